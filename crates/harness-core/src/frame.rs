//! Frames: the unit of a session log. Every stored frame has a `seq`,
//! assigned by the log, gap-free from 1.

use serde::{Deserialize, Serialize};

use crate::part::StreamPart;
use crate::relay::HostOutcome;
use crate::sandbox::SandboxHandle;
use crate::turn::TurnStatus;

/// A session id. Kept as a string newtype so ids from any front end fit;
/// [`SessionId::parse`] enforces the charset every backend can store and put
/// in a URL or an object key.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct SessionId(String);

impl SessionId {
    /// Longest accepted id.
    pub const MAX_LEN: usize = 128;

    /// Validate and wrap an id: 1–128 chars of `[A-Za-z0-9._-]`, not starting
    /// with `.`.
    pub fn parse(id: impl Into<String>) -> crate::Result<Self> {
        let id = id.into();
        let ok = !id.is_empty()
            && id.len() <= Self::MAX_LEN
            && !id.starts_with('.')
            && id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
        if ok {
            Ok(Self(id))
        } else {
            Err(crate::Error::invalid(format!(
                "invalid session id {id:?}: use 1-{} characters of A-Z a-z 0-9 . _ - (not starting with '.')",
                Self::MAX_LEN
            )))
        }
    }

    /// The id as a string.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for SessionId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Which kind of text a stored message holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MessageKind {
    /// Assistant text.
    Text,
    /// Assistant reasoning.
    Reasoning,
}

/// What a stored frame says.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(
    tag = "type",
    rename_all = "kebab-case",
    rename_all_fields = "camelCase"
)]
pub enum FrameBody {
    /// A client's prompt, starting a turn.
    UserMessage {
        /// The prompt.
        text: String,
        /// Turn the prompt starts (chosen by the client or assigned by the
        /// session actor, `t<n>`; unique per session).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        turn_id: Option<String>,
    },
    /// A client's answer to a `tool-approval-request`.
    ApprovalResponse {
        /// The request being answered.
        approval_id: String,
        /// Allow or deny.
        approved: bool,
        /// Optional reason shown to the agent.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reason: Option<String>,
        /// The turn it answers (filled in by the session actor).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        turn_id: Option<String>,
    },
    /// A client asked to abort the running turn.
    AbortRequested {
        /// The turn.
        turn_id: String,
        /// Why (ends up in the turn's error as `aborted: <reason>`).
        reason: String,
    },
    /// A stream part from the runner, stored as is. Text and reasoning deltas
    /// never appear here: they are folded into one [`FrameBody::Message`].
    Part {
        /// Turn that produced the part.
        turn_id: String,
        /// The part.
        part: StreamPart,
    },
    /// A whole text or reasoning block, stored once when it ends.
    Message {
        /// Turn that produced it.
        turn_id: String,
        /// Block id from the `*-start` part.
        id: String,
        /// Text or reasoning.
        kind: MessageKind,
        /// The full text.
        text: String,
        /// True when the block never saw its `*-end` (runner fenced or gone).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        interrupted: bool,
    },
    /// A turn changed status.
    TurnStatus {
        /// The turn.
        turn_id: String,
        /// Its new status.
        status: TurnStatus,
        /// Error message for `failed`/`timed_out`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        error: Option<String>,
        /// A stable name for why, where there is one (`budget_exceeded`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        code: Option<String>,
        /// The sandbox the turn ran in (the next turn continues there).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        sandbox: Option<SandboxHandle>,
        /// The agent's own session id (the next turn resumes it).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        agent_session_id: Option<String>,
        /// The turn-end checkpoint (tree and agent state) taken as the turn
        /// ended: its key in the session's checkpoint store. Set on the
        /// terminal status only, when checkpoints are on.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        checkpoint: Option<String>,
    },
    /// The session's sandbox is set aside: its next turn makes a new one
    /// and puts `checkpoint` into it (a fork, a rewind). The old sandbox
    /// is not the session's any more.
    SandboxReset {
        /// The turn whose end the session goes back to (none: before its
        /// first turn ended: an empty sandbox, a new conversation).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        turn_id: Option<String>,
        /// That turn's checkpoint.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        checkpoint: Option<String>,
        /// The agent session that checkpoint holds (the next turn resumes it).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        agent_session_id: Option<String>,
        /// The provider of the new sandbox (none: the session's own).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        provider: Option<String>,
        /// Why, for people: `fork of s1 at seq 12`, `rewind to turn t1`.
        reason: String,
    },
    /// A host-tool call of a turn, as the session recorded it before handing
    /// it to its host (or finding none). Stored once per call id.
    HostCall {
        /// The turn whose agent called.
        turn_id: String,
        /// The call.
        call_id: String,
        /// The tool.
        tool: String,
        /// Its arguments.
        input: serde_json::Value,
        /// Largest result kept.
        byte_budget: u64,
        /// The deadline is this frame's `at_ms` plus this.
        timeout_ms: u64,
    },
    /// How a host-tool call ended: exactly one per call id.
    HostOutcome {
        /// The turn.
        turn_id: String,
        /// The call.
        call_id: String,
        /// The outcome (its fields inline: `outcome`, `output`, …).
        #[serde(flatten)]
        outcome: HostOutcome,
    },
    /// A runner attached with this generation; older generations are fenced.
    RunnerAttached {
        /// Generation number, strictly increasing per session.
        generation: u64,
    },
    /// The log was sealed: no frame follows this one.
    Sealed {},
}

impl FrameBody {
    /// The turn this frame opened: a prompt's, once the session actor gave
    /// it its id.
    pub fn opened_turn(&self) -> Option<&str> {
        match self {
            FrameBody::UserMessage { turn_id, .. } => turn_id.as_deref(),
            _ => None,
        }
    }
}

/// A stored frame.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Frame {
    /// Position in the log, from 1, gap-free.
    pub seq: u64,
    /// Milliseconds since the Unix epoch when the log stored it (0 if the log
    /// keeps no clock).
    #[serde(default)]
    pub at_ms: u64,
    /// The content.
    pub body: FrameBody,
}

impl Frame {
    /// Serialized size in bytes, as limits count it.
    pub fn encoded_len(body: &FrameBody) -> usize {
        serde_json::to_vec(body)
            .map(|v| v.len())
            .unwrap_or(usize::MAX)
    }
}
