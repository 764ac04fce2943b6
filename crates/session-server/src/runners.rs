//! Remote runners: a server that runs no engine itself hands its sessions'
//! turn commands to the runner attached on `GET /v1/runner` (see
//! `session_runtime::remote` for the protocol). One runner at a time: a
//! newer generation replaces the attached one, an older one is refused.

use std::sync::{Arc, Mutex, Weak};

use harness_core::actor::Input;
use harness_core::session::TurnCommand;
use harness_core::SessionId;
use session_runtime::{Dispatcher, Hub, ToRunner};
use tokio::sync::mpsc;

/// What goes out on the attached runner's socket.
#[derive(Debug)]
pub(crate) enum Outgoing {
    /// A command (boxed: a start carries the session's config).
    Command(Box<ToRunner>),
    /// Close the channel (a newer runner took over).
    Close(String),
}

#[derive(Debug)]
struct Attached {
    id: u64,
    generation: u64,
    tx: mpsc::UnboundedSender<Outgoing>,
}

/// The attached remote runner, as the hub's [`Dispatcher`].
#[derive(Debug)]
pub(crate) struct RemoteRunners {
    hub: Weak<Hub>,
    current: Mutex<Option<Attached>>,
    next_id: std::sync::atomic::AtomicU64,
}

impl RemoteRunners {
    pub(crate) fn new(hub: &Arc<Hub>) -> Self {
        Self {
            hub: Arc::downgrade(hub),
            current: Mutex::new(None),
            next_id: std::sync::atomic::AtomicU64::new(1),
        }
    }

    /// Attach a runner of `generation`: its id and what to send it; `Err`
    /// with the current generation when a newer one is attached.
    pub(crate) fn attach(
        &self,
        generation: u64,
    ) -> Result<(u64, mpsc::UnboundedReceiver<Outgoing>), u64> {
        let mut current = self.current.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(attached) = current.as_ref() {
            if attached.generation > generation {
                return Err(attached.generation);
            }
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let id = self
            .next_id
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if let Some(old) = current.replace(Attached { id, generation, tx }) {
            let _ = old.tx.send(Outgoing::Close(format!(
                "replaced by runner generation {generation}"
            )));
        }
        Ok((id, rx))
    }

    /// The runner `id` left.
    pub(crate) fn detach(&self, id: u64) {
        let mut current = self.current.lock().unwrap_or_else(|e| e.into_inner());
        if current.as_ref().is_some_and(|a| a.id == id) {
            *current = None;
        }
    }

    /// A runner reported that it could not start or abort a turn.
    pub(crate) fn failed(&self, session: &SessionId, turn_id: String, error: String) {
        if let Some(hub) = self.hub.upgrade() {
            if let Err(e) = hub.input(session, Input::DispatchFailed { turn_id, error }) {
                tracing::error!(%session, error = %e, "could not record the failed turn");
            }
        }
    }
}

impl Dispatcher for RemoteRunners {
    fn dispatch(&self, session: &SessionId, command: TurnCommand) {
        let current = self.current.lock().unwrap_or_else(|e| e.into_inner());
        match current.as_ref() {
            Some(attached) => {
                let _ = attached
                    .tx
                    .send(Outgoing::Command(Box::new(ToRunner::Command {
                        session: session.clone(),
                        command,
                    })));
            }
            None => tracing::info!(
                %session,
                turn = command.turn_id(),
                "no runner attached: the command is sent when one attaches"
            ),
        }
    }
}
