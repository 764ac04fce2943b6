//! Making a tree checkpoint: the tree listed beside the parent's manifest,
//! the files that changed read out of the sandbox as one tar and cut into
//! chunks, the manifest put together and stored.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use futures::StreamExt;

use super::gc::{Lock, LockKind};
use super::listing::{list_tree, sandbox_now, Listing};
use super::manifest::{encode_manifest, known, load_manifest, KnownManifest, NEW_ENTRY};
use super::upload::Uploader;
use super::{
    InPathOrder, TreeCheckpointInfo, TreeEntry, TreeKind, TreeManifest, AVG_CHUNK, BLOB_PREFIX,
    FORMAT, LOCK_PREFIX, MAX_CHUNK, MIN_CHUNK, PACK_PREFIX,
};
use crate::archive::{MovePhase, MoveProgress};
use harness_core::checkpoint::{validate_key, CheckpointStore, ObjectMeta};
use harness_core::clock::Clock;
use harness_core::sandbox::{ListedEntry, Sandbox};
use harness_core::stream::ByteStream;
use harness_core::tarscan::{TarEntry, TarItem, TarKind, TarScanner};
use harness_core::turn_checkpoint::PathRules;
use harness_core::{Error, Result};

/// Checkpoint `dir` of `sandbox` into `store` under `key` as a tree
/// checkpoint, against `parent` (the key of an earlier tree checkpoint of
/// the same tree) when given. See the module docs.
pub async fn checkpoint_tree(
    sandbox: &dyn Sandbox,
    dir: &str,
    store: &dyn CheckpointStore,
    key: &str,
    parent: Option<&str>,
    clock: &dyn Clock,
    progress: Option<Arc<dyn MoveProgress>>,
) -> Result<TreeCheckpointInfo> {
    let keep_all = PathRules::default();
    checkpoint_tree_excluding(sandbox, dir, store, key, parent, clock, progress, &keep_all).await
}

/// [`checkpoint_tree`] leaving out the entries `rules` exclude (and
/// everything under an excluded directory). The rules apply to what the
/// provider lists or exports, so every provider leaves out the same paths;
/// an entry of the parent now excluded is recorded as deleted. Without a
/// parent, a tree that cannot be listed is exported whole and filtered
/// after (its excluded content is read, not stored).
#[allow(clippy::too_many_arguments)]
#[tracing::instrument(name = "checkpoint_tree", skip_all, fields(key = %key, dir = %dir))]
pub async fn checkpoint_tree_excluding(
    sandbox: &dyn Sandbox,
    dir: &str,
    store: &dyn CheckpointStore,
    key: &str,
    parent: Option<&str>,
    clock: &dyn Clock,
    progress: Option<Arc<dyn MoveProgress>>,
    rules: &PathRules,
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
        Ok((mut listing, parent_manifest)) => {
            if let Listing::Listed { entries, .. } = &mut listing {
                entries.retain(|e| !rules.excludes(&e.path));
            }
            checkpoint_locked(
                sandbox,
                dir,
                store,
                key,
                parent,
                listing,
                parent_manifest,
                progress,
                rules,
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

/// [`checkpoint_tree`] with the lock held, the tree listed and the parent
/// read: the tree read (whole, or against the parent), its chunks
/// uploaded, what is gone from the parent recorded, the manifest stored.
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
    rules: &PathRules,
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
        Listing::Listed { now, entries } if has_parent => {
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
        // Every entry new: no parent, or a sandbox that cannot list (read
        // whole from its tar).
        listing => {
            let (now, listed) = match listing {
                Listing::Listed { now, entries } => (now, entries),
                _ => (sandbox_now(sandbox).await?, Vec::new()),
            };
            let mut read = read_whole_tree(
                sandbox,
                dir,
                &listed,
                &mut uploader,
                &mut stats,
                progress.as_deref(),
            )
            .await?;
            read.retain(|e| !rules.excludes(&e.path));
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
