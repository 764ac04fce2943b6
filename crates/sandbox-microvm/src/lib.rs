//! A harness sandbox backend on QEMU's `microvm` machine.
//!
//! Each sandbox is one VM: the Debian kernel booted PVH, an initramfs that
//! mounts the sandbox's disk (a qcow2 overlay on the root image, or on a
//! bootstrap snapshot) and hands PID 1 to the guest agent
//! (`harness-microvm-agent`), which serves framed exec requests over a
//! virtio-serial port whose host end is a Unix socket. Files and trees move
//! through commands the agent runs (`cat`, GNU `tar`), so no directory is
//! shared with the host. QEMU runs daemonized, so a VM outlives the process
//! that made it; its directory (disk, socket, pidfile, console log,
//! `vm.json`) is all a handle needs.
//!
//! KVM is used where it can really boot a guest (a short probe boot,
//! cached); elsewhere the guest runs under TCG. Network: `deny-all` is a VM
//! without a NIC, `allow-all` user-mode networking (the host's loopback is
//! `10.0.2.2` inside); host forwards are QEMU `guestfwd` rules running the
//! host copy of the agent as a relay, on restricted user-mode networking
//! unless allow-all, and `custom` is that plus the egress proxy's forward.
//! See `docs/sandbox-microvm.md`.

mod conn;
mod exec;
mod guest_files;
#[cfg(feature = "microsandbox")]
mod msb;
mod vm;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures::StreamExt;
use harness_core::bootstrap::{self, BootstrapRecipe, HostFiles, SnapshotStore};
use harness_core::sandbox::{
    export_tar_by_exec, poll_detached_by_exec, resolve_path, shell_quote, DetachedProcess,
    DetachedStatus, ExecRequest, ExecStream, NetworkPolicy, PortEndpoint, Sandbox, SandboxHandle,
    SandboxProvider, SandboxSpec, SnapshotInfo, EGRESS_PROXY_PORT,
};
use harness_core::stream::ByteStream;
use harness_core::{Error, ErrorKind, Result};
use serde::Deserialize;

use guest_files::StdinShell as _;
#[cfg(feature = "microsandbox")]
pub use msb::{MicrosandboxConfig, MicrosandboxProvider, MicrosandboxSandbox, MSB_PROVIDER};
pub use vm::Accel;
use vm::{VmDir, VmMeta};

/// The provider name in handles.
pub const PROVIDER: &str = "microvm";

/// The environment every command starts from (then the spec's, then the
/// request's).
const BASE_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Where the provider finds QEMU and the guest, and keeps its VMs.
#[derive(Debug, Clone)]
pub struct MicrovmConfig {
    /// The uncompressed kernel (`vmlinux`, booted PVH).
    pub kernel: PathBuf,
    /// The initramfs holding busybox, the modules, the init script and the agent.
    pub initramfs: PathBuf,
    /// The root disk image (raw ext4) every VM's overlay starts from.
    pub rootfs: PathBuf,
    /// The agent binary on the host (static), which QEMU runs as
    /// `agent relay SOCKET` per connection to a host forward. `None`: host
    /// forwards (and so `custom` networking) are refused.
    pub agent: Option<PathBuf>,
    /// A key of the root image's content: part of every bootstrap identity.
    pub rootfs_key: String,
    /// VMs (`vms/<id>/`) and bootstrap snapshots (`snapshots/`).
    pub state_dir: PathBuf,
    /// `qemu-system-x86_64`.
    pub qemu: PathBuf,
    /// `qemu-img`.
    pub qemu_img: PathBuf,
    /// `None`: probe whether KVM boots a guest (cached in `probe_cache`),
    /// else TCG.
    pub accel: Option<Accel>,
    /// Where the probe's answer is kept.
    pub probe_cache: PathBuf,
    /// vCPUs when the spec names none.
    pub default_cpus: u32,
    /// Memory when the spec names none.
    pub default_memory_mb: u64,
    /// Longest a boot may take until the agent answers.
    pub boot_timeout: Duration,
}

#[derive(Debug, Deserialize)]
struct Assets {
    #[serde(default)]
    agent: Option<PathBuf>,
    kernel: PathBuf,
    initramfs: PathBuf,
    rootfs: PathBuf,
    rootfs_key: String,
}

impl MicrovmConfig {
    /// The guest `cargo xtask microvm` built into `assets_dir` (its
    /// `assets.json`), with VMs kept under `state_dir`.
    pub fn from_assets(
        assets_dir: impl AsRef<Path>,
        state_dir: impl Into<PathBuf>,
    ) -> Result<Self> {
        let dir = assets_dir.as_ref();
        let manifest = dir.join("assets.json");
        let text = std::fs::read_to_string(&manifest).map_err(|e| {
            Error::not_found(format!(
                "{}: {e} (build the guest with `cargo xtask microvm`)",
                manifest.display()
            ))
        })?;
        let assets: Assets = serde_json::from_str(&text)
            .map_err(|e| Error::corrupt(format!("{}: {e}", manifest.display())))?;
        for p in [&assets.kernel, &assets.initramfs, &assets.rootfs] {
            if !p.exists() {
                return Err(Error::not_found(format!(
                    "{} names {}, which is missing (run `cargo xtask microvm`)",
                    manifest.display(),
                    p.display()
                )));
            }
        }
        let accel = match std::env::var("HARNESS_MICROVM_ACCEL").as_deref() {
            Ok("kvm") => Some(Accel::Kvm),
            Ok("tcg") => Some(Accel::Tcg),
            _ => None,
        };
        Ok(Self {
            kernel: assets.kernel,
            initramfs: assets.initramfs,
            rootfs: assets.rootfs,
            agent: assets.agent.filter(|a| a.exists()),
            rootfs_key: assets.rootfs_key,
            state_dir: state_dir.into(),
            qemu: "qemu-system-x86_64".into(),
            qemu_img: "qemu-img".into(),
            accel,
            probe_cache: dir.join("accel-probe.json"),
            default_cpus: 1,
            default_memory_mb: 1024,
            boot_timeout: Duration::from_secs(120),
        })
    }

    fn vms(&self) -> PathBuf {
        self.state_dir.join("vms")
    }

    fn snapshots(&self) -> PathBuf {
        self.state_dir.join("snapshots")
    }

    /// The base every bootstrap identity is computed against.
    fn identity_base(&self) -> String {
        format!("microvm:{}", self.rootfs_key)
    }
}

/// Creates and resumes microVM sandboxes.
#[derive(Debug, Clone)]
pub struct MicrovmProvider {
    config: Arc<MicrovmConfig>,
    accel: Arc<tokio::sync::OnceCell<Accel>>,
}

impl MicrovmProvider {
    /// A provider over `config`. QEMUs of this provider whose VM directory
    /// was removed without a `destroy` (unreachable: their socket is gone)
    /// are killed.
    pub fn new(config: MicrovmConfig) -> Self {
        let swept = vm::sweep_orphans();
        if swept > 0 {
            tracing::warn!("killed {swept} orphaned microVM(s) whose directory was gone");
        }
        Self {
            config: Arc::new(config),
            accel: Arc::new(tokio::sync::OnceCell::new()),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &MicrovmConfig {
        &self.config
    }

    /// KVM or TCG: the configured one, else the cached probe's answer, else
    /// a probe boot under KVM (20 s at most) whose answer is cached.
    pub async fn accel(&self) -> Accel {
        *self
            .accel
            .get_or_init(|| async {
                if let Some(a) = self.config.accel {
                    return a;
                }
                // Whether KVM boots a guest depends on the host, QEMU and
                // the kernel, not on the agent: keyed on those.
                let key = format!(
                    "{} {}",
                    self.config.qemu.display(),
                    self.config.kernel.display()
                );
                let cached = |path: &Path| -> Option<Accel> {
                    let text = std::fs::read_to_string(path).ok()?;
                    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
                    if v["key"] != key.as_str() {
                        return None;
                    }
                    serde_json::from_value::<Accel>(v["accel"].clone()).ok()
                };
                if let Some(a) = cached(&self.config.probe_cache) {
                    return a;
                }
                // One probe at a time across processes (parallel tests):
                // the others wait and read its answer.
                let lock_path = self.config.probe_cache.with_extension("lock");
                let _lock = tokio::task::spawn_blocking(move || {
                    let f = std::fs::File::options()
                        .create(true)
                        .truncate(false)
                        .write(true)
                        .open(lock_path)
                        .ok()?;
                    f.lock().ok()?;
                    Some(f)
                })
                .await
                .ok()
                .flatten();
                if let Some(a) = cached(&self.config.probe_cache) {
                    return a;
                }
                let (accel, why) = self.probe_kvm().await;
                tracing::info!("microvm: using {} ({why})", accel.as_str());
                let record = serde_json::json!({"key": key, "accel": accel, "why": why});
                let tmp = self.config.probe_cache.with_extension("tmp");
                if std::fs::write(&tmp, record.to_string()).is_ok() {
                    let _ = std::fs::rename(&tmp, &self.config.probe_cache);
                }
                accel
            })
            .await
    }

    async fn probe_kvm(&self) -> (Accel, String) {
        if std::fs::File::options()
            .read(true)
            .write(true)
            .open("/dev/kvm")
            .is_err()
        {
            return (Accel::Tcg, "/dev/kvm cannot be opened".into());
        }
        let dir = VmDir(
            self.config
                .vms()
                .join(format!("probe-{}", uuid::Uuid::new_v4().simple())),
        );
        let started = Instant::now();
        let result = async {
            std::fs::create_dir_all(&dir.0)?;
            vm::overlay(&self.config, &self.config.rootfs, &dir.disk()).await?;
            let meta = self.meta_for(
                "probe".into(),
                "/".into(),
                BTreeMap::new(),
                NetworkPolicy::DenyAll,
                1,
                256,
                BTreeMap::new(),
                Accel::Kvm,
            );
            dir.write_meta(&meta)?;
            vm::start(&self.config, &dir, &meta).await?;
            self.wait_agent(&dir, Duration::from_secs(20)).await
        }
        .await;
        vm::kill(&dir).await;
        let _ = std::fs::remove_dir_all(&dir.0);
        match result {
            Ok(()) => (
                Accel::Kvm,
                format!("a KVM guest booted in {:?}", started.elapsed()),
            ),
            Err(e) => (Accel::Tcg, format!("no KVM guest answered: {e}")),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn meta_for(
        &self,
        id: String,
        workdir: String,
        env: BTreeMap<String, String>,
        network: NetworkPolicy,
        cpus: u32,
        memory_mb: u64,
        ports: BTreeMap<u16, u16>,
        accel: Accel,
    ) -> VmMeta {
        VmMeta {
            id,
            workdir,
            env,
            network,
            cpus,
            memory_mb,
            ports,
            accel,
            kernel: self.config.kernel.clone(),
            initramfs: self.config.initramfs.clone(),
            forwards: Vec::new(),
            agent: None,
        }
    }

    /// Wait until the VM's agent answers, failing early if QEMU exits.
    async fn wait_agent(&self, dir: &VmDir, limit: Duration) -> Result<()> {
        let socket = dir.socket();
        let greet = conn::lease(&socket, limit);
        tokio::pin!(greet);
        let mut tick = tokio::time::interval(Duration::from_millis(200));
        loop {
            tokio::select! {
                r = &mut greet => {
                    return r.map(drop).map_err(|e| Error::backend(format!(
                        "{}; guest console:\n{}", e.message(), dir.console_tail()
                    )));
                }
                _ = tick.tick() => {
                    if dir.running_pid().is_none() && dir.pidfile().exists() {
                        return Err(Error::backend(format!(
                            "the microVM exited while booting; guest console:\n{}",
                            dir.console_tail()
                        )));
                    }
                }
            }
        }
    }

    fn sandbox(&self, dir: VmDir, meta: VmMeta) -> MicrovmSandbox {
        MicrovmSandbox {
            socket: dir.socket(),
            dir,
            meta,
        }
    }

    /// Boot the VM in `dir` (already holding its disk and meta).
    async fn boot(&self, dir: &VmDir, meta: &VmMeta) -> Result<()> {
        conn::forget(&dir.socket());
        vm::start(&self.config, dir, meta).await?;
        self.wait_agent(dir, self.config.boot_timeout).await
    }

    fn vm_id(spec: &SandboxSpec) -> String {
        let clean = harness_core::sandbox::name_part;
        match (&spec.session_id, &spec.slot) {
            (Some(session), Some(slot)) => format!("mvm-{}-{}", clean(session), clean(slot)),
            _ => format!("mvm-{}", uuid::Uuid::new_v4().simple()),
        }
    }

    async fn make(
        &self,
        spec: &SandboxSpec,
        backing: &Path,
        id: String,
        network: NetworkPolicy,
    ) -> Result<MicrovmSandbox> {
        let dir = VmDir(self.config.vms().join(&id));
        if dir.0.exists() {
            // A leftover of the same session and slot: replace it.
            vm::kill(&dir).await;
            conn::forget(&dir.socket());
            std::fs::remove_dir_all(&dir.0)?;
        }
        std::fs::create_dir_all(&dir.0)?;
        if dir.socket().display().to_string().len() > 100 {
            return Err(Error::invalid(format!(
                "the VM socket path {} is too long for a Unix socket: use a shorter state_dir",
                dir.socket().display()
            )));
        }
        let mut ports = BTreeMap::new();
        for p in &spec.ports {
            ports.insert(*p, vm::free_port()?);
        }
        let cpus = spec
            .cpus
            .map(|c| c.ceil().max(1.0) as u32)
            .unwrap_or(self.config.default_cpus);
        let memory_mb = spec
            .memory_mb
            .unwrap_or(self.config.default_memory_mb)
            .max(128);
        let accel = self.accel().await;
        let mut meta = self.meta_for(
            id,
            spec.workdir.clone(),
            spec.env.clone(),
            network,
            cpus,
            memory_mb,
            ports,
            accel,
        );
        meta.forwards = spec.forwards.clone();
        meta.agent = self.config.agent.clone();
        let result = async {
            vm::overlay(&self.config, backing, &dir.disk()).await?;
            dir.write_meta(&meta)?;
            self.boot(&dir, &meta).await?;
            let sandbox = self.sandbox(dir.clone(), meta.clone());
            sandbox
                .sh(&format!("mkdir -p {}", shell_quote(&meta.workdir)))
                .await?;
            Ok::<_, Error>(sandbox)
        }
        .await;
        if result.is_err() {
            vm::kill(&dir).await;
            conn::forget(&dir.socket());
            let _ = std::fs::remove_dir_all(&dir.0);
        }
        result
    }
}

/// Reads recipe host files with tokio.
#[derive(Debug)]
struct TokioFiles;

#[async_trait]
impl HostFiles for TokioFiles {
    async fn open(&self, path: &str) -> Result<ByteStream> {
        let f = tokio::fs::File::open(path).await?;
        Ok(Box::pin(
            tokio_util_like::reader_stream(f).map(|c| c.map_err(Error::from)),
        ))
    }
}

mod tokio_util_like {
    //! A byte stream over an `AsyncRead` (without pulling in tokio-util).
    use bytes::Bytes;
    use tokio::io::AsyncReadExt;

    pub fn reader_stream(
        r: impl tokio::io::AsyncRead + Unpin + Send + 'static,
    ) -> impl futures::Stream<Item = std::io::Result<Bytes>> + Send {
        futures::stream::unfold(Some(r), |state| async move {
            let mut r = state?;
            let mut buf = vec![0u8; 256 * 1024];
            match r.read(&mut buf).await {
                Ok(0) => None,
                Ok(n) => {
                    buf.truncate(n);
                    Some((Ok(Bytes::from(buf)), Some(r)))
                }
                Err(e) => Some((Err(e), None)),
            }
        })
    }
}

/// Bootstrap snapshots: `snapshots/<identity>.qcow2`, the disk of a VM the
/// recipe ran in (an overlay on the root image), which sessions' disks are
/// overlays on.
struct Snapshots<'a>(&'a MicrovmProvider);

#[async_trait]
impl SnapshotStore for Snapshots<'_> {
    type Lock = std::fs::File;

    async fn lock(&self, identity: &str) -> Result<std::fs::File> {
        let path = self.0.config.snapshots().join(format!("{identity}.lock"));
        tokio::task::spawn_blocking(move || -> Result<std::fs::File> {
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir)?;
            }
            let file = std::fs::File::options()
                .create(true)
                .truncate(false)
                .write(true)
                .open(&path)?;
            file.lock()?;
            Ok(file)
        })
        .await
        .map_err(|e| Error::backend(format!("snapshot lock task failed: {e}")))?
    }

    async fn exists(&self, identity: &str) -> Result<bool> {
        Ok(self
            .0
            .config
            .snapshots()
            .join(format!("{identity}.qcow2"))
            .exists())
    }

    async fn build(&self, identity: &str, recipe: &BootstrapRecipe) -> Result<()> {
        let provider = self.0;
        let id = format!("bootstrap-{}", uuid::Uuid::new_v4().simple());
        // The recipe may fetch things: it runs with user-mode networking.
        let sandbox = provider
            .make(
                &SandboxSpec::new("/"),
                &provider.config.rootfs,
                id,
                NetworkPolicy::AllowAll,
            )
            .await?;
        let result = async {
            bootstrap::run_recipe(&sandbox, recipe, &TokioFiles).await?;
            sandbox.poweroff().await?;
            let target = provider
                .config
                .snapshots()
                .join(format!("{identity}.qcow2"));
            std::fs::rename(sandbox.dir.disk(), &target)?;
            Ok::<(), Error>(())
        }
        .await;
        vm::kill(&sandbox.dir).await;
        conn::forget(&sandbox.socket);
        let _ = std::fs::remove_dir_all(&sandbox.dir.0);
        result
    }
}

#[async_trait]
impl SandboxProvider for MicrovmProvider {
    fn name(&self) -> &'static str {
        PROVIDER
    }

    async fn create(&self, spec: &SandboxSpec) -> Result<Box<dyn Sandbox>> {
        if spec.wrap.is_some() {
            return Err(Error::unsupported(
                "the microvm provider cannot wrap an existing VM",
            ));
        }
        if !spec.forwards.is_empty() && self.config.agent.is_none() {
            return Err(Error::unsupported(
                "the microvm provider was given no host agent binary (assets.json `agent`), \
                 which host forwards run through",
            ));
        }
        spec.check_forwards()?;
        for f in &spec.forwards {
            if f.socket.contains(',') || f.socket.contains(char::is_whitespace) {
                return Err(Error::invalid(format!(
                    "forward socket path {:?} holds a comma or a space, which QEMU's option \
                     syntax cannot carry",
                    f.socket
                )));
            }
        }
        match &spec.network {
            NetworkPolicy::AllowAll => {}
            NetworkPolicy::DenyAll => {
                if !spec.ports.is_empty() {
                    return Err(Error::invalid(format!(
                        "ports {:?} cannot be exposed from a deny-all microVM",
                        spec.ports
                    )));
                }
            }
            NetworkPolicy::Custom { .. } => {
                if !spec.forwards.iter().any(|f| f.port == EGRESS_PROXY_PORT) {
                    return Err(Error::invalid(format!(
                        "a custom network policy needs the egress proxy forward on port \
                         {EGRESS_PROXY_PORT}: the microVM has no route out but through it"
                    )));
                }
                if !spec.ports.is_empty() {
                    return Err(Error::invalid(format!(
                        "ports {:?} cannot be exposed from a custom-policy microVM",
                        spec.ports
                    )));
                }
            }
        }
        if !spec.workdir.starts_with('/') {
            return Err(Error::invalid(format!(
                "workdir {:?} must be absolute",
                spec.workdir
            )));
        }
        let id = Self::vm_id(spec);
        match spec.bootstrap.as_ref().filter(|r| !r.is_empty()) {
            None => {
                let sb = self
                    .make(spec, &self.config.rootfs, id, spec.network.clone())
                    .await?;
                Ok(Box::new(sb))
            }
            Some(recipe) => {
                let base = self.config.identity_base();
                let (identity, _lock) =
                    bootstrap::ensure_snapshot(&Snapshots(self), &base, recipe).await?;
                let backing = self.config.snapshots().join(format!("{identity}.qcow2"));
                // The lock is held until the overlay exists (prune waits).
                let sb = self.make(spec, &backing, id, spec.network.clone()).await?;
                Ok(Box::new(sb))
            }
        }
    }

    async fn resume(&self, handle: &SandboxHandle) -> Result<Box<dyn Sandbox>> {
        if handle.provider != PROVIDER {
            return Err(Error::invalid(format!(
                "a {:?} handle cannot be resumed by the microvm provider",
                handle.provider
            )));
        }
        let dir = match handle.data["dir"].as_str() {
            Some(d) => VmDir(PathBuf::from(d)),
            None => VmDir(self.config.vms().join(&handle.id)),
        };
        let meta = dir.read_meta()?;
        if meta.id != handle.id {
            return Err(Error::not_found(format!(
                "{} holds VM {:?}, not {:?}",
                dir.0.display(),
                meta.id,
                handle.id
            )));
        }
        if dir.running_pid().is_none() {
            self.boot(&dir, &meta).await?;
        }
        Ok(Box::new(self.sandbox(dir, meta)))
    }

    async fn list_snapshots(&self) -> Result<Vec<SnapshotInfo>> {
        let mut out = Vec::new();
        let rd = match std::fs::read_dir(self.config.snapshots()) {
            Ok(rd) => rd,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
            Err(e) => return Err(e.into()),
        };
        for entry in rd.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if let Some(identity) = name.strip_suffix(".qcow2") {
                out.push(SnapshotInfo {
                    identity: identity.to_string(),
                    reference: entry.path().display().to_string(),
                    size_bytes: entry.metadata().ok().map(|m| m.len()),
                });
            }
        }
        out.sort_by(|a, b| a.identity.cmp(&b.identity));
        Ok(out)
    }

    async fn prune_snapshots(&self, keep: &[String]) -> Result<Vec<SnapshotInfo>> {
        let mut removed = Vec::new();
        for snap in self.list_snapshots().await? {
            if keep.contains(&snap.identity) {
                continue;
            }
            let _lock = Snapshots(self).lock(&snap.identity).await?;
            // Sessions' disks are overlays on it: keep it while one exists.
            let used = std::fs::read_dir(self.config.vms())
                .map(|rd| {
                    rd.flatten().any(|e| {
                        std::fs::read(e.path().join("disk.qcow2"))
                            .map(|b| {
                                let head = &b[..b.len().min(4096)];
                                String::from_utf8_lossy(head).contains(&snap.reference)
                            })
                            .unwrap_or(false)
                    })
                })
                .unwrap_or(false);
            if used {
                continue;
            }
            std::fs::remove_file(&snap.reference)?;
            removed.push(snap);
        }
        Ok(removed)
    }
}

/// A live microVM sandbox.
#[derive(Debug)]
pub struct MicrovmSandbox {
    dir: VmDir,
    socket: PathBuf,
    meta: VmMeta,
}

impl MicrovmSandbox {
    /// How this VM runs its CPU.
    pub fn accel(&self) -> Accel {
        self.meta.accel
    }

    /// The guest console log on the host.
    pub fn console_log(&self) -> PathBuf {
        self.dir.console()
    }

    fn env_for(&self, extra: &BTreeMap<String, String>) -> BTreeMap<String, String> {
        let mut env = BTreeMap::new();
        env.insert("PATH".to_string(), BASE_PATH.to_string());
        env.insert("HOME".to_string(), "/root".to_string());
        env.insert("LANG".to_string(), "C.UTF-8".to_string());
        env.extend(self.meta.env.clone());
        env.extend(extra.clone());
        env
    }

    async fn start(
        &self,
        argv: Vec<String>,
        cwd: Option<&str>,
        env: &BTreeMap<String, String>,
        stdin: Option<ByteStream>,
        timeout: Option<Duration>,
        abort: Option<harness_core::stream::AbortSignal>,
    ) -> Result<ExecStream> {
        if argv.is_empty() {
            return Err(Error::invalid("empty argv"));
        }
        let cwd = cwd
            .map(|c| resolve_path(&self.meta.workdir, c))
            .unwrap_or_else(|| self.meta.workdir.clone());
        exec::start(
            &self.socket,
            Duration::from_secs(60),
            exec::Plan {
                argv,
                env: self.env_for(env),
                cwd,
                stdin,
                timeout,
                abort,
            },
        )
        .await
        .map_err(|e| {
            if e.kind() == ErrorKind::Backend && self.dir.running_pid().is_none() {
                Error::not_found(format!(
                    "the microVM {} is not running: {}",
                    self.meta.id,
                    e.message()
                ))
            } else if e.kind() == ErrorKind::Backend {
                Error::backend(format!(
                    "{}; guest console:\n{}",
                    e.message(),
                    self.dir.console_tail()
                ))
            } else {
                e
            }
        })
    }

    /// Flush the guest's disks and power it off; returns when QEMU is gone.
    async fn poweroff(&self) -> Result<()> {
        if self.dir.running_pid().is_some() {
            if let Ok(lease) = conn::lease(&self.socket, Duration::from_secs(30)).await {
                let _ = lease.send(&harness_microvm_agent::Host::Poweroff, b"");
            }
            if !vm::wait_gone(&self.dir, Duration::from_secs(30)).await {
                tracing::warn!("microVM {} did not power off; killing it", self.meta.id);
                vm::kill(&self.dir).await;
            }
        }
        conn::forget(&self.socket);
        Ok(())
    }
}

#[async_trait]
impl guest_files::StdinShell for MicrovmSandbox {
    async fn start_script(&self, script: String, stdin: Option<ByteStream>) -> Result<ExecStream> {
        self.start(
            vec!["sh".into(), "-c".into(), script],
            Some("/"),
            &BTreeMap::new(),
            stdin,
            None,
            None,
        )
        .await
    }
}

#[async_trait]
impl Sandbox for MicrovmSandbox {
    fn handle(&self) -> SandboxHandle {
        SandboxHandle {
            provider: PROVIDER.into(),
            id: self.meta.id.clone(),
            workdir: self.meta.workdir.clone(),
            owned: true,
            data: serde_json::json!({
                "dir": self.dir.0.display().to_string(),
                "accel": self.meta.accel,
            }),
        }
    }

    fn workdir(&self) -> &str {
        &self.meta.workdir
    }

    async fn exec(&self, request: ExecRequest) -> Result<ExecStream> {
        let stdin = request.stdin.map(harness_core::stream::once);
        self.start(
            request.argv,
            request.cwd.as_deref(),
            &request.env,
            stdin,
            request.timeout,
            request.abort,
        )
        .await
    }

    async fn read_file(&self, path: &str) -> Result<ByteStream> {
        guest_files::read_file(self, resolve_path(&self.meta.workdir, path)).await
    }

    async fn poll_detached(
        &self,
        process: &DetachedProcess,
        offset: u64,
    ) -> Result<(DetachedStatus, ByteStream)> {
        // The status probe and the read in one exec, not two, on every poll.
        poll_detached_by_exec(self, process, offset).await
    }

    async fn write_file(&self, path: &str, content: ByteStream) -> Result<u64> {
        guest_files::write_file(self, resolve_path(&self.meta.workdir, path), content).await
    }

    async fn export_tar(&self, dir: &str) -> Result<ByteStream> {
        export_tar_by_exec(self, &resolve_path(&self.meta.workdir, dir)).await
    }

    async fn import_tar(&self, dir: &str, tar: ByteStream) -> Result<()> {
        guest_files::import_tar(self, resolve_path(&self.meta.workdir, dir), tar).await
    }

    async fn port_endpoint(&self, port: u16) -> Result<PortEndpoint> {
        match self.meta.ports.get(&port) {
            Some(host) => Ok(PortEndpoint {
                sandbox_port: port,
                host: "127.0.0.1".into(),
                port: *host,
            }),
            None => Err(Error::not_found(format!(
                "port {port} was not requested when the microVM was created"
            ))),
        }
    }

    async fn stop(&self) -> Result<SandboxHandle> {
        self.poweroff().await?;
        Ok(self.handle())
    }

    async fn destroy(&self) -> Result<()> {
        vm::kill(&self.dir).await;
        conn::forget(&self.socket);
        match std::fs::remove_dir_all(&self.dir.0) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e.into()),
        }
    }
}
