//! The sandbox contract: one trait pair every backend implements.
//!
//! A [`SandboxProvider`] creates sandboxes from a [`SandboxSpec`] and resumes
//! them from a serializable [`SandboxHandle`] (possibly in another process).
//! A [`Sandbox`] runs commands with streamed output, reads and writes files as
//! streams, exports and imports directories as tar streams, and manages its
//! own lifecycle.
//!
//! Optional capabilities answer [`ErrorKind::Unsupported`](crate::ErrorKind)
//! where the contract says so (see each method); the conformance suite in
//! `harness-testkit` accepts that answer only there.
//!
//! Detached processes (agents that outlive one slice) have default
//! implementations on top of `exec` and a POSIX shell inside the sandbox, so
//! a backend gets them for free and may override them.

use std::collections::BTreeMap;
use std::pin::Pin;
use std::time::Duration;

use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use futures::{Stream, StreamExt};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::bootstrap::BootstrapRecipe;
use crate::maybe::{MaybeSend, MaybeSync};
use crate::stream::{AbortSignal, ByteStream};
use crate::{Error, Result};

/// Network access for a sandbox, fixed at create time.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "mode", rename_all = "kebab-case")]
pub enum NetworkPolicy {
    /// Unrestricted network.
    #[default]
    AllowAll,
    /// No network at all (loopback only).
    DenyAll,
    /// Only the listed destinations, minus the denied ranges. Providers
    /// enforce it with no route out of the sandbox but an egress proxy on
    /// the host that checks every connection against these lists (see
    /// `docs/network.md`).
    Custom {
        /// Host names that may be reached: `example.com`, or `*.example.com`
        /// for every name under it.
        #[serde(default)]
        allowed_hosts: Vec<String>,
        /// CIDR ranges that may be reached (`10.1.0.0/16`, `::1/128`).
        #[serde(default)]
        allowed_cidrs: Vec<String>,
        /// CIDR ranges that must not be reached, even if allowed above; checked
        /// against the addresses a host name resolves to.
        #[serde(default)]
        denied_cidrs: Vec<String>,
        /// Destination ports that may be reached; empty allows every port.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        allowed_ports: Vec<u16>,
    },
}

/// The loopback port inside a sandbox where the session's model broker
/// answers (see [`HostForward`]).
pub const MODEL_BROKER_PORT: u16 = 47811;
/// The loopback port inside a sandbox where the egress proxy of a `custom`
/// network policy answers.
pub const EGRESS_PROXY_PORT: u16 = 47812;

/// A host service a sandbox reaches on its own loopback, whatever its
/// network policy: inside the sandbox, `127.0.0.1:<port>` connects to the
/// Unix socket `socket` on the host. This is how an agent with no network
/// reaches the model broker, and how a `custom` policy's egress proxy is
/// reached. The socket's directory must hold nothing but sockets: a
/// provider may mount the whole directory into the sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostForward {
    /// The loopback port inside the sandbox.
    pub port: u16,
    /// The host path of the Unix socket it reaches.
    pub socket: String,
}

/// `s` as a part of a sandbox's name (a container, VM or directory name):
/// anything but ASCII letters, digits, `-` and `_` becomes `-`, cut at 40
/// characters. Every provider names its sandboxes after the session and
/// slot with this one rule.
pub fn name_part(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '-'
            }
        })
        .take(40)
        .collect()
}

/// How to make a sandbox.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SandboxSpec {
    /// Base image (container image, template name); backend-specific.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// Working directory for the agent and default cwd for `exec`.
    pub workdir: String,
    /// Environment for every command.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// CPU limit (fractional cores), where the backend supports it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpus: Option<f64>,
    /// Memory limit in MiB, where the backend supports it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_mb: Option<u64>,
    /// Ports inside the sandbox to expose to the host.
    #[serde(default)]
    pub ports: Vec<u16>,
    /// Network policy.
    #[serde(default)]
    pub network: NetworkPolicy,
    /// Host services reachable on the sandbox's loopback under every network
    /// policy. A provider that cannot provide one refuses the spec with
    /// `Unsupported`, never drops it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub forwards: Vec<HostForward>,
    /// Labels for bookkeeping (container labels, directory metadata).
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Bootstrap recipe to run once per identity.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bootstrap: Option<BootstrapRecipe>,
    /// Wrap-mode: use this existing, caller-owned sandbox instead of creating
    /// one. `destroy` then leaves it in place.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wrap: Option<String>,
    /// The session this sandbox serves (used in names and labels).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<String>,
    /// A stable name for the sandbox, unique within its session (the turn
    /// driver passes the turn id). A creator killed after `create` but
    /// before it recorded the handle leaves a sandbox nothing refers to;
    /// creating again with the same session and slot replaces that sandbox
    /// instead of leaving it behind. `None`: a fresh random name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slot: Option<String>,
}

impl SandboxSpec {
    /// What every provider asks of the forwards (each adds its own
    /// limits): a port from 1 to 65535, no port twice, and the socket an
    /// absolute host path.
    pub fn check_forwards(&self) -> Result<()> {
        let mut ports = std::collections::BTreeSet::new();
        for forward in &self.forwards {
            if forward.port == 0 {
                return Err(Error::invalid("a forward needs a port from 1 to 65535"));
            }
            if !ports.insert(forward.port) {
                return Err(Error::invalid(format!(
                    "port {} is forwarded twice",
                    forward.port
                )));
            }
            if !forward.socket.starts_with('/') {
                return Err(Error::invalid(format!(
                    "forward socket {:?} must be an absolute host path",
                    forward.socket
                )));
            }
        }
        Ok(())
    }

    /// A spec with `workdir` and defaults for everything else.
    pub fn new(workdir: impl Into<String>) -> Self {
        Self {
            image: None,
            workdir: workdir.into(),
            env: BTreeMap::new(),
            cpus: None,
            memory_mb: None,
            ports: Vec::new(),
            network: NetworkPolicy::AllowAll,
            forwards: Vec::new(),
            labels: BTreeMap::new(),
            bootstrap: None,
            wrap: None,
            session_id: None,
            slot: None,
        }
    }
}

/// Everything needed to reattach to a sandbox, as JSON that survives a
/// process restart.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SandboxHandle {
    /// Provider name (`local`, `docker`, …); a provider refuses foreign handles.
    pub provider: String,
    /// Backend id (container id, directory name, …).
    pub id: String,
    /// The working directory.
    pub workdir: String,
    /// Whether `destroy` removes the underlying resource (false in wrap-mode).
    #[serde(default = "default_true")]
    pub owned: bool,
    /// Backend-specific data.
    #[serde(default)]
    pub data: Value,
}

fn default_true() -> bool {
    true
}

/// A command to run.
#[derive(Debug, Clone, Default)]
pub struct ExecRequest {
    /// Program and arguments (no shell unless you run one).
    pub argv: Vec<String>,
    /// Working directory; defaults to the sandbox's workdir.
    pub cwd: Option<String>,
    /// Extra environment on top of the sandbox's.
    pub env: BTreeMap<String, String>,
    /// Bytes written to stdin, which is then closed. `None` means an empty stdin.
    pub stdin: Option<Bytes>,
    /// Kill the command (and its children) after this long.
    pub timeout: Option<Duration>,
    /// Kill the command (and its children) when this fires.
    pub abort: Option<AbortSignal>,
}

impl ExecRequest {
    /// Run `argv` directly.
    pub fn new<I, S>(argv: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Self {
            argv: argv.into_iter().map(Into::into).collect(),
            ..Self::default()
        }
    }

    /// Run `script` with `sh -c`.
    pub fn shell(script: impl Into<String>) -> Self {
        Self::new(["sh".to_string(), "-c".to_string(), script.into()])
    }

    /// Set the working directory.
    pub fn cwd(mut self, cwd: impl Into<String>) -> Self {
        self.cwd = Some(cwd.into());
        self
    }

    /// Add an environment variable.
    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.env.insert(key.into(), value.into());
        self
    }

    /// Set stdin.
    pub fn stdin(mut self, bytes: impl Into<Bytes>) -> Self {
        self.stdin = Some(bytes.into());
        self
    }

    /// Set a timeout.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// Set an abort signal.
    pub fn abort(mut self, abort: AbortSignal) -> Self {
        self.abort = Some(abort);
        self
    }
}

/// Why a command stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExitReason {
    /// It exited (or was killed by something other than us).
    Exited,
    /// Its abort signal fired and we killed it.
    Aborted,
    /// Its timeout passed and we killed it.
    TimedOut,
}

/// How a command ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExitStatus {
    /// Exit code, when it exited normally.
    pub code: Option<i32>,
    /// Signal number, when a signal ended it.
    pub signal: Option<i32>,
    /// Why it ended.
    pub reason: ExitReason,
}

impl ExitStatus {
    /// A normal exit with `code`.
    pub fn exited(code: i32) -> Self {
        Self {
            code: Some(code),
            signal: None,
            reason: ExitReason::Exited,
        }
    }

    /// True for a normal exit with code 0.
    pub fn success(&self) -> bool {
        self.reason == ExitReason::Exited && self.code == Some(0)
    }
}

/// One event of a running command. The stream ends with exactly one `Exit`.
#[derive(Debug, Clone, PartialEq)]
pub enum ExecEvent {
    /// Bytes on stdout.
    Stdout(Bytes),
    /// Bytes on stderr.
    Stderr(Bytes),
    /// The command ended.
    Exit(ExitStatus),
}

/// The events of a running command.
#[cfg(not(target_arch = "wasm32"))]
pub type ExecStream = Pin<Box<dyn Stream<Item = Result<ExecEvent>> + Send + 'static>>;
/// The events of one command (not `Send` on wasm32, where nothing is).
#[cfg(target_arch = "wasm32")]
pub type ExecStream = Pin<Box<dyn Stream<Item = Result<ExecEvent>> + 'static>>;

/// A command's collected output.
#[derive(Debug, Clone)]
pub struct ExecOutput {
    /// All of stdout.
    pub stdout: Bytes,
    /// All of stderr.
    pub stderr: Bytes,
    /// How it ended.
    pub status: ExitStatus,
}

impl ExecOutput {
    /// stdout as lossy UTF-8.
    pub fn stdout_str(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }

    /// stderr as lossy UTF-8.
    pub fn stderr_str(&self) -> String {
        String::from_utf8_lossy(&self.stderr).into_owned()
    }

    /// Err unless the command exited 0, with stderr in the message.
    pub fn check(self, what: &str) -> Result<Self> {
        if self.status.success() {
            Ok(self)
        } else {
            Err(Error::backend(format!(
                "{what} failed ({:?}): {}",
                self.status,
                self.stderr_str().trim()
            )))
        }
    }
}

/// Drain an [`ExecStream`] into memory.
pub async fn collect_exec(mut stream: ExecStream) -> Result<ExecOutput> {
    let mut stdout = BytesMut::new();
    let mut stderr = BytesMut::new();
    while let Some(event) = stream.next().await {
        match event? {
            ExecEvent::Stdout(b) => stdout.extend_from_slice(&b),
            ExecEvent::Stderr(b) => stderr.extend_from_slice(&b),
            ExecEvent::Exit(status) => {
                return Ok(ExecOutput {
                    stdout: stdout.freeze(),
                    stderr: stderr.freeze(),
                    status,
                })
            }
        }
    }
    Err(Error::backend(
        "command output ended without an exit status",
    ))
}

/// A process started with [`Sandbox::spawn_detached`]: it keeps running when
/// the caller goes away, with its output spooled to files in the sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DetachedProcess {
    /// Backend process id (a pid for the shell-based default).
    pub id: String,
    /// File receiving stdout.
    pub stdout_path: String,
    /// File receiving stderr.
    pub stderr_path: String,
    /// File written with the exit code when the process ends.
    pub exit_path: String,
}

/// State of a detached process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum DetachedStatus {
    /// Still running.
    Running,
    /// Exited with this code (128+N for signal N).
    Exited {
        /// Exit code.
        code: i32,
    },
    /// Not running and no exit code was recorded (killed with the sandbox).
    Lost,
}

/// What to start detached.
#[derive(Debug, Clone, Default)]
pub struct DetachedRequest {
    /// Program and arguments.
    pub argv: Vec<String>,
    /// Working directory; defaults to the sandbox's workdir.
    pub cwd: Option<String>,
    /// Extra environment.
    pub env: BTreeMap<String, String>,
    /// Directory (inside the sandbox, outside the working tree) that receives
    /// `stdout`, `stderr` and `exit`. One process per directory: launching
    /// into a directory that already had one returns that process.
    pub spool_dir: String,
}

/// A port inside the sandbox as reachable from the host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PortEndpoint {
    /// Port inside the sandbox.
    pub sandbox_port: u16,
    /// Host to connect to.
    pub host: String,
    /// Port to connect to.
    pub port: u16,
}

impl PortEndpoint {
    /// `http://host:port`.
    pub fn http_url(&self) -> String {
        format!("http://{}:{}", self.host, self.port)
    }
}

/// A bootstrap snapshot a provider keeps.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotInfo {
    /// The recipe identity (see [`BootstrapRecipe::identity`]).
    pub identity: String,
    /// Backend reference (image tag, directory).
    pub reference: String,
    /// Size in bytes, when known.
    pub size_bytes: Option<u64>,
}

/// Creates and resumes sandboxes of one backend.
#[cfg_attr(not(target_arch = "wasm32"), async_trait)]
#[cfg_attr(target_arch = "wasm32", async_trait(?Send))]
pub trait SandboxProvider: MaybeSend + MaybeSync + std::fmt::Debug {
    /// Short backend name, recorded in handles (`local`, `docker`, …).
    fn name(&self) -> &'static str;

    /// Create a sandbox (or wrap an existing one, see [`SandboxSpec::wrap`]),
    /// running the bootstrap recipe from its snapshot when one exists.
    async fn create(&self, spec: &SandboxSpec) -> Result<Box<dyn Sandbox>>;

    /// Reattach to a sandbox from its handle, whether it is running or
    /// stopped (a stopped one is started again).
    async fn resume(&self, handle: &SandboxHandle) -> Result<Box<dyn Sandbox>>;

    /// Whether commands in a sandbox made with this network policy run in
    /// the host's own network namespace, so the host's loopback is theirs
    /// (the local provider under `allow-all`). Such a sandbox takes no
    /// [`SandboxSpec::forwards`]: host services are reached at their host
    /// address instead.
    fn shares_host_network(&self, network: &NetworkPolicy) -> bool {
        let _ = network;
        false
    }

    /// Whether [`Sandbox::set_network`] can give this provider's sandboxes
    /// a route out and take it away again while they run (Docker: a
    /// firewall in the container's network namespace, set from the host;
    /// its published ports still answer). A caller that may change
    /// the policy later creates such a sandbox with `allow-all` and calls
    /// `set_network` before it runs anything. A route taken away may come
    /// back when the sandbox is stopped and started again: such a caller
    /// calls `set_network` again after `resume`. False by default.
    fn changes_network_at_run_time(&self) -> bool {
        false
    }

    /// Bootstrap snapshots this provider keeps. Optional.
    async fn list_snapshots(&self) -> Result<Vec<SnapshotInfo>> {
        Err(Error::unsupported(format!(
            "{} keeps no bootstrap snapshots",
            self.name()
        )))
    }

    /// Delete snapshots whose identity is not in `keep`; returns what was
    /// removed. Optional.
    async fn prune_snapshots(&self, keep: &[String]) -> Result<Vec<SnapshotInfo>> {
        let _ = keep;
        Err(Error::unsupported(format!(
            "{} keeps no bootstrap snapshots",
            self.name()
        )))
    }

    /// Let go of what the provider keeps ready for sandboxes not made yet
    /// (a pool's containers), as the process that owns it stops; the
    /// sandboxes it made stay. Nothing by default.
    async fn shutdown(&self) -> Result<()> {
        Ok(())
    }
}

/// One path under a listed directory, with the stat a tree checkpoint
/// compares against its parent's (`lstat`: a symlink is not followed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListedEntry {
    /// GNU `find -printf %y`'s letter: `f` file, `d` directory, `l`
    /// symlink, `s` socket, `p` FIFO, `c`/`b` device node.
    pub kind: char,
    /// Permission bits, setuid/setgid/sticky included (`%m`).
    pub mode: u32,
    /// Size in bytes (`%s`; a symlink's is its text's length).
    pub size: u64,
    /// Modification time, whole seconds since the epoch.
    pub mtime: u64,
    /// Inode number.
    pub ino: u64,
    /// Status-change time, nanoseconds since the epoch.
    pub ctime_ns: u64,
    /// Path relative to the listed directory, `/`-separated.
    pub path: String,
    /// A symlink's text; empty for anything else.
    pub link: String,
}

/// Every path under a directory, as [`Sandbox::list_tree`] answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TreeListing {
    /// The sandbox's clock when the listing began, whole seconds since the
    /// epoch: a file modified in this second or later may change again
    /// without its stat showing it (the racy-second rule).
    pub now_secs: u64,
    /// The paths, in no particular order.
    pub entries: Vec<ListedEntry>,
}

/// A live sandbox.
#[cfg_attr(not(target_arch = "wasm32"), async_trait)]
#[cfg_attr(target_arch = "wasm32", async_trait(?Send))]
pub trait Sandbox: MaybeSend + MaybeSync + std::fmt::Debug {
    /// The handle that resumes this sandbox elsewhere.
    fn handle(&self) -> SandboxHandle;

    /// The working directory.
    fn workdir(&self) -> &str;

    /// The sandbox's `$HOME` as its commands see it, when the provider
    /// knows it without running anything (recorded in the handle when the
    /// sandbox was made). `None`, the default: ask the sandbox. A turn's
    /// slice starts the agent one exec sooner with it (on Docker an exec
    /// is a ~50 ms round trip through dockerd and runc).
    fn home_hint(&self) -> Option<String> {
        None
    }

    /// Run a command, streaming its output. The returned stream ends with one
    /// [`ExecEvent::Exit`]; abort and timeout kill the command's whole
    /// process tree and are reported in [`ExitStatus::reason`].
    async fn exec(&self, request: ExecRequest) -> Result<ExecStream>;

    /// Read a file as a stream. `NotFound` if it does not exist.
    async fn read_file(&self, path: &str) -> Result<ByteStream>;

    /// Read a file from byte `offset` on (for tailing a spool). The default
    /// runs `tail -c` in the sandbox ([`read_from_script`]).
    async fn read_file_from(&self, path: &str, offset: u64) -> Result<ByteStream> {
        let path = resolve_path(self.workdir(), path);
        let stream = self
            .exec(ExecRequest::shell(read_from_script(&path, offset)))
            .await?;
        Ok(exec_stdout_stream(stream, path))
    }

    /// Write a file from a stream, creating parent directories and replacing
    /// any existing file. Returns the number of bytes written.
    async fn write_file(&self, path: &str, content: ByteStream) -> Result<u64>;

    /// Export `dir` as an uncompressed tar stream whose entries are relative
    /// to `dir`. Nothing is staged on the sandbox's disk.
    async fn export_tar(&self, dir: &str) -> Result<ByteStream>;

    /// Extract a tar stream into `dir` (created if missing), overlaying what
    /// is there: files not in the archive stay.
    async fn import_tar(&self, dir: &str, tar: ByteStream) -> Result<()>;

    /// How many [`Sandbox::import_tar`] calls into one directory may run at
    /// once, on disjoint sets of files whose directories exist, and be
    /// faster for it (the sandbox writes on several cores). A tree restore
    /// of many files splits its stream that many ways; 1 (the default)
    /// keeps one stream.
    fn parallel_imports(&self) -> usize {
        1
    }

    /// True if [`Sandbox::import_tar_staged`] is implemented. `moves::restore`
    /// then reads a checkpoint once instead of verifying it in a first pass.
    fn stages_tar_imports(&self) -> bool {
        false
    }

    /// Like [`Sandbox::import_tar`], but nothing of the archive becomes
    /// visible under `dir` unless the whole stream ends without an error:
    /// the entries land in a staging directory and are moved into place
    /// (overlaying, as `import_tar` does) only after the stream's last
    /// item. A stream that fails — a refused entry, a content hash found
    /// wrong at its end — leaves `dir` as it was and the staging directory
    /// removed. Only a failure while moving entries into place (an I/O
    /// error) can leave part of the archive applied.
    ///
    /// `Unsupported` unless [`Sandbox::stages_tar_imports`] says otherwise.
    async fn import_tar_staged(&self, dir: &str, tar: ByteStream) -> Result<()> {
        let _ = (dir, tar);
        Err(Error::unsupported(
            "this sandbox has no staged tar import: verify the archive before import_tar",
        ))
    }

    /// List every path under `dir` (not `dir` itself) with its stat, for
    /// tree checkpoints (`harness_moves::tree`). `NotFound` when
    /// `dir` is not a directory. Entries may come in any order; in path
    /// order (bytewise), the caller's sort of them costs one pass.
    ///
    /// `Unsupported` by default: tree checkpoints then run GNU `find`
    /// inside the sandbox, which costs an exec and the formatting and
    /// parsing of every path. A provider that can `lstat` the sandbox's
    /// files from where it runs (the local sandbox) answers directly. A
    /// provider answering here also promises that the sandbox has GNU
    /// `tar` (tree checkpoints read the changed files with `tar -T -`).
    async fn list_tree(&self, dir: &str) -> Result<TreeListing> {
        let _ = dir;
        Err(Error::unsupported(
            "this sandbox has no native tree listing: list it with GNU find inside",
        ))
    }

    /// A tar stream of exactly `paths` (relative to `dir`; a directory
    /// without its contents), each as what it is — a symlink as a symlink,
    /// never followed. A path that no longer exists is left out (the tree
    /// may change under a running agent). Tree checkpoints read the files
    /// that changed since their parent with it.
    ///
    /// By default GNU `tar --no-recursion -T -` runs inside the sandbox
    /// ([`export_paths_with_tar`]): an exec per checkpoint. A provider that
    /// reads the sandbox's files from where it runs (the local sandbox)
    /// builds the archive in-process.
    async fn export_paths_tar(&self, dir: &str, paths: &[String]) -> Result<ByteStream> {
        export_paths_with_tar(self, dir, paths).await
    }

    /// Start a process that outlives this call and this process, with stdout
    /// and stderr spooled to files under `request.spool_dir`.
    ///
    /// Idempotent per spool directory: a second call with the same
    /// `spool_dir` returns the first call's process instead of starting
    /// another, so a caller killed mid-launch can simply launch again.
    async fn spawn_detached(&self, request: DetachedRequest) -> Result<DetachedProcess> {
        let (script, process) = detached_launch_script(&request, self.workdir());
        let out = collect_exec(self.exec(ExecRequest::shell(script)).await?).await?;
        let out = out.check("starting a detached process")?;
        let pid = out.stdout_str().trim().to_string();
        if pid.is_empty() || !pid.bytes().all(|b| b.is_ascii_digit()) {
            return Err(Error::backend(format!(
                "detached launch printed no pid: {pid:?}"
            )));
        }
        Ok(DetachedProcess { id: pid, ..process })
    }

    /// Whether a detached process still runs. By default a probe script
    /// runs inside the sandbox ([`detached_status_by_exec`]).
    async fn detached_status(&self, process: &DetachedProcess) -> Result<DetachedStatus> {
        detached_status_by_exec(self, process).await
    }

    /// One look at a detached process: its status, probed first, and its
    /// stdout from byte `offset` on — so `Exited` with nothing new to read
    /// means the whole output was read. `NotFound` (from the call or from
    /// the stream) when the stdout file is gone. By default the two calls above; a provider whose every call is
    /// an exec answers both in one ([`poll_detached_by_exec`]): a running
    /// turn polls several times a second.
    async fn poll_detached(
        &self,
        process: &DetachedProcess,
        offset: u64,
    ) -> Result<(DetachedStatus, ByteStream)> {
        let status = self.detached_status(process).await?;
        let stdout = self.read_file_from(&process.stdout_path, offset).await?;
        Ok((status, stdout))
    }

    /// Kill a detached process and its children. Idempotent. By default a
    /// script inside the sandbox signals its group ([`kill_detached_by_exec`]).
    async fn kill_detached(&self, process: &DetachedProcess) -> Result<()> {
        kill_detached_by_exec(self, process).await
    }

    /// Where a port inside the sandbox can be reached from the host.
    /// Optional: `Unsupported` when the backend exposes no ports, `NotFound`
    /// when the port was not requested at create time.
    async fn port_endpoint(&self, port: u16) -> Result<PortEndpoint> {
        let _ = port;
        Err(Error::unsupported("this sandbox exposes no ports"))
    }

    /// Keep this sandbox's whole filesystem as an image named after `name`
    /// (letters, digits, `-`, `_`, `.`), and answer the reference a later
    /// [`SandboxSpec::image`] names to create sandboxes that start with
    /// these files (a Docker image commit). The sandbox keeps running; its
    /// processes are not part of the image. What an outside caller's
    /// one-time setup did (the AI SDK's `onFirstCreate`) is kept this way,
    /// once per identity. Optional: `Unsupported` by default.
    async fn snapshot_image(&self, name: &str) -> Result<String> {
        let _ = name;
        Err(Error::unsupported(
            "this sandbox cannot keep its filesystem as an image",
        ))
    }

    /// Give the running sandbox a route out (`allow-all`) or take every
    /// route away (`deny-all`, and `custom`, whose lists an egress proxy
    /// reached through a forward enforces), keeping its forwards and what
    /// the host reaches of it (its exposed ports). Only
    /// where [`SandboxProvider::changes_network_at_run_time`] says so, on a
    /// sandbox created with `allow-all`; `Unsupported` by default.
    async fn set_network(&self, policy: &NetworkPolicy) -> Result<()> {
        let _ = policy;
        Err(Error::unsupported(
            "this sandbox's network policy is fixed when it is created",
        ))
    }

    /// Let go of the sandbox but keep it running; returns the handle to
    /// resume it.
    async fn detach(&self) -> Result<SandboxHandle> {
        Ok(self.handle())
    }

    /// Stop the sandbox, keeping its state for a later `resume`. Optional.
    async fn stop(&self) -> Result<SandboxHandle> {
        Err(Error::unsupported(
            "this sandbox cannot be stopped and resumed",
        ))
    }

    /// Remove the sandbox and its resources (in wrap-mode the caller's
    /// sandbox stays). Idempotent.
    async fn destroy(&self) -> Result<()>;
}

/// Quote `s` for a POSIX shell.
pub fn shell_quote(s: &str) -> String {
    if !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"/._-=:,+@".contains(&b))
    {
        return s.to_string();
    }
    format!("'{}'", s.replace('\'', "'\\''"))
}

/// Join `path` onto `workdir` unless it is absolute.
pub fn resolve_path(workdir: &str, path: &str) -> String {
    if path.starts_with('/') {
        path.to_string()
    } else if workdir.ends_with('/') {
        format!("{workdir}{path}")
    } else {
        format!("{workdir}/{path}")
    }
}

/// The shell script the default [`Sandbox::spawn_detached`] runs, and the
/// process record it produces (without the pid).
///
/// The child runs under `setsid` so it is its own session and process group
/// (killable as a group, untouched when the launching exec ends); the exit
/// code is written to a temporary file and renamed, so a reader never sees a
/// half-written code.
pub fn detached_launch_script(
    request: &DetachedRequest,
    workdir: &str,
) -> (String, DetachedProcess) {
    let dir = request.spool_dir.trim_end_matches('/');
    let process = DetachedProcess {
        id: String::new(),
        stdout_path: format!("{dir}/stdout"),
        stderr_path: format!("{dir}/stderr"),
        exit_path: format!("{dir}/exit"),
    };
    let cwd = request
        .cwd
        .as_deref()
        .map(|c| resolve_path(workdir, c))
        .unwrap_or_else(|| workdir.to_string());
    let mut command = String::from("exec env");
    for (k, v) in &request.env {
        command.push(' ');
        command.push_str(&shell_quote(&format!("{k}={v}")));
    }
    for arg in &request.argv {
        command.push(' ');
        command.push_str(&shell_quote(arg));
    }
    let inner = format!(
        "cd {cwd} && ( {command} ) >{out} 2>{err} </dev/null; code=$?; echo $code >{exit}.tmp && mv {exit}.tmp {exit}",
        cwd = shell_quote(&cwd),
        out = shell_quote(&process.stdout_path),
        err = shell_quote(&process.stderr_path),
        exit = shell_quote(&process.exit_path),
    );
    // `launch` is created with `mkdir`, which only one caller can win: a
    // retried launch (its caller killed after the exec started, before it
    // recorded the pid) finds the first one's pid instead of starting a
    // second process. The script runs to its end even when the caller dies,
    // so a `launch` without a `pid` is one about to write it; after 10 s it
    // is given up on (exit 45: the launcher was killed with the sandbox).
    let script = format!(
        "set -e; mkdir -p {dir}; \
         if ! mkdir {launch} 2>/dev/null; then \
           i=0; while [ ! -f {pid} ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done; \
           if [ -f {pid} ]; then cat {pid}; exit 0; fi; \
           echo 'an earlier launch in this spool never recorded its pid' >&2; exit 45; \
         fi; \
         rm -f {exit}; : >{out}; : >{err}; \
         setsid sh -c {inner} >/dev/null 2>&1 </dev/null & p=$!; \
         echo $p >{pid}.tmp; mv {pid}.tmp {pid}; echo $p",
        dir = shell_quote(dir),
        launch = shell_quote(&format!("{dir}/launch")),
        pid = shell_quote(&format!("{dir}/pid")),
        exit = shell_quote(&process.exit_path),
        out = shell_quote(&process.stdout_path),
        err = shell_quote(&process.stderr_path),
        inner = shell_quote(&inner),
    );
    (script, process)
}

/// Whether a detached process still runs, asked inside the sandbox: the
/// default [`Sandbox::detached_status`], for providers whose process ids
/// mean something only inside (a PID namespace of their own).
pub async fn detached_status_by_exec<S: Sandbox + ?Sized>(
    sandbox: &S,
    process: &DetachedProcess,
) -> Result<DetachedStatus> {
    let script = detached_status_script(process);
    let out = collect_exec(sandbox.exec(ExecRequest::shell(script)).await?).await?;
    let out = out.check("probing a detached process")?;
    parse_detached_status(&out.stdout_str())
}

/// The shell probe of [`detached_status_by_exec`]: prints one line,
/// `running`, `lost` or the exit code.
fn detached_status_script(process: &DetachedProcess) -> String {
    format!(
        // `kill -0` succeeds on a zombie, and zombies linger where PID 1
        // does not reap (many containers): a `Z` state counts as gone.
        // The exit file is read again after the process check: the
        // process may have written it and exited between the two.
        "if [ -f {exit} ]; then cat {exit}; \
         elif kill -0 {pid} 2>/dev/null && ! grep -q '^[0-9]* ([^)]*) Z' /proc/{pid}/stat 2>/dev/null; then echo running; \
         elif [ -f {exit} ]; then cat {exit}; \
         else echo lost; fi",
        exit = shell_quote(&process.exit_path),
        pid = process.id
    )
}

/// The shell command that prints file `path` (absolute) from byte `offset`
/// on, or exits 44 (`NotFound` to [`exec_stdout_stream`]) when there is no
/// such file: the default [`Sandbox::read_file_from`].
pub fn read_from_script(path: &str, offset: u64) -> String {
    // The message quotes the path as one more argument: putting the
    // quoted path inside another pair of quotes breaks on a `'` in it.
    format!(
        "test -e {p} || {{ printf 'no such file: %s\\n' {p} >&2; exit 44; }}; exec tail -c +{} {p}",
        offset + 1,
        p = shell_quote(path)
    )
}

/// [`Sandbox::poll_detached`] in one exec, for providers whose status probe
/// and reads are execs ([`detached_status_by_exec`], the default
/// [`Sandbox::read_file_from`]): the probe's line, then the file's bytes.
pub async fn poll_detached_by_exec<S: Sandbox + ?Sized>(
    sandbox: &S,
    process: &DetachedProcess,
    offset: u64,
) -> Result<(DetachedStatus, ByteStream)> {
    let path = resolve_path(sandbox.workdir(), &process.stdout_path);
    let script = format!(
        "{}; {}",
        detached_status_script(process),
        read_from_script(&path, offset)
    );
    let stream = exec_stdout_stream(sandbox.exec(ExecRequest::shell(script)).await?, path);
    let (line, rest) = split_first_line(stream, 256).await?;
    Ok((parse_detached_status(&line)?, rest))
}

/// The first line of `stream` (without its newline; at most `limit`
/// bytes), and the stream of what follows it.
async fn split_first_line(mut stream: ByteStream, limit: usize) -> Result<(String, ByteStream)> {
    let mut head = BytesMut::new();
    loop {
        if let Some(nl) = head.iter().position(|&b| b == b'\n') {
            let line = String::from_utf8_lossy(&head[..nl]).into_owned();
            let rest = head.split_off(nl + 1).freeze();
            let rest = futures::stream::iter((!rest.is_empty()).then(|| Ok(rest)));
            return Ok((line, Box::pin(rest.chain(stream))));
        }
        if head.len() > limit {
            return Err(Error::backend(format!(
                "expected a line of at most {limit} bytes, got {:?}…",
                String::from_utf8_lossy(&head[..limit])
            )));
        }
        match stream.next().await {
            Some(chunk) => head.extend_from_slice(&chunk?),
            None => {
                return Err(Error::backend(format!(
                    "the output ended before its first line ended: {:?}",
                    String::from_utf8_lossy(&head)
                )))
            }
        }
    }
}

/// Kill a detached process and its group from inside the sandbox: the
/// default [`Sandbox::kill_detached`].
pub async fn kill_detached_by_exec<S: Sandbox + ?Sized>(
    sandbox: &S,
    process: &DetachedProcess,
) -> Result<()> {
    // The launch script made the process a session (and group) leader, so
    // the negative pid reaches every child the agent spawned.
    let script = format!(
        // `kill -SIG -PID`, not `kill -SIG -- -PID`: dash (Debian's sh)
        // rejects the `--` form.
        "kill -TERM -{pid} 2>/dev/null; for i in 1 2 3 4 5 6 7 8 9 10; do kill -0 {pid} 2>/dev/null || exit 0; \
         grep -q '^[0-9]* ([^)]*) Z' /proc/{pid}/stat 2>/dev/null && exit 0; sleep 0.1; done; kill -KILL -{pid} 2>/dev/null; exit 0",
        pid = process.id
    );
    collect_exec(sandbox.exec(ExecRequest::shell(script)).await?)
        .await?
        .check("killing a detached process")?;
    Ok(())
}

/// Parse what the default `detached_status` probe prints.
pub fn parse_detached_status(text: &str) -> Result<DetachedStatus> {
    match text.trim() {
        "running" => Ok(DetachedStatus::Running),
        "lost" => Ok(DetachedStatus::Lost),
        other => other
            .parse::<i32>()
            .map(|code| DetachedStatus::Exited { code })
            .map_err(|_| Error::backend(format!("unexpected detached status {other:?}"))),
    }
}

/// Export `dir` of `sandbox` as the contract's tar stream with GNU tar run
/// through its `exec` (`tar -C dir -cf - .`: entries relative to `dir`),
/// for backends without an archive API of their own. A missing directory
/// is `NotFound` from this call, not at the consumer's first read.
pub async fn export_tar_by_exec(sandbox: &dyn Sandbox, dir: &str) -> Result<ByteStream> {
    let script = format!(
        "test -d {d} || {{ echo no such directory: {d} >&2; exit 44; }}; exec tar -C {d} -cf - .",
        d = shell_quote(dir)
    );
    let stream = sandbox.exec(ExecRequest::shell(script)).await?;
    first_error_now(exec_stdout_stream(stream, dir.to_string())).await
}

/// Wait for `stream`'s first item: an error there is returned now; else the
/// stream comes back whole (fused: an ended stream is never polled again).
pub async fn first_error_now(stream: ByteStream) -> Result<ByteStream> {
    let mut stream = stream.fuse();
    match stream.next().await {
        Some(Ok(first)) => Ok(Box::pin(
            futures::stream::once(async move { Ok(first) }).chain(stream),
        )),
        Some(Err(e)) => Err(e),
        None => Ok(crate::stream::empty()),
    }
}

/// The shell script that extracts a tar from stdin into `dir` inside a
/// sandbox where commands run as root (containers, VMs), and the error its
/// failure means. GNU tar keeps every write inside `dir`: it refuses `..`
/// members and hard links out (non-zero exit), strips a leading `/`, and
/// creates symlinks only after the entries that could be written through
/// them. Modes are kept exactly (`umask 0`) but, with
/// `--no-same-permissions`, without setuid, setgid and sticky bits (a
/// root-owned setuid program must not come out of an archive;
/// `tarscan` refuses such entries first, this is the second line).
/// `--no-same-owner`: everything restored belongs to the extracting user,
/// whatever owners the archive names.
pub fn extract_tar_script(dir: &str) -> String {
    format!(
        "mkdir -p {d} && umask 0 && exec tar -C {d} -xf - --no-same-permissions --no-same-owner",
        d = shell_quote(dir)
    )
}

/// The error of an [`extract_tar_script`] run that did not succeed: `Unsafe`
/// when tar refused an entry that would escape `dir`, else `Backend`.
pub fn extract_tar_failure(dir: &str, status: &ExitStatus, stderr: &str) -> Error {
    let message = format!(
        "extracting into {dir} failed ({status:?}): {}",
        stderr.trim()
    );
    if stderr.contains("contains '..'") || stderr.contains("hard link") {
        Error::unsafe_entry(message)
    } else {
        Error::backend(message)
    }
}

/// Turn an exec stream into a byte stream of its stdout, failing if the
/// command fails (exit 44 from the default `read_file_from` means NotFound).
/// [`Sandbox::export_paths_tar`] by GNU `tar` inside the sandbox: `tar -C
/// dir --null --verbatim-files-from --no-recursion --ignore-failed-read -T
/// -` with the paths on stdin (a path removed meanwhile is skipped with a
/// warning on tar's stderr).
pub async fn export_paths_with_tar<S: Sandbox + ?Sized>(
    sandbox: &S,
    dir: &str,
    paths: &[String],
) -> Result<ByteStream> {
    let mut list = Vec::new();
    for path in paths {
        list.extend_from_slice(path.as_bytes());
        list.push(0);
    }
    let script = format!(
        "exec tar -C {} --null --verbatim-files-from --no-recursion --ignore-failed-read -T - -cf -",
        shell_quote(dir)
    );
    let stream = sandbox.exec(ExecRequest::shell(script).stdin(list)).await?;
    Ok(exec_stdout_stream(stream, dir.to_string()))
}

pub fn exec_stdout_stream(stream: ExecStream, what: String) -> ByteStream {
    let mut stderr = BytesMut::new();
    Box::pin(futures::stream::unfold(
        Some((stream, what)),
        move |state| {
            let mut state = state;
            let mut stderr = std::mem::take(&mut stderr);
            async move {
                let (mut stream, what) = state.take()?;
                loop {
                    match stream.next().await {
                        Some(Ok(ExecEvent::Stdout(b))) => {
                            return Some((Ok(b), Some((stream, what))))
                        }
                        Some(Ok(ExecEvent::Stderr(b))) => stderr.extend_from_slice(&b),
                        Some(Ok(ExecEvent::Exit(status))) if status.success() => return None,
                        Some(Ok(ExecEvent::Exit(status))) => {
                            let msg = String::from_utf8_lossy(&stderr).trim().to_string();
                            let err = if status.code == Some(44) {
                                Error::not_found(format!("{what}: {msg}"))
                            } else {
                                Error::backend(format!("reading {what} failed ({status:?}): {msg}"))
                            };
                            return Some((Err(err), None));
                        }
                        Some(Err(e)) => return Some((Err(e), None)),
                        None => {
                            return Some((
                                Err(Error::backend(format!("reading {what}: no exit status"))),
                                None,
                            ))
                        }
                    }
                }
            }
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunks(parts: &[&'static str]) -> ByteStream {
        Box::pin(futures::stream::iter(
            parts
                .iter()
                .map(|p| Ok(Bytes::from_static(p.as_bytes())))
                .collect::<Vec<_>>(),
        ))
    }

    #[test]
    fn a_status_line_is_split_from_the_bytes_after_it_at_any_chunking() {
        for parts in [
            &["running\nab", "c\n"][..],
            &["run", "ning", "\n", "abc\n"],
            &["running\n", "abc\n"],
            &["running\nabc\n"],
        ] {
            let (line, rest) =
                futures::executor::block_on(split_first_line(chunks(parts), 256)).unwrap();
            let rest = futures::executor::block_on(crate::stream::collect(rest, 1024)).unwrap();
            assert_eq!(
                (line.as_str(), &rest[..]),
                ("running", &b"abc\n"[..]),
                "{parts:?}"
            );
        }
        let (line, rest) =
            futures::executor::block_on(split_first_line(chunks(&["7\n"]), 256)).unwrap();
        assert_eq!(line, "7");
        assert!(futures::executor::block_on(crate::stream::collect(rest, 8))
            .unwrap()
            .is_empty());
        let err = futures::executor::block_on(split_first_line(chunks(&["lost"]), 256))
            .err()
            .unwrap();
        assert!(
            err.to_string().contains("ended before its first line"),
            "{err}"
        );
        let long = futures::executor::block_on(split_first_line(chunks(&["x"; 300]), 256))
            .err()
            .unwrap();
        assert!(long.to_string().contains("at most 256 bytes"), "{long}");
    }

    #[test]
    fn forwards_are_checked_before_any_provider_sees_them() {
        let with = |forwards: &[(u16, &str)]| {
            let mut spec = SandboxSpec::new("/w");
            spec.forwards = forwards
                .iter()
                .map(|(port, socket)| HostForward {
                    port: *port,
                    socket: socket.to_string(),
                })
                .collect();
            spec.check_forwards()
        };
        assert!(with(&[(80, "/run/a.sock"), (81, "/run/b.sock")]).is_ok());
        for (forwards, says) in [
            (&[(0, "/run/a.sock")][..], "port from 1"),
            (
                &[(80, "/run/a.sock"), (80, "/run/b.sock")][..],
                "forwarded twice",
            ),
            (&[(80, "run/a.sock")][..], "absolute host path"),
        ] {
            let err = with(forwards).unwrap_err();
            assert_eq!(err.kind(), crate::ErrorKind::InvalidInput, "{forwards:?}");
            assert!(err.message().contains(says), "{forwards:?}: {err}");
        }
    }

    #[test]
    fn shell_quote_round_trips_hostile_strings() {
        assert_eq!(shell_quote("plain/path.txt"), "plain/path.txt");
        assert_eq!(shell_quote(""), "''");
        assert_eq!(shell_quote("it's $HOME"), "'it'\\''s $HOME'");
    }

    #[test]
    fn resolve_path_joins_relative_paths() {
        assert_eq!(resolve_path("/w", "a/b"), "/w/a/b");
        assert_eq!(resolve_path("/w/", "a"), "/w/a");
        assert_eq!(resolve_path("/w", "/etc/x"), "/etc/x");
    }

    #[test]
    fn detached_status_parses_every_answer() {
        assert_eq!(
            parse_detached_status("running\n").unwrap(),
            DetachedStatus::Running
        );
        assert_eq!(parse_detached_status("lost").unwrap(), DetachedStatus::Lost);
        assert_eq!(
            parse_detached_status("3\n").unwrap(),
            DetachedStatus::Exited { code: 3 }
        );
        assert!(parse_detached_status("garbage").is_err());
    }

    #[test]
    fn network_policy_json_shape() {
        let p: NetworkPolicy = serde_json::from_str(
            r#"{"mode":"custom","allowed_hosts":["example.com"],"denied_cidrs":["10.0.0.0/8"]}"#,
        )
        .unwrap();
        assert_eq!(
            p,
            NetworkPolicy::Custom {
                allowed_hosts: vec!["example.com".into()],
                allowed_cidrs: vec![],
                denied_cidrs: vec!["10.0.0.0/8".into()],
                allowed_ports: vec![],
            }
        );
        assert_eq!(
            serde_json::to_string(&NetworkPolicy::DenyAll).unwrap(),
            r#"{"mode":"deny-all"}"#
        );
    }
}
