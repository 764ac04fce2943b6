//! The Durable Streams protocol (`/v1/stream/*`), as specified by
//! durable-streams/durable-streams `PROTOCOL.md` and checked by the npm
//! suite `@durable-streams/server-conformance-tests`.
//!
//! - Generic byte and JSON streams live in a [`StreamStore`] (in memory, or
//!   written through to SQLite with [`StreamStore::open`]; see [`store`]).
//! - When a session [`Hub`] is attached, `/v1/stream/sessions/<session id>`
//!   is a read-only JSON stream of that session's frames (offsets carry the
//!   frame seq), so any Durable Streams client can follow a session: catch-up
//!   reads come from the hub's log, live reads follow the session's actor.
//!
//! See `docs/durable-streams.md` for what is implemented and how the
//! conformance suite is run.

use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Uri};
use axum::response::Response;
use axum::routing::any;
use axum::Router;
use harness_core::SessionId;
use session_runtime::Hub;
use tokio::sync::mpsc;

use crate::auth::{authorize, bearer, GrantRole, TokenGrant};

mod sessions;
pub mod store;
// `pub` (hidden) only so the fuzz targets in `fuzz/` reach the parsers.
#[doc(hidden)]
pub mod util;

pub use store::{
    AppendOptions, AppendOutcome, CreateOptions, Offset, Producer, StoreError, StreamMeta,
    StreamStore,
};

/// Path prefix every stream lives under.
pub const PREFIX: &str = "/v1/stream/";

/// Largest request body accepted (`PUT`/`POST`); larger bodies get 413.
pub const MAX_BODY_BYTES: usize = 64 * 1024 * 1024;

const STREAM_NEXT_OFFSET: &str = "stream-next-offset";
const STREAM_UP_TO_DATE: &str = "stream-up-to-date";
const STREAM_CLOSED: &str = "stream-closed";
const STREAM_CURSOR: &str = "stream-cursor";
const STREAM_TTL: &str = "stream-ttl";
const STREAM_EXPIRES_AT: &str = "stream-expires-at";
const STREAM_SEQ: &str = "stream-seq";
const PRODUCER_ID: &str = "producer-id";
const PRODUCER_EPOCH: &str = "producer-epoch";
const PRODUCER_SEQ: &str = "producer-seq";
const PRODUCER_EXPECTED_SEQ: &str = "producer-expected-seq";
const PRODUCER_RECEIVED_SEQ: &str = "producer-received-seq";
const FORKED_FROM: &str = "stream-forked-from";
const FORK_OFFSET: &str = "stream-fork-offset";
const FORK_SUB_OFFSET: &str = "stream-fork-sub-offset";

/// Who may use the streams: the session server's token table, or nobody
/// checked at all.
#[derive(Debug, Clone, Default)]
pub struct StreamAuth {
    /// Grants as in [`crate::ServerConfig::tokens`]. Generic streams need a
    /// `host` grant; session streams accept `client`/`runner` grants scoped
    /// to the session.
    pub tokens: Vec<TokenGrant>,
    /// Accept every request without a token (local development, tests).
    pub insecure_no_auth: bool,
}

/// Everything the `/v1/stream/*` routes need.
#[derive(Debug, Clone)]
pub struct DurableStreamsState {
    /// Generic streams.
    pub store: Arc<StreamStore>,
    /// How long a long-poll (or an idle SSE connection, between keep-alive
    /// control events) waits for data.
    pub long_poll_timeout: Duration,
    /// When set, sessions are readable at `/v1/stream/sessions/<id>`: read
    /// from the hub's log, followed live through the hub's actors (so every
    /// write to those sessions must go through this hub).
    pub sessions: Option<Arc<Hub>>,
    /// Access control.
    pub auth: StreamAuth,
}

impl DurableStreamsState {
    /// A fresh in-memory store, 30 s long-polls, no session streams, and
    /// no authentication (add tokens through [`DurableStreamsState::auth`]).
    pub fn new() -> Self {
        Self {
            store: Arc::new(StreamStore::new()),
            long_poll_timeout: Duration::from_secs(30),
            sessions: None,
            auth: StreamAuth {
                tokens: Vec::new(),
                insecure_no_auth: true,
            },
        }
    }

    /// The state the session server mounts: its hub's sessions as session
    /// streams, its token table for access, and `config.stream_store` (or a
    /// fresh in-memory store) for generic streams.
    pub fn for_server(config: &crate::ServerConfig, hub: Arc<Hub>) -> Self {
        Self {
            store: config
                .stream_store
                .clone()
                .unwrap_or_else(|| Arc::new(StreamStore::new())),
            long_poll_timeout: Duration::from_secs(30),
            sessions: Some(hub),
            auth: StreamAuth {
                tokens: config.tokens.clone(),
                insecure_no_auth: config.insecure_no_auth,
            },
        }
    }
}

impl Default for DurableStreamsState {
    fn default() -> Self {
        Self::new()
    }
}

/// The routes: every method on `/v1/stream/{*name}`.
pub fn router(state: DurableStreamsState) -> Router {
    Router::new()
        .route("/v1/stream/{*name}", any(handle))
        .with_state(Arc::new(state))
}

/// The routes as the session server mounts them
/// ([`DurableStreamsState::for_server`]). Without `config.stream_store`,
/// each call makes a fresh in-memory stream store, so build the router once
/// per server.
pub fn server_router(config: &crate::ServerConfig, hub: Arc<Hub>) -> Router {
    router(DurableStreamsState::for_server(config, hub))
}

type Shared = Arc<DurableStreamsState>;

/// A response under construction.
pub(crate) struct Reply {
    status: StatusCode,
    headers: HeaderMap,
    body: Body,
}

impl Reply {
    pub(crate) fn new(status: StatusCode) -> Self {
        Self {
            status,
            headers: HeaderMap::new(),
            body: Body::empty(),
        }
    }

    pub(crate) fn text(status: StatusCode, message: impl Into<String>) -> Self {
        Self::new(status)
            .header(header::CONTENT_TYPE.as_str(), "text/plain")
            .body(Body::from(message.into()))
    }

    pub(crate) fn header(mut self, name: &str, value: impl AsRef<str>) -> Self {
        if let (Ok(n), Ok(v)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_str(value.as_ref()),
        ) {
            self.headers.insert(n, v);
        }
        self
    }

    pub(crate) fn body(mut self, body: Body) -> Self {
        self.body = body;
        self
    }

    fn finish(self) -> Response {
        let mut response = Response::new(self.body);
        *response.status_mut() = self.status;
        let headers = response.headers_mut();
        headers.extend(self.headers);
        for (name, value) in COMMON_HEADERS {
            headers
                .entry(*name)
                .or_insert(HeaderValue::from_static(value));
        }
        response
    }
}

/// CORS and browser-safety headers on every answer (protocol §10.7).
const COMMON_HEADERS: &[(&str, &str)] = &[
    ("access-control-allow-origin", "*"),
    ("access-control-allow-methods", "GET, POST, PUT, DELETE, HEAD, OPTIONS"),
    (
        "access-control-allow-headers",
        "content-type, authorization, if-none-match, Stream-Seq, Stream-TTL, Stream-Expires-At, Stream-Closed, Producer-Id, Producer-Epoch, Producer-Seq, Stream-Forked-From, Stream-Fork-Offset, Stream-Fork-Sub-Offset",
    ),
    (
        "access-control-expose-headers",
        "Stream-Next-Offset, Stream-Cursor, Stream-Up-To-Date, Stream-Closed, Producer-Epoch, Producer-Seq, Producer-Expected-Seq, Producer-Received-Seq, etag, content-type, content-encoding, vary, location",
    ),
    ("x-content-type-options", "nosniff"),
    ("cross-origin-resource-policy", "cross-origin"),
];

fn header_str<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

async fn handle(
    State(state): State<Shared>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let path = uri.path().to_string();
    if method == Method::OPTIONS {
        return Reply::new(StatusCode::NO_CONTENT).finish();
    }
    let name = path.strip_prefix(PREFIX).unwrap_or("");
    let params = util::query_pairs(uri.query());
    let token = bearer(
        &headers,
        params
            .iter()
            .find(|(k, _)| k == "access_token")
            .map(|(_, v)| v.as_str()),
    );
    if let (Some(hub), Some(raw_id)) = (&state.sessions, name.strip_prefix("sessions/")) {
        let session = match SessionId::parse(raw_id) {
            Ok(s) => s,
            Err(e) => return Reply::text(StatusCode::BAD_REQUEST, e.to_string()).finish(),
        };
        if let Err(e) = authorize(
            &state.auth.tokens,
            state.auth.insecure_no_auth,
            token.as_deref(),
            Some(&session),
            &[GrantRole::Client, GrantRole::Runner],
        ) {
            return Reply::text(e.status, e.message).finish();
        }
        return sessions::handle(
            &state,
            hub.clone(),
            &session,
            &path,
            method,
            &params,
            &headers,
        )
        .await
        .finish();
    }
    if let Err(e) = authorize(
        &state.auth.tokens,
        state.auth.insecure_no_auth,
        token.as_deref(),
        None,
        &[GrantRole::Host],
    ) {
        return Reply::text(e.status, e.message).finish();
    }
    let reply = match method {
        Method::PUT => create(&state, &path, &headers, body).await,
        Method::HEAD => head(&state, &path),
        Method::GET => read(&state, &path, &params, &headers).await,
        Method::POST => append(&state, &path, &headers, body).await,
        Method::DELETE => delete(&state, &path),
        _ => Reply::text(StatusCode::METHOD_NOT_ALLOWED, "method not allowed"),
    };
    reply.finish()
}

/// Map a store refusal to its protocol status.
fn store_error(e: StoreError) -> Reply {
    let status = match &e {
        StoreError::NotFound | StoreError::SourceNotFound => StatusCode::NOT_FOUND,
        StoreError::Gone => StatusCode::GONE,
        StoreError::PathHeldByForks
        | StoreError::ConfigMismatch
        | StoreError::SourceGone
        | StoreError::SourceContentTypeMismatch
        | StoreError::SeqConflict
        | StoreError::ContentTypeMismatch => StatusCode::CONFLICT,
        StoreError::InvalidForkOffset
        | StoreError::InvalidForkSubOffset(_)
        | StoreError::InvalidJson
        | StoreError::EmptyArray => StatusCode::BAD_REQUEST,
        StoreError::Storage(_) => StatusCode::INTERNAL_SERVER_ERROR,
    };
    Reply::text(status, e.to_string())
}

async fn read_body(body: Body) -> Result<Bytes, Reply> {
    axum::body::to_bytes(body, MAX_BODY_BYTES)
        .await
        .map_err(|e| {
            Reply::text(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("request body unreadable or larger than {MAX_BODY_BYTES} bytes: {e}"),
            )
        })
}

/// `^(0|[1-9]\d*)$`
#[doc(hidden)]
pub fn strict_uint(raw: &str) -> Option<u64> {
    let ok = raw == "0"
        || (!raw.is_empty() && !raw.starts_with('0') && raw.bytes().all(|b| b.is_ascii_digit()));
    if ok {
        raw.parse().ok()
    } else {
        None
    }
}

/// `^[\w-]+/[\w-]+`: anything else is treated as absent.
#[doc(hidden)]
pub fn valid_content_type(raw: &str) -> bool {
    let word = |s: &str| {
        !s.is_empty()
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    };
    let Some((a, rest)) = raw.split_once('/') else {
        return false;
    };
    let b: String = rest
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == '-')
        .collect();
    word(a) && word(&b)
}

fn location(headers: &HeaderMap, path: &str) -> String {
    let host = header_str(headers, header::HOST.as_str()).unwrap_or("localhost");
    format!("http://{host}{path}")
}

async fn create(state: &DurableStreamsState, path: &str, headers: &HeaderMap, body: Body) -> Reply {
    let forked_from = header_str(headers, FORKED_FROM).map(str::to_string);
    let content_type = match header_str(headers, header::CONTENT_TYPE.as_str()) {
        Some(ct) if !ct.trim().is_empty() && valid_content_type(ct.trim()) => {
            Some(ct.trim().to_string())
        }
        // Forks inherit the source's type when none is given.
        _ if forked_from.is_some() => None,
        _ => Some("application/octet-stream".to_string()),
    };
    let ttl = header_str(headers, STREAM_TTL);
    let expires = header_str(headers, STREAM_EXPIRES_AT);
    if ttl.is_some() && expires.is_some() {
        return Reply::text(
            StatusCode::BAD_REQUEST,
            "Cannot specify both Stream-TTL and Stream-Expires-At",
        );
    }
    let ttl_seconds = match ttl.map(strict_uint) {
        Some(None) => return Reply::text(StatusCode::BAD_REQUEST, "Invalid Stream-TTL value"),
        Some(Some(v)) => Some(v),
        None => None,
    };
    let expires_at = match expires {
        Some(raw) => match util::parse_rfc3339_ms(raw) {
            Some(ms) => Some((raw.to_string(), ms)),
            None => {
                return Reply::text(
                    StatusCode::BAD_REQUEST,
                    "Invalid Stream-Expires-At timestamp",
                )
            }
        },
        None => None,
    };
    let fork_offset = match header_str(headers, FORK_OFFSET) {
        Some(raw) if !raw.is_empty() => match Offset::parse(raw) {
            Some(o) => Some(o),
            None => {
                return Reply::text(StatusCode::BAD_REQUEST, "Invalid Stream-Fork-Offset format")
            }
        },
        _ => None,
    };
    let fork_sub_offset = match headers.get(FORK_SUB_OFFSET) {
        None => None,
        Some(raw) => {
            if forked_from.is_none() {
                return Reply::text(
                    StatusCode::BAD_REQUEST,
                    "Stream-Fork-Sub-Offset requires Stream-Forked-From",
                );
            }
            match raw.to_str().ok().and_then(strict_uint) {
                Some(v) => Some(v),
                None => {
                    return Reply::text(
                        StatusCode::BAD_REQUEST,
                        "Invalid Stream-Fork-Sub-Offset format",
                    )
                }
            }
        }
    };
    let closed = header_str(headers, STREAM_CLOSED) == Some("true");
    let data = match read_body(body).await {
        Ok(b) => b,
        Err(r) => return r,
    };
    let opts = CreateOptions {
        content_type: content_type.clone(),
        ttl_seconds,
        expires_at,
        initial_data: (!data.is_empty()).then_some(data),
        closed,
        forked_from,
        fork_offset,
        fork_sub_offset,
    };
    match state.store.create(path, opts) {
        Ok((created, meta)) => {
            let ct = meta
                .content_type
                .clone()
                .or(content_type)
                .unwrap_or_else(|| "application/octet-stream".into());
            let mut reply = Reply::new(if created {
                StatusCode::CREATED
            } else {
                StatusCode::OK
            })
            .header("content-type", ct)
            .header(STREAM_NEXT_OFFSET, meta.tail.to_string());
            if created {
                reply = reply.header("location", location(headers, path));
            }
            if meta.closed {
                reply = reply.header(STREAM_CLOSED, "true");
            }
            reply
        }
        Err(e) => store_error(e),
    }
}

fn etag(path: &str, start: &str, end: Offset, closed: bool) -> String {
    let suffix = if closed { ":c" } else { "" };
    format!(
        "\"{}:{start}:{end}{suffix}\"",
        util::base64(path.as_bytes())
    )
}

fn head(state: &DurableStreamsState, path: &str) -> Reply {
    let Some(meta) = state.store.meta(path) else {
        return Reply::new(StatusCode::NOT_FOUND).header("content-type", "text/plain");
    };
    if meta.soft_deleted {
        return Reply::new(StatusCode::GONE).header("content-type", "text/plain");
    }
    let mut reply = Reply::new(StatusCode::OK)
        .header(STREAM_NEXT_OFFSET, meta.tail.to_string())
        .header("cache-control", "no-store")
        .header("etag", etag(path, "-1", meta.tail, meta.closed));
    if let Some(ct) = &meta.content_type {
        reply = reply.header("content-type", ct);
    }
    if meta.closed {
        reply = reply.header(STREAM_CLOSED, "true");
    }
    if let Some(ttl) = meta.ttl_seconds {
        reply = reply.header(STREAM_TTL, ttl.to_string());
    }
    if let Some(at) = &meta.expires_at {
        reply = reply.header(STREAM_EXPIRES_AT, at);
    }
    reply
}

/// Parsed `offset`/`live`/`cursor` query parameters of a read.
pub(crate) struct ReadParams {
    /// Raw offset as given (`None` = absent).
    pub offset: Option<String>,
    pub live: Option<String>,
    pub cursor: Option<String>,
}

pub(crate) fn read_params(params: &[(String, String)]) -> Result<ReadParams, Reply> {
    let offsets: Vec<&String> = params
        .iter()
        .filter(|(k, _)| k == "offset")
        .map(|(_, v)| v)
        .collect();
    if offsets.len() > 1 {
        return Err(Reply::text(
            StatusCode::BAD_REQUEST,
            "Multiple offset parameters not allowed",
        ));
    }
    let offset = offsets.first().map(|s| s.to_string());
    if let Some(o) = &offset {
        if o.is_empty() {
            return Err(Reply::text(
                StatusCode::BAD_REQUEST,
                "Empty offset parameter",
            ));
        }
        if o != "-1" && o != "now" && Offset::parse(o).is_none() {
            return Err(Reply::text(
                StatusCode::BAD_REQUEST,
                "Invalid offset format",
            ));
        }
    }
    let get = |name: &str| {
        params
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
    };
    let live = get("live");
    if matches!(live.as_deref(), Some("long-poll" | "sse")) && offset.is_none() {
        return Err(Reply::text(
            StatusCode::BAD_REQUEST,
            "live reads require an offset parameter",
        ));
    }
    Ok(ReadParams {
        offset,
        live,
        cursor: get("cursor"),
    })
}

/// Content types whose SSE payloads go as text; everything else is base64.
pub(crate) fn text_compatible(content_type: Option<&str>) -> bool {
    let ct = content_type
        .map(store::normalize_content_type)
        .unwrap_or_default();
    ct.starts_with("text/") || ct == "application/json"
}

async fn read(
    state: &DurableStreamsState,
    path: &str,
    params: &[(String, String)],
    headers: &HeaderMap,
) -> Reply {
    let Some(meta) = state.store.meta(path) else {
        return Reply::text(StatusCode::NOT_FOUND, "Stream not found");
    };
    if meta.soft_deleted {
        return Reply::text(StatusCode::GONE, "Stream is gone");
    }
    let p = match read_params(params) {
        Ok(p) => p,
        Err(r) => return r,
    };
    state.store.touch(path);
    let start = match p.offset.as_deref() {
        None | Some("-1") => None,
        Some("now") => Some(meta.tail),
        Some(raw) => Offset::parse(raw),
    };
    if p.live.as_deref() == Some("sse") {
        return sse(state, path, start, p.cursor, &meta);
    }
    let long_poll = p.live.as_deref() == Some("long-poll");
    if p.offset.as_deref() == Some("now") && !long_poll {
        let mut reply = Reply::new(StatusCode::OK)
            .header(STREAM_NEXT_OFFSET, meta.tail.to_string())
            .header(STREAM_UP_TO_DATE, "true")
            .header("cache-control", "no-store")
            .body(Body::from(if meta.is_json() { "[]" } else { "" }));
        if let Some(ct) = &meta.content_type {
            reply = reply.header("content-type", ct);
        }
        if meta.closed {
            reply = reply.header(STREAM_CLOSED, "true");
        }
        return reply;
    }
    let (mut messages, mut meta) = match state.store.read(path, start) {
        Ok(r) => r,
        Err(e) => return store_error(e),
    };
    if long_poll && messages.is_empty() && start == Some(meta.tail) {
        let at = meta.tail;
        if meta.closed {
            return Reply::new(StatusCode::NO_CONTENT)
                .header(STREAM_NEXT_OFFSET, at.to_string())
                .header(STREAM_UP_TO_DATE, "true")
                .header(STREAM_CLOSED, "true");
        }
        match wait(state, path, at, state.long_poll_timeout, None).await {
            Waited::Data(m, new_meta) => {
                messages = m;
                meta = new_meta;
            }
            Waited::Closed | Waited::TimedOut | Waited::Gone => {
                let mut reply = Reply::new(StatusCode::NO_CONTENT)
                    .header(STREAM_NEXT_OFFSET, at.to_string())
                    .header(STREAM_UP_TO_DATE, "true")
                    .header(STREAM_CURSOR, util::response_cursor(p.cursor.as_deref()));
                if state.store.meta(path).is_some_and(|m| m.closed) {
                    reply = reply.header(STREAM_CLOSED, "true");
                }
                return reply;
            }
        }
    }
    let end = messages.last().map(|m| m.offset).unwrap_or(meta.tail);
    let at_tail_closed = meta.closed && end == meta.tail;
    let tag = etag(
        path,
        p.offset.as_deref().unwrap_or("-1"),
        end,
        at_tail_closed,
    );
    if header_str(headers, header::IF_NONE_MATCH.as_str()) == Some(tag.as_str()) {
        return Reply::new(StatusCode::NOT_MODIFIED).header("etag", tag);
    }
    let mut reply = Reply::new(StatusCode::OK)
        .header(STREAM_NEXT_OFFSET, end.to_string())
        .header(STREAM_UP_TO_DATE, "true")
        .header("etag", tag)
        .body(Body::from(store::format_body(meta.is_json(), &messages)));
    if let Some(ct) = &meta.content_type {
        reply = reply.header("content-type", ct);
    }
    if long_poll {
        reply = reply.header(STREAM_CURSOR, util::response_cursor(p.cursor.as_deref()));
    }
    if at_tail_closed {
        reply = reply.header(STREAM_CLOSED, "true");
    }
    reply
}

/// The end of a wait for data after an offset.
enum Waited {
    Data(Vec<store::StoredMessage>, store::StreamMeta),
    Closed,
    TimedOut,
    Gone,
}

/// Wait until `path` has data after `after`, is closed, or `timeout`
/// passes. `cancel` ends the wait early (an SSE client went away).
async fn wait(
    state: &DurableStreamsState,
    path: &str,
    after: Offset,
    timeout: Duration,
    cancel: Option<&mpsc::Sender<Result<Bytes, std::convert::Infallible>>>,
) -> Waited {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let Some(notify) = state.store.notifier(path) else {
            return Waited::Gone;
        };
        // Register before looking, so an append between the look and the
        // sleep still wakes us.
        let notified = notify.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        match state.store.read(path, Some(after)) {
            Ok((messages, meta)) => {
                if meta.soft_deleted {
                    return Waited::Gone;
                }
                if !messages.is_empty() {
                    return Waited::Data(messages, meta);
                }
                if meta.closed {
                    return Waited::Closed;
                }
            }
            Err(_) => return Waited::Gone,
        }
        let closed = async {
            match cancel {
                Some(tx) => tx.closed().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = &mut notified => {}
            _ = tokio::time::sleep_until(deadline) => return Waited::TimedOut,
            _ = closed => return Waited::Gone,
        }
    }
}

/// Split a payload into SSE `data:` lines (every CR, LF or CRLF starts a new
/// line, so a payload can never inject an event of its own). A line that
/// starts with a space gets one more after `data:`: readers drop the first
/// space after the colon.
#[doc(hidden)]
pub fn sse_event(event: &str, payload: &str) -> Bytes {
    let mut out = format!("event: {event}\n");
    let normalized = payload.replace("\r\n", "\n").replace('\r', "\n");
    for line in normalized.split('\n') {
        out.push_str(if line.starts_with(' ') {
            "data: "
        } else {
            "data:"
        });
        out.push_str(line);
        out.push('\n');
    }
    out.push('\n');
    Bytes::from(out)
}

pub(crate) fn control(
    offset: Offset,
    cursor: Option<String>,
    up_to_date: bool,
    closed: bool,
) -> Bytes {
    let mut out = Vec::with_capacity(120);
    control_into(offset, cursor.as_deref(), up_to_date, closed, &mut out);
    Bytes::from(out)
}

/// The control event (`event: control`, one `data:` line of JSON:
/// `streamNextOffset`, then `streamClosed` or `streamCursor`/`upToDate`)
/// appended to `out`: written in place, since an SSE reader gets one after
/// every data event.
pub(crate) fn control_into(
    offset: Offset,
    cursor: Option<&str>,
    up_to_date: bool,
    closed: bool,
    out: &mut Vec<u8>,
) {
    // Offsets are digits and `_` (as `Offset`'s Display writes them). The
    // JSON starts with `{`, so `data:` takes no extra space.
    out.extend_from_slice(b"event: control\ndata:{\"streamNextOffset\":\"");
    util::push_decimal(out, offset.read_seq, 16);
    out.push(b'_');
    util::push_decimal(out, offset.byte, 16);
    out.push(b'"');
    if closed {
        out.extend_from_slice(b",\"streamClosed\":true");
    } else {
        if let Some(c) = cursor {
            out.extend_from_slice(b",\"streamCursor\":");
            // A cursor echoes what a client sent: escaped as JSON (which
            // also keeps it on one line).
            let _ = serde_json::to_writer(&mut *out, c);
        }
        if up_to_date {
            out.extend_from_slice(b",\"upToDate\":true");
        }
    }
    out.extend_from_slice(b"}\n\n");
}

pub(crate) fn sse_headers(reply: Reply, base64: bool) -> Reply {
    let reply = reply
        .header("content-type", "text/event-stream")
        .header("cache-control", "no-cache");
    if base64 {
        reply.header("stream-sse-data-encoding", "base64")
    } else {
        reply
    }
}

/// A body fed by a channel.
pub(crate) fn channel_body(rx: mpsc::Receiver<Result<Bytes, std::convert::Infallible>>) -> Body {
    Body::from_stream(futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    }))
}

fn sse(
    state: &DurableStreamsState,
    path: &str,
    start: Option<Offset>,
    cursor: Option<String>,
    meta: &store::StreamMeta,
) -> Reply {
    let base64 = !text_compatible(meta.content_type.as_deref());
    let json = meta.is_json();
    let (tx, rx) = mpsc::channel(64);
    let state = state.clone();
    let path = path.to_string();
    tokio::spawn(async move {
        let _ = sse_loop(&state, &path, start, cursor, base64, json, &tx).await;
    });
    sse_headers(Reply::new(StatusCode::OK), base64).body(channel_body(rx))
}

/// The SSE connection: catch up, then follow. Every data event is followed
/// by a control event carrying the offset after it (protocol §5.8).
async fn sse_loop(
    state: &DurableStreamsState,
    path: &str,
    start: Option<Offset>,
    cursor: Option<String>,
    base64: bool,
    json: bool,
    tx: &mpsc::Sender<Result<Bytes, std::convert::Infallible>>,
) -> Result<(), ()> {
    let send = |b: Bytes| async move { tx.send(Ok(b)).await.map_err(|_| ()) };
    let (mut messages, mut meta) = state.store.read(path, start).map_err(|_| ())?;
    let mut current = start;
    loop {
        state.store.touch(path);
        let count = messages.len();
        for (i, m) in messages.iter().enumerate() {
            let payload = if base64 {
                util::base64(&m.data)
            } else if json {
                String::from_utf8_lossy(&store::format_json(std::slice::from_ref(m))).into_owned()
            } else {
                String::from_utf8_lossy(&m.data).into_owned()
            };
            send(sse_event("data", &payload)).await?;
            let last = i + 1 == count;
            let at_tail = last && m.offset == meta.tail;
            if at_tail && meta.closed {
                return send(control(m.offset, None, true, true)).await;
            }
            send(control(
                m.offset,
                Some(util::response_cursor(cursor.as_deref())),
                at_tail,
                false,
            ))
            .await?;
            current = Some(m.offset);
        }
        let at = current.unwrap_or(meta.tail);
        if count == 0 {
            if meta.closed && at == meta.tail {
                return send(control(at, None, true, true)).await;
            }
            send(control(
                at,
                Some(util::response_cursor(cursor.as_deref())),
                true,
                false,
            ))
            .await?;
        }
        current = Some(at);
        // Wait for more, sending a keep-alive control event on every timeout.
        loop {
            match wait(state, path, at, state.long_poll_timeout, Some(tx)).await {
                Waited::Data(m, new_meta) => {
                    messages = m;
                    meta = new_meta;
                    break;
                }
                Waited::Closed => return send(control(at, None, true, true)).await,
                Waited::Gone => return Ok(()),
                Waited::TimedOut => {
                    send(control(
                        at,
                        Some(util::response_cursor(cursor.as_deref())),
                        true,
                        false,
                    ))
                    .await?;
                }
            }
        }
    }
}

fn producer_from(headers: &HeaderMap) -> Result<Option<Producer>, Reply> {
    let id = header_str(headers, PRODUCER_ID);
    let epoch = header_str(headers, PRODUCER_EPOCH);
    let seq = header_str(headers, PRODUCER_SEQ);
    let (id, epoch, seq) = match (id, epoch, seq) {
        (None, None, None) => return Ok(None),
        (Some(i), Some(e), Some(s)) => (i, e, s),
        _ => {
            return Err(Reply::text(
                StatusCode::BAD_REQUEST,
                "All producer headers (Producer-Id, Producer-Epoch, Producer-Seq) must be provided together",
            ))
        }
    };
    if id.is_empty() {
        return Err(Reply::text(
            StatusCode::BAD_REQUEST,
            "Invalid Producer-Id: must not be empty",
        ));
    }
    // Digits only, and within JavaScript's safe integers like the reference.
    let int = |s: &str| {
        (!s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
            .then(|| s.parse::<u64>().ok())
            .flatten()
            .filter(|v| *v < (1u64 << 53))
    };
    let Some(epoch) = int(epoch) else {
        return Err(Reply::text(
            StatusCode::BAD_REQUEST,
            "Invalid Producer-Epoch: must be a non-negative integer",
        ));
    };
    let Some(seq) = int(seq) else {
        return Err(Reply::text(
            StatusCode::BAD_REQUEST,
            "Invalid Producer-Seq: must be a non-negative integer",
        ));
    };
    Ok(Some(Producer {
        id: id.to_string(),
        epoch,
        seq,
    }))
}

fn outcome_reply(outcome: AppendOutcome, producer: Option<&Producer>, close_only: bool) -> Reply {
    match outcome {
        AppendOutcome::Accepted { offset, closed } => {
            let status = if producer.is_some() && !close_only {
                StatusCode::OK
            } else {
                StatusCode::NO_CONTENT
            };
            let mut reply = Reply::new(status).header(STREAM_NEXT_OFFSET, offset.to_string());
            if let Some(p) = producer {
                reply = reply
                    .header(PRODUCER_EPOCH, p.epoch.to_string())
                    .header(PRODUCER_SEQ, p.seq.to_string());
            }
            if closed {
                reply = reply.header(STREAM_CLOSED, "true");
            }
            reply
        }
        AppendOutcome::Duplicate {
            last_seq,
            offset,
            closed,
        } => {
            let mut reply =
                Reply::new(StatusCode::NO_CONTENT).header(PRODUCER_SEQ, last_seq.to_string());
            if let Some(p) = producer {
                reply = reply.header(PRODUCER_EPOCH, p.epoch.to_string());
            }
            if closed {
                reply = reply
                    .header(STREAM_CLOSED, "true")
                    .header(STREAM_NEXT_OFFSET, offset.to_string());
            }
            reply
        }
        AppendOutcome::StaleEpoch { current_epoch } => {
            Reply::text(StatusCode::FORBIDDEN, "Stale producer epoch")
                .header(PRODUCER_EPOCH, current_epoch.to_string())
        }
        AppendOutcome::InvalidEpochSeq => Reply::text(
            StatusCode::BAD_REQUEST,
            "New epoch must start with sequence 0",
        ),
        AppendOutcome::SequenceGap { expected, received } => {
            Reply::text(StatusCode::CONFLICT, "Producer sequence gap")
                .header(PRODUCER_EXPECTED_SEQ, expected.to_string())
                .header(PRODUCER_RECEIVED_SEQ, received.to_string())
        }
        AppendOutcome::StreamClosed { offset } => {
            Reply::text(StatusCode::CONFLICT, "Stream is closed")
                .header(STREAM_CLOSED, "true")
                .header(STREAM_NEXT_OFFSET, offset.to_string())
        }
    }
}

async fn append(state: &DurableStreamsState, path: &str, headers: &HeaderMap, body: Body) -> Reply {
    let close = header_str(headers, STREAM_CLOSED) == Some("true");
    let producer = match producer_from(headers) {
        Ok(p) => p,
        Err(r) => return r,
    };
    let data = match read_body(body).await {
        Ok(b) => b,
        Err(r) => return r,
    };
    if data.is_empty() {
        if !close {
            return Reply::text(StatusCode::BAD_REQUEST, "Empty body");
        }
        return match state.store.close(path, producer.clone()) {
            Ok(outcome) => {
                state.store.touch(path);
                outcome_reply(outcome, producer.as_ref(), true)
            }
            Err(e) => store_error(e),
        };
    }
    let Some(content_type) = header_str(headers, header::CONTENT_TYPE.as_str()) else {
        return Reply::text(StatusCode::BAD_REQUEST, "Content-Type header is required");
    };
    let opts = AppendOptions {
        seq: header_str(headers, STREAM_SEQ).map(str::to_string),
        content_type: Some(content_type.to_string()),
        producer: producer.clone(),
        close,
    };
    match state.store.append(path, data, opts) {
        Ok(outcome) => outcome_reply(outcome, producer.as_ref(), false),
        Err(e) => store_error(e),
    }
}

fn delete(state: &DurableStreamsState, path: &str) -> Reply {
    match state.store.delete(path) {
        Ok(true) => Reply::new(StatusCode::NO_CONTENT),
        Ok(false) => Reply::text(StatusCode::NOT_FOUND, "Stream not found"),
        Err(e) => store_error(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_events_are_one_data_line_of_json() {
        use serde_json::json;
        let offset = Offset {
            read_seq: 0,
            byte: 42,
        };
        let cases = [
            (
                None,
                false,
                false,
                json!({"streamNextOffset": offset.to_string()}),
            ),
            (
                Some("7\n\"x"),
                true,
                false,
                json!({"streamNextOffset": offset.to_string(), "streamCursor": "7\n\"x", "upToDate": true}),
            ),
            (
                Some("7"),
                true,
                true,
                json!({"streamNextOffset": offset.to_string(), "streamClosed": true}),
            ),
        ];
        for (cursor, up_to_date, closed, expected) in cases {
            let event = control(offset, cursor.map(str::to_string), up_to_date, closed);
            let text = std::str::from_utf8(&event).unwrap();
            let data = text
                .strip_prefix("event: control\ndata:")
                .and_then(|t| t.strip_suffix("\n\n"))
                .unwrap_or_else(|| panic!("not one control event: {text:?}"));
            assert!(!data.contains('\n'), "{text:?}");
            let got: serde_json::Value = serde_json::from_str(data).unwrap();
            assert_eq!(got, expected);
            // The same as the generic SSE encoding of that payload.
            assert_eq!(&sse_event("control", data)[..], &event[..]);
        }
    }

    #[test]
    fn sse_data_keeps_a_leading_space() {
        // Found by fuzzing: readers drop the first space after `data:`.
        assert_eq!(
            &sse_event("data", " a\nb")[..],
            b"event: data\ndata:  a\ndata:b\n\n"
        );
    }
}
