//! Every subcommand, through the built `harness` binary, with the real
//! agent binaries and real services where the subcommand needs them.

mod common;

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use harness_testkit::model::{last_user_text_contains, Reply, Rule, Script, ScriptedModel};
use harness_testkit::{require_env, skip_or_fail};

fn harness(home: &Path) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_harness"));
    cmd.arg("--home").arg(home).stdin(Stdio::null());
    cmd.env_remove("ANTHROPIC_API_KEY")
        .env_remove("OPENAI_API_KEY")
        .env_remove("HARNESS_HOME");
    cmd
}

fn run(cmd: &mut Command) -> (Output, String, String) {
    let out = cmd.output().expect("the harness binary runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    (out, stdout, stderr)
}

fn have_agent(var: &str) -> bool {
    require_env(var).is_some()
}

#[test]
fn demo_runs_a_real_claude_code_turn() {
    if !have_agent("HARNESS_CLAUDE_BIN") {
        return;
    }
    let home = tempfile::tempdir().unwrap();
    let (out, stdout, stderr) = run(harness(home.path()).arg("demo"));
    assert!(out.status.success(), "demo failed:\n{stdout}\n{stderr}");
    assert!(
        stdout.contains("⏺ Bash("),
        "the tool call streamed to the terminal:\n{stdout}"
    );
    assert!(
        stdout.contains(
            "hello.txt in the sandbox, read through the sandbox API: \"hello from the sandbox\""
        ),
        "{stdout}"
    );
    // The demo runs in this process: the summary counts the slices.
    assert!(
        stdout.contains("turn t1 finished in 1 slice(s)"),
        "{stdout}"
    );
    assert_demo_reported_no_error(home.path(), &stdout, &stderr);
}

#[test]
fn demo_runs_a_real_codex_turn() {
    if !have_agent("HARNESS_CODEX_BIN") {
        return;
    }
    let home = tempfile::tempdir().unwrap();
    let (out, stdout, stderr) = run(harness(home.path()).args(["demo", "--agent", "codex"]));
    assert!(out.status.success(), "demo failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("\"hello from the sandbox\""), "{stdout}");
    assert_demo_reported_no_error(home.path(), &stdout, &stderr);
}

/// A demo turn that succeeds can still carry errors the agent reported on
/// the way (e.g. Codex's "✖ Code Mode is unavailable because failed to
/// spawn code-mode host …" when the recipe shipped `codex` without its
/// helper binaries): none may be printed (`✖` lines, how the terminal shows
/// an `error` part) and none may be stored in the session's frames.
fn assert_demo_reported_no_error(home: &Path, stdout: &str, stderr: &str) {
    let crossed: Vec<&str> = stdout
        .lines()
        .chain(stderr.lines())
        .filter(|l| l.contains('✖'))
        .collect();
    assert!(
        crossed.is_empty(),
        "the demo printed errors:\n{}\n--- stdout:\n{stdout}\n--- stderr:\n{stderr}",
        crossed.join("\n")
    );
    // stderr names it: "session s-… (<agent> in a local sandbox)".
    let session = stderr
        .lines()
        .find_map(|l| l.strip_prefix("session "))
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("the demo named no session:\n{stderr}"));
    let (out, export, err) = run(harness(home).args(["sessions", "export", session]));
    assert!(out.status.success(), "sessions export {session}: {err}");
    let frames: Vec<serde_json::Value> = export
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let parts: Vec<&serde_json::Value> = frames
        .iter()
        .filter(|f| f["body"]["type"] == "part")
        .map(|f| &f["body"]["part"])
        .collect();
    assert!(
        parts.iter().any(|p| p["type"] == "finish"),
        "the export holds the turn's parts:\n{export}"
    );
    let errors: Vec<&&serde_json::Value> = parts.iter().filter(|p| p["type"] == "error").collect();
    assert!(
        errors.is_empty(),
        "the demo's turn stored error parts: {errors:#?}\n--- frames:\n{export}"
    );
    let failed: Vec<&serde_json::Value> = frames
        .iter()
        .filter(|f| f["body"]["type"] == "turn-status" && !f["body"]["error"].is_null())
        .collect();
    assert!(failed.is_empty(), "turn errors: {failed:#?}");
}

#[test]
fn run_without_a_key_explains_what_to_do() {
    let home = tempfile::tempdir().unwrap();
    let (out, _, stderr) = run(harness(home.path()).args(["run", "hello"]));
    assert!(!out.status.success());
    assert!(stderr.contains("ANTHROPIC_API_KEY is not set"), "{stderr}");
    assert!(
        stderr.contains("harness demo"),
        "points at the demo: {stderr}"
    );
    let (out, _, stderr) = run(harness(home.path()).args(["run", "--agent", "codex", "hello"]));
    assert!(!out.status.success());
    assert!(stderr.contains("OPENAI_API_KEY is not set"), "{stderr}");
}

#[test]
fn unknown_session_and_bad_flags_are_clear_errors() {
    let home = tempfile::tempdir().unwrap();
    let (out, _, stderr) = run(harness(home.path())
        .args(["run", "--session", "nope", "hi"])
        .env("ANTHROPIC_API_KEY", "k"));
    assert!(!out.status.success());
    assert!(stderr.contains("unknown session \"nope\""), "{stderr}");
    let (out, _, stderr) = run(harness(home.path()).args(["run", "--sandbox", "vm", "hi"]));
    assert!(!out.status.success());
    assert!(stderr.contains("invalid value 'vm'"), "{stderr}");
    let (out, _, stderr) = run(harness(home.path()).args(["sessions", "export", "../etc"]));
    assert!(!out.status.success());
    assert!(stderr.contains("invalid session id"), "{stderr}");
    // With no store named, the store is the home's checkpoints directory.
    let (out, stdout, stderr) = run(harness(home.path())
        .args(["ls"])
        .env_remove("HARNESS_S3_ENDPOINT")
        .env_remove("HARNESS_R2_ACCOUNT_ID"));
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.is_empty(), "{stdout}");
    let default_store = home.path().join("checkpoints");
    assert!(
        stderr.contains(&default_store.display().to_string()) && default_store.is_dir(),
        "{stderr}"
    );
    // Two stores named at once: refused, nothing made.
    let other = home.path().join("other-store");
    let (out, _, stderr) = run(harness(home.path())
        .args(["ls", "--dir"])
        .arg(&other)
        .args(["--endpoint", "http://127.0.0.1:9"]));
    assert!(!out.status.success());
    assert!(stderr.contains("pick one"), "{stderr}");
    assert!(!other.exists());
    // A directory store on a path that is a file.
    let file = home.path().join("a-file");
    std::fs::write(&file, "x").unwrap();
    let (out, _, stderr) = run(harness(home.path())
        .args(["ls", "--dir"])
        .arg(&file)
        .env_remove("HARNESS_S3_ENDPOINT"));
    assert!(!out.status.success());
    assert!(
        stderr.contains("opening the checkpoint store in") && stderr.contains("a-file"),
        "{stderr}"
    );
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "x");
}

/// `run` with a base URL pointed at the scripted model, twice in one
/// session; then `sessions list|export|fork` on the result.
#[tokio::test(flavor = "multi_thread")]
async fn run_continues_a_session_and_sessions_commands_read_it() {
    if !have_agent("HARNESS_CLAUDE_BIN") {
        return;
    }
    let script = Script::new()
        .rule(
            Rule::new(
                last_user_text_contains("second question"),
                Reply::text("second answer"),
            )
            .assert_assistant_texts_contain("first answer"),
        )
        .rule(Rule::new(
            last_user_text_contains("first question"),
            Reply::text("first answer"),
        ));
    let model = ScriptedModel::start(script).await.unwrap();
    let home = tempfile::tempdir().unwrap();
    let base = |cmd: &mut Command| {
        cmd.env("ANTHROPIC_API_KEY", "test-key")
            .env("ANTHROPIC_BASE_URL", model.base_url())
            .env("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1");
    };
    let mut first = harness(home.path());
    base(&mut first);
    let (out, stdout, stderr) = run(first.args(["run", "first question"]));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("first answer"), "{stdout}");
    let session = stderr
        .split_whitespace()
        .skip_while(|w| *w != "--session")
        .nth(1)
        .expect("run prints how to continue")
        .to_string();
    let mut second = harness(home.path());
    base(&mut second);
    let (out, stdout, stderr) = run(second.args(["run", "--session", &session, "second question"]));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("second answer"), "{stdout}");
    assert!(
        model.failures().is_empty(),
        "the second turn carried the first: {:?}",
        model.failures()
    );

    let (out, stdout, _) = run(harness(home.path()).args(["sessions", "list"]));
    assert!(out.status.success());
    let rows = common::parse_sessions(&stdout);
    let row = rows
        .iter()
        .find(|r| r.id == session)
        .unwrap_or_else(|| panic!("{session} is not listed:\n{stdout}"));
    // The log's meta: the session's config, both prompts, the latest turn.
    assert_eq!(
        (
            row.agent.as_str(),
            row.sandbox.as_str(),
            row.turns,
            row.last_turn.as_str(),
            row.sealed
        ),
        ("claude-code", "local", 2, "t2 finished", false),
        "{stdout}"
    );
    let (out, stdout, _) = run(harness(home.path()).args(["sessions", "export", &session]));
    assert!(out.status.success());
    let frames: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(
        row.frames,
        frames.len() as u64,
        "FRAMES is the export's length"
    );
    let seqs: Vec<u64> = frames.iter().map(|f| f["seq"].as_u64().unwrap()).collect();
    assert_eq!(
        seqs,
        (1..=seqs.len() as u64).collect::<Vec<_>>(),
        "gap-free"
    );
    let texts: Vec<&str> = frames
        .iter()
        .filter(|f| f["body"]["type"] == "message")
        .filter_map(|f| f["body"]["text"].as_str())
        .collect();
    assert_eq!(
        texts,
        vec!["first answer", "second answer"],
        "each text stored once"
    );
    let (out, stdout, stderr) = run(harness(home.path()).args([
        "sessions", "fork", &session, "--until", "2", "--seal", "--target", "forked",
    ]));
    assert!(out.status.success(), "{stderr}");
    let info: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(
        (info["last_seq"].as_u64(), info["sealed"].as_bool()),
        (Some(4), Some(true)),
        "2 frames, the frame closing the turn they cut, the seal: {info}"
    );
    let (out, _, stderr) =
        run(harness(home.path()).args(["sessions", "fork", &session, "--until", "9999"]));
    assert!(!out.status.success());
    assert!(stderr.contains("cannot fork"), "{stderr}");

    session_as_markdown(home.path(), &session);
    retention_of_a_fork(home.path());
    // Last but one: it edits the database behind the harness's back.
    audit_chain_of_a_real_session(home.path(), &session, row.frames);
    // Last: the session goes, with the sandbox it owns.
    let (out, stdout, stderr) = run(harness(home.path()).args(["sessions", "delete", &session]));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("removed its local sandbox"), "{stdout}");
    let (_, stdout, _) = run(harness(home.path()).args(["sessions", "list"]));
    assert!(!stdout.contains(&session), "{stdout}");
    let (out, _, stderr) = run(harness(home.path()).args(["sessions", "delete", &session]));
    assert!(
        !out.status.success() && stderr.contains("unknown session"),
        "{stderr}"
    );
}

/// `sessions trim` and `sessions delete` (docs/retention.md) on the sealed
/// fork made above (4 frames): trimmed through 2, it exports frames 3 and
/// 4 and still verifies; a cut that leaves nothing is refused; deleted, it
/// is gone from the list.
fn retention_of_a_fork(home: &Path) {
    let (out, stdout, stderr) =
        run(harness(home).args(["sessions", "trim", "forked", "--through", "4"]));
    assert!(!out.status.success(), "{stdout}");
    assert!(stderr.contains("keeps at least the newest"), "{stderr}");
    let (out, stdout, stderr) =
        run(harness(home).args(["sessions", "trim", "forked", "--through", "2"]));
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("holds frames 3..=4"), "{stdout}");
    let (out, stdout, _) = run(harness(home).args(["sessions", "export", "forked"]));
    assert!(out.status.success());
    let seqs: Vec<u64> = stdout
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["seq"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert_eq!(seqs, [3, 4], "export starts at the cut");
    let (out, stdout, stderr) = run(harness(home).args(["sessions", "verify", "forked"]));
    assert!(
        out.status.success(),
        "the kept frames verify: {stdout}{stderr}"
    );
    let (out, stdout, stderr) = run(harness(home).args(["sessions", "delete", "forked"]));
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("deleted session forked"), "{stdout}");
    let (_, stdout, _) = run(harness(home).args(["sessions", "list"]));
    assert!(!stdout.contains("forked"), "{stdout}");
}

/// `sessions export --format markdown`: both turns in order, each prompt
/// under the user's heading and each answer under the assistant's.
fn session_as_markdown(home: &Path, session: &str) {
    let (out, md, stderr) =
        run(harness(home).args(["sessions", "export", session, "--format", "markdown"]));
    assert!(out.status.success(), "{stderr}");
    let at = |needle: &str| {
        md.find(needle)
            .unwrap_or_else(|| panic!("{needle:?} is not in the document:\n{md}"))
    };
    let order = [
        at(&format!("# Session {session}\n")),
        at("## User (t1)\n\nfirst question"),
        at("## Assistant (t1, finished)"),
        at("first answer"),
        at("## User (t2)\n\nsecond question"),
        at("## Assistant (t2, finished)"),
        at("second answer"),
    ];
    assert!(order.windows(2).all(|w| w[0] < w[1]), "{order:?}\n{md}");
    let (out, _, stderr) =
        run(harness(home).args(["sessions", "export", session, "--format", "pdf"]));
    assert!(!out.status.success());
    assert!(
        stderr.contains("markdown"),
        "the error names the formats: {stderr}"
    );
}

/// `sessions verify` and `export --chain` on a session real turns wrote,
/// then on the same session after its database was edited behind the
/// harness's back.
fn audit_chain_of_a_real_session(home: &Path, session: &str, frames: u64) {
    use std::os::unix::fs::PermissionsExt;
    let key = home.join("audit.key");
    let mode = std::fs::metadata(&key).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "the audit key is the owner's alone");
    let (out, stdout, stderr) = run(harness(home).args(["sessions", "verify", session]));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.contains(&format!("audit chain intact over {frames} frames")),
        "{stdout}"
    );
    let head = stdout
        .split_whitespace()
        .skip_while(|w| *w != "head")
        .nth(1)
        .expect("verify prints the head")
        .to_string();
    let (out, stdout, _) = run(harness(home).args(["sessions", "export", session, "--chain"]));
    assert!(out.status.success());
    let chained: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(chained.len() as u64, frames);
    assert_eq!(
        chained.last().unwrap()["hash"].as_str(),
        Some(head.as_str()),
        "the export carries the chain; its last hash is the head"
    );
    let (out, _, stderr) =
        run(harness(home).args(["sessions", "verify", session, "--head", &head]));
    assert!(out.status.success(), "{stderr}");
    let (out, _, stderr) =
        run(harness(home).args(["sessions", "verify", session, "--head", &"ab".repeat(32)]));
    assert!(!out.status.success());
    assert!(stderr.contains("not the head"), "{stderr}");
    let (out, _, stderr) = run(harness(home).args(["sessions", "verify", "nobody"]));
    assert!(!out.status.success());
    assert!(stderr.contains("unknown session"), "{stderr}");

    // Someone with the database file rewrites what the agent answered.
    let db = rusqlite::Connection::open(home.join("harness.db")).unwrap();
    let seq: i64 = db
        .query_row(
            "SELECT seq FROM frames WHERE session = ?1 AND body LIKE '%first answer%' \
             ORDER BY seq LIMIT 1",
            [session],
            |r| r.get(0),
        )
        .unwrap();
    db.execute(
        "UPDATE frames SET body = replace(body, 'first answer', 'other answer') \
         WHERE session = ?1 AND seq = ?2",
        rusqlite::params![session, seq],
    )
    .unwrap();
    let (out, _, stderr) = run(harness(home).args(["sessions", "verify", session]));
    assert!(!out.status.success(), "an edited log must not verify");
    assert!(
        stderr.contains(&format!("frame {seq} does not match its hash")),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn serve_answers_with_auth() {
    let home = tempfile::tempdir().unwrap();
    let token = "cli-test-token-0123456789";
    let mut child = harness(home.path())
        .args([
            "serve",
            "--addr",
            "127.0.0.1:0",
            "--token",
            &format!("{token}=host"),
        ])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    // Notes (an agent or Docker this machine lacks) may come first. The
    // reader keeps draining after the address: a closed pipe would make
    // the server's next line of output fail.
    let (found, address) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        let mut seen = String::new();
        for line in std::io::BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            if line.contains("http://") {
                let _ = found.send(Ok(line));
            } else {
                seen.push_str(&line);
                seen.push('\n');
            }
        }
        let _ = found.send(Err(seen));
    });
    let line = match address.recv_timeout(Duration::from_secs(60)) {
        Ok(Ok(line)) => line,
        Ok(Err(seen)) => panic!("serve exited before printing its address:\n{seen}"),
        Err(e) => panic!("serve printed no address in 60 s: {e}"),
    };
    let url = line
        .split_whitespace()
        .find(|w| w.starts_with("http://"))
        .expect("serve prints its address")
        .to_string();
    let client = reqwest::Client::new();
    let denied = client
        .get(format!("{url}/v1/sessions"))
        .send()
        .await
        .unwrap();
    assert_eq!(denied.status(), 401);
    let created = client
        .post(format!("{url}/v1/sessions"))
        .bearer_auth(token)
        .json(&serde_json::json!({"id": "served"}))
        .send()
        .await
        .unwrap();
    assert!(created.status().is_success(), "{}", created.status());
    let listed: serde_json::Value = client
        .get(format!("{url}/v1/sessions"))
        .bearer_auth(token)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(listed.to_string().contains("served"), "{listed}");
    child.kill().unwrap();
    let _ = child.wait();
    // Refuses to start without any auth configured.
    let (out, _, stderr) = run(harness(home.path()).args(["serve", "--addr", "127.0.0.1:0"]));
    assert!(!out.status.success());
    assert!(stderr.contains("no tokens"), "{stderr}");
}

#[test]
#[cfg_attr(
    not(feature = "s3"),
    ignore = "needs the `s3` feature (cargo test -p harness-cli --features s3; CI builds --features full)"
)]
fn checkpoint_ls_and_restore_move_a_tree_between_sessions() {
    if !have_agent("HARNESS_CLAUDE_BIN") {
        return;
    }
    let Some(endpoint) = require_env("HARNESS_S3_ENDPOINT") else {
        return;
    };
    let home = tempfile::tempdir().unwrap();
    move_a_tree_between_sessions(
        home.path(),
        &common::s3_store_flags(&endpoint, "cli-move"),
        // Another namespace of the same bucket.
        &common::s3_store_flags(&endpoint, "cli-elsewhere"),
    );
}

/// The same through the default store, the home's `checkpoints/`
/// directory (no flags), and no S3 server.
#[test]
fn checkpoint_ls_and_restore_through_the_home_directory_store() {
    if !have_agent("HARNESS_CLAUDE_BIN") {
        return;
    }
    let home = tempfile::tempdir().unwrap();
    let elsewhere = home.path().join("elsewhere");
    let elsewhere = ["--dir".to_string(), elsewhere.display().to_string()];
    move_a_tree_between_sessions(home.path(), &[], &elsewhere);
    let stored = home.path().join("checkpoints");
    assert!(
        stored.join("sessions").is_dir(),
        "nothing under {}",
        stored.display()
    );
}

/// Two kept demo sessions; a file made in the first one's tree is
/// checkpointed into `store` (the store flags; none: the home's
/// directory), listed there and not in `elsewhere`, and restored into the
/// second one's tree, over what it has.
fn move_a_tree_between_sessions(home: &Path, store: &[String], elsewhere: &[String]) {
    // The store is what the flags name, never one from the environment.
    let harness = |home: &Path| {
        let mut cmd = harness(home);
        cmd.env_remove("HARNESS_S3_ENDPOINT")
            .env_remove("HARNESS_R2_ACCOUNT_ID")
            .env_remove("HARNESS_CHECKPOINT_DIR");
        cmd
    };
    // Two kept demo sessions: the first one's tree has hello.txt.
    let (out, stdout, stderr) = run(harness(home).args(["demo", "--keep"]));
    if !out.status.success() {
        skip_or_fail(&format!(
            "demo failed, cannot test moves:\n{stdout}\n{stderr}"
        ));
        return;
    }
    let id = |stdout: &str| {
        stdout
            .split_whitespace()
            .skip_while(|w| *w != "kept")
            .nth(2)
            .expect("demo --keep names the session")
            .to_string()
    };
    let a = id(&stdout);
    // A session's sandbox is what its turn recorded in the log (the latest
    // turn-status frame's handle): a local directory under the home's
    // sandboxes, its tree at work/.
    let workdir = |s: &str| {
        let (out, stdout, stderr) = run(harness(home).args(["sessions", "export", s]));
        assert!(out.status.success(), "{stderr}");
        let handle = stdout
            .lines()
            .rev()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .filter(|f| f["body"]["type"] == "turn-status")
            .find_map(|f| (!f["body"]["sandbox"].is_null()).then(|| f["body"]["sandbox"].clone()))
            .unwrap_or_else(|| panic!("session {s} recorded no sandbox:\n{stdout}"));
        assert_eq!(handle["provider"], "local", "{handle:#}");
        let dir = home
            .join("sandboxes")
            .join(handle["id"].as_str().unwrap())
            .join("work");
        assert_eq!(
            handle["workdir"].as_str().map(Path::new),
            Some(dir.as_path()),
            "{handle:#}"
        );
        dir
    };
    std::fs::write(workdir(&a).join("moved.txt"), "made in A").unwrap();
    let key = format!("sessions/{a}/cli.tar.zst");
    let (out, stdout, stderr) = run(harness(home)
        .args(["checkpoint", "--session", &a, "--key", &key])
        .args(store));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    // The key printed names the lineage on an encrypted store (S3 by
    // default), and is the key given on a directory store.
    let printed = stdout
        .split_whitespace()
        .nth(1)
        .map(|k| k.trim_end_matches(':').to_string())
        .unwrap_or_default();
    let encrypted = store.iter().any(|f| f == "--endpoint");
    let expected = if encrypted {
        format!("lineages/{a}/{key}")
    } else {
        key.clone()
    };
    assert_eq!(printed, expected, "{stdout}");
    let key = printed;
    let (out, stdout, _) = run(harness(home).arg("ls").args(store));
    assert!(out.status.success());
    assert!(stdout.contains(&key), "{stdout}");
    // Another store does not see it.
    let (out, stdout, _) = run(harness(home).arg("ls").args(elsewhere));
    assert!(out.status.success());
    assert!(!stdout.contains(&key), "{stdout}");

    let (out, stdout, stderr) = run(harness(home).args(["demo", "--keep"]));
    assert!(out.status.success(), "{stderr}");
    let b = id(&stdout);
    assert_ne!(a, b);
    std::fs::write(workdir(&b).join("only-in-b.txt"), "stays").unwrap();
    let (out, stdout, stderr) = run(harness(home)
        .args(["restore", "--session", &b, "--key", &key])
        .args(store));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert_eq!(
        std::fs::read_to_string(workdir(&b).join("moved.txt")).unwrap(),
        "made in A"
    );
    assert_eq!(
        std::fs::read_to_string(workdir(&b).join("only-in-b.txt")).unwrap(),
        "stays",
        "restore overlays"
    );
}
