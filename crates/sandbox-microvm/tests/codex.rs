//! A real `codex` turn inside a microVM: the adapter's bootstrap recipe
//! copies the static binary in once (a disk snapshot per recipe identity),
//! the turn runs detached in the guest with its spool tailed through the
//! agent, and the model is the test kit's scripted server on the host's
//! loopback, reached from a deny-all guest only through a host forward
//! (guest `127.0.0.1:47811` → a Unix socket on the host, as the model
//! broker is reached).
//!
//! One turn, under deny-all: an allow-all twin (the model at 10.0.2.2) cost
//! CI another VM boot and codex turn under TCG (84 s in a cold run) for
//! what `microvm.rs`'s `allow_all_reaches_the_host_and_deny_all_nothing`
//! already shows, that an allow-all guest reaches the host.

mod common;

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use harness_agent_e2e::{read_all, run_turn, Session};
use harness_codex::{CodexConfig, CodexHarness};
use harness_core::sandbox::{
    HostForward, NetworkPolicy, SandboxProvider, SandboxSpec, MODEL_BROKER_PORT,
};
use harness_testkit::model::*;

/// Relay every connection on a new Unix socket to `target` (TCP); returns
/// the socket's directory guard and path.
async fn unix_front(target: SocketAddr) -> (tempfile::TempDir, String) {
    let dir = tempfile::Builder::new()
        .prefix("mvmfwd")
        .tempdir_in("/tmp")
        .unwrap();
    let path = dir.path().join("model.sock");
    let listener = tokio::net::UnixListener::bind(&path).unwrap();
    tokio::spawn(async move {
        while let Ok((mut inbound, _)) = listener.accept().await {
            tokio::spawn(async move {
                if let Ok(mut outbound) = tokio::net::TcpStream::connect(target).await {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                }
            });
        }
    });
    (dir, path.display().to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_codex_turn_runs_in_a_deny_all_microvm_through_a_host_forward() {
    let h = match CodexConfig::from_env() {
        Ok(c) => CodexHarness::new(c),
        Err(e) => {
            harness_testkit::skip_or_fail(&format!("codex binary: {e}"));
            return;
        }
    };
    // A stable state directory: the codex snapshot (a 300 MB copy into the
    // guest) is made once per recipe identity and reused by later runs.
    let cache = std::env::var("HARNESS_CACHE").unwrap_or_else(|_| "/var/cache/harness".into());
    let Some(provider) = common::provider_in(format!("{cache}/microvm-sandboxes")) else {
        return;
    };
    let server = ScriptedModel::start_on(
        SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0),
        write_a_file_script(),
    )
    .await
    .unwrap();
    let addr: SocketAddr = server
        .base_url()
        .trim_start_matches("http://")
        .parse()
        .unwrap();
    let mut env: BTreeMap<String, String> = server.codex_env().into_iter().collect();
    let mut spec = SandboxSpec::new("/workspace");
    let (_front, socket) = unix_front(addr).await;
    spec.forwards = vec![HostForward {
        port: MODEL_BROKER_PORT,
        socket,
    }];
    env.insert(
        "OPENAI_BASE_URL".into(),
        format!("http://127.0.0.1:{MODEL_BROKER_PORT}/v1"),
    );
    let name = "codex-deny";
    spec.network = NetworkPolicy::DenyAll;
    spec.session_id = Some(name.into());
    // A fixed slot: a run that died before `destroy` left its VM in the
    // shared state directory, and this replaces it.
    spec.slot = Some("t1".into());
    spec.bootstrap = Some(harness_core::harness::Harness::bootstrap_recipe(&h).unwrap());
    let started = std::time::Instant::now();
    let sandbox = provider.create(&spec).await.expect("create the microVM");
    println!("microVM with codex ready in {:?}", started.elapsed());
    let mut session = Session::resumed(sandbox, "/root".into(), name.into(), None, 0);
    let started = std::time::Instant::now();
    let run = run_turn(&mut session, &h, "write a file", &env).await;
    println!("codex turn took {:?}", started.elapsed());
    server.assert_no_failures();
    assert_eq!(run.exit_code, 0, "{}", run.stderr);
    assert_eq!(run.text(), "Wrote it.");
    assert!(session.agent_session_id.is_some());
    assert_eq!(
        read_all(session.sandbox.as_ref(), "made.txt").await,
        "agent-was-here\n"
    );
    session.destroy().await;
}
