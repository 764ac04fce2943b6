//! The shared `CheckpointStore` conformance suite against the real S3
//! server, each check in a fresh namespace of the test bucket.

mod common;

use std::sync::Arc;

use checkpoint_r2::MIN_PART_SIZE;
use harness_core::checkpoint::CheckpointStore;

#[tokio::test]
async fn s3_store_passes_the_checkpoint_conformance_suite() {
    let Some(ep) = common::endpoint().await else {
        return;
    };
    // The smallest part size, so the suite's multi-MiB objects take the
    // multipart path (temporary key, copy with metadata) too.
    harness_testkit::conformance::checkpoint::run_all(|| {
        let ep = ep.clone();
        async move {
            let store =
                common::store_with(common::config(&ep, "conform").with_part_size(MIN_PART_SIZE))
                    .await;
            Arc::new(store) as Arc<dyn CheckpointStore>
        }
    })
    .await
    .unwrap();
}
