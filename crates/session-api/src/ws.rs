//! The session WebSocket (`GET /v1/sessions/{id}/ws`): who connects
//! (`?role=client|runner|tool-host`, `generation`, `takeover`), which
//! grants each role needs, and what an inbound text message is — the same
//! on `session-server` and on the Worker's Durable Object (which holds its
//! sockets with the hibernation API).

use std::collections::HashMap;

use harness_core::actor::{ClientMessage, ErrorCode, Role, RunnerMessage, ServerMessage};
use harness_core::relay::HostMessage;

use crate::auth::{check_client_message, GrantRole};
use crate::request::param_u64;
use crate::ApiError;

/// The close code a server sends when the actor closes a connection (a
/// fenced runner, a replaced tool host).
pub const CLOSED_BY_SESSION: u16 = 4001;

/// Most bytes a close frame's reason may hold (RFC 6455: a control frame's
/// payload is at most 125 bytes, two of them the code).
pub const MAX_CLOSE_REASON: usize = 123;

/// `reason` cut to fit a close frame, at a character boundary: a longer one
/// is a protocol error that the peer sees instead of the reason.
pub fn close_reason(reason: &str) -> &str {
    if reason.len() <= MAX_CLOSE_REASON {
        return reason;
    }
    let mut end = MAX_CLOSE_REASON;
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    &reason[..end]
}

/// The role a socket asks for.
pub fn role(params: &HashMap<String, String>) -> Result<Role, ApiError> {
    Ok(match params.get("role").map(String::as_str) {
        None | Some("client") => Role::Client,
        Some("runner") => Role::Runner {
            generation: param_u64(params, "generation")?.ok_or_else(|| {
                ApiError::invalid("a runner must say its generation (?generation=N)")
            })?,
        },
        Some("tool-host") => Role::ToolHost {
            takeover: match params.get("takeover").map(String::as_str) {
                None | Some("false") => false,
                Some("true") => true,
                Some(other) => {
                    return Err(ApiError::invalid(format!(
                        "takeover must be true or false, got {other:?}"
                    )))
                }
            },
        },
        Some(other) => {
            return Err(ApiError::invalid(format!(
                "role must be client, runner or tool-host, got {other:?}"
            )))
        }
    })
}

/// The grants that may connect as `role` (a host may do everything).
pub fn grants_for(role: Role) -> &'static [GrantRole] {
    match role {
        Role::Client => &[GrantRole::Client],
        Role::Runner { .. } => &[GrantRole::Runner],
        Role::ToolHost { .. } => &[GrantRole::ToolHost],
    }
}

/// One inbound message, typed by the socket's role.
#[derive(Debug, Clone, PartialEq)]
pub enum Inbound {
    /// From a client.
    Client(ClientMessage),
    /// From the runner.
    Runner(RunnerMessage),
    /// From the tool host.
    ToolHost(HostMessage),
}

/// Parse a text message from a socket of `role` held by `grant`: the
/// message, or the error to send back (nothing reaches the actor). Over
/// `limit` bytes, malformed JSON, or a seal from a client without the
/// host grant are refused here.
// The refusal is sent on the socket at once, never carried up a call
// chain, so its size does not matter.
#[allow(clippy::result_large_err)]
pub fn parse_inbound(
    role: Role,
    grant: GrantRole,
    raw: &str,
    limit: usize,
) -> Result<Inbound, ServerMessage> {
    if raw.len() > limit {
        return Err(ServerMessage::Error {
            code: ErrorCode::FrameTooLarge,
            message: format!(
                "message of {} bytes exceeds the {limit}-byte limit",
                raw.len()
            ),
        });
    }
    let invalid = |e: serde_json::Error| ServerMessage::Error {
        code: ErrorCode::Invalid,
        message: format!("malformed message: {e}"),
    };
    match role {
        Role::Client => match serde_json::from_str::<ClientMessage>(raw) {
            Ok(m) => match check_client_message(&m, grant) {
                Ok(()) => Ok(Inbound::Client(m)),
                Err(e) => Err(e.to_message()),
            },
            Err(e) => Err(invalid(e)),
        },
        Role::Runner { .. } => serde_json::from_str(raw)
            .map(Inbound::Runner)
            .map_err(invalid),
        Role::ToolHost { .. } => serde_json::from_str(raw)
            .map(Inbound::ToolHost)
            .map_err(invalid),
    }
}

/// The error for a binary message.
pub fn binary_refused() -> ServerMessage {
    ServerMessage::Error {
        code: ErrorCode::Invalid,
        message: "send JSON text messages, not binary".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn close_reasons_fit_a_close_frame() {
        assert_eq!(close_reason("short"), "short");
        let long = "é".repeat(100);
        let cut = close_reason(&long);
        assert!(cut.len() <= MAX_CLOSE_REASON && cut.len() >= MAX_CLOSE_REASON - 1);
        assert!(long.starts_with(cut));
    }

    #[test]
    fn roles_come_from_the_query() {
        assert_eq!(role(&params(&[])).unwrap(), Role::Client);
        assert_eq!(
            role(&params(&[("role", "runner"), ("generation", "7")])).unwrap(),
            Role::Runner { generation: 7 }
        );
        assert!(role(&params(&[("role", "runner")])).is_err());
        assert_eq!(
            role(&params(&[("role", "tool-host"), ("takeover", "true")])).unwrap(),
            Role::ToolHost { takeover: true }
        );
        assert!(role(&params(&[("role", "tool-host"), ("takeover", "yes")])).is_err());
        assert!(role(&params(&[("role", "admin")])).is_err());
    }

    #[test]
    fn inbound_messages_are_typed_or_refused() {
        let client = Role::Client;
        assert!(matches!(
            parse_inbound(
                client,
                GrantRole::Client,
                r#"{"type":"prompt","text":"hi"}"#,
                1000
            ),
            Ok(Inbound::Client(ClientMessage::Prompt { .. }))
        ));
        let refused = |r: Result<Inbound, ServerMessage>| match r {
            Err(ServerMessage::Error { code, .. }) => code,
            other => panic!("not refused: {other:?}"),
        };
        assert_eq!(
            refused(parse_inbound(
                client,
                GrantRole::Client,
                r#"{"type":"seal"}"#,
                1000
            )),
            ErrorCode::Forbidden
        );
        assert!(parse_inbound(client, GrantRole::Host, r#"{"type":"seal"}"#, 1000).is_ok());
        assert_eq!(
            refused(parse_inbound(client, GrantRole::Client, "{", 1000)),
            ErrorCode::Invalid
        );
        assert_eq!(
            refused(parse_inbound(
                client,
                GrantRole::Client,
                &"x".repeat(11),
                10
            )),
            ErrorCode::FrameTooLarge
        );
    }
}
