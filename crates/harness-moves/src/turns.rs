//! Turn-end checkpoints ([`TurnCheckpoints`]) on any [`CheckpointStore`]:
//! the working tree as an incremental tree checkpoint against the
//! session's previous one (only what changed is read and stored), the
//! agent's state dirs as one archive, and a small manifest written last.
//!
//! ```text
//! turns/<session>/<turn>/tree        the tree checkpoint's manifest (docs/tree-checkpoints.md)
//! turns/<session>/<turn>/state.tar.zst  the agent's state dirs, relative to $HOME
//! turns/<session>/<turn>/turn.json   a TurnManifest: present = complete
//! ```
//!
//! With a deployment key ([`StoreTurnCheckpoints::with_encryption`]) the
//! same layout lives in the session's fork lineage, encrypted
//! (`checkpoint-crypt`), and the key a turn records names it:
//! `lineages/<lineage>/turns/<session>/<turn>`. The lineage is the one the
//! session's previous checkpoint lives in (a fork's first turn: its
//! parent's), else the session's own id, so a fork reads and extends its
//! parent's content.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use async_trait::async_trait;
use checkpoint_crypt::{split_lineage, DeploymentKey, Lineages};
use harness_core::checkpoint::{CheckpointStore, ObjectMeta};
use harness_core::clock::Clock;
use harness_core::harness::Harness;
use harness_core::sandbox::Sandbox;
use harness_core::slice::home_of;
use harness_core::turn::TurnState;
use harness_core::turn_checkpoint::{key_segment, turn_checkpoint_key, PathRules, TurnCheckpoints};
use harness_core::{Error, ErrorKind, Result};
use serde::{Deserialize, Serialize};

use crate::archive::{check_recorded, restore_agent_state, store_agent_state, verify};
use crate::tree::{checkpoint_tree_excluding, restore_tree};

/// [`TurnManifest::version`] this build writes and reads.
pub const TURN_MANIFEST_VERSION: u32 = 1;

/// Largest turn manifest read.
const MANIFEST_LIMIT: usize = 1 << 20;

/// What a turn-end checkpoint holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TurnManifest {
    /// [`TURN_MANIFEST_VERSION`].
    pub version: u32,
    /// The adapter's name (`Harness::name`).
    pub agent: String,
    /// The agent's own session id at the turn's end.
    pub agent_session_id: Option<String>,
    /// The session and turn.
    pub session_id: String,
    /// The turn.
    pub turn_id: String,
    /// The source sandbox's working directory.
    pub workdir: String,
    /// The source sandbox's `$HOME`.
    pub home: String,
    /// The tree checkpoint's key.
    pub tree: String,
    /// The agent's state dirs stored, relative to `home`.
    pub state_dirs: Vec<String>,
    /// The state archive (none when the agent had no state).
    pub state: Option<ObjectMeta>,
    /// When the checkpoint was written (ms since the epoch, the runner's
    /// clock): retention leaves young ones alone, whose frame may not be in
    /// the log yet.
    #[serde(default)]
    pub created_at_ms: u64,
}

/// The keys of the checkpoint at `base`.
fn keys(base: &str) -> (String, String, String) {
    (
        format!("{base}/tree"),
        format!("{base}/state.tar.zst"),
        format!("{base}/turn.json"),
    )
}

/// Read and check the manifest of the turn-end checkpoint at `base`.
pub async fn read_turn_manifest(store: &dyn CheckpointStore, base: &str) -> Result<TurnManifest> {
    let (_, _, manifest_key) = keys(base);
    harness_core::checkpoint::validate_key(&manifest_key)?;
    let stream = store.get(&manifest_key).await.map_err(|e| {
        if e.kind() == ErrorKind::NotFound {
            Error::not_found(format!(
                "no turn-end checkpoint at {base:?} (never completed, or collected)"
            ))
        } else {
            e
        }
    })?;
    let bytes = harness_core::stream::collect(stream, MANIFEST_LIMIT).await?;
    let manifest: TurnManifest = serde_json::from_slice(&bytes).map_err(|e| {
        Error::corrupt(format!(
            "turn checkpoint {manifest_key:?} is not valid: {e}"
        ))
    })?;
    if manifest.version != TURN_MANIFEST_VERSION {
        return Err(Error::invalid(format!(
            "turn checkpoint {manifest_key:?} has version {}, this build reads {TURN_MANIFEST_VERSION}",
            manifest.version
        )));
    }
    Ok(manifest)
}

/// Largest `.gitignore` read for the rules.
const GITIGNORE_LIMIT: usize = 1 << 20;

/// The session's include/exclude rules for its tree: its `exclude`
/// patterns, plus the tree's top-level `.gitignore` when it asks.
async fn path_rules(sandbox: &dyn Sandbox, state: &TurnState) -> Result<PathRules> {
    let Some(config) = state.sandbox_config.as_ref().map(|c| &c.checkpoints) else {
        return Ok(PathRules::default());
    };
    let mut rules = PathRules::new(&config.exclude);
    if config.gitignore {
        let path = format!("{}/.gitignore", sandbox.workdir().trim_end_matches('/'));
        match sandbox.read_file(&path).await {
            Ok(stream) => {
                let bytes = harness_core::stream::collect(stream, GITIGNORE_LIMIT).await?;
                rules.add_gitignore(&String::from_utf8_lossy(&bytes));
            }
            Err(e) if e.kind() == ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    Ok(rules)
}

/// Turn-end checkpoints in a [`CheckpointStore`].
#[derive(Clone)]
pub struct StoreTurnCheckpoints {
    lineages: Lineages,
    clock: Arc<dyn Clock>,
}

impl std::fmt::Debug for StoreTurnCheckpoints {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreTurnCheckpoints")
            .field("store", self.lineages.raw())
            .field("encrypts", &self.lineages.encrypts())
            .finish_non_exhaustive()
    }
}

impl StoreTurnCheckpoints {
    /// Checkpoints in `store`, timed by `clock` (the tree checkpoint's
    /// locks and racy-file rule).
    pub fn new(store: Arc<dyn CheckpointStore>, clock: Arc<dyn Clock>) -> Self {
        Self {
            lineages: Lineages::new(store, None),
            clock,
        }
    }

    /// Checkpoints in `lineages` (a store with its deployment key, which
    /// decides whether new ones are encrypted), timed by `clock`.
    pub fn over(lineages: Lineages, clock: Arc<dyn Clock>) -> Self {
        Self { lineages, clock }
    }

    /// New checkpoints encrypted under `key`'s lineage keys (and
    /// encrypted ones readable).
    pub fn with_encryption(mut self, key: DeploymentKey) -> Self {
        self.lineages = Lineages::new(self.lineages.raw().clone(), Some(key));
        self
    }

    /// The store, as it holds objects.
    pub fn store(&self) -> &Arc<dyn CheckpointStore> {
        self.lineages.raw()
    }
}

#[cfg_attr(not(target_arch = "wasm32"), async_trait)]
#[cfg_attr(target_arch = "wasm32", async_trait(?Send))]
impl TurnCheckpoints for StoreTurnCheckpoints {
    async fn checkpoint(
        &self,
        sandbox: &dyn Sandbox,
        harness: &dyn Harness,
        state: &TurnState,
    ) -> Result<String> {
        let lineage = match state.checkpoint.as_deref().and_then(split_lineage) {
            Some((lineage, _)) => lineage.to_string(),
            None => key_segment(&state.session_id),
        };
        let (store, prefix) = self.lineages.for_new(&lineage)?;
        let encrypted = !prefix.is_empty();
        let store = store.as_ref();
        let base = turn_checkpoint_key(&state.session_id, &state.turn_id);
        let recorded = format!("{prefix}{base}");
        let (tree_key, state_key, manifest_key) = keys(&base);
        // The previous turn's tree is the parent: only what changed since is
        // read. A parent that is gone (collected), or in another space (a
        // plain checkpoint from before encryption was turned on), means a
        // full read.
        let parent = match &state.checkpoint {
            Some(previous) if *previous != recorded => {
                let within = match split_lineage(previous) {
                    Some((l, rest)) if encrypted && l == lineage => Some(rest),
                    None if !encrypted => Some(previous.as_str()),
                    _ => None,
                };
                match within {
                    Some(previous) => match read_turn_manifest(store, previous).await {
                        Ok(m) => Some(m.tree),
                        Err(e) if e.kind() == ErrorKind::NotFound => None,
                        Err(e) => return Err(e),
                    },
                    None => None,
                }
            }
            _ => None,
        };
        let home = home_of(sandbox).await?;
        let (state_dirs, state_object) =
            store_agent_state(sandbox, harness, store, &state_key, &home).await?;
        let rules = path_rules(sandbox, state).await?;
        checkpoint_tree_excluding(
            sandbox,
            sandbox.workdir(),
            store,
            &tree_key,
            parent.as_deref(),
            self.clock.as_ref(),
            None,
            &rules,
        )
        .await?;
        let manifest = TurnManifest {
            version: TURN_MANIFEST_VERSION,
            agent: harness.name().to_string(),
            agent_session_id: state.agent_session_id.clone(),
            session_id: state.session_id.clone(),
            turn_id: state.turn_id.clone(),
            workdir: sandbox.workdir().to_string(),
            home,
            tree: tree_key,
            state_dirs,
            state: state_object,
            created_at_ms: self.clock.now_ms(),
        };
        store
            .put(
                &manifest_key,
                harness_core::stream::once(serde_json::to_vec_pretty(&manifest)?),
            )
            .await?;
        Ok(recorded)
    }

    async fn restore(&self, key: &str, sandbox: &dyn Sandbox, harness: &dyn Harness) -> Result<()> {
        let (store, key) = self.lineages.resolve(key)?;
        let (store, key) = (store.as_ref(), key.as_str());
        let manifest = read_turn_manifest(store, key).await?;
        if manifest.agent != harness.name() {
            return Err(Error::invalid(format!(
                "checkpoint {key:?} holds agent {:?}, not {:?}",
                manifest.agent,
                harness.name()
            )));
        }
        let (_, state_key, _) = keys(key);
        if let Some(recorded) = &manifest.state {
            check_recorded(store, &state_key, recorded).await?;
            // Checked before anything is written: an unsafe entry in the
            // state archive must not leave a half-restored sandbox.
            verify(store, &state_key, None).await?;
        }
        restore_tree(store, &manifest.tree, sandbox, sandbox.workdir(), None).await?;
        if manifest.state.is_some() {
            let home = home_of(sandbox).await?;
            restore_agent_state(
                store,
                &state_key,
                &manifest.home,
                &manifest.workdir,
                sandbox,
                harness,
                &home,
            )
            .await?;
        }
        Ok(())
    }
}

/// What [`collect_turn_checkpoints`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TurnGcInfo {
    /// Turn-end checkpoints found (complete: with their manifest).
    pub found: usize,
    /// Those kept because a session references them.
    pub referenced: usize,
    /// Those kept because they are younger than the grace period.
    pub young: usize,
    /// Those deleted.
    pub deleted: usize,
    /// Objects deleted (manifests, trees' manifests, state archives); the
    /// trees' content goes with the next `collect_garbage`.
    pub objects_deleted: usize,
}

/// Delete every complete turn-end checkpoint under `turns/` that is not in
/// `referenced` (the keys the sessions' logs name: each session's current
/// checkpoint and the turn ends it may rewind to — a fork's included, so a
/// live fork keeps what it was made from) and is older than `grace_ms` at
/// `now_ms` (a checkpoint just written may not be in its log yet). A base
/// without its manifest (a checkpoint that failed, or is being written) is
/// left alone. Run [`collect_garbage`](crate::tree::collect_garbage)
/// after it to free the trees' content.
pub async fn collect_turn_checkpoints(
    store: &dyn CheckpointStore,
    referenced: &HashSet<String>,
    now_ms: u64,
    grace_ms: u64,
) -> Result<TurnGcInfo> {
    let mut bases: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for key in store.list_keys("turns/").await? {
        if let Some((base, _)) = key.rsplit_once('/') {
            bases.entry(base.to_string()).or_default().push(key);
        }
    }
    let mut info = TurnGcInfo::default();
    for (base, keys) in bases {
        let manifest_key = format!("{base}/turn.json");
        if !keys.contains(&manifest_key) {
            continue;
        }
        info.found += 1;
        if referenced.contains(&base) {
            info.referenced += 1;
            continue;
        }
        let manifest = match read_turn_manifest(store, &base).await {
            Ok(m) => m,
            // Unreadable: not ours to judge; left alone.
            Err(_) => continue,
        };
        if now_ms.saturating_sub(manifest.created_at_ms) < grace_ms {
            info.young += 1;
            continue;
        }
        // The manifest first: a checkpoint half deleted is incomplete,
        // never restorable.
        store.delete(&manifest_key).await?;
        info.objects_deleted += 1;
        for key in keys.iter().filter(|k| **k != manifest_key) {
            store.delete(key).await?;
            info.objects_deleted += 1;
        }
        info.deleted += 1;
    }
    Ok(info)
}

#[cfg(test)]
mod tests {
    use super::*;
    use harness_core::checkpoint::MemoryCheckpointStore;

    async fn put_checkpoint(store: &MemoryCheckpointStore, base: &str, created_at_ms: u64) {
        let manifest = TurnManifest {
            version: TURN_MANIFEST_VERSION,
            agent: "a".into(),
            agent_session_id: None,
            session_id: "s".into(),
            turn_id: "t".into(),
            workdir: "/w".into(),
            home: "/h".into(),
            tree: format!("{base}/tree"),
            state_dirs: Vec::new(),
            state: None,
            created_at_ms,
        };
        for (key, body) in [
            (format!("{base}/tree"), b"tree".to_vec()),
            (format!("{base}/state.tar.zst"), b"state".to_vec()),
            (
                format!("{base}/turn.json"),
                serde_json::to_vec(&manifest).unwrap(),
            ),
        ] {
            store
                .put(&key, harness_core::stream::once(body))
                .await
                .unwrap();
        }
    }

    #[tokio::test]
    async fn unreferenced_old_checkpoints_go_and_the_rest_stay() {
        let store = MemoryCheckpointStore::default();
        put_checkpoint(&store, "turns/a/t1", 1_000).await; // a fork references it
        put_checkpoint(&store, "turns/a/t2", 1_000).await; // nobody does
        put_checkpoint(&store, "turns/b/t1", 9_500).await; // nobody, but young
                                                           // Being written: no manifest yet.
        store
            .put("turns/c/t1/tree", harness_core::stream::once(b"x".to_vec()))
            .await
            .unwrap();
        let referenced = HashSet::from(["turns/a/t1".to_string()]);
        let info = collect_turn_checkpoints(&store, &referenced, 10_000, 1_000)
            .await
            .unwrap();
        assert_eq!(
            info,
            TurnGcInfo {
                found: 3,
                referenced: 1,
                young: 1,
                deleted: 1,
                objects_deleted: 3
            }
        );
        let left = store.list_keys("turns/").await.unwrap();
        assert!(
            left.iter().all(|k| !k.starts_with("turns/a/t2/")),
            "{left:?}"
        );
        for kept in [
            "turns/a/t1/turn.json",
            "turns/b/t1/turn.json",
            "turns/c/t1/tree",
        ] {
            assert!(left.iter().any(|k| k == kept), "{kept} gone: {left:?}");
        }
    }
}
