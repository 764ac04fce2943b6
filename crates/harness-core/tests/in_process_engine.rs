//! The in-process engine's loop: slices until done, state saved after every
//! step, abort and approvals delivered, unfinished turns resumed.
//!
//! The executor here plays an agent process as a deterministic script; the
//! engine under test is the real one. End-to-end runs with real agents live
//! in the engine crates' tests.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use harness_core::clock::ManualClock;
use harness_core::engine::{
    DurableEngine, InProcessEngine, MemoryTurnStore, SliceExecutor, Spawner, TurnStore,
};
use harness_core::sandbox::{DetachedProcess, SandboxHandle};
use harness_core::stream::AbortSignal;
use harness_core::turn::{
    ApprovalAnswer, PendingApproval, SliceOutcome, SliceReport, TurnState, TurnStatus,
};

#[derive(Default)]
struct ScriptedAgent {
    /// Outcomes to report, in order; the last repeats.
    outcomes: Mutex<Vec<SliceOutcome>>,
    slices: AtomicU32,
    kills: AtomicU32,
    ends: AtomicU32,
    /// When set, a slice waits for the abort signal (an agent that runs on).
    block_until_abort: bool,
}

fn handle() -> SandboxHandle {
    SandboxHandle {
        provider: "test".into(),
        id: "box".into(),
        workdir: "/w".into(),
        owned: true,
        data: serde_json::Value::Null,
    }
}

/// A fresh turn that already has its sandbox.
fn turn(agent: &str) -> TurnState {
    let mut state = TurnState::new("s", "t", agent, "p");
    state.sandbox = Some(handle());
    state
}

#[async_trait]
impl SliceExecutor for ScriptedAgent {
    async fn create_sandbox(&self, _state: &TurnState) -> harness_core::Result<SandboxHandle> {
        Ok(handle())
    }
    async fn turn_ended(&self, state: &TurnState) -> harness_core::Result<()> {
        assert!(state.status.is_terminal());
        self.ends.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
    async fn run_slice(
        &self,
        state: &TurnState,
        _budget: Duration,
        abort: AbortSignal,
    ) -> harness_core::Result<SliceReport> {
        let n = self.slices.fetch_add(1, Ordering::SeqCst);
        if self.block_until_abort {
            abort.aborted().await;
        }
        let outcome = {
            let mut o = self.outcomes.lock().unwrap();
            if o.len() > 1 {
                o.remove(0)
            } else {
                o[0].clone()
            }
        };
        Ok(SliceReport {
            process: Some(DetachedProcess {
                id: "7".into(),
                stdout_path: "o".into(),
                stderr_path: "e".into(),
                exit_path: "x".into(),
            }),
            agent_session_id: Some("agent-1".into()),
            cursor: state.cursor + 10 * u64::from(n + 1),
            outcome,
            last_progress_at_ms: None,
            last_warning: None,
            sandbox: None,
            usage: None,
            stderr_tail: None,
        })
    }
    async fn kill_agent(
        &self,
        _state: &TurnState,
        _p: &DetachedProcess,
    ) -> harness_core::Result<()> {
        self.kills.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

fn spawner() -> Spawner {
    Arc::new(|f| {
        tokio::spawn(f);
    })
}

fn engine(agent: Arc<ScriptedAgent>, store: Arc<MemoryTurnStore>) -> InProcessEngine {
    InProcessEngine::new(agent, store, Arc::new(ManualClock::at(1_000)), spawner())
}

#[tokio::test]
async fn slices_run_until_the_agent_exits() {
    let agent = Arc::new(ScriptedAgent {
        outcomes: Mutex::new(vec![
            SliceOutcome::Running,
            SliceOutcome::Running,
            SliceOutcome::Exited { code: 0 },
        ]),
        ..Default::default()
    });
    let store = Arc::new(MemoryTurnStore::default());
    let e = engine(agent.clone(), store.clone());
    e.start_turn(turn("codex")).await.unwrap();
    let done = e.wait_turn("s", "t").await.unwrap();
    assert_eq!(done.status, TurnStatus::Finished);
    assert_eq!(done.slices_run, 3);
    assert_eq!(agent.slices.load(Ordering::SeqCst), 3);
    assert!(done.end_recorded);
    assert_eq!(
        agent.ends.load(Ordering::SeqCst),
        1,
        "the end is recorded once"
    );
    assert_eq!(
        store.load("s", "t").await.unwrap().unwrap(),
        done,
        "final state persisted"
    );
    assert!(
        e.start_turn(turn("codex")).await.is_err(),
        "a turn id is used once"
    );
}

#[tokio::test]
async fn abort_stops_a_running_slice_and_kills_the_agent() {
    let agent = Arc::new(ScriptedAgent {
        outcomes: Mutex::new(vec![SliceOutcome::Running]),
        block_until_abort: true,
        ..Default::default()
    });
    let e = engine(agent.clone(), Arc::new(MemoryTurnStore::default()));
    e.start_turn(turn("codex")).await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    e.abort_turn("s", "t", "stop button").await.unwrap();
    let done = tokio::time::timeout(Duration::from_secs(5), e.wait_turn("s", "t"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(done.status, TurnStatus::Failed);
    assert!(done.error.unwrap().contains("stop button"));
    assert_eq!(
        agent.kills.load(Ordering::SeqCst),
        1,
        "the agent process was killed"
    );
    assert!(!done.kill_pending);
}

#[tokio::test]
async fn approvals_are_delivered_to_a_waiting_turn() {
    let pending = PendingApproval {
        approval_id: "ap".into(),
        tool_name: "Bash".into(),
        input: serde_json::json!({}),
    };
    let agent = Arc::new(ScriptedAgent {
        outcomes: Mutex::new(vec![
            SliceOutcome::ApprovalRequested(pending),
            SliceOutcome::Exited { code: 0 },
        ]),
        ..Default::default()
    });
    let e = engine(agent, Arc::new(MemoryTurnStore::default()));
    e.start_turn(turn("claude-code")).await.unwrap();
    for _ in 0..100 {
        if e.turn_state("s", "t").await.unwrap().status == TurnStatus::AwaitingToolApproval {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        e.turn_state("s", "t").await.unwrap().status,
        TurnStatus::AwaitingToolApproval
    );
    e.answer_approval(
        "s",
        "t",
        ApprovalAnswer {
            approval_id: "ap".into(),
            approved: true,
            reason: None,
        },
    )
    .await
    .unwrap();
    let done = e.wait_turn("s", "t").await.unwrap();
    assert_eq!(done.status, TurnStatus::Finished);
    assert_eq!(done.approval_answers.len(), 1);
}

#[tokio::test]
async fn a_restarted_engine_resumes_unfinished_turns_from_its_store() {
    let store = Arc::new(MemoryTurnStore::default());
    // A turn saved mid-way by a previous process.
    let mut saved = turn("codex");
    saved.status = TurnStatus::ReadyForNextStep;
    saved.cursor = 40;
    saved.slices_run = 4;
    saved.started_at_ms = Some(1_000);
    store.save(&saved, 0).await.unwrap();
    let agent = Arc::new(ScriptedAgent {
        outcomes: Mutex::new(vec![SliceOutcome::Exited { code: 0 }]),
        ..Default::default()
    });
    let e = engine(agent.clone(), store.clone());
    assert_eq!(e.resume_unfinished().await.unwrap(), 1);
    let done = e.wait_turn("s", "t").await.unwrap();
    assert_eq!((done.status, done.slices_run), (TurnStatus::Finished, 5));
    assert!(done.cursor > 40, "continued from the saved cursor");
    assert_eq!(e.resume_unfinished().await.unwrap(), 0);
}
