//! # harness-scripted-model
//!
//! Scripted model servers: the Anthropic Messages API (`POST /v1/messages`,
//! `POST /v1/messages/count_tokens`) and the OpenAI Responses API
//! (`POST /v1/responses`), streaming SSE, answering from a [`Script`].
//!
//! One [`ScriptedModel`] serves both APIs on `127.0.0.1:<ephemeral>`; point
//! Claude Code at [`ScriptedModel::base_url`] (`ANTHROPIC_BASE_URL`) and Codex
//! at [`ScriptedModel::v1_url`] (`model_providers.<name>.base_url`). Every
//! request is recorded ([`ScriptedModel::requests`]); failed script
//! assertions and unmatched requests are recorded as failures
//! ([`ScriptedModel::failures`]) and answered with a text the agent shows.
//!
//! ```no_run
//! # async fn demo() -> anyhow::Result<()> {
//! use harness_scripted_model::*;
//! let server = ScriptedModel::anthropic(Script::bash_then_text("echo hi > hi.txt", "done")).await?;
//! // run `claude` with server.claude_env() ...
//! assert!(server.failures().is_empty());
//! # Ok(()) }
//! ```
//!
//! It is a product feature, not only a test aid: `harness demo` and
//! `harness serve --demo` run real agents against it, with no key and no
//! network. The test kit re-exports it as `harness_testkit::model`.
//!
//! See `README.md` beside this crate for what the real CLIs need.

mod request;
mod script;
mod sse;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use futures::StreamExt;
use serde_json::{json, Value};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

pub use request::{Api, ModelRequest, ToolResult};
pub use script::{
    all, any, any_of, api, last_is_tool_result, last_is_tool_result_for, last_user_text_contains,
    matcher_fn, not, system_contains, Assertion, Gate, Matcher, Part, Reply, Rule, Script,
    StopReason, ToolCall, ToolKind, BASH_CALL_ID,
};
pub use sse::{
    anthropic_events, anthropic_message, openai_events, openai_response, ResponseMeta, SseEvent,
};

/// The smallest real turn: a prompt containing "write a file" gets one
/// shell call (`echo agent-was-here > made.txt && cat made.txt`), whose
/// result must contain `agent-was-here`, then the text "Wrote it.".
pub fn write_a_file_script() -> Script {
    Script::new()
        .rule(
            Rule::new(
                last_is_tool_result_for(BASH_CALL_ID),
                Reply::text("Wrote it."),
            )
            .assert_tool_result_contains(BASH_CALL_ID, "agent-was-here"),
        )
        .on(
            last_user_text_contains("write a file"),
            Reply::shell(
                BASH_CALL_ID,
                "echo agent-was-here > made.txt && cat made.txt",
            ),
        )
}

/// The text answered (and the failure recorded) when no rule matches.
pub const NO_MATCH_TEXT: &str = "no scripted reply matched";

/// One request the server received, whatever its path.
#[derive(Debug, Clone)]
pub struct RecordedRequest {
    /// HTTP method.
    pub method: String,
    /// Path without the query.
    pub path: String,
    /// Raw query string, if any (Claude Code sends `beta=true`).
    pub query: Option<String>,
    /// All headers, names lower-case, in arrival order.
    pub headers: Vec<(String, String)>,
    /// The JSON body (`Null` if empty or not JSON).
    pub body: Value,
    /// The model API, for `POST /v1/messages` and `POST /v1/responses`.
    pub api: Option<Api>,
    /// Index of the rule that answered (model requests only).
    pub rule: Option<usize>,
    /// Failures this request caused (assertions, no match).
    pub failures: Vec<String>,
    /// When its body had arrived (wall clock, so that it lines up with
    /// another process's span times on the same machine).
    pub received_at: std::time::SystemTime,
}

impl RecordedRequest {
    /// The first value of header `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        let name = name.to_ascii_lowercase();
        self.headers
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.as_str())
    }
    /// The normalised view, for model requests.
    pub fn model_request(&self) -> Option<ModelRequest> {
        self.api.map(|a| ModelRequest::new(a, self.body.clone()))
    }
}

struct Shared {
    script: Script,
    /// When set, a model request that does not carry this key (as
    /// `x-api-key` or `Authorization: Bearer`) is refused with 401.
    required_key: Option<String>,
    refused: AtomicU64,
    requests: Mutex<Vec<RecordedRequest>>,
    failures: Mutex<Vec<String>>,
    next_id: AtomicU64,
}

impl Shared {
    fn record(&self, rec: RecordedRequest) {
        if !rec.failures.is_empty() {
            self.failures
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .extend(rec.failures.iter().cloned());
        }
        self.requests
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(rec);
    }
}

/// A running scripted model server; it stops when dropped.
pub struct ScriptedModel {
    addr: SocketAddr,
    shared: Arc<Shared>,
    shutdown: Option<oneshot::Sender<()>>,
    task: JoinHandle<()>,
}

impl std::fmt::Debug for ScriptedModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ScriptedModel")
            .field("addr", &self.addr)
            .field("rules", &self.shared.script.rules.len())
            .finish()
    }
}

impl ScriptedModel {
    /// Serve `script` on both APIs on `127.0.0.1:<ephemeral port>`.
    pub async fn start(script: Script) -> anyhow::Result<Self> {
        Self::start_on(SocketAddr::from(([127, 0, 0, 1], 0)), script).await
    }

    /// Serve `script` on `addr` (port 0: an ephemeral port). For clients
    /// that cannot reach the host's loopback, e.g. a Docker container, which
    /// reaches the host on its bridge gateway address.
    pub async fn start_on(addr: SocketAddr, script: Script) -> anyhow::Result<Self> {
        Self::serve(addr, script, None).await
    }

    /// [`ScriptedModel::start_on`], refusing with `401` every model request
    /// that does not carry `key` (as `x-api-key`, or `Authorization:
    /// Bearer`): a client that has no key, or a wrong one, gets no answer
    /// from the script. Refusals are counted ([`ScriptedModel::refused`])
    /// and recorded, not reported as failures.
    pub async fn start_requiring_key(
        addr: SocketAddr,
        script: Script,
        key: impl Into<String>,
    ) -> anyhow::Result<Self> {
        Self::serve(addr, script, Some(key.into())).await
    }

    async fn serve(
        addr: SocketAddr,
        script: Script,
        required_key: Option<String>,
    ) -> anyhow::Result<Self> {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            script,
            required_key,
            refused: AtomicU64::new(0),
            requests: Mutex::new(Vec::new()),
            failures: Mutex::new(Vec::new()),
            next_id: AtomicU64::new(1),
        });
        let app = Router::new()
            .route("/v1/messages", post(anthropic_messages))
            .route("/messages", post(anthropic_messages))
            .route("/v1/messages/count_tokens", post(count_tokens))
            .route("/messages/count_tokens", post(count_tokens))
            .route("/v1/responses", post(openai_responses))
            .route("/responses", post(openai_responses))
            .route("/v1/models", get(models))
            .route("/models", get(models))
            // Claude Code's connectivity probe when non-essential traffic is on.
            .route("/api/hello", get(hello))
            .fallback(fallback)
            .with_state(shared.clone());
        let (tx, task) = serve_until_shutdown(listener, app);
        Ok(Self {
            addr,
            shared,
            shutdown: Some(tx),
            task,
        })
    }

    /// Same as [`ScriptedModel::start`] (one server answers both APIs).
    pub async fn anthropic(script: Script) -> anyhow::Result<Self> {
        Self::start(script).await
    }

    /// Same as [`ScriptedModel::start`] (one server answers both APIs).
    pub async fn openai(script: Script) -> anyhow::Result<Self> {
        Self::start(script).await
    }

    /// The socket address served.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://<address served>:PORT` (`127.0.0.1` unless started with
    /// [`ScriptedModel::start_on`]) — Claude Code's `ANTHROPIC_BASE_URL`.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// [`ScriptedModel::base_url`] + `/v1` — an OpenAI provider `base_url` (Codex).
    pub fn v1_url(&self) -> String {
        format!("{}/v1", self.base_url())
    }

    /// Every request received so far, in arrival order.
    pub fn requests(&self) -> Vec<RecordedRequest> {
        self.shared
            .requests
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The model requests (`/v1/messages`, `/v1/responses`) so far, in order.
    pub fn model_requests(&self) -> Vec<ModelRequest> {
        self.requests()
            .iter()
            .filter_map(RecordedRequest::model_request)
            .collect()
    }

    /// Model requests refused for a missing or wrong key (see
    /// [`ScriptedModel::start_requiring_key`]).
    pub fn refused(&self) -> u64 {
        self.shared.refused.load(Ordering::Relaxed)
    }

    /// Failed assertions and unmatched requests so far.
    pub fn failures(&self) -> Vec<String> {
        self.shared
            .failures
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Panic with the recorded failures, if any.
    #[track_caller]
    pub fn assert_no_failures(&self) {
        let f = self.failures();
        assert!(f.is_empty(), "scripted model failures: {f:#?}");
    }

    /// Environment for Claude Code against this server:
    /// `ANTHROPIC_BASE_URL`, `ANTHROPIC_API_KEY`,
    /// `CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1`.
    pub fn claude_env(&self) -> Vec<(String, String)> {
        vec![
            ("ANTHROPIC_BASE_URL".into(), self.base_url()),
            ("ANTHROPIC_API_KEY".into(), "test".into()),
            (
                "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC".into(),
                "1".into(),
            ),
        ]
    }

    /// Environment for Codex against this server: `OPENAI_API_KEY`.
    pub fn codex_env(&self) -> Vec<(String, String)> {
        vec![("OPENAI_API_KEY".into(), "test".into())]
    }

    /// `-c` arguments making Codex use this server (provider `mock`,
    /// `wire_api="responses"`) with model `model`.
    pub fn codex_config_args(&self, model: &str) -> Vec<String> {
        vec![
            "-c".into(),
            "model_provider=mock".into(),
            "-c".into(),
            format!(
                "model_providers.mock={{name=\"mock\",base_url=\"{}\",env_key=\"OPENAI_API_KEY\",wire_api=\"responses\"}}",
                self.v1_url()
            ),
            "-c".into(),
            format!("model={model}"),
        ]
    }
}

impl Drop for ScriptedModel {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        self.task.abort();
    }
}

fn header_pairs(headers: &HeaderMap) -> Vec<(String, String)> {
    headers
        .iter()
        .map(|(k, v)| {
            (
                k.as_str().to_ascii_lowercase(),
                String::from_utf8_lossy(v.as_bytes()).into_owned(),
            )
        })
        .collect()
}

fn parse_body(headers: &HeaderMap, body: &Bytes) -> Result<Value, String> {
    if body.is_empty() {
        return Ok(Value::Null);
    }
    if let Some(enc) = headers.get(header::CONTENT_ENCODING) {
        let enc = enc.to_str().unwrap_or("?");
        if enc != "identity" {
            return Err(format!("unsupported content-encoding {enc:?}"));
        }
    }
    serde_json::from_slice(body).map_err(|e| format!("request body is not JSON: {e}"))
}

fn base_record(method: &Method, uri: &Uri, headers: &HeaderMap, body: Value) -> RecordedRequest {
    RecordedRequest {
        method: method.to_string(),
        path: uri.path().to_string(),
        query: uri.query().map(str::to_string),
        headers: header_pairs(headers),
        body,
        api: None,
        rule: None,
        failures: Vec::new(),
        received_at: std::time::SystemTime::now(),
    }
}

/// Pick the reply for a model request, recording it and its failures.
fn answer(
    shared: &Shared,
    api: Api,
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    body: &Bytes,
) -> Result<(ModelRequest, Reply), Box<Response>> {
    if let Some(key) = &shared.required_key {
        let header = |name: header::HeaderName| {
            headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_string()
        };
        let bearer = header(header::AUTHORIZATION);
        let carried = header(header::HeaderName::from_static("x-api-key")) == *key
            || bearer.strip_prefix("Bearer ") == Some(key.as_str());
        if !carried {
            shared.refused.fetch_add(1, Ordering::Relaxed);
            let mut rec = base_record(method, uri, headers, Value::Null);
            rec.api = Some(api);
            shared.record(rec);
            return Err(Box::new(
                (
                    StatusCode::UNAUTHORIZED,
                    axum::Json(json!({"type":"error","error":{"type":"authentication_error","message":"scripted model: this request does not carry the key"}})),
                )
                    .into_response(),
            ));
        }
    }
    let parsed = match parse_body(headers, body) {
        Ok(v) => v,
        Err(e) => {
            let mut rec = base_record(
                method,
                uri,
                headers,
                Value::String(String::from_utf8_lossy(body).into_owned()),
            );
            rec.api = Some(api);
            rec.failures.push(format!("{} {}: {e}", method, uri.path()));
            shared.record(rec);
            return Err(Box::new(
                (
                    StatusCode::BAD_REQUEST,
                    axum::Json(json!({"type":"error","error":{"type":"invalid_request_error","message":e}})),
                )
                    .into_response(),
            ));
        }
    };
    let req = ModelRequest::new(api, parsed.clone());
    let mut rec = base_record(method, uri, headers, parsed);
    rec.api = Some(api);
    let reply = match shared.script.select(&req) {
        Some((i, rule)) => {
            rec.rule = Some(i);
            let errs: Vec<String> = rule
                .assertions
                .iter()
                .filter_map(|a| a.check(&req).err())
                .map(|e| format!("rule {i} ({}): {e}", rule.label()))
                .collect();
            if errs.is_empty() {
                rule.reply.clone()
            } else {
                rec.failures.extend(errs.iter().cloned());
                Reply::text(format!("ASSERTION FAILED: {}", errs.join("; ")))
            }
        }
        None => {
            rec.failures.push(format!(
                "{NO_MATCH_TEXT}: {api:?} request with last user text {:?}, last tool results {:?}",
                req.last_user_text(),
                req.last_tool_results()
            ));
            Reply::text(NO_MATCH_TEXT)
        }
    };
    shared.record(rec);
    Ok((req, reply))
}

fn meta(shared: &Shared, req: &ModelRequest, body: &Bytes, default_model: &str) -> ResponseMeta {
    ResponseMeta {
        n: shared.next_id.fetch_add(1, Ordering::Relaxed),
        model: req.model().unwrap_or(default_model).to_string(),
        input_tokens: (body.len() as u64 / 4).max(1),
    }
}

fn sse_response(
    mut events: Vec<SseEvent>,
    reply: &Reply,
    extra: &[(&'static str, String)],
) -> Response {
    if let Some((n, gate)) = &reply.hold {
        if let Some(e) = events.iter_mut().filter(|e| e.is_delta()).nth(*n) {
            e.hold = Some(gate.clone());
        }
    }
    let stream = futures::stream::iter(events).then(|e| async move {
        if let Some(gate) = &e.hold {
            gate.opened().await;
        }
        if !e.delay.is_zero() {
            tokio::time::sleep(e.delay).await;
        }
        Ok::<_, Infallible>(Bytes::from(e.to_wire()))
    });
    let mut builder = Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache");
    for (k, v) in extra {
        builder = builder.header(*k, v);
    }
    builder
        .body(Body::from_stream(stream))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

/// How one API answers a model call: the model named when the request
/// names none, the header carrying the request id, and its two bodies
/// (streamed events, or one JSON message).
struct Dialect {
    api: Api,
    default_model: &'static str,
    request_id_header: &'static str,
    events: fn(&Reply, &ResponseMeta) -> Vec<SseEvent>,
    message: fn(&Reply, &ResponseMeta) -> Value,
}

const ANTHROPIC: Dialect = Dialect {
    api: Api::Anthropic,
    default_model: "claude-scripted",
    request_id_header: "request-id",
    events: anthropic_events,
    message: anthropic_message,
};

const OPENAI: Dialect = Dialect {
    api: Api::OpenAi,
    default_model: "gpt-test",
    request_id_header: "x-request-id",
    events: openai_events,
    message: openai_response,
};

/// The scripted answer to one model call, in `dialect`.
fn model_call(
    dialect: &Dialect,
    shared: &Shared,
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    body: &Bytes,
) -> Response {
    let (req, reply) = match answer(shared, dialect.api, method, uri, headers, body) {
        Ok(x) => x,
        Err(r) => return *r,
    };
    let m = meta(shared, &req, body, dialect.default_model);
    let request_id = (dialect.request_id_header, format!("req_scripted_{}", m.n));
    if req.stream() {
        sse_response((dialect.events)(&reply, &m), &reply, &[request_id])
    } else {
        ([request_id], axum::Json((dialect.message)(&reply, &m))).into_response()
    }
}

async fn anthropic_messages(
    State(shared): State<Arc<Shared>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    model_call(&ANTHROPIC, &shared, &method, &uri, &headers, &body)
}

async fn openai_responses(
    State(shared): State<Arc<Shared>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    model_call(&OPENAI, &shared, &method, &uri, &headers, &body)
}

async fn count_tokens(
    State(shared): State<Arc<Shared>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let parsed = parse_body(&headers, &body).unwrap_or(Value::Null);
    shared.record(base_record(&method, &uri, &headers, parsed));
    axum::Json(json!({"input_tokens": (body.len() / 4).max(1)})).into_response()
}

async fn models(
    State(shared): State<Arc<Shared>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
) -> Response {
    shared.record(base_record(&method, &uri, &headers, Value::Null));
    let entry = |id: &str, name: &str| {
        json!({
            "id": id, "type": "model", "object": "model", "display_name": name,
            "created_at": "2025-01-01T00:00:00Z", "created": 1735689600, "owned_by": "harness-testkit",
        })
    };
    axum::Json(json!({
        "object": "list",
        "data": [
            entry("claude-sonnet-4-5", "Claude Sonnet (scripted)"),
            entry("claude-opus-4-1", "Claude Opus (scripted)"),
            entry("gpt-test", "GPT test (scripted)"),
        ],
        "has_more": false,
        "first_id": "claude-sonnet-4-5",
        "last_id": "gpt-test",
    }))
    .into_response()
}

async fn hello(
    State(shared): State<Arc<Shared>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
) -> Response {
    shared.record(base_record(&method, &uri, &headers, Value::Null));
    StatusCode::OK.into_response()
}

async fn fallback(
    State(shared): State<Arc<Shared>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let parsed = parse_body(&headers, &body).unwrap_or(Value::Null);
    shared.record(base_record(&method, &uri, &headers, parsed));
    (
        StatusCode::NOT_FOUND,
        axum::Json(json!({
            "type": "error",
            "error": {"type": "not_found_error", "message": format!("scripted model: no route {} {}", method, uri.path())}
        })),
    )
        .into_response()
}

/// Serve `app` on `listener` until the returned sender fires or is
/// dropped (this crate's model server, and the test kit's other servers).
#[doc(hidden)]
pub fn serve_until_shutdown(
    listener: tokio::net::TcpListener,
    app: Router,
) -> (oneshot::Sender<()>, JoinHandle<()>) {
    let (tx, rx) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app)
            .with_graceful_shutdown(async {
                let _ = rx.await;
            })
            .await;
    });
    (tx, task)
}
