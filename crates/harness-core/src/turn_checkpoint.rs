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
    format!("turns/{}/{}", key_segment(session_id), key_segment(turn_id))
}

/// `s` as one checkpoint-key segment: bytes outside `A-Z a-z 0-9 . -`
/// written as `_xx` escapes (`.` and `..` too), so distinct strings map to
/// distinct segments.
pub fn key_segment(s: &str) -> String {
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

/// Which paths of a tree a checkpoint leaves out: a subset of `.gitignore`
/// syntax, applied to the paths of the tree's entries (relative to its root,
/// `/`-separated) the same way on every provider, since the tree checkpoint
/// filters what the provider lists or exports.
///
/// - a pattern without a `/` (other than a trailing one) matches an entry
///   of that name at any depth: `node_modules`, `*.log`;
/// - a pattern with a `/` is anchored at the root: `node_modules/.cache`,
///   `/build`, `docs/**/*.tmp`;
/// - `*` matches within one path segment, `**` any number of segments; a
///   trailing `/` is dropped (a matched file is left out like a directory);
/// - an entry under a left-out directory is left out;
/// - blank lines and `#` comments are skipped; `!` (re-include) is not
///   supported and is skipped, which keeps more, never less.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PathRules {
    patterns: Vec<Vec<String>>,
}

impl PathRules {
    /// Rules from patterns (as in a `.gitignore`, one per item).
    pub fn new<I, S>(patterns: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let mut rules = Self::default();
        for p in patterns {
            rules.add(p.as_ref());
        }
        rules
    }

    /// Add the lines of a `.gitignore` file.
    pub fn add_gitignore(&mut self, text: &str) {
        for line in text.lines() {
            self.add(line);
        }
    }

    fn add(&mut self, pattern: &str) {
        let p = pattern.trim_end_matches(['\r', ' ']);
        if p.is_empty() || p.starts_with('#') || p.starts_with('!') {
            return;
        }
        let p = p.trim_end_matches('/');
        let anchored = p.contains('/');
        let p = p.trim_start_matches('/');
        if p.is_empty() {
            return;
        }
        let mut segments: Vec<String> = Vec::new();
        if !anchored {
            segments.push("**".into());
        }
        segments.extend(p.split('/').filter(|s| !s.is_empty()).map(str::to_string));
        self.patterns.push(segments);
    }

    /// Whether there are no rules.
    pub fn is_empty(&self) -> bool {
        self.patterns.is_empty()
    }

    /// Whether `path` (relative, `/`-separated) or a directory above it is
    /// left out.
    pub fn excludes(&self, path: &str) -> bool {
        let segments: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
        // A prefix matching means a directory above (or the entry itself).
        self.patterns
            .iter()
            .any(|p| (1..=segments.len()).any(|n| matches_segments(p, &segments[..n])))
    }
}

fn matches_segments(pattern: &[String], path: &[&str]) -> bool {
    match pattern.split_first() {
        None => path.is_empty(),
        Some((first, rest)) if first == "**" => {
            (0..=path.len()).any(|skip| matches_segments(rest, &path[skip..]))
        }
        Some((first, rest)) => match path.split_first() {
            Some((seg, more)) => {
                glob(first.as_bytes(), seg.as_bytes()) && matches_segments(rest, more)
            }
            None => false,
        },
    }
}

/// `*` and `?` within one segment.
fn glob(pattern: &[u8], name: &[u8]) -> bool {
    match pattern.split_first() {
        None => name.is_empty(),
        Some((b'*', rest)) => (0..=name.len()).any(|i| glob(rest, &name[i..])),
        Some((b'?', rest)) => !name.is_empty() && glob(rest, &name[1..]),
        Some((c, rest)) => name.first() == Some(c) && glob(rest, &name[1..]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn path_rules_follow_the_gitignore_subset() {
        let mut rules = PathRules::new([
            "node_modules/.cache",
            "/build/",
            "*.log",
            "# note",
            "!keep.log",
        ]);
        rules.add_gitignore("target\n\n**/tmp/*.o\n");
        for left_out in [
            "node_modules/.cache",
            "node_modules/.cache/x/y.js",
            "build",
            "build/out.bin",
            "debug.log",
            "src/deep/trace.log",
            "target",
            "crates/a/target/debug/x",
            "a/tmp/f.o",
            "tmp/f.o",
        ] {
            assert!(rules.excludes(left_out), "{left_out} should be left out");
        }
        for kept in [
            "node_modules/pkg/index.js",
            "src/build/mod.rs",
            "log",
            "logs/a.txt",
            "a/tmp/f.c",
            "keep.txt",
            "targets",
        ] {
            assert!(!rules.excludes(kept), "{kept} should be kept");
        }
        assert!(PathRules::default().is_empty());
        assert!(!PathRules::default().excludes("anything"));
    }

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
