//! [`EncryptedStore`]: a [`CheckpointStore`] whose objects are sealed
//! before they reach the store it wraps.

use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use futures::StreamExt;
use harness_core::checkpoint::{
    check_range, validate_key, CheckpointStore, ObjectMeta, PartCutter,
};
use harness_core::stream::ByteStream;
use harness_core::{Error, Result};
use sha2::{Digest, Sha256};

use crate::format::{
    content_size, data_segments, index32, segment_offset, SegmentKey, HEADER, SEALED_SEGMENT,
    SEGMENT, TAG, TRAILER,
};

/// Requests in flight when a listing reads its objects' trailers.
const LIST_CONCURRENCY: usize = 16;

/// Reads of an object that is being replaced, before giving up.
const RACE_RETRIES: usize = 8;

/// Every object of `inner` sealed under one key (a lineage's): the store
/// `inner` holds only ciphertext, and content comes back only when this
/// key opens it. See the crate's docs for the layout.
///
/// Sizes and hashes this store reports are the content's, as on a plain
/// store: `put`, `head` and `list` answer the content's length and its
/// SHA-256 (read from the object's sealed trailer: a `head` is a `HEAD`
/// and a ranged `GET` of the last 48 bytes). A ranged read fetches and
/// opens the 64 KiB segments around the range, so, unlike a plain store's,
/// it is verified.
#[derive(Clone)]
pub struct EncryptedStore {
    inner: Arc<dyn CheckpointStore>,
    key: SegmentKey,
}

impl std::fmt::Debug for EncryptedStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EncryptedStore")
            .field("inner", &self.inner)
            .field("key", &self.key)
            .finish()
    }
}

impl EncryptedStore {
    /// `inner`, sealed under `key`.
    pub fn new(inner: Arc<dyn CheckpointStore>, key: SegmentKey) -> Self {
        Self { inner, key }
    }

    /// The store holding the ciphertext.
    pub fn inner(&self) -> &Arc<dyn CheckpointStore> {
        &self.inner
    }

    /// `read` of the object under `key` as the inner store holds it now
    /// (its metadata first). A read that takes several requests (a `HEAD`,
    /// then ranges) can see two versions of an object replaced meanwhile:
    /// a failure is retried while the object's stored hash keeps changing,
    /// and returned once it holds still (then it is the object's own).
    async fn consistent<'a, T, F, Fut>(&'a self, key: &'a str, read: F) -> Result<T>
    where
        F: Fn(ObjectMeta) -> Fut,
        Fut: std::future::Future<Output = Result<T>> + 'a,
    {
        let mut stored = self.inner.head(key).await?;
        for _ in 0..RACE_RETRIES {
            match read(stored.clone()).await {
                Ok(v) => return Ok(v),
                Err(e) => {
                    let now = self.inner.head(key).await?;
                    if now == stored {
                        return Err(e);
                    }
                    stored = now;
                }
            }
        }
        read(stored).await
    }

    /// The content's metadata of an object the inner store holds as
    /// `stored`: its size from the stored size, its hash from the trailer.
    async fn content_meta(&self, stored: ObjectMeta) -> Result<ObjectMeta> {
        let key = stored.key;
        let size = content_size(&key, stored.size)?;
        let header = self.inner.get_range(&key, 0..HEADER).await?;
        self.key.check_header(&key, &header)?;
        let trailer = self
            .inner
            .get_range(&key, stored.size - TRAILER..stored.size)
            .await?;
        let index = index32(data_segments(size))?;
        let Some(digest) = self.key.open(&header, &key, index, true, &trailer) else {
            return Err(damaged(&key, "its trailer"));
        };
        Ok(ObjectMeta {
            key,
            size,
            sha256: hex::encode(digest),
        })
    }
}

fn damaged(key: &str, what: &str) -> Error {
    Error::corrupt(format!(
        "checkpoint {key:?} failed its authentication at {what}: the stored bytes were changed, \
         moved from another object or cut"
    ))
}

#[cfg_attr(not(target_arch = "wasm32"), async_trait)]
#[cfg_attr(target_arch = "wasm32", async_trait(?Send))]
impl CheckpointStore for EncryptedStore {
    async fn put(&self, key: &str, content: ByteStream) -> Result<ObjectMeta> {
        validate_key(key)?;
        let header = self.key.header()?;
        let seal_key = self.key.clone();
        let name = key.to_string();
        // What the sealing stream saw, for the answer: the content's size
        // and hash (the inner store answers the ciphertext's).
        let seen: Arc<Mutex<Option<(u64, [u8; 32])>>> = Arc::default();
        struct Sealing {
            cutter: PartCutter,
            header: [u8; HEADER as usize],
            key: SegmentKey,
            name: String,
            index: u64,
            size: u64,
            stage: Stage,
            seen: Arc<Mutex<Option<(u64, [u8; 32])>>>,
        }
        #[derive(PartialEq)]
        enum Stage {
            Header,
            Data,
            Done,
        }
        let state = Sealing {
            cutter: PartCutter::new(content, SEGMENT as usize),
            header,
            key: seal_key,
            name,
            index: 0,
            size: 0,
            stage: Stage::Header,
            seen: seen.clone(),
        };
        let sealed: ByteStream = Box::pin(futures::stream::unfold(state, |mut s| async move {
            match s.stage {
                Stage::Header => {
                    s.stage = Stage::Data;
                    let header = Bytes::copy_from_slice(&s.header);
                    Some((Ok(header), s))
                }
                Stage::Data => {
                    if s.cutter.done() {
                        // The trailer: the content's hash, sealed as last.
                        s.stage = Stage::Done;
                        let digest = s.cutter.digest();
                        let index = match index32(s.index) {
                            Ok(i) => i,
                            Err(e) => return Some((Err(e), s)),
                        };
                        *s.seen.lock().expect("seen lock") = Some((s.size, digest));
                        let trailer = s.key.seal(&s.header, &s.name, index, true, &digest);
                        return Some((Ok(trailer), s));
                    }
                    let part = match s.cutter.next_part().await {
                        Ok(p) => p,
                        Err(e) => {
                            s.stage = Stage::Done;
                            return Some((Err(e), s));
                        }
                    };
                    if part.is_empty() {
                        // An empty stream: no data segment, only the trailer.
                        return Some((Ok(Bytes::new()), s));
                    }
                    let index = match index32(s.index) {
                        Ok(i) => i,
                        Err(e) => {
                            s.stage = Stage::Done;
                            return Some((Err(e), s));
                        }
                    };
                    s.index += 1;
                    s.size += part.len() as u64;
                    let out = s.key.seal(&s.header, &s.name, index, false, &part);
                    Some((Ok(out), s))
                }
                Stage::Done => None,
            }
        }));
        self.inner.put(key, sealed).await?;
        let (size, digest) = seen
            .lock()
            .expect("seen lock")
            .take()
            .ok_or_else(|| Error::backend(format!("the store took {key:?} before its end")))?;
        Ok(ObjectMeta {
            key: key.to_string(),
            size,
            sha256: hex::encode(digest),
        })
    }

    async fn get(&self, key: &str) -> Result<ByteStream> {
        let stream = self.inner.get(key).await?;
        Ok(opening(stream, key.to_string(), self.clone()))
    }

    async fn head(&self, key: &str) -> Result<ObjectMeta> {
        self.consistent(key, |stored| self.content_meta(stored))
            .await
    }

    async fn list(&self, prefix: &str) -> Result<Vec<ObjectMeta>> {
        let stored = self.inner.list(prefix).await?;
        let metas: Vec<Result<Option<ObjectMeta>>> = futures::stream::iter(stored)
            .map(|m| async move {
                match self.content_meta(m.clone()).await {
                    Ok(meta) => Ok(Some(meta)),
                    // Replaced or deleted since the listing: as it is now.
                    Err(_) => match self.head(&m.key).await {
                        Ok(meta) => Ok(Some(meta)),
                        Err(e) if e.kind() == harness_core::ErrorKind::NotFound => Ok(None),
                        Err(e) => Err(e),
                    },
                }
            })
            .buffered(LIST_CONCURRENCY)
            .collect()
            .await;
        metas.into_iter().filter_map(Result::transpose).collect()
    }

    async fn list_keys(&self, prefix: &str) -> Result<Vec<String>> {
        self.inner.list_keys(prefix).await
    }

    async fn delete(&self, key: &str) -> Result<()> {
        self.inner.delete(key).await
    }

    async fn get_range(&self, key: &str, range: std::ops::Range<u64>) -> Result<Bytes> {
        check_range(key, &range)?;
        self.consistent(key, |stored| self.range_of(stored, range.clone()))
            .await
    }
}

impl EncryptedStore {
    /// Bytes `range` of the content of the object stored as `stored`.
    async fn range_of(&self, stored: ObjectMeta, range: std::ops::Range<u64>) -> Result<Bytes> {
        let key = stored.key.as_str();
        let size = content_size(key, stored.size)?;
        if range.end > size {
            return Err(harness_core::checkpoint::range_past_end(key, &range, size));
        }
        if range.is_empty() {
            return Ok(Bytes::new());
        }
        let first = range.start / SEGMENT;
        let last = (range.end - 1) / SEGMENT;
        let from = segment_offset(first);
        let to = (segment_offset(last) + SEALED_SEGMENT).min(stored.size - TRAILER);
        let (header, sealed) = futures::try_join!(
            self.inner.get_range(key, 0..HEADER),
            self.inner.get_range(key, from..to)
        )?;
        self.key.check_header(key, &header)?;
        let mut out = BytesMut::with_capacity((range.end - range.start) as usize);
        for (n, segment) in sealed.chunks(SEALED_SEGMENT as usize).enumerate() {
            let index = first + n as u64;
            let Some(plain) = self.key.open(&header, key, index32(index)?, false, segment) else {
                return Err(damaged(key, &format!("segment {index}")));
            };
            let at = index * SEGMENT;
            let lo = range.start.saturating_sub(at) as usize;
            let hi = ((range.end - at) as usize).min(plain.len());
            out.extend_from_slice(&plain[lo..hi]);
        }
        Ok(out.freeze())
    }
}

/// The stored stream of `key`, opened: yields the content segment by
/// segment and ends with an error unless the trailer opens and names the
/// content's hash.
fn opening(stream: ByteStream, key: String, store: EncryptedStore) -> ByteStream {
    let state = Opening {
        stream,
        key,
        store,
        buf: BytesMut::new(),
        header: None,
        index: 0,
        hasher: Sha256::new(),
        ended: false,
        finished: false,
    };
    Box::pin(futures::stream::unfold(state, |mut s| async move {
        if s.finished {
            return None;
        }
        match s.next().await {
            Ok(Some(out)) => Some((Ok(out), s)),
            Ok(None) => None,
            Err(e) => {
                s.finished = true;
                Some((Err(e), s))
            }
        }
    }))
}

struct Opening {
    stream: ByteStream,
    key: String,
    store: EncryptedStore,
    /// Read, not yet opened.
    buf: BytesMut,
    header: Option<Bytes>,
    /// The next data segment's index.
    index: u64,
    hasher: Sha256,
    /// The stored stream has ended.
    ended: bool,
    /// The trailer was checked, or an error was yielded.
    finished: bool,
}

impl Opening {
    /// The next piece of content, `None` at the verified end.
    async fn next(&mut self) -> Result<Option<Bytes>> {
        let key = self.key.clone();
        let key = key.as_str();
        if self.header.is_none() {
            self.fill(HEADER).await?;
            if (self.buf.len() as u64) < HEADER {
                return Err(Error::corrupt(format!(
                    "checkpoint {key:?} is shorter ({} bytes) than an encrypted object's header",
                    self.buf.len()
                )));
            }
            let header = self.buf.split_to(HEADER as usize).freeze();
            self.store.key.check_header(key, &header)?;
            self.header = Some(header);
        }
        // A full segment is known to be data, not the object's end, once
        // a trailer's worth of bytes follows it.
        self.fill(SEALED_SEGMENT + TRAILER).await?;
        let len = self.buf.len() as u64;
        let data = if len >= SEALED_SEGMENT + TRAILER {
            SEALED_SEGMENT
        } else if len == TRAILER {
            0
        } else if len > TRAILER + TAG {
            len - TRAILER
        } else {
            return Err(Error::corrupt(format!(
                "checkpoint {key:?} ends with {len} bytes that are no segment and trailer: \
                 it was cut short or extended"
            )));
        };
        let header = self.header.clone().expect("read above");
        if data > 0 {
            let segment = self.buf.split_to(data as usize);
            let index = self.index;
            let Some(plain) = self
                .store
                .key
                .open(&header, key, index32(index)?, false, &segment)
            else {
                return Err(damaged(key, &format!("segment {index}")));
            };
            self.index += 1;
            self.hasher.update(&plain);
            return Ok(Some(Bytes::from(plain)));
        }
        let trailer = self.buf.split_to(TRAILER as usize);
        let Some(recorded) =
            self.store
                .key
                .open(&header, key, index32(self.index)?, true, &trailer)
        else {
            return Err(damaged(key, "its trailer"));
        };
        if recorded[..] != self.hasher.clone().finalize()[..] {
            return Err(Error::corrupt(format!(
                "checkpoint {key:?} does not match the hash its trailer records"
            )));
        }
        self.finished = true;
        Ok(None)
    }

    /// Read until `want` bytes are buffered or the stored stream ends.
    async fn fill(&mut self, want: u64) -> Result<()> {
        while !self.ended && (self.buf.len() as u64) < want {
            match self.stream.next().await {
                Some(chunk) => self.buf.extend_from_slice(&chunk?),
                None => self.ended = true,
            }
        }
        Ok(())
    }
}
