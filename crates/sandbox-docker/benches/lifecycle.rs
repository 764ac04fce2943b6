//! Sandbox lifecycle latency on the real Docker engine, side by side:
//!
//! - our `create → exec(true) → destroy` against `docker run --rm IMAGE true`
//!   (the spawned CLI);
//! - a warm start from an identity snapshot against a cold bootstrap (a
//!   recipe with a few pre-commands, run and committed each time), both as
//!   the whole create -> exec -> destroy and as the start alone (create and
//!   the first exec's exit: when the sandbox is usable);
//!
//! each without a pool (`pool_size` 0, the default) and with one
//! (`HARNESS_BENCH_POOL`, default 1), whose background fills are let
//! finish before every timed run, ours or the CLI's, so they never overlap
//! one: what is measured is a create that finds its pool ready.
//!
//! Run: `cargo bench -p sandbox-docker --bench lifecycle` (add
//! `--profile dev` to skip the release build; the numbers are dominated by
//! dockerd). `HARNESS_BENCH_N` sets the iterations (default 10),
//! `HARNESS_TEST_IMAGE` the image (default `harness-test:bookworm`).

use std::time::{Duration, Instant};

use harness_core::bootstrap::BootstrapRecipe;
use harness_core::sandbox::{collect_exec, ExecRequest, SandboxProvider, SandboxSpec};
use sandbox_docker::{DockerConfig, DockerProvider};

fn median_ms(mut samples: Vec<Duration>) -> f64 {
    samples.sort();
    let n = samples.len();
    let mid = if n % 2 == 1 {
        samples[n / 2]
    } else {
        (samples[n / 2 - 1] + samples[n / 2]) / 2
    };
    mid.as_secs_f64() * 1000.0
}

fn recipe(nonce: &str) -> BootstrapRecipe {
    BootstrapRecipe {
        files: vec![],
        bootstrap_pre_commands: vec![
            "mkdir -p /opt/bench /workspace".into(),
            format!("echo {nonce} > /opt/bench/nonce"),
            "ls /usr/bin > /opt/bench/tools.txt".into(),
        ],
        commands: vec!["sha256sum /opt/bench/tools.txt > /opt/bench/tools.sha".into()],
    }
}

/// One create -> exec(true) -> destroy: (the start, i.e. create and the
/// first exec's exit; the whole, with destroy).
async fn lifecycle_parts(provider: &DockerProvider, spec: &SandboxSpec) -> (Duration, Duration) {
    let started = Instant::now();
    let sb = provider.create(spec).await.expect("create");
    let out = collect_exec(sb.exec(ExecRequest::new(["true"])).await.expect("exec"))
        .await
        .expect("exec output");
    assert!(out.status.success());
    let start = started.elapsed();
    sb.destroy().await.expect("destroy");
    (start, started.elapsed())
}

async fn lifecycle(provider: &DockerProvider, spec: &SandboxSpec) -> Duration {
    lifecycle_parts(provider, spec).await.1
}

/// `docker run --rm IMAGE true`, timed.
fn cli_run(image: &str) -> Duration {
    let started = Instant::now();
    let status = std::process::Command::new("docker")
        .args(["run", "--rm", image, "true"])
        .status()
        .expect("docker CLI");
    assert!(status.success());
    started.elapsed()
}

/// Let a pool's background fills finish, so they never overlap a timed
/// run (ours or the CLI's): what is measured is a create that finds its
/// pool ready, as a pool sized for the demand does.
async fn settle(provider: &DockerProvider) {
    assert!(provider.pool_settled(Duration::from_secs(60)).await);
}

/// Medians of (ours, CLI) over `n` interleaved runs.
async fn versus_cli(
    provider: &DockerProvider,
    spec: &SandboxSpec,
    image: &str,
    n: usize,
) -> (f64, f64) {
    let mut ours = Vec::new();
    let mut cli = Vec::new();
    for _ in 0..n {
        settle(provider).await;
        ours.push(lifecycle(provider, spec).await);
        settle(provider).await;
        cli.push(cli_run(image));
    }
    (median_ms(ours), median_ms(cli))
}

/// Medians of warm and cold runs over `n` interleaved runs: (start, whole)
/// each; the snapshot images made are appended to `images`.
async fn warm_and_cold(
    provider: &DockerProvider,
    spec: &SandboxSpec,
    image: &str,
    n: usize,
    images: &mut Vec<String>,
) -> ((f64, f64), (f64, f64)) {
    let warm_nonce = uuid::Uuid::new_v4().simple().to_string();
    let mut warm_spec = spec.clone();
    warm_spec.bootstrap = Some(recipe(&warm_nonce));
    images.push(format!(
        "{}:{}",
        provider.config().snapshot_repo,
        recipe(&warm_nonce).identity(image)
    ));
    let _ = lifecycle(provider, &warm_spec).await; // builds the snapshot
    let mut warm = Vec::new();
    let mut cold = Vec::new();
    for _ in 0..n {
        settle(provider).await;
        warm.push(lifecycle_parts(provider, &warm_spec).await);
        let nonce = uuid::Uuid::new_v4().simple().to_string();
        let mut cold_spec = spec.clone();
        let r = recipe(&nonce);
        images.push(format!(
            "{}:{}",
            provider.config().snapshot_repo,
            r.identity(image)
        ));
        cold_spec.bootstrap = Some(r);
        settle(provider).await;
        cold.push(lifecycle_parts(provider, &cold_spec).await);
    }
    let medians = |v: Vec<(Duration, Duration)>| {
        (
            median_ms(v.iter().map(|p| p.0).collect()),
            median_ms(v.iter().map(|p| p.1).collect()),
        )
    };
    (medians(warm), medians(cold))
}

#[tokio::main]
async fn main() {
    // `cargo bench` passes `--bench`; nothing else to parse.
    let n: usize = std::env::var("HARNESS_BENCH_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10);
    let pool_size: usize = std::env::var("HARNESS_BENCH_POOL")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let image =
        std::env::var("HARNESS_TEST_IMAGE").unwrap_or_else(|_| "harness-test:bookworm".into());
    let config = DockerConfig {
        default_image: image.clone(),
        ..DockerConfig::default()
    };
    let plain = match DockerProvider::connect(config.clone()).await {
        Ok(p) => p,
        Err(e) => {
            println!("skipped: no docker engine answers: {e}");
            return;
        }
    };
    let pooled = DockerProvider::connect(DockerConfig {
        pool_size: pool_size.max(1),
        ..config
    })
    .await
    .expect("connect");
    let spec = SandboxSpec::new("/work");

    // Warm up the engine's caches once for each path.
    let _ = lifecycle(&plain, &spec).await;
    let _ = cli_run(&image);

    let mut images = Vec::new();
    let (ours, cli) = versus_cli(&plain, &spec, &image, n).await;
    let (warm, cold) = warm_and_cold(&plain, &spec, &image, n, &mut images).await;
    let _ = lifecycle(&pooled, &spec).await; // fills the pool's first shape
    let (p_ours, p_cli) = versus_cli(&pooled, &spec, &image, n).await;
    let (p_warm, p_cold) = warm_and_cold(&pooled, &spec, &image, n, &mut images).await;
    let removed = pooled.shutdown().await.expect("pool shutdown");
    for img in &images {
        let _ = std::process::Command::new("docker")
            .args(["rmi", img])
            .output();
    }

    println!("sandbox-docker lifecycle, image {image}, N={n}, median ms");
    println!("{:<56} {:>10}", "case", "median ms");
    let row = |name: &str, v: f64| println!("{name:<56} {v:>10.1}");
    let ratio = |name: &str, v: f64| println!("{name:<56} {v:>10.2}");
    println!("-- no pool (pool_size 0, the default)");
    row("ours: create -> exec(true) -> destroy", ours);
    row("docker CLI: docker run --rm IMAGE true", cli);
    ratio("ratio ours / CLI", ours / cli);
    row(
        "warm: create from identity snapshot (+exec, destroy)",
        warm.1,
    );
    row("cold: bootstrap recipe + commit (+exec, destroy)", cold.1);
    ratio("ratio cold / warm", cold.1 / warm.1);
    row("warm start: create from snapshot -> first exec", warm.0);
    row(
        "cold start: bootstrap + commit + create -> first exec",
        cold.0,
    );
    ratio("ratio cold start / warm start", cold.0 / warm.0);
    println!("-- pool_size {pool_size} (pool settled before each timed run)");
    row("ours: create -> exec(true) -> destroy", p_ours);
    row("docker CLI: docker run --rm IMAGE true", p_cli);
    ratio("ratio ours / CLI", p_ours / p_cli);
    row(
        "warm: create from identity snapshot (+exec, destroy)",
        p_warm.1,
    );
    row("cold: bootstrap recipe + commit (+exec, destroy)", p_cold.1);
    ratio("ratio cold / warm", p_cold.1 / p_warm.1);
    row("warm start: create from snapshot -> first exec", p_warm.0);
    row(
        "cold start: bootstrap + commit + create -> first exec",
        p_cold.0,
    );
    ratio("ratio cold start / warm start", p_cold.0 / p_warm.0);
    println!("pooled containers removed at shutdown: {removed}");
}
