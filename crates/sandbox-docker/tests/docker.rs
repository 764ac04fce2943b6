//! The Docker sandbox against the real engine.

mod common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{provider, provider_with, sh, sh_ok, Cleanup};
use futures::StreamExt;
use harness_core::sandbox::{
    collect_exec, ExecEvent, ExecRequest, ExitReason, HostForward, NetworkPolicy, SandboxProvider,
    SandboxSpec, EGRESS_PROXY_PORT, MODEL_BROKER_PORT,
};
use harness_core::stream::{collect, once, AbortSignal, ByteStream};
use harness_core::ErrorKind;
use harness_testkit::conformance::sandbox::{self as suite, SocketServer};
use sandbox_docker::{BindMount, DockerConfig, FORWARD_DIRS_IN_CONTAINER, GATE_IN_CONTAINER};

fn spec() -> SandboxSpec {
    let mut spec = SandboxSpec::new("/work/project");
    spec.session_id = Some(format!("test-{}", uuid::Uuid::new_v4().simple()));
    spec
}

#[tokio::test]
async fn exec_streams_output_env_cwd_stdin_and_exit_code() {
    let Some(p) = provider().await else { return };
    let mut spec = spec();
    spec.env.insert("FROM_SPEC".into(), "spec value".into());
    let sb = p.create(&spec).await.unwrap();
    let _c = Cleanup(Some(sb.handle().id));

    // The workdir was created and is the default cwd.
    assert_eq!(sh_ok(&*sb, "pwd").await, "/work/project\n");
    let out = collect_exec(
        sb.exec(
            ExecRequest::shell("echo out; echo err >&2; echo \"$FROM_SPEC/$FROM_REQ\"; exit 3")
                .env("FROM_REQ", "req"),
        )
        .await
        .unwrap(),
    )
    .await
    .unwrap();
    assert_eq!(out.stdout_str(), "out\nspec value/req\n");
    assert_eq!(out.stderr_str(), "err\n");
    assert_eq!(out.status.code, Some(3));
    assert_eq!(out.status.reason, ExitReason::Exited);

    // stdin is delivered and then closed (cat ends).
    let out = collect_exec(
        sb.exec(ExecRequest::new(["cat"]).stdin(Bytes::from_static(b"piped\x00bytes")))
            .await
            .unwrap(),
    )
    .await
    .unwrap();
    assert_eq!(&out.stdout[..], b"piped\x00bytes");
    // No stdin means an empty one, not a hang.
    let out = collect_exec(sb.exec(ExecRequest::new(["cat"])).await.unwrap())
        .await
        .unwrap();
    assert!(out.status.success() && out.stdout.is_empty());

    // cwd is relative to the workdir; a missing program is exit 127.
    sh_ok(&*sb, "mkdir -p sub").await;
    let out = collect_exec(sb.exec(ExecRequest::new(["pwd"]).cwd("sub")).await.unwrap())
        .await
        .unwrap();
    assert_eq!(out.stdout_str(), "/work/project/sub\n");
    let out = collect_exec(
        sb.exec(ExecRequest::new(["no-such-program-xyz"]))
            .await
            .unwrap(),
    )
    .await
    .unwrap();
    assert_eq!(out.status.code, Some(127));

    // Output arrives as it is produced, not at the end: the command waits
    // for a gate that is only opened once its first line has arrived (held
    // back, the line would come after the command gives up, 30 s later).
    let mut stream = sb
        .exec(ExecRequest::shell(
            "echo first; i=0; while [ ! -e /tmp/gate ] && [ $i -lt 600 ]; do sleep 0.05; i=$((i+1)); done; echo second",
        ))
        .await
        .unwrap();
    let first = tokio::time::timeout(Duration::from_secs(20), stream.next())
        .await
        .expect("the first line was held back")
        .unwrap()
        .unwrap();
    assert_eq!(first, ExecEvent::Stdout(Bytes::from_static(b"first\n")));
    let opened = collect_exec(
        sb.exec(ExecRequest::shell("touch /tmp/gate"))
            .await
            .unwrap(),
    )
    .await
    .unwrap();
    assert!(opened.status.success());
    let rest = collect_exec(stream).await.unwrap();
    assert_eq!(rest.stdout_str(), "second\n");
    sb.destroy().await.unwrap();
    sb.destroy().await.unwrap(); // idempotent
}

#[tokio::test]
async fn abort_kills_the_whole_process_tree() {
    let Some(p) = provider().await else { return };
    let sb = p.create(&spec()).await.unwrap();
    let _c = Cleanup(Some(sb.handle().id));
    let abort = AbortSignal::new();
    let mut stream = sb
        .exec(
            ExecRequest::shell("sleep 301 & sh -c 'sleep 302' & echo started; wait")
                .abort(abort.clone()),
        )
        .await
        .unwrap();
    match stream.next().await.unwrap().unwrap() {
        ExecEvent::Stdout(b) => assert_eq!(&b[..], b"started\n"),
        other => panic!("unexpected {other:?}"),
    }
    assert_eq!(
        sh_ok(&*sb, "ps -eo args | grep -c '^sleep 30[12]'")
            .await
            .trim(),
        "2"
    );
    abort.abort();
    let mut exit = None;
    while let Some(ev) = stream.next().await {
        if let ExecEvent::Exit(s) = ev.unwrap() {
            exit = Some(s);
        }
    }
    let exit = exit.expect("an exit event");
    assert_eq!(exit.reason, ExitReason::Aborted);
    let left = sh(&*sb, "ps -eo args | grep -c '^sleep 30[12]'").await;
    assert_eq!(left.stdout_str().trim(), "0", "children survived the abort");
    sb.destroy().await.unwrap();
}

#[tokio::test]
async fn timeout_kills_and_is_reported() {
    let Some(p) = provider().await else { return };
    let sb = p.create(&spec()).await.unwrap();
    let _c = Cleanup(Some(sb.handle().id));
    let started = Instant::now();
    let out = collect_exec(
        sb.exec(ExecRequest::shell("sleep 303 & wait").timeout(Duration::from_millis(500)))
            .await
            .unwrap(),
    )
    .await
    .unwrap();
    assert_eq!(out.status.reason, ExitReason::TimedOut);
    assert!(!out.status.success());
    assert!(started.elapsed() < Duration::from_secs(10));
    assert_eq!(
        sh_ok(&*sb, "ps -eo args | grep -c '^sleep 303' || true")
            .await
            .trim(),
        "0"
    );
    sb.destroy().await.unwrap();
}

#[tokio::test]
async fn files_round_trip_and_missing_is_not_found() {
    let Some(p) = provider().await else { return };
    let sb = p.create(&spec()).await.unwrap();
    let _c = Cleanup(Some(sb.handle().id));
    let n = sb
        .write_file("deep/er/hello.txt", once("hello\nworld"))
        .await
        .unwrap();
    assert_eq!(n, 11);
    assert_eq!(
        sh_ok(&*sb, "cat /work/project/deep/er/hello.txt").await,
        "hello\nworld"
    );
    let got = collect(sb.read_file("deep/er/hello.txt").await.unwrap(), 1 << 20)
        .await
        .unwrap();
    assert_eq!(&got[..], b"hello\nworld");
    // Overwrite replaces; empty files work.
    sb.write_file("deep/er/hello.txt", once("x")).await.unwrap();
    let got = collect(
        sb.read_file("/work/project/deep/er/hello.txt")
            .await
            .unwrap(),
        10,
    )
    .await
    .unwrap();
    assert_eq!(&got[..], b"x");
    sb.write_file("empty", harness_core::stream::empty())
        .await
        .unwrap();
    assert!(collect(sb.read_file("empty").await.unwrap(), 10)
        .await
        .unwrap()
        .is_empty());
    // Symlinks are followed.
    sh_ok(&*sb, "ln -s deep/er/hello.txt link").await;
    let got = collect(sb.read_file("link").await.unwrap(), 10)
        .await
        .unwrap();
    assert_eq!(&got[..], b"x");
    // Missing file and directory.
    let err = sb.read_file("nope.txt").await.err().expect("missing file");
    assert_eq!(err.kind(), ErrorKind::NotFound, "{err}");
    let err = sb.read_file("deep").await.err().expect("a directory");
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
    // Tail from an offset.
    sb.write_file("spool", once("0123456789")).await.unwrap();
    let got = collect(sb.read_file_from("spool", 4).await.unwrap(), 100)
        .await
        .unwrap();
    assert_eq!(&got[..], b"456789");
    sb.destroy().await.unwrap();
}

#[tokio::test]
async fn tar_export_is_relative_and_import_overlays() {
    let Some(p) = provider().await else { return };
    let sb = p.create(&spec()).await.unwrap();
    let _c = Cleanup(Some(sb.handle().id));
    sh_ok(
        &*sb,
        "mkdir -p src/a && echo one > src/a/1.txt && echo two > src/2.txt",
    )
    .await;
    let tar = collect(sb.export_tar("src").await.unwrap(), 1 << 20)
        .await
        .unwrap();
    let mut names: Vec<String> = tar::Archive::new(&tar[..])
        .entries()
        .unwrap()
        .map(|e| e.unwrap().path().unwrap().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert!(names.iter().all(|n| !n.starts_with("src")), "{names:?}");
    assert!(
        names
            .iter()
            .any(|n| n.trim_start_matches("./") == "a/1.txt"),
        "{names:?}"
    );

    sh_ok(
        &*sb,
        "mkdir -p dst && echo keep > dst/keep.txt && echo old > dst/2.txt",
    )
    .await;
    sb.import_tar("dst", once(tar)).await.unwrap();
    assert_eq!(
        sh_ok(&*sb, "cat dst/keep.txt dst/2.txt dst/a/1.txt").await,
        "keep\ntwo\none\n"
    );
    // Into a directory that does not exist yet.
    let tar = collect(sb.export_tar("src").await.unwrap(), 1 << 20)
        .await
        .unwrap();
    sb.import_tar("/fresh/dir", once(tar)).await.unwrap();
    assert_eq!(sh_ok(&*sb, "cat /fresh/dir/2.txt").await, "two\n");

    let err = sb
        .export_tar("no-such-dir")
        .await
        .err()
        .expect("missing dir");
    assert_eq!(err.kind(), ErrorKind::NotFound, "{err}");

    // An entry escaping the target is refused.
    let mut b = tar::Builder::new(Vec::new());
    let mut h = tar::Header::new_gnu();
    h.set_size(4);
    h.set_mode(0o644);
    h.set_entry_type(tar::EntryType::Regular);
    {
        let name = b"../escape.txt";
        let gnu = h.as_gnu_mut().unwrap();
        gnu.name[..name.len()].copy_from_slice(name);
    }
    h.set_cksum();
    b.append(&h, &b"evil"[..]).unwrap();
    let evil = Bytes::from(b.into_inner().unwrap());
    let err = sb.import_tar("dst", once(evil)).await.expect_err("refused");
    assert!(
        matches!(
            err.kind(),
            ErrorKind::Unsafe | ErrorKind::Backend | ErrorKind::InvalidInput
        ),
        "{err}"
    );
    let out = sh(&*sb, "test -e /work/project/escape.txt").await;
    assert!(!out.status.success(), "the escaping entry was written");
    sb.destroy().await.unwrap();
}

/// A TCP server on the bridge gateway address (an address of this machine,
/// read from the sandbox's default route) that answers every connection
/// with a line.
async fn gateway_server(
    sandbox: &dyn harness_core::sandbox::Sandbox,
) -> Option<(std::net::SocketAddr, tokio::task::JoinHandle<()>)> {
    let hex = sh_ok(sandbox, "awk '$2==\"00000000\"{print $3}' /proc/net/route").await;
    let raw = u32::from_str_radix(hex.trim(), 16).ok()?;
    // /proc/net/route prints the address in host (little-endian) order.
    let ip = std::net::Ipv4Addr::from(raw.swap_bytes());
    let listener = tokio::net::TcpListener::bind((ip, 0)).await.ok()?;
    let addr = listener.local_addr().ok()?;
    let task = tokio::spawn(async move {
        use tokio::io::AsyncWriteExt;
        while let Ok((mut s, _)) = listener.accept().await {
            let _ = s.write_all(b"reached-host\n").await;
        }
    });
    Some((addr, task))
}

#[tokio::test]
async fn deny_all_has_no_network_and_allow_all_does() {
    let Some(p) = provider().await else { return };
    let mut open = spec();
    open.network = NetworkPolicy::AllowAll;
    let sb = p.create(&open).await.unwrap();
    let _c1 = Cleanup(Some(sb.handle().id));
    let Some((addr, server)) = gateway_server(&*sb).await else {
        harness_testkit::skip_or_fail("cannot bind a server on the bridge gateway address");
        return;
    };
    let probe = format!(
        "timeout 5 bash -c 'exec 3<>/dev/tcp/{}/{}; cat <&3' 2>&1; echo rc=$?",
        addr.ip(),
        addr.port()
    );
    let out = sh_ok(&*sb, &probe).await;
    assert!(
        out.contains("reached-host"),
        "allow-all could not reach the host: {out}"
    );
    sb.destroy().await.unwrap();

    let mut closed = spec();
    closed.network = NetworkPolicy::DenyAll;
    let sb = p.create(&closed).await.unwrap();
    let _c2 = Cleanup(Some(sb.handle().id));
    let out = sh_ok(&*sb, &probe).await;
    assert!(
        !out.contains("reached-host"),
        "deny-all reached the host: {out}"
    );
    assert!(!out.contains("rc=0"), "{out}");
    // Only loopback is there.
    let ifaces = sh_ok(&*sb, "ls /sys/class/net").await;
    assert_eq!(ifaces.trim(), "lo");
    sb.destroy().await.unwrap();
    server.abort();
}

/// A provider whose config names the gate (built for the test), or `None`
/// after a skip.
async fn gated_provider() -> Option<sandbox_docker::DockerProvider> {
    let gate = harness_testkit::gate_binary()?;
    provider_with(DockerConfig {
        gate: Some(gate),
        ..DockerConfig::default()
    })
    .await
}

fn custom_policy() -> NetworkPolicy {
    NetworkPolicy::Custom {
        allowed_hosts: vec!["example.com".into()],
        allowed_cidrs: vec![],
        denied_cidrs: vec![],
        allowed_ports: vec![],
    }
}

#[tokio::test]
async fn custom_network_policy_needs_the_egress_forward_and_gets_no_network_besides() {
    let Some(p) = gated_provider().await else {
        return;
    };
    // Without the egress proxy forward nothing would enforce the lists.
    let mut s = spec();
    s.network = custom_policy();
    let err = p
        .create(&s)
        .await
        .expect_err("custom without the egress forward must be refused");
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
    assert!(
        err.message()
            .contains("custom network policy needs the egress proxy forward on port 47812"),
        "{err}"
    );
    // With it: no network but loopback, and the proxy answers there.
    let proxy = SocketServer::start("egress-proxy-answer").await.unwrap();
    s.forwards = vec![proxy.forward(EGRESS_PROXY_PORT)];
    let sb = p.create(&s).await.unwrap();
    let _c = Cleanup(Some(sb.handle().id));
    let info = p
        .client()
        .inspect_container(&sb.handle().id, None)
        .await
        .unwrap();
    assert_eq!(
        info.host_config.unwrap().network_mode.as_deref(),
        Some("none")
    );
    assert_eq!(sh_ok(&*sb, "ls /sys/class/net").await.trim(), "lo");
    let reply = sh_ok(&*sb, &http_get(EGRESS_PROXY_PORT)).await;
    assert!(reply.ends_with("egress-proxy-answer"), "{reply:?}");
    sb.destroy().await.unwrap();
}

/// One HTTP GET to 127.0.0.1:`port` from inside; the whole response.
fn http_get(port: u16) -> String {
    format!(
        "timeout 10 bash -c 'exec 3<>/dev/tcp/127.0.0.1/{port} && printf \"GET / HTTP/1.0\\r\\n\\r\\n\" >&3 && cat <&3' || true"
    )
}

#[tokio::test]
async fn forwards_mount_only_the_sockets_directory_and_the_gate_read_only() {
    let Some(p) = gated_provider().await else {
        return;
    };
    let broker = SocketServer::start("broker-answer").await.unwrap();
    let mut s = spec();
    s.network = NetworkPolicy::DenyAll;
    s.forwards = vec![broker.forward(MODEL_BROKER_PORT)];
    let sb = p.create(&s).await.unwrap();
    let _c = Cleanup(Some(sb.handle().id));
    // The handle records the forward at its path inside the container.
    let data = sb.handle().data;
    assert_eq!(data["forwards"][0]["port"], MODEL_BROKER_PORT);
    assert_eq!(
        data["forwards"][0]["path"],
        format!("{FORWARD_DIRS_IN_CONTAINER}/0/suite.sock")
    );
    let listing = sh_ok(
        &*sb,
        &format!("ls -A {FORWARD_DIRS_IN_CONTAINER}/0; test -x {GATE_IN_CONTAINER} && echo gate"),
    )
    .await;
    assert_eq!(listing, "suite.sock\ngate\n");
    let write = sh(
        &*sb,
        &format!("touch {FORWARD_DIRS_IN_CONTAINER}/0/x 2>&1 || echo refused; cat /dev/null > {GATE_IN_CONTAINER} || echo refused"),
    )
    .await;
    assert_eq!(
        write.stdout_str().matches("refused").count(),
        2,
        "{:?}",
        write.stdout_str()
    );
    let reply = sh_ok(&*sb, &http_get(MODEL_BROKER_PORT)).await;
    assert!(reply.ends_with("broker-answer"), "{reply:?}");
    // One daemon serves the container, whatever the number of execs.
    for _ in 0..3 {
        sh_ok(&*sb, "true").await;
    }
    let daemons = sh_ok(
        &*sb,
        "for p in /proc/[0-9]*; do [ \"$(tr '\\0' '\\n' < $p/cmdline 2>/dev/null | sed -n 2p)\" = --serve ] && echo $p; done | wc -l",
    )
    .await;
    assert_eq!(daemons.trim(), "1", "forward daemons in the container");
    sb.destroy().await.unwrap();
}

#[tokio::test]
async fn forwards_are_refused_where_they_cannot_be_kept() {
    let Some(p) = provider_with(DockerConfig {
        gate: Some("/nonexistent/harness-sandbox-gate".into()),
        ..DockerConfig::default()
    })
    .await
    else {
        return;
    };
    let forward = HostForward {
        port: MODEL_BROKER_PORT,
        socket: "/tmp/harness-test-forward/broker.sock".into(),
    };
    // No gate.
    let mut s = spec();
    s.forwards = vec![forward.clone()];
    let err = p.create(&s).await.expect_err("no gate");
    assert_eq!(err.kind(), ErrorKind::Unsupported, "{err}");
    assert!(
        err.message().contains("HARNESS_SANDBOX_GATE_BIN")
            && err.message().contains("/nonexistent/harness-sandbox-gate"),
        "{err}"
    );
    // Wrap-mode: mounts cannot be added to a running container.
    let owner = p.create(&spec()).await.unwrap();
    let _c = Cleanup(Some(owner.handle().id));
    let mut s = spec();
    s.wrap = Some(owner.handle().id);
    s.forwards = vec![forward.clone()];
    let err = p.create(&s).await.expect_err("wrap with forwards");
    assert_eq!(err.kind(), ErrorKind::Unsupported, "{err}");
    assert!(
        err.message().contains("wrap-mode cannot add forwards"),
        "{err}"
    );
    owner.destroy().await.unwrap();
    // A socket directly in `/` would mount the host's root.
    let mut s = spec();
    s.forwards = vec![HostForward {
        port: MODEL_BROKER_PORT,
        socket: "/broker.sock".into(),
    }];
    assert_eq!(
        p.create(&s).await.unwrap_err().kind(),
        ErrorKind::InvalidInput
    );
}

#[tokio::test]
async fn every_exec_through_the_gate_keeps_the_exec_contract() {
    let Some(p) = gated_provider().await else {
        return;
    };
    let broker = SocketServer::start("unused").await.unwrap();
    let mut s = spec();
    s.network = NetworkPolicy::DenyAll;
    s.forwards = vec![broker.forward(MODEL_BROKER_PORT)];
    let sandbox = p.create(&s).await.unwrap();
    let _c = Cleanup(Some(sandbox.handle().id));
    let sb = sandbox.as_ref();
    suite::exec_streams_stdout_stderr_and_one_exit(sb)
        .await
        .unwrap();
    suite::exec_exit_codes(sb).await.unwrap();
    suite::exec_cwd(sb).await.unwrap();
    suite::exec_stdin(sb).await.unwrap();
    suite::exec_streams_before_exit(sb).await.unwrap();
    suite::exec_timeout_kills_tree(sb).await.unwrap();
    suite::exec_abort_kills_tree(sb).await.unwrap();
    suite::detached_processes(sb).await.unwrap();
    suite::a_second_launch_in_one_spool_returns_the_first(sb)
        .await
        .unwrap();
    sandbox.destroy().await.unwrap();
    suite::exec_env(&p, &s).await.unwrap();
    suite::detach_and_resume(&p, &s).await.unwrap();
    assert_eq!(
        suite::stop_and_resume(&p, &s).await.unwrap(),
        suite::Capability::Supported
    );
}

#[tokio::test]
async fn ports_publish_on_distinct_free_host_ports() {
    let Some(p) = provider().await else { return };
    let mut s = spec();
    s.ports = vec![8080];
    let a = p.create(&s).await.unwrap();
    let _ca = Cleanup(Some(a.handle().id));
    let b = p.create(&s).await.unwrap();
    let _cb = Cleanup(Some(b.handle().id));
    let ea = a.port_endpoint(8080).await.unwrap();
    let eb = b.port_endpoint(8080).await.unwrap();
    assert_eq!(ea.host, "127.0.0.1");
    assert_ne!(ea.port, eb.port, "two sessions got one host port");
    let err = a.port_endpoint(9999).await.expect_err("unpublished port");
    assert_eq!(err.kind(), ErrorKind::NotFound);

    // A real server inside answers through the endpoint.
    let server = "perl -MIO::Socket::INET -e '$s=IO::Socket::INET->new(LocalPort=>8080,Listen=>5,ReuseAddr=>1) or die $!; print \"up\\n\"; $|=1; while($c=$s->accept){print $c \"from-sandbox\\n\"; close $c}'";
    let mut serving = a.exec(ExecRequest::shell(server)).await.unwrap();
    match serving.next().await.unwrap().unwrap() {
        ExecEvent::Stdout(b) => assert_eq!(&b[..], b"up\n"),
        other => panic!("server did not start: {other:?}"),
    }
    use tokio::io::AsyncReadExt;
    let mut conn = tokio::net::TcpStream::connect((ea.host.as_str(), ea.port))
        .await
        .unwrap();
    let mut got = String::new();
    conn.read_to_string(&mut got).await.unwrap();
    assert_eq!(got, "from-sandbox\n");

    // The endpoint survives stop and resume (read back from docker).
    let handle = a.stop().await.unwrap();
    let resumed = p.resume(&handle).await.unwrap();
    assert_eq!(resumed.port_endpoint(8080).await.unwrap(), ea);
    drop(serving);
    a.destroy().await.unwrap();
    b.destroy().await.unwrap();
}

#[tokio::test]
async fn stop_and_resume_in_process_keep_files() {
    let Some(p) = provider().await else { return };
    let sb = p.create(&spec()).await.unwrap();
    let _c = Cleanup(Some(sb.handle().id));
    sb.write_file("state.txt", once("kept")).await.unwrap();
    let started = Instant::now();
    let handle = sb.stop().await.unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "stop waited for the kill grace"
    );
    let json = serde_json::to_string(&handle).unwrap();
    let handle = serde_json::from_str(&json).unwrap();
    let back = p.resume(&handle).await.unwrap();
    let got = collect(back.read_file("state.txt").await.unwrap(), 10)
        .await
        .unwrap();
    assert_eq!(&got[..], b"kept");
    back.destroy().await.unwrap();
    let err = p.resume(&handle).await.expect_err("destroyed");
    assert_eq!(err.kind(), ErrorKind::NotFound);
    let mut foreign = handle.clone();
    foreign.provider = "local".into();
    assert_eq!(
        p.resume(&foreign).await.err().unwrap().kind(),
        ErrorKind::InvalidInput
    );
}

#[tokio::test]
async fn wrap_mode_uses_the_container_and_destroy_leaves_it() {
    let Some(p) = provider().await else { return };
    let owner = p.create(&spec()).await.unwrap();
    let _c = Cleanup(Some(owner.handle().id));
    let mut s = spec();
    s.wrap = Some(owner.handle().id);
    s.workdir = "/wrapped".into();
    s.env.insert("WRAP_ENV".into(), "yes".into());
    let wrapped = p.create(&s).await.unwrap();
    assert!(!wrapped.handle().owned);
    assert_eq!(
        sh_ok(&*wrapped, "pwd; echo $WRAP_ENV").await,
        "/wrapped\nyes\n"
    );
    wrapped.destroy().await.unwrap();
    // Still there and running.
    assert_eq!(
        sh_ok(&*owner, "test -d /wrapped && echo alive").await,
        "alive\n"
    );
    // Resuming the wrapped handle keeps the per-exec environment.
    let again = p.resume(&wrapped.handle()).await.unwrap();
    assert_eq!(sh_ok(&*again, "echo $WRAP_ENV").await, "yes\n");
    // Deny-all cannot be promised for a container on a network.
    s.network = NetworkPolicy::DenyAll;
    let err = p.create(&s).await.expect_err("refused");
    assert_eq!(err.kind(), ErrorKind::Unsupported);
    owner.destroy().await.unwrap();
}

#[tokio::test]
async fn bind_mounts_are_read_only_when_asked() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("agent"), b"#!/bin/sh\necho agent-ran\n").unwrap();
    let config = DockerConfig {
        bind_mounts: vec![BindMount {
            host: dir.path().to_string_lossy().into_owned(),
            container: "/opt/agent".into(),
            read_only: true,
        }],
        ..DockerConfig::default()
    };
    let Some(p) = provider_with(config).await else {
        return;
    };
    let sb = p.create(&spec()).await.unwrap();
    let _c = Cleanup(Some(sb.handle().id));
    assert_eq!(sh_ok(&*sb, "sh /opt/agent/agent").await, "agent-ran\n");
    let out = sh(&*sb, "echo x > /opt/agent/new").await;
    assert!(!out.status.success(), "read-only mount was writable");
    assert!(
        out.stderr_str().contains("Read-only"),
        "{}",
        out.stderr_str()
    );
    sb.destroy().await.unwrap();
}

#[tokio::test]
async fn limits_are_applied() {
    let Some(p) = provider().await else { return };
    let mut s = spec();
    s.cpus = Some(0.5);
    s.memory_mb = Some(256);
    let sb = p.create(&s).await.unwrap();
    let _c = Cleanup(Some(sb.handle().id));
    let info = p
        .client()
        .inspect_container(&sb.handle().id, None)
        .await
        .unwrap();
    let hc = info.host_config.unwrap();
    assert_eq!(hc.nano_cpus, Some(500_000_000));
    assert_eq!(hc.memory, Some(256 * 1024 * 1024));
    let labels = info.config.unwrap().labels.unwrap();
    assert_eq!(
        labels.get("dev.harness.managed-by").map(String::as_str),
        Some("harness")
    );
    assert_eq!(labels.get("dev.harness.session-id"), s.session_id.as_ref());
    sb.destroy().await.unwrap();
}

/// Peak resident memory of this process, in KiB.
fn vm_hwm_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

/// `total` deterministic bytes in 256 KiB chunks, generated on the fly.
fn generated(total: u64) -> ByteStream {
    const CHUNK: u64 = 256 * 1024;
    Box::pin(futures::stream::unfold(0u64, move |sent| async move {
        if sent >= total {
            return None;
        }
        let n = CHUNK.min(total - sent);
        let chunk: Vec<u8> = (sent..sent + n)
            .map(|i| (i.wrapping_mul(31) % 251) as u8)
            .collect();
        Some((Ok(Bytes::from(chunk)), sent + n))
    }))
}

#[tokio::test]
async fn a_large_file_round_trips_as_a_stream_in_bounded_memory() {
    use sha2::{Digest, Sha256};
    let Some(p) = provider().await else { return };
    let sb = p.create(&spec()).await.unwrap();
    let _c = Cleanup(Some(sb.handle().id));
    const SIZE: u64 = 120 * 1024 * 1024;
    let mut expected = Sha256::new();
    let mut src = generated(SIZE);
    while let Some(c) = src.next().await {
        expected.update(c.unwrap());
    }
    let expected = hex::encode(expected.finalize());

    let before = vm_hwm_kib();
    let n = sb.write_file("big.bin", generated(SIZE)).await.unwrap();
    assert_eq!(n, SIZE);
    let in_box = sh_ok(&*sb, "sha256sum big.bin | cut -d' ' -f1").await;
    assert_eq!(in_box.trim(), expected);
    let mut read = sb.read_file("big.bin").await.unwrap();
    let mut hasher = Sha256::new();
    let mut total = 0u64;
    while let Some(c) = read.next().await {
        let c = c.unwrap();
        total += c.len() as u64;
        hasher.update(&c);
    }
    assert_eq!(total, SIZE);
    assert_eq!(hex::encode(hasher.finalize()), expected);
    let grew_mib = (vm_hwm_kib().saturating_sub(before)) / 1024;
    println!(
        "VmHWM grew by {grew_mib} MiB for a {} MiB round trip",
        SIZE >> 20
    );
    assert!(grew_mib < 64, "peak memory grew by {grew_mib} MiB");
    sb.destroy().await.unwrap();
}

#[tokio::test]
async fn a_failing_source_never_leaves_a_truncated_file() {
    let Some(p) = provider().await else { return };
    let sb = p.create(&spec()).await.unwrap();
    let _c = Cleanup(Some(sb.handle().id));
    sb.write_file("f.bin", once("original")).await.unwrap();
    let failing: ByteStream = Box::pin(generated(3 * 1024 * 1024).chain(futures::stream::once(
        async { Err(harness_core::Error::backend("source broke")) },
    )));
    let err = sb
        .write_file("f.bin", failing)
        .await
        .expect_err("must fail");
    assert!(err.message().contains("source broke"), "{err}");
    let got = collect(sb.read_file("f.bin").await.unwrap(), 100)
        .await
        .unwrap();
    assert_eq!(&got[..], b"original");
    assert_eq!(
        sh_ok(&*sb, "ls -a /work/project | grep -c harness-tmp || true")
            .await
            .trim(),
        "0",
        "temporary file left behind"
    );
    sb.destroy().await.unwrap();
}

/// A tar import is written from the host into the container's root when
/// this process shares the engine's host as root (as CI runs): what it
/// makes gets the directory's owner — here 1234, which GNU tar run as the
/// container's root would not give — and the directory is found inside the
/// container (an absolute symlink in it leads into the container, not the
/// host). With `host_imports: false`, or not as root, GNU tar in the
/// container extracts it (as the container's root). Either way the tree
/// is the archive's.
#[tokio::test]
async fn imports_are_written_from_the_host_when_it_may_else_through_an_exec() {
    use tar::EntryType as T;
    let Some(host) = provider().await else { return };
    let Some(exec_only) = provider_with(DockerConfig {
        host_imports: false,
        ..DockerConfig::default()
    })
    .await
    else {
        return;
    };
    let root = rustix::process::geteuid().is_root();
    let tar = Bytes::from(harness_testkit::trees::tar_of(&[
        ("d/", T::Directory, "", 0o750),
        ("d/f.txt", T::Regular, "from the archive", 0o640),
        ("top.txt", T::Regular, "top", 0o644),
        ("link", T::Symlink, "d/f.txt", 0o777),
    ]));
    for (name, provider, from_host) in [("host", &host, root), ("exec", &exec_only, false)] {
        let sb = provider.create(&spec()).await.unwrap();
        let _c = Cleanup(Some(sb.handle().id));
        // `/jump` leads, inside the container, to a directory of 1234.
        sh_ok(
            &*sb,
            "mkdir -p /tmp/inside && chown 1234:1234 /tmp/inside && ln -s /tmp/inside /jump",
        )
        .await;
        sb.import_tar("/jump", once(tar.clone())).await.unwrap();
        let listed = sh_ok(
            &*sb,
            "cd /tmp/inside && stat -c '%n %u:%g %a' d d/f.txt top.txt && cat d/f.txt && echo && readlink link",
        )
        .await;
        let owner = if from_host { "1234:1234" } else { "0:0" };
        assert_eq!(
            listed,
            format!(
                "d {owner} 750\nd/f.txt {owner} 640\ntop.txt {owner} 644\nfrom the archive\nd/f.txt\n"
            ),
            "{name}"
        );
        sb.destroy().await.unwrap();
    }
}

/// The provider knows a sandbox's `$HOME` from configuration (the handle
/// carries it, so a resume knows it too), and it is what commands see:
/// the image's, and the spec's `HOME` over it.
#[tokio::test]
async fn the_home_hint_is_the_home_commands_see() {
    let Some(provider) = common::provider().await else {
        return;
    };
    let plain = SandboxSpec::new("/work");
    let mut own = SandboxSpec::new("/work");
    own.env.insert("HOME".into(), "/work/home".into());
    for spec in [plain, own] {
        let sandbox = provider.create(&spec).await.unwrap();
        let _cleanup = Cleanup(Some(sandbox.handle().id.clone()));
        let home = sh_ok(sandbox.as_ref(), "printf %s \"$HOME\"").await;
        assert_eq!(
            sandbox.home_hint().as_deref(),
            Some(home.as_str()),
            "{spec:?}"
        );
        let resumed = provider.resume(&sandbox.handle()).await.unwrap();
        assert_eq!(resumed.home_hint(), sandbox.home_hint());
        sandbox.destroy().await.unwrap();
    }
}

/// With an exec directory, commands go through the exec server in the
/// container — the engine creates no exec for them — and keep working
/// through the engine's exec when the server cannot be reached: a socket
/// swapped for a link to a host socket (never followed: the host socket
/// sees no connection), a server killed.
#[tokio::test]
async fn commands_go_through_the_exec_server_and_fall_back_to_the_engines_exec() {
    let exec_root = tempfile::tempdir().unwrap();
    let Some(provider) = common::provider_with_exec_server(exec_root.path()).await else {
        return;
    };
    let sandbox = provider.create(&spec()).await.unwrap();
    let id = sandbox.handle().id.clone();
    let _cleanup = Cleanup(Some(id.clone()));
    let exec_dir = std::path::PathBuf::from(
        sandbox.handle().data["exec_dir"]
            .as_str()
            .expect("the handle names the exec directory"),
    );
    assert!(exec_dir.starts_with(exec_root.path()));

    // The server binds as the container starts: wait for its socket.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !exec_dir.join("sock").exists() {
        assert!(
            Instant::now() < deadline,
            "no exec server socket in {}",
            exec_dir.display()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let since = common::unix_now();
    for i in 0..5 {
        let out = sh_ok(
            sandbox.as_ref(),
            &format!("echo run {i}; echo \"$HOME\" >&2"),
        )
        .await;
        assert_eq!(out, format!("run {i}\n"));
    }
    let streamed = collect(sandbox.read_file("/etc/hostname").await.unwrap(), 1 << 20)
        .await
        .unwrap();
    assert!(!streamed.is_empty());
    assert_eq!(
        common::engine_execs(&provider, &id, since).await,
        0,
        "commands went through the engine's exec although the server was there"
    );

    // A link to a host socket in the server's place: not followed, and the
    // command runs through the engine instead.
    let host_dir = tempfile::tempdir().unwrap();
    let host_socket = host_dir.path().join("host.sock");
    let host_listener = std::os::unix::net::UnixListener::bind(&host_socket).unwrap();
    host_listener.set_nonblocking(true).unwrap();
    std::fs::rename(exec_dir.join("sock"), exec_dir.join("sock.real")).unwrap();
    std::os::unix::fs::symlink(&host_socket, exec_dir.join("sock")).unwrap();
    let since = common::unix_now();
    assert_eq!(
        sh_ok(sandbox.as_ref(), "echo through the engine").await,
        "through the engine\n"
    );
    assert!(
        host_listener.accept().is_err(),
        "the host followed the container's link to a host socket"
    );
    assert!(common::engine_execs(&provider, &id, since).await >= 1);
    std::fs::remove_file(exec_dir.join("sock")).unwrap();
    std::fs::rename(exec_dir.join("sock.real"), exec_dir.join("sock")).unwrap();
    assert_eq!(sh_ok(sandbox.as_ref(), "echo back").await, "back\n");

    // A killed server (after the command that kills it has answered):
    // its socket refuses, the engine runs the command.
    sh_ok(
        sandbox.as_ref(),
        "( sleep 0.3; for p in /proc/[0-9]*; do tr '\\0' ' ' <$p/cmdline 2>/dev/null \\
           | grep -q -- '--exec-serve' && kill -9 ${p#/proc/}; done ) >/dev/null 2>&1 &",
    )
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let since = common::unix_now();
    assert_eq!(sh_ok(sandbox.as_ref(), "echo still").await, "still\n");
    assert!(common::engine_execs(&provider, &id, since).await >= 1);

    sandbox.destroy().await.unwrap();
    assert!(
        !exec_dir.parent().unwrap().exists(),
        "destroy left the exec directory"
    );
}
