//! # harness-broker
//!
//! The model broker: the host side of an agent's model access. The agent in
//! the sandbox holds a session token and the broker's address, never the
//! real key; the broker checks the token against the session the request
//! names, swaps in the real key, forwards the request to the provider (or
//! any `ANTHROPIC_BASE_URL` / `OPENAI_BASE_URL`) and streams the answer back
//! chunk by chunk, counting what the session used on the way.
//!
//! ```text
//!   sandbox                         host
//!   agent ──► 127.0.0.1:47811 ──► <dir>/sessions/<id>/model.sock ──► broker ──► provider
//!             (the gate's forward)                      token → key
//! ```
//!
//! Where it listens, all under one directory (`<home>/broker` for the CLI):
//!
//! ```text
//! <dir>/secret                 the HMAC key tokens derive from (0600, made once)
//! <dir>/sessions/<id>/model.sock  the session's own Unix socket, which its sandboxes
//!                              reach through a forward (the directory holds that
//!                              socket only: providers mount it); it answers that
//!                              session's token alone
//! <dir>/broker.json            the loopback TCP port, for sandboxes on the host network
//! <dir>/usage/<session>.json   what each session used
//! <dir>/active/<session>       sessions with a turn running: only their tokens open anything
//!                              (its mtime: when a slice or a model call last said so)
//! <dir>/policies/<session>.json, <dir>/egress/<session>/proxy.sock
//!                              a `custom` network policy and its egress proxy
//! <dir>/lock                   held by the one process that serves
//! ```
//!
//! Several processes may run slices over one directory (a `harness run`
//! next to a `harness serve`); the first one to take `<dir>/lock` serves,
//! the others hand out the same tokens and forwards, and take over the
//! serving when the holder exits (checked at every sandbox creation and
//! agent start). Tokens derive from the secret, so they survive restarts.
//!
//! See `docs/broker.md`.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use harness_core::audit::AuditRecord;
use harness_core::broker::{ModelBroker, Reach};
use harness_core::sandbox::{HostForward, NetworkPolicy, EGRESS_PROXY_PORT, MODEL_BROKER_PORT};
use harness_core::turn::{Budget, ModelUsage};
use harness_core::{Error, Result, SessionId};
use serde::{Deserialize, Serialize};

mod listeners;
mod proxy;
pub use harness_broker_proto::{token, usage, wire};

pub use usage::Usage;

pub use harness_broker_proto::wire::{ANTHROPIC_DEFAULT_URL, OPENAI_DEFAULT_URL};

/// One provider the broker forwards to.
#[derive(Clone)]
pub struct Upstream {
    /// Where requests go (`https://api.anthropic.com`, or a proxy's URL).
    pub base_url: String,
    /// The real key, added on the host side.
    pub api_key: String,
}

impl std::fmt::Debug for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the key.
        f.debug_struct("Upstream")
            .field("base_url", &self.base_url)
            .finish_non_exhaustive()
    }
}

/// How to start a broker.
#[derive(Debug, Clone)]
pub struct BrokerConfig {
    /// The broker's directory (see the crate docs).
    pub dir: PathBuf,
    /// Where Claude Code's requests go.
    pub anthropic: Option<Upstream>,
    /// Where Codex's requests go.
    pub openai: Option<Upstream>,
}

impl BrokerConfig {
    /// Upstreams from this process's environment: `ANTHROPIC_API_KEY` (and
    /// `ANTHROPIC_BASE_URL`), `OPENAI_API_KEY` (and `OPENAI_BASE_URL`). A
    /// provider without a key is not configured; its requests are refused
    /// with a message that says which variable to set.
    pub fn from_env(dir: impl Into<PathBuf>) -> Self {
        let env: BTreeMap<String, String> = harness_core::broker::CREDENTIAL_ENV_VARS
            .iter()
            .filter_map(|k| std::env::var(k).ok().map(|v| (k.to_string(), v)))
            .collect();
        Self::from_vars(dir, &env)
    }

    /// Upstreams from these variables (the same names as
    /// [`from_env`](Self::from_env)): what a runtime was given as its agents'
    /// environment.
    pub fn from_vars(dir: impl Into<PathBuf>, env: &BTreeMap<String, String>) -> Self {
        let var = |k: &str| env.get(k).filter(|v| !v.is_empty()).cloned();
        let upstream = |key: &str, url: &str, default: &str| {
            var(key).map(|api_key| Upstream {
                base_url: var(url).unwrap_or_else(|| default.to_string()),
                api_key,
            })
        };
        Self {
            dir: dir.into(),
            anthropic: upstream(
                "ANTHROPIC_API_KEY",
                "ANTHROPIC_BASE_URL",
                ANTHROPIC_DEFAULT_URL,
            ),
            openai: upstream("OPENAI_API_KEY", "OPENAI_BASE_URL", OPENAI_DEFAULT_URL),
        }
    }
}

/// Starts a process that serves the broker directory (for example
/// `harness broker serve --dir DIR` with the upstreams' variables in its
/// environment); called when no process serves it.
pub type SpawnServer = Arc<dyn Fn(&BrokerConfig) -> Result<()> + Send + Sync>;

/// What `broker.json` records.
#[derive(Debug, Default, Serialize, Deserialize)]
struct BrokerState {
    tcp_port: u16,
    /// The serving process.
    #[serde(default)]
    pid: u32,
    /// A digest of the serving process's upstreams (URLs and keys): a client
    /// with other upstreams replaces a detached server.
    #[serde(default)]
    upstreams: String,
}

impl BrokerConfig {
    /// A short digest of the upstreams (never the keys themselves).
    fn fingerprint(&self) -> String {
        use sha2::Digest;
        let mut h = sha2::Sha256::new();
        for u in [&self.anthropic, &self.openai] {
            match u {
                Some(u) => {
                    h.update(u.base_url.as_bytes());
                    h.update([0]);
                    h.update(u.api_key.as_bytes());
                    h.update([1]);
                }
                None => h.update([2]),
            }
        }
        hex::encode(&h.finalize()[..8])
    }
}

/// The model broker. Cheap to clone; once serving, it serves until
/// [`Broker::shutdown`] or the end of the tokio runtime.
#[derive(Debug, Clone)]
pub struct Broker {
    inner: Arc<Inner>,
}

struct Inner {
    dir: PathBuf,
    secret: Vec<u8>,
    /// How to start a serving process when none serves; `None`: serve here.
    spawn: Option<SpawnServer>,
    config: BrokerConfig,
    fingerprint: String,
    anthropic: Option<Upstream>,
    openai: Option<Upstream>,
    client: reqwest::Client,
    /// Serialises usage updates (read, add, write) in this process.
    usage_lock: Mutex<()>,
    /// The last index of each session's audit journal written by this
    /// process.
    journal_counts: Mutex<std::collections::HashMap<String, u64>>,
    /// This broker directory's journal id (`ModelBroker::journal_id`):
    /// derived from its secret, so stable across restarts and distinct
    /// between homes.
    journal_id: String,
    serving: tokio::sync::Mutex<Option<Serving>>,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Broker")
            .field("dir", &self.dir)
            .field("anthropic", &self.anthropic)
            .field("openai", &self.openai)
            .finish_non_exhaustive()
    }
}

/// The listeners of the process that holds the lock.
struct Serving {
    _lock: File,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    listeners: listeners::SessionListeners,
}

impl Drop for Serving {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl Broker {
    /// Open the broker directory (making it and its secret when new) and
    /// serve it in this process, unless another live process already does
    /// (then take over when that one exits).
    pub async fn start(config: BrokerConfig) -> Result<Broker> {
        let broker = Self::open(config, None)?;
        broker.ensure_served().await?;
        Ok(broker)
    }

    /// Open the broker directory and have a *detached* process serve it:
    /// when none does, `spawn` starts one (and one serving other upstreams
    /// is replaced). The broker then outlives this process, as the agents
    /// it serves do: a runner killed mid-turn does not cut its agent's
    /// model stream.
    pub async fn start_detached(config: BrokerConfig, spawn: SpawnServer) -> Result<Broker> {
        let broker = Self::open(config, Some(spawn))?;
        broker.ensure_served().await?;
        Ok(broker)
    }

    fn open(config: BrokerConfig, spawn: Option<SpawnServer>) -> Result<Broker> {
        let dir = config.dir.clone();
        for sub in [
            "", "sessions", "usage", "active", "policies", "egress", "budgets", "calls",
        ] {
            std::fs::create_dir_all(dir.join(sub))
                .map_err(|e| crate::ctx(e, format!("creating {}", dir.join(sub).display())))?;
        }
        // The directory holds the secret: only its owner may look in. The
        // socket directory must be reachable by a sandbox's (possibly
        // unprivileged) user, hence the search bit for all on the path to it.
        set_mode(&dir, 0o711)?;
        set_mode(&dir.join("sessions"), 0o711)?;
        for private in ["usage", "active", "policies", "budgets", "calls"] {
            set_mode(&dir.join(private), 0o700)?;
        }
        set_mode(&dir.join("egress"), 0o711)?;
        let secret = load_or_make_secret(&dir.join("secret"))?;
        let client = reqwest::Client::builder()
            .connect_timeout(std::time::Duration::from_secs(30))
            .build()
            .map_err(|e| Error::backend(format!("building the broker's HTTP client: {e}")))?;
        let fingerprint = config.fingerprint();
        let journal_id = {
            use sha2::Digest;
            let digest = sha2::Sha256::new()
                .chain_update(b"harness broker journal id\0")
                .chain_update(&secret)
                .finalize();
            hex::encode(&digest[..6])
        };
        let broker = Broker {
            inner: Arc::new(Inner {
                config: config.clone(),
                fingerprint,
                dir,
                spawn,
                secret,
                anthropic: config.anthropic,
                openai: config.openai,
                client,
                usage_lock: Mutex::new(()),
                journal_counts: Mutex::default(),
                journal_id,
                serving: tokio::sync::Mutex::new(None),
            }),
        };
        Ok(broker)
    }

    /// The broker directory.
    pub fn dir(&self) -> &Path {
        &self.inner.dir
    }

    /// The Unix socket the sandboxes of `session_id` reach through their
    /// forward (it answers that session alone).
    pub fn socket_path(&self, session_id: &str) -> PathBuf {
        session_socket(&self.inner.dir, session_id)
    }

    /// The token of `session_id`: what that session's agent holds.
    pub fn token(&self, session_id: &str) -> String {
        token::token_for(&self.inner.secret, session_id)
    }

    /// Whether this process is the one serving the directory now.
    pub async fn is_serving(&self) -> bool {
        self.inner.serving.lock().await.is_some()
    }

    /// The loopback TCP address of the broker (for sandboxes on the host
    /// network), as the serving process recorded it.
    pub fn tcp_addr(&self) -> Result<std::net::SocketAddr> {
        let state = read_state(&self.inner.dir)?;
        if state.tcp_port == 0 {
            return Err(Error::backend(format!(
                "the broker in {} has no TCP port on record: no process serves it",
                self.inner.dir.display()
            )));
        }
        Ok(std::net::SocketAddr::from(([127, 0, 0, 1], state.tcp_port)))
    }

    /// Open `session_id`'s endpoint: its token works from now on (a turn's
    /// agent starts). [`ModelBroker::agent_env`] does this.
    pub fn activate(&self, session_id: &str) -> Result<()> {
        let id = SessionId::parse(session_id)?;
        let path = mark_path(&self.inner.dir, id.as_str());
        std::fs::write(&path, b"").map_err(|e| ctx(e, format!("writing {}", path.display())))
    }

    /// Close `session_id`'s endpoint: its token opens nothing, in every
    /// process serving this directory, until the session's next turn
    /// starts. [`ModelBroker::turn_ended`] does this; so does the end of
    /// a session. Idempotent.
    pub fn revoke(&self, session_id: &str) -> Result<()> {
        let id = SessionId::parse(session_id)?;
        let path = mark_path(&self.inner.dir, id.as_str());
        match std::fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(ctx(e, format!("removing {}", path.display()))),
        }
    }

    /// What `session_id` used so far.
    pub fn usage(&self, session_id: &str) -> Result<Usage> {
        read_usage(&self.inner.dir, session_id)
    }

    /// Stop serving (close the listeners, release the lock) so another
    /// process may take over. Tokens and forwards keep working with it.
    pub async fn shutdown(&self) {
        self.inner.serving.lock().await.take();
    }

    /// Serve the directory if no live process does (the lock is free).
    pub async fn ensure_served(&self) -> Result<()> {
        if let Some(spawn) = &self.inner.spawn {
            return self.ensure_detached_server(spawn).await;
        }
        let mut serving = self.inner.serving.lock().await;
        if serving.is_none() {
            *serving = self.try_serve().await?;
        }
        if let Some(s) = serving.as_mut() {
            s.listeners.refresh(&self.inner);
        }
        Ok(())
    }

    /// The directory's lock file (held by the serving process), and its path.
    fn open_lock(&self) -> Result<(File, PathBuf)> {
        let path = self.inner.dir.join("lock");
        let file = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|e| crate::ctx(e, format!("opening {}", path.display())))?;
        Ok((file, path))
    }

    /// Whether some process holds the directory's lock (serves it).
    fn lock_is_held(&self) -> Result<bool> {
        let (lock, lock_path) = self.open_lock()?;
        match lock.try_lock() {
            Ok(()) => Ok(false), // free; released as `lock` drops
            Err(std::fs::TryLockError::WouldBlock) => Ok(true),
            Err(std::fs::TryLockError::Error(e)) => {
                Err(crate::ctx(e, format!("locking {}", lock_path.display())))
            }
        }
    }

    async fn ensure_detached_server(&self, spawn: &SpawnServer) -> Result<()> {
        // One client at a time decides (in this process).
        let _guard = self.inner.serving.lock().await;
        if self.lock_is_held()? {
            let state = read_state(&self.inner.dir).unwrap_or_default();
            if state.upstreams == self.inner.fingerprint || state.pid == 0 {
                return Ok(());
            }
            // A server with other keys or URLs: replace it (its agents'
            // streams are cut; they retry against the new one).
            tracing::info!(
                pid = state.pid,
                "the detached model broker serves other upstreams: replacing it"
            );
            let _ = std::process::Command::new("kill")
                .args(["-TERM", &state.pid.to_string()])
                .status();
            self.wait_for_lock(false).await?;
        }
        spawn(&self.inner.config)?;
        self.wait_for_lock(true).await
    }

    /// Wait (at most 10 s) until the lock is `held` or free.
    async fn wait_for_lock(&self, held: bool) -> Result<()> {
        for _ in 0..200 {
            if self.lock_is_held()? == held {
                return Ok(());
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        Err(Error::backend(format!(
            "the detached model broker of {} did not {} in 10 s (see {})",
            self.inner.dir.display(),
            if held { "start" } else { "stop" },
            self.inner.dir.join("broker.log").display()
        )))
    }

    /// Serve the directory in this process until it is idle (no session
    /// has a turn running) for `idle_exit`, or the directory is removed:
    /// the life of a detached broker (`harness broker serve`).
    ///
    /// A turn counts as running while its session's `active/` mark is
    /// younger than `stale_after`: the slice runner refreshes it at every
    /// slice ([`ModelBroker::turn_running`]) and the session's model calls
    /// refresh it too ([`MARK_REFRESH`]). A mark nobody refreshed for that
    /// long is a turn whose runner was killed and never came back (and
    /// whose agent is silent): it no longer keeps the broker up. Its token
    /// still opens the session's endpoint until the turn ends.
    pub async fn serve_until_idle(
        config: BrokerConfig,
        idle_exit: std::time::Duration,
        stale_after: std::time::Duration,
    ) -> Result<()> {
        let broker = Self::open(config, None)?;
        broker.ensure_served().await?;
        if !broker.is_serving().await {
            return Err(Error::conflict(format!(
                "another process serves the model broker of {}",
                broker.dir().display()
            )));
        }
        let mut idle_since = std::time::Instant::now();
        loop {
            tokio::time::sleep(std::time::Duration::from_millis(500)).await;
            if !broker.dir().join("secret").exists() {
                tracing::info!("the broker directory is gone: stopping");
                return Ok(());
            }
            if turns_running(broker.dir(), stale_after) {
                idle_since = std::time::Instant::now();
            } else if idle_since.elapsed() >= idle_exit {
                tracing::info!(idle = ?idle_exit, "no turn for a while: stopping");
                broker.shutdown().await;
                return Ok(());
            }
        }
    }

    async fn try_serve(&self) -> Result<Option<Serving>> {
        let dir = &self.inner.dir;
        let (lock, lock_path) = self.open_lock()?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                tracing::debug!(dir = %dir.display(), "another process serves the model broker");
                return Ok(None);
            }
            Err(std::fs::TryLockError::Error(e)) => {
                return Err(crate::ctx(e, format!("locking {}", lock_path.display())))
            }
        }
        let previous = read_state(dir).unwrap_or_default().tcp_port;
        let tcp = match tokio::net::TcpListener::bind(("127.0.0.1", previous)).await {
            Ok(l) if previous != 0 => l,
            _ => tokio::net::TcpListener::bind(("127.0.0.1", 0))
                .await
                .map_err(|e| crate::ctx(e, "listening on 127.0.0.1"))?,
        };
        let tcp_port = tcp.local_addr().map_err(Error::from)?.port();
        if previous != 0 && previous != tcp_port {
            tracing::warn!(previous, now = tcp_port, "the broker's TCP port changed: agents on the host network started before this get connection errors until their next turn");
        }
        write_state(
            dir,
            &BrokerState {
                tcp_port,
                pid: std::process::id(),
                upstreams: self.inner.fingerprint.clone(),
            },
        )?;
        let app = proxy::router(self.inner.clone(), None);
        // Another process may register a session or a policy (its
        // session's sandbox is made there, and waits for the socket): the
        // serving process picks it up as soon as the directories change
        // (inotify), and looks every quarter of a second in any case (a
        // watch that could not be set up, an overflowed event queue).
        let weak = Arc::downgrade(&self.inner);
        let mut changes = listeners::RegistrationWatch::new(dir);
        let tasks = vec![
            tokio::spawn(async move {
                loop {
                    changes.next(std::time::Duration::from_millis(250)).await;
                    let Some(inner) = weak.upgrade() else { break };
                    let mut serving = inner.serving.lock().await;
                    if let Some(s) = serving.as_mut() {
                        s.listeners.refresh(&inner);
                    }
                    drop(serving);
                }
            }),
            tokio::spawn(async move {
                if let Err(e) = axum::serve(tcp, app).await {
                    tracing::error!(error = %e, "the broker's TCP listener stopped serving");
                }
            }),
        ];
        tracing::info!(dir = %dir.display(), tcp_port, "model broker serving");
        Ok(Some(Serving {
            _lock: lock,
            tasks,
            listeners: listeners::SessionListeners::default(),
        }))
    }
}

#[async_trait]
impl ModelBroker for Broker {
    async fn forwards(
        &self,
        session_id: &str,
        network: &NetworkPolicy,
    ) -> Result<Vec<HostForward>> {
        let id = SessionId::parse(session_id)?;
        let socket = listeners::register(&self.inner.dir, id.as_str())?;
        let mut forwards = vec![HostForward {
            port: MODEL_BROKER_PORT,
            socket: socket.to_string_lossy().into_owned(),
        }];
        if let NetworkPolicy::Custom { .. } = network {
            let socket = listeners::register_policy(&self.inner.dir, id.as_str(), network)?;
            forwards.push(HostForward {
                port: EGRESS_PROXY_PORT,
                socket: socket.to_string_lossy().into_owned(),
            });
        }
        self.ensure_served().await?;
        if self.inner.spawn.is_some() {
            // The detached server binds the new sockets when it sees them
            // registered (at once through inotify, else on its next look):
            // have them before the sandbox is made (bounded at 5 s; a late
            // socket only costs the agent a retry).
            for _ in 0..1000 {
                if forwards.iter().all(|f| Path::new(&f.socket).exists()) {
                    break;
                }
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
        }
        Ok(forwards)
    }

    async fn agent_env(
        &self,
        session_id: &str,
        network: &NetworkPolicy,
        reach: Reach,
    ) -> Result<BTreeMap<String, String>> {
        let id = SessionId::parse(session_id)?;
        self.ensure_served().await?;
        let base = match reach {
            Reach::Forwarded => format!("http://127.0.0.1:{MODEL_BROKER_PORT}"),
            Reach::HostNetwork => format!("http://{}", self.tcp_addr()?),
        };
        let base = format!("{base}/s/{}", id.as_str());
        let token = self.token(id.as_str());
        self.activate(id.as_str())?;
        let mut env = wire::agent_env(&base, &token);
        if let NetworkPolicy::Custom { .. } = network {
            let proxy = format!("http://127.0.0.1:{EGRESS_PROXY_PORT}");
            for k in [
                "HTTP_PROXY",
                "HTTPS_PROXY",
                "ALL_PROXY",
                "http_proxy",
                "https_proxy",
                "all_proxy",
            ] {
                env.insert(k.to_string(), proxy.clone());
            }
            for k in ["NO_PROXY", "no_proxy"] {
                env.insert(k.to_string(), "127.0.0.1,localhost".to_string());
            }
        }
        Ok(env)
    }

    async fn turn_ended(&self, session_id: &str) -> Result<()> {
        self.revoke(session_id)
    }

    async fn turn_running(&self, session_id: &str) -> Result<()> {
        let id = SessionId::parse(session_id)?;
        self.ensure_served().await?;
        let path = mark_path(&self.inner.dir, id.as_str());
        match refresh_mark(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                Err(ctx(e, format!("refreshing {}", path.display())))
            }
            _ => Ok(()),
        }
    }

    async fn set_budget(&self, session_id: &str, budget: &Budget) -> Result<()> {
        let id = SessionId::parse(session_id)?;
        let path = budget_path(&self.inner.dir, id.as_str());
        if budget.is_unlimited() {
            return match std::fs::remove_file(&path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    Err(crate::ctx(e, format!("removing {}", path.display())))
                }
                _ => Ok(()),
            };
        }
        write_atomic(&path, &serde_json::to_vec_pretty(budget)?)
    }

    async fn usage(&self, session_id: &str) -> Result<Option<ModelUsage>> {
        Ok(Some(self.usage(session_id)?.model_usage()))
    }

    async fn model_calls(&self, session_id: &str) -> Result<Vec<AuditRecord>> {
        let id = SessionId::parse(session_id)?;
        let (journal, ack) = calls_paths(&self.inner.dir, id.as_str());
        let acknowledged: u64 = std::fs::read_to_string(&ack)
            .ok()
            .and_then(|t| t.trim().parse().ok())
            .unwrap_or(0);
        let text = match std::fs::read_to_string(&journal) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(crate::ctx(e, format!("reading {}", journal.display()))),
        };
        // A line cut by a crash mid-append is skipped: the call's usage is
        // in the session's totals either way.
        Ok(text
            .lines()
            .filter_map(|l| serde_json::from_str::<AuditRecord>(l).ok())
            .filter(|r| r.journal_index().is_some_and(|i| i > acknowledged))
            .collect())
    }

    fn journal_id(&self) -> Option<String> {
        Some(self.inner.journal_id.clone())
    }

    async fn model_calls_recorded(&self, session_id: &str, upto: u64) -> Result<()> {
        let id = SessionId::parse(session_id)?;
        let (_, ack) = calls_paths(&self.inner.dir, id.as_str());
        write_atomic(&ack, upto.to_string().as_bytes())
    }
}

/// The session's journal of brokered calls (`calls/<session>.jsonl`, one
/// [`AuditRecord::ModelCall`] a line) and the index up to which they are in
/// its log (`calls/<session>.ack`).
fn calls_paths(dir: &Path, session_id: &str) -> (PathBuf, PathBuf) {
    let calls = dir.join("calls");
    (
        calls.join(format!("{session_id}.jsonl")),
        calls.join(format!("{session_id}.ack")),
    )
}

/// The session's turn mark: there while a turn of it runs (its token opens
/// the endpoint), its mtime when a slice or a model call last said so.
fn mark_path(dir: &Path, session_id: &str) -> PathBuf {
    dir.join("active").join(session_id)
}

fn budget_path(dir: &Path, session_id: &str) -> PathBuf {
    dir.join("budgets").join(format!("{session_id}.json"))
}

/// The budget the session is held to (none when it has no file).
pub(crate) fn read_budget(dir: &Path, session_id: &str) -> Budget {
    std::fs::read(budget_path(dir, session_id))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default()
}

fn session_socket(dir: &Path, session_id: &str) -> PathBuf {
    dir.join("sessions").join(session_id).join("model.sock")
}

/// What `session_id` used, read from a broker directory (for tools that do
/// not run a broker themselves, such as `harness usage`).
pub fn read_usage(dir: &Path, session_id: &str) -> Result<Usage> {
    let id = SessionId::parse(session_id)?;
    let path = dir.join("usage").join(format!("{}.json", id.as_str()));
    match std::fs::read(&path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map_err(|e| Error::corrupt(format!("{}: {e}", path.display()))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Usage::default()),
        Err(e) => Err(crate::ctx(e, format!("reading {}", path.display()))),
    }
}

/// How long a session's `active/` mark counts as a turn running with
/// nothing refreshing it (`harness broker serve --stale-after`'s default).
pub const STALE_AFTER: std::time::Duration = std::time::Duration::from_secs(3600);

/// How often, at most, a session's model calls refresh its `active/` mark.
pub const MARK_REFRESH: std::time::Duration = std::time::Duration::from_secs(60);

/// Whether some session's `active/` mark in `dir` is younger than
/// `stale_after` (one whose age cannot be read counts as young).
fn turns_running(dir: &Path, stale_after: std::time::Duration) -> bool {
    let Ok(entries) = std::fs::read_dir(dir.join("active")) else {
        return false;
    };
    entries.flatten().any(|entry| {
        let age = entry
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok());
        age.is_none_or(|age| age < stale_after)
    })
}

/// Set the mark at `path` to now, if it exists (a mark is only ever made
/// by [`Broker::activate`]).
fn refresh_mark(path: &Path) -> std::io::Result<()> {
    File::options()
        .write(true)
        .open(path)?
        .set_modified(std::time::SystemTime::now())
}

impl Inner {
    /// Whether the session's token opens its endpoint (a turn is running);
    /// its mark is refreshed when older than [`MARK_REFRESH`].
    fn is_active(&self, session_id: &str) -> bool {
        let path = mark_path(&self.dir, session_id);
        let Ok(meta) = std::fs::metadata(&path) else {
            return false;
        };
        let age = meta.modified().ok().and_then(|t| t.elapsed().ok());
        if age.is_none_or(|age| age >= MARK_REFRESH) {
            let _ = refresh_mark(&path);
        }
        true
    }

    /// Append a record to the session's audit journal
    /// (`calls/<session>.jsonl`), numbered in order: model calls and egress
    /// decisions alike, as this process (the one serving the session's
    /// sockets) makes them.
    pub(crate) fn journal(&self, session_id: &str, record: impl FnOnce(u64) -> AuditRecord) {
        use std::io::Write;
        let (journal, _) = calls_paths(&self.dir, session_id);
        let mut counts = self
            .journal_counts
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let next = counts.entry(session_id.to_string()).or_insert_with(|| {
            // Numbering goes on from what the file holds (a restarted
            // broker).
            std::fs::read_to_string(&journal)
                .map(|t| t.lines().count() as u64)
                .unwrap_or(0)
        });
        *next += 1;
        let appended = serde_json::to_string(&record(*next))
            .map_err(Error::from)
            .and_then(|mut line| {
                line.push('\n');
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&journal)
                    .and_then(|mut f| f.write_all(line.as_bytes()))
                    .map_err(|e| crate::ctx(e, format!("appending to {}", journal.display())))
            });
        if let Err(e) = appended {
            tracing::warn!(error = %e, session.id = session_id, "could not journal an audit record");
        }
    }

    /// Add one exchange to the session's record (read, add, write, atomic)
    /// and, with `call` (its model and status), to its audit journal.
    fn record(&self, session_id: &str, add: &Usage, call: Option<(Option<String>, u16)>) {
        let _guard = self.usage_lock.lock().unwrap_or_else(|e| e.into_inner());
        let mut usage = read_usage(&self.dir, session_id).unwrap_or_default();
        usage.add(add);
        if let Some((model, status)) = call {
            self.journal(session_id, |index| AuditRecord::ModelCall {
                index,
                model,
                status,
                input_tokens: add.input_tokens,
                output_tokens: add.output_tokens,
                spend_micros: (add.unpriced_requests == 0).then_some(add.spend_micros),
            });
        }
        let path = self.dir.join("usage").join(format!("{session_id}.json"));
        if let Err(e) = write_atomic(
            &path,
            &serde_json::to_vec_pretty(&usage).unwrap_or_default(),
        ) {
            tracing::warn!(error = %e, session.id = session_id, "could not record the session's model usage");
        }
    }
}

/// An I/O error with what was being done, keeping its kind.
pub(crate) fn ctx(e: impl Into<Error>, what: impl std::fmt::Display) -> Error {
    let e: Error = e.into();
    Error::new(e.kind(), format!("{what}: {}", e.message()))
}

pub(crate) fn set_mode(path: &Path, mode: u32) -> Result<()> {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(|e| crate::ctx(e, format!("setting the mode of {}", path.display())))
}

/// A secret of at least 32 random bytes in the file `path` (mode 0600),
/// made when missing. Several processes may call it at once: the first one
/// to make the file wins and every caller gets its bytes. The broker's
/// token secret is one; the audit chain's key (`<home>/audit.key`) another.
pub fn load_or_make_secret(path: &Path) -> Result<Vec<u8>> {
    match std::fs::read(path) {
        Ok(s) if s.len() >= 32 => return Ok(s),
        Ok(_) => {
            return Err(Error::corrupt(format!(
                "{} is shorter than 32 bytes: remove it to make a new one (every session token changes)",
                path.display()
            )))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(crate::ctx(e, format!("reading {}", path.display()))),
    }
    // Two v4 UUIDs: 244 random bits from the OS generator.
    let mut secret = uuid::Uuid::new_v4().as_bytes().to_vec();
    secret.extend_from_slice(uuid::Uuid::new_v4().as_bytes());
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode_0600()
            .open(&tmp)
            .map_err(|e| crate::ctx(e, format!("creating {}", tmp.display())))?;
        f.write_all(&secret).map_err(Error::from)?;
        f.sync_all().map_err(Error::from)?;
    }
    // Another process may have made one meanwhile: the first one wins, so
    // every process derives the same tokens.
    match std::fs::hard_link(&tmp, path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            return Err(crate::ctx(e, format!("writing {}", path.display())));
        }
    }
    let _ = std::fs::remove_file(&tmp);
    std::fs::read(path).map_err(Error::from)
}

trait Mode0600 {
    fn mode_0600(&mut self) -> &mut Self;
}

impl Mode0600 for std::fs::OpenOptions {
    fn mode_0600(&mut self) -> &mut Self {
        use std::os::unix::fs::OpenOptionsExt;
        self.mode(0o600)
    }
}

fn read_state(dir: &Path) -> Result<BrokerState> {
    let path = dir.join("broker.json");
    match std::fs::read(&path) {
        Ok(b) => serde_json::from_slice(&b)
            .map_err(|e| Error::corrupt(format!("{}: {e}", path.display()))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(BrokerState::default()),
        Err(e) => Err(Error::from(e)),
    }
}

fn write_state(dir: &Path, state: &BrokerState) -> Result<()> {
    write_atomic(&dir.join("broker.json"), &serde_json::to_vec(state)?)
}

pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, bytes).map_err(|e| crate::ctx(e, format!("writing {}", tmp.display())))?;
    std::fs::rename(&tmp, path)
        .map_err(|e| crate::ctx(e, format!("renaming onto {}", path.display())))
}

/// The variables the broker's env replaces, for callers that build their
/// own environment.
pub use harness_core::broker::CREDENTIAL_ENV_VARS;
