//! `useChat` talking to a session with no custom code (`docs/ai-sdk.md`,
//! "useChat"): the AI SDK's chat protocol on `harness serve` (`/v1/chat`),
//! driven by the real `ai` package and by the example app
//! (`examples/chat/`, React + `useChat`, built with vite) in a real
//! headless Chromium, against the built `harness` binary with the real
//! `claude` and `codex` and the scripted model.
//!
//! The example's dependencies are installed once per lockfile into
//! `$HARNESS_CACHE/npm/chat-example-<hash>` (npm registry); Node 22 runs
//! the build, `vite preview` and the Node script (`js/chat.mjs`).
//! Screenshots go to `$HARNESS_CACHE/screenshots/chat/`. Without Node 22,
//! npm, Chromium or an agent binary the tests skip with the reason, and
//! fail under `HARNESS_REQUIRE_REAL=1`.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::browser::*;
use common::npm::{node22, run};
use common::server::*;
use fantoccini::Locator;
use harness_testkit::model::{
    last_is_tool_result_for, last_user_text_contains, Reply, Rule, Script, ScriptedModel,
    BASH_CALL_ID,
};
use serde_json::{json, Value};

fn script() -> Script {
    Script::new()
        .rule(
            Rule::new(
                last_is_tool_result_for(BASH_CALL_ID),
                Reply::text_chunks(["The tool ", "ran."]).with_delay(300),
            )
            .assert_tool_result_contains(BASH_CALL_ID, "tool-ran"),
        )
        .on(
            last_user_text_contains("run the tool"),
            Reply::shell(BASH_CALL_ID, "echo tool-ran > tool.txt && cat tool.txt"),
        )
        .rule(
            Rule::new(
                last_user_text_contains("what did I ask first"),
                Reply::text("You first asked me to run the tool."),
            )
            .assert_user_texts_contain("run the tool"),
        )
        .on(
            last_user_text_contains("slow please"),
            Reply::text_chunks(["slowly ", "and ", "slower ", "still."]).with_delay(1500),
        )
}

fn example_dir() -> PathBuf {
    harness_testkit::checkout::path("examples/chat")
}

/// The example app copied from this checkout with the helper it imports
/// (`packages/ai-sdk/src/chat.ts`, at the same relative place), its
/// cached dependencies linked.
struct Example {
    root: tempfile::TempDir,
    node: PathBuf,
}

impl Example {
    fn prepare() -> Option<Example> {
        let node = node22()?;
        let modules = common::npm::node_modules(&example_dir(), "chat-example")?;
        let root = tempfile::tempdir().unwrap();
        let app = root.path().join("examples/chat");
        copy_tree(&example_dir(), &app);
        let helper = root.path().join("packages/ai-sdk/src");
        std::fs::create_dir_all(&helper).unwrap();
        std::fs::copy(
            example_dir().join("../../packages/ai-sdk/src/chat.ts"),
            helper.join("chat.ts"),
        )
        .unwrap();
        let _ = std::fs::remove_dir_all(app.join("node_modules"));
        std::os::unix::fs::symlink(&modules, app.join("node_modules")).unwrap();
        Some(Example { root, node })
    }

    fn app(&self) -> PathBuf {
        self.root.path().join("examples/chat")
    }

    /// `tsc --noEmit`, then `vite build` into `dist/`.
    fn build(&self) {
        let started = Instant::now();
        run(
            Command::new(&self.node)
                .args([
                    "node_modules/typescript/bin/tsc",
                    "--noEmit",
                    "-p",
                    "tsconfig.json",
                ])
                .current_dir(self.app()),
            "tsc (examples/chat)",
        );
        run(
            Command::new(&self.node)
                .args([
                    "node_modules/vite/bin/vite.js",
                    "build",
                    "--logLevel",
                    "warn",
                ])
                .current_dir(self.app()),
            "vite build (examples/chat)",
        );
        assert!(self.app().join("dist/index.html").is_file());
        println!("example built in {:.1} s", started.elapsed().as_secs_f64());
    }

    /// `vite preview` of the build, proxying `/v1` to `serve`.
    fn preview(&self, serve: &Serve) -> (KillOnDrop, String) {
        let port = free_port();
        let mut cmd = Command::new(&self.node);
        cmd.args(["node_modules/vite/bin/vite.js", "preview", "--strictPort"])
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .env("HARNESS_URL", &serve.base)
            .current_dir(self.app())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let child = KillOnDrop(cmd.spawn().expect("vite preview starts"));
        let url = format!("http://127.0.0.1:{port}");
        let started = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "vite preview did not listen"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        (child, url)
    }

    /// `js/chat.mjs` with `args`; its RESULT.
    async fn node_script(&self, args: Value) -> Value {
        let script = self.app().join("chat.mjs");
        std::fs::write(&script, include_str!("js/chat.mjs")).unwrap();
        let started = Instant::now();
        let child = tokio::process::Command::new(&self.node)
            .arg(&script)
            .arg(args.to_string())
            .current_dir(self.app())
            .kill_on_drop(true)
            .output();
        let out = tokio::time::timeout(Duration::from_secs(300), child)
            .await
            .expect("the chat script took over 5 minutes")
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        let result = stdout
            .lines()
            .find_map(|l| l.strip_prefix("RESULT "))
            .unwrap_or_else(|| {
                panic!(
                    "the chat script failed ({}):\n{stdout}\n{}",
                    out.status,
                    &stderr[stderr.len().saturating_sub(6000)..]
                )
            });
        println!("chat script: {:.1} s", started.elapsed().as_secs_f64());
        serde_json::from_str(result).unwrap()
    }
}

/// A child process killed (and reaped) when dropped.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let name = entry.file_name();
        if name == "node_modules" || name == "dist" {
            continue;
        }
        if entry.file_type().unwrap().is_dir() {
            copy_tree(&entry.path(), &to.join(&name));
        } else {
            std::fs::copy(entry.path(), to.join(&name)).unwrap();
        }
    }
}

/// The AI SDK's `Chat` with its default transport drives a session of
/// `agent`: prompts with a tool call and streamed text, a second prompt
/// continuing the conversation, a retried POST starting nothing, the
/// history equal to what the streams built; with Claude Code also a
/// dropped connection that leaves the turn running, `abortChat`, and an
/// approval answered with `addToolApprovalResponse`.
async fn the_ai_sdk_chat_drives(agent: Agent) {
    if !agent.available() {
        return;
    }
    let Some(example) = Example::prepare() else {
        return;
    };
    let model = ScriptedModel::start(script()).await.unwrap();
    let home = tempfile::tempdir().unwrap();
    let serve = Serve::start(home.path(), &model, &[]);
    let session = create(&serve, json!({"agent": agent.name()})).await;
    let approvals = create(&serve, json!({"agent": agent.name(), "approvals": true})).await;
    let r = example
        .node_script(json!({
            "base": serve.base,
            "client": CLIENT,
            "session": session,
            "approvalSession": approvals,
            "agent": agent.name(),
        }))
        .await;
    println!("{r}");
    assert_eq!(r["retryTurns"], 2, "{r}");
    if agent == Agent::Claude {
        // Codex reports its answer whole; Claude Code streams it.
        assert!(
            !r["partialTexts"].as_array().unwrap().is_empty(),
            "the answer streamed in before it was whole: {r}"
        );
        assert_eq!(r["approved"], true);
    }
    model.assert_no_failures();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ai_sdk_chat_drives_claude_code() {
    the_ai_sdk_chat_drives(Agent::Claude).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ai_sdk_chat_drives_codex() {
    the_ai_sdk_chat_drives(Agent::Codex).await;
}

/// The session's latest turn, as its meta tells it.
async fn session_turn(serve: &Serve, session: &str) -> Value {
    get_json(serve, &format!("/v1/sessions/{session}")).await["meta"]["turn"].clone()
}

/// The example app in Chromium: a prompt shows the tool call and the
/// answer; a reload mid-turn shows the turn finish with every part once;
/// Stop mid-turn kills the agent and the turn ends failed with the
/// reason; an approval clicked in the page runs the tool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_app_chats_with_a_session_in_chromium() {
    if !Agent::Claude.available() {
        return;
    }
    let Some(example) = Example::prepare() else {
        return;
    };
    let Some(b) = browser(1000, 900).await else {
        return;
    };
    example.build();
    let model = ScriptedModel::start(script()).await.unwrap();
    let home = tempfile::tempdir().unwrap();
    let serve = Serve::start(home.path(), &model, &[]);
    let (_preview, page) = example.preview(&serve);
    let session = create(&serve, json!({"agent": "claude-code"})).await;
    let c = &b.client;
    let open = |id: &str| format!("{page}/#session={id}&token={CLIENT}");

    // A prompt: the tool call with its output, then the answer.
    c.goto(&open(&session)).await.unwrap();
    type_into(c, "#prompt", "run the tool").await;
    click(c, "#send").await;
    let output = wait_text(
        &serve,
        c,
        ".tool[data-state=output-available] .output",
        "tool-ran",
    )
    .await;
    assert_eq!(output.trim(), "tool-ran");
    wait_text(&serve, c, ".message.assistant .turn-status", "finished").await;
    assert_eq!(
        text_of(c, ".message.assistant .text").await,
        "The tool ran."
    );
    assert_eq!(text_of(c, ".tool .tool-name").await, "Bash");
    screenshot_to(c, "chat", "tool-call").await;

    // A reload while the answer streams: the page loads the history and
    // resumes the running turn; it ends with each part once.
    type_into(c, "#prompt", "slow please").await;
    click(c, "#send").await;
    wait_text(&serve, c, "li[data-id=t2-assistant] .text", "slowly").await;
    c.refresh().await.unwrap();
    let turn = session_turn(&serve, &session).await;
    assert_eq!(
        (turn["turn_id"].as_str(), turn["status"].as_str()),
        (Some("t2"), Some("ready_for_next_step")),
        "the page reloaded while the turn ran"
    );
    wait_text(
        &serve,
        c,
        "li[data-id=t2-assistant] .turn-status",
        "finished",
    )
    .await;
    assert_eq!(
        text_of(c, "li[data-id=t2-assistant] .text").await,
        "slowly and slower still."
    );
    assert_eq!(count(c, "li[data-id=t2-assistant] .text").await, 1);
    assert_eq!(count(c, ".message.user").await, 2, "each prompt once");
    assert_eq!(count(c, ".message.assistant").await, 2);
    assert_eq!(count(c, ".tool").await, 1, "the tool call once");
    screenshot_to(c, "chat", "after-reload").await;

    // Stop mid-turn: the agent is killed, the turn ends failed.
    type_into(c, "#prompt", "slow please, once more").await;
    click(c, "#send").await;
    wait_text(&serve, c, "li[data-id=t3-assistant] .text", "slowly").await;
    assert!(
        !sandbox_processes(home.path()).is_empty(),
        "the agent runs in its sandbox"
    );
    click(c, "#stop").await;
    let status = wait_text(&serve, c, "li[data-id=t3-assistant] .turn-status", "failed").await;
    assert_eq!(status, "failed: aborted: stopped from the chat");
    let left = sandbox_processes(home.path());
    assert!(left.is_empty(), "processes left in the sandbox: {left:?}");
    let turn = session_turn(&serve, &session).await;
    assert_eq!(turn["status"], "failed");
    assert_eq!(turn["error"], "aborted: stopped from the chat");
    screenshot_to(c, "chat", "stopped").await;

    // An approval from the page: the tool runs after Approve.
    let asking = create(&serve, json!({"agent": "claude-code", "approvals": true})).await;
    c.goto(&open(&asking)).await.unwrap();
    c.refresh().await.unwrap();
    type_into(c, "#prompt", "run the tool").await;
    click(c, "#send").await;
    wait_text(
        &serve,
        c,
        ".tool[data-state=approval-requested] .tool-name",
        "Bash",
    )
    .await;
    screenshot_to(c, "chat", "approval").await;
    assert_eq!(
        count(c, ".tool .output").await,
        0,
        "nothing ran before the answer"
    );
    click(c, ".tool .approve").await;
    wait_text(
        &serve,
        c,
        ".tool[data-state=output-available] .output",
        "tool-ran",
    )
    .await;
    wait_text(&serve, c, ".message.assistant .turn-status", "finished").await;
    assert_eq!(
        text_of(c, ".message.assistant .text").await,
        "The tool ran."
    );
    assert!(
        c.find(Locator::Css(".tool .approve")).await.is_err(),
        "the buttons are gone once answered"
    );
    model.assert_no_failures();
}
