//! Rendering stream parts on the terminal as they arrive.

use harness::core::part::StreamPart;

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
