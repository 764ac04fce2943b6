//! JSON errors: every refusal answers `{"error": {"code", "message"}}` with
//! a status that says whose fault it is.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use harness_core::{Error, ErrorKind};
use serde_json::json;

/// An HTTP error with a stable code.
#[derive(Debug, Clone)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// Stable snake_case code (`unauthorized`, `forbidden`, `not_found`,
    /// `frame_too_large`, `invalid`, `sealed`, `conflict`, …).
    pub code: String,
    /// What happened and what to do.
    pub message: String,
}

impl ApiError {
    /// An error from its parts.
    pub fn new(status: StatusCode, code: &str, message: impl Into<String>) -> Self {
        Self {
            status,
            code: code.to_string(),
            message: message.into(),
        }
    }

    /// 400 `invalid`.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid", message)
    }

    /// 413 `frame_too_large`.
    pub fn too_large(message: impl Into<String>) -> Self {
        Self::new(StatusCode::PAYLOAD_TOO_LARGE, "frame_too_large", message)
    }

    /// Map an actor's error code (see `harness_core::actor::ServerMessage`)
    /// to an HTTP error.
    pub fn from_actor(code: &str, message: &str) -> Self {
        let status = match code {
            "frame_too_large" => StatusCode::PAYLOAD_TOO_LARGE,
            "invalid" => StatusCode::BAD_REQUEST,
            "sealed" | "stale_runner" => StatusCode::CONFLICT,
            "not_a_client" | "not_a_runner" => StatusCode::FORBIDDEN,
            // The log's own refusal: a reused idempotency key is the
            // caller's conflict, anything else is ours.
            "append_failed" if message.contains("conflict:") => StatusCode::CONFLICT,
            "append_failed" if message.contains("invalid_input:") => StatusCode::BAD_REQUEST,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        Self::new(status, code, message)
    }
}

impl From<Error> for ApiError {
    fn from(err: Error) -> Self {
        let (status, code) = match err.kind() {
            ErrorKind::NotFound => (StatusCode::NOT_FOUND, "not_found"),
            ErrorKind::InvalidInput | ErrorKind::Unsafe => (StatusCode::BAD_REQUEST, "invalid"),
            ErrorKind::Conflict => (StatusCode::CONFLICT, "conflict"),
            ErrorKind::Unauthorized => (StatusCode::UNAUTHORIZED, "unauthorized"),
            ErrorKind::Unsupported => (StatusCode::NOT_IMPLEMENTED, "unsupported"),
            ErrorKind::TimedOut => (StatusCode::GATEWAY_TIMEOUT, "timed_out"),
            _ => (StatusCode::INTERNAL_SERVER_ERROR, err.kind().as_str()),
        };
        Self::new(status, code, err.message())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({"error": {"code": self.code, "message": self.message}});
        (self.status, Json(body)).into_response()
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {}: {}",
            self.status.as_u16(),
            self.code,
            self.message
        )
    }
}
