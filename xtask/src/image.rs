//! `cargo xtask image`: the Docker test image, built offline.
//!
//! No image registry is reachable, so the image is a debootstrapped Debian
//! rootfs from the same mirror apt uses (`harness-rootfs`: the one recipe
//! the CLI's default Docker image and the microVM disk use too), imported
//! with `docker import`. The rootfs tarball is cached in
//! `$HARNESS_CACHE/images/` keyed by a hash of the recipe, and the image
//! carries that hash as a label: a changed recipe rebuilds, an unchanged
//! one is a no-op.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{Context, Result};
use harness_rootfs::Rootfs;

use crate::util::{self, run};

pub const IMAGE: &str = "harness-test:bookworm";
/// The label the CLI's own base image carries too (`sandbox-docker`'s
/// `base_image::RECIPE_LABEL`).
const LABEL: &str = "harness.recipe";

fn image_label() -> Option<String> {
    let out = Command::new("docker")
        .args(["image", "inspect", "--format"])
        .arg(format!("{{{{ index .Config.Labels \"{LABEL}\" }}}}"))
        .arg(IMAGE)
        .stderr(Stdio::null())
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// The debootstrapped rootfs tarball (cached in `$HARNESS_CACHE/images/`,
/// keyed by the recipe), built if missing or `force`. The Docker test image
/// is imported from it; the microVM root disk (`cargo xtask microvm`) is
/// made from it too.
pub fn rootfs_tarball(force: bool) -> Result<PathBuf> {
    let rootfs = Rootfs::for_host();
    let images = util::cache_subdir("images")?;
    if force {
        let _ = std::fs::remove_file(images.join(rootfs.rootfs_name()));
    }
    let t = Instant::now();
    let tarball = rootfs
        .build(&images, &|line| println!("image: {line}"))
        .context("making the Debian rootfs (run `cargo xtask deps` for debootstrap)")?;
    println!("image: rootfs ready in {}", util::fmt_duration(t.elapsed()));
    Ok(tarball)
}

pub fn build(force: bool) -> Result<()> {
    let start = Instant::now();
    let rootfs = Rootfs::for_host();
    let key = rootfs.key();
    println!("image: {IMAGE}, recipe `{}` (key {key})", rootfs.recipe());
    if !force {
        match image_label() {
            Some(l) if l == key => {
                println!("image: {IMAGE} exists and matches the recipe; nothing to do");
                return Ok(());
            }
            Some(l) => println!("image: {IMAGE} exists with recipe key `{l}`; rebuilding"),
            None => {}
        }
    }
    let tarball = rootfs_tarball(force)?;
    run(Command::new("docker")
        .args(["import", "--change"])
        .arg(format!("LABEL {LABEL}={key}"))
        .args(["--change", "CMD [\"/bin/bash\"]"])
        .arg(&tarball)
        .arg(IMAGE)
        .stdout(Stdio::null()))
    .context("docker import (is dockerd running? `cargo xtask services start`)")?;
    run(Command::new("docker").args(["run", "--rm", "--network", "none", IMAGE, "true"]))
        .context("the new image does not run `true`")?;
    println!(
        "image: {IMAGE} ready in {}",
        util::fmt_duration(start.elapsed())
    );
    Ok(())
}
