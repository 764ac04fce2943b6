//! The shared sandbox conformance suite against the real local provider.

use harness_core::sandbox::SandboxSpec;
use harness_testkit::conformance::sandbox as suite;
use sandbox_local::LocalProvider;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_sandbox_passes_the_conformance_suite() {
    let root = tempfile::tempdir().unwrap();
    let provider = LocalProvider::new(root.path());
    let result = suite::run_all(&provider, SandboxSpec::new("/workspace")).await;
    if let Err(e) = result {
        panic!("{e:#}");
    }
    // Every sandbox the suite made was destroyed again.
    let left: Vec<_> = std::fs::read_dir(root.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(left.is_empty(), "sandboxes left behind: {left:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn optional_capabilities_are_reported_as_the_docs_say() {
    let root = tempfile::tempdir().unwrap();
    let provider = LocalProvider::new(root.path());
    let spec = SandboxSpec::new("/workspace");
    assert_eq!(
        suite::port_endpoint(&provider, &spec).await.unwrap(),
        suite::Capability::Supported
    );
    assert!(matches!(
        suite::stop_and_resume(&provider, &spec).await.unwrap(),
        suite::Capability::Unsupported(_)
    ));
    let net = suite::network_deny_all(&provider, &spec, &suite::SuiteOptions::default())
        .await
        .unwrap();
    match net {
        suite::Capability::Unsupported(msg) => assert!(
            msg.contains("cannot enforce network policy"),
            "unclear refusal: {msg}"
        ),
        other => panic!("local cannot enforce deny-all, yet the suite says {other:?}"),
    }
}
