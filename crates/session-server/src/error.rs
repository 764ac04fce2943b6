//! JSON errors: every refusal answers `{"error": {"code", "message"}}` with
//! a status that says whose fault it is.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use harness_core::actor::ErrorCode;
use harness_core::{Error, ErrorKind};
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
    /// HTTP error; the code travels unchanged.
    pub fn from_code(code: ErrorCode, message: &str) -> Self {
        let status = match code {
            ErrorCode::FrameTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ErrorCode::Invalid => StatusCode::BAD_REQUEST,
            ErrorCode::Sealed
            | ErrorCode::StaleRunner
            | ErrorCode::TurnInProgress
            | ErrorCode::NoActiveTurn
            | ErrorCode::Conflict
            | ErrorCode::HostLeaseHeld => StatusCode::CONFLICT,
            ErrorCode::NotAClient
            | ErrorCode::NotARunner
            | ErrorCode::NotAHost
            | ErrorCode::Forbidden => StatusCode::FORBIDDEN,
            ErrorCode::NotFound => StatusCode::NOT_FOUND,
            ErrorCode::Unauthorized => StatusCode::UNAUTHORIZED,
            ErrorCode::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            ErrorCode::AppendFailed | ErrorCode::ReplayFailed | ErrorCode::Other => {
                StatusCode::INTERNAL_SERVER_ERROR
            }
        };
        Self::new(status, code.as_str(), message)
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
        let (status, code) = match err.kind() {
            ErrorKind::NotFound => (StatusCode::NOT_FOUND, "not_found"),
            ErrorKind::InvalidInput | ErrorKind::Unsafe => (StatusCode::BAD_REQUEST, "invalid"),
            ErrorKind::Conflict => (StatusCode::CONFLICT, "conflict"),
            ErrorKind::Fenced => (StatusCode::CONFLICT, "stale_runner"),
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
