//! Runs the official Durable Streams conformance suite
//! (`harness_testkit::conformance::durable_streams`) against the real
//! `/v1/stream/*` router on a real TCP port, with the in-memory and the
//! SQLite store. The Worker runs the same suite (harness-worker's
//! tests/wrangler.rs).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use harness_testkit::conformance::durable_streams as suite;
use session_server::durable_streams::{router, DurableStreamsState, StreamStore};

/// Serve `state` on a real port and run the suite against it.
async fn run_suite(dir: &Path, state: DurableStreamsState) -> suite::Counts {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let server = tokio::spawn(async move {
        axum::serve(listener, router(state)).await.expect("serve");
    });
    let dir = dir.to_path_buf();
    let counts = tokio::task::spawn_blocking(move || suite::run(&dir, &format!("http://{addr}")))
        .await
        .expect("suite task");
    server.abort();
    counts
}

/// One test runs both stores one after the other: two suites at once on a
/// two-core machine would turn timing tests flaky.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn durable_streams_conformance_suite() {
    let Some(dir) = tokio::task::spawn_blocking(suite::available_or_skip)
        .await
        .expect("install task")
    else {
        return;
    };

    // The suite waits up to 5 s for a long-poll: the server answers in 2.
    let mut memory = DurableStreamsState::new();
    memory.long_poll_timeout = Duration::from_secs(2);
    let counts = run_suite(&dir, memory).await;
    suite::check("memory", &counts);

    let db = tempfile::tempdir().expect("tempdir");
    let mut sqlite = DurableStreamsState::new();
    sqlite.long_poll_timeout = Duration::from_secs(2);
    sqlite.store = Arc::new(StreamStore::open(db.path().join("streams.db")).expect("open store"));
    let counts = run_suite(&dir, sqlite).await;
    suite::check("sqlite", &counts);
}
