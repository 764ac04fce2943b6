//! The manifest object: read and parsed, admitted by the restore rules,
//! kept in memory by the hash of its object, and written as zstd frames of
//! runs of entries that a re-checkpoint copies where its entries did not
//! change.

use std::collections::HashSet;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use futures::StreamExt;
use serde::Serialize;
use sha2::{Digest, Sha256};

use super::{chunk_bytes, is_sha256_hex, TreeEntry, TreeKind, TreeManifest, FORMAT};
use crate::archive::{compress, decompress};
use harness_core::checkpoint::CheckpointStore;
use harness_core::stream::ByteStream;
use harness_core::tarscan::{ScanSummary, TarScanner};
use harness_core::{Error, ErrorKind, Result};

/// Largest manifest accepted on read (uncompressed): ~100 bytes per entry,
/// so far above the scanner's 500,000-entry default.
const MAX_MANIFEST_BYTES: usize = 256 * 1024 * 1024;
/// zstd level of manifests: written on every checkpoint, so speed over
/// size (level 1 takes half the time of level 3 on a 20,000-entry
/// manifest, for a fifth more bytes: still well under 1% of the tree).
const MANIFEST_ZSTD_LEVEL: i32 = 1;

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
pub(super) struct KnownManifest {
    pub(super) manifest: TreeManifest,
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
pub(super) struct EntryFrame {
    first: usize,
    len: usize,
    bytes: Bytes,
}

impl KnownManifest {
    pub(super) fn new(manifest: TreeManifest) -> Self {
        Self::with_frames(manifest, Vec::new())
    }

    pub(super) fn with_frames(manifest: TreeManifest, frames: Vec<EntryFrame>) -> Self {
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
    pub(super) fn admitted(&self) -> Result<ScanSummary> {
        if let Some(summary) = self.admitted.get() {
            return Ok(*summary);
        }
        let summary = admit(&self.manifest)?;
        Ok(*self.admitted.get_or_init(|| summary))
    }

    /// Whether one of the manifest's files has the chunk `hash` (hex).
    pub(super) fn has_chunk(&self, hash: &str) -> bool {
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
pub(super) mod known {
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
    pub(in crate::tree) fn get(sha: &str) -> Option<Arc<KnownManifest>> {
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
    pub(in crate::tree) fn take_sole(
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
    pub(in crate::tree) fn clear() {
        kept().lock().unwrap_or_else(|e| e.into_inner()).clear();
    }

    /// Keep `manifest` as the object whose SHA-256 is `sha`.
    pub(in crate::tree) fn put(sha: &str, manifest: Arc<KnownManifest>) {
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
pub(super) async fn load_manifest(
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

/// Entries per frame of a written manifest: a frame ends after an entry
/// whose path hashes to 0 modulo [`FRAME_AVG_ENTRIES`] (once it has
/// [`FRAME_MIN_ENTRIES`]), or at [`FRAME_MAX_ENTRIES`]. The ends depend on
/// the paths, not on positions, so a path added or removed changes the
/// frames around it only, and a re-checkpoint reuses the others.
const FRAME_AVG_ENTRIES: u64 = 1024;
const FRAME_MIN_ENTRIES: usize = 256;
const FRAME_MAX_ENTRIES: usize = 4096;

/// No entry of the parent: an entry the checkpoint made or changed.
pub(super) const NEW_ENTRY: u32 = u32::MAX;

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
pub(super) async fn encode_manifest(
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

/// The archive rules, for all entries, before anything is touched.
pub(super) fn admit(manifest: &TreeManifest) -> Result<ScanSummary> {
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

#[cfg(test)]
pub(in crate::tree) mod tests {
    use super::*;
    use crate::archive::DEFAULT_ZSTD_LEVEL;
    use harness_core::checkpoint::MemoryCheckpointStore;

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

    /// Store `m` under `key` as checkpoints write a manifest (zstd JSON);
    /// the object's hash.
    pub(in crate::tree) async fn put_manifest(
        store: &MemoryCheckpointStore,
        key: &str,
        m: &TreeManifest,
    ) -> String {
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
}
