//! The bridge routes, answering as `@cloudflare/sandbox`'s bridge does.

// Handlers stop early with the bridge's error response: `Result<_, Response>`
// is the shape of that, and its size does not matter here.
#![allow(clippy::result_large_err)]

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, Path, Query, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use base64::Engine as _;
use bytes::BytesMut;
use futures::{Stream, StreamExt};
use harness_core::sandbox::{
    collect_exec, shell_quote, ExecEvent, ExecRequest, ExitReason, ExitStatus, Sandbox,
    SandboxProvider, SandboxSpec,
};
use harness_core::ErrorKind;
use serde_json::{json, Value};
use tokio::sync::{oneshot, OnceCell};

use super::openapi::{media_type, OpenApi};

/// The bridge's root: exec cwds and file paths must resolve inside it, and
/// persist/hydrate archive it.
pub const WORKSPACE: &str = "/workspace";

/// The bridge's limit on a file write (413 `payload_too_large` above it) and
/// on a hydrate archive (400 `invalid_request` above it).
pub const MAX_BODY_BYTES: usize = 32 * 1024 * 1024;

/// How much of a request the validating middleware buffers: more than the
/// bridge's own limits, so an over-limit body still reaches the route and is
/// refused the way the bridge refuses it.
const VALIDATE_BUFFER_BYTES: usize = 40 * 1024 * 1024;

/// What a [`BridgeServer`] serves.
#[derive(Debug)]
pub struct BridgeServerConfig {
    /// The Bearer token every route but `/health` requires.
    pub token: String,
    /// Template for the inner sandboxes (image, env, …); `workdir` is forced
    /// to `/workspace`, the bridge's root.
    pub spec: SandboxSpec,
    /// `Some`: validate every request and response against this document and
    /// record the violations (see [`BridgeServer::check`]).
    pub openapi: Option<super::OpenApi>,
}

/// A bridge-compatible HTTP server on `127.0.0.1:<ephemeral port>`.
#[derive(Debug)]
pub struct BridgeServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    shutdown: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

#[derive(Debug)]
struct Shared {
    provider: Arc<dyn SandboxProvider>,
    token: String,
    spec: SandboxSpec,
    openapi: Option<OpenApi>,
    violations: Mutex<Vec<String>>,
    /// Bridge sandbox id → its inner sandbox, made on first use. The cell
    /// lets two first requests for one id wait for one `create` without
    /// holding the map's lock across it.
    sandboxes: Mutex<HashMap<String, Arc<OnceCell<Arc<Inner>>>>>,
}

#[derive(Debug)]
struct Inner {
    sandbox: Box<dyn Sandbox>,
    sessions: Mutex<HashMap<String, Session>>,
    tunnels: Mutex<BTreeMap<u16, Value>>,
}

/// What a bridge session carries into the execs that name it.
#[derive(Debug, Clone, Default)]
struct Session {
    cwd: Option<String>,
    env: BTreeMap<String, String>,
}

impl BridgeServer {
    /// Serve on `127.0.0.1:<ephemeral port>`.
    pub async fn start(
        provider: Arc<dyn SandboxProvider>,
        config: BridgeServerConfig,
    ) -> anyhow::Result<Self> {
        let mut spec = config.spec;
        spec.workdir = WORKSPACE.to_string();
        let shared = Arc::new(Shared {
            provider,
            token: config.token,
            spec,
            openapi: config.openapi,
            violations: Mutex::new(Vec::new()),
            sandboxes: Mutex::new(HashMap::new()),
        });
        let listener = tokio::net::TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0))).await?;
        let addr = listener.local_addr()?;
        let app = router(shared.clone());
        let (tx, task) = crate::serve_until_shutdown(listener, app);
        Ok(Self {
            addr,
            shared,
            shutdown: Some(tx),
            task,
        })
    }

    /// `http://127.0.0.1:PORT` (no trailing slash).
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every OpenAPI violation seen so far, each naming method and path.
    pub fn violations(&self) -> Vec<String> {
        self.shared.violations.lock().unwrap().clone()
    }

    /// Err listing the violations, if any.
    pub fn check(&self) -> anyhow::Result<()> {
        let v = self.violations();
        if v.is_empty() {
            return Ok(());
        }
        anyhow::bail!(
            "{} violation(s) of the Cloudflare Sandbox bridge OpenAPI document:\n  {}",
            v.len(),
            v.join("\n  ")
        )
    }

    /// Ids of the bridge sandboxes that have a live inner sandbox.
    pub fn sandboxes(&self) -> Vec<String> {
        let map = self.shared.sandboxes.lock().unwrap();
        let mut ids: Vec<String> = map
            .iter()
            .filter(|(_, cell)| cell.initialized())
            .map(|(id, _)| id.clone())
            .collect();
        ids.sort();
        ids
    }

    /// Stop serving and destroy every inner sandbox.
    pub async fn shutdown(mut self) -> anyhow::Result<()> {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        // Graceful shutdown waits for open responses; an exec stream a test
        // left open must not hang it.
        if tokio::time::timeout(Duration::from_secs(5), &mut self.task)
            .await
            .is_err()
        {
            self.task.abort();
        }
        let cells: Vec<(String, Arc<OnceCell<Arc<Inner>>>)> =
            self.shared.sandboxes.lock().unwrap().drain().collect();
        let mut failures = Vec::new();
        for (id, cell) in cells {
            if let Some(inner) = cell.get() {
                if let Err(e) = inner.sandbox.destroy().await {
                    failures.push(format!("{id}: {e}"));
                }
            }
        }
        if !failures.is_empty() {
            anyhow::bail!(
                "destroying the bridge's sandboxes failed: {}",
                failures.join("; ")
            );
        }
        Ok(())
    }
}

impl Drop for BridgeServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn router(shared: Arc<Shared>) -> Router {
    let sandbox = "/v1/sandbox/{id}";
    Router::new()
        .route("/health", get(|| async { Json(json!({ "ok": true })) }))
        .route("/v1/openapi.json", get(openapi_json))
        .route("/v1/sandbox", post(create_sandbox))
        .route(sandbox, delete(destroy_sandbox))
        .route(&format!("{sandbox}/exec"), post(exec))
        .route(
            &format!("{sandbox}/file/"),
            get(|| async { empty_path() }).put(|| async { empty_path() }),
        )
        .route(
            &format!("{sandbox}/file/{{*path}}"),
            get(read_file).put(write_file),
        )
        .route(
            &format!("{sandbox}/tunnel/{{port}}"),
            post(create_tunnel).delete(destroy_tunnel),
        )
        .route(&format!("{sandbox}/running"), get(running))
        .route(&format!("{sandbox}/pty"), get(pty))
        .route(&format!("{sandbox}/persist"), post(persist))
        .route(&format!("{sandbox}/hydrate"), post(hydrate))
        .route(&format!("{sandbox}/mount"), post(mount))
        .route(&format!("{sandbox}/unmount"), post(unmount))
        .route(&format!("{sandbox}/session"), post(create_session))
        .route(
            &format!("{sandbox}/session/{{sid}}"),
            delete(delete_session),
        )
        .route("/v1/pool/stats", get(pool_stats))
        .route("/v1/pool/shutdown-prewarmed", post(pool_ok))
        .route("/v1/pool/prime", post(pool_ok))
        // The routes read bodies themselves, with the bridge's limits and
        // answers; axum's 2 MB default would answer first, differently.
        .layer(DefaultBodyLimit::disable())
        .layer(middleware::from_fn_with_state(shared.clone(), auth))
        .layer(middleware::from_fn_with_state(shared.clone(), validate))
        .with_state(shared)
}

// ---------------------------------------------------------------- helpers

/// The bridge's error body: `{"error": message, "code": code}`.
fn error_json(status: u16, code: &str, message: impl Into<String>) -> Response {
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (
        status,
        Json(json!({ "error": message.into(), "code": code })),
    )
        .into_response()
}

/// Normalise `path` (`.`/`..`, relative to `/workspace`) and keep it only if
/// it stays within `/workspace`, as the bridge's `resolveWorkspacePath`.
fn resolve_workspace_path(path: &str) -> Option<String> {
    let abs = if path.starts_with('/') {
        path.to_string()
    } else {
        format!("{WORKSPACE}/{path}")
    };
    let mut parts: Vec<&str> = Vec::new();
    for seg in abs.split('/') {
        match seg {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            s => parts.push(s),
        }
    }
    let resolved = format!("/{}", parts.join("/"));
    (resolved == WORKSPACE || resolved.starts_with(&format!("{WORKSPACE}/"))).then_some(resolved)
}

/// The bridge's `validateSessionId`.
fn valid_session_id(id: &str) -> bool {
    (1..=128).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
        && !id.contains("..")
}

/// The `Session-Id` header: `Ok(None)` when absent or empty (the bridge
/// treats an empty header as none), `Err` with the bridge's 400 when malformed.
fn session_header(headers: &HeaderMap) -> Result<Option<String>, Response> {
    let Some(raw) = headers.get("session-id") else {
        return Ok(None);
    };
    let raw = raw.to_str().unwrap_or("\u{0}");
    if raw.is_empty() {
        return Ok(None);
    }
    if !valid_session_id(raw) {
        return Err(error_json(
            400,
            "invalid_request",
            "Invalid session ID format",
        ));
    }
    Ok(Some(raw.to_string()))
}

/// Lowercase RFC 4648 base32 without padding (`[a-z2-7]`), as the bridge
/// makes sandbox ids.
fn base32(data: &[u8]) -> String {
    const ALPHABET: &[u8; 32] = b"abcdefghijklmnopqrstuvwxyz234567";
    let mut out = String::new();
    let (mut bits, mut value) = (0u32, 0u32);
    for &byte in data {
        value = (value << 8) | u32::from(byte);
        bits += 8;
        while bits >= 5 {
            out.push(ALPHABET[((value >> (bits - 5)) & 31) as usize] as char);
            bits -= 5;
        }
    }
    if bits > 0 {
        out.push(ALPHABET[((value << (5 - bits)) & 31) as usize] as char);
    }
    out
}

fn random_id() -> String {
    base32(uuid::Uuid::new_v4().as_bytes())
}

/// Now as RFC 3339 UTC (`2026-12-01T07:36:38.123Z`), the shape of the
/// bridge's `createdAt`.
fn now_rfc3339() -> String {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let secs = now.as_secs() as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Howard Hinnant's days-to-civil.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        now.subsec_millis()
    )
}

/// Read a body whole, counting every byte but keeping at most `limit`: the
/// bridge buffers a body before judging its size, and names the size.
async fn read_body(body: Body, limit: usize) -> Result<(Bytes, usize), String> {
    let mut stream = body.into_data_stream();
    let mut buf = BytesMut::new();
    let mut total = 0usize;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| e.to_string())?;
        total += chunk.len();
        if total <= limit {
            buf.extend_from_slice(&chunk);
        }
    }
    Ok((buf.freeze(), total))
}

impl Shared {
    /// The inner sandbox of bridge sandbox `id`, created on first use like
    /// the bridge's containers (ids are names, not records).
    async fn sandbox(&self, id: &str) -> Result<Arc<Inner>, Response> {
        let cell = self
            .sandboxes
            .lock()
            .unwrap()
            .entry(id.to_string())
            .or_default()
            .clone();
        cell.get_or_try_init(|| async {
            let mut spec = self.spec.clone();
            // No slot: a provider replaces the sandbox of a repeated
            // (session, slot), and bridge ids repeat across servers (tests
            // pick fixed ids). The label names the bridge id instead.
            spec.slot = None;
            spec.labels
                .insert("harness.bridge-sandbox".to_string(), id.to_string());
            let sandbox = self.provider.create(&spec).await?;
            Ok::<_, harness_core::Error>(Arc::new(Inner {
                sandbox,
                sessions: Mutex::new(HashMap::new()),
                tunnels: Mutex::new(BTreeMap::new()),
            }))
        })
        .await
        .cloned()
        // What the bridge answers when its pool cannot hand out a container.
        .map_err(|e| error_json(502, "pool_error", format!("pool error: {e}")))
    }

    /// The inner sandbox of `id` if one was made; never makes one.
    fn existing(&self, id: &str) -> Option<Arc<Inner>> {
        self.sandboxes
            .lock()
            .unwrap()
            .get(id)
            .and_then(|cell| cell.get().cloned())
    }

    fn record(&self, violations: impl IntoIterator<Item = String>) {
        let mut all = self.violations.lock().unwrap();
        for v in violations {
            tracing::warn!(violation = %v, "bridge OpenAPI violation");
            all.push(v);
        }
    }
}

// ------------------------------------------------------------- middleware

/// The bridge's `/v1/sandbox/*` and `/v1/pool/*` guards: the sandbox id's
/// format (`[a-z2-7]{1,128}`), then the Bearer token.
async fn auth(State(shared): State<Arc<Shared>>, req: Request, next: Next) -> Response {
    let path = req.uri().path().to_string();
    let sandbox_route = path == "/v1/sandbox" || path.starts_with("/v1/sandbox/");
    let pool_route = path.starts_with("/v1/pool/");
    if sandbox_route {
        if let Some(id) = path.split('/').nth(3).filter(|s| !s.is_empty()) {
            let ok = id.len() <= 128 && id.bytes().all(|b| matches!(b, b'a'..=b'z' | b'2'..=b'7'));
            if !ok {
                return error_json(400, "invalid_request", "Invalid sandbox ID format");
            }
        }
    }
    if sandbox_route || pool_route {
        let header = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        // The sandbox routes take the scheme in any case, the pool routes
        // only `Bearer` (as the bridge's two guards do).
        let provided = if header.len() >= 7
            && (header.starts_with("Bearer ")
                || (sandbox_route && header[..7].eq_ignore_ascii_case("bearer ")))
        {
            &header[7..]
        } else {
            ""
        };
        if provided != shared.token {
            return error_json(401, "unauthorized", "Unauthorized");
        }
    }
    next.run(req).await
}

/// Check the request and the response against the document (when the
/// server has one). Requests are buffered (they are at most the bridge's
/// limits); JSON responses are buffered; event streams are passed through
/// as they come and checked when they end; binary responses are checked by
/// status and content type only, never held back.
async fn validate(State(shared): State<Arc<Shared>>, req: Request, next: Next) -> Response {
    let Some(api) = shared.openapi.as_ref() else {
        return next.run(req).await;
    };
    let method = req.method().to_string();
    let path_and_query = req
        .uri()
        .path_and_query()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| req.uri().path().to_string());
    let (parts, body) = req.into_parts();
    let body = match axum::body::to_bytes(body, VALIDATE_BUFFER_BYTES).await {
        Ok(b) => b,
        Err(e) => {
            let v = format!(
                "request {method} {path_and_query}: body unreadable or over {VALIDATE_BUFFER_BYTES} bytes: {e}"
            );
            shared.record([v.clone()]);
            return error_json(413, "invalid_request", v);
        }
    };
    let violations = api.validate_request(&method, &path_and_query, &parts.headers, &body);
    if !violations.is_empty() {
        shared.record(violations.clone());
        return error_json(
            400,
            "invalid_request",
            format!(
                "the request violates the bridge's OpenAPI document: {}",
                violations.join("; ")
            ),
        );
    }
    let response = next.run(Request::from_parts(parts, Body::from(body))).await;

    let status = response.status().as_u16();
    let (parts, body) = response.into_parts();
    let media = media_type(&parts.headers);
    match media.as_deref() {
        Some("text/event-stream") => {
            let shared = shared.clone();
            let headers = parts.headers.clone();
            let tee = tee_then(body.into_data_stream(), move |whole| {
                if let Some(api) = shared.openapi.as_ref() {
                    let v =
                        api.validate_response(&method, &path_and_query, status, &headers, whole);
                    shared.record(v);
                }
            });
            Response::from_parts(parts, Body::from_stream(tee))
        }
        Some(m) if m == "application/json" || m.ends_with("+json") => {
            let bytes = match axum::body::to_bytes(body, VALIDATE_BUFFER_BYTES).await {
                Ok(b) => b,
                Err(e) => {
                    shared.record([format!(
                        "response {status} to {method} {path_and_query}: body unreadable: {e}"
                    )]);
                    Bytes::new()
                }
            };
            shared.record(api.validate_response(
                &method,
                &path_and_query,
                status,
                &parts.headers,
                &bytes,
            ));
            Response::from_parts(parts, Body::from(bytes))
        }
        None => {
            // No content type: only a body-less answer (204) is valid; an
            // empty body is what such responses carry.
            let bytes = axum::body::to_bytes(body, VALIDATE_BUFFER_BYTES)
                .await
                .unwrap_or_default();
            shared.record(api.validate_response(
                &method,
                &path_and_query,
                status,
                &parts.headers,
                &bytes,
            ));
            Response::from_parts(parts, Body::from(bytes))
        }
        Some(_) => {
            // Raw bytes (files, tars): nothing in them to check, and they may
            // be large; checking status and content type needs no body.
            if api
                .response_media_types(&method, &path_and_query, status)
                .is_some_and(|m| m.is_empty())
            {
                shared.record([format!(
                    "response {status} to {method} {path_and_query}: the response declares no content but has Content-Type {}",
                    media.as_deref().unwrap_or("")
                )]);
            } else {
                shared.record(api.validate_response(
                    &method,
                    &path_and_query,
                    status,
                    &parts.headers,
                    &[],
                ));
            }
            Response::from_parts(parts, body)
        }
    }
}

/// Pass `stream` through, keeping a copy; at its end call `done` with the
/// whole. A stream dropped early (the client went away) is not judged.
fn tee_then<S, E>(
    stream: S,
    done: impl FnOnce(&[u8]) + Send + 'static,
) -> impl Stream<Item = Result<Bytes, E>> + Send
where
    S: Stream<Item = Result<Bytes, E>> + Send + Unpin + 'static,
    E: Send + 'static,
{
    futures::stream::unfold(Some((stream, BytesMut::new(), done)), |state| async move {
        let (mut stream, mut seen, done) = state?;
        match stream.next().await {
            Some(Ok(chunk)) => {
                seen.extend_from_slice(&chunk);
                Some((Ok(chunk), Some((stream, seen, done))))
            }
            Some(Err(e)) => Some((Err(e), None)),
            None => {
                done(&seen);
                None
            }
        }
    })
}

// ----------------------------------------------------------------- routes

async fn openapi_json(
    State(shared): State<Arc<Shared>>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
) -> Response {
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    if bearer != shared.token && query.get("token").map(String::as_str) != Some(&shared.token) {
        return error_json(401, "unauthorized", "Unauthorized");
    }
    match shared.openapi.as_ref() {
        Some(api) => Json(api.document().clone()).into_response(),
        None => match OpenApi::pinned() {
            Ok(api) => Json(api.document().clone()).into_response(),
            Err(e) => error_json(502, "pool_error", format!("{e:#}")),
        },
    }
}

async fn create_sandbox() -> Response {
    Json(json!({ "id": random_id() })).into_response()
}

async fn destroy_sandbox(State(shared): State<Arc<Shared>>, Path(id): Path<String>) -> Response {
    let cell = shared.sandboxes.lock().unwrap().remove(&id);
    if let Some(inner) = cell.as_ref().and_then(|c| c.get()) {
        // The bridge ignores a failed destroy and answers 204 regardless.
        if let Err(e) = inner.sandbox.destroy().await {
            tracing::warn!(sandbox = %id, error = %e, "destroying a bridge sandbox failed");
        }
    }
    StatusCode::NO_CONTENT.into_response()
}

async fn exec(
    State(shared): State<Arc<Shared>>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let Ok(body) = serde_json::from_slice::<Value>(&body) else {
        return error_json(400, "invalid_request", "Invalid JSON body");
    };
    let argv: Vec<String> = match body.get("argv").and_then(Value::as_array) {
        Some(a) if !a.is_empty() => {
            match a.iter().map(|v| v.as_str().map(str::to_string)).collect() {
                Some(argv) => argv,
                None => return error_json(400, "invalid_request", "argv entries must be strings"),
            }
        }
        _ => return error_json(400, "invalid_request", "argv must be a non-empty array"),
    };
    let session_id = match session_header(&headers) {
        Ok(s) => s,
        Err(r) => return r,
    };
    let timeout = body
        .get("timeout_ms")
        .and_then(Value::as_f64)
        .filter(|ms| *ms >= 0.0)
        .map(|ms| Duration::from_millis(ms as u64));
    let mut cwd = None;
    if let Some(c) = body.get("cwd").and_then(Value::as_str) {
        match resolve_workspace_path(c) {
            Some(c) => cwd = Some(c),
            None => {
                return error_json(
                    403,
                    "invalid_request",
                    "cwd must resolve to a location within /workspace",
                )
            }
        }
    }
    let inner = match shared.sandbox(&id).await {
        Ok(i) => i,
        Err(r) => return r,
    };
    let session = session_id
        .map(|sid| {
            inner
                .sessions
                .lock()
                .unwrap()
                .entry(sid)
                .or_default()
                .clone()
        })
        .unwrap_or_default();
    // The bridge hands the container one shell command line: every argv
    // token quoted, joined by spaces. Running it through `sh -c` the same
    // way keeps shell semantics (e.g. 127 for an unknown command).
    let line = argv
        .iter()
        .map(|a| shell_quote(a))
        .collect::<Vec<_>>()
        .join(" ");
    let mut request = ExecRequest::shell(line);
    request.cwd = cwd.or(session.cwd);
    request.env = session.env;
    request.timeout = timeout;

    let events = match inner.sandbox.exec(request).await {
        Ok(stream) => stream,
        Err(e) => {
            // Like the bridge: the SSE stream is already promised, so a
            // failure to start is its one (terminal) event.
            let frame = sse_frame(
                "error",
                &json!({ "error": format!("exec failed: {e}"), "code": "exec_transport_error" })
                    .to_string(),
            );
            return sse_response(Body::from(frame));
        }
    };
    let timeout_ms = timeout.map(|t| t.as_millis());
    // Mapped lazily: a client that goes away drops the body, which drops the
    // inner stream (and the command with it).
    let frames = futures::stream::unfold(Some(events), move |state| async move {
        let mut events = state?;
        loop {
            let (event, data, more) = match events.next().await {
                Some(Ok(ExecEvent::Stdout(b))) | Some(Ok(ExecEvent::Stderr(b))) if b.is_empty() => {
                    continue
                }
                Some(Ok(ExecEvent::Stdout(b))) => ("stdout", b64(&b), true),
                Some(Ok(ExecEvent::Stderr(b))) => ("stderr", b64(&b), true),
                Some(Ok(ExecEvent::Exit(status))) => {
                    let (event, data) = exit_event(status, timeout_ms);
                    (event, data, false)
                }
                Some(Err(e)) => (
                    "error",
                    json!({ "error": e.to_string(), "code": "exec_error" }).to_string(),
                    false,
                ),
                None => (
                    "error",
                    json!({ "error": "command output ended without an exit status", "code": "exec_error" })
                        .to_string(),
                    false,
                ),
            };
            let frame = Ok::<_, std::io::Error>(Bytes::from(sse_frame(event, &data)));
            return Some((frame, more.then_some(events)));
        }
    });
    sse_response(Body::from_stream(frames))
}

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// The terminal event for how a command ended: `exit` with its code
/// (128+N for a command killed by signal N, as a shell reports it), or
/// `error` when our timeout killed it.
fn exit_event(status: ExitStatus, timeout_ms: Option<u128>) -> (&'static str, String) {
    match status.reason {
        ExitReason::TimedOut => (
            "error",
            json!({
                "error": format!("command timed out after {} ms", timeout_ms.unwrap_or(0)),
                "code": "exec_error"
            })
            .to_string(),
        ),
        ExitReason::Aborted => (
            "error",
            json!({ "error": "command aborted", "code": "exec_error" }).to_string(),
        ),
        ExitReason::Exited => {
            let code = status
                .code
                .unwrap_or_else(|| 128 + status.signal.unwrap_or(0));
            ("exit", json!({ "exit_code": code }).to_string())
        }
    }
}

/// One SSE event as the bridge writes it: `event: <name>`, the data split
/// into `data:` lines, a blank line.
fn sse_frame(event: &str, data: &str) -> String {
    let data: Vec<String> = data.split('\n').map(|l| format!("data: {l}")).collect();
    format!("event: {event}\n{}\n\n", data.join("\n"))
}

fn sse_response(body: Body) -> Response {
    let mut response = Response::new(body);
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}

/// The file routes take the path after `file/` and resolve it under `/`
/// (`file/workspace/a.txt` is `/workspace/a.txt`).
fn file_path(path: &str) -> Result<String, Response> {
    if path.is_empty() {
        return Err(empty_path());
    }
    resolve_workspace_path(&format!("/{path}")).ok_or_else(|| {
        error_json(
            403,
            "invalid_request",
            "path must resolve to a location within /workspace",
        )
    })
}

fn empty_path() -> Response {
    error_json(400, "invalid_request", "file path must not be empty")
}

async fn read_file(
    State(shared): State<Arc<Shared>>,
    Path((id, path)): Path<(String, String)>,
    headers: HeaderMap,
) -> Response {
    let resolved = match file_path(&path) {
        Ok(p) => p,
        Err(r) => return r,
    };
    if let Err(r) = session_header(&headers) {
        return r;
    }
    let inner = match shared.sandbox(&id).await {
        Ok(i) => i,
        Err(r) => return r,
    };
    let not_found = || {
        error_json(
            404,
            "workspace_read_not_found",
            format!("File not found: {resolved}"),
        )
    };
    let failed = |e: harness_core::Error| {
        error_json(502, "exec_transport_error", format!("read failed: {e}"))
    };
    let stream = match inner.sandbox.read_file(&resolved).await {
        Ok(s) => s,
        Err(e) if e.kind() == ErrorKind::NotFound => return not_found(),
        Err(e) => return failed(e),
    };
    // A provider may report a missing file as the stream's first item: look
    // before promising a 200.
    // Fused: for an empty file the peek below sees the end, and the chain
    // polls the stream once more (an `unfold` panics if polled after it
    // ended).
    let mut stream = stream.fuse();
    let first = match stream.next().await {
        Some(Err(e)) if e.kind() == ErrorKind::NotFound => return not_found(),
        Some(Err(e)) => return failed(e),
        first => first,
    };
    let rest = futures::stream::iter(first).chain(stream).map(|item| {
        item.map_err(|e| std::io::Error::other(format!("reading the file failed: {e}")))
    });
    let mut response = Response::new(Body::from_stream(rest));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    response
}

async fn write_file(
    State(shared): State<Arc<Shared>>,
    Path((id, path)): Path<(String, String)>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let resolved = match file_path(&path) {
        Ok(p) => p,
        Err(r) => return r,
    };
    if let Err(r) = session_header(&headers) {
        return r;
    }
    let inner = match shared.sandbox(&id).await {
        Ok(i) => i,
        Err(r) => return r,
    };
    let (bytes, total) = match read_body(body, MAX_BODY_BYTES).await {
        Ok(b) => b,
        Err(e) => {
            return error_json(
                502,
                "workspace_archive_write_error",
                format!("write failed: {e}"),
            )
        }
    };
    if total > MAX_BODY_BYTES {
        // Not in the document's error codes, but what the bridge answers.
        return error_json(
            413,
            "payload_too_large",
            format!("payload too large: {total} bytes exceeds the {MAX_BODY_BYTES}-byte limit"),
        );
    }
    match inner
        .sandbox
        .write_file(&resolved, harness_core::stream::once(bytes))
        .await
    {
        Ok(_) => Json(json!({ "ok": true })).into_response(),
        Err(e) => error_json(
            502,
            "workspace_archive_write_error",
            format!("write failed: {e}"),
        ),
    }
}

/// The bridge's `validatePort`: an integer in 1024–65535, not 3000 (the
/// container's control port).
fn tunnel_port(raw: &str) -> Result<u16, Response> {
    raw.parse::<u16>()
        .ok()
        .filter(|p| *p >= 1024 && *p != 3000)
        .ok_or_else(|| error_json(400, "invalid_request", "Invalid port"))
}

async fn create_tunnel(
    State(shared): State<Arc<Shared>>,
    Path((id, port)): Path<(String, String)>,
    body: Bytes,
) -> Response {
    let port = match tunnel_port(&port) {
        Ok(p) => p,
        Err(r) => return r,
    };
    let mut name = None;
    let text = String::from_utf8_lossy(&body);
    if !text.trim().is_empty() {
        let Ok(options) = serde_json::from_str::<Value>(&text) else {
            return error_json(400, "invalid_request", "Invalid JSON body");
        };
        match options.get("name") {
            None => {}
            Some(Value::String(n)) => name = Some(n.clone()),
            Some(_) => {
                return error_json(
                    400,
                    "invalid_request",
                    "name must be a string when provided",
                )
            }
        }
    }
    let inner = match shared.sandbox(&id).await {
        Ok(i) => i,
        Err(r) => return r,
    };
    if let Some(existing) = inner.tunnels.lock().unwrap().get(&port) {
        return Json(existing.clone()).into_response();
    }
    // Instead of a public tunnel: the sandbox's own address, which the host
    // reaches directly (a Docker container's bridge IP).
    let address = match collect_exec(
        match inner
            .sandbox
            .exec(ExecRequest::new(["hostname", "-i"]))
            .await
        {
            Ok(s) => s,
            Err(e) => return error_json(502, "tunnel_error", format!("tunnel failed: {e}")),
        },
    )
    .await
    {
        Ok(out) if out.status.success() => out
            .stdout_str()
            .split_whitespace()
            .next()
            .map(str::to_string),
        Ok(out) => {
            return error_json(
                502,
                "tunnel_error",
                format!(
                    "tunnel failed: hostname -i: {:?} {}",
                    out.status,
                    out.stderr_str().trim()
                ),
            )
        }
        Err(e) => return error_json(502, "tunnel_error", format!("tunnel failed: {e}")),
    };
    let Some(address) = address else {
        return error_json(
            502,
            "tunnel_error",
            "tunnel failed: the sandbox has no address (hostname -i printed nothing)",
        );
    };
    let host = if address.contains(':') {
        format!("[{address}]")
    } else {
        address.clone()
    };
    let mut tunnel = json!({
        "id": random_id(),
        "port": port,
        "url": format!("http://{host}:{port}"),
        "hostname": address,
        "createdAt": now_rfc3339(),
    });
    if let Some(name) = name {
        tunnel["name"] = Value::String(name);
    }
    let tunnel = inner
        .tunnels
        .lock()
        .unwrap()
        .entry(port)
        .or_insert(tunnel)
        .clone();
    Json(tunnel).into_response()
}

async fn destroy_tunnel(
    State(shared): State<Arc<Shared>>,
    Path((id, port)): Path<(String, String)>,
) -> Response {
    let port = match tunnel_port(&port) {
        Ok(p) => p,
        Err(r) => return r,
    };
    if let Some(inner) = shared.existing(&id) {
        inner.tunnels.lock().unwrap().remove(&port);
    }
    StatusCode::NO_CONTENT.into_response()
}

async fn running(State(shared): State<Arc<Shared>>, Path(id): Path<String>) -> Response {
    // Only a sandbox that exists and answers a trivial command runs; asking
    // must not make one.
    let running = match shared.existing(&id) {
        None => false,
        Some(inner) => match inner.sandbox.exec(ExecRequest::new(["true"])).await {
            Ok(s) => collect_exec(s).await.is_ok_and(|o| o.status.success()),
            Err(_) => false,
        },
    };
    Json(json!({ "running": running })).into_response()
}

async fn pty(headers: HeaderMap) -> Response {
    let upgrade = headers
        .get(header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if !upgrade.eq_ignore_ascii_case("websocket") {
        return error_json(400, "invalid_request", "WebSocket upgrade required");
    }
    error_json(
        502,
        "exec_transport_error",
        "terminal failed: the test bridge has no PTY support",
    )
}

async fn persist(
    State(shared): State<Arc<Shared>>,
    Path(id): Path<String>,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    let excludes: Vec<&str> = query
        .get("excludes")
        .map(|e| e.split(',').filter(|s| !s.is_empty()).collect())
        .unwrap_or_default();
    if excludes.iter().any(|e| e.contains("..")) {
        return error_json(
            400,
            "invalid_request",
            "exclude paths must not contain \"..\"",
        );
    }
    let inner = match shared.sandbox(&id).await {
        Ok(i) => i,
        Err(r) => return r,
    };
    // The bridge's command, with the archive on stdout instead of a
    // temporary file.
    let mut command = String::from("tar cf -");
    for rel in &excludes {
        let rel = rel.strip_prefix("./").unwrap_or(rel);
        command.push_str(&format!(" --exclude {}", shell_quote(&format!("./{rel}"))));
    }
    command.push_str(&format!(" -C {} .", shell_quote(WORKSPACE)));
    let mut events = match inner.sandbox.exec(ExecRequest::shell(command)).await {
        Ok(s) => s,
        Err(e) => {
            return error_json(
                502,
                "workspace_archive_read_error",
                format!("persist failed: {e}"),
            )
        }
    };
    // The bridge answers 502 when tar fails; hold the status back until the
    // archive's first bytes (or tar's end) show which it is.
    let mut stderr = BytesMut::new();
    let first = loop {
        match events.next().await {
            Some(Ok(ExecEvent::Stdout(b))) if !b.is_empty() => break Some(b),
            Some(Ok(ExecEvent::Stdout(_))) => {}
            Some(Ok(ExecEvent::Stderr(b))) => stderr.extend_from_slice(&b),
            Some(Ok(ExecEvent::Exit(status))) if status.success() => break None,
            Some(Ok(ExecEvent::Exit(status))) => {
                return error_json(
                    502,
                    "workspace_archive_read_error",
                    format!(
                        "tar failed (exit {}): {}",
                        exit_code(status),
                        String::from_utf8_lossy(&stderr).trim()
                    ),
                )
            }
            Some(Err(e)) => {
                return error_json(
                    502,
                    "workspace_archive_read_error",
                    format!("persist failed: {e}"),
                )
            }
            None => {
                return error_json(
                    502,
                    "workspace_archive_read_error",
                    "persist failed: tar ended without an exit status",
                )
            }
        }
    };
    // Once streaming, a failure can only cut the body short: the client
    // sees a broken transfer, never a silently truncated archive.
    let rest = futures::stream::unfold(Some((events, first, stderr)), |state| async move {
        let (mut events, first, mut stderr) = state?;
        if let Some(b) = first {
            return Some((Ok(b), Some((events, None, stderr))));
        }
        loop {
            match events.next().await {
                Some(Ok(ExecEvent::Stdout(b))) => {
                    return Some((Ok(b), Some((events, None, stderr))))
                }
                Some(Ok(ExecEvent::Stderr(b))) => stderr.extend_from_slice(&b),
                Some(Ok(ExecEvent::Exit(status))) if status.success() => return None,
                Some(Ok(ExecEvent::Exit(status))) => {
                    return Some((
                        Err(std::io::Error::other(format!(
                            "tar failed (exit {}): {}",
                            exit_code(status),
                            String::from_utf8_lossy(&stderr).trim()
                        ))),
                        None,
                    ))
                }
                Some(Err(e)) => return Some((Err(std::io::Error::other(e.to_string())), None)),
                None => {
                    return Some((
                        Err(std::io::Error::other("tar ended without an exit status")),
                        None,
                    ))
                }
            }
        }
    });
    let mut response = Response::new(Body::from_stream(rest));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    response
}

fn exit_code(status: ExitStatus) -> i32 {
    status
        .code
        .unwrap_or_else(|| 128 + status.signal.unwrap_or(0))
}

async fn hydrate(
    State(shared): State<Arc<Shared>>,
    Path(id): Path<String>,
    body: Body,
) -> Response {
    let inner = match shared.sandbox(&id).await {
        Ok(i) => i,
        Err(r) => return r,
    };
    let (tar, total) = match read_body(body, MAX_BODY_BYTES).await {
        Ok(b) => b,
        Err(_) => return error_json(400, "invalid_request", "Could not read request body"),
    };
    if total == 0 {
        return error_json(400, "invalid_request", "Empty tar payload");
    }
    if total > MAX_BODY_BYTES {
        return error_json(
            400,
            "invalid_request",
            format!("tar payload too large: {total} bytes exceeds the {MAX_BODY_BYTES}-byte limit"),
        );
    }
    let command = format!(
        "mkdir -p {root} && tar xf - -C {root}",
        root = shell_quote(WORKSPACE)
    );
    let out = match inner
        .sandbox
        .exec(ExecRequest::shell(command).stdin(tar))
        .await
    {
        Ok(s) => collect_exec(s).await,
        Err(e) => Err(e),
    };
    match out {
        Ok(out) if out.status.success() => Json(json!({ "ok": true })).into_response(),
        Ok(out) => error_json(
            502,
            "workspace_archive_write_error",
            format!(
                "tar extract failed (exit {}): {}",
                exit_code(out.status),
                out.stderr_str().trim()
            ),
        ),
        Err(e) => error_json(
            502,
            "workspace_archive_write_error",
            format!("hydrate failed: {e}"),
        ),
    }
}

async fn mount(body: Bytes) -> Response {
    if serde_json::from_slice::<Value>(&body).is_err() {
        return error_json(400, "invalid_request", "Invalid JSON body");
    }
    error_json(
        502,
        "mount_error",
        "mount failed: the test bridge cannot mount buckets",
    )
}

async fn unmount(body: Bytes) -> Response {
    if serde_json::from_slice::<Value>(&body).is_err() {
        return error_json(400, "invalid_request", "Invalid JSON body");
    }
    error_json(
        502,
        "unmount_error",
        "unmount failed: the test bridge cannot mount buckets",
    )
}

async fn create_session(
    State(shared): State<Arc<Shared>>,
    Path(id): Path<String>,
    body: Bytes,
) -> Response {
    // The bridge reads the body leniently: no or bad JSON is `{}`.
    let body: Value = serde_json::from_slice(&body).unwrap_or_else(|_| json!({}));
    let inner = match shared.sandbox(&id).await {
        Ok(i) => i,
        Err(r) => return r,
    };
    let sid = match body.get("id").and_then(Value::as_str) {
        Some(sid) if !valid_session_id(sid) => {
            return error_json(
                502,
                "session_error",
                format!("session create failed: invalid session id {sid:?}"),
            )
        }
        Some(sid) => sid.to_string(),
        None => format!("session-{}", &random_id()[..16]),
    };
    let env = body
        .get("env")
        .and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string())))
                .collect()
        })
        .unwrap_or_default();
    let cwd = body.get("cwd").and_then(Value::as_str).map(str::to_string);
    // An existing id is answered again, its session left as it is.
    inner
        .sessions
        .lock()
        .unwrap()
        .entry(sid.clone())
        .or_insert(Session { cwd, env });
    Json(json!({ "id": sid })).into_response()
}

async fn delete_session(
    State(shared): State<Arc<Shared>>,
    Path((id, sid)): Path<(String, String)>,
) -> Response {
    if let Some(inner) = shared.existing(&id) {
        inner.sessions.lock().unwrap().remove(&sid);
    }
    Json(json!({ "success": true, "sessionId": sid })).into_response()
}

async fn pool_stats(State(shared): State<Arc<Shared>>) -> Response {
    let live = shared
        .sandboxes
        .lock()
        .unwrap()
        .values()
        .filter(|c| c.initialized())
        .count();
    // No warm pool here: every sandbox is made on demand.
    Json(json!({
        "warm": 0,
        "assigned": live,
        "total": live,
        "config": { "warmTarget": 0, "refreshInterval": 0 },
        "maxInstances": null,
    }))
    .into_response()
}

async fn pool_ok() -> Response {
    Json(json!({ "ok": true })).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workspace_confinement() {
        assert_eq!(
            resolve_workspace_path("a/b").as_deref(),
            Some("/workspace/a/b")
        );
        assert_eq!(
            resolve_workspace_path("/workspace").as_deref(),
            Some("/workspace")
        );
        assert_eq!(resolve_workspace_path("/workspace/../etc"), None);
        assert_eq!(resolve_workspace_path("../x"), None);
        assert_eq!(resolve_workspace_path("/workspacex"), None);
        assert_eq!(resolve_workspace_path("/tmp"), None);
    }

    #[test]
    fn ids_are_bridge_shaped() {
        let id = random_id();
        assert_eq!(id.len(), 26);
        assert!(id.bytes().all(|b| matches!(b, b'a'..=b'z' | b'2'..=b'7')));
        assert_eq!(base32(b"foobar"), "mzxw6ytboi");
    }

    #[test]
    fn sse_frames() {
        assert_eq!(
            sse_frame("exit", "{\"exit_code\":0}"),
            "event: exit\ndata: {\"exit_code\":0}\n\n"
        );
        assert_eq!(sse_frame("x", "a\nb"), "event: x\ndata: a\ndata: b\n\n");
        let ts = now_rfc3339();
        assert_eq!(ts.len(), 24, "{ts}");
    }
}
