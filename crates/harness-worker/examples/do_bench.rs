//! One session's Durable Object under `wrangler dev`: how many frames per
//! second it stores, and how many bytes a frame takes in its SQLite —
//! next to `harness serve`'s server (`session-server` over `session-log`)
//! given the same HTTP workload in the same run.
//!
//! The workload: clients post `approval-response` messages to one
//! session's `POST /v1/sessions/<id>/messages` (each one stored frame,
//! ~115 bytes of JSON; the runner path of a turn stores its parts the same
//! way, one actor input each), 1 client and then 16, for `BENCH_SECS`
//! each. Bytes per frame: the object's SQLite file size (and its WAL)
//! after the run, divided by the frames stored.
//!
//! ```text
//! cargo xtask worker build --release   # (or a dev build)
//! cargo run --release -p harness-worker --example do_bench
//! # knobs: BENCH_SECS (10) BENCH_CLIENTS (1,16)
//! ```
//!
//! Local `wrangler dev` runs workerd on this machine, in one process, with
//! its own request routing and SQLite; a deployed object runs elsewhere.
//! What this measures is the code path and the storage format, not
//! Cloudflare's production capacity. `docs/cloudflare-worker.md` has the
//! figures and the capacity sketch built on them.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use harness_testkit::conformance::session_api::{self, CLIENT, HOST};
use harness_testkit::wrangler::WranglerDev;
use serde_json::json;

fn secs() -> u64 {
    std::env::var("BENCH_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10)
}

fn clients() -> Vec<usize> {
    std::env::var("BENCH_CLIENTS")
        .ok()
        .map(|v| v.split(',').filter_map(|c| c.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![1, 16])
}

struct Run {
    frames: u64,
    per_sec: f64,
    p50_ms: f64,
    p99_ms: f64,
}

/// `clients` posting to session `id` at `base` for `secs` (answers to the
/// running turn's approvals: each is stored as a frame).
async fn hammer(base: &str, id: &str, clients: usize, secs: u64) -> Run {
    let http = reqwest::Client::new();
    let stop = Arc::new(AtomicBool::new(false));
    let count = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for c in 0..clients {
        let (http, stop, count) = (http.clone(), stop.clone(), count.clone());
        let url = format!("{base}/v1/sessions/{id}/messages");
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                n += 1;
                let body = json!({
                    "type": "approval-response",
                    "approvalId": format!("c{c}-{n}"),
                    "approved": true,
                });
                let t = Instant::now();
                let response = http
                    .post(&url)
                    .bearer_auth(CLIENT)
                    .json(&body)
                    .send()
                    .await
                    .expect("the server answers");
                assert_eq!(response.status(), 200, "{}", response.text().await.unwrap());
                latencies.push(t.elapsed().as_secs_f64() * 1000.0);
                count.fetch_add(1, Ordering::Relaxed);
            }
            latencies
        }));
    }
    tokio::time::sleep(Duration::from_secs(secs)).await;
    stop.store(true, Ordering::Relaxed);
    let mut latencies = Vec::new();
    for t in tasks {
        latencies.extend(t.await.expect("client task"));
    }
    let elapsed = started.elapsed().as_secs_f64();
    latencies.sort_by(|a, b| a.total_cmp(b));
    let pick = |q: f64| latencies[((latencies.len() as f64 - 1.0) * q) as usize];
    let frames = count.load(Ordering::Relaxed);
    Run {
        frames,
        per_sec: frames as f64 / elapsed,
        p50_ms: pick(0.50),
        p99_ms: pick(0.99),
    }
}

async fn create(base: &str, id: &str, token: Option<&str>) {
    let mut request = reqwest::Client::new()
        .post(format!("{base}/v1/sessions"))
        .json(&json!({ "id": id }));
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    let response = request.send().await.expect("create");
    assert_eq!(response.status(), 201, "{}", response.text().await.unwrap());
    // A running turn for the answers (no engine runs it: the prompt waits).
    let response = reqwest::Client::new()
        .post(format!("{base}/v1/sessions/{id}/messages"))
        .bearer_auth(token.unwrap_or(CLIENT))
        .json(&json!({"type": "prompt", "text": "bench"}))
        .send()
        .await
        .expect("prompt");
    assert_eq!(response.status(), 200, "{}", response.text().await.unwrap());
}

/// The Durable Objects' SQLite files under wrangler's state directory
/// (with WAL), in bytes.
fn object_bytes(state: &Path) -> u64 {
    fn walk(dir: &Path, total: &mut u64) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                walk(&path, total);
            } else if path.to_string_lossy().contains("durable-objects")
                || path.to_string_lossy().contains("do/")
            {
                let name = path.file_name().unwrap_or_default().to_string_lossy();
                if name.ends_with(".sqlite") || name.ends_with(".sqlite-wal") {
                    *total += entry.metadata().map_or(0, |m| m.len());
                }
            }
        }
    }
    let mut total = 0;
    walk(state, &mut total);
    total
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let worker_dir = harness_testkit::checkout::path("crates/harness-worker");
    let state = std::env::temp_dir().join(format!("harness-do-bench-{}", std::process::id()));
    let tokens = session_api::token_table().to_string();
    let dev = {
        let state = state.clone();
        tokio::task::spawn_blocking(move || {
            WranglerDev::start_with_state(&worker_dir, &[("HARNESS_TOKENS", tokens)], &state)
        })
        .await
        .expect("start task")
        .expect("wrangler and the built Worker (cargo xtask worker build)")
    };

    // The baseline: harness serve's HTTP server over its SQLite log.
    let dir = tempfile::tempdir().expect("a temp dir");
    let log =
        Arc::new(session_log::SqliteSessionLog::open(dir.path().join("log.db")).expect("the log"));
    let mut config = session_server::ServerConfig::new(log);
    config.insecure_no_auth = true;
    let server = session_server::SessionServer::new(config);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a port");
    let serve_base = format!("http://{}", listener.local_addr().unwrap());
    let router = server.router();
    tokio::spawn(async move { axum::serve(listener, router).await });

    let secs = secs();
    println!("one session, approval-response frames, {secs} s per row");
    println!(
        "{:>8} | {:>24} | {:>24} | {:>8}",
        "clients", "Worker DO: f/s p50/p99 ms", "harness serve: f/s p50/p99", "DO/serve"
    );
    let mut stored = 0;
    for (i, n) in clients().into_iter().enumerate() {
        let id = format!("bench-{i}");
        create(&dev.base, &id, Some(HOST)).await;
        create(&serve_base, &id, None).await;
        let worker = hammer(&dev.base, &id, n, secs).await;
        let serve = hammer(&serve_base, &id, n, secs).await;
        stored += worker.frames;
        println!(
            "{n:>8} | {:>8.0} {:>6.1}/{:>7.1} | {:>8.0} {:>6.1}/{:>7.1} | {:>8.3}",
            worker.per_sec,
            worker.p50_ms,
            worker.p99_ms,
            serve.per_sec,
            serve.p50_ms,
            serve.p99_ms,
            worker.per_sec / serve.per_sec
        );
    }
    drop(dev);
    let bytes = object_bytes(&state);
    println!(
        "Durable Object SQLite: {bytes} bytes for {stored} frames = {:.0} bytes/frame (index and meta row included)",
        bytes as f64 / stored.max(1) as f64
    );
    let _ = std::fs::remove_dir_all(&state);
}
