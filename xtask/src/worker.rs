//! `cargo xtask worker deps|build|dev|test`: the Cloudflare Worker
//! (`crates/harness-worker`) built for wasm32 and run under `wrangler dev`,
//! locally and offline (docs/cloudflare-worker.md).
//!
//! Tools, each installed once into `$HARNESS_CACHE/tools/<name>-<version>`
//! and skipped when the right version is there:
//! - `worker-build` (crates.io, `--locked`): builds the cdylib and its JS
//!   shim (both cargo installs are `--debug` builds: see `cargo_install`);
//! - `wasm-bindgen-cli` at exactly the `wasm-bindgen` version in
//!   `Cargo.lock` (without `--locked`: its own lock file does not build);
//! - `wrangler` from npm (4.86.0: the last release that runs on Node 20),
//!   which brings `workerd`;
//! - `esbuild` from npm (`@esbuild/linux-x64` at the version worker-build
//!   bundles with);
//! - `wasm-opt` from npm `binaryen` (132: the version worker-build 0.8.7
//!   runs; only `--release` builds use it). Debian's `binaryen` (108)
//!   cannot parse the module wasm-bindgen 0.2.130 writes ("invalid heap
//!   type index").
//!
//! worker-build would download wasm-bindgen, wasm-opt and esbuild from
//! GitHub; `WASM_BINDGEN_BIN`, `WASM_OPT_BIN` and `ESBUILD_BIN` point it at
//! these instead. wrangler runs with `WRANGLER_SEND_METRICS=false
//! CLOUDFLARE_CF_FETCH_ENABLED=false CI=1`: no metrics, no fetch of the
//! `request.cf` data, no prompts.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::util::{self, run};

pub const WORKER_BUILD_VERSION: &str = "0.8.7";
pub const WRANGLER_VERSION: &str = "4.86.0";
/// What worker-build 0.8.7 bundles with (its `CUR_ESBUILD_VERSION`).
pub const ESBUILD_VERSION: &str = "0.28.2";
/// The wasm-opt worker-build 0.8.7 runs (its `CUR_WASM_OPT_VERSION`), as
/// npm publishes it.
pub const BINARYEN_VERSION: &str = "132.0.0";

/// The Worker crate's directory.
pub fn worker_dir() -> PathBuf {
    util::repo_root().join("crates/harness-worker")
}

fn tools_dir() -> PathBuf {
    util::cache_dir().join("tools")
}

pub fn worker_build_bin() -> PathBuf {
    tools_dir()
        .join(format!("worker-build-{WORKER_BUILD_VERSION}"))
        .join("bin/worker-build")
}

pub fn wasm_bindgen_bin(version: &str) -> PathBuf {
    tools_dir()
        .join(format!("wasm-bindgen-{version}"))
        .join("bin/wasm-bindgen")
}

fn wrangler_root() -> PathBuf {
    tools_dir().join(format!("wrangler-{WRANGLER_VERSION}"))
}

/// The wrangler executable (`HARNESS_WRANGLER` for the tests).
pub fn wrangler_bin() -> PathBuf {
    wrangler_root().join("node_modules/.bin/wrangler")
}

fn esbuild_root() -> PathBuf {
    tools_dir().join(format!("esbuild-{ESBUILD_VERSION}"))
}

pub fn esbuild_bin() -> PathBuf {
    esbuild_root().join("node_modules/@esbuild/linux-x64/bin/esbuild")
}

fn binaryen_root() -> PathBuf {
    tools_dir().join(format!("binaryen-{BINARYEN_VERSION}"))
}

pub fn wasm_opt_bin() -> PathBuf {
    binaryen_root().join("node_modules/.bin/wasm-opt")
}

/// The `wasm-bindgen` crate's version in the workspace's `Cargo.lock`: the
/// CLI must be exactly that one.
pub fn wasm_bindgen_version() -> Result<String> {
    let lock = util::repo_root().join("Cargo.lock");
    let text =
        std::fs::read_to_string(&lock).with_context(|| format!("reading {}", lock.display()))?;
    let mut lines = text.lines();
    while let Some(line) = lines.next() {
        if line.trim() == "name = \"wasm-bindgen\"" {
            if let Some(version) = lines
                .next()
                .and_then(|l| l.trim().strip_prefix("version = \""))
                .and_then(|v| v.strip_suffix('"'))
            {
                return Ok(version.to_string());
            }
        }
    }
    bail!("no wasm-bindgen package in {}", lock.display())
}

/// The first line a `--version` run prints, or `None` if it does not run.
fn version_of(bin: &Path) -> Option<String> {
    let out = Command::new(bin)
        .arg("--version")
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .ok()?;
    out.status.success().then(|| {
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .next()
            .unwrap_or("")
            .trim()
            .to_string()
    })
}

/// The version in an installed npm package's `package.json`.
fn npm_version(package_json: &Path) -> Option<String> {
    let text = std::fs::read_to_string(package_json).ok()?;
    let value: serde_json::Value = serde_json::from_str(&text).ok()?;
    value["version"].as_str().map(str::to_string)
}

/// The `cargo install` of a tool into `root` (`$HARNESS_CACHE/tools/…`).
pub(crate) fn cargo_install(krate: &str, version: &str, root: &Path, locked: bool) -> Command {
    let mut cmd = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    // --debug: these tools only orchestrate (wasm-bindgen's pass over a
    // 3.4 MB module takes seconds either way), and an optimised build costs
    // a cold CI run ~20 min of the 2 cores instead of ~3.5 (measured, see
    // docs/cloudflare-worker.md).
    cmd.args(["install", krate, "--version", version, "--debug", "--root"])
        .arg(root)
        // A target directory of their own: the installs keep what they
        // built for the next version bump, and never wait for (or hold)
        // the workspace's build lock, so CI builds them beside other
        // steps (`cargo_tools.rs`).
        .env("CARGO_TARGET_DIR", util::cargo_target_dir().join("tools"));
    if locked {
        cmd.arg("--locked");
    }
    cmd
}

/// The `cargo install`s of the Worker's tools that are missing or at
/// another version: worker-build, then wasm-bindgen-cli.
pub(crate) fn missing_cargo_tools() -> Result<Vec<(&'static str, Command)>> {
    let mut missing = Vec::new();
    let bin = worker_build_bin();
    if version_of(&bin).is_none_or(|v| !v.ends_with(WORKER_BUILD_VERSION)) {
        missing.push((
            "worker-build",
            cargo_install("worker-build", WORKER_BUILD_VERSION, tool_root(&bin), true),
        ));
    }
    let version = wasm_bindgen_version()?;
    let bin = wasm_bindgen_bin(&version);
    if version_of(&bin).is_none_or(|v| v != format!("wasm-bindgen {version}")) {
        // Not --locked: the CLI's own lock file pins crates that no longer build.
        missing.push((
            "wasm-bindgen-cli",
            cargo_install("wasm-bindgen-cli", &version, tool_root(&bin), false),
        ));
    }
    Ok(missing)
}

/// `<root>` of `<root>/bin/<tool>`.
pub(crate) fn tool_root(bin: &Path) -> &Path {
    bin.parent()
        .and_then(Path::parent)
        .expect("the tool's bin/ is under its root")
}

/// Install every tool that is missing or at another version.
pub fn deps() -> Result<()> {
    util::timed("worker: rust target wasm32-unknown-unknown", || {
        run(Command::new("rustup").args(["target", "add", "wasm32-unknown-unknown"]))
    })?;
    util::timed("worker: worker-build and wasm-bindgen-cli", || {
        let missing = missing_cargo_tools()?;
        if missing.is_empty() {
            println!(
                "worker-build {WORKER_BUILD_VERSION} and wasm-bindgen {} are installed",
                wasm_bindgen_version()?
            );
        }
        for (_, mut cmd) in missing {
            run(&mut cmd)?;
        }
        Ok(())
    })?;
    util::timed("worker: wrangler (npm)", || {
        let have = npm_version(&wrangler_root().join("node_modules/wrangler/package.json"));
        if have.as_deref() == Some(WRANGLER_VERSION) && util::is_executable(&wrangler_bin()) {
            println!(
                "wrangler {WRANGLER_VERSION} is in {}",
                wrangler_root().display()
            );
            return Ok(());
        }
        util::npm_install(&wrangler_root(), &format!("wrangler@{WRANGLER_VERSION}"))
    })?;
    util::timed("worker: esbuild (npm)", || {
        if version_of(&esbuild_bin()).as_deref() == Some(ESBUILD_VERSION) {
            println!(
                "esbuild {ESBUILD_VERSION} is in {}",
                esbuild_root().display()
            );
            return Ok(());
        }
        util::npm_install(
            &esbuild_root(),
            &format!("@esbuild/linux-x64@{ESBUILD_VERSION}"),
        )
    })?;
    util::timed("worker: wasm-opt (npm binaryen)", || {
        let have = npm_version(&binaryen_root().join("node_modules/binaryen/package.json"));
        if have.as_deref() == Some(BINARYEN_VERSION) && util::is_executable(&wasm_opt_bin()) {
            println!(
                "binaryen {BINARYEN_VERSION} is in {}",
                binaryen_root().display()
            );
            return Ok(());
        }
        util::npm_install(&binaryen_root(), &format!("binaryen@{BINARYEN_VERSION}"))
    })?;
    Ok(())
}

/// Fail with what to run when a tool is missing.
fn require(bin: &Path) -> Result<()> {
    if !util::is_executable(bin) {
        bail!(
            "{} is missing: run `cargo xtask worker deps`",
            bin.display()
        );
    }
    Ok(())
}

/// Where the test build lives, under the crate: its own `wrangler.toml`
/// and `src/entry.mjs` (copies of the crate's) beside `build/`, so `wrangler
/// dev` runs it as it runs the crate's deploy build.
pub const TEST_BUILD_DIR: &str = "test-build";

/// worker-build in the crate's directory. The deploy build (no features)
/// → `crates/harness-worker/build/`; with `test_routes`, the test build
/// (the `test-routes` feature: the engine API, the slice failpoint, the
/// stores' conformance routes) → `crates/harness-worker/test-build/`, which
/// every test under `wrangler dev` runs. The two share every dependency's
/// build: only the crate itself is compiled twice.
pub fn build(release: bool, test_routes: bool) -> Result<()> {
    let version = wasm_bindgen_version()?;
    let (worker_build, bindgen, esbuild) = (
        worker_build_bin(),
        wasm_bindgen_bin(&version),
        esbuild_bin(),
    );
    for bin in [&worker_build, &bindgen, &esbuild] {
        require(bin)?;
    }
    let root = worker_dir();
    let out = if test_routes {
        root.join(TEST_BUILD_DIR)
    } else {
        root.clone()
    };
    let mut cmd = Command::new(&worker_build);
    cmd.current_dir(&root)
        .arg(if release { "--release" } else { "--dev" })
        .arg("--out-dir")
        .arg(out.join("build"))
        .env("CARGO_TARGET_DIR", util::cargo_target_dir())
        .env("WASM_BINDGEN_BIN", &bindgen)
        .env("ESBUILD_BIN", &esbuild);
    if test_routes {
        // After the options: worker-build hands what it does not know to
        // `cargo build`.
        cmd.args(["--features", "test-routes"]);
    }
    if util::is_executable(&wasm_opt_bin()) {
        cmd.env("WASM_OPT_BIN", wasm_opt_bin());
    } else if release {
        bail!(
            "{} is missing: run `cargo xtask worker deps`",
            wasm_opt_bin().display()
        );
    }
    run(&mut cmd)?;
    let index = out.join("build/index.js");
    if !index.exists() {
        bail!("worker-build did not leave {}", index.display());
    }
    if test_routes {
        // The same configuration and entry as the deploy build, so the
        // tests run what a deployment runs, plus the test routes.
        std::fs::create_dir_all(out.join("src"))?;
        for file in ["wrangler.toml", "src/entry.mjs"] {
            std::fs::copy(root.join(file), out.join(file))
                .with_context(|| format!("copying {file} into {}", out.display()))?;
        }
    }
    Ok(())
}

/// The environment wrangler runs with: offline and quiet.
pub fn wrangler_env(cmd: &mut Command) -> &mut Command {
    cmd.env("WRANGLER_SEND_METRICS", "false")
        .env("CLOUDFLARE_CF_FETCH_ENABLED", "false")
        .env("CI", "1")
}

/// `wrangler dev` on 127.0.0.1:`port`, its state in `persist`, started with
/// `setsid` (its own process group: workerd and the rest go with it) and
/// stopped by that group. A small `sh` stays in the terminal's foreground
/// group to do that: Ctrl-C (or SIGTERM/SIGHUP) reaches it, not wrangler's
/// group, and it signals wrangler's group; it also does when wrangler
/// exits by itself. `tokens`: the token table (`HARNESS_TOKENS`).
pub fn dev(port: u16, persist: Option<PathBuf>, tokens: Option<String>) -> Result<()> {
    require(&wrangler_bin())?;
    let index = worker_dir().join("build/index.js");
    if !index.exists() {
        bail!(
            "{} is missing: run `cargo xtask worker build`",
            index.display()
        );
    }
    let persist = match persist {
        Some(p) => p,
        None => util::cache_subdir("worker-dev")?,
    };
    // `setsid` in a non-interactive shell's background job is not a group
    // leader, so it execs in place: `$!` is wrangler, and its group id.
    // (dash's `kill` takes no `--`: `kill -TERM -<pgid>`.)
    const SUPERVISE: &str = r#"setsid "$@" & pid=$!
trap 'kill -TERM "-$pid" 2>/dev/null' INT TERM HUP
wait "$pid"; status=$?
kill -TERM "-$pid" 2>/dev/null
wait "$pid" 2>/dev/null
exit "$status""#;
    let mut cmd = Command::new("sh");
    cmd.args(["-c", SUPERVISE, "sh"])
        .arg(wrangler_bin())
        .current_dir(worker_dir())
        .args(["dev", "--ip", "127.0.0.1", "--port", &port.to_string()])
        .arg("--persist-to")
        .arg(&persist)
        .args(["--show-interactive-dev-session=false"]);
    if let Some(tokens) = tokens {
        cmd.arg("--var").arg(format!("HARNESS_TOKENS:{tokens}"));
    }
    wrangler_env(&mut cmd);
    println!("$ {}", util::display(&cmd));
    let mut child = cmd.spawn().context("starting wrangler dev")?;
    let addr = format!("127.0.0.1:{port}");
    if util::wait_until(Duration::from_secs(60), || util::tcp_answers(&addr)) {
        println!(
            "wrangler dev: http://{addr} (state in {}); Ctrl-C stops it",
            persist.display()
        );
    }
    let status = child.wait().context("waiting for wrangler dev")?;
    println!("wrangler dev ended ({status})");
    Ok(())
}

/// Build the Worker, then run its tests that need only wrangler (the
/// session-API and Durable Streams suites, and the engine suite on
/// Workflows, under `wrangler dev`) with the tools' paths and
/// `HARNESS_REQUIRE_REAL=1`.
pub fn test() -> Result<()> {
    util::timed("worker: build", || build(false, false))?;
    util::timed("worker: test build", || build(false, true))?;
    util::timed("worker: test under wrangler dev", || {
        run(util::cargo()
            .args(["test", "-p", "harness-worker", "--test", "wrangler"])
            .args(["--test", "engine"])
            .env("HARNESS_WRANGLER", wrangler_bin())
            .env("HARNESS_REQUIRE_REAL", "1"))
    })
}
