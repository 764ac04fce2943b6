//! The `CheckpointStore` conformance suite. Every backend's tests call
//! [`run_all`] with a factory that makes a fresh, empty store (for remote
//! stores: a fresh bucket or prefix).

use std::future::Future;
use std::sync::Arc;

use anyhow::{bail, ensure, Context, Result};
use bytes::Bytes;
use futures::StreamExt;
use harness_core::checkpoint::CheckpointStore;
use harness_core::stream::{self, ByteStream};
use harness_core::{Error, ErrorKind};
use sha2::{Digest, Sha256};

/// Deterministic pseudo-random content of `len` bytes, produced in chunks
/// of `chunk` bytes as a stream, never held whole.
pub fn generated(len: u64, chunk: usize, seed: u64) -> ByteStream {
    let mut state = seed | 1;
    let mut left = len;
    Box::pin(futures::stream::iter(std::iter::from_fn(move || {
        if left == 0 {
            return None;
        }
        let n = (chunk as u64).min(left) as usize;
        left -= n as u64;
        let mut buf = Vec::with_capacity(n);
        while buf.len() < n {
            // xorshift64*: cheap, deterministic, incompressible enough.
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            let v = state.wrapping_mul(0x2545_F491_4F6C_DD1D).to_le_bytes();
            buf.extend_from_slice(&v[..(n - buf.len()).min(8)]);
        }
        Some(Ok(Bytes::from(buf)))
    })))
}

/// SHA-256 (hex) and length of a stream, computed as it flows.
pub async fn digest(mut s: ByteStream) -> harness_core::Result<(String, u64)> {
    let mut h = Sha256::new();
    let mut n = 0u64;
    while let Some(chunk) = s.next().await {
        let chunk = chunk?;
        n += chunk.len() as u64;
        h.update(&chunk);
    }
    Ok((hex::encode(h.finalize()), n))
}

/// Run every check against fresh stores from `factory`.
pub async fn run_all<F, Fut>(factory: F) -> Result<()>
where
    F: Fn() -> Fut,
    Fut: Future<Output = Arc<dyn CheckpointStore>>,
{
    put_get_round_trip(factory().await)
        .await
        .context("put_get_round_trip")?;
    streamed_multi_chunk(factory().await)
        .await
        .context("streamed_multi_chunk")?;
    overwrite_replaces(factory().await)
        .await
        .context("overwrite_replaces")?;
    missing_key_is_not_found(factory().await)
        .await
        .context("missing_key_is_not_found")?;
    list_by_prefix(factory().await)
        .await
        .context("list_by_prefix")?;
    delete_is_idempotent(factory().await)
        .await
        .context("delete_is_idempotent")?;
    failed_put_leaves_previous(factory().await)
        .await
        .context("failed_put_leaves_previous")?;
    unsafe_keys_are_refused(factory().await)
        .await
        .context("unsafe_keys_are_refused")?;
    empty_object(factory().await)
        .await
        .context("empty_object")?;
    Ok(())
}

/// What is put comes back byte for byte, with its size and hash recorded.
pub async fn put_get_round_trip(store: Arc<dyn CheckpointStore>) -> Result<()> {
    let meta = store
        .put(
            "sessions/s1/a.tar.zst",
            stream::once(&b"hello checkpoint"[..]),
        )
        .await?;
    ensure!(meta.size == 16, "size {}", meta.size);
    ensure!(
        meta.sha256 == hex::encode(Sha256::digest(b"hello checkpoint")),
        "hash {}",
        meta.sha256
    );
    let back = stream::collect(store.get("sessions/s1/a.tar.zst").await?, 1 << 20).await?;
    ensure!(&back[..] == b"hello checkpoint", "got {back:?}");
    let head = store.head("sessions/s1/a.tar.zst").await?;
    ensure!(head == meta, "head {head:?} != put {meta:?}");
    Ok(())
}

/// A multi-chunk stream (several MiB, odd chunk sizes) round-trips.
pub async fn streamed_multi_chunk(store: Arc<dyn CheckpointStore>) -> Result<()> {
    let len = 12 * 1024 * 1024 + 123;
    let (want, _) = digest(generated(len, 65_537, 7)).await?;
    let meta = store.put("big/object", generated(len, 65_537, 7)).await?;
    ensure!(meta.size == len && meta.sha256 == want, "put meta {meta:?}");
    let (got, n) = digest(store.get("big/object").await?).await?;
    ensure!(
        n == len && got == want,
        "read back {n} bytes with hash {got}"
    );
    Ok(())
}

/// A second put under a key replaces the first.
pub async fn overwrite_replaces(store: Arc<dyn CheckpointStore>) -> Result<()> {
    store.put("k", stream::once(&b"one"[..])).await?;
    store.put("k", stream::once(&b"two-longer"[..])).await?;
    let back = stream::collect(store.get("k").await?, 1024).await?;
    ensure!(&back[..] == b"two-longer", "got {back:?}");
    ensure!(
        store.list("").await?.len() == 1,
        "overwrite left two objects"
    );
    Ok(())
}

/// Absent keys are `NotFound` for get and head.
pub async fn missing_key_is_not_found(store: Arc<dyn CheckpointStore>) -> Result<()> {
    match store.get("nope/never").await {
        Err(e) if e.kind() == ErrorKind::NotFound => {}
        Err(e) => bail!("get of a missing key must be NotFound, got {e}"),
        Ok(_) => bail!("get of a missing key must be NotFound, got a stream"),
    }
    match store.head("nope/never").await {
        Err(e) if e.kind() == ErrorKind::NotFound => {}
        other => bail!("head of a missing key must be NotFound, got {other:?}"),
    }
    Ok(())
}

/// `list(prefix)` returns exactly the keys under the prefix, sorted.
pub async fn list_by_prefix(store: Arc<dyn CheckpointStore>) -> Result<()> {
    for key in [
        "sessions/b/2",
        "sessions/a/1",
        "sessions/a/2",
        "sessions/ab/1",
        "other/x",
    ] {
        store
            .put(key, stream::once(Bytes::from(key.to_string())))
            .await?;
    }
    let keys: Vec<String> = store
        .list("sessions/a/")
        .await?
        .into_iter()
        .map(|m| m.key)
        .collect();
    ensure!(
        keys == vec!["sessions/a/1", "sessions/a/2"],
        "list(sessions/a/) gave {keys:?}"
    );
    let all: Vec<String> = store.list("").await?.into_iter().map(|m| m.key).collect();
    ensure!(
        all.len() == 5 && all.windows(2).all(|w| w[0] < w[1]),
        "list('') gave {all:?}"
    );
    let metas = store.list("sessions/b/").await?;
    ensure!(
        metas.len() == 1 && metas[0].size == 12,
        "list carries sizes: {metas:?}"
    );
    Ok(())
}

/// Delete removes; deleting again is fine.
pub async fn delete_is_idempotent(store: Arc<dyn CheckpointStore>) -> Result<()> {
    store.put("d/1", stream::once(&b"x"[..])).await?;
    store.delete("d/1").await?;
    ensure!(
        matches!(store.head("d/1").await, Err(e) if e.kind() == ErrorKind::NotFound),
        "still there after delete"
    );
    store.delete("d/1").await?;
    store.delete("d/never-existed").await?;
    Ok(())
}

/// A put whose stream fails midway stores nothing and leaves the previous
/// object intact.
pub async fn failed_put_leaves_previous(store: Arc<dyn CheckpointStore>) -> Result<()> {
    store.put("f/obj", stream::once(&b"previous"[..])).await?;
    let failing: ByteStream = Box::pin(generated(6 * 1024 * 1024, 1024 * 1024, 3).chain(
        futures::stream::once(async { Err(Error::backend("source sandbox died")) }),
    ));
    ensure!(
        store.put("f/obj", failing).await.is_err(),
        "a failing stream must fail the put"
    );
    let back = stream::collect(store.get("f/obj").await?, 64 << 20).await?;
    ensure!(
        &back[..] == b"previous",
        "the previous object changed: {} bytes",
        back.len()
    );
    let failing: ByteStream =
        Box::pin(futures::stream::once(async { Err(Error::backend("boom")) }));
    ensure!(
        store.put("f/new", failing).await.is_err(),
        "a failing stream must fail the put"
    );
    ensure!(
        matches!(store.head("f/new").await, Err(e) if e.kind() == ErrorKind::NotFound),
        "a failed put left an object"
    );
    Ok(())
}

/// Keys that could climb out of a namespace are refused.
pub async fn unsafe_keys_are_refused(store: Arc<dyn CheckpointStore>) -> Result<()> {
    for key in ["../escape", "/abs", "a/../../b", ""] {
        match store.put(key, stream::once(&b"x"[..])).await {
            Err(e) if e.kind() == ErrorKind::InvalidInput => {}
            other => bail!("key {key:?} must be refused as InvalidInput, got {other:?}"),
        }
    }
    ensure!(
        store.list("").await?.is_empty(),
        "a refused key stored something"
    );
    Ok(())
}

/// A zero-byte object is an object.
pub async fn empty_object(store: Arc<dyn CheckpointStore>) -> Result<()> {
    let meta = store.put("e/empty", stream::empty()).await?;
    ensure!(meta.size == 0, "size {}", meta.size);
    let back = stream::collect(store.get("e/empty").await?, 10).await?;
    ensure!(back.is_empty(), "got {} bytes", back.len());
    Ok(())
}
