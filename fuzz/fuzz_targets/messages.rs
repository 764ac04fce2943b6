//! Client, runner and server messages and stored frames: the JSON every
//! WebSocket, HTTP body and log row carries, decoded and then fed to the
//! session actor over a log that applies the real log rules.
//!
//! The input is lines; the first byte of a line says what the rest is:
//! `c`/`d` a `ClientMessage` from client 1/3, `r` a `RunnerMessage` from the
//! current runner, `s` a `ServerMessage`, `f` a `Frame`, `p` a `StreamPart`,
//! `x` a control step (`x0` runner leaves, `x1` a newer runner attaches,
//! `x2` a client joins with a replay cursor, `x3` the running turn's
//! dispatch fails, `x4` the log fails the next append).
//!
//! Asserts: every value that decodes re-encodes and decodes to an equal value
//! with a stable encoding; every `ServerMessage` the actor sends does too; the
//! actor answers every client and runner message exactly once (ack, received
//! or error); replays stay within the log; the actor's seq, seal and meta
//! agree with the log's after every step.

#![no_main]

use std::fmt::Debug;

use harness_core::actor::{
    ActorConfig, ClientMessage, ConnId, Input, Output, Role, RunnerMessage, ServerMessage,
    SessionActor,
};
use harness_core::log::LogState;
use harness_core::{ErrorKind, Frame, SessionId, StreamPart};
use libfuzzer_sys::fuzz_target;
use serde::de::DeserializeOwned;
use serde::Serialize;

/// Small, so the size limits are reachable.
const MAX_FRAME_BYTES: usize = 2048;
const CLIENT_A: ConnId = 1;
const CLIENT_B: ConnId = 3;

fn roundtrip<T: Serialize + DeserializeOwned + PartialEq + Debug>(value: &T) {
    let encoded = serde_json::to_vec(value).expect("a decoded value encodes");
    let back: T = serde_json::from_slice(&encoded).unwrap_or_else(|e| {
        panic!(
            "{value:?} encodes to {} which does not decode: {e}",
            String::from_utf8_lossy(&encoded)
        )
    });
    assert_eq!(&back, value, "decode(encode(v)) != v");
    let again = serde_json::to_vec(&back).expect("encodes");
    assert_eq!(again, encoded, "encoding is not stable");
}

fn decode<T: Serialize + DeserializeOwned + PartialEq + Debug>(bytes: &[u8]) -> Option<T> {
    let value: T = serde_json::from_slice(bytes).ok()?;
    roundtrip(&value);
    Some(value)
}

struct World {
    actor: SessionActor,
    log: LogState,
    runner: Option<ConnId>,
    generation: u64,
    next_conn: ConnId,
    fail_next_append: bool,
}

impl World {
    fn new() -> Self {
        let mut w = World {
            actor: SessionActor::new(ActorConfig {
                max_frame_bytes: MAX_FRAME_BYTES,
            }),
            log: LogState::new(SessionId::parse("fuzz").expect("valid id")),
            runner: None,
            generation: 0,
            next_conn: 10,
            fail_next_append: false,
        };
        w.step(Input::Connect {
            conn: CLIENT_A,
            role: Role::Client,
            after: None,
        });
        w.step(Input::Connect {
            conn: CLIENT_B,
            role: Role::Client,
            after: Some(0),
        });
        w.attach_runner();
        w
    }

    fn attach_runner(&mut self) {
        self.generation += 1;
        let conn = self.next_conn;
        self.next_conn += 1;
        self.runner = Some(conn);
        self.step(Input::Connect {
            conn,
            role: Role::Runner {
                generation: self.generation,
            },
            after: None,
        });
    }

    /// Feed `input` and perform every output in order, the way
    /// `ActorDriver` does; returns the replies (ack/received/error) sent to
    /// `watch`.
    fn step_watching(&mut self, input: Input, watch: Option<ConnId>) -> usize {
        let mut queue: std::collections::VecDeque<Output> = self.actor.handle(input).into();
        let mut replies = 0;
        while let Some(output) = queue.pop_front() {
            match output {
                Output::Append(request) => {
                    let result = if std::mem::take(&mut self.fail_next_append) {
                        Input::AppendFailed {
                            kind: ErrorKind::Backend,
                            error: "fuzz: the log failed".into(),
                        }
                    } else {
                        match self.log.append(request, 0, MAX_FRAME_BYTES) {
                            Ok(a) => Input::Appended {
                                frame: a.frame,
                                duplicate: a.duplicate,
                            },
                            Err(e) => Input::AppendFailed {
                                kind: e.kind(),
                                error: e.message().to_string(),
                            },
                        }
                    };
                    queue.extend(self.actor.handle(result));
                }
                Output::Replay { after, until, .. } => {
                    let last = self.log.info().last_seq;
                    assert!(
                        after < until && until <= last,
                        "replay ({after}, {until}] outside the log (last seq {last})"
                    );
                }
                Output::Send { conn, message } => {
                    roundtrip(&message);
                    if Some(conn) == watch
                        && matches!(
                            message,
                            ServerMessage::Ack { .. }
                                | ServerMessage::Received {}
                                | ServerMessage::Error { .. }
                        )
                    {
                        replies += 1;
                    }
                }
                Output::SendAll { conns, message } => {
                    roundtrip(&message);
                    if watch.is_some_and(|w| conns.contains(&w))
                        && matches!(
                            message,
                            ServerMessage::Ack { .. }
                                | ServerMessage::Received {}
                                | ServerMessage::Error { .. }
                        )
                    {
                        replies += 1;
                    }
                }
                Output::Close { conn, .. } => {
                    if self.runner == Some(conn) {
                        self.runner = None;
                    }
                }
                Output::Dispatch(_) => {}
            }
        }
        self.check();
        replies
    }

    fn step(&mut self, input: Input) {
        self.step_watching(input, None);
    }

    fn check(&self) {
        let info = self.log.info();
        assert!(!self.actor.has_pending_appends());
        assert_eq!(self.actor.last_seq(), info.last_seq, "actor and log seq");
        assert_eq!(self.actor.is_sealed(), info.sealed, "actor and log seal");
        // The actor fences a new generation before its frame is stored (and
        // a sealed log stores none), so only generation may run ahead.
        let mut actor_meta = self.actor.meta().clone();
        let mut log_meta = info.meta.clone();
        assert!(actor_meta.generation >= log_meta.generation);
        actor_meta.generation = 0;
        log_meta.generation = 0;
        assert_eq!(actor_meta, log_meta, "actor and log meta");
    }

    fn message(&mut self, input: Input, conn: ConnId) {
        let replies = self.step_watching(input, Some(conn));
        assert_eq!(replies, 1, "one answer per message, got {replies}");
    }
}

fuzz_target!(|data: &[u8]| {
    let mut world = World::new();
    for line in data.split(|&b| b == b'\n') {
        let Some((&kind, rest)) = line.split_first() else {
            continue;
        };
        match kind {
            b'c' | b'd' => {
                if let Some(message) = decode::<ClientMessage>(rest) {
                    let conn = if kind == b'c' { CLIENT_A } else { CLIENT_B };
                    world.message(Input::Client { conn, message }, conn);
                }
            }
            b'r' => {
                if let Some(message) = decode::<RunnerMessage>(rest) {
                    if let Some(conn) = world.runner {
                        world.message(Input::Runner { conn, message }, conn);
                    }
                }
            }
            b's' => {
                decode::<ServerMessage>(rest);
            }
            b'f' => {
                if let Some(frame) = decode::<Frame>(rest) {
                    roundtrip(&frame.body);
                    assert_eq!(
                        Frame::encoded_len(&frame.body),
                        serde_json::to_vec(&frame.body).unwrap().len()
                    );
                }
            }
            b'p' => {
                decode::<StreamPart>(rest);
            }
            b'x' => match rest.first() {
                Some(b'0') => {
                    if let Some(conn) = world.runner.take() {
                        world.step(Input::Disconnect { conn });
                    }
                }
                Some(b'1') => world.attach_runner(),
                Some(b'2') => {
                    let conn = world.next_conn;
                    world.next_conn += 1;
                    let after = world.log.info().last_seq / 2;
                    world.step(Input::Connect {
                        conn,
                        role: Role::Client,
                        after: Some(after),
                    });
                }
                Some(b'3') => {
                    if let Some(turn) = world.actor.meta().active_turn() {
                        let turn_id = turn.turn_id.clone();
                        world.step(Input::DispatchFailed {
                            turn_id,
                            error: "fuzz: no engine".into(),
                        });
                    }
                }
                Some(b'4') => world.fail_next_append = true,
                _ => {}
            },
            _ => {
                // Anything else: each decoder on the whole line.
                decode::<ClientMessage>(line);
                decode::<RunnerMessage>(line);
                decode::<ServerMessage>(line);
                decode::<Frame>(line);
            }
        }
    }
});
