//! # session-api
//!
//! What the two servers of the session API share, with no runtime and no
//! HTTP framework: `session-server` (axum, tokio) and the Cloudflare
//! Worker's session Durable Object (`harness-worker`, wasm32) both answer
//! the same paths with the same JSON, status codes and bearer roles, so one
//! client talks to either. Each server keeps only its framing; the rules
//! live here once:
//!
//! - [`auth`]: the token table (`TokenGrant`: token, scope, role), where a
//!   request's token comes from, and the 401/403 decision;
//! - [`error`]: `{"error": {"code", "message"}}` and the status of every
//!   code (the actor's refusals and core's error kinds);
//! - [`request`]: the `POST /v1/sessions` body, query parameters, the
//!   `Last-Event-ID` header, page limits, the `POST /messages` ack;
//! - [`sse`]: the `/events` stream's events (`frame` with the seq as id,
//!   `live` without one, `error`), their wire encoding, and its reader as
//!   a state machine each server drives (`EventsReader`: the log a page at
//!   a time, then the actor; keep-alives);
//! - [`ui_stream`]: session messages as an AI SDK UI message stream
//!   (`/ui-stream`), a pure mapping;
//! - [`chat`]: a session as the AI SDK's chat endpoint (`useChat`): the
//!   request read into a prompt or approval answers, the log as
//!   `UIMessage[]`;
//! - [`ws`]: the session WebSocket's roles, their grants, and inbound
//!   messages typed or refused;
//! - [`markdown`]: a session as a Markdown document (the conversation,
//!   tool calls folded), for `export?format=markdown`.
//!
//! See `docs/session-server.md` for the API itself.

pub mod auth;
pub mod chat;
pub mod error;
pub mod markdown;
pub mod request;
pub mod sse;
pub mod ui_stream;
pub mod ws;

pub use auth::{authorize, bearer, GrantRole, Scope, TokenGrant};
pub use error::ApiError;
