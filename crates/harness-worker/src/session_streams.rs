//! Session logs as read-only Durable Streams on the Worker
//! (`/v1/stream/sessions/<id>`), answered by the session's object with the
//! `durable-streams` crate's session answers, as `session-server` answers
//! them: catch-up pages from the object's SQLite, long-polls and SSE
//! readers following the actor (a reader connection at the offset: the
//! actor replays what it missed, then fans out each stored frame).

use std::time::Duration;

use durable_streams::protocol::{control, read_params, sse_headers, Reply};
use durable_streams::sessions::{
    data_event_into, frame_control_into, head, nothing_new, offset_of, read_only, seq_of,
    FramesRead, MAX_FRAMES_PER_READ,
};
use durable_streams::util;
use futures::future::{select, Either};
use futures::StreamExt;
use harness_core::actor::ServerMessage;
use harness_core::frame::Frame;
use harness_core::log::SessionStore;
use harness_core::SessionId;
use session_api::ApiError;
use worker::{Method, Request, Response};

use crate::object::{Inbox, Leave, Outbound, SessionObject};
use crate::store::DoStore;
use crate::streams::{long_poll_timeout, respond};

/// The header carrying the client's path from the front (the etag names it).
pub(crate) const PATH_HEADER: &str = "x-harness-stream-path";

fn internal(e: worker::Error) -> ApiError {
    ApiError::new(500, "internal", e.to_string())
}

/// A `Stream-Cursor` for a client that sent `client`, now.
fn cursor(client: Option<&str>) -> String {
    let now = worker::js_sys::Date::now() as i64;
    let random = (worker::js_sys::Math::random() * 9_007_199_254_740_991.0) as u64;
    util::response_cursor(client, now, random)
}

/// The next frame the actor sends a reader; `None` when it closed the
/// connection.
async fn next_frame(rx: &mut Inbox) -> Option<Frame> {
    loop {
        match rx.next().await? {
            Outbound::Msg(ServerMessage::Frame { frame }) => return Some(frame),
            Outbound::Msg(_) => {}
            Outbound::Close(_) => return None,
        }
    }
}

impl SessionObject {
    /// `GET`/`HEAD` of the session's stream; anything else is 405.
    pub(crate) async fn session_stream(
        &self,
        session: &SessionId,
        store: &DoStore,
        req: &Request,
    ) -> Result<Response, ApiError> {
        let method = req.method();
        if !matches!(method, Method::Get | Method::Head) {
            return respond(read_only()).map_err(internal);
        }
        let info = store.info().await?;
        if method == Method::Head {
            return respond(head(info.last_seq, info.sealed)).map_err(internal);
        }
        let url = req.url().map_err(internal)?;
        let params = util::query_pairs(url.query().unwrap_or_default());
        let p = match read_params(&params) {
            Ok(p) => p,
            Err(reply) => return respond(reply).map_err(internal),
        };
        let header = |name: &str| req.headers().get(name).ok().flatten();
        let path = header(PATH_HEADER).unwrap_or_default();
        // From the start (`-1`) of a trimmed log: from its cut; from an
        // offset inside the cut: 410 (docs/retention.md).
        let after = info.reader_start(seq_of(p.offset.as_deref(), info.last_seq))?;
        let timeout = long_poll_timeout(&self.env);
        if p.live.as_deref() == Some("sse") {
            return self
                .session_stream_sse(
                    session,
                    after,
                    info.last_seq,
                    info.sealed,
                    p.cursor,
                    timeout,
                )
                .await;
        }
        let long_poll = p.live.as_deref() == Some("long-poll");
        let mut info = info;
        if long_poll && info.last_seq <= after {
            if !info.sealed {
                // Follow the actor: it replays what came after `after`
                // since the look above, then fans out each stored frame.
                let (conn, mut rx) = self.connect_reader(session, after).await?;
                let _leave = Leave {
                    conn,
                    gone: self.gone.clone(),
                };
                let woken = Box::pin(async {
                    while let Some(frame) = next_frame(&mut rx).await {
                        if frame.seq > after {
                            return;
                        }
                    }
                });
                let timer = Box::pin(worker::Delay::from(timeout));
                let _ = select(woken, timer).await;
                info = store.info().await?;
            }
            if info.last_seq <= after {
                let cursor = cursor(p.cursor.as_deref());
                return respond(nothing_new(after, &cursor, info.sealed)).map_err(internal);
            }
        }
        let frames = store.read(after, MAX_FRAMES_PER_READ).await?;
        let if_none_match = header("if-none-match");
        let read = FramesRead {
            path: &path,
            offset: p.offset.as_deref(),
            after,
            last_seq: info.last_seq,
            sealed: info.sealed,
            cursor: long_poll.then(|| cursor(p.cursor.as_deref())),
            if_none_match: if_none_match.as_deref(),
        };
        respond(read.reply(&frames)).map_err(internal)
    }

    /// `live=sse`: every frame after `after` as a data event and its
    /// control event, the frames the actor has queued in one chunk (up to
    /// date after the last of them once past the tail seen at connect), a
    /// keep-alive control event after `keep_alive` of quiet, and the close
    /// when the log is sealed.
    async fn session_stream_sse(
        &self,
        session: &SessionId,
        after: u64,
        tail: u64,
        sealed: bool,
        client_cursor: Option<String>,
        keep_alive: Duration,
    ) -> Result<Response, ApiError> {
        let head = sse_headers(Reply::new(http::StatusCode::OK), false).with_common_headers();
        let headers = worker::Headers::new();
        for (name, value) in &head.headers {
            headers
                .set(name.as_str(), value.to_str().unwrap_or_default())
                .map_err(internal)?;
        }
        if sealed && after >= tail {
            let closed = control(offset_of(after), None, true, true).to_vec();
            let body = futures::stream::iter([Ok::<Vec<u8>, worker::Error>(closed)]);
            return Ok(Response::from_stream(body)
                .map_err(internal)?
                .with_headers(headers));
        }
        let (conn, rx) = self.connect_reader(session, after).await?;
        let reader = StreamReader {
            rx,
            after,
            tail,
            first: true,
            done: false,
            client_cursor,
            keep_alive,
            _leave: Leave {
                conn,
                gone: self.gone.clone(),
            },
        };
        let body = futures::stream::unfold(reader, |mut reader| async move {
            let chunk = reader.next_chunk().await?;
            Some((Ok::<Vec<u8>, worker::Error>(chunk), reader))
        });
        Ok(Response::from_stream(body)
            .map_err(internal)?
            .with_headers(headers))
    }
}

/// One SSE reader of a session stream.
#[derive(Debug)]
struct StreamReader {
    rx: Inbox,
    /// The last seq sent.
    after: u64,
    /// The log's last seq when the reader connected.
    tail: u64,
    first: bool,
    done: bool,
    client_cursor: Option<String>,
    keep_alive: Duration,
    _leave: Leave,
}

impl StreamReader {
    async fn next_chunk(&mut self) -> Option<Vec<u8>> {
        if self.done {
            return None;
        }
        let cursor = cursor(self.client_cursor.as_deref());
        if std::mem::replace(&mut self.first, false) && self.after >= self.tail {
            // Up to date from the start.
            return Some(control(offset_of(self.after), Some(&cursor), true, false).to_vec());
        }
        let first = {
            let timer = Box::pin(worker::Delay::from(self.keep_alive));
            let next = Box::pin(next_frame(&mut self.rx));
            match select(next, timer).await {
                Either::Left((Some(frame), _)) => frame,
                Either::Left((None, _)) => {
                    self.done = true;
                    return None;
                }
                Either::Right(_) => {
                    return Some(
                        control(offset_of(self.after), Some(&cursor), true, false).to_vec(),
                    );
                }
            }
        };
        // What the actor has already queued goes as one chunk.
        let mut batch = vec![first];
        while let Ok(out) = self.rx.try_recv() {
            match out {
                Outbound::Msg(ServerMessage::Frame { frame }) => batch.push(frame),
                Outbound::Msg(_) => {}
                Outbound::Close(_) => break,
            }
        }
        batch.retain(|f| f.seq > self.after);
        let count = batch.len();
        let mut chunk = Vec::with_capacity(count * 320);
        for (i, frame) in batch.iter().enumerate() {
            data_event_into(&serde_json::to_vec(frame).unwrap_or_default(), &mut chunk);
            self.after = frame.seq;
            let up_to_date = i + 1 == count && frame.seq >= self.tail;
            if frame_control_into(frame, &cursor, up_to_date, &mut chunk) {
                self.done = true;
                break;
            }
        }
        Some(chunk)
    }
}
