//! The tool host: the process on the user's own machine that offers tools
//! to a session's agent and runs the calls the session hands it
//! (`harness relay-host`, or [`ToolHost`] in an embedding program).
//!
//! It attaches to one session as [`Role::ToolHost`] (over the session
//! WebSocket of a server, `?role=tool-host`, or in-process through a
//! [`Hub`]), declares its tools, and then runs each [`HostCall`] it
//! receives — at most once per call id, even if the session sent one twice
//! — streaming output back as chunks and ending with one result. A
//! [`ServerMessage::HostCancel`] (deadline passed, turn ended) stops the
//! call: a command is killed. Outcomes are the session's business: the
//! host only reports what ran.

use std::collections::{BTreeMap, HashSet};
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures::{SinkExt, StreamExt};
use harness_core::actor::{ErrorCode, Role, ServerMessage};
use harness_core::relay::{validate_tools, HostCall, HostMessage, ToolSpec};
use harness_core::{Error, Result, SessionId};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot};
use tokio_tungstenite::tungstenite::Message;

use crate::hub::Hub;

/// What a tool produced (after any chunks it streamed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolOutput {
    /// The result text (the rest of it, after the chunks).
    pub output: String,
    /// The tool failed (the agent is told so).
    pub is_error: bool,
    /// How many bytes the tool produced in all, when more than it sent
    /// (it stopped sending at the budget): the session's truncation
    /// marker names this size.
    pub produced_bytes: Option<u64>,
}

impl ToolOutput {
    /// A successful result.
    pub fn ok(output: impl Into<String>) -> Self {
        Self {
            output: output.into(),
            is_error: false,
            produced_bytes: None,
        }
    }

    /// A failed result.
    pub fn error(output: impl Into<String>) -> Self {
        Self {
            output: output.into(),
            is_error: true,
            produced_bytes: None,
        }
    }
}

/// One call as a tool sees it.
#[derive(Debug, Clone)]
pub struct CallContext {
    /// The call id (unique per session).
    pub call_id: String,
    /// Send no more than this many bytes (the session keeps no more).
    pub byte_budget: u64,
    /// Wall-clock deadline (ms since the Unix epoch).
    pub deadline_at_ms: u64,
    chunks: mpsc::UnboundedSender<(String, String)>,
}

impl CallContext {
    /// Stream part of the output now (it is part of the final result).
    pub fn chunk(&self, data: impl Into<String>) {
        let _ = self.chunks.send((self.call_id.clone(), data.into()));
    }
}

/// A tool implemented in Rust.
#[async_trait]
pub trait HostTool: Send + Sync {
    /// Run one call with `input` (the arguments object). Dropped (the
    /// future is not polled again) when the session cancels the call.
    async fn call(&self, input: Value, ctx: CallContext) -> ToolOutput;
}

/// A tool that runs a command: the arguments, as JSON, on its stdin; its
/// stdout is the result (stderr is appended when it fails); a non-zero
/// exit is an error. Killed when the call is cancelled.
#[derive(Debug, Clone)]
pub struct CommandTool {
    /// Program and arguments.
    pub argv: Vec<String>,
    /// Working directory (default: the host's).
    pub cwd: Option<std::path::PathBuf>,
    /// Extra environment.
    pub env: BTreeMap<String, String>,
}

#[async_trait]
impl HostTool for CommandTool {
    async fn call(&self, input: Value, ctx: CallContext) -> ToolOutput {
        let Some((program, args)) = self.argv.split_first() else {
            return ToolOutput::error("the tool's command is empty");
        };
        let mut cmd = tokio::process::Command::new(program);
        cmd.args(args)
            .envs(&self.env)
            .env("HARNESS_CALL_ID", &ctx.call_id)
            .env("HARNESS_BYTE_BUDGET", ctx.byte_budget.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // Cancelling drops this future, and with it the child: killed.
            .kill_on_drop(true);
        if let Some(cwd) = &self.cwd {
            cmd.current_dir(cwd);
        }
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => return ToolOutput::error(format!("cannot start {program:?}: {e}")),
        };
        let mut stdin = child.stdin.take().expect("piped");
        let body = serde_json::to_vec(&input).unwrap_or_default();
        let feed = async move {
            let _ = stdin.write_all(&body).await;
            // Closing stdin tells the tool its input is complete.
            drop(stdin);
        };
        // Stdout streams to the session as it comes, as chunks of whole
        // characters, up to a little past the budget: the session keeps no
        // more, and a tool that prints gigabytes must not fill our memory
        // (the rest is read and counted, not kept).
        let cap = ctx.byte_budget.saturating_add(1);
        let mut stdout = child.stdout.take().expect("piped");
        let chunks = ctx.clone();
        let read_out = async move {
            let mut pending = Vec::new();
            let mut sent = 0u64;
            let mut total = 0u64;
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                match stdout.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        total += n as u64;
                        let room = cap.saturating_sub(sent + pending.len() as u64) as usize;
                        pending.extend_from_slice(&buf[..n.min(room)]);
                        let text = take_utf8(&mut pending, false);
                        if !text.is_empty() {
                            sent += text.len() as u64;
                            chunks.chunk(text);
                        }
                    }
                }
            }
            let rest = take_utf8(&mut pending, true);
            if !rest.is_empty() {
                chunks.chunk(rest);
            }
            total
        };
        let mut stderr = child.stderr.take().expect("piped");
        let read_err = async move {
            let mut s = Vec::new();
            let _ = (&mut stderr).take(16 * 1024).read_to_end(&mut s).await;
            s
        };
        let ((), total, err) = tokio::join!(feed, read_out, read_err);
        let status = child.wait().await;
        let mut output = match status {
            Ok(s) if s.success() => ToolOutput::ok(""),
            Ok(s) => {
                let err = String::from_utf8_lossy(&err);
                ToolOutput::error(format!("{err}\n[{program} exited with {s}]"))
            }
            Err(e) => ToolOutput::error(format!("waiting for {program:?} failed: {e}")),
        };
        output.produced_bytes = Some(total + output.output.len() as u64);
        output
    }
}

/// Take the text at the front of `bytes`: whole UTF-8 characters (an
/// invalid sequence becomes U+FFFD); an incomplete character at the end
/// stays for the next read unless `at_end`.
fn take_utf8(bytes: &mut Vec<u8>, at_end: bool) -> String {
    let mut out = String::new();
    loop {
        match std::str::from_utf8(bytes) {
            Ok(s) => {
                out.push_str(s);
                bytes.clear();
                return out;
            }
            Err(e) => {
                let good = e.valid_up_to();
                out.push_str(std::str::from_utf8(&bytes[..good]).unwrap_or_default());
                match e.error_len() {
                    Some(bad) => {
                        out.push(char::REPLACEMENT_CHARACTER);
                        bytes.drain(..good + bad);
                    }
                    None if at_end => {
                        out.push(char::REPLACEMENT_CHARACTER);
                        bytes.clear();
                        return out;
                    }
                    None => {
                        bytes.drain(..good);
                        return out;
                    }
                }
            }
        }
    }
}

/// A tool from an async closure.
struct FnTool<F>(F);

#[async_trait]
impl<F, Fut> HostTool for FnTool<F>
where
    F: Fn(Value, CallContext) -> Fut + Send + Sync,
    Fut: std::future::Future<Output = ToolOutput> + Send,
{
    async fn call(&self, input: Value, ctx: CallContext) -> ToolOutput {
        (self.0)(input, ctx).await
    }
}

/// What a host reports as it runs (for a terminal or a log).
#[derive(Debug, Clone, PartialEq)]
pub enum HostEvent {
    /// Attached and declared.
    Attached {
        /// The tools offered.
        tools: Vec<String>,
    },
    /// A call finished (or was cancelled: `None`).
    Ran {
        /// The call.
        call_id: String,
        /// The tool.
        tool: String,
        /// Whether it reported an error; `None` when cancelled.
        is_error: Option<bool>,
        /// How long it ran.
        elapsed: Duration,
    },
    /// The session refused something (e.g. a late result).
    Refused {
        /// Why.
        message: String,
    },
}

/// A set of tools and the loop that serves them to one session.
#[derive(Clone, Default)]
pub struct ToolHost {
    tools: Vec<(ToolSpec, Arc<dyn HostTool>)>,
    events: Option<mpsc::UnboundedSender<HostEvent>>,
}

impl std::fmt::Debug for ToolHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ToolHost")
            .field(
                "tools",
                &self.tools.iter().map(|(s, _)| &s.name).collect::<Vec<_>>(),
            )
            .finish()
    }
}

/// How a host is attached: messages in, messages out.
#[async_trait]
trait HostLink: Send {
    async fn send(&mut self, message: &HostMessage) -> Result<()>;
    /// The next message; `None` when the session closed the link.
    async fn recv(&mut self) -> Result<Option<ServerMessage>>;
}

impl ToolHost {
    /// A host with no tools.
    pub fn new() -> Self {
        Self::default()
    }

    /// Offer `tool` as `spec`.
    pub fn tool(mut self, spec: ToolSpec, tool: impl HostTool + 'static) -> Self {
        self.tools.push((spec, Arc::new(tool)));
        self
    }

    /// Offer an async function as `spec`.
    pub fn function<F, Fut>(self, spec: ToolSpec, f: F) -> Self
    where
        F: Fn(Value, CallContext) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = ToolOutput> + Send + 'static,
    {
        self.tool(spec, FnTool(f))
    }

    /// Report [`HostEvent`]s on `events`.
    pub fn with_events(mut self, events: mpsc::UnboundedSender<HostEvent>) -> Self {
        self.events = Some(events);
        self
    }

    /// The tools offered.
    pub fn specs(&self) -> Vec<ToolSpec> {
        self.tools.iter().map(|(s, _)| s.clone()).collect()
    }

    /// Serve `session` of the server at `base` (`http://host:port`) with a
    /// `tool-host` token, until the session closes the socket. `takeover`
    /// replaces a host already attached (its calls out end `ambiguous`).
    pub async fn serve_ws(
        &self,
        base: &str,
        session: &SessionId,
        token: Option<&str>,
        takeover: bool,
    ) -> Result<()> {
        let base = base.trim_end_matches('/');
        let ws_base = if let Some(rest) = base.strip_prefix("https://") {
            format!("wss://{rest}")
        } else if let Some(rest) = base.strip_prefix("http://") {
            format!("ws://{rest}")
        } else {
            base.to_string()
        };
        let mut url = format!("{ws_base}/v1/sessions/{session}/ws?role=tool-host");
        if takeover {
            url.push_str("&takeover=true");
        }
        if let Some(token) = token {
            url.push_str("&access_token=");
            url.push_str(token);
        }
        let (socket, _) = // Small messages, each awaited: no Nagle delay.
        tokio_tungstenite::connect_async_with_config(&url, None, true).await.map_err(|e| {
            Error::backend(format!(
                "cannot attach to {base} as the tool host of {session}: {e}"
            ))
        })?;
        self.serve(WsHostLink(socket)).await
    }

    /// Serve `session` in-process through `hub`.
    pub async fn serve_hub(
        &self,
        hub: &Arc<Hub>,
        session: &SessionId,
        takeover: bool,
    ) -> Result<()> {
        let conn = hub
            .connect(session, Role::ToolHost { takeover }, None)
            .await?;
        self.serve(HubHostLink(conn)).await
    }

    fn event(&self, event: HostEvent) {
        if let Some(tx) = &self.events {
            let _ = tx.send(event);
        }
    }

    async fn serve(&self, mut link: impl HostLink) -> Result<()> {
        let specs = self.specs();
        validate_tools(&specs).map_err(Error::invalid)?;
        link.send(&HostMessage::Declare {
            tools: specs.clone(),
        })
        .await?;
        // The declaration's answer tells whether we hold the lease.
        loop {
            match link.recv().await? {
                Some(ServerMessage::Received {}) => break,
                Some(ServerMessage::Error { code, message }) => {
                    return Err(code.into_error(message));
                }
                Some(_) => {}
                None => return Err(Error::backend("the session closed the tool-host link")),
            }
        }
        self.event(HostEvent::Attached {
            tools: specs.iter().map(|s| s.name.clone()).collect(),
        });
        let by_name: BTreeMap<String, Arc<dyn HostTool>> = self
            .tools
            .iter()
            .map(|(s, t)| (s.name.clone(), t.clone()))
            .collect();
        // Every call id ever started here: the session never sends one
        // twice, and this makes sure of it on our side too.
        let mut started: HashSet<String> = HashSet::new();
        let mut cancels: BTreeMap<String, oneshot::Sender<()>> = BTreeMap::new();
        let (done_tx, mut done_rx) = mpsc::unbounded_channel::<(String, Option<ToolOutput>)>();
        let (chunk_tx, mut chunk_rx) = mpsc::unbounded_channel::<(String, String)>();
        loop {
            tokio::select! {
                message = link.recv() => match message? {
                    None => return Ok(()),
                    Some(ServerMessage::HostCall { call }) => {
                        if !started.insert(call.call_id.clone()) {
                            tracing::warn!(call = %call.call_id, "a call id came twice; not running it again");
                            continue;
                        }
                        let Some(tool) = by_name.get(&call.tool).cloned() else {
                            // The session only sends declared tools; answer anyway.
                            let out = ToolOutput::error(format!("this host has no tool {:?}", call.tool));
                            // (no chunks were sent for it)
                            let _ = done_tx.send((call.call_id.clone(), Some(out)));
                            continue;
                        };
                        let (cancel_tx, cancel_rx) = oneshot::channel();
                        cancels.insert(call.call_id.clone(), cancel_tx);
                        self.spawn_call(call, tool, cancel_rx, done_tx.clone(), chunk_tx.clone());
                    }
                    Some(ServerMessage::HostCancel { call_id, reason }) => {
                        tracing::info!(call = %call_id, "cancelled by the session: {reason}");
                        if let Some(cancel) = cancels.remove(&call_id) {
                            let _ = cancel.send(());
                        }
                    }
                    Some(ServerMessage::Error { code, message }) => {
                        if code == ErrorCode::HostLeaseHeld {
                            return Err(code.into_error(message));
                        }
                        self.event(HostEvent::Refused { message });
                    }
                    Some(_) => {}
                },
                Some((call_id, data)) = chunk_rx.recv() => {
                    link.send(&HostMessage::Chunk { call_id, data }).await?;
                }
                Some((call_id, output)) = done_rx.recv() => {
                    cancels.remove(&call_id);
                    // Chunks sent before the result are already queued in
                    // order: drain them first.
                    while let Ok((id, data)) = chunk_rx.try_recv() {
                        link.send(&HostMessage::Chunk { call_id: id, data }).await?;
                    }
                    if let Some(output) = output {
                        link.send(&HostMessage::Result {
                            call_id,
                            output: output.output,
                            is_error: output.is_error,
                            produced_bytes: output.produced_bytes,
                        })
                        .await?;
                    }
                }
            }
        }
    }

    fn spawn_call(
        &self,
        call: HostCall,
        tool: Arc<dyn HostTool>,
        cancel: oneshot::Receiver<()>,
        done: mpsc::UnboundedSender<(String, Option<ToolOutput>)>,
        chunks: mpsc::UnboundedSender<(String, String)>,
    ) {
        let events = self.events.clone();
        tokio::spawn(async move {
            let started = Instant::now();
            let ctx = CallContext {
                call_id: call.call_id.clone(),
                byte_budget: call.byte_budget,
                deadline_at_ms: call.deadline_at_ms,
                chunks,
            };
            let output = tokio::select! {
                out = tool.call(call.input, ctx) => Some(out),
                _ = cancel => None,
            };
            if let Some(tx) = events {
                let _ = tx.send(HostEvent::Ran {
                    call_id: call.call_id.clone(),
                    tool: call.tool.clone(),
                    is_error: output.as_ref().map(|o| o.is_error),
                    elapsed: started.elapsed(),
                });
            }
            let _ = done.send((call.call_id, output));
        });
    }
}

struct HubHostLink(crate::hub::Connection);

#[async_trait]
impl HostLink for HubHostLink {
    async fn send(&mut self, message: &HostMessage) -> Result<()> {
        self.0.tool_host(message.clone());
        Ok(())
    }

    async fn recv(&mut self) -> Result<Option<ServerMessage>> {
        Ok(self.0.recv().await.and_then(|out| out.into_message().ok()))
    }
}

type WsStream =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

struct WsHostLink(WsStream);

#[async_trait]
impl HostLink for WsHostLink {
    async fn send(&mut self, message: &HostMessage) -> Result<()> {
        let text = serde_json::to_string(message)?;
        self.0
            .send(Message::text(text))
            .await
            .map_err(|e| Error::backend(format!("the tool-host socket failed: {e}")))
    }

    async fn recv(&mut self) -> Result<Option<ServerMessage>> {
        while let Some(msg) = self.0.next().await {
            match msg.map_err(|e| Error::backend(format!("the tool-host socket failed: {e}")))? {
                Message::Text(t) => match serde_json::from_str::<ServerMessage>(t.as_str()) {
                    Ok(m) => return Ok(Some(m)),
                    Err(e) => tracing::warn!("ignoring a message the session sent: {e}"),
                },
                Message::Close(frame) => {
                    if let Some(f) = frame {
                        tracing::info!("the session closed the tool-host link: {}", f.reason);
                    }
                    return Ok(None);
                }
                _ => {}
            }
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::take_utf8;

    #[test]
    fn text_is_taken_in_whole_characters() {
        // "é" is C3 A9: a read that ends between them keeps C3 for later.
        let mut bytes = b"caf\xC3".to_vec();
        assert_eq!(take_utf8(&mut bytes, false), "caf");
        assert_eq!(bytes, b"\xC3");
        bytes.extend_from_slice(b"\xA9!");
        assert_eq!(take_utf8(&mut bytes, false), "\u{e9}!");
        assert!(bytes.is_empty());
        // Invalid bytes become U+FFFD; an unfinished character at the end
        // of the output too.
        let mut bytes = b"a\xFFb\xE2\x82".to_vec();
        assert_eq!(take_utf8(&mut bytes, false), "a\u{fffd}b");
        assert_eq!(take_utf8(&mut bytes, true), "\u{fffd}");
        assert!(bytes.is_empty());
    }
}
