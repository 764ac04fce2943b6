//! Codex `exec --json` → [`StreamPart`]s.
//!
//! Codex prints one event per line: `thread.started`, `turn.started`,
//! `item.started` / `item.updated` / `item.completed` (each carrying an
//! `item` with a `type`), `turn.completed`, `turn.failed`, `error`. Items
//! are mapped by type (see `docs/agents.md`). `exec --json` of 0.171.0 sends
//! agent messages and reasoning only as `item.completed`; should a later
//! version send `item.started`/`item.updated` for them, the parser streams
//! the growing text as deltas and closes the block on `item.completed`.

use std::collections::{HashMap, HashSet};

use harness_core::harness::OutputParser;
use harness_core::part::{FileChangeKind, StreamPart, Usage, WARNING_MODEL_RETRY};
use serde_json::{json, Value};

/// The tool name reported for Codex shell commands (`command_execution`
/// items). It is the name of the function Codex declares to the model for
/// running commands, so it is the "native" name a user sees in requests.
pub const SHELL_TOOL_NAME: &str = "exec_command";

/// The tool name reported for patches (`file_change` items).
pub const PATCH_TOOL_NAME: &str = "apply_patch";

/// How the notice Codex prints as an `error` item (twice, observed with
/// 0.171.0) when it runs with `--dangerously-bypass-hook-trust` begins. The
/// adapter passes that flag itself for its approval hook, so the notice is
/// not an error of the turn: it becomes a `raw` part.
pub const HOOK_TRUST_NOTICE: &str = "`--dangerously-bypass-hook-trust` is enabled";

/// Parser state for one turn of Codex output.
#[derive(Debug, Default)]
pub struct CodexParser {
    thread_id: Option<String>,
    started: bool,
    /// Open text/reasoning items: id → (text emitted so far, is reasoning).
    open: HashMap<String, (String, bool)>,
    /// Tool items whose call was already reported.
    calls: HashSet<String>,
    /// Items already completed (a repeated completion is ignored).
    done: HashSet<String>,
    /// `Reconnecting...` notices seen (for their attempt number when the
    /// message carries none).
    reconnects: u32,
}

/// Codex's notice that a request to the model failed and is retried, e.g.
/// `Reconnecting... waiting for network (Connection failed: error sending
/// request)` (observed with nothing listening at the provider's base URL)
/// or `Reconnecting... 2/5 (stream disconnected before completion)`.
const RECONNECTING: &str = "Reconnecting...";

/// The `N/M` right after [`RECONNECTING`], when present.
fn reconnect_attempt(message: &str) -> Option<(u32, u32)> {
    let rest = message.strip_prefix(RECONNECTING)?.trim_start();
    let token = rest.split_whitespace().next()?;
    let (n, m) = token.split_once('/')?;
    Some((n.parse().ok()?, m.parse().ok()?))
}

fn raw(value: Value) -> StreamPart {
    StreamPart::Raw { value }
}

fn str_of<'a>(v: &'a Value, key: &str) -> Option<&'a str> {
    v.get(key).and_then(Value::as_str)
}

impl CodexParser {
    /// A parser for a fresh turn.
    pub fn new() -> Self {
        Self::default()
    }

    fn start(&mut self, out: &mut Vec<StreamPart>) {
        if !self.started {
            self.started = true;
            out.push(StreamPart::StreamStart {
                agent_session_id: self.thread_id.clone(),
            });
        }
    }

    /// Stream `text` (the item's full text so far) for block `id`.
    fn text_progress(&mut self, id: &str, text: &str, reasoning: bool, out: &mut Vec<StreamPart>) {
        let entry = self.open.entry(id.to_string()).or_insert_with(|| {
            out.push(if reasoning {
                StreamPart::ReasoningStart { id: id.to_string() }
            } else {
                StreamPart::TextStart { id: id.to_string() }
            });
            (String::new(), reasoning)
        });
        // Deltas are the new suffix; a rewritten prefix is sent whole.
        let delta = text.strip_prefix(entry.0.as_str()).unwrap_or(text);
        if !delta.is_empty() {
            out.push(if reasoning {
                StreamPart::ReasoningDelta {
                    id: id.to_string(),
                    delta: delta.to_string(),
                }
            } else {
                StreamPart::TextDelta {
                    id: id.to_string(),
                    delta: delta.to_string(),
                }
            });
        }
        entry.0 = text.to_string();
    }

    fn text_end(&mut self, id: &str, out: &mut Vec<StreamPart>) {
        if let Some((_, reasoning)) = self.open.remove(id) {
            out.push(if reasoning {
                StreamPart::ReasoningEnd { id: id.to_string() }
            } else {
                StreamPart::TextEnd { id: id.to_string() }
            });
        }
    }

    fn tool_call(&mut self, id: &str, name: &str, input: Value, out: &mut Vec<StreamPart>) {
        if self.calls.insert(id.to_string()) {
            out.push(StreamPart::ToolCall {
                tool_call_id: id.to_string(),
                tool_name: name.to_string(),
                input,
            });
        }
    }

    fn on_item(&mut self, phase: &str, event: &Value, out: &mut Vec<StreamPart>) {
        let Some(item) = event.get("item") else {
            out.push(raw(event.clone()));
            return;
        };
        let Some(id) = str_of(item, "id").map(str::to_string) else {
            out.push(raw(event.clone()));
            return;
        };
        let completed = phase == "item.completed";
        if completed && !self.done.insert(id.clone()) {
            return;
        }
        let status = str_of(item, "status").unwrap_or("");
        match str_of(item, "type") {
            Some(kind @ ("agent_message" | "reasoning")) => {
                let reasoning = kind == "reasoning";
                let text = str_of(item, "text").unwrap_or("");
                self.text_progress(&id, text, reasoning, out);
                if completed {
                    self.text_end(&id, out);
                }
            }
            Some("command_execution") => {
                let command = item.get("command").cloned().unwrap_or(Value::Null);
                self.tool_call(&id, SHELL_TOOL_NAME, json!({ "command": command }), out);
                if completed {
                    let exit_code = item.get("exit_code").cloned().unwrap_or(Value::Null);
                    let is_error = status == "failed"
                        || status == "declined"
                        || exit_code.as_i64().is_some_and(|c| c != 0);
                    out.push(StreamPart::ToolResult {
                        tool_call_id: id,
                        tool_name: SHELL_TOOL_NAME.into(),
                        output: json!({
                            "aggregated_output": item.get("aggregated_output").cloned().unwrap_or(Value::Null),
                            "exit_code": exit_code,
                        }),
                        is_error,
                    });
                }
            }
            Some("file_change") => {
                let changes = item.get("changes").cloned().unwrap_or(Value::Null);
                self.tool_call(&id, PATCH_TOOL_NAME, json!({ "changes": changes }), out);
                if completed {
                    let failed = status == "failed";
                    out.push(StreamPart::ToolResult {
                        tool_call_id: id,
                        tool_name: PATCH_TOOL_NAME.into(),
                        output: json!({ "status": status }),
                        is_error: failed,
                    });
                    if !failed {
                        for change in changes.as_array().into_iter().flatten() {
                            match file_change(change) {
                                Some(part) => out.push(part),
                                None => out.push(raw(change.clone())),
                            }
                        }
                    }
                }
            }
            Some("mcp_tool_call") => {
                let name = match (str_of(item, "server"), str_of(item, "tool")) {
                    (Some(s), Some(t)) => format!("mcp__{s}__{t}"),
                    (None, Some(t)) => t.to_string(),
                    _ => "mcp_tool_call".to_string(),
                };
                let input = item.get("arguments").cloned().unwrap_or(Value::Null);
                self.tool_call(&id, &name, input, out);
                if completed {
                    let error = item.get("error").filter(|e| !e.is_null()).cloned();
                    out.push(StreamPart::ToolResult {
                        tool_call_id: id,
                        tool_name: name,
                        is_error: error.is_some() || status == "failed",
                        output: error
                            .or_else(|| item.get("result").cloned())
                            .unwrap_or(Value::Null),
                    });
                }
            }
            Some("web_search") => {
                let query = item.get("query").cloned().unwrap_or(Value::Null);
                self.tool_call(&id, "web_search", json!({ "query": query }), out);
                if completed {
                    out.push(StreamPart::ToolResult {
                        tool_call_id: id,
                        tool_name: "web_search".into(),
                        output: item.clone(),
                        is_error: false,
                    });
                }
            }
            Some("error")
                if str_of(item, "message").is_some_and(|m| m.starts_with(HOOK_TRUST_NOTICE)) =>
            {
                if completed || phase == "item.started" {
                    out.push(raw(event.clone()));
                }
            }
            Some("error") => {
                if completed || phase == "item.started" {
                    out.push(StreamPart::Error {
                        message: str_of(item, "message")
                            .unwrap_or("codex error item")
                            .to_string(),
                    });
                }
            }
            _ => out.push(raw(event.clone())),
        }
    }
}

/// One entry of a `file_change` item: `{path, kind}` with `kind` either a
/// string (`add`/`delete`/`update`) or an object `{type: …}`.
fn file_change(change: &Value) -> Option<StreamPart> {
    let path = str_of(change, "path")?;
    let kind = change.get("kind")?;
    let kind = kind.as_str().or_else(|| str_of(kind, "type"))?;
    let kind = match kind {
        "add" | "create" => FileChangeKind::Create,
        "delete" | "remove" => FileChangeKind::Delete,
        "update" | "modify" => FileChangeKind::Modify,
        _ => return None,
    };
    Some(StreamPart::FileChange {
        kind,
        path: path.to_string(),
    })
}

fn usage_from(v: &Value) -> Usage {
    let n = |k: &str| v.get(k).and_then(Value::as_u64);
    Usage {
        input_tokens: n("input_tokens").unwrap_or(0),
        output_tokens: n("output_tokens").unwrap_or(0),
        cached_input_tokens: n("cached_input_tokens"),
        reasoning_tokens: n("reasoning_output_tokens"),
    }
}

impl OutputParser for CodexParser {
    fn push_line(&mut self, line: &str) -> Vec<StreamPart> {
        let line = line.trim_end_matches('\r');
        if line.trim().is_empty() {
            return Vec::new();
        }
        let v: Value = match serde_json::from_str(line) {
            Ok(v @ Value::Object(_)) => v,
            Ok(other) => return vec![raw(other)],
            Err(_) => return vec![raw(json!({ "line": line }))],
        };
        let mut out = Vec::new();
        match str_of(&v, "type") {
            Some("thread.started") => {
                if let Some(id) = str_of(&v, "thread_id") {
                    self.thread_id = Some(id.to_string());
                }
                self.start(&mut out);
            }
            Some("turn.started") => self.start(&mut out),
            Some(phase @ ("item.started" | "item.updated" | "item.completed")) => {
                self.start(&mut out);
                self.on_item(phase, &v, &mut out);
            }
            Some("turn.completed") => {
                self.start(&mut out);
                self.close_all(&mut out);
                out.push(StreamPart::Finish {
                    finish_reason: "stop".into(),
                    usage: v.get("usage").map(usage_from).unwrap_or_default(),
                });
            }
            Some("turn.failed") => {
                self.start(&mut out);
                self.close_all(&mut out);
                let message = v
                    .get("error")
                    .and_then(|e| str_of(e, "message"))
                    .unwrap_or("codex turn failed")
                    .to_string();
                out.push(StreamPart::Error { message });
                out.push(StreamPart::Finish {
                    finish_reason: "error".into(),
                    usage: v.get("usage").map(usage_from).unwrap_or_default(),
                });
            }
            Some("error") if str_of(&v, "message").is_some_and(|m| m.starts_with(RECONNECTING)) => {
                self.start(&mut out);
                self.reconnects += 1;
                let message = str_of(&v, "message").unwrap_or_default();
                let (attempt, max_attempts) = match reconnect_attempt(message) {
                    Some((n, m)) => (n, Some(m)),
                    None => (self.reconnects, None),
                };
                out.push(StreamPart::Warning {
                    code: WARNING_MODEL_RETRY.into(),
                    message: message.to_string(),
                    attempt: Some(attempt),
                    max_attempts,
                });
            }
            Some("error") => {
                self.start(&mut out);
                out.push(StreamPart::Error {
                    message: str_of(&v, "message").unwrap_or("codex error").to_string(),
                });
            }
            _ => out.push(raw(v)),
        }
        out
    }

    fn agent_session_id(&self) -> Option<String> {
        self.thread_id.clone()
    }

    fn in_block(&self) -> bool {
        !self.open.is_empty()
    }
}

impl CodexParser {
    /// Close blocks a finished turn left open, so every start has an end.
    fn close_all(&mut self, out: &mut Vec<StreamPart>) {
        let mut ids: Vec<String> = self.open.keys().cloned().collect();
        ids.sort();
        for id in ids {
            self.text_end(&id, out);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_all(text: &str) -> (CodexParser, Vec<StreamPart>) {
        let mut p = CodexParser::new();
        let mut parts = Vec::new();
        for line in text.lines() {
            parts.extend(p.push_line(line));
        }
        (p, parts)
    }

    fn types(parts: &[StreamPart]) -> Vec<&'static str> {
        parts.iter().map(StreamPart::type_name).collect()
    }

    #[test]
    fn shell_turn_from_the_reference() {
        let (p, parts) = parse_all(include_str!(
            "../tests/fixtures/agent-clis-shell-turn.jsonl"
        ));
        assert_eq!(
            p.agent_session_id().as_deref(),
            Some("01a22892-d5c6-7bf2-9df7-7ba6184dbfc2")
        );
        assert_eq!(
            types(&parts),
            [
                "stream-start",
                "error",
                "tool-call",
                "tool-result",
                "text-start",
                "text-delta",
                "text-end",
                "finish"
            ]
        );
        assert_eq!(
            parts[0],
            StreamPart::StreamStart {
                agent_session_id: Some("01a22892-d5c6-7bf2-9df7-7ba6184dbfc2".into())
            }
        );
        assert_eq!(
            parts[2],
            StreamPart::ToolCall {
                tool_call_id: "item_1".into(),
                tool_name: SHELL_TOOL_NAME.into(),
                input: json!({"command": "/bin/bash -lc 'echo hello > hi.txt && cat hi.txt'"}),
            }
        );
        assert_eq!(
            parts[3],
            StreamPart::ToolResult {
                tool_call_id: "item_1".into(),
                tool_name: SHELL_TOOL_NAME.into(),
                output: json!({"aggregated_output": "hello\n", "exit_code": 0}),
                is_error: false,
            }
        );
        assert_eq!(
            parts[5],
            StreamPart::TextDelta {
                id: "item_2".into(),
                delta: "done".into()
            }
        );
        assert_eq!(
            parts[7],
            StreamPart::Finish {
                finish_reason: "stop".into(),
                usage: Usage {
                    input_tokens: 20,
                    output_tokens: 10,
                    cached_input_tokens: Some(0),
                    reasoning_tokens: Some(0)
                }
            }
        );
        assert!(!p.in_block());
    }

    #[test]
    fn captured_turn_with_reasoning() {
        let (_, parts) = parse_all(include_str!("../tests/fixtures/tool-turn.jsonl"));
        assert!(parts.contains(&StreamPart::ReasoningDelta {
            id: "item_1".into(),
            delta: "Let me think hard".into()
        }));
        assert!(parts.contains(&StreamPart::ReasoningEnd {
            id: "item_1".into()
        }));
        let text: String = parts
            .iter()
            .filter_map(|p| match p {
                StreamPart::TextDelta { delta, .. } => Some(delta.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(text, "I will create the file.All done now.");
        assert!(!types(&parts).contains(&"raw"));
    }

    #[test]
    fn streamed_item_updates_become_deltas() {
        let mut p = CodexParser::new();
        let a = p.push_line(
            r#"{"type":"item.started","item":{"id":"i1","type":"agent_message","text":""}}"#,
        );
        assert_eq!(
            a,
            [
                StreamPart::StreamStart {
                    agent_session_id: None
                },
                StreamPart::TextStart { id: "i1".into() }
            ]
        );
        assert!(p.in_block());
        let b = p.push_line(
            r#"{"type":"item.updated","item":{"id":"i1","type":"agent_message","text":"Hel"}}"#,
        );
        assert_eq!(
            b,
            [StreamPart::TextDelta {
                id: "i1".into(),
                delta: "Hel".into()
            }]
        );
        let c = p.push_line(
            r#"{"type":"item.completed","item":{"id":"i1","type":"agent_message","text":"Hello"}}"#,
        );
        assert_eq!(
            c,
            [
                StreamPart::TextDelta {
                    id: "i1".into(),
                    delta: "lo".into()
                },
                StreamPart::TextEnd { id: "i1".into() }
            ]
        );
        assert!(!p.in_block());
        // A repeated completion is not reported twice.
        assert!(p
            .push_line(r#"{"type":"item.completed","item":{"id":"i1","type":"agent_message","text":"Hello"}}"#)
            .is_empty());
    }

    #[test]
    fn file_changes_and_failed_commands() {
        let mut p = CodexParser::new();
        let parts = p.push_line(r#"{"type":"item.completed","item":{"id":"p1","type":"file_change","changes":[{"path":"/w/new.txt","kind":"add"},{"path":"/w/old.txt","kind":"delete"},{"path":"/w/x.rs","kind":{"type":"update","move_path":null}}],"status":"completed"}}"#);
        let changes: Vec<_> = parts
            .iter()
            .filter_map(|p| match p {
                StreamPart::FileChange { kind, path } => Some((*kind, path.as_str())),
                _ => None,
            })
            .collect();
        assert_eq!(
            changes,
            [
                (FileChangeKind::Create, "/w/new.txt"),
                (FileChangeKind::Delete, "/w/old.txt"),
                (FileChangeKind::Modify, "/w/x.rs")
            ]
        );
        assert!(parts.iter().any(
            |x| matches!(x, StreamPart::ToolCall { tool_name, .. } if tool_name == PATCH_TOOL_NAME)
        ));
        let failed = p.push_line(r#"{"type":"item.completed","item":{"id":"p2","type":"file_change","changes":[{"path":"a","kind":"add"}],"status":"failed"}}"#);
        assert!(!failed
            .iter()
            .any(|x| matches!(x, StreamPart::FileChange { .. })));
        let cmd = p.push_line(r#"{"type":"item.completed","item":{"id":"c1","type":"command_execution","command":"false","aggregated_output":"","exit_code":1,"status":"failed"}}"#);
        assert!(
            matches!(&cmd[0], StreamPart::ToolCall { .. }),
            "call reported even without item.started"
        );
        assert!(matches!(
            &cmd[1],
            StreamPart::ToolResult { is_error: true, .. }
        ));
    }

    #[test]
    fn turn_failed_gives_error_and_finish_error() {
        let mut p = CodexParser::new();
        p.push_line(r#"{"type":"thread.started","thread_id":"t"}"#);
        p.push_line(r#"{"type":"item.started","item":{"id":"r","type":"reasoning","text":"hm"}}"#);
        assert!(p.in_block());
        let parts =
            p.push_line(r#"{"type":"turn.failed","error":{"message":"stream disconnected"}}"#);
        assert_eq!(
            parts,
            [
                StreamPart::ReasoningEnd { id: "r".into() },
                StreamPart::Error {
                    message: "stream disconnected".into()
                },
                StreamPart::Finish {
                    finish_reason: "error".into(),
                    usage: Usage::default()
                }
            ]
        );
        assert!(!p.in_block());
        assert_eq!(
            p.push_line(r#"{"type":"error","message":"reconnecting"}"#),
            [StreamPart::Error {
                message: "reconnecting".into()
            }]
        );
    }

    #[test]
    fn reconnect_notices_become_model_retry_warnings() {
        let mut p = CodexParser::new();
        p.push_line(r#"{"type":"thread.started","thread_id":"t"}"#);
        p.push_line(r#"{"type":"turn.started"}"#);
        let dead = r#"{"type":"error","message":"Reconnecting... waiting for network (Connection failed: error sending request)"}"#;
        for n in 1..=2 {
            let parts = p.push_line(dead);
            assert_eq!(
                parts,
                [StreamPart::Warning {
                    code: "model-retry".into(),
                    message: "Reconnecting... waiting for network (Connection failed: error sending request)".into(),
                    attempt: Some(n),
                    max_attempts: None,
                }]
            );
        }
        let counted = p.push_line(
            r#"{"type":"error","message":"Reconnecting... 2/5 (stream disconnected before completion)"}"#,
        );
        assert!(matches!(
            &counted[0],
            StreamPart::Warning {
                attempt: Some(2),
                max_attempts: Some(5),
                ..
            }
        ));
    }

    #[test]
    fn malformed_and_unknown_lines_become_raw_and_never_panic() {
        let mut p = CodexParser::new();
        for line in [
            "Reading additional input from stdin...",
            "{\"type\":",
            "[]",
            "\"str\"",
            r#"{"type":"brand.new"}"#,
            r#"{"type":"item.completed"}"#,
            r#"{"type":"item.completed","item":{"type":"agent_message"}}"#,
            r#"{"type":"item.completed","item":{"id":"z","type":"todo_list","items":[]}}"#,
            r#"{"nothing":1}"#,
        ] {
            let parts = p.push_line(line);
            assert!(
                parts.iter().any(|x| matches!(x, StreamPart::Raw { .. })),
                "{line} -> {parts:?}"
            );
        }
        assert!(p.push_line("   ").is_empty());
        assert!(!p.in_block());
    }

    #[test]
    fn a_call_the_approval_hook_blocked_leaves_no_item_and_the_trust_notice_is_raw() {
        // Observed with 0.171.0: `--dangerously-bypass-hook-trust` and a
        // PreToolUse hook that denied the model's exec_command call. Codex
        // prints the flag's notice twice as `error` items and nothing at
        // all for the blocked call (no command_execution item); the model
        // got the hook's reason as the call's output and answered.
        let (_, parts) = parse_all(include_str!(
            "../tests/fixtures/approval-hook-denied-turn.jsonl"
        ));
        assert_eq!(
            types(&parts),
            [
                "stream-start",
                "raw",
                "raw",
                "error",
                "text-start",
                "text-delta",
                "text-end",
                "finish"
            ]
        );
        assert!(
            matches!(&parts[3], StreamPart::Error { message } if message.starts_with("Model metadata"))
        );
        assert!(!parts.iter().any(
            |p| matches!(p, StreamPart::Error { message } if message.contains(HOOK_TRUST_NOTICE))
        ));
    }
}
