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
//!
//! The module: `wire` holds what crosses its edge (client, runner and
//! server messages; inputs and outputs), `host_calls` the tool-host lease
//! and the life of each host call, and this file the machine.

use std::collections::{BTreeMap, VecDeque};

use crate::frame::{Frame, FrameBody, MessageKind};
use crate::log::{AppendRequest, LogInfo, DEFAULT_MAX_FRAME_BYTES};
use crate::part::StreamPart;
use crate::session::{SessionMeta, TurnCommand};
use crate::turn::TurnStatus;
use crate::{Error, ErrorKind};

mod host_calls;
mod wire;

pub use wire::*;

use host_calls::{Call, CallState, HostLease};

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
                        code: None,
                        sandbox: None,
                        agent_session_id: None,
                        checkpoint: None,
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
            ClientMessage::Rewind { turn_id } => {
                match crate::fork::rewind_frame(&self.meta, &turn_id) {
                    Ok(body) => (body, None, false),
                    Err(e) => {
                        let code = if active.is_some() {
                            ErrorCode::TurnInProgress
                        } else {
                            ErrorCode::Invalid
                        };
                        return Self::refuse(conn, code, e.to_string(), out);
                    }
                }
            }
        };
        self.checked_append(body, key, conn, dispatch, out);
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
                code,
                sandbox,
                agent_session_id,
                checkpoint,
                key,
            } => {
                if status.is_terminal() {
                    self.flush_turn(&turn_id, out);
                }
                let body = FrameBody::TurnStatus {
                    turn_id,
                    status,
                    error,
                    code,
                    sandbox,
                    agent_session_id,
                    checkpoint,
                };
                self.checked_append(body, key, conn, false, out);
                return;
            }
            RunnerMessage::Part { turn_id, part, key } => (turn_id, part, key),
        };
        let Some((kind, id, event)) = classify_block(&part) else {
            let body = FrameBody::Part { turn_id, part };
            self.checked_append(body, key, conn, false, out);
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
                self.checked_append(block.into_message(false), Some(key), conn, false, out);
            }
        }
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

    /// Append a connection's frame (`dispatch`: it starts work for the
    /// engine), or refuse it when it is over the frame limit.
    fn checked_append(
        &mut self,
        body: FrameBody,
        key: Option<String>,
        conn: ConnId,
        dispatch: bool,
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
            dispatch,
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
