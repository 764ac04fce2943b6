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
use harness_core::actor::Role;
use harness_core::frame::Frame;
use harness_core::log::{LogInfo, SessionLog};
use harness_core::{ErrorKind, SessionId};
use session_runtime::{Connection, Hub, Outbound, SharedFrame};

use ::durable_streams::sessions::{
    data_event_into, frame_control_into, frame_data_event, offset_of, seq_of, FramesRead,
    MAX_FRAMES_PER_READ,
};

use super::{control, control_into, cursor, read_params, sse_headers, DurableStreamsState, Reply};

fn log_error(e: harness_core::Error) -> Reply {
    let status = match e.kind() {
        ErrorKind::NotFound => StatusCode::NOT_FOUND,
        ErrorKind::InvalidInput => StatusCode::BAD_REQUEST,
        // Retention trimmed the frames at that offset (docs/retention.md).
        ErrorKind::Gone => StatusCode::GONE,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    Reply::text(status, e.to_string())
}

/// Read up to [`MAX_FRAMES_PER_READ`] frames after `after`.
async fn frames_after(
    log: &Arc<dyn SessionLog>,
    session: &SessionId,
    after: u64,
) -> Result<Vec<Frame>, Reply> {
    match log.read(session, after, MAX_FRAMES_PER_READ).await {
        // From the start of a trimmed log: from its cut, the earliest
        // offset it keeps. From an offset inside the cut: 410.
        Err(e) if e.kind() == ErrorKind::Gone && after == 0 => {
            let info = log.info(session).await.map_err(log_error)?;
            log.read(session, info.kept_after(), MAX_FRAMES_PER_READ)
                .await
                .map_err(log_error)
        }
        read => read.map_err(log_error),
    }
}

/// The next stored frame the actor fans out to `conn`; `None` when the
/// actor dropped the connection. Live parts and the rest are skipped.
async fn next_frame(conn: &mut Connection) -> Option<SharedFrame> {
    loop {
        match conn.recv().await? {
            Outbound::Frame(frame) => return Some(frame),
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
            if frame.frame().seq > after {
                return;
            }
        }
    };
    let _ = tokio::time::timeout(timeout, woken).await;
    hub.log().info(session).await.map_err(log_error)
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
        return ::durable_streams::sessions::read_only().into();
    }
    let log = hub.log().clone();
    let info = match log.info(session).await {
        Ok(i) => i,
        Err(e) => return log_error(e),
    };
    if method == Method::HEAD {
        return ::durable_streams::sessions::head(info.last_seq, info.sealed).into();
    }
    let p = match read_params(params) {
        Ok(p) => p,
        Err(r) => return r.into(),
    };
    let after = seq_of(p.offset.as_deref(), info.last_seq);
    if p.live.as_deref() == Some("sse") {
        let timeout = state.long_poll_timeout;
        let pump = SsePump {
            hub,
            session: session.clone(),
            after,
            cursor: p.cursor,
            first: true,
            conn: None,
            done: false,
            timeout,
            keep_alive: Box::pin(tokio::time::sleep(timeout)),
            last_sent: tokio::time::Instant::now(),
        };
        let body = futures::stream::unfold(pump, |mut pump| async move {
            let chunk = pump.next_chunk().await?;
            Some((Ok::<_, std::convert::Infallible>(chunk), pump))
        });
        return Reply::from(sse_headers(
            ::durable_streams::Reply::new(StatusCode::OK),
            false,
        ))
        .body(Body::from_stream(body));
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
            let cursor = cursor(p.cursor.as_deref());
            return ::durable_streams::sessions::nothing_new(after, &cursor, info.sealed).into();
        }
    }
    let frames = match frames_after(&log, session, after).await {
        Ok(f) => f,
        Err(r) => return r,
    };
    let read = FramesRead {
        path,
        offset: p.offset.as_deref(),
        after,
        last_seq: info.last_seq,
        sealed: info.sealed,
        cursor: (p.live.as_deref() == Some("long-poll")).then(|| cursor(p.cursor.as_deref())),
        if_none_match: headers.get("if-none-match").and_then(|v| v.to_str().ok()),
    };
    read.reply(&frames).into()
}

/// The body of a `live=sse` read, produced as the client reads it (no task
/// or channel in between): catch up from the log a page per chunk, then
/// follow the actor, every frame it has queued in one chunk, each data
/// event (its frame's JSON encoded once for all readers) followed by its
/// control event. Back to catching up when the actor drops the connection
/// (e.g. the reader fell too far behind); a gone client drops it.
struct SsePump {
    hub: Arc<Hub>,
    session: SessionId,
    /// The last seq sent.
    after: u64,
    /// The client's cursor, echoed (advanced) in control events.
    cursor: Option<String>,
    first: bool,
    conn: Option<Connection>,
    done: bool,
    /// A quiet spell this long sends a keep-alive control event.
    timeout: Duration,
    /// Fires `timeout` after `last_sent` (re-armed only when it fires).
    keep_alive: std::pin::Pin<Box<tokio::time::Sleep>>,
    last_sent: tokio::time::Instant,
}

impl SsePump {
    fn cursor(&self) -> String {
        cursor(self.cursor.as_deref())
    }

    async fn next_chunk(&mut self) -> Option<Bytes> {
        if self.done {
            return None;
        }
        let chunk = self.produce().await;
        if chunk.is_none() {
            self.done = true;
        }
        self.last_sent = tokio::time::Instant::now();
        chunk.map(Bytes::from)
    }

    /// The next chunk; `None` ends the stream.
    async fn produce(&mut self) -> Option<Vec<u8>> {
        loop {
            let next = if self.conn.is_none() {
                self.catch_up().await?
            } else {
                self.follow().await?
            };
            if let Some(chunk) = next {
                return Some(chunk);
            }
        }
    }

    /// One page from the log, or a control event; `Ok(None)` once
    /// connected to the actor.
    async fn catch_up(&mut self) -> Option<Option<Vec<u8>>> {
        let log = self.hub.log().clone();
        let frames = frames_after(&log, &self.session, self.after).await.ok()?;
        let info = log.info(&self.session).await.ok()?;
        let first = std::mem::replace(&mut self.first, false);
        if !frames.is_empty() {
            // A page of events in one chunk.
            let cursor = self.cursor();
            let mut page = Vec::with_capacity(frames.len() * 320);
            for f in &frames {
                frame_data_event(f, &mut page);
                self.after = f.seq;
                let at_tail = self.after >= info.last_seq;
                if at_tail && info.sealed {
                    control_into(offset_of(self.after), None, true, true, &mut page);
                    self.done = true;
                    return Some(Some(page));
                }
                control_into(
                    offset_of(self.after),
                    Some(&cursor),
                    at_tail,
                    false,
                    &mut page,
                );
            }
            return Some(Some(page));
        }
        if info.sealed {
            self.done = true;
            return Some(Some(
                control(offset_of(self.after), None, true, true).to_vec(),
            ));
        }
        if first {
            // Up to date from the start.
            let cursor = self.cursor();
            return Some(Some(
                control(offset_of(self.after), Some(&cursor), true, false).to_vec(),
            ));
        }
        if self.after < info.last_seq {
            // Frames came meanwhile: read on.
            return Some(None);
        }
        let conn = self
            .hub
            .connect(&self.session, Role::Client, Some(self.after))
            .await
            .ok()?;
        self.conn = Some(conn);
        Some(None)
    }

    /// What the actor has queued (waiting for the first), as one chunk;
    /// `Some(None)` when the actor dropped the connection.
    async fn follow(&mut self) -> Option<Option<Vec<u8>>> {
        let mut conn = self.conn.take()?;
        let first = loop {
            tokio::select! {
                biased;
                out = conn.recv() => match out {
                    Some(Outbound::Frame(frame)) => break frame,
                    Some(Outbound::Msg(_)) => {}
                    // Dropped by the actor: catch up from the log again.
                    Some(Outbound::Close(_)) | None => return Some(None),
                },
                _ = &mut self.keep_alive => {
                    let due = self.last_sent + self.timeout;
                    let now = tokio::time::Instant::now();
                    if now < due {
                        // Something was sent since the timer was armed.
                        self.keep_alive.as_mut().reset(due);
                        continue;
                    }
                    self.keep_alive.as_mut().reset(now + self.timeout);
                    self.conn = Some(conn);
                    let cursor = self.cursor();
                    return Some(Some(
                        control(offset_of(self.after), Some(&cursor), true, false).to_vec(),
                    ));
                }
            }
        };
        // The frames the actor has already queued form one batch: the
        // reader is up to date after its last one.
        let mut batch = vec![first];
        let mut dropped = false;
        loop {
            match conn.try_recv() {
                Some(Outbound::Frame(frame)) => batch.push(frame),
                Some(Outbound::Msg(_)) => {}
                Some(Outbound::Close(_)) => {
                    dropped = true;
                    break;
                }
                None => break,
            }
        }
        let log = self.hub.log().clone();
        let mut expect = self.after;
        let mut events: Vec<Pending> = Vec::with_capacity(batch.len());
        for frame in batch {
            let seq = frame.frame().seq;
            if seq <= expect {
                continue;
            }
            // A frame stored without the actor: read the gap from the log.
            while seq > expect + 1 {
                let gap = frames_after(&log, &self.session, expect).await.ok()?;
                let gap: Vec<Frame> = gap.into_iter().filter(|f| f.seq < seq).collect();
                let Some(last) = gap.last() else { break };
                expect = last.seq;
                events.extend(gap.into_iter().map(Pending::Read));
            }
            expect = seq;
            events.push(Pending::Shared(frame));
        }
        let count = events.len();
        let cursor = self.cursor();
        let mut chunk = Vec::with_capacity(count * 320);
        for (i, event) in events.iter().enumerate() {
            let frame = match event {
                Pending::Shared(f) => {
                    data_event_into(f.json(), &mut chunk);
                    f.frame()
                }
                Pending::Read(f) => {
                    frame_data_event(f, &mut chunk);
                    f
                }
            };
            self.after = frame.seq;
            if frame_control_into(frame, &cursor, i + 1 == count, &mut chunk) {
                self.done = true;
                return Some(Some(chunk));
            }
        }
        if !dropped {
            self.conn = Some(conn);
        }
        Some((!chunk.is_empty()).then_some(chunk))
    }
}

/// A frame of a follow batch: shared by the actor, or read from the log.
// A read frame is the large variant (232 bytes: a turn status carries its
// sandbox handle); a batch holds few, so boxing each would buy nothing.
#[allow(clippy::large_enum_variant)]
enum Pending {
    Shared(SharedFrame),
    Read(Frame),
}
