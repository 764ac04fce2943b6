//! `cargo xtask mutants`: mutation testing with cargo-mutants
//! (docs/reliability.md, "Mutation testing") of the files where a silent
//! bug loses data or lets someone in. Each file is mutated with only the
//! tests that cover it (on two cores a mutant is a rebuild plus those
//! tests: the workspace's whole suite per mutant would take days).
//!
//! A mutant no test catches ("missed") fails the run unless
//! `xtask/mutants-equivalent.txt` names it with the reason it cannot be
//! caught (it changes nothing observable); at most a tenth of a file's
//! mutants may be named there. `--ci` is CI's smoke: the mutants in code
//! the last commit changed, at most [`CI_MUTANTS`] of them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use clap::Args;

use crate::util;

/// The cargo-mutants release `cargo xtask deps` installs.
pub const VERSION: &str = "27.1.0";

/// CI mutates at most this many mutants in all (a shard of each touched
/// file's, in the listed order, while the budget lasts): about 30 s each
/// on two cores.
const CI_MUTANTS: usize = 6;

/// A file under mutation, and the packages whose tests cover it.
struct Target {
    file: &'static str,
    tests: &'static [&'static str],
}

/// The listed files (issue 43): the append decision and the log rules,
/// retention, the audit chain, tar scanning, the turn machine and its
/// driver, the session actor and its host-call outcomes, tree checkpoints'
/// restore verification, garbage collection and its locks, the tar
/// extraction of host directories (the local provider's, Docker's from the
/// engine's host), fencing (the PostgreSQL leases and the
/// fenced append), the native log store and its index, the
/// broker's session and turn tokens and its budget admission.
const TARGETS: &[Target] = &[
    Target {
        file: "crates/harness-core/src/log/append.rs",
        tests: &["harness-core", "session-log"],
    },
    Target {
        file: "crates/harness-core/src/log/retention.rs",
        tests: &["harness-core", "session-log"],
    },
    Target {
        file: "crates/harness-core/src/log/chain.rs",
        tests: &["harness-core"],
    },
    Target {
        file: "crates/harness-core/src/log.rs",
        tests: &["harness-core", "session-log"],
    },
    Target {
        file: "crates/harness-core/src/tarscan.rs",
        tests: &["harness-core"],
    },
    Target {
        file: "crates/harness-core/src/turn_driver.rs",
        tests: &["harness-core"],
    },
    Target {
        file: "crates/harness-core/src/turn.rs",
        tests: &["harness-core"],
    },
    Target {
        file: "crates/harness-core/src/actor/mod.rs",
        tests: &["harness-core"],
    },
    Target {
        file: "crates/harness-core/src/actor/host_calls.rs",
        tests: &["harness-core"],
    },
    Target {
        file: "crates/harness-moves/src/tree/gc.rs",
        tests: &["harness-moves"],
    },
    Target {
        file: "crates/harness-moves/src/tree/restore.rs",
        tests: &["harness-moves"],
    },
    Target {
        file: "crates/harness-tario/src/lib.rs",
        tests: &["harness-tario", "sandbox-local"],
    },
    Target {
        file: "crates/session-log-postgres/src/lease.rs",
        tests: &["session-log-postgres"],
    },
    Target {
        file: "crates/session-log/src/lib.rs",
        tests: &["session-log"],
    },
    Target {
        file: "crates/session-log/src/index.rs",
        tests: &["session-log"],
    },
    Target {
        file: "crates/harness-broker-proto/src/token.rs",
        tests: &["harness-broker-proto"],
    },
    Target {
        file: "crates/harness-broker-proto/src/usage.rs",
        tests: &["harness-broker-proto"],
    },
];

#[derive(Debug, Args)]
pub struct MutantsArgs {
    /// Only these listed files (default: every one).
    #[arg(long = "file")]
    files: Vec<String>,
    /// Only mutants in code this diff touches (`git diff` output).
    #[arg(long, value_name = "DIFF")]
    in_diff: Option<PathBuf>,
    /// CI's smoke: the mutants in what the last commit changed in the
    /// listed files, at most 6.
    #[arg(long, conflicts_with_all = ["files", "in_diff"])]
    ci: bool,
    /// List the files and their test packages, then stop.
    #[arg(long)]
    list: bool,
}

/// The installed cargo-mutants (`cargo xtask deps`).
pub fn bin() -> PathBuf {
    util::cache_dir()
        .join("tools")
        .join(format!("cargo-mutants-{VERSION}"))
        .join("bin/cargo-mutants")
}

/// Install cargo-mutants unless this version is there (a debug build: it
/// only orchestrates, and compiles in under a minute on two cores).
pub fn install() -> Result<()> {
    match install_command() {
        Some(mut cmd) => util::run(&mut cmd),
        None => {
            println!("{} is installed", bin().display());
            Ok(())
        }
    }
}

/// The `cargo install` of cargo-mutants, or `None` when it is there.
pub(crate) fn install_command() -> Option<Command> {
    let bin = bin();
    (!bin.exists()).then(|| {
        crate::worker::cargo_install(
            "cargo-mutants",
            VERSION,
            crate::worker::tool_root(&bin),
            true,
        )
    })
}

/// CI's step: `--ci`.
pub fn run_ci() -> Result<()> {
    run(MutantsArgs {
        files: Vec::new(),
        in_diff: None,
        ci: true,
        list: false,
    })
}

/// What one file's run found.
#[derive(Debug, Default)]
struct Tally {
    caught: usize,
    missed: Vec<String>,
    timeout: usize,
    unviable: usize,
}

pub fn run(args: MutantsArgs) -> Result<()> {
    if args.list {
        for t in TARGETS {
            println!("{}  (tests: {})", t.file, t.tests.join(", "));
        }
        return Ok(());
    }
    install()?;
    let root = util::repo_root();
    let out = util::cargo_target_dir().join("mutants");
    std::fs::create_dir_all(&out)?;
    let (targets, diff, shard) = if args.ci {
        let diff = out.join("last-commit.diff");
        let text = Command::new("git")
            .args(["diff", "HEAD~1", "HEAD", "--"])
            .args(TARGETS.iter().map(|t| t.file))
            .current_dir(&root)
            .output()
            .context("git diff HEAD~1 (a clone with history)")?;
        if !text.status.success() {
            println!("mutants: no previous commit to diff against: nothing to mutate");
            return Ok(());
        }
        std::fs::write(&diff, &text.stdout)?;
        let touched: Vec<&Target> = TARGETS
            .iter()
            .filter(|t| String::from_utf8_lossy(&text.stdout).contains(&format!("b/{}", t.file)))
            .collect();
        (touched, Some(diff), true)
    } else {
        let chosen: Vec<&Target> = TARGETS
            .iter()
            .filter(|t| args.files.is_empty() || args.files.iter().any(|f| t.file.ends_with(f)))
            .collect();
        if chosen.is_empty() {
            bail!(
                "none of {:?} is a listed file (`cargo xtask mutants --list`)",
                args.files
            );
        }
        (chosen, args.in_diff.clone(), false)
    };
    if targets.is_empty() {
        println!("mutants: the last commit changed none of the listed files: nothing to mutate");
        return Ok(());
    }
    let equivalent = equivalents(&root)?;
    let mut report = Vec::new();
    let mut failed = Vec::new();
    let mut budget = CI_MUTANTS;
    for target in targets {
        let dir = out.join(target.file.replace('/', "__"));
        let mut cmd = Command::new(bin());
        cmd.arg("mutants")
            .args(["--file", target.file])
            // One comma-separated list (a repeated flag keeps only one).
            .args(["--test-package", &target.tests.join(",")])
            .args(["--no-shuffle", "--output"])
            .arg(&dir)
            .current_dir(&root)
            .env("CARGO_INCREMENTAL", "0");
        if shard && util::is_ci() {
            // CI's clone is thrown away: mutate it in place, so the build
            // reuses what the test step compiled (a copy has another path,
            // and cargo would build its crates again from nothing).
            cmd.arg("--in-place")
                .env("CARGO_TARGET_DIR", util::cargo_target_dir());
        } else {
            // By hand: mutated copies of the tree, built apart from the
            // main target dir (their crates' paths differ: they would only
            // fill it). `rm -rf $HARNESS_CACHE/mutants-target` frees it.
            cmd.env("CARGO_TARGET_DIR", util::cache_dir().join("mutants-target"));
        }
        if let Some(diff) = &diff {
            cmd.arg("--in-diff").arg(diff);
        }
        if shard {
            // One shard of at most CI_MUTANTS, chosen by the listing's size.
            let listed = Command::new(bin())
                .args(["mutants", "--list", "--file", target.file])
                .arg("--in-diff")
                .arg(diff.as_ref().expect("ci has a diff"))
                .current_dir(&root)
                .output()?;
            let n = String::from_utf8_lossy(&listed.stdout).lines().count();
            if n == 0 || budget == 0 {
                continue;
            }
            let shards = n.div_ceil(budget);
            budget -= n.div_ceil(shards);
            cmd.args(["--shard", &format!("0/{shards}")]);
        }
        println!("$ {}", util::display(&cmd));
        // cargo-mutants exits non-zero when a mutant was missed: the
        // outcomes decide here.
        let _ = cmd.status().context("running cargo-mutants")?;
        let tally = tally(&dir.join("mutants.out/outcomes.json"))?;
        let tested = tally.caught + tally.missed.len() + tally.timeout;
        let unexplained: Vec<&String> = tally
            .missed
            .iter()
            .filter(|m| !equivalent.contains_key(m.as_str()))
            .collect();
        let named = tally.missed.len() - unexplained.len();
        let caught_pct = if tested == 0 {
            100.0
        } else {
            100.0 * (tally.caught + tally.timeout) as f64 / tested as f64
        };
        report.push(format!(
            "| `{}` | {} | {} | {} | {} | {} | {caught_pct:.0} % |",
            target.file,
            tested + tally.unviable,
            tally.caught,
            tally.missed.len(),
            tally.timeout,
            tally.unviable
        ));
        for m in &tally.missed {
            let why = equivalent
                .get(m.as_str())
                .map_or("NOT EXPLAINED".to_string(), |w| format!("equivalent: {w}"));
            println!("  missed: {m} — {why}");
        }
        if !unexplained.is_empty() {
            failed.push(format!(
                "{}: {} mutant(s) no test catches",
                target.file,
                unexplained.len()
            ));
        }
        if tested > 0 && named * 10 > tested {
            failed.push(format!(
                "{}: {named} of {tested} mutants are named equivalent (at most a tenth)",
                target.file
            ));
        }
    }
    println!("\n| file | mutants | caught | missed | timed out | unviable | caught |");
    println!("|---|---|---|---|---|---|---|");
    for line in &report {
        println!("{line}");
    }
    if !failed.is_empty() {
        bail!("mutation testing: {}", failed.join("; "));
    }
    Ok(())
}

/// `xtask/mutants-equivalent.txt`: `<mutant name> — <why it is equivalent>`
/// per line (`#` comments).
fn equivalents(root: &Path) -> Result<BTreeMap<String, String>> {
    let path = root.join("xtask/mutants-equivalent.txt");
    let text = std::fs::read_to_string(&path).unwrap_or_default();
    let mut out = BTreeMap::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let Some((name, why)) = line.split_once(" — ") else {
            bail!(
                "{}:{}: a line is `<mutant> — <why it is equivalent>`",
                path.display(),
                i + 1
            );
        };
        out.insert(name.trim().to_string(), why.trim().to_string());
    }
    Ok(out)
}

/// Count a run's outcomes (cargo-mutants' `outcomes.json`).
fn tally(path: &Path) -> Result<Tally> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading {} (did cargo-mutants run?)", path.display()))?;
    let json: serde_json::Value = serde_json::from_str(&text)?;
    let mut tally = Tally::default();
    for outcome in json["outcomes"].as_array().into_iter().flatten() {
        let Some(name) = outcome["scenario"]["Mutant"]["name"].as_str() else {
            continue; // the unmutated baseline
        };
        match outcome["summary"].as_str() {
            Some("CaughtMutant") => tally.caught += 1,
            Some("MissedMutant") => tally.missed.push(name.to_string()),
            Some("Timeout") => tally.timeout += 1,
            Some("Unviable") => tally.unviable += 1,
            other => bail!("{name}: an outcome this xtask does not know: {other:?}"),
        }
    }
    Ok(tally)
}
