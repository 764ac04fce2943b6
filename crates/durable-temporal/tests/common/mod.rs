//! Shared test helpers: configuration, the real local sandbox, the SQLite
//! session log, and the scripted agent.

#![allow(dead_code)]

pub mod script;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use durable_temporal::{ActivityTuning, TemporalConfig};
use harness_core::frame::{Frame, FrameBody, SessionId};
use harness_core::log::{now_ms, SessionLog};
use harness_core::sandbox::{SandboxProvider, SandboxSpec};
use harness_core::sink::LogSink;
use harness_core::slice::SliceRunner;
use harness_core::turn::TurnState;

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

/// A slice runner over the local sandbox provider rooted at `root`, the
/// scripted agent and a log sink writing to `log` as generation `now`.
pub fn runner(root: &Path, log: Arc<dyn SessionLog>) -> SliceRunner {
    let mut providers: BTreeMap<String, Arc<dyn SandboxProvider>> = BTreeMap::new();
    providers.insert(
        sandbox_local::PROVIDER_NAME.into(),
        Arc::new(sandbox_local::LocalProvider::new(root)),
    );
    let mut harnesses: BTreeMap<String, Arc<dyn harness_core::harness::Harness>> = BTreeMap::new();
    harnesses.insert(script::SCRIPT_AGENT.into(), Arc::new(script::ScriptHarness));
    SliceRunner {
        providers,
        harnesses,
        sink: Arc::new(LogSink::new(log, now_ms())),
        env: BTreeMap::new(),
        model: None,
        poll_interval: Duration::from_millis(50),
        sleep: Arc::new(|d| Box::pin(tokio::time::sleep(d))),
        now_ms: Arc::new(now_ms),
    }
}

/// A fresh turn of the scripted agent in a new local sandbox, with the
/// session created in `log`.
pub async fn new_turn(root: &Path, log: &dyn SessionLog, prompt: &str, slice_ms: u64) -> TurnState {
    let session = format!("s{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    log.create(&SessionId::parse(session.clone()).unwrap())
        .await
        .unwrap();
    let provider = sandbox_local::LocalProvider::new(root);
    let sandbox = provider.create(&SandboxSpec::new("/work")).await.unwrap();
    let mut state = TurnState::new(session, "t1", script::SCRIPT_AGENT, prompt);
    state.sandbox = Some(sandbox.handle());
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
    frames
        .iter()
        .filter_map(|f| match &f.body {
            FrameBody::Message { turn_id, text, .. } if turn_id == turn => Some(text.clone()),
            _ => None,
        })
        .collect()
}

/// Assert the log is gap-free and every scripted line is stored exactly
/// once, in order.
pub fn assert_lines_once(frames: &[Frame], turn: &str, lines: u32) {
    let seqs: Vec<u64> = frames.iter().map(|f| f.seq).collect();
    let expected_seqs: Vec<u64> = (1..=frames.len() as u64).collect();
    assert_eq!(seqs, expected_seqs, "log seqs must be gap-free");
    let got = messages(frames, turn);
    let want: Vec<String> = (0..lines).map(|i| format!("line {i}")).collect();
    assert_eq!(got, want, "every line stored exactly once, in order");
}
