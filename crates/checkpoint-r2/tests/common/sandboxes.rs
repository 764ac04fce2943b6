//! Sandboxes on both real providers, and a provider-neutral description of
//! a tree (read through the sandbox's own `exec`), so trees can be compared
//! across local and Docker sandboxes.

use sandbox_docker::{DockerConfig, DockerProvider};

/// The Docker test image: `HARNESS_TEST_IMAGE`, else `harness-test:bookworm`.
pub fn image() -> String {
    std::env::var("HARNESS_TEST_IMAGE")
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "harness-test:bookworm".into())
}

/// A Docker provider with the test image as default, or `None` after a skip
/// (a failure under `HARNESS_REQUIRE_REAL=1`).
pub async fn docker() -> Option<DockerProvider> {
    let config = DockerConfig {
        default_image: image(),
        ..DockerConfig::default()
    };
    let provider = match DockerProvider::connect(config).await {
        Ok(p) => p,
        Err(e) => {
            super::skip_or_fail(&format!("no docker engine answers: {e}"));
            return None;
        }
    };
    if provider.client().inspect_image(&image()).await.is_err() {
        super::skip_or_fail(&format!(
            "docker image {} is missing (build it with `cargo xtask image`)",
            image()
        ));
        return None;
    }
    Some(provider)
}

// Not every test binary uses every helper.
#[allow(unused_imports)]
pub use harness_testkit::trees::{assert_overlaid, listing, make_tree, prepare_target, sh};

/// A tar whose entries are written with raw header names, so it can hold
/// what the `tar` crate's safe setters refuse (`..`).
pub fn raw_tar(entries: &[(&str, tar::EntryType, &str, &[u8])]) -> Vec<u8> {
    let mut builder = tar::Builder::new(Vec::new());
    for (name, kind, link, data) in entries {
        let mut header = tar::Header::new_ustar();
        let raw = header.as_old_mut();
        raw.name = [0; 100];
        raw.name[..name.len()].copy_from_slice(name.as_bytes());
        if !link.is_empty() {
            raw.linkname = [0; 100];
            raw.linkname[..link.len()].copy_from_slice(link.as_bytes());
        }
        header.set_entry_type(*kind);
        header.set_mode(if *kind == tar::EntryType::Symlink {
            0o777
        } else {
            0o644
        });
        header.set_size(data.len() as u64);
        header.set_mtime(1_700_000_000);
        header.set_cksum();
        builder.append(&header, *data).unwrap();
    }
    builder.into_inner().unwrap()
}

/// A new local sandbox of `provider`, its workdir `/workspace`.
pub async fn fresh_local(
    provider: &sandbox_local::LocalProvider,
) -> Box<dyn harness_core::sandbox::Sandbox> {
    use harness_core::sandbox::SandboxProvider;
    provider
        .create(&harness_core::sandbox::SandboxSpec::new("/workspace"))
        .await
        .unwrap()
}

/// The wall clock, as tree checkpoints' locks read it.
pub fn wall_clock() -> harness_core::clock::FnClock<impl Fn() -> u64 + Send + Sync> {
    harness_core::clock::FnClock(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64
    })
}
