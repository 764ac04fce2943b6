//! The host-tool round trip on loopback, next to a plain HTTP request and
//! response to the same server: a runner's `host_call` over its WebSocket,
//! the session actor storing the call, the tool host (`ToolHost` over its
//! own WebSocket) answering, the actor storing the outcome and answering
//! the runner — against `GET /v1/sessions/{id}`.
//!
//! ```text
//! cargo run --release -p session-server --example host_tools_bench
//! BENCH_CALLS=5000 cargo run --release -p session-server --example host_tools_bench
//! ```
//!
//! In this process, a SQLite log in a temp dir, real TCP on 127.0.0.1.

use std::sync::Arc;
use std::time::{Duration, Instant};

use harness_core::relay::{HostCallRequest, HostOutcome, ToolSpec};
use harness_core::slice::PartSink;
use harness_core::SessionId;
use serde_json::json;
use session_log::SqliteSessionLog;
use session_runtime::{RunnerSink, ToolHost, ToolOutput, WsConnector};
use session_server::{ServerConfig, SessionServer};

#[path = "support/stats.rs"]
mod stats;
use stats::percentile;

fn summary(what: &str, mut ms: Vec<f64>) -> (f64, f64) {
    ms.sort_by(f64::total_cmp);
    let (p50, p99) = (percentile(&ms, 0.5), percentile(&ms, 0.99));
    println!(
        "{what}: {} round trips, p50 {p50:.3} ms, p99 {p99:.3} ms",
        ms.len()
    );
    (p50, p99)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let calls: usize = std::env::var("BENCH_CALLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000);
    let dir = tempfile::tempdir()?;
    let log = Arc::new(SqliteSessionLog::open(dir.path().join("bench.db"))?);
    let mut config = ServerConfig::new(log);
    config.insecure_no_auth = true;
    let server = SessionServer::new(config);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let router = server.router();
    tokio::spawn(async move { axum::serve(session_server::no_delay(listener), router).await });
    let base = format!("http://{addr}");
    let http = reqwest::Client::new();

    // A session with a running turn (no engine here: the runner below
    // speaks for it).
    let session = SessionId::parse("bench")?;
    let created = http
        .post(format!("{base}/v1/sessions"))
        .json(&json!({"id": "bench"}))
        .send()
        .await?;
    anyhow::ensure!(
        created.status().is_success(),
        "create: {}",
        created.status()
    );
    let opened = http
        .post(format!("{base}/v1/sessions/bench/messages"))
        .json(&json!({"type": "prompt", "text": "go", "turnId": "t1"}))
        .send()
        .await?;
    anyhow::ensure!(opened.status() == 200, "prompt: {}", opened.status());

    let host = ToolHost::new().function(
        ToolSpec::new("echo", "echo the input", json!({"type": "object"})),
        |input, _ctx| async move { ToolOutput::ok(input.to_string()) },
    );
    let (host_base, host_session) = (base.clone(), session.clone());
    tokio::spawn(async move { host.serve_ws(&host_base, &host_session, None, false).await });
    let runner = RunnerSink::new(Arc::new(WsConnector::new(base.clone(), None)), 1);
    let started = Instant::now();
    while runner.host_tools(session.as_str()).await?.is_empty() {
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(10),
            "the host never attached"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    // Warm both paths, then measure them alternately so both see the same
    // machine.
    let mut host_ms = Vec::with_capacity(calls);
    let mut http_ms = Vec::with_capacity(calls);
    for i in 0..calls + 100 {
        let call = HostCallRequest {
            call_id: format!("c{i}"),
            tool: "echo".into(),
            input: json!({"i": i}),
            byte_budget: None,
            timeout_ms: None,
        };
        let t = Instant::now();
        let outcome = runner.host_call(session.as_str(), "t1", call).await?;
        let host_el = t.elapsed();
        anyhow::ensure!(
            matches!(outcome, HostOutcome::Completed { .. }),
            "call {i}: {outcome:?}"
        );
        let t = Instant::now();
        let info = http.get(format!("{base}/v1/sessions/bench")).send().await?;
        anyhow::ensure!(info.status() == 200, "info: {}", info.status());
        info.bytes().await?;
        let http_el = t.elapsed();
        if i >= 100 {
            host_ms.push(host_el.as_secs_f64() * 1e3);
            http_ms.push(http_el.as_secs_f64() * 1e3);
        }
    }
    let (h50, h99) = summary(
        "host-tool call (runner WS → actor → host WS → actor → runner, 2 SQLite appends)",
        host_ms,
    );
    let (b50, b99) = summary("plain HTTP GET /v1/sessions/{id} (baseline)", http_ms);
    println!(
        "ratio host call / HTTP: p50 ×{:.2}, p99 ×{:.2}",
        h50 / b50,
        h99 / b99
    );
    Ok(())
}
