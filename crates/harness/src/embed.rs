//! [`open`]: the session runtime of a directory, assembled from this
//! crate's backends — what `harness run` and `harness serve` use, for
//! programs that embed the harness.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use harness_core::turn::TurnConfig;
use harness_core::{Error, ErrorKind, Result};
use session_runtime::{EngineChoice, Runtime};

/// How [`open_with`] assembles the runtime.
#[derive(Debug, Clone, Default)]
pub struct OpenOptions {
    /// Environment for the agents (API keys, base URLs). Default: the
    /// `ANTHROPIC_*`, `CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC` and
    /// `OPENAI_*` variables of this process.
    pub env: Option<BTreeMap<String, String>>,
    /// Turn budgets (slice length, turn length, retries).
    pub turn: Option<TurnConfig>,
    /// The Docker image for sessions that name none (feature `docker`).
    pub docker_image: Option<String>,
    /// Give agents the credentials in `env` as they are (the key enters the
    /// sandbox, where anything the agent runs can read it). Default, with
    /// the `broker` feature: agents reach the model through the model
    /// broker of `dir/broker` with a session token.
    pub direct_model: bool,
}

/// The session runtime of `dir` with the defaults of [`OpenOptions`].
pub async fn open(dir: impl AsRef<Path>) -> Result<Runtime> {
    open_with(dir, OpenOptions::default()).await
}

/// The session runtime of `dir`: the SQLite log and turn store
/// (`dir/harness.db`), local sandboxes under `dir/sandboxes`, Docker when
/// the `docker` feature is on and a Docker engine answers, Claude Code and
/// Codex when their binaries are found (`HARNESS_CLAUDE_BIN` /
/// `HARNESS_CODEX_BIN`, the `cargo xtask agents` cache, or `PATH`), the
/// in-process engine. Unfinished turns of an earlier process are resumed.
///
/// One process should drive a directory at a time (`harness serve` and
/// `harness run` take a lock on it; take the same care in your program).
pub async fn open_with(dir: impl AsRef<Path>, options: OpenOptions) -> Result<Runtime> {
    let dir: PathBuf = dir.as_ref().to_path_buf();
    std::fs::create_dir_all(&dir)?;
    let log = session_log::SqliteSessionLog::open(dir.join("harness.db"))?;
    // The audit chain's key, beside the database as `harness` keeps it
    // (docs/audit.md). It is made by the broker's secret-file helper;
    // without the `broker` feature the chain stays unkeyed.
    #[cfg(feature = "broker")]
    let log = {
        let key = harness_broker::load_or_make_secret(&dir.join("audit.key"))?;
        log.with_chain_key(harness_core::log::ChainKey::new(key))
    };
    let log = Arc::new(log);
    let env = options.env.unwrap_or_else(session_runtime::agent_env);
    #[cfg(feature = "broker")]
    let broker: Option<Arc<dyn harness_core::broker::ModelBroker>> = if options.direct_model {
        None
    } else {
        let config = harness_broker::BrokerConfig::from_vars(dir.join("broker"), &env);
        Some(Arc::new(harness_broker::Broker::start(config).await?))
    };
    #[cfg(not(feature = "broker"))]
    let broker: Option<Arc<dyn harness_core::broker::ModelBroker>> = {
        let _ = options.direct_model;
        None
    };
    let mut builder = Runtime::builder(log.clone())
        .broker(broker)
        .engine(EngineChoice::InProcess {
            store: Arc::new(log.turn_store()),
        })
        .env(env)
        .turn_config(options.turn.unwrap_or_default())
        .checkpoints(turn_checkpoints(&dir)?)
        .provider(Arc::new(sandbox_local::LocalProvider::new(
            dir.join("sandboxes"),
        )));
    #[cfg(feature = "docker")]
    {
        let mut config = sandbox_docker::DockerConfig::default();
        if let Some(image) = options.docker_image {
            config.default_image = image;
        }
        if let Ok(docker) = sandbox_docker::DockerProvider::connect(config).await {
            builder = builder.provider(Arc::new(docker));
        }
    }
    #[cfg(not(feature = "docker"))]
    let _ = options.docker_image;
    let mut agents = 0;
    #[cfg(feature = "claude-code")]
    if let Some(path) = found(harness_claude_code::locate_host_binary())? {
        let binary = harness_claude_code::AgentBinary::load(&path)?;
        builder = builder.agent(Arc::new(harness_claude_code::ClaudeCodeHarness::new(
            harness_claude_code::ClaudeCodeConfig::with_binary(binary),
        )));
        agents += 1;
    }
    #[cfg(feature = "codex")]
    if let Some(path) = found(harness_codex::locate_host_binary())? {
        let binary = harness_codex::AgentBinary::load(&path)?;
        builder = builder.agent(Arc::new(harness_codex::CodexHarness::new(
            harness_codex::CodexConfig::with_binary(binary),
        )));
        agents += 1;
    }
    if agents == 0 {
        return Err(Error::not_found(
            "no agent binary found: set HARNESS_CLAUDE_BIN or HARNESS_CODEX_BIN, or put claude/codex on PATH",
        ));
    }
    let runtime = builder.build();
    runtime.start().await?;
    Ok(runtime)
}

/// A located binary, `None` when it is simply not there.
#[allow(dead_code)]
fn found(located: Result<PathBuf>) -> Result<Option<PathBuf>> {
    match located {
        Ok(path) => Ok(Some(path)),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// Turn-end checkpoints in `<dir>/checkpoints` (with the `fs-store`
/// feature; without it, sessions run without checkpoints).
fn turn_checkpoints(
    dir: &Path,
) -> Result<Option<Arc<dyn harness_core::turn_checkpoint::TurnCheckpoints>>> {
    #[cfg(feature = "fs-store")]
    {
        let store = checkpoint_fs::FsCheckpointStore::open(dir.join("checkpoints"))?;
        Ok(Some(Arc::new(
            harness_moves::turns::StoreTurnCheckpoints::new(
                Arc::new(store),
                Arc::new(session_runtime::SystemClock),
            ),
        )))
    }
    #[cfg(not(feature = "fs-store"))]
    {
        let _ = dir;
        Ok(None)
    }
}
