//! # sandbox-docker
//!
//! A [`SandboxProvider`] on the Docker engine, through `bollard`: every
//! sandbox is a container running a tiny idle init; commands run through the
//! exec API in their own process group (so abort and timeout kill the whole
//! tree); files move through the archive endpoints as streams; bootstrap
//! recipes run once per identity and are kept as committed images
//! (`harness-snapshot:<identity>`).
//!
//! ```no_run
//! use harness_core::sandbox::{collect_exec, ExecRequest, SandboxProvider, SandboxSpec};
//! use sandbox_docker::{DockerConfig, DockerProvider};
//!
//! # async fn demo() -> harness_core::Result<()> {
//! let provider = DockerProvider::connect(DockerConfig {
//!     default_image: "harness-test:bookworm".into(),
//!     ..DockerConfig::default()
//! })
//! .await?;
//! let sandbox = provider.create(&SandboxSpec::new("/work")).await?;
//! let out = collect_exec(sandbox.exec(ExecRequest::shell("echo hi")).await?).await?;
//! assert_eq!(out.stdout_str(), "hi\n");
//! sandbox.destroy().await?;
//! # Ok(())
//! # }
//! ```
//!
//! Deny-all and custom policies run the container with `--network none`;
//! the spec's host forwards reach the container's loopback through
//! `harness-sandbox-gate`, bind-mounted with the sockets' directories (see
//! [`DockerConfig::gate`]).
//!
//! See `docs/sandbox-docker.md` for the network-policy stance, forwards,
//! ports, wrap-mode, snapshots and resume semantics.

pub mod base_image;
mod bootstrap;
mod exec;
mod exec_server;
mod forward_dirs;
mod host_import;
mod pool;
mod snapshot;
mod tarfile;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bollard::errors::Error as BollardError;
use bollard::models::{ContainerCreateBody, HostConfig, PortBinding};
use bollard::query_parameters::{
    CreateContainerOptionsBuilder, DownloadFromContainerOptionsBuilder,
    RemoveContainerOptionsBuilder, RenameContainerOptionsBuilder, StopContainerOptionsBuilder,
    UploadToContainerOptionsBuilder,
};
use bollard::Docker;
use bytes::{Bytes, BytesMut};
use futures::StreamExt;
use harness_core::sandbox::{
    collect_exec, export_tar_by_exec, extract_tar_failure, extract_tar_script,
    poll_detached_by_exec, resolve_path, shell_quote, DetachedProcess, DetachedStatus, ExecRequest,
    ExecStream, NetworkPolicy, PortEndpoint, Sandbox, SandboxHandle, SandboxProvider, SandboxSpec,
    SnapshotInfo, EGRESS_PROXY_PORT,
};
use harness_core::stream::ByteStream;
use harness_core::tarscan;
use harness_core::{Error, ErrorKind, Result};
use serde_json::json;

/// The provider name recorded in handles.
pub const PROVIDER_NAME: &str = "docker";

/// The idle init every sandbox container runs: it exits at once on SIGTERM
/// (so `stop` takes milliseconds, not the 10 s kill grace) and otherwise
/// sleeps forever.
const INIT_SCRIPT: &str = "trap 'exit 0' TERM; while :; do sleep 3600 & wait; done";

/// The init of a container with an exec directory: it starts the gate's
/// exec server there first (`exec_server`; a gate that cannot run in the
/// image leaves the commands to the engine's exec), then idles as
/// [`INIT_SCRIPT`] does.
fn init_with_exec_server() -> String {
    format!(
        "{GATE_IN_CONTAINER} --exec-server {} >/dev/null 2>&1; {INIT_SCRIPT}",
        exec_server::socket_in_container()
    )
}

pub use exec_server::DIR_IN_CONTAINER as EXEC_DIR_IN_CONTAINER;

/// Contents up to this size are written with one archive upload; larger
/// (or unknown-length) ones stream through an exec's stdin.
const SMALL_WRITE: usize = 1024 * 1024;

/// Where the gate binary is mounted in a container with forwards.
pub const GATE_IN_CONTAINER: &str = "/run/harness/gate";
/// Where the directory of the `n`th forwarded socket is mounted:
/// `<FORWARD_DIRS_IN_CONTAINER>/<n>`.
pub const FORWARD_DIRS_IN_CONTAINER: &str = "/run/harness/forward";

/// A host path mounted into every container the provider creates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BindMount {
    /// Absolute path on the host.
    pub host: String,
    /// Absolute path inside the container.
    pub container: String,
    /// Mount read-only.
    pub read_only: bool,
}

impl From<(String, String, bool)> for BindMount {
    fn from((host, container, read_only): (String, String, bool)) -> Self {
        Self {
            host,
            container,
            read_only,
        }
    }
}

/// How the provider reaches Docker and names what it makes.
#[derive(Debug, Clone)]
pub struct DockerConfig {
    /// Image for specs that name none.
    pub default_image: String,
    /// Prefix of every label the provider sets (`<prefix>.managed-by`, …).
    pub label_prefix: String,
    /// Repository of bootstrap snapshot images (`<repo>:<identity>`).
    pub snapshot_repo: String,
    /// Directory of the bootstrap lock files (one per identity).
    pub lock_dir: PathBuf,
    /// Host paths mounted into every created container (e.g. a large agent
    /// binary, read-only, instead of copying it).
    pub bind_mounts: Vec<BindMount>,
    /// Seconds `stop` waits after SIGTERM before SIGKILL.
    pub stop_timeout_secs: i32,
    /// The `harness-sandbox-gate` binary on the Docker host, mounted
    /// read-only at [`GATE_IN_CONTAINER`] into containers whose spec has
    /// forwards (every command there runs through it). It must run in the
    /// container's image: the gate is a dynamically linked glibc program, so
    /// the image needs a glibc at least as new as the build host's. `None`:
    /// [`harness_sandbox_gate::locate`] (`$HARNESS_SANDBOX_GATE_BIN`, else
    /// `harness-sandbox-gate` beside the current executable).
    pub gate: Option<PathBuf>,
    /// Ready containers kept per spec shape (0, the default: no pool). With
    /// `n > 0`, after every `create` the provider starts containers of the
    /// same shape in the background until `n` are ready, and a later
    /// `create` of exactly that shape (image or bootstrap identity, workdir,
    /// env, limits, network policy, ports, forwards, labels, session id)
    /// takes one instead of creating and starting a container. A destroyed
    /// sandbox never goes back to the pool. Pooled containers are removed by
    /// [`DockerProvider::shutdown`], best effort when the last clone of the
    /// provider is dropped, and, when their process died, by the next
    /// [`DockerProvider::connect`] (see `docs/sandbox-docker.md`, "Pool").
    pub pool_size: usize,
    /// At most this many shapes are pooled at once (default 4): a create of
    /// a new shape beyond it drops the least recently used shape's ready
    /// containers.
    pub pool_max_shapes: usize,
    /// How long a fill waits before it creates a container (default 1 s).
    /// A fill follows every create of a shape, so it would otherwise run
    /// while the session that just took (or made) a container starts its
    /// agent — dockerd's create and start competing with that start for
    /// the CPU (on two cores: +30 ms launch, +66 ms agent start in `bench
    /// ready`, docs/performance.md). Zero: at once.
    pub pool_refill_delay: Duration,
    /// Set, pooled containers serve any session: a shape leaves out the
    /// session id, and a pooled container mounts forward directories of
    /// its own, kept here (`<dir>/<pool name>/<n>`), into which a session's
    /// sockets move when it takes the container (`docs/sandbox-docker.md`,
    /// "Pool"). It must be on the filesystem of the forwards' sockets.
    /// `None` (the default): the session id is part of the shape, so a
    /// session only ever takes a container pooled for itself.
    pub pool_forward_dir: Option<PathBuf>,
    /// Make [`default_image`](Self::default_image) on this machine when a
    /// spec that names no image needs it and it is missing (or of another
    /// recipe): a debootstrapped Debian, no registry needed
    /// ([`base_image`]). `None`: a missing default image is an error.
    pub make_default_image: Option<MakeImage>,
    /// Write tar imports (restores, forks, rehydrations) from this host
    /// into the container's root when this process shares the engine's
    /// host and may (`host_import`; `docs/sandbox-docker.md`, "Imports
    /// from the host"); else, and when `false`, GNU tar in the container
    /// extracts them through an exec. Default `true`.
    pub host_imports: bool,
    /// Set, every session container gets an exec directory of its own
    /// here (`<dir>/exec-<id>/dir`, mounted at [`EXEC_DIR_IN_CONTAINER`]),
    /// the gate is mounted, and the container's init starts the gate's
    /// exec server in that directory: commands then go over one Unix
    /// connection each instead of the engine's exec API (about 1 ms
    /// against 60–70 ms; `docs/sandbox-docker.md`, "Commands through the
    /// exec server"), falling back to the engine's exec whenever the
    /// server cannot be reached. It must be on this host, where the engine
    /// can mount it. `None` (the default): every command through the
    /// engine's exec.
    pub exec_dir: Option<PathBuf>,
}

/// How to make the default image ([`DockerConfig::make_default_image`]).
#[derive(Clone)]
pub struct MakeImage {
    /// The root filesystem's recipe.
    pub rootfs: base_image::Rootfs,
    /// Where the rootfs tar is kept between builds.
    pub cache: PathBuf,
    /// Told each stage of a build (it takes about a minute the first time).
    pub progress: Arc<dyn Fn(&str) + Send + Sync>,
}

impl MakeImage {
    /// This host's Debian recipe, cached in `cache`, stages logged.
    pub fn for_host(cache: impl Into<PathBuf>) -> Self {
        Self {
            rootfs: base_image::Rootfs::for_host(),
            cache: cache.into(),
            progress: Arc::new(|line| tracing::info!("docker base image: {line}")),
        }
    }
}

impl std::fmt::Debug for MakeImage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MakeImage")
            .field("rootfs", &self.rootfs)
            .field("cache", &self.cache)
            .finish_non_exhaustive()
    }
}

impl Default for DockerConfig {
    /// [`base_image::DEFAULT_IMAGE`] (made on first use, its rootfs kept in
    /// `$HARNESS_CACHE/images`), labels under `dev.harness`, snapshots in
    /// `harness-snapshot`, locks in `$HARNESS_CACHE/locks` (or the temp dir
    /// for both).
    fn default() -> Self {
        let cache = std::env::var_os("HARNESS_CACHE")
            .map(PathBuf::from)
            .unwrap_or_else(|| std::env::temp_dir().join("harness"));
        Self {
            default_image: base_image::DEFAULT_IMAGE.into(),
            make_default_image: Some(MakeImage::for_host(cache.join("images"))),
            label_prefix: "dev.harness".into(),
            snapshot_repo: "harness-snapshot".into(),
            lock_dir: cache.join("locks"),
            bind_mounts: Vec::new(),
            stop_timeout_secs: 5,
            gate: None,
            pool_size: 0,
            pool_max_shapes: 4,
            pool_refill_delay: Duration::from_secs(1),
            pool_forward_dir: None,
            host_imports: true,
            exec_dir: None,
        }
    }
}

/// The directories of containers' own under `config` — pooled
/// containers' forward directories, exec directories — each root with the
/// prefix of its entries' names: what `forward_dirs::sweep` clears of
/// containers that are gone.
pub(crate) fn swept_dirs(config: &DockerConfig) -> Vec<(PathBuf, &'static str)> {
    [
        (config.pool_forward_dir.clone(), pool::POOL_NAME_PREFIX),
        (config.exec_dir.clone(), exec_server::NAME_PREFIX),
    ]
    .into_iter()
    .filter_map(|(root, prefix)| Some((root?, prefix)))
    .collect()
}

/// What a new container gets besides its image, spec and binds.
#[derive(Debug, Default, Clone, Copy)]
struct RunAs<'a> {
    /// Pooled: its name and the labels marking it as the pool's.
    pooled: Option<(&'a str, &'a [(String, String)])>,
    /// Its exec directory on the host (`exec_server`).
    exec_dir: Option<&'a Path>,
}

/// Creates and resumes Docker sandboxes.
#[derive(Debug, Clone)]
pub struct DockerProvider {
    docker: Docker,
    config: DockerConfig,
    /// The ready containers (`config.pool_size > 0`), shared by clones.
    pool: Option<Arc<pool::Pool>>,
    /// Held while the default image is checked or made (one build at a
    /// time); true once it is known to be there.
    default_image_ready: Arc<tokio::sync::Mutex<bool>>,
    /// The images the gate is known to run in (their references, as
    /// sessions name them): checked once each, not on every create — the
    /// check is an exec, ~50 ms on the path to a session's first turn.
    gate_runs_in: Arc<std::sync::Mutex<std::collections::HashSet<String>>>,
    /// Each image's `$HOME` for its commands, as its configuration says
    /// (`image_home`): looked up once per image.
    image_homes: Arc<std::sync::Mutex<HashMap<String, Option<String>>>>,
}

/// Map a bollard error onto the core's kinds (404 → NotFound, 409 → Conflict).
pub(crate) fn docker_err(what: &str, err: BollardError) -> Error {
    let kind = match &err {
        BollardError::DockerResponseServerError { status_code, .. } => match status_code {
            404 => ErrorKind::NotFound,
            409 => ErrorKind::Conflict,
            400 => ErrorKind::InvalidInput,
            _ => ErrorKind::Backend,
        },
        _ => ErrorKind::Backend,
    };
    let msg = match &err {
        BollardError::DockerResponseServerError { message, .. } => message.clone(),
        other => other.to_string(),
    };
    Error::new(kind, format!("docker: {what}: {msg}")).with_source(err)
}

impl DockerProvider {
    /// Connect with Docker's local defaults (`DOCKER_HOST` or the unix
    /// socket), negotiate the API version, and check the engine answers.
    pub async fn connect(config: DockerConfig) -> Result<Self> {
        let docker = Docker::connect_with_local_defaults()
            .map_err(|e| docker_err("connecting", e))?
            .negotiate_version()
            .await
            .map_err(|e| docker_err("negotiating the API version", e))?;
        docker
            .ping()
            .await
            .map_err(|e| docker_err("pinging the engine", e))?;
        let provider = Self::with_client(docker, config);
        if let Err(e) = provider.reap_pool_leftovers().await {
            tracing::warn!("reaping pooled containers of dead processes failed: {e}");
        }
        Ok(provider)
    }

    /// Use an existing client. Unlike [`connect`](Self::connect), this does
    /// not reap pooled containers left by dead processes; call
    /// [`reap_pool_leftovers`](Self::reap_pool_leftovers) for that.
    pub fn with_client(docker: Docker, config: DockerConfig) -> Self {
        let pool = (config.pool_size > 0).then(|| {
            Arc::new(pool::Pool::new(
                docker.clone(),
                format!("{}.pool", config.label_prefix),
                config.pool_size,
                config.pool_max_shapes,
                config.pool_refill_delay,
                swept_dirs(&config),
            ))
        });
        Self {
            docker,
            config,
            pool,
            default_image_ready: Arc::default(),
            gate_runs_in: Arc::default(),
            image_homes: Arc::default(),
        }
    }

    /// A clone without the pool (what background fills work with, so they
    /// never keep the pool alive).
    fn bare(&self) -> Self {
        Self {
            docker: self.docker.clone(),
            config: self.config.clone(),
            pool: None,
            default_image_ready: self.default_image_ready.clone(),
            gate_runs_in: self.gate_runs_in.clone(),
            image_homes: self.image_homes.clone(),
        }
    }

    /// The pool's instance id (the value of its `<prefix>.pool` label), when
    /// [`DockerConfig::pool_size`] is set.
    pub fn pool_instance(&self) -> Option<&str> {
        self.pool.as_deref().map(|p| p.instance.as_str())
    }

    /// How many ready containers the pool holds now, over all shapes.
    pub fn pool_ready(&self) -> usize {
        self.pool.as_deref().map_or(0, pool::Pool::ready)
    }

    /// Wait until no background fill is in flight (at most `timeout`);
    /// whether that happened. Benchmarks and tests use it to measure and
    /// look at a settled pool.
    pub async fn pool_settled(&self, timeout: Duration) -> bool {
        match &self.pool {
            Some(pool) => pool.settled(timeout).await,
            None => true,
        }
    }

    /// Close the pool and remove its containers (waiting for fills in
    /// flight); the number removed. Sandboxes taken from the pool are not
    /// touched. `create` keeps working afterwards, without a pool. Also what
    /// dropping the last clone does, best effort.
    pub async fn shutdown(&self) -> Result<usize> {
        match &self.pool {
            Some(pool) => pool.shutdown(self).await,
            None => Ok(0),
        }
    }

    /// Remove pooled containers (any provider's) that nobody can take any
    /// more: those whose owning process is certainly dead (same boot and pid
    /// namespace, and its pid gone or reused) and stopped ones. `connect`
    /// does this; the number removed.
    pub async fn reap_pool_leftovers(&self) -> Result<usize> {
        pool::reap(self, &self.label("pool")).await
    }

    /// Make the default image if [`DockerConfig::make_default_image`] says
    /// how and it is missing or of another recipe (checked once per
    /// provider; concurrent creates wait for one build).
    pub async fn ensure_default_image(&self) -> Result<()> {
        let Some(make) = &self.config.make_default_image else {
            return Ok(());
        };
        let mut ready = self.default_image_ready.lock().await;
        if !*ready {
            base_image::ensure(
                self,
                &self.config.default_image,
                &make.rootfs,
                &make.cache,
                &*make.progress,
            )
            .await
            .map_err(|e| {
                Error::new(
                    e.kind(),
                    format!(
                        "making the default Docker image {}: {} (or name an image for the \
                         session)",
                        self.config.default_image,
                        e.message()
                    ),
                )
            })?;
            *ready = true;
        }
        Ok(())
    }

    /// The client.
    pub fn client(&self) -> &Docker {
        &self.docker
    }

    /// The default bridge network's gateway: an address of this machine
    /// that containers on the bridge reach (where to bind a host service
    /// they must call, e.g. a model endpoint). What `docker network
    /// inspect bridge` reports, else the first address of its subnet
    /// (dockerd's default when it leaves `Gateway` out). Binding there
    /// fails if the guess is not an address of this machine, so a wrong
    /// guess cannot send traffic elsewhere.
    pub async fn bridge_gateway(&self) -> Option<std::net::IpAddr> {
        use std::net::{IpAddr, Ipv4Addr};
        let net = self.docker.inspect_network("bridge", None).await.ok()?;
        let config = net.ipam?.config?;
        if let Some(gw) = config
            .iter()
            .find_map(|c| c.gateway.as_deref()?.parse::<IpAddr>().ok())
        {
            return Some(gw);
        }
        config.iter().find_map(|c| {
            let (addr, _len) = c.subnet.as_deref()?.split_once('/')?;
            let net: Ipv4Addr = addr.parse().ok()?;
            Some(IpAddr::V4(Ipv4Addr::from(u32::from(net) + 1)))
        })
    }

    /// The configuration.
    pub fn config(&self) -> &DockerConfig {
        &self.config
    }

    pub(crate) fn label(&self, key: &str) -> String {
        format!("{}.{key}", self.config.label_prefix)
    }

    fn base_labels(&self, spec: &SandboxSpec, role: &str) -> HashMap<String, String> {
        let mut labels: HashMap<String, String> = spec
            .labels
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        labels.insert(self.label("managed-by"), "harness".into());
        labels.insert(self.label("role"), role.into());
        if let Some(session) = &spec.session_id {
            labels.insert(self.label("session-id"), session.clone());
        }
        labels
    }

    /// Create, start and return a container from `image`.
    pub(crate) async fn run_container(
        &self,
        image: &str,
        spec: &SandboxSpec,
        role: &str,
        workdir: Option<&str>,
        extra_binds: &[String],
    ) -> Result<String> {
        self.run_container_as(image, spec, role, workdir, extra_binds, RunAs::default())
            .await
    }

    /// Create and start a pooled container of `plan`'s shape, named `name`
    /// and carrying `marks` besides the labels a fresh one gets.
    async fn run_pooled(
        &self,
        plan: &pool::Plan,
        name: &str,
        marks: &[(String, String)],
    ) -> Result<String> {
        // A shape pooled for any session mounts forward directories of the
        // container's own, which a session's sockets move into when it
        // takes the container (`forward_dirs`).
        let mut binds = plan.extra_binds.clone();
        let root = match (plan.forward_dirs, &self.config.pool_forward_dir) {
            (0, _) => None,
            (n, Some(root)) => {
                let dirs = forward_dirs::make(root, name, n).map_err(|e| {
                    forward_dirs::remove(root, name);
                    Error::backend(format!(
                        "making the forward directories of pooled container {name} in {}: {e}",
                        root.display()
                    ))
                })?;
                for (n, dir) in dirs.iter().enumerate() {
                    binds.push(format!(
                        "{}:{FORWARD_DIRS_IN_CONTAINER}/{n}:ro",
                        dir.display()
                    ));
                }
                Some(root)
            }
            (_, None) => {
                return Err(Error::invalid(
                    "a shape pooled for any session needs DockerConfig::pool_forward_dir",
                ))
            }
        };
        let made = self
            .run_session(
                &plan.image,
                &plan.spec,
                &binds,
                Some((name, marks)),
                plan.exec_server,
            )
            .await;
        let (id, exec_dir) = match (made, root) {
            (Ok(made), None) => made,
            (Ok((id, exec_dir)), Some(root)) => {
                match forward_dirs::record_container(root, name, &id) {
                    Ok(()) => (id, exec_dir),
                    Err(e) => {
                        let _ = self.remove(&id).await;
                        forward_dirs::remove(root, name);
                        if let Some(dir) = &exec_dir {
                            exec_server::remove_dir(dir);
                        }
                        return Err(Error::backend(format!(
                            "recording pooled container {name}'s directories: {e}"
                        )));
                    }
                }
            }
            (Err(e), root) => {
                if let Some(root) = root {
                    forward_dirs::remove(root, name);
                }
                return Err(e);
            }
        };
        if plan.check_gate {
            if let Err(e) = self.check_gate(&id, &plan.image).await {
                let _ = self.remove(&id).await;
                if let Some(root) = &self.config.pool_forward_dir {
                    forward_dirs::remove(root, name);
                }
                if let Some(dir) = &exec_dir {
                    exec_server::remove_dir(dir);
                }
                return Err(e);
            }
        }
        Ok(id)
    }

    /// Take a ready container of `plan`'s shape for `spec`'s session (and
    /// start the pool's refill), or `None` when the pool has none this
    /// session could take. `data` is the handle's data so far.
    async fn take_pooled(
        &self,
        pool: &Arc<pool::Pool>,
        key: &str,
        plan: &pool::Plan,
        spec: &SandboxSpec,
        session_dirs: &[String],
        data: &serde_json::Value,
    ) -> Option<DockerSandbox> {
        while let Some(id) = pool.take(key) {
            match self.adopt(&id, spec, session_dirs).await {
                Ok((linked, exec_dir)) => {
                    let mut data = data.clone();
                    if let Some(dir) = exec_dir {
                        data["exec_dir"] = json!(dir);
                    }
                    pool.refill(self, key, Arc::new(plan.clone()));
                    data["image"] = json!(plan.image);
                    if let Some(home) = self.image_home(&plan.image, spec).await {
                        data["home"] = json!(home);
                    }
                    if !linked.is_empty() {
                        data["pool_forwards"] = json!(linked);
                    }
                    return Some(self.sandbox(id, spec.workdir.clone(), true, data));
                }
                Err(e) => {
                    // Removed behind our back, or the rename failed:
                    // never hand out a container we could not adopt.
                    tracing::warn!("a pooled container could not be taken: {e}");
                    let _ = self.remove(&id).await;
                }
            }
        }
        None
    }

    /// Create and start a session container — a session's own, or a
    /// pooled one (`pooled`: its name and marks) — with an exec directory
    /// of its own when `exec_server` and the provider has a place for them
    /// (made here, recorded with the container's id for the sweep, removed
    /// again if the container is not made): its id and that directory.
    async fn run_session(
        &self,
        image: &str,
        spec: &SandboxSpec,
        binds: &[String],
        pooled: Option<(&str, &[(String, String)])>,
        exec_server: bool,
    ) -> Result<(String, Option<PathBuf>)> {
        let exec_dir = match self.config.exec_dir.as_deref().filter(|_| exec_server) {
            Some(root) => Some(exec_server::make_dir(root).map_err(|e| {
                Error::backend(format!(
                    "making an exec directory in {}: {e}",
                    root.display()
                ))
            })?),
            None => None,
        };
        let run_as = RunAs {
            pooled,
            exec_dir: exec_dir.as_deref(),
        };
        let made = self
            .run_container_as(image, spec, "session", Some(&spec.workdir), binds, run_as)
            .await;
        let Some(dir) = exec_dir else {
            return made.map(|id| (id, None));
        };
        let recorded = match made {
            Ok(id) => match exec_server::record(&dir, &id) {
                Ok(()) => return Ok((id, Some(dir))),
                Err(e) => {
                    let _ = self.remove(&id).await;
                    Error::backend(format!(
                        "recording container {id}'s exec directory {}: {e}",
                        dir.display()
                    ))
                }
            },
            Err(e) => e,
        };
        exec_server::remove_dir(&dir);
        Err(recorded)
    }

    /// [`run_container`](Self::run_container), optionally as a pooled
    /// container (its name and extra labels) and with an exec directory.
    async fn run_container_as(
        &self,
        image: &str,
        spec: &SandboxSpec,
        role: &str,
        workdir: Option<&str>,
        extra_binds: &[String],
        run_as: RunAs<'_>,
    ) -> Result<String> {
        let RunAs { pooled, exec_dir } = run_as;
        let mut last_err = None;
        let mut extra_binds = extra_binds.to_vec();
        if let Some(dir) = exec_dir {
            extra_binds.push(format!("{}:{EXEC_DIR_IN_CONTAINER}:rw", dir.display()));
        }
        let init = match exec_dir {
            Some(_) => init_with_exec_server(),
            None => INIT_SCRIPT.to_string(),
        };
        // Host ports are chosen here and can be taken by someone else before
        // dockerd binds them: retry with fresh ones on that conflict.
        for _ in 0..5 {
            let ports = free_ports(spec.ports.len())?;
            let mut bindings = HashMap::new();
            let mut exposed = Vec::new();
            for (sandbox_port, host_port) in spec.ports.iter().zip(&ports) {
                let key = format!("{sandbox_port}/tcp");
                exposed.push(key.clone());
                bindings.insert(
                    key,
                    Some(vec![PortBinding {
                        host_ip: Some("127.0.0.1".into()),
                        host_port: Some(host_port.to_string()),
                    }]),
                );
            }
            let binds: Vec<String> = self
                .config
                .bind_mounts
                .iter()
                .map(|m| {
                    format!(
                        "{}:{}:{}",
                        m.host,
                        m.container,
                        if m.read_only { "ro" } else { "rw" }
                    )
                })
                .chain(extra_binds.iter().cloned())
                .collect();
            let host_config = HostConfig {
                nano_cpus: spec.cpus.map(|c| (c * 1e9) as i64),
                memory: spec.memory_mb.map(|m| (m * 1024 * 1024) as i64),
                // Custom is no route out, like deny-all: its egress proxy
                // is reached through the forward on EGRESS_PROXY_PORT.
                network_mode: match spec.network {
                    NetworkPolicy::DenyAll | NetworkPolicy::Custom { .. } => Some("none".into()),
                    NetworkPolicy::AllowAll => None,
                },
                port_bindings: (!bindings.is_empty()).then_some(bindings),
                binds: (!binds.is_empty()).then_some(binds),
                ..Default::default()
            };
            let body = ContainerCreateBody {
                image: Some(image.to_string()),
                entrypoint: Some(vec![
                    "/bin/sh".into(),
                    "-c".into(),
                    init.clone(),
                    "harness-init".into(),
                ]),
                cmd: Some(vec![]),
                env: Some(spec.env.iter().map(|(k, v)| format!("{k}={v}")).collect()),
                // Docker creates the working directory when it is missing.
                working_dir: workdir.map(str::to_string),
                labels: Some({
                    let mut labels = self.base_labels(spec, role);
                    for (k, v) in pooled.map(|p| p.1).unwrap_or_default() {
                        labels.insert(k.clone(), v.clone());
                    }
                    if let Some(dir) = exec_dir {
                        // How a session that takes a pooled container finds it.
                        labels.insert(self.label("exec-dir"), dir.display().to_string());
                    }
                    labels
                }),
                exposed_ports: (!exposed.is_empty()).then_some(exposed),
                host_config: Some(host_config),
                ..Default::default()
            };
            let slot = spec
                .slot
                .as_deref()
                .filter(|_| role == "session" && pooled.is_none());
            let name = match pooled {
                Some((name, _)) => name.to_string(),
                None => container_name(spec.session_id.as_deref(), role, slot),
            };
            let create = |body| {
                self.docker.create_container(
                    Some(CreateContainerOptionsBuilder::new().name(&name).build()),
                    body,
                )
            };
            let what = format!("creating a container from {image}");
            let created = match create(body.clone()).await {
                // A creator killed before it recorded this slot's container
                // left it: nothing refers to it, so it is replaced. Removed
                // on the name's conflict only, not before every create: that
                // would be one more call to dockerd on every session's path.
                Err(BollardError::DockerResponseServerError {
                    status_code: 409, ..
                }) if slot.is_some() => {
                    self.remove(&name).await?;
                    create(body).await.map_err(|e| docker_err(&what, e))?
                }
                other => other.map_err(|e| docker_err(&what, e))?,
            };
            match self.docker.start_container(&created.id, None).await {
                Ok(()) => return Ok(created.id),
                Err(e) => {
                    let err = docker_err("starting the container", e);
                    let _ = self.remove(&created.id).await;
                    let msg = err.message().to_ascii_lowercase();
                    if msg.contains("port is already allocated")
                        || msg.contains("address already in use")
                    {
                        last_err = Some(err);
                        continue;
                    }
                    return Err(err);
                }
            }
        }
        Err(last_err.unwrap_or_else(|| Error::backend("could not publish the ports")))
    }

    pub(crate) async fn remove(&self, id: &str) -> Result<()> {
        remove_container(&self.docker, id).await
    }

    /// Make pooled container `id` the sandbox `spec` asks for: check that it
    /// still runs (a dockerd restart or a `docker stop` may have stopped
    /// it), and rename it to the name a fresh container would get
    /// (replacing a slot's leftover, as a fresh create does). From then on
    /// it is no longer pooled.
    ///
    /// A container pooled for any session gets the spec's forward
    /// directories (`session_dirs`, in mount order) linked to its own
    /// (`forward_dirs::link`); the pairs linked, which the sandbox's
    /// handle records so that `destroy` can undo them.
    async fn adopt(
        &self,
        id: &str,
        spec: &SandboxSpec,
        session_dirs: &[String],
    ) -> Result<(Vec<(PathBuf, PathBuf)>, Option<String>)> {
        let info = self
            .docker
            .inspect_container(id, None)
            .await
            .map_err(|e| docker_err("inspecting a pooled container", e))?;
        if info.state.and_then(|s| s.running) != Some(true) {
            return Err(Error::backend(format!(
                "pooled container {id} is not running"
            )));
        }
        let exec_dir = info
            .config
            .as_ref()
            .and_then(|c| c.labels.as_ref())
            .and_then(|labels| labels.get(&self.label("exec-dir")))
            .cloned();
        let mut linked: Vec<(PathBuf, PathBuf)> = Vec::new();
        if !session_dirs.is_empty() {
            let root = self.config.pool_forward_dir.as_ref().ok_or_else(|| {
                Error::invalid(
                    "a shape pooled for any session needs DockerConfig::pool_forward_dir",
                )
            })?;
            let pool_name = info
                .name
                .as_deref()
                .unwrap_or_default()
                .trim_start_matches('/');
            let dir = forward_dirs::of(root, pool_name);
            for (n, session_dir) in session_dirs.iter().enumerate() {
                let pair = (PathBuf::from(session_dir), dir.join(n.to_string()));
                if let Err(e) = forward_dirs::link(&pair.0, &pair.1) {
                    undo_links(&linked);
                    return Err(Error::backend(format!(
                        "moving the sockets of {session_dir} into pooled container {pool_name}'s {}: {e}",
                        pair.1.display()
                    )));
                }
                linked.push(pair);
            }
        }
        let slot = spec.slot.as_deref();
        let name = container_name(spec.session_id.as_deref(), "session", slot);
        let renamed = async {
            if slot.is_some() {
                self.remove(&name).await?;
            }
            self.docker
                .rename_container(id, RenameContainerOptionsBuilder::new().name(&name).build())
                .await
                .map_err(|e| docker_err("renaming a pooled container", e))
        }
        .await;
        if let Err(e) = renamed {
            undo_links(&linked);
            return Err(e);
        }
        Ok((linked, exec_dir))
    }

    /// Inspect `id`, starting it when it is not running.
    async fn ensure_running(&self, id: &str) -> Result<String> {
        let info = self
            .docker
            .inspect_container(id, None)
            .await
            .map_err(|e| docker_err(&format!("inspecting container {id}"), e))?;
        let full_id = info
            .id
            .clone()
            .ok_or_else(|| Error::backend("docker returned a container without an id"))?;
        let running = info.state.as_ref().and_then(|s| s.running) == Some(true);
        if !running {
            self.docker
                .start_container(&full_id, None)
                .await
                .map_err(|e| docker_err(&format!("starting stopped container {id}"), e))?;
        }
        Ok(full_id)
    }

    fn sandbox(
        &self,
        id: String,
        workdir: String,
        owned: bool,
        data: serde_json::Value,
    ) -> DockerSandbox {
        let extra_env = data
            .get("env")
            .and_then(|e| serde_json::from_value::<BTreeMap<String, String>>(e.clone()).ok())
            .unwrap_or_default();
        let forwards = forwards_in(&data);
        let exec_dir = data
            .get("exec_dir")
            .and_then(|d| d.as_str())
            .map(PathBuf::from);
        DockerSandbox {
            exec_dir,
            docker: self.docker.clone(),
            id,
            workdir,
            owned,
            data,
            extra_env,
            forwards,
            stop_timeout_secs: self.config.stop_timeout_secs,
            label_prefix: self.config.label_prefix.clone(),
            host_imports: self.config.host_imports,
        }
    }

    /// The gate binary on the host: [`DockerConfig::gate`], else what
    /// [`harness_sandbox_gate::locate`] finds.
    fn gate(&self) -> Result<PathBuf> {
        let gate = self
            .config
            .gate
            .clone()
            .or_else(harness_sandbox_gate::locate);
        match gate {
            Some(gate) if gate.is_file() => Ok(gate),
            other => Err(Error::unsupported(format!(
                "the docker sandbox serves forwards through harness-sandbox-gate, and {}: set {}, \
                 DockerConfig::gate, or put {} beside this executable",
                match other {
                    Some(path) => format!("{} does not exist", path.display()),
                    None => "none was found".to_string(),
                },
                harness_sandbox_gate::BIN_ENV,
                harness_sandbox_gate::BINARY_NAME,
            ))),
        }
    }

    /// Refuse an image the mounted gate cannot run in (no glibc, or an
    /// older one than the gate was built against) before anything runs
    /// through it.
    ///
    /// Once per image reference and provider: a reference retagged to an
    /// image without a usable glibc after its first check fails at its
    /// first forwarded command instead, with the gate's own error.
    /// The `$HOME` an exec in a container of `image` made from `spec`
    /// sees, from configuration alone: the spec's `HOME`, else the image's,
    /// else `/root` for an image that runs as root (what Docker sets
    /// then). `None` when only the container's `/etc/passwd` could tell (a
    /// user other than root and no `HOME`), or the image cannot be
    /// inspected: the caller asks the container instead.
    async fn image_home(&self, image: &str, spec: &SandboxSpec) -> Option<String> {
        if let Some(home) = spec.env.get("HOME") {
            return Some(home.clone());
        }
        if let Some(known) = self.image_homes.lock().unwrap().get(image) {
            return known.clone();
        }
        let config = self.docker.inspect_image(image).await.ok()?.config?;
        let from_env = config
            .env
            .unwrap_or_default()
            .iter()
            .find_map(|kv| kv.strip_prefix("HOME=").map(str::to_string));
        let user = config.user.unwrap_or_default();
        let home = from_env.or_else(|| {
            matches!(user.as_str(), "" | "root" | "0" | "root:root" | "0:0")
                .then(|| "/root".to_string())
        });
        self.image_homes
            .lock()
            .unwrap()
            .insert(image.to_string(), home.clone());
        home
    }

    async fn check_gate(&self, container: &str, image: &str) -> Result<()> {
        if self.gate_runs_in.lock().unwrap().contains(image) {
            return Ok(());
        }
        let (code, _, stderr) = exec::run_simple(
            &self.docker,
            container,
            vec![GATE_IN_CONTAINER.into(), "--version".into()],
        )
        .await?;
        if code == 0 {
            self.gate_runs_in.lock().unwrap().insert(image.to_string());
            return Ok(());
        }
        Err(Error::unsupported(format!(
            "harness-sandbox-gate cannot run in image {image} (exit {code}: {}); forwards need \
             an image with a glibc at least as new as the gate's build host, or a gate built for \
             the image (DockerConfig::gate)",
            String::from_utf8_lossy(&stderr).trim()
        )))
    }

    async fn create_wrapped(&self, target: &str, spec: &SandboxSpec) -> Result<DockerSandbox> {
        let id = self.ensure_running(target).await?;
        let info = self
            .docker
            .inspect_container(&id, None)
            .await
            .map_err(|e| docker_err("inspecting the wrapped container", e))?;
        let mode = info
            .host_config
            .as_ref()
            .and_then(|h| h.network_mode.clone())
            .unwrap_or_default();
        // The caller's container keeps its own network: say so rather than
        // pretend a deny-all policy holds.
        if spec.network != NetworkPolicy::AllowAll && mode != "none" {
            return Err(Error::unsupported(format!(
                "wrap-mode cannot change the network of container {target} (network mode {mode:?}); \
                 deny-all needs a container created with --network none"
            )));
        }
        let image = info
            .config
            .as_ref()
            .and_then(|c| c.image.clone())
            .unwrap_or_default();
        let data = json!({ "image": image, "wrap": true, "env": spec.env });
        let sandbox = self.sandbox(id, spec.workdir.clone(), false, data);
        sandbox.mkdir(&spec.workdir).await?;
        if let Some(recipe) = spec.bootstrap.as_ref().filter(|r| !r.is_empty()) {
            // No snapshot for a caller's container: run the recipe in place,
            // once per identity, remembered by a marker file.
            let identity = recipe.identity(&image);
            let marker = format!("/.harness-bootstrap-{identity}");
            let probe = sandbox
                .run(ExecRequest::new(["test", "-e", &marker]))
                .await?;
            if !probe.status.success() {
                bootstrap::run_recipe(&sandbox, recipe).await?;
                sandbox
                    .run(ExecRequest::new(["touch", &marker]))
                    .await?
                    .check("marking the wrapped container bootstrapped")?;
            }
        }
        Ok(sandbox)
    }
}

#[async_trait]
impl SandboxProvider for DockerProvider {
    fn name(&self) -> &'static str {
        PROVIDER_NAME
    }

    fn changes_network_at_run_time(&self) -> bool {
        true
    }

    async fn create(&self, spec: &SandboxSpec) -> Result<Box<dyn Sandbox>> {
        let mounts = forward_mounts(spec)?;
        if !spec.workdir.starts_with('/') {
            return Err(Error::invalid(format!(
                "workdir must be an absolute path, got {:?}",
                spec.workdir
            )));
        }
        if let Some(target) = &spec.wrap {
            if !spec.forwards.is_empty() {
                return Err(Error::unsupported(format!(
                    "wrap-mode cannot add forwards ({:?}) to container {target}: the gate and the \
                     sockets' directories are bind mounts, fixed when a container is created",
                    spec.forwards.iter().map(|f| f.port).collect::<Vec<_>>()
                )));
            }
            return Ok(Box::new(self.create_wrapped(target, spec).await?));
        }
        if spec.image.is_none() {
            self.ensure_default_image().await?;
        }
        let mut extra_binds = Vec::new();
        // Forwards need the gate; the exec server wants it (without one,
        // commands go through the engine's exec).
        let gate = match (mounts.is_empty(), &self.config.exec_dir) {
            (false, _) => Some(self.gate()?),
            (true, Some(_)) => self.gate().ok(),
            (true, None) => None,
        };
        if let Some(gate) = &gate {
            extra_binds.push(format!("{}:{GATE_IN_CONTAINER}:ro", gate.display()));
        }
        let exec_server = gate.is_some() && self.config.exec_dir.is_some();
        // The gate alone: what a container pooled for any session mounts
        // besides its own forward directories.
        let gate_binds = extra_binds.clone();
        if !mounts.is_empty() {
            for (host_dir, container_dir) in &mounts.dirs {
                extra_binds.push(format!("{host_dir}:{container_dir}:ro"));
            }
        }
        let base = spec
            .image
            .clone()
            .unwrap_or_else(|| self.config.default_image.clone());
        let recipe = spec.bootstrap.as_ref().filter(|r| !r.is_empty());
        let mut data = json!({ "image": base, "wrap": false });
        if !mounts.is_empty() {
            // The handle carries the forwards, so a resume anywhere wraps
            // every command the same way.
            data["forwards"] = serde_json::to_value(&mounts.forwards)?;
        }
        // With a place for pooled containers' own forward directories, a
        // session's container can come from a pool filled before the
        // session existed: its shape leaves out the session (id and socket
        // directories), which `adopt` joins to the container.
        let for_any_session = self.config.pool_forward_dir.is_some();
        let session_dirs: Vec<String> = if for_any_session {
            mounts.dirs.iter().map(|(host, _)| host.clone()).collect()
        } else {
            Vec::new()
        };
        let pooled = match &self.pool {
            Some(pool) => {
                // The snapshot's tag follows from the identity alone: a
                // pooled container of it pins the image, so no build or
                // lock is needed to take one.
                let image = match recipe {
                    Some(r) => bootstrap::snapshot_tag(self, &r.identity(&base)),
                    None => base.clone(),
                };
                let mut plan = pool::Plan {
                    image,
                    spec: SandboxSpec {
                        slot: None,
                        bootstrap: None,
                        ..spec.clone()
                    },
                    extra_binds: extra_binds.clone(),
                    check_gate: !mounts.is_empty(),
                    forward_dirs: 0,
                    exec_server,
                };
                if for_any_session {
                    plan.spec.session_id = None;
                    // The sockets as the container sees them: the same for
                    // every session.
                    for (forward, record) in plan.spec.forwards.iter_mut().zip(&mounts.forwards) {
                        forward.socket = record.path.clone();
                    }
                    plan.extra_binds = gate_binds;
                    plan.forward_dirs = mounts.dirs.len();
                }
                let key = shape_key(&plan)?;
                Some((pool.clone(), key, plan))
            }
            None => None,
        };
        if let Some((pool, key, plan)) = &pooled {
            if let Some(taken) = self
                .take_pooled(pool, key, plan, spec, &session_dirs, &data)
                .await
            {
                return Ok(Box::new(taken));
            }
        }
        let (image, snapshot_lock) = match recipe {
            Some(recipe) => {
                let (tag, lock) = bootstrap::ensure_snapshot(self, &base, recipe).await?;
                (tag, Some(lock))
            }
            None => (base.clone(), None),
        };
        let (id, exec_dir) = self
            .run_session(&image, spec, &extra_binds, None, exec_server)
            .await?;
        if let Some(dir) = &exec_dir {
            data["exec_dir"] = json!(dir);
        }
        // The container now pins the snapshot; prune may proceed.
        drop(snapshot_lock);
        data["image"] = json!(image);
        if let Some(home) = self.image_home(&image, spec).await {
            data["home"] = json!(home);
        }
        if !mounts.is_empty() {
            if let Err(e) = self.check_gate(&id, &image).await {
                let _ = self.remove(&id).await;
                if let Some(dir) = &exec_dir {
                    exec_server::remove_dir(dir);
                }
                return Err(e);
            }
        }
        if let Some((pool, key, plan)) = pooled {
            // The next create of this shape finds a ready container.
            pool.refill(self, &key, Arc::new(plan));
        }
        Ok(Box::new(self.sandbox(id, spec.workdir.clone(), true, data)))
    }

    async fn resume(&self, handle: &SandboxHandle) -> Result<Box<dyn Sandbox>> {
        if handle.provider != PROVIDER_NAME {
            return Err(Error::invalid(format!(
                "a {:?} handle cannot be resumed by the docker provider",
                handle.provider
            )));
        }
        if let Some(forwards) = handle.data.get("forwards") {
            // Never run commands without the forwards the sandbox was made
            // with: a handle whose record is unreadable is refused.
            serde_json::from_value::<Vec<ForwardRecord>>(forwards.clone())
                .map_err(|e| Error::invalid(format!("the handle's forwards are malformed: {e}")))?;
        }
        let id = self.ensure_running(&handle.id).await?;
        Ok(Box::new(self.sandbox(
            id,
            handle.workdir.clone(),
            handle.owned,
            handle.data.clone(),
        )))
    }

    async fn list_snapshots(&self) -> Result<Vec<SnapshotInfo>> {
        bootstrap::list(self).await
    }

    async fn prune_snapshots(&self, keep: &[String]) -> Result<Vec<SnapshotInfo>> {
        bootstrap::prune(self, keep).await
    }

    /// [`DockerProvider::shutdown`]: the pool's containers go.
    async fn shutdown(&self) -> Result<()> {
        DockerProvider::shutdown(self).await.map(|_| ())
    }
}

/// A container used as a sandbox.
#[derive(Debug)]
pub struct DockerSandbox {
    docker: Docker,
    id: String,
    workdir: String,
    owned: bool,
    data: serde_json::Value,
    /// Environment applied per exec (wrap-mode, where the container's own
    /// environment cannot be changed).
    extra_env: BTreeMap<String, String>,
    /// The spec's forwards with the sockets' paths inside the container:
    /// every exec runs through the gate when there are any.
    forwards: Vec<harness_sandbox_gate::Forward>,
    stop_timeout_secs: i32,
    /// The provider's label prefix (images this sandbox commits carry it).
    label_prefix: String,
    /// [`DockerConfig::host_imports`].
    host_imports: bool,
    /// The host directory of the container's exec server's socket, when
    /// it has one ([`DockerConfig::exec_dir`]).
    exec_dir: Option<PathBuf>,
}

impl DockerSandbox {
    /// The container id.
    pub fn container_id(&self) -> &str {
        &self.id
    }

    async fn run(&self, request: ExecRequest) -> Result<harness_core::sandbox::ExecOutput> {
        collect_exec(self.exec(request).await?).await
    }

    /// Start `plan` through the container's exec server when it can be
    /// reached, else through the engine's exec.
    async fn start(&self, plan: exec::ExecPlan) -> Result<ExecStream> {
        if let Some(dir) = &self.exec_dir {
            match exec_server::connect(dir).await {
                Ok(conn) => return exec_server::start(dir, conn, plan).await,
                Err(e) => tracing::debug!(
                    "the exec server in {} cannot be reached ({e}); the engine's exec runs the command",
                    dir.display()
                ),
            }
        }
        exec::start(&self.docker, &self.id, plan).await
    }

    async fn mkdir(&self, dir: &str) -> Result<()> {
        let out = exec::run_simple(
            &self.docker,
            &self.id,
            vec!["mkdir".into(), "-p".into(), dir.into()],
        )
        .await?;
        if out.0 != 0 {
            return Err(Error::backend(format!(
                "mkdir -p {dir} failed: {}",
                String::from_utf8_lossy(&out.2).trim()
            )));
        }
        Ok(())
    }

    /// Stream `content` into `path` through an exec's stdin, into a
    /// temporary file renamed into place only once every byte arrived.
    async fn write_streaming(&self, path: &str, content: ByteStream) -> Result<u64> {
        let tmp = format!("{path}.harness-tmp-{}", uuid::Uuid::new_v4().simple());
        let parent = parent_dir(path);
        let counter = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let counted = {
            let counter = counter.clone();
            content.map(move |chunk| {
                if let Ok(c) = &chunk {
                    counter.fetch_add(c.len() as u64, std::sync::atomic::Ordering::Relaxed);
                }
                chunk
            })
        };
        let script = format!(
            "mkdir -p {p} && cat > {t}",
            p = shell_quote(&parent),
            t = shell_quote(&tmp)
        );
        let plan = exec::ExecPlan {
            argv: vec!["sh".into(), "-c".into(), script],
            env: Vec::new(),
            cwd: None,
            stdin: Some(Box::pin(counted)),
            timeout: None,
            abort: None,
        };
        let result = match self.start(plan).await {
            Ok(stream) => collect_exec(stream).await,
            Err(e) => Err(e),
        };
        let out = match result {
            Ok(out) if out.status.success() => out,
            Ok(out) => {
                let _ = self.run(ExecRequest::new(["rm", "-f", &tmp])).await;
                return Err(Error::backend(format!(
                    "writing {path} failed ({:?}): {}",
                    out.status,
                    out.stderr_str().trim()
                )));
            }
            Err(e) => {
                let _ = self.run(ExecRequest::new(["rm", "-f", &tmp])).await;
                return Err(e);
            }
        };
        drop(out);
        let n = counter.load(std::sync::atomic::Ordering::Relaxed);
        // Rename only if the size matches what we sent: a connection cut
        // short must not leave a truncated file under the real name.
        let check = format!(
            "n=$(wc -c < {t}); if [ \"$n\" -eq {n} ]; then mv -f {t} {p}; else rm -f {t}; echo \"wrote $n of {n} bytes\" >&2; exit 1; fi",
            t = shell_quote(&tmp),
            p = shell_quote(path)
        );
        self.run(ExecRequest::shell(check))
            .await?
            .check(&format!("writing {path}"))?;
        Ok(n)
    }

    async fn upload(&self, dir: &str, body: ByteStream) -> Result<()> {
        let body = body.map(|c| c.map_err(std::io::Error::from));
        self.docker
            .upload_to_container(
                &self.id,
                Some(UploadToContainerOptionsBuilder::new().path(dir).build()),
                bollard::body_try_stream(body),
            )
            .await
            .map_err(|e| docker_err(&format!("uploading into {dir}"), e))
    }

    /// Upload one file whose size is known, streaming its body.
    pub(crate) async fn upload_file(
        &self,
        path: &str,
        size: u64,
        mode: u32,
        body: ByteStream,
    ) -> Result<()> {
        let rel = path.trim_start_matches('/');
        let head = tarfile::header_blocks(rel, size, mode)?;
        let tail = tarfile::trailer(size);
        let stream = futures::stream::once(async move { Ok(head) })
            .chain(body)
            .chain(futures::stream::once(async move { Ok(tail) }));
        self.upload("/", Box::pin(stream)).await
    }

    fn download(&self, path: &str) -> ByteStream {
        let stream = self.docker.download_from_container(
            &self.id,
            Some(
                DownloadFromContainerOptionsBuilder::new()
                    .path(path)
                    .build(),
            ),
        );
        let what = path.to_string();
        Box::pin(stream.map(move |c| c.map_err(|e| docker_err(&format!("reading {what}"), e))))
    }
}

#[async_trait]
impl Sandbox for DockerSandbox {
    fn handle(&self) -> SandboxHandle {
        SandboxHandle {
            provider: PROVIDER_NAME.into(),
            id: self.id.clone(),
            workdir: self.workdir.clone(),
            owned: self.owned,
            data: self.data.clone(),
        }
    }

    fn workdir(&self) -> &str {
        &self.workdir
    }

    fn home_hint(&self) -> Option<String> {
        self.data
            .get("home")
            .and_then(|h| h.as_str())
            .map(str::to_string)
    }

    async fn exec(&self, request: ExecRequest) -> Result<ExecStream> {
        if request.argv.is_empty() {
            return Err(Error::invalid(
                "exec needs a program to run (argv is empty)",
            ));
        }
        let cwd = request
            .cwd
            .as_deref()
            .map(|c| resolve_path(&self.workdir, c))
            .unwrap_or_else(|| self.workdir.clone());
        let env = self
            .extra_env
            .iter()
            .chain(request.env.iter())
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        let argv = if self.forwards.is_empty() {
            request.argv
        } else {
            // The container has its own network namespace: the gate only
            // serves the forwards (a daemon the first exec starts, alive
            // with the container) and then execs the command.
            harness_sandbox_gate::command_line(
                GATE_IN_CONTAINER,
                false,
                &self.forwards,
                &request.argv,
            )
        };
        let plan = exec::ExecPlan {
            argv,
            env,
            cwd: Some(cwd),
            stdin: request
                .stdin
                .map(|b| Box::pin(futures::stream::once(async move { Ok(b) })) as ByteStream),
            timeout: request.timeout,
            abort: request.abort,
        };
        self.start(plan).await
    }

    async fn poll_detached(
        &self,
        process: &DetachedProcess,
        offset: u64,
    ) -> Result<(DetachedStatus, ByteStream)> {
        // The status probe and the read in one exec, not two, on every poll.
        poll_detached_by_exec(self, process, offset).await
    }

    async fn read_file(&self, path: &str) -> Result<ByteStream> {
        let mut path = resolve_path(&self.workdir, path);
        // Docker archives a symlink as the link itself: follow it (bounded,
        // like the kernel's loop limit) so reads see the target's bytes.
        for _ in 0..16 {
            match tarfile::open_single_entry(self.download(&path)).await? {
                tarfile::SingleEntry::File(s) => return Ok(s),
                tarfile::SingleEntry::Symlink(target) => {
                    path = if target.starts_with('/') {
                        target
                    } else {
                        format!("{}/{}", parent_dir(&path), target)
                    };
                }
                tarfile::SingleEntry::Other(kind) => {
                    return Err(Error::invalid(format!(
                        "{path} is not a regular file ({kind:?})"
                    )))
                }
            }
        }
        Err(Error::invalid(format!(
            "too many symlinks resolving {path}"
        )))
    }

    async fn write_file(&self, path: &str, mut content: ByteStream) -> Result<u64> {
        let path = resolve_path(&self.workdir, path);
        if path.ends_with('/') {
            return Err(Error::invalid(format!(
                "{path} names a directory, not a file"
            )));
        }
        // Read ahead up to SMALL_WRITE: small content goes up in one archive
        // request; anything larger streams through an exec without ever
        // being held whole.
        let mut head = BytesMut::new();
        let mut rest_first: Option<Bytes> = None;
        while let Some(chunk) = content.next().await {
            let chunk = chunk?;
            if head.len() + chunk.len() > SMALL_WRITE {
                rest_first = Some(chunk);
                break;
            }
            head.extend_from_slice(&chunk);
        }
        match rest_first {
            None => {
                let n = head.len() as u64;
                let archive =
                    tarfile::small_archive(path.trim_start_matches('/'), head.freeze(), 0o644)?;
                self.upload("/", harness_core::stream::once(archive))
                    .await?;
                Ok(n)
            }
            Some(first) => {
                let prefix = futures::stream::iter([Ok(head.freeze()), Ok(first)]);
                self.write_streaming(&path, Box::pin(prefix.chain(content)))
                    .await
            }
        }
    }

    async fn export_tar(&self, dir: &str) -> Result<ByteStream> {
        // `tar -C dir .` gives entries relative to dir, as the contract
        // asks (docker's archive endpoint would prefix the dir's own name).
        export_tar_by_exec(self, &resolve_path(&self.workdir, dir)).await
    }

    /// Each import is a `tar` exec of its own. The engine is most often
    /// this machine's, so its cores; a remote engine with fewer only runs
    /// the parts in turn.
    fn parallel_imports(&self) -> usize {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    }

    async fn import_tar(&self, dir: &str, tar: ByteStream) -> Result<()> {
        let dir = resolve_path(&self.workdir, dir);
        if self.host_imports {
            // `open` found the directory with openat2: the kernel has it.
            if let Some((fd, owner)) = host_import::open(&self.docker, &self.id, &dir).await {
                let root = harness_tario::ImportRoot::new(fd, owner)?;
                return harness_tario::import_beneath(root, dir.into(), tar).await;
            }
        }
        // Extracted by GNU tar inside the container (core's
        // `extract_tar_script`), fed through an exec's stdin. Docker's own
        // archive PUT would refuse legitimate trees (a symlink pointing above
        // the tree, e.g. `../shared`, is "invalid symlink" there).
        let script = extract_tar_script(&dir);
        // Scanned on the way in: devices, FIFOs, setuid files, `..` and
        // anything GNU tar would read differently from the scanner stop the
        // extraction (by failing its stdin, which kills tar) before tar sees
        // their header. Entries before the refused one stay extracted.
        let tar = tarscan::scan_stream(tar, tarscan::TarScanner::new().outward_symlinks());
        let plan = exec::ExecPlan {
            argv: vec!["sh".into(), "-c".into(), script],
            env: Vec::new(),
            cwd: None,
            stdin: Some(tar),
            timeout: None,
            abort: None,
        };
        let out = collect_exec(self.start(plan).await?).await?;
        if out.status.success() {
            return Ok(());
        }
        Err(extract_tar_failure(&dir, &out.status, &out.stderr_str()))
    }

    async fn port_endpoint(&self, port: u16) -> Result<PortEndpoint> {
        let info = self
            .docker
            .inspect_container(&self.id, None)
            .await
            .map_err(|e| docker_err("inspecting the container", e))?;
        let binding = info
            .network_settings
            .and_then(|n| n.ports)
            .and_then(|mut p| p.remove(&format!("{port}/tcp")))
            .flatten()
            .and_then(|b| b.into_iter().next());
        let Some(binding) = binding else {
            return Err(Error::not_found(format!(
                "port {port} was not published when the sandbox was created"
            )));
        };
        let host_port = binding
            .host_port
            .as_deref()
            .and_then(|p| p.parse().ok())
            .ok_or_else(|| Error::backend(format!("docker gave port {port} no host port")))?;
        let host = match binding.host_ip.as_deref() {
            None | Some("") | Some("0.0.0.0") => "127.0.0.1".to_string(),
            Some(ip) => ip.to_string(),
        };
        Ok(PortEndpoint {
            sandbox_port: port,
            host,
            port: host_port,
        })
    }

    async fn snapshot_image(&self, name: &str) -> Result<String> {
        snapshot::commit(self, name).await
    }

    async fn set_network(&self, policy: &NetworkPolicy) -> Result<()> {
        if !self.owned {
            return Err(Error::unsupported(
                "wrap-mode: the caller's container keeps its own network",
            ));
        }
        snapshot::set_network(&self.docker, &self.id, policy).await
    }

    async fn stop(&self) -> Result<SandboxHandle> {
        match self
            .docker
            .stop_container(
                &self.id,
                Some(
                    StopContainerOptionsBuilder::new()
                        .t(self.stop_timeout_secs)
                        .build(),
                ),
            )
            .await
        {
            Ok(()) => Ok(self.handle()),
            Err(e) => {
                let err = docker_err("stopping the container", e);
                // 304 (already stopped) comes back as an error in some
                // versions: stopping a stopped container is fine.
                match &err.source_status() {
                    Some(304) => Ok(self.handle()),
                    _ => Err(err),
                }
            }
        }
    }

    async fn destroy(&self) -> Result<()> {
        if !self.owned {
            return Ok(());
        }
        remove_container(&self.docker, &self.id).await?;
        // Taken from a pool for any session: the session's socket
        // directories are links into the container's own; make them
        // directories again, and remove the container's.
        let linked: Vec<(PathBuf, PathBuf)> = self
            .data
            .get("pool_forwards")
            .and_then(|v| serde_json::from_value(v.clone()).ok())
            .unwrap_or_default();
        for (session_dir, pool_dir) in &linked {
            forward_dirs::unlink(session_dir, pool_dir).map_err(|e| {
                Error::backend(format!(
                    "moving the sockets of {} back from {}: {e}",
                    session_dir.display(),
                    pool_dir.display()
                ))
            })?;
        }
        if let Some(dir) = linked.first().and_then(|(_, p)| p.parent()) {
            let _ = std::fs::remove_dir_all(dir);
        }
        if let Some(dir) = &self.exec_dir {
            exec_server::remove_dir(dir);
        }
        Ok(())
    }
}

/// Remove container `id` with its anonymous volumes, killing it if it runs;
/// a missing container is fine.
pub(crate) async fn remove_container(docker: &Docker, id: &str) -> Result<()> {
    match docker
        .remove_container(
            id,
            Some(
                RemoveContainerOptionsBuilder::new()
                    .force(true)
                    .v(true)
                    .build(),
            ),
        )
        .await
    {
        Ok(()) => Ok(()),
        Err(e) => {
            let err = docker_err("removing the container", e);
            // Gone, or going (another caller's removal is in progress).
            if err.kind() == ErrorKind::NotFound
                || (err.kind() == ErrorKind::Conflict
                    && err.message().contains("already in progress"))
            {
                Ok(())
            } else {
                Err(err)
            }
        }
    }
}

/// The pool key of a shape: everything the container is created with but
/// its name, canonically serialized (the spec's maps are ordered).
fn shape_key(plan: &pool::Plan) -> Result<String> {
    Ok(serde_json::to_string(&json!({
        "image": plan.image,
        "spec": plan.spec,
        "binds": plan.extra_binds,
    }))?)
}

trait SourceStatus {
    fn source_status(&self) -> Option<u16>;
}

impl SourceStatus for Error {
    fn source_status(&self) -> Option<u16> {
        use std::error::Error as _;
        match self.source()?.downcast_ref::<BollardError>()? {
            BollardError::DockerResponseServerError { status_code, .. } => Some(*status_code),
            _ => None,
        }
    }
}

/// The spec's forwards as mounts: each distinct socket directory at
/// `/run/harness/forward/<n>`, and each socket's path there.
#[derive(Debug, Default)]
struct ForwardMounts {
    /// (host directory, container directory)
    dirs: Vec<(String, String)>,
    forwards: Vec<ForwardRecord>,
}

impl ForwardMounts {
    fn is_empty(&self) -> bool {
        self.forwards.is_empty()
    }
}

/// A forward as the handle's data records it.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct ForwardRecord {
    port: u16,
    /// The socket's path inside the container.
    path: String,
}

/// Check the spec's network policy and forwards; where they are mounted.
fn forward_mounts(spec: &SandboxSpec) -> Result<ForwardMounts> {
    let mut mounts = ForwardMounts::default();
    let mut ports = Vec::new();
    spec.check_forwards()?;
    for forward in &spec.forwards {
        ports.push(forward.port);
        let (dir, file) = match forward.socket.rsplit_once('/') {
            Some((dir, file)) if forward.socket.starts_with('/') && !file.is_empty() => {
                (if dir.is_empty() { "/" } else { dir }, file)
            }
            _ => {
                return Err(Error::invalid(format!(
                    "forward socket {:?} must be an absolute host path naming a socket",
                    forward.socket
                )))
            }
        };
        if dir == "/" || dir.contains(':') {
            // `/` would mount the host's root; `:` breaks the bind syntax.
            return Err(Error::invalid(format!(
                "forward socket {:?} must be in a directory of its own (its directory is \
                 mounted into the container)",
                forward.socket
            )));
        }
        let n = match mounts.dirs.iter().position(|(host, _)| host == dir) {
            Some(n) => n,
            None => {
                mounts.dirs.push((
                    dir.to_string(),
                    format!("{FORWARD_DIRS_IN_CONTAINER}/{}", mounts.dirs.len()),
                ));
                mounts.dirs.len() - 1
            }
        };
        mounts.forwards.push(ForwardRecord {
            port: forward.port,
            path: format!("{}/{file}", mounts.dirs[n].1),
        });
    }
    if matches!(spec.network, NetworkPolicy::Custom { .. }) && !ports.contains(&EGRESS_PROXY_PORT) {
        return Err(Error::invalid(format!(
            "custom network policy needs the egress proxy forward on port {EGRESS_PROXY_PORT}; \
             the harness runtime adds it when a model broker is configured"
        )));
    }
    Ok(mounts)
}

/// Undo `forward_dirs::link` for `linked` (best effort: on the way out of
/// a failed take).
fn undo_links(linked: &[(PathBuf, PathBuf)]) {
    for (session_dir, pool_dir) in linked {
        if let Err(e) = forward_dirs::unlink(session_dir, pool_dir) {
            tracing::warn!("moving the sockets of {} back: {e}", session_dir.display());
        }
    }
}

/// The forwards a handle's data records, as the gate takes them.
fn forwards_in(data: &serde_json::Value) -> Vec<harness_sandbox_gate::Forward> {
    data.get("forwards")
        .and_then(|f| serde_json::from_value::<Vec<ForwardRecord>>(f.clone()).ok())
        .unwrap_or_default()
        .into_iter()
        .map(|f| harness_sandbox_gate::Forward::new(f.port, f.path))
        .collect()
}

fn parent_dir(path: &str) -> String {
    match path.trim_end_matches('/').rsplit_once('/') {
        Some(("", _)) | None => "/".into(),
        Some((parent, _)) => parent.into(),
    }
}

/// A container name from the session id and the slot, each as
/// [`harness_core::sandbox::name_part`] makes them, or a random suffix
/// without a slot: `harness-<session>-slot-<turn>`. A container a session
/// took from a pool carries no session label, so its name is how it is
/// found.
fn container_name(session: Option<&str>, role: &str, slot: Option<&str>) -> String {
    let session = harness_core::sandbox::name_part(session.unwrap_or(""));
    let suffix = match slot
        .map(harness_core::sandbox::name_part)
        .filter(|s| !s.is_empty())
    {
        Some(slot) if !session.is_empty() => format!("slot-{slot}"),
        _ => uuid::Uuid::new_v4().simple().to_string()[..10].to_string(),
    };
    if session.is_empty() {
        format!("harness-{role}-{suffix}")
    } else {
        format!("harness-{session}-{suffix}")
    }
}

/// `n` distinct free TCP ports on 127.0.0.1 (all held until every one is
/// chosen, so they differ from each other).
fn free_ports(n: usize) -> Result<Vec<u16>> {
    let listeners = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0"))
        .collect::<std::io::Result<Vec<_>>>()?;
    listeners
        .iter()
        .map(|l| Ok(l.local_addr()?.port()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parent_dir_handles_root_and_nesting() {
        assert_eq!(parent_dir("/a"), "/");
        assert_eq!(parent_dir("/a/b/c.txt"), "/a/b");
    }

    #[test]
    fn container_names_are_valid_for_docker() {
        let name = container_name(Some("s/1 ü"), "session", None);
        assert!(name.starts_with("harness-s-1--"), "{name}");
        assert!(name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_'));
    }

    #[test]
    fn free_ports_are_distinct() {
        let ports = free_ports(4).unwrap();
        let mut sorted = ports.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), 4);
    }
}
