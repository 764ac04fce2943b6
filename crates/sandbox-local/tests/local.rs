//! Behaviour specific to the local backend: bootstrap templates (once per
//! identity across threads and processes), wrap-mode, network policies
//! through the gate (a network namespace per command; needs root),
//! bounded memory for large files, and resume from another process.
//!
//! Tests that need a second process re-run this test binary with
//! `SANDBOX_LOCAL_CHILD` set; the ignored test `child_entry` then plays the
//! child's part.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use harness_core::bootstrap::{BootstrapRecipe, FileSource, RecipeFile};
use harness_core::sandbox::{
    collect_exec, ExecRequest, ExitReason, HostForward, NetworkPolicy, Sandbox, SandboxHandle,
    SandboxProvider, SandboxSpec, EGRESS_PROXY_PORT, MODEL_BROKER_PORT,
};
use harness_core::stream;
use harness_core::ErrorKind;
use harness_testkit::conformance::sandbox as suite;
use harness_testkit::trees::tar_of;
use sandbox_local::LocalProvider;
use sha2::{Digest, Sha256};

const CHILD_ROLE: &str = "SANDBOX_LOCAL_CHILD";
const CHILD_ROOT: &str = "SANDBOX_LOCAL_CHILD_ROOT";
const CHILD_COUNTER: &str = "SANDBOX_LOCAL_CHILD_COUNTER";
const CHILD_AGENT_FILE: &str = "SANDBOX_LOCAL_CHILD_AGENT_FILE";
const CHILD_GATE: &str = "SANDBOX_LOCAL_CHILD_GATE";
const CHILD_SOCKET: &str = "SANDBOX_LOCAL_CHILD_SOCKET";

/// A recipe with an inline file, a host file, and a command that appends
/// one line to `$COUNTER` (outside the template) each time it runs.
fn recipe(agent_file: &Path) -> BootstrapRecipe {
    let content = std::fs::read(agent_file).unwrap();
    BootstrapRecipe {
        files: vec![
            RecipeFile {
                path: "/opt/agent/config.txt".into(),
                mode: 0o644,
                source: FileSource::Inline {
                    text: "inline-config\n".into(),
                },
            },
            RecipeFile {
                path: "/opt/agent/bin/agent".into(),
                mode: 0o755,
                source: FileSource::HostPath {
                    path: agent_file.to_str().unwrap().into(),
                    sha256: hex::encode(Sha256::digest(&content)),
                },
            },
        ],
        bootstrap_pre_commands: vec!["mkdir -p \"$HOME/.agent\"".into()],
        // The sleep widens the window in which a second first-session
        // would run the recipe too if the lock did not hold.
        commands: vec![
            "echo ran >> \"$COUNTER\"; sleep 1; echo bootstrapped > \"$HOME/.agent/state\"".into(),
        ],
    }
}

fn agent_file(dir: &Path) -> PathBuf {
    let path = dir.join("agent.sh");
    std::fs::write(&path, "#!/bin/sh\necho agent-ran\n").unwrap();
    path
}

fn bootstrap_spec(counter: &Path, agent: &Path) -> SandboxSpec {
    let mut spec = SandboxSpec::new("/workspace");
    spec.env
        .insert("COUNTER".into(), counter.to_str().unwrap().into());
    spec.bootstrap = Some(recipe(agent));
    spec
}

fn lines(path: &Path) -> usize {
    std::fs::read_to_string(path)
        .map(|s| s.lines().count())
        .unwrap_or(0)
}

async fn sh(sb: &dyn Sandbox, script: &str) -> String {
    let out = collect_exec(sb.exec(ExecRequest::shell(script)).await.unwrap())
        .await
        .unwrap();
    assert!(out.status.success(), "{script}: {}", out.stderr_str());
    out.stdout_str()
}

/// What a bootstrapped sandbox must contain.
async fn assert_bootstrapped(sb: &dyn Sandbox) {
    let out = sh(
        sb,
        "cat \"$HARNESS_SANDBOX_ROOT/opt/agent/config.txt\"; \"$HARNESS_SANDBOX_ROOT/opt/agent/bin/agent\"; cat \"$HOME/.agent/state\"",
    )
    .await;
    assert_eq!(out, "inline-config\nagent-ran\nbootstrapped\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bootstrap_runs_once_for_concurrent_first_sessions_in_one_process() {
    let root = tempfile::tempdir().unwrap();
    let scratch = tempfile::tempdir().unwrap();
    let counter = scratch.path().join("counter");
    let agent = agent_file(scratch.path());
    let spec = bootstrap_spec(&counter, &agent);
    // Two provider values over one root, as two engines in one process.
    let (p1, p2) = (
        LocalProvider::new(root.path()),
        LocalProvider::new(root.path()),
    );
    let (a, b) = tokio::join!(p1.create(&spec), p2.create(&spec));
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_eq!(
        lines(&counter),
        1,
        "the recipe must run once for two concurrent first sessions"
    );
    assert_bootstrapped(a.as_ref()).await;
    assert_bootstrapped(b.as_ref()).await;
    // Sessions get copies: one changing its tree leaves the other alone.
    sh(
        a.as_ref(),
        "echo changed > \"$HARNESS_SANDBOX_ROOT/opt/agent/config.txt\"",
    )
    .await;
    assert_bootstrapped(b.as_ref()).await;

    let c = p1.create(&spec).await.unwrap();
    assert_eq!(
        lines(&counter),
        1,
        "a later session starts from the template"
    );
    assert_bootstrapped(c.as_ref()).await;

    let identity = spec.bootstrap.as_ref().unwrap().identity("local");
    let snapshots = p1.list_snapshots().await.unwrap();
    assert_eq!(snapshots.len(), 1, "{snapshots:?}");
    assert_eq!(snapshots[0].identity, identity);
    assert!(snapshots[0].size_bytes.unwrap() > 0);
    assert!(p1
        .prune_snapshots(std::slice::from_ref(&identity))
        .await
        .unwrap()
        .is_empty());
    let removed = p1.prune_snapshots(&[]).await.unwrap();
    assert_eq!(removed.len(), 1);
    assert!(p1.list_snapshots().await.unwrap().is_empty());
    // With the template pruned, the next first session runs the recipe again.
    let d = p1.create(&spec).await.unwrap();
    assert_eq!(lines(&counter), 2);
    assert_bootstrapped(d.as_ref()).await;
    for sb in [a, b, c, d] {
        sb.destroy().await.unwrap();
    }
}

/// Until `provider`'s pool holds `n` ready copies of `identity` (bounded).
async fn pool_holds(provider: &LocalProvider, identity: &str, n: usize) {
    for _ in 0..6000 {
        if provider.pool_ready(identity) == n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!(
        "the pool of {identity} holds {} ready copies, not {n}, after 60 s",
        provider.pool_ready(identity)
    );
}

/// The one ready copy of `identity` and its inode.
fn pooled_copy(root: &Path, identity: &str) -> (PathBuf, u64) {
    use std::os::unix::fs::MetadataExt;
    let dir = root.join("templates/pool").join(identity);
    let copies: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| !p.file_name().unwrap().to_string_lossy().starts_with(".tmp"))
        .collect();
    assert_eq!(copies.len(), 1, "{copies:?}");
    let inode = std::fs::metadata(&copies[0]).unwrap().ino();
    (copies[0].clone(), inode)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ready_copy_of_the_template_starts_the_next_sandbox() {
    use std::os::unix::fs::MetadataExt;
    let root = tempfile::tempdir().unwrap();
    let scratch = tempfile::tempdir().unwrap();
    let counter = scratch.path().join("counter");
    let agent = agent_file(scratch.path());
    let spec = bootstrap_spec(&counter, &agent);
    let identity = spec.bootstrap.as_ref().unwrap().identity("local");
    let provider = LocalProvider::new(root.path()).with_pool_size(1);
    // The first sandbox builds the template and copies it; a ready copy
    // is then made in the background.
    let a = provider.create(&spec).await.unwrap();
    pool_holds(&provider, &identity, 1).await;
    let (copy, inode) = pooled_copy(root.path(), &identity);
    // The next sandbox *is* that copy, moved, and is bootstrapped like the
    // first; the pool is topped up with another.
    let b = provider.create(&spec).await.unwrap();
    assert!(!copy.exists(), "the ready copy was taken");
    let b_root = Path::new(b.workdir()).parent().unwrap().to_path_buf();
    assert_eq!(std::fs::metadata(&b_root).unwrap().ino(), inode);
    assert_bootstrapped(b.as_ref()).await;
    assert_eq!(lines(&counter), 1, "the recipe ran once");
    pool_holds(&provider, &identity, 1).await;
    let (_, refilled) = pooled_copy(root.path(), &identity);
    assert_ne!(refilled, inode, "a new copy, not the taken one");
    // A session's changes stay its own: the next copy is the template's.
    sh(
        b.as_ref(),
        "echo changed > \"$HARNESS_SANDBOX_ROOT/opt/agent/config.txt\"",
    )
    .await;
    let c = provider.create(&spec).await.unwrap();
    assert_bootstrapped(c.as_ref()).await;
    pool_holds(&provider, &identity, 1).await;
    // Pruning the template takes its ready copies too.
    provider.prune_snapshots(&[]).await.unwrap();
    assert!(!root.path().join("templates/pool").join(&identity).exists());
    // Without a pool, nothing is copied ahead.
    let unpooled_root = tempfile::tempdir().unwrap();
    let unpooled = LocalProvider::new(unpooled_root.path()).with_pool_size(0);
    let d = unpooled.create(&spec).await.unwrap();
    assert_bootstrapped(d.as_ref()).await;
    assert!(!unpooled_root.path().join("templates/pool").exists());
    for sb in [a, b, c, d] {
        sb.destroy().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recipe_with_a_wrong_host_file_digest_fails_and_leaves_no_template() {
    let root = tempfile::tempdir().unwrap();
    let scratch = tempfile::tempdir().unwrap();
    let counter = scratch.path().join("counter");
    let agent = agent_file(scratch.path());
    let mut spec = bootstrap_spec(&counter, &agent);
    if let FileSource::HostPath { sha256, .. } =
        &mut spec.bootstrap.as_mut().unwrap().files[1].source
    {
        *sha256 = "00".repeat(32);
    }
    let provider = LocalProvider::new(root.path());
    let err = provider.create(&spec).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");
    assert!(err.message().contains("SHA-256"), "{err}");
    assert_eq!(lines(&counter), 0, "no command runs after a bad file");
    assert!(provider.list_snapshots().await.unwrap().is_empty());
    // Only the templates dir (with its lock file) remains: no sandbox dir,
    // no temporary template.
    let left: Vec<_> = std::fs::read_dir(root.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(left, vec!["templates".to_string()]);
    let tmp_left = std::fs::read_dir(root.path().join("templates"))
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .starts_with(".tmp")
        })
        .count();
    assert_eq!(tmp_left, 0);
}

fn spawn_child(role: &str, envs: &[(&str, &Path)]) -> std::process::Child {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", "child_entry", "--nocapture", "--include-ignored"])
        .env(CHILD_ROLE, role)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    for (k, v) in envs {
        cmd.env(k, v);
    }
    cmd.spawn().unwrap()
}

fn child_handle(output: &std::process::Output) -> SandboxHandle {
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "child failed: {stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix("HANDLE="))
        .unwrap_or_else(|| panic!("child printed no handle: {stdout}"));
    serde_json::from_str(line).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bootstrap_runs_once_for_concurrent_first_sessions_in_two_processes() {
    let root = tempfile::tempdir().unwrap();
    let scratch = tempfile::tempdir().unwrap();
    let counter = scratch.path().join("counter");
    let agent = agent_file(scratch.path());
    let envs = [
        (CHILD_ROOT, root.path()),
        (CHILD_COUNTER, counter.as_path()),
        (CHILD_AGENT_FILE, agent.as_path()),
    ];
    let a = spawn_child("bootstrap", &envs);
    let b = spawn_child("bootstrap", &envs);
    let (a, b) = (a.wait_with_output().unwrap(), b.wait_with_output().unwrap());
    let (ha, hb) = (child_handle(&a), child_handle(&b));
    assert_ne!(ha.id, hb.id);
    assert_eq!(
        lines(&counter),
        1,
        "two processes creating the first session must run the recipe once"
    );
    let provider = LocalProvider::new(root.path());
    for h in [ha, hb] {
        let sb = provider.resume(&h).await.unwrap();
        assert_bootstrapped(sb.as_ref()).await;
        sb.destroy().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_process_creates_and_this_one_resumes_from_the_handle_json() {
    let root = tempfile::tempdir().unwrap();
    let child = spawn_child("resume", &[(CHILD_ROOT, root.path())]);
    let output = child.wait_with_output().unwrap();
    let handle = child_handle(&output);
    assert_eq!(handle.provider, "local");
    // A provider with another root: the handle alone finds the sandbox.
    let elsewhere = tempfile::tempdir().unwrap();
    let provider = LocalProvider::new(elsewhere.path());
    let sb = provider.resume(&handle).await.unwrap();
    let content = stream::collect(sb.read_file("from-child.txt").await.unwrap(), 1024)
        .await
        .unwrap();
    assert_eq!(&content[..], b"written by the child process");
    assert_eq!(
        sh(sb.as_ref(), "cat from-child.txt").await,
        "written by the child process"
    );
    sb.destroy().await.unwrap();
    let again = provider.resume(&handle).await.unwrap_err();
    assert_eq!(again.kind(), ErrorKind::NotFound);
}

/// The child's part for the two-process tests (does nothing in a normal run).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "runs only as a child process of another test"]
async fn child_entry() {
    let Ok(role) = std::env::var(CHILD_ROLE) else {
        return;
    };
    let root = PathBuf::from(std::env::var(CHILD_ROOT).unwrap());
    let provider = LocalProvider::new(&root);
    let sb = match role.as_str() {
        "bootstrap" => {
            let counter = PathBuf::from(std::env::var(CHILD_COUNTER).unwrap());
            let agent = PathBuf::from(std::env::var(CHILD_AGENT_FILE).unwrap());
            provider
                .create(&bootstrap_spec(&counter, &agent))
                .await
                .unwrap()
        }
        "deny" => {
            let gate = PathBuf::from(std::env::var(CHILD_GATE).unwrap());
            let socket = std::env::var(CHILD_SOCKET).unwrap();
            let mut spec = SandboxSpec::new("/workspace");
            spec.network = NetworkPolicy::DenyAll;
            spec.forwards = vec![HostForward {
                port: MODEL_BROKER_PORT,
                socket,
            }];
            provider.with_gate(gate).create(&spec).await.unwrap()
        }
        "resume" => {
            let sb = provider
                .create(&SandboxSpec::new("/workspace"))
                .await
                .unwrap();
            sb.write_file(
                "from-child.txt",
                stream::once("written by the child process"),
            )
            .await
            .unwrap();
            sb
        }
        other => panic!("unknown child role {other}"),
    };
    let handle = sb.detach().await.unwrap();
    println!("HANDLE={}", serde_json::to_string(&handle).unwrap());
}

/// A provider with the gate, or `None` (skipped, or failed under
/// `HARNESS_REQUIRE_REAL=1`) when this process may not make network
/// namespaces or the gate cannot be built.
fn gated_provider(root: &Path) -> Option<LocalProvider> {
    if !nix::unistd::geteuid().is_root() {
        harness_testkit::skip_or_fail(
            "the local sandbox's deny-all/custom policies need root (a network namespace per command)",
        );
        return None;
    }
    let gate = harness_testkit::gate_binary()?;
    Some(LocalProvider::new(root).with_gate(gate))
}

fn custom_policy() -> NetworkPolicy {
    NetworkPolicy::Custom {
        allowed_hosts: vec!["example.com".into()],
        allowed_cidrs: vec![],
        denied_cidrs: vec![],
        allowed_ports: vec![],
    }
}

/// A host TCP server on 127.0.0.1 counting connections.
async fn host_server() -> (u16, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let hits = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = hits.clone();
    tokio::spawn(async move {
        while let Ok((conn, _)) = listener.accept().await {
            counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            drop(conn);
        }
    });
    (port, hits)
}

/// `connected` or `refused` for a TCP connection to 127.0.0.1:`port`.
async fn probe(sb: &dyn Sandbox, port: u16) -> String {
    sh(
        sb,
        &format!(
            "timeout 3 bash -c 'exec 3<>/dev/tcp/127.0.0.1/{port}' 2>/dev/null && echo connected || echo refused"
        ),
    )
    .await
    .trim()
    .to_string()
}

/// One HTTP GET to 127.0.0.1:`port` from inside; the response.
async fn get(sb: &dyn Sandbox, port: u16) -> String {
    sh(
        sb,
        &format!(
            "timeout 10 bash -c 'exec 3<>/dev/tcp/127.0.0.1/{port} && printf \"GET / HTTP/1.0\\r\\n\\r\\n\" >&3 && cat <&3' || true"
        ),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deny_all_runs_every_command_in_a_network_namespace_of_its_own() {
    let root = tempfile::tempdir().unwrap();
    let Some(provider) = gated_provider(root.path()) else {
        return;
    };
    let (port, hits) = host_server().await;
    let mut spec = SandboxSpec::new("/workspace");
    spec.network = NetworkPolicy::DenyAll;
    let sb = provider.create(&spec).await.unwrap();
    assert!(!provider.shares_host_network(&NetworkPolicy::DenyAll));
    assert_eq!(probe(sb.as_ref(), port).await, "refused");
    assert_eq!(hits.load(std::sync::atomic::Ordering::SeqCst), 0);
    // Only loopback, up; not the host's namespace; and no way back.
    let links = sh(sb.as_ref(), "ip -o link show").await;
    assert_eq!(links.lines().count(), 1, "{links}");
    assert!(links.contains("lo:") && links.contains("UP"), "{links}");
    let host_ns = std::fs::read_link("/proc/self/ns/net").unwrap();
    let inside = sh(sb.as_ref(), "readlink /proc/self/ns/net").await;
    assert_ne!(inside.trim(), host_ns.to_string_lossy());
    let escape = sh(
        sb.as_ref(),
        &format!(
            "nsenter --net={} true 2>/dev/null && echo escaped || echo stayed",
            Path::new("/proc")
                .join(std::process::id().to_string())
                .join("ns/net")
                .display()
        ),
    )
    .await;
    assert_eq!(escape.trim(), "stayed");
    // The process group is still the command's: a timeout kills the tree.
    let out = collect_exec(
        sb.exec(ExecRequest::shell("sleep 30 & sleep 30").timeout(Duration::from_millis(500)))
            .await
            .unwrap(),
    )
    .await
    .unwrap();
    assert_eq!(out.status.reason, ExitReason::TimedOut);
    // A missing program is NotFound, as without the gate.
    let Err(missing) = sb.exec(ExecRequest::new(["harness-no-such-program"])).await else {
        panic!("a missing program must be NotFound");
    };
    assert_eq!(missing.kind(), ErrorKind::NotFound, "{missing}");
    sb.destroy().await.unwrap();

    // The control: allow-all reaches the same server.
    let sb = provider
        .create(&SandboxSpec::new("/workspace"))
        .await
        .unwrap();
    assert!(provider.shares_host_network(&NetworkPolicy::AllowAll));
    assert_eq!(probe(sb.as_ref(), port).await, "connected");
    sb.destroy().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn custom_reaches_only_the_egress_forward() {
    let root = tempfile::tempdir().unwrap();
    let Some(provider) = gated_provider(root.path()) else {
        return;
    };
    let (port, hits) = host_server().await;
    let proxy = harness_testkit::conformance::sandbox::SocketServer::start("egress-proxy-answer")
        .await
        .unwrap();
    let mut spec = SandboxSpec::new("/workspace");
    spec.network = custom_policy();
    spec.forwards = vec![proxy.forward(EGRESS_PROXY_PORT)];
    let sb = provider.create(&spec).await.unwrap();
    assert_eq!(probe(sb.as_ref(), port).await, "refused");
    assert_eq!(hits.load(std::sync::atomic::Ordering::SeqCst), 0);
    let reply = get(sb.as_ref(), EGRESS_PROXY_PORT).await;
    assert!(reply.ends_with("egress-proxy-answer"), "{reply:?}");
    assert_eq!(proxy.hits(), 1);
    sb.destroy().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_the_local_sandbox_cannot_do_is_refused_at_create() {
    let root = tempfile::tempdir().unwrap();
    let provider = LocalProvider::new(root.path());
    let forward = HostForward {
        port: MODEL_BROKER_PORT,
        socket: "/tmp/harness-test-broker.sock".into(),
    };
    // Allow-all shares the host network: forwards make no sense there.
    let mut spec = SandboxSpec::new("/workspace");
    spec.forwards = vec![forward.clone()];
    let err = provider.create(&spec).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unsupported, "{err}");
    assert!(err.message().contains("host's own network"), "{err}");
    // Custom without the egress forward: nothing would enforce its lists.
    let mut spec = SandboxSpec::new("/workspace");
    spec.network = custom_policy();
    spec.forwards = vec![forward.clone()];
    let err = provider.create(&spec).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
    assert!(
        err.message().contains("egress proxy forward on port 47812"),
        "{err}"
    );
    // Ports cannot be reached in a namespace per command.
    let mut spec = SandboxSpec::new("/workspace");
    spec.network = NetworkPolicy::DenyAll;
    spec.ports = vec![8080];
    let err = provider.create(&spec).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unsupported, "{err}");
    assert!(err.message().contains("cannot expose ports"), "{err}");
    // A relative socket path.
    let mut spec = SandboxSpec::new("/workspace");
    spec.network = NetworkPolicy::DenyAll;
    spec.forwards = vec![HostForward {
        port: MODEL_BROKER_PORT,
        socket: "broker.sock".into(),
    }];
    let err = provider.create(&spec).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
    // No gate: refused, naming how to provide one.
    let without = LocalProvider::new(root.path()).with_gate(root.path().join("no-gate"));
    for policy in [NetworkPolicy::DenyAll, custom_policy()] {
        let mut spec = SandboxSpec::new("/workspace");
        spec.network = policy.clone();
        spec.forwards = vec![HostForward {
            port: EGRESS_PROXY_PORT,
            socket: "/tmp/harness-test-egress.sock".into(),
        }];
        let err = without.create(&spec).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Unsupported, "{policy:?}: {err}");
        assert!(
            err.message().contains("HARNESS_SANDBOX_GATE_BIN") && err.message().contains("no-gate"),
            "{err}"
        );
    }
    assert!(
        std::fs::read_dir(root.path()).unwrap().next().is_none(),
        "a refused create leaves nothing behind"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_policy_and_forwards_survive_resume_in_another_process() {
    let root = tempfile::tempdir().unwrap();
    let Some(gate) = gated_provider(root.path()).and_then(|p| p.gate()) else {
        return;
    };
    let server = harness_testkit::conformance::sandbox::SocketServer::start("broker-answer")
        .await
        .unwrap();
    let socket = server.socket().to_path_buf();
    let child = spawn_child(
        "deny",
        &[
            (CHILD_ROOT, root.path()),
            (CHILD_GATE, gate.as_path()),
            (CHILD_SOCKET, socket.as_path()),
        ],
    );
    let handle = child_handle(&child.wait_with_output().unwrap());
    // This process's provider has no usable gate of its own: the one the
    // sandbox was created with (recorded in sandbox.json) is used.
    let elsewhere = tempfile::tempdir().unwrap();
    let provider = LocalProvider::new(elsewhere.path()).with_gate(elsewhere.path().join("none"));
    let sb = provider.resume(&handle).await.unwrap();
    let (port, hits) = host_server().await;
    assert_eq!(probe(sb.as_ref(), port).await, "refused");
    assert_eq!(hits.load(std::sync::atomic::Ordering::SeqCst), 0);
    let reply = get(sb.as_ref(), MODEL_BROKER_PORT).await;
    assert!(reply.ends_with("broker-answer"), "{reply:?}");
    drop(sb);

    // With no gate anywhere, resume refuses rather than run commands with
    // the host's network.
    let meta_path = Path::new(handle.data["dir"].as_str().unwrap()).join("sandbox.json");
    let mut meta: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&meta_path).unwrap()).unwrap();
    assert_eq!(meta["network"]["mode"], "deny-all");
    assert_eq!(meta["forwards"][0]["port"], MODEL_BROKER_PORT);
    meta["gate"] = "/nonexistent/harness-sandbox-gate".into();
    std::fs::write(&meta_path, serde_json::to_vec(&meta).unwrap()).unwrap();
    let err = provider.resume(&handle).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unsupported, "{err}");
    assert!(err.message().contains("HARNESS_SANDBOX_GATE_BIN"), "{err}");
    LocalProvider::new(root.path())
        .with_gate(gate)
        .resume(&handle)
        .await
        .unwrap()
        .destroy()
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrap_mode_uses_the_callers_directory_and_destroy_leaves_it() {
    let root = tempfile::tempdir().unwrap();
    let theirs = tempfile::tempdir().unwrap();
    std::fs::write(theirs.path().join("mine.txt"), "caller's file").unwrap();
    let provider = LocalProvider::new(root.path());
    let mut spec = SandboxSpec::new("/workspace");
    spec.wrap = Some(theirs.path().to_str().unwrap().into());
    let sb = provider.create(&spec).await.unwrap();
    assert_eq!(sb.workdir(), theirs.path().to_str().unwrap());
    assert!(!sb.handle().owned);
    assert_eq!(sh(sb.as_ref(), "cat mine.txt").await, "caller's file");
    sb.write_file("new.txt", stream::once("from sandbox"))
        .await
        .unwrap();
    let handle = sb.handle();
    sb.destroy().await.unwrap();
    assert_eq!(
        std::fs::read_to_string(theirs.path().join("mine.txt")).unwrap(),
        "caller's file"
    );
    assert!(theirs.path().join("new.txt").exists());
    assert_eq!(
        provider.resume(&handle).await.unwrap_err().kind(),
        ErrorKind::NotFound
    );
    // A wrap directory that does not exist is refused up front.
    spec.wrap = Some(theirs.path().join("missing").to_str().unwrap().into());
    assert_eq!(
        provider.create(&spec).await.unwrap_err().kind(),
        ErrorKind::NotFound
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn home_is_per_sandbox_and_overridable() {
    let root = tempfile::tempdir().unwrap();
    let provider = LocalProvider::new(root.path());
    let sb = provider
        .create(&SandboxSpec::new("/workspace"))
        .await
        .unwrap();
    let local = sb.as_ref() as &dyn Sandbox;
    let home = sh(local, "printf %s \"$HOME\"").await;
    let handle = sb.handle();
    let dir = handle.data["dir"].as_str().unwrap();
    assert_eq!(home, format!("{dir}/home"));
    assert!(home.starts_with(root.path().to_str().unwrap()));
    assert_eq!(sb.workdir(), format!("{dir}/work"));
    let out = collect_exec(
        sb.exec(ExecRequest::shell("printf %s \"$HOME\"").env("HOME", "/elsewhere"))
            .await
            .unwrap(),
    )
    .await
    .unwrap();
    assert_eq!(out.stdout_str(), "/elsewhere");
    sb.destroy().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_and_timeout_kill_the_process_tree() {
    let root = tempfile::tempdir().unwrap();
    let provider = LocalProvider::new(root.path());
    let sb = provider
        .create(&SandboxSpec::new("/workspace"))
        .await
        .unwrap();
    suite::exec_abort_kills_tree(sb.as_ref()).await.unwrap();
    suite::exec_timeout_kills_tree(sb.as_ref()).await.unwrap();

    // Dropping the output stream also takes the tree down (nobody would
    // ever see its exit otherwise).
    let pidfile = format!("{}/dropped.pids", sb.workdir());
    let mut stream = sb
        .exec(ExecRequest::shell(format!(
            "echo $$ > {pidfile}; sleep 100 & echo $! >> {pidfile}; echo ready; sleep 100"
        )))
        .await
        .unwrap();
    // Wait for "ready" so both pids are recorded.
    use futures::StreamExt;
    let first = tokio::time::timeout(Duration::from_secs(10), stream.next())
        .await
        .unwrap();
    assert!(first.is_some());
    drop(stream);
    let pids: Vec<i32> = std::fs::read_to_string(&pidfile)
        .unwrap()
        .split_whitespace()
        .map(|p| p.parse().unwrap())
        .collect();
    assert_eq!(pids.len(), 2);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let alive: Vec<_> = pids.iter().filter(|p| running(**p)).collect();
        if alive.is_empty() {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "dropping the exec stream left {alive:?} running"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // And a plain timeout reports itself in the status.
    let out = collect_exec(
        sb.exec(ExecRequest::new(["sleep", "30"]).timeout(Duration::from_millis(300)))
            .await
            .unwrap(),
    )
    .await
    .unwrap();
    assert_eq!(out.status.reason, ExitReason::TimedOut);
    assert_eq!(out.status.signal, Some(9));
    sb.destroy().await.unwrap();
}

/// Alive and not a zombie.
fn running(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .map(|(_, rest)| rest.trim_start().to_string())
        })
        .is_some_and(|rest| !rest.starts_with('Z'))
}

/// Peak resident set size of this process, in bytes.
fn vm_hwm() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .expect("VmHWM in /proc/self/status");
    let kb: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kb * 1024
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_file_round_trips_with_bounded_memory() {
    let root = tempfile::tempdir().unwrap();
    let provider = LocalProvider::new(root.path());
    let sb = provider
        .create(&SandboxSpec::new("/workspace"))
        .await
        .unwrap();
    // Reset the peak so the baseline is "now" (5 = reset VmHWM; a kernel
    // that refuses just leaves the older, higher peak as the baseline).
    let _ = std::fs::write("/proc/self/clear_refs", "5");
    let baseline = vm_hwm();
    let bytes = 128 * 1024 * 1024;
    let report = suite::large_file_round_trip(sb.as_ref(), "big/large.bin", bytes)
        .await
        .unwrap();
    let peak = vm_hwm();
    let delta = peak.saturating_sub(baseline);
    println!(
        "large file: {} MiB, write {:.2}s, read {:.2}s, peak RSS {} MiB (baseline {} MiB, delta {} MiB)",
        report.bytes >> 20,
        report.write_secs,
        report.read_secs,
        peak >> 20,
        baseline >> 20,
        delta >> 20
    );
    assert_eq!(report.bytes, bytes);
    assert!(
        delta < 64 * 1024 * 1024,
        "peak RSS grew by {} MiB while streaming {} MiB: something buffers the whole file",
        delta >> 20,
        bytes >> 20
    );
    // The same bound holds for a tar export of a tree holding a big file.
    sb.write_file("tree/big.bin", suite::generated_stream(bytes, 1 << 20, 9))
        .await
        .unwrap();
    let _ = std::fs::write("/proc/self/clear_refs", "5");
    let baseline = vm_hwm();
    let mut tar = sb.export_tar("tree").await.unwrap();
    let mut total = 0u64;
    use futures::StreamExt;
    while let Some(chunk) = tar.next().await {
        total += chunk.unwrap().len() as u64;
    }
    let delta = vm_hwm().saturating_sub(baseline);
    println!(
        "tar export: {} MiB, peak RSS delta {} MiB",
        total >> 20,
        delta >> 20
    );
    assert!(total > bytes);
    assert!(
        delta < 64 * 1024 * 1024,
        "tar export buffered: +{} MiB",
        delta >> 20
    );
    sb.destroy().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn import_refuses_writing_through_a_symlink_out_of_the_target() {
    let root = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    let provider = LocalProvider::new(root.path());
    let sb = provider
        .create(&SandboxSpec::new("/workspace"))
        .await
        .unwrap();
    let mut builder = tar::Builder::new(Vec::new());
    let mut link = tar::Header::new_gnu();
    link.set_entry_type(tar::EntryType::Symlink);
    link.set_size(0);
    link.set_mode(0o777);
    builder
        .append_link(&mut link, "escape", outside.path())
        .unwrap();
    let mut file = tar::Header::new_gnu();
    file.set_size(4);
    file.set_mode(0o644);
    builder
        .append_data(&mut file, "escape/pwned.txt", &b"evil"[..])
        .unwrap();
    let tar = builder.into_inner().unwrap();
    let err = sb
        .import_tar("target", stream::once(tar))
        .await
        .unwrap_err();
    assert!(
        matches!(
            err.kind(),
            ErrorKind::Unsafe | ErrorKind::Io | ErrorKind::InvalidInput
        ),
        "{err}"
    );
    assert!(
        !outside.path().join("pwned.txt").exists(),
        "import wrote through a symlink to outside the target"
    );
    // An absolute entry path is refused too.
    let mut builder = tar::Builder::new(Vec::new());
    let mut file = tar::Header::new_gnu();
    file.set_size(1);
    file.set_mode(0o644);
    {
        let name = b"/abs.txt";
        file.as_old_mut().name[..name.len()].copy_from_slice(name);
    }
    file.set_cksum();
    builder.append(&file, &b"x"[..]).unwrap();
    let err = sb
        .import_tar("target2", stream::once(builder.into_inner().unwrap()))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unsafe, "{err}");
    sb.destroy().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_ops_resolve_relative_paths_against_the_workdir_and_keep_modes() {
    let root = tempfile::tempdir().unwrap();
    let provider = LocalProvider::new(root.path());
    let sb = provider
        .create(&SandboxSpec::new("/workspace"))
        .await
        .unwrap();
    sb.write_file("bin/tool", stream::once("#!/bin/sh\necho v1\n"))
        .await
        .unwrap();
    sh(sb.as_ref(), "chmod 755 bin/tool").await;
    // Rewriting an executable keeps it executable.
    sb.write_file("bin/tool", stream::once("#!/bin/sh\necho v2\n"))
        .await
        .unwrap();
    assert_eq!(sh(sb.as_ref(), "./bin/tool").await, "v2\n");
    let host_path = Path::new(sb.workdir()).join("bin/tool");
    assert!(
        host_path.is_file(),
        "relative paths land under the host workdir"
    );
    // A failing source stream leaves the old file as it was.
    let failing: harness_core::stream::ByteStream = Box::pin(futures::stream::iter(vec![
        Ok(bytes::Bytes::from_static(b"partial")),
        Err(harness_core::Error::backend("source broke")),
    ]));
    let err = sb.write_file("bin/tool", failing).await.unwrap_err();
    assert!(err.message().contains("source broke"), "{err}");
    assert_eq!(sh(sb.as_ref(), "./bin/tool").await, "v2\n");
    let leftovers = sh(sb.as_ref(), "ls -A bin").await;
    assert_eq!(leftovers, "tool\n", "no temporary file is left behind");
    sb.destroy().await.unwrap();
}

/// The host process's environment (where a model key lives) reaches no
/// command: commands get the sandbox's environment and a few host
/// variables (`INHERITED_ENV`), nothing else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_do_not_inherit_the_host_environment() {
    // Set before any command runs in this test binary's process; no other
    // test here reads it.
    std::env::set_var("SANDBOX_LOCAL_TEST_SECRET", "host-secret-value-41");
    let root = tempfile::tempdir().unwrap();
    let provider = LocalProvider::new(root.path());
    let mut spec = SandboxSpec::new("/workspace");
    spec.env.insert("FROM_SPEC".into(), "spec-value".into());
    let sb = provider.create(&spec).await.unwrap();
    let env = sh(sb.as_ref(), "env").await;
    assert!(!env.contains("host-secret-value-41"), "{env}");
    assert!(env.contains("FROM_SPEC=spec-value"), "{env}");
    assert!(env.lines().any(|l| l.starts_with("PATH=")), "{env}");
    assert!(env.lines().any(|l| l.starts_with("HOME=")), "{env}");
    sb.destroy().await.unwrap();
}

fn listing(root: &Path) -> Vec<(String, String)> {
    let out = Command::new("sh")
        .arg("-c")
        .arg("find . -mindepth 1 -printf '%p %y %m %l\\n' | sort")
        .current_dir(root)
        .output()
        .unwrap();
    assert!(out.status.success());
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| {
            let (p, rest) = l.split_once(' ').unwrap();
            let content = match std::fs::symlink_metadata(root.join(p)) {
                Ok(m) if m.is_file() => std::fs::read_to_string(root.join(p)).unwrap_or_default(),
                _ => String::new(),
            };
            (p.to_string(), format!("{rest} {content}"))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn staged_import_overlays_like_import_and_leaves_nothing_on_failure() {
    use tar::EntryType::{Directory, Regular, Symlink};
    let root = tempfile::tempdir().unwrap();
    let provider = LocalProvider::new(root.path());
    let sb = provider
        .create(&SandboxSpec::new("/workspace"))
        .await
        .unwrap();
    assert!(sb.stages_tar_imports());
    let base = Path::new(sb.workdir());
    let archive = tar_of(&[
        ("src", Directory, "", 0o755),
        ("src/a.rs", Regular, "new a\n", 0o644),
        ("src/deep", Directory, "", 0o755),
        ("src/deep/b.rs", Regular, "new b\n", 0o600),
        ("locked", Directory, "", 0o555),
        ("locked/in.txt", Regular, "inside a read-only dir\n", 0o644),
        ("was-link", Directory, "", 0o755),
        ("was-link/f", Regular, "real dir now\n", 0o644),
        ("run.sh", Regular, "#!/bin/sh\n", 0o755),
        ("link", Symlink, "src/a.rs", 0o777),
    ]);
    // Into a directory that does not exist yet; and onto both a fresh and
    // a populated target, the staged result equals import_tar's.
    for (plain, staged) in [("p1", "s1"), ("p2", "s2")] {
        for dir in [plain, staged] {
            if plain == "p2" {
                let t = base.join(dir);
                std::fs::create_dir_all(t.join("src/deep")).unwrap();
                std::fs::write(t.join("src/a.rs"), "old a\n").unwrap();
                std::fs::write(t.join("src/keep.rs"), "target only\n").unwrap();
                std::fs::write(t.join("mine.txt"), "target only\n").unwrap();
                std::fs::write(t.join("run.sh"), "old\n").unwrap();
            }
        }
        sb.import_tar(plain, stream::once(archive.clone()))
            .await
            .unwrap();
        sb.import_tar_staged(staged, stream::once(archive.clone()))
            .await
            .unwrap();
        let want = listing(&base.join(plain));
        assert_eq!(
            listing(&base.join(staged)),
            want,
            "staged import of {staged}"
        );
        if plain == "p2" {
            assert!(want.iter().any(|(p, _)| p == "./src/keep.rs"));
        }
    }
    // Where the target holds a symlink and the archive a directory (which
    // import_tar refuses), the staged import replaces the symlink and
    // writes nothing through it.
    let outside = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(base.join("s3")).unwrap();
    std::os::unix::fs::symlink(outside.path(), base.join("s3/was-link")).unwrap();
    sb.import_tar_staged("s3", stream::once(archive.clone()))
        .await
        .unwrap();
    assert!(base
        .join("s3/was-link")
        .symlink_metadata()
        .unwrap()
        .is_dir());
    assert_eq!(
        std::fs::read_to_string(base.join("s3/was-link/f")).unwrap(),
        "real dir now\n"
    );
    assert_eq!(std::fs::read_dir(outside.path()).unwrap().count(), 0);
    let leftovers: Vec<_> = std::fs::read_dir(base)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("harness-import"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");

    // A stream that fails after whole entries went by: nothing visible,
    // the target not even created, no staging directory left.
    let parent = base.parent().unwrap().to_path_buf();
    let before = listing(&parent);
    let s2_before = listing(&base.join("s2"));
    for dir in ["fresh", "s2"] {
        let failing: harness_core::stream::ByteStream = Box::pin(futures::stream::iter(vec![
            Ok(bytes::Bytes::from(archive.clone())),
            Err(harness_core::Error::corrupt("hash mismatch at the end")),
        ]));
        let err = sb.import_tar_staged(dir, failing).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");
    }
    assert!(!base.join("fresh").exists());
    assert_eq!(listing(&base.join("s2")), s2_before);
    assert_eq!(listing(&parent), before);
    sb.destroy().await.unwrap();
}

/// A detached agent still ending (writing its exit file) while its
/// sandbox is destroyed: the removal must not fail on the entry it adds
/// between a directory's listing and its removal.
#[tokio::test]
async fn destroy_right_after_a_detached_launch_succeeds() {
    let dir = tempfile::tempdir().unwrap();
    let provider = LocalProvider::new(dir.path().join("sandboxes"));
    for round in 0..40 {
        let sandbox = provider
            .create(&SandboxSpec::new("/workspace"))
            .await
            .unwrap();
        sandbox
            .spawn_detached(harness_core::sandbox::DetachedRequest {
                argv: vec!["sh".into(), "-c".into(), "echo agent".into()],
                cwd: None,
                env: Default::default(),
                spool_dir: format!("{}/.spool", sandbox.workdir()),
            })
            .await
            .unwrap();
        if let Err(e) = sandbox.destroy().await {
            panic!("round {round}: {e}");
        }
    }
}
