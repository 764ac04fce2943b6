//! Session server figures: append throughput (direct and over HTTP /
//! WebSocket), live-delivery latency to many SSE readers, replay time.
//!
//! ```text
//! cargo run --release -p session-server --example bench
//! BENCH_READERS=1000 BENCH_RATE=50 BENCH_SECS=10 BENCH_REPLAY=100000 cargo run --release -p session-server --example bench
//! ```
//!
//! Everything runs in this process against a SQLite log in a temp dir, over
//! real TCP on 127.0.0.1.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{SinkExt, StreamExt};
use harness_core::frame::FrameBody;
use harness_core::log::{AppendRequest, SessionLog};
use harness_core::SessionId;
use serde_json::{json, Value};
use session_log::SqliteSessionLog;
use session_server::{ServerConfig, SessionServer};
use tokio_tungstenite::tungstenite::Message;

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A runner's part: what most of a session's frames are (they leave the
/// session's meta alone).
fn part(i: u64) -> FrameBody {
    FrameBody::Part {
        turn_id: "t1".into(),
        part: harness_core::part::StreamPart::Raw {
            value: json!({"line": format!("frame {i}: the quick brown fox jumps over the lazy dog")}),
        },
    }
}

/// A prompt: a frame the log folds into the session's meta in the same
/// transaction (read and rewrite the meta), the worst case per append.
fn prompt(i: u64) -> FrameBody {
    FrameBody::UserMessage {
        text: format!("frame {i}: the quick brown fox jumps over the lazy dog"),
        turn_id: None,
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let readers = env("BENCH_READERS", 1000);
    let rate = env("BENCH_RATE", 50);
    let secs = env("BENCH_SECS", 10);
    let replay_n = env("BENCH_REPLAY", 100_000);
    let direct_n = env("BENCH_DIRECT", 20_000);
    let http_n = env("BENCH_HTTP", 5_000);

    let dir = tempfile::tempdir()?;
    let log = Arc::new(SqliteSessionLog::open(dir.path().join("bench.db"))?);
    let mut config = ServerConfig::new(log.clone());
    config.insecure_no_auth = true;
    let server = SessionServer::new(config);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let router = server.router();
    tokio::spawn(async move { axum::serve(listener, router).await });
    let base = format!("http://{addr}");
    let http = reqwest::Client::new();
    let create = |id: &str| {
        http.post(format!("{base}/v1/sessions"))
            .json(&json!({"id": id}))
            .send()
    };

    // 1. Direct appends to the SQLite log, one writer: parts (the common
    // frame), then prompts (folded into the session's meta).
    for (what, frame) in [("parts", part as fn(u64) -> FrameBody), ("prompts", prompt)] {
        let s = SessionId::parse(format!("direct-{what}"))?;
        log.create(&s).await?;
        let t = Instant::now();
        for i in 0..direct_n {
            log.append(&s, AppendRequest::new(frame(i))).await?;
        }
        let el = t.elapsed();
        println!(
            "direct append of {what} (SqliteSessionLog, 1 writer): {direct_n} frames in {:.2?} = {:.0} frames/s",
            el,
            direct_n as f64 / el.as_secs_f64()
        );
    }

    // 2. HTTP appends: POST /messages, 16 concurrent writers. A session
    // holds one turn at a time, so one prompt opens a turn (no runtime runs
    // it here) and the writers store client answers in it (answers to no
    // pending request: stored, folded into nothing).
    create("http").await?;
    let opened = http
        .post(format!("{base}/v1/sessions/http/messages"))
        .json(&json!({"type": "prompt", "text": "open"}))
        .send()
        .await?;
    anyhow::ensure!(opened.status() == 200, "status {}", opened.status());
    let t = Instant::now();
    let writers = 16;
    let mut tasks = Vec::new();
    for w in 0..writers {
        let (http, base) = (http.clone(), base.clone());
        tasks.push(tokio::spawn(async move {
            for i in 0..http_n / writers {
                let r = http
                    .post(format!("{base}/v1/sessions/http/messages"))
                    .json(&json!({"type": "approval-response", "approvalId": format!("w{w} m{i}"), "approved": true}))
                    .send()
                    .await?;
                anyhow::ensure!(r.status() == 200, "status {}", r.status());
            }
            anyhow::Ok(())
        }));
    }
    for task in tasks {
        task.await??;
    }
    let el = t.elapsed();
    let n = (http_n / writers) * writers;
    println!(
        "HTTP append (POST /messages, {writers} writers): {n} frames in {:.2?} = {:.0} frames/s",
        el,
        n as f64 / el.as_secs_f64()
    );

    // 3. Runner stream over one WebSocket (pipelined, acks counted).
    create("ws").await?;
    let (mut runner, _) = tokio_tungstenite::connect_async(format!(
        "ws://{addr}/v1/sessions/ws/ws?role=runner&generation=1"
    ))
    .await?;
    let t = Instant::now();
    let ws_n = http_n;
    let (mut sink, mut stream) = runner.split();
    let sender = tokio::spawn(async move {
        for i in 0..ws_n {
            let m =
                json!({"type": "part", "turnId": "t", "part": {"type": "raw", "value": {"i": i}}});
            sink.send(Message::Text(m.to_string().into())).await?;
        }
        anyhow::Ok(sink)
    });
    let mut acks = 0;
    while acks < ws_n {
        if let Some(Ok(Message::Text(t))) = stream.next().await {
            if t.as_str().contains("\"ack\"") {
                acks += 1;
            }
        }
    }
    let el = t.elapsed();
    runner = sender.await??.reunite(stream)?;
    let _ = runner.close(None).await;
    println!(
        "WebSocket runner append (pipelined): {ws_n} frames in {:.2?} = {:.0} frames/s",
        el,
        ws_n as f64 / el.as_secs_f64()
    );

    // 4. Live-delivery latency to many SSE readers.
    create("live").await?;
    let opened = reqwest::Client::new()
        .post(format!("{base}/v1/sessions/live/messages"))
        .json(&json!({"type": "prompt", "text": "open"}))
        .send()
        .await?;
    anyhow::ensure!(opened.status() == 200);
    let start = Instant::now();
    let mut reader_tasks = Vec::new();
    let (ready_tx, mut ready_rx) = tokio::sync::mpsc::unbounded_channel::<()>();
    let total = rate * secs;
    for _ in 0..readers {
        let http = reqwest::Client::new();
        let url = format!("{base}/v1/sessions/live/events");
        let ready = ready_tx.clone();
        reader_tasks.push(tokio::spawn(async move {
            let r = http.get(url).send().await?;
            let _ = ready.send(());
            let mut body = r.bytes_stream();
            let mut buf = String::new();
            let mut lat = Vec::new();
            let mut got = 0;
            while got < total {
                let Some(chunk) = body.next().await else {
                    break;
                };
                buf.push_str(&String::from_utf8_lossy(&chunk?));
                while let Some(end) = buf.find("\n\n") {
                    let block: String = buf.drain(..end + 2).collect();
                    let Some(data) = block.lines().find_map(|l| l.strip_prefix("data: ")) else {
                        continue;
                    };
                    let v: Value = serde_json::from_str(data)?;
                    if let Some(sent) = v["body"]["approvalId"]
                        .as_str()
                        .and_then(|s| s.parse::<u128>().ok())
                    {
                        let now = start.elapsed().as_micros();
                        lat.push((now.saturating_sub(sent)) as f64 / 1000.0);
                        got += 1;
                    }
                }
            }
            anyhow::Ok(lat)
        }));
    }
    drop(ready_tx);
    // Each reader signals once its response head arrived (its sender lives
    // on in the task, so count rather than wait for the channel to close).
    let mut connected = 0;
    while connected < readers && ready_rx.recv().await.is_some() {
        connected += 1;
    }
    // The SSE response head arrives before the reader is registered with
    // the actor; every reader asks for the whole history (after=0), so no
    // frame is missed either way. Give registration a moment.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut tick = tokio::time::interval(Duration::from_micros(1_000_000 / rate));
    let writer = reqwest::Client::new();
    for _ in 0..total {
        tick.tick().await;
        let sent = start.elapsed().as_micros().to_string();
        let r = writer
            .post(format!("{base}/v1/sessions/live/messages"))
            .json(&json!({"type": "approval-response", "approvalId": sent, "approved": true}))
            .send()
            .await?;
        anyhow::ensure!(r.status() == 200);
    }
    let mut all = Vec::new();
    for task in reader_tasks {
        all.extend(task.await??);
    }
    all.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    println!(
        "live delivery to {connected} SSE readers, {rate} frames/s for {secs} s: {} deliveries, p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
        all.len(),
        percentile(&all, 0.5),
        percentile(&all, 0.99),
        all.last().copied().unwrap_or(f64::NAN)
    );

    // 5. Replay of a long session.
    let s = SessionId::parse("replay")?;
    log.create(&s).await?;
    let t = Instant::now();
    for i in 0..replay_n {
        log.append(&s, AppendRequest::new(part(i))).await?;
    }
    println!("(filled {replay_n} frames in {:.2?})", t.elapsed());
    let t = Instant::now();
    let mut after = 0;
    loop {
        let page = log.read(&s, after, 1000).await?;
        let Some(last) = page.last() else { break };
        after = last.seq;
    }
    println!(
        "replay {replay_n} frames, direct log.read pages of 1000: {:.2?}",
        t.elapsed()
    );
    let t = Instant::now();
    let frames: Vec<Value> = http
        .get(format!("{base}/v1/sessions/replay/export"))
        .send()
        .await?
        .json()
        .await?;
    anyhow::ensure!(frames.len() as u64 == replay_n);
    println!(
        "replay {replay_n} frames, GET /export (one JSON array): {:.2?}",
        t.elapsed()
    );
    let t = Instant::now();
    let r = http
        .get(format!("{base}/v1/sessions/replay/events?after=0"))
        .send()
        .await?;
    let mut body = r.bytes_stream();
    let mut count = 0u64;
    let mut tail = String::new();
    while count < replay_n {
        let Some(chunk) = body.next().await else {
            break;
        };
        tail.push_str(&String::from_utf8_lossy(&chunk?));
        const MARK: &str = "event: frame";
        count += tail.matches(MARK).count() as u64;
        if let Some(pos) = tail.rfind(MARK) {
            tail.drain(..pos + MARK.len());
        }
        // Keep at most a cut marker (shorter than a whole one) for the next chunk.
        let cut = tail.floor_char_boundary(tail.len().saturating_sub(MARK.len() - 1));
        tail.drain(..cut);
    }
    println!(
        "replay {replay_n} frames, SSE /events?after=0: {:.2?} ({count} events)",
        t.elapsed()
    );
    Ok(())
}
