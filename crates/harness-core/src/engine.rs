//! Durable engines: who runs the slices of a turn, and where the state lives
//! between them.
//!
//! [`DurableEngine`] is what callers use (start, query, answer, abort, wait).
//! [`SliceExecutor`] is the one piece of real work an engine schedules (run
//! `harness:slice`, kill the agent). [`TurnStore`] persists the JSON state
//! after every step. The [`InProcessEngine`] here loops slices on whatever
//! executor the caller spawns futures on; it resumes unfinished turns from
//! its store after a restart.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use futures::channel::{mpsc, oneshot};
use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};

use crate::log::now_ms;
use crate::sandbox::DetachedProcess;
use crate::stream::AbortSignal;
use crate::turn::{next_step, step, ApprovalAnswer, NextStep, SliceReport, TurnEvent, TurnState};
use crate::{Error, ErrorKind, Result};

/// Runs the real work of a turn.
#[async_trait]
pub trait SliceExecutor: Send + Sync {
    /// Run one slice (`harness:slice`) of at most `budget`. When `abort`
    /// fires the slice returns early with what it has.
    async fn run_slice(
        &self,
        state: &TurnState,
        budget: Duration,
        abort: AbortSignal,
    ) -> Result<SliceReport>;

    /// Kill the agent process of a turn. Idempotent.
    async fn kill_agent(&self, state: &TurnState, process: &DetachedProcess) -> Result<()>;

    /// The turn is over (`state` is terminal): record it where clients see
    /// it. Must be idempotent (an engine may call it again after a crash).
    async fn turn_ended(&self, state: &TurnState) -> Result<()> {
        let _ = state;
        Ok(())
    }
}

/// Persists turn states.
#[async_trait]
pub trait TurnStore: Send + Sync + std::fmt::Debug {
    /// Save (replace) a turn's state.
    async fn save(&self, state: &TurnState) -> Result<()>;
    /// Load a turn's state.
    async fn load(&self, session_id: &str, turn_id: &str) -> Result<Option<TurnState>>;
    /// Turns whose next step is not `Done`.
    async fn unfinished(&self) -> Result<Vec<TurnState>>;
}

/// An engine that runs turns durably.
#[async_trait]
pub trait DurableEngine: Send + Sync + std::fmt::Debug {
    /// Engine name (`in-process`, `temporal`, …).
    fn name(&self) -> &'static str;
    /// Start a turn (its state must be `not_started`).
    async fn start_turn(&self, state: TurnState) -> Result<()>;
    /// The turn's current state.
    async fn turn_state(&self, session_id: &str, turn_id: &str) -> Result<TurnState>;
    /// Answer the turn's pending permission request.
    async fn answer_approval(
        &self,
        session_id: &str,
        turn_id: &str,
        answer: ApprovalAnswer,
    ) -> Result<()>;
    /// Abort the turn.
    async fn abort_turn(&self, session_id: &str, turn_id: &str, reason: &str) -> Result<()>;
    /// Wait until the turn is over; returns its final state.
    async fn wait_turn(&self, session_id: &str, turn_id: &str) -> Result<TurnState>;
}

/// An in-memory [`TurnStore`].
#[derive(Debug, Default, Clone)]
pub struct MemoryTurnStore {
    states: Arc<Mutex<HashMap<(String, String), TurnState>>>,
}

#[async_trait]
impl TurnStore for MemoryTurnStore {
    async fn save(&self, state: &TurnState) -> Result<()> {
        self.states
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(
                (state.session_id.clone(), state.turn_id.clone()),
                state.clone(),
            );
        Ok(())
    }
    async fn load(&self, session_id: &str, turn_id: &str) -> Result<Option<TurnState>> {
        Ok(self
            .states
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&(session_id.to_string(), turn_id.to_string()))
            .cloned())
    }
    async fn unfinished(&self) -> Result<Vec<TurnState>> {
        Ok(self
            .states
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .filter(|s| !matches!(next_step(s), NextStep::Done { .. }))
            .cloned()
            .collect())
    }
}

/// Spawns a future on the caller's runtime (tokio natively, the platform's
/// executor elsewhere).
pub type Spawner = Arc<dyn Fn(BoxFuture<'static, ()>) + Send + Sync>;

struct TurnControl {
    abort: AbortSignal,
    abort_reason: Mutex<Option<String>>,
    approvals: mpsc::UnboundedSender<ApprovalAnswer>,
    waiters: Mutex<Vec<oneshot::Sender<TurnState>>>,
}

type TurnKey = (String, String);

/// Loops slices in this process. See the module docs.
#[derive(Clone)]
pub struct InProcessEngine {
    executor: Arc<dyn SliceExecutor>,
    store: Arc<dyn TurnStore>,
    spawn: Spawner,
    running: Arc<Mutex<HashMap<TurnKey, Arc<TurnControl>>>>,
    /// Kill attempts before a kill failure fails the turn for good.
    max_kill_attempts: u32,
}

impl std::fmt::Debug for InProcessEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InProcessEngine")
            .field("store", &self.store)
            .finish_non_exhaustive()
    }
}

impl InProcessEngine {
    /// An engine running slices on `executor`, saving states in `store`, and
    /// spawning turn loops with `spawn`.
    pub fn new(
        executor: Arc<dyn SliceExecutor>,
        store: Arc<dyn TurnStore>,
        spawn: Spawner,
    ) -> Self {
        Self {
            executor,
            store,
            spawn,
            running: Arc::default(),
            max_kill_attempts: 5,
        }
    }

    /// Pick up every unfinished turn in the store (call once at start-up).
    /// Returns how many were resumed.
    pub async fn resume_unfinished(&self) -> Result<usize> {
        let turns = self.store.unfinished().await?;
        let n = turns.len();
        for state in turns {
            self.launch(state);
        }
        Ok(n)
    }

    fn launch(&self, state: TurnState) {
        let key = (state.session_id.clone(), state.turn_id.clone());
        let (tx, rx) = mpsc::unbounded();
        let control = Arc::new(TurnControl {
            abort: AbortSignal::new(),
            abort_reason: Mutex::new(None),
            approvals: tx,
            waiters: Mutex::new(Vec::new()),
        });
        self.running
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key.clone(), control.clone());
        let engine = self.clone();
        (self.spawn)(Box::pin(async move {
            let result = engine.drive(state, control.clone(), rx).await;
            engine
                .running
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&key);
            let final_state = match result {
                Ok(s) => s,
                Err(e) => {
                    // Persisting failed: leave the last saved state for the
                    // next start-up and report what we have to waiters.
                    tracing_fallback(&e);
                    match engine.store.load(&key.0, &key.1).await {
                        Ok(Some(s)) => s,
                        _ => return,
                    }
                }
            };
            for waiter in control
                .waiters
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .drain(..)
            {
                let _ = waiter.send(final_state.clone());
            }
        }));
    }

    async fn drive(
        &self,
        mut state: TurnState,
        control: Arc<TurnControl>,
        mut approvals: mpsc::UnboundedReceiver<ApprovalAnswer>,
    ) -> Result<TurnState> {
        let mut kill_attempts = 0;
        loop {
            if control.abort.is_aborted() && !state.status.is_terminal() {
                let reason = control
                    .abort_reason
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .clone()
                    .unwrap_or_default();
                state = step(state, TurnEvent::Abort { reason })?.0;
            }
            self.store.save(&state).await?;
            match next_step(&state) {
                NextStep::AwaitStart => {
                    state = step(state, TurnEvent::Start { now_ms: now_ms() })?.0;
                }
                NextStep::RunSlice { budget_ms } => {
                    let report = self
                        .executor
                        .run_slice(
                            &state,
                            Duration::from_millis(budget_ms),
                            control.abort.clone(),
                        )
                        .await;
                    let event = match report {
                        Ok(report) => TurnEvent::SliceCompleted {
                            report,
                            now_ms: now_ms(),
                        },
                        Err(e) => TurnEvent::SliceFailed {
                            retryable: !matches!(
                                e.kind(),
                                ErrorKind::InvalidInput
                                    | ErrorKind::Unsafe
                                    | ErrorKind::Unauthorized
                            ),
                            error: e.to_string(),
                        },
                    };
                    state = match step(state.clone(), event) {
                        Ok((s, _)) => s,
                        // A report the machine refuses (stale cursor) counts as a failed slice.
                        Err(e) => {
                            step(
                                state,
                                TurnEvent::SliceFailed {
                                    error: e.to_string(),
                                    retryable: true,
                                },
                            )?
                            .0
                        }
                    };
                }
                NextStep::KillAgent { process } => {
                    match self.executor.kill_agent(&state, &process).await {
                        Ok(()) => state = step(state, TurnEvent::AgentKilled)?.0,
                        Err(e) => {
                            kill_attempts += 1;
                            if kill_attempts >= self.max_kill_attempts {
                                // Give up on the process (the sandbox may be gone);
                                // the turn is already terminal.
                                let mut s = step(state, TurnEvent::AgentKilled)?.0;
                                s.error = Some(format!(
                                    "{} (and killing the agent failed: {e})",
                                    s.error.unwrap_or_default()
                                ));
                                state = s;
                            }
                        }
                    }
                }
                NextStep::AwaitApproval { .. } => {
                    let abort = control.abort.clone();
                    let answer = futures::select! {
                        answer = approvals.next() => answer,
                        _ = abort.aborted().fuse() => None,
                    };
                    if let Some(answer) = answer {
                        match step(state.clone(), TurnEvent::ApprovalAnswered(answer)) {
                            Ok((s, _)) => state = s,
                            Err(_) => continue, // an answer to another request: ignore it
                        }
                    }
                }
                NextStep::Done { .. } => {
                    // Best effort: the turn is over whatever the sink says; a
                    // failure here is retried by the next start-up's resume only
                    // if the state were unfinished, so report it in the state.
                    if let Err(e) = self.executor.turn_ended(&state).await {
                        state.error = Some(match state.error.take() {
                            Some(prev) => format!("{prev} (and recording the end failed: {e})"),
                            None => format!("recording the end of the turn failed: {e}"),
                        });
                        self.store.save(&state).await?;
                    }
                    return Ok(state);
                }
            }
        }
    }

    fn control(&self, session_id: &str, turn_id: &str) -> Option<Arc<TurnControl>> {
        self.running
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&(session_id.to_string(), turn_id.to_string()))
            .cloned()
    }
}

fn tracing_fallback(_e: &Error) {
    // harness-core has no logging dependency; the engine's callers observe
    // failures through `wait_turn` and the stored state.
}

#[async_trait]
impl DurableEngine for InProcessEngine {
    fn name(&self) -> &'static str {
        "in-process"
    }

    async fn start_turn(&self, state: TurnState) -> Result<()> {
        if self.control(&state.session_id, &state.turn_id).is_some() {
            return Err(Error::conflict(format!(
                "turn {} of session {} is already running",
                state.turn_id, state.session_id
            )));
        }
        if let Some(existing) = self.store.load(&state.session_id, &state.turn_id).await? {
            return Err(Error::conflict(format!(
                "turn {} of session {} already exists ({})",
                state.turn_id,
                state.session_id,
                existing.status.as_str()
            )));
        }
        self.store.save(&state).await?;
        self.launch(state);
        Ok(())
    }

    async fn turn_state(&self, session_id: &str, turn_id: &str) -> Result<TurnState> {
        self.store
            .load(session_id, turn_id)
            .await?
            .ok_or_else(|| Error::not_found(format!("no turn {turn_id} in session {session_id}")))
    }

    async fn answer_approval(
        &self,
        session_id: &str,
        turn_id: &str,
        answer: ApprovalAnswer,
    ) -> Result<()> {
        let control = self
            .control(session_id, turn_id)
            .ok_or_else(|| Error::not_found(format!("turn {turn_id} is not running")))?;
        control
            .approvals
            .unbounded_send(answer)
            .map_err(|_| Error::conflict("the turn has ended"))
    }

    async fn abort_turn(&self, session_id: &str, turn_id: &str, reason: &str) -> Result<()> {
        let control = self
            .control(session_id, turn_id)
            .ok_or_else(|| Error::not_found(format!("turn {turn_id} is not running")))?;
        *control
            .abort_reason
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(reason.to_string());
        control.abort.abort();
        Ok(())
    }

    async fn wait_turn(&self, session_id: &str, turn_id: &str) -> Result<TurnState> {
        let rx = match self.control(session_id, turn_id) {
            Some(control) => {
                let (tx, rx) = oneshot::channel();
                control
                    .waiters
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(tx);
                rx
            }
            None => return self.turn_state(session_id, turn_id).await,
        };
        match rx.await {
            Ok(state) => Ok(state),
            // The loop ended between our lookup and registration.
            Err(_) => self.turn_state(session_id, turn_id).await,
        }
    }
}
