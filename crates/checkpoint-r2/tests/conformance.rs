//! The shared `CheckpointStore` conformance suite against the real S3
//! server, each check in a fresh namespace of the test bucket.

mod common;

use std::sync::Arc;

use bytes::Bytes;
use checkpoint_r2::{S3CheckpointStore, MIN_PART_SIZE, SHA256_METADATA};
use harness_core::checkpoint::CheckpointStore;
use harness_testkit::conformance::checkpoint::StoreUnderTest;

/// The suite's tamper hook: a raw `PutObject` of other bytes under the
/// object's key, with the `sha256` metadata the store recorded at put.
async fn overwrite_keeping_hash(
    store: &S3CheckpointStore,
    key: &str,
    bytes: Bytes,
) -> anyhow::Result<()> {
    let full = store.object_key(key);
    let bucket = &store.config().bucket;
    let head = store
        .client()
        .head_object()
        .bucket(bucket)
        .key(&full)
        .send()
        .await?;
    let sha = head
        .metadata()
        .and_then(|m| m.get(SHA256_METADATA))
        .cloned()
        .ok_or_else(|| anyhow::anyhow!("{key:?} has no recorded sha256"))?;
    store
        .client()
        .put_object()
        .bucket(bucket)
        .key(full)
        .metadata(SHA256_METADATA, sha)
        .body(bytes.into())
        .send()
        .await?;
    Ok(())
}

#[tokio::test]
async fn s3_store_passes_the_checkpoint_conformance_suite() {
    let Some(ep) = common::endpoint().await else {
        return;
    };
    // The smallest part size, so the suite's multi-MiB objects take the
    // multipart path (the hash in a trailer) too.
    harness_testkit::conformance::checkpoint::run_all(|| {
        let ep = ep.clone();
        async move {
            let store =
                common::store_with(common::config(&ep, "conform").with_part_size(MIN_PART_SIZE))
                    .await;
            let raw = store.clone();
            StoreUnderTest::new(
                Arc::new(store) as Arc<dyn CheckpointStore>,
                Arc::new(move |key: String, bytes: Bytes| {
                    let raw = raw.clone();
                    Box::pin(async move { overwrite_keeping_hash(&raw, &key, bytes).await })
                }),
            )
        }
    })
    .await
    .unwrap();
}
