//! The Durable Streams protocol (durable-streams/durable-streams
//! `PROTOCOL.md`), once, for every server that speaks it.
//!
//! - [`store::Streams`]: every generic byte and JSON stream of a server, as
//!   a state machine with no runtime — creates, appends with idempotent
//!   producers and `Stream-Seq`, close, forks with offsets and sub-offsets,
//!   TTLs and expiry, soft deletes. Its time comes from a
//!   [`harness_core::clock::Clock`]; what it changed comes out as
//!   [`store::Changes`] for the host to persist ([`store::SCHEMA`]).
//! - [`protocol`]: HTTP semantics over it (statuses, headers, etags,
//!   cursors, long-poll and SSE as steps a host drives).
//! - [`native::StreamStore`] (feature `native`): the native host — a mutex,
//!   a SQLite file through `rusqlite`, tokio wake-ups. `session-server`
//!   mounts it; the Cloudflare Worker serves the same [`protocol`] from a
//!   Durable Object over its own SQLite.
//!
//! Checked by the npm suite `@durable-streams/server-conformance-tests`
//! against both servers (`docs/durable-streams.md`).

pub mod protocol;
pub mod sessions;
pub mod store;
// `pub` (hidden) so the fuzz targets in `fuzz/` reach the parsers.
#[doc(hidden)]
pub mod util;

#[cfg(feature = "native")]
pub mod native;

#[cfg(feature = "native")]
pub use native::StreamStore;
pub use protocol::{
    handle, sse_event, strict_uint, valid_content_type, Handled, LongPoll, Reply, Request, SseFeed,
    SseStep, MAX_BODY_BYTES, PREFIX,
};
pub use store::{
    AppendOptions, AppendOutcome, Changes, CreateOptions, Offset, Producer, StoreError,
    StoredMessage, StreamMeta, Streams,
};
