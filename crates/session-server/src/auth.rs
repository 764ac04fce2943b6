//! Bearer tokens scoped to a session (or every session) and a role.
//!
//! A request names its token in `Authorization: Bearer <token>`, or, for
//! browsers whose `EventSource`/`WebSocket` cannot set headers, in the
//! `access_token` query parameter. No token or an unknown token is 401; a
//! known token without a grant for this session and role is 403. Both are
//! decided before anything reaches the actor or the log.
//!
//! The grants and the decision are `session-api`'s, shared with the
//! Cloudflare Worker; this is their axum side.

use axum::http::HeaderMap;
use harness_core::SessionId;

pub use session_api::auth::{GrantRole, Scope, TokenGrant};

use crate::error::ApiError;

/// The token from the `Authorization` header, else from `access_token`.
pub(crate) fn bearer(headers: &HeaderMap, query_token: Option<&str>) -> Option<String> {
    let header = headers.get(axum::http::header::AUTHORIZATION);
    session_api::auth::bearer(header.map(|v| v.as_bytes()), query_token)
}

/// Check that the caller may act as one of `allowed` on `session`. Host
/// grants pass every check. Returns the role that matched.
pub(crate) fn authorize(
    grants: &[TokenGrant],
    insecure_no_auth: bool,
    token: Option<&str>,
    session: Option<&SessionId>,
    allowed: &[GrantRole],
) -> Result<GrantRole, ApiError> {
    session_api::auth::authorize(grants, insecure_no_auth, token, session, allowed)
        .map_err(ApiError::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sid(s: &str) -> SessionId {
        SessionId::parse(s).unwrap()
    }

    /// The decision is session-api's (tested there); here, that its
    /// refusals keep their status on the way to an HTTP answer.
    #[test]
    fn refusals_keep_their_status() {
        let grants = vec![TokenGrant::new(
            "c",
            Scope::Session(sid("a")),
            GrantRole::Client,
        )];
        let refused = |t: Option<&str>, s: &str| {
            authorize(&grants, false, t, Some(&sid(s)), &[GrantRole::Client])
                .unwrap_err()
                .status
        };
        assert_eq!(refused(None, "a"), 401);
        assert_eq!(refused(Some("c"), "b"), 403);
        assert_eq!(
            authorize(
                &grants,
                false,
                Some("c"),
                Some(&sid("a")),
                &[GrantRole::Client]
            )
            .unwrap(),
            GrantRole::Client
        );
    }

    #[test]
    fn bearer_comes_from_the_header_first() {
        let mut h = HeaderMap::new();
        assert_eq!(bearer(&h, Some("q")).as_deref(), Some("q"));
        h.insert("authorization", "Bearer abc".parse().unwrap());
        assert_eq!(bearer(&h, Some("q")).as_deref(), Some("abc"));
        h.insert("authorization", "Basic abc".parse().unwrap());
        assert_eq!(bearer(&h, None), None);
    }
}
