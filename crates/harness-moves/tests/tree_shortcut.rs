//! The re-checkpoint's shortcut (a file whose stat is the one the parent
//! recorded keeps the parent's chunks unread) never keeps a changed file:
//! files edited so that size, mtime and mode stay the same — in place, and
//! replaced through a rename — are read again, and the tree restored from
//! the re-checkpoint is the source's, byte for byte. Files that did not
//! change are not read. Local sandboxes (GNU `find` and `tar`), memory
//! store: runs everywhere.

mod common;

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::{fresh_local, wall_clock};
use harness_core::checkpoint::MemoryCheckpointStore;
use harness_moves::tree::{checkpoint_tree, restore_tree, TreeCheckpointInfo};
use sandbox_local::LocalProvider;

/// A second long past: files pinned to it are never "racy".
const OLD: u64 = 1_600_000_000;

/// Set `path`'s mtime to `secs` (and so move its ctime to now).
fn set_mtime(path: &Path, secs: u64) {
    let status = Command::new("touch")
        .arg("-m")
        .arg("-d")
        .arg(format!("@{secs}"))
        .arg(path)
        .status()
        .unwrap();
    assert!(status.success(), "touch {}", path.display());
}

fn content(tag: &str) -> Vec<u8> {
    // Every version of every file has the same size.
    format!("{tag:<63}\n").into_bytes()
}

/// Per file: content and mode.
fn snapshot(root: &Path) -> BTreeMap<String, (Vec<u8>, u32)> {
    let mut out = BTreeMap::new();
    for entry in std::fs::read_dir(root).unwrap() {
        let path = entry.unwrap().path();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o7777;
        out.insert(
            path.file_name().unwrap().to_string_lossy().into_owned(),
            (std::fs::read(&path).unwrap(), mode),
        );
    }
    out
}

/// Restore `key` into an empty sandbox and compare it with `src`.
async fn assert_restores_to(
    store: &MemoryCheckpointStore,
    key: &str,
    provider: &LocalProvider,
    src: &Path,
) {
    let b = fresh_local(provider).await;
    restore_tree(store, key, b.as_ref(), b.workdir(), None)
        .await
        .unwrap();
    let want = snapshot(src);
    let got = snapshot(Path::new(b.workdir()));
    for (path, node) in &want {
        assert_eq!(
            got.get(path),
            Some(node),
            "{path} restored from {key} is not the source's"
        );
    }
    assert_eq!(got.len(), want.len(), "restored from {key}");
    b.destroy().await.unwrap();
}

#[tokio::test]
async fn a_changed_file_is_read_again_whatever_stat_it_keeps() {
    let root = tempfile::tempdir().unwrap();
    let provider = LocalProvider::new(root.path());
    let a = fresh_local(&provider).await;
    let src = Path::new(a.workdir()).to_path_buf();
    let store = MemoryCheckpointStore::new();
    let clock = wall_clock();
    for i in 0..20 {
        let path = src.join(format!("f{i:02}.txt"));
        std::fs::write(&path, content(&format!("file {i}, version 1"))).unwrap();
        set_mtime(&path, OLD);
    }
    let checkpoint = |key: &'static str, parent: Option<&'static str>| {
        let (a, store, clock) = (a.as_ref(), &store, &clock);
        async move {
            checkpoint_tree(a, a.workdir(), store, key, parent, clock, None)
                .await
                .unwrap()
        }
    };
    let first: TreeCheckpointInfo = checkpoint("trees/t1", None).await;
    assert_eq!(first.files_read, 20);
    // ctime follows the kernel's clock tick: let it move on.
    tokio::time::sleep(Duration::from_millis(50)).await;

    // Nothing changed: nothing is read.
    let same = checkpoint("trees/t2", Some("trees/t1")).await;
    assert_eq!(same.files_read, 0, "unchanged files were read");

    // Three files change keeping size, mtime and mode:
    // f00 rewritten in place (same inode), mtime set back;
    let f00 = src.join("f00.txt");
    std::fs::write(&f00, content("file 0, version 2")).unwrap();
    set_mtime(&f00, OLD);
    // f01 replaced by a file renamed over it (another inode);
    let tmp = src.join(".f01.tmp");
    std::fs::write(&tmp, content("file 1, version 2")).unwrap();
    set_mtime(&tmp, OLD);
    std::fs::rename(&tmp, src.join("f01.txt")).unwrap();
    // f02's mode changed and changed back, then its content, mtime set back.
    let f02 = src.join("f02.txt");
    std::fs::set_permissions(&f02, std::fs::Permissions::from_mode(0o600)).unwrap();
    std::fs::set_permissions(&f02, std::fs::Permissions::from_mode(0o644)).unwrap();
    std::fs::write(&f02, content("file 2, version 2")).unwrap();
    set_mtime(&f02, OLD);
    // (A rename can land on a recycled inode number: the ctime still moved.)
    let changed = checkpoint("trees/t3", Some("trees/t2")).await;
    assert_eq!(
        changed.files_read, 3,
        "exactly the three changed files are read"
    );
    assert_restores_to(&store, "trees/t3", &provider, &src).await;

    // The files read again recorded their new stat: a checkpoint after
    // this one reads nothing.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let settled = checkpoint("trees/t4", Some("trees/t3")).await;
    assert_eq!(
        settled.files_read, 0,
        "re-read files got their stat recorded"
    );

    // Racy: a file whose mtime is not older than the second the parent was
    // listed is read every time, even when nothing else tells it changed.
    let future = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 3600;
    let f03 = src.join("f03.txt");
    set_mtime(&f03, future);
    let racy = checkpoint("trees/t5", Some("trees/t4")).await;
    assert_eq!(racy.files_read, 1);
    let racy_again = checkpoint("trees/t6", Some("trees/t5")).await;
    assert_eq!(racy_again.files_read, 1, "a racy file is read again");
    assert_restores_to(&store, "trees/t6", &provider, &src).await;
    a.destroy().await.unwrap();
}

#[tokio::test]
async fn a_tree_restored_elsewhere_is_read_once_then_trusted() {
    // Restoring writes new inodes and ctimes: the first re-checkpoint of
    // the restored tree against the checkpoint it came from reads every
    // file (and uploads nothing new); the next one reads only changes.
    let root = tempfile::tempdir().unwrap();
    let provider = LocalProvider::new(root.path());
    let a = fresh_local(&provider).await;
    let store = MemoryCheckpointStore::new();
    let clock = wall_clock();
    for i in 0..10 {
        let path = Path::new(a.workdir()).join(format!("f{i}.txt"));
        std::fs::write(&path, content(&format!("file {i}"))).unwrap();
        set_mtime(&path, OLD);
    }
    checkpoint_tree(a.as_ref(), a.workdir(), &store, "t/a1", None, &clock, None)
        .await
        .unwrap();
    let b = fresh_local(&provider).await;
    restore_tree(&store, "t/a1", b.as_ref(), b.workdir(), None)
        .await
        .unwrap();
    let moved = checkpoint_tree(
        b.as_ref(),
        b.workdir(),
        &store,
        "t/b1",
        Some("t/a1"),
        &clock,
        None,
    )
    .await
    .unwrap();
    assert_eq!(moved.files_read, 10);
    assert_eq!(moved.chunks_uploaded, 0, "the content was in the store");
    tokio::time::sleep(Duration::from_millis(50)).await;
    let path = Path::new(b.workdir()).join("f3.txt");
    std::fs::write(&path, content("file 3, edited in B")).unwrap();
    set_mtime(&path, OLD);
    let next = checkpoint_tree(
        b.as_ref(),
        b.workdir(),
        &store,
        "t/b2",
        Some("t/b1"),
        &clock,
        None,
    )
    .await
    .unwrap();
    assert_eq!(next.files_read, 1);
    assert_restores_to(&store, "t/b2", &provider, Path::new(b.workdir())).await;
}
