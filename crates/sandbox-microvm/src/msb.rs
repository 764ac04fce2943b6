//! The `microsandbox` engine (cargo feature `microsandbox`, off by default):
//! sandboxes as libkrun microVMs run by the microsandbox runtime (`msb`
//! with `libkrunfw`), driven through its Rust SDK. A thin adapter: the SDK
//! boots the VM, runs commands through its own guest agent and keeps the
//! sandboxes in its database under `MSB_HOME`; this module maps the
//! harness contract onto that.
//!
//! - **Root filesystem:** a local directory (a Debian rootfs with GNU
//!   coreutils and tar). The SDK uses a directory root as it is, so every
//!   sandbox gets its own copy (`cp -a --reflink=auto`) under
//!   [`MicrosandboxConfig::state_dir`], removed with the sandbox.
//! - **Exec:** streamed stdout/stderr from the SDK's exec sessions. Abort and
//!   timeout kill the command's whole process tree (a short script in the
//!   guest walks `/proc` from the command's pid) and report `Aborted` /
//!   `TimedOut`. The SDK reports an exit code only; a negative code is taken
//!   as the signal that ended the process.
//! - **Files and trees** go through commands, as for the QEMU provider
//!   (core's `export_tar_by_exec`, `extract_tar_script` behind `tarscan`).
//! - **Network:** `allow-all` is the SDK's allow-all policy; `deny-all` a VM
//!   with networking disabled. `custom` policies and host forwards are
//!   refused with `Unsupported` (the SDK has its own policy engine and no
//!   Unix-socket forwards; wiring the harness egress proxy through it is not
//!   done). Ports are published on 127.0.0.1 (allow-all only).
//! - **Not supported:** wrap-mode and bootstrap snapshots (`Unsupported`).
//!
//! The runtime is found the SDK's way: `MSB_PATH` and `MSB_LIBKRUNFW_PATH`
//! (or [`MicrosandboxConfig::msb`] / [`MicrosandboxConfig::libkrunfw`]);
//! the SDK and `msb` versions must match. It needs a KVM that can boot a
//! guest: where it cannot (a software KVM such as `kvm_pvm`), creating a
//! sandbox fails, and [`MicrosandboxProvider::boot_probe`] says so. See
//! `docs/sandbox-microvm.md`, "The microsandbox engine".

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures::StreamExt;
use harness_core::sandbox::{
    collect_exec, export_tar_by_exec, poll_detached_by_exec, resolve_path, shell_quote,
    DetachedProcess, DetachedStatus, ExecEvent, ExecRequest, ExecStream, ExitReason, ExitStatus,
    NetworkPolicy, PortEndpoint, Sandbox, SandboxHandle, SandboxProvider, SandboxSpec,
};
use harness_core::stream::{AbortSignal, ByteStream};
use harness_core::{Error, ErrorKind, Result};
use microsandbox as sdk;
use tokio::sync::oneshot;

use crate::guest_files::{self, aborted, sleep_until, stdin_failure, StdinShell as _};
use crate::BASE_PATH;

/// The provider name in handles.
pub const MSB_PROVIDER: &str = "microsandbox";

/// How long a killed command's output may still drain before its exit is
/// reported without the guest agent's word.
const DRAIN_AFTER_KILL: Duration = Duration::from_secs(5);

/// Where the microsandbox engine finds its runtime and root filesystem.
#[derive(Debug, Clone)]
pub struct MicrosandboxConfig {
    /// The root filesystem directory every sandbox's private copy is made from.
    pub rootfs: PathBuf,
    /// The copies of the root filesystem (`rootfs/<sandbox>/`).
    pub state_dir: PathBuf,
    /// The SDK's home (database, runtime sockets, logs). `None`: the SDK's
    /// own choice (`MSB_HOME`, else `~/.microsandbox`). Keep one home per
    /// SDK version: the database is migrated by the version that opens it.
    pub home: Option<PathBuf>,
    /// The `msb` binary, when `MSB_PATH` does not name one (the variable wins).
    pub msb: Option<PathBuf>,
    /// `libkrunfw`, when `MSB_LIBKRUNFW_PATH` does not name it (the variable wins).
    pub libkrunfw: Option<PathBuf>,
    /// vCPUs when the spec names none.
    pub default_cpus: u8,
    /// Memory when the spec names none.
    pub default_memory_mb: u32,
}

impl MicrosandboxConfig {
    /// Sandboxes from copies of `rootfs`, kept under `state_dir`, with the
    /// SDK's own home and runtime paths.
    pub fn new(rootfs: impl Into<PathBuf>, state_dir: impl Into<PathBuf>) -> Self {
        Self {
            rootfs: rootfs.into(),
            state_dir: state_dir.into(),
            home: None,
            msb: None,
            libkrunfw: None,
            default_cpus: 1,
            default_memory_mb: 1024,
        }
    }
}

/// Creates and resumes microsandbox sandboxes.
#[derive(Clone)]
pub struct MicrosandboxProvider {
    config: Arc<MicrosandboxConfig>,
    backend: Arc<dyn sdk::Backend>,
}

impl std::fmt::Debug for MicrosandboxProvider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MicrosandboxProvider")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// The SDK's error as a harness error of the nearest kind.
fn sdk_error(what: &str, e: sdk::MicrosandboxError) -> Error {
    use sdk::MicrosandboxError as E;
    let message = format!("microsandbox: {what}: {e}");
    match e {
        E::SandboxNotFound(_) => Error::not_found(message),
        E::InvalidConfig(_) => Error::invalid(message),
        E::Unsupported { .. } => Error::unsupported(message),
        E::SandboxAlreadyExists(_) => Error::conflict(message),
        _ => Error::backend(message),
    }
}

fn is_not_found(e: &sdk::MicrosandboxError) -> bool {
    matches!(e, sdk::MicrosandboxError::SandboxNotFound(_))
}

impl MicrosandboxProvider {
    /// A provider over `config`, with its own local SDK backend (the
    /// configured home). `msb`/`libkrunfw` paths are registered with the SDK
    /// once per process (the SDK keeps the first).
    pub fn new(config: MicrosandboxConfig) -> Result<Self> {
        if let Some(p) = &config.msb {
            sdk::config::set_sdk_msb_path(p.clone());
        }
        if let Some(p) = &config.libkrunfw {
            sdk::set_libkrunfw_path(p.clone());
        }
        let mut builder = sdk::LocalBackend::builder();
        if let Some(home) = &config.home {
            builder = builder.home(home.clone());
        }
        let backend = builder
            .build_lazy()
            .map_err(|e| sdk_error("configuring the local backend", e))?;
        Ok(Self {
            config: Arc::new(config),
            backend: Arc::new(backend),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &MicrosandboxConfig {
        &self.config
    }

    /// Whether this host can boot a microsandbox guest: `/dev/kvm` opens
    /// and a deny-all sandbox boots and runs `true` within `limit`. `Err`
    /// holds why not (e.g. libkrun's `KVM_EXIT_INTERNAL_ERROR` under a
    /// software KVM), for a test to print as its skip reason.
    pub async fn boot_probe(&self, limit: Duration) -> std::result::Result<(), String> {
        if let Err(e) = std::fs::File::options()
            .read(true)
            .write(true)
            .open("/dev/kvm")
        {
            return Err(format!("/dev/kvm cannot be opened: {e}"));
        }
        let mut spec = SandboxSpec::new("/");
        spec.network = NetworkPolicy::DenyAll;
        let name = format!("hmsb-probe-{}", uuid::Uuid::new_v4().simple());
        let started = std::time::Instant::now();
        let attempt = async {
            let sb = self.make(&spec, name.clone()).await?;
            let out = collect_exec(sb.exec(ExecRequest::new(["true"])).await?).await;
            let _ = sb.destroy().await;
            out?.check("true")?;
            Ok::<(), Error>(())
        };
        let result = match tokio::time::timeout(limit, attempt).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(format!(
                "a microsandbox guest did not boot ({}): {}",
                kvm_kind(),
                e.message()
            )),
            Err(_) => Err(format!(
                "a microsandbox guest did not answer within {limit:?} ({})",
                kvm_kind()
            )),
        };
        // A failed or timed-out boot leaves its record and rootfs copy.
        self.remove_leftover(&name).await;
        tracing::info!(
            "microsandbox boot probe: {:?} after {:?}",
            result,
            started.elapsed()
        );
        result
    }

    fn rootfs_copy(&self, name: &str) -> PathBuf {
        self.config.state_dir.join("rootfs").join(name)
    }

    fn sandbox_name(spec: &SandboxSpec) -> String {
        let clean = |s: &str| -> String {
            s.chars()
                .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
                .take(40)
                .collect()
        };
        match (&spec.session_id, &spec.slot) {
            (Some(session), Some(slot)) => format!("hmsb-{}-{}", clean(session), clean(slot)),
            _ => format!("hmsb-{}", uuid::Uuid::new_v4().simple()),
        }
    }

    /// Remove the SDK's record of `name` (stopping it) and its rootfs copy.
    async fn remove_leftover(&self, name: &str) {
        let found = sdk::with_backend(self.backend.clone(), sdk::Sandbox::get(name)).await;
        if let Ok(handle) = found {
            if let Err(e) = handle.destroy().await {
                if !is_not_found(&e) {
                    tracing::warn!("microsandbox: removing leftover {name}: {e}");
                }
            }
        }
        let _ = tokio::fs::remove_dir_all(self.rootfs_copy(name)).await;
    }

    /// The error lines of the runtime's system log for `name` (why a VM
    /// stopped), if any.
    async fn runtime_errors(&self, name: &str) -> Option<String> {
        let handle = sdk::with_backend(self.backend.clone(), sdk::Sandbox::get(name))
            .await
            .ok()?;
        let options = sdk::logs::LogOptions {
            tail: Some(200),
            sources: vec![sdk::logs::LogSource::System],
            ..Default::default()
        };
        let entries = handle.logs(&options).await.ok()?;
        let errors: Vec<String> = entries
            .iter()
            .flat_map(|e| {
                String::from_utf8_lossy(&e.data)
                    .lines()
                    .filter(|l| l.contains("ERROR"))
                    .map(|l| l.trim().to_string())
                    .collect::<Vec<_>>()
            })
            .collect();
        (!errors.is_empty()).then(|| errors[errors.len().saturating_sub(3)..].join(" | "))
    }

    async fn copy_rootfs(&self, name: &str) -> Result<PathBuf> {
        if !self.config.rootfs.join("bin").exists() && !self.config.rootfs.join("usr").exists() {
            return Err(Error::not_found(format!(
                "microsandbox: {} is not a root filesystem directory",
                self.config.rootfs.display()
            )));
        }
        let dest = self.rootfs_copy(name);
        if let Some(parent) = dest.parent() {
            tokio::fs::create_dir_all(parent).await?;
        }
        let out = tokio::process::Command::new("cp")
            .args(["-a", "--reflink=auto"])
            .arg(&self.config.rootfs)
            .arg(&dest)
            .output()
            .await?;
        if !out.status.success() {
            let _ = tokio::fs::remove_dir_all(&dest).await;
            return Err(Error::backend(format!(
                "copying the rootfs {} to {} failed: {}",
                self.config.rootfs.display(),
                dest.display(),
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        Ok(dest)
    }

    async fn make(&self, spec: &SandboxSpec, name: String) -> Result<MicrosandboxSandbox> {
        // A leftover of the same session and slot is replaced.
        self.remove_leftover(&name).await;
        let rootfs = self.copy_rootfs(&name).await?;
        let mut ports = BTreeMap::new();
        for p in &spec.ports {
            let l = std::net::TcpListener::bind("127.0.0.1:0")?;
            ports.insert(*p, l.local_addr()?.port());
        }
        let cpus = spec
            .cpus
            .map(|c| c.ceil().clamp(1.0, 255.0) as u8)
            .unwrap_or(self.config.default_cpus);
        let memory = spec
            .memory_mb
            .map(|m| m.clamp(128, u64::from(u32::MAX)) as u32)
            .unwrap_or(self.config.default_memory_mb);
        let mut env = BTreeMap::new();
        env.insert("PATH".to_string(), BASE_PATH.to_string());
        env.insert("HOME".to_string(), "/root".to_string());
        env.insert("LANG".to_string(), "C.UTF-8".to_string());
        env.extend(spec.env.clone());
        let mut builder = sdk::Sandbox::builder(name.clone())
            .image(rootfs)
            .cpus(cpus)
            .memory(memory)
            .workdir("/")
            .envs(env);
        builder = match &spec.network {
            NetworkPolicy::DenyAll => builder.disable_network(),
            _ => {
                let mut b = builder.network(|n| n.policy(sdk::NetworkPolicy::allow_all()));
                for (guest, host) in &ports {
                    b = b.port(*host, *guest);
                }
                b
            }
        };
        let created =
            sdk::with_backend(self.backend.clone(), builder.detached(true).create()).await;
        let inner = match created {
            Ok(inner) => inner,
            Err(e) => {
                let mut err = sdk_error(&format!("creating {name}"), e);
                if let Some(log) = self.runtime_errors(&name).await {
                    err = Error::new(err.kind(), format!("{}; runtime log: {log}", err.message()));
                }
                self.remove_leftover(&name).await;
                return Err(err);
            }
        };
        let sandbox = MicrosandboxSandbox {
            inner,
            rootfs: self.rootfs_copy(&name).display().to_string(),
            name,
            workdir: spec.workdir.clone(),
            ports,
        };
        if let Err(e) = sandbox
            .sh(&format!("mkdir -p {}", shell_quote(&spec.workdir)))
            .await
        {
            let _ = sandbox.destroy().await;
            return Err(e);
        }
        Ok(sandbox)
    }
}

#[async_trait]
impl SandboxProvider for MicrosandboxProvider {
    fn name(&self) -> &'static str {
        MSB_PROVIDER
    }

    async fn create(&self, spec: &SandboxSpec) -> Result<Box<dyn Sandbox>> {
        if spec.wrap.is_some() {
            return Err(Error::unsupported(
                "the microsandbox provider cannot wrap an existing sandbox",
            ));
        }
        if spec.bootstrap.as_ref().is_some_and(|r| !r.is_empty()) {
            return Err(Error::unsupported(
                "the microsandbox provider keeps no bootstrap snapshots yet",
            ));
        }
        if !spec.forwards.is_empty() {
            return Err(Error::unsupported(
                "the microsandbox provider has no host forwards (Unix sockets on the guest's \
                 loopback)",
            ));
        }
        match &spec.network {
            NetworkPolicy::AllowAll => {}
            NetworkPolicy::DenyAll => {
                if !spec.ports.is_empty() {
                    return Err(Error::invalid(format!(
                        "ports {:?} cannot be exposed from a deny-all microsandbox",
                        spec.ports
                    )));
                }
            }
            NetworkPolicy::Custom { .. } => {
                return Err(Error::unsupported(
                    "the microsandbox provider does not enforce custom network policies (the \
                     harness egress proxy is reached through host forwards, which it lacks)",
                ));
            }
        }
        if !spec.workdir.starts_with('/') {
            return Err(Error::invalid(format!(
                "workdir {:?} must be absolute",
                spec.workdir
            )));
        }
        let sb = self.make(spec, Self::sandbox_name(spec)).await?;
        Ok(Box::new(sb))
    }

    async fn resume(&self, handle: &SandboxHandle) -> Result<Box<dyn Sandbox>> {
        if handle.provider != MSB_PROVIDER {
            return Err(Error::invalid(format!(
                "a {:?} handle cannot be resumed by the microsandbox provider",
                handle.provider
            )));
        }
        let found = sdk::with_backend(self.backend.clone(), sdk::Sandbox::get(&handle.id))
            .await
            .map_err(|e| sdk_error(&format!("finding {}", handle.id), e))?;
        let inner = found
            .connect_or_start_detached()
            .await
            .map_err(|e| sdk_error(&format!("starting {}", handle.id), e))?;
        let ports = handle.data["ports"]
            .as_object()
            .map(|m| {
                m.iter()
                    .filter_map(|(k, v)| Some((k.parse().ok()?, u16::try_from(v.as_u64()?).ok()?)))
                    .collect()
            })
            .unwrap_or_default();
        Ok(Box::new(MicrosandboxSandbox {
            inner,
            name: handle.id.clone(),
            workdir: handle.workdir.clone(),
            ports,
            rootfs: self.rootfs_copy(&handle.id).display().to_string(),
        }))
    }
}

/// A live microsandbox sandbox.
pub struct MicrosandboxSandbox {
    inner: sdk::Sandbox,
    name: String,
    workdir: String,
    /// Sandbox port → host port on 127.0.0.1.
    ports: BTreeMap<u16, u16>,
    /// The private rootfs copy, removed by `destroy`.
    rootfs: String,
}

impl std::fmt::Debug for MicrosandboxSandbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MicrosandboxSandbox")
            .field("name", &self.name)
            .field("workdir", &self.workdir)
            .field("ports", &self.ports)
            .finish_non_exhaustive()
    }
}

impl MicrosandboxSandbox {
    /// Start `argv` with `stdin` streamed in (if any).
    async fn start(
        &self,
        argv: Vec<String>,
        cwd: Option<&str>,
        env: &BTreeMap<String, String>,
        stdin: Option<ByteStream>,
        timeout: Option<Duration>,
        abort: Option<AbortSignal>,
    ) -> Result<ExecStream> {
        let Some((program, args)) = argv.split_first() else {
            return Err(Error::invalid("empty argv"));
        };
        let cwd = cwd
            .map(|c| resolve_path(&self.workdir, c))
            .unwrap_or_else(|| self.workdir.clone());
        let piped = stdin.is_some();
        let env = env.clone();
        let args = args.to_vec();
        let mut handle = self
            .inner
            .exec_stream_with(program.clone(), move |o| {
                let o = o.args(args).cwd(cwd).envs(env);
                if piped {
                    o.stdin_pipe()
                } else {
                    o.stdin_null()
                }
            })
            .await
            .map_err(|e| sdk_error("exec", e))?;
        // Started or Failed comes first: a missing program is an error here.
        let mut pending = None;
        let pid = match handle.recv().await {
            Some(sdk::ExecEvent::Started { pid }) => Some(pid),
            Some(sdk::ExecEvent::Failed(f)) => {
                let kind = if f.errno_name.as_deref() == Some("ENOENT") {
                    ErrorKind::NotFound
                } else {
                    ErrorKind::InvalidInput
                };
                return Err(Error::new(kind, format!("exec {program}: {}", f.message)));
            }
            Some(other) => {
                pending = Some(other);
                None
            }
            None => {
                return Err(Error::backend(
                    "microsandbox: the exec session ended before the command started",
                ))
            }
        };
        let (fail_tx, fail_rx) = oneshot::channel();
        let stdin_failed = stdin.is_some().then_some(fail_rx);
        if let (Some(mut source), Some(sink)) = (stdin, handle.take_stdin()) {
            tokio::spawn(async move {
                while let Some(chunk) = source.next().await {
                    match chunk {
                        Ok(b) => {
                            if sink.write(&b).await.is_err() {
                                return;
                            }
                        }
                        Err(e) => {
                            let _ = fail_tx.send(e);
                            return;
                        }
                    }
                }
                let _ = sink.close().await;
            });
        }
        let running = Running {
            handle,
            sandbox: self.inner.clone(),
            pid,
            pending,
            stdin_failed,
            deadline: timeout.map(|t| tokio::time::Instant::now() + t),
            abort,
            reason: ExitReason::Exited,
            killed_at: None,
            done: false,
        };
        Ok(Box::pin(futures::stream::unfold(
            running,
            |mut r| async move {
                let ev = r.next_event().await?;
                Some((ev, r))
            },
        )))
    }
}

/// One running command: SDK exec events as harness events, with the
/// timeout, the abort signal and a failing stdin source killing its tree.
struct Running {
    handle: sdk::ExecHandle,
    sandbox: sdk::Sandbox,
    pid: Option<u32>,
    pending: Option<sdk::ExecEvent>,
    stdin_failed: Option<oneshot::Receiver<Error>>,
    deadline: Option<tokio::time::Instant>,
    abort: Option<AbortSignal>,
    reason: ExitReason,
    killed_at: Option<tokio::time::Instant>,
    done: bool,
}

impl Drop for Running {
    fn drop(&mut self) {
        if !self.done && self.killed_at.is_none() {
            // A dropped stream kills its command.
            if tokio::runtime::Handle::try_current().is_ok() {
                kill_tree(&self.sandbox, &self.handle, self.pid);
            }
        }
    }
}

/// SIGKILL to the command and every descendant, from a second exec in the
/// guest (the SDK's own kill reaches the one process). The tree is stopped
/// level by level before it is killed, so nothing forks away meanwhile.
fn kill_tree(sandbox: &sdk::Sandbox, handle: &sdk::ExecHandle, pid: Option<u32>) {
    let control = handle.control();
    let sandbox = sandbox.clone();
    tokio::spawn(async move {
        if let Some(pid) = pid {
            let script = format!(
                "all={pid}; t={pid}; kill -STOP {pid} 2>/dev/null; \
                 while [ -n \"$t\" ]; do n=; \
                   for f in /proc/[0-9]*/stat; do \
                     {{ read -r l < \"$f\"; }} 2>/dev/null || continue; \
                     set -- ${{l##*) }}; \
                     for p in $t; do if [ \"$2\" = \"$p\" ]; then q=${{f#/proc/}}; n=\"$n ${{q%/stat}}\"; fi; done; \
                   done; \
                   [ -n \"$n\" ] && kill -STOP $n 2>/dev/null; all=\"$all $n\"; t=$n; \
                 done; kill -KILL $all 2>/dev/null; kill -KILL -{pid} 2>/dev/null; exit 0"
            );
            let _ = sandbox
                .exec_with("sh", |o| o.args(["-c", script.as_str()]).cwd("/"))
                .await;
        }
        let _ = control.kill().await;
    });
}

impl Running {
    fn kill(&mut self, reason: ExitReason) {
        if self.killed_at.is_none() {
            self.reason = reason;
            self.killed_at = Some(tokio::time::Instant::now());
            kill_tree(&self.sandbox, &self.handle, self.pid);
        }
    }

    fn map(&mut self, ev: sdk::ExecEvent) -> Option<Result<ExecEvent>> {
        match ev {
            sdk::ExecEvent::Stdout(b) => Some(Ok(ExecEvent::Stdout(Bytes::copy_from_slice(&b)))),
            sdk::ExecEvent::Stderr(b) => Some(Ok(ExecEvent::Stderr(Bytes::copy_from_slice(&b)))),
            sdk::ExecEvent::Exited { code } => {
                self.done = true;
                let status = if self.reason != ExitReason::Exited {
                    ExitStatus {
                        code: None,
                        signal: Some(9),
                        reason: self.reason,
                    }
                } else if code < 0 {
                    ExitStatus {
                        code: None,
                        signal: Some(-code),
                        reason: ExitReason::Exited,
                    }
                } else {
                    ExitStatus::exited(code)
                };
                Some(Ok(ExecEvent::Exit(status)))
            }
            sdk::ExecEvent::Failed(f) => {
                self.done = true;
                Some(Err(Error::backend(format!(
                    "microsandbox: the command failed: {}",
                    f.message
                ))))
            }
            sdk::ExecEvent::Started { pid } => {
                self.pid = Some(pid);
                None
            }
            sdk::ExecEvent::StdinError(_) => None,
        }
    }

    async fn next_event(&mut self) -> Option<Result<ExecEvent>> {
        if self.done {
            return None;
        }
        if let Some(ev) = self.pending.take() {
            if let Some(out) = self.map(ev) {
                return Some(out);
            }
        }
        loop {
            let deadline = self.deadline.filter(|_| self.killed_at.is_none());
            let drain_end = self.killed_at.map(|t| t + DRAIN_AFTER_KILL);
            let abort = self.abort.clone().filter(|_| self.killed_at.is_none());
            tokio::select! {
                biased;
                err = stdin_failure(&mut self.stdin_failed) => {
                    if let Some(e) = err {
                        self.kill(ExitReason::Exited);
                        self.done = true;
                        return Some(Err(e));
                    }
                    self.stdin_failed = None;
                }
                ev = self.handle.recv() => match ev {
                    Some(ev) => {
                        if let Some(out) = self.map(ev) {
                            return Some(out);
                        }
                    }
                    None => {
                        self.done = true;
                        return Some(Err(Error::backend(
                            "microsandbox: the exec session ended without an exit (the VM stopped?)",
                        )));
                    }
                },
                () = sleep_until(deadline) => self.kill(ExitReason::TimedOut),
                () = aborted(abort) => self.kill(ExitReason::Aborted),
                () = sleep_until(drain_end) => {
                    self.done = true;
                    return Some(Ok(ExecEvent::Exit(ExitStatus {
                        code: None,
                        signal: Some(9),
                        reason: self.reason,
                    })));
                }
            }
        }
    }
}

/// What kind of KVM this host has, for skip reasons: `kvm_pvm` (a
/// software scheme that cannot run libkrun guests) or the usual modules.
fn kvm_kind() -> String {
    let mut loaded: Vec<String> = std::fs::read_dir("/sys/module")
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|m| m.starts_with("kvm"))
                .collect()
        })
        .unwrap_or_default();
    loaded.sort();
    if loaded.is_empty() {
        "no kvm module in /sys/module".into()
    } else {
        format!("kvm modules: {}", loaded.join(", "))
    }
}

#[async_trait]
impl guest_files::StdinShell for MicrosandboxSandbox {
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
impl Sandbox for MicrosandboxSandbox {
    fn handle(&self) -> SandboxHandle {
        let ports: serde_json::Map<String, serde_json::Value> = self
            .ports
            .iter()
            .map(|(g, h)| (g.to_string(), serde_json::Value::from(*h)))
            .collect();
        SandboxHandle {
            provider: MSB_PROVIDER.into(),
            id: self.name.clone(),
            workdir: self.workdir.clone(),
            owned: true,
            data: serde_json::json!({ "ports": ports }),
        }
    }

    fn workdir(&self) -> &str {
        &self.workdir
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
        guest_files::read_file(self, resolve_path(&self.workdir, path)).await
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
        guest_files::write_file(self, resolve_path(&self.workdir, path), content).await
    }

    async fn export_tar(&self, dir: &str) -> Result<ByteStream> {
        export_tar_by_exec(self, &resolve_path(&self.workdir, dir)).await
    }

    async fn import_tar(&self, dir: &str, tar: ByteStream) -> Result<()> {
        guest_files::import_tar(self, resolve_path(&self.workdir, dir), tar).await
    }

    async fn port_endpoint(&self, port: u16) -> Result<PortEndpoint> {
        match self.ports.get(&port) {
            Some(host) => Ok(PortEndpoint {
                sandbox_port: port,
                host: "127.0.0.1".into(),
                port: *host,
            }),
            None => Err(Error::not_found(format!(
                "port {port} was not requested when the microsandbox was created"
            ))),
        }
    }

    async fn stop(&self) -> Result<SandboxHandle> {
        self.inner
            .stop()
            .await
            .map_err(|e| sdk_error(&format!("stopping {}", self.name), e))?;
        Ok(self.handle())
    }

    async fn destroy(&self) -> Result<()> {
        match self.inner.destroy().await {
            Ok(()) => {}
            Err(e) if is_not_found(&e) => {}
            Err(e) => return Err(sdk_error(&format!("destroying {}", self.name), e)),
        }
        match tokio::fs::remove_dir_all(&self.rootfs).await {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_names_are_stable_and_clean() {
        let mut spec = SandboxSpec::new("/w");
        spec.session_id = Some("s/1 x".into());
        spec.slot = Some("t1".into());
        assert_eq!(MicrosandboxProvider::sandbox_name(&spec), "hmsb-s-1-x-t1");
        spec.slot = None;
        let a = MicrosandboxProvider::sandbox_name(&spec);
        let b = MicrosandboxProvider::sandbox_name(&spec);
        assert_ne!(a, b);
        assert!(a.starts_with("hmsb-"));
    }
}
