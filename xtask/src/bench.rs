//! `cargo xtask bench <name>`: the benchmarks, each comparing against a
//! baseline in the same run and printing ratios. They are not part of CI
//! (speed is measured, not asserted); they need the services running
//! (`cargo xtask services start`) and the test environment, which this sets.

use std::process::Command;

use anyhow::{Context, Result};
use clap::ValueEnum;

use crate::util;

/// A benchmark.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Bench {
    /// Docker create→exec→destroy vs `docker run --rm`; warm snapshot vs cold bootstrap.
    Docker,
    /// Checkpoint+restore of a 190 MB / 20,000-file tree (memory and S3 stores)
    /// vs `tar|gzip` and `tar|zstd` pipelines.
    Moves,
    /// Turn-end checkpoints with one file changed, and forks to a new local
    /// sandbox and a new Docker container, on the same tree in a directory
    /// store, vs a whole-archive checkpoint + restore.
    Fork,
    /// Engine overhead per slice: direct vs in-process vs Temporal.
    Engine,
    /// Time to a ready agent: `POST /v1/sessions` + a prompt to the
    /// agent's first model request, per provider, next to a bare `claude
    /// -p` on the host; each stage's share from the server's spans.
    Ready,
    /// Live delivery alone: 1,000 SSE readers at 50 and 1,000 frames/s on
    /// the session stream and the Durable Streams stream, next to the bare
    /// fan-out floor and the reference server, five interleaved rounds.
    Live,
    /// Session server: append throughput, live-delivery latency to 1,000 SSE
    /// readers, replay of 100k frames — on our endpoints, then over the
    /// Durable Streams protocol side by side with the reference server.
    Server,
    /// Host-tool round trip (runner → session → tool host → session →
    /// runner) vs a plain HTTP request to the same server, p50/p99.
    HostTools,
    /// A streamed model request through the model broker (TCP and a
    /// session's Unix socket) vs straight to the provider: p50/p99 and
    /// throughput.
    Broker,
    /// The sandbox API (the AI SDK's provider): from Node through the npm
    /// package vs the same calls on the provider in Rust — first command
    /// after create, exec round trip, 64 MiB write and read.
    SandboxApi,
    /// The search index: appends/s of indexed frames vs the same bytes not
    /// indexed, and query p50/p99 over everything indexed.
    Search,
    /// The sealed local sandbox's boundary per exec: round trips in a
    /// host-mode and a sealed sandbox next to a bare `sh -c true` spawn.
    Seal,
    /// Several session-server nodes over one PostgreSQL next to one node on
    /// SQLite: appends/s through the nodes in turn, live delivery p99 on
    /// the owner and through another node (needs `services start --only postgres`).
    Scale,
    /// microVM: boot to first exec, exec round trip, file throughput
    /// through the agent, CPU-bound work against the host.
    Microvm,
    /// All of the above, in order.
    All,
}

fn commands(bench: Bench) -> Vec<Vec<&'static str>> {
    let example = |package, name| vec!["run", "--release", "-p", package, "--example", name];
    match bench {
        Bench::Docker => vec![vec![
            "bench",
            "-p",
            "sandbox-docker",
            "--bench",
            "lifecycle",
        ]],
        Bench::Moves => {
            let mut args = example("checkpoint-r2", "move_bench");
            args.extend(["--", "--repeat", "5"]);
            vec![args]
        }
        Bench::Fork => vec![example("checkpoint-r2", "fork_bench")],
        Bench::Engine => vec![example("durable-temporal", "overhead")],
        Bench::Ready => vec![vec![
            "bench",
            "-p",
            "harness-cli",
            "--features",
            "full",
            "--bench",
            "ready",
        ]],
        Bench::Live => vec![example("session-server", "bench")],
        Bench::Server => vec![
            example("session-server", "bench"),
            example("session-server", "ds_bench"),
        ],
        Bench::HostTools => vec![example("session-server", "host_tools_bench")],
        Bench::SandboxApi => vec![example("session-server", "sandbox_api_bench")],
        Bench::Broker => vec![example("harness-broker", "broker_bench")],
        Bench::Seal => vec![example("sandbox-local", "seal_bench")],
        Bench::Search => vec![example("session-log", "search_bench")],
        Bench::Scale => vec![example("session-server", "scale_bench")],
        // Debug build: the time is the guest's, and a release build of the
        // provider's dependencies would cost minutes for nothing.
        Bench::Microvm => vec![vec![
            "run",
            "-p",
            "sandbox-microvm",
            "--example",
            "microvm_bench",
        ]],
        Bench::All => vec![],
    }
}

/// Run one benchmark (or all).
pub fn run(bench: Bench, extra: &[String]) -> Result<()> {
    let all = [
        Bench::Docker,
        Bench::Moves,
        Bench::Fork,
        Bench::Engine,
        Bench::Ready,
        Bench::Server,
        Bench::HostTools,
        Bench::Broker,
        Bench::SandboxApi,
        Bench::Seal,
        Bench::Search,
        Bench::Scale,
        Bench::Microvm,
    ];
    let chosen: Vec<Bench> = if bench == Bench::All {
        all.to_vec()
    } else {
        vec![bench]
    };
    for b in chosen {
        for args in commands(b) {
            let mut cmd = util::cargo();
            cmd.args(&args);
            if !extra.is_empty() {
                if !args.contains(&"--") {
                    cmd.arg("--");
                }
                cmd.args(extra);
            }
            for (key, value) in crate::env::test_env(true) {
                cmd.env(key, value);
            }
            if b == Bench::Moves {
                for (key, value) in move_anchors()? {
                    cmd.env(key, value);
                }
            }
            if b == Bench::Live {
                for (key, value) in [("BENCH_ONLY", "live"), ("BENCH_ROUNDS", "5")] {
                    if std::env::var_os(key).is_none() {
                        cmd.env(key, value);
                    }
                }
            }
            println!("==== bench {b:?}: cargo {}", args.join(" "));
            util::run(&mut cmd)?;
        }
    }
    Ok(())
}

/// The awscli `bench moves` compares with (PyPI), in a venv of its own.
const AWSCLI: &str = "awscli==1.46.2";

/// The S3 clients `bench moves` pipes its anchors through: Debian's
/// `rclone` (installed with apt when missing) and PyPI's `awscli` (in
/// `$HARNESS_CACHE/tools/awscli`), as `MOVE_BENCH_RCLONE` /
/// `MOVE_BENCH_AWS` for the bench. Not part of `deps`: only this bench
/// needs them.
fn move_anchors() -> Result<Vec<(&'static str, String)>> {
    if util::which("rclone").is_none() {
        util::run(Command::new("apt-get").args(["install", "-y", "-q", "rclone"]))?;
    }
    let rclone = util::which("rclone").context("apt-get installed no rclone")?;
    let venv = util::cache_subdir("tools/awscli")?;
    let aws = venv.join("bin/aws");
    if !util::is_executable(&aws) {
        util::run(Command::new("python3").args(["-m", "venv"]).arg(&venv))?;
        util::run(Command::new(venv.join("bin/pip")).args([
            "install",
            "-q",
            "--disable-pip-version-check",
            AWSCLI,
        ]))?;
    }
    Ok(vec![
        ("MOVE_BENCH_RCLONE", rclone.display().to_string()),
        ("MOVE_BENCH_AWS", aws.display().to_string()),
    ])
}
