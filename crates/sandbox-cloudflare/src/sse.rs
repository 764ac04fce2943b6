//! A sans-IO reader of the bridge's exec stream (`text/event-stream`).
//!
//! The bridge writes `event: <name>` and one `data:` line per line of the
//! payload, then a blank line. Feed bytes as they arrive with
//! [`SseReader::push`]; complete events come out in order.

use bytes::BytesMut;

/// One server-sent event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SseEvent {
    /// The `event:` name (`message` when absent, as the SSE spec says).
    pub event: String,
    /// The `data:` lines joined with `\n`.
    pub data: String,
}

/// Accumulates bytes and yields whole events.
#[derive(Debug, Default)]
pub struct SseReader {
    buffer: BytesMut,
    event: Option<String>,
    data: Vec<String>,
}

/// Longest line the reader holds before refusing the stream: the bridge
/// base64-encodes each output chunk into one line, and chunks are small.
pub const MAX_LINE: usize = 16 * 1024 * 1024;

impl SseReader {
    /// A reader with nothing buffered.
    pub fn new() -> Self {
        Self::default()
    }

    /// Add bytes; returns the events they completed. Errs on a line longer
    /// than [`MAX_LINE`] or one that is not UTF-8.
    pub fn push(&mut self, bytes: &[u8]) -> Result<Vec<SseEvent>, String> {
        self.buffer.extend_from_slice(bytes);
        let mut events = Vec::new();
        while let Some(end) = self.buffer.iter().position(|&b| b == b'\n') {
            let line = self.buffer.split_to(end + 1);
            let line = &line[..end];
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            let line = std::str::from_utf8(line)
                .map_err(|_| "the exec stream has a line that is not UTF-8".to_string())?;
            if line.is_empty() {
                if self.event.is_some() || !self.data.is_empty() {
                    events.push(SseEvent {
                        event: self.event.take().unwrap_or_else(|| "message".into()),
                        data: std::mem::take(&mut self.data).join("\n"),
                    });
                }
                continue;
            }
            if line.starts_with(':') {
                continue; // a comment (keep-alive)
            }
            let (field, value) = match line.split_once(':') {
                Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
                None => (line, ""),
            };
            match field {
                "event" => self.event = Some(value.to_string()),
                "data" => self.data.push(value.to_string()),
                _ => {} // id, retry: unused by the bridge
            }
        }
        if self.buffer.len() > MAX_LINE {
            return Err(format!(
                "the exec stream has a line longer than {MAX_LINE} bytes"
            ));
        }
        Ok(events)
    }

    /// True when bytes of an unfinished event are buffered.
    pub fn has_partial(&self) -> bool {
        !self.buffer.is_empty() || self.event.is_some() || !self.data.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_split_across_pushes_come_out_whole() {
        let mut r = SseReader::new();
        assert!(r.push(b"event: stdout\nda").unwrap().is_empty());
        let ev = r
            .push(b"ta: aGk=\n\nevent: exit\ndata: {\"exit_code\":0}\n\n")
            .unwrap();
        assert_eq!(
            ev,
            vec![
                SseEvent {
                    event: "stdout".into(),
                    data: "aGk=".into()
                },
                SseEvent {
                    event: "exit".into(),
                    data: "{\"exit_code\":0}".into()
                },
            ]
        );
        assert!(!r.has_partial());
    }

    #[test]
    fn multi_line_data_and_crlf_and_comments() {
        let mut r = SseReader::new();
        let ev = r
            .push(b": ping\r\nevent: error\r\ndata: a\r\ndata: b\r\n\r\n")
            .unwrap();
        assert_eq!(
            ev,
            vec![SseEvent {
                event: "error".into(),
                data: "a\nb".into()
            }]
        );
    }

    #[test]
    fn a_huge_line_is_refused() {
        let mut r = SseReader::new();
        let big = vec![b'a'; MAX_LINE + 1];
        assert!(r.push(&big).is_err());
    }
}
