//! # harness
//!
//! Run coding agents (Claude Code, Codex) inside sandboxes as durable
//! sessions. This crate is the facade: it re-exports [`core`] (traits, types,
//! state machines) and every backend behind a cargo feature, so an
//! application picks its parts à la carte:
//!
//! | feature | module | what |
//! |---|---|---|
//! | `local` (default) | [`local`] | sandbox: a host directory and process groups |
//! | `docker` | [`docker`] | sandbox: a Docker container (bollard) |
//! | `cloudflare` | [`cloudflare`] | sandbox: a Cloudflare Sandbox bridge over HTTP |
//! | `moves` (default) | [`moves`] | moving trees and sessions between sandboxes (zstd, tree checkpoints) |
//! | `fs-store` (default) | [`fs_store`] | checkpoint store in a local directory |
//! | `r2` | [`r2`] | checkpoint store on R2 / any S3 |
//! | `sqlite` (default) | [`sqlite`] | session log and turn store on SQLite |
//! | `postgres` | [`postgres`] | session logs, turn store and session leases on PostgreSQL (several `harness serve` nodes) |
//! | `runtime` (default) | [`runtime`] | the session runtime on tokio: actors, dispatch to an engine, the embedding API |
//! | `server` | [`server`] | the session server (HTTP, WebSocket, SSE) |
//! | `claude-code` (default) | [`claude_code`] | the Claude Code adapter |
//! | `codex` (default) | [`codex`] | the Codex adapter |
//! | `temporal` | [`temporal`] | the Temporal engine |
//! | `helpers` | [`sandbox_gate`], [`approval_mcp`], [`relay_mcp`] | the programs a sandbox runs beside the agent, as libraries (for a multi-call binary) |
//!
//! ## Embedding: sessions in five lines
//!
//! [`open`] assembles the session runtime on a directory — the SQLite log
//! and turn store, local sandboxes (and Docker with the `docker` feature),
//! the agents found on this machine, the in-process engine — and resumes
//! what an earlier process left unfinished:
//!
//! ```no_run
//! # async fn demo() -> harness::core::Result<()> {
//! use harness::core::session::SessionConfig;
//! let harness = harness::open("/var/lib/my-app/harness").await?;
//! let session = harness.create_session(None, SessionConfig::default()).await?; // Claude Code, local sandbox
//! let mut turn = session.prompt("Create hello.txt with a greeting").await?;
//! while let Some(update) = turn.next().await { println!("{update:?}") } // parts, then the end
//! let later = harness.session(session.id()).await?; // resume it by id, in any process
//! # let _ = later; Ok(()) }
//! ```
//!
//! `session.answer(id, approved, reason)` answers a permission request and
//! `session.abort(reason)` stops the running turn; a `harness serve` on the
//! same directory serves the same sessions over HTTP.
//!
//! ## Parts à la carte
//!
//! ```no_run
//! # async fn demo() -> harness::core::Result<()> {
//! use harness::core::sandbox::{SandboxProvider, SandboxSpec, ExecRequest, collect_exec};
//! let provider = harness::local::LocalProvider::new("/tmp/harness-sandboxes");
//! let sandbox = provider.create(&SandboxSpec::new("work")).await?;
//! let out = collect_exec(sandbox.exec(ExecRequest::shell("echo hello")).await?).await?;
//! assert_eq!(out.stdout_str(), "hello\n");
//! sandbox.destroy().await?;
//! # Ok(()) }
//! ```

pub use harness_core as core;

#[cfg(feature = "moves")]
pub use harness_moves as moves;

#[cfg(feature = "local")]
pub use sandbox_local as local;

#[cfg(feature = "docker")]
pub use sandbox_docker as docker;

#[cfg(feature = "cloudflare")]
pub use sandbox_cloudflare as cloudflare;

#[cfg(feature = "microvm")]
pub use sandbox_microvm as microvm;

#[cfg(feature = "fs-store")]
pub use checkpoint_fs as fs_store;

#[cfg(feature = "r2")]
pub use checkpoint_r2 as r2;

#[cfg(feature = "sqlite")]
pub use session_log as sqlite;

#[cfg(feature = "postgres")]
pub use session_log_postgres as postgres;

#[cfg(feature = "runtime")]
pub use session_runtime as runtime;

#[cfg(feature = "broker")]
pub use harness_broker as broker;

#[cfg(feature = "server")]
pub use session_server as server;

#[cfg(feature = "claude-code")]
pub use harness_claude_code as claude_code;

#[cfg(feature = "codex")]
pub use harness_codex as codex;

#[cfg(feature = "temporal")]
pub use durable_temporal as temporal;

#[cfg(feature = "helpers")]
pub use harness_sandbox_gate as sandbox_gate;

#[cfg(feature = "helpers")]
pub use harness_approval_mcp as approval_mcp;

#[cfg(feature = "helpers")]
pub use harness_relay_mcp as relay_mcp;

#[cfg(all(feature = "runtime", feature = "sqlite", feature = "local"))]
mod embed;
#[cfg(all(feature = "runtime", feature = "sqlite", feature = "local"))]
pub use embed::{open, open_with, OpenOptions};
