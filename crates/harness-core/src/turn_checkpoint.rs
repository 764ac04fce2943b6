//! Turn-end checkpoints: at every turn's end the slice runner stores the
//! sandbox's working tree and the agent's own state (Claude Code's session
//! file, Codex's rollout) as one checkpoint, names it on the turn's terminal
//! `turn-status` frame, and makes a session's next sandbox from it when the
//! session has none — after a fork or a rewind — or when its sandbox is
//! gone. See `docs/session-runtime.md` ("Turn-end checkpoints").
//!
//! Core holds the trait and the key scheme; the pipeline that moves trees
//! (`harness-moves`, with its zstd) implements it, so core stays free of it.

use async_trait::async_trait;

use crate::harness::Harness;
use crate::maybe::{MaybeSend, MaybeSync};
use crate::sandbox::Sandbox;
use crate::turn::TurnState;
use crate::Result;

/// The [`StreamPart::Warning`](crate::part::StreamPart::Warning) code of the
/// part a turn emits when its sandbox was made anew from the session's
/// checkpoint (after a fork or rewind, or because the old one was gone).
pub const WARNING_SANDBOX_RESTORED: &str = "sandbox-restored";

/// Stores and restores turn-end checkpoints.
#[cfg_attr(not(target_arch = "wasm32"), async_trait)]
#[cfg_attr(target_arch = "wasm32", async_trait(?Send))]
pub trait TurnCheckpoints: MaybeSend + MaybeSync + std::fmt::Debug {
    /// Checkpoint the working tree of `sandbox` and `harness`'s state at the
    /// end of `state`'s turn, incrementally against `state.checkpoint` (the
    /// session's previous one, when there is one), under
    /// [`turn_checkpoint_key`]. Idempotent: a retry writes the same key.
    /// Returns the key.
    async fn checkpoint(
        &self,
        sandbox: &dyn Sandbox,
        harness: &dyn Harness,
        state: &TurnState,
    ) -> Result<String>;

    /// Put checkpoint `key` into `sandbox`, a new one: the tree onto its
    /// working directory, the agent's state under its `$HOME` (moved to the
    /// new paths when they differ). Nothing is written when the checkpoint
    /// is missing or damaged.
    async fn restore(&self, key: &str, sandbox: &dyn Sandbox, harness: &dyn Harness) -> Result<()>;
}

/// Where the checkpoint of `turn_id`'s end in `session_id` lives:
/// `turns/<session>/<turn>`, bytes outside the key alphabet (`A-Z a-z 0-9
/// . -`) written as `_xx` escapes so every turn id maps to one
/// valid key.
pub fn turn_checkpoint_key(session_id: &str, turn_id: &str) -> String {
    fn segment(s: &str) -> String {
        let mut out = String::with_capacity(s.len());
        for b in s.bytes() {
            if b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-') {
                out.push(b as char);
            } else {
                out.push_str(&format!("_{b:02x}"));
            }
        }
        if out == "." || out == ".." {
            out = out.replace('.', "_2e");
        }
        out
    }
    format!("turns/{}/{}", segment(session_id), segment(turn_id))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_turn_id_maps_to_one_valid_key() {
        let cases = [
            ("s1", "t1", "turns/s1/t1"),
            ("s_1", "t 1", "turns/s_5f1/t_201"),
            ("s", "..", "turns/s/_2e_2e"),
            ("s", "a/b", "turns/s/a_2fb"),
            ("s", "é", "turns/s/_c3_a9"),
        ];
        for (s, t, want) in cases {
            let key = turn_checkpoint_key(s, t);
            assert_eq!(key, want);
            crate::checkpoint::validate_key(&format!("{key}/manifest.json")).unwrap();
        }
        // Distinct ids, distinct keys (the escape is injective).
        assert_ne!(
            turn_checkpoint_key("s", "a_b"),
            turn_checkpoint_key("s", "a b")
        );
    }
}
