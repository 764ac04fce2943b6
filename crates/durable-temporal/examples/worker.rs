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
//! It serves the scripted test agent (`agent = "script"`). The worker
//! future is not `Send`, so it runs on the main task.

#[path = "../tests/common/script.rs"]
mod script;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use harness_core::log::now_ms;
use harness_core::sandbox::SandboxProvider;
use harness_core::sink::LogSink;
use harness_core::slice::SliceRunner;

fn required(name: &str) -> anyhow::Result<String> {
    std::env::var(name).map_err(|_| anyhow::anyhow!("{name} must be set"))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let config = durable_temporal::TemporalConfig::from_env();
    let log = session_log::SqliteSessionLog::open(required("DT_WORKER_LOG_DB")?)?;
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
    harnesses.insert(script::SCRIPT_AGENT.into(), Arc::new(script::ScriptHarness));
    let runner = SliceRunner {
        providers,
        harnesses,
        // The start time as generation: a restarted worker fences the old one.
        sink: Arc::new(LogSink::new(Arc::new(log), now_ms())),
        env: BTreeMap::new(),
        model: None,
        poll_interval: Duration::from_millis(50),
        sleep: Arc::new(|d| Box::pin(tokio::time::sleep(d))),
        now_ms: Arc::new(now_ms),
    };
    eprintln!(
        "worker {} polling {} on {}",
        std::process::id(),
        config.task_queue,
        config.address
    );
    durable_temporal::run_worker(config, runner).await?;
    Ok(())
}
