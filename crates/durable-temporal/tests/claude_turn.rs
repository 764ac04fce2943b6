//! The real `claude` binary in a real local sandbox, against the scripted
//! model streaming slowly, as a Temporal turn longer than one slice.

mod common;

use std::sync::Arc;
use std::time::Duration;

use durable_temporal::{TemporalEngine, TurnWorker};
use harness_claude_code::{ClaudeCodeConfig, ClaudeCodeHarness};
use harness_core::engine::DurableEngine;
use harness_core::harness::Harness;
use harness_core::log::SessionLog;
use harness_core::sandbox::{SandboxProvider, SandboxSpec};
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
    let session = format!("cc{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    log.create(&harness_core::frame::SessionId::parse(session.clone()).unwrap())
        .await
        .unwrap();
    let mut spec = SandboxSpec::new("/workspace");
    spec.session_id = Some(session.clone());
    spec.bootstrap = Some(harness.bootstrap_recipe().unwrap());
    let provider = sandbox_local::LocalProvider::new(&root);
    let sandbox = provider.create(&spec).await.unwrap();
    let mut state = TurnState::new(session.clone(), "t1", harness.name(), "answer slowly");
    state.sandbox = Some(sandbox.handle());
    state.config.slice_ms = 1_000;

    let mut runner = common::runner(&root, log.clone());
    runner
        .harnesses
        .insert(harness.name().into(), Arc::new(harness.clone()));
    runner.env = server.claude_env().into_iter().collect();
    let engine = TemporalEngine::connect(config.clone()).await.unwrap();
    let mut worker = TurnWorker::new(&config, runner).await.unwrap();
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
    server.assert_no_failures();
    assert_eq!(done.status, TurnStatus::Finished, "{done:?}");
    assert!(
        done.slices_run >= 2,
        "a ~4 s answer with 1 s slices ran {} slices",
        done.slices_run
    );
    assert!(done.agent_session_id.is_some(), "{done:?}");
    let frames = common::frames(log.as_ref(), &session).await;
    let texts = common::messages(&frames, "t1");
    assert_eq!(
        texts,
        vec![chunks.concat()],
        "the answer stored once, whole"
    );
    let seqs: Vec<u64> = frames.iter().map(|f| f.seq).collect();
    assert_eq!(seqs, (1..=frames.len() as u64).collect::<Vec<_>>());
    sandbox.destroy().await.unwrap();
}
