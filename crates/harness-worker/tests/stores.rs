//! The Worker's stores under the suites every native store passes: the
//! Durable Object's log (`src/store.rs`, `DoStore`) under
//! `conformance::log`, `conformance::retention` (delete, trim, search
//! across the objects) and `conformance::search` (all but its thousand
//! sessions), and the R2 store (`src/checkpoints.rs`, `R2Store`, on
//! wrangler's local bucket) under `conformance::checkpoint`, corruption
//! included. Each trait call is one request to the test build's routes
//! (`src/test_routes.rs`), which make that call on the real store in
//! workerd: `harness_testkit::worker_stores` is the HTTP adapter.
//!
//! Needs the test build and wrangler (`cargo xtask worker build
//! --test-routes`); without them it skips, or fails under
//! `HARNESS_REQUIRE_REAL=1`.

#![cfg(not(target_arch = "wasm32"))]

use std::sync::Arc;

use anyhow::Context;
use harness_core::log::{ChainKey, SessionLog};
use harness_testkit::conformance::session_api::HOST;
use harness_testkit::conformance::{checkpoint, log, retention, search};
use harness_testkit::worker_stores::{WorkerCheckpoints, WorkerLog};
use harness_testkit::wrangler::test_build_with_suite_tokens;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_workers_log_and_r2_store_pass_the_shared_suites() {
    let Some(dev) = test_build_with_suite_tokens().await else {
        return;
    };
    let base = dev.base.clone();
    // A fresh log per check: a namespace of its own (worker_stores docs).
    let fresh_log = || {
        let base = base.clone();
        async move { Arc::new(WorkerLog::new(&base, HOST)) as Arc<dyn SessionLog> }
    };
    let logs = log::run_all(fresh_log).await;
    if let Err(e) = logs {
        panic!(
            "the Durable Object's log fails the log suite: {e:#}\n--- wrangler dev ---\n{}",
            dev.log_tail()
        );
    }
    // Retention: delete and trim through the public routes, search across
    // the objects (no audit key is set: the chain is unkeyed).
    let kept = retention::run_all(fresh_log, &ChainKey::unkeyed()).await;
    if let Err(e) = kept {
        panic!(
            "the Durable Object's log fails the retention suite: {e:#}\n--- wrangler dev ---\n{}",
            dev.log_tail()
        );
    }
    // Search over the objects: the suite's checks but its thousand
    // sessions (a thousand Durable Objects under `wrangler dev` is minutes
    // of CI for what the native stores show; hits ranked across objects:
    // `tests/wrangler.rs`, `the_worker_searches_across_sessions`).
    let found = async {
        search::a_new_frame_is_found_as_soon_as_it_is_stored(fresh_log().await)
            .await
            .context("a_new_frame_is_found_as_soon_as_it_is_stored")?;
        search::a_fork_finds_its_prefix_and_its_own_frames(fresh_log().await)
            .await
            .context("a_fork_finds_its_prefix_and_its_own_frames")?;
        search::bad_queries_are_refused_with_the_reason(fresh_log().await)
            .await
            .context("bad_queries_are_refused_with_the_reason")
    }
    .await;
    if let Err(e) = found {
        panic!(
            "the Durable Object's log fails the search suite: {e:#}\n--- wrangler dev ---\n{}",
            dev.log_tail()
        );
    }
    let checkpoints = checkpoint::run_all(|| {
        let base = base.clone();
        async move {
            WorkerCheckpoints::new(&base, HOST)
                .emptied()
                .await
                .expect("emptying the bucket")
                .under_test()
        }
    })
    .await;
    if let Err(e) = checkpoints {
        panic!(
            "the Worker's R2 store fails the checkpoint suite: {e:#}\n--- wrangler dev ---\n{}",
            dev.log_tail()
        );
    }
}

/// The public checkpoint route (`PUT /v1/checkpoints/objects/<key>`)
/// stores a body whole or not at all: a body sent without a declared length
/// (chunked) is refused with 411, and one that stops before its declared
/// length — a client that died half-way, over a raw socket — stores
/// nothing, the previous object stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_put_cut_short_stores_nothing() {
    use std::io::Write;

    let Some(dev) = test_build_with_suite_tokens().await else {
        return;
    };
    let http = reqwest::Client::new();
    let url = |key: &str| format!("{}/v1/checkpoints/objects/{key}", dev.base);
    let put = http
        .put(url("cut/obj"))
        .bearer_auth(HOST)
        .body(b"previous".to_vec())
        .send()
        .await
        .unwrap();
    assert_eq!(
        put.status(),
        200,
        "{}",
        put.text().await.unwrap_or_default()
    );

    let chunks = futures::stream::iter([Ok::<_, std::io::Error>(vec![7u8; 4096])]);
    let chunked = http
        .put(url("cut/obj"))
        .bearer_auth(HOST)
        .body(reqwest::Body::wrap_stream(chunks))
        .send()
        .await
        .unwrap();
    let status = chunked.status();
    let text = chunked.text().await.unwrap_or_default();
    assert_eq!(status, 411, "a PUT without Content-Length: {text}");
    assert!(text.contains("length_required"), "{text}");

    // Declared 100,000 bytes, sent 50,000, then the client is gone.
    let addr = dev.base.trim_start_matches("http://").to_string();
    tokio::task::spawn_blocking(move || {
        let mut socket = std::net::TcpStream::connect(&addr).expect("connect");
        let head = format!(
            "PUT /v1/checkpoints/objects/cut/obj HTTP/1.1\r\nHost: {addr}\r\n\
             Authorization: Bearer {HOST}\r\nContent-Length: 100000\r\n\r\n"
        );
        socket.write_all(head.as_bytes()).expect("head");
        socket.write_all(&[9u8; 50_000]).expect("half the body");
        socket.flush().expect("flush");
        socket.shutdown(std::net::Shutdown::Both).expect("hang up");
    })
    .await
    .unwrap();
    // Once the Worker is done with the cut request (its third PUT in the
    // log; wrangler answers 503 "Network connection lost"), or after 10 s:
    // whatever it made of it, it stored none of it.
    let started = std::time::Instant::now();
    while dev
        .log()
        .matches("PUT /v1/checkpoints/objects/cut/obj")
        .count()
        < 3
        && started.elapsed() < std::time::Duration::from_secs(10)
    {
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let back = http
        .get(url("cut/obj"))
        .bearer_auth(HOST)
        .send()
        .await
        .unwrap();
    assert_eq!(back.status(), 200);
    assert_eq!(
        &back.bytes().await.unwrap()[..],
        b"previous",
        "a PUT cut short replaced the object\n--- wrangler dev ---\n{}",
        dev.log_tail()
    );
}
