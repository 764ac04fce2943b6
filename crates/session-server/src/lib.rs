//! # session-server
//!
//! The session actor of `harness-core` served over HTTP, Server-Sent Events
//! and WebSocket with axum, on any [`SessionLog`] (SQLite natively, see the
//! `session-log` crate).
//!
//! The actors run in a `session_runtime::Hub` (one tokio task per live
//! session driving core's `ActorDriver`); this crate is the HTTP shell
//! around it and has no session semantics of its own. Built with
//! [`SessionServer::with_hub`] over a `session_runtime::Runtime`'s hub, a
//! client's prompt runs a turn on the runtime's engine; built with
//! [`SessionServer::new`], prompts are stored and wait for a runtime. See
//! `docs/session-server.md` for the endpoints and the design.
//!
//! ```no_run
//! # async fn run() -> std::io::Result<()> {
//! use std::sync::Arc;
//! use session_server::{serve, ServerConfig, TokenGrant, Scope, GrantRole};
//! let log = Arc::new(harness_core::log::MemorySessionLog::new());
//! let mut config = ServerConfig::new(log);
//! config.tokens.push(TokenGrant::new("secret", Scope::All, GrantRole::Host));
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:8787").await?;
//! serve(listener, config).await
//! # }
//! ```

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use harness_core::actor::ActorConfig;
use harness_core::log::{SessionLog, DEFAULT_MAX_FRAME_BYTES};
use harness_core::SessionId;
use session_runtime::{Hub, HubConfig};

mod auth;
mod chat;
pub mod durable_streams;
mod error;
mod http;
mod runners;
/// The sandbox API: `harness serve`'s sandboxes for outside agents (the
/// AI SDK's `HarnessAgent`), see `docs/ai-sdk.md`.
pub mod sandboxes;
/// A session as a Markdown document (in `session-api`, shared with the
/// Cloudflare Worker).
pub use session_api::markdown;
/// The AI SDK UI message stream mapping (it lives in `session-api`, shared
/// with the Cloudflare Worker).
pub use session_api::ui_stream;
mod web;

pub use auth::{GrantRole, Scope, TokenGrant};
pub use error::ApiError;

/// How the server runs.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Where frames are stored.
    pub log: Arc<dyn SessionLog>,
    /// The token table (see [`TokenGrant`]).
    pub tokens: Vec<TokenGrant>,
    /// Accept every request as `host` without a token. For local
    /// development only.
    pub insecure_no_auth: bool,
    /// Largest encoded frame accepted (default 1 MiB); larger writes get 413
    /// (HTTP) or a `frame_too_large` error (WebSocket) and store nothing.
    pub max_frame_bytes: usize,
    /// A session actor with no connections stops after this long.
    pub idle_timeout: Duration,
    /// Agent adapters a new session may name (empty: any name is stored;
    /// the runtime refuses unknown ones at the first prompt).
    pub agents: Vec<String>,
    /// Sandbox providers a new session may name (empty: any).
    pub providers: Vec<String>,
    /// Where generic Durable Streams (`/v1/stream/*`) live; `None`: a fresh
    /// in-memory store per router (lost when the process ends). Pass
    /// [`durable_streams::StreamStore::open`] to keep them in SQLite.
    pub stream_store: Option<Arc<durable_streams::StreamStore>>,
    /// The key the log's audit chain is keyed with, for
    /// `GET /v1/sessions/{id}/verify` (the one the log appends with;
    /// default unkeyed). docs/audit.md.
    pub chain_key: harness_core::log::ChainKey,
}

impl ServerConfig {
    /// Defaults: no tokens (every request is 401 until you add some or set
    /// `insecure_no_auth`), 1 MiB frames, 30 s idle timeout.
    pub fn new(log: Arc<dyn SessionLog>) -> Self {
        Self {
            log,
            tokens: Vec::new(),
            insecure_no_auth: false,
            max_frame_bytes: DEFAULT_MAX_FRAME_BYTES,
            idle_timeout: Duration::from_secs(30),
            agents: Vec::new(),
            providers: Vec::new(),
            stream_store: None,
            chain_key: harness_core::log::ChainKey::unkeyed(),
        }
    }

    /// The hub settings this configuration implies.
    pub fn hub_config(&self) -> HubConfig {
        HubConfig {
            actor: ActorConfig {
                max_frame_bytes: self.max_frame_bytes,
            },
            idle_timeout: self.idle_timeout,
            ..HubConfig::default()
        }
    }
}

/// A configured server: its router plus a view of the live actors.
#[derive(Debug, Clone)]
pub struct SessionServer {
    state: Arc<http::AppState>,
}

/// One pass of a retention policy over every session: how many it deleted.
async fn retention_pass(
    hub: &Hub,
    policy: &harness_core::log::RetentionPolicy,
) -> harness_core::Result<usize> {
    let mut logs = Vec::new();
    let mut after = None;
    loop {
        let page = hub.log().list_page(after.as_ref(), 1000).await?;
        let Some(last) = page.last() else { break };
        after = Some(last.session.clone());
        logs.extend(page);
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let mut deleted = 0;
    for session in policy.expired(&logs, now) {
        match hub.delete(&session).await {
            Ok(_) => deleted += 1,
            // Another node deleted it first, or a turn started since.
            Err(e) => tracing::info!(%session, "retention left the session: {e}"),
        }
    }
    Ok(deleted)
}

impl SessionServer {
    /// Build a server with its own hub and no runtime: prompts are stored
    /// and wait for one (no I/O yet).
    pub fn new(config: ServerConfig) -> Self {
        let hub = Hub::new(config.log.clone(), config.hub_config());
        Self::with_hub(config, hub)
    }

    /// Build a server over `hub` (a `session_runtime::Runtime`'s, so
    /// prompts run turns). `hub` must be over `config.log`.
    pub fn with_hub(config: ServerConfig, hub: Arc<Hub>) -> Self {
        Self {
            state: Arc::new(http::AppState {
                hub,
                config,
                runners: None,
            }),
        }
    }

    /// Build a server whose turns run in a remote runner (`harness runner`)
    /// attached on `GET /v1/runner`: the hub's commands go to it.
    pub fn with_remote_runners(config: ServerConfig) -> Self {
        let hub = Hub::new(config.log.clone(), config.hub_config());
        let runners = Arc::new(runners::RemoteRunners::new(&hub));
        hub.set_dispatcher(runners.clone());
        Self {
            state: Arc::new(http::AppState {
                hub,
                config,
                runners: Some(runners),
            }),
        }
    }

    /// The axum router (mount it under any prefix-free path).
    pub fn router(&self) -> Router {
        http::router(self.state.clone()).merge(durable_streams::server_router(
            &self.state.config,
            self.state.hub.clone(),
        ))
    }

    /// Serve on `listener` until the process ends.
    pub async fn serve(self, listener: tokio::net::TcpListener) -> std::io::Result<()> {
        axum::serve(no_delay(listener), self.router()).await
    }

    /// Run `policy` now and then every `every` until the process ends
    /// (`docs/retention.md`): each session it names is deleted through the
    /// hub (its actor closed first; one with a turn running is never
    /// named). Several nodes may each run it: a session another node
    /// deleted first is skipped.
    pub fn spawn_retention(
        &self,
        policy: harness_core::log::RetentionPolicy,
        every: Duration,
    ) -> tokio::task::JoinHandle<()> {
        let hub = self.state.hub.clone();
        tokio::spawn(async move {
            loop {
                match retention_pass(&hub, &policy).await {
                    Ok(0) => {}
                    Ok(n) => tracing::info!(deleted = n, "retention deleted sessions"),
                    Err(e) => tracing::warn!("retention: listing the sessions failed: {e}"),
                }
                tokio::time::sleep(every).await;
            }
        })
    }

    /// Sessions whose actor is running right now.
    pub fn live_sessions(&self) -> Vec<SessionId> {
        self.state.hub.live_sessions()
    }
}

/// Serve `config` on `listener` until the process ends.
pub async fn serve(listener: tokio::net::TcpListener, config: ServerConfig) -> std::io::Result<()> {
    let server = SessionServer::new(config);
    axum::serve(no_delay(listener), server.router()).await
}

/// `listener` with Nagle's algorithm off on every connection: frames and
/// WebSocket messages are small and each is awaited by someone; with Nagle
/// on, a message written behind another unacknowledged one waits for the
/// peer's delayed ACK (~40 ms per host-tool round trip, measured).
pub fn no_delay(
    listener: tokio::net::TcpListener,
) -> impl axum::serve::Listener<Io = tokio::net::TcpStream, Addr = std::net::SocketAddr> {
    use axum::serve::ListenerExt;
    listener.tap_io(|tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!("cannot set TCP_NODELAY: {e}");
        }
    })
}
