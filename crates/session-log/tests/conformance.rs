//! The shared `SessionLog` conformance suite against the SQLite log, on a
//! file (WAL) and in memory, plus SQLite-specific checks: data survives a
//! reopen, and the memory log passes the same suite (the suite's own sanity).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use harness_core::engine::TurnStore;
use harness_core::log::{AppendRequest, MemorySessionLog, SessionLog};
use harness_core::{ErrorKind, FrameBody, SessionId};
use session_log::{SqliteSessionLog, SqliteTurnStore};

#[tokio::test]
async fn sqlite_file_log_passes_the_conformance_suite() {
    let dir = tempfile::tempdir().unwrap();
    let n = AtomicUsize::new(0);
    harness_testkit::conformance::log::run_all(|| {
        let path = dir
            .path()
            .join(format!("log-{}.db", n.fetch_add(1, Ordering::SeqCst)));
        async move { Arc::new(SqliteSessionLog::open(path).unwrap()) as Arc<dyn SessionLog> }
    })
    .await
    .unwrap();
}

/// Retention (delete, trim) on a file, where the indexer thread writes the
/// index after each commit, and in memory, where the writer does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_log_passes_the_retention_suite() {
    let dir = tempfile::tempdir().unwrap();
    let n = AtomicUsize::new(0);
    let key = harness_core::log::ChainKey::new(*b"sqlite retention");
    harness_testkit::conformance::retention::run_all(
        || {
            let path = dir
                .path()
                .join(format!("ret-{}.db", n.fetch_add(1, Ordering::SeqCst)));
            let key = key.clone();
            async move {
                Arc::new(SqliteSessionLog::open(path).unwrap().with_chain_key(key))
                    as Arc<dyn SessionLog>
            }
        },
        &key,
    )
    .await
    .unwrap();
    harness_testkit::conformance::retention::run_all(
        || async {
            Arc::new(
                SqliteSessionLog::open_in_memory()
                    .unwrap()
                    .with_chain_key(key.clone()),
            ) as Arc<dyn SessionLog>
        },
        &key,
    )
    .await
    .unwrap();
}

/// Three connections to one file (what three processes have) written
/// through at once: one gap-free log, every key once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_connections_on_one_file_share_one_log() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("shared.db");
    let handles: Vec<Arc<dyn SessionLog>> = (0..3)
        .map(|_| Arc::new(SqliteSessionLog::open(&path).unwrap()) as Arc<dyn SessionLog>)
        .collect();
    harness_testkit::conformance::log::handles_on_one_store(handles)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_turn_store_passes_the_conformance_suite() {
    let dir = tempfile::tempdir().unwrap();
    let n = AtomicUsize::new(0);
    harness_testkit::conformance::turn_store::run_all(|| {
        let path = dir
            .path()
            .join(format!("turns-{}.db", n.fetch_add(1, Ordering::SeqCst)));
        async move { Arc::new(SqliteTurnStore::open(path).unwrap()) as Arc<dyn TurnStore> }
    })
    .await
    .unwrap();
    // Two connections on one file: the fence holds across them.
    let path = dir.path().join("turns-shared.db");
    let (a, b) = (
        SqliteTurnStore::open(&path).unwrap(),
        SqliteTurnStore::open(&path).unwrap(),
    );
    let s = |c| {
        harness_testkit::conformance::turn_store::state(
            "s",
            "t",
            harness_core::turn::TurnStatus::ReadyForNextStep,
            c,
        )
    };
    a.save(&s(1), 2).await.unwrap();
    b.save(&s(2), 3).await.unwrap();
    assert_eq!(
        a.save(&s(3), 2).await.unwrap_err().kind(),
        ErrorKind::Fenced
    );
    assert_eq!(a.load("s", "t").await.unwrap().unwrap().cursor, 2);
}

#[tokio::test]
async fn sqlite_memory_log_passes_the_conformance_suite() {
    harness_testkit::conformance::log::run_all(|| async {
        Arc::new(SqliteSessionLog::open_in_memory().unwrap()) as Arc<dyn SessionLog>
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn memory_log_passes_the_conformance_suite() {
    harness_testkit::conformance::log::run_all(|| async {
        Arc::new(MemorySessionLog::new()) as Arc<dyn SessionLog>
    })
    .await
    .unwrap();
}

fn prompt(text: &str) -> FrameBody {
    FrameBody::UserMessage {
        text: text.into(),
        turn_id: None,
    }
}

#[tokio::test]
async fn frames_keys_seal_and_forks_survive_a_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("log.db");
    let s = SessionId::parse("s1").unwrap();
    let f = SessionId::parse("s1-fork").unwrap();
    {
        let log = SqliteSessionLog::open(&path).unwrap();
        log.create(&s).await.unwrap();
        log.append(&s, AppendRequest::idempotent(prompt("a"), "k1"))
            .await
            .unwrap();
        log.append(&s, AppendRequest::new(prompt("b")))
            .await
            .unwrap();
        log.fork(&s, 1, &f).await.unwrap();
        log.seal(&s).await.unwrap();
    }
    let log = SqliteSessionLog::open(&path).unwrap();
    let info = log.info(&s).await.unwrap();
    assert!(info.sealed);
    assert_eq!(info.last_seq, 3);
    let frames = log.read(&s, 0, 10).await.unwrap();
    assert_eq!(frames[0].body, prompt("a"));
    assert!(frames[0].at_ms > 0, "the log stamps frames with its clock");
    // The key is still known after the reopen, even on a sealed log.
    let dup = log
        .append(&s, AppendRequest::idempotent(prompt("a"), "k1"))
        .await
        .unwrap();
    assert!(dup.duplicate && dup.seq == 1);
    let err = log
        .append(&s, AppendRequest::new(prompt("c")))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Conflict);
    let fork = log.info(&f).await.unwrap();
    // Prompt "a" and the frame that closes its turn in the fork.
    assert_eq!(fork.last_seq, 2);
    assert!(!fork.sealed);
    assert!(fork.meta.active_turn().is_none());
    assert_eq!(fork.forked_from.unwrap().session, s);
}

#[tokio::test]
async fn forking_a_sealed_log_whole_keeps_the_seal_and_a_prefix_does_not() {
    let log = SqliteSessionLog::open_in_memory().unwrap();
    let s = SessionId::parse("src").unwrap();
    log.create(&s).await.unwrap();
    log.append(&s, AppendRequest::new(prompt("a")))
        .await
        .unwrap();
    let sealed = log.seal(&s).await.unwrap();
    let whole = log
        .fork(&s, sealed.last_seq, &SessionId::parse("whole").unwrap())
        .await
        .unwrap();
    assert!(whole.sealed, "a fork including the seal frame is sealed");
    let prefix = log
        .fork(&s, 1, &SessionId::parse("prefix").unwrap())
        .await
        .unwrap();
    assert!(!prefix.sealed);
    // The prefix ends inside the prompt's turn: the fork closed it (seq 2).
    assert_eq!(prefix.last_seq, 2);
    assert!(prefix.meta.active_turn().is_none());
    let next = log
        .append(&prefix.session, AppendRequest::new(prompt("go on")))
        .await
        .unwrap();
    assert_eq!(next.seq, 3);
}

#[tokio::test]
async fn a_smaller_frame_limit_is_enforced() {
    let log = SqliteSessionLog::open_in_memory()
        .unwrap()
        .with_max_frame_bytes(100);
    let s = SessionId::parse("small").unwrap();
    log.create(&s).await.unwrap();
    let err = log
        .append(&s, AppendRequest::new(prompt(&"x".repeat(200))))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput);
    assert_eq!(log.info(&s).await.unwrap().last_seq, 0);
}

#[tokio::test]
async fn meta_survives_a_reopen_and_an_old_database_is_migrated() {
    use harness_core::session::SessionConfig;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("meta.db");
    let s = SessionId::parse("m").unwrap();
    {
        let log = SqliteSessionLog::open(&path).unwrap();
        log.create_with(&s, Some(SessionConfig::new("codex", "local")))
            .await
            .unwrap();
        log.append(
            &s,
            AppendRequest::idempotent(
                FrameBody::UserMessage {
                    text: "go".into(),
                    turn_id: Some("t1".into()),
                },
                "p",
            ),
        )
        .await
        .unwrap();
    }
    let log = SqliteSessionLog::open(&path).unwrap();
    let meta = log.info(&s).await.unwrap().meta;
    assert_eq!(meta.config.unwrap().agent, "codex");
    assert_eq!(meta.turn.unwrap().key.as_deref(), Some("p"));

    // A database from before the meta column: the schema of the first
    // release, one session with a prompt and a runner generation.
    let old = dir.path().join("old.db");
    {
        let conn = rusqlite::Connection::open(&old).unwrap();
        conn.execute_batch(
            "CREATE TABLE logs (session TEXT PRIMARY KEY NOT NULL, sealed INTEGER NOT NULL DEFAULT 0, forked_from TEXT, fork_until INTEGER);
             CREATE TABLE frames (session TEXT NOT NULL, seq INTEGER NOT NULL, at_ms INTEGER NOT NULL, body TEXT NOT NULL, idem_key TEXT, PRIMARY KEY (session, seq)) WITHOUT ROWID;
             CREATE TABLE turns (session TEXT NOT NULL, turn TEXT NOT NULL, state TEXT NOT NULL, done INTEGER NOT NULL, PRIMARY KEY (session, turn));
             INSERT INTO logs (session) VALUES ('old');
             INSERT INTO frames VALUES ('old', 1, 5, '{\"type\":\"runner-attached\",\"generation\":9}', NULL);
             INSERT INTO frames VALUES ('old', 2, 6, '{\"type\":\"user-message\",\"text\":\"hi\",\"turnId\":\"t1\"}', 'prompt:t1');",
        )
        .unwrap();
    }
    let log = SqliteSessionLog::open(&old).unwrap();
    let s = SessionId::parse("old").unwrap();
    let meta = log.info(&s).await.unwrap().meta;
    assert_eq!(meta.generation, 9);
    let turn = meta.active_turn().expect("the prompt's turn is running");
    assert_eq!(
        (turn.turn_id.as_str(), turn.key.as_deref()),
        ("t1", Some("prompt:t1"))
    );
    // The next append that touches the meta stores the folded meta.
    log.append(
        &s,
        AppendRequest::new(FrameBody::RunnerAttached { generation: 10 }),
    )
    .await
    .unwrap();
    assert_eq!(log.info(&s).await.unwrap().meta.generation, 10);
}

/// Processes that open a database file nobody has created yet race to make
/// it (WAL switch, schema): `harness sessions list` run while `harness run`
/// starts did. Every opener must succeed, each on a new file, several times.
#[test]
fn connections_racing_to_create_one_file_all_open_it() {
    let dir = tempfile::tempdir().unwrap();
    for round in 0..20 {
        let path = dir.path().join(format!("fresh-{round}.db"));
        let barrier = Arc::new(std::sync::Barrier::new(6));
        let openers: Vec<_> = (0..6)
            .map(|_| {
                let path = path.clone();
                let barrier = barrier.clone();
                std::thread::spawn(move || {
                    barrier.wait();
                    SqliteSessionLog::open(&path).map(|_| ())
                })
            })
            .collect();
        for opener in openers {
            let result = opener.join().unwrap();
            assert!(result.is_ok(), "round {round}: {result:?}");
        }
    }
}
