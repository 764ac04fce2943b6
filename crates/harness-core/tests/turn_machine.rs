//! `run_harness_session` / `step`: every status and transition.

use harness_core::sandbox::{DetachedProcess, SandboxHandle};
use harness_core::session::SandboxConfig;
use harness_core::turn::{
    next_step, run_harness_session, step, ApprovalAnswer, NextStep, PendingApproval, SliceOutcome,
    SliceReport, TurnEvent, TurnState, TurnStatus,
};
use harness_core::ErrorKind;
use serde_json::json;

fn process() -> DetachedProcess {
    DetachedProcess {
        id: "42".into(),
        stdout_path: "/h/.harness/t1/stdout".into(),
        stderr_path: "/h/.harness/t1/stderr".into(),
        exit_path: "/h/.harness/t1/exit".into(),
    }
}

fn handle() -> SandboxHandle {
    SandboxHandle {
        provider: "local".into(),
        id: "box".into(),
        workdir: "/w".into(),
        owned: true,
        data: serde_json::Value::Null,
    }
}

/// A turn of a session whose sandbox exists.
fn fresh(session: &str, turn: &str, agent: &str) -> TurnState {
    let mut s = TurnState::new(session, turn, agent, "hello");
    s.sandbox = Some(handle());
    s
}

fn started() -> TurnState {
    let s = fresh("s1", "t1", "claude-code");
    assert_eq!(next_step(&s), NextStep::AwaitStart);
    let (s, next) = step(s, TurnEvent::Start { now_ms: 1_000 }).unwrap();
    assert_eq!(s.status, TurnStatus::ReadyForNextStep);
    assert_eq!(next, NextStep::RunSlice { budget_ms: 750_000 });
    s
}

fn report(cursor: u64, outcome: SliceOutcome) -> TurnEvent {
    TurnEvent::SliceCompleted {
        report: SliceReport {
            process: Some(process()),
            agent_session_id: Some("agent-sess".into()),
            cursor,
            outcome,
            last_progress_at_ms: None,
            last_warning: None,
            sandbox: None,
            usage: None,
            stderr_tail: None,
        },
        now_ms: 2_000,
    }
}

#[test]
fn running_slices_loop_until_the_agent_exits_zero() {
    let s = started();
    let (s, next) = step(s, report(100, SliceOutcome::Running)).unwrap();
    assert_eq!(
        (s.status, s.cursor, s.slices_run),
        (TurnStatus::ReadyForNextStep, 100, 1)
    );
    assert!(matches!(next, NextStep::RunSlice { .. }));
    assert_eq!(s.agent_session_id.as_deref(), Some("agent-sess"));
    assert_eq!(s.process, Some(process()));
    let (s, next) = step(s, report(250, SliceOutcome::Exited { code: 0 })).unwrap();
    assert_eq!(s.status, TurnStatus::Finished);
    assert_eq!(next, NextStep::RecordEnd);
    assert_eq!((s.exit_code, s.slices_run), (Some(0), 2));
}

#[test]
fn nonzero_exit_fails_the_turn() {
    let (s, next) = step(started(), report(10, SliceOutcome::Exited { code: 3 })).unwrap();
    assert_eq!(s.status, TurnStatus::Failed);
    assert_eq!(next, NextStep::RecordEnd);
    assert_eq!(s.error.as_deref(), Some("agent exited with code 3"));
}

#[test]
fn a_nonzero_exit_quotes_the_agents_stderr() {
    let mut event = report(10, SliceOutcome::Exited { code: 1 });
    let TurnEvent::SliceCompleted { report, .. } = &mut event else {
        unreachable!()
    };
    report.stderr_tail = Some("No conversation found with session ID: abc".into());
    let (s, _) = step(started(), event).unwrap();
    assert_eq!(s.status, TurnStatus::Failed);
    assert_eq!(
        s.error.as_deref(),
        Some("agent exited with code 1: No conversation found with session ID: abc")
    );
}

#[test]
fn lost_process_fails_without_a_kill() {
    let (s, next) = step(started(), report(10, SliceOutcome::Lost)).unwrap();
    assert_eq!(s.status, TurnStatus::Failed);
    assert!(!s.kill_pending, "nothing to kill when the process is lost");
    assert_eq!(next, NextStep::RecordEnd);
}

#[test]
fn turn_budget_times_out_and_kills_the_agent() {
    let mut s = started();
    s.config.max_turn_ms = 500;
    let (s, next) = step(s, report(10, SliceOutcome::Running)).unwrap();
    assert_eq!(s.status, TurnStatus::TimedOut);
    assert!(s.kill_pending);
    assert_eq!(next, NextStep::KillAgent { process: process() });
    let (s, next) = step(s, TurnEvent::AgentKilled).unwrap();
    assert!(!s.kill_pending);
    assert_eq!(next, NextStep::RecordEnd);
}

#[test]
fn a_quiet_agent_times_out_with_its_last_warning_and_is_killed() {
    let mut s = started();
    s.config.quiet_ms = 30_000;
    // Progress at 20 s, checked at 45 s: 25 s of quiet is within the limit.
    let quiet = |cursor, progress_at, now_ms, warning: Option<&str>| TurnEvent::SliceCompleted {
        report: SliceReport {
            process: Some(process()),
            agent_session_id: None,
            cursor,
            outcome: SliceOutcome::Running,
            last_progress_at_ms: Some(progress_at),
            last_warning: warning.map(str::to_string),
            sandbox: None,
            usage: None,
            stderr_tail: None,
        },
        now_ms,
    };
    let (s, _) = step(s, quiet(10, 20_000, 45_000, None)).unwrap();
    assert_eq!(s.status, TurnStatus::ReadyForNextStep);
    assert_eq!(s.last_progress_at_ms, Some(20_000));
    // A slice that saw only warnings keeps the old progress time: 31 s.
    let (s, next) = step(
        s,
        quiet(
            20,
            20_000,
            51_000,
            Some("the model request failed (retry 4)"),
        ),
    )
    .unwrap();
    assert_eq!(s.status, TurnStatus::TimedOut);
    assert_eq!(
        s.error.as_deref(),
        Some("no output from the agent for 31 s (the quiet limit); its last warning: the model request failed (retry 4)")
    );
    assert_eq!(next, NextStep::KillAgent { process: process() });
}

#[test]
fn the_quiet_limit_can_be_turned_off_and_an_approval_restarts_it() {
    let mut s = started();
    s.config.quiet_ms = 0;
    let (s, _) = step(s, report(10, SliceOutcome::Running)).unwrap();
    assert_eq!(s.status, TurnStatus::ReadyForNextStep, "0 = no quiet limit");
    let pending = PendingApproval {
        approval_id: "ap1".into(),
        tool_name: "Bash".into(),
        input: json!({}),
    };
    let mut s = s;
    s.config.quiet_ms = 30_000;
    s.last_progress_at_ms = Some(1_500);
    let (s, _) = step(s, report(20, SliceOutcome::ApprovalRequested(pending))).unwrap();
    let answer = ApprovalAnswer {
        approval_id: "ap1".into(),
        approved: true,
        reason: None,
    };
    let (s, _) = step(s, TurnEvent::ApprovalAnswered(answer)).unwrap();
    assert_eq!(
        s.last_progress_at_ms, None,
        "the wait for a client is not quiet"
    );
}

#[test]
fn approval_round_trip() {
    let pending = PendingApproval {
        approval_id: "ap1".into(),
        tool_name: "Bash".into(),
        input: json!({"command": "rm -rf x"}),
    };
    let (s, next) = step(
        started(),
        report(10, SliceOutcome::ApprovalRequested(pending.clone())),
    )
    .unwrap();
    assert_eq!(s.status, TurnStatus::AwaitingToolApproval);
    assert_eq!(
        next,
        NextStep::AwaitApproval {
            approval_id: "ap1".into()
        }
    );
    // An answer to some other request is refused and changes nothing.
    let wrong = ApprovalAnswer {
        approval_id: "other".into(),
        approved: true,
        reason: None,
    };
    assert_eq!(
        step(s.clone(), TurnEvent::ApprovalAnswered(wrong))
            .unwrap_err()
            .kind(),
        ErrorKind::InvalidInput
    );
    // A slice report while waiting is a conflict.
    assert_eq!(
        step(s.clone(), report(20, SliceOutcome::Running))
            .unwrap_err()
            .kind(),
        ErrorKind::Conflict
    );
    let answer = ApprovalAnswer {
        approval_id: "ap1".into(),
        approved: false,
        reason: Some("no".into()),
    };
    let (s, next) = step(s, TurnEvent::ApprovalAnswered(answer.clone())).unwrap();
    assert_eq!(s.status, TurnStatus::ReadyForNextStep);
    assert!(matches!(next, NextStep::RunSlice { .. }));
    assert_eq!(s.approval_answers, vec![answer]);
    assert_eq!(s.pending_approval, None);
}

#[test]
fn abort_fails_the_turn_and_kills_a_running_agent() {
    let (s, _) = step(started(), report(10, SliceOutcome::Running)).unwrap();
    let (s, next) = step(
        s,
        TurnEvent::Abort {
            reason: "user pressed stop".into(),
        },
    )
    .unwrap();
    assert_eq!(s.status, TurnStatus::Failed);
    assert!(s
        .error
        .as_deref()
        .unwrap()
        .starts_with("aborted: user pressed stop"));
    assert_eq!(next, NextStep::KillAgent { process: process() });
    let (_, next) = step(s, TurnEvent::AgentKilled).unwrap();
    assert_eq!(next, NextStep::RecordEnd);

    // Aborting before anything ran needs no kill.
    let (s, next) = step(
        fresh("s", "t", "codex"),
        TurnEvent::Abort { reason: "x".into() },
    )
    .unwrap();
    assert_eq!((s.status, next), (TurnStatus::Failed, NextStep::RecordEnd));
}

#[test]
fn slice_failures_retry_then_fail() {
    let s = started();
    let fail = |retryable| TurnEvent::SliceFailed {
        error: "worker died".into(),
        retryable,
    };
    let (s, next) = step(s, fail(true)).unwrap();
    assert_eq!(
        (s.status, s.consecutive_failures),
        (TurnStatus::ReadyForNextStep, 1)
    );
    assert!(matches!(next, NextStep::RunSlice { .. }));
    // A success resets the count.
    let (s, _) = step(s, report(5, SliceOutcome::Running)).unwrap();
    assert_eq!(s.consecutive_failures, 0);
    let (s, _) = step(s, fail(true)).unwrap();
    let (s, _) = step(s, fail(true)).unwrap();
    let (s, next) = step(s, fail(true)).unwrap();
    assert_eq!(s.status, TurnStatus::Failed);
    assert!(s.error.as_deref().unwrap().contains("3 in a row"));
    assert_eq!(next, NextStep::KillAgent { process: process() });
    // A non-retryable failure fails at once.
    let (s, _) = step(started(), fail(false)).unwrap();
    assert_eq!(s.status, TurnStatus::Failed);
}

#[test]
fn stale_slice_reports_are_refused() {
    let (s, _) = step(started(), report(500, SliceOutcome::Running)).unwrap();
    let err = step(s.clone(), report(400, SliceOutcome::Exited { code: 0 })).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Conflict);
    assert!(err.to_string().contains("stale slice report"));
    // A slice that read nothing new reports the cursor it started from:
    // that is progress of the turn (a slice run), not a stale report.
    let (s, next) = step(s, report(500, SliceOutcome::Running)).unwrap();
    assert_eq!((s.cursor, s.slices_run), (500, 2));
    assert!(matches!(next, NextStep::RunSlice { .. }));
}

#[test]
fn terminal_turns_refuse_everything_but_agent_killed() {
    let (s, _) = step(started(), report(1, SliceOutcome::Exited { code: 0 })).unwrap();
    for event in [
        TurnEvent::Start { now_ms: 0 },
        report(2, SliceOutcome::Running),
        TurnEvent::Abort {
            reason: "late".into(),
        },
        TurnEvent::SliceFailed {
            error: "x".into(),
            retryable: true,
        },
    ] {
        assert_eq!(
            step(s.clone(), event).unwrap_err().kind(),
            ErrorKind::Conflict
        );
    }
    // Starting twice is refused too.
    assert_eq!(
        step(started(), TurnEvent::Start { now_ms: 5 })
            .unwrap_err()
            .kind(),
        ErrorKind::Conflict
    );
}

#[test]
fn next_turn_carries_the_conversation() {
    let (s, _) = step(started(), report(1, SliceOutcome::Exited { code: 0 })).unwrap();
    let next = s.next_turn("t2", "and now?");
    assert_eq!(next.status, TurnStatus::NotStarted);
    assert_eq!(next.agent_session_id.as_deref(), Some("agent-sess"));
    assert_eq!((next.cursor, next.process.clone()), (0, None));
}

#[test]
fn json_entry_point_round_trips_every_status_name() {
    let state = serde_json::to_value(fresh("s1", "t1", "codex")).unwrap();
    assert_eq!(state["status"], "not_started");
    let out =
        run_harness_session(json!({"state": state, "event": {"event": "start", "now_ms": 1}}))
            .unwrap();
    assert_eq!(out["state"]["status"], "ready_for_next_step");
    assert_eq!(
        out["next"],
        json!({"step": "run_slice", "budget_ms": 750000})
    );
    let out = run_harness_session(json!({
        "state": out["state"],
        "event": {"event": "slice_completed", "now_ms": 2, "report": {"cursor": 9, "outcome": {"kind": "approval_requested", "approval_id": "a", "tool_name": "Bash", "input": {}}}}
    }))
    .unwrap();
    assert_eq!(out["state"]["status"], "awaiting_tool_approval");
    let out = run_harness_session(
        json!({"state": out["state"], "event": {"event": "abort", "reason": "r"}}),
    )
    .unwrap();
    assert_eq!(out["state"]["status"], "failed");
    for (status, name) in [
        (TurnStatus::TimedOut, "timed_out"),
        (TurnStatus::Finished, "finished"),
    ] {
        assert_eq!(serde_json::to_value(status).unwrap(), name);
    }
    // Malformed input is a clear InvalidInput error.
    let err = run_harness_session(json!({"state": {"nope": 1}})).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput);
    // Without an event it only reports the next step.
    let out = run_harness_session(json!({"state": out["state"]})).unwrap();
    assert_eq!(out["next"], json!({"step": "record_end"}));
    let out =
        run_harness_session(json!({"state": out["state"], "event": {"event": "end_recorded"}}))
            .unwrap();
    assert_eq!(out["next"], json!({"step": "done", "status": "failed"}));
}

#[test]
fn a_first_turn_creates_its_sandbox_then_runs() {
    let mut s = TurnState::new("s", "t1", "codex", "p");
    s.sandbox_config = Some(SandboxConfig::default());
    let (s, next) = step(s, TurnEvent::Start { now_ms: 1 }).unwrap();
    assert_eq!(
        (s.status, next),
        (TurnStatus::ReadyForNextStep, NextStep::CreateSandbox)
    );
    // A failed creation counts like a failed slice.
    let (s, next) = step(
        s,
        TurnEvent::SliceFailed {
            error: "docker down".into(),
            retryable: true,
        },
    )
    .unwrap();
    assert_eq!((s.consecutive_failures, next), (1, NextStep::CreateSandbox));
    let (s, next) = step(s, TurnEvent::SandboxCreated { handle: handle() }).unwrap();
    assert!(matches!(next, NextStep::RunSlice { .. }));
    assert_eq!(
        (s.sandbox.clone(), s.consecutive_failures),
        (Some(handle()), 0)
    );
    // Only once.
    let err = step(s, TurnEvent::SandboxCreated { handle: handle() }).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Conflict);
}

#[test]
fn a_turn_with_no_way_to_a_sandbox_fails_at_start() {
    let (s, next) = step(
        TurnState::new("s", "t1", "codex", "p"),
        TurnEvent::Start { now_ms: 1 },
    )
    .unwrap();
    assert_eq!((s.status, next), (TurnStatus::Failed, NextStep::RecordEnd));
    assert!(s.error.unwrap().contains("sandbox"));
}

#[test]
fn the_end_is_recorded_once_and_only_for_a_terminal_turn() {
    let s = started();
    assert_eq!(
        step(s.clone(), TurnEvent::EndRecorded).unwrap_err().kind(),
        ErrorKind::Conflict
    );
    let (s, next) = step(s, report(5, SliceOutcome::Exited { code: 0 })).unwrap();
    assert_eq!(next, NextStep::RecordEnd);
    assert_eq!(s.status_key(), "t1:status:finished");
    let (s, next) = step(s, TurnEvent::EndRecorded).unwrap();
    assert!(s.end_recorded);
    assert_eq!(
        next,
        NextStep::Done {
            status: TurnStatus::Finished
        }
    );
}

/// A slice report whose session usage crosses the turn's budget ends the
/// turn `failed` with the code `budget_exceeded` (whatever the agent did:
/// here it was still running) and kills the agent; one under it runs on.
#[test]
fn a_spent_budget_fails_the_turn_with_its_code() {
    let with_usage = |cursor, input, output, spend| {
        let TurnEvent::SliceCompleted { mut report, now_ms } =
            report(cursor, SliceOutcome::Running)
        else {
            unreachable!()
        };
        report.usage = Some(harness_core::turn::ModelUsage {
            input_tokens: input,
            output_tokens: output,
            spend_micros: spend,
        });
        TurnEvent::SliceCompleted { report, now_ms }
    };
    let mut s = started();
    s.config.budget.max_tokens = Some(1_000);
    s.config.budget.max_spend_micros = Some(50_000);
    let (s, next) = step(s, with_usage(10, 600, 300, Some(10_000))).unwrap();
    assert_eq!(s.status, TurnStatus::ReadyForNextStep);
    assert!(s.error_code.is_none());
    assert!(matches!(next, NextStep::RunSlice { .. }));
    let (s, next) = step(s, with_usage(20, 900, 350, Some(20_000))).unwrap();
    assert_eq!(s.status, TurnStatus::Failed);
    assert_eq!(
        s.error_code.as_deref(),
        Some(harness_core::turn::BUDGET_EXCEEDED)
    );
    let error = s.error.clone().unwrap();
    assert!(
        error.contains("1250 tokens used of 1000 (250 over)"),
        "{error}"
    );
    assert!(matches!(next, NextStep::KillAgent { .. }), "{next:?}");
    // Spend alone crosses too, and says so in dollars.
    let mut s = started();
    s.config.budget.max_spend_micros = Some(50_000);
    let (s, _) = step(s, with_usage(10, 10, 10, Some(75_000))).unwrap();
    assert_eq!(s.error_code.as_deref(), Some("budget_exceeded"));
    assert!(s.error.unwrap().contains("$0.075000 used of $0.050000"));
    // An unpriced model's usage cannot cross a spend budget here: the
    // broker refuses such requests before they pass.
    let mut s = started();
    s.config.budget.max_spend_micros = Some(50_000);
    let (s, _) = step(s, with_usage(10, 10, 10, None)).unwrap();
    assert_eq!(s.status, TurnStatus::ReadyForNextStep);
}
