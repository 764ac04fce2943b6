//! [`StreamStore`]: [`Streams`] served natively — behind a mutex, written
//! through to a SQLite file with `rusqlite` (or kept in memory only), with
//! tokio waking long-polls and SSE bodies when their stream is written to.
//! `session-server` mounts it at `/v1/stream/*`.
//!
//! Durability: every request that changes a stream commits its
//! [`Changes`] in one transaction before it is answered (WAL,
//! `synchronous = NORMAL`: an acknowledged write survives the process being
//! killed; a power loss can take the last transactions back).

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use futures::Stream;
use harness_core::clock::{Clock, FnClock};
use rusqlite::{params, Connection};
use tokio::sync::Notify;

use crate::protocol::{self, Handled, LongPoll, Reply, Request, SseFeed, SseStep};
use crate::store::{
    sql, AppendOptions, AppendOutcome, Changes, CreateOptions, Offset, Producer, StoreError,
    StoredMessage, StreamMeta, Streams, SCHEMA,
};

/// The generic streams of one native server (see the module docs).
#[derive(Debug)]
pub struct StreamStore {
    inner: Mutex<Inner>,
}

#[derive(Debug)]
struct Inner {
    streams: Streams,
    db: Option<Connection>,
    /// Woken (and dropped) after each write to its path; waiters take a
    /// fresh one from here before they look at the stream.
    notifiers: HashMap<String, Arc<Notify>>,
}

fn system_clock() -> Arc<dyn Clock> {
    Arc::new(FnClock(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0)
    }))
}

/// A seed for the cursor jitter: the standard library's per-process
/// random hasher keys.
fn seed() -> u64 {
    std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish()
}

fn sql_err(e: rusqlite::Error) -> StoreError {
    StoreError::Storage(e.to_string())
}

impl Default for StreamStore {
    fn default() -> Self {
        Self::new()
    }
}

impl StreamStore {
    /// An empty store, in memory only.
    pub fn new() -> Self {
        Self::with(Streams::new(system_clock(), seed()), None)
    }

    /// A store persisted in the SQLite file at `path` (created if absent),
    /// with every stream it already holds loaded.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, StoreError> {
        let db = Connection::open(path).map_err(sql_err)?;
        db.execute_batch("PRAGMA journal_mode = WAL; PRAGMA synchronous = NORMAL;")
            .map_err(sql_err)?;
        for statement in SCHEMA {
            db.execute_batch(statement).map_err(sql_err)?;
        }
        let streams = {
            let mut rows = db.prepare(sql::SELECT_STREAMS).map_err(sql_err)?;
            let metas = rows
                .query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)))
                .map_err(sql_err)?
                .collect::<Result<Vec<_>, _>>()
                .map_err(sql_err)?;
            let mut rows = db.prepare(sql::SELECT_MESSAGES).map_err(sql_err)?;
            let messages = rows
                .query_map([], |r| {
                    Ok((
                        r.get::<_, String>(0)?,
                        StoredMessage {
                            offset: Offset {
                                read_seq: r.get::<_, i64>(1)? as u64,
                                byte: r.get::<_, i64>(2)? as u64,
                            },
                            data: Bytes::from(r.get::<_, Vec<u8>>(3)?),
                        },
                    ))
                })
                .map_err(sql_err)?
                .collect::<Result<Vec<_>, _>>()
                .map_err(sql_err)?;
            Streams::load(system_clock(), seed(), metas, messages)?
        };
        Ok(Self::with(streams, Some(db)))
    }

    fn with(streams: Streams, db: Option<Connection>) -> Self {
        Self {
            inner: Mutex::new(Inner {
                streams,
                db,
                notifiers: HashMap::new(),
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves plain data behind; keep serving.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Answer one request (authentication is the caller's), with what it
    /// changed committed and its waiters woken.
    pub fn handle(&self, req: &Request<'_>) -> Handled {
        let mut inner = self.lock();
        let handled = protocol::handle(&mut inner.streams, req);
        if let Err(e) = inner.persist() {
            return Handled::Reply(protocol::store_error(e));
        }
        if protocol::writes(req.method) {
            inner.wake(req.path);
        }
        handled
    }

    /// [`LongPoll::poll`] under the lock.
    pub fn poll(&self, poll: &LongPoll) -> Option<Reply> {
        let mut inner = self.lock();
        let reply = poll.poll(&mut inner.streams);
        inner.persist_or_warn();
        reply
    }

    /// [`LongPoll::timed_out`] under the lock.
    pub fn timed_out(&self, poll: &LongPoll) -> Reply {
        let mut inner = self.lock();
        let reply = poll.timed_out(&mut inner.streams);
        inner.persist_or_warn();
        reply
    }

    /// [`SseFeed::next`] under the lock.
    pub fn sse_step(&self, feed: &mut SseFeed) -> SseStep {
        let mut inner = self.lock();
        let step = feed.next(&mut inner.streams);
        inner.persist_or_warn();
        step
    }

    /// What wakes a waiter on `path`: take it before looking at the stream,
    /// so a write between the look and the wait still wakes.
    pub fn notifier(&self, path: &str) -> Arc<Notify> {
        self.lock()
            .notifiers
            .entry(path.to_string())
            .or_default()
            .clone()
    }

    /// Wait (up to `timeout`) for the answer to a long-poll.
    pub async fn long_poll(&self, poll: LongPoll, timeout: Duration) -> Reply {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notify = self.notifier(poll.path());
            let notified = notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(reply) = self.poll(&poll) {
                return reply;
            }
            tokio::select! {
                _ = &mut notified => {}
                _ = tokio::time::sleep_until(deadline) => return self.timed_out(&poll),
            }
        }
    }

    /// The body of an SSE read, produced as the client reads it: a
    /// keep-alive control event after `keep_alive` without data. The body
    /// ends when the stream closes or goes, or when the client leaves (the
    /// server drops it).
    pub fn sse_body(
        self: &Arc<Self>,
        feed: SseFeed,
        keep_alive: Duration,
    ) -> impl Stream<Item = Bytes> + Send + 'static {
        let state = (self.clone(), feed, false);
        futures::stream::unfold(state, move |(store, mut feed, done)| async move {
            if done {
                return None;
            }
            loop {
                let notify = store.notifier(feed.path());
                let notified = notify.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                match store.sse_step(&mut feed) {
                    SseStep::Send(bytes) => return Some((bytes, (store, feed, false))),
                    SseStep::End(bytes) if bytes.is_empty() => return None,
                    SseStep::End(bytes) => return Some((bytes, (store, feed, true))),
                    SseStep::Wait => {}
                }
                tokio::select! {
                    _ = &mut notified => {}
                    _ = tokio::time::sleep(keep_alive) => {
                        let bytes = feed.keep_alive(&mut store.lock().streams);
                        return Some((bytes, (store, feed, false)));
                    }
                }
            }
        })
    }

    /// Run `op` on the streams, commit what it changed (a failed commit
    /// turns into the error), and wake `path`'s waiters.
    fn write<T>(
        &self,
        path: &str,
        op: impl FnOnce(&mut Streams) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let mut inner = self.lock();
        let result = op(&mut inner.streams);
        let persisted = inner.persist();
        inner.wake(path);
        let value = result?;
        persisted?;
        Ok(value)
    }

    /// Metadata of a stream (soft-deleted streams are reported as such).
    pub fn meta(&self, path: &str) -> Option<StreamMeta> {
        let mut inner = self.lock();
        let meta = inner.streams.meta(path);
        inner.persist_or_warn();
        meta
    }

    /// `PUT`: create, or confirm an identical existing stream.
    /// Returns `(created, meta)`.
    pub fn create(
        &self,
        path: &str,
        opts: CreateOptions,
    ) -> Result<(bool, StreamMeta), StoreError> {
        self.write(path, |s| s.create(path, opts))
    }

    /// Everything after `after` (`None` = from the start), inherited
    /// messages of forks included, plus the stream's metadata.
    pub fn read(
        &self,
        path: &str,
        after: Option<Offset>,
    ) -> Result<(Vec<StoredMessage>, StreamMeta), StoreError> {
        let mut inner = self.lock();
        let result = inner.streams.read(path, after);
        inner.persist_or_warn();
        result
    }

    /// `POST` with a body.
    pub fn append(
        &self,
        path: &str,
        data: Bytes,
        opts: AppendOptions,
    ) -> Result<AppendOutcome, StoreError> {
        self.write(path, |s| s.append(path, data, opts))
    }

    /// `POST` with an empty body and `Stream-Closed: true`.
    pub fn close(
        &self,
        path: &str,
        producer: Option<Producer>,
    ) -> Result<AppendOutcome, StoreError> {
        self.write(path, |s| s.close(path, producer))
    }

    /// `DELETE`: remove, or soft-delete while forks read through it.
    /// `Ok(false)` when there was no such stream.
    pub fn delete(&self, path: &str) -> Result<bool, StoreError> {
        self.write(path, |s| s.delete(path))
    }
}

impl Inner {
    /// Commit what changed, in one transaction.
    fn persist(&mut self) -> Result<(), StoreError> {
        let changes = self.streams.take_changes();
        match self.db.as_mut() {
            Some(db) if !changes.is_empty() => write(db, &changes),
            _ => Ok(()),
        }
    }

    /// [`Inner::persist`] after a read (which may expire a stream): a
    /// failure is logged, the read is answered.
    fn persist_or_warn(&mut self) {
        if let Err(e) = self.persist() {
            tracing::warn!(error = %e, "durable streams: persisting an expiry failed");
        }
    }

    fn wake(&mut self, path: &str) {
        if let Some(notify) = self.notifiers.remove(path) {
            notify.notify_waiters();
        }
    }
}

fn write(db: &mut Connection, changes: &Changes) -> Result<(), StoreError> {
    let tx = db.transaction().map_err(sql_err)?;
    for (path, m) in &changes.messages {
        tx.execute(
            sql::INSERT_MESSAGE,
            params![
                path,
                m.offset.read_seq as i64,
                m.offset.byte as i64,
                &m.data[..]
            ],
        )
        .map_err(sql_err)?;
    }
    for (path, meta) in &changes.upserts {
        tx.execute(sql::UPSERT_STREAM, params![path, meta])
            .map_err(sql_err)?;
    }
    for path in &changes.removed {
        tx.execute(sql::DELETE_STREAM, params![path])
            .map_err(sql_err)?;
        tx.execute(sql::DELETE_MESSAGES, params![path])
            .map_err(sql_err)?;
    }
    tx.commit().map_err(sql_err)
}
