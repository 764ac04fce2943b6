//! The one error type every trait in the crate speaks.
//!
//! Backends map their own failures onto these kinds so that callers (engines,
//! the CLI, HTTP handlers) can react to *what* went wrong without knowing
//! which backend they talk to: `NotFound` becomes a 404, `Unsupported` lets a
//! conformance suite accept an optional capability being absent, `Conflict`
//! covers sealed logs and busy sessions, `Fenced` a replaced runner.

use std::fmt;

/// What kind of failure an [`Error`] is. On the wire (a remote executor's
/// or engine's error body) it is its [`as_str`](ErrorKind::as_str) name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// The named thing (sandbox, key, session, file) does not exist.
    NotFound,
    /// The backend does not offer this optional capability.
    Unsupported,
    /// The input is malformed or violates a limit; nothing was changed.
    InvalidInput,
    /// The request conflicts with the current state (sealed log, a turn
    /// already running, duplicate id with different content, …).
    Conflict,
    /// The caller is a runner that a newer runner generation replaced: it
    /// must stop writing at once (nothing it sends is stored any more).
    Fenced,
    /// An archive entry would escape its target, or another safety rule
    /// refused the operation; nothing was changed.
    Unsafe,
    /// The operation was aborted by its caller.
    Aborted,
    /// The operation ran past its deadline.
    TimedOut,
    /// Stored data failed an integrity check (hash mismatch, truncation).
    Corrupt,
    /// What was asked for existed once and retention removed it (frames
    /// trimmed off a log's start): ask for what is kept.
    Gone,
    /// Authentication or authorization failed.
    Unauthorized,
    /// The backend (engine, daemon, store) failed or is unreachable.
    Backend,
    /// Local I/O failed.
    Io,
}

impl ErrorKind {
    /// A short, stable, snake_case name (used in JSON errors and logs).
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::NotFound => "not_found",
            ErrorKind::Unsupported => "unsupported",
            ErrorKind::InvalidInput => "invalid_input",
            ErrorKind::Conflict => "conflict",
            ErrorKind::Fenced => "fenced",
            ErrorKind::Unsafe => "unsafe",
            ErrorKind::Aborted => "aborted",
            ErrorKind::TimedOut => "timed_out",
            ErrorKind::Corrupt => "corrupt",
            ErrorKind::Gone => "gone",
            ErrorKind::Unauthorized => "unauthorized",
            ErrorKind::Backend => "backend",
            ErrorKind::Io => "io",
        }
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An error with a kind and a human-readable message that says what to do.
#[derive(Debug, thiserror::Error)]
#[error("{kind}: {message}")]
pub struct Error {
    kind: ErrorKind,
    message: String,
    #[source]
    source: Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
}

/// `Result` with the crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// An error of `kind` with `message`.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
            source: None,
        }
    }

    /// Attach the underlying cause.
    pub fn with_source(mut self, source: impl std::error::Error + Send + Sync + 'static) -> Self {
        self.source = Some(Box::new(source));
        self
    }

    /// What kind of failure this is.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The message without the kind prefix.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// Shorthand for [`ErrorKind::NotFound`].
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::NotFound, message)
    }
    /// Shorthand for [`ErrorKind::Unsupported`].
    pub fn unsupported(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Unsupported, message)
    }
    /// Shorthand for [`ErrorKind::InvalidInput`].
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidInput, message)
    }
    /// Shorthand for [`ErrorKind::Conflict`].
    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Conflict, message)
    }
    /// Shorthand for [`ErrorKind::Fenced`].
    pub fn fenced(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Fenced, message)
    }
    /// Shorthand for [`ErrorKind::Unsafe`].
    pub fn unsafe_entry(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Unsafe, message)
    }
    /// Shorthand for [`ErrorKind::Backend`].
    pub fn backend(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Backend, message)
    }
    /// Shorthand for [`ErrorKind::Gone`].
    pub fn gone(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Gone, message)
    }
    /// Shorthand for [`ErrorKind::Corrupt`].
    pub fn corrupt(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Corrupt, message)
    }
}

impl From<std::io::Error> for Error {
    fn from(err: std::io::Error) -> Self {
        let kind = match err.kind() {
            std::io::ErrorKind::NotFound => ErrorKind::NotFound,
            std::io::ErrorKind::InvalidInput | std::io::ErrorKind::InvalidData => {
                ErrorKind::InvalidInput
            }
            std::io::ErrorKind::TimedOut => ErrorKind::TimedOut,
            std::io::ErrorKind::Unsupported => ErrorKind::Unsupported,
            _ => ErrorKind::Io,
        };
        // Errors that already carry one of ours (wrapped for an io::Read
        // adapter) are unwrapped so the kind survives the round trip.
        if err.get_ref().is_some_and(|inner| inner.is::<Error>()) {
            let inner = err.into_inner().expect("checked above");
            return *inner.downcast::<Error>().expect("checked above");
        }
        Error::new(kind, err.to_string()).with_source(err)
    }
}

impl From<serde_json::Error> for Error {
    fn from(err: serde_json::Error) -> Self {
        Error::invalid(format!("malformed JSON: {err}")).with_source(err)
    }
}

impl From<Error> for std::io::Error {
    fn from(err: Error) -> Self {
        let kind = match err.kind {
            ErrorKind::NotFound => std::io::ErrorKind::NotFound,
            ErrorKind::InvalidInput | ErrorKind::Unsafe | ErrorKind::Corrupt => {
                std::io::ErrorKind::InvalidData
            }
            ErrorKind::TimedOut => std::io::ErrorKind::TimedOut,
            ErrorKind::Unsupported => std::io::ErrorKind::Unsupported,
            _ => std::io::ErrorKind::Other,
        };
        std::io::Error::new(kind, err)
    }
}

#[cfg(test)]
mod tests {
    use super::ErrorKind;

    /// The wire name of every kind is its `as_str` name, both ways.
    #[test]
    fn kinds_travel_by_their_names() {
        let kinds = [
            ErrorKind::NotFound,
            ErrorKind::Unsupported,
            ErrorKind::InvalidInput,
            ErrorKind::Conflict,
            ErrorKind::Fenced,
            ErrorKind::Unsafe,
            ErrorKind::Aborted,
            ErrorKind::TimedOut,
            ErrorKind::Corrupt,
            ErrorKind::Gone,
            ErrorKind::Unauthorized,
            ErrorKind::Backend,
            ErrorKind::Io,
        ];
        for kind in kinds {
            let json = serde_json::to_value(kind).unwrap();
            assert_eq!(json, serde_json::Value::from(kind.as_str()));
            assert_eq!(serde_json::from_value::<ErrorKind>(json).unwrap(), kind);
        }
    }
}
