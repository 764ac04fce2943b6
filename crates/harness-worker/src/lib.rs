//! # harness-worker
//!
//! The Cloudflare counterpart of `harness serve`: a Worker whose front
//! (`front`) answers the session API of `session-server` — same paths, JSON,
//! status codes and bearer roles, decided by the shared `session-api`
//! crate — and hands each session's requests to that session's Durable
//! Object (`object::SessionObject`, one per session, named by the session
//! id). The object drives core's `ActorDriver` over its own SQLite
//! (`store::DoStore`, a `harness_core::log::SessionStore`), so the actor
//! rules (seq, idempotency, seal, one turn at a time, fan-out order) are the
//! ones `harness serve` runs.
//!
//! Generic Durable Streams (`/v1/stream/*`) are served by one more object,
//! `streams::StreamsObject`, with the `durable-streams` crate's protocol
//! over its SQLite, as `session-server` serves them natively; a session's
//! own stream (`/v1/stream/sessions/<id>`) is answered by its object.
//!
//! The `test-routes` feature adds what only the tests use (`engine_api`,
//! `test_routes`, the slice failpoint); a deploy build leaves it off and has
//! none of those routes.
//!
//! Everything is `cfg(target_arch = "wasm32")`: on the host this crate is
//! empty, and its test (`tests/wrangler.rs`) runs the built Worker under
//! `wrangler dev`. See `docs/cloudflare-worker.md`.

#![cfg(target_arch = "wasm32")]

mod broker;
mod checkpoints;
mod directory;
#[cfg(feature = "test-routes")]
mod engine_api;
mod front;
mod journal;
mod object;
mod retention;
mod session_streams;
mod store;
mod streams;
#[cfg(feature = "test-routes")]
mod test_routes;
mod turns;

pub use directory::SessionDirectory;
pub use object::SessionObject;
pub use store::DoStore;
pub use streams::StreamsObject;
