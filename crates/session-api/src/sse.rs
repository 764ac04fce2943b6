//! The events of `GET /v1/sessions/{id}/events`: a stored frame is `id:
//! <seq>`, `event: frame`, `data: <Frame JSON>`; a live part is `event:
//! live`, `data: {"turnId","part"}` with no id (so `Last-Event-ID` always
//! names a stored frame); a refusal is `event: error`, `data: {"code",
//! "message"}`. The stream ends after the `sealed` frame.

use harness_core::actor::{ErrorCode, ServerMessage};
use harness_core::frame::{Frame, FrameBody};
use harness_core::StreamPart;
use serde_json::json;

/// One SSE event of the session stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SseEvent {
    /// `id:` (the frame's seq), for stored frames only.
    pub id: Option<u64>,
    /// `event:`.
    pub event: &'static str,
    /// `data:` (one line of JSON).
    pub data: String,
}

impl SseEvent {
    /// A stored frame.
    pub fn frame(frame: &Frame) -> Self {
        Self {
            id: Some(frame.seq),
            event: "frame",
            data: serde_json::to_string(frame).unwrap_or_default(),
        }
    }

    /// A live part of `turn_id`.
    pub fn live(turn_id: &str, part: &StreamPart) -> Self {
        Self {
            id: None,
            event: "live",
            data: json!({"turnId": turn_id, "part": part}).to_string(),
        }
    }

    /// An error sent on the stream.
    pub fn error(code: ErrorCode, message: &str) -> Self {
        Self {
            id: None,
            event: "error",
            data: json!({"code": code, "message": message}).to_string(),
        }
    }

    /// The event on the wire (`text/event-stream`), blank line included.
    pub fn encode(&self) -> String {
        let mut out = String::with_capacity(self.data.len() + 32);
        if let Some(id) = self.id {
            out.push_str(&format!("id: {id}\n"));
        }
        out.push_str("event: ");
        out.push_str(self.event);
        out.push('\n');
        for line in self.data.split('\n') {
            out.push_str("data: ");
            out.push_str(line);
            out.push('\n');
        }
        out.push('\n');
        out
    }
}

/// True for the frame after which a session stream ends.
pub fn ends_stream(frame: &Frame) -> bool {
    matches!(frame.body, FrameBody::Sealed {})
}

/// A comment line that keeps an idle stream open through proxies.
pub const KEEP_ALIVE: &str = ":\n\n";

/// How long an idle stream waits before it sends [`KEEP_ALIVE`].
pub const KEEP_ALIVE_INTERVAL: std::time::Duration = std::time::Duration::from_secs(15);

/// A stored frame's event written into `out` around its JSON (encoded
/// once for every reader): what [`SseEvent::frame`] encodes, without the
/// intermediate strings. Compact JSON has no raw newline: one data line.
pub fn frame_event_into(seq: u64, json: &[u8], out: &mut Vec<u8>) {
    use std::io::Write;
    out.reserve(json.len() + 40);
    // Writing to a Vec cannot fail.
    let _ = write!(out, "id: {seq}\nevent: frame\ndata: ");
    out.extend_from_slice(json);
    out.extend_from_slice(b"\n\n");
}

/// What a reader of `GET /events` does next ([`EventsReader::next`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventsStep {
    /// Read stored frames after `after` from the log and hand them to
    /// [`EventsReader::page`].
    ReadPage {
        /// The last seq sent.
        after: u64,
    },
    /// Connect to the session's actor at `after` (it sends what is stored
    /// after it, then everything live) and call
    /// [`EventsReader::connected`].
    Connect {
        /// The last seq sent.
        after: u64,
    },
    /// Wait for what the actor sends ([`EventsReader::message`],
    /// [`EventsReader::frame`]), sending [`KEEP_ALIVE`] after
    /// [`KEEP_ALIVE_INTERVAL`] of quiet; [`EventsReader::dropped`] when the
    /// actor drops the connection.
    Follow,
    /// The stream is over.
    End,
}

/// The reader of `GET /v1/sessions/{id}/events` as a state machine, which
/// both servers drive with their own I/O: stored frames page by page from
/// the log (bounded memory, whatever the history), then what the actor
/// sends. Each frame goes out once, in seq order; the stream ends after
/// the `sealed` frame, when the actor drops the connection (the client
/// resumes from its `Last-Event-ID`), or, for a session sealed when the
/// request came, once everything stored was sent.
///
/// A host connects when [`next`](Self::next) says so (`session-server`),
/// or first, at the log's end, and reads the log up to there while the
/// actor holds what comes meanwhile ([`connected`](Self::connected) before
/// the first step: the Worker, whose body cannot reach its object later).
#[derive(Debug, Clone)]
pub struct EventsReader {
    /// The last seq sent.
    cursor: u64,
    /// Sealed when the request came: nothing live follows what is stored.
    sealed: bool,
    /// Set once connected: the actor sends the frames after this seq.
    connected_after: Option<u64>,
    /// The last page read was empty.
    caught_up: bool,
    done: bool,
}

impl EventsReader {
    /// A reader from after `after` (0: the whole history) of a session
    /// that is `sealed` or not.
    pub fn new(after: u64, sealed: bool) -> Self {
        Self {
            cursor: after,
            sealed,
            connected_after: None,
            caught_up: false,
            done: false,
        }
    }

    /// The last seq sent.
    pub fn cursor(&self) -> u64 {
        self.cursor
    }

    /// True once the stream is over.
    pub fn is_done(&self) -> bool {
        self.done
    }

    /// What to do next.
    pub fn next(&self) -> EventsStep {
        if self.done {
            return EventsStep::End;
        }
        match self.connected_after {
            Some(live) if self.cursor < live && !self.caught_up => {
                EventsStep::ReadPage { after: self.cursor }
            }
            Some(_) => EventsStep::Follow,
            None if !self.caught_up => EventsStep::ReadPage { after: self.cursor },
            None if self.sealed => EventsStep::End,
            None => EventsStep::Connect { after: self.cursor },
        }
    }

    /// Connected to the actor at `after`.
    pub fn connected(&mut self, after: u64) {
        self.connected_after = Some(after);
    }

    /// A page of stored frames read after the cursor, written into `out`;
    /// an empty page means the log has nothing more.
    pub fn page(&mut self, frames: &[Frame], out: &mut Vec<u8>) {
        if frames.is_empty() {
            self.caught_up = true;
        }
        for frame in frames {
            self.frame(frame, None, out);
            if self.done {
                return;
            }
        }
    }

    /// A stored frame (from a page or the actor), with its JSON if it is
    /// already encoded. One already sent is skipped: the actor replays
    /// exactly what follows its connection's seq, which a page may have
    /// covered meanwhile.
    pub fn frame(&mut self, frame: &Frame, json: Option<&[u8]>, out: &mut Vec<u8>) {
        if self.done || frame.seq <= self.cursor {
            return;
        }
        self.cursor = frame.seq;
        match json {
            Some(json) => frame_event_into(frame.seq, json, out),
            None => {
                let json = serde_json::to_vec(frame).unwrap_or_default();
                frame_event_into(frame.seq, &json, out);
            }
        }
        if ends_stream(frame) {
            self.done = true;
        }
    }

    /// A message the actor sent: a stored frame, a live part or an error.
    /// Acks and the runner's and tool host's messages never reach a reader.
    pub fn message(&mut self, message: &ServerMessage, out: &mut Vec<u8>) {
        if self.done {
            return;
        }
        let event = match message {
            ServerMessage::Frame { frame } => return self.frame(frame, None, out),
            ServerMessage::Live { turn_id, part } => SseEvent::live(turn_id, part),
            ServerMessage::Error { code, message } => SseEvent::error(*code, message),
            ServerMessage::Ack { .. }
            | ServerMessage::Received {}
            | ServerMessage::HostCall { .. }
            | ServerMessage::HostCancel { .. }
            | ServerMessage::HostTools { .. } => return,
        };
        out.extend_from_slice(event.encode().as_bytes());
    }

    /// The actor dropped the connection (it stopped, or the reader fell too
    /// far behind): the stream ends, and the client resumes from its
    /// `Last-Event-ID`.
    pub fn dropped(&mut self) {
        self.done = true;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_carry_their_seq_and_live_parts_none() {
        let frame = Frame {
            seq: 4,
            at_ms: 9,
            body: FrameBody::Sealed {},
        };
        let e = SseEvent::frame(&frame);
        assert!(e.encode().starts_with("id: 4\nevent: frame\ndata: {"));
        assert!(e.encode().ends_with("}\n\n"));
        assert!(ends_stream(&frame));
        let l = SseEvent::live(
            "t1",
            &StreamPart::TextDelta {
                id: "b".into(),
                delta: "x".into(),
            },
        );
        assert!(l.encode().starts_with("event: live\ndata: "));
    }

    fn frame(seq: u64, body: FrameBody) -> Frame {
        Frame {
            seq,
            at_ms: 0,
            body,
        }
    }

    fn text(seq: u64) -> Frame {
        frame(
            seq,
            FrameBody::UserMessage {
                text: format!("m{seq}"),
                turn_id: None,
            },
        )
    }

    #[test]
    fn the_in_place_event_is_the_encoded_one() {
        let f = text(12);
        let mut out = Vec::new();
        frame_event_into(12, &serde_json::to_vec(&f).unwrap(), &mut out);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            SseEvent::frame(&f).encode()
        );
    }

    #[test]
    fn a_reader_pages_the_log_then_connects_where_it_stopped() {
        let mut r = EventsReader::new(1, false);
        let mut out = Vec::new();
        assert_eq!(r.next(), EventsStep::ReadPage { after: 1 });
        r.page(&[text(2), text(3)], &mut out);
        assert_eq!(r.next(), EventsStep::ReadPage { after: 3 });
        r.page(&[], &mut out);
        assert_eq!(r.next(), EventsStep::Connect { after: 3 });
        r.connected(3);
        assert_eq!(r.next(), EventsStep::Follow);
        // The actor's replay of a frame already sent is skipped.
        r.frame(&text(3), None, &mut out);
        r.message(&ServerMessage::Frame { frame: text(4) }, &mut out);
        let text_out = String::from_utf8(out.clone()).unwrap();
        let ids: Vec<&str> = text_out.lines().filter(|l| l.starts_with("id: ")).collect();
        assert_eq!(ids, ["id: 2", "id: 3", "id: 4"]);
        r.frame(&frame(5, FrameBody::Sealed {}), None, &mut out);
        assert!(r.is_done());
        assert_eq!(r.next(), EventsStep::End);
    }

    #[test]
    fn a_reader_connected_first_reads_the_log_up_to_its_connection() {
        let mut r = EventsReader::new(0, false);
        r.connected(2);
        let mut out = Vec::new();
        assert_eq!(r.next(), EventsStep::ReadPage { after: 0 });
        r.page(&[text(1), text(2)], &mut out);
        assert_eq!(r.next(), EventsStep::Follow);
        r.dropped();
        assert_eq!(r.next(), EventsStep::End);
    }

    #[test]
    fn a_sealed_session_ends_once_its_log_is_read() {
        let mut r = EventsReader::new(7, true);
        let mut out = Vec::new();
        r.page(&[], &mut out);
        assert_eq!(r.next(), EventsStep::End);
        assert!(out.is_empty());
    }
}
