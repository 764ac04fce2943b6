//! The per-session listeners of the serving process.
//!
//! Each session with a sandbox has its own model socket,
//! `<dir>/sessions/<session>/model.sock`, that answers that session's token
//! alone: a sandbox's forward reaches its own session's endpoint and no
//! other, so even a leaked token of another session opens nothing there.
//! A session under a `custom` network policy also has its egress proxy at
//! `<dir>/egress/<session>/proxy.sock`, enforcing the policy recorded in
//! `<dir>/policies/<session>.json` (checked when recorded: a policy the
//! proxy cannot enforce is refused before any sandbox exists).
//!
//! Registering only writes files; the serving process matches its
//! listeners to them (at once when it registered them; when another
//! process did, as soon as inotify reports the change, else within a
//! quarter of a second), and after a restart serves them all again.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use harness_core::audit::AuditRecord;
use harness_core::sandbox::NetworkPolicy;
use harness_core::{Error, Result};
use harness_egress::{EgressPolicy, EgressProxy, Outcome};

use crate::Inner;

/// Record `session_id` as one with sandboxes; returns its model socket.
pub(crate) fn register(dir: &Path, session_id: &str) -> Result<PathBuf> {
    let socket = crate::session_socket(dir, session_id);
    let sock_dir = socket.parent().expect("a socket path has a parent");
    socket_dir(sock_dir)?;
    Ok(socket)
}

/// Make a socket directory, mode 0755. A sandbox provider may have made it
/// a symbolic link into a directory of a container's own (the Docker
/// pool's `forward_dirs`), which holds the sockets while the link stands;
/// a link whose target is gone (its container removed by a process that
/// died before it could undo the link) is replaced by a directory.
fn socket_dir(sock_dir: &Path) -> Result<()> {
    let dangling = std::fs::symlink_metadata(sock_dir).is_ok_and(|m| m.file_type().is_symlink())
        && !sock_dir.exists();
    if dangling {
        std::fs::remove_file(sock_dir)
            .map_err(|e| crate::ctx(e, format!("removing the dead link {}", sock_dir.display())))?;
    }
    std::fs::create_dir_all(sock_dir)
        .map_err(|e| crate::ctx(e, format!("creating {}", sock_dir.display())))?;
    crate::set_mode(sock_dir, 0o755)
}

/// Record `session_id`'s `custom` policy; returns its egress socket.
pub(crate) fn register_policy(
    dir: &Path,
    session_id: &str,
    network: &NetworkPolicy,
) -> Result<PathBuf> {
    // Refuse what the proxy cannot enforce now, with the proxy's words.
    EgressPolicy::from_network(network)?;
    let path = policy_path(dir, session_id);
    crate::write_atomic(&path, &serde_json::to_vec_pretty(network)?)?;
    let sock_dir = dir.join("egress").join(session_id);
    socket_dir(&sock_dir)?;
    Ok(sock_dir.join("proxy.sock"))
}

fn policy_path(dir: &Path, session_id: &str) -> PathBuf {
    dir.join("policies").join(format!("{session_id}.json"))
}

/// What tells the serving process that another process registered a
/// session or a policy: a watch (inotify, through `notify`) on the
/// directories registering writes to (`sessions/`, `policies/`,
/// `egress/`). Dropping it stops the watch.
pub(crate) struct RegistrationWatch {
    watch: Option<(notify::RecommendedWatcher, tokio::sync::mpsc::Receiver<()>)>,
}

impl RegistrationWatch {
    pub(crate) fn new(dir: &Path) -> Self {
        let watch = match Self::watch(dir) {
            Ok(watch) => Some(watch),
            Err(e) => {
                tracing::warn!(error = %e, dir = %dir.display(), "no watch on the broker's registrations: another process's new session waits for the next look");
                None
            }
        };
        RegistrationWatch { watch }
    }

    fn watch(
        dir: &Path,
    ) -> std::result::Result<(notify::RecommendedWatcher, tokio::sync::mpsc::Receiver<()>), String>
    {
        use notify::Watcher;
        // One pending signal is enough: a refresh covers every change
        // before it.
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        let mut watcher =
            notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
                // Only entries coming or going (a session's directory
                // made, a policy renamed into place) are registrations.
                // Not opens, reads or attribute changes: the refresh itself
                // reads these directories, and acting on that would refresh
                // forever (seen: the broker at 100 % CPU).
                if let Ok(event) = event {
                    if is_registration(&event.kind) {
                        let _ = tx.try_send(());
                    }
                }
            })
            .map_err(|e| e.to_string())?;
        for sub in ["sessions", "policies", "egress"] {
            let path = dir.join(sub);
            std::fs::create_dir_all(&path).map_err(|e| format!("{}: {e}", path.display()))?;
            watcher
                .watch(&path, notify::RecursiveMode::NonRecursive)
                .map_err(|e| format!("{}: {e}", path.display()))?;
        }
        Ok((watcher, rx))
    }

    /// Until the directories change or `at_most` passes, whichever is
    /// first.
    pub(crate) async fn next(&mut self, at_most: std::time::Duration) {
        match &mut self.watch {
            Some((_, changes)) => {
                if let Ok(None) = tokio::time::timeout(at_most, changes.recv()).await {
                    // The watcher's thread is gone: back to looking.
                    self.watch = None;
                }
            }
            None => tokio::time::sleep(at_most).await,
        }
    }
}

/// Whether a change of a registrations directory can be a registration
/// (or its removal).
fn is_registration(kind: &notify::EventKind) -> bool {
    use notify::event::ModifyKind;
    use notify::EventKind;
    matches!(
        kind,
        EventKind::Create(_) | EventKind::Remove(_) | EventKind::Modify(ModifyKind::Name(_))
    )
}

impl std::fmt::Debug for RegistrationWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegistrationWatch")
            .field("watching", &self.watch.is_some())
            .finish()
    }
}

/// The listeners the serving process runs, by session.
#[derive(Default)]
pub(crate) struct SessionListeners {
    model: BTreeMap<String, tokio::task::JoinHandle<()>>,
    egress: BTreeMap<String, (NetworkPolicy, tokio::task::JoinHandle<()>)>,
}

impl Drop for SessionListeners {
    fn drop(&mut self) {
        for task in self.model.values() {
            task.abort();
        }
        for (_, task) in self.egress.values() {
            task.abort();
        }
    }
}

/// The names of the entries of `dir` (none when it cannot be read).
fn names(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

impl SessionListeners {
    /// Match the listeners to the sessions and policies on record.
    pub(crate) fn refresh(&mut self, inner: &Arc<Inner>) {
        let dir = &inner.dir;
        let sessions = names(&dir.join("sessions"));
        self.model
            .retain(|s, task| !task.is_finished() && sessions.contains(s));
        for session in sessions {
            if self.model.contains_key(&session) {
                continue;
            }
            match serve_model(inner, &session) {
                Ok(task) => {
                    self.model.insert(session, task);
                }
                Err(e) => {
                    tracing::warn!(error = %e, session.id = %session, "the session's model socket could not start")
                }
            }
        }

        let mut policies = BTreeMap::new();
        for name in names(&dir.join("policies")) {
            let Some(session) = name.strip_suffix(".json") else {
                continue;
            };
            let path = policy_path(dir, session);
            match std::fs::read(&path)
                .map_err(Error::from)
                .and_then(|b| Ok(serde_json::from_slice::<NetworkPolicy>(&b)?))
            {
                Ok(policy) => {
                    policies.insert(session.to_string(), policy);
                }
                Err(e) => {
                    tracing::warn!(error = %e, file = %path.display(), "unreadable egress policy")
                }
            }
        }
        self.egress.retain(|session, (policy, task)| {
            let keep = policies.get(session) == Some(policy) && !task.is_finished();
            if !keep {
                task.abort();
            }
            keep
        });
        for (session, network) in policies {
            if self.egress.contains_key(&session) {
                continue;
            }
            match serve_egress(inner, &session, &network) {
                Ok(task) => {
                    self.egress.insert(session, (network, task));
                }
                Err(e) => {
                    tracing::warn!(error = %e, session.id = %session, "the session's egress proxy could not start")
                }
            }
        }
    }
}

/// Bind `socket` afresh: a file there is left by a process that died (the
/// caller holds the directory's lock, so no live process serves it).
fn bind(socket: &Path) -> Result<tokio::net::UnixListener> {
    let _ = std::fs::remove_file(socket);
    let listener = tokio::net::UnixListener::bind(socket)
        .map_err(|e| crate::ctx(e, format!("listening on {}", socket.display())))?;
    // Any user may connect (a container's agent may not be root): the
    // token, and for the egress proxy the policy, are the checks.
    crate::set_mode(socket, 0o666)?;
    Ok(listener)
}

fn serve_model(inner: &Arc<Inner>, session_id: &str) -> Result<tokio::task::JoinHandle<()>> {
    let socket = crate::session_socket(&inner.dir, session_id);
    let listener = bind(&socket)?;
    let app = crate::proxy::router(inner.clone(), Some(session_id.to_string()));
    tracing::debug!(session.id = session_id, socket = %socket.display(), "model socket serving");
    let session = session_id.to_string();
    Ok(tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(error = %e, session.id = %session, "the session's model socket stopped serving");
        }
    }))
}

fn serve_egress(
    inner: &Arc<Inner>,
    session_id: &str,
    network: &NetworkPolicy,
) -> Result<tokio::task::JoinHandle<()>> {
    let policy = EgressPolicy::from_network(network)?;
    let sock_dir = inner.dir.join("egress").join(session_id);
    socket_dir(&sock_dir)?;
    let listener = bind(&sock_dir.join("proxy.sock"))?;
    tracing::info!(session.id = session_id, "egress proxy serving");
    // Every decision goes to the session's audit journal as it is made.
    let (journal_inner, session) = (inner.clone(), session_id.to_string());
    let journal: harness_egress::Journal = Arc::new(move |outcome: &Outcome| {
        let (target, decision, reason) = match outcome {
            Outcome::Allowed { target, reason, .. } => (target.clone(), "allowed", reason.clone()),
            Outcome::Refused { target, reason } => (target.clone(), "refused", reason.clone()),
            Outcome::Failed { reason, .. } => (String::new(), "failed", reason.clone()),
            _ => return,
        };
        journal_inner.journal(&session, |index| AuditRecord::Egress {
            index,
            target,
            decision: decision.into(),
            reason,
        });
    });
    Ok(EgressProxy::new(policy)
        .with_journal(journal)
        .serve_unix(listener))
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_dead_link_in_place_of_a_socket_directory_is_replaced() {
        let tmp = tempfile::tempdir().unwrap();
        let gone = tmp.path().join("pool").join("0");
        let sessions = tmp.path().join("sessions");
        std::fs::create_dir_all(&sessions).unwrap();
        std::os::unix::fs::symlink(&gone, sessions.join("s1")).unwrap();
        let socket = super::register(tmp.path(), "s1").unwrap();
        let dir = socket.parent().unwrap();
        assert!(std::fs::symlink_metadata(dir).unwrap().is_dir());
        // A live link is kept: the sockets are behind it.
        let live = tmp.path().join("pool").join("1");
        std::fs::create_dir_all(&live).unwrap();
        std::os::unix::fs::symlink(&live, sessions.join("s2")).unwrap();
        super::register(tmp.path(), "s2").unwrap();
        assert!(std::fs::symlink_metadata(sessions.join("s2"))
            .unwrap()
            .file_type()
            .is_symlink());
    }

    use notify::event::{AccessKind, AccessMode, CreateKind, MetadataKind, ModifyKind, RenameMode};
    use notify::EventKind;

    use super::is_registration;

    #[test]
    fn only_entries_coming_or_going_are_registrations() {
        // What a refresh does to the watched directories itself (read
        // them, and the attribute changes of registering) must not wake
        // it again.
        for kind in [
            EventKind::Access(AccessKind::Open(AccessMode::Any)),
            EventKind::Access(AccessKind::Close(AccessMode::Read)),
            EventKind::Modify(ModifyKind::Metadata(MetadataKind::Permissions)),
            EventKind::Other,
        ] {
            assert!(!is_registration(&kind), "{kind:?}");
        }
        for kind in [
            EventKind::Create(CreateKind::Folder),
            EventKind::Modify(ModifyKind::Name(RenameMode::To)),
            EventKind::Remove(notify::event::RemoveKind::Folder),
        ] {
            assert!(is_registration(&kind), "{kind:?}");
        }
    }
}
