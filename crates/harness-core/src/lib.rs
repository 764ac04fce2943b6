//! # harness-core
//!
//! The traits, data types and pure state machines of the harness, and the
//! drivers that join them to I/O they are given: everything that decides,
//! nothing that does I/O of its own. Backends (sandboxes, stores, logs,
//! engines) implement the traits in their own crates; every runtime (the
//! tokio server, a Cloudflare Durable Object) drives the same
//! [`actor_driver::ActorDriver`]; every engine (in-process, Temporal,
//! Workflows) drives the same [`turn_driver::TurnDriver`].
//!
//! No I/O, no clock, no threads: time comes in as a [`clock::Clock`],
//! storage as traits, spawning as a function. The crate has no cargo
//! features and no C dependency, and builds for `wasm32-unknown-unknown`
//! as it is; there trait futures are not `Send` ([`maybe`]). Moving trees
//! between sandboxes (zstd, tree checkpoints) is its own crate,
//! `harness-moves`.
//!
//! Map of the crate:
//! - [`sandbox`]: `SandboxProvider`/`Sandbox`, specs, handles, exec, network policy;
//! - [`bootstrap`]: recipes and their stable identity;
//! - [`checkpoint`]: `CheckpointStore` and the in-memory store;
//! - [`log`]: `SessionLog` (the directory) and `SessionStore` (one session),
//!   the log rules on plain data, the in-memory log;
//! - [`frame`], [`part`]: what a session log holds, in the AI SDK vocabulary;
//! - [`session`]: session config, the meta folded from frames, turn commands
//!   and `SessionRuntime`, which performs them on an engine;
//! - [`actor`], [`actor_driver`]: the session actor as a sans-IO machine and its one loop;
//! - [`turn`], [`turn_driver`]: durable turn state, `run_harness_session`, and the one turn loop;
//! - [`harness`]: the agent adapter contract;
//! - [`engine`]: `DurableEngine`, the slice contract and the in-process engine;
//! - [`slice`]: `harness:slice`, one bounded piece of a turn, and where its parts go;
//! - [`clock`], [`maybe`]: time as an input; `Send` only where there are threads;
//! - [`tarscan`]: archive safety (what every restore admits);
//! - [`sse`], [`query`]: the one reader of server-sent events (bounded,
//!   sans-IO) and the one decoder of query strings.

pub mod actor;
pub mod actor_driver;
pub mod audit;
pub mod bootstrap;
pub mod broker;
pub mod checkpoint;
pub mod clock;
pub mod decorate;
pub mod engine;
mod error;
pub mod failpoint;
pub mod fork;
pub mod frame;
pub mod harness;
pub mod log;
pub mod maybe;
pub mod part;
pub mod query;
pub mod sandbox;
pub mod search;
pub mod session;
pub mod slice;
pub mod sse;
pub mod stream;
pub mod tarscan;
pub mod turn;
pub mod turn_checkpoint;
pub mod turn_driver;

pub use error::{Error, ErrorKind, Result};
pub use frame::{Frame, FrameBody, SessionId};
/// The host-tool wire types (calls, outcomes, tool declarations).
pub use harness_relay as relay;
pub use part::StreamPart;
