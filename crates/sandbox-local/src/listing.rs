//! The native tree listing ([`Sandbox::list_tree`](harness_core::sandbox::Sandbox::list_tree)):
//! the sandbox's files are the host's, so they are `lstat`ed in-process
//! instead of through `find -printf` in a shell — no exec, no formatting
//! and parsing of every path, and the walk split over threads.
//!
//! The answer is in path order (byte order of the relative paths), which
//! spares tree checkpoints a sort of the whole listing on one thread: each
//! walker orders the one directory it read, and the directories are
//! stitched together at the end without comparing across them.

use std::cmp::Ordering;
use std::collections::{BTreeMap, HashMap};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use harness_core::sandbox::{ListedEntry, TreeListing};
use harness_core::{Error, ErrorKind, Result};
use nix::errno::Errno;
use nix::sys::inotify::{Inotify, WatchDescriptor};

/// Threads walking one tree: directories are handed out one at a time, so
/// a wide tree keeps them all busy. More than a few buys nothing on the
/// page cache.
const WALKERS: usize = 4;

/// List every path under `root` (see the trait method). Blocking.
pub(crate) fn list_tree(root: &Path) -> Result<TreeListing> {
    check_root(root)?;
    let now_secs = now_secs();
    let walked = walk(root, vec![String::new()], None)?;
    Ok(TreeListing {
        now_secs,
        entries: in_path_order(&walked.by_dir),
    })
}

/// `NotFound` unless `root` is a directory.
pub(crate) fn check_root(root: &Path) -> Result<()> {
    match std::fs::metadata(root) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => Err(Error::not_found(format!(
            "{} is not a directory",
            root.display()
        ))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(Error::not_found(format!(
            "{} does not exist",
            root.display()
        ))),
        Err(e) => Err(e.into()),
    }
}

/// The clock a listing records when it begins (the racy-second rule of
/// [`TreeListing::now_secs`]).
pub(crate) fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// What a walk read.
pub(crate) struct Walked {
    /// Every directory read, by relative path ("" is the root), with its
    /// items in order.
    pub(crate) by_dir: HashMap<String, DirItems>,
    /// With a watch: the watch on each directory read, added before it was
    /// read (so a change after the read is an event).
    pub(crate) watches: Vec<(WatchDescriptor, String)>,
    /// With a watch: why one could not be added (the walk itself went on).
    pub(crate) watch_failed: Option<Errno>,
}

/// Read the directories `start` (relative to `root`) and everything below
/// them, on a few threads. With `watch`, each directory is added to it
/// just before it is read.
pub(crate) fn walk(root: &Path, start: Vec<String>, watch: Option<&Inotify>) -> Result<Walked> {
    let walk = Walk {
        root: root.to_path_buf(),
        queue: Mutex::new(Queue {
            dirs: start,
            busy: 0,
            failed: None,
            watch_failed: None,
        }),
        more: std::sync::Condvar::new(),
        watch,
    };
    let threads = WALKERS.min(
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
    );
    let (by_dir, watches) = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads).map(|_| scope.spawn(|| walk.work())).collect();
        let mut by_dir = HashMap::new();
        let mut watches = Vec::new();
        for worker in workers {
            for (dir, items, wd) in worker.join().expect("a listing thread panicked") {
                if let Some(wd) = wd {
                    watches.push((wd, dir.clone()));
                }
                by_dir.insert(dir, items);
            }
        }
        (by_dir, watches)
    });
    let queue = walk.queue.into_inner().unwrap_or_else(|e| e.into_inner());
    if let Some(error) = queue.failed {
        return Err(error);
    }
    Ok(Walked {
        by_dir,
        watches,
        watch_failed: queue.watch_failed,
    })
}

/// The items of the one directory `rel` (not below it), in order; none
/// when it no longer exists.
pub(crate) fn read_dir_items(root: &Path, rel: &str) -> Result<DirItems> {
    let mut items = Vec::new();
    read_dir(root, rel, &mut items)?;
    sort_items(rel, &mut items);
    Ok(items)
}

/// One directory's listing, in the order its paths take in the whole
/// tree's path order.
pub(crate) type DirItems = Vec<Item>;

pub(crate) enum Item {
    Entry(ListedEntry),
    /// Where the contents of the subdirectory at this relative path go.
    Subtree(String),
}

impl Item {
    /// The name within its directory; a subtree sorts as the name and a
    /// `/`, as each of its paths begins.
    fn key(&self, prefix: usize) -> (&[u8], bool) {
        match self {
            Item::Entry(e) => (&e.path.as_bytes()[prefix..], false),
            Item::Subtree(rel) => (&rel.as_bytes()[prefix..], true),
        }
    }
}

/// Order of two sibling keys: `name` or `name/` (see [`Item::key`]). A
/// subtree does not sort where its directory's own entry does: `a-b`
/// comes between `a` and `a/x`, as `-` sorts before `/`.
fn key_order((a, a_sub): (&[u8], bool), (b, b_sub): (&[u8], bool)) -> Ordering {
    let slash: &[u8] = b"/";
    let a = a.iter().chain(if a_sub { slash } else { &[] });
    let b = b.iter().chain(if b_sub { slash } else { &[] });
    a.cmp(b)
}

/// Every directory's items (keyed by the directory's relative path, the
/// root's being "") as one list in path order. Iterative: a tree may be
/// deeper than a thread's stack would allow recursing.
pub(crate) fn in_path_order(by_dir: &HashMap<String, DirItems>) -> Vec<ListedEntry> {
    let total = by_dir.values().map(Vec::len).sum();
    let mut out = Vec::with_capacity(total);
    let mut stack = vec![by_dir.get("").map_or(&[][..], Vec::as_slice).iter()];
    while let Some(items) = stack.last_mut() {
        match items.next() {
            Some(Item::Entry(entry)) => out.push(entry.clone()),
            // A directory removed before it was read has no items.
            Some(Item::Subtree(rel)) => {
                if let Some(items) = by_dir.get(rel) {
                    stack.push(items.iter());
                }
            }
            None => {
                stack.pop();
            }
        }
    }
    out
}

/// The subdirectories `items` has a subtree for.
pub(crate) fn subtrees(items: &DirItems) -> impl Iterator<Item = &str> {
    items.iter().filter_map(|item| match item {
        Item::Subtree(rel) => Some(rel.as_str()),
        Item::Entry(_) => None,
    })
}

/// Order one directory's items as the whole tree's path order has them.
fn sort_items(rel: &str, items: &mut DirItems) {
    let prefix = if rel.is_empty() { 0 } else { rel.len() + 1 };
    items.sort_unstable_by(|a, b| key_order(a.key(prefix), b.key(prefix)));
}

struct Queue {
    /// Directories (relative; "" is the root) not yet read.
    dirs: Vec<String>,
    /// Threads reading a directory now (each may add more).
    busy: usize,
    failed: Option<Error>,
    watch_failed: Option<Errno>,
}

struct Walk<'w> {
    root: PathBuf,
    queue: Mutex<Queue>,
    more: std::sync::Condvar,
    watch: Option<&'w Inotify>,
}

impl Walk<'_> {
    /// Take directories until none is left and no thread can add one;
    /// each one read is returned with its items in order and its watch.
    fn work(&self) -> Vec<(String, DirItems, Option<WatchDescriptor>)> {
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
            // Watched before it is read: a change after the read is then
            // an event, never lost between the two.
            let mut watch_failed = None;
            let wd = self.watch.and_then(|inotify| {
                match inotify.add_watch(&self.root.join(&dir), crate::watch::WATCH_MASK) {
                    Ok(wd) => Some(wd),
                    // Gone (or replaced by a file) since its parent was
                    // read: the read below finds nothing.
                    Err(Errno::ENOENT | Errno::ENOTDIR) => None,
                    Err(e) => {
                        watch_failed = Some(e);
                        None
                    }
                }
            });
            let mut items = Vec::new();
            let result = read_dir(&self.root, &dir, &mut items);
            let mut queue = self.queue.lock().unwrap_or_else(|e| e.into_inner());
            queue.busy -= 1;
            if let Some(e) = watch_failed {
                queue.watch_failed.get_or_insert(e);
            }
            match result {
                // Its subdirectories are read next.
                Ok(()) => queue.dirs.extend(subtrees(&items).map(str::to_string)),
                Err(e) => {
                    queue.failed.get_or_insert(e);
                }
            }
            drop(queue);
            self.more.notify_all();
            // Ordered here, on the walker's thread, outside the lock.
            sort_items(&dir, &mut items);
            out.push((dir, items, wd));
        }
    }
}

/// `lstat` every entry of `rel` into `out`, and for each subdirectory the
/// place of its contents.
fn read_dir(root: &Path, rel: &str, out: &mut DirItems) -> Result<()> {
    let abs = if rel.is_empty() {
        root.to_path_buf()
    } else {
        root.join(rel)
    };
    let entries = match std::fs::read_dir(&abs) {
        Ok(entries) => entries,
        // Removed (or replaced by a file) since its parent was read (the
        // agent may be working): it is gone from the listing, as with
        // `find`.
        Err(e)
            if e.kind() == std::io::ErrorKind::NotFound
                || e.raw_os_error() == Some(Errno::ENOTDIR as i32) =>
        {
            return Ok(())
        }
        Err(e) => return Err(io_error(&abs, e)),
    };
    for entry in entries {
        let entry = entry.map_err(|e| io_error(&abs, e))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else {
            return Err(Error::unsafe_entry(format!(
                "a path under {} is not UTF-8: {:?}",
                root.display(),
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
            out.push(Item::Subtree(path.clone()));
        }
        out.push(Item::Entry(ListedEntry {
            kind,
            mode: meta.mode() & 0o7777,
            size: meta.size(),
            mtime: u64::try_from(meta.mtime()).unwrap_or(0),
            ino: meta.ino(),
            ctime_ns: u64::try_from(meta.ctime()).unwrap_or(0) * 1_000_000_000
                + u64::try_from(meta.ctime_nsec()).unwrap_or(0),
            path,
            link,
        }));
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Names around `/` in byte order (`-` and `.` sort before it, `0`
    /// after), a directory beside a file of its name with a suffix (the
    /// Rust module layout), non-ASCII, and a deep chain: the listing comes
    /// back in exactly the order a sort by path gives.
    #[test]
    fn the_listing_is_in_path_order() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        for dir in ["a/x/y", "a-b/c", "a0", "mod00/inner", "é/ü", "B", "empty"] {
            std::fs::create_dir_all(r.join(dir)).unwrap();
        }
        for file in [
            "a.rs",
            "a/x.rs",
            "a/x/y/z",
            "a/x-y",
            "a-b/c/d",
            "a-b.txt",
            "a0/f",
            "mod00.rs",
            "mod00/inner.rs",
            "mod00/inner/f",
            "é/ü/f",
            "é.txt",
            "B/f",
            "b",
        ] {
            std::fs::write(r.join(file), file).unwrap();
        }
        std::os::unix::fs::symlink("a/x.rs", r.join("a-link")).unwrap();
        let mut deep = String::from("deep");
        for _ in 0..300 {
            deep.push_str("/d");
        }
        std::fs::create_dir_all(r.join(&deep)).unwrap();
        std::fs::write(r.join(&deep).join("leaf"), "x").unwrap();

        let listed: Vec<String> = list_tree(r)
            .unwrap()
            .entries
            .into_iter()
            .map(|e| e.path)
            .collect();
        let mut sorted = listed.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(listed.len(), sorted.len(), "no path twice");
        assert_eq!(listed, sorted, "the listing is in path order");
        // Everything is there: 7 + 14 + 1 + 301 + 1 written, plus the
        // parents `create_dir_all` made on the way.
        for path in ["a", "a/x", "a/x/y/z", "a-link", "é/ü/f", "empty", "b"] {
            assert!(listed.iter().any(|p| p == path), "{path} listed");
        }
        assert!(listed.contains(&format!("{deep}/leaf")));
    }

    #[test]
    fn a_subtree_sorts_as_its_name_and_a_slash() {
        use Ordering::*;
        let k = |s: &'static str, sub| (s.as_bytes(), sub);
        assert_eq!(key_order(k("a", true), k("a-b", false)), Greater);
        assert_eq!(key_order(k("a", false), k("a-b", false)), Less);
        assert_eq!(key_order(k("a", true), k("a0", false)), Less);
        assert_eq!(key_order(k("a", true), k("a", false)), Greater);
        assert_eq!(key_order(k("ab", true), k("a", true)), Greater);
        assert_eq!(key_order(k("a", true), k("a", true)), Equal);
    }
}
