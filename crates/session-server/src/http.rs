//! The HTTP surface: routes, auth checks, limits, SSE and WebSocket loops.
//!
//! Every write goes through the session's actor; reads of stored history
//! (frames, export, the catch-up part of SSE and WebSocket replays) go to
//! the log directly, so a reader with a long history does not hold up the
//! actor: it reads up to the end itself and then connects with `after` = the
//! last seq it read; the actor replays only what was stored in between.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::ws::{CloseFrame, Message, WebSocket, WebSocketUpgrade};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::{SinkExt, StreamExt};
use harness_core::actor::{ClientMessage, Role, ServerMessage};
use harness_core::frame::Frame;
use harness_core::log::LogInfo;
use harness_core::SessionId;
use tokio::sync::mpsc;

use crate::auth::{authorize, bearer, GrantRole};
use crate::error::ApiError;
use session_runtime::{Connection, Hub, Outbound, SharedFrame};

/// Frames read from the log per page (catch-up, export).
pub(crate) const PAGE: usize = harness_core::actor_driver::REPLAY_PAGE;
use crate::ui_stream::{UiStreamMapper, UI_STREAM_HEADER};
use crate::ServerConfig;
use session_api::request::ENVELOPE_SLACK;
use session_api::sse::{EventsReader, EventsStep, KEEP_ALIVE_INTERVAL};
use session_api::ws::{self, Inbound};

/// How long an HTTP write waits for the actor's answer.
pub(crate) const ANSWER_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug)]
pub(crate) struct AppState {
    pub(crate) hub: Arc<Hub>,
    pub(crate) config: ServerConfig,
    /// Set when turns run in a remote runner (`GET /v1/runner`).
    pub(crate) runners: Option<Arc<crate::runners::RemoteRunners>>,
}

pub(crate) type Shared = State<Arc<AppState>>;
pub(crate) type Params = Query<HashMap<String, String>>;

pub(crate) fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/", get(crate::web::index))
        .route("/index.html", get(crate::web::index))
        .route("/app.js", get(crate::web::script))
        .route("/app.css", get(crate::web::style))
        .route("/favicon.ico", get(crate::web::favicon))
        .route("/v1/sessions", post(create).get(list))
        .route("/v1/search", get(search))
        .route("/v1/sessions/{id}", get(info).delete(delete))
        .route("/v1/sessions/{id}/trim", post(trim))
        .route("/v1/sessions/{id}/ws", get(websocket))
        .route("/v1/sessions/{id}/messages", post(post_message))
        .route("/v1/sessions/{id}/events", get(events))
        .route("/v1/sessions/{id}/frames", get(frames))
        .route("/v1/sessions/{id}/export", get(export))
        .route("/v1/sessions/{id}/verify", get(verify))
        .route("/v1/sessions/{id}/fork", post(fork))
        .route("/v1/sessions/{id}/seal", post(seal))
        .route("/v1/sessions/{id}/rewind", post(rewind))
        .route("/v1/sessions/{id}/ui-stream", get(ui_stream))
        .route("/v1/chat", post(crate::chat::post))
        .route("/v1/chat/{id}/stream", get(crate::chat::resume))
        .route("/v1/chat/{id}/messages", get(crate::chat::messages))
        .route("/v1/chat/{id}/abort", post(crate::chat::abort))
        .route("/v1/runner", get(runner_channel))
        .fallback(|| async {
            ApiError::new(StatusCode::NOT_FOUND, "not_found", "no such endpoint")
        })
        .layer(axum::middleware::from_fn(trace_request))
        .with_state(state)
}

/// One `http.request` span per request, named by its route (not its path:
/// session ids would make every route a new name) and carrying the session
/// id and the status. A streamed response's span ends when its headers are
/// sent; what the stream carries is traced by the turn that writes it.
async fn trace_request(request: axum::extract::Request, next: axum::middleware::Next) -> Response {
    use tracing::Instrument;
    let route = request
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .map_or("unmatched", |p| p.as_str())
        .to_string();
    let session = request
        .uri()
        .path()
        .strip_prefix("/v1/sessions/")
        .or_else(|| request.uri().path().strip_prefix("/v1/chat/"))
        .and_then(|rest| rest.split('/').next())
        .unwrap_or("")
        .to_string();
    let span = tracing::info_span!(
        "http.request",
        http.method = %request.method(),
        http.route = %route,
        session.id = %session,
        http.status = tracing::field::Empty,
    );
    let response = next.run(request).instrument(span.clone()).await;
    span.record("http.status", response.status().as_u16());
    response
}

pub(crate) const READERS: &[GrantRole] = &[GrantRole::Client, GrantRole::Runner];
const HOST: &[GrantRole] = &[GrantRole::Host];

impl AppState {
    pub(crate) fn auth(
        &self,
        headers: &HeaderMap,
        params: &HashMap<String, String>,
        session: Option<&SessionId>,
        allowed: &[GrantRole],
    ) -> Result<GrantRole, ApiError> {
        let token = bearer(headers, params.get("access_token").map(String::as_str));
        authorize(
            &self.config.tokens,
            self.config.insecure_no_auth,
            token.as_deref(),
            session,
            allowed,
        )
    }

    pub(crate) fn body_limit(&self) -> usize {
        self.config.max_frame_bytes.saturating_add(ENVELOPE_SLACK)
    }
}

// Ids, parameters and the create body are read as the Worker reads them
// (`session-api`).
pub(crate) fn session_id(raw: &str) -> Result<SessionId, ApiError> {
    session_api::request::session_id(raw).map_err(ApiError::from)
}

fn param_u64(params: &HashMap<String, String>, name: &str) -> Result<Option<u64>, ApiError> {
    session_api::request::param_u64(params, name).map_err(ApiError::from)
}

fn param_flag(params: &HashMap<String, String>, name: &str) -> bool {
    session_api::request::param_flag(params, name)
}

/// Read a request body, refusing more than `limit` bytes with a JSON 413.
pub(crate) async fn read_body(body: Body, limit: usize) -> Result<axum::body::Bytes, ApiError> {
    axum::body::to_bytes(body, limit).await.map_err(|e| {
        // axum names no type for the limit error (it is http-body-util's
        // `LengthLimitError`); its message is stable.
        if e.to_string().contains("length limit") {
            ApiError::too_large(format!(
                "request body exceeds {limit} bytes (frame limit plus envelope)"
            ))
        } else {
            ApiError::invalid(format!("could not read the request body: {e}"))
        }
    })
}

// ---- sessions --------------------------------------------------------------

async fn create(
    State(state): Shared,
    Query(params): Params,
    headers: HeaderMap,
    body: Body,
) -> Result<(StatusCode, Json<LogInfo>), ApiError> {
    let bytes = read_body(body, session_api::request::MAX_CREATE_BODY).await?;
    let body = session_api::request::CreateSession::parse(&bytes)?;
    let id = body.session_id(&uuid::Uuid::new_v4().simple().to_string())?;
    state.auth(&headers, &params, Some(&id), HOST)?;
    let config = body.config(&state.config.agents, &state.config.providers)?;
    let info = state
        .hub
        .log()
        .create_with(&id, Some(config.clone()))
        .await?;
    session_api::request::check_created(&info, &config)?;
    Ok((StatusCode::CREATED, Json(info)))
}

async fn list(
    State(state): Shared,
    Query(params): Params,
    headers: HeaderMap,
) -> Result<Json<Vec<LogInfo>>, ApiError> {
    state.auth(&headers, &params, None, HOST)?;
    let (after, limit) = session_api::request::sessions_page(&params)?;
    let page = state.hub.log().list_page(after.as_ref(), limit).await?;
    Ok(Json(page))
}

/// `GET /v1/search?q=`: frames across every session, best first
/// (`docs/search.md`). Spans sessions, so it takes a host's grant, as the
/// session list does.
async fn search(
    State(state): Shared,
    Query(params): Params,
    headers: HeaderMap,
) -> Result<Json<Vec<harness_core::search::SearchHit>>, ApiError> {
    state.auth(&headers, &params, None, HOST)?;
    let query = session_api::request::search_query(&params)?;
    Ok(Json(state.hub.log().search(&query).await?))
}

async fn info(
    State(state): Shared,
    Path(id): Path<String>,
    Query(params): Params,
    headers: HeaderMap,
) -> Result<Json<LogInfo>, ApiError> {
    let id = session_id(&id)?;
    state.auth(&headers, &params, Some(&id), READERS)?;
    Ok(Json(state.hub.log().info(&id).await?))
}

async fn frames(
    State(state): Shared,
    Path(id): Path<String>,
    Query(params): Params,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let id = session_id(&id)?;
    state.auth(&headers, &params, Some(&id), READERS)?;
    let (after, limit) = session_api::request::frames_page(&params)?;
    // The first page answers for the session (404) before the body starts.
    let first = state.hub.log().read(&id, after, limit.min(PAGE)).await?;
    Ok(frames_array(state, id, first, u64::MAX, limit))
}

async fn export(
    State(state): Shared,
    Path(id): Path<String>,
    Query(params): Params,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let id = session_id(&id)?;
    state.auth(&headers, &params, Some(&id), READERS)?;
    let info = state.hub.log().info(&id).await?;
    let until = param_u64(&params, "until")?.unwrap_or(info.last_seq);
    if until > info.last_seq {
        return Err(ApiError::invalid(format!(
            "cannot export {id} until={until}: the log ends at seq {}",
            info.last_seq
        )));
    }
    if session_api::request::export_format(&params)? == session_api::request::ExportFormat::Markdown
    {
        let mut frames = Vec::new();
        loop {
            let after = frames.last().map_or(info.kept_after(), |f: &Frame| f.seq);
            let page = read_page(&state, &id, after, until, usize::MAX).await?;
            if page.is_empty() {
                break;
            }
            frames.extend(page);
        }
        let document = session_api::markdown::session_markdown(&info, &frames);
        return Ok((
            [(
                axum::http::header::CONTENT_TYPE,
                session_api::markdown::MARKDOWN_CONTENT_TYPE,
            )],
            document,
        )
            .into_response());
    }
    // What retention kept: from the cut, if the log was trimmed.
    let first = read_page(&state, &id, info.kept_after(), until, usize::MAX).await?;
    Ok(frames_array(state, id, first, until, usize::MAX))
}

async fn verify(
    State(state): Shared,
    Path(id): Path<String>,
    Query(params): Params,
    headers: HeaderMap,
) -> Result<Json<session_api::request::Verified>, ApiError> {
    let id = session_id(&id)?;
    state.auth(&headers, &params, Some(&id), READERS)?;
    let report =
        harness_core::log::verify_log(state.hub.log().clone(), &id, &state.config.chain_key)
            .await?;
    Ok(Json(session_api::request::Verified::new(id, report)))
}

/// Frames `after < seq <= until`, at most `max` and one page of them.
async fn read_page(
    state: &AppState,
    id: &SessionId,
    after: u64,
    until: u64,
    max: usize,
) -> Result<Vec<Frame>, ApiError> {
    if after >= until || max == 0 {
        return Ok(Vec::new());
    }
    let want = usize::try_from(until - after)
        .unwrap_or(PAGE)
        .min(PAGE)
        .min(max);
    let mut page = state.hub.log().read(id, after, want).await?;
    page.retain(|f| f.seq <= until);
    Ok(page)
}

/// A JSON array of frames, `first` (a page already read, so a failing
/// first read is still an error status) and then the following ones up to
/// `until`, at most `max` in all, written a page at a time: no array of
/// 100,000 frames in memory, and the client receives while the server
/// reads. A read failing midway ends the body early, so the client sees
/// invalid JSON rather than a short array that parses.
fn frames_array(
    state: Arc<AppState>,
    id: SessionId,
    first: Vec<Frame>,
    until: u64,
    max: usize,
) -> Response {
    struct Pages {
        state: Arc<AppState>,
        id: SessionId,
        next: Option<Vec<Frame>>,
        cursor: u64,
        left: usize,
        until: u64,
        started: bool,
        done: bool,
    }
    let pages = Pages {
        state,
        id,
        next: Some(first),
        cursor: 0,
        left: max,
        until,
        started: false,
        done: false,
    };
    let body = futures::stream::unfold(pages, |mut p| async move {
        if p.done {
            return None;
        }
        let page = match p.next.take() {
            Some(page) => page,
            None => match read_page(&p.state, &p.id, p.cursor, p.until, p.left).await {
                Ok(page) => page,
                Err(e) => return Some((Err(std::io::Error::other(e.message)), p)),
            },
        };
        let mut out = Vec::with_capacity(page.len() * 256 + 2);
        if !p.started {
            out.push(b'[');
        }
        for frame in page.iter().take(p.left) {
            if p.started || out.len() > 1 {
                out.push(b',');
            }
            // Frames are plain data: encoding cannot fail.
            let _ = serde_json::to_writer(&mut out, frame);
            p.cursor = frame.seq;
        }
        p.started = true;
        p.left = p.left.saturating_sub(page.len());
        if page.is_empty() || p.left == 0 || p.cursor >= p.until {
            out.push(b']');
            p.done = true;
        }
        Some((Ok(axum::body::Bytes::from(out)), p))
    });
    (
        [(
            axum::http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        Body::from_stream(body),
    )
        .into_response()
}

async fn fork(
    State(state): Shared,
    Path(id): Path<String>,
    Query(params): Params,
    headers: HeaderMap,
) -> Result<(StatusCode, Json<LogInfo>), ApiError> {
    let source = session_id(&id)?;
    let target = match params.get("target") {
        Some(t) => session_id(t)?,
        None => SessionId::parse(format!(
            "{}-fork-{}",
            &source.as_str()[..source.as_str().len().min(80)],
            uuid::Uuid::new_v4().simple()
        ))?,
    };
    state.auth(&headers, &params, Some(&source), HOST)?;
    state.auth(&headers, &params, Some(&target), HOST)?;
    let until = match param_u64(&params, "until")? {
        Some(n) => n,
        None => state.hub.log().info(&source).await?.last_seq,
    };
    // A new session with no actor yet: written through the log. Unsealed,
    // its sandbox is a new one, on `provider` (default: the source's),
    // holding the tree of the last turn end at or before `until`.
    let info = harness_core::fork::fork_session(
        state.hub.log().as_ref(),
        &source,
        until,
        &target,
        params.get("provider").cloned(),
        param_flag(&params, "seal"),
    )
    .await?;
    Ok((StatusCode::CREATED, Json(info)))
}

/// `POST /v1/sessions/{id}/rewind?turn=T`: the session goes back to the
/// end of turn `T` in place (a host operation): the actor records a
/// `sandbox-reset`, and the next turn runs in a new sandbox made from that
/// turn's checkpoint, the agent continuing from there.
async fn rewind(
    State(state): Shared,
    Path(id): Path<String>,
    Query(params): Params,
    headers: HeaderMap,
) -> Result<Json<serde_json::Value>, ApiError> {
    let id = session_id(&id)?;
    state.auth(&headers, &params, Some(&id), HOST)?;
    let turn_id = params
        .get("turn")
        .filter(|t| !t.is_empty())
        .ok_or_else(|| {
            ApiError::invalid("rewind needs ?turn=<turn id> (the turn whose end to go back to)")
        })?
        .clone();
    let mut conn = state
        .hub
        .request(&id, ClientMessage::Rewind { turn_id })
        .await?;
    let acked = conn.answer(ANSWER_TIMEOUT).await?;
    Ok(Json(session_api::request::ack(
        acked.seq,
        acked.duplicate,
        acked.turn_id,
    )))
}

async fn seal(
    State(state): Shared,
    Path(id): Path<String>,
    Query(params): Params,
    headers: HeaderMap,
) -> Result<Json<LogInfo>, ApiError> {
    let id = session_id(&id)?;
    state.auth(&headers, &params, Some(&id), HOST)?;
    state.hub.seal(&id).await?;
    Ok(Json(state.hub.log().info(&id).await?))
}

/// `DELETE /v1/sessions/{id}` (retention): 204 once the log and the
/// sandbox the session owns are gone (`Hub::delete`), or 409 while a turn
/// runs.
async fn delete(
    State(state): Shared,
    Path(id): Path<String>,
    Query(params): Params,
    headers: HeaderMap,
) -> Result<StatusCode, ApiError> {
    let id = session_id(&id)?;
    state.auth(&headers, &params, Some(&id), HOST)?;
    let removal = state.hub.delete(&id).await?;
    tracing::info!(session = %id, sandbox = ?removal, "deleted a session");
    Ok(StatusCode::NO_CONTENT)
}

/// `POST /v1/sessions/{id}/trim` `{"through": N}` (retention): frames
/// `1..=N` go; the answer is the session's info with its cut.
async fn trim(
    State(state): Shared,
    Path(id): Path<String>,
    Query(params): Params,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Result<Json<LogInfo>, ApiError> {
    let id = session_id(&id)?;
    state.auth(&headers, &params, Some(&id), HOST)?;
    let through = session_api::request::trim_through(&body)?;
    Ok(Json(state.hub.log().trim(&id, through).await?))
}

// ---- writes over HTTP ------------------------------------------------------

async fn post_message(
    State(state): Shared,
    Path(id): Path<String>,
    Query(params): Params,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<serde_json::Value>, ApiError> {
    let id = session_id(&id)?;
    let grant = state.auth(&headers, &params, Some(&id), &[GrantRole::Client])?;
    let bytes = read_body(body, state.body_limit()).await?;
    let message: ClientMessage = serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::invalid(format!("malformed client message: {e}")))?;
    session_api::auth::check_client_message(&message, grant)?;
    // One command to the actor: connect, the message, and close once handled.
    let mut conn = state.hub.request(&id, message).await?;
    let acked = conn.answer(ANSWER_TIMEOUT).await?;
    Ok(Json(session_api::request::ack(
        acked.seq,
        acked.duplicate,
        acked.turn_id,
    )))
}

// ---- reading live: catch-up then connect ------------------------------------

/// Send stored frames after `after` to `send` straight from the log, then
/// connect to the actor at the last seq sent. Returns the connection and the
/// cursor, or `None` when the receiver went away.
pub(crate) async fn catch_up_and_connect<F>(
    state: &AppState,
    hub: &Arc<Hub>,
    id: &SessionId,
    after: u64,
    mut send: F,
) -> Result<Option<(Connection, u64)>, ApiError>
where
    F: FnMut(Frame) -> bool,
{
    let mut cursor = after;
    loop {
        let page = state.hub.log().read(id, cursor, PAGE).await?;
        let Some(last) = page.last() else { break };
        cursor = last.seq;
        for frame in page {
            if !send(frame) {
                return Ok(None);
            }
        }
    }
    let conn = hub.connect(id, Role::Client, Some(cursor)).await?;
    Ok(Some((conn, cursor)))
}

/// An SSE body fed by a channel; the producer notices a gone reader through
/// `Sender::closed`.
pub(crate) fn sse_from(
    rx: mpsc::Receiver<Event>,
) -> Sse<impl futures::Stream<Item = Result<Event, Infallible>>> {
    let stream = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|e| (Ok::<_, Infallible>(e), rx))
    });
    Sse::new(stream).keep_alive(KeepAlive::new().interval(KEEP_ALIVE_INTERVAL))
}

async fn events(
    State(state): Shared,
    Path(id): Path<String>,
    Query(params): Params,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let id = session_id(&id)?;
    state.auth(&headers, &params, Some(&id), READERS)?;
    let after = session_api::request::events_after(
        headers.get("last-event-id").map(|v| v.as_bytes()),
        &params,
    )?;
    let info = state.hub.log().info(&id).await?;
    // A reader from the start of a trimmed log starts at its cut; one
    // resuming from inside the cut is told those frames are gone (410).
    let after = info.reader_start(after)?;
    let pump = EventPump {
        state,
        id,
        reader: EventsReader::new(after, info.sealed),
        conn: None,
        keep_alive: Box::pin(tokio::time::sleep(KEEP_ALIVE_INTERVAL)),
        last_sent: tokio::time::Instant::now(),
    };
    let body = futures::stream::unfold(pump, |mut pump| async move {
        let chunk = pump.next_chunk().await?;
        Some((Ok::<_, Infallible>(axum::body::Bytes::from(chunk)), pump))
    });
    Ok((
        [
            (
                axum::http::header::CONTENT_TYPE,
                HeaderValue::from_static("text/event-stream"),
            ),
            (
                axum::http::header::CACHE_CONTROL,
                HeaderValue::from_static("no-cache"),
            ),
        ],
        Body::from_stream(body),
    )
        .into_response())
}

/// The body of `GET /events`, produced as the client reads it: the steps of
/// a `session_api::sse::EventsReader` (stored frames a page per chunk, then
/// what the actor sends, everything already queued per chunk), with a
/// keep-alive comment after a quiet spell. A gone client drops it (and with
/// it the connection).
struct EventPump {
    state: Arc<AppState>,
    id: SessionId,
    reader: EventsReader,
    conn: Option<Connection>,
    /// Fires [`KEEP_ALIVE_INTERVAL`] after `last_sent` (re-armed only when
    /// it fires, not per chunk).
    keep_alive: std::pin::Pin<Box<tokio::time::Sleep>>,
    /// When the last chunk went out.
    last_sent: tokio::time::Instant,
}

impl EventPump {
    async fn next_chunk(&mut self) -> Option<Vec<u8>> {
        let mut out = Vec::new();
        loop {
            match self.reader.next() {
                EventsStep::End => return (!out.is_empty()).then_some(out),
                EventsStep::ReadPage { after } => {
                    let page = self
                        .state
                        .hub
                        .log()
                        .read(&self.id, after, PAGE)
                        .await
                        .ok()?;
                    self.reader.page(&page, &mut out);
                    if !out.is_empty() {
                        return Some(out);
                    }
                }
                EventsStep::Connect { after } => {
                    let conn = self
                        .state
                        .hub
                        .connect(&self.id, Role::Client, Some(after))
                        .await
                        .ok()?;
                    self.conn = Some(conn);
                    self.reader.connected(after);
                }
                EventsStep::Follow => {
                    if let Some(chunk) = self.follow(&mut out).await {
                        return Some(chunk);
                    }
                }
            }
        }
    }

    /// What the actor has queued (waiting for the first), as one chunk, or
    /// a keep-alive; `None` when the reader ended without output.
    async fn follow(&mut self, out: &mut Vec<u8>) -> Option<Vec<u8>> {
        // Out of `self` while messages are encoded; put back after.
        let mut conn = self.conn.take()?;
        loop {
            let first = tokio::select! {
                biased;
                out = conn.recv() => out,
                _ = &mut self.keep_alive => {
                    let due = self.last_sent + KEEP_ALIVE_INTERVAL;
                    let now = tokio::time::Instant::now();
                    if now < due {
                        // Something was sent since the timer was armed.
                        self.keep_alive.as_mut().reset(due);
                        continue;
                    }
                    self.last_sent = now;
                    self.keep_alive.as_mut().reset(now + KEEP_ALIVE_INTERVAL);
                    self.conn = Some(conn);
                    return Some(session_api::sse::KEEP_ALIVE.as_bytes().to_vec());
                }
            };
            let mut next = first;
            loop {
                match next {
                    Some(Outbound::Frame(frame)) => {
                        self.reader.frame(frame.frame(), Some(frame.json()), out)
                    }
                    Some(Outbound::Msg(message)) => self.reader.message(&message, out),
                    // Dropped by the actor (it stopped, or this reader fell
                    // too far behind): the client resumes from its
                    // Last-Event-ID.
                    Some(Outbound::Close(_)) | None => self.reader.dropped(),
                }
                if self.reader.is_done() {
                    return (!out.is_empty()).then(|| std::mem::take(out));
                }
                match conn.try_recv() {
                    Some(message) => next = Some(message),
                    None => break,
                }
            }
            if !out.is_empty() {
                self.last_sent = tokio::time::Instant::now();
                self.conn = Some(conn);
                return Some(std::mem::take(out));
            }
        }
    }
}

async fn ui_stream(
    State(state): Shared,
    Path(id): Path<String>,
    Query(params): Params,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let id = session_id(&id)?;
    state.auth(&headers, &params, Some(&id), READERS)?;
    let info = state.hub.log().info(&id).await?;
    // Default: from now on (the turn a client is about to start); pass
    // `?after=<seq of the prompt's ack - 1>` to include a turn already
    // under way. From 0 on a trimmed log: its cut; inside the cut: 410.
    let after = match param_u64(&params, "after")? {
        Some(after) => info.reader_start(after)?,
        None => info.last_seq,
    };
    let message_id = format!("{id}-{after}");
    let mut mapper = UiStreamMapper::new(message_id);
    // Catch up and register with the actor before answering, so a client
    // that has the response head will see every live part from now on.
    let mut pending = Vec::new();
    let caught = catch_up_and_connect(&state, &state.hub, &id, after, |frame| {
        pending.extend(mapper.map(&ServerMessage::Frame { frame }));
        !mapper.is_done()
    })
    .await?;
    let (tx, rx) = mpsc::channel::<Event>(256);
    tokio::spawn(async move {
        let mut open = true;
        for chunk in pending {
            if tx
                .send(Event::default().data(chunk.to_string()))
                .await
                .is_err()
            {
                open = false;
                break;
            }
        }
        if let (true, Some((conn, cursor))) = (open, caught) {
            pump_ui(conn, cursor, &mut mapper, &tx).await;
        }
        let _ = tx.send(Event::default().data("[DONE]")).await;
    });
    let mut response = sse_from(rx).into_response();
    response
        .headers_mut()
        .insert(UI_STREAM_HEADER, HeaderValue::from_static("v1"));
    Ok(response)
}

/// Map live traffic until the turn finishes, the session is sealed, or the
/// reader leaves.
async fn pump_ui(
    mut conn: Connection,
    mut cursor: u64,
    mapper: &mut UiStreamMapper,
    tx: &mpsc::Sender<Event>,
) {
    while !mapper.is_done() {
        let out = tokio::select! {
            out = conn.recv() => out,
            _ = tx.closed() => return,
        };
        let Some(Ok(message)) = out.map(Outbound::into_message) else {
            return;
        };
        if let ServerMessage::Frame { frame } = &message {
            if frame.seq <= cursor {
                continue;
            }
            cursor = frame.seq;
        }
        for chunk in mapper.map(&message) {
            if tx
                .send(Event::default().data(chunk.to_string()))
                .await
                .is_err()
            {
                return;
            }
        }
    }
}

// ---- WebSocket ---------------------------------------------------------------

async fn websocket(
    State(state): Shared,
    Path(id): Path<String>,
    Query(params): Params,
    headers: HeaderMap,
    ws: WebSocketUpgrade,
) -> Result<Response, ApiError> {
    let id = session_id(&id)?;
    let role = ws::role(&params)?;
    let allowed = ws::grants_for(role);
    let grant = state.auth(&headers, &params, Some(&id), allowed)?;
    let after = param_u64(&params, "after")?;
    // 404 (no such session) and 410 (resuming inside a trimmed log's cut)
    // before the upgrade, while we can still answer with a status; a
    // replay from 0 of a trimmed log starts at its cut.
    let info = state.hub.log().info(&id).await?;
    let after = after.map(|after| info.reader_start(after)).transpose()?;
    // Messages a little over the frame limit get a clear error; far over
    // it the socket is closed (1009) without reading them into memory.
    let max_message = state.body_limit().saturating_mul(4);
    Ok(ws
        .max_message_size(max_message)
        .on_upgrade(move |socket| run_socket(state, id, role, grant, after, socket)))
}

fn text(message: &ServerMessage) -> Message {
    Message::Text(serde_json::to_string(message).unwrap_or_default().into())
}

/// `text(&ServerMessage::Frame { frame })` of a shared frame, around its
/// JSON encoded once for all readers.
fn frame_text(frame: &SharedFrame) -> Message {
    let json = frame.json();
    let mut out = Vec::with_capacity(json.len() + 27);
    out.extend_from_slice(b"{\"type\":\"frame\",\"frame\":");
    out.extend_from_slice(json);
    out.push(b'}');
    // Built from UTF-8 JSON and ASCII.
    Message::Text(String::from_utf8(out).unwrap_or_default().into())
}

async fn run_socket(
    state: Arc<AppState>,
    id: SessionId,
    role: Role,
    grant: GrantRole,
    after: Option<u64>,
    socket: WebSocket,
) {
    let (mut sink, mut stream) = socket.split();
    // Catch-up for clients that asked for history, straight from the log,
    // page by page; then connect at the last seq sent.
    let connected = match (role, after) {
        (Role::Client, Some(after)) => {
            let mut cursor = after;
            let caught: Result<u64, ApiError> = loop {
                let page = match state.hub.log().read(&id, cursor, PAGE).await {
                    Ok(p) => p,
                    Err(e) => break Err(e.into()),
                };
                let Some(last) = page.last() else {
                    break Ok(cursor);
                };
                cursor = last.seq;
                // Queued without a flush each, then flushed once per page.
                for frame in page {
                    if sink
                        .feed(text(&ServerMessage::Frame { frame }))
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
                if sink.flush().await.is_err() {
                    return;
                }
            };
            match caught {
                Ok(cursor) => state
                    .hub
                    .connect(&id, role, Some(cursor))
                    .await
                    .map(|c| (c, cursor))
                    .map_err(ApiError::from),
                Err(e) => Err(e),
            }
        }
        _ => state
            .hub
            .connect(&id, role, None)
            .await
            .map(|c| (c, 0))
            .map_err(ApiError::from),
    };
    let (mut conn, mut cursor) = match connected {
        Ok(c) => c,
        Err(e) => {
            let msg = e.to_message();
            let _ = sink.send(text(&msg)).await;
            let _ = sink.send(Message::Close(None)).await;
            return;
        }
    };
    let limit = state.config.max_frame_bytes.saturating_add(ENVELOPE_SLACK);
    loop {
        tokio::select! {
            out = conn.recv() => match out {
                Some(Outbound::Close(reason)) => {
                    let frame = CloseFrame { code: ws::CLOSED_BY_SESSION, reason: ws::close_reason(&reason).into() };
                    let _ = sink.send(Message::Close(Some(frame))).await;
                    break;
                }
                Some(first) => {
                    // This message and whatever else is queued already, in
                    // one flush.
                    let mut next = Some(first);
                    let mut failed = false;
                    while let Some(out) = next.take() {
                        let message = match out {
                            // The actor replays exactly (cursor, last]; this
                            // only guards against a duplicate.
                            Outbound::Frame(f) if f.frame().seq <= cursor => None,
                            Outbound::Frame(f) => {
                                cursor = f.frame().seq;
                                Some(frame_text(&f))
                            }
                            Outbound::Msg(m) => Some(text(&m)),
                            Outbound::Close(reason) => {
                                let frame = CloseFrame { code: ws::CLOSED_BY_SESSION, reason: ws::close_reason(&reason).into() };
                                let _ = sink.feed(Message::Close(Some(frame))).await;
                                failed = true;
                                break;
                            }
                        };
                        if let Some(message) = message {
                            if sink.feed(message).await.is_err() {
                                failed = true;
                                break;
                            }
                        }
                        next = conn.try_recv();
                    }
                    if failed || sink.flush().await.is_err() {
                        let _ = sink.flush().await;
                        break;
                    }
                }
                None => break,
            },
            inbound = stream.next() => match inbound {
                Some(Ok(Message::Text(t))) => {
                    if let Some(err) = inbound_message(&conn, role, grant, t.as_str(), limit) {
                        if sink.send(text(&err)).await.is_err() {
                            break;
                        }
                    }
                }
                Some(Ok(Message::Binary(_))) => {
                    if sink.send(text(&ws::binary_refused())).await.is_err() {
                        break;
                    }
                }
                Some(Ok(Message::Ping(_) | Message::Pong(_))) => {}
                Some(Ok(Message::Close(_))) | Some(Err(_)) | None => break,
            },
        }
    }
    // Dropping `conn` tells the actor the connection is gone.
}

/// Parse and forward one inbound message; an error to send back if it is
/// refused before reaching the actor (nothing stored).
fn inbound_message(
    conn: &Connection,
    role: Role,
    grant: GrantRole,
    raw: &str,
    limit: usize,
) -> Option<ServerMessage> {
    match ws::parse_inbound(role, grant, raw, limit) {
        Ok(Inbound::Client(m)) => conn.client(m),
        Ok(Inbound::Runner(m)) => conn.runner(m),
        Ok(Inbound::ToolHost(m)) => conn.tool_host(m),
        Err(refusal) => return Some(refusal),
    }
    None
}

// ---- the runner channel (a remote runner runs this server's turns) ---------

async fn runner_channel(
    State(state): Shared,
    Query(params): Params,
    headers: HeaderMap,
    ws: WebSocketUpgrade,
) -> Result<Response, ApiError> {
    state.auth(&headers, &params, None, &[GrantRole::Runner])?;
    let generation = param_u64(&params, "generation")?
        .ok_or_else(|| ApiError::invalid("a runner must say its generation (?generation=N)"))?;
    let Some(runners) = state.runners.clone() else {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "conflict",
            "this server runs its turns itself; start it with `--engine remote` to hand them to a runner",
        ));
    };
    let (id, outgoing) = runners.attach(generation).map_err(|current| {
        ApiError::new(
            StatusCode::CONFLICT,
            "stale_runner",
            format!("runner generation {generation} is older than the attached {current}"),
        )
    })?;
    Ok(ws.on_upgrade(move |socket| serve_runner(state, runners, id, outgoing, socket)))
}

async fn serve_runner(
    state: Arc<AppState>,
    runners: Arc<crate::runners::RemoteRunners>,
    id: u64,
    mut outgoing: mpsc::UnboundedReceiver<crate::runners::Outgoing>,
    socket: WebSocket,
) {
    use crate::runners::Outgoing;
    use session_runtime::{FromRunner, ToRunner};
    let (mut sink, mut stream) = socket.split();
    // Catch the runner up: every running turn's commands (idempotent; a
    // command dispatched meanwhile may come twice).
    if let Ok(infos) = state.hub.log().list().await {
        for info in infos.into_iter().filter(|i| !i.sealed) {
            for command in info.meta.pending_commands() {
                let message = ToRunner::Command {
                    session: info.session.clone(),
                    command,
                };
                let text = serde_json::to_string(&message).unwrap_or_default();
                if sink.send(Message::Text(text.into())).await.is_err() {
                    runners.detach(id);
                    return;
                }
            }
        }
    }
    loop {
        tokio::select! {
            out = outgoing.recv() => match out {
                Some(Outgoing::Command(message)) => {
                    let text = serde_json::to_string(&message).unwrap_or_default();
                    if sink.send(Message::Text(text.into())).await.is_err() {
                        break;
                    }
                }
                Some(Outgoing::Close(reason)) => {
                    let frame = CloseFrame { code: ws::CLOSED_BY_SESSION, reason: ws::close_reason(&reason).into() };
                    let _ = sink.send(Message::Close(Some(frame))).await;
                    break;
                }
                None => break,
            },
            inbound = stream.next() => match inbound {
                Some(Ok(Message::Text(t))) => match serde_json::from_str::<FromRunner>(t.as_str()) {
                    Ok(FromRunner::DispatchFailed { session, turn_id, error }) => {
                        runners.failed(&session, turn_id, error)
                    }
                    Err(e) => tracing::warn!("ignoring a runner-channel message: {e}"),
                },
                Some(Ok(Message::Close(_))) | Some(Err(_)) | None => break,
                Some(Ok(_)) => {}
            },
        }
    }
    runners.detach(id);
}

#[cfg(test)]
mod tests {
    use super::*;
    use harness_core::frame::FrameBody;
    use serde_json::json;

    #[test]
    fn frame_events_are_encoded_as_the_session_api_says() {
        let frames = [
            Frame {
                seq: 7,
                at_ms: 1_764_443_000_000,
                body: FrameBody::UserMessage {
                    text: "two\nlines \"quoted\"".into(),
                    turn_id: Some("t1".into()),
                },
            },
            Frame {
                seq: 8,
                at_ms: 1,
                body: FrameBody::Sealed {},
            },
        ];
        let mut out = Vec::new();
        let mut shared = Vec::new();
        for frame in &frames {
            let mut reader = EventsReader::new(frame.seq - 1, false);
            reader.frame(frame, None, &mut out);
            let shared_frame = SharedFrame::new(frame.clone());
            let mut reader = EventsReader::new(frame.seq - 1, false);
            reader.frame(frame, Some(shared_frame.json()), &mut shared);
        }
        let expected: String = frames
            .iter()
            .map(|f| session_api::sse::SseEvent::frame(f).encode())
            .collect();
        assert_eq!(String::from_utf8(out).unwrap(), expected);
        assert_eq!(String::from_utf8(shared).unwrap(), expected);
    }

    #[test]
    fn a_shared_frame_goes_on_a_websocket_as_its_server_message() {
        let frame = Frame {
            seq: 3,
            at_ms: 9,
            body: FrameBody::Part {
                turn_id: "t1".into(),
                part: harness_core::part::StreamPart::Raw {
                    value: json!({"line": "a \"quoted\" ünïcode\nline"}),
                },
            },
        };
        let Message::Text(built) = frame_text(&SharedFrame::new(frame.clone())) else {
            panic!("not text");
        };
        let Message::Text(expected) = text(&ServerMessage::Frame { frame }) else {
            panic!("not text");
        };
        assert_eq!(built.as_str(), expected.as_str());
    }
}
