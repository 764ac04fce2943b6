//! # harness-core
//!
//! The traits, data types and pure state machines of the harness: everything
//! that decides, nothing that does I/O. Backends (sandboxes, stores, logs,
//! engines) implement the traits in their own crates; the native server and
//! the Cloudflare Durable Object drive the same [`actor::SessionActor`]; every
//! engine drives the same [`turn::run_harness_session`].
//!
//! The crate builds for `wasm32-unknown-unknown` with default features off
//! (the `zstd` feature adds the move pipeline, which needs C code).
//!
//! Map of the crate:
//! - [`sandbox`]: `SandboxProvider`/`Sandbox`, specs, handles, exec, network policy;
//! - [`bootstrap`]: recipes and their stable identity;
//! - [`checkpoint`]: `CheckpointStore` and the in-memory store;
//! - [`log`]: `SessionLog`, its rules on plain data, the in-memory log;
//! - [`frame`], [`part`]: what a session log holds, in the AI SDK vocabulary;
//! - [`turn`]: durable turn state and `run_harness_session`;
//! - [`actor`]: the session actor as a sans-IO machine;
//! - [`harness`]: the agent adapter contract;
//! - [`engine`]: `DurableEngine`, the slice contract and the in-process engine;
//! - [`slice`]: `harness:slice`, one bounded piece of a turn; [`sink`]: where its parts go;
//! - [`tarscan`], `moves`: archive safety and the checkpoint/restore pipeline.

pub mod actor;
pub mod bootstrap;
pub mod checkpoint;
pub mod engine;
mod error;
pub mod frame;
pub mod harness;
pub mod log;
#[cfg(feature = "zstd")]
pub mod moves;
pub mod part;
pub mod sandbox;
pub mod sink;
pub mod slice;
pub mod stream;
pub mod tarscan;
pub mod turn;

pub use error::{Error, ErrorKind, Result};
pub use frame::{Frame, FrameBody, SessionId};
pub use part::StreamPart;
