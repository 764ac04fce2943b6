//! Shared setup: a provider on the real engine, or a skip (a failure under
//! `HARNESS_REQUIRE_REAL=1`).
#![allow(dead_code)]

use harness_core::sandbox::{collect_exec, ExecOutput, ExecRequest, Sandbox};
use sandbox_docker::{DockerConfig, DockerProvider};

/// The test image: `HARNESS_TEST_IMAGE`, else `harness-test:bookworm`.
pub fn image() -> String {
    std::env::var("HARNESS_TEST_IMAGE")
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "harness-test:bookworm".into())
}

/// A provider on the local engine with the test image as default, or `None`
/// (after printing why) when no engine or image is there.
pub async fn provider() -> Option<DockerProvider> {
    provider_with(DockerConfig::default()).await
}

/// Like [`provider`], starting from `config`.
pub async fn provider_with(mut config: DockerConfig) -> Option<DockerProvider> {
    config.default_image = image();
    let provider = match DockerProvider::connect(config).await {
        Ok(p) => p,
        Err(e) => {
            harness_testkit::skip_or_fail(&format!("no docker engine answers: {e}"));
            return None;
        }
    };
    if provider.client().inspect_image(&image()).await.is_err() {
        harness_testkit::skip_or_fail(&format!(
            "docker image {} is missing (build it with `cargo xtask image`)",
            image()
        ));
        return None;
    }
    Some(provider)
}

/// A provider whose containers run commands through their exec server
/// (the gate's, exec directories under `exec_root`), or `None` (after
/// saying why) without the gate or an engine.
pub async fn provider_with_exec_server(exec_root: &std::path::Path) -> Option<DockerProvider> {
    let gate = harness_testkit::gate_binary()?;
    provider_with(DockerConfig {
        gate: Some(gate),
        exec_dir: Some(exec_root.to_path_buf()),
        ..DockerConfig::default()
    })
    .await
}

/// Run a shell script and collect its output.
pub async fn sh(sandbox: &dyn Sandbox, script: &str) -> ExecOutput {
    collect_exec(sandbox.exec(ExecRequest::shell(script)).await.unwrap())
        .await
        .unwrap()
}

/// Run a shell script that must succeed; its stdout.
pub async fn sh_ok(sandbox: &dyn Sandbox, script: &str) -> String {
    let out = sh(sandbox, script).await;
    assert!(
        out.status.success(),
        "{script:?} failed: {:?} {}",
        out.status,
        out.stderr_str()
    );
    out.stdout_str()
}

/// Destroys the sandbox when dropped, so a failing test leaves no container.
pub struct Cleanup(pub Option<String>);

impl Drop for Cleanup {
    fn drop(&mut self) {
        if let Some(id) = self.0.take() {
            let _ = std::process::Command::new("docker")
                .args(["rm", "-f", &id])
                .output();
        }
    }
}

/// The bridge network's gateway (an address of this machine that an
/// allow-all container reaches), read from a container's default route.
pub async fn bridge_gateway(provider: &DockerProvider) -> Option<std::net::Ipv4Addr> {
    use harness_core::sandbox::{SandboxProvider, SandboxSpec};
    let sb = provider.create(&SandboxSpec::new("/")).await.ok()?;
    let hex = sh(&*sb, "awk '$2==\"00000000\"{print $3}' /proc/net/route").await;
    let _ = sb.destroy().await;
    let raw = u32::from_str_radix(hex.stdout_str().trim(), 16).ok()?;
    // /proc/net/route prints the address in host (little-endian) order.
    Some(std::net::Ipv4Addr::from(raw.swap_bytes()))
}

/// How many execs the engine created in container `id` between `since`
/// (unix seconds) and now: each command that went through the engine's
/// exec API is one.
pub async fn engine_execs(
    provider: &sandbox_docker::DockerProvider,
    id: &str,
    since: u64,
) -> usize {
    use bollard::query_parameters::EventsOptionsBuilder;
    let until = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 1;
    let filters =
        std::collections::HashMap::from([("container", vec![id]), ("type", vec!["container"])]);
    let options = EventsOptionsBuilder::new()
        .since(&since.to_string())
        .until(&until.to_string())
        .filters(&filters)
        .build();
    let events: Vec<_> = futures::StreamExt::collect(provider.client().events(Some(options))).await;
    events
        .into_iter()
        .filter_map(Result::ok)
        .filter(|e| {
            e.action
                .as_deref()
                .is_some_and(|a| a.starts_with("exec_create"))
        })
        .count()
}

pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}
