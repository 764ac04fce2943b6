//! The Temporal engine with Docker sandboxes: the real `claude` in a real
//! container answering over several slices, and a worker process killed
//! with `kill -9` mid-slice whose turn a new worker finishes with a gap-free
//! log and every line once. Real dockerd, image `HARNESS_TEST_IMAGE`; the
//! scripted model listens on the bridge gateway address, which containers
//! reach.

mod common;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use durable_temporal::{TemporalConfig, TemporalEngine, TurnWorker};
use harness_claude_code::{ClaudeCodeConfig, ClaudeCodeHarness};
use harness_core::engine::DurableEngine;
use harness_core::harness::Harness;
use harness_core::sandbox::{SandboxProvider, SandboxSpec};
use harness_core::turn::{TurnState, TurnStatus};
use harness_testkit::model::*;
use harness_testkit::real::skip_or_fail;
use sandbox_docker::{DockerConfig, DockerProvider};

/// The test image and a provider using it by default; `None` after a skip
/// (a failure under `HARNESS_REQUIRE_REAL=1`).
async fn docker() -> Option<(String, DockerProvider)> {
    let image = harness_testkit::require_env("HARNESS_TEST_IMAGE")?;
    let provider = match DockerProvider::connect(DockerConfig {
        default_image: image.clone(),
        ..DockerConfig::default()
    })
    .await
    {
        Ok(p) => p,
        Err(e) => {
            skip_or_fail(&format!("no docker engine answers: {e}"));
            return None;
        }
    };
    if provider.client().inspect_image(&image).await.is_err() {
        skip_or_fail(&format!(
            "docker image {image} is missing (build it with `cargo xtask image`)"
        ));
        return None;
    }
    Some((image, provider))
}

/// Removes a container when dropped, so a failing test leaves none behind
/// (the happy path destroys the sandbox itself).
struct Cleanup(String);

impl Drop for Cleanup {
    fn drop(&mut self) {
        let _ = Command::new("docker")
            .args(["rm", "-f", &self.0])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn docker_claude_turn_longer_than_one_slice() {
    let config = common::test_config();
    if !common::server_or_skip(&config).await {
        return;
    }
    let Some((_image, provider)) = docker().await else {
        return;
    };
    let Some(gateway) = provider.bridge_gateway().await else {
        skip_or_fail("cannot find the docker bridge gateway address");
        return;
    };
    let harness = match ClaudeCodeConfig::from_env() {
        Ok(c) => ClaudeCodeHarness::new(c),
        Err(e) => {
            skip_or_fail(&format!("claude binary: {e}"));
            return;
        }
    };
    let chunks = [
        "Slow ", "answer ", "spread ", "over ", "several ", "slices.",
    ];
    let server = ScriptedModel::start_on(
        SocketAddr::new(gateway, 0),
        Script::new().on(any(), Reply::text_chunks(chunks).with_delay(700)),
    )
    .await
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let log = Arc::new(session_log::SqliteSessionLog::open(dir.path().join("log.db")).unwrap());
    let hub = common::hub(log.clone());
    let session = common::new_session(log.as_ref(), "cd").await;
    let mut spec = SandboxSpec::new("/workspace");
    spec.session_id = Some(session.clone());
    spec.bootstrap = Some(harness.bootstrap_recipe().unwrap());
    let sandbox = provider.create(&spec).await.unwrap();
    let handle = sandbox.handle();
    let _cleanup = Cleanup(handle.id.clone());
    assert_eq!(handle.provider, sandbox_docker::PROVIDER_NAME);
    let mut state = TurnState::new(session.clone(), "t1", harness.name(), "answer slowly");
    state.sandbox = Some(handle);
    state.config.slice_ms = 1_000;

    let mut runner = common::runner(dir.path(), hub);
    runner
        .providers
        .insert(sandbox_docker::PROVIDER_NAME.into(), Arc::new(provider));
    runner
        .harnesses
        .insert(harness.name().into(), Arc::new(harness.clone()));
    // The base URL names the gateway address: the agent runs in the container.
    runner.env = server.claude_env().into_iter().collect();
    let engine = TemporalEngine::connect(config.clone()).await.unwrap();
    let mut worker = TurnWorker::new(&config, Arc::new(runner)).await.unwrap();
    let shutdown = worker.shutdown_handle();
    let local = tokio::task::LocalSet::new();
    let worker_task = local.spawn_local(async move { worker.run().await });
    let started = Instant::now();
    let done = local
        .run_until(async {
            engine.start_turn(state).await.unwrap();
            tokio::time::timeout(Duration::from_secs(120), engine.wait_turn(&session, "t1"))
                .await
                .expect("claude turn did not finish in 120 s")
                .unwrap()
        })
        .await;
    eprintln!(
        "docker claude turn: {:?}, {} slices",
        started.elapsed(),
        done.slices_run
    );
    shutdown();
    let _ = local
        .run_until(tokio::time::timeout(Duration::from_secs(20), worker_task))
        .await;
    server.assert_no_failures();
    assert!(
        !server.model_requests().is_empty(),
        "the agent in the container never reached the model"
    );
    assert_eq!(done.status, TurnStatus::Finished, "{done:?}");
    assert!(
        done.slices_run >= 2,
        "a ~4 s answer with 1 s slices ran {} slices",
        done.slices_run
    );
    assert!(done.agent_session_id.is_some(), "{done:?}");
    let frames = common::frames(log.as_ref(), &session).await;
    assert_eq!(
        common::messages(&frames, "t1"),
        vec![chunks.concat()],
        "the answer stored once, whole"
    );
    common::assert_gap_free(&frames);
    common::assert_end_stored_once(&frames, &done);
    sandbox.destroy().await.unwrap();
}

/// `target/<profile>/examples/worker`, built by `cargo test`/`nextest`
/// alongside this test binary.
fn worker_binary() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().unwrap().parent().unwrap();
    let path = profile_dir.join("examples").join("worker");
    assert!(
        path.exists(),
        "{} is missing: build it with `cargo build -p durable-temporal --examples`",
        path.display()
    );
    path
}

/// A worker child process, SIGKILLed when dropped so a failing test leaves
/// no worker polling behind.
struct Worker(Child);

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A worker process serving Docker sandboxes with `image` as default.
fn spawn_worker(config: &TemporalConfig, db: &Path, root: &Path, image: &str) -> Worker {
    let child = Command::new(worker_binary())
        .env("HARNESS_TEMPORAL_ADDRESS", &config.address)
        .env("HARNESS_TEMPORAL_NAMESPACE", &config.namespace)
        .env("HARNESS_TEMPORAL_TASK_QUEUE", &config.task_queue)
        .env("DT_WORKER_LOG_DB", db)
        .env("DT_WORKER_SANDBOX_ROOT", root)
        .env("DT_WORKER_DOCKER_IMAGE", image)
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn worker");
    Worker(child)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn docker_worker_killed_mid_turn() {
    let config = common::test_config();
    if !common::server_or_skip(&config).await {
        return;
    }
    let Some((image, provider)) = docker().await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("log.db");
    let log = Arc::new(session_log::SqliteSessionLog::open(&db).unwrap());
    let lines = 30;
    let session = common::new_session(log.as_ref(), "sd").await;
    let mut spec = SandboxSpec::new("/work");
    spec.session_id = Some(session.clone());
    let sandbox = provider.create(&spec).await.unwrap();
    let handle = sandbox.handle();
    let _cleanup = Cleanup(handle.id.clone());
    assert_eq!(handle.provider, sandbox_docker::PROVIDER_NAME);
    let mut state = TurnState::new(
        session.clone(),
        "t1",
        harness_testkit::agent::SCRIPT_AGENT,
        format!("lines={lines} delay=0.2"),
    );
    state.sandbox = Some(handle);
    state.config.slice_ms = 1_000;
    let turn = state.turn_id.clone();

    let engine = TemporalEngine::connect(config.clone()).await.unwrap();
    let mut first = spawn_worker(&config, &db, dir.path(), &image);
    engine.start_turn(state).await.unwrap();
    // Wait until the agent's output is being read, then into the turn.
    let started = Instant::now();
    loop {
        let s = engine.turn_state(&session, &turn).await.unwrap();
        if s.cursor > 0 || s.status.is_terminal() {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "turn never started"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_millis(1_700)).await;
    let before = engine.turn_state(&session, &turn).await.unwrap();
    assert_eq!(
        before.status,
        TurnStatus::ReadyForNextStep,
        "the kill must land mid-turn: {before:?}"
    );
    first.0.kill().unwrap(); // SIGKILL
    first.0.wait().unwrap();
    let second = spawn_worker(&config, &db, dir.path(), &image);
    let result =
        tokio::time::timeout(Duration::from_secs(90), engine.wait_turn(&session, &turn)).await;
    drop(second);
    let done = result
        .expect("turn did not finish after the worker restart")
        .unwrap();
    eprintln!(
        "docker, kill mid-turn: finished in {:?}, {} slices, {} failed in a row at most",
        started.elapsed(),
        done.slices_run,
        done.consecutive_failures
    );
    assert_eq!(done.status, TurnStatus::Finished, "{done:?}");
    let frames = common::frames(log.as_ref(), &session).await;
    common::assert_lines_once(&frames, &turn, lines);
    common::assert_end_stored_once(&frames, &done);
    let generations = common::generations(&frames);
    assert!(generations.len() >= 2, "{generations:?}");
    assert!(
        generations.windows(2).all(|w| w[0] < w[1]),
        "{generations:?}"
    );
    sandbox.destroy().await.unwrap();
}
