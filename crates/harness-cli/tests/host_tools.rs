//! Host tools end to end: `harness serve` runs the real agent against the
//! scripted model; `harness relay-host` (a second process, outside the
//! sandbox) offers a command tool; the model calls `mcp__host__lookup`,
//! the command runs on the host (its side effect is a file the test
//! reads), and the agent answers with the result. Also: the tool host
//! killed with SIGKILL mid-call (→ `ambiguous`, never run again), and the
//! runner killed and resumed mid-call (→ the recorded outcome, the tool
//! ran once).

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use harness_testkit::model::{
    any, last_is_tool_result_for, matcher_fn, Reply, Rule, Script, ScriptedModel, ToolCall,
};
use serde_json::{json, Value};

use common::follow::Seen;
use common::server::*;

const CALL: &str = "toolu_host_1";
const TOOL: &str = "mcp__host__lookup";
const TURN_TIMEOUT: Duration = Duration::from_secs(120);

#[derive(Debug, Clone, Copy)]
enum Agent {
    Claude,
    Codex,
}

impl Agent {
    fn name(self) -> &'static str {
        match self {
            Agent::Claude => "claude-code",
            Agent::Codex => "codex",
        }
    }

    fn available(self) -> bool {
        let var = match self {
            Agent::Claude => "HARNESS_CLAUDE_BIN",
            Agent::Codex => "HARNESS_CODEX_BIN",
        };
        harness_testkit::require_env(var).is_some()
    }
}

/// The model's script: call the host tool (checking the agent was given
/// it), then answer with what the tool returned.
fn script(result_contains: &str, answer: &str) -> Script {
    Script::new()
        .rule(
            Rule::new(last_is_tool_result_for(CALL), Reply::text(answer))
                .assert_tool_result_contains(CALL, result_contains),
        )
        .rule(Rule::new(
            matcher_fn(|req| req.api == harness_testkit::model::Api::Anthropic && !offers_host_tool(&req.body)),
            Reply::text("the agent was not given mcp__host__lookup"),
        ))
        .on(
            any(),
            // Codex (0.171) offers MCP tools inside its code mode: the model
            // calls the `exec` tool with JavaScript that calls them.
            Reply::tool(ToolCall::custom_on_openai(
                CALL,
                (TOOL, json!({"q": "4711"})),
                (
                    "exec",
                    "const r = await tools.mcp__host__lookup({q: \"4711\"});\ntext(JSON.stringify(r));",
                ),
            )),
        )
}

/// Whether a model request lists the host tool (Anthropic `tools[].name`,
/// OpenAI `tools[].name` or a namespace's tools).
fn offers_host_tool(body: &Value) -> bool {
    body.to_string().contains("lookup")
}

/// A tools file whose `lookup` runs `script` with `sh -c` in `dir`.
fn tools_file(dir: &Path, script: &str) -> std::path::PathBuf {
    let path = dir.join("tools.toml");
    let toml = format!(
        "[[tool]]\nname = \"lookup\"\ndescription = \"Look up an order on the host\"\ncommand = [\"sh\", \"-c\", {script:?}]\ninput_schema = {{ type = \"object\", properties = {{ q = {{ type = \"string\" }} }}, required = [\"q\"] }}\n"
    );
    std::fs::write(&path, toml).unwrap();
    path
}

/// The session's frames once its turn `turn` ended (bounded wait).
async fn until_end(serve: &Serve, id: &str, turn: &str) -> Vec<Value> {
    let started = Instant::now();
    loop {
        let seen = Seen {
            frames: export(serve, id).await,
            live: Vec::new(),
        };
        if seen.end(turn).is_some() {
            return seen.frames;
        }
        assert!(
            started.elapsed() < TURN_TIMEOUT,
            "turn {turn} did not end; frames:\n{:#?}\nserver log:\n{}",
            seen.frames,
            serve.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn of_type<'a>(frames: &'a [Value], kind: &str) -> Vec<&'a Value> {
    frames
        .iter()
        .map(|f| &f["body"])
        .filter(|b| b["type"] == kind)
        .collect()
}

fn status(frames: &[Value], turn: &str) -> String {
    frames
        .iter()
        .rev()
        .map(|f| &f["body"])
        .find(|b| b["type"] == "turn-status" && b["turnId"] == turn)
        .map(|b| format!("{} {}", b["status"], b["error"]))
        .unwrap_or_default()
}

fn answer_text(frames: &[Value]) -> String {
    frames
        .iter()
        .map(|f| &f["body"])
        .filter(|b| b["type"] == "message" && b["kind"] == "text")
        .map(|b| b["text"].as_str().unwrap_or("").to_string())
        .collect::<Vec<_>>()
        .join("")
}

async fn model_for(docker: bool, script: Script) -> Option<(ScriptedModel, Option<String>)> {
    if docker {
        let (image, gateway) = docker_parts().await?;
        let model = ScriptedModel::start_on(SocketAddr::new(gateway, 0), script)
            .await
            .unwrap();
        Some((model, Some(image)))
    } else {
        Some((ScriptedModel::start(script).await.unwrap(), None))
    }
}

async fn a_host_tool_runs_on_the_host(agent: Agent, docker: bool) {
    if !agent.available() {
        return;
    }
    let Some((model, image)) = model_for(
        docker,
        script("ORDER-4711 shipped", "The host says ORDER-4711 shipped."),
    )
    .await
    else {
        return;
    };
    let home = tempfile::tempdir().unwrap();
    let host_dir = tempfile::tempdir().unwrap();
    // The side effect is on the host: a file the sandbox cannot see.
    let tools = tools_file(
        host_dir.path(),
        "input=$(cat); echo \"$input\" >> calls.log; echo \"ORDER-4711 shipped (asked: $input)\"",
    );
    let serve = Serve::start(home.path(), &model, &[]);
    let mut body =
        json!({"agent": agent.name(), "sandbox": if docker { "docker" } else { "local" }});
    if let Some(image) = &image {
        body["image"] = json!(image);
    }
    let id = create(&serve, body).await;
    let _containers = common::docker::SessionContainers(id.clone());
    let _host = RelayHost::start(&serve, &id, &tools, &[]);
    let turn = prompt(&serve, &id, "look up order 4711 with the host tool").await;
    let frames = until_end(&serve, &id, &turn).await;
    assert!(
        status(&frames, &turn).starts_with("\"finished\""),
        "{}\n{frames:#?}\nserver log:\n{}",
        status(&frames, &turn),
        serve.log()
    );
    model.assert_no_failures();
    let calls = std::fs::read_to_string(host_dir.path().join("calls.log")).unwrap_or_default();
    assert_eq!(
        calls.lines().count(),
        1,
        "the tool ran once, on the host: {calls:?}"
    );
    assert!(
        calls.contains("4711"),
        "it got the model's arguments: {calls:?}"
    );
    let outcomes = of_type(&frames, "host-outcome");
    assert_eq!(outcomes.len(), 1, "{frames:#?}");
    assert_eq!(outcomes[0]["outcome"], "completed", "{:#}", outcomes[0]);
    assert!(outcomes[0]["output"]
        .as_str()
        .unwrap()
        .contains("ORDER-4711 shipped"));
    assert_eq!(of_type(&frames, "host-call").len(), 1);
    assert!(
        answer_text(&frames).contains("ORDER-4711 shipped"),
        "the agent answered with the result: {}",
        answer_text(&frames)
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn claude_local_calls_a_host_tool() {
    a_host_tool_runs_on_the_host(Agent::Claude, false).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn claude_docker_calls_a_host_tool() {
    a_host_tool_runs_on_the_host(Agent::Claude, true).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn codex_local_calls_a_host_tool() {
    a_host_tool_runs_on_the_host(Agent::Codex, false).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn codex_docker_calls_a_host_tool() {
    a_host_tool_runs_on_the_host(Agent::Codex, true).await;
}

/// Wait (bounded) until `path` has a line.
async fn until_started(path: &Path, what: &str, log: impl Fn() -> String) {
    let started = Instant::now();
    while std::fs::read_to_string(path).map_or(true, |s| s.is_empty()) {
        assert!(
            started.elapsed() < TURN_TIMEOUT,
            "{what} never started; log:\n{}",
            log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The tool host SIGKILLed while its tool runs: the call ends `ambiguous`,
/// the agent is told it may or may not have run, and it never runs again.
#[tokio::test(flavor = "multi_thread")]
async fn a_tool_host_killed_mid_call_leaves_ambiguous_and_never_reruns() {
    if !Agent::Claude.available() {
        return;
    }
    let model = ScriptedModel::start(script("may or may not have run", "The outcome is unknown."))
        .await
        .unwrap();
    let home = tempfile::tempdir().unwrap();
    let host_dir = tempfile::tempdir().unwrap();
    let tools = tools_file(
        host_dir.path(),
        "echo started >> calls.log; sleep 30; echo finished",
    );
    let serve = Serve::start(home.path(), &model, &[]);
    let id = create(&serve, json!({"agent": "claude-code", "sandbox": "local"})).await;
    let mut host = RelayHost::start(&serve, &id, &tools, &[]);
    let turn = prompt(&serve, &id, "look up order 4711").await;
    let calls = host_dir.path().join("calls.log");
    until_started(&calls, "the host tool", || serve.log()).await;
    host.process.kill();
    let frames = until_end(&serve, &id, &turn).await;
    assert!(
        status(&frames, &turn).starts_with("\"finished\""),
        "{}",
        status(&frames, &turn)
    );
    model.assert_no_failures();
    let outcomes = of_type(&frames, "host-outcome");
    assert_eq!(outcomes.len(), 1, "{frames:#?}");
    assert_eq!(outcomes[0]["outcome"], "ambiguous", "{:#}", outcomes[0]);
    // The call is never sent again (a repeat is answered from the log:
    // crates/harness-core/tests/host_calls.rs); here, it ran once.
    let log = std::fs::read_to_string(&calls).unwrap();
    assert_eq!(log.lines().count(), 1, "the tool ran once: {log:?}");
}

/// The runner (`harness runner` of a `--engine remote` server) SIGKILLed
/// while a host tool runs: the host finishes, the session records the
/// outcome, and the restarted runner's slice gets that recorded outcome for
/// the same call id — the tool ran once and the agent answers with it.
#[tokio::test(flavor = "multi_thread")]
async fn a_runner_killed_mid_call_gets_the_recorded_outcome_after_restart() {
    if !Agent::Claude.available() {
        return;
    }
    let model = ScriptedModel::start(script(
        "ORDER-4711 shipped",
        "The host says ORDER-4711 shipped.",
    ))
    .await
    .unwrap();
    let home = tempfile::tempdir().unwrap();
    let runner_home = tempfile::tempdir().unwrap();
    let host_dir = tempfile::tempdir().unwrap();
    let tools = tools_file(
        host_dir.path(),
        "echo started >> calls.log; sleep 3; echo 'ORDER-4711 shipped'",
    );
    let serve = Serve::start(home.path(), &model, &["--engine", "remote"]);
    let mut runner = Worker::runner(runner_home.path(), &serve, &model);
    let id = create(&serve, json!({"agent": "claude-code", "sandbox": "local"})).await;
    let _host = RelayHost::start(&serve, &id, &tools, &[]);
    let turn = prompt(&serve, &id, "look up order 4711").await;
    let calls = host_dir.path().join("calls.log");
    until_started(&calls, "the host tool", || serve.log()).await;
    runner.kill();
    // The host finishes meanwhile; its outcome is stored with no runner.
    let started = Instant::now();
    while !export(&serve, &id)
        .await
        .iter()
        .any(|f| f["body"]["type"] == "host-outcome")
    {
        assert!(
            started.elapsed() < TURN_TIMEOUT,
            "no outcome:\n{}",
            serve.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _runner = Worker::runner(runner_home.path(), &serve, &model);
    let frames = until_end(&serve, &id, &turn).await;
    assert!(
        status(&frames, &turn).starts_with("\"finished\""),
        "{}\n{}",
        status(&frames, &turn),
        serve.log()
    );
    model.assert_no_failures();
    let log = std::fs::read_to_string(&calls).unwrap();
    assert_eq!(log.lines().count(), 1, "the tool ran once: {log:?}");
    let outcomes = of_type(&frames, "host-outcome");
    assert_eq!(outcomes.len(), 1, "{frames:#?}");
    assert_eq!(outcomes[0]["outcome"], "completed");
    assert!(answer_text(&frames).contains("ORDER-4711 shipped"));
}
