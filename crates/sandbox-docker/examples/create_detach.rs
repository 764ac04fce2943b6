//! Create a Docker sandbox, write a file, optionally stop it, and print its
//! handle as JSON on stdout: another process resumes it from that line.
//!
//! ```text
//! cargo run -p sandbox-docker --example create_detach -- \
//!     [--image IMG] [--write PATH=CONTENT] [--stop] [--bootstrap NONCE]
//! ```
//!
//! `--bootstrap NONCE` adds a recipe whose command records when it ran in
//! `/bootstrap-ran` (the NONCE makes the recipe identity unique); the tests
//! use it to check that the recipe runs once across processes.

use harness_core::bootstrap::BootstrapRecipe;
use harness_core::sandbox::{SandboxProvider, SandboxSpec};
use sandbox_docker::{DockerConfig, DockerProvider};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let mut image =
        std::env::var("HARNESS_TEST_IMAGE").unwrap_or_else(|_| "harness-test:bookworm".into());
    let mut writes = Vec::new();
    let mut stop = false;
    let mut nonce = None;
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--image" => {
                image = args
                    .next()
                    .ok_or_else(|| anyhow::anyhow!("--image needs a value"))?
            }
            "--write" => {
                let spec = args
                    .next()
                    .ok_or_else(|| anyhow::anyhow!("--write needs PATH=CONTENT"))?;
                let (path, content) = spec
                    .split_once('=')
                    .ok_or_else(|| anyhow::anyhow!("--write needs PATH=CONTENT, got {spec:?}"))?;
                writes.push((path.to_string(), content.to_string()));
            }
            "--stop" => stop = true,
            "--bootstrap" => {
                nonce = Some(
                    args.next()
                        .ok_or_else(|| anyhow::anyhow!("--bootstrap needs a nonce"))?,
                )
            }
            other => anyhow::bail!("unknown argument {other:?}"),
        }
    }
    let provider = DockerProvider::connect(DockerConfig {
        default_image: image,
        ..DockerConfig::default()
    })
    .await?;
    let mut spec = SandboxSpec::new("/work");
    spec.session_id = Some(format!("example-{}", std::process::id()));
    if let Some(nonce) = nonce {
        spec.bootstrap = Some(BootstrapRecipe {
            files: vec![],
            bootstrap_pre_commands: vec![format!("echo {nonce} > /bootstrap-nonce")],
            // The sleep widens the window in which a second first session
            // would run the recipe again if the lock did not hold.
            commands: vec!["sleep 1; date +%s%N > /bootstrap-ran".into()],
        });
    }
    let sandbox = provider.create(&spec).await?;
    for (path, content) in writes {
        sandbox
            .write_file(&path, harness_core::stream::once(content))
            .await?;
    }
    let handle = if stop {
        sandbox.stop().await?
    } else {
        sandbox.detach().await?
    };
    println!("{}", serde_json::to_string(&handle)?);
    Ok(())
}
