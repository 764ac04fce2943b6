//! The protocol over HTTP: one request in, one [`Handled`] out, with no
//! runtime. A host (`session-server` on tokio, the Worker's streams object)
//! authenticates, reads the body under [`MAX_BODY_BYTES`], calls
//! [`handle`] on its [`Streams`], persists [`Streams::take_changes`], wakes
//! the waiters of the path when [`writes`] says the method wrote, and turns
//! the answer into its own response type:
//!
//! - [`Handled::Reply`]: a complete answer.
//! - [`Handled::LongPoll`]: a `live=long-poll` read at the tail. The host
//!   calls [`LongPoll::poll`] now and whenever the path is written to, until
//!   it answers; at the deadline it sends [`LongPoll::timed_out`].
//! - [`Handled::Sse`]: a `live=sse` read. The host sends the head, then
//!   feeds the body from [`SseFeed::next`]: [`SseStep::Send`] as it comes,
//!   [`SseStep::Wait`] until the path is written to (or, after the keep-alive
//!   interval, [`SseFeed::keep_alive`]), [`SseStep::End`] last.
//!
//! Status codes, headers and messages follow durable-streams `PROTOCOL.md`
//! as its conformance suite checks them (`docs/durable-streams.md`).

use bytes::Bytes;
use http::{header, HeaderMap, HeaderName, HeaderValue, Method, StatusCode};

use crate::store::{
    format_body, format_json, normalize_content_type, AppendOptions, AppendOutcome, CreateOptions,
    Offset, Producer, StoreError, StoredMessage, StreamMeta, Streams,
};
use crate::util;

/// Path prefix every stream lives under.
pub const PREFIX: &str = "/v1/stream/";

/// Largest request body accepted (`PUT`/`POST`); larger bodies get 413
/// ([`body_too_large`]).
pub const MAX_BODY_BYTES: usize = 64 * 1024 * 1024;

/// `Stream-Next-Offset`.
pub const STREAM_NEXT_OFFSET: &str = "stream-next-offset";
/// `Stream-Up-To-Date`.
pub const STREAM_UP_TO_DATE: &str = "stream-up-to-date";
/// `Stream-Closed`.
pub const STREAM_CLOSED: &str = "stream-closed";
/// `Stream-Cursor`.
pub const STREAM_CURSOR: &str = "stream-cursor";
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

/// CORS and browser-safety headers on every answer (protocol §10.7).
pub const COMMON_HEADERS: &[(&str, &str)] = &[
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

/// One request, as the host received it.
#[derive(Debug)]
pub struct Request<'a> {
    /// The method.
    pub method: &'a Method,
    /// The whole path (`/v1/stream/…`): it is the stream's name.
    pub path: &'a str,
    /// The raw query string, if any.
    pub query: Option<&'a str>,
    /// The headers.
    pub headers: &'a HeaderMap,
    /// The body, already read (and refused over [`MAX_BODY_BYTES`]).
    pub body: Bytes,
}

/// A complete answer (its body in memory).
#[derive(Debug, Clone)]
pub struct Reply {
    /// The status.
    pub status: StatusCode,
    /// The headers, each name once ([`Reply::with_common_headers`] adds
    /// CORS and the rest).
    pub headers: Vec<(HeaderName, HeaderValue)>,
    /// The body.
    pub body: Bytes,
}

impl Reply {
    /// An empty answer.
    pub fn new(status: StatusCode) -> Self {
        Self {
            status,
            headers: Vec::new(),
            body: Bytes::new(),
        }
    }

    /// A `text/plain` answer.
    pub fn text(status: StatusCode, message: impl Into<String>) -> Self {
        Self::new(status)
            .header(header::CONTENT_TYPE.as_str(), "text/plain")
            .body(Bytes::from(message.into()))
    }

    /// Set a header (a name or value that is not valid HTTP is dropped:
    /// every name here is a constant, and values are offsets, numbers or
    /// what the client sent in a header).
    pub fn header(mut self, name: &str, value: impl AsRef<str>) -> Self {
        if let (Ok(n), Ok(v)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_str(value.as_ref()),
        ) {
            self.headers.retain(|(have, _)| *have != n);
            self.headers.push((n, v));
        }
        self
    }

    /// The value of header `name` (lower case), if set.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.as_str() == name)
            .and_then(|(_, v)| v.to_str().ok())
    }

    /// Set the body.
    pub fn body(mut self, body: Bytes) -> Self {
        self.body = body;
        self
    }

    /// Add [`COMMON_HEADERS`] (those not already set): what every answer
    /// carries, streamed ones included.
    pub fn with_common_headers(mut self) -> Self {
        for (name, value) in COMMON_HEADERS {
            if self.get(name).is_none() {
                self.headers.push((
                    HeaderName::from_static(name),
                    HeaderValue::from_static(value),
                ));
            }
        }
        self
    }
}

/// What a request needs from its host.
#[derive(Debug)]
pub enum Handled {
    /// Send this.
    Reply(Reply),
    /// Wait for data at the tail (see the module docs).
    LongPoll(LongPoll),
    /// Send `head`, then stream `feed` (see the module docs).
    Sse {
        /// Status and headers of the event stream.
        head: Reply,
        /// Its body, step by step.
        feed: SseFeed,
    },
}

/// Whether a request with `method` may have written to its stream (its
/// waiters should be woken once it is answered).
pub fn writes(method: &Method) -> bool {
    matches!(*method, Method::PUT | Method::POST | Method::DELETE)
}

/// The 413 for a body over `limit` bytes.
pub fn body_too_large(limit: usize) -> Reply {
    Reply::text(
        StatusCode::PAYLOAD_TOO_LARGE,
        format!("request body unreadable or larger than {limit} bytes"),
    )
}

/// Answer `req` on `streams`. Authentication is the host's.
pub fn handle(streams: &mut Streams, req: &Request<'_>) -> Handled {
    let path = req.path;
    let reply = match *req.method {
        Method::OPTIONS => Reply::new(StatusCode::NO_CONTENT),
        Method::PUT => create(streams, path, req.headers, req.body.clone()),
        Method::HEAD => head(streams, path),
        Method::GET => {
            let params = util::query_pairs(req.query.unwrap_or_default());
            return read(streams, path, &params, req.headers);
        }
        Method::POST => append(streams, path, req.headers, req.body.clone()),
        Method::DELETE => delete(streams, path),
        _ => Reply::text(StatusCode::METHOD_NOT_ALLOWED, "method not allowed"),
    };
    Handled::Reply(reply)
}

fn header_str<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

/// Map a store refusal to its protocol status.
pub fn store_error(e: StoreError) -> Reply {
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

fn create(streams: &mut Streams, path: &str, headers: &HeaderMap, data: Bytes) -> Reply {
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
    match streams.create(path, opts) {
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

/// The `etag` of a read of `path` from `start` (as the client wrote it)
/// to `end`.
pub fn etag(path: &str, start: &str, end: Offset, closed: bool) -> String {
    let suffix = if closed { ":c" } else { "" };
    format!(
        "\"{}:{start}:{end}{suffix}\"",
        util::base64(path.as_bytes())
    )
}

fn head(streams: &mut Streams, path: &str) -> Reply {
    let Some(meta) = streams.meta(path) else {
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
#[derive(Debug, Clone)]
pub struct ReadParams {
    /// Raw offset as given (`None` = absent).
    pub offset: Option<String>,
    /// `live`: `long-poll`, `sse` or absent.
    pub live: Option<String>,
    /// The client's `cursor`.
    pub cursor: Option<String>,
}

/// Check a read's query parameters (session streams use the same rules).
pub fn read_params(params: &[(String, String)]) -> Result<ReadParams, Reply> {
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
pub fn text_compatible(content_type: Option<&str>) -> bool {
    let ct = content_type.map(normalize_content_type).unwrap_or_default();
    ct.starts_with("text/") || ct == "application/json"
}

fn read(
    streams: &mut Streams,
    path: &str,
    params: &[(String, String)],
    headers: &HeaderMap,
) -> Handled {
    let Some(meta) = streams.meta(path) else {
        return Handled::Reply(Reply::text(StatusCode::NOT_FOUND, "Stream not found"));
    };
    if meta.soft_deleted {
        return Handled::Reply(Reply::text(StatusCode::GONE, "Stream is gone"));
    }
    let p = match read_params(params) {
        Ok(p) => p,
        Err(r) => return Handled::Reply(r),
    };
    streams.touch(path);
    let start = match p.offset.as_deref() {
        None | Some("-1") => None,
        Some("now") => Some(meta.tail),
        Some(raw) => Offset::parse(raw),
    };
    if p.live.as_deref() == Some("sse") {
        let base64 = !text_compatible(meta.content_type.as_deref());
        return Handled::Sse {
            head: sse_headers(Reply::new(StatusCode::OK), base64),
            feed: SseFeed {
                path: path.to_string(),
                start,
                at: None,
                cursor: p.cursor,
                base64,
                json: meta.is_json(),
                started: false,
            },
        };
    }
    let long_poll = p.live.as_deref() == Some("long-poll");
    if p.offset.as_deref() == Some("now") && !long_poll {
        let mut reply = Reply::new(StatusCode::OK)
            .header(STREAM_NEXT_OFFSET, meta.tail.to_string())
            .header(STREAM_UP_TO_DATE, "true")
            .header("cache-control", "no-store")
            .body(Bytes::from_static(if meta.is_json() { b"[]" } else { b"" }));
        if let Some(ct) = &meta.content_type {
            reply = reply.header("content-type", ct);
        }
        if meta.closed {
            reply = reply.header(STREAM_CLOSED, "true");
        }
        return Handled::Reply(reply);
    }
    let (messages, meta) = match streams.read(path, start) {
        Ok(r) => r,
        Err(e) => return Handled::Reply(store_error(e)),
    };
    let read = ReadOf {
        path: path.to_string(),
        offset: p.offset,
        cursor: p.cursor,
        long_poll,
        if_none_match: header_str(headers, header::IF_NONE_MATCH.as_str()).map(str::to_string),
    };
    if long_poll && messages.is_empty() && start == Some(meta.tail) {
        let poll = LongPoll {
            read,
            at: meta.tail,
        };
        if meta.closed {
            return Handled::Reply(
                Reply::new(StatusCode::NO_CONTENT)
                    .header(STREAM_NEXT_OFFSET, poll.at.to_string())
                    .header(STREAM_UP_TO_DATE, "true")
                    .header(STREAM_CLOSED, "true"),
            );
        }
        return Handled::LongPoll(poll);
    }
    Handled::Reply(read.data_reply(streams, &messages, &meta))
}

/// What a catch-up or long-poll read answers with, besides its data.
#[derive(Debug, Clone)]
struct ReadOf {
    path: String,
    offset: Option<String>,
    cursor: Option<String>,
    long_poll: bool,
    if_none_match: Option<String>,
}

impl ReadOf {
    fn data_reply(
        &self,
        streams: &mut Streams,
        messages: &[StoredMessage],
        meta: &StreamMeta,
    ) -> Reply {
        let end = messages.last().map(|m| m.offset).unwrap_or(meta.tail);
        let at_tail_closed = meta.closed && end == meta.tail;
        let tag = etag(
            &self.path,
            self.offset.as_deref().unwrap_or("-1"),
            end,
            at_tail_closed,
        );
        if self.if_none_match.as_deref() == Some(tag.as_str()) {
            return Reply::new(StatusCode::NOT_MODIFIED).header("etag", tag);
        }
        let mut reply = Reply::new(StatusCode::OK)
            .header(STREAM_NEXT_OFFSET, end.to_string())
            .header(STREAM_UP_TO_DATE, "true")
            .header("etag", tag)
            .body(format_body(meta.is_json(), messages));
        if let Some(ct) = &meta.content_type {
            reply = reply.header("content-type", ct);
        }
        if self.long_poll {
            reply = reply.header(STREAM_CURSOR, streams.cursor(self.cursor.as_deref()));
        }
        if at_tail_closed {
            reply = reply.header(STREAM_CLOSED, "true");
        }
        reply
    }
}

/// A `live=long-poll` read waiting at the tail.
#[derive(Debug, Clone)]
pub struct LongPoll {
    read: ReadOf,
    at: Offset,
}

impl LongPoll {
    /// The stream it waits on.
    pub fn path(&self) -> &str {
        &self.read.path
    }

    /// The answer, once there is one: data after the tail it waits at, or
    /// the stream closed or gone. `None`: keep waiting.
    pub fn poll(&self, streams: &mut Streams) -> Option<Reply> {
        match streams.read(&self.read.path, Some(self.at)) {
            Ok((messages, meta)) => {
                if meta.soft_deleted || (messages.is_empty() && meta.closed) {
                    return Some(self.timed_out(streams));
                }
                if messages.is_empty() {
                    return None;
                }
                Some(self.read.data_reply(streams, &messages, &meta))
            }
            Err(_) => Some(self.timed_out(streams)),
        }
    }

    /// The answer when nothing came: 204, up to date at the same offset.
    pub fn timed_out(&self, streams: &mut Streams) -> Reply {
        let mut reply = Reply::new(StatusCode::NO_CONTENT)
            .header(STREAM_NEXT_OFFSET, self.at.to_string())
            .header(STREAM_UP_TO_DATE, "true")
            .header(STREAM_CURSOR, streams.cursor(self.read.cursor.as_deref()));
        if streams.meta(&self.read.path).is_some_and(|m| m.closed) {
            reply = reply.header(STREAM_CLOSED, "true");
        }
        reply
    }
}

/// The body of a `live=sse` read: catch up, then follow. Every data event
/// is followed by a control event carrying the offset after it (protocol
/// §5.8).
#[derive(Debug, Clone)]
pub struct SseFeed {
    path: String,
    /// Where the reader started (`None`: the beginning).
    start: Option<Offset>,
    /// The offset sent last; `None` before the first step.
    at: Option<Offset>,
    cursor: Option<String>,
    base64: bool,
    json: bool,
    started: bool,
}

/// What to do next with an SSE body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SseStep {
    /// Send these bytes, then ask again.
    Send(Bytes),
    /// Nothing new: ask again when the stream is written to; send
    /// [`SseFeed::keep_alive`] if nothing comes for a while.
    Wait,
    /// Send these bytes (possibly none) and end the body.
    End(Bytes),
}

impl SseFeed {
    /// The stream it follows.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The next step.
    pub fn next(&mut self, streams: &mut Streams) -> SseStep {
        let after = if self.started { self.at } else { self.start };
        let (messages, meta) = match streams.read(&self.path, after) {
            Ok(r) => r,
            Err(_) => return SseStep::End(Bytes::new()),
        };
        if self.started && meta.soft_deleted {
            return SseStep::End(Bytes::new());
        }
        streams.touch(&self.path);
        let first = !self.started;
        self.started = true;
        if !messages.is_empty() {
            let mut out = Vec::new();
            let count = messages.len();
            for (i, m) in messages.iter().enumerate() {
                let payload = if self.base64 {
                    util::base64(&m.data)
                } else if self.json {
                    String::from_utf8_lossy(&format_json(std::slice::from_ref(m))).into_owned()
                } else {
                    String::from_utf8_lossy(&m.data).into_owned()
                };
                out.extend_from_slice(&sse_event("data", &payload));
                let at_tail = i + 1 == count && m.offset == meta.tail;
                self.at = Some(m.offset);
                if at_tail && meta.closed {
                    control_into(m.offset, None, true, true, &mut out);
                    return SseStep::End(Bytes::from(out));
                }
                let cursor = streams.cursor(self.cursor.as_deref());
                control_into(m.offset, Some(&cursor), at_tail, false, &mut out);
            }
            return SseStep::Send(Bytes::from(out));
        }
        let at = after.unwrap_or(meta.tail);
        self.at = Some(at);
        if meta.closed && at >= meta.tail {
            return SseStep::End(control(at, None, true, true));
        }
        if first {
            let cursor = streams.cursor(self.cursor.as_deref());
            return SseStep::Send(control(at, Some(&cursor), true, false));
        }
        SseStep::Wait
    }

    /// The control event to send when nothing came for a while.
    pub fn keep_alive(&self, streams: &mut Streams) -> Bytes {
        let cursor = streams.cursor(self.cursor.as_deref());
        control(self.at.unwrap_or_default(), Some(&cursor), true, false)
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

/// One control event ([`control_into`]).
pub fn control(offset: Offset, cursor: Option<&str>, up_to_date: bool, closed: bool) -> Bytes {
    let mut out = Vec::with_capacity(120);
    control_into(offset, cursor, up_to_date, closed, &mut out);
    Bytes::from(out)
}

/// The control event (`event: control`, one `data:` line of JSON:
/// `streamNextOffset`, then `streamClosed` or `streamCursor`/`upToDate`)
/// appended to `out`: written in place, since an SSE reader gets one after
/// every data event.
pub fn control_into(
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

/// The head of an event stream.
pub fn sse_headers(reply: Reply, base64: bool) -> Reply {
    let reply = reply
        .header("content-type", "text/event-stream")
        .header("cache-control", "no-cache");
    if base64 {
        reply.header("stream-sse-data-encoding", "base64")
    } else {
        reply
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

fn append(streams: &mut Streams, path: &str, headers: &HeaderMap, data: Bytes) -> Reply {
    let close = header_str(headers, STREAM_CLOSED) == Some("true");
    let producer = match producer_from(headers) {
        Ok(p) => p,
        Err(r) => return r,
    };
    if data.is_empty() {
        if !close {
            return Reply::text(StatusCode::BAD_REQUEST, "Empty body");
        }
        return match streams.close(path, producer.clone()) {
            Ok(outcome) => {
                streams.touch(path);
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
    match streams.append(path, data, opts) {
        Ok(outcome) => outcome_reply(outcome, producer.as_ref(), false),
        Err(e) => store_error(e),
    }
}

fn delete(streams: &mut Streams, path: &str) -> Reply {
    match streams.delete(path) {
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
            let event = control(offset, cursor, up_to_date, closed);
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
