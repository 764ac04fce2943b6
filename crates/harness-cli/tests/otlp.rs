//! `harness --otlp URL run …` exports the turn's spans over OTLP/HTTP, and
//! they nest as `docs/operations.md` says: session → turn → slice →
//! agent start / agent launch / log append, each carrying the ids users
//! search by. The receiver is an OTLP/HTTP endpoint this test serves on
//! loopback; the agent is the real `claude` against the scripted model.

use std::process::{Command, Stdio};

use harness_testkit::model::{Script, ScriptedModel};
use harness_testkit::require_env;

#[path = "common/otlp.rs"]
mod otlp;
use otlp::Span;

/// The spans as an indented tree (children in arrival order), for the
/// test's output and the docs.
fn render(spans: &[Span], root: &Span, depth: usize, out: &mut String) {
    let keys = [
        "session.id",
        "turn.id",
        "command",
        "generation",
        "slice",
        "sandbox.id",
        "outcome",
        "part",
        "status",
        "what",
        "started",
    ];
    let fields: Vec<String> = keys
        .iter()
        .filter(|k| root.attributes.contains_key(**k))
        .map(|k| format!("{k}={}", root.attr(k)))
        .collect();
    out.push_str(&format!(
        "{}{} {}\n",
        "  ".repeat(depth),
        root.name,
        fields.join(" ")
    ));
    for child in spans.iter().filter(|s| s.parent == root.id) {
        render(spans, child, depth + 1, out);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_turns_spans_nest_and_carry_the_ids() {
    if require_env("HARNESS_CLAUDE_BIN").is_none() {
        return;
    }
    let (endpoint, received) = otlp::receiver().await;
    let model = ScriptedModel::start(Script::bash_each_turn(
        "echo traced > traced.txt && cat traced.txt",
        "Traced.",
    ))
    .await
    .unwrap();
    let home = tempfile::tempdir().unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_harness"));
    cmd.arg("--home")
        .arg(home.path())
        .args(["--otlp", &endpoint, "run", "trace this"])
        .stdin(Stdio::null())
        .env_remove("HARNESS_HOME")
        .env("ANTHROPIC_API_KEY", "test-key")
        .env("ANTHROPIC_BASE_URL", model.base_url())
        .env("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1");
    let out = tokio::task::spawn_blocking(move || cmd.output().unwrap())
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{stderr}");
    let session = stderr
        .split_whitespace()
        .skip_while(|w| *w != "session")
        .nth(1)
        .expect("run names its session")
        .to_string();
    // The exporter flushed before the process exited.
    let spans = received.lock().unwrap().clone();
    assert!(!spans.is_empty(), "nothing was exported:\n{stderr}");
    assert!(spans.iter().all(|s| s.service == "harness"), "{spans:?}");
    let named = |name: &str| -> Vec<&Span> { spans.iter().filter(|s| s.name == name).collect() };

    let turns = named("turn");
    assert_eq!(turns.len(), 1, "{spans:#?}");
    let turn = turns[0];
    let command = named("session")
        .into_iter()
        .find(|s| s.attr("command") == "start")
        .expect("the session's start command");
    let mut tree = String::new();
    render(&spans, command, 0, &mut tree);
    println!("{tree}");

    assert_eq!(command.attr("session.id"), session);
    assert_eq!(
        turn.parent, command.id,
        "turn is a child of the session's command"
    );
    assert_eq!(turn.trace, command.trace);
    assert_eq!(turn.attr("session.id"), session);
    assert_eq!(turn.attr("turn.id"), command.attr("turn.id"));
    assert!(turn.attr("generation").parse::<u64>().is_ok(), "{turn:?}");
    assert_eq!(turn.attr("status"), "finished");

    let create = named("sandbox.create");
    assert_eq!(create.len(), 1, "a first turn makes its sandbox");
    assert_eq!(create[0].parent, turn.id);
    let sandbox = create[0].attr("sandbox.id").to_string();
    assert!(!sandbox.is_empty(), "{:?}", create[0]);

    let slices = named("slice");
    assert!(!slices.is_empty());
    for (n, slice) in slices.iter().enumerate() {
        assert_eq!(slice.parent, turn.id, "slice under the turn: {slice:?}");
        assert_eq!(slice.trace, turn.trace);
        assert_eq!(slice.attr("session.id"), session);
        assert_eq!(slice.attr("turn.id"), turn.attr("turn.id"));
        assert_eq!(slice.attr("slice"), (n + 1).to_string());
        assert_eq!(slice.attr("sandbox.id"), sandbox);
    }
    assert_eq!(slices.last().unwrap().attr("outcome"), "exited");

    let starts = named("agent.start");
    assert_eq!(starts.len(), 1, "the agent starts once per turn");
    assert_eq!(starts[0].parent, slices[0].id);
    assert_eq!(starts[0].attr("started"), "true");
    // The launch runs under the agent start (a local sandbox's handle
    // knows `$HOME`: no claim exec before it).
    let launches = named("agent.launch");
    assert!(
        launches.iter().any(|e| e.parent == starts[0].id),
        "the launch runs under the agent start: {launches:?}"
    );

    let slice_ids: Vec<&Vec<u8>> = slices.iter().map(|s| &s.id).collect();
    let appended: Vec<&str> = named("log.append")
        .into_iter()
        .filter(|a| slice_ids.contains(&&a.parent))
        .map(|a| a.attr("part"))
        .collect();
    for part in ["tool-call", "tool-result", "text-end", "finish"] {
        assert!(
            appended.contains(&part),
            "{part} appended in a slice: {appended:?}"
        );
    }
    assert!(
        !appended.contains(&"text-delta"),
        "deltas are DEBUG spans, not exported by default: {appended:?}"
    );
    let end = named("log.append")
        .into_iter()
        .find(|a| a.attr("status") == "finished")
        .expect("the turn's end is recorded");
    assert_eq!(end.parent, turn.id);
}
