//! The shared sandbox conformance suite against the `microsandbox` engine
//! (feature `microsandbox`): the same suite the QEMU provider runs.
//!
//! It needs the microsandbox runtime (`MSB_PATH`, `MSB_LIBKRUNFW_PATH`, of
//! the SDK's version), a root filesystem directory (`HARNESS_MSB_ROOTFS`,
//! else the Docker test image's rootfs tarball that `cargo xtask image`
//! caches, extracted for the run) and a KVM that boots a guest. A boot probe
//! decides first; where it fails (the CI machines' `kvm_pvm`, on which
//! libkrun stops with `KVM_EXIT_INTERNAL_ERROR`) the test prints
//! `SKIP: <reason>` and skips through `harness_testkit::skip_or_fail`
//! (allowed by `xtask/src/skips.rs`).

#![cfg(feature = "microsandbox")]

use std::path::{Path, PathBuf};
use std::time::Duration;

use harness_core::sandbox::SandboxSpec;
use harness_testkit::conformance::sandbox::{self as suite, SuiteOptions};
use sandbox_microvm::{MicrosandboxConfig, MicrosandboxProvider};

fn skip(reason: &str) {
    println!("SKIP: {reason}");
    harness_testkit::skip_or_fail(reason);
}

/// `HARNESS_MSB_ROOTFS`, else the cached Docker test image rootfs tarball
/// extracted under `scratch`.
fn rootfs(scratch: &Path) -> Result<PathBuf, String> {
    if let Some(dir) = std::env::var_os("HARNESS_MSB_ROOTFS") {
        return Ok(dir.into());
    }
    let cache = std::env::var("HARNESS_CACHE").unwrap_or_else(|_| "/var/cache/harness".into());
    let images = Path::new(&cache).join("images");
    let tarball = std::fs::read_dir(&images)
        .map_err(|e| format!("{}: {e}", images.display()))?
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("rootfs-") && n.ends_with(".tar"))
        })
        .ok_or_else(|| {
            format!(
                "no HARNESS_MSB_ROOTFS and no rootfs tarball in {} (cargo xtask image)",
                images.display()
            )
        })?;
    let dir = scratch.join("rootfs");
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let status = std::process::Command::new("tar")
        .arg("-xf")
        .arg(&tarball)
        .arg("-C")
        .arg(&dir)
        .status()
        .map_err(|e| format!("tar: {e}"))?;
    if !status.success() {
        return Err(format!("extracting {} failed", tarball.display()));
    }
    Ok(dir)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn microsandbox_passes_the_sandbox_conformance_suite() {
    let Some(msb) = std::env::var_os("MSB_PATH").filter(|p| Path::new(p).is_file()) else {
        skip(
            "MSB_PATH does not name the microsandbox runtime `msb` (the PyPI wheel \
             microsandbox==0.7.11 carries it and libkrunfw; see docs/sandbox-microvm.md)",
        );
        return;
    };
    // Under /tmp: the runtime's socket paths under its home must stay short.
    let scratch = tempfile::Builder::new()
        .prefix("msb")
        .tempdir_in("/tmp")
        .expect("temp dir");
    let rootfs = match rootfs(scratch.path()) {
        Ok(r) => r,
        Err(e) => {
            skip(&format!("no root filesystem for microsandbox: {e}"));
            return;
        }
    };
    let mut config = MicrosandboxConfig::new(rootfs, scratch.path().join("state"));
    config.home = Some(scratch.path().join("home"));
    config.msb = Some(msb.into());
    let provider = MicrosandboxProvider::new(config).expect("provider");
    if let Err(why) = provider.boot_probe(Duration::from_secs(90)).await {
        skip(&format!(
            "microsandbox cannot boot a guest on this host: {why}"
        ));
        return;
    }
    let mut spec = SandboxSpec::new("/work");
    spec.session_id = Some("conformance".into());
    let options = SuiteOptions {
        // Whether and where the guest reaches the host's loopback is the
        // runtime's network engine's business; reachability is not checked.
        host_address: None,
        large_file_bytes: 32 * 1024 * 1024,
    };
    let started = std::time::Instant::now();
    if let Err(e) = suite::run_all_with(&provider, spec.clone(), &options).await {
        panic!("{e:#}");
    }
    println!("suite took {:?}", started.elapsed());
}
