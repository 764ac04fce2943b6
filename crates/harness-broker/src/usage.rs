//! What a session used: requests, bytes and tokens, read from the streams as
//! they pass.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// One session's use of the model through the broker.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Usage {
    /// Requests forwarded upstream.
    pub requests: u64,
    /// Requests refused (bad token, revoked session, no upstream).
    pub refused: u64,
    /// Request body bytes sent upstream.
    pub request_bytes: u64,
    /// Response body bytes passed back to the agent.
    pub response_bytes: u64,
    /// Input tokens the provider reported.
    pub input_tokens: u64,
    /// Output tokens the provider reported.
    pub output_tokens: u64,
}

impl Usage {
    /// Add one exchange's figures.
    pub fn add(&mut self, other: &Usage) {
        self.requests += other.requests;
        self.refused += other.refused;
        self.request_bytes += other.request_bytes;
        self.response_bytes += other.response_bytes;
        self.input_tokens += other.input_tokens;
        self.output_tokens += other.output_tokens;
    }
}

/// Longest line the scanner keeps while looking for a usage report; longer
/// lines (big deltas) are skipped, never buffered whole.
const MAX_LINE: usize = 256 * 1024;

/// Reads token counts out of a response body as its chunks pass, without
/// holding the body: Server-Sent Events line by line (Anthropic's
/// `message_start` / `message_delta`, OpenAI's `response.completed`), or a
/// plain JSON body's top-level `usage`.
#[derive(Debug, Default)]
pub struct UsageScanner {
    line: Vec<u8>,
    skipping: bool,
    input: u64,
    output: u64,
}

impl UsageScanner {
    /// Feed the next chunk of the body.
    pub fn feed(&mut self, chunk: &[u8]) {
        let mut rest = chunk;
        loop {
            let (segment, ended) = match rest.iter().position(|&b| b == b'\n') {
                Some(nl) => (&rest[..nl], true),
                None => (rest, false),
            };
            if !self.skipping {
                if self.line.len() + segment.len() > MAX_LINE {
                    self.skipping = true;
                    self.line.clear();
                } else {
                    self.line.extend_from_slice(segment);
                }
            }
            if !ended {
                return;
            }
            if !self.skipping {
                let line = std::mem::take(&mut self.line);
                self.line_done(&line);
            }
            self.line.clear();
            self.skipping = false;
            rest = &rest[segment.len() + 1..];
        }
    }

    /// The body ended: take a last unterminated line (a JSON body) and
    /// return `(input_tokens, output_tokens)`.
    pub fn finish(mut self) -> (u64, u64) {
        if !self.skipping && !self.line.is_empty() {
            let line = std::mem::take(&mut self.line);
            self.line_done(&line);
        }
        (self.input, self.output)
    }

    fn line_done(&mut self, line: &[u8]) {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let json = match line.strip_prefix(b"data:") {
            Some(rest) => rest,
            None if line.first() == Some(&b'{') => line,
            None => return,
        };
        // Cheap filter: most events carry no usage.
        if !json.windows(7).any(|w| w == b"\"usage\"") {
            return;
        }
        let Ok(value) = serde_json::from_slice::<Value>(json.trim_ascii()) else {
            return;
        };
        self.take(&value);
    }

    fn take(&mut self, v: &Value) {
        let num = |u: &Value, k: &str| u.get(k).and_then(Value::as_u64);
        match v.get("type").and_then(Value::as_str) {
            // Anthropic: input counted at the start, output cumulative in
            // each delta.
            Some("message_start") => {
                if let Some(u) = v.pointer("/message/usage") {
                    self.input = anthropic_input(u);
                    self.output = num(u, "output_tokens").unwrap_or(self.output);
                }
            }
            Some("message_delta") => {
                if let Some(u) = v.get("usage") {
                    if let Some(o) = num(u, "output_tokens") {
                        self.output = o;
                    }
                    if num(u, "input_tokens").is_some() {
                        self.input = anthropic_input(u);
                    }
                }
            }
            // OpenAI Responses: the whole figure once, at the end.
            Some("response.completed") | Some("response.incomplete") | Some("response.failed") => {
                if let Some(u) = v.pointer("/response/usage") {
                    self.input = num(u, "input_tokens").unwrap_or(0);
                    self.output = num(u, "output_tokens").unwrap_or(0);
                }
            }
            // A non-streaming body (either API) reports `usage` at the top.
            _ => {
                if let Some(u) = v.get("usage") {
                    self.input = anthropic_input(u);
                    self.output = num(u, "output_tokens").unwrap_or(0);
                }
            }
        }
    }
}

/// Anthropic splits input into fresh, cache-read and cache-written tokens;
/// all three were sent.
fn anthropic_input(u: &Value) -> u64 {
    [
        "input_tokens",
        "cache_read_input_tokens",
        "cache_creation_input_tokens",
    ]
    .iter()
    .filter_map(|k| u.get(*k).and_then(Value::as_u64))
    .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scan(chunks: &[&str]) -> (u64, u64) {
        let mut s = UsageScanner::default();
        for c in chunks {
            s.feed(c.as_bytes());
        }
        s.finish()
    }

    #[test]
    fn anthropic_stream_split_anywhere() {
        let body = "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":12,\"cache_read_input_tokens\":3,\"output_tokens\":1}}}\n\n\
                    event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"delta\":{\"text\":\"hi\"}}\n\n\
                    event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":40}}\n\n";
        for cut in [1, 7, 50, 133, body.len() - 1] {
            let (a, b) = body.split_at(cut);
            assert_eq!(scan(&[a, b]), (15, 40), "cut at {cut}");
        }
    }

    #[test]
    fn openai_stream_and_plain_json() {
        let body = "event: response.created\ndata: {\"type\":\"response.created\",\"response\":{}}\n\n\
                    event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"usage\":{\"input_tokens\":7,\"output_tokens\":9}}}\n\n";
        assert_eq!(scan(&[body]), (7, 9));
        assert_eq!(
            scan(&[
                "{\"id\":\"x\",\"usage\":{\"input_tokens\":5,",
                "\"output_tokens\":6}}"
            ]),
            (5, 6)
        );
    }

    #[test]
    fn huge_lines_are_skipped_not_held() {
        let big = format!("data: {{\"x\":\"{}\"}}\n", "a".repeat(MAX_LINE * 2));
        let mut s = UsageScanner::default();
        s.feed(big.as_bytes());
        assert!(s.line.len() < MAX_LINE);
        s.feed(b"data: {\"type\":\"response.completed\",\"response\":{\"usage\":{\"input_tokens\":1,\"output_tokens\":2}}}\n");
        assert_eq!(s.finish(), (1, 2));
    }
}
