//! Files and trees through a command with a streamed stdin, and the waits
//! an exec stream races: shared by both engines of this crate (the QEMU
//! guest agent and the microsandbox SDK), whose only way into the guest the
//! harness uses is a command.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use async_trait::async_trait;
use futures::StreamExt;
use harness_core::sandbox::{
    collect_exec, exec_stdout_stream, extract_tar_failure, extract_tar_script, first_error_now,
    shell_quote, ExecRequest, ExecStream, Sandbox,
};
use harness_core::stream::{AbortSignal, ByteStream};
use harness_core::{tarscan, Error, Result};
use tokio::sync::oneshot;

/// A guest that runs `sh -c` scripts from `/` with a streamed stdin.
#[async_trait]
pub(crate) trait StdinShell: Send + Sync {
    /// Start `sh -c script` from `/`, `stdin` (if any) streamed in.
    async fn start_script(&self, script: String, stdin: Option<ByteStream>) -> Result<ExecStream>;

    /// Run `sh -c script` to a successful end; its stdout.
    async fn sh(&self, script: &str) -> Result<String> {
        let out = collect_exec(self.start_script(script.to_string(), None).await?)
            .await?
            .check(script)?;
        Ok(out.stdout_str())
    }
}

/// Stream the file at the absolute `path` in the guest (`cat` in an exec):
/// a directory there is `Invalid` (exit 45), a path with nothing there
/// `NotFound` (exit 44), both reported before the stream is returned.
pub(crate) async fn read_file<S: Sandbox + ?Sized>(guest: &S, path: String) -> Result<ByteStream> {
    let script = format!(
        "if [ -d {p} ]; then echo {p} is a directory >&2; exit 45; fi; \
         test -e {p} || {{ echo no such file: {p} >&2; exit 44; }}; exec cat -- {p}",
        p = shell_quote(&path)
    );
    let stream = guest.exec(ExecRequest::shell(script)).await?;
    first_error_now(exec_stdout_stream(stream, path)).await
}

/// Write `content` to the absolute `path` in the guest: into a temporary
/// beside it, renamed over `path` only once complete, so a failed write
/// leaves the old file (or none). A directory at `path` is `Invalid`.
pub(crate) async fn write_file(
    guest: &dyn StdinShell,
    path: String,
    content: ByteStream,
) -> Result<u64> {
    if path.ends_with('/') {
        return Err(Error::invalid(format!(
            "{path} names a directory, not a file"
        )));
    }
    let parent = match path.rsplit_once('/') {
        Some(("", _)) | None => "/".to_string(),
        Some((p, _)) => p.to_string(),
    };
    let tmp = format!("{path}.harness-tmp-{}", uuid::Uuid::new_v4().simple());
    let counter = Arc::new(AtomicU64::new(0));
    let c = counter.clone();
    let counted: ByteStream = Box::pin(content.map(move |chunk| {
        if let Ok(b) = &chunk {
            c.fetch_add(b.len() as u64, Ordering::Relaxed);
        }
        chunk
    }));
    let script = format!(
        "if [ -d {p} ]; then echo {p} is a directory >&2; exit 45; fi; \
         mkdir -p {d} && cat > {t} && mv -f {t} {p} || {{ rc=$?; rm -f {t}; exit $rc; }}",
        p = shell_quote(&path),
        d = shell_quote(&parent),
        t = shell_quote(&tmp)
    );
    let out = match collect_exec(guest.start_script(script, Some(counted)).await?).await {
        Ok(out) => out,
        Err(e) => {
            let _ = guest.sh(&format!("rm -f {}", shell_quote(&tmp))).await;
            return Err(e);
        }
    };
    if !out.status.success() {
        let msg = format!(
            "writing {path} failed ({:?}): {}",
            out.status,
            out.stderr_str().trim()
        );
        return Err(if out.status.code == Some(45) {
            Error::invalid(msg)
        } else {
            Error::backend(msg)
        });
    }
    Ok(counter.load(Ordering::Relaxed))
}

/// Extract `tar` into the absolute `dir` in the guest with GNU tar (core's
/// `extract_tar_script`, which keeps every write inside `dir`); the scanner
/// stops the stream (killing tar) at the first entry it refuses.
pub(crate) async fn import_tar(guest: &dyn StdinShell, dir: String, tar: ByteStream) -> Result<()> {
    let tar = tarscan::scan_stream(tar, tarscan::TarScanner::new().outward_symlinks());
    let out = collect_exec(
        guest
            .start_script(extract_tar_script(&dir), Some(tar))
            .await?,
    )
    .await?;
    if out.status.success() {
        return Ok(());
    }
    Err(extract_tar_failure(&dir, &out.status, &out.stderr_str()))
}

/// The stdin feeder's error; `None` once it finished without one (then
/// the slot is emptied and this never resolves again).
pub(crate) async fn stdin_failure(rx: &mut Option<oneshot::Receiver<Error>>) -> Option<Error> {
    match rx {
        Some(r) => r.await.ok(),
        None => futures::future::pending().await,
    }
}

/// Sleep until `at`, or forever without one.
pub(crate) async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => futures::future::pending().await,
    }
}

/// Wait for `abort`, or forever without one.
pub(crate) async fn aborted(abort: Option<AbortSignal>) {
    match abort {
        Some(a) => a.aborted().await,
        None => futures::future::pending().await,
    }
}
