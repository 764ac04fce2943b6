//! # harness-rootfs
//!
//! A minimal Debian root filesystem, made on this machine from the mirror
//! apt uses: `debootstrap --variant=minbase` of a suite plus a few
//! packages, packed as a tar. It is what Docker sandboxes start from when
//! a session names no image (`sandbox-docker` imports it as
//! `harness/debian:bookworm`), the test image (`cargo xtask image`) and the
//! microVM's root disk (`cargo xtask microvm`) — one recipe, kept here.
//!
//! No image registry is needed: only the Debian mirror apt already uses.
//! The tar is named by the recipe's key, so a cache keeps one per recipe
//! and a changed recipe makes a new one.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use sha2::{Digest, Sha256};

/// Packages on top of minbase (which has glibc, bash, coreutils, tar):
/// `ps` for agents' process checks, CA certificates for HTTPS, and a small
/// Python (many agent tools and the sandbox conformance suite's port
/// server use it).
pub const PACKAGES: &[&str] = &["procps", "ca-certificates", "python3-minimal"];

/// Used when apt's sources name no mirror for the suite.
const FALLBACK_MIRROR: &str = "http://deb.debian.org/debian";

/// What to build: a debootstrapped Debian.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rootfs {
    /// Debian suite.
    pub suite: String,
    /// debootstrap variant.
    pub variant: String,
    /// Extra packages.
    pub packages: Vec<String>,
    /// The Debian mirror.
    pub mirror: String,
}

impl Rootfs {
    /// The default recipe (bookworm, minbase, [`PACKAGES`]) from the
    /// mirror apt uses on this host ([`debian_mirror`]).
    pub fn for_host() -> Self {
        Self {
            suite: "bookworm".into(),
            variant: "minbase".into(),
            packages: PACKAGES.iter().map(|p| p.to_string()).collect(),
            mirror: debian_mirror("bookworm"),
        }
    }

    /// The recipe as text (what the key hashes).
    pub fn recipe(&self) -> String {
        format!(
            "debootstrap --variant={} --include={} {} {}; docker import v1",
            self.variant,
            self.packages.join(","),
            self.suite,
            self.mirror
        )
    }

    /// The recipe's key: 16 hex digits of its SHA-256.
    pub fn key(&self) -> String {
        hex::encode(&Sha256::digest(self.recipe().as_bytes())[..8])
    }

    /// The cached rootfs tar's file name.
    pub fn rootfs_name(&self) -> String {
        format!("rootfs-{}-{}-{}.tar", self.suite, self.variant, self.key())
    }

    /// The rootfs tar in `cache`: reused when there, else debootstrapped
    /// (root and `debootstrap` needed), `progress` told each stage.
    pub fn build(&self, cache: &Path, progress: &dyn Fn(&str)) -> std::io::Result<PathBuf> {
        let tarball = cache.join(self.rootfs_name());
        if tarball.is_file() {
            progress(&format!("reusing the rootfs {}", tarball.display()));
            return Ok(tarball);
        }
        std::fs::create_dir_all(cache)?;
        // One build per recipe at a time, across processes: the others
        // wait here, then find the tar made.
        let lock = std::fs::File::create(cache.join(format!(".rootfs-{}.lock", self.key())))?;
        lock.lock()?;
        if tarball.is_file() {
            progress(&format!("reusing the rootfs {}", tarball.display()));
            return Ok(tarball);
        }
        let dir = cache.join(format!("rootfs-{}.tmp", self.key()));
        if dir.exists() {
            std::fs::remove_dir_all(&dir)?;
        }
        progress(&format!(
            "debootstrap {} ({}, {}) from {} — about a minute",
            self.suite,
            self.variant,
            self.packages.join(" "),
            self.mirror
        ));
        let status = Command::new(debootstrap())
            .arg(format!("--variant={}", self.variant))
            .arg(format!("--include={}", self.packages.join(",")))
            .arg(&self.suite)
            .arg(&dir)
            .arg(&self.mirror)
            .stdout(Stdio::null())
            .status()
            .map_err(|e| {
                std::io::Error::new(
                    e.kind(),
                    format!(
                        "cannot run debootstrap ({e}): making the Debian rootfs needs Debian's \
                         `debootstrap` (apt-get install debootstrap) and root"
                    ),
                )
            })?;
        if !status.success() {
            return Err(std::io::Error::other(format!(
                "debootstrap {} into {} failed ({status}); is the mirror {} reachable? \
                 (set HARNESS_DEBIAN_MIRROR)",
                self.suite,
                dir.display(),
                self.mirror
            )));
        }
        // What an image never needs: apt's downloaded packages and lists.
        for sub in ["var/cache/apt/archives", "var/lib/apt/lists"] {
            for entry in std::fs::read_dir(dir.join(sub))
                .into_iter()
                .flatten()
                .flatten()
            {
                if entry.file_type().is_ok_and(|t| t.is_file()) {
                    let _ = std::fs::remove_file(entry.path());
                }
            }
        }
        progress("packing the rootfs");
        let partial = tarball.with_extension("tar.partial");
        let status = Command::new("tar")
            .arg("-C")
            .arg(&dir)
            .args(["--numeric-owner", "-cf"])
            .arg(&partial)
            .arg(".")
            .status()?;
        if !status.success() {
            return Err(std::io::Error::other(format!(
                "packing {} failed ({status})",
                dir.display()
            )));
        }
        std::fs::rename(&partial, &tarball)?;
        std::fs::remove_dir_all(&dir)?;
        Ok(tarball)
    }
}

/// `debootstrap`: on `PATH`, else in the sbin directories a non-login
/// root shell may leave out of it.
fn debootstrap() -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin"].map(PathBuf::from))
        .map(|dir| dir.join("debootstrap"))
        .find(|p| p.is_file())
        .unwrap_or_else(|| PathBuf::from("debootstrap"))
}

/// The Debian mirror apt uses for `suite`: `$HARNESS_DEBIAN_MIRROR`, else
/// the first matching source in `/etc/apt/sources.list` and
/// `/etc/apt/sources.list.d/` (one-line and deb822 formats), else
/// `deb.debian.org`.
pub fn debian_mirror(suite: &str) -> String {
    if let Some(m) = std::env::var("HARNESS_DEBIAN_MIRROR")
        .ok()
        .filter(|m| !m.is_empty())
    {
        return m;
    }
    let mut files = vec![PathBuf::from("/etc/apt/sources.list")];
    if let Ok(dir) = std::fs::read_dir("/etc/apt/sources.list.d") {
        let mut more: Vec<PathBuf> = dir
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|e| e == "sources" || e == "list"))
            .collect();
        more.sort();
        files.extend(more);
    }
    files
        .iter()
        .find_map(|f| {
            let text = std::fs::read_to_string(f).ok()?;
            if f.extension().is_some_and(|e| e == "sources") {
                mirror_from_deb822(&text, suite)
            } else {
                mirror_from_one_line(&text, suite)
            }
        })
        .unwrap_or_else(|| FALLBACK_MIRROR.to_string())
}

/// deb822: a stanza with `Types: deb` and `suite` among its `Suites:`.
fn mirror_from_deb822(text: &str, suite: &str) -> Option<String> {
    text.split("\n\n").find_map(|stanza| {
        let (mut types, mut uris, mut suites, mut enabled) = ("", "", "", true);
        for line in stanza.lines().map(str::trim) {
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
        let wanted = enabled
            && types.split_whitespace().any(|t| t == "deb")
            && suites.split_whitespace().any(|s| s == suite);
        wanted
            .then(|| uris.split_whitespace().next())
            .flatten()
            .map(|uri| uri.trim_end_matches('/').to_string())
    })
}

/// One-line format: `deb [opts] URI SUITE components...`.
fn mirror_from_one_line(text: &str, suite: &str) -> Option<String> {
    text.lines().find_map(|line| {
        let rest = line.trim().strip_prefix("deb ")?.trim_start();
        let rest = match rest.strip_prefix('[') {
            Some(opts) => opts.split_once(']')?.1.trim_start(),
            None => rest,
        };
        let mut parts = rest.split_whitespace();
        let (uri, found) = (parts.next()?, parts.next()?);
        (found == suite).then(|| uri.trim_end_matches('/').to_string())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deb822_picks_the_suite_stanza() {
        let text = "Types: deb\nURIs: http://a/debian-security\nSuites: bookworm-security\n\n\
                    Types: deb deb-src\nURIs: http://mirror/debian/\nSuites: bookworm bookworm-updates\n\
                    Components: main\n";
        assert_eq!(
            mirror_from_deb822(text, "bookworm").as_deref(),
            Some("http://mirror/debian")
        );
        let disabled = "Types: deb\nURIs: http://off/\nSuites: bookworm\nEnabled: no\n";
        assert_eq!(mirror_from_deb822(disabled, "bookworm"), None);
    }

    #[test]
    fn one_line_with_options() {
        let text = "# comment\ndeb [arch=amd64 signed-by=/k.gpg] http://m/debian/ bookworm main\n";
        assert_eq!(
            mirror_from_one_line(text, "bookworm").as_deref(),
            Some("http://m/debian")
        );
        assert_eq!(mirror_from_one_line(text, "trixie"), None);
    }

    #[test]
    fn the_key_follows_the_recipe() {
        let a = Rootfs {
            suite: "bookworm".into(),
            variant: "minbase".into(),
            packages: vec!["procps".into()],
            mirror: "http://m".into(),
        };
        let mut b = a.clone();
        assert_eq!(a.key(), b.key());
        b.packages.push("python3-minimal".into());
        assert_ne!(a.key(), b.key());
        assert!(a.rootfs_name().starts_with("rootfs-bookworm-minbase-"));
        assert_eq!(a.key().len(), 16);
    }
}
