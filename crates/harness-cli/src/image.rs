//! `harness image build`: the Docker image sessions start from when they
//! name none (`harness/debian:bookworm`), made on this machine from the
//! Debian mirror apt uses — no image registry needed. A Docker session
//! makes it on first use too; this command makes it ahead of time, or
//! again (`--force`), or under another tag.

#[cfg(feature = "docker")]
use anyhow::Context;
use anyhow::Result;

use crate::home::Home;

/// `harness image` subcommands.
#[derive(Debug, clap::Subcommand)]
pub enum ImageCommand {
    /// Make the default Docker image (debootstrap + import; about a minute
    /// the first time, seconds once its rootfs is cached).
    Build {
        /// The image's tag.
        #[arg(long, default_value = "harness/debian:bookworm")]
        tag: String,
        /// Make it again even if an image of this recipe exists (and
        /// debootstrap again).
        #[arg(long)]
        force: bool,
    },
}

/// Where the rootfs tar is kept between builds: `$HARNESS_CACHE/images`
/// when that is set (where `cargo xtask image` keeps it), else
/// `<home>/images`.
#[cfg(feature = "docker")]
fn cache(home: &Home) -> std::path::PathBuf {
    match std::env::var_os("HARNESS_CACHE").filter(|c| !c.is_empty()) {
        Some(cache) => std::path::PathBuf::from(cache).join("images"),
        None => home.images(),
    }
}

/// How the CLI makes the default image: this host's recipe, the cache
/// above, each stage on stderr.
#[cfg(feature = "docker")]
pub fn make_image(home: &Home) -> harness::docker::MakeImage {
    harness::docker::MakeImage {
        progress: std::sync::Arc::new(|line| eprintln!("docker image: {line}")),
        ..harness::docker::MakeImage::for_host(cache(home))
    }
}

/// Run an `image` subcommand.
#[cfg(feature = "docker")]
pub async fn run(home: &Home, command: ImageCommand) -> Result<()> {
    match command {
        ImageCommand::Build { tag, force } => {
            let make = make_image(home);
            let provider = harness::docker::DockerProvider::connect(Default::default())
                .await
                .context("no Docker engine answered (start dockerd)")?;
            if force {
                let _ = std::fs::remove_file(make.cache.join(make.rootfs.rootfs_name()));
                harness::docker::base_image::remove(&provider, &tag).await?;
            }
            let made = harness::docker::base_image::ensure(
                &provider,
                &tag,
                &make.rootfs,
                &make.cache,
                &*make.progress,
            )
            .await?;
            if made {
                println!("made {tag} (recipe {})", make.rootfs.key());
            } else {
                println!(
                    "{tag} is there (recipe {}); nothing to do",
                    make.rootfs.key()
                );
            }
            Ok(())
        }
    }
}

/// `harness image` in a build without Docker.
#[cfg(not(feature = "docker"))]
pub async fn run(_home: &Home, _command: ImageCommand) -> Result<()> {
    Err(crate::features::missing("docker", "`harness image`"))
}
