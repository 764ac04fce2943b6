//! The body of a turn's Workflow instance: core's [`TurnDriver`] driven
//! through durable steps.
//!
//! Workflows runs an instance's `run` from the top every time it resumes
//! it (after a sleep, an eviction, a retry of the whole instance); each
//! `step.do` whose name was seen before returns its recorded output
//! without running again. So this loop must take the same path on every
//! replay, and everything it decides on comes out of a step:
//!
//! - the time the driver is fed is the time the previous step *recorded*
//!   (a step's output is `{at_ms, ok | failure}`), never the clock at
//!   replay;
//! - step names are numbered in the order the loop asks for them
//!   (`0003 slice`), so a replay asks for the same names in the same order;
//! - the executor runs only inside a step body.
//!
//! The seam to the runtime is [`Steps`]: `binding::WorkflowSteps` on wasm32
//! (a `WorkflowStep`), and a replaying double in this crate's tests.

use std::rc::Rc;
use std::time::Duration;

use async_trait::async_trait;
use futures::future::LocalBoxFuture;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use harness_core::engine::SliceExecutor;
use harness_core::sandbox::{DetachedProcess, SandboxHandle};
use harness_core::stream::AbortSignal;
use harness_core::turn::{ApprovalAnswer, SliceReport, TurnState, TurnStatus};
use harness_core::turn_driver::{StepFailure, TurnAction, TurnDriver};
use harness_core::Result;

/// The event type a waiting turn takes its input from
/// (`instance.sendEvent({type: "turn-input", payload})`), a JSON
/// [`TurnInput`].
pub const INPUT_EVENT: &str = "turn-input";

/// How long a turn whose slice was aborted waits for the abort's event,
/// which carries the client's reason (it was sent with the abort, so it is
/// normally there already).
pub const ABORT_REASON_WAIT_MS: u64 = 10_000;

/// What a Workflow instance is created with (its `params`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TurnParams {
    /// The turn's initial state (`SessionRuntime::initial_state`).
    pub state: TurnState,
    /// The runner generation this instance emits parts as: a newer
    /// instance of the same session fences it.
    pub generation: u64,
    /// Retries and timeouts of the steps (in the params, not read from the
    /// Worker's environment, so a replay schedules the same steps).
    #[serde(default)]
    pub tuning: StepTuning,
}

/// A client's input to a waiting turn.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "kebab-case")]
pub enum TurnInput {
    /// An answer to the pending approval.
    Answer {
        /// The answer.
        answer: ApprovalAnswer,
    },
    /// Abort the turn.
    Abort {
        /// Why.
        reason: String,
    },
}

/// Retries and timeouts of a turn's steps.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct StepTuning {
    /// Retries of a step that failed retryably (after the first attempt).
    pub retries: u32,
    /// Delay before each retry (constant).
    pub retry_delay_ms: u64,
    /// Added to the slice budget for the slice step's timeout.
    pub slice_margin_ms: u64,
    /// Timeout of the other steps (creating a sandbox runs its bootstrap).
    pub step_timeout_ms: u64,
    /// How long a turn waits for an approval answer before it is aborted.
    pub input_timeout_ms: u64,
}

impl Default for StepTuning {
    fn default() -> Self {
        Self {
            retries: 3,
            retry_delay_ms: 2_000,
            slice_margin_ms: 60_000,
            step_timeout_ms: 10 * 60_000,
            input_timeout_ms: 24 * 3_600_000,
        }
    }
}

/// How one step is run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepOptions {
    /// Timeout of one attempt.
    pub timeout_ms: u64,
    /// Retries after the first attempt.
    pub retries: u32,
    /// Delay before each retry.
    pub retry_delay_ms: u64,
}

/// One attempt of a step: `Ok(json)` is recorded as the step's output;
/// `Err(message)` fails the attempt, which the runtime retries.
pub type StepBody = Rc<dyn Fn() -> LocalBoxFuture<'static, std::result::Result<String, String>>>;

/// The durable-step runtime: Workflows' `WorkflowStep` on wasm32.
#[async_trait(?Send)]
pub trait Steps {
    /// Run `body` as the step `name`, or return what it recorded before.
    /// `Err(message)` when every attempt failed.
    async fn run(
        &self,
        name: &str,
        options: StepOptions,
        body: StepBody,
    ) -> std::result::Result<String, String>;

    /// Wait for a [`INPUT_EVENT`] event (its payload, as JSON), or what
    /// this wait recorded before. `Err` after `timeout_ms` without one.
    async fn wait_input(&self, name: &str, timeout_ms: u64) -> std::result::Result<String, String>;

    /// The turn's state changed (its status, or the approval it waits
    /// for): publish it where `turn_state` can read it while the instance
    /// runs (an instance shows no output before its end). Not a step: a
    /// replay publishes again, ending at the same state. By default
    /// nothing is published.
    async fn progress(&self, _state: &TurnState) {}
}

/// What a step records: the result of the action, when it finished and,
/// for a slice, whether the executor aborted it.
///
/// Read back with [`read_record`]: `ok` is present for a success even when
/// the result is `()` (JSON `null`), so a unit success is not mistaken for
/// a record of nothing.
#[derive(Debug, Serialize)]
struct Record<T> {
    at_ms: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    ok: Option<T>,
    #[serde(skip_serializing_if = "Option::is_none")]
    failure: Option<StepFailure>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    aborted: bool,
}

/// A step's recorded output: when it finished, the action's result (a
/// failure, else the `ok` value, which may be `null` for `()`), and whether
/// the slice was aborted. Records written before `ok` and `failure` were
/// left out when empty (`"ok": null, "failure": null` for a unit success)
/// read the same way.
fn read_record<T: DeserializeOwned>(json: &str) -> std::result::Result<ReadRecord<T>, String> {
    let value: serde_json::Value = serde_json::from_str(json).map_err(|e| e.to_string())?;
    let at_ms = value["at_ms"]
        .as_u64()
        .ok_or_else(|| "no at_ms".to_string())?;
    let aborted = value["aborted"].as_bool().unwrap_or(false);
    let result = match (value.get("failure"), value.get("ok")) {
        (Some(failure), _) if !failure.is_null() => Some(Err(serde_json::from_value(
            failure.clone(),
        )
        .map_err(|e| e.to_string())?)),
        (_, Some(ok)) => Some(Ok(
            serde_json::from_value(ok.clone()).map_err(|e| e.to_string())?
        )),
        _ => None,
    };
    Ok(ReadRecord {
        at_ms,
        result,
        aborted,
    })
}

/// A [`Record`] as read back.
struct ReadRecord<T> {
    at_ms: u64,
    /// `None`: the record holds neither a result nor a failure.
    result: Option<std::result::Result<T, StepFailure>>,
    aborted: bool,
}

/// The step body's verdict on an action's result: success and failures no
/// attempt can change are recorded; a retryable failure fails the attempt.
fn record<T: Serialize>(result: Result<T>, at_ms: u64) -> std::result::Result<String, String> {
    record_slice(result, at_ms, false)
}

/// [`record`], noting whether the slice's abort signal fired.
fn record_slice<T: Serialize>(
    result: Result<T>,
    at_ms: u64,
    aborted: bool,
) -> std::result::Result<String, String> {
    let record = match result {
        Ok(value) => Record {
            at_ms,
            ok: Some(value),
            failure: None,
            aborted,
        },
        Err(e) => match StepFailure::from_error(&e) {
            StepFailure::Retryable(message) => return Err(message),
            failure => Record {
                at_ms,
                ok: None,
                failure: Some(failure),
                aborted,
            },
        },
    };
    serde_json::to_string(&record).map_err(|e| format!("encoding the step's output: {e}"))
}

/// Run one action as a step and read back its record: the action's result
/// (a step that failed every attempt is `Retryable` with its last message)
/// and the time it finished, if it recorded one.
async fn step<T: DeserializeOwned>(
    steps: &dyn Steps,
    name: &str,
    options: StepOptions,
    body: StepBody,
) -> (Option<u64>, std::result::Result<T, StepFailure>) {
    let (at, result, _) = step_aborted(steps, name, options, body).await;
    (at, result)
}

/// [`step`], with whether the recorded attempt was aborted.
async fn step_aborted<T: DeserializeOwned>(
    steps: &dyn Steps,
    name: &str,
    options: StepOptions,
    body: StepBody,
) -> (Option<u64>, std::result::Result<T, StepFailure>, bool) {
    match steps.run(name, options, body).await {
        Ok(json) => match read_record::<T>(&json) {
            Ok(ReadRecord {
                at_ms,
                result: Some(result),
                aborted,
            }) => (Some(at_ms), result, aborted),
            Ok(ReadRecord {
                at_ms,
                result: None,
                ..
            }) => (
                Some(at_ms),
                Err(StepFailure::Fatal(format!(
                    "step {name} recorded neither a result nor a failure"
                ))),
                false,
            ),
            Err(e) => (
                None,
                Err(StepFailure::Fatal(format!(
                    "step {name} recorded an unreadable output: {e}"
                ))),
                false,
            ),
        },
        Err(message) => (None, Err(StepFailure::Retryable(message)), false),
    }
}

/// Drive a turn to its end through `steps`; returns the final state.
///
/// `clock` is read only inside step bodies (its readings are recorded).
/// Parts reach the session through `executor`'s sink as they are parsed,
/// keyed by spool offset, so a retried or replayed slice re-emits nothing
/// the log has not deduplicated.
pub async fn run_turn(
    params: TurnParams,
    steps: &dyn Steps,
    executor: Rc<dyn SliceExecutor>,
    clock: Rc<dyn Fn() -> u64>,
) -> Result<TurnState> {
    let tuning = params.tuning;
    let mut driver = TurnDriver::new(params.state)?;
    let mut seq = 0u32;
    let mut next_name = |what: &str| {
        seq += 1;
        format!("{seq:04} {what}")
    };
    let options = |timeout_ms: u64| StepOptions {
        timeout_ms,
        retries: tuning.retries,
        retry_delay_ms: tuning.retry_delay_ms,
    };

    let start_clock = clock.clone();
    let (at, _) = step::<u64>(
        steps,
        &next_name("start"),
        options(tuning.step_timeout_ms),
        Rc::new(move || {
            let now = start_clock();
            Box::pin(async move { record(Ok(now), now) })
        }),
    )
    .await;
    let mut now_ms = at.unwrap_or(0);
    let mut published: Option<(TurnStatus, Option<String>)> = None;

    loop {
        // Poll first: polling applies what waited (the start, a client's
        // answer), and the step must run on the state that results.
        let next = driver.poll(now_ms);
        let state = driver.state().clone();
        let shown = (
            state.status,
            state
                .pending_approval
                .as_ref()
                .map(|p| p.approval_id.clone()),
        );
        if published.as_ref() != Some(&shown) {
            steps.progress(&state).await;
            published = Some(shown);
        }
        // One step body per action: the executor call on this state,
        // recorded with the time it finished.
        let body = |action: Action| -> StepBody {
            let (executor, clock, state) = (executor.clone(), clock.clone(), state.clone());
            Rc::new(move || {
                let (executor, clock, state, action) = (
                    executor.clone(),
                    clock.clone(),
                    state.clone(),
                    action.clone(),
                );
                Box::pin(async move { action.perform(executor.as_ref(), &state, clock).await })
            })
        };
        match next {
            TurnAction::CreateSandbox => {
                let (at, result) = step::<SandboxHandle>(
                    steps,
                    &next_name("create-sandbox"),
                    options(tuning.step_timeout_ms),
                    body(Action::CreateSandbox),
                )
                .await;
                now_ms = at.unwrap_or(now_ms);
                driver.sandbox_created(result);
            }
            TurnAction::RunSlice { budget_ms } => {
                let (at, result, aborted) = step_aborted::<SliceReport>(
                    steps,
                    &next_name("slice"),
                    options(budget_ms.saturating_add(tuning.slice_margin_ms)),
                    body(Action::RunSlice { budget_ms }),
                )
                .await;
                now_ms = at.unwrap_or(now_ms);
                driver.slice_done(result, now_ms);
                if aborted {
                    // The reason travels as the abort event the engine sent
                    // beside the mailbox (`abort_turn`): take it, recorded.
                    let waited = steps
                        .wait_input(&next_name("abort-reason"), ABORT_REASON_WAIT_MS)
                        .await;
                    let reason = match waited.map(|json| serde_json::from_str::<TurnInput>(&json)) {
                        Ok(Ok(TurnInput::Abort { reason })) => reason,
                        _ => "aborted by a client while a slice ran".to_string(),
                    };
                    driver.abort(reason);
                }
            }
            TurnAction::KillAgent { process } => {
                let (at, result) = step::<()>(
                    steps,
                    &next_name("kill-agent"),
                    options(tuning.step_timeout_ms),
                    body(Action::KillAgent(process)),
                )
                .await;
                now_ms = at.unwrap_or(now_ms);
                // The step's retries are spent: a failure is final.
                driver.agent_killed(result.map_err(final_failure));
            }
            TurnAction::RecordEnd => {
                let (at, result) = step::<()>(
                    steps,
                    &next_name("record-end"),
                    options(tuning.step_timeout_ms),
                    body(Action::RecordEnd),
                )
                .await;
                now_ms = at.unwrap_or(now_ms);
                driver.end_recorded(result.map_err(final_failure));
            }
            TurnAction::AwaitInput => {
                match steps
                    .wait_input(&next_name("input"), tuning.input_timeout_ms)
                    .await
                {
                    Ok(json) => match serde_json::from_str::<TurnInput>(&json) {
                        Ok(TurnInput::Answer { answer }) => driver.answer(answer),
                        Ok(TurnInput::Abort { reason }) => driver.abort(reason),
                        // The event is recorded, so a replay ends the same way.
                        Err(e) => {
                            driver.abort(format!("a {INPUT_EVENT} event is not a turn input: {e}"))
                        }
                    },
                    Err(message) => driver.abort(format!(
                        "no answer within {} s ({message})",
                        tuning.input_timeout_ms / 1000
                    )),
                }
            }
            TurnAction::Stop | TurnAction::Done => return Ok(driver.into_state()),
        }
    }
}

/// The executor call one step makes.
#[derive(Debug, Clone)]
enum Action {
    CreateSandbox,
    RunSlice { budget_ms: u64 },
    KillAgent(DetachedProcess),
    RecordEnd,
}

impl Action {
    /// Make the call and record its result (see [`record`]).
    async fn perform(
        &self,
        executor: &dyn SliceExecutor,
        state: &TurnState,
        clock: Rc<dyn Fn() -> u64>,
    ) -> std::result::Result<String, String> {
        match self {
            Action::CreateSandbox => record(executor.create_sandbox(state).await, clock()),
            Action::RunSlice { budget_ms } => {
                // A Workflow cannot signal a running step, so the executor
                // watches for an abort itself (the Worker asks the
                // session's object) and fires this signal; the record says
                // it did.
                let abort = AbortSignal::new();
                let budget = Duration::from_millis(*budget_ms);
                let result = executor.run_slice(state, budget, abort.clone()).await;
                record_slice(result, clock(), abort.is_aborted())
            }
            Action::KillAgent(process) => {
                record(executor.kill_agent(state, process).await, clock())
            }
            Action::RecordEnd => record(executor.turn_ended(state).await, clock()),
        }
    }
}

/// Killing and recording the end already ran the step's retries.
fn final_failure(failure: StepFailure) -> StepFailure {
    match failure {
        StepFailure::Retryable(message) => StepFailure::Fatal(message),
        other => other,
    }
}
