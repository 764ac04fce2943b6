//! Shared test plumbing: reaching the real S3 server, fresh buckets, and
//! deterministic content generated on the fly.
#![allow(dead_code)]

use std::time::Duration;

use bytes::Bytes;
use checkpoint_r2::{S3CheckpointStore, S3Config, MIN_PART_SIZE};
use futures::StreamExt;
use harness_core::stream::ByteStream;
use harness_core::Result;
use sha2::{Digest, Sha256};

pub use harness_testkit::skip_or_fail;

pub mod sandboxes;

/// The S3 endpoint from `HARNESS_S3_ENDPOINT`, if set and accepting
/// connections; otherwise skip (or fail under CI) and return `None`.
pub async fn endpoint() -> Option<String> {
    let Some(endpoint) = std::env::var("HARNESS_S3_ENDPOINT")
        .ok()
        .filter(|v| !v.is_empty())
    else {
        skip_or_fail(
            "HARNESS_S3_ENDPOINT is not set (start SeaweedFS with `cargo xtask services start`)",
        );
        return None;
    };
    let host = endpoint
        .split("://")
        .nth(1)
        .unwrap_or(&endpoint)
        .split('/')
        .next()
        .unwrap_or_default()
        .to_string();
    match tokio::time::timeout(
        Duration::from_secs(3),
        tokio::net::TcpStream::connect(&host),
    )
    .await
    {
        Ok(Ok(_)) => Some(endpoint),
        other => {
            skip_or_fail(&format!(
                "S3 endpoint {endpoint} is unreachable ({other:?})"
            ));
            None
        }
    }
}

/// The one bucket all tests share. Tests are isolated by prefix, not by
/// bucket: SeaweedFS backs every bucket with its own collection of volumes,
/// and a server with few volume slots runs out after a handful of buckets.
pub const TEST_BUCKET: &str = "harness-checkpoint-r2-tests";

/// The config for a fresh namespace (`tests/<tag>-<uuid>`) in the test
/// bucket; SeaweedFS without configured identities accepts any credentials.
pub fn config(endpoint: &str, tag: &str) -> S3Config {
    S3Config::custom(
        endpoint,
        "us-east-1",
        "harness-test",
        "harness-test-secret",
        TEST_BUCKET,
    )
    .with_prefix(format!("tests/{tag}-{}", uuid::Uuid::new_v4().simple()))
}

/// The raw S3 prefix of a store's namespace (`<prefix>/`).
pub fn namespace(store: &S3CheckpointStore) -> String {
    format!("{}/", store.config().prefix)
}

/// A store on its own, newly created bucket, with the smallest legal part
/// size so multipart paths run with little data.
pub async fn store(endpoint: &str, tag: &str) -> S3CheckpointStore {
    store_with(config(endpoint, tag).with_part_size(MIN_PART_SIZE)).await
}

/// A store for `config`, its bucket created.
pub async fn store_with(config: S3Config) -> S3CheckpointStore {
    let store = S3CheckpointStore::new(config).expect("valid config");
    store.ensure_bucket().await.expect("create test bucket");
    store
}

/// A deterministic pseudo-random stream of `total` bytes in `chunk`-sized
/// pieces, generated as it is read (xorshift64*), and its SHA-256.
pub fn generated(seed: u64, total: u64, chunk: usize) -> (ByteStream, String) {
    let mut hasher = Sha256::new();
    let mut st = seed | 1;
    let mut left = total;
    while left > 0 {
        let n = left.min(chunk as u64) as usize;
        hasher.update(gen_chunk(&mut st, n));
        left -= n as u64;
    }
    let sha = hex::encode(hasher.finalize());
    (generated_stream(seed, total, chunk), sha)
}

/// The stream half of [`generated`] (no up-front hashing pass).
pub fn generated_stream(seed: u64, total: u64, chunk: usize) -> ByteStream {
    Box::pin(futures::stream::unfold(
        (seed | 1, total),
        move |(mut st, left)| async move {
            if left == 0 {
                return None;
            }
            let n = left.min(chunk as u64) as usize;
            let bytes = gen_chunk(&mut st, n);
            Some((Ok(Bytes::from(bytes)), (st, left - n as u64)))
        },
    ))
}

fn gen_chunk(st: &mut u64, n: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(n + 8);
    while out.len() < n {
        *st ^= *st >> 12;
        *st ^= *st << 25;
        *st ^= *st >> 27;
        out.extend_from_slice(&st.wrapping_mul(0x2545_F491_4F6C_DD1D).to_le_bytes());
    }
    out.truncate(n);
    out
}

/// Read a stream to its end, returning (size, sha256) or the first error.
pub async fn drain(mut stream: ByteStream) -> Result<(u64, String)> {
    let mut hasher = Sha256::new();
    let mut size = 0u64;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk?;
        size += chunk.len() as u64;
        hasher.update(&chunk);
    }
    Ok((size, hex::encode(hasher.finalize())))
}

/// Every object in the store's namespace, raw (temporaries included), as
/// keys relative to the namespace.
pub async fn raw_keys(store: &S3CheckpointStore) -> Vec<String> {
    let ns = namespace(store);
    let out = store
        .client()
        .list_objects_v2()
        .bucket(&store.config().bucket)
        .prefix(&ns)
        .send()
        .await
        .expect("raw list");
    out.contents()
        .iter()
        .filter_map(|o| o.key()?.strip_prefix(&ns).map(str::to_string))
        .collect()
}

/// Multipart uploads still open in the store's namespace.
pub async fn open_uploads(store: &S3CheckpointStore) -> Vec<String> {
    let out = store
        .client()
        .list_multipart_uploads()
        .bucket(&store.config().bucket)
        .prefix(namespace(store))
        .send()
        .await
        .expect("list multipart uploads");
    out.uploads()
        .iter()
        .filter_map(|u| u.key().map(str::to_string))
        .collect()
}

/// Read a (small) stream into memory.
pub async fn drain_to_vec(mut stream: ByteStream) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(chunk) = stream.next().await {
        out.extend_from_slice(&chunk.expect("stream chunk"));
    }
    out
}
