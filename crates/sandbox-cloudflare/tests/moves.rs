//! A working tree moves laptop (local sandbox) → Cloudflare sandbox →
//! Docker sandbox and back, through a checkpoint store, with the core move
//! pipeline; trees are compared through each sandbox's own
//! find/stat/sha256sum (paths, contents, modes, symlink targets).

mod common;

use harness_core::checkpoint::MemoryCheckpointStore;
use harness_core::sandbox::{Sandbox, SandboxProvider, SandboxSpec};
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
