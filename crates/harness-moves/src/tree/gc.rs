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
