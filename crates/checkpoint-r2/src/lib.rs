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
//!   streaming. A single-part object records it as its user metadata
//!   `x-amz-meta-sha256`; a multipart one, whose metadata S3 takes before
//!   any byte is known, is marked `x-amz-meta-sha256-trailer` at creation and
//!   carries the hash in its last 40 bytes (a zstd skippable frame). `get`
//!   checks the content against the hash with [`verify_stream`] or
//!   [`verify_trailer_stream`] (which also strips the trailer) and ends the
//!   stream with `Corrupt` on a mismatch, or when the object carries no hash.
//! - **Atomic replace.** A multipart upload goes straight to the final key:
//!   S3 makes the object visible only when the upload completes, with its
//!   bytes and its hash together, so readers see the previous object until
//!   then and never new bytes with an old hash. A failed or cancelled put
//!   aborts its upload and leaves any previous object in place.
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
use aws_sdk_s3::types::{CompletedMultipartUpload, CompletedPart};
use bytes::{Bytes, BytesMut};
use futures::{StreamExt, TryStreamExt};
use harness_core::checkpoint::{
    check_range, range_past_end, recorded_hash, validate_key, CheckpointStore, ObjectMeta,
    PartCutter, RecordedHash, PARTIAL_MARK, SHA256_TRAILER_FORMAT, SHA256_TRAILER_LEN,
    SHA256_TRAILER_METADATA,
};
use harness_core::stream::ByteStream;
use harness_core::{Error, ErrorKind, Result};

pub use config::{S3Config, DEFAULT_PART_SIZE, MAX_PART_SIZE, MIN_PART_SIZE};

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

/// Reads of a trailer object's tail before `head` gives up on an object
/// replaced under it each time.
const HEAD_ATTEMPTS: usize = 4;

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

    /// Abort multipart uploads under this store's namespace that were
    /// started more than `older_than` ago, the leftovers of puts whose
    /// process died before it could clean up, and delete the temporary
    /// `~partial-` objects that versions before the hash trailer left. (On
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

    /// Upload `first` and the rest of `reader` as the parts of upload
    /// `upload_id` to `full`, the last part ending with the hash trailer,
    /// and complete it. Returns the content's size and hex SHA-256.
    async fn upload_multipart(
        &self,
        full: &str,
        upload_id: &str,
        first: Bytes,
        cutter: &mut PartCutter,
    ) -> Result<(u64, String)> {
        let mut parts = Vec::new();
        let mut in_flight = futures::stream::FuturesOrdered::new();
        let mut current = first;
        let mut part_number: u32 = 1;
        let mut size = 0u64;
        let sha = loop {
            size += current.len() as u64;
            // The last part carries the hash of everything before it (S3
            // allows only the last part to be small, so it is appended to
            // the content's last part rather than sent alone).
            let last = cutter.done().then(|| {
                let (part, sha) = cutter.last_with_trailer(&current);
                current = part;
                sha
            });
            in_flight.push_back(upload_part(
                self.client.clone(),
                self.config.bucket.clone(),
                full.to_string(),
                upload_id.to_string(),
                part_number,
                current,
            ));
            if let Some(sha) = last {
                break sha;
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
            let mut fill = std::pin::pin!(cutter.next_part());
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
        };
        while let Some(done) = in_flight.next().await {
            parts.push(done?);
        }
        self.client
            .complete_multipart_upload()
            .bucket(&self.config.bucket)
            .key(full)
            .upload_id(upload_id)
            .multipart_upload(
                CompletedMultipartUpload::builder()
                    .set_parts(Some(parts))
                    .build(),
            )
            .send()
            .await
            .map_err(|e| sdk_error(e, "complete multipart upload"))?;
        Ok((size, sha))
    }

    /// A put of more than one part: a multipart upload straight to the
    /// final key, marked at creation as carrying its hash in a trailer.
    /// Until it completes, readers see the previous object; a failed or
    /// dropped put aborts it.
    async fn put_large(
        &self,
        key: &str,
        full: &str,
        first: Bytes,
        parts: &mut PartCutter,
    ) -> Result<ObjectMeta> {
        let bucket = &self.config.bucket;
        let created = self
            .client
            .create_multipart_upload()
            .bucket(bucket)
            .key(full)
            .content_type("application/octet-stream")
            .metadata(SHA256_TRAILER_METADATA, SHA256_TRAILER_FORMAT)
            .send()
            .await
            .map_err(|e| sdk_error(e, &format!("start upload of checkpoint {key:?}")))?;
        let upload_id = created
            .upload_id()
            .ok_or_else(|| Error::backend("CreateMultipartUpload returned no upload id"))?
            .to_string();
        // Dropping the put future (the caller gave up) must not leave a
        // dangling upload either: the guard aborts it from a spawned task.
        let mut guard = Cleanup::new(&self.client, bucket, full, &upload_id);
        match self.upload_multipart(full, &upload_id, first, parts).await {
            Ok((size, sha)) => {
                guard.disarm();
                Ok(ObjectMeta {
                    key: key.to_string(),
                    size,
                    sha256: sha,
                })
            }
            Err(e) => {
                guard.run().await;
                Err(e)
            }
        }
    }

    /// The metadata of a trailer object from one ranged `GET` of its last
    /// bytes, which answers the size (`Content-Range`), the layout and the
    /// trailer of one and the same version. `None` when the range cannot be
    /// served (416): the object was replaced since its `HEAD` by one too
    /// short to have a trailer.
    async fn tail_meta(&self, key: &str) -> Result<Option<ObjectMeta>> {
        let out = self
            .client
            .get_object()
            .bucket(&self.config.bucket)
            .key(self.object_key(key))
            .range(format!("bytes=-{SHA256_TRAILER_LEN}"))
            .send()
            .await;
        let out = match out {
            Ok(out) => out,
            Err(e) if e.raw_response().map(|r| r.status().as_u16()) == Some(416) => {
                return Ok(None)
            }
            Err(e) => {
                return Err(sdk_error(
                    e,
                    &format!("read the hash of checkpoint {key:?}"),
                ))
            }
        };
        let recorded = recorded_hash_of(key, out.metadata())?;
        // "bytes 960-999/1000"; a server that ignored the range sent it all.
        let total = out
            .content_range()
            .and_then(|r| r.rsplit_once('/'))
            .and_then(|(_, total)| total.parse::<u64>().ok());
        let tail = out.body.collect().await.map_err(|e| {
            Error::backend(format!(
                "reading the hash of checkpoint {key:?} from S3 failed: {e}"
            ))
        })?;
        let tail = tail.into_bytes();
        let stored = total.unwrap_or(tail.len() as u64);
        recorded.object_meta(key, stored, &tail).map(Some)
    }
}

#[async_trait]
impl CheckpointStore for S3CheckpointStore {
    async fn put(&self, key: &str, content: ByteStream) -> Result<ObjectMeta> {
        validate_key(key)?;
        let full = self.object_key(key);
        let mut parts = PartCutter::new(content, self.config.part_size);
        let first = parts.next_part().await?;
        if parts.done() {
            let sha = hex::encode(parts.digest());
            let size = first.len() as u64;
            self.put_small(key, &full, first, sha.clone()).await?;
            return Ok(ObjectMeta {
                key: key.to_string(),
                size,
                sha256: sha,
            });
        }
        self.put_large(key, &full, first, &mut parts).await
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
        let recorded = recorded_hash_of(key, out.metadata())?;
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
        Ok(recorded.verify(stream, key.to_string()))
    }

    /// One ranged `GET`: the `Content-Range` answers the stored size, so a
    /// range reaching into a trailer object's hash trailer (past its
    /// content) is refused like one past the end.
    async fn get_range(&self, key: &str, range: std::ops::Range<u64>) -> Result<Bytes> {
        check_range(key, &range)?;
        if range.is_empty() {
            self.head(key).await?;
            return Ok(Bytes::new());
        }
        let out = self
            .client
            .get_object()
            .bucket(&self.config.bucket)
            .key(self.object_key(key))
            .range(format!("bytes={}-{}", range.start, range.end - 1))
            .send()
            .await;
        let out = match out {
            Ok(out) => out,
            // The range starts at or past the stored end.
            Err(e) if e.raw_response().map(|r| r.status().as_u16()) == Some(416) => {
                let stored = self.head(key).await?.size;
                return Err(range_past_end(key, &range, stored));
            }
            Err(e) => return Err(sdk_error(e, &format!("read a range of checkpoint {key:?}"))),
        };
        let recorded = recorded_hash_of(key, out.metadata())?;
        let total = out
            .content_range()
            .and_then(|r| r.rsplit_once('/'))
            .and_then(|(_, total)| total.parse::<u64>().ok());
        let body = out
            .body
            .collect()
            .await
            .map_err(|e| {
                Error::backend(format!(
                    "reading a range of checkpoint {key:?} from S3 failed: {e}"
                ))
            })?
            .into_bytes();
        let Some(total) = total else {
            // A server that ignored the range sent the whole object.
            return Err(Error::backend(format!(
                "S3 answered a ranged read of {key:?} without a Content-Range"
            )));
        };
        let content = match recorded {
            RecordedHash::Trailer => total.saturating_sub(SHA256_TRAILER_LEN as u64),
            RecordedHash::Metadata(_) => total,
        };
        if range.end > content {
            return Err(range_past_end(key, &range, content));
        }
        if body.len() as u64 != range.end - range.start {
            return Err(Error::backend(format!(
                "S3 answered {} bytes for range {}..{} of {key:?}",
                body.len(),
                range.start,
                range.end
            )));
        }
        Ok(body)
    }

    async fn head(&self, key: &str) -> Result<ObjectMeta> {
        validate_key(key)?;
        // A trailer object's metadata comes from one ranged read of its
        // tail. An object replaced between the two requests by one too
        // short for the range is looked at afresh, a few times at most.
        for _ in 0..HEAD_ATTEMPTS {
            let out = self
                .client
                .head_object()
                .bucket(&self.config.bucket)
                .key(self.object_key(key))
                .send()
                .await
                .map_err(|e| sdk_error(e, &format!("head checkpoint {key:?}")))?;
            let recorded = recorded_hash_of(key, out.metadata())?;
            if recorded != RecordedHash::Trailer {
                let stored = out.content_length().unwrap_or(0).max(0) as u64;
                return recorded.object_meta(key, stored, &[]);
            }
            if let Some(meta) = self.tail_meta(key).await? {
                return Ok(meta);
            }
        }
        Err(Error::backend(format!(
            "checkpoint {key:?} was replaced {HEAD_ATTEMPTS} times while its hash was read; try again"
        )))
    }

    async fn list(&self, prefix: &str) -> Result<Vec<ObjectMeta>> {
        let keys = self.list_keys(prefix).await?;
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

    /// The listing's pages alone: no `HEAD` per object.
    async fn list_keys(&self, prefix: &str) -> Result<Vec<String>> {
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
        keys.sort();
        Ok(keys)
    }

    async fn delete(&self, key: &str) -> Result<()> {
        validate_key(key)?;
        delete_object(&self.client, &self.config.bucket, &self.object_key(key)).await
    }
}

/// How an object records its hash (in its metadata, or as a trailer), or
/// `Corrupt` if it records none (an object written by something else).
fn recorded_hash_of(
    key: &str,
    metadata: Option<&std::collections::HashMap<String, String>>,
) -> Result<RecordedHash> {
    recorded_hash(
        key,
        |name| metadata.and_then(|m| m.get(name)).map(String::as_str),
        "x-amz-meta-sha256",
    )
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

/// Undoes a half-done put: aborts its multipart upload. Run explicitly on
/// the error path; if the put future is dropped while armed, the abort runs
/// on a spawned task instead.
struct Cleanup {
    client: aws_sdk_s3::Client,
    bucket: String,
    key: String,
    upload_id: String,
    armed: bool,
}

impl Cleanup {
    fn new(client: &aws_sdk_s3::Client, bucket: &str, key: &str, upload_id: &str) -> Self {
        Self {
            client: client.clone(),
            bucket: bucket.to_string(),
            key: key.to_string(),
            upload_id: upload_id.to_string(),
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
            if let Err(e) = abort_upload(&client, &bucket, &key, &upload_id).await {
                // The original error is what the caller needs; a leftover is
                // invisible to readers and `cleanup_stale` removes it later.
                tracing::warn!(%key, error = %e, "could not abort the upload of a failed checkpoint put");
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
