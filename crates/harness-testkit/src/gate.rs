//! The sandbox gate binary for tests (`harness-sandbox-gate`: network
//! namespaces and host forwards for the local and docker providers).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use crate::real::skip_or_fail;

/// The gate binary: `$HARNESS_SANDBOX_GATE_BIN`, else the workspace's
/// `harness-sandbox-gate` package built now, on its own, into
/// `<target>/helpers` (not beside the test binaries, where another cargo
/// command could swap it mid-test). Built once per test process. `None`
/// (after [`skip_or_fail`]) when it cannot be built.
pub fn gate_binary() -> Option<PathBuf> {
    static GATE: OnceLock<Option<PathBuf>> = OnceLock::new();
    let found = GATE.get_or_init(|| {
        if let Some(p) = std::env::var_os("HARNESS_SANDBOX_GATE_BIN").filter(|p| !p.is_empty()) {
            return Some(p.into());
        }
        build_helper("harness-sandbox-gate")
            .map_err(|e| eprintln!("{e}"))
            .ok()
    });
    if found.is_none() {
        skip_or_fail("could not build the harness-sandbox-gate binary");
    }
    found.clone()
}

/// `cargo build -p <package> --target-dir <target>/helpers`; the binary.
fn build_helper(package: &str) -> Result<PathBuf, String> {
    let target = target_dir().ok_or("cannot tell the cargo target directory of this test")?;
    let helpers = target.join("helpers");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let status = Command::new(cargo)
        .args(["build", "-q", "-p", package, "--target-dir"])
        .arg(&helpers)
        .current_dir(crate::checkout::root())
        .status()
        .map_err(|e| format!("running cargo to build {package}: {e}"))?;
    if !status.success() {
        return Err(format!("cargo build -p {package} failed ({status})"));
    }
    let bin = helpers.join("debug").join(package);
    if bin.is_file() {
        Ok(bin)
    } else {
        Err(format!(
            "cargo built {package} but {} is missing",
            bin.display()
        ))
    }
}

/// `<target>` from this test binary's path (`<target>/<profile>/deps/<test>`
/// or `<target>/<profile>/<test>`), else `$CARGO_TARGET_DIR`.
fn target_dir() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let mut dir: &Path = exe.parent()?;
    if dir.file_name().is_some_and(|n| n == "deps") {
        dir = dir.parent()?;
    }
    match dir.parent() {
        Some(target) => Some(target.to_path_buf()),
        None => std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from),
    }
}
