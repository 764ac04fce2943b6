//! `cargo xtask fuzz`: build the fuzz targets in `fuzz/` with cargo-fuzz and
//! run each for a while (see docs/fuzzing.md).
//!
//! cargo-fuzz (libFuzzer) runs on the pinned stable toolchain: its
//! instrumentation is stable `-C` flags, and only sanitizers need nightly, so
//! targets are built `--sanitizer none` (the workspace forbids `unsafe`) with
//! debug assertions on (overflow panics count as crashes). cargo-fuzz itself
//! comes from `$HARNESS_CACHE/tools/bin`, else `PATH`, else `cargo install`
//! from crates.io into `$HARNESS_CACHE/tools` (~1 min).
//!
//! Two ways to run:
//! - by hand (`cargo xtask fuzz [--seconds N]`): open-ended exploration from
//!   the committed inputs (`fuzz/seeds/<target>/`, hand-written, and
//!   `fuzz/corpus/<target>/`, the evolved corpus, minimised) plus a working
//!   corpus kept in `$HARNESS_CACHE/fuzz/corpus/<target>/` (new inputs go
//!   there, never into the repo). `--merge` then folds the working corpus
//!   into `fuzz/corpus/` (libFuzzer's `-merge=1`: only inputs that add
//!   coverage), to commit.
//! - in CI (`smoke`): deterministic. Every committed input is run, then a
//!   fixed number of mutations from a fixed seed, with new inputs written
//!   to a scratch directory: the same commit gives the same run, whatever
//!   the machine's cache holds. A fresh machine once found a crash in 30
//!   timed seconds that warm caches never reached; the committed corpus and
//!   crash inputs now replay on every run instead.
//!
//! A crash is written to `$HARNESS_CACHE/fuzz/artifacts/<target>/` and fails
//! the command.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;

use crate::util;

const CARGO_FUZZ_VERSION: &str = "0.13.2";

/// A target (a binary of `fuzz/Cargo.toml`).
#[derive(Debug, Clone, Copy)]
pub struct Target {
    pub name: &'static str,
    /// The largest input it takes.
    pub max_len: usize,
    /// Mutations the CI smoke runs after replaying the committed inputs
    /// (about 15 s each on the 2-core CI machine).
    pub smoke_runs: u64,
}

pub const TARGETS: &[Target] = &[
    Target {
        name: "messages",
        max_len: 8192,
        smoke_runs: 150_000,
    },
    Target {
        name: "tarscan",
        max_len: 16384,
        smoke_runs: 300_000,
    },
    Target {
        name: "checkpoint_key",
        max_len: 1024,
        smoke_runs: 1_000_000,
    },
    Target {
        name: "ds_headers",
        max_len: 4096,
        smoke_runs: 300_000,
    },
    Target {
        name: "http",
        max_len: 8192,
        smoke_runs: 30_000,
    },
];

/// Seconds per target by hand, by default.
pub const DEFAULT_SECONDS: u64 = 30;

/// The libFuzzer seed of the CI smoke.
const SMOKE_SEED: u64 = 1;

#[derive(Debug, Args)]
pub struct FuzzArgs {
    /// Only these targets (comma-separated or repeated); default: all.
    #[arg(long = "target", value_delimiter = ',')]
    targets: Vec<String>,
    /// Seconds to run each target.
    #[arg(long, default_value_t = DEFAULT_SECONDS)]
    seconds: u64,
    /// Run what CI runs instead (deterministic: the committed inputs, then
    /// a fixed number of mutations from a fixed seed).
    #[arg(long, conflicts_with_all = ["seconds", "merge"])]
    smoke: bool,
    /// Fold the working corpus in the cache into `fuzz/corpus/<target>/`
    /// (minimised: only inputs that add coverage), to commit.
    #[arg(long)]
    merge: bool,
}

/// How a target is run.
#[derive(Debug, Clone, Copy)]
enum Mode {
    /// Open-ended, for this many seconds, growing the cache's corpus.
    Explore { seconds: u64 },
    /// What CI runs.
    Smoke,
    /// Minimise the cache's corpus into the committed one.
    Merge,
}

pub fn run(args: FuzzArgs) -> Result<()> {
    let targets = if args.targets.is_empty() {
        TARGETS.to_vec()
    } else {
        args.targets
            .iter()
            .map(|n| target(n))
            .collect::<Result<Vec<_>>>()?
    };
    let mode = match (args.smoke, args.merge) {
        (true, _) => Mode::Smoke,
        (_, true) => Mode::Merge,
        _ => Mode::Explore {
            seconds: args.seconds,
        },
    };
    fuzz(&targets, mode)
}

/// The CI smoke: every target, deterministically.
pub fn smoke() -> Result<()> {
    fuzz(TARGETS, Mode::Smoke)
}

fn target(name: &str) -> Result<Target> {
    TARGETS
        .iter()
        .find(|t| t.name == name)
        .copied()
        .with_context(|| {
            format!(
                "no fuzz target `{name}` (targets: {})",
                TARGETS
                    .iter()
                    .map(|t| t.name)
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        })
}

fn fuzz_target_dir() -> PathBuf {
    // Apart from the workspace's: other RUSTFLAGS would rebuild it all.
    util::cache_dir().join("target-fuzz")
}

fn cargo_fuzz_works(dir: &Path) -> bool {
    let bin = dir.join("cargo-fuzz");
    util::is_executable(&bin) && util::succeeds(Command::new(&bin).args(["fuzz", "--version"]))
}

/// The directory holding a working `cargo-fuzz`, installing it if needed.
fn ensure_cargo_fuzz() -> Result<PathBuf> {
    let tools_bin = util::cache_dir().join("tools").join("bin");
    if cargo_fuzz_works(&tools_bin) {
        return Ok(tools_bin);
    }
    if let Some(found) = util::which("cargo-fuzz") {
        let dir = found.parent().expect("a file has a parent").to_path_buf();
        if cargo_fuzz_works(&dir) {
            return Ok(dir);
        }
    }
    std::fs::create_dir_all(&tools_bin)?;
    util::run(
        Command::new("cargo")
            .current_dir(util::cache_dir())
            .env_remove("CARGO_TARGET_DIR")
            .args([
                "install",
                "cargo-fuzz",
                "--locked",
                // It only drives cargo and the targets: a debug build
                // saves a cold run most of its compile time.
                "--debug",
                "--version",
                CARGO_FUZZ_VERSION,
                "--root",
            ])
            .arg(util::cache_dir().join("tools")),
    )?;
    Ok(tools_bin)
}

fn host_triple() -> Result<String> {
    let out = util::output(
        Command::new("rustc")
            .current_dir(util::repo_root())
            .arg("-vV"),
    )?;
    out.lines()
        .find_map(|l| l.strip_prefix("host: "))
        .map(str::to_string)
        .context("rustc -vV printed no host")
}

/// What one run reported.
#[derive(Debug, Default)]
struct Figures {
    execs: u64,
    execs_per_sec: u64,
    cov: u64,
    features: u64,
    corpus: String,
    crash: Option<String>,
}

fn fuzz(targets: &[Target], mode: Mode) -> Result<()> {
    let tools = ensure_cargo_fuzz()?;
    let path = std::env::var_os("PATH").unwrap_or_default();
    let mut paths = vec![tools];
    paths.extend(std::env::split_paths(&path));
    let target_dir = fuzz_target_dir();
    let mut build = Command::new("cargo");
    build
        .current_dir(util::repo_root())
        .env("PATH", std::env::join_paths(paths)?)
        .env_remove("CARGO_TARGET_DIR")
        .args(["fuzz", "build", "--sanitizer", "none", "--debug-assertions"])
        .arg("--target-dir")
        .arg(&target_dir);
    // `cargo fuzz build` takes one target, or none for all of them.
    if let [one] = targets {
        build.arg(one.name);
    }
    util::timed("fuzz: build", || util::run(&mut build))?;

    let bin_dir = target_dir.join(host_triple()?).join("release");
    let mut results = Vec::new();
    for target in targets {
        let name = target.name;
        let artifacts = util::cache_subdir(&format!("fuzz/artifacts/{name}"))?;
        let committed = committed_dirs(name);
        let mut cmd = Command::new(bin_dir.join(name));
        cmd.current_dir(&artifacts)
            .arg(format!("-max_len={}", target.max_len))
            .arg("-timeout=30")
            .arg("-rss_limit_mb=2048")
            .arg("-print_final_stats=1")
            .arg(format!("-artifact_prefix={}/", artifacts.display()));
        let what = match mode {
            Mode::Explore { seconds } => {
                cmd.arg(util::cache_subdir(&format!("fuzz/corpus/{name}"))?)
                    .args(&committed)
                    .arg(format!("-max_total_time={seconds}"));
                format!("{seconds}s")
            }
            Mode::Smoke => {
                // Emptied first: what the run finds depends on the
                // committed inputs only.
                let scratch = util::cache_dir().join("fuzz/scratch").join(name);
                let _ = std::fs::remove_dir_all(&scratch);
                std::fs::create_dir_all(&scratch)?;
                cmd.arg(&scratch)
                    .args(&committed)
                    .arg(format!("-seed={SMOKE_SEED}"))
                    .arg(format!("-runs={}", target.smoke_runs));
                format!("the committed inputs + {} runs", target.smoke_runs)
            }
            Mode::Merge => {
                let corpus = util::repo_root().join("fuzz").join("corpus").join(name);
                std::fs::create_dir_all(&corpus)?;
                cmd.arg("-merge=1")
                    .arg(&corpus)
                    .arg(util::cache_subdir(&format!("fuzz/corpus/{name}"))?);
                "merge".to_string()
            }
        };
        let start = Instant::now();
        let figures = util::timed(&format!("fuzz: {name}, {what}"), || run_libfuzzer(&mut cmd))?;
        results.push((name, start.elapsed(), figures));
    }

    println!();
    println!(
        "{:<15} {:>7} {:>12} {:>9} {:>7} {:>8} {:>16}  crash",
        "target", "time", "execs", "exec/s", "cov", "ft", "corpus"
    );
    let mut crashed = Vec::new();
    for (name, took, f) in &results {
        println!(
            "{:<15} {:>7} {:>12} {:>9} {:>7} {:>8} {:>16}  {}",
            name,
            util::fmt_duration(*took),
            f.execs,
            f.execs_per_sec,
            f.cov,
            f.features,
            f.corpus,
            f.crash.as_deref().unwrap_or("none")
        );
        if let Some(c) = &f.crash {
            crashed.push(format!(
                "{name}: {c}\n    reproduce: {} {c}",
                bin_dir.join(name).display()
            ));
        }
    }
    if !crashed.is_empty() {
        bail!("fuzz targets crashed:\n  {}", crashed.join("\n  "));
    }
    Ok(())
}

/// The committed inputs of `name`: the hand-written seeds and the evolved
/// corpus (either may be missing).
fn committed_dirs(name: &str) -> Vec<PathBuf> {
    let fuzz = util::repo_root().join("fuzz");
    [
        fuzz.join("seeds").join(name),
        fuzz.join("corpus").join(name),
    ]
    .into_iter()
    .filter(|d| d.is_dir())
    .collect()
}

/// Run a libFuzzer binary, echoing its output, and read its figures.
fn run_libfuzzer(cmd: &mut Command) -> Result<Figures> {
    println!("$ {}", util::display(cmd));
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::inherit())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("could not start {}", util::display(cmd)))?;
    let stderr = child.stderr.take().expect("piped");
    let mut f = Figures::default();
    let mut err = std::io::stderr();
    for line in BufReader::new(stderr).lines() {
        let line = line.unwrap_or_default();
        // Status lines and the closing dictionary are many: show the rest.
        let noise = (line.starts_with('#') && !line.contains("DONE") && !line.contains("INITED"))
            || line.starts_with('"');
        if !noise {
            let _ = writeln!(err, "{line}");
        }
        read_figures(&line, &mut f);
    }
    let status = child.wait()?;
    if !status.success() && f.crash.is_none() {
        f.crash = Some(format!("exited {status} without an artifact"));
    }
    Ok(f)
}

fn read_figures(line: &str, f: &mut Figures) {
    let stat = |name: &str| {
        line.strip_prefix(name)
            .and_then(|r| r.trim_start_matches(':').trim().parse::<u64>().ok())
    };
    if let Some(v) = stat("stat::number_of_executed_units") {
        f.execs = v;
    } else if let Some(v) = stat("stat::average_exec_per_sec") {
        f.execs_per_sec = v;
    } else if line.starts_with('#') && (line.contains("DONE") || line.contains("pulse")) {
        // `#123 DONE cov: 1234 ft: 5678 corp: 90/12Kb ...`
        let words: Vec<&str> = line.split_whitespace().collect();
        for pair in words.windows(2) {
            match pair[0] {
                "cov:" => f.cov = pair[1].parse().unwrap_or(f.cov),
                "ft:" => f.features = pair[1].parse().unwrap_or(f.features),
                "corp:" => f.corpus = pair[1].to_string(),
                _ => {}
            }
        }
    } else if let Some(rest) = line.split_once("Test unit written to ") {
        f.crash = Some(rest.1.trim().to_string());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_libfuzzer_figures() {
        let mut f = Figures::default();
        for line in [
            "#4194304 pulse  cov: 900 ft: 3000 corp: 80/10Kb lim: 4096 exec/s: 1000 rss: 60Mb",
            "#600123 DONE   cov: 1234 ft: 5678 corp: 90/12Kb lim: 4096 exec/s: 20004 rss: 64Mb",
            "stat::number_of_executed_units: 600123",
            "stat::average_exec_per_sec:     20004",
        ] {
            read_figures(line, &mut f);
        }
        assert_eq!(
            (f.execs, f.execs_per_sec, f.cov, f.features),
            (600123, 20004, 1234, 5678)
        );
        assert_eq!(f.corpus, "90/12Kb");
        assert!(f.crash.is_none());
        read_figures(
            "artifact_prefix='/x/'; Test unit written to /x/crash-abc",
            &mut f,
        );
        assert_eq!(f.crash.as_deref(), Some("/x/crash-abc"));
    }
}
