//! The schema, made once per database and versioned: a node refuses a
//! database written by a newer harness (its rows may mean more than this
//! build knows), and nodes starting together make it once (an advisory
//! lock held for the migration's transaction). A column added after a
//! table was first made is added by an idempotent `ALTER TABLE ... ADD
//! COLUMN IF NOT EXISTS` in the same batch, so a database an older build
//! made gains it at the next start; older builds ignore it.

use harness_core::{Error, Result};

use crate::db_err;

/// The schema this build writes.
pub const SCHEMA_VERSION: i32 = 1;

/// The key of the advisory lock the migration holds ("harness" in ASCII).
const MIGRATION_LOCK: i64 = 0x0068_6172_6e65_7373;

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS harness_schema (
    version     INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS harness_logs (
    session     TEXT PRIMARY KEY,
    sealed      BOOLEAN NOT NULL DEFAULT FALSE,
    forked_from TEXT,
    fork_until  BIGINT,
    meta        TEXT NOT NULL,
    last_seq    BIGINT NOT NULL DEFAULT 0,
    last_at_ms  BIGINT NOT NULL DEFAULT 0,
    last_hash   BYTEA
);
CREATE TABLE IF NOT EXISTS harness_frames (
    session     TEXT NOT NULL,
    seq         BIGINT NOT NULL,
    at_ms       BIGINT NOT NULL,
    body        TEXT NOT NULL,
    idem_key    TEXT,
    hash        BYTEA,
    PRIMARY KEY (session, seq)
);
CREATE UNIQUE INDEX IF NOT EXISTS harness_frames_idem ON harness_frames (session, idem_key)
    WHERE idem_key IS NOT NULL;
CREATE TABLE IF NOT EXISTS harness_turns (
    session     TEXT NOT NULL,
    turn        TEXT NOT NULL,
    state       TEXT NOT NULL,
    done        BOOLEAN NOT NULL,
    generation  BIGINT NOT NULL DEFAULT 0,
    PRIMARY KEY (session, turn)
);
CREATE TABLE IF NOT EXISTS harness_search (
    session     TEXT NOT NULL,
    seq         BIGINT NOT NULL,
    kind        TEXT NOT NULL,
    text        TEXT NOT NULL,
    doc         TSVECTOR NOT NULL,
    PRIMARY KEY (session, seq)
);
CREATE INDEX IF NOT EXISTS harness_search_doc ON harness_search USING GIN (doc);
CREATE TABLE IF NOT EXISTS harness_leases (
    session     TEXT PRIMARY KEY,
    node        TEXT NOT NULL,
    generation  BIGINT NOT NULL,
    expires_at  TIMESTAMPTZ NOT NULL
);
CREATE INDEX IF NOT EXISTS harness_turns_unfinished ON harness_turns (session, turn)
    WHERE NOT done;
-- Retention's cut (`SessionLog::trim`), added to databases made before it:
-- the last seq removed, its chain hash, and the meta folded through it
-- (what a fork past the cut starts from). NULL for a log never trimmed.
ALTER TABLE harness_logs ADD COLUMN IF NOT EXISTS cut_through BIGINT;
ALTER TABLE harness_logs ADD COLUMN IF NOT EXISTS cut_hash BYTEA;
ALTER TABLE harness_logs ADD COLUMN IF NOT EXISTS cut_meta TEXT;
";

/// Make the schema if it is missing; refuse a newer one.
pub(crate) async fn migrate(client: &deadpool_postgres::Object) -> Result<()> {
    client.batch_execute("BEGIN").await.map_err(db_err)?;
    let result = async {
        client
            .query_one("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])
            .await
            .map_err(db_err)?;
        client.batch_execute(SCHEMA).await.map_err(db_err)?;
        let stored: Option<i32> = client
            .query_opt("SELECT max(version) FROM harness_schema", &[])
            .await
            .map_err(db_err)?
            .and_then(|r| r.get(0));
        match stored {
            None => {
                client
                    .execute(
                        "INSERT INTO harness_schema (version) VALUES ($1)",
                        &[&SCHEMA_VERSION],
                    )
                    .await
                    .map_err(db_err)?;
                Ok(())
            }
            Some(v) if v > SCHEMA_VERSION => Err(Error::invalid(format!(
                "this database holds the harness schema version {v}, newer than this build's \
                 ({SCHEMA_VERSION}): a newer harness wrote it; run that version (or a newer \
                 one) against it, never an older one"
            ))),
            Some(_) => Ok(()),
        }
    }
    .await;
    let end = if result.is_ok() { "COMMIT" } else { "ROLLBACK" };
    client.batch_execute(end).await.map_err(db_err)?;
    result
}
