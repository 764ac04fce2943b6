//! The workspace's helper binaries for tests: the sandbox gate
//! (`harness-sandbox-gate`: network namespaces and host forwards for the
//! local and docker providers) and the approval and relay MCP servers,
//! prebuilt by `cargo xtask ci` or built here once per test process.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::real::skip_or_fail;

/// The gate binary ([`helper_binary`]).
pub fn gate_binary() -> Option<PathBuf> {
    helper_binary("harness-sandbox-gate")
}

/// The workspace's binaries tests hand to the processes they start.
pub const HELPERS: [&str; 3] = [
    "harness-sandbox-gate",
    "harness-approval-mcp",
    "harness-relay-mcp",
];

/// The variable that names a prebuilt `package` binary to the tests:
/// `harness-sandbox-gate` → `HARNESS_TEST_SANDBOX_GATE_BIN`. Not the
/// product's own variables (`HARNESS_SANDBOX_GATE_BIN`…): set for every
/// test, those would change what the code under test finds (a local
/// provider with no gate named refuses deny-all, and a test checks it).
pub fn helper_env(package: &str) -> String {
    let name = package.trim_start_matches("harness-");
    format!("HARNESS_TEST_{}_BIN", name.to_uppercase().replace('-', "_"))
}

/// A helper binary of this workspace ([`HELPERS`]): the one its variable
/// ([`helper_env`]) names — `cargo xtask ci` builds them once before the
/// tests and sets it — else `package` built now, on its own, into
/// `<target>/helpers`, once per test process. Not the copy beside the test
/// binaries: another cargo command could swap it mid-test for a build
/// with other features (and a helper is hashed into every sandbox's
/// bootstrap identity, so each swap meant a new bootstrap). `None` when it
/// cannot be built, after [`skip_or_fail`] (the reason printed).
pub fn helper_binary(package: &str) -> Option<PathBuf> {
    static BUILT: std::sync::Mutex<Vec<(String, Option<PathBuf>)>> =
        std::sync::Mutex::new(Vec::new());
    if let Some(p) = std::env::var_os(helper_env(package)).filter(|p| !p.is_empty()) {
        return Some(p.into());
    }
    let found = {
        let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
        match built.iter().find(|(name, _)| name == package) {
            Some((_, found)) => found.clone(),
            None => {
                let found = build_helper(package).map_err(|e| eprintln!("{e}")).ok();
                built.push((package.to_string(), found.clone()));
                found
            }
        }
    };
    if found.is_none() {
        skip_or_fail(&format!("could not build the {package} binary"));
    }
    found
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
