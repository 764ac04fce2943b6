//! `cargo xtask chaos`: many kill trials of real turns (see
//! docs/reliability.md). The trials are the `chaos` test of harness-cli
//! (`crates/harness-cli/tests/chaos.rs`), which the ordinary test run
//! also runs as a 5-trial smoke; this command starts the real parts, runs
//! that test with the trial count and seed given, and keeps a JSON-lines
//! report.

use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;

use crate::{agents, env, image, services, util};

#[derive(Debug, Args)]
pub struct ChaosArgs {
    /// How many trials.
    #[arg(long, default_value_t = 50)]
    trials: u32,
    /// The seed every trial draws from (default: from the clock; printed).
    #[arg(long)]
    seed: Option<u64>,
    /// Only this trial of the seed (what a failed run prints to replay).
    #[arg(long)]
    trial: Option<u32>,
    /// Only these engines: in-process, serve, temporal, runner (default:
    /// all). `workflows` is taken and skipped with its reason (see
    /// [`WORKFLOWS_SKIP`]).
    #[arg(long = "engine", value_delimiter = ',')]
    engines: Vec<String>,
    /// Only these phases (see docs/reliability.md; default: all).
    #[arg(long = "phase", value_delimiter = ',')]
    phases: Vec<String>,
    /// Leave the services, image and agents as they are (faster reruns).
    #[arg(long)]
    no_setup: bool,
    /// Kill `harness serve` nodes instead: three nodes over PostgreSQL on
    /// Temporal, a random node killed at a random time of a turn
    /// (`tests/nodes.rs`, `node_kill_trials`; docs/scale.md).
    #[arg(long)]
    nodes: bool,
}

/// The skip registry's entry that says why Workflows cannot be killed and
/// resumed here (`wrangler dev`'s local Workflows do not resume an
/// instance after a restart): chaos on `workflows` is skipped for it.
const WORKFLOWS_SKIP: &str = "the_workflows_engine_passes_the_engine_suite";

/// The engines asked for, less `workflows`, which is skipped with the
/// registry's reason; `None` when nothing is left to run.
fn runnable_engines(asked: &[String]) -> Option<Vec<String>> {
    if !asked.iter().any(|e| e == "workflows") {
        return Some(asked.to_vec());
    }
    let why = crate::skips::ALLOWED_SKIPS
        .iter()
        .find(|(name, _)| *name == WORKFLOWS_SKIP)
        .map_or("not registered", |(_, why)| *why);
    println!("chaos: skipped: workflows — {why}");
    let rest: Vec<String> = asked
        .iter()
        .filter(|e| *e != "workflows")
        .cloned()
        .collect();
    (!rest.is_empty()).then_some(rest)
}

pub fn run(mut args: ChaosArgs) -> Result<()> {
    match runnable_engines(&args.engines) {
        Some(engines) => args.engines = engines,
        None => return Ok(()),
    }
    if !args.no_setup {
        services::start(services::ALL)?;
        image::build(false)?;
        agents::install_all()?;
    }
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64 % 1_000_000_007)
            .unwrap_or(1)
    });
    let scope = if args.engines.is_empty() {
        String::new()
    } else {
        format!("-{}", args.engines.join("-"))
    };
    let report = util::cache_subdir("chaos")?.join(format!("seed-{seed}{scope}.jsonl"));
    let _ = std::fs::remove_file(&report);
    if args.nodes {
        return node_trials(&args, seed);
    }
    let mut cmd = trials_command("chaos");
    cmd.env("HARNESS_CHAOS_TRIALS", args.trials.to_string())
        .env("HARNESS_CHAOS_SEED", seed.to_string())
        .env("HARNESS_CHAOS_REPORT", &report);
    if let Some(trial) = args.trial {
        cmd.env("HARNESS_CHAOS_TRIAL", trial.to_string());
    }
    if !args.phases.is_empty() {
        cmd.env("HARNESS_CHAOS_PHASES", args.phases.join(","));
    }
    if !args.engines.is_empty() {
        cmd.env("HARNESS_CHAOS_ENGINES", args.engines.join(","));
    }
    let started = Instant::now();
    let result = util::run(&mut cmd);
    println!(
        "chaos: seed {seed}, {} in {}; report: {}",
        if result.is_ok() { "passed" } else { "FAILED" },
        util::fmt_duration(started.elapsed()),
        report.display()
    );
    result.context("chaos trials failed (each failed trial printed its replay command)")
}

/// `--nodes`: the node kill trials.
fn node_trials(args: &ChaosArgs, seed: u64) -> Result<()> {
    let mut cmd = trials_command("nodes");
    cmd.args(["-E", "test(node_kill_trials)"]);
    cmd.env("HARNESS_NODES_TRIALS", args.trials.to_string())
        .env("HARNESS_CHAOS_SEED", seed.to_string());
    let started = Instant::now();
    let result = util::run(&mut cmd);
    println!(
        "chaos --nodes: seed {seed}, {} trials {} in {}",
        args.trials,
        if result.is_ok() { "passed" } else { "FAILED" },
        util::fmt_duration(started.elapsed())
    );
    result.context("node kill trials failed (each failed trial printed its draw)")
}

/// `cargo nextest run` of harness-cli's test file `test`, with the
/// tests' environment. The trials need Temporal, S3 and PostgreSQL (a test
/// is ignored without its features, which would run nothing): the
/// features CI tests with.
fn trials_command(test: &str) -> std::process::Command {
    let mut cmd = util::cargo();
    cmd.args([
        "nextest",
        "run",
        "-p",
        "harness-cli",
        "--test",
        test,
        "--no-capture",
        // Not `ci::CI_FEATURES`: its `harness-moves/zstd-rust` is refused
        // with `-p harness-cli` (cargo takes `dep/feature` only of the
        // selected packages' dependencies), and the trials do not move trees
        // through pure-Rust zstd.
        "--features",
        "harness-cli/full",
    ]);
    for (k, v) in env::test_env(true) {
        cmd.env(k, v);
    }
    cmd
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `workflows` is skipped with the registry's reason, never run and
    /// never silently taken for "all engines".
    #[test]
    fn workflows_is_a_registered_skip() {
        assert!(crate::skips::ALLOWED_SKIPS
            .iter()
            .any(|(name, _)| *name == WORKFLOWS_SKIP));
        let asked = |names: &[&str]| names.iter().map(|n| n.to_string()).collect::<Vec<_>>();
        assert_eq!(runnable_engines(&asked(&["workflows"])), None);
        assert_eq!(
            runnable_engines(&asked(&["serve", "workflows"])),
            Some(asked(&["serve"]))
        );
        assert_eq!(runnable_engines(&asked(&[])), Some(asked(&[])));
    }
}
