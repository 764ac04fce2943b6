//! A working tree moves local sandbox → microVM → Docker container and
//! back through a checkpoint store with the core move pipeline; trees are
//! compared through each sandbox's own find/stat/sha256sum.

mod common;

use harness_core::checkpoint::MemoryCheckpointStore;
use harness_core::sandbox::{Sandbox, SandboxProvider, SandboxSpec};
use harness_testkit::trees::{listing, make_tree, move_onto};
use sandbox_docker::{DockerConfig, DockerProvider};
use sandbox_local::LocalProvider;

async fn create(provider: &dyn SandboxProvider) -> Box<dyn Sandbox> {
    provider
        .create(&SandboxSpec::new("/workspace"))
        .await
        .expect("create sandbox")
}

async fn docker() -> Option<DockerProvider> {
    let image =
        std::env::var("HARNESS_TEST_IMAGE").unwrap_or_else(|_| "harness-test:bookworm".into());
    let provider = match DockerProvider::connect(DockerConfig {
        default_image: image.clone(),
        ..DockerConfig::default()
    })
    .await
    {
        Ok(p) => p,
        Err(e) => {
            harness_testkit::skip_or_fail(&format!("no docker engine answers: {e}"));
            return None;
        }
    };
    if provider.client().inspect_image(&image).await.is_err() {
        harness_testkit::skip_or_fail(&format!(
            "docker image {image} is missing (cargo xtask image)"
        ));
        return None;
    }
    Some(provider)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tree_moves_local_to_microvm_to_docker_and_back() {
    let Some((microvm, _state)) = common::provider() else {
        return;
    };
    let Some(docker) = docker().await else {
        return;
    };
    let store = MemoryCheckpointStore::new();
    let root = tempfile::tempdir().unwrap();
    let local = LocalProvider::new(root.path());

    let laptop = create(&local).await;
    make_tree(laptop.as_ref()).await;
    let vm = create(&microvm).await;
    let container = create(&docker).await;
    move_onto(laptop.as_ref(), vm.as_ref(), &store, "moves/l2m.tar.zst").await;
    move_onto(vm.as_ref(), container.as_ref(), &store, "moves/m2d.tar.zst").await;
    let vm_back = create(&microvm).await;
    move_onto(
        container.as_ref(),
        vm_back.as_ref(),
        &store,
        "moves/d2m.tar.zst",
    )
    .await;
    let laptop_back = create(&local).await;
    move_onto(
        vm_back.as_ref(),
        laptop_back.as_ref(),
        &store,
        "moves/m2l.tar.zst",
    )
    .await;
    let start = listing(laptop.as_ref(), laptop.workdir()).await;
    let end = listing(laptop_back.as_ref(), laptop_back.workdir()).await;
    assert_eq!(start, end, "the tree changed on its round trip");
    for sb in [laptop, vm, container, vm_back, laptop_back] {
        sb.destroy().await.unwrap();
    }
}
