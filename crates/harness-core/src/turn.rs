//! Durable turn state and `run_harness_session`, the pure orchestration
//! function every engine drives.
//!
//! An engine keeps a [`TurnState`] (as JSON), feeds it [`TurnEvent`]s, and
//! does what the returned [`NextStep`] says: run a slice, kill the agent,
//! wait for an approval, or stop. The function does no I/O, so the same
//! transitions run in-process, in a Temporal workflow and in a Cloudflare
//! Workflow, and are tested here once.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::sandbox::{DetachedProcess, SandboxHandle};
use crate::session::SandboxConfig;
use crate::{Error, Result};

/// Where a turn is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TurnStatus {
    /// Created, nothing run yet.
    NotStarted,
    /// The agent runs (or is about to); run the next slice.
    ReadyForNextStep,
    /// The agent waits for a client's answer to a permission request.
    AwaitingToolApproval,
    /// The turn ran past its time budget and was stopped.
    TimedOut,
    /// The turn failed (agent error, lost process, abort, exhausted retries).
    Failed,
    /// The agent finished the turn.
    Finished,
}

impl TurnStatus {
    /// True for `timed_out`, `failed` and `finished`.
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            TurnStatus::TimedOut | TurnStatus::Failed | TurnStatus::Finished
        )
    }

    /// The snake_case name.
    pub fn as_str(self) -> &'static str {
        match self {
            TurnStatus::NotStarted => "not_started",
            TurnStatus::ReadyForNextStep => "ready_for_next_step",
            TurnStatus::AwaitingToolApproval => "awaiting_tool_approval",
            TurnStatus::TimedOut => "timed_out",
            TurnStatus::Failed => "failed",
            TurnStatus::Finished => "finished",
        }
    }
}

/// Budgets for one turn.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TurnConfig {
    /// Longest a single slice may run, in milliseconds (default 750 s).
    pub slice_ms: u64,
    /// Longest the whole turn may run, in milliseconds (default 2 h).
    pub max_turn_ms: u64,
    /// Failed slices in a row before the turn fails (default 3).
    pub max_consecutive_failures: u32,
    /// Longest the agent may go without progress — a part other than a
    /// warning — before the turn ends `timed_out`, in milliseconds; 0
    /// turns the check off. Time spent waiting for a client's approval
    /// does not count. The default, 15 minutes, is above the longest
    /// silent stretch a healthy agent has: a tool call reports nothing
    /// until it returns, and Claude Code's Bash tool stops a command after
    /// 10 minutes at most.
    #[serde(default = "default_quiet_ms")]
    pub quiet_ms: u64,
    /// The session's model budget: crossing it ends the turn `failed` with
    /// the code [`BUDGET_EXCEEDED`], and the broker opens nothing more.
    #[serde(default, skip_serializing_if = "Budget::is_unlimited")]
    pub budget: Budget,
}

/// The error code of a turn that ended because its session's model budget
/// was spent.
pub const BUDGET_EXCEEDED: &str = "budget_exceeded";

/// Per-session limits on what the model broker passes through, counted
/// over the whole session (every turn), as the broker counts it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Budget {
    /// Model tokens, input and output together.
    #[serde(default, alias = "max_tokens", skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u64>,
    /// Brokered spend in millionths of a US dollar, priced by the broker's
    /// price table (`docs/broker.md`, *Budgets*).
    #[serde(
        default,
        alias = "max_spend_micros",
        skip_serializing_if = "Option::is_none"
    )]
    pub max_spend_micros: Option<u64>,
}

impl Budget {
    /// No limit at all.
    pub fn is_unlimited(&self) -> bool {
        self.max_tokens.is_none() && self.max_spend_micros.is_none()
    }

    /// The first limit `used` crosses, said as a person would: which, the
    /// limit, what was used and by how much it is over.
    pub fn exceeded_by(&self, used: &ModelUsage) -> Option<String> {
        let tokens = used.input_tokens + used.output_tokens;
        if let Some(max) = self.max_tokens.filter(|max| tokens >= *max) {
            return Some(format!(
                "the session's token budget is spent: {tokens} tokens used of {max} ({} over)",
                tokens - max
            ));
        }
        if let (Some(max), Some(spent)) = (self.max_spend_micros, used.spend_micros) {
            if spent >= max {
                return Some(format!(
                    "the session's spend budget is spent: ${:.6} used of ${:.6} (${:.6} over)",
                    spent as f64 / 1e6,
                    max as f64 / 1e6,
                    (spent - max) as f64 / 1e6
                ));
            }
        }
        None
    }
}

/// What a session used of the model so far, as the broker counted it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ModelUsage {
    pub input_tokens: u64,
    pub output_tokens: u64,
    /// Priced by the broker's table; `None` when a model it served has no
    /// price there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spend_micros: Option<u64>,
}

/// [`TurnConfig::quiet_ms`] by default: 15 minutes.
pub const DEFAULT_QUIET_MS: u64 = 15 * 60 * 1000;

fn default_quiet_ms() -> u64 {
    DEFAULT_QUIET_MS
}

impl Default for TurnConfig {
    fn default() -> Self {
        Self {
            slice_ms: 750_000,
            max_turn_ms: 2 * 60 * 60 * 1000,
            max_consecutive_failures: 3,
            quiet_ms: DEFAULT_QUIET_MS,
            budget: Budget::default(),
        }
    }
}

/// A pending permission request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PendingApproval {
    /// The request id answers must quote.
    pub approval_id: String,
    /// The tool that wants to run.
    pub tool_name: String,
    /// Its input.
    pub input: Value,
}

/// A client's answer, kept so the slice can hand it to the agent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApprovalAnswer {
    /// The request answered.
    pub approval_id: String,
    /// Allow or deny.
    pub approved: bool,
    /// Optional reason.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// The durable state of one turn. Serialized as JSON between slices.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TurnState {
    /// Format version of this struct.
    pub version: u32,
    /// The session.
    pub session_id: String,
    /// The turn (unique within the session).
    pub turn_id: String,
    /// Agent adapter name (`claude-code`, `codex`).
    pub agent: String,
    /// The prompt.
    pub prompt: String,
    /// Where the turn is.
    pub status: TurnStatus,
    /// Budgets.
    #[serde(default)]
    pub config: TurnConfig,
    /// The sandbox the agent runs in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox: Option<SandboxHandle>,
    /// How to make the sandbox when `sandbox` is not set yet (the session's
    /// first turn): the engine's first step creates it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox_config: Option<SandboxConfig>,
    /// Model name for the agent (the runner's default when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Ask a client before tools that need permission (the adapter must
    /// support it; see [`crate::session::SessionConfig::approvals`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub approvals: bool,
    /// The agent's own session/thread id, carried across turns.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_session_id: Option<String>,
    /// The session's checkpoint when the turn started (the tree and agent
    /// state its sandbox holds, or is made from when it has none or it is
    /// gone); once the turn ended and was checkpointed, that new one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<String>,
    /// The running agent process, once started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub process: Option<DetachedProcess>,
    /// Bytes of the agent's stdout spool already parsed and appended.
    #[serde(default)]
    pub cursor: u64,
    /// Slices completed.
    #[serde(default)]
    pub slices_run: u32,
    /// Slices failed in a row.
    #[serde(default)]
    pub consecutive_failures: u32,
    /// When the turn started (ms since epoch).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at_ms: Option<u64>,
    /// When the agent last made progress (see [`TurnConfig::quiet_ms`]);
    /// unset until a slice reports it, and again after an approval (the
    /// wait for a client is not the agent's silence).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_progress_at_ms: Option<u64>,
    /// The last warning the agent reported (e.g. that it retries the
    /// model), kept to say why a quiet turn timed out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_warning: Option<String>,
    /// The permission request the turn waits on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending_approval: Option<PendingApproval>,
    /// Answers given so far in this turn.
    #[serde(default)]
    pub approval_answers: Vec<ApprovalAnswer>,
    /// The agent process must still be killed (after abort or timeout).
    #[serde(default)]
    pub kill_pending: bool,
    /// Why the turn failed or timed out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// A stable name for why, where there is one ([`BUDGET_EXCEEDED`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_code: Option<String>,
    /// The agent's exit code, once it exited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    /// The terminal status was recorded in the session log (a terminal turn
    /// is only `Done` after that, so a crash in between records it on
    /// resume — and the log's idempotency key keeps it to one frame).
    #[serde(default)]
    pub end_recorded: bool,
}

/// The current format version.
pub const TURN_STATE_VERSION: u32 = 1;

impl TurnState {
    /// A fresh turn.
    pub fn new(
        session_id: impl Into<String>,
        turn_id: impl Into<String>,
        agent: impl Into<String>,
        prompt: impl Into<String>,
    ) -> Self {
        Self {
            version: TURN_STATE_VERSION,
            session_id: session_id.into(),
            turn_id: turn_id.into(),
            agent: agent.into(),
            prompt: prompt.into(),
            status: TurnStatus::NotStarted,
            config: TurnConfig::default(),
            sandbox: None,
            sandbox_config: None,
            model: None,
            approvals: false,
            agent_session_id: None,
            checkpoint: None,
            process: None,
            cursor: 0,
            slices_run: 0,
            consecutive_failures: 0,
            started_at_ms: None,
            last_progress_at_ms: None,
            last_warning: None,
            pending_approval: None,
            approval_answers: Vec::new(),
            kill_pending: false,
            error: None,
            error_code: None,
            exit_code: None,
            end_recorded: false,
        }
    }

    /// The next turn of the same session: same sandbox, same agent session
    /// (so the conversation continues), fresh everything else.
    pub fn next_turn(&self, turn_id: impl Into<String>, prompt: impl Into<String>) -> Self {
        let mut next = Self::new(self.session_id.clone(), turn_id, self.agent.clone(), prompt);
        next.config = self.config.clone();
        next.sandbox = self.sandbox.clone();
        next.sandbox_config = self.sandbox_config.clone();
        next.model = self.model.clone();
        next.approvals = self.approvals;
        next.agent_session_id = self.agent_session_id.clone();
        next
    }

    /// The idempotency key of the frame recording this turn's current
    /// status (`<turn>:status:<status>`): one frame per turn and status,
    /// whoever records it and however often.
    pub fn status_key(&self) -> String {
        format!("{}:status:{}", self.turn_id, self.status.as_str())
    }
}

/// What a slice observed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum SliceOutcome {
    /// The agent still runs; the slice used its budget.
    Running,
    /// The agent exited with this code and its output was fully consumed.
    Exited {
        /// Exit code.
        code: i32,
    },
    /// The agent asks for permission.
    ApprovalRequested(PendingApproval),
    /// The agent process is gone without an exit code.
    Lost,
}

/// A slice's report back to the orchestration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SliceReport {
    /// The agent process (set by the slice that started it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub process: Option<DetachedProcess>,
    /// The agent's session id, once seen in its output.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_session_id: Option<String>,
    /// New spool cursor (never behind the state's).
    pub cursor: u64,
    /// What happened.
    pub outcome: SliceOutcome,
    /// When the agent last made progress, as far as this slice saw.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_progress_at_ms: Option<u64>,
    /// The last warning this slice saw.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_warning: Option<String>,
    /// The sandbox this slice made in place of the session's, which was
    /// gone, from the session's checkpoint (see `docs/session-runtime.md`,
    /// "Outliving the sandbox").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox: Option<SandboxHandle>,
    /// The session's model usage when the slice ended (with a broker).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<ModelUsage>,
    /// The last lines the agent wrote to stderr, read when it exited with a
    /// non-zero code: the turn's error quotes them, so "exited with code 1"
    /// says why (a missing conversation, a refused key, a bad flag).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stderr_tail: Option<String>,
}

/// Something that happened to a turn.
// A slice's report is the large variant; events are made one at a time and
// consumed at once, so boxing it would only add an allocation.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum TurnEvent {
    /// Begin the turn.
    Start {
        /// Current time.
        now_ms: u64,
    },
    /// A slice finished.
    SliceCompleted {
        /// What it saw.
        report: SliceReport,
        /// Current time.
        now_ms: u64,
    },
    /// A slice failed (worker crash, sandbox unreachable, …).
    SliceFailed {
        /// What went wrong.
        error: String,
        /// Whether running another slice may help.
        retryable: bool,
    },
    /// A client answered the pending permission request.
    ApprovalAnswered(ApprovalAnswer),
    /// A client aborted the turn.
    Abort {
        /// Why.
        reason: String,
    },
    /// The engine killed the agent process as asked.
    AgentKilled,
    /// The engine created the turn's sandbox as asked.
    SandboxCreated {
        /// Its handle.
        handle: SandboxHandle,
    },
    /// The engine recorded the terminal status in the session log.
    EndRecorded,
}

/// What the engine must do next.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "step", rename_all = "snake_case")]
pub enum NextStep {
    /// Create the session's sandbox from `sandbox_config`, then report
    /// [`TurnEvent::SandboxCreated`].
    CreateSandbox,
    /// Run one slice of at most `budget_ms`.
    RunSlice {
        /// Slice budget in milliseconds.
        budget_ms: u64,
    },
    /// Kill the agent process, then report [`TurnEvent::AgentKilled`].
    KillAgent {
        /// The process to kill.
        process: DetachedProcess,
    },
    /// Wait for [`TurnEvent::ApprovalAnswered`] (or an abort).
    AwaitApproval {
        /// The request.
        approval_id: String,
    },
    /// Nothing more to do until [`TurnEvent::Start`].
    AwaitStart,
    /// Record the terminal status in the session log, then report
    /// [`TurnEvent::EndRecorded`].
    RecordEnd,
    /// The turn is over.
    Done {
        /// Its final status.
        status: TurnStatus,
    },
}

/// What the state asks for now (engines call this after a restart).
pub fn next_step(state: &TurnState) -> NextStep {
    if state.kill_pending {
        if let Some(process) = &state.process {
            return NextStep::KillAgent {
                process: process.clone(),
            };
        }
    }
    match state.status {
        TurnStatus::NotStarted => NextStep::AwaitStart,
        TurnStatus::ReadyForNextStep if state.sandbox.is_none() => NextStep::CreateSandbox,
        TurnStatus::ReadyForNextStep => NextStep::RunSlice {
            budget_ms: state.config.slice_ms,
        },
        TurnStatus::AwaitingToolApproval => NextStep::AwaitApproval {
            approval_id: state
                .pending_approval
                .as_ref()
                .map(|p| p.approval_id.clone())
                .unwrap_or_default(),
        },
        _ if !state.end_recorded => NextStep::RecordEnd,
        status => NextStep::Done { status },
    }
}

fn fail(state: &mut TurnState, status: TurnStatus, error: String) {
    state.status = status;
    state.error = Some(error);
    state.pending_approval = None;
    state.kill_pending = state.process.is_some();
}

/// Apply `event` to `state`; returns the new state and what to do next.
/// Errors leave the caller's state as it was (the input is consumed by value,
/// so on error simply keep using your copy).
pub fn step(mut state: TurnState, event: TurnEvent) -> Result<(TurnState, NextStep)> {
    if state.version != TURN_STATE_VERSION {
        return Err(Error::invalid(format!(
            "turn state version {} is not supported (expected {TURN_STATE_VERSION})",
            state.version
        )));
    }
    let terminal = state.status.is_terminal();
    match event {
        TurnEvent::AgentKilled => {
            state.kill_pending = false;
        }
        TurnEvent::EndRecorded => {
            if !terminal {
                return Err(Error::conflict(format!(
                    "turn {} is {}: only a finished turn's end is recorded",
                    state.turn_id,
                    state.status.as_str()
                )));
            }
            state.end_recorded = true;
        }
        _ if terminal => {
            return Err(Error::conflict(format!(
                "turn {} is already {}; start a new turn",
                state.turn_id,
                state.status.as_str()
            )));
        }
        TurnEvent::Start { now_ms } => {
            if state.status != TurnStatus::NotStarted {
                return Err(Error::conflict(format!(
                    "turn {} has already started",
                    state.turn_id
                )));
            }
            state.started_at_ms = Some(now_ms);
            if state.sandbox.is_none() && state.sandbox_config.is_none() {
                let error = "the turn has neither a sandbox handle nor a sandbox config".into();
                fail(&mut state, TurnStatus::Failed, error);
            } else {
                state.status = TurnStatus::ReadyForNextStep;
            }
        }
        TurnEvent::SandboxCreated { handle } => {
            if state.status != TurnStatus::ReadyForNextStep || state.sandbox.is_some() {
                return Err(Error::conflict(format!(
                    "turn {} did not ask for a sandbox",
                    state.turn_id
                )));
            }
            state.sandbox = Some(handle);
            state.consecutive_failures = 0;
        }
        TurnEvent::SliceCompleted { report, now_ms } => {
            slice_completed(&mut state, report, now_ms)?;
        }
        TurnEvent::SliceFailed { error, retryable } => {
            state.consecutive_failures += 1;
            if !retryable || state.consecutive_failures >= state.config.max_consecutive_failures {
                let n = state.consecutive_failures;
                fail(
                    &mut state,
                    TurnStatus::Failed,
                    format!("slice failed ({n} in a row): {error}"),
                );
            }
        }
        TurnEvent::ApprovalAnswered(answer) => approval_answered(&mut state, answer)?,
        TurnEvent::Abort { reason } => {
            fail(&mut state, TurnStatus::Failed, format!("aborted: {reason}"));
        }
    }
    let next = next_step(&state);
    Ok((state, next))
}

/// A slice's report: the cursor moves on (never back: a stale report is
/// a conflict), what it learnt is kept, and its outcome decides the
/// status.
fn slice_completed(state: &mut TurnState, report: SliceReport, now_ms: u64) -> Result<()> {
    if state.status != TurnStatus::ReadyForNextStep {
        return Err(Error::conflict(format!(
            "a slice reported while turn {} is {}",
            state.turn_id,
            state.status.as_str()
        )));
    }
    if report.cursor < state.cursor {
        // A retried or duplicated slice from before the last accepted
        // one: applying it would rewind the spool cursor.
        return Err(Error::conflict(format!(
            "stale slice report: cursor {} is behind {}",
            report.cursor, state.cursor
        )));
    }
    state.cursor = report.cursor;
    state.slices_run += 1;
    state.consecutive_failures = 0;
    if report.sandbox.is_some() {
        state.sandbox = report.sandbox;
    }
    if report.process.is_some() {
        state.process = report.process;
    }
    if report.agent_session_id.is_some() {
        state.agent_session_id = report.agent_session_id;
    }
    if report.last_progress_at_ms.is_some() {
        state.last_progress_at_ms = report.last_progress_at_ms;
    }
    if report.last_warning.is_some() {
        state.last_warning = report.last_warning;
    }
    // A spent budget ends the turn whatever the agent did meanwhile (it
    // usually exits on the broker's refusal): the reason is the budget.
    if let Some(why) = report
        .usage
        .as_ref()
        .and_then(|used| state.config.budget.exceeded_by(used))
    {
        if let SliceOutcome::Exited { code } = report.outcome {
            state.exit_code = Some(code);
        }
        fail(state, TurnStatus::Failed, why);
        state.error_code = Some(BUDGET_EXCEEDED.to_string());
        return Ok(());
    }
    match report.outcome {
        SliceOutcome::Running => check_time_limits(state, now_ms),
        SliceOutcome::Exited { code } => {
            state.exit_code = Some(code);
            if code == 0 {
                state.status = TurnStatus::Finished;
            } else {
                state.status = TurnStatus::Failed;
                state.error = Some(match &report.stderr_tail {
                    Some(tail) => format!("agent exited with code {code}: {tail}"),
                    None => format!("agent exited with code {code}"),
                });
            }
        }
        SliceOutcome::ApprovalRequested(request) => {
            state.status = TurnStatus::AwaitingToolApproval;
            state.pending_approval = Some(request);
        }
        SliceOutcome::Lost => {
            state.process = None;
            fail(
                state,
                TurnStatus::Failed,
                "agent process was lost (sandbox restarted?)".into(),
            );
        }
    }
    Ok(())
}

/// A turn still running after a slice ends `timed_out` past its budget
/// (`max_turn_ms`) or after `quiet_ms` without progress (the last warning
/// quoted: why it was quiet).
fn check_time_limits(state: &mut TurnState, now_ms: u64) {
    let started = state.started_at_ms.unwrap_or(now_ms);
    let quiet = state.config.quiet_ms;
    let silent_since = state.last_progress_at_ms.unwrap_or(started);
    if now_ms.saturating_sub(started) >= state.config.max_turn_ms {
        let limit = state.config.max_turn_ms;
        fail(
            state,
            TurnStatus::TimedOut,
            format!("turn exceeded its {limit} ms budget"),
        );
    } else if quiet > 0 && now_ms.saturating_sub(silent_since) >= quiet {
        let mut error = format!(
            "no output from the agent for {} s (the quiet limit)",
            now_ms.saturating_sub(silent_since) / 1000
        );
        if let Some(warning) = &state.last_warning {
            error.push_str(&format!("; its last warning: {warning}"));
        }
        fail(state, TurnStatus::TimedOut, error);
    }
}

/// A client's answer to the pending permission request: only that request
/// takes it, and the turn runs on.
fn approval_answered(state: &mut TurnState, answer: ApprovalAnswer) -> Result<()> {
    let pending = state
        .pending_approval
        .as_ref()
        .map(|p| p.approval_id.as_str());
    if state.status != TurnStatus::AwaitingToolApproval
        || pending != Some(answer.approval_id.as_str())
    {
        return Err(Error::invalid(format!(
            "no pending approval {:?} in turn {}",
            answer.approval_id, state.turn_id
        )));
    }
    state.pending_approval = None;
    state.approval_answers.push(answer);
    state.status = TurnStatus::ReadyForNextStep;
    // The quiet timer starts over with the next slice.
    state.last_progress_at_ms = None;
    Ok(())
}

/// The JSON face of [`step`]: `{"state": …, "event": …}` in,
/// `{"state": …, "next": …}` out. This is what durable engines store and
/// pass around; it is the only entry point a foreign runtime needs.
pub fn run_harness_session(input: Value) -> Result<Value> {
    #[derive(Deserialize)]
    struct Input {
        state: TurnState,
        #[serde(default)]
        event: Option<TurnEvent>,
    }
    let input: Input = serde_json::from_value(input)?;
    let (state, next) = match input.event {
        Some(event) => step(input.state, event)?,
        None => {
            let next = next_step(&input.state);
            (input.state, next)
        }
    };
    Ok(serde_json::json!({ "state": state, "next": next }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_budget_is_unlimited_only_without_either_limit() {
        assert!(Budget::default().is_unlimited());
        let tokens = Budget {
            max_tokens: Some(10),
            ..Budget::default()
        };
        let spend = Budget {
            max_spend_micros: Some(10),
            ..Budget::default()
        };
        assert!(!tokens.is_unlimited());
        assert!(!spend.is_unlimited());
        // The stored config leaves an unlimited budget out, and keeps a
        // limited one.
        let config = serde_json::to_value(TurnConfig::default()).unwrap();
        assert!(config.get("budget").is_none(), "{config}");
        let limited = TurnConfig {
            budget: spend,
            ..TurnConfig::default()
        };
        let config = serde_json::to_value(&limited).unwrap();
        assert_eq!(config["budget"]["maxSpendMicros"], 10, "{config}");
    }

    #[test]
    fn the_quiet_limit_is_fifteen_minutes_by_default_also_when_a_stored_config_lacks_it() {
        // The field's doc says 15 minutes: above Claude
        // Code's 10-minute Bash limit.
        assert_eq!(DEFAULT_QUIET_MS, 900_000);
        assert_eq!(TurnConfig::default().quiet_ms, 900_000);
        let stored = serde_json::json!({
            "slice_ms": 1000, "max_turn_ms": 2000, "max_consecutive_failures": 1
        });
        let config: TurnConfig = serde_json::from_value(stored).unwrap();
        assert_eq!(config.quiet_ms, 900_000);
    }
}
