//! The bridge the tests talk to: a real deployed bridge when
//! `HARNESS_CF_BRIDGE_URL` and `HARNESS_CF_TOKEN` are set, else the test
//! kit's bridge-compatible server backed by the real Docker engine, with
//! every request and response validated against the bridge's pinned
//! OpenAPI document.
#![allow(dead_code)]

use std::sync::Arc;

use harness_core::sandbox::SandboxSpec;
use harness_testkit::bridge::{BridgeServer, BridgeServerConfig, OpenApi};
use sandbox_cloudflare::{CloudflareConfig, CloudflareProvider};
use sandbox_docker::DockerProvider;

/// A Docker provider on the test image, or `None` after a skip (a failure
/// under `HARNESS_REQUIRE_REAL=1`).
pub async fn docker() -> Option<DockerProvider> {
    harness_agent_e2e::docker_image_provider().await
}

/// A bridge and a provider talking to it.
pub struct TestBridge {
    /// The test server (absent against a real bridge).
    pub server: Option<BridgeServer>,
    /// The provider under test.
    pub provider: CloudflareProvider,
    /// The token the bridge takes.
    pub token: String,
    /// The bridge's base URL.
    pub url: String,
}

impl TestBridge {
    /// Fail on any OpenAPI violation the server saw, then stop it and
    /// destroy what is left.
    pub async fn finish(self) {
        if let Err(e) = self.finish_checked().await {
            panic!("{e}");
        }
    }

    /// [`finish`](Self::finish), returning the violations instead of
    /// panicking (so a test can report them beside its own failure).
    pub async fn finish_checked(self) -> Result<(), String> {
        let Some(server) = self.server else {
            return Ok(());
        };
        let checked = server.check();
        server
            .shutdown()
            .await
            .expect("shutting the bridge server down");
        checked.map_err(|e| {
            format!(
                "the bridge saw requests or answered responses outside its OpenAPI contract:\n{e:#}"
            )
        })
    }
}

pub const TOKEN: &str = "test-bridge-token";

/// The bridge for this test run (see the module docs), or `None` after a
/// skip.
pub async fn bridge() -> Option<TestBridge> {
    if let Ok(config) = CloudflareConfig::from_env() {
        println!(
            "running against the real Cloudflare bridge at {}",
            config.url
        );
        let provider = CloudflareProvider::new(config.clone()).expect("provider");
        return Some(TestBridge {
            server: None,
            provider,
            token: config.token,
            url: config.url,
        });
    }
    let docker = docker().await?;
    let openapi = match OpenApi::pinned() {
        Ok(o) => o,
        Err(e) => {
            harness_testkit::skip_or_fail(&format!("the bridge's OpenAPI document: {e:#}"));
            return None;
        }
    };
    let server = BridgeServer::start(
        Arc::new(docker),
        BridgeServerConfig {
            token: TOKEN.into(),
            spec: SandboxSpec::new("/workspace"),
            openapi: Some(openapi),
        },
    )
    .await
    .expect("starting the bridge-compatible server");
    let url = server.url();
    let provider = CloudflareProvider::new(CloudflareConfig::new(url.clone(), TOKEN)).unwrap();
    Some(TestBridge {
        server: Some(server),
        provider,
        token: TOKEN.into(),
        url,
    })
}
