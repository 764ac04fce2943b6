//! Engine overhead per slice: the same zero-work slices (agent running,
//! nothing new to read, budget 0) run three ways:
//! 1. `SliceRunner::run` called directly in-process;
//! 2. through `harness_core::engine::InProcessEngine`;
//! 3. through Temporal (`harness_turn` workflow, `harness:slice` activity,
//!    in-process worker on a `LocalSet`).
//!
//! Run: `cargo run -p durable-temporal --example overhead` (needs the
//! Temporal dev server at `HARNESS_TEMPORAL_ADDRESS`, default
//! 127.0.0.1:7233).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use durable_temporal::{TemporalConfig, TemporalEngine, TurnWorker};
use harness_core::clock::Clock;
use harness_core::engine::{DurableEngine, InProcessEngine, MemoryTurnStore};
use harness_core::frame::SessionId;
use harness_core::log::{MemorySessionLog, SessionLog};
use harness_core::sandbox::{SandboxProvider, SandboxSpec};
use harness_core::slice::SliceRunner;
use harness_core::stream::AbortSignal;
use harness_core::turn::{step, TurnEvent, TurnState};
use harness_testkit::agent::{ScriptHarness, SCRIPT_AGENT};
use session_runtime::{Hub, HubConfig, HubConnector, RunnerSink, SystemClock};

/// How long the scripted agent runs in the engine measurements.
const AGENT_SECONDS: f64 = 4.0;

fn now_ms() -> u64 {
    SystemClock.now_ms()
}

/// A runner writing through a hub of session actors over `log` (call
/// inside the tokio runtime: the actors run on it).
fn runner(root: &Path, log: Arc<dyn SessionLog>) -> SliceRunner {
    let mut providers: BTreeMap<String, Arc<dyn SandboxProvider>> = BTreeMap::new();
    providers.insert(
        sandbox_local::PROVIDER_NAME.into(),
        Arc::new(sandbox_local::LocalProvider::new(root)),
    );
    let mut harnesses: BTreeMap<String, Arc<dyn harness_core::harness::Harness>> = BTreeMap::new();
    harnesses.insert(SCRIPT_AGENT.into(), Arc::new(ScriptHarness));
    let hub = Hub::new(log, HubConfig::default());
    SliceRunner {
        providers,
        harnesses,
        sink: Arc::new(RunnerSink::new(Arc::new(HubConnector::new(hub)), now_ms())),
        env: BTreeMap::new(),
        broker: None,
        model: None,
        poll_interval: Duration::from_millis(50),
        sleep: session_runtime::tokio_sleeper(),
        clock: Arc::new(SystemClock),
    }
}

async fn turn(
    root: &Path,
    log: &dyn SessionLog,
    session: &str,
    prompt: &str,
) -> anyhow::Result<TurnState> {
    log.create(&SessionId::parse(session)?).await?;
    let sandbox = sandbox_local::LocalProvider::new(root)
        .create(&SandboxSpec::new("/work"))
        .await?;
    let mut state = TurnState::new(session, "t1", SCRIPT_AGENT, prompt);
    state.sandbox = Some(sandbox.handle());
    // Budget 0: every slice polls once and returns `running`.
    state.config.slice_ms = 0;
    state.config.max_consecutive_failures = 1;
    Ok(state)
}

/// Prompt for an agent that prints one line then stays quiet for `seconds`.
fn quiet_agent(seconds: f64) -> String {
    format!("lines=1 delay={seconds}")
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let log: Arc<dyn SessionLog> = Arc::new(MemorySessionLog::new());
    let runner = runner(dir.path(), log.clone());

    // 1. Direct: start the agent with a first slice, then time zero-work slices.
    let state = turn(dir.path(), log.as_ref(), "direct", &quiet_agent(60.0)).await?;
    let mut state = step(state, TurnEvent::Start { now_ms: now_ms() })?.0;
    let first = runner
        .run(&state, Duration::ZERO, AbortSignal::new())
        .await?;
    state = step(
        state,
        TurnEvent::SliceCompleted {
            report: first,
            now_ms: now_ms(),
        },
    )?
    .0;
    let n = 50;
    let t = Instant::now();
    for _ in 0..n {
        let report = runner
            .run(&state, Duration::ZERO, AbortSignal::new())
            .await?;
        state = step(
            state,
            TurnEvent::SliceCompleted {
                report,
                now_ms: now_ms(),
            },
        )?
        .0;
    }
    let direct = t.elapsed() / n;
    if let Some(process) = &state.process {
        let sandbox = runner.providers["local"]
            .resume(state.sandbox.as_ref().unwrap())
            .await?;
        sandbox.kill_detached(process).await?;
    }
    println!("direct SliceRunner::run (zero-work slice): {direct:?} per slice over {n}");

    // 2. In-process engine.
    let engine = InProcessEngine::new(
        Arc::new(runner.clone()),
        Arc::new(MemoryTurnStore::default()),
        Arc::new(SystemClock),
        session_runtime::tokio_spawner(),
    );
    let state = turn(
        dir.path(),
        log.as_ref(),
        "inproc",
        &quiet_agent(AGENT_SECONDS),
    )
    .await?;
    let t = Instant::now();
    engine.start_turn(state).await?;
    let done = engine.wait_turn("inproc", "t1").await?;
    let per = t.elapsed() / done.slices_run.max(1);
    println!(
        "in-process engine: {per:?} per slice ({} slices, {:?} total, status {}); overhead {:?}",
        done.slices_run,
        t.elapsed(),
        done.status.as_str(),
        per.saturating_sub(direct)
    );

    // 3. Temporal.
    let config = TemporalConfig {
        task_queue: format!("dt-overhead-{}", uuid::Uuid::new_v4()),
        ..TemporalConfig::from_env()
    };
    if !durable_temporal::server_reachable(&config, Duration::from_secs(5)).await {
        println!("skipped temporal: no server at {}", config.address);
        return Ok(());
    }
    let mut worker = TurnWorker::new(&config, Arc::new(runner.clone())).await?;
    let shutdown = worker.shutdown_handle();
    let local = tokio::task::LocalSet::new();
    let handle = local.spawn_local(async move { worker.run().await });
    let engine = TemporalEngine::connect(config.clone()).await?;
    let state = turn(
        dir.path(),
        log.as_ref(),
        "temporal",
        &quiet_agent(AGENT_SECONDS),
    )
    .await?;
    let (elapsed, done) = local
        .run_until(async {
            let t = Instant::now();
            engine.start_turn(state).await?;
            let done = engine.wait_turn("temporal", "t1").await?;
            anyhow::Ok((t.elapsed(), done))
        })
        .await?;
    shutdown();
    let _ = local.run_until(handle).await;
    let per = elapsed / done.slices_run.max(1);
    println!(
        "temporal engine: {per:?} per slice ({} slices, {elapsed:?} total, status {}); overhead {:?}",
        done.slices_run,
        done.status.as_str(),
        per.saturating_sub(direct)
    );
    Ok(())
}
