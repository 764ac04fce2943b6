//! The audit chain: every stored frame carries a hash of its own content
//! and of its predecessor's hash, so an edit, an insertion or a deletion
//! anywhere in a log is found by walking it once ([`verify_chain`]).
//!
//! ```text
//! hash(n) = HMAC-SHA256(key, "harness-frame-v1" ‖ hash(n-1) ‖ seq ‖ at_ms ‖ idem key ‖ body)
//! hash(0) = 32 zero bytes
//! ```
//!
//! The hash is computed once, by the append decision
//! ([`plan_append`](super::plan_append)), over the body exactly as the store
//! keeps it, so every store chains alike. It does not cover the session id:
//! a fork copies its parent's frames with their hashes and continues from
//! the parent's hash at the cut.
//!
//! **Why keyed.** An unkeyed chain catches a changed or missing frame, but
//! whoever can write the store can also rewrite every frame after some
//! point and recompute every hash. With a key the store never holds (the
//! harness home's `audit.key`, a Worker secret), such a rewrite cannot be
//! made consistent. [`ChainKey::unkeyed`] (an empty key) is what a store
//! uses when it was given none: tests and throwaway logs.
//!
//! **What it does not catch.** Frames cut off the *end* of a log leave a
//! shorter chain that is still whole; compare with a head kept elsewhere
//! (`verify` prints the head; clients also hold the seqs they saw).
//! `docs/audit.md` has the threat model.

use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

use crate::{Error, Result};

/// Bytes in a frame hash.
pub const HASH_LEN: usize = 32;

/// Domain tag at the start of every hashed message (a later format gets a
/// new tag, never a new meaning for this one).
const DOMAIN: &[u8] = b"harness-frame-v1";

/// A frame's link in the chain.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FrameHash([u8; HASH_LEN]);

impl FrameHash {
    /// The predecessor of a log's first frame.
    pub const GENESIS: FrameHash = FrameHash([0; HASH_LEN]);

    /// The hash from its bytes.
    pub fn from_bytes(bytes: [u8; HASH_LEN]) -> Self {
        Self(bytes)
    }

    /// The hash from a slice as stored (a BLOB column); `Corrupt` when it
    /// has the wrong length.
    pub fn from_slice(bytes: &[u8]) -> Result<Self> {
        <[u8; HASH_LEN]>::try_from(bytes).map(Self).map_err(|_| {
            Error::corrupt(format!(
                "a frame hash holds {} bytes, not {HASH_LEN}",
                bytes.len()
            ))
        })
    }

    /// The hash from 64 hex digits.
    pub fn parse_hex(text: &str) -> Result<Self> {
        let mut bytes = [0; HASH_LEN];
        hex::decode_to_slice(text.trim(), &mut bytes).map_err(|e| {
            Error::invalid(format!("`{text}` is not a frame hash (64 hex digits): {e}"))
        })?;
        Ok(Self(bytes))
    }

    /// Its bytes.
    pub fn as_bytes(&self) -> &[u8; HASH_LEN] {
        &self.0
    }

    /// 64 lowercase hex digits.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }
}

impl std::fmt::Display for FrameHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl std::fmt::Debug for FrameHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "FrameHash({})", self.to_hex())
    }
}

impl Serialize for FrameHash {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_hex())
    }
}

impl<'de> Deserialize<'de> for FrameHash {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        FrameHash::parse_hex(&text).map_err(serde::de::Error::custom)
    }
}

/// The secret the chain is keyed with. Kept by whoever runs the log, never
/// by the store.
#[derive(Clone)]
pub struct ChainKey {
    secret: Vec<u8>,
    /// The HMAC with the key already absorbed: each link clones it instead
    /// of hashing the padded key again (two of a short frame's five
    /// compressions).
    keyed: Hmac<Sha256>,
    /// No chain at all: frames are stored without a hash. Only the append
    /// bench's side-by-side anchor uses it ([`ChainKey::off`]).
    off: bool,
}

impl PartialEq for ChainKey {
    fn eq(&self, other: &Self) -> bool {
        self.secret == other.secret && self.off == other.off
    }
}

impl Eq for ChainKey {}

impl ChainKey {
    /// A key from secret bytes (any length; 32 random bytes is right).
    pub fn new(secret: impl Into<Vec<u8>>) -> Self {
        let secret = secret.into();
        Self {
            keyed: <Hmac<Sha256> as Mac>::new_from_slice(&secret)
                .expect("HMAC takes a key of any length"),
            secret,
            off: false,
        }
    }

    /// The empty key: a chain anyone can recompute (see the module docs).
    pub fn unkeyed() -> Self {
        Self::new(Vec::new())
    }

    /// Whether this is the empty key.
    pub fn is_unkeyed(&self) -> bool {
        self.secret.is_empty()
    }

    /// No chain: appends store frames without a hash, as a log did before
    /// the chain existed (`verify` then counts them as unchained). For the
    /// append bench's anchor, which measures what the chain costs.
    #[doc(hidden)]
    pub fn off() -> Self {
        Self {
            off: true,
            ..Self::unkeyed()
        }
    }

    /// Whether appends chain at all ([`off`](Self::off)).
    pub fn chains(&self) -> bool {
        !self.off
    }
}

impl Default for ChainKey {
    fn default() -> Self {
        Self::unkeyed()
    }
}

impl std::fmt::Debug for ChainKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the secret.
        if self.off {
            f.write_str("ChainKey(off)")
        } else if self.is_unkeyed() {
            f.write_str("ChainKey(unkeyed)")
        } else {
            f.write_str("ChainKey(..)")
        }
    }
}

/// The hash of one frame, given its predecessor's.
pub fn link(
    key: &ChainKey,
    prev: &FrameHash,
    seq: u64,
    at_ms: u64,
    idem_key: Option<&str>,
    body_json: &str,
) -> FrameHash {
    let mut mac = key.keyed.clone();
    mac.update(DOMAIN);
    mac.update(&prev.0);
    mac.update(&seq.to_be_bytes());
    mac.update(&at_ms.to_be_bytes());
    // Lengths before variable fields, so no two frames hash the same bytes.
    match idem_key {
        Some(k) => {
            mac.update(&[1]);
            mac.update(&(k.len() as u64).to_be_bytes());
            mac.update(k.as_bytes());
        }
        None => mac.update(&[0]),
    }
    mac.update(&(body_json.len() as u64).to_be_bytes());
    mac.update(body_json.as_bytes());
    FrameHash(mac.finalize().into_bytes().into())
}

/// One stored frame as the chain sees it: its fields as stored (the body
/// as the store keeps its text) and the hash stored with it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChainedFrame {
    /// Its seq.
    pub seq: u64,
    /// Its stamp.
    pub at_ms: u64,
    /// Its idempotency key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// Its body as stored (JSON text).
    pub body: String,
    /// Its stored hash; `None` for a frame written before the log kept a
    /// chain.
    pub hash: Option<FrameHash>,
}

/// Where a chain does not hold.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ChainBreak {
    /// Frames are missing: `after` is followed by `next` (or by nothing,
    /// when `next` is `None` and the log says it is longer).
    Gap {
        /// The last frame present before the hole (0: none).
        after: u64,
        /// The first frame after it, if any.
        next: Option<u64>,
    },
    /// The frame's stored hash is not the hash of what is stored: its body,
    /// stamp or key was changed, or a frame before it was.
    Mismatch {
        /// The frame.
        seq: u64,
    },
    /// A frame without a hash after frames that have one: its hash was
    /// removed.
    Unchained {
        /// The frame.
        seq: u64,
    },
}

impl std::fmt::Display for ChainBreak {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ChainBreak::Gap {
                after,
                next: Some(next),
            } => write!(
                f,
                "frames {}..={} are missing (frame {after} is followed by frame {next})",
                after + 1,
                next - 1
            ),
            ChainBreak::Gap { after, next: None } => write!(
                f,
                "frames after {after} are missing (the log says it holds more)"
            ),
            ChainBreak::Mismatch { seq } => write!(
                f,
                "frame {seq} does not match its hash: its body, stamp or key was changed \
                 (or its hash was)"
            ),
            ChainBreak::Unchained { seq } => write!(
                f,
                "frame {seq} has no hash although frames before it have one"
            ),
        }
    }
}

/// What [`verify_chain`] found.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChainReport {
    /// Frames read.
    pub frames: u64,
    /// Leading frames written before the log kept a chain (they are not
    /// covered).
    pub unchained: u64,
    /// The last frame's hash, when the chain holds to the end: compare it
    /// with a head kept elsewhere to catch a cut-off end.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head: Option<FrameHash>,
    /// The first place the chain does not hold; `None`: intact.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub broken: Option<ChainBreak>,
    /// The frame whose hash is the head the walk was asked to look for
    /// ([`ChainVerifier::watching`]); `None` when it is not in the chain
    /// (or none was asked for).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kept_head_at: Option<u64>,
}

impl ChainReport {
    /// Whether the chain holds.
    pub fn intact(&self) -> bool {
        self.broken.is_none()
    }
}

/// Walks a log's frames in seq order, checking each link.
#[derive(Debug, Clone)]
pub struct ChainVerifier {
    key: ChainKey,
    prev: FrameHash,
    last_seq: u64,
    chained: bool,
    watched: Option<FrameHash>,
    report: ChainReport,
}

impl ChainVerifier {
    /// A walk from the start of a log.
    pub fn new(key: ChainKey) -> Self {
        Self {
            key,
            prev: FrameHash::GENESIS,
            last_seq: 0,
            chained: false,
            watched: None,
            report: ChainReport {
                frames: 0,
                unchained: 0,
                head: None,
                broken: None,
                kept_head_at: None,
            },
        }
    }

    /// Start the walk at a trimmed log's cut ([`LogCut`](super::LogCut)):
    /// the next frame is `through + 1`, linked to the hash kept there.
    pub fn from_cut(mut self, cut: &super::LogCut) -> Self {
        self.last_seq = cut.through;
        if let Some(hash) = cut.hash {
            self.prev = hash;
            self.chained = true;
        }
        self
    }

    /// Also note which frame's hash is `head` (a head kept elsewhere: the
    /// log must still hold it, which catches frames cut off its end).
    pub fn watching(mut self, head: FrameHash) -> Self {
        self.watched = Some(head);
        self
    }

    /// Whether a break was found (later frames are then not looked at).
    pub fn broken(&self) -> bool {
        self.report.broken.is_some()
    }

    /// The next frame.
    pub fn push(&mut self, frame: &ChainedFrame) {
        if self.broken() {
            return;
        }
        self.report.frames += 1;
        if frame.seq != self.last_seq + 1 {
            self.report.broken = Some(ChainBreak::Gap {
                after: self.last_seq,
                next: Some(frame.seq),
            });
            return;
        }
        self.last_seq = frame.seq;
        let Some(stored) = frame.hash else {
            if self.chained {
                self.report.broken = Some(ChainBreak::Unchained { seq: frame.seq });
            } else {
                self.report.unchained += 1;
            }
            return;
        };
        // The first chained frame after an unchained prefix starts from
        // genesis (that is how an older log began its chain).
        self.chained = true;
        let expected = link(
            &self.key,
            &self.prev,
            frame.seq,
            frame.at_ms,
            frame.key.as_deref(),
            &frame.body,
        );
        if expected != stored {
            self.report.broken = Some(ChainBreak::Mismatch { seq: frame.seq });
            return;
        }
        if self.watched == Some(stored) {
            self.report.kept_head_at = Some(frame.seq);
        }
        self.prev = stored;
    }

    /// The report, given the last seq the log says it holds.
    pub fn finish(mut self, log_last_seq: u64) -> ChainReport {
        if self.report.broken.is_none() && self.last_seq < log_last_seq {
            self.report.broken = Some(ChainBreak::Gap {
                after: self.last_seq,
                next: None,
            });
        }
        if self.report.broken.is_none() && self.chained {
            self.report.head = Some(self.prev);
        }
        self.report
    }
}

/// Check a whole log's frames (in seq order) against `key`.
pub fn verify_chain<'a>(
    key: &ChainKey,
    frames: impl IntoIterator<Item = &'a ChainedFrame>,
    log_last_seq: u64,
) -> ChainReport {
    let mut v = ChainVerifier::new(key.clone());
    for f in frames {
        v.push(f);
    }
    v.finish(log_last_seq)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(key: &ChainKey, bodies: &[&str]) -> Vec<ChainedFrame> {
        let mut prev = FrameHash::GENESIS;
        bodies
            .iter()
            .enumerate()
            .map(|(i, b)| {
                let seq = i as u64 + 1;
                let hash = link(key, &prev, seq, 1000 + seq, None, b);
                prev = hash;
                ChainedFrame {
                    seq,
                    at_ms: 1000 + seq,
                    key: None,
                    body: b.to_string(),
                    hash: Some(hash),
                }
            })
            .collect()
    }

    #[test]
    fn an_intact_chain_verifies_and_names_its_head() {
        let key = ChainKey::new(*b"0123456789abcdef0123456789abcdef");
        let frames = chain(&key, &["{\"a\":1}", "{\"b\":2}", "{\"c\":3}"]);
        let report = verify_chain(&key, &frames, 3);
        assert!(report.intact(), "{report:?}");
        assert_eq!(report.frames, 3);
        assert_eq!(report.head, frames[2].hash);
        assert_eq!(report.kept_head_at, None, "no head was asked for");
        let mut walk = ChainVerifier::new(key.clone()).watching(frames[1].hash.unwrap());
        for f in &frames {
            walk.push(f);
        }
        assert_eq!(walk.finish(3).kept_head_at, Some(2));
    }

    #[test]
    fn an_edited_body_is_named() {
        let key = ChainKey::new(*b"k");
        let mut frames = chain(&key, &["1", "2", "3", "4"]);
        frames[2].body = "33".into();
        let report = verify_chain(&key, &frames, 4);
        assert_eq!(report.broken, Some(ChainBreak::Mismatch { seq: 3 }));
        assert_eq!(report.head, None);
    }

    #[test]
    fn a_deleted_frame_is_a_gap_and_a_cut_end_too_when_the_log_says_so() {
        let key = ChainKey::new(*b"k");
        let mut frames = chain(&key, &["1", "2", "3", "4"]);
        frames.remove(1);
        let report = verify_chain(&key, &frames, 4);
        assert_eq!(
            report.broken,
            Some(ChainBreak::Gap {
                after: 1,
                next: Some(3)
            })
        );
        let frames = chain(&key, &["1", "2", "3"]);
        let report = verify_chain(&key, &frames, 4);
        assert_eq!(
            report.broken,
            Some(ChainBreak::Gap {
                after: 3,
                next: None
            })
        );
    }

    /// Frames 3.. rewritten with every hash recomputed, unkeyed: what the
    /// store's writer can do without the key.
    fn rewrite_from_3(frames: &[ChainedFrame]) -> Vec<ChainedFrame> {
        let mut forged = frames.to_vec();
        let mut prev = forged[1].hash.unwrap();
        for f in forged.iter_mut().skip(2) {
            f.body = format!("forged {}", f.body);
            let h = link(&ChainKey::unkeyed(), &prev, f.seq, f.at_ms, None, &f.body);
            f.hash = Some(h);
            prev = h;
        }
        forged
    }

    #[test]
    fn a_consistent_rewrite_without_the_key_is_caught_and_with_no_key_is_not() {
        let key = ChainKey::new(*b"the deployment's secret");
        let frames = chain(&key, &["1", "2", "3", "4"]);
        // The writer of the store rewrites from frame 3 on and recomputes
        // every hash, but it does not hold the key.
        let forged = rewrite_from_3(&frames);
        assert_eq!(
            verify_chain(&key, &forged, 4).broken,
            Some(ChainBreak::Mismatch { seq: 3 })
        );
        // The same rewrite of an unkeyed chain passes: why logs are keyed.
        let open = chain(&ChainKey::unkeyed(), &["1", "2", "3", "4"]);
        let forged = rewrite_from_3(&open);
        assert!(verify_chain(&ChainKey::unkeyed(), &forged, 4).intact());
    }

    #[test]
    fn every_field_is_covered() {
        let key = ChainKey::new(*b"k");
        let base = link(&key, &FrameHash::GENESIS, 1, 5, None, "{}");
        assert_ne!(base, link(&key, &FrameHash::GENESIS, 2, 5, None, "{}"));
        assert_ne!(base, link(&key, &FrameHash::GENESIS, 1, 6, None, "{}"));
        assert_ne!(base, link(&key, &FrameHash::GENESIS, 1, 5, Some(""), "{}"));
        assert_ne!(base, link(&key, &FrameHash::GENESIS, 1, 5, None, "{ }"));
        assert_ne!(
            base,
            link(&key, &FrameHash::from_bytes([1; 32]), 1, 5, None, "{}")
        );
        assert_ne!(
            base,
            link(&ChainKey::new(*b"j"), &FrameHash::GENESIS, 1, 5, None, "{}")
        );
    }

    #[test]
    fn an_unchained_prefix_is_counted_and_a_removed_hash_is_named() {
        let key = ChainKey::new(*b"k");
        let mut frames = chain(&key, &["1", "2", "3"]);
        // An older log: frame 1 predates the chain, which begins at 2
        // from genesis.
        let mut old = vec![ChainedFrame {
            hash: None,
            ..frames[0].clone()
        }];
        let h2 = link(&key, &FrameHash::GENESIS, 2, 1002, None, "2");
        old.push(ChainedFrame {
            hash: Some(h2),
            ..frames[1].clone()
        });
        let report = verify_chain(&key, &old, 2);
        assert!(report.intact(), "{report:?}");
        assert_eq!(report.unchained, 1);
        frames[2].hash = None;
        assert_eq!(
            verify_chain(&key, &frames, 3).broken,
            Some(ChainBreak::Unchained { seq: 3 })
        );
    }

    #[test]
    fn hashes_read_back_from_hex_and_json() {
        let h = link(&ChainKey::unkeyed(), &FrameHash::GENESIS, 1, 0, None, "x");
        assert_eq!(FrameHash::parse_hex(&h.to_hex()).unwrap(), h);
        let json = serde_json::to_string(&h).unwrap();
        assert_eq!(serde_json::from_str::<FrameHash>(&json).unwrap(), h);
        assert!(FrameHash::parse_hex("abc").is_err());
        assert!(FrameHash::from_slice(&[0; 31]).is_err());
    }

    /// A hash shows as its hex everywhere (stores keep its bytes, logs and
    /// reports its text), and its bytes are its own.
    #[test]
    fn a_hash_shows_its_own_bytes_and_hex() {
        let h = link(&ChainKey::unkeyed(), &FrameHash::GENESIS, 1, 0, None, "x");
        let hex = h.to_hex();
        assert_eq!(hex::encode(h.as_bytes()), hex);
        assert_eq!(FrameHash::from_slice(h.as_bytes()).unwrap(), h);
        assert_eq!(h.to_string(), hex);
        assert_eq!(format!("{h:?}"), format!("FrameHash({hex})"));
        let other = FrameHash::parse_hex(&"01".repeat(HASH_LEN)).unwrap();
        assert_eq!(other.as_bytes(), &[1; HASH_LEN]);
    }

    /// Keys are equal by their secret and whether they chain at all; the
    /// empty key is the unkeyed one; `off` chains nothing; a key never
    /// prints its secret.
    #[test]
    fn keys_compare_by_secret_and_never_print_it() {
        let key = ChainKey::new(b"s3cret-bytes".to_vec());
        assert_eq!(key, ChainKey::new(b"s3cret-bytes".to_vec()));
        assert_ne!(key, ChainKey::new(b"other".to_vec()));
        assert_ne!(key, ChainKey::unkeyed());
        assert_eq!(ChainKey::unkeyed(), ChainKey::default());
        assert_ne!(ChainKey::unkeyed(), ChainKey::off());
        assert!(ChainKey::unkeyed().is_unkeyed());
        assert!(!key.is_unkeyed());
        assert!(key.chains() && ChainKey::unkeyed().chains());
        assert!(!ChainKey::off().chains());
        assert_eq!(format!("{:?}", ChainKey::off()), "ChainKey(off)");
        assert_eq!(format!("{:?}", ChainKey::unkeyed()), "ChainKey(unkeyed)");
        let shown = format!("{key:?}");
        assert_eq!(shown, "ChainKey(..)");
        assert!(!shown.contains("s3cret"));
    }

    /// Each break says where the chain fails, in words an operator can act on.
    #[test]
    fn breaks_say_where_the_chain_fails() {
        let cases = [
            (
                ChainBreak::Gap {
                    after: 3,
                    next: Some(7),
                },
                "frames 4..=6 are missing (frame 3 is followed by frame 7)",
            ),
            (
                ChainBreak::Gap {
                    after: 9,
                    next: None,
                },
                "frames after 9 are missing",
            ),
            (
                ChainBreak::Mismatch { seq: 5 },
                "frame 5 does not match its hash",
            ),
            (
                ChainBreak::Unchained { seq: 8 },
                "frame 8 has no hash although frames before it have one",
            ),
        ];
        for (broken, says) in cases {
            let text = broken.to_string();
            assert!(text.contains(says), "{broken:?} says {text:?}");
        }
    }
}
