//! Several session-server nodes over one PostgreSQL (docs/scale.md), next
//! to one node over SQLite in the same run:
//!
//! 1. appends: `BENCH_WRITERS` writers, one session each, posting answers
//!    over HTTP (`POST /messages`), each request to the next node in turn —
//!    so with N nodes, (N−1)/N of them are forwarded to the session's
//!    owner — frames/s;
//! 2. live delivery: `BENCH_READERS` SSE readers of one session, spread over
//!    the nodes (those not on the owner read through a forwarder), while a
//!    writer posts `BENCH_RATE` frames/s to the owner; latency = the
//!    reader's receive time − the writer's send time, p50/p99, for readers
//!    on the owner and through another node.
//!
//! Each setup runs `BENCH_ROUNDS` times, interleaved; every round printed.
//! The nodes are session servers in this process, each on its own 2-thread
//! runtime and TCP port (what `harness serve --log postgres://` builds:
//! the fenced log, the leases, the hub that forwards); the client has its
//! own runtime. On a 2-core machine they share the cores with PostgreSQL
//! and the client: read the ratios, not the absolute figures.
//!
//! ```text
//! cargo xtask services start --only postgres && cargo xtask bench scale
//! # knobs: BENCH_HTTP (4000) BENCH_WRITERS (16) BENCH_READERS (300)
//! #        BENCH_RATE (50) BENCH_SECS (8) BENCH_NODES (1,2,3) BENCH_ROUNDS (2)
//! ```

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use harness_core::log::SessionLog;
use serde_json::json;
use session_log::SqliteSessionLog;
use session_log_postgres::PostgresSessionLog;
use session_runtime::{Hub, HubConfig};
use session_server::{ServerConfig, SessionServer};

#[path = "support/servers.rs"]
mod servers;

#[path = "support/stats.rs"]
mod stats;
use stats::{env, percentile};

/// One node: its URL and the runtime it serves on.
struct Node {
    base: String,
    _server: servers::Server,
}

/// A session server over `log` on a runtime and port of its own; with
/// `leases`, one node among several.
fn start_node<F, Fut>(make: F) -> anyhow::Result<Node>
where
    F: FnOnce(String) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<(Arc<dyn SessionLog>, HubConfig)>>,
{
    let (listener, base, rt) = servers::listener_and_runtime("node")?;
    let (log, hub_config) = rt.block_on(make(base.clone()))?;
    let mut config = ServerConfig::new(log.clone());
    config.insecure_no_auth = true;
    rt.spawn(async move {
        let hub = Hub::new(log, hub_config);
        let listener = tokio::net::TcpListener::from_std(listener).expect("listener");
        SessionServer::with_hub(config, hub)
            .serve(listener)
            .await
            .expect("serve");
    });
    Ok(Node {
        base,
        _server: servers::Server::Ours(Some(rt)),
    })
}

fn sqlite_node(dir: &std::path::Path) -> anyhow::Result<Node> {
    let path = dir.join("single.db");
    start_node(move |_| async move {
        let log: Arc<dyn SessionLog> = Arc::new(SqliteSessionLog::open(path)?);
        Ok((log, HubConfig::default()))
    })
}

fn postgres_nodes(url: &str, n: usize) -> anyhow::Result<Vec<Node>> {
    (0..n)
        .map(|_| {
            let url = url.to_string();
            start_node(move |base| async move {
                let handle = PostgresSessionLog::connect(&url).await?;
                let leases = handle.leases(&base, Duration::from_secs(10))?;
                let log: Arc<dyn SessionLog> = Arc::new(handle.fenced(leases.clone()));
                let config = HubConfig {
                    leases: Some(Arc::new(leases)),
                    ..HubConfig::default()
                };
                Ok((log, config))
            })
        })
        .collect()
}

async fn post(http: &reqwest::Client, url: String, body: serde_json::Value) -> anyhow::Result<()> {
    let r = http.post(&url).json(&body).send().await?;
    anyhow::ensure!(r.status().is_success(), "POST {url}: {}", r.status());
    Ok(())
}

/// A session with an open turn (so answers are stored), its actor on
/// `owner`.
async fn open_session(http: &reqwest::Client, owner: &str, id: &str) -> anyhow::Result<()> {
    post(http, format!("{owner}/v1/sessions"), json!({"id": id})).await?;
    post(
        http,
        format!("{owner}/v1/sessions/{id}/messages"),
        json!({"type": "prompt", "text": "open"}),
    )
    .await
}

fn answer(id: String) -> serde_json::Value {
    json!({"type": "approval-response", "approvalId": id, "approved": true})
}

/// Frames/s of `n` answers from `writers` writers, one session each, each
/// request to the next node in turn.
async fn appends(nodes: &[Node], tag: &str, n: u64, writers: u64) -> anyhow::Result<f64> {
    let http = reqwest::Client::new();
    let bases: Vec<String> = nodes.iter().map(|n| n.base.clone()).collect();
    for w in 0..writers {
        let owner = &bases[w as usize % bases.len()];
        open_session(&http, owner, &format!("{tag}-{w}")).await?;
    }
    let per = n / writers;
    let started = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..writers {
        let (http, bases, id) = (http.clone(), bases.clone(), format!("{tag}-{w}"));
        tasks.push(tokio::spawn(async move {
            for i in 0..per {
                let base = &bases[(w + i) as usize % bases.len()];
                let url = format!("{base}/v1/sessions/{id}/messages");
                post(&http, url, answer(format!("w{w} m{i}"))).await?;
            }
            anyhow::Ok(())
        }));
    }
    for task in tasks {
        task.await??;
    }
    Ok((per * writers) as f64 / started.elapsed().as_secs_f64())
}

/// Latencies (ms) seen by readers on the owner and through other nodes.
struct Live {
    direct: Vec<f64>,
    forwarded: Vec<f64>,
    expected: usize,
    complete: usize,
}

/// One reader: every answer's send stamp (µs since `start`) after
/// `"approvalId":"`, until it saw `total` or the deadline.
async fn reader(
    http: reqwest::Client,
    url: String,
    start: Instant,
    total: usize,
    deadline: tokio::time::Instant,
    ready: tokio::sync::mpsc::UnboundedSender<()>,
) -> anyhow::Result<Vec<f64>> {
    let response = http.get(&url).send().await?;
    anyhow::ensure!(response.status() == 200, "GET {url}: {}", response.status());
    let _ = ready.send(());
    let mut body = response.bytes_stream();
    let mut text = String::new();
    let mut got = Vec::with_capacity(total);
    let marker = "\"approvalId\":\"";
    while got.len() < total {
        let Ok(Some(chunk)) = tokio::time::timeout_at(deadline, body.next()).await else {
            break;
        };
        let now = start.elapsed().as_micros() as u64;
        text.push_str(&String::from_utf8_lossy(&chunk?));
        let Some(end) = text.rfind("\n\n") else {
            continue;
        };
        for piece in text[..end].split(marker).skip(1) {
            let digits: String = piece.chars().take_while(char::is_ascii_digit).collect();
            if let Ok(sent) = digits.parse::<u64>() {
                got.push(now.saturating_sub(sent) as f64 / 1000.0);
            }
        }
        text.drain(..end + 2);
    }
    Ok(got)
}

async fn live(
    nodes: &[Node],
    tag: &str,
    readers: u64,
    rate: u64,
    secs: u64,
) -> anyhow::Result<Live> {
    let http = reqwest::Client::new();
    let owner = nodes[0].base.clone();
    open_session(&http, &owner, tag).await?;
    let total = (rate * secs) as usize;
    let start = Instant::now();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs + 20);
    let (ready_tx, mut ready) = tokio::sync::mpsc::unbounded_channel();
    let mut tasks = Vec::new();
    for r in 0..readers {
        let node = &nodes[r as usize % nodes.len()];
        // After the prompt (seq 1) and whatever the open turn stored.
        let url = format!("{}/v1/sessions/{tag}/events?after=1", node.base);
        let direct = (r as usize).is_multiple_of(nodes.len());
        let task = tokio::spawn(reader(
            http.clone(),
            url,
            start,
            total,
            deadline,
            ready_tx.clone(),
        ));
        tasks.push((direct, task));
    }
    for _ in 0..readers {
        ready.recv().await;
    }
    // Let the forwarders' sockets to the owner open.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let every = Duration::from_micros(1_000_000 / rate.max(1));
    let mut tick = tokio::time::interval(every);
    for _ in 0..total {
        tick.tick().await;
        let sent = start.elapsed().as_micros() as u64;
        post(
            &http,
            format!("{owner}/v1/sessions/{tag}/messages"),
            answer(sent.to_string()),
        )
        .await?;
    }
    let mut out = Live {
        direct: Vec::new(),
        forwarded: Vec::new(),
        expected: total * readers as usize,
        complete: 0,
    };
    for (direct, task) in tasks {
        let got = task.await??;
        if got.len() >= total {
            out.complete += 1;
        }
        if direct {
            out.direct.extend(got);
        } else {
            out.forwarded.extend(got);
        }
    }
    out.direct.sort_by(|a, b| a.total_cmp(b));
    out.forwarded.sort_by(|a, b| a.total_cmp(b));
    Ok(out)
}

fn main() -> anyhow::Result<()> {
    let url = std::env::var("HARNESS_TEST_POSTGRES_URL").map_err(|_| {
        anyhow::anyhow!(
            "HARNESS_TEST_POSTGRES_URL is not set: `cargo xtask services start --only postgres`, \
             then `eval \"$(cargo xtask env)\"` (or run `cargo xtask bench scale`)"
        )
    })?;
    let http_n = env("BENCH_HTTP", 4000);
    let writers = env("BENCH_WRITERS", 16).max(1);
    let readers = env("BENCH_READERS", 300).max(1);
    let rate = env("BENCH_RATE", 50).max(1);
    let secs = env("BENCH_SECS", 8).max(1);
    let rounds = env("BENCH_ROUNDS", 2).max(1);
    let counts: Vec<usize> = std::env::var("BENCH_NODES")
        .unwrap_or_else(|_| "1,2,3".into())
        .split(',')
        .filter_map(|n| n.trim().parse().ok())
        .filter(|n| *n >= 1)
        .collect();
    let dir = tempfile::tempdir()?;
    let client = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let run = std::process::id();
    let mut setups: Vec<(String, Vec<Node>)> =
        vec![("1 node, SQLite".into(), vec![sqlite_node(dir.path())?])];
    for n in &counts {
        setups.push((
            format!("{n} node(s), PostgreSQL"),
            postgres_nodes(&url, *n)?,
        ));
    }
    println!("| round | setup | appends/s ({writers} writers, round-robin over the nodes) | ratio vs SQLite |");
    println!("|---|---|---:|---:|");
    for round in 1..=rounds {
        let mut anchor = f64::NAN;
        for (i, (name, nodes)) in setups.iter().enumerate() {
            let tag = format!("a{run}-{round}-{i}");
            let v = client.block_on(appends(nodes, &tag, http_n, writers))?;
            if i == 0 {
                anchor = v;
            }
            println!("| {round} | {name} | {v:.0} | x{:.2} |", v / anchor);
        }
    }
    println!();
    println!(
        "| round | setup | live p50 / p99 ms on the owner | p50 / p99 ms through another node | p99 ratio vs SQLite | readers complete |"
    );
    println!("|---|---|---:|---:|---:|---:|");
    for round in 1..=rounds {
        let mut anchor = f64::NAN;
        for (i, (name, nodes)) in setups.iter().enumerate() {
            let tag = format!("l{run}-{round}-{i}");
            let l = client.block_on(live(nodes, &tag, readers, rate, secs))?;
            let p99 = percentile(&l.direct, 0.99).max(percentile(&l.forwarded, 0.99));
            let p99 = if p99.is_nan() {
                percentile(&l.direct, 0.99)
            } else {
                p99
            };
            if i == 0 {
                anchor = p99;
            }
            let through = if l.forwarded.is_empty() {
                "—".to_string()
            } else {
                format!(
                    "{:.1} / {:.1}",
                    percentile(&l.forwarded, 0.5),
                    percentile(&l.forwarded, 0.99)
                )
            };
            println!(
                "| {round} | {name} | {:.1} / {:.1} | {through} | x{:.2} | {}/{readers} ({} of {} deliveries) |",
                percentile(&l.direct, 0.5),
                percentile(&l.direct, 0.99),
                p99 / anchor,
                l.complete,
                l.direct.len() + l.forwarded.len(),
                l.expected
            );
        }
    }
    println!("\n({readers} readers, {rate} frames/s for {secs} s; the worst p99 of the two reader groups is compared)");
    drop(setups);
    client.shutdown_background();
    Ok(())
}
