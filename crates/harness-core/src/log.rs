//! Session logs: the ordered, durable record of a session.
//!
//! The rules every backend follows (and the conformance suite checks):
//! - `seq` starts at 1 and has no gaps; the log, not the writer, assigns it.
//! - An append with an idempotency key already used returns the original seq
//!   with `duplicate: true` and stores nothing; reusing a key for different
//!   content is a `Conflict`.
//! - `read(after)` returns frames with `seq > after`, in order.
//! - `seal` appends a final [`FrameBody::Sealed`] frame; any later append is
//!   a `Conflict`. Sealing twice is a no-op.
//! - `fork(until = N)` copies frames `1..=N` (and their idempotency keys) into
//!   a new log, which then grows on its own; `N` beyond the source's end is
//!   invalid, an existing target is a `Conflict`.
//!
//! [`LogState`] implements these rules on plain data so in-memory backends
//! (and a Durable Object) reuse them instead of re-deriving them.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use crate::frame::{Frame, FrameBody, SessionId};
use crate::{Error, Result};

/// Largest encoded frame body a log accepts by default (1 MiB).
pub const DEFAULT_MAX_FRAME_BYTES: usize = 1024 * 1024;

/// Largest idempotency key accepted.
pub const MAX_IDEMPOTENCY_KEY_LEN: usize = 256;

/// What to append.
#[derive(Debug, Clone, PartialEq)]
pub struct AppendRequest {
    /// The frame content.
    pub body: FrameBody,
    /// Makes the append idempotent: a retry with the same key stores nothing.
    pub idempotency_key: Option<String>,
}

impl AppendRequest {
    /// An append without an idempotency key.
    pub fn new(body: FrameBody) -> Self {
        Self {
            body,
            idempotency_key: None,
        }
    }

    /// An append with an idempotency key.
    pub fn idempotent(body: FrameBody, key: impl Into<String>) -> Self {
        Self {
            body,
            idempotency_key: Some(key.into()),
        }
    }
}

/// The result of an append.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Appended {
    /// The frame's seq (the original one for a duplicate).
    pub seq: u64,
    /// True when the key was seen before and nothing was stored.
    pub duplicate: bool,
}

/// Where a forked log came from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForkOrigin {
    /// The source session.
    pub session: SessionId,
    /// The last seq copied.
    pub until: u64,
}

/// A log's metadata.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogInfo {
    /// The session.
    pub session: SessionId,
    /// Seq of the last frame (0 when empty).
    pub last_seq: u64,
    /// Whether the log is sealed.
    pub sealed: bool,
    /// Set when the log was made by `fork`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub forked_from: Option<ForkOrigin>,
}

/// An append-only, seq-numbered log per session.
#[async_trait]
pub trait SessionLog: Send + Sync + std::fmt::Debug {
    /// Create an empty log; creating an existing one returns its info.
    async fn create(&self, session: &SessionId) -> Result<LogInfo>;

    /// Metadata. `NotFound` for an unknown session.
    async fn info(&self, session: &SessionId) -> Result<LogInfo>;

    /// Append one frame; the log assigns its seq.
    async fn append(&self, session: &SessionId, request: AppendRequest) -> Result<Appended>;

    /// Frames with `seq > after`, at most `limit` of them, in order.
    async fn read(&self, session: &SessionId, after: u64, limit: usize) -> Result<Vec<Frame>>;

    /// Seal the log (see the module docs).
    async fn seal(&self, session: &SessionId) -> Result<LogInfo>;

    /// Copy frames `1..=until` into a new log `target`.
    async fn fork(&self, source: &SessionId, until: u64, target: &SessionId) -> Result<LogInfo>;

    /// Every log, sorted by session id.
    async fn list(&self) -> Result<Vec<LogInfo>>;
}

/// Validate an append before storing it: size and key limits.
pub fn check_append(request: &AppendRequest, max_frame_bytes: usize) -> Result<()> {
    let len = Frame::encoded_len(&request.body);
    if len > max_frame_bytes {
        return Err(Error::invalid(format!(
            "frame of {len} bytes exceeds the {max_frame_bytes}-byte limit; split the content into smaller frames"
        )));
    }
    if let Some(key) = &request.idempotency_key {
        if key.is_empty() || key.len() > MAX_IDEMPOTENCY_KEY_LEN {
            return Err(Error::invalid(format!(
                "idempotency key must be 1-{MAX_IDEMPOTENCY_KEY_LEN} bytes, got {}",
                key.len()
            )));
        }
    }
    Ok(())
}

/// The error for appending to a sealed log.
pub fn sealed_error(session: &SessionId) -> Error {
    Error::conflict(format!("session {session} is sealed; fork it to continue"))
}

/// The error for an idempotency key reused with other content.
pub fn key_reuse_error(key: &str, seq: u64) -> Error {
    Error::conflict(format!(
        "idempotency key {key:?} was already used for frame {seq} with different content"
    ))
}

/// The error for forking past the end.
pub fn fork_range_error(source: &SessionId, until: u64, last_seq: u64) -> Error {
    Error::invalid(format!(
        "cannot fork {source} until={until}: the log ends at seq {last_seq}"
    ))
}

/// One log's state, with the rules applied on plain data.
#[derive(Debug, Clone)]
pub struct LogState {
    session: SessionId,
    frames: Vec<Frame>,
    keys: HashMap<String, u64>,
    sealed: bool,
    forked_from: Option<ForkOrigin>,
}

impl LogState {
    /// An empty log.
    pub fn new(session: SessionId) -> Self {
        Self {
            session,
            frames: Vec::new(),
            keys: HashMap::new(),
            sealed: false,
            forked_from: None,
        }
    }

    /// Metadata.
    pub fn info(&self) -> LogInfo {
        LogInfo {
            session: self.session.clone(),
            last_seq: self.frames.len() as u64,
            sealed: self.sealed,
            forked_from: self.forked_from.clone(),
        }
    }

    /// Apply an append at time `now_ms`.
    pub fn append(
        &mut self,
        request: AppendRequest,
        now_ms: u64,
        max_frame_bytes: usize,
    ) -> Result<Appended> {
        check_append(&request, max_frame_bytes)?;
        if let Some(key) = &request.idempotency_key {
            if let Some(&seq) = self.keys.get(key) {
                let stored = &self.frames[(seq - 1) as usize].body;
                return if *stored == request.body {
                    Ok(Appended {
                        seq,
                        duplicate: true,
                    })
                } else {
                    Err(key_reuse_error(key, seq))
                };
            }
        }
        if self.sealed {
            return Err(sealed_error(&self.session));
        }
        let seq = self.frames.len() as u64 + 1;
        if matches!(request.body, FrameBody::Sealed {}) {
            self.sealed = true;
        }
        if let Some(key) = request.idempotency_key {
            self.keys.insert(key, seq);
        }
        self.frames.push(Frame {
            seq,
            at_ms: now_ms,
            body: request.body,
        });
        Ok(Appended {
            seq,
            duplicate: false,
        })
    }

    /// Frames after `after`.
    pub fn read(&self, after: u64, limit: usize) -> Vec<Frame> {
        let start = (after as usize).min(self.frames.len());
        self.frames[start..].iter().take(limit).cloned().collect()
    }

    /// Seal (idempotent).
    pub fn seal(&mut self, now_ms: u64) -> LogInfo {
        if !self.sealed {
            self.append(AppendRequest::new(FrameBody::Sealed {}), now_ms, usize::MAX)
                .expect("an unsealed log accepts a seal frame");
        }
        self.info()
    }

    /// A new log holding frames `1..=until`.
    pub fn fork(&self, until: u64, target: SessionId) -> Result<LogState> {
        let last = self.frames.len() as u64;
        if until > last {
            return Err(fork_range_error(&self.session, until, last));
        }
        let frames: Vec<Frame> = self.frames[..until as usize].to_vec();
        let keys = self
            .keys
            .iter()
            .filter(|(_, &s)| s <= until)
            .map(|(k, &s)| (k.clone(), s))
            .collect();
        let sealed = frames
            .iter()
            .any(|f| matches!(f.body, FrameBody::Sealed {}));
        Ok(LogState {
            session: target,
            frames,
            keys,
            sealed,
            forked_from: Some(ForkOrigin {
                session: self.session.clone(),
                until,
            }),
        })
    }
}

/// Milliseconds since the Unix epoch; 0 where the target has no clock
/// (`wasm32-unknown-unknown` without a host).
pub fn now_ms() -> u64 {
    #[cfg(not(target_arch = "wasm32"))]
    {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0)
    }
    #[cfg(target_arch = "wasm32")]
    {
        0
    }
}

/// An in-memory [`SessionLog`] for tests and single-process use.
#[derive(Debug, Clone)]
pub struct MemorySessionLog {
    logs: Arc<Mutex<BTreeMap<SessionId, LogState>>>,
    max_frame_bytes: usize,
}

impl Default for MemorySessionLog {
    fn default() -> Self {
        Self::new()
    }
}

impl MemorySessionLog {
    /// An empty set of logs with the default frame limit.
    pub fn new() -> Self {
        Self {
            logs: Arc::default(),
            max_frame_bytes: DEFAULT_MAX_FRAME_BYTES,
        }
    }

    /// Set the frame size limit.
    pub fn with_max_frame_bytes(mut self, max: usize) -> Self {
        self.max_frame_bytes = max;
        self
    }

    fn with_log<T>(
        &self,
        session: &SessionId,
        f: impl FnOnce(&mut LogState) -> Result<T>,
    ) -> Result<T> {
        let mut logs = self.logs.lock().unwrap_or_else(|e| e.into_inner());
        let log = logs
            .get_mut(session)
            .ok_or_else(|| unknown_session(session))?;
        f(log)
    }
}

/// The error for an unknown session.
pub fn unknown_session(session: &SessionId) -> Error {
    Error::not_found(format!("unknown session {session}"))
}

#[async_trait]
impl SessionLog for MemorySessionLog {
    async fn create(&self, session: &SessionId) -> Result<LogInfo> {
        let mut logs = self.logs.lock().unwrap_or_else(|e| e.into_inner());
        Ok(logs
            .entry(session.clone())
            .or_insert_with(|| LogState::new(session.clone()))
            .info())
    }

    async fn info(&self, session: &SessionId) -> Result<LogInfo> {
        self.with_log(session, |log| Ok(log.info()))
    }

    async fn append(&self, session: &SessionId, request: AppendRequest) -> Result<Appended> {
        let max = self.max_frame_bytes;
        self.with_log(session, |log| log.append(request, now_ms(), max))
    }

    async fn read(&self, session: &SessionId, after: u64, limit: usize) -> Result<Vec<Frame>> {
        self.with_log(session, |log| Ok(log.read(after, limit)))
    }

    async fn seal(&self, session: &SessionId) -> Result<LogInfo> {
        self.with_log(session, |log| Ok(log.seal(now_ms())))
    }

    async fn fork(&self, source: &SessionId, until: u64, target: &SessionId) -> Result<LogInfo> {
        let mut logs = self.logs.lock().unwrap_or_else(|e| e.into_inner());
        if logs.contains_key(target) {
            return Err(Error::conflict(format!(
                "cannot fork into {target}: that session already exists"
            )));
        }
        let forked = logs
            .get(source)
            .ok_or_else(|| unknown_session(source))?
            .fork(until, target.clone())?;
        let info = forked.info();
        logs.insert(target.clone(), forked);
        Ok(info)
    }

    async fn list(&self) -> Result<Vec<LogInfo>> {
        Ok(self
            .logs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .map(LogState::info)
            .collect())
    }
}
