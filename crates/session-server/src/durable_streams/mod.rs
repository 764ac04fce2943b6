//! The Durable Streams protocol (`/v1/stream/*`) on this server: the
//! `durable-streams` crate's protocol and [`StreamStore`] behind axum, as
//! specified by durable-streams/durable-streams `PROTOCOL.md` and checked by
//! the npm suite `@durable-streams/server-conformance-tests`.
//!
//! - Generic byte and JSON streams live in a [`StreamStore`] (in memory, or
//!   written through to SQLite with [`StreamStore::open`]); the protocol
//!   itself is `durable_streams::protocol`, which the Cloudflare Worker
//!   serves too.
//! - When a session [`Hub`] is attached, `/v1/stream/sessions/<session id>`
//!   is a read-only JSON stream of that session's frames (offsets carry the
//!   frame seq), so any Durable Streams client can follow a session: catch-up
//!   reads come from the hub's log, live reads follow the session's actor.
//!
//! See `docs/durable-streams.md` for what is implemented and how the
//! conformance suite is run.

use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::Response;
use axum::routing::any;
use axum::Router;
use harness_core::SessionId;
use session_runtime::Hub;

use crate::auth::{authorize, bearer, GrantRole, TokenGrant};

mod sessions;

pub use ::durable_streams::protocol::{
    control, control_into, read_params, sse_headers, STREAM_CLOSED, STREAM_CURSOR,
    STREAM_NEXT_OFFSET, STREAM_UP_TO_DATE,
};
pub use ::durable_streams::{
    sse_event, store, strict_uint, util, valid_content_type, AppendOptions, AppendOutcome,
    CreateOptions, Offset, Producer, StoreError, StreamMeta, StreamStore, MAX_BODY_BYTES, PREFIX,
};
use ::durable_streams::{Handled, Request};

/// Who may use the streams: the session server's token table, or nobody
/// checked at all.
#[derive(Debug, Clone, Default)]
pub struct StreamAuth {
    /// Grants as in [`crate::ServerConfig::tokens`]. Generic streams need a
    /// `host` grant; session streams accept `client`/`runner` grants scoped
    /// to the session.
    pub tokens: Vec<TokenGrant>,
    /// Accept every request without a token (local development, tests).
    pub insecure_no_auth: bool,
}

/// Everything the `/v1/stream/*` routes need.
#[derive(Debug, Clone)]
pub struct DurableStreamsState {
    /// Generic streams.
    pub store: Arc<StreamStore>,
    /// How long a long-poll (or an idle SSE connection, between keep-alive
    /// control events) waits for data.
    pub long_poll_timeout: Duration,
    /// When set, sessions are readable at `/v1/stream/sessions/<id>`: read
    /// from the hub's log, followed live through the hub's actors (so every
    /// write to those sessions must go through this hub).
    pub sessions: Option<Arc<Hub>>,
    /// Access control.
    pub auth: StreamAuth,
}

impl DurableStreamsState {
    /// A fresh in-memory store, 30 s long-polls, no session streams, and
    /// no authentication (add tokens through [`DurableStreamsState::auth`]).
    pub fn new() -> Self {
        Self {
            store: Arc::new(StreamStore::new()),
            long_poll_timeout: Duration::from_secs(30),
            sessions: None,
            auth: StreamAuth {
                tokens: Vec::new(),
                insecure_no_auth: true,
            },
        }
    }

    /// The state the session server mounts: its hub's sessions as session
    /// streams, its token table for access, and `config.stream_store` (or a
    /// fresh in-memory store) for generic streams.
    pub fn for_server(config: &crate::ServerConfig, hub: Arc<Hub>) -> Self {
        Self {
            store: config
                .stream_store
                .clone()
                .unwrap_or_else(|| Arc::new(StreamStore::new())),
            long_poll_timeout: Duration::from_secs(30),
            sessions: Some(hub),
            auth: StreamAuth {
                tokens: config.tokens.clone(),
                insecure_no_auth: config.insecure_no_auth,
            },
        }
    }
}

impl Default for DurableStreamsState {
    fn default() -> Self {
        Self::new()
    }
}

/// The routes: every method on `/v1/stream/{*name}`.
pub fn router(state: DurableStreamsState) -> Router {
    Router::new()
        .route("/v1/stream/{*name}", any(handle))
        .with_state(Arc::new(state))
}

/// The routes as the session server mounts them
/// ([`DurableStreamsState::for_server`]). Without `config.stream_store`,
/// each call makes a fresh in-memory stream store, so build the router once
/// per server.
pub fn server_router(config: &crate::ServerConfig, hub: Arc<Hub>) -> Router {
    router(DurableStreamsState::for_server(config, hub))
}

type Shared = Arc<DurableStreamsState>;

/// A response under construction: the protocol's [`::durable_streams::Reply`],
/// or its head with a streamed body.
pub(crate) struct Reply {
    head: ::durable_streams::Reply,
    stream: Option<Body>,
}

impl From<::durable_streams::Reply> for Reply {
    fn from(head: ::durable_streams::Reply) -> Self {
        Self { head, stream: None }
    }
}

impl Reply {
    pub(crate) fn new(status: StatusCode) -> Self {
        ::durable_streams::Reply::new(status).into()
    }

    pub(crate) fn text(status: StatusCode, message: impl Into<String>) -> Self {
        ::durable_streams::Reply::text(status, message).into()
    }

    pub(crate) fn body(mut self, body: Body) -> Self {
        self.stream = Some(body);
        self
    }

    fn finish(self) -> Response {
        let head = self.head.with_common_headers();
        let body = self.stream.unwrap_or_else(|| Body::from(head.body));
        let mut response = Response::new(body);
        *response.status_mut() = head.status;
        response.headers_mut().extend(head.headers);
        response
    }
}

/// The `Stream-Cursor` for a client that sent `client`, now.
pub(crate) fn cursor(client: Option<&str>) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0);
    // One generator per thread, seeded once: a cursor goes out with every
    // SSE control event to every reader, and drawing each from the OS
    // (a `getrandom` call) cost ~6 % of the server's CPU at 1,000 readers.
    thread_local! {
        static JITTER: std::cell::Cell<u64> = std::cell::Cell::new(u64::from_le_bytes(
            uuid::Uuid::new_v4().as_bytes()[..8].try_into().unwrap_or([0; 8]),
        ));
    }
    let random = JITTER.with(|state| {
        let mut s = state.get();
        let r = util::splitmix64(&mut s);
        state.set(s);
        r
    });
    util::response_cursor(client, now, random)
}

async fn handle(
    State(state): State<Shared>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let path = uri.path().to_string();
    if method == Method::OPTIONS {
        return Reply::new(StatusCode::NO_CONTENT).finish();
    }
    let name = path.strip_prefix(PREFIX).unwrap_or("");
    let params = util::query_pairs(uri.query().unwrap_or_default());
    let token = bearer(
        &headers,
        params
            .iter()
            .find(|(k, _)| k == "access_token")
            .map(|(_, v)| v.as_str()),
    );
    if let (Some(hub), Some(raw_id)) = (&state.sessions, name.strip_prefix("sessions/")) {
        let session = match SessionId::parse(raw_id) {
            Ok(s) => s,
            Err(e) => return Reply::text(StatusCode::BAD_REQUEST, e.to_string()).finish(),
        };
        if let Err(e) = authorize(
            &state.auth.tokens,
            state.auth.insecure_no_auth,
            token.as_deref(),
            Some(&session),
            &[GrantRole::Client, GrantRole::Runner],
        ) {
            return Reply::text(e.status, e.message).finish();
        }
        return sessions::handle(
            &state,
            hub.clone(),
            &session,
            &path,
            method,
            &params,
            &headers,
        )
        .await
        .finish();
    }
    if let Err(e) = authorize(
        &state.auth.tokens,
        state.auth.insecure_no_auth,
        token.as_deref(),
        None,
        &[GrantRole::Host],
    ) {
        return Reply::text(e.status, e.message).finish();
    }
    let body = match axum::body::to_bytes(body, MAX_BODY_BYTES).await {
        Ok(b) => b,
        Err(_) => {
            return Reply::from(::durable_streams::protocol::body_too_large(MAX_BODY_BYTES))
                .finish()
        }
    };
    let request = Request {
        method: &method,
        path: &path,
        query: uri.query(),
        headers: &headers,
        body,
    };
    let handled = state.store.handle(&request);
    match handled {
        Handled::Reply(reply) => Reply::from(reply).finish(),
        Handled::LongPoll(poll) => {
            Reply::from(state.store.long_poll(poll, state.long_poll_timeout).await).finish()
        }
        Handled::Sse { head, feed } => {
            let body = state.store.sse_body(feed, state.long_poll_timeout);
            let body = futures::StreamExt::map(body, Ok::<Bytes, std::convert::Infallible>);
            Reply::from(head).body(Body::from_stream(body)).finish()
        }
    }
}
