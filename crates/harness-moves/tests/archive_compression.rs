//! `moves::compress_archive`: whole archives compressed by libzstd's own
//! worker threads, driven without a flush each time the input waits.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use futures::Stream;
use harness_core::stream::{self, ByteStream};
use harness_moves::{compress, compress_archive, decompress};

/// Pseudo-random but compressible: words from a small vocabulary, so the
/// ratio of a multi-job archive can be compared with one encoder's.
fn text(len: usize) -> Vec<u8> {
    const WORDS: &[&[u8]] = &[
        b"fn ", b"let ", b"mut ", b"self ", b"impl ", b"match ", b"return ", b"{\n", b"}\n",
        b";\n", b"stream ", b"chunk ", b"error ", b"value ",
    ];
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut out = Vec::with_capacity(len + 16);
    while out.len() < len {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        let r = x.wrapping_mul(0x2545_f491_4f6c_dd1d);
        out.extend_from_slice(WORDS[(r % WORDS.len() as u64) as usize]);
        if r.is_multiple_of(97) {
            // Some incompressible bytes too.
            out.extend_from_slice(&r.to_le_bytes());
        }
    }
    out.truncate(len);
    out
}

/// Yields `bytes` in chunks of `chunk`, answering `Pending` (and waking
/// itself) before every other chunk, like a pipe the reader outpaces.
struct Stuttering {
    bytes: Bytes,
    chunk: usize,
    pos: usize,
    wait: bool,
}

impl Stream for Stuttering {
    type Item = harness_core::Result<Bytes>;
    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.pos == self.bytes.len() {
            return Poll::Ready(None);
        }
        self.wait = !self.wait;
        if self.wait {
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        let end = (self.pos + self.chunk).min(self.bytes.len());
        let out = self.bytes.slice(self.pos..end);
        self.pos = end;
        Poll::Ready(Some(Ok(out)))
    }
}

fn stuttering(bytes: &[u8], chunk: usize) -> ByteStream {
    Box::pin(Stuttering {
        bytes: Bytes::copy_from_slice(bytes),
        chunk,
        pos: 0,
        wait: false,
    })
}

#[tokio::test]
async fn archives_round_trip_through_the_worker_threads() {
    // Several of zstd's jobs (2 MiB each), fed in odd chunks with waits.
    let input = text(11_000_000 + 12_345);
    let zst = stream::collect(compress_archive(stuttering(&input, 65_521), 3), 64 << 20)
        .await
        .unwrap();
    let back = stream::collect(decompress(stuttering(&zst, 4_099)), 64 << 20)
        .await
        .unwrap();
    assert!(back.as_ref() == input.as_slice(), "round trip");

    // One ordinary frame: a stock single-threaded decoder reads it, and
    // the jobs cost little ratio against one encoder over the whole input.
    let single = stream::collect(compress(stuttering(&input, 1 << 20), 3), 64 << 20)
        .await
        .unwrap();
    assert!(
        (zst.len() as f64) < single.len() as f64 * 1.05,
        "worker jobs compress within 5% of one encoder: {} vs {}",
        zst.len(),
        single.len()
    );
}

#[tokio::test]
async fn empty_and_tiny_archives_round_trip() {
    for input in [Vec::new(), b"x".to_vec(), text(1000)] {
        let zst = stream::collect(compress_archive(stuttering(&input, 7), 3), 1 << 20)
            .await
            .unwrap();
        assert!(!zst.is_empty(), "a frame even for nothing");
        let back = stream::collect(decompress(stream::once(zst)), 1 << 20)
            .await
            .unwrap();
        assert_eq!(back.as_ref(), input.as_slice());
    }
}

#[tokio::test]
async fn an_input_error_ends_the_archive_with_that_error() {
    let chunks: Vec<harness_core::Result<Bytes>> = vec![
        Ok(Bytes::from(text(3_000_000))),
        Err(harness_core::Error::corrupt("source broke")),
    ];
    let err = stream::collect(
        compress_archive(Box::pin(futures::stream::iter(chunks)), 3),
        64 << 20,
    )
    .await
    .unwrap_err();
    assert!(err.to_string().contains("source broke"), "{err}");
}
