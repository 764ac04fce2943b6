//! A tree's listing kept between tree checkpoints, with inotify saying what
//! to read again (git's fsmonitor idea, in-process).
//!
//! A re-checkpoint must know every path's stat, and a full listing
//! `lstat`s every entry: about 1.8 µs each on this kind of machine, most of
//! a re-checkpoint of a 20,000-file tree (`docs/tree-checkpoints.md`). So
//! the first listing of a directory also adds an inotify watch on every
//! directory under it — each one *before* it is read, so a change after the
//! read is always an event — and keeps what it read, directory by
//! directory. The next listing of the same directory drains the events
//! (the kernel queues them inside the changing system call, so a change
//! that returned before the listing began is in the queue) and reads again
//! only the directories they name; a directory that appeared is walked
//! whole, one that went is dropped. The answer is the same full listing,
//! in path order, that a walk would give.
//!
//! Whenever the events cannot be trusted the watch is dropped and the tree
//! walked again: the queue overflowed, the root itself was deleted or
//! moved, a watch could not be added (`max_user_watches`), or the events
//! could not be read. What inotify does not report, and so what this
//! listing misses until a full walk: a write through a shared memory
//! mapping after the file's last `close` (no event at all), and a write to
//! a file through a hard link from outside the tree (the event goes to the
//! other directory). `LocalProvider::with_tree_watch(false)` (or
//! `HARNESS_LOCAL_TREE_WATCH=0`) turns it off for trees written that way.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use harness_core::sandbox::TreeListing;
use harness_core::Result;
use nix::errno::Errno;
use nix::sys::inotify::{AddWatchFlags as F, InitFlags, Inotify, WatchDescriptor};

use crate::listing::{self, DirItems, Item};

/// What each directory's watch reports: anything that changes a child's
/// stat or the directory's list of names, and the directory itself going.
/// `IN_CLOSE_WRITE` also catches writes through a mapping made before the
/// file was closed.
pub(crate) const WATCH_MASK: F = F::IN_MODIFY
    .union(F::IN_ATTRIB)
    .union(F::IN_CLOSE_WRITE)
    .union(F::IN_CREATE)
    .union(F::IN_DELETE)
    .union(F::IN_MOVED_FROM)
    .union(F::IN_MOVED_TO)
    .union(F::IN_DELETE_SELF)
    .union(F::IN_MOVE_SELF)
    .union(F::IN_ONLYDIR)
    .union(F::IN_DONT_FOLLOW);

/// Events that change a directory's list of names, and so its own stat
/// (kept in its parent's items).
const NAMES_CHANGED: F = F::IN_CREATE
    .union(F::IN_DELETE)
    .union(F::IN_MOVED_FROM)
    .union(F::IN_MOVED_TO);

/// Events after which a watch no longer stands for its directory's path.
const WATCH_GONE: F = F::IN_IGNORED
    .union(F::IN_DELETE_SELF)
    .union(F::IN_MOVE_SELF)
    .union(F::IN_UNMOUNT);

/// Changed directories past which (and past a quarter of the tree's) a
/// listing walks the tree again rather than re-reading them one by one.
const WALK_INSTEAD: usize = 64;

/// Trees watched at once by this process. Each is an inotify instance, and
/// a user has 128 by default, shared with every other program they run
/// (editors, file watchers): past this many, listings walk the tree.
pub(crate) const MAX_WATCHED_TREES: usize = 8;

static WATCHED_TREES: AtomicUsize = AtomicUsize::new(0);

/// One of the [`MAX_WATCHED_TREES`] places, given back when dropped.
#[derive(Debug)]
struct Place(());

impl Place {
    fn take() -> Option<Place> {
        WATCHED_TREES
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < MAX_WATCHED_TREES).then_some(n + 1)
            })
            .ok()
            .map(|_| Place(()))
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        WATCHED_TREES.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A listed tree and the watch that says what changed in it since.
pub(crate) struct WatchedTree {
    root: PathBuf,
    inotify: Inotify,
    /// What each directory held when last read (relative path, "" the root).
    by_dir: HashMap<String, DirItems>,
    dir_of: HashMap<WatchDescriptor, String>,
    wd_of: HashMap<String, WatchDescriptor>,
    /// Directories the last listing read (all of them for the first).
    dirs_read: usize,
    _place: Place,
}

impl std::fmt::Debug for WatchedTree {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WatchedTree")
            .field("root", &self.root)
            .field("dirs", &self.by_dir.len())
            .finish_non_exhaustive()
    }
}

impl WatchedTree {
    /// Walk `root` (as [`listing::list_tree`] does), watching it when a
    /// watch can be had: the listing, and the watch to refresh it with.
    pub(crate) fn start(root: &Path) -> Result<(TreeListing, Option<WatchedTree>)> {
        listing::check_root(root)?;
        let now_secs = listing::now_secs();
        let watch = Place::take().and_then(|place| {
            match Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC) {
                Ok(inotify) => Some((place, inotify)),
                Err(e) => {
                    tracing::debug!(root = %root.display(), error = %e, "no inotify instance: the next listing walks the tree");
                    None
                }
            }
        });
        let walked = listing::walk(
            root,
            vec![String::new()],
            watch.as_ref().map(|(_, inotify)| inotify),
        )?;
        let entries = listing::in_path_order(&walked.by_dir);
        let listing = TreeListing { now_secs, entries };
        let Some((place, inotify)) = watch else {
            return Ok((listing, None));
        };
        if let Some(e) = walked.watch_failed {
            tracing::debug!(root = %root.display(), error = %e, "a directory could not be watched: the next listing walks the tree");
            return Ok((listing, None));
        }
        let mut tree = WatchedTree {
            root: root.to_path_buf(),
            inotify,
            dirs_read: walked.by_dir.len(),
            by_dir: walked.by_dir,
            dir_of: HashMap::new(),
            wd_of: HashMap::new(),
            _place: place,
        };
        if !tree.record_watches(walked.watches) {
            return Ok((listing, None));
        }
        Ok((listing, Some(tree)))
    }

    /// The directory this watch lists.
    pub(crate) fn root(&self) -> &Path {
        &self.root
    }

    /// Directories the last listing read: all of them for the first, the
    /// changed ones after.
    pub(crate) fn dirs_read(&self) -> usize {
        self.dirs_read
    }

    /// The tree's listing now, reading again only what the events name.
    /// `Ok(None)` when the events cannot be trusted (see the module doc):
    /// drop this and [`start`](Self::start) again. An error reading a
    /// directory is returned as the walk would return it; the caller drops
    /// this then too.
    pub(crate) fn refresh(&mut self) -> Result<Option<TreeListing>> {
        let now_secs = listing::now_secs();
        // Directories whose items are read again, and directories (with
        // everything below) dropped and, where they still are, walked.
        let mut dirty: HashSet<String> = HashSet::new();
        let mut fresh: BTreeSet<String> = BTreeSet::new();
        loop {
            let events = match self.inotify.read_events() {
                Ok(events) => events,
                Err(Errno::EAGAIN) => break,
                Err(e) => {
                    tracing::debug!(root = %self.root.display(), error = %e, "reading inotify events failed: walking the tree");
                    return Ok(None);
                }
            };
            for event in events {
                if event.mask.contains(F::IN_Q_OVERFLOW) {
                    tracing::debug!(root = %self.root.display(), "inotify queue overflowed: walking the tree");
                    return Ok(None);
                }
                // A watch dropped earlier (its directory left the tree).
                let Some(dir) = self.dir_of.get(&event.wd) else {
                    continue;
                };
                if event.mask.intersects(WATCH_GONE) {
                    if dir.is_empty() {
                        tracing::debug!(root = %self.root.display(), "the listed directory itself went: walking it again");
                        return Ok(None);
                    }
                    dirty.insert(parent_of(dir).to_string());
                    fresh.insert(dir.clone());
                    continue;
                }
                match event.name {
                    Some(name) => {
                        // Not UTF-8: the walk reports it as it always does.
                        let Some(name) = name.to_str() else {
                            return Ok(None);
                        };
                        if event.mask.intersects(NAMES_CHANGED) {
                            if event.mask.contains(F::IN_ISDIR) {
                                fresh.insert(join(dir, name));
                            }
                            if !dir.is_empty() {
                                dirty.insert(parent_of(dir).to_string());
                            }
                        }
                        dirty.insert(dir.clone());
                    }
                    // The directory's own stat, kept in its parent's items.
                    None if !dir.is_empty() => {
                        dirty.insert(parent_of(dir).to_string());
                    }
                    None => {}
                }
            }
        }
        // Most of the tree changed (a checkout, a restore into it): the
        // walk reads on several threads, the re-reads below on one.
        if dirty.len() > WALK_INSTEAD.max(self.by_dir.len() / 4) {
            tracing::debug!(root = %self.root.display(), dirs = dirty.len(), "most directories changed: walking the tree");
            return Ok(None);
        }
        let mut dirty: Vec<String> = dirty.into_iter().collect();
        // Parents before children: a directory found gone or new while its
        // parent is read is not read again itself.
        dirty.sort_unstable();
        let mut dirs_read = 0;
        for dir in dirty {
            if !self.by_dir.contains_key(&dir) || within_any(&fresh, &dir) {
                continue;
            }
            let items = listing::read_dir_items(&self.root, &dir)?;
            dirs_read += 1;
            let before: HashSet<&str> = listing::subtrees(&self.by_dir[&dir]).collect();
            let now: HashSet<&str> = listing::subtrees(&items).collect();
            for changed in before.symmetric_difference(&now) {
                fresh.insert(changed.to_string());
            }
            self.by_dir.insert(dir, items);
        }
        // The outermost of the directories to drop, then walk: those with
        // no ancestor among them.
        let tops: Vec<String> = fresh
            .iter()
            .filter(|dir| !within_any(&fresh, parent_of(dir)))
            .cloned()
            .collect();
        for top in &tops {
            self.forget(top);
        }
        let to_walk: Vec<String> = tops
            .into_iter()
            .filter(|dir| {
                self.by_dir
                    .get(parent_of(dir))
                    .is_some_and(|items| listing::subtrees(items).any(|s| s == dir))
            })
            .collect();
        if !to_walk.is_empty() {
            let walked = listing::walk(&self.root, to_walk, Some(&self.inotify))?;
            if let Some(e) = walked.watch_failed {
                tracing::debug!(root = %self.root.display(), error = %e, "a directory could not be watched: walking the tree");
                return Ok(None);
            }
            dirs_read += walked.by_dir.len();
            self.by_dir.extend(walked.by_dir);
            if !self.record_watches(walked.watches) {
                return Ok(None);
            }
        }
        self.dirs_read = dirs_read;
        Ok(Some(TreeListing {
            now_secs,
            entries: listing::in_path_order(&self.by_dir),
        }))
    }

    /// Map each new watch to its directory; false if one was already
    /// another directory's (the same directory reached twice: trust
    /// nothing).
    fn record_watches(&mut self, watches: Vec<(WatchDescriptor, String)>) -> bool {
        for (wd, dir) in watches {
            if self.dir_of.contains_key(&wd) {
                tracing::debug!(root = %self.root.display(), dir, "one directory watched under two paths: walking the tree");
                return false;
            }
            self.dir_of.insert(wd, dir.clone());
            self.wd_of.insert(dir, wd);
        }
        true
    }

    /// Drop `top` and everything below it, with their watches.
    fn forget(&mut self, top: &str) {
        let mut stack = vec![top.to_string()];
        while let Some(dir) = stack.pop() {
            if let Some(wd) = self.wd_of.remove(&dir) {
                self.dir_of.remove(&wd);
                // Already gone with its directory: EINVAL, nothing to do.
                let _ = self.inotify.rm_watch(wd);
            }
            if let Some(items) = self.by_dir.remove(&dir) {
                stack.extend(items.into_iter().filter_map(|item| match item {
                    Item::Subtree(rel) => Some(rel),
                    Item::Entry(_) => None,
                }));
            }
        }
    }
}

/// `dir`'s listing from the watch kept for it, else from a walk that
/// starts a watch (replacing the one kept for another directory).
pub(crate) fn watched_listing(
    kept: &Mutex<Option<WatchedTree>>,
    dir: &Path,
) -> Result<TreeListing> {
    let mut kept = kept.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(tree) = kept.as_mut().filter(|tree| tree.root() == dir) {
        match tree.refresh() {
            Ok(Some(listing)) => {
                tracing::debug!(dir = %dir.display(), dirs_read = tree.dirs_read(), "tree listed from its watch");
                return Ok(listing);
            }
            Ok(None) => {}
            Err(e) => {
                *kept = None;
                return Err(e);
            }
        }
    }
    // The old watch goes first: its inotify instance is one of a few.
    *kept = None;
    let (listing, tree) = WatchedTree::start(dir)?;
    *kept = tree;
    Ok(listing)
}

fn parent_of(dir: &str) -> &str {
    dir.rfind('/').map_or("", |i| &dir[..i])
}

fn join(dir: &str, name: &str) -> String {
    if dir.is_empty() {
        name.to_string()
    } else {
        format!("{dir}/{name}")
    }
}

/// `path` is one of `tops` or below one.
fn within_any(tops: &BTreeSet<String>, path: &str) -> bool {
    // Each ancestor of `path`, itself first.
    let mut at = path;
    loop {
        if tops.contains(at) {
            return true;
        }
        if at.is_empty() {
            return false;
        }
        at = parent_of(at);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use std::os::unix::fs::{symlink, PermissionsExt};

    /// The watched listing, which must be exactly what a walk gives now.
    fn refreshed(tree: &mut WatchedTree, step: &str) -> usize {
        let listing = tree
            .refresh()
            .unwrap()
            .unwrap_or_else(|| panic!("{step}: the watch lost track"));
        let walked = listing::list_tree(tree.root()).unwrap();
        assert_eq!(
            listing.entries, walked.entries,
            "{step}: the watched listing differs from a walk"
        );
        tree.dirs_read()
    }

    fn write(path: &Path, content: &str) {
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(path, content).unwrap();
    }

    /// Every kind of change a tree sees between checkpoints, one after
    /// another: after each, the listing from the watch equals a fresh walk
    /// (every stat compared, the ctime in nanoseconds among them, so a
    /// stale entry shows), and a change inside one directory reads that
    /// directory alone.
    #[test]
    fn a_watched_listing_is_the_walk_after_every_kind_of_change() {
        let scratch = tempfile::tempdir().unwrap();
        let root = scratch.path().join("tree");
        let outside = scratch.path().join("outside");
        fs::create_dir_all(&outside).unwrap();
        for i in 0..30 {
            write(
                &root.join(format!("pkg{}/mod{}/f{i}.rs", i % 3, i % 5)),
                "fn x() {}",
            );
        }
        write(&root.join("a/b/c/f1"), "one");
        write(&root.join("a/b/c/f2"), "two");
        write(&root.join("d/g"), "g");
        write(&root.join("e/f/h"), "h");
        symlink("a/b/c/f1", root.join("link")).unwrap();
        let (first, tree) = WatchedTree::start(&root).unwrap();
        let mut tree = tree.expect("a watch (inotify is available)");
        assert_eq!(first.entries, listing::list_tree(&root).unwrap().entries);
        let all_dirs = tree.dirs_read();
        assert!(
            all_dirs >= 20,
            "the first listing reads every directory: {all_dirs}"
        );

        assert_eq!(refreshed(&mut tree, "nothing changed"), 0);

        std::io::Write::write_all(
            &mut fs::OpenOptions::new()
                .append(true)
                .open(root.join("a/b/c/f1"))
                .unwrap(),
            b" more",
        )
        .unwrap();
        assert_eq!(refreshed(&mut tree, "append"), 1, "only a/b/c is read");

        fs::write(root.join("a/b/c/f2"), "TWO").unwrap();
        assert_eq!(refreshed(&mut tree, "same size, new content"), 1);

        fs::set_permissions(root.join("d/g"), fs::Permissions::from_mode(0o600)).unwrap();
        refreshed(&mut tree, "chmod");

        fs::File::options()
            .write(true)
            .open(root.join("d/g"))
            .unwrap()
            .set_modified(std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_000_000))
            .unwrap();
        refreshed(&mut tree, "mtime set back");

        fs::File::options()
            .write(true)
            .open(root.join("e/f/h"))
            .unwrap()
            .set_len(0)
            .unwrap();
        refreshed(&mut tree, "truncate");

        write(&root.join("new.txt"), "new");
        refreshed(&mut tree, "a new file at the root");

        // Made after the watch: its contents come from a walk of it.
        let mut deep = root.join("fresh");
        for i in 0..40 {
            deep.push(format!("d{i}"));
        }
        write(&deep.join("leaf"), "leaf");
        write(&root.join("fresh/x/y"), "y");
        refreshed(&mut tree, "a new directory chain");
        // And watched from then on.
        fs::write(deep.join("leaf"), "changed leaf").unwrap();
        assert_eq!(refreshed(&mut tree, "a change deep in the new chain"), 1);

        fs::remove_file(root.join("new.txt")).unwrap();
        refreshed(&mut tree, "a file removed");

        fs::rename(root.join("a/b/c/f1"), root.join("d/f1")).unwrap();
        refreshed(&mut tree, "a file moved between directories");

        fs::rename(root.join("a/b"), root.join("d/b2")).unwrap();
        refreshed(&mut tree, "a directory moved within the tree");
        fs::write(root.join("d/b2/c/f2"), "after the move").unwrap();
        refreshed(&mut tree, "a change in the moved directory");

        write(&outside.join("z/y/x"), "from outside");
        fs::rename(outside.join("z"), root.join("z")).unwrap();
        refreshed(&mut tree, "a directory moved in from outside");

        fs::rename(root.join("e"), outside.join("e2")).unwrap();
        refreshed(&mut tree, "a directory moved out");
        fs::write(outside.join("e2/f/h"), "written outside").unwrap();
        assert_eq!(
            refreshed(&mut tree, "a change in the directory moved out"),
            0,
            "its watch went with it"
        );

        fs::remove_dir_all(root.join("d")).unwrap();
        write(&root.join("d/other"), "a new d");
        refreshed(&mut tree, "a directory replaced by one of the same name");
        fs::write(root.join("d/other"), "in the new d").unwrap();
        assert_eq!(refreshed(&mut tree, "a change in the new d"), 1);

        fs::remove_file(root.join("link")).unwrap();
        symlink("d/other", root.join("link")).unwrap();
        refreshed(&mut tree, "a symlink pointed elsewhere");

        fs::remove_file(root.join("d/other")).unwrap();
        write(&root.join("d/other/inside"), "a file became a directory");
        refreshed(&mut tree, "a file replaced by a directory");
        fs::remove_dir_all(root.join("fresh")).unwrap();
        write(&root.join("fresh"), "a directory became a file");
        refreshed(&mut tree, "a directory replaced by a file");

        assert_eq!(refreshed(&mut tree, "nothing changed since"), 0);
    }

    /// More events than the kernel queues: the watch says it lost track
    /// (the caller walks the tree), and a new one starts clean.
    #[test]
    fn an_overflowed_queue_is_a_lost_watch() {
        let scratch = tempfile::tempdir().unwrap();
        let root = scratch.path();
        write(&root.join("a"), "a");
        write(&root.join("b"), "b");
        let (_, tree) = WatchedTree::start(root).unwrap();
        let mut tree = tree.expect("a watch");
        let queued: usize = fs::read_to_string("/proc/sys/fs/inotify/max_queued_events")
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(16_384);
        // Alternating names: the kernel folds an event only into an
        // identical one just before it.
        for i in 0..=queued {
            let (name, mode) = if i % 2 == 0 {
                ("a", 0o600)
            } else {
                ("b", 0o640)
            };
            fs::set_permissions(
                root.join(name),
                fs::Permissions::from_mode(mode + (i as u32 / 2 % 2) * 4),
            )
            .unwrap();
        }
        assert!(tree.refresh().unwrap().is_none(), "the overflow is noticed");
        let (listing, tree) = WatchedTree::start(root).unwrap();
        assert!(tree.is_some());
        assert_eq!(listing.entries, listing::list_tree(root).unwrap().entries);
    }

    /// Through the sandbox's path (`watched_listing`): the second listing
    /// comes from the watch; when most directories changed it walks
    /// instead; either way the answer is the walk's.
    #[test]
    fn the_sandbox_lists_from_its_watch_and_walks_when_most_changed() {
        let scratch = tempfile::tempdir().unwrap();
        let root = scratch.path();
        for d in 0..100 {
            write(&root.join(format!("d{d:03}/f")), "f");
        }
        let kept = Mutex::new(None);
        let first = watched_listing(&kept, root).unwrap();
        assert_eq!(first.entries, listing::list_tree(root).unwrap().entries);
        assert_eq!(kept.lock().unwrap().as_ref().unwrap().dirs_read(), 101);

        fs::write(root.join("d042/f"), "changed").unwrap();
        let second = watched_listing(&kept, root).unwrap();
        assert_eq!(second.entries, listing::list_tree(root).unwrap().entries);
        assert_eq!(kept.lock().unwrap().as_ref().unwrap().dirs_read(), 1);

        for d in 0..80 {
            fs::write(root.join(format!("d{d:03}/f")), "all changed").unwrap();
        }
        let third = watched_listing(&kept, root).unwrap();
        assert_eq!(third.entries, listing::list_tree(root).unwrap().entries);
        assert_eq!(
            kept.lock().unwrap().as_ref().unwrap().dirs_read(),
            101,
            "80 of 101 directories changed: walked"
        );
    }

    /// The listed directory itself removed: lost, and a new start says
    /// `NotFound`.
    #[test]
    fn the_root_going_is_a_lost_watch() {
        let scratch = tempfile::tempdir().unwrap();
        let root = scratch.path().join("tree");
        write(&root.join("f"), "f");
        let (_, tree) = WatchedTree::start(&root).unwrap();
        let mut tree = tree.expect("a watch");
        fs::rename(&root, scratch.path().join("moved")).unwrap();
        assert!(tree.refresh().unwrap().is_none());
        let e = WatchedTree::start(&root).unwrap_err();
        assert_eq!(e.kind(), harness_core::ErrorKind::NotFound);
    }
}
