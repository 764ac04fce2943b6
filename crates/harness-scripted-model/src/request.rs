//! A normalised, read-only view of one model request (Anthropic Messages or
//! OpenAI Responses), used by matchers, assertions and tests.

use serde_json::Value;

/// Which wire API a request came in on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Api {
    /// `POST /v1/messages` (Claude Code).
    Anthropic,
    /// `POST /v1/responses` (Codex).
    OpenAi,
}

/// One request to a model endpoint, as seen by a [`super::Matcher`].
#[derive(Debug, Clone)]
pub struct ModelRequest {
    /// The API the request used.
    pub api: Api,
    /// The parsed JSON body.
    pub body: Value,
}

/// A tool result found in a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolResult {
    /// `tool_use_id` (Anthropic) or `call_id` (OpenAI).
    pub call_id: String,
    /// The result's text (content blocks concatenated).
    pub content: String,
    /// Anthropic `is_error` (always false for OpenAI).
    pub is_error: bool,
}

/// Concatenate the text of a content value: a string, an array of blocks with
/// `text` fields (any `type` except tool results), or an object with `content`.
pub(crate) fn content_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Array(items) => {
            let mut out = Vec::new();
            for it in items {
                match it {
                    Value::String(s) => out.push(s.clone()),
                    Value::Object(o) => {
                        let ty = o.get("type").and_then(Value::as_str).unwrap_or("");
                        if ty == "tool_result" || ty == "tool_use" {
                            continue;
                        }
                        if let Some(t) = o.get("text").and_then(Value::as_str) {
                            out.push(t.to_string());
                        } else if let Some(c) = o.get("content") {
                            out.push(content_text(c));
                        }
                    }
                    _ => {}
                }
            }
            out.join("\n")
        }
        Value::Object(o) => {
            if let Some(t) = o.get("text").and_then(Value::as_str) {
                t.to_string()
            } else if let Some(c) = o.get("content") {
                content_text(c)
            } else if let Some(c) = o.get("output") {
                content_text(c)
            } else {
                String::new()
            }
        }
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

/// A system / developer message inside the conversation items.
fn is_system_item(m: &Value) -> bool {
    matches!(
        m.get("role").and_then(Value::as_str),
        Some("system") | Some("developer")
    )
}

fn is_tool_result_block(b: &Value) -> bool {
    b.get("type").and_then(Value::as_str) == Some("tool_result")
}

impl ModelRequest {
    /// Build a view over a parsed body.
    pub fn new(api: Api, body: Value) -> Self {
        Self { api, body }
    }

    /// The requested model name.
    pub fn model(&self) -> Option<&str> {
        self.body.get("model").and_then(Value::as_str)
    }

    /// Whether the client asked for a streamed answer.
    pub fn stream(&self) -> bool {
        self.body
            .get("stream")
            .and_then(Value::as_bool)
            .unwrap_or(false)
    }

    /// The conversation items: Anthropic `messages`, OpenAI `input` (a string
    /// input is returned as one user message).
    pub fn items(&self) -> Vec<Value> {
        match self.api {
            Api::Anthropic => self
                .body
                .get("messages")
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default(),
            Api::OpenAi => match self.body.get("input") {
                Some(Value::Array(a)) => a.clone(),
                Some(Value::String(s)) => {
                    vec![serde_json::json!({"type":"message","role":"user","content":s})]
                }
                _ => Vec::new(),
            },
        }
    }

    /// The system prompt / instructions as text.
    pub fn system_text(&self) -> String {
        let mut s = match self.api {
            Api::Anthropic => self.body.get("system"),
            Api::OpenAi => self.body.get("instructions"),
        }
        .map(content_text)
        .unwrap_or_default();
        for it in self.items().iter().filter(|m| is_system_item(m)) {
            s.push('\n');
            s.push_str(&it.get("content").map(content_text).unwrap_or_default());
        }
        s
    }

    /// The text of every user message in order (tool results excluded;
    /// messages with no text are skipped).
    pub fn user_texts(&self) -> Vec<String> {
        self.role_texts("user")
    }

    /// The text of every assistant message in order (messages with no text
    /// are skipped).
    pub fn assistant_texts(&self) -> Vec<String> {
        self.role_texts("assistant")
    }

    fn role_texts(&self, role: &str) -> Vec<String> {
        self.items()
            .iter()
            .filter(|it| it.get("role").and_then(Value::as_str) == Some(role))
            .filter(|it| {
                self.api == Api::Anthropic
                    || it.get("type").and_then(Value::as_str).unwrap_or("message") == "message"
            })
            .map(|it| it.get("content").map(content_text).unwrap_or_default())
            .filter(|t| !t.trim().is_empty())
            .collect()
    }

    /// The text of the most recent user message that carries text (tool
    /// results are not text: a request whose last message is a tool result
    /// still reports the prompt that started the turn).
    pub fn last_user_text(&self) -> Option<String> {
        self.user_texts().pop()
    }

    /// Every tool result in the request, in order.
    pub fn tool_results(&self) -> Vec<ToolResult> {
        let mut out = Vec::new();
        for it in self.items() {
            match self.api {
                Api::Anthropic => {
                    if let Some(blocks) = it.get("content").and_then(Value::as_array) {
                        for b in blocks.iter().filter(|b| is_tool_result_block(b)) {
                            out.push(ToolResult {
                                call_id: b
                                    .get("tool_use_id")
                                    .and_then(Value::as_str)
                                    .unwrap_or("")
                                    .to_string(),
                                content: b.get("content").map(content_text).unwrap_or_default(),
                                is_error: b
                                    .get("is_error")
                                    .and_then(Value::as_bool)
                                    .unwrap_or(false),
                            });
                        }
                    }
                }
                Api::OpenAi => {
                    let ty = it.get("type").and_then(Value::as_str).unwrap_or("");
                    if ty == "function_call_output" || ty == "custom_tool_call_output" {
                        out.push(ToolResult {
                            call_id: it
                                .get("call_id")
                                .and_then(Value::as_str)
                                .unwrap_or("")
                                .to_string(),
                            content: it.get("output").map(content_text).unwrap_or_default(),
                            is_error: false,
                        });
                    }
                }
            }
        }
        out
    }

    /// The tool result for `call_id`, if the request carries one.
    pub fn tool_result(&self, call_id: &str) -> Option<ToolResult> {
        self.tool_results()
            .into_iter()
            .rev()
            .find(|r| r.call_id == call_id)
    }

    /// The tool results carried by the LAST conversation item (Anthropic: the
    /// last message, if it is a user message with `tool_result` blocks;
    /// OpenAI: the trailing run of `function_call_output` items).
    pub fn last_tool_results(&self) -> Vec<ToolResult> {
        let items = self.items();
        match self.api {
            Api::Anthropic => {
                // Claude Code puts `role: "system"` messages (environment
                // info) inside `messages`; they are not conversation turns.
                let Some(last) = items.iter().rev().find(|m| !is_system_item(m)) else {
                    return Vec::new();
                };
                if last.get("role").and_then(Value::as_str) != Some("user") {
                    return Vec::new();
                }
                let Some(blocks) = last.get("content").and_then(Value::as_array) else {
                    return Vec::new();
                };
                let view = ModelRequest::new(
                    Api::Anthropic,
                    serde_json::json!({"messages":[{"role":"user","content":blocks}]}),
                );
                view.tool_results()
            }
            Api::OpenAi => {
                let mut tail = Vec::new();
                for it in items.iter().rev().skip_while(|m| is_system_item(m)) {
                    let ty = it.get("type").and_then(Value::as_str).unwrap_or("");
                    if ty == "function_call_output" || ty == "custom_tool_call_output" {
                        tail.push(it.clone());
                    } else {
                        break;
                    }
                }
                tail.reverse();
                ModelRequest::new(Api::OpenAi, serde_json::json!({ "input": tail })).tool_results()
            }
        }
    }

    /// Whether the request ends with a tool result for `call_id`.
    pub fn last_is_tool_result_for(&self, call_id: &str) -> bool {
        self.last_tool_results()
            .iter()
            .any(|r| r.call_id == call_id)
    }

    /// Names of the tools the client declared.
    pub fn tool_names(&self) -> Vec<String> {
        self.body
            .get("tools")
            .and_then(Value::as_array)
            .map(|tools| {
                tools
                    .iter()
                    .filter_map(|t| {
                        t.get("name")
                            .or_else(|| t.get("function").and_then(|f| f.get("name")))
                            .and_then(Value::as_str)
                            .map(str::to_string)
                    })
                    .collect()
            })
            .unwrap_or_default()
    }
}
