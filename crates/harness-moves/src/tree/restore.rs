//! Restoring a tree checkpoint: the chunks located (packs or blobs) and
//! checked before anything is written, the entries the target lacks sent
//! to it as tar (one stream, or several side by side for a sandbox that
//! writes on several cores: [`Sandbox::parallel_imports`]), then the
//! deleted paths removed.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use futures::{SinkExt, StreamExt};

use super::chunks::{
    fetch_chunk, lacking_blobs, list_blob_hashes, unpack_chunk, HEADS_BEFORE_LISTING,
};
use super::listing::{list_tree, Listing};
use super::manifest::{admit, load_manifest};
use super::packs::{self, pack_key, PackIndex, PACK_READ_MAX};
use super::{
    blob_key, chunk_bytes, InPathOrder, TreeEntry, TreeKind, TreeManifest, TreeRestoreInfo,
    IN_FLIGHT, IN_FLIGHT_BYTES, MAX_CHUNK,
};
use crate::archive::{MovePhase, MoveProgress};
use harness_core::checkpoint::{validate_key, CheckpointStore};
use harness_core::sandbox::{collect_exec, shell_quote, ExecRequest, ListedEntry, Sandbox};
use harness_core::tarscan::ScanSummary;
use harness_core::{Error, ErrorKind, Result};

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
    let mut streams = 0;
    if !needed.is_empty() {
        let ordered = tar_order(&needed, &located);
        let ways = sandbox.parallel_imports().min(MAX_IMPORT_PARTS);
        let target = ImportTarget {
            store,
            located: &located,
            packs: &manifest.packs,
            sandbox,
            dir,
            progress: progress.clone(),
        };
        match split_for_import(&ordered, ways) {
            None => {
                streams = 1;
                target.import(&ordered).await?
            }
            Some(split) => {
                streams = split.parts.len() as u64
                    + u64::from(!split.dirs.is_empty())
                    + u64::from(!split.symlinks.is_empty());
                // Directories first, so that every part finds its files'
                // directories; the parts side by side; symlinks last, as
                // in one stream.
                target.import(split.dirs).await?;
                let parts = futures::future::join_all(split.parts.iter().map(|p| target.import(p)));
                parts.await.into_iter().collect::<Result<Vec<()>>>()?;
                target.import(split.symlinks).await?;
            }
        }
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
        streams,
    })
}

/// Where a restore's tar streams go, and what they are made from.
struct ImportTarget<'a> {
    store: &'a dyn CheckpointStore,
    located: &'a HashMap<&'a str, Loc>,
    packs: &'a [String],
    sandbox: &'a dyn Sandbox,
    dir: &'a str,
    progress: Option<Arc<dyn MoveProgress>>,
}

impl ImportTarget<'_> {
    /// One tar stream of `ordered` (in [`tar_order`]); none when empty.
    async fn import(&self, ordered: &[&TreeEntry]) -> Result<()> {
        if ordered.is_empty() {
            return Ok(());
        }
        let (tx, rx) = futures::channel::mpsc::channel::<Result<Bytes>>(8);
        let produce = produce_tar(
            self.store,
            ordered,
            self.located,
            self.packs,
            tx,
            self.progress.clone(),
        );
        let import = self.sandbox.import_tar(self.dir, Box::pin(rx));
        let (produced, imported) = futures::join!(produce, import);
        // The producer's error is the cause when both failed.
        produced?;
        imported
    }
}

/// The most streams one restore sends at once, whatever the sandbox
/// takes: each holds its own chunks in flight.
const MAX_IMPORT_PARTS: usize = 4;

/// Below this many files a restore sends one stream: each part costs a
/// stream's setup (an exec, in a container).
const SPLIT_MIN_FILES: usize = 512;

/// A restore's entries split for a sandbox that imports several streams
/// at once ([`Sandbox::parallel_imports`]).
struct ImportSplit<'s, 'e> {
    dirs: &'s [&'e TreeEntry],
    /// The files, in runs of [`tar_order`] (so a part still reads its
    /// packs in ranges) of about equal cost.
    parts: Vec<&'s [&'e TreeEntry]>,
    symlinks: &'s [&'e TreeEntry],
}

/// How `ordered` (in [`tar_order`]: directories, files, symlinks) is sent
/// to a sandbox taking `ways` imports at once; `None`: as one stream —
/// one way, few files, or a directory its owner may not write (a part
/// would find it locked; one stream unlocks it until its end).
fn split_for_import<'s, 'e>(
    ordered: &'s [&'e TreeEntry],
    ways: usize,
) -> Option<ImportSplit<'s, 'e>> {
    let dirs_end = ordered.partition_point(|e| e.kind == TreeKind::Dir);
    let files_end = dirs_end + ordered[dirs_end..].partition_point(|e| e.kind == TreeKind::File);
    let files = &ordered[dirs_end..files_end];
    let locked_dir = ordered[..dirs_end].iter().any(|e| e.mode & 0o200 == 0);
    if ways < 2 || files.len() < SPLIT_MIN_FILES || locked_dir {
        return None;
    }
    // A file costs its bytes and a fixed amount for its creation.
    let cost = |e: &TreeEntry| e.size + 16 * 1024;
    let total: u64 = files.iter().map(|e| cost(e)).sum();
    let share = total.div_ceil(ways as u64);
    let mut parts = Vec::with_capacity(ways);
    let (mut start, mut acc) = (0, 0);
    for (i, e) in files.iter().enumerate() {
        acc += cost(e);
        if acc >= share && parts.len() + 1 < ways {
            parts.push(&files[start..=i]);
            (start, acc) = (i + 1, 0);
        }
    }
    if start < files.len() {
        parts.push(&files[start..]);
    }
    Some(ImportSplit {
        dirs: &ordered[..dirs_end],
        parts,
        symlinks: &ordered[files_end..],
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
    let heads: Vec<_> = used
        .into_iter()
        .map(|at| async move {
            let id = &packs[at as usize];
            (at, store.head(&pack_key(id)).await)
        })
        .collect();
    let mut heads = futures::stream::iter(heads).buffer_unordered(IN_FLIGHT);
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

/// Gap between two packed chunks one read may span (read and dropped):
/// cheaper than a second request.
const PACK_READ_GAP: u64 = 64 * 1024;

/// Send `ordered` (in [`tar_order`]) as a tar stream, chunks fetched ahead
/// in order within [`IN_FLIGHT_BYTES`] and [`IN_FLIGHT`] ([`tar_units`]).
async fn produce_tar(
    store: &dyn CheckpointStore,
    ordered: &[&TreeEntry],
    located: &HashMap<&str, Loc>,
    packs: &[String],
    mut tx: futures::channel::mpsc::Sender<Result<Bytes>>,
    progress: Option<Arc<dyn MoveProgress>>,
) -> Result<()> {
    // Units in order, run ahead within the byte and request budgets.
    let mut units = tar_units(ordered, located).into_iter().peekable();
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
                for bytes in coalesce(pieces) {
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

/// Pieces below this size travel joined (headers, padding, small files'
/// content): one message per unit instead of three per file, each a wake
/// of the importer. Larger pieces go as they are, uncopied.
const JOIN_BELOW: usize = 64 * 1024;

/// `pieces` with each run of small ones ([`JOIN_BELOW`]) joined into one.
fn coalesce(pieces: Vec<Bytes>) -> Vec<Bytes> {
    let mut out = Vec::new();
    let mut joined = BytesMut::new();
    for piece in pieces {
        if piece.len() < JOIN_BELOW {
            joined.extend_from_slice(&piece);
            continue;
        }
        if !joined.is_empty() {
            out.push(joined.split().freeze());
        }
        out.push(piece);
    }
    if !joined.is_empty() {
        out.push(joined.freeze());
    }
    out
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

#[cfg(test)]
mod tests {
    use super::*;
    use harness_core::tarscan::{TarItem, TarKind, TarScanner};

    fn entry(path: &str, kind: TreeKind, mode: u32, size: u64) -> TreeEntry {
        TreeEntry {
            path: path.into(),
            kind,
            mode,
            size,
            mtime: 0,
            chunks: vec![],
            target: None,
            ino: 0,
            ctime_ns: 0,
        }
    }

    #[test]
    fn a_big_restore_splits_into_runs_of_equal_cost_between_dirs_and_symlinks() {
        let mut all = vec![entry("d", TreeKind::Dir, 0o755, 0)];
        // One big file and many small ones: the parts balance bytes and
        // files, not counts.
        all.push(entry("d/big", TreeKind::File, 0o644, 64 << 20));
        for i in 0..3000 {
            all.push(entry(&format!("d/f{i:04}"), TreeKind::File, 0o644, 10_000));
        }
        all.push(entry("link", TreeKind::Symlink, 0o777, 0));
        let ordered: Vec<&TreeEntry> = all.iter().collect();

        let split = split_for_import(&ordered, 4).expect("split");
        assert_eq!(split.dirs.len(), 1);
        assert_eq!(split.symlinks.len(), 1);
        assert!(split.parts.len() >= 2 && split.parts.len() <= 4);
        // The parts are the files, whole and in order.
        let joined: Vec<&str> = split
            .parts
            .iter()
            .flat_map(|p| p.iter().map(|e| e.path.as_str()))
            .collect();
        let files: Vec<&str> = all[1..all.len() - 1]
            .iter()
            .map(|e| e.path.as_str())
            .collect();
        assert_eq!(joined, files);
        assert_eq!(split.parts[0].len(), 1, "the big file is a part's worth");
        // Ways 1, few files, or a locked directory: one stream.
        assert!(split_for_import(&ordered, 1).is_none());
        assert!(split_for_import(&ordered[..100], 4).is_none());
        let mut locked = all.clone();
        locked[0].mode = 0o555;
        let ordered: Vec<&TreeEntry> = locked.iter().collect();
        assert!(split_for_import(&ordered, 4).is_none());
    }

    /// A file costs its creation as well as its bytes: many empty files
    /// weigh as much as a few full ones. And the split starts at exactly
    /// [`SPLIT_MIN_FILES`] files.
    #[test]
    fn a_files_creation_counts_in_the_split_and_the_split_starts_at_its_minimum() {
        let mut all = Vec::new();
        for i in 0..600 {
            all.push(entry(&format!("e{i:03}"), TreeKind::File, 0o644, 0));
        }
        for i in 0..4 {
            all.push(entry(&format!("f{i}"), TreeKind::File, 0o644, 1 << 20));
        }
        let ordered: Vec<&TreeEntry> = all.iter().collect();
        let split = split_for_import(&ordered, 2).expect("two ways");
        let lens: Vec<usize> = split.parts.iter().map(|p| p.len()).collect();
        // 600 × 16 KiB of creation and 4 × (1024 + 16) KiB: half of it is
        // reached at the 430th empty file (were a file its bytes alone,
        // at the second full one).
        assert_eq!(lens, [430, 174]);

        let files: Vec<TreeEntry> = (0..SPLIT_MIN_FILES)
            .map(|i| entry(&format!("f{i:04}"), TreeKind::File, 0o644, 10))
            .collect();
        let ordered: Vec<&TreeEntry> = files.iter().collect();
        assert!(
            split_for_import(&ordered, 2).is_some(),
            "{SPLIT_MIN_FILES} files split"
        );
        assert!(
            split_for_import(&ordered[1..], 2).is_none(),
            "one fewer does not"
        );
    }

    /// When the last part fills exactly at the last file, no empty part
    /// follows it (an empty part would be one more import stream).
    #[test]
    fn a_part_filled_at_the_last_file_is_the_last_part() {
        // One big file worth two shares, then 511 empty files worth
        // exactly one: the second part fills at the very last file.
        let mut all = vec![entry("big", TreeKind::File, 0o644, 16_728_064)];
        for i in 0..511 {
            all.push(entry(&format!("e{i:03}"), TreeKind::File, 0o644, 0));
        }
        let ordered: Vec<&TreeEntry> = all.iter().collect();
        let split = split_for_import(&ordered, 3).expect("three ways");
        let lens: Vec<usize> = split.parts.iter().map(|p| p.len()).collect();
        assert_eq!(lens, [1, 511]);
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

    /// A directory's name ends in `/` (as tar writes one, and as strict
    /// readers expect); a name of exactly 100 bytes fits the header's field
    /// and needs no GNU long name.
    #[test]
    fn header_names_are_as_tar_writes_them() {
        let dir = entry("a/b", TreeKind::Dir, 0o755, 0);
        let header = tar_header(&dir).unwrap();
        assert_eq!(header.len(), 512);
        assert_eq!(&header[..5], b"a/b/\0");
        let hundred = "p".repeat(100);
        let header = tar_header(&entry(&hundred, TreeKind::File, 0o644, 0)).unwrap();
        assert_eq!(header.len(), 512, "one block, no long name");
        assert_eq!(&header[..100], hundred.as_bytes());
        let longer = "p".repeat(101);
        let header = tar_header(&entry(&longer, TreeKind::File, 0o644, 0)).unwrap();
        assert_eq!(
            header.len(),
            512 * 3,
            "a long-name header, its block, the header"
        );
        // A link text of exactly 100 bytes fits too.
        let mut link = entry("l", TreeKind::Symlink, 0o777, 0);
        link.target = Some("t".repeat(100));
        assert_eq!(tar_header(&link).unwrap().len(), 512);
        // A long name of 512 bytes and its NUL take two blocks, and the
        // scanner reads the name back whole.
        let name = "n/".repeat(255) + "fi";
        assert_eq!(name.len(), 512);
        let mut tar = tar_header(&entry(&name, TreeKind::File, 0o644, 0))
            .unwrap()
            .to_vec();
        assert_eq!(tar.len(), 512 * 4);
        tar.extend_from_slice(&[0u8; 1024]);
        let mut paths = Vec::new();
        let mut scanner = TarScanner::new();
        scanner
            .push_entries(&tar, &mut |item| {
                if let TarItem::Entry(e) = item {
                    paths.push(e.path);
                }
                Ok(())
            })
            .unwrap();
        scanner.finish().unwrap();
        assert_eq!(paths, [name]);
    }

    /// Small pieces travel joined, in order; a large one goes uncopied
    /// (the same bytes) between the runs it splits.
    #[test]
    fn small_pieces_are_joined_and_large_ones_pass_as_they_are() {
        let big = Bytes::from(vec![7u8; JOIN_BELOW]);
        let pieces = vec![
            Bytes::from_static(b"header"),
            Bytes::from_static(b"data"),
            Bytes::from(vec![0u8; 3]),
            big.clone(),
            Bytes::from_static(b"pad"),
            Bytes::from_static(b"next"),
        ];
        let out = coalesce(pieces);
        assert_eq!(out.len(), 3, "{out:?}");
        assert_eq!(&out[0][..], b"headerdata\0\0\0");
        assert_eq!(out[1].as_ptr(), big.as_ptr(), "the large piece was copied");
        assert_eq!(&out[2][..], b"padnext");
        assert_eq!(coalesce(vec![big.clone()]).len(), 1);
        assert!(coalesce(Vec::new()).is_empty());
    }
}
