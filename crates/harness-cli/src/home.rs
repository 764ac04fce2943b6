//! The CLI's state directory: the SQLite database (session log and turn
//! store), local sandboxes, downloaded agents — and who runs the home's
//! session runtime right now.
//!
//! One session has one actor. A home's sessions are driven by exactly one
//! process at a time: the one holding `runtime.lock` (an exclusive file
//! lock, released by the kernel when the process dies, even by kill -9).
//! `harness serve` holds it while it serves and writes `serve.json` (its
//! address and a local token), so a `harness run` on the same home talks to
//! the server instead of starting a second actor; a `harness run` without a
//! server holds the lock itself for the length of its turn.

use std::fs::File;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

/// The state directory.
#[derive(Debug, Clone)]
pub struct Home {
    dir: PathBuf,
    direct_model: bool,
}

/// Proof that this process runs the home's session runtime. Dropping it
/// (or dying) releases the home.
#[derive(Debug)]
pub struct RuntimeLock {
    _file: File,
}

/// What a running `harness serve` publishes in the home.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ServeInfo {
    /// `http://host:port`.
    pub url: String,
    /// A host token of the server, for clients on this machine.
    pub token: String,
    /// The server's process id.
    pub pid: u32,
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
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        Ok(Self {
            dir,
            direct_model: false,
        })
    }

    /// Give agents the model key itself instead of a broker token
    /// (`--direct-model`).
    pub fn with_direct_model(mut self, direct: bool) -> Self {
        self.direct_model = direct;
        self
    }

    /// Whether agents get the key itself (`--direct-model`).
    pub fn direct_model(&self) -> bool {
        self.direct_model
    }

    /// The model broker's directory (its socket, secret and usage records).
    pub fn broker_dir(&self) -> PathBuf {
        self.dir.join("broker")
    }

    /// The SQLite database.
    pub fn db(&self) -> PathBuf {
        self.dir.join("harness.db")
    }

    /// The key the session log's audit chain is keyed with (made on first
    /// use; docs/audit.md). Kept out of the database so whoever can write
    /// the database alone cannot rewrite the chain consistently.
    pub fn audit_key(&self) -> PathBuf {
        self.dir.join("audit.key")
    }

    /// The deployment's checkpoint key, where `$HARNESS_CHECKPOINT_KEY` does
    /// not give one (made on the first encrypted checkpoint;
    /// docs/checkpoint-encryption.md).
    pub fn checkpoint_key(&self) -> PathBuf {
        self.dir.join("checkpoint.key")
    }

    /// The audit chain's key ([`audit_key`](Self::audit_key)).
    pub fn chain_key(&self) -> Result<harness::core::log::ChainKey> {
        let path = self.audit_key();
        let secret = harness::broker::load_or_make_secret(&path)
            .with_context(|| format!("the audit key {}", path.display()))?;
        Ok(harness::core::log::ChainKey::new(secret))
    }

    /// The session log (the SQLite database), chaining frames with the
    /// home's audit key.
    pub fn open_log(&self) -> Result<harness::sqlite::SqliteSessionLog> {
        Ok(harness::sqlite::SqliteSessionLog::open(self.db())
            .context("opening the session log")?
            .with_chain_key(self.chain_key()?))
    }

    /// The SQLite database of the generic Durable Streams `harness serve`
    /// serves under `/v1/stream/*`.
    pub fn streams_db(&self) -> PathBuf {
        self.dir.join("streams.db")
    }

    /// Root of local sandboxes.
    pub fn sandboxes(&self) -> PathBuf {
        self.dir.join("sandboxes")
    }

    /// Where the Docker provider makes each container's exec directory
    /// (`DockerConfig::exec_dir`).
    pub fn docker_exec_dir(&self) -> PathBuf {
        self.dir.join("docker-exec")
    }

    /// Where this binary is linked under the helpers' names
    /// (`crate::helpers`).
    pub fn helpers(&self) -> PathBuf {
        self.dir.join("helpers")
    }

    /// Where the Docker base image's rootfs is kept (without
    /// `$HARNESS_CACHE`; `crate::image`).
    #[cfg_attr(not(feature = "docker"), allow(dead_code))]
    pub fn images(&self) -> PathBuf {
        self.dir.join("images")
    }

    /// The default checkpoint store (a directory store,
    /// `checkpoint_fs`), used when no other store is named.
    pub fn checkpoints(&self) -> PathBuf {
        self.dir.join("checkpoints")
    }

    /// Where downloaded agents go.
    pub fn agents(&self) -> PathBuf {
        self.dir.join("agents")
    }

    fn lock_file(&self) -> Result<File> {
        let path = self.dir.join("runtime.lock");
        std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .with_context(|| format!("opening {}", path.display()))
    }

    /// Take the home's runtime if nobody holds it.
    pub fn try_lock_runtime(&self) -> Result<Option<RuntimeLock>> {
        let file = self.lock_file()?;
        match file.try_lock() {
            Ok(()) => Ok(Some(RuntimeLock { _file: file })),
            Err(std::fs::TryLockError::WouldBlock) => Ok(None),
            Err(std::fs::TryLockError::Error(e)) => {
                Err(e).context("locking the home's runtime.lock")
            }
        }
    }

    /// Take the home's runtime, waiting (and saying so) while another
    /// process holds it.
    pub async fn lock_runtime(&self, what: &str) -> Result<RuntimeLock> {
        if let Some(lock) = self.try_lock_runtime()? {
            return Ok(lock);
        }
        eprintln!(
            "another harness process drives the sessions of {}; {what} waits for it to finish…",
            self.dir.display()
        );
        loop {
            tokio::time::sleep(Duration::from_millis(250)).await;
            if let Some(lock) = self.try_lock_runtime()? {
                return Ok(lock);
            }
        }
    }

    fn serve_path(&self) -> PathBuf {
        self.dir.join("serve.json")
    }

    /// What the running server published, if a server runs.
    pub fn serve_info(&self) -> Option<ServeInfo> {
        let bytes = std::fs::read(self.serve_path()).ok()?;
        serde_json::from_slice(&bytes).ok()
    }

    /// Publish this server (readable by the owner only: it holds a token).
    pub fn write_serve_info(&self, info: &ServeInfo) -> Result<()> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let path = self.serve_path();
        let tmp = path.with_extension("json.tmp");
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(true)
            .write(true)
            .mode(0o600)
            .open(&tmp)
            .with_context(|| format!("writing {}", tmp.display()))?;
        file.write_all(&serde_json::to_vec_pretty(info)?)?;
        std::fs::rename(&tmp, &path)?;
        Ok(())
    }

    /// Withdraw what this server published.
    pub fn remove_serve_info(&self) {
        let _ = std::fs::remove_file(self.serve_path());
    }
}
