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
//!   nothing is stored on a refusal.

use std::collections::{BTreeMap, VecDeque};

use serde::{Deserialize, Serialize};

use crate::frame::{Frame, FrameBody, MessageKind};
use crate::log::{AppendRequest, DEFAULT_MAX_FRAME_BYTES};
use crate::part::StreamPart;
use crate::turn::TurnStatus;
use crate::Error;

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
    /// An answer to a permission request.
    ApprovalResponse {
        /// The request.
        approval_id: String,
        /// Allow or deny.
        approved: bool,
        /// Optional reason.
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
    /// A turn changed status.
    TurnStatus {
        /// The turn.
        turn_id: String,
        /// The status.
        status: TurnStatus,
        /// Error text.
        #[serde(default)]
        error: Option<String>,
        /// Idempotency key.
        #[serde(default)]
        key: Option<String>,
    },
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
    /// The sender's write was stored (or was a duplicate).
    Ack {
        /// Seq of the stored frame.
        seq: u64,
        /// True if an idempotency key matched an earlier write.
        duplicate: bool,
    },
    /// The sender's message was refused; nothing was stored.
    Error {
        /// Stable code: `stale_runner`, `sealed`, `frame_too_large`,
        /// `not_a_runner`, `not_a_client`, `invalid`, `append_failed`.
        code: String,
        /// What happened and what to do.
        message: String,
    },
}

impl ServerMessage {
    fn error(code: &str, message: impl Into<String>) -> Self {
        ServerMessage::Error {
            code: code.to_string(),
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
    /// The result of the oldest [`Output::Append`] still pending.
    Appended {
        /// The frame as stored (with its seq).
        frame: Frame,
        /// True if the log found the idempotency key already used.
        duplicate: bool,
    },
    /// The oldest pending append failed.
    AppendFailed {
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
    /// Close a connection.
    Close {
        /// The connection.
        conn: ConnId,
        /// Why.
        reason: String,
    },
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
    generation: u64,
    runner: Option<ConnId>,
    clients: BTreeMap<ConnId, ()>,
    /// Appends issued and not yet answered, with the connection to ack.
    pending: VecDeque<Option<ConnId>>,
    /// Text/reasoning blocks in progress, in the order they opened.
    open: Vec<OpenBlock>,
}

impl SessionActor {
    /// An actor for an empty log.
    pub fn new(config: ActorConfig) -> Self {
        Self {
            config,
            last_seq: 0,
            sealed: false,
            generation: 0,
            runner: None,
            clients: BTreeMap::new(),
            pending: VecDeque::new(),
            open: Vec::new(),
        }
    }

    /// Fold a stored frame into the state (used on start-up to recover from
    /// the log: last seq, seal, runner generation).
    pub fn recover(&mut self, frame: &Frame) {
        self.last_seq = self.last_seq.max(frame.seq);
        match &frame.body {
            FrameBody::Sealed {} => self.sealed = true,
            FrameBody::RunnerAttached { generation } => {
                self.generation = self.generation.max(*generation)
            }
            _ => {}
        }
    }

    /// Seq of the last stored frame.
    pub fn last_seq(&self) -> u64 {
        self.last_seq
    }

    /// The current runner generation.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Whether the session is sealed.
    pub fn is_sealed(&self) -> bool {
        self.sealed
    }

    /// Live connections (clients and runner).
    pub fn connection_count(&self) -> usize {
        self.clients.len() + usize::from(self.runner.is_some())
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
            }
            Input::Client { conn, message } => self.client(conn, message, &mut out),
            Input::Runner { conn, message } => self.runner_message(conn, message, &mut out),
            Input::Appended { frame, duplicate } => {
                let reply_to = self.pending.pop_front().flatten();
                if !duplicate {
                    self.last_seq = self.last_seq.max(frame.seq);
                    if matches!(frame.body, FrameBody::Sealed {}) {
                        self.sealed = true;
                    }
                }
                if let Some(conn) = reply_to {
                    out.push(Output::Send {
                        conn,
                        message: ServerMessage::Ack {
                            seq: frame.seq,
                            duplicate,
                        },
                    });
                }
                if !duplicate {
                    for &conn in self.clients.keys() {
                        out.push(Output::Send {
                            conn,
                            message: ServerMessage::Frame {
                                frame: frame.clone(),
                            },
                        });
                    }
                }
            }
            Input::AppendFailed { error } => {
                if let Some(Some(conn)) = self.pending.pop_front() {
                    out.push(Output::Send {
                        conn,
                        message: ServerMessage::error(
                            "append_failed",
                            format!("the log refused the write: {error}"),
                        ),
                    });
                }
            }
        }
        out
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
            Role::Runner { generation } => {
                let current_busy = self.runner.is_some();
                if generation < self.generation || (generation == self.generation && current_busy) {
                    out.push(Output::Send {
                        conn,
                        message: ServerMessage::error(
                            "stale_runner",
                            format!(
                                "runner generation {generation} is fenced: generation {} is current",
                                self.generation
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
                            "stale_runner",
                            format!("fenced by runner generation {generation}"),
                        ),
                    });
                    out.push(Output::Close {
                        conn: old,
                        reason: "fenced by a newer runner".into(),
                    });
                }
                self.runner = Some(conn);
                if generation > self.generation {
                    self.generation = generation;
                    if !self.sealed {
                        self.append(
                            AppendRequest::new(FrameBody::RunnerAttached { generation }),
                            None,
                            out,
                        );
                    }
                }
            }
        }
    }

    fn client(&mut self, conn: ConnId, message: ClientMessage, out: &mut Vec<Output>) {
        if !self.clients.contains_key(&conn) {
            out.push(Output::Send {
                conn,
                message: ServerMessage::error(
                    "not_a_client",
                    "only client connections send prompts and answers",
                ),
            });
            return;
        }
        let (body, key) = match message {
            ClientMessage::Prompt { text, turn_id, key } => {
                (FrameBody::UserMessage { text, turn_id }, key)
            }
            ClientMessage::ApprovalResponse {
                approval_id,
                approved,
                reason,
            } => (
                FrameBody::ApprovalResponse {
                    approval_id,
                    approved,
                    reason,
                },
                None,
            ),
            ClientMessage::Seal {} => (FrameBody::Sealed {}, None),
        };
        if self.sealed {
            if matches!(body, FrameBody::Sealed {}) {
                out.push(Output::Send {
                    conn,
                    message: ServerMessage::Ack {
                        seq: self.last_seq,
                        duplicate: true,
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
        if let Err(e) = self.check_size(&body) {
            out.push(Output::Send {
                conn,
                message: ServerMessage::error("frame_too_large", e.message()),
            });
            return;
        }
        self.append(
            AppendRequest {
                body,
                idempotency_key: key,
            },
            Some(conn),
            out,
        );
    }

    fn runner_message(&mut self, conn: ConnId, message: RunnerMessage, out: &mut Vec<Output>) {
        if self.runner != Some(conn) {
            let text = if self.clients.contains_key(&conn) {
                "only the runner sends stream parts".to_string()
            } else {
                format!(
                    "this runner was fenced; generation {} is current",
                    self.generation
                )
            };
            let code = if self.clients.contains_key(&conn) {
                "not_a_runner"
            } else {
                "stale_runner"
            };
            out.push(Output::Send {
                conn,
                message: ServerMessage::error(code, text),
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
            RunnerMessage::TurnStatus {
                turn_id,
                status,
                error,
                key,
            } => {
                if status.is_terminal() {
                    self.flush_turn(&turn_id, out);
                }
                let body = FrameBody::TurnStatus {
                    turn_id,
                    status,
                    error,
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
            }
            (BlockEvent::Delta(_) | BlockEvent::End, None) => {
                let message = format!("block {id:?} was never started");
                out.push(Output::Send {
                    conn,
                    message: ServerMessage::error("invalid", message),
                });
            }
            (BlockEvent::Delta(delta), Some(pos)) => {
                let limit = self.config.max_frame_bytes;
                let block = &mut self.open[pos];
                if block.text.len() + delta.len() > limit {
                    let message = format!("block {id:?} would exceed the {limit}-byte frame limit");
                    out.push(Output::Send {
                        conn,
                        message: ServerMessage::error("frame_too_large", message),
                    });
                    return;
                }
                block.text.push_str(delta);
                self.fanout_live(&turn_id, part, out);
            }
            (BlockEvent::End, Some(pos)) => {
                let block = self.open.remove(pos);
                let key = key.unwrap_or_else(|| block.key());
                self.checked_append(block.into_message(false), Some(key), conn, out);
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
            out.push(Output::Send {
                conn,
                message: ServerMessage::error("frame_too_large", e.message()),
            });
            return;
        }
        self.append(
            AppendRequest {
                body,
                idempotency_key: key,
            },
            Some(conn),
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

    fn append(&mut self, request: AppendRequest, reply_to: Option<ConnId>, out: &mut Vec<Output>) {
        self.pending.push_back(reply_to);
        out.push(Output::Append(request));
    }

    /// Live parts are not acknowledged: they are not stored, and a runner
    /// that retries re-sends whole blocks anyway.
    fn fanout_live(&self, turn_id: &str, part: StreamPart, out: &mut Vec<Output>) {
        for &conn in self.clients.keys() {
            out.push(Output::Send {
                conn,
                message: ServerMessage::Live {
                    turn_id: turn_id.to_string(),
                    part: part.clone(),
                },
            });
        }
    }
}

fn sealed_message() -> ServerMessage {
    ServerMessage::error("sealed", "the session is sealed; fork it to continue")
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
