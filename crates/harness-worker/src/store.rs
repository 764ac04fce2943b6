//! [`DoStore`]: one session's log in its Durable Object's SQLite — core's
//! [`SessionStore`], what the actor driver reads and writes.
//!
//! The schema mirrors `session-log`'s (`logs`, `frames` with the
//! idempotency key and its unique index) without the `session` column: a
//! Durable Object holds exactly one session. The log's row also keeps the
//! last seq and its time, so an append never scans.
//!
//! Atomicity: Durable Object SQL has no `BEGIN`; the runtime commits every
//! write made without an `await` in between as one implicit transaction,
//! and holds the object's outgoing messages until it is durable (output
//! gates). An append's insert and its meta update are made back to back
//! with no `await`, so they are stored together or not at all, and no
//! response leaves before they are stored.

use async_trait::async_trait;
use harness_core::frame::{Frame, FrameBody, SessionId};
use harness_core::log::{
    fold_meta, fork_closing_frame, fork_range_error, plan_append, unknown_session, AppendPlan,
    AppendRequest, AppendView, Appended, CheckedAppend, ForkOrigin, LogHead, LogInfo, SessionStore,
};
use harness_core::session::{SessionConfig, SessionMeta};
use harness_core::{Error, Result};
use serde::{Deserialize, Serialize};
use worker::{SqlStorage, SqlStorageValue};

const SCHEMA: &[&str] = &[
    "CREATE TABLE IF NOT EXISTS logs (
        id          INTEGER PRIMARY KEY CHECK (id = 1),
        session     TEXT NOT NULL,
        sealed      INTEGER NOT NULL DEFAULT 0,
        forked_from TEXT,
        fork_until  INTEGER,
        meta        TEXT NOT NULL,
        last_seq    INTEGER NOT NULL DEFAULT 0,
        last_at_ms  INTEGER NOT NULL DEFAULT 0
    )",
    "CREATE TABLE IF NOT EXISTS frames (
        seq      INTEGER PRIMARY KEY,
        at_ms    INTEGER NOT NULL,
        body     TEXT NOT NULL,
        idem_key TEXT
    )",
    "CREATE UNIQUE INDEX IF NOT EXISTS frames_idem ON frames (idem_key)
        WHERE idem_key IS NOT NULL",
];

/// One session's log in a Durable Object's SQLite.
#[derive(Debug, Clone)]
pub struct DoStore {
    sql: SqlStorage,
    session: SessionId,
    max_frame_bytes: usize,
}

#[derive(Deserialize)]
struct LogRow {
    session: String,
    sealed: i64,
    forked_from: Option<String>,
    fork_until: Option<i64>,
    meta: String,
    last_seq: i64,
    last_at_ms: i64,
}

#[derive(Deserialize)]
struct FrameRow {
    seq: i64,
    at_ms: i64,
    body: String,
}

#[derive(Deserialize)]
struct KeyedFrameRow {
    seq: i64,
    at_ms: i64,
    body: String,
    idem_key: Option<String>,
}

/// What a fork copies from its source: the prefix of the log up to
/// `until`, with each frame's idempotency key, and the session's config.
/// (One message: a fork of a very long session is bounded by the
/// runtime's request size; see docs/cloudflare-worker.md.)
#[derive(Debug, Serialize, Deserialize)]
pub struct ForkPrefix {
    /// The source session.
    pub source: SessionId,
    /// The last seq copied.
    pub until: u64,
    /// The source's config.
    pub config: Option<SessionConfig>,
    /// Frames `1..=until` and their keys.
    pub frames: Vec<(Frame, Option<String>)>,
}

fn db_err(e: impl std::fmt::Display) -> Error {
    Error::backend(format!("durable object sql: {e}"))
}

fn int(v: u64) -> SqlStorageValue {
    // Seqs and milliseconds stay far below 2^53 (JavaScript numbers).
    SqlStorageValue::Integer(i64::try_from(v).unwrap_or(i64::MAX))
}

impl DoStore {
    /// The store of `session` over `sql`, refusing frames over
    /// `max_frame_bytes`.
    pub fn new(sql: SqlStorage, session: SessionId, max_frame_bytes: usize) -> Self {
        Self {
            sql,
            session,
            max_frame_bytes,
        }
    }

    /// The session id this object holds, if it was created (read without
    /// creating any table, so asking an unknown session writes nothing).
    pub fn stored_session(sql: &SqlStorage) -> Result<Option<SessionId>> {
        #[derive(Deserialize)]
        struct Name {
            name: String,
        }
        let tables: Vec<Name> = sql
            .exec(
                "SELECT name FROM sqlite_master WHERE type = 'table' AND name = 'logs'",
                None,
            )
            .and_then(|c| c.to_array())
            .map_err(db_err)?;
        if !tables.iter().any(|t| t.name == "logs") {
            return Ok(None);
        }
        #[derive(Deserialize)]
        struct Session {
            session: String,
        }
        let rows: Vec<Session> = sql
            .exec("SELECT session FROM logs WHERE id = 1", None)
            .and_then(|c| c.to_array())
            .map_err(db_err)?;
        rows.into_iter()
            .next()
            .map(|r| SessionId::parse(r.session))
            .transpose()
    }

    /// Create the log (schema and the log's row) with `config`; an existing
    /// log is left as it is. Returns its info.
    pub fn create(&self, config: Option<SessionConfig>) -> Result<LogInfo> {
        for statement in SCHEMA {
            self.sql.exec(statement, None).map_err(db_err)?;
        }
        let meta = serde_json::to_string(&SessionMeta::new(config)).map_err(db_err)?;
        self.sql
            .exec(
                "INSERT OR IGNORE INTO logs (id, session, meta) VALUES (1, ?, ?)",
                vec![self.session.as_str().into(), meta.into()],
            )
            .map_err(db_err)?;
        self.load_info()
    }

    fn load_info(&self) -> Result<LogInfo> {
        let rows: Vec<LogRow> = self
            .sql
            .exec(
                "SELECT session, sealed, forked_from, fork_until, meta, last_seq, last_at_ms
                 FROM logs WHERE id = 1",
                None,
            )
            .and_then(|c| c.to_array())
            .map_err(db_err)?;
        let row = rows
            .into_iter()
            .next()
            .ok_or_else(|| unknown_session(&self.session))?;
        if row.session != self.session.as_str() {
            return Err(Error::conflict(format!(
                "this durable object holds session {}, not {}",
                row.session, self.session
            )));
        }
        let meta: SessionMeta = serde_json::from_str(&row.meta).map_err(db_err)?;
        let forked_from = match (row.forked_from, row.fork_until) {
            (Some(session), Some(until)) => Some(ForkOrigin {
                session: SessionId::parse(session)?,
                until: until as u64,
            }),
            _ => None,
        };
        Ok(LogInfo {
            session: self.session.clone(),
            last_seq: row.last_seq as u64,
            last_at_ms: row.last_at_ms as u64,
            sealed: row.sealed != 0,
            forked_from,
            meta,
        })
    }

    /// The prefix of this log a fork up to `until` copies (`InvalidInput`
    /// past the end, as every log answers).
    pub fn fork_prefix(&self, until: u64) -> Result<ForkPrefix> {
        let info = self.load_info()?;
        if until > info.last_seq {
            return Err(fork_range_error(&self.session, until, info.last_seq));
        }
        let rows: Vec<KeyedFrameRow> = self
            .sql
            .exec(
                "SELECT seq, at_ms, body, idem_key FROM frames WHERE seq <= ? ORDER BY seq",
                vec![int(until)],
            )
            .and_then(|c| c.to_array())
            .map_err(db_err)?;
        let frames = rows
            .into_iter()
            .map(|r| {
                let key = r.idem_key;
                let frame = decode(FrameRow {
                    seq: r.seq,
                    at_ms: r.at_ms,
                    body: r.body,
                })?;
                Ok((frame, key))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(ForkPrefix {
            source: self.session.clone(),
            until,
            config: info.meta.config,
            frames,
        })
    }

    /// Create this log as a fork of `prefix`'s source: its frames and keys
    /// as they were, the meta folded from them, the origin recorded and,
    /// when the prefix ends inside a running turn, the frame that closes
    /// it (core's `fork_closing_frame`, as every log does). `Conflict` when
    /// this session exists. No `await` inside: one implicit transaction.
    pub fn create_fork(&self, prefix: ForkPrefix) -> Result<LogInfo> {
        if Self::stored_session(&self.sql)?.is_some() {
            return Err(Error::conflict(format!(
                "cannot fork into {}: that session already exists",
                self.session
            )));
        }
        for statement in SCHEMA {
            self.sql.exec(statement, None).map_err(db_err)?;
        }
        let meta = fold_meta(
            prefix.config.clone(),
            prefix
                .frames
                .iter()
                .map(|(f, key)| (f.seq, &f.body, key.as_deref())),
        );
        let sealed = prefix
            .frames
            .iter()
            .any(|(f, _)| matches!(f.body, FrameBody::Sealed {}));
        let last_at_ms = prefix.frames.last().map_or(0, |(f, _)| f.at_ms);
        for (frame, key) in &prefix.frames {
            let body = serde_json::to_string(&frame.body).map_err(db_err)?;
            self.sql
                .exec(
                    "INSERT INTO frames (seq, at_ms, body, idem_key) VALUES (?, ?, ?, ?)",
                    vec![
                        int(frame.seq),
                        int(frame.at_ms),
                        body.into(),
                        key.clone().into(),
                    ],
                )
                .map_err(db_err)?;
        }
        let meta_json = serde_json::to_string(&meta).map_err(db_err)?;
        self.sql
            .exec(
                "INSERT INTO logs (id, session, sealed, forked_from, fork_until, meta, last_seq, last_at_ms)
                 VALUES (1, ?, ?, ?, ?, ?, ?, ?)",
                vec![
                    self.session.as_str().into(),
                    int(u64::from(sealed)),
                    prefix.source.as_str().into(),
                    int(prefix.until),
                    meta_json.into(),
                    int(prefix.until),
                    int(last_at_ms),
                ],
            )
            .map_err(db_err)?;
        if let Some(closing) = fork_closing_frame(&meta, sealed, &prefix.source, prefix.until) {
            self.append_sync(closing, now_ms())?;
        }
        self.load_info()
    }

    fn frame_by_key(&self, key: &str) -> Result<Option<Frame>> {
        let rows: Vec<FrameRow> = self
            .sql
            .exec(
                "SELECT seq, at_ms, body FROM frames WHERE idem_key = ?",
                vec![key.into()],
            )
            .and_then(|c| c.to_array())
            .map_err(db_err)?;
        rows.into_iter().next().map(decode).transpose()
    }

    fn read_sync(&self, after: u64, limit: usize) -> Result<Vec<Frame>> {
        let rows: Vec<FrameRow> = self
            .sql
            .exec(
                "SELECT seq, at_ms, body FROM frames WHERE seq > ? ORDER BY seq LIMIT ?",
                vec![int(after), int(limit as u64)],
            )
            .and_then(|c| c.to_array())
            .map_err(db_err)?;
        rows.into_iter().map(decode).collect()
    }

    /// An append: `harness_core::log`'s decision over this object's log,
    /// then exactly what it says written.
    fn append_sync(&self, request: AppendRequest, now_ms: u64) -> Result<Appended> {
        let append = CheckedAppend::new(request, self.max_frame_bytes)?;
        let new = match plan_append(
            &mut DoView {
                store: self,
                info: None,
            },
            append,
            now_ms,
        )? {
            AppendPlan::Duplicate(appended) => return Ok(appended),
            AppendPlan::Write(new) => new,
        };
        let (seq, at_ms) = (new.frame.seq, new.frame.at_ms);
        // No await from here to the end: one implicit transaction.
        self.sql
            .exec(
                "INSERT INTO frames (seq, at_ms, body, idem_key) VALUES (?, ?, ?, ?)",
                vec![
                    int(seq),
                    int(at_ms),
                    new.body_json.clone().into(),
                    new.key.clone().into(),
                ],
            )
            .map_err(db_err)?;
        let sealed = int(u64::from(new.seals));
        match &new.meta {
            None => self.sql.exec(
                "UPDATE logs SET last_seq = ?, last_at_ms = ?, sealed = sealed OR ? WHERE id = 1",
                vec![int(seq), int(at_ms), sealed],
            ),
            Some(meta) => {
                let meta = serde_json::to_string(meta).map_err(db_err)?;
                self.sql.exec(
                    "UPDATE logs SET last_seq = ?, last_at_ms = ?, sealed = sealed OR ?, meta = ? WHERE id = 1",
                    vec![int(seq), int(at_ms), sealed, meta.into()],
                )
            }
        }
        .map_err(db_err)?;
        Ok(new.appended())
    }
}

/// The object's log as the append decision reads it (the log's row read
/// once, with its meta).
struct DoView<'a> {
    store: &'a DoStore,
    info: Option<LogInfo>,
}

impl DoView<'_> {
    fn info(&mut self) -> Result<&LogInfo> {
        if self.info.is_none() {
            self.info = Some(self.store.load_info()?);
        }
        Ok(self.info.as_ref().expect("just loaded"))
    }
}

impl AppendView for DoView<'_> {
    fn session(&self) -> &SessionId {
        &self.store.session
    }

    fn head(&mut self) -> Result<LogHead> {
        let info = self.info()?;
        Ok(LogHead {
            last_seq: info.last_seq,
            sealed: info.sealed,
        })
    }

    fn frame_by_key(&mut self, key: &str) -> Result<Option<Frame>> {
        self.store.frame_by_key(key)
    }

    fn meta(&mut self) -> Result<SessionMeta> {
        Ok(self.info()?.meta.clone())
    }
}

fn decode(row: FrameRow) -> Result<Frame> {
    Ok(Frame {
        seq: row.seq as u64,
        at_ms: row.at_ms as u64,
        body: serde_json::from_str(&row.body).map_err(db_err)?,
    })
}

/// Now, in ms since the epoch (the Worker's clock: frozen during a request
/// in production, which stamps a request's frames alike).
pub fn now_ms() -> u64 {
    worker::Date::now().as_millis()
}

#[async_trait(?Send)]
impl SessionStore for DoStore {
    fn session(&self) -> &SessionId {
        &self.session
    }

    async fn info(&self) -> Result<LogInfo> {
        self.load_info()
    }

    async fn append(&self, request: AppendRequest) -> Result<Appended> {
        self.append_sync(request, now_ms())
    }

    async fn read(&self, after: u64, limit: usize) -> Result<Vec<Frame>> {
        self.read_sync(after, limit)
    }
}
