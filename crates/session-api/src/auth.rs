//! Bearer tokens scoped to a session (or every session) and a role.
//!
//! A request names its token in `Authorization: Bearer <token>`, or, for
//! browsers whose `EventSource`/`WebSocket` cannot set headers, in the
//! `access_token` query parameter. No token or an unknown token is 401; a
//! known token without a grant for this session and role is 403. Both are
//! decided before anything reaches the actor or the log.

use harness_core::SessionId;
use serde::{Deserialize, Serialize};

use crate::error::ApiError;

/// What a token may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GrantRole {
    /// Send prompts and answers, read frames.
    Client,
    /// Attach as the runner and send stream parts.
    Runner,
    /// Everything: create, list, fork, seal, export, and the other roles.
    Host,
    /// Attach as the session's tool host (`?role=tool-host`): offer tools
    /// and run the calls its agent makes; nothing else.
    #[serde(rename = "tool-host")]
    ToolHost,
}

/// Who may read a session: its clients and its runner (and hosts).
pub const READERS: &[GrantRole] = &[GrantRole::Client, GrantRole::Runner];
/// Host-only operations (create, list, fork, seal).
pub const HOST: &[GrantRole] = &[GrantRole::Host];
/// Who may post client messages.
pub const CLIENTS: &[GrantRole] = &[GrantRole::Client];

/// Which sessions a grant covers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    /// Every session (`*`).
    All,
    /// One session.
    Session(SessionId),
}

impl Scope {
    /// Parse `*` or a session id.
    pub fn parse(s: &str) -> harness_core::Result<Self> {
        if s == "*" {
            Ok(Scope::All)
        } else {
            SessionId::parse(s).map(Scope::Session)
        }
    }

    fn covers(&self, session: Option<&SessionId>) -> bool {
        match (self, session) {
            (Scope::All, _) => true,
            (Scope::Session(s), Some(asked)) => s == asked,
            // Session-less operations (list, create without id) need `*`.
            (Scope::Session(_), None) => false,
        }
    }
}

/// One entry of the token table. A token may appear in several grants.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenGrant {
    /// The secret.
    pub token: String,
    /// Sessions it covers.
    pub scope: Scope,
    /// What it may do there.
    pub role: GrantRole,
}

impl std::fmt::Debug for TokenGrant {
    // Never print the secret.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenGrant")
            .field("token", &"<redacted>")
            .field("scope", &self.scope)
            .field("role", &self.role)
            .finish()
    }
}

impl TokenGrant {
    /// A grant for `role` on `scope`.
    pub fn new(token: impl Into<String>, scope: Scope, role: GrantRole) -> Self {
        Self {
            token: token.into(),
            scope,
            role,
        }
    }
}

/// The token from the `Authorization` header's value (its raw bytes), else
/// from the `access_token` query parameter. A header that is not `Bearer
/// <token>` (or not text) names no token, even with the query parameter.
pub fn bearer(authorization: Option<&[u8]>, query_token: Option<&str>) -> Option<String> {
    if let Some(v) = authorization {
        let v = std::str::from_utf8(v).ok()?;
        let (scheme, rest) = v.split_once(' ')?;
        return scheme
            .eq_ignore_ascii_case("bearer")
            .then(|| rest.trim().to_string());
    }
    query_token.map(str::to_string)
}

/// Check that the caller may act as one of `allowed` on `session`. Host
/// grants pass every check. Returns the role that matched.
pub fn authorize(
    grants: &[TokenGrant],
    insecure_no_auth: bool,
    token: Option<&str>,
    session: Option<&SessionId>,
    allowed: &[GrantRole],
) -> Result<GrantRole, ApiError> {
    if insecure_no_auth {
        return Ok(GrantRole::Host);
    }
    let mine = grants_of(grants, insecure_no_auth, token)?;
    for g in &mine {
        if g.scope.covers(session) && (g.role == GrantRole::Host || allowed.contains(&g.role)) {
            return Ok(g.role);
        }
    }
    let what = session.map_or_else(|| "all sessions".to_string(), |s| format!("session {s}"));
    Err(ApiError::new(
        403,
        "forbidden",
        format!("this token may not act as {allowed:?} on {what}"),
    ))
}

/// The grants of `token`: 401 when it is missing or unknown (nothing is
/// asked of a server with `insecure_no_auth`). What a request whose
/// session is named in its body checks before reading the body.
pub fn grants_of<'a>(
    grants: &'a [TokenGrant],
    insecure_no_auth: bool,
    token: Option<&str>,
) -> Result<Vec<&'a TokenGrant>, ApiError> {
    if insecure_no_auth {
        return Ok(Vec::new());
    }
    let Some(token) = token else {
        return Err(ApiError::new(
            401,
            "unauthorized",
            "missing bearer token: send `Authorization: Bearer <token>` (or ?access_token=)",
        ));
    };
    let mine: Vec<&TokenGrant> = grants
        .iter()
        .filter(|g| constant_time_eq(g.token.as_bytes(), token.as_bytes()))
        .collect();
    if mine.is_empty() {
        return Err(ApiError::new(401, "unauthorized", "unknown bearer token"));
    }
    Ok(mine)
}

/// Sealing and rewinding are host operations, whichever endpoint carries
/// them: a client token may prompt, answer and abort, not close the session
/// or put it back to an earlier turn. Every endpoint that takes a
/// [`ClientMessage`] asks here.
pub fn check_client_message(
    message: &harness_core::actor::ClientMessage,
    grant: GrantRole,
) -> Result<(), ApiError> {
    use harness_core::actor::ClientMessage;
    let what = match message {
        ClientMessage::Seal {} => "sealing needs a host token (POST /v1/sessions/{id}/seal)",
        ClientMessage::Rewind { .. } => {
            "rewinding needs a host token (POST /v1/sessions/{id}/rewind?turn=…)"
        }
        _ => return Ok(()),
    };
    if grant == GrantRole::Host {
        Ok(())
    } else {
        Err(ApiError::new(403, "forbidden", what))
    }
}

/// Compare secrets without leaking the position of the first difference.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sid(s: &str) -> SessionId {
        SessionId::parse(s).unwrap()
    }

    #[test]
    fn grants_are_checked_by_token_scope_and_role() {
        let grants = vec![
            TokenGrant::new("c", Scope::Session(sid("a")), GrantRole::Client),
            TokenGrant::new("h", Scope::All, GrantRole::Host),
        ];
        let (a, b) = (sid("a"), sid("b"));
        let ok = |t: Option<&str>, s: Option<&SessionId>, r: &[GrantRole]| {
            authorize(&grants, false, t, s, r)
        };
        assert_eq!(
            ok(None, None, &[GrantRole::Client]).unwrap_err().status,
            401
        );
        assert_eq!(
            ok(Some("x"), None, &[GrantRole::Client])
                .unwrap_err()
                .status,
            401
        );
        assert!(ok(Some("c"), Some(&a), &[GrantRole::Client]).is_ok());
        assert_eq!(
            ok(Some("c"), Some(&b), &[GrantRole::Client])
                .unwrap_err()
                .status,
            403
        );
        assert_eq!(
            ok(Some("c"), Some(&a), &[GrantRole::Runner])
                .unwrap_err()
                .status,
            403
        );
        assert_eq!(
            ok(Some("h"), Some(&b), &[GrantRole::Runner]).unwrap(),
            GrantRole::Host
        );
        assert!(authorize(&grants, true, None, None, &[GrantRole::Host]).is_ok());
    }

    #[test]
    fn bearer_comes_from_the_header_first() {
        assert_eq!(bearer(None, Some("q")).as_deref(), Some("q"));
        assert_eq!(
            bearer(Some(b"Bearer abc"), Some("q")).as_deref(),
            Some("abc")
        );
        assert_eq!(bearer(Some(b"bearer  abc "), None).as_deref(), Some("abc"));
        assert_eq!(bearer(Some(b"Basic abc"), Some("q")), None);
        assert_eq!(bearer(Some(b"Bearer \xff"), None), None);
    }
}
