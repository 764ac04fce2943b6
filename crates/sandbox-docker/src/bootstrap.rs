//! Bootstrap snapshots: run a recipe once per identity, keep the result as
//! the image `<snapshot_repo>:<identity>`, start later sessions from it.
//!
//! Concurrent first sessions (threads or processes on one host) serialize
//! on an exclusive lock file per identity and re-check the image once they
//! hold it, so the recipe runs once.

use std::collections::HashMap;
use std::fs::OpenOptions;

use bollard::query_parameters::{
    CommitContainerOptionsBuilder, ListImagesOptionsBuilder, RemoveImageOptionsBuilder,
};
use futures::StreamExt;
use harness_core::bootstrap::{BootstrapRecipe, FileSource, SnapshotStore};
use harness_core::sandbox::{SandboxSpec, SnapshotInfo};
use harness_core::{Error, ErrorKind, Result};
use tokio_util::io::ReaderStream;

use crate::{docker_err, DockerProvider, DockerSandbox};

/// Whether `image` exists locally.
async fn image_exists(provider: &DockerProvider, image: &str) -> Result<bool> {
    match provider.client().inspect_image(image).await {
        Ok(_) => Ok(true),
        Err(e) => {
            let err = docker_err("inspecting an image", e);
            if err.kind() == ErrorKind::NotFound {
                Ok(false)
            } else {
                Err(err)
            }
        }
    }
}

/// Hold the identity's lock: taken by whoever builds the snapshot, by
/// whoever creates a session container from it (until the container exists,
/// after which docker itself refuses to remove the image), and by prune
/// before removing it — so a prune never removes a snapshot between its
/// commit and the first container made from it.
pub(crate) async fn lock_identity(
    provider: &DockerProvider,
    identity: &str,
) -> Result<std::fs::File> {
    let lock_path = provider
        .config()
        .lock_dir
        .join(format!("docker-bootstrap-{identity}.lock"));
    // flock blocks the thread: take it off the async runtime. Locks on
    // separate opens conflict within one process too, so threads serialize.
    tokio::task::spawn_blocking(move || -> Result<std::fs::File> {
        if let Some(dir) = lock_path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)?;
        file.lock()?;
        Ok(file)
    })
    .await
    .map_err(|e| Error::backend(format!("bootstrap lock task failed: {e}")))?
}

/// The snapshot image for `recipe` on `base`, building it if needed, and the
/// identity's lock: keep it until a container from the image exists. The
/// rule (lock, check again, build once) is core's `ensure_snapshot`.
pub(crate) async fn ensure_snapshot(
    provider: &DockerProvider,
    base: &str,
    recipe: &BootstrapRecipe,
) -> Result<(String, std::fs::File)> {
    let store = Snapshots { provider, base };
    let (identity, lock) = harness_core::bootstrap::ensure_snapshot(&store, base, recipe).await?;
    Ok((store.tag(&identity), lock))
}

/// The tag of the snapshot image of `identity`.
pub(crate) fn snapshot_tag(provider: &DockerProvider, identity: &str) -> String {
    format!("{}:{identity}", provider.config().snapshot_repo)
}

/// Snapshot images `<snapshot_repo>:<identity>` of one base image.
struct Snapshots<'a> {
    provider: &'a DockerProvider,
    base: &'a str,
}

impl Snapshots<'_> {
    fn tag(&self, identity: &str) -> String {
        snapshot_tag(self.provider, identity)
    }
}

#[async_trait::async_trait]
impl SnapshotStore for Snapshots<'_> {
    type Lock = std::fs::File;

    async fn lock(&self, identity: &str) -> Result<std::fs::File> {
        lock_identity(self.provider, identity).await
    }

    async fn exists(&self, identity: &str) -> Result<bool> {
        image_exists(self.provider, &self.tag(identity)).await
    }

    async fn build(&self, identity: &str, recipe: &BootstrapRecipe) -> Result<()> {
        build(
            self.provider,
            self.base,
            recipe,
            identity,
            &self.tag(identity),
        )
        .await
    }
}

async fn build(
    provider: &DockerProvider,
    base: &str,
    recipe: &BootstrapRecipe,
    identity: &str,
    tag: &str,
) -> Result<()> {
    let mut spec = SandboxSpec::new("/");
    spec.labels
        .insert(provider.label("identity"), identity.to_string());
    let id = provider
        .run_container(base, &spec, "bootstrap", None, &[])
        .await?;
    let sandbox = provider.sandbox(id.clone(), "/".into(), true, serde_json::Value::Null);
    let result = async {
        run_recipe(&sandbox, recipe).await?;
        let options = CommitContainerOptionsBuilder::new()
            .container(&id)
            .repo(&provider.config().snapshot_repo)
            .tag(identity)
            .comment(&format!("harness bootstrap snapshot of {base}"))
            .changes(&format!(
                "LABEL {}={identity} {}=harness",
                provider.label("identity"),
                provider.label("managed-by")
            ))
            .build();
        provider
            .client()
            .commit_container(options, bollard::models::ContainerConfig::default())
            .await
            .map_err(|e| docker_err(&format!("committing snapshot {tag}"), e))?;
        Ok::<(), Error>(())
    }
    .await;
    let removed = provider.remove(&id).await;
    result?;
    removed
}

/// Run `recipe` in `sandbox`: core's recipe runner, but files go up
/// through the archive endpoint with their size and mode in the header (a
/// 300 MB agent binary streams in one request, not through an exec's
/// stdin), host files through core's `verified_host_file`.
pub(crate) async fn run_recipe(sandbox: &DockerSandbox, recipe: &BootstrapRecipe) -> Result<()> {
    for file in &recipe.files {
        match &file.source {
            FileSource::Inline { text } => {
                sandbox
                    .upload_file(
                        &file.path,
                        text.len() as u64,
                        file.mode,
                        harness_core::stream::once(text.clone()),
                    )
                    .await?;
            }
            FileSource::HostPath { path, sha256 } => {
                let f = tokio::fs::File::open(path).await.map_err(|e| {
                    Error::from(e).with_context(&format!("opening recipe file {path}"))
                })?;
                let size = f.metadata().await?.len();
                let body =
                    ReaderStream::with_capacity(f, 256 * 1024).map(|c| c.map_err(Error::from));
                let (body, check) =
                    harness_core::bootstrap::verified_host_file(path, sha256, Box::pin(body));
                check.judge(sandbox.upload_file(&file.path, size, file.mode, body).await)?;
            }
        }
    }
    harness_core::bootstrap::run_recipe_commands(sandbox, recipe).await
}

trait WithContext {
    fn with_context(self, what: &str) -> Self;
}

impl WithContext for Error {
    fn with_context(self, what: &str) -> Self {
        Error::new(self.kind(), format!("{what}: {}", self.message()))
    }
}

/// Snapshot images, found by the identity label.
pub(crate) async fn list(provider: &DockerProvider) -> Result<Vec<SnapshotInfo>> {
    let label = provider.label("identity");
    let mut filters: HashMap<String, Vec<String>> = HashMap::new();
    filters.insert("label".into(), vec![label.clone()]);
    let images = provider
        .client()
        .list_images(Some(
            ListImagesOptionsBuilder::new().filters(&filters).build(),
        ))
        .await
        .map_err(|e| docker_err("listing snapshot images", e))?;
    let repo_prefix = format!("{}:", provider.config().snapshot_repo);
    let mut out = Vec::new();
    for image in images {
        let Some(identity) = image.labels.get(&label).cloned() else {
            continue;
        };
        let reference = image
            .repo_tags
            .iter()
            .find(|t| t.starts_with(&repo_prefix))
            .cloned()
            .unwrap_or_else(|| image.id.clone());
        out.push(SnapshotInfo {
            identity,
            reference,
            size_bytes: u64::try_from(image.size).ok(),
        });
    }
    out.sort_by(|a, b| a.identity.cmp(&b.identity));
    Ok(out)
}

/// Remove snapshots whose identity is not in `keep`. Images still used by a
/// container are left alone (docker refuses) and not reported as removed.
pub(crate) async fn prune(provider: &DockerProvider, keep: &[String]) -> Result<Vec<SnapshotInfo>> {
    let mut removed = Vec::new();
    for snap in list(provider).await? {
        if keep.contains(&snap.identity) {
            continue;
        }
        // Wait out a session being created from this snapshot right now.
        let _lock = lock_identity(provider, &snap.identity).await?;
        match provider
            .client()
            .remove_image(
                &snap.reference,
                Some(RemoveImageOptionsBuilder::new().force(false).build()),
                None,
            )
            .await
        {
            Ok(_) => removed.push(snap),
            Err(e) => {
                let err = docker_err("removing a snapshot", e);
                match err.kind() {
                    ErrorKind::Conflict => {
                        tracing::warn!(snapshot = %snap.reference, "snapshot in use, kept: {err}");
                    }
                    ErrorKind::NotFound => {}
                    _ => return Err(err),
                }
            }
        }
    }
    Ok(removed)
}
