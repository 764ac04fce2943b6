//! The session actor's sans-IO machine, driven by a minimal synchronous
//! wrapper over the in-memory log state (the same loop the tokio and
//! Durable Object wrappers run).

use std::collections::BTreeMap;

use harness_core::actor::{
    ActorConfig, ClientMessage, ConnId, Input, Output, Role, RunnerMessage, ServerMessage,
    SessionActor,
};
use harness_core::frame::{FrameBody, MessageKind, SessionId};
use harness_core::log::LogState;
use harness_core::part::StreamPart;
use harness_core::session::TurnCommand;
use harness_core::turn::TurnStatus;

struct Harness {
    actor: SessionActor,
    log: LogState,
    inbox: BTreeMap<ConnId, Vec<ServerMessage>>,
    closed: Vec<ConnId>,
    dispatched: Vec<TurnCommand>,
}

impl Harness {
    fn new() -> Self {
        Self::with_config(ActorConfig::default())
    }

    fn with_config(config: ActorConfig) -> Self {
        Self {
            actor: SessionActor::new(config),
            log: LogState::new(SessionId::parse("s").unwrap()),
            inbox: BTreeMap::new(),
            closed: Vec::new(),
            dispatched: Vec::new(),
        }
    }

    /// Restart: a new actor starts from the log's info (its folded meta),
    /// without reading a frame.
    fn restart(&mut self) {
        self.actor = SessionActor::from_info(ActorConfig::default(), &self.log.info());
    }

    fn feed(&mut self, input: Input) {
        let mut queue: std::collections::VecDeque<Output> = self.actor.handle(input).into();
        while let Some(out) = queue.pop_front() {
            match out {
                Output::Append(req) => {
                    let before = self.log.info().last_seq;
                    let input = match self.log.append(req, 0, usize::MAX) {
                        Ok(a) => {
                            assert_eq!(a.frame, self.log.read(a.seq - 1, 1).unwrap().remove(0));
                            assert!(a.duplicate || a.seq == before + 1);
                            Input::Appended {
                                frame: a.frame,
                                duplicate: a.duplicate,
                            }
                        }
                        Err(e) => Input::AppendFailed {
                            kind: e.kind(),
                            error: e.to_string(),
                        },
                    };
                    // Results are fed back before anything queued after them.
                    let more = self.actor.handle(input);
                    for (i, o) in more.into_iter().enumerate() {
                        queue.insert(i, o);
                    }
                }
                Output::Replay { conn, after, until } => {
                    for frame in self.log.read(after, (until - after) as usize).unwrap() {
                        self.inbox
                            .entry(conn)
                            .or_default()
                            .push(ServerMessage::Frame { frame });
                    }
                }
                Output::Send { conn, message } => self.inbox.entry(conn).or_default().push(message),
                Output::SendAll { conns, message } => {
                    for conn in conns {
                        self.inbox.entry(conn).or_default().push(message.clone());
                    }
                }
                Output::Close { conn, .. } => self.closed.push(conn),
                Output::Dispatch(command) => self.dispatched.push(command),
            }
        }
    }

    /// The stored messages as (kind, block id, text), in seq order.
    fn messages(&self) -> Vec<(MessageKind, String, String)> {
        self.log
            .read(0, usize::MAX)
            .unwrap()
            .into_iter()
            .filter_map(|f| match f.body {
                FrameBody::Message { kind, id, text, .. } => Some((kind, id, text)),
                _ => None,
            })
            .collect()
    }

    fn take(&mut self, conn: ConnId) -> Vec<ServerMessage> {
        self.inbox.remove(&conn).unwrap_or_default()
    }

    fn seqs(&mut self, conn: ConnId) -> Vec<u64> {
        self.take(conn)
            .into_iter()
            .filter_map(|m| match m {
                ServerMessage::Frame { frame } => Some(frame.seq),
                _ => None,
            })
            .collect()
    }

    fn client(&mut self, conn: ConnId, after: Option<u64>) {
        self.feed(Input::Connect {
            conn,
            role: Role::Client,
            after,
        });
    }

    fn runner(&mut self, conn: ConnId, generation: u64) {
        self.feed(Input::Connect {
            conn,
            role: Role::Runner { generation },
            after: None,
        });
    }

    fn part(&mut self, conn: ConnId, part: StreamPart) {
        self.feed(Input::Runner {
            conn,
            message: RunnerMessage::Part {
                turn_id: "t1".into(),
                part,
                key: None,
            },
        });
    }

    /// A client's answer to a permission request (a frame of the running turn).
    fn answer(&mut self, conn: ConnId, approval_id: &str) {
        self.feed(Input::Client {
            conn,
            message: ClientMessage::ApprovalResponse {
                approval_id: approval_id.into(),
                approved: true,
                reason: None,
            },
        });
    }

    fn status(&mut self, conn: ConnId, turn_id: &str, status: TurnStatus) {
        self.feed(Input::Runner {
            conn,
            message: RunnerMessage::TurnStatus {
                turn_id: turn_id.into(),
                status,
                error: None,
                code: None,
                sandbox: None,
                agent_session_id: None,
                key: None,
                checkpoint: None,
            },
        });
    }

    fn prompt(&mut self, conn: ConnId, text: &str) {
        self.feed(Input::Client {
            conn,
            message: ClientMessage::Prompt {
                text: text.into(),
                turn_id: None,
                key: None,
            },
        });
    }
}

fn error_code(messages: &[ServerMessage]) -> Option<String> {
    messages.iter().find_map(|m| match m {
        ServerMessage::Error { code, .. } => Some(code.as_str().to_string()),
        _ => None,
    })
}

#[test]
fn every_client_sees_every_frame_in_seq_order() {
    let mut h = Harness::new();
    h.client(1, None);
    h.client(2, None);
    h.prompt(1, "hello");
    h.runner(9, 1);
    h.part(
        9,
        StreamPart::ToolCall {
            tool_call_id: "c".into(),
            tool_name: "Bash".into(),
            input: serde_json::json!({}),
        },
    );
    let one = h.seqs(1);
    assert_eq!(one, vec![1, 2, 3], "prompt, runner-attached, tool-call");
    assert_eq!(h.seqs(2), one);
    assert_eq!(h.actor.last_seq(), 3);
}

#[test]
fn writers_get_acks_and_duplicates_are_not_fanned_out() {
    let mut h = Harness::new();
    h.client(1, None);
    h.client(2, None);
    let send = |h: &mut Harness| {
        h.feed(Input::Client {
            conn: 1,
            message: ClientMessage::Prompt {
                text: "p".into(),
                turn_id: None,
                key: Some("k1".into()),
            },
        })
    };
    send(&mut h);
    let first = h.take(1);
    assert!(
        first.contains(&ServerMessage::Ack {
            seq: 1,
            duplicate: false,
            turn_id: Some("t1".into()),
        }),
        "{first:?}"
    );
    h.take(2);
    send(&mut h);
    assert_eq!(
        h.take(1),
        vec![ServerMessage::Ack {
            seq: 1,
            duplicate: true,
            turn_id: Some("t1".into()),
        }]
    );
    assert!(
        h.take(2).is_empty(),
        "a duplicate must not be fanned out again"
    );
    assert_eq!(h.log.info().last_seq, 1);
}

#[test]
fn replay_from_a_cursor_then_live() {
    let mut h = Harness::new();
    h.client(1, None);
    h.prompt(1, "m0");
    for i in 1..5 {
        h.answer(1, &format!("a{i}"));
    }
    h.client(2, Some(2));
    assert_eq!(h.seqs(2), vec![3, 4, 5], "replay after 2");
    h.answer(1, "live");
    assert_eq!(h.seqs(2), vec![6], "then live, no gap, no duplicate");
    h.client(3, Some(6));
    assert!(h.seqs(3).is_empty(), "an up-to-date cursor replays nothing");
    h.client(4, Some(0));
    assert_eq!(h.seqs(4), vec![1, 2, 3, 4, 5, 6]);
}

#[test]
fn text_deltas_go_live_but_are_stored_once() {
    let mut h = Harness::new();
    h.client(1, None);
    h.runner(9, 1);
    h.take(1);
    h.part(9, StreamPart::TextStart { id: "b1".into() });
    for d in ["Hel", "lo, ", "world"] {
        h.part(
            9,
            StreamPart::TextDelta {
                id: "b1".into(),
                delta: d.into(),
            },
        );
    }
    let live = h.take(1);
    assert_eq!(
        live.len(),
        4,
        "start + three deltas reached the live client: {live:?}"
    );
    assert!(live.iter().all(|m| matches!(m, ServerMessage::Live { .. })));
    assert_eq!(
        h.log.info().last_seq,
        1,
        "nothing but runner-attached is stored mid-block"
    );

    // A client joining mid-block gets the partial text.
    h.client(2, None);
    let joined = h.take(2);
    assert_eq!(
        joined,
        vec![
            ServerMessage::Live {
                turn_id: "t1".into(),
                part: StreamPart::TextStart { id: "b1".into() }
            },
            ServerMessage::Live {
                turn_id: "t1".into(),
                part: StreamPart::TextDelta {
                    id: "b1".into(),
                    delta: "Hello, world".into()
                }
            },
        ]
    );

    h.part(9, StreamPart::TextEnd { id: "b1".into() });
    let frames = h.log.read(0, 10).unwrap();
    assert_eq!(frames.len(), 2);
    assert_eq!(
        frames[1].body,
        FrameBody::Message {
            turn_id: "t1".into(),
            id: "b1".into(),
            kind: MessageKind::Text,
            text: "Hello, world".into(),
            interrupted: false
        }
    );
    assert_eq!(h.seqs(1), vec![2]);
    assert_eq!(h.seqs(2), vec![2]);
    // After the block ends a new client sees no partial text.
    h.client(3, None);
    assert!(h.take(3).is_empty());
}

#[test]
fn a_resent_block_starts_over_and_a_retried_end_is_stored_once() {
    let mut h = Harness::new();
    h.runner(9, 1);
    h.part(9, StreamPart::TextStart { id: "b".into() });
    h.part(
        9,
        StreamPart::TextDelta {
            id: "b".into(),
            delta: "partial".into(),
        },
    );
    // The slice is retried: the whole block comes again.
    h.part(9, StreamPart::TextStart { id: "b".into() });
    h.part(
        9,
        StreamPart::TextDelta {
            id: "b".into(),
            delta: "full text".into(),
        },
    );
    h.part(9, StreamPart::TextEnd { id: "b".into() });
    h.part(9, StreamPart::TextStart { id: "b".into() });
    h.part(
        9,
        StreamPart::TextDelta {
            id: "b".into(),
            delta: "full text".into(),
        },
    );
    h.part(9, StreamPart::TextEnd { id: "b".into() });
    let messages: Vec<_> = h
        .log
        .read(0, 10)
        .unwrap()
        .into_iter()
        .filter(|f| matches!(f.body, FrameBody::Message { .. }))
        .collect();
    assert_eq!(messages.len(), 1, "stored once");
    assert!(matches!(&messages[0].body, FrameBody::Message { text, .. } if text == "full text"));
}

#[test]
fn a_turn_ending_mid_block_stores_the_partial_text() {
    let mut h = Harness::new();
    h.runner(9, 1);
    h.part(9, StreamPart::ReasoningStart { id: "r".into() });
    h.part(
        9,
        StreamPart::ReasoningDelta {
            id: "r".into(),
            delta: "thinking".into(),
        },
    );
    h.feed(Input::Runner {
        conn: 9,
        message: RunnerMessage::TurnStatus {
            sandbox: None,
            agent_session_id: None,
            turn_id: "t1".into(),
            status: TurnStatus::Failed,
            error: Some("x".into()),
            code: None,
            key: None,
            checkpoint: None,
        },
    });
    let bodies: Vec<_> = h
        .log
        .read(0, 10)
        .unwrap()
        .into_iter()
        .map(|f| f.body)
        .collect();
    assert!(
        matches!(&bodies[1], FrameBody::Message { kind: MessageKind::Reasoning, text, interrupted: true, .. } if text == "thinking")
    );
    assert!(matches!(
        &bodies[2],
        FrameBody::TurnStatus {
            status: TurnStatus::Failed,
            ..
        }
    ));
}

#[test]
fn a_newer_runner_fences_the_older_one() {
    let mut h = Harness::new();
    h.client(1, None);
    h.runner(10, 1);
    h.runner(20, 2);
    assert!(h.closed.contains(&10), "the old runner is closed");
    assert_eq!(error_code(&h.take(10)).as_deref(), Some("stale_runner"));
    let before = h.log.info().last_seq;
    h.part(
        10,
        StreamPart::Error {
            message: "late write".into(),
        },
    );
    assert_eq!(error_code(&h.take(10)).as_deref(), Some("stale_runner"));
    assert_eq!(
        h.log.info().last_seq,
        before,
        "a fenced runner's write is not stored"
    );
    h.part(
        20,
        StreamPart::Error {
            message: "current".into(),
        },
    );
    assert_eq!(h.log.info().last_seq, before + 1);

    // A lower generation is refused outright, also after a restart (the
    // generation is recovered from the log).
    h.restart();
    assert_eq!(h.actor.generation(), 2);
    h.runner(30, 1);
    assert_eq!(error_code(&h.take(30)).as_deref(), Some("stale_runner"));
    assert!(h.closed.contains(&30));
    // The same generation may reattach once its old connection is gone.
    h.runner(31, 2);
    assert!(h.take(31).is_empty());
    h.runner(32, 2);
    assert_eq!(
        error_code(&h.take(32)).as_deref(),
        Some("stale_runner"),
        "one runner per generation at a time"
    );
}

#[test]
fn clients_cannot_write_as_the_runner_and_vice_versa() {
    let mut h = Harness::new();
    h.client(1, None);
    h.runner(9, 1);
    h.take(1);
    h.part(
        1,
        StreamPart::Error {
            message: "spoof".into(),
        },
    );
    assert_eq!(error_code(&h.take(1)).as_deref(), Some("not_a_runner"));
    h.feed(Input::Client {
        conn: 9,
        message: ClientMessage::Seal {},
    });
    assert_eq!(error_code(&h.take(9)).as_deref(), Some("not_a_client"));
    assert_eq!(h.log.info().last_seq, 1);
}

#[test]
fn seal_refuses_later_writes_and_survives_restart() {
    let mut h = Harness::new();
    h.client(1, None);
    h.runner(9, 1);
    h.prompt(1, "last words");
    assert!(!h.actor.is_sealed());
    h.feed(Input::Client {
        conn: 1,
        message: ClientMessage::Seal {},
    });
    assert!(h.actor.is_sealed());
    let sealed_at = h.log.info().last_seq;
    h.take(1);
    h.prompt(1, "too late");
    assert_eq!(error_code(&h.take(1)).as_deref(), Some("sealed"));
    h.part(
        9,
        StreamPart::Error {
            message: "too late".into(),
        },
    );
    assert_eq!(error_code(&h.take(9)).as_deref(), Some("sealed"));
    assert_eq!(h.log.info().last_seq, sealed_at);
    h.restart();
    assert!(h.actor.is_sealed());
    h.client(2, None);
    h.prompt(2, "after restart");
    assert_eq!(error_code(&h.take(2)).as_deref(), Some("sealed"));
}

#[test]
fn fork_until_n_continues_independently() {
    let mut h = Harness::new();
    h.client(1, None);
    h.prompt(1, "m0");
    for i in 1..4 {
        h.answer(1, &format!("a{i}"));
    }
    let fork = h
        .log
        .fork(2, SessionId::parse("s-fork").unwrap(), 0)
        .unwrap();
    let mut f = Harness::new();
    f.log = fork;
    f.restart();
    // The cut is inside turn t1: the fork closed it with a frame of its own.
    assert_eq!(f.actor.last_seq(), 3);
    assert!(f.actor.meta().active_turn().is_none());
    let turn = f
        .actor
        .meta()
        .turn
        .clone()
        .expect("the fork's meta is folded");
    assert_eq!(turn.turn_id, "t1");
    assert_eq!(turn.status, TurnStatus::Failed);
    // Those answers named no pending request: kept in the log, not the meta.
    assert!(turn.answers.is_empty());
    f.client(1, Some(0));
    assert_eq!(f.seqs(1), vec![1, 2, 3]);
    f.prompt(1, "a new turn in the fork");
    assert_eq!(f.seqs(1), vec![4]);
    assert_eq!(f.actor.meta().active_turn().unwrap().turn_id, "t2");
    assert_eq!(h.log.info().last_seq, 4, "the source is untouched");
}

#[test]
fn oversized_frames_are_refused_and_nothing_is_stored() {
    let mut h = Harness::with_config(ActorConfig {
        max_frame_bytes: 64,
    });
    h.client(1, None);
    h.prompt(1, &"x".repeat(100));
    assert_eq!(error_code(&h.take(1)).as_deref(), Some("frame_too_large"));
    h.runner(9, 1);
    h.part(9, StreamPart::TextStart { id: "b".into() });
    h.part(
        9,
        StreamPart::TextDelta {
            id: "b".into(),
            delta: "y".repeat(100),
        },
    );
    assert_eq!(error_code(&h.take(9)).as_deref(), Some("frame_too_large"));
    assert_eq!(h.log.info().last_seq, 1, "only runner-attached was stored");
}

#[test]
fn a_failed_append_is_reported_to_the_writer() {
    let mut h = Harness::new();
    h.client(1, None);
    // Seal the log behind the actor's back: its next append fails, and the
    // log's reason (a conflict) reaches the writer as a typed code.
    h.log.seal(0);
    h.take(1);
    h.prompt(1, "x");
    assert_eq!(error_code(&h.take(1)).as_deref(), Some("conflict"));
    assert!(
        h.dispatched.is_empty(),
        "nothing stored, nothing dispatched"
    );
}

#[test]
fn a_prompt_opens_one_turn_and_asks_for_it_to_start() {
    let mut h = Harness::new();
    h.client(1, None);
    h.prompt(1, "first");
    match h.dispatched.as_slice() {
        [TurnCommand::Start {
            turn_id, prompt, ..
        }] => assert_eq!((turn_id.as_str(), prompt.as_str()), ("t1", "first")),
        other => panic!("{other:?}"),
    }
    let stored = h.log.read(0, 10).unwrap();
    assert!(
        matches!(&stored[0].body, FrameBody::UserMessage { turn_id: Some(t), .. } if t == "t1"),
        "the assigned turn id is stored: {stored:?}"
    );
    h.take(1);
    // One turn at a time: a second prompt is refused and stores nothing.
    h.prompt(1, "second");
    assert_eq!(error_code(&h.take(1)).as_deref(), Some("turn_in_progress"));
    assert_eq!(h.log.info().last_seq, 1);
    assert_eq!(h.dispatched.len(), 1);
    // Answers and aborts reach the running turn.
    h.answer(1, "ap1");
    h.feed(Input::Client {
        conn: 1,
        message: ClientMessage::Abort {
            turn_id: None,
            reason: Some("stop".into()),
        },
    });
    assert!(
        matches!(&h.dispatched[1], TurnCommand::Answer { turn_id, answer } if turn_id == "t1" && answer.approval_id == "ap1")
    );
    assert!(
        matches!(&h.dispatched[2], TurnCommand::Abort { turn_id, reason } if turn_id == "t1" && reason == "stop")
    );
    // The runner records the end: the session takes the next prompt.
    h.runner(9, 1);
    h.status(9, "t1", TurnStatus::Failed);
    h.prompt(1, "second");
    assert!(
        matches!(h.dispatched.last(), Some(TurnCommand::Start { turn_id, .. }) if turn_id == "t2")
    );
}

#[test]
fn only_the_answer_to_the_pending_request_is_kept_in_the_meta() {
    let mut h = Harness::new();
    h.client(1, None);
    h.prompt(1, "go");
    h.runner(9, 1);
    h.part(
        9,
        StreamPart::ToolApprovalRequest {
            approval_id: "ap1".into(),
            tool_call_id: "c1".into(),
            tool_name: "Bash".into(),
            input: serde_json::json!({}),
        },
    );
    let turn = h.actor.meta().active_turn().unwrap().clone();
    assert_eq!(turn.approval.as_deref(), Some("ap1"));
    // Many answers to nothing: stored, folded into nothing.
    for i in 0..50 {
        h.answer(1, &format!("bogus{i}"));
    }
    assert!(h.actor.meta().active_turn().unwrap().answers.is_empty());
    h.answer(1, "ap1");
    let turn = h.actor.meta().active_turn().unwrap().clone();
    assert_eq!(turn.approval, None);
    assert_eq!(turn.answers.len(), 1);
    assert_eq!(
        h.log.info().meta,
        *h.actor.meta(),
        "the log folded the same"
    );
}

#[test]
fn answers_and_aborts_without_a_running_turn_are_refused() {
    let mut h = Harness::new();
    h.client(1, None);
    h.answer(1, "ap");
    assert_eq!(error_code(&h.take(1)).as_deref(), Some("no_active_turn"));
    h.feed(Input::Client {
        conn: 1,
        message: ClientMessage::Abort {
            turn_id: None,
            reason: None,
        },
    });
    assert_eq!(error_code(&h.take(1)).as_deref(), Some("no_active_turn"));
    h.prompt(1, "go");
    h.take(1);
    h.feed(Input::Client {
        conn: 1,
        message: ClientMessage::Abort {
            turn_id: Some("t7".into()),
            reason: None,
        },
    });
    assert_eq!(error_code(&h.take(1)).as_deref(), Some("no_active_turn"));
    assert_eq!(h.log.info().last_seq, 1, "refusals store nothing");
}

#[test]
fn a_retried_prompt_is_a_duplicate_and_dispatches_nothing_twice() {
    let mut h = Harness::new();
    h.client(1, None);
    let send = |h: &mut Harness| {
        h.feed(Input::Client {
            conn: 1,
            message: ClientMessage::Prompt {
                text: "once".into(),
                turn_id: None,
                key: Some("k".into()),
            },
        })
    };
    send(&mut h);
    h.take(1);
    send(&mut h); // while its turn runs
    assert_eq!(
        h.take(1),
        vec![ServerMessage::Ack {
            seq: 1,
            duplicate: true,
            turn_id: Some("t1".into()),
        }]
    );
    h.restart(); // the key survives in the log's meta
    h.client(1, None);
    send(&mut h);
    assert_eq!(
        h.take(1),
        vec![ServerMessage::Ack {
            seq: 1,
            duplicate: true,
            turn_id: Some("t1".into()),
        }]
    );
    assert_eq!(h.dispatched.len(), 1);
}

#[test]
fn a_turn_that_cannot_start_is_recorded_failed() {
    let mut h = Harness::new();
    h.client(1, None);
    h.prompt(1, "go");
    h.take(1);
    h.feed(Input::DispatchFailed {
        turn_id: "t1".into(),
        error: "no engine".into(),
    });
    let last = h.log.read(1, 10).unwrap().remove(0);
    match last.body {
        FrameBody::TurnStatus { status, error, .. } => {
            assert_eq!(status, TurnStatus::Failed);
            assert!(error.unwrap().contains("no engine"));
        }
        other => panic!("{other:?}"),
    }
    assert!(h.actor.meta().active_turn().is_none());
    // Clients saw it live.
    assert_eq!(h.seqs(1), vec![2]);
}

#[test]
fn a_restarted_actor_knows_the_generation_and_the_running_turn_from_meta() {
    let mut h = Harness::new();
    h.client(1, None);
    h.runner(9, 4);
    h.prompt(1, "go");
    h.restart();
    assert_eq!(h.actor.generation(), 4);
    let turn = h.actor.meta().active_turn().expect("running turn");
    assert_eq!(turn.turn_id, "t1");
    let pending = h.actor.meta().pending_commands();
    assert!(matches!(&pending[..], [TurnCommand::Start { prompt, .. }] if prompt == "go"));
    h.runner(10, 3);
    assert_eq!(error_code(&h.take(10)).as_deref(), Some("stale_runner"));
}

#[test]
fn each_block_of_a_turn_is_its_own_message_and_reasoning_is_stored_as_reasoning() {
    let mut h = Harness::new();
    h.runner(9, 1);
    let block = |h: &mut Harness, id: &str, reasoning: bool, text: &str| {
        let id = id.to_string();
        let (start, delta, end) = if reasoning {
            (
                StreamPart::ReasoningStart { id: id.clone() },
                StreamPart::ReasoningDelta {
                    id: id.clone(),
                    delta: text.into(),
                },
                StreamPart::ReasoningEnd { id },
            )
        } else {
            (
                StreamPart::TextStart { id: id.clone() },
                StreamPart::TextDelta {
                    id: id.clone(),
                    delta: text.into(),
                },
                StreamPart::TextEnd { id },
            )
        };
        for part in [start, delta, end] {
            h.part(9, part);
        }
    };
    block(&mut h, "r1", true, "thinking");
    block(&mut h, "b1", false, "first");
    block(&mut h, "b2", false, "second");
    let messages = h.messages();
    // Each block is stored once, under a key of its own (turn, kind, id):
    // the second text block is not a duplicate of the first.
    assert_eq!(
        messages,
        vec![
            (MessageKind::Reasoning, "r1".into(), "thinking".into()),
            (MessageKind::Text, "b1".into(), "first".into()),
            (MessageKind::Text, "b2".into(), "second".into()),
        ]
    );
}

#[test]
fn recovering_from_the_frames_gives_the_state_the_meta_gives() {
    let mut h = Harness::new();
    h.client(1, None);
    h.runner(9, 3);
    h.prompt(1, "hello");
    h.feed(Input::Client {
        conn: 1,
        message: ClientMessage::Seal {},
    });
    let info = h.log.info();
    // A log that keeps no meta: a new actor folds every frame.
    let mut recovered = SessionActor::new(ActorConfig::default());
    for frame in h.log.read(0, usize::MAX).unwrap() {
        recovered.recover(&frame);
    }
    let from_meta = SessionActor::from_info(ActorConfig::default(), &info);
    assert_eq!(recovered.last_seq(), info.last_seq);
    assert!(recovered.last_seq() >= 3, "{}", recovered.last_seq());
    assert!(recovered.is_sealed());
    assert_eq!(recovered.generation(), 3);
    assert_eq!(recovered.meta(), from_meta.meta());
    assert_eq!(recovered.meta().turns, 1);
}

#[test]
fn the_actor_says_who_is_attached() {
    let mut h = Harness::new();
    assert!(!h.actor.has_runner());
    assert!(!h.actor.has_tool_host());
    h.runner(9, 1);
    assert!(h.actor.has_runner());
    h.feed(Input::Connect {
        conn: 5,
        role: Role::ToolHost { takeover: false },
        after: None,
    });
    assert!(h.actor.has_tool_host());
    assert_eq!(h.actor.connection_count(), 2);
    h.feed(Input::Disconnect { conn: 9 });
    h.feed(Input::Disconnect { conn: 5 });
    assert!(!h.actor.has_runner());
    assert!(!h.actor.has_tool_host());
    assert_eq!(h.actor.connection_count(), 0);
}

#[test]
fn appends_in_flight_are_known_until_their_results_come_back() {
    let mut actor = SessionActor::new(ActorConfig::default());
    assert!(!actor.has_pending_appends());
    actor.handle(Input::Connect {
        conn: 1,
        role: Role::Client,
        after: None,
    });
    let out = actor.handle(Input::Client {
        conn: 1,
        message: ClientMessage::Prompt {
            text: "go".into(),
            turn_id: None,
            key: None,
        },
    });
    assert!(
        out.iter().any(|o| matches!(o, Output::Append(_))),
        "{out:?}"
    );
    assert!(actor.has_pending_appends());
    actor.handle(Input::AppendFailed {
        kind: harness_core::ErrorKind::InvalidInput,
        error: "refused".into(),
    });
    assert!(!actor.has_pending_appends());
}

#[test]
fn a_write_the_log_finds_invalid_is_refused_as_invalid() {
    let mut actor = SessionActor::new(ActorConfig::default());
    actor.handle(Input::Connect {
        conn: 1,
        role: Role::Client,
        after: None,
    });
    actor.handle(Input::Client {
        conn: 1,
        message: ClientMessage::Prompt {
            text: "go".into(),
            turn_id: None,
            key: None,
        },
    });
    let out = actor.handle(Input::AppendFailed {
        kind: harness_core::ErrorKind::InvalidInput,
        error: "a bad frame".into(),
    });
    let codes: Vec<String> = out
        .iter()
        .filter_map(|o| match o {
            Output::Send {
                conn: 1,
                message: ServerMessage::Error { code, .. },
            } => Some(code.as_str().to_string()),
            _ => None,
        })
        .collect();
    assert_eq!(codes, vec!["invalid".to_string()]);
}

#[test]
fn a_failed_dispatch_of_a_turn_that_is_not_running_stores_nothing() {
    let mut h = Harness::new();
    h.client(1, None);
    h.runner(9, 1);
    h.prompt(1, "go");
    h.status(9, "t1", TurnStatus::Finished);
    let before = h.log.info().last_seq;
    assert!(h.actor.meta().active_turn().is_none());
    h.feed(Input::DispatchFailed {
        turn_id: "t1".into(),
        error: "no engine".into(),
    });
    assert_eq!(h.log.info().last_seq, before, "an ended turn stays ended");
}

#[test]
fn a_turn_id_the_client_names_must_be_new_and_1_to_128_characters() {
    let mut h = Harness::new();
    h.client(1, None);
    h.runner(9, 1);
    h.prompt(1, "first");
    h.status(9, "t1", TurnStatus::Finished);
    h.take(1);
    let before = h.log.info().last_seq;
    let named = |h: &mut Harness, id: String| {
        h.feed(Input::Client {
            conn: 1,
            message: ClientMessage::Prompt {
                text: "again".into(),
                turn_id: Some(id),
                key: None,
            },
        });
        error_code(&h.take(1))
    };
    assert_eq!(named(&mut h, "t1".into()).as_deref(), Some("conflict"));
    assert_eq!(named(&mut h, String::new()).as_deref(), Some("invalid"));
    assert_eq!(named(&mut h, "x".repeat(129)).as_deref(), Some("invalid"));
    assert_eq!(h.log.info().last_seq, before, "nothing stored on a refusal");
    assert_eq!(named(&mut h, "y".repeat(128)), None);
    assert_eq!(
        h.actor.meta().active_turn().map(|t| t.turn_id.clone()),
        Some("y".repeat(128))
    );
}

#[test]
fn a_runner_reattaching_with_the_current_generation_stores_nothing() {
    let mut h = Harness::new();
    h.runner(9, 2);
    let attached = h.log.info().last_seq;
    assert_eq!(attached, 1, "the new generation is recorded");
    h.feed(Input::Disconnect { conn: 9 });
    h.runner(10, 2);
    assert!(h.take(10).is_empty());
    assert_eq!(h.log.info().last_seq, attached, "no second runner-attached");
    assert!(h.actor.has_runner());
}

#[test]
fn an_abort_may_name_the_running_turn_but_no_other() {
    let mut h = Harness::new();
    h.client(1, None);
    h.runner(9, 1);
    h.prompt(1, "go");
    h.take(1);
    let abort = |h: &mut Harness, turn: &str| {
        h.feed(Input::Client {
            conn: 1,
            message: ClientMessage::Abort {
                turn_id: Some(turn.into()),
                reason: None,
            },
        });
        error_code(&h.take(1))
    };
    let before = h.log.info().last_seq;
    assert_eq!(abort(&mut h, "t7").as_deref(), Some("no_active_turn"));
    assert_eq!(h.log.info().last_seq, before);
    assert_eq!(abort(&mut h, "t1"), None);
    let last = h.log.read(before, 1).unwrap().remove(0);
    assert!(
        matches!(&last.body, FrameBody::AbortRequested { turn_id, .. } if turn_id == "t1"),
        "{last:?}"
    );
}

#[test]
fn blocks_open_at_once_are_told_apart_by_id_and_kind() {
    let mut h = Harness::new();
    h.runner(9, 1);
    let delta = |id: &str, text: &str| StreamPart::TextDelta {
        id: id.into(),
        delta: text.into(),
    };
    for part in [
        StreamPart::TextStart { id: "a".into() },
        StreamPart::ReasoningStart { id: "a".into() },
        StreamPart::TextStart { id: "b".into() },
        delta("a", "one"),
        StreamPart::ReasoningDelta {
            id: "a".into(),
            delta: "hmm".into(),
        },
        delta("b", "two"),
        StreamPart::TextEnd { id: "b".into() },
        StreamPart::ReasoningEnd { id: "a".into() },
        StreamPart::TextEnd { id: "a".into() },
    ] {
        h.part(9, part);
    }
    let messages = h.messages();
    assert_eq!(
        messages,
        vec![
            (MessageKind::Text, "b".into(), "two".into()),
            (MessageKind::Reasoning, "a".into(), "hmm".into()),
            (MessageKind::Text, "a".into(), "one".into()),
        ]
    );
}

#[test]
fn a_block_may_grow_to_the_frame_limit_and_no_further() {
    let mut h = Harness::with_config(ActorConfig {
        max_frame_bytes: 64,
    });
    h.runner(9, 1);
    h.take(9);
    h.part(9, StreamPart::TextStart { id: "b".into() });
    let delta = |text: String| StreamPart::TextDelta {
        id: "b".into(),
        delta: text,
    };
    h.part(9, delta("x".repeat(64)));
    assert_eq!(error_code(&h.take(9)), None, "64 bytes of a 64-byte limit");
    h.part(9, delta("y".into()));
    assert_eq!(error_code(&h.take(9)).as_deref(), Some("frame_too_large"));
}

#[test]
fn a_frame_of_exactly_the_limit_is_stored() {
    let part = StreamPart::Error {
        message: "exactly at the limit".into(),
    };
    let body = FrameBody::Part {
        turn_id: "t1".into(),
        part: part.clone(),
    };
    let size = harness_core::frame::Frame::encoded_len(&body);
    for (limit, stored) in [(size, true), (size - 1, false)] {
        let mut h = Harness::with_config(ActorConfig {
            max_frame_bytes: limit,
        });
        h.runner(9, 1);
        h.take(9);
        let before = h.log.info().last_seq;
        h.part(9, part.clone());
        assert_eq!(h.log.info().last_seq > before, stored, "limit {limit}");
        if !stored {
            assert_eq!(error_code(&h.take(9)).as_deref(), Some("frame_too_large"));
        }
    }
}
