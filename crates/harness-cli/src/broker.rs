//! `harness broker serve`: the home's model broker as a process of its own.
//!
//! `harness run`, `serve`, `worker` and `runner` do not serve the broker
//! themselves: they start this detached process when none serves the
//! home's broker directory, so the broker outlives them as the agents do
//! (a runner killed mid-turn does not cut its agent's model stream; the
//! next runner finds the same broker). It stops on its own once no session
//! has had a turn running for `--idle-exit` seconds, or when its directory
//! is removed. A turn whose mark no slice and no model call refreshed for
//! `--stale-after` seconds (its runner was killed and never came back)
//! does not count as running.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use harness::broker::{Broker, BrokerConfig, SpawnServer};
use harness::core::broker::{ModelBroker, CREDENTIAL_ENV_VARS};

use crate::home::Home;

/// `harness broker …`.
#[derive(Debug, clap::Subcommand)]
pub enum BrokerCommand {
    /// Serve a broker directory until idle (started by the other commands;
    /// the upstreams come from ANTHROPIC_API_KEY / ANTHROPIC_BASE_URL and
    /// OPENAI_API_KEY / OPENAI_BASE_URL).
    Serve {
        /// The broker directory (default: the home's `broker/`).
        #[arg(long)]
        dir: Option<PathBuf>,
        /// Stop after this many seconds with no turn running.
        #[arg(long, default_value_t = 600)]
        idle_exit: u64,
        /// A turn whose mark no slice and no model call refreshed for this
        /// many seconds (its server was killed and not restarted) no longer
        /// counts as running.
        #[arg(long, default_value_t = harness::broker::STALE_AFTER.as_secs())]
        stale_after: u64,
    },
    /// Show what a session used through the broker.
    Usage {
        /// The session.
        session: String,
    },
}

/// Run a broker subcommand.
pub async fn run(home: &Home, command: BrokerCommand) -> Result<()> {
    match command {
        BrokerCommand::Serve {
            dir,
            idle_exit,
            stale_after,
        } => {
            let dir = dir.unwrap_or_else(|| home.broker_dir());
            Broker::serve_until_idle(
                BrokerConfig::from_env(&dir),
                Duration::from_secs(idle_exit),
                Duration::from_secs(stale_after),
            )
            .await
            .with_context(|| format!("serving the model broker of {}", dir.display()))
        }
        BrokerCommand::Usage { session } => {
            let usage = harness::broker::read_usage(&home.broker_dir(), &session)?;
            println!("{}", serde_json::to_string_pretty(&usage)?);
            Ok(())
        }
    }
}

/// The home's model broker over the upstreams in `env`, served by a
/// detached `harness broker serve`; `None` with `--direct-model` (said on
/// stderr: the key then enters every sandbox).
pub async fn model_broker(
    home: &Home,
    env: &BTreeMap<String, String>,
) -> Result<Option<Arc<dyn ModelBroker>>> {
    if home.direct_model() {
        eprintln!(
            "warning: --direct-model: agents get the model key in their environment; anything they run can read it and send it anywhere"
        );
        return Ok(None);
    }
    let exe = std::env::current_exe().context("finding this harness binary")?;
    let spawn: SpawnServer = Arc::new(move |config: &BrokerConfig| {
        spawn_server(&exe, config).map_err(|e| {
            harness::core::Error::backend(format!("starting `harness broker serve`: {e:#}"))
        })
    });
    let config = BrokerConfig::from_vars(home.broker_dir(), env);
    let broker = Broker::start_detached(config, spawn)
        .await
        .with_context(|| {
            format!(
                "starting the model broker of {}",
                home.broker_dir().display()
            )
        })?;
    Ok(Some(Arc::new(broker)))
}

fn spawn_server(exe: &std::path::Path, config: &BrokerConfig) -> Result<()> {
    use std::os::unix::process::CommandExt;
    let log_path = config.dir.join("broker.log");
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)
        .with_context(|| format!("opening {}", log_path.display()))?;
    let mut cmd = Command::new(exe);
    cmd.arg("broker")
        .arg("serve")
        .arg("--dir")
        .arg(&config.dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        // Its own process group: a Ctrl-C meant for this command leaves it.
        .process_group(0);
    // Exactly the upstreams this command was given, nothing inherited.
    for k in CREDENTIAL_ENV_VARS {
        cmd.env_remove(k);
    }
    for (key, url, upstream) in [
        ("ANTHROPIC_API_KEY", "ANTHROPIC_BASE_URL", &config.anthropic),
        ("OPENAI_API_KEY", "OPENAI_BASE_URL", &config.openai),
    ] {
        if let Some(u) = upstream {
            cmd.env(key, &u.api_key).env(url, &u.base_url);
        }
    }
    cmd.env_remove("HARNESS_DIRECT_MODEL");
    let mut child = cmd.spawn().context("spawning harness broker serve")?;
    // Reap it if it ends while this process lives.
    std::thread::spawn(move || {
        let _ = child.wait();
    });
    Ok(())
}
