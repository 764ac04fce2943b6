//! A Cloudflare Sandbox *bridge* for tests, with the bridge's own OpenAPI
//! document as the referee.
//!
//! The `sandbox-cloudflare` provider talks to the bridge HTTP API of
//! `@cloudflare/sandbox` (`dist/bridge/index.js`, a Hono app in a Worker).
//! Its tests need no Cloudflare account: [`BridgeServer`] answers that API
//! the way the bridge's route handlers do (status codes, error codes and
//! messages, the 32 MiB limits, `/workspace` confinement, the SSE framing of
//! exec), backed by real sandboxes of any [`SandboxProvider`] (in practice
//! Docker, whose workdir `/workspace` is the bridge's root).
//!
//! With an [`OpenApi`] in its config the server checks every request the
//! client sends and every response it returns against the bridge's
//! published OpenAPI 3.1 document, pinned by `cargo xtask deps`
//! ([`OpenApi::pinned`]). A request that violates it is answered 400
//! `invalid_request` (the real bridge would misbehave on it); every
//! violation is recorded, and [`BridgeServer::check`] fails the test.
//!
//! [`SandboxProvider`]: harness_core::sandbox::SandboxProvider

mod openapi;
mod server;

pub use openapi::{check_exec_sse, pinned_path, OpenApi, CF_SANDBOX_VERSION};
pub use server::{BridgeServer, BridgeServerConfig, MAX_BODY_BYTES, WORKSPACE};
