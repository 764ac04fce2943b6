//! Rendering a [`Reply`] as Anthropic Messages or OpenAI Responses events.

use std::time::Duration;

use serde_json::{json, Value};

use super::request::Api;
use super::script::{Part, Reply};

/// One server-sent event, with the pause to take before sending it.
#[derive(Debug, Clone, PartialEq)]
pub struct SseEvent {
    /// The `event:` name (equal to `data.type`).
    pub name: String,
    /// The `data:` JSON.
    pub data: Value,
    /// Pause before this event.
    pub delay: Duration,
    /// Wait for this gate before this event.
    pub hold: Option<super::script::Gate>,
}

impl SseEvent {
    fn new(data: Value) -> Self {
        let name = data
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or("message")
            .to_string();
        Self {
            name,
            data,
            delay: Duration::ZERO,
            hold: None,
        }
    }
    fn delayed(mut self, d: Duration) -> Self {
        self.delay = d;
        self
    }
    /// Whether this event streams a piece of text, reasoning or a tool's
    /// input (what [`Reply::hold_before_delta`] counts).
    pub(crate) fn is_delta(&self) -> bool {
        self.name.ends_with("delta")
    }
    /// The wire form: `event: NAME\ndata: JSON\n\n`.
    pub fn to_wire(&self) -> String {
        format!("event: {}\ndata: {}\n\n", self.name, self.data)
    }
}

/// Per-response identity and token counts.
#[derive(Debug, Clone)]
pub struct ResponseMeta {
    /// Sequence number of this response (for ids).
    pub n: u64,
    /// Model name echoed back.
    pub model: String,
    /// Input tokens to report.
    pub input_tokens: u64,
}

fn output_tokens(reply: &Reply) -> u64 {
    let mut chars = 0usize;
    for p in &reply.parts {
        chars += match p {
            Part::Text(c) | Part::Thinking(c) => c.iter().map(String::len).sum(),
            Part::Tool(_) => 40,
        };
    }
    (chars as u64 / 4).max(1)
}

/// Split a string into two halves on a char boundary (for argument deltas).
fn halves(s: &str) -> Vec<String> {
    let chars: Vec<char> = s.chars().collect();
    if chars.len() < 2 {
        return vec![s.to_string()];
    }
    let mid = chars.len() / 2;
    vec![chars[..mid].iter().collect(), chars[mid..].iter().collect()]
}

// ---------------------------------------------------------------- Anthropic

fn anthropic_usage(meta: &ResponseMeta, output: u64) -> Value {
    json!({
        "input_tokens": meta.input_tokens,
        "output_tokens": output,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    })
}

fn anthropic_block(part: &Part, n: u64, api_index: usize) -> Value {
    match part {
        Part::Text(c) => json!({"type": "text", "text": c.concat()}),
        Part::Thinking(c) => json!({
            "type": "thinking",
            "thinking": c.concat(),
            "signature": format!("sig_{n}_{api_index}"),
        }),
        Part::Tool(call) => {
            let (name, input) = call.render(Api::Anthropic);
            json!({"type": "tool_use", "id": call.id, "name": name, "input": input})
        }
    }
}

/// The Anthropic Messages SSE events for `reply`.
pub fn anthropic_events(reply: &Reply, meta: &ResponseMeta) -> Vec<SseEvent> {
    let d = reply.delay;
    let mut ev = vec![
        SseEvent::new(json!({
            "type": "message_start",
            "message": {
                "id": format!("msg_{}", meta.n),
                "type": "message",
                "role": "assistant",
                "model": meta.model,
                "content": [],
                "stop_reason": null,
                "stop_sequence": null,
                "usage": anthropic_usage(meta, 1),
            }
        })),
        SseEvent::new(json!({"type": "ping"})),
    ];
    for (index, part) in reply.parts.iter().enumerate() {
        match part {
            Part::Text(chunks) => {
                ev.push(SseEvent::new(json!({
                    "type": "content_block_start", "index": index,
                    "content_block": {"type": "text", "text": ""}
                })));
                for c in chunks {
                    ev.push(
                        SseEvent::new(json!({
                            "type": "content_block_delta", "index": index,
                            "delta": {"type": "text_delta", "text": c}
                        }))
                        .delayed(d),
                    );
                }
            }
            Part::Thinking(chunks) => {
                ev.push(SseEvent::new(json!({
                    "type": "content_block_start", "index": index,
                    "content_block": {"type": "thinking", "thinking": "", "signature": ""}
                })));
                for c in chunks {
                    ev.push(
                        SseEvent::new(json!({
                            "type": "content_block_delta", "index": index,
                            "delta": {"type": "thinking_delta", "thinking": c}
                        }))
                        .delayed(d),
                    );
                }
                ev.push(SseEvent::new(json!({
                    "type": "content_block_delta", "index": index,
                    "delta": {"type": "signature_delta", "signature": format!("sig_{}_{index}", meta.n)}
                })));
            }
            Part::Tool(call) => {
                let (name, input) = call.render(Api::Anthropic);
                ev.push(SseEvent::new(json!({
                    "type": "content_block_start", "index": index,
                    "content_block": {"type": "tool_use", "id": call.id, "name": name, "input": {}}
                })));
                for c in halves(&input.to_string()) {
                    ev.push(
                        SseEvent::new(json!({
                            "type": "content_block_delta", "index": index,
                            "delta": {"type": "input_json_delta", "partial_json": c}
                        }))
                        .delayed(d),
                    );
                }
            }
        }
        ev.push(SseEvent::new(
            json!({"type": "content_block_stop", "index": index}),
        ));
    }
    ev.push(SseEvent::new(json!({
        "type": "message_delta",
        "delta": {"stop_reason": reply.stop_reason().as_anthropic(), "stop_sequence": null},
        "usage": {"output_tokens": output_tokens(reply)},
    })));
    ev.push(SseEvent::new(json!({"type": "message_stop"})));
    ev
}

/// The non-streaming Anthropic Messages response body for `reply`.
pub fn anthropic_message(reply: &Reply, meta: &ResponseMeta) -> Value {
    let content: Vec<Value> = reply
        .parts
        .iter()
        .enumerate()
        .map(|(i, p)| anthropic_block(p, meta.n, i))
        .collect();
    json!({
        "id": format!("msg_{}", meta.n),
        "type": "message",
        "role": "assistant",
        "model": meta.model,
        "content": content,
        "stop_reason": reply.stop_reason().as_anthropic(),
        "stop_sequence": null,
        "usage": anthropic_usage(meta, output_tokens(reply)),
    })
}

// ------------------------------------------------------------------ OpenAI

fn openai_item(part: &Part, n: u64, i: usize, done: bool) -> Value {
    let status = if done { "completed" } else { "in_progress" };
    match part {
        Part::Text(c) => json!({
            "type": "message",
            "id": format!("msg_{n}_{i}"),
            "status": status,
            "role": "assistant",
            "content": if done {
                json!([{"type": "output_text", "text": c.concat(), "annotations": []}])
            } else {
                json!([])
            },
        }),
        Part::Thinking(c) => json!({
            "type": "reasoning",
            "id": format!("rs_{n}_{i}"),
            "summary": if done {
                json!([{"type": "summary_text", "text": c.concat()}])
            } else {
                json!([])
            },
        }),
        Part::Tool(call) if call.is_custom(Api::OpenAi) => {
            let (name, input) = call.render(Api::OpenAi);
            json!({
                "type": "custom_tool_call",
                "id": format!("ctc_{n}_{i}"),
                "status": status,
                "call_id": call.id,
                "name": name,
                "input": if done { input.as_str().unwrap_or_default().to_string() } else { String::new() },
            })
        }
        Part::Tool(call) => {
            let (name, input) = call.render(Api::OpenAi);
            json!({
                "type": "function_call",
                "id": format!("fc_{n}_{i}"),
                "status": status,
                "call_id": call.id,
                "name": name,
                "arguments": if done { input.to_string() } else { String::new() },
            })
        }
    }
}

fn openai_usage(reply: &Reply, meta: &ResponseMeta) -> Value {
    let out = output_tokens(reply);
    json!({
        "input_tokens": meta.input_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": out,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": meta.input_tokens + out,
    })
}

/// The full OpenAI Responses `response` object for `reply`.
pub fn openai_response(reply: &Reply, meta: &ResponseMeta) -> Value {
    let output: Vec<Value> = reply
        .parts
        .iter()
        .enumerate()
        .map(|(i, p)| openai_item(p, meta.n, i, true))
        .collect();
    json!({
        "id": format!("resp_{}", meta.n),
        "object": "response",
        "created_at": 0,
        "status": "completed",
        "model": meta.model,
        "output": output,
        "usage": openai_usage(reply, meta),
    })
}

/// The OpenAI Responses SSE events for `reply`.
pub fn openai_events(reply: &Reply, meta: &ResponseMeta) -> Vec<SseEvent> {
    let d = reply.delay;
    let n = meta.n;
    let shell = json!({
        "id": format!("resp_{n}"),
        "object": "response",
        "created_at": 0,
        "status": "in_progress",
        "model": meta.model,
        "output": [],
    });
    let mut ev = vec![
        SseEvent::new(json!({"type": "response.created", "response": shell})),
        SseEvent::new(json!({"type": "response.in_progress", "response": shell})),
    ];
    for (i, part) in reply.parts.iter().enumerate() {
        ev.push(SseEvent::new(json!({
            "type": "response.output_item.added", "output_index": i,
            "item": openai_item(part, n, i, false),
        })));
        match part {
            Part::Text(chunks) => {
                let item_id = format!("msg_{n}_{i}");
                let text = chunks.concat();
                ev.push(SseEvent::new(json!({
                    "type": "response.content_part.added", "item_id": item_id,
                    "output_index": i, "content_index": 0,
                    "part": {"type": "output_text", "text": "", "annotations": []},
                })));
                for c in chunks {
                    ev.push(
                        SseEvent::new(json!({
                            "type": "response.output_text.delta", "item_id": item_id,
                            "output_index": i, "content_index": 0, "delta": c,
                        }))
                        .delayed(d),
                    );
                }
                ev.push(SseEvent::new(json!({
                    "type": "response.output_text.done", "item_id": item_id,
                    "output_index": i, "content_index": 0, "text": text,
                })));
                ev.push(SseEvent::new(json!({
                    "type": "response.content_part.done", "item_id": item_id,
                    "output_index": i, "content_index": 0,
                    "part": {"type": "output_text", "text": text, "annotations": []},
                })));
            }
            Part::Thinking(chunks) => {
                let item_id = format!("rs_{n}_{i}");
                let text = chunks.concat();
                ev.push(SseEvent::new(json!({
                    "type": "response.reasoning_summary_part.added", "item_id": item_id,
                    "output_index": i, "summary_index": 0,
                    "part": {"type": "summary_text", "text": ""},
                })));
                for c in chunks {
                    ev.push(
                        SseEvent::new(json!({
                            "type": "response.reasoning_summary_text.delta", "item_id": item_id,
                            "output_index": i, "summary_index": 0, "delta": c,
                        }))
                        .delayed(d),
                    );
                }
                ev.push(SseEvent::new(json!({
                    "type": "response.reasoning_summary_text.done", "item_id": item_id,
                    "output_index": i, "summary_index": 0, "text": text,
                })));
                ev.push(SseEvent::new(json!({
                    "type": "response.reasoning_summary_part.done", "item_id": item_id,
                    "output_index": i, "summary_index": 0,
                    "part": {"type": "summary_text", "text": text},
                })));
            }
            Part::Tool(call) if call.is_custom(Api::OpenAi) => {
                let item_id = format!("ctc_{n}_{i}");
                let (_, input) = call.render(Api::OpenAi);
                let input = input.as_str().unwrap_or_default().to_string();
                for c in halves(&input) {
                    ev.push(
                        SseEvent::new(json!({
                            "type": "response.custom_tool_call_input.delta",
                            "item_id": item_id, "output_index": i, "delta": c,
                        }))
                        .delayed(d),
                    );
                }
                ev.push(SseEvent::new(json!({
                    "type": "response.custom_tool_call_input.done",
                    "item_id": item_id, "output_index": i, "input": input,
                })));
            }
            Part::Tool(call) => {
                let item_id = format!("fc_{n}_{i}");
                let args = call.render(Api::OpenAi).1.to_string();
                for c in halves(&args) {
                    ev.push(
                        SseEvent::new(json!({
                            "type": "response.function_call_arguments.delta",
                            "item_id": item_id, "output_index": i, "delta": c,
                        }))
                        .delayed(d),
                    );
                }
                ev.push(SseEvent::new(json!({
                    "type": "response.function_call_arguments.done",
                    "item_id": item_id, "output_index": i, "arguments": args,
                })));
            }
        }
        ev.push(SseEvent::new(json!({
            "type": "response.output_item.done", "output_index": i,
            "item": openai_item(part, n, i, true),
        })));
    }
    ev.push(SseEvent::new(json!({
        "type": "response.completed",
        "response": openai_response(reply, meta),
    })));
    for (seq, e) in ev.iter_mut().enumerate() {
        if let Some(o) = e.data.as_object_mut() {
            o.insert("sequence_number".into(), json!(seq));
        }
    }
    ev
}
