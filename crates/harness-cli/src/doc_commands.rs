//! Every `harness` command line the README and `docs/` show parses with
//! this very binary's command line: a renamed flag or subcommand fails
//! here, not in a reader's terminal. (What the README's blocks *do* is
//! checked by running them: `tests/readme.rs`.)
//!
//! A command line is a line of a ```` ```sh ```` block that starts with
//! `harness ` or `cargo run -p harness-cli [--features …] -- `
//! (`harness_testkit::docs`). Reference listings may write optional parts
//! as `[--keep]` and alternatives as `a|b`: each bracket is kept (without
//! brackets) and the first alternative taken.

use clap::Parser;
use harness_testkit::docs::{harness_args, sh_blocks};

/// The `harness` command lines of `markdown` (named `file` in places):
/// `(file:line, arguments)`.
fn commands(file: &str, markdown: &str) -> Vec<(String, Vec<String>)> {
    sh_blocks(markdown)
        .into_iter()
        .flat_map(|b| b.commands)
        .filter_map(|(line, text)| {
            let args = harness_args(&text)?
                .iter()
                .map(|w| {
                    let w = w.trim_start_matches('[').trim_end_matches(']');
                    match w.split_once('|') {
                        Some((first, _)) if !w.contains('=') && !w.contains(' ') => {
                            first.to_string()
                        }
                        _ => w.to_string(),
                    }
                })
                .filter(|w| !w.is_empty())
                .collect();
            Some((format!("{file}:{line}"), args))
        })
        .collect()
}

/// The command lines of `markdown` the binary refuses, with clap's reason.
fn refused(file: &str, markdown: &str) -> Vec<String> {
    commands(file, markdown)
        .into_iter()
        .filter_map(|(place, args)| {
            let argv = std::iter::once("harness".to_string()).chain(args.iter().cloned());
            crate::Cli::try_parse_from(argv).err().map(|e| {
                let first = e.to_string().lines().next().unwrap_or_default().to_string();
                format!("{place}: harness {}: {first}", args.join(" "))
            })
        })
        .collect()
}

fn docs() -> Vec<(String, String)> {
    let root = harness_testkit::checkout::root();
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
            let name = p.strip_prefix(&root).unwrap_or(&p).display().to_string();
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
    // The README shows two, the CLI guide dozens (37 in all on writing this).
    assert!(count >= 30, "found only {count} documented commands");
}

#[test]
fn a_wrong_flag_in_a_document_is_caught() {
    let doc = "```sh\ncargo run -p harness-cli -- serve --demo   # fine\n\
               harness serve \\\n  --no-such-flag\nharness sessions list\n```\n";
    let refused = refused("x.md", doc);
    assert_eq!(refused.len(), 1, "{refused:?}");
    assert!(
        refused[0].starts_with("x.md:3: harness serve --no-such-flag"),
        "{refused:?}"
    );
}

#[test]
fn listing_syntax_resolves() {
    let cmd = commands(
        "x.md",
        "```sh\nharness demo [--agent claude-code|codex] [--keep]\n```\n",
    );
    assert_eq!(cmd[0].1, ["demo", "--agent", "claude-code", "--keep"]);
}
