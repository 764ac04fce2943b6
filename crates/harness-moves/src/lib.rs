//! # harness-moves
//!
//! Moving a working tree, and a whole agent session, between sandboxes of
//! any provider through any [`CheckpointStore`](harness_core::checkpoint::CheckpointStore):
//!
//! - whole-archive checkpoints ([`checkpoint`] / [`restore`]): the tree as
//!   one zstd tar, streamed, with every entry admitted by core's
//!   [`TarScanner`](harness_core::tarscan::TarScanner) before anything is
//!   written;
//! - incremental, content-addressed tree checkpoints ([`tree`]): a manifest
//!   plus content chunks stored once per store, so a re-checkpoint reads
//!   and uploads only what changed;
//! - session moves ([`checkpoint_session`] / [`restore_session`]): the tree,
//!   the agent's own state and a manifest;
//! - turn-end checkpoints ([`turns::StoreTurnCheckpoints`]): the same, the
//!   tree incremental, taken at every turn's end.
//!
//! zstd runs through libzstd natively (feature `zstd`, the default) or in
//! pure Rust for wasm32 (feature `zstd-rust`, [`zstd_rust`]: a Worker's
//! moves). This is the one crate of the pipeline with a C dependency and
//! cargo features; `harness-core`, whose traits it uses, has neither.
//! See `docs/tree-checkpoints.md` and `docs/ARCHITECTURE.md` ("Moving a
//! tree").

mod archive;
pub mod tree;
pub mod turns;
#[cfg(feature = "zstd-rust")]
pub mod zstd_rust;

pub use archive::*;

/// Encrypted checkpoints: a key per fork lineage (`lineages/<L>/…`).
pub use checkpoint_crypt as crypt;
