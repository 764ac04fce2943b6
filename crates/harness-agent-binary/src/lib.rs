//! # harness-agent-binary
//!
//! The agent's native executable on the host, identified by its content hash.
//! Shared by the agent adapters (`harness-claude-code`, `harness-codex`) and
//! the approval tool, so each adapter stays publishable on its own without
//! carrying a copy.
//!
//! The bootstrap recipe names the binary by SHA-256 (so a sandbox snapshot is
//! keyed on the exact build), and hashing a 300–400 MB file takes seconds, so
//! the digest is computed once and cached next to the file as
//! `<path>.sha256` (`sha256sum` format, then the file's size, mtime and
//! inode). The cache is trusted only for that very file; a replaced binary
//! is hashed again.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

use harness_core::bootstrap::{FileSource, RecipeFile};
use harness_core::sandbox::shell_quote;
use harness_core::{Error, Result};
use sha2::{Digest, Sha256};

/// Find an agent's native binary on this host: the path in `env_var` if
/// set, else `$HARNESS_CACHE/agents/<cache_relative>` (default cache
/// `/var/cache/harness`, where `cargo xtask agents` installs them).
/// `NotFound`, naming both places, when neither exists.
pub fn locate(env_var: &str, cache_relative: &str, what: &str) -> Result<PathBuf> {
    if let Some(p) = std::env::var_os(env_var).filter(|p| !p.is_empty()) {
        return Ok(p.into());
    }
    let cache = std::env::var("HARNESS_CACHE").unwrap_or_else(|_| "/var/cache/harness".into());
    let p = PathBuf::from(cache).join("agents").join(cache_relative);
    if p.is_file() {
        Ok(p)
    } else {
        Err(Error::not_found(format!(
            "no {what} binary: set {env_var} or run `cargo xtask agents` (looked at {})",
            p.display()
        )))
    }
}

/// A native agent executable on the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentBinary {
    /// Absolute path on the host.
    pub host_path: PathBuf,
    /// Hex SHA-256 of the file's content.
    pub sha256: String,
    /// The version the binary reports (`--version`), e.g. `2.1.332`.
    pub version: String,
}

impl AgentBinary {
    /// Describe the binary at `path`: hash it (or read the cached digest) and
    /// ask it for its version. Fails with `NotFound` if the file is missing
    /// and `Backend` if it does not run on this host.
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        let host_path = std::fs::canonicalize(path.as_ref()).map_err(|e| {
            Error::not_found(format!("agent binary {}: {e}", path.as_ref().display()))
        })?;
        let sha256 = sha256_cached(&host_path)?;
        let version = probe_version(&host_path)?;
        Ok(Self {
            host_path,
            sha256,
            version,
        })
    }

    /// Like [`AgentBinary::load`] with a known version (no `--version` run;
    /// useful when the host cannot execute the binary, e.g. another libc).
    pub fn with_version(path: impl AsRef<Path>, version: impl Into<String>) -> Result<Self> {
        let host_path = std::fs::canonicalize(path.as_ref()).map_err(|e| {
            Error::not_found(format!("agent binary {}: {e}", path.as_ref().display()))
        })?;
        let sha256 = sha256_cached(&host_path)?;
        Ok(Self {
            host_path,
            sha256,
            version: version.into(),
        })
    }
}

/// A small harness program copied into every sandbox next to the agent
/// (the approval server `harness-approval-mcp`, the host-tool bridge
/// `harness-relay-mcp`), named by its hash in the bootstrap recipe.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HelperBinary {
    /// Path on the host.
    pub host_path: PathBuf,
    /// Its SHA-256 (part of the bootstrap identity).
    pub sha256: String,
}

impl HelperBinary {
    /// Hash the binary at `path` (cached like the agent binary's digest).
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        let host_path = path.as_ref().to_path_buf();
        if !host_path.is_file() {
            return Err(Error::not_found(format!(
                "no helper binary at {}",
                host_path.display()
            )));
        }
        let sha256 = sha256_cached(&host_path)?;
        Ok(Self { host_path, sha256 })
    }

    /// A helper already installed at `path` in the sandbox's image, for an
    /// agent that is preinstalled there too (a Cloudflare bridge image):
    /// the recipe of such an agent installs nothing, so there is nothing to
    /// copy or hash.
    pub fn preinstalled(path: impl Into<PathBuf>) -> Self {
        Self {
            host_path: path.into(),
            sha256: String::new(),
        }
    }
}

/// The recipe's part for `helpers` (a path in the sandbox and the helper
/// installed there): a file per distinct binary, and a command hard-linking
/// each further path to the file of the same content. The helpers are
/// often one binary (the multi-call `harness`, which runs as whichever
/// helper its name says): copied once, not once per name.
pub fn helper_files(helpers: &[(&str, &HelperBinary)]) -> (Vec<RecipeFile>, Vec<String>) {
    let mut files: Vec<RecipeFile> = Vec::new();
    let mut links = Vec::new();
    for (path, helper) in helpers {
        let copied = (!helper.sha256.is_empty())
            .then(|| {
                files.iter().find(|f| {
                    matches!(&f.source, FileSource::HostPath { sha256, .. } if *sha256 == helper.sha256)
                })
            })
            .flatten();
        match copied {
            Some(first) => links.push(format!(
                "mkdir -p \"${{HARNESS_SANDBOX_ROOT:-}}\"{dir} && ln -f \"${{HARNESS_SANDBOX_ROOT:-}}\"{from} \"${{HARNESS_SANDBOX_ROOT:-}}\"{to}",
                dir = shell_quote(Path::new(path).parent().and_then(Path::to_str).unwrap_or("/")),
                from = shell_quote(&first.path),
                to = shell_quote(path),
            )),
            None => files.push(RecipeFile {
                path: path.to_string(),
                mode: 0o755,
                source: FileSource::HostPath {
                    path: helper.host_path.display().to_string(),
                    sha256: helper.sha256.clone(),
                },
            }),
        }
    }
    (files, links)
}

/// What identifies one version of a file without reading it: size,
/// modification time (ns) and, on Unix, device and inode. Cargo replaces a
/// binary by hard-linking another build in its place, whose mtime can be
/// *older* than a cache written since (seen: a test's `cargo build -p`
/// swapped `harness-relay-mcp` for a build with other features, and the
/// mtime check kept the old digest); the inode changes then.
fn stat_key(meta: &std::fs::Metadata) -> String {
    let mtime = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos());
    #[cfg(unix)]
    let node = {
        use std::os::unix::fs::MetadataExt;
        format!(" dev={} ino={}", meta.dev(), meta.ino())
    };
    #[cfg(not(unix))]
    let node = String::new();
    format!("size={} mtime_ns={mtime}{node}", meta.len())
}

/// The SHA-256 of `path`, from `<path>.sha256` when that was written for
/// this very version of the file (same size, mtime and inode), else
/// computed and (best effort) written there: `sha256sum` format on the
/// first line, the file's [`stat_key`] on the second.
pub fn sha256_cached(path: &Path) -> Result<String> {
    let cache = PathBuf::from(format!("{}.sha256", path.display()));
    let meta = std::fs::metadata(path)?;
    let key = stat_key(&meta);
    if let Ok(text) = std::fs::read_to_string(&cache) {
        let mut lines = text.lines();
        let digest = lines
            .next()
            .and_then(|l| l.split_whitespace().next())
            .unwrap_or("");
        let fresh = lines.next().map(str::trim) == Some(key.as_str());
        if fresh && digest.len() == 64 && digest.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Ok(digest.to_ascii_lowercase());
        }
    }
    let mut file = std::fs::File::open(path)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    let digest = hex::encode(hasher.finalize());
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    // A read-only cache directory only costs a re-hash next time.
    let _ = std::fs::write(&cache, format!("{digest}  {name}\n{key}\n"));
    Ok(digest)
}

/// Run `<bin> --version` and pick the first dotted version number.
fn probe_version(bin: &Path) -> Result<String> {
    let out = Command::new(bin)
        .arg("--version")
        .env("HOME", std::env::temp_dir())
        .output()
        .map_err(|e| Error::backend(format!("running {} --version: {e}", bin.display())))?;
    let text = String::from_utf8_lossy(&out.stdout);
    parse_version(&text).ok_or_else(|| {
        Error::backend(format!(
            "{} --version printed no version: {:?} (stderr {:?})",
            bin.display(),
            text.trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    })
}

/// The first whitespace-separated token that looks like `N.N[.N…]`, with a
/// leading `v` or `name-` prefix stripped (`codex-cli 0.171.0`,
/// `2.1.332 (Claude Code)`).
pub fn parse_version(text: &str) -> Option<String> {
    text.split_whitespace().find_map(|tok| {
        let tok = tok.trim_start_matches('v');
        let ok = tok.contains('.')
            && tok.chars().next().is_some_and(|c| c.is_ascii_digit())
            && tok
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '.' || c == '-');
        ok.then(|| tok.to_string())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_binary_under_two_helper_names_is_copied_once_and_linked() {
        let harness = HelperBinary {
            host_path: "/opt/harness".into(),
            sha256: "ab".repeat(32),
        };
        let other = HelperBinary {
            host_path: "/opt/relay".into(),
            sha256: "cd".repeat(32),
        };
        let (files, links) = helper_files(&[("/h/approval", &harness), ("/h/b/relay", &harness)]);
        assert_eq!(files.len(), 1);
        assert_eq!(files[0].path, "/h/approval");
        assert_eq!(
            links,
            vec![
                "mkdir -p \"${HARNESS_SANDBOX_ROOT:-}\"/h/b && ln -f \"${HARNESS_SANDBOX_ROOT:-}\"/h/approval \"${HARNESS_SANDBOX_ROOT:-}\"/h/b/relay"
            ]
        );
        let (files, links) = helper_files(&[("/h/approval", &harness), ("/h/relay", &other)]);
        assert_eq!((files.len(), links.len()), (2, 0));
    }

    #[test]
    fn versions_from_both_clis() {
        assert_eq!(
            parse_version("2.1.332 (Claude Code)\n").as_deref(),
            Some("2.1.332")
        );
        assert_eq!(
            parse_version("codex-cli 0.171.0\n").as_deref(),
            Some("0.171.0")
        );
        assert_eq!(parse_version("no version here"), None);
    }

    #[test]
    fn digest_is_cached_and_recomputed_when_stale() {
        let dir = std::env::temp_dir().join(format!("agent-bin-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let bin = dir.join("tool");
        std::fs::write(&bin, b"abc").unwrap();
        let d = sha256_cached(&bin).unwrap();
        assert_eq!(
            d,
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        let cache = dir.join("tool.sha256");
        assert!(std::fs::read_to_string(&cache).unwrap().starts_with(&d));
        // A cache entry for this very file is believed (proves it is read).
        let key = stat_key(&std::fs::metadata(&bin).unwrap());
        std::fs::write(&cache, format!("{}  tool\n{key}\n", "0".repeat(64))).unwrap();
        assert_eq!(sha256_cached(&bin).unwrap(), "0".repeat(64));
        // One without the file's stat key (an old cache) is not.
        std::fs::write(&cache, format!("{}  tool\n", "0".repeat(64))).unwrap();
        assert_eq!(sha256_cached(&bin).unwrap(), d);
        // Another build hard-linked into place with an *older* mtime, as
        // cargo does: the inode differs, so the digest is recomputed.
        let other = dir.join("tool-other-build");
        std::fs::write(&other, b"abcd").unwrap();
        let old = std::fs::metadata(&bin).unwrap().modified().unwrap()
            - std::time::Duration::from_secs(3600);
        std::fs::File::options()
            .write(true)
            .open(&other)
            .unwrap()
            .set_modified(old)
            .unwrap();
        std::fs::remove_file(&bin).unwrap();
        std::fs::hard_link(&other, &bin).unwrap();
        let d2 = sha256_cached(&bin).unwrap();
        assert_eq!(
            d2,
            "88d4266fd4e6338d13b845fcf289579d209c897823b9217da3e161936f031589"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
