//! Every `harness` command line the README and `docs/` show parses with
//! this very binary's command line: a renamed flag or subcommand fails
//! here, not in a reader's terminal. (What the README's blocks *do* is
//! checked by running them: `tests/readme.rs`.)
//!
//! A command line is a line of a ```` ```sh ```` block that starts with
//! `harness ` or `cargo run -p harness-cli [--features …] -- `, with `\`
//! continuations joined and `# comments` dropped. Reference listings may
//! write optional parts as `[--keep]` and alternatives as `a|b`: each
//! bracket is kept (without brackets) and the first alternative taken.

use clap::Parser;

/// A command line found in a document.
#[derive(Debug, Clone, PartialEq)]
pub struct DocCommand {
    /// `file:line`.
    pub place: String,
    /// The arguments after the program.
    pub args: Vec<String>,
}

/// The command lines of `markdown` (named `file` in places).
pub fn commands(file: &str, markdown: &str) -> Vec<DocCommand> {
    let mut out = Vec::new();
    let mut in_sh = false;
    let mut pending: Option<(usize, String)> = None;
    for (i, line) in markdown.lines().enumerate() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("```") {
            in_sh = !in_sh && trimmed.trim_start_matches('`').trim() == "sh";
            pending = None;
            continue;
        }
        if !in_sh {
            continue;
        }
        let (start, mut text) = match pending.take() {
            Some((start, so_far)) => (start, so_far + " " + trimmed),
            None => (i + 1, trimmed.to_string()),
        };
        if let Some(joined) = text.strip_suffix('\\') {
            pending = Some((start, joined.trim_end().to_string()));
            continue;
        }
        text = strip_comment(&text);
        if let Some(args) = harness_args(&text) {
            out.push(DocCommand {
                place: format!("{file}:{start}"),
                args,
            });
        }
    }
    out
}

/// The line without its `# comment` (a `#` outside quotes after a space).
fn strip_comment(line: &str) -> String {
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

/// The arguments of a `harness` command line, listing syntax resolved.
fn harness_args(line: &str) -> Option<Vec<String>> {
    let words = shell_words(line);
    let rest = match words.first().map(String::as_str) {
        Some("harness") => &words[1..],
        Some("cargo") if words.get(1..4) == Some(&["run".into(), "-p".into(), "harness-cli".into()]) => {
            let dashes = words.iter().position(|w| w == "--")?;
            &words[dashes + 1..]
        }
        _ => return None,
    };
    Some(
        rest.iter()
            .map(|w| {
                let w = w.trim_start_matches('[').trim_end_matches(']');
                match w.split_once('|') {
                    Some((first, _)) if !w.contains('=') && !w.contains(' ') => first.to_string(),
                    _ => w.to_string(),
                }
            })
            .filter(|w| !w.is_empty())
            .collect(),
    )
}

/// Split like a POSIX shell would, without expanding anything: quotes
/// group and are removed.
fn shell_words(line: &str) -> Vec<String> {
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

/// Parse every command line of `markdown`; the ones the binary refuses,
/// with clap's reason.
pub fn refused(file: &str, markdown: &str) -> Vec<String> {
    commands(file, markdown)
        .into_iter()
        .filter_map(|cmd| {
            let argv = std::iter::once("harness".to_string()).chain(cmd.args.iter().cloned());
            crate::Cli::try_parse_from(argv).err().map(|e| {
                let first = e.to_string().lines().next().unwrap_or_default().to_string();
                format!("{}: harness {}: {first}", cmd.place, cmd.args.join(" "))
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn docs() -> Vec<(String, String)> {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let mut files = vec![root.join("README.md")];
        let mut more: Vec<_> = std::fs::read_dir(root.join("docs"))
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|e| e == "md"))
            .collect();
        more.sort();
        files.extend(more);
        files
            .into_iter()
            .map(|p| {
                let name = p
                    .strip_prefix(&root)
                    .unwrap_or(&p)
                    .display()
                    .to_string();
                (name, std::fs::read_to_string(&p).unwrap())
            })
            .collect()
    }

    #[test]
    fn every_documented_harness_command_parses() {
        let mut refused_all = Vec::new();
        let mut count = 0;
        for (name, text) in docs() {
            count += commands(&name, &text).len();
            refused_all.extend(refused(&name, &text));
        }
        assert!(
            refused_all.is_empty(),
            "documented commands this binary refuses:\n{}",
            refused_all.join("\n")
        );
        // The README shows two, the CLI guide dozens (37 on writing this).
        assert!(count >= 30, "found only {count} documented commands");
    }

    #[test]
    fn a_wrong_flag_in_a_document_is_caught() {
        let doc = "text\n```sh\n# ok\ncargo run -p harness-cli -- serve --demo   # fine\n\
                   harness serve \\\n  --no-such-flag\nharness sessions list\n```\n\
                   harness serve --not-in-a-block\n";
        let found = commands("x.md", doc);
        assert_eq!(
            found,
            vec![
                DocCommand {
                    place: "x.md:4".into(),
                    args: vec!["serve".into(), "--demo".into()]
                },
                DocCommand {
                    place: "x.md:5".into(),
                    args: vec!["serve".into(), "--no-such-flag".into()]
                },
                DocCommand {
                    place: "x.md:7".into(),
                    args: vec!["sessions".into(), "list".into()]
                },
            ]
        );
        let refused = refused("x.md", doc);
        assert_eq!(refused.len(), 1, "{refused:?}");
        assert!(refused[0].starts_with("x.md:5: harness serve --no-such-flag"), "{refused:?}");
    }

    #[test]
    fn listing_syntax_and_quotes_resolve() {
        let cmd = &commands(
            "x.md",
            "```sh\nharness demo [--agent claude-code|codex] [--keep]\n\
             harness serve --token \"$H=host\" --token 'a b=client'  # two\n```\n",
        );
        assert_eq!(cmd[0].args, ["demo", "--agent", "claude-code", "--keep"]);
        assert_eq!(cmd[1].args, ["serve", "--token", "$H=host", "--token", "a b=client"]);
    }
}
