//! The S3 store against a real S3 server (SeaweedFS in CI, at
//! `HARNESS_S3_ENDPOINT`). Each test makes its own bucket.

mod common;

use std::time::Duration;

use bytes::Bytes;
use checkpoint_r2::{S3CheckpointStore, MIN_PART_SIZE, SHA256_METADATA};
use common::{drain, endpoint, generated, open_uploads, raw_keys, store, store_with};
use futures::StreamExt;
use harness_core::checkpoint::CheckpointStore;
use harness_core::stream::{self, ByteStream};
use harness_core::{Error, ErrorKind};

const MIB: u64 = 1024 * 1024;

#[tokio::test]
async fn small_object_round_trip_head_list_delete() {
    let Some(ep) = endpoint().await else { return };
    let s = store(&ep, "basic").await;
    let meta = s
        .put(
            "sessions/s1/turn-1.tar.zst",
            stream::once(&b"hello checkpoint"[..]),
        )
        .await
        .unwrap();
    assert_eq!(meta.size, 16);
    assert_eq!(
        meta.sha256,
        hex::encode(<sha2::Sha256 as sha2::Digest>::digest(b"hello checkpoint"))
    );
    let got = stream::collect(s.get("sessions/s1/turn-1.tar.zst").await.unwrap(), 1 << 20)
        .await
        .unwrap();
    assert_eq!(&got[..], b"hello checkpoint");
    assert_eq!(s.head("sessions/s1/turn-1.tar.zst").await.unwrap(), meta);
    // Stored under the namespace, with the hash as user metadata.
    let raw = s
        .client()
        .head_object()
        .bucket(&s.config().bucket)
        .key(format!(
            "{}sessions/s1/turn-1.tar.zst",
            common::namespace(&s)
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(
        raw.metadata().unwrap().get(SHA256_METADATA),
        Some(&meta.sha256)
    );
    s.delete("sessions/s1/turn-1.tar.zst").await.unwrap();
    s.delete("sessions/s1/turn-1.tar.zst").await.unwrap(); // idempotent
    assert_eq!(
        s.get("sessions/s1/turn-1.tar.zst")
            .await
            .err()
            .unwrap()
            .kind(),
        ErrorKind::NotFound
    );
    assert_eq!(
        s.head("sessions/s1/turn-1.tar.zst")
            .await
            .unwrap_err()
            .kind(),
        ErrorKind::NotFound
    );
}

#[tokio::test]
async fn empty_object_round_trips() {
    let Some(ep) = endpoint().await else { return };
    let s = store(&ep, "empty").await;
    let meta = s.put("e", stream::empty()).await.unwrap();
    assert_eq!(meta.size, 0);
    assert_eq!(
        drain(s.get("e").await.unwrap()).await.unwrap(),
        (0, meta.sha256)
    );
}

#[tokio::test]
async fn invalid_keys_are_refused_before_any_request() {
    let Some(ep) = endpoint().await else { return };
    let s = store(&ep, "keys").await;
    for bad in ["../x", "/abs", "a//b", "a~partial-1", "sp ace", ""] {
        assert_eq!(
            s.put(bad, stream::once(&b"x"[..]))
                .await
                .unwrap_err()
                .kind(),
            ErrorKind::InvalidInput,
            "{bad:?}"
        );
        assert_eq!(
            s.get(bad).await.err().unwrap().kind(),
            ErrorKind::InvalidInput
        );
        assert_eq!(
            s.delete(bad).await.unwrap_err().kind(),
            ErrorKind::InvalidInput
        );
    }
    assert!(raw_keys(&s).await.is_empty());
}

#[tokio::test]
async fn list_is_sorted_by_key_scoped_to_prefix_and_hides_temporaries() {
    let Some(ep) = endpoint().await else { return };
    let s = store(&ep, "list").await;
    for key in ["sessions/b/2", "sessions/a/1", "sessions/b/1", "other/x"] {
        s.put(key, stream::once(Bytes::from(key.to_string())))
            .await
            .unwrap();
    }
    // A leftover temporary from a crashed put, and an object outside the
    // namespace: neither is a checkpoint of this store.
    let ns = common::namespace(&s);
    for raw in [
        format!("{ns}sessions/b/3~partial-dead"),
        format!("{}-elsewhere/sessions/z", s.config().prefix),
    ] {
        s.client()
            .put_object()
            .bucket(&s.config().bucket)
            .key(raw)
            .body(Bytes::from_static(b"junk").into())
            .send()
            .await
            .unwrap();
    }
    let listed = s.list("sessions/").await.unwrap();
    let keys: Vec<_> = listed.iter().map(|m| m.key.as_str()).collect();
    assert_eq!(keys, ["sessions/a/1", "sessions/b/1", "sessions/b/2"]);
    for m in &listed {
        assert_eq!(m.size, m.key.len() as u64);
        assert_eq!(m, &s.head(&m.key).await.unwrap());
    }
    assert_eq!(s.list("sessions/b/").await.unwrap().len(), 2);
    assert_eq!(s.list("").await.unwrap().len(), 4);
    assert!(s.list("nothing/").await.unwrap().is_empty());
}

#[tokio::test]
async fn multipart_put_round_trips_and_leaves_no_temporaries() {
    let Some(ep) = endpoint().await else { return };
    let s = store(&ep, "multi").await;
    // 2.5 parts, in odd-sized chunks so parts straddle chunk boundaries.
    let total = 5 * MIN_PART_SIZE as u64 / 2;
    let (content, sha) = generated(7, total, 100_003);
    let meta = s.put("big/one", content).await.unwrap();
    assert_eq!((meta.size, meta.sha256.as_str()), (total, sha.as_str()));
    assert_eq!(
        drain(s.get("big/one").await.unwrap()).await.unwrap(),
        (total, sha)
    );
    assert_eq!(raw_keys(&s).await, ["big/one"]);
    assert!(open_uploads(&s).await.is_empty());
}

#[tokio::test]
async fn part_boundaries_exactly_one_part_and_one_byte_more() {
    let Some(ep) = endpoint().await else { return };
    let s = store(&ep, "bound").await;
    for (i, total) in [
        MIN_PART_SIZE as u64,
        MIN_PART_SIZE as u64 + 1,
        2 * MIN_PART_SIZE as u64,
    ]
    .into_iter()
    .enumerate()
    {
        let key = format!("b/{i}");
        let (content, sha) = generated(i as u64 + 11, total, 1 << 20);
        let meta = s.put(&key, content).await.unwrap();
        assert_eq!(meta.size, total);
        assert_eq!(
            drain(s.get(&key).await.unwrap()).await.unwrap(),
            (total, sha)
        );
    }
    assert!(open_uploads(&s).await.is_empty());
}

/// The object under `key` as the server stores it: its user metadata and
/// bytes, trailer included.
async fn raw_object(
    s: &S3CheckpointStore,
    key: &str,
) -> (std::collections::HashMap<String, String>, Bytes) {
    let out = s
        .client()
        .get_object()
        .bucket(&s.config().bucket)
        .key(s.object_key(key))
        .send()
        .await
        .unwrap();
    let metadata = out.metadata().cloned().unwrap_or_default();
    (metadata, out.body.collect().await.unwrap().into_bytes())
}

/// A multipart object goes straight to its key, marked at creation, with
/// the hash in its last 40 bytes: a zstd skippable frame, so the raw object
/// of a zstd checkpoint still decompresses to the content.
#[tokio::test]
async fn a_multipart_object_carries_its_hash_as_a_zstd_skippable_frame() {
    let Some(ep) = endpoint().await else { return };
    let s = store_with(common::config(&ep, "trailer").with_part_size(MIN_PART_SIZE)).await;
    // Incompressible enough to need three parts once compressed.
    let (plain, _) = generated(3, 12 * MIB + 5, 256 * 1024);
    let plain = stream::collect(plain, 16 << 20).await.unwrap();
    let packed = Bytes::from(zstd::encode_all(&plain[..], 1).unwrap());
    assert!(packed.len() > 2 * MIN_PART_SIZE, "{} bytes", packed.len());
    let sha = hex::encode(<sha2::Sha256 as sha2::Digest>::digest(&packed));
    let meta = s
        .put("ckpt.tar.zst", stream::once(packed.clone()))
        .await
        .unwrap();
    assert_eq!(
        (meta.size, meta.sha256.as_str()),
        (packed.len() as u64, sha.as_str())
    );
    assert_eq!(s.head("ckpt.tar.zst").await.unwrap(), meta);
    assert_eq!(s.list("").await.unwrap(), std::slice::from_ref(&meta));
    let got = stream::collect(s.get("ckpt.tar.zst").await.unwrap(), 32 << 20)
        .await
        .unwrap();
    assert!(got == packed, "get returns the content without the trailer");

    let (metadata, raw) = raw_object(&s, "ckpt.tar.zst").await;
    assert_eq!(
        metadata.get("sha256-trailer").map(String::as_str),
        Some("zstd-skippable-frame")
    );
    assert_eq!(metadata.get(SHA256_METADATA), None);
    assert_eq!(raw.len(), packed.len() + 40);
    assert_eq!(&raw[..packed.len()], &packed[..]);
    assert_eq!(hex::encode(&raw[packed.len() + 8..]), sha);
    // The raw object is still a zstd stream of the plain content.
    assert!(zstd::decode_all(&raw[..]).unwrap() == plain);
    assert_eq!(raw_keys(&s).await, ["ckpt.tar.zst"]);
    assert!(open_uploads(&s).await.is_empty());
}

#[tokio::test]
async fn overwrite_replaces_content_and_hash() {
    let Some(ep) = endpoint().await else { return };
    let s = store(&ep, "over").await;
    let (a, sha_a) = generated(1, 6 * MIB, 1 << 20);
    let (b, sha_b) = generated(2, 11 * MIB, 1 << 20);
    assert_eq!(s.put("k", a).await.unwrap().sha256, sha_a);
    assert_eq!(s.put("k", b).await.unwrap().sha256, sha_b);
    assert_eq!(s.head("k").await.unwrap().sha256, sha_b);
    assert_eq!(
        drain(s.get("k").await.unwrap()).await.unwrap(),
        (11 * MIB, sha_b)
    );
}

/// Bytes replaced behind the store's back no longer match the recorded
/// hash: the read ends in `Corrupt`.
#[tokio::test]
async fn content_changed_out_of_band_is_corrupt() {
    let Some(ep) = endpoint().await else { return };
    let s = store(&ep, "corrupt").await;
    let (content, _) = generated(5, 7 * MIB, 1 << 20);
    let meta = s.put("c", content).await.unwrap();
    // Same size, one byte different, the old hash kept as metadata: only
    // the content check can notice.
    let (tampered, _) = generated(5, 7 * MIB, 1 << 20);
    let mut bytes = stream::collect(tampered, 8 << 20).await.unwrap().to_vec();
    bytes[3 * MIB as usize] ^= 0x40;
    s.client()
        .put_object()
        .bucket(&s.config().bucket)
        .key(s.object_key("c"))
        .metadata(SHA256_METADATA, &meta.sha256)
        .body(Bytes::from(bytes).into())
        .send()
        .await
        .unwrap();
    let err = drain(s.get("c").await.unwrap()).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");

    // The same for a trailer object: its bytes replaced, its trailer and
    // marker kept.
    let (content, _) = generated(6, 12 * MIB, 1 << 20);
    let meta = s.put("t", content).await.unwrap();
    let mut raw = raw_object(&s, "t").await.1.to_vec();
    assert_eq!(raw.len() as u64, meta.size + 40);
    raw[MIB as usize] ^= 0x40;
    let rewrite = |body: Vec<u8>| {
        s.client()
            .put_object()
            .bucket(&s.config().bucket)
            .key(s.object_key("t"))
            .metadata("sha256-trailer", "zstd-skippable-frame")
            .body(Bytes::from(body).into())
            .send()
    };
    rewrite(raw.clone()).await.unwrap();
    assert_eq!(s.head("t").await.unwrap(), meta, "the trailer is unchanged");
    let err = drain(s.get("t").await.unwrap()).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");
    assert!(err.to_string().contains("failed verification"), "{err}");
    // Cut short: no trailer at the end.
    rewrite(raw[..raw.len() - 20].to_vec()).await.unwrap();
    let err = s.head("t").await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");
    let err = drain(s.get("t").await.unwrap()).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");

    // An object without any recorded hash cannot be verified: refused.
    s.client()
        .put_object()
        .bucket(&s.config().bucket)
        .key(s.object_key("nohash"))
        .body(Bytes::from_static(b"foreign").into())
        .send()
        .await
        .unwrap();
    assert_eq!(
        s.get("nohash").await.err().unwrap().kind(),
        ErrorKind::Corrupt
    );
}

/// A stream that yields `good` bytes, then fails.
fn failing_after(good: u64) -> ByteStream {
    let (ok, _) = generated(9, good, 1 << 20);
    Box::pin(ok.chain(futures::stream::once(async {
        Err(Error::new(ErrorKind::Io, "the source sandbox went away"))
    })))
}

#[tokio::test]
async fn failed_upload_leaves_previous_object_and_no_dangling_upload() {
    let Some(ep) = endpoint().await else { return };
    let s = store(&ep, "fail").await;
    s.put("keep", stream::once(&b"previous"[..])).await.unwrap();
    // Fails in the third part: two parts were uploaded already.
    let err = s.put("keep", failing_after(12 * MIB)).await.unwrap_err();
    assert_eq!(
        err.kind(),
        ErrorKind::Io,
        "the stream's own error surfaces: {err}"
    );
    let got = stream::collect(s.get("keep").await.unwrap(), 1 << 10)
        .await
        .unwrap();
    assert_eq!(&got[..], b"previous");
    // And for a key that never existed: still nothing.
    s.put("fresh", failing_after(7 * MIB)).await.unwrap_err();
    assert_eq!(
        s.head("fresh").await.unwrap_err().kind(),
        ErrorKind::NotFound
    );
    // Failing inside the first part (small-object path) too.
    s.put("tiny", failing_after(1000)).await.unwrap_err();
    assert_eq!(
        s.head("tiny").await.unwrap_err().kind(),
        ErrorKind::NotFound
    );

    assert!(
        open_uploads(&s).await.is_empty(),
        "{:?}",
        open_uploads(&s).await
    );
    assert_eq!(raw_keys(&s).await, ["keep"]);
}

/// A caller that gives up mid-put (drops the future) leaves no open upload
/// behind: the cleanup guard aborts it on a spawned task.
#[tokio::test]
async fn cancelled_put_aborts_its_upload() {
    let Some(ep) = endpoint().await else { return };
    let s = store(&ep, "cancel").await;
    // 6 MiB, then a stream that never ends nor yields.
    let (head, _) = generated(4, 6 * MIB, 1 << 20);
    let stalled: ByteStream = Box::pin(head.chain(futures::stream::pending()));
    let put = s.put("never", stalled);
    assert!(tokio::time::timeout(Duration::from_secs(3), put)
        .await
        .is_err());
    // The abort runs on a spawned task; give it a moment.
    let mut open = open_uploads(&s).await;
    for _ in 0..50 {
        if open.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        open = open_uploads(&s).await;
    }
    assert!(open.is_empty(), "dangling uploads: {open:?}");
    assert!(raw_keys(&s).await.is_empty());
}

#[tokio::test]
async fn cleanup_stale_removes_leftovers_of_crashed_puts() {
    let Some(ep) = endpoint().await else { return };
    let s = store(&ep, "stale").await;
    s.put("real", stream::once(&b"keep me"[..])).await.unwrap();
    // What a process killed mid-put leaves: an open upload (on its final
    // key), and a temporary object of a version before the hash trailer.
    s.client()
        .create_multipart_upload()
        .bucket(&s.config().bucket)
        .key(s.object_key("x"))
        .send()
        .await
        .unwrap();
    s.client()
        .put_object()
        .bucket(&s.config().bucket)
        .key(s.object_key("y~partial-crashed"))
        .body(Bytes::from_static(b"half").into())
        .send()
        .await
        .unwrap();
    // Young leftovers may belong to a put still running: kept.
    assert_eq!(s.cleanup_stale(Duration::from_secs(3600)).await.unwrap(), 0);
    assert_eq!(s.cleanup_stale(Duration::ZERO).await.unwrap(), 2);
    assert!(open_uploads(&s).await.is_empty());
    assert_eq!(raw_keys(&s).await, ["real"]);
}

#[tokio::test]
async fn missing_bucket_is_a_backend_error_not_not_found() {
    let Some(ep) = endpoint().await else { return };
    let mut cfg = common::config(&ep, "absent");
    cfg.bucket = format!("absent-{}", uuid::Uuid::new_v4().simple());
    let s = S3CheckpointStore::new(cfg).unwrap();
    let err = s.get("k").await.err().unwrap();
    assert_eq!(err.kind(), ErrorKind::Backend, "{err}");
    assert!(err.message().contains("bucket"), "{err}");
}
