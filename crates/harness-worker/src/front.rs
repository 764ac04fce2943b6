//! The Worker's front: the session API's routes, answered with
//! `session-api`'s rules exactly as `session-server` answers them (paths,
//! JSON, statuses, bearer roles), then handed to the session's Durable
//! Object. A refused request (401, 403, 400, 413) is answered here and never
//! reaches the object, so it writes nothing.
//!
//! Served: `POST /v1/sessions`, `GET /v1/sessions/{id}`, `POST
//! …/messages`, `GET …/events` (SSE, `Last-Event-ID`), `GET …/frames`,
//! `GET …/export`, `GET …/ui-stream`, `POST …/seal`, fork, WebSocket, and
//! Durable Streams (`/v1/stream/*`: generic streams in the streams object,
//! session streams in the session's object), and `GET /v1/sessions` (the
//! directory object's ids, each session's info from its object), `GET
//! /v1/search` (every session's object searches its own index; merged
//! here), and retention: `POST /v1/sessions/{id}/trim` and `DELETE
//! /v1/sessions/{id}`. Not yet:
//! the runner channel `/v1/runner` — it answers 501 `unsupported`. Tests
//! only (the `test-routes` feature): the engine API `POST
//! /v1/test/engine/<op>` with `HARNESS_TEST_EXECUTOR_URL` set
//! (`engine_api.rs`), and the stores' conformance routes `POST
//! /v1/test/log/<op>` and `/v1/test/checkpoints/<op>` (`test_routes.rs`).

// `#[event(fetch)]` expands to unsafe blocks: allowed here, denied
// elsewhere in the crate.
#![allow(unsafe_code)]

use harness_core::actor::ClientMessage;
use harness_core::checkpoint::CheckpointStore;
use harness_core::log::DEFAULT_MAX_FRAME_BYTES;
use harness_core::stream::ByteStream;
use harness_core::SessionId;
use serde::Serialize;
use session_api::auth::{
    authorize, bearer, check_client_message, GrantRole, CLIENTS, HOST, READERS,
};
use session_api::request::{self, CreateSession, MAX_CREATE_BODY};
use session_api::{ws, ApiError, TokenGrant};
use worker::{event, Context, Env, Headers, Method, Request, RequestInit, Response};

use crate::checkpoints::R2Store;

/// The header carrying the session id from the front to its object.
pub(crate) const SESSION_HEADER: &str = "x-harness-session";
/// Set by the front on a forwarded WebSocket upgrade: "1" when the token
/// holds the host grant (a client socket of a host may seal).
pub(crate) const GRANT_HOST_HEADER: &str = "x-harness-grant-host";

/// `HARNESS_MAX_FRAME_BYTES`, else 1 MiB.
pub(crate) fn max_frame_bytes(env: &Env) -> usize {
    env.var("HARNESS_MAX_FRAME_BYTES")
        .ok()
        .and_then(|v| v.to_string().trim().parse().ok())
        .unwrap_or(DEFAULT_MAX_FRAME_BYTES)
}

/// A JSON response.
pub(crate) fn json_response<T: Serialize>(status: u16, value: &T) -> Result<Response, ApiError> {
    Response::from_json(value)
        .map(|r| r.with_status(status))
        .map_err(|e| ApiError::new(500, "internal", e.to_string()))
}

/// The JSON error every server sends.
pub(crate) fn error_response(e: &ApiError) -> worker::Result<Response> {
    Ok(Response::from_json(&e.body())?.with_status(e.status))
}

#[event(fetch)]
async fn fetch(req: Request, env: Env, ctx: Context) -> worker::Result<Response> {
    match route(req, &env, &ctx).await {
        Ok(response) => Ok(response),
        Err(e) => error_response(&e),
    }
}

/// The token table and switches, from the Worker's variables.
struct Auth {
    grants: Vec<TokenGrant>,
    insecure_no_auth: bool,
}

impl Auth {
    fn from_env(env: &Env) -> Result<Self, ApiError> {
        let grants = match env.var("HARNESS_TOKENS") {
            Ok(v) => serde_json::from_str(&v.to_string()).map_err(|e| {
                ApiError::new(
                    500,
                    "internal",
                    format!("HARNESS_TOKENS is not a token table: {e}"),
                )
            })?,
            Err(_) => Vec::new(),
        };
        let insecure_no_auth = env
            .var("HARNESS_INSECURE_NO_AUTH")
            .is_ok_and(|v| v.to_string() == "1");
        Ok(Self {
            grants,
            insecure_no_auth,
        })
    }
}

struct Call<'a> {
    req: Request,
    env: &'a Env,
    auth: Auth,
    params: std::collections::HashMap<String, String>,
    query: String,
}

impl Call<'_> {
    fn authorize(
        &self,
        session: Option<&SessionId>,
        allowed: &[GrantRole],
    ) -> Result<GrantRole, ApiError> {
        let header = self.req.headers().get("authorization").ok().flatten();
        let token = bearer(
            header.as_deref().map(str::as_bytes),
            self.params.get("access_token").map(String::as_str),
        );
        authorize(
            &self.auth.grants,
            self.auth.insecure_no_auth,
            token.as_deref(),
            session,
            allowed,
        )
    }

    /// The body, refusing more than `limit` bytes with the 413 session-server sends.
    async fn body(&mut self, limit: usize) -> Result<Vec<u8>, ApiError> {
        match limited_body(&mut self.req, limit).await {
            Ok(bytes) => Ok(bytes),
            Err(None) => Err(request::body_too_large(limit)),
            Err(Some(e)) => Err(ApiError::invalid(format!(
                "could not read the request body: {e}"
            ))),
        }
    }

    /// Call `session`'s object on `op` (its query: this request's, or
    /// `query`), with `body`.
    async fn object(
        &self,
        session: &SessionId,
        method: Method,
        op: &str,
        query: Option<String>,
        body: Option<Vec<u8>>,
    ) -> Result<Response, ApiError> {
        let query = query.unwrap_or_else(|| self.query.clone());
        session_object(self.env, session, method, op, &query, body).await
    }
}

/// `op` of `session`'s Durable Object (`object.rs`), with `query` and
/// `body` (`turns::object_request`, with the session API's error).
pub(crate) async fn session_object(
    env: &Env,
    session: &SessionId,
    method: Method,
    op: &str,
    query: &str,
    body: Option<Vec<u8>>,
) -> Result<Response, ApiError> {
    crate::turns::object_request(
        env,
        session.as_str(),
        method,
        &format!("{op}?{query}"),
        body,
    )
    .await
    .map_err(internal)
}

/// `req`'s body if it is at most `limit` bytes (by its declared length,
/// then by what arrived): `Err(None)` when larger, `Err(Some(e))` when it
/// could not be read.
pub(crate) async fn limited_body(
    req: &mut Request,
    limit: usize,
) -> Result<Vec<u8>, Option<worker::Error>> {
    let declared = req
        .headers()
        .get("content-length")
        .ok()
        .flatten()
        .and_then(|v| v.parse::<usize>().ok());
    if declared.is_some_and(|n| n > limit) {
        return Err(None);
    }
    let bytes = req.bytes().await.map_err(Some)?;
    if bytes.len() > limit {
        return Err(None);
    }
    Ok(bytes)
}

async fn route(req: Request, env: &Env, ctx: &Context) -> Result<Response, ApiError> {
    let url = req
        .url()
        .map_err(|e| ApiError::new(500, "internal", e.to_string()))?;
    let query = url.query().unwrap_or("").to_string();
    let method = req.method();
    let mut call = Call {
        params: request::parse_query(&query),
        req,
        env,
        auth: Auth::from_env(env)?,
        query,
    };
    let path = url.path().to_string();
    let segments: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let max_frame = max_frame_bytes(env);
    match (method, segments.as_slice()) {
        (Method::Post, ["v1", "sessions"]) => create_session(&mut call).await,
        (Method::Get, ["v1", "sessions"]) => {
            call.authorize(None, HOST)?;
            list_sessions(&call).await
        }
        (Method::Get, ["v1", "sessions", id]) => {
            let id = request::session_id(id)?;
            call.authorize(Some(&id), READERS)?;
            call.object(&id, Method::Get, "info", None, None).await
        }
        (Method::Post, ["v1", "sessions", id, "messages"]) => {
            post_message(&mut call, id, max_frame).await
        }
        (Method::Get, ["v1", "sessions", id, "events"]) => {
            let id = request::session_id(id)?;
            call.authorize(Some(&id), READERS)?;
            let header = call.req.headers().get("last-event-id").ok().flatten();
            let after = request::events_after(header.as_deref().map(str::as_bytes), &call.params)?;
            call.object(
                &id,
                Method::Get,
                "events",
                Some(format!("after={after}")),
                None,
            )
            .await
        }
        (
            Method::Get,
            ["v1", "sessions", id, op @ ("frames" | "export" | "ui-stream" | "verify")],
        ) => {
            let id = request::session_id(id)?;
            call.authorize(Some(&id), READERS)?;
            call.object(&id, Method::Get, op, None, None).await
        }
        (Method::Post, ["v1", "sessions", id, "seal"]) => {
            let id = request::session_id(id)?;
            call.authorize(Some(&id), HOST)?;
            call.object(&id, Method::Post, "seal", Some(String::new()), None)
                .await
        }
        (Method::Post, ["v1", "sessions", id, "fork"]) => fork(&call, id).await,
        (Method::Post, ["v1", "sessions", id, "trim"]) => {
            // Retention (docs/retention.md): frames 1..=through go.
            let id = request::session_id(id)?;
            call.authorize(Some(&id), HOST)?;
            let body = call.body(MAX_CREATE_BODY).await?;
            request::trim_through(&body)?;
            call.object(&id, Method::Post, "trim", Some(String::new()), Some(body))
                .await
        }
        (Method::Delete, ["v1", "sessions", id]) => delete_session(&call, id).await,
        (Method::Get, ["v1", "sessions", id, "ws"]) => open_websocket(&call, id).await,
        (method, ["v1", "stream", "sessions", id]) => session_stream(call, method, id, &path).await,
        (method, ["v1", "stream", _, ..]) => streams(call, method, &path).await,
        (Method::Get, ["v1", "checkpoints", "objects"]) => {
            call.authorize(None, HOST)?;
            let store = R2Store::from_env(call.env)?;
            let prefix = call.params.get("prefix").cloned().unwrap_or_default();
            json_response(200, &store.list(&prefix).await?)
        }
        (method, ["v1", "checkpoints", "objects", key @ ..]) => {
            call.authorize(None, HOST)?;
            checkpoint_object(call, method, &key.join("/")).await
        }
        (Method::Post, ["v1", "checkpoints", op @ ("checkpoint" | "restore")]) => {
            call.authorize(None, HOST)?;
            checkpoint_move(call, op).await
        }
        (_, ["v1", "broker", "s", session, api, rest @ ..]) => {
            // The model broker (broker.rs): a turn token, not a grant.
            let rest = rest.join("/");
            crate::broker::forward(call.req, env, ctx, session, api, &rest)
                .await
                .map_err(internal)
        }
        (_, ["v1", "runner"]) => Err(unsupported("the runner channel on the Worker")),
        (Method::Get, ["v1", "search"]) => {
            call.authorize(None, HOST)?;
            search(&call).await
        }
        #[cfg(feature = "test-routes")]
        (Method::Post, ["v1", "test", suite, op]) => {
            test_route(&mut call, suite, op, max_frame).await
        }
        (_, ["v1", "sessions", ..]) => Err(ApiError::new(
            405,
            "method_not_allowed",
            "this endpoint does not take that method",
        )),
        _ => Err(ApiError::no_route()),
    }
}

/// `DELETE /v1/sessions/{id}`, retention (docs/retention.md): the object
/// empties itself, then the directory forgets the id.
async fn delete_session(call: &Call<'_>, id: &str) -> Result<Response, ApiError> {
    let id = request::session_id(id)?;
    call.authorize(Some(&id), HOST)?;
    let answer = call
        .object(&id, Method::Delete, "delete", Some(String::new()), None)
        .await?;
    if answer.status_code() == 204 {
        forget_session(call.env, &id).await?;
    }
    Ok(answer)
}

/// `POST /v1/test/<suite>/<op>` (`test-routes` builds only): the
/// conformance suites' ways in — the engine suite (engine_api.rs, when
/// enabled), the log suite and the checkpoint suite (test_routes.rs).
#[cfg(feature = "test-routes")]
async fn test_route(
    call: &mut Call<'_>,
    suite: &str,
    op: &str,
    max_frame: usize,
) -> Result<Response, ApiError> {
    match suite {
        "engine" if crate::engine_api::enabled(call.env) => {
            // A runner's grant, as starting and steering turns is a runner's.
            call.authorize(None, &[GrantRole::Runner])?;
            let body = call.body(max_frame).await?;
            crate::engine_api::serve(call.env, op, &body)
                .await
                .map_err(internal)
        }
        "log" => {
            let id = call
                .params
                .get("session")
                .map(|s| request::session_id(s))
                .transpose()?
                .ok_or_else(|| ApiError::invalid("?session= is required"))?;
            call.authorize(Some(&id), HOST)?;
            if op == "create" {
                record_session(call.env, &id).await?;
            }
            let body = call.body(max_frame.saturating_mul(2)).await?;
            let object_op = format!("{}{op}", crate::test_routes::LOG_OP);
            let answer = call
                .object(&id, Method::Post, &object_op, None, Some(body))
                .await?;
            if op == "delete" && answer.status_code() == 200 {
                forget_session(call.env, &id).await?;
            }
            Ok(answer)
        }
        "checkpoints" => {
            call.authorize(None, HOST)?;
            let limit = R2Store::from_env(call.env)?.max_bytes();
            let body = call.body(limit).await?;
            crate::test_routes::checkpoints(call.env, op, &call.params, body)
                .await
                .map_err(internal)
        }
        _ => Err(ApiError::no_route()),
    }
}

/// `POST /v1/sessions`: as session-server, the body is read and checked
/// first, then the token; the session is recorded in the directory, then
/// created in its object.
async fn create_session(call: &mut Call<'_>) -> Result<Response, ApiError> {
    let bytes = call.body(MAX_CREATE_BODY).await?;
    let create = CreateSession::parse(&bytes)?;
    let id = create.session_id(&random_hex())?;
    call.authorize(Some(&id), HOST)?;
    let config = create.config(&[], &[])?;
    // Listed before it exists, so it is never missing from the list.
    record_session(call.env, &id).await?;
    let body = serde_json::to_vec(&config).map_err(|e| ApiError::invalid(e.to_string()))?;
    call.object(&id, Method::Post, "create", Some(String::new()), Some(body))
        .await
}

/// `POST …/messages`: a client's message, within the frame limit, to the
/// session's object (`seal` only with the host grant).
async fn post_message(
    call: &mut Call<'_>,
    id: &str,
    max_frame: usize,
) -> Result<Response, ApiError> {
    let id = request::session_id(id)?;
    let grant = call.authorize(Some(&id), CLIENTS)?;
    let bytes = call.body(request::body_limit(max_frame)).await?;
    let message: ClientMessage = serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::invalid(format!("malformed client message: {e}")))?;
    check_client_message(&message, grant)?;
    call.object(&id, Method::Post, "messages", None, Some(bytes))
        .await
}

/// `POST …/fork`: as session-server, the target (given or generated), the
/// host on both, then the source's prefix copied into the target's new
/// object, and an optional seal of the fork.
async fn fork(call: &Call<'_>, id: &str) -> Result<Response, ApiError> {
    let source = request::session_id(id)?;
    let target = match call.params.get("target") {
        Some(t) => request::session_id(t)?,
        None => {
            let base = &source.as_str()[..source.as_str().len().min(80)];
            request::session_id(&format!("{base}-fork-{}", random_hex()))?
        }
    };
    call.authorize(Some(&source), HOST)?;
    call.authorize(Some(&target), HOST)?;
    record_session(call.env, &target).await?;
    let query = match request::param_u64(&call.params, "until")? {
        Some(until) => format!("until={until}"),
        None => String::new(),
    };
    let mut prefix = call
        .object(&source, Method::Get, "fork-prefix", Some(query), None)
        .await?;
    if prefix.status_code() != 200 {
        // The source's own answer: 404 unknown, 400 past its end.
        return Ok(prefix);
    }
    let bytes = prefix.bytes().await.map_err(internal)?;
    let mut created = call
        .object(
            &target,
            Method::Post,
            "fork-into",
            Some(String::new()),
            Some(bytes),
        )
        .await?;
    if created.status_code() != 201 || !request::param_flag(&call.params, "seal") {
        return Ok(created);
    }
    let info: serde_json::Value = created.json().await.map_err(internal)?;
    if info["sealed"] == true {
        return json_response(201, &info);
    }
    let mut sealed = call
        .object(&target, Method::Post, "seal", Some(String::new()), None)
        .await?;
    if sealed.status_code() != 200 {
        return Ok(sealed);
    }
    let info: serde_json::Value = sealed.json().await.map_err(internal)?;
    json_response(201, &info)
}

/// `GET …/ws`: the token and role are checked here; the upgrade itself goes
/// to the session's object, which holds the socket.
async fn open_websocket(call: &Call<'_>, id: &str) -> Result<Response, ApiError> {
    let id = request::session_id(id)?;
    let role = ws::role(&call.params)?;
    let grant = call.authorize(Some(&id), ws::grants_for(role))?;
    let headers = call.req.headers().clone();
    let host = if grant == GrantRole::Host { "1" } else { "0" };
    headers.set(GRANT_HOST_HEADER, host).map_err(internal)?;
    forward_to_session(call, &id, Method::Get, "ws", headers).await
}

/// A generic Durable Stream: `OPTIONS` answered here (CORS needs no
/// token), everything else checked as `session-server` checks it (a host
/// grant, the body under the protocol's limit) and forwarded to the streams
/// object. Refusals are the protocol's plain-text answers.
async fn streams(mut call: Call<'_>, method: Method, path: &str) -> Result<Response, ApiError> {
    use durable_streams::protocol::{body_too_large, Reply};
    if method == Method::Options {
        return stream_reply(Reply::new(http::StatusCode::NO_CONTENT));
    }
    if let Err(e) = call.authorize(None, HOST) {
        return stream_refusal(e.status, e.message);
    }
    let body = if matches!(method, Method::Put | Method::Post) {
        let limit = crate::streams::max_body_bytes(call.env);
        match call.body(limit).await {
            Ok(b) => Some(b),
            Err(e) if e.status == 413 => return stream_reply(body_too_large(limit)),
            Err(e) => return stream_refusal(e.status, e.message),
        }
    } else {
        None
    };
    let headers = call.req.headers().clone();
    let mut init = RequestInit::new();
    init.with_method(method).with_headers(headers);
    if let Some(body) = body {
        let array = worker::js_sys::Uint8Array::from(body.as_slice());
        init.with_body(Some(array.into()));
    }
    let query = if call.query.is_empty() {
        String::new()
    } else {
        format!("?{}", call.query)
    };
    let url = format!("https://streams.internal{path}{query}");
    let request = Request::new_with_init(&url, &init).map_err(internal)?;
    let namespace = call.env.durable_object("STREAMS").map_err(internal)?;
    let stub = namespace
        .id_from_name(crate::streams::STREAMS_OBJECT)
        .and_then(|i| i.get_stub())
        .map_err(internal)?;
    stub.fetch_with_request(request).await.map_err(internal)
}

/// A Durable Streams answer (CORS headers included).
fn stream_reply(reply: durable_streams::protocol::Reply) -> Result<Response, ApiError> {
    crate::streams::respond(reply).map_err(internal)
}

/// A refusal as Durable Streams answers one: the status and a plain-text
/// message, not the session API's JSON error.
fn stream_refusal(status: u16, message: String) -> Result<Response, ApiError> {
    let status = http::StatusCode::from_u16(status).unwrap_or(http::StatusCode::FORBIDDEN);
    stream_reply(durable_streams::protocol::Reply::text(status, message))
}

/// A session's log as a Durable Stream: checked as `session-server`
/// checks it (a client or runner grant on the session), answered by the
/// session's object (read-only: writes get 405).
async fn session_stream(
    call: Call<'_>,
    method: Method,
    id: &str,
    path: &str,
) -> Result<Response, ApiError> {
    use durable_streams::protocol::Reply;
    if method == Method::Options {
        return stream_reply(Reply::new(http::StatusCode::NO_CONTENT));
    }
    let id = match SessionId::parse(id) {
        Ok(id) => id,
        Err(e) => return stream_refusal(400, e.to_string()),
    };
    if let Err(e) = call.authorize(Some(&id), &[GrantRole::Client, GrantRole::Runner]) {
        return stream_refusal(e.status, e.message);
    }
    let headers = call.req.headers().clone();
    headers
        .set(crate::session_streams::PATH_HEADER, path)
        .map_err(internal)?;
    forward_to_session(&call, &id, method, "stream", headers).await
}

/// Hand this request to `id`'s object at `op`, with `headers` (plus the
/// session header) and this request's query: for what the object answers
/// from the client's own request (a WebSocket upgrade, a stream read).
async fn forward_to_session(
    call: &Call<'_>,
    id: &SessionId,
    method: Method,
    op: &str,
    headers: Headers,
) -> Result<Response, ApiError> {
    headers.set(SESSION_HEADER, id.as_str()).map_err(internal)?;
    let mut init = RequestInit::new();
    init.with_method(method).with_headers(headers);
    let url = format!("https://session.internal/{op}?{}", call.query);
    let request = Request::new_with_init(&url, &init).map_err(internal)?;
    let namespace = call.env.durable_object("SESSIONS").map_err(internal)?;
    let stub = namespace
        .id_from_name(id.as_str())
        .and_then(|i| i.get_stub())
        .map_err(internal)?;
    stub.fetch_with_request(request).await.map_err(internal)
}

/// One checkpoint object in R2 (`checkpoints.rs`): `PUT` stores the body
/// (answering its metadata), `GET` streams it back verified, `HEAD`
/// answers its size and hash as headers, `DELETE` removes it.
async fn checkpoint_object(
    mut call: Call<'_>,
    method: Method,
    key: &str,
) -> Result<Response, ApiError> {
    let store = R2Store::from_env(call.env)?;
    match method {
        Method::Put => {
            let declared = declared_length(&call.req)?;
            let body = call.body(store.max_bytes()).await?;
            check_whole_body(declared, body.len())?;
            let content: ByteStream =
                Box::pin(futures::stream::iter([Ok(bytes::Bytes::from(body))]));
            json_response(200, &store.put(key, content).await?)
        }
        Method::Get => {
            let meta = store.head(key).await?;
            let stream = store.get(key).await?;
            let body = futures::StreamExt::map(stream, |chunk| {
                chunk
                    .map(|b| b.to_vec())
                    .map_err(|e| worker::Error::RustError(e.to_string()))
            });
            let headers = checkpoint_headers(&meta)?;
            Ok(Response::from_stream(body)
                .map_err(internal)?
                .with_headers(headers))
        }
        Method::Head => {
            let meta = store.head(key).await?;
            Ok(Response::empty()
                .map_err(internal)?
                .with_headers(checkpoint_headers(&meta)?))
        }
        Method::Delete => {
            store.delete(key).await?;
            Ok(Response::empty().map_err(internal)?.with_status(204))
        }
        _ => Err(ApiError::new(
            405,
            "method_not_allowed",
            "checkpoint objects take PUT, GET, HEAD and DELETE",
        )),
    }
}

/// A checkpoint `PUT`'s `Content-Length`: required (411 without it). The
/// route buffers the body, and a chunked upload whose client died half-way
/// can reach the Worker looking whole (seen under `wrangler dev`): only a
/// declared length tells a cut body from a complete one.
fn declared_length(req: &Request) -> Result<usize, ApiError> {
    let header = req.headers().get("content-length").ok().flatten();
    header
        .as_deref()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .ok_or_else(|| {
            ApiError::new(
                411,
                "length_required",
                "a checkpoint PUT needs a Content-Length: the body is stored whole or not at \
                 all, and only its declared length tells a body cut short from a complete one",
            )
        })
}

/// `Err` (nothing stored) when the body that arrived is not the declared one.
fn check_whole_body(declared: usize, received: usize) -> Result<(), ApiError> {
    if declared == received {
        return Ok(());
    }
    Err(ApiError::invalid(format!(
        "the body was cut short: {received} of the {declared} bytes declared arrived; nothing \
         was stored"
    )))
}

fn checkpoint_headers(meta: &harness_core::checkpoint::ObjectMeta) -> Result<Headers, ApiError> {
    let headers = Headers::new();
    headers
        .set("x-checkpoint-size", &meta.size.to_string())
        .map_err(internal)?;
    headers
        .set("x-checkpoint-sha256", &meta.sha256)
        .map_err(internal)?;
    Ok(headers)
}

/// What `POST /v1/checkpoints/checkpoint|restore` takes.
#[derive(serde::Deserialize)]
struct MoveRequest {
    /// A sandbox of the Worker's bridge.
    sandbox: harness_core::sandbox::SandboxHandle,
    /// The directory to checkpoint or restore onto.
    dir: String,
    /// The checkpoint key in R2: for a restore, as a checkpoint answered it
    /// (`lineages/<L>/…` for an encrypted one); for a checkpoint, the key
    /// within its lineage.
    key: String,
    /// With the Worker's checkpoint key set: the lineage a checkpoint is
    /// encrypted in (a session and its forks share one). Default `moves`.
    #[serde(default)]
    lineage: Option<String>,
}

/// Core's move pipeline between a bridge sandbox and R2, in the Worker.
async fn checkpoint_move(mut call: Call<'_>, op: &str) -> Result<Response, ApiError> {
    let body = call.body(64 * 1024).await?;
    let request: MoveRequest = serde_json::from_slice(&body)
        .map_err(|e| ApiError::invalid(format!("malformed move request: {e}")))?;
    let store: std::sync::Arc<dyn CheckpointStore> =
        std::sync::Arc::new(R2Store::from_env(call.env)?);
    let lineages =
        harness_moves::crypt::Lineages::new(store, crate::checkpoints::checkpoint_key(call.env)?);
    let provider = crate::turns::bridge_provider(call.env)?;
    let sandbox = provider.resume(&request.sandbox).await?;
    if op == "checkpoint" {
        let lineage = request.lineage.as_deref().unwrap_or("moves");
        let (store, prefix) = lineages.for_new(lineage)?;
        let mut info = harness_moves::checkpoint(
            sandbox.as_ref(),
            &request.dir,
            store.as_ref(),
            &request.key,
            None,
        )
        .await?;
        // The key to restore it by names its lineage.
        info.object.key = format!("{prefix}{}", info.object.key);
        json_response(
            200,
            &serde_json::json!({
                "object": info.object,
                "tar_bytes": info.tar_bytes,
                "encrypted": lineages.encrypts(),
            }),
        )
    } else {
        let (store, key) = lineages.resolve(&request.key)?;
        let info =
            harness_moves::restore(store.as_ref(), &key, sandbox.as_ref(), &request.dir, None)
                .await?;
        json_response(
            200,
            &serde_json::json!({
                "entries": info.summary.entries,
                "content_bytes": info.summary.content_bytes,
                "archive_bytes": info.summary.archive_bytes,
            }),
        )
    }
}

/// The directory object (`directory.rs`) at `path`.
pub(crate) async fn directory(env: &Env, method: Method, path: &str) -> Result<Response, ApiError> {
    let namespace = env.durable_object("DIRECTORY").map_err(internal)?;
    let stub = namespace
        .id_from_name(crate::directory::DIRECTORY_OBJECT)
        .and_then(|i| i.get_stub())
        .map_err(internal)?;
    let mut init = RequestInit::new();
    init.with_method(method);
    let url = format!("https://directory.internal{path}");
    let request = Request::new_with_init(&url, &init).map_err(internal)?;
    stub.fetch_with_request(request).await.map_err(internal)
}

/// A page of the directory's session ids after `after` (`""`: from the
/// first), at most `limit`, in order.
pub(crate) async fn listed_ids(
    env: &Env,
    after: &str,
    limit: usize,
) -> Result<Vec<String>, ApiError> {
    let path = format!("/list?after={after}&limit={limit}");
    let mut ids = directory(env, Method::Get, &path).await?;
    ids.json().await.map_err(internal)
}

/// Record `id` in the directory of sessions.
async fn record_session(env: &Env, id: &SessionId) -> Result<(), ApiError> {
    let path = format!("/add?id={}", id.as_str());
    let answer = directory(env, Method::Post, &path).await?;
    if answer.status_code() != 204 {
        return Err(ApiError::new(
            500,
            "internal",
            format!(
                "the session directory refused {id}: {}",
                answer.status_code()
            ),
        ));
    }
    Ok(())
}

/// Remove `id` from the directory of sessions (after its object emptied
/// itself).
pub(crate) async fn forget_session(env: &Env, id: &SessionId) -> Result<(), ApiError> {
    directory(env, Method::Post, &format!("/remove?id={id}")).await?;
    Ok(())
}

/// `GET /v1/sessions`: a page of the listed sessions' info, by id, as
/// `session-server` pages its log's sessions
/// (`session_api::request::sessions_page`). One request to each session's
/// object; an id whose creation failed (404) is left out, and the next ids
/// of the directory fill its place, so a page is short only at the end.
async fn list_sessions(call: &Call<'_>) -> Result<Response, ApiError> {
    let (after, limit) = request::sessions_page(&call.params)?;
    let mut cursor = after.map(|a| a.as_str().to_string()).unwrap_or_default();
    let mut infos = Vec::with_capacity(limit);
    while infos.len() < limit {
        let ids = listed_ids(call.env, &cursor, limit - infos.len()).await?;
        if ids.is_empty() {
            break;
        }
        for id in ids {
            cursor.clone_from(&id);
            let Ok(id) = SessionId::parse(id) else {
                continue;
            };
            let mut info = call
                .object(&id, Method::Get, "info", Some(String::new()), None)
                .await?;
            match info.status_code() {
                200 => infos.push(info.json::<serde_json::Value>().await.map_err(internal)?),
                404 => {}
                status => {
                    return Err(ApiError::new(
                        500,
                        "internal",
                        format!("the info of session {id} answered {status}"),
                    ))
                }
            }
        }
    }
    json_response(200, &infos)
}

/// Sessions whose objects one search asks at once.
const SEARCH_FAN_OUT: usize = 50;

/// `GET /v1/search` (docs/search.md): every listed session's object
/// searches its own index; the hits are merged best first (lower rank),
/// then by session and seq, and cut at the limit. One subrequest per
/// session, [`SEARCH_FAN_OUT`] at a time.
async fn search(call: &Call<'_>) -> Result<Response, ApiError> {
    // Checked first: bad input is a 400 here as on harness serve.
    let query = session_api::request::search_query(&call.params)?;
    query.check()?;
    let limit = query.limit()?;
    let mut hits: Vec<harness_core::search::SearchHit> = Vec::new();
    let mut cursor = String::new();
    loop {
        let ids = listed_ids(call.env, &cursor, SEARCH_FAN_OUT).await?;
        let Some(last) = ids.last() else { break };
        cursor.clone_from(last);
        let asks = ids
            .iter()
            .filter_map(|id| SessionId::parse(id).ok())
            .map(|id| async move {
                let mut answer = call.object(&id, Method::Get, "search", None, None).await?;
                match answer.status_code() {
                    200 => answer
                        .json::<Vec<harness_core::search::SearchHit>>()
                        .await
                        .map_err(internal),
                    // Listed, but its creation failed: nothing to find.
                    404 => Ok(Vec::new()),
                    status => Err(ApiError::new(
                        500,
                        "internal",
                        format!("the search of session {id} answered {status}"),
                    )),
                }
            });
        for found in futures::future::join_all(asks).await {
            hits.extend(found?);
        }
        hits.sort_by(|a, b| {
            a.rank
                .total_cmp(&b.rank)
                .then_with(|| a.session.as_str().cmp(b.session.as_str()))
                .then(a.seq.cmp(&b.seq))
        });
        hits.truncate(limit);
    }
    json_response(200, &hits)
}

pub(crate) fn internal(e: worker::Error) -> ApiError {
    ApiError::new(500, "internal", e.to_string())
}

fn unsupported(what: &str) -> ApiError {
    ApiError::new(501, "unsupported", format!("{what} is not built yet"))
}

/// 16 hex digits of randomness (session ids are names, not secrets).
fn random_hex() -> String {
    let a = (worker::js_sys::Math::random() * f64::from(u32::MAX)) as u32;
    let b = (worker::js_sys::Math::random() * f64::from(u32::MAX)) as u32;
    format!("{a:08x}{b:08x}")
}
