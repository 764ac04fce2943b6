//! A session as the AI SDK's chat endpoint (`useChat` with its default
//! transport, `api: <server>/v1/chat`, the chat id = the session id): the
//! HTTP framing of `session_api::chat`, which holds the rules.
//!
//! - `POST /v1/chat`: a prompt or approval answers, then the turn's UI
//!   message stream;
//! - `GET /v1/chat/{id}/stream`: the running turn replayed and followed
//!   (204 when none runs);
//! - `GET /v1/chat/{id}/messages`: the session as `UIMessage[]`;
//! - `POST /v1/chat/{id}/abort`: abort the running turn and answer how it
//!   ended (`useChat`'s `stop()` only drops the connection, which never
//!   stops a turn).

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use axum::Json;
use harness_core::actor::{ClientMessage, Role, ServerMessage};
use harness_core::frame::{Frame, FrameBody};
use harness_core::SessionId;
use serde_json::{json, Value};
use session_api::chat::{self, ChatAction, ChatRequest};
use session_api::ui_stream::UiStreamMapper;
use session_runtime::{Connection, Outbound};
use tokio::sync::mpsc;

use crate::auth::GrantRole;
use crate::error::ApiError;
use crate::http::{
    catch_up_and_connect, read_body, session_id, sse_from, AppState, Params, Shared,
    ANSWER_TIMEOUT, READERS,
};
use crate::ui_stream::UI_STREAM_HEADER;

/// How long `POST …/abort` waits for the turn to end before answering.
const ABORT_WAIT: Duration = Duration::from_secs(60);

const CLIENT: &[GrantRole] = &[GrantRole::Client];

pub(crate) async fn post(
    State(state): Shared,
    Query(params): Params,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    // A wrong token is refused before a body of up to 32 MiB is read; the
    // session it may act on is named in the body.
    let token = crate::auth::bearer(&headers, params.get("access_token").map(String::as_str));
    session_api::auth::grants_of(
        &state.config.tokens,
        state.config.insecure_no_auth,
        token.as_deref(),
    )?;
    let bytes = read_body(body, chat::MAX_CHAT_BODY).await?;
    let request = ChatRequest::parse(&bytes)?;
    let id = request.session;
    state.auth(&headers, &params, Some(&id), CLIENT)?;
    let info = state.hub.log().info(&id).await?;
    match request.action {
        ChatAction::Prompt { message_id, text } => {
            let prompt = ClientMessage::Prompt {
                text,
                turn_id: None,
                key: Some(chat::prompt_key(&message_id)),
            };
            let mut conn = state.hub.request(&id, prompt).await?;
            let acked = conn.answer(ANSWER_TIMEOUT).await?;
            let turn = acked.turn_id.ok_or_else(|| {
                ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "append_failed",
                    "the session stored the prompt but named no turn",
                )
            })?;
            // A retried request (duplicate) streams the same turn again,
            // from its prompt.
            Ok(stream_turn(state, id, turn, acked.seq.saturating_sub(1), 0))
        }
        ChatAction::Approvals(answers) => {
            let plan = chat::plan_approvals(&info.meta, &answers)?;
            let start = info
                .meta
                .active_turn()
                .map_or(0, |t| t.start_seq.saturating_sub(1));
            // The client has the turn's message up to the request: the
            // stream continues after it.
            let request_seq = find_request(&state, &id, start, &plan.approval_id).await?;
            for answer in plan.send {
                let message = ClientMessage::ApprovalResponse {
                    approval_id: answer.approval_id,
                    approved: answer.approved,
                    reason: answer.reason,
                };
                let mut conn = state.hub.request(&id, message).await?;
                conn.answer(ANSWER_TIMEOUT).await?;
            }
            Ok(stream_turn(state, id, plan.turn_id, start, request_seq))
        }
    }
}

/// The seq of the turn's `tool-approval-request` with `approval_id`
/// (reading the turn's frames from `after`); 0 if the log has none.
async fn find_request(
    state: &AppState,
    id: &SessionId,
    after: u64,
    approval_id: &str,
) -> Result<u64, ApiError> {
    let mut cursor = after;
    loop {
        let page = state.hub.log().read(id, cursor, crate::http::PAGE).await?;
        let Some(last) = page.last() else {
            return Ok(0);
        };
        cursor = last.seq;
        if let Some(frame) = page
            .iter()
            .find(|f| chat::is_approval_request(f, approval_id))
        {
            return Ok(frame.seq);
        }
    }
}

pub(crate) async fn resume(
    State(state): Shared,
    Path(id): Path<String>,
    Query(params): Params,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let id = session_id(&id)?;
    state.auth(&headers, &params, Some(&id), READERS)?;
    let info = state.hub.log().info(&id).await?;
    let Some(turn) = info.meta.active_turn() else {
        return Ok(StatusCode::NO_CONTENT.into_response());
    };
    let (turn, after) = (turn.turn_id.clone(), turn.start_seq.saturating_sub(1));
    Ok(stream_turn(state, id, turn, after, 0))
}

pub(crate) async fn messages(
    State(state): Shared,
    Path(id): Path<String>,
    Query(params): Params,
    headers: HeaderMap,
) -> Result<Json<Vec<Value>>, ApiError> {
    let id = session_id(&id)?;
    state.auth(&headers, &params, Some(&id), READERS)?;
    let mut frames = Vec::new();
    let mut cursor = 0;
    loop {
        let page = state.hub.log().read(&id, cursor, crate::http::PAGE).await?;
        let Some(last) = page.last() else { break };
        cursor = last.seq;
        frames.extend(page);
    }
    if frames.is_empty() {
        // 404 for a session that does not exist.
        state.hub.log().info(&id).await?;
    }
    Ok(Json(chat::history(&frames)))
}

pub(crate) async fn abort(
    State(state): Shared,
    Path(id): Path<String>,
    Query(params): Params,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<Value>, ApiError> {
    let id = session_id(&id)?;
    state.auth(&headers, &params, Some(&id), CLIENT)?;
    let bytes = read_body(body, 64 * 1024).await?;
    let reason = if bytes.iter().all(u8::is_ascii_whitespace) {
        None
    } else {
        let body: Value = serde_json::from_slice(&bytes)
            .map_err(|e| ApiError::invalid(format!("the abort body is not JSON: {e}")))?;
        match body.get("reason") {
            None | Some(Value::Null) => None,
            Some(Value::String(r)) => Some(r.clone()),
            Some(_) => return Err(ApiError::invalid("\"reason\" must be a string")),
        }
    };
    let info = state.hub.log().info(&id).await?;
    let Some(turn) = info.meta.active_turn().map(|t| t.turn_id.clone()) else {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "no_active_turn",
            "no turn is running",
        ));
    };
    let message = ClientMessage::Abort {
        turn_id: Some(turn.clone()),
        reason: Some(reason.unwrap_or_else(|| "stopped in the chat".into())),
    };
    let mut conn = state.hub.request(&id, message).await?;
    let acked = conn.answer(ANSWER_TIMEOUT).await?;
    drop(conn);
    // Wait for the turn's end (the agent killed, the status recorded).
    let mut follow = state
        .hub
        .connect(&id, Role::Client, Some(acked.seq))
        .await?;
    let ended = tokio::time::timeout(ABORT_WAIT, async {
        while let Some(out) = follow.recv().await {
            let Ok(ServerMessage::Frame { frame }) = out.into_message() else {
                continue;
            };
            if let FrameBody::TurnStatus {
                turn_id,
                status,
                error,
                ..
            } = frame.body
            {
                if turn_id == turn && status.is_terminal() {
                    return Some((status, error));
                }
            }
        }
        None
    })
    .await
    .ok()
    .flatten();
    let (status, error) = match ended {
        Some(end) => end,
        None => {
            let info = state.hub.log().info(&id).await?;
            let t = info.meta.turn.filter(|t| t.turn_id == turn);
            (
                t.as_ref()
                    .map_or(harness_core::turn::TurnStatus::NotStarted, |t| t.status),
                t.and_then(|t| t.error),
            )
        }
    };
    Ok(Json(
        json!({"turnId": turn, "status": status, "error": error}),
    ))
}

/// The UI message stream of turn `turn`: its frames after `after` mapped
/// (those up to `silent_until` only to know the message so far, for a
/// stream that continues a message the client has), then live, until the
/// turn ends or waits for an answer to a permission request.
fn stream_turn(
    state: Arc<AppState>,
    id: SessionId,
    turn: String,
    after: u64,
    silent_until: u64,
) -> Response {
    let (tx, rx) = mpsc::channel::<Event>(256);
    tokio::spawn(async move {
        let mut pump = TurnPump {
            mapper: chat::turn_mapper(&turn),
            silent_until,
            candidate: None,
        };
        let mut pending = Vec::new();
        let caught = catch_up_and_connect(&state, &state.hub, &id, after, |frame| {
            pending.extend(pump.frame(frame));
            !pump.mapper.is_done()
        })
        .await;
        let mut open = true;
        for chunk in pending {
            if !send(&tx, &chunk).await {
                open = false;
                break;
            }
        }
        match caught {
            Ok(Some((conn, cursor))) if open => {
                pump.follow(&state, &id, conn, cursor, &tx).await;
            }
            Ok(_) => {}
            Err(e) => {
                let chunk = json!({"type": "error", "errorText": e.message});
                send(&tx, &chunk).await;
            }
        }
        let _ = tx.send(Event::default().data("[DONE]")).await;
    });
    let mut response = sse_from(rx).into_response();
    response
        .headers_mut()
        .insert(UI_STREAM_HEADER, HeaderValue::from_static("v1"));
    response
}

async fn send(tx: &mpsc::Sender<Event>, chunk: &Value) -> bool {
    tx.send(Event::default().data(chunk.to_string()))
        .await
        .is_ok()
}

struct TurnPump {
    mapper: UiStreamMapper,
    silent_until: u64,
    /// A permission request mapped and not answered in what was read so
    /// far: once caught up, the stream pauses there if it is still pending.
    candidate: Option<String>,
}

impl TurnPump {
    fn frame(&mut self, frame: Frame) -> Vec<Value> {
        let seq = frame.seq;
        if let FrameBody::ApprovalResponse { approval_id, .. } = &frame.body {
            if self.candidate.as_deref() == Some(approval_id.as_str()) {
                self.candidate = None;
            }
        }
        let chunks = self.mapper.map(&ServerMessage::Frame { frame });
        if let Some(request) = self.mapper.take_approval_request() {
            self.candidate = Some(request);
        }
        if seq <= self.silent_until {
            if seq == self.silent_until {
                self.mapper.continue_message();
                self.candidate = None;
            }
            return Vec::new();
        }
        chunks
    }

    /// Map live traffic until the turn ends, pauses for an approval, or the
    /// reader leaves.
    async fn follow(
        &mut self,
        state: &AppState,
        id: &SessionId,
        mut conn: Connection,
        mut cursor: u64,
        tx: &mpsc::Sender<Event>,
    ) {
        while !self.mapper.is_done() {
            let next = match conn.try_recv() {
                Some(out) => Some(out),
                None => {
                    // Caught up: a request still unanswered ends the stream.
                    if let Some(request) = self.candidate.take() {
                        let pending = state.hub.log().info(id).await.ok().is_some_and(|info| {
                            info.meta
                                .active_turn()
                                .is_some_and(|t| t.approval.as_deref() == Some(request.as_str()))
                        });
                        if pending {
                            for chunk in self.mapper.pause_for_approval() {
                                if !send(tx, &chunk).await {
                                    return;
                                }
                            }
                            return;
                        }
                    }
                    tokio::select! {
                        out = conn.recv() => out,
                        _ = tx.closed() => return,
                    }
                }
            };
            let Some(Ok(message)) = next.map(Outbound::into_message) else {
                return;
            };
            let chunks = match message {
                ServerMessage::Frame { frame } if frame.seq <= cursor => continue,
                ServerMessage::Frame { frame } => {
                    cursor = frame.seq;
                    self.frame(frame)
                }
                other => self.mapper.map(&other),
            };
            for chunk in chunks {
                if !send(tx, &chunk).await {
                    return;
                }
            }
        }
    }
}
