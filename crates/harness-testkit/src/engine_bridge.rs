//! The engine conformance suite ([`crate::conformance::engine`]) against an
//! engine that lives in another process: the Workflows engine inside the
//! Worker under `wrangler dev` (`crates/harness-worker/src/engine_api.rs`).
//! The wire is `durable_workflows::remote`.
//!
//! - [`ExecutorServer`]: the suite's `SliceExecutor` served over HTTP on
//!   loopback. Each Workflow step of the engine under test calls it, so the
//!   suite's scripted agent, its failure injection and its session log are
//!   what every step runs against. A slice's abort comes as its own call
//!   (`abort-slice`) and fires that slice's signal.
//! - [`RemoteEngine`]: a `DurableEngine` whose every method is one call of
//!   the Worker's engine API.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, RwLock};

use async_trait::async_trait;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use durable_workflows::remote::{
    AbortRequest, AnswerRequest, KillAgentRequest, RemoteError, RunSliceRequest, TurnRef,
};
use durable_workflows::{StepTuning, TurnParams};
use harness_core::engine::{DurableEngine, SliceExecutor};
use harness_core::stream::AbortSignal;
use harness_core::turn::{ApprovalAnswer, TurnState};
use harness_core::{Error, Result};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::sync::oneshot;

/// Turns by `(session, turn)`.
type TurnKey = (String, String);

#[derive(Default)]
struct Slices {
    /// The abort signal of each turn's running slice.
    running: HashMap<TurnKey, AbortSignal>,
    /// Aborts that arrived before their slice did (the two calls race).
    early: HashSet<TurnKey>,
}

struct Shared {
    executor: RwLock<Option<Arc<dyn SliceExecutor>>>,
    slices: Mutex<Slices>,
}

/// A `SliceExecutor` served over HTTP (`POST /<op>`, the ops of
/// `durable_workflows::remote::EXECUTOR_OPS`) on `127.0.0.1`.
pub struct ExecutorServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    shutdown: Option<oneshot::Sender<()>>,
}

impl std::fmt::Debug for ExecutorServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExecutorServer")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl ExecutorServer {
    /// Serve on a free loopback port; calls fail (`unsupported`) until
    /// [`set`](Self::set) gives an executor.
    pub async fn start() -> std::io::Result<Self> {
        let shared = Arc::new(Shared {
            executor: RwLock::new(None),
            slices: Mutex::new(Slices::default()),
        });
        let app = Router::new()
            .route("/{op}", post(call))
            .with_state(shared.clone());
        let listener = tokio::net::TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0))).await?;
        let addr = listener.local_addr()?;
        let (tx, _task) = crate::serve_until_shutdown(listener, app);
        Ok(Self {
            addr,
            shared,
            shutdown: Some(tx),
        })
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Serve `executor` from now on (an engine the suite starts gets its
    /// own executor).
    pub fn set(&self, executor: Arc<dyn SliceExecutor>) {
        *self
            .shared
            .executor
            .write()
            .unwrap_or_else(|e| e.into_inner()) = Some(executor);
    }
}

impl Drop for ExecutorServer {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}

fn failure(error: &Error) -> Response {
    let remote = RemoteError::of(error);
    let status = StatusCode::from_u16(remote.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (status, Json(remote)).into_response()
}

fn parse<T: DeserializeOwned>(op: &str, body: &[u8]) -> Result<T> {
    serde_json::from_slice(body)
        .map_err(|e| Error::invalid(format!("the body of executor op {op} is malformed: {e}")))
}

async fn call(
    State(shared): State<Arc<Shared>>,
    Path(op): Path<String>,
    body: axum::body::Bytes,
) -> Response {
    match op_result(&shared, &op, &body).await {
        Ok(value) => Json(value).into_response(),
        Err(e) => failure(&e),
    }
}

/// One executor op: its result as JSON.
async fn op_result(shared: &Shared, op: &str, body: &[u8]) -> Result<serde_json::Value> {
    let executor = shared
        .executor
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .clone()
        .ok_or_else(|| Error::unsupported("no executor is set on the test's server"))?;
    let value = match op {
        "create-sandbox" => to_json(&executor.create_sandbox(&parse(op, body)?).await?)?,
        "run-slice" => {
            let request: RunSliceRequest = parse(op, body)?;
            let key = (
                request.state.session_id.clone(),
                request.state.turn_id.clone(),
            );
            let abort = AbortSignal::new();
            {
                let mut slices = shared.slices.lock().unwrap_or_else(|e| e.into_inner());
                if slices.early.remove(&key) {
                    abort.abort();
                }
                slices.running.insert(key.clone(), abort.clone());
            }
            let report = executor
                .run_slice(&request.state, request.budget(), abort)
                .await;
            shared
                .slices
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .running
                .remove(&key);
            to_json(&report?)?
        }
        "abort-slice" => {
            let turn: TurnRef = parse(op, body)?;
            let key = (turn.session_id, turn.turn_id);
            let mut slices = shared.slices.lock().unwrap_or_else(|e| e.into_inner());
            let fired = match slices.running.get(&key) {
                Some(signal) => {
                    signal.abort();
                    true
                }
                None => {
                    // Its run-slice call is still on its way.
                    slices.early.insert(key);
                    false
                }
            };
            serde_json::json!({ "fired": fired })
        }
        "kill-agent" => {
            let request: KillAgentRequest = parse(op, body)?;
            to_json(
                &executor
                    .kill_agent(&request.state, &request.process)
                    .await?,
            )?
        }
        "turn-ended" => to_json(&executor.turn_ended(&parse(op, body)?).await?)?,
        other => {
            return Err(Error::not_found(format!(
                "no executor op {other:?} (ops: {})",
                durable_workflows::remote::EXECUTOR_OPS.join(", ")
            )))
        }
    };
    Ok(value)
}

fn to_json<T: Serialize>(value: &T) -> Result<serde_json::Value> {
    serde_json::to_value(value).map_err(|e| Error::backend(format!("encoding a result: {e}")))
}

/// A `DurableEngine` served by a Worker's engine API
/// (`POST <base>/v1/test/engine/<op>`, with a runner's bearer token).
#[derive(Debug, Clone)]
pub struct RemoteEngine {
    base: String,
    token: String,
    generation: u64,
    tuning: StepTuning,
    client: reqwest::Client,
}

impl RemoteEngine {
    /// The engine of the Worker at `base`, its turns emitting as runner
    /// `generation` with `tuning`.
    pub fn new(base: &str, token: &str, generation: u64, tuning: StepTuning) -> Self {
        Self {
            base: base.trim_end_matches('/').to_string(),
            token: token.to_string(),
            generation,
            tuning,
            client: reqwest::Client::new(),
        }
    }

    async fn call<B: Serialize, R: DeserializeOwned>(&self, op: &str, body: &B) -> Result<R> {
        let what = format!("the Worker's engine op {op}");
        let failed = |e: reqwest::Error| Error::backend(format!("{what}: {e}"));
        let response = self
            .client
            .post(format!("{}/v1/test/engine/{op}", self.base))
            .bearer_auth(&self.token)
            .json(body)
            .send()
            .await
            .map_err(failed)?;
        let status = response.status().as_u16();
        let text = response.text().await.map_err(failed)?;
        if status != 200 {
            return Err(RemoteError::from_answer(&what, status, &text));
        }
        serde_json::from_str(&text)
            .map_err(|e| Error::backend(format!("{what} answered {text:?}: {e}")))
    }
}

fn turn(session_id: &str, turn_id: &str) -> TurnRef {
    TurnRef {
        session_id: session_id.to_string(),
        turn_id: turn_id.to_string(),
    }
}

#[async_trait]
impl DurableEngine for RemoteEngine {
    fn name(&self) -> &'static str {
        "cloudflare-workflows (over the Worker's engine API)"
    }

    async fn start_turn(&self, state: TurnState) -> Result<()> {
        let params = TurnParams {
            state,
            generation: self.generation,
            tuning: self.tuning.clone(),
        };
        self.call::<_, serde_json::Value>("start", &params)
            .await
            .map(drop)
    }

    async fn turn_state(&self, session_id: &str, turn_id: &str) -> Result<TurnState> {
        self.call("state", &turn(session_id, turn_id)).await
    }

    async fn answer_approval(
        &self,
        session_id: &str,
        turn_id: &str,
        answer: ApprovalAnswer,
    ) -> Result<()> {
        let request = AnswerRequest {
            turn: turn(session_id, turn_id),
            answer,
        };
        self.call::<_, serde_json::Value>("answer", &request)
            .await
            .map(drop)
    }

    async fn abort_turn(&self, session_id: &str, turn_id: &str, reason: &str) -> Result<()> {
        let request = AbortRequest {
            turn: turn(session_id, turn_id),
            reason: reason.to_string(),
        };
        self.call::<_, serde_json::Value>("abort", &request)
            .await
            .map(drop)
    }

    async fn wait_turn(&self, session_id: &str, turn_id: &str) -> Result<TurnState> {
        self.call("wait", &turn(session_id, turn_id)).await
    }
}
