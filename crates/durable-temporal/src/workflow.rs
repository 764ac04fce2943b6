//! The `harness_turn` workflow and its two activities, `harness:slice` and
//! `harness:kill-agent`.
//!
//! The workflow is a thin loop around [`harness_core::turn::step`]: it holds
//! the [`TurnState`], asks [`next_step`] what to do, does it with SDK
//! primitives only (activities, `wait_condition`, deterministic `select!`,
//! `workflow_time`), and feeds the result back as a [`TurnEvent`]. Nothing
//! in it does I/O, reads the clock or spawns tasks, so a replay on another
//! worker takes exactly the same path.

use std::collections::VecDeque;
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
use harness_core::sandbox::DetachedProcess;
use harness_core::slice::SliceRunner;
use harness_core::stream::AbortSignal;
use harness_core::turn::{
    next_step, step, ApprovalAnswer, NextStep, SliceReport, TurnEvent, TurnState,
};
use harness_core::ErrorKind;

/// Workflow type name registered with the server.
pub const WORKFLOW_TYPE: &str = "harness_turn";
/// Activity type of one slice.
pub const SLICE_ACTIVITY: &str = "harness:slice";
/// Activity type that kills a turn's agent process.
pub const KILL_ACTIVITY: &str = "harness:kill-agent";
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
    /// Heartbeat timeout of `harness:slice`. A worker that dies mid-slice
    /// is noticed after this long and the slice is retried elsewhere. The
    /// activity heartbeats every quarter of it (the SDK sends at most one
    /// heartbeat per 0.8 × timeout to the server).
    pub heartbeat_timeout_ms: u64,
    /// First retry delay of a failed activity attempt.
    pub retry_initial_interval_ms: u64,
    /// Attempts per activity before the failure reaches the turn machine
    /// (which then counts a failed slice).
    pub retry_max_attempts: u32,
    /// Start-to-close timeout of `harness:kill-agent`.
    pub kill_timeout_ms: u64,
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
            continue_as_new_after_slices: 200,
        }
    }
}

/// The workflow's input: the turn state plus tuning. Continue-as-new also
/// carries signals received but not yet applied.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TurnWorkflowInput {
    /// The turn (must be `not_started` on the first run).
    pub state: TurnState,
    /// Activity settings.
    #[serde(default)]
    pub tuning: ActivityTuning,
    /// An abort received before a continue-as-new.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending_abort: Option<String>,
    /// Approval answers received before a continue-as-new.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pending_approvals: Vec<ApprovalAnswer>,
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

/// The activities, run by a worker that owns a [`SliceRunner`].
#[derive(Debug)]
pub struct TurnActivities {
    runner: SliceRunner,
}

impl TurnActivities {
    /// Activities running slices with `runner`.
    pub fn new(runner: SliceRunner) -> Self {
        Self { runner }
    }
}

fn to_activity_error(e: harness_core::Error) -> ActivityError {
    let message = e.to_string();
    if matches!(
        e.kind(),
        ErrorKind::InvalidInput | ErrorKind::Unsafe | ErrorKind::Unauthorized
    ) {
        // Retrying cannot help; the workflow reads the flag back and fails
        // the turn right away.
        ActivityError::application(ApplicationFailure::non_retryable(message))
    } else {
        ActivityError::application(ApplicationFailure::new(message))
    }
}

#[activities]
impl TurnActivities {
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
        let every = ctx
            .info()
            .heartbeat_timeout
            .map(|t| t / 4)
            .unwrap_or(Duration::from_secs(5))
            .max(Duration::from_millis(50));
        let run = self.runner.run(
            &input.state,
            Duration::from_millis(input.budget_ms),
            abort.clone(),
        );
        let watch = async {
            ctx.cancelled().await;
            abort.abort();
            std::future::pending::<()>().await;
        };
        let beat = async {
            loop {
                // A failed heartbeat (payload encoding) is not worth failing
                // the slice over: the heartbeat timeout will tell.
                let _ = ctx.record_heartbeat(()).await;
                tokio::time::sleep(every).await;
            }
        };
        tokio::select! {
            biased;
            result = run => result.map_err(to_activity_error),
            _ = futures::future::join(watch, beat) => Err(ActivityError::application(
                ApplicationFailure::new("the heartbeat loop of the slice ended"),
            )),
        }
    }

    /// `harness:kill-agent`: kill the turn's agent process (idempotent).
    #[activity(name = "harness:kill-agent")]
    pub async fn kill_agent(
        self: Arc<Self>,
        _ctx: ActivityContext,
        input: KillInput,
    ) -> Result<(), ActivityError> {
        self.runner
            .kill_agent(&input.state, &input.process)
            .await
            .map_err(to_activity_error)
    }
}

/// The `harness_turn` workflow. See the module docs.
#[workflow]
#[derive(Debug)]
pub struct HarnessTurnWorkflow {
    turn: TurnState,
    tuning: ActivityTuning,
    abort: Option<String>,
    approvals: VecDeque<ApprovalAnswer>,
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

fn failed_event(error: &ActivityExecutionError) -> TurnEvent {
    let non_retryable = matches!(
        error.cause(),
        Some(temporalio_common::error::IncomingError::Application(app)) if app.is_non_retryable()
    );
    let message = error
        .cause()
        .map(|c| c.failure().message.clone())
        .filter(|m| !m.is_empty())
        .unwrap_or_else(|| error.to_string());
    TurnEvent::SliceFailed {
        error: message,
        retryable: !non_retryable,
    }
}

fn terminate(e: harness_core::Error) -> ApplicationFailure {
    ApplicationFailure::non_retryable(e.to_string())
}

#[workflow_methods]
impl HarnessTurnWorkflow {
    /// Build the workflow's state from its input.
    #[init]
    pub fn new(_ctx: &WorkflowContextView, input: TurnWorkflowInput) -> Self {
        Self {
            turn: input.state,
            tuning: input.tuning,
            abort: input.pending_abort,
            approvals: input.pending_approvals.into(),
            slices_this_run: 0,
        }
    }

    /// Drive the turn to its end; returns the final state.
    #[run(name = "harness_turn")]
    pub async fn run(ctx: &mut WorkflowContext<Self>) -> WorkflowResult<TurnState> {
        loop {
            let (state, abort, tuning) =
                ctx.state(|s| (s.turn.clone(), s.abort.clone(), s.tuning.clone()));
            if let Some(reason) = abort {
                if !state.status.is_terminal() {
                    let (next, _) = step(state, TurnEvent::Abort { reason }).map_err(terminate)?;
                    ctx.state_mut(|s| s.turn = next);
                    continue;
                }
            }
            match next_step(&state) {
                NextStep::AwaitStart => {
                    let now_ms = workflow_now_ms(ctx);
                    let (next, _) = step(state, TurnEvent::Start { now_ms }).map_err(terminate)?;
                    ctx.state_mut(|s| s.turn = next);
                }
                NextStep::RunSlice { budget_ms } => {
                    let done_here = ctx.state(|s| s.slices_this_run);
                    if tuning.continue_as_new_after_slices > 0
                        && done_here >= tuning.continue_as_new_after_slices
                    {
                        let input = ctx.state(|s| TurnWorkflowInput {
                            state: s.turn.clone(),
                            tuning: s.tuning.clone(),
                            pending_abort: s.abort.clone(),
                            pending_approvals: s.approvals.iter().cloned().collect(),
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
                        SliceInput {
                            state: state.clone(),
                            budget_ms,
                        },
                        options,
                    );
                    let mut activity = std::pin::pin!(activity);
                    let first = {
                        let mut aborted = std::pin::pin!(ctx.wait_condition(|s| s.abort.is_some()));
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
                    let event = match &result {
                        Ok(report) => TurnEvent::SliceCompleted {
                            report: report.clone(),
                            now_ms,
                        },
                        Err(e) => failed_event(e),
                    };
                    let next = match step(state.clone(), event) {
                        Ok((next, _)) => next,
                        // A report the machine refuses (stale cursor) counts
                        // as a failed slice, as in the in-process engine.
                        Err(e) => {
                            step(
                                state,
                                TurnEvent::SliceFailed {
                                    error: e.to_string(),
                                    retryable: true,
                                },
                            )
                            .map_err(terminate)?
                            .0
                        }
                    };
                    ctx.state_mut(|s| {
                        s.turn = next;
                        s.slices_this_run += 1;
                    });
                }
                NextStep::KillAgent { process } => {
                    let options = ActivityOptions::with_start_to_close_timeout(
                        Duration::from_millis(tuning.kill_timeout_ms),
                    )
                    .retry_policy(retry_policy(&tuning))
                    .build();
                    let result = ctx
                        .execute_activity(
                            TurnActivities::kill_agent,
                            KillInput {
                                state: state.clone(),
                                process,
                            },
                            options,
                        )
                        .await;
                    let (mut next, _) = step(state, TurnEvent::AgentKilled).map_err(terminate)?;
                    if let Err(e) = result {
                        // Retries are exhausted (the sandbox may be gone):
                        // the turn is already terminal, keep why.
                        next.error = Some(format!(
                            "{} (and killing the agent failed: {e})",
                            next.error.unwrap_or_default()
                        ));
                    }
                    ctx.state_mut(|s| s.turn = next);
                }
                NextStep::AwaitApproval { approval_id } => {
                    ctx.wait_condition(|s| s.abort.is_some() || !s.approvals.is_empty())
                        .await?;
                    let answer = ctx.state_mut(|s| s.approvals.pop_front());
                    if let Some(answer) = answer {
                        if answer.approval_id == approval_id {
                            if let Ok((next, _)) = step(state, TurnEvent::ApprovalAnswered(answer))
                            {
                                ctx.state_mut(|s| s.turn = next);
                            }
                        }
                        // An answer to another request is dropped.
                    }
                }
                NextStep::Done { .. } => return Ok(state),
            }
        }
    }

    /// Signal `approve`: queue a client's answer to the pending request.
    #[signal(name = "approve")]
    pub fn signal_approve(&mut self, _ctx: &mut SyncWorkflowContext<Self>, answer: ApprovalAnswer) {
        self.approvals.push_back(answer);
    }

    /// Signal `abort`: abort the turn (the first reason wins).
    #[signal(name = "abort")]
    pub fn signal_abort(&mut self, _ctx: &mut SyncWorkflowContext<Self>, request: AbortRequest) {
        if self.abort.is_none() {
            self.abort = Some(request.reason);
        }
    }

    /// Query `state`: the current turn state.
    #[query(name = "state")]
    pub fn query_state(&self, _ctx: &WorkflowContextView) -> TurnState {
        self.turn.clone()
    }
}
