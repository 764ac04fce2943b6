//! `harness --otlp URL run …` exports the turn's spans over OTLP/HTTP, and
//! they nest as `docs/operations.md` says: session → turn → slice →
//! agent start / sandbox exec / log append, each carrying the ids users
//! search by. The receiver is an OTLP/HTTP endpoint this test serves on
//! loopback; the agent is the real `claude` against the scripted model.

use std::collections::HashMap;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::State;
use axum::routing::post;
use harness_testkit::model::{Script, ScriptedModel};
use harness_testkit::require_env;
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use prost::Message;

/// A received span, flattened.
#[derive(Debug, Clone)]
struct Span {
    name: String,
    trace: Vec<u8>,
    id: Vec<u8>,
    parent: Vec<u8>,
    service: String,
    attributes: HashMap<String, String>,
}

impl Span {
    fn attr(&self, key: &str) -> &str {
        self.attributes.get(key).map_or("", String::as_str)
    }
}

type Received = Arc<Mutex<Vec<Span>>>;

async fn receive(State(received): State<Received>, body: Bytes) -> Vec<u8> {
    let request = ExportTraceServiceRequest::decode(body).expect("an OTLP protobuf export");
    let mut spans = received.lock().unwrap();
    for resource in request.resource_spans {
        let service = resource
            .resource
            .iter()
            .flat_map(|r| &r.attributes)
            .find(|kv| kv.key == "service.name")
            .and_then(|kv| kv.value.as_ref())
            .map(|v| value_text(v.value.as_ref()))
            .unwrap_or_default();
        for scope in resource.scope_spans {
            for span in scope.spans {
                let attributes = span
                    .attributes
                    .iter()
                    .map(|kv| {
                        let value = kv.value.as_ref().and_then(|v| v.value.as_ref());
                        (kv.key.clone(), value_text(value))
                    })
                    .collect();
                spans.push(Span {
                    name: span.name,
                    trace: span.trace_id,
                    id: span.span_id,
                    parent: span.parent_span_id,
                    service: service.clone(),
                    attributes,
                });
            }
        }
    }
    ExportTraceServiceResponse::default().encode_to_vec()
}

fn value_text(value: Option<&AnyValue>) -> String {
    match value {
        Some(AnyValue::StringValue(s)) => s.clone(),
        Some(AnyValue::IntValue(i)) => i.to_string(),
        Some(AnyValue::BoolValue(b)) => b.to_string(),
        Some(AnyValue::DoubleValue(d)) => d.to_string(),
        other => format!("{other:?}"),
    }
}

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
    let received: Received = Arc::default();
    let app = axum::Router::new()
        .route("/v1/traces", post(receive))
        .with_state(received.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let otlp = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
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
        .args(["--otlp", &otlp, "run", "trace this"])
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
    let execs = named("sandbox.exec");
    assert!(
        execs.iter().any(|e| e.parent == starts[0].id),
        "the spool claim runs under the agent start: {execs:?}"
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
