//! Fill a sandbox pool, print the pool's instance id, and crash (abort: no
//! `shutdown`, no `Drop`), leaving the pooled containers behind as a killed
//! process would. The pool tests check that the next provider reaps them.
//!
//! ```text
//! cargo run -p sandbox-docker --example pool_crash -- [POOL_SIZE]
//! ```

use std::time::Duration;

use harness_core::sandbox::{SandboxProvider, SandboxSpec};
use sandbox_docker::{DockerConfig, DockerProvider};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let size: usize = std::env::args()
        .nth(1)
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(2);
    let image =
        std::env::var("HARNESS_TEST_IMAGE").unwrap_or_else(|_| "harness-test:bookworm".into());
    let provider = DockerProvider::connect(DockerConfig {
        default_image: image,
        pool_size: size,
        ..DockerConfig::default()
    })
    .await?;
    let mut spec = SandboxSpec::new("/work");
    spec.session_id = Some("pool-crash".into());
    provider.create(&spec).await?.destroy().await?;
    anyhow::ensure!(
        provider.pool_settled(Duration::from_secs(60)).await,
        "the pool did not settle"
    );
    anyhow::ensure!(
        provider.pool_ready() == size,
        "{} ready",
        provider.pool_ready()
    );
    println!("{}", provider.pool_instance().unwrap_or_default());
    std::process::abort();
}
