//! Session tokens: what an agent holds instead of the key.
//!
//! A token is an HMAC-SHA256 of the session id under the broker's secret
//! (a file in the broker directory, made once). It is stable, so an agent
//! started before a crash keeps working with the broker that comes back; it
//! is worthless for any other session, since the broker checks it against
//! the session named in the request path; and it is worthless anywhere else,
//! since no provider knows it.

use hmac::{Hmac, Mac};
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

/// The prefix of every session token (so a leaked one is recognisable).
pub const TOKEN_PREFIX: &str = "hsb1_";

/// What the MAC covers: a versioned label and the session id.
fn message(session_id: &str) -> Vec<u8> {
    format!("harness-broker/v1/session/{session_id}").into_bytes()
}

fn mac(secret: &[u8], session_id: &str) -> HmacSha256 {
    let mut mac = HmacSha256::new_from_slice(secret).expect("HMAC takes a key of any length");
    mac.update(&message(session_id));
    mac
}

/// The token of `session_id` under `secret`.
pub fn token_for(secret: &[u8], session_id: &str) -> String {
    let tag = mac(secret, session_id).finalize().into_bytes();
    format!("{TOKEN_PREFIX}{}", hex::encode(tag))
}

/// Whether `token` is the token of `session_id` (constant time in the tag).
pub fn verify(secret: &[u8], session_id: &str, token: &str) -> bool {
    let Some(tag) = token.strip_prefix(TOKEN_PREFIX) else {
        return false;
    };
    let Ok(tag) = hex::decode(tag) else {
        return false;
    };
    mac(secret, session_id).verify_slice(&tag).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_opens_its_own_session_only() {
        let secret = b"0123456789abcdef0123456789abcdef";
        let a = token_for(secret, "session-a");
        assert!(a.starts_with(TOKEN_PREFIX));
        assert!(verify(secret, "session-a", &a));
        assert!(!verify(secret, "session-b", &a));
        assert!(!verify(b"another secret", "session-a", &a));
        assert!(!verify(secret, "session-a", &a[..a.len() - 2]));
        assert!(!verify(secret, "session-a", "sk-ant-real-key"));
        assert!(!verify(secret, "session-a", &a.replace(TOKEN_PREFIX, "")));
        // Stable: the same secret gives the same token after a restart.
        assert_eq!(a, token_for(secret, "session-a"));
    }
}
