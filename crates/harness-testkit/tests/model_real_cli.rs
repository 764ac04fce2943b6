//! The real `claude` and `codex` binaries against the scripted model servers:
//! one tool-using turn (a shell command that writes a file) and a resumed
//! second turn whose request must carry the first.
//!
//! Runs only when `HARNESS_CLAUDE_BIN` / `HARNESS_CODEX_BIN` name the native
//! executables (e.g. `node_modules/@anthropic-ai/claude-code-linux-x64/claude`,
//! `node_modules/@openai/codex-linux-x64/vendor/x86_64-unknown-linux-musl/bin/codex`);
//! otherwise each test prints "skipped: ..." and passes, unless
//! `HARNESS_REQUIRE_REAL=1`, which makes a missing binary a failure.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use harness_testkit::model::*;
use serde_json::Value;

const RUN_TIMEOUT: Duration = Duration::from_secs(180);
const FIRST_PROMPT: &str = "make hi.txt";
const FIRST_ANSWER: &str = "Done: the file says hello.";
const SECOND_PROMPT: &str = "now the second question";
const SECOND_ANSWER: &str = "Second turn answer.";

fn real_bin(var: &str) -> Option<PathBuf> {
    let p = PathBuf::from(harness_testkit::require_env(var)?);
    assert!(p.is_file(), "{var}={} is not a file", p.display());
    Some(p)
}

/// The script both CLIs run: turn 1 calls the shell, then answers; turn 2
/// (recognised by its prompt, not by a counter) asserts it carries turn 1.
fn script() -> Script {
    Script::new()
        .rule(
            Rule::new(
                last_is_tool_result_for(BASH_CALL_ID),
                Reply::text(FIRST_ANSWER),
            )
            .named("tool result -> answer")
            .assert_tool_result_contains(BASH_CALL_ID, "hello"),
        )
        .rule(
            Rule::new(
                last_user_text_contains(SECOND_PROMPT),
                Reply::text_chunks(["Second ", "turn ", "answer."]).with_delay(20),
            )
            .named("second turn")
            .assert_user_texts_contain(FIRST_PROMPT)
            .assert_assistant_texts_contain(FIRST_ANSWER)
            .assert_tool_result_contains(BASH_CALL_ID, "hello"),
        )
        .rule(
            Rule::new(
                last_user_text_contains(FIRST_PROMPT),
                Reply::text("I will create the file.").then_tool(ToolCall::shell(
                    BASH_CALL_ID,
                    "echo hello > hi.txt && cat hi.txt",
                )),
            )
            .named("prompt -> shell"),
        )
}

struct Run {
    lines: Vec<Value>,
    stderr: String,
}

async fn run(bin: &Path, args: &[String], env: &[(String, String)], cwd: &Path) -> Run {
    let mut cmd = tokio::process::Command::new(bin);
    cmd.args(args)
        .current_dir(cwd)
        .env_clear()
        .env(
            "PATH",
            std::env::var_os("PATH").unwrap_or_else(|| "/usr/bin:/bin".into()),
        )
        .env("LANG", "C.UTF-8")
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let out = tokio::time::timeout(RUN_TIMEOUT, cmd.output())
        .await
        .unwrap_or_else(|_| panic!("{} timed out after {RUN_TIMEOUT:?}", bin.display()))
        .expect("spawn");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "{} {args:?} failed: {}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        bin.display(),
        out.status
    );
    let lines = stdout
        .lines()
        .filter(|l| l.trim_start().starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad JSON line {l:?}: {e}")))
        .collect();
    Run { lines, stderr }
}

fn dump(server: &ScriptedModel, run: &Run) -> String {
    let reqs: Vec<String> = server
        .requests()
        .iter()
        .map(|r| {
            format!(
                "{} {} rule={:?} failures={:?}",
                r.method, r.path, r.rule, r.failures
            )
        })
        .collect();
    format!(
        "requests: {reqs:#?}\nfailures: {:#?}\nlines: {:#?}\nstderr: {}",
        server.failures(),
        run.lines,
        run.stderr
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_code_tool_turn_and_resume() {
    let Some(bin) = real_bin("HARNESS_CLAUDE_BIN") else {
        return;
    };
    let server = ScriptedModel::anthropic(script()).await.unwrap();
    let home = tempfile::tempdir().unwrap();
    let work = tempfile::tempdir().unwrap();
    let mut env = server.claude_env();
    env.push(("HOME".into(), home.path().display().to_string()));
    env.push(("IS_SANDBOX".into(), "1".into()));
    let common = [
        "--output-format",
        "stream-json",
        "--verbose",
        "--include-partial-messages",
        "--permission-mode",
        "bypassPermissions",
    ]
    .map(String::from);

    // Turn 1: a Bash round trip.
    let mut args = vec!["-p".to_string(), FIRST_PROMPT.to_string()];
    args.extend(common.iter().cloned());
    let r1 = run(&bin, &args, &env, work.path()).await;
    let ctx = dump(&server, &r1);
    server.assert_no_failures();
    assert_eq!(
        std::fs::read_to_string(work.path().join("hi.txt"))
            .ok()
            .as_deref(),
        Some("hello\n"),
        "{ctx}"
    );
    let init = &r1.lines[0];
    assert_eq!(
        (init["type"].as_str(), init["subtype"].as_str()),
        (Some("system"), Some("init")),
        "{ctx}"
    );
    let session_id = init["session_id"].as_str().expect("session_id").to_string();
    let last = r1.lines.last().unwrap();
    assert_eq!(last["type"], "result", "{ctx}");
    assert_eq!(last["subtype"], "success", "{ctx}");
    assert_eq!(last["is_error"], false, "{ctx}");
    assert_eq!(last["result"], FIRST_ANSWER, "{ctx}");
    assert_eq!(last["session_id"], session_id.as_str(), "{ctx}");
    // --include-partial-messages forwards our SSE deltas.
    assert!(
        r1.lines
            .iter()
            .any(|l| l["type"] == "stream_event" && l["event"]["delta"]["type"] == "text_delta"),
        "{ctx}"
    );
    assert!(
        r1.lines
            .iter()
            .any(|l| l["type"] == "user"
                && l["message"]["content"][0]["tool_use_id"] == BASH_CALL_ID),
        "{ctx}"
    );
    let reqs = server.model_requests();
    assert_eq!(reqs.len(), 2, "{ctx}");
    assert!(reqs[1].last_is_tool_result_for(BASH_CALL_ID), "{ctx}");
    assert!(reqs.iter().all(|r| r.stream()), "{ctx}");
    let recorded = server.requests();
    assert!(
        recorded
            .iter()
            .any(|r| r.header("x-api-key") == Some("test")),
        "{ctx}"
    );

    // Turn 2: resume; the request carries turn 1.
    let mut args = vec![
        "-p".to_string(),
        SECOND_PROMPT.to_string(),
        "--resume".to_string(),
        session_id.clone(),
    ];
    args.extend(common.iter().cloned());
    let r2 = run(&bin, &args, &env, work.path()).await;
    let ctx = dump(&server, &r2);
    server.assert_no_failures();
    let last = r2.lines.last().unwrap();
    assert_eq!(last["subtype"], "success", "{ctx}");
    assert_eq!(last["result"], SECOND_ANSWER, "{ctx}");
    assert_eq!(last["session_id"], session_id.as_str(), "{ctx}");
    let reqs = server.model_requests();
    assert_eq!(reqs.len(), 3, "{ctx}");
    let third = &reqs[2];
    assert!(
        third.user_texts().iter().any(|t| t.contains(FIRST_PROMPT)),
        "{ctx}"
    );
    assert!(
        third
            .assistant_texts()
            .iter()
            .any(|t| t.contains(FIRST_ANSWER)),
        "{ctx}"
    );
    assert!(third.tool_result(BASH_CALL_ID).is_some(), "{ctx}");
    assert_eq!(
        third.last_user_text().as_deref(),
        Some(SECOND_PROMPT),
        "{ctx}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codex_tool_turn_and_resume() {
    let Some(bin) = real_bin("HARNESS_CODEX_BIN") else {
        return;
    };
    let server = ScriptedModel::openai(script()).await.unwrap();
    let home = tempfile::tempdir().unwrap();
    let codex_home = tempfile::tempdir().unwrap(); // must exist before the run
    let work = tempfile::tempdir().unwrap();
    let mut env = server.codex_env();
    env.push(("HOME".into(), home.path().display().to_string()));
    env.push(("CODEX_HOME".into(), codex_home.path().display().to_string()));
    let mut common: Vec<String> = [
        "--json",
        "--skip-git-repo-check",
        "--dangerously-bypass-approvals-and-sandbox",
    ]
    .map(String::from)
    .to_vec();
    common.extend(server.codex_config_args("gpt-test"));

    // Turn 1: an exec_command round trip.
    let mut args = vec!["exec".to_string()];
    args.extend(common.iter().cloned());
    args.push(FIRST_PROMPT.to_string());
    let r1 = run(&bin, &args, &env, work.path()).await;
    let ctx = dump(&server, &r1);
    server.assert_no_failures();
    assert_eq!(
        std::fs::read_to_string(work.path().join("hi.txt"))
            .ok()
            .as_deref(),
        Some("hello\n"),
        "{ctx}"
    );
    assert_eq!(r1.lines[0]["type"], "thread.started", "{ctx}");
    let thread_id = r1.lines[0]["thread_id"]
        .as_str()
        .expect("thread_id")
        .to_string();
    let completed = |lines: &[Value], ty: &str| -> Vec<Value> {
        lines
            .iter()
            .filter(|l| l["type"] == "item.completed" && l["item"]["type"] == ty)
            .map(|l| l["item"].clone())
            .collect()
    };
    let cmds = completed(&r1.lines, "command_execution");
    assert_eq!(cmds.len(), 1, "{ctx}");
    assert_eq!(cmds[0]["exit_code"], 0, "{ctx}");
    assert!(
        cmds[0]["command"]
            .as_str()
            .unwrap()
            .contains("echo hello > hi.txt"),
        "{ctx}"
    );
    let msgs = completed(&r1.lines, "agent_message");
    assert_eq!(msgs.last().unwrap()["text"], FIRST_ANSWER, "{ctx}");
    assert_eq!(r1.lines.last().unwrap()["type"], "turn.completed", "{ctx}");
    let reqs = server.model_requests();
    assert_eq!(reqs.len(), 2, "{ctx}");
    assert!(reqs[1].last_is_tool_result_for(BASH_CALL_ID), "{ctx}");
    let recorded = server.requests();
    assert!(recorded.iter().all(|r| r.path == "/v1/responses"), "{ctx}");
    assert!(
        recorded
            .iter()
            .all(|r| r.header("authorization") == Some("Bearer test")),
        "{ctx}"
    );

    // Turn 2: `exec resume <thread_id>`; the request carries turn 1.
    let mut args = vec!["exec".to_string()];
    args.extend(common.iter().cloned());
    args.extend([
        "resume".to_string(),
        thread_id.clone(),
        SECOND_PROMPT.to_string(),
    ]);
    let r2 = run(&bin, &args, &env, work.path()).await;
    let ctx = dump(&server, &r2);
    server.assert_no_failures();
    assert_eq!(r2.lines[0]["thread_id"], thread_id.as_str(), "{ctx}");
    let msgs = completed(&r2.lines, "agent_message");
    assert_eq!(msgs.last().unwrap()["text"], SECOND_ANSWER, "{ctx}");
    assert_eq!(r2.lines.last().unwrap()["type"], "turn.completed", "{ctx}");
    let reqs = server.model_requests();
    assert_eq!(reqs.len(), 3, "{ctx}");
    let third = &reqs[2];
    assert!(
        third.user_texts().iter().any(|t| t.contains(FIRST_PROMPT)),
        "{ctx}"
    );
    assert!(
        third
            .assistant_texts()
            .iter()
            .any(|t| t.contains(FIRST_ANSWER)),
        "{ctx}"
    );
    assert!(third.tool_result(BASH_CALL_ID).is_some(), "{ctx}");
    assert_eq!(
        third.last_user_text().as_deref(),
        Some(SECOND_PROMPT),
        "{ctx}"
    );
}
