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
    /// What those tokens cost by the broker's price table, in millionths
    /// of a US dollar.
    #[serde(default)]
    pub spend_micros: u64,
    /// Requests to a model the price table has no price for (their tokens
    /// are not in `spend_micros`).
    #[serde(default)]
    pub unpriced_requests: u64,
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
        self.spend_micros += other.spend_micros;
        self.unpriced_requests += other.unpriced_requests;
    }

    /// What a budget is checked against: the spend only when every
    /// request was priced.
    pub fn model_usage(&self) -> harness_core::turn::ModelUsage {
        harness_core::turn::ModelUsage {
            input_tokens: self.input_tokens,
            output_tokens: self.output_tokens,
            spend_micros: (self.unpriced_requests == 0).then_some(self.spend_micros),
        }
    }
}

/// One model's price, in US dollars per million tokens
/// (`{"input": 3, "output": 15}`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Price {
    /// Per million input tokens.
    #[serde(rename = "input")]
    pub input_per_mtok: f64,
    /// Per million output tokens.
    #[serde(rename = "output")]
    pub output_per_mtok: f64,
}

/// The broker's price table (`<broker dir>/prices.json` natively, the
/// Worker's `HARNESS_MODEL_PRICES`): model name →
/// [`Price`]; a name ending in `*` prices every model it is a prefix of
/// (the longest such prefix wins over shorter ones, an exact name over
/// all).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct PriceTable(pub std::collections::BTreeMap<String, Price>);

impl PriceTable {
    /// The table in a `prices.json` document (`origin` names it in the
    /// error): a typo is an error, so it never silently prices everything
    /// at nothing.
    pub fn parse(bytes: &[u8], origin: &str) -> harness_core::Result<Self> {
        serde_json::from_slice(bytes)
            .map_err(|e| harness_core::Error::invalid(format!("{origin}: {e}")))
    }

    /// The price of `model`.
    pub fn price(&self, model: &str) -> Option<Price> {
        if let Some(p) = self.0.get(model) {
            return Some(*p);
        }
        self.0
            .iter()
            .filter_map(|(k, p)| Some((k.strip_suffix('*')?, p)))
            .filter(|(prefix, _)| model.starts_with(prefix))
            .max_by_key(|(prefix, _)| prefix.len())
            .map(|(_, p)| *p)
    }

    /// What `input` and `output` tokens of `model` cost, in micro-dollars.
    pub fn spend_micros(&self, model: &str, input: u64, output: u64) -> Option<u64> {
        let p = self.price(model)?;
        Some((input as f64 * p.input_per_mtok + output as f64 * p.output_per_mtok).round() as u64)
    }
}

/// Whether a request for `model` may pass for a session held to `budget`
/// that used `used` so far — the rule of every broker, the native one and
/// the Worker's: `Err(why)` once a limit is spent (the request that
/// crosses it has passed: its size is known only once answered), or when
/// a spend budget meets a model `prices` has no price for (refused, never
/// counted as free; `prices_origin` names the table in the reason).
pub fn admit(
    budget: &harness_core::turn::Budget,
    used: &harness_core::turn::ModelUsage,
    prices: &PriceTable,
    model: Option<&str>,
    prices_origin: &str,
) -> Result<(), String> {
    if budget.is_unlimited() {
        return Ok(());
    }
    if let Some(why) = budget.exceeded_by(used) {
        return Err(why);
    }
    if budget.max_spend_micros.is_some() && prices.price(model.unwrap_or("")).is_none() {
        return Err(format!(
            "the session has a spend budget, and model {:?} has no price in {prices_origin}",
            model.unwrap_or("(none named)"),
        ));
    }
    Ok(())
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
    /// return `(input_tokens, output_tokens)`. (A line being skipped is
    /// held empty.)
    pub fn finish(mut self) -> (u64, u64) {
        if !self.line.is_empty() {
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

    #[test]
    fn admission_follows_the_budget_and_the_price_table() {
        use harness_core::turn::{Budget, ModelUsage};
        let used = |input, output, spend| ModelUsage {
            input_tokens: input,
            output_tokens: output,
            spend_micros: spend,
        };
        let prices = PriceTable::parse(br#"{"claude-*": {"input": 3, "output": 15}}"#, "t")
            .expect("a table");
        let none = Budget::default();
        assert_eq!(admit(&none, &used(9, 9, None), &prices, None, "t"), Ok(()));
        let tokens = Budget {
            max_tokens: Some(10),
            max_spend_micros: None,
        };
        assert_eq!(
            admit(&tokens, &used(4, 5, None), &prices, None, "t"),
            Ok(())
        );
        let spent = admit(&tokens, &used(4, 6, None), &prices, None, "t").unwrap_err();
        assert!(spent.contains("10 tokens used of 10"), "{spent}");
        let spend = Budget {
            max_tokens: None,
            max_spend_micros: Some(1_000),
        };
        assert_eq!(
            admit(
                &spend,
                &used(1, 1, Some(999)),
                &prices,
                Some("claude-x"),
                "t"
            ),
            Ok(())
        );
        assert!(admit(
            &spend,
            &used(1, 1, Some(1_000)),
            &prices,
            Some("claude-x"),
            "t"
        )
        .is_err());
        let unpriced = admit(
            &spend,
            &used(0, 0, Some(0)),
            &prices,
            Some("gpt-5"),
            "the table",
        )
        .unwrap_err();
        assert!(
            unpriced.contains("\"gpt-5\" has no price in the table"),
            "{unpriced}"
        );
    }

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

    /// A `message_delta` data line of exactly `len` bytes (no newline)
    /// reporting `output` tokens.
    fn delta_line(len: usize, output: u64) -> String {
        let head = "data: {\"type\":\"message_delta\",\"pad\":\"";
        let tail = format!("\",\"usage\":{{\"output_tokens\":{output}}}}}");
        format!("{head}{}{tail}", "a".repeat(len - head.len() - tail.len()))
    }

    #[test]
    fn a_line_at_the_limit_is_read_and_one_past_it_is_skipped() {
        // A report beside a long delta (100 KB) is well under the limit.
        assert_eq!(scan(&[&delta_line(100_000, 3), "\n"]), (0, 3));
        let at = delta_line(MAX_LINE, 7);
        assert_eq!(at.len(), MAX_LINE);
        assert_eq!(scan(&[&at, "\n"]), (0, 7));
        // Split anywhere, the parts add up to the same line.
        let (a, b) = at.split_at(MAX_LINE / 2);
        assert_eq!(scan(&[a, b, "\n"]), (0, 7));
        // One byte more: skipped, so the earlier report stands.
        let past = delta_line(MAX_LINE + 1, 9);
        assert_eq!(scan(&[&at, "\n", &past, "\n"]), (0, 7));
        let (a, b) = past.split_at(MAX_LINE / 2);
        assert_eq!(scan(&[&at, "\n", a, b, "\n"]), (0, 7));
    }

    #[test]
    fn only_data_lines_and_a_json_body_are_read() {
        let report = "{\"type\":\"message_delta\",\"usage\":{\"output_tokens\":5}}";
        assert_eq!(scan(&[&format!("data: {report}\n")]), (0, 5));
        assert_eq!(scan(&[report]), (0, 5));
        // Another SSE field, a comment, an indented line: not reports.
        for line in [
            format!("event: {report}\n"),
            format!(": {report}\n"),
            format!("  {report}\n"),
        ] {
            assert_eq!(scan(&[&line]), (0, 0), "{line}");
        }
    }

    #[test]
    fn usage_adds_every_figure() {
        let figures = |n: u64| Usage {
            requests: n,
            refused: 2 * n,
            request_bytes: 3 * n,
            response_bytes: 4 * n,
            input_tokens: 5 * n,
            output_tokens: 6 * n,
            spend_micros: 7 * n,
            unpriced_requests: 8 * n,
        };
        let mut total = figures(1);
        total.add(&figures(10));
        assert_eq!(total, figures(11));
        total.add(&figures(0));
        assert_eq!(total, figures(11));
    }

    #[test]
    fn huge_lines_are_skipped_not_held() {
        let big = format!("data: {{\"x\":\"{}\"}}\n", "a".repeat(MAX_LINE * 2));
        let mut s = UsageScanner::default();
        s.feed(big.as_bytes());
        assert!(s.line.len() < MAX_LINE);
        // Fed in pieces, it is never held either.
        let mut pieces = UsageScanner::default();
        for piece in big.as_bytes().chunks(4096) {
            pieces.feed(piece);
            assert!(
                pieces.line.len() <= MAX_LINE,
                "{} bytes held",
                pieces.line.len()
            );
        }
        s.feed(b"data: {\"type\":\"response.completed\",\"response\":{\"usage\":{\"input_tokens\":1,\"output_tokens\":2}}}\n");
        assert_eq!(s.finish(), (1, 2));
    }
}

#[cfg(test)]
mod price_tests {
    use super::*;

    #[test]
    fn prices_match_exactly_then_by_the_longest_prefix() {
        let table: PriceTable = serde_json::from_str(
            r#"{"claude-*": {"input": 3, "output": 15},
                "claude-haiku-*": {"input": 1, "output": 5},
                "gpt-5": {"input": 1.25, "output": 10}}"#,
        )
        .unwrap();
        // 1000 input + 100 output at $3/$15 per Mtok = $0.0045.
        assert_eq!(
            table.spend_micros("claude-sonnet-4-5", 1000, 100),
            Some(4500)
        );
        assert_eq!(
            table.spend_micros("claude-haiku-4-5", 1000, 100),
            Some(1500)
        );
        assert_eq!(table.spend_micros("gpt-5", 1000, 100), Some(2250));
        assert_eq!(table.spend_micros("gpt-5-mini", 1000, 100), None);
        let mut used = Usage {
            input_tokens: 1000,
            output_tokens: 100,
            spend_micros: 4500,
            ..Usage::default()
        };
        assert_eq!(used.model_usage().spend_micros, Some(4500));
        used.unpriced_requests = 1;
        assert_eq!(used.model_usage().spend_micros, None);
    }
}
