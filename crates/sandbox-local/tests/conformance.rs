//! The shared sandbox conformance suite against the real local provider,
//! with the sandbox gate (deny-all, custom and host forwards need root: a
//! network namespace per command).

use harness_core::sandbox::SandboxSpec;
use harness_testkit::conformance::sandbox as suite;
use sandbox_local::LocalProvider;

/// The provider with the gate, or `None` after a skip (a failure under
/// `HARNESS_REQUIRE_REAL=1`) when namespaces cannot be made here.
fn provider(root: &std::path::Path) -> Option<LocalProvider> {
    if !nix::unistd::geteuid().is_root() {
        harness_testkit::skip_or_fail(
            "the local sandbox's network items need root (a network namespace per command)",
        );
        return None;
    }
    Some(LocalProvider::new(root).with_gate(harness_testkit::gate_binary()?))
}

fn assert_nothing_left(root: &std::path::Path) {
    let left: Vec<_> = std::fs::read_dir(root)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(left.is_empty(), "sandboxes left behind: {left:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_sandbox_passes_the_conformance_suite() {
    let root = tempfile::tempdir().unwrap();
    let Some(provider) = provider(root.path()) else {
        return;
    };
    let report = match suite::run_all(&provider, SandboxSpec::new("/workspace")).await {
        Ok(report) => report,
        Err(e) => panic!("{e:#}"),
    };
    // The optional items answer as docs/sandbox-local.md says: ports and every
    // network policy (through the gate's namespaces), but no stop.
    for item in [
        "port_endpoint",
        "network_deny_all",
        "host_forward",
        "network_custom",
    ] {
        assert_eq!(
            report.capability(item),
            &suite::Capability::Supported,
            "{item}"
        );
    }
    assert!(matches!(
        report.capability("stop_and_resume"),
        suite::Capability::Unsupported(_)
    ));
    // Every sandbox the suite made was destroyed again.
    assert_nothing_left(root.path());
}

/// The exec, file and detached-process items again with every command
/// behind the gate (deny-all, with a forward): the gate must keep the
/// process-group, timeout, abort and detach semantics of a plain exec.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_suite_passes_with_every_command_behind_the_gate() {
    let root = tempfile::tempdir().unwrap();
    let Some(provider) = provider(root.path()) else {
        return;
    };
    let (_server, spec) = suite::deny_all_with_a_forward().await.unwrap();
    if let Err(e) = suite::contract_items(&provider, &spec).await {
        panic!("{e:#}");
    }
    assert_nothing_left(root.path());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_gate_restricted_networks_are_unsupported() {
    let root = tempfile::tempdir().unwrap();
    let provider = LocalProvider::new(root.path()).with_gate(root.path().join("no-gate"));
    let spec = SandboxSpec::new("/workspace");
    match suite::network_deny_all(&provider, &spec, &suite::SuiteOptions::default())
        .await
        .unwrap()
    {
        suite::Capability::Unsupported(msg) => assert!(
            msg.contains("HARNESS_SANDBOX_GATE_BIN"),
            "unclear refusal: {msg}"
        ),
        other => panic!("deny-all without a gate cannot be enforced, yet the suite says {other:?}"),
    }
    assert!(matches!(
        suite::host_forward(&provider, &spec).await.unwrap(),
        suite::Capability::Unsupported(_)
    ));
    assert_nothing_left(root.path());
}
