//! The Durable Streams conformance suite: the official npm package
//! `@durable-streams/server-conformance-tests`, under vitest, against a
//! server at a base URL — `session-server`'s router natively, the Worker
//! under `wrangler dev` (the same suite, the same floor).
//!
//! The npm packages are installed once into
//! `$HARNESS_CACHE/npm/durable-streams` (default `/var/cache/harness`);
//! node and npm are the real parts it needs ([`available`] says why not).
//! A run fails when a suite test fails or fewer than [`MIN_PASSED`] pass (see
//! `docs/durable-streams.md` for the measured counts).

use std::path::{Path, PathBuf};
use std::process::Command;

/// Suite tests that must pass, per store. Measured (suite 0.3.6, memory and
/// SQLite stores alike): 332 of 338 passed, 0 failed, 6 skipped (the suite
/// skips its optional subscription/webhook APIs unless asked to run them).
/// The floor is the measured number: any regression fails this test.
pub const MIN_PASSED: u64 = 332;

/// Pinned versions, so a new suite release cannot silently move the floor.
const SUITE_VERSION: &str = "0.3.6";
const VITEST_VERSION: &str = "4.1.12";

/// The vitest file: the suite is a function to call inside a test file
/// (the package's own CLI finds no test files when run from node_modules).
const TEST_FILE: &str = r#"import { runConformanceTests } from "@durable-streams/server-conformance-tests"
const baseUrl = process.env.DS_BASE_URL
if (!baseUrl) throw new Error("DS_BASE_URL is required")
// The server's long-poll timeout is 2 s; the suite waits up to this + 1 s.
runConformanceTests({ baseUrl, longPollTimeoutMs: 5000 })
"#;

const VITEST_CONFIG: &str = r#"export default { test: { include: ["conformance.test.mjs"], testTimeout: 30000, hookTimeout: 30000 } }
"#;

fn found(program: &str) -> bool {
    Command::new(program)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Install (once) the suite and vitest into the cache directory.
pub fn install_dir() -> Result<PathBuf, String> {
    let cache = std::env::var("HARNESS_CACHE").unwrap_or_else(|_| "/var/cache/harness".into());
    let dir = Path::new(&cache).join("npm").join("durable-streams");
    let marker = dir
        .join("node_modules")
        .join("@durable-streams")
        .join("server-conformance-tests")
        .join("package.json");
    let vitest = dir.join("node_modules").join(".bin").join("vitest");
    let pinned = std::fs::read_to_string(&marker)
        .is_ok_and(|s| s.contains(&format!("\"version\": \"{SUITE_VERSION}\"")));
    if !pinned || !vitest.exists() {
        std::fs::create_dir_all(&dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
        let status = Command::new("npm")
            .arg("install")
            .arg("--no-audit")
            .arg("--no-fund")
            .arg("--prefix")
            .arg(&dir)
            .arg(format!(
                "@durable-streams/server-conformance-tests@{SUITE_VERSION}"
            ))
            .arg(format!("vitest@{VITEST_VERSION}"))
            .status()
            .map_err(|e| format!("run npm: {e}"))?;
        if !status.success() {
            return Err(format!(
                "npm install into {} failed: {status}",
                dir.display()
            ));
        }
    }
    let run = dir.join("run");
    std::fs::create_dir_all(&run).map_err(|e| e.to_string())?;
    std::fs::write(run.join("conformance.test.mjs"), TEST_FILE).map_err(|e| e.to_string())?;
    std::fs::write(run.join("vitest.config.mjs"), VITEST_CONFIG).map_err(|e| e.to_string())?;
    Ok(dir)
}

/// What a run of the suite reported.
#[derive(Debug)]
pub struct Counts {
    /// Tests passed.
    pub passed: u64,
    /// Tests failed.
    pub failed: u64,
    /// Tests skipped (the suite's optional APIs).
    pub skipped: u64,
    /// All tests.
    pub total: u64,
    /// Full names of the failed tests.
    pub failures: Vec<String>,
}

fn parse_report(path: &Path) -> Result<Counts, String> {
    let text =
        std::fs::read_to_string(path).map_err(|e| format!("read {}: {e}", path.display()))?;
    let report: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("vitest JSON report: {e}"))?;
    let num = |k: &str| {
        report
            .get(k)
            .and_then(serde_json::Value::as_u64)
            .unwrap_or(0)
    };
    let mut failures = Vec::new();
    for file in report["testResults"].as_array().into_iter().flatten() {
        for t in file["assertionResults"].as_array().into_iter().flatten() {
            if t["status"] == "failed" {
                failures.push(t["fullName"].as_str().unwrap_or("?").to_string());
            }
        }
    }
    Ok(Counts {
        passed: num("numPassedTests"),
        failed: num("numFailedTests"),
        skipped: num("numPendingTests") + num("numTodoTests"),
        total: num("numTotalTests"),
        failures,
    })
}

/// Where the suite is installed, or why it cannot run here (node or npm
/// missing, or the install failed).
pub fn available() -> Result<PathBuf, String> {
    if !found("node") || !found("npm") {
        return Err("node and npm are needed to run the Durable Streams conformance suite".into());
    }
    install_dir().map_err(|e| format!("cannot install the conformance suite: {e}"))
}

/// [`available`], or `None` after `skip_or_fail` with the reason.
pub fn available_or_skip() -> Option<PathBuf> {
    available().map_err(|why| crate::skip_or_fail(&why)).ok()
}

/// Run the suite (installed in `dir`) against the server at `base_url`
/// (`http://host:port`, streams under `/v1/stream/`), blocking. The
/// server's long-poll timeout must be under 5 s (the suite waits that long).
pub fn run(dir: &Path, base_url: &str) -> Counts {
    let report = dir.join("run").join("report.json");
    let _ = std::fs::remove_file(&report);
    let vitest = dir.join("node_modules").join(".bin").join("vitest");
    let output = Command::new(vitest)
        .current_dir(dir.join("run"))
        .args(["run", "--config", "vitest.config.mjs", "--reporter=json"])
        .arg(format!("--outputFile={}", report.display()))
        .env("DS_BASE_URL", base_url)
        .output()
        .expect("run vitest");
    match parse_report(&report) {
        Ok(c) => c,
        Err(e) => panic!(
            "no vitest report ({e}); vitest stderr:\n{}",
            String::from_utf8_lossy(&output.stderr)
        ),
    }
}

/// Print the counts and fail on any failed suite test or below
/// [`MIN_PASSED`]; `store` names the server and store in the messages.
///
/// No failure is allowed: every store passes every test the suite runs
/// (the 6 it skips are its optional subscription APIs). The reference
/// server `@durable-streams/server` 0.3.7 fails six of them
/// (`docs/durable-streams.md` names them); none of those is excused here.
pub fn check(store: &str, counts: &Counts) {
    println!(
        "durable-streams conformance: {} passed, {} failed, {} skipped (of {}, {store} store)",
        counts.passed, counts.failed, counts.skipped, counts.total
    );
    for name in &counts.failures {
        println!("  failed: {name}");
    }
    assert!(counts.total > 0, "the suite ran no tests");
    assert!(
        counts.failed == 0 && counts.failures.is_empty(),
        "durable-streams conformance ({store} store): {} suite test(s) failed: {:#?}",
        counts.failed,
        counts.failures
    );
    assert!(
        counts.passed >= MIN_PASSED,
        "durable-streams conformance ({store} store) regressed: {} passed < floor {MIN_PASSED}; failures: {:#?}",
        counts.passed,
        counts.failures
    );
}
