//! Working trees moved between local and Docker sandboxes in every
//! direction, through the S3 store (and the memory store once), with the
//! core move pipeline. Trees are compared through each sandbox's own
//! find/stat/sha256sum: paths, contents, modes, symlink targets.

mod common;

use common::sandboxes::{assert_overlaid, docker, listing, make_tree, prepare_target, raw_tar, sh};
use harness_core::checkpoint::{CheckpointStore, MemoryCheckpointStore};
use harness_core::sandbox::{Sandbox, SandboxProvider, SandboxSpec};
use harness_core::ErrorKind;
use harness_moves as moves;
use sandbox_local::LocalProvider;

/// Destroys a sandbox when dropped, so a failing test leaves no container.
struct Destroy(Option<Box<dyn Sandbox>>);

impl Destroy {
    fn get(&self) -> &dyn Sandbox {
        self.0.as_deref().expect("sandbox")
    }
}

impl Drop for Destroy {
    fn drop(&mut self) {
        if let Some(sb) = self.0.take() {
            let h = sb.handle();
            if h.provider == "docker" {
                let _ = std::process::Command::new("docker")
                    .args(["rm", "-f", &h.id])
                    .output();
            }
        }
    }
}

async fn create(provider: &dyn SandboxProvider) -> Destroy {
    Destroy(Some(
        provider
            .create(&SandboxSpec::new("/workspace"))
            .await
            .expect("create sandbox"),
    ))
}

/// Move A's tree onto B (which has its own files) through `store` and check
/// B = A + B's own file; also check nothing was staged on A's disk.
async fn move_and_compare(a: &dyn Sandbox, b: &dyn Sandbox, store: &dyn CheckpointStore) {
    make_tree(a).await;
    prepare_target(b).await;
    let want = listing(a, a.workdir()).await;
    // Files on A's file system that appear or change during the checkpoint
    // (newer than a marker): a staged archive would show up here. The
    // sandbox's file system is the container's `/`, or a local sandbox's
    // root directory (its /tmp is the host's, shared with everything else).
    // Each exec's own pid file is not staging.
    let root = "r=\"${HARNESS_SANDBOX_ROOT:-/}\"";
    sh(
        a,
        &format!("{root}; touch \"$r/.harness-move-marker\" && sleep 1"),
    )
    .await;
    let key = format!("moves/{}.tar.zst", uuid::Uuid::new_v4().simple());
    let info = moves::checkpoint(a, a.workdir(), store, &key, None)
        .await
        .unwrap();
    assert!(info.tar_bytes > 6_000_000, "tar bytes {}", info.tar_bytes);
    assert_eq!(store.head(&key).await.unwrap(), info.object);
    let staged = sh(
        a,
        &format!(
            "{root}; find \"$r\" -xdev -type f -newer \"$r/.harness-move-marker\" ! -name '.harness-exec-*.pid' 2>/dev/null | head -20"
        ),
    )
    .await;
    assert_eq!(
        staged.trim(),
        "",
        "files written on A during the checkpoint"
    );
    let restored = moves::restore(store, &key, b, b.workdir(), None)
        .await
        .unwrap();
    // `want` has no entry for the root itself; the archive may.
    let entries = restored.summary.entries as usize;
    assert!(
        entries == want.len() || entries == want.len() + 1,
        "{entries} entries restored for {} in the tree",
        want.len()
    );
    let got = listing(b, b.workdir()).await;
    assert_overlaid(&want, &got);
    store.delete(&key).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_to_docker_through_s3() {
    let Some(ep) = common::endpoint().await else {
        return;
    };
    let Some(dp) = docker().await else { return };
    let store = common::store(&ep, "x-l2d").await;
    let root = tempfile::tempdir().unwrap();
    let lp = LocalProvider::new(root.path());
    let a = create(&lp).await;
    let b = create(&dp).await;
    move_and_compare(a.get(), b.get(), &store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn docker_to_local_through_s3() {
    let Some(ep) = common::endpoint().await else {
        return;
    };
    let Some(dp) = docker().await else { return };
    let store = common::store(&ep, "x-d2l").await;
    let root = tempfile::tempdir().unwrap();
    let lp = LocalProvider::new(root.path());
    let a = create(&dp).await;
    let b = create(&lp).await;
    move_and_compare(a.get(), b.get(), &store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn docker_to_docker_through_s3() {
    let Some(ep) = common::endpoint().await else {
        return;
    };
    let Some(dp) = docker().await else { return };
    let store = common::store(&ep, "x-d2d").await;
    let a = create(&dp).await;
    let b = create(&dp).await;
    move_and_compare(a.get(), b.get(), &store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_to_docker_through_the_memory_store() {
    let Some(dp) = docker().await else { return };
    let store = MemoryCheckpointStore::new();
    let root = tempfile::tempdir().unwrap();
    let lp = LocalProvider::new(root.path());
    let a = create(&lp).await;
    let b = create(&dp).await;
    move_and_compare(a.get(), b.get(), &store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_archives_are_refused_by_a_docker_target_and_change_nothing() {
    let Some(ep) = common::endpoint().await else {
        return;
    };
    let Some(dp) = docker().await else { return };
    let store = common::store(&ep, "x-hostile").await;
    let b = create(&dp).await;
    let b = b.get();
    sh(
        b,
        "set -e; mkdir -p /workspace/keep; echo precious > /workspace/keep/mine.txt",
    )
    .await;
    let before = listing(b, b.workdir()).await;
    // The names next to the tree and where the archives aim (names only:
    // every exec touches /tmp, so mtimes of / change anyway).
    let outside = "ls -1a / /etc | sha256sum";
    let outside_before = sh(b, outside).await;

    let archives = [
        (
            "climb",
            raw_tar(&[
                ("ok.txt", tar::EntryType::Regular, "", b"fine\n"),
                ("../escape", tar::EntryType::Regular, "", b"escaped\n"),
            ]),
        ),
        (
            "absolute",
            raw_tar(&[
                ("ok.txt", tar::EntryType::Regular, "", b"fine\n"),
                ("/etc/harness-pwned", tar::EntryType::Regular, "", b"x\n"),
            ]),
        ),
        (
            "symlink-out",
            raw_tar(&[
                ("ok.txt", tar::EntryType::Regular, "", b"fine\n"),
                ("etc-link", tar::EntryType::Symlink, "/etc", b""),
                (
                    "etc-link/harness-pwned",
                    tar::EntryType::Regular,
                    "",
                    b"x\n",
                ),
            ]),
        ),
        (
            "hardlink-out",
            raw_tar(&[
                ("ok.txt", tar::EntryType::Regular, "", b"fine\n"),
                ("passwd", tar::EntryType::Link, "../etc/passwd", b""),
            ]),
        ),
    ];
    for (name, tar_bytes) in archives {
        let zst = zstd::encode_all(&tar_bytes[..], 3).unwrap();
        let key = format!("hostile/{name}.tar.zst");
        store
            .put(&key, harness_core::stream::once(zst))
            .await
            .unwrap();
        let err = moves::restore(&store, &key, b, b.workdir(), None)
            .await
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Unsafe, "{name}: {err}");
        assert_eq!(
            listing(b, b.workdir()).await,
            before,
            "{name}: the target changed"
        );
        assert_eq!(
            sh(b, outside).await,
            outside_before,
            "{name}: something changed outside the target"
        );
    }
    let probe = sh(
        b,
        "for f in /escape /etc/harness-pwned /workspace/ok.txt; do [ -e $f ] && echo $f; done; true",
    )
    .await;
    assert_eq!(probe.trim(), "", "files an archive aimed at exist");
}
