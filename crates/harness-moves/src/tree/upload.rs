//! The checkpoint's uploader: stores the chunks the store lacks (asked
//! with `HEAD`s, or answered from one listing of the store), large files'
//! as blobs, many small files' in packs.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use futures::stream::FuturesUnordered;
use futures::StreamExt;
use sha2::{Digest, Sha256};

use super::chunks::{compressed, lacking_blobs, list_blob_hashes, HEADS_BEFORE_LISTING};
use super::manifest::KnownManifest;
use super::packs::{self, PackWriter, PACK_MIN_BYTES, PACK_MIN_CHUNKS, PACK_TARGET_BYTES};
use super::{blob_key, pack_index_key, pack_key, IN_FLIGHT, IN_FLIGHT_BYTES};
use harness_core::checkpoint::CheckpointStore;
use harness_core::{ErrorKind, Result};

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

/// A small file's chunk the uploader holds: its hex hash, digest, content.
type SmallChunk = (String, [u8; 32], Bytes);

/// Uploads chunks the store lacks, within [`IN_FLIGHT_BYTES`] and
/// [`IN_FLIGHT`]: a large file's chunks as blobs, small files' chunks in
/// packs when the run stores many of them ([`PACK_MIN_CHUNKS`]), else as
/// blobs too.
pub(super) struct Uploader<'s> {
    store: &'s dyn CheckpointStore,
    /// The parent's manifest: its chunks are stored.
    pub(super) parent: Option<Arc<KnownManifest>>,
    /// The chunks the parent had at the paths this run reads (stored
    /// too): a file read again with the content it had (a racy one, or
    /// one only touched) is not asked about, wherever the parent keeps it.
    pub(super) parent_at_paths: HashSet<String>,
    /// Chunks this run found or stored (or holds, to store).
    known: HashSet<String>,
    presence: Presence,
    /// Each upload answers whether it stored a chunk, and its size.
    running: FuturesUnordered<harness_core::maybe::BoxFuture<'s, Result<(bool, u64)>>>,
    running_bytes: u64,
    compressing: Arc<futures::lock::Mutex<()>>,
    pub(super) uploaded: u64,
    pub(super) uploaded_bytes: Arc<AtomicU64>,
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
    pub(super) packs: std::collections::BTreeSet<String>,
}

impl<'s> Uploader<'s> {
    pub(super) fn new(store: &'s dyn CheckpointStore) -> Self {
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
    /// a whole file under [`MIN_CHUNK`](super::MIN_CHUNK), which may travel in a pack.
    pub(super) async fn add(&mut self, chunk: Bytes, small: bool) -> Result<String> {
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
    pub(super) async fn finish(&mut self) -> Result<()> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use harness_core::checkpoint::MemoryCheckpointStore;

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
}
