//! `cargo xtask ci`: the one command CI runs (and a developer can run too).

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};

use crate::beside::{self, Beside};
use crate::cargo_tools::CargoTools;
use crate::matrix::{self, Row, What};
use crate::{
    agents, deny, deps, env, fuzz, image, layers, microvm, package, services, skips, util, worker,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Step {
    /// apt, PyPI and npm packages (`cargo xtask deps` without the agents
    /// and cargo-mutants, which the mutants step installs)
    Deps,
    /// dockerd, Temporal, SeaweedFS (`cargo xtask services start`)
    Services,
    /// the Docker test image (`cargo xtask image`)
    Image,
    /// the sandbox-microvm guest: kernel, initramfs, root disk (`cargo xtask microvm`)
    Microvm,
    /// the Claude Code and Codex CLIs (`cargo xtask agents`)
    Agents,
    /// the Cloudflare Worker's tools and its two wasm32 builds (`cargo
    /// xtask worker deps`, `cargo xtask worker build [--test-routes]`): the
    /// test build its tests run under `wrangler dev`, and the deploy build
    /// one test checks has no test routes
    Worker,
    /// cargo fmt --all -- --check
    Fmt,
    /// who may depend on whom (`cargo xtask layers`, on cargo metadata)
    Layers,
    /// cargo clippy --workspace --all-targets -- -D warnings
    Clippy,
    /// harness-core builds for wasm32-unknown-unknown
    Wasm,
    /// cargo deny --offline check licenses bans sources
    Deny,
    /// cargo package of every publishable crate (dry run)
    Package,
    /// cargo nextest run --workspace
    Test,
    /// the rows in xtask/src/matrix.rs
    Matrix,
    /// every fuzz target, deterministically (`cargo xtask fuzz --smoke`)
    Fuzz,
    /// the mutants in what the last commit changed in the listed files, at
    /// most 6 (`cargo xtask mutants --ci`)
    Mutants,
}

impl Step {
    pub fn name(self) -> String {
        self.to_possible_value()
            .map(|v| v.get_name().to_string())
            .unwrap_or_default()
    }

    fn needs_real_parts(self) -> bool {
        matches!(
            self,
            Step::Deps | Step::Services | Step::Image | Step::Microvm | Step::Agents | Step::Worker
        )
    }
}

#[derive(Debug, Args)]
pub struct CiArgs {
    /// Run only these steps (comma-separated or repeated), in CI order.
    #[arg(long, value_enum, value_delimiter = ',')]
    only: Vec<Step>,
    /// Skip these steps.
    #[arg(long, value_enum, value_delimiter = ',')]
    skip: Vec<Step>,
    /// Skip deps/services/image/agents; tests that need real parts then skip
    /// themselves (HARNESS_REQUIRE_REAL is not set).
    #[arg(long)]
    skip_services: bool,
}

/// Counts from nextest's summary line(s).
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Counts {
    passed: u64,
    failed: u64,
    skipped: u64,
}

impl Counts {
    fn add(&mut self, o: Counts) {
        self.passed += o.passed;
        self.failed += o.failed;
        self.skipped += o.skipped;
    }
}

pub fn ci(args: CiArgs) -> Result<()> {
    // Declaration order of `Step` is CI order.
    let steps: Vec<Step> = Step::value_variants()
        .iter()
        .copied()
        .filter(|s| args.only.is_empty() || args.only.contains(s))
        .filter(|s| !args.skip.contains(s))
        .filter(|s| !(args.skip_services && s.needs_real_parts()))
        .collect();
    let require_real = !args.skip_services;
    let total = Instant::now();
    println!(
        "cargo xtask ci: HARNESS_CACHE={} CARGO_TARGET_DIR={} CI={}",
        util::cache_dir().display(),
        util::cargo_target_dir().display(),
        util::is_ci()
    );
    println!(
        "steps: {}",
        steps
            .iter()
            .map(|s| s.name())
            .collect::<Vec<_>>()
            .join(", ")
    );

    if util::is_ci() && std::env::var_os(beside::CHILD_ENV).is_none() {
        // A fresh clone's mtimes would make cargo rebuild every workspace crate.
        let target = util::cargo_target_dir();
        match crate::mtimes::restore_and_record(&util::repo_root(), &target) {
            Ok(r) => println!(
                "source mtimes: {} restored, {} changed, {} new (manifest in {})",
                r.restored,
                r.changed,
                r.new,
                target.display()
            ),
            // Only speed is lost: cargo rebuilds what it cannot trust.
            Err(e) => println!("source mtimes: not restored: {e:#}"),
        }
    }

    let mut tools = CargoTools::for_run(&steps);
    let mut beside = Beside::for_run(&steps, args.skip_services);
    let mut done: Vec<(Step, Duration, bool)> = Vec::new();
    let mut counts: Option<Counts> = None;
    let n = steps.len();
    for (i, step) in steps.iter().copied().enumerate() {
        println!();
        println!(
            "==================== [{}/{n}] {} ====================",
            i + 1,
            step.name()
        );
        let start = Instant::now();
        let res = if beside.owns(step) {
            beside.finish(step).map(|c| {
                if let Some(c) = c {
                    counts.get_or_insert_with(Counts::default).add(c);
                }
            })
        } else {
            run_step(step, require_real, &mut counts, &mut beside, &mut tools)
        };
        let took = start.elapsed();
        done.push((step, took, res.is_ok()));
        match res {
            Ok(()) => println!(
                "---- [{}/{n}] {}: ok ({})",
                i + 1,
                step.name(),
                util::fmt_duration(took)
            ),
            Err(e) => {
                println!(
                    "---- [{}/{n}] {}: FAILED ({}): {e:#}",
                    i + 1,
                    step.name(),
                    util::fmt_duration(took)
                );
                beside.abandon();
                tools.abandon();
                summary(&done, total.elapsed(), counts);
                bail!("cargo xtask ci: step `{}` failed: {e:#}", step.name());
            }
        }
    }
    summary(&done, total.elapsed(), counts);
    Ok(())
}

fn summary(done: &[(Step, Duration, bool)], total: Duration, counts: Option<Counts>) {
    println!();
    println!("==================== summary ====================");
    for (step, took, ok) in done {
        println!(
            "{:<9} {:<6} {:>8}",
            step.name(),
            if *ok { "ok" } else { "FAILED" },
            util::fmt_duration(*took)
        );
    }
    println!("{:<9} {:<6} {:>8}", "total", "", util::fmt_duration(total));
    let skipped = SKIPPED.lock().unwrap_or_else(|e| e.into_inner());
    if skipped.is_empty() {
        println!("skipped tests: none");
    } else {
        println!("skipped tests ({}):", skipped.len());
        for (test, why) in skipped.iter() {
            println!("  {test} — {why}");
        }
    }
    drop(skipped);
    if let Some(c) = counts {
        // The plain closing line CI reads: `tests: N passed, N failed, N skipped`.
        println!(
            "tests: {} passed, {} failed, {} skipped",
            c.passed, c.failed, c.skipped
        );
    }
    let _ = std::io::stdout().flush();
}

/// The features CI builds the workspace with: the `harness` binary with
/// every backend (its default build is small; docs/cli.md, "Features"),
/// so every test of it runs, and the move pipeline's pure-Rust zstd (the
/// Worker's) beside libzstd, so its tests run in the same build instead
/// of a matrix row of their own (whose dependencies, built with other
/// features, cost a cold run 5 m 17 s). Clippy, the tests and the list of
/// ignored tests all use it, so they see the same code.
pub const CI_FEATURES: [&str; 2] = ["--features", "harness-cli/full,harness-moves/zstd-rust"];

fn run_step(
    step: Step,
    require_real: bool,
    counts: &mut Option<Counts>,
    beside: &mut Beside,
    tools: &mut CargoTools,
) -> Result<()> {
    match step {
        // cargo-mutants is the mutants step's (`cargo_tools.rs`).
        Step::Deps => deps::system(),
        Step::Services => services::start(services::ALL),
        Step::Image => image::build(false),
        Step::Microvm => microvm::build(false).map(|_| ()),
        Step::Agents => agents::install_all().map(|_| ()),
        Step::Worker => tools
            .wait_for(Step::Worker)
            .and_then(|()| worker::deps())
            .and_then(|()| worker::build(false, true))
            .and_then(|()| worker::build(false, false)),
        Step::Fmt => util::run(util::cargo().args(["fmt", "--all", "--", "--check"]))
            .context("formatting differs: run `cargo fmt --all`"),
        Step::Layers => layers::check(),
        Step::Clippy => util::run(
            util::cargo()
                .args(["clippy", "--workspace", "--all-targets"])
                .args(CI_FEATURES)
                .args(["--", "-D", "warnings"]),
        ),
        Step::Wasm => {
            util::run(util::cargo().args(["build", "-p", "harness-core", "--target", matrix::WASM]))
        }
        Step::Deny => deny::check(),
        Step::Package => package::dry_run(),
        Step::Test => {
            // First, as it builds what the run then finds built: once the
            // run starts, cargo's build lock belongs to the steps beside.
            check_ignored()?;
            let mut cmd = util::cargo();
            cmd.args(["nextest", "run", "--workspace", "--no-fail-fast"])
                .args(["--test-threads", &test_threads().to_string()])
                .args(CI_FEATURES);
            nextest(&mut cmd, require_real, counts, &mut || beside.start())
        }
        Step::Matrix => run_matrix(matrix::MATRIX, require_real, counts),
        Step::Fuzz => fuzz::smoke(),
        Step::Mutants => tools
            .wait_for(Step::Mutants)
            .and_then(|()| crate::mutants::run_ci()),
    }
}

/// How many tests the test step runs at once: `$HARNESS_TEST_THREADS`, else
/// one and a half per core. Many tests wait on agents, Docker and the
/// scripted model's turns rather than compute: with one thread per core a
/// cold CI run's test step left the two cores 27 % idle (vmstat every
/// 10 s, docs/CI.md), and three threads take that up.
fn test_threads() -> usize {
    std::env::var("HARNESS_TEST_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n: &usize| n > 0)
        .unwrap_or_else(|| {
            let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
            cores + cores.div_ceil(2)
        })
}

/// nextest runs so far in this process (each gets its own skip log).
static RUNS: AtomicU64 = AtomicU64::new(0);

/// Every test that did not run, with why, for the closing summary.
static SKIPPED: std::sync::Mutex<Vec<(String, String)>> = std::sync::Mutex::new(Vec::new());

/// `#[ignore]`d tests must be exactly the ones `skips::IGNORED` lists: a
/// new one fails the run until it is listed with its reason, and a listed
/// one that is gone fails it until it is removed.
fn check_ignored() -> Result<()> {
    let out = util::cargo()
        .args([
            "nextest",
            "list",
            "--workspace",
            CI_FEATURES[0],
            CI_FEATURES[1],
            "--run-ignored",
            "only",
            "--message-format",
            "oneline",
        ])
        .stderr(Stdio::inherit())
        .output()
        .context("listing the ignored tests")?;
    if !out.status.success() {
        bail!("`cargo nextest list --run-ignored only` failed");
    }
    let found: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(str::to_string)
        .collect();
    let listed = ignored_as_listed(&found, skips::IGNORED)?;
    SKIPPED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .extend(listed);
    Ok(())
}

/// The `#[ignore]`d tests `found`, each with its reason from `registry`;
/// an error naming any not in it, or any it lists that is not found.
fn ignored_as_listed(found: &[String], registry: &[(&str, &str)]) -> Result<Vec<(String, String)>> {
    let mut listed = Vec::new();
    let mut unlisted = Vec::new();
    for test in found {
        match registry.iter().find(|(name, _)| name == test) {
            Some((_, why)) => listed.push((test.clone(), format!("#[ignore]: {why}"))),
            None => unlisted.push(test.as_str()),
        }
    }
    let gone: Vec<&str> = registry
        .iter()
        .map(|(name, _)| *name)
        .filter(|name| !found.iter().any(|f| f == name))
        .collect();
    if !unlisted.is_empty() {
        bail!(
            "ignored tests not in xtask/src/skips.rs (IGNORED): {} — list each with why it may go unrun, or make it run",
            unlisted.join(", ")
        );
    }
    if !gone.is_empty() {
        bail!(
            "xtask/src/skips.rs lists ignored tests that no longer exist: {}",
            gone.join(", ")
        );
    }
    Ok(listed)
}

/// The skips a run logged (`<test>\t<reason>` lines, `harness_testkit::
/// skip_or_fail`), each with its reason, and those of them `allowed` does
/// not name (matched at the end of the test's name) when real parts are
/// required: any such fails the run.
fn logged_skips(
    logged: &str,
    require_real: bool,
    allowed: &[(&str, &str)],
) -> (Vec<(String, String)>, Vec<String>) {
    let mut skipped = Vec::new();
    let mut not_allowed = Vec::new();
    for line in logged.lines() {
        let (test, why) = line.split_once('\t').unwrap_or((line, ""));
        if require_real && !allowed.iter().any(|(name, _)| test.ends_with(name)) {
            not_allowed.push(test.to_string());
        }
        skipped.push((test.to_string(), why.to_string()));
    }
    (skipped, not_allowed)
}

/// Run nextest with the test environment, echoing its output and reading
/// its `Summary` line into `counts` (also when tests failed). Tests that
/// skip for a missing real part append to a log (see
/// `harness_testkit::skip_or_fail`); they are named in the summary, and
/// under `require_real` only `skips::ALLOWED_SKIPS` may skip at all.
fn nextest(
    cmd: &mut Command,
    require_real: bool,
    counts: &mut Option<Counts>,
    on_start: &mut dyn FnMut(),
) -> Result<()> {
    let test_env = env::test_env(require_real);
    for (k, v) in &test_env {
        println!("  {k}={v}");
        cmd.env(k, v);
    }
    for (k, bin) in crate::helpers::prebuilt()? {
        println!("  {k}={}", bin.display());
        cmd.env(k, bin);
    }
    let skip_log = util::cache_dir().join("skips").join(format!(
        "{}-{}.log",
        std::process::id(),
        RUNS.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(skip_log.parent().expect("has a parent"))?;
    let _ = std::fs::remove_file(&skip_log);
    cmd.env("HARNESS_SKIP_LOG", &skip_log);
    let allowed: Vec<&str> = skips::ALLOWED_SKIPS.iter().map(|(name, _)| *name).collect();
    cmd.env("HARNESS_ALLOWED_SKIPS", allowed.join(","));
    let result = nextest_inner(cmd, counts, on_start);
    let logged = std::fs::read_to_string(&skip_log).unwrap_or_default();
    let _ = std::fs::remove_file(&skip_log);
    let (skipped, not_allowed) = logged_skips(&logged, require_real, skips::ALLOWED_SKIPS);
    SKIPPED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .extend(skipped);
    result?;
    if !not_allowed.is_empty() {
        bail!(
            "tests skipped that xtask/src/skips.rs does not allow: {}",
            not_allowed.join(", ")
        );
    }
    Ok(())
}

/// `on_start` is called once, when nextest starts running tests (its build
/// is done).
fn nextest_inner(
    cmd: &mut Command,
    counts: &mut Option<Counts>,
    on_start: &mut dyn FnMut(),
) -> Result<()> {
    println!("$ {}", util::display(cmd));
    let mut child = cmd
        .stderr(Stdio::piped())
        .spawn()
        .context("could not start cargo nextest (is cargo-nextest installed?)")?;
    let stderr = child.stderr.take().expect("piped");
    let mut summary_line = None;
    let mut err = std::io::stderr();
    for line in BufReader::new(stderr).lines() {
        let line = line.unwrap_or_default();
        let _ = writeln!(err, "{line}");
        let trimmed = line.trim_start();
        if trimmed.starts_with("Starting ") && trimmed.contains(" tests across ") {
            on_start();
        }
        if trimmed.starts_with("Summary [") {
            summary_line = Some(line);
        }
    }
    let status = child.wait()?;
    if let Some(line) = &summary_line {
        counts
            .get_or_insert_with(Counts::default)
            .add(parse_summary(line));
    }
    if !status.success() {
        bail!("`{}` failed ({status})", util::display(cmd));
    }
    if summary_line.is_none() {
        bail!("nextest printed no Summary line");
    }
    Ok(())
}

/// The counts of the closing line [`summary`] prints (`tests: N passed, N
/// failed, N skipped`) in a run's output, if it has one.
pub(crate) fn closing_counts(output: &str) -> Option<Counts> {
    let line = output.lines().rev().find(|l| l.starts_with("tests: "))?;
    Some(parse_summary(line.trim_start_matches("tests:")))
}

/// `Summary [  1.234s] 12 tests run: 11 passed, 1 failed, 3 skipped`.
fn parse_summary(line: &str) -> Counts {
    let mut c = Counts::default();
    let after = line.split_once("run:").map(|(_, r)| r).unwrap_or(line);
    for part in after.split(',') {
        let mut words = part.split_whitespace();
        let (Some(num), Some(word)) = (words.next(), words.next()) else {
            continue;
        };
        let Ok(num) = num.parse::<u64>() else {
            continue;
        };
        match word {
            "passed" => c.passed += num,
            "failed" | "timed" => c.failed += num,
            "skipped" => c.skipped += num,
            _ => {}
        }
    }
    c
}

/// name -> features (without `default`) for the workspace's packages.
fn workspace_packages() -> Result<BTreeMap<String, Vec<String>>> {
    let out = util::output(util::cargo().args(["metadata", "--no-deps", "--format-version", "1"]))?;
    let meta: serde_json::Value = serde_json::from_str(&out).context("parsing cargo metadata")?;
    let mut pkgs = BTreeMap::new();
    for p in meta["packages"]
        .as_array()
        .context("cargo metadata: no packages")?
    {
        let name = p["name"].as_str().unwrap_or_default().to_string();
        let mut features: Vec<String> = p["features"]
            .as_object()
            .map(|m| m.keys().filter(|k| *k != "default").cloned().collect())
            .unwrap_or_default();
        features.sort();
        pkgs.insert(name, features);
    }
    Ok(pkgs)
}

/// `cargo xtask extra`: the rows of `matrix::EXTRA`, which CI does not run.
pub fn run_extra() -> Result<()> {
    let mut counts = None;
    run_matrix(matrix::EXTRA, false, &mut counts)
}

fn run_matrix(rows: &[Row], require_real: bool, counts: &mut Option<Counts>) -> Result<()> {
    let pkgs = workspace_packages()?;
    let mut failed = Vec::new();
    let mut ran = 0;
    for row in rows {
        let expanded = match expand_row(row, &pkgs) {
            Ok(expanded) => expanded,
            Err(why) => {
                // A row that cannot run fails: a renamed package or feature
                // must not quietly drop what the row checked.
                println!("matrix: `{}` cannot run: {why}", row.label());
                failed.push(format!("{} ({why})", row.label()));
                continue;
            }
        };
        for r in expanded {
            ran += 1;
            let res = util::timed(&format!("matrix: {}", r.label()), || {
                run_row(&r, require_real, counts)
            });
            if res.is_err() {
                failed.push(r.label());
            }
        }
    }
    println!("matrix: {ran} row(s) run, {} failed", failed.len());
    if !failed.is_empty() {
        bail!("matrix rows failed:\n  {}", failed.join("\n  "));
    }
    Ok(())
}

/// The rows `row` stands for in a workspace whose packages have the
/// features `pkgs` lists (one per feature for an each-feature row), or
/// why it cannot run: its package is gone, it names a feature the package
/// lacks, or it expands to nothing.
fn expand_row(row: &Row, pkgs: &BTreeMap<String, Vec<String>>) -> Result<Vec<Row>, String> {
    let features = pkgs
        .get(row.package)
        .ok_or_else(|| format!("package `{}` is not in the workspace", row.package))?;
    if let Some(missing) = row
        .feature_list()
        .chain(row.except.iter().copied())
        .find(|f| !features.iter().any(|x| x == f))
    {
        return Err(format!(
            "package `{}` has no feature `{missing}`",
            row.package
        ));
    }
    if !row.each_feature {
        return Ok(vec![*row]);
    }
    let expanded: Vec<Row> = features
        .iter()
        .filter(|f| !row.except.contains(&f.as_str()))
        .map(|f| {
            let all = if row.features.is_empty() {
                f.clone()
            } else {
                format!("{},{f}", row.features)
            };
            Row {
                features: Box::leak(all.into_boxed_str()),
                each_feature: false,
                ..*row
            }
        })
        .collect();
    if expanded.is_empty() {
        return Err(format!(
            "package `{}` has no features to take one at a time",
            row.package
        ));
    }
    Ok(expanded)
}

fn run_row(row: &Row, require_real: bool, counts: &mut Option<Counts>) -> Result<()> {
    let mut cmd = util::cargo();
    match row.what {
        What::Check => cmd.arg("check"),
        What::Build => cmd.arg("build"),
        What::Test => cmd.args(["nextest", "run", "--no-fail-fast"]),
    };
    cmd.args(["-p", row.package]);
    if !row.default_features {
        cmd.arg("--no-default-features");
    }
    if !row.features.is_empty() {
        cmd.args(["--features", row.features]);
    }
    if let Some(t) = row.target {
        cmd.args(["--target", t]);
    }
    if let Some(t) = row.test_binary {
        cmd.args(["--test", t]);
    }
    if row.all_targets && row.what != What::Test {
        cmd.arg("--all-targets");
    }
    if row.what == What::Test {
        nextest(&mut cmd, require_real, counts, &mut || {})
    } else {
        util::run(&mut cmd)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_nextest_summary() {
        let c =
            parse_summary("     Summary [   1.234s] 12 tests run: 10 passed, 2 failed, 3 skipped");
        assert_eq!((c.passed, c.failed, c.skipped), (10, 2, 3));
        let c = parse_summary("     Summary [   0.010s] 2 tests run: 2 passed, 0 skipped");
        assert_eq!((c.passed, c.failed, c.skipped), (2, 0, 0));
    }

    #[test]
    fn reads_the_closing_line_of_another_run() {
        let c = closing_counts("x\ntests: 25 passed, 1 failed, 2 skipped\n").unwrap();
        assert_eq!((c.passed, c.failed, c.skipped), (25, 1, 2));
        assert!(closing_counts("no counts here").is_none());
    }

    /// A planted skip no registry entry allows fails the run when real
    /// parts are required, and is listed with its reason either way.
    #[test]
    fn a_skip_not_in_the_registry_fails_the_run() {
        let logged = "a::listed_one\tno KVM here\nplanted::unlisted\tno dockerd\n";
        let allowed = [("listed_one", "a machine without KVM")];
        let (skipped, not_allowed) = logged_skips(logged, true, &allowed);
        assert_eq!(not_allowed, ["planted::unlisted"]);
        assert_eq!(
            skipped,
            [
                ("a::listed_one".to_string(), "no KVM here".to_string()),
                ("planted::unlisted".to_string(), "no dockerd".to_string()),
            ]
        );
        // Without the promise of real parts, a skip is reported, not failed.
        assert!(logged_skips(logged, false, &allowed).1.is_empty());
        // The registry as it stands allows neither.
        assert_eq!(logged_skips(logged, true, skips::ALLOWED_SKIPS).1.len(), 2);
    }

    /// A planted `#[ignore]`d test the registry does not list fails the
    /// run, as does a listed one that is gone; listed ones carry their
    /// reason into the summary.
    #[test]
    fn an_ignored_test_not_in_the_registry_fails_the_run() {
        let registry = [("p child", "started by its parent")];
        let found = |names: &[&str]| names.iter().map(|n| n.to_string()).collect::<Vec<_>>();
        let listed = ignored_as_listed(&found(&["p child"]), &registry).unwrap();
        assert_eq!(
            listed,
            [(
                "p child".to_string(),
                "#[ignore]: started by its parent".to_string()
            )]
        );
        let err = ignored_as_listed(&found(&["p child", "p planted"]), &registry).unwrap_err();
        assert!(
            err.to_string()
                .contains("not in xtask/src/skips.rs (IGNORED): p planted"),
            "{err}"
        );
        let err = ignored_as_listed(&found(&[]), &registry).unwrap_err();
        assert!(
            err.to_string().contains("no longer exist: p child"),
            "{err}"
        );
    }

    /// Every row CI and `cargo xtask extra` run names a package and
    /// features this workspace has.
    #[test]
    fn every_matrix_row_can_run_here() {
        let pkgs = workspace_packages().unwrap();
        for row in matrix::MATRIX.iter().chain(matrix::EXTRA) {
            let rows =
                expand_row(row, &pkgs).unwrap_or_else(|why| panic!("{}: {why}", row.label()));
            assert!(!rows.is_empty(), "{}", row.label());
        }
    }

    /// A row whose package or feature is gone is an error that says which,
    /// not a skip.
    #[test]
    fn a_row_that_cannot_run_says_why() {
        let pkgs: BTreeMap<String, Vec<String>> = [
            ("with".to_string(), vec!["a".to_string(), "b".to_string()]),
            ("bare".to_string(), vec![]),
        ]
        .into_iter()
        .collect();
        let err = expand_row(&Row::check("gone"), &pkgs).unwrap_err();
        assert!(err.contains("`gone` is not in the workspace"), "{err}");
        let err = expand_row(&Row::test("with").features("otlp"), &pkgs).unwrap_err();
        assert!(err.contains("no feature `otlp`"), "{err}");
        let err = expand_row(&Row::check("with").each_feature().except(&["c"]), &pkgs).unwrap_err();
        assert!(err.contains("no feature `c`"), "{err}");
        let err = expand_row(&Row::check("bare").each_feature(), &pkgs).unwrap_err();
        assert!(err.contains("no features"), "{err}");
        let rows = expand_row(&Row::check("with").each_feature().except(&["a"]), &pkgs).unwrap();
        assert_eq!(rows.iter().map(|r| r.features).collect::<Vec<_>>(), ["b"]);
    }
}
