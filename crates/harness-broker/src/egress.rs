//! The egress proxies of `custom` network policies, one per session.
//!
//! Registering a session writes its policy to `<dir>/policies/<session>.json`
//! (checked first: a policy the proxy cannot enforce is refused before any
//! sandbox exists). The serving process keeps one listener per policy on
//! record at `<dir>/egress/<session>/proxy.sock`, a directory with that one
//! socket in it, which the session's sandboxes get as their forward to
//! [`EGRESS_PROXY_PORT`](harness_core::sandbox::EGRESS_PROXY_PORT).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use harness_core::sandbox::NetworkPolicy;
use harness_core::{Error, Result};
use harness_egress::{EgressPolicy, EgressProxy};

/// Record `session_id`'s policy; returns the socket its sandboxes forward to.
pub(crate) fn register(dir: &Path, session_id: &str, network: &NetworkPolicy) -> Result<PathBuf> {
    // Refuse what the proxy cannot enforce now, with the proxy's words.
    EgressPolicy::from_network(network)?;
    let path = policy_path(dir, session_id);
    crate::write_atomic(&path, &serde_json::to_vec_pretty(network)?)?;
    let sock_dir = dir.join("egress").join(session_id);
    std::fs::create_dir_all(&sock_dir)
        .map_err(|e| crate::ctx(e, format!("creating {}", sock_dir.display())))?;
    crate::set_mode(&sock_dir, 0o755)?;
    Ok(sock_dir.join("proxy.sock"))
}

fn policy_path(dir: &Path, session_id: &str) -> PathBuf {
    dir.join("policies").join(format!("{session_id}.json"))
}

/// The listeners the serving process runs, by session.
#[derive(Default)]
pub(crate) struct EgressListeners {
    running: BTreeMap<String, (NetworkPolicy, tokio::task::JoinHandle<()>)>,
}

impl Drop for EgressListeners {
    fn drop(&mut self) {
        for (_, task) in self.running.values() {
            task.abort();
        }
    }
}

impl EgressListeners {
    /// Match the listeners to the policies on record: start the missing,
    /// restart the changed, stop the removed (a revoked session's).
    pub(crate) fn refresh(&mut self, dir: &Path) {
        let mut on_record = BTreeMap::new();
        if let Ok(entries) = std::fs::read_dir(dir.join("policies")) {
            for entry in entries.flatten() {
                let name = entry.file_name().to_string_lossy().into_owned();
                let Some(session) = name.strip_suffix(".json") else { continue };
                match std::fs::read(entry.path())
                    .map_err(Error::from)
                    .and_then(|b| Ok(serde_json::from_slice::<NetworkPolicy>(&b)?))
                {
                    Ok(policy) => {
                        on_record.insert(session.to_string(), policy);
                    }
                    Err(e) => tracing::warn!(error = %e, file = %entry.path().display(), "unreadable egress policy"),
                }
            }
        }
        self.running.retain(|session, (policy, task)| {
            let keep = on_record.get(session) == Some(policy) && !task.is_finished();
            if !keep {
                task.abort();
            }
            keep
        });
        for (session, network) in on_record {
            if self.running.contains_key(&session) {
                continue;
            }
            match serve(dir, &session, &network) {
                Ok(task) => {
                    self.running.insert(session, (network, task));
                }
                Err(e) => tracing::warn!(error = %e, session.id = %session, "the session's egress proxy could not start"),
            }
        }
    }
}

fn serve(dir: &Path, session_id: &str, network: &NetworkPolicy) -> Result<tokio::task::JoinHandle<()>> {
    let policy = EgressPolicy::from_network(network)?;
    let sock_dir = dir.join("egress").join(session_id);
    std::fs::create_dir_all(&sock_dir).map_err(Error::from)?;
    let socket = sock_dir.join("proxy.sock");
    let _ = std::fs::remove_file(&socket);
    let listener = tokio::net::UnixListener::bind(&socket)
        .map_err(|e| crate::ctx(e, format!("listening on {}", socket.display())))?;
    crate::set_mode(&socket, 0o666)?;
    tracing::info!(session.id = session_id, socket = %socket.display(), "egress proxy serving");
    Ok(EgressProxy::new(policy).serve_unix(listener))
}
