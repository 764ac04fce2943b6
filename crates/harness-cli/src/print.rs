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

/// How a warning looks on the terminal. `model_url` is where the agent
/// sends its model requests, when this process knows it.
pub fn render_warning(part: &StreamPart, model_url: Option<&str>) -> Option<String> {
    let StreamPart::Warning {
        code,
        message,
        attempt,
        max_attempts,
    } = part
    else {
        return None;
    };
    if code != harness::core::part::WARNING_MODEL_RETRY {
        return Some(format!("⚠ {message}\n"));
    }
    let model = match model_url {
        Some(url) => format!("the model at {url}"),
        None => "the model".to_string(),
    };
    let count = match (attempt, max_attempts) {
        (Some(n), Some(max)) => format!(" ({n} of {max})"),
        (Some(n), None) => format!(" ({n})"),
        _ => String::new(),
    };
    Some(format!(
        "⚠ {model} is not answering: retrying{count}… [{message}]\n"
    ))
}

/// The line under a running turn saying what it is doing and how long ago
/// its agent last printed something. Drawn on stderr when it is a
/// terminal (indicatif hides it otherwise); hidden while text streams, so
/// it never splits a line of the answer.
pub struct Activity {
    bar: Option<indicatif::ProgressBar>,
    /// Any part seen yet (the template changes after the first).
    seen_output: bool,
    /// A text or reasoning block is open.
    in_block: bool,
    /// Tools called and not yet returned, latest last.
    running_tools: Vec<String>,
    model_url: Option<String>,
}

impl std::fmt::Debug for Activity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Activity")
            .field("in_block", &self.in_block)
            .finish_non_exhaustive()
    }
}

impl Activity {
    /// Start with `first` ("starting the turn …").
    pub fn new(first: &str, model_url: Option<String>) -> Self {
        let mut activity = Self {
            bar: None,
            seen_output: false,
            in_block: false,
            running_tools: Vec::new(),
            model_url,
        };
        activity.show(first);
        activity
    }

    fn show(&mut self, what: &str) {
        let template = if self.seen_output {
            "{spinner} {msg} · {elapsed} since the last output"
        } else {
            "{spinner} {msg} [{elapsed}]"
        };
        let bar = self.bar.get_or_insert_with(|| {
            let bar = indicatif::ProgressBar::new_spinner();
            bar.enable_steady_tick(std::time::Duration::from_millis(120));
            bar
        });
        bar.set_style(indicatif::ProgressStyle::with_template(template).expect("static template"));
        bar.set_message(what.to_string());
    }

    fn hide(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
    }

    /// Print `text` to stdout (or stderr) without tearing the status line.
    pub fn print(&self, text: &str, to_stderr: bool) {
        use std::io::Write;
        let write = || {
            if to_stderr {
                let mut err = std::io::stderr().lock();
                let _ = err.write_all(text.as_bytes());
                let _ = err.flush();
            } else {
                let mut out = std::io::stdout().lock();
                let _ = out.write_all(text.as_bytes());
                let _ = out.flush();
            }
        };
        match &self.bar {
            Some(bar) => bar.suspend(write),
            None => write(),
        }
    }

    /// Show `part` and say what the turn does now.
    pub fn part(&mut self, part: &StreamPart) {
        if part.is_progress() {
            self.seen_output = true;
            if let Some(bar) = &self.bar {
                bar.reset_elapsed();
            }
        }
        match part {
            StreamPart::TextStart { .. } | StreamPart::ReasoningStart { .. } => {
                self.in_block = true;
                self.hide();
            }
            StreamPart::TextEnd { .. } | StreamPart::ReasoningEnd { .. } => {
                self.print("\n", false);
                self.in_block = false;
                self.show("waiting for the model");
            }
            StreamPart::Warning { .. } => {
                let line = render_warning(part, self.model_url.as_deref()).unwrap_or_default();
                if self.in_block {
                    self.print("\n", false);
                }
                self.print(&line, true);
                if !self.in_block {
                    self.show(line.trim_start_matches("⚠ ").trim_end());
                }
            }
            StreamPart::ToolApprovalRequest { .. } => {
                self.hide();
                if let Some(text) = render(part) {
                    self.print(&text, false);
                }
            }
            part => {
                if let Some(text) = render(part) {
                    self.print(&text, false);
                }
                if self.in_block {
                    return;
                }
                match part {
                    StreamPart::ToolCall { tool_name, .. } => {
                        self.running_tools.push(tool_name.clone());
                        self.show(&format!("running {tool_name}"))
                    }
                    StreamPart::ToolResult { .. } => {
                        self.running_tools.pop();
                        match self.running_tools.last().cloned() {
                            Some(tool) => self.show(&format!("running {tool}")),
                            None => self.show("waiting for the model"),
                        }
                    }
                    StreamPart::Finish { .. } => self.hide(),
                    // A step ends when the model asks for a tool, before
                    // the tool runs: it does not change what the turn does.
                    _ if !self.running_tools.is_empty() => {}
                    _ => self.show("waiting for the model"),
                }
            }
        }
    }

    /// The turn ended: remove the line.
    pub fn done(mut self) {
        self.hide();
    }
}
