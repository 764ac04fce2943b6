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

/// A trim and a delete take the index rows of the frames they remove, in
/// their transaction: the documents and their FTS5 entries. (A search joins
/// the frames, so rows left behind would never show as hits — they would
/// be garbage that grows; this counts the rows themselves.)
#[tokio::test]
async fn trim_and_delete_take_their_index_rows() {
    use harness_core::frame::{FrameBody, MessageKind, SessionId};
    use harness_core::log::AppendRequest;

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("retention.db");
    let (kept, gone) = (
        SessionId::parse("kept").unwrap(),
        SessionId::parse("gone").unwrap(),
    );
    {
        let log = SqliteSessionLog::open(&path).unwrap();
        for (session, frames) in [(&kept, 5), (&gone, 2)] {
            log.create(session).await.unwrap();
            for i in 1..=frames {
                let said = FrameBody::Message {
                    turn_id: "t1".into(),
                    id: format!("m{i}"),
                    kind: MessageKind::Text,
                    text: format!("pangolin number {i}"),
                    interrupted: false,
                };
                log.append(session, AppendRequest::new(said)).await.unwrap();
            }
        }
        // Dropping the log writes what its indexer holds (above).
    }
    let conn = rusqlite::Connection::open(&path).unwrap();
    let count = |sql: &str| -> i64 { conn.query_row(sql, [], |r| r.get(0)).unwrap() };
    let fts = "SELECT count(*) FROM search_fts WHERE search_fts MATCH 'pangolin'";
    assert_eq!(count("SELECT count(*) FROM search_docs"), 7);
    assert_eq!(count(fts), 7);
    {
        let log = SqliteSessionLog::open(&path).unwrap();
        log.trim(&kept, 3).await.unwrap();
        log.delete(&gone).await.unwrap();
    }
    assert_eq!(
        count("SELECT count(*) FROM search_docs WHERE session = 'kept' AND seq <= 3"),
        0,
        "the trimmed frames' documents"
    );
    assert_eq!(
        count("SELECT count(*) FROM search_docs WHERE session = 'kept'"),
        2
    );
    assert_eq!(
        count("SELECT count(*) FROM search_docs WHERE session = 'gone'"),
        0,
        "the deleted session's documents"
    );
    assert_eq!(count(fts), 2, "the FTS5 entries of what was removed");
}
