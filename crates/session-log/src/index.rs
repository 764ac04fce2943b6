//! The search index (`docs/search.md`), kept off the append path.
//!
//! FTS5 costs about as much per frame as the append itself (measured:
//! indexing in the append's transaction halved appends/s), so appends do
//! not wait for it: the writer hands every committed frame — with its
//! document from the append decision, if it has one — to the **indexer**,
//! a thread with its own connection that writes them in batches (every
//! [`FLUSH_EVERY`], or [`FLUSH_AT`] frames), each batch one transaction:
//! the documents, their FTS5 entries, and per session the last seq indexed
//! (`search_marks`). A frame is searchable within about [`FLUSH_EVERY`] of
//! its commit.
//!
//! A process that dies with frames committed but not yet indexed leaves
//! their sessions' marks behind; [`catch_up`], run when the log is opened,
//! indexes every session's frames past its mark (a database written before
//! the index existed has no marks, so all of it).

use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use harness_core::search::{document, Document};
use harness_core::{Error, FrameBody, Result};
use rusqlite::{params, Connection, TransactionBehavior};

use crate::db_err;

/// How long a committed frame waits at most before the indexer writes it.
pub(crate) const FLUSH_EVERY: Duration = Duration::from_millis(100);
/// A batch this large is written at once.
pub(crate) const FLUSH_AT: usize = 2048;

/// One committed frame, as the index takes it.
#[derive(Debug, Clone)]
pub(crate) struct Entry {
    pub session: String,
    pub seq: i64,
    pub doc: Option<Document>,
}

/// [`write_entries`] in a transaction of its own.
pub(crate) fn index_batch(conn: &Connection, entries: &[Entry]) -> Result<()> {
    if entries.is_empty() {
        return Ok(());
    }
    let tx = rusqlite::Transaction::new_unchecked(conn, TransactionBehavior::Immediate)
        .map_err(db_err)?;
    write_entries(&tx, entries)?;
    tx.commit().map_err(db_err)
}

/// Write `entries` (in commit order) in the open transaction: their
/// documents and FTS5 entries (a frame indexed before is left alone), and
/// each session's mark.
pub(crate) fn write_entries(tx: &Connection, entries: &[Entry]) -> Result<()> {
    let mut marks: std::collections::HashMap<&str, i64> = std::collections::HashMap::new();
    for entry in entries {
        let mark = marks.entry(entry.session.as_str()).or_insert(entry.seq);
        *mark = (*mark).max(entry.seq);
        let Some(doc) = &entry.doc else { continue };
        // Only a frame still stored: retention may have deleted or
        // trimmed it between its commit and this batch.
        let added = tx
            .prepare_cached(
                "INSERT OR IGNORE INTO search_docs (session, seq, kind, text) \
                 SELECT ?1, ?2, ?3, ?4 \
                 WHERE EXISTS (SELECT 1 FROM frames WHERE session = ?1 AND seq = ?2)",
            )
            .map_err(db_err)?
            .execute(params![
                entry.session,
                entry.seq,
                doc.kind.as_str(),
                doc.text
            ])
            .map_err(db_err)?;
        if added == 1 {
            tx.prepare_cached(
                "INSERT INTO search_fts (rowid, text) VALUES (last_insert_rowid(), ?1)",
            )
            .map_err(db_err)?
            .execute(params![doc.text])
            .map_err(db_err)?;
        }
    }
    for (session, through) in marks {
        tx.prepare_cached(
            "INSERT INTO search_marks (session, through) \
             SELECT ?1, ?2 WHERE EXISTS (SELECT 1 FROM logs WHERE session = ?1) \
             ON CONFLICT (session) DO UPDATE SET through = max(through, excluded.through)",
        )
        .map_err(db_err)?
        .execute(params![session, through])
        .map_err(db_err)?;
    }
    Ok(())
}

/// `session`'s frames after seq `after`, as the index takes them, read
/// from the frames themselves (catch-up at open, and a fork's copy).
pub(crate) fn stored_entries(conn: &Connection, session: &str, after: i64) -> Result<Vec<Entry>> {
    let entries = {
        let mut stmt = conn
            .prepare_cached(
                "SELECT seq, body FROM frames WHERE session = ?1 AND seq > ?2 ORDER BY seq",
            )
            .map_err(db_err)?;
        let rows = stmt
            .query_map(params![session, after], |r| {
                Ok((r.get::<_, i64>(0)?, r.get::<_, String>(1)?))
            })
            .map_err(db_err)?;
        let mut entries = Vec::new();
        for row in rows {
            let (seq, body) = row.map_err(db_err)?;
            // A frame this build cannot read is left out of the index, not
            // a reason to refuse the database.
            let doc = serde_json::from_str::<FrameBody>(&body)
                .ok()
                .and_then(|b| document(&b));
            entries.push(Entry {
                session: session.to_string(),
                seq,
                doc,
            });
        }
        entries
    };
    Ok(entries)
}

/// Index every session's frames past its mark (see the module docs).
pub(crate) fn catch_up(conn: &Connection) -> Result<()> {
    let behind: Vec<(String, i64)> = {
        let mut stmt = conn
            .prepare(
                "SELECT l.session, coalesce(m.through, 0) FROM logs l \
                 LEFT JOIN search_marks m ON m.session = l.session \
                 WHERE EXISTS (SELECT 1 FROM frames f \
                               WHERE f.session = l.session AND f.seq > coalesce(m.through, 0))",
            )
            .map_err(db_err)?;
        let rows = stmt
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
            .map_err(db_err)?;
        rows.collect::<rusqlite::Result<_>>().map_err(db_err)?
    };
    for (session, through) in behind {
        for chunk in stored_entries(conn, &session, through)?.chunks(FLUSH_AT) {
            index_batch(conn, chunk)?;
        }
    }
    Ok(())
}

/// Where the writer hands committed frames.
#[derive(Debug)]
pub(crate) enum IndexSink {
    /// The indexer thread of a database file.
    Thread(Sender<Vec<Entry>>),
    /// Written by the writer itself right after each commit (an in-memory
    /// database, which no second connection can open).
    Inline,
    /// Not indexed (the turn store's writer appends no frames).
    None,
}

/// The indexer thread: see the module docs. Dropping it writes what it
/// holds and stops it.
#[derive(Debug)]
pub(crate) struct Indexer {
    thread: Option<JoinHandle<()>>,
}

impl Indexer {
    /// Start the thread over `conn` (its own connection to the database);
    /// the sink to hand it frames.
    pub(crate) fn start(conn: Connection) -> Result<(Self, IndexSink)> {
        let (tx, rx) = std::sync::mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("session-log-indexer".into())
            .spawn(move || run(conn, rx))
            .map_err(|e| Error::backend(format!("cannot start the search indexer: {e}")))?;
        Ok((
            Self {
                thread: Some(thread),
            },
            IndexSink::Thread(tx),
        ))
    }

    /// Wait for the thread to write what it was handed and stop (its
    /// sender must be gone: the writer is dropped first).
    pub(crate) fn join(&mut self) {
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Whether the indexer writes its batch now: never an empty one; else
/// when the writer is gone, the oldest entry has waited [`FLUSH_EVERY`]
/// (`waited`), or [`FLUSH_AT`] entries are held.
fn flush_due(waited: Option<Duration>, held: usize, closed: bool) -> bool {
    held > 0 && (closed || waited.is_some_and(|w| w >= FLUSH_EVERY) || held >= FLUSH_AT)
}

fn run(conn: Connection, rx: Receiver<Vec<Entry>>) {
    let mut batch: Vec<Entry> = Vec::new();
    let mut since: Option<Instant> = None;
    loop {
        let wait = since.map_or(Duration::from_secs(3600), |s| {
            FLUSH_EVERY.saturating_sub(s.elapsed())
        });
        let closed = match rx.recv_timeout(wait) {
            Ok(entries) => {
                since.get_or_insert_with(Instant::now);
                batch.extend(entries);
                false
            }
            Err(RecvTimeoutError::Timeout) => false,
            Err(RecvTimeoutError::Disconnected) => true,
        };
        if flush_due(since.map(|s| s.elapsed()), batch.len(), closed) {
            if let Err(e) = index_batch(&conn, &batch) {
                // The marks stay behind: the next open catches up.
                tracing::warn!(frames = batch.len(), error = %e, "search index: a batch failed");
            }
            batch.clear();
            since = None;
        }
        if closed {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A batch is written when it is old enough, big enough or the writer
    /// is gone — and never when it is empty.
    #[test]
    fn a_batch_is_written_when_old_big_or_closed_and_never_empty() {
        let young = Some(FLUSH_EVERY / 2);
        assert!(!flush_due(None, 1, false));
        assert!(!flush_due(young, 1, false));
        assert!(!flush_due(young, FLUSH_AT - 1, false));
        assert!(flush_due(young, FLUSH_AT, false), "big enough");
        assert!(flush_due(Some(FLUSH_EVERY), 1, false), "old enough");
        assert!(flush_due(Some(FLUSH_EVERY * 3), 1, false));
        assert!(flush_due(young, 1, true), "the writer is gone");
        assert!(flush_due(None, 1, true));
        assert!(!flush_due(None, 0, true), "nothing to write");
        assert!(!flush_due(Some(FLUSH_EVERY * 3), 0, false));
    }
}
