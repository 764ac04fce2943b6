//! The wire of a remote turn engine and a remote slice executor, as the
//! engine conformance suite drives a Workflows engine that lives inside a
//! Worker (`docs/durable-workflows.md`, "The engine conformance suite"):
//!
//! - **the engine API** — the Worker's `/v1/test/engine/<op>` routes,
//!   each a `DurableEngine` method on `WorkflowsEngine` ([`ENGINE_OPS`]);
//! - **the executor API** — `POST <executor>/<op>`, each a `SliceExecutor`
//!   method, answered by the test's executor ([`EXECUTOR_OPS`]). A Workflow
//!   step makes the call, so the suite's executor (its scripted agent in a
//!   real sandbox, its failure injection, its session log) runs every step
//!   while Workflows schedules, retries and replays them.
//!
//! Every call is one JSON request. A success is `200` with the method's
//! result as JSON; a failure is a non-`200` status with a [`RemoteError`],
//! which keeps the error's kind, so the engine classifies it
//! (`StepFailure::from_error`) exactly as it would the local error.
//!
//! Runtime-free: the Worker (wasm32) and the native test kit share it.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use harness_core::sandbox::DetachedProcess;
use harness_core::turn::{ApprovalAnswer, TurnState};
use harness_core::{Error, ErrorKind};

/// The engine API's operations (`/v1/test/engine/<op>`, all `POST`):
/// `start` takes a [`crate::TurnParams`]; `answer` an [`AnswerRequest`];
/// `abort` an [`AbortRequest`]; `state` and `wait` a [`TurnRef`] and answer
/// a `TurnState`.
pub const ENGINE_OPS: [&str; 5] = ["start", "answer", "abort", "state", "wait"];

/// The executor API's operations (`POST <executor>/<op>`):
/// `create-sandbox` and `turn-ended` take a `TurnState`; `run-slice` a
/// [`RunSliceRequest`]; `kill-agent` a [`KillAgentRequest`]; `abort-slice`
/// a [`TurnRef`] (fire the abort signal of that turn's running slice).
pub const EXECUTOR_OPS: [&str; 5] = [
    "create-sandbox",
    "run-slice",
    "abort-slice",
    "kill-agent",
    "turn-ended",
];

/// A turn, by session and turn id.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TurnRef {
    /// The session.
    pub session_id: String,
    /// The turn.
    pub turn_id: String,
}

impl TurnRef {
    /// The turn `state` is of.
    pub fn of(state: &TurnState) -> Self {
        Self {
            session_id: state.session_id.clone(),
            turn_id: state.turn_id.clone(),
        }
    }
}

/// `answer`: a client's answer to the pending approval.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AnswerRequest {
    /// The turn.
    #[serde(flatten)]
    pub turn: TurnRef,
    /// The answer.
    pub answer: ApprovalAnswer,
}

/// `abort`: abort the turn, running slice included.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AbortRequest {
    /// The turn.
    #[serde(flatten)]
    pub turn: TurnRef,
    /// Why.
    pub reason: String,
}

/// `run-slice`: run one slice of `state` within `budget_ms`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunSliceRequest {
    /// The state the slice runs on.
    pub state: TurnState,
    /// The slice's budget.
    pub budget_ms: u64,
}

impl RunSliceRequest {
    /// The budget as a duration.
    pub fn budget(&self) -> Duration {
        Duration::from_millis(self.budget_ms)
    }
}

/// `kill-agent`: kill the turn's agent process.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct KillAgentRequest {
    /// The turn.
    pub state: TurnState,
    /// Its agent.
    pub process: DetachedProcess,
}

/// A failed call's body: the error's kind and message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteError {
    /// What kind of failure it is.
    pub kind: ErrorKind,
    /// What happened.
    pub message: String,
}

impl RemoteError {
    /// The body that carries `error`.
    pub fn of(error: &Error) -> Self {
        Self {
            kind: error.kind(),
            message: error.message().to_string(),
        }
    }

    /// The HTTP status a failure of this kind is answered with (for logs
    /// and curl; the body's `kind` is what a client decides on).
    pub fn status(&self) -> u16 {
        match self.kind {
            ErrorKind::NotFound => 404,
            ErrorKind::InvalidInput | ErrorKind::Unsafe => 400,
            ErrorKind::Conflict | ErrorKind::Fenced => 409,
            ErrorKind::Unauthorized => 403,
            ErrorKind::Unsupported => 501,
            ErrorKind::Gone => 410,
            _ => 500,
        }
    }

    /// The error a client raises on reading this body.
    pub fn into_error(self) -> Error {
        Error::new(self.kind, self.message)
    }

    /// The error for a non-`200` answer whose body is `text`: the carried
    /// error if it is a [`RemoteError`], else a backend error naming the
    /// call, its status and the body.
    pub fn from_answer(what: &str, status: u16, text: &str) -> Error {
        match serde_json::from_str::<RemoteError>(text) {
            Ok(remote) => remote.into_error(),
            Err(_) => Error::backend(format!(
                "{what} answered {status}: {}",
                text.chars().take(500).collect::<String>()
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A failure keeps its kind and message across the wire, so the engine
    /// on the other side classifies it as it would the local error.
    #[test]
    fn a_remote_error_keeps_its_kind() {
        for error in [
            Error::fenced("a newer runner"),
            Error::invalid("bad prompt"),
            Error::backend("the sandbox went away"),
        ] {
            let body = serde_json::to_string(&RemoteError::of(&error)).unwrap();
            let back = RemoteError::from_answer("run-slice", 500, &body);
            assert_eq!(back.kind(), error.kind(), "{body}");
            assert_eq!(back.message(), error.message());
        }
        let other = RemoteError::from_answer("run-slice", 502, "<html>bad gateway</html>");
        assert_eq!(other.kind(), ErrorKind::Backend);
        assert!(other.message().contains("502"), "{other}");
    }

    #[test]
    fn requests_name_the_turn_flat() {
        let abort = AbortRequest {
            turn: TurnRef {
                session_id: "s".into(),
                turn_id: "t1".into(),
            },
            reason: "stop".into(),
        };
        let json = serde_json::to_value(&abort).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"session_id": "s", "turn_id": "t1", "reason": "stop"})
        );
    }
}
