//! Session tokens: what an agent holds instead of the key.
//!
//! Two kinds, one MAC (HMAC-SHA256 under the broker's secret):
//!
//! - **session tokens** (`hsb1_…`, the native broker): the MAC of the
//!   session id. Stable, so an agent started before a crash keeps working
//!   with the broker that comes back; the broker keeps which sessions have
//!   a turn running, and opens nothing for the others.
//! - **turn tokens** (`hst1_<tag>_<turn>`, the Worker's broker): the MAC of
//!   the session id *and* the turn id, with the turn in clear. The Worker
//!   keeps no list of open sessions: it checks the tag, then asks the
//!   session's object whether that turn is the one running. A token of an
//!   ended turn is expired for good.
//!
//! Either is worthless for any other session (the broker checks it against
//! the session the request path names) and anywhere else (no provider knows
//! it).

use hmac::{Hmac, Mac};
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

/// The prefix of every session token (so a leaked one is recognisable).
pub const TOKEN_PREFIX: &str = "hsb1_";

/// The prefix of every turn token.
pub const TURN_TOKEN_PREFIX: &str = "hst1_";

/// What a session token's MAC covers: a versioned label and the session id.
fn message(session_id: &str) -> Vec<u8> {
    format!("harness-broker/v1/session/{session_id}").into_bytes()
}

fn mac(secret: &[u8], session_id: &str) -> HmacSha256 {
    mac_over(secret, &message(session_id))
}

fn mac_over(secret: &[u8], message: &[u8]) -> HmacSha256 {
    let mut mac = HmacSha256::new_from_slice(secret).expect("HMAC takes a key of any length");
    mac.update(message);
    mac
}

/// What a turn token's MAC covers: another label (a session token is never
/// a turn token), the session id, a separator no id holds, the turn id.
fn turn_message(session_id: &str, turn_id: &str) -> Vec<u8> {
    format!("harness-broker/v1/turn/{session_id}\n{turn_id}").into_bytes()
}

/// The token of turn `turn_id` of `session_id` under `secret`.
pub fn turn_token_for(secret: &[u8], session_id: &str, turn_id: &str) -> String {
    let tag = mac_over(secret, &turn_message(session_id, turn_id))
        .finalize()
        .into_bytes();
    format!("{TURN_TOKEN_PREFIX}{}_{turn_id}", hex::encode(tag))
}

/// The turn `token` opens for `session_id`, if it is a turn token of that
/// session under `secret` (constant time in the tag). Whether that turn
/// still runs is the caller's question.
pub fn verify_turn<'t>(secret: &[u8], session_id: &str, token: &'t str) -> Option<&'t str> {
    let rest = token.strip_prefix(TURN_TOKEN_PREFIX)?;
    let (tag, turn_id) = rest.split_once('_')?;
    let tag = hex::decode(tag).ok()?;
    mac_over(secret, &turn_message(session_id, turn_id))
        .verify_slice(&tag)
        .ok()?;
    Some(turn_id)
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

    #[test]
    fn a_turn_token_opens_its_own_session_and_names_its_turn() {
        let secret = b"0123456789abcdef0123456789abcdef";
        let t = turn_token_for(secret, "session-a", "t2");
        assert!(t.starts_with(TURN_TOKEN_PREFIX));
        assert_eq!(verify_turn(secret, "session-a", &t), Some("t2"));
        assert_eq!(verify_turn(secret, "session-b", &t), None);
        assert_eq!(verify_turn(b"another secret", "session-a", &t), None);
        // The turn in clear cannot be edited: the tag covers it.
        assert_eq!(
            verify_turn(secret, "session-a", &t.replace("_t2", "_t3")),
            None
        );
        // A turn id with underscores survives the round trip.
        let odd = turn_token_for(secret, "session-a", "t_4_b");
        assert_eq!(verify_turn(secret, "session-a", &odd), Some("t_4_b"));
        // The two kinds never stand for each other.
        assert!(!verify(secret, "session-a", &t));
        let session = token_for(secret, "session-a");
        assert_eq!(verify_turn(secret, "session-a", &session), None);
        assert_eq!(verify_turn(secret, "session-a", "sk-ant-real-key"), None);
    }
}
