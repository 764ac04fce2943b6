//! What the conformance suite does not cover: the network policies as this
//! provider enforces them (forwards and custom are the suite's), what it
//! refuses, a VM outliving the process that
//! made it, and bootstrap once per identity through a disk snapshot.

mod common;

use std::time::Duration;

use harness_core::bootstrap::{BootstrapRecipe, FileSource, RecipeFile};
use harness_core::sandbox::{
    HostForward, NetworkPolicy, SandboxHandle, SandboxProvider, SandboxSpec,
};
use harness_core::ErrorKind;
use tokio::io::AsyncWriteExt;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allow_all_reaches_the_host_and_deny_all_nothing() {
    let Some((provider, _state)) = common::provider() else {
        return;
    };
    // A server on the host's loopback only: user-mode networking maps
    // 10.0.2.2 in the guest to it.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let server = tokio::spawn(async move {
        for _ in 0..4 {
            let Ok(Ok((mut s, _))) =
                tokio::time::timeout(Duration::from_secs(120), listener.accept()).await
            else {
                return;
            };
            let _ = s.write_all(b"hello-from-host\n").await;
        }
    });
    let probe = format!(
        "python3 -c 'import socket; s=socket.create_connection((\"10.0.2.2\", {port}), timeout=5); print(s.recv(100).decode().strip())'"
    );

    let open = provider.create(&SandboxSpec::new("/work")).await.unwrap();
    let out = common::sh(open.as_ref(), &probe).await;
    assert!(out.status.success(), "{}", out.stderr_str());
    assert_eq!(out.stdout_str().trim(), "hello-from-host");
    open.destroy().await.unwrap();

    let mut spec = SandboxSpec::new("/work");
    spec.network = NetworkPolicy::DenyAll;
    let closed = provider.create(&spec).await.unwrap();
    let out = common::sh(closed.as_ref(), "ls /sys/class/net").await;
    assert_eq!(
        out.stdout_str().split_whitespace().collect::<Vec<_>>(),
        ["lo"],
        "deny-all has no NIC"
    );
    let out = common::sh(closed.as_ref(), &probe).await;
    assert!(
        !out.status.success(),
        "deny-all reached the host: {}",
        out.stdout_str()
    );
    closed.destroy().await.unwrap();
    server.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_specs_and_foreign_handles_are_refused_clearly() {
    let Some((provider, _state)) = common::provider() else {
        return;
    };
    let mut spec = SandboxSpec::new("/work");
    spec.network = NetworkPolicy::Custom {
        allowed_hosts: vec!["example.com".into()],
        allowed_cidrs: vec![],
        denied_cidrs: vec![],
        allowed_ports: vec![],
    };
    // Custom needs the egress proxy's forward: nothing else leaves the VM.
    let err = provider.create(&spec).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
    assert!(err.to_string().contains("47812"), "{err}");

    let mut spec = SandboxSpec::new("/work");
    spec.forwards = vec![
        HostForward {
            port: 47811,
            socket: "/tmp/x.sock".into(),
        },
        HostForward {
            port: 47811,
            socket: "/tmp/y.sock".into(),
        },
    ];
    let err = provider.create(&spec).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");

    let mut spec = SandboxSpec::new("/work");
    spec.wrap = Some("vm".into());
    assert_eq!(
        provider.create(&spec).await.unwrap_err().kind(),
        ErrorKind::Unsupported
    );

    let mut spec = SandboxSpec::new("/work");
    spec.network = NetworkPolicy::DenyAll;
    spec.ports = vec![8080];
    assert_eq!(
        provider.create(&spec).await.unwrap_err().kind(),
        ErrorKind::InvalidInput
    );

    let foreign = SandboxHandle {
        provider: "docker".into(),
        id: "x".into(),
        workdir: "/".into(),
        owned: true,
        data: serde_json::Value::Null,
    };
    assert_eq!(
        provider.resume(&foreign).await.unwrap_err().kind(),
        ErrorKind::InvalidInput
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cpus_and_memory_reach_the_guest() {
    let Some((provider, _state)) = common::provider() else {
        return;
    };
    let mut spec = SandboxSpec::new("/work");
    spec.cpus = Some(2.0);
    spec.memory_mb = Some(700);
    let sb = provider.create(&spec).await.unwrap();
    let out = common::sh(
        sb.as_ref(),
        "nproc; awk '/MemTotal/ {print $2}' /proc/meminfo",
    )
    .await;
    let text = out.stdout_str();
    let mut lines = text.lines();
    assert_eq!(lines.next(), Some("2"));
    let kib: u64 = lines.next().unwrap().trim().parse().unwrap();
    assert!(
        (500_000..=716_800).contains(&kib),
        "MemTotal {kib} KiB for 700 MiB"
    );
    sb.destroy().await.unwrap();
}

/// The child half of `a_vm_outlives_the_process_that_made_it`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "started by a_vm_outlives_the_process_that_made_it"]
async fn child_creates_a_vm() {
    let state = std::env::var("MICROVM_CHILD_STATE").expect("run by the parent test");
    let provider = common::provider_in(state).expect("provider in child");
    let sb = provider.create(&SandboxSpec::new("/work")).await.unwrap();
    let out = common::sh(sb.as_ref(), "echo made-by-child > /work/child.txt").await;
    assert!(out.status.success());
    let handle = sb.detach().await.unwrap();
    println!("HANDLE={}", serde_json::to_string(&handle).unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vm_outlives_the_process_that_made_it() {
    let Some((provider, state)) = common::provider() else {
        return;
    };
    let exe = std::env::current_exe().unwrap();
    let state_path = state.path().to_path_buf();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(exe)
            .args([
                "child_creates_a_vm",
                "--exact",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("MICROVM_CHILD_STATE", state_path)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "child failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json = stdout
        .lines()
        .find_map(|l| l.find("HANDLE=").map(|i| &l[i + 7..]))
        .expect("child printed its handle");
    let handle: SandboxHandle = serde_json::from_str(json).unwrap();
    // The child process is gone; its VM still runs and keeps its files.
    let sb = provider.resume(&handle).await.unwrap();
    let out = common::sh(sb.as_ref(), "cat /work/child.txt").await;
    assert_eq!(out.stdout_str(), "made-by-child\n");
    sb.destroy().await.unwrap();
    let err = provider.resume(&handle).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotFound, "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bootstrap_runs_once_per_identity_from_a_disk_snapshot() {
    let Some((provider, _state)) = common::provider() else {
        return;
    };
    let host_file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(host_file.path(), b"#!/bin/sh\necho tool-ran\n").unwrap();
    let sha = {
        use std::io::Read;
        let mut f = std::fs::File::open(host_file.path()).unwrap();
        let mut buf = Vec::new();
        f.read_to_end(&mut buf).unwrap();
        let out = std::process::Command::new("sha256sum")
            .arg(host_file.path())
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .next()
            .unwrap()
            .to_string()
    };
    let recipe = BootstrapRecipe {
        files: vec![
            RecipeFile {
                path: "/opt/tool/bin/tool".into(),
                mode: 0o755,
                source: FileSource::HostPath {
                    path: host_file.path().display().to_string(),
                    sha256: sha,
                },
            },
            RecipeFile {
                path: "/etc/harness-recipe.txt".into(),
                mode: 0o600,
                source: FileSource::Inline {
                    text: "inline".into(),
                },
            },
        ],
        bootstrap_pre_commands: vec!["echo run >> /var/bootstrap-runs".into()],
        commands: vec![],
    };
    let mut spec = SandboxSpec::new("/work");
    spec.bootstrap = Some(recipe.clone());
    let a = provider.create(&spec).await.unwrap();
    let b = provider.create(&spec).await.unwrap();
    for sb in [&a, &b] {
        let out = common::sh(
            sb.as_ref(),
            "/opt/tool/bin/tool; wc -l < /var/bootstrap-runs; stat -c %a /etc/harness-recipe.txt",
        )
        .await;
        assert_eq!(
            out.stdout_str(),
            "tool-ran\n1\n600\n",
            "{}",
            out.stderr_str()
        );
    }
    // Sessions' disks are separate overlays on the one snapshot.
    common::sh(a.as_ref(), "echo only-a > /work/a.txt").await;
    let out = common::sh(
        b.as_ref(),
        "test -e /work/a.txt && echo shared || echo separate",
    )
    .await;
    assert_eq!(out.stdout_str(), "separate\n");
    let snaps = provider.list_snapshots().await.unwrap();
    assert_eq!(snaps.len(), 1, "{snaps:?}");
    assert!(snaps[0].identity.starts_with("bs-"));
    // In use: prune keeps it.
    assert!(provider.prune_snapshots(&[]).await.unwrap().is_empty());
    a.destroy().await.unwrap();
    b.destroy().await.unwrap();
    let removed = provider.prune_snapshots(&[]).await.unwrap();
    assert_eq!(removed.len(), 1);
    assert!(provider.list_snapshots().await.unwrap().is_empty());
}
