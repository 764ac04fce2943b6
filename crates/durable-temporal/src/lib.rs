//! A [`DurableEngine`] on Temporal: one workflow per turn (`harness_turn`),
//! one activity per slice (`harness:slice`).
//!
//! - [`TemporalEngine`] is the client side: start a turn, query its state,
//!   signal approvals and aborts, wait for the result.
//! - [`TurnWorker`] / [`run_worker`] is the worker side: it runs the
//!   workflow code and the activities, which do the real work through a
//!   [`SliceExecutor`] — in practice a `SliceRunner` (sandbox providers,
//!   agent adapters, and a sink writing as the session's runner, e.g. over
//!   the runner WebSocket of `harness serve`).
//!
//! The Temporal worker future is not `Send`: run it on the main task of a
//! `#[tokio::main]` (or `block_on`) or inside a [`tokio::task::LocalSet`],
//! never with `tokio::spawn`. See `docs/durable-temporal.md`.

use std::time::Duration;

use async_trait::async_trait;
use temporalio_client::errors::{
    WorkflowGetResultError, WorkflowInteractionError, WorkflowQueryError, WorkflowStartError,
};
use temporalio_client::{
    Client, ClientOptions, Connection, ConnectionOptions, Url, WorkflowDescribeOptions,
    WorkflowExecutionStatus, WorkflowGetResultOptions, WorkflowIdReusePolicy, WorkflowQueryOptions,
    WorkflowSignalOptions, WorkflowStartOptions,
};
use temporalio_sdk::{Runtime, Worker, WorkerOptions};

use std::sync::Arc;

use harness_core::engine::{DurableEngine, SliceExecutor};
use harness_core::turn::{ApprovalAnswer, TurnState, TurnStatus};
use harness_core::{Error, Result};

// The SDK's macros generate marker types (one per activity, signal and query)
// that do not implement Debug.
#[allow(missing_debug_implementations)]
pub mod workflow;

pub use workflow::{
    AbortRequest, ActivityTuning, HarnessTurnWorkflow, KillInput, SliceInput, TurnActivities,
    TurnWorkflowInput, CREATE_SANDBOX_ACTIVITY, KILL_ACTIVITY, RECORD_END_ACTIVITY, SLICE_ACTIVITY,
    WORKFLOW_TYPE,
};

/// Default server address (the dev server of `cargo xtask services start`).
pub const DEFAULT_ADDRESS: &str = "127.0.0.1:7233";
/// Default task queue.
pub const DEFAULT_TASK_QUEUE: &str = "harness-turns";

/// Where the server is and how turns are scheduled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TemporalConfig {
    /// `host:port` or an `http(s)://` URL of the frontend.
    pub address: String,
    /// Namespace.
    pub namespace: String,
    /// Task queue the workflows and activities run on.
    pub task_queue: String,
    /// Activity timeouts, heartbeats and retries (sent with every turn).
    pub tuning: ActivityTuning,
}

impl Default for TemporalConfig {
    fn default() -> Self {
        Self {
            address: DEFAULT_ADDRESS.into(),
            namespace: "default".into(),
            task_queue: DEFAULT_TASK_QUEUE.into(),
            tuning: ActivityTuning::default(),
        }
    }
}

impl TemporalConfig {
    /// Defaults overridden by `HARNESS_TEMPORAL_ADDRESS`,
    /// `HARNESS_TEMPORAL_NAMESPACE`, `HARNESS_TEMPORAL_TASK_QUEUE`, and for
    /// the activities `HARNESS_TEMPORAL_HEARTBEAT_TIMEOUT_MS` (how soon a
    /// dead worker's slice moves to another worker) and
    /// `HARNESS_TEMPORAL_RETRY_INITIAL_MS`. Tuning is read where turns are
    /// started (it travels in the workflow input).
    pub fn from_env() -> Self {
        let mut config = Self::default();
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
        if let Some(address) = var("HARNESS_TEMPORAL_ADDRESS") {
            config.address = address;
        }
        if let Some(namespace) = var("HARNESS_TEMPORAL_NAMESPACE") {
            config.namespace = namespace;
        }
        if let Some(queue) = var("HARNESS_TEMPORAL_TASK_QUEUE") {
            config.task_queue = queue;
        }
        let ms = |name: &str| var(name).and_then(|v| v.parse::<u64>().ok());
        if let Some(ms) = ms("HARNESS_TEMPORAL_HEARTBEAT_TIMEOUT_MS") {
            config.tuning.heartbeat_timeout_ms = ms;
        }
        if let Some(ms) = ms("HARNESS_TEMPORAL_RETRY_INITIAL_MS") {
            config.tuning.retry_initial_interval_ms = ms;
        }
        config
    }

    /// The address as a URL (`http://` is assumed without a scheme).
    pub fn url(&self) -> Result<Url> {
        let address = self.address.trim();
        let text = if address.contains("://") {
            address.to_string()
        } else {
            format!("http://{address}")
        };
        Url::parse(&text)
            .map_err(|e| Error::invalid(format!("bad Temporal address {:?}: {e}", self.address)))
    }
}

/// The workflow id of a turn: `harness-<session>-<turn>`.
pub fn workflow_id(session_id: &str, turn_id: &str) -> String {
    format!("harness-{session_id}-{turn_id}")
}

/// Connect a client to the configured server and namespace.
pub async fn connect(config: &TemporalConfig) -> Result<Client> {
    let options = ConnectionOptions::new(config.url()?)
        .identity(format!("harness-{}", std::process::id()))
        .build();
    let connection = Connection::connect(options).await.map_err(|e| {
        Error::backend(format!(
            "cannot connect to Temporal at {}: {e}",
            config.address
        ))
    })?;
    Client::new(
        connection,
        ClientOptions::new(config.namespace.clone()).build(),
    )
    .map_err(|e| Error::backend(format!("cannot create a Temporal client: {e}")))
}

/// Whether a Temporal frontend answers at `config.address` within
/// `timeout` (used by tests and examples to skip cleanly).
pub async fn server_reachable(config: &TemporalConfig, timeout: Duration) -> bool {
    matches!(
        tokio::time::timeout(timeout, connect(config)).await,
        Ok(Ok(_))
    )
}

/// The client side of the engine. See the crate docs.
#[derive(Clone)]
pub struct TemporalEngine {
    client: Client,
    config: TemporalConfig,
}

impl std::fmt::Debug for TemporalEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TemporalEngine")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl TemporalEngine {
    /// Connect to the configured server.
    pub async fn connect(config: TemporalConfig) -> Result<Self> {
        let client = connect(&config).await?;
        Ok(Self { client, config })
    }

    /// The configuration.
    pub fn config(&self) -> &TemporalConfig {
        &self.config
    }

    /// The underlying Temporal client.
    pub fn client(&self) -> &Client {
        &self.client
    }

    fn handle(
        &self,
        session_id: &str,
        turn_id: &str,
    ) -> temporalio_client::WorkflowHandle<Client, HarnessTurnWorkflow> {
        self.client
            .get_workflow_handle::<HarnessTurnWorkflow>(workflow_id(session_id, turn_id))
    }

    async fn result(&self, session_id: &str, turn_id: &str) -> Result<TurnState> {
        self.handle(session_id, turn_id)
            .get_result(WorkflowGetResultOptions::default())
            .await
            .map_err(|e| match e {
                WorkflowGetResultError::NotFound(_) => {
                    Error::not_found(format!("no turn {turn_id} in session {session_id}"))
                }
                e => Error::backend(format!(
                    "turn {turn_id} of session {session_id} ended without a state: {e}"
                )),
            })
    }
}

fn interaction_error(session_id: &str, turn_id: &str, e: WorkflowInteractionError) -> Error {
    let text = e.to_string();
    let not_found = matches!(&e, WorkflowInteractionError::NotFound(_))
        || text.contains("not found")
        || text.contains("already completed");
    if not_found {
        Error::not_found(format!(
            "turn {turn_id} of session {session_id} is not running: {text}"
        ))
    } else {
        Error::backend(format!("turn {turn_id} of session {session_id}: {text}"))
    }
}

#[async_trait]
impl DurableEngine for TemporalEngine {
    fn name(&self) -> &'static str {
        "temporal"
    }

    async fn start_turn(&self, state: TurnState) -> Result<()> {
        if state.status != TurnStatus::NotStarted {
            return Err(Error::invalid(format!(
                "turn {} is {}, only a not_started turn can be started",
                state.turn_id,
                state.status.as_str()
            )));
        }
        let id = workflow_id(&state.session_id, &state.turn_id);
        let options = WorkflowStartOptions::new(self.config.task_queue.clone(), id.clone())
            .id_reuse_policy(WorkflowIdReusePolicy::RejectDuplicate)
            .build();
        let input = TurnWorkflowInput {
            driver: harness_core::turn_driver::TurnDriver::new(state)?,
            tuning: self.config.tuning.clone(),
        };
        self.client
            .start_workflow(HarnessTurnWorkflow::run, input, options)
            .await
            .map_err(|e| match e {
                WorkflowStartError::AlreadyStarted { .. } => {
                    Error::conflict(format!("workflow {id} already exists"))
                }
                e => Error::backend(format!("starting workflow {id}: {e}")),
            })?;
        Ok(())
    }

    async fn turn_state(&self, session_id: &str, turn_id: &str) -> Result<TurnState> {
        let handle = self.handle(session_id, turn_id);
        // A closed workflow answers queries only by being replayed on a
        // worker (and waits ~30 s when none polls): its result is the final
        // state, so read that instead.
        let description = handle
            .describe(WorkflowDescribeOptions::default())
            .await
            .map_err(|e| interaction_error(session_id, turn_id, e))?;
        if description.status() != WorkflowExecutionStatus::Running {
            return self.result(session_id, turn_id).await;
        }
        match handle
            .query(
                HarnessTurnWorkflow::query_state,
                (),
                WorkflowQueryOptions::default(),
            )
            .await
        {
            Ok(state) => Ok(state),
            Err(WorkflowQueryError::NotFound(_)) => Err(Error::not_found(format!(
                "no turn {turn_id} in session {session_id}"
            ))),
            // The run closed between describe and query.
            Err(query_error) => self.result(session_id, turn_id).await.map_err(|e| {
                Error::backend(format!(
                    "querying turn {turn_id} failed ({query_error}) and so did reading its result ({e})"
                ))
            }),
        }
    }

    async fn answer_approval(
        &self,
        session_id: &str,
        turn_id: &str,
        answer: ApprovalAnswer,
    ) -> Result<()> {
        self.handle(session_id, turn_id)
            .signal(
                HarnessTurnWorkflow::signal_approve,
                answer,
                WorkflowSignalOptions::default(),
            )
            .await
            .map_err(|e| interaction_error(session_id, turn_id, e))
    }

    async fn abort_turn(&self, session_id: &str, turn_id: &str, reason: &str) -> Result<()> {
        self.handle(session_id, turn_id)
            .signal(
                HarnessTurnWorkflow::signal_abort,
                AbortRequest {
                    reason: reason.to_string(),
                },
                WorkflowSignalOptions::default(),
            )
            .await
            .map_err(|e| interaction_error(session_id, turn_id, e))
    }

    async fn wait_turn(&self, session_id: &str, turn_id: &str) -> Result<TurnState> {
        self.result(session_id, turn_id).await
    }
}

/// A worker that runs `harness_turn` workflows and their activities.
///
/// Not `Send`: drive [`TurnWorker::run`] on the main task or a
/// [`tokio::task::LocalSet`].
pub struct TurnWorker {
    worker: Worker,
    // The SDK runtime must outlive the worker it created.
    _runtime: Runtime,
}

impl std::fmt::Debug for TurnWorker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TurnWorker").finish_non_exhaustive()
    }
}

impl TurnWorker {
    /// Connect and register the workflow and activities. Needs a running
    /// tokio runtime.
    pub async fn new(config: &TemporalConfig, executor: Arc<dyn SliceExecutor>) -> Result<Self> {
        let runtime = Runtime::from_current_tokio(Default::default())
            .map_err(|e| Error::backend(format!("cannot create the Temporal runtime: {e}")))?;
        let client = connect(config).await?;
        let options = WorkerOptions::new(config.task_queue.clone())
            .register_activities(TurnActivities::new(executor))
            .register_workflow::<HarnessTurnWorkflow>()
            .map_err(|e| Error::backend(format!("registering the workflow: {e}")))?
            .build();
        let worker = Worker::new(&runtime, client, options)
            .map_err(|e| Error::backend(format!("cannot create the Temporal worker: {e}")))?;
        Ok(Self {
            worker,
            _runtime: runtime,
        })
    }

    /// A function that asks the worker to shut down (its `run` then
    /// returns once in-flight tasks finish).
    pub fn shutdown_handle(&self) -> impl Fn() + Send + Sync + 'static {
        self.worker.shutdown_handle()
    }

    /// Poll and run tasks until shut down.
    pub async fn run(&mut self) -> Result<()> {
        self.worker
            .run()
            .await
            .map_err(|e| Error::backend(format!("the Temporal worker stopped: {e}")))
    }
}

/// Run a worker for `config.task_queue` with `executor` until it is shut
/// down or fails. The future is not `Send` (see the crate docs).
pub async fn run_worker(config: TemporalConfig, executor: Arc<dyn SliceExecutor>) -> Result<()> {
    TurnWorker::new(&config, executor).await?.run().await
}
