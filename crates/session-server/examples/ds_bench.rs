//! Durable Streams benchmark: this server's `/v1/stream/*` side by side with
//! the reference server (npm `@durable-streams/server`), same client
//! workload, one run.
//!
//! ```text
//! cargo run --release -p session-server --example ds_bench
//! DS_BENCH_APPENDS=20000 DS_BENCH_WRITERS=16 DS_BENCH_READERS=1000 DS_BENCH_RATE=50 \
//!   DS_BENCH_SECS=10 DS_BENCH_REPLAY=100000 cargo run --release -p session-server --example ds_bench
//! ```
//!
//! Servers (all on 127.0.0.1, each measured alone, one after the other):
//! - `ours/mem`: `SessionServer::router()` (SQLite session log in a temp dir,
//!   `insecure_no_auth`), whose generic streams live in memory; served on
//!   its own 2-thread tokio runtime so it does not share the client's.
//! - `ours/sqlite`: `durable_streams::router` with `StreamStore::open` (every
//!   append committed to SQLite before the answer).
//! - `ref/mem`, `ref/file`: `DurableStreamTestServer` 0.3.7 in a Node child
//!   process, in memory and with `dataDir` (log files + LMDB). Installed
//!   once with npm into `$HARNESS_CACHE/npm/ds-reference`.
//!
//! Workload, over plain HTTP/1.1 (reqwest, no compression asked for):
//! (a) append: N JSON messages, one per POST, k concurrent writers;
//! (b) live: R SSE readers (`live=sse`, from the start of a fresh stream,
//!     reconnecting from the last `streamNextOffset` if a response ends), a
//!     writer POSTing `rate` messages/s for `secs` s, each carrying its send
//!     time; latency = receive time − send time, per delivery;
//! (c) replay: M messages (POSTed as JSON arrays of 1000), then a full read
//!     from `offset=-1` following `Stream-Next-Offset` until
//!     `Stream-Up-To-Date`.
//!
//! The client and the server under test share the machine's cores; on 2
//! cores the client's own SSE parsing for 1000 readers is part of the
//! measured latency for both servers alike. Results: `docs/durable-streams.md`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use serde_json::{json, Value};
use session_log::SqliteSessionLog;
use session_server::durable_streams::{router, DurableStreamsState, StreamStore};
use session_server::{ServerConfig, SessionServer};

#[path = "support/servers.rs"]
mod servers;

#[path = "support/stats.rs"]
mod stats;
use servers::{install_reference, serve_ours, serve_reference, LAUNCHER};
use stats::{env, percentile};

#[derive(Debug, Clone, Copy)]
struct Params {
    appends: u64,
    writers: u64,
    readers: u64,
    rate: u64,
    secs: u64,
    replay: u64,
}

#[derive(Debug, Default, Clone)]
struct Results {
    append_per_s: f64,
    deliveries: u64,
    expected: u64,
    readers_complete: u64,
    reconnects: u64,
    p50_ms: f64,
    p99_ms: f64,
    max_ms: f64,
    replay_fill_s: f64,
    replay_s: f64,
    replay_pages: u64,
}

async fn create(http: &reqwest::Client, url: &str) -> anyhow::Result<()> {
    let r = http
        .put(url)
        .header("content-type", "application/json")
        .send()
        .await?;
    anyhow::ensure!(r.status().is_success(), "PUT {url}: {}", r.status());
    Ok(())
}

async fn post(http: &reqwest::Client, url: &str, body: String) -> anyhow::Result<()> {
    let r = http
        .post(url)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await?;
    anyhow::ensure!(r.status().is_success(), "POST {url}: {}", r.status());
    Ok(())
}

/// (a) Append throughput: one JSON message per POST, `writers` in parallel.
async fn bench_append(http: &reqwest::Client, base: &str, p: Params) -> anyhow::Result<f64> {
    let url = format!("{base}/v1/stream/bench-append");
    create(http, &url).await?;
    let per = p.appends / p.writers;
    let t = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..p.writers {
        let (http, url) = (http.clone(), url.clone());
        tasks.push(tokio::spawn(async move {
            for i in 0..per {
                let m =
                    json!({"w": w, "i": i, "text": "the quick brown fox jumps over the lazy dog"});
                post(&http, &url, m.to_string()).await?;
            }
            anyhow::Ok(())
        }));
    }
    for task in tasks {
        task.await??;
    }
    Ok((per * p.writers) as f64 / t.elapsed().as_secs_f64())
}

/// Read SSE `data` events and return the latency of every message in them,
/// plus how often the reader had to reconnect.
///
/// Like a real client, it follows `streamNextOffset` from the control events
/// and, when the server ends the response (or the connection breaks),
/// reconnects from there. Stops at `total` messages or at `deadline`
/// (keeping what arrived: missing deliveries show in the count).
async fn sse_reader(
    http: reqwest::Client,
    url: String,
    start: Instant,
    total: u64,
    deadline: tokio::time::Instant,
    ready: tokio::sync::mpsc::UnboundedSender<()>,
) -> anyhow::Result<(Vec<f64>, u64)> {
    let mut lat = Vec::new();
    let mut offset = "-1".to_string();
    let mut reconnects = 0u64;
    let mut ready = Some(ready);
    while (lat.len() as u64) < total && tokio::time::Instant::now() < deadline {
        let get = http.get(format!("{url}?offset={offset}&live=sse")).send();
        let resp = match tokio::time::timeout_at(deadline, get).await {
            Err(_) => break,
            Ok(Ok(r)) if r.status() == 200 => r,
            Ok(Ok(r)) => anyhow::bail!("SSE GET at offset {offset}: {}", r.status()),
            Ok(Err(_)) if ready.is_none() => {
                // Counted as a reconnect; pause so a refusing server is not hammered.
                reconnects += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
            Ok(Err(e)) => return Err(e.into()),
        };
        if let Some(r) = ready.take() {
            let _ = r.send(());
        } else {
            reconnects += 1;
        }
        let mut body = resp.bytes_stream();
        let mut buf = String::new();
        while (lat.len() as u64) < total {
            let Ok(Some(Ok(chunk))) = tokio::time::timeout_at(deadline, body.next()).await else {
                break;
            };
            buf.push_str(&String::from_utf8_lossy(&chunk));
            // Events end with a blank line; normalise CRLF first.
            if buf.contains('\r') {
                buf = buf.replace("\r\n", "\n");
            }
            while let Some(end) = buf.find("\n\n") {
                let block: String = buf.drain(..end + 2).collect();
                let mut event = "message";
                let mut data = Vec::new();
                for line in block.lines() {
                    if let Some(e) = line.strip_prefix("event:") {
                        event = e.trim();
                    } else if let Some(d) = line.strip_prefix("data:") {
                        data.push(d.strip_prefix(' ').unwrap_or(d));
                    }
                }
                let now = start.elapsed().as_micros() as f64;
                let v: Value = serde_json::from_str(&data.join("\n"))?;
                match event {
                    "control" => {
                        if let Some(next) = v["streamNextOffset"].as_str() {
                            offset = next.to_string();
                        }
                    }
                    "data" => {
                        let items = match v {
                            Value::Array(a) => a,
                            other => vec![other],
                        };
                        for item in items {
                            if let Some(sent) = item["t"].as_f64() {
                                lat.push((now - sent) / 1000.0);
                            }
                        }
                    }
                    _ => {}
                }
            }
        }
    }
    Ok((lat, reconnects))
}

/// Returns every latency, the expected delivery count, and how many readers
/// got every message, and the number of SSE reconnections.
async fn bench_live(base: &str, p: Params) -> anyhow::Result<(Vec<f64>, u64, u64, u64)> {
    let url = format!("{base}/v1/stream/bench-live");
    let http = reqwest::Client::new();
    create(&http, &url).await?;
    let total = p.rate * p.secs;
    let start = Instant::now();
    let (ready_tx, mut ready_rx) = tokio::sync::mpsc::unbounded_channel::<()>();
    let mut readers = Vec::new();
    for _ in 0..p.readers {
        let (http, url, ready) = (http.clone(), url.clone(), ready_tx.clone());
        readers.push(tokio::spawn(async move {
            // From the start of the (empty) stream: no message can be missed
            // however late the server registers the reader. Bounded: a
            // reader that misses messages gives up at the deadline.
            let deadline = tokio::time::Instant::now() + Duration::from_secs(p.secs + 30);
            sse_reader(http, url, start, total, deadline, ready).await
        }));
    }
    drop(ready_tx);
    let mut connected = 0;
    while connected < p.readers && ready_rx.recv().await.is_some() {
        connected += 1;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut tick = tokio::time::interval(Duration::from_micros(1_000_000 / p.rate));
    for i in 0..total {
        tick.tick().await;
        let m = json!({"t": start.elapsed().as_micros() as u64, "i": i});
        post(&http, &url, m.to_string()).await?;
    }
    let mut all = Vec::new();
    let mut complete = 0;
    let mut reconnects = 0;
    for r in readers {
        let (lat, again) = r.await??;
        reconnects += again;
        complete += u64::from(lat.len() as u64 == total);
        all.extend(lat);
    }
    all.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    Ok((all, total * connected, complete, reconnects))
}

/// (c) Replay: fill, then read everything from `offset=-1`.
async fn bench_replay(
    http: &reqwest::Client,
    base: &str,
    p: Params,
) -> anyhow::Result<(f64, f64, u64)> {
    let url = format!("{base}/v1/stream/bench-replay");
    create(http, &url).await?;
    let t = Instant::now();
    let batch = 1000;
    let mut i = 0;
    while i < p.replay {
        let n = batch.min(p.replay - i);
        let items: Vec<Value> = (i..i + n)
            .map(|k| json!({"i": k, "text": "the quick brown fox jumps over the lazy dog"}))
            .collect();
        post(http, &url, Value::Array(items).to_string()).await?;
        i += n;
    }
    let fill = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let mut offset = "-1".to_string();
    let mut count = 0u64;
    let mut pages = 0u64;
    // Bounded: at least one message per page or we stop.
    while pages <= p.replay {
        let r = http.get(format!("{url}?offset={offset}")).send().await?;
        anyhow::ensure!(r.status() == 200, "replay GET: {}", r.status());
        let next = r
            .headers()
            .get("stream-next-offset")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let done = r.headers().contains_key("stream-up-to-date");
        let body: Value = serde_json::from_slice(&r.bytes().await?)?;
        let n = body.as_array().map_or(0, Vec::len) as u64;
        count += n;
        pages += 1;
        if done || n == 0 {
            break;
        }
        offset = next.ok_or_else(|| anyhow::anyhow!("no Stream-Next-Offset"))?;
    }
    anyhow::ensure!(
        count == p.replay,
        "replay read {count} of {} messages",
        p.replay
    );
    Ok((fill, t.elapsed().as_secs_f64(), pages))
}

async fn run_all(base: &str, p: Params) -> anyhow::Result<Results> {
    let http = reqwest::Client::new();
    let append_per_s = bench_append(&http, base, p).await?;
    let (lat, expected, readers_complete, reconnects) = bench_live(base, p).await?;
    let (replay_fill_s, replay_s, replay_pages) = bench_replay(&http, base, p).await?;
    Ok(Results {
        append_per_s,
        deliveries: lat.len() as u64,
        expected,
        readers_complete,
        reconnects,
        p50_ms: percentile(&lat, 0.5),
        p99_ms: percentile(&lat, 0.99),
        max_ms: lat.last().copied().unwrap_or(f64::NAN),
        replay_fill_s,
        replay_s,
        replay_pages,
    })
}

fn ratio(a: f64, b: f64) -> String {
    if b > 0.0 && a.is_finite() && b.is_finite() {
        format!("{:.2}", a / b)
    } else {
        "-".into()
    }
}

fn print_table(p: Params, rows: &[(String, Option<Results>)]) {
    let get = |name: &str| {
        rows.iter()
            .find(|(n, _)| n == name)
            .and_then(|(_, r)| r.clone())
    };
    type Metric = (&'static str, fn(&Results) -> f64, &'static str);
    let metrics: [Metric; 6] = [
        ("append (frames/s)", |r| r.append_per_s, "{:.0}"),
        ("live p50 (ms)", |r| r.p50_ms, "{:.2}"),
        ("live p99 (ms)", |r| r.p99_ms, "{:.2}"),
        ("live max (ms)", |r| r.max_ms, "{:.2}"),
        ("replay fill (s)", |r| r.replay_fill_s, "{:.2}"),
        ("replay read (s)", |r| r.replay_s, "{:.3}"),
    ];
    println!();
    println!(
        "Durable Streams bench: {} appends x {} writers; {} SSE readers x {} frames/s x {} s; replay {} frames",
        p.appends, p.writers, p.readers, p.rate, p.secs, p.replay
    );
    let names: Vec<&str> = rows.iter().map(|(n, _)| n.as_str()).collect();
    print!("| metric |");
    for n in &names {
        print!(" {n} |");
    }
    println!(" ours/ref (mem) | ours/ref (disk) |");
    print!("|---|");
    for _ in &names {
        print!("---:|");
    }
    println!("---:|---:|");
    for (label, f, fmt) in metrics {
        print!("| {label} |");
        for (_, r) in rows {
            let cell = match r {
                Some(r) if fmt == "{:.0}" => format!("{:.0}", f(r)),
                Some(r) if fmt == "{:.3}" => format!("{:.3}", f(r)),
                Some(r) => format!("{:.2}", f(r)),
                None => "failed".into(),
            };
            print!(" {cell} |");
        }
        // A latency over a partial set of deliveries compares nothing.
        let live = label.starts_with("live");
        let complete = |r: &Results| !live || r.deliveries == r.expected;
        let pair = |a: &str, b: &str| match (get(a), get(b)) {
            (Some(a), Some(b)) if complete(&a) && complete(&b) => ratio(f(&a), f(&b)),
            _ => "-".into(),
        };
        println!(
            " {} | {} |",
            pair("ours/mem", "ref/mem"),
            pair("ours/sqlite", "ref/file")
        );
    }
    print!("| live deliveries |");
    for (_, r) in rows {
        match r {
            Some(r) => print!(" {}/{} |", r.deliveries, r.expected),
            None => print!(" failed |"),
        }
    }
    println!(" | |");
    print!("| readers with every frame |");
    for (_, r) in rows {
        match r {
            Some(r) => print!(" {}/{} |", r.readers_complete, p.readers),
            None => print!(" failed |"),
        }
    }
    println!(" | |");
    print!("| SSE reconnects |");
    for (_, r) in rows {
        match r {
            Some(r) => print!(" {} |", r.reconnects),
            None => print!(" failed |"),
        }
    }
    println!(" | |");
    print!("| replay pages |");
    for (_, r) in rows {
        match r {
            Some(r) => print!(" {} |", r.replay_pages),
            None => print!(" failed |"),
        }
    }
    println!(" | |");
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let p = Params {
        appends: env("DS_BENCH_APPENDS", 20_000),
        writers: env("DS_BENCH_WRITERS", 16).max(1),
        readers: env("DS_BENCH_READERS", 1000),
        rate: env("DS_BENCH_RATE", 50).max(1),
        secs: env("DS_BENCH_SECS", 10),
        replay: env("DS_BENCH_REPLAY", 100_000),
    };
    let dir = tempfile::tempdir()?;
    let mut rows: Vec<(String, Option<Results>)> = Vec::new();

    // Each server runs alone, then is stopped before the next starts.
    let mut record = |name: &str, r: anyhow::Result<Results>| {
        match &r {
            Ok(r) => println!("{name}: {r:?}"),
            Err(e) => println!("{name}: FAILED: {e:#}"),
        }
        rows.push((name.to_string(), r.ok()));
    };

    // DS_BENCH_ONLY=ref/file,ours/mem runs a subset (for investigating one).
    let only = std::env::var("DS_BENCH_ONLY").ok();
    let wanted = |name: &str| {
        only.as_deref()
            .is_none_or(|o| o.split(',').any(|x| x.trim() == name))
    };

    if wanted("ours/mem") {
        let log = Arc::new(SqliteSessionLog::open(dir.path().join("sessions.db"))?);
        let mut config = ServerConfig::new(log);
        config.insecure_no_auth = true;
        let app = SessionServer::new(config).router();
        let (base, server) = serve_ours(app)?;
        record("ours/mem", run_all(&base, p).await);
        drop(server);
    }
    if wanted("ours/sqlite") {
        let mut state = DurableStreamsState::new();
        state.store = Arc::new(StreamStore::open(dir.path().join("streams.db"))?);
        let (base, server) = serve_ours(router(state))?;
        record("ours/sqlite", run_all(&base, p).await);
        drop(server);
    }

    let reference = ["ref/mem", "ref/file"].into_iter().any(wanted);
    let installed = if reference {
        Some(tokio::task::spawn_blocking(install_reference).await?)
    } else {
        None
    };
    match installed {
        None => {}
        Some(Err(e)) => {
            println!("reference server not installed: {e:#}");
            record("ref/mem", Err(e));
        }
        Some(Ok(entry)) => {
            let launcher = dir.path().join("launch.mjs");
            std::fs::write(&launcher, LAUNCHER)?;
            for (name, data) in [
                ("ref/mem", None),
                ("ref/file", Some(dir.path().join("ref"))),
            ] {
                if !wanted(name) {
                    continue;
                }
                let started = serve_reference(&entry, &launcher, data.as_deref());
                match started {
                    Ok((base, server)) => {
                        record(name, run_all(&base, p).await);
                        drop(server);
                    }
                    Err(e) => record(name, Err(e)),
                }
            }
        }
    }
    print_table(p, &rows);
    Ok(())
}
