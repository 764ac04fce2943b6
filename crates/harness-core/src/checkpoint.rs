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

    /// The keys [`list`](Self::list) names, without their metadata: what
    /// a caller that only asks "which objects are there" needs, and, on a
    /// store whose listing carries no hashes (S3 gives them a request per
    /// object), a page request per thousand keys instead. The default
    /// asks `list`.
    async fn list_keys(&self, prefix: &str) -> Result<Vec<String>> {
        Ok(self
            .list(prefix)
            .await?
            .into_iter()
            .map(|m| m.key)
            .collect())
    }

    /// Remove an object. Removing an absent key is not an error.
    async fn delete(&self, key: &str) -> Result<()>;

    /// Bytes `range` of an object's content, which must lie within it
    /// (`InvalidInput` otherwise; `NotFound` if the object is absent). The
    /// object's recorded hash covers the whole content, so a range is **not
    /// verified**: the caller checks what it reads (a tree checkpoint hashes
    /// every chunk it reads out of a pack). The default reads the object
    /// from the start and keeps the range; a store that can ask for the
    /// range alone (S3's `Range` header) overrides it.
    async fn get_range(&self, key: &str, range: std::ops::Range<u64>) -> Result<Bytes> {
        check_range(key, &range)?;
        let mut body = self.get(key).await?;
        let mut at = 0u64;
        let mut out = BytesMut::with_capacity((range.end - range.start) as usize);
        while at < range.end {
            let Some(chunk) = body.next().await else {
                break;
            };
            let chunk = chunk?;
            let end = at + chunk.len() as u64;
            if end > range.start {
                let from = range.start.saturating_sub(at) as usize;
                let to = (range.end.min(end) - at) as usize;
                out.extend_from_slice(&chunk[from..to]);
            }
            at = end;
        }
        if (out.len() as u64) < range.end - range.start {
            return Err(range_past_end(key, &range, at));
        }
        Ok(out.freeze())
    }
}

/// A range a store can be asked for: not reversed. (An empty range is
/// allowed and answers no bytes.)
pub fn check_range(key: &str, range: &std::ops::Range<u64>) -> Result<()> {
    validate_key(key)?;
    if range.start > range.end {
        return Err(Error::invalid(format!(
            "range {}..{} of {key:?} is reversed",
            range.start, range.end
        )));
    }
    Ok(())
}

/// The error for a range that ends past an object of `size` bytes.
pub fn range_past_end(key: &str, range: &std::ops::Range<u64>, size: u64) -> Error {
    Error::invalid(format!(
        "range {}..{} is past the end of {key:?} ({size} bytes)",
        range.start, range.end
    ))
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

/// The content's size in an object of `stored` bytes that ends with its
/// hash trailer; `Corrupt` if it is too short to hold one.
pub fn trailer_content_size(key: &str, stored: u64) -> Result<u64> {
    stored
        .checked_sub(SHA256_TRAILER_LEN as u64)
        .ok_or_else(|| {
            Error::corrupt(format!(
                "checkpoint {key:?} is shorter ({stored} bytes) than its hash trailer"
            ))
        })
}

/// The metadata name marking an object whose SHA-256 is stored in its own
/// last [`SHA256_TRAILER_LEN`] bytes instead of under [`SHA256_METADATA`],
/// with the value [`SHA256_TRAILER_FORMAT`].
///
/// S3 takes an object's metadata when a multipart upload starts, before
/// any byte, and so before the hash, is known. The hash goes at the end of
/// the upload instead, and the object appears at its key in one step, with
/// its bytes and hash together, without a copy. See `docs/checkpoint-r2.md`.
pub const SHA256_TRAILER_METADATA: &str = "sha256-trailer";

/// The value of [`SHA256_TRAILER_METADATA`]: the trailer is a zstd
/// skippable frame (magic `0x184D2A5E`, length 32, the 32-byte digest), so
/// a zstd checkpoint read straight from the bucket still decompresses with
/// the `zstd` CLI.
pub const SHA256_TRAILER_FORMAT: &str = "zstd-skippable-frame";

/// Bytes of the trailer: the frame's magic and length, then the digest.
pub const SHA256_TRAILER_LEN: usize = 40;

/// One of the zstd skippable-frame magics (`0x184D2A50..=0x184D2A5F`).
const TRAILER_MAGIC: u32 = 0x184D_2A5E;

/// The trailer that records `digest` (see [`SHA256_TRAILER_METADATA`]).
pub fn sha256_trailer(digest: &[u8; 32]) -> [u8; SHA256_TRAILER_LEN] {
    let mut out = [0u8; SHA256_TRAILER_LEN];
    out[..4].copy_from_slice(&TRAILER_MAGIC.to_le_bytes());
    out[4..8].copy_from_slice(&32u32.to_le_bytes());
    out[8..].copy_from_slice(digest);
    out
}

/// The hex SHA-256 a trailer records; `Corrupt` if `trailer` is not one.
pub fn parse_sha256_trailer(key: &str, trailer: &[u8]) -> Result<String> {
    let mut expected = [0u8; 8];
    expected[..4].copy_from_slice(&TRAILER_MAGIC.to_le_bytes());
    expected[4..].copy_from_slice(&32u32.to_le_bytes());
    if trailer.len() != SHA256_TRAILER_LEN || trailer[..8] != expected {
        return Err(Error::corrupt(format!(
            "checkpoint {key:?} is marked {SHA256_TRAILER_METADATA}={SHA256_TRAILER_FORMAT} but does not end with one ({} bytes read)",
            trailer.len()
        )));
    }
    Ok(hex::encode(&trailer[8..]))
}

/// How an object records its hash: the two layouts every object store
/// reads ([`SHA256_METADATA`], [`SHA256_TRAILER_METADATA`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecordedHash {
    /// The hex SHA-256, from the object's metadata.
    Metadata(String),
    /// In the object's last [`SHA256_TRAILER_LEN`] bytes.
    Trailer,
}

impl RecordedHash {
    /// `stream`, the object's bytes as stored, as its content checked
    /// against this hash: [`verify_stream`] or [`verify_trailer_stream`].
    pub fn verify(self, stream: ByteStream, key: String) -> ByteStream {
        match self {
            Self::Metadata(sha) => verify_stream(stream, key, sha),
            Self::Trailer => verify_trailer_stream(stream, key),
        }
    }

    /// The metadata of the object under `key` of `stored` bytes, given its
    /// last bytes (`tail`, at least a trailer's; unused when the hash is in
    /// metadata): the content's size and hash; `Corrupt` if a trailer
    /// object cannot hold or does not end with one.
    pub fn object_meta(self, key: &str, stored: u64, tail: &[u8]) -> Result<ObjectMeta> {
        let (size, sha256) = match self {
            Self::Metadata(sha) => (stored, sha),
            Self::Trailer => {
                let size = trailer_content_size(key, stored)?;
                let from = tail.len().saturating_sub(SHA256_TRAILER_LEN);
                (size, parse_sha256_trailer(key, &tail[from..])?)
            }
        };
        Ok(ObjectMeta {
            key: key.to_string(),
            size,
            sha256,
        })
    }
}

/// A put's content cut into parts of one size, hashed as it goes: what a
/// store that uploads in parts (S3 multipart, R2's binding) cuts its stream
/// with. One part is in memory at a time, plus the chunk read ahead.
pub struct PartCutter {
    stream: ByteStream,
    part_size: usize,
    /// Read from the stream, not yet in a part.
    leftover: Bytes,
    /// The stream has ended.
    ended: bool,
    hasher: Sha256,
}

impl std::fmt::Debug for PartCutter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PartCutter")
            .field("part_size", &self.part_size)
            .field("ended", &self.ended)
            .finish_non_exhaustive()
    }
}

impl PartCutter {
    /// Cut `stream` into parts of `part_size` bytes.
    pub fn new(stream: ByteStream, part_size: usize) -> Self {
        Self {
            stream,
            part_size,
            leftover: Bytes::new(),
            ended: false,
            hasher: Sha256::new(),
        }
    }

    /// Nothing is left: the part returned last was the last.
    pub fn done(&self) -> bool {
        self.ended && self.leftover.is_empty()
    }

    /// The next part: `part_size` bytes, fewer only at the end. It looks
    /// one chunk ahead, so [`PartCutter::done`] is exact after every call
    /// (a stream of exactly one part is known to be one). A failed stream
    /// fails here.
    pub async fn next_part(&mut self) -> Result<Bytes> {
        let mut buf = BytesMut::with_capacity(self.part_size);
        loop {
            if !self.leftover.is_empty() {
                let take = self.leftover.len().min(self.part_size - buf.len());
                let piece = self.leftover.split_to(take);
                self.hasher.update(&piece);
                buf.extend_from_slice(&piece);
            }
            if buf.len() == self.part_size {
                self.read_nonempty().await?;
                return Ok(buf.freeze());
            }
            self.read_nonempty().await?;
            if self.done() {
                return Ok(buf.freeze());
            }
        }
    }

    /// The SHA-256 of every byte cut so far (the content's, once done).
    pub fn digest(&self) -> [u8; 32] {
        self.hasher.clone().finalize().into()
    }

    /// `part`, the content's last, followed by the trailer that records
    /// the content's hash; and that hash, hex. For a trailer object.
    pub fn last_with_trailer(&self, part: &[u8]) -> (Bytes, String) {
        let digest = self.digest();
        let mut out = BytesMut::with_capacity(part.len() + SHA256_TRAILER_LEN);
        out.extend_from_slice(part);
        out.extend_from_slice(&sha256_trailer(&digest));
        (out.freeze(), hex::encode(digest))
    }

    /// Make `leftover` non-empty, or mark the stream ended.
    async fn read_nonempty(&mut self) -> Result<()> {
        while self.leftover.is_empty() && !self.ended {
            match self.stream.next().await {
                Some(chunk) => self.leftover = chunk?,
                None => self.ended = true,
            }
        }
        Ok(())
    }
}

/// How the object under `key` records its hash, given a lookup of its
/// metadata; `Corrupt` as [`recorded_sha256`] when it records none.
pub fn recorded_hash<'m>(
    key: &str,
    metadata: impl Fn(&str) -> Option<&'m str>,
    looked_in: &str,
) -> Result<RecordedHash> {
    match (metadata(SHA256_METADATA), metadata(SHA256_TRAILER_METADATA)) {
        (None, Some(SHA256_TRAILER_FORMAT)) => Ok(RecordedHash::Trailer),
        (None, Some(other)) => Err(Error::corrupt(format!(
            "checkpoint {key:?} records its hash as {SHA256_TRAILER_METADATA}={other:?}, a layout this version does not know"
        ))),
        (recorded, _) => recorded_sha256(key, recorded, looked_in).map(RecordedHash::Metadata),
    }
}

/// Wrap the stream of an object that ends with its hash trailer: yields
/// the content without the trailer and, at the end, checks the content
/// against the trailer's hash, failing with `Corrupt` on a mismatch or a
/// missing trailer. One chunk is held back until the next arrives (the
/// last [`SHA256_TRAILER_LEN`] bytes are not content); nothing is copied
/// but the few bytes of chunks smaller than the trailer.
pub fn verify_trailer_stream(stream: ByteStream, key: String) -> ByteStream {
    struct State {
        stream: ByteStream,
        hasher: Sha256,
        key: String,
        /// Read, not yet yielded: holds the trailer once the stream ends.
        held: Bytes,
        done: bool,
    }
    let state = State {
        stream,
        hasher: Sha256::new(),
        key,
        held: Bytes::new(),
        done: false,
    };
    Box::pin(futures::stream::unfold(state, |mut s| async move {
        if s.done {
            return None;
        }
        loop {
            match s.stream.next().await {
                Some(Ok(chunk)) if chunk.len() >= SHA256_TRAILER_LEN => {
                    // The new chunk alone covers the trailer: all that was
                    // held is content.
                    let out = std::mem::replace(&mut s.held, chunk);
                    if !out.is_empty() {
                        s.hasher.update(&out);
                        return Some((Ok(out), s));
                    }
                }
                Some(Ok(chunk)) => {
                    let total = s.held.len() + chunk.len();
                    let keep_from = total.saturating_sub(SHA256_TRAILER_LEN).min(s.held.len());
                    let out = s.held.slice(..keep_from);
                    let mut kept = BytesMut::with_capacity(total - keep_from);
                    kept.extend_from_slice(&s.held[keep_from..]);
                    kept.extend_from_slice(&chunk);
                    s.held = kept.freeze();
                    if !out.is_empty() {
                        s.hasher.update(&out);
                        return Some((Ok(out), s));
                    }
                }
                Some(Err(e)) => {
                    s.done = true;
                    return Some((Err(e), s));
                }
                None => {
                    s.done = true;
                    if s.held.len() < SHA256_TRAILER_LEN {
                        let err = parse_sha256_trailer(&s.key, &s.held).unwrap_err();
                        return Some((Err(err), s));
                    }
                    let split = s.held.len() - SHA256_TRAILER_LEN;
                    let content = s.held.slice(..split);
                    let expected = match parse_sha256_trailer(&s.key, &s.held[split..]) {
                        Ok(e) => e,
                        Err(e) => return Some((Err(e), s)),
                    };
                    s.hasher.update(&content);
                    let actual = hex::encode(s.hasher.clone().finalize());
                    if actual != expected {
                        let err = Error::corrupt(format!(
                            "checkpoint {:?} failed verification: content hash {actual} != recorded {expected}",
                            s.key
                        ));
                        return Some((Err(err), s));
                    }
                    if content.is_empty() {
                        return None;
                    }
                    return Some((Ok(content), s));
                }
            }
        }
    }))
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

    async fn get_range(&self, key: &str, range: std::ops::Range<u64>) -> Result<Bytes> {
        check_range(key, &range)?;
        let bytes = self
            .objects
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(key)
            .map(|(bytes, _)| bytes.clone())
            .ok_or_else(|| Error::not_found(format!("no checkpoint under key {key:?}")))?;
        if range.end > bytes.len() as u64 {
            return Err(range_past_end(key, &range, bytes.len() as u64));
        }
        Ok(bytes.slice(range.start as usize..range.end as usize))
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

    /// `content` with its trailer, cut into chunks of the given sizes
    /// (the rest in one), read back through [`verify_trailer_stream`].
    fn read_with_trailer(content: &[u8], cuts: &[usize], trailer: &[u8]) -> Result<Vec<u8>> {
        let mut all = content.to_vec();
        all.extend_from_slice(trailer);
        let mut chunks = Vec::new();
        let mut at = 0;
        for &n in cuts {
            let end = (at + n).min(all.len());
            chunks.push(Ok(Bytes::copy_from_slice(&all[at..end])));
            at = end;
        }
        chunks.push(Ok(Bytes::copy_from_slice(&all[at..])));
        let mut stream = verify_trailer_stream(Box::pin(futures::stream::iter(chunks)), "k".into());
        futures::executor::block_on(async {
            let mut out = Vec::new();
            while let Some(chunk) = stream.next().await {
                let chunk = chunk?;
                assert!(!chunk.is_empty(), "no empty chunks");
                out.extend_from_slice(&chunk);
            }
            Ok(out)
        })
    }

    #[test]
    fn a_trailer_is_stripped_and_checked_however_the_stream_is_cut() {
        let content: Vec<u8> = (0..1000u32).map(|i| (i * 7 % 251) as u8).collect();
        let digest: [u8; 32] = Sha256::digest(&content).into();
        let trailer = sha256_trailer(&digest);
        // It is a zstd skippable frame: magic 0x184D2A5E, length 32.
        assert_eq!(&trailer[..8], &[0x5E, 0x2A, 0x4D, 0x18, 32, 0, 0, 0]);
        assert_eq!(
            parse_sha256_trailer("k", &trailer).unwrap(),
            hex::encode(digest)
        );
        let cuts: &[&[usize]] = &[
            &[],
            &[1],
            &[999],
            &[1000],
            &[1001],
            &[1039],
            &[500, 1, 1, 1, 1, 1],
            &[10; 104],
            &[39, 40, 41],
            &[3; 346],
        ];
        for cut in cuts {
            assert_eq!(
                read_with_trailer(&content, cut, &trailer).unwrap(),
                content,
                "cut {cut:?}"
            );
        }
        // Empty content: just the trailer.
        let empty: [u8; 32] = Sha256::digest(b"").into();
        assert!(read_with_trailer(b"", &[5], &sha256_trailer(&empty))
            .unwrap()
            .is_empty());
    }

    #[test]
    fn a_wrong_or_missing_trailer_is_corrupt() {
        let content = b"the content of a checkpoint".repeat(10);
        let digest: [u8; 32] = Sha256::digest(&content).into();
        let good = sha256_trailer(&digest);
        // One content byte changed.
        let mut changed = content.clone();
        changed[5] ^= 1;
        let e = read_with_trailer(&changed, &[100], &good).unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::Corrupt);
        assert!(e.message().contains("failed verification"), "{e}");
        // Truncated: the last bytes are content, not a trailer.
        let e = read_with_trailer(&content, &[7], &good[..20]).unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::Corrupt);
        assert!(e.message().contains("does not end with one"), "{e}");
        // Shorter than a trailer.
        let e = read_with_trailer(b"short", &[], b"").unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::Corrupt);
    }

    #[test]
    fn the_hash_is_looked_for_in_metadata_then_as_a_trailer() {
        let recorded = |pairs: &[(&str, &str)]| {
            let map: std::collections::HashMap<String, String> = pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            recorded_hash("k", |name| map.get(name).map(String::as_str), "here")
        };
        let sha = "ab".repeat(32);
        assert_eq!(
            recorded(&[(SHA256_METADATA, &sha)]).unwrap(),
            RecordedHash::Metadata(sha.clone())
        );
        assert_eq!(
            recorded(&[(SHA256_TRAILER_METADATA, SHA256_TRAILER_FORMAT)]).unwrap(),
            RecordedHash::Trailer
        );
        let e = recorded(&[(SHA256_TRAILER_METADATA, "v9")]).unwrap_err();
        assert!(e.message().contains("does not know"), "{e}");
        let e = recorded(&[]).unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::Corrupt);
    }

    /// Parts are full but the last, `done` is exact (a stream of exactly
    /// one part is one part), and the hash covers every byte.
    #[test]
    fn parts_are_cut_to_size_and_hashed() {
        let content: Vec<u8> = (0..2500u32).map(|i| (i % 251) as u8).collect();
        for (total, sizes) in [
            (1000, vec![1000]),
            (2500, vec![1000, 1000, 500]),
            (0, vec![0]),
        ] {
            let chunks: Vec<Result<Bytes>> = content[..total]
                .chunks(333)
                .map(|c| Ok(Bytes::copy_from_slice(c)))
                .collect();
            let mut cutter = PartCutter::new(Box::pin(futures::stream::iter(chunks)), 1000);
            let mut got = Vec::new();
            futures::executor::block_on(async {
                loop {
                    got.push(cutter.next_part().await.unwrap().len());
                    if cutter.done() {
                        break;
                    }
                }
            });
            assert_eq!(got, sizes, "{total} bytes");
            let digest: [u8; 32] = Sha256::digest(&content[..total]).into();
            assert_eq!(cutter.digest(), digest);
            let (last, sha) = cutter.last_with_trailer(b"end");
            assert_eq!(sha, hex::encode(digest));
            assert_eq!(&last[..3], b"end");
            assert_eq!(parse_sha256_trailer("k", &last[3..]).unwrap(), sha);
        }
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
