//! What a caller keeps of a running sandbox and changes while it runs:
//! its filesystem as an image (`Sandbox::snapshot_image`, a `docker commit`)
//! and its route out (`Sandbox::set_network`, a connect to or disconnect
//! from the default bridge network).

use bollard::models::{ContainerConfig, NetworkConnectRequest, NetworkDisconnectRequest};
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
        .changes(&format!("LABEL {}.managed-by=harness", sandbox.label_prefix))
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

/// Connect container `id` to the default bridge (`allow-all`) or
/// disconnect it from every network it is on (anything else): its
/// forwards stay, they are bind mounts. Idempotent.
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
    let networks: Vec<String> = info
        .network_settings
        .and_then(|n| n.networks)
        .map(|n| n.into_keys().filter(|k| k != "none").collect())
        .unwrap_or_default();
    match policy {
        NetworkPolicy::AllowAll => {
            if mode == "none" {
                return Err(Error::unsupported(
                    "this container was created with --network none: it cannot be given a route \
                     out (create it with allow-all to change its policy later)",
                ));
            }
            if networks.iter().any(|n| n == BRIDGE) {
                return Ok(());
            }
            docker
                .connect_network(
                    BRIDGE,
                    NetworkConnectRequest {
                        container: id.to_string(),
                        endpoint_config: None,
                    },
                )
                .await
                .map_err(|e| docker_err("connecting the container to the bridge network", e))
        }
        NetworkPolicy::DenyAll | NetworkPolicy::Custom { .. } => {
            for network in networks {
                docker
                    .disconnect_network(
                        &network,
                        NetworkDisconnectRequest {
                            container: id.to_string(),
                            force: Some(true),
                        },
                    )
                    .await
                    .map_err(|e| {
                        docker_err(&format!("disconnecting the container from {network}"), e)
                    })?;
            }
            Ok(())
        }
    }
}
