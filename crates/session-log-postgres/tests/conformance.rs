//! The log and turn-store conformance suites against a real PostgreSQL
//! (`cargo xtask services start` runs one; `HARNESS_TEST_POSTGRES_URL`
//! names it), each check in a database of its own; three handles on one
//! database (what three nodes are) sharing one gap-free log; and the bad
//! inputs a node meets at start.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use harness_core::engine::TurnStore;
use harness_core::log::SessionLog;
use harness_core::ErrorKind;
use session_log_postgres::{PostgresSessionLog, SCHEMA_VERSION};

/// The test server's URL, or `None` after a skip.
fn admin_url() -> Option<String> {
    match std::env::var("HARNESS_TEST_POSTGRES_URL") {
        Ok(url) if !url.is_empty() => Some(url),
        _ => {
            harness_testkit::skip_or_fail(
                "HARNESS_TEST_POSTGRES_URL is not set (cargo xtask services start; eval \"$(cargo xtask env)\")",
            );
            None
        }
    }
}

static DATABASES: AtomicUsize = AtomicUsize::new(0);

/// A new, empty database on the server of `admin`; its URL.
async fn fresh_database(admin: &str) -> String {
    let name = format!(
        "harness_t{}_{}",
        std::process::id(),
        DATABASES.fetch_add(1, Ordering::SeqCst)
    );
    let (client, connection) = tokio_postgres::connect(admin, tokio_postgres::NoTls)
        .await
        .expect("the test PostgreSQL answers");
    let task = tokio::spawn(connection);
    // Two statements: a multi-statement string is one implicit
    // transaction, which neither may run in.
    for sql in [
        format!("DROP DATABASE IF EXISTS {name}"),
        format!("CREATE DATABASE {name}"),
    ] {
        client.batch_execute(&sql).await.expect("a test database");
    }
    drop(client);
    let _ = task.await;
    let (base, _) = admin.rsplit_once('/').expect("a URL with a database");
    format!("{base}/{name}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_log_passes_the_conformance_suite() {
    let Some(admin) = admin_url() else { return };
    harness_testkit::conformance::log::run_all(|| {
        let admin = admin.clone();
        async move {
            let url = fresh_database(&admin).await;
            Arc::new(PostgresSessionLog::connect(&url).await.unwrap()) as Arc<dyn SessionLog>
        }
    })
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

/// What a node meets at start: a database written by a newer harness is
/// refused with the reason; an unreachable server fails fast, naming it
/// (without the password); a malformed URL is bad input.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newer_schema_an_unreachable_server_and_a_bad_url_are_refused_clearly() {
    let Some(admin) = admin_url() else { return };
    let url = fresh_database(&admin).await;
    drop(PostgresSessionLog::connect(&url).await.unwrap());
    let (client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    let task = tokio::spawn(connection);
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
