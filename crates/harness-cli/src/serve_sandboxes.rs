//! The sandbox API of `harness serve` (`/v1/sandboxes`, `docs/ai-sdk.md`):
//! which providers it offers and what their sandboxes are given.
//!
//! - `local` (under the home's `sandboxes/`, like sessions' local
//!   sandboxes) and `docker` (when an engine answers).
//! - Node 22 and pnpm for the AI SDK's in-sandbox bridge: the directory
//!   `$HARNESS_SANDBOX_TOOLS` (else `$HARNESS_CACHE/tools/node22`, where
//!   `cargo xtask deps` installs them), with `bin/node` and `bin/pnpm`. A
//!   container gets it read-only at `/opt/harness/tools` and its `bin` on
//!   `PATH`; a local sandbox gets the host directory's `bin` on `PATH`.
//! - The host's CA bundle (`/etc/ssl/certs/ca-certificates.crt`) as
//!   `NODE_EXTRA_CA_CERTS`, mounted read-only into containers: `pnpm
//!   install` inside then trusts what the host trusts (a registry proxy's
//!   CA among them).

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::Result;
use harness::server::sandboxes::{SandboxApi, SandboxRegistry};
use harness::server::TokenGrant;

use crate::home::Home;

/// Where the tools directory goes inside a container.
#[cfg(feature = "docker")]
const TOOLS_IN_CONTAINER: &str = "/opt/harness/tools";
/// Where the host's CA bundle goes inside a container.
#[cfg(feature = "docker")]
const CA_IN_CONTAINER: &str = "/opt/harness/ca-certificates.crt";
pub(crate) const HOST_CA: &str = "/etc/ssl/certs/ca-certificates.crt";
#[cfg(feature = "docker")]
const CONTAINER_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// The tools directory, if there is one.
fn tools_dir() -> Option<PathBuf> {
    let dir = match std::env::var_os("HARNESS_SANDBOX_TOOLS") {
        Some(d) if !d.is_empty() => PathBuf::from(d),
        _ => {
            let cache =
                std::env::var("HARNESS_CACHE").unwrap_or_else(|_| "/var/cache/harness".into());
            PathBuf::from(cache).join("tools").join("node22")
        }
    };
    dir.join("bin").join("node").is_file().then_some(dir)
}

/// Where identity snapshots are recorded: `$HARNESS_SANDBOX_SNAPSHOTS`,
/// else the home's `sandbox-api/snapshots` (the tests share one directory
/// per machine, so a bootstrap made by one test run is reused by the next).
fn snapshots_dir(home: &Home) -> PathBuf {
    match std::env::var_os("HARNESS_SANDBOX_SNAPSHOTS") {
        Some(d) if !d.is_empty() => PathBuf::from(d),
        _ => home
            .sandboxes()
            .with_file_name("sandbox-api")
            .join("snapshots"),
    }
}

/// The API over this machine's providers, with the server's grants.
pub async fn sandbox_api(
    home: &Home,
    tokens: Vec<TokenGrant>,
    insecure: bool,
    image: Option<&str>,
) -> Result<SandboxApi> {
    let tools = tools_dir();
    let ca = std::path::Path::new(HOST_CA).is_file();
    let mut registry = SandboxRegistry::new(home.sandboxes().with_file_name("sandbox-api"))
        .auth(tokens, insecure)
        .snapshots_dir(snapshots_dir(home))
        .provider("local", crate::local::provider(home, "local", None).await?);
    let mut local_env = BTreeMap::new();
    if let Some(tools) = &tools {
        let host_path = std::env::var("PATH").unwrap_or_default();
        local_env.insert(
            "PATH".to_string(),
            format!("{}:{host_path}", tools.join("bin").display()),
        );
    }
    if ca {
        local_env.insert("NODE_EXTRA_CA_CERTS".to_string(), HOST_CA.to_string());
    }
    registry = registry.provider_env("local", local_env);

    #[cfg(feature = "docker")]
    {
        registry = with_docker(registry, home, image, tools.as_deref(), ca).await?;
    }
    #[cfg(not(feature = "docker"))]
    let _ = image;
    Ok(registry.start().await?)
}

/// The registry with Docker sandboxes, when an engine answers: the Node 22
/// tools and the host's CA bundle mounted, the home's gate and default
/// image (`crate::local::docker_config`).
#[cfg(feature = "docker")]
async fn with_docker(
    mut registry: SandboxRegistry,
    home: &Home,
    image: Option<&str>,
    tools: Option<&std::path::Path>,
    ca: bool,
) -> Result<SandboxRegistry> {
    let mut config = crate::local::docker_config(home, image)?;
    let mut docker_env = BTreeMap::new();
    if let Some(tools) = &tools {
        config.bind_mounts.push(harness::docker::BindMount {
            host: tools.display().to_string(),
            container: TOOLS_IN_CONTAINER.into(),
            read_only: true,
        });
        docker_env.insert(
            "PATH".to_string(),
            format!("{TOOLS_IN_CONTAINER}/bin:{CONTAINER_PATH}"),
        );
    }
    if ca {
        config.bind_mounts.push(harness::docker::BindMount {
            host: HOST_CA.into(),
            container: CA_IN_CONTAINER.into(),
            read_only: true,
        });
        docker_env.insert(
            "NODE_EXTRA_CA_CERTS".to_string(),
            CA_IN_CONTAINER.to_string(),
        );
    }
    let connect = harness::docker::DockerProvider::connect(config);
    match tokio::time::timeout(std::time::Duration::from_secs(10), connect).await {
        Ok(Ok(docker)) => {
            registry = registry
                .provider("docker", std::sync::Arc::new(docker))
                .provider_env("docker", docker_env);
        }
        _ => eprintln!(
            "note: the sandbox API offers no docker sandboxes (no Docker engine answered)"
        ),
    }
    Ok(registry)
}
