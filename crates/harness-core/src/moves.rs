//! Moving a working tree: checkpoint a sandbox directory into a
//! [`CheckpointStore`] and restore it into any sandbox.
//!
//! `checkpoint`: `export_tar` → zstd → `put`, as one stream: nothing is staged
//! on the sandbox's disk or held whole in memory.
//!
//! `restore` reads the checkpoint twice: the first pass decompresses it and
//! runs [`TarScanner`] over every entry without touching the target; only if
//! the whole archive is safe does the second pass stream it into
//! `import_tar`. Reading twice costs a second download but keeps memory
//! bounded and guarantees a refused archive changes nothing. The second pass
//! scans again and the store verifies the content hash on both reads, so an
//! object swapped between the passes fails instead of being applied.

use std::sync::Arc;

use async_compression::futures::bufread::{ZstdDecoder, ZstdEncoder};
use async_compression::Level;
use bytes::Bytes;
use futures::io::{AsyncRead, AsyncReadExt, BufReader};
use futures::{StreamExt, TryStreamExt};

use crate::checkpoint::{CheckpointStore, ObjectMeta};
use crate::sandbox::Sandbox;
use crate::stream::ByteStream;
use crate::tarscan::{ScanSummary, TarScanner};
use crate::{Error, Result};

/// Chunk size of the streams the pipeline produces.
const CHUNK: usize = 256 * 1024;

/// A phase of a move, for progress reporting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MovePhase {
    /// Reading the tree out of the source sandbox (uncompressed bytes).
    Export,
    /// Checking the checkpoint before restoring (uncompressed bytes).
    Verify,
    /// Writing the tree into the target sandbox (uncompressed bytes).
    Import,
}

/// Receives progress of long moves (the CLI draws bars from it).
pub trait MoveProgress: Send + Sync {
    /// `bytes` more were processed in `phase`.
    fn advance(&self, phase: MovePhase, bytes: u64);
    /// `phase` is done.
    fn finish(&self, phase: MovePhase) {
        let _ = phase;
    }
}

/// zstd level for checkpoints: 3 is zstd's default, a good ratio at speed.
pub const DEFAULT_ZSTD_LEVEL: i32 = 3;

/// What a checkpoint produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointInfo {
    /// The stored object.
    pub object: ObjectMeta,
    /// Uncompressed tar bytes.
    pub tar_bytes: u64,
}

/// What a restore applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RestoreInfo {
    /// The scan of the archive.
    pub summary: ScanSummary,
}

fn counting(
    stream: ByteStream,
    phase: MovePhase,
    progress: Option<Arc<dyn MoveProgress>>,
    total: Arc<std::sync::atomic::AtomicU64>,
) -> ByteStream {
    Box::pin(stream.inspect_ok(move |chunk| {
        total.fetch_add(chunk.len() as u64, std::sync::atomic::Ordering::Relaxed);
        if let Some(p) = &progress {
            p.advance(phase, chunk.len() as u64);
        }
    }))
}

fn reader_stream<R: AsyncRead + Unpin + Send + 'static>(reader: R) -> ByteStream {
    Box::pin(futures::stream::try_unfold(
        reader,
        |mut reader| async move {
            let mut buf = vec![0u8; CHUNK];
            let n = reader.read(&mut buf).await.map_err(Error::from)?;
            if n == 0 {
                return Ok(None);
            }
            buf.truncate(n);
            Ok(Some((Bytes::from(buf), reader)))
        },
    ))
}

fn stream_reader(stream: ByteStream) -> impl futures::io::AsyncBufRead + Unpin + Send {
    BufReader::with_capacity(
        CHUNK,
        stream.map_err(std::io::Error::from).into_async_read(),
    )
}

/// Compress a tar stream with zstd at `level`.
pub fn compress(tar: ByteStream, level: i32) -> ByteStream {
    reader_stream(ZstdEncoder::with_quality(
        stream_reader(tar),
        Level::Precise(level),
    ))
}

/// Decompress a zstd stream.
pub fn decompress(zst: ByteStream) -> ByteStream {
    let mut decoder = ZstdDecoder::new(stream_reader(zst));
    decoder.multiple_members(true);
    reader_stream(decoder)
}

/// Stream `dir` of `sandbox` into `store` under `key`.
pub async fn checkpoint(
    sandbox: &dyn Sandbox,
    dir: &str,
    store: &dyn CheckpointStore,
    key: &str,
    progress: Option<Arc<dyn MoveProgress>>,
) -> Result<CheckpointInfo> {
    crate::checkpoint::validate_key(key)?;
    let total = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let tar = counting(
        sandbox.export_tar(dir).await?,
        MovePhase::Export,
        progress.clone(),
        total.clone(),
    );
    let object = store.put(key, compress(tar, DEFAULT_ZSTD_LEVEL)).await?;
    if let Some(p) = &progress {
        p.finish(MovePhase::Export);
    }
    Ok(CheckpointInfo {
        object,
        tar_bytes: total.load(std::sync::atomic::Ordering::Relaxed),
    })
}

/// Wrap a tar stream so every chunk goes through a [`TarScanner`]; the
/// stream fails at the first unsafe entry and at a truncated end.
pub fn scanned(tar: ByteStream) -> ByteStream {
    Box::pin(futures::stream::unfold(
        Some((tar, TarScanner::new())),
        |state| async move {
            let (mut tar, mut scanner) = state?;
            match tar.next().await {
                Some(Ok(chunk)) => match scanner.push(&chunk) {
                    Ok(()) => Some((Ok(chunk), Some((tar, scanner)))),
                    Err(e) => Some((Err(e), None)),
                },
                Some(Err(e)) => Some((Err(e), None)),
                None => match scanner.finish() {
                    Ok(_) => None,
                    Err(e) => Some((Err(e), None)),
                },
            }
        },
    ))
}

/// Decompress and scan a checkpoint without restoring it.
pub async fn verify(
    store: &dyn CheckpointStore,
    key: &str,
    progress: Option<Arc<dyn MoveProgress>>,
) -> Result<ScanSummary> {
    let mut tar = decompress(store.get(key).await?);
    let mut scanner = TarScanner::new();
    while let Some(chunk) = tar.next().await {
        let chunk = chunk?;
        scanner.push(&chunk)?;
        if let Some(p) = &progress {
            p.advance(MovePhase::Verify, chunk.len() as u64);
        }
    }
    if let Some(p) = &progress {
        p.finish(MovePhase::Verify);
    }
    scanner.finish()
}

/// Restore the checkpoint under `key` onto `dir` of `sandbox`, overlaying
/// what is there. Refuses (changing nothing) if any entry is unsafe.
pub async fn restore(
    store: &dyn CheckpointStore,
    key: &str,
    sandbox: &dyn Sandbox,
    dir: &str,
    progress: Option<Arc<dyn MoveProgress>>,
) -> Result<RestoreInfo> {
    crate::checkpoint::validate_key(key)?;
    let summary = verify(store, key, progress.clone()).await?;
    let total = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let tar = counting(
        scanned(decompress(store.get(key).await?)),
        MovePhase::Import,
        progress.clone(),
        total,
    );
    sandbox.import_tar(dir, tar).await?;
    if let Some(p) = &progress {
        p.finish(MovePhase::Import);
    }
    Ok(RestoreInfo { summary })
}
