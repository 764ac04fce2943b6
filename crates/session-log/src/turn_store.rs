//! [`SqliteTurnStore`]: the in-process engine's [`TurnStore`] on SQLite, so a
//! restarted process finds its unfinished turns.
//!
//! One row per turn: `turns(session, turn, state JSON, done)`. `done` caches
//! whether [`next_step`] says the turn is over, so `unfinished` is an index
//! scan instead of decoding every state ever saved.

use std::path::Path;
use std::sync::Arc;

use async_trait::async_trait;
use harness_core::engine::{decode_turn_state, fenced_save_error, TurnStore};
use harness_core::turn::{next_step, NextStep, TurnState};
use harness_core::Result;
use rusqlite::{params, OptionalExtension};

use crate::writer::Writer;
use crate::{db_err, open_connection};

/// A [`TurnStore`] in a SQLite database (WAL, same durability as the log).
#[derive(Debug, Clone)]
pub struct SqliteTurnStore {
    /// The writer thread of its database (shared with the log when made
    /// by `SqliteSessionLog::turn_store`).
    db: Arc<Writer>,
}

impl SqliteTurnStore {
    /// Open (or create) the store at `path` (may be the log's file).
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        Ok(Self::from_writer(Writer::start_unindexed(
            open_connection(path.as_ref())?,
        )?))
    }

    pub(crate) fn from_writer(db: Arc<Writer>) -> Self {
        Self { db }
    }
}

#[async_trait]
impl TurnStore for SqliteTurnStore {
    async fn save(&self, state: &TurnState, generation: u64) -> Result<()> {
        let json = serde_json::to_string(state)?;
        let done = matches!(next_step(state), NextStep::Done { .. });
        let (session, turn) = (state.session_id.clone(), state.turn_id.clone());
        let generation = i64::try_from(generation).unwrap_or(i64::MAX);
        let stored: Option<i64> = self
            .db
            .exec(move |conn| {
                // One statement: the row is replaced only by an equal or newer
                // generation, so a replaced engine cannot overwrite its successor.
                let changed = conn
                    .execute(
                        "INSERT INTO turns (session, turn, state, done, generation) \
                     VALUES (?1, ?2, ?3, ?4, ?5) \
                     ON CONFLICT (session, turn) DO UPDATE SET state = excluded.state, \
                     done = excluded.done, generation = excluded.generation \
                     WHERE turns.generation <= excluded.generation",
                        params![session, turn, json, done, generation],
                    )
                    .map_err(db_err)?;
                if changed == 1 {
                    return Ok(None);
                }
                conn.query_row(
                    "SELECT generation FROM turns WHERE session = ?1 AND turn = ?2",
                    params![session, turn],
                    |r| r.get(0),
                )
                .map(Some)
                .map_err(db_err)
            })
            .await?;
        match stored {
            None => Ok(()),
            Some(stored) => Err(fenced_save_error(state, stored as u64, generation as u64)),
        }
    }

    async fn load(&self, session_id: &str, turn_id: &str) -> Result<Option<TurnState>> {
        let (session, turn) = (session_id.to_string(), turn_id.to_string());
        let json: Option<String> = self
            .db
            .exec(move |conn| {
                conn.query_row(
                    "SELECT state FROM turns WHERE session = ?1 AND turn = ?2",
                    params![session, turn],
                    |r| r.get(0),
                )
                .optional()
                .map_err(db_err)
            })
            .await?;
        json.as_deref().map(decode_turn_state).transpose()
    }

    async fn unfinished(&self) -> Result<Vec<TurnState>> {
        let rows: Vec<String> = self
            .db
            .exec(move |conn| {
                let mut stmt = conn
                    .prepare("SELECT state FROM turns WHERE done = 0 ORDER BY session, turn")
                    .map_err(db_err)?;
                let rows = stmt.query_map([], |r| r.get(0)).map_err(db_err)?;
                rows.collect::<rusqlite::Result<Vec<String>>>()
                    .map_err(db_err)
            })
            .await?;
        rows.iter().map(|j| decode_turn_state(j)).collect()
    }
}
