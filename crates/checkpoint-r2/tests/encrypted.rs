//! Encrypted checkpoints on the real S3 server (issue 40): the store holds
//! ciphertext only, another key restores nothing, and the encrypted store
//! passes the shared conformance suite there too.

mod common;

use std::sync::Arc;

use checkpoint_crypt::{format, DeploymentKey, EncryptedStore};
use checkpoint_r2::S3CheckpointStore;
use harness_core::checkpoint::CheckpointStore;
use harness_core::sandbox::Sandbox;
use harness_core::turn::TurnState;
use harness_core::turn_checkpoint::TurnCheckpoints;
use harness_core::ErrorKind;
use harness_moves::turns::StoreTurnCheckpoints;
use harness_testkit::agent::{ScriptHarness, SCRIPT_AGENT};
use harness_testkit::conformance::checkpoint::{run_all, sealed_tamper, StoreUnderTest};
use harness_testkit::trees::sh;

const MARKER: &str = "MARKER-c41f-the-store-must-never-read-this";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn encrypted_store_over_s3_passes_the_checkpoint_conformance_suite() {
    let Some(ep) = common::endpoint().await else {
        return;
    };
    run_all(|| {
        let ep = ep.clone();
        async move {
            let raw: Arc<dyn CheckpointStore> = Arc::new(common::store(&ep, "sealed").await);
            let key = DeploymentKey::from_secret(&[5; 32]).unwrap();
            let view: Arc<dyn CheckpointStore> =
                Arc::new(EncryptedStore::new(raw.clone(), key.lineage("suite")));
            StoreUnderTest::new(
                view.clone(),
                sealed_tamper(raw, view, format::HEADER as usize),
            )
        }
    })
    .await
    .unwrap();
}

fn turn(session: &str, n: u64, previous: Option<String>) -> TurnState {
    let mut s = TurnState::new(session, format!("t{n}"), SCRIPT_AGENT, "p");
    s.checkpoint = previous;
    s
}

/// Every object the store's namespace holds, as stored, read with the raw
/// S3 client (not through the store): does any contain the marker?
async fn marker_in_store(store: &S3CheckpointStore) -> Vec<String> {
    let mut found = Vec::new();
    let keys = common::raw_keys(store).await;
    assert!(!keys.is_empty(), "the store holds nothing");
    for key in keys {
        let full = format!("{}{key}", common::namespace(store));
        let object = store
            .client()
            .get_object()
            .bucket(&store.config().bucket)
            .key(&full)
            .send()
            .await
            .unwrap();
        let bytes = object.body.collect().await.unwrap().into_bytes();
        if bytes.windows(MARKER.len()).any(|w| w == MARKER.as_bytes()) {
            found.push(key);
        }
    }
    found
}

/// A tree with the marker in a small file (packed), in a 1 MiB file (a
/// blob of its own) and in a file name's content only; the rest random, so
/// zstd keeps the marker's bytes as they are.
async fn tree_with_marker(sandbox: &dyn Sandbox) {
    sh(
        sandbox,
        &format!(
            "mkdir -p src && printf '%s' '{MARKER}' > src/small.txt && \
             head -c 700000 /dev/urandom > big.bin && printf '%s' '{MARKER}' >> big.bin && \
             head -c 400000 /dev/urandom >> big.bin && echo plain > src/other.rs"
        ),
    )
    .await;
}

#[tokio::test]
async fn an_encrypted_turn_checkpoint_leaves_no_content_in_s3_and_another_key_restores_nothing() {
    let Some(ep) = common::endpoint().await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let provider = sandbox_local::LocalProvider::new(dir.path().join("sandboxes"));
    let clock = Arc::new(common::sandboxes::wall_clock());
    let source = common::sandboxes::fresh_local(&provider).await;
    tree_with_marker(source.as_ref()).await;

    // The control: the same tree checkpointed without encryption shows the
    // marker in the store, so the search below can find it.
    let plain_store = common::store(&ep, "plain").await;
    let plain = StoreTurnCheckpoints::new(Arc::new(plain_store.clone()), clock.clone());
    let plain_key = plain
        .checkpoint(source.as_ref(), &ScriptHarness, &turn("enc-s1", 1, None))
        .await
        .unwrap();
    assert_eq!(plain_key, "turns/enc-s1/t1");
    let seen = marker_in_store(&plain_store).await;
    assert!(
        seen.len() >= 2,
        "the control store shows the marker in only {seen:?}"
    );

    let store = common::store(&ep, "sealed-turns").await;
    let key_a = DeploymentKey::from_secret(&[0xa; 32]).unwrap();
    let sealed = StoreTurnCheckpoints::new(Arc::new(store.clone()), clock.clone())
        .with_encryption(key_a.clone());
    let key = sealed
        .checkpoint(source.as_ref(), &ScriptHarness, &turn("enc-s1", 1, None))
        .await
        .unwrap();
    assert_eq!(key, "lineages/enc-s1/turns/enc-s1/t1");
    assert_eq!(marker_in_store(&store).await, Vec::<String>::new());
    let raw = common::raw_keys(&store).await;
    assert!(
        raw.iter().all(|k| k.starts_with("lineages/enc-s1/")),
        "objects outside the lineage: {raw:?}"
    );

    // A fork's turn (its previous checkpoint is the parent's) stays in the
    // parent's lineage and stores only what changed.
    sh(source.as_ref(), "echo changed > src/other.rs").await;
    let before = raw.len();
    let fork_key = sealed
        .checkpoint(
            source.as_ref(),
            &ScriptHarness,
            &turn("enc-fork", 1, Some(key.clone())),
        )
        .await
        .unwrap();
    assert_eq!(fork_key, "lineages/enc-s1/turns/enc-fork/t1");
    let after = common::raw_keys(&store).await;
    let mut added_bytes = 0;
    for k in after.iter().filter(|k| !raw.contains(k)) {
        added_bytes += store.head(k).await.unwrap().size;
    }
    assert!(
        added_bytes < 64 * 1024,
        "the fork stored {added_bytes} bytes for a one-line change (before: {before} objects): \
         the 1 MiB file went again"
    );

    // Another deployment's key: refused with a clear error, nothing written.
    let target = common::sandboxes::fresh_local(&provider).await;
    let other = StoreTurnCheckpoints::new(Arc::new(store.clone()), clock.clone())
        .with_encryption(DeploymentKey::from_secret(&[0xb; 32]).unwrap());
    let e = other
        .restore(&key, target.as_ref(), &ScriptHarness)
        .await
        .expect_err("another key restored");
    assert_eq!(e.kind(), ErrorKind::Unauthorized, "{e}");
    assert!(e.to_string().contains("another key"), "{e}");
    let listed = sh(
        target.as_ref(),
        &format!("find {} -mindepth 1 | wc -l", target.workdir()),
    )
    .await;
    assert_eq!(
        listed.trim(),
        "0",
        "a refused restore wrote into the sandbox"
    );

    // The right key restores the tree, byte for byte.
    sealed
        .restore(&key, target.as_ref(), &ScriptHarness)
        .await
        .unwrap();
    let sum = |s: Box<dyn Sandbox>| async move {
        sh(
            s.as_ref(),
            &format!("cd {} && sha256sum big.bin src/small.txt", s.workdir()),
        )
        .await
    };
    let source_sums = sh(
        source.as_ref(),
        &format!("cd {} && sha256sum big.bin src/small.txt", source.workdir()),
    )
    .await;
    assert_eq!(sum(target).await, source_sums);
}
