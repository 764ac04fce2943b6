//! Garbage collection of blobs and packs no manifest references, and the
//! locks that keep it and tree checkpoints apart.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};

use sha2::{Digest, Sha256};

use super::manifest::read_manifest;
use super::{
    is_sha256_hex, pack_index_key, pack_key, BLOB_PREFIX, LOCK_PREFIX, LOCK_TTL_MS, PACK_PREFIX,
};
use harness_core::checkpoint::CheckpointStore;
use harness_core::clock::Clock;
use harness_core::{Error, ErrorKind, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum LockKind {
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
pub(super) struct Lock {
    key: String,
}

impl Lock {
    pub(super) async fn take(
        store: &dyn CheckpointStore,
        kind: LockKind,
        clock: &dyn Clock,
    ) -> Result<Lock> {
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

    pub(super) async fn release(self, store: &dyn CheckpointStore) {
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
        // Encrypted lineages are collected each through its own view.
        if [
            BLOB_PREFIX,
            LOCK_PREFIX,
            PACK_PREFIX,
            checkpoint_crypt::LINEAGES,
        ]
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
    use crate::archive::DEFAULT_ZSTD_LEVEL;
    use crate::tree::{blob_key, TreeEntry, TreeKind, TreeManifest, FORMAT};
    use harness_core::checkpoint::MemoryCheckpointStore;
    use harness_core::clock::ManualClock;

    fn hash(n: u8) -> String {
        format!("{n:02x}").repeat(32)
    }

    async fn put(store: &MemoryCheckpointStore, key: &str, bytes: &[u8]) {
        store
            .put(key, harness_core::stream::once(bytes.to_vec()))
            .await
            .unwrap();
    }

    /// A manifest of one file made of `chunks`, naming `packs`, stored
    /// (zstd JSON, as checkpoints write it) under `key`.
    async fn put_manifest(
        store: &MemoryCheckpointStore,
        key: &str,
        chunks: &[&str],
        packs: &[&str],
    ) {
        let manifest = TreeManifest {
            format: FORMAT.to_string(),
            parent: None,
            listed_at: 1,
            entries: vec![TreeEntry {
                path: "f".into(),
                kind: TreeKind::File,
                mode: 0o644,
                size: 1,
                mtime: 1,
                chunks: chunks.iter().map(|c| c.to_string()).collect(),
                target: None,
                ino: 0,
                ctime_ns: 0,
            }],
            deleted: vec![],
            packs: packs.iter().map(|p| p.to_string()).collect(),
        };
        crate::tree::manifest::tests::put_manifest(store, key, &manifest).await;
    }

    async fn keys(store: &MemoryCheckpointStore) -> Vec<String> {
        let mut keys = store.list_keys("").await.unwrap();
        keys.sort();
        keys
    }

    /// What no manifest references goes — blobs, and packs with their
    /// index (or an index alone) — counted with their bytes; what one
    /// references stays, and so does everything that is not a blob or a
    /// pack: manifests, whole archives, lineages, locks, and names under
    /// `packs/` that are no pack's.
    #[tokio::test]
    async fn collection_deletes_exactly_what_no_manifest_references() {
        let store = MemoryCheckpointStore::new();
        let clock = ManualClock::at(10 * LOCK_TTL_MS);
        let (kept, also_kept, gone) = (hash(1), hash(2), hash(3));
        put(&store, &blob_key(&kept), b"k").await;
        put(&store, &blob_key(&also_kept), b"kk").await;
        put(&store, &blob_key(&gone), b"gone!").await;
        let (pack_kept, pack_gone, index_alone) = (hash(4), hash(5), hash(6));
        for (key, bytes) in [
            (pack_key(&pack_kept), &b"pack"[..]),
            (pack_index_key(&pack_kept), b"idx"),
            (pack_key(&pack_gone), b"1234567"),
            (pack_index_key(&pack_gone), b"123"),
            (pack_index_key(&index_alone), b"12345678901"),
        ] {
            put(&store, &key, bytes).await;
        }
        put(&store, "packs/zz/not-a-pack", b"?").await;
        put_manifest(&store, "trees/one", &[&kept], &[&pack_kept]).await;
        put_manifest(&store, "trees/two", &[&also_kept, &kept], &[]).await;
        put(&store, "archives/whole.tar.zst", b"not a manifest").await;
        put(&store, "lineages/l1/blobs/ab/unreadable", b"sealed").await;
        // An expired checkpoint lock: a crashed holder's; it stays.
        put(&store, &format!("{LOCK_PREFIX}checkpoint-0-aa"), b"").await;
        let before = keys(&store).await;

        let info = collect_garbage(&store, &clock).await.unwrap();
        assert_eq!(
            info,
            GcInfo {
                manifests: 2,
                blobs_kept: 2,
                blobs_deleted: 1,
                packs_kept: 1,
                packs_deleted: 2,
                bytes_freed: (5 + 7 + 3 + 11) as u64,
            }
        );
        let deleted = [
            blob_key(&gone),
            pack_key(&pack_gone),
            pack_index_key(&pack_gone),
            pack_index_key(&index_alone),
        ];
        let expected: Vec<String> = before
            .iter()
            .filter(|k| !deleted.contains(k))
            .cloned()
            .collect();
        assert_eq!(keys(&store).await, expected, "its own lock is removed too");
        // Nothing left to collect: a second pass deletes nothing.
        let again = collect_garbage(&store, &clock).await.unwrap();
        assert_eq!(
            (again.blobs_deleted, again.packs_deleted, again.bytes_freed),
            (0, 0, 0)
        );
        assert_eq!((again.blobs_kept, again.packs_kept), (2, 1));
    }

    /// A store whose `head` answers `NotFound` for the keys in `gone` (an
    /// object deleted between the listing and the question) and fails for
    /// `broken`.
    #[derive(Debug)]
    struct HeadFails {
        inner: MemoryCheckpointStore,
        gone: Vec<String>,
        broken: Option<String>,
    }

    #[async_trait::async_trait]
    impl CheckpointStore for HeadFails {
        async fn put(
            &self,
            key: &str,
            content: harness_core::stream::ByteStream,
        ) -> Result<harness_core::checkpoint::ObjectMeta> {
            self.inner.put(key, content).await
        }
        async fn get(&self, key: &str) -> Result<harness_core::stream::ByteStream> {
            self.inner.get(key).await
        }
        async fn head(&self, key: &str) -> Result<harness_core::checkpoint::ObjectMeta> {
            if self.gone.iter().any(|k| k == key) {
                return Err(Error::not_found(format!("{key} is gone")));
            }
            if self.broken.as_deref() == Some(key) {
                return Err(Error::backend("the store is down"));
            }
            self.inner.head(key).await
        }
        async fn list(&self, prefix: &str) -> Result<Vec<harness_core::checkpoint::ObjectMeta>> {
            self.inner.list(prefix).await
        }
        async fn delete(&self, key: &str) -> Result<()> {
            self.inner.delete(key).await
        }
    }

    /// An object gone between the listing and its `head` (another client
    /// deleted it) is passed over, neither counted nor failing the pass; any
    /// other failure of `head` stops it.
    #[tokio::test]
    async fn an_object_gone_since_the_listing_is_passed_over_and_a_failing_store_stops_the_pass() {
        let clock = ManualClock::at(10 * LOCK_TTL_MS);
        let (blob, pack) = (hash(8), hash(9));
        let store = HeadFails {
            inner: MemoryCheckpointStore::new(),
            gone: vec![blob_key(&blob), pack_index_key(&pack)],
            broken: None,
        };
        put(&store.inner, &blob_key(&blob), b"blob").await;
        put(&store.inner, &blob_key(&hash(10)), b"other").await;
        put(&store.inner, &pack_key(&pack), b"pack").await;
        put(&store.inner, &pack_index_key(&pack), b"idx").await;
        let info = collect_garbage(&store, &clock).await.unwrap();
        assert_eq!(
            (info.blobs_deleted, info.packs_deleted, info.bytes_freed),
            (1, 1, 5 + 4),
            "{info:?}"
        );
        assert_eq!(
            store.inner.list_keys("").await.unwrap(),
            [blob_key(&blob), pack_index_key(&pack)],
            "what head called gone was not deleted"
        );

        for broken in [blob_key(&blob), pack_key(&pack)] {
            let store = HeadFails {
                inner: MemoryCheckpointStore::new(),
                gone: vec![],
                broken: Some(broken.clone()),
            };
            put(&store.inner, &blob_key(&blob), b"blob").await;
            put(&store.inner, &pack_key(&pack), b"pack").await;
            let err = collect_garbage(&store, &clock).await.unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Backend, "{broken}: {err}");
            assert!(
                store.inner.head(&broken).await.is_ok(),
                "{broken} was deleted"
            );
        }
    }

    /// A manifest that does not parse might reference anything: nothing is
    /// collected, and the error names it.
    #[tokio::test]
    async fn an_unreadable_manifest_stops_the_collection() {
        let store = MemoryCheckpointStore::new();
        let clock = ManualClock::at(10 * LOCK_TTL_MS);
        put(&store, &blob_key(&hash(7)), b"x").await;
        let broken = format!("{{\"format\":\"{FORMAT}\",\"entries\":[");
        let packed = harness_core::stream::collect(
            crate::archive::compress_archive(
                harness_core::stream::once(broken.into_bytes()),
                DEFAULT_ZSTD_LEVEL,
            ),
            1 << 20,
        )
        .await
        .unwrap();
        store
            .put("trees/broken", harness_core::stream::once(packed))
            .await
            .unwrap();
        let before = keys(&store).await;
        let err = collect_garbage(&store, &clock).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");
        assert!(
            err.message()
                .starts_with("not collecting: trees/broken could not be read"),
            "{err}"
        );
        assert_eq!(keys(&store).await, before);
    }

    /// Each side refuses while the other's lock is live (younger than the
    /// TTL), removing its own; an expired one does not hold it; a lock of
    /// its own kind does not either.
    #[tokio::test]
    async fn checkpoints_and_collections_exclude_each_other_until_a_lock_expires() {
        let store = MemoryCheckpointStore::new();
        let clock = ManualClock::at(10 * LOCK_TTL_MS);
        let checkpoint = Lock::take(&store, LockKind::Checkpoint, &clock)
            .await
            .unwrap();
        let held = keys(&store).await;
        assert_eq!(held.len(), 1);
        assert!(held[0].starts_with("locks/checkpoint-"), "{held:?}");
        // A second checkpoint may run beside it.
        let second = Lock::take(&store, LockKind::Checkpoint, &clock)
            .await
            .unwrap();
        second.release(&store).await;

        let err = collect_garbage(&store, &clock).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Conflict);
        assert!(
            err.message().contains("a tree checkpoint is running"),
            "{err}"
        );
        assert_eq!(keys(&store).await, held, "the refused side's lock stays");

        // At the TTL's last millisecond it still holds; after it, not.
        clock.set(10 * LOCK_TTL_MS + LOCK_TTL_MS - 1);
        assert_eq!(
            collect_garbage(&store, &clock).await.unwrap_err().kind(),
            ErrorKind::Conflict
        );
        clock.set(10 * LOCK_TTL_MS + LOCK_TTL_MS);
        collect_garbage(&store, &clock).await.unwrap();
        checkpoint.release(&store).await;
        assert!(keys(&store).await.is_empty());

        // And the other way round.
        let gc = Lock::take(&store, LockKind::Gc, &clock).await.unwrap();
        let err = Lock::take(&store, LockKind::Checkpoint, &clock)
            .await
            .err()
            .expect("a checkpoint beside a running collection");
        assert_eq!(err.kind(), ErrorKind::Conflict);
        assert!(
            err.message().contains("a garbage collection is running"),
            "{err}"
        );
        gc.release(&store).await;
        Lock::take(&store, LockKind::Checkpoint, &clock)
            .await
            .unwrap()
            .release(&store)
            .await;
        assert!(keys(&store).await.is_empty());
    }
}
