//! A `harness_turn` worker process for the kill -9 tests (and a template
//! for a real deployment).
//!
//! Configuration from the environment:
//! - `HARNESS_TEMPORAL_ADDRESS`, `HARNESS_TEMPORAL_NAMESPACE`,
//!   `HARNESS_TEMPORAL_TASK_QUEUE`: where to poll (see `TemporalConfig`);
//! - `DT_WORKER_LOG_DB`: the SQLite session log the slices append to;
//! - `DT_WORKER_SANDBOX_ROOT`: root of the local sandbox provider;
//! - `DT_WORKER_DOCKER_IMAGE` (optional): also serve turns in Docker
//!   sandboxes (provider `docker`, this image as its default), through the
//!   local Docker engine.
//!
//! It serves the scripted test agent (`agent = "script"`,
//! `harness_testkit::agent::ScriptHarness`). Parts are written as the
//! session's runner through a hub of session actors over the log (a real
//! deployment would use `session_runtime::WsConnector` to the runner
//! WebSocket of `harness serve` instead). The worker future is not `Send`,
//! so it runs on the main task.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use harness_core::clock::Clock;
use harness_core::sandbox::SandboxProvider;
use harness_core::slice::SliceRunner;
use harness_testkit::agent::{ScriptHarness, SCRIPT_AGENT};
use session_runtime::{Hub, HubConfig, HubConnector, RunnerSink, SystemClock};

fn required(name: &str) -> anyhow::Result<String> {
    std::env::var(name).map_err(|_| anyhow::anyhow!("{name} must be set"))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let config = durable_temporal::TemporalConfig::from_env();
    let log = session_log::SqliteSessionLog::open(required("DT_WORKER_LOG_DB")?)?;
    // The session actors run on this runtime.
    let hub = Hub::new(Arc::new(log), HubConfig::default());
    let root = required("DT_WORKER_SANDBOX_ROOT")?;
    let mut providers: BTreeMap<String, Arc<dyn SandboxProvider>> = BTreeMap::new();
    providers.insert(
        sandbox_local::PROVIDER_NAME.into(),
        Arc::new(sandbox_local::LocalProvider::new(root)),
    );
    // Docker only when asked for: a worker without it needs no engine.
    if let Some(image) = std::env::var("DT_WORKER_DOCKER_IMAGE")
        .ok()
        .filter(|v| !v.is_empty())
    {
        let docker = sandbox_docker::DockerProvider::connect(sandbox_docker::DockerConfig {
            default_image: image,
            ..sandbox_docker::DockerConfig::default()
        })
        .await?;
        providers.insert(sandbox_docker::PROVIDER_NAME.into(), Arc::new(docker));
    }
    let mut harnesses: BTreeMap<String, Arc<dyn harness_core::harness::Harness>> = BTreeMap::new();
    harnesses.insert(SCRIPT_AGENT.into(), Arc::new(ScriptHarness));
    let runner = SliceRunner {
        providers,
        harnesses,
        // The start time as generation: a restarted worker fences the old one.
        sink: Arc::new(RunnerSink::new(
            Arc::new(HubConnector::new(hub)),
            SystemClock.now_ms(),
        )),
        env: BTreeMap::new(),
        broker: None,
        model: None,
        poll_interval: Duration::from_millis(50),
        sleep: session_runtime::tokio_sleeper(),
        clock: Arc::new(SystemClock),
        checkpoints: None,
    };
    eprintln!(
        "worker {} polling {} on {}",
        std::process::id(),
        config.task_queue,
        config.address
    );
    durable_temporal::run_worker(config, Arc::new(runner)).await?;
    Ok(())
}
