//! Generic Durable Streams on the Worker: the `durable-streams` crate's
//! protocol served from one Durable Object, [`StreamsObject`], over its
//! SQLite — the counterpart of `session-server`'s native `StreamStore`.
//!
//! The front checks the token (a `host` grant, as `session-server` asks)
//! and the body size, then forwards the request here. The object keeps
//! every stream in memory ([`Streams`], loaded from its SQLite on first
//! use) and writes each request's [`Changes`] with no `await` in between,
//! so the runtime commits them as one implicit transaction and holds the
//! answer until they are durable (output gates), as `DoStore` does for a
//! session's log.
//!
//! Long-polls and SSE readers wait in the object: each registers a one-shot
//! waiter for its path before it looks at the stream, and every request
//! that writes to a path wakes that path's waiters. Keep-alives and
//! long-poll deadlines are `worker::Delay`s.
//!
//! One object holds every generic stream (forks read through their source,
//! so streams that fork from one another must share a store). That bounds a
//! deployment's generic streams to what one object sustains
//! (`docs/cloudflare-worker.md`). Session streams
//! (`/v1/stream/sessions/<id>`) are served by each session's own object
//! (`session_streams.rs`).

// `#[durable_object]` expands to an unsafe block: allowed here, denied
// elsewhere in the crate.
#![allow(unsafe_code)]

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use durable_streams::protocol::{
    self, Handled, LongPoll, Reply, Request as StreamRequest, SseStep,
};
use durable_streams::store::{sql, Changes, Offset, StoredMessage, Streams, SCHEMA};
use durable_streams::{SseFeed, StoreError};
use futures::channel::oneshot;
use futures::future::{select, Either};
use harness_core::clock::FnClock;
use worker::{
    durable_object, wasm_bindgen, DurableObject, Env, Headers, Request, Response, SqlStorage,
    SqlStorageValue, State,
};

/// The largest `PUT`/`POST` body the Worker takes (`HARNESS_DS_MAX_BODY_BYTES`,
/// else 1 MiB): a message is one row of the object's SQLite, and a Durable
/// Object's SQLite refuses values over 2 MB.
pub(crate) fn max_body_bytes(env: &Env) -> usize {
    env.var("HARNESS_DS_MAX_BODY_BYTES")
        .ok()
        .and_then(|v| v.to_string().trim().parse().ok())
        .unwrap_or(1024 * 1024)
}

/// The name of the one object holding every generic stream.
pub(crate) const STREAMS_OBJECT: &str = "streams";

/// Long-poll deadline and SSE keep-alive: `HARNESS_DS_LONG_POLL_MS`, else
/// 30 s (as `session-server`).
pub(crate) fn long_poll_timeout(env: &Env) -> Duration {
    let ms = env
        .var("HARNESS_DS_LONG_POLL_MS")
        .ok()
        .and_then(|v| v.to_string().trim().parse().ok())
        .unwrap_or(30_000);
    Duration::from_millis(ms)
}

/// What the object and its streamed bodies share.
struct Shared {
    sql: SqlStorage,
    /// Loaded on first use.
    streams: RefCell<Option<Streams>>,
    /// One-shot waiters per path, woken by the next write to it.
    waiters: RefCell<HashMap<String, Vec<oneshot::Sender<()>>>>,
}

impl Shared {
    /// Run `op` on the streams (loading them first if needed), then write
    /// what it changed — all without an `await`, so one implicit
    /// transaction.
    fn with<T>(&self, op: impl FnOnce(&mut Streams) -> T) -> Result<T, StoreError> {
        let mut slot = self.streams.borrow_mut();
        if slot.is_none() {
            *slot = Some(load(&self.sql)?);
        }
        let streams = slot.as_mut().expect("loaded above");
        let value = op(streams);
        if let Err(e) = persist(&self.sql, &streams.take_changes()) {
            // Memory may now be ahead of storage: forget it, and let the
            // next request load what was stored.
            *slot = None;
            return Err(e);
        }
        Ok(value)
    }

    /// A waiter for the next write to `path`.
    fn waiter(&self, path: &str) -> oneshot::Receiver<()> {
        let (tx, rx) = oneshot::channel();
        let mut waiters = self.waiters.borrow_mut();
        let list = waiters.entry(path.to_string()).or_default();
        // Readers that went away (or were answered) leave cancelled senders.
        list.retain(|tx| !tx.is_canceled());
        list.push(tx);
        rx
    }

    fn wake(&self, path: &str) {
        if let Some(waiters) = self.waiters.borrow_mut().remove(path) {
            for tx in waiters {
                let _ = tx.send(());
            }
        }
    }
}

fn storage(e: worker::Error) -> StoreError {
    StoreError::Storage(e.to_string())
}

fn load(sql: &SqlStorage) -> Result<Streams, StoreError> {
    for statement in SCHEMA {
        sql.exec(statement, None).map_err(storage)?;
    }
    let mut metas = Vec::new();
    for row in sql.exec(sql::SELECT_STREAMS, None).map_err(storage)?.raw() {
        match row.map_err(storage)?.as_slice() {
            [SqlStorageValue::String(path), SqlStorageValue::String(meta)] => {
                metas.push((path.clone(), meta.clone()));
            }
            other => return Err(StoreError::Storage(format!("ds_streams row: {other:?}"))),
        }
    }
    let mut messages = Vec::new();
    for row in sql.exec(sql::SELECT_MESSAGES, None).map_err(storage)?.raw() {
        let row = row.map_err(storage)?;
        let (path, read_seq, byte, data) = match row.as_slice() {
            [SqlStorageValue::String(p), SqlStorageValue::Integer(r), SqlStorageValue::Integer(b), data] => {
                (p.clone(), *r, *b, data)
            }
            other => return Err(StoreError::Storage(format!("ds_messages row: {other:?}"))),
        };
        let data = match data {
            SqlStorageValue::Blob(bytes) => Bytes::from(bytes.clone()),
            // SQLite answers an empty blob as an empty string.
            SqlStorageValue::String(text) => Bytes::from(text.clone().into_bytes()),
            other => return Err(StoreError::Storage(format!("ds_messages data: {other:?}"))),
        };
        messages.push((
            path,
            StoredMessage {
                data,
                offset: Offset {
                    read_seq: read_seq as u64,
                    byte: byte as u64,
                },
            },
        ));
    }
    let clock = Arc::new(FnClock(|| worker::js_sys::Date::now() as u64));
    let seed = (worker::js_sys::Math::random() * 9_007_199_254_740_991.0) as u64;
    Streams::load(clock, seed, metas, messages)
}

fn persist(sql: &SqlStorage, changes: &Changes) -> Result<(), StoreError> {
    let int = |n: u64| SqlStorageValue::Integer(n as i64);
    for (path, m) in &changes.messages {
        sql.exec(
            sql::INSERT_MESSAGE,
            Some(vec![
                path.clone().into(),
                int(m.offset.read_seq),
                int(m.offset.byte),
                SqlStorageValue::Blob(m.data.to_vec()),
            ]),
        )
        .map_err(storage)?;
    }
    for (path, meta) in &changes.upserts {
        sql.exec(
            sql::UPSERT_STREAM,
            Some(vec![path.clone().into(), meta.clone().into()]),
        )
        .map_err(storage)?;
    }
    for path in &changes.removed {
        sql.exec(sql::DELETE_STREAM, Some(vec![path.clone().into()]))
            .map_err(storage)?;
        sql.exec(sql::DELETE_MESSAGES, Some(vec![path.clone().into()]))
            .map_err(storage)?;
    }
    Ok(())
}

/// The object holding every generic stream.
#[durable_object]
pub struct StreamsObject {
    shared: Rc<Shared>,
    timeout: Duration,
}

impl std::fmt::Debug for StreamsObject {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamsObject").finish_non_exhaustive()
    }
}

impl DurableObject for StreamsObject {
    fn new(state: State, env: Env) -> Self {
        Self {
            shared: Rc::new(Shared {
                sql: state.storage().sql(),
                streams: RefCell::new(None),
                waiters: RefCell::default(),
            }),
            timeout: long_poll_timeout(&env),
        }
    }

    async fn fetch(&self, mut req: Request) -> worker::Result<Response> {
        let url = req.url()?;
        let raw_method = req.method();
        let method: http::Method = raw_method
            .as_ref()
            .parse()
            .map_err(|_| worker::Error::RustError(format!("unknown method {raw_method}")))?;
        let mut headers = http::HeaderMap::new();
        for (name, value) in req.headers().entries() {
            if let (Ok(n), Ok(v)) = (
                http::HeaderName::from_bytes(name.as_bytes()),
                http::HeaderValue::from_str(&value),
            ) {
                headers.append(n, v);
            }
        }
        let body = if protocol::writes(&method) {
            Bytes::from(req.bytes().await?)
        } else {
            Bytes::new()
        };
        let request = StreamRequest {
            method: &method,
            path: url.path(),
            query: url.query(),
            headers: &headers,
            body,
        };
        let handled = match self.shared.with(|s| protocol::handle(s, &request)) {
            Ok(handled) => handled,
            Err(e) => return respond(protocol::store_error(e)),
        };
        if protocol::writes(&method) {
            self.shared.wake(url.path());
        }
        match handled {
            Handled::Reply(reply) => respond(reply),
            Handled::LongPoll(poll) => respond(self.long_poll(poll).await),
            Handled::Sse { head, feed } => {
                let body = sse_body(self.shared.clone(), feed, self.timeout);
                let head = head.with_common_headers();
                Ok(Response::from_stream(body)?
                    .with_status(head.status.as_u16())
                    .with_headers(headers_of(&head)?))
            }
        }
    }
}

impl StreamsObject {
    async fn long_poll(&self, poll: LongPoll) -> Reply {
        let deadline = worker::js_sys::Date::now() + self.timeout.as_millis() as f64;
        loop {
            let woken = self.shared.waiter(poll.path());
            match self.shared.with(|s| poll.poll(s)) {
                Ok(Some(reply)) => return reply,
                Ok(None) => {}
                Err(e) => return protocol::store_error(e),
            }
            let left = (deadline - worker::js_sys::Date::now()).max(0.0);
            let timer = Box::pin(worker::Delay::from(Duration::from_millis(left as u64)));
            if let Either::Right(_) = select(woken, timer).await {
                return match self.shared.with(|s| poll.timed_out(s)) {
                    Ok(reply) => reply,
                    Err(e) => protocol::store_error(e),
                };
            }
        }
    }
}

/// An SSE body: steps of the feed as the client reads, a keep-alive after
/// `keep_alive` of quiet. It ends when the stream closes or goes; a client
/// that leaves cancels it.
fn sse_body(
    shared: Rc<Shared>,
    feed: SseFeed,
    keep_alive: Duration,
) -> impl futures::Stream<Item = worker::Result<Vec<u8>>> + 'static {
    futures::stream::unfold(
        (shared, feed, false),
        move |(shared, mut feed, done)| async move {
            if done {
                return None;
            }
            loop {
                let woken = shared.waiter(feed.path());
                let step = match shared.with(|s| feed.next(s)) {
                    Ok(step) => step,
                    Err(_) => SseStep::End(Bytes::new()),
                };
                match step {
                    SseStep::Send(bytes) => {
                        return Some((Ok(bytes.to_vec()), (shared, feed, false)))
                    }
                    SseStep::End(bytes) if bytes.is_empty() => return None,
                    SseStep::End(bytes) => return Some((Ok(bytes.to_vec()), (shared, feed, true))),
                    SseStep::Wait => {}
                }
                let timer = Box::pin(worker::Delay::from(keep_alive));
                if let Either::Right(_) = select(woken, timer).await {
                    let bytes = shared.with(|s| feed.keep_alive(s)).unwrap_or_default();
                    return Some((Ok(bytes.to_vec()), (shared, feed, false)));
                }
            }
        },
    )
}

fn headers_of(reply: &Reply) -> worker::Result<Headers> {
    let headers = Headers::new();
    for (name, value) in &reply.headers {
        headers.set(name.as_str(), value.to_str().unwrap_or_default())?;
    }
    Ok(headers)
}

/// The Worker response for a complete answer (no body object at all when
/// it is empty: 204 and 304 may not have one).
pub(crate) fn respond(reply: Reply) -> worker::Result<Response> {
    let reply = reply.with_common_headers();
    let headers = headers_of(&reply)?;
    let response = if reply.body.is_empty() {
        Response::empty()?
    } else {
        Response::from_bytes(reply.body.to_vec())?
    };
    Ok(response
        .with_status(reply.status.as_u16())
        .with_headers(headers))
}
