//! The sealed local sandbox against the real bubblewrap, util-linux and
//! slirp4netns: the conformance suite, and the boundary itself — what a
//! command inside cannot see, reach or become.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use harness_core::sandbox::{
    collect_exec, ExecOutput, ExecRequest, NetworkPolicy, Sandbox, SandboxProvider, SandboxSpec,
};
use harness_testkit::conformance::sandbox as suite;
use sandbox_local::{Isolation, LocalProvider};

/// A provider root the sandbox uid can reach (tempfile makes 0700
/// directories), or `None` after a skip when this host cannot seal.
fn sealed(root: &Path) -> Option<LocalProvider> {
    if !nix::unistd::geteuid().is_root() {
        harness_testkit::skip_or_fail(
            "the sealed local sandbox's tests run as root here (cgroup limits, a uid to drop to)",
        );
        return None;
    }
    for tool in ["bwrap", "slirp4netns", "nsenter", "setpriv"] {
        let found = std::env::var_os("PATH")
            .map(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()))
            .unwrap_or(false);
        if !found {
            harness_testkit::skip_or_fail(&format!(
                "{tool} is not installed (cargo xtask deps: bubblewrap, slirp4netns, util-linux)"
            ));
            return None;
        }
    }
    std::fs::set_permissions(root, std::fs::Permissions::from_mode(0o755)).unwrap();
    Some(
        LocalProvider::new(root)
            .with_gate(harness_testkit::gate_binary()?)
            .with_isolation(Isolation::Sealed),
    )
}

async fn sh(sb: &dyn Sandbox, script: &str) -> ExecOutput {
    collect_exec(sb.exec(ExecRequest::shell(script)).await.unwrap())
        .await
        .unwrap()
}

fn nothing_left(root: &Path) -> Vec<std::ffi::OsString> {
    std::fs::read_dir(root)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sealed_sandbox_keeps_the_sandbox_contract() {
    let root = tempfile::tempdir().unwrap();
    let Some(provider) = sealed(root.path()) else {
        return;
    };
    let (_server, spec) = suite::deny_all_with_a_forward().await.unwrap();
    if let Err(e) = suite::contract_items(&provider, &spec).await {
        panic!("{e:#}");
    }
    assert!(
        nothing_left(root.path()).is_empty(),
        "{:?}",
        nothing_left(root.path())
    );
}

/// What the boundary asks for, tried from inside one session: the
/// harness home's secret, another session's tree and socket, host
/// processes' environments, root — none is reachable, and a canary key of
/// the harness's own environment appears nowhere inside.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sealed_command_reaches_nothing_of_the_host_or_another_session() {
    let root = tempfile::tempdir().unwrap();
    let Some(provider) = sealed(root.path()) else {
        return;
    };
    // A harness home beside the sandboxes, with a broker secret and a
    // session's model socket, as `harness serve` keeps them.
    let home = tempfile::tempdir().unwrap();
    std::fs::set_permissions(home.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let secret = home.path().join("broker/secret");
    std::fs::create_dir_all(secret.parent().unwrap()).unwrap();
    std::fs::write(&secret, "broker-secret-canary").unwrap();
    let socket = home.path().join("broker/sessions/other/model.sock");
    std::fs::create_dir_all(socket.parent().unwrap()).unwrap();
    let _listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    // The canary: a model key in the harness's environment (the holder and
    // every command start from an environment of their own).
    let canary = "sk-ant-canary-3f1c9e";
    std::env::set_var("ANTHROPIC_API_KEY", canary);

    let spec = SandboxSpec::new("/workspace");
    let a = provider.create(&spec).await.unwrap();
    let b = provider.create(&spec).await.unwrap();
    let b_file = PathBuf::from(b.workdir()).join("private.txt");
    std::fs::write(&b_file, "b's tree").unwrap();

    let probe = format!(
        "cat {secret} 2>&1; echo \"secret:$?\"; \
         cat {b_file} 2>&1; echo \"b-read:$?\"; \
         echo x > {b_file} 2>&1; echo \"b-write:$?\"; \
         test -e {socket}; echo \"socket:$?\"; \
         ls /proc | grep -c '^[0-9]' ; \
         cat /proc/1/environ /proc/*/environ 2>/dev/null | tr '\\0' '\\n' | grep -c {canary}; \
         env | grep -c {canary}; \
         grep -rl {canary} / --exclude-dir=proc --exclude-dir=sys --exclude-dir=usr 2>/dev/null | head -3; \
         id -u; grep NoNewPrivs /proc/self/status",
        secret = secret.display(),
        b_file = b_file.display(),
        socket = socket.display(),
    );
    let out = sh(a.as_ref(), &probe).await;
    let text = out.stdout_str();
    let lines: Vec<&str> = text.lines().collect();
    assert!(
        text.contains("secret:1") || text.contains("secret:2"),
        "{text}"
    );
    assert!(!text.contains("broker-secret-canary"), "{text}");
    assert!(!text.contains("b's tree"), "{text}");
    assert!(
        text.contains("b-read:1") || text.contains("b-read:2"),
        "{text}"
    );
    assert!(!text.contains("b-write:0"), "{text}");
    assert_eq!(std::fs::read_to_string(&b_file).unwrap(), "b's tree");
    assert!(text.contains("socket:1"), "{text}");
    // Only the sandbox's own processes: its init, the holder's sleep, this
    // shell and its pipeline — never the host's hundreds.
    let procs: usize = lines
        .iter()
        .find(|l| l.parse::<usize>().is_ok())
        .unwrap()
        .parse()
        .unwrap();
    assert!(procs < 20, "{procs} processes visible: {text}");
    assert!(!text.contains(canary), "{text}");
    let uid: u32 = lines[lines.len() - 2].trim().parse().unwrap();
    assert_ne!(uid, 0, "{text}");
    assert!(lines.last().unwrap().contains('1'), "{text}");
    // As the host sees it: what the command made belongs to that uid.
    sh(a.as_ref(), "echo made > mine.txt").await;
    let made = std::fs::metadata(PathBuf::from(a.workdir()).join("mine.txt")).unwrap();
    assert_eq!(made.uid(), uid);
    assert_ne!(made.uid(), 0);
    // And the harness's writes are the sandbox's to change.
    a.write_file("given.txt", harness_core::stream::once("given"))
        .await
        .unwrap();
    let out = sh(a.as_ref(), "echo changed >> given.txt && cat given.txt").await;
    assert_eq!(out.stdout_str(), "givenchanged\n", "{}", out.stderr_str());
    // The harness acting for the sandbox reaches no more than it does.
    // (Its /tmp is its own: the home under the host's /tmp is not there.)
    let err = a
        .read_file(&secret.display().to_string())
        .await
        .err()
        .unwrap();
    assert_eq!(err.kind(), harness_core::ErrorKind::NotFound, "{err}");
    let err = a.read_file("/etc/shadow").await.err().unwrap();
    assert_eq!(err.kind(), harness_core::ErrorKind::Unsafe, "{err}");
    let err = a
        .write_file("/etc/harness-was-here", harness_core::stream::once("x"))
        .await
        .err()
        .unwrap();
    assert_eq!(err.kind(), harness_core::ErrorKind::Unsafe, "{err}");
    assert!(!Path::new("/etc/harness-was-here").exists());
    a.destroy().await.unwrap();
    b.destroy().await.unwrap();
    assert!(nothing_left(root.path()).is_empty());
}

/// `memory_mb` is a cgroup limit: a hog is killed at it, and the exec says
/// why; a detached process is held by the same limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_memory_hog_is_killed_at_the_sandbox_limit() {
    let root = tempfile::tempdir().unwrap();
    let Some(provider) = sealed(root.path()) else {
        return;
    };
    let mut spec = SandboxSpec::new("/workspace");
    spec.memory_mb = Some(64);
    spec.cpus = Some(0.5);
    let sb = provider.create(&spec).await.unwrap();
    // `tail -n 1` holds the one (newline-free) line in memory.
    let out = sh(
        sb.as_ref(),
        "head -c 268435456 /dev/zero | tail -n 1 >/dev/null; echo after",
    )
    .await;
    assert_eq!(out.status.signal, None, "the shell itself survives");
    let out = collect_exec(
        sb.exec(ExecRequest::shell("exec tail -n 1 < /dev/zero"))
            .await
            .unwrap(),
    )
    .await
    .unwrap();
    assert_eq!(out.status.signal, Some(9), "{out:?}");
    assert!(
        out.stderr_str().contains("memory limit (64 MiB)"),
        "{}",
        out.stderr_str()
    );
    // A small command still runs.
    assert_eq!(sh(sb.as_ref(), "echo ok").await.stdout_str(), "ok\n");
    sb.destroy().await.unwrap();
    assert!(nothing_left(root.path()).is_empty());
}

/// `allow-all` in a sealed sandbox is a user-mode network: the host's
/// other addresses answer, its loopback (the broker's TCP port, any local
/// service) does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allow_all_reaches_out_but_not_the_hosts_loopback() {
    let root = tempfile::tempdir().unwrap();
    let Some(provider) = sealed(root.path()) else {
        return;
    };
    // A host address that is not loopback: the one a route to a
    // documentation address would leave from (no packet is sent).
    let probe = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
    let Ok(()) = probe.connect("192.0.2.1:9") else {
        harness_testkit::skip_or_fail("this host has no non-loopback address to serve on");
        return;
    };
    let host_ip = probe.local_addr().unwrap().ip();
    if host_ip.is_loopback() || host_ip.is_unspecified() {
        harness_testkit::skip_or_fail("this host has no non-loopback address to serve on");
        return;
    }
    let outside = tokio::net::TcpListener::bind((host_ip, 0)).await.unwrap();
    let loopback = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let (outside_port, loop_port) = (
        outside.local_addr().unwrap().port(),
        loopback.local_addr().unwrap().port(),
    );
    tokio::spawn(async move {
        while let Ok((mut c, _)) = outside.accept().await {
            use tokio::io::AsyncWriteExt;
            let _ = c.write_all(b"hello from the host\n").await;
        }
    });
    let mut spec = SandboxSpec::new("/workspace");
    spec.network = NetworkPolicy::AllowAll;
    let sb = provider.create(&spec).await.unwrap();
    let out = sh(
        sb.as_ref(),
        &format!(
            "timeout 5 bash -c 'head -1 < /dev/tcp/{host_ip}/{outside_port}'; echo \"out:$?\"; \
             timeout 5 bash -c 'echo > /dev/tcp/127.0.0.1/{loop_port}' 2>/dev/null; echo \"loop:$?\""
        ),
    )
    .await;
    let text = out.stdout_str();
    assert!(
        text.contains("hello from the host"),
        "{text}{}",
        out.stderr_str()
    );
    assert!(!text.contains("loop:0"), "{text}");
    drop(loopback);
    sb.destroy().await.unwrap();
    assert!(nothing_left(root.path()).is_empty());
}
