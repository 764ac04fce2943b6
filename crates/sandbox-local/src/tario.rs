//! Tar export and import with the `tar` crate, run on blocking threads and
//! bridged to async byte streams by bounded channels (so memory stays at a
//! few chunks whatever the size of the tree).

use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use bytes::{Bytes, BytesMut};
use futures::StreamExt;
use harness_core::stream::ByteStream;
use harness_core::tarscan::{check_entry_path, scan_stream, TarScanner};
use harness_core::{Error, ErrorKind, Result};
use tokio::sync::mpsc;

/// Size of the chunks an export yields.
const CHUNK: usize = 256 * 1024;
/// Chunks in flight between the blocking side and the async side.
const DEPTH: usize = 4;

/// Stream `dir` as an uncompressed tar whose entry names are relative to it.
pub(crate) fn export(dir: PathBuf) -> ByteStream {
    let (tx, mut rx) = mpsc::channel::<Result<Bytes>>(DEPTH);
    tokio::task::spawn_blocking(move || {
        let mut writer = ChannelWriter {
            tx: tx.clone(),
            buf: BytesMut::with_capacity(CHUNK),
        };
        let result = (|| -> Result<()> {
            let mut builder = tar::Builder::new(&mut writer);
            builder.follow_symlinks(false);
            append_tree(&mut builder, &dir, Path::new(""))?;
            builder.finish()?;
            drop(builder);
            writer.flush()?;
            Ok(())
        })();
        if let Err(e) = result {
            // A reader that went away is not an error worth reporting.
            let _ = tx.blocking_send(Err(e));
        }
    });
    Box::pin(futures::stream::poll_fn(move |cx| rx.poll_recv(cx)))
}

fn append_tree<W: Write>(builder: &mut tar::Builder<W>, root: &Path, rel: &Path) -> Result<()> {
    let dir = root.join(rel);
    let mut names: Vec<_> = std::fs::read_dir(&dir)?
        .map(|e| e.map(|e| e.file_name()))
        .collect::<std::io::Result<_>>()?;
    // Sorted, so equal trees give equal archives.
    names.sort();
    for name in names {
        let rel_path = rel.join(&name);
        let full = root.join(&rel_path);
        let meta = std::fs::symlink_metadata(&full)?;
        let ft = meta.file_type();
        if ft.is_dir() {
            builder.append_dir(&rel_path, &full)?;
            append_tree(builder, root, &rel_path)?;
        } else if ft.is_file() || ft.is_symlink() {
            builder.append_path_with_name(&full, &rel_path)?;
        } else {
            // Sockets, FIFOs and devices cannot travel in a checkpoint (the
            // import side refuses them too).
            tracing::warn!(path = %full.display(), "skipping special file in tar export");
        }
    }
    Ok(())
}

/// `Write` that sends full chunks into a channel.
struct ChannelWriter {
    tx: mpsc::Sender<Result<Bytes>>,
    buf: BytesMut,
}

impl ChannelWriter {
    fn send_buf(&mut self) -> std::io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let chunk = self.buf.split().freeze();
        self.tx.blocking_send(Ok(chunk)).map_err(|_| {
            std::io::Error::new(
                std::io::ErrorKind::BrokenPipe,
                "tar export reader went away",
            )
        })
    }
}

impl Write for ChannelWriter {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        let room = CHUNK - self.buf.len();
        let n = room.min(data.len());
        self.buf.extend_from_slice(&data[..n]);
        if self.buf.len() >= CHUNK {
            self.send_buf()?;
            self.buf.reserve(CHUNK);
        }
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.send_buf()
    }
}

/// `Read` over chunks arriving on a channel.
struct ChannelReader {
    rx: mpsc::Receiver<Bytes>,
    cur: Bytes,
}

impl Read for ChannelReader {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        while self.cur.is_empty() {
            match self.rx.blocking_recv() {
                Some(chunk) => self.cur = chunk,
                None => return Ok(0),
            }
        }
        let n = self.cur.len().min(out.len());
        out[..n].copy_from_slice(&self.cur.split_to(n));
        Ok(n)
    }
}

/// Extract `tar` into `dir`, overlaying what is there. The archive is
/// scanned on the way in (`TarScanner::outward_symlinks`): a refused entry
/// stops the import before the unpacker sees its header.
pub(crate) async fn import(dir: PathBuf, tar: ByteStream) -> Result<()> {
    let mut tar = scan_stream(tar, TarScanner::new().outward_symlinks());
    tokio::fs::create_dir_all(&dir).await?;
    let (tx, rx) = mpsc::channel::<Bytes>(DEPTH);
    let unpacker = tokio::task::spawn_blocking(move || {
        unpack(
            &dir,
            ChannelReader {
                rx,
                cur: Bytes::new(),
            },
        )
    });
    let mut stream_error = None;
    while let Some(chunk) = tar.next().await {
        match chunk {
            Ok(chunk) => {
                if tx.send(chunk).await.is_err() {
                    // The unpacker stopped early; its result says why.
                    break;
                }
            }
            Err(e) => {
                stream_error = Some(e);
                break;
            }
        }
    }
    drop(tx);
    let unpacked = unpacker
        .await
        .map_err(|e| Error::backend(format!("tar import task failed: {e}")))?;
    if let Some(e) = stream_error {
        return Err(e);
    }
    unpacked
}

fn unpack(dir: &Path, reader: ChannelReader) -> Result<()> {
    let mut archive = tar::Archive::new(reader);
    // Modes are kept (no umask) but without setuid, setgid and sticky bits:
    // an archive must never leave a program that runs as its owner.
    // (`moves::restore` refuses such entries outright before this runs.)
    archive.set_preserve_permissions(false);
    archive.set_mask(0);
    archive.set_preserve_mtime(true);
    archive.set_overwrite(true);
    archive.set_unpack_xattrs(false);
    // Directories without owner write permission are made writable while
    // their contents land, and get their mode at the end (as `tar` does).
    let mut locked_dirs: Vec<(PathBuf, u32)> = Vec::new();
    for entry in archive
        .entries()
        .map_err(|e| Error::corrupt(format!("reading tar: {e}")))?
    {
        let mut entry = entry.map_err(|e| Error::corrupt(format!("reading tar entry: {e}")))?;
        let raw_path = String::from_utf8_lossy(&entry.path_bytes()).into_owned();
        let normalized = check_entry_path(&raw_path)?;
        let kind = entry.header().entry_type();
        if matches!(
            kind,
            tar::EntryType::Char | tar::EntryType::Block | tar::EntryType::Fifo
        ) {
            return Err(Error::unsafe_entry(format!(
                "refusing tar entry {raw_path:?}: device files and FIFOs are not imported"
            )));
        }
        if normalized.is_empty() {
            // The archive root itself: `dir` already exists.
            continue;
        }
        let unpacked = entry.unpack_in(dir).map_err(|e| {
            let kind = match e.kind() {
                std::io::ErrorKind::NotFound => ErrorKind::NotFound,
                _ => ErrorKind::Io,
            };
            Error::new(kind, format!("unpacking tar entry {raw_path:?}: {e}"))
        })?;
        if !unpacked {
            return Err(Error::unsafe_entry(format!(
                "refusing tar entry {raw_path:?}: it would land outside {}",
                dir.display()
            )));
        }
        if kind == tar::EntryType::Directory {
            let mode = entry.header().mode().unwrap_or(0o755) & 0o777;
            if mode & 0o200 == 0 {
                let path = dir.join(&normalized);
                std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode | 0o700))?;
                locked_dirs.push((path, mode));
            }
        }
    }
    for (path, mode) in locked_dirs.into_iter().rev() {
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode))?;
    }
    Ok(())
}

/// Extract `tar` like [`import`], but into a staging directory beside `dir`
/// (inside it when no sibling can be made), and move the entries into place
/// only once the whole stream ended without an error: a refused entry or a
/// content hash found wrong at the end of the stream leaves `dir` as it was
/// (not even created) and the staging directory removed.
pub(crate) async fn import_staged(dir: PathBuf, tar: ByteStream) -> Result<()> {
    let staging = {
        let dir = dir.clone();
        tokio::task::spawn_blocking(move || make_staging(&dir))
            .await
            .map_err(|e| Error::backend(format!("tar import task failed: {e}")))??
    };
    let imported = import(staging.clone(), tar).await;
    tokio::task::spawn_blocking(move || {
        let result = imported.and_then(|()| {
            std::fs::create_dir_all(&dir)?;
            commit(&staging, &dir)
        });
        remove_tree(&staging);
        result
    })
    .await
    .map_err(|e| Error::backend(format!("tar import task failed: {e}")))?
}

/// A fresh directory, readable by its owner only, for the entries of one
/// import into `dir`: `<parent>/.<name>.harness-import-<uuid>` on the same
/// file system as `dir` (so entries move by rename), else
/// `<dir>/.harness-import-<uuid>`.
fn make_staging(dir: &Path) -> Result<PathBuf> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    let nonce = uuid::Uuid::new_v4().simple();
    let mut builder = std::fs::DirBuilder::new();
    builder.mode(0o700);
    if let (Some(parent), Some(name)) = (dir.parent(), dir.file_name()) {
        let sibling = parent.join(format!(
            ".{}.harness-import-{nonce}",
            name.to_string_lossy()
        ));
        let same_fs = match (std::fs::metadata(parent), std::fs::metadata(dir)) {
            (Ok(p), Ok(d)) => p.dev() == d.dev(),
            (Ok(_), Err(e)) if e.kind() == std::io::ErrorKind::NotFound => true,
            (Err(e), _) if e.kind() == std::io::ErrorKind::NotFound => {
                std::fs::create_dir_all(parent)?;
                true
            }
            _ => false,
        };
        if same_fs && builder.create(&sibling).is_ok() {
            return Ok(sibling);
        }
    }
    std::fs::create_dir_all(dir)?;
    let inside = dir.join(format!(".harness-import-{nonce}"));
    builder.create(&inside)?;
    Ok(inside)
}

/// Move every entry of `staged` into `dir` (an existing directory),
/// overlaying: an entry not there is renamed into place whole (a directory
/// with everything under it); a file or symlink there is replaced; a
/// directory there is merged into and takes the staged directory's mode. A
/// symlink in `dir` is never followed: where the archive has a directory,
/// it replaces the symlink.
fn commit(staged: &Path, dir: &Path) -> Result<()> {
    for entry in std::fs::read_dir(staged)? {
        let name = entry?.file_name();
        let from = staged.join(&name);
        let to = dir.join(&name);
        let from_meta = std::fs::symlink_metadata(&from)?;
        let to_meta = match std::fs::symlink_metadata(&to) {
            Ok(meta) => meta,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                std::fs::rename(&from, &to)?;
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        match (from_meta.is_dir(), to_meta.is_dir()) {
            (true, true) => {
                // Both writable while entries move; then the archive's mode.
                let mode = from_meta.permissions().mode() & 0o7777;
                std::fs::set_permissions(&from, std::fs::Permissions::from_mode(mode | 0o700))?;
                std::fs::set_permissions(&to, std::fs::Permissions::from_mode(mode | 0o700))?;
                commit(&from, &to)?;
                std::fs::set_permissions(&to, std::fs::Permissions::from_mode(mode))?;
                std::fs::remove_dir(&from)?;
            }
            (true, false) => {
                std::fs::remove_file(&to)?;
                std::fs::rename(&from, &to)?;
            }
            (false, true) => {
                // Only an empty directory gives way to a file (as tar fails
                // to overwrite a directory with a file).
                std::fs::remove_dir(&to).map_err(|e| {
                    Error::new(
                        ErrorKind::Io,
                        format!(
                            "cannot replace directory {} with a file from the archive: {e}",
                            to.display()
                        ),
                    )
                })?;
                std::fs::rename(&from, &to)?;
            }
            (false, false) => std::fs::rename(&from, &to)?,
        }
    }
    Ok(())
}

/// Remove a staging directory, whatever modes its directories were left
/// with. Best effort: a leftover is outside the target's tree.
fn remove_tree(path: &Path) {
    if std::fs::remove_dir_all(path).is_ok() {
        return;
    }
    fn unlock(path: &Path) {
        if let Ok(meta) = std::fs::symlink_metadata(path) {
            if meta.is_dir() {
                let mode = meta.permissions().mode();
                let _ =
                    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode | 0o700));
                if let Ok(entries) = std::fs::read_dir(path) {
                    for entry in entries.flatten() {
                        unlock(&entry.path());
                    }
                }
            }
        }
    }
    unlock(path);
    if let Err(e) = std::fs::remove_dir_all(path) {
        tracing::warn!(path = %path.display(), error = %e, "could not remove a tar import's staging directory");
    }
}
