//! # sandbox-local
//!
//! A [`SandboxProvider`] whose sandboxes are directories on the host and
//! whose commands are host processes. It is the fastest backend and the one
//! to develop against; it is **not a security boundary**: a command can read
//! and write anything the host user can. Under `allow-all` it reaches any
//! network the host can; under `deny-all` and `custom` every command runs
//! through `harness-sandbox-gate` in a fresh network namespace of its own
//! (loopback only, plus the spec's host forwards), which needs root or
//! `CAP_SYS_ADMIN`. See `docs/sandbox-local.md` for the full story.
//!
//! Layout under the provider root (default `$HARNESS_CACHE/local-sandboxes`):
//!
//! ```text
//! <root>/<id>/sandbox.json   metadata (env, ports, workdir, network, forwards) read by resume
//! <root>/<id>/work/          the workdir (unless wrap-mode names another)
//! <root>/<id>/home/          $HOME for every command
//! <root>/<id>/opt/...        bootstrap recipe files (`/opt/x` lands here)
//! <root>/templates/<bs-id>/  a finished bootstrap template
//! <root>/templates/<bs-id>.lock
//! ```
//!
//! Paths given to file operations and `cwd` are host paths: relative ones are
//! joined onto the workdir, absolute ones are used as they are. The spec's
//! `workdir` is only recorded (as the `spec_workdir` label in the metadata);
//! the real workdir is always the host directory above, and
//! [`Sandbox::workdir`] and the handle report that host path.
//!
//! ```no_run
//! # async fn demo() -> harness_core::Result<()> {
//! use harness_core::sandbox::{collect_exec, ExecRequest, SandboxProvider, SandboxSpec};
//! let provider = sandbox_local::LocalProvider::new("/tmp/sandboxes");
//! let sandbox = provider.create(&SandboxSpec::new("/workspace")).await?;
//! let out = collect_exec(sandbox.exec(ExecRequest::shell("echo hi > f; cat f")).await?).await?;
//! assert_eq!(out.stdout_str(), "hi\n");
//! let json = serde_json::to_string(&sandbox.detach().await?)?;
//! // ... later, maybe in another process:
//! let again = provider.resume(&serde_json::from_str(&json)?).await?;
//! again.destroy().await?;
//! # Ok(()) }
//! ```

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use futures::StreamExt;
use harness_core::sandbox::{
    detached_status_by_exec, kill_detached_by_exec, parse_detached_status, resolve_path,
    DetachedProcess, DetachedStatus, ExecRequest, ExecStream, HostForward, NetworkPolicy,
    PortEndpoint, Sandbox, SandboxHandle, SandboxProvider, SandboxSpec, SnapshotInfo, TreeListing,
    EGRESS_PROXY_PORT,
};
use harness_core::stream::ByteStream;
use harness_core::{Error, ErrorKind, Result};
use harness_tario as tario;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncSeekExt, AsyncWriteExt};
use tokio_util::io::ReaderStream;
use watch::WatchedTree;

mod exec;
mod listing;
mod seal;
mod template;
mod watch;

/// The host variables a command inherits; everything else of the host
/// process's environment is left out (the spec's and the request's `env`
/// are added on top).
pub const INHERITED_ENV: &[&str] = &[
    "PATH",
    "LANG",
    "LANGUAGE",
    "LC_ALL",
    "LC_CTYPE",
    "LC_MESSAGES",
    "TZ",
    "TERM",
    "USER",
    "LOGNAME",
    "SHELL",
    "TMPDIR",
    "SSL_CERT_FILE",
    "SSL_CERT_DIR",
    "http_proxy",
    "https_proxy",
    "no_proxy",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "NO_PROXY",
];

pub use seal::{BWRAP_ENV, DEFAULT_UID, UID_ENV};

/// Chooses the isolation of new local sandboxes (`sealed` or `host`) for
/// providers made with [`LocalProvider::new`] / [`LocalProvider::from_env`].
pub const ISOLATION_ENV: &str = "HARNESS_LOCAL_ISOLATION";

/// What separates a local sandbox's commands from the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Isolation {
    /// Host processes as the harness's own user, in the host's file
    /// system: not a boundary (the default, and what runs where Linux
    /// namespaces do not).
    #[default]
    Host,
    /// A boundary: an unprivileged uid, namespaces of its own held by a
    /// per-sandbox `bwrap`, cgroup limits (`docs/sandbox-local.md`,
    /// *Sealed*). Refused with the reason where the host cannot.
    Sealed,
}

impl Isolation {
    /// [`ISOLATION_ENV`], else `Host`; an unknown value is an error.
    pub fn from_env() -> Result<Self> {
        match std::env::var(ISOLATION_ENV) {
            Err(_) => Ok(Self::Host),
            Ok(v) => v.parse(),
        }
    }
}

impl std::str::FromStr for Isolation {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim() {
            "" | "host" => Ok(Self::Host),
            "sealed" => Ok(Self::Sealed),
            other => Err(Error::invalid(format!(
                "{ISOLATION_ENV}={other:?}: expected `sealed` or `host`"
            ))),
        }
    }
}

/// The provider name recorded in handles.
pub const PROVIDER_NAME: &str = "local";
/// Name of the metadata file in a sandbox directory.
const META_FILE: &str = "sandbox.json";
/// Chunk size of file reads.
const FILE_CHUNK: usize = 256 * 1024;

/// Ready copies of each bootstrap template a provider keeps by default.
pub const DEFAULT_POOL_SIZE: usize = 1;

/// Creates sandboxes as directories under a root directory.
#[derive(Debug, Clone)]
pub struct LocalProvider {
    root: PathBuf,
    /// Ready copies kept per bootstrap template (`with_pool_size`).
    pool_size: usize,
    gate: Option<PathBuf>,
    watch_trees: bool,
    isolation: Isolation,
    /// An unreadable [`ISOLATION_ENV`], reported by `create`.
    isolation_error: Option<String>,
}

impl LocalProvider {
    /// What sealing `spec` needs (its tools and the sandbox's uid and gid),
    /// checked before anything is made: a host that cannot seal refuses, it
    /// never runs unsealed. `None` on the host isolation.
    fn sealing(&self, spec: &SandboxSpec) -> Result<Option<(seal::Tools, u32, u32)>> {
        if self.isolation == Isolation::Host {
            return Ok(None);
        }
        let tools = seal::Tools::find(&spec.network)?;
        let (uid, gid) = seal::sandbox_ids()?;
        if spec.wrap.is_some() && nix::unistd::geteuid().is_root() {
            return Err(Error::unsupported(
                "a sealed local sandbox cannot wrap a directory while the harness runs \
                 as root: its commands run as an unprivileged uid, which would have to \
                 own the directory; run the harness as the directory's owner, or copy it \
                 in",
            ));
        }
        Ok(Some((tools, uid, gid)))
    }

    /// Fill the new sandbox's directory from the bootstrap template when
    /// `spec` has a recipe (a pooled copy when one is ready), returning the
    /// template's identity; without a recipe the sandbox starts empty.
    async fn start_from_template(&self, spec: &SandboxSpec, dir: &Path) -> Result<Option<String>> {
        let Some(recipe) = spec.bootstrap.clone().filter(|r| !r.is_empty()) else {
            return Ok(None);
        };
        let root = self.root.clone();
        let env = spec.env.clone();
        let target = dir.to_path_buf();
        let pooled = self.pool_size > 0;
        let made = tokio::task::spawn_blocking(move || -> Result<String> {
            let (identity, template) = template::ensure(&root, &recipe, &env)?;
            if !(pooled && template::take_pooled(&root, &identity, &target)) {
                template::copy_tree(&template, &target)?;
            }
            Ok(identity)
        })
        .await
        .map_err(|e| Error::backend(format!("bootstrap task failed: {e}")))?;
        match made {
            Ok(identity) => {
                self.refill_pool(&identity);
                Ok(Some(identity))
            }
            Err(e) => {
                let _ = tokio::fs::remove_dir_all(dir).await;
                Err(e)
            }
        }
    }

    /// A provider keeping its sandboxes and templates under `root`. Its
    /// deny-all and custom-policy sandboxes use the gate
    /// [`harness_sandbox_gate::locate`] finds (`$HARNESS_SANDBOX_GATE_BIN`,
    /// else `harness-sandbox-gate` beside the current executable) unless
    /// [`with_gate`](Self::with_gate) names one.
    ///
    /// Its sandboxes keep a tree's listing between tree checkpoints and
    /// learn what changed from inotify (see
    /// [`with_tree_watch`](Self::with_tree_watch)), unless
    /// `HARNESS_LOCAL_TREE_WATCH=0` is set.
    ///
    /// Its sandboxes' isolation is [`ISOLATION_ENV`]'s (default
    /// [`Isolation::Host`]) unless [`with_isolation`](Self::with_isolation)
    /// sets it.
    pub fn new(root: impl Into<PathBuf>) -> Self {
        let (isolation, isolation_error) = match Isolation::from_env() {
            Ok(i) => (i, None),
            Err(e) => (Isolation::Host, Some(e.message().to_string())),
        };
        Self {
            root: root.into(),
            pool_size: DEFAULT_POOL_SIZE,
            gate: None,
            watch_trees: std::env::var_os("HARNESS_LOCAL_TREE_WATCH").is_none_or(|v| v != "0"),
            isolation,
            isolation_error,
        }
    }

    /// Make new sandboxes with this isolation.
    pub fn with_isolation(mut self, isolation: Isolation) -> Self {
        self.isolation = isolation;
        self.isolation_error = None;
        self
    }

    /// The isolation of the sandboxes this provider creates.
    pub fn isolation(&self) -> Isolation {
        self.isolation
    }

    /// Whether [`Sandbox::list_tree`] keeps the listing of the directory it
    /// last listed and watches it with inotify, so that the next listing
    /// (a re-checkpoint's) reads again only the directories that changed
    /// (`docs/sandbox-local.md`, *A watched tree listing*). On by default.
    /// inotify does not report a write through a shared memory mapping
    /// after the file's last `close`, nor a write through a hard link from
    /// outside the tree; turn this off for trees written that way, and
    /// every listing stats every path.
    pub fn with_tree_watch(mut self, watch: bool) -> Self {
        self.watch_trees = watch;
        self
    }

    /// Keep up to `n` ready copies of each bootstrap template (default
    /// [`DEFAULT_POOL_SIZE`]; 0 turns the pool off). A session's sandbox
    /// then starts from a copy made in the background after the previous
    /// create, taken with one `rename`, instead of copying the template
    /// (the agent's binary, ~400 MB for Claude Code) while the session
    /// waits. Each ready copy costs the template's size on disk.
    pub fn with_pool_size(mut self, n: usize) -> Self {
        self.pool_size = n;
        self
    }

    /// Run deny-all and custom-policy commands through this
    /// `harness-sandbox-gate` binary.
    pub fn with_gate(mut self, gate: impl Into<PathBuf>) -> Self {
        self.gate = Some(gate.into());
        self
    }

    /// Top `identity`'s pool up to the pool size in the background (at
    /// most one fill per identity at a time, across processes).
    fn refill_pool(&self, identity: &str) {
        if self.pool_size == 0 {
            return;
        }
        let (root, identity, size) = (self.root.clone(), identity.to_string(), self.pool_size);
        tokio::task::spawn_blocking(move || {
            if let Err(e) = template::fill_pool(&root, &identity, size) {
                tracing::warn!(error = %e, identity = %identity, "could not refill the local sandbox pool; the next sandbox copies its template");
            }
        });
    }

    /// How many ready copies of bootstrap template `identity` the pool
    /// holds now (for tests and benchmarks).
    pub fn pool_ready(&self, identity: &str) -> usize {
        template::pool_ready(&self.root, identity)
    }

    /// The sandbox in `dir`, as this provider makes them.
    fn sandbox(&self, dir: PathBuf, meta: Meta, gate: Option<PathBuf>) -> Result<Box<dyn Sandbox>> {
        Ok(Box::new(LocalSandbox::new(
            dir,
            meta,
            gate,
            self.watch_trees,
        )?))
    }

    /// The gate binary this provider uses: the one given to
    /// [`with_gate`](Self::with_gate), else what
    /// [`harness_sandbox_gate::locate`] finds now.
    pub fn gate(&self) -> Option<PathBuf> {
        self.gate.clone().or_else(harness_sandbox_gate::locate)
    }

    /// A provider under the default root: `$HARNESS_CACHE/local-sandboxes`,
    /// else `$XDG_CACHE_HOME/harness/local-sandboxes`, else
    /// `$HOME/.cache/harness/local-sandboxes`.
    pub fn from_env() -> Result<Self> {
        Ok(Self::new(default_root()?))
    }

    /// The root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    fn sandbox_dir(&self, id: &str) -> PathBuf {
        self.root.join(id)
    }
}

/// See [`LocalProvider::from_env`].
pub fn default_root() -> Result<PathBuf> {
    if let Some(cache) = std::env::var_os("HARNESS_CACHE").filter(|v| !v.is_empty()) {
        return Ok(PathBuf::from(cache).join("local-sandboxes"));
    }
    if let Some(xdg) = std::env::var_os("XDG_CACHE_HOME").filter(|v| !v.is_empty()) {
        return Ok(PathBuf::from(xdg).join("harness/local-sandboxes"));
    }
    if let Some(home) = std::env::var_os("HOME").filter(|v| !v.is_empty()) {
        return Ok(PathBuf::from(home).join(".cache/harness/local-sandboxes"));
    }
    Err(Error::invalid(
        "no root for local sandboxes: set HARNESS_CACHE (or HOME)",
    ))
}

/// What `sandbox.json` holds: everything `resume` needs besides the handle.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Meta {
    id: String,
    workdir: String,
    home: String,
    #[serde(default)]
    env: BTreeMap<String, String>,
    #[serde(default)]
    ports: Vec<u16>,
    owned: bool,
    #[serde(default)]
    labels: BTreeMap<String, String>,
    #[serde(default)]
    bootstrap_identity: Option<String>,
    /// Metadata written before network policies existed here is allow-all,
    /// the only policy accepted then.
    #[serde(default)]
    network: NetworkPolicy,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    forwards: Vec<HostForward>,
    /// The gate binary `create` used: `resume` falls back to it when its
    /// own provider has none configured or found.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    gate: Option<String>,
    /// Set for a sealed sandbox: its holder, uid and cgroups.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    seal: Option<seal::SealMeta>,
}

/// Keep only characters safe in a directory name.
fn sanitize(s: &str) -> String {
    harness_core::sandbox::name_part(s)
        .trim_matches('-')
        .to_string()
}

/// Whether commands under `policy` run in the host's network namespace.
fn host_network(policy: &NetworkPolicy) -> bool {
    matches!(policy, NetworkPolicy::AllowAll)
}

/// What a missing gate means, naming every way to provide one.
fn no_gate(policy: &NetworkPolicy, detail: &str) -> Error {
    Error::unsupported(format!(
        "the local sandbox enforces network policy {} with harness-sandbox-gate (a network \
         namespace per command), and {detail}: set {}, put {} beside this executable, or use \
         LocalProvider::with_gate",
        policy_name(policy),
        harness_sandbox_gate::BIN_ENV,
        harness_sandbox_gate::BINARY_NAME,
    ))
}

fn policy_name(policy: &NetworkPolicy) -> &'static str {
    match policy {
        NetworkPolicy::AllowAll => "allow-all",
        NetworkPolicy::DenyAll => "deny-all",
        NetworkPolicy::Custom { .. } => "custom",
    }
}

/// Check the spec's network, ports and forwards; the gate to run commands
/// through (`None` under allow-all, where commands are plain host
/// processes).
async fn network_plan(spec: &SandboxSpec, gate: Option<PathBuf>) -> Result<Option<PathBuf>> {
    if host_network(&spec.network) {
        if !spec.forwards.is_empty() {
            return Err(Error::unsupported(format!(
                "the local sandbox under allow-all runs commands in the host's own network \
                 namespace, so it takes no forwards ({:?}): reach host services at their host \
                 address instead",
                spec.forwards.iter().map(|f| f.port).collect::<Vec<_>>()
            )));
        }
        return Ok(None);
    }
    check_forwards(spec)?;
    if !spec.ports.is_empty() {
        return Err(Error::unsupported(format!(
            "the local sandbox cannot expose ports {:?} under {}: each command runs in a network \
             namespace of its own that nothing on the host can reach; use allow-all, or the \
             docker backend",
            spec.ports,
            policy_name(&spec.network)
        )));
    }
    let Some(gate) = gate else {
        return Err(no_gate(&spec.network, "none was found"));
    };
    if !gate.is_file() {
        return Err(no_gate(
            &spec.network,
            &format!("{} does not exist", gate.display()),
        ));
    }
    probe_gate(&gate).await?;
    Ok(Some(gate))
}

/// The spec's forwards are well formed, and a custom policy has the
/// egress proxy's.
fn check_forwards(spec: &SandboxSpec) -> Result<()> {
    spec.check_forwards()?;
    let ports: Vec<u16> = spec.forwards.iter().map(|f| f.port).collect();
    if matches!(spec.network, NetworkPolicy::Custom { .. }) && !ports.contains(&EGRESS_PROXY_PORT) {
        return Err(Error::invalid(format!(
            "custom network policy needs the egress proxy forward on port {EGRESS_PROXY_PORT}; \
             the harness runtime adds it when a model broker is configured"
        )));
    }
    Ok(())
}

/// The sealed sandbox's network check: its own network namespace under
/// every policy (`allow-all` through slirp4netns), forwards under every
/// policy (the model broker's among them), no ports. The gate, when there
/// are forwards, serves them.
fn sealed_network_plan(spec: &SandboxSpec, gate: Option<PathBuf>) -> Result<Option<PathBuf>> {
    check_forwards(spec)?;
    if !spec.ports.is_empty() {
        return Err(Error::unsupported(format!(
            "a sealed local sandbox exposes no ports ({:?}): its network namespace is its own; \
             use the docker backend for ports",
            spec.ports
        )));
    }
    if spec.forwards.is_empty() {
        return Ok(None);
    }
    match gate {
        Some(gate) if gate.is_file() => Ok(Some(gate)),
        Some(gate) => Err(no_gate(
            &spec.network,
            &format!("{} does not exist", gate.display()),
        )),
        None => Err(no_gate(&spec.network, "none was found")),
    }
}

/// Run `gate --unshare-net -- true` once, so a host where namespaces
/// cannot be made refuses at `create` rather than failing every command.
async fn probe_gate(gate: &Path) -> Result<()> {
    let run = tokio::process::Command::new(gate)
        .args(["--unshare-net", "--", "true"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .output();
    let out = match tokio::time::timeout(std::time::Duration::from_secs(20), run).await {
        Ok(Ok(out)) => out,
        Ok(Err(e)) => {
            return Err(Error::unsupported(format!(
                "cannot run the sandbox gate {}: {e}",
                gate.display()
            )))
        }
        Err(_) => {
            return Err(Error::backend(format!(
                "the sandbox gate {} did not answer within 20 s",
                gate.display()
            )))
        }
    };
    if out.status.success() {
        return Ok(());
    }
    let stderr = String::from_utf8_lossy(&out.stderr).trim().to_string();
    if out.status.code() == Some(harness_sandbox_gate::EXIT_GATE_FAILED) {
        // Not allowed to make a namespace, or no `ip`: this host cannot
        // enforce the policy.
        Err(Error::unsupported(stderr))
    } else {
        Err(Error::backend(format!(
            "the sandbox gate {} failed its check ({}): {stderr}",
            gate.display(),
            out.status
        )))
    }
}

#[async_trait]
impl SandboxProvider for LocalProvider {
    fn name(&self) -> &'static str {
        PROVIDER_NAME
    }

    fn shares_host_network(&self, network: &NetworkPolicy) -> bool {
        self.isolation == Isolation::Host && host_network(network)
    }

    async fn create(&self, spec: &SandboxSpec) -> Result<Box<dyn Sandbox>> {
        if let Some(e) = &self.isolation_error {
            return Err(Error::invalid(e.clone()));
        }
        let sealing = self.sealing(spec)?;
        let gate = match sealing {
            Some(_) => sealed_network_plan(spec, self.gate())?,
            None => network_plan(spec, self.gate()).await?,
        };
        let wrap = wrap_dir(spec).await?;
        let (id, in_slot) = sandbox_id(spec);
        let dir = self.sandbox_dir(&id);
        tokio::fs::create_dir_all(&self.root).await?;
        if in_slot && tokio::fs::symlink_metadata(&dir).await.is_ok() {
            // A creator killed before it recorded this slot's sandbox left
            // it: nothing refers to it, so it is replaced, not kept beside.
            tracing::info!(sandbox.id = %id, "replacing the sandbox a killed creator left in this slot");
            remove_all(&dir).await?;
        }

        let identity = self.start_from_template(spec, &dir).await?;
        let home = dir.join("home");
        let work = match &wrap {
            Some(path) => path.clone(),
            None => dir.join("work"),
        };
        tokio::fs::create_dir_all(&home).await?;
        tokio::fs::create_dir_all(&work).await?;
        let seal = match sealing {
            Some((tools, uid, gid)) => {
                let started = start_seal(
                    tools,
                    dir.clone(),
                    wrap.clone(),
                    spec.network.clone(),
                    spec.forwards.clone(),
                    gate.clone(),
                    (uid, gid),
                    (spec.memory_mb, spec.cpus),
                )
                .await;
                match started {
                    Ok(seal) => Some(seal),
                    Err(e) => {
                        let _ = remove_all(&dir).await;
                        return Err(e);
                    }
                }
            }
            None => None,
        };

        let mut labels = spec.labels.clone();
        labels.insert("spec_workdir".into(), spec.workdir.clone());
        if let Some(session) = &spec.session_id {
            labels.insert("session_id".into(), session.clone());
        }
        let meta = Meta {
            id: id.clone(),
            workdir: path_string(&work)?,
            home: path_string(&home)?,
            env: spec.env.clone(),
            ports: spec.ports.clone(),
            owned: wrap.is_none(),
            labels,
            bootstrap_identity: identity,
            network: spec.network.clone(),
            forwards: spec.forwards.clone(),
            gate: gate.as_deref().map(path_string).transpose()?,
            seal,
        };
        // Written last and atomically: a directory with `sandbox.json` is a
        // complete sandbox, which is what `resume` checks.
        if let Err(e) = write_meta(&dir, &meta).await {
            if let Some(seal) = &meta.seal {
                seal::stop(seal);
            }
            return Err(e);
        }
        // A sealed sandbox's commands join its holder; the gate only
        // served its forwards.
        let run_gate = if meta.seal.is_some() { None } else { gate };
        self.sandbox(dir, meta, run_gate)
    }

    async fn resume(&self, handle: &SandboxHandle) -> Result<Box<dyn Sandbox>> {
        if handle.provider != PROVIDER_NAME {
            return Err(Error::invalid(format!(
                "handle belongs to provider {:?}, not {PROVIDER_NAME:?}",
                handle.provider
            )));
        }
        // The handle names its directory, so a provider with another root
        // (or another process) can still resume it.
        let dir = match handle.data.get("dir").and_then(|d| d.as_str()) {
            Some(d) => PathBuf::from(d),
            None => {
                if sanitize(&handle.id) != handle.id {
                    return Err(Error::invalid(format!(
                        "malformed local sandbox id {:?}",
                        handle.id
                    )));
                }
                self.sandbox_dir(&handle.id)
            }
        };
        let raw = match tokio::fs::read(dir.join(META_FILE)).await {
            Ok(raw) => raw,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(Error::not_found(format!(
                    "local sandbox {} does not exist (destroyed, or never created): no {}",
                    handle.id,
                    dir.join(META_FILE).display()
                )))
            }
            Err(e) => return Err(e.into()),
        };
        let meta: Meta = serde_json::from_slice(&raw)?;
        if meta.id != handle.id {
            return Err(Error::invalid(format!(
                "handle id {:?} does not match the sandbox at {} ({:?})",
                handle.id,
                dir.display(),
                meta.id
            )));
        }
        if !Path::new(&meta.workdir).is_dir() {
            return Err(Error::not_found(format!(
                "workdir {} of local sandbox {} is gone",
                meta.workdir, meta.id
            )));
        }
        let mut meta = meta;
        if let Some(old) = meta.seal.clone() {
            // Sealed: never run a command outside its namespaces. A holder
            // gone with its processes (the host restarted) is made again
            // around the same directories.
            if !seal::alive(&old) {
                let tools = seal::Tools::find(&meta.network)?;
                let gate = meta.gate.as_ref().map(PathBuf::from);
                let wrap = (!meta.owned).then(|| PathBuf::from(&meta.workdir));
                let seal = start_seal(
                    tools,
                    dir.clone(),
                    wrap,
                    meta.network.clone(),
                    meta.forwards.clone(),
                    gate,
                    (old.uid, old.gid),
                    (old.memory_mb, old.cpus),
                )
                .await?;
                meta.seal = Some(seal);
                write_meta(&dir, &meta).await?;
            }
            return self.sandbox(dir, meta, None);
        }
        // A restricted sandbox never runs a command without its gate: this
        // provider's, else the one `create` used.
        let gate = if host_network(&meta.network) {
            None
        } else {
            let gate = self.gate().filter(|g| g.is_file()).or_else(|| {
                meta.gate
                    .as_ref()
                    .map(PathBuf::from)
                    .filter(|g| g.is_file())
            });
            match gate {
                Some(gate) => Some(gate),
                None => {
                    return Err(no_gate(
                        &meta.network,
                        &format!("none was found to resume sandbox {}", meta.id),
                    ))
                }
            }
        };
        self.sandbox(dir, meta, gate)
    }

    async fn list_snapshots(&self) -> Result<Vec<SnapshotInfo>> {
        let root = self.root.clone();
        tokio::task::spawn_blocking(move || template::list(&root))
            .await
            .map_err(|e| Error::backend(format!("listing templates failed: {e}")))?
    }

    async fn prune_snapshots(&self, keep: &[String]) -> Result<Vec<SnapshotInfo>> {
        let root = self.root.clone();
        let keep = keep.to_vec();
        tokio::task::spawn_blocking(move || template::prune(&root, &keep))
            .await
            .map_err(|e| Error::backend(format!("pruning templates failed: {e}")))?
    }
}

/// The caller's directory `spec` wraps, checked: an absolute path to an
/// existing directory.
async fn wrap_dir(spec: &SandboxSpec) -> Result<Option<PathBuf>> {
    let Some(path) = &spec.wrap else {
        return Ok(None);
    };
    let path = PathBuf::from(path);
    if !path.is_absolute() {
        return Err(Error::invalid(format!(
            "wrap directory {} must be an absolute host path",
            path.display()
        )));
    }
    if !tokio::fs::metadata(&path)
        .await
        .map(|m| m.is_dir())
        .unwrap_or(false)
    {
        return Err(Error::not_found(format!(
            "wrap directory {} does not exist",
            path.display()
        )));
    }
    Ok(Some(path))
}

/// A new sandbox's id: `<session>-<slot>` for a session's slot (the same
/// id each time, so a creator killed before recording it is found again;
/// `true`), else the session (or `sbx`) and a random suffix.
fn sandbox_id(spec: &SandboxSpec) -> (String, bool) {
    let prefix = spec
        .session_id
        .as_deref()
        .map(sanitize)
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "sbx".to_string());
    let slot = spec
        .slot
        .as_deref()
        .map(sanitize)
        .filter(|s| !s.is_empty() && spec.session_id.is_some());
    match slot {
        Some(slot) => (format!("{prefix}-{slot}"), true),
        None => (
            format!(
                "{prefix}-{}",
                &uuid::Uuid::new_v4().simple().to_string()[..12]
            ),
            false,
        ),
    }
}

/// Write `sandbox.json` atomically (a directory with it is a complete
/// sandbox).
async fn write_meta(dir: &Path, meta: &Meta) -> Result<()> {
    let tmp = dir.join(format!(".{META_FILE}.tmp"));
    tokio::fs::write(&tmp, serde_json::to_vec_pretty(meta)?).await?;
    tokio::fs::rename(&tmp, dir.join(META_FILE)).await?;
    Ok(())
}

/// Hand the sandbox's directories to its uid and start its holder.
#[allow(clippy::too_many_arguments)]
async fn start_seal(
    tools: seal::Tools,
    dir: PathBuf,
    wrap: Option<PathBuf>,
    network: NetworkPolicy,
    forwards: Vec<HostForward>,
    gate: Option<PathBuf>,
    (uid, gid): (u32, u32),
    (memory_mb, cpus): (Option<u64>, Option<f64>),
) -> Result<seal::SealMeta> {
    tokio::task::spawn_blocking(move || {
        // The sandbox's /tmp is a directory of its own (bound there), so
        // the harness reads and writes it as it does the rest.
        let tmp = dir.join("tmp");
        std::fs::create_dir_all(&tmp)?;
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o1777))?;
        // Everything the sandbox sees of its directory, bound at its host
        // path; `sandbox.json` and the seal's own files stay outside.
        let mut binds = Vec::new();
        for entry in std::fs::read_dir(&dir)? {
            let entry = entry?;
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if name == META_FILE || name == seal::SEAL_DIR || name.starts_with('.') {
                continue;
            }
            seal::own(&entry.path(), uid, gid)?;
            binds.push(entry.path());
        }
        if let Some(wrap) = wrap {
            binds.push(wrap);
        }
        seal::start(
            &tools,
            &seal::HolderPlan {
                dir: &dir,
                binds,
                network: &network,
                forwards: &forwards,
                gate: gate.as_deref(),
                uid,
                gid,
                memory_mb,
                cpus,
            },
        )
    })
    .await
    .map_err(|e| Error::backend(format!("starting the sealed sandbox failed: {e}")))?
}

fn path_string(p: &Path) -> Result<String> {
    p.to_str()
        .map(str::to_string)
        .ok_or_else(|| Error::invalid(format!("path {} is not UTF-8", p.display())))
}

/// A sandbox directory on the host. See the crate docs.
#[derive(Debug)]
pub struct LocalSandbox {
    dir: PathBuf,
    meta: Meta,
    /// Set exactly when the policy is not allow-all: every command runs
    /// through it.
    gate: Option<String>,
    /// The last listed directory's listing and watch (`None` inside when
    /// nothing is watched); absent when the provider turned watching off.
    tree_watch: Option<Arc<Mutex<Option<WatchedTree>>>>,
    /// Set exactly when the sandbox is sealed: the `nsenter` every command
    /// joins the holder's namespaces with.
    nsenter: Option<PathBuf>,
}

impl LocalSandbox {
    fn new(dir: PathBuf, meta: Meta, gate: Option<PathBuf>, watch_trees: bool) -> Result<Self> {
        path_string(&dir)?;
        let gate = gate.as_deref().map(path_string).transpose()?;
        let nsenter = match &meta.seal {
            Some(_) => Some(seal::nsenter()?),
            None => None,
        };
        Ok(Self {
            dir,
            meta,
            gate,
            tree_watch: watch_trees.then(|| Arc::new(Mutex::new(None))),
            nsenter,
        })
    }

    /// Whether the sandbox is sealed (see [`Isolation::Sealed`]).
    pub fn is_sealed(&self) -> bool {
        self.meta.seal.is_some()
    }

    /// Hand `path` (and the directories above it up to the sandbox's own)
    /// to a sealed sandbox's uid after the harness wrote it; `recursive`
    /// for a tree the harness unpacked.
    async fn own(&self, path: PathBuf, recursive: bool) -> Result<()> {
        let Some(seal) = &self.meta.seal else {
            return Ok(());
        };
        let (uid, gid) = (seal.uid, seal.gid);
        let stop = [self.dir.clone(), PathBuf::from(&self.meta.workdir)];
        tokio::task::spawn_blocking(move || {
            if recursive {
                seal::own(&path, uid, gid)?;
            } else {
                seal::own_one(&path, uid, gid)?;
            }
            let mut up = path.parent();
            while let Some(dir) = up {
                if stop.iter().any(|s| s.as_path() == dir)
                    || !stop.iter().any(|s| dir.starts_with(s))
                {
                    break;
                }
                seal::own_one(dir, uid, gid)?;
                up = dir.parent();
            }
            Ok(())
        })
        .await
        .map_err(|e| Error::backend(format!("handing files to the sandbox failed: {e}")))?
    }

    /// The sandbox's network policy.
    pub fn network(&self) -> &NetworkPolicy {
        &self.meta.network
    }

    /// The gate its commands run through (`None` under allow-all).
    pub fn gate(&self) -> Option<&Path> {
        self.gate.as_deref().map(Path::new)
    }

    /// `argv` as it is spawned: through the gate (a network namespace of
    /// its own, plus the forwards) unless the policy is allow-all.
    fn gated(&self, argv: Vec<String>) -> Vec<String> {
        match &self.gate {
            None => argv,
            Some(gate) => {
                let forwards: Vec<harness_sandbox_gate::Forward> = self
                    .meta
                    .forwards
                    .iter()
                    .map(|f| harness_sandbox_gate::Forward::new(f.port, f.socket.clone()))
                    .collect();
                harness_sandbox_gate::command_line(gate, true, &forwards, &argv)
            }
        }
    }

    /// The sandbox's own directory (`<root>/<id>`), parent of `home/`.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The bootstrap identity this sandbox started from, if any.
    pub fn bootstrap_identity(&self) -> Option<&str> {
        self.meta.bootstrap_identity.as_deref()
    }

    /// `dir` resolved, if it is a directory (what an export reads).
    async fn export_dir(&self, dir: &str) -> Result<PathBuf> {
        let full = self.reach(dir)?;
        match tokio::fs::metadata(&full).await {
            Ok(m) if m.is_dir() => Ok(full),
            Ok(_) => Err(Error::invalid(format!(
                "{} is not a directory",
                full.display()
            ))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(Error::not_found(format!(
                "{} does not exist",
                full.display()
            ))),
            Err(e) => Err(e.into()),
        }
    }

    fn resolve(&self, path: &str) -> PathBuf {
        PathBuf::from(resolve_path(&self.meta.workdir, path))
    }

    /// Where the harness reads or writes `path` for a file operation: the
    /// host path itself, except in a sealed sandbox, whose `/tmp` is its
    /// own `<dir>/tmp` and which reaches nothing outside its directories
    /// (the harness acts for the sandbox, with the sandbox's reach).
    fn reach(&self, path: &str) -> Result<PathBuf> {
        let full = self.resolve(path);
        if self.meta.seal.is_none() {
            return Ok(full);
        }
        // The sandbox's own directories first: they may lie under the
        // host's /tmp themselves.
        let own = full.starts_with(&self.dir) || full.starts_with(&self.meta.workdir);
        let host = match full.strip_prefix("/tmp") {
            Ok(rest) if !own => self.dir.join("tmp").join(rest),
            _ => full.clone(),
        };
        let inside_dir = host.strip_prefix(&self.dir).ok().and_then(|rest| {
            let first = rest.components().next()?;
            let name = first.as_os_str().to_string_lossy();
            (name != META_FILE && name != seal::SEAL_DIR && !name.starts_with('.')).then_some(())
        });
        if inside_dir.is_some() || (!self.meta.owned && host.starts_with(&self.meta.workdir)) {
            Ok(host)
        } else {
            Err(Error::new(
                ErrorKind::Unsafe,
                format!(
                    "{} is outside the sealed sandbox (its directories under {}, and /tmp)",
                    full.display(),
                    self.dir.display()
                ),
            ))
        }
    }

    fn env_for(&self, extra: &BTreeMap<String, String>) -> Vec<(String, String)> {
        // Commands start from an empty environment plus these few host
        // variables: the host process's own environment (model keys among
        // them) never reaches a sandbox by inheritance.
        let mut env: Vec<(String, String)> = INHERITED_ENV
            .iter()
            .filter_map(|k| std::env::var(k).ok().map(|v| (k.to_string(), v)))
            .collect();
        env.extend([
            ("HOME".to_string(), self.meta.home.clone()),
            (
                "HARNESS_SANDBOX_ROOT".to_string(),
                self.dir.to_string_lossy().into_owned(),
            ),
        ]);
        // Later entries win: spec env, then the request's.
        env.extend(self.meta.env.iter().map(|(k, v)| (k.clone(), v.clone())));
        env.extend(extra.iter().map(|(k, v)| (k.clone(), v.clone())));
        env
    }
}

#[async_trait]
impl Sandbox for LocalSandbox {
    fn handle(&self) -> SandboxHandle {
        SandboxHandle {
            provider: PROVIDER_NAME.to_string(),
            id: self.meta.id.clone(),
            workdir: self.meta.workdir.clone(),
            owned: self.meta.owned,
            data: serde_json::json!({ "dir": self.dir.to_string_lossy() }),
        }
    }

    fn workdir(&self) -> &str {
        &self.meta.workdir
    }

    fn home_hint(&self) -> Option<String> {
        // What `env_for` gives every command: the spec's HOME over the
        // sandbox's own.
        Some(
            self.meta
                .env
                .get("HOME")
                .cloned()
                .unwrap_or_else(|| self.meta.home.clone()),
        )
    }

    async fn exec(&self, request: ExecRequest) -> Result<ExecStream> {
        let cwd = match &request.cwd {
            Some(c) => self.resolve(c),
            None => PathBuf::from(&self.meta.workdir),
        };
        let env = self.env_for(&request.env);
        if self.gate.is_some() {
            // The gate would report a missing program only as exit 127:
            // say NotFound up front, as an ungated spawn does.
            exec::check_program(&request.argv, &cwd, &env)?;
        }
        if let (Some(seal), Some(nsenter)) = (&self.meta.seal, &self.nsenter) {
            let seen = self.reach(&cwd.display().to_string())?;
            if !seen.is_dir() {
                return Err(Error::not_found(format!(
                    "working directory {} does not exist",
                    cwd.display()
                )));
            }
            exec::check_program(&request.argv, &seen, &env)?;
            let argv = seal::command(nsenter, seal, &cwd, &request.argv);
            let oom_before = seal.memory_mb.and_then(|_| seal::oom_kills(seal));
            let stream = exec::spawn(exec::Launch {
                argv: &argv,
                cwd: Path::new("/"),
                env,
                stdin: request.stdin,
                timeout: request.timeout,
                abort: request.abort,
            })?;
            return Ok(match oom_before {
                Some(before) => report_oom(stream, seal.clone(), before),
                None => stream,
            });
        }
        let argv = self.gated(request.argv);
        exec::spawn(exec::Launch {
            argv: &argv,
            cwd: &cwd,
            env,
            stdin: request.stdin,
            timeout: request.timeout,
            abort: request.abort,
        })
    }

    async fn read_file(&self, path: &str) -> Result<ByteStream> {
        self.read_file_from(path, 0).await
    }

    async fn read_file_from(&self, path: &str, offset: u64) -> Result<ByteStream> {
        let full = self.reach(path)?;
        let mut file = tokio::fs::File::open(&full).await.map_err(|e| {
            let err = Error::from(e);
            Error::new(err.kind(), format!("{}: {}", full.display(), err.message()))
        })?;
        if file.metadata().await?.is_dir() {
            return Err(Error::invalid(format!(
                "{} is a directory, not a file",
                full.display()
            )));
        }
        if offset > 0 {
            file.seek(std::io::SeekFrom::Start(offset)).await?;
        }
        Ok(Box::pin(
            ReaderStream::with_capacity(file, FILE_CHUNK).map(|r| r.map_err(Error::from)),
        ))
    }

    async fn write_file(&self, path: &str, mut content: ByteStream) -> Result<u64> {
        let full = self.reach(path)?;
        let parent = full
            .parent()
            .ok_or_else(|| Error::invalid(format!("cannot write to {}", full.display())))?
            .to_path_buf();
        let name = full
            .file_name()
            .ok_or_else(|| Error::invalid(format!("{} names no file", full.display())))?
            .to_string_lossy()
            .into_owned();
        tokio::fs::create_dir_all(&parent).await?;
        // Write beside the target and rename, so a failed stream leaves the
        // old file (or no file) rather than a truncated one.
        let tmp = parent.join(format!(".{name}.tmp-{}", uuid::Uuid::new_v4().simple()));
        let result = async {
            let mut file = tokio::fs::File::create(&tmp).await?;
            let mut written = 0u64;
            while let Some(chunk) = content.next().await {
                let chunk = chunk?;
                file.write_all(&chunk).await?;
                written += chunk.len() as u64;
            }
            file.flush().await?;
            if let Ok(old) = tokio::fs::metadata(&full).await {
                if old.is_dir() {
                    return Err(Error::invalid(format!(
                        "{} is a directory, not a file",
                        full.display()
                    )));
                }
                // Replacing a file keeps its mode (an executable stays one).
                tokio::fs::set_permissions(&tmp, old.permissions()).await?;
            }
            tokio::fs::rename(&tmp, &full).await?;
            Ok::<_, Error>(written)
        }
        .await;
        if result.is_err() {
            let _ = tokio::fs::remove_file(&tmp).await;
        }
        let written = result?;
        self.own(full, false).await?;
        Ok(written)
    }

    async fn export_tar(&self, dir: &str) -> Result<ByteStream> {
        Ok(tario::export(self.export_dir(dir).await?))
    }

    async fn import_tar(&self, dir: &str, tar: ByteStream) -> Result<()> {
        let full = self.reach(dir)?;
        tario::import(full.clone(), tar).await?;
        self.own(full, true).await
    }

    /// Built in-process, as `export_tar` is: no exec.
    async fn export_paths_tar(&self, dir: &str, paths: &[String]) -> Result<ByteStream> {
        Ok(tario::export_paths(
            self.export_dir(dir).await?,
            paths.to_vec(),
        ))
    }

    fn stages_tar_imports(&self) -> bool {
        true
    }

    /// Each import unpacks on a blocking thread of its own: as many at
    /// once as the machine has cores.
    fn parallel_imports(&self) -> usize {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    }

    /// `lstat` in-process, on a few threads; the directory listed last is
    /// kept and watched, and listed again from its inotify events
    /// ([`LocalProvider::with_tree_watch`]). `Unsupported` when the
    /// sandbox's `tar` is not GNU tar (the trait's promise).
    async fn list_tree(&self, dir: &str) -> Result<TreeListing> {
        let full = self.reach(dir)?;
        let env = self.env_for(&BTreeMap::new());
        let tree_watch = self.tree_watch.clone();
        tokio::task::spawn_blocking(move || {
            if !listing::has_gnu_tar(&env) {
                return Err(Error::unsupported(
                    "the sandbox's tar is not GNU tar: tree checkpoints read whole trees here",
                ));
            }
            match tree_watch {
                Some(kept) => watch::watched_listing(&kept, &full),
                None => listing::list_tree(&full),
            }
        })
        .await
        .map_err(|e| Error::backend(format!("tree listing task failed: {e}")))?
    }

    async fn import_tar_staged(&self, dir: &str, tar: ByteStream) -> Result<()> {
        let full = self.reach(dir)?;
        tario::import_staged(full.clone(), tar).await?;
        self.own(full, true).await
    }

    async fn port_endpoint(&self, port: u16) -> Result<PortEndpoint> {
        // Commands share the host's network, so a port inside is the same
        // port on the host.
        if self.meta.ports.contains(&port) {
            Ok(PortEndpoint {
                sandbox_port: port,
                host: "127.0.0.1".to_string(),
                port,
            })
        } else {
            Err(Error::not_found(format!(
                "port {port} was not listed in the spec's ports {:?}",
                self.meta.ports
            )))
        }
    }

    async fn detached_status(&self, process: &DetachedProcess) -> Result<DetachedStatus> {
        if self.is_sealed() {
            // Its pid is a pid of the sandbox's own PID namespace.
            return detached_status_by_exec(self, process).await;
        }
        match tokio::fs::read_to_string(self.resolve(&process.exit_path)).await {
            Ok(text) => return parse_detached_status(&text),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e.into()),
        }
        let pid: i32 = process.id.parse().map_err(|_| {
            Error::invalid(format!("detached process id {:?} is not a pid", process.id))
        })?;
        // A zombie is not running: when the init of this machine does not
        // reap orphans, `kill -0` (the shell default) would call it alive.
        match process_state(pid).await {
            Some(state) if state != 'Z' && state != 'X' => return Ok(DetachedStatus::Running),
            _ => {}
        }
        // Gone — but it may have written its exit file and exited between the
        // first read and the process check; only a process gone without an
        // exit file is lost.
        match tokio::fs::read_to_string(self.resolve(&process.exit_path)).await {
            Ok(text) => parse_detached_status(&text),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(DetachedStatus::Lost),
            Err(e) => Err(e.into()),
        }
    }

    async fn kill_detached(&self, process: &DetachedProcess) -> Result<()> {
        if self.is_sealed() {
            return kill_detached_by_exec(self, process).await;
        }
        // Native instead of the shell default: killpg on the host needs no
        // shell process per kill. The launch script made the process a
        // session and group leader, so its pid is the group id.
        let pid: i32 = process.id.parse().map_err(|_| {
            Error::invalid(format!("detached process id {:?} is not a pid", process.id))
        })?;
        if pid <= 1 {
            return Err(Error::invalid(format!(
                "refusing to kill process group {pid}"
            )));
        }
        let pgid = nix::unistd::Pid::from_raw(pid);
        if nix::sys::signal::killpg(pgid, None).is_err() {
            return Ok(());
        }
        let _ = nix::sys::signal::killpg(pgid, nix::sys::signal::Signal::SIGTERM);
        // Give the agent a moment to exit cleanly, then make sure. (Members
        // may linger as zombies, so SIGKILL is sent regardless: it is a
        // no-op for what already exited.)
        for _ in 0..20 {
            match process_state(pid).await {
                Some(state) if state != 'Z' && state != 'X' => {}
                _ => break,
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        exec::kill_group(pgid);
        Ok(())
    }

    async fn stop(&self) -> Result<SandboxHandle> {
        Err(Error::unsupported(
            "the local sandbox cannot be stopped: its processes are host processes; use detach \
             (the directory persists) or destroy",
        ))
    }

    async fn destroy(&self) -> Result<()> {
        if let Some(seal) = self.meta.seal.clone() {
            tokio::task::spawn_blocking(move || seal::stop(&seal))
                .await
                .map_err(|e| Error::backend(format!("stopping the sealed sandbox failed: {e}")))?;
        }
        // In wrap-mode the workdir is the caller's directory outside
        // `<root>/<id>`, so removing our directory (home, metadata) leaves it.
        remove_all(&self.dir).await
    }
}

/// Pass `stream` on; when it ends with a SIGKILL and the sandbox's cgroup
/// counted a new OOM kill meanwhile, say so on stderr before the exit: the
/// memory limit, not something else, ended the command.
fn report_oom(stream: ExecStream, seal: seal::SealMeta, before: u64) -> ExecStream {
    Box::pin(stream.flat_map(move |event| {
        let mut out = Vec::with_capacity(2);
        if let Ok(harness_core::sandbox::ExecEvent::Exit(status)) = &event {
            let kills = seal::oom_kills(&seal).unwrap_or(before);
            if status.signal == Some(9) && kills > before {
                out.push(Ok(harness_core::sandbox::ExecEvent::Stderr(
                    format!(
                        "harness: the sandbox's memory limit ({} MiB) was reached; the kernel \
                         killed a process of this command\n",
                        seal.memory_mb.unwrap_or_default()
                    )
                    .into(),
                )));
            }
        }
        out.push(event);
        futures::stream::iter(out)
    }))
}

/// The state letter of `/proc/<pid>/stat` (`R`, `S`, `Z`, …), `None` when
/// there is no such process.
async fn process_state(pid: i32) -> Option<char> {
    let stat = tokio::fs::read_to_string(format!("/proc/{pid}/stat"))
        .await
        .ok()?;
    // The command name is in parentheses and may contain spaces: the state
    // follows the last ')'.
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

/// `remove_dir_all` where a missing directory is success (destroy is
/// idempotent).
async fn remove_all(dir: &Path) -> Result<()> {
    use backon::{ConstantBuilder, Retryable};
    // A process of the sandbox that is still ending (a detached agent
    // writing its exit file) can add an entry to a directory between its
    // listing and its removal: ten more tries 20 ms apart, then the error.
    let pauses = ConstantBuilder::new()
        .with_delay(std::time::Duration::from_millis(20))
        .with_max_times(10);
    let result = (|| tokio::fs::remove_dir_all(dir))
        .retry(pauses)
        .sleep(tokio::time::sleep)
        .when(|e: &std::io::Error| e.kind() == std::io::ErrorKind::DirectoryNotEmpty)
        .await;
    match result {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => {
            let err = Error::from(e);
            Err(Error::new(
                if err.kind() == ErrorKind::NotFound {
                    ErrorKind::Io
                } else {
                    err.kind()
                },
                format!("removing {}: {}", dir.display(), err.message()),
            ))
        }
    }
}
