//! What crosses the actor's edge: the messages clients, runners and tool
//! hosts send and receive on the wire, and the [`Input`]s and [`Output`]s
//! of the machine itself.

use serde::{Deserialize, Serialize};

use crate::frame::{Frame, FrameBody};
use crate::log::AppendRequest;
use crate::part::StreamPart;
use crate::relay::{HostCall, HostCallRequest, HostMessage, ToolSpec};
use crate::sandbox::SandboxHandle;
use crate::session::TurnCommand;
use crate::turn::TurnStatus;
use crate::{Error, ErrorKind};

/// A connection, numbered by the wrapper.
pub type ConnId = u64;

/// Who is on the other end of a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "role", rename_all = "snake_case")]
pub enum Role {
    /// A front end: sends prompts and answers, reads frames.
    Client,
    /// The runner of turns, fenced by generation.
    Runner {
        /// Its generation.
        generation: u64,
    },
    /// The session's tool host (`harness relay-host`): offers tools, runs
    /// the calls the actor hands it. One at a time: a second host is
    /// refused (`host_lease_held`) unless it asks to take over.
    ToolHost {
        /// Replace the attached host (its calls still out end
        /// `ambiguous`) instead of being refused.
        #[serde(default)]
        takeover: bool,
    },
}

/// What a client may send.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(
    tag = "type",
    rename_all = "kebab-case",
    rename_all_fields = "camelCase"
)]
pub enum ClientMessage {
    /// A prompt starting a turn.
    Prompt {
        /// The prompt.
        text: String,
        /// Optional client-chosen turn id.
        #[serde(default)]
        turn_id: Option<String>,
        /// Optional idempotency key (a retried send stores nothing twice).
        #[serde(default)]
        key: Option<String>,
    },
    /// An answer to a permission request of the running turn.
    ApprovalResponse {
        /// The request.
        approval_id: String,
        /// Allow or deny.
        approved: bool,
        /// Optional reason.
        #[serde(default)]
        reason: Option<String>,
    },
    /// Abort the running turn (it ends `failed` with `aborted: <reason>`).
    Abort {
        /// The turn (default: the running one); another id is refused.
        #[serde(default)]
        turn_id: Option<String>,
        /// Why.
        #[serde(default)]
        reason: Option<String>,
    },
    /// Close the session for writing.
    Seal {},
    /// Put the session back to the end of an earlier turn, in place: its
    /// next turn runs in a new sandbox holding that turn's checkpoint (tree
    /// and agent state). The log keeps its history and records the rewind.
    /// Refused while a turn runs, or for a turn with no checkpoint.
    Rewind {
        /// The turn whose end to go back to.
        turn_id: String,
    },
}

/// What the runner may send.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(
    tag = "type",
    rename_all = "kebab-case",
    rename_all_fields = "camelCase"
)]
pub enum RunnerMessage {
    /// A stream part of a turn.
    Part {
        /// The turn.
        turn_id: String,
        /// The part.
        part: StreamPart,
        /// Idempotency key, e.g. derived from the spool offset.
        #[serde(default)]
        key: Option<String>,
    },
    /// The turn's agent calls a host tool. The one answer is the
    /// [`FrameBody::HostOutcome`] frame (sent once the outcome is stored,
    /// however long the host takes); a repeated call id gets the recorded
    /// one.
    HostCall {
        /// The turn.
        turn_id: String,
        /// The call.
        call: HostCallRequest,
    },
    /// Which tools the attached host offers (answered with
    /// [`ServerMessage::HostTools`]; empty when no host is attached).
    HostTools {},
    /// A turn changed status.
    TurnStatus {
        /// The turn.
        turn_id: String,
        /// The status.
        status: TurnStatus,
        /// Error text.
        #[serde(default)]
        error: Option<String>,
        /// A stable name for why, where there is one (`budget_exceeded`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        code: Option<String>,
        /// The sandbox the turn runs in, for the session's next turn.
        #[serde(default)]
        sandbox: Option<SandboxHandle>,
        /// The agent's own session id, for the session's next turn.
        #[serde(default)]
        agent_session_id: Option<String>,
        /// The turn-end checkpoint taken (terminal status only).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        checkpoint: Option<String>,
        /// Idempotency key.
        #[serde(default)]
        key: Option<String>,
    },
}

impl RunnerMessage {
    /// A part of `turn_id` keyed by `key` (stable across retries).
    pub fn keyed_part(turn_id: &str, part: StreamPart, key: String) -> Self {
        RunnerMessage::Part {
            turn_id: turn_id.to_string(),
            part,
            key: Some(key),
        }
    }

    /// The turn-status message a runner sends for `state` (its status,
    /// error, sandbox and agent session, keyed by
    /// [`TurnState::status_key`](crate::turn::TurnState::status_key)).
    pub fn turn_status_of(state: &crate::turn::TurnState) -> Self {
        RunnerMessage::TurnStatus {
            turn_id: state.turn_id.clone(),
            status: state.status,
            error: state.error.clone(),
            code: state.error_code.clone(),
            sandbox: state.sandbox.clone(),
            agent_session_id: state.agent_session_id.clone(),
            checkpoint: state
                .status
                .is_terminal()
                .then(|| state.checkpoint.clone())
                .flatten(),
            key: Some(state.status_key()),
        }
    }
}

/// Why the actor refused a message. Stable on the wire (snake_case), and
/// typed so a driver maps it to an [`ErrorKind`] (or an HTTP status)
/// without parsing text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// A newer runner generation is attached; this runner must stop.
    StaleRunner,
    /// The session is sealed; fork it to continue.
    Sealed,
    /// The frame is over the size limit.
    FrameTooLarge,
    /// Only the runner sends stream parts.
    NotARunner,
    /// Only clients send prompts and answers.
    NotAClient,
    /// The message is malformed or breaks a rule.
    Invalid,
    /// A turn is running; the prompt was not stored.
    TurnInProgress,
    /// No turn is running to answer or abort.
    NoActiveTurn,
    /// The log refused the write as conflicting (e.g. an idempotency key
    /// reused for other content).
    Conflict,
    /// The log failed to store the write.
    AppendFailed,
    /// Stored frames could not be read back for a replay.
    ReplayFailed,
    /// The frames asked for were removed by retention (a replay resuming
    /// inside a trimmed log's cut).
    Gone,
    /// The session does not exist (said by a transport before the actor).
    NotFound,
    /// No valid token (said by a transport).
    Unauthorized,
    /// The token does not allow this (said by a transport).
    Forbidden,
    /// The service could not answer in time or went away.
    Unavailable,
    /// Another tool host holds the session's host lease.
    HostLeaseHeld,
    /// Only the tool host sends declarations and results.
    NotAHost,
    /// A code this version does not know.
    #[serde(other)]
    Other,
}

impl ErrorCode {
    /// The snake_case name.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::StaleRunner => "stale_runner",
            ErrorCode::Sealed => "sealed",
            ErrorCode::FrameTooLarge => "frame_too_large",
            ErrorCode::NotARunner => "not_a_runner",
            ErrorCode::NotAClient => "not_a_client",
            ErrorCode::Invalid => "invalid",
            ErrorCode::TurnInProgress => "turn_in_progress",
            ErrorCode::NoActiveTurn => "no_active_turn",
            ErrorCode::Conflict => "conflict",
            ErrorCode::AppendFailed => "append_failed",
            ErrorCode::ReplayFailed => "replay_failed",
            ErrorCode::Gone => "gone",
            ErrorCode::NotFound => "not_found",
            ErrorCode::Unauthorized => "unauthorized",
            ErrorCode::Forbidden => "forbidden",
            ErrorCode::Unavailable => "unavailable",
            ErrorCode::HostLeaseHeld => "host_lease_held",
            ErrorCode::NotAHost => "not_a_host",
            ErrorCode::Other => "other",
        }
    }

    /// The code named `name` ([`ErrorCode::Other`] when unknown).
    pub fn from_name(name: &str) -> Self {
        serde_json::from_value(serde_json::Value::String(name.to_string()))
            .unwrap_or(ErrorCode::Other)
    }

    /// The error kind a caller sees.
    pub fn kind(self) -> ErrorKind {
        match self {
            ErrorCode::StaleRunner => ErrorKind::Fenced,
            ErrorCode::Sealed
            | ErrorCode::TurnInProgress
            | ErrorCode::NoActiveTurn
            | ErrorCode::Conflict
            | ErrorCode::HostLeaseHeld => ErrorKind::Conflict,
            ErrorCode::FrameTooLarge | ErrorCode::Invalid => ErrorKind::InvalidInput,
            ErrorCode::NotARunner
            | ErrorCode::NotAClient
            | ErrorCode::NotAHost
            | ErrorCode::Unauthorized
            | ErrorCode::Forbidden => ErrorKind::Unauthorized,
            ErrorCode::NotFound => ErrorKind::NotFound,
            ErrorCode::Gone => ErrorKind::Gone,
            ErrorCode::AppendFailed
            | ErrorCode::ReplayFailed
            | ErrorCode::Unavailable
            | ErrorCode::Other => ErrorKind::Backend,
        }
    }

    /// An [`Error`] of this code's kind.
    pub fn into_error(self, message: impl Into<String>) -> Error {
        Error::new(self.kind(), message)
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What the actor sends on a connection.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(
    tag = "type",
    rename_all = "kebab-case",
    rename_all_fields = "camelCase"
)]
pub enum ServerMessage {
    /// A stored frame.
    Frame {
        /// The frame.
        frame: Frame,
    },
    /// A live, unstored part (text/reasoning deltas, or the partial text of a
    /// block in progress for a client that just connected).
    Live {
        /// The turn.
        turn_id: String,
        /// The part.
        part: StreamPart,
    },
    /// The runner's live part (a text or reasoning start or delta) was
    /// fanned out; it is not stored by itself (its block is, on its end).
    /// With [`ServerMessage::Ack`] and [`ServerMessage::Error`] this makes
    /// one answer for every runner message, so a runner knows when the
    /// actor has taken each one.
    Received {},
    /// The sender's write was stored (or was a duplicate).
    Ack {
        /// Seq of the stored frame.
        seq: u64,
        /// True if an idempotency key matched an earlier write.
        duplicate: bool,
        /// The turn a stored prompt opened (its id may have been assigned
        /// by the actor), so the client can follow it without reading the
        /// log back.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        turn_id: Option<String>,
    },
    /// To the tool host: run this call (once; a repeated call id never
    /// comes again). Answer with [`HostMessage::Result`].
    HostCall {
        /// The call.
        call: HostCall,
    },
    /// To the tool host: stop this call (its deadline passed or its turn
    /// ended); a result sent later is dropped.
    HostCancel {
        /// The call.
        call_id: String,
        /// Why.
        reason: String,
    },
    /// To a runner: the tools of the attached host.
    HostTools {
        /// The tools (empty when no host is attached).
        tools: Vec<ToolSpec>,
    },
    /// The sender's message was refused; nothing was stored.
    Error {
        /// Why.
        code: ErrorCode,
        /// What happened and what to do.
        message: String,
    },
}

impl ServerMessage {
    /// Whether this answers the one message a runner or tool host sent:
    /// `ack`, `received`, `host-tools`, or a host call's outcome frame
    /// (the only frames such a connection receives). Errors answer too;
    /// a transport reports them as refusals.
    pub fn is_reply(&self) -> bool {
        match self {
            ServerMessage::Ack { .. }
            | ServerMessage::Received {}
            | ServerMessage::HostTools { .. } => true,
            ServerMessage::Frame { frame } => matches!(frame.body, FrameBody::HostOutcome { .. }),
            _ => false,
        }
    }

    /// A refusal.
    pub fn error(code: ErrorCode, message: impl Into<String>) -> Self {
        ServerMessage::Error {
            code,
            message: message.into(),
        }
    }
}

/// Something that happened.
#[derive(Debug, Clone, PartialEq)]
pub enum Input {
    /// A connection opened. `after` asks for a replay of frames with
    /// `seq > after` before live frames (None: live frames only).
    Connect {
        /// The connection.
        conn: ConnId,
        /// Its role.
        role: Role,
        /// Replay cursor.
        after: Option<u64>,
    },
    /// A connection closed.
    Disconnect {
        /// The connection.
        conn: ConnId,
    },
    /// A client's message.
    Client {
        /// The connection.
        conn: ConnId,
        /// The message.
        message: ClientMessage,
    },
    /// A runner's message.
    Runner {
        /// The connection.
        conn: ConnId,
        /// The message.
        message: RunnerMessage,
    },
    /// The tool host's message.
    ToolHost {
        /// The connection.
        conn: ConnId,
        /// The message.
        message: HostMessage,
    },
    /// The time now (ms since the Unix epoch). The wrapper feeds it at
    /// least as often as [`SessionActor::next_deadline`] asks: host calls
    /// past their deadline end `timeout` on it.
    Tick {
        /// Now.
        now_ms: u64,
    },
    /// The result of the oldest [`Output::Append`] still pending.
    Appended {
        /// The frame as stored (with its seq).
        frame: Frame,
        /// True if the log found the idempotency key already used.
        duplicate: bool,
    },
    /// The oldest pending append failed.
    AppendFailed {
        /// What kind of failure (a `Conflict` is the writer's, the rest the log's).
        kind: ErrorKind,
        /// Why.
        error: String,
    },
    /// The host could not perform a [`TurnCommand::Start`] (engine down,
    /// unknown agent, …): the turn is recorded as failed so the session can
    /// take its next prompt.
    DispatchFailed {
        /// The turn.
        turn_id: String,
        /// Why.
        error: String,
    },
}

/// Something the wrapper must do, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Output {
    /// Append to the log, then feed back [`Input::Appended`] or
    /// [`Input::AppendFailed`] before any other input.
    Append(AppendRequest),
    /// Send stored frames `after < seq <= until` to `conn`, read from the log.
    Replay {
        /// The connection.
        conn: ConnId,
        /// Exclusive lower bound.
        after: u64,
        /// Inclusive upper bound.
        until: u64,
    },
    /// Send a message on a connection.
    Send {
        /// The connection.
        conn: ConnId,
        /// The message.
        message: ServerMessage,
    },
    /// Send one message to each of `conns`, in that order (a stored frame
    /// or a live part fanned out to every client): the same as a `Send` per
    /// connection, but the message is made once, so a transport can share
    /// it (and its encoding) between the connections instead of copying it.
    SendAll {
        /// The connections.
        conns: Vec<ConnId>,
        /// The message.
        message: ServerMessage,
    },
    /// Close a connection.
    Close {
        /// The connection.
        conn: ConnId,
        /// Why.
        reason: String,
    },
    /// A stored client message asks for an engine call: perform it (or
    /// hand it to the runner that runs this session's turns).
    Dispatch(TurnCommand),
}
