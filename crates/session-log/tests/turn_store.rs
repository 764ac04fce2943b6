//! `SqliteTurnStore`: save/load round-trips, `unfinished` follows
//! `next_step`, and states survive a reopen.

use harness_core::engine::TurnStore;
use harness_core::turn::{TurnState, TurnStatus};
use harness_core::ErrorKind;
use session_log::{SqliteSessionLog, SqliteTurnStore};

fn state(session: &str, turn: &str, status: TurnStatus) -> TurnState {
    harness_testkit::conformance::turn_store::state(session, turn, status, 0)
}

#[tokio::test]
async fn turn_states_round_trip_and_survive_a_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("turns.db");
    {
        let store = SqliteTurnStore::open(&path).unwrap();
        store
            .save(&state("s", "t1", TurnStatus::NotStarted), 1)
            .await
            .unwrap();
        store
            .save(&state("s", "t2", TurnStatus::NotStarted), 1)
            .await
            .unwrap();
        // Replacing a state: t2 finishes.
        store
            .save(&state("s", "t2", TurnStatus::Finished), 1)
            .await
            .unwrap();
        assert_eq!(
            store.load("s", "t2").await.unwrap().unwrap().status,
            TurnStatus::Finished
        );
    }
    let store = SqliteTurnStore::open(&path).unwrap();
    assert!(store.load("s", "nope").await.unwrap().is_none());
    let loaded = store.load("s", "t1").await.unwrap().unwrap();
    assert_eq!(loaded, state("s", "t1", TurnStatus::NotStarted));
    let unfinished: Vec<String> = store
        .unfinished()
        .await
        .unwrap()
        .into_iter()
        .map(|s| s.turn_id)
        .collect();
    assert_eq!(unfinished, vec!["t1".to_string()]);
}

#[tokio::test]
async fn the_log_and_the_turn_store_share_one_file() {
    let dir = tempfile::tempdir().unwrap();
    let log = SqliteSessionLog::open(dir.path().join("both.db")).unwrap();
    let store = log.turn_store();
    store
        .save(&state("s", "t", TurnStatus::ReadyForNextStep), 1)
        .await
        .unwrap();
    assert_eq!(store.unfinished().await.unwrap().len(), 1);
}

#[tokio::test]
async fn a_replaced_engine_cannot_overwrite_its_successors_state() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteTurnStore::open(dir.path().join("fence.db")).unwrap();
    let mut older = state("s", "t", TurnStatus::ReadyForNextStep);
    older.cursor = 10;
    store.save(&older, 5).await.unwrap();
    let mut newer = older.clone();
    newer.cursor = 99;
    store.save(&newer, 6).await.unwrap();
    // The engine of generation 5 wakes up and saves what it had.
    let err = store.save(&older, 5).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Fenced, "{err}");
    assert_eq!(store.load("s", "t").await.unwrap().unwrap().cursor, 99);
    // The same generation keeps saving; a newer one takes over.
    store.save(&newer, 6).await.unwrap();
    store.save(&older, 7).await.unwrap();
    assert_eq!(store.load("s", "t").await.unwrap().unwrap().cursor, 10);
}
