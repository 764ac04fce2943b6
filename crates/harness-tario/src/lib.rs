//! Tar export and import, run on blocking threads and bridged to async byte
//! streams by bounded channels (so memory stays at a few chunks whatever the
//! size of the tree). The `tar` crate builds and reads the archives; the
//! import writes every entry itself, beneath the target ([`unpack_beneath`]).

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use bytes::{Bytes, BytesMut};
use futures::StreamExt;
use harness_core::stream::ByteStream;
use harness_core::tarscan::{check_entry_path, scan_stream, TarScanner};
use harness_core::{Error, ErrorKind, Result};
use rustix::io::Errno;
use tokio::sync::mpsc;

/// Size of the chunks an export yields.
const CHUNK: usize = 256 * 1024;
/// Chunks in flight between the blocking side and the async side.
const DEPTH: usize = 4;

/// Stream `dir` as an uncompressed tar whose entry names are relative to it.
pub fn export(dir: PathBuf) -> ByteStream {
    export_with(move |builder| append_tree(builder, &dir, Path::new("")))
}

/// A tar stream whose entries `append` adds, built on a blocking thread
/// (symlinks never followed) and sent on in chunks as it grows.
fn export_with(
    append: impl FnOnce(&mut tar::Builder<&mut ChannelWriter>) -> Result<()> + Send + 'static,
) -> ByteStream {
    let (tx, mut rx) = mpsc::channel::<Result<Bytes>>(DEPTH);
    tokio::task::spawn_blocking(move || {
        let mut writer = ChannelWriter {
            tx: tx.clone(),
            buf: BytesMut::with_capacity(CHUNK),
        };
        let result = (|| -> Result<()> {
            let mut builder = tar::Builder::new(&mut writer);
            builder.follow_symlinks(false);
            append(&mut builder)?;
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

/// A tar of exactly `paths` under `dir` (no recursion; symlinks not
/// followed; a path gone meanwhile left out), built in-process
/// (`Sandbox::export_paths_tar`).
pub fn export_paths(dir: PathBuf, paths: Vec<String>) -> ByteStream {
    export_with(move |builder| {
        for path in &paths {
            let rel = Path::new(path);
            if rel.is_absolute()
                || rel
                    .components()
                    .any(|c| !matches!(c, std::path::Component::Normal(_)))
            {
                return Err(Error::invalid(format!(
                    "{path:?} is not a relative path inside the exported directory"
                )));
            }
            let full = dir.join(rel);
            let meta = match std::fs::symlink_metadata(&full) {
                Ok(m) => m,
                // Removed since it was listed: left out, as GNU tar's
                // --ignore-failed-read does.
                Err(e) if gone(&e) => continue,
                Err(e) => return Err(e.into()),
            };
            let ft = meta.file_type();
            let appended = if ft.is_dir() {
                builder.append_dir(rel, &full)
            } else if ft.is_file() || ft.is_symlink() {
                builder.append_path_with_name(&full, rel)
            } else {
                tracing::warn!(path = %full.display(), "skipping special file in tar export");
                Ok(())
            };
            match appended {
                Ok(()) => {}
                Err(e) if gone(&e) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    })
}

/// A listed path that is no longer there: removed, or under a directory
/// that became a file meanwhile (`ENOTDIR`). Any other error (a name too
/// long, a loop of symlinks, a failing disk) fails the export.
fn gone(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::NotFound | std::io::ErrorKind::NotADirectory
    )
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
pub async fn import(dir: PathBuf, tar: ByteStream) -> Result<()> {
    tokio::fs::create_dir_all(&dir).await?;
    unpack_stream(tar, move |reader| unpack_safely(&dir, reader)).await
}

/// A directory, held by a descriptor, that [`import_beneath`] writes into.
#[derive(Debug)]
pub struct ImportRoot(Beneath);

impl ImportRoot {
    /// `dir` (a descriptor of a directory) for an import whose new entries
    /// become `owner`'s (uid, gid) when given — the owner of the directory
    /// written into, say, when the writer is root on another system's
    /// behalf. `Unsupported` where the kernel lacks `openat2`.
    pub fn new(dir: std::os::fd::OwnedFd, owner: Option<(u32, u32)>) -> Result<Self> {
        let owner = owner.map(|(uid, gid)| {
            (
                rustix::fs::Uid::from_raw(uid),
                rustix::fs::Gid::from_raw(gid),
            )
        });
        Ok(ImportRoot(Beneath::from_fd(dir, owner)?))
    }
}

/// Extract `tar` into `root`, overlaying what is there, every entry
/// written beneath it ([`unpack_beneath`]); `shown` names the directory in
/// errors. The archive is scanned on the way in, as by [`import`].
pub async fn import_beneath(root: ImportRoot, shown: PathBuf, tar: ByteStream) -> Result<()> {
    unpack_stream(tar, move |reader| unpack_beneath(root.0, &shown, reader)).await
}

/// Feed `tar`, scanned (`TarScanner::outward_symlinks`: a refused entry
/// stops the import before the unpacker sees its header), to `unpack` on a
/// blocking thread through a bounded channel.
async fn unpack_stream(
    tar: ByteStream,
    unpack: impl FnOnce(ChannelReader) -> Result<()> + Send + 'static,
) -> Result<()> {
    let mut tar = scan_stream(tar, TarScanner::new().outward_symlinks());
    let (tx, rx) = mpsc::channel::<Bytes>(DEPTH);
    let unpacker = tokio::task::spawn_blocking(move || {
        unpack(ChannelReader {
            rx,
            cur: Bytes::new(),
        })
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

/// [`unpack_beneath`] where the kernel has `openat2`, else [`unpack`].
fn unpack_safely(dir: &Path, reader: impl Read) -> Result<()> {
    match Beneath::open(dir) {
        Ok(beneath) => unpack_beneath(beneath, dir, reader),
        Err(e) if e.kind() == ErrorKind::Unsupported => unpack(dir, reader),
        Err(e) => Err(e),
    }
}

/// The tar crate's `unpack_in`, for kernels without `openat2`: it checks
/// each entry's parent with a `realpath` (slower, and racy against a
/// symlink swapped in after the check).
fn unpack(dir: &Path, reader: impl Read) -> Result<()> {
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
    let mut locked_dirs = DirModes::default();
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
        let unpacked = entry
            .unpack_in(dir)
            .map_err(|e| unpack_error(&raw_path, e))?;
        if !unpacked {
            return Err(Error::unsafe_entry(format!(
                "refusing tar entry {raw_path:?}: it would land outside {}",
                dir.display()
            )));
        }
        if kind == tar::EntryType::Directory {
            let mode = entry.header().mode().unwrap_or(0o755) & 0o777;
            let path = dir.join(&normalized);
            if mode & 0o200 == 0 {
                std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode | 0o700))?;
                locked_dirs.insert(path, mode);
            } else {
                // A later entry of a locked directory, with a mode the
                // unpack just gave it: that one stays.
                locked_dirs.remove(&path);
            }
        }
    }
    set_dir_modes(locked_dirs)
}

/// Directories' final modes, set once their entries have landed: a later
/// entry of the same directory overrides an earlier one's mode (as tar).
type DirModes = std::collections::HashMap<PathBuf, u32>;

/// Give each directory of `modes` its mode, deepest first (a parent's mode
/// may take its owner's search permission, which a child's change needs).
/// A path a later entry replaced (a file or symlink now) keeps its own mode.
fn set_dir_modes(modes: DirModes) -> Result<()> {
    let mut dirs: Vec<(PathBuf, u32)> = modes.into_iter().collect();
    dirs.sort_by_key(|(path, _)| std::cmp::Reverse(path.components().count()));
    for (path, mode) in dirs {
        if std::fs::symlink_metadata(&path).is_ok_and(|m| m.is_dir()) {
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode))?;
        }
    }
    Ok(())
}

/// An entry that could not be written, with why: the tar crate's errors
/// name the path ("failed to unpack `…`") and keep the system's error (a
/// full disk, a permission) as their source, so the chain goes in the
/// message; a bench once stopped on "failed to unpack" and nothing else.
fn unpack_error(raw: &str, e: std::io::Error) -> Error {
    let kind = match e.kind() {
        std::io::ErrorKind::NotFound => ErrorKind::NotFound,
        _ => ErrorKind::Io,
    };
    let mut message = format!("unpacking tar entry {raw:?}: {e}");
    let mut source = std::error::Error::source(&e);
    while let Some(cause) = source {
        message.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    Error::new(kind, message)
}

/// Unpack into `dir`, overlaying what is there, with every entry written
/// relative to a descriptor of its parent directory opened by `openat2`
/// with `RESOLVE_BENEATH` from `dir` ([`Beneath`]): the kernel refuses any
/// path that would leave `dir` — through `..`, an absolute symlink or a
/// symlink climbing out, whether the archive made it or the tree had it —
/// at the moment of the call, so a symlink swapped in while the import
/// runs leads nowhere. (The tar crate's `unpack_in` checks the same with a
/// `realpath` of the entry's parent and of `dir`: a dozen system calls an
/// entry, a sixth of a 20,000-file restore's time, and a check a swap
/// after it defeats.) Each directory is opened once for the run of entries
/// in it, each file written with one open, its data, its times and its
/// mode. Entries under a symlink the archive itself made are refused (the
/// scanner in front of [`import`] refuses them first; this is the
/// second line), as are entries leaving `dir`.
fn unpack_beneath(mut beneath: Beneath, dir: &Path, reader: impl Read) -> Result<()> {
    use std::collections::HashSet;

    let mut archive = tar::Archive::new(reader);
    // Paths (relative, normalized) of the symlinks the archive made.
    let mut symlinks: HashSet<String> = HashSet::new();
    // Final modes of the archive's directories, by relative path.
    let mut dir_modes: HashMap<String, u32> = HashMap::new();
    let unsafe_entry =
        |raw: &str, why: &str| Error::unsafe_entry(format!("refusing tar entry {raw:?}: {why}"));
    let under_symlink = |symlinks: &HashSet<String>, path: &str| {
        path.match_indices('/')
            .any(|(i, _)| symlinks.contains(&path[..i]))
    };
    // A path the kernel would not resolve beneath `dir`.
    let failed = |raw: &str, e: std::io::Error| {
        if matches!(Errno::from_io_error(&e), Some(Errno::XDEV | Errno::LOOP)) {
            unsafe_entry(
                raw,
                &format!("it would land outside {} ({e})", dir.display()),
            )
        } else {
            unpack_error(raw, e)
        }
    };
    for entry in archive
        .entries()
        .map_err(|e| Error::corrupt(format!("reading tar: {e}")))?
    {
        let mut entry = entry.map_err(|e| Error::corrupt(format!("reading tar entry: {e}")))?;
        let raw = String::from_utf8_lossy(&entry.path_bytes()).into_owned();
        let normalized = check_entry_path(&raw)?;
        if normalized.is_empty() {
            // The archive root itself: `dir` already exists.
            continue;
        }
        if under_symlink(&symlinks, &normalized) {
            return Err(unsafe_entry(&raw, "it lies under a symlink of the archive"));
        }
        let (parent, name) = normalized.rsplit_once('/').unwrap_or(("", &normalized));
        let header = entry.header();
        let kind = header.entry_type();
        let mode = header.mode().unwrap_or(0o644) & 0o777;
        let mtime = header.mtime().ok();
        // An entry replaces an earlier one of the same path (as tar does),
        // except a directory, which a later directory entry merges into.
        match kind {
            tar::EntryType::Directory => {
                symlinks.remove(&normalized);
                beneath
                    .make_dir(parent, name, mode)
                    .map_err(|e| failed(&raw, e))?;
                dir_modes.insert(normalized, mode);
            }
            tar::EntryType::Regular | tar::EntryType::Continuous => {
                symlinks.remove(&normalized);
                let mut file = beneath
                    .create_file(parent, name)
                    .map_err(|e| failed(&raw, e))?;
                std::io::copy(&mut entry, &mut file).map_err(|e| unpack_error(&raw, e))?;
                if let Some(secs) = mtime {
                    let at = std::time::UNIX_EPOCH + std::time::Duration::from_secs(secs);
                    file.set_times(std::fs::FileTimes::new().set_accessed(at).set_modified(at))
                        .map_err(|e| unpack_error(&raw, e))?;
                }
                // No setuid, setgid or sticky bit: an archive must never
                // leave a program that runs as its owner.
                file.set_permissions(std::fs::Permissions::from_mode(mode))
                    .map_err(|e| unpack_error(&raw, e))?;
            }
            tar::EntryType::Symlink => {
                let target = entry
                    .link_name()
                    .map_err(|e| Error::corrupt(format!("reading tar entry {raw:?}: {e}")))?
                    .ok_or_else(|| unsafe_entry(&raw, "a symlink without a target"))?;
                beneath
                    .symlink(&target, parent, name)
                    .map_err(|e| failed(&raw, e))?;
                symlinks.insert(normalized);
            }
            tar::EntryType::Link => {
                let target = entry
                    .link_name_bytes()
                    .map(|b| String::from_utf8_lossy(&b).into_owned())
                    .ok_or_else(|| unsafe_entry(&raw, "a hard link without a target"))?;
                let target = check_entry_path(&target)?;
                if target.is_empty() || under_symlink(&symlinks, &target) {
                    return Err(unsafe_entry(
                        &raw,
                        "its link target is not a file of the archive",
                    ));
                }
                beneath
                    .hard_link(&target, parent, name)
                    .map_err(|e| failed(&raw, e))?;
            }
            tar::EntryType::Char | tar::EntryType::Block | tar::EntryType::Fifo => {
                return Err(unsafe_entry(
                    &raw,
                    "device files and FIFOs are not imported",
                ));
            }
            // Extension records are read by `entries()`; anything else
            // (sparse files, vendor types) is not something we write.
            other => {
                return Err(unsafe_entry(
                    &raw,
                    &format!("entry type {other:?} is not imported"),
                ));
            }
        }
    }
    beneath.set_dir_modes(dir_modes)
}

/// A directory written into only through descriptors the kernel resolved
/// beneath it (`openat2`, `RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS`); the
/// directory last written into is kept open.
#[derive(Debug)]
struct Beneath {
    root: std::os::fd::OwnedFd,
    /// The last parent directory opened: its relative path and descriptor.
    /// Never a directory this import removed: only an empty one is removed
    /// (replaced by another entry of its path), and one kept here holds the
    /// entry written into it — removing it fails.
    last: Option<(String, std::os::fd::OwnedFd)>,
    /// Whom the entries this import makes are given to; `None`: the writer.
    owner: Option<(rustix::fs::Uid, rustix::fs::Gid)>,
}

impl Beneath {
    const RESOLVE: rustix::fs::ResolveFlags =
        rustix::fs::ResolveFlags::BENEATH.union(rustix::fs::ResolveFlags::NO_MAGICLINKS);
    /// A directory held as a place to resolve from, not to read.
    const DIR_PATH: rustix::fs::OFlags = rustix::fs::OFlags::PATH
        .union(rustix::fs::OFlags::DIRECTORY)
        .union(rustix::fs::OFlags::CLOEXEC);
    /// A directory opened to change its mode, never through a symlink.
    const DIR_NOFOLLOW: rustix::fs::OFlags = rustix::fs::OFlags::RDONLY
        .union(rustix::fs::OFlags::DIRECTORY)
        .union(rustix::fs::OFlags::NOFOLLOW)
        .union(rustix::fs::OFlags::CLOEXEC);
    /// A file made by this import, never one there already or a symlink's.
    const NEW_FILE: rustix::fs::OFlags = rustix::fs::OFlags::WRONLY
        .union(rustix::fs::OFlags::CREATE)
        .union(rustix::fs::OFlags::EXCL)
        .union(rustix::fs::OFlags::NOFOLLOW)
        .union(rustix::fs::OFlags::CLOEXEC);

    fn open(dir: &Path) -> Result<Self> {
        let root = rustix::fs::open(dir, Self::DIR_PATH, rustix::fs::Mode::empty())
            .map_err(|e| Error::from(std::io::Error::from(e)))?;
        Self::from_fd(root, None)
    }

    fn from_fd(
        root: std::os::fd::OwnedFd,
        owner: Option<(rustix::fs::Uid, rustix::fs::Gid)>,
    ) -> Result<Self> {
        use rustix::fs::Mode;
        // Asked once, before anything is read: a kernel without it says so.
        match rustix::fs::openat2(
            &root,
            ".",
            Self::DIR_PATH,
            Mode::empty(),
            Self::RESOLVE,
        ) {
            Ok(_) => Ok(Beneath {
                root,
                last: None,
                owner,
            }),
            Err(Errno::NOSYS) => Err(Error::unsupported(
                "tar imports need openat2 (Linux 5.6 or later) to keep every entry inside the sandbox",
            )),
            Err(e) => Err(std::io::Error::from(e).into()),
        }
    }

    /// Give what `fd` holds, just made, to the import's owner.
    fn give_fd(&self, fd: impl std::os::fd::AsFd) -> std::io::Result<()> {
        if let Some((uid, gid)) = self.owner {
            rustix::fs::fchown(fd, Some(uid), Some(gid))?;
        }
        Ok(())
    }

    /// Give `parent/name`, just made, to `owner` (not through a symlink:
    /// a symlink itself is given).
    fn give(
        owner: Option<(rustix::fs::Uid, rustix::fs::Gid)>,
        parent: impl std::os::fd::AsFd,
        name: &str,
    ) -> std::io::Result<()> {
        if let Some((uid, gid)) = owner {
            use rustix::fs::AtFlags;
            rustix::fs::chownat(
                parent,
                name,
                Some(uid),
                Some(gid),
                AtFlags::SYMLINK_NOFOLLOW,
            )?;
        }
        Ok(())
    }

    /// `rel` (relative, normalized; "" is the root), opened beneath the root.
    fn open_dir(
        &self,
        rel: &str,
        flags: rustix::fs::OFlags,
    ) -> std::io::Result<std::os::fd::OwnedFd> {
        use rustix::fs::{Mode, OFlags};
        let rel = if rel.is_empty() { "." } else { rel };
        let flags = flags.union(OFlags::DIRECTORY).union(OFlags::CLOEXEC);
        Ok(rustix::fs::openat2(
            &self.root,
            rel,
            flags,
            Mode::empty(),
            Self::RESOLVE,
        )?)
    }

    /// The directory `rel`, made with its missing parents (as `mkdir -p`).
    fn dir(&mut self, rel: &str) -> std::io::Result<std::os::fd::BorrowedFd<'_>> {
        use rustix::fs::OFlags;
        use std::os::fd::AsFd;
        if rel.is_empty() {
            return Ok(self.root.as_fd());
        }
        if self.last.as_ref().is_none_or(|(at, _)| at != rel) {
            let fd = match self.open_dir(rel, OFlags::PATH) {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    for (i, _) in rel.match_indices('/').chain([(rel.len(), "")]) {
                        let (up, name) = rel[..i].rsplit_once('/').unwrap_or(("", &rel[..i]));
                        let up = self.open_dir(up, OFlags::PATH)?;
                        match rustix::fs::mkdirat(&up, name, 0o777.into()) {
                            Ok(()) => Self::give(self.owner, &up, name)?,
                            Err(Errno::EXIST) => {}
                            Err(e) => return Err(e.into()),
                        }
                    }
                    self.open_dir(rel, OFlags::PATH)?
                }
                other => other?,
            };
            self.last = Some((rel.to_string(), fd));
        }
        Ok(self.last.as_ref().expect("just set").1.as_fd())
    }

    /// Remove what `parent/name` holds (a file, a symlink, an empty
    /// directory), if anything.
    fn remove(&mut self, parent: &str, name: &str) -> std::io::Result<()> {
        use rustix::fs::AtFlags;
        let at = self.dir(parent)?;
        let flags = match rustix::fs::statat(at, name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) if rustix::fs::FileType::from_raw_mode(st.st_mode).is_dir() => {
                AtFlags::REMOVEDIR
            }
            Ok(_) => AtFlags::empty(),
            Err(Errno::NOENT) => return Ok(()),
            Err(e) => return Err(e.into()),
        };
        Ok(rustix::fs::unlinkat(at, name, flags)?)
    }

    /// A directory at `parent/name`, merged into when there is one, else
    /// made (replacing a file or symlink), writable by its owner while its
    /// entries land.
    fn make_dir(&mut self, parent: &str, name: &str, mode: u32) -> std::io::Result<()> {
        use rustix::fs::AtFlags;
        let at = self.dir(parent)?;
        let made = match rustix::fs::mkdirat(at, name, 0o700.into()) {
            Ok(()) => true,
            Err(Errno::EXIST) => {
                let st = rustix::fs::statat(at, name, AtFlags::SYMLINK_NOFOLLOW)?;
                let replaced = !rustix::fs::FileType::from_raw_mode(st.st_mode).is_dir();
                if replaced {
                    self.remove(parent, name)?;
                    rustix::fs::mkdirat(self.dir(parent)?, name, 0o700.into())?;
                }
                replaced
            }
            Err(e) => return Err(e.into()),
        };
        // Opened without following: a symlink swapped in is refused.
        let fd = rustix::fs::openat(self.dir(parent)?, name, Self::DIR_NOFOLLOW, 0.into())?;
        rustix::fs::fchmod(&fd, (mode | 0o700).into())?;
        if made {
            self.give_fd(&fd)?;
        }
        Ok(())
    }

    /// A new file at `parent/name`, replacing what is there, open for writing.
    fn create_file(&mut self, parent: &str, name: &str) -> std::io::Result<std::fs::File> {
        let flags = Self::NEW_FILE;
        let fd = match rustix::fs::openat(self.dir(parent)?, name, flags, 0o600.into()) {
            Err(Errno::EXIST) => {
                self.remove(parent, name)?;
                rustix::fs::openat(self.dir(parent)?, name, flags, 0o600.into())?
            }
            other => other?,
        };
        self.give_fd(&fd)?;
        Ok(std::fs::File::from(fd))
    }

    fn symlink(&mut self, target: &Path, parent: &str, name: &str) -> std::io::Result<()> {
        self.remove(parent, name)?;
        let owner = self.owner;
        let at = self.dir(parent)?;
        rustix::fs::symlinkat(target, at, name)?;
        Self::give(owner, at, name)
    }

    /// A hard link at `parent/name` to `target` (relative, normalized),
    /// both resolved beneath the root.
    fn hard_link(&mut self, target: &str, parent: &str, name: &str) -> std::io::Result<()> {
        use rustix::fs::{AtFlags, OFlags};
        let (up, file) = target.rsplit_once('/').unwrap_or(("", target));
        let from = self.open_dir(up, OFlags::PATH)?;
        self.remove(parent, name)?;
        Ok(rustix::fs::linkat(
            &from,
            file,
            self.dir(parent)?,
            name,
            AtFlags::empty(),
        )?)
    }

    /// Give each directory of `modes` its mode, deepest first (a parent's
    /// mode may take its owner's search permission, which a child's change
    /// needs). A path a later entry replaced (a file or symlink now) keeps
    /// its own mode.
    fn set_dir_modes(self, modes: HashMap<String, u32>) -> Result<()> {
        use rustix::fs::OFlags;
        let mut dirs: Vec<(String, u32)> = modes.into_iter().collect();
        dirs.sort_by_key(|(path, _)| std::cmp::Reverse(path.matches('/').count()));
        for (path, mode) in dirs {
            match self.open_dir(&path, OFlags::RDONLY.union(OFlags::NOFOLLOW)) {
                Ok(fd) => rustix::fs::fchmod(&fd, mode.into())
                    .map_err(|e| Error::from(std::io::Error::from(e)))?,
                Err(e) if matches!(Errno::from_io_error(&e), Some(Errno::NOTDIR | Errno::LOOP)) => {
                }
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }
}

/// Extract `tar` like [`import`], but into a staging directory beside `dir`
/// (inside it when no sibling can be made), and move the entries into place
/// only once the whole stream ended without an error: a refused entry or a
/// content hash found wrong at the end of the stream leaves `dir` as it was
/// (not even created) and the staging directory removed.
pub async fn import_staged(dir: PathBuf, tar: ByteStream) -> Result<()> {
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
                move_into_place(&from, &to, &from_meta)?;
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
                move_into_place(&from, &to, &from_meta)?;
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

/// Rename `from` (whose metadata is `meta`) to `to`. A directory without
/// its owner's write permission cannot move to another parent unless the
/// mover is root (its `..` entry is rewritten: `EACCES`), so it is made
/// writable for the move and given its mode back.
fn move_into_place(from: &Path, to: &Path, meta: &std::fs::Metadata) -> std::io::Result<()> {
    let mode = meta.permissions().mode() & 0o7777;
    if !meta.is_dir() || mode & 0o200 != 0 {
        return std::fs::rename(from, to);
    }
    std::fs::set_permissions(from, std::fs::Permissions::from_mode(mode | 0o200))?;
    std::fs::rename(from, to)?;
    std::fs::set_permissions(to, std::fs::Permissions::from_mode(mode))
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

#[cfg(test)]
mod tests {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    use super::*;

    #[test]
    fn an_unpack_error_says_why() {
        // The shape of the tar crate's errors: the path in the message,
        // the system's error as the source.
        #[derive(Debug)]
        struct Wrapped(std::io::Error);
        impl std::fmt::Display for Wrapped {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("failed to unpack `/t/a.txt`")
            }
        }
        impl std::error::Error for Wrapped {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        let full = std::io::Error::from_raw_os_error(28);
        let e = unpack_error("a.txt", std::io::Error::new(full.kind(), Wrapped(full)));
        assert_eq!(e.kind(), ErrorKind::Io);
        assert!(e.message().contains("failed to unpack"), "{e}");
        assert!(e.message().contains("No space left on device"), "{e}");
        // A path that is not there stays NotFound.
        let gone = unpack_error("b.txt", std::io::Error::from(std::io::ErrorKind::NotFound));
        assert_eq!(gone.kind(), ErrorKind::NotFound, "{gone}");
    }

    /// A later entry of the same path replaces an earlier directory (an
    /// empty one), file or symlink, as tar does.
    #[test]
    fn the_unpack_replaces_an_earlier_entry_of_the_same_path() {
        use tar::EntryType as T;
        let tar = archive(&[
            ("x/", T::Directory, 0o755, ""),
            ("x", T::Regular, 0o644, "a file now"),
            ("l", T::Symlink, 0o777, "x"),
            ("l", T::Regular, 0o600, "not a link"),
            ("f", T::Regular, 0o644, "a file first"),
            ("f/", T::Directory, 0o750, ""),
            ("f/in.txt", T::Regular, 0o644, "in"),
            ("s", T::Symlink, 0o777, "/"),
            ("s/", T::Directory, 0o755, ""),
        ]);
        let dir = tempfile::tempdir().unwrap();
        unpack_safely(dir.path(), &tar[..]).unwrap();
        assert_eq!(
            listing(dir.path()),
            [
                "f/ 750",
                "f/in.txt 644 1700000000 1 in",
                "l 600 1700000000 1 not a link",
                "s/ 755",
                "x 644 1700000000 1 a file now"
            ]
        );
    }

    /// A tar of the given entries: `(path, kind, mode, data or link target)`.
    fn archive(entries: &[(&str, tar::EntryType, u32, &str)]) -> Vec<u8> {
        let mut builder = tar::Builder::new(Vec::new());
        for (path, kind, mode, data) in entries {
            let mut header = tar::Header::new_gnu();
            header.set_entry_type(*kind);
            header.set_mode(*mode);
            header.set_mtime(1_700_000_000);
            match kind {
                tar::EntryType::Symlink | tar::EntryType::Link => {
                    header.set_size(0);
                    builder.append_link(&mut header, path, data).unwrap();
                }
                _ => {
                    header.set_size(data.len() as u64);
                    builder
                        .append_data(&mut header, path, data.as_bytes())
                        .unwrap();
                }
            }
        }
        builder.into_inner().unwrap()
    }

    /// Every entry under `dir`: path, kind, mode, file mtime, content or
    /// link target.
    fn listing(dir: &Path) -> Vec<String> {
        let mut out = Vec::new();
        let mut stack = vec![dir.to_path_buf()];
        while let Some(at) = stack.pop() {
            for entry in std::fs::read_dir(&at).unwrap() {
                let path = entry.unwrap().path();
                let meta = std::fs::symlink_metadata(&path).unwrap();
                let rel = path.strip_prefix(dir).unwrap().display().to_string();
                let mode = meta.permissions().mode() & 0o7777;
                if meta.is_symlink() {
                    out.push(format!(
                        "{rel} -> {}",
                        std::fs::read_link(&path).unwrap().display()
                    ));
                } else if meta.is_dir() {
                    out.push(format!("{rel}/ {mode:o}"));
                    stack.push(path);
                } else {
                    let data = std::fs::read_to_string(&path).unwrap();
                    out.push(format!(
                        "{rel} {mode:o} {} {} {data}",
                        meta.mtime(),
                        meta.nlink()
                    ));
                }
            }
        }
        out.sort();
        out
    }

    /// The chunks of a stream, and its first error.
    async fn drain(stream: ByteStream) -> (Vec<Bytes>, Option<Error>) {
        let mut chunks = Vec::new();
        let mut stream = stream;
        while let Some(item) = stream.next().await {
            match item {
                Ok(chunk) => chunks.push(chunk),
                Err(e) => return (chunks, Some(e)),
            }
        }
        (chunks, None)
    }

    /// The names of the entries of a tar.
    fn names(chunks: &[Bytes]) -> Vec<String> {
        let bytes = chunks.concat();
        let mut archive = tar::Archive::new(&bytes[..]);
        archive
            .entries()
            .unwrap()
            .map(|e| e.unwrap().path().unwrap().display().to_string())
            .collect()
    }

    #[tokio::test]
    async fn an_export_comes_in_chunks_of_256_kib() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("big"), vec![7u8; 1 << 20]).unwrap();
        let (chunks, err) = drain(export(dir.path().to_path_buf())).await;
        assert!(err.is_none(), "{err:?}");
        let (last, whole) = chunks.split_last().unwrap();
        let sizes: Vec<usize> = chunks.iter().map(Bytes::len).collect();
        assert!(whole.len() >= 4, "{sizes:?}");
        assert!(whole.iter().all(|c| c.len() == 256 * 1024), "{sizes:?}");
        assert!(!last.is_empty() && last.len() <= 256 * 1024, "{sizes:?}");
        assert_eq!(names(&chunks), ["big"]);
    }

    #[tokio::test]
    async fn export_paths_refuses_a_path_that_leaves_the_directory() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("tree");
        std::fs::create_dir_all(dir.join("sub")).unwrap();
        std::fs::write(dir.join("a.txt"), "a").unwrap();
        std::fs::write(root.path().join("secret"), "outside-bytes").unwrap();
        let secret = root.path().join("secret").display().to_string();
        for bad in ["../secret", "sub/../../secret", secret.as_str()] {
            let (chunks, err) =
                drain(export_paths(dir.clone(), vec!["a.txt".into(), bad.into()])).await;
            let err = err.unwrap_or_else(|| panic!("{bad}: exported {:?}", names(&chunks)));
            assert_eq!(err.kind(), ErrorKind::InvalidInput, "{bad}: {err}");
            let bytes = chunks.concat();
            assert!(
                !bytes.windows(13).any(|w| w == b"outside-bytes"),
                "{bad}: the outside file's bytes were sent"
            );
        }
    }

    #[tokio::test]
    async fn export_paths_leaves_out_what_is_gone_and_fails_on_what_it_cannot_read() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.txt"), "a").unwrap();
        std::fs::write(dir.path().join("was-a-dir"), "now a file").unwrap();
        std::fs::create_dir(dir.path().join("d")).unwrap();
        let listed = |more: &str| {
            ["a.txt", "removed.txt", "was-a-dir/inner.txt", "d", more]
                .map(String::from)
                .to_vec()
        };
        let (chunks, err) = drain(export_paths(dir.path().to_path_buf(), listed("a.txt"))).await;
        assert!(err.is_none(), "{err:?}");
        assert_eq!(names(&chunks), ["a.txt", "d", "a.txt"]);
        // A name longer than the file system allows is no "gone" path.
        let long = "n".repeat(300);
        let (_, err) = drain(export_paths(dir.path().to_path_buf(), listed(&long))).await;
        let err = err.expect("a name too long is an error");
        assert!(err.message().contains("too long"), "{err}");
    }

    #[test]
    fn the_unpack_writes_what_the_tar_crate_writes() {
        use tar::EntryType as T;
        let tar = archive(&[
            ("./", T::Directory, 0o755, ""),
            ("a/", T::Directory, 0o750, ""),
            ("a/run.sh", T::Regular, 0o4755, "#!/bin/sh\n"),
            ("a/ro.txt", T::Regular, 0o444, "read only"),
            ("deep/er/still/f.txt", T::Regular, 0o644, "implied parents"),
            ("locked/", T::Directory, 0o555, ""),
            ("locked/inside.txt", T::Regular, 0o600, "in a read-only dir"),
            ("a/ro.txt", T::Regular, 0o640, "replaced by a later entry"),
            ("a/", T::Directory, 0o700, ""),
            ("locked/", T::Directory, 0o500, ""),
            ("opened/", T::Directory, 0o555, ""),
            ("opened/", T::Directory, 0o750, ""),
            ("link", T::Symlink, 0o777, "a/run.sh"),
            ("hard", T::Link, 0o644, "a/ro.txt"),
        ]);
        let (old, new) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        unpack(old.path(), &tar[..]).unwrap();
        unpack_safely(new.path(), &tar[..]).unwrap();
        let (want, got) = (listing(old.path()), listing(new.path()));
        assert_eq!(got, want);
        // A later entry of a directory sets its mode (both unpacks).
        for dir in ["a/ 700", "locked/ 500", "opened/ 750"] {
            assert!(got.contains(&dir.to_string()), "{dir}: {got:#?}");
        }
        // The setuid bit is dropped; the later entry won.
        assert!(
            got.contains(&"a/run.sh 755 1700000000 1 #!/bin/sh\n".to_string()),
            "{got:#?}"
        );
        assert!(
            got.iter()
                .any(|l| l.starts_with("a/ro.txt 640 1700000000 2 replaced")),
            "{got:#?}"
        );
        for dir in [old.path(), new.path()] {
            let locked = dir.join("locked");
            std::fs::set_permissions(&locked, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
    }

    /// The staging directory sits beside the target, on its file system
    /// (entries then move by rename), made with its parents when missing,
    /// private; inside the target when the target is a file system of its
    /// own (its parent is another); an error when the target cannot be read.
    #[test]
    fn the_staging_directory_sits_beside_the_target_on_its_file_system() {
        use std::os::unix::fs::MetadataExt;
        let root = tempfile::tempdir().unwrap();
        let existing = root.path().join("tree");
        std::fs::create_dir(&existing).unwrap();
        for (target, beside) in [
            (existing.clone(), root.path().to_path_buf()),
            (root.path().join("absent"), root.path().to_path_buf()),
            (
                root.path().join("new/deeper/tree"),
                root.path().join("new/deeper"),
            ),
        ] {
            let staging = make_staging(&target).unwrap();
            assert_eq!(staging.parent(), Some(beside.as_path()), "{target:?}");
            let name = staging.file_name().unwrap().to_string_lossy().into_owned();
            let stem = target.file_name().unwrap().to_string_lossy();
            assert!(
                name.starts_with(&format!(".{stem}.harness-import-")),
                "{name}"
            );
            let meta = std::fs::metadata(&staging).unwrap();
            assert_eq!(meta.permissions().mode() & 0o7777, 0o700, "{name}");
        }
        let looped = root.path().join("loop");
        std::os::unix::fs::symlink(&looped, &looped).unwrap();
        assert!(make_staging(&looped).is_err(), "a symlink loop");
        // A file system of its own: /dev/shm (tmpfs) under /dev, where the
        // machine has them apart.
        let (shm, dev) = (Path::new("/dev/shm"), Path::new("/dev"));
        if let (Ok(s), Ok(d)) = (std::fs::metadata(shm), std::fs::metadata(dev)) {
            if s.dev() != d.dev() {
                let staging = make_staging(shm).unwrap();
                let inside = staging.parent() == Some(shm);
                std::fs::remove_dir(&staging).unwrap();
                assert!(inside, "{staging:?}");
            }
        }
    }

    const CHILD_HOW: &str = "TARIO_TEST_UNPACK_HOW";
    const CHILD_DIR: &str = "TARIO_TEST_UNPACK_DIR";

    /// Unpack `tar` into a new directory `out` under `scratch` the way
    /// `how` says, and list it: `unpack` (the tar crate's), `beneath`
    /// ([`unpack_safely`], the imports' unpacker) or
    /// `staged-twice` ([`import_staged`] twice, the second merging into
    /// what the first left).
    fn unpack_and_list(how: &str, scratch: &Path, tar: &[u8]) -> Vec<String> {
        let dir = scratch.join("out");
        // The staged imports are async; the unpacks above them are not.
        let block_on =
            |import: std::pin::Pin<Box<dyn std::future::Future<Output = Result<()>>>>| {
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap()
                    .block_on(import)
            };
        match how {
            "unpack" => {
                std::fs::create_dir(&dir).unwrap();
                unpack(&dir, tar).unwrap();
            }
            "beneath" => {
                std::fs::create_dir(&dir).unwrap();
                unpack_safely(&dir, tar).unwrap();
            }
            "staged-twice" => {
                for _ in 0..2 {
                    let stream = harness_core::stream::once(Bytes::copy_from_slice(tar));
                    block_on(Box::pin(import_staged(dir.clone(), stream))).unwrap();
                }
            }
            "staged-failing" => {
                // The whole archive, then the stream's error (a content
                // hash found wrong at its end): the unpack has finished,
                // read-only directories and all, when the import fails.
                let stream: ByteStream = Box::pin(futures::stream::iter([
                    Ok(Bytes::copy_from_slice(tar)),
                    Err(Error::corrupt("a hash found wrong at the end")),
                ]));
                let err = block_on(Box::pin(import_staged(dir, stream))).unwrap_err();
                assert!(err.message().contains("found wrong"), "{err}");
                // What is left beside the archive: nothing.
                return listing(scratch)
                    .into_iter()
                    .filter(|entry| !entry.starts_with("in.tar "))
                    .collect();
            }
            other => panic!("no unpack {other}"),
        }
        listing(&dir)
    }

    /// [`unpack_and_list`] as a user the file modes bind. Root writes into
    /// any directory, so a read-only one in an archive tests nothing when
    /// the tests run as root (as in CI): then a child process of this test
    /// binary, as `nobody`, does it ([`unpack_child`]).
    fn unpack_and_list_as_a_user(how: &str, tar: &[u8]) -> Vec<String> {
        use std::os::unix::process::CommandExt;
        let scratch = tempfile::tempdir().unwrap();
        if !nix::unistd::geteuid().is_root() {
            let listed = unpack_and_list(how, scratch.path(), tar);
            // Read-only directories the temporary directory's drop could not empty.
            remove_tree(&scratch.path().join("out"));
            return listed;
        }
        std::fs::write(scratch.path().join("in.tar"), tar).unwrap();
        std::os::unix::fs::chown(scratch.path(), Some(65534), Some(65534)).unwrap();
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "tests::unpack_child"])
            .args(["--include-ignored", "--nocapture", "--test-threads=1"])
            .env(CHILD_HOW, how)
            .env(CHILD_DIR, scratch.path())
            .uid(65534)
            .gid(65534)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{how} as nobody: {stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        stdout
            .lines()
            // The test harness's own "test … " may start the first line.
            .filter_map(|l| l.split_once("ENTRY=").map(|(_, entry)| entry.to_string()))
            .collect()
    }

    #[test]
    #[ignore = "the child of unpack_and_list_as_a_user"]
    fn unpack_child() {
        let (Ok(how), Ok(scratch)) = (std::env::var(CHILD_HOW), std::env::var(CHILD_DIR)) else {
            return;
        };
        let scratch = PathBuf::from(scratch);
        let tar = std::fs::read(scratch.join("in.tar")).unwrap();
        for line in unpack_and_list(&how, &scratch, &tar) {
            println!("ENTRY={line}");
        }
    }

    /// Read-only directories in an archive still take their entries when
    /// the modes bind (a laptop user is not root), and end with their own
    /// modes: by the tar crate's unpack, the imports' own unpacker and the
    /// staged import's merge into a tree that has them already.
    #[test]
    fn read_only_directories_take_their_entries_and_keep_their_modes() {
        use tar::EntryType as T;
        let tar = archive(&[
            ("locked/", T::Directory, 0o555, ""),
            ("locked/inner/", T::Directory, 0o500, ""),
            ("locked/inner/f.txt", T::Regular, 0o444, "deep"),
            ("locked/g.txt", T::Regular, 0o644, "g"),
        ]);
        // A staged import that fails at the end leaves nothing: not the
        // target, not its staging directory, read-only directories in it
        // notwithstanding.
        assert_eq!(
            unpack_and_list_as_a_user("staged-failing", &tar),
            Vec::<String>::new()
        );
        for how in ["unpack", "beneath", "staged-twice"] {
            assert_eq!(
                unpack_and_list_as_a_user(how, &tar),
                [
                    "locked/ 555",
                    "locked/g.txt 644 1700000000 1 g",
                    "locked/inner/ 500",
                    "locked/inner/f.txt 444 1700000000 1 deep",
                ],
                "{how}"
            );
        }
    }

    /// A target that is not there fails the unpack, whatever the archive
    /// holds (even nothing): the directory is opened before the first entry
    /// is read, and only a kernel without `openat2` falls back to the tar
    /// crate.
    #[test]
    fn an_unpack_into_a_missing_directory_fails() {
        let scratch = tempfile::tempdir().unwrap();
        let missing = scratch.path().join("not-there");
        let empty = tar::Builder::new(Vec::new()).into_inner().unwrap();
        let err = unpack_safely(&missing, &empty[..]).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::NotFound, "{err}");
        assert!(!missing.exists());
    }

    /// `outside` holds what the test put there, `secret` reading `keep`,
    /// and nothing else.
    fn outside_untouched(outside: &Path, what: &str) {
        let mut left: Vec<_> = std::fs::read_dir(outside)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        left.sort();
        assert_eq!(left, vec![std::ffi::OsString::from("secret")], "{what}");
        let secret = std::fs::read_to_string(outside.join("secret")).unwrap();
        assert_eq!(secret, "keep", "{what}");
    }

    /// Entries under a symlink the archive made are refused, whether it
    /// leads out (the kernel would refuse them too) or stays inside (only
    /// the unpacker's own check refuses them: the scanner's rule, kept as
    /// a second line), and nothing is written outside or through it.
    #[test]
    fn the_unpack_refuses_entries_under_the_archives_own_symlinks() {
        use tar::EntryType as T;
        let outside = tempfile::tempdir().unwrap();
        let target = outside.path().display().to_string();
        for (what, tar) in [
            (
                "a file",
                archive(&[
                    ("out", T::Symlink, 0o777, &target),
                    ("out/evil", T::Regular, 0o644, "x"),
                ]),
            ),
            (
                "a directory",
                archive(&[
                    ("out", T::Symlink, 0o777, &target),
                    ("out/d/", T::Directory, 0o755, ""),
                ]),
            ),
            (
                "a hard link to a path through it",
                archive(&[
                    ("out", T::Symlink, 0o777, &target),
                    ("h", T::Link, 0o644, "out/secret"),
                ]),
            ),
            (
                "a climbing hard link",
                archive(&[("h", T::Link, 0o644, "../secret")]),
            ),
            ("a FIFO", archive(&[("p", T::Fifo, 0o644, "")])),
            (
                "a file under an inside symlink",
                archive(&[
                    ("real/", T::Directory, 0o755, ""),
                    ("in", T::Symlink, 0o777, "real"),
                    ("in/evil", T::Regular, 0o644, "x"),
                ]),
            ),
            (
                "a directory under an inside symlink",
                archive(&[
                    ("real/", T::Directory, 0o755, ""),
                    ("in", T::Symlink, 0o777, "real"),
                    ("in/evil/", T::Directory, 0o755, ""),
                ]),
            ),
            (
                "a hard link through an inside symlink",
                archive(&[
                    ("real/evil", T::Regular, 0o644, "x"),
                    ("in", T::Symlink, 0o777, "real"),
                    ("h", T::Link, 0o644, "in/evil"),
                ]),
            ),
        ] {
            std::fs::write(outside.path().join("secret"), "keep").unwrap();
            let dir = tempfile::tempdir().unwrap();
            let err = unpack_safely(dir.path(), &tar[..]).unwrap_err();
            assert!(
                matches!(err.kind(), ErrorKind::Unsafe | ErrorKind::InvalidInput),
                "{what}: {err}"
            );
            if what.contains("inside") {
                assert!(
                    err.message().contains("symlink of the archive")
                        || err.message().contains("not a file of the archive"),
                    "{what}: {err}"
                );
                assert!(!dir.path().join("h").exists(), "{what}");
                let real: Vec<_> = std::fs::read_dir(dir.path().join("real"))
                    .unwrap()
                    .map(|e| e.unwrap().file_name().into_string().unwrap())
                    .collect();
                let want: &[&str] = if what.contains("hard") {
                    &["evil"]
                } else {
                    &[]
                };
                assert_eq!(real, want, "{what}");
            }
            outside_untouched(outside.path(), what);
        }
    }

    /// An import onto a tree never writes through the tree's own symlinks
    /// out of it (the archive's scanner knows only the archive's): each
    /// entry under `out -> <outside>` is refused, with nothing written
    /// there; a symlink that stays inside is followed, as the tar crate
    /// follows it; what was imported before the refused entry stays.
    #[tokio::test]
    async fn an_import_does_not_write_through_the_trees_symlinks_out_of_it() {
        use tar::EntryType as T;
        let outside = tempfile::tempdir().unwrap();
        let target = outside.path().display().to_string();
        for (what, entries) in [
            ("a file", vec![("out/evil", T::Regular, 0o644, "x")]),
            ("a directory", vec![("out/d/", T::Directory, 0o755, "")]),
            (
                "a file in a new directory",
                vec![("out/d/e", T::Regular, 0o644, "x")],
            ),
            ("a symlink", vec![("out/l", T::Symlink, 0o777, "x")]),
            (
                "a hard link to it",
                vec![("out/h", T::Link, 0o644, "kept.txt")],
            ),
            (
                "a hard link from it",
                vec![("h", T::Link, 0o644, "out/secret")],
            ),
            (
                "a file through a climbing symlink",
                vec![("up/evil", T::Regular, 0o644, "x")],
            ),
        ] {
            std::fs::write(outside.path().join("secret"), "keep").unwrap();
            let dir = tempfile::tempdir().unwrap();
            std::os::unix::fs::symlink(&target, dir.path().join("out")).unwrap();
            std::os::unix::fs::symlink("../..", dir.path().join("up")).unwrap();
            std::fs::create_dir(dir.path().join("real")).unwrap();
            std::os::unix::fs::symlink("real", dir.path().join("in")).unwrap();
            let mut all = vec![("kept.txt", T::Regular, 0o644, "first")];
            all.extend(entries);
            let stream = harness_core::stream::once(Bytes::from(archive(&all)));
            let err = import(dir.path().to_path_buf(), stream).await.unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Unsafe, "{what}: {err}");
            outside_untouched(outside.path(), what);
            let kept = std::fs::read_to_string(dir.path().join("kept.txt")).unwrap();
            assert_eq!(kept, "first", "{what}");
            // A symlink that stays inside leads where it points.
            let inside = archive(&[("in/x.txt", T::Regular, 0o644, "through")]);
            let stream = harness_core::stream::once(Bytes::from(inside));
            import(dir.path().to_path_buf(), stream).await.unwrap();
            let x = std::fs::read_to_string(dir.path().join("real/x.txt")).unwrap();
            assert_eq!(x, "through", "{what}");
        }
    }

    /// Onto a tree with entries of its own, the import writes what the tar
    /// crate's `unpack_in` writes: files replaced, directories merged into
    /// and given the archive's mode, what the archive lacks kept.
    #[test]
    fn an_import_onto_a_tree_writes_what_the_tar_crate_writes() {
        use tar::EntryType as T;
        let tar = archive(&[
            ("a/", T::Directory, 0o750, ""),
            ("a/old.txt", T::Regular, 0o600, "new content"),
            ("a/new.txt", T::Regular, 0o644, "added"),
            (
                "b/c/d.txt",
                T::Regular,
                0o644,
                "deep, under a kept directory",
            ),
            ("link", T::Symlink, 0o777, "a/new.txt"),
            ("hard", T::Link, 0o644, "a/old.txt"),
        ]);
        let (old, new) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        for dir in [old.path(), new.path()] {
            std::fs::create_dir_all(dir.join("a")).unwrap();
            std::fs::create_dir_all(dir.join("b/c")).unwrap();
            std::fs::write(dir.join("a/old.txt"), "old content").unwrap();
            std::fs::write(dir.join("a/mine.txt"), "not in the archive").unwrap();
            std::fs::write(dir.join("b/c/mine.txt"), "neither").unwrap();
            std::os::unix::fs::symlink("b", dir.join("link")).unwrap();
        }
        unpack(old.path(), &tar[..]).unwrap();
        unpack_safely(new.path(), &tar[..]).unwrap();
        let (want, got) = (listing(old.path()), listing(new.path()));
        assert_eq!(got, want);
        for line in [
            "a/ 750",
            "a/mine.txt 644",
            "b/c/mine.txt 644",
            "link -> a/new.txt",
            "a/old.txt 600 1700000000 2 new content",
        ] {
            assert!(got.iter().any(|l| l.starts_with(line)), "{line}: {got:#?}");
        }
    }

    /// An import through a descriptor gives every entry it makes — files,
    /// directories, implied parents, symlinks — to the owner named, and
    /// leaves what was there with its own. Giving a file away needs root
    /// (as in CI); any other user gives them to itself, which checks less.
    #[tokio::test]
    async fn an_import_beneath_a_descriptor_gives_what_it_makes_to_the_owner() {
        use std::os::unix::fs::MetadataExt;
        use tar::EntryType as T;
        let me = (
            nix::unistd::geteuid().as_raw(),
            nix::unistd::getegid().as_raw(),
        );
        let them = if me.0 == 0 { (65534, 65534) } else { me };
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("kept")).unwrap();
        std::fs::write(dir.path().join("kept/old.txt"), "old").unwrap();
        let tar = archive(&[
            ("kept/", T::Directory, 0o755, ""),
            ("kept/new.txt", T::Regular, 0o644, "new"),
            ("d/", T::Directory, 0o750, ""),
            ("implied/parent/f.txt", T::Regular, 0o600, "deep"),
            ("link", T::Symlink, 0o777, "d"),
        ]);
        let fd = rustix::fs::open(
            dir.path(),
            rustix::fs::OFlags::PATH | rustix::fs::OFlags::DIRECTORY,
            rustix::fs::Mode::empty(),
        )
        .unwrap();
        let root = ImportRoot::new(fd, Some(them)).unwrap();
        let stream = harness_core::stream::once(Bytes::from(tar));
        import_beneath(root, PathBuf::from("/shown"), stream)
            .await
            .unwrap();
        let owner = |rel: &str| {
            let meta = std::fs::symlink_metadata(dir.path().join(rel)).unwrap();
            (meta.uid(), meta.gid())
        };
        for made in [
            "kept/new.txt",
            "d",
            "implied",
            "implied/parent",
            "implied/parent/f.txt",
            "link",
        ] {
            assert_eq!(owner(made), them, "{made}");
        }
        for there in ["kept", "kept/old.txt"] {
            assert_eq!(owner(there), me, "{there}");
        }
        assert_eq!(
            std::fs::read_to_string(dir.path().join("implied/parent/f.txt")).unwrap(),
            "deep"
        );
        // Errors name the directory as shown, not the descriptor's path.
        let fd = rustix::fs::open(
            dir.path(),
            rustix::fs::OFlags::PATH | rustix::fs::OFlags::DIRECTORY,
            rustix::fs::Mode::empty(),
        )
        .unwrap();
        std::os::unix::fs::symlink("/", dir.path().join("out")).unwrap();
        let root = ImportRoot::new(fd, None).unwrap();
        let tar = archive(&[("out/evil", T::Regular, 0o644, "x")]);
        let stream = harness_core::stream::once(Bytes::from(tar));
        let err = import_beneath(root, PathBuf::from("/shown"), stream)
            .await
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Unsafe, "{err}");
        assert!(err.message().contains("/shown"), "{err}");
    }
}
