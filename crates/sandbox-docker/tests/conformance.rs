//! The shared sandbox conformance suite against the real Docker engine.

mod common;

use harness_core::sandbox::{SandboxProvider, SandboxSpec};
use harness_testkit::conformance::sandbox::{self as suite, Capability, SuiteOptions};

/// Whether the test image has a program the suite's port check can serve
/// with (`python3` or `nc`).
async fn image_can_serve(provider: &dyn SandboxProvider) -> bool {
    let sb = provider.create(&SandboxSpec::new("/")).await.unwrap();
    let out = common::sh(&*sb, "command -v python3 || command -v nc").await;
    sb.destroy().await.unwrap();
    out.status.success()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn docker_passes_the_sandbox_conformance_suite() {
    // The gate serves the host forwards inside the containers, and runs
    // the commands through its exec server, as `harness serve` has them
    // (the engine's exec, its fallback, is what the rest of this crate's
    // tests use).
    let exec_root = tempfile::tempdir().unwrap();
    let Some(provider) = common::provider_with_exec_server(exec_root.path()).await else {
        return;
    };
    let Some(gateway) = common::bridge_gateway(&provider).await else {
        harness_testkit::skip_or_fail("cannot find the docker bridge gateway address");
        return;
    };
    let mut spec = SandboxSpec::new("/work");
    spec.session_id = Some("conformance".into());
    let options = SuiteOptions {
        host_address: Some(gateway.into()),
        ..SuiteOptions::default()
    };
    // Docker offers every optional capability: `Unsupported` would be a
    // regression here, although the suite accepts it in general.
    let every_optional_item = [
        "port_endpoint",
        "stop_and_resume",
        "network_deny_all",
        "host_forward",
        "network_custom",
    ];
    let can_serve = image_can_serve(&provider).await;
    if can_serve {
        let report = match suite::run_all_with(&provider, spec.clone(), &options).await {
            Ok(report) => report,
            Err(e) => panic!("{e:#}"),
        };
        for item in every_optional_item {
            assert_eq!(report.capability(item), &Capability::Supported, "{item}");
        }
    } else {
        // Everything but the port item, which needs a server program the
        // image lacks (this crate's own `ports_publish_on_distinct_free_host_ports`
        // covers ports with perl meanwhile).
        let sandbox = provider.create(&spec).await.unwrap();
        let sb = sandbox.as_ref();
        suite::command_and_file_items(sb).await.unwrap();
        suite::tar_round_trip(sb).await.unwrap();
        suite::import_refuses_escaping_entries(sb).await.unwrap();
        suite::large_file_round_trip(sb, "suite/large.bin", options.large_file_bytes)
            .await
            .unwrap();
        sandbox.destroy().await.unwrap();
        suite::exec_env(&provider, &spec).await.unwrap();
        suite::detach_and_resume(&provider, &spec).await.unwrap();
        suite::destroy_is_idempotent(&provider, &spec)
            .await
            .unwrap();
        let answers = [
            suite::stop_and_resume(&provider, &spec).await,
            suite::network_deny_all(&provider, &spec, &options).await,
            suite::host_forward(&provider, &spec).await,
            suite::network_custom(&provider, &spec, &options).await,
        ];
        for (item, answer) in every_optional_item[1..].iter().zip(answers) {
            assert_eq!(
                answer.unwrap_or_else(|e| panic!("{item}: {e:#}")),
                Capability::Supported,
                "{item}"
            );
        }
    }
    if !can_serve {
        harness_testkit::skip_or_fail(&format!(
            "image {} has neither python3 nor nc for the suite's port_endpoint item \
                 (every other item ran and passed)",
            common::image()
        ));
    }
}
