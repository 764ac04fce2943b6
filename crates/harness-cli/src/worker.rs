//! `harness worker`: a Temporal worker for a `harness serve --engine
//! temporal`. It runs the slices of the server's turns where the sandboxes
//! are, and writes their parts to the server as the session's runner over
//! the runner WebSocket, fenced by generation (its start time): a worker
//! started later fences one that is still writing.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use harness::core::clock::Clock;
use harness::core::harness::Harness;
use harness::core::sandbox::SandboxProvider;
use harness::core::slice::SliceRunner;
use harness::runtime::{RunnerSink, SystemClock, WsConnector};

use crate::home::Home;
use crate::local;
use crate::AgentKind;

/// `harness worker` arguments.
#[derive(Debug, clap::Args)]
pub struct WorkerArgs {
    /// The server whose turns this worker runs (`http://host:port`).
    #[arg(long)]
    server: String,
    /// A runner (or host) token of the server.
    #[arg(long, env = "HARNESS_TOKEN")]
    token: Option<String>,
    /// Docker image for docker sessions that name none.
    #[arg(long)]
    image: Option<String>,
}

/// Run the worker until interrupted. Temporal's address, namespace and
/// task queue come from `HARNESS_TEMPORAL_ADDRESS`, `…_NAMESPACE`,
/// `…_TASK_QUEUE` (the same variables as `harness serve --engine temporal`).
pub async fn run(home: &Home, args: WorkerArgs) -> Result<()> {
    let config = harness::temporal::TemporalConfig::from_env();
    let mut providers: BTreeMap<String, Arc<dyn SandboxProvider>> = BTreeMap::new();
    providers.insert("local".into(), local::provider(home, "local", None).await?);
    match local::provider(home, "docker", args.image.as_deref()).await {
        Ok(docker) => {
            providers.insert("docker".into(), docker);
        }
        Err(e) => eprintln!("note: docker sandboxes are not available: {e:#}"),
    }
    let mut harnesses: BTreeMap<String, Arc<dyn Harness>> = BTreeMap::new();
    for adapter in local::agents(home, &[AgentKind::ClaudeCode, AgentKind::Codex], true).await? {
        harnesses.insert(adapter.name().to_string(), adapter);
    }
    let generation = SystemClock.now_ms();
    let connector = WsConnector::new(args.server.clone(), args.token.clone());
    let runner = SliceRunner {
        providers,
        harnesses,
        sink: Arc::new(RunnerSink::new(Arc::new(connector), generation)),
        env: local::agent_env(),
        model: None,
        poll_interval: Duration::from_millis(150),
        sleep: harness::runtime::tokio_sleeper(),
        clock: Arc::new(SystemClock),
    };
    eprintln!(
        "worker (runner generation {generation}) for {} on Temporal {} queue {}",
        args.server, config.address, config.task_queue
    );
    // The Temporal worker future is not Send: it runs on this (main) task.
    let mut worker = harness::temporal::TurnWorker::new(&config, Arc::new(runner))
        .await
        .context(
            "starting the Temporal worker (start Temporal with `cargo xtask services start`)",
        )?;
    let shutdown = worker.shutdown_handle();
    let run = worker.run();
    tokio::pin!(run);
    tokio::select! {
        result = &mut run => result?,
        _ = tokio::signal::ctrl_c() => {
            eprintln!("shutting down the worker (in-flight slices finish first)");
            shutdown();
            run.await?;
        }
    }
    Ok(())
}
