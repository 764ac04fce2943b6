//! The shared sandbox conformance suite against a Cloudflare bridge: the
//! test kit's bridge-compatible server (backed by the real Docker engine,
//! every request and response checked against the bridge's own OpenAPI
//! document), or a real deployed bridge:
//!
//! ```sh
//! HARNESS_CF_BRIDGE_URL=https://sandbox.example.workers.dev HARNESS_CF_TOKEN=… \
//!   cargo test -p sandbox-cloudflare --test conformance
//! ```

mod common;

use harness_core::sandbox::{SandboxProvider, SandboxSpec};
use harness_core::ErrorKind;
use harness_testkit::conformance::sandbox::{self as suite, Capability, SuiteOptions};
use sandbox_cloudflare::transport::{BridgeRequest, BridgeTransport, Method, ReqwestTransport};
use sandbox_cloudflare::{CloudflareConfig, CloudflareProvider};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cloudflare_passes_the_sandbox_conformance_suite() {
    let Some(bridge) = common::bridge().await else {
        return;
    };
    let spec = SandboxSpec::new("/workspace");
    let options = SuiteOptions {
        // The bridge has no network policy: the reachability halves of the
        // network items never run (deny-all and custom are refused).
        host_address: None,
        // Several 16 MiB parts on the way in, a streamed GET on the way out.
        large_file_bytes: 100 * 1024 * 1024,
    };
    let result = suite::run_all_with(&bridge.provider, spec.clone(), &options).await;
    let contract = bridge.finish_checked().await;
    let report = match (result, contract) {
        (Ok(report), Ok(())) => report,
        (suite, contract) => panic!(
            "suite: {}\ncontract: {}",
            suite.map_or_else(|e| format!("{e:#}"), |_| "passed".into()),
            contract.err().unwrap_or_else(|| "kept".into())
        ),
    };
    // What the bridge has and has not, pinned: a change is a regression or
    // a feature to document, not noise.
    assert_eq!(
        report.capability("port_endpoint"),
        &Capability::Supported,
        "ports through tunnels"
    );
    assert!(
        matches!(
            report.capability("stop_and_resume"),
            Capability::Unsupported(_)
        ),
        "the bridge cannot stop a sandbox"
    );
    assert!(matches!(
        report.capability("network_deny_all"),
        Capability::Unsupported(m) if m.contains("no network policy")
    ));
    assert!(matches!(
        report.capability("host_forward"),
        Capability::Unsupported(m) if m.contains("--direct-model")
    ));
}

/// A request that drifts from the bridge's API (a field renamed) is caught
/// by the validation, and the suite would fail on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renamed_field_is_caught_by_the_openapi_validation() {
    let Some(bridge) = common::bridge().await else {
        return;
    };
    let Some(server) = bridge.server.as_ref() else {
        println!("skipped: a real bridge validates nothing for us");
        return;
    };
    assert!(server.violations().is_empty());
    let transport = ReqwestTransport::new(&bridge.url, &bridge.token).unwrap();
    let response = transport
        .send(
            BridgeRequest::new(Method::Post, "/v1/sandbox/drift-check/exec")
                .json(json!({ "args": ["true"] })),
        )
        .await
        .unwrap();
    assert_eq!(response.status, 400);
    let violations = server.violations();
    assert!(
        violations.iter().any(|v| v.contains("argv")),
        "the missing `argv` must be named: {violations:#?}"
    );
    assert!(server.check().is_err());
    assert!(
        server.sandboxes().is_empty(),
        "a refused request must create nothing: {:?}",
        server.sandboxes()
    );
    // This test's server is expected to have seen a violation.
    bridge.server.unwrap().shutdown().await.unwrap();
}

/// A wrong token is `Unauthorized` with the bridge's message, and creates
/// nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_token_is_refused_and_creates_nothing() {
    let Some(bridge) = common::bridge().await else {
        return;
    };
    let provider =
        CloudflareProvider::new(CloudflareConfig::new(bridge.url.clone(), "not-the-token"))
            .unwrap();
    let err = provider
        .create(&SandboxSpec::new("/workspace"))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unauthorized, "{err}");
    assert!(err.message().contains("unauthorized"), "{err}");
    if let Some(server) = &bridge.server {
        assert!(server.sandboxes().is_empty(), "{:?}", server.sandboxes());
    }
    bridge.finish().await;
}

/// Another process resumes a sandbox by its handle: the files and the
/// spec's environment are there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handle_resumes_in_a_fresh_provider() {
    let Some(bridge) = common::bridge().await else {
        return;
    };
    let mut spec = SandboxSpec::new("/workspace");
    spec.env.insert("FROM_SPEC".into(), "kept".into());
    let sandbox = bridge.provider.create(&spec).await.unwrap();
    let out = harness_core::sandbox::collect_exec(
        sandbox
            .exec(harness_core::sandbox::ExecRequest::shell(
                "echo hi > /workspace/note.txt",
            ))
            .await
            .unwrap(),
    )
    .await
    .unwrap();
    assert!(out.status.success());
    let handle = serde_json::to_string(&sandbox.detach().await.unwrap()).unwrap();
    drop(sandbox);

    let fresh = CloudflareProvider::new(CloudflareConfig::new(
        bridge.url.clone(),
        bridge.token.clone(),
    ))
    .unwrap();
    let resumed = fresh
        .resume(&serde_json::from_str(&handle).unwrap())
        .await
        .unwrap();
    let out = harness_core::sandbox::collect_exec(
        resumed
            .exec(harness_core::sandbox::ExecRequest::shell(
                "cat note.txt; printf %s \"$FROM_SPEC\"",
            ))
            .await
            .unwrap(),
    )
    .await
    .unwrap();
    assert_eq!(out.stdout_str(), "hi\nkept");
    resumed.destroy().await.unwrap();
    bridge.finish().await;
}
