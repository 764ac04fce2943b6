//! # harness-broker-proto
//!
//! The model broker's rules with no I/O, shared by every host that serves
//! a broker — the native one (`harness-broker`: Unix sockets, axum,
//! reqwest) and the Cloudflare Worker's (a route of the Worker, `fetch`):
//!
//! - [`token`]: session and turn tokens, what an agent holds instead of
//!   the key;
//! - [`wire`]: the path, the presented token, the headers that never cross,
//!   a refusal's shape, the agent's environment;
//! - [`usage`]: what a session used, read from the answers as they pass,
//!   and the price table that costs it.
//!
//! Builds for wasm32 (no runtime, no C): `cargo xtask layers` keeps it so.

pub mod token;
pub mod usage;
pub mod wire;

pub use usage::{Price, PriceTable, Usage, UsageScanner};
pub use wire::Api;
