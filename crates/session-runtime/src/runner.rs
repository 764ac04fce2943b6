//! The runner side: where a slice's parts go. [`RunnerSink`] is core's
//! [`PartSink`] writing *as the session's runner*, fenced by generation,
//! through a [`RunnerConnector`]: [`HubConnector`] in-process (the engine
//! runs inside `harness serve`, `harness run` or an embedding program) or
//! [`WsConnector`] over the runner WebSocket of a remote server (a Temporal
//! worker, a `harness runner` next to the sandbox).
//!
//! Each write waits for the actor's acknowledgement, so a slice never
//! advances its cursor past a part that was not stored. Writes of one
//! session go one at a time over one link; the link is dropped when the
//! turn's end is recorded, so an idle session's actor can stop.
//!
//! Fencing: once the actor refuses a write with `stale_runner` (a newer
//! generation attached) or closes the link for that reason, every later
//! write for that session fails at once with `ErrorKind::Fenced` — the
//! sink never reconnects under a fenced generation — and the engine stops
//! the turn without touching anything (`TurnAction::Stop`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use futures::{SinkExt, StreamExt};
use harness_core::actor::{ErrorCode, Role, RunnerMessage, ServerMessage};
use harness_core::part::StreamPart;
use harness_core::relay::{HostCallRequest, HostOutcome, ToolSpec};
use harness_core::slice::PartSink;
use harness_core::turn::TurnState;
use harness_core::{Error, ErrorKind, Result, SessionId};
use harness_core::{Frame, FrameBody};
use tokio_tungstenite::tungstenite::Message;

use crate::hub::{AnswerError, Connection, Hub};

/// How long a runner write waits for the actor's acknowledgement.
pub const ACK_TIMEOUT: Duration = Duration::from_secs(60);

/// A runner's link to one session's actor: send a message, get its reply.
#[async_trait]
pub trait RunnerLink: Send {
    /// Send `message` and wait up to `timeout` for its reply: `Ack` or
    /// `Received` once stored, `HostTools`, or a host call's outcome frame
    /// (a refusal is an error).
    async fn send(&mut self, message: RunnerMessage, timeout: Duration) -> Result<ServerMessage>;
}

/// Opens [`RunnerLink`]s.
#[async_trait]
pub trait RunnerConnector: Send + Sync + std::fmt::Debug {
    /// Attach to `session` as runner `generation`.
    async fn attach(&self, session: &SessionId, generation: u64) -> Result<Box<dyn RunnerLink>>;
}

/// What a refused or lost write means for the runner.
fn refusal(e: AnswerError) -> Error {
    match e {
        AnswerError::Refused {
            code: ErrorCode::StaleRunner,
            message,
        } => Error::fenced(message),
        other => Error::from(other),
    }
}

/// Links through an in-process [`Hub`].
#[derive(Debug, Clone)]
pub struct HubConnector {
    hub: Arc<Hub>,
}

impl HubConnector {
    /// Runner links to `hub`'s actors.
    pub fn new(hub: Arc<Hub>) -> Self {
        Self { hub }
    }
}

struct HubLink(Connection);

#[async_trait]
impl RunnerLink for HubLink {
    async fn send(&mut self, message: RunnerMessage, timeout: Duration) -> Result<ServerMessage> {
        self.0.runner(message);
        self.0.reply(timeout).await.map_err(refusal)
    }
}

#[async_trait]
impl RunnerConnector for HubConnector {
    async fn attach(&self, session: &SessionId, generation: u64) -> Result<Box<dyn RunnerLink>> {
        let conn = self
            .hub
            .connect(session, Role::Runner { generation }, None)
            .await?;
        Ok(Box::new(HubLink(conn)))
    }
}

/// Links over the runner WebSocket of a session server
/// (`GET /v1/sessions/{id}/ws?role=runner&generation=G`) — or of any of
/// several nodes serving one log (`docs/scale.md`): an attach tries them in
/// turn from the last that answered, so a runner outlives a node.
#[derive(Debug)]
pub struct WsConnector {
    bases: Vec<String>,
    token: Option<String>,
    /// The node the last attach reached.
    preferred: std::sync::atomic::AtomicUsize,
}

impl Clone for WsConnector {
    fn clone(&self) -> Self {
        Self {
            bases: self.bases.clone(),
            token: self.token.clone(),
            preferred: std::sync::atomic::AtomicUsize::new(
                self.preferred.load(std::sync::atomic::Ordering::Relaxed),
            ),
        }
    }
}

impl WsConnector {
    /// Links to the server at `base` (`http://host:port`), authenticated
    /// with a runner (or host) `token`.
    pub fn new(base: impl Into<String>, token: Option<String>) -> Self {
        Self::with_nodes(vec![base.into()], token)
    }

    /// Links to whichever of `bases` — nodes over one log — answers.
    /// Panics on an empty list.
    pub fn with_nodes(bases: Vec<String>, token: Option<String>) -> Self {
        assert!(!bases.is_empty(), "a runner needs a server to write to");
        Self {
            bases: bases
                .into_iter()
                .map(|b| b.trim_end_matches('/').to_string())
                .collect(),
            token,
            preferred: std::sync::atomic::AtomicUsize::new(0),
        }
    }

    fn url(&self, base: &str, session: &SessionId, generation: u64) -> String {
        let base = crate::remote::ws_base(base);
        let mut url =
            format!("{base}/v1/sessions/{session}/ws?role=runner&generation={generation}");
        if let Some(token) = &self.token {
            url.push_str("&access_token=");
            url.push_str(token);
        }
        url
    }
}

type WsStream =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

struct WsLink(WsStream);

#[async_trait]
impl RunnerLink for WsLink {
    async fn send(&mut self, message: RunnerMessage, timeout: Duration) -> Result<ServerMessage> {
        let text = serde_json::to_string(&message)?;
        self.0
            .send(Message::text(text))
            .await
            .map_err(|e| Error::backend(format!("the runner socket failed: {e}")))?;
        let wait = async {
            while let Some(msg) = self.0.next().await {
                let msg =
                    msg.map_err(|e| Error::backend(format!("the runner socket failed: {e}")))?;
                match msg {
                    Message::Text(t) => match serde_json::from_str::<ServerMessage>(t.as_str()) {
                        Ok(m) if m.is_reply() => return Ok(m),
                        Ok(ServerMessage::Error { code, message }) => {
                            return Err(refusal(AnswerError::Refused { code, message }))
                        }
                        _ => {}
                    },
                    Message::Close(frame) => {
                        let reason = frame
                            .map(|f| f.reason.to_string())
                            .unwrap_or_else(|| "closed".into());
                        return Err(refusal(AnswerError::Closed(reason)));
                    }
                    _ => {}
                }
            }
            Err(Error::backend("the runner socket closed"))
        };
        tokio::time::timeout(timeout, wait)
            .await
            .unwrap_or_else(|_| Err(Error::from(AnswerError::TimedOut)))
    }
}

#[async_trait]
impl RunnerConnector for WsConnector {
    async fn attach(&self, session: &SessionId, generation: u64) -> Result<Box<dyn RunnerLink>> {
        use std::sync::atomic::Ordering;
        let first = self.preferred.load(Ordering::Relaxed);
        let mut failures = Vec::new();
        for k in 0..self.bases.len() {
            let at = (first + k) % self.bases.len();
            let base = &self.bases[at];
            let url = self.url(base, session, generation);
            // Small messages, each awaited: no Nagle delay.
            match tokio_tungstenite::connect_async_with_config(&url, None, true).await {
                Ok((socket, _)) => {
                    self.preferred.store(at, Ordering::Relaxed);
                    return Ok(Box::new(WsLink(socket)));
                }
                Err(e) => failures.push(format!("{base}: {e}")),
            }
        }
        Err(Error::backend(format!(
            "cannot attach as runner of {session}: {}",
            failures.join("; ")
        )))
    }
}

#[derive(Default)]
struct Slot {
    link: Option<Box<dyn RunnerLink>>,
    fenced: Option<String>,
}

/// Core's [`PartSink`] as the session's runner. See the module docs.
#[derive(Debug, Clone)]
pub struct RunnerSink {
    connector: Arc<dyn RunnerConnector>,
    generation: u64,
    slots: Arc<Mutex<HashMap<SessionId, Arc<tokio::sync::Mutex<Slot>>>>>,
}

impl std::fmt::Debug for Slot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Slot")
            .field("linked", &self.link.is_some())
            .field("fenced", &self.fenced)
            .finish()
    }
}

impl RunnerSink {
    /// Write through `connector` as runner `generation` (use something
    /// that grows across restarts, e.g. the start time in milliseconds).
    pub fn new(connector: Arc<dyn RunnerConnector>, generation: u64) -> Self {
        Self {
            connector,
            generation,
            slots: Arc::default(),
        }
    }

    /// The generation this sink writes as.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    fn slot(&self, session: &SessionId) -> Arc<tokio::sync::Mutex<Slot>> {
        self.slots
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(session.clone())
            .or_default()
            .clone()
    }

    async fn send(&self, session: &str, message: RunnerMessage, release: bool) -> Result<()> {
        self.request(session, message, release, ACK_TIMEOUT)
            .await
            .map(|_| ())
    }

    /// Send `message` on the session's link (attaching first) and return
    /// the actor's reply.
    async fn request(
        &self,
        session: &str,
        message: RunnerMessage,
        release: bool,
        timeout: Duration,
    ) -> Result<ServerMessage> {
        let session = SessionId::parse(session)?;
        let slot = self.slot(&session);
        let mut slot = slot.lock().await;
        if let Some(why) = &slot.fenced {
            return Err(Error::fenced(why.clone()));
        }
        if slot.link.is_none() {
            slot.link = Some(self.connector.attach(&session, self.generation).await?);
        }
        let link = slot.link.as_mut().expect("attached above");
        let result = link.send(message, timeout).await;
        match &result {
            Err(e) if e.kind() == ErrorKind::Fenced => {
                tracing::warn!(%session, generation = self.generation, "runner fenced: {}", e.message());
                slot.fenced = Some(e.message().to_string());
                slot.link = None;
            }
            // A lost link is reopened by the next write (the slice retries).
            Err(_) => slot.link = None,
            Ok(_) if release => slot.link = None,
            Ok(_) => {}
        }
        result
    }
}

#[async_trait]
impl PartSink for RunnerSink {
    async fn emit(
        &self,
        session_id: &str,
        turn_id: &str,
        part: StreamPart,
        key: String,
    ) -> Result<()> {
        let message = RunnerMessage::keyed_part(turn_id, part, key);
        self.send(session_id, message, false).await
    }

    async fn turn_status(&self, state: &TurnState) -> Result<()> {
        let message = RunnerMessage::turn_status_of(state);
        // The turn is over: let go of the actor so an idle session stops.
        self.send(&state.session_id, message, state.status.is_terminal())
            .await
    }

    async fn host_call(
        &self,
        session_id: &str,
        turn_id: &str,
        call: HostCallRequest,
    ) -> Result<HostOutcome> {
        // The session answers by the call's deadline at the latest (it
        // records a timeout then); the margin covers the trip.
        let timeout = Duration::from_millis(call.timeout()) + ACK_TIMEOUT;
        let call_id = call.call_id.clone();
        let message = RunnerMessage::HostCall {
            turn_id: turn_id.to_string(),
            call,
        };
        match self.request(session_id, message, false, timeout).await? {
            ServerMessage::Frame {
                frame:
                    Frame {
                        body:
                            FrameBody::HostOutcome {
                                call_id: answered,
                                outcome,
                                ..
                            },
                        ..
                    },
            } if answered == call_id => Ok(outcome),
            other => Err(Error::backend(format!(
                "the session answered host call {call_id} with {other:?}"
            ))),
        }
    }

    async fn host_tools(&self, session_id: &str) -> Result<Vec<ToolSpec>> {
        match self
            .request(session_id, RunnerMessage::HostTools {}, false, ACK_TIMEOUT)
            .await?
        {
            ServerMessage::HostTools { tools } => Ok(tools),
            other => Err(Error::backend(format!(
                "the session answered a host-tools request with {other:?}"
            ))),
        }
    }
}
