//! The engine conformance suite (`harness_testkit::conformance::engine`) on
//! the Workflows engine: the real `WorkflowsEngine` and `run_turn` inside
//! the Worker under `wrangler dev`, local Workflows scheduling, retrying
//! and replaying every step, and the suite's own executor (its scripted
//! agent in a real local sandbox, its failure injection, its session log)
//! called by each step over HTTP (`harness_testkit::engine_bridge`).
//!
//! One case is skipped, with its reason printed: a killed engine resumed by
//! the next. Local Workflows do not resume an instance after `wrangler
//! dev` restarts (the replay tests in `crates/durable-workflows` show what
//! a resumed instance does). See `docs/durable-workflows.md`.

#![cfg(not(target_arch = "wasm32"))]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use async_trait::async_trait;
use durable_workflows::StepTuning;
use harness_core::engine::{DurableEngine, SliceExecutor};
use harness_testkit::conformance::engine::{self, EngineFixture};
use harness_testkit::conformance::session_api::{self, RUNNER};
use harness_testkit::engine_bridge::{ExecutorServer, RemoteEngine};
use harness_testkit::wrangler::WranglerDev;

/// The Worker under `wrangler dev`, its engine API on, and the suite's
/// executor its steps call.
struct WorkflowsFixture {
    dev: WranglerDev,
    executor: ExecutorServer,
    generation: AtomicU64,
}

/// Short retry delays (the default is 2 s) keep the retry cases quick; the
/// rest is `StepTuning::default()`.
fn tuning() -> StepTuning {
    StepTuning {
        retry_delay_ms: 250,
        ..StepTuning::default()
    }
}

#[async_trait]
impl EngineFixture for WorkflowsFixture {
    async fn start(
        &self,
        executor: Arc<dyn SliceExecutor>,
    ) -> anyhow::Result<Arc<dyn DurableEngine>> {
        self.executor.set(executor);
        let generation = self.generation.fetch_add(1, Ordering::SeqCst);
        Ok(Arc::new(RemoteEngine::new(
            &self.dev.base,
            RUNNER,
            generation,
            tuning(),
        )))
    }

    async fn crash(&self, _engine: Arc<dyn DurableEngine>) {
        unreachable!("crash_unsupported says why this is never called")
    }

    async fn stop(&self, _engine: Arc<dyn DurableEngine>) {}

    fn crash_unsupported(&self) -> Option<String> {
        Some(
            "local Workflows do not resume an instance after `wrangler dev` restarts; \
             crates/durable-workflows/tests/replay.rs shows what a resumed instance does"
                .into(),
        )
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_workflows_engine_passes_the_engine_suite() {
    let executor = ExecutorServer::start().await.expect("the executor server");
    let worker_dir = harness_testkit::wrangler::test_build();
    let vars = vec![
        ("HARNESS_TOKENS", session_api::token_table().to_string()),
        ("HARNESS_TEST_EXECUTOR_URL", executor.url()),
    ];
    let Some(dev) = tokio::task::spawn_blocking(move || WranglerDev::start(worker_dir, &vars))
        .await
        .expect("start task")
    else {
        return;
    };
    refuses_what_it_must(&dev.base).await;
    let root = tempfile::tempdir().unwrap();
    let provider = Arc::new(sandbox_local::LocalProvider::new(root.path()));
    let fixture = WorkflowsFixture {
        dev,
        executor,
        generation: AtomicU64::new(1),
    };
    let began = Instant::now();
    let result = engine::run_all(&fixture, provider).await;
    eprintln!("engine suite on Workflows: {:?}", began.elapsed());
    if let Err(e) = result {
        panic!("{e:?}\n--- wrangler dev ---\n{}", fixture.dev.log_tail());
    }
}

/// The engine API refuses a request without a runner's token and a
/// malformed body, with the error's kind in the body; an unknown turn is
/// `not_found`. (Without `HARNESS_TEST_EXECUTOR_URL` the routes do not
/// exist: `tests/wrangler.rs` checks that on its Worker.)
async fn refuses_what_it_must(base: &str) {
    let client = reqwest::Client::new();
    let wait = serde_json::json!({"session_id": "eng-none", "turn_id": "t1"});
    let post = |token: &'static str| {
        client
            .post(format!("{base}/v1/test/engine/wait"))
            .bearer_auth(token)
            .json(&wait)
            .send()
    };
    let refused = post(session_api::CLIENT).await.unwrap();
    assert_eq!(refused.status(), 403, "a client may not drive turns");
    let unknown = post(RUNNER).await.unwrap();
    let status = unknown.status();
    let body: serde_json::Value = unknown.json().await.unwrap();
    assert_eq!(status, 404, "{body}");
    assert_eq!(body["kind"], "not_found", "{body}");
    let bad = client
        .post(format!("{base}/v1/test/engine/start"))
        .bearer_auth(RUNNER)
        .body("{not json")
        .send()
        .await
        .unwrap();
    let status = bad.status();
    let body: serde_json::Value = bad.json().await.unwrap();
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["kind"], "invalid_input", "{body}");
}
