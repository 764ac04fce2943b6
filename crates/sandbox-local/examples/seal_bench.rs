//! What the sealed local sandbox's boundary costs per command: the exec
//! round trip (`true`, output collected, exit read) in a host-mode sandbox
//! and in a sealed one (a bubblewrap holder's namespaces joined with
//! `nsenter`, the uid dropped with `setpriv`, `no_new_privs`), next to a
//! bare `sh -c true` spawned by this process — the anchor — in the same
//! run, in interleaved rounds.
//!
//! ```text
//! cargo xtask bench seal
//! BENCH_EXECS=500 BENCH_ROUNDS=7 cargo run --release -p sandbox-local --example seal_bench
//! ```
//!
//! Needs root, bubblewrap, util-linux and slirp4netns (`cargo xtask deps`),
//! as the sealed tests do; without them it says what is missing and stops.

use std::os::unix::fs::PermissionsExt;
use std::time::{Duration, Instant};

use harness_core::sandbox::{collect_exec, ExecRequest, Sandbox, SandboxProvider, SandboxSpec};
use sandbox_local::{Isolation, LocalProvider};

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// `n` round trips of `true` in `sandbox`, sorted.
async fn sandbox_round(sandbox: &dyn Sandbox, n: usize) -> Vec<Duration> {
    let mut times = Vec::with_capacity(n);
    for _ in 0..n {
        let started = Instant::now();
        let out = collect_exec(sandbox.exec(ExecRequest::shell("true")).await.unwrap())
            .await
            .unwrap();
        times.push(started.elapsed());
        assert!(out.status.success(), "{out:?}");
    }
    times.sort();
    times
}

/// `n` bare `sh -c true` spawns from this process, sorted.
async fn bare_round(n: usize) -> Vec<Duration> {
    let mut times = Vec::with_capacity(n);
    for _ in 0..n {
        let started = Instant::now();
        let status = tokio::process::Command::new("sh")
            .args(["-c", "true"])
            .status()
            .await
            .unwrap();
        times.push(started.elapsed());
        assert!(status.success());
    }
    times.sort();
    times
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("seal_bench: the sealed sandbox needs root here (cgroups, a uid to drop to)");
        std::process::exit(2);
    }
    let execs = env_or("BENCH_EXECS", 200);
    let rounds = env_or("BENCH_ROUNDS", 5);
    let root = tempfile::tempdir().unwrap();
    std::fs::set_permissions(root.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let gate = harness_testkit::gate_binary().expect("the sandbox gate");
    let host = LocalProvider::new(root.path().join("host"))
        .with_gate(gate.clone())
        .with_isolation(Isolation::Host);
    let sealed = LocalProvider::new(root.path().join("sealed"))
        .with_gate(gate)
        .with_isolation(Isolation::Sealed);
    std::fs::create_dir_all(root.path().join("sealed")).unwrap();
    std::fs::set_permissions(
        root.path().join("sealed"),
        std::fs::Permissions::from_mode(0o755),
    )
    .unwrap();
    let spec = SandboxSpec::new("/workspace");
    let started = Instant::now();
    let host_box = host.create(&spec).await.expect("a host-mode sandbox");
    let host_create = started.elapsed();
    let started = Instant::now();
    let sealed_box = match sealed.create(&spec).await {
        Ok(s) => s,
        Err(e) => {
            eprintln!("seal_bench: this host cannot seal: {e}");
            std::process::exit(2);
        }
    };
    let sealed_create = started.elapsed();
    println!(
        "seal_bench: {execs} execs of `true` per round, {rounds} rounds, interleaved \
         (bare spawn, host mode, sealed)"
    );
    println!(
        "create: host mode {:.1} ms, sealed {:.1} ms (the holder, its namespaces, slirp4netns)",
        ms(host_create),
        ms(sealed_create)
    );
    // Warm both (page cache, the first nsenter).
    sandbox_round(host_box.as_ref(), 10).await;
    sandbox_round(sealed_box.as_ref(), 10).await;
    println!(
        "{:>5}  {:>17}  {:>17}  {:>17}  {:>13}  {:>14}",
        "round",
        "bare p50/p99 ms",
        "host p50/p99 ms",
        "sealed p50/p99 ms",
        "sealed/host",
        "sealed-host ms"
    );
    for round in 1..=rounds {
        let bare = bare_round(execs).await;
        let h = sandbox_round(host_box.as_ref(), execs).await;
        let s = sandbox_round(sealed_box.as_ref(), execs).await;
        let (h50, s50) = (percentile(&h, 0.5), percentile(&s, 0.5));
        println!(
            "{round:>5}  {:>8.2}/{:<8.2}  {:>8.2}/{:<8.2}  {:>8.2}/{:<8.2}  {:>13.2}  {:>14.2}",
            ms(percentile(&bare, 0.5)),
            ms(percentile(&bare, 0.99)),
            ms(h50),
            ms(percentile(&h, 0.99)),
            ms(s50),
            ms(percentile(&s, 0.99)),
            s50.as_secs_f64() / h50.as_secs_f64(),
            ms(s50) - ms(h50),
        );
    }
    host_box.destroy().await.unwrap();
    sealed_box.destroy().await.unwrap();
}
