//! Restoring a tree checkpoint (`tree/restore.rs`) into real local
//! sandboxes: what lands on disk (content, modes, mtimes, symlinks, paths
//! past tar's 100 bytes), what a restore leaves alone (a target already
//! holding the tree is not written to), what it removes (the paths the
//! checkpoint deleted, only as the parent had them, deepest first), and
//! what it refuses before writing a byte: a key that names no tree, a blob
//! or a pack gone, a pack that is not the one its index describes. A chunk
//! that fails its hash mid-stream fails the restore, and a failed restore
//! removes nothing.

mod common;

use std::collections::BTreeMap;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use common::{fresh_local, noise, wall_clock};
use harness_core::checkpoint::{CheckpointStore, MemoryCheckpointStore};
use harness_core::sandbox::Sandbox;
use harness_core::ErrorKind;
use harness_moves::tree::{
    blob_key, checkpoint_tree, forget_kept, pack_index_key, pack_key, read_manifest, restore_tree,
    TreeKind,
};
use harness_moves::{MovePhase, MoveProgress};
use sandbox_local::LocalProvider;

/// What a path holds, as the restore must reproduce it.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Node {
    File {
        content: Vec<u8>,
        mode: u32,
        mtime: i64,
    },
    Dir {
        mode: u32,
    },
    Link {
        target: String,
    },
}

/// Every path under `root` (not `root` itself) with what it holds.
fn snapshot(root: &Path) -> BTreeMap<String, Node> {
    let mut out = BTreeMap::new();
    let mut dirs = vec![root.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let rel = path.strip_prefix(root).unwrap().display().to_string();
            let meta = std::fs::symlink_metadata(&path).unwrap();
            let mode = meta.permissions().mode() & 0o7777;
            let node = if meta.file_type().is_symlink() {
                let target = std::fs::read_link(&path).unwrap();
                Node::Link {
                    target: target.display().to_string(),
                }
            } else if meta.is_dir() {
                dirs.push(path.clone());
                Node::Dir { mode }
            } else {
                Node::File {
                    content: std::fs::read(&path).unwrap(),
                    mode,
                    mtime: meta.mtime(),
                }
            };
            out.insert(rel, node);
        }
    }
    out
}

fn write(root: &Path, rel: &str, content: &[u8], mode: u32) {
    let path = root.join(rel);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(&path, content).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
    // A minute ago: an unchanged file is then not "racy" for the next
    // checkpoint, which keeps its chunks without reading it.
    let then = std::time::SystemTime::now() - std::time::Duration::from_secs(60);
    std::fs::File::options()
        .write(true)
        .open(&path)
        .unwrap()
        .set_modified(then)
        .unwrap();
}

/// A tree with one of each thing a restore writes differently.
fn varied_tree(root: &Path) {
    write(root, "README.md", b"# a tree\n", 0o644);
    write(root, "empty", b"", 0o600);
    write(root, "bin/run.sh", b"#!/bin/sh\necho run\n", 0o755);
    // Three chunks at least (chunks are at most 4 MiB).
    write(root, "data/big.bin", &noise(9 * 1024 * 1024, 7), 0o644);
    let deep = format!("{}/{}", "d".repeat(60), "e".repeat(60));
    write(
        root,
        &format!("{deep}/past-one-hundred-bytes.txt"),
        b"long path\n",
        0o644,
    );
    std::os::unix::fs::symlink("README.md", root.join("link")).unwrap();
    let far = format!("../{}", "t".repeat(120));
    std::os::unix::fs::symlink(&far, root.join("bin/far-link")).unwrap();
    std::fs::create_dir_all(root.join("empty-dir")).unwrap();
    std::fs::set_permissions(
        root.join("empty-dir"),
        std::fs::Permissions::from_mode(0o700),
    )
    .unwrap();
}

/// Two local sandboxes of one provider: a source and a target.
struct Pair {
    _root: tempfile::TempDir,
    src: Box<dyn Sandbox>,
    dst: Box<dyn Sandbox>,
}

impl Pair {
    async fn new() -> Pair {
        let root = tempfile::tempdir().unwrap();
        let provider = LocalProvider::new(root.path());
        let src = fresh_local(&provider).await;
        let dst = fresh_local(&provider).await;
        Pair {
            _root: root,
            src,
            dst,
        }
    }

    fn src_dir(&self) -> PathBuf {
        PathBuf::from(self.src.workdir())
    }

    fn dst_dir(&self) -> PathBuf {
        PathBuf::from(self.dst.workdir())
    }

    async fn checkpoint(&self, store: &dyn CheckpointStore, key: &str, parent: Option<&str>) {
        checkpoint_tree(
            self.src.as_ref(),
            self.src.workdir(),
            store,
            key,
            parent,
            &wall_clock(),
            None,
        )
        .await
        .unwrap();
    }

    async fn restore(
        &self,
        store: &dyn CheckpointStore,
        key: &str,
    ) -> harness_core::Result<harness_moves::tree::TreeRestoreInfo> {
        restore_tree(store, key, self.dst.as_ref(), self.dst.workdir(), None).await
    }
}

/// Requests by verb, to show what a restore asked the store for. Paced,
/// each blob `GET` waits before it answers (the `n`-th `(n % 8 + 1)` ×
/// 100 ms, so they end one after another) and the store notes how many
/// blob `GET`s were waiting, itself included, when each started.
#[derive(Debug)]
struct Counting {
    inner: MemoryCheckpointStore,
    gets: AtomicU64,
    ranged: AtomicU64,
    paced: bool,
    blob_heads: AtomicU64,
    waiting: AtomicU64,
    at_start: Mutex<Vec<u64>>,
}

impl Counting {
    fn new() -> Counting {
        Counting {
            inner: MemoryCheckpointStore::new(),
            gets: AtomicU64::new(0),
            ranged: AtomicU64::new(0),
            paced: false,
            blob_heads: AtomicU64::new(0),
            waiting: AtomicU64::new(0),
            at_start: Mutex::new(Vec::new()),
        }
    }

    fn paced() -> Counting {
        Counting {
            paced: true,
            ..Counting::new()
        }
    }

    /// Reads of content (blobs and packs): not of a manifest, which this
    /// process may keep or not (its cache is shared by every test in it).
    fn reads(&self) -> u64 {
        self.gets.load(Ordering::SeqCst) + self.ranged.load(Ordering::SeqCst)
    }

    fn ranged(&self) -> u64 {
        self.ranged.load(Ordering::SeqCst)
    }

    async fn pace(&self, key: &str) {
        if !self.paced || !key.starts_with(harness_moves::tree::BLOB_PREFIX) {
            return;
        }
        let now = self.waiting.fetch_add(1, Ordering::SeqCst) + 1;
        let n = {
            let mut at_start = self.at_start.lock().unwrap();
            at_start.push(now);
            at_start.len() as u64 - 1
        };
        tokio::time::sleep(std::time::Duration::from_millis(100 * (n % 8 + 1))).await;
        self.waiting.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A blob or a pack (or a pack's index): a tree's content, not a manifest.
fn is_content(key: &str) -> bool {
    key.starts_with(harness_moves::tree::BLOB_PREFIX)
        || key.starts_with(harness_moves::tree::PACK_PREFIX)
}

#[async_trait::async_trait]
impl CheckpointStore for Counting {
    async fn put(
        &self,
        key: &str,
        content: harness_core::stream::ByteStream,
    ) -> harness_core::Result<harness_core::checkpoint::ObjectMeta> {
        self.inner.put(key, content).await
    }
    async fn get(&self, key: &str) -> harness_core::Result<harness_core::stream::ByteStream> {
        if is_content(key) {
            self.gets.fetch_add(1, Ordering::SeqCst);
        }
        self.pace(key).await;
        self.inner.get(key).await
    }
    async fn get_range(
        &self,
        key: &str,
        range: std::ops::Range<u64>,
    ) -> harness_core::Result<Bytes> {
        if is_content(key) {
            self.ranged.fetch_add(1, Ordering::SeqCst);
        }
        self.inner.get_range(key, range).await
    }
    async fn head(&self, key: &str) -> harness_core::Result<harness_core::checkpoint::ObjectMeta> {
        if key.starts_with(harness_moves::tree::BLOB_PREFIX) {
            self.blob_heads.fetch_add(1, Ordering::SeqCst);
        }
        self.inner.head(key).await
    }
    async fn list(
        &self,
        prefix: &str,
    ) -> harness_core::Result<Vec<harness_core::checkpoint::ObjectMeta>> {
        self.inner.list(prefix).await
    }
    async fn delete(&self, key: &str) -> harness_core::Result<()> {
        self.inner.delete(key).await
    }
}

/// A progress that keeps what it was told.
#[derive(Debug, Default)]
struct Told {
    advanced: Mutex<BTreeMap<String, u64>>,
    finished: Mutex<Vec<String>>,
}

impl MoveProgress for Told {
    fn advance(&self, phase: MovePhase, bytes: u64) {
        *self
            .advanced
            .lock()
            .unwrap()
            .entry(format!("{phase:?}"))
            .or_default() += bytes;
    }
    fn finish(&self, phase: MovePhase) {
        self.finished.lock().unwrap().push(format!("{phase:?}"));
    }
}

async fn bytes_of(store: &dyn CheckpointStore, key: &str) -> Bytes {
    harness_core::stream::collect(store.get(key).await.unwrap(), 1 << 30)
        .await
        .unwrap()
}

async fn replace(store: &dyn CheckpointStore, key: &str, bytes: Vec<u8>) {
    store
        .put(key, harness_core::stream::once(Bytes::from(bytes)))
        .await
        .unwrap();
}

#[tokio::test]
async fn a_tree_restores_whole_into_an_empty_sandbox() {
    let pair = Pair::new().await;
    varied_tree(&pair.src_dir());
    let store = MemoryCheckpointStore::new();
    pair.checkpoint(&store, "t1", None).await;
    let manifest = read_manifest(&store, "t1").await.unwrap().unwrap();
    let files: Vec<_> = manifest
        .entries
        .iter()
        .filter(|e| e.kind == TreeKind::File)
        .collect();

    let told = Arc::new(Told::default());
    let info = restore_tree(
        &store,
        "t1",
        pair.dst.as_ref(),
        pair.dst.workdir(),
        Some(told.clone()),
    )
    .await
    .unwrap();
    assert_eq!(snapshot(&pair.dst_dir()), snapshot(&pair.src_dir()));
    let entries = manifest
        .entries
        .iter()
        .filter(|e| !e.path.is_empty())
        .count();
    assert_eq!(info.written, entries as u64, "every entry written");
    let file_bytes: u64 = files.iter().map(|e| e.size).sum();
    assert_eq!(info.bytes_written, file_bytes);
    assert_eq!(info.removed, 0);
    assert_eq!(info.streams, 1, "a few files go as one stream");
    // The stream's bytes as they were sent: the files' content, their
    // headers (two for a long name) and padding, and the two end blocks.
    let advanced = told.advanced.lock().unwrap().clone();
    let sent = advanced["Import"];
    assert!(
        sent >= file_bytes + 512 * entries as u64 + 1024,
        "{sent} bytes reported for {file_bytes} bytes in {entries} entries"
    );
    assert!(sent % 512 == 0, "tar is sent in whole blocks: {sent}");
    assert_eq!(*told.finished.lock().unwrap(), ["Import"]);
}

#[tokio::test]
async fn a_target_that_holds_the_tree_is_not_written_to() {
    let pair = Pair::new().await;
    varied_tree(&pair.src_dir());
    let store = Counting::new();
    pair.checkpoint(&store, "t1", None).await;
    pair.restore(&store, "t1").await.unwrap();
    let before = snapshot(&pair.dst_dir());

    let reads = store.reads();
    let again = pair.restore(&store, "t1").await.unwrap();
    assert_eq!((again.written, again.bytes_written), (0, 0));
    assert_eq!((again.streams, again.removed), (0, 0));
    // No content is read at all (the manifest may be: the process keeps a
    // few, shared by the tests running in it).
    assert_eq!(store.reads(), reads, "no content read for a tree in place");
    assert_eq!(snapshot(&pair.dst_dir()), before);

    // One file edited in the target, one removed: those two are written
    // back, nothing else.
    let dst = pair.dst_dir();
    std::fs::write(dst.join("README.md"), b"edited in the target\n").unwrap();
    std::fs::remove_file(dst.join("bin/run.sh")).unwrap();
    let mended = pair.restore(&store, "t1").await.unwrap();
    assert_eq!(mended.written, 2);
    let readme = b"# a tree\n".len() as u64;
    let script = b"#!/bin/sh\necho run\n".len() as u64;
    assert_eq!(mended.bytes_written, readme + script);
    assert_eq!(snapshot(&dst), snapshot(&pair.src_dir()));
}

#[tokio::test]
async fn the_paths_a_checkpoint_deleted_go_deepest_first_when_unchanged() {
    let pair = Pair::new().await;
    let src = pair.src_dir();
    write(&src, "keep.txt", b"kept\n", 0o644);
    write(&src, "old.txt", b"old\n", 0o644);
    write(&src, "edited-there.txt", b"as the parent had it\n", 0o644);
    write(&src, "gone/deeper/leaf.txt", b"leaf\n", 0o644);
    write(&src, "stays/file.txt", b"file\n", 0o644);
    let store = MemoryCheckpointStore::new();
    pair.checkpoint(&store, "t1", None).await;
    pair.restore(&store, "t1").await.unwrap();

    for rel in ["old.txt", "edited-there.txt", "stays/file.txt"] {
        std::fs::remove_file(src.join(rel)).unwrap();
    }
    std::fs::remove_dir_all(src.join("gone")).unwrap();
    std::fs::remove_dir(src.join("stays")).unwrap();
    pair.checkpoint(&store, "t2", Some("t1")).await;
    let manifest = read_manifest(&store, "t2").await.unwrap().unwrap();
    let deleted: Vec<&str> = manifest.deleted.iter().map(|e| e.path.as_str()).collect();
    assert_eq!(
        deleted,
        [
            "edited-there.txt",
            "gone",
            "gone/deeper",
            "gone/deeper/leaf.txt",
            "old.txt",
            "stays",
            "stays/file.txt"
        ]
    );

    // The target changed one of them since, and put a file of its own in
    // a directory the checkpoint deleted.
    let dst = pair.dst_dir();
    std::fs::write(dst.join("edited-there.txt"), b"the target's own\n").unwrap();
    write(&dst, "stays/mine.txt", b"the target's\n", 0o644);
    let info = pair.restore(&store, "t2").await.unwrap();
    assert_eq!(info.written, 0);
    // old.txt, gone/deeper/leaf.txt, gone/deeper, gone, stays/file.txt
    // and stays (asked, and kept: it is not empty).
    assert_eq!(info.removed, 6);
    let after = snapshot(&dst);
    let paths: Vec<&str> = after.keys().map(String::as_str).collect();
    assert_eq!(
        paths,
        ["edited-there.txt", "keep.txt", "stays", "stays/mine.txt"]
    );
    assert!(
        matches!(&after["edited-there.txt"], Node::File { content, .. } if content == b"the target's own\n")
    );
}

#[tokio::test]
async fn a_key_that_names_no_tree_is_refused() {
    let pair = Pair::new().await;
    let store = MemoryCheckpointStore::new();
    replace(&store, "an-archive", b"not a tree manifest".to_vec()).await;
    let err = pair.restore(&store, "an-archive").await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");

    let err = pair.restore(&store, "no-such-key").await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotFound, "{err}");

    let err = pair.restore(&store, "../escape").await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
    assert!(snapshot(&pair.dst_dir()).is_empty());
}

#[tokio::test]
async fn a_missing_blob_is_refused_before_anything_is_written() {
    let pair = Pair::new().await;
    let src = pair.src_dir();
    for i in 0..5 {
        write(
            &src,
            &format!("f{i}.txt"),
            format!("file {i}\n").as_bytes(),
            0o644,
        );
    }
    let store = MemoryCheckpointStore::new();
    pair.checkpoint(&store, "t1", None).await;
    let manifest = read_manifest(&store, "t1").await.unwrap().unwrap();
    assert!(manifest.packs.is_empty(), "a few files are stored as blobs");
    let last = manifest
        .entries
        .iter()
        .rev()
        .find(|e| e.kind == TreeKind::File)
        .unwrap();
    store.delete(&blob_key(&last.chunks[0])).await.unwrap();

    let err = pair.restore(&store, "t1").await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotFound, "{err}");
    assert!(err.message().contains("incomplete"), "{err}");
    assert!(err.message().contains(&blob_key(&last.chunks[0])), "{err}");
    assert!(snapshot(&pair.dst_dir()).is_empty(), "nothing written");
}

/// 600 small files of distinct content: packed, and past the count from
/// which a restore lists the store instead of asking per chunk.
fn many_small_files(root: &Path) {
    for i in 0..600 {
        let dir = if i % 2 == 0 { "even" } else { "odd" };
        write(
            root,
            &format!("{dir}/f{i:03}.txt"),
            format!("content of file {i}\n").as_bytes(),
            0o644,
        );
    }
    std::os::unix::fs::symlink("even/f000.txt", root.join("first")).unwrap();
}

#[tokio::test]
async fn a_pack_gone_or_not_as_indexed_is_refused_before_anything_is_written() {
    let pair = Pair::new().await;
    many_small_files(&pair.src_dir());
    let store = MemoryCheckpointStore::new();
    pair.checkpoint(&store, "t1", None).await;
    let manifest = read_manifest(&store, "t1").await.unwrap().unwrap();
    assert_eq!(manifest.packs.len(), 1, "{:?}", manifest.packs);
    let pack = pack_key(&manifest.packs[0]);
    let index = pack_index_key(&manifest.packs[0]);
    let pack_bytes = bytes_of(&store, &pack).await;
    let index_bytes = bytes_of(&store, &index).await;
    let refused = |why: &'static str, kind: ErrorKind, says: &'static str| {
        let pair = &pair;
        let store = &store;
        async move {
            // As a new process would: nothing of the pack kept from before.
            forget_kept();
            let err = pair.restore(store, "t1").await.unwrap_err();
            assert_eq!(err.kind(), kind, "{why}: {err}");
            assert!(err.message().contains(says), "{why}: {err}");
            assert!(
                snapshot(&pair.dst_dir()).is_empty(),
                "{why}: nothing written"
            );
        }
    };

    store.delete(&pack).await.unwrap();
    refused("the pack deleted", ErrorKind::NotFound, "incomplete").await;

    replace(&store, &pack, pack_bytes[..pack_bytes.len() / 2].to_vec()).await;
    refused(
        "the pack cut short",
        ErrorKind::Corrupt,
        "not the pack its index describes",
    )
    .await;

    let mut other = pack_bytes.to_vec();
    let at = other.len() / 2;
    other[at] ^= 0xff;
    replace(&store, &pack, other).await;
    refused(
        "the pack altered",
        ErrorKind::Corrupt,
        "not the pack its index describes",
    )
    .await;

    replace(&store, &pack, pack_bytes.to_vec()).await;
    // The pack whole, its index claiming a chunk past the pack's end (the
    // last entry's length, its last four bytes, made longer).
    let mut claim = index_bytes.to_vec();
    let at = claim.len() - 4;
    let len = u32::from_le_bytes(claim[at..].try_into().unwrap());
    claim[at..].copy_from_slice(&(len + 1_000_000).to_le_bytes());
    replace(&store, &index, claim).await;
    refused(
        "the index claiming more than the pack holds",
        ErrorKind::Corrupt,
        "not the pack its index describes",
    )
    .await;

    store.delete(&index).await.unwrap();
    refused(
        "the pack's index deleted",
        ErrorKind::NotFound,
        "incomplete",
    )
    .await;

    replace(&store, &index, index_bytes.to_vec()).await;
    forget_kept();
    let info = pair.restore(&store, "t1").await.unwrap();
    assert_eq!(info.written, 603, "600 files, 2 directories, 1 symlink");
    assert_eq!(snapshot(&pair.dst_dir()), snapshot(&pair.src_dir()));
}

#[tokio::test]
async fn a_chunk_that_fails_its_hash_fails_the_restore_and_removes_nothing() {
    let pair = Pair::new().await;
    let src = pair.src_dir();
    write(&src, "old.txt", b"old\n", 0o644);
    write(&src, "same.txt", b"same\n", 0o644);
    let store = MemoryCheckpointStore::new();
    pair.checkpoint(&store, "t1", None).await;
    pair.restore(&store, "t1").await.unwrap();

    std::fs::remove_file(src.join("old.txt")).unwrap();
    write(&src, "new.txt", b"new content\n", 0o644);
    pair.checkpoint(&store, "t2", Some("t1")).await;
    let manifest = read_manifest(&store, "t2").await.unwrap().unwrap();
    let new = manifest
        .entries
        .iter()
        .find(|e| e.path == "new.txt")
        .unwrap();
    // Another chunk's stored bytes under new.txt's key: a well-formed
    // chunk whose content hashes to something else.
    let same = manifest
        .entries
        .iter()
        .find(|e| e.path == "same.txt")
        .unwrap();
    let other = bytes_of(&store, &blob_key(&same.chunks[0])).await;
    replace(&store, &blob_key(&new.chunks[0]), other.to_vec()).await;

    let err = pair.restore(&store, "t2").await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");
    let dst = pair.dst_dir();
    assert!(dst.join("old.txt").exists(), "the deletion is not applied");
    assert_eq!(std::fs::read(dst.join("same.txt")).unwrap(), b"same\n");
}

#[tokio::test]
async fn many_files_go_as_parallel_streams_unless_a_directory_is_locked() {
    let pair = Pair::new().await;
    let src = pair.src_dir();
    many_small_files(&src);
    let store = MemoryCheckpointStore::new();
    pair.checkpoint(&store, "t1", None).await;
    let info = pair.restore(&store, "t1").await.unwrap();
    assert_eq!(snapshot(&pair.dst_dir()), snapshot(&src));
    // What a local sandbox takes at once: one per core, at most four parts.
    let ways = std::thread::available_parallelism().map_or(1, |n| n.get());
    let want = if ways < 2 { 1 } else { ways.min(4) as u64 + 2 };
    assert_eq!(
        info.streams, want,
        "the directories, {ways} part(s) of files, the symlinks"
    );

    // A directory its owner may not write: one stream, which unlocks it
    // until its end.
    std::fs::set_permissions(src.join("odd"), std::fs::Permissions::from_mode(0o555)).unwrap();
    pair.checkpoint(&store, "t2", Some("t1")).await;
    let other = Pair::new().await;
    let locked = other.restore(&store, "t2").await.unwrap();
    assert_eq!(locked.streams, 1);
    assert_eq!(snapshot(&other.dst_dir()), snapshot(&src));
    // (Writable again, so the temp dirs can be removed.)
    for dir in [src.join("odd"), other.dst_dir().join("odd")] {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
}

#[tokio::test]
async fn a_part_of_a_pack_is_read_in_one_range_across_the_chunks_it_skips() {
    let pair = Pair::new().await;
    let src = pair.src_dir();
    // 10 KiB files no compressor shrinks: packed, each chunk ~10 KiB.
    for i in 0..200u64 {
        write(&src, &format!("f{i:03}"), &noise(10 * 1024, i + 1), 0o644);
    }
    // Two files of one content: one chunk, which the read holds already
    // when the second comes.
    write(&src, "same-a", &noise(10 * 1024, 7777), 0o644);
    write(&src, "same-b", &noise(10 * 1024, 7777), 0o644);
    let store = Counting::new();
    pair.checkpoint(&store, "t1", None).await;
    let manifest = read_manifest(&store, "t1").await.unwrap().unwrap();
    assert_eq!(manifest.packs.len(), 1);
    let before = store.ranged();
    pair.restore(&store, "t1").await.unwrap();
    assert_eq!(
        store.ranged() - before,
        1,
        "one ranged read for the whole pack"
    );
    // The target loses every other file: the chunks to read lie 10 KiB
    // apart in the pack, well within the gap one read may span (64 KiB).
    let dst = pair.dst_dir();
    for i in (0..200).step_by(2) {
        std::fs::remove_file(dst.join(format!("f{i:03}"))).unwrap();
    }
    forget_kept();
    let before = store.ranged();
    let info = pair.restore(&store, "t1").await.unwrap();
    assert_eq!((info.written, info.streams), (100, 1));
    assert_eq!(store.ranged() - before, 1, "one ranged read for 100 chunks");
    assert_eq!(snapshot(&dst), snapshot(&src));

    // The first file and the last: ~2 MB apart in the pack, past the gap
    // one read spans, so two reads.
    std::fs::remove_file(dst.join("f000")).unwrap();
    std::fs::remove_file(dst.join("f199")).unwrap();
    forget_kept();
    let before = store.ranged();
    let info = pair.restore(&store, "t1").await.unwrap();
    assert_eq!(info.written, 2);
    assert_eq!(
        store.ranged() - before,
        2,
        "two chunks far apart, two reads"
    );
    assert_eq!(snapshot(&dst), snapshot(&src));
}

#[tokio::test]
async fn a_restore_keeps_its_byte_budget_of_chunks_in_flight_and_keeps_it_full() {
    let pair = Pair::new().await;
    let src = pair.src_dir();
    // Chunks of 4 MiB files, stored as blobs: each costs 4 MiB of the
    // restore's 32 MiB in flight, so 8 are fetched at once.
    for i in 0..4u64 {
        write(
            &src,
            &format!("big{i}"),
            &noise(4 * 1024 * 1024, 100 + i),
            0o644,
        );
    }
    let plain = Counting::new();
    pair.checkpoint(&plain, "t1", None).await;
    let manifest = read_manifest(&plain, "t1").await.unwrap().unwrap();
    assert!(manifest.packs.is_empty(), "large chunks are blobs");
    let chunks: usize = manifest.entries.iter().map(|e| e.chunks.len()).sum();
    assert!(chunks >= 10, "{chunks} chunks: more than the budget takes");
    // The same objects in a store that paces its blob reads.
    let store = Counting::paced();
    for key in plain.inner.list_keys("").await.unwrap() {
        replace(&store, &key, bytes_of(&plain, &key).await.to_vec()).await;
    }
    forget_kept();
    pair.restore(&store, "t1").await.unwrap();
    assert_eq!(snapshot(&pair.dst_dir()), snapshot(&src));
    let at_start = store.at_start.lock().unwrap().clone();
    assert_eq!(at_start.len(), chunks, "one read per chunk");
    assert_eq!(
        at_start.iter().max(),
        Some(&8),
        "at most 32 MiB in flight, and that much: {at_start:?}"
    );
    // The first read to end (the shortest wait) frees its share at once:
    // the ninth starts while the seven others still wait.
    assert_eq!(at_start[8], 8, "{at_start:?}");
}

#[tokio::test]
async fn chunks_in_two_packs_are_each_read_from_their_own() {
    let pair = Pair::new().await;
    let src = pair.src_dir();
    for i in 0..100u64 {
        write(&src, &format!("a{i:03}"), &noise(10 * 1024, i + 1), 0o644);
    }
    let store = Counting::new();
    pair.checkpoint(&store, "t1", None).await;
    // As many new files again: the second run packs them in a pack of its
    // own, and the tree's chunks lie at the same offsets of two packs.
    for i in 0..100u64 {
        write(
            &src,
            &format!("b{i:03}"),
            &noise(10 * 1024, 1000 + i),
            0o644,
        );
    }
    pair.checkpoint(&store, "t2", Some("t1")).await;
    let manifest = read_manifest(&store, "t2").await.unwrap().unwrap();
    assert_eq!(manifest.packs.len(), 2, "{:?}", manifest.packs);
    forget_kept();
    let before = store.ranged();
    let info = pair.restore(&store, "t2").await.unwrap();
    assert_eq!(info.written, 200);
    assert_eq!(store.ranged() - before, 2, "one ranged read per pack");
    assert_eq!(snapshot(&pair.dst_dir()), snapshot(&src));
}

#[tokio::test]
async fn many_blobs_are_found_with_a_listing_not_a_head_each() {
    let pair = Pair::new().await;
    let src = pair.src_dir();
    let store = Counting::new();
    // Five runs of 60 new small files each: too few per run to pack, so
    // 300 blobs, more than a restore asks about one by one (256).
    let mut parent: Option<String> = None;
    for run in 0..5u64 {
        for i in 0..60u64 {
            let n = run * 60 + i;
            write(
                &src,
                &format!("r{run}/f{i:02}"),
                format!("file {n}\n").as_bytes(),
                0o644,
            );
        }
        let key = format!("t{run}");
        pair.checkpoint(&store, &key, parent.as_deref()).await;
        parent = Some(key);
    }
    let manifest = read_manifest(&store, "t4").await.unwrap().unwrap();
    assert!(manifest.packs.is_empty(), "{:?}", manifest.packs);
    forget_kept();
    let before = store.blob_heads.load(Ordering::SeqCst);
    let info = pair.restore(&store, "t4").await.unwrap();
    assert_eq!(info.written, 305, "300 files in 5 directories");
    assert_eq!(
        store.blob_heads.load(Ordering::SeqCst) - before,
        0,
        "the blobs are listed, not asked for one by one"
    );
    assert_eq!(snapshot(&pair.dst_dir()), snapshot(&src));
}
