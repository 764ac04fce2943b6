//! `cargo xtask image`: the Docker test image, built offline.
//!
//! No image registry is reachable, so the image is a debootstrapped Debian
//! rootfs from the same mirror apt uses, imported with `docker import`. The
//! rootfs tarball is cached in `$HARNESS_CACHE/images/` keyed by a hash of
//! the recipe, and the image carries that hash as a label: a changed recipe
//! rebuilds, an unchanged one is a no-op.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{bail, Context, Result};

use crate::util::{self, run};

pub const IMAGE: &str = "harness-test:bookworm";
const SUITE: &str = "bookworm";
const VARIANT: &str = "minbase";
/// Extra packages on top of minbase (which already has glibc, bash,
/// coreutils, tar).
// python3-minimal: the sandbox conformance suite serves a port from inside
// the sandbox with it (the minbase image has no other server program).
const INCLUDE: &str = "procps,ca-certificates,python3-minimal";
const LABEL: &str = "harness.recipe";
/// Used only if no mirror can be read from apt's sources.
const FALLBACK_MIRROR: &str = "http://deb.debian.org/debian";

/// The Debian mirror apt uses for `SUITE` (override: `HARNESS_DEBIAN_MIRROR`).
pub fn debian_mirror() -> String {
    if let Ok(m) = std::env::var("HARNESS_DEBIAN_MIRROR") {
        if !m.is_empty() {
            return m;
        }
    }
    let mut files = vec![PathBuf::from("/etc/apt/sources.list")];
    if let Ok(rd) = std::fs::read_dir("/etc/apt/sources.list.d") {
        let mut more: Vec<PathBuf> = rd
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|e| e == "sources" || e == "list"))
            .collect();
        more.sort();
        files.extend(more);
    }
    for f in files {
        let Ok(text) = std::fs::read_to_string(&f) else {
            continue;
        };
        let found = if f.extension().is_some_and(|e| e == "sources") {
            mirror_from_deb822(&text)
        } else {
            mirror_from_one_line(&text)
        };
        if let Some(m) = found {
            return m;
        }
    }
    FALLBACK_MIRROR.to_string()
}

/// deb822: a stanza with `Types: deb` and `SUITE` among its `Suites:`.
fn mirror_from_deb822(text: &str) -> Option<String> {
    for stanza in text.split("\n\n") {
        let mut types = "";
        let mut uris = "";
        let mut suites = "";
        let mut enabled = true;
        for line in stanza.lines() {
            let line = line.trim();
            if line.starts_with('#') {
                continue;
            }
            let Some((k, v)) = line.split_once(':') else {
                continue;
            };
            match k.trim().to_ascii_lowercase().as_str() {
                "types" => types = v.trim(),
                "uris" => uris = v.trim(),
                "suites" => suites = v.trim(),
                "enabled" => enabled = !v.trim().eq_ignore_ascii_case("no"),
                _ => {}
            }
        }
        if enabled
            && types.split_whitespace().any(|t| t == "deb")
            && suites.split_whitespace().any(|s| s == SUITE)
        {
            if let Some(uri) = uris.split_whitespace().next() {
                return Some(uri.trim_end_matches('/').to_string());
            }
        }
    }
    None
}

/// One-line format: `deb [opts] URI SUITE components...`.
fn mirror_from_one_line(text: &str) -> Option<String> {
    for line in text.lines() {
        let line = line.trim();
        let Some(rest) = line.strip_prefix("deb ") else {
            continue;
        };
        let mut rest = rest.trim_start();
        if rest.starts_with('[') {
            rest = rest
                .split_once(']')
                .map(|(_, r)| r.trim_start())
                .unwrap_or("");
        }
        let mut parts = rest.split_whitespace();
        if let (Some(uri), Some(suite)) = (parts.next(), parts.next()) {
            if suite == SUITE {
                return Some(uri.trim_end_matches('/').to_string());
            }
        }
    }
    None
}

fn recipe(mirror: &str) -> String {
    format!(
        "debootstrap --variant={VARIANT} --include={INCLUDE} {SUITE} {mirror}; docker import v1"
    )
}

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
    let mirror = debian_mirror();
    let key = util::stable_hash(&recipe(&mirror));
    let images = util::cache_subdir("images")?;
    let tarball = images.join(format!("rootfs-{SUITE}-{VARIANT}-{key}.tar"));
    if tarball.exists() && !force {
        println!("image: reusing cached rootfs {}", tarball.display());
    } else {
        let rootfs = images.join(format!("rootfs-{key}.tmp"));
        if rootfs.exists() {
            std::fs::remove_dir_all(&rootfs)
                .with_context(|| format!("removing stale {}", rootfs.display()))?;
        }
        if util::which("debootstrap").is_none() {
            bail!("debootstrap not found: run `cargo xtask deps`");
        }
        let t = Instant::now();
        run(Command::new("debootstrap")
            .arg(format!("--variant={VARIANT}"))
            .arg(format!("--include={INCLUDE}"))
            .arg(SUITE)
            .arg(&rootfs)
            .arg(&mirror)
            .stdout(Stdio::null()))
        .context("debootstrap failed (is the mirror reachable? set HARNESS_DEBIAN_MIRROR)")?;
        println!(
            "image: debootstrap took {}",
            util::fmt_duration(t.elapsed())
        );
        // Trim what a test image never needs.
        for sub in ["var/cache/apt/archives", "var/lib/apt/lists"] {
            let d = rootfs.join(sub);
            if let Ok(rd) = std::fs::read_dir(&d) {
                for e in rd.flatten() {
                    if e.file_type().is_ok_and(|t| t.is_file()) {
                        let _ = std::fs::remove_file(e.path());
                    }
                }
            }
        }
        let tmp_tar = images.join(format!("rootfs-{key}.tar.tmp"));
        run(Command::new("tar")
            .arg("-C")
            .arg(&rootfs)
            .args(["--numeric-owner", "-cf"])
            .arg(&tmp_tar)
            .arg("."))?;
        std::fs::rename(&tmp_tar, &tarball)?;
        std::fs::remove_dir_all(&rootfs)?;
    }
    Ok(tarball)
}

pub fn build(force: bool) -> Result<()> {
    let start = Instant::now();
    let mirror = debian_mirror();
    let recipe = recipe(&mirror);
    let key = util::stable_hash(&recipe);
    println!("image: {IMAGE}, recipe `{recipe}` (key {key})");
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deb822_picks_the_suite_stanza() {
        let text = "Types: deb\nURIs: http://example.invalid/debian-security\nSuites: bookworm-security\n\n\
                    Types: deb\n# comment\nURIs: http://example.invalid/debian/\nSuites: bookworm bookworm-updates\nComponents: main\n";
        assert_eq!(
            mirror_from_deb822(text).as_deref(),
            Some("http://example.invalid/debian")
        );
    }

    #[test]
    fn one_line_with_options() {
        let text =
            "# x\ndeb [arch=amd64 signed-by=/k.gpg] http://example.invalid/debian bookworm main\n";
        assert_eq!(
            mirror_from_one_line(text).as_deref(),
            Some("http://example.invalid/debian")
        );
    }
}
