//! A session as an AI SDK chat endpoint: what `useChat`'s default
//! transport (`DefaultChatTransport` of `ai` 7) sends, read into one
//! session action, and the session's log as the `UIMessage[]` history a
//! page loads into `useChat({ messages })`.
//!
//! The transport's `api` is `<server>/v1/chat` and its chat id is the
//! session id (`docs/ai-sdk.md`, "useChat"):
//!
//! - `POST /v1/chat` `{id, messages, trigger, messageId?}`: the last message
//!   says what to do ([`ChatRequest::parse`]): a `user` message is a
//!   prompt whose message id is its idempotency key ([`prompt_key`]); an
//!   `assistant` message whose tool parts carry approval responses
//!   (`addToolApprovalResponse`) answers the running turn's pending
//!   request ([`plan_approvals`]). Everything else the client sends is
//!   ignored: the log is the truth. `regenerate-message` is refused.
//! - the answer streams the turn's UI message chunks through a
//!   [`UiStreamMapper::for_turn`] (the same mapping as `/ui-stream`),
//!   until the turn ends or waits for an approval;
//! - `GET /v1/chat/{id}/stream` replays the running turn from its prompt
//!   (the transport's `resumeStreamIsReplay`); 204 when none runs;
//! - `GET /v1/chat/{id}/messages`: [`history`].

use std::collections::HashMap;

use harness_core::frame::{Frame, FrameBody};
use harness_core::session::SessionMeta;
use harness_core::SessionId;
use serde_json::{json, Map, Value};

use crate::error::ApiError;
use crate::ui_stream::UiStreamMapper;

/// Largest `POST /v1/chat` body: `useChat` sends the whole conversation
/// with every request (only its last message is read). A conversation
/// past it can send just the last message (`prepareSendMessagesRequest`).
pub const MAX_CHAT_BODY: usize = 32 * 1024 * 1024;

/// Longest message id accepted (it becomes an idempotency key).
pub const MAX_MESSAGE_ID: usize = 256;

/// The id of a turn's user message in the history.
pub fn user_message_id(turn_id: &str) -> String {
    format!("{turn_id}-user")
}

/// The id of a turn's assistant message, in streams and the history: a
/// stream that resumes or continues a turn names the message the client
/// already has.
pub fn assistant_message_id(turn_id: &str) -> String {
    format!("{turn_id}-assistant")
}

/// The prompt's idempotency key for a chat message id: a retried `POST`
/// of the same message is the same prompt.
pub fn prompt_key(message_id: &str) -> String {
    format!("chat:{message_id}")
}

/// A mapper for turn `turn_id`'s assistant message.
pub fn turn_mapper(turn_id: &str) -> UiStreamMapper {
    UiStreamMapper::for_turn(assistant_message_id(turn_id), turn_id)
}

/// An answer to a permission request, as a tool part carries it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Approval {
    /// The request's id (`approval.id`).
    pub approval_id: String,
    /// Allow or deny.
    pub approved: bool,
    /// Why (shown to the agent).
    pub reason: Option<String>,
}

/// What a chat request asks the session to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChatAction {
    /// Start a turn with this prompt.
    Prompt {
        /// The user message's id (the idempotency key's source).
        message_id: String,
        /// Its text parts, joined by blank lines.
        text: String,
    },
    /// Answer the running turn's permission request.
    Approvals(Vec<Approval>),
}

/// A `POST /v1/chat` body, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatRequest {
    /// The chat id: the session.
    pub session: SessionId,
    /// What to do.
    pub action: ChatAction,
}

impl ChatRequest {
    /// Read a body `{id, messages, trigger, messageId?}`; a 4xx saying what
    /// is wrong (nothing is sent to the session then).
    pub fn parse(bytes: &[u8]) -> Result<Self, ApiError> {
        let body: Value = serde_json::from_slice(bytes)
            .map_err(|e| ApiError::invalid(format!("the chat request is not JSON: {e}")))?;
        let Some(body) = body.as_object() else {
            return Err(ApiError::invalid(
                "the chat request must be an object {id, messages, trigger}",
            ));
        };
        let id = body.get("id").and_then(Value::as_str).ok_or_else(|| {
            ApiError::invalid(
                "the chat request has no \"id\": give useChat the session id as its id",
            )
        })?;
        let session = crate::request::session_id(id)?;
        match body.get("trigger").and_then(Value::as_str) {
            Some("submit-message") | None => {}
            Some("regenerate-message") => {
                return Err(ApiError::new(
                    400,
                    "unsupported",
                    "regenerate is not supported: a session's log is append-only and the agent's \
                     conversation cannot be rewound yet; send a new message instead",
                ))
            }
            Some(other) => {
                return Err(ApiError::invalid(format!(
                    "unknown trigger {other:?} (expected \"submit-message\")"
                )))
            }
        }
        let messages = body
            .get("messages")
            .and_then(Value::as_array)
            .ok_or_else(|| ApiError::invalid("the chat request has no \"messages\" array"))?;
        let last = messages
            .last()
            .ok_or_else(|| ApiError::invalid("the chat request's \"messages\" is empty"))?;
        let last = last
            .as_object()
            .ok_or_else(|| ApiError::invalid("the last message is not an object"))?;
        let parts = last
            .get("parts")
            .and_then(Value::as_array)
            .ok_or_else(|| ApiError::invalid("the last message has no \"parts\" array"))?;
        let action = match last.get("role").and_then(Value::as_str) {
            Some("user") => user_prompt(last, parts)?,
            Some("assistant") => ChatAction::Approvals(approvals(parts)?),
            other => {
                return Err(ApiError::invalid(format!(
                    "the last message's role is {other:?}: send a user message (a prompt) or \
                     the assistant message with approval responses"
                )))
            }
        };
        Ok(Self { session, action })
    }
}

fn user_prompt(message: &Map<String, Value>, parts: &[Value]) -> Result<ChatAction, ApiError> {
    let message_id = message
        .get("id")
        .and_then(Value::as_str)
        .filter(|id| !id.is_empty() && id.len() <= MAX_MESSAGE_ID)
        .ok_or_else(|| {
            ApiError::invalid(format!(
                "the user message needs an \"id\" of 1-{MAX_MESSAGE_ID} characters (it makes a retried request start no second turn)"
            ))
        })?;
    let mut texts = Vec::new();
    for part in parts {
        match part.get("type").and_then(Value::as_str) {
            Some("text") => texts.push(
                part.get("text")
                    .and_then(Value::as_str)
                    .ok_or_else(|| ApiError::invalid("a text part has no \"text\" string"))?,
            ),
            // Hints the UI keeps for itself.
            Some("step-start") => {}
            Some(t) if t.starts_with("data-") => {}
            other => {
                return Err(ApiError::invalid(format!(
                    "a user message may only hold text parts; {other:?} cannot reach the agent"
                )))
            }
        }
    }
    let text = texts.join("\n\n");
    if text.trim().is_empty() {
        return Err(ApiError::invalid("the user message has no text"));
    }
    Ok(ChatAction::Prompt {
        message_id: message_id.to_string(),
        text,
    })
}

fn approvals(parts: &[Value]) -> Result<Vec<Approval>, ApiError> {
    let mut out = Vec::new();
    for part in parts {
        let kind = part.get("type").and_then(Value::as_str).unwrap_or("");
        let is_tool = kind == "dynamic-tool" || kind.starts_with("tool-");
        if !is_tool || part.get("state").and_then(Value::as_str) != Some("approval-responded") {
            continue;
        }
        let approval = part.get("approval");
        let id = approval.and_then(|a| a.get("id")).and_then(Value::as_str);
        let approved = approval
            .and_then(|a| a.get("approved"))
            .and_then(Value::as_bool);
        let (Some(id), Some(approved)) = (id, approved) else {
            return Err(ApiError::invalid(
                "a tool part in state approval-responded needs approval.id and approval.approved",
            ));
        };
        let reason = approval
            .and_then(|a| a.get("reason"))
            .and_then(Value::as_str)
            .map(str::to_string);
        out.push(Approval {
            approval_id: id.to_string(),
            approved,
            reason,
        });
    }
    if out.is_empty() {
        return Err(ApiError::invalid(
            "the last message is an assistant message with no approval response: \
             answer a request with addToolApprovalResponse, or send a user message",
        ));
    }
    Ok(out)
}

/// What to send for a request's approvals.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApprovalPlan {
    /// The running turn they answer.
    pub turn_id: String,
    /// Answers to send (the pending request's); empty when every answer
    /// was given before (a retried request).
    pub send: Vec<Approval>,
    /// The request the answers are about (the stream continues after it).
    pub approval_id: String,
}

/// Check answers against the session's meta: each must answer the running
/// turn's pending request, or repeat an answer it already got. Anything
/// else is a 409 that names what the turn waits on; nothing is sent then.
pub fn plan_approvals(meta: &SessionMeta, answers: &[Approval]) -> Result<ApprovalPlan, ApiError> {
    let Some(turn) = meta.active_turn() else {
        let first = answers.first().map_or("", |a| a.approval_id.as_str());
        return Err(ApiError::new(
            409,
            "no_active_turn",
            format!("no turn is running, so the approval response to {first:?} answers nothing"),
        ));
    };
    let mut send = Vec::new();
    for answer in answers {
        if turn.approval.as_deref() == Some(answer.approval_id.as_str()) {
            if !send.contains(answer) {
                send.push(answer.clone());
            }
            continue;
        }
        match turn
            .answers
            .iter()
            .find(|a| a.approval_id == answer.approval_id)
        {
            Some(given) if given.approved == answer.approved => {}
            Some(given) => {
                return Err(ApiError::new(
                    409,
                    "conflict",
                    format!(
                        "approval {:?} was already {}",
                        answer.approval_id,
                        if given.approved { "approved" } else { "denied" }
                    ),
                ))
            }
            None => {
                let waits = match &turn.approval {
                    Some(id) => format!("it waits on {id:?}"),
                    None => "it waits on no approval".into(),
                };
                return Err(ApiError::new(
                    409,
                    "no_pending_approval",
                    format!(
                        "approval {:?} is not pending in turn {} ({waits})",
                        answer.approval_id, turn.turn_id
                    ),
                ));
            }
        }
    }
    if send.len() > 1 {
        return Err(ApiError::invalid(
            "two different answers to the same approval request",
        ));
    }
    let approval_id = answers
        .last()
        .map(|a| a.approval_id.clone())
        .unwrap_or_default();
    Ok(ApprovalPlan {
        turn_id: turn.turn_id.clone(),
        send,
        approval_id,
    })
}

/// Whether `frame` is the `tool-approval-request` with this id.
pub fn is_approval_request(frame: &Frame, approval_id: &str) -> bool {
    matches!(
        &frame.body,
        FrameBody::Part {
            part: harness_core::part::StreamPart::ToolApprovalRequest { approval_id: id, .. },
            ..
        } if id == approval_id
    )
}

/// The session's log as the AI SDK's `UIMessage[]`: per turn, the user
/// message (`<turn>-user`, its prompt as one text part) and the assistant
/// message (`<turn>-assistant`) folded from the very chunks a stream of
/// the turn sends, with `metadata` `{turnId, status, error?}` (`status`
/// `running` while the turn has not ended). Answers to permission requests
/// are folded into their tool part's `approval`. Text still streaming (not
/// stored yet) is not in it; a `resume` stream brings it. A
/// `sandbox-reset` (a rewind to turn `T`) drops the turns after `T`: the
/// agent's conversation no longer holds them.
pub fn history<'a>(frames: impl IntoIterator<Item = &'a Frame>) -> Vec<Value> {
    let mut out: Vec<Value> = Vec::new();
    let mut current: Option<(UiStreamMapper, Assistant)> = None;
    for frame in frames {
        if let FrameBody::SandboxReset { turn_id, .. } = &frame.body {
            // A rewind: the turns after `turn_id` are no longer the
            // agent's conversation, so they leave the history.
            if let Some((_, done)) = current.take() {
                out.extend(done.into_message());
            }
            let keep = match turn_id {
                Some(turn) => out
                    .iter()
                    .rposition(|m| {
                        m["id"] == user_message_id(turn) || m["id"] == assistant_message_id(turn)
                    })
                    .map_or(out.len(), |i| i + 1),
                None => 0,
            };
            out.truncate(keep);
            continue;
        }
        if let FrameBody::UserMessage {
            text,
            turn_id: Some(turn),
        } = &frame.body
        {
            if let Some((_, done)) = current.take() {
                out.extend(done.into_message());
            }
            out.push(json!({
                "id": user_message_id(turn),
                "role": "user",
                "parts": [{"type": "text", "text": text}],
            }));
            current = Some((turn_mapper(turn), Assistant::new(turn)));
            continue;
        }
        let Some((mapper, message)) = current.as_mut() else {
            continue;
        };
        if let FrameBody::ApprovalResponse {
            approval_id,
            approved,
            reason,
            ..
        } = &frame.body
        {
            message.answered(approval_id, *approved, reason.as_deref());
        }
        let message_frame = harness_core::actor::ServerMessage::Frame {
            frame: frame.clone(),
        };
        for chunk in mapper.map(&message_frame) {
            message.chunk(&chunk);
        }
    }
    if let Some((_, done)) = current {
        out.extend(done.into_message());
    }
    out
}

/// An assistant message being folded from UI chunks (what the AI SDK's
/// `processUIMessageStream` does with them, for the chunks our streams
/// send).
struct Assistant {
    id: String,
    parts: Vec<Value>,
    /// Text and reasoning blocks still streaming: `<type>:<block id>` →
    /// index in `parts`.
    open_blocks: HashMap<String, usize>,
    metadata: Value,
}

impl Assistant {
    fn new(turn: &str) -> Self {
        Self {
            id: assistant_message_id(turn),
            parts: Vec::new(),
            open_blocks: HashMap::new(),
            metadata: json!({"turnId": turn, "status": "running"}),
        }
    }

    fn into_message(self) -> Option<Value> {
        let ended = self.metadata["status"] != "running";
        (ended || !self.parts.is_empty()).then(|| {
            json!({
                "id": self.id,
                "role": "assistant",
                "metadata": self.metadata,
                "parts": self.parts,
            })
        })
    }

    fn tool(&mut self, call: &str) -> Option<&mut Value> {
        self.parts
            .iter_mut()
            .rev()
            .find(|p| p["type"] == "dynamic-tool" && p["toolCallId"] == call)
    }

    fn answered(&mut self, approval_id: &str, approved: bool, reason: Option<&str>) {
        let part = self
            .parts
            .iter_mut()
            .find(|p| p["approval"]["id"] == approval_id);
        if let Some(part) = part {
            part["approval"]["approved"] = json!(approved);
            if let Some(reason) = reason {
                part["approval"]["reason"] = json!(reason);
            }
            if part["state"] == "approval-requested" {
                part["state"] = json!("approval-responded");
            }
        }
    }

    fn chunk(&mut self, chunk: &Value) {
        let kind = chunk["type"].as_str().unwrap_or("");
        match kind {
            "start-step" => self.parts.push(json!({"type": "step-start"})),
            "text-start" | "reasoning-start" => {
                let part_type = &kind[..kind.len() - "-start".len()];
                let mut part = json!({"type": part_type, "text": "", "state": "streaming"});
                if part_type == "reasoning" {
                    part["id"] = chunk["id"].clone();
                }
                let block = format!("{part_type}:{}", chunk["id"].as_str().unwrap_or(""));
                self.open_blocks.insert(block, self.parts.len());
                self.parts.push(part);
            }
            "text-delta" | "reasoning-delta" | "text-end" | "reasoning-end" => {
                let part_type = kind.split('-').next().unwrap_or("");
                let block = format!("{part_type}:{}", chunk["id"].as_str().unwrap_or(""));
                let index = if kind.ends_with("-end") {
                    self.open_blocks.remove(&block)
                } else {
                    self.open_blocks.get(&block).copied()
                };
                if let Some(part) = index.and_then(|i| self.parts.get_mut(i)) {
                    if let Some(delta) = chunk["delta"].as_str() {
                        let text = format!("{}{delta}", part["text"].as_str().unwrap_or(""));
                        part["text"] = json!(text);
                    }
                    if kind.ends_with("-end") {
                        part["state"] = json!("done");
                    }
                }
            }
            "tool-input-available" => self.parts.push(json!({
                "type": "dynamic-tool",
                "toolName": chunk["toolName"],
                "toolCallId": chunk["toolCallId"],
                "state": "input-available",
                "input": chunk["input"],
            })),
            "tool-approval-request" => {
                let call = chunk["toolCallId"].as_str().unwrap_or("").to_string();
                let approval = json!({"id": chunk["approvalId"]});
                if let Some(part) = self.tool(&call) {
                    part["state"] = json!("approval-requested");
                    part["approval"] = approval;
                }
            }
            "tool-output-available" | "tool-output-error" => {
                let call = chunk["toolCallId"].as_str().unwrap_or("").to_string();
                if let Some(part) = self.tool(&call) {
                    if kind == "tool-output-available" {
                        part["state"] = json!("output-available");
                        part["output"] = chunk["output"].clone();
                    } else {
                        part["state"] = json!("output-error");
                        part["errorText"] = chunk["errorText"].clone();
                    }
                }
            }
            "finish" => {
                if let Some(metadata) = chunk.get("messageMetadata") {
                    self.metadata = metadata.clone();
                }
            }
            t if t.starts_with("data-") && chunk["transient"] != true => {
                self.parts
                    .push(json!({"type": t, "data": chunk["data"].clone()}));
            }
            // `start` (its metadata is the turn's), `finish-step`, `error`
            // (the status carries it), transient data.
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use harness_core::part::StreamPart;
    use harness_core::session::TurnMeta;
    use harness_core::turn::ApprovalAnswer;
    use harness_core::turn::TurnStatus;

    fn body(v: Value) -> Vec<u8> {
        serde_json::to_vec(&v).unwrap()
    }

    #[test]
    fn a_user_message_is_a_prompt_keyed_by_its_id() {
        let r = ChatRequest::parse(&body(json!({
            "id": "s1", "trigger": "submit-message",
            "messages": [
                {"id": "old", "role": "user", "parts": [{"type": "text", "text": "ignored"}]},
                {"id": "m2", "role": "user", "parts": [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]}
            ]
        })))
        .unwrap();
        assert_eq!(r.session.as_str(), "s1");
        assert_eq!(
            r.action,
            ChatAction::Prompt {
                message_id: "m2".into(),
                text: "hello\n\nthere".into()
            }
        );
        assert_eq!(prompt_key("m2"), "chat:m2");
    }

    #[test]
    fn bad_requests_are_refused_with_what_is_wrong() {
        let cases = [
            (json!([]), "must be an object"),
            (json!({"messages": []}), "no \"id\""),
            (json!({"id": "a/b", "messages": []}), "invalid session id"),
            (json!({"id": "s", "messages": []}), "is empty"),
            (json!({"id": "s", "messages": "x"}), "no \"messages\" array"),
            (
                json!({"id": "s", "trigger": "regenerate-message", "messages": []}),
                "regenerate is not supported",
            ),
            (
                json!({"id": "s", "trigger": "nope", "messages": []}),
                "unknown trigger",
            ),
            (
                json!({"id": "s", "messages": [{"id": "m", "role": "system", "parts": []}]}),
                "role is Some(\"system\")",
            ),
            (
                json!({"id": "s", "messages": [{"id": "m", "role": "user", "parts": []}]}),
                "has no text",
            ),
            (
                json!({"id": "s", "messages": [{"role": "user", "parts": [{"type": "text", "text": "x"}]}]}),
                "needs an \"id\"",
            ),
            (
                json!({"id": "s", "messages": [{"id": "m", "role": "user", "parts": [{"type": "file", "url": "x"}]}]}),
                "only hold text parts",
            ),
            (
                json!({"id": "s", "messages": [{"id": "m", "role": "assistant", "parts": [{"type": "text", "text": "x"}]}]}),
                "no approval response",
            ),
            (
                json!({"id": "s", "messages": [{"id": "m", "role": "assistant", "parts": [
                    {"type": "dynamic-tool", "state": "approval-responded", "approval": {"id": "a"}}]}]}),
                "approval.approved",
            ),
        ];
        for (b, needle) in cases {
            let e = ChatRequest::parse(&body(b.clone())).unwrap_err();
            assert!(e.status >= 400 && e.status < 500, "{b}: {e}");
            assert!(e.message.contains(needle), "{b}: {e}");
        }
        assert!(ChatRequest::parse(b"{")
            .unwrap_err()
            .message
            .contains("not JSON"));
    }

    fn meta(
        approval: Option<&str>,
        answers: Vec<ApprovalAnswer>,
        status: TurnStatus,
    ) -> SessionMeta {
        SessionMeta {
            turn: Some(TurnMeta {
                turn_id: "t1".into(),
                prompt: "p".into(),
                key: None,
                status,
                error: None,
                approval: approval.map(str::to_string),
                answers,
                abort: None,
                start_seq: 1,
            }),
            ..SessionMeta::default()
        }
    }

    fn answer(id: &str, approved: bool) -> Approval {
        Approval {
            approval_id: id.into(),
            approved,
            reason: None,
        }
    }

    #[test]
    fn approvals_answer_the_pending_request_or_repeat_an_answer() {
        let running = TurnStatus::AwaitingToolApproval;
        let parsed = ChatRequest::parse(&body(json!({
            "id": "s", "messages": [{"id": "t1-assistant", "role": "assistant", "parts": [
                {"type": "step-start"},
                {"type": "dynamic-tool", "toolCallId": "c", "state": "approval-responded",
                 "approval": {"id": "a1", "approved": true, "reason": "fine"}}]}]
        })))
        .unwrap();
        let ChatAction::Approvals(answers) = parsed.action else {
            panic!("approvals")
        };
        assert_eq!(answers[0].reason.as_deref(), Some("fine"));
        let plan = plan_approvals(&meta(Some("a1"), vec![], running), &answers).unwrap();
        assert_eq!((plan.turn_id.as_str(), plan.send.len()), ("t1", 1));
        // Retried after it was stored: nothing to send, the same stream.
        let given = ApprovalAnswer {
            approval_id: "a1".into(),
            approved: true,
            reason: None,
        };
        let plan = plan_approvals(&meta(None, vec![given.clone()], running), &answers).unwrap();
        assert!(plan.send.is_empty());
        assert_eq!(plan.approval_id, "a1");
        // The other answer to a request answered already.
        let e =
            plan_approvals(&meta(None, vec![given], running), &[answer("a1", false)]).unwrap_err();
        assert_eq!((e.status, e.code.as_str()), (409, "conflict"));
        // A request nobody made.
        let e =
            plan_approvals(&meta(Some("a1"), vec![], running), &[answer("zz", true)]).unwrap_err();
        assert_eq!((e.status, e.code.as_str()), (409, "no_pending_approval"));
        assert!(e.message.contains("waits on \"a1\""), "{e}");
        // No turn running.
        let e = plan_approvals(
            &meta(None, vec![], TurnStatus::Finished),
            &[answer("a1", true)],
        )
        .unwrap_err();
        assert_eq!((e.status, e.code.as_str()), (409, "no_active_turn"));
    }

    fn f(seq: u64, body: FrameBody) -> Frame {
        Frame {
            seq,
            at_ms: 0,
            body,
        }
    }

    fn part(turn: &str, part: StreamPart) -> FrameBody {
        FrameBody::Part {
            turn_id: turn.into(),
            part,
        }
    }

    #[test]
    fn history_folds_each_turn_into_a_user_and_an_assistant_message() {
        let frames = vec![
            f(
                1,
                FrameBody::UserMessage {
                    text: "run it".into(),
                    turn_id: Some("t1".into()),
                },
            ),
            f(
                2,
                part(
                    "t1",
                    StreamPart::StreamStart {
                        agent_session_id: None,
                    },
                ),
            ),
            f(
                3,
                part(
                    "t1",
                    StreamPart::ToolApprovalRequest {
                        approval_id: "a1".into(),
                        tool_call_id: "c1".into(),
                        tool_name: "Bash".into(),
                        input: json!({"command": "ls"}),
                    },
                ),
            ),
            f(
                4,
                part(
                    "t1",
                    StreamPart::ToolCall {
                        tool_call_id: "c1".into(),
                        tool_name: "Bash".into(),
                        input: json!({"command": "ls"}),
                    },
                ),
            ),
            f(
                5,
                FrameBody::ApprovalResponse {
                    approval_id: "a1".into(),
                    approved: true,
                    reason: Some("ok".into()),
                    turn_id: Some("t1".into()),
                },
            ),
            f(
                6,
                part(
                    "t1",
                    StreamPart::ToolResult {
                        tool_call_id: "c1".into(),
                        tool_name: "Bash".into(),
                        output: json!("a.txt"),
                        is_error: false,
                    },
                ),
            ),
            f(
                7,
                FrameBody::Message {
                    turn_id: "t1".into(),
                    id: "b1".into(),
                    kind: harness_core::frame::MessageKind::Text,
                    text: "Done.".into(),
                    interrupted: false,
                },
            ),
            f(
                8,
                part(
                    "t1",
                    StreamPart::Finish {
                        finish_reason: "end_turn".into(),
                        usage: Default::default(),
                    },
                ),
            ),
            f(
                9,
                FrameBody::TurnStatus {
                    turn_id: "t1".into(),
                    status: TurnStatus::Finished,
                    error: None,
                    code: None,
                    sandbox: None,
                    agent_session_id: None,
                    checkpoint: None,
                },
            ),
            f(
                10,
                FrameBody::UserMessage {
                    text: "again".into(),
                    turn_id: Some("t2".into()),
                },
            ),
            f(
                11,
                FrameBody::Message {
                    turn_id: "t2".into(),
                    id: "b2".into(),
                    kind: harness_core::frame::MessageKind::Reasoning,
                    text: "hmm".into(),
                    interrupted: false,
                },
            ),
        ];
        let h = history(&frames);
        assert_eq!(h.len(), 4, "{h:#?}");
        assert_eq!(
            h[0],
            json!({"id": "t1-user", "role": "user", "parts": [{"type": "text", "text": "run it"}]})
        );
        assert_eq!(h[1]["id"], "t1-assistant");
        assert_eq!(
            h[1]["metadata"],
            json!({"turnId": "t1", "status": "finished"})
        );
        assert_eq!(
            h[1]["parts"],
            json!([
                {"type": "step-start"},
                {"type": "dynamic-tool", "toolName": "Bash", "toolCallId": "c1", "state": "output-available",
                 "input": {"command": "ls"}, "output": "a.txt",
                 "approval": {"id": "a1", "approved": true, "reason": "ok"}},
                {"type": "text", "text": "Done.", "state": "done"},
            ])
        );
        assert_eq!(h[3]["metadata"]["status"], "running");
        assert_eq!(
            h[3]["parts"][1],
            json!({"type": "reasoning", "id": "b2", "text": "hmm", "state": "done"})
        );
    }

    #[test]
    fn a_rewind_drops_the_turns_after_its_turn_from_the_history() {
        let prompt = |seq, turn: &str| {
            f(
                seq,
                FrameBody::UserMessage {
                    text: format!("prompt of {turn}"),
                    turn_id: Some(turn.into()),
                },
            )
        };
        let reset = |seq, turn: Option<&str>| {
            f(
                seq,
                FrameBody::SandboxReset {
                    turn_id: turn.map(str::to_string),
                    checkpoint: None,
                    agent_session_id: None,
                    provider: None,
                    reason: "rewind".into(),
                },
            )
        };
        let ended = |seq, turn: &str| {
            f(
                seq,
                FrameBody::TurnStatus {
                    turn_id: turn.into(),
                    status: TurnStatus::Finished,
                    error: None,
                    code: None,
                    sandbox: None,
                    agent_session_id: None,
                    checkpoint: None,
                },
            )
        };
        let ids = |frames: &[Frame]| -> Vec<String> {
            history(frames)
                .iter()
                .map(|m| m["id"].as_str().unwrap().to_string())
                .collect()
        };
        let mut frames = vec![
            prompt(1, "t1"),
            ended(2, "t1"),
            prompt(3, "t2"),
            ended(4, "t2"),
            reset(5, Some("t1")),
            prompt(6, "t3"),
        ];
        assert_eq!(ids(&frames), ["t1-user", "t1-assistant", "t3-user"]);
        frames.push(reset(7, None));
        assert!(ids(&frames).is_empty());
    }

    #[test]
    fn a_turn_stream_ends_at_its_status_and_pauses_at_an_approval() {
        let mut m = turn_mapper("t2");
        let map = |m: &mut UiStreamMapper, frame: Frame| {
            m.map(&harness_core::actor::ServerMessage::Frame { frame })
        };
        // Another turn's frames are not this stream's.
        assert!(map(
            &mut m,
            f(
                1,
                part(
                    "t1",
                    StreamPart::ToolCall {
                        tool_call_id: "x".into(),
                        tool_name: "Bash".into(),
                        input: json!({})
                    }
                )
            )
        )
        .is_empty());
        let out = map(
            &mut m,
            f(
                2,
                part(
                    "t2",
                    StreamPart::ToolApprovalRequest {
                        approval_id: "a".into(),
                        tool_call_id: "c".into(),
                        tool_name: "Bash".into(),
                        input: json!({}),
                    },
                ),
            ),
        );
        let types: Vec<_> = out.iter().map(|c| c["type"].as_str().unwrap()).collect();
        assert_eq!(
            types,
            [
                "start",
                "start-step",
                "tool-input-available",
                "tool-approval-request"
            ]
        );
        assert_eq!(out[0]["messageId"], "t2-assistant");
        assert_eq!(out[0]["messageMetadata"], json!({"turnId": "t2"}));
        assert_eq!(m.take_approval_request().as_deref(), Some("a"));
        assert_eq!(m.take_approval_request(), None);
        let paused = m.pause_for_approval();
        assert_eq!(paused.last().unwrap()["finishReason"], "tool-calls");
        assert_eq!(
            paused.last().unwrap()["messageMetadata"]["status"],
            "awaiting_tool_approval"
        );
        assert!(m.is_done());

        // The agent's finish does not end a turn's stream; its status does.
        let mut m = turn_mapper("t2");
        let out = map(
            &mut m,
            f(
                3,
                part(
                    "t2",
                    StreamPart::Finish {
                        finish_reason: "end_turn".into(),
                        usage: Default::default(),
                    },
                ),
            ),
        );
        assert!(!m.is_done(), "{out:?}");
        let out = map(
            &mut m,
            f(
                4,
                FrameBody::TurnStatus {
                    turn_id: "t2".into(),
                    status: TurnStatus::Failed,
                    error: Some("aborted: stop".into()),
                    code: None,
                    sandbox: None,
                    agent_session_id: None,
                    checkpoint: None,
                },
            ),
        );
        let types: Vec<_> = out.iter().map(|c| c["type"].as_str().unwrap()).collect();
        assert_eq!(types, ["start", "error", "finish"]);
        assert_eq!(
            out[2]["messageMetadata"],
            json!({"turnId": "t2", "status": "failed", "error": "aborted: stop"})
        );
        assert!(m.is_done());
    }
}
