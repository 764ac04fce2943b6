//! `harness sessions list|export|fork`, on the CLI's SQLite log.

use anyhow::{Context, Result};
use harness::core::frame::SessionId;
use harness::core::log::SessionLog;

use crate::home::Home;

/// `harness sessions …`.
#[derive(Debug, clap::Subcommand)]
pub enum SessionsCommand {
    /// List sessions: id, frames, sealed, origin.
    List,
    /// Print a session's frames as JSON lines.
    Export {
        /// The session.
        id: String,
        /// Only frames 1..=UNTIL.
        #[arg(long)]
        until: Option<u64>,
    },
    /// Copy frames 1..=UNTIL of a session into a new session.
    Fork {
        /// The source session.
        id: String,
        /// Last frame to copy.
        #[arg(long)]
        until: u64,
        /// Id of the new session (default: generated).
        #[arg(long)]
        target: Option<String>,
        /// Seal the new session (read-only).
        #[arg(long)]
        seal: bool,
    },
}

/// Run a sessions subcommand.
pub async fn run(home: &Home, command: SessionsCommand) -> Result<()> {
    let log =
        harness::sqlite::SqliteSessionLog::open(home.db()).context("opening the session log")?;
    match command {
        SessionsCommand::List => {
            let logs = log.list().await?;
            println!(
                "{:<32} {:<12} {:<7} {:>6} {:>7} {:>7}  {:<24} origin",
                "SESSION", "AGENT", "SANDBOX", "TURNS", "FRAMES", "SEALED", "LAST TURN"
            );
            for info in logs {
                let origin = info
                    .forked_from
                    .as_ref()
                    .map(|o| format!("fork of {} until {}", o.session, o.until))
                    .unwrap_or_default();
                let config = info.meta.config_or_default();
                let last = info
                    .meta
                    .turn
                    .as_ref()
                    .map(|t| format!("{} {}", t.turn_id, t.status.as_str()))
                    .unwrap_or_else(|| "-".into());
                println!(
                    "{:<32} {:<12} {:<7} {:>6} {:>7} {:>7}  {:<24} {origin}",
                    info.session.to_string(),
                    config.agent,
                    config.sandbox.provider,
                    info.meta.turns,
                    info.last_seq,
                    if info.sealed { "yes" } else { "no" },
                    last
                );
            }
        }
        SessionsCommand::Export { id, until } => {
            let session = SessionId::parse(id)?;
            let info = log.info(&session).await?;
            let until = until.unwrap_or(info.last_seq);
            if until > info.last_seq {
                anyhow::bail!(
                    "session {session} ends at frame {}, cannot export until {until}",
                    info.last_seq
                );
            }
            let mut after = 0;
            while after < until {
                let frames = log
                    .read(&session, after, (until - after).min(1000) as usize)
                    .await?;
                let Some(last) = frames.last() else { break };
                after = last.seq;
                for frame in frames {
                    println!("{}", serde_json::to_string(&frame)?);
                }
            }
        }
        SessionsCommand::Fork {
            id,
            until,
            target,
            seal,
        } => {
            let source = SessionId::parse(id)?;
            let target =
                SessionId::parse(target.unwrap_or_else(|| format!("{source}-fork-{until}")))?;
            let mut info = log.fork(&source, until, &target).await?;
            if seal {
                info = log.seal(&target).await?;
            }
            println!("{}", serde_json::to_string_pretty(&info)?);
        }
    }
    Ok(())
}
