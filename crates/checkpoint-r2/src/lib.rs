//! # checkpoint-r2
//!
//! A [`CheckpointStore`] on Cloudflare R2 or any S3-compatible object store,
//! through `aws-sdk-s3`.
//!
//! - **Streamed both ways.** `put` reads its stream into parts of
//!   [`S3Config::part_size`] (8 MiB by default) and uploads each part as it
//!   fills, two at a time while the next one fills: memory stays at about
//!   three parts whatever the object's size. Objects smaller than one part go up with a
//!   single `PutObject`. `get` hands the response body on chunk by chunk.
//! - **Integrity.** `put` computes the SHA-256 of the content while
//!   streaming and records it as the object's user metadata
//!   `x-amz-meta-sha256`; `get` checks the content against it with
//!   [`verify_stream`] and ends the stream with `Corrupt` on a mismatch (or
//!   when the object carries no hash).
//! - **Atomic replace.** S3 wants metadata when a multipart upload is
//!   *created*, before the hash is known. So a large put uploads to a
//!   temporary key `<key>~partial-<uuid>` (`~` can never occur in a valid
//!   checkpoint key, so temporaries never collide with or show up as
//!   checkpoints), completes it, then copies it server-side onto the final
//!   key with `MetadataDirective=REPLACE` and the hash, and deletes the
//!   temporary. Readers see the previous object until the copy lands, then
//!   the new one with its hash: never new bytes with an old hash. A failed
//!   or cancelled put aborts its multipart upload (or deletes its
//!   temporary) and leaves any previous object in place. Objects over 5 GiB
//!   are copied with `UploadPartCopy`, which has no size limit.
//!
//! See `docs/checkpoint-r2.md` for R2 setup and the reasoning in full.

mod config;

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use async_trait::async_trait;
use aws_sdk_s3::config::http::HttpResponse;
use aws_sdk_s3::config::timeout::TimeoutConfig;
use aws_sdk_s3::config::{BehaviorVersion, Credentials, Region};
use aws_sdk_s3::error::{DisplayErrorContext, ProvideErrorMetadata, SdkError};
use aws_sdk_s3::primitives::ByteStream as S3Body;
use aws_sdk_s3::types::{CompletedMultipartUpload, CompletedPart, MetadataDirective};
use bytes::{Bytes, BytesMut};
use futures::{StreamExt, TryStreamExt};
use harness_core::checkpoint::{
    recorded_sha256, validate_key, verify_stream, CheckpointStore, ObjectMeta, PARTIAL_MARK,
};
use harness_core::stream::ByteStream;
use harness_core::{Error, ErrorKind, Result};
use sha2::{Digest, Sha256};

pub use config::{S3Config, DEFAULT_PART_SIZE, MAX_PART_SIZE, MAX_SINGLE_COPY, MIN_PART_SIZE};

/// The user-metadata name under which the content hash is recorded (sent
/// as the header `x-amz-meta-sha256`); the Worker's R2 binding uses the
/// same one.
pub use harness_core::checkpoint::SHA256_METADATA;

/// Chunk size of the streams `get` returns.
const GET_CHUNK: usize = 256 * 1024;

/// S3 allows at most this many parts in one multipart upload.
const MAX_PARTS: u32 = 10_000;

/// Parts a put uploads at once (one more fills meanwhile). Measured on
/// SeaweedFS over loopback, 75 MB: 1 → 1.35-1.58 s, 2 → 1.16-1.31 s,
/// 3 → 1.15-1.34 s.
const UPLOADS_IN_FLIGHT: usize = 2;

/// How many `HeadObject` requests `list` runs at once to read hashes
/// (`ListObjectsV2` does not return user metadata).
const LIST_HEAD_CONCURRENCY: usize = 16;

/// A [`CheckpointStore`] on an S3-compatible bucket (Cloudflare R2, AWS S3,
/// SeaweedFS, MinIO, …). Cheap to clone: clones share one connection pool.
#[derive(Clone)]
pub struct S3CheckpointStore {
    client: aws_sdk_s3::Client,
    config: S3Config,
    /// `"<prefix>/"`, or empty for the bucket root.
    namespace: String,
}

impl std::fmt::Debug for S3CheckpointStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("S3CheckpointStore")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl S3CheckpointStore {
    /// A store for `config` (validated first). Makes no request: the first
    /// operation connects. Call [`S3CheckpointStore::ensure_bucket`] to
    /// create the bucket if it may not exist.
    pub fn new(config: S3Config) -> Result<Self> {
        config.validate()?;
        let http = aws_smithy_http_client::Builder::new()
            .tls_provider(aws_smithy_http_client::tls::Provider::Rustls(
                aws_smithy_http_client::tls::rustls_provider::CryptoMode::Ring,
            ))
            .build_https();
        let sdk_config = aws_sdk_s3::Config::builder()
            .behavior_version(BehaviorVersion::latest())
            .endpoint_url(&config.endpoint)
            .region(Region::new(config.region.clone()))
            .credentials_provider(Credentials::new(
                config.access_key_id.clone(),
                config.secret_access_key.clone(),
                None,
                None,
                "checkpoint-r2",
            ))
            .force_path_style(config.force_path_style)
            .http_client(http)
            // Connecting must be quick; a whole part upload or download may
            // take long on a slow link, so no per-operation timeout.
            .timeout_config(
                TimeoutConfig::builder()
                    .connect_timeout(Duration::from_secs(10))
                    .build(),
            )
            .build();
        let namespace = if config.prefix.is_empty() {
            String::new()
        } else {
            format!("{}/", config.prefix)
        };
        Ok(Self {
            client: aws_sdk_s3::Client::from_conf(sdk_config),
            config,
            namespace,
        })
    }

    /// The configuration this store was built from.
    pub fn config(&self) -> &S3Config {
        &self.config
    }

    /// The underlying S3 client (for administration and tests).
    pub fn client(&self) -> &aws_sdk_s3::Client {
        &self.client
    }

    /// The S3 object key a checkpoint key is stored under: `<prefix>/<key>`.
    pub fn object_key(&self, key: &str) -> String {
        format!("{}{key}", self.namespace)
    }

    /// Create the bucket if it does not exist yet (an existing bucket owned
    /// by these credentials is fine).
    pub async fn ensure_bucket(&self) -> Result<()> {
        let bucket = &self.config.bucket;
        if self
            .client
            .head_bucket()
            .bucket(bucket)
            .send()
            .await
            .is_ok()
        {
            return Ok(());
        }
        match self.client.create_bucket().bucket(bucket).send().await {
            Ok(_) => Ok(()),
            Err(e)
                if matches!(
                    e.code(),
                    Some("BucketAlreadyOwnedByYou") | Some("BucketAlreadyExists")
                ) =>
            {
                Ok(())
            }
            Err(e) => Err(sdk_error(e, &format!("create bucket {bucket:?}"))),
        }
    }

    /// Abort multipart uploads and delete temporary objects under this
    /// store's namespace that were started more than `older_than` ago: the
    /// leftovers of puts whose process died before it could clean up. (On
    /// R2/S3 a bucket lifecycle rule "abort incomplete multipart uploads
    /// after N days" does the first half as well.) Returns how many
    /// leftovers were removed.
    pub async fn cleanup_stale(&self, older_than: Duration) -> Result<usize> {
        let cutoff = std::time::SystemTime::now()
            .checked_sub(older_than)
            .unwrap_or(std::time::UNIX_EPOCH);
        let is_old = |t: Option<&aws_sdk_s3::primitives::DateTime>| {
            t.and_then(|t| std::time::SystemTime::try_from(*t).ok())
                .is_some_and(|t| t < cutoff)
        };
        let bucket = &self.config.bucket;
        let mut removed = 0;
        let mut key_marker: Option<String> = None;
        let mut upload_marker: Option<String> = None;
        loop {
            let page = self
                .client
                .list_multipart_uploads()
                .bucket(bucket)
                .prefix(&self.namespace)
                .set_key_marker(key_marker.clone())
                .set_upload_id_marker(upload_marker.clone())
                .send()
                .await
                .map_err(|e| sdk_error(e, "list multipart uploads"))?;
            for up in page.uploads() {
                if let (Some(key), Some(id)) = (up.key(), up.upload_id()) {
                    if is_old(up.initiated()) {
                        abort_upload(&self.client, bucket, key, id).await?;
                        removed += 1;
                    }
                }
            }
            if page.is_truncated() == Some(true) {
                key_marker = page.next_key_marker().map(str::to_string);
                upload_marker = page.next_upload_id_marker().map(str::to_string);
                if key_marker.is_none() && upload_marker.is_none() {
                    break;
                }
            } else {
                break;
            }
        }
        let mut pages = self
            .client
            .list_objects_v2()
            .bucket(bucket)
            .prefix(&self.namespace)
            .into_paginator()
            .send();
        while let Some(page) = pages.next().await {
            let page = page.map_err(|e| sdk_error(e, "list objects"))?;
            for obj in page.contents() {
                if let Some(key) = obj.key() {
                    if key.contains(PARTIAL_MARK) && is_old(obj.last_modified()) {
                        delete_object(&self.client, bucket, key).await?;
                        removed += 1;
                    }
                }
            }
        }
        Ok(removed)
    }

    async fn put_small(&self, key: &str, full: &str, body: Bytes, sha: String) -> Result<()> {
        self.client
            .put_object()
            .bucket(&self.config.bucket)
            .key(full)
            .content_length(body.len() as i64)
            .content_type("application/octet-stream")
            .metadata(SHA256_METADATA, sha)
            .body(S3Body::from(body))
            .send()
            .await
            .map_err(|e| sdk_error(e, &format!("put checkpoint {key:?}")))?;
        Ok(())
    }

    /// Upload `first` and the rest of `reader` as a multipart upload to
    /// `temp`. Returns the total size.
    async fn upload_multipart(
        &self,
        temp: &str,
        upload_id: &str,
        first: Bytes,
        reader: &mut PartReader,
        hasher: &mut Sha256,
    ) -> Result<u64> {
        let mut parts = Vec::new();
        let mut in_flight = futures::stream::FuturesOrdered::new();
        let mut current = first;
        let mut part_number: u32 = 1;
        let mut size = 0u64;
        loop {
            size += current.len() as u64;
            in_flight.push_back(upload_part(
                self.client.clone(),
                self.config.bucket.clone(),
                temp.to_string(),
                upload_id.to_string(),
                part_number,
                current,
            ));
            if reader.done() {
                break;
            }
            if part_number >= MAX_PARTS {
                return Err(Error::invalid(format!(
                    "checkpoint is larger than {MAX_PARTS} parts of {} bytes: raise S3Config::part_size",
                    self.config.part_size
                )));
            }
            // Wait for the oldest upload while UPLOADS_IN_FLIGHT run.
            while in_flight.len() >= UPLOADS_IN_FLIGHT {
                if let Some(done) = in_flight.next().await {
                    parts.push(done?);
                }
            }
            // The next part fills while the uploads run: at most
            // UPLOADS_IN_FLIGHT + 1 parts in memory.
            let mut fill = std::pin::pin!(reader.fill(self.config.part_size, hasher));
            current = std::future::poll_fn(|cx| {
                while let std::task::Poll::Ready(Some(done)) = in_flight.poll_next_unpin(cx) {
                    match done {
                        Ok(part) => parts.push(part),
                        Err(e) => return std::task::Poll::Ready(Err(e)),
                    }
                }
                fill.as_mut().poll(cx)
            })
            .await?;
            part_number += 1;
        }
        while let Some(done) = in_flight.next().await {
            parts.push(done?);
        }
        self.client
            .complete_multipart_upload()
            .bucket(&self.config.bucket)
            .key(temp)
            .upload_id(upload_id)
            .multipart_upload(
                CompletedMultipartUpload::builder()
                    .set_parts(Some(parts))
                    .build(),
            )
            .send()
            .await
            .map_err(|e| sdk_error(e, "complete multipart upload"))?;
        Ok(size)
    }

    /// Copy the completed temporary object onto the final key with the hash
    /// as metadata.
    async fn commit_copy(&self, temp: &str, full: &str, size: u64, sha: &str) -> Result<()> {
        let bucket = &self.config.bucket;
        let source = format!("{bucket}/{temp}");
        if size <= self.config.max_single_copy {
            self.client
                .copy_object()
                .bucket(bucket)
                .key(full)
                .copy_source(&source)
                .metadata_directive(MetadataDirective::Replace)
                .content_type("application/octet-stream")
                .metadata(SHA256_METADATA, sha)
                .send()
                .await
                .map_err(|e| sdk_error(e, "copy checkpoint onto its key"))?;
            return Ok(());
        }
        // Over the single-copy limit: a multipart copy, whose metadata is
        // given at creation (the hash is known by now).
        let created = self
            .client
            .create_multipart_upload()
            .bucket(bucket)
            .key(full)
            .content_type("application/octet-stream")
            .metadata(SHA256_METADATA, sha)
            .send()
            .await
            .map_err(|e| sdk_error(e, "create multipart copy"))?;
        let upload_id = created
            .upload_id()
            .ok_or_else(|| Error::backend("multipart copy has no upload id"))?
            .to_string();
        let mut guard = Cleanup::abort(&self.client, bucket, full, &upload_id);
        // Ranges as large as allowed, but small enough to stay within the
        // part-count limit.
        let range = (self.config.max_single_copy).max(size.div_ceil(u64::from(MAX_PARTS)));
        let mut parts = Vec::new();
        let mut start = 0u64;
        let mut number = 1;
        while start < size {
            let end = (start + range).min(size) - 1;
            let out = self
                .client
                .upload_part_copy()
                .bucket(bucket)
                .key(full)
                .upload_id(&upload_id)
                .part_number(number)
                .copy_source(&source)
                .copy_source_range(format!("bytes={start}-{end}"))
                .send()
                .await
                .map_err(|e| sdk_error(e, "copy part"));
            let out = match out {
                Ok(out) => out,
                Err(e) => {
                    guard.run().await;
                    return Err(e);
                }
            };
            let etag = out
                .copy_part_result()
                .and_then(|r| r.e_tag())
                .map(str::to_string);
            parts.push(
                CompletedPart::builder()
                    .part_number(number)
                    .set_e_tag(etag)
                    .build(),
            );
            start = end + 1;
            number += 1;
        }
        let done = self
            .client
            .complete_multipart_upload()
            .bucket(bucket)
            .key(full)
            .upload_id(&upload_id)
            .multipart_upload(
                CompletedMultipartUpload::builder()
                    .set_parts(Some(parts))
                    .build(),
            )
            .send()
            .await
            .map_err(|e| sdk_error(e, "complete multipart copy"));
        match done {
            Ok(_) => {
                guard.disarm();
                Ok(())
            }
            Err(e) => {
                guard.run().await;
                Err(e)
            }
        }
    }

    async fn put_large(
        &self,
        key: &str,
        full: &str,
        first: Bytes,
        reader: &mut PartReader,
        hasher: &mut Sha256,
    ) -> Result<ObjectMeta> {
        let bucket = &self.config.bucket;
        let temp = format!("{full}{PARTIAL_MARK}{}", uuid::Uuid::new_v4().simple());
        let created = self
            .client
            .create_multipart_upload()
            .bucket(bucket)
            .key(&temp)
            .content_type("application/octet-stream")
            .send()
            .await
            .map_err(|e| sdk_error(e, &format!("start upload of checkpoint {key:?}")))?;
        let upload_id = created
            .upload_id()
            .ok_or_else(|| Error::backend("CreateMultipartUpload returned no upload id"))?
            .to_string();
        // Dropping the put future (the caller gave up) must not leave a
        // dangling upload either: the guard aborts it from a spawned task.
        let mut guard = Cleanup::abort(&self.client, bucket, &temp, &upload_id);
        let size = match self
            .upload_multipart(&temp, &upload_id, first, reader, hasher)
            .await
        {
            Ok(size) => size,
            Err(e) => {
                guard.run().await;
                return Err(e);
            }
        };
        guard.disarm();
        let mut guard = Cleanup::delete(&self.client, bucket, &temp);
        let sha = hex::encode(std::mem::take(hasher).finalize());
        if let Err(e) = self.commit_copy(&temp, full, size, &sha).await {
            guard.run().await;
            return Err(e);
        }
        guard.run().await;
        Ok(ObjectMeta {
            key: key.to_string(),
            size,
            sha256: sha,
        })
    }
}

#[async_trait]
impl CheckpointStore for S3CheckpointStore {
    async fn put(&self, key: &str, content: ByteStream) -> Result<ObjectMeta> {
        validate_key(key)?;
        let full = self.object_key(key);
        let mut hasher = Sha256::new();
        let mut reader = PartReader::new(content);
        let first = reader.fill(self.config.part_size, &mut hasher).await?;
        if reader.done() {
            let sha = hex::encode(hasher.finalize());
            let size = first.len() as u64;
            self.put_small(key, &full, first, sha.clone()).await?;
            return Ok(ObjectMeta {
                key: key.to_string(),
                size,
                sha256: sha,
            });
        }
        self.put_large(key, &full, first, &mut reader, &mut hasher)
            .await
    }

    async fn get(&self, key: &str) -> Result<ByteStream> {
        validate_key(key)?;
        let out = self
            .client
            .get_object()
            .bucket(&self.config.bucket)
            .key(self.object_key(key))
            .send()
            .await
            .map_err(|e| sdk_error(e, &format!("get checkpoint {key:?}")))?;
        let sha = recorded_sha(key, out.metadata())?;
        let body = out.body;
        let owned_key = key.to_string();
        // The HTTP body arrives in frames of a few KiB; coalescing them into
        // chunks of up to GET_CHUNK bytes cuts the per-chunk cost of every
        // stage downstream (hashing, zstd, tar) at a bounded memory cost.
        let stream: ByteStream = Box::pin(futures::stream::try_unfold(
            (body, owned_key, false),
            |(mut body, key, ended)| async move {
                if ended {
                    return Ok(None);
                }
                let mut buf = BytesMut::new();
                loop {
                    match body.try_next().await {
                        Ok(Some(frame)) => {
                            if buf.is_empty() && frame.len() >= GET_CHUNK {
                                return Ok(Some((frame, (body, key, false))));
                            }
                            buf.extend_from_slice(&frame);
                            if buf.len() >= GET_CHUNK {
                                return Ok(Some((buf.freeze(), (body, key, false))));
                            }
                        }
                        Ok(None) if buf.is_empty() => return Ok(None),
                        Ok(None) => return Ok(Some((buf.freeze(), (body, key, true)))),
                        Err(e) => {
                            return Err(Error::backend(format!(
                                "reading checkpoint {key:?} from S3 failed: {}",
                                DisplayErrorContext(&e)
                            ))
                            .with_source(e))
                        }
                    }
                }
            },
        ));
        Ok(verify_stream(stream, key.to_string(), sha))
    }

    async fn head(&self, key: &str) -> Result<ObjectMeta> {
        validate_key(key)?;
        let out = self
            .client
            .head_object()
            .bucket(&self.config.bucket)
            .key(self.object_key(key))
            .send()
            .await
            .map_err(|e| sdk_error(e, &format!("head checkpoint {key:?}")))?;
        let sha = recorded_sha(key, out.metadata())?;
        Ok(ObjectMeta {
            key: key.to_string(),
            size: out.content_length().unwrap_or(0).max(0) as u64,
            sha256: sha,
        })
    }

    async fn list(&self, prefix: &str) -> Result<Vec<ObjectMeta>> {
        let mut keys = Vec::new();
        let mut pages = self
            .client
            .list_objects_v2()
            .bucket(&self.config.bucket)
            .prefix(format!("{}{prefix}", self.namespace))
            .into_paginator()
            .send();
        while let Some(page) = pages.next().await {
            let page = page.map_err(|e| sdk_error(e, &format!("list checkpoints {prefix:?}")))?;
            for obj in page.contents() {
                let Some(key) = obj.key().and_then(|k| k.strip_prefix(&self.namespace)) else {
                    continue;
                };
                // Temporaries of puts in progress, and foreign objects whose
                // names no checkpoint key can have, are not checkpoints. And
                // the prefix is checked here too: some servers (SeaweedFS)
                // normalise `//` and `..` in a listing prefix, so `list("/")`
                // would otherwise answer every key.
                if validate_key(key).is_ok() && key.starts_with(prefix) {
                    keys.push(key.to_string());
                }
            }
        }
        // ListObjectsV2 carries no user metadata: the hashes come from a
        // HEAD per object. An object deleted in between is skipped.
        let metas: Vec<Option<ObjectMeta>> = futures::stream::iter(keys)
            .map(|key| async move {
                match self.head(&key).await {
                    Ok(meta) => Ok(Some(meta)),
                    Err(e) if e.kind() == ErrorKind::NotFound => Ok(None),
                    Err(e) => Err(e),
                }
            })
            .buffer_unordered(LIST_HEAD_CONCURRENCY)
            .try_collect()
            .await?;
        let mut metas: Vec<ObjectMeta> = metas.into_iter().flatten().collect();
        metas.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(metas)
    }

    async fn delete(&self, key: &str) -> Result<()> {
        validate_key(key)?;
        delete_object(&self.client, &self.config.bucket, &self.object_key(key)).await
    }
}

/// The hash recorded on an object, or `Corrupt` if it has none (an object
/// written by something else, or a put interrupted in a way S3 allowed).
fn recorded_sha(
    key: &str,
    metadata: Option<&std::collections::HashMap<String, String>>,
) -> Result<String> {
    let recorded = metadata.and_then(|m| m.get(SHA256_METADATA));
    recorded_sha256(key, recorded.map(String::as_str), "x-amz-meta-sha256")
}

/// Cuts a byte stream into parts of a fixed size, hashing as it goes.
struct PartReader {
    stream: ByteStream,
    /// Bytes read from the stream but not yet put into a part.
    leftover: Bytes,
    /// The stream has ended and `leftover` is empty.
    ended: bool,
}

impl PartReader {
    fn new(stream: ByteStream) -> Self {
        Self {
            stream,
            leftover: Bytes::new(),
            ended: false,
        }
    }

    /// Nothing is left to read.
    fn done(&self) -> bool {
        self.ended && self.leftover.is_empty()
    }

    /// The next part: `size` bytes, or fewer at the end of the stream. After
    /// it returns, [`PartReader::done`] tells whether more parts follow (it
    /// looks one chunk ahead so a stream of exactly one part is known to be
    /// small).
    async fn fill(&mut self, size: usize, hasher: &mut Sha256) -> Result<Bytes> {
        let mut buf = BytesMut::with_capacity(size);
        loop {
            if !self.leftover.is_empty() {
                let take = self.leftover.len().min(size - buf.len());
                let piece = self.leftover.split_to(take);
                hasher.update(&piece);
                buf.extend_from_slice(&piece);
            }
            if buf.len() == size {
                // Look ahead so `done` is exact.
                self.read_nonempty().await?;
                return Ok(buf.freeze());
            }
            self.read_nonempty().await?;
            if self.ended && self.leftover.is_empty() {
                return Ok(buf.freeze());
            }
        }
    }

    /// Make `leftover` non-empty, or mark the stream ended.
    async fn read_nonempty(&mut self) -> Result<()> {
        while self.leftover.is_empty() && !self.ended {
            match self.stream.next().await {
                Some(chunk) => self.leftover = chunk?,
                None => self.ended = true,
            }
        }
        Ok(())
    }
}

type PartFuture = Pin<Box<dyn Future<Output = Result<CompletedPart>> + Send>>;

fn upload_part(
    client: aws_sdk_s3::Client,
    bucket: String,
    key: String,
    upload_id: String,
    number: u32,
    body: Bytes,
) -> PartFuture {
    Box::pin(async move {
        let out = client
            .upload_part()
            .bucket(bucket)
            .key(key)
            .upload_id(upload_id)
            .part_number(number as i32)
            .content_length(body.len() as i64)
            .body(S3Body::from(body))
            .send()
            .await
            .map_err(|e| sdk_error(e, &format!("upload part {number}")))?;
        Ok(CompletedPart::builder()
            .part_number(number as i32)
            .set_e_tag(out.e_tag().map(str::to_string))
            .build())
    })
}

async fn abort_upload(
    client: &aws_sdk_s3::Client,
    bucket: &str,
    key: &str,
    upload_id: &str,
) -> Result<()> {
    match client
        .abort_multipart_upload()
        .bucket(bucket)
        .key(key)
        .upload_id(upload_id)
        .send()
        .await
    {
        Ok(_) => Ok(()),
        Err(e) if e.code() == Some("NoSuchUpload") => Ok(()),
        Err(e) => Err(sdk_error(e, "abort multipart upload")),
    }
}

async fn delete_object(client: &aws_sdk_s3::Client, bucket: &str, key: &str) -> Result<()> {
    match client.delete_object().bucket(bucket).key(key).send().await {
        Ok(_) => Ok(()),
        Err(e) => {
            let err = sdk_error(e, &format!("delete {key:?}"));
            if err.kind() == ErrorKind::NotFound {
                Ok(())
            } else {
                Err(err)
            }
        }
    }
}

/// Undoes a half-done put: aborts a multipart upload or deletes a temporary
/// object. Run explicitly on the error path; if the put future is dropped
/// while armed, the cleanup runs on a spawned task instead.
struct Cleanup {
    client: aws_sdk_s3::Client,
    bucket: String,
    key: String,
    /// `Some` to abort this upload, `None` to delete the object.
    upload_id: Option<String>,
    armed: bool,
}

impl Cleanup {
    fn abort(client: &aws_sdk_s3::Client, bucket: &str, key: &str, upload_id: &str) -> Self {
        Self {
            client: client.clone(),
            bucket: bucket.to_string(),
            key: key.to_string(),
            upload_id: Some(upload_id.to_string()),
            armed: true,
        }
    }

    fn delete(client: &aws_sdk_s3::Client, bucket: &str, key: &str) -> Self {
        Self {
            client: client.clone(),
            bucket: bucket.to_string(),
            key: key.to_string(),
            upload_id: None,
            armed: true,
        }
    }

    fn disarm(&mut self) {
        self.armed = false;
    }

    fn task(&self) -> impl Future<Output = ()> + Send + 'static {
        let (client, bucket, key, upload_id) = (
            self.client.clone(),
            self.bucket.clone(),
            self.key.clone(),
            self.upload_id.clone(),
        );
        async move {
            let result = match &upload_id {
                Some(id) => abort_upload(&client, &bucket, &key, id).await,
                None => delete_object(&client, &bucket, &key).await,
            };
            if let Err(e) = result {
                // The original error is what the caller needs; a leftover is
                // invisible to readers and `cleanup_stale` removes it later.
                tracing::warn!(%key, error = %e, "could not clean up after a failed checkpoint put");
            }
        }
    }

    async fn run(&mut self) {
        if self.armed {
            self.armed = false;
            self.task().await;
        }
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        if self.armed {
            if let Ok(handle) = tokio::runtime::Handle::try_current() {
                handle.spawn(self.task());
            }
        }
    }
}

/// Map an SDK failure onto the harness error kinds.
fn sdk_error<E>(err: SdkError<E, HttpResponse>, what: &str) -> Error
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
{
    let status = err.raw_response().map(|r| r.status().as_u16());
    let code = err.code().map(str::to_string);
    let detail = DisplayErrorContext(&err).to_string();
    let kind = match (status, code.as_deref()) {
        (_, Some("NoSuchBucket")) => ErrorKind::Backend,
        (_, Some("NoSuchKey" | "NotFound")) | (Some(404), _) => ErrorKind::NotFound,
        (_, Some("AccessDenied" | "InvalidAccessKeyId" | "SignatureDoesNotMatch"))
        | (Some(401 | 403), _) => ErrorKind::Unauthorized,
        _ if matches!(err, SdkError::TimeoutError(_)) => ErrorKind::TimedOut,
        _ => ErrorKind::Backend,
    };
    let message = match kind {
        ErrorKind::NotFound => format!("{what}: no such object"),
        _ if code.as_deref() == Some("NoSuchBucket") => {
            format!(
                "{what}: the bucket does not exist (create it, or call ensure_bucket): {detail}"
            )
        }
        ErrorKind::Unauthorized => {
            format!("{what}: the S3 credentials were refused: {detail}")
        }
        _ => format!("{what}: {detail}"),
    };
    Error::new(kind, message).with_source(err)
}
