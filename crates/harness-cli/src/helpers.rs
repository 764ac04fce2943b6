//! The helper programs sandboxes run are this binary.
//!
//! A sandbox needs three small programs beside the agent: the gate every
//! command of a restricted sandbox starts through (`harness-sandbox-gate`),
//! the approval server Claude Code asks for permission
//! (`harness-approval-mcp`) and the host-tool bridge (`harness-relay-mcp`).
//! Stable cargo cannot build another package's binary as a dependency, so
//! `cargo run -p harness-cli`, `cargo install harness-cli` and a release
//! archive would each ship `harness` alone. Instead `harness` is a
//! multi-call binary, as busybox is: invoked under a helper's name
//! (`argv[0]`), it runs that helper ([`dispatch`]). The home keeps a link
//! under each helper's name pointing at this executable ([`path`]), which
//! the providers run, mount or copy like any other helper binary.
//!
//! An explicit helper still wins: `$HARNESS_SANDBOX_GATE_BIN`,
//! `$HARNESS_APPROVAL_MCP_BIN`, `$HARNESS_RELAY_MCP_BIN`, or a binary of that
//! name beside this one (a workspace build of the helper crates).
//!
//! The microVM guest agent is the one helper that is not here: it is PID 1
//! of a guest, a static musl binary built with the guest's kernel and
//! initramfs by `cargo xtask microvm` (docs/sandbox-microvm.md).

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result};

use crate::home::Home;

/// A helper program.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Helper {
    /// `harness-sandbox-gate`.
    Gate,
    /// `harness-approval-mcp`.
    Approval,
    /// `harness-relay-mcp`.
    Relay,
}

impl Helper {
    /// Every helper.
    pub const ALL: [Helper; 3] = [Helper::Gate, Helper::Approval, Helper::Relay];

    /// Its binary name.
    pub fn name(self) -> &'static str {
        match self {
            Helper::Gate => harness::sandbox_gate::BINARY_NAME,
            Helper::Approval => "harness-approval-mcp",
            Helper::Relay => "harness-relay-mcp",
        }
    }

    /// The variable naming an explicit binary for it.
    pub fn env_var(self) -> &'static str {
        match self {
            Helper::Gate => harness::sandbox_gate::BIN_ENV,
            Helper::Approval => "HARNESS_APPROVAL_MCP_BIN",
            Helper::Relay => "HARNESS_RELAY_MCP_BIN",
        }
    }

    /// The helper a program invoked as `argv0` is, if any.
    fn of_argv0(argv0: &OsStr) -> Option<Helper> {
        let name = Path::new(argv0).file_name()?.to_str()?;
        if harness::sandbox_gate::NAMES.contains(&name) {
            return Some(Helper::Gate);
        }
        Self::ALL.into_iter().find(|h| h.name() == name)
    }

    fn run(self) -> ExitCode {
        match self {
            Helper::Gate => {
                harness::sandbox_gate::cli::main();
                ExitCode::SUCCESS
            }
            Helper::Approval => harness::approval_mcp::main(),
            Helper::Relay => harness::relay_mcp::main(),
        }
    }
}

/// Run as the helper this process was invoked as (its `argv[0]`), if it
/// was invoked as one; `None` for `harness` itself.
pub fn dispatch() -> Option<ExitCode> {
    let argv0 = std::env::args_os().next()?;
    Helper::of_argv0(&argv0).map(Helper::run)
}

/// The binary to run as `helper`: `$<helper's variable>` when set, else a
/// file of the helper's name beside this executable, else this executable
/// under the helper's name: `<home>/helpers/<name>`, a symbolic link to it
/// (made, or pointed here again, now).
pub fn path(home: &Home, helper: Helper) -> Result<PathBuf> {
    if let Some(p) = std::env::var_os(helper.env_var()).filter(|p| !p.is_empty()) {
        return Ok(p.into());
    }
    let exe = std::env::current_exe().context("finding this executable")?;
    if let Some(sibling) = exe.parent().map(|d| d.join(helper.name())) {
        if sibling.is_file() && !same_file(&sibling, &exe) {
            return Ok(sibling);
        }
    }
    let dir = home.helpers();
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let link = dir.join(helper.name());
    if std::fs::read_link(&link).ok().as_deref() != Some(exe.as_path()) {
        // Made under a temporary name and renamed over the old link, so a
        // concurrent process never finds it missing.
        let tmp = dir.join(format!(".{}.{}", helper.name(), std::process::id()));
        let _ = std::fs::remove_file(&tmp);
        std::os::unix::fs::symlink(&exe, &tmp)
            .with_context(|| format!("linking {} to {}", tmp.display(), exe.display()))?;
        std::fs::rename(&tmp, &link).with_context(|| format!("replacing {}", link.display()))?;
    }
    Ok(link)
}

fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_helper_is_known_by_its_name_wherever_it_lives() {
        for (argv0, want) in [
            ("harness-sandbox-gate", Some(Helper::Gate)),
            ("/run/harness/gate", Some(Helper::Gate)),
            (
                "/home/u/.local/share/harness/helpers/harness-relay-mcp",
                Some(Helper::Relay),
            ),
            (
                "/usr/local/bin/harness-approval-mcp",
                Some(Helper::Approval),
            ),
            ("harness", None),
            ("/usr/bin/harness", None),
            ("harness-relay-mcp-old", None),
        ] {
            assert_eq!(Helper::of_argv0(OsStr::new(argv0)), want, "{argv0}");
        }
    }
}
