//! The Docker containers a test's sessions made, found by the provider's
//! labels: listing, inspecting, running a command in, and removing them;
//! and what a Docker test needs from the machine (image, bridge gateway).

#![allow(dead_code)]

use std::net::{IpAddr, Ipv4Addr};
use std::process::{Command, Stdio};

use harness_testkit::{require_env, skip_or_fail};

/// `docker ps` for the session containers the Docker provider made for
/// `session` (by its labels): full ids.
pub fn docker_ps_session(session: &str) -> std::io::Result<std::process::Output> {
    Command::new("docker")
        .args([
            "ps",
            "-a",
            "-q",
            "--no-trunc",
            "--filter",
            &format!("label=dev.harness.session-id={session}"),
            "--filter",
            "label=dev.harness.role=session",
        ])
        .output()
}

/// The session's containers (full ids).
pub fn session_containers(session: &str) -> Vec<String> {
    let out = docker_ps_session(session).unwrap();
    assert!(
        out.status.success(),
        "docker ps: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .map(str::to_string)
        .collect()
}

/// A container's working directory (the sandbox's workdir).
pub fn container_workdir(container: &str) -> String {
    let out = Command::new("docker")
        .args(["inspect", "--format", "{{.Config.WorkingDir}}", container])
        .output()
        .unwrap();
    assert!(out.status.success(), "docker inspect {container}");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// Removes a session's containers when dropped, so a failing test leaves
/// none behind.
pub struct SessionContainers(pub String);

impl Drop for SessionContainers {
    fn drop(&mut self) {
        // No assertion here: this also runs while a failed test unwinds.
        let Ok(out) = docker_ps_session(&self.0) else {
            return;
        };
        for id in String::from_utf8_lossy(&out.stdout).split_whitespace() {
            let _ = Command::new("docker")
                .args(["rm", "-f", id])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
    }
}

/// `docker exec <container> sh -c <script>`: (success, stdout).
pub fn docker_sh(container: &str, script: &str) -> (bool, String) {
    let out = Command::new("docker")
        .args(["exec", container, "sh", "-c", script])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).to_string(),
    )
}

/// The test image (`HARNESS_TEST_IMAGE`) and the bridge gateway, or `None`
/// after a skip (a failure under `HARNESS_REQUIRE_REAL=1`).
pub fn docker_parts() -> Option<(String, IpAddr)> {
    let image = require_env("HARNESS_TEST_IMAGE")?;
    let inspect = Command::new("docker")
        .args(["image", "inspect", "--format", "{{.Id}}", &image])
        .output();
    match inspect {
        Ok(out) if out.status.success() => {}
        Ok(out) => {
            skip_or_fail(&format!(
                "docker image {image} is not usable (build it with `cargo xtask image`): {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
            return None;
        }
        Err(e) => {
            skip_or_fail(&format!("no docker CLI: {e}"));
            return None;
        }
    }
    let Some(gateway) = bridge_gateway() else {
        skip_or_fail("cannot find the docker bridge gateway address");
        return None;
    };
    Some((image, gateway))
}

/// The default bridge network's gateway, from `docker network inspect
/// bridge`; dockerd may leave `Gateway` out, and then uses the first
/// address of the subnet. The model server binds there, so a wrong guess
/// fails the bind instead of sending traffic elsewhere.
pub fn bridge_gateway() -> Option<IpAddr> {
    let out = Command::new("docker")
        .args([
            "network",
            "inspect",
            "bridge",
            "--format",
            "{{range .IPAM.Config}}{{.Gateway}}|{{.Subnet}}\n{{end}}",
        ])
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let configs: Vec<(&str, &str)> = text.lines().filter_map(|l| l.split_once('|')).collect();
    if let Some(gw) = configs.iter().find_map(|(gw, _)| gw.parse::<IpAddr>().ok()) {
        return Some(gw);
    }
    configs.iter().find_map(|(_, subnet)| {
        let net: Ipv4Addr = subnet.split_once('/')?.0.parse().ok()?;
        Some(IpAddr::V4(Ipv4Addr::from(u32::from(net) + 1)))
    })
}
