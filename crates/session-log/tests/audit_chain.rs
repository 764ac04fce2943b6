//! The audit chain on SQLite, tampered with the way someone holding the
//! database file would: a body edited in place, a frame deleted, every
//! frame after some point rewritten with its hashes recomputed. `verify`
//! names the first frame that does not hold. Also: a database written
//! before the chain existed gets the column and chains from then on.

use std::sync::Arc;

use harness_core::frame::MessageKind;
use harness_core::log::chain::link;
use harness_core::log::{verify_log, AppendRequest, ChainBreak, ChainKey, FrameHash, SessionLog};
use harness_core::{FrameBody, SessionId};
use rusqlite::{params, Connection};
use session_log::SqliteSessionLog;

fn key() -> ChainKey {
    ChainKey::new(*b"a deployment secret, not in the db")
}

fn said(i: u64) -> FrameBody {
    FrameBody::Message {
        turn_id: "t0".into(),
        id: format!("m{i}"),
        kind: MessageKind::Text,
        text: format!("the agent said {i}"),
        interrupted: false,
    }
}

/// A keyed log file holding session `s` with `n` frames (frame 2 with an
/// idempotency key), and the session id.
async fn log_with(dir: &std::path::Path, n: u64) -> (Arc<dyn SessionLog>, SessionId) {
    let log = SqliteSessionLog::open(dir.join("log.db"))
        .unwrap()
        .with_chain_key(key());
    let s = SessionId::parse("s").unwrap();
    log.create(&s).await.unwrap();
    for i in 1..=n {
        let request = if i == 2 {
            AppendRequest::idempotent(said(i), "k2")
        } else {
            AppendRequest::new(said(i))
        };
        log.append(&s, request).await.unwrap();
    }
    (Arc::new(log), s)
}

fn raw(dir: &std::path::Path) -> Connection {
    Connection::open(dir.join("log.db")).unwrap()
}

#[tokio::test]
async fn the_keyed_file_log_passes_the_chain_conformance() {
    let dir = tempfile::tempdir().unwrap();
    let log = SqliteSessionLog::open(dir.path().join("log.db"))
        .unwrap()
        .with_chain_key(key());
    harness_testkit::conformance::log::every_frame_is_chained(Arc::new(log), &key())
        .await
        .unwrap();
}

#[tokio::test]
async fn a_body_edited_in_the_database_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let (log, s) = log_with(dir.path(), 8).await;
    assert!(verify_log(log.clone(), &s, &key()).await.unwrap().intact());
    let changed = raw(dir.path())
        .execute(
            "UPDATE frames SET body = replace(body, 'said 5', 'said five') \
             WHERE session = 's' AND seq = 5",
            [],
        )
        .unwrap();
    assert_eq!(changed, 1);
    let report = verify_log(log.clone(), &s, &key()).await.unwrap();
    assert_eq!(report.broken, Some(ChainBreak::Mismatch { seq: 5 }));
    // A stamp moved is found the same way.
    let dir = tempfile::tempdir().unwrap();
    let (log, s) = log_with(dir.path(), 4).await;
    raw(dir.path())
        .execute("UPDATE frames SET at_ms = at_ms - 60000 WHERE seq = 3", [])
        .unwrap();
    let report = verify_log(log, &s, &key()).await.unwrap();
    assert_eq!(report.broken, Some(ChainBreak::Mismatch { seq: 3 }));
}

#[tokio::test]
async fn a_deleted_frame_is_named_as_the_gap() {
    let dir = tempfile::tempdir().unwrap();
    let (log, s) = log_with(dir.path(), 8).await;
    raw(dir.path())
        .execute("DELETE FROM frames WHERE session = 's' AND seq = 4", [])
        .unwrap();
    let report = verify_log(log, &s, &key()).await.unwrap();
    assert_eq!(
        report.broken,
        Some(ChainBreak::Gap {
            after: 3,
            next: Some(5)
        })
    );
    assert!(
        report
            .broken
            .unwrap()
            .to_string()
            .contains("frames 4..=4 are missing"),
        "the break says which frames"
    );
}

#[tokio::test]
async fn a_consistent_rewrite_from_some_point_on_is_caught_without_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let (log, s) = log_with(dir.path(), 8).await;
    // The writer of the database rewrites frames 5..=8 and recomputes each
    // hash from the one before, as an unkeyed chain would let it; it does
    // not hold the key, so it uses the empty one (any other guess is as
    // good).
    let conn = raw(dir.path());
    let prev: Vec<u8> = conn
        .query_row(
            "SELECT hash FROM frames WHERE session = 's' AND seq = 4",
            [],
            |r| r.get(0),
        )
        .unwrap();
    let mut prev = FrameHash::from_slice(&prev).unwrap();
    for seq in 5..=8u64 {
        let (at_ms, body): (i64, String) = conn
            .query_row(
                "SELECT at_ms, body FROM frames WHERE session = 's' AND seq = ?1",
                params![seq as i64],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .unwrap();
        let body = body.replace("the agent said", "nobody said");
        let hash = link(&ChainKey::unkeyed(), &prev, seq, at_ms as u64, None, &body);
        conn.execute(
            "UPDATE frames SET body = ?2, hash = ?3 WHERE session = 's' AND seq = ?1",
            params![seq as i64, body, &hash.as_bytes()[..]],
        )
        .unwrap();
        prev = hash;
    }
    let report = verify_log(log.clone(), &s, &key()).await.unwrap();
    assert_eq!(report.broken, Some(ChainBreak::Mismatch { seq: 5 }));
    // The rewrite is itself a whole chain under the key it was made with:
    // only the key tells them apart.
    let rewritten = verify_log(log, &s, &ChainKey::unkeyed()).await.unwrap();
    assert_eq!(rewritten.broken, Some(ChainBreak::Mismatch { seq: 1 }));
}

#[tokio::test]
async fn a_removed_hash_is_named_and_a_wrong_length_one_is_an_error_naming_the_frame() {
    let dir = tempfile::tempdir().unwrap();
    let (log, s) = log_with(dir.path(), 5).await;
    raw(dir.path())
        .execute("UPDATE frames SET hash = NULL WHERE seq = 3", [])
        .unwrap();
    let report = verify_log(log.clone(), &s, &key()).await.unwrap();
    assert_eq!(report.broken, Some(ChainBreak::Unchained { seq: 3 }));
    raw(dir.path())
        .execute("UPDATE frames SET hash = x'0102' WHERE seq = 4", [])
        .unwrap();
    let err = verify_log(log, &s, &key()).await.unwrap_err();
    assert!(err.to_string().contains("frame 4"), "{err}");
}

#[tokio::test]
async fn a_database_from_before_the_chain_gets_the_column_and_chains_from_then_on() {
    let dir = tempfile::tempdir().unwrap();
    // The schema as it was before the chain: no `hash` column.
    let conn = raw(dir.path());
    conn.execute_batch(
        "CREATE TABLE logs (session TEXT PRIMARY KEY NOT NULL, sealed INTEGER NOT NULL DEFAULT 0,
             forked_from TEXT, fork_until INTEGER, meta TEXT);
         CREATE TABLE frames (session TEXT NOT NULL, seq INTEGER NOT NULL, at_ms INTEGER NOT NULL,
             body TEXT NOT NULL, idem_key TEXT, PRIMARY KEY (session, seq)) WITHOUT ROWID;
         INSERT INTO logs (session) VALUES ('old');",
    )
    .unwrap();
    for seq in 1..=2u64 {
        conn.execute(
            "INSERT INTO frames (session, seq, at_ms, body) VALUES ('old', ?1, 1000, ?2)",
            params![seq as i64, serde_json::to_string(&said(seq)).unwrap()],
        )
        .unwrap();
    }
    drop(conn);
    let log: Arc<dyn SessionLog> = Arc::new(
        SqliteSessionLog::open(dir.path().join("log.db"))
            .unwrap()
            .with_chain_key(key()),
    );
    let s = SessionId::parse("old").unwrap();
    log.append(&s, AppendRequest::new(said(3))).await.unwrap();
    log.append(&s, AppendRequest::new(said(4))).await.unwrap();
    let report = verify_log(log.clone(), &s, &key()).await.unwrap();
    assert!(report.intact(), "{report:?}");
    assert_eq!((report.frames, report.unchained), (4, 2));
    // From there on the chain protects as anywhere else.
    raw(dir.path())
        .execute(
            "UPDATE frames SET body = replace(body, 'said 4', 'said 44') WHERE seq = 4",
            [],
        )
        .unwrap();
    let report = verify_log(log, &s, &key()).await.unwrap();
    assert_eq!(report.broken, Some(ChainBreak::Mismatch { seq: 4 }));
}
