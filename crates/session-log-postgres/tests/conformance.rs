//! The log, turn-store, leases, search and retention conformance suites
//! against a real PostgreSQL (`cargo xtask services start` runs one;
//! `HARNESS_TEST_POSTGRES_URL` names it), each check in a database of its
//! own; three handles on one
//! database (what three nodes are) sharing one gap-free log; and the bad
//! inputs a node meets at start.

use std::sync::Arc;
use std::time::{Duration, Instant};

use harness_core::engine::TurnStore;
use harness_core::log::SessionLog;
use harness_core::ErrorKind;
use session_log_postgres::{PostgresSessionLog, SCHEMA_VERSION};

use harness_testkit::postgres::{admin_url, fresh_database};

/// A log in a new, empty database.
async fn fresh_log(admin: &str) -> Arc<dyn SessionLog> {
    let url = fresh_database(admin).await;
    Arc::new(PostgresSessionLog::connect(&url).await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_log_passes_the_conformance_suite() {
    let Some(admin) = admin_url() else { return };
    harness_testkit::conformance::log::run_all(|| fresh_log(&admin))
        .await
        .unwrap();
}

/// Three handles on one database, as three nodes have: written through at
/// once, one gap-free log, every key once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_handles_on_one_database_share_one_log() {
    let Some(admin) = admin_url() else { return };
    let url = fresh_database(&admin).await;
    let mut handles: Vec<Arc<dyn SessionLog>> = Vec::new();
    for _ in 0..3 {
        handles.push(Arc::new(PostgresSessionLog::connect(&url).await.unwrap()));
    }
    harness_testkit::conformance::log::handles_on_one_store(handles)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_turn_store_passes_the_conformance_suite() {
    let Some(admin) = admin_url() else { return };
    harness_testkit::conformance::turn_store::run_all(|| {
        let admin = admin.clone();
        async move {
            let url = fresh_database(&admin).await;
            let log = PostgresSessionLog::connect(&url).await.unwrap();
            Arc::new(log.turn_store()) as Arc<dyn TurnStore>
        }
    })
    .await
    .unwrap();
}

/// The session leases suite: nodes over one database.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_leases_pass_the_conformance_suite() {
    let Some(admin) = admin_url() else { return };
    harness_testkit::conformance::leases::run_all(|| {
        let admin = admin.clone();
        async move {
            let url = fresh_database(&admin).await;
            let log = PostgresSessionLog::connect(&url).await.unwrap();
            move |node: &str, ttl: Duration| {
                Arc::new(log.leases(node, ttl).unwrap())
                    as Arc<dyn harness_core::log::SessionLeases>
            }
        }
    })
    .await
    .unwrap();
}

/// What a node meets at start: a database written by a newer harness is
/// refused with the reason; an unreachable server fails fast, naming it
/// (without the password); a malformed URL is bad input.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newer_schema_an_unreachable_server_and_a_bad_url_are_refused_clearly() {
    let Some(admin) = admin_url() else { return };
    let (url, client, task) = made_database(&admin).await;
    client
        .execute(
            "UPDATE harness_schema SET version = $1",
            &[&(SCHEMA_VERSION + 1)],
        )
        .await
        .unwrap();
    drop(client);
    let _ = task.await;
    let err = PostgresSessionLog::connect(&url).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
    assert!(err.to_string().contains("newer"), "{err}");

    // Port 1 on loopback: nothing listens there.
    let started = Instant::now();
    let err = PostgresSessionLog::connect("postgres://harness:s3cret@127.0.0.1:1/db")
        .await
        .unwrap_err();
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(err.kind(), ErrorKind::Backend, "{err}");
    let text = err.to_string();
    assert!(
        text.contains("cannot connect to PostgreSQL at postgres://harness:***@127.0.0.1:1/db"),
        "{text}"
    );
    assert!(!text.contains("s3cret"), "{text}");

    let err = PostgresSessionLog::connect("postgres://127.0.0.1:notaport/db")
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
}

/// Two nodes, one session: the first takes the lease, the second cannot
/// while it lasts; once it expires the second takes it over with a higher
/// generation, and the first node's late append — its handle still
/// believing it owns the session — is refused as fenced, while the new
/// owner's lands right after the old owner's last frame.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_lease_fences_the_old_owner() {
    use harness_core::frame::{FrameBody, MessageKind, SessionId};
    use harness_core::log::AppendRequest;

    let Some(admin) = admin_url() else { return };
    let url = fresh_database(&admin).await;
    let base = PostgresSessionLog::connect(&url).await.unwrap();
    let ttl = Duration::from_millis(1500);
    let (leases_a, leases_b) = (
        base.leases("node-a", ttl).unwrap(),
        base.leases("node-b", ttl).unwrap(),
    );
    let (a, b) = (base.fenced(leases_a.clone()), base.fenced(leases_b.clone()));
    let s = SessionId::parse("leased").unwrap();
    base.create(&s).await.unwrap();
    let said = |t: &str| {
        AppendRequest::new(FrameBody::Message {
            turn_id: "t0".into(),
            id: t.into(),
            kind: MessageKind::Text,
            text: t.into(),
            interrupted: false,
        })
    };

    // Without a lease, no node appends.
    let err = a.append(&s, said("a0")).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Fenced, "{err}");

    let lease_a = leases_a.acquire(&s).await.unwrap().expect("a free lease");
    assert_eq!(lease_a.generation, 1);
    assert_eq!(a.append(&s, said("a1")).await.unwrap().seq, 1);
    // Held and renewed by A: B cannot take it, nor append.
    assert!(leases_b.acquire(&s).await.unwrap().is_none());
    assert!(leases_a.renew(&lease_a).await.unwrap());
    let err = b.append(&s, said("b0")).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Fenced, "{err}");
    // A re-acquiring its own lease keeps the generation.
    assert_eq!(leases_a.acquire(&s).await.unwrap().unwrap().generation, 1);

    // A stops renewing (paused, partitioned): once the lease expires, B
    // takes the session over.
    tokio::time::sleep(ttl + Duration::from_millis(300)).await;
    let lease_b = leases_b
        .acquire(&s)
        .await
        .unwrap()
        .expect("an expired lease");
    assert_eq!(lease_b.generation, 2);
    assert_eq!(
        base.leases("node-c", ttl).unwrap().owner(&s).await.unwrap(),
        Some(("node-b".to_string(), 2, false))
    );
    // A's late write is refused; B's follows A's last frame.
    let err = a.append(&s, said("a-late")).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Fenced, "{err}");
    assert!(err.to_string().contains("node-b"), "{err}");
    assert_eq!(b.append(&s, said("b1")).await.unwrap().seq, 2);
    // A learns it on renewal, too, and forgets the lease: its next append
    // is refused before the row is read.
    assert!(!leases_a.renew(&lease_a).await.unwrap());
    let err = a.append(&s, said("a-later")).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Fenced, "{err}");
    assert!(err.to_string().contains("holds no lease"), "{err}");
    // A clean release lets the next owner in at once.
    leases_b.release(&lease_b).await.unwrap();
    let lease_a2 = leases_a
        .acquire(&s)
        .await
        .unwrap()
        .expect("a released lease");
    assert_eq!(lease_a2.generation, 3);
    assert_eq!(a.append(&s, said("a2")).await.unwrap().seq, 3);
    let frames = base.read(&s, 0, 10).await.unwrap();
    assert_eq!(frames.len(), 3);
}

/// A node restarted under the same name takes its expired lease back at a
/// new generation; its previous life (paused, not dead) still believes it
/// holds generation 1, and its appends are refused: the row must match on
/// the node *and* the generation. A node's name is 1 to 200 bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nodes_previous_life_is_fenced_by_its_next() {
    use harness_core::frame::{FrameBody, SessionId};
    use harness_core::log::AppendRequest;

    let Some(admin) = admin_url() else { return };
    let url = fresh_database(&admin).await;
    let base = PostgresSessionLog::connect(&url).await.unwrap();
    let ttl = Duration::from_millis(1000);
    let (before, after) = (
        base.leases("node-a", ttl).unwrap(),
        base.leases("node-a", ttl).unwrap(),
    );
    assert!(format!("{before:?}").contains("node-a"), "{before:?}");
    assert_eq!((before.node(), before.ttl()), ("node-a", ttl));
    let (old, new) = (base.fenced(before.clone()), base.fenced(after.clone()));
    let s = SessionId::parse("restarted").unwrap();
    base.create(&s).await.unwrap();
    let prompt = |t: &str| {
        AppendRequest::new(FrameBody::UserMessage {
            text: t.into(),
            turn_id: None,
        })
    };
    assert_eq!(before.acquire(&s).await.unwrap().unwrap().generation, 1);
    assert_eq!(old.append(&s, prompt("first life")).await.unwrap().seq, 1);
    tokio::time::sleep(ttl + Duration::from_millis(300)).await;
    assert_eq!(after.acquire(&s).await.unwrap().unwrap().generation, 2);
    let err = old.append(&s, prompt("late")).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Fenced, "{err}");
    assert!(err.to_string().contains("generation 2"), "{err}");
    assert_eq!(new.append(&s, prompt("second life")).await.unwrap().seq, 2);

    for bad in [String::new(), "n".repeat(201)] {
        let err = base.leases(&bad, ttl).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidInput, "{bad:?}: {err}");
    }
    assert_eq!(
        base.leases(&"n".repeat(200), ttl).unwrap().node().len(),
        200
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_log_passes_the_search_suite() {
    let Some(admin) = admin_url() else { return };
    harness_testkit::conformance::search::run_all(|| fresh_log(&admin))
        .await
        .unwrap();
}

/// Retention (delete, trim), each check in a database of its own, under a
/// chain key the store is given (the kept frames verify from the cut).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_log_passes_the_retention_suite() {
    let Some(admin) = admin_url() else { return };
    let key = harness_core::log::ChainKey::new(*b"postgres retention");
    harness_testkit::conformance::retention::run_all(
        || {
            let (admin, key) = (admin.clone(), key.clone());
            async move {
                let url = fresh_database(&admin).await;
                let log = PostgresSessionLog::connect(&url).await.unwrap();
                Arc::new(log.with_chain_key(key)) as Arc<dyn SessionLog>
            }
        },
        &key,
    )
    .await
    .unwrap();
}

/// What the suites do not see: a database made before retention gains
/// the cut columns at the next start; a fenced handle trims and deletes
/// only while it holds the session's lease; a delete takes the session's
/// turn rows and lease row with it, and no other session's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_migrates_old_databases_is_fenced_and_clears_turns_and_leases() {
    use harness_core::frame::{FrameBody, SessionId};
    use harness_core::log::AppendRequest;

    let Some(admin) = admin_url() else { return };
    let (url, client, task) = made_database(&admin).await;
    client
        .batch_execute(
            "ALTER TABLE harness_logs DROP COLUMN cut_through, DROP COLUMN cut_hash, \
             DROP COLUMN cut_meta",
        )
        .await
        .unwrap();
    let base = PostgresSessionLog::connect(&url).await.unwrap();

    let ttl = Duration::from_secs(30);
    let leases = base.leases("node-a", ttl).unwrap();
    let fenced = base.fenced(leases.clone());
    let (s, other) = (
        SessionId::parse("doomed").unwrap(),
        SessionId::parse("other").unwrap(),
    );
    for id in [&s, &other] {
        base.create(id).await.unwrap();
        for i in 0..3 {
            base.append(
                id,
                AppendRequest::new(FrameBody::UserMessage {
                    text: format!("p{i}"),
                    turn_id: None,
                }),
            )
            .await
            .unwrap();
        }
        client
            .execute(
                "INSERT INTO harness_turns (session, turn, state, done) \
                 VALUES ($1, 't1', '{}', FALSE)",
                &[&id.as_str()],
            )
            .await
            .unwrap();
    }
    let err = fenced.trim(&s, 1).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Fenced, "{err}");
    let err = fenced.delete(&s).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Fenced, "{err}");
    assert!(base.info(&s).await.unwrap().trimmed.is_none());

    leases.acquire(&s).await.unwrap().expect("a free lease");
    leases.acquire(&other).await.unwrap().expect("a free lease");
    let info = fenced.trim(&s, 2).await.unwrap();
    assert_eq!(info.trimmed.map(|c| c.through), Some(2));
    fenced.delete(&s).await.unwrap();
    let count = |table: &'static str, id: &'static str| {
        let client = &client;
        async move {
            client
                .query_one(
                    &format!("SELECT count(*) FROM {table} WHERE session = $1"),
                    &[&id],
                )
                .await
                .unwrap()
                .get::<_, i64>(0)
        }
    };
    for (table, others) in [
        ("harness_turns", 1),
        ("harness_leases", 1),
        ("harness_frames", 3),
        ("harness_search", 3),
        ("harness_logs", 1),
    ] {
        assert_eq!(count(table, "doomed").await, 0, "{table}");
        assert_eq!(
            count(table, "other").await,
            others,
            "{table} of another session"
        );
    }
    drop(client);
    let _ = task.await;
}

/// A fresh database the log has made its schema in, and a plain client on
/// it (its connection's task: drop the client, then await it) to edit
/// what the log wrote.
async fn made_database(
    admin: &str,
) -> (
    String,
    tokio_postgres::Client,
    tokio::task::JoinHandle<Result<(), tokio_postgres::Error>>,
) {
    let url = fresh_database(admin).await;
    drop(PostgresSessionLog::connect(&url).await.unwrap());
    let (client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    (url, client, tokio::spawn(connection))
}
