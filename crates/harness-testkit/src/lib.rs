//! # harness-testkit
//!
//! What every backend's tests share (not published):
//! - [`conformance`]: one suite per core trait, run against every backend;
//! - [`decorated`]: a real sandbox with one behaviour changed (a contract
//!   broken, a race provoked), for the tests that need one;
//! - [`agent`]: a scripted agent process (a shell script printing JSON
//!   lines) for the engine suite and engine tests;
//! - [`model`]: scripted Anthropic Messages and OpenAI Responses servers,
//!   the one scripted part in end-to-end tests with the real agent CLIs;
//! - [`real`]: the skip-or-fail rule for tests that need real parts;
//! - [`gate`]: the sandbox gate and the other helper binaries tests start,
//!   prebuilt by `cargo xtask ci` or built for the tests that need them;
//! - [`checkout`]: the checkout under test, found when the test runs (not
//!   the clone the test binary was compiled in);
//! - [`bridge`]: a Cloudflare Sandbox bridge API server over real sandboxes,
//!   checking every request and response against the bridge's OpenAPI
//!   document (the `sandbox-cloudflare` provider's tests);
//! - [`trees`]: the test tree every move test builds, and a listing of a
//!   tree that means the same on every provider;
//! - [`wrangler`]: the Cloudflare Worker under `wrangler dev`, for the
//!   session-API suite ([`conformance::session_api`]);
//! - [`worker_stores`]: that Worker's Durable Object log and R2 store as
//!   `SessionLog` and `CheckpointStore` over HTTP, for the log and
//!   checkpoint suites;
//! - [`engine_bridge`]: the engine suite against the Workflows engine in
//!   that Worker (the suite's executor served to its steps over HTTP, and
//!   the Worker's engine API as a `DurableEngine`).

pub mod agent;
pub mod ai_sdk;
pub mod bridge;
pub mod checkout;
pub mod conformance;
pub mod decorated;
pub mod docs;
pub mod engine_bridge;
pub mod gate;
/// The scripted model servers (the `harness-scripted-model` crate).
pub use harness_scripted_model as model;
pub mod postgres;
pub mod real;
pub mod trees;
pub mod worker_stores;
pub mod wrangler;

pub use gate::gate_binary;
pub use real::{real_parts_required, require_env, skip_or_fail};

pub(crate) use harness_scripted_model::serve_until_shutdown;
