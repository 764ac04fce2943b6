//! The shared `CheckpointStore` conformance suite against a directory on
//! this machine's file system, each check in a fresh directory.

use std::sync::Arc;

use bytes::Bytes;
use checkpoint_fs::FsCheckpointStore;
use harness_core::checkpoint::{CheckpointStore, SHA256_TRAILER_LEN};
use harness_testkit::conformance::checkpoint::{run_all, StoreUnderTest};

/// The suite's tamper hook: other bytes in the object's file, followed by
/// the hash trailer the store wrote at put (so the store still "records"
/// the old hash, as a disk that changed under it would).
fn overwrite_keeping_hash(
    store: &FsCheckpointStore,
    key: &str,
    bytes: &[u8],
) -> anyhow::Result<()> {
    let path = store.object_path(key)?;
    let stored = std::fs::read(&path)?;
    anyhow::ensure!(stored.len() >= SHA256_TRAILER_LEN, "{key:?} has no trailer");
    let mut out = bytes.to_vec();
    out.extend_from_slice(&stored[stored.len() - SHA256_TRAILER_LEN..]);
    std::fs::write(&path, out)?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fs_store_passes_the_checkpoint_conformance_suite() {
    // Every store's directory lives as long as the test.
    let dirs = Arc::new(std::sync::Mutex::new(Vec::new()));
    run_all(|| {
        let dirs = dirs.clone();
        async move {
            let dir = tempfile::tempdir().unwrap();
            let store = FsCheckpointStore::open(dir.path().join("store")).unwrap();
            dirs.lock().unwrap().push(dir);
            let raw = store.clone();
            StoreUnderTest::new(
                Arc::new(store),
                Arc::new(move |key: String, bytes: Bytes| {
                    let raw = raw.clone();
                    Box::pin(async move { overwrite_keeping_hash(&raw, &key, &bytes) })
                }),
            )
        }
    })
    .await
    .unwrap();
}

/// A key can be an object and the prefix of other objects at once (as in
/// any object store); deleting objects leaves no empty directories behind;
/// temporaries of puts never show in a listing.
#[tokio::test]
async fn nested_keys_coexist_and_deletes_leave_no_directories() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("store");
    let store = FsCheckpointStore::open(&root).unwrap();
    for key in ["a", "a/b", "a/b/c", "a/bc"] {
        store
            .put(
                key,
                harness_core::stream::once(Bytes::from(key.to_string())),
            )
            .await
            .unwrap();
    }
    assert_eq!(
        store.list_keys("").await.unwrap(),
        ["a", "a/b", "a/b/c", "a/bc"]
    );
    assert_eq!(
        store.list_keys("a/b").await.unwrap(),
        ["a/b", "a/b/c", "a/bc"]
    );
    assert_eq!(store.head("a/b").await.unwrap().size, 3);
    // A stray file in the temporaries' directory is not an object.
    std::fs::write(root.join("~tmp").join("leftover"), b"x").unwrap();
    assert_eq!(store.list("").await.unwrap().len(), 4);
    for key in ["a", "a/b", "a/b/c", "a/bc"] {
        store.delete(key).await.unwrap();
    }
    assert!(store.list_keys("").await.unwrap().is_empty());
    let mut left: Vec<String> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    assert_eq!(left, ["~tmp"], "empty directories were left behind");
}

/// A put whose future is dropped midway leaves no temporary file and no
/// object.
#[tokio::test]
async fn a_dropped_put_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("store");
    let store = FsCheckpointStore::open(&root).unwrap();
    let endless: harness_core::stream::ByteStream =
        Box::pin(futures::stream::unfold((), |()| async {
            tokio::task::yield_now().await;
            Some((Ok(Bytes::from_static(&[7u8; 4096])), ()))
        }));
    let put = store.put("d/never", endless);
    assert!(
        tokio::time::timeout(std::time::Duration::from_millis(200), put)
            .await
            .is_err(),
        "an endless put finished"
    );
    assert_eq!(std::fs::read_dir(root.join("~tmp")).unwrap().count(), 0);
    assert!(store.list_keys("").await.unwrap().is_empty());
}

/// `open` on a path that is a file is a clear error.
#[test]
fn opening_a_file_as_a_store_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("f");
    std::fs::write(&file, b"x").unwrap();
    let err = FsCheckpointStore::open(&file).unwrap_err();
    assert!(err.message().contains(&file.display().to_string()), "{err}");
}
