//! Checkpoints in R2, through the Worker's R2 binding: [`R2Store`], core's
//! [`CheckpointStore`] with the object layout of `checkpoint-r2` (the object
//! `<prefix>/<key>`, its SHA-256 in the custom metadata `sha256`, which S3
//! clients see as `x-amz-meta-sha256`), so a checkpoint written here restores
//! through `checkpoint-r2` on a laptop, and the other way round: objects
//! `checkpoint-r2` uploads in parts carry their hash in a trailer instead
//! (custom metadata `sha256-trailer`), which reads here strip and check.
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
//! A put of one part (8 MiB) is one `put` of the binding, with its hash in
//! the metadata. A larger one is a multipart upload straight to the key, its
//! hash in a trailer as `checkpoint-r2` writes them, one part in memory at a
//! time: the object appears when the upload completes, never as new bytes
//! with an old hash. The object route (`PUT /v1/checkpoints/objects/<key>`)
//! buffers its request body, up to `HARNESS_CHECKPOINT_MAX_BYTES` (96 MiB by
//! default: a Worker has 128 MB of memory).

use std::collections::HashMap;

use async_trait::async_trait;
use bytes::Bytes;
use futures::StreamExt;
use harness_core::checkpoint::{
    check_range, range_past_end, recorded_hash, validate_key, CheckpointStore, ObjectMeta,
    PartCutter, RecordedHash, PARTIAL_MARK, SHA256_METADATA, SHA256_TRAILER_FORMAT,
    SHA256_TRAILER_LEN, SHA256_TRAILER_METADATA,
};
use harness_core::stream::ByteStream;
use harness_core::{Error, Result};
use worker::{Bucket, Env, Include, Range};

/// The binding's name in `wrangler.toml`.
pub(crate) const BINDING: &str = "CHECKPOINTS";

/// Largest request body the object route buffers by default.
const DEFAULT_MAX_BYTES: usize = 96 << 20;

/// Parts of a multipart put. R2 wants every part but the last of one size,
/// of at least 5 MiB; one part is in memory at a time.
const PART_BYTES: usize = 8 << 20;

/// Upload `first` and the rest of `parts` to `upload`, the last part ending
/// with the hash trailer. Returns the parts, the content's size and its hex
/// SHA-256.
async fn upload_parts(
    upload: &worker::MultipartUpload,
    first: Bytes,
    cutter: &mut PartCutter,
) -> Result<(Vec<worker::UploadedPart>, u64, String)> {
    let mut uploaded = Vec::new();
    let mut part = first;
    let mut size = 0u64;
    for number in 1u16.. {
        size += part.len() as u64;
        let last = cutter.done().then(|| {
            let (with_trailer, sha) = cutter.last_with_trailer(&part);
            part = with_trailer;
            sha
        });
        uploaded.push(
            upload
                .upload_part(number, Vec::from(std::mem::take(&mut part)))
                .await
                .map_err(r2(format!("upload part {number}")))?,
        );
        if let Some(sha) = last {
            return Ok((uploaded, size, sha));
        }
        if number == MAX_PARTS {
            break;
        }
        part = cutter.next_part().await?;
    }
    Err(Error::invalid(format!(
        "checkpoint is larger than {MAX_PARTS} parts of {PART_BYTES} bytes"
    )))
}

/// R2's limit on the parts of one upload.
const MAX_PARTS: u16 = 10_000;

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

    pub(crate) fn object_key(&self, key: &str) -> String {
        format!("{}{key}", self.namespace)
    }

    /// How `object` records its hash: in its custom metadata, or (an
    /// object a multipart S3 upload wrote, `checkpoint-r2`) in a trailer.
    fn recorded(key: &str, object: &worker::Object) -> Result<RecordedHash> {
        let metadata = object
            .custom_metadata()
            .map_err(r2(format!("metadata of {key:?}")))?;
        recorded_hash(
            key,
            |name| metadata.get(name).map(String::as_str),
            "custom metadata sha256",
        )
    }

    /// The metadata of `object` (from a `head`, a `list` or a `get`).
    async fn meta_of(&self, key: &str, object: &worker::Object) -> Result<ObjectMeta> {
        match Self::recorded(key, object)? {
            RecordedHash::Trailer => self.tail_meta(key).await,
            recorded => recorded.object_meta(key, object.size(), &[]),
        }
    }

    /// The metadata of a trailer object from one ranged read of its last
    /// bytes: size, layout and trailer of one and the same version.
    async fn tail_meta(&self, key: &str) -> Result<ObjectMeta> {
        let object = self
            .bucket
            .get(self.object_key(key))
            .range(Range::Suffix {
                suffix: SHA256_TRAILER_LEN as u64,
            })
            .execute()
            .await
            .map_err(r2(format!("read the hash of {key:?}")))?
            .ok_or_else(|| Error::not_found(format!("no checkpoint {key:?}")))?;
        let recorded = Self::recorded(key, &object)?;
        let tail = object
            .body()
            .ok_or_else(|| Error::backend(format!("R2: {key:?} has no body")))?
            .bytes()
            .await
            .map_err(r2(format!("read the hash of {key:?}")))?;
        recorded.object_meta(key, object.size(), &tail)
    }
}

#[async_trait(?Send)]
impl CheckpointStore for R2Store {
    async fn put(&self, key: &str, content: ByteStream) -> Result<ObjectMeta> {
        validate_key(key)?;
        let mut cutter = PartCutter::new(content, PART_BYTES);
        let first = cutter.next_part().await?;
        if cutter.done() {
            // One part: one put, the hash in the metadata.
            let digest = cutter.digest();
            let sha = hex::encode(digest);
            let size = first.len() as u64;
            self.bucket
                .put(self.object_key(key), Vec::from(first))
                // R2 checks the body against this digest before storing it.
                .sha256(digest.to_vec())
                .custom_metadata(HashMap::from([(SHA256_METADATA.to_string(), sha.clone())]))
                .execute()
                .await
                .map_err(r2(format!("put {key:?}")))?;
            return Ok(ObjectMeta {
                key: key.to_string(),
                size,
                sha256: sha,
            });
        }
        // More: a multipart upload straight to the key, its hash in a
        // trailer, as `checkpoint-r2` writes them (nothing visible before
        // it completes; aborted on failure).
        let upload = self
            .bucket
            .create_multipart_upload(self.object_key(key))
            .custom_metadata(HashMap::from([(
                SHA256_TRAILER_METADATA.to_string(),
                SHA256_TRAILER_FORMAT.to_string(),
            )]))
            .execute()
            .await
            .map_err(r2(format!("start the upload of {key:?}")))?;
        match upload_parts(&upload, first, &mut cutter).await {
            Ok((uploaded, size, sha)) => {
                upload
                    .complete(uploaded)
                    .await
                    .map_err(r2(format!("complete the upload of {key:?}")))?;
                Ok(ObjectMeta {
                    key: key.to_string(),
                    size,
                    sha256: sha,
                })
            }
            Err(e) => {
                // The original error is what the caller needs; an upload
                // left open is invisible to readers.
                let _ = upload.abort().await;
                Err(e)
            }
        }
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
        let recorded = Self::recorded(key, &object)?;
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
        Ok(recorded.verify(stream, key.to_string()))
    }

    async fn head(&self, key: &str) -> Result<ObjectMeta> {
        validate_key(key)?;
        let object = self
            .bucket
            .head(self.object_key(key))
            .await
            .map_err(r2(format!("head {key:?}")))?
            .ok_or_else(|| Error::not_found(format!("no checkpoint {key:?}")))?;
        self.meta_of(key, &object).await
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
                out.push(self.meta_of(key, &object).await?);
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

    /// One ranged read of R2 (both layouts keep the content first, so its
    /// offsets are the object's), after a `head` for the content's size.
    /// Not verified, as the trait says: an encrypted store reads its
    /// segments and trailer through this, and checks them itself.
    async fn get_range(&self, key: &str, range: std::ops::Range<u64>) -> Result<Bytes> {
        check_range(key, &range)?;
        let size = self.head(key).await?.size;
        if range.end > size {
            return Err(range_past_end(key, &range, size));
        }
        if range.is_empty() {
            return Ok(Bytes::new());
        }
        let length = range.end - range.start;
        let object = self
            .bucket
            .get(self.object_key(key))
            .range(Range::OffsetWithLength {
                offset: range.start,
                length,
            })
            .execute()
            .await
            .map_err(r2(format!("read a range of {key:?}")))?
            .ok_or_else(|| Error::not_found(format!("no checkpoint {key:?}")))?;
        let bytes = object
            .body()
            .ok_or_else(|| Error::backend(format!("R2: {key:?} has no body")))?
            .bytes()
            .await
            .map_err(r2(format!("read a range of {key:?}")))?;
        if bytes.len() as u64 != length {
            return Err(Error::backend(format!(
                "R2 answered {} bytes for {length} of {key:?}",
                bytes.len()
            )));
        }
        Ok(Bytes::from(bytes))
    }
}

/// The Worker's checkpoint key (the secret `HARNESS_CHECKPOINT_KEY`, 64 or
/// more hex digits; `.dev.vars` or `--var` under `wrangler dev`): with it,
/// checkpoints the Worker writes are encrypted in the Worker before they
/// reach R2 (`docs/checkpoint-encryption.md`). A malformed one is an error,
/// never a silent fallback to plain.
pub(crate) fn checkpoint_key(env: &Env) -> Result<Option<harness_moves::crypt::DeploymentKey>> {
    let name = harness_moves::crypt::KEY_ENV;
    let value = crate::object::secret_or_var(env, name);
    value
        .map(|v| {
            harness_moves::crypt::DeploymentKey::from_hex(&v)
                .map_err(|e| Error::invalid(format!("the Worker's {name}: {}", e.message())))
        })
        .transpose()
}
