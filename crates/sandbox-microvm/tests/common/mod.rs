//! Finding the real parts: QEMU and the guest `cargo xtask microvm` built.

#![allow(dead_code)]

use std::path::PathBuf;

use harness_core::sandbox::{collect_exec, ExecOutput, ExecRequest, Sandbox};
use sandbox_microvm::{MicrovmConfig, MicrovmProvider};

/// `HARNESS_MICROVM_ASSETS`, else `$HARNESS_CACHE/microvm`.
pub fn assets_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("HARNESS_MICROVM_ASSETS") {
        return d.into();
    }
    let cache = std::env::var("HARNESS_CACHE").unwrap_or_else(|_| "/var/cache/harness".into());
    PathBuf::from(cache).join("microvm")
}

fn on_path(name: &str) -> bool {
    std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join(name).is_file()))
        .unwrap_or(false)
}

/// A provider with its VMs under `state`, or `None` after `skip_or_fail`
/// when QEMU or the guest is missing.
pub fn provider_in(state: impl Into<PathBuf>) -> Option<MicrovmProvider> {
    for tool in ["qemu-system-x86_64", "qemu-img"] {
        if !on_path(tool) {
            harness_testkit::skip_or_fail(&format!(
                "{tool} is not installed (cargo xtask deps: qemu-system-x86, qemu-utils)"
            ));
            return None;
        }
    }
    match MicrovmConfig::from_assets(assets_dir(), state) {
        Ok(config) => Some(MicrovmProvider::new(config)),
        Err(e) => {
            harness_testkit::skip_or_fail(&format!("microVM guest: {e}"));
            None
        }
    }
}

/// A provider with a fresh temporary state directory (kept alive by the
/// returned guard).
pub fn provider() -> Option<(MicrovmProvider, tempfile::TempDir)> {
    // Under /tmp: the agent socket path must stay short.
    let dir = tempfile::Builder::new()
        .prefix("mvm")
        .tempdir_in("/tmp")
        .expect("temp dir");
    let p = provider_in(dir.path())?;
    Some((p, dir))
}

pub async fn sh(sb: &dyn Sandbox, script: &str) -> ExecOutput {
    collect_exec(sb.exec(ExecRequest::shell(script)).await.unwrap())
        .await
        .unwrap()
}
