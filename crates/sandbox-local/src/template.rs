//! Bootstrap templates: a recipe runs once per identity into
//! `<root>/templates/<identity>`, and sessions start from a copy of it.
//!
//! All of this is blocking file-system work; callers run it on
//! `spawn_blocking`.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use harness_core::bootstrap::{BootstrapRecipe, FileSource, SnapshotStore};
use harness_core::sandbox::SnapshotInfo;
use harness_core::tarscan::check_entry_path;
use harness_core::{Error, Result};
use sha2::{Digest, Sha256};

/// The base name every local identity is computed against.
pub(crate) const BASE: &str = "local";

/// Directory holding the templates under a provider root.
pub(crate) fn templates_dir(root: &Path) -> PathBuf {
    root.join("templates")
}

/// Make sure the template for `recipe` exists and return its path. The
/// recipe runs at most once per identity, across threads and processes, by
/// core's `ensure_snapshot` rule over [`Templates`]: the first caller holds
/// an exclusive `flock` on `<identity>.lock` while it builds into a
/// temporary directory and renames it into place; the others wait on the
/// lock and then find the finished template. Blocking (the store's steps
/// are plain file-system calls, driven to completion on this thread).
pub(crate) fn ensure(
    root: &Path,
    recipe: &BootstrapRecipe,
    env: &BTreeMap<String, String>,
) -> Result<(String, PathBuf)> {
    let identity = recipe.identity(BASE);
    let templates = templates_dir(root);
    let target = templates.join(&identity);
    if target.is_dir() {
        return Ok((identity, target));
    }
    std::fs::create_dir_all(&templates)?;
    let store = Templates { root, env };
    let (identity, _lock) = futures::executor::block_on(harness_core::bootstrap::ensure_snapshot(
        &store, BASE, recipe,
    ))?;
    Ok((identity, target))
}

/// Templates as core's snapshot store: `<root>/templates/<identity>`.
struct Templates<'a> {
    root: &'a Path,
    env: &'a BTreeMap<String, String>,
}

#[async_trait::async_trait]
impl SnapshotStore for Templates<'_> {
    type Lock = File;

    async fn lock(&self, identity: &str) -> Result<File> {
        let lock = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(templates_dir(self.root).join(format!("{identity}.lock")))?;
        // `File::lock` is flock(LOCK_EX): per open file description, so it
        // also serialises threads of this process that opened the file
        // separately.
        lock.lock()?;
        Ok(lock)
    }

    async fn exists(&self, identity: &str) -> Result<bool> {
        Ok(templates_dir(self.root).join(identity).is_dir())
    }

    async fn build(&self, identity: &str, recipe: &BootstrapRecipe) -> Result<()> {
        let templates = templates_dir(self.root);
        let tmp = templates.join(format!(".tmp-{identity}-{}", uuid::Uuid::new_v4().simple()));
        match build(&tmp, recipe, self.env) {
            Ok(()) => {
                std::fs::rename(&tmp, templates.join(identity))?;
                Ok(())
            }
            Err(e) => {
                let _ = std::fs::remove_dir_all(&tmp);
                Err(e)
            }
        }
    }
}

/// Run `recipe` with `dir` as the sandbox root. Not core's `run_recipe`
/// (which the QEMU and Cloudflare providers use, and whose host-file check
/// and command loop Docker's archive-upload variant shares): a local
/// template is a directory built before any sandbox exists, so its files are
/// plain copies (a host file's SHA-256 checked first, nothing staged through
/// an exec) and its commands run from the template's root on this thread.
fn build(dir: &Path, recipe: &BootstrapRecipe, env: &BTreeMap<String, String>) -> Result<()> {
    let work = dir.join("work");
    let home = dir.join("home");
    std::fs::create_dir_all(&work)?;
    std::fs::create_dir_all(&home)?;
    for file in &recipe.files {
        let rel = check_entry_path(file.path.trim_start_matches('/')).map_err(|_| {
            Error::invalid(format!(
                "recipe file path {:?} must not contain '..'",
                file.path
            ))
        })?;
        if rel.is_empty() {
            return Err(Error::invalid("recipe file path is empty"));
        }
        let dest = dir.join(&rel);
        if let Some(parent) = dest.parent() {
            std::fs::create_dir_all(parent)?;
        }
        match &file.source {
            FileSource::Inline { text } => std::fs::write(&dest, text)?,
            FileSource::HostPath { path, sha256 } => {
                let actual = sha256_file(Path::new(path)).map_err(|e| {
                    Error::new(
                        e.kind(),
                        format!("recipe host file {path}: {}", e.message()),
                    )
                })?;
                if !actual.eq_ignore_ascii_case(sha256) {
                    return Err(Error::corrupt(format!(
                        "recipe host file {path} has SHA-256 {actual}, the recipe declares {sha256}"
                    )));
                }
                // A copy, not a hardlink: the sandbox may chmod or rewrite it
                // without touching the host's file.
                std::fs::copy(path, &dest)?;
            }
        }
        std::fs::set_permissions(&dest, std::fs::Permissions::from_mode(file.mode & 0o7777))?;
    }
    for cmd in recipe
        .bootstrap_pre_commands
        .iter()
        .chain(recipe.commands.iter())
    {
        let out = Command::new("sh")
            .arg("-c")
            .arg(cmd)
            .current_dir(&work)
            .env("HOME", &home)
            .env("HARNESS_SANDBOX_ROOT", dir)
            .envs(env)
            .stdin(Stdio::null())
            .process_group(0)
            .output()
            .map_err(|e| Error::backend(format!("running bootstrap command {cmd:?}: {e}")))?;
        if !out.status.success() {
            let stderr = String::from_utf8_lossy(&out.stderr);
            let tail: String = stderr
                .chars()
                .rev()
                .take(2000)
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect();
            return Err(Error::backend(format!(
                "bootstrap command {cmd:?} failed ({}): {}",
                out.status,
                tail.trim()
            )));
        }
    }
    Ok(())
}

fn sha256_file(path: &Path) -> Result<String> {
    let mut file = File::open(path)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1024 * 1024];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex::encode(hasher.finalize()))
}

/// Copy a tree, keeping modes and symlinks (a session's copy of a template).
pub(crate) fn copy_tree(from: &Path, to: &Path) -> Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let src = entry.path();
        let dst = to.join(entry.file_name());
        let ft = entry.file_type()?;
        if ft.is_dir() {
            copy_tree(&src, &dst)?;
            let mode = std::fs::metadata(&src)?.permissions();
            std::fs::set_permissions(&dst, mode)?;
        } else if ft.is_symlink() {
            std::os::unix::fs::symlink(std::fs::read_link(&src)?, &dst)?;
        } else if ft.is_file() {
            // `fs::copy` copies the permission bits too.
            std::fs::copy(&src, &dst)?;
        }
    }
    Ok(())
}

fn tree_size(path: &Path) -> u64 {
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return 0;
    };
    if !meta.is_dir() {
        return meta.len();
    }
    std::fs::read_dir(path)
        .map(|rd| rd.flatten().map(|e| tree_size(&e.path())).sum())
        .unwrap_or(0)
}

/// Where ready copies of template `identity` wait:
/// `templates/pool/<identity>/<name>`, each renamed into place once whole
/// (a copy in progress is `.tmp-<pid>-<uuid>`). Not a template itself
/// (`list` takes `bs-*` only).
fn pool_dir(root: &Path, identity: &str) -> PathBuf {
    templates_dir(root).join("pool").join(identity)
}

/// The ready copies in `dir` (not those still being copied).
fn ready_copies(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .filter(|e| !e.file_name().to_string_lossy().starts_with(".tmp"))
                .map(|e| e.path())
                .collect()
        })
        .unwrap_or_default()
}

/// How many ready copies of `identity` wait.
pub(crate) fn pool_ready(root: &Path, identity: &str) -> usize {
    ready_copies(&pool_dir(root, identity)).len()
}

/// Move a ready copy of `identity`'s template to `target`; false when none
/// is ready. A copy two creates race for goes to one of them (`rename`
/// is atomic; the other finds it gone and tries the next).
pub(crate) fn take_pooled(root: &Path, identity: &str, target: &Path) -> bool {
    ready_copies(&pool_dir(root, identity))
        .into_iter()
        .any(|copy| std::fs::rename(&copy, target).is_ok())
}

/// Top `identity`'s pool up to `size` ready copies of `template`. One
/// filler per identity at a time (a lock file beside the pool; another
/// holder means the filling is in hand). Copies a killed filler left
/// half-made are removed first.
pub(crate) fn fill_pool(root: &Path, identity: &str, size: usize) -> Result<()> {
    let template = templates_dir(root).join(identity);
    let dir = pool_dir(root, identity);
    std::fs::create_dir_all(&dir)?;
    let lock = File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(dir.with_extension("lock"))?;
    match lock.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => return Ok(()),
        Err(std::fs::TryLockError::Error(e)) => return Err(e.into()),
    }
    // Under the lock no other filler runs: every `.tmp` left is a dead one's.
    for entry in std::fs::read_dir(&dir)?.flatten() {
        if entry.file_name().to_string_lossy().starts_with(".tmp") {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
    while ready_copies(&dir).len() < size {
        if !template.is_dir() {
            // Pruned meanwhile: nothing to copy.
            return Ok(());
        }
        let name = uuid::Uuid::new_v4().simple().to_string();
        let tmp = dir.join(format!(".tmp-{}-{name}", std::process::id()));
        if let Err(e) = copy_tree(&template, &tmp) {
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(e);
        }
        std::fs::rename(&tmp, dir.join(name))?;
    }
    Ok(())
}

/// Every finished template under `root`.
pub(crate) fn list(root: &Path) -> Result<Vec<SnapshotInfo>> {
    let dir = templates_dir(root);
    let entries = match std::fs::read_dir(&dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e.into()),
    };
    let mut out = Vec::new();
    for entry in entries {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with("bs-") && entry.file_type()?.is_dir() {
            out.push(SnapshotInfo {
                identity: name,
                reference: entry.path().display().to_string(),
                size_bytes: Some(tree_size(&entry.path())),
            });
        }
    }
    out.sort_by(|a, b| a.identity.cmp(&b.identity));
    Ok(out)
}

/// Remove templates whose identity is not in `keep`.
pub(crate) fn prune(root: &Path, keep: &[String]) -> Result<Vec<SnapshotInfo>> {
    let mut removed = Vec::new();
    for info in list(root)? {
        if keep.contains(&info.identity) {
            continue;
        }
        let templates = templates_dir(root);
        let lock_path = templates.join(format!("{}.lock", info.identity));
        let lock = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)?;
        // Under the lock, so a concurrent first session is not half-copied.
        lock.lock()?;
        // The lock file stays: deleting it could let two builders hold
        // locks on different inodes.
        // Its ready copies go with it, once a filler at work has finished
        // its copy (its lock; it then finds the template gone and stops).
        let pool = pool_dir(root, &info.identity);
        let _pool_lock = match std::fs::create_dir_all(templates.join("pool")) {
            Ok(()) => {
                let lock = File::options()
                    .create(true)
                    .truncate(false)
                    .write(true)
                    .open(pool.with_extension("lock"))?;
                lock.lock()?;
                Some(lock)
            }
            Err(_) => None,
        };
        std::fs::remove_dir_all(&info.reference)?;
        if pool.exists() {
            std::fs::remove_dir_all(&pool)?;
        }
        removed.push(info);
    }
    Ok(removed)
}
