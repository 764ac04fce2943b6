//! The `SandboxProvider`/`Sandbox` conformance suite.
//!
//! Every backend's tests call [`run_all`] (or [`run_all_with`]) with the real
//! provider and a spec for it; each contract item is also a `pub async fn` so
//! a backend can run them one by one. Every function fails with a message
//! naming the broken rule; optional capabilities (`stop`, `port_endpoint`,
//! deny-all networking) may answer `Unsupported`, which the suite reports as
//! [`Capability::Unsupported`] instead of failing.
//!
//! Commands the suite runs inside the sandbox need a POSIX `sh` with
//! coreutils (`cat`, `sleep`, `stat`, `cksum`, `find`, `sort`, `timeout`);
//! the port check needs `python3` or `nc`, the network check `bash`,
//! `python3` or `nc`.
//!
//! Network checks only ever target an address on this machine: the suite
//! listens on [`SuiteOptions::host_address`] and probes it from inside.
//! Host forwards ([`host_forward`], [`network_custom`]) reach a small HTTP
//! server the suite serves on a Unix socket in a directory of its own under
//! the temp dir, answering a per-test nonce.

use std::collections::BTreeMap;
use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, ensure, Context, Result};
use bytes::Bytes;
use futures::StreamExt;
use harness_core::checkpoint::{CheckpointStore, MemoryCheckpointStore};
use harness_core::clock::{Clock, ManualClock};
use harness_core::sandbox::{
    collect_exec, shell_quote, DetachedRequest, DetachedStatus, ExecEvent, ExecOutput, ExecRequest,
    ExitReason, HostForward, NetworkPolicy, Sandbox, SandboxHandle, SandboxProvider, SandboxSpec,
    EGRESS_PROXY_PORT, MODEL_BROKER_PORT,
};
use harness_core::stream::{AbortSignal, ByteStream};
use harness_core::{Error, ErrorKind};
use harness_moves::tree::{self as tc, BLOB_PREFIX};
use sha2::{Digest, Sha256};

/// How long any single suite command may take before the suite calls it
/// hung (well above what each needs).
const COMMAND_DEADLINE: Duration = Duration::from_secs(60);

/// Knobs for the parts of the suite that depend on the backend's setup.
#[derive(Debug, Clone)]
pub struct SuiteOptions {
    /// An address of this machine that commands inside an allow-all sandbox
    /// can reach (127.0.0.1 for backends sharing the host network, the
    /// bridge gateway for containers). The suite listens there. `None`
    /// skips the reachability half of the network check.
    pub host_address: Option<IpAddr>,
    /// Size of the large-file round trip in [`run_all_with`]; 0 skips it.
    pub large_file_bytes: u64,
}

impl Default for SuiteOptions {
    fn default() -> Self {
        Self {
            host_address: Some(IpAddr::V4(Ipv4Addr::LOCALHOST)),
            large_file_bytes: 100 * 1024 * 1024,
        }
    }
}

/// Result of an optional contract item.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Capability {
    /// The backend offers it and it behaved.
    Supported,
    /// The backend answered `Unsupported` (accepted), with its message.
    Unsupported(String),
}

/// What [`large_file_round_trip`] measured.
#[derive(Debug, Clone, PartialEq)]
pub struct LargeFileReport {
    /// Bytes written and read back.
    pub bytes: u64,
    /// Hex SHA-256 of the content.
    pub sha256: String,
    /// Seconds the write took.
    pub write_secs: f64,
    /// Seconds the read took.
    pub read_secs: f64,
}

/// What a passing [`run_all_with`] found about the optional items: each
/// capability item's answer under its function's name, so a backend's test
/// pins what it offers without running the items (and creating their
/// sandboxes) a second time.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SuiteReport {
    capabilities: BTreeMap<&'static str, Capability>,
}

impl SuiteReport {
    /// The answer of the optional item named `item` (`port_endpoint`,
    /// `stop_and_resume`, `network_deny_all`, `host_forward`,
    /// `network_custom`).
    ///
    /// # Panics
    ///
    /// On a name the suite has no optional item for: a test asking for it
    /// would otherwise pin nothing.
    pub fn capability(&self, item: &str) -> &Capability {
        self.capabilities.get(item).unwrap_or_else(|| {
            panic!(
                "the sandbox suite has no optional item {item:?}; it has {:?}",
                self.capabilities.keys().collect::<Vec<_>>()
            )
        })
    }
}

/// Run every contract item with [`SuiteOptions::default`].
pub async fn run_all(provider: &dyn SandboxProvider, spec: SandboxSpec) -> Result<SuiteReport> {
    run_all_with(provider, spec, &SuiteOptions::default()).await
}

/// Run every contract item; failures are collected and reported together,
/// each under the name of the function that found it. On success, the
/// optional items' answers come back in the [`SuiteReport`].
pub async fn run_all_with(
    provider: &dyn SandboxProvider,
    spec: SandboxSpec,
    options: &SuiteOptions,
) -> Result<SuiteReport> {
    let mut suite = Recorder::new(provider);
    let sandbox = provider
        .create(&spec)
        .await
        .context("creating the sandbox for the suite")?;
    let sb = sandbox.as_ref();
    suite.record(
        "exec_streams_stdout_stderr_and_one_exit",
        exec_streams_stdout_stderr_and_one_exit(sb).await,
    );
    suite.record("exec_exit_codes", exec_exit_codes(sb).await);
    suite.record("exec_cwd", exec_cwd(sb).await);
    suite.record("exec_stdin", exec_stdin(sb).await);
    suite.record(
        "exec_streams_before_exit",
        exec_streams_before_exit(sb).await,
    );
    suite.record("exec_timeout_kills_tree", exec_timeout_kills_tree(sb).await);
    suite.record("exec_abort_kills_tree", exec_abort_kills_tree(sb).await);
    suite.record("files_round_trip", files_round_trip(sb).await);
    suite.record("read_file_from_offset", read_file_from_offset(sb).await);
    suite.record("tar_round_trip", tar_round_trip(sb).await);
    suite.record("tree_checkpoints", tree_checkpoints(sb).await);
    suite.record(
        "native_listing_matches_find",
        native_listing_matches_find(sb).await,
    );
    suite.record(
        "paths_export_matches_gnu_tar",
        paths_export_matches_gnu_tar(sb).await,
    );
    suite.record(
        "import_refuses_escaping_entries",
        import_refuses_escaping_entries(sb).await,
    );
    suite.record(
        "import_refuses_hostile_entries",
        import_refuses_hostile_entries(sb).await,
    );
    suite.record(
        "restore_refuses_hostile_archives",
        restore_refuses_hostile_archives(sb).await,
    );
    suite.record(
        "restore_refuses_decompression_bombs",
        restore_refuses_decompression_bombs(sb).await,
    );
    suite.record(
        "import_takes_no_owners_from_the_archive",
        import_takes_no_owners_from_the_archive(sb).await,
    );
    suite.record("unicode_names", unicode_names(sb).await);
    suite.record("concurrent_execs", concurrent_execs(sb).await);
    suite.record(
        "slow_reader_of_large_output",
        slow_reader_of_large_output(sb).await,
    );
    suite.record("detached_processes", detached_processes(sb).await);
    suite.record(
        "a_second_launch_in_one_spool_returns_the_first",
        a_second_launch_in_one_spool_returns_the_first(sb).await,
    );
    if options.large_file_bytes > 0 {
        suite.record(
            "large_file_round_trip",
            large_file_round_trip(sb, "suite/large.bin", options.large_file_bytes)
                .await
                .map(|_| ()),
        );
    }
    suite.record(
        "destroy (suite sandbox)",
        sandbox.destroy().await.map_err(Into::into),
    );
    record_provider_items(&mut suite, provider, &spec, options).await;
    suite.finish()
}

/// The items about what the provider does with sandboxes rather than what
/// one sandbox does — `exec_env`, `detach_and_resume`,
/// `destroy_is_idempotent`, `a_slot_replaces_its_leftover` and the
/// optional items — each on sandboxes it creates: the second half of
/// [`run_all_with`], and what a variant of a provider that creates another
/// way (a pool of ready containers) runs beside [`command_and_file_items`]
/// on one of its sandboxes.
pub async fn provider_items(
    provider: &dyn SandboxProvider,
    spec: &SandboxSpec,
    options: &SuiteOptions,
) -> Result<SuiteReport> {
    let mut suite = Recorder::new(provider);
    record_provider_items(&mut suite, provider, spec, options).await;
    suite.finish()
}

async fn record_provider_items(
    suite: &mut Recorder,
    provider: &dyn SandboxProvider,
    spec: &SandboxSpec,
    options: &SuiteOptions,
) {
    suite.record("exec_env", exec_env(provider, spec).await);
    suite.record("detach_and_resume", detach_and_resume(provider, spec).await);
    suite.record(
        "destroy_is_idempotent",
        destroy_is_idempotent(provider, spec).await,
    );
    suite.record(
        "a_slot_replaces_its_leftover",
        a_slot_replaces_its_leftover(provider, spec).await,
    );
    suite.optional("port_endpoint", port_endpoint(provider, spec).await);
    suite.optional("stop_and_resume", stop_and_resume(provider, spec).await);
    suite.optional(
        "network_deny_all",
        network_deny_all(provider, spec, options).await,
    );
    suite.optional("host_forward", host_forward(provider, spec).await);
    suite.optional(
        "network_custom",
        network_custom(provider, spec, options).await,
    );
}

/// What a run of items found so far: the failures, each under its item's
/// name, and the optional items' answers.
struct Recorder {
    provider: String,
    failures: Vec<String>,
    report: SuiteReport,
    /// Items run one after another, so the time since the previous record
    /// is this item's: printed so a slow provider shows where it is slow.
    previous: Instant,
}

impl Recorder {
    fn new(provider: &dyn SandboxProvider) -> Recorder {
        Recorder {
            provider: provider.name().to_string(),
            failures: Vec::new(),
            report: SuiteReport::default(),
            previous: Instant::now(),
        }
    }

    fn record(&mut self, name: &str, result: Result<()>) {
        eprintln!(
            "sandbox suite [{}] {name}: {:.2} s",
            self.provider,
            self.previous.elapsed().as_secs_f64()
        );
        self.previous = Instant::now();
        if let Err(e) = result {
            self.failures.push(format!("{name}: {e:#}"));
        }
    }

    fn optional(&mut self, name: &'static str, answer: Result<Capability>) {
        let answer = answer.map(|capability| {
            self.report.capabilities.insert(name, capability);
        });
        self.record(name, answer);
    }

    fn finish(self) -> Result<SuiteReport> {
        if self.failures.is_empty() {
            Ok(self.report)
        } else {
            bail!(
                "{} sandbox contract item(s) failed for provider {:?}:\n  - {}",
                self.failures.len(),
                self.provider,
                self.failures.join("\n  - ")
            )
        }
    }
}

/// A deny-all spec with one forward (to a [`SocketServer`] kept alive by
/// the returned guard): what a gated or sealed variant runs
/// [`contract_items`] on, so every command goes through its namespace.
pub async fn deny_all_with_a_forward() -> Result<(SocketServer, SandboxSpec)> {
    let server = SocketServer::start("unused").await?;
    let mut spec = SandboxSpec::new("/workspace");
    spec.network = NetworkPolicy::DenyAll;
    spec.forwards = vec![server.forward(harness_core::sandbox::MODEL_BROKER_PORT)];
    Ok((server, spec))
}

/// The command, file, concurrency, detached-launch, environment,
/// detach/resume and destroy items on sandboxes made from `spec`: what a
/// variant of a provider (every command behind the gate, a sealed local
/// sandbox) must keep of the contract, without the items its variant
/// changes on purpose (ports, network policies).
pub async fn contract_items(provider: &dyn SandboxProvider, spec: &SandboxSpec) -> Result<()> {
    let sandbox = provider.create(spec).await?;
    let sb = sandbox.as_ref();
    command_and_file_items(sb).await?;
    concurrent_execs(sb).await?;
    a_second_launch_in_one_spool_returns_the_first(sb).await?;
    sandbox.destroy().await?;
    exec_env(provider, spec).await?;
    detach_and_resume(provider, spec).await?;
    destroy_is_idempotent(provider, spec).await
}

/// The items about one sandbox's commands and files — exec streams, exit
/// codes, cwd, stdin, streaming before exit, timeout and abort killing the
/// tree, files, reads from an offset, detached processes — stopping at the
/// first failure: for a backend's own tests of a sandbox made another way
/// (behind a gate, taken from a pool) that must keep the same contract.
pub async fn command_and_file_items(sb: &dyn Sandbox) -> Result<()> {
    exec_streams_stdout_stderr_and_one_exit(sb).await?;
    exec_exit_codes(sb).await?;
    exec_cwd(sb).await?;
    exec_stdin(sb).await?;
    exec_streams_before_exit(sb).await?;
    exec_timeout_kills_tree(sb).await?;
    exec_abort_kills_tree(sb).await?;
    files_round_trip(sb).await?;
    read_file_from_offset(sb).await?;
    detached_processes(sb).await?;
    home_hint_is_the_home_commands_see(sb).await?;
    Ok(())
}

/// A provider's [`Sandbox::home_hint`], when it gives one, is the `$HOME`
/// commands see (the slice builds the agent's paths from it without
/// asking).
pub async fn home_hint_is_the_home_commands_see(sb: &dyn Sandbox) -> Result<()> {
    let Some(hint) = sb.home_hint() else {
        return Ok(());
    };
    let seen = sh(sb, "printf %s \"$HOME\"").await?;
    ensure!(
        hint == seen,
        "home_hint says {hint:?}, but commands see HOME={seen:?}"
    );
    Ok(())
}

// ---------------------------------------------------------------------------
// helpers

/// Await `fut`, failing with `what` if it takes longer than `limit`.
async fn within<T>(limit: Duration, what: &str, fut: impl Future<Output = T>) -> Result<T> {
    tokio::time::timeout(limit, fut)
        .await
        .map_err(|_| anyhow!("{what} did not finish within {limit:?}"))
}

/// Run a request and collect its output, bounded by `COMMAND_DEADLINE`.
async fn run(sb: &dyn Sandbox, req: ExecRequest) -> Result<ExecOutput> {
    let what = format!("exec {:?}", req.argv);
    let stream = sb.exec(req).await.with_context(|| what.clone())?;
    within(COMMAND_DEADLINE, &what, collect_exec(stream))
        .await?
        .with_context(|| {
            format!("{what}: stream ended badly (the contract requires a final Exit event)")
        })
}

/// Run a shell script that must succeed; returns stdout.
async fn sh(sb: &dyn Sandbox, script: &str) -> Result<String> {
    let out = run(sb, ExecRequest::shell(script)).await?;
    ensure!(
        out.status.success(),
        "setup script {script:?} failed ({:?}): {}",
        out.status,
        out.stderr_str().trim()
    );
    Ok(out.stdout_str())
}

/// Collect a byte stream, bounded in time and size.
async fn read_all(stream: ByteStream, what: &str) -> Result<Vec<u8>> {
    let bytes = within(
        COMMAND_DEADLINE,
        what,
        harness_core::stream::collect(stream, 256 * 1024 * 1024),
    )
    .await??;
    Ok(bytes.to_vec())
}

/// Read a whole file (errors keep their kind for NotFound checks).
async fn read_file(sb: &dyn Sandbox, path: &str) -> Result<Vec<u8>, Error> {
    let stream = sb.read_file(path).await?;
    let bytes = tokio::time::timeout(
        COMMAND_DEADLINE,
        harness_core::stream::collect(stream, 256 * 1024 * 1024),
    )
    .await
    .map_err(|_| Error::backend(format!("reading {path} hung")))??;
    Ok(bytes.to_vec())
}

/// `bytes` as a stream of `chunk`-sized pieces.
fn chunked(bytes: Vec<u8>, chunk: usize) -> ByteStream {
    let bytes = Bytes::from(bytes);
    let pieces: Vec<_> = (0..bytes.len())
        .step_by(chunk.max(1))
        .map(|i| Ok(bytes.slice(i..(i + chunk).min(bytes.len()))))
        .collect();
    Box::pin(futures::stream::iter(pieces))
}

/// Deterministic pseudo-random content of `len` bytes, produced in
/// `chunk`-byte pieces as a stream and never held whole.
pub fn generated_stream(len: u64, chunk: usize, seed: u64) -> ByteStream {
    let mut state = seed | 1;
    let mut left = len;
    Box::pin(futures::stream::iter(std::iter::from_fn(move || {
        if left == 0 {
            return None;
        }
        let n = (chunk as u64).min(left) as usize;
        left -= n as u64;
        let mut buf = Vec::with_capacity(n);
        while buf.len() < n {
            // xorshift64*: cheap, deterministic and incompressible.
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            let v = state.wrapping_mul(0x2545_F491_4F6C_DD1D).to_le_bytes();
            buf.extend_from_slice(&v[..(n - buf.len()).min(8)]);
        }
        Some(Ok(Bytes::from(buf)))
    })))
}

fn pseudo_random(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 24) as u8
        })
        .collect()
}

/// A fresh directory name under the workdir for one check.
fn scratch(name: &str) -> String {
    format!("suite/{name}-{}", uuid_like())
}

fn uuid_like() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!("{:x}{:x}{n}", std::process::id(), t & 0xffff_ffff)
}

/// Shell snippet printing every pid in `pidfile` that is still alive (a
/// zombie counts as dead: only its exit status is left, and an init that
/// does not reap would otherwise keep it "alive").
fn alive_pids_script(pidfile: &str) -> String {
    format!(
        "for p in $(cat {f}); do \
           if kill -0 \"$p\" 2>/dev/null; then \
             s=$(sed 's/.*) //' /proc/$p/stat 2>/dev/null | cut -d' ' -f1); \
             [ \"$s\" = Z ] || echo \"$p\"; \
           fi; \
         done",
        f = shell_quote(pidfile)
    )
}

/// Wait until every pid in `pidfile` is gone (up to 10 s).
async fn assert_pids_gone(sb: &dyn Sandbox, pidfile: &str, what: &str) -> Result<()> {
    let pids = sh(sb, &format!("cat {}", shell_quote(pidfile))).await?;
    ensure!(
        pids.split_whitespace().count() >= 2,
        "{what}: the test command did not record its pids ({pids:?})"
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let alive = sh(sb, &alive_pids_script(pidfile)).await?;
        if alive.trim().is_empty() {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "{what}: processes of the killed command's tree are still alive (pids {}; all \
                 recorded: {}): the whole process tree must be killed",
                alive.split_whitespace().collect::<Vec<_>>().join(" "),
                pids.split_whitespace().collect::<Vec<_>>().join(" ")
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn is_kind<T>(result: &Result<T, Error>, kind: ErrorKind) -> bool {
    matches!(result, Err(e) if e.kind() == kind)
}

// ---------------------------------------------------------------------------
// exec

/// stdout and stderr arrive as separate events, and the stream ends with
/// exactly one `Exit`, after which it yields nothing.
pub async fn exec_streams_stdout_stderr_and_one_exit(sb: &dyn Sandbox) -> Result<()> {
    let mut stream = sb
        .exec(ExecRequest::shell(
            "printf out1; printf err1 >&2; printf out2; printf err2 >&2; exit 0",
        ))
        .await
        .context("exec")?;
    let mut stdout = Vec::new();
    let mut stderr = Vec::new();
    let mut exits = Vec::new();
    let mut after_exit = 0usize;
    let drain = async {
        while let Some(event) = stream.next().await {
            match event.context("exec stream yielded an error")? {
                ExecEvent::Stdout(b) if exits.is_empty() => stdout.extend_from_slice(&b),
                ExecEvent::Stderr(b) if exits.is_empty() => stderr.extend_from_slice(&b),
                ExecEvent::Exit(s) => exits.push(s),
                _ => after_exit += 1,
            }
        }
        Ok::<_, anyhow::Error>(())
    };
    within(COMMAND_DEADLINE, "draining an exec stream", drain).await??;
    ensure!(
        exits.len() == 1,
        "the exec stream must end with exactly one Exit event, got {} ({exits:?})",
        exits.len()
    );
    ensure!(
        after_exit == 0,
        "the exec stream yielded {after_exit} output event(s) after Exit"
    );
    ensure!(
        exits[0].success(),
        "`exit 0` must report success, got {:?}",
        exits[0]
    );
    ensure!(
        stdout == b"out1out2",
        "stdout must carry exactly what went to fd 1, got {:?}",
        String::from_utf8_lossy(&stdout)
    );
    ensure!(
        stderr == b"err1err2",
        "stderr must carry exactly what went to fd 2, got {:?}",
        String::from_utf8_lossy(&stderr)
    );
    Ok(())
}

/// Exit codes and signals are reported as they happened.
pub async fn exec_exit_codes(sb: &dyn Sandbox) -> Result<()> {
    for code in [0, 1, 3, 42] {
        let out = run(sb, ExecRequest::shell(format!("exit {code}"))).await?;
        ensure!(
            out.status.code == Some(code) && out.status.reason == ExitReason::Exited,
            "`exit {code}` must report code {code} and reason Exited, got {:?}",
            out.status
        );
        ensure!(
            out.status.success() == (code == 0),
            "success() must be true only for code 0 (code {code}: {:?})",
            out.status
        );
    }
    let out = run(sb, ExecRequest::shell("kill -9 $$")).await?;
    ensure!(
        out.status.signal == Some(9) || out.status.code == Some(137),
        "a command killed by SIGKILL must report signal 9 (or code 137), got {:?}",
        out.status
    );
    ensure!(
        out.status.reason == ExitReason::Exited,
        "a kill we did not ask for is reason Exited, got {:?}",
        out.status
    );
    // A program that does not exist: an error, or a failed exit.
    match sb
        .exec(ExecRequest::new(["/nonexistent/harness-suite-program"]))
        .await
    {
        Err(_) => {}
        Ok(stream) => {
            let out = within(
                COMMAND_DEADLINE,
                "exec of a missing program",
                collect_exec(stream),
            )
            .await??;
            ensure!(
                !out.status.success(),
                "running a missing program must not succeed, got {:?}",
                out.status
            );
        }
    }
    Ok(())
}

/// The spec's env and the request's env reach the command (the request
/// wins), and `HOME` is set.
pub async fn exec_env(provider: &dyn SandboxProvider, spec: &SandboxSpec) -> Result<()> {
    let mut spec = spec.clone();
    spec.env
        .insert("SUITE_SPEC_VAR".into(), "from spec with spaces".into());
    spec.env.insert("SUITE_OVERRIDE".into(), "spec".into());
    let sandbox = provider.create(&spec).await.context("create")?;
    let result = async {
        let out = run(
            sandbox.as_ref(),
            ExecRequest::shell(r#"printf '%s|%s|%s|%s' "$SUITE_SPEC_VAR" "$SUITE_OVERRIDE" "$SUITE_REQ" "${HOME:+home-set}""#)
                .env("SUITE_OVERRIDE", "request")
                .env("SUITE_REQ", "it's $literal"),
        )
        .await?;
        ensure!(
            out.stdout_str() == "from spec with spaces|request|it's $literal|home-set",
            "env must be spec env + request env (request wins) with HOME set; got {:?}",
            out.stdout_str()
        );
        Ok(())
    }
    .await;
    sandbox.destroy().await.context("destroy")?;
    result
}

/// The default cwd is the workdir; relative cwds resolve against it,
/// absolute ones are taken as they are; a missing cwd fails.
pub async fn exec_cwd(sb: &dyn Sandbox) -> Result<()> {
    let dir = scratch("cwd");
    sh(sb, &format!("mkdir -p {}/sub", shell_quote(&dir))).await?;
    let workdir_real = sh(sb, &format!("cd {} && pwd -P", shell_quote(sb.workdir()))).await?;
    let default_cwd = sh(sb, "pwd -P").await?;
    ensure!(
        default_cwd == workdir_real,
        "the default cwd must be the workdir {:?}, got {:?}",
        workdir_real.trim(),
        default_cwd.trim()
    );
    let rel = run(sb, ExecRequest::shell("pwd -P").cwd(format!("{dir}/sub"))).await?;
    let expected = format!("{}/{dir}/sub", workdir_real.trim());
    ensure!(
        rel.status.success() && rel.stdout_str().trim() == expected,
        "a relative cwd must resolve against the workdir: expected {expected:?}, got {:?} ({:?})",
        rel.stdout_str().trim(),
        rel.status
    );
    let abs = format!("{}/{dir}", sb.workdir().trim_end_matches('/'));
    let out = run(sb, ExecRequest::shell("pwd -P").cwd(abs.clone())).await?;
    ensure!(
        out.status.success() && out.stdout_str().trim() == format!("{}/{dir}", workdir_real.trim()),
        "an absolute cwd {abs:?} must be used as is, got {:?}",
        out.stdout_str().trim()
    );
    match sb
        .exec(ExecRequest::shell("true").cwd(format!("{dir}/does-not-exist")))
        .await
    {
        Err(_) => {}
        Ok(stream) => {
            let out = within(
                COMMAND_DEADLINE,
                "exec in a missing cwd",
                collect_exec(stream),
            )
            .await??;
            ensure!(
                !out.status.success(),
                "a command in a missing cwd must not succeed, got {:?}",
                out.status
            );
        }
    }
    sh(sb, &format!("rm -rf {}", shell_quote(&dir))).await?;
    Ok(())
}

/// stdin bytes (binary, with zeros) reach the command and stdin is closed
/// after them; no stdin means an empty, closed stdin.
pub async fn exec_stdin(sb: &dyn Sandbox) -> Result<()> {
    let mut data = pseudo_random(1024 * 1024, 7);
    data.extend_from_slice(&[0, 0, 0, b'\n', 0]);
    let out = run(sb, ExecRequest::new(["cat"]).stdin(data.clone())).await?;
    ensure!(
        out.status.success(),
        "cat with stdin failed: {:?}",
        out.status
    );
    ensure!(
        out.stdout.as_ref() == data.as_slice(),
        "stdin must reach the command byte for byte: sent {} bytes, cat echoed {} bytes",
        data.len(),
        out.stdout.len()
    );
    let out = run(sb, ExecRequest::new(["cat"])).await?;
    ensure!(
        out.status.success() && out.stdout.is_empty(),
        "without stdin, `cat` must see an empty closed stdin; got {:?} and {} bytes",
        out.status,
        out.stdout.len()
    );
    Ok(())
}

/// Output arrives while the command runs, not only when it ends. Decided by
/// events, not by the clock: the command prints `a`, then waits for a gate
/// file that is only made once `a` has arrived, then prints `b`. A backend
/// that held output back until the exit would deliver nothing until the
/// command gave up waiting (30 s), and fail here.
pub async fn exec_streams_before_exit(sb: &dyn Sandbox) -> Result<()> {
    let gate = format!("/tmp/harness-suite-gate-{}", uuid_like());
    let script = format!(
        "echo a; i=0; while [ ! -e {g} ] && [ $i -lt 600 ]; do sleep 0.05; i=$((i+1)); done; \
         if [ -e {g} ]; then echo b; else echo no-gate; fi",
        g = shell_quote(&gate)
    );
    let mut stream = sb.exec(ExecRequest::shell(script)).await.context("exec")?;
    let first = within(Duration::from_secs(20), "the first line while the command runs", async {
        loop {
            match stream.next().await {
                Some(Ok(ExecEvent::Stdout(b))) => break Ok(b),
                Some(Ok(ExecEvent::Stderr(_))) => continue,
                Some(Ok(ExecEvent::Exit(s))) => {
                    break Err(anyhow!("the command exited ({s:?}) before any output arrived"))
                }
                Some(Err(e)) => break Err(e.into()),
                None => break Err(anyhow!("the stream ended without output")),
            }
        }
    })
    .await
    .context("output must stream while the command runs (the command waits for a gate only opened once its first line arrived)")??;
    ensure!(
        first.starts_with(b"a"),
        "the first stdout chunk must start with \"a\", got {:?}",
        String::from_utf8_lossy(&first)
    );
    sh(sb, &format!("touch {}", shell_quote(&gate))).await?;
    let mut all = first.to_vec();
    let mut status = None;
    within(
        COMMAND_DEADLINE,
        "the rest of the streaming command",
        async {
            while let Some(event) = stream.next().await {
                match event? {
                    ExecEvent::Stdout(b) => all.extend_from_slice(&b),
                    ExecEvent::Stderr(_) => {}
                    ExecEvent::Exit(s) => status = Some(s),
                }
            }
            Ok::<_, Error>(())
        },
    )
    .await??;
    let _ = sh(sb, &format!("rm -f {}", shell_quote(&gate))).await;
    let status = status.ok_or_else(|| anyhow!("no Exit event"))?;
    ensure!(status.success(), "the gated command failed: {status:?}");
    ensure!(
        all == b"a\nb\n",
        "stdout must be \"a\\nb\\n\", got {:?}",
        String::from_utf8_lossy(&all)
    );
    Ok(())
}

/// The tree killer shared by the timeout and abort checks.
async fn killed_tree(
    sb: &dyn Sandbox,
    name: &str,
    make: impl FnOnce(ExecRequest) -> ExecRequest,
    want: ExitReason,
) -> Result<()> {
    let dir = scratch(name);
    sh(sb, &format!("mkdir -p {}", shell_quote(&dir))).await?;
    let pidfile = format!("{}/{dir}/pids", sb.workdir().trim_end_matches('/'));
    let script = format!(
        "echo $$ > {f}; sleep 100 & echo $! >> {f}; sleep 100",
        f = shell_quote(&pidfile)
    );
    let started = Instant::now();
    let req = make(ExecRequest::shell(script));
    let stream = sb.exec(req).await.context("exec")?;
    let out = within(
        Duration::from_secs(20),
        &format!("a command that should be killed ({want:?}) after 1 s"),
        collect_exec(stream),
    )
    .await?
    .context("the killed command's stream must still end with an Exit event")?;
    ensure!(
        out.status.reason == want,
        "a command killed by its {} must report reason {want:?}, got {:?}",
        if want == ExitReason::TimedOut {
            "timeout"
        } else {
            "abort signal"
        },
        out.status
    );
    ensure!(
        !out.status.success(),
        "a killed command must not report success: {:?}",
        out.status
    );
    ensure!(
        started.elapsed() < Duration::from_secs(15),
        "the kill took {:?}",
        started.elapsed()
    );
    assert_pids_gone(sb, &pidfile, &format!("after {want:?}")).await?;
    sh(sb, &format!("rm -rf {}", shell_quote(&dir))).await?;
    Ok(())
}

/// A timeout kills the command and its children; reason `TimedOut`.
pub async fn exec_timeout_kills_tree(sb: &dyn Sandbox) -> Result<()> {
    killed_tree(
        sb,
        "timeout",
        |r| r.timeout(Duration::from_secs(1)),
        ExitReason::TimedOut,
    )
    .await
}

/// An abort signal kills the command and its children; reason `Aborted`.
pub async fn exec_abort_kills_tree(sb: &dyn Sandbox) -> Result<()> {
    let signal = AbortSignal::new();
    let trigger = signal.clone();
    let timer = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(1)).await;
        trigger.abort();
    });
    let result = killed_tree(sb, "abort", |r| r.abort(signal), ExitReason::Aborted).await;
    timer.abort();
    result
}

// ---------------------------------------------------------------------------
// files

/// Files written as streams read back byte for byte: binary with zeros,
/// several MB in uneven chunks, parent directories created, replacement,
/// absolute and relative paths agreeing, `NotFound` for a missing file.
pub async fn files_round_trip(sb: &dyn Sandbox) -> Result<()> {
    let dir = scratch("files");
    let binary: Vec<u8> = (0..=255u8).chain(std::iter::repeat_n(0u8, 300)).collect();
    let path = format!("{dir}/a/b/c/binary.bin");
    let n = sb
        .write_file(&path, chunked(binary.clone(), 100))
        .await
        .context("write_file into missing parent directories must create them")?;
    ensure!(
        n == binary.len() as u64,
        "write_file returned {n}, wrote {} bytes",
        binary.len()
    );
    let back = read_file(sb, &path).await.context("read_file")?;
    ensure!(
        back == binary,
        "binary content (with zero bytes) changed in a write/read round trip"
    );
    // The exec side sees the same file at the same relative path.
    let size = sh(sb, &format!("wc -c < {}", shell_quote(&path))).await?;
    ensure!(
        size.trim() == binary.len().to_string(),
        "exec sees {} bytes at {path}, write_file wrote {}",
        size.trim(),
        binary.len()
    );

    let big = pseudo_random(5 * 1024 * 1024 + 123, 42);
    let big_path = format!("{dir}/big.bin");
    let n = sb
        .write_file(&big_path, chunked(big.clone(), 65_537))
        .await
        .context("write_file of 5 MB")?;
    ensure!(
        n == big.len() as u64,
        "write_file returned {n} for {} bytes",
        big.len()
    );
    let back = read_all(sb.read_file(&big_path).await?, "reading 5 MB").await?;
    ensure!(
        back.len() == big.len() && back == big,
        "5 MB file changed in a round trip (read {} of {} bytes)",
        back.len(),
        big.len()
    );

    // Replacing an existing file with shorter content leaves no tail.
    sb.write_file(&big_path, harness_core::stream::once("short"))
        .await?;
    let back = read_file(sb, &big_path).await?;
    ensure!(
        back == b"short",
        "write_file must replace the file, got {} bytes starting {:?}",
        back.len(),
        String::from_utf8_lossy(&back[..back.len().min(16)])
    );

    // An absolute path inside the workdir is the same file as the relative one.
    let abs = format!("{}/{dir}/abs.txt", sb.workdir().trim_end_matches('/'));
    sb.write_file(&abs, harness_core::stream::once("absolute"))
        .await?;
    let back = read_file(sb, &format!("{dir}/abs.txt")).await?;
    ensure!(
        back == b"absolute",
        "absolute and workdir-relative paths must name the same file"
    );

    // An empty stream makes an empty file.
    sb.write_file(&format!("{dir}/empty"), harness_core::stream::empty())
        .await?;
    ensure!(
        read_file(sb, &format!("{dir}/empty")).await?.is_empty(),
        "empty write must give an empty file"
    );

    let missing = read_file(sb, &format!("{dir}/no/such/file")).await;
    ensure!(
        is_kind(&missing, ErrorKind::NotFound),
        "reading a missing file must fail with NotFound, got {:?}",
        missing.map(|b| b.len())
    );
    sh(sb, &format!("rm -rf {}", shell_quote(&dir))).await?;
    Ok(())
}

/// `read_file_from` starts at the offset; past the end is empty; a missing
/// file is `NotFound`.
pub async fn read_file_from_offset(sb: &dyn Sandbox) -> Result<()> {
    let dir = scratch("offset");
    let path = format!("{dir}/spool");
    sb.write_file(&path, harness_core::stream::once("0123456789"))
        .await?;
    for (offset, want) in [
        (0u64, "0123456789"),
        (4, "456789"),
        (9, "9"),
        (10, ""),
        (25, ""),
    ] {
        let got = read_all(
            sb.read_file_from(&path, offset)
                .await
                .with_context(|| format!("read_file_from({offset})"))?,
            "read_file_from",
        )
        .await?;
        ensure!(
            got == want.as_bytes(),
            "read_file_from(offset {offset}) must give {want:?}, got {:?}",
            String::from_utf8_lossy(&got)
        );
    }
    let missing = async {
        let s = sb.read_file_from(&format!("{dir}/missing"), 3).await?;
        harness_core::stream::collect(s, 1024).await
    }
    .await;
    ensure!(
        is_kind(&missing, ErrorKind::NotFound),
        "read_file_from of a missing file must fail with NotFound, got {missing:?}"
    );
    sh(sb, &format!("rm -rf {}", shell_quote(&dir))).await?;
    Ok(())
}

/// A listing of a tree that tells types, modes, link targets and content.
async fn manifest(sb: &dyn Sandbox, dir: &str) -> Result<Vec<String>> {
    // With GNU find, a handful of processes for the whole tree (`-printf`,
    // one `cksum` per batch of files); without it, a few per entry — which
    // in an emulated microVM made a 601-file tree take over a minute.
    let script = format!(
        "cd {} && if find . -maxdepth 0 -printf '' >/dev/null 2>&1; then \
           find . -mindepth 1 \\( -type l -printf 'L %p -> %l\\n' \\) \
             -o \\( -type d -printf 'D %p %m\\n' \\) -o -printf 'F %p %m\\n' | LC_ALL=C sort; \
           find . -mindepth 1 -type f -print0 | xargs -0 -r cksum | sed 's/^/C /' | LC_ALL=C sort; \
         else \
           find . -mindepth 1 | LC_ALL=C sort | while IFS= read -r p; do \
             if [ -L \"$p\" ]; then echo \"L $p -> $(readlink \"$p\")\"; \
             elif [ -d \"$p\" ]; then echo \"D $p $(stat -c %a \"$p\")\"; \
             else echo \"F $p $(stat -c %a \"$p\") $(cksum < \"$p\")\"; fi; done; \
         fi",
        shell_quote(dir)
    );
    Ok(sh(sb, &script).await?.lines().map(str::to_string).collect())
}

/// export_tar → import_tar reproduces files, directories, symlinks and
/// modes, with entry names relative to the exported directory; import
/// overlays (files only in the target stay, files in both are replaced).
pub async fn tar_round_trip(sb: &dyn Sandbox) -> Result<()> {
    let base = scratch("tar");
    let src = format!("{base}/src");
    let dst = format!("{base}/dst");
    let long = "d".repeat(60);
    sh(
        sb,
        &format!(
            "set -e; mkdir -p {src}/a/b {src}/empty {src}/{long}/{long}; cd {src}; \
             printf hello > a/b/file.txt; chmod 640 a/b/file.txt; \
             printf '#!/bin/sh\\necho hi\\n' > run.sh; chmod 755 run.sh; \
             : > zero; head -c 300000 /dev/urandom > rand.bin; \
             printf deep > {long}/{long}/deep.txt; \
             ln -s b/file.txt a/link; ln -s ../outside-target dangling; chmod 700 empty; \
             mkdir -p ../dst/a/b; printf stays > ../dst/only-in-target.txt; \
             printf old-content-longer > ../dst/a/b/file.txt",
            src = shell_quote(&src),
        ),
    )
    .await?;
    let tar = read_all(
        sb.export_tar(&src).await.context("export_tar")?,
        "export_tar",
    )
    .await?;
    // Entry names are relative to the exported directory.
    let mut archive = tar::Archive::new(tar.as_slice());
    let mut names = Vec::new();
    for entry in archive
        .entries()
        .context("export_tar produced an unreadable tar")?
    {
        let entry = entry.context("export_tar produced an unreadable tar entry")?;
        names.push(String::from_utf8_lossy(&entry.path_bytes()).into_owned());
    }
    ensure!(
        names
            .iter()
            .all(|n| !n.starts_with('/') && !n.contains("suite/")),
        "export_tar entries must be relative to the exported dir, got {names:?}"
    );
    ensure!(
        names
            .iter()
            .any(|n| n.trim_start_matches("./") == "a/b/file.txt"),
        "export_tar must contain a/b/file.txt, got {names:?}"
    );

    sb.import_tar(&dst, harness_core::stream::once(tar))
        .await
        .context("import_tar")?;
    let want = manifest(sb, &src).await?;
    let got = manifest(sb, &dst).await?;
    let got_without_extra: Vec<_> = got
        .iter()
        .filter(|l| !l.contains("only-in-target.txt"))
        .cloned()
        .collect();
    ensure!(
        got_without_extra == want,
        "import_tar(export_tar(src)) must reproduce src (types, modes, link targets, content).\n\
         src:\n{}\ndst:\n{}",
        want.join("\n"),
        got.join("\n")
    );
    let kept = read_file(sb, &format!("{dst}/only-in-target.txt")).await;
    ensure!(
        matches!(&kept, Ok(b) if b == b"stays"),
        "import_tar must overlay: a file only in the target must stay, got {:?}",
        kept.map(|b| String::from_utf8_lossy(&b).into_owned())
    );

    let missing = async {
        let s = sb.export_tar(&format!("{base}/no-such-dir")).await?;
        harness_core::stream::collect(s, 1024 * 1024).await
    }
    .await;
    ensure!(
        missing.is_err(),
        "export_tar of a missing directory must fail"
    );
    sh(sb, &format!("rm -rf {}", shell_quote(&base))).await?;
    Ok(())
}

/// Whether the sandbox has GNU `find` and `tar`, which tree checkpoints use
/// to read only changed files (elsewhere they read the whole tree).
async fn has_gnu_tools(sb: &dyn Sandbox) -> Result<bool> {
    let out = run(
        sb,
        ExecRequest::shell(
            "find . -maxdepth 0 -printf '' >/dev/null 2>&1 && tar --version 2>/dev/null | grep -q 'GNU tar'",
        ),
    )
    .await?;
    Ok(out.status.success())
}

/// `export_paths_tar` archives exactly the named paths as GNU `tar
/// --no-recursion -T -` does inside the sandbox (the trait's default, and
/// the oracle here): same paths, kinds, permission bits, sizes, mtimes,
/// link texts and contents. A directory comes without its contents, a
/// symlink as a symlink (a dangling one too), a missing path is left out.
/// Passes trivially for a provider that keeps the default.
pub async fn paths_export_matches_gnu_tar(sb: &dyn Sandbox) -> Result<()> {
    if !has_gnu_tools(sb).await? {
        return Ok(());
    }
    let base = scratch("paths-export");
    sh(
        sb,
        &format!(
            "set -e; mkdir -p {b}/a/b; cd {b}; \
             printf hello > a/b/file.txt; chmod 640 a/b/file.txt; \
             printf inside > a/b/not-asked; printf x > 'sp ace é'; : > zero; \
             ln -s a/b/file.txt link; ln -s ../nowhere dangling; \
             touch -d '2001-02-03 04:05:06' a/b/file.txt",
            b = shell_quote(&base)
        ),
    )
    .await?;
    let paths: Vec<String> = [
        "a",
        "a/b/file.txt",
        "sp ace é",
        "zero",
        "link",
        "dangling",
        "gone",
    ]
    .iter()
    .map(|p| p.to_string())
    .collect();
    let native = sb
        .export_paths_tar(&base, &paths)
        .await
        .context("export_paths_tar")?;
    let gnu = harness_core::sandbox::export_paths_with_tar(sb, &base, &paths).await?;
    let (native, gnu) = (
        tar_entries(read_all(native, "export_paths_tar").await?)?,
        tar_entries(read_all(gnu, "GNU tar -T -").await?)?,
    );
    let names: Vec<&str> = native.iter().map(|e| e.0.as_str()).collect();
    ensure!(
        names == ["a", "a/b/file.txt", "dangling", "link", "sp ace é", "zero"],
        "exported {names:?}"
    );
    ensure!(
        native == gnu,
        "export_paths_tar gave {native:?}, GNU tar {gnu:?}"
    );
    sh(sb, &format!("rm -rf {}", shell_quote(&base))).await?;
    Ok(())
}

/// (path without a trailing `/`, entry type, permission bits, size, mtime,
/// link text, SHA-256 of the content) of every entry, sorted by path.
type TarRow = (String, u8, u32, u64, u64, String, String);

fn tar_entries(bytes: Vec<u8>) -> Result<Vec<TarRow>> {
    use std::io::Read;
    let mut archive = tar::Archive::new(std::io::Cursor::new(bytes));
    let mut rows = Vec::new();
    for entry in archive.entries()? {
        let mut entry = entry?;
        let header = entry.header().clone();
        let path = entry
            .path()?
            .to_string_lossy()
            .trim_end_matches('/')
            .to_string();
        let link = entry
            .link_name()?
            .map(|l| l.to_string_lossy().to_string())
            .unwrap_or_default();
        let mut content = Vec::new();
        entry.read_to_end(&mut content)?;
        rows.push((
            path,
            header.entry_type().as_byte(),
            header.mode()? & 0o7777,
            header.size()?,
            header.mtime()?,
            link,
            hex::encode(Sha256::digest(&content)),
        ));
    }
    rows.sort();
    Ok(rows)
}

/// A provider's native tree listing ([`Sandbox::list_tree`]) says what GNU
/// `find -printf` inside the sandbox says, field for field: kind, mode
/// (setuid included), size, mtime, inode, ctime to the nanosecond, path and
/// link text, for files, directories, symlinks (dangling too), a hard
/// link, a FIFO and a name with spaces and non-ASCII; its clock reading is
/// the sandbox's; a missing directory or a file is `NotFound`. A provider
/// without one answers `Unsupported` (the default) and is not checked
/// further.
pub async fn native_listing_matches_find(sb: &dyn Sandbox) -> Result<()> {
    let base = scratch("listing");
    match sb.list_tree(&base).await {
        Err(e) if e.kind() == ErrorKind::Unsupported => return Ok(()),
        Err(e) if e.kind() == ErrorKind::NotFound => {}
        other => bail!("listing {base} before it exists: {other:?}, expected NotFound"),
    }
    sh(
        sb,
        &format!(
            "set -e; mkdir -p {b}/a/b {b}/empty; cd {b}; \
             printf hello > a/b/file.txt; chmod 640 a/b/file.txt; \
             printf run > tool; chmod 4755 tool; : > zero; \
             printf x > 'sp ace é'; ln a/b/file.txt hard; \
             ln -s a/b/file.txt link; ln -s ../nowhere dangling; mkfifo pipe; \
             touch -d '2001-02-03 04:05:06' a/b/file.txt",
            b = shell_quote(&base)
        ),
    )
    .await?;
    if !has_gnu_tools(sb).await? {
        bail!("the sandbox lists natively but has no GNU find/tar (list_tree promises GNU tar)");
    }
    let before = sh(sb, "date +%s").await?.trim().parse::<u64>()?;
    let listing = sb
        .list_tree(&base)
        .await
        .with_context(|| format!("listing {base}"))?;
    let after = sh(sb, "date +%s").await?.trim().parse::<u64>()?;
    ensure!(
        (before..=after).contains(&listing.now_secs),
        "the listing's clock {} is not the sandbox's ({before}..={after})",
        listing.now_secs
    );
    let out = run(
        sb,
        ExecRequest::shell(format!(
            "cd {} && find . -mindepth 1 -printf '%y %m %s %T@ %i %C@ %P\\0%l\\0'",
            shell_quote(&base)
        )),
    )
    .await?;
    ensure!(out.status.success(), "find failed: {}", out.stderr_str());
    let mut found = Vec::new();
    let mut fields = out.stdout.split(|&b| b == 0);
    while let Some(record) = fields.next().filter(|r| !r.is_empty()) {
        let link = String::from_utf8(fields.next().context("a record without its link")?.to_vec())?;
        let record = std::str::from_utf8(record)?;
        let parts: Vec<&str> = record.splitn(7, ' ').collect();
        ensure!(parts.len() == 7, "unreadable find record {record:?}");
        let (secs, frac) = parts[5].split_once('.').unwrap_or((parts[5], ""));
        let frac = format!("{frac:0<9}");
        found.push(harness_core::sandbox::ListedEntry {
            kind: parts[0].chars().next().context("no kind")?,
            mode: u32::from_str_radix(parts[1], 8)?,
            size: parts[2].parse()?,
            mtime: parts[3].split('.').next().unwrap_or_default().parse()?,
            ino: parts[4].parse()?,
            ctime_ns: secs.parse::<u64>()? * 1_000_000_000 + frac[..9].parse::<u64>()?,
            path: parts[6].to_string(),
            link,
        });
    }
    let mut native = listing.entries;
    native.sort_by(|a, b| a.path.cmp(&b.path));
    found.sort_by(|a, b| a.path.cmp(&b.path));
    ensure!(
        found.len() == 11,
        "find listed {} paths, expected 11",
        found.len()
    );
    for (n, f) in native.iter().zip(&found) {
        ensure!(n == f, "the native listing says {n:?}, find says {f:?}");
    }
    ensure!(
        native.len() == found.len(),
        "the native listing has {} paths, find {}",
        native.len(),
        found.len()
    );
    let file = sb
        .list_tree(&format!("{base}/zero"))
        .await
        .err()
        .map(|e| e.kind());
    ensure!(
        file == Some(ErrorKind::NotFound),
        "listing a file: {file:?}, expected NotFound"
    );
    sh(sb, &format!("rm -rf {}", shell_quote(&base))).await?;
    Ok(())
}

/// Tree checkpoints (`harness_moves::tree`) through this
/// sandbox's exec, `export_tar` and `import_tar`: a first checkpoint
/// restores the tree exactly; after a one-file change, an added and a
/// removed file, the checkpoint against the first reads and uploads only
/// the change (where the sandbox has GNU find/tar), and restoring it onto
/// the first state writes only the change, removes the deleted file, and
/// keeps a file only the target has; a checkpoint whose blob is missing
/// restores nothing; garbage collection removes exactly the blobs no
/// manifest references, and refuses to run during a checkpoint.
pub async fn tree_checkpoints(sb: &dyn Sandbox) -> Result<()> {
    let base = scratch("tree");
    let scene = TreeScene::make(sb, &base).await?;
    scene.first_checkpoint_restores_the_tree().await?;
    scene.second_checkpoint_moves_only_the_change().await?;
    scene.a_missing_blob_restores_nothing().await?;
    scene.collection_keeps_what_manifests_reference().await?;
    scene.many_files_restore_in_parallel_streams().await?;
    sh(sb, &format!("rm -rf {}", shell_quote(&base))).await?;
    Ok(())
}

/// What [`tree_checkpoints`] works on: the tree `a`, the target `b` (with
/// a file of its own), `c` (a target a refused restore must not create),
/// whether the sandbox has GNU find/tar, and the store and clock every
/// step shares.
struct TreeScene<'s> {
    sb: &'s dyn Sandbox,
    a: String,
    b: String,
    c: String,
    gnu: bool,
    store: MemoryCheckpointStore,
    clock: ManualClock,
}

impl<'s> TreeScene<'s> {
    /// Make the tree under `base`: 30 small files in a deep directory, an
    /// executable, an empty file, a large file and its copy, a symlink, an
    /// empty directory and a file the next step removes.
    async fn make(sb: &'s dyn Sandbox, base: &str) -> Result<Self> {
        let (a, b, c) = (
            format!("{base}/a"),
            format!("{base}/b"),
            format!("{base}/c"),
        );
        sh(
            sb,
            &format!(
                "set -e; mkdir -p {b} {a}/src/deep {a}/empty; echo mine > {b}/user.txt; cd {a}; \
                 i=0; while [ $i -lt 30 ]; do echo \"line $i\" > src/deep/f$i.txt; i=$((i+1)); done; \
                 printf '#!/bin/sh\\necho hi\\n' > run.sh; chmod 755 run.sh; \
                 : > zero; head -c 1500000 /dev/urandom > big.bin; cp big.bin copy.bin; \
                 ln -s src/deep/f1.txt link; echo gone > doomed.txt",
                a = shell_quote(&a),
                b = shell_quote(&b),
            ),
        )
        .await?;
        let gnu = has_gnu_tools(sb).await?;
        Ok(Self {
            sb,
            a,
            b,
            c,
            gnu,
            store: MemoryCheckpointStore::new(),
            clock: ManualClock::at(1_000_000),
        })
    }

    /// A tree of many files restores into an empty directory exactly, in
    /// as many streams side by side as the sandbox takes
    /// ([`Sandbox::parallel_imports`], at most 4), directories and symlinks
    /// in their own: no part writes before its directories exist, none
    /// follows another's symlink. Only for sandboxes that take more than
    /// one stream.
    async fn many_files_restore_in_parallel_streams(&self) -> Result<()> {
        let sb = self.sb;
        if sb.parallel_imports() < 2 {
            // One stream is what every other step restores through; a
            // 601-file tree adds nothing there but minutes (an emulated
            // microVM lists it in over a minute).
            return Ok(());
        }
        let (many, into) = (
            format!("{}/many", self.a),
            format!("{}/many-restored", self.b),
        );
        sh(
            sb,
            &format!(
                "set -e; mkdir -p {m}; cd {m}; d=0; while [ $d -lt 24 ]; do mkdir -p dir$d/sub; \
                 i=0; while [ $i -lt 25 ]; do echo \"$d $i\" > dir$d/sub/f$i.txt; i=$((i+1)); done; \
                 chmod 750 dir$d; d=$((d+1)); done; ln -s dir3/sub dir3link; \
                 head -c 300000 /dev/urandom > dir5/big.bin",
                m = shell_quote(&many),
            ),
        )
        .await?;
        tc::checkpoint_tree(
            sb,
            &many,
            &self.store,
            "trees/many",
            None,
            &self.clock,
            None,
        )
        .await
        .context("checkpoint of 601 files")?;
        let restored = tc::restore_tree(&self.store, "trees/many", sb, &into, None)
            .await
            .context("restoring 601 files")?;
        let ways = sb.parallel_imports().min(4) as u64;
        // Directories, the symlink, and the files in `ways` parts.
        let want_streams = ways + 2;
        ensure!(
            restored.streams == want_streams,
            "601 files for a sandbox taking {ways} imports at once went in {} streams, not {want_streams}",
            restored.streams
        );
        let (want, got) = (manifest(sb, &many).await?, manifest(sb, &into).await?);
        ensure!(
            got == want,
            "a tree restored in parallel streams must reproduce the tree.\nsource:\n{}\nrestored:\n{}",
            want.join("\n"),
            got.join("\n")
        );
        Ok(())
    }

    /// The first checkpoint reads every file, stores each content once,
    /// and restores the tree exactly.
    async fn first_checkpoint_restores_the_tree(&self) -> Result<()> {
        let sb = self.sb;
        let Self {
            a, b, store, clock, ..
        } = self;
        let first = tc::checkpoint_tree(sb, a, store, "trees/1", None, clock, None)
            .await
            .context("first tree checkpoint")?;
        ensure!(
            first.files_read == 35,
            "the first checkpoint reads every file (35), read {}",
            first.files_read
        );
        // copy.bin has big.bin's content: its chunks are stored once.
        let blobs = store.list(BLOB_PREFIX).await?.len() as u64;
        ensure!(
            blobs == first.chunks_uploaded && blobs < 35 + 2,
            "content is stored once per hash: {blobs} blobs, {} uploaded",
            first.chunks_uploaded
        );
        let restored = tc::restore_tree(store, "trees/1", sb, b, None)
            .await
            .context("restoring the first tree checkpoint")?;
        let want = manifest(sb, a).await?;
        let got: Vec<String> = manifest(sb, b)
            .await?
            .into_iter()
            .filter(|l| !l.contains("user.txt"))
            .collect();
        ensure!(
            got == want,
            "a restored tree checkpoint must reproduce the tree.\nsource:\n{}\nrestored:\n{}",
            want.join("\n"),
            got.join("\n")
        );
        ensure!(restored.written >= 38, "wrote {} entries", restored.written);
        Ok(())
    }

    /// After a one-file change, an added and a removed file, the checkpoint
    /// against the first reads and uploads only the change (where the
    /// sandbox has GNU find/tar); restoring it onto the first state writes
    /// only the change, removes the deleted file, and keeps the file only
    /// the target has.
    async fn second_checkpoint_moves_only_the_change(&self) -> Result<()> {
        let sb = self.sb;
        let Self {
            a,
            b,
            store,
            clock,
            gnu,
            ..
        } = self;
        // One file changed, one added, one removed.
        sh(
            sb,
            &format!(
                "set -e; cd {}; echo more >> src/deep/f7.txt; echo new > added.txt; rm doomed.txt",
                shell_quote(a)
            ),
        )
        .await?;
        let second = tc::checkpoint_tree(sb, a, store, "trees/2", Some("trees/1"), clock, None)
            .await
            .context("second tree checkpoint")?;
        ensure!(
            second.deleted == 1,
            "one path deleted, got {}",
            second.deleted
        );
        if *gnu {
            // f7 and added.txt, plus the files the racy rule re-reads (those
            // written in the second the first listing ran: at most all).
            ensure!(
                second.files_read >= 2,
                "the changed and the added file are read, got {}",
                second.files_read
            );
            ensure!(
                second.chunks_uploaded == 2,
                "only the two new contents are uploaded, got {}",
                second.chunks_uploaded
            );
        }
        let onto_first = tc::restore_tree(store, "trees/2", sb, b, None)
            .await
            .context("restoring the second checkpoint onto the first")?;
        let want = manifest(sb, a).await?;
        let got = manifest(sb, b).await?;
        // One `F` line per file (its content may have a line of its own).
        let user: Vec<&String> = got
            .iter()
            .filter(|l| l.starts_with("F ") && l.contains("user.txt"))
            .collect();
        ensure!(user.len() == 1, "a file only the target has stays: {got:?}");
        let got: Vec<String> = got
            .into_iter()
            .filter(|l| !l.contains("user.txt"))
            .filter(|l| *gnu || !l.contains("doomed.txt"))
            .collect();
        ensure!(
            got == want,
            "restoring onto the parent's state must give the new tree.\nsource:\n{}\nrestored:\n{}",
            want.join("\n"),
            got.join("\n")
        );
        if *gnu {
            ensure!(
                onto_first.removed == 1,
                "the deleted file is removed, got {}",
                onto_first.removed
            );
            ensure!(
                onto_first.written <= 4,
                "only what changed is written onto the parent's state (f7, added.txt, and \
                 at most their directories), wrote {}",
                onto_first.written
            );
        }
        Ok(())
    }

    /// A checkpoint whose blob is missing is refused before anything is
    /// written.
    async fn a_missing_blob_restores_nothing(&self) -> Result<()> {
        let sb = self.sb;
        let Self {
            a, c, store, clock, ..
        } = self;
        // A missing blob: refused before anything is written.
        sh(sb, &format!("echo lone > {}/lone.txt", shell_quote(a))).await?;
        tc::checkpoint_tree(sb, a, store, "trees/3", Some("trees/2"), clock, None).await?;
        let lone = tc::blob_key(&hex::encode(Sha256::digest(b"lone\n")));
        store.delete(&lone).await?;
        let missing = tc::restore_tree(store, "trees/3", sb, c, None).await;
        ensure!(
            is_kind(&missing, ErrorKind::NotFound),
            "a checkpoint whose blob is gone must fail NotFound, got {:?}",
            missing.map(|_| ())
        );
        let untouched = run(
            sb,
            ExecRequest::shell(format!("test -e {}", shell_quote(c))),
        )
        .await?;
        ensure!(
            !untouched.status.success(),
            "a refused restore must write nothing (the target dir appeared)"
        );
        Ok(())
    }

    /// Garbage collection removes exactly the blobs no manifest
    /// references, and refuses to run during a checkpoint (unless its lock
    /// is past its TTL).
    async fn collection_keeps_what_manifests_reference(&self) -> Result<()> {
        let sb = self.sb;
        let Self {
            c, store, clock, ..
        } = self;
        // Garbage: with trees/1 and trees/3 gone, the old content of f7 and
        // doomed.txt's are referenced by no manifest.
        store.delete("trees/3").await?;
        store.delete("trees/1").await?;
        let before = store.list(BLOB_PREFIX).await?.len() as u64;
        let gc = tc::collect_garbage(store, clock).await?;
        ensure!(
            gc.manifests == 1 && gc.blobs_deleted == 2 && gc.blobs_kept + 2 == before,
            "collection keeps what trees/2 references and drops f7's old content and \
             doomed.txt's: {gc:?} of {before}"
        );
        tc::restore_tree(store, "trees/2", sb, c, None)
            .await
            .context("trees/2 must restore after collection")?;
        // A checkpoint in progress (its lock) stops a collection.
        store
            .put(
                &format!("locks/checkpoint-{}-x", clock.now_ms()),
                harness_core::stream::empty(),
            )
            .await?;
        let busy = tc::collect_garbage(store, clock).await;
        ensure!(
            is_kind(&busy, ErrorKind::Conflict),
            "collection during a checkpoint must fail Conflict, got {:?}",
            busy.map(|_| ())
        );
        // ... unless that lock is a crashed holder's, past its TTL.
        clock.advance(tc::LOCK_TTL_MS + 1);
        tc::collect_garbage(store, clock)
            .await
            .context("a stale lock must not stop collection")?;
        Ok(())
    }
}

/// A tar with an entry whose raw name is `name`.
fn raw_tar(name: &str, content: &[u8]) -> Vec<u8> {
    let mut header = tar::Header::new_gnu();
    {
        let old = header.as_old_mut();
        old.name[..name.len()].copy_from_slice(name.as_bytes());
    }
    header.set_size(content.len() as u64);
    header.set_mode(0o644);
    header.set_entry_type(tar::EntryType::Regular);
    header.set_cksum();
    let mut out = header.as_bytes().to_vec();
    out.extend_from_slice(content);
    out.resize(out.len().div_ceil(512) * 512, 0);
    out.extend_from_slice(&[0u8; 1024]);
    out
}

/// import_tar refuses entries that would land outside the target
/// (`../x`), with an error, and writes nothing there.
pub async fn import_refuses_escaping_entries(sb: &dyn Sandbox) -> Result<()> {
    let base = scratch("escape");
    let target = format!("{base}/target");
    sh(sb, &format!("mkdir -p {}", shell_quote(&target))).await?;
    let result = sb
        .import_tar(
            &target,
            harness_core::stream::once(raw_tar("../escaped.txt", b"escaped")),
        )
        .await;
    ensure!(
        result.is_err(),
        "import_tar must refuse an entry named ../escaped.txt"
    );
    let leaked = read_file(sb, &format!("{base}/escaped.txt")).await;
    ensure!(
        is_kind(&leaked, ErrorKind::NotFound),
        "a refused ../ entry must not be written outside the target (found {base}/escaped.txt)"
    );
    sh(sb, &format!("rm -rf {}", shell_quote(&base))).await?;
    Ok(())
}

/// The large-file rule: write `bytes` generated on the fly (never buffered
/// whole) and read them back, comparing SHA-256 digests computed as the
/// bytes flow. Deletes the file afterwards.
pub async fn large_file_round_trip(
    sb: &dyn Sandbox,
    path: &str,
    bytes: u64,
) -> Result<LargeFileReport> {
    const CHUNK: usize = 1024 * 1024;
    let hasher = Arc::new(std::sync::Mutex::new(Sha256::new()));
    let h = hasher.clone();
    let source = generated_stream(bytes, CHUNK, 0x5eed)
        .map(move |chunk| {
            if let Ok(c) = &chunk {
                h.lock().expect("hasher lock").update(c);
            }
            chunk
        })
        .boxed();
    let started = Instant::now();
    let written = within(
        Duration::from_secs(600),
        "writing the large file",
        sb.write_file(path, source),
    )
    .await?
    .context("write_file of the large file")?;
    let write_secs = started.elapsed().as_secs_f64();
    let sent = hex::encode(std::mem::take(&mut *hasher.lock().expect("hasher lock")).finalize());
    ensure!(
        written == bytes,
        "write_file reported {written} bytes, sent {bytes}"
    );

    let started = Instant::now();
    let mut stream = sb
        .read_file(path)
        .await
        .context("read_file of the large file")?;
    let mut got = Sha256::new();
    let mut read = 0u64;
    let reading = async {
        while let Some(chunk) = stream.next().await {
            let chunk = chunk?;
            read += chunk.len() as u64;
            got.update(&chunk);
        }
        Ok::<_, Error>(())
    };
    within(Duration::from_secs(600), "reading the large file", reading).await??;
    let read_secs = started.elapsed().as_secs_f64();
    let got = hex::encode(got.finalize());
    ensure!(
        read == bytes,
        "read back {read} bytes of a {bytes}-byte file"
    );
    ensure!(
        got == sent,
        "the large file's SHA-256 changed in the round trip: wrote {sent}, read {got}"
    );
    sh(sb, &format!("rm -f {}", shell_quote(path))).await?;
    Ok(LargeFileReport {
        bytes,
        sha256: sent,
        write_secs,
        read_secs,
    })
}

// ---------------------------------------------------------------------------
// detached processes

/// spawn_detached runs in the background with output spooled to files;
/// detached_status goes Running → Exited{code}; kill_detached kills the
/// process group and is idempotent.
pub async fn detached_processes(sb: &dyn Sandbox) -> Result<()> {
    let spool = format!("/tmp/harness-suite-spool-{}", uuid_like());
    let pidfile = format!("{spool}/pids");
    let process = sb
        .spawn_detached(DetachedRequest {
            argv: vec![
                "sh".into(),
                "-c".into(),
                "echo started; echo to-err >&2; echo \"$SUITE_DETACHED\"; sleep 2; echo done; exit 7".into(),
            ],
            cwd: None,
            env: BTreeMap::from([("SUITE_DETACHED".to_string(), "env-ok".to_string())]),
            spool_dir: format!("{spool}/one"),
        })
        .await
        .context("spawn_detached")?;
    let status = sb
        .detached_status(&process)
        .await
        .context("detached_status")?;
    ensure!(
        status == DetachedStatus::Running,
        "a detached `sleep 2` must be Running right after spawn, got {status:?}"
    );
    // Polled as a slice does: the status, then what is new since the last
    // read. "Exited" with nothing new means the whole output was read.
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut polled = Vec::new();
    let final_status = loop {
        let (s, new) = sb
            .poll_detached(&process, polled.len() as u64)
            .await
            .context("poll_detached")?;
        let new = harness_core::stream::collect(new, 1 << 20).await?;
        polled.extend_from_slice(&new);
        if (s != DetachedStatus::Running && new.is_empty()) || Instant::now() > deadline {
            break s;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    ensure!(
        final_status == DetachedStatus::Exited { code: 7 },
        "a detached process that ran `exit 7` must end as Exited {{ code: 7 }}, got {final_status:?}"
    );
    ensure!(
        polled == b"started\nenv-ok\ndone\n",
        "polling the process from each read's end must read its whole stdout once, got {:?}",
        String::from_utf8_lossy(&polled)
    );
    let (s, tail) = sb.poll_detached(&process, 8).await?;
    let tail = harness_core::stream::collect(tail, 1 << 20).await?;
    ensure!(
        s == final_status && tail[..] == b"env-ok\ndone\n"[..],
        "a poll from byte 8 must give the exit and the stdout after it, got {s:?} and {:?}",
        String::from_utf8_lossy(&tail)
    );
    let stdout = read_file(sb, &process.stdout_path)
        .await
        .context("stdout spool")?;
    ensure!(
        stdout == b"started\nenv-ok\ndone\n",
        "the stdout spool must hold the process's stdout, got {:?}",
        String::from_utf8_lossy(&stdout)
    );
    let stderr = read_file(sb, &process.stderr_path)
        .await
        .context("stderr spool")?;
    ensure!(
        stderr == b"to-err\n",
        "the stderr spool must hold the process's stderr, got {:?}",
        String::from_utf8_lossy(&stderr)
    );
    sh(sb, &format!("rm {}", shell_quote(&process.stdout_path))).await?;
    let gone = match sb.poll_detached(&process, 0).await {
        Ok((_, stream)) => harness_core::stream::collect(stream, 1 << 20).await.err(),
        Err(e) => Some(e),
    };
    ensure!(
        gone.as_ref().map(|e| e.kind()) == Some(ErrorKind::NotFound),
        "polling a process whose stdout file is gone must be NotFound, got {gone:?}"
    );

    // A tree that must die with kill_detached.
    let process = sb
        .spawn_detached(DetachedRequest {
            argv: vec![
                "sh".into(),
                "-c".into(),
                format!(
                    "echo $$ > {f}.tmp; sleep 100 & echo $! >> {f}.tmp; mv {f}.tmp {f}; sleep 100",
                    f = shell_quote(&pidfile)
                ),
            ],
            cwd: None,
            env: BTreeMap::new(),
            spool_dir: format!("{spool}/two"),
        })
        .await
        .context("spawn_detached")?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while read_file(sb, &pidfile).await.is_err() {
        ensure!(
            Instant::now() < deadline,
            "the detached process never started (no pidfile after 10 s)"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    sb.kill_detached(&process).await.context("kill_detached")?;
    assert_pids_gone(sb, &pidfile, "after kill_detached").await?;
    let status = sb.detached_status(&process).await?;
    ensure!(
        status != DetachedStatus::Running,
        "a killed detached process must not be Running, got {status:?}"
    );
    sb.kill_detached(&process)
        .await
        .context("kill_detached must be idempotent")?;
    sh(sb, &format!("rm -rf {}", shell_quote(&spool))).await?;
    Ok(())
}

/// A launch is idempotent per spool directory: the caller killed after the
/// launch started launches again and gets the process already running, not
/// a second one (the turn driver relies on it to start an agent once).
pub async fn a_second_launch_in_one_spool_returns_the_first(sb: &dyn Sandbox) -> Result<()> {
    let spool = format!("/tmp/harness-suite-spool-{}", uuid_like());
    let counter = format!("{spool}-count");
    let request = DetachedRequest {
        argv: vec![
            "sh".into(),
            "-c".into(),
            format!("echo run >> {}; sleep 30", shell_quote(&counter)),
        ],
        cwd: None,
        env: BTreeMap::new(),
        spool_dir: spool.clone(),
    };
    let first = sb
        .spawn_detached(request.clone())
        .await
        .context("first launch")?;
    let second = sb
        .spawn_detached(request)
        .await
        .context("second launch into the same spool")?;
    let result = async {
        ensure!(
            first == second,
            "a second launch into one spool must return the first process: {first:?} vs {second:?}"
        );
        let deadline = Instant::now() + Duration::from_secs(10);
        while read_file(sb, &counter).await.is_err() {
            ensure!(Instant::now() < deadline, "the detached process never ran");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // Time for a second process, were there one, to have written too.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let runs = read_file(sb, &counter).await?;
        ensure!(
            runs == b"run\n",
            "one process must have run, the counter holds {:?}",
            String::from_utf8_lossy(&runs)
        );
        Ok(())
    }
    .await;
    let _ = sb.kill_detached(&first).await;
    let _ = sh(
        sb,
        &format!("rm -rf {} {}", shell_quote(&spool), shell_quote(&counter)),
    )
    .await;
    result
}

// ---------------------------------------------------------------------------
// lifecycle

/// `SandboxSpec::slot`: a second create with the session and slot of a
/// sandbox whose handle was never recorded replaces it (the creator was
/// killed in between), so a retried create leaves one sandbox, not two.
/// Without a slot every create is a new sandbox.
pub async fn a_slot_replaces_its_leftover(
    provider: &dyn SandboxProvider,
    spec: &SandboxSpec,
) -> Result<()> {
    let mut slotted = spec.clone();
    slotted.session_id = Some(format!("suite-{}", &uuid_like()[..8]));
    slotted.slot = Some("t1".into());
    let leftover = provider.create(&slotted).await.context("first create")?;
    leftover
        .write_file("suite-leftover.txt", harness_core::stream::once("old"))
        .await?;
    let leftover_handle = leftover.detach().await?;
    drop(leftover);
    let again = provider
        .create(&slotted)
        .await
        .context("create again in the slot")?;
    let result = async {
        let out = sh(
            again.as_ref(),
            "test -e suite-leftover.txt && echo kept || echo fresh",
        )
        .await?;
        ensure!(
            out.trim() == "fresh",
            "a create in an occupied slot must start a fresh sandbox, the leftover's file is there"
        );
        // The leftover is gone: its handle resumes nothing, or resumes the
        // replacement (a provider whose ids are the slot's name).
        if let Ok(old) = provider.resume(&leftover_handle).await {
            let out = sh(
                old.as_ref(),
                "test -e suite-leftover.txt && echo kept || echo gone",
            )
            .await;
            ensure!(
                !matches!(out.as_deref().map(str::trim), Ok("kept")),
                "the leftover sandbox must be replaced, its handle still reaches its files"
            );
        }
        let mut plain = spec.clone();
        plain.session_id = slotted.session_id.clone();
        let a = provider
            .create(&plain)
            .await
            .context("create without a slot")?;
        let b = provider
            .create(&plain)
            .await
            .context("create without a slot")?;
        let distinct = a.handle().id != b.handle().id && a.handle().id != again.handle().id;
        let _ = a.destroy().await;
        let _ = b.destroy().await;
        ensure!(
            distinct,
            "creates without a slot must make distinct sandboxes"
        );
        Ok(())
    }
    .await;
    let _ = again.destroy().await;
    result
}

/// detach → handle JSON → resume (as another process would) sees the same
/// files and runs commands.
pub async fn detach_and_resume(provider: &dyn SandboxProvider, spec: &SandboxSpec) -> Result<()> {
    let sandbox = provider.create(spec).await.context("create")?;
    let marker = uuid_like();
    sandbox
        .write_file(
            "suite-resume.txt",
            harness_core::stream::once(marker.clone()),
        )
        .await?;
    let handle = sandbox.detach().await.context("detach")?;
    drop(sandbox);
    let json = serde_json::to_string(&handle)?;
    let parsed: SandboxHandle = serde_json::from_str(&json)?;
    ensure!(
        parsed == handle,
        "the handle must survive a JSON round trip"
    );
    ensure!(
        handle.provider == provider.name(),
        "the handle must name its provider {:?}, got {:?}",
        provider.name(),
        handle.provider
    );
    let resumed = provider
        .resume(&parsed)
        .await
        .context("resume from the detached handle")?;
    let result = async {
        let back = read_file(resumed.as_ref(), "suite-resume.txt").await?;
        ensure!(
            back == marker.as_bytes(),
            "a resumed sandbox must see the files written before detach"
        );
        ensure!(
            resumed.handle().id == handle.id,
            "resume must reattach to the same sandbox (id {:?}, got {:?})",
            handle.id,
            resumed.handle().id
        );
        let out = sh(resumed.as_ref(), "cat suite-resume.txt").await?;
        ensure!(
            out == marker,
            "exec in the resumed sandbox must see the file"
        );
        Ok(())
    }
    .await;
    resumed.destroy().await.context("destroy")?;
    result
}

/// destroy is idempotent; resuming a destroyed sandbox fails with NotFound.
pub async fn destroy_is_idempotent(
    provider: &dyn SandboxProvider,
    spec: &SandboxSpec,
) -> Result<()> {
    let sandbox = provider.create(spec).await.context("create")?;
    sandbox
        .write_file("suite-destroy.txt", harness_core::stream::once("x"))
        .await?;
    let handle = sandbox.handle();
    sandbox.destroy().await.context("first destroy")?;
    sandbox
        .destroy()
        .await
        .context("a second destroy must succeed too (destroy is idempotent)")?;
    let resumed = provider.resume(&handle).await;
    ensure!(
        is_kind(&resumed, ErrorKind::NotFound),
        "resume after destroy must fail with NotFound, got {}",
        match &resumed {
            Ok(_) => "a sandbox".to_string(),
            Err(e) => e.to_string(),
        }
    );
    Ok(())
}

/// A free TCP port on this machine (the kernel's choice; released again).
async fn free_port() -> Result<u16> {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    Ok(l.local_addr()?.port())
}

/// A server started in the sandbox on a spec port is reachable at
/// `port_endpoint`; an unlisted port is `NotFound`. Optional.
pub async fn port_endpoint(
    provider: &dyn SandboxProvider,
    spec: &SandboxSpec,
) -> Result<Capability> {
    let mut spec = spec.clone();
    if spec.ports.is_empty() {
        spec.ports.push(free_port().await?);
    }
    let port = spec.ports[0];
    let sandbox = provider.create(&spec).await.context("create with a port")?;
    let result = async {
        let endpoint = match sandbox.port_endpoint(port).await {
            Err(e) if e.kind() == ErrorKind::Unsupported => {
                return Ok(Capability::Unsupported(e.to_string()))
            }
            other => other.context("port_endpoint of a spec port")?,
        };
        ensure!(endpoint.sandbox_port == port, "endpoint names sandbox port {}, asked {port}", endpoint.sandbox_port);
        let unlisted = sandbox.port_endpoint(if port == 65535 { 65534 } else { port + 1 }).await;
        ensure!(
            is_kind(&unlisted, ErrorKind::NotFound),
            "port_endpoint of a port not in the spec must be NotFound, got {unlisted:?}"
        );
        let server = format!(
            "if command -v python3 >/dev/null 2>&1; then exec python3 -c '
import socket
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((\"0.0.0.0\", {port}))
s.listen(8)
while True:
    c, _ = s.accept()
    c.sendall(b\"suite-port-ok\\n\")
    c.close()
'; elif command -v nc >/dev/null 2>&1; then while true; do echo suite-port-ok | nc -l -p {port} || nc -l {port} < /dev/null; done; \
             else echo 'the sandbox has neither python3 nor nc to run a test server' >&2; exit 97; fi"
        );
        let spool = format!("/tmp/harness-suite-port-{}", uuid_like());
        let process = sandbox
            .spawn_detached(DetachedRequest {
                argv: vec!["sh".into(), "-c".into(), server],
                cwd: None,
                env: BTreeMap::new(),
                spool_dir: spool.clone(),
            })
            .await
            .context("starting a test server in the sandbox")?;
        let addr = format!("{}:{}", endpoint.host, endpoint.port);
        let deadline = Instant::now() + Duration::from_secs(20);
        let reply = loop {
            let attempt = async {
                let mut conn = tokio::net::TcpStream::connect(&addr).await?;
                let mut buf = Vec::new();
                tokio::io::AsyncReadExt::read_to_end(&mut conn, &mut buf).await?;
                Ok::<_, std::io::Error>(buf)
            };
            match tokio::time::timeout(Duration::from_secs(3), attempt).await {
                Ok(Ok(buf)) if buf.starts_with(b"suite-port-ok") => break Ok(()),
                other => {
                    if Instant::now() > deadline {
                        let status = sandbox.detached_status(&process).await.ok();
                        let err = read_file(sandbox.as_ref(), &process.stderr_path).await.unwrap_or_default();
                        break Err(anyhow!(
                            "a server on sandbox port {port} was not reachable at {addr} within 20 s \
                             (last attempt: {other:?}; server status {status:?}, stderr {:?})",
                            String::from_utf8_lossy(&err)
                        ));
                    }
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
            }
        };
        let _ = sandbox.kill_detached(&process).await;
        let _ = sh(sandbox.as_ref(), &format!("rm -rf {}", shell_quote(&spool))).await;
        reply?;
        Ok(Capability::Supported)
    }
    .await;
    sandbox.destroy().await.context("destroy")?;
    result
}

/// stop keeps the state; resume starts it again. Optional.
pub async fn stop_and_resume(
    provider: &dyn SandboxProvider,
    spec: &SandboxSpec,
) -> Result<Capability> {
    let sandbox = provider.create(spec).await.context("create")?;
    let marker = uuid_like();
    sandbox
        .write_file("suite-stop.txt", harness_core::stream::once(marker.clone()))
        .await?;
    let handle = match sandbox.stop().await {
        Err(e) if e.kind() == ErrorKind::Unsupported => {
            sandbox.destroy().await?;
            return Ok(Capability::Unsupported(e.to_string()));
        }
        Err(e) => {
            let _ = sandbox.destroy().await;
            return Err(anyhow::Error::new(e).context("stop"));
        }
        Ok(h) => h,
    };
    let handle: SandboxHandle = serde_json::from_str(&serde_json::to_string(&handle)?)?;
    let resumed = match provider.resume(&handle).await {
        Ok(r) => r,
        Err(e) => {
            let _ = sandbox.destroy().await;
            return Err(anyhow::Error::new(e).context("resume after stop"));
        }
    };
    let result = async {
        let back = sh(resumed.as_ref(), "cat suite-stop.txt").await?;
        ensure!(back == marker, "files must survive stop + resume");
        Ok(Capability::Supported)
    }
    .await;
    resumed.destroy().await?;
    result
}

/// Try to open a TCP connection from inside the sandbox; true if it
/// connected.
async fn probe_connect(sb: &dyn Sandbox, addr: SocketAddr) -> Result<bool> {
    let (host, port) = (addr.ip().to_string(), addr.port());
    let script = format!(
        "if command -v bash >/dev/null 2>&1; then timeout 5 bash -c 'exec 3<>/dev/tcp/{host}/{port}'; \
         elif command -v python3 >/dev/null 2>&1; then timeout 5 python3 -c 'import socket; socket.create_connection((\"{host}\", {port}), 4)'; \
         elif command -v nc >/dev/null 2>&1; then timeout 5 nc -z -w 4 {host} {port}; \
         else echo 'no bash, python3 or nc in the sandbox to probe the network' >&2; exit 97; fi \
         && echo connected || echo failed"
    );
    let out = run(sb, ExecRequest::shell(script)).await?;
    ensure!(
        out.status.success(),
        "network probe failed to run ({:?}): {}",
        out.status,
        out.stderr_str().trim()
    );
    match out.stdout_str().trim() {
        "connected" => Ok(true),
        "failed" => Ok(false),
        other => bail!("network probe printed {other:?}"),
    }
}

/// Deny-all: a sandbox created with `NetworkPolicy::DenyAll` cannot connect
/// to a server on this machine that an allow-all sandbox reaches. A
/// provider may refuse deny-all with `Unsupported` (accepted).
pub async fn network_deny_all(
    provider: &dyn SandboxProvider,
    spec: &SandboxSpec,
    options: &SuiteOptions,
) -> Result<Capability> {
    let bind = options
        .host_address
        .unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST));
    let listener = tokio::net::TcpListener::bind(SocketAddr::new(bind, 0))
        .await
        .with_context(|| format!("binding a host test server on {bind}"))?;
    let addr = listener.local_addr()?;
    let accepted = Arc::new(AtomicU64::new(0));
    let counter = accepted.clone();
    let server = tokio::spawn(async move {
        while let Ok((conn, _)) = listener.accept().await {
            counter.fetch_add(1, Ordering::SeqCst);
            drop(conn);
        }
    });
    let result = async {
        let mut deny = spec.clone();
        deny.network = NetworkPolicy::DenyAll;
        let capability = match provider.create(&deny).await {
            Err(e) if e.kind() == ErrorKind::Unsupported => Capability::Unsupported(e.to_string()),
            Err(e) => return Err(anyhow::Error::new(e).context("create with DenyAll")),
            Ok(sandbox) => {
                let probe = probe_connect(sandbox.as_ref(), addr).await;
                sandbox.destroy().await?;
                ensure!(
                    !probe?,
                    "a deny-all sandbox connected to {addr} on this machine: the policy is not enforced"
                );
                ensure!(
                    accepted.load(Ordering::SeqCst) == 0,
                    "the host test server accepted a connection from a deny-all sandbox"
                );
                Capability::Supported
            }
        };
        if options.host_address.is_some() {
            // The control: the same probe from allow-all must connect, or the
            // deny-all result above proves nothing.
            let mut allow = spec.clone();
            allow.network = NetworkPolicy::AllowAll;
            let sandbox = provider.create(&allow).await.context("create with AllowAll")?;
            let probe = probe_connect(sandbox.as_ref(), addr).await;
            sandbox.destroy().await?;
            ensure!(
                probe?,
                "an allow-all sandbox could not connect to the host test server at {addr} \
                 (set SuiteOptions::host_address to an address the sandbox reaches)"
            );
            ensure!(
                accepted.load(Ordering::SeqCst) >= 1,
                "the probe claimed a connection the host test server never accepted"
            );
        }
        Ok(capability)
    }
    .await;
    server.abort();
    result
}

// ---------------------------------------------------------------------------
// host forwards

/// An HTTP server on a Unix socket, alone in a fresh directory under the
/// temp dir (a provider may mount the whole directory), answering every
/// request with `body`. Stops and removes its directory when dropped.
#[derive(Debug)]
pub struct SocketServer {
    dir: std::path::PathBuf,
    socket: std::path::PathBuf,
    hits: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl SocketServer {
    /// Serve `body` on a new socket.
    pub async fn start(body: &str) -> Result<Self> {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("harness-suite-fwd-{}", uuid_like()));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755))?;
        let socket = dir.join("suite.sock");
        let listener = tokio::net::UnixListener::bind(&socket)
            .with_context(|| format!("binding {}", socket.display()))?;
        // Any user inside the sandbox may connect (containers may run as
        // someone else than the test).
        std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o777))?;
        let hits = Arc::new(AtomicU64::new(0));
        let counter = hits.clone();
        let body = body.to_string();
        let task = tokio::spawn(async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            while let Ok((mut conn, _)) = listener.accept().await {
                counter.fetch_add(1, Ordering::SeqCst);
                let body = body.clone();
                tokio::spawn(async move {
                    let mut head = Vec::new();
                    let mut buf = [0u8; 1024];
                    let read_head = async {
                        while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 16384 {
                            match conn.read(&mut buf).await {
                                Ok(0) | Err(_) => break,
                                Ok(n) => head.extend_from_slice(&buf[..n]),
                            }
                        }
                    };
                    let _ = tokio::time::timeout(Duration::from_secs(10), read_head).await;
                    let reply = format!(
                        "HTTP/1.0 200 OK\r\ncontent-type: text/plain\r\ncontent-length: {}\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = conn.write_all(reply.as_bytes()).await;
                    let _ = conn.shutdown().await;
                });
            }
        });
        Ok(Self {
            dir,
            socket,
            hits,
            task,
        })
    }

    /// The socket's host path.
    pub fn socket(&self) -> &std::path::Path {
        &self.socket
    }

    /// A forward of `port` to this server.
    pub fn forward(&self, port: u16) -> HostForward {
        HostForward {
            port,
            socket: self.socket.to_string_lossy().into_owned(),
        }
    }

    /// Connections accepted so far.
    pub fn hits(&self) -> u64 {
        self.hits.load(Ordering::SeqCst)
    }
}

impl Drop for SocketServer {
    fn drop(&mut self) {
        self.task.abort();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A shell script that sends one HTTP request to `127.0.0.1:port` and
/// prints the whole response (or nothing, when nothing answers); exit 97
/// when the sandbox has no program to do it with.
fn http_get_script(port: u16) -> String {
    format!(
        "if command -v bash >/dev/null 2>&1; then \
           timeout 10 bash -c 'exec 3<>/dev/tcp/127.0.0.1/{port} && printf \"GET / HTTP/1.0\\r\\n\\r\\n\" >&3 && cat <&3'; \
         elif command -v python3 >/dev/null 2>&1; then \
           timeout 10 python3 -c 'import socket,sys; s=socket.create_connection((\"127.0.0.1\", {port}), 8); s.sendall(b\"GET / HTTP/1.0\\r\\n\\r\\n\"); sys.stdout.write(s.makefile(\"rb\").read().decode())'; \
         else echo 'no bash or python3 in the sandbox to reach a forward' >&2; exit 97; fi; exit 0"
    )
}

/// GET through the forward on `port` from inside `sb`; the response.
async fn get_through_forward(sb: &dyn Sandbox, port: u16) -> Result<String> {
    let out = run(sb, ExecRequest::shell(http_get_script(port))).await?;
    ensure!(
        out.status.success(),
        "the forward probe failed to run ({:?}): {}",
        out.status,
        out.stderr_str().trim()
    );
    Ok(out.stdout_str())
}

/// The forward on `port` answers `nonce` from an exec, from a detached
/// process that connects after the exec that launched it has ended, and
/// from the same sandbox resumed from its JSON handle.
async fn check_forward(
    provider: &dyn SandboxProvider,
    sandbox: &dyn Sandbox,
    port: u16,
    nonce: &str,
    what: &str,
) -> Result<()> {
    let reply = get_through_forward(sandbox, port).await?;
    ensure!(
        reply.ends_with(nonce),
        "{what}: 127.0.0.1:{port} inside must reach the host socket (the reply must end with the \
         nonce {nonce:?}), got {reply:?}"
    );

    // A detached process (an agent) still reaches it after its launch
    // returned.
    let spool = format!("/tmp/harness-suite-fwd-{}", uuid_like());
    let process = sandbox
        .spawn_detached(DetachedRequest {
            argv: vec![
                "sh".into(),
                "-c".into(),
                format!("sleep 1.5; {}", http_get_script(port)),
            ],
            cwd: None,
            env: BTreeMap::new(),
            spool_dir: spool.clone(),
        })
        .await
        .with_context(|| format!("{what}: spawn_detached"))?;
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        let status = sandbox.detached_status(&process).await?;
        if status != DetachedStatus::Running || Instant::now() > deadline {
            break status;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let out = read_file(sandbox, &process.stdout_path)
        .await
        .unwrap_or_default();
    let err = read_file(sandbox, &process.stderr_path)
        .await
        .unwrap_or_default();
    let _ = sandbox.kill_detached(&process).await;
    let _ = sh(sandbox, &format!("rm -rf {}", shell_quote(&spool))).await;
    ensure!(
        status == DetachedStatus::Exited { code: 0 },
        "{what}: the detached forward probe must exit 0, got {status:?} (stderr {:?})",
        String::from_utf8_lossy(&err)
    );
    ensure!(
        out.ends_with(nonce.as_bytes()),
        "{what}: a detached process must reach the forward after its launch returned, got {:?}",
        String::from_utf8_lossy(&out)
    );

    // Resumed from JSON (as another process would), the forward holds.
    let handle: SandboxHandle = serde_json::from_str(&serde_json::to_string(&sandbox.handle())?)?;
    let resumed = provider
        .resume(&handle)
        .await
        .with_context(|| format!("{what}: resume"))?;
    let reply = get_through_forward(resumed.as_ref(), port).await?;
    ensure!(
        reply.ends_with(nonce),
        "{what}: after resume, 127.0.0.1:{port} must still reach the host socket, got {reply:?}"
    );
    Ok(())
}

/// Host forwards: with `forwards = [MODEL_BROKER_PORT → a Unix socket the
/// suite serves]`, a command inside reaches that socket at
/// `127.0.0.1:MODEL_BROKER_PORT`, under deny-all and under allow-all. A
/// provider whose allow-all commands share the host's network
/// ([`SandboxProvider::shares_host_network`]) must refuse forwards there
/// with `Unsupported`. Optional: a provider may refuse forwards with
/// `Unsupported` (then the whole item is `Unsupported`).
pub async fn host_forward(
    provider: &dyn SandboxProvider,
    spec: &SandboxSpec,
) -> Result<Capability> {
    let nonce = format!("suite-forward-{}", uuid_like());
    let server = SocketServer::start(&nonce).await?;
    let mut capability = Capability::Supported;
    for policy in [NetworkPolicy::DenyAll, NetworkPolicy::AllowAll] {
        let mut with = spec.clone();
        with.network = policy.clone();
        with.forwards = vec![server.forward(MODEL_BROKER_PORT)];
        let shares = provider.shares_host_network(&policy);
        let sandbox = match provider.create(&with).await {
            Err(e) if e.kind() == ErrorKind::Unsupported => {
                if !shares {
                    capability = Capability::Unsupported(e.to_string());
                }
                continue;
            }
            Err(e) => {
                return Err(anyhow::Error::new(e)
                    .context(format!("create with a forward under {policy:?}")))
            }
            Ok(sandbox) => sandbox,
        };
        if shares {
            let _ = sandbox.destroy().await;
            bail!(
                "the provider shares the host network under {policy:?} yet accepted a forward: \
                 it must refuse forwards there with Unsupported"
            );
        }
        let result = check_forward(
            provider,
            sandbox.as_ref(),
            MODEL_BROKER_PORT,
            &nonce,
            &format!("{policy:?}"),
        )
        .await;
        sandbox.destroy().await?;
        result?;
    }
    if capability == Capability::Supported {
        ensure!(
            server.hits() >= 3,
            "the host socket saw {} connections, expected at least 3 per policy",
            server.hits()
        );
    }
    Ok(capability)
}

/// Custom network policy: enforced as no route out plus the egress proxy
/// forward on [`EGRESS_PROXY_PORT`], so a custom spec without that forward
/// must be refused (`InvalidInput` or `Unsupported`, naming the port). With
/// it, the sandbox cannot reach [`SuiteOptions::host_address`] directly,
/// and the forward answers. A provider may refuse custom policies
/// altogether with `Unsupported`.
pub async fn network_custom(
    provider: &dyn SandboxProvider,
    spec: &SandboxSpec,
    options: &SuiteOptions,
) -> Result<Capability> {
    let mut custom = spec.clone();
    custom.network = NetworkPolicy::Custom {
        allowed_hosts: vec!["example.invalid".into()],
        allowed_cidrs: vec![],
        denied_cidrs: vec![],
        allowed_ports: vec![],
    };
    custom.forwards.clear();
    match provider.create(&custom).await {
        Ok(sandbox) => {
            let _ = sandbox.destroy().await;
            bail!(
                "a custom policy without the egress proxy forward (port {EGRESS_PROXY_PORT}) was \
                 accepted: nothing would enforce its lists"
            );
        }
        // A provider with no network policy at all refuses `custom` whatever
        // the forwards (checked again with the forward below).
        Err(e)
            if e.kind() == ErrorKind::Unsupported
                && !e.message().contains(&EGRESS_PROXY_PORT.to_string()) =>
        {
            let mut with_forward = custom.clone();
            with_forward.forwards = vec![HostForward {
                port: EGRESS_PROXY_PORT,
                socket: "/nonexistent/harness-suite/proxy.sock".into(),
            }];
            match provider.create(&with_forward).await {
                Err(again) if again.kind() == ErrorKind::Unsupported => {
                    return Ok(Capability::Unsupported(e.to_string()))
                }
                Ok(sandbox) => {
                    let _ = sandbox.destroy().await;
                    bail!(
                        "a custom policy without the egress forward was refused as unsupported \
                         without naming port {EGRESS_PROXY_PORT}, but accepted with it: {e}"
                    );
                }
                Err(_) => bail!(
                    "refusing a custom policy without the egress forward must name port \
                     {EGRESS_PROXY_PORT}: {e}"
                ),
            }
        }
        Err(e) if e.kind() == ErrorKind::Unsupported || e.kind() == ErrorKind::InvalidInput => {
            ensure!(
                e.message().contains(&EGRESS_PROXY_PORT.to_string()),
                "refusing a custom policy without the egress forward must name port \
                 {EGRESS_PROXY_PORT}: {e}"
            );
        }
        Err(e) => bail!(
            "a custom policy without the egress forward must be refused as InvalidInput or \
             Unsupported, got {:?}: {e}",
            e.kind()
        ),
    }

    let bind = options
        .host_address
        .unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST));
    let listener = tokio::net::TcpListener::bind(SocketAddr::new(bind, 0))
        .await
        .with_context(|| format!("binding a host test server on {bind}"))?;
    let addr = listener.local_addr()?;
    let accepted = Arc::new(AtomicU64::new(0));
    let counter = accepted.clone();
    let direct = tokio::spawn(async move {
        while let Ok((conn, _)) = listener.accept().await {
            counter.fetch_add(1, Ordering::SeqCst);
            drop(conn);
        }
    });
    let nonce = format!("suite-egress-{}", uuid_like());
    let proxy = SocketServer::start(&nonce).await?;
    custom.forwards = vec![proxy.forward(EGRESS_PROXY_PORT)];
    let result = async {
        let sandbox = match provider.create(&custom).await {
            Err(e) if e.kind() == ErrorKind::Unsupported => {
                return Ok(Capability::Unsupported(e.to_string()))
            }
            Err(e) => return Err(anyhow::Error::new(e).context("create with a custom policy")),
            Ok(sandbox) => sandbox,
        };
        let checked = async {
            ensure!(
                !probe_connect(sandbox.as_ref(), addr).await?,
                "a custom-policy sandbox connected to {addr} directly: only the egress proxy may \
                 be reachable"
            );
            ensure!(
                accepted.load(Ordering::SeqCst) == 0,
                "the host test server accepted a connection from a custom-policy sandbox"
            );
            let reply = get_through_forward(sandbox.as_ref(), EGRESS_PROXY_PORT).await?;
            ensure!(
                reply.ends_with(&nonce),
                "the egress proxy forward on 127.0.0.1:{EGRESS_PROXY_PORT} must reach the host \
                 socket, got {reply:?}"
            );
            Ok(())
        }
        .await;
        sandbox.destroy().await?;
        checked.map(|()| Capability::Supported)
    }
    .await;
    direct.abort();
    result
}

// ---------------------------------------------------------------------------
// concurrency, large output, names

/// Several commands at once on one sandbox each get exactly their own
/// stdout, stderr and exit code, and really run at the same time: their
/// 2 s sleeps overlap. What one command takes alone is measured first, so
/// a slow guest (a VM emulated without KVM, where printing the lines takes
/// seconds of its one CPU) is held to the same rule as a fast one.
pub async fn concurrent_execs(sb: &dyn Sandbox) -> Result<()> {
    const N: usize = 6;
    const LINES: usize = 2000;
    let script = |i: usize| {
        format!(
            "sleep 2; n=0; while [ $n -lt {LINES} ]; do echo \"cmd-{i}-line-$n\"; n=$((n+1)); done; \
             echo err-{i} >&2; exit {}",
            10 + i
        )
    };
    let started = Instant::now();
    run(sb, ExecRequest::shell(script(N))).await?;
    let alone = started.elapsed();
    let started = Instant::now();
    let runs = (0..N).map(|i| {
        let script = script(i);
        async move { run(sb, ExecRequest::shell(script)).await.map(|o| (i, o)) }
    });
    let outs = futures::future::join_all(runs).await;
    let elapsed = started.elapsed();
    for out in outs {
        let (i, out) = out?;
        let want: String = (0..LINES).map(|n| format!("cmd-{i}-line-{n}\n")).collect();
        ensure!(
            out.stdout_str() == want,
            "command {i} of {N} running at once got other stdout ({} bytes, expected {}; \
             starts {:?})",
            out.stdout.len(),
            want.len(),
            out.stdout_str().chars().take(40).collect::<String>()
        );
        ensure!(
            out.stderr_str() == format!("err-{i}\n"),
            "command {i} got stderr {:?}",
            out.stderr_str()
        );
        ensure!(
            out.status.code == Some(10 + i as i32),
            "command {i} must exit {}, got {:?}",
            10 + i,
            out.status
        );
    }
    // One after another they take N times one alone; at once their
    // sleeps overlap, saving up to 2 s for each but the first: at least
    // one whole sleep of that must show. Not more: their printing competes
    // for the cores at once and, on a loaded machine, runs slower than the
    // lone command did (a microVM emulated without KVM during CI: 10.8 s at
    // once against 2.54 s alone, 15.2 s one after another).
    let serial = alone * N as u32;
    let bound = serial.saturating_sub(Duration::from_secs(2));
    ensure!(
        elapsed < bound,
        "{N} commands that each sleep 2 s took {elapsed:?} at once, one alone {alone:?}: \
         they ran one after another"
    );
    Ok(())
}

/// A command writing far more than any pipe holds (2 MiB to stderr first,
/// then 32 MiB to stdout) to a consumer that reads slowly at first: nothing
/// is lost, reordered or deadlocked, and the exit is clean.
pub async fn slow_reader_of_large_output(sb: &dyn Sandbox) -> Result<()> {
    const STDOUT: u64 = 32 * 1024 * 1024;
    const STDERR: usize = 2 * 1024 * 1024;
    const LINE: &[u8] = b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ\n";
    let script = format!(
        "head -c {STDERR} /dev/zero | tr '\\0' e >&2; \
         yes {} | head -c {STDOUT}; echo done >&2",
        std::str::from_utf8(&LINE[..LINE.len() - 1])?
    );
    let mut stream = sb.exec(ExecRequest::shell(script)).await.context("exec")?;
    let mut out_bytes = 0u64;
    let mut err = Vec::new();
    let mut exits = Vec::new();
    let mut events = 0u32;
    let drain = async {
        while let Some(event) = stream.next().await {
            events += 1;
            if events <= 40 {
                // A slow consumer: the command fills every buffer meanwhile.
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
            match event? {
                ExecEvent::Stdout(b) => {
                    for (k, byte) in b.iter().enumerate() {
                        let at = out_bytes + k as u64;
                        if *byte != LINE[(at % LINE.len() as u64) as usize] {
                            bail!("stdout differs at byte {at}: a chunk was lost or reordered");
                        }
                    }
                    out_bytes += b.len() as u64;
                }
                ExecEvent::Stderr(b) => err.extend_from_slice(&b),
                ExecEvent::Exit(s) => exits.push(s),
            }
        }
        Ok(())
    };
    within(
        Duration::from_secs(180),
        "reading 34 MiB of output slowly",
        drain,
    )
    .await??;
    ensure!(
        out_bytes == STDOUT,
        "read {out_bytes} bytes of stdout, the command wrote {STDOUT}"
    );
    ensure!(
        err.len() == STDERR + 5
            && err[..STDERR].iter().all(|&b| b == b'e')
            && err.ends_with(b"done\n"),
        "stderr must be {STDERR} bytes of 'e' then \"done\\n\", got {} bytes",
        err.len()
    );
    ensure!(
        exits.len() == 1 && exits[0].success(),
        "one successful Exit expected, got {exits:?}"
    );
    Ok(())
}

/// Unicode (and shell-hostile) file names: written, read (also from an
/// offset), seen by commands, and carried through export_tar/import_tar
/// byte for byte, including a name longer than a tar header holds.
pub async fn unicode_names(sb: &dyn Sandbox) -> Result<()> {
    let base = scratch("unicode");
    let long = "é".repeat(90);
    let names: Vec<String> = vec![
        "ünïcødé.txt".into(),
        "日本語/ファイル名.md".into(),
        "emoji 🦀 crab.rs".into(),
        "quote's \"and\" $dollar `tick` \\back.txt".into(),
        "ελληνικά/Ωμέγα".into(),
        format!("{long}/{long}.txt"),
    ];
    let src = format!("{base}/src");
    for name in &names {
        let path = format!("{src}/{name}");
        let content = format!("content of {name}");
        sb.write_file(&path, harness_core::stream::once(content.clone()))
            .await
            .with_context(|| format!("write_file {name:?}"))?;
        let back = read_file(sb, &path)
            .await
            .with_context(|| format!("read_file {name:?}"))?;
        ensure!(back == content.as_bytes(), "{name:?} read back {back:?}");
        let tail = read_all(sb.read_file_from(&path, 11).await?, "read_file_from").await?;
        ensure!(
            tail == content.as_bytes()[11..],
            "read_file_from(11) of {name:?} gave {:?}",
            String::from_utf8_lossy(&tail)
        );
        let cat = sh(sb, &format!("cat -- {}", shell_quote(&path))).await?;
        ensure!(cat == content, "cat of {name:?} printed {cat:?}");
    }
    let listed = sh(
        sb,
        &format!("cd {} && find . -type f | LC_ALL=C sort", shell_quote(&src)),
    )
    .await?;
    let mut want: Vec<String> = names.iter().map(|n| format!("./{n}")).collect();
    want.sort();
    ensure!(
        listed.lines().collect::<Vec<_>>() == want,
        "commands see the names {listed:?}, expected {want:?}"
    );
    let tar = read_all(sb.export_tar(&src).await?, "export_tar").await?;
    let mut archive = tar::Archive::new(tar.as_slice());
    let mut in_tar = Vec::new();
    for entry in archive.entries()? {
        let entry = entry?;
        in_tar.push(
            String::from_utf8(entry.path_bytes().into_owned())
                .context("export_tar wrote a name that is not the UTF-8 it was")?,
        );
    }
    for name in &names {
        ensure!(
            in_tar.iter().any(|n| n.trim_start_matches("./") == name),
            "export_tar lacks {name:?}: {in_tar:?}"
        );
    }
    let dst = format!("{base}/dst");
    sb.import_tar(&dst, harness_core::stream::once(tar))
        .await
        .context("import_tar of unicode names")?;
    for name in &names {
        let back = read_file(sb, &format!("{dst}/{name}")).await?;
        ensure!(
            back == format!("content of {name}").as_bytes(),
            "{name:?} after a tar round trip: {back:?}"
        );
    }
    sh(sb, &format!("rm -rf {}", shell_quote(&base))).await?;
    Ok(())
}

// ---------------------------------------------------------------------------
// hostile archives

/// One raw tar header (checksum set) for `path`, written without the tar
/// crate's own path checks: hostile names are the point.
fn raw_header(
    path: &str,
    kind: tar::EntryType,
    mode: u32,
    link: Option<&str>,
    size: u64,
) -> tar::Header {
    let mut h = tar::Header::new_gnu();
    h.as_old_mut().name[..path.len()].copy_from_slice(path.as_bytes());
    if let Some(link) = link {
        h.as_old_mut().linkname[..link.len()].copy_from_slice(link.as_bytes());
    }
    h.set_entry_type(kind);
    h.set_mode(mode);
    h.set_size(size);
    h.set_mtime(1_700_000_000);
    h.set_cksum();
    h
}

/// A header block followed by `data`, padded.
fn raw_entry(header: &tar::Header, data: &[u8]) -> Vec<u8> {
    let mut out = header.as_bytes().to_vec();
    out.extend_from_slice(data);
    out.resize(out.len().div_ceil(512) * 512, 0);
    out
}

fn file(path: &str, mode: u32, data: &[u8]) -> Vec<u8> {
    raw_entry(
        &raw_header(path, tar::EntryType::Regular, mode, None, data.len() as u64),
        data,
    )
}

fn link(path: &str, kind: tar::EntryType, target: &str) -> Vec<u8> {
    raw_entry(&raw_header(path, kind, 0o777, Some(target), 0), &[])
}

fn device(path: &str, kind: tar::EntryType, major: u32, minor: u32) -> Vec<u8> {
    let mut h = raw_header(path, kind, 0o666, None, 0);
    h.set_device_major(major).expect("gnu header");
    h.set_device_minor(minor).expect("gnu header");
    h.set_cksum();
    raw_entry(&h, &[])
}

/// A PAX header (`x`, or `g` for global) with `records`.
fn pax_header(records: &[(&str, &str)], global: bool) -> Vec<u8> {
    let mut body = Vec::new();
    for (k, v) in records {
        let rest = format!(" {k}={v}\n");
        let mut n = rest.len() + 1;
        while n.to_string().len() + rest.len() != n {
            n += 1;
        }
        body.extend(format!("{n}{rest}").as_bytes());
    }
    let kind = if global {
        tar::EntryType::XGlobalHeader
    } else {
        tar::EntryType::XHeader
    };
    raw_entry(
        &raw_header("PaxHeader", kind, 0o644, None, body.len() as u64),
        &body,
    )
}

/// The archive's entries, the end marker added.
fn archive_of(entries: Vec<Vec<u8>>) -> Vec<u8> {
    let mut out = entries.concat();
    out.extend_from_slice(&[0u8; 1024]);
    out
}

/// A hostile archive: its entries (after a harmless `before.txt`), what it
/// tries, and whether `import_tar` alone must refuse it too (it may keep a
/// symlink pointing out of the tree; `moves::restore` may not).
struct Hostile {
    name: &'static str,
    tar: Vec<u8>,
    import_refuses: bool,
}

/// The hostile archives, aimed at a target next to `outside.txt` (what
/// `../` escapes hit); `abs` is a short absolute directory holding another
/// `outside.txt` and an `outside-dir/` (what absolute paths and links hit).
fn hostile_archives(abs: &str) -> Vec<Hostile> {
    use tar::EntryType as T;
    let before = || file("before.txt", 0o644, b"harmless");
    let hidden_device = device("hidden-dev", T::Char, 1, 3);
    let h = |name, entries: Vec<Vec<u8>>, import_refuses| Hostile {
        name,
        tar: archive_of([vec![before()], entries].concat()),
        import_refuses,
    };
    vec![
        h(
            "dotdot",
            vec![file("../escaped.txt", 0o644, b"escaped")],
            true,
        ),
        h(
            "absolute path",
            vec![file(&format!("{abs}/written.txt"), 0o644, b"absolute")],
            true,
        ),
        h(
            "setuid file",
            vec![file("suid", 0o4755, b"#!/bin/sh\nid\n")],
            true,
        ),
        h(
            "setgid file",
            vec![file("sgid", 0o2755, b"#!/bin/sh\nid\n")],
            true,
        ),
        h("char device", vec![device("null-dev", T::Char, 1, 3)], true),
        h(
            "block device",
            vec![device("block-dev", T::Block, 7, 0)],
            true,
        ),
        h("fifo", vec![device("fifo", T::Fifo, 0, 0)], true),
        h(
            "absolute symlink",
            vec![link("etc-link", T::Symlink, "/etc")],
            false,
        ),
        h(
            "climbing symlink",
            vec![link("up", T::Symlink, "../../..")],
            false,
        ),
        h(
            "hardlink out",
            vec![link("hl", T::Link, "../outside.txt")],
            true,
        ),
        h(
            "hardlink to an absolute path",
            vec![link("hl-abs", T::Link, &format!("{abs}/outside.txt"))],
            true,
        ),
        h(
            "hardlink under a symlink",
            vec![
                link("via", T::Symlink, &format!("{abs}/outside-dir")),
                link("via/planted", T::Link, "before.txt"),
            ],
            true,
        ),
        h(
            "file under a symlink",
            vec![
                link("via2", T::Symlink, &format!("{abs}/outside-dir")),
                file("via2/planted.txt", 0o644, b"planted"),
            ],
            true,
        ),
        h(
            "duplicate entry",
            vec![
                link("dup", T::Symlink, "before.txt"),
                file("dup", 0o644, b"overwrite through the first dup"),
            ],
            true,
        ),
        h(
            "gnu sparse",
            vec![raw_entry(
                &raw_header("sparse", T::GNUSparse, 0o644, None, 0),
                &[],
            )],
            true,
        ),
        h(
            "pax sparse renaming",
            vec![
                pax_header(&[("GNU.sparse.name", "renamed.txt")], false),
                file("innocent.txt", 0o644, b"abc"),
            ],
            true,
        ),
        h(
            "pax global header",
            vec![
                pax_header(&[("comment", "global")], true),
                file("a.txt", 0o644, b"a"),
            ],
            true,
        ),
        h(
            "bad checksum hiding a device",
            vec![{
                let mut cover = raw_entry(&raw_header("cover", T::Regular, 0o644, None, 512), &[]);
                cover[148..156].copy_from_slice(b"0000000\0");
                [cover, hidden_device.clone()].concat()
            }],
            true,
        ),
        h(
            "pax size hiding a device",
            vec![
                pax_header(&[("size", "0")], false),
                raw_entry(&raw_header("sized", T::Regular, 0o644, None, 512), &[]),
                hidden_device.clone(),
            ],
            true,
        ),
        h(
            "symlink with data hiding a device",
            vec![
                raw_entry(
                    &raw_header("datalink", T::Symlink, 0o777, Some("before.txt"), 512),
                    &[],
                ),
                hidden_device,
            ],
            true,
        ),
    ]
}

/// Everything a hostile archive could hit outside its target: a listing of
/// `base` (the target pruned) and of `abs`, the sentinels' content and
/// link counts.
async fn outside_state(
    sb: &dyn Sandbox,
    base: &str,
    target_name: &str,
    abs: &str,
) -> Result<String> {
    sh(
        sb,
        &format!(
            "cd {b} && find . -path ./{t} -prune -o -print | LC_ALL=C sort; \
             cat outside.txt; stat -c ' links=%h' outside.txt; \
             cd {a} && find . | LC_ALL=C sort; cat outside.txt; stat -c ' links=%h' outside.txt",
            b = shell_quote(base),
            t = shell_quote(target_name),
            a = shell_quote(abs)
        ),
    )
    .await
}

/// No privileged or special file anywhere under `dir`.
async fn nothing_privileged(sb: &dyn Sandbox, dir: &str, what: &str) -> Result<()> {
    let found = sh(
        sb,
        &format!(
            "find {} \\( -type b -o -type c -o -type p \\) -print -o ! -type d -perm /6000 -print; true",
            shell_quote(dir)
        ),
    )
    .await?;
    ensure!(
        found.trim().is_empty(),
        "{what}: left device nodes, FIFOs or setuid/setgid files: {found:?}"
    );
    let names = sh(
        sb,
        &format!("cd {} && find . | LC_ALL=C sort", shell_quote(dir)),
    )
    .await?;
    for hidden in ["hidden-dev", "renamed.txt", "planted"] {
        ensure!(
            !names.contains(hidden),
            "{what}: an entry the scan never saw was written ({hidden}): {names:?}"
        );
    }
    Ok(())
}

async fn hostile_scratch(sb: &dyn Sandbox, name: &str) -> Result<(String, String)> {
    let base = scratch(name);
    let abs = format!("/tmp/harness-suite-{}", uuid_like());
    for dir in [&base, &abs] {
        sh(
            sb,
            &format!(
                "mkdir -p {d}/outside-dir && printf sentinel > {d}/outside.txt",
                d = shell_quote(dir)
            ),
        )
        .await?;
    }
    Ok((base, abs))
}

/// `import_tar` refuses every hostile archive but those that only hold a
/// symlink pointing out (which it may restore as it was) with an error, and
/// whatever it did before refusing, it wrote nothing outside its target,
/// left no device, FIFO or setuid/setgid file, and never wrote an entry
/// that a scan of the archive would not have seen.
pub async fn import_refuses_hostile_entries(sb: &dyn Sandbox) -> Result<()> {
    let (base, abs) = hostile_scratch(sb, "hostile-import").await?;
    let mut failures = Vec::new();
    for (i, case) in hostile_archives(&abs).into_iter().enumerate() {
        let target_name = format!("t{i}");
        let target = format!("{base}/{target_name}");
        let before = outside_state(sb, &base, &target_name, &abs).await?;
        let result = sb
            .import_tar(&target, harness_core::stream::once(case.tar))
            .await;
        let check = async {
            if case.import_refuses {
                ensure!(result.is_err(), "import_tar accepted it");
            }
            // Two execs at once (the listing prunes the target, so the
            // mkdir does not show in it).
            let mkdir = format!("mkdir -p {}", shell_quote(&target));
            let (after, _) =
                tokio::try_join!(outside_state(sb, &base, &target_name, &abs), sh(sb, &mkdir))?;
            ensure!(
                after == before,
                "it changed what lies outside the target:\nbefore:\n{before}\nafter:\n{after}"
            );
            nothing_privileged(sb, &target, "import_tar").await
        }
        .await;
        if let Err(e) = check {
            failures.push(format!("{}: {e:#}", case.name));
        }
    }
    sh(
        sb,
        &format!("rm -rf {} {}", shell_quote(&base), shell_quote(&abs)),
    )
    .await?;
    ensure!(
        failures.is_empty(),
        "hostile archives through import_tar:\n  {}",
        failures.join("\n  ")
    );
    Ok(())
}

/// `import_tar` of a file the archive says belongs to uid/gid 4242 leaves
/// it owned by whoever extracts (extractors running as root would
/// otherwise hand files to any user the archive names).
pub async fn import_takes_no_owners_from_the_archive(sb: &dyn Sandbox) -> Result<()> {
    let target = scratch("owners");
    let mut h = raw_header("owned.txt", tar::EntryType::Regular, 0o644, None, 2);
    h.set_uid(4242);
    h.set_gid(4242);
    h.set_cksum();
    let tar = archive_of(vec![raw_entry(&h, b"hi")]);
    sb.import_tar(&target, harness_core::stream::once(tar))
        .await?;
    let out = sh(
        sb,
        &format!(
            "stat -c '%u:%g' {}/owned.txt && id -u && id -g",
            shell_quote(&target)
        ),
    )
    .await?;
    let lines: Vec<&str> = out.lines().collect();
    sh(sb, &format!("rm -rf {}", shell_quote(&target))).await?;
    ensure!(lines.len() == 3, "unexpected output: {out:?}");
    ensure!(
        lines[0] == format!("{}:{}", lines[1], lines[2]),
        "the file belongs to {} (the archive said 4242:4242), not to the extracting user {}:{}",
        lines[0],
        lines[1],
        lines[2]
    );
    Ok(())
}

/// The entry limit the file bomb of [`restore_refuses_decompression_bombs`]
/// is restored under.
const BOMB_ENTRY_LIMIT: u64 = 10_000;

/// The zstd of `data`, as one frame (frames concatenate: the decompressed
/// stream is their contents in order).
async fn zstd_frame(data: Vec<u8>) -> Result<Vec<u8>> {
    use harness_moves as moves;
    let frame = moves::compress(harness_core::stream::once(data), moves::DEFAULT_ZSTD_LEVEL);
    Ok(harness_core::stream::collect(frame, usize::MAX)
        .await?
        .to_vec())
}

/// Two decompression bombs, stored as a few MB of zstd in a memory store:
/// 10 GiB of zeros in one file, and 1,000,000 empty files. A restore into
/// this sandbox refuses each with an `Unsafe` error that names the limit,
/// and leaves the target as it was.
///
/// The zeros go through `moves::restore` and its built-in limits (8 GiB:
/// refused at the header). The files go through `restore_with_limits` with
/// the entry limit lowered to 10,000 (`BOMB_ENTRY_LIMIT`): a sandbox that stages
/// imports writes every entry before the crossing one into its staging
/// directory, and 500,000 empty files (the built-in limit, unit-tested in
/// `tarscan`) took 2 m 12 s to create on this project's CI disk (ext4) —
/// most of the local suite's time — for the same refusal.
pub async fn restore_refuses_decompression_bombs(sb: &dyn Sandbox) -> Result<()> {
    use harness_core::checkpoint::{CheckpointStore, MemoryCheckpointStore};
    use harness_core::tarscan::ScanLimits;
    use harness_moves as moves;
    let target = format!("{}/target", scratch("bombs"));
    sh(
        sb,
        &format!(
            "mkdir -p {t} && printf keep > {t}/keep.txt",
            t = shell_quote(&target)
        ),
    )
    .await?;
    let store = MemoryCheckpointStore::new();
    // 10 GiB of zeros: the header, then 10,240 frames of 1 MiB of zeros
    // (each a few dozen bytes of zstd), then the end marker.
    let size = 10u64 << 30;
    let header = raw_header("zeros.bin", tar::EntryType::Regular, 0o644, None, size);
    let mut zeros = zstd_frame(header.as_bytes().to_vec()).await?;
    let mib = zstd_frame(vec![0u8; 1 << 20]).await?;
    for _ in 0..(size >> 20) {
        zeros.extend_from_slice(&mib);
    }
    zeros.extend(zstd_frame(vec![0u8; 1024]).await?);
    // 1,000,000 empty files, 10,000 headers to a frame.
    let mut files = Vec::new();
    for chunk in 0..100 {
        let mut tar = Vec::with_capacity(10_000 * 512);
        for i in 0..10_000 {
            let name = format!("f{}", chunk * 10_000 + i);
            tar.extend(file(&name, 0o644, b""));
        }
        files.extend(zstd_frame(tar).await?);
    }
    files.extend(zstd_frame(vec![0u8; 1024]).await?);
    let mut failures = Vec::new();
    let lowered = ScanLimits {
        max_entries: BOMB_ENTRY_LIMIT,
        ..ScanLimits::BUILT_IN
    };
    for (name, bomb, limits, says) in [
        (
            "10 GiB of zeros",
            zeros,
            ScanLimits::default(),
            "bytes of files",
        ),
        ("1,000,000 empty files", files, lowered, "entries"),
    ] {
        let compressed = bomb.len();
        let key = format!("bombs/{}.tar.zst", name.replace([' ', ','], "-"));
        store.put(&key, harness_core::stream::once(bomb)).await?;
        let before = manifest(sb, &target).await?;
        let result = moves::restore_with_limits(&store, &key, sb, &target, None, limits).await;
        let check = async {
            match &result {
                Ok(info) => bail!("restore accepted it: {info:?}"),
                Err(e) if e.kind() == ErrorKind::Unsafe && e.message().contains(says) => {}
                Err(e) => bail!("not refused for its size ({says}): {e}"),
            }
            let after = manifest(sb, &target).await?;
            ensure!(
                after == before,
                "the target changed:
{before:?}
{after:?}"
            );
            Ok(())
        }
        .await;
        if let Err(e) = check {
            failures.push(format!("{name} ({compressed} bytes of zstd): {e:#}"));
        }
    }
    sh(sb, &format!("rm -rf {}", shell_quote(&target))).await?;
    ensure!(
        failures.is_empty(),
        "decompression bombs:\n  {}",
        failures.join("\n  ")
    );
    Ok(())
}

/// `moves::restore` of each hostile archive (stored zstd-compressed in a
/// memory checkpoint store) into this sandbox fails with a clear `Unsafe`
/// or `Corrupt` error and leaves the target exactly as it was (the harmless
/// entry before the hostile one included) and everything outside it too.
pub async fn restore_refuses_hostile_archives(sb: &dyn Sandbox) -> Result<()> {
    use harness_core::checkpoint::{CheckpointStore, MemoryCheckpointStore};
    use harness_moves as moves;
    let (base, abs) = hostile_scratch(sb, "hostile-restore").await?;
    let target_name = "target";
    let target = format!("{base}/{target_name}");
    sh(
        sb,
        &format!(
            "mkdir -p {t}/sub && printf keep > {t}/keep.txt && ln -s keep.txt {t}/keep-link",
            t = shell_quote(&target)
        ),
    )
    .await?;
    let store = MemoryCheckpointStore::new();
    let mut failures = Vec::new();
    // The target and what lies outside it, read together (two execs at
    // once: an emulated microVM pays most of a second per exec). What one
    // case leaves is what the next starts from, so each is judged by what
    // it changed itself.
    let scene = || async {
        tokio::try_join!(
            manifest(sb, &target),
            outside_state(sb, &base, target_name, &abs)
        )
    };
    let mut before = scene().await?;
    for case in hostile_archives(&abs) {
        let key = format!("hostile/{}.tar.zst", case.name.replace(' ', "-"));
        store
            .put(
                &key,
                moves::compress(
                    harness_core::stream::once(case.tar),
                    moves::DEFAULT_ZSTD_LEVEL,
                ),
            )
            .await?;
        let result = moves::restore(&store, &key, sb, &target, None).await;
        let after = scene().await?;
        let check = (|| {
            match &result {
                Ok(info) => bail!("restore accepted it: {info:?}"),
                Err(e) if matches!(e.kind(), ErrorKind::Unsafe | ErrorKind::Corrupt) => {
                    ensure!(e.to_string().len() > 20, "an unclear error: {e}");
                }
                Err(e) => bail!("restore must refuse as Unsafe or Corrupt, got {e}"),
            }
            ensure!(
                after.0 == before.0,
                "the refused restore changed the target"
            );
            ensure!(
                after.1 == before.1,
                "the refused restore changed what lies outside the target"
            );
            Ok(())
        })();
        if let Err(e) = check {
            failures.push(format!("{}: {e:#}", case.name));
        }
        before = after;
    }
    // The control: the same pipeline restores a harmless archive.
    let key = "hostile/harmless.tar.zst";
    store
        .put(
            key,
            moves::compress(
                harness_core::stream::once(archive_of(vec![
                    file("before.txt", 0o644, b"harmless"),
                    link("rel-link", tar::EntryType::Symlink, "before.txt"),
                ])),
                moves::DEFAULT_ZSTD_LEVEL,
            ),
        )
        .await?;
    moves::restore(&store, key, sb, &target, None)
        .await
        .context("restoring a harmless archive through the same pipeline")?;
    let back = read_file(sb, &format!("{target}/before.txt")).await?;
    ensure!(back == b"harmless", "the harmless restore wrote {back:?}");
    sh(
        sb,
        &format!("rm -rf {} {}", shell_quote(&base), shell_quote(&abs)),
    )
    .await?;
    ensure!(
        failures.is_empty(),
        "hostile archives through moves::restore:\n  {}",
        failures.join("\n  ")
    );
    Ok(())
}
