//! What a caller keeps of a running sandbox and changes while it runs:
//! its filesystem as an image (`Sandbox::snapshot_image`, a `docker commit`)
//! and its route out (`Sandbox::set_network`, a firewall in its network
//! namespace set from the host).

use bollard::models::{ContainerConfig, NetworkConnectRequest};
use bollard::query_parameters::CommitContainerOptionsBuilder;
use bollard::Docker;
use harness_core::sandbox::NetworkPolicy;
use harness_core::{Error, Result};

use crate::{docker_err, DockerSandbox};

/// The repository of the images [`commit`] makes.
pub(crate) const IMAGE_REPO: &str = "harness-sandbox-image";

/// The network a sandbox with a route out is on.
const BRIDGE: &str = "bridge";

/// Commit `sandbox`'s container as `harness-sandbox-image:<name>`.
///
/// The image keeps the base image's environment, not the container's: a
/// sandbox made from it gets its own spec's variables, never those of the
/// sandbox it was taken from.
pub(crate) async fn commit(sandbox: &DockerSandbox, name: &str) -> Result<String> {
    if name.is_empty()
        || name.len() > 120
        || !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
        || name.starts_with(['.', '-'])
    {
        return Err(Error::invalid(format!(
            "image name {name:?}: use 1-120 letters, digits, '-', '_' or '.', not starting with '.' or '-'"
        )));
    }
    let docker = &sandbox.docker;
    let info = docker
        .inspect_container(&sandbox.id, None)
        .await
        .map_err(|e| docker_err("inspecting the container to commit", e))?;
    let image = info.config.as_ref().and_then(|c| c.image.clone());
    let base_env = match &image {
        Some(image) => docker
            .inspect_image(image)
            .await
            .ok()
            .and_then(|i| i.config)
            .and_then(|c| c.env)
            .unwrap_or_default(),
        None => Vec::new(),
    };
    let tag = name.to_ascii_lowercase();
    let options = CommitContainerOptionsBuilder::new()
        .container(&sandbox.id)
        .repo(IMAGE_REPO)
        .tag(&tag)
        .comment("harness sandbox image (Sandbox::snapshot_image)")
        .changes(&format!(
            "LABEL {}.managed-by=harness",
            sandbox.label_prefix
        ))
        .build();
    let config = ContainerConfig {
        env: Some(base_env),
        ..Default::default()
    };
    docker
        .commit_container(options, config)
        .await
        .map_err(|e| docker_err(&format!("committing {IMAGE_REPO}:{tag}"), e))?;
    Ok(format!("{IMAGE_REPO}:{tag}"))
}

/// The chain [`set_network`] puts in front of a container's `OUTPUT`.
const CHAIN: &str = "HARNESS-EGRESS";

/// Give container `id` a route out (`allow-all`) or take it away
/// (anything else) while it runs, keeping what reaches it from the host:
/// its published ports, and its forwards (bind mounts).
///
/// Taking the route away installs a firewall in the container's network
/// namespace, from the host (`nsenter -n` + `iptables`/`ip6tables`): its
/// own loopback and the replies of connections made *to* it pass, every
/// connection it starts is refused. Disconnecting it from its network
/// would also drop its published ports (a port URL, the AI SDK's bridge).
/// A container has no `NET_ADMIN` (Docker's default capabilities), so
/// root inside cannot undo it. The rules live in the namespace: a caller
/// that stops and starts the container applies them again. Idempotent.
pub(crate) async fn set_network(docker: &Docker, id: &str, policy: &NetworkPolicy) -> Result<()> {
    let info = docker
        .inspect_container(id, None)
        .await
        .map_err(|e| docker_err("inspecting the container", e))?;
    let mode = info
        .host_config
        .as_ref()
        .and_then(|h| h.network_mode.clone())
        .unwrap_or_default();
    if mode == "none" {
        return match policy {
            NetworkPolicy::AllowAll => Err(Error::unsupported(
                "this container was created with --network none: it cannot be given a route \
                 out (create it with allow-all to change its policy later)",
            )),
            _ => Ok(()),
        };
    }
    let pid = info
        .state
        .as_ref()
        .and_then(|s| s.pid)
        .filter(|p| *p > 0)
        .ok_or_else(|| {
            Error::conflict("the container is not running: start it before changing its network")
        })?;
    let networks: Vec<String> = info
        .network_settings
        .and_then(|n| n.networks)
        .map(|n| n.into_keys().filter(|k| k != "none").collect())
        .unwrap_or_default();
    if matches!(policy, NetworkPolicy::AllowAll) && !networks.iter().any(|n| n == BRIDGE) {
        docker
            .connect_network(
                BRIDGE,
                NetworkConnectRequest {
                    container: id.to_string(),
                    endpoint_config: None,
                },
            )
            .await
            .map_err(|e| docker_err("connecting the container to the bridge network", e))?;
    }
    let script = match policy {
        NetworkPolicy::AllowAll => format!(
            "for t in iptables ip6tables; do \
               $t -w -D OUTPUT -j {CHAIN} 2>/dev/null; $t -w -F {CHAIN} 2>/dev/null; $t -w -X {CHAIN} 2>/dev/null; \
             done; true"
        ),
        NetworkPolicy::DenyAll | NetworkPolicy::Custom { .. } => format!(
            "set -e; for t in iptables ip6tables; do \
               if ! $t -w -L OUTPUT -n >/dev/null 2>&1; then [ $t = ip6tables ] && continue; exit 3; fi; \
               $t -w -N {CHAIN} 2>/dev/null || $t -w -F {CHAIN}; \
               $t -w -A {CHAIN} -o lo -j ACCEPT; \
               $t -w -A {CHAIN} -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT; \
               $t -w -A {CHAIN} -p tcp -j REJECT --reject-with tcp-reset; \
               $t -w -A {CHAIN} -j REJECT; \
               $t -w -C OUTPUT -j {CHAIN} 2>/dev/null || $t -w -I OUTPUT -j {CHAIN}; \
             done"
        ),
    };
    let out = tokio::process::Command::new("nsenter")
        .args(["-t", &pid.to_string(), "-n", "sh", "-c", &script])
        .output()
        .await
        .map_err(|e| {
            Error::unsupported(format!(
                "changing a container's network needs nsenter and iptables on the Docker host: {e}"
            ))
        })?;
    if !out.status.success() {
        return Err(Error::unsupported(format!(
            "could not change the network of container {id} from the host (root, nsenter and \
             iptables are needed; exit {}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}
