//! The CLI's state directory: the SQLite database (session log and turn
//! store), local sandboxes, downloaded agents, and one record per session.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use harness::core::sandbox::SandboxHandle;
use serde::{Deserialize, Serialize};

/// What the CLI remembers about a session between invocations.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SessionRecord {
    /// Session id.
    pub id: String,
    /// Agent adapter name.
    pub agent: String,
    /// The sandbox, resumable from any process.
    pub sandbox: SandboxHandle,
    /// Turns started so far.
    pub turns: u32,
    /// The agent's own session id, for resuming the conversation.
    #[serde(default)]
    pub agent_session_id: Option<String>,
}

/// The state directory.
#[derive(Debug, Clone)]
pub struct Home {
    dir: PathBuf,
}

impl Home {
    /// `dir`, else `$HOME/.local/share/harness`; created if missing.
    pub fn open(dir: Option<PathBuf>) -> Result<Self> {
        let dir = match dir {
            Some(d) => d,
            None => {
                let base = std::env::var_os("HOME")
                    .context("neither --home, $HARNESS_HOME nor $HOME is set")?;
                PathBuf::from(base).join(".local/share/harness")
            }
        };
        std::fs::create_dir_all(dir.join("sessions"))
            .with_context(|| format!("creating {}", dir.display()))?;
        Ok(Self { dir })
    }

    /// The SQLite database.
    pub fn db(&self) -> PathBuf {
        self.dir.join("harness.db")
    }

    /// Root of local sandboxes.
    pub fn sandboxes(&self) -> PathBuf {
        self.dir.join("sandboxes")
    }

    /// Where downloaded agents go.
    pub fn agents(&self) -> PathBuf {
        self.dir.join("agents")
    }

    fn record_path(&self, id: &str) -> Result<PathBuf> {
        harness::core::SessionId::parse(id)?;
        Ok(self.dir.join("sessions").join(format!("{id}.json")))
    }

    /// Load a session record.
    pub fn load_session(&self, id: &str) -> Result<SessionRecord> {
        let path = self.record_path(id)?;
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                bail!("unknown session {id:?}: `harness sessions list` shows the known ones")
            }
            Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
        };
        serde_json::from_slice(&bytes)
            .with_context(|| format!("{} is not a session record", path.display()))
    }

    /// Save a session record (atomically).
    pub fn save_session(&self, record: &SessionRecord) -> Result<()> {
        let path = self.record_path(&record.id)?;
        let tmp = path.with_extension("json.tmp");
        std::fs::write(&tmp, serde_json::to_vec_pretty(record)?)?;
        std::fs::rename(&tmp, &path)?;
        Ok(())
    }

    /// Remove a session record.
    pub fn forget_session(&self, id: &str) -> Result<()> {
        let path = self.record_path(id)?;
        match std::fs::remove_file(path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e.into()),
            _ => Ok(()),
        }
    }
}
