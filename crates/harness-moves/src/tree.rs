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
//!
//! [`Sandbox::list_tree`]: harness_core::sandbox::Sandbox::list_tree
//! [`Sandbox::export_paths_tar`]: harness_core::sandbox::Sandbox::export_paths_tar
//! [`TarScanner`]: harness_core::tarscan::TarScanner

use serde::{Deserialize, Serialize};

use harness_core::checkpoint::ObjectMeta;
use harness_core::sandbox::ListedEntry;
use harness_core::tarscan::{ScanSummary, TarKind};

mod checkpoint;
mod chunks;
mod gc;
mod listing;
mod manifest;
mod packs;
mod restore;
mod upload;

pub use checkpoint::{checkpoint_tree, checkpoint_tree_excluding};
pub use gc::{collect_garbage, GcInfo};
pub use manifest::read_manifest;
pub use packs::{index_key as pack_index_key, pack_key};
pub use restore::{restore_manifest, restore_tree};

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
    manifest::known::clear();
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
    /// Tar streams the entries were sent in: 1, or more when the sandbox
    /// takes several at once and there were many files (0: none needed).
    pub streams: u64,
}

fn chunk_bytes(hex_hash: &str) -> Option<[u8; 32]> {
    let mut out = [0u8; 32];
    hex::decode_to_slice(hex_hash, &mut out).ok()?;
    Some(out)
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

/// 64 hex digits. Every byte is looked at (no early exit), which the
/// compiler turns into a few vector instructions: the check byte by byte
/// took most of a manifest's admission (20,000 hashes).
fn is_sha256_hex(h: &str) -> bool {
    h.len() == 64 && h.bytes().fold(true, |ok, b| ok & b.is_ascii_hexdigit())
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
