//! Session logs as read-only Durable Streams (`/v1/stream/sessions/<id>`):
//! the answers both servers give, with no runtime. Where the frames come
//! from (a log, an actor's fan-out) is the host's.
//!
//! The stream is `application/json`; each item is one stored frame
//! (`{"seq", "at_ms", "body"}`). The offset after frame `n` is
//! `0000000000000000_<n, 16 digits>` ([`offset_of`]), so a reader maps
//! offsets to seqs and back; the tail is the log's last seq and the stream is
//! closed once the log is sealed. Writes go through the session API, so
//! `PUT`/`POST`/`DELETE` answer 405 ([`read_only`]).

use bytes::Bytes;
use harness_core::frame::{Frame, FrameBody};
use http::StatusCode;

use crate::protocol::{
    control_into, etag, Reply, STREAM_CLOSED, STREAM_CURSOR, STREAM_NEXT_OFFSET, STREAM_UP_TO_DATE,
};
use crate::store::Offset;

/// Frames per catch-up response; a longer log answers without
/// `Stream-Up-To-Date` and the client reads on from `Stream-Next-Offset`.
pub const MAX_FRAMES_PER_READ: usize = 1000;

/// The offset after frame `seq`.
pub fn offset_of(seq: u64) -> Offset {
    Offset {
        read_seq: 0,
        byte: seq,
    }
}

/// The seq a read's `offset` parameter starts after (`-1` or none: 0,
/// `now`: the tail).
pub fn seq_of(raw: Option<&str>, tail: u64) -> u64 {
    match raw {
        None | Some("-1") => 0,
        Some("now") => tail,
        Some(o) => Offset::parse(o).map(|o| o.byte).unwrap_or(0),
    }
}

/// The answer to a write.
pub fn read_only() -> Reply {
    Reply::text(
        StatusCode::METHOD_NOT_ALLOWED,
        "session streams are read-only: write through /v1/sessions/<id>",
    )
}

/// `HEAD`: the tail and whether the log is sealed.
pub fn head(last_seq: u64, sealed: bool) -> Reply {
    let reply = Reply::new(StatusCode::OK)
        .header("content-type", "application/json")
        .header(STREAM_NEXT_OFFSET, offset_of(last_seq).to_string())
        .header("cache-control", "no-store");
    if sealed {
        reply.header(STREAM_CLOSED, "true")
    } else {
        reply
    }
}

/// A long-poll that found nothing after `after`: 204, up to date.
pub fn nothing_new(after: u64, cursor: &str, sealed: bool) -> Reply {
    let reply = Reply::new(StatusCode::NO_CONTENT)
        .header(STREAM_NEXT_OFFSET, offset_of(after).to_string())
        .header(STREAM_UP_TO_DATE, "true")
        .header(STREAM_CURSOR, cursor);
    if sealed {
        reply.header(STREAM_CLOSED, "true")
    } else {
        reply
    }
}

/// A read of session stream `path` (from `offset` as the client wrote it)
/// answered with `frames`, the frames after `after` up to
/// [`MAX_FRAMES_PER_READ`].
#[derive(Debug)]
pub struct FramesRead<'a> {
    /// The request path (the etag names it).
    pub path: &'a str,
    /// The `offset` parameter as sent.
    pub offset: Option<&'a str>,
    /// The seq the read started after.
    pub after: u64,
    /// The log's last seq when the read looked (frames appended since may
    /// be in `frames`).
    pub last_seq: u64,
    /// The log is sealed.
    pub sealed: bool,
    /// The `Stream-Cursor` to answer with, on long-polls.
    pub cursor: Option<String>,
    /// The client's `If-None-Match`.
    pub if_none_match: Option<&'a str>,
}

impl FramesRead<'_> {
    /// The answer: the frames as one JSON array, with offsets, up-to-date,
    /// closed and etag (304 when the client has it).
    pub fn reply(&self, frames: &[Frame]) -> Reply {
        let end = frames.last().map(|f| f.seq).unwrap_or(self.after);
        // Frames may have been appended after the log's tail was read.
        let tail = self.last_seq.max(end);
        let up_to_date = end >= tail;
        let closed = self.sealed && up_to_date;
        let tag = etag(
            self.path,
            self.offset.unwrap_or("-1"),
            offset_of(end),
            closed,
        );
        if self.if_none_match == Some(tag.as_str()) {
            return Reply::new(StatusCode::NOT_MODIFIED).header("etag", tag);
        }
        let mut reply = Reply::new(StatusCode::OK)
            .header("content-type", "application/json")
            .header(STREAM_NEXT_OFFSET, offset_of(end).to_string())
            .header("etag", tag)
            .body(Bytes::from(
                serde_json::to_vec(frames).unwrap_or_else(|_| b"[]".to_vec()),
            ));
        if up_to_date {
            reply = reply.header(STREAM_UP_TO_DATE, "true");
        }
        if closed {
            reply = reply.header(STREAM_CLOSED, "true");
        }
        if let Some(cursor) = &self.cursor {
            reply = reply.header(STREAM_CURSOR, cursor);
        }
        reply
    }
}

/// The data event of one frame given as its JSON (`event: data`,
/// `data:[<frame JSON>]`: a JSON stream's items go as an array), appended
/// to `out`.
pub fn data_event_into(json: &[u8], out: &mut Vec<u8>) {
    // Compact JSON has no raw line break, so it is one data line; it starts
    // with `[`, so `data:` takes no extra space.
    out.reserve(json.len() + 22);
    out.extend_from_slice(b"event: data\ndata:[");
    out.extend_from_slice(json);
    out.extend_from_slice(b"]\n\n");
}

/// The data event of `frame`, appended to `out`.
pub fn frame_data_event(frame: &Frame, out: &mut Vec<u8>) {
    // Frames are plain data: encoding cannot fail.
    data_event_into(&serde_json::to_vec(frame).unwrap_or_default(), out);
}

/// After the data event of `frame`, its control event: the offset after
/// it, and either the close (a seal ends the stream: `true` is returned,
/// send nothing more) or the cursor and whether the reader is up to date.
pub fn frame_control_into(
    frame: &Frame,
    cursor: &str,
    up_to_date: bool,
    out: &mut Vec<u8>,
) -> bool {
    if matches!(frame.body, FrameBody::Sealed {}) {
        control_into(offset_of(frame.seq), None, true, true, out);
        return true;
    }
    control_into(offset_of(frame.seq), Some(cursor), up_to_date, false, out);
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_frame_data_event_is_the_generic_sse_encoding_of_its_json_array() {
        let frame = Frame {
            seq: 5,
            at_ms: 1,
            body: FrameBody::UserMessage {
                text: "two\nlines\r\n \"quoted\"".into(),
                turn_id: Some("t1".into()),
            },
        };
        let json = serde_json::to_string(std::slice::from_ref(&frame)).unwrap();
        let expected = crate::protocol::sse_event("data", &json);
        let mut out = Vec::new();
        frame_data_event(&frame, &mut out);
        assert_eq!(out, &expected[..]);
    }

    #[test]
    fn offsets_carry_seqs() {
        assert_eq!(
            offset_of(7).to_string(),
            "0000000000000000_0000000000000007"
        );
        assert_eq!(seq_of(Some(&offset_of(7).to_string()), 9), 7);
        assert_eq!(seq_of(Some("now"), 9), 9);
        assert_eq!(seq_of(Some("-1"), 9), 0);
        assert_eq!(seq_of(None, 9), 0);
    }

    #[test]
    fn a_read_to_a_sealed_tail_is_closed_and_a_partial_one_is_not() {
        let frame = |seq| Frame {
            seq,
            at_ms: 0,
            body: FrameBody::Sealed {},
        };
        let read = FramesRead {
            path: "/v1/stream/sessions/s",
            offset: None,
            after: 0,
            last_seq: 2,
            sealed: true,
            cursor: None,
            if_none_match: None,
        };
        let whole = read.reply(&[frame(1), frame(2)]);
        assert_eq!(whole.get(STREAM_CLOSED), Some("true"));
        assert_eq!(whole.get(STREAM_UP_TO_DATE), Some("true"));
        let part = read.reply(&[frame(1)]);
        assert_eq!(part.get(STREAM_CLOSED), None);
        assert_eq!(part.get(STREAM_UP_TO_DATE), None);
        let tag = whole.get("etag").unwrap().to_string();
        let again = FramesRead {
            if_none_match: Some(&tag),
            ..read
        };
        assert_eq!(
            again.reply(&[frame(1), frame(2)]).status,
            StatusCode::NOT_MODIFIED
        );
    }
}
