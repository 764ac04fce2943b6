//! The session runtime of a home, in this process: the SQLite log and turn
//! store, the sandbox providers this machine has, the agent adapters, and
//! the engine — assembled once here for `harness serve`, `run`, `demo` and
//! `resume`, so they all take the same path.

use harness::core::turn_checkpoint::TurnCheckpoints;
use std::collections::BTreeMap;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use harness::core::harness::Harness;
use harness::core::sandbox::SandboxProvider;
use harness::core::turn::TurnConfig;
use harness::runtime::{EngineChoice, Runtime};

use crate::helpers::Helper;
use crate::home::Home;
use crate::AgentKind;

/// Which engine runs the home's turns.
#[derive(Debug, Clone)]
pub enum EngineSpec {
    /// In this process, turn states in the home's SQLite database.
    InProcess,
    /// On Temporal: workflows started from here, slices run by
    /// `harness worker` processes.
    #[cfg(feature = "temporal")]
    Temporal(harness::temporal::TemporalConfig),
}

/// What to assemble.
#[derive(Debug, Clone)]
pub struct Options {
    /// Agents this runtime runs (each must be available unless `lenient`).
    pub agents: Vec<AgentKind>,
    /// Environment every agent gets (credentials, base URLs).
    pub env: BTreeMap<String, String>,
    /// The Docker image for sessions that name none.
    pub image: Option<String>,
    /// Slice length and quiet limit of the turns.
    pub limits: TurnLimits,
    /// The engine.
    pub engine: EngineSpec,
    /// Leave out (with a note) an agent or Docker that is not available,
    /// instead of failing (a server offers what the machine has).
    pub lenient: bool,
    /// Fail when Docker is not available (the session runs in Docker).
    pub require_docker: bool,
    /// Fail when no Cloudflare bridge answers (a new session asked for one).
    pub require_cloudflare: bool,
    /// One node among several over a shared log (`serve --log
    /// postgres://…`); `None`: the home's SQLite log, this process alone.
    pub cluster: Option<Cluster>,
    /// Ready Docker containers kept for new sessions (`serve
    /// --docker-pool`; 0: none, the one-shot commands' choice, for which
    /// a pool would be made and thrown away).
    pub docker_pool: usize,
}

/// What a node among several shares with the others (docs/scale.md).
#[derive(Debug, Clone)]
pub struct Cluster {
    /// The shared session log (fenced by the leases).
    pub log: Arc<dyn harness::core::log::SessionLog>,
    /// Which node runs each session's actor.
    pub leases: Arc<dyn harness::core::log::SessionLeases>,
    /// The host token this node presents when it forwards to a peer.
    pub peer_token: Option<String>,
    /// The shared log and this node's name, for the operator (the
    /// database's password blanked).
    pub describe: String,
}

/// The turn budgets a user sets on the command line.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct TurnLimits {
    /// Slice length in milliseconds (default 750 s).
    #[arg(long, hide = true)]
    pub slice_ms: Option<u64>,
    /// End a turn `timed_out` when its agent shows no progress (no output
    /// but warnings such as model retries) for this many seconds; 0 = never.
    /// Waiting for an approval does not count. [default: 900]
    #[arg(long, value_name = "SECONDS", env = "HARNESS_QUIET_TIMEOUT")]
    pub quiet_timeout: Option<u64>,
    /// Hold every session to this many model tokens (input and output,
    /// over all its turns, as the model broker counts them): past it the
    /// broker refuses the session's model calls and the turn ends `failed`
    /// with the code `budget_exceeded`.
    #[arg(long, value_name = "TOKENS", env = "HARNESS_BUDGET_TOKENS")]
    pub budget_tokens: Option<u64>,
    /// Hold every session to this brokered spend in US dollars, priced by
    /// `<home>/broker/prices.json` (docs/broker.md, *Budgets*); a model
    /// with no price there is refused while a spend budget is set.
    #[arg(long, value_name = "USD", env = "HARNESS_BUDGET_USD", value_parser = parse_usd)]
    pub budget_usd: Option<f64>,
}

/// A dollar amount: finite and not negative.
fn parse_usd(s: &str) -> std::result::Result<f64, String> {
    match s.trim().trim_start_matches('$').parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
        _ => Err(format!("{s:?} is not an amount of US dollars (e.g. 2.50)")),
    }
}

impl TurnLimits {
    /// The turn config these limits give.
    pub fn turn_config(&self) -> TurnConfig {
        let mut turn = TurnConfig::default();
        if let Some(ms) = self.slice_ms {
            turn.slice_ms = ms;
        }
        if let Some(secs) = self.quiet_timeout {
            turn.quiet_ms = secs.saturating_mul(1000);
        }
        turn.budget.max_tokens = self.budget_tokens;
        turn.budget.max_spend_micros = self.budget_usd.map(|usd| (usd * 1e6).round() as u64);
        turn
    }
}

/// A provider for `kind` (`local` under the home, or `docker`).
pub async fn provider(
    home: &Home,
    kind: &str,
    image: Option<&str>,
) -> Result<Arc<dyn SandboxProvider>> {
    match kind {
        "local" => Ok(Arc::new(
            harness::local::LocalProvider::new(home.sandboxes())
                .with_gate(crate::helpers::path(home, Helper::Gate)?),
        )),
        #[cfg(not(feature = "docker"))]
        "docker" => {
            let _ = image;
            Err(crate::features::missing("docker", "a docker sandbox"))
        }
        #[cfg(feature = "docker")]
        "docker" => docker_provider(home, image, 0).await,
        #[cfg(not(feature = "cloudflare"))]

        "cloudflare" => Err(crate::features::missing("cloudflare", "a cloudflare sandbox")),
        #[cfg(feature = "cloudflare")]
        "cloudflare" => {
            let config = harness::cloudflare::CloudflareConfig::from_env()?;
            let provider = harness::cloudflare::CloudflareProvider::new(config.clone())?;
            tokio::time::timeout(std::time::Duration::from_secs(10), provider.health())
                .await
                .map_err(|_| {
                    anyhow::anyhow!(
                        "the Cloudflare bridge at {} did not answer /health in 10 s",
                        config.url
                    )
                })?
                .with_context(|| {
                    format!("the Cloudflare bridge at {} is not healthy", config.url)
                })?;
            Ok(Arc::new(provider))
        }
        #[cfg(not(feature = "microvm"))]
        "microvm" => Err(crate::features::missing("microvm", "a microvm sandbox")),
        #[cfg(feature = "microvm")]
        "microvm" => {
            let config = harness::microvm::MicrovmConfig::from_assets(
                microvm_assets(),
                microvm_state(home),
            )?;
            Ok(Arc::new(harness::microvm::MicrovmProvider::new(config)))
        }
        other => bail!(
            "unknown sandbox provider {other:?} (this build knows local, docker, cloudflare and microvm)"
        ),
    }
}

/// The Docker provider of this home, keeping `pool` ready containers for
/// new sessions (`DockerConfig::pool_size`; with the pool they serve any
/// session, their forward directories beside the broker's sockets).
#[cfg(feature = "docker")]
async fn docker_provider(
    home: &Home,
    image: Option<&str>,
    pool: usize,
) -> Result<Arc<dyn SandboxProvider>> {
    let mut config = docker_config(home, image)?;
    if pool > 0 {
        config.pool_size = pool;
        config.pool_forward_dir = Some(home.broker_dir().join("pool"));
    }
    let connect = harness::docker::DockerProvider::connect(config);
    let provider = tokio::time::timeout(std::time::Duration::from_secs(10), connect)
        .await
        .map_err(|_| anyhow::anyhow!("the Docker engine did not answer in 10 s"))?
        .context(
            "no Docker engine answered (start dockerd, e.g. `cargo xtask services start`, or use --sandbox local)",
        )?;
    Ok(Arc::new(provider))
}

/// The Docker provider's configuration for this home: the default image
/// (`image`, else `harness/debian:bookworm`, made here on first use with no
/// registry needed, saying what it does: it takes a minute), the gate
/// (`crate::helpers`), and the containers' exec directories.
#[cfg(feature = "docker")]
pub fn docker_config(home: &Home, image: Option<&str>) -> Result<harness::docker::DockerConfig> {
    let mut config = harness::docker::DockerConfig::default();
    if let Some(image) = image {
        config.default_image = image.to_string();
    }
    config.gate = Some(crate::helpers::path(home, Helper::Gate)?);
    config.make_default_image = Some(crate::image::make_image(home));
    // Commands through the exec server in each container, not the
    // engine's exec API (docs/sandbox-docker.md).
    config.exec_dir = Some(home.docker_exec_dir());
    Ok(config)
}

/// The microVM guest: `HARNESS_MICROVM_ASSETS`, else
/// `$HARNESS_CACHE/microvm` (where `cargo xtask microvm` builds it).
fn microvm_assets() -> std::path::PathBuf {
    if let Some(dir) = std::env::var_os("HARNESS_MICROVM_ASSETS") {
        return dir.into();
    }
    let cache = std::env::var("HARNESS_CACHE").unwrap_or_else(|_| "/var/cache/harness".into());
    std::path::Path::new(&cache).join("microvm")
}

/// Where microVMs and their bootstrap snapshots live:
/// `HARNESS_MICROVM_STATE`, else `<home>/microvm`.
#[cfg(feature = "microvm")]
fn microvm_state(home: &Home) -> std::path::PathBuf {
    match std::env::var_os("HARNESS_MICROVM_STATE") {
        Some(dir) => dir.into(),
        None => home.sandboxes().with_file_name("microvm"),
    }
}

/// The adapters for `kinds`, skipping (with a note) the unavailable ones
/// when `lenient`.
pub async fn agents(
    home: &Home,
    kinds: &[AgentKind],
    lenient: bool,
) -> Result<Vec<Arc<dyn Harness>>> {
    let mut out = Vec::new();
    for &kind in kinds {
        let loaded = async {
            let binary = crate::agents::ensure_binary(home, kind).await?;
            crate::agents::adapter(home, kind, binary)
        }
        .await;
        match loaded {
            Ok(adapter) => out.push(adapter),
            Err(e) if lenient => eprintln!("note: {} is not available: {e:#}", kind.name()),
            Err(e) => return Err(e),
        }
    }
    Ok(out)
}

/// Assemble the home's runtime. The caller holds the home's
/// [`RuntimeLock`](crate::home::RuntimeLock).
pub async fn runtime(home: &Home, options: Options) -> Result<Runtime> {
    let (log, turn_store): (Arc<dyn harness::core::log::SessionLog>, _) = match &options.cluster {
        Some(cluster) => (cluster.log.clone(), None),
        None => {
            let log = home.open_log()?;
            let turns: Arc<dyn harness::core::engine::TurnStore> = Arc::new(log.turn_store());
            (Arc::new(log), Some(turns))
        }
    };
    let engine = match &options.engine {
        EngineSpec::InProcess => EngineChoice::InProcess {
            store: turn_store.context(
                "several nodes run their turns on Temporal: the in-process engine's turns would die with their node",
            )?,
        },
        #[cfg(feature = "temporal")]
        EngineSpec::Temporal(config) => EngineChoice::External(Arc::new(
            harness::temporal::TemporalEngine::connect(config.clone())
                .await
                .context("connecting to Temporal (start it with `cargo xtask services start`)")?,
        )),
    };
    let turn = options.limits.turn_config();
    // Slices run here only on the in-process engine (Temporal's run in
    // `harness worker`, which has its own broker).
    let broker = match options.engine {
        EngineSpec::InProcess => model_broker(home, &options.env).await?,
        #[cfg(feature = "temporal")]
        EngineSpec::Temporal(_) => None,
    };
    let mut builder = Runtime::builder(log);
    if let Some(cluster) = &options.cluster {
        builder = builder.hub_config(harness::runtime::HubConfig {
            leases: Some(cluster.leases.clone()),
            peer_token: cluster.peer_token.clone(),
            ..Default::default()
        });
    }
    let mut builder = builder
        .engine(engine)
        .broker(broker)
        .env(options.env.clone())
        .turn_config(turn)
        .checkpoints(Some(turn_checkpoints(home)?));
    builder = builder.provider(provider(home, "local", None).await?);
    #[cfg(feature = "docker")]
    let docker = docker_provider(home, options.image.as_deref(), options.docker_pool).await;
    #[cfg(not(feature = "docker"))]
    let docker = provider(home, "docker", options.image.as_deref()).await;
    match docker {
        Ok(docker) => builder = builder.provider(docker),
        Err(e) if options.require_docker => return Err(e),
        Err(e) if options.lenient && cfg!(feature = "docker") => {
            eprintln!("note: docker sandboxes are not available: {e:#}")
        }
        // A run in a local sandbox does not need Docker.
        Err(_) => {}
    }
    // A bridge is configured by its URL; without one, nothing to add.
    if options.require_cloudflare
        || (cfg!(feature = "cloudflare") && std::env::var_os("HARNESS_CF_BRIDGE_URL").is_some())
    {
        match provider(home, "cloudflare", None).await {
            Ok(cloudflare) => builder = builder.provider(cloudflare),
            Err(e) if options.require_cloudflare => return Err(e),
            Err(e) => eprintln!("note: cloudflare sandboxes are not available: {e:#}"),
        }
    }
    // The microVM guest is found by its assets; without them, nothing to add.
    if cfg!(feature = "microvm") && microvm_assets().join("assets.json").exists() {
        match provider(home, "microvm", None).await {
            Ok(microvm) => builder = builder.provider(microvm),
            Err(e) => eprintln!("note: microvm sandboxes are not available: {e:#}"),
        }
    }
    for adapter in agents(home, &options.agents, options.lenient).await? {
        builder = builder.agent(adapter);
    }
    Ok(builder.build())
}

pub use crate::broker::model_broker;

/// Turn-end checkpoints in the home's directory store (`<home>/checkpoints`,
/// the store `harness checkpoint` uses by default): every turn's end is
/// checkpointed there, and forks, rewinds and lost sandboxes are made anew
/// from it.
pub fn turn_checkpoints(home: &Home) -> Result<Arc<dyn TurnCheckpoints>> {
    let dir = home.checkpoints();
    let store = harness::fs_store::FsCheckpointStore::open(&dir)
        .with_context(|| format!("opening the checkpoint store in {}", dir.display()))?;
    Ok(Arc::new(harness::moves::turns::StoreTurnCheckpoints::new(
        Arc::new(store),
        Arc::new(harness::runtime::SystemClock),
    )))
}

/// Credentials and base URLs for agents, from this process's environment.
pub fn agent_env() -> BTreeMap<String, String> {
    harness::runtime::agent_env()
}
