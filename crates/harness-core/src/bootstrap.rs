//! Bootstrap recipes and their stable identity.
//!
//! A recipe is what turns a base image into a sandbox ready for an agent:
//! files to write (the agent binary among them), `bootstrap_pre_commands`
//! (image prep such as installing CA certificates) and `commands`. Backends
//! run a recipe once per *identity* and snapshot the result; the identity is a
//! hash of everything that can change the result, so equal recipes share a
//! snapshot across processes and machines, and any change makes a new one.

use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::maybe::{MaybeSend, MaybeSync};
use crate::sandbox::{collect_exec, shell_quote, ExecRequest, Sandbox};
use crate::stream::ByteStream;
use crate::{Error, Result};

/// Where a recipe file's bytes come from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum FileSource {
    /// Small text content carried in the recipe itself.
    Inline {
        /// The file's content.
        text: String,
    },
    /// A file on the host, identified by its content hash. Large files (agent
    /// binaries of hundreds of MB) use this: the identity hashes the digest,
    /// not the bytes, and a backend may copy or bind-mount the file.
    HostPath {
        /// Absolute path on the host.
        path: String,
        /// Hex SHA-256 of the content (the identity depends on it).
        sha256: String,
    },
}

/// One file a recipe writes into the sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecipeFile {
    /// Absolute path inside the sandbox.
    pub path: String,
    /// Unix permission bits, e.g. `0o755` for an executable.
    pub mode: u32,
    /// The content.
    pub source: FileSource,
}

/// What to run once per identity before any session uses a sandbox.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BootstrapRecipe {
    /// Files written first, in order.
    #[serde(default)]
    pub files: Vec<RecipeFile>,
    /// Image-preparation shell commands run after the files (e.g.
    /// `apt-get install -y ca-certificates`).
    #[serde(default)]
    pub bootstrap_pre_commands: Vec<String>,
    /// Further shell commands (e.g. an agent's own setup step).
    #[serde(default)]
    pub commands: Vec<String>,
}

/// Bump when the meaning of a recipe field changes, so old snapshots are not
/// reused for a recipe they no longer match.
const IDENTITY_VERSION: u32 = 1;

impl BootstrapRecipe {
    /// True when the recipe does nothing.
    pub fn is_empty(&self) -> bool {
        self.files.is_empty() && self.bootstrap_pre_commands.is_empty() && self.commands.is_empty()
    }

    /// Merge another recipe after this one.
    pub fn extend(&mut self, other: BootstrapRecipe) {
        self.files.extend(other.files);
        self.bootstrap_pre_commands
            .extend(other.bootstrap_pre_commands);
        self.commands.extend(other.commands);
    }

    /// The stable identity of running this recipe on `base` (an image name,
    /// a template directory, …): `bs-` and 24 hex digits of a SHA-256 over a
    /// canonical encoding. Inline text is hashed by content, host files by
    /// their declared digest.
    pub fn identity(&self, base: &str) -> String {
        let mut hasher = Sha256::new();
        let mut field = |tag: &str, value: &[u8]| {
            // Length-prefix every field so no two recipes encode alike.
            hasher.update(tag.as_bytes());
            hasher.update((value.len() as u64).to_le_bytes());
            hasher.update(value);
        };
        field("version", &IDENTITY_VERSION.to_le_bytes());
        field("base", base.as_bytes());
        for file in &self.files {
            field("file.path", file.path.as_bytes());
            field("file.mode", &file.mode.to_le_bytes());
            match &file.source {
                FileSource::Inline { text } => {
                    field("file.inline", &Sha256::digest(text.as_bytes()));
                }
                FileSource::HostPath { sha256, .. } => field("file.sha256", sha256.as_bytes()),
            }
        }
        for cmd in &self.bootstrap_pre_commands {
            field("pre", cmd.as_bytes());
        }
        for cmd in &self.commands {
            field("cmd", cmd.as_bytes());
        }
        let digest = hasher.finalize();
        format!("bs-{}", &hex::encode(digest)[..24])
    }
}

/// Where a recipe's [`FileSource::HostPath`] files are read: the provider's
/// own I/O (core reads no files).
#[cfg_attr(not(target_arch = "wasm32"), async_trait)]
#[cfg_attr(target_arch = "wasm32", async_trait(?Send))]
pub trait HostFiles: MaybeSend + MaybeSync {
    /// The content of the host file at `path`.
    async fn open(&self, path: &str) -> Result<ByteStream>;
}

/// Run `recipe` in `sandbox`, the one recipe runner every provider that
/// bootstraps through its own `Sandbox` uses: each file is streamed in with
/// `write_file` (a host file through [`verified_host_file`]: a content
/// that does not match the declared SHA-256 fails the write, `Corrupt`),
/// given its mode with `chmod`, then [`run_recipe_commands`]. The first
/// failure stops it, naming the step. A provider with a faster way in for
/// files (Docker's archive upload, size and mode in the header) writes them
/// itself through [`verified_host_file`] and then calls
/// [`run_recipe_commands`].
pub async fn run_recipe(
    sandbox: &dyn Sandbox,
    recipe: &BootstrapRecipe,
    host: &dyn HostFiles,
) -> Result<()> {
    for file in &recipe.files {
        if !file.path.starts_with('/') {
            return Err(Error::invalid(format!(
                "recipe file path {:?} must be absolute",
                file.path
            )));
        }
        let (body, check) = match &file.source {
            FileSource::Inline { text } => (crate::stream::once(text.clone()), None),
            FileSource::HostPath { path, sha256 } => {
                let body = host
                    .open(path)
                    .await
                    .map_err(|e| context(e, &format!("opening recipe host file {path}")))?;
                let (body, check) = verified_host_file(path, sha256, body);
                (body, Some(check))
            }
        };
        let written = sandbox.write_file(&file.path, body).await;
        match check {
            Some(check) => check.judge(written),
            None => written,
        }
        .map_err(|e| context(e, &format!("writing recipe file {}", file.path)))?;
        let chmod = format!("chmod {:o} {}", file.mode & 0o7777, shell_quote(&file.path));
        run_step(sandbox, &chmod).await?;
    }
    run_recipe_commands(sandbox, recipe).await
}

/// `body` (the content of recipe host file `path`) passed through and
/// hashed on the way: if it does not match the declared `sha256`, the
/// stream ends with a `Corrupt` error instead of ending cleanly, so the
/// write it feeds fails. A writer may report that failure as its own (an
/// HTTP client's "request failed"): [`HostFileCheck::judge`] gives the
/// write's result with the mismatch as its cause.
pub fn verified_host_file(
    path: &str,
    sha256: &str,
    body: ByteStream,
) -> (ByteStream, HostFileCheck) {
    let check = HostFileCheck(Arc::new(Mutex::new(None)));
    let verdict = check.0.clone();
    let what = (path.to_string(), sha256.to_ascii_lowercase());
    let stream = Box::pin(futures::stream::unfold(
        Some((body, Sha256::new(), what, verdict)),
        |state| async move {
            let (mut body, mut hasher, what, verdict) = state?;
            match body.next().await {
                Some(Ok(chunk)) => {
                    hasher.update(&chunk);
                    Some((Ok(chunk), Some((body, hasher, what, verdict))))
                }
                Some(Err(e)) => Some((Err(e), None)),
                None => {
                    let got = hex::encode(hasher.finalize());
                    let (path, want) = what;
                    let mismatch = (got != want).then(|| {
                        format!(
                            "recipe host file {path} has SHA-256 {got}, the recipe declares {want}"
                        )
                    });
                    *verdict.lock().unwrap_or_else(|e| e.into_inner()) =
                        mismatch.clone().map(Error::corrupt);
                    mismatch.map(|m| (Err(Error::corrupt(m)), None))
                }
            }
        },
    ));
    (stream, check)
}

/// The verdict of a [`verified_host_file`] stream.
#[derive(Debug, Clone)]
pub struct HostFileCheck(Arc<Mutex<Option<Error>>>);

impl HostFileCheck {
    /// The result of the write the stream fed: the content's mismatch if
    /// there was one (whatever the writer made of it), else `written`.
    pub fn judge<T>(&self, written: Result<T>) -> Result<T> {
        match self.0.lock().unwrap_or_else(|e| e.into_inner()).take() {
            Some(mismatch) => Err(mismatch),
            None => written,
        }
    }
}

/// Run the recipe's `bootstrap_pre_commands`, then its `commands`, in
/// order with `sh -c` from `/`; the first failure stops them, with the tail
/// of its stderr.
pub async fn run_recipe_commands(sandbox: &dyn Sandbox, recipe: &BootstrapRecipe) -> Result<()> {
    for cmd in recipe
        .bootstrap_pre_commands
        .iter()
        .chain(recipe.commands.iter())
    {
        run_step(sandbox, cmd).await?;
    }
    Ok(())
}

async fn run_step(sandbox: &dyn Sandbox, cmd: &str) -> Result<()> {
    let out = collect_exec(sandbox.exec(ExecRequest::shell(cmd).cwd("/")).await?).await?;
    if out.status.success() {
        return Ok(());
    }
    let stderr = out.stderr_str();
    let tail: String = {
        let chars: Vec<char> = stderr.trim().chars().collect();
        chars[chars.len().saturating_sub(2000)..].iter().collect()
    };
    Err(Error::backend(format!(
        "bootstrap command {cmd:?} failed ({:?}): {tail}",
        out.status
    )))
}

fn context(e: Error, what: &str) -> Error {
    Error::new(e.kind(), format!("{what}: {}", e.message()))
}

/// The snapshot side of a provider, as [`ensure_snapshot`] drives it.
#[cfg_attr(not(target_arch = "wasm32"), async_trait)]
#[cfg_attr(target_arch = "wasm32", async_trait(?Send))]
pub trait SnapshotStore: MaybeSend + MaybeSync {
    /// Held while a snapshot is built, while a sandbox is being made from
    /// it, and by prune while it removes it (a file lock, …).
    type Lock: MaybeSend;
    /// Wait for the identity's exclusive lock.
    async fn lock(&self, identity: &str) -> Result<Self::Lock>;
    /// Whether the snapshot of `identity` exists.
    async fn exists(&self, identity: &str) -> Result<bool>;
    /// Run `recipe` and keep the result as the snapshot of `identity`.
    async fn build(&self, identity: &str, recipe: &BootstrapRecipe) -> Result<()>;
}

/// The bootstrap-once rule: the identity of `recipe` on `base`, its
/// snapshot built unless it exists, and the identity's lock — still held, so
/// the caller makes its sandbox from the snapshot before a concurrent prune
/// can remove it. Concurrent first sessions (threads or processes) wait on
/// the lock and find the snapshot built, so the recipe runs once.
pub async fn ensure_snapshot<S: SnapshotStore + ?Sized>(
    store: &S,
    base: &str,
    recipe: &BootstrapRecipe,
) -> Result<(String, S::Lock)> {
    let identity = recipe.identity(base);
    let lock = store.lock(&identity).await?;
    if !store.exists(&identity).await? {
        store.build(&identity, recipe).await.map_err(|e| {
            Error::new(
                e.kind(),
                format!("bootstrap {identity} failed: {}", e.message()),
            )
        })?;
    }
    Ok((identity, lock))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_files_are_verified_as_they_stream() {
        let collect = |sha: &str| {
            let body: ByteStream = Box::pin(futures::stream::iter(vec![
                Ok(bytes::Bytes::from_static(b"ab")),
                Ok(bytes::Bytes::from_static(b"c")),
            ]));
            let (stream, check) = verified_host_file("/h/tool", sha, body);
            let items = futures::executor::block_on(stream.collect::<Vec<_>>());
            let judged = check.judge(Err::<(), _>(Error::backend("the writer's own words")));
            (items, judged)
        };
        let abc = hex::encode(Sha256::digest(b"abc"));
        let (good, judged) = collect(&abc.to_ascii_uppercase());
        assert_eq!(good.len(), 2, "the content passes through unchanged");
        assert!(good.iter().all(Result::is_ok));
        assert_eq!(judged.unwrap_err().kind(), crate::ErrorKind::Backend);
        let (bad, judged) = collect(&"00".repeat(32));
        assert_eq!(bad.len(), 3, "the content, then the error");
        let err = bad[2].as_ref().unwrap_err();
        assert_eq!(err.kind(), crate::ErrorKind::Corrupt);
        assert!(err.message().contains(&abc), "{err}");
        // Whatever the writer said, the mismatch is the cause.
        assert_eq!(judged.unwrap_err().kind(), crate::ErrorKind::Corrupt);
    }

    fn recipe() -> BootstrapRecipe {
        BootstrapRecipe {
            files: vec![RecipeFile {
                path: "/opt/agent/bin/claude".into(),
                mode: 0o755,
                source: FileSource::HostPath {
                    path: "/cache/claude".into(),
                    sha256: "ab".repeat(32),
                },
            }],
            bootstrap_pre_commands: vec!["mkdir -p /workspace".into()],
            commands: vec![],
        }
    }

    #[test]
    fn identity_is_stable_and_sensitive_to_every_field() {
        let base = recipe();
        let id = base.identity("img:1");
        assert_eq!(id, recipe().identity("img:1"), "same recipe, same identity");
        assert!(id.starts_with("bs-") && id.len() == 27);
        assert_ne!(
            id,
            base.identity("img:2"),
            "base image is part of the identity"
        );

        let mut moved_host_file = recipe();
        if let FileSource::HostPath { path, .. } = &mut moved_host_file.files[0].source {
            *path = "/elsewhere/claude".into();
        }
        assert_eq!(
            id,
            moved_host_file.identity("img:1"),
            "host path is not content"
        );

        let mut other = recipe();
        other.files[0].mode = 0o700;
        assert_ne!(id, other.identity("img:1"));
        let mut other = recipe();
        other.bootstrap_pre_commands.push("true".into());
        assert_ne!(id, other.identity("img:1"));
        // Moving a command between the two lists changes the identity too.
        let mut a = BootstrapRecipe::default();
        a.bootstrap_pre_commands.push("x".into());
        let mut b = BootstrapRecipe::default();
        b.commands.push("x".into());
        assert_ne!(a.identity("i"), b.identity("i"));
    }

    /// A store in memory that counts builds and can be told to fail.
    struct Store {
        built: std::sync::Mutex<Vec<String>>,
        fail: bool,
    }

    #[async_trait]
    impl SnapshotStore for Store {
        type Lock = String;
        async fn lock(&self, identity: &str) -> Result<String> {
            Ok(format!("lock:{identity}"))
        }
        async fn exists(&self, identity: &str) -> Result<bool> {
            Ok(self.built.lock().unwrap().iter().any(|i| i == identity))
        }
        async fn build(&self, identity: &str, _recipe: &BootstrapRecipe) -> Result<()> {
            if self.fail {
                return Err(Error::backend("step 2 broke"));
            }
            self.built.lock().unwrap().push(identity.to_string());
            Ok(())
        }
    }

    #[test]
    fn ensure_snapshot_builds_once_per_identity_and_returns_the_lock() {
        let store = Store {
            built: std::sync::Mutex::new(Vec::new()),
            fail: false,
        };
        let r = recipe();
        let (id, lock) = futures::executor::block_on(ensure_snapshot(&store, "b", &r)).unwrap();
        assert_eq!(id, r.identity("b"));
        assert_eq!(lock, format!("lock:{id}"));
        futures::executor::block_on(ensure_snapshot(&store, "b", &r)).unwrap();
        assert_eq!(store.built.lock().unwrap().len(), 1, "built once");
        futures::executor::block_on(ensure_snapshot(&store, "other", &r)).unwrap();
        assert_eq!(
            store.built.lock().unwrap().len(),
            2,
            "another base, another snapshot"
        );

        let failing = Store {
            built: std::sync::Mutex::new(Vec::new()),
            fail: true,
        };
        let err = futures::executor::block_on(ensure_snapshot(&failing, "b", &r)).unwrap_err();
        assert!(
            err.to_string()
                .contains(&format!("bootstrap {id} failed: step 2 broke")),
            "{err}"
        );
    }
}
