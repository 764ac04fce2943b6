//! Sandbox lifecycle latency on the real Docker engine, side by side:
//!
//! - our `create → exec(true) → destroy` against `docker run --rm IMAGE true`
//!   (the spawned CLI);
//! - a warm start from an identity snapshot against a cold bootstrap (a
//!   recipe with a few pre-commands, run and committed each time).
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

async fn lifecycle(provider: &DockerProvider, spec: &SandboxSpec) -> Duration {
    let started = Instant::now();
    let sb = provider.create(spec).await.expect("create");
    let out = collect_exec(sb.exec(ExecRequest::new(["true"])).await.expect("exec"))
        .await
        .expect("exec output");
    assert!(out.status.success());
    sb.destroy().await.expect("destroy");
    started.elapsed()
}

#[tokio::main]
async fn main() {
    // `cargo bench` passes `--bench`; nothing else to parse.
    let n: usize = std::env::var("HARNESS_BENCH_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10);
    let image =
        std::env::var("HARNESS_TEST_IMAGE").unwrap_or_else(|_| "harness-test:bookworm".into());
    let provider = match DockerProvider::connect(DockerConfig {
        default_image: image.clone(),
        ..DockerConfig::default()
    })
    .await
    {
        Ok(p) => p,
        Err(e) => {
            println!("skipped: no docker engine answers: {e}");
            return;
        }
    };
    let spec = SandboxSpec::new("/work");

    // Warm up the engine's caches once for each path.
    let _ = lifecycle(&provider, &spec).await;
    let _ = std::process::Command::new("docker")
        .args(["run", "--rm", &image, "true"])
        .output();

    let mut ours = Vec::new();
    let mut cli = Vec::new();
    for _ in 0..n {
        ours.push(lifecycle(&provider, &spec).await);
        let started = Instant::now();
        let status = std::process::Command::new("docker")
            .args(["run", "--rm", &image, "true"])
            .status()
            .expect("docker CLI");
        assert!(status.success());
        cli.push(started.elapsed());
    }

    let warm_nonce = uuid::Uuid::new_v4().simple().to_string();
    let mut warm_spec = spec.clone();
    warm_spec.bootstrap = Some(recipe(&warm_nonce));
    let _ = lifecycle(&provider, &warm_spec).await; // builds the snapshot
    let mut warm = Vec::new();
    let mut cold = Vec::new();
    let mut cold_images = Vec::new();
    for _ in 0..n {
        warm.push(lifecycle(&provider, &warm_spec).await);
        let nonce = uuid::Uuid::new_v4().simple().to_string();
        let mut cold_spec = spec.clone();
        let r = recipe(&nonce);
        cold_images.push(format!(
            "{}:{}",
            provider.config().snapshot_repo,
            r.identity(&image)
        ));
        cold_spec.bootstrap = Some(r);
        cold.push(lifecycle(&provider, &cold_spec).await);
    }
    let warm_identity = recipe(&warm_nonce).identity(&image);
    cold_images.push(format!(
        "{}:{warm_identity}",
        provider.config().snapshot_repo
    ));
    for img in &cold_images {
        let _ = std::process::Command::new("docker")
            .args(["rmi", img])
            .output();
    }

    let (ours, cli, warm, cold) = (
        median_ms(ours),
        median_ms(cli),
        median_ms(warm),
        median_ms(cold),
    );
    println!("sandbox-docker lifecycle, image {image}, N={n}, median ms");
    println!("{:<52} {:>10}", "case", "median ms");
    println!(
        "{:<52} {:>10.1}",
        "ours: create -> exec(true) -> destroy", ours
    );
    println!(
        "{:<52} {:>10.1}",
        "docker CLI: docker run --rm IMAGE true", cli
    );
    println!("{:<52} {:>10.2}", "ratio ours / CLI", ours / cli);
    println!(
        "{:<52} {:>10.1}",
        "warm: create from identity snapshot (+exec, destroy)", warm
    );
    println!(
        "{:<52} {:>10.1}",
        "cold: bootstrap recipe + commit (+exec, destroy)", cold
    );
    println!("{:<52} {:>10.2}", "ratio cold / warm", cold / warm);
}
