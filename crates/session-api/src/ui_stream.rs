//! Session messages as an AI SDK UI message stream (what `useChat` reads).
//!
//! A pure mapping: [`UiStreamMapper::map`] turns each [`ServerMessage`] a
//! session connection receives (stored frames and live parts) into zero or
//! more UI message chunks (`{"type": "text-delta", …}`); the HTTP layer
//! writes each as `data: <json>` and ends with `data: [DONE]` once
//! [`UiStreamMapper::is_done`] says so (the turn finished or the session was
//! sealed).
//!
//! Mapping:
//! - live `text-start`/`text-delta` (and reasoning) → the same chunk types;
//!   a stored `message` frame ends the block (`text-end`), or, when its
//!   block was never seen live (replay), is sent whole as start/delta/end;
//! - `tool-call` → `tool-input-available` with `dynamic: true` (the client
//!   does not declare the agent's native tools);
//! - `tool-result` → `tool-output-available` (`tool-output-error` when the
//!   tool reported an error);
//! - `tool-approval-request` → `tool-approval-request`;
//! - `stream-start` → `start-step`, `finish-step` → `finish-step`;
//! - `file-change` → `data-file-change`;
//! - `error` → `error`; `finish`, a terminal `turn-status` or `sealed` →
//!   `finish`, then done.

use std::collections::HashSet;

use harness_core::actor::ServerMessage;
use harness_core::frame::{FrameBody, MessageKind};
use harness_core::part::StreamPart;
use harness_core::turn::TurnStatus;
use serde_json::{json, Value};

/// The header that marks a UI message stream.
pub const UI_STREAM_HEADER: &str = "x-vercel-ai-ui-message-stream";

/// Turns session messages into UI message chunks. One mapper per stream.
#[derive(Debug, Clone)]
pub struct UiStreamMapper {
    message_id: String,
    started: bool,
    step_open: bool,
    /// Blocks whose start was sent live: (is_reasoning, id).
    live_blocks: HashSet<(bool, String)>,
    finished: bool,
}

impl UiStreamMapper {
    /// A mapper for one assistant message with this id.
    pub fn new(message_id: impl Into<String>) -> Self {
        Self {
            message_id: message_id.into(),
            started: false,
            step_open: false,
            live_blocks: HashSet::new(),
            finished: false,
        }
    }

    /// True once `finish` was produced: write `[DONE]` and end the stream.
    pub fn is_done(&self) -> bool {
        self.finished
    }

    /// The chunks for one message (none after the stream is done).
    pub fn map(&mut self, message: &ServerMessage) -> Vec<Value> {
        let mut out = Vec::new();
        if self.finished {
            return out;
        }
        match message {
            ServerMessage::Live { part, .. } => self.live(part, &mut out),
            ServerMessage::Frame { frame } => self.frame(&frame.body, &mut out),
            ServerMessage::Ack { .. }
            | ServerMessage::Received {}
            | ServerMessage::Error { .. }
            | ServerMessage::HostCall { .. }
            | ServerMessage::HostCancel { .. }
            | ServerMessage::HostTools { .. } => {}
        }
        out
    }

    fn start(&mut self, out: &mut Vec<Value>) {
        if !self.started {
            self.started = true;
            out.push(json!({"type": "start", "messageId": self.message_id}));
        }
    }

    fn step(&mut self, out: &mut Vec<Value>) {
        self.start(out);
        if !self.step_open {
            self.step_open = true;
            out.push(json!({"type": "start-step"}));
        }
    }

    fn live(&mut self, part: &StreamPart, out: &mut Vec<Value>) {
        match part {
            StreamPart::TextStart { id } | StreamPart::ReasoningStart { id } => {
                let reasoning = matches!(part, StreamPart::ReasoningStart { .. });
                self.step(out);
                // A retried block starts again: its start is sent once.
                if self.live_blocks.insert((reasoning, id.clone())) {
                    out.push(json!({"type": block_type(reasoning, "start"), "id": id}));
                }
            }
            StreamPart::TextDelta { id, delta } | StreamPart::ReasoningDelta { id, delta } => {
                let reasoning = matches!(part, StreamPart::ReasoningDelta { .. });
                self.step(out);
                if self.live_blocks.insert((reasoning, id.clone())) {
                    out.push(json!({"type": block_type(reasoning, "start"), "id": id}));
                }
                out.push(json!({"type": block_type(reasoning, "delta"), "id": id, "delta": delta}));
            }
            // Only deltas travel live; everything else arrives as frames.
            _ => {}
        }
    }

    fn frame(&mut self, body: &FrameBody, out: &mut Vec<Value>) {
        match body {
            FrameBody::Message { id, kind, text, .. } => {
                let reasoning = *kind == MessageKind::Reasoning;
                self.step(out);
                if !self.live_blocks.remove(&(reasoning, id.clone())) {
                    out.push(json!({"type": block_type(reasoning, "start"), "id": id}));
                    if !text.is_empty() {
                        out.push(
                            json!({"type": block_type(reasoning, "delta"), "id": id, "delta": text}),
                        );
                    }
                }
                out.push(json!({"type": block_type(reasoning, "end"), "id": id}));
            }
            FrameBody::Part { part, .. } => self.part(part, out),
            FrameBody::TurnStatus { status, error, .. } if status.is_terminal() => {
                self.start(out);
                if let Some(error) = error {
                    out.push(json!({"type": "error", "errorText": error}));
                }
                let reason = match status {
                    TurnStatus::Finished => "stop",
                    TurnStatus::Failed => "error",
                    _ => "other",
                };
                self.finish(reason, out);
            }
            FrameBody::Sealed {} => {
                self.start(out);
                self.finish("other", out);
            }
            // The agent's own tool-call and tool-result parts already show
            // a host tool's call and answer; these frames are the session's
            // bookkeeping (in the session's frames, not the UI stream).
            FrameBody::HostCall { .. } | FrameBody::HostOutcome { .. } => {}
            FrameBody::UserMessage { .. }
            | FrameBody::ApprovalResponse { .. }
            | FrameBody::AbortRequested { .. }
            | FrameBody::TurnStatus { .. }
            | FrameBody::RunnerAttached { .. }
            | FrameBody::SandboxReset { .. } => {}
        }
    }

    fn part(&mut self, part: &StreamPart, out: &mut Vec<Value>) {
        match part {
            StreamPart::StreamStart { .. } => self.step(out),
            StreamPart::ToolCall {
                tool_call_id,
                tool_name,
                input,
            } => {
                self.step(out);
                out.push(json!({
                    "type": "tool-input-available",
                    "toolCallId": tool_call_id,
                    "toolName": tool_name,
                    "input": input,
                    "dynamic": true,
                }));
            }
            StreamPart::ToolApprovalRequest {
                approval_id,
                tool_call_id,
                ..
            } => {
                self.step(out);
                out.push(json!({
                    "type": "tool-approval-request",
                    "approvalId": approval_id,
                    "toolCallId": tool_call_id,
                }));
            }
            StreamPart::ToolResult {
                tool_call_id,
                output,
                is_error,
                ..
            } => {
                self.step(out);
                if *is_error {
                    let text = match output {
                        Value::String(s) => s.clone(),
                        other => other.to_string(),
                    };
                    out.push(json!({
                        "type": "tool-output-error",
                        "toolCallId": tool_call_id,
                        "errorText": text,
                        "dynamic": true,
                    }));
                } else {
                    out.push(json!({
                        "type": "tool-output-available",
                        "toolCallId": tool_call_id,
                        "output": output,
                        "dynamic": true,
                    }));
                }
            }
            StreamPart::FileChange { kind, path } => {
                self.step(out);
                out.push(json!({"type": "data-file-change", "data": {"kind": kind, "path": path}}));
            }
            StreamPart::FinishStep { .. } if self.step_open => {
                self.step_open = false;
                out.push(json!({"type": "finish-step"}));
            }
            StreamPart::Finish { finish_reason, .. } => {
                self.start(out);
                self.finish(&normalize_reason(finish_reason), out);
            }
            StreamPart::Error { message } => {
                self.start(out);
                out.push(json!({"type": "error", "errorText": message}));
            }
            // Transient: a client shows it while it matters, the message
            // history does not keep it.
            StreamPart::Warning {
                code,
                message,
                attempt,
                max_attempts,
            } => {
                self.start(out);
                out.push(json!({
                    "type": "data-warning",
                    "data": {"code": code, "message": message, "attempt": attempt, "maxAttempts": max_attempts},
                    "transient": true,
                }));
            }
            // Deltas never reach the log; compaction and raw events have no
            // UI chunk.
            _ => {}
        }
    }

    fn finish(&mut self, reason: &str, out: &mut Vec<Value>) {
        if self.step_open {
            self.step_open = false;
            out.push(json!({"type": "finish-step"}));
        }
        out.push(json!({"type": "finish", "finishReason": reason}));
        self.finished = true;
    }
}

fn block_type(reasoning: bool, what: &str) -> String {
    let base = if reasoning { "reasoning" } else { "text" };
    format!("{base}-{what}")
}

/// The AI SDK accepts a fixed set of finish reasons; anything else (an
/// agent's own word, e.g. `aborted`) becomes `other`.
fn normalize_reason(reason: &str) -> String {
    match reason {
        "stop" | "length" | "content-filter" | "tool-calls" | "error" | "other" => reason.into(),
        "end_turn" | "completed" => "stop".into(),
        _ => "other".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use harness_core::frame::Frame;
    use harness_core::part::Usage;

    fn frame(seq: u64, body: FrameBody) -> ServerMessage {
        ServerMessage::Frame {
            frame: Frame {
                seq,
                at_ms: 0,
                body,
            },
        }
    }

    fn live(part: StreamPart) -> ServerMessage {
        ServerMessage::Live {
            turn_id: "t".into(),
            part,
        }
    }

    fn types(chunks: &[Value]) -> Vec<&str> {
        chunks.iter().map(|c| c["type"].as_str().unwrap()).collect()
    }

    #[test]
    fn live_text_then_stored_message_ends_the_block_once() {
        let mut m = UiStreamMapper::new("msg-1");
        let mut all = Vec::new();
        all.extend(m.map(&live(StreamPart::TextStart { id: "b".into() })));
        all.extend(m.map(&live(StreamPart::TextDelta {
            id: "b".into(),
            delta: "Hel".into(),
        })));
        all.extend(m.map(&live(StreamPart::TextDelta {
            id: "b".into(),
            delta: "lo".into(),
        })));
        all.extend(m.map(&frame(
            3,
            FrameBody::Message {
                turn_id: "t".into(),
                id: "b".into(),
                kind: MessageKind::Text,
                text: "Hello".into(),
                interrupted: false,
            },
        )));
        assert_eq!(
            types(&all),
            vec![
                "start",
                "start-step",
                "text-start",
                "text-delta",
                "text-delta",
                "text-end"
            ]
        );
        assert_eq!(all[0]["messageId"], "msg-1");
        assert_eq!(all[3]["delta"], "Hel");
        assert_eq!(all[5]["id"], "b");
        assert!(!m.is_done());
    }

    #[test]
    fn a_replayed_message_is_sent_whole() {
        let mut m = UiStreamMapper::new("m");
        let chunks = m.map(&frame(
            1,
            FrameBody::Message {
                turn_id: "t".into(),
                id: "r".into(),
                kind: MessageKind::Reasoning,
                text: "thinking".into(),
                interrupted: false,
            },
        ));
        assert_eq!(
            types(&chunks),
            vec![
                "start",
                "start-step",
                "reasoning-start",
                "reasoning-delta",
                "reasoning-end"
            ]
        );
        assert_eq!(chunks[3]["delta"], "thinking");
    }

    #[test]
    fn tools_map_to_dynamic_tool_chunks_and_finish_ends_the_stream() {
        let mut m = UiStreamMapper::new("m");
        let part = |p| FrameBody::Part {
            turn_id: "t".into(),
            part: p,
        };
        let call = m.map(&frame(
            1,
            part(StreamPart::ToolCall {
                tool_call_id: "c1".into(),
                tool_name: "Bash".into(),
                input: json!({"command": "ls"}),
            }),
        ));
        assert_eq!(
            call.last().unwrap(),
            &json!({"type": "tool-input-available", "toolCallId": "c1", "toolName": "Bash",
                    "input": {"command": "ls"}, "dynamic": true})
        );
        let result = m.map(&frame(
            2,
            part(StreamPart::ToolResult {
                tool_call_id: "c1".into(),
                tool_name: "Bash".into(),
                output: json!("a\nb"),
                is_error: false,
            }),
        ));
        assert_eq!(
            result,
            vec![
                json!({"type": "tool-output-available", "toolCallId": "c1", "output": "a\nb", "dynamic": true})
            ]
        );
        let failed = m.map(&frame(
            3,
            part(StreamPart::ToolResult {
                tool_call_id: "c2".into(),
                tool_name: "Bash".into(),
                output: json!("boom"),
                is_error: true,
            }),
        ));
        assert_eq!(failed[0]["type"], "tool-output-error");
        assert_eq!(failed[0]["errorText"], "boom");
        let err = m.map(&frame(
            4,
            part(StreamPart::Error {
                message: "bad".into(),
            }),
        ));
        assert_eq!(err, vec![json!({"type": "error", "errorText": "bad"})]);
        let warning = m.map(&frame(
            4,
            part(StreamPart::Warning {
                code: "model-retry".into(),
                message: "the model request failed".into(),
                attempt: Some(2),
                max_attempts: None,
            }),
        ));
        assert_eq!(
            warning,
            vec![json!({"type": "data-warning", "transient": true,
                        "data": {"code": "model-retry", "message": "the model request failed", "attempt": 2, "maxAttempts": null}})]
        );
        let fin = m.map(&frame(
            5,
            part(StreamPart::Finish {
                finish_reason: "aborted".into(),
                usage: Usage::default(),
            }),
        ));
        assert_eq!(types(&fin), vec!["finish-step", "finish"]);
        assert_eq!(fin[1]["finishReason"], "other");
        assert!(m.is_done());
        assert!(m.map(&frame(6, FrameBody::Sealed {})).is_empty());
    }

    #[test]
    fn terminal_status_and_seal_finish_the_stream() {
        let mut m = UiStreamMapper::new("m");
        let out = m.map(&frame(
            1,
            FrameBody::TurnStatus {
                turn_id: "t".into(),
                status: TurnStatus::Failed,
                error: Some("agent died".into()),
                sandbox: None,
                agent_session_id: None,
                checkpoint: None,
            },
        ));
        assert_eq!(types(&out), vec!["start", "error", "finish"]);
        assert_eq!(out[2]["finishReason"], "error");
        assert!(m.is_done());

        let mut m = UiStreamMapper::new("m");
        let running = m.map(&frame(
            1,
            FrameBody::TurnStatus {
                turn_id: "t".into(),
                status: TurnStatus::ReadyForNextStep,
                error: None,
                sandbox: None,
                agent_session_id: None,
                checkpoint: None,
            },
        ));
        assert!(running.is_empty());
        assert!(!m.is_done());
        let sealed = m.map(&frame(2, FrameBody::Sealed {}));
        assert_eq!(types(&sealed), vec!["start", "finish"]);
        assert!(m.is_done());
    }
}
