//! zstd in pure Rust ([`ruzstd`]), for targets the C library does not
//! build for: a Worker (wasm32) checkpoints and restores with these, and
//! its checkpoints are ordinary zstd that every decoder reads.
//!
//! - [`compress`] cuts the input into pieces of [`FRAME_INPUT`] bytes and
//!   writes each as its own zstd frame at ruzstd's `Fastest` level (about
//!   zstd's level 1): a stream of concatenated frames, which zstd decoders
//!   (the `zstd` CLI, libzstd's streaming API, this module) read as one.
//!   Memory: one piece and its frame.
//! - [`decompress`] decodes any zstd stream — one frame or many, from
//!   libzstd at any level or from [`compress`] — as it arrives, keeping just
//!   enough input for the next block (a block is at most 128 KiB) and the
//!   frame's window. A frame whose content checksum does not match, and a
//!   stream that ends inside a frame, end the output with `Corrupt`.

use bytes::{Bytes, BytesMut};
use futures::StreamExt;
use ruzstd::decoding::FrameDecoder;
use ruzstd::encoding::{compress_to_vec, CompressionLevel};

use harness_core::stream::ByteStream;
use harness_core::{Error, Result};

/// Input bytes per frame [`compress`] writes.
pub const FRAME_INPUT: usize = 2 << 20;

/// The most compressed input one block and what may follow it need: a
/// block header (3) and its largest content (128 KiB), a frame's checksum
/// (4) and the next frame's largest header (18).
const BLOCK_INPUT: usize = 128 * 1024 + 3 + 4 + 18;

/// Output produced per step of [`decompress`].
const OUTPUT_CHUNK: usize = 256 * 1024;

/// Compress a stream as concatenated zstd frames (see the module docs).
pub fn compress(input: ByteStream) -> ByteStream {
    let state = Some((input, BytesMut::new(), false));
    Box::pin(futures::stream::unfold(state, |state| async move {
        let (mut input, mut pending, wrote) = state?;
        loop {
            if pending.len() >= FRAME_INPUT {
                let piece = pending.split_to(FRAME_INPUT);
                let frame = compress_to_vec(&piece[..], CompressionLevel::Fastest);
                return Some((Ok(Bytes::from(frame)), Some((input, pending, true))));
            }
            match input.next().await {
                Some(Ok(chunk)) => pending.extend_from_slice(&chunk),
                Some(Err(e)) => return Some((Err(e), None)),
                None if pending.is_empty() && wrote => return None,
                None => {
                    // The rest, or one empty frame for an empty input (a
                    // zstd stream has at least one frame).
                    let frame = compress_to_vec(&pending[..], CompressionLevel::Fastest);
                    return Some((Ok(Bytes::from(frame)), None));
                }
            }
        }
    }))
}

/// Where [`decompress`] is.
struct Decoding {
    input: ByteStream,
    input_done: bool,
    /// Compressed bytes not consumed yet.
    pending: BytesMut,
    decoder: FrameDecoder,
    /// A frame was started and has not ended.
    in_frame: bool,
    frames: u64,
}

fn corrupt(what: impl std::fmt::Display) -> Error {
    Error::corrupt(format!("zstd stream: {what}"))
}

impl Decoding {
    /// Read input until at least `want` bytes are pending or it ended.
    async fn fill(&mut self, want: usize) -> Result<()> {
        while !self.input_done && self.pending.len() < want {
            match self.input.next().await {
                Some(chunk) => self.pending.extend_from_slice(&chunk?),
                None => self.input_done = true,
            }
        }
        Ok(())
    }

    /// The next piece of output; `None` at the clean end of the stream.
    async fn next(&mut self) -> Result<Option<Bytes>> {
        let mut out = vec![0u8; OUTPUT_CHUNK];
        loop {
            self.fill(BLOCK_INPUT).await?;
            if !self.in_frame {
                if self.pending.is_empty() && self.input_done {
                    return if self.frames == 0 {
                        Err(corrupt("empty: no frame"))
                    } else {
                        Ok(None)
                    };
                }
                let mut header = &self.pending[..];
                let before = header.len();
                self.decoder
                    .reset(&mut header)
                    .map_err(|e| corrupt(format!("frame header: {e}")))?;
                let used = before - header.len();
                let _ = self.pending.split_to(used);
                self.in_frame = true;
                self.frames += 1;
                continue;
            }
            let (read, written) = self
                .decoder
                .decode_from_to(&self.pending, &mut out)
                .map_err(|e| corrupt(format!("block: {e}")))?;
            let read = read.min(self.pending.len());
            let _ = self.pending.split_to(read);
            if written > 0 {
                out.truncate(written);
                return Ok(Some(Bytes::from(out)));
            }
            if self.decoder.is_finished() && self.decoder.can_collect() == 0 {
                if let (Some(stored), Some(computed)) = (
                    self.decoder.get_checksum_from_data(),
                    self.decoder.get_calculated_checksum(),
                ) {
                    if stored != computed {
                        return Err(corrupt(format!(
                            "frame {} fails its content checksum",
                            self.frames
                        )));
                    }
                }
                self.in_frame = false;
                continue;
            }
            if read == 0 && self.input_done {
                return Err(corrupt("truncated inside a frame"));
            }
            if read == 0 {
                // Not one whole block pending: read more than before.
                let want = self.pending.len() + BLOCK_INPUT;
                self.fill(want).await?;
            }
        }
    }
}

/// Decompress a zstd stream of one or more frames (see the module docs).
pub fn decompress(input: ByteStream) -> ByteStream {
    let state = Some(Decoding {
        input,
        input_done: false,
        pending: BytesMut::new(),
        decoder: FrameDecoder::new(),
        in_frame: false,
        frames: 0,
    });
    Box::pin(futures::stream::unfold(state, |state| async move {
        let mut decoding = state?;
        match decoding.next().await {
            Ok(Some(bytes)) => Some((Ok(bytes), Some(decoding))),
            Ok(None) => None,
            Err(e) => Some((Err(e), None)),
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use harness_core::ErrorKind;

    fn stream_of(data: Vec<u8>, chunk: usize) -> ByteStream {
        let chunks: Vec<Result<Bytes>> = data
            .chunks(chunk.max(1))
            .map(|c| Ok(Bytes::copy_from_slice(c)))
            .collect();
        Box::pin(futures::stream::iter(chunks))
    }

    async fn collect(mut s: ByteStream) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        while let Some(chunk) = s.next().await {
            out.extend_from_slice(&chunk?);
        }
        Ok(out)
    }

    /// Text-like data that compresses, several frames long.
    fn sample(len: usize) -> Vec<u8> {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        (0..len)
            .map(|i| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                if i % 7 == 0 {
                    b'a' + (state % 26) as u8
                } else {
                    b"the quick brown fox "[i % 20]
                }
            })
            .collect()
    }

    #[test]
    fn round_trips_across_frames_and_chunkings() {
        futures::executor::block_on(async {
            for (len, chunk) in [
                (0, 1),
                (1, 1),
                (100_000, 333),
                (FRAME_INPUT * 2 + 12_345, 65_536),
            ] {
                let data = sample(len);
                let zst = collect(compress(stream_of(data.clone(), chunk)))
                    .await
                    .unwrap();
                assert!(len < 100_000 || zst.len() < len / 2, "{len}: {}", zst.len());
                for read_chunk in [7, 4096, 1 << 20] {
                    let back = collect(decompress(stream_of(zst.clone(), read_chunk)))
                        .await
                        .unwrap();
                    assert_eq!(back, data, "len {len}, read chunk {read_chunk}");
                }
            }
        });
    }

    #[test]
    fn truncation_and_damage_are_corrupt() {
        futures::executor::block_on(async {
            let data = sample(300_000);
            let zst = collect(compress(stream_of(data, 4096))).await.unwrap();
            let cut = zst[..zst.len() - 10].to_vec();
            let err = collect(decompress(stream_of(cut, 1000))).await.unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");
            let err = collect(decompress(stream_of(Vec::new(), 1)))
                .await
                .unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");
            let err = collect(decompress(stream_of(b"not zstd at all".to_vec(), 4)))
                .await
                .unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");
        });
    }

    /// What libzstd writes (one frame, level 3, with a checksum) decodes
    /// here, and what this writes decodes with libzstd.
    #[cfg(feature = "zstd")]
    #[test]
    fn interoperates_with_libzstd() {
        use async_compression::futures::bufread::{ZstdDecoder, ZstdEncoder};
        use futures::io::AsyncReadExt;
        futures::executor::block_on(async {
            let data = sample(FRAME_INPUT * 2 + 777);
            let mut c = Vec::new();
            let mut encoder =
                ZstdEncoder::with_quality(&data[..], async_compression::Level::Precise(3));
            encoder.read_to_end(&mut c).await.unwrap();
            let back = collect(decompress(stream_of(c.clone(), 10_000)))
                .await
                .unwrap();
            assert_eq!(back, data);
            let mut flipped = c.clone();
            let at = flipped.len() / 2;
            flipped[at] ^= 0x55;
            assert!(collect(decompress(stream_of(flipped, 10_000)))
                .await
                .is_err());

            let ours = collect(compress(stream_of(data.clone(), 65_536)))
                .await
                .unwrap();
            let mut back = Vec::new();
            let mut decoder = ZstdDecoder::new(&ours[..]);
            decoder.multiple_members(true);
            decoder.read_to_end(&mut back).await.unwrap();
            assert_eq!(back, data);
        });
    }
}
