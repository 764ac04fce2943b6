//! Durable engines: who runs the slices of a turn, and where the state lives
//! between them.
//!
//! [`DurableEngine`] is what callers use (start, query, answer, abort, wait).
//! [`SliceExecutor`] is the real work an engine schedules (create the
//! sandbox, run `harness:slice`, kill the agent, record the end).
//! [`TurnStore`] persists the JSON state after every step. The
//! [`InProcessEngine`] here drives [`TurnDriver`] (the one turn loop, shared
//! with every engine) on whatever executor the caller spawns futures on; it
//! resumes unfinished turns from its store after a restart.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use futures::channel::{mpsc, oneshot};
use futures::{FutureExt, StreamExt};
use tracing::Instrument;

use crate::clock::Clock;
use crate::maybe::{BoxFuture, MaybeSend, MaybeSync};
use crate::sandbox::{DetachedProcess, SandboxHandle};
use crate::stream::AbortSignal;
use crate::turn::{next_step, ApprovalAnswer, NextStep, SliceReport, TurnState};
use crate::turn_driver::{StepFailure, TurnAction, TurnDriver};
use crate::{Error, Result};

/// Runs the real work of a turn.
#[cfg_attr(not(target_arch = "wasm32"), async_trait)]
#[cfg_attr(target_arch = "wasm32", async_trait(?Send))]
pub trait SliceExecutor: MaybeSend + MaybeSync {
    /// Create the session's sandbox from the state's `sandbox_config` (the
    /// first turn of a session) and return its handle, detached.
    async fn create_sandbox(&self, state: &TurnState) -> Result<SandboxHandle>;

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
    /// it. Idempotent (an engine calls it again after a crash; the record
    /// carries [`TurnState::status_key`]).
    async fn turn_ended(&self, state: &TurnState) -> Result<()>;
}

/// Persists turn states.
///
/// Saves are fenced: each carries the saving engine's generation, and a
/// store refuses (with `ErrorKind::Fenced`) a save of a turn last saved by
/// a higher generation, so an engine that was replaced while it ran (a
/// paused process that wakes up) cannot overwrite its successor's state.
#[cfg_attr(not(target_arch = "wasm32"), async_trait)]
#[cfg_attr(target_arch = "wasm32", async_trait(?Send))]
pub trait TurnStore: MaybeSend + MaybeSync + std::fmt::Debug {
    /// Save (replace) a turn's state as engine `generation`.
    async fn save(&self, state: &TurnState, generation: u64) -> Result<()>;
    /// Load a turn's state.
    async fn load(&self, session_id: &str, turn_id: &str) -> Result<Option<TurnState>>;
    /// Turns whose next step is not `Done`.
    async fn unfinished(&self) -> Result<Vec<TurnState>>;
}

/// An engine that runs turns durably.
#[cfg_attr(not(target_arch = "wasm32"), async_trait)]
#[cfg_attr(target_arch = "wasm32", async_trait(?Send))]
pub trait DurableEngine: MaybeSend + MaybeSync + std::fmt::Debug {
    /// Engine name (`in-process`, `temporal`, …).
    fn name(&self) -> &'static str;
    /// Start a turn (its state must be `not_started`); `Conflict` when the
    /// turn id is already known.
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

/// A stored turn state read back: `Corrupt` when it does not decode.
pub fn decode_turn_state(json: &str) -> Result<TurnState> {
    serde_json::from_str(json)
        .map_err(|e| crate::Error::corrupt(format!("stored turn state is unreadable: {e}")))
}

/// The error for a save refused because a newer engine owns the turn.
pub fn fenced_save_error(state: &TurnState, stored: u64, generation: u64) -> Error {
    Error::fenced(format!(
        "turn {} of session {} is driven by engine generation {stored}; generation {generation} stops",
        state.turn_id, state.session_id
    ))
}

type TurnKey = (String, String);

/// An in-memory [`TurnStore`].
#[derive(Debug, Default, Clone)]
pub struct MemoryTurnStore {
    states: Arc<Mutex<HashMap<TurnKey, (TurnState, u64)>>>,
}

#[cfg_attr(not(target_arch = "wasm32"), async_trait)]
#[cfg_attr(target_arch = "wasm32", async_trait(?Send))]
impl TurnStore for MemoryTurnStore {
    async fn save(&self, state: &TurnState, generation: u64) -> Result<()> {
        let mut states = self.states.lock().unwrap_or_else(|e| e.into_inner());
        let key = (state.session_id.clone(), state.turn_id.clone());
        if let Some((_, stored)) = states.get(&key) {
            if *stored > generation {
                return Err(fenced_save_error(state, *stored, generation));
            }
        }
        states.insert(key, (state.clone(), generation));
        Ok(())
    }
    async fn load(&self, session_id: &str, turn_id: &str) -> Result<Option<TurnState>> {
        Ok(self
            .states
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&(session_id.to_string(), turn_id.to_string()))
            .map(|(s, _)| s.clone()))
    }
    async fn unfinished(&self) -> Result<Vec<TurnState>> {
        Ok(self
            .states
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .filter(|(s, _)| !matches!(next_step(s), NextStep::Done { .. }))
            .map(|(s, _)| s.clone())
            .collect())
    }
}

/// Spawns a future on the caller's runtime (tokio natively, the platform's
/// executor elsewhere).
#[cfg(not(target_arch = "wasm32"))]
pub type Spawner = Arc<dyn Fn(BoxFuture<'static, ()>) + Send + Sync>;
/// Spawns a future on the caller's runtime (the platform's executor).
#[cfg(target_arch = "wasm32")]
pub type Spawner = Arc<dyn Fn(BoxFuture<'static, ()>)>;

/// What a running turn's loop receives from callers.
#[derive(Debug, Default)]
struct Inbox {
    abort: Option<String>,
    answers: Vec<ApprovalAnswer>,
}

struct TurnControl {
    /// Cuts a running slice short.
    abort: AbortSignal,
    inbox: Mutex<Inbox>,
    /// Wakes a loop parked on [`TurnAction::AwaitInput`].
    wake: mpsc::UnboundedSender<()>,
    waiters: Mutex<Vec<oneshot::Sender<Result<TurnState>>>>,
}

impl TurnControl {
    /// Hand what callers sent to the driver.
    fn drain_into(&self, driver: &mut TurnDriver) {
        let mut inbox = self.inbox.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(reason) = inbox.abort.take() {
            driver.abort(reason);
        }
        for answer in inbox.answers.drain(..) {
            driver.answer(answer);
        }
    }
}

/// Drives turns in this process with [`TurnDriver`]. See the module docs.
#[derive(Clone)]
pub struct InProcessEngine {
    executor: Arc<dyn SliceExecutor>,
    store: Arc<dyn TurnStore>,
    clock: Arc<dyn Clock>,
    spawn: Spawner,
    generation: u64,
    running: Arc<Mutex<HashMap<TurnKey, Arc<TurnControl>>>>,
}

impl std::fmt::Debug for InProcessEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InProcessEngine")
            .field("store", &self.store)
            .field("generation", &self.generation)
            .finish_non_exhaustive()
    }
}

impl InProcessEngine {
    /// An engine running slices on `executor`, saving states in `store`,
    /// reading time from `clock` and spawning turn loops with `spawn`.
    pub fn new(
        executor: Arc<dyn SliceExecutor>,
        store: Arc<dyn TurnStore>,
        clock: Arc<dyn Clock>,
        spawn: Spawner,
    ) -> Self {
        Self {
            executor,
            store,
            clock,
            spawn,
            generation: 0,
            running: Arc::default(),
        }
    }

    /// Save turn states as `generation` (use something that grows across
    /// restarts, e.g. the start time): a store then refuses the saves of an
    /// older engine still running somewhere, which stops its turns.
    pub fn with_generation(mut self, generation: u64) -> Self {
        self.generation = generation;
        self
    }

    /// The generation this engine saves as.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Pick up every unfinished turn in the store (call once at start-up).
    /// Returns how many were resumed.
    pub async fn resume_unfinished(&self) -> Result<usize> {
        let turns = self.store.unfinished().await?;
        let mut n = 0;
        for state in turns {
            if self.control(&state.session_id, &state.turn_id).is_none() {
                self.launch(state);
                n += 1;
            }
        }
        Ok(n)
    }

    fn launch(&self, state: TurnState) {
        let key = (state.session_id.clone(), state.turn_id.clone());
        let (wake, wake_rx) = mpsc::unbounded();
        let control = Arc::new(TurnControl {
            abort: AbortSignal::new(),
            inbox: Mutex::default(),
            wake,
            waiters: Mutex::new(Vec::new()),
        });
        self.running
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key.clone(), control.clone());
        let engine = self.clone();
        // The turn's root in a trace: a child of the `session` span that
        // started it (or a root, for a turn resumed after a restart).
        let turn_span = tracing::info_span!(
            "turn",
            session.id = %state.session_id,
            turn.id = %state.turn_id,
            agent = %state.agent,
            engine = "in-process",
            generation = self.generation,
            status = tracing::field::Empty,
            slices = tracing::field::Empty,
        );
        (self.spawn)(Box::pin(async move {
            let result = engine
                .drive(state, control.clone(), wake_rx)
                .instrument(turn_span.clone())
                .await;
            match &result {
                Ok(state) => {
                    turn_span.record("status", state.status.as_str());
                    turn_span.record("slices", state.slices_run);
                }
                Err(e) => {
                    turn_span.record("status", "stopped");
                    turn_span.in_scope(|| tracing::warn!(error = %e, "the turn loop stopped"));
                }
            }
            drop(turn_span);
            engine
                .running
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&key);
            let waiters: Vec<_> = control
                .waiters
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .drain(..)
                .collect();
            for waiter in waiters {
                let answer = match &result {
                    Ok(state) => Ok(state.clone()),
                    Err(e) => Err(Error::new(e.kind(), e.message())),
                };
                let _ = waiter.send(answer);
            }
        }));
    }

    /// The turn loop: [`TurnDriver`] with this engine's I/O.
    async fn drive(
        &self,
        state: TurnState,
        control: Arc<TurnControl>,
        mut wake: mpsc::UnboundedReceiver<()>,
    ) -> Result<TurnState> {
        let mut driver = TurnDriver::new(state)?;
        let failure = |e: Error| StepFailure::from_error(&e);
        loop {
            control.drain_into(&mut driver);
            let action = driver.poll(self.clock.now_ms());
            if action == TurnAction::Stop {
                // Fenced: a newer runner drives this turn; touch nothing.
                let why = driver.fenced().unwrap_or("fenced").to_string();
                return Err(Error::fenced(why));
            }
            self.store.save(driver.state(), self.generation).await?;
            let state = driver.state().clone();
            match action {
                TurnAction::CreateSandbox => {
                    let result = self.executor.create_sandbox(&state).await;
                    driver.sandbox_created(result.map_err(failure));
                }
                TurnAction::RunSlice { budget_ms } => {
                    let budget = Duration::from_millis(budget_ms);
                    let result = self
                        .executor
                        .run_slice(&state, budget, control.abort.clone())
                        .await;
                    driver.slice_done(result.map_err(failure), self.clock.now_ms());
                }
                TurnAction::KillAgent { process } => {
                    let result = self.executor.kill_agent(&state, &process).await;
                    driver.agent_killed(result.map_err(failure));
                }
                TurnAction::RecordEnd => {
                    let result = self.executor.turn_ended(&state).await;
                    driver.end_recorded(result.map_err(failure));
                }
                TurnAction::AwaitInput => {
                    futures::select! {
                        _ = wake.next() => {},
                        _ = control.abort.aborted().fuse() => {},
                    }
                }
                TurnAction::Done => return Ok(driver.into_state()),
                TurnAction::Stop => unreachable!("handled above"),
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

    fn running_control(&self, session_id: &str, turn_id: &str) -> Result<Arc<TurnControl>> {
        self.control(session_id, turn_id).ok_or_else(|| {
            Error::not_found(format!(
                "turn {turn_id} of session {session_id} is not running"
            ))
        })
    }
}

#[cfg_attr(not(target_arch = "wasm32"), async_trait)]
#[cfg_attr(target_arch = "wasm32", async_trait(?Send))]
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
        TurnDriver::new(state.clone())?;
        self.store.save(&state, self.generation).await?;
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
        let control = self.running_control(session_id, turn_id)?;
        control
            .inbox
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .answers
            .push(answer);
        let _ = control.wake.unbounded_send(());
        Ok(())
    }

    async fn abort_turn(&self, session_id: &str, turn_id: &str, reason: &str) -> Result<()> {
        let control = self.running_control(session_id, turn_id)?;
        control
            .inbox
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .abort
            .get_or_insert_with(|| reason.to_string());
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
            Ok(result) => result,
            // The loop ended between our lookup and registration.
            Err(_) => self.turn_state(session_id, turn_id).await,
        }
    }
}
