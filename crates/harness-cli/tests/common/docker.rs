//! The Docker containers a test's sessions made, found by the provider's
//! labels: listing, inspecting, running a command in, and removing them;
//! and what a Docker test needs from the machine (image, bridge gateway).

#![allow(dead_code)]

use std::net::{IpAddr, Ipv4Addr};
use std::process::{Command, Stdio};

use harness_testkit::{require_env, skip_or_fail};

/// `docker ps` for the session containers the Docker provider made for
/// `session`: full ids, one a line. Found by the session's label, or, for
/// a container the session took from `harness serve`'s pool (made before
/// the session, so without its label), by the name it was given then
/// (`harness-<session>-slot-<turn>`, or a random suffix without a slot).
pub fn docker_ps_session(session: &str) -> std::io::Result<std::process::Output> {
    let ps = |filter: String| {
        Command::new("docker")
            .args([
                "ps",
                "-a",
                "-q",
                "--no-trunc",
                "--filter",
                &filter,
                "--filter",
                "label=dev.harness.role=session",
            ])
            .output()
    };
    let by_label = ps(format!("label=dev.harness.session-id={session}"))?;
    if !by_label.status.success() {
        return Ok(by_label);
    }
    let clean = harness::core::sandbox::name_part(session);
    let by_name = ps(format!(
        "name=^/harness-{clean}-(slot-[A-Za-z0-9_-]+|[0-9a-f]{{10}})$"
    ))?;
    if !by_name.status.success() {
        return Ok(by_name);
    }
    let mut ids: Vec<String> = Vec::new();
    for out in [&by_label, &by_name] {
        for id in String::from_utf8_lossy(&out.stdout).split_whitespace() {
            if !ids.iter().any(|i| i == id) {
                ids.push(id.to_string());
            }
        }
    }
    Ok(std::process::Output {
        stdout: ids.join("\n").into_bytes(),
        ..by_label
    })
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
