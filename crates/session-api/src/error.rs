//! JSON errors: every refusal answers `{"error": {"code", "message"}}` with
//! a status that says whose fault it is. The status of each code is decided
//! here, for both servers.

use harness_core::actor::{ErrorCode, ServerMessage};
use harness_core::{Error, ErrorKind};
use serde_json::json;

/// An HTTP error with a stable code.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// HTTP status.
    pub status: u16,
    /// Stable snake_case code (`unauthorized`, `forbidden`, `not_found`,
    /// `frame_too_large`, `invalid`, `sealed`, `conflict`, …).
    pub code: String,
    /// What happened and what to do.
    pub message: String,
}

impl ApiError {
    /// An error from its parts.
    pub fn new(status: u16, code: &str, message: impl Into<String>) -> Self {
        Self {
            status,
            code: code.to_string(),
            message: message.into(),
        }
    }

    /// 400 `invalid`.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(400, "invalid", message)
    }

    /// 413 `frame_too_large`.
    pub fn too_large(message: impl Into<String>) -> Self {
        Self::new(413, "frame_too_large", message)
    }

    /// 404 `not_found` for a path no route answers.
    pub fn no_route() -> Self {
        Self::new(404, "not_found", "no such endpoint")
    }

    /// Map an actor's refusal (see `harness_core::actor::ErrorCode`) to an
    /// HTTP error; the code travels unchanged.
    pub fn from_code(code: ErrorCode, message: &str) -> Self {
        Self::new(status_of_code(code), code.as_str(), message)
    }

    /// The body every server sends.
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {"code": self.code, "message": self.message}})
    }

    /// The error as a WebSocket message.
    pub fn to_message(&self) -> ServerMessage {
        ServerMessage::Error {
            code: ErrorCode::from_name(&self.code),
            message: self.message.clone(),
        }
    }
}

/// The HTTP status of an actor's error code.
pub fn status_of_code(code: ErrorCode) -> u16 {
    match code {
        ErrorCode::FrameTooLarge => 413,
        ErrorCode::Invalid => 400,
        ErrorCode::Sealed
        | ErrorCode::StaleRunner
        | ErrorCode::TurnInProgress
        | ErrorCode::NoActiveTurn
        | ErrorCode::Conflict
        | ErrorCode::HostLeaseHeld => 409,
        ErrorCode::NotAClient
        | ErrorCode::NotARunner
        | ErrorCode::NotAHost
        | ErrorCode::Forbidden => 403,
        ErrorCode::NotFound => 404,
        ErrorCode::Gone => 410,
        ErrorCode::Unauthorized => 401,
        ErrorCode::Unavailable => 503,
        ErrorCode::AppendFailed | ErrorCode::ReplayFailed | ErrorCode::Other => 500,
    }
}

impl From<Error> for ApiError {
    fn from(err: Error) -> Self {
        let (status, code) = match err.kind() {
            ErrorKind::NotFound => (404, "not_found"),
            ErrorKind::InvalidInput | ErrorKind::Unsafe => (400, "invalid"),
            ErrorKind::Conflict => (409, "conflict"),
            ErrorKind::Fenced => (409, "stale_runner"),
            ErrorKind::Unauthorized => (401, "unauthorized"),
            ErrorKind::Unsupported => (501, "unsupported"),
            ErrorKind::TimedOut => (504, "timed_out"),
            ErrorKind::Gone => (410, "gone"),
            _ => (500, err.kind().as_str()),
        };
        Self::new(status, code, err.message())
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}: {}", self.status, self.code, self.message)
    }
}

impl std::error::Error for ApiError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_keep_their_name_and_get_their_status() {
        let e = ApiError::from_code(ErrorCode::TurnInProgress, "busy");
        assert_eq!((e.status, e.code.as_str()), (409, "turn_in_progress"));
        assert_eq!(
            ApiError::from_code(ErrorCode::FrameTooLarge, "").status,
            413
        );
        assert_eq!(ApiError::from(Error::not_found("x")).status, 404);
        assert_eq!(
            e.body(),
            json!({"error": {"code": "turn_in_progress", "message": "busy"}})
        );
    }
}
