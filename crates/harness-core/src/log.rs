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
//!   invalid, an existing target is a `Conflict`. When the copy ends inside
//!   a turn (the prompt is in it, the turn's end is not), the fork appends
//!   one frame of its own, [`fork_closing_frame`]: that turn never runs in
//!   the fork, which is ready for a new prompt at once.
//! - `delete` removes a log: its frames, keys, meta and index entries
//!   (`NotFound` when unknown). A fork of it keeps its own copy.
//! - `trim(through = N)` drops frames `1..=N` (retention): `N` must leave
//!   the newest frame (a log always shows its head), a cut at or before
//!   the current one changes nothing. The log keeps frame `N`'s chain hash
//!   ([`LogCut`]), so what is kept still verifies from the cut. Reading
//!   from inside the cut (`after < N`), and forking at or before it, is
//!   [`Gone`](crate::ErrorKind::Gone); a fork past it keeps the same cut.
//!   The meta, folded already, stays; the trimmed frames' idempotency keys
//!   and index entries go with them.
//! - An append answers with the frame as stored (seq and `at_ms`), so a
//!   caller fanning it out never reads it back.
//! - Each appended frame is folded into the session's [`SessionMeta`]
//!   (with [`SessionMeta::apply`]) in the same transaction, and
//!   [`LogInfo::meta`] returns it: recovering a session actor reads that,
//!   not the whole log.
//!
//! Two traits: [`SessionLog`] is the directory of sessions (create, list,
//! fork) plus per-session operations by id; [`SessionStore`] is *one*
//! session's log, all a session actor needs — what a Durable Object, which
//! holds exactly one session, implements. [`LogSession`] adapts the first to
//! the second.
//!
//! The append rules live once, in [`append::plan_append`]: every store
//! (the memory [`LogState`], SQLite, the Durable Object) asks it what to
//! write and writes that. [`LogState`] holds a log on plain data for
//! in-memory backends.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use crate::clock::Clock;
use crate::frame::{Frame, FrameBody, SessionId};
use crate::maybe::{MaybeSend, MaybeSync};
use crate::session::{SessionConfig, SessionMeta};
use crate::{Error, Result};

pub mod append;
pub mod chain;
pub mod lease;
pub mod retention;

pub use append::{plan_append, AppendPlan, AppendView, CheckedAppend, LogHead, NewFrame};
pub use chain::{ChainBreak, ChainKey, ChainReport, ChainedFrame, FrameHash};
pub use lease::{Claim, SessionLeases};
pub use retention::RetentionPolicy;

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
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Appended {
    /// The frame's seq (the original one for a duplicate).
    pub seq: u64,
    /// True when the key was seen before and nothing was stored.
    pub duplicate: bool,
    /// The frame as stored (the original one for a duplicate).
    pub frame: Frame,
}

/// Where a forked log came from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForkOrigin {
    /// The source session.
    pub session: SessionId,
    /// The last seq copied.
    pub until: u64,
}

/// Where a trimmed log starts: frames `1..=through` were removed by
/// retention ([`SessionLog::trim`]); `hash` is frame `through`'s chain link,
/// the start from which the kept frames verify.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogCut {
    /// The last seq removed.
    pub through: u64,
    /// Frame `through`'s hash (`None` for a frame from before the chain).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hash: Option<FrameHash>,
}

/// `Gone` for a read from inside `session`'s cut.
pub fn trimmed_error(session: &SessionId, cut: &LogCut, after: u64) -> Error {
    Error::gone(format!(
        "frames 1..={} of session {session} were removed by retention; \
         read from seq {} on (asked for frames after {after})",
        cut.through,
        cut.through + 1
    ))
}

/// `Gone` unless frames after `after` are all kept (the rule every store's
/// read and read_chain apply).
pub fn check_kept(session: &SessionId, cut: Option<&LogCut>, after: u64) -> Result<()> {
    match cut {
        Some(cut) if after < cut.through => Err(trimmed_error(session, cut, after)),
        _ => Ok(()),
    }
}

/// Whether trimming `info`'s log through `through` removes anything:
/// `InvalidInput` for a cut that would leave no frame (or is 0), `false`
/// for one at or before the current cut.
pub fn check_trim(info: &LogInfo, through: u64) -> Result<bool> {
    if through == 0 || through >= info.last_seq {
        return Err(Error::invalid(format!(
            "cannot trim session {} through seq {through}: it holds frames up to {}, \
             and trimming keeps at least the newest one (give 1..={})",
            info.session,
            info.last_seq,
            info.last_seq.saturating_sub(1)
        )));
    }
    Ok(info.trimmed.is_none_or(|cut| through > cut.through))
}

/// A log's metadata.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LogInfo {
    /// The session.
    pub session: SessionId,
    /// Seq of the last frame (0 when empty).
    pub last_seq: u64,
    /// When the last frame was stored (ms since the epoch; 0 when empty or
    /// when the log keeps no clock): the session's last activity.
    #[serde(default)]
    pub last_at_ms: u64,
    /// Whether the log is sealed.
    pub sealed: bool,
    /// Set when the log was made by `fork`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub forked_from: Option<ForkOrigin>,
    /// What the frames say about the session now (config, runner
    /// generation, latest turn, sandbox).
    #[serde(default)]
    pub meta: SessionMeta,
    /// Set once retention trimmed the log's start: the first kept frame is
    /// `through + 1`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trimmed: Option<LogCut>,
}

impl LogInfo {
    /// The cursor a read of everything the log keeps starts after: 0, or
    /// the last seq retention trimmed ([`LogCut::through`]).
    pub fn kept_after(&self) -> u64 {
        self.trimmed.map_or(0, |cut| cut.through)
    }

    /// Where a reader that asks for the frames after `after` starts: one
    /// from the start (0) of a trimmed log at its cut; one resuming from
    /// inside the cut is told those frames are gone ([`check_kept`]). The
    /// rule of every server's event streams.
    pub fn reader_start(&self, after: u64) -> Result<u64> {
        if after == 0 {
            return Ok(self.kept_after());
        }
        check_kept(&self.session, self.trimmed.as_ref(), after)?;
        Ok(after)
    }
}

/// An append-only, seq-numbered log per session.
#[cfg_attr(not(target_arch = "wasm32"), async_trait)]
#[cfg_attr(target_arch = "wasm32", async_trait(?Send))]
pub trait SessionLog: MaybeSend + MaybeSync + std::fmt::Debug {
    /// Create an empty log with no configuration (the defaults apply);
    /// creating an existing one returns its info.
    async fn create(&self, session: &SessionId) -> Result<LogInfo> {
        self.create_with(session, None).await
    }

    /// Create an empty log for a session configured with `config`;
    /// creating an existing one returns its info unchanged.
    async fn create_with(
        &self,
        session: &SessionId,
        config: Option<SessionConfig>,
    ) -> Result<LogInfo>;

    /// Metadata. `NotFound` for an unknown session.
    async fn info(&self, session: &SessionId) -> Result<LogInfo>;

    /// Append one frame; the log assigns its seq.
    async fn append(&self, session: &SessionId, request: AppendRequest) -> Result<Appended>;

    /// Append one frame into a *group* of appends committed together (group
    /// commit): the answer is the frame as it will be stored and the group
    /// it joined, but it is durable — and may be acknowledged or shown to
    /// anyone — only once [`commit_group`](Self::commit_group) for that
    /// group returned `Ok`. If the group's commit fails, none of its frames
    /// is stored. Later appends see the earlier ones of an open group (seq,
    /// keys, seal). The default appends durably at once (group 0).
    async fn append_grouped(
        &self,
        session: &SessionId,
        request: AppendRequest,
    ) -> Result<(Appended, u64)> {
        Ok((self.append(session, request).await?, 0))
    }

    /// Make `group` durable (commit it if it is still open); `Err` when its
    /// commit failed, i.e. none of its frames is stored. Called by the
    /// appender of `session` that joined the group.
    async fn commit_group(&self, session: &SessionId, group: u64) -> Result<()> {
        let _ = (session, group);
        Ok(())
    }

    /// Frames with `seq > after`, at most `limit` of them, in order.
    async fn read(&self, session: &SessionId, after: u64, limit: usize) -> Result<Vec<Frame>>;

    /// Frames with `seq > after` as the audit chain sees them (the body
    /// as stored, the key, the stored hash): what [`verify_log`] and an
    /// export read. `Unsupported` by default, for a store that keeps no
    /// chain.
    async fn read_chain(
        &self,
        session: &SessionId,
        after: u64,
        limit: usize,
    ) -> Result<Vec<ChainedFrame>> {
        let _ = (session, after, limit);
        Err(Error::unsupported("this session log keeps no audit chain"))
    }

    /// Frames across every session that match `query`
    /// ([`search`](crate::search): the index each store keeps with its
    /// appends), best first. `Unsupported` by default, for a store that
    /// keeps no index.
    async fn search(
        &self,
        query: &crate::search::SearchQuery,
    ) -> Result<Vec<crate::search::SearchHit>> {
        let _ = query;
        Err(Error::unsupported("this session log keeps no search index"))
    }

    /// Seal the log (see the module docs).
    async fn seal(&self, session: &SessionId) -> Result<LogInfo>;

    /// Remove `session`'s log (see the module docs). `Unsupported` by
    /// default.
    async fn delete(&self, session: &SessionId) -> Result<()> {
        let _ = session;
        Err(Error::unsupported(
            "this session log cannot delete sessions",
        ))
    }

    /// Remove frames `1..=through` of `session` ([`check_trim`]; see the
    /// module docs). `Unsupported` by default.
    async fn trim(&self, session: &SessionId, through: u64) -> Result<LogInfo> {
        let _ = (session, through);
        Err(Error::unsupported("this session log cannot trim sessions"))
    }

    /// Copy frames `1..=until` into a new log `target` (plus
    /// [`fork_closing_frame`] when they leave a turn open).
    async fn fork(&self, source: &SessionId, until: u64, target: &SessionId) -> Result<LogInfo>;

    /// Every log, sorted by session id.
    async fn list(&self) -> Result<Vec<LogInfo>>;

    /// At most `limit` logs whose session id sorts after `after` (from the
    /// first without it), sorted by session id: one page of
    /// [`list`](Self::list). By default a filter of `list`; a store that
    /// can seek (an index on the id) reads only the page.
    async fn list_page(&self, after: Option<&SessionId>, limit: usize) -> Result<Vec<LogInfo>> {
        Ok(self
            .list()
            .await?
            .into_iter()
            .filter(|info| after.is_none_or(|a| info.session.as_str() > a.as_str()))
            .take(limit)
            .collect())
    }
}

/// One session's log: everything a session actor reads and writes. A
/// Durable Object, which holds exactly one session, implements this over
/// its own storage; natively [`LogSession`] adapts any [`SessionLog`].
#[cfg_attr(not(target_arch = "wasm32"), async_trait)]
#[cfg_attr(target_arch = "wasm32", async_trait(?Send))]
pub trait SessionStore: MaybeSend + MaybeSync + std::fmt::Debug {
    /// The session.
    fn session(&self) -> &SessionId;
    /// Metadata, including the folded [`SessionMeta`]. `NotFound` when the
    /// session does not exist.
    async fn info(&self) -> Result<LogInfo>;
    /// Append one frame; the log assigns its seq and answers with the frame
    /// as stored.
    async fn append(&self, request: AppendRequest) -> Result<Appended>;
    /// Append into a group committed later ([`SessionLog::append_grouped`]).
    /// The default appends durably at once (group 0).
    async fn append_grouped(&self, request: AppendRequest) -> Result<(Appended, u64)> {
        Ok((self.append(request).await?, 0))
    }
    /// Make `group` durable ([`SessionLog::commit_group`]).
    async fn commit_group(&self, group: u64) -> Result<()> {
        let _ = group;
        Ok(())
    }
    /// Frames with `seq > after`, at most `limit` of them, in order.
    async fn read(&self, after: u64, limit: usize) -> Result<Vec<Frame>>;
    /// Frames with `seq > after` as the audit chain sees them
    /// ([`SessionLog::read_chain`]).
    async fn read_chain(&self, after: u64, limit: usize) -> Result<Vec<ChainedFrame>> {
        let _ = (after, limit);
        Err(Error::unsupported(
            "this session store keeps no audit chain",
        ))
    }
}

/// Frames [`verify_log`] reads at a time.
const VERIFY_PAGE: usize = 1000;

/// Walk `store`'s whole chain with `key` ([`chain`]'s rules), one page at a
/// time.
pub async fn verify_store(store: &dyn SessionStore, key: &ChainKey) -> Result<ChainReport> {
    walk_store(store, chain::ChainVerifier::new(key.clone())).await
}

/// Feed `store`'s whole chain to `walk`, one page at a time, and report.
pub async fn walk_store(
    store: &dyn SessionStore,
    mut walk: chain::ChainVerifier,
) -> Result<ChainReport> {
    let info = store.info().await?;
    let mut after = 0;
    if let Some(cut) = &info.trimmed {
        walk = walk.from_cut(cut);
        after = cut.through;
    }
    loop {
        let page = store.read_chain(after, VERIFY_PAGE).await?;
        let Some(last) = page.last() else { break };
        after = last.seq;
        for frame in &page {
            walk.push(frame);
        }
        if walk.broken() || page.len() < VERIFY_PAGE {
            break;
        }
    }
    Ok(walk.finish(info.last_seq))
}

/// [`verify_store`] for one session of a [`SessionLog`].
pub async fn verify_log(
    log: Arc<dyn SessionLog>,
    session: &SessionId,
    key: &ChainKey,
) -> Result<ChainReport> {
    verify_store(&LogSession::new(log, session.clone()), key).await
}

/// One session of a [`SessionLog`], as a [`SessionStore`].
#[derive(Debug, Clone)]
pub struct LogSession {
    log: Arc<dyn SessionLog>,
    session: SessionId,
}

impl LogSession {
    /// `session` of `log`.
    pub fn new(log: Arc<dyn SessionLog>, session: SessionId) -> Self {
        Self { log, session }
    }
}

#[cfg_attr(not(target_arch = "wasm32"), async_trait)]
#[cfg_attr(target_arch = "wasm32", async_trait(?Send))]
impl SessionStore for LogSession {
    fn session(&self) -> &SessionId {
        &self.session
    }
    async fn info(&self) -> Result<LogInfo> {
        self.log.info(&self.session).await
    }
    async fn append(&self, request: AppendRequest) -> Result<Appended> {
        self.log.append(&self.session, request).await
    }
    async fn append_grouped(&self, request: AppendRequest) -> Result<(Appended, u64)> {
        self.log.append_grouped(&self.session, request).await
    }
    async fn commit_group(&self, group: u64) -> Result<()> {
        self.log.commit_group(&self.session, group).await
    }
    async fn read(&self, after: u64, limit: usize) -> Result<Vec<Frame>> {
        self.log.read(&self.session, after, limit).await
    }
    async fn read_chain(&self, after: u64, limit: usize) -> Result<Vec<ChainedFrame>> {
        self.log.read_chain(&self.session, after, limit).await
    }
}

/// Fold frames into the meta of a session configured with `config` (used
/// when a log's meta must be rebuilt: a fork, or a database written before
/// meta was stored).
pub fn fold_meta<'a>(
    config: Option<SessionConfig>,
    frames: impl IntoIterator<Item = (u64, &'a FrameBody, Option<&'a str>)>,
) -> SessionMeta {
    let mut meta = SessionMeta::new(config);
    for (seq, body, key) in frames {
        meta.apply(seq, body, key);
    }
    meta
}

/// Validate an append whose body encodes to `len` bytes: size and key
/// limits ([`CheckedAppend::new`] runs it).
pub(crate) fn check_append(
    request: &AppendRequest,
    len: usize,
    max_frame_bytes: usize,
) -> Result<()> {
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

/// The frame a fork appends after its copied prefix when the prefix leaves
/// a turn open: a terminal `turn-status` (failed, saying why) for it.
/// Without it the fork would refuse every prompt (a turn "is still
/// running") and a runtime resuming open turns would run the copied prompt
/// again, in the source's sandbox. `None` when the prefix ends between
/// turns or is sealed.
pub fn fork_closing_frame(
    meta: &SessionMeta,
    sealed: bool,
    source: &SessionId,
    until: u64,
) -> Option<AppendRequest> {
    if sealed {
        return None;
    }
    let turn = meta.active_turn()?;
    Some(AppendRequest::new(FrameBody::TurnStatus {
        turn_id: turn.turn_id.clone(),
        status: crate::turn::TurnStatus::Failed,
        error: Some(format!(
            "forked from {source} at seq {until}, before this turn ended: it does not run in the fork"
        )),
        code: None,
        sandbox: None,
        agent_session_id: None,
        checkpoint: None,
    }))
}

/// One log's state, with the rules applied on plain data.
#[derive(Debug, Clone)]
pub struct LogState {
    session: SessionId,
    frames: Vec<Frame>,
    keys: HashMap<String, u64>,
    sealed: bool,
    forked_from: Option<ForkOrigin>,
    meta: SessionMeta,
    /// The key frames are chained with, and each frame's hash.
    chain_key: ChainKey,
    hashes: Vec<Option<FrameHash>>,
    /// Frames before `frames[0]` that retention removed, and the meta
    /// folded through them (what a fork past the cut starts from).
    cut: Option<(LogCut, SessionMeta)>,
}

impl LogState {
    /// An empty log.
    pub fn new(session: SessionId) -> Self {
        Self::with_config(session, None)
    }

    /// An empty log of a session configured with `config`.
    pub fn with_config(session: SessionId, config: Option<SessionConfig>) -> Self {
        Self {
            session,
            frames: Vec::new(),
            keys: HashMap::new(),
            sealed: false,
            forked_from: None,
            meta: SessionMeta::new(config),
            chain_key: ChainKey::unkeyed(),
            hashes: Vec::new(),
            cut: None,
        }
    }

    /// How many frames retention removed from the start.
    fn offset(&self) -> u64 {
        self.cut.as_ref().map_or(0, |(c, _)| c.through)
    }

    /// The meta folded through frame `until` (at or past the cut).
    fn meta_through(&self, until: u64) -> SessionMeta {
        let mut meta = match &self.cut {
            Some((_, meta)) => meta.clone(),
            None => SessionMeta::new(self.meta.config.clone()),
        };
        let key_of: HashMap<u64, &str> = self.keys.iter().map(|(k, &s)| (s, k.as_str())).collect();
        for f in &self.frames[..(until - self.offset()) as usize] {
            meta.apply(f.seq, &f.body, key_of.get(&f.seq).copied());
        }
        meta
    }

    /// The index in `frames` of the first frame after `after` (`Gone`
    /// inside the cut).
    fn start_after(&self, after: u64) -> Result<usize> {
        check_kept(&self.session, self.cut.as_ref().map(|(c, _)| c), after)?;
        Ok(((after - self.offset()) as usize).min(self.frames.len()))
    }

    /// Remove frames `1..=through` ([`check_trim`]'s rules).
    pub fn trim(&mut self, through: u64) -> Result<LogInfo> {
        if check_trim(&self.info(), through)? {
            let meta = self.meta_through(through);
            let n = (through - self.offset()) as usize;
            let hash = self.hashes[n - 1];
            self.frames.drain(..n);
            self.hashes.drain(..n);
            self.keys.retain(|_, &mut seq| seq > through);
            self.cut = Some((LogCut { through, hash }, meta));
        }
        Ok(self.info())
    }

    /// Chain frames appended from now on with `key` (unkeyed by default).
    pub fn with_chain_key(mut self, key: ChainKey) -> Self {
        self.chain_key = key;
        self
    }

    /// Metadata.
    pub fn info(&self) -> LogInfo {
        LogInfo {
            session: self.session.clone(),
            last_seq: self.offset() + self.frames.len() as u64,
            last_at_ms: self.frames.last().map_or(0, |f| f.at_ms),
            sealed: self.sealed,
            forked_from: self.forked_from.clone(),
            meta: self.meta.clone(),
            trimmed: self.cut.as_ref().map(|(c, _)| *c),
        }
    }

    /// Apply an append at time `now_ms` ([`plan_append`]'s rules).
    pub fn append(
        &mut self,
        request: AppendRequest,
        now_ms: u64,
        max_frame_bytes: usize,
    ) -> Result<Appended> {
        let checked = CheckedAppend::new(request, max_frame_bytes)?;
        let chain_key = self.chain_key.clone();
        match plan_append(self, checked, now_ms, &chain_key)? {
            AppendPlan::Duplicate(appended) => Ok(appended),
            AppendPlan::Write(new) => {
                let appended = new.appended();
                self.sealed |= new.seals;
                if let Some(meta) = new.meta {
                    self.meta = meta;
                }
                if let Some(key) = new.key {
                    self.keys.insert(key, new.frame.seq);
                }
                self.frames.push(new.frame);
                self.hashes.push(new.hash);
                Ok(appended)
            }
        }
    }

    /// Frames after `after` (`Gone` inside the cut).
    pub fn read(&self, after: u64, limit: usize) -> Result<Vec<Frame>> {
        let start = self.start_after(after)?;
        Ok(self.frames[start..].iter().take(limit).cloned().collect())
    }

    /// Frames after `after` as the audit chain sees them (bodies encoded
    /// as they were when appended: the encoding is deterministic).
    pub fn read_chain(&self, after: u64, limit: usize) -> Result<Vec<ChainedFrame>> {
        let start = self.start_after(after)?;
        let key_of: HashMap<u64, &str> = self.keys.iter().map(|(k, &s)| (s, k.as_str())).collect();
        self.frames[start..]
            .iter()
            .zip(&self.hashes[start..])
            .take(limit)
            .map(|(f, h)| {
                Ok(ChainedFrame {
                    seq: f.seq,
                    at_ms: f.at_ms,
                    key: key_of.get(&f.seq).map(|k| k.to_string()),
                    body: serde_json::to_string(&f.body)?,
                    hash: *h,
                })
            })
            .collect()
    }

    /// Seal (idempotent).
    pub fn seal(&mut self, now_ms: u64) -> LogInfo {
        if !self.sealed {
            self.append(AppendRequest::new(FrameBody::Sealed {}), now_ms, usize::MAX)
                .expect("an unsealed log accepts a seal frame");
        }
        self.info()
    }

    /// A new log holding frames `1..=until` (and, when they leave a turn
    /// open, [`fork_closing_frame`] stamped `now_ms`).
    pub fn fork(&self, until: u64, target: SessionId, now_ms: u64) -> Result<LogState> {
        let last = self.info().last_seq;
        if until > last {
            return Err(fork_range_error(&self.session, until, last));
        }
        check_fork_kept(&self.session, self.cut.as_ref().map(|(c, _)| c), until)?;
        let copied = (until - self.offset()) as usize;
        let frames: Vec<Frame> = self.frames[..copied].to_vec();
        let keys = self
            .keys
            .iter()
            .filter(|(_, &s)| s <= until)
            .map(|(k, &s)| (k.clone(), s))
            .collect();
        let sealed = frames
            .iter()
            .any(|f| matches!(f.body, FrameBody::Sealed {}));
        let meta = self.meta_through(until);
        let closing = fork_closing_frame(&meta, sealed, &self.session, until);
        let mut forked = LogState {
            session: target,
            frames,
            keys,
            sealed,
            forked_from: Some(ForkOrigin {
                session: self.session.clone(),
                until,
            }),
            meta,
            chain_key: self.chain_key.clone(),
            hashes: self.hashes[..copied].to_vec(),
            cut: self.cut.clone(),
        };
        if let Some(closing) = closing {
            forked.append(closing, now_ms, usize::MAX)?;
        }
        Ok(forked)
    }
}

impl AppendView for LogState {
    fn session(&self) -> &SessionId {
        &self.session
    }

    fn head(&mut self) -> Result<LogHead> {
        Ok(LogHead {
            last_seq: self.info().last_seq,
            sealed: self.sealed,
            last_hash: self.hashes.last().copied().flatten(),
        })
    }

    fn frame_by_key(&mut self, key: &str) -> Result<Option<Frame>> {
        Ok(self
            .keys
            .get(key)
            .map(|&seq| self.frames[(seq - self.offset() - 1) as usize].clone()))
    }

    fn meta(&mut self) -> Result<SessionMeta> {
        Ok(self.meta.clone())
    }
}

/// An in-memory [`SessionLog`] for tests and single-process use. Frames
/// are stamped with the clock given to [`MemorySessionLog::with_clock`]
/// (none by default: `at_ms` is then 0).
#[derive(Debug, Clone)]
pub struct MemorySessionLog {
    logs: Arc<Mutex<BTreeMap<SessionId, LogState>>>,
    max_frame_bytes: usize,
    clock: Option<Arc<dyn Clock>>,
    chain_key: ChainKey,
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
            clock: None,
            chain_key: ChainKey::unkeyed(),
        }
    }

    /// Chain the frames of logs created from now on with `key`.
    pub fn with_chain_key(mut self, key: ChainKey) -> Self {
        self.chain_key = key;
        self
    }

    /// Stamp frames with `clock`.
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = Some(clock);
        self
    }

    fn now_ms(&self) -> u64 {
        self.clock.as_ref().map_or(0, |c| c.now_ms())
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

/// A stored frame body read back (the JSON text a store keeps): `Corrupt`
/// naming the frame when it does not decode.
pub fn decode_stored_body(json: &str, session: &SessionId, seq: i64) -> Result<FrameBody> {
    serde_json::from_str(json).map_err(|e| {
        Error::corrupt(format!(
            "frame {seq} of session {session} holds unreadable JSON: {e}"
        ))
    })
}

/// A stored meta read back: `Corrupt` naming the session when it does not
/// decode.
pub fn decode_stored_meta(json: &str, session: &SessionId) -> Result<SessionMeta> {
    serde_json::from_str(json)
        .map_err(|e| Error::corrupt(format!("the meta of session {session} is unreadable: {e}")))
}

/// `Gone` for a fork at or before `session`'s cut (its frames are gone).
pub fn check_fork_kept(session: &SessionId, cut: Option<&LogCut>, until: u64) -> Result<()> {
    match cut {
        Some(cut) if until <= cut.through => Err(Error::gone(format!(
            "cannot fork session {session} at seq {until}: frames 1..={} were removed by \
             retention (fork at {} or later)",
            cut.through,
            cut.through + 1
        ))),
        _ => Ok(()),
    }
}

/// Whether a fork of `source` up to `until` is sealed (the seal frame is
/// always the last one, so exactly when the copy includes it), after the
/// range check every log makes.
pub fn fork_copy_sealed(source: &LogInfo, until: u64) -> Result<bool> {
    if until > source.last_seq {
        return Err(fork_range_error(&source.session, until, source.last_seq));
    }
    Ok(source.sealed && until == source.last_seq)
}

#[cfg_attr(not(target_arch = "wasm32"), async_trait)]
#[cfg_attr(target_arch = "wasm32", async_trait(?Send))]
impl SessionLog for MemorySessionLog {
    async fn create_with(
        &self,
        session: &SessionId,
        config: Option<SessionConfig>,
    ) -> Result<LogInfo> {
        let mut logs = self.logs.lock().unwrap_or_else(|e| e.into_inner());
        Ok(logs
            .entry(session.clone())
            .or_insert_with(|| {
                LogState::with_config(session.clone(), config)
                    .with_chain_key(self.chain_key.clone())
            })
            .info())
    }

    async fn info(&self, session: &SessionId) -> Result<LogInfo> {
        self.with_log(session, |log| Ok(log.info()))
    }

    async fn append(&self, session: &SessionId, request: AppendRequest) -> Result<Appended> {
        let (max, now) = (self.max_frame_bytes, self.now_ms());
        self.with_log(session, |log| log.append(request, now, max))
    }

    async fn read(&self, session: &SessionId, after: u64, limit: usize) -> Result<Vec<Frame>> {
        self.with_log(session, |log| log.read(after, limit))
    }

    async fn read_chain(
        &self,
        session: &SessionId,
        after: u64,
        limit: usize,
    ) -> Result<Vec<ChainedFrame>> {
        self.with_log(session, |log| log.read_chain(after, limit))
    }

    async fn seal(&self, session: &SessionId) -> Result<LogInfo> {
        let now = self.now_ms();
        self.with_log(session, |log| Ok(log.seal(now)))
    }

    async fn delete(&self, session: &SessionId) -> Result<()> {
        let mut logs = self.logs.lock().unwrap_or_else(|e| e.into_inner());
        logs.remove(session)
            .map(|_| ())
            .ok_or_else(|| unknown_session(session))
    }

    async fn trim(&self, session: &SessionId, through: u64) -> Result<LogInfo> {
        self.with_log(session, |log| log.trim(through))
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
            .fork(until, target.clone(), self.now_ms())?;
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

    async fn list_page(&self, after: Option<&SessionId>, limit: usize) -> Result<Vec<LogInfo>> {
        use std::ops::Bound;
        let logs = self.logs.lock().unwrap_or_else(|e| e.into_inner());
        let from = after.map_or(Bound::Unbounded, Bound::Excluded);
        Ok(logs
            .range::<SessionId, _>((from, Bound::Unbounded))
            .take(limit)
            .map(|(_, log)| log.info())
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `state` with `n` prompts more ("prompt 0", "prompt 1", …).
    fn with_prompts(mut state: LogState, n: u64) -> LogState {
        for i in 0..n {
            let body = FrameBody::UserMessage {
                text: format!("prompt {i}"),
                turn_id: None,
            };
            state
                .append(AppendRequest::new(body), i, usize::MAX)
                .unwrap();
        }
        state
    }

    /// A log of `n` prompts.
    fn log_of(n: u64) -> LogState {
        with_prompts(LogState::new(SessionId::parse("trim-rules").unwrap()), n)
    }

    /// A log with only the required methods: what every default gives a
    /// store that does not override it. Appends answer with a recorded
    /// call; `list` holds three sessions.
    #[derive(Debug, Default)]
    struct Bare {
        created_with: Mutex<Vec<String>>,
    }

    /// A log whose group commits fail: what [`LogSession`] must pass on.
    #[derive(Debug, Default)]
    struct FailingCommits(Bare);

    fn bare() -> Error {
        Error::invalid("not in the bare log")
    }

    fn info_of(id: &str) -> LogInfo {
        LogState::new(SessionId::parse(id).unwrap()).info()
    }

    #[async_trait]
    impl SessionLog for Bare {
        async fn create_with(
            &self,
            session: &SessionId,
            _config: Option<SessionConfig>,
        ) -> Result<LogInfo> {
            self.created_with.lock().unwrap().push(session.to_string());
            Ok(info_of(session.as_str()))
        }
        async fn info(&self, _: &SessionId) -> Result<LogInfo> {
            Err(bare())
        }
        async fn append(&self, session: &SessionId, request: AppendRequest) -> Result<Appended> {
            let mut state = LogState::new(session.clone());
            state.append(request, 7, usize::MAX)
        }
        async fn read(&self, _: &SessionId, _: u64, _: usize) -> Result<Vec<Frame>> {
            Err(bare())
        }
        async fn seal(&self, _: &SessionId) -> Result<LogInfo> {
            Err(bare())
        }
        async fn fork(&self, _: &SessionId, _: u64, _: &SessionId) -> Result<LogInfo> {
            Err(bare())
        }
        async fn list(&self) -> Result<Vec<LogInfo>> {
            Ok(["a", "b", "c"].into_iter().map(info_of).collect())
        }
    }

    #[async_trait]
    impl SessionLog for FailingCommits {
        async fn create_with(&self, s: &SessionId, c: Option<SessionConfig>) -> Result<LogInfo> {
            self.0.create_with(s, c).await
        }
        async fn info(&self, s: &SessionId) -> Result<LogInfo> {
            self.0.info(s).await
        }
        async fn append(&self, s: &SessionId, request: AppendRequest) -> Result<Appended> {
            self.0.append(s, request).await
        }
        async fn commit_group(&self, _: &SessionId, group: u64) -> Result<()> {
            Err(Error::conflict(format!("group {group} failed")))
        }
        async fn read(&self, s: &SessionId, after: u64, limit: usize) -> Result<Vec<Frame>> {
            self.0.read(s, after, limit).await
        }
        async fn seal(&self, s: &SessionId) -> Result<LogInfo> {
            self.0.seal(s).await
        }
        async fn fork(&self, s: &SessionId, until: u64, t: &SessionId) -> Result<LogInfo> {
            self.0.fork(s, until, t).await
        }
        async fn list(&self) -> Result<Vec<LogInfo>> {
            self.0.list().await
        }
    }

    #[test]
    fn a_session_of_a_log_passes_a_failed_group_commit_on() {
        let log: Arc<dyn SessionLog> = Arc::new(FailingCommits::default());
        let session = LogSession::new(log, SessionId::parse("s").unwrap());
        let e = futures::executor::block_on(session.commit_group(3)).unwrap_err();
        assert_eq!(e.message(), "group 3 failed");
    }

    #[test]
    fn an_idempotency_key_is_1_to_256_bytes() {
        let append = |key: String| {
            let body = FrameBody::UserMessage {
                text: "hi".into(),
                turn_id: None,
            };
            check_append(&AppendRequest::idempotent(body, key), 10, 100)
        };
        append("k".repeat(MAX_IDEMPOTENCY_KEY_LEN)).unwrap();
        append("k".into()).unwrap();
        for key in [String::new(), "k".repeat(MAX_IDEMPOTENCY_KEY_LEN + 1)] {
            let e = append(key).unwrap_err();
            assert_eq!(e.kind(), crate::ErrorKind::InvalidInput, "{e}");
        }
        assert_eq!(MAX_IDEMPOTENCY_KEY_LEN, 256);
    }

    #[test]
    fn a_log_without_its_own_methods_gets_the_defaults() {
        use futures::executor::block_on;
        let log = Bare::default();
        let id = SessionId::parse("s").unwrap();
        let unsupported = |r: Result<()>| {
            let e = r.unwrap_err();
            assert_eq!(e.kind(), crate::ErrorKind::Unsupported, "{e}");
        };
        // What a store keeps only if it says so.
        unsupported(block_on(log.read_chain(&id, 0, 10)).map(drop));
        unsupported(block_on(log.search(&crate::search::SearchQuery::new("x"))).map(drop));
        unsupported(block_on(log.delete(&id)));
        unsupported(block_on(log.trim(&id, 1)).map(drop));
        // `create` is `create_with` no configuration.
        assert_eq!(block_on(log.create(&id)).unwrap().session, id);
        assert_eq!(*log.created_with.lock().unwrap(), ["s"]);
        // A grouped append is an append, durable at once (group 0).
        let body = FrameBody::UserMessage {
            text: "hi".into(),
            turn_id: None,
        };
        let (appended, group) =
            block_on(log.append_grouped(&id, AppendRequest::new(body))).unwrap();
        assert_eq!((appended.frame.seq, group), (1, 0));
        block_on(log.commit_group(&id, group)).unwrap();
        // A page of `list`: after a session (not with it), at most `limit`.
        let page = |after: Option<&str>, limit| {
            let after = after.map(|a| SessionId::parse(a).unwrap());
            block_on(log.list_page(after.as_ref(), limit))
                .unwrap()
                .into_iter()
                .map(|i| i.session.to_string())
                .collect::<Vec<_>>()
        };
        assert_eq!(page(None, 2), ["a", "b"]);
        assert_eq!(page(Some("a"), 10), ["b", "c"]);
        assert_eq!(page(Some("b"), 1), ["c"]);
        assert!(page(Some("c"), 10).is_empty());
    }

    /// One session's store with only the required methods.
    #[derive(Debug)]
    struct BareStore(SessionId);

    #[async_trait]
    impl SessionStore for BareStore {
        fn session(&self) -> &SessionId {
            &self.0
        }
        async fn info(&self) -> Result<LogInfo> {
            Err(bare())
        }
        async fn append(&self, request: AppendRequest) -> Result<Appended> {
            LogState::new(self.0.clone()).append(request, 7, usize::MAX)
        }
        async fn read(&self, _: u64, _: usize) -> Result<Vec<Frame>> {
            Err(bare())
        }
    }

    #[test]
    fn a_store_without_its_own_methods_gets_the_defaults() {
        use futures::executor::block_on;
        let store = BareStore(SessionId::parse("s").unwrap());
        let e = block_on(store.read_chain(0, 10)).unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::Unsupported, "{e}");
        let body = FrameBody::UserMessage {
            text: "hi".into(),
            turn_id: None,
        };
        let (appended, group) = block_on(store.append_grouped(AppendRequest::new(body))).unwrap();
        assert_eq!((appended.frame.seq, group), (1, 0));
        block_on(store.commit_group(group)).unwrap();
    }

    /// A chained log whose frame 2 reads back altered (when `tampered`),
    /// counting the pages it is asked for.
    #[derive(Debug)]
    struct Tampered {
        state: LogState,
        tampered: bool,
        pages: Mutex<usize>,
    }

    #[async_trait]
    impl SessionStore for Tampered {
        fn session(&self) -> &SessionId {
            &self.state.session
        }
        async fn info(&self) -> Result<LogInfo> {
            Ok(self.state.info())
        }
        async fn append(&self, _: AppendRequest) -> Result<Appended> {
            Err(bare())
        }
        async fn read(&self, _: u64, _: usize) -> Result<Vec<Frame>> {
            Err(bare())
        }
        async fn read_chain(&self, after: u64, limit: usize) -> Result<Vec<ChainedFrame>> {
            *self.pages.lock().unwrap() += 1;
            let mut page = self.state.read_chain(after, limit)?;
            for frame in page.iter_mut().filter(|f| self.tampered && f.seq == 2) {
                frame.body = frame.body.replace("prompt 1", "prompt X");
            }
            Ok(page)
        }
    }

    #[test]
    fn a_verification_reads_every_page_and_stops_at_the_first_break() {
        let key = ChainKey::new(b"test key".to_vec());
        let frames = VERIFY_PAGE as u64 + 500;
        let store = |tampered| {
            let session = SessionId::parse("tampered").unwrap();
            let state = with_prompts(LogState::new(session).with_chain_key(key.clone()), frames);
            Tampered {
                state,
                tampered,
                pages: Mutex::new(0),
            }
        };
        let verify =
            |store: &Tampered| futures::executor::block_on(verify_store(store, &key)).unwrap();
        // Intact: every page read, every frame walked.
        let intact = store(false);
        let report = verify(&intact);
        assert_eq!(
            (report.frames, report.broken.is_none()),
            (frames, true),
            "{report:?}"
        );
        assert_eq!(*intact.pages.lock().unwrap(), 2);
        // Broken on the first page: nothing past it is read.
        let tampered = store(true);
        let report = verify(&tampered);
        assert!(report.broken.is_some(), "{report:?}");
        assert_eq!(
            *tampered.pages.lock().unwrap(),
            1,
            "pages read past the break"
        );
    }

    #[test]
    fn a_fork_of_a_trimmed_log_folds_the_meta_through_its_point() {
        let mut state = log_of(10);
        state.trim(3).unwrap();
        let fork = state.fork(6, SessionId::parse("f").unwrap(), 0).unwrap();
        let meta = fork.info().meta;
        assert_eq!(meta.turns, 6);
        assert_eq!(meta.turn.map(|t| t.prompt), Some("prompt 5".to_string()));
        // A second trim folds from the first cut on.
        state.trim(5).unwrap();
        let fork = state.fork(8, SessionId::parse("g").unwrap(), 0).unwrap();
        assert_eq!(fork.info().meta.turns, 8);
    }

    #[test]
    fn a_cut_keeps_its_frames_hash_and_forgets_its_keys() {
        let key = ChainKey::new(b"test key".to_vec());
        let mut state = LogState::new(SessionId::parse("keyed").unwrap()).with_chain_key(key);
        let prompt = |i: u64| FrameBody::UserMessage {
            text: format!("prompt {i}"),
            turn_id: None,
        };
        for i in 1..=5 {
            let request = AppendRequest::idempotent(prompt(i), format!("k{i}"));
            state.append(request, i, usize::MAX).unwrap();
        }
        let third = state.read_chain(2, 1).unwrap()[0].hash;
        assert!(third.is_some());
        let info = state.trim(3).unwrap();
        // The chain goes on from frame 3's hash.
        assert_eq!(info.trimmed.map(|c| (c.through, c.hash)), Some((3, third)));
        // A key of a kept frame still answers with its frame …
        let again = state
            .append(AppendRequest::idempotent(prompt(4), "k4"), 9, usize::MAX)
            .unwrap();
        assert_eq!((again.duplicate, again.seq), (true, 4));
        // … one of a removed frame has no frame to answer with: forgotten.
        let again = state
            .append(AppendRequest::idempotent(prompt(3), "k3"), 9, usize::MAX)
            .unwrap();
        assert_eq!((again.duplicate, again.seq), (false, 6));
    }

    #[test]
    fn the_memory_log_takes_its_clock_key_and_frame_limit() {
        use futures::executor::block_on;
        let key = ChainKey::new(b"memory key".to_vec());
        let log = MemorySessionLog::new()
            .with_clock(Arc::new(crate::clock::ManualClock::at(42_000)))
            .with_chain_key(key.clone())
            .with_max_frame_bytes(200);
        let id = SessionId::parse("m").unwrap();
        block_on(log.create(&id)).unwrap();
        let prompt = |text: String| {
            AppendRequest::new(FrameBody::UserMessage {
                text,
                turn_id: None,
            })
        };
        let appended = block_on(log.append(&id, prompt("hi".into()))).unwrap();
        // Stamped by its clock.
        assert_eq!(appended.frame.at_ms, 42_000);
        assert_eq!(block_on(log.info(&id)).unwrap().last_at_ms, 42_000);
        // Chained with its key: the other key finds the chain broken.
        let log: Arc<dyn SessionLog> = Arc::new(log);
        let own = block_on(verify_log(log.clone(), &id, &key)).unwrap();
        assert!(own.broken.is_none() && own.head.is_some(), "{own:?}");
        let other = ChainKey::new(b"another key".to_vec());
        let report = block_on(verify_log(log.clone(), &id, &other)).unwrap();
        assert!(report.broken.is_some(), "{report:?}");
        // Held to its frame limit.
        let e = block_on(log.append(&id, prompt("x".repeat(300)))).unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::InvalidInput, "{e}");
        // The default limit is 1 MiB: half of it passes.
        let roomy = MemorySessionLog::new();
        block_on(roomy.create(&id)).unwrap();
        block_on(roomy.append(&id, prompt("x".repeat(512 * 1024)))).unwrap();
        // Deleted, it is gone; deleting it again says so.
        block_on(log.delete(&id)).unwrap();
        for e in [
            block_on(log.info(&id)).unwrap_err(),
            block_on(log.delete(&id)).unwrap_err(),
        ] {
            assert_eq!(e.kind(), crate::ErrorKind::NotFound, "{e}");
        }
    }

    #[test]
    fn a_trim_removes_something_only_past_the_cut() {
        let mut state = log_of(5);
        assert!(check_trim(&state.info(), 2).unwrap());
        state.trim(2).unwrap();
        let info = state.info();
        // At or before the cut: nothing left to remove there.
        assert!(!check_trim(&info, 1).unwrap());
        assert!(!check_trim(&info, 2).unwrap());
        assert!(check_trim(&info, 3).unwrap());
        // The newest frame stays; 0 is no cut.
        for through in [0, 5, 6] {
            let err = check_trim(&info, through).unwrap_err();
            assert_eq!(
                err.kind(),
                crate::ErrorKind::InvalidInput,
                "{through}: {err}"
            );
        }
    }
}
