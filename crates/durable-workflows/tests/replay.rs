//! `run_turn` against a double of the Workflows step runtime that behaves
//! as Workflows does: a step's recorded output is returned without running
//! it again, a failed attempt is retried up to the step's retry limit, and
//! an evicted instance runs `run` again from the top over the records.

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, VecDeque};
use std::rc::Rc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use async_trait::async_trait;
use durable_workflows::{run_turn, StepBody, StepOptions, Steps, TurnInput, TurnParams};
use futures::FutureExt;
use harness_core::engine::SliceExecutor;
use harness_core::sandbox::{DetachedProcess, SandboxHandle};
use harness_core::stream::AbortSignal;
use harness_core::turn::{
    ApprovalAnswer, PendingApproval, SliceOutcome, SliceReport, TurnState, TurnStatus,
};
use harness_core::{Error, Result};

/// What Workflows keeps for an instance, across runs of `run`.
#[derive(Default)]
struct Records {
    outputs: RefCell<HashMap<String, std::result::Result<String, String>>>,
    /// Step names in the order their bodies ran (one entry per attempt).
    attempts: RefCell<Vec<String>>,
    /// Inputs not yet taken by a wait.
    inputs: RefCell<VecDeque<String>>,
    /// What `run` published as its progress: status and awaited approval.
    progress: RefCell<Vec<(TurnStatus, Option<String>)>>,
}

impl Records {
    /// An event sent to the instance (what `sendEvent` does), waiting for
    /// its `wait_input`.
    fn send(&self, input: &TurnInput) {
        self.inputs
            .borrow_mut()
            .push_back(serde_json::to_string(input).unwrap());
    }
}

/// One run of `run`: evicted (its future never completes) once it has run
/// `evict_after` new steps.
struct Run<'a> {
    records: &'a Records,
    evict_after: Option<usize>,
    ran: Cell<usize>,
}

#[async_trait(?Send)]
impl Steps for Run<'_> {
    async fn run(
        &self,
        name: &str,
        options: StepOptions,
        body: StepBody,
    ) -> std::result::Result<String, String> {
        if let Some(output) = self.records.outputs.borrow().get(name) {
            return output.clone();
        }
        if self.evict_after == Some(self.ran.get()) {
            futures::future::pending::<()>().await;
        }
        self.ran.set(self.ran.get() + 1);
        let mut last = Err(String::new());
        for _ in 0..=options.retries {
            self.records.attempts.borrow_mut().push(name.to_string());
            last = body().await;
            if last.is_ok() {
                break;
            }
        }
        self.records
            .outputs
            .borrow_mut()
            .insert(name.to_string(), last.clone());
        last
    }

    async fn wait_input(
        &self,
        name: &str,
        _timeout_ms: u64,
    ) -> std::result::Result<String, String> {
        if let Some(output) = self.records.outputs.borrow().get(name) {
            return output.clone();
        }
        let input = self
            .records
            .inputs
            .borrow_mut()
            .pop_front()
            .ok_or_else(|| "timed out".to_string());
        self.records
            .outputs
            .borrow_mut()
            .insert(name.to_string(), input.clone());
        input
    }

    async fn progress(&self, state: &TurnState) {
        let approval = state
            .pending_approval
            .as_ref()
            .map(|p| p.approval_id.clone());
        self.records
            .progress
            .borrow_mut()
            .push((state.status, approval));
    }
}

/// An agent whose slices report `outcomes` in order; `fail_attempts`
/// attempts of slice `fail_slice` (1-based) fail after running.
#[derive(Default)]
struct Agent {
    outcomes: Mutex<VecDeque<std::result::Result<SliceOutcome, Error>>>,
    fail_slice: u32,
    fail_attempts: AtomicU32,
    /// Slice (1-based) during which the executor sees an abort.
    abort_slice: u32,
    slices: AtomicU32,
    creates: AtomicU32,
    kills: AtomicU32,
    ends: Mutex<Vec<TurnStatus>>,
    /// The approval answers each slice's state carried.
    answers_seen: Mutex<Vec<Vec<String>>>,
}

fn bump(counter: &AtomicU32) {
    counter.fetch_add(1, Ordering::SeqCst);
}

fn count(counter: &AtomicU32) -> u32 {
    counter.load(Ordering::SeqCst)
}

fn process() -> DetachedProcess {
    DetachedProcess {
        id: "7".into(),
        stdout_path: "o".into(),
        stderr_path: "e".into(),
        exit_path: "x".into(),
    }
}

// Natively an executor is `Send + Sync` with `Send` futures.
#[async_trait]
impl SliceExecutor for Agent {
    async fn create_sandbox(&self, _state: &TurnState) -> Result<SandboxHandle> {
        bump(&self.creates);
        Ok(SandboxHandle {
            provider: "test".into(),
            id: "sb-1".into(),
            workdir: "/workspace".into(),
            owned: true,
            data: serde_json::Value::Null,
        })
    }

    async fn run_slice(
        &self,
        state: &TurnState,
        _budget: Duration,
        abort: AbortSignal,
    ) -> Result<SliceReport> {
        bump(&self.slices);
        self.answers_seen.lock().unwrap().push(
            state
                .approval_answers
                .iter()
                .map(|a| a.approval_id.clone())
                .collect(),
        );
        let this_slice = state.slices_run + 1;
        if this_slice == self.abort_slice {
            abort.abort();
        }
        if this_slice == self.fail_slice && count(&self.fail_attempts) > 0 {
            self.fail_attempts.fetch_sub(1, Ordering::SeqCst);
            return Err(Error::backend("the bridge dropped the connection"));
        }
        let outcome = self
            .outcomes
            .lock()
            .unwrap()
            .pop_front()
            .expect("a slice the script did not plan")?;
        Ok(SliceReport {
            process: Some(process()),
            agent_session_id: Some("agent-1".into()),
            cursor: state.cursor + 100,
            outcome,
            last_progress_at_ms: None,
            last_warning: None,
            sandbox: None,
            usage: None,
            stderr_tail: None,
        })
    }

    async fn kill_agent(&self, _state: &TurnState, _process: &DetachedProcess) -> Result<()> {
        bump(&self.kills);
        Ok(())
    }

    async fn turn_ended(&self, state: &TurnState) -> Result<()> {
        self.ends.lock().unwrap().push(state.status);
        Ok(())
    }
}

fn params() -> TurnParams {
    let mut state = TurnState::new("s1", "t1", "claude-code", "hello");
    state.sandbox_config = Some(Default::default());
    TurnParams {
        state,
        generation: 1,
        tuning: Default::default(),
    }
}

/// A clock that moves 1 s per reading.
fn clock() -> Rc<dyn Fn() -> u64> {
    let t = Cell::new(1_000_000u64);
    Rc::new(move || {
        t.set(t.get() + 1_000);
        t.get()
    })
}

fn run_once(
    records: &Records,
    agent: &Rc<Agent>,
    evict_after: Option<usize>,
) -> Option<Result<TurnState>> {
    let run = Run {
        records,
        evict_after,
        ran: Cell::new(0),
    };
    let executor: Rc<dyn SliceExecutor> = agent.clone();
    // Every await in the double and the agent is ready at once, so a run
    // either finishes here or was evicted (pending forever).
    run_turn(params(), &run, executor, clock()).now_or_never()
}

#[test]
fn a_turn_runs_to_its_end_and_a_failed_attempt_is_retried() {
    let agent = Rc::new(Agent {
        outcomes: Mutex::new(VecDeque::from([
            Ok(SliceOutcome::Running),
            Ok(SliceOutcome::Exited { code: 0 }),
        ])),
        fail_slice: 1,
        fail_attempts: AtomicU32::new(1),
        ..Agent::default()
    });
    let records = Records::default();
    let state = run_once(&records, &agent, None)
        .expect("not evicted")
        .expect("the turn ran");
    assert_eq!(state.status, TurnStatus::Finished);
    assert_eq!(state.slices_run, 2);
    assert_eq!(state.cursor, 200);
    // The end's `()` result is read back as recorded.
    assert!(state.end_recorded && state.error.is_none(), "{state:?}");
    assert_eq!(*agent.ends.lock().unwrap(), vec![TurnStatus::Finished]);
    assert_eq!(
        *records.attempts.borrow(),
        vec![
            "0001 start",
            "0002 create-sandbox",
            "0003 slice",
            "0003 slice",
            "0004 slice",
            "0005 record-end",
        ],
        "the failed attempt of the first slice is retried as the same step"
    );
}

#[test]
fn a_replay_after_an_eviction_runs_no_finished_step_again() {
    let script = || {
        Rc::new(Agent {
            outcomes: Mutex::new(VecDeque::from([
                Ok(SliceOutcome::Running),
                Ok(SliceOutcome::Running),
                Ok(SliceOutcome::Exited { code: 0 }),
            ])),
            ..Agent::default()
        })
    };
    // The reference: one uninterrupted run.
    let straight = run_once(&Records::default(), &script(), None)
        .unwrap()
        .unwrap();

    let agent = script();
    let records = Records::default();
    assert!(
        run_once(&records, &agent, Some(3)).is_none(),
        "evicted after three steps"
    );
    assert_eq!(count(&agent.creates), 1);
    assert_eq!(count(&agent.slices), 1);
    // Workflows runs `run` again from the top over the records.
    let replayed = run_once(&records, &agent, None).unwrap().unwrap();
    assert_eq!(count(&agent.creates), 1, "the sandbox is not made twice");
    assert_eq!(
        count(&agent.slices),
        3,
        "the first slice does not run again"
    );
    assert_eq!(*agent.ends.lock().unwrap(), vec![TurnStatus::Finished]);
    assert_eq!(replayed, straight, "the replay ends in the same state");
    let attempts = records.attempts.borrow();
    let mut unique = attempts.clone();
    unique.dedup();
    assert_eq!(*attempts, unique, "no step body ran twice");
}

#[test]
fn a_fatal_failure_is_recorded_and_not_retried() {
    let agent = Rc::new(Agent {
        outcomes: Mutex::new(VecDeque::from([Err(Error::invalid(
            "the agent's command line is refused",
        ))])),
        ..Agent::default()
    });
    let records = Records::default();
    let state = run_once(&records, &agent, None).unwrap().unwrap();
    assert_eq!(state.status, TurnStatus::Failed);
    assert_eq!(count(&agent.slices), 1, "a fatal failure is not retried");
    assert!(
        state
            .error
            .as_deref()
            .is_some_and(|e| e.contains("refused")),
        "{:?}",
        state.error
    );
    assert_eq!(*agent.ends.lock().unwrap(), vec![TurnStatus::Failed]);
}

#[test]
fn an_approval_waits_for_its_event_and_an_abort_ends_the_turn() {
    let approval = PendingApproval {
        approval_id: "ap-1".into(),
        tool_name: "Bash".into(),
        input: serde_json::json!({"command": "ls"}),
    };
    let asks = || {
        Rc::new(Agent {
            outcomes: Mutex::new(VecDeque::from([
                Ok(SliceOutcome::ApprovalRequested(approval.clone())),
                Ok(SliceOutcome::Exited { code: 0 }),
            ])),
            ..Agent::default()
        })
    };

    let agent = asks();
    let records = Records::default();
    let answer = TurnInput::Answer {
        answer: ApprovalAnswer {
            approval_id: "ap-1".into(),
            approved: true,
            reason: None,
        },
    };
    records.send(&answer);
    let state = run_once(&records, &agent, None).unwrap().unwrap();
    assert_eq!(state.status, TurnStatus::Finished);
    assert_eq!(count(&agent.slices), 2, "the agent ran on after the answer");
    // The slice after the answer hands it to the agent.
    assert_eq!(
        *agent.answers_seen.lock().unwrap(),
        vec![Vec::<String>::new(), vec!["ap-1".to_string()]]
    );
    assert!(records.outputs.borrow().contains_key("0004 input"));
    // While it waited, the turn published the state `turn_state` shows:
    // awaiting that approval; then ready for its next slice after the answer.
    let progress = records.progress.borrow().clone();
    let waiting = (TurnStatus::AwaitingToolApproval, Some("ap-1".to_string()));
    let at = progress
        .iter()
        .position(|p| *p == waiting)
        .unwrap_or_else(|| panic!("no awaiting state published: {progress:?}"));
    assert!(
        progress[at + 1..]
            .iter()
            .any(|p| p.0 == TurnStatus::ReadyForNextStep),
        "the answered turn was not published as ready again: {progress:?}"
    );

    let agent = asks();
    let records = Records::default();
    let abort = TurnInput::Abort {
        reason: "the user left".into(),
    };
    records.send(&abort);
    let state = run_once(&records, &agent, None).unwrap().unwrap();
    assert_ne!(state.status, TurnStatus::Finished);
    assert!(state.status.is_terminal());
    assert_eq!(count(&agent.slices), 1, "no slice after the abort");
    assert_eq!(count(&agent.kills), 1, "the waiting agent is killed");
    assert_eq!(agent.ends.lock().unwrap().len(), 1);
}

#[test]
fn an_abort_the_executor_sees_during_a_slice_ends_the_turn() {
    let agent = Rc::new(Agent {
        outcomes: Mutex::new(VecDeque::from([
            Ok(SliceOutcome::Running),
            Ok(SliceOutcome::Running),
            Ok(SliceOutcome::Exited { code: 0 }),
        ])),
        abort_slice: 2,
        ..Agent::default()
    });
    let records = Records::default();
    // The engine sends the abort's event beside the mailbox the executor
    // watches; its reason becomes the turn's error.
    let abort = TurnInput::Abort {
        reason: "stop pressed".into(),
    };
    records.send(&abort);
    let state = run_once(&records, &agent, None).unwrap().unwrap();
    assert!(state.status.is_terminal());
    assert_ne!(state.status, TurnStatus::Finished);
    // Killing the agent and recording the end (both `()` results) are
    // read back as done, not as records of nothing.
    assert_eq!(state.error.as_deref(), Some("aborted: stop pressed"));
    assert!(state.end_recorded, "{state:?}");
    assert_eq!(count(&agent.slices), 2, "no slice after the aborted one");
    assert_eq!(count(&agent.kills), 1, "the agent is killed");
    assert_eq!(*agent.ends.lock().unwrap(), vec![state.status]);
    // A replay over the records ends the same way without running anything.
    let replayed = run_once(&records, &agent, None).unwrap().unwrap();
    assert_eq!(replayed, state);
    assert_eq!(count(&agent.slices), 2);
}
