//! The lease side of an actor on a node among several: keeping the lease
//! while the actor runs, re-sending what the previous owner left running
//! when the session was taken over, and noticing when the store refused an
//! append as fenced (the lease went elsewhere before the keeper noticed).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use harness_core::frame::Frame;
use harness_core::log::{
    AppendRequest, Appended, ChainedFrame, LogInfo, SessionLeases, SessionStore,
};
use harness_core::{ErrorKind, Result, SessionId};
use tokio::sync::mpsc;

use super::{ActorTask, Command};

/// How long a forwarder waits before trying an owner that just failed it
/// again (its lease still stands): a tenth of the lease, at most a second.
pub(super) fn retry_pause(ttl: Duration) -> Duration {
    (ttl / 10).min(Duration::from_secs(1))
}

/// A lease this node took for an actor.
pub(super) struct Held {
    pub leases: Arc<dyn SessionLeases>,
    pub generation: u64,
    /// Another node (or this node's previous life) held it before.
    pub taken_over: bool,
}

impl Held {
    /// Start keeping the lease (the node's [`Renewer`] renews it with every
    /// other lease the node holds). After a takeover, first re-send the
    /// session's pending turn commands: the old owner may have died
    /// between storing a prompt and handing its turn to the engine
    /// (commands are idempotent: a running turn is not started twice).
    pub(super) async fn start(self, task: &ActorTask) -> Keeper {
        tracing::info!(
            session = %task.session,
            node = self.leases.node(),
            generation = self.generation,
            taken_over = self.taken_over,
            "this node runs the session's actor"
        );
        if self.taken_over {
            match task.hub.log.info(&task.session).await {
                Ok(info) if !info.sealed => {
                    for command in info.meta.pending_commands() {
                        task.hub.dispatch(&task.session, command);
                    }
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(
                    session = %task.session,
                    "could not read what the previous owner left running: {e}"
                ),
            }
        }
        let renewer = task.hub.renewer(&self.leases);
        renewer.add(task.session.clone(), self.generation, task.tx.clone());
        Keeper {
            renewer,
            leases: self.leases,
            session: task.session.clone(),
            generation: self.generation,
        }
    }
}

/// Keeps one actor's lease: the node's renewer renews it until [`stop`](Self::stop).
pub(super) struct Keeper {
    renewer: Arc<Renewer>,
    leases: Arc<dyn SessionLeases>,
    session: SessionId,
    generation: u64,
}

impl Keeper {
    /// Stop renewing; `release` gives the lease up at once (the actor
    /// retired: the next node need not wait for it to expire).
    pub(super) async fn stop(self, release: bool) {
        self.renewer.remove(&self.session, self.generation);
        if release {
            if let Err(e) = self.leases.release(&self.session, self.generation).await {
                tracing::warn!(session = %self.session, "could not release the lease: {e}");
            }
        }
    }
}

/// One held lease in the renewer.
struct Kept {
    generation: u64,
    actor: mpsc::UnboundedSender<Command>,
    /// When it was taken or last renewed.
    renewed: tokio::time::Instant,
}

/// Every lease this node holds, renewed together every third of the lease
/// (`SessionLeases::renew_all`: one round trip for the node, not one per
/// session). It tells an actor when its lease is gone (taken by another
/// node), or when it could not be renewed for two thirds of it (it may be
/// taken any moment: stop before it is).
pub(super) struct Renewer {
    leases: Arc<dyn SessionLeases>,
    held: Mutex<std::collections::HashMap<SessionId, Kept>>,
}

impl Renewer {
    /// A renewer of `leases`, its loop spawned on `tasks` (it ends when the
    /// last handle to the renewer is gone).
    pub(super) fn start(
        leases: Arc<dyn SessionLeases>,
        tasks: &tokio::runtime::Handle,
    ) -> Arc<Self> {
        let renewer = Arc::new(Self {
            leases,
            held: Mutex::default(),
        });
        tasks.spawn(renew_loop(Arc::downgrade(&renewer)));
        renewer
    }

    fn add(&self, session: SessionId, generation: u64, actor: mpsc::UnboundedSender<Command>) {
        self.held.lock().unwrap_or_else(|e| e.into_inner()).insert(
            session,
            Kept {
                generation,
                actor,
                renewed: tokio::time::Instant::now(),
            },
        );
    }

    fn remove(&self, session: &SessionId, generation: u64) {
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        if held
            .get(session)
            .is_some_and(|k| k.generation == generation)
        {
            held.remove(session);
        }
    }

    /// One round: renew every lease held now; tell the actors of those lost.
    async fn round(&self) {
        let every = self.leases.ttl() / 3;
        let snapshot: Vec<(SessionId, u64)> = self
            .held
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|(s, k)| (s.clone(), k.generation))
            .collect();
        if snapshot.is_empty() {
            return;
        }
        let answers = self.leases.renew_all(&snapshot).await;
        let now = tokio::time::Instant::now();
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        for (n, (session, generation)) in snapshot.iter().enumerate() {
            // Removed (the actor stopped) or taken anew meanwhile.
            let Some(kept) = held
                .get_mut(session)
                .filter(|k| k.generation == *generation)
            else {
                continue;
            };
            let lost = match &answers {
                Ok(answers) if answers.get(n) == Some(&true) => {
                    kept.renewed = now;
                    continue;
                }
                Ok(_) => format!(
                    "node {} lost the lease of generation {generation} to another node",
                    self.leases.node()
                ),
                Err(e) if kept.renewed.elapsed() + every >= self.leases.ttl() => format!(
                    "node {} could not renew its lease for {} ms ({e})",
                    self.leases.node(),
                    kept.renewed.elapsed().as_millis()
                ),
                Err(e) => {
                    tracing::warn!(%session, "renewing the lease failed, trying again: {e}");
                    continue;
                }
            };
            let _ = kept.actor.send(Command::LeaseLost(lost));
            held.remove(session);
        }
    }
}

/// Renew every third of the lease while the renewer lives.
async fn renew_loop(renewer: std::sync::Weak<Renewer>) {
    let Some(every) = renewer.upgrade().map(|r| r.leases.ttl() / 3) else {
        return;
    };
    loop {
        tokio::time::sleep(every).await;
        let Some(renewer) = renewer.upgrade() else {
            return;
        };
        renewer.round().await;
    }
}

/// The actor's store, remembering whether an append was refused as fenced
/// (a sign the lease is gone even before the keeper learns it).
#[derive(Debug, Clone)]
pub(super) struct FenceWatch {
    inner: Arc<dyn SessionStore>,
    fenced: Arc<Mutex<Option<String>>>,
}

impl FenceWatch {
    pub(super) fn new(inner: Arc<dyn SessionStore>) -> Self {
        Self {
            inner,
            fenced: Arc::default(),
        }
    }

    /// The store to give the actor.
    pub(super) fn store(&self) -> Arc<dyn SessionStore> {
        Arc::new(self.clone())
    }

    /// Why an append was fenced since the last call, if one was.
    pub(super) fn take(&self) -> Option<String> {
        self.fenced.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    fn watch<T>(&self, result: Result<T>) -> Result<T> {
        if let Err(e) = &result {
            if e.kind() == ErrorKind::Fenced {
                tracing::warn!(session = %self.inner.session(), "an append was refused as fenced: {e}");
                *self.fenced.lock().unwrap_or_else(|e| e.into_inner()) = Some(e.to_string());
            }
        }
        result
    }
}

#[async_trait]
impl SessionStore for FenceWatch {
    fn session(&self) -> &SessionId {
        self.inner.session()
    }
    async fn info(&self) -> Result<LogInfo> {
        self.inner.info().await
    }
    async fn append(&self, request: AppendRequest) -> Result<Appended> {
        let result = self.inner.append(request).await;
        self.watch(result)
    }
    async fn append_grouped(&self, request: AppendRequest) -> Result<(Appended, u64)> {
        let result = self.inner.append_grouped(request).await;
        self.watch(result)
    }
    async fn commit_group(&self, group: u64) -> Result<()> {
        let result = self.inner.commit_group(group).await;
        self.watch(result)
    }
    async fn read(&self, after: u64, limit: usize) -> Result<Vec<Frame>> {
        self.inner.read(after, limit).await
    }
    async fn read_chain(&self, after: u64, limit: usize) -> Result<Vec<ChainedFrame>> {
        self.inner.read_chain(after, limit).await
    }
}
