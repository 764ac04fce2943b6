//! A working tree moves laptop (local sandbox) → Cloudflare sandbox →
//! Docker sandbox and back, through a checkpoint store, with the core move
//! pipeline; and laptop → R2-compatible store (the real S3 server,
//! `checkpoint-r2`) → Cloudflare sandbox and back, as archives and as
//! incremental tree checkpoints. Trees are compared through each sandbox's
//! own find/stat/sha256sum (paths, contents, modes, symlink targets).

mod common;

use harness_core::checkpoint::MemoryCheckpointStore;
use harness_core::clock::FnClock;
use harness_core::sandbox::{Sandbox, SandboxProvider, SandboxSpec};
use harness_moves::tree as tree_checkpoint;
use harness_testkit::trees::{listing, make_tree, move_onto};
use sandbox_local::LocalProvider;

async fn create(provider: &dyn SandboxProvider) -> Box<dyn Sandbox> {
    provider
        .create(&SandboxSpec::new("/workspace"))
        .await
        .expect("create sandbox")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tree_moves_local_to_cloudflare_to_docker_and_back() {
    let Some(bridge) = common::bridge().await else {
        return;
    };
    let Some(docker) = common::docker().await else {
        return;
    };
    let store = MemoryCheckpointStore::new();
    let root = tempfile::tempdir().unwrap();
    let local = LocalProvider::new(root.path());

    let laptop = create(&local).await;
    make_tree(laptop.as_ref()).await;
    let cloud = create(&bridge.provider).await;
    let container = create(&docker).await;

    // Laptop → Cloudflare: the tree plus the cloud sandbox's own file.
    let in_cloud = move_onto(laptop.as_ref(), cloud.as_ref(), &store, "moves/l2c.tar.zst").await;
    // The staging directory never travels.
    assert!(
        !in_cloud.iter().any(|l| l.contains(".harness-io")),
        "{in_cloud:#?}"
    );
    // Cloudflare → Docker.
    move_onto(
        cloud.as_ref(),
        container.as_ref(),
        &store,
        "moves/c2d.tar.zst",
    )
    .await;

    // And back: Docker → Cloudflare (a fresh sandbox) → laptop (fresh).
    let cloud_back = create(&bridge.provider).await;
    move_onto(
        container.as_ref(),
        cloud_back.as_ref(),
        &store,
        "moves/d2c.tar.zst",
    )
    .await;
    let laptop_back = create(&local).await;
    move_onto(
        cloud_back.as_ref(),
        laptop_back.as_ref(),
        &store,
        "moves/c2l.tar.zst",
    )
    .await;
    // The round trip ends where it began, plus each target's own file.
    let start = listing(laptop.as_ref(), laptop.workdir()).await;
    let end = listing(laptop_back.as_ref(), laptop_back.workdir()).await;
    assert_eq!(start, end, "the tree changed on its round trip");
    for sb in [laptop, cloud, container, cloud_back, laptop_back] {
        sb.destroy().await.unwrap();
    }
    bridge.finish().await;
}

/// The system clock (tree checkpoints stamp their locks).
fn wall_clock() -> FnClock<fn() -> u64> {
    FnClock(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64)
    })
}

/// The R2-compatible store: `checkpoint-r2` on `HARNESS_S3_ENDPOINT` (the
/// S3 server `cargo xtask services start` runs), a fresh prefix.
async fn r2_store() -> Option<checkpoint_r2::S3CheckpointStore> {
    let Some(endpoint) = std::env::var("HARNESS_S3_ENDPOINT")
        .ok()
        .filter(|v| !v.is_empty())
    else {
        harness_testkit::skip_or_fail(
            "HARNESS_S3_ENDPOINT is not set (start the S3 server with `cargo xtask services start`)",
        );
        return None;
    };
    let prefix = format!(
        "tests/cloudflare-moves-{}-{}",
        std::process::id(),
        wall_clock().0()
    );
    let config = checkpoint_r2::S3Config::custom(
        &endpoint,
        "us-east-1",
        "harness-test",
        "harness-test-secret",
        "harness-checkpoint-r2-tests",
    )
    .with_prefix(prefix);
    let store = checkpoint_r2::S3CheckpointStore::new(config).expect("an S3 config");
    if let Err(e) = store.ensure_bucket().await {
        harness_testkit::skip_or_fail(&format!("the S3 server at {endpoint}: {e}"));
        return None;
    }
    Some(store)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tree_moves_laptop_to_cloudflare_and_back_through_an_r2_compatible_store() {
    let Some(bridge) = common::bridge().await else {
        return;
    };
    let Some(store) = r2_store().await else {
        bridge.finish().await;
        return;
    };
    let root = tempfile::tempdir().unwrap();
    let local = LocalProvider::new(root.path());

    let laptop = create(&local).await;
    make_tree(laptop.as_ref()).await;
    let start = listing(laptop.as_ref(), laptop.workdir()).await;

    // Archives: laptop → R2 → Cloudflare → R2 → a fresh laptop sandbox.
    let cloud = create(&bridge.provider).await;
    move_onto(
        laptop.as_ref(),
        cloud.as_ref(),
        &store,
        "moves/r2-l2c.tar.zst",
    )
    .await;
    let laptop_back = create(&local).await;
    move_onto(
        cloud.as_ref(),
        laptop_back.as_ref(),
        &store,
        "moves/r2-c2l.tar.zst",
    )
    .await;
    let end = listing(laptop_back.as_ref(), laptop_back.workdir()).await;
    assert_eq!(start, end, "the tree changed on its round trip through R2");

    // Tree checkpoints: the laptop's tree as a manifest and chunks in R2,
    // restored in a fresh Cloudflare sandbox; a change made there comes
    // back as an incremental checkpoint on top of the first.
    let dir = laptop.workdir().to_string();
    let first = tree_checkpoint::checkpoint_tree(
        laptop.as_ref(),
        &dir,
        &store,
        "trees/l",
        None,
        &wall_clock(),
        None,
    )
    .await
    .expect("tree checkpoint of the laptop");
    let cloud2 = create(&bridge.provider).await;
    tree_checkpoint::restore_tree(&store, "trees/l", cloud2.as_ref(), cloud2.workdir(), None)
        .await
        .expect("tree restore in the Cloudflare sandbox");
    let in_cloud = listing(cloud2.as_ref(), cloud2.workdir()).await;
    assert_eq!(
        start, in_cloud,
        "the Cloudflare sandbox holds the laptop's tree"
    );
    let out = harness_core::sandbox::collect_exec(
        cloud2
            .exec(harness_core::sandbox::ExecRequest::shell(
                "echo changed-in-the-cloud > cloud-note.txt",
            ))
            .await
            .unwrap(),
    )
    .await
    .unwrap();
    assert!(out.status.success(), "{out:?}");
    let second = tree_checkpoint::checkpoint_tree(
        cloud2.as_ref(),
        cloud2.workdir(),
        &store,
        "trees/c",
        Some("trees/l"),
        &wall_clock(),
        None,
    )
    .await
    .expect("incremental tree checkpoint in the Cloudflare sandbox");
    assert!(
        second.bytes_uploaded < first.bytes_uploaded,
        "the incremental checkpoint uploaded {} bytes, the first {}",
        second.bytes_uploaded,
        first.bytes_uploaded
    );
    tree_checkpoint::restore_tree(&store, "trees/c", laptop.as_ref(), &dir, None)
        .await
        .expect("tree restore back on the laptop");
    let cloud_listing = listing(cloud2.as_ref(), cloud2.workdir()).await;
    let laptop_listing = listing(laptop.as_ref(), &dir).await;
    assert_eq!(
        cloud_listing, laptop_listing,
        "the laptop has the cloud's change"
    );
    assert!(
        laptop_listing.iter().any(|l| l.contains("cloud-note.txt")),
        "{laptop_listing:#?}"
    );

    for sb in [laptop, cloud, laptop_back, cloud2] {
        sb.destroy().await.unwrap();
    }
    bridge.finish().await;
}
