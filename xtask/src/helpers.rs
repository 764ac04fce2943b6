//! The workspace's helper binaries the tests hand to the processes they
//! start (the sandbox gate, the approval and relay MCP servers), built once
//! before a nextest run and named to it through their variables.
//!
//! A test that finds no variable builds its helper itself
//! (`harness_testkit::gate::helper_binary`): one `cargo build` per test
//! process. Each is a no-op build, but cargo loads and checks the whole
//! workspace for it: during CI's test step a cargo process was running
//! about all the time, a third of the two cores' samples in one 90 s
//! `perf record -a` window (docs/CI.md).

use std::path::PathBuf;
use std::sync::OnceLock;

use anyhow::{bail, Result};

use crate::util;

/// `harness_testkit::gate::HELPERS` (a test below keeps the two alike).
pub const HELPERS: [&str; 3] = [
    "harness-sandbox-gate",
    "harness-approval-mcp",
    "harness-relay-mcp",
];

/// `harness_testkit::gate::helper_env`.
pub fn env_name(package: &str) -> String {
    let name = package.trim_start_matches("harness-");
    format!("HARNESS_TEST_{}_BIN", name.to_uppercase().replace('-', "_"))
}

/// Every helper built into `<target>/helpers` (where a test would build
/// it), once per xtask process; `(variable, binary)` for each.
pub fn prebuilt() -> Result<Vec<(String, PathBuf)>> {
    static BUILT: OnceLock<std::result::Result<Vec<(String, PathBuf)>, String>> = OnceLock::new();
    BUILT
        .get_or_init(|| build().map_err(|e| format!("{e:#}")))
        .clone()
        .map_err(anyhow::Error::msg)
}

fn build() -> Result<Vec<(String, PathBuf)>> {
    let dir = util::cargo_target_dir().join("helpers");
    let mut cmd = util::cargo();
    cmd.args(["build", "-q", "--target-dir"]).arg(&dir);
    for package in HELPERS {
        cmd.args(["-p", package]);
    }
    util::run(&mut cmd)?;
    let mut out = Vec::new();
    for package in HELPERS {
        let bin = dir.join("debug").join(package);
        if !bin.is_file() {
            bail!("cargo built {package} but {} is missing", bin.display());
        }
        out.push((env_name(package), bin));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_list_and_the_names_are_the_test_kits() {
        let kit =
            std::fs::read_to_string(util::repo_root().join("crates/harness-testkit/src/gate.rs"))
                .unwrap();
        let list = kit
            .split_once("pub const HELPERS")
            .and_then(|(_, rest)| rest.split_once("];"))
            .map(|(list, _)| list)
            .expect("gate.rs declares HELPERS");
        let named: Vec<&str> = list.split('"').skip(1).step_by(2).collect();
        assert_eq!(named, HELPERS);
        assert_eq!(
            env_name("harness-sandbox-gate"),
            "HARNESS_TEST_SANDBOX_GATE_BIN"
        );
        assert_eq!(env_name("harness-relay-mcp"), "HARNESS_TEST_RELAY_MCP_BIN");
        assert!(kit
            .contains(r#"format!("HARNESS_TEST_{}_BIN", name.to_uppercase().replace('-', "_"))"#));
    }
}
