//! Checkpoints in R2, through the Worker's R2 binding: [`R2Store`], core's
//! [`CheckpointStore`] with the object layout of `checkpoint-r2` (the object
//! `<prefix>/<key>`, its SHA-256 in the custom metadata `sha256`, which S3
//! clients see as `x-amz-meta-sha256`), so a checkpoint written here restores
//! through `checkpoint-r2` on a laptop, and the other way round.
//!
//! The routes (host grant; `docs/cloudflare-worker.md`):
//!
//! - `PUT|GET|HEAD|DELETE /v1/checkpoints/objects/<key>`, `GET
//!   /v1/checkpoints/objects?prefix=`: the store itself, for a laptop that
//!   holds no R2 credentials.
//! - `POST /v1/checkpoints/checkpoint` and `POST /v1/checkpoints/restore`,
//!   with `{"sandbox": <handle>, "dir": "...", "key": "..."}`: core's
//!   `moves::checkpoint` / `moves::restore` between a sandbox of the
//!   Worker's bridge and R2 — the tree never leaves Cloudflare.
//!
//! A put is buffered whole (the binding's single `put`, with the hash known
//! before the object exists, so readers never see new bytes with an old
//! hash) and refused over `HARNESS_CHECKPOINT_MAX_BYTES` (96 MiB by default:
//! a Worker has 128 MB of memory).

use std::collections::HashMap;

use async_trait::async_trait;
use bytes::Bytes;
use futures::StreamExt;
use harness_core::checkpoint::{
    recorded_sha256, validate_key, verify_stream, CheckpointStore, ObjectMeta, PARTIAL_MARK,
    SHA256_METADATA,
};
use harness_core::stream::ByteStream;
use harness_core::{Error, Result};
use sha2::{Digest, Sha256};
use worker::{Bucket, Env, Include};

/// The binding's name in `wrangler.toml`.
pub(crate) const BINDING: &str = "CHECKPOINTS";

/// Largest object a put takes by default.
const DEFAULT_MAX_BYTES: usize = 96 << 20;

/// Checkpoints in an R2 bucket, through the binding.
pub(crate) struct R2Store {
    bucket: Bucket,
    /// `<prefix>/`, or empty.
    namespace: String,
    max_bytes: usize,
}

impl std::fmt::Debug for R2Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("R2Store")
            .field("namespace", &self.namespace)
            .finish_non_exhaustive()
    }
}

fn r2(what: String) -> impl FnOnce(worker::Error) -> Error {
    move |e| Error::backend(format!("R2: {what}: {e}"))
}

impl R2Store {
    /// The bucket bound as `CHECKPOINTS`, under `HARNESS_CHECKPOINT_PREFIX`
    /// (as `checkpoint-r2`'s `S3Config::prefix`).
    pub(crate) fn from_env(env: &Env) -> Result<Self> {
        let bucket = env.bucket(BINDING).map_err(|e| {
            Error::unsupported(format!(
                "no R2 bucket bound as {BINDING} (wrangler.toml [[r2_buckets]]): {e}"
            ))
        })?;
        let var = |name: &str| env.var(name).ok().map(|v| v.to_string());
        let prefix = var("HARNESS_CHECKPOINT_PREFIX").unwrap_or_default();
        let prefix = prefix.trim_matches('/');
        let max_bytes = var("HARNESS_CHECKPOINT_MAX_BYTES")
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(DEFAULT_MAX_BYTES);
        Ok(Self {
            bucket,
            namespace: if prefix.is_empty() {
                String::new()
            } else {
                format!("{prefix}/")
            },
            max_bytes,
        })
    }

    /// The largest object a put takes.
    pub(crate) fn max_bytes(&self) -> usize {
        self.max_bytes
    }

    fn object_key(&self, key: &str) -> String {
        format!("{}{key}", self.namespace)
    }

    fn meta_of(&self, key: &str, object: &worker::Object) -> Result<ObjectMeta> {
        let metadata = object
            .custom_metadata()
            .map_err(r2(format!("metadata of {key:?}")))?;
        Ok(ObjectMeta {
            key: key.to_string(),
            size: object.size(),
            sha256: recorded_sha256(
                key,
                metadata.get(SHA256_METADATA).map(String::as_str),
                "custom metadata sha256",
            )?,
        })
    }
}

#[async_trait(?Send)]
impl CheckpointStore for R2Store {
    async fn put(&self, key: &str, mut content: ByteStream) -> Result<ObjectMeta> {
        validate_key(key)?;
        let mut hasher = Sha256::new();
        let mut body = Vec::new();
        while let Some(chunk) = content.next().await {
            // A failed stream stores nothing: the previous object stays.
            let chunk = chunk?;
            if body.len() + chunk.len() > self.max_bytes {
                return Err(Error::invalid(format!(
                    "checkpoint {key:?} is over {} bytes, the most the Worker buffers for one put (HARNESS_CHECKPOINT_MAX_BYTES)",
                    self.max_bytes
                )));
            }
            hasher.update(&chunk);
            body.extend_from_slice(&chunk);
        }
        let digest = hasher.finalize();
        let sha = hex::encode(digest);
        let size = body.len() as u64;
        self.bucket
            .put(self.object_key(key), body)
            // R2 checks the body against this digest before storing it.
            .sha256(digest.to_vec())
            .custom_metadata(HashMap::from([(SHA256_METADATA.to_string(), sha.clone())]))
            .execute()
            .await
            .map_err(r2(format!("put {key:?}")))?;
        Ok(ObjectMeta {
            key: key.to_string(),
            size,
            sha256: sha,
        })
    }

    async fn get(&self, key: &str) -> Result<ByteStream> {
        validate_key(key)?;
        let object = self
            .bucket
            .get(self.object_key(key))
            .execute()
            .await
            .map_err(r2(format!("get {key:?}")))?
            .ok_or_else(|| Error::not_found(format!("no checkpoint {key:?}")))?;
        let meta = self.meta_of(key, &object)?;
        let body = object
            .body()
            .ok_or_else(|| Error::backend(format!("R2: checkpoint {key:?} has no body")))?
            .stream()
            .map_err(r2(format!("read {key:?}")))?;
        let owned = key.to_string();
        let stream: ByteStream = Box::pin(body.map(move |chunk| {
            chunk
                .map(Bytes::from)
                .map_err(|e| Error::backend(format!("R2: reading {owned:?}: {e}")))
        }));
        Ok(verify_stream(stream, key.to_string(), meta.sha256))
    }

    async fn head(&self, key: &str) -> Result<ObjectMeta> {
        validate_key(key)?;
        let object = self
            .bucket
            .head(self.object_key(key))
            .await
            .map_err(r2(format!("head {key:?}")))?
            .ok_or_else(|| Error::not_found(format!("no checkpoint {key:?}")))?;
        self.meta_of(key, &object)
    }

    async fn list(&self, prefix: &str) -> Result<Vec<ObjectMeta>> {
        let mut out = Vec::new();
        let mut cursor: Option<String> = None;
        loop {
            let mut request = self
                .bucket
                .list()
                .prefix(format!("{}{prefix}", self.namespace))
                .include(vec![Include::CustomMetadata]);
            if let Some(c) = cursor.take() {
                request = request.cursor(c);
            }
            let page = request
                .execute()
                .await
                .map_err(r2(format!("list {prefix:?}")))?;
            for object in page.objects() {
                let full = object.key();
                let Some(key) = full.strip_prefix(&self.namespace) else {
                    continue;
                };
                if key.contains(PARTIAL_MARK) || validate_key(key).is_err() {
                    continue;
                }
                out.push(self.meta_of(key, &object)?);
            }
            match page.cursor().filter(|_| page.truncated()) {
                Some(c) => cursor = Some(c),
                None => break,
            }
        }
        out.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(out)
    }

    async fn delete(&self, key: &str) -> Result<()> {
        validate_key(key)?;
        self.bucket
            .delete(self.object_key(key))
            .await
            .map_err(r2(format!("delete {key:?}")))
    }
}
