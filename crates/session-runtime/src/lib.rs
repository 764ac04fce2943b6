//! # session-runtime
//!
//! The session runtime on tokio: what joins a client's prompt to a turn on
//! a durable engine, in one process. The logic lives in `harness-core`
//! (the actor and its [`ActorDriver`](harness_core::actor_driver::ActorDriver),
//! the turn loop, [`SessionRuntime`](harness_core::session::SessionRuntime));
//! this crate is the I/O around it:
//!
//! - [`hub`]: one tokio task per live session driving its actor, with a
//!   channel per connection (clients and the runner);
//! - [`dispatch`]: the actor's turn commands performed on an engine, in
//!   order per session;
//! - [`runner`]: the slice runner's sink, writing as the session's runner
//!   (fenced by generation) in-process or over the runner WebSocket;
//! - [`runtime`]: all of it assembled ([`Runtime`]), and the client API
//!   ([`SessionClient`], [`TurnHandle`]) that `harness run` and embedding
//!   programs use;
//! - [`follow`]: a client's view of one turn as stream parts;
//! - [`remote`]: the runner channel, for a server whose turns run in a
//!   remote runner.
//!
//! `session-server` serves a [`Hub`] over HTTP; `harness serve`,
//! `harness run` and the `harness` facade's embedding API build a
//! [`Runtime`].
//!
//! ```no_run
//! # async fn demo(
//! #     harness: std::sync::Arc<dyn harness_core::harness::Harness>,
//! #     local: std::sync::Arc<dyn harness_core::sandbox::SandboxProvider>,
//! # ) -> harness_core::Result<()> {
//! use std::sync::Arc;
//! use harness_core::log::MemorySessionLog;
//! use harness_core::session::SessionConfig;
//! use session_runtime::Runtime;
//! let runtime = Runtime::builder(Arc::new(MemorySessionLog::new()))
//!     .provider(local)
//!     .agent(harness)
//!     .build();
//! runtime.start().await?;
//! let session = runtime.create_session(None, SessionConfig::default()).await?;
//! let outcome = session.prompt("Create hello.txt").await?.finish().await?;
//! println!("{:?}: {}", outcome.status, outcome.text);
//! # Ok(()) }
//! ```

pub mod dispatch;
pub mod failpoints;
pub mod follow;
pub mod hub;
pub mod remote;
pub mod runner;
pub mod runtime;
pub mod tool_host;

pub use dispatch::{Dispatcher, EngineDispatcher, OnFailure};
pub use follow::{TurnFollower, TurnUpdate};
pub use hub::{
    Acked, AnswerError, Connection, Hub, HubConfig, Outbound, SandboxRemoval, SharedFrame,
};
pub use remote::{serve_runner_channel, FromRunner, ToRunner};
pub use runner::{HubConnector, RunnerConnector, RunnerLink, RunnerSink, WsConnector};
pub use runtime::{
    tokio_sleeper, tokio_spawner, EngineChoice, Runtime, RuntimeBuilder, SessionClient, Started,
    TurnHandle, TurnOutcome,
};
pub use tool_host::{CallContext, CommandTool, HostEvent, HostTool, ToolHost, ToolOutput};

/// The environment variables agents take their credentials and endpoints
/// from (Claude Code: `ANTHROPIC_*`; Codex: `OPENAI_*`).
pub const AGENT_ENV_VARS: &[&str] = &[
    "ANTHROPIC_API_KEY",
    "ANTHROPIC_BASE_URL",
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC",
    "OPENAI_API_KEY",
    "OPENAI_BASE_URL",
];

/// [`AGENT_ENV_VARS`] as set (and not empty) in this process: what a
/// runtime hands its agents by default.
pub fn agent_env() -> std::collections::BTreeMap<String, String> {
    AGENT_ENV_VARS
        .iter()
        .filter_map(|k| {
            std::env::var(k)
                .ok()
                .filter(|v| !v.is_empty())
                .map(|v| (k.to_string(), v))
        })
        .collect()
}

/// The system clock: milliseconds since the Unix epoch.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl harness_core::clock::Clock for SystemClock {
    fn now_ms(&self) -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0)
    }
}
