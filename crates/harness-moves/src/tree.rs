//! Incremental, content-addressed checkpoints of a working tree.
//!
//! A whole-archive checkpoint ([`crate::archive::checkpoint`]) stores the tree
//! as one zstd tar: a one-file change costs a full upload. A *tree
//! checkpoint* stores a [`TreeManifest`] at the checkpoint's key (paths,
//! kinds, modes, sizes, mtimes, and for each file the hashes of its content
//! chunks) and the content as blobs addressed by their SHA-256 under
//! `blobs/` of the same store, each stored once per store whichever tree
//! and checkpoint it came from:
//!
//! ```text
//! <key>                         zstd JSON manifest  {"format":"harness-tree/1",…}
//!                               (zstd frames of runs of entries: a re-checkpoint
//!                               copies the frames whose entries did not change)
//! blobs/<h[0..2]>/<h>           zstd of one content chunk whose SHA-256 is h
//! packs/<p[0..2]>/<p>           many small files' chunks, zstd frames end to end
//! packs/<p[0..2]>/<p>.idx       where each lies in the pack (p: the pack's SHA-256)
//! locks/<kind>-<ms>-<nonce>     a running checkpoint or garbage collection
//! ```
//!
//! Files are cut into content-defined chunks (FastCDC, 512 KiB–4 MiB, 1 MiB
//! on average), so an edit inside a large file re-stores the chunks around
//! it, not the file; a file under 512 KiB is one chunk. A run that stores
//! 64 or more such small files' chunks writes them into packs of ~8 MiB
//! (see `packs`); the manifest names the packs its chunks may be in.
//!
//! **Checkpoint with a parent** (the previous checkpoint of the same tree):
//! the tree is listed (kind, mode, size, mtime, inode, ctime, path, link:
//! by the provider itself where it can, [`Sandbox::list_tree`], else with
//! `find -printf` inside the sandbox) while the parent's manifest is read; a
//! file whose whole stat — size, mtime, mode, inode and ctime — equals the
//! one the parent recorded keeps the parent's chunks without being read,
//! unless its mtime is not older than the second the parent's listing ran
//! (a file changed twice within that second could keep its size and mtime:
//! such "racy" entries are always read again, as git does). The ctime is
//! what no tool can set back (`touch -d`, `cp -p` and `tar x` move it), so
//! a file rewritten with its old size and mtime is read too. Only the
//! other files leave the sandbox, as one tar stream
//! ([`Sandbox::export_paths_tar`]: built in-process by the local sandbox,
//! `tar --no-recursion -T -` inside the others); only chunks the store
//! lacks are uploaded. Without a parent the tree is
//! listed too (the stats recorded for the next checkpoint are taken before
//! the read, so a file changing during it is read again next time) and
//! read whole through `export_tar`, hashed on the way; where the sandbox
//! has no GNU `find` and `tar`, it is read whole every time. Paths of the
//! parent that are gone are recorded as `deleted`. A tree restored from a
//! checkpoint has new inodes and ctimes: its first re-checkpoint reads
//! every file (uploading only what the store lacks).
//!
//! **Restore** checks every manifest entry by the [`TarScanner`] rules
//! (nothing unsafe is written, and nothing at all if any entry is refused)
//! and that every chunk it needs is in the store, before touching the
//! target. It then lists the target: an entry already there with the same
//! kind, size, mtime and mode (or link text) is not written, so restoring a
//! checkpoint onto the state of its parent writes only what changed. What
//! is written goes to `import_tar` as a tar built from the blobs (each
//! chunk's hash checked before its bytes are passed on). Files only in the
//! target stay, as with whole archives; a path the manifest records as
//! deleted is removed only where the target still holds exactly the
//! parent's version of it (a file the user made there is never removed).
//!
//! **Garbage collection** ([`collect_garbage`]) deletes blobs no manifest
//! in the store references, and packs no manifest names. A checkpoint may reuse a blob it found in the
//! store without uploading it, so collection and checkpoints exclude each
//! other through lock objects: each side writes its own lock, then lists
//! the other side's; if one is there (and younger than [`LOCK_TTL_MS`], a
//! crashed holder's lock expires), it removes its own and fails with
//! `Conflict`. Both may fail; both cannot proceed.
//!
//! Whole-archive checkpoints still restore: [`crate::archive::restore`] reads
//! the first bytes of the object and takes the manifest path only for a
//! manifest.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use futures::stream::FuturesUnordered;
use futures::{SinkExt, StreamExt};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::archive::{compress, decompress, MovePhase, MoveProgress, DEFAULT_ZSTD_LEVEL};
use harness_core::checkpoint::{validate_key, CheckpointStore, ObjectMeta};
use harness_core::clock::Clock;
use harness_core::sandbox::{collect_exec, shell_quote, ExecRequest, ListedEntry, Sandbox};
use harness_core::stream::ByteStream;
use harness_core::tarscan::{ScanSummary, TarEntry, TarItem, TarKind, TarScanner};
use harness_core::{Error, ErrorKind, Result};

mod packs;
pub use packs::{index_key as pack_index_key, pack_key};
use packs::{
    PackIndex, PackWriter, PACK_MIN_BYTES, PACK_MIN_CHUNKS, PACK_READ_MAX, PACK_TARGET_BYTES,
};

/// The manifest's `format`, and the prefix a manifest object starts with.
pub const FORMAT: &str = "harness-tree/1";
/// Where blobs live in a store.
pub const BLOB_PREFIX: &str = "blobs/";
/// Where checkpoint and garbage-collection locks live in a store.
pub const LOCK_PREFIX: &str = "locks/";
/// Where packs (many small files' chunks in one object) and their indexes
/// live in a store.
pub const PACK_PREFIX: &str = "packs/";
/// A lock older than this is a crashed holder's and is ignored.
pub const LOCK_TTL_MS: u64 = 60 * 60 * 1000;

/// Smallest content-defined chunk (and the size under which a file is one).
pub const MIN_CHUNK: usize = 512 * 1024;
/// Average content-defined chunk.
pub const AVG_CHUNK: usize = 1024 * 1024;
/// Largest content-defined chunk.
pub const MAX_CHUNK: usize = 4 * 1024 * 1024;

/// Bytes of chunks being uploaded or fetched at once: what bounds a move's
/// memory (a few tens of MiB whatever the tree), while many small files
/// are in flight together (a store round trip each).
const IN_FLIGHT_BYTES: u64 = 32 * 1024 * 1024;
/// Requests in flight at once, whatever their size.
const IN_FLIGHT: usize = 64;
/// Largest manifest accepted on read (uncompressed): ~100 bytes per entry,
/// so far above the scanner's 500,000-entry default.
const MAX_MANIFEST_BYTES: usize = 256 * 1024 * 1024;
/// zstd level of manifests: written on every checkpoint, so speed over
/// size (level 1 takes half the time of level 3 on a 20,000-entry
/// manifest, for a fifth more bytes: still well under 1% of the tree).
const MANIFEST_ZSTD_LEVEL: i32 = 1;
/// The sandbox has no GNU `find`/`tar` (listing falls back to reading all).
const EXIT_NO_GNU_TOOLS: i32 = 45;
/// The listed directory does not exist.
const EXIT_NO_DIR: i32 = 44;

/// A tree checkpoint: what [`checkpoint_tree`] stores at the key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TreeManifest {
    /// Always [`FORMAT`]; first, so the object's first bytes identify it.
    pub format: String,
    /// The checkpoint this one was made against, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
    /// The sandbox's clock (seconds) when the tree was listed: entries with
    /// an mtime at or after it are re-read by the next checkpoint.
    pub listed_at: u64,
    /// Every entry of the tree, sorted by path.
    pub entries: Vec<TreeEntry>,
    /// The parent's entries whose paths are gone, as the parent had them
    /// (without their chunks).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub deleted: Vec<TreeEntry>,
    /// The packs (their ids: the SHA-256 of each pack object) that may
    /// hold this manifest's chunks: a chunk is a blob of its own, or in
    /// one of these ([`PACK_PREFIX`]). Garbage collection keeps them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub packs: Vec<String>,
}

/// The kind of a [`TreeEntry`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TreeKind {
    /// A regular file (hard links are stored as files of the same content).
    File,
    /// A directory.
    Dir,
    /// A symbolic link.
    Symlink,
}

/// One path of a [`TreeManifest`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TreeEntry {
    /// Relative, normalized path.
    pub path: String,
    /// File, directory or symlink.
    pub kind: TreeKind,
    /// Permission bits.
    pub mode: u32,
    /// Content bytes (files).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub size: u64,
    /// Modification time, seconds since the epoch.
    #[serde(default)]
    pub mtime: u64,
    /// SHA-256 of each content chunk, in order (files).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub chunks: Vec<String>,
    /// The link text (symlinks).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
    /// The file's inode number when the checkpoint listed it (0: not
    /// known). With `ctime_ns`, part of the stat a re-checkpoint compares.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub ino: u64,
    /// The file's status-change time (nanoseconds since the epoch) when
    /// the checkpoint listed it (0: not known). No tool can set it back:
    /// any write, `chmod` or `touch` moves it.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub ctime_ns: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl TreeEntry {
    /// The archive kind (a symlink's target copied; nothing else is).
    fn tar_kind(&self) -> TarKind {
        match self.kind {
            TreeKind::File => TarKind::File,
            TreeKind::Dir => TarKind::Dir,
            TreeKind::Symlink => TarKind::Symlink {
                target: self.target.clone().unwrap_or_default(),
            },
        }
    }

    /// Whether a re-checkpoint may keep this file's chunks without reading
    /// it: its whole stat as listed now — size, mtime, mode, inode and
    /// ctime — is the one recorded when the parent listed it, and the
    /// parent's listing ran in a later second than the mtime (else the
    /// file is "racy": written again within that second, it could keep
    /// its size and mtime). An entry with no recorded inode or ctime is
    /// always read.
    fn unchanged_since(&self, listed: &ListedEntry, parent_listed_at: u64) -> bool {
        self.kind == TreeKind::File
            && self.same_as(listed)
            && self.ino != 0
            && self.ctime_ns != 0
            && listed.ino == self.ino
            && listed.ctime_ns == self.ctime_ns
            && self.mtime < parent_listed_at
    }

    /// Record `listed`'s inode and ctime, if it is this file as read (a
    /// file changed between the listing and the read keeps none, so the
    /// next checkpoint reads it again).
    fn stamp_from(&mut self, listed: Option<&ListedEntry>) {
        if let Some(l) = listed.filter(|l| self.kind == TreeKind::File && self.same_as(l)) {
            self.ino = l.ino;
            self.ctime_ns = l.ctime_ns;
        }
    }

    /// Whether `listed` (from a sandbox listing) is this entry as stored.
    fn same_as(&self, listed: &ListedEntry) -> bool {
        match self.kind {
            TreeKind::File => {
                listed.kind == 'f'
                    && listed.size == self.size
                    && listed.mtime == self.mtime
                    && listed.mode == self.mode
            }
            TreeKind::Dir => listed.kind == 'd' && listed.mode == self.mode,
            TreeKind::Symlink => {
                listed.kind == 'l' && Some(listed.link.as_str()) == self.target.as_deref()
            }
        }
    }
}

/// Forget the manifests and pack indexes this process keeps, as a new
/// process would start: for tests and benchmarks of what a restore in
/// another process reads.
#[doc(hidden)]
pub fn forget_kept() {
    known::clear();
    packs::forget_kept();
}

/// Forget the pack indexes alone ([`forget_kept`]): a benchmark's restore
/// reads them as another process would, while the manifest its next
/// checkpoint builds on stays kept.
#[doc(hidden)]
pub fn forget_kept_pack_indexes() {
    packs::forget_kept();
}

/// The key a blob of hash `hash` is stored under.
pub fn blob_key(hash: &str) -> String {
    format!("{BLOB_PREFIX}{}/{hash}", &hash[..2])
}

/// What [`checkpoint_tree`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TreeCheckpointInfo {
    /// The stored manifest object.
    pub object: ObjectMeta,
    /// Entries in the manifest.
    pub entries: u64,
    /// Bytes of content in the tree.
    pub tree_bytes: u64,
    /// Files read out of the sandbox (the rest kept the parent's chunks).
    pub files_read: u64,
    /// Bytes of file content read out of the sandbox.
    pub bytes_read: u64,
    /// Chunks uploaded (the rest were in the store already).
    pub chunks_uploaded: u64,
    /// Bytes uploaded: compressed chunks plus the compressed manifest.
    pub bytes_uploaded: u64,
    /// Paths of the parent that are gone.
    pub deleted: u64,
}

/// What [`restore_tree`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TreeRestoreInfo {
    /// The manifest as the scanner admitted it.
    pub summary: ScanSummary,
    /// Entries written (the rest were in the target already).
    pub written: u64,
    /// Bytes of file content written.
    pub bytes_written: u64,
    /// Paths removed because the checkpoint deleted them.
    pub removed: u64,
}

/// Read the object under `key`: `Some` manifest if it is a tree
/// checkpoint, `None` if it is a whole-archive one.
pub async fn read_manifest(store: &dyn CheckpointStore, key: &str) -> Result<Option<TreeManifest>> {
    Ok(read_manifest_hashed(store, key).await?.0)
}

/// [`read_manifest`], with the SHA-256 of the stored object's bytes as
/// read (what the store checked them against).
async fn read_manifest_hashed(
    store: &dyn CheckpointStore,
    key: &str,
) -> Result<(Option<TreeManifest>, String)> {
    let hasher = Arc::new(std::sync::Mutex::new(Sha256::new()));
    let hashing = hasher.clone();
    let stored = store.get(key).await?.map(move |chunk| {
        if let Ok(bytes) = &chunk {
            hashing
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .update(bytes);
        }
        chunk
    });
    let manifest = parse_manifest(key, decompress(Box::pin(stored))).await?;
    let sha = hex::encode(
        std::mem::take(&mut *hasher.lock().unwrap_or_else(|e| e.into_inner())).finalize(),
    );
    Ok((manifest, sha))
}

async fn parse_manifest(key: &str, mut body: ByteStream) -> Result<Option<TreeManifest>> {
    let mut text = BytesMut::new();
    let prefix = format!("{{\"format\":\"{FORMAT}\"");
    while let Some(chunk) = body.next().await {
        let chunk = match chunk {
            Ok(c) => c,
            // Not zstd at all, or a tar that is not a manifest, is not
            // ours to judge here: the archive path reports it.
            Err(e) if text.len() < prefix.len() && e.kind() != ErrorKind::NotFound => {
                return Ok(None)
            }
            Err(e) => return Err(e),
        };
        text.extend_from_slice(&chunk);
        if text.len() >= prefix.len() && !text.starts_with(prefix.as_bytes()) {
            return Ok(None);
        }
        if text.len() > MAX_MANIFEST_BYTES {
            return Err(Error::invalid(format!(
                "manifest {key} is larger than {MAX_MANIFEST_BYTES} bytes"
            )));
        }
    }
    if !text.starts_with(prefix.as_bytes()) {
        return Ok(None);
    }
    let manifest: TreeManifest = serde_json::from_slice(&text)
        .map_err(|e| Error::corrupt(format!("manifest {key} does not parse: {e}")))?;
    Ok(Some(manifest))
}

/// A manifest as read or written by this process, with what is derived
/// from it once: its admission by the restore rules and the set of its
/// chunk hashes.
#[derive(Debug)]
struct KnownManifest {
    manifest: TreeManifest,
    admitted: std::sync::OnceLock<ScanSummary>,
    chunks: std::sync::OnceLock<HashSet<[u8; 32]>>,
    /// The compressed frames of its entries, when this process wrote it
    /// (empty when it was read): what the next checkpoint against it
    /// reuses for the entries that did not change.
    frames: Vec<EntryFrame>,
}

/// One zstd frame of a written manifest's `entries`: the JSON of entries
/// `first..first + len`, each after a comma but the manifest's first.
#[derive(Debug, Clone)]
struct EntryFrame {
    first: usize,
    len: usize,
    bytes: Bytes,
}

impl KnownManifest {
    fn new(manifest: TreeManifest) -> Self {
        Self::with_frames(manifest, Vec::new())
    }

    fn with_frames(manifest: TreeManifest, frames: Vec<EntryFrame>) -> Self {
        Self {
            manifest,
            admitted: std::sync::OnceLock::new(),
            chunks: std::sync::OnceLock::new(),
            frames,
        }
    }

    /// The frame that starts at entry `first`, if this manifest has one.
    fn frame_at(&self, first: usize) -> Option<&EntryFrame> {
        let at = self.frames.binary_search_by_key(&first, |f| f.first).ok()?;
        self.frames.get(at)
    }

    /// [`admit`], once.
    fn admitted(&self) -> Result<ScanSummary> {
        if let Some(summary) = self.admitted.get() {
            return Ok(*summary);
        }
        let summary = admit(&self.manifest)?;
        Ok(*self.admitted.get_or_init(|| summary))
    }

    /// Whether one of the manifest's files has the chunk `hash` (hex).
    fn has_chunk(&self, hash: &str) -> bool {
        let chunks = self.chunks.get_or_init(|| {
            self.manifest
                .entries
                .iter()
                .flat_map(|e| e.chunks.iter())
                .filter_map(|h| chunk_bytes(h))
                .collect()
        });
        chunk_bytes(hash).is_some_and(|h| chunks.contains(&h))
    }
}

fn chunk_bytes(hex_hash: &str) -> Option<[u8; 32]> {
    let mut out = [0u8; 32];
    hex::decode_to_slice(hex_hash, &mut out).ok()?;
    Some(out)
}

/// Manifests this process read or wrote, by the SHA-256 of their stored
/// object: a re-checkpoint against its parent, and the restore of a
/// checkpoint onto the state of its parent, skip fetching, parsing and
/// admitting the 20,000-entry manifest they used a moment ago (the bulk
/// of their time, `docs/tree-checkpoints.md`). A manifest object is
/// looked up by the hash its store reports (`head`), so a key that now
/// holds another object is read again; what is cached was parsed from
/// bytes whose hash is that key, or is what was written under it. Bounded
/// by [`CACHED_MANIFESTS`] manifests and [`CACHED_ENTRIES`] entries in
/// all, the least recently used going first.
mod known {
    use std::collections::VecDeque;
    use std::sync::{Arc, Mutex, OnceLock};

    use super::KnownManifest;

    /// Manifests kept at most.
    pub(super) const CACHED_MANIFESTS: usize = 4;
    /// Entries kept at most, over all kept manifests (~200 bytes each).
    pub(super) const CACHED_ENTRIES: usize = 250_000;

    type Kept = VecDeque<(String, Arc<KnownManifest>)>;

    fn kept() -> &'static Mutex<Kept> {
        static KEPT: OnceLock<Mutex<Kept>> = OnceLock::new();
        KEPT.get_or_init(|| Mutex::new(VecDeque::new()))
    }

    fn valid(sha: &str) -> bool {
        super::is_sha256_hex(sha)
    }

    /// The manifest stored as the object whose SHA-256 is `sha`, if kept.
    pub(super) fn get(sha: &str) -> Option<Arc<KnownManifest>> {
        if !valid(sha) {
            return None;
        }
        let mut kept = kept().lock().unwrap_or_else(|e| e.into_inner());
        let at = kept.iter().position(|(s, _)| s == sha)?;
        let hit = kept.remove(at)?;
        let manifest = hit.1.clone();
        kept.push_front(hit);
        Some(manifest)
    }

    /// `manifest` for the caller alone, taken out of the kept ones, when
    /// no one else holds it (a restore or checkpoint using it now); else
    /// it stays kept and comes back as `Err`.
    pub(super) fn take_sole(
        manifest: Arc<KnownManifest>,
    ) -> Result<KnownManifest, Arc<KnownManifest>> {
        let mut kept = kept().lock().unwrap_or_else(|e| e.into_inner());
        // Under the lock nobody can take another handle from the cache:
        // the cache's and the caller's are all there are, or not.
        let at = kept.iter().position(|(_, m)| Arc::ptr_eq(m, &manifest));
        let handles = 1 + usize::from(at.is_some());
        if Arc::strong_count(&manifest) != handles {
            return Err(manifest);
        }
        if let Some(at) = at {
            kept.remove(at);
        }
        drop(kept);
        Arc::try_unwrap(manifest)
    }

    /// Keep nothing.
    pub(super) fn clear() {
        kept().lock().unwrap_or_else(|e| e.into_inner()).clear();
    }

    /// Keep `manifest` as the object whose SHA-256 is `sha`.
    pub(super) fn put(sha: &str, manifest: Arc<KnownManifest>) {
        let size = manifest.manifest.entries.len() + manifest.manifest.deleted.len();
        if !valid(sha) || size > CACHED_ENTRIES {
            return;
        }
        let mut kept = kept().lock().unwrap_or_else(|e| e.into_inner());
        kept.retain(|(s, _)| s != sha);
        kept.push_front((sha.to_string(), manifest));
        let entries = |k: &Kept| {
            k.iter()
                .map(|(_, m)| m.manifest.entries.len() + m.manifest.deleted.len())
                .sum::<usize>()
        };
        while kept.len() > CACHED_MANIFESTS || entries(&kept) > CACHED_ENTRIES {
            kept.pop_back();
        }
    }
}

/// The tree manifest under `key`: the kept one when the store's object is
/// one this process read or wrote, else fetched, parsed and kept. `None`
/// for a whole-archive checkpoint.
async fn load_manifest(
    store: &dyn CheckpointStore,
    key: &str,
) -> Result<Option<Arc<KnownManifest>>> {
    let meta = store.head(key).await?;
    if let Some(hit) = known::get(&meta.sha256) {
        return Ok(Some(hit));
    }
    let (manifest, sha) = read_manifest_hashed(store, key).await?;
    Ok(manifest.map(|manifest| {
        let manifest = Arc::new(KnownManifest::new(manifest));
        known::put(&sha, manifest.clone());
        manifest
    }))
}

/// Checkpoint `dir` of `sandbox` into `store` under `key` as a tree
/// checkpoint, against `parent` (the key of an earlier tree checkpoint of
/// the same tree) when given. See the module docs.
#[tracing::instrument(name = "checkpoint_tree", skip_all, fields(key = %key, dir = %dir))]
pub async fn checkpoint_tree(
    sandbox: &dyn Sandbox,
    dir: &str,
    store: &dyn CheckpointStore,
    key: &str,
    parent: Option<&str>,
    clock: &dyn Clock,
    progress: Option<Arc<dyn MoveProgress>>,
) -> Result<TreeCheckpointInfo> {
    validate_key(key)?;
    if [BLOB_PREFIX, LOCK_PREFIX, PACK_PREFIX]
        .iter()
        .any(|p| key.starts_with(p))
    {
        return Err(Error::invalid(format!(
            "checkpoint key {key:?} is inside {BLOB_PREFIX}, {PACK_PREFIX} or {LOCK_PREFIX}, which tree checkpoints keep for themselves"
        )));
    }
    // The lock is taken while the tree is listed and the parent's manifest
    // read: neither decides anything about the store's blobs (the parent
    // references its own, which garbage collection keeps), and nothing
    // that does runs before the lock is held. A lock refused discards both.
    let (lock, prepared) = futures::join!(
        Lock::take(store, LockKind::Checkpoint, clock),
        list_with_parent(sandbox, dir, store, parent)
    );
    let lock = lock?;
    let result = match prepared {
        Ok((listing, parent_manifest)) => {
            checkpoint_locked(
                sandbox,
                dir,
                store,
                key,
                parent,
                listing,
                parent_manifest,
                progress,
            )
            .await
        }
        Err(e) => Err(e),
    };
    lock.release(store).await;
    result
}

/// The tree's listing and the parent's manifest, side by side.
async fn list_with_parent(
    sandbox: &dyn Sandbox,
    dir: &str,
    store: &dyn CheckpointStore,
    parent_key: Option<&str>,
) -> Result<(Listing, Option<Arc<KnownManifest>>)> {
    // The sandbox lists the tree while the parent's manifest is fetched
    // and parsed (or found kept): the listing waits on the sandbox, the
    // parse on the CPU. The listing is polled first, so it has started
    // before a parse that never yields holds the task.
    let read_parent = async {
        match parent_key {
            Some(p) => Some(load_manifest(store, p).await?.ok_or_else(|| {
                Error::invalid(format!(
                    "parent {p} is a whole-archive checkpoint; make a tree checkpoint without a parent first"
                ))
            }))
            .transpose(),
            None => Ok(None),
        }
    };
    // Listed without a parent too: the stats it records (taken before the
    // read) are what the next checkpoint compares.
    let (listing, parent) = futures::join!(list_tree(sandbox, dir), read_parent);
    Ok((listing?, parent?))
}

#[allow(clippy::too_many_arguments)]
async fn checkpoint_locked(
    sandbox: &dyn Sandbox,
    dir: &str,
    store: &dyn CheckpointStore,
    key: &str,
    parent_key: Option<&str>,
    listing: Listing,
    parent: Option<Arc<KnownManifest>>,
    progress: Option<Arc<dyn MoveProgress>>,
) -> Result<TreeCheckpointInfo> {
    let mut uploader = Uploader::new(store);
    let mut stats = TreeCheckpointInfo {
        object: ObjectMeta {
            key: key.to_string(),
            size: 0,
            sha256: String::new(),
        },
        entries: 0,
        tree_bytes: 0,
        files_read: 0,
        bytes_read: 0,
        chunks_uploaded: 0,
        bytes_uploaded: 0,
        deleted: 0,
    };
    // The parent's entries (sorted by path), each marked when the listing
    // finds its path: what is unmarked at the end is gone (`deleted`).
    let mut found = vec![false; parent.as_deref().map_or(0, |p| p.manifest.entries.len())];
    let has_parent = parent_key.is_some();
    let mut parent = parent.map(ParentManifest::Shared);
    // Entries sorted by path, and for each its index among the parent's
    // entries when it is that entry unchanged (`NEW_ENTRY` otherwise).
    let (listed_at, entries, origins) = match listing {
        Listing::Missing => return Err(Error::not_found(format!("no such directory: {dir}"))),
        Listing::Listed { now, entries } if !has_parent => {
            let read = read_whole_tree(
                sandbox,
                dir,
                &entries,
                &mut uploader,
                &mut stats,
                progress.as_deref(),
            )
            .await?;
            let origins = vec![NEW_ENTRY; read.len()];
            (now, read, origins)
        }
        Listing::Listed { now, entries } => {
            let (read, origins) = read_against_parent(
                sandbox,
                dir,
                entries,
                &mut parent,
                &mut found,
                &mut uploader,
                &mut stats,
                progress.as_deref(),
            )
            .await?;
            (now, read, origins)
        }
        Listing::Unsupported => {
            let now = sandbox_now(sandbox).await?;
            let read = read_whole_tree(
                sandbox,
                dir,
                &[],
                &mut uploader,
                &mut stats,
                progress.as_deref(),
            )
            .await?;
            let origins = vec![NEW_ENTRY; read.len()];
            (now, read, origins)
        }
    };
    uploader.finish().await?;
    if let Some(p) = &progress {
        p.finish(MovePhase::Export);
    }
    // Moved-out entries were all found: what is gone is intact.
    let parent_ref: Option<&KnownManifest> = parent.as_ref().map(ParentManifest::get);
    let old_entries: &[TreeEntry] = parent_ref.map_or(&[], |p| p.manifest.entries.as_slice());
    let deleted = if has_parent {
        deleted_since(old_entries, &found, &entries)
    } else {
        Vec::new()
    };
    stats.entries = entries.len() as u64;
    stats.tree_bytes = entries.iter().map(|e| e.size).sum();
    stats.deleted = deleted.len() as u64;
    stats.chunks_uploaded = uploader.uploaded;
    stats.bytes_uploaded = uploader.uploaded_bytes.load(Ordering::Relaxed);
    // The parent's packs hold its chunks, which unchanged entries keep
    // (and a chunk it had is not stored again); this run's packs and those
    // it found chunks in hold the rest.
    let mut packs = std::mem::take(&mut uploader.packs);
    packs.extend(
        parent_ref
            .iter()
            .flat_map(|p| p.manifest.packs.iter().cloned()),
    );
    let manifest = TreeManifest {
        format: FORMAT.to_string(),
        parent: parent_key.map(str::to_string),
        listed_at,
        entries,
        deleted,
        packs: packs.into_iter().collect(),
    };
    let (object, packed_len) = store_manifest(store, key, manifest, &origins, parent_ref).await?;
    stats.bytes_uploaded += packed_len;
    stats.object = object;
    Ok(stats)
}

/// The whole tree read out of the sandbox as one tar, sorted by path,
/// each file stamped with the inode and ctime `listed` gives it (none when
/// the listing is empty: the tree could not be listed).
async fn read_whole_tree(
    sandbox: &dyn Sandbox,
    dir: &str,
    listed: &[ListedEntry],
    uploader: &mut Uploader<'_>,
    stats: &mut TreeCheckpointInfo,
    progress: Option<&dyn MoveProgress>,
) -> Result<Vec<TreeEntry>> {
    let tar = sandbox.export_tar(dir).await?;
    let mut read = read_tar(tar, uploader, stats, progress).await?;
    let listed: HashMap<&str, &ListedEntry> = listed.iter().map(|l| (l.path.as_str(), l)).collect();
    for entry in &mut read {
        entry.stamp_from(listed.get(entry.path.as_str()).copied());
    }
    read.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(read)
}

/// A re-checkpoint's entries in path order, and for each the index of the
/// parent's entry it is unchanged ([`NEW_ENTRY`] if none): the listing is
/// paired with the parent's entries, and only the files whose stat
/// changed are read out of the sandbox.
#[allow(clippy::too_many_arguments)]
async fn read_against_parent(
    sandbox: &dyn Sandbox,
    dir: &str,
    listed: Vec<ListedEntry>,
    parent: &mut Option<ParentManifest>,
    found: &mut [bool],
    uploader: &mut Uploader<'_>,
    stats: &mut TreeCheckpointInfo,
    progress: Option<&dyn MoveProgress>,
) -> Result<(Vec<TreeEntry>, Vec<u32>)> {
    let plan = Plan::pair(
        dir,
        listed,
        parent.as_ref().map(ParentManifest::get),
        found,
        &mut uploader.parent_at_paths,
    )?;
    // Many files to read (a tree just restored, with new inodes): the
    // parent's chunk set spares a store request per chunk it holds. A
    // few: asking the store is cheaper than the set, and the parent's
    // unchanged entries are better moved than copied.
    if plan.changed.len() >= PARENT_CHUNK_SET_FILES {
        if let Some(ParentManifest::Shared(p)) = parent {
            uploader.parent = Some(p.clone());
        }
    } else {
        *parent = parent.take().map(ParentManifest::into_sole);
    }
    let read = read_changed(sandbox, dir, &plan.changed, uploader, stats, progress).await?;
    Ok(plan.assemble(read, parent, found))
}

/// A parent's manifest as a re-checkpoint holds it.
enum ParentManifest {
    /// Held elsewhere too (kept, or used by a restore): its unchanged
    /// entries are copied into the new manifest.
    Shared(Arc<KnownManifest>),
    /// This checkpoint's alone: its unchanged entries move into the new
    /// manifest (copying 20,000 paths and hashes took most of a
    /// re-checkpoint).
    Sole(Box<KnownManifest>),
}

impl ParentManifest {
    fn get(&self) -> &KnownManifest {
        match self {
            ParentManifest::Shared(p) => p,
            ParentManifest::Sole(p) => p,
        }
    }

    /// The manifest taken out of the kept ones when nothing else holds it.
    fn into_sole(self) -> Self {
        match self {
            ParentManifest::Shared(p) => match known::take_sole(p) {
                Ok(sole) => ParentManifest::Sole(Box::new(sole)),
                Err(shared) => ParentManifest::Shared(shared),
            },
            sole => sole,
        }
    }

    /// The entry at `i`, for the new manifest.
    fn entry(&mut self, i: u32) -> TreeEntry {
        match self {
            ParentManifest::Sole(sole) => {
                std::mem::replace(&mut sole.manifest.entries[i as usize], moved_out())
            }
            ParentManifest::Shared(shared) => shared.manifest.entries[i as usize].clone(),
        }
    }
}

/// A re-checkpoint's manifest before its changed files are read: place by
/// place in path order (8 bytes each; the entries are put together once,
/// at the end), and beside each place the parent's entry it is unchanged
/// ([`NEW_ENTRY`] if none).
struct Plan {
    slots: Vec<Slot>,
    origins: Vec<u32>,
    /// Directories and symlinks, in the order of their `Slot::Own`.
    own: Vec<TreeEntry>,
    /// Files to read, in the order of their `Slot::Changed`.
    changed: Vec<ListedEntry>,
}

impl Plan {
    /// Pair each listed path with the parent's entry there, marking it in
    /// `found`; `parent_at_paths` gets the chunks the parent had at the
    /// paths to read. Both sides are in path order: one merge pass, with
    /// no map of either.
    fn pair(
        dir: &str,
        listed: Vec<ListedEntry>,
        parent: Option<&KnownManifest>,
        found: &mut [bool],
        parent_at_paths: &mut HashSet<String>,
    ) -> Result<Plan> {
        let parent_listed_at = parent.map_or(0, |p| p.manifest.listed_at);
        let old_entries: &[TreeEntry] = parent.map_or(&[], |p| p.manifest.entries.as_slice());
        let mut plan = Plan {
            slots: Vec::with_capacity(listed.len()),
            origins: Vec::with_capacity(listed.len()),
            own: Vec::new(),
            changed: Vec::new(),
        };
        // The parent's entry `i`, if `entry` is it unchanged.
        let origin = |old: Option<(usize, &TreeEntry)>, entry: &TreeEntry| match old {
            Some((i, o)) if o == entry => i as u32,
            _ => NEW_ENTRY,
        };
        let mut parent_at = InPathOrder::new(old_entries, |e: &TreeEntry| e.path.as_str());
        for listed in listed {
            let old = parent_at.get(&listed.path);
            if let Some((i, _)) = old {
                found[i] = true;
            }
            match listed.kind {
                'd' | 'l' => {
                    let entry = TreeEntry {
                        path: listed.path,
                        kind: if listed.kind == 'd' {
                            TreeKind::Dir
                        } else {
                            TreeKind::Symlink
                        },
                        mode: listed.mode,
                        size: 0,
                        mtime: listed.mtime,
                        chunks: Vec::new(),
                        target: (listed.kind == 'l').then_some(listed.link),
                        ino: 0,
                        ctime_ns: 0,
                    };
                    plan.origins.push(origin(old, &entry));
                    plan.slots.push(Slot::Own);
                    plan.own.push(entry);
                }
                'f' => match old {
                    Some((i, old)) if old.unchanged_since(&listed, parent_listed_at) => {
                        plan.origins.push(i as u32);
                        plan.slots.push(Slot::Parent(i as u32));
                    }
                    old => {
                        if let Some((_, was)) = old {
                            parent_at_paths.extend(was.chunks.iter().cloned());
                        }
                        plan.origins.push(NEW_ENTRY);
                        plan.slots.push(Slot::Changed {
                            old: old.map_or(NEW_ENTRY, |(i, _)| i as u32),
                        });
                        plan.changed.push(listed);
                    }
                },
                // tar skips sockets too (a file the parent had there is
                // gone).
                's' => {
                    if let Some((i, _)) = old {
                        found[i] = false;
                    }
                }
                other => {
                    return Err(Error::unsafe_entry(format!(
                        "{dir}/{}: a {} cannot be checkpointed",
                        listed.path,
                        match other {
                            'p' => "FIFO",
                            'b' | 'c' => "device node",
                            _ => "file of unknown type",
                        }
                    )))
                }
            }
        }
        Ok(plan)
    }

    /// The manifest's entries in path order, with their origins: the
    /// parent's where unchanged, the directories and symlinks as listed,
    /// the changed files as `read` (in the order of `changed`). A file
    /// read by nobody was removed between the listing and the read: it is
    /// left out, and the parent's entry at its path is gone (unmarked in
    /// `found`).
    fn assemble(
        self,
        read: Vec<Option<TreeEntry>>,
        parent: &mut Option<ParentManifest>,
        found: &mut [bool],
    ) -> (Vec<TreeEntry>, Vec<u32>) {
        let mut out = Vec::with_capacity(self.slots.len());
        let mut out_origins = Vec::with_capacity(self.slots.len());
        let mut own = self.own.into_iter();
        let mut read = read.into_iter();
        for (slot, from) in self.slots.into_iter().zip(self.origins) {
            let entry = match slot {
                Slot::Parent(i) => parent
                    .as_mut()
                    .expect("an unchanged entry has a parent")
                    .entry(i),
                Slot::Own => own.next().expect("one directory or symlink per place"),
                Slot::Changed { old } => match read.next().expect("one file per place") {
                    Some(entry) => entry,
                    None => {
                        if old != NEW_ENTRY {
                            found[old as usize] = false;
                        }
                        continue;
                    }
                },
            };
            out.push(entry);
            out_origins.push(from);
        }
        (out, out_origins)
    }
}

/// The changed files as read, each in its place among them. A file
/// removed since the listing (the agent may still be working) is left out
/// (`None`), and so recorded as deleted, instead of failing the
/// checkpoint.
async fn read_changed(
    sandbox: &dyn Sandbox,
    dir: &str,
    changed: &[ListedEntry],
    uploader: &mut Uploader<'_>,
    stats: &mut TreeCheckpointInfo,
    progress: Option<&dyn MoveProgress>,
) -> Result<Vec<Option<TreeEntry>>> {
    let mut read_files: Vec<Option<TreeEntry>> = Vec::new();
    if changed.is_empty() {
        return Ok(read_files);
    }
    let paths: Vec<String> = changed.iter().map(|l| l.path.clone()).collect();
    let tar = sandbox.export_paths_tar(dir, &paths).await?;
    let read = read_tar(tar, uploader, stats, progress).await?;
    let place: HashMap<&str, usize> = changed
        .iter()
        .enumerate()
        .map(|(k, l)| (l.path.as_str(), k))
        .collect();
    read_files.resize_with(changed.len(), || None);
    for mut entry in read.into_iter().filter(|e| e.kind == TreeKind::File) {
        if let Some(&k) = place.get(entry.path.as_str()) {
            entry.stamp_from(Some(&changed[k]));
            read_files[k] = Some(entry);
        }
    }
    Ok(read_files)
}

/// The parent's entries whose paths are gone: not `found` by the listing
/// and not among `entries` again, sorted by path, with only what a
/// restore compares (a deleted file's blobs are not kept alive by its
/// successor).
fn deleted_since(
    parent_entries: &[TreeEntry],
    found: &[bool],
    entries: &[TreeEntry],
) -> Vec<TreeEntry> {
    let gone: Vec<&TreeEntry> = parent_entries
        .iter()
        .zip(found)
        .filter(|(_, found)| !**found)
        .map(|(e, _)| e)
        .collect();
    // Only when something is gone: whether its path is back.
    let present: HashSet<&str> = if gone.is_empty() {
        HashSet::new()
    } else {
        entries.iter().map(|e| e.path.as_str()).collect()
    };
    let mut deleted: Vec<TreeEntry> = gone
        .into_iter()
        .filter(|e| !present.contains(e.path.as_str()))
        .map(|e| TreeEntry {
            chunks: Vec::new(),
            ino: 0,
            ctime_ns: 0,
            ..e.clone()
        })
        .collect();
    deleted.sort_by(|a, b| a.path.cmp(&b.path));
    deleted
}

/// Store `manifest` under `key` ([`encode_manifest`] against `parent`)
/// and keep it, so that the next checkpoint of this tree, or a restore of
/// this one, finds it parsed. Returns the stored object and the bytes
/// uploaded.
async fn store_manifest(
    store: &dyn CheckpointStore,
    key: &str,
    manifest: TreeManifest,
    origins: &[u32],
    parent: Option<&KnownManifest>,
) -> Result<(ObjectMeta, u64)> {
    let (packed, frames) = encode_manifest(&manifest, origins, parent).await?;
    let manifest = Arc::new(KnownManifest::with_frames(manifest, frames));
    let packed_len = packed.len() as u64;
    let object = store.put(key, harness_core::stream::once(packed)).await?;
    known::put(&object.sha256, manifest);
    Ok((object, packed_len))
}

/// Changed files from which a re-checkpoint consults the parent's chunk
/// set (built once per manifest, ~10 ms for 20,000 files) instead of
/// asking the store whether each chunk is there.
const PARENT_CHUNK_SET_FILES: usize = 256;

/// What a place of a re-checkpoint's manifest holds, in path order.
enum Slot {
    /// The parent's entry at this index, unchanged.
    Parent(u32),
    /// The next directory or symlink as listed.
    Own,
    /// The next changed file, once read; `old` is the parent's entry at
    /// its path (`NEW_ENTRY` if none), which goes back among the deleted
    /// if the file vanishes before it is read.
    Changed { old: u32 },
}

/// What stays in a parent's place when its entry moved into the next
/// manifest (allocates nothing).
fn moved_out() -> TreeEntry {
    TreeEntry {
        path: String::new(),
        kind: TreeKind::File,
        mode: 0,
        size: 0,
        mtime: 0,
        chunks: Vec::new(),
        target: None,
        ino: 0,
        ctime_ns: 0,
    }
}

/// Entries per frame of a written manifest: a frame ends after an entry
/// whose path hashes to 0 modulo [`FRAME_AVG_ENTRIES`] (once it has
/// [`FRAME_MIN_ENTRIES`]), or at [`FRAME_MAX_ENTRIES`]. The ends depend on
/// the paths, not on positions, so a path added or removed changes the
/// frames around it only, and a re-checkpoint reuses the others.
const FRAME_AVG_ENTRIES: u64 = 1024;
const FRAME_MIN_ENTRIES: usize = 256;
const FRAME_MAX_ENTRIES: usize = 4096;

/// No entry of the parent: an entry the checkpoint made or changed.
const NEW_ENTRY: u32 = u32::MAX;

/// Whether a frame may end after the entry at `path` (FNV-1a, a hash that
/// no platform or version changes).
fn ends_frame(path: &str) -> bool {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in path.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    h.is_multiple_of(FRAME_AVG_ENTRIES)
}

/// `manifest` as stored: the JSON `serde_json` makes of a [`TreeManifest`]
/// (the same fields in the same order, `format` first) as zstd frames
/// concatenated — the head, the entries a frame per run of about
/// [`FRAME_AVG_ENTRIES`], the tail — which any zstd reader reads as one
/// stream. `origins[i]` is the index in `parent` of entry `i` when it is
/// that entry unchanged ([`NEW_ENTRY`] otherwise): a run of the parent's
/// entries that was one of its frames is that frame again, not encoded and
/// compressed anew. Returns the object's bytes and the entry frames (as
/// slices of them).
async fn encode_manifest(
    manifest: &TreeManifest,
    origins: &[u32],
    parent: Option<&KnownManifest>,
) -> Result<(Bytes, Vec<EntryFrame>)> {
    #[derive(Serialize)]
    struct Head<'a> {
        format: &'a str,
        #[serde(skip_serializing_if = "Option::is_none")]
        parent: Option<&'a str>,
        listed_at: u64,
    }
    let encoding = |e: serde_json::Error| Error::backend(format!("encoding the manifest: {e}"));
    let packed = |json: Vec<u8>| async move {
        harness_core::stream::collect(
            compress(harness_core::stream::once(json), MANIFEST_ZSTD_LEVEL),
            MAX_MANIFEST_BYTES,
        )
        .await
    };
    let mut head = serde_json::to_vec(&Head {
        format: &manifest.format,
        parent: manifest.parent.as_deref(),
        listed_at: manifest.listed_at,
    })
    .map_err(encoding)?;
    head.pop(); // the closing brace
    head.extend_from_slice(b",\"entries\":[");
    // The object as it grows, and each entry frame's (first, len) and
    // byte range in it.
    let mut object = BytesMut::new();
    object.extend_from_slice(&packed(head).await?);
    let mut spans: Vec<(usize, usize, std::ops::Range<usize>)> = Vec::new();
    let mut push = |object: &mut BytesMut, frame: &[u8], entries: (usize, usize)| {
        spans.push((
            entries.0,
            entries.1,
            object.len()..object.len() + frame.len(),
        ));
        object.extend_from_slice(frame);
    };
    let entries = &manifest.entries;
    let mut at = 0;
    while at < entries.len() {
        let reused = parent.zip(origins.get(at)).and_then(|(p, &from)| {
            let frame = p.frame_at(from as usize).filter(|_| from != NEW_ENTRY)?;
            let run = origins.get(at..at + frame.len)?;
            // The same entries, in the same place relative to the comma.
            let same = (at == 0) == (frame.first == 0)
                && run
                    .iter()
                    .enumerate()
                    .all(|(k, &o)| o as usize == frame.first + k);
            same.then(|| frame.clone())
        });
        if let Some(frame) = reused {
            push(&mut object, &frame.bytes, (at, frame.len));
            at += frame.len;
            continue;
        }
        let first = at;
        let mut json = Vec::new();
        loop {
            if at > 0 {
                json.push(b',');
            }
            serde_json::to_writer(&mut json, &entries[at]).map_err(encoding)?;
            at += 1;
            let len = at - first;
            if at == entries.len()
                || len >= FRAME_MAX_ENTRIES
                || (len >= FRAME_MIN_ENTRIES && ends_frame(&entries[at - 1].path))
            {
                break;
            }
        }
        push(&mut object, &packed(json).await?, (first, at - first));
    }
    let mut tail = vec![b']'];
    if !manifest.deleted.is_empty() {
        tail.extend_from_slice(b",\"deleted\":");
        serde_json::to_writer(&mut tail, &manifest.deleted).map_err(encoding)?;
    }
    if !manifest.packs.is_empty() {
        tail.extend_from_slice(b",\"packs\":");
        serde_json::to_writer(&mut tail, &manifest.packs).map_err(encoding)?;
    }
    tail.push(b'}');
    object.extend_from_slice(&packed(tail).await?);
    if object.len() > MAX_MANIFEST_BYTES {
        return Err(Error::invalid(format!(
            "the manifest would be {} bytes, over {MAX_MANIFEST_BYTES}",
            object.len()
        )));
    }
    let object = object.freeze();
    let frames = spans
        .into_iter()
        .map(|(first, len, range)| EntryFrame {
            first,
            len,
            bytes: object.slice(range),
        })
        .collect();
    Ok((object, frames))
}

/// Restore the tree checkpoint under `key` onto `dir` of `sandbox`,
/// writing only what the target lacks. See the module docs.
#[tracing::instrument(name = "restore_tree", skip_all, fields(key = %key, dir = %dir))]
pub async fn restore_tree(
    store: &dyn CheckpointStore,
    key: &str,
    sandbox: &dyn Sandbox,
    dir: &str,
    progress: Option<Arc<dyn MoveProgress>>,
) -> Result<TreeRestoreInfo> {
    validate_key(key)?;
    // The target is listed while the manifest is fetched, parsed and
    // admitted: the listing waits on the sandbox, the rest on the store
    // and the CPU. Nothing is written before both are done.
    let read = async {
        let manifest = load_manifest(store, key)
            .await?
            .ok_or_else(|| Error::invalid(format!("{key} is a whole-archive checkpoint")))?;
        let summary = manifest.admitted()?;
        Ok::<_, Error>((manifest, summary))
    };
    let (listing, read) = futures::join!(list_tree(sandbox, dir), read);
    let (manifest, summary) = read?;
    apply_manifest(
        store,
        &manifest.manifest,
        summary,
        listing?,
        sandbox,
        dir,
        progress,
    )
    .await
}

/// [`restore_tree`] of a manifest already read.
pub async fn restore_manifest(
    store: &dyn CheckpointStore,
    manifest: &TreeManifest,
    sandbox: &dyn Sandbox,
    dir: &str,
    progress: Option<Arc<dyn MoveProgress>>,
) -> Result<TreeRestoreInfo> {
    let (listing, summary) = futures::join!(list_tree(sandbox, dir), async { admit(manifest) });
    let summary = summary?;
    apply_manifest(store, manifest, summary, listing?, sandbox, dir, progress).await
}

/// The archive rules, for all entries, before anything is touched.
fn admit(manifest: &TreeManifest) -> Result<ScanSummary> {
    if manifest.format != FORMAT {
        return Err(Error::unsupported(format!(
            "manifest format {:?} (this build reads {FORMAT})",
            manifest.format
        )));
    }
    let mut scanner = TarScanner::new();
    scanner.reserve(manifest.entries.len());
    for entry in &manifest.entries {
        check_chunks(entry)?;
        scanner.admit(&entry.path, &entry.tar_kind(), entry.mode, entry.size)?;
    }
    let summary = scanner.finish()?;
    for entry in &manifest.deleted {
        harness_core::tarscan::normalize_entry_path(&entry.path)?;
    }
    // A pack id becomes a key: nothing but a hash may name one.
    if let Some(bad) = manifest.packs.iter().find(|p| !is_sha256_hex(p)) {
        return Err(Error::corrupt(format!(
            "manifest names a malformed pack id {bad:?}"
        )));
    }
    Ok(summary)
}

/// Items in path order (a listing, a manifest's entries) asked for paths
/// one after another, with the index of what is found: a walk forward
/// while the paths asked come in path order, as a sorted side's do, and a
/// binary search for one that does not (a manifest written elsewhere need
/// not be sorted, and is then paired just as right, only slower). An
/// unsorted `items` only makes a path be missed (read or written again).
struct InPathOrder<'a, T> {
    items: &'a [T],
    path: fn(&T) -> &str,
    /// Where the walk is: every item before it sorts before the last path
    /// asked for.
    next: usize,
}

impl<'a, T> InPathOrder<'a, T> {
    fn new(items: &'a [T], path: fn(&T) -> &str) -> Self {
        Self {
            items,
            path,
            next: 0,
        }
    }

    fn get(&mut self, path: &str) -> Option<(usize, &'a T)> {
        let (items, path_of) = (self.items, self.path);
        if self.next > 0 && path <= path_of(&items[self.next - 1]) {
            return items
                .binary_search_by(|item| path_of(item).cmp(path))
                .ok()
                .map(|i| (i, &items[i]));
        }
        while items
            .get(self.next)
            .is_some_and(|item| path_of(item) < path)
        {
            self.next += 1;
        }
        let at = self.next;
        let found = items.get(at).filter(|item| path_of(item) == path)?;
        self.next += 1;
        Some((at, found))
    }
}

/// Write what the target (as `listing` found it) lacks of an admitted
/// manifest, then remove what it deleted.
async fn apply_manifest(
    store: &dyn CheckpointStore,
    manifest: &TreeManifest,
    summary: ScanSummary,
    listing: Listing,
    sandbox: &dyn Sandbox,
    dir: &str,
    progress: Option<Arc<dyn MoveProgress>>,
) -> Result<TreeRestoreInfo> {
    let listed = match listing {
        Listing::Listed { entries, .. } => entries,
        Listing::Missing | Listing::Unsupported => Vec::new(),
    };
    let mut target = InPathOrder::new(&listed, listed_path);
    let needed: Vec<&TreeEntry> = manifest
        .entries
        .iter()
        .filter(|e| !e.path.is_empty())
        .filter(|e| !target.get(&e.path).is_some_and(|(_, l)| e.same_as(l)))
        .collect();
    // Every chunk there before the first byte is written.
    let located = locate_chunks(store, manifest, &needed).await?;
    let bytes_written: u64 = needed.iter().map(|e| e.size).sum();
    let written = needed.len() as u64;
    if !needed.is_empty() {
        let (tx, rx) = futures::channel::mpsc::channel::<Result<Bytes>>(8);
        let produce = produce_tar(
            store,
            &needed,
            &located,
            &manifest.packs,
            tx,
            progress.clone(),
        );
        let import = sandbox.import_tar(dir, Box::pin(rx));
        let (produced, imported) = futures::join!(produce, import);
        // The producer's error is the cause when both failed.
        produced?;
        imported?;
    }
    if let Some(p) = &progress {
        p.finish(MovePhase::Import);
    }
    // Deletions last: a failed import removes nothing.
    let removed = remove_deleted(sandbox, dir, &manifest.deleted, &listed).await?;
    Ok(TreeRestoreInfo {
        summary,
        written,
        bytes_written,
        removed,
    })
}

fn listed_path(listed: &ListedEntry) -> &str {
    &listed.path
}

/// The refusal of a restore whose content the store lacks in part.
fn incomplete(missing: &str) -> Error {
    Error::not_found(format!(
        "the checkpoint's content is incomplete in the store ({missing}); nothing was restored"
    ))
}

/// Where each chunk of `needed` is: a pack of the manifest's (the map), or
/// a blob (not in it). Fails as incomplete when one is neither, and when a
/// pack read from is not there as its index describes it.
async fn locate_chunks<'m>(
    store: &dyn CheckpointStore,
    manifest: &'m TreeManifest,
    needed: &[&'m TreeEntry],
) -> Result<HashMap<&'m str, Loc>> {
    let unique: HashSet<&str> = needed
        .iter()
        .flat_map(|e| e.chunks.iter().map(String::as_str))
        .collect();
    // Many chunks (a tree restored whole) are looked up in the packs
    // first, then the rest in one listing of the blobs; a few (the files a
    // checkpoint changed, stored as blobs) are asked with a `HEAD` first,
    // and the packs' indexes read only for what is not a blob.
    let mut unfound: Vec<&str> = unique.iter().copied().collect();
    let mut located: HashMap<&str, Loc> = HashMap::new();
    let mut indexes: Option<Vec<Arc<PackIndex>>> = None;
    // A pack's index gone is content gone.
    let read_indexes = || async {
        packs::read_indexes(store, &manifest.packs)
            .await
            .map_err(|e| match e.kind() {
                ErrorKind::NotFound => incomplete(e.message()),
                _ => e,
            })
    };
    if !manifest.packs.is_empty() && unique.len() > HEADS_BEFORE_LISTING {
        let read = read_indexes().await?;
        located = locate_in_packs(&read, &unfound);
        unfound.retain(|h| !located.contains_key(h));
        indexes = Some(read);
    }
    let mut missing = missing_blobs(store, &unfound).await?;
    if !missing.is_empty() && !manifest.packs.is_empty() && indexes.is_none() {
        let read = read_indexes().await?;
        let found = locate_in_packs(&read, &missing);
        missing.retain(|h| !found.contains_key(h));
        located.extend(found);
        indexes = Some(read);
    }
    if let Some(first) = missing.first() {
        return Err(incomplete(&format!("{} is missing", blob_key(first))));
    }
    check_packs(store, &manifest.packs, &located, indexes.as_deref()).await?;
    Ok(located)
}

/// Every pack `located` reads from is there, is what its id names, and is
/// long enough for its index.
async fn check_packs(
    store: &dyn CheckpointStore,
    packs: &[String],
    located: &HashMap<&str, Loc>,
    indexes: Option<&[Arc<PackIndex>]>,
) -> Result<()> {
    let used: std::collections::BTreeSet<u32> = located.values().map(|l| l.pack).collect();
    let mut heads = futures::stream::iter(used)
        .map(|at| async move {
            let id = &packs[at as usize];
            (at, store.head(&pack_key(id)).await)
        })
        .buffer_unordered(IN_FLIGHT);
    while let Some((at, head)) = heads.next().await {
        let id = &packs[at as usize];
        let meta = head.map_err(|e| {
            if e.kind() == ErrorKind::NotFound {
                incomplete(&format!("{} is missing", pack_key(id)))
            } else {
                e
            }
        })?;
        let end = indexes.map_or(0, |i| i[at as usize].end());
        if meta.sha256 != *id || meta.size < end {
            return Err(Error::corrupt(format!(
                "pack {} holds {} bytes with SHA-256 {}, not the pack its index describes",
                pack_key(id),
                meta.size,
                meta.sha256
            )));
        }
    }
    Ok(())
}

/// Remove from the target the `deleted` paths it still holds exactly as
/// the parent had them (`listed`: the target before the restore); returns
/// how many.
async fn remove_deleted(
    sandbox: &dyn Sandbox,
    dir: &str,
    deleted: &[TreeEntry],
    listed: &[ListedEntry],
) -> Result<u64> {
    let mut files = Vec::new();
    let mut dirs = Vec::new();
    let mut target = InPathOrder::new(listed, listed_path);
    for gone in deleted {
        if target.get(&gone.path).is_some_and(|(_, l)| gone.same_as(l)) {
            match gone.kind {
                TreeKind::Dir => dirs.push(gone.path.as_str()),
                _ => files.push(gone.path.as_str()),
            }
        }
    }
    let removed = (files.len() + dirs.len()) as u64;
    if removed > 0 {
        // Deepest first, so a directory's children go before it; a
        // directory that still holds anything stays.
        dirs.sort_by(|a, b| b.cmp(a));
        let mut list = Vec::new();
        for p in files.iter().chain(dirs.iter()) {
            list.extend_from_slice(p.as_bytes());
            list.push(0);
        }
        let script = format!(
            "cd {} || exit 44; xargs -0 sh -c 'for p; do if [ -d \"$p\" ] && [ ! -L \"$p\" ]; then rmdir \"$p\" 2>/dev/null; else rm -f \"$p\"; fi; done; exit 0' sh",
            shell_quote(dir)
        );
        collect_exec(sandbox.exec(ExecRequest::shell(script).stdin(list)).await?)
            .await?
            .check("removing the paths the checkpoint deleted")?;
    }
    Ok(removed)
}

/// 64 hex digits. Every byte is looked at (no early exit), which the
/// compiler turns into a few vector instructions: the check byte by byte
/// took most of a manifest's admission (20,000 hashes).
fn is_sha256_hex(h: &str) -> bool {
    h.len() == 64 && h.bytes().fold(true, |ok, b| ok & b.is_ascii_hexdigit())
}

fn check_chunks(entry: &TreeEntry) -> Result<()> {
    let ok = entry.chunks.iter().all(|h| is_sha256_hex(h));
    let kind_ok = entry.kind == TreeKind::File || entry.chunks.is_empty();
    if ok && kind_ok {
        Ok(())
    } else {
        Err(Error::corrupt(format!(
            "manifest entry {:?} has malformed chunk hashes",
            entry.path
        )))
    }
}

/// Where a chunk to restore lies in one of the manifest's packs (`pack`:
/// its position in `packs`).
#[derive(Debug, Clone, Copy)]
struct Loc {
    pack: u32,
    offset: u64,
    end: u64,
}

/// The packed chunks among `wanted` (hex hashes), from `indexes` (the
/// manifest's packs' indexes, in its order).
fn locate_in_packs<'h>(indexes: &[Arc<PackIndex>], wanted: &[&'h str]) -> HashMap<&'h str, Loc> {
    let by_digest: HashMap<[u8; 32], &str> = wanted
        .iter()
        .filter_map(|h| chunk_bytes(h).map(|d| (d, *h)))
        .collect();
    let mut found = HashMap::new();
    for (at, index) in indexes.iter().enumerate() {
        for c in &index.chunks {
            if let Some(&hash) = by_digest.get(&c.hash) {
                found.entry(hash).or_insert(Loc {
                    pack: at as u32,
                    offset: c.offset,
                    end: c.end(),
                });
            }
        }
    }
    found
}

/// Which of `hashes` the store holds no blob of: one listing of the blobs
/// for many (unless the store is too large to list), a `HEAD` each for a
/// few.
async fn missing_blobs<'h>(
    store: &dyn CheckpointStore,
    hashes: &[&'h str],
) -> Result<Vec<&'h str>> {
    let listed = if hashes.len() > HEADS_BEFORE_LISTING {
        list_blob_hashes(store).await?
    } else {
        None
    };
    if let Some(stored) = listed {
        return Ok(hashes
            .iter()
            .copied()
            .filter(|h| !chunk_bytes(h).is_some_and(|d| stored.contains(&d)))
            .collect());
    }
    lacking_blobs(store, hashes.to_vec(), |h| h).await
}

/// The items whose blob (of hash `hash(item)`) the store lacks, asked with
/// a `HEAD` each, [`IN_FLIGHT`] at a time, in their order.
async fn lacking_blobs<T, F>(store: &dyn CheckpointStore, items: Vec<T>, hash: F) -> Result<Vec<T>>
where
    F: Fn(&T) -> &str,
{
    let hash = &hash;
    let mut heads = futures::stream::iter(items)
        .map(|item| async move {
            match store.head(&blob_key(hash(&item))).await {
                Ok(_) => Ok(None),
                Err(e) if e.kind() == ErrorKind::NotFound => Ok(Some(item)),
                Err(e) => Err(e),
            }
        })
        .buffered(IN_FLIGHT);
    let mut lacking = Vec::new();
    while let Some(answer) = heads.next().await {
        lacking.extend(answer?);
    }
    Ok(lacking)
}

/// Gap between two packed chunks one read may span (read and dropped):
/// cheaper than a second request.
const PACK_READ_GAP: u64 = 64 * 1024;

/// Send `entries` as a tar stream, chunks fetched ahead in order within
/// [`IN_FLIGHT_BYTES`] and [`IN_FLIGHT`] ([`tar_order`], [`tar_units`]).
async fn produce_tar(
    store: &dyn CheckpointStore,
    entries: &[&TreeEntry],
    located: &HashMap<&str, Loc>,
    packs: &[String],
    mut tx: futures::channel::mpsc::Sender<Result<Bytes>>,
    progress: Option<Arc<dyn MoveProgress>>,
) -> Result<()> {
    let ordered = tar_order(entries, located);
    // Units in order, run ahead within the byte and request budgets.
    let mut units = tar_units(&ordered, located).into_iter().peekable();
    let mut running = futures::stream::FuturesOrdered::new();
    let mut costs = std::collections::VecDeque::new();
    let mut in_flight = 0u64;
    loop {
        while running.len() < IN_FLIGHT {
            let Some(next) = units.peek() else { break };
            let c = next.cost;
            if !running.is_empty() && in_flight + c > IN_FLIGHT_BYTES {
                break;
            }
            let unit = units.next().expect("peeked");
            in_flight += c;
            costs.push_back(c);
            running.push_back(unit.fetch(store, packs));
        }
        let Some(pieces) = running.next().await else {
            break;
        };
        in_flight -= costs.pop_front().unwrap_or(0);
        match pieces {
            Ok(pieces) => {
                for bytes in pieces {
                    if let Some(p) = &progress {
                        p.advance(MovePhase::Import, bytes.len() as u64);
                    }
                    if tx.send(Ok(bytes)).await.is_err() {
                        // The importer stopped; its error says why.
                        return Ok(());
                    }
                }
            }
            Err(e) => {
                let _ = tx
                    .send(Err(Error::new(e.kind(), e.message().to_string())))
                    .await;
                return Err(e);
            }
        }
    }
    Ok(())
}

/// The order a restore's tar sends `entries` in: directories first (in
/// path order, so each comes before what it holds), then the files whose
/// content is packed in the order of the packs (so that runs of them are
/// one ranged read each), then the rest in path order, symlinks last; the
/// importer takes entries in any order once their directories exist.
fn tar_order<'e>(entries: &[&'e TreeEntry], located: &HashMap<&str, Loc>) -> Vec<&'e TreeEntry> {
    let rank = |e: &TreeEntry| match e.kind {
        TreeKind::Dir => (0, 0, 0),
        TreeKind::File => match e.chunks.first().and_then(|h| located.get(h.as_str())) {
            Some(l) => (1, l.pack, l.offset),
            None => (2, 0, 0),
        },
        TreeKind::Symlink => (3, 0, 0),
    };
    let mut ordered: Vec<&TreeEntry> = entries.to_vec();
    // Stable: path order within each rank.
    ordered.sort_by_key(|e| rank(e));
    ordered
}

/// One piece of a restore's tar stream.
enum Piece<'a> {
    Header(&'a TreeEntry),
    /// A blob's hash.
    Blob(&'a str),
    /// A packed chunk's hash and where it is.
    Packed(&'a str, Loc),
    Bytes(Bytes),
}

/// Pieces produced together: those of one ranged read of a pack (`span`:
/// the pack, start, end), or one blob, with headers and padding around
/// them. `cost`: the bytes they hold in flight.
struct Unit<'a> {
    pieces: Vec<Piece<'a>>,
    span: Option<(u32, u64, u64)>,
    cost: u64,
}

impl<'a> Unit<'a> {
    fn new() -> Self {
        Unit {
            pieces: Vec::new(),
            span: None,
            cost: 0,
        }
    }

    /// Widen this unit's read of a pack to take in the packed chunk at
    /// `loc`, when it is in the same pack, within [`PACK_READ_GAP`] of the
    /// read's end and [`PACK_READ_MAX`] of its start; whether it did.
    fn joins(&mut self, loc: Loc) -> bool {
        match &mut self.span {
            Some((pack, start, end)) if *pack == loc.pack => {
                if loc.offset >= *start && loc.end <= *end {
                    true
                } else if loc.offset >= *end
                    && loc.offset - *end <= PACK_READ_GAP
                    && loc.end - *start <= PACK_READ_MAX
                {
                    self.cost += loc.end - *end;
                    *end = loc.end;
                    true
                } else {
                    false
                }
            }
            _ => false,
        }
    }

    /// The unit's bytes, in order: its pack range read once, its blob
    /// fetched, each chunk's hash checked.
    async fn fetch(self, store: &dyn CheckpointStore, packs: &[String]) -> Result<Vec<Bytes>> {
        let read = match self.span {
            Some((pack, start, end)) => {
                let key = pack_key(&packs[pack as usize]);
                Some((start, store.get_range(&key, start..end).await?))
            }
            None => None,
        };
        let mut out = Vec::with_capacity(self.pieces.len());
        for piece in self.pieces {
            out.push(match piece {
                Piece::Header(entry) => tar_header(entry)?,
                Piece::Bytes(b) => b,
                Piece::Blob(hash) => fetch_chunk(store, hash).await?,
                Piece::Packed(hash, loc) => {
                    let (start, bytes) = read.as_ref().expect("a packed chunk's unit reads");
                    let frame =
                        bytes.slice((loc.offset - start) as usize..(loc.end - start) as usize);
                    let id = &packs[loc.pack as usize];
                    unpack_chunk(
                        frame,
                        hash,
                        &format!("chunk {hash} of pack {}", pack_key(id)),
                    )
                    .await?
                }
            });
        }
        Ok(out)
    }
}

/// The tar stream of `ordered` as units: runs of packed chunks close
/// together in one pack are one unit, read with one ranged request; a
/// blob is a unit of its own; the headers and padding go with the unit
/// they come before or after, and two zero blocks end the stream.
fn tar_units<'a>(ordered: &[&'a TreeEntry], located: &HashMap<&str, Loc>) -> Vec<Unit<'a>> {
    let mut units: Vec<Unit<'_>> = Vec::new();
    let mut unit = Unit::new();
    for entry in ordered {
        unit.pieces.push(Piece::Header(entry));
        for hash in &entry.chunks {
            // A chunk costs at most its file's size and at most MAX_CHUNK.
            let raw = entry.size.min(MAX_CHUNK as u64);
            match located.get(hash.as_str()) {
                Some(&loc) => {
                    if !unit.joins(loc) {
                        if unit.span.is_some() || !unit.pieces.is_empty() {
                            units.push(std::mem::replace(&mut unit, Unit::new()));
                        }
                        unit.span = Some((loc.pack, loc.offset, loc.end));
                        unit.cost += loc.end - loc.offset;
                    }
                    unit.cost += raw;
                    unit.pieces.push(Piece::Packed(hash, loc));
                }
                None => {
                    units.push(std::mem::replace(&mut unit, Unit::new()));
                    units.push(Unit {
                        pieces: vec![Piece::Blob(hash)],
                        span: None,
                        cost: raw,
                    });
                }
            }
        }
        let pad = (512 - (entry.size % 512) as usize) % 512;
        if pad > 0 {
            unit.pieces.push(Piece::Bytes(Bytes::from(vec![0u8; pad])));
        }
    }
    unit.pieces.push(Piece::Bytes(Bytes::from(vec![0u8; 1024])));
    units.push(unit);
    units
}

/// The header block(s) of one entry: GNU format, with a GNU long name for
/// paths or link texts over 100 bytes.
fn tar_header(entry: &TreeEntry) -> Result<Bytes> {
    let mut out = BytesMut::new();
    let mut header = tar::Header::new_gnu();
    let (kind, size) = match entry.kind {
        TreeKind::File => (tar::EntryType::Regular, entry.size),
        TreeKind::Dir => (tar::EntryType::Directory, 0),
        TreeKind::Symlink => (tar::EntryType::Symlink, 0),
    };
    header.set_entry_type(kind);
    header.set_size(size);
    header.set_mode(entry.mode);
    header.set_mtime(entry.mtime);
    let long = |out: &mut BytesMut, kind: tar::EntryType, value: &[u8]| {
        let mut h = tar::Header::new_gnu();
        let name = b"././@LongLink";
        h.as_gnu_mut().expect("gnu header").name[..name.len()].copy_from_slice(name);
        h.set_entry_type(kind);
        h.set_mode(0o644);
        h.set_size(value.len() as u64 + 1);
        h.set_cksum();
        out.extend_from_slice(h.as_bytes());
        out.extend_from_slice(value);
        out.extend_from_slice(&[0]);
        let pad = (512 - ((value.len() + 1) % 512)) % 512;
        out.extend_from_slice(&vec![0u8; pad]);
    };
    let path = match entry.kind {
        TreeKind::Dir => format!("{}/", entry.path),
        _ => entry.path.clone(),
    };
    if path.len() > 100 {
        long(&mut out, tar::EntryType::GNULongName, path.as_bytes());
        let name = &mut header.as_gnu_mut().expect("gnu header").name;
        name.copy_from_slice(&path.as_bytes()[..100]);
    } else {
        header.as_gnu_mut().expect("gnu header").name[..path.len()]
            .copy_from_slice(path.as_bytes());
    }
    if let Some(target) = &entry.target {
        if target.len() > 100 {
            long(&mut out, tar::EntryType::GNULongLink, target.as_bytes());
            header
                .as_gnu_mut()
                .expect("gnu header")
                .linkname
                .copy_from_slice(&target.as_bytes()[..100]);
        } else {
            header.as_gnu_mut().expect("gnu header").linkname[..target.len()]
                .copy_from_slice(target.as_bytes());
        }
    }
    header.set_cksum();
    out.extend_from_slice(header.as_bytes());
    Ok(out.freeze())
}

/// One chunk's content, its hash checked.
async fn fetch_chunk(store: &dyn CheckpointStore, hash: &str) -> Result<Bytes> {
    let key = blob_key(hash);
    let body = store.get(&key).await?;
    unpack_stream(body, hash, &format!("blob {key}")).await
}

/// A chunk's content out of its zstd frame, its hash checked (`what`
/// names where it was read, for the error).
async fn unpack_chunk(frame: Bytes, hash: &str, what: &str) -> Result<Bytes> {
    unpack_stream(harness_core::stream::once(frame), hash, what).await
}

async fn unpack_stream(compressed: ByteStream, hash: &str, what: &str) -> Result<Bytes> {
    // A chunk is at most MAX_CHUNK: a blob that inflates past it is refused.
    #[cfg(feature = "zstd")]
    let content = {
        // A frame past this bound is not one of a chunk.
        let frames = harness_core::stream::collect(compressed, zstd_bound(MAX_CHUNK)).await?;
        chunk_zstd::decompress(&frames, MAX_CHUNK, what)?
    };
    #[cfg(not(feature = "zstd"))]
    let content = harness_core::stream::collect(decompress(compressed), MAX_CHUNK).await?;
    let got = hex::encode(Sha256::digest(&content));
    if got != hash {
        return Err(Error::corrupt(format!(
            "{what} holds content with SHA-256 {got}"
        )));
    }
    Ok(content)
}

/// The most zstd makes of `len` bytes: it never grows incompressible data
/// by more than a few bytes per 128 KiB block.
fn zstd_bound(len: usize) -> usize {
    len + len / 8 + 1024
}

/// A chunk's zstd frame.
#[cfg(feature = "zstd")]
async fn compressed(content: Bytes) -> Result<Bytes> {
    chunk_zstd::compress(&content, DEFAULT_ZSTD_LEVEL)
}

/// A chunk's zstd frame(s), in pure Rust.
#[cfg(not(feature = "zstd"))]
async fn compressed(content: Bytes) -> Result<Bytes> {
    let limit = zstd_bound(content.len());
    harness_core::stream::collect(
        compress(harness_core::stream::once(content), DEFAULT_ZSTD_LEVEL),
        limit,
    )
    .await
}

/// libzstd for chunks, with one compression and one decompression context
/// per thread, reused. Most chunks are small whole files, and a context
/// made for each (its tables and the streaming adapter's two 256 KiB
/// buffers) cost more than compressing the file; a reused context told the
/// input's size also sizes its tables to a small file.
#[cfg(feature = "zstd")]
mod chunk_zstd {
    use std::cell::RefCell;
    use std::io::Read;

    use bytes::Bytes;
    use zstd::zstd_safe::{self, DCtx, ResetDirective};

    use harness_core::{Error, Result};

    thread_local! {
        static COMPRESSOR: RefCell<Option<(i32, zstd::bulk::Compressor<'static>)>> =
            const { RefCell::new(None) };
        static DECOMPRESSOR: RefCell<Option<DCtx<'static>>> = const { RefCell::new(None) };
    }

    /// `content` as one zstd frame at `level` (its size in the header).
    pub(super) fn compress(content: &[u8], level: i32) -> Result<Bytes> {
        COMPRESSOR.with(|cell| {
            let mut cell = cell.borrow_mut();
            let compressor = match &mut *cell {
                Some((at, compressor)) if *at == level => compressor,
                slot => &mut slot.insert((level, zstd::bulk::Compressor::new(level)?)).1,
            };
            Ok(Bytes::from(compressor.compress(content)?))
        })
    }

    /// The content of `frames` (one zstd frame or several, as the Worker's
    /// pure-Rust encoder writes), refused as corrupt past `max` bytes or
    /// when it is not zstd; `what` names where the frames were read.
    pub(super) fn decompress(frames: &[u8], max: usize, what: &str) -> Result<Bytes> {
        let corrupt = |why: String| Error::corrupt(format!("{what}: {why}"));
        DECOMPRESSOR.with(|cell| {
            let mut cell = cell.borrow_mut();
            let context = match &mut *cell {
                Some(context) => context,
                slot => slot.insert(DCtx::try_create().ok_or_else(|| {
                    Error::backend("libzstd could not make a decompression context")
                })?),
            };
            // What an earlier frame that failed midway left is dropped.
            context
                .reset(ResetDirective::SessionOnly)
                .map_err(|code| corrupt(zstd_safe::get_error_name(code).to_string()))?;
            // The first frame's size, when its header has it, sizes the
            // buffer once; never more than `max` on a header's word.
            let expected = zstd_safe::get_frame_content_size(frames)
                .ok()
                .flatten()
                .unwrap_or(0)
                .min(max as u64);
            let mut content = Vec::with_capacity(expected as usize);
            zstd::stream::read::Decoder::with_context(frames, context)
                .take(max as u64 + 1)
                .read_to_end(&mut content)
                .map_err(|e| corrupt(format!("not a zstd chunk: {e}")))?;
            if content.len() > max {
                return Err(corrupt(format!("inflates past {max} bytes")));
            }
            Ok(Bytes::from(content))
        })
    }
}

/// Chunks asked about one `HEAD` each before the store's blob keys are
/// listed instead: a few `HEAD`s cost less than listing 256 prefixes, a
/// whole tree's (20,000 for the bench tree) cost more than the uploads.
const HEADS_BEFORE_LISTING: usize = 256;

/// Most blob keys under one two-hex-digit prefix the listing holds: past
/// it (a store of over ~500,000 blobs) the listing is dropped and `HEAD`s
/// go on, so the set stays within ~16 MiB whatever the store's size.
const MAX_LISTED_PER_PREFIX: usize = 2048;

/// Prefix listings in flight at once.
const LISTINGS_IN_FLIGHT: usize = 16;

/// How the uploader learns whether the store holds a chunk.
enum Presence {
    /// A `HEAD` per chunk; `asked` so far.
    Head { asked: usize },
    /// The hashes of every blob in the store when it was listed, and what
    /// its packs hold (`None`: too many packs to read). A listing holds
    /// while the checkpoint's lock does: garbage collection, the one
    /// remover of blobs and packs, cannot run meanwhile.
    Listed {
        blobs: HashSet<[u8; 32]>,
        packed: Option<packs::Packed>,
    },
    /// The store holds too many blobs to list: a `HEAD` per chunk.
    TooMany,
}

/// Where the store holds a chunk, as its listing says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stored {
    Absent,
    Blob,
    /// In the pack at this position of the listing's packs.
    Pack(u32),
}

impl Presence {
    /// What the store's listing says of the chunk `digest`: `None` when it
    /// is to be asked with a `HEAD` (the first [`HEADS_BEFORE_LISTING`]
    /// chunks, or a store too large to list). The chunk past those lists
    /// the store.
    async fn listed(
        &mut self,
        store: &dyn CheckpointStore,
        digest: &[u8; 32],
    ) -> Result<Option<Stored>> {
        if let Presence::Head { asked } = self {
            if *asked < HEADS_BEFORE_LISTING {
                *asked += 1;
                return Ok(None);
            }
            self.list_now(store).await?;
        }
        Ok(match self {
            Presence::Listed { blobs, packed } => Some(if blobs.contains(digest) {
                Stored::Blob
            } else {
                match packed.as_ref().and_then(|p| p.chunks.get(digest)) {
                    Some(&at) => Stored::Pack(at),
                    None => Stored::Absent,
                }
            }),
            _ => None,
        })
    }

    /// List the store now, unless it was (many chunks to ask about at
    /// once: a listing costs less than their `HEAD`s, and sees packs).
    async fn list_now(&mut self, store: &dyn CheckpointStore) -> Result<()> {
        if let Presence::Head { .. } = self {
            let (blobs, packed) =
                futures::try_join!(list_blob_hashes(store), packs::list_packed(store))?;
            *self = match blobs {
                Some(blobs) => Presence::Listed { blobs, packed },
                None => Presence::TooMany,
            };
        }
        Ok(())
    }

    /// The id of the pack at `at` of the listing.
    fn pack_id(&self, at: u32) -> Option<&str> {
        match self {
            Presence::Listed {
                packed: Some(p), ..
            } => p.ids.get(at as usize).map(String::as_str),
            _ => None,
        }
    }
}

/// Every blob hash in `store`, or `None` when a prefix holds more than
/// [`MAX_LISTED_PER_PREFIX`].
async fn list_blob_hashes(store: &dyn CheckpointStore) -> Result<Option<HashSet<[u8; 32]>>> {
    let mut listings = futures::stream::iter(0..=255u8)
        .map(|p| async move { store.list_keys(&format!("{BLOB_PREFIX}{p:02x}/")).await })
        .buffer_unordered(LISTINGS_IN_FLIGHT);
    let mut hashes = HashSet::new();
    while let Some(keys) = listings.next().await {
        let keys = keys?;
        if keys.len() > MAX_LISTED_PER_PREFIX {
            return Ok(None);
        }
        for key in keys {
            let mut hash = [0u8; 32];
            // A key of another shape is no chunk of ours: not counted.
            if hex::decode_to_slice(key.rsplit('/').next().unwrap_or_default(), &mut hash).is_ok() {
                hashes.insert(hash);
            }
        }
    }
    Ok(Some(hashes))
}

/// A small file's chunk the uploader holds: its hex hash, digest, content.
type SmallChunk = (String, [u8; 32], Bytes);

/// Uploads chunks the store lacks, within [`IN_FLIGHT_BYTES`] and
/// [`IN_FLIGHT`]: a large file's chunks as blobs, small files' chunks in
/// packs when the run stores many of them ([`PACK_MIN_CHUNKS`]), else as
/// blobs too.
struct Uploader<'s> {
    store: &'s dyn CheckpointStore,
    /// The parent's manifest: its chunks are stored.
    parent: Option<Arc<KnownManifest>>,
    /// The chunks the parent had at the paths this run reads (stored
    /// too): a file read again with the content it had (a racy one, or
    /// one only touched) is not asked about, wherever the parent keeps it.
    parent_at_paths: HashSet<String>,
    /// Chunks this run found or stored (or holds, to store).
    known: HashSet<String>,
    presence: Presence,
    /// Each upload answers whether it stored a chunk, and its size.
    running: FuturesUnordered<harness_core::maybe::BoxFuture<'s, Result<(bool, u64)>>>,
    running_bytes: u64,
    compressing: Arc<futures::lock::Mutex<()>>,
    uploaded: u64,
    uploaded_bytes: Arc<AtomicU64>,
    /// Small files' chunks not yet asked about: asked together, so that
    /// many are answered by one listing of the store.
    held: Vec<SmallChunk>,
    held_bytes: u64,
    /// Small chunks the store lacks, until the run knows whether it packs.
    undecided: Vec<SmallChunk>,
    undecided_bytes: u64,
    /// The run stores enough small chunks to pack them.
    packing: bool,
    pack: PackWriter,
    /// Packs this run wrote, and packs of the store it found chunks in.
    packs: std::collections::BTreeSet<String>,
}

impl<'s> Uploader<'s> {
    fn new(store: &'s dyn CheckpointStore) -> Self {
        Self {
            store,
            parent: None,
            parent_at_paths: HashSet::new(),
            known: HashSet::new(),
            presence: Presence::Head { asked: 0 },
            running: FuturesUnordered::new(),
            running_bytes: 0,
            compressing: Arc::new(futures::lock::Mutex::new(())),
            uploaded: 0,
            uploaded_bytes: Arc::new(AtomicU64::new(0)),
            held: Vec::new(),
            held_bytes: 0,
            undecided: Vec::new(),
            undecided_bytes: 0,
            packing: false,
            pack: PackWriter::default(),
            packs: Default::default(),
        }
    }

    /// Store `chunk` unless known; returns its hash. `small`: the chunk is
    /// a whole file under [`MIN_CHUNK`], which may travel in a pack.
    async fn add(&mut self, chunk: Bytes, small: bool) -> Result<String> {
        let digest: [u8; 32] = Sha256::digest(&chunk).into();
        let hash = hex::encode(digest);
        let in_parent = self.parent_at_paths.contains(&hash)
            || self.parent.as_ref().is_some_and(|p| p.has_chunk(&hash));
        if in_parent || !self.known.insert(hash.clone()) {
            return Ok(hash);
        }
        if small {
            self.held_bytes += chunk.len() as u64;
            self.held.push((hash.clone(), digest, chunk));
            if self.held.len() >= PACK_MIN_CHUNKS || self.held_bytes >= PACK_MIN_BYTES {
                self.settle_held().await?;
            }
            return Ok(hash);
        }
        // Whether to ask the store with a `HEAD` (`None`), or what its
        // listing says.
        let listed = self.presence.listed(self.store, &digest).await?;
        match listed {
            Some(Stored::Blob) => {}
            Some(Stored::Pack(at)) => self.use_pack(at),
            Some(Stored::Absent) | None => {
                self.upload_blob(hash.clone(), chunk, listed.is_none())
                    .await?
            }
        }
        Ok(hash)
    }

    /// Ask the store about the held chunks, and pack or hold those it
    /// lacks.
    async fn settle_held(&mut self) -> Result<()> {
        let held = std::mem::take(&mut self.held);
        let many = held.len() >= PACK_MIN_CHUNKS || self.held_bytes >= PACK_MIN_BYTES;
        self.held_bytes = 0;
        if many {
            self.presence.list_now(self.store).await?;
        }
        let mut ask = Vec::new();
        for chunk in held {
            match self.presence.listed(self.store, &chunk.1).await? {
                Some(Stored::Blob) => {}
                Some(Stored::Pack(at)) => self.use_pack(at),
                Some(Stored::Absent) => self.hold_absent(chunk),
                None => ask.push(chunk),
            }
        }
        // A few chunks with no listing: a `HEAD` each.
        for chunk in lacking_blobs(self.store, ask, |c: &SmallChunk| c.0.as_str()).await? {
            self.hold_absent(chunk);
        }
        if !self.packing
            && (self.undecided.len() >= PACK_MIN_CHUNKS || self.undecided_bytes >= PACK_MIN_BYTES)
        {
            self.packing = true;
        }
        if self.packing {
            self.undecided_bytes = 0;
            for (_, digest, chunk) in std::mem::take(&mut self.undecided) {
                self.pack_chunk(digest, chunk).await?;
            }
        }
        Ok(())
    }

    fn hold_absent(&mut self, chunk: SmallChunk) {
        self.undecided_bytes += chunk.2.len() as u64;
        self.undecided.push(chunk);
    }

    fn use_pack(&mut self, at: u32) {
        if let Some(id) = self.presence.pack_id(at) {
            self.packs.insert(id.to_string());
        }
    }

    /// Compress `chunk` into the pack being filled; seal it when full.
    async fn pack_chunk(&mut self, digest: [u8; 32], chunk: Bytes) -> Result<()> {
        let frame = compressed(chunk).await?;
        self.uploaded += 1;
        self.uploaded_bytes
            .fetch_add(frame.len() as u64, Ordering::Relaxed);
        self.pack.push(digest, &frame);
        if self.pack.len() >= PACK_TARGET_BYTES {
            self.seal_pack().await?;
        }
        Ok(())
    }

    /// Store the pack being filled, then its index (an index names a pack
    /// that is there).
    async fn seal_pack(&mut self) -> Result<()> {
        if self.pack.is_empty() {
            return Ok(());
        }
        let sealed = std::mem::take(&mut self.pack).seal();
        let len = (sealed.pack.len() + sealed.index.len()) as u64;
        self.uploaded_bytes
            .fetch_add(sealed.index.len() as u64, Ordering::Relaxed);
        self.packs.insert(sealed.id.clone());
        self.make_room(len).await?;
        let store = self.store;
        self.running_bytes += len;
        self.running.push(Box::pin(async move {
            store
                .put(
                    &pack_key(&sealed.id),
                    harness_core::stream::once(sealed.pack),
                )
                .await?;
            store
                .put(
                    &pack_index_key(&sealed.id),
                    harness_core::stream::once(sealed.index),
                )
                .await?;
            // Its chunks were counted as they were packed.
            Ok((false, len))
        }));
        Ok(())
    }

    /// Upload `chunk` as a blob (after a `HEAD`, when `ask_first`, to see
    /// whether the store has it).
    async fn upload_blob(&mut self, hash: String, chunk: Bytes, ask_first: bool) -> Result<()> {
        let len = chunk.len() as u64;
        self.make_room(len).await?;
        let store = self.store;
        let key = blob_key(&hash);
        let bytes = self.uploaded_bytes.clone();
        let compressing = self.compressing.clone();
        self.running_bytes += len;
        self.running.push(Box::pin(async move {
            if ask_first {
                match store.head(&key).await {
                    Ok(_) => return Ok((false, len)),
                    Err(e) if e.kind() == ErrorKind::NotFound => {}
                    Err(e) => return Err(e),
                }
            }
            // One zstd encoder at a time: each holds a few MiB of
            // tables whatever the chunk's size, and the uploads share
            // one task, so more would only add memory, not speed.
            let packed = {
                let _one = compressing.lock().await;
                compressed(chunk).await?
            };
            bytes.fetch_add(packed.len() as u64, Ordering::Relaxed);
            store.put(&key, harness_core::stream::once(packed)).await?;
            Ok((true, len))
        }));
        Ok(())
    }

    /// Wait until `len` more bytes fit in flight.
    async fn make_room(&mut self, len: u64) -> Result<()> {
        while !self.running.is_empty()
            && (self.running.len() >= IN_FLIGHT || self.running_bytes + len > IN_FLIGHT_BYTES)
        {
            self.reap_one().await?;
        }
        Ok(())
    }

    async fn reap_one(&mut self) -> Result<()> {
        if let Some(done) = self.running.next().await {
            let (stored, len) = done?;
            self.running_bytes -= len;
            if stored {
                self.uploaded += 1;
            }
        }
        Ok(())
    }

    /// Store what is held (packed, or as blobs when the run has too few
    /// small chunks to pack) and wait for every upload.
    async fn finish(&mut self) -> Result<()> {
        self.settle_held().await?;
        if self.packing {
            self.seal_pack().await?;
        } else {
            self.undecided_bytes = 0;
            for (hash, _, chunk) in std::mem::take(&mut self.undecided) {
                self.upload_blob(hash, chunk, false).await?;
            }
        }
        while !self.running.is_empty() {
            self.reap_one().await?;
        }
        Ok(())
    }
}

/// Cuts one file's content into content-defined chunks as it arrives.
struct Chunker {
    buf: BytesMut,
}

impl Chunker {
    fn cut(&self, all: bool) -> Option<usize> {
        if self.buf.is_empty() || (!all && self.buf.len() < MAX_CHUNK) {
            return None;
        }
        let cdc = fastcdc::v2020::FastCDC::new(&self.buf, MIN_CHUNK, AVG_CHUNK, MAX_CHUNK);
        let (_, len) = cdc.cut(0, self.buf.len());
        Some(len.max(1).min(self.buf.len()))
    }
}

/// Take a tar stream apart into entries, storing file content as chunks.
async fn read_tar(
    mut tar: ByteStream,
    uploader: &mut Uploader<'_>,
    stats: &mut TreeCheckpointInfo,
    progress: Option<&dyn MoveProgress>,
) -> Result<Vec<TreeEntry>> {
    enum Item {
        Entry(TarEntry),
        Data(Bytes),
    }
    // The export is the sandbox's own tree: symlinks may point anywhere
    // (they are judged again, by the full rules, on restore).
    let mut scanner = TarScanner::new().outward_symlinks();
    let mut entries: Vec<TreeEntry> = Vec::new();
    let mut by_path: HashMap<String, usize> = HashMap::new();
    let mut current: Option<(TreeEntry, u64)> = None;
    let mut chunker = Chunker {
        buf: BytesMut::new(),
    };
    while let Some(chunk) = tar.next().await {
        let chunk = chunk?;
        if let Some(p) = progress {
            p.advance(MovePhase::Export, chunk.len() as u64);
        }
        let mut items = Vec::new();
        scanner.push_entries(&chunk, &mut |item| {
            items.push(match item {
                TarItem::Entry(e) => Item::Entry(e),
                TarItem::Data(d) => Item::Data(chunk.slice_ref(d)),
            });
            Ok(())
        })?;
        for item in items {
            match item {
                Item::Entry(entry) => {
                    let (kind, target, chunks, size) = match entry.kind {
                        TarKind::File => (TreeKind::File, None, Vec::new(), entry.size),
                        TarKind::Dir => (TreeKind::Dir, None, Vec::new(), 0),
                        TarKind::Symlink { target } => {
                            (TreeKind::Symlink, Some(target), Vec::new(), 0)
                        }
                        TarKind::Hardlink { target } => {
                            let original = by_path
                                .get(&target)
                                .map(|&i| &entries[i])
                                .filter(|e| e.kind == TreeKind::File)
                                .ok_or_else(|| {
                                    Error::corrupt(format!(
                                        "hard link {:?} to {target:?}, which the export did not hold before it",
                                        entry.path
                                    ))
                                })?;
                            (TreeKind::File, None, original.chunks.clone(), original.size)
                        }
                    };
                    if entry.path.is_empty() {
                        continue;
                    }
                    let tree_entry = TreeEntry {
                        path: entry.path,
                        kind,
                        mode: entry.mode,
                        size,
                        mtime: entry.mtime,
                        chunks,
                        target,
                        ino: 0,
                        ctime_ns: 0,
                    };
                    if tree_entry.kind == TreeKind::File && tree_entry.chunks.is_empty() {
                        stats.files_read += 1;
                        if tree_entry.size > 0 {
                            current = Some((tree_entry, 0));
                            continue;
                        }
                    }
                    by_path.insert(tree_entry.path.clone(), entries.len());
                    entries.push(tree_entry);
                }
                Item::Data(data) => {
                    let (entry, got) = current
                        .as_mut()
                        .ok_or_else(|| Error::corrupt("tar data outside a file"))?;
                    *got += data.len() as u64;
                    stats.bytes_read += data.len() as u64;
                    chunker.buf.extend_from_slice(&data);
                    let done = *got == entry.size;
                    // A whole file under the smallest chunk is one chunk,
                    // which may travel in a pack.
                    let small = entry.size < MIN_CHUNK as u64;
                    while let Some(len) = chunker.cut(done) {
                        let piece = chunker.buf.split_to(len).freeze();
                        let hash = uploader.add(piece, small).await?;
                        // `current` is borrowed mutably above; re-borrow.
                        if let Some((entry, _)) = current.as_mut() {
                            entry.chunks.push(hash);
                        }
                    }
                    if done {
                        let (entry, _) = current.take().expect("current file");
                        by_path.insert(entry.path.clone(), entries.len());
                        entries.push(entry);
                    }
                }
            }
        }
    }
    scanner.finish()?;
    if current.is_some() {
        return Err(Error::corrupt("the export ended inside a file"));
    }
    Ok(entries)
}

enum Listing {
    Listed { now: u64, entries: Vec<ListedEntry> },
    Missing,
    Unsupported,
}

/// List `dir`: natively where the provider can
/// ([`Sandbox::list_tree`]), else with GNU `find` inside the sandbox.
async fn list_tree(sandbox: &dyn Sandbox, dir: &str) -> Result<Listing> {
    let mut listing = match sandbox.list_tree(dir).await {
        Ok(listing) => Listing::Listed {
            now: listing.now_secs,
            entries: listing.entries,
        },
        Err(e) if e.kind() == ErrorKind::NotFound => Listing::Missing,
        Err(e) if e.kind() == ErrorKind::Unsupported => find_tree(sandbox, dir).await?,
        Err(e) => return Err(e),
    };
    // In path order, as manifests are: checkpoint and restore pair the
    // two in one pass. One pass here too when the sandbox answered in
    // that order (the local one does).
    if let Listing::Listed { entries, .. } = &mut listing {
        entries.sort_unstable_by(|a, b| a.path.cmp(&b.path));
    }
    Ok(listing)
}

/// List `dir` inside the sandbox with GNU `find`.
async fn find_tree(sandbox: &dyn Sandbox, dir: &str) -> Result<Listing> {
    let script = format!(
        "cd {d} 2>/dev/null || exit {EXIT_NO_DIR}; \
         {{ find . -maxdepth 0 -printf '' && tar --version | grep -q 'GNU tar'; }} >/dev/null 2>&1 || exit {EXIT_NO_GNU_TOOLS}; \
         date +%s; exec find . -mindepth 1 -printf '%y %m %s %T@ %i %C@ %P\\0%l\\0'",
        d = shell_quote(dir)
    );
    let out = collect_exec(sandbox.exec(ExecRequest::shell(script)).await?).await?;
    match out.status.code {
        Some(0) => {}
        Some(EXIT_NO_DIR) => return Ok(Listing::Missing),
        Some(EXIT_NO_GNU_TOOLS) => return Ok(Listing::Unsupported),
        _ => {
            let status = out.status;
            return Err(out
                .check(&format!("listing {dir}"))
                .err()
                .unwrap_or_else(|| {
                    Error::backend(format!("listing {dir}: unexpected exit {status:?}"))
                }));
        }
    }
    let text = &out.stdout[..];
    let newline = text
        .iter()
        .position(|&b| b == b'\n')
        .ok_or_else(|| Error::backend(format!("listing {dir}: no clock reading")))?;
    let now = std::str::from_utf8(&text[..newline])
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .ok_or_else(|| Error::backend(format!("listing {dir}: unreadable clock")))?;
    let mut fields = text[newline + 1..].split(|&b| b == 0);
    let mut entries = Vec::new();
    let bad = || Error::backend(format!("listing {dir}: unreadable find output"));
    while let Some(record) = fields.next() {
        if record.is_empty() {
            break;
        }
        let link = fields.next().ok_or_else(bad)?;
        let record = std::str::from_utf8(record)
            .map_err(|_| Error::unsafe_entry(format!("a path under {dir} is not UTF-8")))?;
        let mut parts = record.splitn(7, ' ');
        let mut next = || parts.next().ok_or_else(bad);
        let kind = next()?.chars().next().ok_or_else(bad)?;
        let mode = u32::from_str_radix(next()?, 8).map_err(|_| bad())?;
        let size = next()?.parse::<u64>().map_err(|_| bad())?;
        let mtime = next()?
            .split('.')
            .next()
            .and_then(|s| s.parse::<u64>().ok())
            .ok_or_else(bad)?;
        let ino = next()?.parse::<u64>().map_err(|_| bad())?;
        let ctime_ns = nanos(next()?).ok_or_else(bad)?;
        let path = next()?.to_string();
        entries.push(ListedEntry {
            kind,
            mode,
            size,
            mtime,
            ino,
            ctime_ns,
            path,
            link: String::from_utf8_lossy(link).into_owned(),
        });
    }
    Ok(Listing::Listed { now, entries })
}

/// `find`'s `%C@` (seconds, a dot, a fraction) as nanoseconds.
fn nanos(text: &str) -> Option<u64> {
    let (secs, frac) = text.split_once('.').unwrap_or((text, ""));
    if !frac.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let secs = secs.parse::<u64>().ok()?;
    let frac = frac.as_bytes();
    let ns = (0..9).fold(0u64, |ns, i| {
        ns * 10 + u64::from(frac.get(i).copied().unwrap_or(b'0') - b'0')
    });
    secs.checked_mul(1_000_000_000)?.checked_add(ns)
}

/// The sandbox's clock, in seconds.
async fn sandbox_now(sandbox: &dyn Sandbox) -> Result<u64> {
    let out = collect_exec(sandbox.exec(ExecRequest::shell("date +%s")).await?)
        .await?
        .check("reading the sandbox's clock")?;
    out.stdout_str()
        .trim()
        .parse()
        .map_err(|_| Error::backend("the sandbox's `date +%s` is not a number"))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LockKind {
    Checkpoint,
    Gc,
}

impl LockKind {
    fn name(self) -> &'static str {
        match self {
            LockKind::Checkpoint => "checkpoint",
            LockKind::Gc => "gc",
        }
    }
}

/// A lock object in the store (see the module docs).
struct Lock {
    key: String,
}

impl Lock {
    async fn take(store: &dyn CheckpointStore, kind: LockKind, clock: &dyn Clock) -> Result<Lock> {
        static NONCE: AtomicU64 = AtomicU64::new(0);
        let now = clock.now_ms();
        let mut h = Sha256::new();
        h.update(now.to_le_bytes());
        h.update(NONCE.fetch_add(1, Ordering::Relaxed).to_le_bytes());
        h.update((&h as *const Sha256 as usize).to_le_bytes());
        let nonce = hex::encode(&h.finalize()[..8]);
        let key = format!("{LOCK_PREFIX}{}-{now}-{nonce}", kind.name());
        store.put(&key, harness_core::stream::empty()).await?;
        let other = match kind {
            LockKind::Checkpoint => LockKind::Gc,
            LockKind::Gc => LockKind::Checkpoint,
        };
        let prefix = format!("{LOCK_PREFIX}{}-", other.name());
        let held = store.list_keys(&prefix).await;
        let live = held.map(|keys| {
            keys.into_iter().find(|held| {
                let started = held[prefix.len()..]
                    .split('-')
                    .next()
                    .and_then(|s| s.parse::<u64>().ok())
                    .unwrap_or(0);
                started.saturating_add(LOCK_TTL_MS) > now
            })
        });
        let lock = Lock { key };
        match live {
            Ok(None) => Ok(lock),
            Ok(Some(held)) => {
                lock.release(store).await;
                Err(Error::conflict(format!(
                    "a {} is running on this store ({}); try again when it is done",
                    match other {
                        LockKind::Gc => "garbage collection",
                        LockKind::Checkpoint => "tree checkpoint",
                    },
                    held
                )))
            }
            Err(e) => {
                lock.release(store).await;
                Err(e)
            }
        }
    }

    async fn release(self, store: &dyn CheckpointStore) {
        if let Err(e) = store.delete(&self.key).await {
            tracing::warn!(key = %self.key, error = %e, "could not remove a checkpoint lock; it expires by itself");
        }
    }
}

/// What [`collect_garbage`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GcInfo {
    /// Tree manifests found.
    pub manifests: u64,
    /// Blobs some manifest references.
    pub blobs_kept: u64,
    /// Blobs deleted.
    pub blobs_deleted: u64,
    /// Packs some manifest names.
    pub packs_kept: u64,
    /// Packs deleted (each with its index).
    pub packs_deleted: u64,
    /// Stored bytes deleted.
    pub bytes_freed: u64,
}

/// Delete the blobs no tree manifest in `store` references. Fails with
/// `Conflict` (deleting nothing) while a tree checkpoint runs.
pub async fn collect_garbage(store: &dyn CheckpointStore, clock: &dyn Clock) -> Result<GcInfo> {
    let lock = Lock::take(store, LockKind::Gc, clock).await?;
    let result = collect_locked(store).await;
    lock.release(store).await;
    result
}

async fn collect_locked(store: &dyn CheckpointStore) -> Result<GcInfo> {
    let mut info = GcInfo::default();
    let mut referenced: HashSet<String> = HashSet::new();
    let mut referenced_packs: HashSet<String> = HashSet::new();
    // Keys alone: a store whose listing carries no hashes would otherwise
    // be asked for each blob's.
    for key in store.list_keys("").await? {
        if [BLOB_PREFIX, LOCK_PREFIX, PACK_PREFIX]
            .iter()
            .any(|p| key.starts_with(p))
        {
            continue;
        }
        match read_manifest(store, &key).await {
            Ok(Some(manifest)) => {
                info.manifests += 1;
                for entry in &manifest.entries {
                    referenced.extend(entry.chunks.iter().cloned());
                }
                referenced_packs.extend(manifest.packs);
            }
            Ok(None) => {}
            // A manifest that cannot be read might reference anything:
            // collecting now could break it further.
            Err(e) => {
                return Err(Error::new(
                    e.kind(),
                    format!(
                        "not collecting: {} could not be read ({})",
                        key,
                        e.message()
                    ),
                ))
            }
        }
    }
    for key in store.list_keys(BLOB_PREFIX).await? {
        let hash = key.rsplit('/').next().unwrap_or_default();
        if referenced.contains(hash) {
            info.blobs_kept += 1;
        } else {
            // The size of what goes, asked of the deleted blobs alone.
            let size = match store.head(&key).await {
                Ok(meta) => meta.size,
                Err(e) if e.kind() == ErrorKind::NotFound => continue,
                Err(e) => return Err(e),
            };
            store.delete(&key).await?;
            info.blobs_deleted += 1;
            info.bytes_freed += size;
        }
    }
    // A pack lives while a manifest names it, whichever of its chunks are
    // still used. Its index goes first: an index names a pack that is
    // there, so a collection stopped halfway leaves a pack without an
    // index (unread, collected next time), never the reverse.
    let keys = store.list_keys(PACK_PREFIX).await?;
    let ids: std::collections::BTreeSet<&str> = keys
        .iter()
        .map(|k| k.rsplit('/').next().unwrap_or_default())
        .map(|name| name.strip_suffix(".idx").unwrap_or(name))
        .filter(|id| is_sha256_hex(id))
        .collect();
    for id in ids {
        if referenced_packs.contains(id) {
            info.packs_kept += 1;
            continue;
        }
        for key in [pack_index_key(id), pack_key(id)] {
            match store.head(&key).await {
                Ok(meta) => {
                    store.delete(&key).await?;
                    info.bytes_freed += meta.size;
                }
                Err(e) if e.kind() == ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
        }
        info.packs_deleted += 1;
    }
    Ok(info)
}

#[cfg(test)]
mod tests {
    use super::*;
    use harness_core::checkpoint::MemoryCheckpointStore;

    /// Paths asked in path order, out of it, twice, and missing ones all
    /// find what a lookup by exact path finds.
    #[test]
    fn a_listing_in_path_order_answers_paths_in_any_order() {
        let listed: Vec<ListedEntry> = ["a", "a-b", "a/x", "b", "c/d", "e"]
            .iter()
            .map(|p| ListedEntry {
                kind: 'f',
                mode: 0o644,
                size: 0,
                mtime: 0,
                ino: 0,
                ctime_ns: 0,
                path: p.to_string(),
                link: String::new(),
            })
            .collect();
        let asks = [
            "0", "a", "a/x", "a0", "b", "a-b", "a-b", "a", "c", "c/d", "zz", "e", "b", "d",
        ];
        let mut lookup = InPathOrder::new(&listed, |l: &ListedEntry| l.path.as_str());
        for ask in asks {
            assert_eq!(
                lookup.get(ask).map(|(i, l)| (i, l.path.as_str())),
                listed
                    .iter()
                    .position(|l| l.path == ask)
                    .map(|i| (i, listed[i].path.as_str())),
                "{ask}"
            );
        }
    }

    fn manifest_of(paths: &[&str]) -> TreeManifest {
        TreeManifest {
            format: FORMAT.to_string(),
            parent: None,
            listed_at: 1,
            entries: paths
                .iter()
                .map(|p| TreeEntry {
                    path: p.to_string(),
                    kind: TreeKind::Dir,
                    mode: 0o755,
                    size: 0,
                    mtime: 1,
                    chunks: vec![],
                    target: None,
                    ino: 0,
                    ctime_ns: 0,
                })
                .collect(),
            deleted: vec![],
            packs: vec![],
        }
    }

    async fn put_manifest(store: &MemoryCheckpointStore, key: &str, m: &TreeManifest) -> String {
        let json = serde_json::to_vec(m).unwrap();
        let packed = harness_core::stream::collect(
            crate::archive::compress_archive(harness_core::stream::once(json), DEFAULT_ZSTD_LEVEL),
            1 << 20,
        )
        .await
        .unwrap();
        store
            .put(key, harness_core::stream::once(packed))
            .await
            .unwrap()
            .sha256
    }

    /// The first `HEADS_BEFORE_LISTING` chunks are to be asked with a
    /// `HEAD`; the next one lists the store, blobs and packs, and every
    /// answer after comes from that listing.
    #[tokio::test]
    async fn presence_asks_with_heads_then_answers_from_one_listing() {
        let store = MemoryCheckpointStore::new();
        let blob = [0xab; 32];
        store
            .put(
                &blob_key(&hex::encode(blob)),
                harness_core::stream::once(&b"x"[..]),
            )
            .await
            .unwrap();
        let mut pack = PackWriter::default();
        pack.push([0xcd; 32], b"frame");
        let sealed = pack.seal();
        store
            .put(
                &pack_key(&sealed.id),
                harness_core::stream::once(sealed.pack),
            )
            .await
            .unwrap();
        store
            .put(
                &pack_index_key(&sealed.id),
                harness_core::stream::once(sealed.index),
            )
            .await
            .unwrap();
        let mut presence = Presence::Head { asked: 0 };
        for _ in 0..HEADS_BEFORE_LISTING {
            assert_eq!(presence.listed(&store, &blob).await.unwrap(), None);
        }
        assert_eq!(
            presence.listed(&store, &blob).await.unwrap(),
            Some(Stored::Blob)
        );
        assert_eq!(
            presence.listed(&store, &[0xcd; 32]).await.unwrap(),
            Some(Stored::Pack(0))
        );
        assert_eq!(presence.pack_id(0), Some(sealed.id.as_str()));
        assert_eq!(
            presence.listed(&store, &[0x01; 32]).await.unwrap(),
            Some(Stored::Absent)
        );
    }

    /// A kept manifest is found by its object's hash; the key holding
    /// another object is read again; nothing is kept under a hash that is
    /// not one; the least recently used goes first.
    #[tokio::test]
    async fn manifests_are_kept_by_the_hash_of_their_object() {
        let store = MemoryCheckpointStore::new();
        let first = manifest_of(&["a", "b"]);
        let sha1 = put_manifest(&store, "kept/t", &first).await;
        let loaded = load_manifest(&store, "kept/t").await.unwrap().unwrap();
        assert_eq!(loaded.manifest, first);
        let again = load_manifest(&store, "kept/t").await.unwrap().unwrap();
        assert!(Arc::ptr_eq(&loaded, &again), "the second load parsed again");
        // The key now holds another manifest: its hash differs, it is read.
        let second = manifest_of(&["c"]);
        let sha2 = put_manifest(&store, "kept/t", &second).await;
        assert_ne!(sha1, sha2);
        let reloaded = load_manifest(&store, "kept/t").await.unwrap().unwrap();
        assert_eq!(reloaded.manifest, second);
        assert!(known::get(&sha1).is_some() && known::get(&sha2).is_some());

        known::put(
            "not-a-hash",
            Arc::new(KnownManifest::new(manifest_of(&["x"]))),
        );
        assert!(known::get("not-a-hash").is_none());
        let shas: Vec<String> = (0..=known::CACHED_MANIFESTS)
            .map(|i| format!("{i:064x}"))
            .collect();
        for sha in &shas {
            known::put(sha, Arc::new(KnownManifest::new(manifest_of(&["y"]))));
        }
        assert!(known::get(&shas[0]).is_none(), "the oldest was not dropped");
        assert!(known::get(&shas[known::CACHED_MANIFESTS]).is_some());
        let huge = manifest_of(&vec!["z"; known::CACHED_ENTRIES + 1]);
        let huge_sha = format!("{:064x}", 99);
        known::put(&huge_sha, Arc::new(KnownManifest::new(huge)));
        assert!(
            known::get(&huge_sha).is_none(),
            "a manifest over the bound was kept"
        );
    }

    /// A kept manifest is given up to a checkpoint only when nothing else
    /// holds it; else it stays kept.
    #[test]
    fn a_kept_manifest_is_taken_only_by_its_sole_holder() {
        // (Other tests keep manifests at the same time and may push this
        // one out of the cache: nothing here depends on it staying.)
        let sha = format!("{:064x}", 0x7a6b_5c4d_u64);
        let mine = Arc::new(KnownManifest::new(manifest_of(&["p"])));
        known::put(&sha, mine.clone());
        let theirs = mine.clone();
        let mine = known::take_sole(mine).expect_err("another holder has it");
        if let Some(kept) = known::get(&sha) {
            assert!(Arc::ptr_eq(&kept, &mine), "it stays kept as it was");
        }
        drop(theirs);
        let sole = known::take_sole(mine).expect("the caller holds it alone");
        assert_eq!(sole.manifest, manifest_of(&["p"]));
        assert!(known::get(&sha).is_none(), "it was taken out");
    }

    /// The stored manifest's frames, decompressed, are byte for byte what
    /// serde makes of the whole manifest (and so parse back to it), with no
    /// entry, fewer than a frame, and many frames.
    #[tokio::test]
    async fn a_manifest_in_frames_is_the_serde_json() {
        let paths: Vec<String> = (0..FRAME_MAX_ENTRIES * 3 + 3)
            .map(|i| format!("d{i}"))
            .collect();
        for n in [0, 5, paths.len()] {
            let refs: Vec<&str> = paths[..n].iter().map(String::as_str).collect();
            let mut m = manifest_of(&refs);
            if n > 0 {
                m.parent = Some("ckpt/1".into());
                m.deleted = manifest_of(&["gone"]).entries;
            }
            let whole = serde_json::to_vec(&m).unwrap();
            let (object, frames) = encode_manifest(&m, &vec![NEW_ENTRY; n], None)
                .await
                .unwrap();
            assert_eq!(frames.iter().map(|f| f.len).sum::<usize>(), n);
            if n == paths.len() {
                assert!(frames.len() > 3, "{} frames", frames.len());
            }
            let json = harness_core::stream::collect(
                decompress(harness_core::stream::once(object)),
                usize::MAX,
            )
            .await
            .unwrap();
            assert_eq!(
                String::from_utf8_lossy(&json),
                String::from_utf8_lossy(&whole),
                "{n} entries"
            );
            let back: TreeManifest = serde_json::from_slice(&json).unwrap();
            assert_eq!(back, m);
        }
    }

    /// A manifest written against its parent reuses the parent's frames
    /// for the runs of entries that did not change, also after a path was
    /// added or removed before them, and is still the serde JSON of the
    /// whole manifest.
    #[tokio::test]
    async fn unchanged_runs_of_entries_reuse_the_parents_frames() {
        let paths: Vec<String> = (0..20_000).map(|i| format!("src/f{i:05}.rs")).collect();
        let refs: Vec<&str> = paths.iter().map(String::as_str).collect();
        let parent = manifest_of(&refs);
        let n = parent.entries.len();
        let (_, frames) = encode_manifest(&parent, &vec![NEW_ENTRY; n], None)
            .await
            .unwrap();
        let written = frames.len();
        assert!(written >= 10, "{written} frames");
        // The parent's frames recompressed at another level: the same
        // JSON in bytes no new encoding makes, so a frame found in the
        // output was copied from the parent.
        let mut marked = Vec::new();
        for frame in frames {
            let json = harness_core::stream::collect(
                decompress(harness_core::stream::once(frame.bytes)),
                usize::MAX,
            )
            .await
            .unwrap();
            let bytes = harness_core::stream::collect(
                compress(harness_core::stream::once(json), 9),
                usize::MAX,
            )
            .await
            .unwrap();
            marked.push(EntryFrame { bytes, ..frame });
        }
        let parent = KnownManifest::with_frames(parent, marked);
        let reused = |ours: &[EntryFrame]| {
            ours.iter()
                .filter(|f| parent.frames.iter().any(|p| p.bytes == f.bytes))
                .count()
        };
        // One entry changed in the middle; then one path added near the
        // start and one removed near the end.
        let mut changed = parent.manifest.clone();
        changed.entries[10_000].mode = 0o600;
        let mut origins: Vec<u32> = (0..n as u32).collect();
        origins[10_000] = NEW_ENTRY;
        let mut shifted = parent.manifest.clone();
        let mut shifted_origins: Vec<u32> = (0..n as u32).collect();
        shifted
            .entries
            .insert(100, manifest_of(&["src/f00099a.rs"]).entries[0].clone());
        shifted_origins.insert(100, NEW_ENTRY);
        shifted.entries.remove(19_000);
        shifted_origins.remove(19_000);
        for (m, origins, most_new) in [(changed, origins, 1), (shifted, shifted_origins, 3)] {
            let (object, ours) = encode_manifest(&m, &origins, Some(&parent)).await.unwrap();
            let new = ours.len() - reused(&ours);
            assert!(
                (1..=most_new).contains(&new),
                "{new} of {} frames written anew ({written} in the parent)",
                ours.len()
            );
            let json = harness_core::stream::collect(
                decompress(harness_core::stream::once(object)),
                usize::MAX,
            )
            .await
            .unwrap();
            assert!(json == serde_json::to_vec(&m).unwrap());
        }
        // Without origins nothing is reused.
        let (_, ours) = encode_manifest(&parent.manifest, &vec![NEW_ENTRY; n], Some(&parent))
            .await
            .unwrap();
        assert_eq!(reused(&ours), 0);
    }

    /// The chunk set answers for the manifest's chunks only.
    #[test]
    fn a_kept_manifest_knows_its_chunks() {
        let hash = "ab".repeat(32);
        let mut m = manifest_of(&[]);
        m.entries.push(TreeEntry {
            path: "f".into(),
            kind: TreeKind::File,
            mode: 0o644,
            size: 1,
            mtime: 1,
            chunks: vec![hash.clone()],
            target: None,
            ino: 0,
            ctime_ns: 0,
        });
        let known = KnownManifest::new(m);
        assert!(known.has_chunk(&hash));
        assert!(!known.has_chunk(&"cd".repeat(32)));
        assert!(!known.has_chunk("not hex"));
        assert!(known.admitted().is_ok());
    }

    #[test]
    fn find_times_read_as_nanoseconds() {
        assert_eq!(
            nanos("1796144891.1234567890"),
            Some(1_796_144_891_123_456_789)
        );
        assert_eq!(nanos("12.5"), Some(12_500_000_000));
        assert_eq!(nanos("12"), Some(12_000_000_000));
        assert_eq!(nanos("12.x"), None);
        assert_eq!(nanos("-1.0"), None);
    }

    #[test]
    fn headers_round_trip_through_the_scanner() {
        let long = "d/".repeat(80) + "file";
        let entries = [
            TreeEntry {
                path: "a".into(),
                kind: TreeKind::Dir,
                mode: 0o755,
                size: 0,
                mtime: 7,
                chunks: vec![],
                target: None,
                ino: 0,
                ctime_ns: 0,
            },
            TreeEntry {
                path: long.clone(),
                kind: TreeKind::File,
                mode: 0o644,
                size: 3,
                mtime: 9,
                chunks: vec![],
                target: None,
                ino: 0,
                ctime_ns: 0,
            },
            TreeEntry {
                path: "a/l".into(),
                kind: TreeKind::Symlink,
                mode: 0o777,
                size: 0,
                mtime: 9,
                chunks: vec![],
                target: Some("../".repeat(40) + "x"),
                ino: 0,
                ctime_ns: 0,
            },
        ];
        let mut tar = Vec::new();
        tar.extend_from_slice(&tar_header(&entries[0]).unwrap());
        tar.extend_from_slice(&tar_header(&entries[1]).unwrap());
        tar.extend_from_slice(b"abc");
        tar.extend_from_slice(&[0u8; 509]);
        tar.extend_from_slice(&tar_header(&entries[2]).unwrap());
        tar.extend_from_slice(&[0u8; 1024]);
        let mut seen = Vec::new();
        let mut data = Vec::new();
        let mut scanner = TarScanner::new().outward_symlinks();
        scanner
            .push_entries(&tar, &mut |item| {
                match item {
                    TarItem::Entry(e) => seen.push(e),
                    TarItem::Data(d) => data.extend_from_slice(d),
                }
                Ok(())
            })
            .unwrap();
        scanner.finish().unwrap();
        assert_eq!(data, b"abc");
        assert_eq!(
            seen.iter().map(|e| e.path.as_str()).collect::<Vec<_>>(),
            ["a", long.as_str(), "a/l"]
        );
        assert_eq!(seen[1].mtime, 9);
        assert_eq!(seen[1].size, 3);
        assert_eq!(
            seen[2].kind,
            TarKind::Symlink {
                target: "../".repeat(40) + "x"
            }
        );
        // The full rules refuse that symlink, as a manifest restore would.
        let mut strict = TarScanner::new();
        let e = &entries[2];
        assert!(strict
            .admit(&e.path, &e.tar_kind(), e.mode, e.size)
            .is_err());
    }

    #[test]
    fn the_chunker_cuts_large_content_at_content_defined_points() {
        let mut content = Vec::new();
        let mut x: u64 = 1;
        for _ in 0..(10 * 1024 * 1024) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            content.push(x as u8);
        }
        let cuts = |content: &[u8]| {
            let mut chunker = Chunker {
                buf: BytesMut::from(content),
            };
            let mut out = Vec::new();
            while let Some(len) = chunker.cut(true) {
                out.push(chunker.buf.split_to(len).freeze());
            }
            out
        };
        let a = cuts(&content);
        assert!(a.len() >= 3, "10 MiB in {} chunks", a.len());
        assert!(a.iter().all(|c| c.len() <= MAX_CHUNK));
        // One byte changed in the middle: most chunks are the same.
        content[5 * 1024 * 1024] ^= 0xff;
        let b = cuts(&content);
        let same = b.iter().filter(|c| a.contains(c)).count();
        assert!(
            same + 2 >= b.len(),
            "{same} of {} chunks unchanged",
            b.len()
        );
    }

    /// The reused contexts: frames round-trip whatever came before them
    /// (a failed decode included), several frames read as one content,
    /// and what is not a chunk is refused as corrupt, naming where.
    #[cfg(feature = "zstd")]
    #[test]
    fn chunk_contexts_are_reused_safely() {
        let small = b"a small file\n".repeat(3);
        let large: Vec<u8> = (0..3_000_000u32).map(|i| (i * 7 % 251) as u8).collect();
        for content in [&small[..], &large[..], &[][..]] {
            let frame = chunk_zstd::compress(content, DEFAULT_ZSTD_LEVEL).unwrap();
            let back = chunk_zstd::decompress(&frame, MAX_CHUNK, "blob x").unwrap();
            assert_eq!(&back[..], content);
        }

        // A frame cut short, then a good one on the same thread's context.
        let frame = chunk_zstd::compress(&large, DEFAULT_ZSTD_LEVEL).unwrap();
        let err =
            chunk_zstd::decompress(&frame[..frame.len() / 2], MAX_CHUNK, "blob cut").unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");
        assert!(err.to_string().contains("blob cut"), "{err}");
        let back = chunk_zstd::decompress(&frame, MAX_CHUNK, "blob x").unwrap();
        assert_eq!(&back[..], &large[..]);

        // Two frames end to end are their contents end to end.
        let mut two = chunk_zstd::compress(&small, DEFAULT_ZSTD_LEVEL)
            .unwrap()
            .to_vec();
        two.extend_from_slice(&chunk_zstd::compress(b"and more", 3).unwrap());
        let back = chunk_zstd::decompress(&two, MAX_CHUNK, "blob two").unwrap();
        assert_eq!(back.len(), small.len() + 8);
        assert!(back.ends_with(b"and more"));

        // Past the limit, and not zstd at all.
        let err = chunk_zstd::decompress(&frame, 1_000_000, "blob big").unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");
        assert!(err.to_string().contains("inflates past"), "{err}");
        let err = chunk_zstd::decompress(b"plain text", MAX_CHUNK, "blob plain").unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");
    }
}
