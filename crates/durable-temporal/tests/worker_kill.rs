//! kill -9 of the worker process mid-slice: a new worker process picks the
//! slice up (after the heartbeat timeout) and the log ends gap-free with
//! every line exactly once and the turn's end stored once.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use durable_temporal::{TemporalConfig, TemporalEngine};
use harness_core::engine::DurableEngine;
use harness_core::turn::TurnStatus;

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

fn spawn_worker(config: &TemporalConfig, db: &Path, root: &Path) -> Child {
    Command::new(worker_binary())
        .env("HARNESS_TEMPORAL_ADDRESS", &config.address)
        .env("HARNESS_TEMPORAL_NAMESPACE", &config.namespace)
        .env("HARNESS_TEMPORAL_TASK_QUEUE", &config.task_queue)
        .env("DT_WORKER_LOG_DB", db)
        .env("DT_WORKER_SANDBOX_ROOT", root)
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn worker")
}

/// Where the turn's sandbox comes from.
#[derive(Debug, Clone, Copy)]
enum Sandbox {
    /// Made by the test; the turn carries its handle.
    Premade,
    /// The workflow's first step creates it from the turn's sandbox config.
    CreatedByEngine,
}

/// One turn: kill -9 the worker `kill_after` into the turn, start a new
/// worker, and check the turn finishes with a clean log.
async fn kill_once(kill_after: Duration, sandbox: Sandbox) {
    let config = common::test_config();
    if !common::server_or_skip(&config).await {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("log.db");
    let log = Arc::new(session_log::SqliteSessionLog::open(&db).unwrap());
    let lines = 30;
    let prompt = format!("lines={lines} delay=0.2");
    let state = match sandbox {
        Sandbox::Premade => common::new_turn(dir.path(), log.as_ref(), &prompt, 1_000).await,
        Sandbox::CreatedByEngine => {
            common::new_turn_creating_sandbox(log.as_ref(), &prompt, 1_000).await
        }
    };
    let (session, turn) = (state.session_id.clone(), state.turn_id.clone());
    let engine = TemporalEngine::connect(config.clone()).await.unwrap();
    let mut first = spawn_worker(&config, &db, dir.path());
    engine.start_turn(state).await.unwrap();
    // Wait until the turn is really running (the worker process started
    // and polled), then for the kill point.
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
    tokio::time::sleep(kill_after).await;
    let before = engine.turn_state(&session, &turn).await.unwrap();
    assert_eq!(
        before.status,
        TurnStatus::ReadyForNextStep,
        "the kill must land mid-turn: {before:?}"
    );
    first.kill().unwrap(); // SIGKILL
    first.wait().unwrap();
    let mut second = spawn_worker(&config, &db, dir.path());
    let result =
        tokio::time::timeout(Duration::from_secs(90), engine.wait_turn(&session, &turn)).await;
    let _ = second.kill();
    let _ = second.wait();
    let done = result
        .expect("turn did not finish after the worker restart")
        .unwrap();
    eprintln!(
        "kill after {kill_after:?}: finished in {:?}, {} slices, {} failed in a row at most",
        started.elapsed(),
        done.slices_run,
        done.consecutive_failures
    );
    assert_eq!(done.status, TurnStatus::Finished, "{done:?}");
    assert!(done.sandbox.is_some(), "{done:?}");
    let frames = common::frames(log.as_ref(), &session).await;
    common::assert_lines_once(&frames, &turn, lines);
    common::assert_end_stored_once(&frames, &done);
    // Both workers attached as runners, the second with a higher generation.
    let generations = common::generations(&frames);
    assert!(generations.len() >= 2, "{generations:?}");
    assert!(
        generations.windows(2).all(|w| w[0] < w[1]),
        "{generations:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_killed_early_in_the_turn() {
    kill_once(Duration::from_millis(300), Sandbox::CreatedByEngine).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_killed_mid_turn() {
    kill_once(Duration::from_millis(1_700), Sandbox::Premade).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_killed_late_in_the_turn() {
    kill_once(Duration::from_millis(3_900), Sandbox::Premade).await;
}
