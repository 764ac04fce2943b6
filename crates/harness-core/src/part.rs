//! Stream parts: what an agent turn emits, in the AI SDK harness vocabulary.
//!
//! Field names are camelCase on the wire (`toolCallId`, `toolName`) so a
//! TypeScript consumer that already knows the AI SDK reads them unchanged.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Token usage reported at the end of a turn.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Usage {
    /// Prompt tokens.
    #[serde(default)]
    pub input_tokens: u64,
    /// Completion tokens.
    #[serde(default)]
    pub output_tokens: u64,
    /// Prompt tokens served from a cache, when the agent reports them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cached_input_tokens: Option<u64>,
    /// Tokens spent on reasoning, when the agent reports them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_tokens: Option<u64>,
}

/// What happened to a file, as reported by the agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FileChangeKind {
    /// The file was created.
    Create,
    /// The file was modified.
    Modify,
    /// The file was deleted.
    Delete,
}

/// One part of an agent's output stream.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(
    tag = "type",
    rename_all = "kebab-case",
    rename_all_fields = "camelCase"
)]
pub enum StreamPart {
    /// The turn's stream opened.
    StreamStart {
        /// The agent's own session/thread id, once known.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        agent_session_id: Option<String>,
    },
    /// A text block opens.
    TextStart {
        /// Block id, unique within the turn.
        id: String,
    },
    /// More text for an open block.
    TextDelta {
        /// Block id.
        id: String,
        /// The new text.
        delta: String,
    },
    /// A text block closes.
    TextEnd {
        /// Block id.
        id: String,
    },
    /// A reasoning block opens.
    ReasoningStart {
        /// Block id.
        id: String,
    },
    /// More reasoning for an open block.
    ReasoningDelta {
        /// Block id.
        id: String,
        /// The new text.
        delta: String,
    },
    /// A reasoning block closes.
    ReasoningEnd {
        /// Block id.
        id: String,
    },
    /// The agent calls a tool (with the agent's native tool name).
    ToolCall {
        /// Call id.
        tool_call_id: String,
        /// Native tool name, e.g. `Bash` or `exec_command`.
        tool_name: String,
        /// Tool input as the agent sent it.
        input: Value,
    },
    /// The agent asks for permission before running a tool.
    ToolApprovalRequest {
        /// Id the answer must quote.
        approval_id: String,
        /// The call waiting for approval.
        tool_call_id: String,
        /// Native tool name.
        tool_name: String,
        /// Tool input.
        input: Value,
    },
    /// A tool finished.
    ToolResult {
        /// Call id.
        tool_call_id: String,
        /// Native tool name.
        tool_name: String,
        /// The tool's output.
        output: Value,
        /// Whether the tool reported an error.
        #[serde(default)]
        is_error: bool,
    },
    /// A file in the working tree changed.
    FileChange {
        /// What happened.
        kind: FileChangeKind,
        /// Path relative to the working directory when possible.
        path: String,
    },
    /// The agent compacted its context.
    Compaction {
        /// Free-form details from the agent.
        #[serde(default, skip_serializing_if = "Value::is_null")]
        details: Value,
    },
    /// One model step (request/response) finished.
    FinishStep {
        /// Usage for the step, when known.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        usage: Option<Usage>,
    },
    /// The turn finished.
    Finish {
        /// Why the turn ended (`stop`, `error`, `aborted`, …).
        finish_reason: String,
        /// Token usage for the turn.
        #[serde(default)]
        usage: Usage,
    },
    /// The agent reported an error.
    Error {
        /// Human-readable message.
        message: String,
    },
    /// The agent reported a problem it is working around — today: a request
    /// to the model failed and the agent retries it. Not progress: the
    /// turn's quiet timer keeps running (see `TurnConfig::quiet_ms`).
    Warning {
        /// What kind of problem ([`WARNING_MODEL_RETRY`], …).
        code: String,
        /// Human-readable message, as the agent gave it.
        message: String,
        /// Which retry this is, when the agent counts them.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        attempt: Option<u32>,
        /// How many retries the agent will make, when it says.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        max_attempts: Option<u32>,
    },
    /// An audit record of the turn (`docs/audit.md`): a command the
    /// harness ran in the sandbox, a brokered model call. Written by the
    /// runner, not the agent; not progress.
    Audit {
        /// What happened.
        record: crate::audit::AuditRecord,
    },
    /// An event the parser did not understand, passed through unchanged.
    Raw {
        /// The original JSON value (or `{"line": "..."}` for non-JSON).
        value: Value,
    },
}

/// [`StreamPart::Warning`] code: a request to the model failed and the agent
/// retries it (unreachable endpoint, 5xx, overload).
pub const WARNING_MODEL_RETRY: &str = "model-retry";

impl StreamPart {
    /// Whether this part shows the agent making progress: anything but a
    /// warning or a line the parser did not understand. The quiet timer of
    /// a turn restarts on progress only, so an agent that does nothing but
    /// retry an unreachable model still times out.
    pub fn is_progress(&self) -> bool {
        !matches!(
            self,
            StreamPart::Warning { .. } | StreamPart::Raw { .. } | StreamPart::Audit { .. }
        )
    }

    /// The wire name of this part's `type`.
    pub fn type_name(&self) -> &'static str {
        match self {
            StreamPart::StreamStart { .. } => "stream-start",
            StreamPart::TextStart { .. } => "text-start",
            StreamPart::TextDelta { .. } => "text-delta",
            StreamPart::TextEnd { .. } => "text-end",
            StreamPart::ReasoningStart { .. } => "reasoning-start",
            StreamPart::ReasoningDelta { .. } => "reasoning-delta",
            StreamPart::ReasoningEnd { .. } => "reasoning-end",
            StreamPart::ToolCall { .. } => "tool-call",
            StreamPart::ToolApprovalRequest { .. } => "tool-approval-request",
            StreamPart::ToolResult { .. } => "tool-result",
            StreamPart::FileChange { .. } => "file-change",
            StreamPart::Compaction { .. } => "compaction",
            StreamPart::Audit { .. } => "audit",
            StreamPart::FinishStep { .. } => "finish-step",
            StreamPart::Finish { .. } => "finish",
            StreamPart::Error { .. } => "error",
            StreamPart::Warning { .. } => "warning",
            StreamPart::Raw { .. } => "raw",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn parts_use_the_ai_sdk_wire_names() {
        let part = StreamPart::ToolCall {
            tool_call_id: "c1".into(),
            tool_name: "Bash".into(),
            input: json!({"command": "ls"}),
        };
        let wire = serde_json::to_value(&part).unwrap();
        assert_eq!(
            wire,
            json!({"type": "tool-call", "toolCallId": "c1", "toolName": "Bash", "input": {"command": "ls"}})
        );
        assert_eq!(part.type_name(), "tool-call");
        let back: StreamPart = serde_json::from_value(wire).unwrap();
        assert_eq!(back, part);
        let finish: StreamPart = serde_json::from_value(
            json!({"type": "finish", "finishReason": "stop", "usage": {"inputTokens": 3, "outputTokens": 4}}),
        )
        .unwrap();
        assert_eq!(
            finish,
            StreamPart::Finish {
                finish_reason: "stop".into(),
                usage: Usage {
                    input_tokens: 3,
                    output_tokens: 4,
                    ..Usage::default()
                }
            }
        );
    }
}
