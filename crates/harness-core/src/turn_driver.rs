//! [`TurnDriver`]: the one loop around the turn machine, as a sans-IO
//! machine every engine drives.
//!
//! [`crate::turn`] says what a turn's state becomes after an event. The
//! driver holds the rest of what running a turn means, so that no engine
//! writes it again: it applies a pending abort before anything else, feeds
//! the start time, matches approval answers to the pending request (an
//! answer that arrives while the slice that asks is still reporting is
//! kept), classifies failures once ([`StepFailure::from_error`]: what is
//! retryable, what is fatal, what means "this runner was fenced"), counts a
//! report the machine refuses (a stale cursor) as a failed slice, gives up
//! killing the agent after [`MAX_KILL_ATTEMPTS`], and makes sure the end
//! of the turn is recorded in the session log.
//!
//! Like `quinn-proto`, it never does I/O: an engine asks [`TurnDriver::poll`]
//! what to do, does it, and reports the result with the matching method.
//!
//! ```text
//! loop {
//!     match driver.poll(clock.now_ms()) {
//!         TurnAction::CreateSandbox      => driver.sandbox_created(executor.create_sandbox(..)),
//!         TurnAction::RunSlice{budget}   => driver.slice_done(executor.run_slice(..), now),
//!         TurnAction::KillAgent{process} => driver.agent_killed(executor.kill_agent(..)),
//!         TurnAction::RecordEnd          => driver.end_recorded(executor.turn_ended(..)),
//!         TurnAction::AwaitInput         => wait for driver.answer(..) / driver.abort(..),
//!         TurnAction::Stop | TurnAction::Done => break,
//!     }
//!     persist driver.state() (in-process) — Temporal's history does it for us
//! }
//! ```
//!
//! The in-process engine runs this loop on a task; the Temporal workflow
//! runs it with activities for the I/O steps and holds the driver as its
//! workflow state (signals call [`TurnDriver::answer`] and
//! [`TurnDriver::abort`]); a continue-as-new carries the serialized driver.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

use crate::sandbox::{DetachedProcess, SandboxHandle};
use crate::turn::{
    next_step, step, ApprovalAnswer, NextStep, SliceReport, TurnEvent, TurnState, TurnStatus,
    TURN_STATE_VERSION,
};
use crate::{Error, ErrorKind, Result};

/// Kill attempts before the driver gives up on the agent process (the
/// sandbox may be gone) and records the turn's end anyway.
pub const MAX_KILL_ATTEMPTS: u32 = 5;

/// Attempts to record the end before the driver gives up (the log is
/// unreachable); the failure is kept in the state's error.
pub const MAX_RECORD_ATTEMPTS: u32 = 5;

/// How a step of a turn failed, decided once for every engine.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", content = "message", rename_all = "snake_case")]
pub enum StepFailure {
    /// Another attempt may succeed (a backend hiccup, an unreachable sandbox).
    Retryable(String),
    /// No attempt will succeed (bad input, an unsafe or unauthorized request).
    Fatal(String),
    /// A newer runner replaced this one: stop driving the turn at once and
    /// touch nothing (the newer runner continues it).
    Fenced(String),
}

impl StepFailure {
    /// Classify an error: `InvalidInput`, `Unsafe` and `Unauthorized` are
    /// fatal, `Fenced` is fenced, everything else may pass on retry.
    pub fn from_error(error: &Error) -> Self {
        let message = error.to_string();
        match error.kind() {
            ErrorKind::InvalidInput | ErrorKind::Unsafe | ErrorKind::Unauthorized => {
                StepFailure::Fatal(message)
            }
            ErrorKind::Fenced => StepFailure::Fenced(message),
            _ => StepFailure::Retryable(message),
        }
    }

    /// Whether another attempt may help (fenced: yes, by another runner).
    pub fn is_retryable(&self) -> bool {
        !matches!(self, StepFailure::Fatal(_))
    }

    /// The message.
    pub fn message(&self) -> &str {
        match self {
            StepFailure::Retryable(m) | StepFailure::Fatal(m) | StepFailure::Fenced(m) => m,
        }
    }
}

impl From<&Error> for StepFailure {
    fn from(error: &Error) -> Self {
        StepFailure::from_error(error)
    }
}

/// What the engine must do next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TurnAction {
    /// Create the session's sandbox; report with [`TurnDriver::sandbox_created`].
    CreateSandbox,
    /// Run one slice of at most `budget_ms`; report with [`TurnDriver::slice_done`].
    RunSlice {
        /// The slice budget.
        budget_ms: u64,
    },
    /// Kill the agent process; report with [`TurnDriver::agent_killed`].
    KillAgent {
        /// The process.
        process: DetachedProcess,
    },
    /// Record the terminal status in the session log; report with
    /// [`TurnDriver::end_recorded`].
    RecordEnd,
    /// Wait for [`TurnDriver::answer`] or [`TurnDriver::abort`], then poll again.
    AwaitInput,
    /// This runner was fenced: stop now, persist nothing, kill nothing.
    Stop,
    /// The turn is over and its end recorded.
    Done,
}

/// The sans-IO loop of one turn. See the module docs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TurnDriver {
    state: TurnState,
    /// An abort asked for and not applied yet (the first reason wins).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    abort: Option<String>,
    /// Whether an abort was ever asked for (stays set once applied).
    #[serde(default)]
    aborted: bool,
    /// Answers received and not applied yet.
    #[serde(default, skip_serializing_if = "VecDeque::is_empty")]
    answers: VecDeque<ApprovalAnswer>,
    #[serde(default)]
    kill_attempts: u32,
    #[serde(default)]
    record_attempts: u32,
    /// Set when this runner was fenced.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    fenced: Option<String>,
}

impl TurnDriver {
    /// A driver for `state` (a fresh turn, or one loaded after a restart).
    pub fn new(state: TurnState) -> Result<Self> {
        if state.version != TURN_STATE_VERSION {
            return Err(Error::invalid(format!(
                "turn state version {} is not supported (expected {TURN_STATE_VERSION})",
                state.version
            )));
        }
        Ok(Self {
            state,
            abort: None,
            aborted: false,
            answers: VecDeque::new(),
            kill_attempts: 0,
            record_attempts: 0,
            fenced: None,
        })
    }

    /// The turn's state (persist it after every report).
    pub fn state(&self) -> &TurnState {
        &self.state
    }

    /// The state, consuming the driver.
    pub fn into_state(self) -> TurnState {
        self.state
    }

    /// Why this runner was fenced, if it was.
    pub fn fenced(&self) -> Option<&str> {
        self.fenced.as_deref()
    }

    /// A client asked to abort. Applied at the next [`poll`](Self::poll);
    /// the engine should also cut a running slice short.
    pub fn abort(&mut self, reason: impl Into<String>) {
        if !self.aborted && !self.state.status.is_terminal() {
            self.aborted = true;
            self.abort = Some(reason.into());
        }
    }

    /// Whether an abort was asked for.
    pub fn abort_requested(&self) -> bool {
        self.aborted
    }

    /// A client answered a permission request. Kept until the turn waits on
    /// that request (the slice that surfaces it may still be reporting).
    pub fn answer(&mut self, answer: ApprovalAnswer) {
        let known = self
            .state
            .approval_answers
            .iter()
            .chain(self.answers.iter())
            .any(|a| a.approval_id == answer.approval_id);
        if !known && !self.state.status.is_terminal() {
            self.answers.push_back(answer);
        }
    }

    /// Whether an abort or an answer waits to be applied (wake a driver
    /// parked on [`TurnAction::AwaitInput`]).
    pub fn has_input(&self) -> bool {
        self.abort.is_some() || !self.answers.is_empty()
    }

    /// What to do next. Applies a pending abort first, then starts the turn
    /// (stamped `now_ms`) or hands it a waiting answer, as the state allows.
    pub fn poll(&mut self, now_ms: u64) -> TurnAction {
        if self.fenced.is_some() {
            return TurnAction::Stop;
        }
        if let Some(reason) = self.abort.take() {
            if !self.state.status.is_terminal() {
                self.apply(TurnEvent::Abort { reason });
            }
        }
        loop {
            match next_step(&self.state) {
                NextStep::AwaitStart => {
                    self.apply(TurnEvent::Start { now_ms });
                }
                NextStep::AwaitApproval { approval_id } => {
                    // Answers to other (earlier) requests are stale.
                    while let Some(answer) = self.answers.pop_front() {
                        if answer.approval_id == approval_id {
                            self.apply(TurnEvent::ApprovalAnswered(answer));
                            break;
                        }
                    }
                    if self.state.status == TurnStatus::AwaitingToolApproval {
                        return TurnAction::AwaitInput;
                    }
                }
                NextStep::CreateSandbox => return TurnAction::CreateSandbox,
                NextStep::RunSlice { budget_ms } => return TurnAction::RunSlice { budget_ms },
                NextStep::KillAgent { process } => return TurnAction::KillAgent { process },
                NextStep::RecordEnd => return TurnAction::RecordEnd,
                NextStep::Done { .. } => return TurnAction::Done,
            }
        }
    }

    /// Report [`TurnAction::CreateSandbox`].
    pub fn sandbox_created(&mut self, result: Result<SandboxHandle, StepFailure>) {
        match result {
            Ok(handle) => self.apply(TurnEvent::SandboxCreated { handle }),
            Err(failure) => self.failed("creating the sandbox", failure),
        }
    }

    /// Report [`TurnAction::RunSlice`].
    pub fn slice_done(&mut self, result: Result<SliceReport, StepFailure>, now_ms: u64) {
        match result {
            Ok(report) => {
                let event = TurnEvent::SliceCompleted { report, now_ms };
                match step(self.state.clone(), event) {
                    Ok((state, _)) => self.state = state,
                    // A report the machine refuses (a stale cursor from a
                    // duplicated slice) counts as a failed slice.
                    Err(e) => self.failed("the slice", StepFailure::Retryable(e.to_string())),
                }
            }
            Err(failure) => self.failed("the slice", failure),
        }
    }

    /// Report [`TurnAction::KillAgent`].
    pub fn agent_killed(&mut self, result: Result<(), StepFailure>) {
        match result {
            Ok(()) => self.apply(TurnEvent::AgentKilled),
            Err(StepFailure::Fenced(message)) => self.fenced = Some(message),
            Err(failure) => {
                self.kill_attempts += 1;
                if self.kill_attempts >= MAX_KILL_ATTEMPTS || !failure.is_retryable() {
                    // Give up on the process (the sandbox may be gone); the
                    // turn is already terminal, keep why.
                    self.apply(TurnEvent::AgentKilled);
                    self.note(format!("killing the agent failed: {}", failure.message()));
                }
            }
        }
    }

    /// Report [`TurnAction::RecordEnd`].
    pub fn end_recorded(&mut self, result: Result<(), StepFailure>) {
        match result {
            Ok(()) => self.apply(TurnEvent::EndRecorded),
            Err(StepFailure::Fenced(message)) => self.fenced = Some(message),
            Err(failure) => {
                self.record_attempts += 1;
                if self.record_attempts >= MAX_RECORD_ATTEMPTS || !failure.is_retryable() {
                    self.note(format!(
                        "recording the end of the turn failed: {}",
                        failure.message()
                    ));
                    self.apply(TurnEvent::EndRecorded);
                }
            }
        }
    }

    fn failed(&mut self, what: &str, failure: StepFailure) {
        match failure {
            StepFailure::Fenced(message) => self.fenced = Some(message),
            failure => {
                let retryable = failure.is_retryable();
                let error = format!("{what} failed: {}", failure.message());
                self.apply(TurnEvent::SliceFailed { error, retryable });
            }
        }
    }

    /// Append to the error of a terminal turn.
    fn note(&mut self, text: String) {
        self.state.error = Some(match self.state.error.take() {
            Some(prev) if !prev.is_empty() => format!("{prev} (and {text})"),
            _ => text,
        });
    }

    /// Apply an event `next_step` asked for. The machine only refuses
    /// events the state does not expect, which the loop never feeds; should
    /// it happen anyway the turn fails rather than loop.
    fn apply(&mut self, event: TurnEvent) {
        match step(self.state.clone(), event) {
            Ok((state, _)) => self.state = state,
            Err(e) if !self.state.status.is_terminal() => {
                let error = format!("internal: {e}");
                if let Ok((state, _)) = step(
                    self.state.clone(),
                    TurnEvent::SliceFailed {
                        error,
                        retryable: false,
                    },
                ) {
                    self.state = state;
                }
            }
            Err(_) => {
                // Terminal and refusing: make sure the loop ends.
                self.state.kill_pending = false;
                self.state.end_recorded = true;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::turn::{ApprovalAnswer, TurnState, TurnStatus};

    fn driver_of(state: TurnState) -> TurnDriver {
        TurnDriver::new(state).expect("a current state")
    }

    fn fresh() -> TurnState {
        TurnState::new("s1", "t1", "claude-code", "hi")
    }

    fn ended() -> TurnState {
        TurnState {
            status: TurnStatus::Finished,
            ..fresh()
        }
    }

    fn yes(id: &str) -> ApprovalAnswer {
        ApprovalAnswer {
            approval_id: id.into(),
            approved: true,
            reason: None,
        }
    }

    /// The answers waiting to be applied, as the driver persists them.
    fn waiting(driver: &TurnDriver) -> Vec<String> {
        let json = serde_json::to_value(driver).unwrap();
        json["answers"]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|x| x["approval_id"].as_str().unwrap().to_string())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// One classification for every engine: bad input, unsafe and
    /// unauthorized requests never pass on retry; fenced is its own kind
    /// (another runner goes on); the rest may pass. The message is kept.
    #[test]
    fn step_failures_are_classified_once() {
        for kind in [
            ErrorKind::InvalidInput,
            ErrorKind::Unsafe,
            ErrorKind::Unauthorized,
        ] {
            let failure = StepFailure::from_error(&Error::new(kind, "no good"));
            assert!(
                matches!(failure, StepFailure::Fatal(_)),
                "{kind:?}: {failure:?}"
            );
            assert!(!failure.is_retryable());
            assert!(failure.message().contains("no good"), "{failure:?}");
        }
        let fenced = StepFailure::from_error(&Error::new(ErrorKind::Fenced, "a newer runner"));
        assert!(matches!(fenced, StepFailure::Fenced(_)), "{fenced:?}");
        assert!(fenced.is_retryable());
        assert!(fenced.message().contains("a newer runner"));
        for kind in [
            ErrorKind::Backend,
            ErrorKind::NotFound,
            ErrorKind::TimedOut,
            ErrorKind::Conflict,
            ErrorKind::Io,
        ] {
            let failure = StepFailure::from(&Error::new(kind, "hiccup"));
            assert!(
                matches!(failure, StepFailure::Retryable(_)),
                "{kind:?}: {failure:?}"
            );
            assert!(failure.is_retryable());
            assert!(failure.message().contains("hiccup"));
        }
    }

    /// A fenced report stops the driver for good and says why.
    #[test]
    fn a_fenced_runner_stops_and_says_why() {
        let mut driver = driver_of(fresh());
        assert_eq!(driver.fenced(), None);
        assert_ne!(driver.poll(1), TurnAction::Stop);
        driver.sandbox_created(Err(StepFailure::Fenced("runner 7 took over".into())));
        assert_eq!(driver.fenced(), Some("runner 7 took over"));
        assert_eq!(driver.poll(2), TurnAction::Stop);
        let mut recording = driver_of(ended());
        recording.end_recorded(Err(StepFailure::Fenced("runner 8".into())));
        assert_eq!(recording.fenced(), Some("runner 8"));
        assert_eq!(recording.poll(3), TurnAction::Stop);
    }

    /// An abort is input until the next poll applies it; the first reason
    /// wins; an ended turn takes none.
    #[test]
    fn an_abort_is_taken_once_before_the_end() {
        let mut driver = driver_of(fresh());
        assert!(!driver.abort_requested() && !driver.has_input());
        driver.abort("the user asked");
        driver.abort("a second reason");
        assert!(driver.abort_requested() && driver.has_input());
        driver.poll(1);
        assert!(!driver.has_input(), "the abort was applied");
        assert!(driver.abort_requested(), "it stays asked for");
        let state = format!("{:?}", driver.state());
        assert!(
            state.contains("the user asked") && !state.contains("a second reason"),
            "{state}"
        );
        driver.abort("after it was applied");
        assert!(!driver.has_input(), "a second abort is not input again");

        let mut over = driver_of(ended());
        over.abort("too late");
        assert!(!over.abort_requested() && !over.has_input());
    }

    /// Answers wait until the turn asks for them: each request's answer
    /// once (a repeat, or one the state already applied, is dropped), and
    /// an ended turn takes none.
    #[test]
    fn answers_wait_once_each_until_the_end() {
        let mut driver = driver_of(fresh());
        driver.answer(yes("a1"));
        assert!(driver.has_input());
        driver.answer(yes("a1"));
        driver.answer(yes("a2"));
        assert_eq!(waiting(&driver), ["a1", "a2"]);

        let mut applied = fresh();
        applied.approval_answers.push(yes("a0"));
        let mut driver = driver_of(applied);
        driver.answer(yes("a0"));
        assert!(!driver.has_input(), "{:?}", waiting(&driver));

        let mut over = driver_of(ended());
        over.answer(yes("a9"));
        assert!(!over.has_input());
    }

    /// A failed turn whose agent still runs: the driver asks to kill it.
    fn killing() -> TurnState {
        TurnState {
            status: TurnStatus::Failed,
            kill_pending: true,
            process: Some(crate::sandbox::DetachedProcess {
                id: "42".into(),
                stdout_path: "out".into(),
                stderr_path: "err".into(),
                exit_path: "exit".into(),
            }),
            ..fresh()
        }
    }

    /// A kill that keeps failing is retried up to [`MAX_KILL_ATTEMPTS`],
    /// then given up with the reason noted; a fatal failure gives up at
    /// once; a success ends the kill.
    #[test]
    fn a_failing_kill_is_retried_then_given_up() {
        let mut driver = driver_of(killing());
        for attempt in 1..MAX_KILL_ATTEMPTS {
            assert!(
                matches!(driver.poll(1), TurnAction::KillAgent { .. }),
                "attempt {attempt}"
            );
            driver.agent_killed(Err(StepFailure::Retryable(format!("try {attempt}"))));
        }
        assert!(matches!(driver.poll(1), TurnAction::KillAgent { .. }));
        driver.agent_killed(Err(StepFailure::Retryable("the last try".into())));
        assert_eq!(driver.poll(1), TurnAction::RecordEnd, "given up");
        let error = driver.state().error.clone().unwrap_or_default();
        assert!(
            error.contains("killing the agent failed: the last try"),
            "{error}"
        );

        let mut fatal = driver_of(killing());
        fatal.agent_killed(Err(StepFailure::Fatal("no such sandbox".into())));
        assert_eq!(
            fatal.poll(1),
            TurnAction::RecordEnd,
            "a fatal failure gives up"
        );

        let mut killed = driver_of(killing());
        killed.agent_killed(Ok(()));
        assert_eq!(killed.poll(1), TurnAction::RecordEnd);
        assert!(killed.state().error.is_none(), "{:?}", killed.state().error);
    }

    /// Recording the end is retried up to [`MAX_RECORD_ATTEMPTS`], then the
    /// turn is done with the reason noted; a fatal failure gives up at once.
    #[test]
    fn a_failing_end_record_is_retried_then_given_up() {
        let mut driver = driver_of(ended());
        for attempt in 1..MAX_RECORD_ATTEMPTS {
            assert_eq!(driver.poll(1), TurnAction::RecordEnd, "attempt {attempt}");
            driver.end_recorded(Err(StepFailure::Retryable("log away".into())));
        }
        assert_eq!(driver.poll(1), TurnAction::RecordEnd);
        driver.end_recorded(Err(StepFailure::Retryable("still away".into())));
        assert_eq!(driver.poll(1), TurnAction::Done);
        let error = driver.state().error.clone().unwrap_or_default();
        assert!(
            error.contains("recording the end of the turn failed: still away"),
            "{error}"
        );

        let mut fatal = driver_of(ended());
        fatal.end_recorded(Err(StepFailure::Fatal("refused".into())));
        assert_eq!(fatal.poll(1), TurnAction::Done);
    }

    /// A reason noted on a given-up step joins the turn's error; an event
    /// the machine refuses fails a running turn (never loops) and leaves an
    /// ended one as it was.
    #[test]
    fn given_up_steps_add_to_the_error_and_refusals_fail_the_turn() {
        let mut driver = driver_of(TurnState {
            error: Some("the agent hung".into()),
            ..killing()
        });
        driver.agent_killed(Err(StepFailure::Fatal("gone".into())));
        assert_eq!(
            driver.state().error.as_deref(),
            Some("the agent hung (and killing the agent failed: gone)")
        );
        let mut blank = driver_of(TurnState {
            error: Some(String::new()),
            ..killing()
        });
        blank.agent_killed(Err(StepFailure::Fatal("gone".into())));
        assert_eq!(
            blank.state().error.as_deref(),
            Some("killing the agent failed: gone")
        );

        // The end of a running turn: the machine refuses the report.
        let mut running = driver_of(TurnState {
            status: TurnStatus::ReadyForNextStep,
            ..fresh()
        });
        running.end_recorded(Ok(()));
        assert_eq!(running.state().status, TurnStatus::Failed);
        let error = running.state().error.clone().unwrap_or_default();
        assert!(error.contains("internal:"), "{error}");
        let mut over = driver_of(ended());
        over.agent_killed(Ok(()));
        assert_eq!(over.state(), &ended());
    }
}
