//! The base image Docker sandboxes start from when a session names none,
//! made on this machine: no image registry needed.
//!
//! A minimal Debian ([`harness_rootfs`]: debootstrap `--variant=minbase`
//! from the mirror apt uses, plus a few packages) imported as an image
//! (`docker import`: a rootfs tar, no layers pulled). The image carries the
//! recipe's key as a label: an image of an older recipe is rebuilt, one of
//! this recipe is reused. Making it takes a debootstrap (~30–60 s, root,
//! Debian's `debootstrap` package) the first time; the rootfs tar is kept
//! (`rootfs-<suite>-<variant>-<key>.tar` in a cache directory) so the
//! next import takes seconds.
//!
//! `harness image build` makes it on request, with progress; the CLI makes
//! it before the first Docker session that needs it. The test image of
//! `cargo xtask image` is the same recipe under another tag.

use std::path::Path;

use bollard::query_parameters::CreateImageOptionsBuilder;
use futures::StreamExt;
use harness_core::{Error, Result};
pub use harness_rootfs::Rootfs;

use crate::{docker_err, DockerProvider};

/// The image a Docker sandbox starts from when its session names none.
pub const DEFAULT_IMAGE: &str = "harness/debian:bookworm";

/// The label holding the recipe's key.
pub const RECIPE_LABEL: &str = "harness.recipe";

/// The image's recipe key (its [`RECIPE_LABEL`]), `None` when there is no
/// image of that tag.
pub async fn recipe_of(provider: &DockerProvider, tag: &str) -> Result<Option<String>> {
    match provider.client().inspect_image(tag).await {
        Ok(image) => Ok(Some(
            image
                .config
                .and_then(|c| c.labels)
                .and_then(|l| l.get(RECIPE_LABEL).cloned())
                .unwrap_or_default(),
        )),
        Err(bollard::errors::Error::DockerResponseServerError {
            status_code: 404, ..
        }) => Ok(None),
        Err(e) => Err(docker_err(&format!("inspecting image {tag}"), e)),
    }
}

/// Remove image `tag` (none is fine).
pub async fn remove(provider: &DockerProvider, tag: &str) -> Result<()> {
    match provider
        .client()
        .remove_image(
            tag,
            None::<bollard::query_parameters::RemoveImageOptions>,
            None,
        )
        .await
    {
        Ok(_)
        | Err(bollard::errors::Error::DockerResponseServerError {
            status_code: 404, ..
        }) => Ok(()),
        Err(e) => Err(docker_err(&format!("removing image {tag}"), e)),
    }
}

/// Make image `tag` from `rootfs` unless an image of that tag and recipe
/// exists: the rootfs tar from `cache` (or debootstrapped into it),
/// imported with the recipe's label. `progress` is told each stage.
/// Returns whether it was made.
pub async fn ensure(
    provider: &DockerProvider,
    tag: &str,
    rootfs: &Rootfs,
    cache: &Path,
    progress: &(dyn Fn(&str) + Sync),
) -> Result<bool> {
    let key = rootfs.key();
    if recipe_of(provider, tag).await?.as_deref() == Some(key.as_str()) {
        return Ok(false);
    }
    let tarball = {
        let (image, cache) = (rootfs.clone(), cache.to_path_buf());
        // debootstrap and tar block: off the runtime's threads. Progress
        // lines are collected and told after (they are few and slow).
        let (tx, rx) = std::sync::mpsc::channel::<String>();
        let handle = tokio::task::spawn_blocking(move || {
            image.build(&cache, &|line| {
                let _ = tx.send(line.to_string());
            })
        });
        let result = loop {
            while let Ok(line) = rx.try_recv() {
                progress(&line);
            }
            if handle.is_finished() {
                break handle.await;
            }
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        };
        while let Ok(line) = rx.try_recv() {
            progress(&line);
        }
        result.map_err(|e| Error::backend(format!("making the rootfs: {e}")))??
    };
    progress(&format!("importing {} as {tag}", tarball.display()));
    let file = tokio::fs::File::open(&tarball).await?;
    let body = tokio_util::io::ReaderStream::with_capacity(file, 1 << 20);
    let (repo, version) = tag.rsplit_once(':').unwrap_or((tag, "latest"));
    let options = CreateImageOptionsBuilder::new()
        .from_src("-")
        .repo(repo)
        .tag(version)
        .changes(vec![
            format!("LABEL {RECIPE_LABEL}={key}"),
            "CMD [\"/bin/bash\"]".to_string(),
        ])
        .build();
    let mut answers =
        provider
            .client()
            .create_image(Some(options), Some(bollard::body_try_stream(body)), None);
    while let Some(answer) = answers.next().await {
        answer.map_err(|e| docker_err(&format!("importing {tag}"), e))?;
    }
    match recipe_of(provider, tag).await? {
        Some(found) if found == key => Ok(true),
        found => Err(Error::backend(format!(
            "imported {tag} but it carries recipe {found:?}, not {key}"
        ))),
    }
}
