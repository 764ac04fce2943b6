//! Shell blocks of Markdown documents, as the doc tests read them: the
//! `harness` binary checks every command line its docs show
//! (`doc_commands.rs`), and `tests/readme.rs` runs the README's blocks.

/// A ```` ```sh ```` block: where it starts and its command lines (`\`
/// continuations joined, `# comments` and blank lines dropped), each with
/// its line number.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShBlock {
    /// Line number of the opening fence.
    pub line: usize,
    /// The lines of the document just before the fence (its preamble:
    /// where a marker comment says how a test treats the block).
    pub preamble: Vec<String>,
    /// `(line, command)`.
    pub commands: Vec<(usize, String)>,
}

/// The sh blocks of `markdown`.
pub fn sh_blocks(markdown: &str) -> Vec<ShBlock> {
    let lines: Vec<&str> = markdown.lines().collect();
    let mut out = Vec::new();
    let mut block: Option<ShBlock> = None;
    let mut pending: Option<(usize, String)> = None;
    for (i, line) in lines.iter().enumerate() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("```") {
            match block.take() {
                Some(done) => out.push(done),
                None if trimmed.trim_start_matches('`').trim() == "sh" => {
                    block = Some(ShBlock {
                        line: i + 1,
                        preamble: lines[i.saturating_sub(3)..i]
                            .iter()
                            .map(|l| l.to_string())
                            .collect(),
                        commands: Vec::new(),
                    })
                }
                // Another language's block: skipped whole.
                None => {
                    block = Some(ShBlock {
                        line: 0,
                        preamble: Vec::new(),
                        commands: Vec::new(),
                    })
                }
            }
            pending = None;
            continue;
        }
        let Some(current) = block.as_mut().filter(|b| b.line > 0) else {
            continue;
        };
        let (start, text) = match pending.take() {
            Some((start, so_far)) => (start, so_far + " " + trimmed),
            None => (i + 1, trimmed.to_string()),
        };
        if let Some(joined) = text.strip_suffix('\\') {
            pending = Some((start, joined.trim_end().to_string()));
            continue;
        }
        let text = strip_comment(&text);
        if !text.is_empty() {
            current.commands.push((start, text));
        }
    }
    out.retain(|b| b.line > 0);
    out
}

/// The line without its `# comment` (a `#` outside quotes after a space or
/// at the start).
pub fn strip_comment(line: &str) -> String {
    let (mut single, mut double) = (false, false);
    let mut prev = ' ';
    for (i, c) in line.char_indices() {
        match c {
            '\'' if !double => single = !single,
            '"' if !single => double = !double,
            '#' if !single && !double && prev.is_whitespace() => {
                return line[..i].trim_end().to_string()
            }
            _ => {}
        }
        prev = c;
    }
    line.trim_end().to_string()
}

/// Split like a POSIX shell would, without expanding anything: quotes
/// group and are removed.
pub fn shell_words(line: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut in_word = false;
    let mut quote: Option<char> = None;
    for c in line.chars() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), c) => word.push(c),
            (None, '\'' | '"') => {
                quote = Some(c);
                in_word = true;
            }
            (None, c) if c.is_whitespace() => {
                if in_word {
                    words.push(std::mem::take(&mut word));
                    in_word = false;
                }
            }
            (None, c) => {
                word.push(c);
                in_word = true;
            }
        }
    }
    if in_word {
        words.push(word);
    }
    words
}

/// The arguments of a `harness` command line (`harness …` or `cargo run -p
/// harness-cli [flags] -- …`), `None` for any other command. The command
/// ends where the shell would end it: at a pipe, `&`, `&&`, `||`, `;` or a
/// redirection (`harness sessions export S | grep …`, `harness serve &`).
pub fn harness_args(line: &str) -> Option<Vec<String>> {
    let mut words = shell_words(line);
    if let Some(end) = words.iter().position(|w| {
        matches!(
            w.as_str(),
            "|" | "||" | "&" | "&&" | ";" | ">" | ">>" | "2>&1"
        )
    }) {
        words.truncate(end);
    }
    match words.first().map(String::as_str) {
        Some("harness") => Some(words[1..].to_vec()),
        Some("cargo")
            if words
                .get(1..4)
                .is_some_and(|w| w == ["run", "-p", "harness-cli"]) =>
        {
            let dashes = words.iter().position(|w| w == "--")?;
            Some(words[dashes + 1..].to_vec())
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_lines_and_words() {
        let doc = "intro\n<!-- marker -->\n```sh\n# ok\ncargo run -p harness-cli -- serve --demo   # fine\n\
                   harness serve \\\n  --no-such-flag\n\nharness sessions list\n```\n\
                   ```rust\nharness not_sh\n```\nharness serve --not-in-a-block\n";
        let blocks = sh_blocks(doc);
        assert_eq!(blocks.len(), 1);
        assert_eq!(blocks[0].line, 3);
        assert!(blocks[0].preamble.contains(&"<!-- marker -->".to_string()));
        assert_eq!(
            blocks[0].commands,
            vec![
                (5, "cargo run -p harness-cli -- serve --demo".to_string()),
                (6, "harness serve --no-such-flag".to_string()),
                (9, "harness sessions list".to_string()),
            ]
        );
        assert_eq!(
            harness_args("harness sessions export S | grep '\"checkpoint\"'"),
            Some(vec![
                "sessions".to_string(),
                "export".to_string(),
                "S".to_string()
            ])
        );
        assert_eq!(
            harness_args("cargo run -p harness-cli -- serve --demo &"),
            Some(vec!["serve".to_string(), "--demo".to_string()])
        );
        assert_eq!(
            harness_args("cargo run -p harness-cli --features full -- serve --demo"),
            Some(vec!["serve".to_string(), "--demo".to_string()])
        );
        assert_eq!(harness_args("curl -s x"), None);
        assert_eq!(
            shell_words("serve --token \"$H=host\" --token 'a b=client'"),
            ["serve", "--token", "$H=host", "--token", "a b=client"]
        );
        assert_eq!(strip_comment("echo '# not' # yes"), "echo '# not'");
    }
}
