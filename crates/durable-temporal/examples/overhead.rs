//! Engine overhead per slice: the same zero-work slices (agent running,
//! nothing new to read, budget 0) run three ways:
//! 1. `SliceRunner::run` called directly in-process;
//! 2. through `harness_core::engine::InProcessEngine`;
//! 3. through Temporal (`harness_turn` workflow, `harness:slice` activity,
//!    in-process worker on a `LocalSet`).
//!
//! 4. the baseline: a bare workflow running no-op activities one after the
//!    other on the same server, in the same run — the least a slice can cost
//!    on Temporal (a workflow task plus an activity task per activity).
//!
//! Run: `cargo run -p durable-temporal --example overhead` or `cargo xtask
//! bench engine` (needs the Temporal dev server at
//! `HARNESS_TEMPORAL_ADDRESS`, default 127.0.0.1:7233).

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

/// The baseline: a workflow that runs `n` no-op activities in a row, with
/// the same timeouts as a slice, on its own task queue.
#[allow(missing_debug_implementations)]
mod bare {
    use std::sync::Arc;
    use std::time::Duration;

    use temporalio_macros::{activities, workflow, workflow_methods};
    use temporalio_sdk::activities::{ActivityContext, ActivityError};
    use temporalio_sdk::{ActivityOptions, WorkflowContext, WorkflowContextView, WorkflowResult};

    pub struct NoopActivities;

    #[activities]
    impl NoopActivities {
        #[activity(name = "bench:noop")]
        pub async fn noop(
            self: Arc<Self>,
            _ctx: ActivityContext,
            i: u32,
        ) -> Result<u32, ActivityError> {
            Ok(i)
        }
    }

    #[workflow]
    #[derive(Debug)]
    pub struct NoopLoop {
        n: u32,
    }

    #[workflow_methods]
    impl NoopLoop {
        #[init]
        pub fn new(_ctx: &WorkflowContextView, n: u32) -> Self {
            Self { n }
        }

        #[run(name = "bench_noop_loop")]
        pub async fn run(ctx: &mut WorkflowContext<Self>) -> WorkflowResult<u32> {
            let n = ctx.state(|s| s.n);
            for i in 0..n {
                let options = ActivityOptions::with_start_to_close_timeout(Duration::from_secs(60))
                    .heartbeat_timeout(Duration::from_secs(20))
                    .build();
                ctx.execute_activity(NoopActivities::noop, i, options)
                    .await?;
            }
            Ok(n)
        }
    }
}

/// Per-activity time of the bare no-op loop (`n` activities).
async fn bare_round_trip(config: &TemporalConfig, n: u32) -> anyhow::Result<Duration> {
    use temporalio_client::{WorkflowGetResultOptions, WorkflowStartOptions};
    let queue = format!("dt-bare-{}", uuid::Uuid::new_v4());
    let runtime = temporalio_sdk::Runtime::from_current_tokio(Default::default())?;
    let client = durable_temporal::connect(config).await?;
    let options = temporalio_sdk::WorkerOptions::new(queue.clone())
        .register_activities(bare::NoopActivities)
        .register_workflow::<bare::NoopLoop>()?
        .build();
    let mut worker = temporalio_sdk::Worker::new(&runtime, client.clone(), options)?;
    let shutdown = worker.shutdown_handle();
    let local = tokio::task::LocalSet::new();
    let handle = local.spawn_local(async move { worker.run().await });
    let elapsed = local
        .run_until(async {
            let id = format!("bench-noop-{}", uuid::Uuid::new_v4());
            let t = Instant::now();
            let started = client
                .start_workflow(
                    bare::NoopLoop::run,
                    n,
                    WorkflowStartOptions::new(queue.clone(), id).build(),
                )
                .await?;
            let done: u32 = started
                .get_result(WorkflowGetResultOptions::default())
                .await?;
            anyhow::ensure!(done == n, "the bare loop ran {done} of {n} activities");
            anyhow::Ok(t.elapsed())
        })
        .await?;
    shutdown();
    let _ = local.run_until(handle).await;
    Ok(elapsed / n)
}

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
        checkpoints: None,
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
    // A fresh session id per run: the dev server keeps finished workflows,
    // and a turn's workflow id is derived from it.
    let session = format!(
        "temporal-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    );
    let state = turn(
        dir.path(),
        log.as_ref(),
        &session,
        &quiet_agent(AGENT_SECONDS),
    )
    .await?;
    let (elapsed, done) = local
        .run_until(async {
            let t = Instant::now();
            engine.start_turn(state).await?;
            let done = engine.wait_turn(&session, "t1").await?;
            anyhow::Ok((t.elapsed(), done))
        })
        .await?;
    shutdown();
    let _ = local.run_until(handle).await;
    let per = elapsed / done.slices_run.max(1);
    let overhead = per.saturating_sub(direct);
    println!(
        "temporal engine: {per:?} per slice ({} slices, {elapsed:?} total, status {}); overhead {overhead:?}",
        done.slices_run,
        done.status.as_str(),
    );

    // 4. The baseline on the same server, in the same run: as many bare
    // no-op activities as the turn ran slices.
    let bare = bare_round_trip(&config, done.slices_run.max(10)).await?;
    println!(
        "bare no-op activity round trip: {bare:?} per activity; slice overhead / bare = {:.2}, \
         whole slice / bare = {:.2}",
        overhead.as_secs_f64() / bare.as_secs_f64(),
        per.as_secs_f64() / bare.as_secs_f64()
    );
    Ok(())
}
