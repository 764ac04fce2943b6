//! Claude Code `--output-format stream-json` → [`StreamPart`]s.
//!
//! With `--include-partial-messages` Claude Code prints every SSE event of
//! the model's answer as a `stream_event` line AND, per content block, a
//! whole `assistant` line (observed: right before that block's
//! `content_block_stop`). Text and thinking are taken from the stream events
//! (so they arrive live); tool calls are taken from the whole `assistant`
//! lines (their input is complete there). A message whose stream events were
//! seen never emits its text again from the `assistant` line; a message
//! without stream events (partial messages off, or an older CLI) emits its
//! text from the `assistant` line as one start/delta/end.

use std::collections::{HashMap, HashSet};

use harness_core::harness::OutputParser;
use harness_core::part::{FileChangeKind, StreamPart, Usage, WARNING_MODEL_RETRY};
use serde_json::Value;

/// Parser state for one turn of Claude Code output.
#[derive(Debug, Default)]
pub struct ClaudeCodeParser {
    session_id: Option<String>,
    started: bool,
    /// The working directory from `system/init`, to make paths relative.
    cwd: Option<String>,
    /// Message id of the model answer being streamed.
    current_message: Option<String>,
    /// Messages whose content arrived through stream events.
    streamed_messages: HashSet<String>,
    /// Open streamed blocks: index → (part id, is reasoning).
    open: HashMap<u64, (String, bool)>,
    /// Tool calls seen: id → (native name, input).
    tools: HashMap<String, (String, Value)>,
    /// Usage of the model step being streamed (input from `message_start`).
    step_usage: Usage,
    /// Counter for ids when a message has no id.
    anon: u64,
}

/// A `system/api_retry` line as a [`StreamPart::Warning`].
fn api_retry_warning(v: &Value) -> StreamPart {
    let attempt = v.get("attempt").and_then(Value::as_u64).map(|n| n as u32);
    let max_attempts = v
        .get("max_retries")
        .and_then(Value::as_u64)
        .map(|n| n as u32);
    let error = v.get("error").and_then(Value::as_str).unwrap_or("unknown");
    let mut message = match v.get("error_status").and_then(Value::as_u64) {
        Some(status) => format!("the model request failed (HTTP {status}, {error})"),
        None => format!("the model request failed ({error}: no HTTP response)"),
    };
    if let Some(ms) = v.get("retry_delay_ms").and_then(Value::as_u64) {
        message.push_str(&format!("; retrying in {:.1} s", ms as f64 / 1000.0));
    }
    StreamPart::Warning {
        code: WARNING_MODEL_RETRY.into(),
        message,
        attempt,
        max_attempts,
    }
}

fn raw(value: Value) -> StreamPart {
    StreamPart::Raw { value }
}

fn u(v: &Value, key: &str) -> u64 {
    v.get(key).and_then(Value::as_u64).unwrap_or(0)
}

fn usage_from(v: &Value) -> Usage {
    let cached = v.get("cache_read_input_tokens").and_then(Value::as_u64);
    let reasoning = v
        .get("output_tokens_details")
        .and_then(|d| d.get("thinking_tokens"))
        .and_then(Value::as_u64);
    Usage {
        input_tokens: u(v, "input_tokens"),
        output_tokens: u(v, "output_tokens"),
        cached_input_tokens: cached,
        reasoning_tokens: reasoning,
    }
}

/// The text of a `tool_result` content: a string, or text blocks joined.
fn result_text(content: &Value) -> Option<String> {
    match content {
        Value::String(s) => Some(s.clone()),
        Value::Array(items) => Some(
            items
                .iter()
                .filter_map(|b| b.get("text").and_then(Value::as_str))
                .collect::<Vec<_>>()
                .join("\n"),
        ),
        _ => None,
    }
}

impl ClaudeCodeParser {
    /// A parser for a fresh turn.
    pub fn new() -> Self {
        Self::default()
    }

    fn relative(&self, path: &str) -> String {
        if let Some(cwd) = &self.cwd {
            let cwd = cwd.trim_end_matches('/');
            if let Some(rest) = path.strip_prefix(cwd).and_then(|r| r.strip_prefix('/')) {
                if !rest.is_empty() {
                    return rest.to_string();
                }
            }
        }
        path.to_string()
    }

    fn start(&mut self, out: &mut Vec<StreamPart>) {
        if !self.started {
            self.started = true;
            out.push(StreamPart::StreamStart {
                agent_session_id: self.session_id.clone(),
            });
        }
    }

    fn note_session(&mut self, v: &Value) {
        if self.session_id.is_none() {
            if let Some(id) = v.get("session_id").and_then(Value::as_str) {
                self.session_id = Some(id.to_string());
            }
        }
    }

    fn message_id(&mut self, v: &Value) -> String {
        v.get("api_message_id")
            .and_then(Value::as_str)
            .map(str::to_string)
            .or_else(|| self.current_message.clone())
            .unwrap_or_else(|| {
                self.anon += 1;
                format!("anon{}", self.anon)
            })
    }

    fn on_system(&mut self, v: &Value, out: &mut Vec<StreamPart>) {
        match v.get("subtype").and_then(Value::as_str) {
            Some("init") => {
                if let Some(id) = v.get("session_id").and_then(Value::as_str) {
                    self.session_id = Some(id.to_string());
                }
                if let Some(cwd) = v.get("cwd").and_then(Value::as_str) {
                    self.cwd = Some(cwd.to_string());
                }
                self.start(out);
            }
            // Progress noise: nothing a client needs.
            Some("status") | Some("thinking_tokens") => {}
            // A request to the model failed and Claude Code retries it
            // (observed: `{"subtype":"api_retry","attempt":3,"max_retries":10,
            // "retry_delay_ms":2428,"error_status":null,"error":"unknown"}`
            // when nothing listens at ANTHROPIC_BASE_URL).
            Some("api_retry") => {
                self.start(out);
                out.push(api_retry_warning(v));
            }
            Some("compact_boundary") => out.push(StreamPart::Compaction {
                details: v.get("compact_metadata").cloned().unwrap_or(Value::Null),
            }),
            _ => out.push(raw(v.clone())),
        }
    }

    fn on_stream_event(&mut self, v: &Value, out: &mut Vec<StreamPart>) {
        let Some(event) = v.get("event") else {
            out.push(raw(v.clone()));
            return;
        };
        let index = event.get("index").and_then(Value::as_u64);
        match event.get("type").and_then(Value::as_str) {
            Some("message_start") => {
                let msg = event.get("message").cloned().unwrap_or(Value::Null);
                let id = msg
                    .get("id")
                    .and_then(Value::as_str)
                    .map(str::to_string)
                    .unwrap_or_else(|| {
                        self.anon += 1;
                        format!("anon{}", self.anon)
                    });
                self.streamed_messages.insert(id.clone());
                self.current_message = Some(id);
                self.step_usage = msg.get("usage").map(usage_from).unwrap_or_default();
            }
            Some("content_block_start") => {
                let block = event.get("content_block").cloned().unwrap_or(Value::Null);
                let msg = self.message_id(v);
                self.streamed_messages.insert(msg.clone());
                let Some(index) = index else {
                    out.push(raw(v.clone()));
                    return;
                };
                let id = format!("{msg}:{index}");
                match block.get("type").and_then(Value::as_str) {
                    Some("text") => {
                        out.push(StreamPart::TextStart { id: id.clone() });
                        // A start block may already carry text.
                        if let Some(t) = block.get("text").and_then(Value::as_str) {
                            if !t.is_empty() {
                                out.push(StreamPart::TextDelta {
                                    id: id.clone(),
                                    delta: t.to_string(),
                                });
                            }
                        }
                        self.open.insert(index, (id, false));
                    }
                    Some("thinking") | Some("redacted_thinking") => {
                        out.push(StreamPart::ReasoningStart { id: id.clone() });
                        if let Some(t) = block.get("thinking").and_then(Value::as_str) {
                            if !t.is_empty() {
                                out.push(StreamPart::ReasoningDelta {
                                    id: id.clone(),
                                    delta: t.to_string(),
                                });
                            }
                        }
                        self.open.insert(index, (id, true));
                    }
                    // Tool calls are reported from the whole `assistant` line.
                    Some("tool_use") | Some("server_tool_use") => {}
                    _ => out.push(raw(v.clone())),
                }
            }
            Some("content_block_delta") => {
                let delta = event.get("delta").cloned().unwrap_or(Value::Null);
                let open = index.and_then(|i| self.open.get(&i)).cloned();
                match (delta.get("type").and_then(Value::as_str), open) {
                    (Some("text_delta"), Some((id, false))) => {
                        if let Some(t) = delta.get("text").and_then(Value::as_str) {
                            out.push(StreamPart::TextDelta {
                                id,
                                delta: t.to_string(),
                            });
                        }
                    }
                    (Some("thinking_delta"), Some((id, true))) => {
                        if let Some(t) = delta.get("thinking").and_then(Value::as_str) {
                            out.push(StreamPart::ReasoningDelta {
                                id,
                                delta: t.to_string(),
                            });
                        }
                    }
                    // Tool input fragments and thinking signatures: the whole
                    // values arrive in the `assistant` line.
                    (Some("input_json_delta"), _) | (Some("signature_delta"), _) => {}
                    _ => out.push(raw(v.clone())),
                }
            }
            Some("content_block_stop") => {
                if let Some((id, reasoning)) = index.and_then(|i| self.open.remove(&i)) {
                    out.push(if reasoning {
                        StreamPart::ReasoningEnd { id }
                    } else {
                        StreamPart::TextEnd { id }
                    });
                }
            }
            Some("message_delta") => {
                if let Some(usage) = event.get("usage") {
                    if let Some(o) = usage.get("output_tokens").and_then(Value::as_u64) {
                        self.step_usage.output_tokens = o;
                    }
                }
            }
            Some("message_stop") => {
                // Blocks left open by a truncated stream are closed here so
                // every start has its end.
                let mut left: Vec<_> = self.open.drain().collect();
                left.sort_by_key(|(i, _)| *i);
                for (_, (id, reasoning)) in left {
                    out.push(if reasoning {
                        StreamPart::ReasoningEnd { id }
                    } else {
                        StreamPart::TextEnd { id }
                    });
                }
                out.push(StreamPart::FinishStep {
                    usage: Some(std::mem::take(&mut self.step_usage)),
                });
            }
            Some("ping") => {}
            _ => out.push(raw(v.clone())),
        }
    }

    fn on_assistant(&mut self, v: &Value, out: &mut Vec<StreamPart>) {
        let Some(message) = v.get("message") else {
            out.push(raw(v.clone()));
            return;
        };
        let msg_id = message
            .get("id")
            .and_then(Value::as_str)
            .map(str::to_string);
        let streamed = msg_id
            .as_ref()
            .is_some_and(|id| self.streamed_messages.contains(id));
        let Some(blocks) = message.get("content").and_then(Value::as_array) else {
            out.push(raw(v.clone()));
            return;
        };
        for block in blocks {
            match block.get("type").and_then(Value::as_str) {
                Some("text") if !streamed => {
                    self.anon += 1;
                    let id = format!("{}:w{}", msg_id.as_deref().unwrap_or("msg"), self.anon);
                    let text = block.get("text").and_then(Value::as_str).unwrap_or("");
                    out.push(StreamPart::TextStart { id: id.clone() });
                    out.push(StreamPart::TextDelta {
                        id: id.clone(),
                        delta: text.to_string(),
                    });
                    out.push(StreamPart::TextEnd { id });
                }
                Some("thinking") if !streamed => {
                    self.anon += 1;
                    let id = format!("{}:w{}", msg_id.as_deref().unwrap_or("msg"), self.anon);
                    let text = block.get("thinking").and_then(Value::as_str).unwrap_or("");
                    out.push(StreamPart::ReasoningStart { id: id.clone() });
                    out.push(StreamPart::ReasoningDelta {
                        id: id.clone(),
                        delta: text.to_string(),
                    });
                    out.push(StreamPart::ReasoningEnd { id });
                }
                Some("text") | Some("thinking") | Some("redacted_thinking") => {}
                Some("tool_use") | Some("server_tool_use") => {
                    let id = block
                        .get("id")
                        .and_then(Value::as_str)
                        .unwrap_or("")
                        .to_string();
                    let name = block
                        .get("name")
                        .and_then(Value::as_str)
                        .unwrap_or("")
                        .to_string();
                    let input = block.get("input").cloned().unwrap_or(Value::Null);
                    if id.is_empty() || self.tools.contains_key(&id) {
                        // No id, or the same call repeated: report as is, once.
                        if id.is_empty() {
                            out.push(raw(block.clone()));
                        }
                        continue;
                    }
                    self.tools.insert(id.clone(), (name.clone(), input.clone()));
                    out.push(StreamPart::ToolCall {
                        tool_call_id: id,
                        tool_name: name,
                        input,
                    });
                }
                _ => out.push(raw(block.clone())),
            }
        }
    }

    fn on_user(&mut self, v: &Value, out: &mut Vec<StreamPart>) {
        let blocks = v
            .get("message")
            .and_then(|m| m.get("content"))
            .and_then(Value::as_array);
        let Some(blocks) = blocks else {
            // A plain user text (e.g. a replayed prompt): not a stream part.
            if v.get("message").is_none() {
                out.push(raw(v.clone()));
            }
            return;
        };
        for block in blocks {
            if block.get("type").and_then(Value::as_str) != Some("tool_result") {
                continue;
            }
            let id = block
                .get("tool_use_id")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string();
            let is_error = block
                .get("is_error")
                .and_then(Value::as_bool)
                .unwrap_or(false);
            let (name, input) = self
                .tools
                .get(&id)
                .cloned()
                .unwrap_or_else(|| (String::new(), Value::Null));
            let content = block.get("content").cloned().unwrap_or(Value::Null);
            let output = match result_text(&content) {
                Some(text) => Value::String(text),
                None => content,
            };
            out.push(StreamPart::ToolResult {
                tool_call_id: id,
                tool_name: name.clone(),
                output,
                is_error,
            });
            if !is_error {
                if let Some(change) = self.file_change(&name, &input, v.get("tool_use_result")) {
                    out.push(change);
                }
            }
        }
    }

    /// A file-editing tool's successful result becomes a `file-change`.
    /// Kind: the CLI's own `tool_use_result.type` (`create`/`update`) when
    /// present, else `Write` → create and the edit tools → modify.
    fn file_change(&self, name: &str, input: &Value, meta: Option<&Value>) -> Option<StreamPart> {
        let default_kind = match name {
            "Write" => FileChangeKind::Create,
            "Edit" | "MultiEdit" | "NotebookEdit" => FileChangeKind::Modify,
            _ => return None,
        };
        let path = input
            .get("file_path")
            .or_else(|| input.get("notebook_path"))
            .and_then(Value::as_str)
            .or_else(|| meta.and_then(|m| m.get("filePath")).and_then(Value::as_str))?;
        let kind = match meta.and_then(|m| m.get("type")).and_then(Value::as_str) {
            Some("create") => FileChangeKind::Create,
            Some("update") => FileChangeKind::Modify,
            _ => default_kind,
        };
        Some(StreamPart::FileChange {
            kind,
            path: self.relative(path),
        })
    }

    fn on_result(&mut self, v: &Value, out: &mut Vec<StreamPart>) {
        let is_error = v.get("is_error").and_then(Value::as_bool).unwrap_or(false);
        let subtype = v.get("subtype").and_then(Value::as_str).unwrap_or("");
        let usage = v.get("usage").map(usage_from).unwrap_or_default();
        if is_error || subtype != "success" {
            let message = v
                .get("result")
                .and_then(Value::as_str)
                .map(str::to_string)
                .or_else(|| {
                    v.get("errors").and_then(Value::as_array).map(|e| {
                        e.iter()
                            .map(|x| x.as_str().map(str::to_string).unwrap_or(x.to_string()))
                            .collect::<Vec<_>>()
                            .join("; ")
                    })
                })
                .filter(|m| !m.is_empty())
                .unwrap_or_else(|| format!("claude reported {subtype:?}"));
            out.push(StreamPart::Error { message });
            out.push(StreamPart::Finish {
                finish_reason: "error".into(),
                usage,
            });
        } else {
            out.push(StreamPart::Finish {
                finish_reason: "stop".into(),
                usage,
            });
        }
    }
}

impl OutputParser for ClaudeCodeParser {
    fn push_line(&mut self, line: &str) -> Vec<StreamPart> {
        let line = line.trim_end_matches('\r');
        if line.trim().is_empty() {
            return Vec::new();
        }
        let v: Value = match serde_json::from_str(line) {
            Ok(v @ Value::Object(_)) => v,
            Ok(other) => return vec![raw(other)],
            Err(_) => return vec![raw(serde_json::json!({ "line": line }))],
        };
        self.note_session(&v);
        let mut out = Vec::new();
        match v.get("type").and_then(Value::as_str) {
            Some("system") => self.on_system(&v, &mut out),
            Some("stream_event") => {
                self.start(&mut out);
                self.on_stream_event(&v, &mut out)
            }
            Some("assistant") => {
                self.start(&mut out);
                self.on_assistant(&v, &mut out)
            }
            Some("user") => {
                self.start(&mut out);
                self.on_user(&v, &mut out)
            }
            Some("result") => {
                self.start(&mut out);
                self.on_result(&v, &mut out)
            }
            _ => out.push(raw(v)),
        }
        out
    }

    fn agent_session_id(&self) -> Option<String> {
        self.session_id.clone()
    }

    fn in_block(&self) -> bool {
        !self.open.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse_all(text: &str) -> (ClaudeCodeParser, Vec<StreamPart>) {
        let mut p = ClaudeCodeParser::new();
        let mut parts = Vec::new();
        for line in text.lines() {
            parts.extend(p.push_line(line));
        }
        (p, parts)
    }

    fn texts(parts: &[StreamPart]) -> String {
        parts
            .iter()
            .filter_map(|p| match p {
                StreamPart::TextDelta { delta, .. } => Some(delta.as_str()),
                _ => None,
            })
            .collect()
    }

    fn types(parts: &[StreamPart]) -> Vec<&'static str> {
        parts.iter().map(StreamPart::type_name).collect()
    }

    #[test]
    fn whole_message_transcript_from_the_reference() {
        let (p, parts) = parse_all(include_str!(
            "../tests/fixtures/agent-clis-whole-messages.jsonl"
        ));
        assert_eq!(
            p.agent_session_id().as_deref(),
            Some("0d1b01ba-b17b-40ef-b34a-7cbf62eb74ea")
        );
        assert_eq!(
            types(&parts),
            [
                "stream-start",
                "text-start",
                "text-delta",
                "text-end",
                "tool-call",
                "tool-result",
                "text-start",
                "text-delta",
                "text-end",
                "finish"
            ]
        );
        assert_eq!(
            texts(&parts),
            "I will create the file.Done: the file says hello."
        );
        assert_eq!(
            parts[4],
            StreamPart::ToolCall {
                tool_call_id: "toolu_01".into(),
                tool_name: "Bash".into(),
                input: json!({"command": "echo hello > hi.txt && cat hi.txt", "description": "write file"}),
            }
        );
        assert_eq!(
            parts[5],
            StreamPart::ToolResult {
                tool_call_id: "toolu_01".into(),
                tool_name: "Bash".into(),
                output: json!("hello"),
                is_error: false,
            }
        );
        assert_eq!(
            parts[9],
            StreamPart::Finish {
                finish_reason: "stop".into(),
                usage: Usage {
                    input_tokens: 20,
                    output_tokens: 25,
                    ..Usage::default()
                }
            }
        );
        assert!(!p.in_block());
    }

    #[test]
    fn partial_messages_are_streamed_once_not_duplicated() {
        let (p, parts) = parse_all(include_str!("../tests/fixtures/partial-tool-turn.jsonl"));
        assert_eq!(
            p.agent_session_id().as_deref(),
            Some("449dfe2e-ed83-4c71-b6ed-2eecda409ee7")
        );
        // Each text appears exactly once although the CLI printed it twice
        // (deltas and the whole `assistant` line).
        assert_eq!(texts(&parts), "I will create the file.All done now.");
        let reasoning: String = parts
            .iter()
            .filter_map(|p| match p {
                StreamPart::ReasoningDelta { delta, .. } => Some(delta.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(reasoning, "Let me think hard");
        // Three deltas for the first text: it really streamed.
        let first_text_deltas = parts
            .iter()
            .filter(|p| matches!(p, StreamPart::TextDelta { id, .. } if id == "msg_1:1"))
            .count();
        assert_eq!(first_text_deltas, 3);
        assert!(parts.contains(&StreamPart::TextStart {
            id: "msg_1:1".into()
        }));
        assert!(parts.contains(&StreamPart::TextEnd {
            id: "msg_1:1".into()
        }));
        let calls: Vec<_> = parts
            .iter()
            .filter_map(|p| match p {
                StreamPart::ToolCall { tool_name, .. } => Some(tool_name.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(calls, ["Bash", "Write"]);
        // The Write result yields a file-change, relative to the init cwd.
        assert!(parts.contains(&StreamPart::FileChange {
            kind: FileChangeKind::Create,
            path: "w.txt".into()
        }));
        let results: Vec<_> = parts
            .iter()
            .filter(|p| matches!(p, StreamPart::ToolResult { .. }))
            .collect();
        assert_eq!(results.len(), 2);
        // Two model steps, then the finish.
        assert_eq!(
            parts
                .iter()
                .filter(|p| matches!(p, StreamPart::FinishStep { .. }))
                .count(),
            2
        );
        match parts.last().unwrap() {
            StreamPart::Finish {
                finish_reason,
                usage,
            } => {
                assert_eq!(finish_reason, "stop");
                assert_eq!(usage.input_tokens, 24860);
                assert_eq!(usage.output_tokens, 33);
            }
            other => panic!("last part {other:?}"),
        }
        // Noise (status, thinking_tokens) is dropped, nothing is raw.
        assert!(!types(&parts).contains(&"raw"), "{parts:#?}");
        // Every start has its end, in order.
        let starts = types(&parts)
            .iter()
            .filter(|t| t.ends_with("-start") && **t != "stream-start")
            .count();
        let ends = types(&parts).iter().filter(|t| t.ends_with("-end")).count();
        assert_eq!(starts, ends);
    }

    #[test]
    fn in_block_is_true_between_start_and_stop() {
        let text = include_str!("../tests/fixtures/partial-tool-turn.jsonl");
        let mut p = ClaudeCodeParser::new();
        let mut seen_open = false;
        for line in text.lines() {
            let parts = p.push_line(line);
            if parts
                .iter()
                .any(|x| matches!(x, StreamPart::TextStart { .. }))
            {
                assert!(p.in_block());
                seen_open = true;
            }
            if parts
                .iter()
                .any(|x| matches!(x, StreamPart::TextEnd { .. }))
            {
                assert!(!p.in_block());
            }
        }
        assert!(seen_open);
        assert!(!p.in_block());
    }

    #[test]
    fn error_result_gives_error_and_finish_error() {
        let mut p = ClaudeCodeParser::new();
        let parts = p.push_line(
            r#"{"type":"result","subtype":"error_during_execution","is_error":true,"session_id":"s","usage":{"input_tokens":1,"output_tokens":2},"result":"API Error: 500"}"#,
        );
        assert_eq!(
            parts,
            [
                StreamPart::StreamStart {
                    agent_session_id: Some("s".into())
                },
                StreamPart::Error {
                    message: "API Error: 500".into()
                },
                StreamPart::Finish {
                    finish_reason: "error".into(),
                    usage: Usage {
                        input_tokens: 1,
                        output_tokens: 2,
                        ..Usage::default()
                    }
                }
            ]
        );
    }

    #[test]
    fn failed_edit_gives_no_file_change() {
        let mut p = ClaudeCodeParser::new();
        p.push_line(r#"{"type":"system","subtype":"init","session_id":"s","cwd":"/w"}"#);
        let call = p.push_line(r#"{"type":"assistant","message":{"id":"m","content":[{"type":"tool_use","id":"t1","name":"Edit","input":{"file_path":"/w/a.rs","old_string":"x","new_string":"y"}}]}}"#);
        assert!(matches!(&call[0], StreamPart::ToolCall { tool_name, .. } if tool_name == "Edit"));
        let failed = p.push_line(r#"{"type":"user","message":{"content":[{"type":"tool_result","tool_use_id":"t1","content":"no match","is_error":true}]}}"#);
        assert_eq!(failed.len(), 1);
        assert!(
            matches!(&failed[0], StreamPart::ToolResult { is_error: true, tool_name, .. } if tool_name == "Edit")
        );
        p.push_line(r#"{"type":"assistant","message":{"id":"m2","content":[{"type":"tool_use","id":"t2","name":"Edit","input":{"file_path":"/w/a.rs"}}]}}"#);
        let ok = p.push_line(r#"{"type":"user","message":{"content":[{"type":"tool_result","tool_use_id":"t2","content":[{"type":"text","text":"ok"}]}]}}"#);
        assert_eq!(
            ok[1],
            StreamPart::FileChange {
                kind: FileChangeKind::Modify,
                path: "a.rs".into()
            }
        );
        assert!(matches!(&ok[0], StreamPart::ToolResult { output, .. } if output == "ok"));
    }

    #[test]
    fn api_retries_become_model_retry_warnings() {
        let mut p = ClaudeCodeParser::new();
        p.push_line(r#"{"type":"system","subtype":"init","session_id":"s","cwd":"/w"}"#);
        let parts = p.push_line(r#"{"type":"system","subtype":"api_retry","attempt":3,"max_retries":10,"retry_delay_ms":2428,"error_status":null,"error":"unknown","session_id":"s"}"#);
        assert_eq!(
            parts,
            [StreamPart::Warning {
                code: "model-retry".into(),
                message: "the model request failed (unknown: no HTTP response); retrying in 2.4 s"
                    .into(),
                attempt: Some(3),
                max_attempts: Some(10),
            }]
        );
        assert!(!parts[0].is_progress());
        let http = p.push_line(r#"{"type":"system","subtype":"api_retry","attempt":1,"max_retries":10,"retry_delay_ms":500,"error_status":529,"error":"overloaded"}"#);
        assert!(
            matches!(&http[0], StreamPart::Warning { message, .. } if message.contains("HTTP 529, overloaded"))
        );
    }

    #[test]
    fn malformed_and_unknown_lines_become_raw_and_never_panic() {
        let mut p = ClaudeCodeParser::new();
        let cases = [
            "not json at all",
            "{\"type\": ",
            "[1,2,3]",
            "42",
            r#"{"type":"mystery","x":1}"#,
            r#"{"no_type":true}"#,
            r#"{"type":"stream_event"}"#,
            r#"{"type":"stream_event","event":{"type":"content_block_start"}}"#,
            r#"{"type":"stream_event","event":{"type":"content_block_delta","index":7,"delta":{"type":"text_delta","text":"orphan"}}}"#,
            r#"{"type":"assistant"}"#,
            r#"{"type":"assistant","message":{"content":"str"}}"#,
            r#"{"type":"user"}"#,
            r#"{"type":"system","subtype":"brand_new"}"#,
        ];
        for line in cases {
            let parts = p.push_line(line);
            assert!(
                parts.iter().any(|x| matches!(x, StreamPart::Raw { .. })),
                "{line} -> {parts:?}"
            );
        }
        assert_eq!(
            p.push_line("garbage"),
            [StreamPart::Raw {
                value: json!({"line": "garbage"})
            }]
        );
        assert!(p.push_line("").is_empty());
        assert!(!p.in_block());
    }

    #[test]
    fn truncated_stream_keeps_block_open_until_message_stop() {
        let mut p = ClaudeCodeParser::new();
        p.push_line(r#"{"type":"stream_event","event":{"type":"message_start","message":{"id":"m1","usage":{"input_tokens":5}}}}"#);
        let s = p.push_line(r#"{"type":"stream_event","event":{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}}"#);
        assert!(s.contains(&StreamPart::TextStart { id: "m1:0".into() }));
        assert!(p.in_block());
        let d = p.push_line(r#"{"type":"stream_event","event":{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"par"}}}"#);
        assert_eq!(
            d,
            [StreamPart::TextDelta {
                id: "m1:0".into(),
                delta: "par".into()
            }]
        );
        let end = p.push_line(r#"{"type":"stream_event","event":{"type":"message_stop"}}"#);
        assert_eq!(end[0], StreamPart::TextEnd { id: "m1:0".into() });
        assert!(
            matches!(&end[1], StreamPart::FinishStep { usage: Some(u) } if u.input_tokens == 5)
        );
        assert!(!p.in_block());
    }
}
