//! Moving a working tree: checkpoint a sandbox directory into a
//! [`CheckpointStore`] and restore it into any sandbox.
//!
//! `checkpoint`: `export_tar` → zstd → `put`, as one stream: nothing is staged
//! on the sandbox's disk or held whole in memory.
//!
//! `restore` never applies part of a refused archive. On a sandbox with a
//! staged import ([`Sandbox::stages_tar_imports`]) it reads the checkpoint
//! once: the store's hash check, zstd and [`TarScanner`] run on the stream
//! that `import_tar_staged` extracts into a staging directory, and the tree
//! is moved into place only after the stream ended cleanly — an unsafe
//! entry or a hash found wrong at the end leaves the target as it was. On
//! other sandboxes it reads the checkpoint twice: the first pass
//! decompresses it and scans every entry without touching the target; only
//! if the whole archive is safe does the second pass stream it into
//! `import_tar`. The second pass scans again and the store verifies the
//! content hash on both reads, so an object swapped between the passes
//! fails instead of being applied. Either way memory stays bounded.
//!
//! `checkpoint_session` / `restore_session` move a whole agent session: the
//! tree, the agent's state dirs relative to `$HOME`, and a manifest; on
//! restore the adapter's `Harness::relocate_state_script` adapts the state
//! to the target's workdir and home.

use std::sync::Arc;

#[cfg(feature = "zstd")]
use async_compression::futures::bufread::{ZstdDecoder, ZstdEncoder};
#[cfg(feature = "zstd")]
use async_compression::Level;
#[cfg(feature = "zstd")]
use bytes::Bytes;
#[cfg(feature = "zstd")]
use futures::io::{AsyncRead, AsyncReadExt, BufReader};
use futures::{StreamExt, TryStreamExt};

use harness_core::checkpoint::{CheckpointStore, ObjectMeta};
use harness_core::harness::{Harness, StateMove};
use harness_core::sandbox::{shell_quote, Sandbox};
use harness_core::slice::home_of;
use harness_core::stream::ByteStream;
use harness_core::tarscan::{ScanLimits, ScanSummary, TarScanner};
use harness_core::{Error, Result};

/// Chunk size of the streams the pipeline produces.
#[cfg(feature = "zstd")]
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

/// zstd level for checkpoints. Level 1: on the 190 MB bench tree it
/// stores 3.8% more bytes than level 3 (77.0 against 74.2 MB) and
/// checkpoints in about two thirds of the time, which decides a move
/// everywhere but on links slower than the compressor (the upload runs
/// beside it). See `docs/checkpoint-r2.md`, *Level 1*.
pub const DEFAULT_ZSTD_LEVEL: i32 = 1;

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

#[cfg(feature = "zstd")]
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

#[cfg(feature = "zstd")]
fn stream_reader(stream: ByteStream) -> impl futures::io::AsyncBufRead + Unpin + Send {
    BufReader::with_capacity(
        CHUNK,
        stream.map_err(std::io::Error::from).into_async_read(),
    )
}

/// Compress a tar stream with zstd at `level`, on the calling thread.
///
/// For small inputs (the tree checkpoints' chunks) and tests; whole
/// archives go through [`compress_archive`].
#[cfg(feature = "zstd")]
pub fn compress(tar: ByteStream, level: i32) -> ByteStream {
    reader_stream(ZstdEncoder::with_quality(
        stream_reader(tar),
        Level::Precise(level),
    ))
}

/// Most worker threads libzstd is given for one archive.
#[cfg(feature = "zstd")]
const MAX_ZSTD_WORKERS: usize = 4;

/// Bytes each libzstd worker compresses at a time. zstd's own choice at
/// level 3 is 8 MiB (four windows), and its ring of input buffers holds
/// about `workers + 3` jobs, which would put tens of MiB beside a move;
/// 2 MiB jobs keep that near 10 MiB. Each job after the first still sees
/// the end of the one before (zstd's overlap), so the ratio barely moves.
#[cfg(feature = "zstd")]
const ZSTD_JOB_BYTES: u32 = 2 << 20;

/// How many worker threads libzstd may use: the available cores, at most
/// [`MAX_ZSTD_WORKERS`]; none (compression on the calling thread) on one
/// core, where a worker would only add a thread switch.
#[cfg(feature = "zstd")]
fn zstd_workers() -> u32 {
    static WORKERS: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *WORKERS.get_or_init(
        || match std::thread::available_parallelism().map_or(1, |n| n.get()) {
            0 | 1 => 0,
            n => n.min(MAX_ZSTD_WORKERS) as u32,
        },
    )
}

/// Compress a whole archive with zstd at `level`, letting libzstd spread
/// the work over its own worker threads (its multithreaded mode, `zstdmt`).
///
/// Those threads live inside the C library behind the one encoder: this
/// crate spawns nothing and owns no runtime. The output is one ordinary
/// zstd frame that any decoder reads. Memory stays bounded: each worker
/// holds one job of [`ZSTD_JOB_BYTES`] plus its tables.
///
/// The encoder is driven here rather than through `async-compression`'s
/// reader, which flushes whenever its input is momentarily empty: with
/// workers, a flush closes the job being filled and waits for every job in
/// flight, so a source only slightly faster than the compressor (a `tar`
/// reading the page cache) would leave the workers idle most of the time.
/// This flushes only at the end.
#[cfg(feature = "zstd")]
pub fn compress_archive(tar: ByteStream, level: i32) -> ByteStream {
    use async_compression::codecs::{EncodeV2, ZstdEncoder as Codec};
    use async_compression::core::util::{PartialBuffer, WriteBuffer};
    use async_compression::zstd::CParameter;

    enum Phase {
        Reading,
        Finishing,
        Done,
    }
    struct State {
        input: ByteStream,
        current: Bytes,
        pos: usize,
        codec: Codec,
        phase: Phase,
    }

    let workers = zstd_workers();
    if workers == 0 {
        return compress(tar, level);
    }
    let codec = Codec::new_with_params(
        level,
        &[
            CParameter::nb_workers(workers),
            CParameter::job_size(ZSTD_JOB_BYTES),
        ],
    );
    let state = State {
        input: tar,
        current: Bytes::new(),
        pos: 0,
        codec,
        phase: Phase::Reading,
    };
    Box::pin(futures::stream::try_unfold(state, |mut s| async move {
        let mut out = vec![0u8; CHUNK];
        let mut buf = WriteBuffer::new_initialized(&mut out);
        loop {
            match s.phase {
                Phase::Done => break,
                Phase::Finishing => {
                    if s.codec.finish(&mut buf)? {
                        s.phase = Phase::Done;
                    } else if buf.has_no_spare_space() {
                        break;
                    }
                }
                Phase::Reading if s.pos == s.current.len() => {
                    // Hand on what is compressed before waiting for input.
                    if buf.written_len() > 0 {
                        break;
                    }
                    match s.input.next().await {
                        Some(chunk) => {
                            s.current = chunk?;
                            s.pos = 0;
                        }
                        None => s.phase = Phase::Finishing,
                    }
                }
                Phase::Reading => {
                    let mut input = PartialBuffer::new(&s.current[s.pos..]);
                    s.codec.encode(&mut input, &mut buf)?;
                    s.pos += input.written_len();
                    if buf.has_no_spare_space() {
                        break;
                    }
                }
            }
        }
        let n = buf.written_len();
        if n == 0 {
            return Ok(None);
        }
        out.truncate(n);
        Ok(Some((Bytes::from(out), s)))
    }))
}

/// Without libzstd (wasm32: a Worker), the pipeline compresses with
/// [`crate::zstd_rust`]: concatenated frames at about level 1, which any
/// zstd decoder reads. `level` is not used there.
#[cfg(not(feature = "zstd"))]
pub fn compress(tar: ByteStream, level: i32) -> ByteStream {
    let _ = level;
    crate::zstd_rust::compress(tar)
}

/// Without libzstd, the same as [`compress`].
#[cfg(not(feature = "zstd"))]
pub fn compress_archive(tar: ByteStream, level: i32) -> ByteStream {
    compress(tar, level)
}

/// Decompress a zstd stream (one frame or many), with [`crate::zstd_rust`].
#[cfg(not(feature = "zstd"))]
pub fn decompress(zst: ByteStream) -> ByteStream {
    crate::zstd_rust::decompress(zst)
}

/// Decompress a zstd stream (one frame or many).
#[cfg(feature = "zstd")]
pub fn decompress(zst: ByteStream) -> ByteStream {
    let mut decoder = ZstdDecoder::new(stream_reader(zst));
    decoder.multiple_members(true);
    reader_stream(decoder)
}

/// Stream `dir` of `sandbox` into `store` under `key`.
#[tracing::instrument(name = "checkpoint", skip_all, fields(key = %key, dir = %dir))]
pub async fn checkpoint(
    sandbox: &dyn Sandbox,
    dir: &str,
    store: &dyn CheckpointStore,
    key: &str,
    progress: Option<Arc<dyn MoveProgress>>,
) -> Result<CheckpointInfo> {
    harness_core::checkpoint::validate_key(key)?;
    let total = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let tar = counting(
        sandbox.export_tar(dir).await?,
        MovePhase::Export,
        progress.clone(),
        total.clone(),
    );
    let object = store
        .put(key, compress_archive(tar, DEFAULT_ZSTD_LEVEL))
        .await?;
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
    harness_core::tarscan::scan_stream(tar, TarScanner::new())
}

/// Like [`scanned`], and the scan's summary is put into `summary` once the
/// stream ended cleanly.
fn scanned_into(
    tar: ByteStream,
    limits: ScanLimits,
    summary: Arc<std::sync::Mutex<Option<ScanSummary>>>,
) -> ByteStream {
    Box::pin(futures::stream::unfold(
        Some((tar, TarScanner::new().with_limits(limits), summary)),
        |state| async move {
            let (mut tar, mut scanner, summary) = state?;
            match tar.next().await {
                Some(Ok(chunk)) => match scanner.push(&chunk) {
                    Ok(()) => Some((Ok(chunk), Some((tar, scanner, summary)))),
                    Err(e) => Some((Err(e), None)),
                },
                Some(Err(e)) => Some((Err(e), None)),
                None => match scanner.finish() {
                    Ok(done) => {
                        *summary.lock().unwrap_or_else(|e| e.into_inner()) = Some(done);
                        None
                    }
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
    verify_within(store, key, progress, ScanLimits::default()).await
}

async fn verify_within(
    store: &dyn CheckpointStore,
    key: &str,
    progress: Option<Arc<dyn MoveProgress>>,
    limits: ScanLimits,
) -> Result<ScanSummary> {
    let mut tar = decompress(store.get(key).await?);
    let mut scanner = TarScanner::new().with_limits(limits);
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
/// what is there. Refuses (changing nothing) if any entry is unsafe. A
/// tree checkpoint ([`crate::tree`]) is recognised by its first
/// bytes and restored by [`crate::tree::restore_manifest`].
///
/// An archive past [`ScanLimits::default`] (a decompression bomb) is
/// refused at the header that crosses the limit; [`restore_with_limits`]
/// takes other limits.
pub async fn restore(
    store: &dyn CheckpointStore,
    key: &str,
    sandbox: &dyn Sandbox,
    dir: &str,
    progress: Option<Arc<dyn MoveProgress>>,
) -> Result<RestoreInfo> {
    restore_with_limits(store, key, sandbox, dir, progress, ScanLimits::default()).await
}

/// [`restore`], refusing a whole-archive checkpoint past `limits` instead
/// of the defaults. On a sandbox that stages imports the entries before the
/// crossing one are written to the staging directory (and removed with
/// it), so the limits bound that work too.
#[tracing::instrument(name = "restore", skip_all, fields(key = %key, dir = %dir))]
pub async fn restore_with_limits(
    store: &dyn CheckpointStore,
    key: &str,
    sandbox: &dyn Sandbox,
    dir: &str,
    progress: Option<Arc<dyn MoveProgress>>,
    limits: ScanLimits,
) -> Result<RestoreInfo> {
    harness_core::checkpoint::validate_key(key)?;
    // A tree checkpoint (manifest + blobs) restores by its own path.
    if let Some(manifest) = crate::tree::read_manifest(store, key).await? {
        let info = crate::tree::restore_manifest(store, &manifest, sandbox, dir, progress).await?;
        return Ok(RestoreInfo {
            summary: info.summary,
        });
    }
    if sandbox.stages_tar_imports() {
        // One read: hash (the store's stream), zstd and scanner on the way
        // into the staging directory; nothing is visible before the end.
        let summary = Arc::new(std::sync::Mutex::new(None));
        let total = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let tar = counting(
            scanned_into(decompress(store.get(key).await?), limits, summary.clone()),
            MovePhase::Import,
            progress.clone(),
            total,
        );
        sandbox.import_tar_staged(dir, tar).await?;
        if let Some(p) = &progress {
            p.finish(MovePhase::Import);
        }
        let summary = summary
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .ok_or_else(|| {
                Error::backend("the sandbox's staged import did not read the whole archive")
            })?;
        return Ok(RestoreInfo { summary });
    }
    let summary = verify_within(store, key, progress.clone(), limits).await?;
    let total = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let tar = counting(
        harness_core::tarscan::scan_stream(
            decompress(store.get(key).await?),
            TarScanner::new().with_limits(limits),
        ),
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

/// Format version of [`SessionManifest`].
pub const SESSION_MANIFEST_VERSION: u32 = 1;

/// Largest manifest `restore_session` reads.
const MANIFEST_LIMIT: usize = 1 << 20;

/// The keys of a session checkpoint under `base`: the working tree, the
/// agent's state, and the manifest tying them together.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionKeys {
    /// `<base>/work.tar.zst`: the working directory.
    pub work: String,
    /// `<base>/state.tar.zst`: the agent's state dirs, relative to `$HOME`.
    pub state: String,
    /// `<base>/manifest.json`: a [`SessionManifest`].
    pub manifest: String,
}

impl SessionKeys {
    /// The keys under `base` (validated).
    pub fn new(base: &str) -> Result<Self> {
        harness_core::checkpoint::validate_key(base)?;
        let keys = Self {
            work: format!("{base}/work.tar.zst"),
            state: format!("{base}/state.tar.zst"),
            manifest: format!("{base}/manifest.json"),
        };
        // A base near the length limit leaves no room for the suffixes.
        for key in [&keys.work, &keys.state, &keys.manifest] {
            harness_core::checkpoint::validate_key(key)?;
        }
        Ok(keys)
    }
}

/// What a session checkpoint holds, written last under
/// [`SessionKeys::manifest`]: a manifest present means both archives were
/// stored completely, and the recorded hashes tie it to exactly those
/// archives.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SessionManifest {
    /// [`SESSION_MANIFEST_VERSION`].
    pub version: u32,
    /// The adapter's name (`Harness::name`).
    pub agent: String,
    /// The agent's own session id, for `--resume` in the target.
    pub agent_session_id: Option<String>,
    /// The source sandbox's working directory.
    pub workdir: String,
    /// The source sandbox's `$HOME`.
    pub home: String,
    /// The agent's state dirs relative to `home` that existed and were
    /// stored (empty: no state yet, no state archive).
    pub state_dirs: Vec<String>,
    /// The stored working tree.
    pub work: ObjectMeta,
    /// The stored state archive, if any state existed.
    pub state: Option<ObjectMeta>,
}

/// What [`restore_session`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionRestoreInfo {
    /// The manifest read.
    pub manifest: SessionManifest,
    /// The working tree restore.
    pub work: RestoreInfo,
    /// The state restore, if there was state.
    pub state: Option<RestoreInfo>,
    /// The target's `$HOME`, under which the state landed.
    pub home: String,
    /// True if the adapter's relocation script ran (home or workdir
    /// changed and the adapter has one).
    pub relocated: bool,
}

async fn run_script(sandbox: &dyn Sandbox, script: String, what: &str) -> Result<String> {
    let out = harness_core::sandbox::collect_exec(
        sandbox
            .exec(harness_core::sandbox::ExecRequest::shell(script))
            .await?,
    )
    .await?
    .check(what)?;
    Ok(out.stdout_str())
}

/// The state dirs of `harness` relative to `home`; a dir outside `home` is
/// refused (it could not be restored relative to another home).
fn relative_state_dirs(harness: &dyn Harness, home: &str) -> Result<Vec<String>> {
    let home = home.trim_end_matches('/');
    harness
        .state_dirs(home)
        .into_iter()
        .map(|dir| {
            let rel = dir
                .strip_prefix(home)
                .and_then(|r| r.strip_prefix('/'))
                .map(|r| r.trim_end_matches('/'))
                .filter(|r| {
                    !r.is_empty() && r.split('/').all(|s| !s.is_empty() && s != "." && s != "..")
                });
            rel.map(str::to_string).ok_or_else(|| {
                Error::invalid(format!(
                    "agent {} state dir {dir:?} is not inside its home {home:?}",
                    harness.name()
                ))
            })
        })
        .collect()
}

/// Store `harness`'s state dirs that exist under `home` ([`Harness::state_dirs`])
/// at `key` as one zstd tar relative to `home`, made by `tar` in the sandbox
/// and streamed out (nothing staged on its disk). Returns the dirs stored
/// and the object (none when the agent has no state yet).
pub(crate) async fn store_agent_state(
    sandbox: &dyn Sandbox,
    harness: &dyn Harness,
    store: &dyn CheckpointStore,
    key: &str,
    home: &str,
) -> Result<(Vec<String>, Option<ObjectMeta>)> {
    let wanted = relative_state_dirs(harness, home)?;
    // Only the dirs that exist: an agent that has not run yet has none.
    let mut probe = String::new();
    for dir in &wanted {
        probe.push_str(&format!(
            "if [ -d {p} ]; then printf '%s\\n' {d}; fi\n",
            p = shell_quote(&format!("{home}/{dir}")),
            d = shell_quote(dir)
        ));
    }
    let present: Vec<String> = if probe.is_empty() {
        Vec::new()
    } else {
        run_script(sandbox, probe, "looking for agent state")
            .await?
            .lines()
            .map(str::to_string)
            .collect()
    };
    if present.is_empty() {
        return Ok((present, None));
    }
    let quoted: Vec<String> = present.iter().map(|d| shell_quote(d)).collect();
    let excludes: String = harness
        .state_excludes()
        .iter()
        .map(|e| format!(" --exclude={}", shell_quote(e)))
        .collect();
    let script = format!(
        "exec tar -C {}{excludes} -cf - -- {}",
        shell_quote(home),
        quoted.join(" ")
    );
    let tar = harness_core::sandbox::exec_stdout_stream(
        sandbox
            .exec(harness_core::sandbox::ExecRequest::shell(script))
            .await?,
        format!("agent state under {home}"),
    );
    let object = store
        .put(key, compress_archive(tar, DEFAULT_ZSTD_LEVEL))
        .await?;
    Ok((present, Some(object)))
}

/// Put the agent state stored at `key` (by [`store_agent_state`], from a
/// sandbox whose home and workdir were `from_home` and `from_workdir`) under
/// `home` of `sandbox`, then run the adapter's relocation script when a path
/// differs. Returns the restore and whether the script ran. The archive
/// must have been checked ([`verify`]) before anything else was written.
pub(crate) async fn restore_agent_state(
    store: &dyn CheckpointStore,
    key: &str,
    from_home: &str,
    from_workdir: &str,
    sandbox: &dyn Sandbox,
    harness: &dyn Harness,
    home: &str,
) -> Result<(RestoreInfo, bool)> {
    let restored = restore(store, key, sandbox, home, None).await?;
    if from_workdir == sandbox.workdir() && from_home == home {
        return Ok((restored, false));
    }
    let moved = StateMove {
        old_home: from_home,
        home,
        old_workdir: from_workdir,
        workdir: sandbox.workdir(),
    };
    match harness.relocate_state_script(&moved) {
        Some(script) => {
            run_script(sandbox, script, "relocating agent state to the new workdir").await?;
            Ok((restored, true))
        }
        None => Ok((restored, false)),
    }
}

/// Checkpoint a whole session: the working tree to `<base>/work.tar.zst`,
/// the agent's state dirs ([`Harness::state_dirs`], as a tar relative to
/// `$HOME`, made by `tar` in the sandbox and streamed out) to
/// `<base>/state.tar.zst`, then the [`SessionManifest`]. Nothing is staged
/// on the sandbox's disk. Use a fresh `base` per checkpoint.
#[tracing::instrument(name = "checkpoint.session", skip_all, fields(key = %base, agent_session.id = agent_session_id))]
pub async fn checkpoint_session(
    sandbox: &dyn Sandbox,
    harness: &dyn Harness,
    agent_session_id: Option<&str>,
    store: &dyn CheckpointStore,
    base: &str,
    progress: Option<Arc<dyn MoveProgress>>,
) -> Result<SessionManifest> {
    let keys = SessionKeys::new(base)?;
    let home = home_of(sandbox).await?;
    let (present, state) = store_agent_state(sandbox, harness, store, &keys.state, &home).await?;
    let work = checkpoint(sandbox, sandbox.workdir(), store, &keys.work, progress).await?;
    // Objects stored, manifest not yet: a checkpoint killed here must not
    // be restorable (no manifest) and must not harm the next one.
    harness_core::failpoint::hit("checkpoint-upload");
    let manifest = SessionManifest {
        version: SESSION_MANIFEST_VERSION,
        agent: harness.name().to_string(),
        agent_session_id: agent_session_id.map(str::to_string),
        workdir: sandbox.workdir().to_string(),
        home,
        state_dirs: present,
        work: work.object,
        state,
    };
    store
        .put(
            &keys.manifest,
            harness_core::stream::once(serde_json::to_vec_pretty(&manifest)?),
        )
        .await?;
    Ok(manifest)
}

/// Read and check the manifest of the session checkpoint under `base`.
pub async fn read_session_manifest(
    store: &dyn CheckpointStore,
    base: &str,
) -> Result<SessionManifest> {
    let keys = SessionKeys::new(base)?;
    let bytes =
        harness_core::stream::collect(store.get(&keys.manifest).await?, MANIFEST_LIMIT).await?;
    let manifest: SessionManifest = serde_json::from_slice(&bytes).map_err(|e| {
        Error::corrupt(format!(
            "session manifest {:?} is not valid: {e}",
            keys.manifest
        ))
    })?;
    if manifest.version != SESSION_MANIFEST_VERSION {
        return Err(Error::invalid(format!(
            "session manifest {:?} has version {}, this build reads {SESSION_MANIFEST_VERSION}",
            keys.manifest, manifest.version
        )));
    }
    Ok(manifest)
}

/// Check that the object under `key` is the one the manifest recorded (a
/// later checkpoint to the same base could have replaced it).
pub(crate) async fn check_recorded(
    store: &dyn CheckpointStore,
    key: &str,
    recorded: &ObjectMeta,
) -> Result<()> {
    let actual = store.head(key).await?;
    if actual.sha256 != recorded.sha256 || recorded.key != key {
        return Err(Error::corrupt(format!(
            "checkpoint {key:?} is not the one its manifest recorded (hash {} != {})",
            actual.sha256, recorded.sha256
        )));
    }
    Ok(())
}

/// Restore the session checkpoint under `base` into `sandbox`: the tree onto
/// its workdir (overlay), the agent state under its `$HOME`, then — if the
/// workdir or home path differs from the source's — the adapter's
/// [`Harness::relocate_state_script`]. Both archives are scanned before
/// either is applied, so an unsafe entry in either changes nothing.
#[tracing::instrument(name = "restore.session", skip_all, fields(key = %base))]
pub async fn restore_session(
    store: &dyn CheckpointStore,
    base: &str,
    sandbox: &dyn Sandbox,
    harness: &dyn Harness,
    progress: Option<Arc<dyn MoveProgress>>,
) -> Result<SessionRestoreInfo> {
    let keys = SessionKeys::new(base)?;
    let manifest = read_session_manifest(store, base).await?;
    if manifest.agent != harness.name() {
        return Err(Error::invalid(format!(
            "session checkpoint {base:?} is of agent {:?}, not {:?}",
            manifest.agent,
            harness.name()
        )));
    }
    check_recorded(store, &keys.work, &manifest.work).await?;
    if let Some(state) = &manifest.state {
        check_recorded(store, &keys.state, state).await?;
        // Scan the state now: `restore` of the tree below applies it, and a
        // state archive refused afterwards would leave half a session.
        verify(store, &keys.state, None).await?;
    }
    let home = home_of(sandbox).await?;
    let work = restore(store, &keys.work, sandbox, sandbox.workdir(), progress).await?;
    let (state, relocated) = match &manifest.state {
        Some(_) => {
            let (state, relocated) = restore_agent_state(
                store,
                &keys.state,
                &manifest.home,
                &manifest.workdir,
                sandbox,
                harness,
                &home,
            )
            .await?;
            (Some(state), relocated)
        }
        None => (None, false),
    };
    Ok(SessionRestoreInfo {
        manifest,
        work,
        state,
        home,
        relocated,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Dirs(Vec<&'static str>);

    impl Harness for Dirs {
        fn name(&self) -> &'static str {
            "dirs"
        }
        fn bootstrap_recipe(&self) -> Result<harness_core::bootstrap::BootstrapRecipe> {
            Ok(Default::default())
        }
        fn turn_command(
            &self,
            _turn: &harness_core::harness::TurnContext<'_>,
        ) -> Result<harness_core::harness::AgentCommand> {
            Err(Error::invalid("not used"))
        }
        fn parser(&self) -> Box<dyn harness_core::harness::OutputParser> {
            unreachable!("not used")
        }
        fn state_dirs(&self, home: &str) -> Vec<String> {
            self.0.iter().map(|d| d.replace("$HOME", home)).collect()
        }
    }

    #[test]
    fn session_keys_sit_under_a_valid_base() {
        let k = SessionKeys::new("sessions/s1/turn-2").unwrap();
        assert_eq!(k.work, "sessions/s1/turn-2/work.tar.zst");
        assert_eq!(k.state, "sessions/s1/turn-2/state.tar.zst");
        assert_eq!(k.manifest, "sessions/s1/turn-2/manifest.json");
        assert!(SessionKeys::new("../x").is_err());
        assert!(SessionKeys::new("a/").is_err());
        // A valid base too long to take the suffixes (found by fuzzing).
        let long = format!("{}/{}", "a".repeat(250), "b".repeat(250));
        harness_core::checkpoint::validate_key(&long).unwrap();
        assert!(SessionKeys::new(&long).is_err());
    }

    #[test]
    fn state_dirs_are_taken_relative_to_home_and_must_be_inside_it() {
        let h = Dirs(vec!["$HOME/.claude", "$HOME/.config/agent/"]);
        assert_eq!(
            relative_state_dirs(&h, "/home/u/").unwrap(),
            [".claude", ".config/agent"]
        );
        for bad in [
            "/etc/agent",
            "$HOME",
            "$HOME/../other",
            "$HOMEX/.a",
            "$HOME//a",
        ] {
            let err = relative_state_dirs(&Dirs(vec![bad]), "/home/u").unwrap_err();
            assert_eq!(
                err.kind(),
                harness_core::ErrorKind::InvalidInput,
                "{bad}: {err}"
            );
        }
    }
}
