//! Shared test helpers: configuration, the real local sandbox, the SQLite
//! session log behind a hub of session actors, and runners writing to it
//! as the session's runner with the scripted agent
//! ([`harness_testkit::agent::ScriptHarness`]).

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use durable_temporal::{ActivityTuning, TemporalConfig};
use harness_core::clock::Clock;
use harness_core::frame::{Frame, FrameBody, SessionId};
use harness_core::log::SessionLog;
use harness_core::sandbox::{SandboxProvider, SandboxSpec};
use harness_core::session::SandboxConfig;
use harness_core::slice::SliceRunner;
use harness_core::turn::{TurnState, TurnStatus};
use harness_testkit::agent::{ScriptHarness, SCRIPT_AGENT};
use session_runtime::{Hub, HubConfig, HubConnector, RunnerSink, SystemClock};

/// A config for one test: its own task queue, short heartbeats and retries
/// so a dead worker is noticed in about two seconds.
pub fn test_config() -> TemporalConfig {
    let mut config = TemporalConfig::from_env();
    config.task_queue = format!("dt-test-{}", uuid::Uuid::new_v4());
    config.tuning = ActivityTuning {
        slice_margin_ms: 30_000,
        heartbeat_timeout_ms: 2_000,
        retry_initial_interval_ms: 300,
        retry_max_attempts: 10,
        kill_timeout_ms: 20_000,
        create_sandbox_timeout_ms: 120_000,
        continue_as_new_after_slices: 200,
    };
    config
}

/// True when the server answers; otherwise prints/asserts the skip.
pub async fn server_or_skip(config: &TemporalConfig) -> bool {
    if durable_temporal::server_reachable(config, Duration::from_secs(5)).await {
        true
    } else {
        harness_testkit::real::skip_or_fail(&format!(
            "no Temporal server at {} (run `cargo xtask services start`)",
            config.address
        ));
        false
    }
}

/// A hub of session actors over `log` (call inside a tokio runtime: the
/// actors run on it).
pub fn hub(log: Arc<dyn SessionLog>) -> Arc<Hub> {
    Hub::new(log, HubConfig::default())
}

/// A runner generation newer than every one this process handed out
/// before: the start time in milliseconds, made strictly increasing.
pub fn next_generation() -> u64 {
    static LAST: AtomicU64 = AtomicU64::new(0);
    let now = SystemClock.now_ms();
    let mut prev = LAST.load(Ordering::SeqCst);
    loop {
        let next = now.max(prev + 1);
        match LAST.compare_exchange(prev, next, Ordering::SeqCst, Ordering::SeqCst) {
            Ok(_) => return next,
            Err(p) => prev = p,
        }
    }
}

/// A slice runner over the local sandbox provider rooted at `root` and
/// the scripted agent, writing through `hub` as the session's runner (a
/// fresh generation).
pub fn runner(root: &Path, hub: Arc<Hub>) -> SliceRunner {
    let mut providers: BTreeMap<String, Arc<dyn SandboxProvider>> = BTreeMap::new();
    providers.insert(
        sandbox_local::PROVIDER_NAME.into(),
        Arc::new(sandbox_local::LocalProvider::new(root)),
    );
    let mut harnesses: BTreeMap<String, Arc<dyn harness_core::harness::Harness>> = BTreeMap::new();
    harnesses.insert(SCRIPT_AGENT.into(), Arc::new(ScriptHarness));
    SliceRunner {
        providers,
        harnesses,
        sink: Arc::new(RunnerSink::new(
            Arc::new(HubConnector::new(hub)),
            next_generation(),
        )),
        env: BTreeMap::new(),
        broker: None,
        model: None,
        poll_interval: Duration::from_millis(50),
        sleep: session_runtime::tokio_sleeper(),
        clock: Arc::new(SystemClock),
        checkpoints: None,
    }
}

/// A new session in `log` (its id prefixed with `prefix`).
pub async fn new_session(log: &dyn SessionLog, prefix: &str) -> String {
    let session = format!(
        "{prefix}{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    );
    log.create(&SessionId::parse(session.clone()).unwrap())
        .await
        .unwrap();
    session
}

/// A fresh turn of the scripted agent in a new local sandbox made here
/// (the turn carries its handle), with the session created in `log`.
pub async fn new_turn(root: &Path, log: &dyn SessionLog, prompt: &str, slice_ms: u64) -> TurnState {
    let session = new_session(log, "s").await;
    let provider = sandbox_local::LocalProvider::new(root);
    let sandbox = provider.create(&SandboxSpec::new("/work")).await.unwrap();
    let mut state = TurnState::new(session, "t1", SCRIPT_AGENT, prompt);
    state.sandbox = Some(sandbox.handle());
    state.config.slice_ms = slice_ms;
    state
}

/// A fresh turn of the scripted agent that carries only a sandbox config
/// (`local`): the engine's first step creates the sandbox.
pub async fn new_turn_creating_sandbox(
    log: &dyn SessionLog,
    prompt: &str,
    slice_ms: u64,
) -> TurnState {
    let session = new_session(log, "c").await;
    let mut state = TurnState::new(session, "t1", SCRIPT_AGENT, prompt);
    state.sandbox_config = Some(SandboxConfig {
        provider: sandbox_local::PROVIDER_NAME.into(),
        ..SandboxConfig::default()
    });
    state.config.slice_ms = slice_ms;
    state
}

/// All frames of a session.
pub async fn frames(log: &dyn SessionLog, session: &str) -> Vec<Frame> {
    let session = SessionId::parse(session).unwrap();
    let mut out = Vec::new();
    loop {
        let batch = log
            .read(&session, out.last().map_or(0, |f: &Frame| f.seq), 1000)
            .await
            .unwrap();
        if batch.is_empty() {
            return out;
        }
        out.extend(batch);
    }
}

/// The texts of a turn's stored messages, in log order.
pub fn messages(frames: &[Frame], turn: &str) -> Vec<String> {
    harness_testkit::conformance::engine::lines(frames, turn)
}

/// Assert the log's seqs are gap-free.
pub fn assert_gap_free(frames: &[Frame]) {
    let seqs: Vec<u64> = frames.iter().map(|f| f.seq).collect();
    let expected_seqs: Vec<u64> = (1..=frames.len() as u64).collect();
    assert_eq!(seqs, expected_seqs, "log seqs must be gap-free");
}

/// Assert the log is gap-free and every scripted line is stored exactly
/// once, in order.
pub fn assert_lines_once(frames: &[Frame], turn: &str, lines: u32) {
    assert_gap_free(frames);
    let got = messages(frames, turn);
    let want: Vec<String> = (0..lines).map(|i| format!("line {i}")).collect();
    assert_eq!(got, want, "every line stored exactly once, in order");
}

/// Assert the turn's terminal status is stored exactly once, as `state`
/// ended (status and sandbox), and that `state` records it.
pub fn assert_end_stored_once(frames: &[Frame], state: &TurnState) {
    assert!(
        state.status.is_terminal() && state.end_recorded,
        "the turn ended with its end recorded: {state:?}"
    );
    let ends: Vec<(TurnStatus, _)> =
        harness_testkit::conformance::engine::ends(frames, &state.turn_id);
    assert_eq!(
        ends,
        vec![(state.status, state.sandbox.clone())],
        "exactly one terminal turn-status frame for turn {}",
        state.turn_id
    );
}

/// The generations runners attached with, in log order.
pub fn generations(frames: &[Frame]) -> Vec<u64> {
    frames
        .iter()
        .filter_map(|f| match f.body {
            FrameBody::RunnerAttached { generation } => Some(generation),
            _ => None,
        })
        .collect()
}
