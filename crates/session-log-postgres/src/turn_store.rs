//! [`PostgresTurnStore`]: the in-process engine's [`TurnStore`] on
//! PostgreSQL, so a node that takes over a session finds its unfinished
//! turns. One row per turn; `done` caches whether [`next_step`] says the
//! turn is over, so `unfinished` reads a partial index.

use async_trait::async_trait;
use deadpool_postgres::Pool;
use harness_core::engine::{decode_turn_state, fenced_save_error, TurnStore};
use harness_core::turn::{next_step, NextStep, TurnState};
use harness_core::Result;

use crate::{client, db_err};

/// A [`TurnStore`] in a PostgreSQL database.
#[derive(Clone)]
pub struct PostgresTurnStore {
    pool: Pool,
}

impl std::fmt::Debug for PostgresTurnStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresTurnStore")
            .field("pool", &self.pool.status())
            .finish()
    }
}

impl PostgresTurnStore {
    pub(crate) fn from_pool(pool: Pool) -> Self {
        Self { pool }
    }
}

#[async_trait]
impl TurnStore for PostgresTurnStore {
    async fn save(&self, state: &TurnState, generation: u64) -> Result<()> {
        let json = serde_json::to_string(state)?;
        let done = matches!(next_step(state), NextStep::Done { .. });
        let generation_i = i64::try_from(generation).unwrap_or(i64::MAX);
        let client = client(&self.pool).await?;
        // One statement: the row is replaced only by an equal or newer
        // generation, so a replaced engine cannot overwrite its successor.
        let changed = client
            .execute(
                "INSERT INTO harness_turns (session, turn, state, done, generation) \
                 VALUES ($1, $2, $3, $4, $5) \
                 ON CONFLICT (session, turn) DO UPDATE SET state = excluded.state, \
                 done = excluded.done, generation = excluded.generation \
                 WHERE harness_turns.generation <= excluded.generation",
                &[
                    &state.session_id,
                    &state.turn_id,
                    &json,
                    &done,
                    &generation_i,
                ],
            )
            .await
            .map_err(db_err)?;
        if changed == 1 {
            return Ok(());
        }
        let stored: i64 = client
            .query_one(
                "SELECT generation FROM harness_turns WHERE session = $1 AND turn = $2",
                &[&state.session_id, &state.turn_id],
            )
            .await
            .map_err(db_err)?
            .get(0);
        Err(fenced_save_error(state, stored as u64, generation))
    }

    async fn load(&self, session_id: &str, turn_id: &str) -> Result<Option<TurnState>> {
        let client = client(&self.pool).await?;
        let row = client
            .query_opt(
                "SELECT state FROM harness_turns WHERE session = $1 AND turn = $2",
                &[&session_id, &turn_id],
            )
            .await
            .map_err(db_err)?;
        row.map(|r| decode_turn_state(r.get(0))).transpose()
    }

    async fn unfinished(&self) -> Result<Vec<TurnState>> {
        let client = client(&self.pool).await?;
        let rows = client
            .query(
                "SELECT state FROM harness_turns WHERE NOT done ORDER BY session, turn",
                &[],
            )
            .await
            .map_err(db_err)?;
        rows.iter().map(|r| decode_turn_state(r.get(0))).collect()
    }
}
