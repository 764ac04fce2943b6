//! The `CheckpointStore` conformance suite. Every backend's tests call
//! [`run_all`] with a factory that makes a fresh, empty store (for remote
//! stores: a fresh bucket or prefix) together with a [`Tamper`]: the
//! backend's own way to change stored bytes behind the store's back, which
//! the trait cannot do, so the suite can check that every read verifies
//! the content it returns.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use bytes::Bytes;
use futures::future::BoxFuture;
use futures::StreamExt;
use harness_core::checkpoint::CheckpointStore;
use harness_core::stream::{self, ByteStream};
use harness_core::{Error, ErrorKind};
use sha2::{Digest, Sha256};

/// Replaces the bytes stored under a key with other bytes while the store
/// keeps the hash (and size) it recorded at `put`: for S3 a raw `PutObject`
/// with the old `sha256` metadata, for memory a swap of the buffer. It
/// stands for a disk, a network or an operator changing the object.
pub type Tamper = Arc<dyn Fn(String, Bytes) -> BoxFuture<'static, Result<()>> + Send + Sync>;

/// One store to test, and the way to tamper with it.
#[derive(Clone)]
pub struct StoreUnderTest {
    /// The store, fresh and empty.
    pub store: Arc<dyn CheckpointStore>,
    /// Changes its stored bytes out of band (see [`Tamper`]).
    pub tamper: Tamper,
}

impl std::fmt::Debug for StoreUnderTest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreUnderTest")
            .field("store", &self.store)
            .finish_non_exhaustive()
    }
}

impl StoreUnderTest {
    /// `store` with its tamper hook.
    pub fn new(store: Arc<dyn CheckpointStore>, tamper: Tamper) -> Self {
        Self { store, tamper }
    }
}

/// The tamper hook for a store that seals what it stores (`view`, e.g. an
/// encrypting store) over another (`raw`): the change the suite asks for
/// is made to the sealed bytes, which are put back through `raw` as a
/// whole, consistent object (a store that serves other bytes, not a disk
/// the raw store would catch). Same length: one byte flipped at the
/// changed offset plus `header` (so never in a header of that size);
/// shorter or longer: the sealed bytes cut or extended by as much; the
/// original content: the original sealed bytes. So it is `view`'s own
/// check that must catch every case.
pub fn sealed_tamper(
    raw: Arc<dyn CheckpointStore>,
    view: Arc<dyn CheckpointStore>,
    header: usize,
) -> Tamper {
    let originals: Arc<std::sync::Mutex<BTreeMap<String, (Bytes, Bytes)>>> = Arc::default();
    Arc::new(move |key: String, bytes: Bytes| {
        let (raw, view, originals) = (raw.clone(), view.clone(), originals.clone());
        Box::pin(async move {
            let known = originals.lock().expect("originals").get(&key).cloned();
            let (plain, sealed) = match known {
                Some(o) => o,
                None => {
                    let plain = stream::collect(view.get(&key).await?, usize::MAX).await?;
                    let sealed = stream::collect(raw.get(&key).await?, usize::MAX).await?;
                    let o = (plain, sealed);
                    originals
                        .lock()
                        .expect("originals")
                        .insert(key.clone(), o.clone());
                    o
                }
            };
            let out = if bytes == plain {
                sealed
            } else if bytes.is_empty() {
                Bytes::new()
            } else if bytes.len() == plain.len() {
                let at = bytes
                    .iter()
                    .zip(plain.iter())
                    .position(|(a, b)| a != b)
                    .unwrap_or(0);
                let mut changed = sealed.to_vec();
                let at = (at + header).min(changed.len() - 1);
                changed[at] ^= 0x01;
                Bytes::from(changed)
            } else if bytes.len() < plain.len() {
                sealed.slice(..sealed.len().saturating_sub(plain.len() - bytes.len()))
            } else {
                let mut longer = sealed.to_vec();
                longer.extend_from_slice(&bytes[plain.len()..]);
                Bytes::from(longer)
            };
            raw.put(&key, stream::once(out)).await?;
            Ok(())
        })
    })
}

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
    Fut: Future<Output = StoreUnderTest>,
{
    let store = || async { factory().await.store };
    put_get_round_trip(store().await)
        .await
        .context("put_get_round_trip")?;
    streamed_multi_chunk(store().await)
        .await
        .context("streamed_multi_chunk")?;
    overwrite_replaces(store().await)
        .await
        .context("overwrite_replaces")?;
    missing_key_is_not_found(store().await)
        .await
        .context("missing_key_is_not_found")?;
    list_by_prefix(store().await)
        .await
        .context("list_by_prefix")?;
    delete_is_idempotent(store().await)
        .await
        .context("delete_is_idempotent")?;
    failed_put_leaves_previous(store().await)
        .await
        .context("failed_put_leaves_previous")?;
    unsafe_keys_are_refused(store().await)
        .await
        .context("unsafe_keys_are_refused")?;
    invalid_keys_are_refused_by_every_call(store().await)
        .await
        .context("invalid_keys_are_refused_by_every_call")?;
    key_length_limit_is_exact(store().await)
        .await
        .context("key_length_limit_is_exact")?;
    empty_object(store().await).await.context("empty_object")?;
    ranged_reads(store().await).await.context("ranged_reads")?;
    corruption_is_detected_on_read(factory().await)
        .await
        .context("corruption_is_detected_on_read")?;
    concurrent_writers_and_readers_on_one_key(store().await)
        .await
        .context("concurrent_writers_and_readers_on_one_key")?;
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

/// `get_range` answers exactly the bytes asked, at the start, inside and at
/// the very end of a small object and of a multi-chunk one (several MiB:
/// a multipart object on S3, whose stored bytes end with a hash trailer
/// that no range may reach); a range past the end is `InvalidInput`, a missing
/// key `NotFound`, an empty range no bytes.
pub async fn ranged_reads(store: Arc<dyn CheckpointStore>) -> Result<()> {
    let small = Bytes::from_static(b"0123456789abcdef");
    store
        .put("ranges/small", stream::once(small.clone()))
        .await?;
    let len = 12 * 1024 * 1024 + 123;
    let big = stream::collect(generated(len, 65_537, 11), len as usize + 1).await?;
    store.put("ranges/big", stream::once(big.clone())).await?;
    for (key, content) in [("ranges/small", &small), ("ranges/big", &big)] {
        let n = content.len() as u64;
        let mut ranges = vec![0..1, 0..n, n - 1..n, n / 3..n / 2, 3..4];
        if n > 9_000_000 {
            // Across the first part's end and inside the last part.
            ranges.extend([8 * 1024 * 1024 - 5..8 * 1024 * 1024 + 5, n - 1000..n - 10]);
        }
        for r in ranges {
            let got = store.get_range(key, r.clone()).await?;
            ensure!(
                got[..] == content[r.start as usize..r.end as usize],
                "get_range({key}, {r:?}) gave {} bytes that differ from the content",
                got.len()
            );
        }
        let empty = store.get_range(key, 5..5).await?;
        ensure!(
            empty.is_empty(),
            "an empty range gave {} bytes",
            empty.len()
        );
        for past in [n - 1..n + 1, n..n + 1, n + 10..n + 20] {
            match store.get_range(key, past.clone()).await {
                Err(e) if e.kind() == ErrorKind::InvalidInput => {}
                other => bail!(
                    "get_range({key}, {past:?}) past the end ({n} bytes) must be InvalidInput, got {:?}",
                    other.map(|b| b.len())
                ),
            }
        }
    }
    match store.get_range("ranges/never", 0..1).await {
        Err(e) if e.kind() == ErrorKind::NotFound => {}
        other => bail!(
            "get_range of a missing key must be NotFound, got {:?}",
            other.map(|b| b.len())
        ),
    }
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

/// `list(prefix)` returns exactly the keys under the prefix, sorted, and
/// `list_keys(prefix)` the same keys.
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
    for prefix in ["sessions/a/", "sessions/", "s", ""] {
        let listed: Vec<String> = store
            .list(prefix)
            .await?
            .into_iter()
            .map(|m| m.key)
            .collect();
        let keys = store.list_keys(prefix).await?;
        ensure!(
            keys == listed,
            "list_keys({prefix:?}) gave {keys:?}, list gave {listed:?}"
        );
    }
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

/// Keys no store may accept, each with why.
pub fn invalid_keys() -> Vec<(String, &'static str)> {
    vec![
        (String::new(), "empty"),
        ("../escape".into(), "leading .."),
        ("a/../../b".into(), ".. inside"),
        ("..".into(), "just .."),
        (".".into(), "just ."),
        ("a/./b".into(), ". segment"),
        ("/abs".into(), "absolute"),
        ("trailing/".into(), "trailing /"),
        ("a//b".into(), "empty segment"),
        ("sp ace".into(), "space"),
        ("back\\slash".into(), "backslash"),
        ("nul\0byte".into(), "NUL"),
        ("tilde~partial-1".into(), "~ (S3 temporaries use it)"),
        ("caf\u{e9}".into(), "non-ASCII"),
        ("new\nline".into(), "newline"),
        (
            format!("long/{}/{}", "x".repeat(255), "y".repeat(252)),
            "513 bytes",
        ),
        (format!("seg/{}", "z".repeat(256)), "a 256-byte segment"),
    ]
}

fn invalid<T: std::fmt::Debug>(
    result: harness_core::Result<T>,
    call: &str,
    key: &str,
    why: &str,
) -> Result<()> {
    match result {
        Err(e) if e.kind() == ErrorKind::InvalidInput => Ok(()),
        other => bail!(
            "{call} of an invalid key ({why}: {:?}) must be InvalidInput, got {other:?}",
            key.chars().take(40).collect::<String>()
        ),
    }
}

/// Every call that takes a key (`put`, `get`, `head`, `delete`) refuses an
/// invalid one as `InvalidInput` before doing anything, whether or not an
/// object exists; `list` with a hostile prefix finds nothing.
pub async fn invalid_keys_are_refused_by_every_call(store: Arc<dyn CheckpointStore>) -> Result<()> {
    store
        .put("sessions/keep", stream::once(&b"kept"[..]))
        .await?;
    for (key, why) in invalid_keys() {
        invalid(
            store.put(&key, stream::once(&b"x"[..])).await,
            "put",
            &key,
            why,
        )?;
        invalid(store.get(&key).await.map(|_| ()), "get", &key, why)?;
        invalid(store.head(&key).await, "head", &key, why)?;
        invalid(store.delete(&key).await, "delete", &key, why)?;
    }
    // Keys that would reach the kept object only by climbing.
    for key in ["sessions/x/../keep", "./sessions/keep", "sessions//keep"] {
        invalid(store.get(key).await.map(|_| ()), "get", key, "climbing")?;
        invalid(store.delete(key).await, "delete", key, "climbing")?;
    }
    for prefix in ["../", "/", "sessions/../"] {
        match store.list(prefix).await {
            Ok(found) => ensure!(
                found.is_empty(),
                "list({prefix:?}) must find nothing, got {found:?}"
            ),
            Err(e) if e.kind() == ErrorKind::InvalidInput => {}
            Err(e) => bail!("list({prefix:?}) must be empty or InvalidInput, got {e}"),
        }
    }
    let all: Vec<String> = store.list("").await?.into_iter().map(|m| m.key).collect();
    ensure!(
        all == ["sessions/keep"],
        "a refused call changed the store: {all:?}"
    );
    let back = stream::collect(store.get("sessions/keep").await?, 64).await?;
    ensure!(&back[..] == b"kept", "the kept object changed: {back:?}");
    Ok(())
}

/// A key of exactly the limit (512 bytes, with a segment of exactly the
/// 255-byte segment limit) works with every call; one byte more, in all or
/// in a segment, is refused by every call.
pub async fn key_length_limit_is_exact(store: Arc<dyn CheckpointStore>) -> Result<()> {
    use harness_core::checkpoint::{MAX_KEY_BYTES, MAX_KEY_SEGMENT_BYTES};
    let head = format!("limit/{}", "k".repeat(MAX_KEY_SEGMENT_BYTES));
    let key = format!("{head}/{}", "k".repeat(MAX_KEY_BYTES - head.len() - 1));
    ensure!(
        key.len() == MAX_KEY_BYTES,
        "built a key of {} bytes",
        key.len()
    );
    let meta = store
        .put(&key, stream::once(&b"at the limit"[..]))
        .await
        .context("put of a key of exactly the limit")?;
    ensure!(meta.key == key, "put answered key {:?}", meta.key);
    let back = stream::collect(store.get(&key).await?, 64).await?;
    ensure!(&back[..] == b"at the limit", "got {back:?}");
    ensure!(store.head(&key).await? == meta, "head differs from put");
    let listed: Vec<String> = store
        .list("limit/")
        .await?
        .into_iter()
        .map(|m| m.key)
        .collect();
    ensure!(listed == [key.clone()], "list gave {listed:?}");
    let long_segment = format!("limit/{}", "k".repeat(MAX_KEY_SEGMENT_BYTES + 1));
    for over in [format!("{key}k"), long_segment] {
        invalid(
            store.put(&over, stream::once(&b"x"[..])).await,
            "put",
            &over,
            "one byte over the limit",
        )?;
        invalid(store.get(&over).await.map(|_| ()), "get", &over, "over")?;
        invalid(store.head(&over).await, "head", &over, "over")?;
        invalid(store.delete(&over).await, "delete", &over, "over")?;
    }
    store.delete(&key).await?;
    ensure!(
        store.list("").await?.is_empty(),
        "delete at the limit left something"
    );
    Ok(())
}

/// Read `key` to the end and require the read to fail as `Corrupt` (at
/// `get` or, at the latest, as the stream's last item).
async fn expect_corrupt(store: &dyn CheckpointStore, key: &str, what: &str) -> Result<()> {
    let mut s = match store.get(key).await {
        Err(e) if e.kind() == ErrorKind::Corrupt => return Ok(()),
        Err(e) => bail!("{what}: get must fail as Corrupt, got {e}"),
        Ok(s) => s,
    };
    let mut bytes = 0usize;
    loop {
        match tokio::time::timeout(Duration::from_secs(60), s.next()).await {
            Err(_) => bail!("{what}: reading hung"),
            Ok(None) => bail!(
                "{what}: the read ended cleanly after {bytes} bytes: content that does not \
                 match the recorded sha256 was handed out as good"
            ),
            Ok(Some(Ok(chunk))) => bytes += chunk.len(),
            Ok(Some(Err(e))) if e.kind() == ErrorKind::Corrupt => return Ok(()),
            Ok(Some(Err(e))) => bail!("{what}: the read must fail as Corrupt, got {e}"),
        }
    }
}

/// Bytes changed behind the store's back (one byte flipped anywhere,
/// truncated, emptied, extended) are never read as good: the read ends in
/// `Corrupt`. A new put heals the key.
pub async fn corruption_is_detected_on_read(sut: StoreUnderTest) -> Result<()> {
    let store = sut.store.as_ref();
    let key = "tamper/obj.tar.zst";
    let original = stream::collect(generated(300_017, 10_000, 11), 1 << 20).await?;
    let meta = store.put(key, stream::once(original.clone())).await?;
    ensure!(meta.size == original.len() as u64, "put meta {meta:?}");
    let flipped = |at: usize| {
        let mut b = original.to_vec();
        b[at] ^= 0x01;
        Bytes::from(b)
    };
    let n = original.len();
    let cases: Vec<(&str, Bytes)> = vec![
        ("one byte flipped in the middle", flipped(n / 2)),
        ("the first byte flipped", flipped(0)),
        ("the last byte flipped", flipped(n - 1)),
        ("truncated by one byte", original.slice(..n - 1)),
        ("truncated to a third", original.slice(..n / 3)),
        ("emptied", Bytes::new()),
        ("one byte appended", {
            let mut b = original.to_vec();
            b.push(0);
            Bytes::from(b)
        }),
    ];
    for (what, bytes) in cases {
        (sut.tamper)(key.to_string(), bytes)
            .await
            .with_context(|| format!("tampering: {what}"))?;
        expect_corrupt(store, key, what).await?;
    }
    // The tamper hook really writes (or the checks above prove nothing):
    // the original bytes under the old hash read as good again.
    (sut.tamper)(key.to_string(), original.clone()).await?;
    let back = stream::collect(store.get(key).await?, 1 << 20).await?;
    ensure!(
        back == original,
        "after putting the original bytes back, the read differs"
    );
    store.put(key, stream::once(&b"fresh content"[..])).await?;
    let back = stream::collect(store.get(key).await?, 64).await?;
    ensure!(
        &back[..] == b"fresh content",
        "a put after tampering: {back:?}"
    );
    Ok(())
}

/// `stream` with a yield before each chunk, so concurrent puts and reads
/// interleave even on a single-threaded runtime.
fn interleaved(stream: ByteStream) -> ByteStream {
    Box::pin(stream.then(|chunk| async move {
        tokio::task::yield_now().await;
        chunk
    }))
}

/// Several writers replace one key while several readers read it: every
/// read that succeeds returns exactly one version that some writer put,
/// whole, with its own hash (never a mix, never a version with another's
/// hash); no read fails; `NotFound` only before the first put finished.
/// At the end `head` and `get` agree on one version.
pub async fn concurrent_writers_and_readers_on_one_key(
    store: Arc<dyn CheckpointStore>,
) -> Result<()> {
    const KEY: &str = "race/one-key";
    const WRITERS: u64 = 3;
    const ROUNDS: u64 = 2;
    // Small and multi-MiB versions alternate, so S3 stores take both the
    // single-request and the multipart path.
    let version = |seed: u64| -> (u64, usize) {
        let len = if seed.is_multiple_of(2) {
            6 * 1024 * 1024 + seed
        } else {
            100_000 + seed
        };
        (len, 65_536 + seed as usize)
    };
    let mut versions = BTreeMap::new();
    for seed in 1..=WRITERS * ROUNDS {
        let (len, chunk) = version(seed);
        let (sha, _) = digest(generated(len, chunk, seed)).await?;
        versions.insert(sha, (seed, len));
    }
    let versions = Arc::new(versions);
    let written = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let writers_done = Arc::new(std::sync::atomic::AtomicBool::new(false));

    let mut writers = Vec::new();
    for w in 0..WRITERS {
        let (store, versions, written) = (store.clone(), versions.clone(), written.clone());
        writers.push(tokio::spawn(async move {
            for round in 0..ROUNDS {
                let seed = 1 + w + round * WRITERS;
                let (len, chunk) = version(seed);
                let meta = store
                    .put(KEY, interleaved(generated(len, chunk, seed)))
                    .await
                    .with_context(|| format!("writer {w} put of version {seed}"))?;
                ensure!(
                    versions.get(&meta.sha256) == Some(&(seed, len)) && meta.size == len,
                    "writer {w}: put of version {seed} answered {meta:?}"
                );
                written.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
            anyhow::Ok(())
        }));
    }
    let mut readers = Vec::new();
    for r in 0..3 {
        let (store, versions, written, done) = (
            store.clone(),
            versions.clone(),
            written.clone(),
            writers_done.clone(),
        );
        readers.push(tokio::spawn(async move {
            let mut reads = 0u32;
            loop {
                let finished = done.load(std::sync::atomic::Ordering::SeqCst);
                let before = written.load(std::sync::atomic::Ordering::SeqCst);
                match store.get(KEY).await {
                    Err(e) if e.kind() == ErrorKind::NotFound => ensure!(
                        before == 0,
                        "reader {r}: NotFound after {before} put(s) had finished"
                    ),
                    Err(e) => bail!("reader {r}: get failed while writers ran: {e}"),
                    Ok(s) => {
                        let (sha, len) = digest(interleaved(s))
                            .await
                            .with_context(|| format!("reader {r}: reading while writers ran"))?;
                        let Some((seed, want)) = versions.get(&sha) else {
                            bail!(
                                "reader {r}: read {len} bytes with hash {sha}, which no writer \
                                 put (a mix of versions)"
                            );
                        };
                        ensure!(
                            len == *want,
                            "reader {r}: version {seed} came back with {len} bytes"
                        );
                        reads += 1;
                    }
                }
                match store.head(KEY).await {
                    Err(e) if e.kind() == ErrorKind::NotFound => {}
                    Err(e) => bail!("reader {r}: head failed while writers ran: {e}"),
                    Ok(meta) => ensure!(
                        versions
                            .get(&meta.sha256)
                            .is_some_and(|(_, len)| *len == meta.size),
                        "reader {r}: head answered {meta:?}, which no writer put"
                    ),
                }
                if finished && reads >= 2 {
                    return anyhow::Ok(reads);
                }
                tokio::task::yield_now().await;
            }
        }));
    }
    let mut failures = Vec::new();
    for w in writers {
        if let Err(e) = w.await.context("writer task")? {
            failures.push(format!("{e:#}"));
        }
    }
    writers_done.store(true, std::sync::atomic::Ordering::SeqCst);
    for r in readers {
        if let Err(e) = r.await.context("reader task")? {
            failures.push(format!("{e:#}"));
        }
    }
    ensure!(failures.is_empty(), "{}", failures.join("\n"));
    let head = store.head(KEY).await?;
    let (sha, len) = digest(store.get(KEY).await?).await?;
    ensure!(
        sha == head.sha256 && len == head.size && versions.contains_key(&sha),
        "after the race head says {head:?} but get read {len} bytes with hash {sha}"
    );
    let all = store.list("").await?;
    ensure!(
        all.len() == 1 && all[0] == head,
        "after the race list gives {all:?}"
    );
    Ok(())
}
