//! `harness worker` and `harness runner`: the slices of a server's turns,
//! run where the sandboxes are, their parts written to the server as the
//! session's runner over the runner WebSocket, fenced by generation (the
//! process's start time): one started later fences one still writing.
//!
//! - `worker`: a Temporal worker for `harness serve --engine temporal`.
//! - `runner`: the engine itself for `harness serve --engine remote`: it
//!   takes the server's turn commands on the runner channel and runs the
//!   turns on an in-process engine whose states live in its own home.

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
use crate::reconnect::{keep_linked, LinkEnd};
use crate::AgentKind;

/// Where a worker or runner writes, and with what.
#[derive(Debug, clap::Args)]
pub struct RemoteArgs {
    /// The server whose turns this process runs (`http://host:port`); with
    /// several nodes over one log, any number of them, comma-separated: the
    /// parts go to whichever answers (docs/scale.md).
    #[arg(long)]
    server: String,
    /// A runner (or host) token of the server, for every session.
    #[arg(long, env = "HARNESS_TOKEN")]
    token: Option<String>,
    /// Docker image for docker sessions that name none.
    #[arg(long)]
    image: Option<String>,
    /// Where turn-end checkpoints go: a directory, or `s3://BUCKET/PREFIX`
    /// (the endpoint from $HARNESS_S3_ENDPOINT or $HARNESS_R2_ACCOUNT_ID;
    /// encrypted on this machine). Default: the home's `checkpoints/`. Give
    /// every worker the same store so a session's next turn, its forks and
    /// a lost sandbox work on whichever worker takes them (docs/scale.md).
    #[arg(
        long,
        env = "HARNESS_TURN_CHECKPOINTS",
        value_name = "DIR|s3://BUCKET/PREFIX"
    )]
    checkpoints: Option<String>,
}

/// `harness worker` arguments.
#[derive(Debug, clap::Args)]
pub struct WorkerArgs {
    #[command(flatten)]
    remote: RemoteArgs,
}

/// A slice runner over this machine's sandboxes and agents, writing to
/// `server` as runner generation = now; and that generation.
async fn remote_slice_runner(home: &Home, args: &RemoteArgs) -> Result<(SliceRunner, u64)> {
    let (server, token, image) = (&args.server, args.token.clone(), args.image.as_deref());
    let mut providers: BTreeMap<String, Arc<dyn SandboxProvider>> = BTreeMap::new();
    providers.insert("local".into(), local::provider(home, "local", None).await?);
    match local::provider(home, "docker", image).await {
        Ok(docker) => {
            providers.insert("docker".into(), docker);
        }
        Err(e) if cfg!(feature = "docker") => {
            eprintln!("note: docker sandboxes are not available: {e:#}")
        }
        Err(_) => {}
    }
    if cfg!(feature = "cloudflare") && std::env::var_os("HARNESS_CF_BRIDGE_URL").is_some() {
        match local::provider(home, "cloudflare", None).await {
            Ok(cloudflare) => {
                providers.insert("cloudflare".into(), cloudflare);
            }
            Err(e) => eprintln!("note: cloudflare sandboxes are not available: {e:#}"),
        }
    }
    let mut harnesses: BTreeMap<String, Arc<dyn Harness>> = BTreeMap::new();
    for adapter in local::agents(home, &[AgentKind::ClaudeCode, AgentKind::Codex], true).await? {
        harnesses.insert(adapter.name().to_string(), adapter);
    }
    let generation = SystemClock.now_ms();
    let connector = WsConnector::with_nodes(
        server
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(String::from)
            .collect(),
        token,
    );
    let env = local::agent_env();
    let broker = local::model_broker(home, &env).await?;
    let runner = SliceRunner {
        providers,
        harnesses,
        sink: Arc::new(RunnerSink::new(Arc::new(connector), generation)),
        env,
        broker,
        model: None,
        poll_interval: Duration::from_millis(150),
        sleep: harness::runtime::tokio_sleeper(),
        clock: Arc::new(SystemClock),
        checkpoints: Some(match &args.checkpoints {
            Some(spec) => {
                if spec.starts_with("s3://")
                    && std::env::var_os(harness::moves::crypt::KEY_ENV).is_none()
                {
                    eprintln!(
                        "warning: --checkpoints {spec}: checkpoints are encrypted with this \
                         home's key; other workers read them only if every worker shares \
                         ${} (docs/scale.md)",
                        harness::moves::crypt::KEY_ENV
                    );
                }
                crate::moves::StoreArgs::named(spec)?
                    .turn_checkpoints(home)
                    .await?
            }
            None => crate::local::turn_checkpoints(home)?,
        }),
    };
    Ok((runner, generation))
}

/// `harness worker` in a build without Temporal.
#[cfg(not(feature = "temporal"))]
pub async fn run(_home: &Home, _args: WorkerArgs) -> Result<()> {
    Err(crate::features::missing("temporal", "`harness worker`"))
}

/// Run the worker until interrupted. Temporal's address, namespace and
/// task queue come from `HARNESS_TEMPORAL_ADDRESS`, `…_NAMESPACE`,
/// `…_TASK_QUEUE` (the same variables as `harness serve --engine temporal`).
#[cfg(feature = "temporal")]
pub async fn run(home: &Home, args: WorkerArgs) -> Result<()> {
    let config = harness::temporal::TemporalConfig::from_env();
    let (runner, generation) = remote_slice_runner(home, &args.remote).await?;
    eprintln!(
        "worker (runner generation {generation}) for {} on Temporal {} queue {}",
        args.remote.server, config.address, config.task_queue
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
        () = crate::stop::requested() => {
            eprintln!("shutting down the worker (in-flight slices finish first)");
            shutdown();
            run.await?;
        }
    }
    Ok(())
}

/// `harness runner` arguments (the server was started with `--engine
/// remote`).
#[derive(Debug, clap::Args)]
pub struct RunnerArgs {
    #[command(flatten)]
    remote: RemoteArgs,
    #[command(flatten)]
    limits: crate::local::TurnLimits,
}

/// Run the runner until interrupted: the server's turns on an in-process
/// engine (states in this home's SQLite), resumed after a restart.
pub async fn runner(home: &Home, args: RunnerArgs) -> Result<()> {
    use harness::core::engine::InProcessEngine;
    use harness::core::session::SessionRuntime;
    if args.remote.server.contains(',') {
        anyhow::bail!(
            "harness runner takes one --server: a remote-engine server is a single node \
             (several nodes run their turns on Temporal: `harness worker --server A,B,C`)"
        );
    }
    // This home's turn states belong to this runner alone.
    let _lock = home.lock_runtime("harness runner").await?;
    let log = home.open_log().context("opening the runner's turn store")?;
    let (slices, generation) = remote_slice_runner(home, &args.remote).await?;
    let engine = InProcessEngine::new(
        Arc::new(slices),
        Arc::new(log.turn_store()),
        Arc::new(SystemClock),
        harness::runtime::tokio_spawner(),
    )
    .with_generation(generation);
    let resumed = engine.resume_unfinished().await?;
    if resumed > 0 {
        eprintln!("resumed {resumed} turn(s) an earlier runner left unfinished");
    }
    let runtime = SessionRuntime::new(Arc::new(engine)).with_turn_config(args.limits.turn_config());
    let (server, token) = (&args.remote.server, args.remote.token.as_deref());
    eprintln!("runner (generation {generation}) for {server}");
    let channel =
        || harness::runtime::serve_runner_channel(server, token, generation, runtime.clone());
    let linked = keep_linked(
        "runner",
        Duration::from_secs(10),
        channel,
        |ended| match ended {
            Ok(reason) if reason.contains("replaced") => {
                LinkEnd::Stop(Err(anyhow::anyhow!("this runner was replaced: {reason}")))
            }
            Ok(reason) => LinkEnd::Closed(format!("the runner channel closed ({reason})")),
            Err(e) => LinkEnd::Failed(e.to_string()),
        },
    );
    tokio::select! {
        stopped = linked => stopped,
        () = crate::stop::requested() => {
            eprintln!("shutting down the runner (its unfinished turns resume when it starts again)");
            Ok(())
        }
    }
}
