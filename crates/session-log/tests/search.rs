//! Search on the SQLite log (FTS5, fed by the append decision's document,
//! written by the indexer thread after each commit): the search
//! conformance suite, and frames committed but never indexed (a process
//! killed before its indexer wrote them, or a database written before the
//! index existed), indexed at the next open.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use harness_core::log::SessionLog;
use harness_core::search::SearchQuery;
use session_log::SqliteSessionLog;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_log_passes_the_search_suite() {
    let dir = tempfile::tempdir().unwrap();
    let n = AtomicUsize::new(0);
    harness_testkit::conformance::search::run_all(|| {
        let path = dir
            .path()
            .join(format!("search-{}.db", n.fetch_add(1, Ordering::SeqCst)));
        async move { Arc::new(SqliteSessionLog::open(path).unwrap()) as Arc<dyn SessionLog> }
    })
    .await
    .unwrap();
}

/// Frames committed but not indexed are indexed when the log is opened.
#[tokio::test]
async fn a_database_without_an_index_is_indexed_at_open() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("old.db");
    {
        let log = SqliteSessionLog::open(&path).unwrap();
        harness_testkit::conformance::search::generate(&log, 20)
            .await
            .unwrap();
    }
    {
        // What a killed process (or an earlier build) leaves: frames with
        // no index rows and no marks.
        let conn = rusqlite::Connection::open(&path).unwrap();
        conn.execute_batch(
            "DELETE FROM search_docs; INSERT INTO search_fts(search_fts) VALUES ('delete-all'); \
             DELETE FROM search_marks;",
        )
        .unwrap();
        let rows: i64 = conn
            .query_row("SELECT count(*) FROM search_docs", [], |r| r.get(0))
            .unwrap();
        assert_eq!(rows, 0);
    }
    let log = SqliteSessionLog::open(&path).unwrap();
    let hits = log.search(&SearchQuery::new("zeta12")).await.unwrap();
    assert_eq!(hits.len(), 1, "{hits:?}");
    assert_eq!((hits[0].session.as_str(), hits[0].seq), ("s0012", 1));
}

/// Dropping the log waits for its indexer to write what it holds: right
/// after the drop, every session's mark (the last seq indexed) is at its
/// last frame, without a reopen's catch-up.
#[tokio::test]
async fn dropping_the_log_writes_what_the_indexer_holds() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("drop.db");
    {
        let log = SqliteSessionLog::open(&path).unwrap();
        harness_testkit::conformance::search::generate(&log, 20)
            .await
            .unwrap();
    }
    let conn = rusqlite::Connection::open(&path).unwrap();
    let count = |sql: &str| -> i64 { conn.query_row(sql, [], |r| r.get(0)).unwrap() };
    let behind = count(
        "SELECT count(*) FROM logs l WHERE \
         (SELECT max(seq) FROM frames f WHERE f.session = l.session) > \
         COALESCE((SELECT through FROM search_marks m WHERE m.session = l.session), 0)",
    );
    assert_eq!(behind, 0, "sessions with frames left unindexed at the drop");
    assert!(count("SELECT count(*) FROM search_marks") >= 20);
    assert!(count("SELECT count(*) FROM search_docs") >= 20);
}
