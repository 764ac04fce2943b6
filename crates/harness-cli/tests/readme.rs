//! The README's shell blocks, run as a user would: every command of every
//! ```` ```sh ```` block runs, in order, on a new home, unless a marker
//! comment just before the block names it with the reason it cannot
//! (`<!-- readme-test: skip "COMMAND" — REASON -->`).
//!
//! - `cargo run -p harness-cli -- ARGS` runs this test's `harness` binary
//!   with ARGS (cargo itself is not run again: the test step built it, with
//!   CI's features), so a wrong subcommand or flag fails here;
//! - a `serve` command is a server: it runs in the background until the
//!   block ends, and the next command waits for it to listen;
//! - `curl` fails on an HTTP error (a `.curlrc` with `fail-with-body`); a
//!   streaming `curl -N` runs for a few seconds and must have printed
//!   server-sent events;
//! - anything else must exit 0.
//!
//! Every flag of every documented `harness` command line is also checked
//! against the binary without running it (`src/doc_commands.rs`).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use harness_testkit::docs::{harness_args, sh_blocks, ShBlock};
use harness_testkit::skip_or_fail;

/// How long one command may take (the demo runs a whole turn).
const COMMAND_LIMIT: Duration = Duration::from_secs(600);
/// How long a streaming `curl -N` is left to print.
const STREAM_FOR: Duration = Duration::from_secs(4);

/// A command the README marks as not run, with the reason.
fn skips(block: &ShBlock) -> Vec<(String, String)> {
    block
        .preamble
        .iter()
        .filter_map(|l| {
            let rest = l.trim().strip_prefix("<!-- readme-test: skip \"")?;
            let (command, reason) = rest.split_once('"')?;
            let reason = reason
                .trim_start_matches([' ', '—', '-'])
                .trim_end_matches("-->")
                .trim();
            Some((command.to_string(), reason.to_string()))
        })
        .collect()
}

/// What a run of the README's blocks did.
#[derive(Debug, Default)]
struct Ran {
    commands: usize,
    skipped: Vec<String>,
}

struct Runner {
    harness: PathBuf,
    dir: PathBuf,
    server: Option<Child>,
}

impl Drop for Runner {
    fn drop(&mut self) {
        self.stop_server();
        // The home's detached broker outlives its server by design.
        let _ = Command::new("pkill")
            .arg("-f")
            .arg(format!(
                "broker serve --dir {}",
                self.dir.join("home").display()
            ))
            .status();
    }
}

impl Runner {
    fn new(dir: &Path) -> Runner {
        std::fs::create_dir_all(dir.join("curl")).unwrap();
        std::fs::write(dir.join("curl/.curlrc"), "fail-with-body\n").unwrap();
        Runner {
            harness: PathBuf::from(env!("CARGO_BIN_EXE_harness")),
            dir: dir.to_path_buf(),
            server: None,
        }
    }

    fn stop_server(&mut self) {
        if let Some(mut server) = self.server.take() {
            let _ = server.kill();
            let _ = server.wait();
        }
    }

    /// `bash -c command` with the README's environment: a new home, curl
    /// failing on HTTP errors.
    fn shell(&self, command: &str) -> Command {
        let mut cmd = Command::new("bash");
        cmd.arg("-c")
            .arg(command)
            .current_dir(&self.dir)
            .env("HARNESS_HOME", self.dir.join("home"))
            .env("CURL_HOME", self.dir.join("curl"))
            .stdin(Stdio::null());
        cmd
    }

    /// Run one command line of the README; why it failed, if it did.
    fn run(&mut self, place: &str, line: &str) -> Result<(), String> {
        let command = match harness_args(line) {
            Some(args) if line.starts_with("cargo ") => {
                let quoted: Vec<String> = args.iter().map(|a| shell_quote(a)).collect();
                format!(
                    "{} {}",
                    shell_quote(&self.harness.display().to_string()),
                    quoted.join(" ")
                )
            }
            _ => line.to_string(),
        };
        if harness_args(line).is_some_and(|a| a.first().is_some_and(|s| s == "serve")) {
            return self.start_server(place, &command);
        }
        if line.starts_with("curl ")
            && line
                .split_whitespace()
                .any(|w| w.starts_with('-') && !w.starts_with("--") && w.contains('N'))
        {
            return self.stream(place, &command);
        }
        let out = run_bounded(self.shell(&command), COMMAND_LIMIT)
            .map_err(|e| format!("{place}: `{line}`: {e}"))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!(
                "{place}: `{line}` exited {}:\n{}{}",
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ))
        }
    }

    fn start_server(&mut self, place: &str, command: &str) -> Result<(), String> {
        self.stop_server();
        let log = self.dir.join("serve.log");
        let mut cmd = self.shell(&format!("exec {command} 2>{}", log.display()));
        cmd.stdout(Stdio::null());
        let mut child = cmd.spawn().map_err(|e| format!("{place}: {e}"))?;
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            if text.contains("serving sessions on ") {
                self.server = Some(child);
                return Ok(());
            }
            if let Ok(Some(status)) = child.try_wait() {
                return Err(format!(
                    "{place}: `{command}` exited {status} before serving:\n{text}"
                ));
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                return Err(format!(
                    "{place}: `{command}` did not start serving:\n{text}"
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// A streaming `curl -N`: left to print for [`STREAM_FOR`], then ended;
    /// it must not have failed and must have printed events.
    fn stream(&mut self, place: &str, command: &str) -> Result<(), String> {
        let limited = format!("timeout {} {command}", STREAM_FOR.as_secs());
        let out = run_bounded(self.shell(&limited), COMMAND_LIMIT)
            .map_err(|e| format!("{place}: `{command}`: {e}"))?;
        let text = String::from_utf8_lossy(&out.stdout);
        // 124: timeout ended it (a stream does not end by itself).
        let ended = out.status.success() || out.status.code() == Some(124);
        if ended && text.lines().any(|l| l.starts_with("data:")) {
            Ok(())
        } else {
            Err(format!(
                "{place}: `{command}` exited {} with no events:\n{text}{}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            ))
        }
    }
}

fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

/// Run `cmd` to its end, killing it after `limit`.
fn run_bounded(mut cmd: Command, limit: Duration) -> std::io::Result<std::process::Output> {
    let child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn()?;
    let id = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(limit) {
        Ok(out) => out,
        Err(_) => {
            let _ = Command::new("kill").args(["-9", &id.to_string()]).status();
            Err(std::io::Error::other(format!(
                "still running after {limit:?}"
            )))
        }
    }
}

/// Run every block of `readme` in `dir`.
fn run_readme(readme: &str, dir: &Path) -> Result<Ran, String> {
    let mut ran = Ran::default();
    let mut runner = Runner::new(dir);
    for block in sh_blocks(readme) {
        let skip = skips(&block);
        for (line, command) in &block.commands {
            let place = format!("README.md:{line}");
            if let Some((_, reason)) = skip.iter().find(|(c, _)| c == command) {
                ran.skipped.push(format!("{place}: `{command}` — {reason}"));
                continue;
            }
            runner.run(&place, command)?;
            ran.commands += 1;
        }
        runner.stop_server();
    }
    Ok(ran)
}

fn readme() -> String {
    std::fs::read_to_string(harness_testkit::checkout::path("README.md")).unwrap()
}

fn parts_present() -> bool {
    if std::env::var_os("HARNESS_CLAUDE_BIN").is_none() {
        skip_or_fail("the claude binary (HARNESS_CLAUDE_BIN) for the README's demo");
        return false;
    }
    true
}

#[test]
fn every_readme_block_runs() {
    if !parts_present() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let ran = run_readme(&readme(), dir.path()).unwrap_or_else(|e| panic!("{e}"));
    println!("ran {} README commands; not run:", ran.commands);
    for skipped in &ran.skipped {
        println!("  {skipped}");
    }
    // The demo, the server and its four curls.
    assert!(ran.commands >= 6, "ran only {} commands", ran.commands);
    // Each command not run carries its reason.
    assert!(
        ran.skipped.iter().all(|s| !s.ends_with("— ")),
        "{:?}",
        ran.skipped
    );
}

#[test]
fn a_wrong_flag_in_a_readme_block_fails_it() {
    let readme = readme();
    let broken = readme.replacen("-- serve --demo", "-- serve --demo --no-such-flag", 1);
    assert_ne!(broken, readme, "the README has no `serve --demo` to break");
    let dir = tempfile::tempdir().unwrap();
    // Only the block with the server: the demo block would run a turn.
    let server_block = broken
        .split("```sh")
        .find(|b| b.contains("--no-such-flag"))
        .map(|b| format!("```sh{}", &b[..b.find("```").map_or(b.len(), |i| i + 3)]))
        .unwrap();
    let err = run_readme(&server_block, dir.path()).unwrap_err();
    assert!(err.contains("--no-such-flag"), "{err}");
}
