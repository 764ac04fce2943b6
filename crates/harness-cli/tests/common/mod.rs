//! What the durability tests share: the slow scripted turn, the `harness`
//! command aimed at the scripted model, reading a home's sessions back
//! through `harness sessions list|export` (the log's per-session meta and
//! frames), and the check that a turn's log is gap-free with every part
//! stored exactly once.

#![allow(dead_code)]

pub mod browser;
pub mod docker;
pub mod follow;
pub mod npm;
pub mod probe;
pub mod server;

use std::path::Path;
use std::process::{Command, Stdio};

use harness_testkit::model::{
    any, last_is_tool_result_for, last_user_text_contains, Reply, Rule, Script, ScriptedModel,
    BASH_CALL_ID,
};

/// The final answer, streamed in chunks 400 ms apart.
pub const FINAL_CHUNKS: [&str; 6] = ["The slow ", "task ", "is ", "done ", "and ", "verified."];

/// A turn of ~7 s: a Bash call that sleeps 5 s and writes `slow.txt`, then
/// the chunked answer (which asserts the tool result).
pub fn slow_script() -> Script {
    slow_script_sleeping(5)
}

/// [`slow_script`] with a tool that sleeps `seconds`.
pub fn slow_script_sleeping(seconds: u32) -> Script {
    slow_rules(Script::new(), seconds)
}

/// [`slow_script`], and a plain "Again." to a prompt that says "again" (a
/// second turn that ends at once).
pub fn slow_script_answering_again() -> Script {
    slow_rules(
        Script::new().on(last_user_text_contains("again"), Reply::text("Again.")),
        5,
    )
}

/// The slow turn's rules (its command sleeping `seconds`) after those of
/// `script`.
pub fn slow_rules(script: Script, seconds: u32) -> Script {
    script
        .rule(
            Rule::new(
                last_is_tool_result_for(BASH_CALL_ID),
                Reply::text_chunks(FINAL_CHUNKS).with_delay(400),
            )
            .assert_tool_result_contains(BASH_CALL_ID, "slow-done"),
        )
        .rule(Rule::new(
            any(),
            Reply::shell(
                BASH_CALL_ID,
                format!("sleep {seconds}; echo slow-done > slow.txt; cat slow.txt"),
            ),
        ))
}

/// `harness --home HOME` with Claude Code pointed at `model`.
pub fn harness(home: &Path, model: &ScriptedModel) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_harness"));
    cmd.arg("--home")
        .arg(home)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .env("ANTHROPIC_API_KEY", "test-key")
        .env("ANTHROPIC_BASE_URL", model.base_url())
        .env("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1");
    server::with_helpers(&mut cmd);
    cmd
}

/// `harness sessions export SESSION`, parsed.
pub fn export(home: &Path, model: &ScriptedModel, session: &str) -> Vec<serde_json::Value> {
    let out = harness(home, model)
        .args(["sessions", "export", session])
        .stdout(Stdio::piped())
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// One row of `harness sessions list` (what the log's per-session meta
/// says: config, turns, latest turn).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionRow {
    pub id: String,
    pub agent: String,
    pub sandbox: String,
    pub turns: u64,
    pub frames: u64,
    pub sealed: bool,
    /// `t1 finished`, or `-` before the first prompt.
    pub last_turn: String,
}

/// Parse the output of `harness sessions list`.
pub fn parse_sessions(stdout: &str) -> Vec<SessionRow> {
    let mut lines = stdout.lines();
    let header = lines.next().unwrap_or_default();
    assert!(
        header.starts_with("SESSION"),
        "not a session list: {stdout}"
    );
    lines
        .filter(|l| !l.trim().is_empty())
        .map(|line| {
            let w: Vec<&str> = line.split_whitespace().collect();
            assert!(w.len() >= 7, "a short session row: {line:?}");
            let last_turn = if w[6] == "-" {
                "-".to_string()
            } else {
                format!("{} {}", w[6], w.get(7).copied().unwrap_or_default())
            };
            SessionRow {
                id: w[0].to_string(),
                agent: w[1].to_string(),
                sandbox: w[2].to_string(),
                turns: w[3].parse().unwrap(),
                frames: w[4].parse().unwrap(),
                sealed: w[5] == "yes",
                last_turn,
            }
        })
        .collect()
}

/// `harness sessions list`, parsed.
pub fn sessions(home: &Path, model: &ScriptedModel) -> Vec<SessionRow> {
    let out = harness(home, model)
        .args(["sessions", "list"])
        .stdout(Stdio::piped())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "sessions list: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    parse_sessions(&String::from_utf8_lossy(&out.stdout))
}

/// The home's only session, once `harness sessions list` shows it.
pub fn only_session(home: &Path, model: &ScriptedModel) -> Option<SessionRow> {
    let mut rows = sessions(home, model);
    assert!(rows.len() <= 1, "one run, one session: {rows:?}");
    rows.pop()
}

/// The sandbox handle the turn's terminal `turn-status` frame recorded
/// (what the session's next turn continues in).
pub fn recorded_sandbox(frames: &[serde_json::Value]) -> serde_json::Value {
    frames
        .iter()
        .rev()
        .find(|f| f["body"]["type"] == "turn-status" && !f["body"]["sandbox"].is_null())
        .map(|f| f["body"]["sandbox"].clone())
        .unwrap_or_else(|| panic!("no turn-status frame records the sandbox: {frames:#?}"))
}

/// The slow turn's log is gap-free and holds one prompt, one tool call, one
/// tool result, one finish, the whole answer once and exactly one terminal
/// `turn-status` frame, which says `finished`.
pub fn assert_stored_once(frames: &[serde_json::Value], what: &str) {
    let seqs: Vec<u64> = frames.iter().map(|f| f["seq"].as_u64().unwrap()).collect();
    assert_eq!(
        seqs,
        (1..=frames.len() as u64).collect::<Vec<_>>(),
        "gap-free after {what}"
    );
    let count = |pred: &dyn Fn(&serde_json::Value) -> bool| {
        frames.iter().filter(|f| pred(&f["body"])).count()
    };
    let context = format!("{what}: {frames:#?}");
    let part = |kind: &'static str| {
        move |b: &serde_json::Value| b["type"] == "part" && b["part"]["type"] == kind
    };
    assert_eq!(count(&|b| b["type"] == "user-message"), 1, "{context}");
    assert_eq!(count(&part("tool-call")), 1, "one tool call: {context}");
    assert_eq!(count(&part("tool-result")), 1, "one tool result: {context}");
    assert_eq!(count(&part("finish")), 1, "one finish: {context}");
    let texts: Vec<&str> = frames
        .iter()
        .filter(|f| f["body"]["type"] == "message")
        .filter_map(|f| f["body"]["text"].as_str())
        .collect();
    assert_eq!(
        texts,
        vec![FINAL_CHUNKS.concat().as_str()],
        "the answer stored once and whole: {context}"
    );
    // Exactly one terminal status (a resumed turn must not end twice, nor
    // once as failed and once as finished), and it is `finished`.
    let terminal: Vec<&serde_json::Value> = frames
        .iter()
        .map(|f| &f["body"])
        .filter(|b| b["type"] == "turn-status")
        .filter(|b| {
            matches!(
                b["status"].as_str(),
                Some("finished" | "failed" | "timed_out")
            )
        })
        .collect();
    assert_eq!(terminal.len(), 1, "one terminal turn-status: {context}");
    assert_eq!(terminal[0]["status"], "finished", "{context}");
}

/// The sandboxes under the home (not the bootstrap templates).
pub fn local_sandboxes(home: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(home.join("sandboxes")) else {
        return Vec::new();
    };
    let mut ids: Vec<String> = entries
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("sandbox.json").is_file())
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    ids.sort();
    ids
}

/// The one S3 bucket the CLI tests share; each test keeps to its own
/// `--namespace`. SeaweedFS backs every bucket with a collection of its own
/// volumes, so a bucket per test run used up the server's volume slots
/// after a few dozen runs ("No writable volumes", HTTP 500).
pub const S3_TEST_BUCKET: &str = "harness-cli-tests";

/// The store flags for `harness checkpoint|restore|ls`: `endpoint`, the
/// shared test bucket, and a prefix no other test or run uses.
pub fn s3_store_flags(endpoint: &str, tag: &str) -> Vec<String> {
    vec![
        "--endpoint".into(),
        endpoint.into(),
        "--bucket".into(),
        S3_TEST_BUCKET.into(),
        "--namespace".into(),
        format!("tests/{tag}-{}", uuid::Uuid::new_v4().simple()),
    ]
}

/// What a `harness` command did.
pub struct Ran {
    pub ok: bool,
    pub stdout: String,
    pub stderr: String,
}

impl Ran {
    /// Panics unless it succeeded.
    pub fn expect_ok(self, what: &str) -> Self {
        assert!(
            self.ok,
            "{what} failed:\n--- stdout\n{}\n--- stderr\n{}",
            self.stdout, self.stderr
        );
        self
    }

    /// Panics unless it failed; its stderr.
    pub fn expect_err(self, what: &str) -> String {
        assert!(
            !self.ok,
            "{what} should have failed:\n--- stdout\n{}\n--- stderr\n{}",
            self.stdout, self.stderr
        );
        self.stderr
    }

    /// Stdout then stderr.
    pub fn all(&self) -> String {
        format!("{}{}", self.stdout, self.stderr)
    }
}

/// Run a `harness` command to its end with its output captured, killed
/// after 5 minutes.
pub async fn run_to_end(mut cmd: Command) -> Ran {
    let what = format!("{cmd:?}");
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut cmd = tokio::process::Command::from(cmd);
    cmd.kill_on_drop(true);
    let out = tokio::time::timeout(std::time::Duration::from_secs(300), cmd.output())
        .await
        .unwrap_or_else(|_| panic!("{what} ran for 5 minutes"))
        .expect("the harness binary runs");
    Ran {
        ok: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// The session a `harness run`/`restore` names in its "continue with
/// `harness run --session ID PROMPT`".
pub fn continued_session(text: &str) -> String {
    text.split_whitespace()
        .skip_while(|w| *w != "--session")
        .nth(1)
        .unwrap_or_else(|| panic!("names no session to continue:\n{text}"))
        .to_string()
}
