//! The compression and scanning stages of the move pipeline, on archives
//! built with the `tar` crate.

use bytes::Bytes;
use futures::StreamExt;
use harness_core::stream::{self, ByteStream};
use harness_core::ErrorKind;
use harness_moves::{compress, decompress, scanned};

fn archive(files: &[(&str, &[u8])]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (path, data) in files {
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_cksum();
        b.append_data(&mut h, path, *data).unwrap();
    }
    b.into_inner().unwrap()
}

fn chunked(bytes: Vec<u8>, chunk: usize) -> ByteStream {
    let chunks: Vec<harness_core::Result<Bytes>> = bytes
        .chunks(chunk)
        .map(|c| Ok(Bytes::copy_from_slice(c)))
        .collect();
    Box::pin(futures::stream::iter(chunks))
}

#[tokio::test]
async fn compress_then_decompress_is_identity() {
    let big: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
    let tar = archive(&[("a.txt", b"hello"), ("dir/big.bin", &big)]);
    let zst = stream::collect(compress(chunked(tar.clone(), 10_000), 3), 64 << 20)
        .await
        .unwrap();
    assert!(
        zst.len() < tar.len() / 10,
        "repetitive content compresses ({} -> {})",
        tar.len(),
        zst.len()
    );
    let back = stream::collect(scanned(decompress(chunked(zst.to_vec(), 777))), 64 << 20)
        .await
        .unwrap();
    assert_eq!(back.to_vec(), tar);
}

#[tokio::test]
async fn scanned_stream_fails_on_an_unsafe_entry() {
    let mut tar = archive(&[("ok.txt", b"fine")]);
    // Append a hostile entry by hand (the builder refuses to make one).
    let mut h = tar::Header::new_gnu();
    h.as_old_mut().name[..9].copy_from_slice(b"../escape");
    h.set_size(0);
    h.set_mode(0o644);
    h.set_cksum();
    let end = tar.len() - 1024;
    tar.truncate(end);
    tar.extend_from_slice(h.as_bytes());
    tar.extend_from_slice(&[0u8; 1024]);
    let mut s = scanned(chunked(tar, 300));
    let mut err = None;
    while let Some(item) = s.next().await {
        if let Err(e) = item {
            err = Some(e);
            break;
        }
    }
    let err = err.expect("the stream must fail");
    assert_eq!(err.kind(), ErrorKind::Unsafe);
}

#[tokio::test]
async fn corrupt_compressed_data_is_an_error() {
    let zst = stream::collect(compress(chunked(archive(&[("a", b"x")]), 100), 3), 1 << 20)
        .await
        .unwrap();
    let mut bad = zst.to_vec();
    let mid = bad.len() / 2;
    bad.truncate(mid);
    assert!(stream::collect(decompress(chunked(bad, 100)), 1 << 20)
        .await
        .is_err());
}
