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
//! Each run reads the committed seeds (`fuzz/seeds/<target>/`) and a working
//! corpus kept in `$HARNESS_CACHE/fuzz/corpus/<target>/` (new inputs go
//! there, never into the repo); a crash is written to
//! `$HARNESS_CACHE/fuzz/artifacts/<target>/` and fails the command.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;

use crate::util;

const CARGO_FUZZ_VERSION: &str = "0.13.2";

/// The targets (binaries of `fuzz/Cargo.toml`) and the largest input each
/// takes.
pub const TARGETS: &[(&str, usize)] = &[
    ("messages", 8192),
    ("tarscan", 16384),
    ("checkpoint_key", 1024),
    ("ds_headers", 4096),
    ("http", 8192),
];

/// Seconds per target in the CI smoke.
pub const SMOKE_SECONDS: u64 = 30;

#[derive(Debug, Args)]
pub struct FuzzArgs {
    /// Only these targets (comma-separated or repeated); default: all.
    #[arg(long = "target", value_delimiter = ',')]
    targets: Vec<String>,
    /// Seconds to run each target.
    #[arg(long, default_value_t = SMOKE_SECONDS)]
    seconds: u64,
}

pub fn run(args: FuzzArgs) -> Result<()> {
    let names: Vec<&str> = if args.targets.is_empty() {
        TARGETS.iter().map(|(n, _)| *n).collect()
    } else {
        args.targets.iter().map(String::as_str).collect()
    };
    fuzz(&names, args.seconds)
}

/// The CI smoke: every target for [`SMOKE_SECONDS`].
pub fn smoke() -> Result<()> {
    let names: Vec<&str> = TARGETS.iter().map(|(n, _)| *n).collect();
    fuzz(&names, SMOKE_SECONDS)
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

fn fuzz(names: &[&str], seconds: u64) -> Result<()> {
    for n in names {
        if !TARGETS.iter().any(|(t, _)| t == n) {
            bail!(
                "no fuzz target `{n}` (targets: {})",
                TARGETS
                    .iter()
                    .map(|(t, _)| *t)
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
    }
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
    if let [one] = names {
        build.arg(one);
    }
    util::timed("fuzz: build", || util::run(&mut build))?;

    let bin_dir = target_dir.join(host_triple()?).join("release");
    let seeds_root = util::repo_root().join("fuzz").join("seeds");
    let mut results = Vec::new();
    for name in names {
        let max_len = TARGETS
            .iter()
            .find(|(t, _)| t == name)
            .map(|(_, l)| *l)
            .unwrap_or(4096);
        let corpus = util::cache_subdir(&format!("fuzz/corpus/{name}"))?;
        let artifacts = util::cache_subdir(&format!("fuzz/artifacts/{name}"))?;
        let mut cmd = Command::new(bin_dir.join(name));
        cmd.current_dir(&artifacts)
            .arg(&corpus)
            .arg(seeds_root.join(name))
            .arg(format!("-max_total_time={seconds}"))
            .arg(format!("-max_len={max_len}"))
            .arg("-timeout=30")
            .arg("-rss_limit_mb=2048")
            .arg("-print_final_stats=1")
            .arg(format!("-artifact_prefix={}/", artifacts.display()));
        let start = Instant::now();
        let figures = util::timed(&format!("fuzz: {name} for {seconds}s"), || {
            run_libfuzzer(&mut cmd)
        })?;
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
