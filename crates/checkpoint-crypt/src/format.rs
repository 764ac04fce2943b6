//! The layout of a sealed object, and the arithmetic between its content
//! and its stored bytes.
//!
//! ```text
//! header   32 bytes   magic "hck1" ‖ key id (8) ‖ salt (20, random per object)
//! data     n × (segment ‖ tag)   every segment 64 KiB of content but the last, which may be shorter (never empty)
//! trailer  48 bytes   SHA-256 of the content (32) ‖ tag, sealed as the last segment
//! ```
//!
//! Segment `i` is sealed with XChaCha20-Poly1305 under the nonce `salt[..19]
//! ‖ be32(i) ‖ last`, where `last` is 1 for the trailer only, and the
//! associated data `"harness-checkpoint-v1" ‖ key`: a segment moved to
//! another position, another object or another key, a segment dropped
//! from the end (the trailer is the only segment sealed as last) or an
//! object cut short fails to open. The trailer's hash is what
//! [`ObjectMeta::sha256`](harness_core::checkpoint::ObjectMeta) reports,
//! so callers that name content by its hash (tree checkpoints' packs, kept
//! manifests) see the same hashes as on a plain store.

use bytes::Bytes;
use chacha20poly1305::aead::{Aead, Payload};
use chacha20poly1305::{KeyInit, XChaCha20Poly1305, XNonce};
use harness_core::{Error, Result};

/// Content bytes per segment.
pub const SEGMENT: u64 = 64 * 1024;
/// Bytes an AEAD tag adds to a segment.
pub const TAG: u64 = 16;
/// Bytes of a sealed full segment.
pub const SEALED_SEGMENT: u64 = SEGMENT + TAG;
/// Bytes of the header.
pub const HEADER: u64 = 32;
/// Bytes of the sealed trailer (a SHA-256 and its tag).
pub const TRAILER: u64 = 32 + TAG;
/// The first bytes of every sealed object.
pub const MAGIC: &[u8; 4] = b"hck1";
/// What every segment's associated data starts with.
const DOMAIN: &[u8] = b"harness-checkpoint-v1";

/// A lineage's key, ready to seal and open.
#[derive(Clone)]
pub struct SegmentKey {
    cipher: XChaCha20Poly1305,
    /// First 8 bytes of HMAC-SHA256(key, "key-id"): names the key in every
    /// header, so a wrong key is told apart from damage.
    pub id: [u8; 8],
}

impl std::fmt::Debug for SegmentKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SegmentKey")
            .field("id", &hex::encode(self.id))
            .finish_non_exhaustive()
    }
}

impl SegmentKey {
    /// The key `bytes` (32), named by `id`.
    pub fn new(bytes: &[u8; 32], id: [u8; 8]) -> Self {
        Self {
            cipher: XChaCha20Poly1305::new(bytes.into()),
            id,
        }
    }

    /// A fresh header for one object: magic, this key's id, a random salt.
    pub fn header(&self) -> Result<[u8; HEADER as usize]> {
        let mut out = [0u8; HEADER as usize];
        out[..4].copy_from_slice(MAGIC);
        out[4..12].copy_from_slice(&self.id);
        getrandom::getrandom(&mut out[12..])
            .map_err(|e| Error::backend(format!("no randomness for a checkpoint's salt: {e}")))?;
        Ok(out)
    }

    /// Seal segment `index` of the object under `key` with `header`'s salt.
    pub fn seal(&self, header: &[u8], key: &str, index: u32, last: bool, plain: &[u8]) -> Bytes {
        let nonce = nonce(header, index, last);
        let aad = aad(key);
        let sealed = self
            .cipher
            .encrypt(
                &nonce,
                Payload {
                    msg: plain,
                    aad: &aad,
                },
            )
            .expect("XChaCha20-Poly1305 seals any segment shorter than 256 GiB");
        Bytes::from(sealed)
    }

    /// Open segment `index`; `None` when it does not open (another key,
    /// another position or object, or changed bytes).
    pub fn open(
        &self,
        header: &[u8],
        key: &str,
        index: u32,
        last: bool,
        sealed: &[u8],
    ) -> Option<Vec<u8>> {
        let nonce = nonce(header, index, last);
        let aad = aad(key);
        self.cipher
            .decrypt(
                &nonce,
                Payload {
                    msg: sealed,
                    aad: &aad,
                },
            )
            .ok()
    }

    /// Check an object's header: its magic, and that this key sealed it.
    /// `Corrupt` for a header that is not one; `Unauthorized`, naming both
    /// keys, for an object another key sealed.
    pub fn check_header(&self, key: &str, header: &[u8]) -> Result<()> {
        if header.len() != HEADER as usize || &header[..4] != MAGIC {
            return Err(Error::corrupt(format!(
                "checkpoint {key:?} is not an encrypted checkpoint object (no {:?} header): \
                 written without encryption, or damaged",
                std::str::from_utf8(MAGIC).unwrap_or("hck1")
            )));
        }
        if header[4..12] != self.id {
            return Err(wrong_key(key, &header[4..12], &self.id));
        }
        Ok(())
    }
}

/// The error for an object sealed under another key than this lineage's.
pub fn wrong_key(key: &str, found: &[u8], ours: &[u8]) -> Error {
    Error::new(
        harness_core::ErrorKind::Unauthorized,
        format!(
            "checkpoint {key:?} was encrypted with another key (key id {}; this lineage's is {}): \
             it belongs to another session lineage, or was written under another deployment \
             secret (HARNESS_CHECKPOINT_KEY); nothing was read from it",
            hex::encode(found),
            hex::encode(ours)
        ),
    )
}

fn nonce(header: &[u8], index: u32, last: bool) -> XNonce {
    let mut n = [0u8; 24];
    n[..19].copy_from_slice(&header[12..31]);
    n[19..23].copy_from_slice(&index.to_be_bytes());
    n[23] = u8::from(last);
    n.into()
}

fn aad(key: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(DOMAIN.len() + 4 + key.len());
    out.extend_from_slice(DOMAIN);
    out.extend_from_slice(&(key.len() as u32).to_be_bytes());
    out.extend_from_slice(key.as_bytes());
    out
}

/// Stored bytes of an object of `content` bytes.
pub fn sealed_size(content: u64) -> u64 {
    let full = content / SEGMENT;
    let rest = content % SEGMENT;
    HEADER + full * SEALED_SEGMENT + if rest > 0 { rest + TAG } else { 0 } + TRAILER
}

/// Content bytes of an object stored as `stored` bytes; `Corrupt` when no
/// content has that sealed size (cut short, or extended).
pub fn content_size(key: &str, stored: u64) -> Result<u64> {
    let bad = || {
        Error::corrupt(format!(
            "checkpoint {key:?} has {stored} stored bytes, which no encrypted object has: \
             it was cut short or extended"
        ))
    };
    let data = stored.checked_sub(HEADER + TRAILER).ok_or_else(bad)?;
    let full = data / SEALED_SEGMENT;
    let rest = data % SEALED_SEGMENT;
    match rest {
        0 => Ok(full * SEGMENT),
        r if r > TAG => Ok(full * SEGMENT + r - TAG),
        _ => Err(bad()),
    }
}

/// Segments of data an object of `content` bytes has (the trailer's index).
pub fn data_segments(content: u64) -> u64 {
    content.div_ceil(SEGMENT)
}

/// Where sealed segment `index` starts in the stored object.
pub fn segment_offset(index: u64) -> u64 {
    HEADER + index * SEALED_SEGMENT
}

/// A segment index as sealed into its nonce; `InvalidInput` past 2^32
/// segments (256 TiB), which no checkpoint reaches.
pub fn index32(index: u64) -> Result<u32> {
    u32::try_from(index)
        .map_err(|_| Error::invalid("an encrypted checkpoint object is limited to 256 TiB"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_round_trip_and_impossible_sizes_are_corrupt() {
        for content in [
            0,
            1,
            16,
            17,
            SEGMENT - 1,
            SEGMENT,
            SEGMENT + 1,
            3 * SEGMENT,
            300_017,
        ] {
            let stored = sealed_size(content);
            assert_eq!(content_size("k", stored).unwrap(), content, "{content}");
        }
        // A data remainder of 1..=16 bytes is a tag without content.
        for stored in [
            0,
            HEADER + TRAILER - 1,
            HEADER + TRAILER + 1,
            HEADER + TRAILER + TAG,
        ] {
            assert!(content_size("k", stored).is_err(), "{stored}");
        }
    }

    #[test]
    fn a_segment_opens_only_where_it_was_sealed() {
        let key = SegmentKey::new(&[7; 32], [1; 8]);
        let header = key.header().unwrap();
        let sealed = key.seal(&header, "a/b", 3, false, b"content");
        assert_eq!(
            key.open(&header, "a/b", 3, false, &sealed).unwrap(),
            b"content"
        );
        assert!(key.open(&header, "a/c", 3, false, &sealed).is_none());
        assert!(key.open(&header, "a/b", 4, false, &sealed).is_none());
        assert!(key.open(&header, "a/b", 3, true, &sealed).is_none());
        let other = SegmentKey::new(&[8; 32], [1; 8]);
        assert!(other.open(&header, "a/b", 3, false, &sealed).is_none());
        let fresh = key.header().unwrap();
        assert_ne!(header[12..], fresh[12..], "salts repeat");
        assert!(key.open(&fresh, "a/b", 3, false, &sealed).is_none());
    }
}
