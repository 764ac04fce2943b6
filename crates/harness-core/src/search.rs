//! Search across sessions: what of a frame is searchable, what a query is,
//! and what a hit says — the rules every store's index follows.
//!
//! A store indexes each frame it writes with [`document`] (the append
//! decision hands it over: `NewFrame::document`), in the append's
//! transaction or soon after its commit (within a second): prompts, the agent's answers and reasoning, tool calls
//! (the tool's name and every string of its input: commands, file paths),
//! tool results, changed files, and a failed turn's error. Frames that say
//! nothing a person would look for (stream bookkeeping, runner attachment,
//! seals) are not indexed. A [`SearchQuery`] is checked and turned into
//! plain terms here, so no store hands user input to its query language.

use serde::{Deserialize, Serialize};

use crate::frame::{FrameBody, MessageKind, SessionId};
use crate::part::StreamPart;
use crate::{Error, Result};

/// The most text of one frame that is indexed (a long tool output is
/// searched by its beginning).
pub const MAX_DOCUMENT_BYTES: usize = 64 * 1024;
/// The longest query taken.
pub const MAX_QUERY_BYTES: usize = 1000;
/// The most terms in one query.
pub const MAX_TERMS: usize = 32;
/// Hits answered when the query names no limit, and the most it may name.
pub const DEFAULT_LIMIT: usize = 20;
/// The most hits one query answers.
pub const MAX_LIMIT: usize = 200;

/// What kind of frame a hit is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DocKind {
    /// A user's prompt.
    Prompt,
    /// The agent's answer text.
    Answer,
    /// The agent's reasoning.
    Reasoning,
    /// A tool call: its name and input.
    ToolCall,
    /// A tool's result.
    ToolResult,
    /// A file the turn changed.
    File,
    /// A failed turn's error.
    Error,
    /// A host tool's call.
    HostCall,
}

impl DocKind {
    /// The name stored beside the text.
    pub fn as_str(self) -> &'static str {
        match self {
            DocKind::Prompt => "prompt",
            DocKind::Answer => "answer",
            DocKind::Reasoning => "reasoning",
            DocKind::ToolCall => "tool-call",
            DocKind::ToolResult => "tool-result",
            DocKind::File => "file",
            DocKind::Error => "error",
            DocKind::HostCall => "host-call",
        }
    }

    /// The kind an index holds under `s`: `Corrupt` for a name no build
    /// writes.
    pub fn stored(s: &str) -> crate::Result<DocKind> {
        Self::parse(s)
            .ok_or_else(|| crate::Error::corrupt(format!("search index: unknown kind {s:?}")))
    }

    /// The kind a stored name stands for.
    pub fn parse(s: &str) -> Option<DocKind> {
        [
            DocKind::Prompt,
            DocKind::Answer,
            DocKind::Reasoning,
            DocKind::ToolCall,
            DocKind::ToolResult,
            DocKind::File,
            DocKind::Error,
            DocKind::HostCall,
        ]
        .into_iter()
        .find(|k| k.as_str() == s)
    }
}

/// A frame as the index holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Document {
    /// What the frame is.
    pub kind: DocKind,
    /// Its searchable text (at most [`MAX_DOCUMENT_BYTES`]).
    pub text: String,
}

/// The searchable document of a frame, if it has one.
pub fn document(body: &FrameBody) -> Option<Document> {
    let (kind, text) = match body {
        FrameBody::UserMessage { text, .. } => (DocKind::Prompt, text.clone()),
        FrameBody::Message { kind, text, .. } => (
            match kind {
                MessageKind::Reasoning => DocKind::Reasoning,
                MessageKind::Text => DocKind::Answer,
            },
            text.clone(),
        ),
        FrameBody::Part { part, .. } => match part {
            StreamPart::ToolCall {
                tool_name, input, ..
            } => (DocKind::ToolCall, with_strings(tool_name, input)),
            StreamPart::ToolResult { output, .. } => {
                (DocKind::ToolResult, with_strings("", output))
            }
            StreamPart::FileChange { path, .. } => (DocKind::File, path.clone()),
            _ => return None,
        },
        FrameBody::TurnStatus {
            error: Some(error), ..
        } => (DocKind::Error, error.clone()),
        FrameBody::HostCall { tool, input, .. } => (DocKind::HostCall, with_strings(tool, input)),
        _ => return None,
    };
    let text = cut(text.trim().to_string());
    (!text.is_empty()).then_some(Document { kind, text })
}

/// `head` and every string (and number) in `value`, one per line.
fn with_strings(head: &str, value: &serde_json::Value) -> String {
    let mut out = head.to_string();
    let mut stack = vec![value];
    while let Some(v) = stack.pop() {
        if out.len() > MAX_DOCUMENT_BYTES {
            break;
        }
        match v {
            serde_json::Value::String(s) => {
                out.push('\n');
                out.push_str(s);
            }
            serde_json::Value::Number(n) => {
                out.push('\n');
                out.push_str(&n.to_string());
            }
            serde_json::Value::Array(items) => stack.extend(items.iter().rev()),
            serde_json::Value::Object(map) => stack.extend(map.values().rev()),
            _ => {}
        }
    }
    out
}

fn cut(mut text: String) -> String {
    if text.len() > MAX_DOCUMENT_BYTES {
        let mut end = MAX_DOCUMENT_BYTES;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
    }
    text
}

/// A search across sessions. Every term must appear (in any order); the
/// filters narrow by the session's agent and provider, the frame's time and
/// the session's latest turn status.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SearchQuery {
    /// The words to find, as typed.
    pub text: String,
    /// Only sessions of this agent (`claude-code`, `codex`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<String>,
    /// Only sessions on this sandbox provider.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider: Option<String>,
    /// Only frames stored at or after this time (ms since the epoch).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after_ms: Option<u64>,
    /// Only frames stored before this time (ms since the epoch).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub before_ms: Option<u64>,
    /// Only sessions whose latest turn has this status (`running`,
    /// `finished`, `failed`, …).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<String>,
    /// The most hits to answer ([`DEFAULT_LIMIT`] when unset).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<usize>,
}

impl SearchQuery {
    /// A query for `text` with no filters.
    pub fn new(text: impl Into<String>) -> Self {
        Self {
            text: text.into(),
            ..Self::default()
        }
    }

    /// The query's terms: the text split on anything but letters, digits
    /// and `_`, lower-cased, at most [`MAX_TERMS`]. An empty or oversized
    /// query, or one with no term, is bad input.
    pub fn terms(&self) -> Result<Vec<String>> {
        if self.text.len() > MAX_QUERY_BYTES {
            return Err(Error::invalid(format!(
                "the search query is {} bytes; at most {MAX_QUERY_BYTES}",
                self.text.len()
            )));
        }
        let terms: Vec<String> = self
            .text
            .split(|c: char| !(c.is_alphanumeric() || c == '_'))
            .filter(|t| !t.is_empty())
            .map(str::to_lowercase)
            .collect();
        if terms.is_empty() {
            return Err(Error::invalid(
                "the search query has nothing to search for: give it words (letters or digits)",
            ));
        }
        if terms.len() > MAX_TERMS {
            return Err(Error::invalid(format!(
                "the search query has {} terms; at most {MAX_TERMS}",
                terms.len()
            )));
        }
        Ok(terms)
    }

    /// The limit to apply: [`DEFAULT_LIMIT`] when unset; bad input when 0
    /// or over [`MAX_LIMIT`].
    pub fn limit(&self) -> Result<usize> {
        match self.limit {
            None => Ok(DEFAULT_LIMIT),
            Some(n) if (1..=MAX_LIMIT).contains(&n) => Ok(n),
            Some(n) => Err(Error::invalid(format!(
                "limit={n}: a search answers 1 to {MAX_LIMIT} hits"
            ))),
        }
    }

    /// The terms as an FTS5 `MATCH` expression (SQLite's index and the
    /// Durable Object's): each term a quoted string, never read as FTS5
    /// syntax, all of them required.
    pub fn fts5_match(&self) -> Result<String> {
        Ok(self
            .terms()?
            .iter()
            .map(|t| format!("\"{}\"", t.replace('"', "\"\"")))
            .collect::<Vec<_>>()
            .join(" AND "))
    }

    /// Whether a session whose meta is `meta` passes the session filters
    /// (agent, provider, latest turn status) — for a store that searches
    /// one session at a time (a Durable Object); the SQL stores apply the
    /// same filters in their query.
    pub fn admits(&self, meta: &crate::session::SessionMeta) -> bool {
        let config = meta.config.as_ref();
        let is = |want: &Option<String>, have: Option<&str>| {
            want.as_deref().is_none_or(|w| have == Some(w))
        };
        is(&self.agent, config.map(|c| c.agent.as_str()))
            && is(&self.provider, config.map(|c| c.sandbox.provider.as_str()))
            && is(&self.status, meta.turn.as_ref().map(|t| t.status.as_str()))
    }

    /// Check everything before a store runs it: the terms, the limit, and
    /// a time range that is not empty.
    pub fn check(&self) -> Result<()> {
        self.terms()?;
        self.limit()?;
        if let (Some(a), Some(b)) = (self.after_ms, self.before_ms) {
            if a >= b {
                return Err(Error::invalid(format!(
                    "after={a} is not before before={b}: the time range is empty"
                )));
            }
        }
        Ok(())
    }
}

/// One frame a search found.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SearchHit {
    /// The session.
    pub session: SessionId,
    /// The frame's seq in it.
    pub seq: u64,
    /// When the frame was stored (ms since the epoch).
    pub at_ms: u64,
    /// What the frame is.
    pub kind: DocKind,
    /// The text around the match, the matched words between `[` and `]`.
    pub snippet: String,
    /// Its rank: lower is better (the store's relevance score).
    pub rank: f64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn frames_give_their_words_and_bookkeeping_gives_none() {
        let call = FrameBody::Part {
            turn_id: "t1".into(),
            part: StreamPart::ToolCall {
                tool_call_id: "c".into(),
                tool_name: "Bash".into(),
                input: json!({"command": "cargo test -p session-log", "timeout": 120}),
            },
        };
        let doc = document(&call).unwrap();
        assert_eq!(doc.kind, DocKind::ToolCall);
        assert!(doc.text.contains("Bash") && doc.text.contains("cargo test -p session-log"));
        assert!(doc.text.contains("120"));
        let prompt = FrameBody::UserMessage {
            text: "  fix the parser ".into(),
            turn_id: None,
        };
        assert_eq!(document(&prompt).unwrap().text, "fix the parser");
        assert!(document(&FrameBody::RunnerAttached { generation: 1 }).is_none());
        assert!(document(&FrameBody::Sealed {}).is_none());
        let long = FrameBody::UserMessage {
            text: "é".repeat(MAX_DOCUMENT_BYTES),
            turn_id: None,
        };
        assert!(document(&long).unwrap().text.len() <= MAX_DOCUMENT_BYTES);
    }

    #[test]
    fn queries_become_quoted_terms_and_bad_ones_are_refused() {
        let q = SearchQuery::new("Parser.rs \"OR\" NEAR(x)");
        assert_eq!(q.terms().unwrap(), ["parser", "rs", "or", "near", "x"]);
        for bad in ["", "   ", "?!* ()"] {
            let err = SearchQuery::new(bad).check().unwrap_err();
            assert_eq!(err.kind(), crate::ErrorKind::InvalidInput, "{bad:?}");
        }
        assert!(SearchQuery::new("x".repeat(MAX_QUERY_BYTES + 1))
            .check()
            .is_err());
        let mut q = SearchQuery::new("ok");
        q.limit = Some(0);
        assert!(q.check().is_err());
        q.limit = Some(MAX_LIMIT + 1);
        assert!(q.check().is_err());
        q.limit = None;
        q.after_ms = Some(10);
        q.before_ms = Some(10);
        assert!(q.check().is_err());
    }
}
