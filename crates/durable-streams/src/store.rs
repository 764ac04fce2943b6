//! Generic Durable Streams: [`Streams`], the protocol's state machine over
//! every stream of one server.
//!
//! Runtime-free: no locks, no clock of its own (time comes from the
//! [`Clock`] it is given), no I/O. Every stream is held in memory (the map
//! is what reads are served from); a host that persists hands each
//! operation's [`Changes`] to its SQLite before it answers the request:
//! `rusqlite` in [`crate::native::StreamStore`], the Durable Object's SQLite
//! in the Worker. Both use the same tables ([`SCHEMA`]), so a store written by
//! one loads in the other. Loading ([`Streams::load`]) restarts sliding TTLs
//! (the last access instant is not persisted).
//!
//! Session logs are not stored here: servers expose them as read-only
//! streams straight from their session logs.
//!
//! Every operation takes `&mut self`, so validation of a producer tuple, the
//! `Stream-Seq` check, the append and the close of a request happen
//! atomically with respect to every other request; waking waiters
//! (long-poll, SSE) is the host's job, after each request that writes.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use bytes::Bytes;
use harness_core::clock::Clock;
use serde::{Deserialize, Serialize};

/// Bytes a stored message adds to the offset besides its data: the
/// reference server's framing (4-byte length prefix + newline). Keeping the
/// same arithmetic makes our offsets look like the reference's.
const FRAME_OVERHEAD: u64 = 5;

/// Producer state older than this is forgotten (as in the reference server).
const PRODUCER_STATE_TTL_MS: u64 = 7 * 24 * 3600 * 1000;

/// A position in a stream: `<read seq>_<byte offset>`, both zero-padded to 16
/// digits so that offsets compare correctly as strings too.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default, Hash, Serialize, Deserialize,
)]
pub struct Offset {
    /// Kept at 0 by this store (the reference uses it for file rotation).
    pub read_seq: u64,
    /// Logical byte position after the message.
    pub byte: u64,
}

impl Offset {
    /// The start of every stream.
    pub const ZERO: Offset = Offset {
        read_seq: 0,
        byte: 0,
    };

    /// Parse `digits_digits`; anything else is `None`.
    pub fn parse(raw: &str) -> Option<Offset> {
        let (a, b) = raw.split_once('_')?;
        let digits = |s: &str| !s.is_empty() && s.bytes().all(|c| c.is_ascii_digit());
        if !digits(a) || !digits(b) {
            return None;
        }
        Some(Offset {
            read_seq: a.parse().ok()?,
            byte: b.parse().ok()?,
        })
    }
}

impl fmt::Display for Offset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016}_{:016}", self.read_seq, self.byte)
    }
}

/// One stored append. For JSON streams `data` holds the flattened values,
/// each serialized and followed by a comma (`1,{"a":2},`).
#[derive(Debug, Clone)]
pub struct StoredMessage {
    /// The payload.
    pub data: Bytes,
    /// The offset just after this message.
    pub offset: Offset,
}

/// Why a store operation was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreError {
    /// No such stream (or it expired).
    NotFound,
    /// The stream was deleted but forks still read from it.
    Gone,
    /// A deleted stream with live forks still owns this path.
    PathHeldByForks,
    /// `PUT` with a configuration different from the existing stream's.
    ConfigMismatch,
    /// The fork source does not exist.
    SourceNotFound,
    /// The fork source was deleted (its forks keep it alive).
    SourceGone,
    /// A fork asked for a content type other than its source's.
    SourceContentTypeMismatch,
    /// The fork offset lies beyond the source's tail.
    InvalidForkOffset,
    /// The fork sub-offset cannot be resolved.
    InvalidForkSubOffset(String),
    /// A JSON stream got a body that is not JSON.
    InvalidJson,
    /// A JSON stream got `[]` on append.
    EmptyArray,
    /// `Stream-Seq` did not increase.
    SeqConflict,
    /// The append's content type differs from the stream's.
    ContentTypeMismatch,
    /// The SQLite file could not be read or written.
    Storage(String),
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = match self {
            StoreError::NotFound => "stream not found",
            StoreError::Gone => "stream is gone",
            StoreError::PathHeldByForks => {
                "stream was deleted but still has active forks; the path cannot be reused until all forks are removed"
            }
            StoreError::ConfigMismatch => "stream already exists with a different configuration",
            StoreError::SourceNotFound => "source stream not found",
            StoreError::SourceGone => "source stream was deleted but still has active forks",
            StoreError::SourceContentTypeMismatch => "content type mismatch with source stream",
            StoreError::InvalidForkOffset => "fork offset beyond source stream length",
            StoreError::InvalidForkSubOffset(why) => return write!(f, "invalid fork sub-offset: {why}"),
            StoreError::InvalidJson => "invalid JSON",
            StoreError::EmptyArray => "empty arrays are not allowed",
            StoreError::SeqConflict => "Stream-Seq must increase",
            StoreError::ContentTypeMismatch => "content type does not match the stream's",
            StoreError::Storage(why) => return write!(f, "stream storage failed: {why}"),
        };
        f.write_str(text)
    }
}

impl std::error::Error for StoreError {}

/// What `PUT` asks for.
#[derive(Debug, Clone, Default)]
pub struct CreateOptions {
    /// `Content-Type` (already defaulted for non-forks; `None` = inherit).
    pub content_type: Option<String>,
    /// `Stream-TTL` in seconds (sliding: renewed by every access).
    pub ttl_seconds: Option<u64>,
    /// `Stream-Expires-At` as sent, with its parsed instant (ms since epoch).
    pub expires_at: Option<(String, i64)>,
    /// The request body.
    pub initial_data: Option<Bytes>,
    /// `Stream-Closed: true`.
    pub closed: bool,
    /// `Stream-Forked-From`: the source path.
    pub forked_from: Option<String>,
    /// `Stream-Fork-Offset` (default: the source's tail).
    pub fork_offset: Option<Offset>,
    /// `Stream-Fork-Sub-Offset`: bytes (or JSON values) of the first source
    /// message after `fork_offset` to include.
    pub fork_sub_offset: Option<u64>,
}

/// A producer's `(id, epoch, seq)` tuple.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Producer {
    /// `Producer-Id`.
    pub id: String,
    /// `Producer-Epoch`.
    pub epoch: u64,
    /// `Producer-Seq`.
    pub seq: u64,
}

/// What `POST` asks for.
#[derive(Debug, Clone, Default)]
pub struct AppendOptions {
    /// `Stream-Seq` (compared as a string, must strictly increase).
    pub seq: Option<String>,
    /// `Content-Type` of the append.
    pub content_type: Option<String>,
    /// Idempotent producer headers.
    pub producer: Option<Producer>,
    /// `Stream-Closed: true`: close after appending.
    pub close: bool,
}

/// The result of an append or close that reached the stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AppendOutcome {
    /// Data stored (or, for a close-only request, the stream closed).
    Accepted {
        /// The tail after the operation.
        offset: Offset,
        /// The stream is now closed.
        closed: bool,
    },
    /// The producer already sent this seq: nothing stored.
    Duplicate {
        /// Highest seq accepted from this producer.
        last_seq: u64,
        /// The stream's tail.
        offset: Offset,
        /// The stream is closed.
        closed: bool,
    },
    /// The producer epoch is older than the one the stream knows.
    StaleEpoch {
        /// The epoch the stream knows.
        current_epoch: u64,
    },
    /// A new epoch must start at seq 0.
    InvalidEpochSeq,
    /// The producer skipped seqs.
    SequenceGap {
        /// The seq the stream expected.
        expected: u64,
        /// The seq it got.
        received: u64,
    },
    /// The stream is closed (by someone else's request).
    StreamClosed {
        /// Its final offset.
        offset: Offset,
    },
}

/// A stream's metadata, as `HEAD` reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamMeta {
    /// The stream's content type, if it has one.
    pub content_type: Option<String>,
    /// The tail offset.
    pub tail: Offset,
    /// No more appends are accepted.
    pub closed: bool,
    /// Sliding TTL in seconds.
    pub ttl_seconds: Option<u64>,
    /// Absolute expiry as sent at creation.
    pub expires_at: Option<String>,
    /// Deleted (or expired) but kept for its forks: reads answer 410.
    pub soft_deleted: bool,
}

impl StreamMeta {
    /// True for `application/json` streams (parameters ignored).
    pub fn is_json(&self) -> bool {
        self.content_type
            .as_deref()
            .is_some_and(|ct| normalize_content_type(ct) == "application/json")
    }
}

/// Lower-case media type without parameters.
pub fn normalize_content_type(ct: &str) -> String {
    ct.split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase()
}

#[derive(Debug, Clone)]
struct ProducerState {
    epoch: u64,
    last_seq: u64,
    /// Milliseconds since the Unix epoch.
    updated: u64,
}

/// One stream: its messages and everything the protocol tracks about it.
#[derive(Debug)]
struct Stream {
    content_type: Option<String>,
    messages: Vec<StoredMessage>,
    tail: Offset,
    ttl_seconds: Option<u64>,
    expires_at: Option<(String, i64)>,
    /// Milliseconds since the Unix epoch.
    last_access: u64,
    closed: bool,
    closed_by: Option<Producer>,
    /// Number of forks reading through this stream.
    ref_count: usize,
    soft_deleted: bool,
    forked_from: Option<String>,
    fork_offset: Option<Offset>,
    fork_sub_offset: u64,
    last_seq: Option<String>,
    producers: HashMap<String, ProducerState>,
}

impl Stream {
    fn persisted(&self) -> PersistedStream {
        PersistedStream {
            content_type: self.content_type.clone(),
            tail: self.tail,
            ttl_seconds: self.ttl_seconds,
            expires_at: self.expires_at.clone(),
            closed: self.closed,
            closed_by: self.closed_by.clone(),
            ref_count: self.ref_count,
            soft_deleted: self.soft_deleted,
            forked_from: self.forked_from.clone(),
            fork_offset: self.fork_offset,
            fork_sub_offset: self.fork_sub_offset,
            last_seq: self.last_seq.clone(),
            producers: self
                .producers
                .iter()
                .map(|(id, s)| (id.clone(), s.epoch, s.last_seq))
                .collect(),
        }
    }

    fn from_persisted(p: PersistedStream, now: u64) -> Stream {
        Stream {
            content_type: p.content_type,
            messages: Vec::new(),
            tail: p.tail,
            ttl_seconds: p.ttl_seconds,
            expires_at: p.expires_at,
            last_access: now,
            closed: p.closed,
            closed_by: p.closed_by,
            ref_count: p.ref_count,
            soft_deleted: p.soft_deleted,
            forked_from: p.forked_from,
            fork_offset: p.fork_offset,
            fork_sub_offset: p.fork_sub_offset,
            last_seq: p.last_seq,
            producers: p
                .producers
                .into_iter()
                .map(|(id, epoch, last_seq)| {
                    (
                        id,
                        ProducerState {
                            epoch,
                            last_seq,
                            updated: now,
                        },
                    )
                })
                .collect(),
        }
    }

    fn meta(&self) -> StreamMeta {
        StreamMeta {
            content_type: self.content_type.clone(),
            tail: self.tail,
            closed: self.closed,
            ttl_seconds: self.ttl_seconds,
            expires_at: self.expires_at.as_ref().map(|(raw, _)| raw.clone()),
            soft_deleted: self.soft_deleted,
        }
    }

    fn is_json(&self) -> bool {
        self.content_type
            .as_deref()
            .is_some_and(|ct| normalize_content_type(ct) == "application/json")
    }

    fn expired(&self, now: u64) -> bool {
        if let Some((_, at)) = &self.expires_at {
            if now as i64 >= *at {
                return true;
            }
        }
        if let Some(ttl) = self.ttl_seconds {
            if now.saturating_sub(self.last_access) >= ttl.saturating_mul(1000) {
                return true;
            }
        }
        false
    }

    /// Own messages strictly after `after`.
    fn own_after(&self, after: Offset) -> &[StoredMessage] {
        let start = self.messages.partition_point(|m| m.offset <= after);
        &self.messages[start..]
    }

    fn push(&mut self, data: Bytes) -> Offset {
        let offset = Offset {
            read_seq: self.tail.read_seq,
            byte: self.tail.byte + FRAME_OVERHEAD + data.len() as u64,
        };
        self.messages.push(StoredMessage { data, offset });
        self.tail = offset;
        offset
    }
}

/// Every generic stream of one server, in memory, with what changed since
/// the host last persisted (see the module docs).
pub struct Streams {
    map: HashMap<String, Stream>,
    clock: Arc<dyn Clock>,
    /// Streams whose metadata changed (or that were removed).
    dirty: Vec<String>,
    /// Messages stored since the last [`Streams::take_changes`].
    appended: Vec<(String, StoredMessage)>,
    /// State of the cursor jitter's generator (splitmix64).
    jitter: u64,
}

impl fmt::Debug for Streams {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Streams")
            .field("streams", &self.map.len())
            .field("dirty", &self.dirty.len())
            .field("appended", &self.appended.len())
            .finish_non_exhaustive()
    }
}

/// What SQLite keeps of a stream besides its messages.
#[derive(Debug, Serialize, Deserialize)]
struct PersistedStream {
    content_type: Option<String>,
    tail: Offset,
    ttl_seconds: Option<u64>,
    expires_at: Option<(String, i64)>,
    closed: bool,
    closed_by: Option<Producer>,
    ref_count: usize,
    soft_deleted: bool,
    forked_from: Option<String>,
    fork_offset: Option<Offset>,
    fork_sub_offset: u64,
    last_seq: Option<String>,
    /// `(id, epoch, last seq)`.
    producers: Vec<(String, u64, u64)>,
}

/// What to write so the storage matches memory again: the rows of the
/// tables in [`SCHEMA`], as [`Streams::take_changes`] hands them over.
#[derive(Debug, Default)]
pub struct Changes {
    /// `ds_messages` rows to insert: `(path, message)`.
    pub messages: Vec<(String, StoredMessage)>,
    /// `ds_streams` rows to insert or replace: `(path, metadata JSON)`.
    pub upserts: Vec<(String, String)>,
    /// Streams to delete, with their messages.
    pub removed: Vec<String>,
}

impl Changes {
    /// Nothing to write.
    pub fn is_empty(&self) -> bool {
        self.messages.is_empty() && self.upserts.is_empty() && self.removed.is_empty()
    }
}

/// The tables a persisted store keeps, the same in every SQLite the
/// streams are stored in (a file through `rusqlite`, a Durable Object's
/// database): one row of metadata JSON per stream, one row per message.
pub const SCHEMA: &[&str] = &[
    "CREATE TABLE IF NOT EXISTS ds_streams (
         path TEXT PRIMARY KEY,
         meta TEXT NOT NULL
     )",
    "CREATE TABLE IF NOT EXISTS ds_messages (
         path TEXT NOT NULL,
         read_seq INTEGER NOT NULL,
         byte INTEGER NOT NULL,
         data BLOB NOT NULL,
         PRIMARY KEY (path, read_seq, byte)
     )",
];

/// Statements over [`SCHEMA`], with positional parameters.
pub mod sql {
    /// Every stream's metadata: `(path, meta)`.
    pub const SELECT_STREAMS: &str = "SELECT path, meta FROM ds_streams";
    /// Every message in order: `(path, read_seq, byte, data)`.
    pub const SELECT_MESSAGES: &str =
        "SELECT path, read_seq, byte, data FROM ds_messages ORDER BY path, read_seq, byte";
    /// `(path, read_seq, byte, data)`.
    pub const INSERT_MESSAGE: &str =
        "INSERT OR REPLACE INTO ds_messages (path, read_seq, byte, data) VALUES (?1, ?2, ?3, ?4)";
    /// `(path, meta)`.
    pub const UPSERT_STREAM: &str =
        "INSERT OR REPLACE INTO ds_streams (path, meta) VALUES (?1, ?2)";
    /// `(path)`.
    pub const DELETE_STREAM: &str = "DELETE FROM ds_streams WHERE path = ?1";
    /// `(path)`.
    pub const DELETE_MESSAGES: &str = "DELETE FROM ds_messages WHERE path = ?1";
}

/// Validate a JSON body and flatten a top-level array one level, returning
/// the stored form (`v1,v2,`). `Ok(None)` means "nothing to store" (an empty
/// array in the body of a create).
pub fn process_json(data: &[u8], initial: bool) -> Result<Option<Bytes>, StoreError> {
    let value: serde_json::Value =
        serde_json::from_slice(data).map_err(|_| StoreError::InvalidJson)?;
    let mut out = String::new();
    match value {
        serde_json::Value::Array(items) => {
            if items.is_empty() {
                return if initial {
                    Ok(None)
                } else {
                    Err(StoreError::EmptyArray)
                };
            }
            for item in items {
                out.push_str(&item.to_string());
                out.push(',');
            }
        }
        other => {
            out.push_str(&other.to_string());
            out.push(',');
        }
    }
    Ok(Some(Bytes::from(out)))
}

/// Render messages of a JSON stream as one JSON array.
pub fn format_json(messages: &[StoredMessage]) -> Bytes {
    let mut out = Vec::with_capacity(2 + messages.iter().map(|m| m.data.len()).sum::<usize>());
    out.push(b'[');
    for m in messages {
        out.extend_from_slice(&m.data);
    }
    if out.last() == Some(&b',') {
        out.pop();
    }
    out.push(b']');
    Bytes::from(out)
}

/// Render the payload of one message (JSON streams: its values without the
/// trailing comma, wrapped as an array).
pub fn format_body(json: bool, messages: &[StoredMessage]) -> Bytes {
    if json {
        return format_json(messages);
    }
    let mut out = Vec::with_capacity(messages.iter().map(|m| m.data.len()).sum());
    for m in messages {
        out.extend_from_slice(&m.data);
    }
    Bytes::from(out)
}

impl Streams {
    /// No streams; time from `clock`, cursor jitter seeded with `seed`.
    pub fn new(clock: Arc<dyn Clock>, seed: u64) -> Self {
        Self {
            map: HashMap::new(),
            clock,
            dirty: Vec::new(),
            appended: Vec::new(),
            jitter: seed,
        }
    }

    /// The streams a storage holds: its `ds_streams` rows (`(path, meta)`)
    /// and its `ds_messages` rows in offset order. Sliding TTLs restart now
    /// (the last access is not persisted).
    pub fn load(
        clock: Arc<dyn Clock>,
        seed: u64,
        streams: impl IntoIterator<Item = (String, String)>,
        messages: impl IntoIterator<Item = (String, StoredMessage)>,
    ) -> Result<Self, StoreError> {
        let mut this = Self::new(clock, seed);
        let now = this.now();
        for (path, meta) in streams {
            let p: PersistedStream = serde_json::from_str(&meta)
                .map_err(|e| StoreError::Storage(format!("metadata of {path}: {e}")))?;
            this.map.insert(path, Stream::from_persisted(p, now));
        }
        for (path, message) in messages {
            if let Some(stream) = this.map.get_mut(&path) {
                stream.messages.push(message);
            }
        }
        Ok(this)
    }

    /// Milliseconds since the Unix epoch, from the clock.
    pub fn now(&self) -> u64 {
        self.clock.now_ms()
    }

    /// The `Stream-Cursor` to answer a client that sent `client`
    /// ([`crate::util::response_cursor`], jittered from this store's
    /// generator).
    pub fn cursor(&mut self, client: Option<&str>) -> String {
        let random = crate::util::splitmix64(&mut self.jitter);
        crate::util::response_cursor(client, self.now() as i64, random)
    }

    /// What changed since the last call: write it (in one transaction)
    /// before answering the request that changed it.
    pub fn take_changes(&mut self) -> Changes {
        let mut dirty = std::mem::take(&mut self.dirty);
        let appended = std::mem::take(&mut self.appended);
        dirty.sort();
        dirty.dedup();
        let mut changes = Changes {
            messages: appended
                .into_iter()
                .filter(|(path, _)| self.map.contains_key(path))
                .collect(),
            ..Changes::default()
        };
        for path in dirty {
            match self.map.get(&path) {
                Some(stream) => {
                    // Plain data: encoding cannot fail.
                    let meta = serde_json::to_string(&stream.persisted()).unwrap_or_default();
                    changes.upserts.push((path, meta));
                }
                None => changes.removed.push(path),
            }
        }
        changes
    }

    /// Metadata of a stream (soft-deleted streams are reported as such).
    pub fn meta(&mut self, path: &str) -> Option<StreamMeta> {
        Self::live(self, path).map(|s| s.meta())
    }

    /// Drop an expired stream (or soft-delete it if forks read from it).
    /// Returns whether the stream is still present.
    fn check_expiry(map: &mut Streams, path: &str) -> bool {
        let now = map.now();
        let Some(stream) = map.map.get_mut(path) else {
            return false;
        };
        if !stream.expired(now) {
            return true;
        }
        if stream.ref_count > 0 {
            if !stream.soft_deleted {
                stream.soft_deleted = true;
                map.dirty.push(path.to_string());
            }
            return true;
        }
        Self::delete_cascade(map, path);
        false
    }

    fn delete_cascade(map: &mut Streams, path: &str) {
        let Some(stream) = map.map.remove(path) else {
            return;
        };
        map.dirty.push(path.to_string());
        if let Some(parent_path) = stream.forked_from {
            let cascade = match map.map.get_mut(&parent_path) {
                Some(parent) => {
                    parent.ref_count = parent.ref_count.saturating_sub(1);
                    parent.ref_count == 0 && parent.soft_deleted
                }
                None => false,
            };
            map.dirty.push(parent_path.clone());
            if cascade {
                Self::delete_cascade(map, &parent_path);
            }
        }
    }

    /// Live (not expired) stream, soft-deleted ones included.
    fn live<'a>(map: &'a mut Streams, path: &str) -> Option<&'a mut Stream> {
        if !Self::check_expiry(map, path) {
            return None;
        }
        map.map.get_mut(path)
    }

    /// Renew the sliding TTL.
    pub fn touch(&mut self, path: &str) {
        let now = self.now();
        if let Some(s) = self.map.get_mut(path) {
            s.last_access = now;
        }
    }

    /// `PUT`: create, or confirm an identical existing stream.
    /// Returns `(created, meta)`.
    pub fn create(
        &mut self,
        path: &str,
        opts: CreateOptions,
    ) -> Result<(bool, StreamMeta), StoreError> {
        let map = self;
        if Self::check_expiry(map, path) {
            let existing = map.map.get(path).ok_or(StoreError::NotFound)?;
            if existing.soft_deleted {
                return Err(StoreError::PathHeldByForks);
            }
            let ct = |c: Option<&str>| {
                let n = c.map(normalize_content_type).unwrap_or_default();
                if n.is_empty() {
                    "application/octet-stream".to_string()
                } else {
                    n
                }
            };
            let same = ct(opts.content_type.as_deref()) == ct(existing.content_type.as_deref())
                && opts.ttl_seconds == existing.ttl_seconds
                && opts.expires_at.as_ref().map(|e| &e.0)
                    == existing.expires_at.as_ref().map(|e| &e.0)
                && opts.closed == existing.closed
                && opts.forked_from == existing.forked_from
                && (opts.fork_offset.is_none() || opts.fork_offset == existing.fork_offset)
                && opts.fork_sub_offset.unwrap_or(0) == existing.fork_sub_offset;
            return if same {
                Ok((false, existing.meta()))
            } else {
                Err(StoreError::ConfigMismatch)
            };
        }

        let mut stream = Stream {
            content_type: opts.content_type.clone().filter(|c| !c.trim().is_empty()),
            messages: Vec::new(),
            tail: Offset::ZERO,
            ttl_seconds: opts.ttl_seconds,
            expires_at: opts.expires_at.clone(),
            last_access: map.now(),
            closed: opts.closed,
            closed_by: None,
            ref_count: 0,
            soft_deleted: false,
            forked_from: None,
            fork_offset: None,
            fork_sub_offset: 0,
            last_seq: None,
            producers: HashMap::new(),
        };

        if let Some(source_path) = &opts.forked_from {
            if !Self::check_expiry(map, source_path) {
                return Err(StoreError::SourceNotFound);
            }
            let source = map.map.get(source_path).ok_or(StoreError::SourceNotFound)?;
            if source.soft_deleted {
                return Err(StoreError::SourceGone);
            }
            if let Some(ct) = opts
                .content_type
                .as_deref()
                .filter(|c| !c.trim().is_empty())
            {
                let src = source
                    .content_type
                    .as_deref()
                    .map(normalize_content_type)
                    .unwrap_or_default();
                if normalize_content_type(ct) != src {
                    return Err(StoreError::SourceContentTypeMismatch);
                }
            }
            let fork_offset = opts.fork_offset.unwrap_or(source.tail);
            if fork_offset > source.tail {
                return Err(StoreError::InvalidForkOffset);
            }
            let json = source.is_json();
            let mut prefix = None;
            if let Some(sub) = opts.fork_sub_offset.filter(|s| *s > 0) {
                let after = Self::read_chain(&map.map, source_path, Some(fork_offset), source.tail);
                let first = after.first().ok_or_else(|| {
                    StoreError::InvalidForkSubOffset("no data past the fork offset".into())
                })?;
                prefix = Some(sub_prefix(&first.data, sub, json)?);
            }
            if stream.content_type.is_none() {
                stream.content_type = source.content_type.clone();
            }
            if opts.ttl_seconds.is_none() && opts.expires_at.is_none() {
                stream.ttl_seconds = source.ttl_seconds;
                stream.expires_at = source.expires_at.clone();
            }
            stream.forked_from = Some(source_path.clone());
            stream.fork_offset = Some(fork_offset);
            stream.tail = fork_offset;
            if let Some(prefix) = prefix {
                if !prefix.is_empty() {
                    stream.push(prefix);
                    stream.fork_sub_offset = opts.fork_sub_offset.unwrap_or(0);
                }
            }
        }

        if let Some(data) = opts.initial_data.filter(|d| !d.is_empty()) {
            let data = if stream.is_json() {
                process_json(&data, true)?
            } else {
                Some(data)
            };
            if let Some(data) = data {
                stream.push(data);
            }
        }

        if let Some(source_path) = &opts.forked_from {
            if let Some(source) = map.map.get_mut(source_path) {
                source.ref_count += 1;
            }
        }
        let meta = stream.meta();
        for m in &stream.messages {
            map.appended.push((path.to_string(), m.clone()));
        }
        map.dirty.push(path.to_string());
        if let Some(source_path) = &opts.forked_from {
            map.dirty.push(source_path.clone());
        }
        map.map.insert(path.to_string(), stream);
        Ok((true, meta))
    }

    /// Messages of `path`'s ancestry visible to a reader of `path` strictly
    /// after `after` and up to `cap` (inclusive), in offset order.
    fn read_chain(
        map: &HashMap<String, Stream>,
        path: &str,
        after: Option<Offset>,
        cap: Offset,
    ) -> Vec<StoredMessage> {
        let Some(stream) = map.get(path) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        if let (Some(parent), Some(fork_offset)) = (&stream.forked_from, stream.fork_offset) {
            if after.is_none_or(|a| a < fork_offset) {
                out = Self::read_chain(map, parent, after, fork_offset.min(cap));
            }
        }
        let after = after.unwrap_or(Offset {
            read_seq: 0,
            byte: 0,
        });
        for m in stream.own_after(after) {
            if m.offset > cap {
                break;
            }
            // A fork's first own message can sit at the fork offset only
            // through a sub-offset prefix, which is strictly after it.
            out.push(m.clone());
        }
        out
    }

    /// Everything after `after` (`None` = from the start), inherited
    /// messages of forks included, plus the stream's metadata.
    pub fn read(
        &mut self,
        path: &str,
        after: Option<Offset>,
    ) -> Result<(Vec<StoredMessage>, StreamMeta), StoreError> {
        let map = self;
        let stream = Self::live(map, path).ok_or(StoreError::NotFound)?;
        let meta = stream.meta();
        let messages = Self::read_chain(&map.map, path, after, meta.tail);
        Ok((messages, meta))
    }

    /// `POST` with a body.
    pub fn append(
        &mut self,
        path: &str,
        data: Bytes,
        opts: AppendOptions,
    ) -> Result<AppendOutcome, StoreError> {
        let map = self;
        let now = map.now();
        let stream = Self::live(map, path).ok_or(StoreError::NotFound)?;
        if stream.soft_deleted {
            return Err(StoreError::Gone);
        }
        if stream.closed {
            if opts.producer.is_some() && opts.producer == stream.closed_by {
                let seq = opts.producer.as_ref().map(|p| p.seq).unwrap_or(0);
                return Ok(AppendOutcome::Duplicate {
                    last_seq: seq,
                    offset: stream.tail,
                    closed: true,
                });
            }
            return Ok(AppendOutcome::StreamClosed {
                offset: stream.tail,
            });
        }
        if let (Some(given), Some(own)) = (&opts.content_type, &stream.content_type) {
            if normalize_content_type(given) != normalize_content_type(own) {
                return Err(StoreError::ContentTypeMismatch);
            }
        }
        let accepted = match &opts.producer {
            Some(p) => match validate_producer(stream, p, now) {
                Ok(state) => Some(state),
                Err(outcome) => return Ok(outcome),
            },
            None => None,
        };
        if let (Some(seq), Some(last)) = (&opts.seq, &stream.last_seq) {
            if seq <= last {
                return Err(StoreError::SeqConflict);
            }
        }
        let data = if stream.is_json() {
            process_json(&data, false)?.ok_or(StoreError::EmptyArray)?
        } else {
            data
        };
        let offset = stream.push(data);
        stream.last_access = now;
        if let (Some(p), Some(state)) = (&opts.producer, accepted) {
            stream.producers.insert(p.id.clone(), state);
        }
        if let Some(seq) = opts.seq {
            stream.last_seq = Some(seq);
        }
        if opts.close {
            stream.closed = true;
            stream.closed_by = opts.producer.clone();
        }
        let closed = stream.closed;
        let message = stream.messages.last().cloned();
        map.dirty.push(path.to_string());
        if let Some(m) = message {
            map.appended.push((path.to_string(), m));
        }
        Ok(AppendOutcome::Accepted { offset, closed })
    }

    /// `POST` with an empty body and `Stream-Closed: true`.
    pub fn close(
        &mut self,
        path: &str,
        producer: Option<Producer>,
    ) -> Result<AppendOutcome, StoreError> {
        let map = self;
        let now = map.now();
        let stream = Self::live(map, path).ok_or(StoreError::NotFound)?;
        if stream.soft_deleted {
            return Err(StoreError::Gone);
        }
        let Some(p) = producer else {
            stream.closed = true;
            let offset = stream.tail;
            map.dirty.push(path.to_string());
            return Ok(AppendOutcome::Accepted {
                offset,
                closed: true,
            });
        };
        if stream.closed {
            if stream.closed_by.as_ref() == Some(&p) {
                return Ok(AppendOutcome::Duplicate {
                    last_seq: p.seq,
                    offset: stream.tail,
                    closed: true,
                });
            }
            return Ok(AppendOutcome::StreamClosed {
                offset: stream.tail,
            });
        }
        let state = match validate_producer(stream, &p, now) {
            Ok(state) => state,
            Err(outcome) => return Ok(outcome),
        };
        stream.producers.insert(p.id.clone(), state);
        stream.closed = true;
        stream.closed_by = Some(p);
        let offset = stream.tail;
        map.dirty.push(path.to_string());
        Ok(AppendOutcome::Accepted {
            offset,
            closed: true,
        })
    }

    /// `DELETE`: remove, or soft-delete while forks read through it.
    /// `Ok(false)` when there was no such stream.
    pub fn delete(&mut self, path: &str) -> Result<bool, StoreError> {
        let map = self;
        if !Self::check_expiry(map, path) {
            return Ok(false);
        }
        let Some(stream) = map.map.get_mut(path) else {
            return Ok(false);
        };
        if stream.soft_deleted {
            return Err(StoreError::Gone);
        }
        if stream.ref_count > 0 {
            stream.soft_deleted = true;
            map.dirty.push(path.to_string());
            return Ok(true);
        }
        Self::delete_cascade(map, path);
        Ok(true)
    }
}

/// The prefix of a source message a fork with a sub-offset starts with.
fn sub_prefix(data: &[u8], sub: u64, json: bool) -> Result<Bytes, StoreError> {
    if json {
        let text = std::str::from_utf8(data)
            .map_err(|_| StoreError::InvalidForkSubOffset("source JSON is not UTF-8".into()))?;
        let trimmed = text.strip_suffix(',').unwrap_or(text);
        let values: Vec<serde_json::Value> = serde_json::from_str(&format!("[{trimmed}]"))
            .map_err(|_| StoreError::InvalidForkSubOffset("source JSON is unparseable".into()))?;
        if sub as usize > values.len() {
            return Err(StoreError::InvalidForkSubOffset(
                "overshoots the source message's value count".into(),
            ));
        }
        let mut out = String::new();
        for v in &values[..sub as usize] {
            out.push_str(&v.to_string());
            out.push(',');
        }
        return Ok(Bytes::from(out));
    }
    if sub as usize > data.len() {
        return Err(StoreError::InvalidForkSubOffset(
            "overshoots the source message's length".into(),
        ));
    }
    Ok(Bytes::copy_from_slice(&data[..sub as usize]))
}

/// Check a producer tuple; `Ok` carries the state to commit on success.
fn validate_producer(
    stream: &mut Stream,
    p: &Producer,
    now: u64,
) -> Result<ProducerState, AppendOutcome> {
    stream
        .producers
        .retain(|_, s| now.saturating_sub(s.updated) <= PRODUCER_STATE_TTL_MS);
    let fresh = ProducerState {
        epoch: p.epoch,
        last_seq: p.seq,
        updated: now,
    };
    let Some(state) = stream.producers.get(&p.id) else {
        if p.seq != 0 {
            return Err(AppendOutcome::SequenceGap {
                expected: 0,
                received: p.seq,
            });
        }
        return Ok(fresh);
    };
    if p.epoch < state.epoch {
        return Err(AppendOutcome::StaleEpoch {
            current_epoch: state.epoch,
        });
    }
    if p.epoch > state.epoch {
        if p.seq != 0 {
            return Err(AppendOutcome::InvalidEpochSeq);
        }
        return Ok(fresh);
    }
    if p.seq <= state.last_seq {
        return Err(AppendOutcome::Duplicate {
            last_seq: state.last_seq,
            offset: stream.tail,
            closed: stream.closed,
        });
    }
    if p.seq == state.last_seq + 1 {
        return Ok(fresh);
    }
    Err(AppendOutcome::SequenceGap {
        expected: state.last_seq + 1,
        received: p.seq,
    })
}
