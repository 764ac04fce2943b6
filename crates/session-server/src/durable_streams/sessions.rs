//! Session logs as read-only Durable Streams: `/v1/stream/sessions/<id>`.
//!
//! The stream is `application/json`; each item is one stored frame
//! (`{"seq", "at_ms", "body"}`). The offset after frame `n` is
//! `0000000000000000_<n, 16 digits>`, so a reader can map offsets to seqs
//! and back; the tail is the log's last seq and the stream is closed once
//! the log is sealed. Writes go through the session API (`/v1/sessions`),
//! never through this route, so `PUT`/`POST`/`DELETE` answer 405.
//!
//! Catch-up reads come straight from the log. Live reads (long-poll, SSE)
//! follow the session's actor, like `/v1/sessions/<id>/events`: the reader
//! opens a client connection to the [`Hub`] at its offset and is woken by
//! the actor's fan-out of each stored frame, with no timer involved. Every
//! write goes through the actor, so nothing is missed; a frame that reaches
//! the log some other way is picked up with the next frame the actor fans
//! out (the gap is read from the log).

use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, Method, StatusCode};
use futures::FutureExt;
use harness_core::actor::{Role, ServerMessage};
use harness_core::frame::{Frame, FrameBody};
use harness_core::log::{LogInfo, SessionLog};
use harness_core::{ErrorKind, SessionId};
use session_runtime::{Connection, Hub, Outbound};
use tokio::sync::mpsc;

use super::{
    channel_body, control, read_params, sse_event, sse_headers, util, DurableStreamsState, Offset,
    Reply, STREAM_CLOSED, STREAM_CURSOR, STREAM_NEXT_OFFSET, STREAM_UP_TO_DATE,
};

/// Frames per catch-up response; a longer log answers without
/// `Stream-Up-To-Date` and the client reads on from `Stream-Next-Offset`.
const MAX_FRAMES_PER_READ: usize = 1000;

fn offset_of(seq: u64) -> Offset {
    Offset {
        read_seq: 0,
        byte: seq,
    }
}

fn log_error(e: harness_core::Error) -> Reply {
    let status = match e.kind() {
        ErrorKind::NotFound => StatusCode::NOT_FOUND,
        ErrorKind::InvalidInput => StatusCode::BAD_REQUEST,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    Reply::text(status, e.to_string())
}

fn frames_json(frames: &[Frame]) -> String {
    serde_json::to_string(frames).unwrap_or_else(|_| "[]".into())
}

/// Read up to [`MAX_FRAMES_PER_READ`] frames after `after`.
async fn frames_after(
    log: &Arc<dyn SessionLog>,
    session: &SessionId,
    after: u64,
) -> Result<Vec<Frame>, Reply> {
    log.read(session, after, MAX_FRAMES_PER_READ)
        .await
        .map_err(log_error)
}

/// The next stored frame the actor fans out to `conn`; `None` when the
/// actor dropped the connection. Live parts and the rest are skipped.
async fn next_frame(conn: &mut Connection) -> Option<Frame> {
    loop {
        match conn.recv().await? {
            Outbound::Msg(ServerMessage::Frame { frame }) => return Some(frame),
            Outbound::Msg(_) => {}
            Outbound::Close(_) => return None,
        }
    }
}

/// Wait, following the actor, until the log has frames after `after`, is
/// sealed, or `timeout`; then answer the log's info.
async fn wait(
    hub: &Hub,
    session: &SessionId,
    after: u64,
    timeout: Duration,
) -> Result<LogInfo, Reply> {
    // The actor replays (after, last] first, so a frame stored between
    // the caller's look at the log and this connect still wakes us.
    let mut conn = hub
        .connect(session, Role::Client, Some(after))
        .await
        .map_err(log_error)?;
    let woken = async {
        while let Some(frame) = next_frame(&mut conn).await {
            if frame.seq > after {
                return;
            }
        }
    };
    let _ = tokio::time::timeout(timeout, woken).await;
    hub.log().info(session).await.map_err(log_error)
}

fn seq_of(raw: Option<&str>, tail: u64) -> u64 {
    match raw {
        None | Some("-1") => 0,
        Some("now") => tail,
        Some(o) => Offset::parse(o).map(|o| o.byte).unwrap_or(0),
    }
}

pub(super) async fn handle(
    state: &DurableStreamsState,
    hub: Arc<Hub>,
    session: &SessionId,
    path: &str,
    method: Method,
    params: &[(String, String)],
    headers: &HeaderMap,
) -> Reply {
    if method != Method::GET && method != Method::HEAD {
        return Reply::text(
            StatusCode::METHOD_NOT_ALLOWED,
            "session streams are read-only: write through /v1/sessions/<id>",
        );
    }
    let log = hub.log().clone();
    let info = match log.info(session).await {
        Ok(i) => i,
        Err(e) => return log_error(e),
    };
    if method == Method::HEAD {
        let mut reply = Reply::new(StatusCode::OK)
            .header("content-type", "application/json")
            .header(STREAM_NEXT_OFFSET, offset_of(info.last_seq).to_string())
            .header("cache-control", "no-store");
        if info.sealed {
            reply = reply.header(STREAM_CLOSED, "true");
        }
        return reply;
    }
    let p = match read_params(params) {
        Ok(p) => p,
        Err(r) => return r,
    };
    let after = seq_of(p.offset.as_deref(), info.last_seq);
    if p.live.as_deref() == Some("sse") {
        let (tx, rx) = mpsc::channel(64);
        let timeout = state.long_poll_timeout;
        let session = session.clone();
        tokio::spawn(async move {
            let _ = sse_loop(&hub, &session, after, p.cursor, timeout, &tx).await;
        });
        return sse_headers(Reply::new(StatusCode::OK), false).body(channel_body(rx));
    }
    let mut info = info;
    if p.live.as_deref() == Some("long-poll") && info.last_seq <= after {
        if !info.sealed {
            info = match wait(&hub, session, after, state.long_poll_timeout).await {
                Ok(i) => i,
                Err(r) => return r,
            };
        }
        if info.last_seq <= after {
            let mut reply = Reply::new(StatusCode::NO_CONTENT)
                .header(STREAM_NEXT_OFFSET, offset_of(after).to_string())
                .header(STREAM_UP_TO_DATE, "true")
                .header(STREAM_CURSOR, util::response_cursor(p.cursor.as_deref()));
            if info.sealed {
                reply = reply.header(STREAM_CLOSED, "true");
            }
            return reply;
        }
    }
    let frames = match frames_after(&log, session, after).await {
        Ok(f) => f,
        Err(r) => return r,
    };
    let end = frames.last().map(|f| f.seq).unwrap_or(after);
    // Frames may have been appended after `info` was taken.
    let tail = info.last_seq.max(end);
    let up_to_date = end >= tail;
    let closed = info.sealed && up_to_date;
    let tag = format!(
        "\"{}:{}:{}{}\"",
        util::base64(path.as_bytes()),
        p.offset.as_deref().unwrap_or("-1"),
        offset_of(end),
        if closed { ":c" } else { "" }
    );
    if headers.get("if-none-match").and_then(|v| v.to_str().ok()) == Some(tag.as_str()) {
        return Reply::new(StatusCode::NOT_MODIFIED).header("etag", tag);
    }
    let mut reply = Reply::new(StatusCode::OK)
        .header("content-type", "application/json")
        .header(STREAM_NEXT_OFFSET, offset_of(end).to_string())
        .header("etag", tag)
        .body(Body::from(frames_json(&frames)));
    if up_to_date {
        reply = reply.header(STREAM_UP_TO_DATE, "true");
    }
    if closed {
        reply = reply.header(STREAM_CLOSED, "true");
    }
    if p.live.as_deref() == Some("long-poll") {
        reply = reply.header(STREAM_CURSOR, util::response_cursor(p.cursor.as_deref()));
    }
    reply
}

async fn sse_loop(
    hub: &Hub,
    session: &SessionId,
    mut after: u64,
    cursor: Option<String>,
    timeout: Duration,
    tx: &mpsc::Sender<Result<Bytes, std::convert::Infallible>>,
) -> Result<(), ()> {
    let log = hub.log();
    let send = |b: Bytes| async move { tx.send(Ok(b)).await.map_err(|_| ()) };
    let cursor = || Some(util::response_cursor(cursor.as_deref()));
    let mut first = true;
    // Catch up from the log, then follow the actor; back here when the
    // actor drops the connection (e.g. the reader fell too far behind).
    loop {
        let frames = frames_after(log, session, after).await.map_err(|_| ())?;
        let info = log.info(session).await.map_err(|_| ())?;
        // A page of events in one chunk.
        let mut page = Vec::with_capacity(frames.len() * 320);
        for f in &frames {
            page.extend_from_slice(&sse_event("data", &frames_json(std::slice::from_ref(f))));
            after = f.seq;
            let at_tail = after >= info.last_seq;
            if at_tail && info.sealed {
                page.extend_from_slice(&control(offset_of(after), None, true, true));
                return send(Bytes::from(page)).await;
            }
            page.extend_from_slice(&control(offset_of(after), cursor(), at_tail, false));
        }
        if !page.is_empty() {
            send(Bytes::from(page)).await?;
        }
        if frames.is_empty() {
            if info.sealed {
                return send(control(offset_of(after), None, true, true)).await;
            }
            if first {
                send(control(offset_of(after), cursor(), true, false)).await?;
            }
        }
        first = false;
        if after < info.last_seq {
            continue;
        }
        let mut conn = hub
            .connect(session, Role::Client, Some(after))
            .await
            .map_err(|_| ())?;
        loop {
            // Wait for the actor's next frame, stopping early when the
            // client is gone; a quiet spell sends a keep-alive control.
            let next = tokio::select! {
                r = tokio::time::timeout(timeout, next_frame(&mut conn)) => r,
                _ = tx.closed() => return Ok(()),
            };
            let frame = match next {
                Err(_) => {
                    send(control(offset_of(after), cursor(), true, false)).await?;
                    continue;
                }
                Ok(None) => break,
                Ok(Some(frame)) => frame,
            };
            // The frames the actor has already queued form one batch: the
            // reader is up to date after its last one.
            let mut batch = vec![frame];
            while let Some(Some(more)) = next_frame(&mut conn).now_or_never() {
                batch.push(more);
            }
            let mut pending = Vec::new();
            for frame in batch {
                if frame.seq <= after {
                    continue;
                }
                let mut expect = pending.last().map_or(after, |f: &Frame| f.seq);
                // A frame stored without the actor: read the gap from the log.
                while frame.seq > expect + 1 {
                    let gap = frames_after(log, session, expect).await.map_err(|_| ())?;
                    let gap: Vec<Frame> = gap.into_iter().filter(|f| f.seq < frame.seq).collect();
                    let Some(last) = gap.last() else { break };
                    expect = last.seq;
                    pending.extend(gap);
                }
                pending.push(frame);
            }
            // The batch's events in one chunk.
            let count = pending.len();
            let mut chunk = Vec::with_capacity(count * 320);
            for (i, f) in pending.iter().enumerate() {
                chunk.extend_from_slice(&sse_event("data", &frames_json(std::slice::from_ref(f))));
                after = f.seq;
                if matches!(f.body, FrameBody::Sealed {}) {
                    chunk.extend_from_slice(&control(offset_of(after), None, true, true));
                    return send(Bytes::from(chunk)).await;
                }
                chunk.extend_from_slice(&control(
                    offset_of(after),
                    cursor(),
                    i + 1 == count,
                    false,
                ));
            }
            if !chunk.is_empty() {
                send(Bytes::from(chunk)).await?;
            }
        }
    }
}
