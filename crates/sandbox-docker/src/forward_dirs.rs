//! The forward directories of pooled containers, and how a session's
//! sockets move into one when the session takes the container.
//!
//! A spec's forwards are Unix sockets on the host, each in a directory of
//! its own (the broker's `sessions/<id>/`), and a container mounts those
//! directories when it is created — before any session, for a pooled one.
//! So a pooled container mounts directories of its own instead,
//! `<pool_forward_dir>/<pool name>/<n>` ([`crate::DockerConfig::
//! pool_forward_dir`]). When a session takes it ([`link`]), each of the
//! session's socket directories `D` hands its sockets to the container's
//! directory `P` (a rename: the socket stays the one its server listens
//! on) and becomes a symbolic link to `P`, swapped in whole
//! (`renameat2(RENAME_EXCHANGE)`: there is no moment at which `D` is
//! missing). Whoever serves the sockets keeps binding them through `D`'s
//! path, which now leads into `P`: a broker that restarts and binds again
//! is seen inside the container at once. When the sandbox is destroyed
//! ([`unlink`]) the swap is undone — `D` is a directory holding its sockets
//! again — and `P` goes. Why not a hard link of the socket (simpler): a
//! server that binds again makes a new inode, and the link would keep the
//! dead one.
//!
//! `D` and `P` must be on one filesystem (a rename moves the sockets);
//! where they are not, the link fails and the session gets a fresh
//! container instead.

use std::io;
use std::path::{Path, PathBuf};

use rustix::fs::{renameat_with, RenameFlags, CWD};

/// The file in a pooled container's directory naming its container id
/// (what [`sweep`] checks).
const CONTAINER_FILE: &str = "container";

/// The directory of pooled container `name` under `root`.
pub(crate) fn of(root: &Path, name: &str) -> PathBuf {
    root.join(name)
}

/// Make `count` empty forward directories for pooled container `name`:
/// `<root>/<name>/<n>`, mode 0755 (an agent that is not root reaches the
/// sockets in them).
pub(crate) fn make(root: &Path, name: &str, count: usize) -> io::Result<Vec<PathBuf>> {
    use std::os::unix::fs::PermissionsExt;
    let dir = of(root, name);
    std::fs::create_dir_all(&dir)?;
    (0..count)
        .map(|n| {
            let p = dir.join(n.to_string());
            std::fs::create_dir(&p)?;
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755))?;
            Ok(p)
        })
        .collect()
}

/// Record the container the directories of `name` belong to.
pub(crate) fn record_container(root: &Path, name: &str, id: &str) -> io::Result<()> {
    std::fs::write(of(root, name).join(CONTAINER_FILE), id)
}

/// Remove the directories of pooled container `name` (gone already: fine).
pub(crate) fn remove(root: &Path, name: &str) {
    match std::fs::remove_dir_all(of(root, name)) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => {
            tracing::warn!("removing the forward directories of {name}: {e}")
        }
        _ => {}
    }
}

/// Move every entry of `from` into `to` (renames); what was moved, so a
/// failure can move it back.
fn move_entries(from: &Path, to: &Path) -> io::Result<Vec<std::ffi::OsString>> {
    let mut moved = Vec::new();
    for entry in std::fs::read_dir(from)? {
        let name = entry?.file_name();
        if let Err(e) = std::fs::rename(from.join(&name), to.join(&name)) {
            for back in &moved {
                let _ = std::fs::rename(to.join(back), from.join(back));
            }
            return Err(e);
        }
        moved.push(name);
    }
    Ok(moved)
}

fn exchange(a: &Path, b: &Path) -> io::Result<()> {
    renameat_with(CWD, a, CWD, b, RenameFlags::EXCHANGE).map_err(io::Error::from)
}

/// A scratch path next to `pool_dir` (same directory, so same
/// filesystem): `<parent>/<what>-<name>`.
fn beside(pool_dir: &Path, what: &str) -> io::Result<PathBuf> {
    let parent = pool_dir
        .parent()
        .ok_or_else(|| io::Error::other("a pool directory has a parent"))?;
    let name = pool_dir.file_name().unwrap_or_default().to_string_lossy();
    Ok(parent.join(format!("{what}-{name}")))
}

/// Whether `dir` is a symbolic link to `target`.
fn links_to(dir: &Path, target: &Path) -> bool {
    std::fs::read_link(dir).is_ok_and(|t| t == target)
}

/// Give session directory `session_dir`'s sockets to the pooled
/// container's directory `pool_dir` and leave a link to `pool_dir` in its
/// place (see the module docs). Done already: nothing to do. On an error
/// nothing has changed.
pub(crate) fn link(session_dir: &Path, pool_dir: &Path) -> io::Result<()> {
    if links_to(session_dir, pool_dir) {
        return Ok(());
    }
    let link = beside(pool_dir, ".link")?;
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(pool_dir, &link)?;
    let moved = match move_entries(session_dir, pool_dir) {
        Ok(moved) => moved,
        Err(e) => {
            let _ = std::fs::remove_file(&link);
            return Err(e);
        }
    };
    if let Err(e) = exchange(&link, session_dir) {
        for name in &moved {
            let _ = std::fs::rename(pool_dir.join(name), session_dir.join(name));
        }
        let _ = std::fs::remove_file(&link);
        return Err(e);
    }
    // `link` is now the old directory: a socket bound in it between the
    // moves and the swap goes where the others went.
    let _ = move_entries(&link, pool_dir);
    std::fs::remove_dir(&link)
}

/// Undo [`link`]: `session_dir` a directory again, holding the sockets
/// `pool_dir` holds; then `pool_dir` is removed. A `session_dir` that is
/// not a link to `pool_dir` (removed since, or never linked) is left as
/// it is.
pub(crate) fn unlink(session_dir: &Path, pool_dir: &Path) -> io::Result<()> {
    if links_to(session_dir, pool_dir) {
        use std::os::unix::fs::PermissionsExt;
        let back = beside(pool_dir, ".back")?;
        let _ = std::fs::remove_dir_all(&back);
        std::fs::create_dir(&back)?;
        std::fs::set_permissions(&back, std::fs::Permissions::from_mode(0o755))?;
        move_entries(pool_dir, &back)?;
        exchange(&back, session_dir)?;
        // `back` is now the link; what was bound in `pool_dir` meanwhile
        // follows the rest.
        std::fs::remove_file(&back)?;
        let _ = move_entries(pool_dir, session_dir);
    }
    match std::fs::remove_dir_all(pool_dir) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// The pooled containers' directories under `root` whose container is
/// gone: `(name, recorded container id)`, the id `None` for a directory
/// that never got one (its fill died between the directories and the
/// container) and is older than a minute.
pub(crate) fn candidates(root: &Path, prefix: &str) -> Vec<(String, Option<String>)> {
    let Ok(entries) = std::fs::read_dir(root) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            if !name.starts_with(prefix) {
                return None;
            }
            match std::fs::read_to_string(e.path().join(CONTAINER_FILE)) {
                Ok(id) => Some((name, Some(id.trim().to_string()))),
                Err(_) => {
                    let old = e
                        .metadata()
                        .and_then(|m| m.modified())
                        .ok()
                        .and_then(|t| t.elapsed().ok())
                        .is_some_and(|age| age > std::time::Duration::from_secs(60));
                    old.then_some((name, None))
                }
            }
        })
        .collect()
}

/// Remove the directories under `root` named `<prefix>…` (pooled
/// containers': [`crate::pool::POOL_NAME_PREFIX`]; exec directories:
/// [`crate::exec_server::NAME_PREFIX`]) of containers that no longer
/// exist (a taken container's directories stay while it does: its
/// session's sockets are in them). Returns how many went.
pub(crate) async fn sweep(docker: &bollard::Docker, root: &Path, prefix: &str) -> usize {
    let mut removed = 0;
    for (name, id) in candidates(root, prefix) {
        let probe = id.as_deref().unwrap_or(&name);
        let gone = matches!(
            docker.inspect_container(probe, None).await,
            Err(bollard::errors::Error::DockerResponseServerError {
                status_code: 404,
                ..
            })
        );
        if gone {
            remove(root, &name);
            removed += 1;
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A listening socket keeps answering through the swap, the link, a
    /// bind again through the session directory's path, and the undo.
    #[test]
    fn sockets_move_into_the_pool_directory_and_back() {
        let tmp = tempfile::tempdir().unwrap();
        let session = tmp.path().join("sessions").join("s1");
        std::fs::create_dir_all(&session).unwrap();
        let listener = std::os::unix::net::UnixListener::bind(session.join("model.sock")).unwrap();
        let pool = make(&tmp.path().join("pool"), "harness-pool.x-1", 1).unwrap();
        let p = &pool[0];

        link(&session, p).unwrap();
        assert!(links_to(&session, p));
        assert!(p.join("model.sock").exists());
        std::os::unix::net::UnixStream::connect(p.join("model.sock")).unwrap();
        std::os::unix::net::UnixStream::connect(session.join("model.sock")).unwrap();
        listener.accept().unwrap();
        listener.accept().unwrap();
        // Linking again is a no-op.
        link(&session, p).unwrap();

        // A server binding again through the session's path binds in `p`.
        drop(listener);
        std::fs::remove_file(session.join("model.sock")).unwrap();
        let again = std::os::unix::net::UnixListener::bind(session.join("model.sock")).unwrap();
        std::os::unix::net::UnixStream::connect(p.join("model.sock")).unwrap();
        again.accept().unwrap();

        unlink(&session, p).unwrap();
        assert!(std::fs::symlink_metadata(&session).unwrap().is_dir());
        assert!(!p.exists());
        std::os::unix::net::UnixStream::connect(session.join("model.sock")).unwrap();
        again.accept().unwrap();
        // The link's leftovers are gone.
        let left: Vec<_> = std::fs::read_dir(tmp.path().join("pool/harness-pool.x-1"))
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert!(left.is_empty(), "{left:?}");
    }

    #[test]
    fn a_failed_link_changes_nothing() {
        let tmp = tempfile::tempdir().unwrap();
        let session = tmp.path().join("s1");
        std::fs::create_dir_all(&session).unwrap();
        std::fs::write(session.join("model.sock"), b"").unwrap();
        // The pool directory is missing: the move fails.
        let p = tmp.path().join("pool").join("harness-pool.x-2").join("0");
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        assert!(link(&session, &p).is_err());
        assert!(std::fs::symlink_metadata(&session).unwrap().is_dir());
        assert!(session.join("model.sock").exists());
        assert!(!p.parent().unwrap().join(".link-0").exists());
    }

    #[test]
    fn unlinking_a_directory_that_is_no_link_only_removes_the_pool_directory() {
        let tmp = tempfile::tempdir().unwrap();
        let session = tmp.path().join("s1");
        std::fs::create_dir_all(&session).unwrap();
        std::fs::write(session.join("model.sock"), b"").unwrap();
        let p = make(&tmp.path().join("pool"), "harness-pool.x-3", 1).unwrap();
        unlink(&session, &p[0]).unwrap();
        assert!(session.join("model.sock").exists());
        assert!(!p[0].exists());
    }

    #[test]
    fn candidates_are_recorded_containers_and_old_unrecorded_directories() {
        let tmp = tempfile::tempdir().unwrap();
        make(tmp.path(), "harness-pool.a-1", 1).unwrap();
        record_container(tmp.path(), "harness-pool.a-1", "abc\n").unwrap();
        make(tmp.path(), "harness-pool.a-2", 1).unwrap();
        std::fs::create_dir(tmp.path().join("other")).unwrap();
        assert_eq!(
            candidates(tmp.path(), crate::pool::POOL_NAME_PREFIX),
            vec![("harness-pool.a-1".to_string(), Some("abc".to_string()))]
        );
    }
}
