//! How a tree checkpoint learns which chunks the store already holds, and
//! how small files travel in packs: a run with many small files to store
//! lists the store (256 prefix listings of blob keys, and the packs'
//! indexes) instead of a `HEAD` per chunk, and writes their chunks into
//! packs, a restore reads runs of them with one ranged `GET` each; a run
//! with a few stores blobs and asks with `HEAD`s, as a store too large to
//! list is asked. Every request is counted on a store that wraps the
//! memory store, and each way ends in a tree that restores byte for byte.
//! Local sandboxes: runs everywhere.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use async_trait::async_trait;
use bytes::Bytes;
use common::{fresh_local, noise, wall_clock};
use harness_core::checkpoint::{CheckpointStore, MemoryCheckpointStore, ObjectMeta};
use harness_core::sandbox::Sandbox;
use harness_core::stream::ByteStream;
use harness_core::ErrorKind;
use harness_moves::tree::{
    blob_key, checkpoint_tree, collect_garbage, forget_kept, pack_index_key, pack_key,
    read_manifest, restore_tree, TreeCheckpointInfo, BLOB_PREFIX, PACK_PREFIX,
};
use sandbox_local::LocalProvider;

/// Files in the tree: well past the 64 small chunks from which a run
/// packs, and the 256 chunks from which a restore lists the store.
const FILES: usize = 600;

/// Requests on one kind of key, by kind.
#[derive(Debug, Default)]
struct Counts {
    heads: AtomicU64,
    puts: AtomicU64,
    gets: AtomicU64,
    ranged_gets: AtomicU64,
    /// Bytes asked for by ranged reads.
    ranged_bytes: AtomicU64,
    listings: AtomicU64,
    full_listings: AtomicU64,
}

#[derive(Debug, Default)]
struct CountingStore {
    inner: MemoryCheckpointStore,
    blobs: Counts,
    packs: Counts,
}

/// The counts of one kind of key at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Tally {
    heads: u64,
    puts: u64,
    gets: u64,
    ranged_gets: u64,
    ranged_bytes: u64,
    listings: u64,
    full_listings: u64,
}

impl Tally {
    /// What was counted from `before` to this tally.
    fn since(self, before: Tally) -> Tally {
        Tally {
            heads: self.heads - before.heads,
            puts: self.puts - before.puts,
            gets: self.gets - before.gets,
            ranged_gets: self.ranged_gets - before.ranged_gets,
            ranged_bytes: self.ranged_bytes - before.ranged_bytes,
            listings: self.listings - before.listings,
            full_listings: self.full_listings - before.full_listings,
        }
    }
}

impl Counts {
    fn tally(&self) -> Tally {
        Tally {
            heads: self.heads.load(Ordering::SeqCst),
            puts: self.puts.load(Ordering::SeqCst),
            gets: self.gets.load(Ordering::SeqCst),
            ranged_gets: self.ranged_gets.load(Ordering::SeqCst),
            ranged_bytes: self.ranged_bytes.load(Ordering::SeqCst),
            listings: self.listings.load(Ordering::SeqCst),
            full_listings: self.full_listings.load(Ordering::SeqCst),
        }
    }
}

/// Blob and pack requests at one moment.
#[derive(Debug, Clone, Copy)]
struct Tallies {
    blobs: Tally,
    packs: Tally,
}

impl Tallies {
    fn since(self, before: Tallies) -> Tallies {
        Tallies {
            blobs: self.blobs.since(before.blobs),
            packs: self.packs.since(before.packs),
        }
    }
}

impl CountingStore {
    fn tally(&self) -> Tallies {
        Tallies {
            blobs: self.blobs.tally(),
            packs: self.packs.tally(),
        }
    }

    /// The counter of `key`'s kind, if it is a blob or pack key.
    fn count(&self, key: &str, which: fn(&Counts) -> &AtomicU64) {
        let counts = if key.starts_with(BLOB_PREFIX) {
            &self.blobs
        } else if key.starts_with(PACK_PREFIX) {
            &self.packs
        } else {
            return;
        };
        which(counts).fetch_add(1, Ordering::SeqCst);
    }
}

#[async_trait]
impl CheckpointStore for CountingStore {
    async fn put(&self, key: &str, content: ByteStream) -> harness_core::Result<ObjectMeta> {
        self.count(key, |c| &c.puts);
        self.inner.put(key, content).await
    }
    async fn get(&self, key: &str) -> harness_core::Result<ByteStream> {
        self.count(key, |c| &c.gets);
        self.inner.get(key).await
    }
    async fn get_range(
        &self,
        key: &str,
        range: std::ops::Range<u64>,
    ) -> harness_core::Result<Bytes> {
        self.count(key, |c| &c.ranged_gets);
        if key.starts_with(PACK_PREFIX) {
            self.packs
                .ranged_bytes
                .fetch_add(range.end - range.start, Ordering::SeqCst);
        }
        self.inner.get_range(key, range).await
    }
    async fn head(&self, key: &str) -> harness_core::Result<ObjectMeta> {
        self.count(key, |c| &c.heads);
        self.inner.head(key).await
    }
    async fn list(&self, prefix: &str) -> harness_core::Result<Vec<ObjectMeta>> {
        // The listing with hashes: a request per object on S3.
        self.count(prefix, |c| &c.full_listings);
        self.inner.list(prefix).await
    }
    async fn list_keys(&self, prefix: &str) -> harness_core::Result<Vec<String>> {
        self.count(prefix, |c| &c.listings);
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

async fn assert_restores(
    store: &CountingStore,
    key: &str,
    provider: &LocalProvider,
    src: &Path,
) -> harness_moves::tree::TreeRestoreInfo {
    let b = fresh_local(provider).await;
    let info = restore_tree(store, key, b.as_ref(), b.workdir(), None)
        .await
        .unwrap();
    assert_eq!(
        snapshot(Path::new(b.workdir())),
        snapshot(src),
        "{key} restored is not the source"
    );
    b.destroy().await.unwrap();
    info
}

/// The packs a stored manifest names.
async fn packs_of(store: &CountingStore, key: &str) -> Vec<String> {
    read_manifest(store, key).await.unwrap().unwrap().packs
}

#[tokio::test]
async fn many_small_files_travel_in_a_pack_and_restore_with_one_ranged_read() {
    let root = tempfile::tempdir().unwrap();
    let provider = LocalProvider::new(root.path());
    let store = CountingStore::default();

    // An empty store: the run lists it (no HEAD per chunk) and packs
    // every chunk; no blob is written.
    let a = fresh_local(&provider).await;
    write_tree(Path::new(a.workdir()), &[]);
    let first = first_checkpoint(&store, a.as_ref(), "trees/a").await;
    let counted = store.tally();
    assert_eq!(first.chunks_uploaded, FILES as u64);
    assert_eq!(counted.blobs.puts, 0, "no blob for a small file");
    assert_eq!(counted.blobs.heads, 0, "the store is listed instead");
    assert_eq!(
        counted.blobs.listings, 256,
        "one listing per two-hex-digit prefix"
    );
    assert_eq!(counted.packs.listings, 1, "and one of the packs");
    assert_eq!(counted.packs.puts, 2, "one pack and its index");
    assert_eq!(counted.blobs.full_listings + counted.packs.full_listings, 0);
    let packs = packs_of(&store, "trees/a").await;
    assert_eq!(packs.len(), 1, "{packs:?}");
    let pack = &packs[0];
    assert!(store.inner.head(&pack_key(pack)).await.is_ok());
    assert!(store.inner.head(&pack_index_key(pack)).await.is_ok());

    // A restore in a new process: the index is read from the store, and
    // the 600 chunks come out of one ranged read per stream of files (the
    // local sandbox takes as many as the host has cores; directories go
    // in a stream of their own), each reading its own part of the pack:
    // no byte is read twice.
    forget_kept();
    let pack_size = store.inner.head(&pack_key(pack)).await.unwrap().size;
    let before = store.tally();
    let restored = assert_restores(&store, "trees/a", &provider, Path::new(a.workdir())).await;
    let counted = store.tally().since(before);
    let file_streams = match restored.streams {
        1 => 1,
        n => n - 1,
    };
    assert_eq!(counted.packs.gets, 1, "the pack's index");
    assert_eq!(
        counted.packs.ranged_gets, file_streams,
        "one read per stream of files ({} streams)",
        restored.streams
    );
    assert!(
        counted.packs.ranged_bytes <= pack_size,
        "{} bytes read of a {pack_size}-byte pack: a part was read twice",
        counted.packs.ranged_bytes
    );
    assert_eq!(counted.packs.heads, 1, "the pack is there, and whole");
    assert_eq!(counted.blobs.gets + counted.blobs.ranged_gets, 0);
    // Many chunks: the packs' index is read first and answers for every
    // one, so no blob is asked for (neither a `HEAD` nor a listing).
    assert_eq!(counted.blobs.heads + counted.blobs.listings, 0);

    // Another sandbox, the same files and one more, no parent: the packed
    // chunks are found through the packs' indexes, and the one new chunk
    // (too few to pack) goes up as a blob.
    let b = fresh_local(&provider).await;
    write_tree(Path::new(b.workdir()), &["new.txt"]);
    let before = store.tally();
    let second = first_checkpoint(&store, b.as_ref(), "trees/b").await;
    let counted = store.tally().since(before);
    assert_eq!(second.files_read, FILES as u64 + 1);
    assert_eq!(second.chunks_uploaded, 1, "only the new file's chunk");
    assert_eq!(counted.blobs.puts, 1);
    assert_eq!(counted.packs.puts, 0, "no new pack");
    assert_eq!(
        packs_of(&store, "trees/b").await,
        packs,
        "the manifest names the pack that holds its chunks"
    );
    forget_kept();
    assert_restores(&store, "trees/b", &provider, Path::new(b.workdir())).await;

    // With the blob gone, or the pack, or the pack replaced by other
    // bytes, a restore is refused before anything is written.
    let gone = blob_key(&sha256_hex(b"extra new.txt\n"));
    let blob = take(&store, &gone).await;
    let c = fresh_local(&provider).await;
    let target = format!("{}/restored", c.workdir());
    let err = refused(&store, "trees/b", c.as_ref(), &target, "a blob gone").await;
    assert_eq!(err.kind(), ErrorKind::NotFound, "{err}");
    assert!(
        err.to_string().contains(&gone),
        "the error names the blob: {err}"
    );
    put_back(&store, &gone, blob).await;

    let pack_bytes = take(&store, &pack_key(pack)).await;
    let err = refused(&store, "trees/b", c.as_ref(), &target, "its pack gone").await;
    assert_eq!(err.kind(), ErrorKind::NotFound, "{err}");
    assert!(
        err.to_string().contains(&pack_key(pack)),
        "the error names the pack: {err}"
    );

    let mut other = pack_bytes.to_vec();
    other[0] ^= 1;
    put_back(&store, &pack_key(pack), Bytes::from(other)).await;
    let err = refused(&store, "trees/b", c.as_ref(), &target, "its pack replaced").await;
    assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");
    put_back(&store, &pack_key(pack), pack_bytes).await;

    // Its index gone (and not kept by this process): refused the same way.
    let index_bytes = take(&store, &pack_index_key(pack)).await;
    forget_kept();
    let err = refused(&store, "trees/b", c.as_ref(), &target, "its index gone").await;
    assert_eq!(err.kind(), ErrorKind::NotFound, "{err}");
    assert!(
        err.to_string().contains(&pack_index_key(pack)),
        "the error names the index: {err}"
    );
    put_back(&store, &pack_index_key(pack), index_bytes).await;

    // Garbage collection keeps the pack while a manifest names it, and
    // deletes it with its index when none does.
    let clock = wall_clock();
    let gc = collect_garbage(&store, &clock).await.unwrap();
    assert_eq!(
        (gc.packs_kept, gc.packs_deleted, gc.blobs_deleted),
        (1, 0, 0)
    );
    store.inner.delete("trees/a").await.unwrap();
    let gc = collect_garbage(&store, &clock).await.unwrap();
    assert_eq!(
        (gc.packs_kept, gc.packs_deleted),
        (1, 0),
        "trees/b names it too"
    );
    store.inner.delete("trees/b").await.unwrap();
    let gc = collect_garbage(&store, &clock).await.unwrap();
    assert_eq!((gc.packs_deleted, gc.blobs_deleted), (1, 1));
    assert!(store.inner.list_keys(PACK_PREFIX).await.unwrap().is_empty());
    a.destroy().await.unwrap();
    b.destroy().await.unwrap();
    c.destroy().await.unwrap();
}

/// The object under `key`, removed from the store (see [`put_back`]).
async fn take(store: &CountingStore, key: &str) -> Bytes {
    let size = store.inner.head(key).await.unwrap().size;
    let bytes = store.inner.get_range(key, 0..size).await.unwrap();
    store.inner.delete(key).await.unwrap();
    bytes
}

async fn put_back(store: &CountingStore, key: &str, bytes: Bytes) {
    store
        .inner
        .put(key, harness_core::stream::once(bytes))
        .await
        .unwrap();
}

/// The error of a restore of `key` into `target` that must be refused
/// (with `what` wrong in the store), after checking nothing was written.
async fn refused(
    store: &CountingStore,
    key: &str,
    sandbox: &dyn Sandbox,
    target: &str,
    what: &str,
) -> harness_core::Error {
    let err = restore_tree(store, key, sandbox, target, None)
        .await
        .expect_err(&format!("a restore with {what}"));
    assert!(!Path::new(target).exists(), "{what}: nothing was written");
    err
}

#[tokio::test]
async fn packs_are_cut_at_their_size_and_read_in_bounded_ranges() {
    let root = tempfile::tempdir().unwrap();
    let provider = LocalProvider::new(root.path());
    let store = CountingStore::default();
    // 100 files of 100 KiB of noise: ~10 MiB of chunks, more than one
    // 8 MiB pack, and more than two 4 MiB reads.
    let a = fresh_local(&provider).await;
    for i in 0..100u64 {
        let path = Path::new(a.workdir()).join(format!("n{i:03}.bin"));
        std::fs::write(path, noise(100 * 1024, i + 1)).unwrap();
    }
    let info = first_checkpoint(&store, a.as_ref(), "trees/noise").await;
    assert_eq!(info.chunks_uploaded, 100);
    assert_eq!(store.tally().blobs.puts, 0);
    let packs = packs_of(&store, "trees/noise").await;
    assert_eq!(packs.len(), 2, "sealed at 8 MiB: {packs:?}");
    forget_kept();
    let before = store.tally();
    assert_restores(&store, "trees/noise", &provider, Path::new(a.workdir())).await;
    let reads = store.tally().since(before).packs.ranged_gets;
    // 10 MiB in reads of at most 4 MiB, one pack's tail a read of its own.
    assert!((3..=4).contains(&reads), "{reads} ranged reads");
    a.destroy().await.unwrap();
}

#[tokio::test]
async fn a_few_changed_files_go_up_as_blobs_and_restore_without_the_packs() {
    let root = tempfile::tempdir().unwrap();
    let provider = LocalProvider::new(root.path());
    let store = CountingStore::default();
    let a = fresh_local(&provider).await;
    write_tree(Path::new(a.workdir()), &[]);
    first_checkpoint(&store, a.as_ref(), "trees/1").await;
    let b = fresh_local(&provider).await;
    restore_tree(&store, "trees/1", b.as_ref(), b.workdir(), None)
        .await
        .unwrap();
    for name in ["even/f000.txt", "odd/f001.txt", "odd/f003.txt"] {
        std::fs::write(
            Path::new(a.workdir()).join(name),
            format!("changed {name}\n"),
        )
        .unwrap();
    }
    let before = store.tally();
    let info = checkpoint_tree(
        a.as_ref(),
        a.workdir(),
        &store,
        "trees/2",
        Some("trees/1"),
        &wall_clock(),
        None,
    )
    .await
    .unwrap();
    let counted = store.tally().since(before);
    assert_eq!(info.chunks_uploaded, 3);
    assert_eq!(counted.blobs.puts, 3, "three blobs");
    assert_eq!(counted.packs.puts, 0, "no pack for three files");
    assert_eq!(counted.blobs.listings, 0, "no listing for three files");
    assert_eq!(
        packs_of(&store, "trees/2").await,
        packs_of(&store, "trees/1").await,
        "the parent's pack still holds the unchanged files"
    );
    // Onto the state of its parent, in a new process: three blobs, no
    // pack index read.
    forget_kept();
    let before = store.tally();
    let restored = restore_tree(&store, "trees/2", b.as_ref(), b.workdir(), None)
        .await
        .unwrap();
    let counted = store.tally().since(before);
    assert_eq!(restored.written, 3);
    assert_eq!(counted.blobs.gets, 3);
    assert_eq!(counted.packs.gets + counted.packs.ranged_gets, 0);
    assert_eq!(
        snapshot(Path::new(b.workdir())),
        snapshot(Path::new(a.workdir()))
    );
    a.destroy().await.unwrap();
    b.destroy().await.unwrap();
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
    assert_eq!(
        counted.blobs.heads, FILES as u64,
        "a HEAD per chunk once the listing is given up"
    );
    assert!(
        (1..=256).contains(&counted.blobs.listings),
        "the listing was tried, and given up: {} prefix listings",
        counted.blobs.listings
    );
    assert_eq!(
        counted.blobs.puts, 0,
        "the chunks the store lacks are packed"
    );
    assert_eq!(counted.packs.puts, 2);
    assert_eq!(counted.blobs.full_listings, 0);
    assert_restores(&store, "trees/a", &provider, Path::new(a.workdir())).await;

    // Garbage collection finds the blobs by their keys, and deletes only
    // the ones no manifest names.
    let gc = collect_garbage(&store, &clock).await.unwrap();
    assert_eq!((gc.blobs_deleted, gc.blobs_kept), (2049, 0));
    assert_eq!((gc.packs_kept, gc.packs_deleted), (1, 0));
    assert_eq!(gc.bytes_freed, 2049, "the deleted blobs' sizes");
    assert_eq!(
        store.tally().blobs.full_listings,
        0,
        "no listing with hashes"
    );
    assert_restores(&store, "trees/a", &provider, Path::new(a.workdir())).await;
    a.destroy().await.unwrap();
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(bytes))
}
