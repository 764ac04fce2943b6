//! JSON errors: every refusal answers `{"error": {"code", "message"}}` with
//! a status that says whose fault it is (decided in `session-api`, for
//! this server and the Cloudflare Worker alike).

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use harness_core::actor::ErrorCode;
use harness_core::Error;
use serde_json::json;
use session_runtime::AnswerError;

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

    /// Map an actor's refusal (see `harness_core::actor::ErrorCode`) to an
    /// HTTP error; the code travels unchanged (statuses: `session-api`).
    pub fn from_code(code: ErrorCode, message: &str) -> Self {
        session_api::ApiError::from_code(code, message).into()
    }

    /// The error as a WebSocket message.
    pub fn to_message(&self) -> harness_core::actor::ServerMessage {
        harness_core::actor::ServerMessage::Error {
            code: ErrorCode::from_name(&self.code),
            message: self.message.clone(),
        }
    }
}

impl From<AnswerError> for ApiError {
    fn from(e: AnswerError) -> Self {
        match e {
            AnswerError::Refused { code, message } => ApiError::from_code(code, &message),
            AnswerError::Closed(reason) => Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "closed",
                format!("the session closed the connection: {reason}"),
            ),
            AnswerError::TimedOut => Self::new(
                StatusCode::GATEWAY_TIMEOUT,
                "timed_out",
                "the session did not answer in time",
            ),
        }
    }
}

impl From<Error> for ApiError {
    fn from(err: Error) -> Self {
        session_api::ApiError::from(err).into()
    }
}

impl From<session_api::ApiError> for ApiError {
    fn from(e: session_api::ApiError) -> Self {
        Self {
            status: StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            code: e.code,
            message: e.message,
        }
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
