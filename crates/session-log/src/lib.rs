//! # session-log
//!
//! [`SqliteSessionLog`]: the [`SessionLog`] of `harness-core` on SQLite, and
//! [`turn_store::SqliteTurnStore`]: its `TurnStore`, in the same database
//! file if you like.
//!
//! The rules (seq from 1 without gaps, idempotency keys, seal, fork) are the
//! ones written in `harness_core::log`; this crate reuses that module's
//! checks and error constructors so every backend words its errors alike.
//!
//! ## Durability
//!
//! The database runs in WAL mode with `synchronous=NORMAL`. An append returns
//! only after the transaction holding it committed, i.e. after the commit
//! record was written to the WAL file with `write(2)`: from then on the frame
//! lives in the operating system's page cache and survives the death of *this
//! process* (kill -9, panic, OOM kill). What NORMAL gives up compared to FULL
//! is an `fsync` per commit, so a power loss or kernel crash may drop the
//! last few acknowledged transactions (never corrupt the database). Use
//! [`SqliteSessionLog::with_full_sync`] when acknowledged frames must also
//! survive power loss, at the price of one fsync per commit.
//!
//! ## Group commit and threads
//!
//! One thread owns the write connection and commits everything queued
//! meanwhile in one transaction (`writer` module): concurrent appenders
//! share a commit, each answered only once it committed; a session actor
//! batches its own appends with [`SessionLog::append_grouped`] and
//! [`SessionLog::commit_group`]. A failed commit fails every append in it.
//! Reads of a file-backed log use a second, read-only connection (they see
//! committed frames only); an in-memory log reads through the writer. The
//! methods need a tokio runtime. See `docs/session-log.md`.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use backon::{BlockingRetryable, ExponentialBuilder};
use harness_core::log::{
    check_fork_kept, check_kept, check_trim, decode_stored_body, decode_stored_meta,
    fork_closing_frame, fork_copy_sealed, plan_append, unknown_session, AppendPlan, AppendRequest,
    AppendView, Appended, ChainKey, ChainedFrame, CheckedAppend, ForkOrigin, FrameHash, LogCut,
    LogHead, LogInfo, SessionLog, DEFAULT_MAX_FRAME_BYTES,
};
use harness_core::search::{DocKind, Document, SearchHit, SearchQuery};
use harness_core::session::{SessionConfig, SessionMeta};
use harness_core::{Error, Frame, FrameBody, Result, SessionId};
use rusqlite::{params, Connection, OptionalExtension, TransactionBehavior};

use writer::Writer;

mod index;
pub mod turn_store;
mod writer;

pub use turn_store::SqliteTurnStore;

/// How long a statement waits for a lock held by another connection (another
/// process on the same file) before failing.
const BUSY_TIMEOUT: Duration = Duration::from_secs(10);

/// Milliseconds since the Unix epoch, the stamp of stored frames (this
/// backend runs natively and keeps time itself; core takes a clock).
pub(crate) fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

// `logs.meta` is the session's `SessionMeta` as JSON, folded from every
// frame in the append's transaction; NULL in databases written before it
// existed (then folded from the frames when first read).
const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS logs (
    session     TEXT PRIMARY KEY NOT NULL,
    sealed      INTEGER NOT NULL DEFAULT 0,
    forked_from TEXT,
    fork_until  INTEGER,
    meta        TEXT,
    cut_through INTEGER,
    cut_hash    BLOB,
    cut_meta    TEXT
);
CREATE TABLE IF NOT EXISTS frames (
    session  TEXT NOT NULL,
    seq      INTEGER NOT NULL,
    at_ms    INTEGER NOT NULL,
    body     TEXT NOT NULL,
    idem_key TEXT,
    hash     BLOB,
    PRIMARY KEY (session, seq)
) WITHOUT ROWID;
CREATE UNIQUE INDEX IF NOT EXISTS frames_idem ON frames (session, idem_key)
    WHERE idem_key IS NOT NULL;
CREATE TABLE IF NOT EXISTS search_docs (
    id      INTEGER PRIMARY KEY,
    session TEXT NOT NULL,
    seq     INTEGER NOT NULL,
    kind    TEXT NOT NULL,
    text    TEXT NOT NULL
);
CREATE UNIQUE INDEX IF NOT EXISTS search_docs_frame ON search_docs (session, seq);
CREATE VIRTUAL TABLE IF NOT EXISTS search_fts USING fts5(
    text, content = 'search_docs', content_rowid = 'id', tokenize = 'unicode61'
);
CREATE TABLE IF NOT EXISTS search_marks (
    session TEXT PRIMARY KEY NOT NULL,
    through INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS turns (
    session    TEXT NOT NULL,
    turn       TEXT NOT NULL,
    state      TEXT NOT NULL,
    done       INTEGER NOT NULL,
    generation INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (session, turn)
);
";

/// Columns added after the first schema, for databases that predate them.
const MIGRATIONS: &[(&str, &str, &str)] = &[
    ("logs", "meta", "ALTER TABLE logs ADD COLUMN meta TEXT"),
    // The audit chain; NULL for frames written before it.
    ("frames", "hash", "ALTER TABLE frames ADD COLUMN hash BLOB"),
    (
        "turns",
        "generation",
        "ALTER TABLE turns ADD COLUMN generation INTEGER NOT NULL DEFAULT 0",
    ),
    // Retention's cut (`SessionLog::trim`): the last seq removed, its chain
    // hash, and the meta folded through it (what a fork past it starts
    // from). NULL for a log never trimmed.
    (
        "logs",
        "cut_through",
        "ALTER TABLE logs ADD COLUMN cut_through INTEGER",
    ),
    (
        "logs",
        "cut_hash",
        "ALTER TABLE logs ADD COLUMN cut_hash BLOB",
    ),
    (
        "logs",
        "cut_meta",
        "ALTER TABLE logs ADD COLUMN cut_meta TEXT",
    ),
];

fn migrate(conn: &Connection) -> Result<()> {
    for (table, column, sql) in MIGRATIONS {
        let mut stmt = conn
            .prepare(&format!("PRAGMA table_info({table})"))
            .map_err(db_err)?;
        let names = stmt
            .query_map([], |r| r.get::<_, String>(1))
            .map_err(db_err)?
            .collect::<rusqlite::Result<Vec<_>>>()
            .map_err(db_err)?;
        if !names.iter().any(|n| n == column) {
            conn.execute_batch(sql).map_err(db_err)?;
        }
    }
    Ok(())
}

/// Map a SQLite failure onto the crate's error kinds.
pub(crate) fn db_err(err: rusqlite::Error) -> Error {
    Error::backend(format!("sqlite: {err}")).with_source(err)
}

/// Open (creating if needed) a database file with the pragmas and schema both
/// stores use.
pub(crate) fn open_connection(path: &Path) -> Result<Connection> {
    let conn = Connection::open(path).map_err(db_err)?;
    // Connections that open a file nobody has set up yet race to switch it
    // to WAL and create the schema; SQLite answers the loser `SQLITE_BUSY`
    // at once, without waiting on the busy timeout (waiting could deadlock
    // two lock upgrades). The setup is idempotent, so try again, for as long
    // as a busy statement would have waited (pauses of 5 ms doubling to
    // 200 ms, `backon`'s backoff).
    let pauses = ExponentialBuilder::new()
        .with_min_delay(Duration::from_millis(5))
        .with_max_delay(Duration::from_millis(200))
        .with_total_delay(Some(BUSY_TIMEOUT))
        .without_max_times();
    (|| configure(&conn))
        .retry(pauses)
        .sleep(std::thread::sleep)
        .when(is_busy)
        .call()?;
    Ok(conn)
}

/// Whether an error is SQLite's "another connection holds the lock".
fn is_busy(err: &Error) -> bool {
    let mut source = std::error::Error::source(err);
    while let Some(cause) = source {
        if let Some(rusqlite::Error::SqliteFailure(e, _)) = cause.downcast_ref() {
            return matches!(
                e.code,
                rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked
            );
        }
        source = cause.source();
    }
    false
}

fn configure(conn: &Connection) -> Result<()> {
    conn.busy_timeout(BUSY_TIMEOUT).map_err(db_err)?;
    // The append path's statements (and the reads') stay prepared.
    conn.set_prepared_statement_cache_capacity(64);
    // WAL: readers never block the writer, and a commit is one sequential
    // write to the WAL file. `journal_mode` answers with the mode in force
    // (`memory` for an in-memory database, which has no WAL).
    let _mode: String = conn
        .query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))
        .map_err(db_err)?;
    // NORMAL: see the crate docs — acknowledged frames survive the process
    // being killed; only power loss can drop the last transactions.
    conn.execute_batch("PRAGMA synchronous=NORMAL; PRAGMA foreign_keys=ON;")
        .map_err(db_err)?;
    conn.execute_batch(SCHEMA).map_err(db_err)?;
    migrate(conn)?;
    Ok(())
}

/// Run blocking database work on tokio's blocking pool.
pub(crate) async fn blocking<T, F>(conn: &Arc<Mutex<Connection>>, f: F) -> Result<T>
where
    T: Send + 'static,
    F: FnOnce(&mut Connection) -> Result<T> + Send + 'static,
{
    let conn = conn.clone();
    tokio::task::spawn_blocking(move || {
        // A panic while holding the lock leaves no half-done transaction
        // behind (rusqlite rolls back on drop), so a poisoned lock is safe
        // to keep using.
        let mut guard = conn.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut guard)
    })
    .await
    .map_err(|e| Error::backend(format!("database task failed: {e}")))?
}

/// A [`SessionLog`] stored in one SQLite database file.
#[derive(Debug, Clone)]
pub struct SqliteSessionLog {
    /// The thread owning the write connection (group commit).
    writer: Arc<Writer>,
    /// A second connection for reads, which sees committed data only (WAL);
    /// `None` for an in-memory database, read through the writer.
    reader: Option<Arc<Mutex<Connection>>>,
    max_frame_bytes: usize,
}

impl SqliteSessionLog {
    /// Open (or create) the log database at `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let conn = open_connection(path.as_ref())?;
        // Frames a process committed but did not index before it ended.
        index::catch_up(&conn)?;
        let writer = Writer::start(conn, Some(open_connection(path.as_ref())?))?;
        let reader = open_connection(path.as_ref())?;
        reader
            .execute_batch("PRAGMA query_only=1")
            .map_err(db_err)?;
        Ok(Self {
            writer,
            reader: Some(Arc::new(Mutex::new(reader))),
            max_frame_bytes: DEFAULT_MAX_FRAME_BYTES,
        })
    }

    /// A log in a private in-memory database (tests, throwaway sessions).
    pub fn open_in_memory() -> Result<Self> {
        let conn = Connection::open_in_memory().map_err(db_err)?;
        configure(&conn)?;
        Ok(Self {
            writer: Writer::start(conn, None)?,
            reader: None,
            max_frame_bytes: DEFAULT_MAX_FRAME_BYTES,
        })
    }

    /// Chain appended frames with `key` (the audit chain; unkeyed by
    /// default). Every process appending to one file must use the same key,
    /// or the chain breaks where they meet.
    pub fn with_chain_key(self, key: ChainKey) -> Self {
        self.writer.set_chain_key(key);
        self
    }

    /// Set the frame size limit (default 1 MiB).
    pub fn with_max_frame_bytes(mut self, max: usize) -> Self {
        self.max_frame_bytes = max;
        self
    }

    /// Switch to `synchronous=FULL`: every commit is fsynced, so acknowledged
    /// frames survive power loss too (one fsync per group of appends).
    pub fn with_full_sync(self) -> Result<Self> {
        self.writer.exec_blocking(|conn| {
            conn.execute_batch("PRAGMA synchronous=FULL")
                .map_err(db_err)
        })?;
        Ok(self)
    }

    /// Commit at most `n` appends together (default 1024; 1 commits every
    /// plain append on its own, as before group commit: a baseline for
    /// benchmarks). Grouped appends of one appender are not split.
    pub fn with_max_group(self, n: usize) -> Self {
        self.writer.set_max_batch(n);
        self
    }

    /// The frame size limit in force.
    pub fn max_frame_bytes(&self) -> usize {
        self.max_frame_bytes
    }

    /// A [`SqliteTurnStore`] sharing this log's connection (and file).
    pub fn turn_store(&self) -> SqliteTurnStore {
        SqliteTurnStore::from_writer(self.writer.clone())
    }

    /// Make the next `n` commits fail (SQLite's commit hook turns them into
    /// rollbacks): for tests of what a failed group commit does.
    #[doc(hidden)]
    pub fn fail_next_commits(&self, n: usize) {
        self.writer.fail_next_commits(n);
    }

    /// How many transactions of appends the writer has committed (or
    /// tried to): fewer than appends when they were grouped.
    #[doc(hidden)]
    pub fn group_commits(&self) -> u64 {
        self.writer.commits()
    }

    /// Keep the writer busy until the returned guard is dropped, so that
    /// appends made meanwhile queue up and go into one transaction: for
    /// tests of group commit.
    #[doc(hidden)]
    pub fn hold_writer(&self) -> WriterHold {
        let (started_tx, started) = std::sync::mpsc::channel();
        let (release, released) = std::sync::mpsc::channel::<()>();
        // The job holds the thread until released.
        self.writer.exec_detached(move |_conn| {
            let _ = started_tx.send(());
            let _ = released.recv();
        });
        WriterHold {
            writer: self.writer.clone(),
            release,
            started,
        }
    }

    /// Run read-only work on the read connection (or the writer's, in memory).
    /// Run `f` in an immediate transaction on the writer's connection,
    /// committed when `f` returns `Ok` (rolled back otherwise): what every
    /// write outside the append path (seal, fork, delete, trim) does.
    async fn write_tx<T, F>(&self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&rusqlite::Transaction<'_>) -> Result<T> + Send + 'static,
    {
        self.writer
            .exec(move |conn| {
                let tx = conn
                    .transaction_with_behavior(TransactionBehavior::Immediate)
                    .map_err(db_err)?;
                let out = f(&tx)?;
                tx.commit().map_err(db_err)?;
                Ok(out)
            })
            .await
    }

    async fn read_with<T, F>(&self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut Connection) -> Result<T> + Send + 'static,
    {
        match &self.reader {
            Some(reader) => blocking(reader, f).await,
            None => self.writer.exec(f).await,
        }
    }
}

/// See [`SqliteSessionLog::hold_writer`].
#[doc(hidden)]
#[derive(Debug)]
pub struct WriterHold {
    #[allow(dead_code)]
    writer: Arc<Writer>,
    /// Dropped with the guard: the held job's `recv` returns and the
    /// writer goes on.
    #[allow(dead_code)]
    release: std::sync::mpsc::Sender<()>,
    started: std::sync::mpsc::Receiver<()>,
}

impl WriterHold {
    /// Wait until the writer is held.
    pub fn wait(&self) {
        let _ = self.started.recv();
    }
}

/// The `logs` row and last seq of a session, or `NotFound`.
fn load_info(conn: &Connection, session: &SessionId) -> Result<LogInfo> {
    type Row = (bool, Option<String>, Option<i64>, Option<String>);
    let row: Option<Row> = conn
        .prepare_cached("SELECT sealed, forked_from, fork_until, meta FROM logs WHERE session = ?1")
        .map_err(db_err)?
        .query_row(params![session.as_str()], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?))
        })
        .optional()
        .map_err(db_err)?;
    let (sealed, forked_from, fork_until, meta) = row.ok_or_else(|| unknown_session(session))?;
    let trimmed = load_cut(conn, session)?;
    let meta = match meta {
        Some(json) => decode_stored_meta(&json, session)?,
        None => fold_stored(conn, session, None, u64::MAX)?,
    };
    let (last_seq, last_at_ms) = last_frame(conn, session)?;
    let forked_from = match (forked_from, fork_until) {
        (Some(source), Some(until)) => Some(ForkOrigin {
            session: SessionId::parse(source)?,
            until: until as u64,
        }),
        _ => None,
    };
    Ok(LogInfo {
        session: session.clone(),
        last_seq,
        last_at_ms,
        sealed,
        forked_from,
        meta,
        trimmed,
    })
}

/// `session`'s retention cut (`NotFound` for an unknown session).
fn load_cut(conn: &Connection, session: &SessionId) -> Result<Option<LogCut>> {
    let row: Option<(Option<i64>, Option<Vec<u8>>)> = conn
        .prepare_cached("SELECT cut_through, cut_hash FROM logs WHERE session = ?1")
        .map_err(db_err)?
        .query_row(params![session.as_str()], |r| Ok((r.get(0)?, r.get(1)?)))
        .optional()
        .map_err(db_err)?;
    let (through, hash) = row.ok_or_else(|| unknown_session(session))?;
    through
        .map(|through| {
            Ok(LogCut {
                through: through as u64,
                hash: hash.as_deref().map(FrameHash::from_slice).transpose()?,
            })
        })
        .transpose()
}

/// The meta folded through frame `until` of `session` (at or past its cut,
/// if it has one): the cut's meta, or a fresh one under `config`, with the
/// frames after the cut folded in.
fn meta_through(
    conn: &Connection,
    session: &SessionId,
    config: Option<SessionConfig>,
    until: u64,
) -> Result<SessionMeta> {
    let row: (Option<i64>, Option<String>) = conn
        .prepare_cached("SELECT cut_through, cut_meta FROM logs WHERE session = ?1")
        .map_err(db_err)?
        .query_row(params![session.as_str()], |r| Ok((r.get(0)?, r.get(1)?)))
        .map_err(db_err)?;
    let (after, meta) = match row {
        (Some(through), Some(meta)) => (through as u64, decode_stored_meta(&meta, session)?),
        _ => (0, SessionMeta::new(config)),
    };
    fold_frames(conn, session, meta, after, until)
}

/// Fold frames `after < seq <= until` of `session` (with their keys) into
/// `meta`.
fn fold_frames(
    conn: &Connection,
    session: &SessionId,
    mut meta: SessionMeta,
    after: u64,
    until: u64,
) -> Result<SessionMeta> {
    let to_i = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
    let mut stmt = conn
        .prepare_cached(
            "SELECT seq, body, idem_key FROM frames WHERE session = ?1 AND seq > ?2 AND seq <= ?3 \
             ORDER BY seq",
        )
        .map_err(db_err)?;
    let rows = stmt
        .query_map(params![session.as_str(), to_i(after), to_i(until)], |r| {
            Ok((
                r.get::<_, i64>(0)?,
                r.get::<_, String>(1)?,
                r.get::<_, Option<String>>(2)?,
            ))
        })
        .map_err(db_err)?;
    for row in rows {
        let (seq, body, key) = row.map_err(db_err)?;
        meta.apply(
            seq as u64,
            &decode_stored_body(&body, session, seq)?,
            key.as_deref(),
        );
    }
    Ok(meta)
}

/// Remove `session`'s index entries with `seq <= through` (all of them for
/// `i64::MAX`): their FTS5 entries first (external content: FTS5 is told
/// what it indexed), then the documents.
fn unindex(tx: &Connection, session: &SessionId, through: i64) -> Result<()> {
    tx.prepare_cached(
        "INSERT INTO search_fts (search_fts, rowid, text) \
         SELECT 'delete', id, text FROM search_docs WHERE session = ?1 AND seq <= ?2",
    )
    .map_err(db_err)?
    .execute(params![session.as_str(), through])
    .map_err(db_err)?;
    tx.prepare_cached("DELETE FROM search_docs WHERE session = ?1 AND seq <= ?2")
        .map_err(db_err)?
        .execute(params![session.as_str(), through])
        .map_err(db_err)?;
    Ok(())
}

/// The session's meta, read where stored or folded from its frames.
fn load_meta(conn: &Connection, session: &SessionId) -> Result<SessionMeta> {
    let stored: Option<String> = conn
        .prepare_cached("SELECT meta FROM logs WHERE session = ?1")
        .map_err(db_err)?
        .query_row(params![session.as_str()], |r| r.get(0))
        .map_err(db_err)?;
    match stored {
        Some(json) => decode_stored_meta(&json, session),
        None => fold_stored(conn, session, None, u64::MAX),
    }
}

/// Fold frames `1..=until` of `session` (with their keys) into a meta.
fn fold_stored(
    conn: &Connection,
    session: &SessionId,
    config: Option<SessionConfig>,
    until: u64,
) -> Result<SessionMeta> {
    fold_frames(conn, session, SessionMeta::new(config), 0, until)
}

fn store_meta(conn: &Connection, session: &SessionId, meta: &SessionMeta) -> Result<()> {
    conn.prepare_cached("UPDATE logs SET meta = ?2 WHERE session = ?1")
        .map_err(db_err)?
        .execute(params![session.as_str(), serde_json::to_string(meta)?])
        .map_err(db_err)?;
    Ok(())
}

/// Seq and stamp of the last frame ((0, 0) when empty).
fn last_frame(conn: &Connection, session: &SessionId) -> Result<(u64, u64)> {
    let row: Option<(i64, i64)> = conn
        .prepare_cached(
            "SELECT seq, at_ms FROM frames WHERE session = ?1 ORDER BY seq DESC LIMIT 1",
        )
        .map_err(db_err)?
        .query_row(params![session.as_str()], |r| Ok((r.get(0)?, r.get(1)?)))
        .optional()
        .map_err(db_err)?;
    Ok(row.map_or((0, 0), |(s, a)| (s as u64, a as u64)))
}

/// Seq and chain hash of the last frame ((0, None) when empty).
fn last_link(conn: &Connection, session: &SessionId) -> Result<(u64, Option<FrameHash>)> {
    let row: Option<(i64, Option<Vec<u8>>)> = conn
        .prepare_cached("SELECT seq, hash FROM frames WHERE session = ?1 ORDER BY seq DESC LIMIT 1")
        .map_err(db_err)?
        .query_row(params![session.as_str()], |r| Ok((r.get(0)?, r.get(1)?)))
        .optional()
        .map_err(db_err)?;
    match row {
        None => Ok((0, None)),
        Some((seq, hash)) => Ok((
            seq as u64,
            hash.as_deref().map(FrameHash::from_slice).transpose()?,
        )),
    }
}

/// `NotFound` unless `session` has a log.
fn check_exists(conn: &Connection, session: &SessionId) -> Result<()> {
    let exists: Option<i64> = conn
        .prepare_cached("SELECT 1 FROM logs WHERE session = ?1")
        .map_err(db_err)?
        .query_row(params![session.as_str()], |r| r.get(0))
        .optional()
        .map_err(db_err)?;
    match exists {
        Some(_) => Ok(()),
        None => Err(unknown_session(session)),
    }
}

/// `session`'s log as the append decision reads it, inside the open
/// transaction `tx`.
struct TxView<'a> {
    tx: &'a Connection,
    session: &'a SessionId,
}

impl AppendView for TxView<'_> {
    fn session(&self) -> &SessionId {
        self.session
    }

    fn head(&mut self) -> Result<LogHead> {
        let sealed: Option<bool> = self
            .tx
            .prepare_cached("SELECT sealed FROM logs WHERE session = ?1")
            .map_err(db_err)?
            .query_row(params![self.session.as_str()], |r| r.get(0))
            .optional()
            .map_err(db_err)?;
        let sealed = sealed.ok_or_else(|| unknown_session(self.session))?;
        let (last_seq, last_hash) = last_link(self.tx, self.session)?;
        Ok(LogHead {
            last_seq,
            sealed,
            last_hash,
        })
    }

    fn frame_by_key(&mut self, key: &str) -> Result<Option<Frame>> {
        let found: Option<(i64, i64, String)> = self
            .tx
            .prepare_cached(
                "SELECT seq, at_ms, body FROM frames WHERE session = ?1 AND idem_key = ?2",
            )
            .map_err(db_err)?
            .query_row(params![self.session.as_str(), key], |r| {
                Ok((r.get(0)?, r.get(1)?, r.get(2)?))
            })
            .optional()
            .map_err(db_err)?;
        found
            .map(|(seq, at_ms, body)| {
                Ok(Frame {
                    seq: seq as u64,
                    at_ms: at_ms as u64,
                    body: decode_stored_body(&body, self.session, seq)?,
                })
            })
            .transpose()
    }

    fn meta(&mut self) -> Result<SessionMeta> {
        load_meta(self.tx, self.session)
    }
}

/// An append inside the open transaction `tx`: `harness_core::log`'s
/// decision over what `tx` holds, then exactly what it says written.
pub(crate) fn append_in(
    tx: &Connection,
    session: &SessionId,
    append: CheckedAppend,
    now: u64,
    chain: &ChainKey,
) -> Result<(Appended, Option<Document>)> {
    let new = match plan_append(&mut TxView { tx, session }, append, now, chain)? {
        AppendPlan::Duplicate(appended) => return Ok((appended, None)),
        AppendPlan::Write(new) => new,
    };
    tx.prepare_cached(
        "INSERT INTO frames (session, seq, at_ms, body, idem_key, hash) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
    )
    .map_err(db_err)?
    .execute(params![
        session.as_str(),
        new.frame.seq as i64,
        new.frame.at_ms as i64,
        new.body_json,
        new.key,
        new.hash.as_ref().map(|h| &h.as_bytes()[..])
    ])
    .map_err(db_err)?;
    if new.seals {
        tx.prepare_cached("UPDATE logs SET sealed = 1 WHERE session = ?1")
            .map_err(db_err)?
            .execute(params![session.as_str()])
            .map_err(db_err)?;
    }
    if let Some(meta) = &new.meta {
        store_meta(tx, session, meta)?;
    }
    let appended = new.appended();
    // The search index is written after the commit, off this path
    // (index.rs): the writer hands the document on.
    Ok((appended, new.document))
}

#[async_trait]
impl SessionLog for SqliteSessionLog {
    async fn create_with(
        &self,
        session: &SessionId,
        config: Option<SessionConfig>,
    ) -> Result<LogInfo> {
        let session = session.clone();
        let meta = serde_json::to_string(&SessionMeta::new(config))?;
        self.writer
            .exec(move |conn| {
                conn.execute(
                    "INSERT OR IGNORE INTO logs (session, sealed, meta) VALUES (?1, 0, ?2)",
                    params![session.as_str(), meta],
                )
                .map_err(db_err)?;
                load_info(conn, &session)
            })
            .await
    }

    async fn info(&self, session: &SessionId) -> Result<LogInfo> {
        let session = session.clone();
        self.read_with(move |conn| load_info(conn, &session)).await
    }

    async fn append(&self, session: &SessionId, request: AppendRequest) -> Result<Appended> {
        // Checked and encoded here, on the caller's thread, not the
        // writer's. Answered once the transaction holding it committed;
        // appends made meanwhile by other callers share that transaction
        // (`writer`).
        let append = CheckedAppend::new(request, self.max_frame_bytes)?;
        let (appended, _group) = self.writer.append(session.clone(), append, false).await?;
        Ok(appended)
    }

    async fn append_grouped(
        &self,
        session: &SessionId,
        request: AppendRequest,
    ) -> Result<(Appended, u64)> {
        let append = CheckedAppend::new(request, self.max_frame_bytes)?;
        self.writer.append(session.clone(), append, true).await
    }

    async fn commit_group(&self, session: &SessionId, group: u64) -> Result<()> {
        self.writer.commit(session.clone(), group).await
    }

    async fn read(&self, session: &SessionId, after: u64, limit: usize) -> Result<Vec<Frame>> {
        let session = session.clone();
        self.read_with(move |conn| {
            let tx = conn.transaction().map_err(db_err)?;
            check_kept(&session, load_cut(&tx, &session)?.as_ref(), after)?;
            let limit = i64::try_from(limit).unwrap_or(i64::MAX);
            let after = i64::try_from(after).unwrap_or(i64::MAX);
            let mut stmt = tx
                .prepare_cached(
                    "SELECT seq, at_ms, body FROM frames WHERE session = ?1 AND seq > ?2 \
                     ORDER BY seq LIMIT ?3",
                )
                .map_err(db_err)?;
            let rows = stmt
                .query_map(params![session.as_str(), after, limit], |r| {
                    Ok((
                        r.get::<_, i64>(0)?,
                        r.get::<_, i64>(1)?,
                        r.get::<_, String>(2)?,
                    ))
                })
                .map_err(db_err)?;
            let mut frames = Vec::new();
            for row in rows {
                let (seq, at_ms, body) = row.map_err(db_err)?;
                frames.push(Frame {
                    seq: seq as u64,
                    at_ms: at_ms as u64,
                    body: decode_stored_body(&body, &session, seq)?,
                });
            }
            Ok(frames)
        })
        .await
    }

    async fn read_chain(
        &self,
        session: &SessionId,
        after: u64,
        limit: usize,
    ) -> Result<Vec<ChainedFrame>> {
        let session = session.clone();
        self.read_with(move |conn| {
            let tx = conn.transaction().map_err(db_err)?;
            check_kept(&session, load_cut(&tx, &session)?.as_ref(), after)?;
            let limit = i64::try_from(limit).unwrap_or(i64::MAX);
            let after = i64::try_from(after).unwrap_or(i64::MAX);
            let mut stmt = tx
                .prepare_cached(
                    "SELECT seq, at_ms, body, idem_key, hash FROM frames \
                     WHERE session = ?1 AND seq > ?2 ORDER BY seq LIMIT ?3",
                )
                .map_err(db_err)?;
            let rows = stmt
                .query_map(params![session.as_str(), after, limit], |r| {
                    Ok((
                        r.get::<_, i64>(0)?,
                        r.get::<_, i64>(1)?,
                        r.get::<_, String>(2)?,
                        r.get::<_, Option<String>>(3)?,
                        r.get::<_, Option<Vec<u8>>>(4)?,
                    ))
                })
                .map_err(db_err)?;
            let mut frames = Vec::new();
            for row in rows {
                let (seq, at_ms, body, key, hash) = row.map_err(db_err)?;
                frames.push(ChainedFrame {
                    seq: seq as u64,
                    at_ms: at_ms as u64,
                    key,
                    body,
                    hash: hash
                        .as_deref()
                        .map(FrameHash::from_slice)
                        .transpose()
                        .map_err(|e| {
                            Error::corrupt(format!("frame {seq} of session {session}: {e}"))
                        })?,
                });
            }
            Ok(frames)
        })
        .await
    }

    async fn seal(&self, session: &SessionId) -> Result<LogInfo> {
        let session = session.clone();
        let chain = self.writer.chain_key();
        self.write_tx(move |tx| {
            let info = load_info(tx, &session)?;
            if !info.sealed {
                let seal =
                    CheckedAppend::new(AppendRequest::new(FrameBody::Sealed {}), usize::MAX)?;
                append_in(tx, &session, seal, now_ms(), &chain)?;
            }
            let info = load_info(tx, &session)?;
            Ok(info)
        })
        .await
    }

    async fn delete(&self, session: &SessionId) -> Result<()> {
        let session = session.clone();
        self.write_tx(move |tx| {
            check_exists(tx, &session)?;
            unindex(tx, &session, i64::MAX)?;
            for table in ["frames", "search_marks", "turns", "logs"] {
                tx.execute(
                    &format!("DELETE FROM {table} WHERE session = ?1"),
                    params![session.as_str()],
                )
                .map_err(db_err)?;
            }
            Ok(())
        })
        .await
    }

    async fn trim(&self, session: &SessionId, through: u64) -> Result<LogInfo> {
        let session = session.clone();
        self.write_tx(move |tx| {
            let info = load_info(tx, &session)?;
            if !check_trim(&info, through)? {
                return Ok(info);
            }
            let cut_meta = meta_through(tx, &session, info.meta.config.clone(), through)?;
            let through = through as i64;
            let hash: Option<Vec<u8>> = tx
                .query_row(
                    "SELECT hash FROM frames WHERE session = ?1 AND seq = ?2",
                    params![session.as_str(), through],
                    |r| r.get(0),
                )
                .map_err(db_err)?;
            // A log whose meta was never stored (written before it
            // was) keeps it now: its frames are about to go.
            store_meta(tx, &session, &info.meta)?;
            tx.execute(
                "UPDATE logs SET cut_through = ?2, cut_hash = ?3, cut_meta = ?4 \
                     WHERE session = ?1",
                params![
                    session.as_str(),
                    through,
                    hash,
                    serde_json::to_string(&cut_meta)?
                ],
            )
            .map_err(db_err)?;
            unindex(tx, &session, through)?;
            tx.execute(
                "DELETE FROM frames WHERE session = ?1 AND seq <= ?2",
                params![session.as_str(), through],
            )
            .map_err(db_err)?;
            let info = load_info(tx, &session)?;
            Ok(info)
        })
        .await
    }

    async fn fork(&self, source: &SessionId, until: u64, target: &SessionId) -> Result<LogInfo> {
        let source = source.clone();
        let target = target.clone();
        let chain = self.writer.chain_key();
        self.write_tx(move |tx| {
            let target_exists: Option<i64> = tx
                .query_row(
                    "SELECT 1 FROM logs WHERE session = ?1",
                    params![target.as_str()],
                    |r| r.get(0),
                )
                .optional()
                .map_err(db_err)?;
            if target_exists.is_some() {
                return Err(Error::conflict(format!(
                    "cannot fork into {target}: that session already exists"
                )));
            }
            let src = load_info(tx, &source)?;
            let sealed = fork_copy_sealed(&src, until)?;
            check_fork_kept(&source, src.trimmed.as_ref(), until)?;
            tx.execute(
                "INSERT INTO logs (session, sealed, forked_from, fork_until, cut_through, \
                 cut_hash, cut_meta) \
                 SELECT ?1, ?2, ?3, ?4, cut_through, cut_hash, cut_meta FROM logs \
                 WHERE session = ?3",
                params![target.as_str(), sealed, source.as_str(), until as i64],
            )
            .map_err(db_err)?;
            tx.execute(
                "INSERT INTO frames (session, seq, at_ms, body, idem_key, hash) \
                 SELECT ?1, seq, at_ms, body, idem_key, hash FROM frames \
                 WHERE session = ?2 AND seq <= ?3",
                params![target.as_str(), source.as_str(), until as i64],
            )
            .map_err(db_err)?;
            // The copy's meta is its own prefix folded (from the cut it
            // copied, if any), under the source's config.
            let meta = meta_through(tx, &target, src.meta.config.clone(), until)?;
            store_meta(tx, &target, &meta)?;
            if let Some(closing) = fork_closing_frame(&meta, sealed, &source, until) {
                let closing = CheckedAppend::new(closing, usize::MAX)?;
                append_in(tx, &target, closing, now_ms(), &chain)?;
            }
            // The copy's index, from its own frames (the source's may not
            // be indexed yet), in the fork's transaction.
            index::write_entries(tx, &index::stored_entries(tx, target.as_str(), 0)?)?;
            let info = load_info(tx, &target)?;
            Ok(info)
        })
        .await
    }

    async fn search(&self, query: &SearchQuery) -> Result<Vec<SearchHit>> {
        query.check()?;
        let fts = query.fts5_match()?;
        let limit = query.limit()? as i64;
        let q = query.clone();
        let to_i = |v: Option<u64>| v.map(|v| i64::try_from(v).unwrap_or(i64::MAX));
        let (after, before) = (to_i(q.after_ms), to_i(q.before_ms));
        self.read_with(move |conn| {
            let mut stmt = conn
                .prepare_cached(
                    "SELECT d.session, d.seq, f.at_ms, d.kind, \
                            snippet(search_fts, 0, '[', ']', '…', 16), bm25(search_fts) AS rank \
                     FROM search_fts \
                     JOIN search_docs d ON d.id = search_fts.rowid \
                     JOIN frames f ON f.session = d.session AND f.seq = d.seq \
                     JOIN logs l ON l.session = d.session \
                     WHERE search_fts MATCH ?1 \
                       AND (?2 IS NULL OR json_extract(l.meta, '$.config.agent') = ?2) \
                       AND (?3 IS NULL OR json_extract(l.meta, '$.config.sandbox.provider') = ?3) \
                       AND (?4 IS NULL OR f.at_ms >= ?4) \
                       AND (?5 IS NULL OR f.at_ms < ?5) \
                       AND (?6 IS NULL OR json_extract(l.meta, '$.turn.status') = ?6) \
                     ORDER BY rank, d.session, d.seq LIMIT ?7",
                )
                .map_err(db_err)?;
            let rows = stmt
                .query_map(
                    params![fts, q.agent, q.provider, after, before, q.status, limit],
                    |r| {
                        Ok((
                            r.get::<_, String>(0)?,
                            r.get::<_, i64>(1)?,
                            r.get::<_, i64>(2)?,
                            r.get::<_, String>(3)?,
                            r.get::<_, String>(4)?,
                            r.get::<_, f64>(5)?,
                        ))
                    },
                )
                .map_err(db_err)?;
            let mut hits = Vec::new();
            for row in rows {
                let (session, seq, at_ms, kind, snippet, rank) = row.map_err(db_err)?;
                hits.push(SearchHit {
                    session: SessionId::parse(session)?,
                    seq: seq as u64,
                    at_ms: at_ms as u64,
                    kind: DocKind::stored(&kind)?,
                    snippet,
                    rank,
                });
            }
            Ok(hits)
        })
        .await
    }

    async fn list(&self) -> Result<Vec<LogInfo>> {
        self.read_with(move |conn| {
            let tx = conn.transaction().map_err(db_err)?;
            let ids: Vec<String> = {
                let mut stmt = tx
                    .prepare("SELECT session FROM logs ORDER BY session")
                    .map_err(db_err)?;
                let rows = stmt.query_map([], |r| r.get(0)).map_err(db_err)?;
                rows.collect::<rusqlite::Result<_>>().map_err(db_err)?
            };
            ids.into_iter()
                .map(|id| load_info(&tx, &SessionId::parse(id)?))
                .collect()
        })
        .await
    }

    /// One page through the primary key: `session > ?` in id order,
    /// `LIMIT`, so a page costs its own rows whatever the log count.
    async fn list_page(&self, after: Option<&SessionId>, limit: usize) -> Result<Vec<LogInfo>> {
        let after = after.map(|a| a.as_str().to_string());
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        self.read_with(move |conn| {
            let tx = conn.transaction().map_err(db_err)?;
            let ids: Vec<String> = {
                let mut stmt = tx
                    .prepare(
                        "SELECT session FROM logs WHERE ?1 IS NULL OR session > ?1 \
                         ORDER BY session LIMIT ?2",
                    )
                    .map_err(db_err)?;
                let rows = stmt
                    .query_map(rusqlite::params![after, limit], |r| r.get(0))
                    .map_err(db_err)?;
                rows.collect::<rusqlite::Result<_>>().map_err(db_err)?
            };
            ids.into_iter()
                .map(|id| load_info(&tx, &SessionId::parse(id)?))
                .collect()
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_are_stamped_with_the_time_now() {
        let wall = || {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_millis() as u64
        };
        let (before, stamp, after) = (wall(), now_ms(), wall());
        assert!(
            before <= stamp && stamp <= after,
            "{before} {stamp} {after}"
        );
    }

    #[test]
    fn only_a_held_lock_is_busy() {
        let sqlite = |code| {
            db_err(rusqlite::Error::SqliteFailure(
                rusqlite::ffi::Error::new(code),
                None,
            ))
        };
        assert!(is_busy(&sqlite(rusqlite::ffi::SQLITE_BUSY)));
        assert!(is_busy(&sqlite(rusqlite::ffi::SQLITE_LOCKED)));
        assert!(!is_busy(&sqlite(rusqlite::ffi::SQLITE_CONSTRAINT)));
        assert!(!is_busy(&sqlite(rusqlite::ffi::SQLITE_CORRUPT)));
        assert!(!is_busy(&Error::backend("not sqlite at all")));
    }

    #[test]
    fn the_frame_limit_in_force_is_the_one_given() {
        let log = SqliteSessionLog::open_in_memory().unwrap();
        assert_eq!(
            log.max_frame_bytes(),
            harness_core::log::DEFAULT_MAX_FRAME_BYTES
        );
        assert_eq!(log.with_max_frame_bytes(1234).max_frame_bytes(), 1234);
    }
}
