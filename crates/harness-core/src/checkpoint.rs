//! Checkpoint stores: where working trees wait between sandboxes.
//!
//! Objects are written and read as streams and addressed by key. Every store
//! records the SHA-256 of what it stored and verifies it on read, so a
//! truncated or tampered object is reported as [`ErrorKind::Corrupt`]
//! (crate::ErrorKind::Corrupt) instead of being restored.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::maybe::{MaybeSend, MaybeSync};
use crate::stream::ByteStream;
use crate::{Error, Result};

/// What a store knows about an object.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectMeta {
    /// The key.
    pub key: String,
    /// Size in bytes.
    pub size: u64,
    /// Hex SHA-256 of the content.
    pub sha256: String,
}

/// A key-addressed, streamed object store for checkpoints.
#[cfg_attr(not(target_arch = "wasm32"), async_trait)]
#[cfg_attr(target_arch = "wasm32", async_trait(?Send))]
pub trait CheckpointStore: MaybeSend + MaybeSync + std::fmt::Debug {
    /// Store `content` under `key`, replacing any object there. The object
    /// becomes visible only once the whole stream was stored: a failed put
    /// leaves the previous object (or nothing) in place.
    async fn put(&self, key: &str, content: ByteStream) -> Result<ObjectMeta>;

    /// Read an object. `NotFound` if absent. The stream ends with a
    /// `Corrupt` error if the content does not match its recorded hash.
    async fn get(&self, key: &str) -> Result<ByteStream>;

    /// Metadata of one object. `NotFound` if absent.
    async fn head(&self, key: &str) -> Result<ObjectMeta>;

    /// Objects whose key starts with `prefix`, sorted by key.
    async fn list(&self, prefix: &str) -> Result<Vec<ObjectMeta>>;

    /// Remove an object. Removing an absent key is not an error.
    async fn delete(&self, key: &str) -> Result<()>;
}

/// Longest checkpoint key, in bytes.
pub const MAX_KEY_BYTES: usize = 512;

/// Longest segment of a checkpoint key, in bytes: the file-name limit of
/// common file systems, which some object stores (SeaweedFS) share.
pub const MAX_KEY_SEGMENT_BYTES: usize = 255;

/// Validate a checkpoint key: 1–512 bytes of `[A-Za-z0-9._/-]`, no empty,
/// `.` or `..` segment, no segment over 255 bytes, no leading or trailing
/// `/`. Keys map onto object-store paths and file names, so anything that
/// could climb a directory, or that a store could not hold, is refused.
pub fn validate_key(key: &str) -> Result<()> {
    let charset_ok = key
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b'/'));
    let segments_ok = key
        .split('/')
        .all(|s| !s.is_empty() && s.len() <= MAX_KEY_SEGMENT_BYTES && s != "." && s != "..");
    if !key.is_empty() && key.len() <= MAX_KEY_BYTES && charset_ok && segments_ok {
        Ok(())
    } else {
        Err(Error::invalid(format!(
            "invalid checkpoint key {key:?}: use '/'-separated segments of A-Z a-z 0-9 . _ - (no '.', '..' or empty segments, segments of at most 255 bytes, at most 512 bytes in all)"
        )))
    }
}

/// The metadata name object stores record a checkpoint's SHA-256 under:
/// `x-amz-meta-sha256` to an S3 client, custom metadata `sha256` through an
/// R2 binding. Every object store writes and reads it the same way, so a
/// checkpoint written through one restores through the other.
pub const SHA256_METADATA: &str = "sha256";

/// Marks the temporary keys of multipart puts in progress, which are never
/// listed as checkpoints. `~` is outside the key alphabet
/// ([`validate_key`]), so no checkpoint key can contain it.
pub const PARTIAL_MARK: &str = "~partial-";

/// The hash an object store `recorded` for `key` under [`SHA256_METADATA`],
/// lowercased; `Corrupt` when there is none (an object something else
/// wrote: it cannot be verified) or it is not 64 hex digits. `looked_in`
/// names where it was looked for, for the message.
pub fn recorded_sha256(key: &str, recorded: Option<&str>, looked_in: &str) -> Result<String> {
    match recorded {
        Some(s) if s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit()) => {
            Ok(s.to_ascii_lowercase())
        }
        Some(s) => Err(Error::corrupt(format!(
            "checkpoint {key:?} records a malformed sha256 {s:?}"
        ))),
        None => Err(Error::corrupt(format!(
            "checkpoint {key:?} has no recorded sha256 ({looked_in}): it was not written by a checkpoint store and cannot be verified"
        ))),
    }
}

/// The key prefix for a session's checkpoints: `sessions/<id>/`.
pub fn session_prefix(session: &crate::SessionId) -> String {
    format!("sessions/{session}/")
}

/// Wrap a stream so it checks its content against `expected` (hex SHA-256)
/// at the end and fails with `Corrupt` on a mismatch.
pub fn verify_stream(stream: ByteStream, key: String, expected: String) -> ByteStream {
    let state = (stream, Sha256::new(), key, expected, false);
    Box::pin(futures::stream::unfold(
        state,
        |(mut stream, mut hasher, key, expected, done)| async move {
            if done {
                return None;
            }
            match stream.next().await {
                Some(Ok(chunk)) => {
                    hasher.update(&chunk);
                    Some((Ok(chunk), (stream, hasher, key, expected, false)))
                }
                Some(Err(e)) => Some((Err(e), (stream, hasher, key, expected, true))),
                None => {
                    let actual = hex::encode(hasher.clone().finalize());
                    if actual == expected {
                        None
                    } else {
                        let err = Error::corrupt(format!(
                        "checkpoint {key:?} failed verification: content hash {actual} != recorded {expected}"
                    ));
                        Some((Err(err), (stream, hasher, key, expected, true)))
                    }
                }
            }
        },
    ))
}

/// An in-memory store, for tests and single-process use.
#[derive(Debug, Clone, Default)]
pub struct MemoryCheckpointStore {
    objects: Arc<Mutex<BTreeMap<String, (Bytes, ObjectMeta)>>>,
}

impl MemoryCheckpointStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// Replace an object's bytes without updating its recorded hash, to test
    /// that corruption is caught on read.
    pub fn corrupt_for_test(&self, key: &str, bytes: Bytes) {
        if let Some(entry) = self
            .objects
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_mut(key)
        {
            entry.0 = bytes;
        }
    }
}

/// Chunk size used when serving a stored object as a stream.
const MEMORY_CHUNK: usize = 64 * 1024;

#[cfg_attr(not(target_arch = "wasm32"), async_trait)]
#[cfg_attr(target_arch = "wasm32", async_trait(?Send))]
impl CheckpointStore for MemoryCheckpointStore {
    async fn put(&self, key: &str, mut content: ByteStream) -> Result<ObjectMeta> {
        validate_key(key)?;
        let mut buf = BytesMut::new();
        let mut hasher = Sha256::new();
        while let Some(chunk) = content.next().await {
            let chunk = chunk?;
            hasher.update(&chunk);
            buf.extend_from_slice(&chunk);
        }
        let meta = ObjectMeta {
            key: key.to_string(),
            size: buf.len() as u64,
            sha256: hex::encode(hasher.finalize()),
        };
        self.objects
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key.to_string(), (buf.freeze(), meta.clone()));
        Ok(meta)
    }

    async fn get(&self, key: &str) -> Result<ByteStream> {
        validate_key(key)?;
        let (bytes, meta) = self
            .objects
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(key)
            .cloned()
            .ok_or_else(|| Error::not_found(format!("no checkpoint under key {key:?}")))?;
        let chunks: Vec<Result<Bytes>> = (0..bytes.len())
            .step_by(MEMORY_CHUNK)
            .map(|i| Ok(bytes.slice(i..(i + MEMORY_CHUNK).min(bytes.len()))))
            .collect();
        Ok(verify_stream(
            Box::pin(futures::stream::iter(chunks)),
            meta.key,
            meta.sha256,
        ))
    }

    async fn head(&self, key: &str) -> Result<ObjectMeta> {
        validate_key(key)?;
        self.objects
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(key)
            .map(|(_, m)| m.clone())
            .ok_or_else(|| Error::not_found(format!("no checkpoint under key {key:?}")))
    }

    async fn list(&self, prefix: &str) -> Result<Vec<ObjectMeta>> {
        Ok(self
            .objects
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .range(prefix.to_string()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(_, (_, m))| m.clone())
            .collect())
    }

    async fn delete(&self, key: &str) -> Result<()> {
        validate_key(key)?;
        self.objects
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(key);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_recorded_hash_must_be_64_hex_digits() {
        let upper = "AB".repeat(32);
        assert_eq!(
            recorded_sha256("k", Some(&upper), "here").unwrap(),
            "ab".repeat(32)
        );
        for bad in ["", "abc", &"g".repeat(64), &"a".repeat(65)] {
            let e = recorded_sha256("k", Some(bad), "here").unwrap_err();
            assert_eq!(e.kind(), crate::ErrorKind::Corrupt, "{bad:?}");
            assert!(e.message().contains("malformed sha256"), "{e}");
        }
        let e = recorded_sha256("k", None, "custom metadata sha256").unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::Corrupt);
        assert!(e.message().contains("(custom metadata sha256)"), "{e}");
    }

    #[test]
    fn keys_that_could_climb_are_refused() {
        for bad in [
            "",
            "/abs",
            "a//b",
            "a/../b",
            "..",
            "a/.",
            "trailing/",
            "sp ace",
            "a\\b",
        ] {
            assert!(validate_key(bad).is_err(), "{bad:?} must be refused");
        }
        for good in ["a", "sessions/s1/turn-3.tar.zst", "x.y_z-1/2"] {
            validate_key(good).unwrap();
        }
        validate_key(&"s".repeat(MAX_KEY_SEGMENT_BYTES)).unwrap();
        assert!(validate_key(&"s".repeat(MAX_KEY_SEGMENT_BYTES + 1)).is_err());
        let exact = format!("{}/{}/c", "a".repeat(254), "b".repeat(255));
        assert_eq!(exact.len(), MAX_KEY_BYTES);
        validate_key(&exact).unwrap();
        assert!(validate_key(&format!("{exact}b")).is_err());
    }
}
