//! [`Runtime`]: a hub of session actors joined to an engine, and the
//! client API over it ([`SessionClient`], [`TurnHandle`]).
//!
//! The path of a prompt, all in this process: a client's prompt reaches
//! the session's actor (through a [`Connection`], or over HTTP in
//! `session-server`) → the actor stores it and dispatches `Start` →
//! [`EngineDispatcher`] performs it on the engine → the engine's slices
//! write parts through [`RunnerSink`] as the session's runner → the actor
//! stores and fans them out → every client sees them. `harness serve`,
//! `harness run` and the embedding API all build this same thing.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use harness_core::actor::{ClientMessage, Role};
use harness_core::broker::ModelBroker;
use harness_core::clock::Clock;
use harness_core::engine::{DurableEngine, InProcessEngine, Spawner, TurnStore};
use harness_core::harness::Harness;
use harness_core::log::{LogInfo, SessionLog};
use harness_core::sandbox::SandboxProvider;
use harness_core::session::{SessionConfig, SessionRuntime};
use harness_core::slice::{PartSink, SliceRunner};
use harness_core::turn::{TurnConfig, TurnStatus};
use harness_core::turn_checkpoint::TurnCheckpoints;
use harness_core::{Error, Result, SessionId};

use crate::dispatch::EngineDispatcher;
use crate::follow::{TurnFollower, TurnUpdate};
use crate::hub::{Acked, Connection, Hub, HubConfig};
use crate::runner::{HubConnector, RunnerSink};
use crate::SystemClock;

/// How long a client write waits for the actor's answer.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(30);

/// Spawns on the current tokio runtime.
pub fn tokio_spawner() -> Spawner {
    Arc::new(|f| {
        tokio::spawn(f);
    })
}

/// Sleeps on the current tokio runtime.
pub fn tokio_sleeper() -> harness_core::slice::Sleeper {
    Arc::new(|d| Box::pin(tokio::time::sleep(d)))
}

/// Which engine runs turns.
#[derive(Debug)]
pub enum EngineChoice {
    /// The in-process engine, its states in `store`; slices run here and
    /// write through the hub.
    InProcess {
        /// Where turn states are saved between steps.
        store: Arc<dyn TurnStore>,
    },
    /// Another engine (e.g. a Temporal client); its slices run elsewhere
    /// and write over the runner WebSocket.
    External(Arc<dyn DurableEngine>),
}

/// Wraps the runner sink (e.g. to print parts as the engine emits them).
type WrapSink = Box<dyn FnOnce(Arc<dyn PartSink>) -> Arc<dyn PartSink> + Send>;

/// Builds a [`Runtime`].
pub struct RuntimeBuilder {
    log: Arc<dyn SessionLog>,
    hub: HubConfig,
    providers: BTreeMap<String, Arc<dyn SandboxProvider>>,
    harnesses: BTreeMap<String, Arc<dyn Harness>>,
    env: BTreeMap<String, String>,
    broker: Option<Arc<dyn ModelBroker>>,
    model: Option<String>,
    turn: TurnConfig,
    engine: Option<EngineChoice>,
    generation: Option<u64>,
    clock: Arc<dyn Clock>,
    poll_interval: Duration,
    wrap_sink: Option<WrapSink>,
    checkpoints: Option<Arc<dyn TurnCheckpoints>>,
}

impl std::fmt::Debug for RuntimeBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RuntimeBuilder")
            .field("log", &self.log)
            .field("providers", &self.providers.keys().collect::<Vec<_>>())
            .field("harnesses", &self.harnesses.keys().collect::<Vec<_>>())
            .field("engine", &self.engine)
            .finish_non_exhaustive()
    }
}

impl RuntimeBuilder {
    /// Offer sandboxes of `provider` (under its name: `local`, `docker`, …).
    pub fn provider(mut self, provider: Arc<dyn SandboxProvider>) -> Self {
        self.providers.insert(provider.name().to_string(), provider);
        self
    }

    /// Run agents with `harness` (under its name: `claude-code`, `codex`).
    pub fn agent(mut self, harness: Arc<dyn Harness>) -> Self {
        self.harnesses.insert(harness.name().to_string(), harness);
        self
    }

    /// Environment every agent gets (API keys, base URLs).
    pub fn env(mut self, env: BTreeMap<String, String>) -> Self {
        self.env = env;
        self
    }

    /// Reach the model through `broker`: sandboxes get its forwards and
    /// agents a session token instead of the credentials in [`env`](Self::env)
    /// (see `harness_core::broker`). Without one, agents get `env` as it is,
    /// keys included.
    pub fn broker(mut self, broker: Option<Arc<dyn ModelBroker>>) -> Self {
        self.broker = broker;
        self
    }

    /// The default model for sessions that name none.
    pub fn model(mut self, model: Option<String>) -> Self {
        self.model = model;
        self
    }

    /// Turn budgets (slice length, turn length, retries).
    pub fn turn_config(mut self, config: TurnConfig) -> Self {
        self.turn = config;
        self
    }

    /// Actor limits and idle timeout.
    pub fn hub_config(mut self, config: HubConfig) -> Self {
        self.hub = config;
        self
    }

    /// The engine (default: in-process with its states in memory).
    pub fn engine(mut self, engine: EngineChoice) -> Self {
        self.engine = Some(engine);
        self
    }

    /// The runner generation of this process (default: the clock's time at
    /// build, which grows across restarts).
    pub fn generation(mut self, generation: u64) -> Self {
        self.generation = Some(generation);
        self
    }

    /// The clock of the engine, the slices and the hub's actors (default:
    /// the system clock; it replaces the one in [`hub_config`](Self::hub_config)).
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// How often a slice looks at the agent's spool (default 150 ms).
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.poll_interval = interval;
        self
    }

    /// Take a checkpoint of the tree and the agent's state at every turn's
    /// end into `checkpoints`, and make sandboxes from them after a fork, a
    /// rewind or a lost sandbox (see `harness_core::turn_checkpoint`).
    /// Without it, sessions run with no checkpoints.
    pub fn checkpoints(mut self, checkpoints: Option<Arc<dyn TurnCheckpoints>>) -> Self {
        self.checkpoints = checkpoints;
        self
    }

    /// Wrap the runner sink (e.g. to print parts as the engine emits them).
    pub fn wrap_sink(
        mut self,
        wrap: impl FnOnce(Arc<dyn PartSink>) -> Arc<dyn PartSink> + Send + 'static,
    ) -> Self {
        self.wrap_sink = Some(Box::new(wrap));
        self
    }

    /// Assemble the runtime (no I/O yet; call [`Runtime::start`]). Needs a
    /// tokio runtime.
    pub fn build(self) -> Runtime {
        let hub = Hub::new(
            self.log.clone(),
            HubConfig {
                clock: self.clock.clone(),
                ..self.hub
            },
        );
        // A deleted session's sandbox is removed with the providers that
        // made it (those this process runs).
        hub.set_sandbox_providers(self.providers.clone());
        let generation = self.generation.unwrap_or_else(|| self.clock.now_ms());
        let (engine, in_process): (Arc<dyn DurableEngine>, _) =
            match self.engine.unwrap_or(EngineChoice::InProcess {
                store: Arc::new(harness_core::engine::MemoryTurnStore::default()),
            }) {
                EngineChoice::InProcess { store } => {
                    let sink: Arc<dyn PartSink> = Arc::new(RunnerSink::new(
                        Arc::new(HubConnector::new(hub.clone())),
                        generation,
                    ));
                    let sink = match self.wrap_sink {
                        Some(wrap) => wrap(sink),
                        None => sink,
                    };
                    let runner = SliceRunner {
                        providers: self.providers,
                        harnesses: self.harnesses,
                        sink,
                        env: self.env,
                        broker: self.broker,
                        model: self.model,
                        poll_interval: self.poll_interval,
                        sleep: tokio_sleeper(),
                        clock: self.clock.clone(),
                        checkpoints: self.checkpoints,
                    };
                    let engine =
                        InProcessEngine::new(Arc::new(runner), store, self.clock, tokio_spawner())
                            .with_generation(generation);
                    (Arc::new(engine.clone()), Some(engine))
                }
                EngineChoice::External(engine) => (engine, None),
            };
        let runtime = SessionRuntime::new(engine.clone()).with_turn_config(self.turn);
        let dispatcher = EngineDispatcher::new(runtime, &hub);
        hub.set_dispatcher(Arc::new(dispatcher));
        Runtime {
            hub,
            engine,
            in_process,
            generation,
        }
    }
}

/// What [`Runtime::start`] picked up.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Started {
    /// Turns the in-process engine resumed from its store.
    pub resumed: usize,
    /// Sessions whose running turn's commands were dispatched again.
    pub redispatched: usize,
}

/// The session runtime. See the module docs.
#[derive(Debug, Clone)]
pub struct Runtime {
    hub: Arc<Hub>,
    engine: Arc<dyn DurableEngine>,
    in_process: Option<InProcessEngine>,
    generation: u64,
}

impl Runtime {
    /// Start building a runtime over `log`.
    pub fn builder(log: Arc<dyn SessionLog>) -> RuntimeBuilder {
        RuntimeBuilder {
            log,
            hub: HubConfig::default(),
            providers: BTreeMap::new(),
            harnesses: BTreeMap::new(),
            env: BTreeMap::new(),
            broker: None,
            model: None,
            turn: TurnConfig::default(),
            engine: None,
            generation: None,
            clock: Arc::new(SystemClock),
            poll_interval: Duration::from_millis(150),
            wrap_sink: None,
            checkpoints: None,
        }
    }

    /// The hub of session actors (what a server connects clients to).
    pub fn hub(&self) -> &Arc<Hub> {
        &self.hub
    }

    /// The engine.
    pub fn engine(&self) -> &Arc<dyn DurableEngine> {
        &self.engine
    }

    /// The runner generation of this process.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Pick up where an earlier process left off: the in-process engine
    /// resumes its unfinished turns, then every session whose log shows a
    /// running turn has its commands dispatched again (all idempotent: a
    /// prompt stored just before a crash starts now, an answer given then
    /// reaches the turn).
    pub async fn start(&self) -> Result<Started> {
        let resumed = match &self.in_process {
            Some(engine) => engine.resume_unfinished().await?,
            None => 0,
        };
        let mut redispatched = 0;
        // With several nodes, a session's pending commands are re-sent by
        // the node that takes its lease over, not by every node at start;
        // sessions a dead node left are found by the orphan sweep.
        let sessions = match self.hub.config().leases {
            Some(_) => {
                self.hub.sweep_orphans();
                Vec::new()
            }
            None => self.hub.log().list().await?,
        };
        for info in sessions {
            let commands = info.meta.pending_commands();
            if commands.is_empty() || info.sealed {
                continue;
            }
            redispatched += 1;
            for command in commands {
                self.hub.dispatch(&info.session, command);
            }
        }
        Ok(Started {
            resumed,
            redispatched,
        })
    }

    /// Create a session running `config` (a generated id when `id` is None).
    pub async fn create_session(
        &self,
        id: Option<SessionId>,
        config: SessionConfig,
    ) -> Result<SessionClient> {
        let id = match id {
            Some(id) => id,
            None => SessionId::parse(format!(
                "s-{}",
                &uuid::Uuid::new_v4().simple().to_string()[..12]
            ))?,
        };
        let info = self
            .hub
            .log()
            .create_with(&id, Some(config.clone()))
            .await?;
        if let Some(existing) = &info.meta.config {
            if *existing != config {
                return Err(Error::conflict(format!(
                    "session {id} already exists with another configuration ({} in {})",
                    existing.agent, existing.sandbox.provider
                )));
            }
        }
        Ok(SessionClient {
            hub: self.hub.clone(),
            id,
        })
    }

    /// An existing session (`NotFound` otherwise): resume it from its id.
    pub async fn session(&self, id: &SessionId) -> Result<SessionClient> {
        self.hub.log().info(id).await?;
        Ok(SessionClient {
            hub: self.hub.clone(),
            id: id.clone(),
        })
    }
}

/// A client of one session, in this process. Cheap to clone; dropping it
/// leaves the session (and its sandbox) as they are.
#[derive(Debug, Clone)]
pub struct SessionClient {
    hub: Arc<Hub>,
    id: SessionId,
}

impl SessionClient {
    /// The session id: keep it to resume later ([`Runtime::session`]).
    pub fn id(&self) -> &SessionId {
        &self.id
    }

    /// The log's view of the session (config, running turn, sandbox).
    pub async fn info(&self) -> Result<LogInfo> {
        self.hub.log().info(&self.id).await
    }

    async fn send(&self, message: ClientMessage) -> Result<(Connection, Acked)> {
        let mut conn = self.hub.connect(&self.id, Role::Client, None).await?;
        conn.client(message);
        let acked = conn.answer(ANSWER_TIMEOUT).await?;
        Ok((conn, acked))
    }

    /// Send a prompt; its turn starts on the runtime's engine. The handle
    /// streams the turn's parts.
    pub async fn prompt(&self, text: impl Into<String>) -> Result<TurnHandle> {
        let message = ClientMessage::Prompt {
            text: text.into(),
            turn_id: None,
            key: None,
        };
        let (conn, acked) = self.send(message).await?;
        let turn_id = acked.turn_id.ok_or_else(|| {
            Error::backend(format!(
                "the session acknowledged the prompt (seq {}) without the turn it opened",
                acked.seq
            ))
        })?;
        Ok(TurnHandle {
            follower: TurnFollower::new(turn_id),
            conn,
            queued: VecDeque::new(),
        })
    }

    /// Follow `turn_id` (a turn already running) from the frames after
    /// seq `after` on: pass the `last_seq` read together with the turn's
    /// state, so an end stored in between is not missed.
    pub async fn follow(&self, turn_id: impl Into<String>, after: u64) -> Result<TurnHandle> {
        let conn = self
            .hub
            .connect(&self.id, Role::Client, Some(after))
            .await?;
        Ok(TurnHandle {
            follower: TurnFollower::new(turn_id),
            conn,
            queued: VecDeque::new(),
        })
    }

    /// Answer the running turn's permission request.
    pub async fn answer(
        &self,
        approval_id: impl Into<String>,
        approved: bool,
        reason: Option<String>,
    ) -> Result<()> {
        let message = ClientMessage::ApprovalResponse {
            approval_id: approval_id.into(),
            approved,
            reason,
        };
        self.send(message).await.map(|_| ())
    }

    /// Abort the running turn.
    pub async fn abort(&self, reason: impl Into<String>) -> Result<()> {
        let message = ClientMessage::Abort {
            turn_id: None,
            reason: Some(reason.into()),
        };
        self.send(message).await.map(|_| ())
    }
}

/// One turn, as it happens.
#[derive(Debug)]
pub struct TurnHandle {
    follower: TurnFollower,
    conn: Connection,
    queued: VecDeque<TurnUpdate>,
}

/// How a turn ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TurnOutcome {
    /// The turn.
    pub turn_id: String,
    /// `finished`, `failed` or `timed_out`.
    pub status: TurnStatus,
    /// Why it failed.
    pub error: Option<String>,
    /// The assistant's text.
    pub text: String,
}

impl TurnHandle {
    /// The turn id.
    pub fn turn_id(&self) -> &str {
        self.follower.turn_id()
    }

    /// The next part or the end; `None` after the end.
    pub async fn next(&mut self) -> Option<TurnUpdate> {
        loop {
            if let Some(update) = self.queued.pop_front() {
                return Some(update);
            }
            if self.follower.is_ended() {
                return None;
            }
            match self.conn.recv().await?.into_message() {
                Ok(message) => self.queued.extend(self.follower.push(&message)),
                Err(_) => return None,
            }
        }
    }

    /// Wait for the end, dropping the parts.
    pub async fn finish(mut self) -> Result<TurnOutcome> {
        while let Some(update) = self.next().await {
            if let TurnUpdate::Ended { status, error } = update {
                return Ok(TurnOutcome {
                    turn_id: self.follower.turn_id().to_string(),
                    status,
                    error,
                    text: self.follower.text().to_string(),
                });
            }
        }
        Err(Error::backend(format!(
            "the session stopped before turn {} ended",
            self.follower.turn_id()
        )))
    }
}
