//! Source mtimes that survive a fresh clone, so a warm CI run rebuilds only
//! what changed.
//!
//! Cargo decides whether a workspace crate is stale by comparing its source
//! files' mtimes with the time of its last build. A fresh clone gives every
//! file the clone's time, so with a warm target directory CI still rebuilt
//! every workspace crate (about 4 minutes of the test step, a minute of
//! clippy and of the fuzz build: docs/CI.md, warm run 5).
//!
//! The fix keys mtimes by content: the cache keeps, per tracked path, the Git
//! blob hash and the mtime the file had when that content was last seen.
//! At the start of a run a file whose blob hash is the recorded one gets its
//! recorded mtime back; a file whose content changed keeps the clone's time,
//! so cargo rebuilds exactly the crates whose sources changed. Then the
//! manifest is rewritten with what this run sees.
//!
//! Sound only while every build in that target directory comes from a run
//! that kept the manifest: a build of other content there (someone's local
//! `cargo build` with `CARGO_TARGET_DIR` pointed at CI's cache) would look
//! newer than a restored mtime. So this runs under CI only, and the manifest
//! lives inside the target directory it describes (wiping the target wipes
//! it too).

use std::collections::HashMap;
use std::fs::File;
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};

use crate::util;

const MANIFEST: &str = "harness-source-mtimes.tsv";

/// What `restore` did, for the CI log.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Restored {
    pub restored: usize,
    pub changed: usize,
    pub new: usize,
}

/// Restores the recorded mtimes of unchanged tracked files under `repo`, then
/// records every tracked file's blob hash and mtime in `target/`'s manifest.
pub fn restore_and_record(repo: &Path, target: &Path) -> Result<Restored> {
    let tracked = tracked_files(repo)?;
    let manifest_path = target.join(MANIFEST);
    let text = match std::fs::read_to_string(&manifest_path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(e).with_context(|| format!("reading {}", manifest_path.display())),
    };
    let recorded = parse_manifest(&text);
    let mut done = Restored::default();
    let mut out = String::new();
    for (path, blob) in &tracked {
        let file = repo.join(path);
        // Symlinks and submodules have no mtime of their own worth keeping.
        let Ok(meta) = std::fs::symlink_metadata(&file) else {
            continue;
        };
        if !meta.is_file() {
            continue;
        }
        let mtime = match recorded.get(path.as_str()) {
            Some((old_blob, old_mtime)) if old_blob == blob => {
                File::open(&file)
                    .and_then(|f| f.set_modified(*old_mtime))
                    .with_context(|| format!("setting the mtime of {}", file.display()))?;
                done.restored += 1;
                *old_mtime
            }
            Some(_) => {
                done.changed += 1;
                meta.modified()?
            }
            None => {
                done.new += 1;
                meta.modified()?
            }
        };
        let nanos = mtime
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos();
        out.push_str(&format!("{blob}\t{nanos}\t{path}\n"));
    }
    std::fs::create_dir_all(target).with_context(|| format!("creating {}", target.display()))?;
    // Written whole then renamed: a run killed mid-write leaves the old one.
    let tmp = target.join(format!("{MANIFEST}.tmp"));
    std::fs::write(&tmp, out).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, &manifest_path)
        .with_context(|| format!("renaming {} into place", tmp.display()))?;
    Ok(done)
}

/// `(path, blob hash)` of every file in the index (`git ls-files -s`) whose
/// working copy is what the index holds: an edited file's index hash is not
/// its content's, so it is left out (and keeps its fresh mtime).
fn tracked_files(repo: &Path) -> Result<Vec<(String, String)>> {
    let git = |args: &[&str]| {
        util::output(
            std::process::Command::new("git")
                .current_dir(repo)
                .args(args),
        )
    };
    let index = git(&["ls-files", "-s", "-z"])?;
    let edited = git(&["ls-files", "-m", "-z"])?;
    let edited: std::collections::HashSet<&str> = edited.split('\0').collect();
    Ok(index
        .split('\0')
        .filter_map(|entry| {
            // `<mode> <blob> <stage>\t<path>`
            let (head, path) = entry.split_once('\t')?;
            let blob = head.split(' ').nth(1)?;
            (!edited.contains(path)).then(|| (path.to_owned(), blob.to_owned()))
        })
        .collect())
}

fn parse_manifest(text: &str) -> HashMap<&str, (&str, SystemTime)> {
    text.lines()
        .filter_map(|line| {
            let mut parts = line.splitn(3, '\t');
            let blob = parts.next()?;
            let nanos: u128 = parts.next()?.parse().ok()?;
            let path = parts.next()?;
            let secs = u64::try_from(nanos / 1_000_000_000).ok()?;
            let time = UNIX_EPOCH + Duration::new(secs, (nanos % 1_000_000_000) as u32);
            Some((path, (blob, time)))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn git(repo: &Path, args: &[&str]) {
        let ok = std::process::Command::new("git")
            .current_dir(repo)
            .args(["-c", "user.name=t", "-c", "user.email=t@t"])
            .args(args)
            .status()
            .unwrap()
            .success();
        assert!(ok, "git {args:?}");
    }

    fn mtime(p: &Path) -> SystemTime {
        std::fs::metadata(p).unwrap().modified().unwrap()
    }

    #[test]
    fn unchanged_files_get_their_mtime_back_and_changed_ones_keep_the_new_one() {
        let dir = std::env::temp_dir().join(format!("xtask-mtimes-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let (repo, target) = (dir.join("repo"), dir.join("target"));
        std::fs::create_dir_all(&repo).unwrap();
        git(&repo, &["init", "-q"]);
        std::fs::write(repo.join("same.rs"), "fn a() {}").unwrap();
        std::fs::write(repo.join("edited.rs"), "fn b() {}").unwrap();
        git(&repo, &["add", "."]);
        let old = UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        for f in ["same.rs", "edited.rs"] {
            File::open(repo.join(f)).unwrap().set_modified(old).unwrap();
        }
        let first = restore_and_record(&repo, &target).unwrap();
        assert_eq!((first.restored, first.changed, first.new), (0, 0, 2));

        // The next run: a fresh checkout (new mtimes), one file edited.
        std::fs::write(repo.join("same.rs"), "fn a() {}").unwrap();
        std::fs::write(repo.join("edited.rs"), "fn b() { 1; }").unwrap();
        git(&repo, &["add", "."]);
        let second = restore_and_record(&repo, &target).unwrap();
        assert_eq!((second.restored, second.changed, second.new), (1, 1, 0));
        assert_eq!(mtime(&repo.join("same.rs")), old);
        assert!(
            mtime(&repo.join("edited.rs")) > old,
            "an edited file must look new to cargo"
        );

        // And the edited file's new mtime is what the run after that restores.
        let edited_time = mtime(&repo.join("edited.rs"));
        std::fs::write(repo.join("edited.rs"), "fn b() { 1; }").unwrap();
        File::open(repo.join("edited.rs"))
            .unwrap()
            .set_modified(SystemTime::now() + Duration::from_secs(60))
            .unwrap();
        let third = restore_and_record(&repo, &target).unwrap();
        assert_eq!((third.restored, third.changed, third.new), (2, 0, 0));
        assert_eq!(mtime(&repo.join("edited.rs")), edited_time);

        // An edit not yet in the index is not trusted: its index hash matches.
        std::fs::write(repo.join("same.rs"), "fn a() { 2; }").unwrap();
        let fourth = restore_and_record(&repo, &target).unwrap();
        assert_eq!((fourth.restored, fourth.changed, fourth.new), (1, 0, 0));
        assert!(mtime(&repo.join("same.rs")) > old);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
