//! Moving a working tree between two local sandboxes through the S3 store
//! with the core move pipeline (`harness_moves`), and refusing a
//! hostile archive planted in the store.

mod common;

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use harness_core::checkpoint::CheckpointStore;
use harness_core::sandbox::{Sandbox, SandboxProvider, SandboxSpec};
use harness_core::ErrorKind;
use harness_moves as moves;
use sandbox_local::LocalProvider;

/// What a tree holds, for exact comparison: per relative path, a file's
/// bytes and mode, a symlink's target, or a directory.
#[derive(Debug, PartialEq, Eq, Clone)]
enum Node {
    Dir,
    File(Vec<u8>, u32),
    Link(String),
}

fn snapshot(root: &Path) -> BTreeMap<String, Node> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<String, Node>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let entry = entry.unwrap();
            let path = entry.path();
            let rel = path
                .strip_prefix(root)
                .unwrap()
                .to_string_lossy()
                .into_owned();
            let meta = std::fs::symlink_metadata(&path).unwrap();
            if meta.file_type().is_symlink() {
                let target = std::fs::read_link(&path).unwrap();
                out.insert(rel, Node::Link(target.to_string_lossy().into_owned()));
            } else if meta.is_dir() {
                out.insert(rel, Node::Dir);
                walk(root, &path, out);
            } else {
                let mode = meta.permissions().mode() & 0o777;
                out.insert(rel, Node::File(std::fs::read(&path).unwrap(), mode));
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(root, root, &mut out);
    out
}

async fn sandbox(provider: &LocalProvider) -> Box<dyn Sandbox> {
    provider
        .create(&SandboxSpec::new("/workspace"))
        .await
        .expect("create local sandbox")
}

#[tokio::test]
async fn tree_moves_between_local_sandboxes_through_s3_and_overlays() {
    let Some(ep) = common::endpoint().await else {
        return;
    };
    let store = common::store(&ep, "moves").await;
    let root = tempfile::tempdir().unwrap();
    let provider = LocalProvider::new(root.path());
    let a = sandbox(&provider).await;
    let b = sandbox(&provider).await;
    let src = Path::new(a.workdir());
    let dst = Path::new(b.workdir());

    // Source tree: nested text, a 7 MB binary (so the checkpoint spans
    // several parts even compressed), an executable, a relative symlink
    // that stays inside the tree, an empty directory.
    std::fs::create_dir_all(src.join("src/deep/er")).unwrap();
    std::fs::create_dir_all(src.join("empty")).unwrap();
    for i in 0..50 {
        std::fs::write(
            src.join(format!("src/deep/er/file{i}.rs")),
            format!("fn f{i}() -> u32 {{ {i} }}\n").repeat(i + 1),
        )
        .unwrap();
    }
    let blob = common::drain_to_vec(common::generated_stream(5, 7_000_000, 1 << 20)).await;
    std::fs::write(src.join("blob.bin"), &blob).unwrap();
    std::fs::write(src.join("run.sh"), "#!/bin/sh\necho hi\n").unwrap();
    std::fs::set_permissions(src.join("run.sh"), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::os::unix::fs::symlink("src/deep/er/file3.rs", src.join("link.rs")).unwrap();
    std::fs::write(src.join("shared.txt"), "from A\n").unwrap();

    // Target: a file only B has (must survive) and one both have (A wins).
    std::fs::write(dst.join("b-only.txt"), "made in B after the checkpoint\n").unwrap();
    std::fs::write(dst.join("shared.txt"), "old B version\n").unwrap();

    let info = moves::checkpoint(
        a.as_ref(),
        a.workdir(),
        &store,
        "sessions/s1/turn-1.tar.zst",
        None,
    )
    .await
    .unwrap();
    assert!(info.tar_bytes > 7_000_000, "tar bytes {}", info.tar_bytes);
    assert_eq!(
        store.head("sessions/s1/turn-1.tar.zst").await.unwrap(),
        info.object
    );
    moves::restore(
        &store,
        "sessions/s1/turn-1.tar.zst",
        b.as_ref(),
        b.workdir(),
        None,
    )
    .await
    .unwrap();

    let want = snapshot(src);
    let mut got = snapshot(dst);
    assert_eq!(
        got.remove("b-only.txt"),
        Some(Node::File(
            b"made in B after the checkpoint\n".to_vec(),
            0o644
        )),
        "a file made only in the target must stay"
    );
    assert_eq!(
        got.len(),
        want.len(),
        "{:?}",
        got.keys().collect::<Vec<_>>()
    );
    for (path, node) in &want {
        assert_eq!(got.get(path), Some(node), "{path} differs after the move");
    }
    a.destroy().await.unwrap();
    b.destroy().await.unwrap();
}

/// A tar whose entries are written with raw header names, so it can hold
/// what the `tar` crate's safe setters refuse (`..`).
fn raw_tar(entries: &[(&str, tar::EntryType, &str, &[u8])]) -> Vec<u8> {
    let mut builder = tar::Builder::new(Vec::new());
    for (name, kind, link, data) in entries {
        let mut header = tar::Header::new_ustar();
        let raw = header.as_old_mut();
        raw.name = [0; 100];
        raw.name[..name.len()].copy_from_slice(name.as_bytes());
        if !link.is_empty() {
            raw.linkname = [0; 100];
            raw.linkname[..link.len()].copy_from_slice(link.as_bytes());
        }
        header.set_entry_type(*kind);
        header.set_mode(if *kind == tar::EntryType::Symlink {
            0o777
        } else {
            0o644
        });
        header.set_size(data.len() as u64);
        header.set_mtime(1_700_000_000);
        header.set_cksum();
        builder.append(&header, *data).unwrap();
    }
    builder.into_inner().unwrap()
}

#[tokio::test]
async fn hostile_archives_in_the_store_are_refused_and_change_nothing() {
    let Some(ep) = common::endpoint().await else {
        return;
    };
    let store = common::store(&ep, "hostile").await;
    let root = tempfile::tempdir().unwrap();
    let provider = LocalProvider::new(root.path());
    let b = sandbox(&provider).await;
    let dst = Path::new(b.workdir());
    std::fs::create_dir_all(dst.join("keep")).unwrap();
    std::fs::write(dst.join("keep/mine.txt"), "precious\n").unwrap();
    let before = snapshot(dst);
    let parent_before = snapshot(dst.parent().unwrap());

    let archives = [
        (
            "climb",
            raw_tar(&[
                ("ok.txt", tar::EntryType::Regular, "", b"fine\n"),
                ("../escape", tar::EntryType::Regular, "", b"escaped\n"),
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
    ];
    for (name, tar_bytes) in archives {
        let zst = zstd::encode_all(&tar_bytes[..], 3).unwrap();
        let key = format!("hostile/{name}.tar.zst");
        store
            .put(&key, harness_core::stream::once(zst))
            .await
            .unwrap();
        let err = moves::restore(&store, &key, b.as_ref(), b.workdir(), None)
            .await
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Unsafe, "{name}: {err}");
        assert_eq!(snapshot(dst), before, "{name}: the target changed");
        assert_eq!(
            snapshot(dst.parent().unwrap()),
            parent_before,
            "{name}: something was written next to the target"
        );
    }
    assert!(!Path::new("/etc/harness-pwned").exists());
    b.destroy().await.unwrap();
}

/// Checkpoint a tree, then replace the stored bytes without touching the
/// recorded hash (`swap(key, bytes)`: what a bit flip on the server's disk,
/// or a tampering writer, does) and restore: a valid archive of other
/// content, a truncated one and a flipped byte must all fail and leave the
/// target, and the directory around it, as they were.
async fn corrupted_checkpoints_restore_nothing<F, Fut>(store: &dyn CheckpointStore, swap: F)
where
    F: Fn(String, Vec<u8>) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let root = tempfile::tempdir().unwrap();
    let provider = LocalProvider::new(root.path());
    let a = sandbox(&provider).await;
    let b = sandbox(&provider).await;
    let src = Path::new(a.workdir());
    let dst = Path::new(b.workdir());
    std::fs::create_dir_all(src.join("src")).unwrap();
    for i in 0..20 {
        std::fs::write(
            src.join(format!("src/f{i}.rs")),
            format!("fn f{i}() {{}}\n"),
        )
        .unwrap();
    }
    std::fs::write(src.join("shared.txt"), "from A\n").unwrap();
    std::fs::write(dst.join("shared.txt"), "B's own\n").unwrap();
    let key = "corrupt/tree.tar.zst";
    moves::checkpoint(a.as_ref(), a.workdir(), store, key, None)
        .await
        .unwrap();
    let good = common::drain_to_vec(store.get(key).await.unwrap()).await;
    let before = snapshot(dst);
    let around = snapshot(root.path());

    // A whole, safe archive of other content: only the hash tells.
    let other = zstd::encode_all(
        &raw_tar(&[
            ("shared.txt", tar::EntryType::Regular, "", b"swapped\n"),
            ("planted.txt", tar::EntryType::Regular, "", b"planted\n"),
        ])[..],
        3,
    )
    .unwrap();
    let mut flipped = good.clone();
    let mid = flipped.len() / 2;
    flipped[mid] ^= 0x40;
    let truncated = good[..good.len() - 7].to_vec();
    for (name, bytes) in [
        ("other content", other),
        ("flipped", flipped),
        ("truncated", truncated),
    ] {
        swap(key.to_string(), bytes).await;
        let err = moves::restore(store, key, b.as_ref(), b.workdir(), None)
            .await
            .unwrap_err();
        assert!(
            matches!(
                err.kind(),
                ErrorKind::Corrupt | ErrorKind::Io | ErrorKind::Backend
            ),
            "{name}: {err}"
        );
        if name == "other content" {
            assert_eq!(err.kind(), ErrorKind::Corrupt, "{name}: {err}");
        }
        assert_eq!(snapshot(dst), before, "{name}: the target changed");
        assert_eq!(
            snapshot(root.path()),
            around,
            "{name}: something was left around the target"
        );
    }
    // The genuine bytes back: the restore goes through.
    swap(key.to_string(), good).await;
    moves::restore(store, key, b.as_ref(), b.workdir(), None)
        .await
        .unwrap();
    assert_eq!(
        std::fs::read_to_string(dst.join("shared.txt")).unwrap(),
        "from A\n"
    );
    a.destroy().await.unwrap();
    b.destroy().await.unwrap();
}

#[tokio::test]
async fn corrupted_checkpoints_in_the_memory_store_restore_nothing() {
    let store = harness_core::checkpoint::MemoryCheckpointStore::new();
    let swapper = store.clone();
    corrupted_checkpoints_restore_nothing(&store, |key, bytes| {
        swapper.corrupt_for_test(&key, bytes.into());
        async {}
    })
    .await;
}

#[tokio::test]
async fn corrupted_checkpoints_in_s3_restore_nothing() {
    let Some(ep) = common::endpoint().await else {
        return;
    };
    let store = common::store(&ep, "corrupt-move").await;
    let swapper = store.clone();
    corrupted_checkpoints_restore_nothing(&store, |key, bytes| {
        let s3 = swapper.clone();
        async move {
            let recorded = s3.head(&key).await.unwrap().sha256;
            s3.client()
                .put_object()
                .bucket(&s3.config().bucket)
                .key(s3.object_key(&key))
                .metadata(checkpoint_r2::SHA256_METADATA, recorded)
                .body(bytes.into())
                .send()
                .await
                .unwrap();
        }
    })
    .await;
}
