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
    check_fork_kept, check_kept, check_trim, decode_stored_meta, fork_closing_frame,
    fork_range_error, plan_append, unknown_session, AppendPlan, AppendRequest, AppendView,
    Appended, ChainKey, ChainedFrame, CheckedAppend, ForkOrigin, FrameHash, LogCut, LogHead,
    LogInfo, SessionStore,
};
use harness_core::search::{document, DocKind, Document, SearchHit, SearchQuery};
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
        last_at_ms  INTEGER NOT NULL DEFAULT 0,
        last_hash   TEXT,
        cut_through INTEGER,
        cut_hash    TEXT,
        cut_meta    TEXT
    )",
    "CREATE TABLE IF NOT EXISTS frames (
        seq      INTEGER PRIMARY KEY,
        at_ms    INTEGER NOT NULL,
        body     TEXT NOT NULL,
        idem_key TEXT,
        hash     TEXT
    )",
    "CREATE UNIQUE INDEX IF NOT EXISTS frames_idem ON frames (idem_key)
        WHERE idem_key IS NOT NULL",
    SEARCH_DOCS,
    SEARCH_FTS,
];

/// The search index (`docs/search.md`): each indexed frame's document
/// (`harness_core::search::document`, the rule every store uses) and its
/// FTS5 entry, written with the frame (no `await` between: one implicit
/// transaction). An object holds one session, so the index holds one
/// session's frames; the front asks every session's object and merges.
const SEARCH_DOCS: &str = "CREATE TABLE IF NOT EXISTS search_docs (
        seq  INTEGER PRIMARY KEY,
        kind TEXT NOT NULL,
        text TEXT NOT NULL
    )";
const SEARCH_FTS: &str = "CREATE VIRTUAL TABLE IF NOT EXISTS search_fts USING fts5(
        text, content = 'search_docs', content_rowid = 'seq', tokenize = 'unicode61'
    )";

/// Columns added after the first schema (the audit chain's, as hex
/// text), for objects created before them: `(table, column, statement)`.
const MIGRATIONS: &[(&str, &str, &str)] = &[
    (
        "logs",
        "last_hash",
        "ALTER TABLE logs ADD COLUMN last_hash TEXT",
    ),
    ("frames", "hash", "ALTER TABLE frames ADD COLUMN hash TEXT"),
    // Retention (docs/retention.md): where a trimmed log starts.
    (
        "logs",
        "cut_through",
        "ALTER TABLE logs ADD COLUMN cut_through INTEGER",
    ),
    (
        "logs",
        "cut_hash",
        "ALTER TABLE logs ADD COLUMN cut_hash TEXT",
    ),
    (
        "logs",
        "cut_meta",
        "ALTER TABLE logs ADD COLUMN cut_meta TEXT",
    ),
];

/// One session's log in a Durable Object's SQLite.
#[derive(Debug, Clone)]
pub struct DoStore {
    sql: SqlStorage,
    session: SessionId,
    max_frame_bytes: usize,
    chain_key: ChainKey,
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
    last_hash: Option<String>,
    cut_through: Option<i64>,
    cut_hash: Option<String>,
}

#[derive(Deserialize)]
struct FrameRow {
    seq: i64,
    at_ms: i64,
    body: String,
}

#[derive(Deserialize)]
struct ChainRow {
    seq: i64,
    at_ms: i64,
    body: String,
    idem_key: Option<String>,
    hash: Option<String>,
}

impl ChainRow {
    fn chained(self) -> Result<ChainedFrame> {
        let seq = self.seq;
        Ok(ChainedFrame {
            seq: seq as u64,
            at_ms: self.at_ms as u64,
            key: self.idem_key,
            body: self.body,
            hash: self
                .hash
                .as_deref()
                .map(FrameHash::parse_hex)
                .transpose()
                .map_err(|e| Error::corrupt(format!("frame {seq}: {e}")))?,
        })
    }
}

/// What a fork copies from its source: the prefix of the log up to
/// `until` as stored (each frame's body text, idempotency key and chain
/// hash), and the session's config. (One message: a fork of a very long
/// session is bounded by the runtime's request size; see
/// docs/cloudflare-worker.md.)
#[derive(Debug, Serialize, Deserialize)]
pub struct ForkPrefix {
    /// The source session.
    pub source: SessionId,
    /// The last seq copied.
    pub until: u64,
    /// The source's config.
    pub config: Option<SessionConfig>,
    /// Frames `1..=until` as stored (from the cut on, when trimmed).
    pub frames: Vec<ChainedFrame>,
    /// The source's cut, when retention trimmed it: the fork starts there
    /// too, with the meta folded through it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cut: Option<ForkCut>,
}

/// A trimmed source's cut, as a fork takes it over.
#[derive(Debug, Serialize, Deserialize)]
pub struct ForkCut {
    /// Where the kept frames start.
    pub cut: LogCut,
    /// The meta folded through `cut.through`.
    pub meta: SessionMeta,
}

pub(crate) fn db_err(e: impl std::fmt::Display) -> Error {
    Error::backend(format!("durable object sql: {e}"))
}

pub(crate) fn int(v: u64) -> SqlStorageValue {
    // Seqs and milliseconds stay far below 2^53 (JavaScript numbers).
    SqlStorageValue::Integer(i64::try_from(v).unwrap_or(i64::MAX))
}

impl DoStore {
    /// The store of `session` over `sql`, refusing frames over
    /// `max_frame_bytes`, chaining frames with `chain_key`.
    pub fn new(
        sql: SqlStorage,
        session: SessionId,
        max_frame_bytes: usize,
        chain_key: ChainKey,
    ) -> Self {
        Self {
            sql,
            session,
            max_frame_bytes,
            chain_key,
        }
    }

    /// Add the columns an object created before them lacks (once per
    /// object instance: the caller remembers it ran). Nothing to do for an
    /// object that holds no log yet.
    pub fn migrate(sql: &SqlStorage) -> Result<()> {
        #[derive(Deserialize)]
        struct Column {
            name: String,
        }
        if Self::stored_session(sql)?.is_none() {
            return Ok(());
        }
        for (table, column, statement) in MIGRATIONS {
            let columns: Vec<Column> = sql
                .exec(&format!("PRAGMA table_info({table})"), None)
                .and_then(|c| c.to_array())
                .map_err(db_err)?;
            if !columns.iter().any(|c| c.name == *column) {
                sql.exec(statement, None).map_err(db_err)?;
            }
        }
        // An object made before the search index: make it, and index the
        // frames it holds (once: the table exists afterwards).
        let indexed: Vec<Column> = sql
            .exec(
                "SELECT name FROM sqlite_master WHERE type = 'table' AND name = 'search_docs'",
                None,
            )
            .and_then(|c| c.to_array())
            .map_err(db_err)?;
        if indexed.is_empty() {
            sql.exec(SEARCH_DOCS, None).map_err(db_err)?;
            sql.exec(SEARCH_FTS, None).map_err(db_err)?;
            #[derive(Deserialize)]
            struct Stored {
                seq: i64,
                body: String,
            }
            let frames: Vec<Stored> = sql
                .exec("SELECT seq, body FROM frames ORDER BY seq", None)
                .and_then(|c| c.to_array())
                .map_err(db_err)?;
            for frame in frames {
                // A body this build cannot read stays out of the index.
                if let Some(doc) = serde_json::from_str::<FrameBody>(&frame.body)
                    .ok()
                    .and_then(|b| document(&b))
                {
                    index(sql, frame.seq as u64, &doc)?;
                }
            }
        }
        Ok(())
    }

    /// The frames of this session that match `query`, best first (lower
    /// rank is better: FTS5's BM25 over this session's frames). None when
    /// the session does not pass the query's session filters.
    pub fn search(&self, query: &SearchQuery) -> Result<Vec<SearchHit>> {
        query.check()?;
        let info = self.load_info()?;
        if !query.admits(&info.meta) {
            return Ok(Vec::new());
        }
        #[derive(Deserialize)]
        struct Hit {
            seq: i64,
            at_ms: i64,
            kind: String,
            snippet: String,
            rank: f64,
        }
        let mut sql = String::from(
            "SELECT d.seq AS seq, f.at_ms AS at_ms, d.kind AS kind,
                    snippet(search_fts, 0, '[', ']', '…', 16) AS snippet,
                    bm25(search_fts) AS rank
             FROM search_fts
             JOIN search_docs d ON d.seq = search_fts.rowid
             JOIN frames f ON f.seq = d.seq
             WHERE search_fts MATCH ?",
        );
        let mut args: Vec<SqlStorageValue> = vec![query.fts5_match()?.into()];
        if let Some(after) = query.after_ms {
            sql.push_str(" AND f.at_ms >= ?");
            args.push(int(after));
        }
        if let Some(before) = query.before_ms {
            sql.push_str(" AND f.at_ms < ?");
            args.push(int(before));
        }
        sql.push_str(" ORDER BY rank, d.seq LIMIT ?");
        args.push(int(query.limit()? as u64));
        let hits: Vec<Hit> = self
            .sql
            .exec(&sql, args)
            .and_then(|c| c.to_array())
            .map_err(db_err)?;
        hits.into_iter()
            .map(|h| {
                Ok(SearchHit {
                    session: self.session.clone(),
                    seq: h.seq as u64,
                    at_ms: h.at_ms as u64,
                    kind: DocKind::stored(&h.kind)?,
                    snippet: h.snippet,
                    rank: h.rank,
                })
            })
            .collect()
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
        Ok(self.load_head()?.0)
    }

    /// The log's info and its last frame's chain hash.
    fn load_head(&self) -> Result<(LogInfo, Option<FrameHash>)> {
        let rows: Vec<LogRow> = self
            .sql
            .exec(
                "SELECT session, sealed, forked_from, fork_until, meta, last_seq, last_at_ms,
                        last_hash, cut_through, cut_hash
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
        let last_hash = row
            .last_hash
            .as_deref()
            .map(FrameHash::parse_hex)
            .transpose()?;
        let trimmed = match row.cut_through {
            Some(through) => Some(LogCut {
                through: through as u64,
                hash: row
                    .cut_hash
                    .as_deref()
                    .map(FrameHash::parse_hex)
                    .transpose()?,
            }),
            None => None,
        };
        let info = LogInfo {
            session: self.session.clone(),
            last_seq: row.last_seq as u64,
            last_at_ms: row.last_at_ms as u64,
            sealed: row.sealed != 0,
            forked_from,
            meta,
            trimmed,
        };
        Ok((info, last_hash))
    }

    /// The prefix of this log a fork up to `until` copies (`InvalidInput`
    /// past the end, as every log answers).
    pub fn fork_prefix(&self, until: u64) -> Result<ForkPrefix> {
        let info = self.load_info()?;
        if until > info.last_seq {
            return Err(fork_range_error(&self.session, until, info.last_seq));
        }
        check_fork_kept(&self.session, info.trimmed.as_ref(), until)?;
        let kept = info.kept_after();
        let frames =
            self.read_chain_sync(kept, usize::try_from(until - kept).unwrap_or(usize::MAX))?;
        let cut = match info.trimmed {
            Some(cut) => Some(ForkCut {
                cut,
                meta: self.cut_meta()?,
            }),
            None => None,
        };
        Ok(ForkPrefix {
            source: self.session.clone(),
            until,
            config: info.meta.config,
            frames,
            cut,
        })
    }

    /// The meta folded through the cut (retention keeps it with the cut).
    fn cut_meta(&self) -> Result<SessionMeta> {
        #[derive(Deserialize)]
        struct Row {
            cut_meta: Option<String>,
        }
        let rows: Vec<Row> = self
            .sql
            .exec("SELECT cut_meta FROM logs WHERE id = 1", None)
            .and_then(|c| c.to_array())
            .map_err(db_err)?;
        let json = rows
            .into_iter()
            .next()
            .and_then(|r| r.cut_meta)
            .ok_or_else(|| {
                Error::corrupt(format!(
                    "session {} is trimmed but keeps no meta at its cut",
                    self.session
                ))
            })?;
        decode_stored_meta(&json, &self.session)
    }

    /// Remove frames `1..=through` (retention; `check_trim` decides what a
    /// cut may be): the log keeps where it starts (the cut, frame
    /// `through`'s hash, the meta folded through it) so its kept frames
    /// verify from there and a fork past the cut has the meta an untrimmed
    /// fork has; the removed frames leave the search index. No `await`:
    /// one implicit transaction.
    pub fn trim(&self, through: u64) -> Result<LogInfo> {
        let info = self.load_info()?;
        if !check_trim(&info, through)? {
            return Ok(info);
        }
        let (after, mut meta) = match info.trimmed {
            Some(cut) => (cut.through, self.cut_meta()?),
            None => (0, SessionMeta::new(info.meta.config.clone())),
        };
        let removed = self.read_chain_sync(
            after,
            usize::try_from(through - after).unwrap_or(usize::MAX),
        )?;
        for frame in &removed {
            let body: FrameBody = serde_json::from_str(&frame.body)
                .map_err(|e| Error::corrupt(format!("frame {}: {e}", frame.seq)))?;
            meta.apply(frame.seq, &body, frame.key.as_deref());
        }
        let hash = removed
            .last()
            .filter(|f| f.seq == through)
            .and_then(|f| f.hash)
            .map(|h| h.to_hex());
        let meta = serde_json::to_string(&meta).map_err(db_err)?;
        self.sql
            .exec(
                "UPDATE logs SET cut_through = ?, cut_hash = ?, cut_meta = ? WHERE id = 1",
                vec![int(through), hash.into(), meta.into()],
            )
            .map_err(db_err)?;
        self.sql
            .exec(
                "INSERT INTO search_fts (search_fts, rowid, text)
                 SELECT 'delete', seq, text FROM search_docs WHERE seq <= ?",
                vec![int(through)],
            )
            .map_err(db_err)?;
        for statement in [
            "DELETE FROM search_docs WHERE seq <= ?",
            "DELETE FROM frames WHERE seq <= ?",
        ] {
            self.sql
                .exec(statement, vec![int(through)])
                .map_err(db_err)?;
        }
        self.load_info()
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
        let bodies = prefix
            .frames
            .iter()
            .map(|f| {
                serde_json::from_str::<FrameBody>(&f.body)
                    .map_err(|e| Error::invalid(format!("fork prefix frame {}: {e}", f.seq)))
            })
            .collect::<Result<Vec<_>>>()?;
        // From the source's cut when it was trimmed (the meta folded
        // through it), else from the config.
        let mut meta = match &prefix.cut {
            Some(cut) => cut.meta.clone(),
            None => SessionMeta::new(prefix.config.clone()),
        };
        for (frame, body) in prefix.frames.iter().zip(&bodies) {
            meta.apply(frame.seq, body, frame.key.as_deref());
        }
        let sealed = bodies.iter().any(|b| matches!(b, FrameBody::Sealed {}));
        let last_at_ms = prefix.frames.last().map_or(0, |f| f.at_ms);
        // The copy keeps the source's bodies as stored and their hashes:
        // the fork's chain continues from the source's hash at the cut.
        for (frame, body) in prefix.frames.iter().zip(&bodies) {
            self.sql
                .exec(
                    "INSERT INTO frames (seq, at_ms, body, idem_key, hash) VALUES (?, ?, ?, ?, ?)",
                    vec![
                        int(frame.seq),
                        int(frame.at_ms),
                        frame.body.clone().into(),
                        frame.key.clone().into(),
                        frame.hash.map(|h| h.to_hex()).into(),
                    ],
                )
                .map_err(db_err)?;
            // The copy's index, from its own frames.
            if let Some(doc) = document(body) {
                index(&self.sql, frame.seq, &doc)?;
            }
        }
        let last_hash = prefix
            .frames
            .last()
            .and_then(|f| f.hash)
            .map(|h| h.to_hex());
        let meta_json = serde_json::to_string(&meta).map_err(db_err)?;
        // The fork starts where its source does: at the cut it copied.
        let (cut_through, cut_hash, cut_meta) = match &prefix.cut {
            Some(cut) => (
                int(cut.cut.through),
                cut.cut.hash.map(|h| h.to_hex()).into(),
                serde_json::to_string(&cut.meta).map_err(db_err)?.into(),
            ),
            None => (
                SqlStorageValue::Null,
                SqlStorageValue::Null,
                SqlStorageValue::Null,
            ),
        };
        self.sql
            .exec(
                "INSERT INTO logs (id, session, sealed, forked_from, fork_until, meta, last_seq, last_at_ms,
                                   last_hash, cut_through, cut_hash, cut_meta)
                 VALUES (1, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                vec![
                    self.session.as_str().into(),
                    int(u64::from(sealed)),
                    prefix.source.as_str().into(),
                    int(prefix.until),
                    meta_json.into(),
                    int(prefix.until),
                    int(last_at_ms),
                    last_hash.into(),
                    cut_through,
                    cut_hash,
                    cut_meta,
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

    /// `Gone` for a read from inside the cut (`check_kept`, every
    /// store's rule).
    fn check_kept(&self, after: u64) -> Result<()> {
        let info = self.load_info()?;
        check_kept(&self.session, info.trimmed.as_ref(), after)
    }

    fn read_sync(&self, after: u64, limit: usize) -> Result<Vec<Frame>> {
        self.check_kept(after)?;
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

    fn read_chain_sync(&self, after: u64, limit: usize) -> Result<Vec<ChainedFrame>> {
        self.check_kept(after)?;
        let rows: Vec<ChainRow> = self
            .sql
            .exec(
                "SELECT seq, at_ms, body, idem_key, hash FROM frames WHERE seq > ?
                 ORDER BY seq LIMIT ?",
                vec![int(after), int(limit as u64)],
            )
            .and_then(|c| c.to_array())
            .map_err(db_err)?;
        rows.into_iter().map(ChainRow::chained).collect()
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
            &self.chain_key,
        )? {
            AppendPlan::Duplicate(appended) => return Ok(appended),
            AppendPlan::Write(new) => new,
        };
        let (seq, at_ms) = (new.frame.seq, new.frame.at_ms);
        // No await from here to the end: one implicit transaction.
        self.sql
            .exec(
                "INSERT INTO frames (seq, at_ms, body, idem_key, hash) VALUES (?, ?, ?, ?, ?)",
                vec![
                    int(seq),
                    int(at_ms),
                    new.body_json.clone().into(),
                    new.key.clone().into(),
                    new.hash.map(|h| h.to_hex()).into(),
                ],
            )
            .map_err(db_err)?;
        if let Some(doc) = &new.document {
            index(&self.sql, seq, doc)?;
        }
        let sealed = int(u64::from(new.seals));
        let hash: SqlStorageValue = new.hash.map(|h| h.to_hex()).into();
        match &new.meta {
            None => self.sql.exec(
                "UPDATE logs SET last_seq = ?, last_at_ms = ?, last_hash = ?, sealed = sealed OR ?
                 WHERE id = 1",
                vec![int(seq), int(at_ms), hash, sealed],
            ),
            Some(meta) => {
                let meta = serde_json::to_string(meta).map_err(db_err)?;
                self.sql.exec(
                    "UPDATE logs SET last_seq = ?, last_at_ms = ?, last_hash = ?, sealed = sealed OR ?,
                     meta = ? WHERE id = 1",
                    vec![int(seq), int(at_ms), hash, sealed, meta.into()],
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
    info: Option<(LogInfo, Option<FrameHash>)>,
}

impl DoView<'_> {
    fn head_row(&mut self) -> Result<&(LogInfo, Option<FrameHash>)> {
        if self.info.is_none() {
            self.info = Some(self.store.load_head()?);
        }
        Ok(self.info.as_ref().expect("just loaded"))
    }

    fn info(&mut self) -> Result<&LogInfo> {
        Ok(&self.head_row()?.0)
    }
}

impl AppendView for DoView<'_> {
    fn session(&self) -> &SessionId {
        &self.store.session
    }

    fn head(&mut self) -> Result<LogHead> {
        let (info, last_hash) = self.head_row()?;
        Ok(LogHead {
            last_seq: info.last_seq,
            sealed: info.sealed,
            last_hash: *last_hash,
        })
    }

    fn frame_by_key(&mut self, key: &str) -> Result<Option<Frame>> {
        self.store.frame_by_key(key)
    }

    fn meta(&mut self) -> Result<SessionMeta> {
        Ok(self.info()?.meta.clone())
    }
}

/// Index frame `seq`'s document (see [`SEARCH_DOCS`]).
fn index(sql: &SqlStorage, seq: u64, doc: &Document) -> Result<()> {
    sql.exec(
        "INSERT OR IGNORE INTO search_docs (seq, kind, text) VALUES (?, ?, ?)",
        vec![int(seq), doc.kind.as_str().into(), doc.text.clone().into()],
    )
    .map_err(db_err)?;
    sql.exec(
        "INSERT INTO search_fts (rowid, text) VALUES (?, ?)",
        vec![int(seq), doc.text.clone().into()],
    )
    .map_err(db_err)?;
    Ok(())
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

    async fn read_chain(&self, after: u64, limit: usize) -> Result<Vec<ChainedFrame>> {
        self.read_chain_sync(after, limit)
    }
}
