//! Rendering stream parts on the terminal as they arrive.

use std::io::Write;
use std::sync::Arc;

use async_trait::async_trait;
use harness::core::part::StreamPart;
use harness::core::slice::PartSink;
use harness::core::turn::TurnState;

/// A sink that prints every part, then hands it to the real sink.
pub struct PrintingSink {
    inner: Arc<dyn PartSink>,
}

impl std::fmt::Debug for PrintingSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrintingSink").finish_non_exhaustive()
    }
}

impl PrintingSink {
    /// Print, then forward to `inner`.
    pub fn new(inner: Arc<dyn PartSink>) -> Self {
        Self { inner }
    }
}

fn one_line(value: &serde_json::Value, max: usize) -> String {
    let text = match value {
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    let line = text.lines().next().unwrap_or("").to_string();
    if line.chars().count() > max {
        format!("{}…", line.chars().take(max).collect::<String>())
    } else {
        line
    }
}

/// How a part looks on the terminal (`None`: not shown).
pub fn render(part: &StreamPart) -> Option<String> {
    Some(match part {
        StreamPart::StreamStart {
            agent_session_id: Some(id),
        } => format!("· agent session {id}\n"),
        StreamPart::TextDelta { delta, .. } => delta.clone(),
        StreamPart::TextEnd { .. } | StreamPart::ReasoningEnd { .. } => "\n".into(),
        StreamPart::ReasoningDelta { delta, .. } => format!("\x1b[2m{delta}\x1b[0m"),
        StreamPart::ToolCall {
            tool_name, input, ..
        } => format!("⏺ {tool_name}({})\n", one_line(input, 100)),
        StreamPart::ToolResult {
            output, is_error, ..
        } => {
            format!(
                "  ⎿ {}{}\n",
                if *is_error { "error: " } else { "" },
                one_line(output, 100)
            )
        }
        StreamPart::ToolApprovalRequest { tool_name, .. } => {
            format!("? {tool_name} asks for approval\n")
        }
        StreamPart::FileChange { kind, path } => format!("  ✎ {kind:?} {path}\n"),
        StreamPart::Finish {
            finish_reason,
            usage,
        } => format!(
            "✔ finish: {finish_reason} ({} input / {} output tokens)\n",
            usage.input_tokens, usage.output_tokens
        ),
        StreamPart::Error { message } => format!("✖ {message}\n"),
        _ => return None,
    })
}

#[async_trait]
impl PartSink for PrintingSink {
    async fn emit(
        &self,
        session_id: &str,
        turn_id: &str,
        part: StreamPart,
        key: String,
    ) -> harness::core::Result<()> {
        if let Some(text) = render(&part) {
            let mut out = std::io::stdout().lock();
            let _ = out.write_all(text.as_bytes());
            let _ = out.flush();
        }
        self.inner.emit(session_id, turn_id, part, key).await
    }

    async fn turn_status(&self, state: &TurnState) -> harness::core::Result<()> {
        self.inner.turn_status(state).await
    }
}
