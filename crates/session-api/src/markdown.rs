//! A session as a Markdown document: the conversation a person reads,
//! with each tool call folded (`<details>`) under the answer it belongs
//! to. Made from [`chat::history`](crate::chat::history) — the same
//! `UIMessage[]` a page loads into `useChat` — so the document shows what
//! the chat shows (a rewind drops the turns after it, as there).
//!
//! `GET /v1/sessions/{id}/export?format=markdown` and `harness sessions
//! export ID --format markdown` answer it.

use std::fmt::Write;

use harness_core::frame::Frame;
use harness_core::log::LogInfo;
use serde_json::Value;

/// The media type of the document.
pub const MARKDOWN_CONTENT_TYPE: &str = "text/markdown; charset=utf-8";

/// Longest tool input or output shown whole; longer ones are cut, saying
/// how much was left out (the JSON export has everything).
const MAX_SHOWN: usize = 4000;

/// `info`'s session, from its `frames` (all of them, in order).
pub fn session_markdown(info: &LogInfo, frames: &[Frame]) -> String {
    let config = info.meta.config_or_default();
    let mut out = String::new();
    let _ = writeln!(out, "# Session {}", info.session);
    let _ = writeln!(out);
    let _ = write!(
        out,
        "Agent `{}`, sandbox `{}`, frames 1..={}",
        config.agent,
        config.sandbox.provider,
        frames.last().map_or(0, |f| f.seq)
    );
    if let Some(origin) = &info.forked_from {
        let _ = write!(
            out,
            ", forked from `{}` at frame {}",
            origin.session, origin.until
        );
    }
    if info.sealed {
        let _ = write!(out, ", sealed");
    }
    let _ = writeln!(out, ".");
    for message in crate::chat::history(frames) {
        let _ = writeln!(out);
        let turn = message["metadata"]["turnId"]
            .as_str()
            .or_else(|| message["id"].as_str().and_then(|id| id.split('-').next()))
            .unwrap_or("");
        if message["role"] == "user" {
            let _ = writeln!(out, "## User ({turn})");
        } else {
            let status = message["metadata"]["status"].as_str().unwrap_or("running");
            let _ = writeln!(out, "## Assistant ({turn}, {status})");
            if let Some(error) = message["metadata"]["error"].as_str() {
                let _ = writeln!(out);
                let _ = writeln!(out, "> **Error:** {}", one_line(error));
            }
        }
        for part in message["parts"].as_array().into_iter().flatten() {
            write_part(&mut out, part);
        }
    }
    out
}

fn write_part(out: &mut String, part: &Value) {
    match part["type"].as_str().unwrap_or("") {
        "text" => {
            let text = part["text"].as_str().unwrap_or("").trim();
            if !text.is_empty() {
                let _ = writeln!(out);
                let _ = writeln!(out, "{text}");
            }
        }
        "reasoning" => {
            let text = part["text"].as_str().unwrap_or("").trim();
            if !text.is_empty() {
                let _ = writeln!(out);
                let _ = writeln!(out, "<details><summary>Thinking</summary>");
                let _ = writeln!(out);
                let _ = writeln!(out, "{text}");
                let _ = writeln!(out);
                let _ = writeln!(out, "</details>");
            }
        }
        "dynamic-tool" => write_tool(out, part),
        // Steps, data parts: nothing a reader needs.
        _ => {}
    }
}

fn write_tool(out: &mut String, part: &Value) {
    let name = part["toolName"].as_str().unwrap_or("tool");
    let state = part["state"].as_str().unwrap_or("");
    let mut summary = format!("Tool: {}", escape(name));
    if let Some(gist) = gist(&part["input"]) {
        let _ = write!(summary, " — <code>{}</code>", escape(&gist));
    }
    match state {
        "output-error" => summary.push_str(" (failed)"),
        "approval-requested" => summary.push_str(" (waiting for approval)"),
        _ => {}
    }
    if let Some(approved) = part["approval"]["approved"].as_bool() {
        summary.push_str(if approved { " (approved)" } else { " (denied)" });
    }
    let _ = writeln!(out);
    let _ = writeln!(out, "<details><summary>{summary}</summary>");
    let _ = writeln!(out);
    let _ = writeln!(out, "Input:");
    fenced(out, "json", &pretty(&part["input"]));
    match state {
        "output-available" => {
            let _ = writeln!(out, "Output:");
            let output = match &part["output"] {
                Value::String(s) => s.clone(),
                other => pretty(other),
            };
            fenced(out, "", &output);
        }
        "output-error" => {
            let _ = writeln!(out, "Error:");
            fenced(out, "", part["errorText"].as_str().unwrap_or(""));
        }
        _ => {}
    }
    if let Some(reason) = part["approval"]["reason"].as_str() {
        let _ = writeln!(out, "Approval: {}", one_line(reason));
        let _ = writeln!(out);
    }
    let _ = writeln!(out, "</details>");
}

/// What a tool call is about in a few words: its command, path, pattern
/// or URL, whichever it has.
fn gist(input: &Value) -> Option<String> {
    ["command", "file_path", "path", "pattern", "url", "query"]
        .iter()
        .find_map(|k| input[*k].as_str())
        .map(|s| {
            let line = one_line(s);
            match line.char_indices().nth(80) {
                Some((at, _)) => format!("{}…", &line[..at]),
                None => line,
            }
        })
}

fn pretty(v: &Value) -> String {
    serde_json::to_string_pretty(v).unwrap_or_default()
}

/// `text` in a code block whose fence no line of it can close.
fn fenced(out: &mut String, lang: &str, text: &str) {
    let (text, cut) = match text.char_indices().nth(MAX_SHOWN) {
        Some((at, _)) => (&text[..at], text.len() - at),
        None => (text, 0),
    };
    let longest = text
        .lines()
        .map(|l| l.chars().take_while(|&c| c == '`').count())
        .max()
        .unwrap_or(0);
    let fence = "`".repeat(longest.max(2) + 1);
    let _ = writeln!(out);
    let _ = writeln!(out, "{fence}{lang}");
    let _ = writeln!(out, "{}", text.trim_end_matches('\n'));
    let _ = writeln!(out, "{fence}");
    if cut > 0 {
        let _ = writeln!(out, "({cut} more bytes in the JSON export)");
    }
    let _ = writeln!(out);
}

fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Text inside HTML (`<summary>`): no markup from the agent.
fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;
    use harness_core::frame::{FrameBody, MessageKind, SessionId};
    use harness_core::part::StreamPart;
    use harness_core::session::SessionMeta;
    use harness_core::turn::TurnStatus;
    use serde_json::json;

    fn frame(seq: u64, body: FrameBody) -> Frame {
        Frame {
            seq,
            at_ms: 0,
            body,
        }
    }

    fn part(seq: u64, part: StreamPart) -> Frame {
        frame(
            seq,
            FrameBody::Part {
                turn_id: "t1".into(),
                part,
            },
        )
    }

    #[test]
    fn a_turn_reads_as_the_prompt_the_answer_and_its_tool_call_folded() {
        let frames = vec![
            frame(
                1,
                FrameBody::UserMessage {
                    text: "list the files".into(),
                    turn_id: Some("t1".into()),
                },
            ),
            part(
                2,
                StreamPart::ToolCall {
                    tool_call_id: "c1".into(),
                    tool_name: "Bash".into(),
                    input: json!({"command": "ls -la </tmp>"}),
                },
            ),
            part(
                3,
                StreamPart::ToolResult {
                    tool_call_id: "c1".into(),
                    tool_name: "Bash".into(),
                    output: json!("a.txt\n```\nb.txt"),
                    is_error: false,
                },
            ),
            frame(
                4,
                FrameBody::Message {
                    turn_id: "t1".into(),
                    id: "m1".into(),
                    kind: MessageKind::Text,
                    text: "Two files: a.txt and b.txt.".into(),
                    interrupted: false,
                },
            ),
            frame(
                5,
                FrameBody::TurnStatus {
                    turn_id: "t1".into(),
                    status: TurnStatus::Finished,
                    error: None,
                    code: None,
                    sandbox: None,
                    agent_session_id: None,
                    checkpoint: None,
                },
            ),
        ];
        let info = LogInfo {
            session: SessionId::parse("s-md").unwrap(),
            last_seq: 5,
            last_at_ms: 0,
            sealed: false,
            forked_from: None,
            meta: SessionMeta::new(None),
            trimmed: None,
        };
        let md = session_markdown(&info, &frames);
        assert!(md.starts_with("# Session s-md\n"), "{md}");
        let user = md.find("## User (t1)\n\nlist the files").expect(&md);
        let assistant = md.find("## Assistant (t1, finished)").expect(&md);
        let tool = md
            .find("<details><summary>Tool: Bash — <code>ls -la &lt;/tmp&gt;</code></summary>")
            .expect(&md);
        let answer = md.find("Two files: a.txt and b.txt.").expect(&md);
        assert!(
            user < assistant && assistant < tool && tool < answer,
            "{md}"
        );
        // A line of the output starts with three backticks: its fence has
        // four, so that line cannot close it.
        assert!(md.contains("````\na.txt\n```\nb.txt\n````"), "{md}");
    }
}
