//! The Docker containers a test's sessions made, found by the provider's
//! labels: listing, inspecting, running a command in, and removing them.

#![allow(dead_code)]

use std::process::{Command, Stdio};

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
