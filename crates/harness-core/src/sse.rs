//! The one reader of `text/event-stream` (server-sent events) in the
//! workspace, sans-IO: the Cloudflare provider reads the bridge's exec
//! stream with it (natively and on wasm32), the CLI a server's
//! `/events`, the test kit both servers' `/events`.
//!
//! Feed bytes as they arrive with [`SseReader::push`]; whole events come
//! out in order. The fields are read as the WHATWG HTML standard reads
//! them ("Interpreting an event stream"): lines end with CRLF, LF or CR; a
//! leading byte-order mark is dropped; a line starting with `:` is a
//! comment (a keep-alive) and skipped; `field: value` loses one space
//! after the colon; `event`, `data` and `id` are kept, `retry` and
//! unknown fields ignored; a blank line ends an event, which is
//! dispatched only if it had a `data` line. [`read_events`] does the
//! same over a stream of chunks (an HTTP body).
//!
//! Memory is bounded whatever the peer sends: a line, or an event's data,
//! longer than the reader's limit ([`DEFAULT_MAX_EVENT_BYTES`] unless
//! [`SseReader::with_limit`] says otherwise) is an error instead of a
//! buffer that grows with the stream; and each byte is searched for a line
//! end once, however the line is cut into chunks.
//!
//! Not the well-kept `eventsource-stream` crate: it has no such bound (a
//! line that never ends grows its buffer for ever, as does one invalid
//! UTF-8 byte, silently) and re-parses the buffered line on every chunk,
//! so a 64 MiB line in 16 KiB chunks took it 270 s of CPU.

use std::collections::VecDeque;

use futures::{Stream, StreamExt};

/// The longest line, and the most data in one event, a reader holds unless
/// told otherwise (16 MiB): far above what any of our servers sends in one
/// event (the bridge base64-encodes small output chunks; a session frame
/// is at most 1 MiB by default).
pub const DEFAULT_MAX_EVENT_BYTES: usize = 16 * 1024 * 1024;

/// One dispatched event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SseEvent {
    /// `id:` of this event, if it had one (not carried over from earlier
    /// events: our readers check each event's own id).
    pub id: Option<String>,
    /// `event:` (`message` when absent or empty, as the standard says).
    pub event: String,
    /// The `data:` lines joined with `\n`.
    pub data: String,
}

/// Why a stream cannot be read on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SseError {
    /// A line, or one event's data, passed the reader's limit.
    #[error("the event stream has a line or an event longer than {limit} bytes")]
    TooLong {
        /// The reader's limit.
        limit: usize,
    },
    /// A line is not UTF-8.
    #[error("the event stream has a line that is not UTF-8")]
    NotUtf8,
}

/// Accumulates bytes and yields whole events. After an error every later
/// [`push`](Self::push) returns the same error: the stream is not to be
/// read on.
#[derive(Debug)]
pub struct SseReader {
    /// Bytes of the line not ended yet (nothing else stays between pushes).
    partial: Vec<u8>,
    /// The last push ended on a CR: an LF first in the next one is the
    /// rest of that line end.
    after_cr: bool,
    /// Past the start of the stream, where a byte-order mark may stand.
    started: bool,
    event: Option<String>,
    data: Option<String>,
    id: Option<String>,
    limit: usize,
    failed: Option<SseError>,
}

impl Default for SseReader {
    fn default() -> Self {
        Self::with_limit(DEFAULT_MAX_EVENT_BYTES)
    }
}

const BOM: &[u8] = "\u{feff}".as_bytes();

impl SseReader {
    /// A reader with nothing buffered and the default limit.
    pub fn new() -> Self {
        Self::default()
    }

    /// A reader refusing lines, and events' data, longer than `limit`
    /// bytes.
    pub fn with_limit(limit: usize) -> Self {
        Self {
            partial: Vec::new(),
            after_cr: false,
            started: false,
            event: None,
            data: None,
            id: None,
            limit,
            failed: None,
        }
    }

    /// Add the next bytes of the stream; returns the events they
    /// completed, in order.
    pub fn push(&mut self, bytes: &[u8]) -> Result<Vec<SseEvent>, SseError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let result = self.read(bytes);
        if let Err(e) = &result {
            self.failed = Some(e.clone());
        }
        result
    }

    /// True when part of an event is buffered: bytes of a line not ended,
    /// or fields not yet ended by a blank line. At the end of a stream
    /// this is an event cut off (the standard drops it).
    pub fn has_partial(&self) -> bool {
        !self.partial.is_empty() || self.event.is_some() || self.data.is_some() || self.id.is_some()
    }

    fn read(&mut self, bytes: &[u8]) -> Result<Vec<SseEvent>, SseError> {
        let mut buffer = std::mem::take(&mut self.partial);
        // Only the unfinished line was kept, and it holds no line end.
        let mut search = buffer.len();
        buffer.extend_from_slice(bytes);
        let mut start = 0;
        if !self.started {
            if buffer.len() < BOM.len() && BOM.starts_with(&buffer) {
                self.partial = buffer;
                return Ok(Vec::new());
            }
            self.started = true;
            if buffer.starts_with(BOM) {
                start = BOM.len();
                search = search.max(start);
            }
        }
        if self.after_cr && start < buffer.len() {
            self.after_cr = false;
            if buffer[start] == b'\n' {
                start += 1;
                search = search.max(start);
            }
        }
        let mut events = Vec::new();
        while let Some(at) = buffer[search..]
            .iter()
            .position(|&b| b == b'\n' || b == b'\r')
        {
            let end = search + at;
            if let Some(event) = self.line(&buffer[start..end])? {
                events.push(event);
            }
            start = end + 1;
            if buffer[end] == b'\r' {
                match buffer.get(start) {
                    Some(b'\n') => start += 1,
                    Some(_) => {}
                    None => self.after_cr = true,
                }
            }
            search = start;
        }
        if buffer.len() - start > self.limit {
            return Err(SseError::TooLong { limit: self.limit });
        }
        buffer.drain(..start);
        self.partial = buffer;
        Ok(events)
    }

    /// One whole line (without its end); an event when it is the blank line
    /// ending one with data.
    fn line(&mut self, line: &[u8]) -> Result<Option<SseEvent>, SseError> {
        if line.len() > self.limit {
            return Err(SseError::TooLong { limit: self.limit });
        }
        if line.is_empty() {
            let event = self.event.take().filter(|e| !e.is_empty());
            let id = self.id.take();
            return Ok(self.data.take().map(|data| SseEvent {
                id,
                event: event.unwrap_or_else(|| "message".into()),
                data,
            }));
        }
        if line[0] == b':' {
            return Ok(None);
        }
        let line = std::str::from_utf8(line).map_err(|_| SseError::NotUtf8)?;
        let (field, value) = match line.split_once(':') {
            Some((field, value)) => (field, value.strip_prefix(' ').unwrap_or(value)),
            None => (line, ""),
        };
        match field {
            "event" => self.event = Some(value.to_string()),
            "data" => match &mut self.data {
                Some(data) => {
                    if data.len() + 1 + value.len() > self.limit {
                        return Err(SseError::TooLong { limit: self.limit });
                    }
                    data.push('\n');
                    data.push_str(value);
                }
                None => self.data = Some(value.to_string()),
            },
            "id" if !value.contains('\0') => self.id = Some(value.to_string()),
            _ => {}
        }
        Ok(None)
    }
}

/// Why [`read_events`] stopped.
#[derive(Debug, thiserror::Error)]
pub enum ReadError<E> {
    /// The body failed.
    #[error("the event stream failed: {0}")]
    Body(E),
    /// The body is not an event stream we read on.
    #[error(transparent)]
    Sse(#[from] SseError),
}

/// The events of `body` (e.g. an HTTP response's chunks) as `reader`
/// reads them, in order. The first error, the body's or the reader's, is
/// the last item; an event the body's end cuts off is dropped, as the
/// standard says.
pub fn read_events<S, B, E>(
    body: S,
    reader: SseReader,
) -> impl Stream<Item = Result<SseEvent, ReadError<E>>>
where
    S: Stream<Item = Result<B, E>> + Unpin,
    B: AsRef<[u8]>,
{
    struct Reading<S> {
        body: S,
        reader: SseReader,
        ready: VecDeque<SseEvent>,
        done: bool,
    }
    let reading = Reading {
        body,
        reader,
        ready: VecDeque::new(),
        done: false,
    };
    futures::stream::unfold(reading, |mut r| async move {
        loop {
            if let Some(event) = r.ready.pop_front() {
                return Some((Ok(event), r));
            }
            if r.done {
                return None;
            }
            let failed = match r.body.next().await? {
                Ok(chunk) => match r.reader.push(chunk.as_ref()) {
                    Ok(events) => {
                        r.ready.extend(events);
                        continue;
                    }
                    Err(e) => ReadError::Sse(e),
                },
                Err(e) => ReadError::Body(e),
            };
            r.done = true;
            return Some((Err(failed), r));
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(event: &str, data: &str) -> SseEvent {
        SseEvent {
            id: None,
            event: event.into(),
            data: data.into(),
        }
    }

    /// Every event `stream` holds, read in chunks of `size` bytes.
    fn read_in_chunks(stream: &[u8], size: usize) -> Vec<SseEvent> {
        let mut reader = SseReader::new();
        let mut events = Vec::new();
        for chunk in stream.chunks(size) {
            events.extend(reader.push(chunk).unwrap());
        }
        assert!(!reader.has_partial(), "{stream:?} ends between events");
        events
    }

    #[test]
    fn events_split_across_pushes_come_out_whole() {
        let mut r = SseReader::new();
        assert!(r.push(b"event: stdout\nda").unwrap().is_empty());
        assert!(r.has_partial());
        let ev = r
            .push(b"ta: aGk=\n\nevent: exit\ndata: {\"exit_code\":0}\n\n")
            .unwrap();
        assert_eq!(
            ev,
            vec![event("stdout", "aGk="), event("exit", "{\"exit_code\":0}")]
        );
        assert!(!r.has_partial());
    }

    #[test]
    fn every_cut_of_a_stream_reads_the_same() {
        let stream = "\u{feff}: ping\r\nid: 7\r\nevent: frame\r\ndata: {\"a\":\"é\"}\r\n\r\n\
                      data: one\rdata:two\r\r:\n\nevent: live\ndata:  spaced\ndata\n\n"
            .as_bytes();
        let whole = read_in_chunks(stream, stream.len());
        assert_eq!(
            whole,
            vec![
                SseEvent {
                    id: Some("7".into()),
                    event: "frame".into(),
                    data: "{\"a\":\"é\"}".into(),
                },
                event("message", "one\ntwo"),
                event("live", " spaced\n"),
            ]
        );
        for size in 1..stream.len() {
            assert_eq!(read_in_chunks(stream, size), whole, "chunks of {size}");
        }
    }

    #[test]
    fn multi_line_data_and_crlf_and_comments() {
        let mut r = SseReader::new();
        let ev = r
            .push(b": ping\r\nevent: error\r\ndata: a\r\ndata: b\r\n\r\n")
            .unwrap();
        assert_eq!(ev, vec![event("error", "a\nb")]);
    }

    #[test]
    fn keep_alives_and_blocks_without_data_dispatch_nothing() {
        let mut r = SseReader::new();
        assert!(r
            .push(b":\n\n:\n\nevent: exit\n\nid: 3\n\n")
            .unwrap()
            .is_empty());
        // Neither the name nor the id of a block without data leaks into
        // the next event.
        let ev = r.push(b"data: x\n\n").unwrap();
        assert_eq!(ev, vec![event("message", "x")]);
    }

    #[test]
    fn ids_are_each_events_own() {
        let ev = read_in_chunks(
            b"id: 1\ndata: a\n\ndata: b\n\nid\ndata: c\n\nid: x\0y\ndata: d\n\n",
            3,
        );
        let ids: Vec<_> = ev.iter().map(|e| e.id.as_deref()).collect();
        // `id` with no value is an empty id; one holding NUL is ignored.
        assert_eq!(ids, vec![Some("1"), None, Some(""), None]);
    }

    #[test]
    fn a_huge_line_is_refused_and_the_reader_stays_failed() {
        let mut r = SseReader::with_limit(1024);
        let chunk = [b'a'; 100];
        let mut pushed = 0;
        let err = loop {
            match r.push(&chunk) {
                Ok(ev) => assert!(ev.is_empty()),
                Err(e) => break e,
            }
            pushed += chunk.len();
            assert!(pushed <= 1024, "accepted {pushed} bytes of one line");
        };
        assert_eq!(err, SseError::TooLong { limit: 1024 });
        assert_eq!(r.push(b"\n\ndata: x\n\n"), Err(err));
    }

    #[test]
    fn an_event_of_many_short_lines_is_refused_past_the_limit() {
        let mut r = SseReader::with_limit(1024);
        let line = format!("data: {}\n", "b".repeat(99));
        let mut result = Ok(Vec::new());
        for _ in 0..11 {
            result = r.push(line.as_bytes());
            if result.is_err() {
                break;
            }
        }
        assert_eq!(result, Err(SseError::TooLong { limit: 1024 }));
        // Within the limit, the same lines make an event.
        let mut r = SseReader::with_limit(1024);
        let ten = line.repeat(10) + "\n";
        assert_eq!(r.push(ten.as_bytes()).unwrap()[0].data.len(), 10 * 99 + 9);
    }

    #[test]
    fn a_line_that_is_not_utf8_is_refused() {
        let mut r = SseReader::new();
        assert_eq!(r.push(b"data: \xff\n\n"), Err(SseError::NotUtf8));
    }

    #[test]
    fn read_events_reads_a_body_and_stops_at_its_first_error() {
        use futures::executor::block_on;
        use futures::stream;
        let body = stream::iter([
            Ok::<_, String>(&b"event: a\ndata: 1\n\nda"[..]),
            Ok(&b"ta: 2\n\n"[..]),
            Err("reset".to_string()),
            Ok(&b"data: never\n\n"[..]),
        ]);
        let got: Vec<_> = block_on(read_events(body, SseReader::new()).collect());
        assert_eq!(got.len(), 3, "{got:?}");
        assert_eq!(got[0].as_ref().unwrap(), &event("a", "1"));
        assert_eq!(got[1].as_ref().unwrap(), &event("message", "2"));
        assert!(matches!(&got[2], Err(ReadError::Body(e)) if e == "reset"));

        let body = stream::iter([Ok::<_, String>(vec![b'x'; 2048]), Ok(b"\n\n".to_vec())]);
        let got: Vec<_> = block_on(read_events(body, SseReader::with_limit(1024)).collect());
        assert!(
            matches!(&got[..], [Err(ReadError::Sse(SseError::TooLong { .. }))]),
            "{got:?}"
        );
    }
}
