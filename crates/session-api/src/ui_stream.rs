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
//!
//! A mapper [`for_turn`](UiStreamMapper::for_turn) is the chat endpoint's
//! (`crate::chat`): it maps one turn's frames only, its `start` and
//! `finish` carry the turn as message metadata, and it ends at the turn's
//! terminal `turn-status` (the agent's `finish` part comes a moment
//! before it, while the turn still counts as running: a client that
//! prompted again at `finish` would be refused).

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
    /// Tool calls already sent (`tool-input-available`): a call is sent
    /// once, whether its `tool-call` or its approval request comes first.
    tools: HashSet<String>,
    finished: bool,
    /// Set for a chat stream: only this turn's frames, ended by its status.
    turn: Option<String>,
    /// The agent's own finish reason, kept for the turn's end (chat).
    finish_reason: Option<String>,
    /// The approval id of the request mapped last, until taken.
    approval_request: Option<String>,
}

impl UiStreamMapper {
    /// A mapper for one assistant message with this id.
    pub fn new(message_id: impl Into<String>) -> Self {
        Self {
            message_id: message_id.into(),
            started: false,
            step_open: false,
            live_blocks: HashSet::new(),
            tools: HashSet::new(),
            finished: false,
            turn: None,
            finish_reason: None,
            approval_request: None,
        }
    }

    /// A mapper for the assistant message of turn `turn_id` (the chat
    /// endpoint's): other turns' frames map to nothing, `start` carries
    /// `{"turnId"}` and `finish` `{"turnId", "status", "error"?}` as message
    /// metadata, and the stream ends at the turn's terminal status.
    pub fn for_turn(message_id: impl Into<String>, turn_id: impl Into<String>) -> Self {
        Self {
            turn: Some(turn_id.into()),
            ..Self::new(message_id)
        }
    }

    /// The approval id of a `tool-approval-request` the last
    /// [`map`](Self::map) produced (taken: asked once per request).
    pub fn take_approval_request(&mut self) -> Option<String> {
        self.approval_request.take()
    }

    /// End the stream here because the turn waits for an answer to a
    /// permission request: `finish-step`, then `finish` with reason
    /// `tool-calls` (and, for a turn's mapper, the status
    /// `awaiting_tool_approval` in the metadata). The client answers with a
    /// new request (`addToolApprovalResponse`), whose stream continues the
    /// message.
    pub fn pause_for_approval(&mut self) -> Vec<Value> {
        let mut out = Vec::new();
        if !self.finished {
            self.start(&mut out);
            let metadata = self
                .turn
                .as_ref()
                .map(|turn| json!({"turnId": turn, "status": TurnStatus::AwaitingToolApproval}));
            self.finish_with("tool-calls", metadata, &mut out);
        }
        out
    }

    /// Forget that anything was sent, keeping what the frames told (which
    /// tools, blocks and step exist): the next chunk opens a new stream of
    /// the same message with `start`, and its parts go on in the step the
    /// frames left open, as in a stream of the whole turn (so the message a
    /// client continues is the one the history shows). For a stream that
    /// continues a message the client already has, after the frames it saw
    /// were mapped into this mapper and their chunks dropped.
    pub fn continue_message(&mut self) {
        self.started = false;
        self.approval_request = None;
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
            ServerMessage::Live { part, turn_id } if self.ours(turn_id) => {
                self.live(part, &mut out)
            }
            ServerMessage::Live { .. } => {}
            ServerMessage::Frame { frame } => match frame_turn(&frame.body) {
                Some(turn) if !self.ours(turn) => {}
                _ => self.frame(&frame.body, &mut out),
            },
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
            let mut start = json!({"type": "start", "messageId": self.message_id});
            if let Some(turn) = &self.turn {
                start["messageMetadata"] = json!({"turnId": turn});
            }
            out.push(start);
        }
    }

    /// Whether a frame about `turn_id` belongs in this stream.
    fn ours(&self, turn_id: &str) -> bool {
        self.turn.as_deref().is_none_or(|t| t == turn_id)
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
                let reason = match (status, self.finish_reason.take()) {
                    (TurnStatus::Finished, Some(agent)) => agent,
                    (TurnStatus::Finished, None) => "stop".into(),
                    (TurnStatus::Failed, _) => "error".into(),
                    _ => "other".into(),
                };
                let metadata = self.turn.as_ref().map(|turn| {
                    let mut m = json!({"turnId": turn, "status": status});
                    if let Some(error) = error {
                        m["error"] = json!(error);
                    }
                    m
                });
                self.finish_with(&reason, metadata, out);
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
                self.tool_call(tool_call_id, tool_name, input, out);
            }
            StreamPart::ToolApprovalRequest {
                approval_id,
                tool_call_id,
                tool_name,
                input,
            } => {
                // The request belongs to its call's step (Claude Code ends
                // the step with the call; a new one would hide the call
                // from `lastAssistantMessageIsCompleteWithApprovalResponses`,
                // which looks at the last step). It may be read before the
                // call it is about: then it brings the call.
                if self.tools.contains(tool_call_id) {
                    self.start(out);
                } else {
                    self.step(out);
                    self.tool_call(tool_call_id, tool_name, input, out);
                }
                self.approval_request = Some(approval_id.clone());
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
            // A turn's stream ends at the turn's status, which follows.
            StreamPart::Finish { finish_reason, .. } if self.turn.is_some() => {
                self.finish_reason = Some(normalize_reason(finish_reason));
                if self.step_open {
                    self.step_open = false;
                    out.push(json!({"type": "finish-step"}));
                }
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

    /// `tool-input-available` for a call not sent yet.
    fn tool_call(&mut self, id: &str, name: &str, input: &Value, out: &mut Vec<Value>) {
        if self.tools.insert(id.to_string()) {
            out.push(json!({
                "type": "tool-input-available",
                "toolCallId": id,
                "toolName": name,
                "input": input,
                "dynamic": true,
            }));
        }
    }

    fn finish(&mut self, reason: &str, out: &mut Vec<Value>) {
        self.finish_with(reason, None, out);
    }

    fn finish_with(&mut self, reason: &str, metadata: Option<Value>, out: &mut Vec<Value>) {
        if self.step_open {
            self.step_open = false;
            out.push(json!({"type": "finish-step"}));
        }
        let mut finish = json!({"type": "finish", "finishReason": reason});
        if let Some(metadata) = metadata {
            finish["messageMetadata"] = metadata;
        }
        out.push(finish);
        self.finished = true;
    }
}

/// The turn a frame is about, if it is about one.
pub fn frame_turn(body: &FrameBody) -> Option<&str> {
    match body {
        FrameBody::UserMessage { turn_id, .. } | FrameBody::ApprovalResponse { turn_id, .. } => {
            turn_id.as_deref()
        }
        FrameBody::AbortRequested { turn_id, .. }
        | FrameBody::Part { turn_id, .. }
        | FrameBody::Message { turn_id, .. }
        | FrameBody::TurnStatus { turn_id, .. }
        | FrameBody::HostCall { turn_id, .. }
        | FrameBody::HostOutcome { turn_id, .. } => Some(turn_id),
        // A sandbox reset names the turn the session goes back to; it is
        // the session's, not part of any turn's stream.
        FrameBody::RunnerAttached { .. }
        | FrameBody::SandboxReset { .. }
        | FrameBody::Sealed {} => None,
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
    fn an_approval_request_stays_in_its_calls_step_and_brings_an_unseen_call() {
        let part = |p| FrameBody::Part {
            turn_id: "t".into(),
            part: p,
        };
        let call = |id: &str| StreamPart::ToolCall {
            tool_call_id: id.into(),
            tool_name: "Bash".into(),
            input: json!({"command": "ls"}),
        };
        let request = |id: &str| StreamPart::ToolApprovalRequest {
            approval_id: format!("a-{id}"),
            tool_call_id: id.into(),
            tool_name: "Bash".into(),
            input: json!({"command": "ls"}),
        };
        let mut m = UiStreamMapper::new("m");
        let mut all = m.map(&frame(1, part(call("c1"))));
        all.extend(m.map(&frame(2, part(StreamPart::FinishStep { usage: None }))));
        all.extend(m.map(&frame(3, part(request("c1")))));
        // A request read before its call: the call first, once.
        all.extend(m.map(&frame(4, part(request("c2")))));
        all.extend(m.map(&frame(5, part(call("c2")))));
        assert_eq!(
            types(&all),
            vec![
                "start",
                "start-step",
                "tool-input-available",
                "finish-step",
                "tool-approval-request",
                "start-step",
                "tool-input-available",
                "tool-approval-request"
            ]
        );
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
                code: None,
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
                code: None,
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
