//! The session runtime's vocabulary: what a session is configured to run
//! ([`SessionConfig`]), what its log says about it right now
//! ([`SessionMeta`], folded from frames by every log backend in the same
//! transaction as the append), the engine calls a stored client message asks
//! for ([`TurnCommand`]), and [`SessionRuntime`], which performs them on a
//! [`DurableEngine`].
//!
//! The path of a prompt: the session actor stores a `user-message` frame,
//! folds it into its [`SessionMeta`] and emits `Output::Dispatch(Start)`;
//! the host (the tokio runtime of `harness serve`, a Durable Object)
//! hands the command to a [`SessionRuntime`] (or forwards it to a remote
//! runner), which starts the turn on its engine. Approvals and aborts take
//! the same path. Every command is idempotent, and [`SessionMeta::pending_commands`]
//! says what must be (re)done for the active turn, so a runtime that
//! restarts, or a runner that attaches later, catches up from the log.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::engine::DurableEngine;
use crate::frame::{FrameBody, SessionId};
use crate::part::StreamPart;
use crate::sandbox::{NetworkPolicy, SandboxHandle};
use crate::turn::{ApprovalAnswer, TurnConfig, TurnState, TurnStatus};
use crate::{Error, ErrorKind, Result};
use tracing::Instrument;

/// The agent adapter every session runs unless told otherwise.
pub const DEFAULT_AGENT: &str = "claude-code";
/// The sandbox provider every session uses unless told otherwise.
pub const DEFAULT_SANDBOX: &str = "local";

/// How a session's sandbox is made, on its first turn.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SandboxConfig {
    /// Provider name (`local`, `docker`, …).
    pub provider: String,
    /// Image, for providers that have images.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// Network policy.
    #[serde(default)]
    pub network: NetworkPolicy,
    /// Turn-end checkpoints of the sandbox's tree and agent state.
    #[serde(default, skip_serializing_if = "CheckpointRules::is_default")]
    pub checkpoints: CheckpointRules,
}

impl Default for SandboxConfig {
    fn default() -> Self {
        Self {
            provider: DEFAULT_SANDBOX.into(),
            image: None,
            network: NetworkPolicy::AllowAll,
            checkpoints: CheckpointRules::default(),
        }
    }
}

/// A session's turn-end checkpoints (`docs/session-runtime.md`, "Turn-end
/// checkpoints").
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointRules {
    /// Checkpoint the tree and the agent's state at every turn end, where
    /// the runtime has a checkpoint store. On by default.
    #[serde(default = "enabled_by_default")]
    pub enabled: bool,
    /// Paths of the tree left out of checkpoints (so of forks, rewinds and
    /// rehydrated sandboxes): `.gitignore`-style patterns, e.g.
    /// `node_modules/.cache` ([`PathRules`](crate::turn_checkpoint::PathRules)).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub exclude: Vec<String>,
    /// Also leave out what the tree's top-level `.gitignore` names.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub gitignore: bool,
}

fn enabled_by_default() -> bool {
    true
}

impl Default for CheckpointRules {
    fn default() -> Self {
        Self {
            enabled: true,
            exclude: Vec::new(),
            gitignore: false,
        }
    }
}

impl CheckpointRules {
    fn is_default(&self) -> bool {
        *self == Self::default()
    }
}

/// What a session runs, given when it is created.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SessionConfig {
    /// Agent adapter name (`claude-code`, `codex`).
    #[serde(default = "default_agent")]
    pub agent: String,
    /// Where its sandbox comes from.
    #[serde(default)]
    pub sandbox: SandboxConfig,
    /// Model name passed to the agent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Ask a client before the agent runs a tool that needs permission
    /// (`tool-approval-request`, answered with `approval-response`). Off by
    /// default: the sandbox is the boundary. Claude Code only (see
    /// `docs/agents.md` for Codex).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub approvals: bool,
    /// The session's own budget (tokens, brokered spend over all its
    /// turns); when set, it replaces the server's for this session.
    #[serde(default, skip_serializing_if = "crate::turn::Budget::is_unlimited")]
    pub budget: crate::turn::Budget,
}

fn default_agent() -> String {
    DEFAULT_AGENT.into()
}

impl Default for SessionConfig {
    fn default() -> Self {
        Self {
            agent: default_agent(),
            sandbox: SandboxConfig::default(),
            model: None,
            approvals: false,
            budget: crate::turn::Budget::default(),
        }
    }
}

impl SessionConfig {
    /// A config running `agent` in a `provider` sandbox.
    pub fn new(agent: impl Into<String>, provider: impl Into<String>) -> Self {
        Self {
            agent: agent.into(),
            sandbox: SandboxConfig {
                provider: provider.into(),
                ..SandboxConfig::default()
            },
            model: None,
            approvals: false,
            budget: crate::turn::Budget::default(),
        }
    }
}

/// The latest turn of a session, as its log tells it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TurnMeta {
    /// The turn.
    pub turn_id: String,
    /// Its prompt (kept so a runtime that restarts can start it again).
    pub prompt: String,
    /// The prompt's idempotency key, so a retried send is recognised.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// Last status recorded (`not_started` until the runner records one).
    pub status: TurnStatus,
    /// Error recorded with a failed or timed-out status.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The permission request the agent waits on, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval: Option<String>,
    /// Answers clients gave to this turn's requests, in order (an answer
    /// to a request that was not pending is not kept here).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub answers: Vec<ApprovalAnswer>,
    /// An abort a client asked for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub abort: Option<String>,
    /// Seq of the prompt that opened the turn (0 in metas stored before it
    /// was kept): where a recovering actor reads the turn's frames from.
    #[serde(default)]
    pub start_seq: u64,
}

impl TurnMeta {
    /// Whether the turn has not ended yet.
    pub fn is_active(&self) -> bool {
        !self.status.is_terminal()
    }
}

/// What a session's log says about the session now: its configuration,
/// runner generation, latest turn, sandbox and agent session. Every log
/// backend folds each appended frame into it with [`SessionMeta::apply`] in
/// the same transaction as the append, so recovering an actor reads this
/// instead of the whole log.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SessionMeta {
    /// What the session runs (absent for sessions created without one: the
    /// defaults apply).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config: Option<SessionConfig>,
    /// The highest runner generation attached so far.
    #[serde(default)]
    pub generation: u64,
    /// Prompts stored so far.
    #[serde(default)]
    pub turns: u64,
    /// The latest turn.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub turn: Option<TurnMeta>,
    /// The session's sandbox, once a turn recorded it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox: Option<SandboxHandle>,
    /// The agent's own session id, once seen.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_session_id: Option<String>,
    /// The checkpoint the session's tree and agent state are at: the last
    /// turn end's, or the one a fork or rewind goes back to. The next turn
    /// checkpoints against it, and makes its sandbox from it when there is
    /// none (or it is gone).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<String>,
    /// Every turn end that left a checkpoint, oldest first: what a rewind
    /// may go back to (about 100 bytes a turn).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub checkpoints: Vec<TurnCheckpoint>,
    /// What the session used so far, by its log.
    #[serde(default, skip_serializing_if = "SessionUsage::is_empty")]
    pub usage: SessionUsage,
}

/// What a session used so far, folded from its log like the rest of the
/// meta (so both servers answer it in a session's info): the model calls
/// the broker recorded (`audit` `model-call` parts, written at each turn's
/// end) and the tokens the agent reported itself (its `finish` parts, with
/// or without a broker).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SessionUsage {
    /// Brokered model requests, refused ones included.
    #[serde(default)]
    pub model_calls: u64,
    /// Prompt tokens of the brokered calls.
    #[serde(default)]
    pub input_tokens: u64,
    /// Completion tokens of the brokered calls.
    #[serde(default)]
    pub output_tokens: u64,
    /// Their cost by the broker's price table, in millionths of a dollar
    /// (unpriced calls count nothing).
    #[serde(default)]
    pub spend_micros: u64,
    /// Prompt tokens the agent reported at its turns' ends.
    #[serde(default)]
    pub reported_input_tokens: u64,
    /// Completion tokens the agent reported at its turns' ends.
    #[serde(default)]
    pub reported_output_tokens: u64,
}

impl SessionUsage {
    /// Nothing used yet.
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }
}

/// A turn end that left a checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TurnCheckpoint {
    /// The turn.
    pub turn_id: String,
    /// Seq of its terminal `turn-status` frame.
    pub seq: u64,
    /// The checkpoint's key.
    pub key: String,
    /// The agent session the checkpoint holds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_session_id: Option<String>,
}

impl SessionMeta {
    /// Meta of a new session.
    pub fn new(config: Option<SessionConfig>) -> Self {
        Self {
            config,
            ..Self::default()
        }
    }

    /// The configuration in force (the defaults when none was given).
    pub fn config_or_default(&self) -> SessionConfig {
        self.config.clone().unwrap_or_default()
    }

    /// The latest turn if it has not ended.
    pub fn active_turn(&self) -> Option<&TurnMeta> {
        self.turn.as_ref().filter(|t| t.is_active())
    }

    /// The id the next prompt's turn gets when the client names none.
    pub fn next_turn_id(&self) -> String {
        let id = format!("t{}", self.turns + 1);
        if self.turn.as_ref().is_some_and(|t| t.turn_id == id) {
            // A client named an earlier turn like this; stay unique.
            format!("{id}-{}", self.turns + 1)
        } else {
            id
        }
    }

    fn turn_mut(&mut self, turn_id: Option<&str>) -> Option<&mut TurnMeta> {
        self.turn
            .as_mut()
            .filter(|t| turn_id.is_none_or(|id| id == t.turn_id))
    }

    /// Whether [`apply`](Self::apply) could change anything for `body`: a
    /// backend skips loading its stored meta for the frames that never do
    /// (text messages, most parts), which are nearly all of them.
    pub fn touched_by(body: &FrameBody) -> bool {
        match body {
            FrameBody::Message { .. }
            | FrameBody::Sealed {}
            | FrameBody::HostCall { .. }
            | FrameBody::HostOutcome { .. } => false,
            FrameBody::Part { part, .. } => matches!(
                part,
                StreamPart::ToolApprovalRequest { .. }
                    | StreamPart::StreamStart {
                        agent_session_id: Some(_)
                    }
                    | StreamPart::Finish { .. }
                    | StreamPart::Audit {
                        record: crate::audit::AuditRecord::ModelCall { .. }
                    }
            ),
            _ => true,
        }
    }

    /// Fold one stored frame (its seq, and the idempotency key it was
    /// stored under). Returns whether anything changed, so a backend only
    /// rewrites its stored meta when needed.
    pub fn apply(&mut self, seq: u64, body: &FrameBody, key: Option<&str>) -> bool {
        match body {
            FrameBody::RunnerAttached { generation } => {
                let changed = *generation > self.generation;
                self.generation = self.generation.max(*generation);
                changed
            }
            FrameBody::UserMessage { text, turn_id } => {
                let turn_id = turn_id.clone().unwrap_or_else(|| self.next_turn_id());
                self.turns += 1;
                self.turn = Some(TurnMeta {
                    turn_id,
                    prompt: text.clone(),
                    key: key.map(str::to_string),
                    status: TurnStatus::NotStarted,
                    error: None,
                    approval: None,
                    answers: Vec::new(),
                    abort: None,
                    start_seq: seq,
                });
                true
            }
            FrameBody::ApprovalResponse {
                approval_id,
                approved,
                reason,
                turn_id,
            } => {
                let Some(turn) = self.turn_mut(turn_id.as_deref()) else {
                    return false;
                };
                // Only the answer to the request the turn waits on counts
                // (and is re-sent after a restart); an answer to anything
                // else stays in the log as the client's words and changes
                // nothing — so the meta stays as small as the requests.
                if turn.approval.as_deref() != Some(approval_id.as_str()) {
                    return false;
                }
                turn.approval = None;
                turn.answers.push(ApprovalAnswer {
                    approval_id: approval_id.clone(),
                    approved: *approved,
                    reason: reason.clone(),
                });
                true
            }
            FrameBody::AbortRequested { turn_id, reason } => match self.turn_mut(Some(turn_id)) {
                Some(turn) if turn.abort.is_none() => {
                    turn.abort = Some(reason.clone());
                    true
                }
                _ => false,
            },
            FrameBody::Part { turn_id, part } => match part {
                StreamPart::ToolApprovalRequest { approval_id, .. } => {
                    match self.turn_mut(Some(turn_id)) {
                        Some(turn) => {
                            turn.approval = Some(approval_id.clone());
                            true
                        }
                        None => false,
                    }
                }
                StreamPart::StreamStart {
                    agent_session_id: Some(id),
                } if self.agent_session_id.as_ref() != Some(id) => {
                    self.agent_session_id = Some(id.clone());
                    true
                }
                StreamPart::Finish { usage, .. } => {
                    self.usage.reported_input_tokens += usage.input_tokens;
                    self.usage.reported_output_tokens += usage.output_tokens;
                    usage.input_tokens + usage.output_tokens > 0
                }
                StreamPart::Audit {
                    record:
                        crate::audit::AuditRecord::ModelCall {
                            input_tokens,
                            output_tokens,
                            spend_micros,
                            ..
                        },
                } => {
                    self.usage.model_calls += 1;
                    self.usage.input_tokens += input_tokens;
                    self.usage.output_tokens += output_tokens;
                    self.usage.spend_micros += spend_micros.unwrap_or(0);
                    true
                }
                _ => false,
            },
            FrameBody::TurnStatus {
                turn_id,
                status,
                error,
                sandbox,
                agent_session_id,
                checkpoint,
                ..
            } => {
                if let Some(turn) = self.turn_mut(Some(turn_id)) {
                    turn.status = *status;
                    turn.error = error.clone();
                    if status.is_terminal() {
                        turn.approval = None;
                    }
                }
                if sandbox.is_some() {
                    self.sandbox = sandbox.clone();
                }
                if agent_session_id.is_some() {
                    self.agent_session_id = agent_session_id.clone();
                }
                if let (Some(key), true) = (checkpoint, status.is_terminal()) {
                    self.checkpoint = Some(key.clone());
                    self.checkpoints.push(TurnCheckpoint {
                        turn_id: turn_id.clone(),
                        seq,
                        key: key.clone(),
                        agent_session_id: self.agent_session_id.clone(),
                    });
                }
                true
            }
            FrameBody::SandboxReset {
                checkpoint,
                agent_session_id,
                provider,
                ..
            } => {
                self.sandbox = None;
                self.checkpoint = checkpoint.clone();
                self.agent_session_id = agent_session_id.clone();
                if let Some(provider) = provider {
                    let mut config = self.config_or_default();
                    config.sandbox.provider = provider.clone();
                    self.config = Some(config);
                }
                true
            }
            // Host calls live in the log, not the meta: a recovering actor
            // reads the active turn's frames from `start_seq`.
            FrameBody::Message { .. }
            | FrameBody::Sealed {}
            | FrameBody::HostCall { .. }
            | FrameBody::HostOutcome { .. } => false,
        }
    }

    /// The command that starts (or, idempotently, re-starts) `turn`.
    pub fn start_command(&self, turn: &TurnMeta) -> TurnCommand {
        TurnCommand::Start {
            turn_id: turn.turn_id.clone(),
            prompt: turn.prompt.clone(),
            config: self.config_or_default(),
            sandbox: self.sandbox.clone(),
            agent_session_id: self.agent_session_id.clone(),
            checkpoint: self.checkpoint.clone(),
        }
    }

    /// The checkpoint a rewind to `turn_id` goes back to: refused while a
    /// turn runs, and for a turn that ended without one (or never ran).
    pub fn rewind_point(&self, turn_id: &str) -> Result<&TurnCheckpoint> {
        if let Some(running) = self.active_turn() {
            return Err(Error::conflict(format!(
                "turn {} is still running: wait for it to end or abort it, then rewind",
                running.turn_id
            )));
        }
        self.checkpoints
            .iter()
            .rev()
            .find(|c| c.turn_id == turn_id)
            .ok_or_else(|| {
                let known: Vec<&str> = self
                    .checkpoints
                    .iter()
                    .map(|c| c.turn_id.as_str())
                    .collect();
                Error::invalid(format!(
                    "turn {turn_id:?} has no checkpoint to rewind to (turns with one: {})",
                    if known.is_empty() {
                        "none".to_string()
                    } else {
                        known.join(", ")
                    }
                ))
            })
    }

    /// Everything a runtime must (re)do for the active turn: start it, hand
    /// it every answer given, abort it if asked. All idempotent, so a
    /// runtime that restarts or a runner that attaches late sends them all.
    pub fn pending_commands(&self) -> Vec<TurnCommand> {
        let Some(turn) = self.active_turn() else {
            return Vec::new();
        };
        let mut commands = vec![self.start_command(turn)];
        commands.extend(turn.answers.iter().map(|answer| TurnCommand::Answer {
            turn_id: turn.turn_id.clone(),
            answer: answer.clone(),
        }));
        if let Some(reason) = &turn.abort {
            commands.push(TurnCommand::Abort {
                turn_id: turn.turn_id.clone(),
                reason: reason.clone(),
            });
        }
        commands
    }
}

/// An engine call a stored client message asks for.
// `Start` carries the session's config and sandbox handle and is much
// larger than the rest; commands are few (one per prompt, answer or abort)
// and short-lived, so boxing would only add noise at every use.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(
    tag = "type",
    rename_all = "kebab-case",
    rename_all_fields = "camelCase"
)]
pub enum TurnCommand {
    /// Start the turn a prompt opened.
    Start {
        /// The turn.
        turn_id: String,
        /// Its prompt.
        prompt: String,
        /// The session's configuration.
        config: SessionConfig,
        /// The session's sandbox, once a turn made one.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        sandbox: Option<SandboxHandle>,
        /// The agent session to continue.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        agent_session_id: Option<String>,
        /// The checkpoint the session is at ([`SessionMeta::checkpoint`]).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        checkpoint: Option<String>,
    },
    /// Hand a client's answer to the turn.
    Answer {
        /// The turn.
        turn_id: String,
        /// The answer.
        answer: ApprovalAnswer,
    },
    /// Abort the turn.
    Abort {
        /// The turn.
        turn_id: String,
        /// Why.
        reason: String,
    },
}

impl TurnCommand {
    /// The turn the command is about.
    pub fn turn_id(&self) -> &str {
        match self {
            TurnCommand::Start { turn_id, .. }
            | TurnCommand::Answer { turn_id, .. }
            | TurnCommand::Abort { turn_id, .. } => turn_id,
        }
    }
}

/// Performs [`TurnCommand`]s on a [`DurableEngine`]: the one piece every
/// runtime (`harness serve`, `harness runner`, the embedding API, a Durable
/// Object) shares between "the actor stored a prompt" and "the engine runs
/// the turn".
#[derive(Debug, Clone)]
pub struct SessionRuntime {
    engine: Arc<dyn DurableEngine>,
    turn_config: TurnConfig,
}

impl SessionRuntime {
    /// A runtime starting turns on `engine` with the default budgets.
    pub fn new(engine: Arc<dyn DurableEngine>) -> Self {
        Self {
            engine,
            turn_config: TurnConfig::default(),
        }
    }

    /// Budgets for the turns this runtime starts (slice length, …).
    pub fn with_turn_config(mut self, config: TurnConfig) -> Self {
        self.turn_config = config;
        self
    }

    /// The engine.
    pub fn engine(&self) -> &Arc<dyn DurableEngine> {
        &self.engine
    }

    /// The turn state a `Start` command begins with.
    pub fn initial_state(&self, session: &SessionId, command: &TurnCommand) -> Option<TurnState> {
        let TurnCommand::Start {
            turn_id,
            prompt,
            config,
            sandbox,
            agent_session_id,
            checkpoint,
        } = command
        else {
            return None;
        };
        let mut state = TurnState::new(session.as_str(), turn_id, &config.agent, prompt);
        state.config = self.turn_config.clone();
        state.sandbox = sandbox.clone();
        state.sandbox_config = Some(config.sandbox.clone());
        state.agent_session_id = agent_session_id.clone();
        state.checkpoint = checkpoint.clone();
        state.model = config.model.clone();
        state.approvals = config.approvals;
        if !config.budget.is_unlimited() {
            state.config.budget = config.budget.clone();
        }
        Some(state)
    }

    /// Perform one command. Idempotent: starting a turn that already runs,
    /// or answering/aborting one that already ended, succeeds without doing
    /// anything.
    pub async fn perform(&self, session: &SessionId, command: TurnCommand) -> Result<()> {
        // A session lives for days and a span is exported only once it
        // ends, so the session's part of a trace is one short span per
        // command; the turn it starts is its child.
        let span = tracing::info_span!(
            "session",
            session.id = %session,
            turn.id = %command.turn_id(),
            command = match &command {
                TurnCommand::Start { .. } => "start",
                TurnCommand::Answer { .. } => "answer",
                TurnCommand::Abort { .. } => "abort",
            },
            engine = self.engine.name(),
        );
        self.perform_command(session, command)
            .instrument(span)
            .await
    }

    async fn perform_command(&self, session: &SessionId, command: TurnCommand) -> Result<()> {
        match &command {
            TurnCommand::Start {
                turn_id, prompt, ..
            } => {
                let state = self
                    .initial_state(session, &command)
                    .expect("a start command has an initial state");
                match self.engine.start_turn(state).await {
                    Ok(()) => Ok(()),
                    Err(e) if e.kind() == ErrorKind::Conflict => {
                        // Already started (a re-sent command) — or the id
                        // was used by another turn, which is an error.
                        let existing = self.engine.turn_state(session.as_str(), turn_id).await?;
                        if existing.prompt == *prompt {
                            Ok(())
                        } else {
                            Err(Error::conflict(format!(
                                "turn id {turn_id:?} was already used by another turn of session {session}"
                            )))
                        }
                    }
                    Err(e) => Err(e),
                }
            }
            TurnCommand::Answer { turn_id, answer } => ignore_ended(
                self.engine
                    .answer_approval(session.as_str(), turn_id, answer.clone())
                    .await,
            ),
            TurnCommand::Abort { turn_id, reason } => ignore_ended(
                self.engine
                    .abort_turn(session.as_str(), turn_id, reason)
                    .await,
            ),
        }
    }
}

/// A turn that is not running any more has nothing to answer or abort.
fn ignore_ended(result: Result<()>) -> Result<()> {
    match result {
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prompt(text: &str, turn: &str) -> FrameBody {
        FrameBody::UserMessage {
            text: text.into(),
            turn_id: Some(turn.into()),
        }
    }

    #[test]
    fn usage_is_folded_from_model_call_records_and_finish_parts() {
        use crate::audit::AuditRecord;
        let mut meta = SessionMeta::default();
        let part = |part| FrameBody::Part {
            turn_id: "t1".into(),
            part,
        };
        let call = |index, input, output, spend| {
            part(StreamPart::Audit {
                record: AuditRecord::ModelCall {
                    index,
                    model: Some("m".into()),
                    status: 200,
                    input_tokens: input,
                    output_tokens: output,
                    spend_micros: spend,
                },
            })
        };
        for body in [call(1, 100, 10, Some(5)), call(2, 200, 20, None)] {
            assert!(SessionMeta::touched_by(&body));
            assert!(meta.apply(1, &body, None));
        }
        let finish = part(StreamPart::Finish {
            finish_reason: "stop".into(),
            usage: crate::part::Usage {
                input_tokens: 7,
                output_tokens: 3,
                ..Default::default()
            },
        });
        assert!(meta.apply(3, &finish, None));
        let exec = part(StreamPart::Audit {
            record: AuditRecord::Exec {
                argv: vec!["true".into()],
                cwd: None,
                env: vec![],
                detached: false,
                exit_code: Some(0),
                signal: None,
                ended: None,
            },
        });
        assert!(!SessionMeta::touched_by(&exec));
        assert!(!meta.apply(4, &exec, None));
        assert_eq!(
            meta.usage,
            SessionUsage {
                model_calls: 2,
                input_tokens: 300,
                output_tokens: 30,
                spend_micros: 5,
                reported_input_tokens: 7,
                reported_output_tokens: 3,
            }
        );
        // On the wire: camelCase, and absent while nothing was used.
        let json = serde_json::to_value(&meta).unwrap();
        assert_eq!(json["usage"]["modelCalls"], 2);
        assert!(serde_json::to_value(SessionMeta::default())
            .unwrap()
            .get("usage")
            .is_none());
    }

    #[test]
    fn meta_follows_a_turn_from_prompt_to_end() {
        let mut meta = SessionMeta::new(Some(SessionConfig::new("codex", "docker")));
        assert!(meta.apply(0, &prompt("hi", "t1"), Some("k1")));
        let turn = meta.active_turn().expect("active");
        assert_eq!(
            (turn.turn_id.as_str(), turn.key.as_deref()),
            ("t1", Some("k1"))
        );
        assert_eq!(meta.next_turn_id(), "t2");
        let request = FrameBody::Part {
            turn_id: "t1".into(),
            part: StreamPart::ToolApprovalRequest {
                approval_id: "a1".into(),
                tool_call_id: "c1".into(),
                tool_name: "Bash".into(),
                input: serde_json::json!({}),
            },
        };
        assert!(meta.apply(0, &request, None));
        assert_eq!(meta.active_turn().unwrap().approval.as_deref(), Some("a1"));
        let answer = FrameBody::ApprovalResponse {
            approval_id: "a1".into(),
            approved: true,
            reason: None,
            turn_id: Some("t1".into()),
        };
        assert!(meta.apply(0, &answer, None));
        assert_eq!(meta.active_turn().unwrap().approval, None);
        let commands = meta.pending_commands();
        assert_eq!(commands.len(), 2);
        assert!(
            matches!(&commands[0], TurnCommand::Start { config, .. } if config.agent == "codex")
        );
        assert!(matches!(&commands[1], TurnCommand::Answer { answer, .. } if answer.approved));
        let handle = SandboxHandle {
            provider: "docker".into(),
            id: "c".into(),
            workdir: "/workspace".into(),
            owned: true,
            data: serde_json::Value::Null,
        };
        let end = FrameBody::TurnStatus {
            turn_id: "t1".into(),
            status: TurnStatus::Finished,
            error: None,
            code: None,
            sandbox: Some(handle.clone()),
            agent_session_id: Some("thread".into()),
            checkpoint: None,
        };
        assert!(meta.apply(0, &end, None));
        assert!(meta.active_turn().is_none());
        assert!(meta.pending_commands().is_empty());
        assert_eq!(meta.sandbox, Some(handle.clone()));
        // The next turn continues in the same sandbox and agent session.
        meta.apply(0, &prompt("again", "t2"), None);
        match meta.start_command(meta.active_turn().unwrap()) {
            TurnCommand::Start {
                sandbox,
                agent_session_id,
                ..
            } => {
                assert_eq!(sandbox, Some(handle));
                assert_eq!(agent_session_id.as_deref(), Some("thread"));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn frames_of_another_turn_do_not_touch_the_latest() {
        let mut meta = SessionMeta::default();
        meta.apply(0, &prompt("a", "t1"), None);
        let stale = FrameBody::AbortRequested {
            turn_id: "t0".into(),
            reason: "late".into(),
        };
        assert!(!meta.apply(0, &stale, None));
        assert_eq!(meta.active_turn().unwrap().abort, None);
        assert!(!meta.apply(0, &FrameBody::RunnerAttached { generation: 0 }, None));
        assert!(meta.apply(0, &FrameBody::RunnerAttached { generation: 5 }, None));
        assert!(!meta.apply(0, &FrameBody::RunnerAttached { generation: 3 }, None));
        assert_eq!(meta.generation, 5);
    }

    #[test]
    fn assigned_turn_ids_stay_unique_after_a_client_chose_one() {
        let mut meta = SessionMeta::default();
        meta.apply(0, &prompt("a", "t2"), None); // a client named its first turn t2
        assert_eq!(meta.next_turn_id(), "t2-2");
    }
}
