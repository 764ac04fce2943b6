//! Content chunks as the store holds them: each a zstd frame, as a blob of
//! its own or in a pack; read back with its hash checked; and which of them
//! the store holds, asked one `HEAD` each or read off one listing.

use std::collections::HashSet;

use bytes::Bytes;
use futures::StreamExt;
use sha2::{Digest, Sha256};

use super::{blob_key, BLOB_PREFIX, IN_FLIGHT, MAX_CHUNK};
use crate::archive::DEFAULT_ZSTD_LEVEL;
#[cfg(not(feature = "zstd"))]
use crate::archive::{compress, decompress};
use harness_core::checkpoint::CheckpointStore;
use harness_core::stream::ByteStream;
use harness_core::{Error, ErrorKind, Result};

/// One chunk's content, its hash checked.
pub(super) async fn fetch_chunk(store: &dyn CheckpointStore, hash: &str) -> Result<Bytes> {
    let key = blob_key(hash);
    let body = store.get(&key).await?;
    unpack_stream(body, hash, &format!("blob {key}")).await
}

/// A chunk's content out of its zstd frame, its hash checked (`what`
/// names where it was read, for the error).
pub(super) async fn unpack_chunk(frame: Bytes, hash: &str, what: &str) -> Result<Bytes> {
    unpack_stream(harness_core::stream::once(frame), hash, what).await
}

async fn unpack_stream(compressed: ByteStream, hash: &str, what: &str) -> Result<Bytes> {
    // A chunk is at most MAX_CHUNK: a blob that inflates past it is refused.
    #[cfg(feature = "zstd")]
    let content = {
        // A frame past this bound is not one of a chunk.
        let frames = harness_core::stream::collect(compressed, zstd_bound(MAX_CHUNK)).await?;
        chunk_zstd::decompress(&frames, MAX_CHUNK, what)?
    };
    #[cfg(not(feature = "zstd"))]
    let content = harness_core::stream::collect(decompress(compressed), MAX_CHUNK).await?;
    let got = hex::encode(Sha256::digest(&content));
    if got != hash {
        return Err(Error::corrupt(format!(
            "{what} holds content with SHA-256 {got}"
        )));
    }
    Ok(content)
}

/// The most zstd makes of `len` bytes: it never grows incompressible data
/// by more than a few bytes per 128 KiB block.
fn zstd_bound(len: usize) -> usize {
    len + len / 8 + 1024
}

/// A chunk's zstd frame.
#[cfg(feature = "zstd")]
pub(super) async fn compressed(content: Bytes) -> Result<Bytes> {
    chunk_zstd::compress(&content, DEFAULT_ZSTD_LEVEL)
}

/// A chunk's zstd frame(s), in pure Rust.
#[cfg(not(feature = "zstd"))]
pub(super) async fn compressed(content: Bytes) -> Result<Bytes> {
    let limit = zstd_bound(content.len());
    harness_core::stream::collect(
        compress(harness_core::stream::once(content), DEFAULT_ZSTD_LEVEL),
        limit,
    )
    .await
}

/// libzstd for chunks, with one compression and one decompression context
/// per thread, reused. Most chunks are small whole files, and a context
/// made for each (its tables and the streaming adapter's two 256 KiB
/// buffers) cost more than compressing the file; a reused context told the
/// input's size also sizes its tables to a small file.
#[cfg(feature = "zstd")]
mod chunk_zstd {
    use std::cell::RefCell;
    use std::io::Read;

    use bytes::Bytes;
    use zstd::zstd_safe::{self, DCtx, ResetDirective};

    use harness_core::{Error, Result};

    thread_local! {
        static COMPRESSOR: RefCell<Option<(i32, zstd::bulk::Compressor<'static>)>> =
            const { RefCell::new(None) };
        static DECOMPRESSOR: RefCell<Option<DCtx<'static>>> = const { RefCell::new(None) };
    }

    /// `content` as one zstd frame at `level` (its size in the header).
    pub(super) fn compress(content: &[u8], level: i32) -> Result<Bytes> {
        COMPRESSOR.with(|cell| {
            let mut cell = cell.borrow_mut();
            let compressor = match &mut *cell {
                Some((at, compressor)) if *at == level => compressor,
                slot => &mut slot.insert((level, zstd::bulk::Compressor::new(level)?)).1,
            };
            Ok(Bytes::from(compressor.compress(content)?))
        })
    }

    /// The content of `frames` (one zstd frame or several, as the Worker's
    /// pure-Rust encoder writes), refused as corrupt past `max` bytes or
    /// when it is not zstd; `what` names where the frames were read.
    pub(super) fn decompress(frames: &[u8], max: usize, what: &str) -> Result<Bytes> {
        let corrupt = |why: String| Error::corrupt(format!("{what}: {why}"));
        DECOMPRESSOR.with(|cell| {
            let mut cell = cell.borrow_mut();
            let context = match &mut *cell {
                Some(context) => context,
                slot => slot.insert(DCtx::try_create().ok_or_else(|| {
                    Error::backend("libzstd could not make a decompression context")
                })?),
            };
            // What an earlier frame that failed midway left is dropped.
            context
                .reset(ResetDirective::SessionOnly)
                .map_err(|code| corrupt(zstd_safe::get_error_name(code).to_string()))?;
            // The first frame's size, when its header has it, sizes the
            // buffer once; never more than `max` on a header's word.
            let expected = zstd_safe::get_frame_content_size(frames)
                .ok()
                .flatten()
                .unwrap_or(0)
                .min(max as u64);
            let mut content = Vec::with_capacity(expected as usize);
            zstd::stream::read::Decoder::with_context(frames, context)
                .take(max as u64 + 1)
                .read_to_end(&mut content)
                .map_err(|e| corrupt(format!("not a zstd chunk: {e}")))?;
            if content.len() > max {
                return Err(corrupt(format!("inflates past {max} bytes")));
            }
            Ok(Bytes::from(content))
        })
    }
}

/// Chunks asked about one `HEAD` each before the store's blob keys are
/// listed instead: a few `HEAD`s cost less than listing 256 prefixes, a
/// whole tree's (20,000 for the bench tree) cost more than the uploads.
pub(super) const HEADS_BEFORE_LISTING: usize = 256;

/// Most blob keys under one two-hex-digit prefix the listing holds: past
/// it (a store of over ~500,000 blobs) the listing is dropped and `HEAD`s
/// go on, so the set stays within ~16 MiB whatever the store's size.
const MAX_LISTED_PER_PREFIX: usize = 2048;

/// Prefix listings in flight at once.
const LISTINGS_IN_FLIGHT: usize = 16;

/// Every blob hash in `store`, or `None` when a prefix holds more than
/// [`MAX_LISTED_PER_PREFIX`].
pub(super) async fn list_blob_hashes(
    store: &dyn CheckpointStore,
) -> Result<Option<HashSet<[u8; 32]>>> {
    // The futures are made first and then streamed: a stream that makes
    // them with a closure borrowing the store is not provably `Send` for
    // every lifetime (rust#64552), and turn-end checkpoints run inside
    // `Send` futures. The same below and in `packs`, `restore`.
    let listings: Vec<_> = (0..=255u8)
        .map(|p| async move { store.list_keys(&format!("{BLOB_PREFIX}{p:02x}/")).await })
        .collect();
    let mut listings = futures::stream::iter(listings).buffer_unordered(LISTINGS_IN_FLIGHT);
    let mut hashes = HashSet::new();
    while let Some(keys) = listings.next().await {
        let keys = keys?;
        if keys.len() > MAX_LISTED_PER_PREFIX {
            return Ok(None);
        }
        for key in keys {
            let mut hash = [0u8; 32];
            // A key of another shape is no chunk of ours: not counted.
            if hex::decode_to_slice(key.rsplit('/').next().unwrap_or_default(), &mut hash).is_ok() {
                hashes.insert(hash);
            }
        }
    }
    Ok(Some(hashes))
}

/// The items whose blob (of hash `hash(item)`) the store lacks, asked with
/// a `HEAD` each, [`IN_FLIGHT`] at a time, in their order.
pub(super) async fn lacking_blobs<T, F>(
    store: &dyn CheckpointStore,
    items: Vec<T>,
    hash: F,
) -> Result<Vec<T>>
where
    F: Fn(&T) -> &str,
{
    let hash = &hash;
    let heads: Vec<_> = items
        .into_iter()
        .map(|item| async move {
            match store.head(&blob_key(hash(&item))).await {
                Ok(_) => Ok(None),
                Err(e) if e.kind() == ErrorKind::NotFound => Ok(Some(item)),
                Err(e) => Err(e),
            }
        })
        .collect();
    let mut heads = futures::stream::iter(heads).buffered(IN_FLIGHT);
    let mut lacking = Vec::new();
    while let Some(answer) = heads.next().await {
        lacking.extend(answer?);
    }
    Ok(lacking)
}

#[cfg(all(test, feature = "zstd"))]
mod tests {
    use super::*;

    /// The reused contexts: frames round-trip whatever came before them
    /// (a failed decode included), several frames read as one content,
    /// and what is not a chunk is refused as corrupt, naming where.
    #[test]
    fn chunk_contexts_are_reused_safely() {
        let small = b"a small file\n".repeat(3);
        let large: Vec<u8> = (0..3_000_000u32).map(|i| (i * 7 % 251) as u8).collect();
        for content in [&small[..], &large[..], &[][..]] {
            let frame = chunk_zstd::compress(content, DEFAULT_ZSTD_LEVEL).unwrap();
            let back = chunk_zstd::decompress(&frame, MAX_CHUNK, "blob x").unwrap();
            assert_eq!(&back[..], content);
        }

        // A frame cut short, then a good one on the same thread's context.
        let frame = chunk_zstd::compress(&large, DEFAULT_ZSTD_LEVEL).unwrap();
        let err =
            chunk_zstd::decompress(&frame[..frame.len() / 2], MAX_CHUNK, "blob cut").unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");
        assert!(err.to_string().contains("blob cut"), "{err}");
        let back = chunk_zstd::decompress(&frame, MAX_CHUNK, "blob x").unwrap();
        assert_eq!(&back[..], &large[..]);

        // Two frames end to end are their contents end to end.
        let mut two = chunk_zstd::compress(&small, DEFAULT_ZSTD_LEVEL)
            .unwrap()
            .to_vec();
        two.extend_from_slice(&chunk_zstd::compress(b"and more", 3).unwrap());
        let back = chunk_zstd::decompress(&two, MAX_CHUNK, "blob two").unwrap();
        assert_eq!(back.len(), small.len() + 8);
        assert!(back.ends_with(b"and more"));

        // Past the limit, and not zstd at all.
        let err = chunk_zstd::decompress(&frame, 1_000_000, "blob big").unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");
        assert!(err.to_string().contains("inflates past"), "{err}");
        let err = chunk_zstd::decompress(b"plain text", MAX_CHUNK, "blob plain").unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");
    }
}
