//! # session-log-postgres
//!
//! The session log ([`SessionLog`]) and the turn store ([`TurnStore`]) on
//! PostgreSQL, for several `harness serve` nodes sharing one database
//! (`docs/scale.md`). The rules are core's: every append is
//! [`plan_append`]'s decision over what the database holds, inside one
//! transaction that holds the session's row lock, so appends from any
//! number of nodes to one session are serialized by PostgreSQL and stay
//! gap-free; this crate only reads what the decision asks for and writes
//! what it says.
//!
//! ```text
//! harness_logs   (session PK, sealed, forked_from, fork_until, meta,
//!                 last_seq, last_at_ms, last_hash,   one row per session: the head,
//!                 cut_through, cut_hash, cut_meta)   and retention's cut
//! harness_frames (session, seq) PK, at_ms, body, idem_key, hash
//!                 unique (session, idem_key) where idem_key is not null
//! harness_search (session, seq) PK, kind, text, doc  the search index
//! harness_turns  (session, turn) PK, state, done, generation
//! harness_leases (session PK, node, generation, expires_at)
//! harness_schema (version)                           refuses a newer schema
//! ```
//!
//! The cut columns are NULL for a log never trimmed. After
//! [`trim`](SessionLog::trim) through `N` they hold `N` (the last seq
//! removed), frame `N`'s chain hash (where the kept frames verify from)
//! and the meta folded through frame `N` (what a fork past the cut folds
//! its copied frames onto); a fork copies them. [`delete`](SessionLog::delete)
//! removes a session's rows from every table but `harness_schema`.
//!
//! Bodies and metas are stored as JSON *text* (not `jsonb`), the bytes the
//! decision encoded: numbers travel bit-exact, as in every other store.

use std::time::Duration;

use async_trait::async_trait;
use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Transaction};
use harness_core::frame::{Frame, FrameBody, SessionId};
use harness_core::log::chain::{ChainKey, ChainedFrame, FrameHash};
use harness_core::log::{
    check_fork_kept, check_kept, check_trim, decode_stored_body, decode_stored_meta,
    fork_closing_frame, fork_copy_sealed, plan_append, unknown_session, AppendPlan, AppendRequest,
    AppendView, Appended, CheckedAppend, ForkOrigin, LogCut, LogHead, LogInfo, SessionLog,
    DEFAULT_MAX_FRAME_BYTES,
};
use harness_core::search::{DocKind, SearchHit, SearchQuery};
use harness_core::session::{SessionConfig, SessionMeta};
use harness_core::{Error, Result};

mod lease;
mod schema;
mod turn_store;

pub use lease::{Lease, Leases, DEFAULT_LEASE_TTL};
pub use schema::SCHEMA_VERSION;
pub use turn_store::PostgresTurnStore;

/// Connections the pool keeps open at most (each a PostgreSQL backend).
const DEFAULT_POOL_SIZE: usize = 16;
/// How long connecting (or waiting for a pooled connection) may take
/// before the call fails with the reason.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Milliseconds since the Unix epoch, the stamp of stored frames (this
/// backend runs natively and keeps time itself; core takes a clock).
fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// A PostgreSQL failure as the crate's error kinds: a unique violation is a
/// conflict (two nodes made the same thing at once), the rest the backend's.
pub(crate) fn db_err(e: tokio_postgres::Error) -> Error {
    if e.code() == Some(&tokio_postgres::error::SqlState::UNIQUE_VIOLATION) {
        return Error::conflict(format!("PostgreSQL: {e}"));
    }
    match e.as_db_error() {
        Some(db) => Error::backend(format!(
            "PostgreSQL: {}: {}",
            db.code().code(),
            db.message()
        )),
        None => Error::backend(format!("PostgreSQL: {e}")),
    }
}

pub(crate) fn pool_err(e: deadpool_postgres::PoolError) -> Error {
    match e {
        deadpool_postgres::PoolError::Backend(e) => db_err(e),
        other => Error::backend(format!("PostgreSQL connection pool: {other}")),
    }
}

/// The URL with its password, if any, blanked: what errors show.
pub fn redacted(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let userinfo = &url[scheme + 3..at];
            match userinfo.split_once(':') {
                Some((user, _)) => format!("{}{user}:***{}", &url[..scheme + 3], &url[at..]),
                None => url.to_string(),
            }
        }
        _ => url.to_string(),
    }
}

/// How long PostgreSQL lets a connection of ours sit idle inside a
/// transaction before it ends it (a paused node must not hold other
/// nodes' takeovers for longer than a lease).
pub const IDLE_IN_TRANSACTION: Duration = Duration::from_secs(10);

/// Session logs in a PostgreSQL database. Cheap to clone (a pool).
#[derive(Clone)]
pub struct PostgresSessionLog {
    pool: Pool,
    chain: ChainKey,
    max_frame_bytes: usize,
    /// Set on a node's handle: appends need the session's lease.
    fence: Option<Leases>,
}

impl std::fmt::Debug for PostgresSessionLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresSessionLog")
            .field("pool", &self.pool.status())
            .field("max_frame_bytes", &self.max_frame_bytes)
            .finish_non_exhaustive()
    }
}

impl PostgresSessionLog {
    /// Connect to `url` (`postgres://user:password@host:port/db`), make the
    /// schema if the database has none, and refuse a database whose schema
    /// is newer than this build's. Fails within [`CONNECT_TIMEOUT`] with the
    /// reason when the database cannot be reached.
    pub async fn connect(url: &str) -> Result<Self> {
        let pool = pool(url, DEFAULT_POOL_SIZE)?;
        let client = tokio::time::timeout(CONNECT_TIMEOUT, pool.get())
            .await
            .map_err(|_| {
                Error::backend(format!(
                    "PostgreSQL at {} did not answer within {}s",
                    redacted(url),
                    CONNECT_TIMEOUT.as_secs()
                ))
            })?
            .map_err(|e| {
                Error::backend(format!(
                    "cannot connect to PostgreSQL at {}: {}",
                    redacted(url),
                    pool_err(e).message()
                ))
            })?;
        schema::migrate(&client).await?;
        drop(client);
        Ok(Self {
            pool,
            chain: ChainKey::unkeyed(),
            max_frame_bytes: DEFAULT_MAX_FRAME_BYTES,
            fence: None,
        })
    }

    /// The session leases of node `node` in this database (`docs/scale.md`),
    /// each lasting `ttl` unless renewed.
    pub fn leases(&self, node: &str, ttl: Duration) -> Result<Leases> {
        Leases::new(self.pool.clone(), node, ttl)
    }

    /// This log as `leases`' node writes it: every append (and seal) checks,
    /// in its transaction, that the node still holds the session's lease at
    /// the generation it acquired, and is refused as `Fenced` otherwise.
    pub fn fenced(&self, leases: Leases) -> Self {
        Self {
            fence: Some(leases),
            ..self.clone()
        }
    }

    /// Chain new frames under `key` (the audit chain, `docs/audit.md`).
    pub fn with_chain_key(mut self, key: ChainKey) -> Self {
        self.chain = key;
        self
    }

    /// Refuse frames whose encoded body is larger than `max` bytes.
    pub fn with_max_frame_bytes(mut self, max: usize) -> Self {
        self.max_frame_bytes = max;
        self
    }

    /// The largest frame body accepted.
    pub fn max_frame_bytes(&self) -> usize {
        self.max_frame_bytes
    }

    /// The turn store in the same database (same pool).
    pub fn turn_store(&self) -> PostgresTurnStore {
        PostgresTurnStore::from_pool(self.pool.clone())
    }

    pub(crate) async fn client(&self) -> Result<deadpool_postgres::Object> {
        client(&self.pool).await
    }

    /// `columns` of `session`'s frames with `seq > after`, at most `limit`,
    /// in order, starting at column [`FRAME_COLUMN`] of each row; `NotFound`
    /// for an unknown session, `Gone` from inside its cut. One statement,
    /// so one snapshot: the log's row (its existence and cut) and the
    /// frames are read as of the same moment, never across a trim.
    async fn page(
        &self,
        session: &SessionId,
        after: u64,
        limit: usize,
        columns: &str,
    ) -> Result<Vec<tokio_postgres::Row>> {
        let client = self.client().await?;
        let after_i = i64::try_from(after).unwrap_or(i64::MAX);
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        // The log's row, then (joined) its page: no frame row — an empty
        // page — leaves one row of NULL frame columns.
        let stmt = client
            .prepare_cached(&format!(
                "SELECT l.cut_through, l.cut_hash, f.* FROM harness_logs l \
                 LEFT JOIN LATERAL (SELECT {columns} FROM harness_frames \
                 WHERE session = l.session AND seq > $2 ORDER BY seq LIMIT $3) f ON TRUE \
                 WHERE l.session = $1 ORDER BY {}",
                FRAME_COLUMN + 1
            ))
            .await
            .map_err(db_err)?;
        let mut rows = client
            .query(&stmt, &[&session.as_str(), &after_i, &limit])
            .await
            .map_err(db_err)?;
        let first = rows.first().ok_or_else(|| unknown_session(session))?;
        let cut = cut_from_row(first, 0, session)?;
        check_kept(session, cut.as_ref(), after)?;
        rows.retain(|r| r.get::<_, Option<i64>>(FRAME_COLUMN).is_some());
        Ok(rows)
    }
}

/// Where the frame columns start in a row of [`PostgresSessionLog::page`]
/// (after the log's `cut_through` and `cut_hash`); the first is `seq`.
const FRAME_COLUMN: usize = 2;

pub(crate) fn pool(url: &str, size: usize) -> Result<Pool> {
    let config: tokio_postgres::Config = url.parse().map_err(|e| {
        Error::invalid(format!(
            "not a PostgreSQL URL ({}): {e}; expected postgres://user[:password]@host[:port]/database",
            redacted(url)
        ))
    })?;
    let mut config = config;
    config.connect_timeout(CONNECT_TIMEOUT);
    // A node paused (or cut off) inside a transaction holds its rows
    // locked — an append holds its session's head and lease rows — and
    // with them every other node's takeover of those sessions. The server
    // ends such a transaction after this long; ours never sit idle inside
    // one (each statement follows the last at once).
    let timeout = format!(
        "-c idle_in_transaction_session_timeout={}",
        IDLE_IN_TRANSACTION.as_millis()
    );
    let options = match config.get_options() {
        Some(given) if !given.is_empty() => format!("{given} {timeout}"),
        _ => timeout,
    };
    config.options(options);
    let manager = Manager::from_config(
        config,
        tokio_postgres::NoTls,
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    Pool::builder(manager)
        .max_size(size)
        .wait_timeout(Some(CONNECT_TIMEOUT))
        .create_timeout(Some(CONNECT_TIMEOUT))
        .runtime(deadpool_postgres::Runtime::Tokio1)
        .build()
        .map_err(|e| Error::backend(format!("PostgreSQL connection pool: {e}")))
}

pub(crate) async fn client(pool: &Pool) -> Result<deadpool_postgres::Object> {
    pool.get().await.map_err(pool_err)
}

fn decode_hash(bytes: Option<&[u8]>, session: &SessionId, seq: i64) -> Result<Option<FrameHash>> {
    bytes
        .map(FrameHash::from_slice)
        .transpose()
        .map_err(|e| Error::corrupt(format!("frame {seq} of session {session}: {e}")))
}

const INFO_COLUMNS: &str =
    "sealed, forked_from, fork_until, meta, last_seq, last_at_ms, cut_through, cut_hash";

/// How many columns [`INFO_COLUMNS`] names (a query's next one is at this
/// index).
const INFO_COUNT: usize = 8;

/// The cut in columns `at` (`cut_through`) and `at + 1` (`cut_hash`) of
/// `row`: `None` for a log never trimmed.
fn cut_from_row(
    row: &tokio_postgres::Row,
    at: usize,
    session: &SessionId,
) -> Result<Option<LogCut>> {
    let Some(through) = row.get::<_, Option<i64>>(at) else {
        return Ok(None);
    };
    Ok(Some(LogCut {
        through: through as u64,
        hash: decode_hash(row.get::<_, Option<&[u8]>>(at + 1), session, through)?,
    }))
}

fn info_from_row(row: &tokio_postgres::Row, session: &SessionId) -> Result<LogInfo> {
    let forked_from: Option<String> = row.get(1);
    let fork_until: Option<i64> = row.get(2);
    let meta: String = row.get(3);
    let last_seq: i64 = row.get(4);
    let last_at_ms: i64 = row.get(5);
    Ok(LogInfo {
        session: session.clone(),
        last_seq: last_seq as u64,
        last_at_ms: last_at_ms as u64,
        sealed: row.get(0),
        forked_from: match (forked_from, fork_until) {
            (Some(source), Some(until)) => Some(ForkOrigin {
                session: SessionId::parse(source)?,
                until: until as u64,
            }),
            _ => None,
        },
        meta: decode_stored_meta(&meta, session)?,
        trimmed: cut_from_row(row, 6, session)?,
    })
}

/// `session`'s info as `tx` (or a client) sees it.
async fn load_info<C: deadpool_postgres::GenericClient + Sync>(
    c: &C,
    session: &SessionId,
) -> Result<LogInfo> {
    let row = c
        .query_opt(
            &format!("SELECT {INFO_COLUMNS} FROM harness_logs WHERE session = $1"),
            &[&session.as_str()],
        )
        .await
        .map_err(db_err)?
        .ok_or_else(|| unknown_session(session))?;
    info_from_row(&row, session)
}

/// `session`'s info and its cut meta (the `cut_meta` column), read in `tx`
/// with the log's row locked (`FOR UPDATE`, as an append takes it): the
/// head cannot move until `tx` ends.
async fn lock_log(tx: &Transaction<'_>, session: &SessionId) -> Result<(LogInfo, Option<String>)> {
    let stmt = tx
        .prepare_cached(&format!(
            "SELECT {INFO_COLUMNS}, cut_meta FROM harness_logs WHERE session = $1 FOR UPDATE"
        ))
        .await
        .map_err(db_err)?;
    let row = tx
        .query_opt(&stmt, &[&session.as_str()])
        .await
        .map_err(db_err)?
        .ok_or_else(|| unknown_session(session))?;
    Ok((info_from_row(&row, session)?, row.get(INFO_COUNT)))
}

/// Where folding `info`'s kept frames starts: the last seq removed and the
/// meta folded through it (the stored cut meta), or 0 and a fresh meta
/// under the session's config for a log never trimmed.
fn fold_start(info: &LogInfo, cut_meta: Option<&str>) -> Result<(u64, SessionMeta)> {
    match (&info.trimmed, cut_meta) {
        (None, _) => Ok((0, SessionMeta::new(info.meta.config.clone()))),
        (Some(cut), Some(json)) => Ok((cut.through, decode_stored_meta(json, &info.session)?)),
        (Some(cut), None) => Err(Error::corrupt(format!(
            "session {} is trimmed through seq {} but keeps no meta for its cut",
            info.session, cut.through
        ))),
    }
}

/// Frames [`fold_frames`] reads at a time.
const FOLD_PAGE: i64 = 1000;

/// Fold `session`'s frames `after + 1..=until` (with their idempotency
/// keys) into `meta`, a page at a time. Answers the last folded frame's
/// seq, `at_ms` and hash (`None` when there was no frame).
async fn fold_frames<C: deadpool_postgres::GenericClient + Sync>(
    c: &C,
    session: &SessionId,
    meta: &mut SessionMeta,
    after: u64,
    until: u64,
) -> Result<Option<(i64, i64, Option<Vec<u8>>)>> {
    let stmt = c
        .prepare_cached(
            "SELECT seq, body, idem_key, at_ms, hash FROM harness_frames \
             WHERE session = $1 AND seq > $2 AND seq <= $3 ORDER BY seq LIMIT $4",
        )
        .await
        .map_err(db_err)?;
    let until = i64::try_from(until).unwrap_or(i64::MAX);
    let mut after = i64::try_from(after).unwrap_or(i64::MAX);
    let mut last = None;
    loop {
        let rows = c
            .query(&stmt, &[&session.as_str(), &after, &until, &FOLD_PAGE])
            .await
            .map_err(db_err)?;
        for r in &rows {
            let seq: i64 = r.get(0);
            let body = decode_stored_body(r.get(1), session, seq)?;
            meta.apply(seq as u64, &body, r.get::<_, Option<&str>>(2));
            after = seq;
        }
        if let Some(r) = rows.last() {
            last = Some((r.get(0), r.get(3), r.get(4)));
        }
        if (rows.len() as i64) < FOLD_PAGE {
            return Ok(last);
        }
    }
}

/// What the append decision reads, fetched up front inside the transaction
/// (PostgreSQL is asked asynchronously; the decision is a plain function):
/// the head and meta from the session's locked row, and the frame of the
/// request's key.
struct Fetched<'a> {
    session: &'a SessionId,
    head: LogHead,
    meta_json: String,
    by_key: Option<Frame>,
}

impl AppendView for Fetched<'_> {
    fn session(&self) -> &SessionId {
        self.session
    }
    fn head(&mut self) -> Result<LogHead> {
        Ok(self.head)
    }
    fn frame_by_key(&mut self, _key: &str) -> Result<Option<Frame>> {
        // Fetched for the request's key, the only one the decision asks for.
        Ok(self.by_key.clone())
    }
    fn meta(&mut self) -> Result<SessionMeta> {
        decode_stored_meta(&self.meta_json, self.session)
    }
}

/// An append inside the open transaction `tx`: the session's row locked,
/// core's decision over what it holds, then exactly what it says written.
pub(crate) async fn append_in(
    tx: &Transaction<'_>,
    session: &SessionId,
    append: CheckedAppend,
    now: u64,
    chain: &ChainKey,
) -> Result<Appended> {
    let head = tx
        .prepare_cached(
            "SELECT sealed, last_seq, last_hash, meta FROM harness_logs \
             WHERE session = $1 FOR UPDATE",
        )
        .await
        .map_err(db_err)?;
    let row = tx
        .query_opt(&head, &[&session.as_str()])
        .await
        .map_err(db_err)?
        .ok_or_else(|| unknown_session(session))?;
    let last_seq: i64 = row.get(1);
    let head = LogHead {
        sealed: row.get(0),
        last_seq: last_seq as u64,
        last_hash: decode_hash(row.get::<_, Option<&[u8]>>(2), session, last_seq)?,
    };
    let meta_json: String = row.get(3);
    let by_key = match &append.request().idempotency_key {
        None => None,
        Some(key) => {
            let by_key = tx
                .prepare_cached(
                    "SELECT seq, at_ms, body FROM harness_frames \
                     WHERE session = $1 AND idem_key = $2",
                )
                .await
                .map_err(db_err)?;
            match tx
                .query_opt(&by_key, &[&session.as_str(), key])
                .await
                .map_err(db_err)?
            {
                None => None,
                Some(r) => {
                    let seq: i64 = r.get(0);
                    let at_ms: i64 = r.get(1);
                    Some(Frame {
                        seq: seq as u64,
                        at_ms: at_ms as u64,
                        body: decode_stored_body(r.get(2), session, seq)?,
                    })
                }
            }
        }
    };
    let mut view = Fetched {
        session,
        head,
        meta_json,
        by_key,
    };
    let new = match plan_append(&mut view, append, now, chain)? {
        AppendPlan::Duplicate(appended) => return Ok(appended),
        AppendPlan::Write(new) => new,
    };
    let insert = tx
        .prepare_cached(
            "INSERT INTO harness_frames (session, seq, at_ms, body, idem_key, hash) \
             VALUES ($1, $2, $3, $4, $5, $6)",
        )
        .await
        .map_err(db_err)?;
    let hash = new.hash.as_ref().map(|h| &h.as_bytes()[..]);
    tx.execute(
        &insert,
        &[
            &session.as_str(),
            &(new.frame.seq as i64),
            &(new.frame.at_ms as i64),
            &new.body_json,
            &new.key,
            &hash,
        ],
    )
    .await
    .map_err(db_err)?;
    if let Some(doc) = &new.document {
        // The search index (docs/search.md): PostgreSQL's full text, the
        // `simple` configuration (no stemming: code and paths are words
        // as they are).
        let index = tx
            .prepare_cached(
                "INSERT INTO harness_search (session, seq, kind, text, doc) \
                 VALUES ($1, $2, $3, $4, to_tsvector('simple', $4))",
            )
            .await
            .map_err(db_err)?;
        tx.execute(
            &index,
            &[
                &session.as_str(),
                &(new.frame.seq as i64),
                &doc.kind.as_str(),
                &doc.text,
            ],
        )
        .await
        .map_err(db_err)?;
    }
    let meta = new.meta.as_ref().map(serde_json::to_string).transpose()?;
    let update = tx
        .prepare_cached(
            "UPDATE harness_logs SET last_seq = $2, last_at_ms = $3, last_hash = $4, \
             sealed = sealed OR $5, meta = COALESCE($6, meta) WHERE session = $1",
        )
        .await
        .map_err(db_err)?;
    tx.execute(
        &update,
        &[
            &session.as_str(),
            &(new.frame.seq as i64),
            &(new.frame.at_ms as i64),
            &hash,
            &new.seals,
            &meta,
        ],
    )
    .await
    .map_err(db_err)?;
    Ok(new.appended())
}

#[async_trait]
impl SessionLog for PostgresSessionLog {
    async fn create_with(
        &self,
        session: &SessionId,
        config: Option<SessionConfig>,
    ) -> Result<LogInfo> {
        let meta = serde_json::to_string(&SessionMeta::new(config))?;
        let client = self.client().await?;
        client
            .execute(
                "INSERT INTO harness_logs (session, meta) VALUES ($1, $2) \
                 ON CONFLICT (session) DO NOTHING",
                &[&session.as_str(), &meta],
            )
            .await
            .map_err(db_err)?;
        load_info(&client, session).await
    }

    async fn info(&self, session: &SessionId) -> Result<LogInfo> {
        let client = self.client().await?;
        load_info(&client, session).await
    }

    async fn append(&self, session: &SessionId, request: AppendRequest) -> Result<Appended> {
        let append = CheckedAppend::new(request, self.max_frame_bytes)?;
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(db_err)?;
        if let Some(fence) = &self.fence {
            fence.check(&tx, session).await?;
        }
        let appended = append_in(&tx, session, append, now_ms(), &self.chain).await?;
        tx.commit().await.map_err(db_err)?;
        Ok(appended)
    }

    async fn read(&self, session: &SessionId, after: u64, limit: usize) -> Result<Vec<Frame>> {
        const C: usize = FRAME_COLUMN;
        self.page(session, after, limit, "seq, at_ms, body")
            .await?
            .iter()
            .map(|r| {
                let seq: i64 = r.get(C);
                let at_ms: i64 = r.get(C + 1);
                Ok(Frame {
                    seq: seq as u64,
                    at_ms: at_ms as u64,
                    body: decode_stored_body(r.get(C + 2), session, seq)?,
                })
            })
            .collect()
    }

    async fn read_chain(
        &self,
        session: &SessionId,
        after: u64,
        limit: usize,
    ) -> Result<Vec<ChainedFrame>> {
        const C: usize = FRAME_COLUMN;
        self.page(session, after, limit, "seq, at_ms, body, idem_key, hash")
            .await?
            .iter()
            .map(|r| {
                let seq: i64 = r.get(C);
                let at_ms: i64 = r.get(C + 1);
                Ok(ChainedFrame {
                    seq: seq as u64,
                    at_ms: at_ms as u64,
                    body: r.get(C + 2),
                    key: r.get(C + 3),
                    hash: decode_hash(r.get::<_, Option<&[u8]>>(C + 4), session, seq)?,
                })
            })
            .collect()
    }

    async fn seal(&self, session: &SessionId) -> Result<LogInfo> {
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(db_err)?;
        if let Some(fence) = &self.fence {
            fence.check(&tx, session).await?;
        }
        // Read under the row's lock, as the append would take it: a log
        // sealed already is answered as it is.
        let sealed: bool = tx
            .query_opt(
                "SELECT sealed FROM harness_logs WHERE session = $1 FOR UPDATE",
                &[&session.as_str()],
            )
            .await
            .map_err(db_err)?
            .ok_or_else(|| unknown_session(session))?
            .get(0);
        if !sealed {
            let seal = CheckedAppend::new(AppendRequest::new(FrameBody::Sealed {}), usize::MAX)?;
            append_in(&tx, session, seal, now_ms(), &self.chain).await?;
        }
        let info = load_info(&tx, session).await?;
        tx.commit().await.map_err(db_err)?;
        Ok(info)
    }

    /// One transaction: the lease row first (the order a fenced append
    /// locks in: lease, then log), then the log's row — an append waiting
    /// on it finds no session — then its frames, index rows and turns.
    async fn delete(&self, session: &SessionId) -> Result<()> {
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(db_err)?;
        if let Some(fence) = &self.fence {
            fence.check(&tx, session).await?;
        }
        let id = session.as_str();
        tx.execute("DELETE FROM harness_leases WHERE session = $1", &[&id])
            .await
            .map_err(db_err)?;
        let deleted = tx
            .execute("DELETE FROM harness_logs WHERE session = $1", &[&id])
            .await
            .map_err(db_err)?;
        if deleted == 0 {
            return Err(unknown_session(session));
        }
        for table in ["harness_frames", "harness_search", "harness_turns"] {
            tx.execute(&format!("DELETE FROM {table} WHERE session = $1"), &[&id])
                .await
                .map_err(db_err)?;
        }
        tx.commit().await.map_err(db_err)
    }

    /// One transaction under the log's row lock: the cut meta folded on
    /// from the previous cut, the cut written to the row, the trimmed
    /// frames and their index rows removed (their keys go with them).
    async fn trim(&self, session: &SessionId, through: u64) -> Result<LogInfo> {
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(db_err)?;
        if let Some(fence) = &self.fence {
            fence.check(&tx, session).await?;
        }
        let (info, cut_meta) = lock_log(&tx, session).await?;
        if !check_trim(&info, through)? {
            return Ok(info);
        }
        let (after, mut meta) = fold_start(&info, cut_meta.as_deref())?;
        let through_i = through as i64;
        let hash = match fold_frames(&tx, session, &mut meta, after, through).await? {
            Some((seq, _, hash)) if seq == through_i => hash,
            _ => {
                return Err(Error::corrupt(format!(
                    "session {session} holds frames up to {} but not frame {through}",
                    info.last_seq
                )))
            }
        };
        let id = session.as_str();
        tx.execute(
            "UPDATE harness_logs SET cut_through = $2, cut_hash = $3, cut_meta = $4 \
             WHERE session = $1",
            &[&id, &through_i, &hash, &serde_json::to_string(&meta)?],
        )
        .await
        .map_err(db_err)?;
        for table in ["harness_search", "harness_frames"] {
            tx.execute(
                &format!("DELETE FROM {table} WHERE session = $1 AND seq <= $2"),
                &[&id, &through_i],
            )
            .await
            .map_err(db_err)?;
        }
        let info = load_info(&tx, session).await?;
        tx.commit().await.map_err(db_err)?;
        Ok(info)
    }

    async fn fork(&self, source: &SessionId, until: u64, target: &SessionId) -> Result<LogInfo> {
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(db_err)?;
        // The source's row locked: its head (and cut) cannot move under
        // the copy.
        let (src, cut_meta) = lock_log(&tx, source).await?;
        let sealed = fork_copy_sealed(&src, until)?;
        check_fork_kept(source, src.trimmed.as_ref(), until)?;
        let until_i = until as i64;
        // The copy keeps the source's cut: it holds the same kept frames.
        let (cut_through, cut_hash) = match &src.trimmed {
            Some(cut) => (
                Some(cut.through as i64),
                cut.hash.as_ref().map(|h| h.as_bytes().to_vec()),
            ),
            None => (None, None),
        };
        let inserted = tx
            .execute(
                "INSERT INTO harness_logs (session, sealed, forked_from, fork_until, meta, \
                 cut_through, cut_hash, cut_meta) \
                 VALUES ($1, $2, $3, $4, '{}', $5, $6, $7) ON CONFLICT (session) DO NOTHING",
                &[
                    &target.as_str(),
                    &sealed,
                    &source.as_str(),
                    &until_i,
                    &cut_through,
                    &cut_hash,
                    &cut_meta,
                ],
            )
            .await
            .map_err(db_err)?;
        if inserted == 0 {
            return Err(Error::conflict(format!(
                "cannot fork into {target}: that session already exists"
            )));
        }
        tx.execute(
            "INSERT INTO harness_frames (session, seq, at_ms, body, idem_key, hash) \
             SELECT $1, seq, at_ms, body, idem_key, hash FROM harness_frames \
             WHERE session = $2 AND seq <= $3",
            &[&target.as_str(), &source.as_str(), &until_i],
        )
        .await
        .map_err(db_err)?;
        tx.execute(
            "INSERT INTO harness_search (session, seq, kind, text, doc) \
             SELECT $1, seq, kind, text, doc FROM harness_search \
             WHERE session = $2 AND seq <= $3",
            &[&target.as_str(), &source.as_str(), &until_i],
        )
        .await
        .map_err(db_err)?;
        // The copy's meta is its own frames folded onto the cut's meta (a
        // fresh one under the source's config when untrimmed): what a fork
        // of the same frames untrimmed folds. Its head is the source's
        // frame `until`.
        let (after, mut meta) = fold_start(&src, cut_meta.as_deref())?;
        let (last_at_ms, last_hash) = fold_frames(&tx, target, &mut meta, after, until)
            .await?
            .map_or((0, None), |(_, at_ms, hash)| (at_ms, hash));
        tx.execute(
            "UPDATE harness_logs SET meta = $2, last_seq = $3, last_at_ms = $4, last_hash = $5 \
             WHERE session = $1",
            &[
                &target.as_str(),
                &serde_json::to_string(&meta)?,
                &until_i,
                &last_at_ms,
                &last_hash,
            ],
        )
        .await
        .map_err(db_err)?;
        if let Some(closing) = fork_closing_frame(&meta, sealed, source, until) {
            let closing = CheckedAppend::new(closing, usize::MAX)?;
            append_in(&tx, target, closing, now_ms(), &self.chain).await?;
        }
        let info = load_info(&tx, target).await?;
        tx.commit().await.map_err(db_err)?;
        Ok(info)
    }

    async fn list(&self) -> Result<Vec<LogInfo>> {
        self.list_page(None, usize::MAX).await
    }

    async fn search(&self, query: &SearchQuery) -> Result<Vec<SearchHit>> {
        query.check()?;
        // Plain words only (checked above): `plainto_tsquery` ANDs them.
        let words = query.terms()?.join(" ");
        let limit = query.limit()? as i64;
        let to_i = |v: Option<u64>| v.map(|v| i64::try_from(v).unwrap_or(i64::MAX));
        let client = self.client().await?;
        let rows = client
            .query(
                "SELECT s.session, s.seq, f.at_ms, s.kind, \
                        ts_headline('simple', s.text, q, \
                                    'StartSel=[, StopSel=], MaxWords=16, MinWords=6'), \
                        -ts_rank(s.doc, q)::FLOAT8 AS rank \
                 FROM harness_search s \
                 CROSS JOIN plainto_tsquery('simple', $1) q \
                 JOIN harness_frames f ON f.session = s.session AND f.seq = s.seq \
                 JOIN harness_logs l ON l.session = s.session \
                 WHERE s.doc @@ q \
                   AND ($2::TEXT IS NULL OR l.meta::jsonb #>> '{config,agent}' = $2) \
                   AND ($3::TEXT IS NULL OR l.meta::jsonb #>> '{config,sandbox,provider}' = $3) \
                   AND ($4::BIGINT IS NULL OR f.at_ms >= $4) \
                   AND ($5::BIGINT IS NULL OR f.at_ms < $5) \
                   AND ($6::TEXT IS NULL OR l.meta::jsonb #>> '{turn,status}' = $6) \
                 ORDER BY rank, s.session, s.seq LIMIT $7",
                &[
                    &words,
                    &query.agent,
                    &query.provider,
                    &to_i(query.after_ms),
                    &to_i(query.before_ms),
                    &query.status,
                    &limit,
                ],
            )
            .await
            .map_err(db_err)?;
        rows.iter()
            .map(|r| {
                let kind: String = r.get(3);
                Ok(SearchHit {
                    session: SessionId::parse(r.get::<_, String>(0))?,
                    seq: r.get::<_, i64>(1) as u64,
                    at_ms: r.get::<_, i64>(2) as u64,
                    kind: DocKind::stored(&kind)?,
                    snippet: r.get(4),
                    rank: r.get(5),
                })
            })
            .collect()
    }

    /// One page through the primary key: `session > $1` in id order,
    /// `LIMIT`, so a page costs its own rows whatever the log count.
    async fn list_page(&self, after: Option<&SessionId>, limit: usize) -> Result<Vec<LogInfo>> {
        let client = self.client().await?;
        let after = after.map(|a| a.as_str().to_string());
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows = client
            .query(
                &format!(
                    "SELECT {INFO_COLUMNS}, session FROM harness_logs \
                     WHERE $1::TEXT IS NULL OR session > $1 ORDER BY session LIMIT $2"
                ),
                &[&after, &limit],
            )
            .await
            .map_err(db_err)?;
        rows.iter()
            .map(|r| {
                let id = SessionId::parse(r.get::<_, String>(INFO_COUNT))?;
                info_from_row(r, &id)
            })
            .collect()
    }
}
