//! The shared `CheckpointStore` conformance suite against an encrypted
//! store over the memory store, and the encryption's own promises: the
//! raw store holds no content, another lineage's key cannot read, and
//! every change to the sealed bytes is caught by the encrypted store
//! itself (the raw store is handed consistent objects).

use std::sync::Arc;

use checkpoint_crypt::{format, DeploymentKey, EncryptedStore, Lineages};
use harness_core::checkpoint::{CheckpointStore, MemoryCheckpointStore};
use harness_core::stream;
use harness_core::ErrorKind;
use harness_testkit::conformance::checkpoint::{generated, run_all, sealed_tamper, StoreUnderTest};

fn encrypted(raw: Arc<dyn CheckpointStore>, lineage: &str) -> Arc<dyn CheckpointStore> {
    let key = DeploymentKey::from_secret(&[42; 32]).unwrap();
    Arc::new(EncryptedStore::new(raw, key.lineage(lineage)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn encrypted_store_passes_the_checkpoint_conformance_suite() {
    run_all(|| async {
        let raw: Arc<dyn CheckpointStore> = Arc::new(MemoryCheckpointStore::default());
        let view = encrypted(raw.clone(), "suite");
        StoreUnderTest::new(
            view.clone(),
            sealed_tamper(raw, view, format::HEADER as usize),
        )
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn the_raw_store_holds_no_content_and_another_key_reads_nothing() {
    let raw: Arc<dyn CheckpointStore> = Arc::new(MemoryCheckpointStore::default());
    let mine = encrypted(raw.clone(), "lineage-a");
    let marker = b"MARKER-7f3a-the-store-must-never-see-this";
    let mut content = stream::collect(generated(200_000, 4096, 3), usize::MAX)
        .await
        .unwrap()
        .to_vec();
    for at in [0, 65_530, 150_000] {
        content[at..at + marker.len()].copy_from_slice(marker);
    }
    let meta = mine
        .put("trees/t1", stream::once(content.clone()))
        .await
        .unwrap();
    assert_eq!(meta.size, content.len() as u64);
    let stored = stream::collect(raw.get("trees/t1").await.unwrap(), usize::MAX)
        .await
        .unwrap();
    assert_eq!(
        stored.len() as u64,
        format::sealed_size(content.len() as u64)
    );
    assert!(
        !stored.windows(marker.len()).any(|w| w == marker),
        "the marker is readable in the raw store"
    );
    assert_eq!(mine.head("trees/t1").await.unwrap(), meta);
    let back = stream::collect(mine.get("trees/t1").await.unwrap(), usize::MAX)
        .await
        .unwrap();
    assert_eq!(&back[..], &content[..]);
    // Across a segment boundary.
    let range = mine.get_range("trees/t1", 65_000..70_000).await.unwrap();
    assert_eq!(&range[..], &content[65_000..70_000]);

    let theirs = encrypted(raw.clone(), "lineage-b");
    for (what, result) in [
        (
            "get",
            match theirs.get("trees/t1").await {
                Ok(s) => stream::collect(s, usize::MAX).await.map(|_| ()),
                Err(e) => Err(e),
            },
        ),
        ("head", theirs.head("trees/t1").await.map(|_| ())),
        (
            "get_range",
            theirs.get_range("trees/t1", 0..10).await.map(|_| ()),
        ),
    ] {
        let e = result.expect_err(what);
        assert_eq!(e.kind(), ErrorKind::Unauthorized, "{what}: {e}");
        assert!(e.to_string().contains("another key"), "{what}: {e}");
    }
}

#[tokio::test]
async fn recorded_keys_resolve_to_their_lineage() {
    let raw: Arc<dyn CheckpointStore> = Arc::new(MemoryCheckpointStore::default());
    let lineages = Lineages::new(
        raw.clone(),
        Some(DeploymentKey::from_secret(&[9; 32]).unwrap()),
    );
    let (store, prefix) = lineages.for_new("s1").unwrap();
    assert_eq!(prefix, "lineages/s1/");
    store
        .put("turns/s2/t1/turn.json", stream::once(&b"{}"[..]))
        .await
        .unwrap();
    assert_eq!(
        raw.list_keys("").await.unwrap(),
        ["lineages/s1/turns/s2/t1/turn.json"]
    );
    let (view, key) = lineages
        .resolve("lineages/s1/turns/s2/t1/turn.json")
        .unwrap();
    assert_eq!(key, "turns/s2/t1/turn.json");
    let back = stream::collect(view.get(&key).await.unwrap(), 64)
        .await
        .unwrap();
    assert_eq!(&back[..], b"{}");
    assert_eq!(lineages.list().await.unwrap(), ["s1"]);
    // A key given without its lineage is found in the one holding it.
    assert_eq!(lineages.holding("turns/s2/t1").await.unwrap(), ["s1"]);
    assert_eq!(
        lineages.holding("turns/s2/t1/turn.json").await.unwrap(),
        ["s1"]
    );
    assert!(lineages.holding("turns/s2/t").await.unwrap().is_empty());
    // A plain key reads the plain store; without a deployment key an
    // encrypted one is refused with the variable to set.
    let (plain, key) = lineages.resolve("turns/x/t").unwrap();
    assert!(Arc::ptr_eq(&plain, &raw) && key == "turns/x/t");
    let keyless = Lineages::new(raw, None);
    let e = keyless
        .resolve("lineages/s1/turns/s2/t1/turn.json")
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unauthorized);
    assert!(e.to_string().contains("HARNESS_CHECKPOINT_KEY"), "{e}");
}

/// Changes the suite's tamper hook does not make (it maps content offsets
/// onto data segments): the trailer, the header, whole segments moved,
/// dropped or taken from another object. Each is caught by the encrypted
/// store itself, on `get`, and on `head` where it reads the part changed.
#[tokio::test]
async fn every_change_to_the_sealed_bytes_is_caught() {
    let raw: Arc<dyn CheckpointStore> = Arc::new(MemoryCheckpointStore::default());
    let view = encrypted(raw.clone(), "l");
    let seg = format::SEALED_SEGMENT as usize;
    let h = format::HEADER as usize;
    // Three full segments exactly, so dropping one keeps a plausible size.
    let content = stream::collect(generated(3 * format::SEGMENT, 4096, 5), usize::MAX)
        .await
        .unwrap();
    view.put("k", stream::once(content.clone())).await.unwrap();
    view.put("other", stream::once(content.clone()))
        .await
        .unwrap();
    let sealed = stream::collect(raw.get("k").await.unwrap(), usize::MAX)
        .await
        .unwrap()
        .to_vec();
    let other = stream::collect(raw.get("other").await.unwrap(), usize::MAX)
        .await
        .unwrap()
        .to_vec();
    let n = sealed.len();
    let flip = |at: usize| {
        let mut b = sealed.clone();
        b[at] ^= 0x80;
        b
    };
    let cases: Vec<(&str, Vec<u8>, ErrorKind)> = vec![
        (
            "the trailer's last byte flipped",
            flip(n - 1),
            ErrorKind::Corrupt,
        ),
        ("the magic flipped", flip(0), ErrorKind::Corrupt),
        ("the salt flipped", flip(20), ErrorKind::Corrupt),
        ("the key id flipped", flip(5), ErrorKind::Unauthorized),
        (
            "the trailer dropped",
            sealed[..n - 48].to_vec(),
            ErrorKind::Corrupt,
        ),
        (
            "the last data segment dropped",
            [&sealed[..h + 2 * seg], &sealed[n - 48..]].concat(),
            ErrorKind::Corrupt,
        ),
        (
            "two segments swapped",
            [
                &sealed[..h],
                &sealed[h + seg..h + 2 * seg],
                &sealed[h..h + seg],
                &sealed[h + 2 * seg..],
            ]
            .concat(),
            ErrorKind::Corrupt,
        ),
        (
            "a segment from another object",
            [&sealed[..h], &other[h..h + seg], &sealed[h + seg..]].concat(),
            ErrorKind::Corrupt,
        ),
        ("the whole other object", other.clone(), ErrorKind::Corrupt),
    ];
    for (what, bytes, kind) in cases {
        raw.put("k", stream::once(bytes)).await.unwrap();
        let read = match view.get("k").await {
            Ok(s) => stream::collect(s, usize::MAX).await.map(|_| ()),
            Err(e) => Err(e),
        };
        let e = read.expect_err(what);
        assert_eq!(e.kind(), kind, "{what}: {e}");
    }
    // The original reads again: the cases above were the only change.
    raw.put("k", stream::once(sealed)).await.unwrap();
    let back = stream::collect(view.get("k").await.unwrap(), usize::MAX)
        .await
        .unwrap();
    assert_eq!(back, content);
}
