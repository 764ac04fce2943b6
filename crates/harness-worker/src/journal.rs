//! The Worker broker's journal of a session, in the session's Durable
//! Object: every brokered model call (numbered 1, 2, … as
//! `AuditRecord::ModelCall`), the budget the session is held to, and how
//! far the journal is in the session's log — what the native broker keeps
//! under its directory (`calls/<session>.jsonl`, `.ack`, `budgets/`).
//!
//! Written by the broker route (`broker.rs`) as each call's answer ends,
//! read by it before forwarding (the budget against the usage so far), and
//! read by the turn's slice runner through `TurnBroker` (`set_budget`,
//! `usage`, `model_calls`, `model_calls_recorded`), which writes the
//! records into the log at the turn's end: the log's meta then folds them
//! into `meta.usage` as on `harness serve`. The object is single-threaded,
//! so numbering needs no lock. A delete empties it with the rest of the
//! object's storage; a fork starts without one (its records are its own).

use harness_core::audit::AuditRecord;
use harness_core::turn::{Budget, ModelUsage};
use serde::{Deserialize, Serialize};
use worker::{SqlStorage, SqlStorageValue};

use crate::store::{db_err, int};

const SCHEMA: [&str; 2] = [
    "CREATE TABLE IF NOT EXISTS broker_calls (
        idx INTEGER PRIMARY KEY,
        input INTEGER NOT NULL,
        output INTEGER NOT NULL,
        spend INTEGER,
        record TEXT NOT NULL
    )",
    "CREATE TABLE IF NOT EXISTS broker_state (
        id INTEGER PRIMARY KEY CHECK (id = 1),
        recorded INTEGER NOT NULL DEFAULT 0,
        budget TEXT
    )",
];

/// One answered call, as the broker route saw it pass.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct CallFigures {
    /// The model the request named.
    pub model: Option<String>,
    /// The upstream's status.
    pub status: u16,
    pub input_tokens: u64,
    pub output_tokens: u64,
    /// Priced by `HARNESS_MODEL_PRICES`; `None` when the model has no price.
    pub spend_micros: Option<u64>,
}

/// What the broker route needs before it forwards: which turn runs, the
/// budget and what the session used so far.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(crate) struct BrokerState {
    pub running_turn: Option<String>,
    pub budget: Budget,
    pub usage: ModelUsage,
}

/// The journal over an object's SQLite.
pub(crate) struct Journal<'a> {
    sql: &'a SqlStorage,
}

impl<'a> Journal<'a> {
    /// The journal of the object whose SQLite is `sql` (made on first use).
    pub(crate) fn open(sql: &'a SqlStorage) -> harness_core::Result<Self> {
        for statement in SCHEMA {
            sql.exec(statement, None).map_err(db_err)?;
        }
        sql.exec(
            "INSERT OR IGNORE INTO broker_state (id, recorded) VALUES (1, 0)",
            None,
        )
        .map_err(db_err)?;
        Ok(Self { sql })
    }

    /// Journal one call; its number.
    pub(crate) fn record(&self, call: &CallFigures) -> harness_core::Result<u64> {
        #[derive(Deserialize)]
        struct Last {
            last: Option<i64>,
        }
        let last: Vec<Last> = self
            .sql
            .exec("SELECT MAX(idx) AS last FROM broker_calls", None)
            .and_then(|c| c.to_array())
            .map_err(db_err)?;
        let index = last.first().and_then(|l| l.last).unwrap_or(0) as u64 + 1;
        let record = AuditRecord::ModelCall {
            index,
            model: call.model.clone(),
            status: call.status,
            input_tokens: call.input_tokens,
            output_tokens: call.output_tokens,
            spend_micros: call.spend_micros,
        };
        let json = serde_json::to_string(&record).map_err(db_err)?;
        self.sql
            .exec(
                "INSERT INTO broker_calls (idx, input, output, spend, record) VALUES (?, ?, ?, ?, ?)",
                vec![
                    int(index),
                    int(call.input_tokens),
                    int(call.output_tokens),
                    call.spend_micros.map_or(SqlStorageValue::Null, int),
                    json.into(),
                ],
            )
            .map_err(db_err)?;
        Ok(index)
    }

    /// The records not yet in the session's log, in order.
    pub(crate) fn unrecorded(&self) -> harness_core::Result<Vec<AuditRecord>> {
        #[derive(Deserialize)]
        struct Row {
            record: String,
        }
        let rows: Vec<Row> = self
            .sql
            .exec(
                "SELECT record FROM broker_calls
                 WHERE idx > (SELECT recorded FROM broker_state WHERE id = 1) ORDER BY idx",
                None,
            )
            .and_then(|c| c.to_array())
            .map_err(db_err)?;
        rows.iter()
            .map(|r| serde_json::from_str(&r.record).map_err(db_err))
            .collect()
    }

    /// The journal up to `upto` is in the session's log.
    pub(crate) fn recorded(&self, upto: u64) -> harness_core::Result<()> {
        self.sql
            .exec(
                "UPDATE broker_state SET recorded = MAX(recorded, ?) WHERE id = 1",
                vec![int(upto)],
            )
            .map_err(db_err)?;
        Ok(())
    }

    /// Hold the session to `budget` from now on.
    pub(crate) fn set_budget(&self, budget: &Budget) -> harness_core::Result<()> {
        let json = serde_json::to_string(budget).map_err(db_err)?;
        self.sql
            .exec(
                "UPDATE broker_state SET budget = ? WHERE id = 1",
                vec![json.into()],
            )
            .map_err(db_err)?;
        Ok(())
    }

    /// The budget (unlimited until one is set).
    pub(crate) fn budget(&self) -> harness_core::Result<Budget> {
        #[derive(Deserialize)]
        struct Row {
            budget: Option<String>,
        }
        let rows: Vec<Row> = self
            .sql
            .exec("SELECT budget FROM broker_state WHERE id = 1", None)
            .and_then(|c| c.to_array())
            .map_err(db_err)?;
        match rows.first().and_then(|r| r.budget.as_deref()) {
            Some(json) => serde_json::from_str(json).map_err(db_err),
            None => Ok(Budget::default()),
        }
    }

    /// What every journaled call used: the spend only when each was priced.
    pub(crate) fn usage(&self) -> harness_core::Result<ModelUsage> {
        #[derive(Deserialize)]
        struct Sums {
            calls: i64,
            input: Option<i64>,
            output: Option<i64>,
            spend: Option<i64>,
            priced: i64,
        }
        let sums: Vec<Sums> = self
            .sql
            .exec(
                "SELECT COUNT(*) AS calls, SUM(input) AS input, SUM(output) AS output,
                        SUM(spend) AS spend, COUNT(spend) AS priced
                 FROM broker_calls",
                None,
            )
            .and_then(|c| c.to_array())
            .map_err(db_err)?;
        let Some(s) = sums.first() else {
            return Ok(ModelUsage::default());
        };
        Ok(ModelUsage {
            input_tokens: s.input.unwrap_or(0) as u64,
            output_tokens: s.output.unwrap_or(0) as u64,
            spend_micros: (s.priced == s.calls).then(|| s.spend.unwrap_or(0) as u64),
        })
    }
}
