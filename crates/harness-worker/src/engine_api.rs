//! The Workflows engine, reachable from outside the Worker, for the engine
//! conformance suite (`harness_testkit::conformance::engine`). Exists only
//! when `HARNESS_TEST_EXECUTOR_URL` is set; a deployment leaves it empty and
//! these routes answer 404.
//!
//! The suite drives a `DurableEngine` and hands it a `SliceExecutor` whose
//! slices write to the suite's own session log. The engine here is the real
//! one — `WorkflowsEngine` on the `TURNS` binding, `durable_workflows::
//! run_turn` in the instance, local Workflows scheduling, retrying and
//! replaying the steps — and two seams cross the process boundary
//! (`durable_workflows::remote` is the wire):
//!
//! - `POST /v1/test/engine/<op>` ([`serve`]): each op one `DurableEngine`
//!   method. `abort` also writes the turn's mailbox in the session's object,
//!   as a client's abort does through the actor, so a running slice stops;
//!   `state` of a running instance answers the progress the instance
//!   published to that object (an instance shows no output before its end).
//! - [`RemoteExecutor`]: every step's executor call is a `POST` to the
//!   test's executor; an abort the Worker's slice sees is forwarded to it
//!   (`abort-slice`).
//!
//! Requests carry the bearer token of a `runner` grant: the engine API
//! starts and steers turns, which is what a runner does.

use async_trait::async_trait;
use durable_workflows::engine::WorkflowsEngine;
use durable_workflows::remote::{
    AbortRequest, AnswerRequest, KillAgentRequest, RemoteError, RunSliceRequest, TurnRef,
};
use durable_workflows::TurnParams;
use harness_core::engine::{DurableEngine, SliceExecutor};
use harness_core::sandbox::{DetachedProcess, SandboxHandle};
use harness_core::stream::AbortSignal;
use harness_core::turn::{SliceReport, TurnState};
use harness_core::{Error, ErrorKind, Result};
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::time::Duration;
use wasm_bindgen::{JsCast, JsValue};
use worker::{Env, Fetch, Headers, Method, Request, RequestInit, Response};

use crate::turns::{object_post, object_request, publish_progress, var};

/// The Worker variable naming the test's executor (`http://127.0.0.1:PORT`).
pub(crate) const EXECUTOR_URL_VAR: &str = "HARNESS_TEST_EXECUTOR_URL";

/// Whether the engine API is on (the variable is set).
pub(crate) fn enabled(env: &Env) -> bool {
    var(env, EXECUTOR_URL_VAR).is_some()
}

/// Answer `POST /v1/test/engine/<op>` with `body`: `200` and the result, or
/// the error's status and a [`RemoteError`].
pub(crate) async fn serve(env: &Env, op: &str, body: &[u8]) -> worker::Result<Response> {
    let answer = match op_result(env, op, body).await {
        Ok(value) => Response::from_json(&value)?,
        Err(e) => {
            let remote = RemoteError::of(&e);
            Response::from_json(&remote)?.with_status(remote.status())
        }
    };
    Ok(answer)
}

fn parse<T: DeserializeOwned>(op: &str, body: &[u8]) -> Result<T> {
    serde_json::from_slice(body)
        .map_err(|e| Error::invalid(format!("the body of engine op {op} is malformed: {e}")))
}

fn engine(env: &Env, generation: u64) -> Result<WorkflowsEngine> {
    let binding = worker::js_sys::Reflect::get(env, &"TURNS".into())
        .ok()
        .filter(|b| !b.is_undefined())
        .ok_or_else(|| Error::unsupported("the Worker has no TURNS Workflow binding"))?;
    Ok(WorkflowsEngine::new(binding.unchecked_into(), generation))
}

async fn op_result(env: &Env, op: &str, body: &[u8]) -> Result<serde_json::Value> {
    let value = match op {
        "start" => {
            let params: TurnParams = parse(op, body)?;
            // The state `state` shows until the instance publishes its own
            // (never over one it published: a second start of a turn).
            publish_progress(env, &params.state, true).await?;
            engine(env, params.generation)?
                .with_tuning(params.tuning)
                .start_turn(params.state)
                .await?;
            serde_json::Value::Null
        }
        "answer" => {
            let request: AnswerRequest = parse(op, body)?;
            let turn = request.turn;
            engine(env, 0)?
                .answer_approval(&turn.session_id, &turn.turn_id, request.answer)
                .await?;
            serde_json::Value::Null
        }
        "abort" => {
            let request: AbortRequest = parse(op, body)?;
            let turn = request.turn;
            // The mailbox first: the event reaches only a waiting turn; a
            // running slice asks the object (turns.rs, WorkerSlices).
            let path = format!("turn-abort?turn={}", turn.turn_id);
            let note = serde_json::to_vec(&serde_json::json!({ "reason": request.reason }))?;
            object_post(env, &turn.session_id, &path, note).await?;
            engine(env, 0)?
                .abort_turn(&turn.session_id, &turn.turn_id, &request.reason)
                .await?;
            serde_json::Value::Null
        }
        "state" => {
            let turn: TurnRef = parse(op, body)?;
            let state = match engine(env, 0)?
                .turn_state(&turn.session_id, &turn.turn_id)
                .await
            {
                Err(e) if e.kind() == ErrorKind::Unsupported => progress(env, &turn).await?,
                other => other?,
            };
            serde_json::to_value(state)?
        }
        "wait" => {
            let turn: TurnRef = parse(op, body)?;
            let state = engine(env, 0)?
                .wait_turn(&turn.session_id, &turn.turn_id)
                .await?;
            serde_json::to_value(state)?
        }
        other => {
            return Err(Error::not_found(format!(
                "no engine op {other:?} (ops: {})",
                durable_workflows::remote::ENGINE_OPS.join(", ")
            )))
        }
    };
    Ok(value)
}

/// The state a running instance last published.
async fn progress(env: &Env, turn: &TurnRef) -> Result<TurnState> {
    let backend = |e: worker::Error| Error::backend(format!("the session object: {e}"));
    let path = format!("turn-progress?turn={}", turn.turn_id);
    let mut response = object_request(env, &turn.session_id, Method::Get, &path, None)
        .await
        .map_err(backend)?;
    let text = response.text().await.map_err(backend)?;
    match response.status_code() {
        200 => Ok(serde_json::from_str(&text)?),
        404 => Err(Error::not_found(format!(
            "turn {} of {} has published no state",
            turn.turn_id, turn.session_id
        ))),
        status => Err(Error::backend(format!(
            "the session object answered {status} to {path}: {text}"
        ))),
    }
}

/// A `SliceExecutor` over HTTP: the test's executor at `base`
/// (`POST <base>/<op>`, `durable_workflows::remote`).
#[derive(Debug)]
pub(crate) struct RemoteExecutor {
    base: String,
}

impl RemoteExecutor {
    pub(crate) fn new(base: &str) -> Self {
        Self {
            base: base.trim_end_matches('/').to_string(),
        }
    }

    async fn call<B: Serialize, R: DeserializeOwned>(&self, op: &str, body: &B) -> Result<R> {
        let what = format!("the test executor's {op}");
        let failed = |e: worker::Error| Error::backend(format!("{what}: {e}"));
        let headers = Headers::new();
        headers
            .set("content-type", "application/json")
            .map_err(failed)?;
        let mut init = RequestInit::new();
        init.with_method(Method::Post)
            .with_headers(headers)
            .with_body(Some(JsValue::from_str(&serde_json::to_string(body)?)));
        let url = format!("{}/{op}", self.base);
        let request = Request::new_with_init(&url, &init).map_err(failed)?;
        let mut response = Fetch::Request(request).send().await.map_err(failed)?;
        let status = response.status_code();
        let text = response.text().await.map_err(failed)?;
        if status != 200 {
            return Err(RemoteError::from_answer(&what, status, &text));
        }
        serde_json::from_str(&text)
            .map_err(|e| Error::backend(format!("{what} answered {text:?}: {e}")))
    }
}

#[async_trait(?Send)]
impl SliceExecutor for RemoteExecutor {
    async fn create_sandbox(&self, state: &TurnState) -> Result<SandboxHandle> {
        self.call("create-sandbox", state).await
    }

    async fn run_slice(
        &self,
        state: &TurnState,
        budget: Duration,
        abort: AbortSignal,
    ) -> Result<SliceReport> {
        let request = RunSliceRequest {
            state: state.clone(),
            budget_ms: u64::try_from(budget.as_millis()).unwrap_or(u64::MAX),
        };
        let slice = self.call::<_, SliceReport>("run-slice", &request);
        // The abort travels to the executor, whose slice then reports what
        // it has; bounded by the slice's own call.
        let forward = async {
            abort.aborted().await;
            if let Err(e) = self
                .call::<_, serde_json::Value>("abort-slice", &TurnRef::of(state))
                .await
            {
                worker::console_error!("turn {}: forwarding the abort: {e}", state.turn_id);
            }
        };
        futures::pin_mut!(slice, forward);
        match futures::future::select(slice, forward).await {
            futures::future::Either::Left((report, _)) => report,
            futures::future::Either::Right(((), slice)) => slice.await,
        }
    }

    async fn kill_agent(&self, state: &TurnState, process: &DetachedProcess) -> Result<()> {
        let request = KillAgentRequest {
            state: state.clone(),
            process: process.clone(),
        };
        self.call("kill-agent", &request).await
    }

    async fn turn_ended(&self, state: &TurnState) -> Result<()> {
        self.call("turn-ended", state).await
    }
}
