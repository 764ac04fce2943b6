//! The session-API suite against the Worker under `wrangler dev`: the same
//! cases `session-server` passes (crates/session-server/tests/session_api.rs).
//! Needs the built Worker and wrangler (`cargo xtask worker test` builds and
//! runs it; otherwise it skips, or fails under `HARNESS_REQUIRE_REAL=1`).

#![cfg(not(target_arch = "wasm32"))]

use std::path::Path;

use harness_testkit::conformance::session_api::{self, Target};
use harness_testkit::wrangler::WranglerDev;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_worker_speaks_the_session_api() {
    let worker_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let tokens = session_api::token_table().to_string();
    let Some(dev) = tokio::task::spawn_blocking(move || {
        WranglerDev::start(worker_dir, &[("HARNESS_TOKENS", tokens)])
    })
    .await
    .expect("start task") else {
        return;
    };
    let target = Target::new(dev.base.clone(), "w");
    let outcome = tokio::spawn(async move { session_api::run_all(&target).await }).await;
    if let Err(e) = outcome {
        eprintln!("--- wrangler dev ---\n{}", dev.log_tail());
        std::panic::resume_unwind(e.into_panic());
    }
}
