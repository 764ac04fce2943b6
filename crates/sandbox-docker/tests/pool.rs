//! The pool of ready containers (`DockerConfig::pool_size`): a pooled
//! create keeps the sandbox contract, the pool refills, only an identical
//! spec takes a pooled container, and no pooled container outlives
//! `shutdown`, a dropped provider, or a crashed process.

mod common;

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use common::{sh_ok, Cleanup};
use harness_core::sandbox::{NetworkPolicy, SandboxProvider, SandboxSpec};
use harness_testkit::conformance::sandbox::{self as suite, SuiteOptions};
use sandbox_docker::{DockerConfig, DockerProvider};

const SETTLE: Duration = Duration::from_secs(60);

/// Removes every container of a pool instance when dropped, so a failing
/// test leaves none behind.
struct PoolCleanup(String);

impl Drop for PoolCleanup {
    fn drop(&mut self) {
        for id in containers(&self.0) {
            let _ = Command::new("docker").args(["rm", "-f", &id]).output();
        }
    }
}

/// Ids of every container (running or not) labelled with pool `instance`.
fn containers(instance: &str) -> Vec<String> {
    let out = Command::new("docker")
        .args([
            "ps",
            "-a",
            "-q",
            "--no-trunc",
            "--filter",
            &format!("label=dev.harness.pool={instance}"),
        ])
        .output()
        .unwrap();
    assert!(out.status.success());
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect()
}

/// Ids of the containers of pool `instance` still in the pool (named
/// `harness-pool.…`).
fn pooled(instance: &str) -> BTreeSet<String> {
    containers(instance)
        .into_iter()
        .filter(|id| name(id).starts_with("harness-pool."))
        .collect()
}

fn name(id: &str) -> String {
    let out = Command::new("docker")
        .args(["inspect", "-f", "{{.Name}}", id])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .trim_start_matches('/')
        .to_string()
}

fn inspect(id: &str) -> serde_json::Value {
    let out = Command::new("docker")
        .args(["inspect", id])
        .output()
        .unwrap();
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v[0].clone()
}

fn exists(id: &str) -> bool {
    Command::new("docker")
        .args(["inspect", id])
        .output()
        .unwrap()
        .status
        .success()
}

async fn pool_provider(size: usize, max_shapes: usize) -> Option<(DockerProvider, PoolCleanup)> {
    let provider = common::provider_with(DockerConfig {
        pool_size: size,
        pool_max_shapes: max_shapes,
        gate: harness_testkit::gate_binary(),
        ..DockerConfig::default()
    })
    .await?;
    let instance = provider.pool_instance().unwrap().to_string();
    Some((provider, PoolCleanup(instance)))
}

/// The session id is `pool-test` on purpose: its containers are named
/// `harness-pool-test-…`, which must never pass for pooled ones.
fn spec() -> SandboxSpec {
    let mut spec = SandboxSpec::new("/work");
    spec.session_id = Some("pool-test".into());
    spec.env.insert("POOL_TEST".into(), "1".into());
    spec
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pooled_sandbox_keeps_the_sandbox_contract() {
    let Some(gate) = harness_testkit::gate_binary() else {
        return;
    };
    let Some((provider, cleanup)) = pool_provider(1, 8).await else {
        return;
    };
    let instance = cleanup.0.clone();
    let Some(gateway) = common::bridge_gateway(&provider).await else {
        harness_testkit::skip_or_fail("cannot find the docker bridge gateway address");
        return;
    };
    assert!(gate.is_file());
    // (The gateway probe's shape is pooled too.)
    assert!(provider.pool_settled(SETTLE).await);
    let earlier = pooled(&instance);
    let spec = spec();
    let first = provider.create(&spec).await.unwrap();
    let _g1 = Cleanup(Some(first.handle().id.clone()));
    assert!(provider.pool_settled(SETTLE).await);
    let ready: BTreeSet<_> = pooled(&instance).difference(&earlier).cloned().collect();
    assert_eq!(ready.len(), 1, "one container of the shape is ready");
    assert!(!ready.contains(&first.handle().id));
    first.destroy().await.unwrap();

    // This create takes the ready container.
    let sandbox = provider.create(&spec).await.unwrap();
    let _g2 = Cleanup(Some(sandbox.handle().id.clone()));
    let id = sandbox.handle().id.clone();
    assert!(ready.contains(&id), "the create took the pooled container");
    let taken_name = name(&id);
    assert!(
        taken_name.starts_with("harness-pool-test-"),
        "a taken container gets a session's name, got {taken_name}"
    );
    // Same labels, env and workdir as a fresh one.
    let out = Command::new("docker")
        .args([
            "inspect",
            "-f",
            "{{index .Config.Labels \"dev.harness.session-id\"}} {{.Config.WorkingDir}}",
            &id,
        ])
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "pool-test /work"
    );
    assert_eq!(sh_ok(&*sandbox, "echo $POOL_TEST; pwd").await, "1\n/work\n");

    // The sandbox-level items of the suite, on the pooled sandbox.
    let sb = sandbox.as_ref();
    suite::command_and_file_items(sb).await.unwrap();
    suite::tar_round_trip(sb).await.unwrap();
    suite::import_refuses_escaping_entries(sb).await.unwrap();
    sandbox.destroy().await.unwrap();
    assert!(!exists(&id), "destroy removed the taken container");

    // And the suite's provider-level items with the pool on (environment,
    // detach/resume, destroy, a slot's leftover, ports, stop/resume,
    // network policies, forwards): they take pooled containers of their
    // shapes from their second create on. What one sandbox does once it is
    // taken is the plain container's code, which the items above and
    // `conformance.rs`'s whole suite cover.
    let options = SuiteOptions {
        host_address: Some(gateway.into()),
        ..SuiteOptions::default()
    };
    let report = match suite::provider_items(&provider, &spec, &options).await {
        Ok(report) => report,
        Err(e) => panic!("{e:#}"),
    };
    assert_eq!(
        report.capability("network_deny_all"),
        &suite::Capability::Supported,
        "a pooled deny-all container is as cut off as a fresh one"
    );
    assert!(provider.pool_settled(SETTLE).await);
    let removed = provider.shutdown().await.unwrap();
    assert!(removed >= 1, "the shapes of the suite were pooled");
    assert_eq!(
        containers(&instance),
        Vec::<String>::new(),
        "after the suite and shutdown no container of the pool is left"
    );
}

#[tokio::test]
async fn the_pool_refills_and_only_an_identical_spec_takes_from_it() {
    let Some((provider, cleanup)) = pool_provider(2, 16).await else {
        return;
    };
    let instance = cleanup.0.clone();
    let spec = spec();
    let first = provider.create(&spec).await.unwrap();
    let _g = Cleanup(Some(first.handle().id.clone()));
    sh_ok(&*first, "echo dirty > /work/used.txt").await;
    assert!(provider.pool_settled(SETTLE).await);
    let ready = pooled(&instance);
    assert_eq!(ready.len(), 2);
    assert_eq!(provider.pool_ready(), 2);
    let first_id = first.handle().id.clone();
    first.destroy().await.unwrap();
    assert!(
        !pooled(&instance).contains(&first_id),
        "never back to the pool"
    );

    // Specs that differ in one thing each never take a pooled container.
    let mut variants = Vec::new();
    let mut s = spec.clone();
    s.env.insert("POOL_TEST".into(), "2".into());
    variants.push(("env", s));
    let mut s = spec.clone();
    s.workdir = "/other".into();
    variants.push(("workdir", s));
    let mut s = spec.clone();
    s.network = NetworkPolicy::DenyAll;
    variants.push(("network", s));
    let mut s = spec.clone();
    s.labels.insert("team".into(), "x".into());
    variants.push(("labels", s));
    let mut s = spec.clone();
    s.session_id = Some("pool-test-other".into());
    variants.push(("session", s));
    let mut s = spec.clone();
    s.memory_mb = Some(256);
    variants.push(("memory", s));
    let mut s = spec.clone();
    s.image = Some("harness-test-pool-other-tag:never".into());
    variants.push(("image", s));
    for (what, variant) in variants {
        match provider.create(&variant).await {
            Ok(sb) => {
                let id = sb.handle().id.clone();
                let _g = Cleanup(Some(id.clone()));
                assert!(
                    !ready.contains(&id),
                    "a spec with another {what} took a pooled container"
                );
                sb.destroy().await.unwrap();
            }
            // The image variant names an image that does not exist: it must
            // fail like a fresh create, not succeed with a pooled one.
            Err(e) => assert_eq!(what, "image", "{what}: {e}"),
        }
    }
    assert!(provider.pool_settled(SETTLE).await);
    for id in &ready {
        assert!(
            name(id).starts_with("harness-pool."),
            "{id} is still pooled"
        );
    }
    // Now also holding the fills of the variants' shapes.
    let before = pooled(&instance);

    // The identical spec (a slot only changes the name) takes one, gets a
    // clean filesystem, and the shape refills.
    let mut slotted = spec.clone();
    slotted.slot = Some("t1".into());
    let taken = provider.create(&slotted).await.unwrap();
    let taken_id = taken.handle().id.clone();
    let _g = Cleanup(Some(taken_id.clone()));
    assert!(ready.contains(&taken_id), "the identical spec took one");
    assert_eq!(name(&taken_id), "harness-pool-test-slot-t1");
    assert_eq!(
        sh_ok(&*taken, "ls -A /work; echo end").await,
        "end\n",
        "a pooled container was never used"
    );
    assert!(provider.pool_settled(SETTLE).await);
    let after = pooled(&instance);
    let gone: Vec<_> = before.difference(&after).cloned().collect();
    let new: Vec<_> = after.difference(&before).cloned().collect();
    assert_eq!(gone, vec![taken_id.clone()]);
    assert_eq!(new.len(), 1, "one container refilled the shape: {new:?}");
    let info = inspect(&new[0]);
    let config = &info["Config"];
    assert!(config["Env"]
        .as_array()
        .unwrap()
        .contains(&"POOL_TEST=1".into()));
    assert_eq!(config["WorkingDir"], "/work");
    assert_eq!(config["Image"], common::image());
    assert_eq!(config["Labels"]["dev.harness.session-id"], "pool-test");
    assert!(config["Labels"].get("team").is_none());
    assert_ne!(info["HostConfig"]["NetworkMode"], "none");
    assert_eq!(info["HostConfig"]["Memory"], 0);
    taken.destroy().await.unwrap();
    provider.shutdown().await.unwrap();
    assert_eq!(containers(&instance), Vec::<String>::new());
}

#[tokio::test]
async fn a_stopped_pooled_container_is_never_handed_out() {
    let Some((provider, cleanup)) = pool_provider(1, 4).await else {
        return;
    };
    let instance = cleanup.0.clone();
    let spec = spec();
    provider
        .create(&spec)
        .await
        .unwrap()
        .destroy()
        .await
        .unwrap();
    assert!(provider.pool_settled(SETTLE).await);
    let ready: Vec<_> = pooled(&instance).into_iter().collect();
    assert_eq!(ready.len(), 1);
    // As a dockerd restart or someone's `docker stop` would.
    let out = Command::new("docker")
        .args(["stop", &ready[0]])
        .output()
        .unwrap();
    assert!(out.status.success());
    let sandbox = provider.create(&spec).await.unwrap();
    let _g = Cleanup(Some(sandbox.handle().id.clone()));
    assert_ne!(sandbox.handle().id, ready[0]);
    assert_eq!(sh_ok(&*sandbox, "echo ok").await, "ok\n");
    assert!(!exists(&ready[0]), "the stopped one was removed");
    sandbox.destroy().await.unwrap();
    provider.shutdown().await.unwrap();
    assert_eq!(containers(&instance), Vec::<String>::new());
}

#[tokio::test]
async fn shutdown_removes_the_pool_and_leaves_taken_sandboxes() {
    let Some((provider, cleanup)) = pool_provider(2, 4).await else {
        return;
    };
    let instance = cleanup.0.clone();
    let spec = spec();
    provider
        .create(&spec)
        .await
        .unwrap()
        .destroy()
        .await
        .unwrap();
    assert!(provider.pool_settled(SETTLE).await);
    assert_eq!(pooled(&instance).len(), 2);
    let taken = provider.create(&spec).await.unwrap();
    let _g = Cleanup(Some(taken.handle().id.clone()));
    // No settle: the refill is in flight while we shut down.
    let removed = provider.shutdown().await.unwrap();
    assert!(removed >= 1, "removed {removed}");
    assert_eq!(
        containers(&instance),
        vec![taken.handle().id.clone()],
        "only the taken sandbox is left"
    );
    assert_eq!(sh_ok(&*taken, "echo alive").await, "alive\n");
    // Creates still work, without a pool.
    let fresh = provider.create(&spec).await.unwrap();
    let _g2 = Cleanup(Some(fresh.handle().id.clone()));
    fresh.destroy().await.unwrap();
    taken.destroy().await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(containers(&instance), Vec::<String>::new());
    assert_eq!(provider.pool_ready(), 0);
}

#[tokio::test]
async fn dropping_the_provider_removes_its_pool() {
    let spec = spec();
    // Settled pool: the drop removes it before it returns.
    let Some((provider, cleanup)) = pool_provider(2, 4).await else {
        return;
    };
    let instance = cleanup.0.clone();
    let clone = provider.clone();
    provider
        .create(&spec)
        .await
        .unwrap()
        .destroy()
        .await
        .unwrap();
    assert!(provider.pool_settled(SETTLE).await);
    assert_eq!(pooled(&instance).len(), 2);
    drop(provider);
    assert_eq!(pooled(&instance).len(), 2, "a clone still holds the pool");
    drop(clone);
    assert_eq!(containers(&instance), Vec::<String>::new());

    // Fills in flight: each removes its container when it finds the pool
    // gone.
    let Some((provider, cleanup)) = pool_provider(2, 4).await else {
        return;
    };
    let instance = cleanup.0.clone();
    provider
        .create(&spec)
        .await
        .unwrap()
        .destroy()
        .await
        .unwrap();
    drop(provider);
    let mut left = containers(&instance);
    for _ in 0..100 {
        if left.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        left = containers(&instance);
    }
    assert_eq!(left, Vec::<String>::new());
}

/// The `pool_crash` example binary (built with the tests; on demand
/// otherwise).
fn crash_example() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let path = exe
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("examples")
        .join("pool_crash");
    if !path.exists() {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let status = Command::new(cargo)
            .args(["build", "-p", "sandbox-docker", "--example", "pool_crash"])
            .status()
            .unwrap();
        assert!(status.success(), "building the pool_crash example failed");
    }
    path
}

#[tokio::test]
async fn a_crashed_process_leaves_its_pool_to_the_next_provider() {
    // A live provider's pool must survive the reaping.
    let Some((live, live_cleanup)) = pool_provider(1, 4).await else {
        return;
    };
    live.create(&spec()).await.unwrap().destroy().await.unwrap();
    assert!(live.pool_settled(SETTLE).await);
    assert_eq!(pooled(&live_cleanup.0).len(), 1);

    let out = Command::new(crash_example())
        .arg("2")
        .env("HARNESS_TEST_IMAGE", common::image())
        .output()
        .unwrap();
    let instance = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let _cleanup = PoolCleanup(instance.clone());
    // SIGABRT, not an error exit: its pool was full when it crashed.
    use std::os::unix::process::ExitStatusExt;
    assert!(
        out.status.signal() == Some(6) && instance.len() == 12,
        "the example should fill its pool, print it and abort: {:?} {instance:?} {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    // (Another provider connecting meanwhile, in a parallel test, may
    // already have reaped them.)
    let left = pooled(&instance).len();
    assert!(left <= 2, "the crash left {left}");

    // The next provider (pool or not) reaps them at connect. A create the
    // crashed process had in flight may land in the daemon after that reap
    // (seen once under load: one container left): reaping again takes it,
    // as the next connect would. Bounded: 40 rounds of 0.5 s.
    let next = common::provider().await.unwrap();
    for _ in 0..40 {
        if containers(&instance).is_empty() {
            break;
        }
        next.reap_pool_leftovers().await.unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    }
    assert_eq!(containers(&instance), Vec::<String>::new());
    assert_eq!(
        pooled(&live_cleanup.0).len(),
        1,
        "the live provider's pool is kept"
    );
    assert_eq!(next.reap_pool_leftovers().await.unwrap(), 0);
    live.shutdown().await.unwrap();
    assert_eq!(containers(&live_cleanup.0), Vec::<String>::new());
}

/// Serve one-line HTTP answers `body` on a Unix socket at `path` until
/// the task is aborted (a model broker's session socket, as a container
/// reaches it through its forward).
fn serve_socket(path: &std::path::Path, body: &'static str) -> tokio::task::JoinHandle<()> {
    use std::os::unix::fs::PermissionsExt;
    let _ = std::fs::remove_file(path);
    let listener = tokio::net::UnixListener::bind(path).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666)).unwrap();
    tokio::spawn(async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        while let Ok((mut conn, _)) = listener.accept().await {
            let mut buf = [0u8; 1024];
            let _ = conn.read(&mut buf).await;
            let reply = format!(
                "HTTP/1.0 200 OK\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            );
            let _ = conn.write_all(reply.as_bytes()).await;
            let _ = conn.shutdown().await;
        }
    })
}

/// What `127.0.0.1:47811` answers inside the sandbox (the body).
async fn through_forward(sandbox: &dyn harness_core::sandbox::Sandbox) -> String {
    let out = sh_ok(
        sandbox,
        "timeout 10 bash -c 'exec 3<>/dev/tcp/127.0.0.1/47811 && printf \"GET / HTTP/1.0\\r\\n\\r\\n\" >&3 && cat <&3'",
    )
    .await;
    out.rsplit("\r\n\r\n")
        .next()
        .unwrap_or_default()
        .to_string()
}

/// A session spec as the runtime makes it with a model broker: the
/// session's id, deny-all, and its socket directory's forward.
fn session_spec(session: &str, socket: &std::path::Path) -> SandboxSpec {
    let mut spec = SandboxSpec::new("/work");
    spec.session_id = Some(session.into());
    spec.slot = Some("t1".into());
    spec.network = NetworkPolicy::DenyAll;
    spec.forwards = vec![harness_core::sandbox::HostForward {
        port: 47811,
        socket: socket.to_string_lossy().into_owned(),
    }];
    spec
}

/// With `pool_forward_dir`, a session takes a container pooled before it
/// existed: its socket moves into the container's own forward directory,
/// a server binding the socket again through the session's path is seen
/// inside, and `destroy` gives the session its directory back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_take_containers_pooled_before_them_and_keep_their_sockets() {
    if harness_testkit::gate_binary().is_none() {
        return;
    }
    // Sockets and pool directories on one filesystem (the temp dir's).
    let tmp = tempfile::tempdir().unwrap();
    let pool_root = tmp.path().join("pool");
    let Some(provider) = common::provider_with(DockerConfig {
        pool_size: 1,
        gate: harness_testkit::gate_binary(),
        pool_forward_dir: Some(pool_root.clone()),
        exec_dir: Some(tmp.path().join("exec")),
        ..DockerConfig::default()
    })
    .await
    else {
        return;
    };
    let instance = provider.pool_instance().unwrap().to_string();
    let _cleanup = PoolCleanup(instance.clone());
    let sessions = tmp.path().join("sessions");
    let (dir_a, dir_b) = (sessions.join("pool-fwd-a"), sessions.join("pool-fwd-b"));
    for d in [&dir_a, &dir_b] {
        std::fs::create_dir_all(d).unwrap();
    }
    let server_a = serve_socket(&dir_a.join("model.sock"), "a");
    let server_b = serve_socket(&dir_b.join("model.sock"), "b1");

    // Session a's create is fresh, and fills the pool with its shape
    // less the session.
    let a = provider
        .create(&session_spec("pool-fwd-a", &dir_a.join("model.sock")))
        .await
        .unwrap();
    let _ga = Cleanup(Some(a.handle().id.clone()));
    assert_eq!(through_forward(a.as_ref()).await, "a");
    assert!(provider.pool_settled(SETTLE).await);
    let ready = pooled(&instance);
    assert_eq!(ready.len(), 1, "one container pooled for any session");

    // Session b takes it.
    let b = provider
        .create(&session_spec("pool-fwd-b", &dir_b.join("model.sock")))
        .await
        .unwrap();
    let _gb = Cleanup(Some(b.handle().id.clone()));
    let b_id = b.handle().id.clone();
    assert!(ready.contains(&b_id), "session b took the pooled container");
    assert_eq!(name(&b_id), "harness-pool-fwd-b-slot-t1");
    assert!(
        std::fs::symlink_metadata(&dir_b)
            .unwrap()
            .file_type()
            .is_symlink(),
        "b's socket directory now leads into the container's"
    );
    assert_eq!(through_forward(b.as_ref()).await, "b1");
    // b's commands go through the pooled container's own exec server.
    let exec_dir_of = |s: &dyn harness_core::sandbox::Sandbox| {
        s.handle().data["exec_dir"].as_str().map(str::to_string)
    };
    assert!(exec_dir_of(b.as_ref()).is_some());
    assert_ne!(exec_dir_of(a.as_ref()), exec_dir_of(b.as_ref()));
    let since = common::unix_now();
    assert_eq!(sh_ok(b.as_ref(), "echo served").await, "served\n");
    assert_eq!(common::engine_execs(&provider, &b_id, since).await, 0);
    // Both know their `$HOME` without asking, and know it right.
    for sandbox in [&a, &b] {
        let home = sh_ok(sandbox.as_ref(), "printf %s \"$HOME\"").await;
        assert_eq!(sandbox.home_hint().as_deref(), Some(home.as_str()));
    }
    // a's container is a's alone: its answer is still a's.
    assert_eq!(through_forward(a.as_ref()).await, "a");

    // The server restarts and binds again through b's path: seen inside.
    server_b.abort();
    let _ = server_b.await;
    let server_b2 = serve_socket(&dir_b.join("model.sock"), "b2");
    assert_eq!(through_forward(b.as_ref()).await, "b2");
    // So does a resume from the handle (another process, a later slice).
    let resumed = provider.resume(&b.handle()).await.unwrap();
    assert_eq!(through_forward(resumed.as_ref()).await, "b2");

    // Destroy: b's directory is a directory again, holding its socket.
    b.destroy().await.unwrap();
    assert!(!exists(&b_id));
    assert!(std::fs::symlink_metadata(&dir_b).unwrap().is_dir());
    std::os::unix::net::UnixStream::connect(dir_b.join("model.sock"))
        .expect("b's socket answers at its own path again");
    a.destroy().await.unwrap();
    assert!(provider.pool_settled(SETTLE).await);
    provider.shutdown().await.unwrap();
    let left: Vec<_> = std::fs::read_dir(&pool_root)
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert!(left.is_empty(), "pool directories left: {left:?}");
    let left: Vec<_> = std::fs::read_dir(tmp.path().join("exec"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert!(left.is_empty(), "exec directories left: {left:?}");
    server_a.abort();
    server_b2.abort();
}
