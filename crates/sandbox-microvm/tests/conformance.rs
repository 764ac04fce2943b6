//! The shared sandbox conformance suite against real QEMU microVMs (TCG
//! where KVM cannot boot a guest, as on the CI machines).

mod common;

use harness_core::sandbox::SandboxSpec;
use harness_testkit::conformance::sandbox::{self as suite, Capability, SuiteOptions};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn microvm_passes_the_sandbox_conformance_suite() {
    let Some((provider, _state)) = common::provider() else {
        return;
    };
    let mut spec = SandboxSpec::new("/work");
    spec.session_id = Some("conformance".into());
    let options = SuiteOptions {
        // The guest reaches the host's loopback as 10.0.2.2 (user-mode
        // networking), not at an address the suite can listen on; this
        // crate's own `allow_all_reaches_the_host_and_deny_all_nothing`
        // covers reachability.
        host_address: None,
        // Files cross virtio-serial under TCG: 32 MiB keeps the run short.
        large_file_bytes: 32 * 1024 * 1024,
    };
    let started = std::time::Instant::now();
    let report = match suite::run_all_with(&provider, spec.clone(), &options).await {
        Ok(report) => report,
        Err(e) => panic!("{e:#}"),
    };
    println!(
        "suite took {:?} (accel {:?})",
        started.elapsed(),
        provider.accel().await
    );
    // A VM has its own ports, stops and resumes from its disk, and its
    // network is the host's to cut.
    for item in ["port_endpoint", "stop_and_resume", "network_deny_all"] {
        assert_eq!(report.capability(item), &Capability::Supported, "{item}");
    }
}
