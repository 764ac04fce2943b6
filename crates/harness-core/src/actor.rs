//! The session actor as a sans-IO state machine.
//!
//! One actor owns one session. It is fed [`Input`]s (connections, client and
//! runner messages, and the results of the appends it asked for) and answers
//! with [`Output`]s (append this, replay that range to a connection, send a
//! message, close a connection). The async wrapper — a tokio task natively,
//! a Durable Object on Cloudflare — performs the outputs in order and feeds
//! append results back before taking the next input, so the machine never
//! sees two things at once and needs no locks.
//!
//! Rules it enforces:
//! - every stored frame gets its seq from the log and is pushed to every
//!   client in seq order (`append_and_fanout`);
//! - text and reasoning deltas go to live clients at once but are stored
//!   once, as one [`FrameBody::Message`], when the block ends; a client that
//!   connects mid-block receives the partial text;
//! - exactly one runner: a runner attaching with a higher generation fences
//!   the attached one, whose later messages are refused; a lower generation
//!   is refused outright;
//! - a sealed session refuses every write; oversized frames are refused;
//!   nothing is stored on a refusal;
//! - one turn at a time: a prompt opens a turn (its id assigned here when
//!   the client names none), a second prompt while it runs is refused
//!   (`turn_in_progress`), answers and aborts go to the running turn;
//! - once a prompt, an answer or an abort is stored, the actor asks its
//!   host for the matching engine call ([`Output::Dispatch`]); the host
//!   performs it (`SessionRuntime`) or hands it to a remote runner.
//!
//! The actor's durable state is the log's [`SessionMeta`]: it is folded
//! from each stored frame (by the log, in the same transaction, and by the
//! actor when the append's result comes back), so a new actor starts from
//! [`SessionActor::from_info`] without reading the log.

use std::collections::{BTreeMap, VecDeque};

use serde::{Deserialize, Serialize};

use crate::frame::{Frame, FrameBody, MessageKind};
use crate::log::{AppendRequest, LogInfo, DEFAULT_MAX_FRAME_BYTES};
use crate::part::StreamPart;
use crate::relay::{HostCall, HostCallRequest, HostMessage, HostOutcome, ToolSpec};
use crate::sandbox::SandboxHandle;
use crate::session::{SessionMeta, TurnCommand};
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
        /// The sandbox the turn runs in, for the session's next turn.
        #[serde(default)]
        sandbox: Option<SandboxHandle>,
        /// The agent's own session id, for the session's next turn.
        #[serde(default)]
        agent_session_id: Option<String>,
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
            sandbox: state.sandbox.clone(),
            agent_session_id: state.agent_session_id.clone(),
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

/// An append in flight: who to acknowledge, and what it stores.
#[derive(Debug, Clone)]
struct PendingAppend {
    reply_to: Option<ConnId>,
    key: Option<String>,
    then: Then,
}

/// What to do once an append is stored.
#[derive(Debug, Clone, PartialEq)]
enum Then {
    Nothing,
    /// Ask the host for the engine call this frame implies.
    Dispatch,
    /// A host call's frame is stored: hand it to the tool host (or record
    /// it unavailable).
    CallStored(String),
    /// A host call's outcome is stored: answer whoever waits for it.
    OutcomeStored(String),
}

/// The attached tool host.
#[derive(Debug, Clone)]
struct HostLease {
    conn: ConnId,
    tools: Vec<ToolSpec>,
}

/// A host call of the active turn.
#[derive(Debug, Clone)]
struct Call {
    turn_id: String,
    state: CallState,
}

#[derive(Debug, Clone)]
enum CallState {
    /// Its frame is being stored.
    Recording { waiter: Option<ConnId> },
    /// Out at the host.
    Out {
        host: ConnId,
        deadline_at_ms: u64,
        budget: u64,
        /// What arrived so far, kept up to the budget.
        output: String,
        /// Bytes the host sent in all.
        total: u64,
        waiter: Option<ConnId>,
    },
    /// Its outcome is being stored.
    Finishing { waiter: Option<ConnId> },
    /// Recorded before this actor started, with no outcome: the host it
    /// went to is gone with the old connection.
    Orphaned,
    /// Its outcome frame, answered to every repeat of the call id.
    Done(Frame),
}

impl CallState {
    fn waiter_mut(&mut self) -> Option<&mut Option<ConnId>> {
        match self {
            CallState::Recording { waiter }
            | CallState::Out { waiter, .. }
            | CallState::Finishing { waiter } => Some(waiter),
            CallState::Orphaned | CallState::Done(_) => None,
        }
    }
}

#[derive(Debug, Clone)]
struct OpenBlock {
    turn_id: String,
    id: String,
    kind: MessageKind,
    text: String,
}

impl OpenBlock {
    /// The idempotency key of the block's stored message when the runner
    /// gave none: one message per (turn, kind, block id).
    fn key(&self) -> String {
        format!("msg:{}:{:?}:{}", self.turn_id, self.kind, self.id)
    }

    fn into_message(self, interrupted: bool) -> FrameBody {
        FrameBody::Message {
            turn_id: self.turn_id,
            id: self.id,
            kind: self.kind,
            text: self.text,
            interrupted,
        }
    }
}

/// Where a part stands in a text/reasoning block.
enum BlockEvent<'a> {
    Start,
    Delta(&'a str),
    End,
}

/// Text and reasoning parts as (kind, block id, event); `None` for the rest.
fn classify_block(part: &StreamPart) -> Option<(MessageKind, &str, BlockEvent<'_>)> {
    use MessageKind::{Reasoning, Text};
    Some(match part {
        StreamPart::TextStart { id } => (Text, id, BlockEvent::Start),
        StreamPart::TextDelta { id, delta } => (Text, id, BlockEvent::Delta(delta)),
        StreamPart::TextEnd { id } => (Text, id, BlockEvent::End),
        StreamPart::ReasoningStart { id } => (Reasoning, id, BlockEvent::Start),
        StreamPart::ReasoningDelta { id, delta } => (Reasoning, id, BlockEvent::Delta(delta)),
        StreamPart::ReasoningEnd { id } => (Reasoning, id, BlockEvent::End),
        _ => return None,
    })
}

/// The actor's configuration.
#[derive(Debug, Clone)]
pub struct ActorConfig {
    /// Largest encoded frame accepted.
    pub max_frame_bytes: usize,
}

impl Default for ActorConfig {
    fn default() -> Self {
        Self {
            max_frame_bytes: DEFAULT_MAX_FRAME_BYTES,
        }
    }
}

/// The session actor's state.
#[derive(Debug, Clone)]
pub struct SessionActor {
    config: ActorConfig,
    last_seq: u64,
    sealed: bool,
    meta: SessionMeta,
    runner: Option<ConnId>,
    clients: BTreeMap<ConnId, ()>,
    /// Appends issued and not yet answered.
    pending: VecDeque<PendingAppend>,
    /// Text/reasoning blocks in progress, in the order they opened.
    open: Vec<OpenBlock>,
    /// The tool host holding the lease.
    host: Option<HostLease>,
    /// The active turn's host calls, by call id.
    calls: BTreeMap<String, Call>,
    /// The latest time fed ([`Input::Tick`]).
    now_ms: u64,
}

impl SessionActor {
    /// An actor for an empty log.
    pub fn new(config: ActorConfig) -> Self {
        Self {
            config,
            last_seq: 0,
            sealed: false,
            meta: SessionMeta::default(),
            runner: None,
            clients: BTreeMap::new(),
            pending: VecDeque::new(),
            open: Vec::new(),
            host: None,
            calls: BTreeMap::new(),
            now_ms: 0,
        }
    }

    /// An actor for a log described by `info` (its last seq, seal and
    /// folded meta): how a driver starts, without reading frames.
    pub fn from_info(config: ActorConfig, info: &LogInfo) -> Self {
        let mut actor = Self::new(config);
        actor.last_seq = info.last_seq;
        actor.sealed = info.sealed;
        actor.meta = info.meta.clone();
        actor
    }

    /// Fold one stored frame into the state, for a log that keeps no meta
    /// (idempotency keys are not in frames, so a prompt retried after such
    /// a recovery is judged by its content alone).
    pub fn recover(&mut self, frame: &Frame) {
        self.last_seq = self.last_seq.max(frame.seq);
        if matches!(frame.body, FrameBody::Sealed {}) {
            self.sealed = true;
        }
        self.meta.apply(frame.seq, &frame.body, None);
        self.recover_turn_frame(frame);
    }

    /// Fold one stored frame of the active turn (read from its
    /// `start_seq`) into the host-call state: a call with a stored outcome
    /// answers repeats with it; a call with none was out when the last
    /// actor stopped, and ends `ambiguous` when its runner asks again.
    pub fn recover_turn_frame(&mut self, frame: &Frame) {
        let Some(active) = self.meta.active_turn() else {
            return;
        };
        match &frame.body {
            FrameBody::HostCall {
                turn_id, call_id, ..
            } if *turn_id == active.turn_id => {
                self.calls.entry(call_id.clone()).or_insert(Call {
                    turn_id: turn_id.clone(),
                    state: CallState::Orphaned,
                });
            }
            FrameBody::HostOutcome {
                turn_id, call_id, ..
            } if *turn_id == active.turn_id => {
                self.calls.insert(
                    call_id.clone(),
                    Call {
                        turn_id: turn_id.clone(),
                        state: CallState::Done(frame.clone()),
                    },
                );
            }
            _ => {}
        }
    }

    /// The earliest deadline of a host call that is out: feed
    /// [`Input::Tick`] no later than this.
    pub fn next_deadline(&self) -> Option<u64> {
        self.calls
            .values()
            .filter_map(|c| match c.state {
                CallState::Out { deadline_at_ms, .. } => Some(deadline_at_ms),
                _ => None,
            })
            .min()
    }

    /// Whether a tool host holds the lease.
    pub fn has_tool_host(&self) -> bool {
        self.host.is_some()
    }

    /// Seq of the last stored frame.
    pub fn last_seq(&self) -> u64 {
        self.last_seq
    }

    /// The current runner generation.
    pub fn generation(&self) -> u64 {
        self.meta.generation
    }

    /// What the log says about the session (config, latest turn, sandbox).
    pub fn meta(&self) -> &SessionMeta {
        &self.meta
    }

    /// Whether a runner is attached.
    pub fn has_runner(&self) -> bool {
        self.runner.is_some()
    }

    /// Whether the session is sealed.
    pub fn is_sealed(&self) -> bool {
        self.sealed
    }

    /// Live connections (clients, runner and tool host).
    pub fn connection_count(&self) -> usize {
        self.clients.len() + usize::from(self.runner.is_some()) + usize::from(self.host.is_some())
    }

    /// True when appends are in flight (the wrapper must feed their results).
    pub fn has_pending_appends(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Handle one input.
    pub fn handle(&mut self, input: Input) -> Vec<Output> {
        let mut out = Vec::new();
        match input {
            Input::Connect { conn, role, after } => self.connect(conn, role, after, &mut out),
            Input::Disconnect { conn } => {
                self.clients.remove(&conn);
                if self.runner == Some(conn) {
                    // Open blocks stay: the next slice re-sends them from
                    // their start (its cursor never passes an open block).
                    self.runner = None;
                }
                for call in self.calls.values_mut() {
                    if let Some(waiter) = call.state.waiter_mut() {
                        if *waiter == Some(conn) {
                            *waiter = None;
                        }
                    }
                }
                if self.host.as_ref().is_some_and(|h| h.conn == conn) {
                    self.host = None;
                    let reason = "the tool host disconnected while the call was running";
                    self.orphan_host_calls(conn, reason, &mut out);
                }
            }
            Input::ToolHost { conn, message } => self.host_message(conn, message, &mut out),
            Input::Tick { now_ms } => self.tick(now_ms, &mut out),
            Input::Client { conn, message } => self.client(conn, message, &mut out),
            Input::Runner { conn, message } => self.runner_message(conn, message, &mut out),
            Input::Appended { frame, duplicate } => {
                let pending = self.pending.pop_front();
                let reply_to = pending.as_ref().and_then(|p| p.reply_to);
                let then = pending.as_ref().map_or(Then::Nothing, |p| p.then.clone());
                if !duplicate {
                    self.last_seq = self.last_seq.max(frame.seq);
                    if matches!(frame.body, FrameBody::Sealed {}) {
                        self.sealed = true;
                    }
                    let key = pending.as_ref().and_then(|p| p.key.as_deref());
                    self.meta.apply(frame.seq, &frame.body, key);
                    if then == Then::Dispatch {
                        if let Some(command) = self.command_for(&frame.body) {
                            out.push(Output::Dispatch(command));
                        }
                    }
                    self.turn_boundary(&frame.body, &mut out);
                }
                match then {
                    Then::CallStored(call_id) => {
                        self.call_stored(&call_id, &frame, duplicate, &mut out)
                    }
                    Then::OutcomeStored(call_id) => self.outcome_stored(&call_id, &frame, &mut out),
                    Then::Nothing | Then::Dispatch => {}
                }
                if let Some(conn) = reply_to {
                    out.push(Output::Send {
                        conn,
                        message: ServerMessage::Ack {
                            seq: frame.seq,
                            duplicate,
                            turn_id: frame.body.opened_turn().map(str::to_string),
                        },
                    });
                }
                if !duplicate && !self.clients.is_empty() {
                    out.push(Output::SendAll {
                        conns: self.clients.keys().copied().collect(),
                        message: ServerMessage::Frame { frame },
                    });
                }
            }
            Input::AppendFailed { kind, error } => {
                let pending = self.pending.pop_front();
                // A host call whose frame could not be stored: whoever
                // waits for it hears why, and the call is forgotten (the
                // host never saw it).
                let waiter = match pending.as_ref().map(|p| &p.then) {
                    Some(Then::CallStored(id) | Then::OutcomeStored(id)) => self
                        .calls
                        .remove(id)
                        .and_then(|mut c| c.state.waiter_mut().and_then(|w| w.take())),
                    _ => None,
                };
                if let Some(conn) = pending.and_then(|p| p.reply_to).or(waiter) {
                    let code = match kind {
                        ErrorKind::Conflict => ErrorCode::Conflict,
                        ErrorKind::InvalidInput => ErrorCode::Invalid,
                        _ => ErrorCode::AppendFailed,
                    };
                    out.push(Output::Send {
                        conn,
                        message: ServerMessage::error(
                            code,
                            format!("the log refused the write: {error}"),
                        ),
                    });
                }
            }
            Input::DispatchFailed { turn_id, error } => {
                let running = self
                    .meta
                    .active_turn()
                    .is_some_and(|t| t.turn_id == turn_id);
                if running && !self.sealed {
                    self.flush_turn(&turn_id, &mut out);
                    let body = FrameBody::TurnStatus {
                        turn_id: turn_id.clone(),
                        status: TurnStatus::Failed,
                        error: Some(format!("the turn could not be started: {error}")),
                        sandbox: None,
                        agent_session_id: None,
                    };
                    let key = format!("{turn_id}:dispatch-failed");
                    self.append(AppendRequest::idempotent(body, key), None, false, &mut out);
                }
            }
        }
        out
    }

    /// The engine call a stored client frame asks for.
    fn command_for(&self, body: &FrameBody) -> Option<TurnCommand> {
        let turn = self.meta.active_turn()?;
        match body {
            FrameBody::UserMessage { .. } => Some(self.meta.start_command(turn)),
            FrameBody::ApprovalResponse {
                approval_id,
                approved,
                reason,
                ..
            } => Some(TurnCommand::Answer {
                turn_id: turn.turn_id.clone(),
                answer: crate::turn::ApprovalAnswer {
                    approval_id: approval_id.clone(),
                    approved: *approved,
                    reason: reason.clone(),
                },
            }),
            FrameBody::AbortRequested { reason, .. } => Some(TurnCommand::Abort {
                turn_id: turn.turn_id.clone(),
                reason: reason.clone(),
            }),
            _ => None,
        }
    }

    fn connect(&mut self, conn: ConnId, role: Role, after: Option<u64>, out: &mut Vec<Output>) {
        match role {
            Role::Client => {
                if let Some(after) = after {
                    if after < self.last_seq {
                        out.push(Output::Replay {
                            conn,
                            after,
                            until: self.last_seq,
                        });
                    }
                }
                self.clients.insert(conn, ());
                // A client joining mid-block sees what was said so far.
                for block in &self.open {
                    let (start, delta) = block_parts(block);
                    out.push(Output::Send {
                        conn,
                        message: ServerMessage::Live {
                            turn_id: block.turn_id.clone(),
                            part: start,
                        },
                    });
                    if !block.text.is_empty() {
                        out.push(Output::Send {
                            conn,
                            message: ServerMessage::Live {
                                turn_id: block.turn_id.clone(),
                                part: delta,
                            },
                        });
                    }
                }
            }
            Role::ToolHost { takeover } => {
                if let Some(old) = self.host.as_ref().map(|h| h.conn) {
                    if !takeover {
                        out.push(Output::Send {
                            conn,
                            message: ServerMessage::error(
                                ErrorCode::HostLeaseHeld,
                                "another tool host is attached to this session; connect with takeover to replace it",
                            ),
                        });
                        out.push(Output::Close {
                            conn,
                            reason: "host lease held".into(),
                        });
                        return;
                    }
                    out.push(Output::Send {
                        conn: old,
                        message: ServerMessage::error(
                            ErrorCode::HostLeaseHeld,
                            "another tool host took over this session",
                        ),
                    });
                    out.push(Output::Close {
                        conn: old,
                        reason: "replaced by another tool host".into(),
                    });
                    self.host = None;
                    let reason = "the tool host was replaced while the call was running";
                    self.orphan_host_calls(old, reason, out);
                }
                self.host = Some(HostLease {
                    conn,
                    tools: Vec::new(),
                });
            }
            Role::Runner { generation } => {
                let current = self.meta.generation;
                let current_busy = self.runner.is_some();
                if generation < current || (generation == current && current_busy) {
                    out.push(Output::Send {
                        conn,
                        message: ServerMessage::error(
                            ErrorCode::StaleRunner,
                            format!(
                                "runner generation {generation} is fenced: generation {current} is current"
                            ),
                        ),
                    });
                    out.push(Output::Close {
                        conn,
                        reason: "stale runner generation".into(),
                    });
                    return;
                }
                if let Some(old) = self.runner.take() {
                    out.push(Output::Send {
                        conn: old,
                        message: ServerMessage::error(
                            ErrorCode::StaleRunner,
                            format!("fenced by runner generation {generation}"),
                        ),
                    });
                    out.push(Output::Close {
                        conn: old,
                        reason: "fenced by a newer runner".into(),
                    });
                }
                self.runner = Some(conn);
                if generation > current {
                    // Fence at once, before the frame is stored: a message
                    // from an older runner queued behind this connect must
                    // already be refused.
                    self.meta.generation = generation;
                    if !self.sealed {
                        self.append(
                            AppendRequest::new(FrameBody::RunnerAttached { generation }),
                            None,
                            false,
                            out,
                        );
                    }
                }
            }
        }
    }

    fn received(conn: ConnId, out: &mut Vec<Output>) {
        out.push(Output::Send {
            conn,
            message: ServerMessage::Received {},
        });
    }

    fn refuse(conn: ConnId, code: ErrorCode, message: impl Into<String>, out: &mut Vec<Output>) {
        out.push(Output::Send {
            conn,
            message: ServerMessage::error(code, message),
        });
    }

    fn client(&mut self, conn: ConnId, message: ClientMessage, out: &mut Vec<Output>) {
        if !self.clients.contains_key(&conn) {
            let text = "only client connections send prompts and answers";
            return Self::refuse(conn, ErrorCode::NotAClient, text, out);
        }
        if self.sealed {
            if matches!(message, ClientMessage::Seal {}) {
                out.push(Output::Send {
                    conn,
                    message: ServerMessage::Ack {
                        seq: self.last_seq,
                        duplicate: true,
                        turn_id: None,
                    },
                });
            } else {
                out.push(Output::Send {
                    conn,
                    message: sealed_message(),
                });
            }
            return;
        }
        let active = self.meta.active_turn().map(|t| t.turn_id.clone());
        let (body, key, dispatch) = match message {
            ClientMessage::Prompt { text, turn_id, key } => {
                let latest = self.meta.turn.as_ref();
                // A retried send of the prompt that opened the latest turn
                // (same key) is stored under the same turn id, so the log
                // answers it as a duplicate instead of a new turn.
                let retried = latest.filter(|t| key.is_some() && t.key == key);
                let turn_id = match (retried, &active) {
                    (Some(t), _) => t.turn_id.clone(),
                    (None, Some(running)) => {
                        let text = format!(
                            "turn {running} is still running: wait for it to end or abort it ({{\"type\":\"abort\"}})"
                        );
                        return Self::refuse(conn, ErrorCode::TurnInProgress, text, out);
                    }
                    (None, None) => match turn_id {
                        Some(id) if latest.is_some_and(|t| t.turn_id == id) => {
                            let text = format!("turn id {id:?} was already used in this session");
                            return Self::refuse(conn, ErrorCode::Conflict, text, out);
                        }
                        Some(id) if id.is_empty() || id.len() > 128 => {
                            let text = "a turn id must be 1-128 characters";
                            return Self::refuse(conn, ErrorCode::Invalid, text, out);
                        }
                        Some(id) => id,
                        None => self.meta.next_turn_id(),
                    },
                };
                let body = FrameBody::UserMessage {
                    text,
                    turn_id: Some(turn_id),
                };
                (body, key, true)
            }
            ClientMessage::ApprovalResponse {
                approval_id,
                approved,
                reason,
            } => {
                let Some(turn_id) = active else {
                    let text = format!("no turn is running to answer {approval_id:?}");
                    return Self::refuse(conn, ErrorCode::NoActiveTurn, text, out);
                };
                let body = FrameBody::ApprovalResponse {
                    approval_id,
                    approved,
                    reason,
                    turn_id: Some(turn_id),
                };
                (body, None, true)
            }
            ClientMessage::Abort { turn_id, reason } => {
                let running = match (active, turn_id) {
                    (Some(running), Some(asked)) if asked != running => {
                        let text = format!("turn {asked} is not running (turn {running} is)");
                        return Self::refuse(conn, ErrorCode::NoActiveTurn, text, out);
                    }
                    (Some(running), _) => running,
                    (None, _) => {
                        return Self::refuse(
                            conn,
                            ErrorCode::NoActiveTurn,
                            "no turn is running",
                            out,
                        )
                    }
                };
                let body = FrameBody::AbortRequested {
                    turn_id: running,
                    reason: reason.unwrap_or_else(|| "aborted by a client".into()),
                };
                (body, None, true)
            }
            ClientMessage::Seal {} => (FrameBody::Sealed {}, None, false),
        };
        if let Err(e) = self.check_size(&body) {
            return Self::refuse(conn, ErrorCode::FrameTooLarge, e.message(), out);
        }
        self.append(
            AppendRequest {
                body,
                idempotency_key: key,
            },
            Some(conn),
            dispatch,
            out,
        );
    }

    fn runner_message(&mut self, conn: ConnId, message: RunnerMessage, out: &mut Vec<Output>) {
        if self.runner != Some(conn) {
            let (code, text) = if self.clients.contains_key(&conn) {
                (
                    ErrorCode::NotARunner,
                    "only the runner sends stream parts".to_string(),
                )
            } else {
                (
                    ErrorCode::StaleRunner,
                    format!(
                        "this runner was fenced; generation {} is current",
                        self.meta.generation
                    ),
                )
            };
            return Self::refuse(conn, code, text, out);
        }
        if let RunnerMessage::HostTools {} = message {
            let tools = self
                .host
                .as_ref()
                .map(|h| h.tools.clone())
                .unwrap_or_default();
            out.push(Output::Send {
                conn,
                message: ServerMessage::HostTools { tools },
            });
            return;
        }
        if self.sealed {
            out.push(Output::Send {
                conn,
                message: sealed_message(),
            });
            return;
        }
        let (turn_id, part, key) = match message {
            RunnerMessage::HostTools {} => return,
            RunnerMessage::HostCall { turn_id, call } => {
                return self.host_call(conn, turn_id, call, out);
            }
            RunnerMessage::TurnStatus {
                turn_id,
                status,
                error,
                sandbox,
                agent_session_id,
                key,
            } => {
                if status.is_terminal() {
                    self.flush_turn(&turn_id, out);
                }
                let body = FrameBody::TurnStatus {
                    turn_id,
                    status,
                    error,
                    sandbox,
                    agent_session_id,
                };
                self.checked_append(body, key, conn, out);
                return;
            }
            RunnerMessage::Part { turn_id, part, key } => (turn_id, part, key),
        };
        let Some((kind, id, event)) = classify_block(&part) else {
            let body = FrameBody::Part { turn_id, part };
            self.checked_append(body, key, conn, out);
            return;
        };
        let id = id.to_string();
        let position = self
            .open
            .iter()
            .position(|b| b.turn_id == turn_id && b.id == id && b.kind == kind);
        match (event, position) {
            (BlockEvent::Start, _) => {
                // A re-sent block (retried slice) starts over.
                if let Some(pos) = position {
                    self.open.remove(pos);
                }
                self.open.push(OpenBlock {
                    turn_id: turn_id.clone(),
                    id,
                    kind,
                    text: String::new(),
                });
                self.fanout_live(&turn_id, part, out);
                Self::received(conn, out);
            }
            (BlockEvent::Delta(_) | BlockEvent::End, None) => {
                let text = format!("block {id:?} was never started");
                Self::refuse(conn, ErrorCode::Invalid, text, out);
            }
            (BlockEvent::Delta(delta), Some(pos)) => {
                let limit = self.config.max_frame_bytes;
                let block = &mut self.open[pos];
                if block.text.len() + delta.len() > limit {
                    let text = format!("block {id:?} would exceed the {limit}-byte frame limit");
                    return Self::refuse(conn, ErrorCode::FrameTooLarge, text, out);
                }
                block.text.push_str(delta);
                self.fanout_live(&turn_id, part, out);
                Self::received(conn, out);
            }
            (BlockEvent::End, Some(pos)) => {
                let block = self.open.remove(pos);
                let key = key.unwrap_or_else(|| block.key());
                self.checked_append(block.into_message(false), Some(key), conn, out);
            }
        }
    }

    /// A runner asks for a host call: answer a known call id from its
    /// state, else store the call (then hand it to the host).
    fn host_call(
        &mut self,
        conn: ConnId,
        turn_id: String,
        call: HostCallRequest,
        out: &mut Vec<Output>,
    ) {
        if let Err(e) = call.validate() {
            return Self::refuse(conn, ErrorCode::Invalid, e, out);
        }
        let active = self.meta.active_turn().map(|t| t.turn_id.clone());
        if active.as_deref() != Some(turn_id.as_str()) {
            let text = format!("turn {turn_id} is not running: no host call for it");
            return Self::refuse(conn, ErrorCode::NoActiveTurn, text, out);
        }
        if let Some(known) = self.calls.get_mut(&call.call_id) {
            if known.turn_id != turn_id {
                let text = format!(
                    "call id {:?} belongs to turn {}",
                    call.call_id, known.turn_id
                );
                return Self::refuse(conn, ErrorCode::Conflict, text, out);
            }
            match &mut known.state {
                CallState::Done(frame) => out.push(Output::Send {
                    conn,
                    message: ServerMessage::Frame {
                        frame: frame.clone(),
                    },
                }),
                CallState::Orphaned => {
                    let outcome = HostOutcome::Ambiguous {
                        reason: "the session restarted while the call was out at its host".into(),
                    };
                    self.finish_call(&call.call_id, outcome, Some(conn), out);
                }
                state => {
                    if let Some(waiter) = state.waiter_mut() {
                        *waiter = Some(conn);
                    }
                }
            }
            return;
        }
        let body = FrameBody::HostCall {
            turn_id: turn_id.clone(),
            call_id: call.call_id.clone(),
            tool: call.tool.clone(),
            byte_budget: call.budget(),
            timeout_ms: call.timeout(),
            input: call.input,
        };
        if let Err(e) = self.check_size(&body) {
            return Self::refuse(conn, ErrorCode::FrameTooLarge, e.message(), out);
        }
        self.calls.insert(
            call.call_id.clone(),
            Call {
                turn_id,
                state: CallState::Recording { waiter: Some(conn) },
            },
        );
        let key = format!("host-call:{}", call.call_id);
        self.append_then(
            AppendRequest::idempotent(body, key),
            None,
            Then::CallStored(call.call_id),
            out,
        );
    }

    /// A call's frame is stored: hand it to the host, or record why not.
    fn call_stored(
        &mut self,
        call_id: &str,
        frame: &Frame,
        duplicate: bool,
        out: &mut Vec<Output>,
    ) {
        let Some(call) = self.calls.get_mut(call_id) else {
            return;
        };
        let CallState::Recording { waiter } = call.state else {
            return;
        };
        let FrameBody::HostCall {
            tool,
            input,
            byte_budget,
            timeout_ms,
            ..
        } = &frame.body
        else {
            return;
        };
        if duplicate {
            // Stored by an earlier actor whose state this one never read:
            // it may have gone out to a host that is gone now.
            call.state = CallState::Orphaned;
            let outcome = HostOutcome::Ambiguous {
                reason:
                    "the call was recorded before the session restarted; its host may have run it"
                        .into(),
            };
            return self.finish_call(call_id, outcome, waiter, out);
        }
        let unavailable = match &self.host {
            None => Some("no tool host is attached to this session".to_string()),
            Some(h) if !h.tools.iter().any(|t| t.name == *tool) => Some(format!(
                "the attached tool host does not offer {tool:?} (it offers: {})",
                h.tools
                    .iter()
                    .map(|t| t.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )),
            Some(_) => None,
        };
        if let Some(reason) = unavailable {
            return self.finish_call(call_id, HostOutcome::Unavailable { reason }, waiter, out);
        }
        let host = self.host.as_ref().map(|h| h.conn).unwrap_or_default();
        // The deadline runs from when the call was stored (the log's clock,
        // the same on every repeat); a log without a clock leaves the
        // actor's own time.
        let deadline_at_ms = frame.at_ms.max(self.now_ms).saturating_add(*timeout_ms);
        out.push(Output::Send {
            conn: host,
            message: ServerMessage::HostCall {
                call: HostCall {
                    call_id: call_id.to_string(),
                    tool: tool.clone(),
                    input: input.clone(),
                    byte_budget: *byte_budget,
                    deadline_at_ms,
                },
            },
        });
        call.state = CallState::Out {
            host,
            deadline_at_ms,
            budget: *byte_budget,
            output: String::new(),
            total: 0,
            waiter,
        };
    }

    /// Store a call's one outcome (the host hears nothing more of it).
    fn finish_call(
        &mut self,
        call_id: &str,
        outcome: HostOutcome,
        waiter: Option<ConnId>,
        out: &mut Vec<Output>,
    ) {
        let Some(call) = self.calls.get_mut(call_id) else {
            return;
        };
        call.state = CallState::Finishing { waiter };
        let body = FrameBody::HostOutcome {
            turn_id: call.turn_id.clone(),
            call_id: call_id.to_string(),
            outcome,
        };
        let key = format!("host-outcome:{call_id}");
        self.append_then(
            AppendRequest::idempotent(body, key),
            None,
            Then::OutcomeStored(call_id.to_string()),
            out,
        );
    }

    /// A call's outcome is stored (or was already: the log answers with
    /// the first one): keep it for repeats and answer the waiting runner.
    fn outcome_stored(&mut self, call_id: &str, frame: &Frame, out: &mut Vec<Output>) {
        let Some(call) = self.calls.get_mut(call_id) else {
            return;
        };
        let waiter = call.state.waiter_mut().and_then(|w| w.take());
        call.state = CallState::Done(frame.clone());
        if let Some(conn) = waiter {
            out.push(Output::Send {
                conn,
                message: ServerMessage::Frame {
                    frame: frame.clone(),
                },
            });
        }
    }

    /// The calls out at `host` end `ambiguous`: it left (or was replaced)
    /// without answering, and may or may not have run them.
    fn orphan_host_calls(&mut self, host: ConnId, reason: &str, out: &mut Vec<Output>) {
        let ids: Vec<(String, Option<ConnId>)> = self
            .calls
            .iter()
            .filter_map(|(id, c)| match c.state {
                CallState::Out {
                    host: h, waiter, ..
                } if h == host => Some((id.clone(), waiter)),
                _ => None,
            })
            .collect();
        for (id, waiter) in ids {
            let outcome = HostOutcome::Ambiguous {
                reason: reason.to_string(),
            };
            self.finish_call(&id, outcome, waiter, out);
        }
    }

    /// Cancel at the host and record `outcome` for every call out that
    /// `pick` selects.
    fn cancel_calls(
        &mut self,
        pick: impl Fn(u64) -> bool,
        reason: &str,
        outcome: impl Fn(u64) -> HostOutcome,
        out: &mut Vec<Output>,
    ) {
        let due: Vec<(String, ConnId, u64, Option<ConnId>)> = self
            .calls
            .iter()
            .filter_map(|(id, c)| match c.state {
                CallState::Out {
                    host,
                    deadline_at_ms,
                    waiter,
                    ..
                } if pick(deadline_at_ms) => Some((id.clone(), host, deadline_at_ms, waiter)),
                _ => None,
            })
            .collect();
        for (id, host, deadline, waiter) in due {
            out.push(Output::Send {
                conn: host,
                message: ServerMessage::HostCancel {
                    call_id: id.clone(),
                    reason: reason.to_string(),
                },
            });
            self.finish_call(&id, outcome(deadline), waiter, out);
        }
    }

    fn tick(&mut self, now_ms: u64, out: &mut Vec<Output>) {
        self.now_ms = self.now_ms.max(now_ms);
        let now = self.now_ms;
        self.cancel_calls(
            |deadline| deadline <= now,
            "the call's deadline passed",
            |deadline_at_ms| HostOutcome::Timeout { deadline_at_ms },
            out,
        );
    }

    /// A turn ended: its calls still out are cancelled (nobody waits for
    /// them now). A new turn starts: the last turn's calls are forgotten.
    fn turn_boundary(&mut self, body: &FrameBody, out: &mut Vec<Output>) {
        match body {
            FrameBody::TurnStatus { status, .. } if status.is_terminal() => {
                self.cancel_calls(
                    |_| true,
                    "the call's turn ended",
                    |_| HostOutcome::Ambiguous {
                        reason: "the turn ended while the call was running".into(),
                    },
                    out,
                );
            }
            FrameBody::UserMessage { .. } => self.calls.clear(),
            _ => {}
        }
    }

    /// The tool host's message: a declaration, part of a result, a result.
    fn host_message(&mut self, conn: ConnId, message: HostMessage, out: &mut Vec<Output>) {
        let Some(lease) = self.host.as_mut().filter(|h| h.conn == conn) else {
            let text = "only the session's tool host sends declarations and results";
            return Self::refuse(conn, ErrorCode::NotAHost, text, out);
        };
        match message {
            HostMessage::Declare { tools } => {
                if let Err(e) = crate::relay::validate_tools(&tools) {
                    return Self::refuse(conn, ErrorCode::Invalid, e, out);
                }
                lease.tools = tools;
                Self::received(conn, out);
            }
            HostMessage::Chunk { call_id, data } => match self.out_at(conn, &call_id) {
                Some(CallState::Out {
                    budget,
                    output,
                    total,
                    ..
                }) => {
                    keep_within(output, &data, *budget);
                    *total += data.len() as u64;
                    Self::received(conn, out);
                }
                _ => Self::not_out(conn, &call_id, out),
            },
            HostMessage::Result {
                call_id,
                output: rest,
                is_error,
                produced_bytes,
            } => {
                let Some(CallState::Out {
                    budget,
                    output,
                    total,
                    waiter,
                    ..
                }) = self.out_at(conn, &call_id)
                else {
                    return Self::not_out(conn, &call_id, out);
                };
                keep_within(output, &rest, *budget);
                let total = (*total + rest.len() as u64).max(produced_bytes.unwrap_or(0));
                let (text, truncated) =
                    crate::relay::truncate_counted(std::mem::take(output), *budget, total);
                let outcome = HostOutcome::Completed {
                    output: text,
                    is_error,
                    truncated,
                };
                let waiter = *waiter;
                Self::received(conn, out);
                self.finish_call(&call_id, outcome, waiter, out);
            }
        }
    }

    /// The state of `call_id` if it is out at host `conn`.
    fn out_at(&mut self, conn: ConnId, call_id: &str) -> Option<&mut CallState> {
        self.calls
            .get_mut(call_id)
            .map(|c| &mut c.state)
            .filter(|s| matches!(s, CallState::Out { host, .. } if *host == conn))
    }

    fn not_out(conn: ConnId, call_id: &str, out: &mut Vec<Output>) {
        let text = format!(
            "call {call_id:?} is not out at this host (it timed out, its turn ended, or it was never sent): dropped"
        );
        Self::refuse(conn, ErrorCode::Invalid, text, out);
    }

    /// Store what is left of a turn's open blocks, marked interrupted, so a
    /// turn that ends mid-block loses nothing.
    fn flush_turn(&mut self, turn_id: &str, out: &mut Vec<Output>) {
        let (flush, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut self.open)
            .into_iter()
            .partition(|b| b.turn_id == turn_id);
        self.open = keep;
        for block in flush {
            let key = block.key();
            self.append(
                AppendRequest::idempotent(block.into_message(true), key),
                None,
                false,
                out,
            );
        }
    }

    fn checked_append(
        &mut self,
        body: FrameBody,
        key: Option<String>,
        conn: ConnId,
        out: &mut Vec<Output>,
    ) {
        if let Err(e) = self.check_size(&body) {
            return Self::refuse(conn, ErrorCode::FrameTooLarge, e.message(), out);
        }
        self.append(
            AppendRequest {
                body,
                idempotency_key: key,
            },
            Some(conn),
            false,
            out,
        );
    }

    fn check_size(&self, body: &FrameBody) -> Result<(), Error> {
        let len = Frame::encoded_len(body);
        if len > self.config.max_frame_bytes {
            return Err(Error::invalid(format!(
                "frame of {len} bytes exceeds the {}-byte limit",
                self.config.max_frame_bytes
            )));
        }
        Ok(())
    }

    fn append(
        &mut self,
        request: AppendRequest,
        reply_to: Option<ConnId>,
        dispatch: bool,
        out: &mut Vec<Output>,
    ) {
        let then = if dispatch {
            Then::Dispatch
        } else {
            Then::Nothing
        };
        self.append_then(request, reply_to, then, out);
    }

    fn append_then(
        &mut self,
        request: AppendRequest,
        reply_to: Option<ConnId>,
        then: Then,
        out: &mut Vec<Output>,
    ) {
        self.pending.push_back(PendingAppend {
            reply_to,
            key: request.idempotency_key.clone(),
            then,
        });
        out.push(Output::Append(request));
    }

    /// Live parts are not acknowledged: they are not stored, and a runner
    /// that retries re-sends whole blocks anyway.
    fn fanout_live(&self, turn_id: &str, part: StreamPart, out: &mut Vec<Output>) {
        if self.clients.is_empty() {
            return;
        }
        out.push(Output::SendAll {
            conns: self.clients.keys().copied().collect(),
            message: ServerMessage::Live {
                turn_id: turn_id.to_string(),
                part,
            },
        });
    }
}

fn sealed_message() -> ServerMessage {
    ServerMessage::error(
        ErrorCode::Sealed,
        "the session is sealed; fork it to continue",
    )
}

fn block_parts(block: &OpenBlock) -> (StreamPart, StreamPart) {
    let id = block.id.clone();
    match block.kind {
        MessageKind::Text => (
            StreamPart::TextStart { id: id.clone() },
            StreamPart::TextDelta {
                id,
                delta: block.text.clone(),
            },
        ),
        MessageKind::Reasoning => (
            StreamPart::ReasoningStart { id: id.clone() },
            StreamPart::ReasoningDelta {
                id,
                delta: block.text.clone(),
            },
        ),
    }
}

/// Append `data` to `output`, keeping at most `budget` bytes plus one
/// character (enough for the final cut to see the output was longer).
fn keep_within(output: &mut String, data: &str, budget: u64) {
    let room = usize::try_from(budget)
        .unwrap_or(usize::MAX)
        .saturating_add(4)
        .saturating_sub(output.len());
    if room == 0 {
        return;
    }
    let mut take = room.min(data.len());
    while !data.is_char_boundary(take) {
        take -= 1;
    }
    output.push_str(&data[..take]);
}
