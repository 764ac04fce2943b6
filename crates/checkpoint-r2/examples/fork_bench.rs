//! Fork benchmark (`cargo xtask bench fork`): on the ~190 MB, 20,000-file
//! tree of `bench moves`, in the default store (a directory,
//! `checkpoint-fs`):
//!
//! - a turn-end checkpoint with one file changed (`StoreTurnCheckpoints`,
//!   incremental against the previous turn's), in a local sandbox and in a
//!   Docker container (its commands through the gate's exec server, as
//!   `harness serve` runs them);
//! - a fork: a new local sandbox, and a new Docker container, with the
//!   checkpoint put in (what a fork's or a rewind's first turn, and a
//!   rehydration, do);
//! - the anchor, in the same run: a whole-archive checkpoint and restore;
//!   and the floors of any restore that writes the files: the tree copied
//!   with `cp -a` (local) or `tar | docker exec tar x` (Docker) into a new
//!   sandbox, and for Docker also by a `tar x` on the engine's host into
//!   the container's root (`/proc/<pid>/root`: what a restore written from
//!   the host could reach; the bench runs as root on the engine's host).
//!
//! p50 and p99 over `--runs` (default 10) runs each; every run is printed.
//! A fork and its floor run in turn, and every sandbox stays until the
//! end (`forks_and_floor` says why). Options: `--files N`, `--mb N`,
//! `--runs N`. The scratch directory (store, sandboxes)
//! is the temp dir: `TMPDIR=/dev/shm` takes the disk out of the figures. Docker parts are skipped with
//! a note when no engine answers or `HARNESS_TEST_IMAGE` is unset.

use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use checkpoint_fs::FsCheckpointStore;
use harness_core::checkpoint::CheckpointStore;
use harness_core::sandbox::{Sandbox, SandboxProvider, SandboxSpec};
use harness_core::turn::TurnState;
use harness_core::turn_checkpoint::TurnCheckpoints;
use harness_moves::turns::StoreTurnCheckpoints;
use harness_testkit::agent::{ScriptHarness, SCRIPT_AGENT};
use harness_testkit::trees::generate_tree;
use sandbox_local::LocalProvider;

fn arg(name: &str, default: u64) -> u64 {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Flush dirty pages before a timed step (see `move_bench`).
fn settle() {
    let _ = Command::new("sync").status();
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

struct Figure {
    name: String,
    runs: Vec<f64>,
}

impl Figure {
    fn print(&self, anchor: f64) {
        let mut sorted = self.runs.clone();
        sorted.sort_by(f64::total_cmp);
        let p50 = percentile(&sorted, 0.5);
        let p99 = percentile(&sorted, 0.99);
        let runs: Vec<String> = self
            .runs
            .iter()
            .map(|r| format!("{:.0}", r * 1000.0))
            .collect();
        println!(
            "{:<44} p50 {:>7.0} ms  p99 {:>7.0} ms  ×{:.2} of the anchor   runs (ms): {}",
            self.name,
            p50 * 1000.0,
            p99 * 1000.0,
            p50 / anchor,
            runs.join(" ")
        );
    }
}

async fn sh(sandbox: &dyn Sandbox, script: &str) {
    harness_testkit::trees::sh(sandbox, script).await;
}

fn state(session: &str, turn: u64, previous: Option<String>) -> TurnState {
    let mut s = TurnState::new(session, format!("t{turn}"), SCRIPT_AGENT, "bench");
    s.checkpoint = previous;
    s
}

/// Turn-end checkpoints in `sandbox`, each after one file changed.
async fn turn_ends(
    name: &str,
    checkpoints: &StoreTurnCheckpoints,
    sandbox: &dyn Sandbox,
    session: &str,
    runs: u64,
) -> (Figure, String) {
    // An agent with no state of its own: the figures are the tree's.
    let h = ScriptHarness;
    // The first: the whole tree (not timed: a session's first turn end).
    let mut key = checkpoints
        .checkpoint(sandbox, &h, &state(session, 0, None))
        .await
        .unwrap();
    // A second untimed one: the first after a restore reads the tree once
    // (new inodes and ctimes), the next ones only what changed.
    key = checkpoints
        .checkpoint(sandbox, &h, &state(session, 1, Some(key)))
        .await
        .unwrap();
    let mut fig = Figure {
        name: format!("turn-end checkpoint, 1 file changed, {name}"),
        runs: Vec::new(),
    };
    for i in 2..2 + runs {
        sh(
            sandbox,
            &format!("echo change {i} >> pkg000/mod00/file1.rs"),
        )
        .await;
        settle();
        let t = Instant::now();
        key = checkpoints
            .checkpoint(sandbox, &h, &state(session, i, Some(key)))
            .await
            .unwrap();
        fig.runs.push(t.elapsed().as_secs_f64());
    }
    (fig, key)
}

/// A floor: its label, and the shell command (run in the tree) that copies
/// the tree into the sandbox given.
type Floor<'a> = (&'a str, &'a dyn Fn(&dyn Sandbox) -> String);

/// Forks — a new sandbox of `provider` with `key` put in: the whole, and
/// the sandbox's creation alone (the rest is the restore) — interleaved,
/// run by run, with the floors of any restore that writes the files: the
/// tree copied from `src` by a tool with no store, no hashes and no
/// decompression into a new sandbox (each of `floors`: a label and the
/// shell command; `cp -a` beside it for local, `tar | docker exec tar x`
/// and a host-side `tar x` into the container's root for Docker).
/// Interleaved, they meet the same disk: ext4 skips the inodes freed in the
/// last minutes when it allocates, so a phase after a deletion of
/// 20,000-file trees pays for it. Nothing is removed here: every sandbox
/// made goes into `made`, removed at the bench's end (several forks of one
/// point side by side).
#[allow(clippy::too_many_arguments)]
async fn forks_and_floor(
    name: &str,
    checkpoints: &StoreTurnCheckpoints,
    provider: &dyn SandboxProvider,
    spec: &SandboxSpec,
    key: &str,
    src: &std::path::Path,
    floors: &[Floor<'_>],
    runs: u64,
    made: &mut Vec<Box<dyn Sandbox>>,
) -> Vec<Figure> {
    let figure = |name: String| Figure {
        name,
        runs: Vec::new(),
    };
    let mut figures: Vec<Figure> = floors
        .iter()
        .map(|(how, _)| figure(format!("floor: new {name} sandbox + {how}")))
        .collect();
    let mut fork = figure(format!("fork: new {name} sandbox + restore"));
    let mut create = figure(format!("  of which: creating the {name} sandbox"));
    for _ in 0..runs {
        for ((_, copy), floor) in floors.iter().zip(figures.iter_mut()) {
            settle();
            let t = Instant::now();
            let sandbox = provider.create(spec).await.unwrap();
            let status = Command::new("sh")
                .arg("-c")
                .arg(copy(sandbox.as_ref()))
                .current_dir(src)
                .status()
                .unwrap();
            assert!(status.success(), "the plain copy failed");
            floor.runs.push(t.elapsed().as_secs_f64());
            made.push(sandbox);
        }

        settle();
        let t = Instant::now();
        let sandbox = provider.create(spec).await.unwrap();
        create.runs.push(t.elapsed().as_secs_f64());
        checkpoints
            .restore(key, sandbox.as_ref(), &ScriptHarness)
            .await
            .unwrap();
        fork.runs.push(t.elapsed().as_secs_f64());
        made.push(sandbox);
    }
    figures.push(fork);
    figures.push(create);
    figures
}

/// The Docker provider as `harness serve` sets it up: the gate mounted in
/// each container and its commands through the gate's exec server, whose
/// sockets live under `exec_dir` (`docs/sandbox-docker.md`).
async fn docker(image: &str, exec_dir: &std::path::Path) -> Option<sandbox_docker::DockerProvider> {
    let config = sandbox_docker::DockerConfig {
        default_image: image.to_string(),
        gate: harness_testkit::gate_binary(),
        exec_dir: Some(exec_dir.to_path_buf()),
        ..Default::default()
    };
    sandbox_docker::DockerProvider::connect(config).await.ok()
}

#[tokio::main]
async fn main() {
    let files = arg("--files", 20_000) as usize;
    let mb = arg("--mb", 190);
    let runs = arg("--runs", 10);
    let scratch = tempfile::tempdir().unwrap();
    let src = scratch.path().join("src");
    std::fs::create_dir_all(&src).unwrap();
    let (n, bytes) = generate_tree(&src, files, mb);
    println!(
        "fork bench: {n} files, {:.0} MB, {runs} runs each, a directory store",
        bytes as f64 / 1e6
    );
    let store: Arc<dyn CheckpointStore> =
        Arc::new(FsCheckpointStore::open(scratch.path().join("store")).unwrap());
    let clock = Arc::new(harness_core::clock::FnClock(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64
    }));
    let checkpoints = StoreTurnCheckpoints::new(store.clone(), clock);
    let local = LocalProvider::new(scratch.path().join("sandboxes"));
    let mut wrap = SandboxSpec::new("/workspace");
    wrap.wrap = Some(src.to_string_lossy().into_owned());
    let a = local.create(&wrap).await.unwrap();
    // Every sandbox made, removed at the end (see `forks_and_floor`).
    let mut made: Vec<Box<dyn Sandbox>> = Vec::new();

    // The anchor: a whole-archive checkpoint and restore, 3 runs.
    let mut anchor = Figure {
        name: "anchor: whole-archive checkpoint + restore".into(),
        runs: Vec::new(),
    };
    for i in 0..3 {
        let key = format!("bench/archive-{i}.tar.zst");
        settle();
        let t = Instant::now();
        harness_moves::checkpoint(a.as_ref(), a.workdir(), store.as_ref(), &key, None)
            .await
            .unwrap();
        let c = local.create(&SandboxSpec::new("/workspace")).await.unwrap();
        harness_moves::restore(store.as_ref(), &key, c.as_ref(), c.workdir(), None)
            .await
            .unwrap();
        anchor.runs.push(t.elapsed().as_secs_f64());
        made.push(c);
    }
    let mut sorted = anchor.runs.clone();
    sorted.sort_by(f64::total_cmp);
    let anchor_p50 = percentile(&sorted, 0.5);
    anchor.print(anchor_p50);

    let (fig, key) = turn_ends("local", &checkpoints, a.as_ref(), "bench-local", runs).await;
    fig.print(anchor_p50);
    let figures = forks_and_floor(
        "local",
        &checkpoints,
        &local,
        &SandboxSpec::new("/workspace"),
        &key,
        &src,
        // A local sandbox's workdir is a host path.
        &[("cp -a", &|sb: &dyn Sandbox| {
            format!("mkdir -p '{0}' && cp -a . '{0}'", sb.workdir())
        })],
        runs,
        &mut made,
    )
    .await;
    for fig in figures {
        fig.print(anchor_p50);
    }

    let image = std::env::var("HARNESS_TEST_IMAGE").ok();
    let docker = match &image {
        Some(image) => docker(image, &scratch.path().join("docker-exec")).await,
        None => None,
    };
    match docker {
        None => println!("docker: skipped (no engine answers, or HARNESS_TEST_IMAGE is unset)"),
        Some(docker) => {
            let spec = SandboxSpec::new("/workspace");
            let d = docker.create(&spec).await.unwrap();
            checkpoints
                .restore(&key, d.as_ref(), &ScriptHarness)
                .await
                .unwrap();
            let (fig, dkey) =
                turn_ends("Docker", &checkpoints, d.as_ref(), "bench-docker", runs).await;
            fig.print(anchor_p50);
            made.push(d);
            let figures = forks_and_floor(
                "Docker",
                &checkpoints,
                &docker,
                &spec,
                &dkey,
                &src,
                &[
                    ("tar | docker exec tar x", &|sb: &dyn Sandbox| {
                        format!(
                            "tar cf - . | docker exec -i {} sh -c 'mkdir -p /workspace && tar -C /workspace -xf -'",
                            sb.handle().id
                        )
                    }),
                    // What a restore written from the engine's host into
                    // the container's root could reach (needs root there).
                    ("tar x from the host into /proc/<pid>/root", &|sb: &dyn Sandbox| {
                        format!(
                            "root=/proc/$(docker inspect -f '{{{{.State.Pid}}}}' {})/root && mkdir -p $root/workspace && tar cf - . | tar -C $root/workspace -xf -",
                            sb.handle().id
                        )
                    }),
                ],
                runs,
                &mut made,
            )
            .await;
            for fig in figures {
                fig.print(anchor_p50);
            }
        }
    }
    for sandbox in made {
        sandbox.destroy().await.unwrap();
    }
    println!("targets: turn-end checkpoint ≤ 150 ms local, ≤ 500 ms Docker; fork ≤ 1 s local, ≤ 2 s Docker");
}
