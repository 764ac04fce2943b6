//! Restores written from the engine's host: a tar import into a container
//! goes through `/proc/<pid>/root` of the container's main process, with
//! the unpacker of `harness-tario` (every entry beneath the target, by
//! `openat2`), instead of through an exec of GNU tar inside the container
//! — a whole hop and a copy of every byte less (`docs/sandbox-docker.md`,
//! "Imports from the host").
//!
//! Taken only where it is sure to be the container's own tree: on Linux,
//! the engine's pid of the container's main process found in this
//! process's `/proc` *and* its cgroup naming the container (a harness in
//! another pid namespace than the engine's sees another process, or none,
//! under that pid), checked again after the directory is open; the
//! directory opened by resolving it inside the container's root
//! (`RESOLVE_IN_ROOT`: its absolute symlinks lead into the container, not
//! the host); the files given the directory's owner, which needs root here
//! unless that owner is this process's user (a rootless engine). Anything
//! else — another machine, Docker Desktop's VM, no permission, a directory
//! not there yet — gives `None`, and the caller extracts through an exec.

use std::os::fd::OwnedFd;

use bollard::Docker;

/// The directory `dir` (absolute, inside the container) of container `id`
/// opened from this host, and whom its new entries are given to (`None`:
/// this process's own user); `None` where this host cannot, or must not,
/// write there (see the module).
pub(crate) async fn open(
    docker: &Docker,
    id: &str,
    dir: &str,
) -> Option<(OwnedFd, Option<(u32, u32)>)> {
    if !cfg!(target_os = "linux") {
        return None;
    }
    let info = docker.inspect_container(id, None).await.ok()?;
    let pid = info.state?.pid.filter(|pid| *pid > 0)?;
    let full_id = info.id?;
    let rel = dir_in_root(dir);
    let owned = tokio::task::spawn_blocking(move || open_in_root(pid, &full_id, &rel))
        .await
        .ok()??;
    Some(owned)
}

/// `dir` relative to the container's root ("." for the root itself).
fn dir_in_root(dir: &str) -> String {
    let rel = dir.trim_start_matches('/');
    if rel.is_empty() {
        ".".into()
    } else {
        rel.into()
    }
}

/// Whether process `pid`, as this host's `/proc` shows it, is in the
/// cgroup of container `full_id`.
fn in_container(pid: i64, full_id: &str) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/cgroup")).is_ok_and(|c| c.contains(full_id))
}

fn open_in_root(pid: i64, full_id: &str, rel: &str) -> Option<(OwnedFd, Option<(u32, u32)>)> {
    use rustix::fs::{Mode, OFlags, ResolveFlags};
    if full_id.len() < 64 || !in_container(pid, full_id) {
        return None;
    }
    let flags = OFlags::PATH.union(OFlags::DIRECTORY).union(OFlags::CLOEXEC);
    let root = rustix::fs::open(format!("/proc/{pid}/root"), flags, Mode::empty()).ok()?;
    let resolve = ResolveFlags::IN_ROOT.union(ResolveFlags::NO_MAGICLINKS);
    let dir = rustix::fs::openat2(&root, rel, flags, Mode::empty(), resolve).ok()?;
    // The process may have exited, and its pid been reused, since the check.
    if !in_container(pid, full_id) {
        return None;
    }
    let st = rustix::fs::fstat(&dir).ok()?;
    let me = (
        rustix::process::geteuid().as_raw(),
        rustix::process::getegid().as_raw(),
    );
    let owner = (st.st_uid, st.st_gid);
    if owner == me {
        return Some((dir, None));
    }
    // Giving files away needs root.
    (me.0 == 0).then_some((dir, Some(owner)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_directory_is_taken_relative_to_the_containers_root() {
        assert_eq!(dir_in_root("/workspace"), "workspace");
        assert_eq!(dir_in_root("/workspace/a/b"), "workspace/a/b");
        assert_eq!(dir_in_root("/"), ".");
    }

    /// This test process is in no container's cgroup of that id, and a pid
    /// that is no process is in none.
    #[test]
    fn a_process_outside_the_container_is_not_taken() {
        let id = "0".repeat(64);
        assert!(!in_container(std::process::id() as i64, &id));
        assert!(open_in_root(std::process::id() as i64, &id, "tmp").is_none());
        assert!(open_in_root(i64::from(i32::MAX), &id, ".").is_none());
        // A short id (a prefix) is never matched against the cgroup.
        assert!(open_in_root(std::process::id() as i64, "", ".").is_none());
    }
}
