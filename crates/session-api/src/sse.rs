//! The events of `GET /v1/sessions/{id}/events`: a stored frame is `id:
//! <seq>`, `event: frame`, `data: <Frame JSON>`; a live part is `event:
//! live`, `data: {"turnId","part"}` with no id (so `Last-Event-ID` always
//! names a stored frame); a refusal is `event: error`, `data: {"code",
//! "message"}`. The stream ends after the `sealed` frame.

use harness_core::actor::ErrorCode;
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
}
