//! The `harness_turn` workflow and its activities: `harness:create-sandbox`,
//! `harness:slice`, `harness:kill-agent` and `harness:record-end`.
//!
//! The workflow is I/O around core's [`TurnDriver`] — the same turn loop the
//! in-process engine drives. The driver *is* the workflow's state: signals
//! call [`TurnDriver::answer`] / [`TurnDriver::abort`], the query returns
//! its state, a continue-as-new carries it whole. Each iteration asks
//! [`TurnDriver::poll`] what to do and does it with SDK primitives only
//! (activities, `wait_condition`, deterministic `select!`, `workflow_time`).
//! Nothing in it does I/O, reads the clock or spawns tasks, so a replay on
//! another worker takes exactly the same path.

use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use temporalio_macros::{activities, workflow, workflow_methods};
use temporalio_sdk::activities::{ActivityContext, ActivityError};
use temporalio_sdk::{
    ActivityCancellationType, ActivityExecutionError, ActivityOptions, ApplicationFailure,
    CancellableFuture, ContinueAsNewOptions, SyncWorkflowContext, WorkflowContext,
    WorkflowContextView, WorkflowResult,
};
use temporalio_workflow::RetryPolicy;

use harness_core::engine::SliceExecutor;
use harness_core::sandbox::{DetachedProcess, SandboxHandle};
use harness_core::stream::AbortSignal;
use harness_core::turn::{ApprovalAnswer, SliceReport, TurnState};
use harness_core::turn_driver::{StepFailure, TurnAction, TurnDriver};

/// Workflow type name registered with the server.
pub const WORKFLOW_TYPE: &str = "harness_turn";
/// Activity type of one slice.
pub const SLICE_ACTIVITY: &str = "harness:slice";
/// Activity type that kills a turn's agent process.
pub const KILL_ACTIVITY: &str = "harness:kill-agent";
/// Activity type that creates a session's sandbox (its first turn).
pub const CREATE_SANDBOX_ACTIVITY: &str = "harness:create-sandbox";
/// Activity type that records the end of a turn in the session log.
pub const RECORD_END_ACTIVITY: &str = "harness:record-end";
/// Signal carrying an [`ApprovalAnswer`].
pub const APPROVE_SIGNAL: &str = "approve";
/// Signal carrying an [`AbortRequest`].
pub const ABORT_SIGNAL: &str = "abort";
/// Query returning the current [`TurnState`].
pub const STATE_QUERY: &str = "state";

/// Timeouts, heartbeats and retries of the workflow's activities. Carried in
/// the workflow input (not read from the worker's environment) so a replay
/// on any worker schedules the same activities.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct ActivityTuning {
    /// Added to the slice budget to get the activity's start-to-close
    /// timeout: time to reattach, flush the last chunk and report.
    pub slice_margin_ms: u64,
    /// Heartbeat timeout of every activity. A worker that dies mid-activity
    /// (a slice, a sandbox create) is noticed after this long and the
    /// activity is retried elsewhere. Activities heartbeat every quarter of
    /// it (the SDK sends at most one heartbeat per 0.8 × timeout to the
    /// server).
    pub heartbeat_timeout_ms: u64,
    /// First retry delay of a failed activity attempt.
    pub retry_initial_interval_ms: u64,
    /// Attempts per activity before the failure reaches the turn machine
    /// (which then counts a failed slice).
    pub retry_max_attempts: u32,
    /// Start-to-close timeout of `harness:kill-agent` and `harness:record-end`.
    pub kill_timeout_ms: u64,
    /// Start-to-close timeout of `harness:create-sandbox` (a first sandbox
    /// of an identity runs its bootstrap: copying the agent binary).
    pub create_sandbox_timeout_ms: u64,
    /// Continue-as-new after this many slices in one run, so the history
    /// stays small for very long turns (0 = never).
    pub continue_as_new_after_slices: u32,
}

impl Default for ActivityTuning {
    fn default() -> Self {
        Self {
            slice_margin_ms: 60_000,
            heartbeat_timeout_ms: 20_000,
            retry_initial_interval_ms: 1_000,
            retry_max_attempts: 5,
            kill_timeout_ms: 60_000,
            create_sandbox_timeout_ms: 600_000,
            continue_as_new_after_slices: 200,
        }
    }
}

/// The workflow's input: the turn's driver (a fresh one on the first run;
/// continue-as-new carries the current one, with answers and an abort
/// received but not applied yet) plus tuning.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TurnWorkflowInput {
    /// The turn loop's state.
    pub driver: TurnDriver,
    /// Activity settings.
    #[serde(default)]
    pub tuning: ActivityTuning,
}

/// Payload of the `abort` signal.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AbortRequest {
    /// Why the turn is aborted (ends up in the state's `error`).
    pub reason: String,
}

/// Input of `harness:slice`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SliceInput {
    /// The turn state as of the end of the previous slice.
    pub state: TurnState,
    /// The slice budget.
    pub budget_ms: u64,
}

/// Input of `harness:kill-agent`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KillInput {
    /// The (terminal) turn state.
    pub state: TurnState,
    /// The process to kill.
    pub process: DetachedProcess,
}

/// The activities, run by a worker that owns a [`SliceExecutor`] (a
/// [`SliceRunner`](harness_core::slice::SliceRunner) over its sandbox
/// providers, agent adapters and runner sink).
pub struct TurnActivities {
    executor: Arc<dyn SliceExecutor>,
}

impl std::fmt::Debug for TurnActivities {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TurnActivities").finish_non_exhaustive()
    }
}

impl TurnActivities {
    /// Activities doing the work with `executor`.
    pub fn new(executor: Arc<dyn SliceExecutor>) -> Self {
        Self { executor }
    }
}

/// An error as an activity failure, by core's one rule: what
/// [`StepFailure`] calls fatal is non-retryable; the rest (a fenced worker
/// included: another worker takes the activity) is retried by Temporal.
fn to_activity_error(e: harness_core::Error) -> ActivityError {
    let message = e.to_string();
    match StepFailure::from_error(&e) {
        StepFailure::Fatal(_) => {
            ActivityError::application(ApplicationFailure::non_retryable(message))
        }
        _ => ActivityError::application(ApplicationFailure::new(message)),
    }
}

/// How often an activity heartbeats: a quarter of its heartbeat timeout.
fn heartbeat_every(ctx: &ActivityContext) -> Duration {
    ctx.info()
        .heartbeat_timeout
        .map(|t| t / 4)
        .unwrap_or(Duration::from_secs(5))
        .max(Duration::from_millis(50))
}

/// Run `work` while heartbeating, so a worker killed during it is noticed
/// after the heartbeat timeout and the activity retried on another worker —
/// not after its start-to-close timeout (ten minutes for a sandbox create).
async fn heartbeating<T>(
    ctx: &ActivityContext,
    work: impl std::future::Future<Output = harness_core::Result<T>>,
) -> Result<T, ActivityError> {
    let every = heartbeat_every(ctx);
    let beat = async {
        loop {
            // A failed heartbeat (payload encoding) is not worth failing
            // the activity over: the heartbeat timeout will tell.
            let _ = ctx.record_heartbeat(()).await;
            tokio::time::sleep(every).await;
        }
    };
    tokio::select! {
        biased;
        result = work => result.map_err(to_activity_error),
        _ = beat => Err(ActivityError::application(
            ApplicationFailure::new("the heartbeat loop of the activity ended"),
        )),
    }
}

#[activities]
impl TurnActivities {
    /// `harness:create-sandbox`: create the session's sandbox from the
    /// turn's sandbox config (its first turn). A retry after a killed
    /// worker replaces what the killed attempt made (the sandbox is named
    /// after the turn: `SandboxSpec::slot`).
    #[activity(name = "harness:create-sandbox")]
    pub async fn create_sandbox(
        self: Arc<Self>,
        ctx: ActivityContext,
        state: TurnState,
    ) -> Result<SandboxHandle, ActivityError> {
        heartbeating(&ctx, self.executor.create_sandbox(&state)).await
    }

    /// `harness:slice`: run one slice with the worker's runner, heartbeating
    /// while it runs. A cancellation (the turn was aborted) fires the
    /// slice's abort signal, so the runner returns its report early and the
    /// workflow still learns the process it may have started.
    #[activity(name = "harness:slice")]
    pub async fn slice(
        self: Arc<Self>,
        ctx: ActivityContext,
        input: SliceInput,
    ) -> Result<SliceReport, ActivityError> {
        let abort = AbortSignal::new();
        let run = self.executor.run_slice(
            &input.state,
            Duration::from_millis(input.budget_ms),
            abort.clone(),
        );
        // Never ends by itself: it fires the abort and waits for `run`.
        let watch = async {
            ctx.cancelled().await;
            abort.abort();
            std::future::pending::<harness_core::Result<SliceReport>>().await
        };
        let run = async {
            tokio::select! {
                biased;
                result = run => result,
                result = watch => result,
            }
        };
        heartbeating(&ctx, run).await
    }

    /// `harness:kill-agent`: kill the turn's agent process (idempotent).
    #[activity(name = "harness:kill-agent")]
    pub async fn kill_agent(
        self: Arc<Self>,
        ctx: ActivityContext,
        input: KillInput,
    ) -> Result<(), ActivityError> {
        heartbeating(&ctx, self.executor.kill_agent(&input.state, &input.process)).await
    }

    /// `harness:record-end`: record the turn's terminal status in the
    /// session log (idempotent: keyed by the turn).
    #[activity(name = "harness:record-end")]
    pub async fn record_end(
        self: Arc<Self>,
        ctx: ActivityContext,
        state: TurnState,
    ) -> Result<(), ActivityError> {
        heartbeating(&ctx, self.executor.turn_ended(&state)).await
    }
}

/// The `harness_turn` workflow. See the module docs.
#[workflow]
#[derive(Debug)]
pub struct HarnessTurnWorkflow {
    driver: TurnDriver,
    tuning: ActivityTuning,
    slices_this_run: u32,
}

fn workflow_now_ms(ctx: &WorkflowContext<HarnessTurnWorkflow>) -> u64 {
    ctx.workflow_time()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn retry_policy(tuning: &ActivityTuning) -> RetryPolicy {
    RetryPolicy::builder()
        .initial_interval(Duration::from_millis(tuning.retry_initial_interval_ms))
        .maximum_attempts(tuning.retry_max_attempts)
        .build()
}

/// An activity that failed for good (its retries spent, or non-retryable).
fn failure(error: &ActivityExecutionError) -> StepFailure {
    let non_retryable = matches!(
        error.cause(),
        Some(temporalio_common::error::IncomingError::Application(app)) if app.is_non_retryable()
    );
    let message = error
        .cause()
        .map(|c| c.failure().message.clone())
        .filter(|m| !m.is_empty())
        .unwrap_or_else(|| error.to_string());
    if non_retryable {
        StepFailure::Fatal(message)
    } else {
        StepFailure::Retryable(message)
    }
}

/// Kill and record-end already ran Temporal's retries: a failure is final.
fn final_failure(error: &ActivityExecutionError) -> StepFailure {
    StepFailure::Fatal(failure(error).message().to_string())
}

#[workflow_methods]
impl HarnessTurnWorkflow {
    /// Build the workflow's state from its input.
    #[init]
    pub fn new(_ctx: &WorkflowContextView, input: TurnWorkflowInput) -> Self {
        Self {
            driver: input.driver,
            tuning: input.tuning,
            slices_this_run: 0,
        }
    }

    /// Drive the turn to its end; returns the final state.
    #[run(name = "harness_turn")]
    pub async fn run(ctx: &mut WorkflowContext<Self>) -> WorkflowResult<TurnState> {
        loop {
            let now_ms = workflow_now_ms(ctx);
            let (action, state, tuning) = ctx.state_mut(|s| {
                let action = s.driver.poll(now_ms);
                (action, s.driver.state().clone(), s.tuning.clone())
            });
            // Every activity heartbeats (`heartbeating`): a dead worker's
            // activity moves on after the heartbeat timeout.
            let options = |timeout_ms: u64| {
                ActivityOptions::with_start_to_close_timeout(Duration::from_millis(timeout_ms))
                    .heartbeat_timeout(Duration::from_millis(tuning.heartbeat_timeout_ms))
                    .retry_policy(retry_policy(&tuning))
                    .build()
            };
            match action {
                TurnAction::CreateSandbox => {
                    let result = ctx
                        .execute_activity(
                            TurnActivities::create_sandbox,
                            state,
                            options(tuning.create_sandbox_timeout_ms),
                        )
                        .await;
                    ctx.state_mut(|s| s.driver.sandbox_created(result.map_err(|e| failure(&e))));
                }
                TurnAction::RunSlice { budget_ms } => {
                    let done_here = ctx.state(|s| s.slices_this_run);
                    if tuning.continue_as_new_after_slices > 0
                        && done_here >= tuning.continue_as_new_after_slices
                    {
                        let input = ctx.state(|s| TurnWorkflowInput {
                            driver: s.driver.clone(),
                            tuning: s.tuning.clone(),
                        });
                        ctx.continue_as_new(input, ContinueAsNewOptions::default())?;
                    }
                    let options = ActivityOptions::with_start_to_close_timeout(
                        Duration::from_millis(budget_ms.saturating_add(tuning.slice_margin_ms)),
                    )
                    .heartbeat_timeout(Duration::from_millis(tuning.heartbeat_timeout_ms))
                    .retry_policy(retry_policy(&tuning))
                    // On abort, wait for the slice to stop (it reports the
                    // process it may have started, which must be killed).
                    .cancellation_type(ActivityCancellationType::WaitCancellationCompleted)
                    .build();
                    let activity = ctx.execute_activity(
                        TurnActivities::slice,
                        SliceInput { state, budget_ms },
                        options,
                    );
                    let mut activity = std::pin::pin!(activity);
                    let first = {
                        let mut aborted =
                            std::pin::pin!(ctx.wait_condition(|s| s.driver.abort_requested()));
                        temporalio_sdk::workflows::select! {
                            result = activity.as_mut() => Some(result),
                            _ = aborted.as_mut() => None,
                        }
                    };
                    let result = match first {
                        Some(result) => result,
                        None => {
                            activity.cancel();
                            activity.as_mut().await
                        }
                    };
                    let now_ms = workflow_now_ms(ctx);
                    ctx.state_mut(|s| {
                        s.driver.slice_done(result.map_err(|e| failure(&e)), now_ms);
                        s.slices_this_run += 1;
                    });
                }
                TurnAction::KillAgent { process } => {
                    let result = ctx
                        .execute_activity(
                            TurnActivities::kill_agent,
                            KillInput { state, process },
                            options(tuning.kill_timeout_ms),
                        )
                        .await;
                    ctx.state_mut(|s| s.driver.agent_killed(result.map_err(|e| final_failure(&e))));
                }
                TurnAction::RecordEnd => {
                    let result = ctx
                        .execute_activity(
                            TurnActivities::record_end,
                            state,
                            options(tuning.kill_timeout_ms),
                        )
                        .await;
                    ctx.state_mut(|s| s.driver.end_recorded(result.map_err(|e| final_failure(&e))));
                }
                TurnAction::AwaitInput => {
                    ctx.wait_condition(|s| s.driver.has_input()).await?;
                }
                // Activities never report `Fenced` to the workflow (a fenced
                // worker's attempt is retried elsewhere), so this is only
                // reachable if that rule changes; end with what we have.
                TurnAction::Stop | TurnAction::Done => return Ok(state),
            }
        }
    }

    /// Signal `approve`: hand a client's answer to the turn.
    #[signal(name = "approve")]
    pub fn signal_approve(&mut self, _ctx: &mut SyncWorkflowContext<Self>, answer: ApprovalAnswer) {
        self.driver.answer(answer);
    }

    /// Signal `abort`: abort the turn (the first reason wins).
    #[signal(name = "abort")]
    pub fn signal_abort(&mut self, _ctx: &mut SyncWorkflowContext<Self>, request: AbortRequest) {
        self.driver.abort(request.reason);
    }

    /// Query `state`: the current turn state.
    #[query(name = "state")]
    pub fn query_state(&self, _ctx: &WorkflowContextView) -> TurnState {
        self.driver.state().clone()
    }
}
