//! Packs: the chunks of many small files in one object.
//!
//! A tree is mostly small files (20,220 in the bench tree, most of them
//! a few KiB): as blobs of their own, a first checkpoint is a `PUT` per
//! file and a restore into an empty tree a `GET` per file, and an S3
//! server spends its CPU on requests, not bytes (`docs/tree-checkpoints.md`).
//! So a run that stores many small files' chunks writes them into packs
//! instead: a pack is the chunks' zstd frames one after another,
//!
//! ```text
//! packs/<id[0..2]>/<id>       the chunks' zstd frames, concatenated (~8 MiB)
//! packs/<id[0..2]>/<id>.idx   its index: for each chunk its SHA-256, offset, length
//! ```
//!
//! where the id is the SHA-256 of the pack's bytes. A restore reads runs
//! of chunks with one ranged `GET` each and checks every chunk's hash, as
//! it does a blob's. A pack and its index are immutable, so an index read
//! or written once is good for the process's lifetime whatever store it
//! came from (the id names its content); whether a store holds the pack is
//! still asked of that store.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, OnceLock};

use bytes::{BufMut, Bytes, BytesMut};
use futures::StreamExt;
use sha2::{Digest, Sha256};

use super::{is_sha256_hex, IN_FLIGHT, PACK_PREFIX};
use harness_core::checkpoint::CheckpointStore;
use harness_core::{Error, Result};

/// A pack is sealed once it holds this many bytes.
pub(super) const PACK_TARGET_BYTES: usize = 8 * 1024 * 1024;
/// A run packs the small chunks it stores once it has this many (or
/// [`PACK_MIN_BYTES`]); fewer go up as blobs, one request each, as
/// before packs: a re-checkpoint of a few edited files stays a few `PUT`s
/// and adds no pack for every later restore to consider.
pub(super) const PACK_MIN_CHUNKS: usize = 64;
/// See [`PACK_MIN_CHUNKS`].
pub(super) const PACK_MIN_BYTES: u64 = 4 * 1024 * 1024;
/// The most one ranged read of a pack asks for.
pub(super) const PACK_READ_MAX: u64 = 4 * 1024 * 1024;
/// Packs a run reads the indexes of to learn what the store holds; a
/// store with more is not searched for packed chunks (a chunk only in a
/// pack is then stored again, never lost).
const MAX_PACKS_LISTED: usize = 256;
/// Packed chunks held in memory from those indexes at most (~48 bytes
/// each).
const MAX_PACKED_LISTED: usize = 1 << 19;

/// First bytes of an index.
const INDEX_MAGIC: &[u8; 8] = b"HPACKIX1";
/// Bytes per chunk in an index: SHA-256, offset (u64 LE), length (u32 LE).
const INDEX_ENTRY: usize = 32 + 8 + 4;
/// Largest index read (a pack of ~8 MiB holds far fewer chunks).
const MAX_INDEX_BYTES: usize = INDEX_MAGIC.len() + 4 + INDEX_ENTRY * (1 << 20);

/// The key of pack `id`.
pub fn pack_key(id: &str) -> String {
    format!("{PACK_PREFIX}{}/{id}", &id[..2])
}

/// The key of pack `id`'s index.
pub fn index_key(id: &str) -> String {
    format!("{PACK_PREFIX}{}/{id}.idx", &id[..2])
}

/// Where one chunk lies in its pack.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct PackedChunk {
    /// SHA-256 of the chunk's content.
    pub(super) hash: [u8; 32],
    /// Offset of its zstd frame in the pack.
    pub(super) offset: u64,
    /// Length of its zstd frame.
    pub(super) len: u32,
}

impl PackedChunk {
    pub(super) fn end(&self) -> u64 {
        self.offset + u64::from(self.len)
    }
}

/// The chunks of one pack, in the order they were written.
#[derive(Debug, Default)]
pub(super) struct PackIndex {
    pub(super) chunks: Vec<PackedChunk>,
}

impl PackIndex {
    fn encode(&self) -> Bytes {
        let mut out = BytesMut::with_capacity(12 + INDEX_ENTRY * self.chunks.len());
        out.put_slice(INDEX_MAGIC);
        out.put_u32_le(self.chunks.len() as u32);
        for c in &self.chunks {
            out.put_slice(&c.hash);
            out.put_u64_le(c.offset);
            out.put_u32_le(c.len);
        }
        out.freeze()
    }

    fn decode(id: &str, bytes: &[u8]) -> Result<Self> {
        let corrupt = |what: &str| Error::corrupt(format!("index of pack {id}: {what}"));
        let body = bytes
            .strip_prefix(INDEX_MAGIC.as_slice())
            .ok_or_else(|| corrupt("not a pack index"))?;
        let (count, entries) = body
            .split_first_chunk::<4>()
            .ok_or_else(|| corrupt("truncated"))?;
        let count = u32::from_le_bytes(*count) as usize;
        if entries.len() != count * INDEX_ENTRY {
            return Err(corrupt(&format!(
                "{} bytes of entries for {count} chunks",
                entries.len()
            )));
        }
        let chunks = entries
            .chunks_exact(INDEX_ENTRY)
            .map(|e| PackedChunk {
                hash: e[..32].try_into().expect("32 bytes"),
                offset: u64::from_le_bytes(e[32..40].try_into().expect("8 bytes")),
                len: u32::from_le_bytes(e[40..44].try_into().expect("4 bytes")),
            })
            .collect();
        Ok(Self { chunks })
    }

    /// Where the last chunk ends: the pack is at least this long.
    pub(super) fn end(&self) -> u64 {
        self.chunks.iter().map(PackedChunk::end).max().unwrap_or(0)
    }
}

/// A pack being filled.
#[derive(Default)]
pub(super) struct PackWriter {
    bytes: BytesMut,
    index: PackIndex,
}

/// A pack ready to store.
pub(super) struct SealedPack {
    pub(super) id: String,
    pub(super) pack: Bytes,
    pub(super) index: Bytes,
}

impl PackWriter {
    /// Append a chunk's zstd frame.
    pub(super) fn push(&mut self, hash: [u8; 32], frame: &[u8]) {
        self.index.chunks.push(PackedChunk {
            hash,
            offset: self.bytes.len() as u64,
            len: frame.len() as u32,
        });
        self.bytes.extend_from_slice(frame);
    }

    pub(super) fn len(&self) -> usize {
        self.bytes.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.index.chunks.is_empty()
    }

    /// The pack and its index, named by the pack's hash; the index is kept
    /// for this process (a restore of what was just written reads none).
    pub(super) fn seal(self) -> SealedPack {
        let pack = self.bytes.freeze();
        let id = hex::encode(Sha256::digest(&pack));
        let index = self.index.encode();
        cache::put(&id, Arc::new(self.index));
        SealedPack { id, pack, index }
    }
}

/// Indexes this process read or wrote, by pack id, the least recently
/// used going first past [`cache::CACHED_CHUNKS`] chunks in all.
mod cache {
    use super::*;

    /// Chunks kept at most over all kept indexes (48 bytes each).
    pub(super) const CACHED_CHUNKS: usize = 1 << 20;

    type Kept = VecDeque<(String, Arc<PackIndex>)>;

    fn kept() -> &'static Mutex<Kept> {
        static KEPT: OnceLock<Mutex<Kept>> = OnceLock::new();
        KEPT.get_or_init(|| Mutex::new(VecDeque::new()))
    }

    pub(super) fn get(id: &str) -> Option<Arc<PackIndex>> {
        let mut kept = kept().lock().unwrap_or_else(|e| e.into_inner());
        let at = kept.iter().position(|(k, _)| k == id)?;
        let hit = kept.remove(at)?;
        let index = hit.1.clone();
        kept.push_front(hit);
        Some(index)
    }

    pub(super) fn clear() {
        kept().lock().unwrap_or_else(|e| e.into_inner()).clear();
    }

    pub(super) fn put(id: &str, index: Arc<PackIndex>) {
        if index.chunks.len() > CACHED_CHUNKS {
            return;
        }
        let mut kept = kept().lock().unwrap_or_else(|e| e.into_inner());
        kept.retain(|(k, _)| k != id);
        kept.push_front((id.to_string(), index));
        while kept.iter().map(|(_, i)| i.chunks.len()).sum::<usize>() > CACHED_CHUNKS {
            kept.pop_back();
        }
    }
}

/// Forget the kept indexes ([`super::forget_kept`]).
pub(super) fn forget_kept() {
    cache::clear();
}

/// The index of pack `id` in `store` (kept by this process once read).
pub(super) async fn read_index(store: &dyn CheckpointStore, id: &str) -> Result<Arc<PackIndex>> {
    if !is_sha256_hex(id) {
        return Err(Error::corrupt(format!("malformed pack id {id:?}")));
    }
    if let Some(hit) = cache::get(id) {
        return Ok(hit);
    }
    let bytes =
        harness_core::stream::collect(store.get(&index_key(id)).await?, MAX_INDEX_BYTES).await?;
    let index = Arc::new(PackIndex::decode(id, &bytes)?);
    cache::put(id, index.clone());
    Ok(index)
}

/// The indexes of `ids`, in their order, [`IN_FLIGHT`] read at a time.
pub(super) async fn read_indexes(
    store: &dyn CheckpointStore,
    ids: &[String],
) -> Result<Vec<Arc<PackIndex>>> {
    let reads: Vec<_> = ids.iter().map(|id| read_index(store, id)).collect();
    futures::stream::iter(reads)
        .buffered(IN_FLIGHT)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect()
}

/// Every packed chunk of a store: the packs' ids, and for each chunk the
/// position of its pack among them.
#[derive(Debug, Default)]
pub(super) struct Packed {
    pub(super) ids: Vec<String>,
    pub(super) chunks: HashMap<[u8; 32], u32>,
}

/// What the packs of `store` hold, from their indexes; `None` when there
/// are more than [`MAX_PACKS_LISTED`] packs or [`MAX_PACKED_LISTED`]
/// chunks in them, too many to hold. A pack counts when both it and its
/// index are listed.
pub(super) async fn list_packed(store: &dyn CheckpointStore) -> Result<Option<Packed>> {
    let keys = store.list_keys(PACK_PREFIX).await?;
    let listed: std::collections::HashSet<&str> = keys.iter().map(String::as_str).collect();
    let ids: Vec<String> = keys
        .iter()
        .filter_map(|k| k.strip_suffix(".idx"))
        .filter_map(|k| k.rsplit('/').next())
        .filter(|id| is_sha256_hex(id) && listed.contains(pack_key(id).as_str()))
        .map(str::to_string)
        .collect();
    if ids.len() > MAX_PACKS_LISTED {
        return Ok(None);
    }
    let indexes = read_indexes(store, &ids).await?;
    if indexes.iter().map(|i| i.chunks.len()).sum::<usize>() > MAX_PACKED_LISTED {
        return Ok(None);
    }
    let mut chunks = HashMap::new();
    for (at, index) in indexes.iter().enumerate() {
        for c in &index.chunks {
            chunks.entry(c.hash).or_insert(at as u32);
        }
    }
    Ok(Some(Packed { ids, chunks }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_index_reads_back_and_a_damaged_one_is_refused() {
        let mut w = PackWriter::default();
        w.push([1; 32], b"first frame");
        w.push([2; 32], b"second");
        let sealed = w.seal();
        assert_eq!(&sealed.pack[..], b"first framesecond");
        assert_eq!(sealed.id, hex::encode(Sha256::digest(b"first framesecond")));
        let index = PackIndex::decode(&sealed.id, &sealed.index).unwrap();
        assert_eq!(
            index.chunks,
            vec![
                PackedChunk {
                    hash: [1; 32],
                    offset: 0,
                    len: 11
                },
                PackedChunk {
                    hash: [2; 32],
                    offset: 11,
                    len: 6
                },
            ]
        );
        assert_eq!(index.end(), 17);
        let short = &sealed.index[..sealed.index.len() - 1];
        let err = PackIndex::decode(&sealed.id, short).unwrap_err();
        assert!(
            err.to_string().contains("bytes of entries for 2 chunks"),
            "{err}"
        );
        let err = PackIndex::decode(&sealed.id, b"PK\x03\x04 a zip").unwrap_err();
        assert!(err.to_string().contains("not a pack index"), "{err}");
    }
}
