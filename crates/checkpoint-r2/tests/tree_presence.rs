//! How a tree checkpoint learns which chunks the store already holds: a
//! `HEAD` per chunk for the first few hundred, then one listing of the
//! store's blob keys (256 prefix listings) instead of a `HEAD` per chunk,
//! unless the store holds too many blobs to list. Every request is counted
//! on a store that wraps the memory store, and each way ends in a tree
//! that restores byte for byte. Local sandboxes: runs everywhere.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use async_trait::async_trait;
use bytes::Bytes;
use common::sandboxes::{fresh_local, wall_clock};
use harness_core::checkpoint::{CheckpointStore, MemoryCheckpointStore, ObjectMeta};
use harness_core::sandbox::Sandbox;
use harness_core::stream::ByteStream;
use harness_core::tree_checkpoint::{
    checkpoint_tree, collect_garbage, restore_tree, TreeCheckpointInfo, BLOB_PREFIX,
};
use sandbox_local::LocalProvider;

/// The `HEAD`s a checkpoint asks before it lists the store instead
/// (`HEADS_BEFORE_LISTING` in `harness_core::tree_checkpoint`).
const HEADS_BEFORE_LISTING: u64 = 256;
/// Files in the tree: well past [`HEADS_BEFORE_LISTING`].
const FILES: usize = 600;

/// Requests on blob keys, by kind.
#[derive(Debug, Default)]
struct Counts {
    heads: AtomicU64,
    puts: AtomicU64,
    listings: AtomicU64,
    full_listings: AtomicU64,
}

#[derive(Debug, Default)]
struct CountingStore {
    inner: MemoryCheckpointStore,
    blobs: Counts,
}

/// The counts at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Tally {
    heads: u64,
    puts: u64,
    listings: u64,
    full_listings: u64,
}

impl Tally {
    /// What was counted from `before` to this tally.
    fn since(self, before: Tally) -> Tally {
        Tally {
            heads: self.heads - before.heads,
            puts: self.puts - before.puts,
            listings: self.listings - before.listings,
            full_listings: self.full_listings - before.full_listings,
        }
    }
}

impl CountingStore {
    fn tally(&self) -> Tally {
        let c = &self.blobs;
        Tally {
            heads: c.heads.load(Ordering::SeqCst),
            puts: c.puts.load(Ordering::SeqCst),
            listings: c.listings.load(Ordering::SeqCst),
            full_listings: c.full_listings.load(Ordering::SeqCst),
        }
    }
}

fn count(key: &str, counter: &AtomicU64) {
    if key.starts_with(BLOB_PREFIX) {
        counter.fetch_add(1, Ordering::SeqCst);
    }
}

#[async_trait]
impl CheckpointStore for CountingStore {
    async fn put(&self, key: &str, content: ByteStream) -> harness_core::Result<ObjectMeta> {
        count(key, &self.blobs.puts);
        self.inner.put(key, content).await
    }
    async fn get(&self, key: &str) -> harness_core::Result<ByteStream> {
        self.inner.get(key).await
    }
    async fn head(&self, key: &str) -> harness_core::Result<ObjectMeta> {
        count(key, &self.blobs.heads);
        self.inner.head(key).await
    }
    async fn list(&self, prefix: &str) -> harness_core::Result<Vec<ObjectMeta>> {
        // The listing with hashes: a request per object on S3.
        count(prefix, &self.blobs.full_listings);
        self.inner.list(prefix).await
    }
    async fn list_keys(&self, prefix: &str) -> harness_core::Result<Vec<String>> {
        count(prefix, &self.blobs.listings);
        self.inner.list_keys(prefix).await
    }
    async fn delete(&self, key: &str) -> harness_core::Result<()> {
        self.inner.delete(key).await
    }
}

/// `FILES` files of distinct content (plus `extra`), in two directories.
fn write_tree(root: &Path, extra: &[&str]) {
    for i in 0..FILES {
        let dir = root.join(if i % 2 == 0 { "even" } else { "odd" });
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join(format!("f{i:03}.txt")),
            format!("content of file {i}\n"),
        )
        .unwrap();
    }
    for name in extra {
        std::fs::write(root.join(name), format!("extra {name}\n")).unwrap();
    }
}

fn snapshot(root: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut dirs = vec![root.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else {
                let rel = path
                    .strip_prefix(root)
                    .unwrap()
                    .to_string_lossy()
                    .into_owned();
                out.insert(rel, std::fs::read(&path).unwrap());
            }
        }
    }
    out
}

/// A checkpoint of `sandbox`'s workdir under `key`, without a parent.
async fn first_checkpoint(
    store: &CountingStore,
    sandbox: &dyn Sandbox,
    key: &str,
) -> TreeCheckpointInfo {
    checkpoint_tree(
        sandbox,
        sandbox.workdir(),
        store,
        key,
        None,
        &wall_clock(),
        None,
    )
    .await
    .unwrap()
}

async fn assert_restores(store: &CountingStore, key: &str, provider: &LocalProvider, src: &Path) {
    let b = fresh_local(provider).await;
    restore_tree(store, key, b.as_ref(), b.workdir(), None)
        .await
        .unwrap();
    assert_eq!(
        snapshot(Path::new(b.workdir())),
        snapshot(src),
        "{key} restored is not the source"
    );
    b.destroy().await.unwrap();
}

#[tokio::test]
async fn a_large_first_checkpoint_lists_the_store_instead_of_asking_per_chunk() {
    let root = tempfile::tempdir().unwrap();
    let provider = LocalProvider::new(root.path());
    let store = CountingStore::default();

    // An empty store: 256 HEADs, then the listing; every chunk uploaded.
    let a = fresh_local(&provider).await;
    write_tree(Path::new(a.workdir()), &[]);
    let first = first_checkpoint(&store, a.as_ref(), "trees/a").await;
    let counted = store.tally();
    assert_eq!(first.chunks_uploaded, FILES as u64);
    assert_eq!(counted.puts, FILES as u64, "one put per chunk");
    assert_eq!(
        counted.heads, HEADS_BEFORE_LISTING,
        "a HEAD per chunk until the store is listed"
    );
    assert_eq!(
        counted.listings, 256,
        "one listing per two-hex-digit prefix"
    );
    assert_eq!(counted.full_listings, 0, "no listing with hashes");
    assert_restores(&store, "trees/a", &provider, Path::new(a.workdir())).await;

    // Another sandbox, the same files and one more, no parent: what the
    // store holds is found, through HEADs and then the listing alike.
    let b = fresh_local(&provider).await;
    write_tree(Path::new(b.workdir()), &["new.txt"]);
    let before = store.tally();
    let second = first_checkpoint(&store, b.as_ref(), "trees/b").await;
    let counted = store.tally().since(before);
    assert_eq!(second.files_read, FILES as u64 + 1);
    assert_eq!(second.chunks_uploaded, 1, "only the new file's chunk");
    assert_eq!(counted.puts, 1);
    assert_eq!(counted.heads, HEADS_BEFORE_LISTING);
    assert_eq!(counted.listings, 256);
    assert_restores(&store, "trees/b", &provider, Path::new(b.workdir())).await;

    // A restore of 601 chunks lists the store too, instead of 601 HEADs;
    // with one blob gone it is refused before anything is written.
    let gone = harness_core::tree_checkpoint::blob_key(&sha256_hex(b"extra new.txt\n"));
    store.inner.delete(&gone).await.unwrap();
    let c = fresh_local(&provider).await;
    let target = format!("{}/restored", c.workdir());
    let before = store.tally();
    let refused = restore_tree(&store, "trees/b", c.as_ref(), &target, None).await;
    let counted = store.tally().since(before);
    let err = refused.expect_err("a restore with a blob gone");
    assert_eq!(err.kind(), harness_core::ErrorKind::NotFound, "{err}");
    assert!(
        err.to_string().contains(&gone),
        "the error names the blob: {err}"
    );
    assert_eq!(counted.listings, 256, "the store was listed");
    assert_eq!(counted.heads, 0, "no HEAD per chunk");
    assert!(!Path::new(&target).exists(), "nothing was written");
    a.destroy().await.unwrap();
    b.destroy().await.unwrap();
    c.destroy().await.unwrap();
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(bytes))
}

#[tokio::test]
async fn a_store_too_large_to_list_is_asked_per_chunk_and_collected_by_keys() {
    let root = tempfile::tempdir().unwrap();
    let provider = LocalProvider::new(root.path());
    let store = CountingStore::default();
    let clock = wall_clock();
    // 2,049 blobs under one prefix: past what a listing holds (2,048), as
    // in a store of over half a million blobs. No manifest names them.
    for i in 0..2049u32 {
        let hash = format!("ab{:062x}", i);
        store
            .inner
            .put(
                &format!("{BLOB_PREFIX}ab/{hash}"),
                harness_core::stream::once(Bytes::from_static(b"x")),
            )
            .await
            .unwrap();
    }
    let a = fresh_local(&provider).await;
    write_tree(Path::new(a.workdir()), &[]);
    let info = first_checkpoint(&store, a.as_ref(), "trees/a").await;
    let counted = store.tally();
    assert_eq!(info.chunks_uploaded, FILES as u64);
    assert_eq!(counted.puts, FILES as u64);
    assert_eq!(
        counted.heads, FILES as u64,
        "a HEAD per chunk once the listing is given up"
    );
    assert!(
        (1..=256).contains(&counted.listings),
        "the listing was tried, and given up: {} prefix listings",
        counted.listings
    );
    assert_eq!(counted.full_listings, 0);
    assert_restores(&store, "trees/a", &provider, Path::new(a.workdir())).await;

    // Garbage collection finds the blobs by their keys, and deletes only
    // the ones no manifest names.
    let gc = collect_garbage(&store, &clock).await.unwrap();
    assert_eq!((gc.blobs_deleted, gc.blobs_kept), (2049, FILES as u64));
    assert_eq!(gc.bytes_freed, 2049, "the deleted blobs' sizes");
    assert_eq!(store.tally().full_listings, 0, "no listing with hashes");
    assert_restores(&store, "trees/a", &provider, Path::new(a.workdir())).await;
    a.destroy().await.unwrap();
}
