//! A harness [`DurableEngine`](harness_core::engine::DurableEngine) on
//! Cloudflare Workflows.
//!
//! One Workflow instance runs one turn. The instance's `run` is I/O around
//! core's [`TurnDriver`](harness_core::turn_driver::TurnDriver), the same
//! turn loop the in-process engine and the Temporal workflow drive
//! ([`run::run_turn`]):
//!
//! - each I/O action of the driver is one `step.do` — create the sandbox,
//!   one `harness:slice`, kill the agent, record the end — whose recorded
//!   output is the action's result and the time it finished, so a replay of
//!   `run` after an eviction takes exactly the same path without touching
//!   the sandbox again;
//! - a step that fails with a retryable error throws, and Workflows retries
//!   it (`step.do`'s retry config); a fatal or fenced failure is recorded as
//!   the step's output instead, so nothing retries what cannot succeed;
//! - waiting for an approval answer or an abort is `step.waitForEvent`
//!   (event type [`run::INPUT_EVENT`]), which the engine's
//!   [`answer_approval`](harness_core::engine::DurableEngine::answer_approval)
//!   and [`abort_turn`](harness_core::engine::DurableEngine::abort_turn)
//!   send with `instance.sendEvent`.
//!
//! The Workers runtime has no Rust API for Workflows (workers-rs 0.8 has no
//! Workflows module), so [`binding`] declares the few JS methods used with
//! `wasm-bindgen`, and a Worker exports a ~10-line JS `WorkflowEntrypoint`
//! class that calls into Rust (`crates/harness-worker/src/entry.mjs`).
//! See `docs/durable-workflows.md`.

#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod remote;
pub mod run;

#[cfg(target_arch = "wasm32")]
pub mod binding;
#[cfg(target_arch = "wasm32")]
pub mod engine;

pub use run::{
    run_turn, StepBody, StepOptions, StepTuning, Steps, TurnInput, TurnParams, INPUT_EVENT,
};
