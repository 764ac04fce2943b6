//! Host tools in the session actor's sans-IO machine: the host lease, the
//! four outcomes, budgets and deadlines, and exactly-once across repeats,
//! reconnects and restarts. Driven by a synchronous wrapper over the
//! in-memory log state (the loop every runtime's wrapper runs), with a
//! clock the test moves. CPU only.

use std::collections::{BTreeMap, VecDeque};

use harness_core::actor::{
    ActorConfig, ClientMessage, ConnId, Input, Output, Role, RunnerMessage, ServerMessage,
    SessionActor,
};
use harness_core::frame::{Frame, FrameBody, SessionId};
use harness_core::log::LogState;
use harness_core::relay::{
    HostCall, HostCallRequest, HostMessage, HostOutcome, ToolSpec, DEFAULT_TIMEOUT_MS,
};
use harness_core::turn::TurnStatus;
use serde_json::json;

const CLIENT: ConnId = 1;
const RUNNER: ConnId = 2;
const HOST: ConnId = 3;

struct Harness {
    actor: SessionActor,
    log: LogState,
    now_ms: u64,
    inbox: BTreeMap<ConnId, Vec<ServerMessage>>,
    closed: Vec<ConnId>,
}

impl Harness {
    /// A session with a client, a running turn t1 and its runner.
    fn with_turn() -> Self {
        let mut h = Self {
            actor: SessionActor::new(ActorConfig::default()),
            log: LogState::new(SessionId::parse("s").unwrap()),
            now_ms: 1_000_000,
            inbox: BTreeMap::new(),
            closed: Vec::new(),
        };
        h.tick(0);
        h.connect(CLIENT, Role::Client);
        h.feed(Input::Client {
            conn: CLIENT,
            message: ClientMessage::Prompt {
                text: "go".into(),
                turn_id: None,
                key: None,
            },
        });
        h.connect(RUNNER, Role::Runner { generation: 1 });
        h.take(CLIENT);
        h
    }

    /// [`with_turn`](Self::with_turn), a host offering `lookup`, and call
    /// `call_id` out at it (the host's inbox read: it got that one call).
    fn with_call_out(call_id: &str) -> Self {
        let mut h = Self::with_turn();
        h.host(HOST, false, &["lookup"]);
        h.take(HOST);
        h.call(RUNNER, call_id);
        assert_eq!(h.host_calls(HOST).len(), 1);
        h
    }

    fn feed(&mut self, input: Input) {
        let mut queue: VecDeque<Output> = self.actor.handle(input).into();
        while let Some(out) = queue.pop_front() {
            match out {
                Output::Append(req) => {
                    let input = match self.log.append(req, self.now_ms, usize::MAX) {
                        Ok(a) => Input::Appended {
                            frame: a.frame,
                            duplicate: a.duplicate,
                        },
                        Err(e) => Input::AppendFailed {
                            kind: e.kind(),
                            error: e.to_string(),
                        },
                    };
                    let more = self.actor.handle(input);
                    for (i, o) in more.into_iter().enumerate() {
                        queue.insert(i, o);
                    }
                }
                Output::Send { conn, message } => self.inbox.entry(conn).or_default().push(message),
                Output::SendAll { conns, message } => {
                    for conn in conns {
                        self.inbox.entry(conn).or_default().push(message.clone());
                    }
                }
                Output::Close { conn, .. } => self.closed.push(conn),
                Output::Replay { .. } | Output::Dispatch(_) => {}
            }
        }
    }

    fn connect(&mut self, conn: ConnId, role: Role) {
        self.feed(Input::Connect {
            conn,
            role,
            after: None,
        });
    }

    /// Attach a host offering `tools` (names; any arguments).
    fn host(&mut self, conn: ConnId, takeover: bool, tools: &[&str]) {
        self.connect(conn, Role::ToolHost { takeover });
        let tools = tools
            .iter()
            .map(|n| ToolSpec::new(*n, "a test tool", json!({"type": "object"})))
            .collect();
        self.feed(Input::ToolHost {
            conn,
            message: HostMessage::Declare { tools },
        });
    }

    fn tick(&mut self, advance_ms: u64) {
        self.now_ms += advance_ms;
        self.feed(Input::Tick {
            now_ms: self.now_ms,
        });
    }

    fn call(&mut self, runner: ConnId, call_id: &str) {
        self.call_with(runner, request(call_id, "lookup"));
    }

    fn call_with(&mut self, runner: ConnId, call: HostCallRequest) {
        self.feed(Input::Runner {
            conn: runner,
            message: RunnerMessage::HostCall {
                turn_id: "t1".into(),
                call,
            },
        });
    }

    fn result(&mut self, host: ConnId, call_id: &str, output: &str) {
        self.feed(Input::ToolHost {
            conn: host,
            message: HostMessage::Result {
                call_id: call_id.into(),
                output: output.into(),
                is_error: false,
                produced_bytes: None,
            },
        });
    }

    fn take(&mut self, conn: ConnId) -> Vec<ServerMessage> {
        self.inbox.remove(&conn).unwrap_or_default()
    }

    /// The calls the host received (and the rest of its inbox).
    fn host_calls(&mut self, conn: ConnId) -> Vec<HostCall> {
        self.take(conn)
            .into_iter()
            .filter_map(|m| match m {
                ServerMessage::HostCall { call } => Some(call),
                _ => None,
            })
            .collect()
    }

    /// The outcome frames a runner received.
    fn outcomes(&mut self, conn: ConnId) -> Vec<(String, HostOutcome)> {
        self.take(conn)
            .into_iter()
            .filter_map(|m| match m {
                ServerMessage::Frame {
                    frame:
                        Frame {
                            body:
                                FrameBody::HostOutcome {
                                    call_id, outcome, ..
                                },
                            ..
                        },
                } => Some((call_id, outcome)),
                _ => None,
            })
            .collect()
    }

    /// Stored (host-call, host-outcome) frame counts.
    fn stored(&self) -> (usize, usize) {
        let frames = self.log.read(0, usize::MAX).unwrap();
        let calls = frames
            .iter()
            .filter(|f| matches!(f.body, FrameBody::HostCall { .. }))
            .count();
        let outcomes = frames
            .iter()
            .filter(|f| matches!(f.body, FrameBody::HostOutcome { .. }))
            .count();
        (calls, outcomes)
    }

    /// A new actor from the log's info, then the active turn's frames from
    /// its start seq — what `ActorDriver::recover` does.
    fn restart(&mut self) {
        let info = self.log.info();
        self.actor = SessionActor::from_info(ActorConfig::default(), &info);
        let start = info.meta.active_turn().expect("a turn runs").start_seq;
        assert!(start > 0, "the meta knows where the turn starts");
        for frame in self.log.read(start - 1, usize::MAX).unwrap() {
            self.actor.recover_turn_frame(&frame);
        }
        self.inbox.clear();
        self.tick(0);
    }
}

fn request(call_id: &str, tool: &str) -> HostCallRequest {
    HostCallRequest {
        call_id: call_id.into(),
        tool: tool.into(),
        input: json!({"q": call_id}),
        byte_budget: None,
        timeout_ms: None,
    }
}

fn error_code(messages: &[ServerMessage]) -> Option<&'static str> {
    messages.iter().find_map(|m| match m {
        ServerMessage::Error { code, .. } => Some(code.as_str()),
        _ => None,
    })
}

fn completed(output: &str) -> HostOutcome {
    HostOutcome::Completed {
        output: output.into(),
        is_error: false,
        truncated: false,
    }
}

#[test]
fn a_call_goes_to_the_host_once_and_its_result_is_the_outcome() {
    let mut h = Harness::with_turn();
    h.host(HOST, false, &["lookup"]);
    assert!(matches!(h.take(HOST)[..], [ServerMessage::Received {}]));
    h.call(RUNNER, "c1");
    let calls = h.host_calls(HOST);
    assert_eq!(calls.len(), 1, "{calls:?}");
    assert_eq!(calls[0].input, json!({"q": "c1"}));
    assert_eq!(
        calls[0].deadline_at_ms,
        h.now_ms + DEFAULT_TIMEOUT_MS,
        "the deadline runs from when the call was stored"
    );
    // Nothing reaches the runner until the host answers.
    assert!(h.outcomes(RUNNER).is_empty());
    h.result(HOST, "c1", "42 rows");
    assert_eq!(
        h.outcomes(RUNNER),
        vec![("c1".into(), completed("42 rows"))]
    );
    assert_eq!(h.stored(), (1, 1));
    // Clients see the call and its outcome like any frames.
    let seen: Vec<&str> = h
        .take(CLIENT)
        .iter()
        .filter_map(|m| match m {
            ServerMessage::Frame { frame } => Some(match frame.body {
                FrameBody::HostCall { .. } => "call",
                FrameBody::HostOutcome { .. } => "outcome",
                _ => "other",
            }),
            _ => None,
        })
        .collect();
    assert_eq!(seen, ["call", "outcome"]);
}

#[test]
fn without_a_host_or_the_tool_a_call_is_unavailable_and_nothing_runs() {
    let mut h = Harness::with_turn();
    h.call(RUNNER, "c1");
    match &h.outcomes(RUNNER)[..] {
        [(id, HostOutcome::Unavailable { reason })] => {
            assert_eq!(id, "c1");
            assert!(reason.contains("no tool host"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    h.host(HOST, false, &["lookup"]);
    h.take(HOST);
    h.call_with(RUNNER, request("c2", "fetch"));
    match &h.outcomes(RUNNER)[..] {
        [(_, HostOutcome::Unavailable { reason })] => {
            assert!(reason.contains("does not offer \"fetch\""), "{reason}");
            assert!(reason.contains("lookup"), "names what it offers: {reason}");
        }
        other => panic!("{other:?}"),
    }
    assert!(h.host_calls(HOST).is_empty(), "nothing went to the host");
    // Unavailable is recorded: the same id answers the same, even once a
    // host offers the tool (a retry is a new call id).
    h.call(RUNNER, "c1");
    assert!(matches!(
        &h.outcomes(RUNNER)[..],
        [(_, HostOutcome::Unavailable { .. })]
    ));
    assert!(h.host_calls(HOST).is_empty());
    assert_eq!(h.stored(), (2, 2));
}

#[test]
fn a_thousand_repeated_call_ids_each_run_once() {
    let mut h = Harness::with_turn();
    h.host(HOST, false, &["lookup"]);
    h.take(HOST);
    let mut ran: BTreeMap<String, usize> = BTreeMap::new();
    let mut runner = RUNNER;
    let mut generation = 1;
    for i in 0..1000 {
        let id = format!("call-{i}");
        h.call(runner, &id);
        // Every third call is repeated while it is out.
        if i % 3 == 0 {
            h.call(runner, &id);
        }
        // Every seventh, the runner is replaced (a new slice) while it is
        // out, and the new one asks again.
        if i % 7 == 0 {
            generation += 1;
            runner = 100 + generation;
            h.connect(runner, Role::Runner { generation });
            h.call(runner, &id);
        }
        for call in h.host_calls(HOST) {
            *ran.entry(call.call_id.clone()).or_default() += 1;
            h.result(HOST, &call.call_id, &format!("answer {}", call.call_id));
        }
        h.take(HOST);
        // And once done, asked again: the recorded outcome.
        h.call(runner, &id);
        let outcomes = h.outcomes(runner);
        assert!(
            !outcomes.is_empty()
                && outcomes
                    .iter()
                    .all(|(c, o)| *c == id && *o == completed(&format!("answer {id}"))),
            "{id}: {outcomes:?}"
        );
    }
    assert_eq!(ran.len(), 1000);
    assert!(
        ran.values().all(|&n| n == 1),
        "a call ran twice: {:?}",
        ran.iter().find(|(_, &n)| n != 1)
    );
    assert_eq!(h.stored(), (1000, 1000));
}

#[test]
fn the_deadline_passing_is_a_timeout_and_the_host_is_told_to_cancel() {
    let mut h = Harness::with_turn();
    h.host(HOST, false, &["lookup"]);
    h.take(HOST);
    let mut call = request("slow", "lookup");
    call.timeout_ms = Some(5_000);
    h.call_with(RUNNER, call);
    let deadline = h.host_calls(HOST)[0].deadline_at_ms;
    assert_eq!(h.actor.next_deadline(), Some(deadline));
    h.tick(4_999);
    assert!(h.outcomes(RUNNER).is_empty(), "not yet");
    h.tick(1);
    assert_eq!(
        h.outcomes(RUNNER),
        vec![(
            "slow".into(),
            HostOutcome::Timeout {
                deadline_at_ms: deadline
            }
        )]
    );
    assert!(
        h.take(HOST)
            .iter()
            .any(|m| matches!(m, ServerMessage::HostCancel { call_id, .. } if call_id == "slow")),
        "the host is told to cancel"
    );
    assert_eq!(h.actor.next_deadline(), None);
    // A late result is dropped and changes nothing.
    h.result(HOST, "slow", "too late");
    assert_eq!(error_code(&h.take(HOST)), Some("invalid"));
    h.call(RUNNER, "slow");
    assert!(matches!(
        &h.outcomes(RUNNER)[..],
        [(_, HostOutcome::Timeout { .. })]
    ));
    assert_eq!(h.stored(), (1, 1));
}

#[test]
fn the_host_leaving_mid_call_is_ambiguous_and_the_call_never_runs_again() {
    let mut h = Harness::with_turn();
    h.host(HOST, false, &["lookup"]);
    h.take(HOST);
    h.call(RUNNER, "c1");
    assert_eq!(h.host_calls(HOST).len(), 1);
    h.feed(Input::Disconnect { conn: HOST });
    match &h.outcomes(RUNNER)[..] {
        [(_, HostOutcome::Ambiguous { reason })] => {
            assert!(reason.contains("disconnected"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
    // A new host attaches; the repeated call id is answered from the log,
    // never sent to it.
    h.host(HOST + 1, false, &["lookup"]);
    h.take(HOST + 1);
    h.call(RUNNER, "c1");
    assert!(matches!(
        &h.outcomes(RUNNER)[..],
        [(_, HostOutcome::Ambiguous { .. })]
    ));
    assert!(h.host_calls(HOST + 1).is_empty());
    assert_eq!(h.stored(), (1, 1));
}

#[test]
fn one_host_lease_a_second_host_is_refused_unless_it_takes_over() {
    let mut h = Harness::with_turn();
    h.host(HOST, false, &["lookup"]);
    h.take(HOST);
    h.call(RUNNER, "c1");
    h.take(HOST);
    // Refused: it gets the code, is closed, and cannot send results.
    h.connect(HOST + 1, Role::ToolHost { takeover: false });
    assert_eq!(error_code(&h.take(HOST + 1)), Some("host_lease_held"));
    assert!(h.closed.contains(&(HOST + 1)));
    h.result(HOST + 1, "c1", "forged");
    assert_eq!(error_code(&h.take(HOST + 1)), Some("not_a_host"));
    assert!(
        h.outcomes(RUNNER).is_empty(),
        "the holder's call is still out"
    );
    // Takeover: the old host is told and closed, its call is ambiguous.
    h.host(HOST + 2, true, &["lookup"]);
    assert_eq!(error_code(&h.take(HOST)), Some("host_lease_held"));
    assert!(h.closed.contains(&HOST));
    assert!(matches!(
        &h.outcomes(RUNNER)[..],
        [(_, HostOutcome::Ambiguous { .. })]
    ));
    // The old host's late result is refused.
    h.result(HOST, "c1", "late");
    assert_eq!(error_code(&h.take(HOST)), Some("not_a_host"));
    // The new host serves new calls.
    h.take(HOST + 2);
    h.call(RUNNER, "c2");
    assert_eq!(h.host_calls(HOST + 2).len(), 1);
    // Runners learn the tools of the lease holder.
    h.feed(Input::Runner {
        conn: RUNNER,
        message: RunnerMessage::HostTools {},
    });
    match &h.take(RUNNER)[..] {
        [ServerMessage::HostTools { tools }] => assert_eq!(tools[0].name, "lookup"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn results_are_cut_to_the_byte_budget_with_a_marker() {
    let mut h = Harness::with_turn();
    h.host(HOST, false, &["lookup"]);
    h.take(HOST);
    let mut call = request("big", "lookup");
    call.byte_budget = Some(10);
    h.call_with(RUNNER, call);
    assert_eq!(
        h.host_calls(HOST)[0].byte_budget,
        10,
        "the host knows the budget"
    );
    for chunk in ["0123456", "789abcdef"] {
        h.feed(Input::ToolHost {
            conn: HOST,
            message: HostMessage::Chunk {
                call_id: "big".into(),
                data: chunk.into(),
            },
        });
    }
    h.result(HOST, "big", "ghij");
    match &h.outcomes(RUNNER)[..] {
        [(
            _,
            HostOutcome::Completed {
                output,
                truncated: true,
                ..
            },
        )] => {
            assert!(output.starts_with("0123456789\n"), "{output}");
            assert!(output.contains("10 of 20 bytes shown"), "{output}");
        }
        other => panic!("{other:?}"),
    }
    // Within budget: whole, unmarked.
    h.take(HOST);
    h.call(RUNNER, "small");
    h.result(HOST, "small", "fits");
    assert_eq!(
        h.outcomes(RUNNER),
        vec![("small".into(), completed("fits"))]
    );
}

#[test]
fn bad_calls_are_refused_and_store_nothing() {
    let mut h = Harness::with_turn();
    h.host(HOST, false, &["lookup"]);
    h.take(HOST);
    h.call_with(RUNNER, request("../escape", "lookup"));
    assert_eq!(error_code(&h.take(RUNNER)), Some("invalid"));
    let mut call = request("c1", "lookup");
    call.byte_budget = Some(10 * 1024 * 1024);
    h.call_with(RUNNER, call);
    assert_eq!(error_code(&h.take(RUNNER)), Some("invalid"));
    // Another turn's call, and a client posing as a runner.
    h.feed(Input::Runner {
        conn: RUNNER,
        message: RunnerMessage::HostCall {
            turn_id: "t9".into(),
            call: request("c2", "lookup"),
        },
    });
    assert_eq!(error_code(&h.take(RUNNER)), Some("no_active_turn"));
    h.call(CLIENT, "c3");
    assert_eq!(error_code(&h.take(CLIENT)), Some("not_a_runner"));
    // A host declaring a bad tool.
    h.feed(Input::ToolHost {
        conn: HOST,
        message: HostMessage::Declare {
            tools: vec![ToolSpec::new("no spaces", "", json!({"type": "object"}))],
        },
    });
    assert_eq!(error_code(&h.take(HOST)), Some("invalid"));
    assert!(h.host_calls(HOST).is_empty());
    assert_eq!(h.stored(), (0, 0));
}

#[test]
fn a_restarted_actor_replays_recorded_outcomes_and_never_resends_an_open_call() {
    let mut h = Harness::with_turn();
    h.host(HOST, false, &["lookup"]);
    h.take(HOST);
    h.call(RUNNER, "done");
    h.result(HOST, "done", "kept");
    h.take(HOST);
    h.call(RUNNER, "open");
    assert_eq!(h.host_calls(HOST).len(), 1);
    h.take(RUNNER);
    // The server restarts: every connection is gone with it.
    h.restart();
    h.connect(RUNNER + 10, Role::Runner { generation: 2 });
    h.host(HOST + 10, false, &["lookup"]);
    h.take(HOST + 10);
    h.call(RUNNER + 10, "done");
    assert_eq!(
        h.outcomes(RUNNER + 10),
        vec![("done".into(), completed("kept"))]
    );
    h.call(RUNNER + 10, "open");
    // Known from the recovered turn frames as out when the actor stopped
    // (not merely found stored again by its key).
    match &h.outcomes(RUNNER + 10)[..] {
        [(_, HostOutcome::Ambiguous { reason })] => assert_eq!(
            reason,
            "the session restarted while the call was out at its host"
        ),
        other => panic!("{other:?}"),
    }
    assert!(
        h.host_calls(HOST + 10).is_empty(),
        "the new host never sees either"
    );
    assert_eq!(h.stored(), (2, 2));
    // Without the turn's frames (a wrapper that skipped them) the call's
    // key still stops a second run: the stored call is a duplicate, so it
    // is not sent, and ends ambiguous.
    let mut h2 = Harness::with_turn();
    h2.host(HOST, false, &["lookup"]);
    h2.call(RUNNER, "c1");
    h2.take(HOST);
    let info = h2.log.info();
    h2.actor = SessionActor::from_info(ActorConfig::default(), &info);
    h2.connect(RUNNER + 1, Role::Runner { generation: 2 });
    h2.host(HOST + 1, false, &["lookup"]);
    h2.take(HOST + 1);
    h2.call(RUNNER + 1, "c1");
    assert!(matches!(
        &h2.outcomes(RUNNER + 1)[..],
        [(_, HostOutcome::Ambiguous { .. })]
    ));
    assert!(h2.host_calls(HOST + 1).is_empty());
}

#[test]
fn the_turn_ending_cancels_its_calls_and_the_next_turn_starts_clean() {
    let mut h = Harness::with_call_out("c1");
    h.feed(turn_status("t1", TurnStatus::Failed));
    assert!(h
        .take(HOST)
        .iter()
        .any(|m| matches!(m, ServerMessage::HostCancel { call_id, .. } if call_id == "c1")));
    assert_eq!(h.stored(), (1, 1));
    assert_eq!(h.actor.next_deadline(), None);
    // A call for the ended turn is refused.
    h.call(RUNNER, "c2");
    assert_eq!(error_code(&h.take(RUNNER)), Some("no_active_turn"));
}

fn turn_status(turn_id: &str, status: TurnStatus) -> Input {
    Input::Runner {
        conn: RUNNER,
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
    }
}

#[test]
fn a_status_that_does_not_end_the_turn_leaves_its_calls_out() {
    let mut h = Harness::with_call_out("c1");
    // The runner reports the agent started (a status that is not an end).
    h.feed(turn_status("t1", TurnStatus::ReadyForNextStep));
    assert!(
        !h.take(HOST)
            .iter()
            .any(|m| matches!(m, ServerMessage::HostCancel { .. })),
        "a non-terminal status cancelled the call"
    );
    h.result(HOST, "c1", "found");
    assert_eq!(
        h.outcomes(RUNNER),
        vec![("c1".to_string(), completed("found"))]
    );
    assert_eq!(h.stored(), (1, 1));
}

#[test]
fn a_call_id_is_the_sessions_a_later_turn_reusing_it_is_refused_and_nothing_runs() {
    let mut h = Harness::with_call_out("c1");
    h.result(HOST, "c1", "first");
    h.take(RUNNER);
    h.feed(turn_status("t1", TurnStatus::Finished));
    h.feed(Input::Client {
        conn: CLIENT,
        message: ClientMessage::Prompt {
            text: "again".into(),
            turn_id: Some("t2".into()),
            key: None,
        },
    });
    h.take(RUNNER);
    // The relay bridge names each call with a fresh UUID; the log keys a
    // call's frame by its id alone, so an id seen in any earlier turn is a
    // conflict — never the old outcome handed to the new turn, never a
    // second run at the host.
    h.feed(Input::Runner {
        conn: RUNNER,
        message: RunnerMessage::HostCall {
            turn_id: "t2".into(),
            call: request("c1", "lookup"),
        },
    });
    let answered = h.take(RUNNER);
    assert_eq!(error_code(&answered), Some("conflict"), "{answered:?}");
    assert!(h.host_calls(HOST).is_empty());
    assert_eq!(h.stored(), (1, 1));
    // A fresh id in the new turn runs.
    h.feed(Input::Runner {
        conn: RUNNER,
        message: RunnerMessage::HostCall {
            turn_id: "t2".into(),
            call: request("c2", "lookup"),
        },
    });
    assert_eq!(h.host_calls(HOST).len(), 1);
    h.result(HOST, "c2", "second");
    assert_eq!(
        h.outcomes(RUNNER),
        vec![("c2".to_string(), completed("second"))]
    );
    assert_eq!(h.stored(), (2, 2));
}

/// Recovery takes the calls of the running turn only: a call and an
/// outcome of an earlier turn fed to it are passed over. A runner of the new
/// turn that reuses their ids is refused by the log (the ids' keys hold the
/// earlier turn's frames), not answered from the earlier turn's state.
#[test]
fn recovery_passes_over_an_earlier_turns_calls() {
    let mut h = Harness::with_turn();
    h.host(HOST, false, &["lookup"]);
    h.take(HOST);
    h.call(RUNNER, "done");
    h.result(HOST, "done", "kept");
    h.call(RUNNER, "open");
    h.feed(turn_status("t1", TurnStatus::Finished));
    h.feed(Input::Client {
        conn: CLIENT,
        message: ClientMessage::Prompt {
            text: "again".into(),
            turn_id: None,
            key: None,
        },
    });
    let info = h.log.info();
    assert_eq!(
        info.meta.active_turn().map(|t| t.turn_id.as_str()),
        Some("t2")
    );
    // Every frame of the log, t1's included.
    h.actor = SessionActor::from_info(ActorConfig::default(), &info);
    for frame in h.log.read(0, usize::MAX).unwrap() {
        h.actor.recover_turn_frame(&frame);
    }
    h.inbox.clear();
    h.tick(0);
    h.connect(RUNNER + 10, Role::Runner { generation: 2 });
    h.host(HOST + 10, false, &["lookup"]);
    h.take(HOST + 10);
    let stored = h.stored();
    for id in ["done", "open"] {
        h.feed(Input::Runner {
            conn: RUNNER + 10,
            message: RunnerMessage::HostCall {
                turn_id: "t2".into(),
                call: request(id, "lookup"),
            },
        });
        let answer = h.take(RUNNER + 10);
        let refusal = answer.iter().find_map(|m| match m {
            ServerMessage::Error { code, message } => Some((code.as_str(), message.as_str())),
            _ => None,
        });
        match refusal {
            Some(("conflict", message)) => assert!(
                message.starts_with("the log refused the write")
                    && message.contains(&format!("\"host-call:{id}\"")),
                "{id}: {message}"
            ),
            other => panic!("{id}: {other:?} in {answer:?}"),
        }
    }
    assert_eq!(h.stored(), stored, "nothing more is stored");
    assert!(h.host_calls(HOST + 10).is_empty());
}
