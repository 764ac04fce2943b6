//! The native tree listing ([`Sandbox::list_tree`](harness_core::sandbox::Sandbox::list_tree)):
//! the sandbox's files are the host's, so they are `lstat`ed in-process
//! instead of through `find -printf` in a shell — no exec, no formatting
//! and parsing of every path, and the walk split over threads.

use std::collections::BTreeMap;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use harness_core::sandbox::{ListedEntry, TreeListing};
use harness_core::{Error, ErrorKind, Result};

/// Threads walking one tree: directories are handed out one at a time, so
/// a wide tree keeps them all busy. More than a few buys nothing on the
/// page cache.
const WALKERS: usize = 4;

/// List every path under `root` (see the trait method). Blocking.
pub(crate) fn list_tree(root: &Path) -> Result<TreeListing> {
    match std::fs::metadata(root) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => {
            return Err(Error::not_found(format!(
                "{} is not a directory",
                root.display()
            )))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(Error::not_found(format!(
                "{} does not exist",
                root.display()
            )))
        }
        Err(e) => return Err(e.into()),
    }
    let now_secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let walk = Walk {
        root: root.to_path_buf(),
        queue: Mutex::new(Queue {
            dirs: vec![String::new()],
            busy: 0,
            failed: None,
        }),
        more: std::sync::Condvar::new(),
    };
    let threads = WALKERS.min(
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
    );
    let entries = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads).map(|_| scope.spawn(|| walk.work())).collect();
        let mut all = Vec::new();
        for worker in workers {
            all.extend(worker.join().expect("a listing thread panicked"));
        }
        all
    });
    if let Some(error) = walk
        .queue
        .into_inner()
        .unwrap_or_else(|e| e.into_inner())
        .failed
    {
        return Err(error);
    }
    Ok(TreeListing { now_secs, entries })
}

struct Queue {
    /// Directories (relative; "" is the root) not yet read.
    dirs: Vec<String>,
    /// Threads reading a directory now (each may add more).
    busy: usize,
    failed: Option<Error>,
}

struct Walk {
    root: PathBuf,
    queue: Mutex<Queue>,
    more: std::sync::Condvar,
}

impl Walk {
    /// Take directories until none is left and no thread can add one.
    fn work(&self) -> Vec<ListedEntry> {
        let mut out = Vec::new();
        loop {
            let dir = {
                let mut queue = self.queue.lock().unwrap_or_else(|e| e.into_inner());
                loop {
                    if queue.failed.is_some() {
                        return out;
                    }
                    if let Some(dir) = queue.dirs.pop() {
                        queue.busy += 1;
                        break dir;
                    }
                    if queue.busy == 0 {
                        return out;
                    }
                    queue = self.more.wait(queue).unwrap_or_else(|e| e.into_inner());
                }
            };
            let mut found = Vec::new();
            let result = self.read_dir(&dir, &mut out, &mut found);
            let mut queue = self.queue.lock().unwrap_or_else(|e| e.into_inner());
            queue.busy -= 1;
            match result {
                Ok(()) => queue.dirs.extend(found),
                Err(e) => {
                    queue.failed.get_or_insert(e);
                }
            }
            drop(queue);
            self.more.notify_all();
        }
    }

    /// `lstat` every entry of `rel`; subdirectories go to `found`.
    fn read_dir(
        &self,
        rel: &str,
        out: &mut Vec<ListedEntry>,
        found: &mut Vec<String>,
    ) -> Result<()> {
        let abs = if rel.is_empty() {
            self.root.clone()
        } else {
            self.root.join(rel)
        };
        let entries = match std::fs::read_dir(&abs) {
            Ok(entries) => entries,
            // Removed since its parent was read (the agent may be working):
            // it is gone from the listing, as with `find`.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(io_error(&abs, e)),
        };
        for entry in entries {
            let entry = entry.map_err(|e| io_error(&abs, e))?;
            let name = entry.file_name();
            let Some(name) = name.to_str() else {
                return Err(Error::unsafe_entry(format!(
                    "a path under {} is not UTF-8: {:?}",
                    self.root.display(),
                    abs.join(&name)
                )));
            };
            let path = if rel.is_empty() {
                name.to_string()
            } else {
                format!("{rel}/{name}")
            };
            // `DirEntry::metadata` is an `fstatat` without following
            // symlinks: the `lstat` `find` does.
            let meta = match entry.metadata() {
                Ok(meta) => meta,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(io_error(&abs.join(name), e)),
            };
            let file_type = meta.file_type();
            let kind = if file_type.is_file() {
                'f'
            } else if file_type.is_dir() {
                'd'
            } else if file_type.is_symlink() {
                'l'
            } else if file_type.is_socket() {
                's'
            } else if file_type.is_fifo() {
                'p'
            } else if file_type.is_char_device() {
                'c'
            } else if file_type.is_block_device() {
                'b'
            } else {
                'U'
            };
            let link = if kind == 'l' {
                match std::fs::read_link(entry.path()) {
                    Ok(target) => target.to_string_lossy().into_owned(),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                    Err(e) => return Err(io_error(&abs.join(name), e)),
                }
            } else {
                String::new()
            };
            if kind == 'd' {
                found.push(path.clone());
            }
            out.push(ListedEntry {
                kind,
                mode: meta.mode() & 0o7777,
                size: meta.size(),
                mtime: u64::try_from(meta.mtime()).unwrap_or(0),
                ino: meta.ino(),
                ctime_ns: u64::try_from(meta.ctime()).unwrap_or(0) * 1_000_000_000
                    + u64::try_from(meta.ctime_nsec()).unwrap_or(0),
                path,
                link,
            });
        }
        Ok(())
    }
}

/// Always `Io`: a `NotFound` here would read as "no such directory".
fn io_error(path: &Path, e: std::io::Error) -> Error {
    Error::new(ErrorKind::Io, format!("listing {}: {e}", path.display()))
}

/// Whether `tar` on the sandbox's `PATH` is GNU tar (tree checkpoints read
/// changed files with its `-T -`); asked once per `PATH`.
pub(crate) fn has_gnu_tar(env: &[(String, String)]) -> bool {
    static KNOWN: Mutex<BTreeMap<Option<String>, bool>> = Mutex::new(BTreeMap::new());
    let path = env
        .iter()
        .rev()
        .find(|(k, _)| k == "PATH")
        .map(|(_, v)| v.clone());
    if let Some(&known) = KNOWN.lock().unwrap_or_else(|e| e.into_inner()).get(&path) {
        return known;
    }
    let gnu = std::process::Command::new("tar")
        .arg("--version")
        .env_clear()
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .output()
        .is_ok_and(|out| {
            out.status.success() && String::from_utf8_lossy(&out.stdout).contains("GNU tar")
        });
    KNOWN
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(path, gnu);
    gnu
}
