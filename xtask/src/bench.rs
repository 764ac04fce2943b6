//! `cargo xtask bench <name>`: the benchmarks, each comparing against a
//! baseline in the same run and printing ratios. They are not part of CI
//! (speed is measured, not asserted); they need the services running
//! (`cargo xtask services start`) and the test environment, which this sets.

use anyhow::Result;
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
        Bench::Moves => vec![example("checkpoint-r2", "move_bench")],
        Bench::Fork => vec![example("checkpoint-r2", "fork_bench")],
        Bench::Engine => vec![example("durable-temporal", "overhead")],
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
pub fn run(bench: Bench) -> Result<()> {
    let all = [
        Bench::Docker,
        Bench::Moves,
        Bench::Fork,
        Bench::Engine,
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
            for (key, value) in crate::env::test_env(true) {
                cmd.env(key, value);
            }
            println!("==== bench {b:?}: cargo {}", args.join(" "));
            util::run(&mut cmd)?;
        }
    }
    Ok(())
}
