//! Where a session actor's [`TurnCommand`]s go: [`Dispatcher`].
//!
//! [`EngineDispatcher`] performs them with core's [`SessionRuntime`] on an
//! engine reachable from this process (the in-process engine, or a
//! Temporal client whose workers run elsewhere) — in the server's process,
//! or in a remote runner that receives them over the runner channel.
//! Commands of one session are performed in the order they were stored (a
//! per-session queue): an abort sent right after a prompt never overtakes
//! the start. A start or an abort that cannot be performed is reported
//! back to the actor (`Input::DispatchFailed`, directly or through the
//! runner channel), which records the turn as failed so the session can
//! take its next prompt.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use harness_core::actor::Input;
use harness_core::session::{SessionRuntime, TurnCommand};
use harness_core::SessionId;
use tokio::sync::mpsc;

use crate::hub::Hub;

/// Told when a start or an abort could not be performed: `(session, turn,
/// error)`.
pub type OnFailure = Arc<dyn Fn(&SessionId, String, String) + Send + Sync>;

/// Receives the commands of every session of a hub. Must not block:
/// queue the work and return.
pub trait Dispatcher: Send + Sync + std::fmt::Debug {
    /// `command` was stored for `session`.
    fn dispatch(&self, session: &SessionId, command: TurnCommand);
}

/// How long a session's command queue stays without work before its task
/// ends (the next command starts a new one).
const QUEUE_IDLE: Duration = Duration::from_secs(60);

type Queues = Arc<Mutex<HashMap<SessionId, (u64, mpsc::UnboundedSender<TurnCommand>)>>>;

/// Performs commands on an engine in this process. See the module docs.
#[derive(Clone)]
pub struct EngineDispatcher {
    runtime: SessionRuntime,
    on_failure: OnFailure,
    tasks: tokio::runtime::Handle,
    queues: Queues,
    next_epoch: Arc<std::sync::atomic::AtomicU64>,
}

impl std::fmt::Debug for EngineDispatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineDispatcher")
            .field("runtime", &self.runtime)
            .finish_non_exhaustive()
    }
}

impl EngineDispatcher {
    /// Perform `hub`'s commands with `runtime`; failures go back to the
    /// session's actor.
    pub fn new(runtime: SessionRuntime, hub: &Arc<Hub>) -> Self {
        let weak: Weak<Hub> = Arc::downgrade(hub);
        let on_failure: OnFailure = Arc::new(move |session, turn_id, error| {
            if let Some(hub) = weak.upgrade() {
                let input = Input::DispatchFailed { turn_id, error };
                if let Err(e) = hub.input(session, input) {
                    tracing::error!(%session, error = %e, "could not record the failed turn");
                }
            }
        });
        Self::with_failure(runtime, hub.tasks().clone(), on_failure)
    }

    /// Perform commands with `runtime` on the runtime `tasks`, telling
    /// `on_failure` about starts and aborts that could not be performed
    /// (a remote runner sends them back to its server).
    pub fn with_failure(
        runtime: SessionRuntime,
        tasks: tokio::runtime::Handle,
        on_failure: OnFailure,
    ) -> Self {
        Self {
            runtime,
            on_failure,
            tasks,
            queues: Arc::default(),
            next_epoch: Arc::default(),
        }
    }

    /// The runtime performing the commands.
    pub fn runtime(&self) -> &SessionRuntime {
        &self.runtime
    }

    async fn run_queue(
        self,
        session: SessionId,
        epoch: u64,
        mut rx: mpsc::UnboundedReceiver<TurnCommand>,
    ) {
        loop {
            let command = match tokio::time::timeout(QUEUE_IDLE, rx.recv()).await {
                Ok(Some(command)) => command,
                Ok(None) => return,
                Err(_) => {
                    let mut queues = self.queues.lock().unwrap_or_else(|e| e.into_inner());
                    if rx.is_empty() {
                        if queues.get(&session).is_some_and(|(e, _)| *e == epoch) {
                            queues.remove(&session);
                        }
                        return;
                    }
                    continue;
                }
            };
            self.perform(&session, command).await;
        }
    }

    async fn perform(&self, session: &SessionId, command: TurnCommand) {
        let turn_id = command.turn_id().to_string();
        let reports_failure = matches!(
            command,
            TurnCommand::Start { .. } | TurnCommand::Abort { .. }
        );
        let what = match &command {
            TurnCommand::Start { .. } => "start",
            TurnCommand::Answer { .. } => "answer",
            TurnCommand::Abort { .. } => "abort",
        };
        if let Err(e) = self.runtime.perform(session, command).await {
            tracing::warn!(%session, turn = %turn_id, error = %e, "could not {what} the turn");
            if reports_failure {
                (self.on_failure)(session, turn_id, e.to_string());
            }
        }
    }
}

impl Dispatcher for EngineDispatcher {
    fn dispatch(&self, session: &SessionId, command: TurnCommand) {
        let mut queues = self.queues.lock().unwrap_or_else(|e| e.into_inner());
        let command = match queues.get(session) {
            Some((_, tx)) => match tx.send(command) {
                Ok(()) => return,
                Err(mpsc::error::SendError(back)) => back,
            },
            None => command,
        };
        let (tx, rx) = mpsc::unbounded_channel();
        let _ = tx.send(command);
        let epoch = self
            .next_epoch
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        queues.insert(session.clone(), (epoch, tx));
        self.tasks
            .spawn(self.clone().run_queue(session.clone(), epoch, rx));
    }
}
