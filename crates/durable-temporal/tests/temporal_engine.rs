//! The Temporal engine against the real dev server, with a real local
//! sandbox, a real SQLite session log (written through a hub of session
//! actors, as the session's runner) and a scripted agent process.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use durable_temporal::{TemporalEngine, TurnWorker};
use harness_core::engine::{DurableEngine, SliceExecutor};
use harness_core::frame::FrameBody;
use harness_core::part::StreamPart;
use harness_core::turn::TurnStatus;
use tokio::task::LocalSet;

/// Run `body` while an in-process worker polls `config`'s task queue.
async fn with_worker<F, T>(
    config: &durable_temporal::TemporalConfig,
    executor: Arc<dyn SliceExecutor>,
    body: F,
) -> T
where
    F: std::future::Future<Output = T>,
{
    let mut worker = TurnWorker::new(config, executor).await.expect("worker");
    let shutdown = worker.shutdown_handle();
    // The worker future is not Send: it runs on this thread's LocalSet.
    let local = LocalSet::new();
    let handle = local.spawn_local(async move { worker.run().await });
    let out = local.run_until(body).await;
    shutdown();
    let stopped = local
        .run_until(tokio::time::timeout(Duration::from_secs(20), handle))
        .await;
    assert!(
        matches!(stopped, Ok(Ok(Ok(())))),
        "the worker did not shut down cleanly: {stopped:?}"
    );
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turn_longer_than_one_slice_completes_across_slices() {
    let mut config = common::test_config();
    if !common::server_or_skip(&config).await {
        return;
    }
    // Continue-as-new every 2 slices, so that path runs too.
    config.tuning.continue_as_new_after_slices = 2;
    let dir = tempfile::tempdir().unwrap();
    let log = Arc::new(session_log::SqliteSessionLog::open(dir.path().join("log.db")).unwrap());
    let hub = common::hub(log.clone());
    // Only a sandbox config: the workflow's first step creates the sandbox.
    let state = common::new_turn_creating_sandbox(log.as_ref(), "lines=20 delay=0.2", 1_000).await;
    let (session, turn) = (state.session_id.clone(), state.turn_id.clone());
    let runner = Arc::new(common::runner(dir.path(), hub));
    let engine = TemporalEngine::connect(config.clone()).await.unwrap();
    let final_state = with_worker(&config, runner, async {
        engine.start_turn(state.clone()).await.unwrap();
        // Mid-turn the query shows a running turn with progress.
        let started = Instant::now();
        let mut seen_progress = false;
        while started.elapsed() < Duration::from_secs(30) {
            let s = engine.turn_state(&session, &turn).await.unwrap();
            if s.status == TurnStatus::ReadyForNextStep && s.cursor > 0 {
                seen_progress = true;
                break;
            }
            if s.status.is_terminal() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        assert!(
            seen_progress,
            "the query never showed a running turn with progress"
        );
        let out = tokio::time::timeout(Duration::from_secs(60), engine.wait_turn(&session, &turn))
            .await
            .expect("turn did not finish in 60 s")
            .unwrap();
        eprintln!("turn took {:?} from start", started.elapsed());
        out
    })
    .await;
    assert_eq!(final_state.status, TurnStatus::Finished, "{final_state:?}");
    assert_eq!(final_state.exit_code, Some(0));
    assert!(
        final_state.slices_run >= 3,
        "a 4 s turn with 1 s slices ran {} slices",
        final_state.slices_run
    );
    // After the turn, the state is still readable (the closed workflow).
    let t = Instant::now();
    let again = engine.turn_state(&session, &turn).await.unwrap();
    eprintln!("closed-turn state took {:?}", t.elapsed());
    assert_eq!(again.status, TurnStatus::Finished);
    let sandbox = final_state
        .sandbox
        .clone()
        .expect("the engine created the sandbox");
    assert_eq!(sandbox.provider, sandbox_local::PROVIDER_NAME);
    let frames = common::frames(log.as_ref(), &session).await;
    common::assert_lines_once(&frames, &turn, 20);
    common::assert_end_stored_once(&frames, &final_state);
    // A duplicate start is refused.
    let err = engine.start_turn(state).await.unwrap_err();
    assert_eq!(err.kind(), harness_core::ErrorKind::Conflict, "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aborted_turn_fails_with_reason_and_session_takes_another_turn() {
    let config = common::test_config();
    if !common::server_or_skip(&config).await {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let log = Arc::new(session_log::SqliteSessionLog::open(dir.path().join("log.db")).unwrap());
    // 100 lines at 0.2 s: far longer than the test waits; 30 s slices, so
    // the abort must cancel a running slice activity to be prompt.
    let hub = common::hub(log.clone());
    // The turn carries a sandbox made here.
    let state = common::new_turn(dir.path(), log.as_ref(), "lines=100 delay=0.2", 30_000).await;
    let (session, turn) = (state.session_id.clone(), state.turn_id.clone());
    let runner = Arc::new(common::runner(dir.path(), hub));
    let engine = TemporalEngine::connect(config.clone()).await.unwrap();
    with_worker(&config, runner, async {
        // Unknown turns are reported as such.
        let err = engine
            .abort_turn(&session, "no-such-turn", "x")
            .await
            .unwrap_err();
        assert_eq!(err.kind(), harness_core::ErrorKind::NotFound, "{err}");

        engine.start_turn(state.clone()).await.unwrap();
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let asked = Instant::now();
        engine
            .abort_turn(&session, &turn, "user pressed stop")
            .await
            .unwrap();
        let aborted =
            tokio::time::timeout(Duration::from_secs(30), engine.wait_turn(&session, &turn))
                .await
                .expect("aborted turn did not end in 30 s")
                .unwrap();
        eprintln!("abort took {:?}", asked.elapsed());
        assert_eq!(aborted.status, TurnStatus::Failed, "{aborted:?}");
        let error = aborted.error.clone().unwrap_or_default();
        assert!(error.contains("user pressed stop"), "{error}");
        assert!(!aborted.kill_pending, "the agent must have been killed");
        let process = aborted
            .process
            .clone()
            .expect("the slice reported its process");
        // The agent really is gone.
        let provider = sandbox_local::LocalProvider::new(dir.path());
        let sandbox = harness_core::sandbox::SandboxProvider::resume(
            &provider,
            aborted.sandbox.as_ref().unwrap(),
        )
        .await
        .unwrap();
        let status = sandbox.detached_status(&process).await.unwrap();
        assert_ne!(status, harness_core::sandbox::DetachedStatus::Running);
        let before = common::messages(&common::frames(log.as_ref(), &session).await, &turn).len();
        assert!(
            before < 100,
            "the aborted turn should not have run to the end"
        );

        // The session takes another turn.
        let next = aborted.next_turn("t2", "lines=3 delay=0.05");
        assert_eq!(
            next.sandbox, state.sandbox,
            "the next turn reuses the sandbox"
        );
        engine.start_turn(next).await.unwrap();
        let done = tokio::time::timeout(Duration::from_secs(30), engine.wait_turn(&session, "t2"))
            .await
            .expect("second turn did not finish")
            .unwrap();
        assert_eq!(done.status, TurnStatus::Finished, "{done:?}");
        let frames = common::frames(log.as_ref(), &session).await;
        assert_eq!(
            common::messages(&frames, "t2"),
            vec!["line 0", "line 1", "line 2"]
        );
        // The first turn's output did not grow after the kill.
        assert_eq!(common::messages(&frames, &turn).len(), before);
        common::assert_gap_free(&frames);
        common::assert_end_stored_once(&frames, &aborted);
        common::assert_end_stored_once(&frames, &done);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn approval_request_waits_for_the_approve_signal() {
    let config = common::test_config();
    if !common::server_or_skip(&config).await {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let log = Arc::new(session_log::SqliteSessionLog::open(dir.path().join("log.db")).unwrap());
    let hub = common::hub(log.clone());
    let state =
        common::new_turn_creating_sandbox(log.as_ref(), "lines=4 delay=0.1 approval=1", 5_000)
            .await;
    let (session, turn) = (state.session_id.clone(), state.turn_id.clone());
    let runner = Arc::new(common::runner(dir.path(), hub));
    let engine = TemporalEngine::connect(config.clone()).await.unwrap();
    with_worker(&config, runner, async {
        engine.start_turn(state).await.unwrap();
        let started = Instant::now();
        let waiting = loop {
            let s = engine.turn_state(&session, &turn).await.unwrap();
            if s.status == TurnStatus::AwaitingToolApproval || s.status.is_terminal() {
                break s;
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "no approval request"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert_eq!(
            waiting.status,
            TurnStatus::AwaitingToolApproval,
            "{waiting:?}"
        );
        let pending = waiting.pending_approval.clone().unwrap();
        assert_eq!(pending.approval_id, "approve-1");
        // An answer to another request is ignored: still waiting.
        engine
            .answer_approval(
                &session,
                &turn,
                harness_core::turn::ApprovalAnswer {
                    approval_id: "other".into(),
                    approved: true,
                    reason: None,
                },
            )
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(500)).await;
        let still = engine.turn_state(&session, &turn).await.unwrap();
        assert_eq!(still.status, TurnStatus::AwaitingToolApproval);
        engine
            .answer_approval(
                &session,
                &turn,
                harness_core::turn::ApprovalAnswer {
                    approval_id: pending.approval_id.clone(),
                    approved: true,
                    reason: None,
                },
            )
            .await
            .unwrap();
        let done = tokio::time::timeout(Duration::from_secs(30), engine.wait_turn(&session, &turn))
            .await
            .expect("turn did not finish after approval")
            .unwrap();
        assert_eq!(done.status, TurnStatus::Finished, "{done:?}");
        assert_eq!(done.approval_answers.len(), 1);
        assert_eq!(done.approval_answers[0].approval_id, "approve-1");
        let frames = common::frames(log.as_ref(), &session).await;
        common::assert_gap_free(&frames);
        let requests = frames
            .iter()
            .filter(|f| {
                matches!(&f.body, FrameBody::Part {
                    part: StreamPart::ToolApprovalRequest { approval_id, .. }, ..
                } if approval_id == "approve-1")
            })
            .count();
        assert_eq!(requests, 1, "the approval request stored once");
        // The agent waited for the answer file and saw the approval.
        assert_eq!(
            common::messages(&frames, &turn),
            vec!["line 0", "line 1", "approved 1", "line 2", "line 3"],
            "every line stored exactly once, in order"
        );
        common::assert_end_stored_once(&frames, &done);
    })
    .await;
}
