//! Turns on Cloudflare Workflows: the Workflow's entry
//! ([`run_turn_workflow`], called by the `TurnWorkflow` class of
//! `entry.mjs`) and the I/O a slice needs inside a Worker — the bridge over
//! the Worker's `fetch` ([`FetchTransport`]) and the session's Durable
//! Object as the turn's runner ([`ObjectRunnerSink`]).
//!
//! The turn loop is `durable_workflows::run_turn` (core's `TurnDriver`);
//! a slice is core's `SliceRunner` — the same one `harness serve` runs —
//! with the Cloudflare sandbox provider and the agent adapters.

// `#[wasm_bindgen]` on an exported function expands to an unsafe block.
#![allow(unsafe_code)]

use std::cell::Cell;
use std::collections::BTreeMap;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use durable_workflows::binding::{js_message, WorkflowStep, WorkflowSteps};
use durable_workflows::{StepBody, StepOptions, Steps, TurnParams};
use futures::StreamExt;
use harness_claude_code::{
    ApprovalServer, ClaudeCodeConfig, ClaudeCodeHarness, APPROVAL_SERVER_PATH, DEFAULT_INSTALL_PATH,
};
use harness_core::actor::{RunnerMessage, ServerMessage};
use harness_core::broker::{ModelBroker, CREDENTIAL_ENV_VARS};
use harness_core::clock::FnClock;
use harness_core::engine::SliceExecutor;
use harness_core::harness::Harness;
use harness_core::part::StreamPart;
use harness_core::sandbox::{DetachedProcess, SandboxHandle, SandboxProvider};
use harness_core::slice::{PartSink, SliceRunner};
use harness_core::stream::AbortSignal;
use harness_core::turn::{SliceReport, TurnState};
use harness_core::{Error, Result};
use sandbox_cloudflare::transport::{
    BridgeRequest, BridgeResponse, BridgeTransport, Method as BridgeMethod, RequestBody,
};
use sandbox_cloudflare::CloudflareProvider;
use serde::{Deserialize, Serialize};
use wasm_bindgen::prelude::*;
use worker::{Env, Fetch, Headers, Method, Request, RequestInit, ResponseBody};

use crate::broker::{TurnBroker, BROKER_SECRET_VAR, BROKER_URL_VAR};
use crate::front::SESSION_HEADER;

/// The body of the object's internal `/runner` request.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct RunnerRequest {
    /// The generation the Workflow instance runs as.
    pub generation: u64,
    /// The message.
    pub message: RunnerMessage,
}

/// The `run` of the `TurnWorkflow` class (entry.mjs): drive the turn in
/// `event.payload` (a [`TurnParams`]) to its end through `step`; resolves
/// to the final `TurnState` as JSON.
#[wasm_bindgen]
pub async fn run_turn_workflow(
    event: JsValue,
    step: WorkflowStep,
    env: Env,
) -> std::result::Result<JsValue, JsValue> {
    let fail = |message: String| JsValue::from(worker::js_sys::Error::new(&message));
    let payload = worker::js_sys::Reflect::get(&event, &JsValue::from_str("payload"))
        .map_err(|e| fail(js_message(&e)))?;
    let json = worker::js_sys::JSON::stringify(&payload)
        .map_err(|e| fail(js_message(&e)))?
        .as_string()
        .unwrap_or_default();
    let params: TurnParams = serde_json::from_str(&json)
        .map_err(|e| fail(format!("the Workflow's params are not a turn: {e}")))?;
    let executor = executor(&env, &params).map_err(|e| fail(e.to_string()))?;
    let clock: Rc<dyn Fn() -> u64> = Rc::new(|| worker::js_sys::Date::now() as u64);
    let steps = ObjectSteps {
        inner: WorkflowSteps::new(step),
        env: env.clone(),
    };
    let state = durable_workflows::run_turn(params, &steps, executor, clock)
        .await
        .map_err(|e| fail(e.to_string()))?;
    let json = serde_json::to_string(&state).map_err(|e| fail(e.to_string()))?;
    Ok(JsValue::from_str(&json))
}

/// A Worker variable, if set and not empty.
pub(crate) fn var(env: &Env, name: &str) -> Option<String> {
    env.var(name)
        .ok()
        .map(|v| v.to_string())
        .filter(|v| !v.is_empty())
}

/// The Cloudflare sandbox provider on the bridge the Worker is configured
/// with (`HARNESS_CF_BRIDGE_URL`, `HARNESS_CF_TOKEN`), over its `fetch`.
pub(crate) fn bridge_provider(env: &Env) -> Result<Arc<dyn SandboxProvider>> {
    let bridge = var(env, "HARNESS_CF_BRIDGE_URL").ok_or_else(|| {
        Error::invalid("HARNESS_CF_BRIDGE_URL is not set: sandboxes need a sandbox bridge")
    })?;
    let token = var(env, "HARNESS_CF_TOKEN").unwrap_or_default();
    let transport = FetchTransport {
        base_url: bridge.trim_end_matches('/').to_string(),
        token,
        next: AtomicU64::new(0),
    };
    // Core's traits are shared as `Arc<dyn …>`; on wasm32 nothing is `Send`
    // and there is one thread, so the Arc is only a shared handle.
    #[allow(clippy::arc_with_non_send_sync)]
    let provider: Arc<dyn SandboxProvider> = Arc::new(CloudflareProvider::with_transport(
        Arc::new(transport),
        sandbox_cloudflare::DEFAULT_PART_BYTES,
    ));
    Ok(provider)
}

/// A Workflow's steps, with the turn's progress published to the session's
/// object (`turn-progress`), where the engine API reads a running turn's
/// state (`engine_api.rs`). A failed publish is logged and the turn goes on:
/// progress is a view, the step records are the turn.
struct ObjectSteps {
    inner: WorkflowSteps,
    env: Env,
}

#[async_trait(?Send)]
impl Steps for ObjectSteps {
    async fn run(
        &self,
        name: &str,
        options: StepOptions,
        body: StepBody,
    ) -> std::result::Result<String, String> {
        self.inner.run(name, options, body).await
    }

    async fn wait_input(&self, name: &str, timeout_ms: u64) -> std::result::Result<String, String> {
        self.inner.wait_input(name, timeout_ms).await
    }

    async fn progress(&self, state: &TurnState) {
        if let Err(e) = publish_progress(&self.env, state, false).await {
            worker::console_error!("turn {}: publishing its progress: {e}", state.turn_id);
        }
    }
}

/// Store `state` as the turn's progress in its session's object; with
/// `initial`, only if the turn has published none yet.
pub(crate) async fn publish_progress(env: &Env, state: &TurnState, initial: bool) -> Result<()> {
    let body = serde_json::to_vec(state)?;
    let flag = if initial { "&initial=1" } else { "" };
    let path = format!("turn-progress?turn={}{flag}", state.turn_id);
    object_post(env, &state.session_id, &path, body).await
}

/// `POST` `body` to the internal path `path_and_query` of `session`'s
/// object; an error unless it answers 200.
pub(crate) async fn object_post(
    env: &Env,
    session: &str,
    path_and_query: &str,
    body: Vec<u8>,
) -> Result<()> {
    let response = object_request(env, session, Method::Post, path_and_query, Some(body))
        .await
        .map_err(|e| Error::backend(format!("the session object: {e}")))?;
    match response.status_code() {
        200 => Ok(()),
        status => Err(Error::backend(format!(
            "the session object answered {status} to {path_and_query}"
        ))),
    }
}

/// The slice executor of one turn: [`slice_runner`], with the object as
/// the turn's abort mailbox ([`WorkerSlices`]). A test build
/// (`test-routes`) takes the test's executor over HTTP instead when
/// `HARNESS_TEST_EXECUTOR_URL` is set (the engine conformance suite,
/// `engine_api::RemoteExecutor`), and a failpoint from
/// `HARNESS_TEST_FAIL_SLICE`; a deploy build reads neither variable.
fn executor(env: &Env, params: &TurnParams) -> Result<Rc<dyn SliceExecutor>> {
    #[cfg(feature = "test-routes")]
    let inner: Rc<dyn SliceExecutor> = match var(env, crate::engine_api::EXECUTOR_URL_VAR) {
        Some(url) => Rc::new(crate::engine_api::RemoteExecutor::new(&url)),
        None => Rc::new(slice_runner(env, params)?),
    };
    #[cfg(not(feature = "test-routes"))]
    let inner: Rc<dyn SliceExecutor> = Rc::new(slice_runner(env, params)?);
    #[cfg(feature = "test-routes")]
    let failpoint = var(env, "HARNESS_TEST_FAIL_SLICE")
        .map(|v| parse_failpoint(&v))
        .transpose()?
        .map(|(slice, attempts)| (slice, Cell::new(attempts)));
    #[cfg(not(feature = "test-routes"))]
    let failpoint = None;
    Ok(Rc::new(WorkerSlices {
        inner,
        env: env.clone(),
        failpoint,
    }))
}

/// Core's slice runner for one turn: the Cloudflare provider on the bridge
/// the Worker is configured with, the agents preinstalled in the bridge's
/// image, and the session's object as the runner.
fn slice_runner(env: &Env, params: &TurnParams) -> Result<SliceRunner> {
    let provider = bridge_provider(env)?;
    let claude = var(env, "HARNESS_CLAUDE_PATH").unwrap_or_else(|| DEFAULT_INSTALL_PATH.into());
    let mut config = ClaudeCodeConfig::preinstalled(claude);
    // Approvals need the approval MCP server in the bridge's image, where
    // the Claude Code adapter runs it from (APPROVAL_SERVER_PATH).
    if var(env, "HARNESS_APPROVALS").as_deref() == Some("1") {
        config.approvals = Some(ApprovalServer::preinstalled(APPROVAL_SERVER_PATH));
    }
    let claude: Arc<dyn Harness> = Arc::new(ClaudeCodeHarness::new(config));
    // The agents' extra variables: a JSON object. Model credentials in it
    // would enter the sandbox, so they are taken only with the broker off
    // and HARNESS_DIRECT_MODEL=1 (never by default: docs/security.md).
    let agent_env: BTreeMap<String, String> = match var(env, "HARNESS_AGENT_ENV") {
        Some(json) => serde_json::from_str(&json).map_err(|e| {
            Error::invalid(format!(
                "HARNESS_AGENT_ENV is not a JSON object of strings: {e}"
            ))
        })?,
        None => BTreeMap::new(),
    };
    let broker = TurnBroker::from_env(env, &params.state.turn_id)?;
    let direct = var(env, "HARNESS_DIRECT_MODEL").as_deref() == Some("1");
    let credentials: Vec<&str> = CREDENTIAL_ENV_VARS
        .iter()
        .copied()
        .filter(|k| agent_env.contains_key(*k))
        .collect();
    if broker.is_none() && !credentials.is_empty() && !direct {
        return Err(Error::invalid(format!(
            "HARNESS_AGENT_ENV carries {} and the Worker is no model broker: the key would \
             enter the sandbox. Set {BROKER_URL_VAR} (the Worker's URL as sandboxes reach \
             it), {BROKER_SECRET_VAR} and the provider's key as secrets of the Worker \
             (docs/cloudflare-worker.md), or HARNESS_DIRECT_MODEL=1 to hand the agent \
             the key on purpose",
            credentials.join(", ")
        )));
    }
    let sink = ObjectRunnerSink {
        env: env.clone(),
        generation: params.generation,
    };
    Ok(SliceRunner {
        providers: BTreeMap::from([(provider.name().to_string(), provider)]),
        harnesses: BTreeMap::from([(claude.name().to_string(), claude)]),
        sink: Arc::new(sink),
        env: agent_env,
        broker: broker.map(|b| Arc::new(b) as Arc<dyn ModelBroker>),
        model: None,
        poll_interval: Duration::from_millis(250),
        sleep: Arc::new(|d| Box::pin(worker::Delay::from(d))),
        clock: Arc::new(FnClock(|| worker::js_sys::Date::now() as u64)),
        // Turn-end checkpoints on the Worker are not wired yet (its R2
        // store could hold them): docs/session-runtime.md says so.
        checkpoints: None,
    })
}

/// One request to the internal path `path_and_query` of `session`'s
/// object (`https://session.internal/…`).
pub(crate) async fn object_request(
    env: &Env,
    session: &str,
    method: Method,
    path_and_query: &str,
    body: Option<Vec<u8>>,
) -> worker::Result<worker::Response> {
    let namespace = env.durable_object("SESSIONS")?;
    let stub = namespace.id_from_name(session)?.get_stub()?;
    let headers = Headers::new();
    headers.set(SESSION_HEADER, session)?;
    let mut init = RequestInit::new();
    init.with_method(method).with_headers(headers);
    if let Some(body) = body {
        init.with_body(Some(
            worker::js_sys::Uint8Array::from(body.as_slice()).into(),
        ));
    }
    let url = format!("https://session.internal/{path_and_query}");
    stub.fetch_with_request(Request::new_with_init(&url, &init)?)
        .await
}

/// How often a running slice asks the session's object whether a client
/// aborted the turn.
const ABORT_POLL: Duration = Duration::from_secs(1);

/// A turn's slices as the Worker runs them:
///
/// - the session's object is the turn's mailbox while a slice runs: a step
///   cannot be signalled, so the slice asks the object (`/turn-abort`)
///   every [`ABORT_POLL`] and fires its abort signal when a client asked
///   (the abort event the object also sends reaches a turn that waits for
///   input);
/// - a test failpoint (`HARNESS_TEST_FAIL_SLICE=<slice>:<attempts>`, test
///   builds only): the first attempts of that slice run, emitting their
///   parts, and then fail, as a slice whose sandbox connection drops at its
///   end does; the step retries.
struct WorkerSlices {
    inner: Rc<dyn SliceExecutor>,
    env: Env,
    failpoint: Option<(u32, Cell<u32>)>,
}

impl WorkerSlices {
    /// The abort a client asked for, if any (errors count as none: the
    /// next poll asks again).
    async fn abort_requested(&self, state: &TurnState) -> Option<String> {
        let path = format!("turn-abort?turn={}", state.turn_id);
        let mut response = object_request(&self.env, &state.session_id, Method::Get, &path, None)
            .await
            .ok()?;
        let answer: serde_json::Value = response.json().await.ok()?;
        answer["abort"].as_str().map(str::to_string)
    }

    /// The failpoint's verdict on a slice that ran.
    fn fail_after(&self, state: &TurnState, report: &SliceReport) -> Result<()> {
        let Some((slice, left)) = &self.failpoint else {
            return Ok(());
        };
        if state.slices_run + 1 != *slice || left.get() == 0 {
            return Ok(());
        }
        left.set(left.get() - 1);
        let message = format!(
            "failpoint HARNESS_TEST_FAIL_SLICE: slice {slice} ran to cursor {} and fails",
            report.cursor
        );
        worker::console_error!("{message}");
        Err(Error::backend(message))
    }
}

#[async_trait(?Send)]
impl SliceExecutor for WorkerSlices {
    async fn create_sandbox(&self, state: &TurnState) -> Result<SandboxHandle> {
        self.inner.create_sandbox(state).await
    }

    async fn run_slice(
        &self,
        state: &TurnState,
        budget: Duration,
        abort: AbortSignal,
    ) -> Result<SliceReport> {
        let slice = self.inner.run_slice(state, budget, abort.clone());
        // Bounded by the slice: it stops when the slice ends.
        let watch = async {
            loop {
                worker::Delay::from(ABORT_POLL).await;
                if let Some(reason) = self.abort_requested(state).await {
                    worker::console_log!("turn {}: abort requested ({reason})", state.turn_id);
                    abort.abort();
                    return;
                }
            }
        };
        futures::pin_mut!(slice, watch);
        let report = match futures::future::select(slice, watch).await {
            futures::future::Either::Left((report, _)) => report,
            // The slice sees the signal and reports what it has.
            futures::future::Either::Right(((), slice)) => slice.await,
        }?;
        worker::console_log!(
            "turn {}: slice ended {:?} (answers {})",
            state.turn_id,
            report.outcome,
            state.approval_answers.len()
        );
        self.fail_after(state, &report)?;
        Ok(report)
    }

    async fn kill_agent(&self, state: &TurnState, process: &DetachedProcess) -> Result<()> {
        self.inner.kill_agent(state, process).await
    }

    async fn turn_ended(&self, state: &TurnState) -> Result<()> {
        self.inner.turn_ended(state).await
    }
}

/// `HARNESS_TEST_FAIL_SLICE=<slice>:<attempts>`.
#[cfg(feature = "test-routes")]
fn parse_failpoint(value: &str) -> Result<(u32, u32)> {
    let parsed = value
        .split_once(':')
        .and_then(|(s, a)| Some((s.parse().ok()?, a.parse().ok()?)));
    parsed.ok_or_else(|| {
        Error::invalid(format!(
            "HARNESS_TEST_FAIL_SLICE={value:?}: expected <slice>:<attempts>, e.g. 1:1"
        ))
    })
}

/// The session's Durable Object as the turn's runner: each message is one
/// internal `/runner` request, on which the object attaches the instance
/// as runner `generation`, hands the actor the message and answers with
/// the actor's reply. A newer instance's generation fences this one.
struct ObjectRunnerSink {
    env: Env,
    generation: u64,
}

impl ObjectRunnerSink {
    async fn send(&self, session: &str, message: RunnerMessage) -> Result<ServerMessage> {
        let backend = |e: worker::Error| Error::backend(format!("the session object: {e}"));
        let body = serde_json::to_vec(&RunnerRequest {
            generation: self.generation,
            message,
        })?;
        let mut response = object_request(&self.env, session, Method::Post, "runner", Some(body))
            .await
            .map_err(backend)?;
        let text = response.text().await.map_err(backend)?;
        if response.status_code() != 200 {
            return Err(Error::backend(format!(
                "the session object answered {}: {text}",
                response.status_code()
            )));
        }
        let reply: ServerMessage = serde_json::from_str(&text)?;
        match reply {
            ServerMessage::Error { code, message } => Err(Error::new(
                code.kind(),
                format!("{}: {message}", code.as_str()),
            )),
            reply => Ok(reply),
        }
    }
}

#[async_trait(?Send)]
impl PartSink for ObjectRunnerSink {
    async fn emit(
        &self,
        session_id: &str,
        turn_id: &str,
        part: StreamPart,
        key: String,
    ) -> Result<()> {
        let message = RunnerMessage::keyed_part(turn_id, part, key);
        self.send(session_id, message).await.map(|_| ())
    }

    async fn turn_status(&self, state: &TurnState) -> Result<()> {
        let message = RunnerMessage::turn_status_of(state);
        self.send(&state.session_id, message).await.map(|_| ())
    }
}

/// The bridge over the Worker's `fetch`.
#[derive(Debug)]
struct FetchTransport {
    base_url: String,
    token: String,
    next: AtomicU64,
}

#[async_trait(?Send)]
impl BridgeTransport for FetchTransport {
    async fn send(&self, request: BridgeRequest) -> Result<BridgeResponse> {
        let what = format!("{} {}", request.method.as_str(), request.path);
        let failed = |e: worker::Error| {
            Error::backend(format!("cloudflare bridge: {what} did not answer: {e}"))
        };
        let headers = Headers::new();
        headers
            .set("authorization", &format!("Bearer {}", self.token))
            .map_err(failed)?;
        for (name, value) in &request.headers {
            headers.set(name, value).map_err(failed)?;
        }
        let body = match request.body {
            RequestBody::Empty => None,
            RequestBody::Json(value) => {
                headers
                    .set("content-type", "application/json")
                    .map_err(failed)?;
                Some(Bytes::from(serde_json::to_vec(&value)?))
            }
            RequestBody::Bytes(bytes) => {
                headers
                    .set("content-type", "application/octet-stream")
                    .map_err(failed)?;
                Some(bytes)
            }
        };
        let mut init = RequestInit::new();
        init.with_method(match request.method {
            BridgeMethod::Get => Method::Get,
            BridgeMethod::Post => Method::Post,
            BridgeMethod::Put => Method::Put,
            BridgeMethod::Delete => Method::Delete,
        })
        .with_headers(headers);
        if let Some(body) = body {
            init.with_body(Some(worker::js_sys::Uint8Array::from(body.as_ref()).into()));
        }
        let url = format!("{}{}", self.base_url, request.path);
        let request = Request::new_with_init(&url, &init).map_err(failed)?;
        let mut response = Fetch::Request(request).send().await.map_err(failed)?;
        let status = response.status_code();
        let content_type = response.headers().get("content-type").ok().flatten();
        let body: harness_core::stream::ByteStream = match response.body() {
            ResponseBody::Stream(_) => Box::pin(response.stream().map_err(failed)?.map(|chunk| {
                chunk
                    .map(Bytes::from)
                    .map_err(|e| Error::backend(format!("cloudflare bridge: reading a body: {e}")))
            })),
            ResponseBody::Body(bytes) => harness_core::stream::once(bytes.clone()),
            // A 204 (a destroy) has no body at all.
            ResponseBody::Empty => harness_core::stream::empty(),
        };
        Ok(BridgeResponse {
            status,
            content_type,
            body,
        })
    }

    async fn sleep(&self, duration: Duration) {
        worker::Delay::from(duration).await;
    }

    fn unique(&self) -> String {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let random = (worker::js_sys::Math::random() * f64::from(u32::MAX)) as u32;
        format!("{:x}-{random:08x}-{n}", worker::js_sys::Date::now() as u64)
    }
}
