//! `cargo xtask package`: every publishable crate packaged as crates.io
//! would take it, in dependency order, without uploading (a dry run). It
//! catches what only shows at publish time: a path dependency without a
//! version, missing metadata, a file the package needs outside its directory.

use anyhow::{Context, Result};

use crate::util;

/// The workspace members with `publish = false` (`cargo metadata` says
/// `"publish": []` for them).
fn unpublished() -> Result<Vec<String>> {
    let out = util::cargo()
        .args(["metadata", "--no-deps", "--format-version", "1"])
        .output()
        .context("running cargo metadata")?;
    anyhow::ensure!(out.status.success(), "cargo metadata failed");
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    Ok(meta["packages"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|p| p["publish"].as_array().is_some_and(|r| r.is_empty()))
        .filter_map(|p| p["name"].as_str().map(str::to_string))
        .collect())
}

/// `cargo package --workspace --no-verify` minus the unpublished crates.
/// `--no-verify`: each crate is built by the `clippy` and `test` steps
/// already; building thirteen packages again from their tarballs would
/// double CI's compile time.
pub fn dry_run() -> Result<()> {
    let skip = unpublished()?;
    println!("not published (publish = false): {}", skip.join(", "));
    let package = |offline: bool| {
        let mut cmd = util::cargo();
        cmd.args(["package", "--workspace", "--no-verify", "--allow-dirty"]);
        if offline {
            cmd.arg("--offline");
        }
        for name in &skip {
            cmd.args(["--exclude", name]);
        }
        util::run(&mut cmd)
    };
    // Offline first: online, each crate's lock file asks crates.io's index
    // again (58 s of a cold CI run, 64 s here, against 4 s offline), and
    // after the build steps every dependency is in cargo's local cache.
    // Online when that fails (a run of this step alone on an empty cache).
    package(true)
        .or_else(|e| {
            println!("package: offline packaging failed ({e:#}); again with the index online");
            package(false)
        })
        .context("packaging the publishable crates")
}
