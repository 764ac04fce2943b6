//! Session log figures (issue 17, "the log keeps up"), each next to a
//! baseline measured in the same run:
//!
//! 1. appends: direct to `SqliteSessionLog` (1 and 16 writers) and over HTTP
//!    `POST /messages` with 16 writers (one session; 16 sessions), with
//!    group commit (the default) and without (`HubConfig::max_batch = 1`,
//!    `SqliteSessionLog::with_max_group(1)`: every append its own commit,
//!    one actor input at a time — the path before group commit);
//! 2. live delivery to 1,000 SSE readers while a writer stores 50 and then
//!    1,000 frames/s, on the session stream (`/v1/sessions/<id>/events`),
//!    the Durable Streams session stream (`/v1/stream/sessions/<id>`,
//!    `live=sse`) and, side by side, a generic stream of the reference
//!    Durable Streams server (npm `@durable-streams/server`), and the floor:
//!    a bare fan-out server (`support/floor.rs`: each event encoded once,
//!    one `write` per reader of what is queued for it, raw TCP, no log)
//!    with the same readers and writer, and that floor with each event
//!    appended to a SQLite log before it goes out (what durability adds); latency = the reader's receive time − the writer's send time,
//!    per delivery; "lag growth" = p50 of the last fifth of the frames sent
//!    − p50 of the first fifth (≈ 0 when readers keep up);
//!    and with the audit chain next to the same log without it
//!    (`ChainKey::off`), three interleaved rounds each;
//! 3. replay of 100,000 frames on every read path (SSE `/events`, WebSocket
//!    `after=0`, Durable Streams GET, `/export`, `/frames` pages) against
//!    `log.read` pages straight from the log.
//!
//! ```text
//! cargo run --release -p session-server --example bench
//! # knobs: BENCH_HTTP (20000) BENCH_WRITERS (16) BENCH_DIRECT (20000)
//! #        BENCH_READERS (1000) BENCH_RATES (50,1000) BENCH_SECS (10)
//! #        BENCH_REPLAY (100000) BENCH_ONLY (append,live,replay)
//! #        BENCH_ROUNDS (1: live-delivery rounds, every target once per round)
//! #        BENCH_REFERENCE (1; 0 skips the reference server)
//! ```
//!
//! Our servers run on their own 2-thread tokio runtime in this process (the
//! client has its own), over real TCP on 127.0.0.1, SQLite log in a temp
//! dir. Results: `docs/session-server.md`, `docs/durable-streams.md`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{SinkExt, StreamExt};
use harness_core::frame::FrameBody;
use harness_core::log::{AppendRequest, SessionLog};
use harness_core::SessionId;
use serde_json::json;
use session_log::SqliteSessionLog;
use session_runtime::Hub;
use session_server::{ServerConfig, SessionServer};
use tokio_tungstenite::tungstenite::Message;

#[path = "support/servers.rs"]
mod servers;

#[path = "support/stats.rs"]
mod stats;
use stats::{env, percentile};

#[path = "support/floor.rs"]
mod floor;

/// A runner's part: what most of a session's frames are.
fn part(i: u64) -> FrameBody {
    FrameBody::Part {
        turn_id: "t1".into(),
        part: harness_core::part::StreamPart::Raw {
            value: json!({"line": format!("frame {i}: the quick brown fox jumps over the lazy dog")}),
        },
    }
}

fn sorted(mut v: Vec<f64>) -> Vec<f64> {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    v
}

/// Our server over a SQLite log in `dir`, grouped or not.
struct Ours {
    base: String,
    log: Arc<SqliteSessionLog>,
    _server: servers::Server,
}

fn start_ours(dir: &std::path::Path, name: &str, grouped: bool) -> anyhow::Result<Ours> {
    let mut log = SqliteSessionLog::open(dir.join(format!("{name}.db")))?;
    if !grouped {
        log = log.with_max_group(1);
    }
    let log = Arc::new(log);
    let mut config = ServerConfig::new(log.clone());
    config.insecure_no_auth = true;
    let mut hub_config = config.hub_config();
    if !grouped {
        hub_config.max_batch = 1;
    }
    // The hub's actors run on the runtime it is made on: the server's.
    let (listener, base, rt) = servers::listener_and_runtime("ours-server")?;
    let hub_log = log.clone();
    rt.spawn(async move {
        let hub = Hub::new(hub_log, hub_config);
        let listener = tokio::net::TcpListener::from_std(listener).expect("listener");
        // As `harness serve` serves it (TCP_NODELAY on every connection).
        SessionServer::with_hub(config, hub)
            .serve(listener)
            .await
            .expect("serve");
    });
    Ok(Ours {
        base,
        log,
        _server: servers::Server::Ours(Some(rt)),
    })
}

async fn create(http: &reqwest::Client, base: &str, id: &str) -> anyhow::Result<()> {
    let r = http
        .post(format!("{base}/v1/sessions"))
        .json(&json!({"id": id}))
        .send()
        .await?;
    anyhow::ensure!(r.status().is_success(), "create {id}: {}", r.status());
    Ok(())
}

async fn post_message(
    http: &reqwest::Client,
    base: &str,
    id: &str,
    m: serde_json::Value,
) -> anyhow::Result<()> {
    let r = http
        .post(format!("{base}/v1/sessions/{id}/messages"))
        .json(&m)
        .send()
        .await?;
    anyhow::ensure!(r.status() == 200, "POST {id}/messages: {}", r.status());
    Ok(())
}

/// Create `id` with one open turn, so client answers are stored.
async fn session_with_turn(http: &reqwest::Client, base: &str, id: &str) -> anyhow::Result<()> {
    create(http, base, id).await?;
    post_message(http, base, id, json!({"type": "prompt", "text": "open"})).await
}

fn answer(id: String) -> serde_json::Value {
    json!({"type": "approval-response", "approvalId": id, "approved": true})
}

/// `n` answers over HTTP from `writers` concurrent writers, into one
/// session or one session each. Frames/s.
async fn http_appends(
    base: &str,
    tag: &str,
    n: u64,
    writers: u64,
    spread: bool,
) -> anyhow::Result<f64> {
    let http = reqwest::Client::new();
    let sessions: Vec<String> = if spread {
        (0..writers).map(|w| format!("{tag}-{w}")).collect()
    } else {
        vec![tag.to_string()]
    };
    for s in &sessions {
        session_with_turn(&http, base, s).await?;
    }
    let per = n / writers;
    let t = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..writers {
        let (http, base) = (http.clone(), base.to_string());
        let s = sessions[w as usize % sessions.len()].clone();
        tasks.push(tokio::spawn(async move {
            for i in 0..per {
                post_message(&http, &base, &s, answer(format!("w{w} m{i}"))).await?;
            }
            anyhow::Ok(())
        }));
    }
    for task in tasks {
        task.await??;
    }
    Ok((per * writers) as f64 / t.elapsed().as_secs_f64())
}

/// `n` appends straight to the log from `writers` tasks, one session.
async fn direct_appends(
    log: &Arc<SqliteSessionLog>,
    tag: &str,
    n: u64,
    writers: u64,
) -> anyhow::Result<f64> {
    let s = SessionId::parse(tag)?;
    log.create(&s).await?;
    let per = n / writers;
    let t = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..writers {
        let (log, s) = (log.clone(), s.clone());
        tasks.push(tokio::spawn(async move {
            for i in 0..per {
                log.append(&s, AppendRequest::new(part(i))).await?;
            }
            anyhow::Ok(())
        }));
    }
    for task in tasks {
        task.await??;
    }
    Ok((per * writers) as f64 / t.elapsed().as_secs_f64())
}

fn row(label: &str, new: f64, base: f64, unit: &str) {
    println!(
        "| {label} | {new:.0} {unit} | {base:.0} {unit} | x{:.2} |",
        new / base
    );
}

async fn bench_appends(dir: &std::path::Path) -> anyhow::Result<()> {
    let http_n = env("BENCH_HTTP", 20_000);
    let writers = env("BENCH_WRITERS", 16).max(1);
    let direct_n = env("BENCH_DIRECT", 20_000);
    let grouped = start_ours(dir, "append-grouped", true)?;
    let single = start_ours(dir, "append-single", false)?;
    // Alternate the two servers so load changes hit both alike.
    let mut results = Vec::new();
    for (what, spread) in [("one session", false), ("one session each", true)] {
        let g = http_appends(
            &grouped.base,
            &format!("http-{spread}"),
            http_n,
            writers,
            spread,
        )
        .await?;
        let s = http_appends(
            &single.base,
            &format!("http-{spread}"),
            http_n,
            writers,
            spread,
        )
        .await?;
        results.push((
            format!("HTTP POST /messages, {writers} writers, {what}"),
            g,
            s,
        ));
    }
    for w in [1, writers] {
        let g = direct_appends(&grouped.log, &format!("direct-{w}"), direct_n, w).await?;
        let s = direct_appends(&single.log, &format!("direct-{w}"), direct_n, w).await?;
        results.push((
            format!("direct SqliteSessionLog::append, {w} writer(s)"),
            g,
            s,
        ));
    }
    // A runner's parts over one WebSocket, pipelined (acks counted).
    for (server, slot) in [(&grouped, 0), (&single, 1)] {
        let v = ws_runner(&server.base, http_n / 4).await?;
        if slot == 0 {
            results.push(("WebSocket runner parts, pipelined".into(), v, 0.0));
        } else if let Some(last) = results.last_mut() {
            last.2 = v;
        }
    }
    println!();
    println!("| appends (frames/s) | group commit | one commit per append | ratio |");
    println!("|---|---:|---:|---:|");
    for (label, g, s) in results {
        row(&label, g, s, "/s");
    }
    bench_chain(dir, direct_n, writers).await
}

/// What the audit chain costs an append: direct appends to a log keyed as
/// `harness` keys it next to the same log with the chain off
/// (`ChainKey::off`: no HMAC, no hash stored), interleaved, every round
/// printed.
async fn bench_chain(dir: &std::path::Path, n: u64, writers: u64) -> anyhow::Result<()> {
    use harness_core::log::ChainKey;
    let keyed = Arc::new(
        SqliteSessionLog::open(dir.join("chain-keyed.db"))?
            .with_chain_key(ChainKey::new([7u8; 32])),
    );
    let off =
        Arc::new(SqliteSessionLog::open(dir.join("chain-off.db"))?.with_chain_key(ChainKey::off()));
    println!();
    println!("| appends with the audit chain (frames/s) | chained (keyed) | no chain | ratio |");
    println!("|---|---:|---:|---:|");
    for w in [1, writers] {
        for round in 1..=3 {
            let tag = format!("chain-{w}-{round}");
            let c = direct_appends(&keyed, &tag, n, w).await?;
            let o = direct_appends(&off, &tag, n, w).await?;
            row(
                &format!("direct append, {w} writer(s), round {round}"),
                c,
                o,
                "/s",
            );
        }
    }
    Ok(())
}

async fn ws_runner(base: &str, n: u64) -> anyhow::Result<f64> {
    let http = reqwest::Client::new();
    create(&http, base, "ws").await?;
    let addr = base.trim_start_matches("http://");
    let (runner, _) = tokio_tungstenite::connect_async(format!(
        "ws://{addr}/v1/sessions/ws/ws?role=runner&generation=1"
    ))
    .await?;
    let t = Instant::now();
    let (mut sink, mut stream) = runner.split();
    let sender = tokio::spawn(async move {
        for i in 0..n {
            let m =
                json!({"type": "part", "turnId": "t", "part": {"type": "raw", "value": {"i": i}}});
            sink.send(Message::Text(m.to_string().into())).await?;
        }
        anyhow::Ok(sink)
    });
    let mut acks = 0;
    while acks < n {
        match stream.next().await {
            Some(Ok(Message::Text(t))) if t.as_str().contains("\"ack\"") => acks += 1,
            Some(Ok(_)) => {}
            other => anyhow::bail!("runner socket ended: {other:?}"),
        }
    }
    let el = t.elapsed();
    let _ = sender.await?;
    Ok(n as f64 / el.as_secs_f64())
}

// ---- live delivery -----------------------------------------------------------

/// Which stream a reader follows.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Target {
    /// `GET /v1/sessions/<id>/events` (SSE).
    SessionSse,
    /// `GET /v1/stream/sessions/<id>?offset=-1&live=sse`.
    DsSession,
    /// A generic stream of the reference Durable Streams server.
    Reference,
    /// The bare fan-out server (`support/floor.rs`): the floor.
    Floor,
    /// The same with each event appended to a SQLite log before it goes
    /// out (`floor::start_durable`): what durability alone adds.
    DurableFloor,
}

impl Target {
    fn name(self) -> &'static str {
        match self {
            Target::SessionSse => "ours: session SSE /events",
            Target::DsSession => "ours: DS session stream",
            Target::Reference => "reference DS server (generic stream)",
            Target::Floor => "floor: bare fan-out, raw TCP",
            Target::DurableFloor => "floor + append before fan-out",
        }
    }
}

/// Every number after `marker` in `text`, in order.
fn numbers_after(text: &str, marker: &str, mut each: impl FnMut(u64)) {
    let mut rest = text;
    while let Some(at) = rest.find(marker) {
        rest = &rest[at + marker.len()..];
        let end = rest
            .bytes()
            .position(|c| !c.is_ascii_digit())
            .unwrap_or(rest.len());
        if let Ok(n) = rest[..end].parse() {
            each(n);
        }
        rest = &rest[end..];
    }
}

/// A chunked transfer-coding decoder (sizes, data, CRLFs; trailers are
/// not expected on an endless SSE body).
#[derive(Default)]
struct Chunked {
    /// Data bytes left in the current chunk.
    left: usize,
    /// The CRLF after a chunk's data is still to skip.
    crlf: bool,
    ended: bool,
}

impl Chunked {
    /// Decode what `raw` holds into `out`; consumed bytes are removed.
    fn feed(&mut self, raw: &mut Vec<u8>, out: &mut Vec<u8>) -> anyhow::Result<()> {
        let mut pos = 0;
        while pos < raw.len() && !self.ended {
            if self.left > 0 {
                let n = self.left.min(raw.len() - pos);
                out.extend_from_slice(&raw[pos..pos + n]);
                pos += n;
                self.left -= n;
                self.crlf = self.left == 0;
            } else if self.crlf {
                if raw.len() - pos < 2 {
                    break;
                }
                anyhow::ensure!(&raw[pos..pos + 2] == b"\r\n", "bad chunk end");
                pos += 2;
                self.crlf = false;
            } else {
                let Some(eol) = raw[pos..].windows(2).position(|w| w == b"\r\n") else {
                    break;
                };
                let line = std::str::from_utf8(&raw[pos..pos + eol])?;
                let hex = line.split(';').next().unwrap_or("").trim();
                let size = usize::from_str_radix(hex, 16)?;
                pos += eol + 2;
                if size == 0 {
                    self.ended = true;
                } else {
                    self.left = size;
                }
            }
        }
        raw.drain(..pos);
        Ok(())
    }
}

/// One SSE reader on its own TCP connection, as lean as a client can be so
/// that 1,000 of them measure the server rather than themselves: a raw
/// HTTP/1.1 GET, the chunked body decoded by hand, whole events scanned
/// for the writer's send stamps (after `marker`) without an SSE parser.
/// Our streams' frames must arrive gap-free and in order (`"seq":`, checked
/// from 1); Durable Streams readers reconnect from the last
/// `streamNextOffset`. Returns (send stamp, latency ms) per delivery.
async fn live_reader(
    base: String,
    path: String,
    target: Target,
    start: Instant,
    total: usize,
    deadline: tokio::time::Instant,
    ready: tokio::sync::mpsc::UnboundedSender<()>,
) -> anyhow::Result<Vec<(u64, f64)>> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let marker = match target {
        Target::Reference => "\"t\":",
        _ => "\"approvalId\":\"",
    };
    let ds = matches!(target, Target::DsSession | Target::Reference);
    let addr = base
        .trim_start_matches("http://")
        .split('/')
        .next()
        .unwrap_or_default()
        .to_string();
    let mut got = Vec::with_capacity(total);
    let mut last_seq = 0u64;
    let mut offset = "-1".to_string();
    let mut ready = Some(ready);
    let mut raw = Vec::with_capacity(64 * 1024);
    let mut events = Vec::with_capacity(64 * 1024);
    while got.len() < total && tokio::time::Instant::now() < deadline {
        let target_path = if ds {
            format!("{path}?offset={offset}&live=sse")
        } else {
            path.clone()
        };
        let connected = tokio::time::timeout_at(deadline, async {
            let mut tcp = tokio::net::TcpStream::connect(&addr).await?;
            tcp.set_nodelay(true)?;
            let request = format!(
                "GET {target_path} HTTP/1.1\r\nHost: {addr}\r\nAccept: text/event-stream\r\n\r\n"
            );
            tcp.write_all(request.as_bytes()).await?;
            anyhow::Ok(tcp)
        })
        .await;
        let mut tcp = match connected {
            Ok(Ok(tcp)) => tcp,
            Ok(Err(e)) if ready.is_some() => return Err(e),
            Ok(Err(_)) => {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
            Err(_) => break,
        };
        // The response head.
        raw.clear();
        events.clear();
        let head_end = loop {
            if let Some(at) = raw.windows(4).position(|w| w == b"\r\n\r\n") {
                break Some(at + 4);
            }
            match tokio::time::timeout_at(deadline, tcp.read_buf(&mut raw)).await {
                Ok(Ok(n)) if n > 0 => {}
                _ => break None,
            }
        };
        let Some(head_end) = head_end else { continue };
        let head = String::from_utf8_lossy(&raw[..head_end]).to_ascii_lowercase();
        anyhow::ensure!(
            head.starts_with("http/1.1 200"),
            "SSE GET: {}",
            head.lines().next().unwrap_or("")
        );
        let mut chunked = head
            .contains("transfer-encoding: chunked")
            .then(Chunked::default);
        raw.drain(..head_end);
        if let Some(r) = ready.take() {
            let _ = r.send(());
        }
        let mut now = start.elapsed().as_micros() as u64;
        loop {
            match &mut chunked {
                Some(c) => c.feed(&mut raw, &mut events)?,
                None => events.append(&mut raw),
            }
            // Whole events only (a stamp may be cut by a chunk boundary).
            if let Some(end) = events.windows(2).rposition(|w| w == b"\n\n") {
                let text = std::str::from_utf8(&events[..end + 2])?;
                if !ds || target == Target::DsSession {
                    let mut order = Ok(());
                    numbers_after(text, "{\"seq\":", |seq| {
                        if order.is_ok() && seq != last_seq + 1 {
                            order = Err(anyhow::anyhow!("frame {seq} after {last_seq}"));
                        }
                        last_seq = seq;
                    });
                    order?;
                }
                numbers_after(text, marker, |sent| {
                    got.push((sent, now.saturating_sub(sent) as f64 / 1000.0))
                });
                if ds {
                    let key = "\"streamNextOffset\":\"";
                    if let Some(at) = text.rfind(key) {
                        let rest = &text[at + key.len()..];
                        if let Some(q) = rest.find('"') {
                            offset = rest[..q].to_string();
                        }
                    }
                }
                events.drain(..end + 2);
            }
            if got.len() >= total || chunked.as_ref().is_some_and(|c| c.ended) {
                break;
            }
            match tokio::time::timeout_at(deadline, tcp.read_buf(&mut raw)).await {
                Ok(Ok(n)) if n > 0 => now = start.elapsed().as_micros() as u64,
                _ => break,
            }
        }
        if !ds {
            break;
        }
    }
    Ok(got)
}

#[derive(Debug, Default)]
struct Live {
    deliveries: usize,
    expected: usize,
    complete: usize,
    p50: f64,
    p99: f64,
    max: f64,
    lag_growth: f64,
    /// The writes' answer times (issue → response), ms.
    write_p50: f64,
    write_p99: f64,
}

async fn bench_live_one(
    base: &str,
    target: Target,
    readers: u64,
    rate: u64,
    secs: u64,
    tag: &str,
) -> anyhow::Result<Live> {
    let http = reqwest::Client::new();
    type Write = Box<dyn Fn(&reqwest::Client, u64) -> reqwest::RequestBuilder + Send + Sync>;
    let (url, write): (String, Write) = match target {
        Target::SessionSse | Target::DsSession | Target::Floor | Target::DurableFloor => {
            let (url, post) = match target {
                Target::Floor | Target::DurableFloor => {
                    (format!("{base}/floor"), format!("{base}/floor"))
                }
                _ => {
                    session_with_turn(&http, base, tag).await?;
                    let url = if target == Target::SessionSse {
                        format!("{base}/v1/sessions/{tag}/events")
                    } else {
                        format!("{base}/v1/stream/sessions/{tag}")
                    };
                    (url, format!("{base}/v1/sessions/{tag}/messages"))
                }
            };
            (
                url,
                Box::new(move |http, t| http.post(&post).json(&answer(t.to_string()))),
            )
        }
        Target::Reference => {
            let url = format!("{base}/v1/stream/{tag}");
            let r = http
                .put(&url)
                .header("content-type", "application/json")
                .send()
                .await?;
            anyhow::ensure!(r.status().is_success(), "PUT {url}: {}", r.status());
            let post = url.clone();
            (
                url,
                Box::new(move |http, t| {
                    http.post(&post)
                        .header("content-type", "application/json")
                        .body(json!({"t": t}).to_string())
                }),
            )
        }
    };
    let total = (rate * secs) as usize;
    let start = Instant::now();
    let (ready_tx, mut ready_rx) = tokio::sync::mpsc::unbounded_channel();
    let mut tasks = Vec::new();
    for _ in 0..readers {
        // One TCP connection per reader.
        let path = url[base.len()..].to_string();
        let (base, ready) = (base.to_string(), ready_tx.clone());
        let deadline = tokio::time::Instant::now() + Duration::from_secs(secs + 30);
        tasks.push(tokio::spawn(live_reader(
            base, path, target, start, total, deadline, ready,
        )));
    }
    drop(ready_tx);
    let mut connected = 0;
    while connected < readers && ready_rx.recv().await.is_some() {
        connected += 1;
    }
    // Every reader starts at the stream's beginning, so none misses a frame
    // however late it is registered; this only lets registration settle.
    tokio::time::sleep(Duration::from_millis(500)).await;
    // The writer keeps its rate whatever the server's answer time: each
    // write is its own task (at most 256 in flight), stamped when issued.
    // It runs on a thread and runtime of its own, as a separate client
    // would, so its writes are not issued late behind the readers' tasks.
    let writer = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        rt.block_on(async move {
            let http = reqwest::Client::new();
            let mut tick = tokio::time::interval(Duration::from_micros(1_000_000 / rate));
            let in_flight = Arc::new(tokio::sync::Semaphore::new(256));
            let mut writes = Vec::with_capacity(total);
            for _ in 0..total {
                tick.tick().await;
                let permit = in_flight.clone().acquire_owned().await?;
                let sent = start.elapsed().as_micros() as u64;
                let request = write(&http, sent);
                writes.push(tokio::spawn(async move {
                    let issued = Instant::now();
                    let r = request.send().await?;
                    let answered = issued.elapsed().as_secs_f64() * 1000.0;
                    drop(permit);
                    anyhow::ensure!(r.status().is_success(), "write: {}", r.status());
                    anyhow::Ok(answered)
                }));
            }
            let written_in = start.elapsed();
            let mut answers = Vec::with_capacity(writes.len());
            for w in writes {
                answers.push(w.await??);
            }
            anyhow::Ok((written_in, answers))
        })
    });
    let (written_in, answers) = tokio::task::spawn_blocking(move || writer.join())
        .await?
        .map_err(|_| anyhow::anyhow!("the writer panicked"))??;
    let answers = sorted(answers);
    println!(
        "  ({total} writes issued in {:.1} s, all answered after {:.1} s)",
        written_in.as_secs_f64(),
        start.elapsed().as_secs_f64()
    );
    let mut all = Vec::new();
    let mut complete = 0;
    for t in tasks {
        let got = t.await??;
        complete += usize::from(got.len() >= total);
        all.extend(got);
    }
    // Lag growth: the first fifth of the frames sent against the last.
    let mut by_sent = all.clone();
    by_sent.sort_by_key(|(sent, _)| *sent);
    let fifth = by_sent.len() / 5;
    let p50_of = |s: &[(u64, f64)]| percentile(&sorted(s.iter().map(|x| x.1).collect()), 0.5);
    let lag_growth = if fifth > 0 {
        p50_of(&by_sent[by_sent.len() - fifth..]) - p50_of(&by_sent[..fifth])
    } else {
        f64::NAN
    };
    let lat = sorted(all.into_iter().map(|x| x.1).collect());
    Ok(Live {
        deliveries: lat.len(),
        expected: total * connected as usize,
        complete,
        p50: percentile(&lat, 0.5),
        p99: percentile(&lat, 0.99),
        max: lat.last().copied().unwrap_or(f64::NAN),
        lag_growth,
        write_p50: percentile(&answers, 0.5),
        write_p99: percentile(&answers, 0.99),
    })
}

async fn bench_live(dir: &std::path::Path) -> anyhow::Result<()> {
    let readers = env("BENCH_READERS", 1000);
    let secs = env("BENCH_SECS", 10);
    let rates: Vec<u64> = std::env::var("BENCH_RATES")
        .unwrap_or_else(|_| "50,1000".into())
        .split(',')
        .filter_map(|r| r.trim().parse().ok())
        .filter(|r| *r > 0)
        .collect();
    let reference = if env("BENCH_REFERENCE", 1) == 1 {
        match tokio::task::spawn_blocking(servers::install_reference).await? {
            Ok(entry) => {
                let launcher = dir.join("launch.mjs");
                std::fs::write(&launcher, servers::LAUNCHER)?;
                Some((entry, launcher))
            }
            Err(e) => {
                println!("reference server not installed ({e:#}): its rows are skipped");
                None
            }
        }
    } else {
        None
    };
    // Each round runs every target once per rate, interleaved, so a
    // machine that slows down mid-run slows a round's targets alike; the
    // ratios are taken within a round.
    let rounds = env("BENCH_ROUNDS", 1).max(1);
    let mut rows = Vec::new();
    for round in 1..=rounds {
        for &rate in &rates {
            for target in [
                Target::Floor,
                Target::DurableFloor,
                Target::SessionSse,
                Target::DsSession,
                Target::Reference,
            ] {
                // A fresh server per run, so one run's readers do not linger in the next.
                let result = match target {
                    Target::Floor => {
                        let (base, _server) = floor::start()?;
                        bench_live_one(&base, target, readers, rate, secs, "live").await
                    }
                    Target::DurableFloor => {
                        let log = SqliteSessionLog::open(
                            dir.join(format!("live-{round}-{rate}-floor.db")),
                        )?;
                        let session = SessionId::parse("floor")?;
                        log.create(&session).await?;
                        let (base, _server) = floor::start_durable(Arc::new(log), session)?;
                        bench_live_one(&base, target, readers, rate, secs, "live").await
                    }
                    Target::Reference => match &reference {
                        None => continue,
                        Some((entry, launcher)) => {
                            let (base, _server) = servers::serve_reference(entry, launcher, None)?;
                            bench_live_one(&base, target, readers, rate, secs, "live").await
                        }
                    },
                    _ => {
                        let ours =
                            start_ours(dir, &format!("live-{round}-{rate}-{target:?}"), true)?;
                        bench_live_one(&ours.base, target, readers, rate, secs, "live").await
                    }
                };
                match &result {
                    Ok(r) => println!("round {round}: {} @ {rate}/s: {r:?}", target.name()),
                    Err(e) => println!("round {round}: {} @ {rate}/s: FAILED {e:#}", target.name()),
                }
                rows.push((round, rate, target, result.ok()));
            }
        }
    }
    println!();
    println!("| live, {readers} SSE readers, {secs} s | round | frames/s | p50 ms | p99 ms | max ms | lag growth ms | deliveries | readers with all | p99 / reference p99 | p99 / floor p99 | p99 / durable floor p99 | write answered p50 / p99 ms |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for (round, rate, target, r) in &rows {
        // The p99 of `than` at this rate in this round, when it delivered
        // everything.
        let p99_of = |than: Target| {
            rows.iter()
                .find(|(o, r2, t, _)| o == round && r2 == rate && *t == than)
                .and_then(|(_, _, _, r)| r.as_ref())
                .filter(|r| r.deliveries == r.expected)
                .map(|r| r.p99)
        };
        match r {
            Some(r) => {
                let ratio = |base: Option<f64>| match base {
                    Some(base) if r.deliveries == r.expected => format!("{:.3}", r.p99 / base),
                    _ => "-".into(),
                };
                let (ratio, floor, durable) = (
                    ratio(p99_of(Target::Reference)),
                    ratio(p99_of(Target::Floor)),
                    ratio(p99_of(Target::DurableFloor)),
                );
                println!(
                    "| {} | {round} | {rate} | {:.2} | {:.2} | {:.2} | {:+.2} | {}/{} | {}/{readers} | {ratio} | {floor} | {durable} | {:.2} / {:.2} |",
                    target.name(),
                    r.p50,
                    r.p99,
                    r.max,
                    r.lag_growth,
                    r.deliveries,
                    r.expected,
                    r.complete,
                    r.write_p50,
                    r.write_p99
                );
            }
            None => println!(
                "| {} | {round} | {rate} | failed | | | | | | | | | |",
                target.name()
            ),
        }
    }
    Ok(())
}

// ---- replay ------------------------------------------------------------------

async fn timed<F, Fut>(f: F) -> anyhow::Result<(f64, u64)>
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<u64>>,
{
    let t = Instant::now();
    let n = f().await?;
    Ok((t.elapsed().as_secs_f64(), n))
}

/// Count `needle` in a streamed body, across chunk boundaries.
async fn count_in_stream(
    resp: reqwest::Response,
    needle: &str,
    stop_at: u64,
) -> anyhow::Result<u64> {
    let mut body = resp.bytes_stream();
    let mut count = 0u64;
    let mut tail = String::new();
    while count < stop_at {
        let Some(chunk) = body.next().await else {
            break;
        };
        tail.push_str(&String::from_utf8_lossy(&chunk?));
        count += tail.matches(needle).count() as u64;
        if let Some(pos) = tail.rfind(needle) {
            tail.drain(..pos + needle.len());
        }
        let cut = tail.floor_char_boundary(tail.len().saturating_sub(needle.len() - 1));
        tail.drain(..cut);
    }
    Ok(count)
}

async fn bench_replay(dir: &std::path::Path) -> anyhow::Result<()> {
    let n = env("BENCH_REPLAY", 100_000);
    let ours = start_ours(dir, "replay", true)?;
    let (base, log) = (ours.base.clone(), ours.log.clone());
    let s = SessionId::parse("replay")?;
    log.create(&s).await?;
    let t = Instant::now();
    // Filled by 16 concurrent appenders (group commit); order is irrelevant here.
    let mut tasks = Vec::new();
    for w in 0..16 {
        let (log, s) = (log.clone(), s.clone());
        tasks.push(tokio::spawn(async move {
            let mut i = w;
            while i < n {
                log.append(&s, AppendRequest::new(part(i))).await?;
                i += 16;
            }
            anyhow::Ok(())
        }));
    }
    for task in tasks {
        task.await??;
    }
    println!("(filled {n} frames in {:.2?})", t.elapsed());
    let http = reqwest::Client::new();
    let mut rows: Vec<(&str, f64, u64)> = Vec::new();
    let (secs, got) = timed(|| async {
        let mut after = 0;
        let mut count = 0;
        loop {
            let page = log.read(&s, after, 1000).await?;
            let Some(last) = page.last() else { break };
            after = last.seq;
            count += page.len() as u64;
        }
        Ok(count)
    })
    .await?;
    rows.push(("log.read, pages of 1000 (baseline)", secs, got));
    let (secs, got) = timed(|| async {
        let r = http
            .get(format!("{base}/v1/sessions/replay/events?after=0"))
            .send()
            .await?;
        count_in_stream(r, "event: frame", n).await
    })
    .await?;
    rows.push(("SSE GET /events?after=0", secs, got));
    let (secs, got) = timed(|| async {
        let addr = base.trim_start_matches("http://");
        let (mut ws, _) = tokio_tungstenite::connect_async(format!(
            "ws://{addr}/v1/sessions/replay/ws?role=client&after=0"
        ))
        .await?;
        let mut count = 0;
        while count < n {
            match ws.next().await {
                Some(Ok(Message::Text(t))) => {
                    count += t.as_str().matches("\"type\":\"frame\"").count() as u64
                }
                Some(Ok(_)) => {}
                _ => break,
            }
        }
        let _ = ws.close(None).await;
        Ok(count)
    })
    .await?;
    rows.push(("WebSocket ?after=0", secs, got));
    let (secs, got) = timed(|| async {
        let mut offset = "-1".to_string();
        let mut count = 0u64;
        for _ in 0..=n {
            let r = http
                .get(format!("{base}/v1/stream/sessions/replay?offset={offset}"))
                .send()
                .await?;
            anyhow::ensure!(r.status() == 200, "DS GET: {}", r.status());
            let next = r
                .headers()
                .get("stream-next-offset")
                .and_then(|v| v.to_str().ok())
                .map(str::to_string);
            let done = r.headers().contains_key("stream-up-to-date");
            let body = r.bytes().await?;
            let k = memchr_count(&body, b"\"seq\":");
            count += k;
            if done || k == 0 {
                break;
            }
            offset = next.ok_or_else(|| anyhow::anyhow!("no Stream-Next-Offset"))?;
        }
        Ok(count)
    })
    .await?;
    rows.push((
        "Durable Streams GET /v1/stream/sessions (catch-up pages)",
        secs,
        got,
    ));
    let (secs, got) = timed(|| async {
        let body = http
            .get(format!("{base}/v1/sessions/replay/export"))
            .send()
            .await?
            .bytes()
            .await?;
        Ok(memchr_count(&body, b"\"seq\":"))
    })
    .await?;
    rows.push(("GET /export (one JSON array)", secs, got));
    let (secs, got) = timed(|| async {
        let mut after = 0u64;
        let mut count = 0u64;
        loop {
            let body = http
                .get(format!(
                    "{base}/v1/sessions/replay/frames?after={after}&limit=10000"
                ))
                .send()
                .await?
                .bytes()
                .await?;
            let k = memchr_count(&body, b"\"seq\":");
            if k == 0 {
                break;
            }
            count += k;
            after += k;
        }
        Ok(count)
    })
    .await?;
    rows.push(("GET /frames, pages of 10000", secs, got));
    let baseline = rows[0].1;
    println!();
    println!("| replay of {n} frames | seconds | frames | / log.read |");
    println!("|---|---:|---:|---:|");
    for (label, secs, got) in rows {
        println!("| {label} | {secs:.3} | {got} | x{:.2} |", secs / baseline);
    }
    Ok(())
}

fn memchr_count(hay: &[u8], needle: &[u8]) -> u64 {
    hay.windows(needle.len()).filter(|w| *w == needle).count() as u64
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let only = std::env::var("BENCH_ONLY").ok();
    let wanted = |name: &str| {
        only.as_deref()
            .is_none_or(|o| o.split(',').any(|x| x.trim() == name))
    };
    if wanted("append") {
        bench_appends(dir.path()).await?;
    }
    if wanted("replay") {
        bench_replay(dir.path()).await?;
    }
    if wanted("live") {
        bench_live(dir.path()).await?;
    }
    Ok(())
}
