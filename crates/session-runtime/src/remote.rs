//! The runner channel: how a server that runs no engine itself hands its
//! sessions' turn commands to a remote runner (`harness runner`, next to
//! the sandboxes), and hears back about the ones it could not perform.
//!
//! The runner opens `GET /v1/runner?generation=G` (WebSocket, a runner or
//! host token for every session). The server sends, on attach, the pending
//! commands of every session whose meta shows a running turn, then each
//! new command as its actor stores a prompt, an answer or an abort
//! ([`ToRunner`]). The runner performs them with core's `SessionRuntime` on
//! its own engine (in order per session, like [`EngineDispatcher`]), writes
//! the turns' parts to the server over the per-session runner WebSocket as
//! generation G, and reports starts and aborts it could not perform
//! ([`FromRunner`]). A runner of a newer generation replaces the attached
//! one (and fences its writes, session by session, when it writes).

use std::sync::Arc;

use futures::{SinkExt, StreamExt};
use harness_core::session::{SessionRuntime, TurnCommand};
use harness_core::{Error, Result, SessionId};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::Message;

use crate::dispatch::{Dispatcher, EngineDispatcher, OnFailure};

/// What a server sends on the runner channel.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(
    tag = "type",
    rename_all = "kebab-case",
    rename_all_fields = "camelCase"
)]
pub enum ToRunner {
    /// Perform this command for this session.
    Command {
        /// The session.
        session: SessionId,
        /// The command.
        command: TurnCommand,
    },
}

/// What a runner sends back on the runner channel.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(
    tag = "type",
    rename_all = "kebab-case",
    rename_all_fields = "camelCase"
)]
pub enum FromRunner {
    /// A start or an abort could not be performed: the server records the
    /// turn as failed.
    DispatchFailed {
        /// The session.
        session: SessionId,
        /// The turn.
        turn_id: String,
        /// Why.
        error: String,
    },
}

/// A server's `http(s)://` base as the `ws(s)://` base of its sockets,
/// without a trailing slash.
pub(crate) fn ws_base(base: &str) -> String {
    let base = base.trim_end_matches('/');
    if let Some(rest) = base.strip_prefix("https://") {
        format!("wss://{rest}")
    } else if let Some(rest) = base.strip_prefix("http://") {
        format!("ws://{rest}")
    } else {
        base.to_string()
    }
}

/// The runner channel's URL at a server `base` (`http://host:port`).
pub fn runner_channel_url(base: &str, generation: u64, token: Option<&str>) -> String {
    let base = ws_base(base);
    let mut url = format!("{base}/v1/runner?generation={generation}");
    if let Some(token) = token {
        url.push_str("&access_token=");
        url.push_str(token);
    }
    url
}

/// Serve the runner channel of the server at `base` with `runtime` until
/// the server closes it (a newer runner replaced this one, or the server
/// stopped). Returns why it ended.
pub async fn serve_runner_channel(
    base: &str,
    token: Option<&str>,
    generation: u64,
    runtime: SessionRuntime,
) -> Result<String> {
    let url = runner_channel_url(base, generation, token);
    let (socket, _) = // Small messages, each awaited: no Nagle delay.
        tokio_tungstenite::connect_async_with_config(&url, None, true)
        .await
        .map_err(|e| Error::backend(format!("cannot open the runner channel of {base}: {e}")))?;
    let (mut write, mut read) = socket.split();
    let (reports, mut outgoing) = mpsc::unbounded_channel::<FromRunner>();
    let on_failure: OnFailure = Arc::new(move |session, turn_id, error| {
        let _ = reports.send(FromRunner::DispatchFailed {
            session: session.clone(),
            turn_id,
            error,
        });
    });
    let dispatcher =
        EngineDispatcher::with_failure(runtime, tokio::runtime::Handle::current(), on_failure);
    loop {
        tokio::select! {
            inbound = read.next() => match inbound {
                Some(Ok(Message::Text(text))) => match serde_json::from_str::<ToRunner>(text.as_str()) {
                    Ok(ToRunner::Command { session, command }) => dispatcher.dispatch(&session, command),
                    Err(e) => tracing::warn!("ignoring a runner-channel message: {e}"),
                },
                Some(Ok(Message::Close(frame))) => {
                    return Ok(frame.map(|f| f.reason.to_string()).unwrap_or_else(|| "closed".into()))
                }
                Some(Ok(_)) => {}
                Some(Err(e)) => return Err(Error::backend(format!("the runner channel failed: {e}"))),
                None => return Ok("the server closed the runner channel".into()),
            },
            Some(report) = outgoing.recv() => {
                let text = serde_json::to_string(&report)?;
                if write.send(Message::text(text)).await.is_err() {
                    return Ok("the server closed the runner channel".into());
                }
            }
        }
    }
}
