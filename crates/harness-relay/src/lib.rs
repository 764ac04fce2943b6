//! # harness-relay
//!
//! The wire types of host tools: tools that run on a user's own machine
//! (a local database, a browser, a private network) and that an agent in a
//! remote sandbox calls as MCP tools.
//!
//! ```text
//! agent ─MCP─▶ bridge (in the sandbox) ─requests.jsonl─▶ slice (runner)
//!        ─RunnerMessage::HostCall─▶ session actor ─HostCall─▶ host (relay-host)
//!        ◀─ outcome frame ── actor ◀─ HostMessage::Result ── host
//! ```
//!
//! Every call ends in exactly one [`HostOutcome`], stored in the session's
//! log like any other frame: `completed`, `unavailable` (no host attached:
//! nothing ran, safe to call again), `timeout` (the deadline passed: the
//! host is told to cancel) or `ambiguous` (the host left mid-call: it may or
//! may not have run; never retried). A call id seen before answers with the
//! outcome recorded for it; the host never receives a call twice.
//!
//! Permission requests travel the same relay files: an
//! [`ApprovalRequest`] line, answered by an [`ApprovalAnswer`] file (see
//! [`files`]).
//!
//! This crate is serde types and small pure helpers only, so the session
//! actor (in `harness-core`, built for wasm32), the bridge inside the
//! sandbox and the host all speak the same words.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// A result larger than this is cut when the caller names no budget.
pub const DEFAULT_BYTE_BUDGET: u64 = 64 * 1024;
/// The largest budget a call may ask for: an outcome is one log frame, and
/// frames are limited to 1 MiB.
pub const MAX_BYTE_BUDGET: u64 = 512 * 1024;
/// How long a call may run when the caller names no timeout.
pub const DEFAULT_TIMEOUT_MS: u64 = 60_000;
/// The longest timeout a call may ask for.
pub const MAX_TIMEOUT_MS: u64 = 15 * 60_000;
/// Longest call id and tool name.
pub const MAX_ID_LEN: usize = 128;

/// A tool a host offers: what the agent sees in MCP `tools/list`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ToolSpec {
    /// Name, `[A-Za-z0-9_-]{1,64}` (what MCP clients accept).
    pub name: String,
    /// What the tool does, for the model.
    #[serde(default)]
    pub description: String,
    /// JSON Schema of the arguments (an object schema).
    #[serde(default = "empty_object_schema")]
    pub input_schema: Value,
}

fn empty_object_schema() -> Value {
    serde_json::json!({ "type": "object" })
}

impl ToolSpec {
    /// A tool taking `input_schema`.
    pub fn new(
        name: impl Into<String>,
        description: impl Into<String>,
        input_schema: Value,
    ) -> Self {
        Self {
            name: name.into(),
            description: description.into(),
            input_schema,
        }
    }

    /// Check the name and that the schema is an object schema.
    pub fn validate(&self) -> Result<(), String> {
        let name_ok = !self.name.is_empty()
            && self.name.len() <= 64
            && self
                .name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-'));
        if !name_ok {
            return Err(format!(
                "tool name {:?}: use 1-64 characters of A-Z a-z 0-9 _ -",
                self.name
            ));
        }
        if !self.input_schema.is_object() {
            return Err(format!(
                "tool {:?}: inputSchema must be a JSON object (a JSON Schema)",
                self.name
            ));
        }
        Ok(())
    }
}

/// Check a set of declared tools: each valid, names unique.
pub fn validate_tools(tools: &[ToolSpec]) -> Result<(), String> {
    let mut seen = std::collections::BTreeSet::new();
    for tool in tools {
        tool.validate()?;
        if !seen.insert(tool.name.as_str()) {
            return Err(format!("tool {:?} is declared twice", tool.name));
        }
    }
    Ok(())
}

/// Check a call id: 1-128 characters of `[A-Za-z0-9._-]`, not starting
/// with `.` (it names a file in the sandbox's relay directory).
pub fn validate_call_id(id: &str) -> Result<(), String> {
    let ok = !id.is_empty()
        && id.len() <= MAX_ID_LEN
        && !id.starts_with('.')
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "call id {id:?}: use 1-{MAX_ID_LEN} characters of A-Z a-z 0-9 . _ - (not starting with '.')"
        ))
    }
}

/// A call as the agent's side asks for it (the bridge writes it, the
/// runner sends it to the session).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HostCallRequest {
    /// Unique per call; a repeated id answers with the recorded outcome.
    pub call_id: String,
    /// The tool.
    pub tool: String,
    /// Its arguments.
    #[serde(default)]
    pub input: Value,
    /// Largest result in bytes (default [`DEFAULT_BYTE_BUDGET`], at most
    /// [`MAX_BYTE_BUDGET`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub byte_budget: Option<u64>,
    /// How long the call may take, from when the session records it
    /// (default [`DEFAULT_TIMEOUT_MS`], at most [`MAX_TIMEOUT_MS`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
}

impl HostCallRequest {
    /// Check the ids and limits (a budget or timeout above the maximum is
    /// refused, not silently lowered: the caller asked for something the
    /// session will not give).
    pub fn validate(&self) -> Result<(), String> {
        validate_call_id(&self.call_id)?;
        if self.tool.is_empty() || self.tool.len() > MAX_ID_LEN {
            return Err(format!("tool name {:?} is empty or too long", self.tool));
        }
        if let Some(b) = self.byte_budget {
            if b == 0 || b > MAX_BYTE_BUDGET {
                return Err(format!("byteBudget {b} is outside 1..={MAX_BYTE_BUDGET}"));
            }
        }
        if let Some(t) = self.timeout_ms {
            if t == 0 || t > MAX_TIMEOUT_MS {
                return Err(format!("timeoutMs {t} is outside 1..={MAX_TIMEOUT_MS}"));
            }
        }
        Ok(())
    }

    /// The budget in force.
    pub fn budget(&self) -> u64 {
        self.byte_budget.unwrap_or(DEFAULT_BYTE_BUDGET)
    }

    /// The timeout in force.
    pub fn timeout(&self) -> u64 {
        self.timeout_ms.unwrap_or(DEFAULT_TIMEOUT_MS)
    }
}

/// A call as the host receives it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HostCall {
    /// The call.
    pub call_id: String,
    /// The tool.
    pub tool: String,
    /// Its arguments.
    pub input: Value,
    /// Largest result the session keeps; send no more.
    pub byte_budget: u64,
    /// Milliseconds since the Unix epoch (the session's clock) after which
    /// the session records a timeout and ignores a late result.
    pub deadline_at_ms: u64,
}

/// How a call ended. Exactly one per call id, stored as a frame.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(
    tag = "outcome",
    rename_all = "kebab-case",
    rename_all_fields = "camelCase"
)]
pub enum HostOutcome {
    /// The host ran the tool and answered in time.
    Completed {
        /// The result (cut to the byte budget, see `truncated`).
        output: String,
        /// The tool reported failure.
        #[serde(default)]
        is_error: bool,
        /// The result was longer than the budget; `output` ends with a
        /// marker saying how much was cut.
        #[serde(default)]
        truncated: bool,
    },
    /// No host was attached (or it does not offer the tool): nothing ran,
    /// calling again (with a new call id) is safe.
    Unavailable {
        /// Why.
        reason: String,
    },
    /// The deadline passed before the host answered; the host was told to
    /// cancel. The tool may have run in part.
    Timeout {
        /// The deadline that passed.
        deadline_at_ms: u64,
    },
    /// The host left (or the session restarted) while the call was out: it
    /// may or may not have run. Never retried.
    Ambiguous {
        /// Why.
        reason: String,
    },
}

impl HostOutcome {
    /// A completed outcome of `output`, cut to `budget` bytes (at a
    /// character boundary) with a marker when longer.
    pub fn completed(output: String, is_error: bool, budget: u64) -> Self {
        let (output, truncated) = truncate(output, budget);
        HostOutcome::Completed {
            output,
            is_error,
            truncated,
        }
    }

    /// The outcome's name (`completed`, `unavailable`, `timeout`, `ambiguous`).
    pub fn name(&self) -> &'static str {
        match self {
            HostOutcome::Completed { .. } => "completed",
            HostOutcome::Unavailable { .. } => "unavailable",
            HostOutcome::Timeout { .. } => "timeout",
            HostOutcome::Ambiguous { .. } => "ambiguous",
        }
    }

    /// What the agent reads: the result, or a sentence saying what happened
    /// and whether calling again is safe; and whether it is an error.
    pub fn agent_text(&self) -> (String, bool) {
        match self {
            HostOutcome::Completed {
                output, is_error, ..
            } => (output.clone(), *is_error),
            HostOutcome::Unavailable { reason } => (
                format!("host tool unavailable: {reason}. Nothing ran; you may call it again."),
                true,
            ),
            HostOutcome::Timeout { .. } => (
                "host tool timed out: the deadline passed and the host was told to cancel. It may have run in part."
                    .to_string(),
                true,
            ),
            HostOutcome::Ambiguous { reason } => (
                format!("host tool outcome unknown: {reason}. It may or may not have run; do not assume either."),
                true,
            ),
        }
    }
}

/// Cut `output` to at most `budget` bytes at a character boundary, then add
/// a marker naming the full size. Returns the text and whether it was cut.
pub fn truncate(output: String, budget: u64) -> (String, bool) {
    let total = output.len() as u64;
    truncate_counted(output, budget, total)
}

/// [`truncate`] for output that was already cut while it arrived: `total`
/// is how many bytes the tool produced in all (what the marker names).
pub fn truncate_counted(mut output: String, budget: u64, total: u64) -> (String, bool) {
    let budget = usize::try_from(budget).unwrap_or(usize::MAX);
    if output.len() <= budget && total <= budget as u64 {
        return (output, false);
    }
    let mut cut = budget.min(output.len());
    while !output.is_char_boundary(cut) {
        cut -= 1;
    }
    output.truncate(cut);
    output.push_str(&format!(
        "\n[output truncated: {cut} of {total} bytes shown (byte budget {budget})]"
    ));
    (output, true)
}

/// What a host sends to the session.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(
    tag = "type",
    rename_all = "kebab-case",
    rename_all_fields = "camelCase"
)]
pub enum HostMessage {
    /// The tools this host offers (replaces an earlier declaration).
    Declare {
        /// The tools.
        tools: Vec<ToolSpec>,
    },
    /// Part of a call's result, sent while it runs; the session keeps up to
    /// the byte budget.
    Chunk {
        /// The call.
        call_id: String,
        /// More output.
        data: String,
    },
    /// A call finished: its output is the chunks sent so far plus `output`.
    Result {
        /// The call.
        call_id: String,
        /// The (rest of the) output.
        #[serde(default)]
        output: String,
        /// The tool failed.
        #[serde(default)]
        is_error: bool,
        /// How many bytes the tool produced in all, when the host stopped
        /// sending at the budget (the truncation marker names this size).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        produced_bytes: Option<u64>,
    },
}

/// A permission request from the agent's side (Claude Code's approval
/// tool, Codex's `PreToolUse` hook): may this tool call run?
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ApprovalRequest {
    /// Unique per request; names the answer file.
    pub approval_id: String,
    /// The agent's tool.
    pub tool_name: String,
    /// Its input.
    #[serde(default)]
    pub input: Value,
    /// The agent's own id of the tool call, when it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_use_id: Option<String>,
}

/// A client's answer to an [`ApprovalRequest`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApprovalAnswer {
    /// Allow or deny.
    pub approved: bool,
    /// Why (shown to the agent on deny).
    pub reason: Option<String>,
}

/// Files the agent's side (the bridge, the approval tool or hook, inside
/// the sandbox) and the slice exchange, under the turn's relay directory
/// `<spool>/relay`: requests appended to one file, one answer file each.
pub mod files {
    use super::{ApprovalRequest, HostCallRequest, Serialize};
    use serde::Deserialize;

    /// One line of `requests.jsonl`: what the agent's side asks for.
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    #[serde(tag = "kind", rename_all = "kebab-case")]
    pub enum RelayRequest {
        /// Call a host tool; the answer is `answers/<callId>.json`, a
        /// [`HostOutcome`](super::HostOutcome).
        HostTool(HostCallRequest),
        /// Ask the session's client whether a tool call may run; the answer
        /// is `answers/<approvalId>.json`, an
        /// [`ApprovalAnswer`](super::ApprovalAnswer).
        Approval(ApprovalRequest),
    }

    impl RelayRequest {
        /// The id that names the request's answer file.
        pub fn id(&self) -> &str {
            match self {
                RelayRequest::HostTool(r) => &r.call_id,
                RelayRequest::Approval(r) => &r.approval_id,
            }
        }
    }

    /// Requests, one JSON object per line, appended by the bridge.
    pub const REQUESTS: &str = "requests.jsonl";
    /// Answers, one file per call id.
    pub const ANSWERS: &str = "answers";
    /// The host's tools when the agent started, written by the slice.
    pub const TOOLS: &str = "tools.json";

    /// Where the bridge (`harness-relay-mcp`) is installed in a sandbox.
    pub const BRIDGE_PATH: &str = "/opt/harness/bin/harness-relay-mcp";
    /// The bridge's MCP server name: agents call host tool `t` as
    /// `mcp__host__t`.
    pub const MCP_SERVER_NAME: &str = "host";
    /// The directory of a turn's relay files inside its spool.
    pub const DIR: &str = "relay";

    /// The answer file of a call, relative to the relay directory.
    pub fn answer_path(call_id: &str) -> String {
        format!("{ANSWERS}/{call_id}.json")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn outcomes_have_stable_wire_names() {
        let o = HostOutcome::completed("hi".into(), false, 10);
        assert_eq!(
            serde_json::to_value(&o).unwrap(),
            json!({"outcome": "completed", "output": "hi", "isError": false, "truncated": false})
        );
        let t = HostOutcome::Timeout { deadline_at_ms: 5 };
        assert_eq!(
            serde_json::to_value(&t).unwrap(),
            json!({"outcome": "timeout", "deadlineAtMs": 5})
        );
        let r: files::RelayRequest = serde_json::from_value(json!({
            "kind": "host-tool", "callId": "c1", "tool": "t", "input": {"a": 1}
        }))
        .unwrap();
        let files::RelayRequest::HostTool(r) = r else {
            panic!("{r:?}")
        };
        assert_eq!(r.budget(), DEFAULT_BYTE_BUDGET);
        // An approval line as Codex's hook writes it: its own fields stay,
        // unknown ones are ignored.
        let a: files::RelayRequest = serde_json::from_str(
            r#"{"kind":"approval","approvalId":"codex-1-2","session_id":"x","toolName":"exec_command","input":{"cmd":"ls"},"toolUseId":"call_1"}"#,
        )
        .unwrap();
        assert_eq!(a.id(), "codex-1-2");
        assert_eq!(r.timeout(), DEFAULT_TIMEOUT_MS);
    }

    #[test]
    fn truncation_keeps_a_char_boundary_and_says_so() {
        let (s, cut) = truncate("héllo".into(), 2);
        assert!(cut);
        assert!(s.starts_with('h'), "{s}");
        assert!(!s.starts_with("hé"), "é is 2 bytes and does not fit: {s}");
        assert!(s.contains("1 of 6 bytes shown"), "{s}");
        let (s, cut) = truncate("abc".into(), 3);
        assert_eq!((s.as_str(), cut), ("abc", false));
    }

    #[test]
    fn bad_ids_budgets_and_tools_are_refused() {
        assert!(validate_call_id("../x").is_err());
        assert!(validate_call_id(".x").is_err());
        assert!(validate_call_id(&"a".repeat(129)).is_err());
        assert!(validate_call_id("call-1.a_b").is_ok());
        let mut r = HostCallRequest {
            call_id: "c".into(),
            tool: "t".into(),
            input: Value::Null,
            byte_budget: Some(MAX_BYTE_BUDGET + 1),
            timeout_ms: None,
        };
        assert!(r.validate().unwrap_err().contains("byteBudget"));
        r.byte_budget = Some(0);
        assert!(r.validate().is_err());
        r.byte_budget = None;
        r.timeout_ms = Some(MAX_TIMEOUT_MS + 1);
        assert!(r.validate().unwrap_err().contains("timeoutMs"));
        let tools = vec![
            ToolSpec::new("a", "", json!({"type": "object"})),
            ToolSpec::new("a", "", json!({"type": "object"})),
        ];
        assert!(validate_tools(&tools).unwrap_err().contains("twice"));
        assert!(ToolSpec::new("a b", "", json!({})).validate().is_err());
        assert!(ToolSpec::new("a", "", json!("x")).validate().is_err());
    }
}
