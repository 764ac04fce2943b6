//! The real `claude` binary in a real local sandbox, against the scripted
//! model streaming slowly, as a Temporal turn longer than one slice. The
//! turn carries only a sandbox config: the workflow's first step creates
//! the sandbox (with the adapter's bootstrap, which copies the binary in).

mod common;

use std::sync::Arc;
use std::time::Duration;

use durable_temporal::{TemporalEngine, TurnWorker};
use harness_claude_code::{ClaudeCodeConfig, ClaudeCodeHarness};
use harness_core::engine::DurableEngine;
use harness_core::harness::Harness;
use harness_core::sandbox::SandboxProvider;
use harness_core::session::SandboxConfig;
use harness_core::turn::{TurnState, TurnStatus};
use harness_testkit::model::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_turn_longer_than_one_slice() {
    let config = common::test_config();
    if !common::server_or_skip(&config).await {
        return;
    }
    let harness = match ClaudeCodeConfig::from_env() {
        Ok(c) => ClaudeCodeHarness::new(c),
        Err(e) => {
            harness_testkit::real::skip_or_fail(&format!("claude binary: {e}"));
            return;
        }
    };
    let chunks = [
        "Slow ", "answer ", "spread ", "over ", "several ", "slices.",
    ];
    let server =
        ScriptedModel::start(Script::new().on(any(), Reply::text_chunks(chunks).with_delay(700)))
            .await
            .unwrap();
    // A stable root so the bootstrap template (the claude binary) is reused.
    let cache = std::env::var("HARNESS_CACHE").unwrap_or_else(|_| "/var/cache/harness".into());
    let root = std::path::PathBuf::from(format!("{cache}/e2e-local-sandboxes"));
    let dir = tempfile::tempdir().unwrap();
    let log = Arc::new(session_log::SqliteSessionLog::open(dir.path().join("log.db")).unwrap());
    let hub = common::hub(log.clone());
    let session = common::new_session(log.as_ref(), "cc").await;
    let mut state = TurnState::new(session.clone(), "t1", harness.name(), "answer slowly");
    state.sandbox_config = Some(SandboxConfig {
        provider: sandbox_local::PROVIDER_NAME.into(),
        ..SandboxConfig::default()
    });
    state.config.slice_ms = 1_000;

    let mut runner = common::runner(&root, hub);
    runner
        .harnesses
        .insert(harness.name().into(), Arc::new(harness.clone()));
    runner.env = server.claude_env().into_iter().collect();
    let engine = TemporalEngine::connect(config.clone()).await.unwrap();
    let mut worker = TurnWorker::new(&config, Arc::new(runner)).await.unwrap();
    let shutdown = worker.shutdown_handle();
    let local = tokio::task::LocalSet::new();
    let handle = local.spawn_local(async move { worker.run().await });
    let done = local
        .run_until(async {
            engine.start_turn(state).await.unwrap();
            tokio::time::timeout(Duration::from_secs(120), engine.wait_turn(&session, "t1"))
                .await
                .expect("claude turn did not finish in 120 s")
                .unwrap()
        })
        .await;
    shutdown();
    let _ = local
        .run_until(tokio::time::timeout(Duration::from_secs(20), handle))
        .await;
    // The sandbox the engine made goes away whatever the verdict.
    if let Some(handle) = &done.sandbox {
        let provider = sandbox_local::LocalProvider::new(&root);
        provider
            .resume(handle)
            .await
            .unwrap()
            .destroy()
            .await
            .unwrap();
    }
    server.assert_no_failures();
    assert_eq!(done.status, TurnStatus::Finished, "{done:?}");
    assert!(
        done.slices_run >= 2,
        "a ~4 s answer with 1 s slices ran {} slices",
        done.slices_run
    );
    assert!(done.agent_session_id.is_some(), "{done:?}");
    assert!(done.sandbox.is_some(), "the engine created the sandbox");
    let frames = common::frames(log.as_ref(), &session).await;
    let texts = common::messages(&frames, "t1");
    assert_eq!(
        texts,
        vec![chunks.concat()],
        "the answer stored once, whole"
    );
    common::assert_gap_free(&frames);
    common::assert_end_stored_once(&frames, &done);
}
