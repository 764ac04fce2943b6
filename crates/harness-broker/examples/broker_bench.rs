//! What the broker costs: the same streamed model request straight to the
//! (scripted) provider, through the broker's TCP listener, and through a
//! session's Unix socket (what a sandbox's forward reaches) — round trips
//! of a short answer (p50/p99), and the throughput of a long one.
//!
//! ```text
//! cargo run --release -p harness-broker --example broker_bench
//! BENCH_REQUESTS=2000 cargo run --release -p harness-broker --example broker_bench
//! ```
//!
//! One process, loopback only, one connection per request (as the agents'
//! HTTP clients mostly do through the forward); the same hand-written
//! HTTP/1.1 client on every path, so only the path differs.

use std::time::{Duration, Instant};

use harness_broker::{Broker, BrokerConfig, Upstream};
use harness_core::broker::{ModelBroker, Reach};
use harness_core::sandbox::NetworkPolicy;
use harness_testkit::model::{any, last_user_text_contains, Reply, Script, ScriptedModel};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

enum Path {
    Tcp(std::net::SocketAddr),
    Unix(std::path::PathBuf),
}

async fn exchange<S: AsyncRead + AsyncWrite + Unpin>(
    mut s: S,
    path: &str,
    token: &str,
    prompt: &str,
) -> usize {
    let body = format!(
        r#"{{"model":"m","max_tokens":10,"stream":true,"messages":[{{"role":"user","content":"{prompt}"}}]}}"#
    );
    let req = format!(
        "POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nx-api-key: {token}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = Vec::with_capacity(64 * 1024);
    s.read_to_end(&mut out).await.unwrap();
    assert!(
        out.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&out[..out.len().min(300)])
    );
    out.len()
}

async fn one(path: &Path, url_path: &str, token: &str, prompt: &str) -> usize {
    match path {
        Path::Tcp(addr) => {
            let s = tokio::net::TcpStream::connect(addr).await.unwrap();
            s.set_nodelay(true).unwrap();
            exchange(s, url_path, token, prompt).await
        }
        Path::Unix(p) => {
            exchange(
                tokio::net::UnixStream::connect(p).await.unwrap(),
                url_path,
                token,
                prompt,
            )
            .await
        }
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let n: usize = std::env::var("BENCH_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    let big: String = "lorem ipsum dolor sit amet ".repeat(40_000); // ~1 MB of text
    let model = ScriptedModel::start(
        Script::new()
            .on(last_user_text_contains("long"), Reply::text(big.clone()))
            .on(any(), Reply::text("ok")),
    )
    .await?;
    let dir = tempfile::tempdir()?;
    let broker = Broker::start(BrokerConfig {
        dir: dir.path().join("broker"),
        anthropic: Some(Upstream {
            base_url: model.base_url(),
            api_key: "sk-bench".into(),
        }),
        openai: None,
    })
    .await?;
    broker.forwards("bench", &NetworkPolicy::DenyAll).await?;
    broker
        .agent_env("bench", &NetworkPolicy::DenyAll, Reach::Forwarded)
        .await?;
    let token = broker.token("bench");
    let paths = [
        (
            "direct to the provider",
            Path::Tcp(model.addr()),
            "/v1/messages".to_string(),
        ),
        (
            "broker, TCP",
            Path::Tcp(broker.tcp_addr()?),
            "/s/bench/anthropic/v1/messages".to_string(),
        ),
        (
            "broker, session socket",
            Path::Unix(broker.socket_path("bench")),
            "/s/bench/anthropic/v1/messages".to_string(),
        ),
    ];
    println!(
        "{n} short streamed answers per path, then 20 answers of {} KB",
        big.len() / 1024
    );
    let mut base: Option<(f64, f64, f64)> = None;
    for (name, path, url) in &paths {
        for _ in 0..20 {
            one(path, url, &token, "warm").await; // warm-up
        }
        let mut ms = Vec::with_capacity(n);
        for _ in 0..n {
            let t = Instant::now();
            one(path, url, &token, "short").await;
            ms.push(t.elapsed().as_secs_f64() * 1e3);
        }
        ms.sort_by(f64::total_cmp);
        let (p50, p99) = (percentile(&ms, 0.5), percentile(&ms, 0.99));
        let t = Instant::now();
        let mut bytes = 0;
        for _ in 0..20 {
            bytes += one(path, url, &token, "long").await;
        }
        let mbps = bytes as f64 / 1e6 / t.elapsed().as_secs_f64();
        match base {
            None => {
                println!("{name:<24} p50 {p50:.3} ms  p99 {p99:.3} ms  long: {mbps:.1} MB/s");
                base = Some((p50, p99, mbps));
            }
            Some((b50, b99, bmbps)) => println!(
                "{name:<24} p50 {p50:.3} ms (x{:.2})  p99 {p99:.3} ms (x{:.2})  long: {mbps:.1} MB/s (x{:.2})",
                p50 / b50,
                p99 / b99,
                mbps / bmbps
            ),
        }
    }
    let usage = broker.usage("bench")?;
    println!(
        "counted for the session: {} requests, {:.1} MB passed back, {} output tokens",
        usage.requests,
        usage.response_bytes as f64 / 1e6,
        usage.output_tokens
    );
    tokio::time::sleep(Duration::from_millis(10)).await;
    Ok(())
}
