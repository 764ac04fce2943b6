//! A [`CheckpointStore`] in a local directory: the store a single machine
//! needs without an object store (the CLI's default, under the harness
//! home).
//!
//! # Layout
//!
//! An object lives at its key's path with one twist: its file sits in a
//! directory named `~` beside the key's last segment's siblings, so key
//! `sessions/s1/a` is the file `sessions/s1/~/a` and key `sessions/s1` the
//! file `sessions/~/s1`. `~` is outside the key alphabet
//! ([`validate_key`]), so a key can be both an object and the prefix of
//! others (as in any object store) without a file and a directory wanting
//! one name, and every key segment keeps its full 255 bytes as a file name.
//!
//! Each file is the content followed by the 40-byte hash trailer the S3
//! store also writes ([`sha256_trailer`]: a zstd skippable frame carrying
//! the content's SHA-256), so an object carries its own hash: reads verify
//! it and end in `Corrupt` on any change, and `head` reads 40 bytes.
//!
//! # Atomicity
//!
//! A put writes a temporary file under `~tmp/` (also outside the key
//! alphabet), syncs it, and renames it onto the object's path: readers see
//! the old object or the new one, whole, never a mix; a read that opened
//! the old file keeps reading it. A put whose stream fails (or that is
//! dropped) removes its temporary file; one left by a killed process is
//! removed by the next [`FsCheckpointStore::open`] once it is an hour old.
//! Deleting an object removes the directories it leaves empty.

use std::io::SeekFrom;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use bytes::Bytes;
use futures::StreamExt;
use harness_core::checkpoint::{
    check_range, range_past_end, sha256_trailer, trailer_content_size, validate_key,
    verify_trailer_stream, CheckpointStore, ObjectMeta, RecordedHash, SHA256_TRAILER_LEN,
};
use harness_core::stream::ByteStream;
use harness_core::{Error, Result};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncSeekExt, AsyncWriteExt};

/// The directory (in each directory of the tree) holding the objects
/// whose key ends there.
const OBJECTS: &str = "~";

/// The directory (under the root) of puts in progress.
const TEMPS: &str = "~tmp";

/// How old a temporary file must be before `open` takes it for one a
/// killed process left. A put in progress writes to its file as its stream
/// flows, so its modification time stays recent.
const STALE_TEMP: Duration = Duration::from_secs(3600);

/// Bytes read from a file per chunk of a `get`.
const READ_CHUNK: usize = 256 * 1024;

/// A checkpoint store in a directory (see the crate docs for its layout).
#[derive(Debug, Clone)]
pub struct FsCheckpointStore {
    root: PathBuf,
}

/// Distinguishes the temporary files of one process's concurrent puts.
static TEMP_SEQ: AtomicU64 = AtomicU64::new(0);

impl FsCheckpointStore {
    /// The store in `root`, created if absent. Temporary files of puts a
    /// killed process left (an hour old or more) are removed.
    pub fn open(root: impl Into<PathBuf>) -> Result<Self> {
        let root = root.into();
        let temps = root.join(TEMPS);
        std::fs::create_dir_all(&temps).map_err(|e| io_error("creating", &temps, e))?;
        let store = Self { root };
        store.remove_stale_temps();
        Ok(store)
    }

    /// The directory the store keeps its objects in.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The file that holds (or would hold) the object under `key`;
    /// `InvalidInput` for a key [`validate_key`] refuses.
    pub fn object_path(&self, key: &str) -> Result<PathBuf> {
        validate_key(key)?;
        let (dir, name) = key.rsplit_once('/').unwrap_or(("", key));
        let mut path = self.root.clone();
        path.extend(dir.split('/').filter(|s| !s.is_empty()));
        path.push(OBJECTS);
        path.push(name);
        Ok(path)
    }

    fn remove_stale_temps(&self) {
        let temps = self.root.join(TEMPS);
        let Ok(entries) = std::fs::read_dir(&temps) else {
            return;
        };
        let now = SystemTime::now();
        for entry in entries.flatten() {
            let old = entry
                .metadata()
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| now.duration_since(t).ok())
                .is_some_and(|age| age >= STALE_TEMP);
            if old {
                let path = entry.path();
                match std::fs::remove_file(&path) {
                    Ok(()) => {
                        tracing::info!(path = %path.display(), "removed a stale checkpoint temporary")
                    }
                    Err(e) => {
                        tracing::warn!(path = %path.display(), error = %e, "cannot remove a stale checkpoint temporary")
                    }
                }
            }
        }
    }

    fn temp_path(&self) -> PathBuf {
        let seq = TEMP_SEQ.fetch_add(1, Ordering::Relaxed);
        let nanos = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        self.root
            .join(TEMPS)
            .join(format!("{}-{seq}-{nanos}", std::process::id()))
    }

    /// Open the object under `key` for reading: the file, its length as
    /// stored (content and trailer) and its path.
    async fn open_object(&self, key: &str) -> Result<(tokio::fs::File, u64, PathBuf)> {
        let path = self.object_path(key)?;
        let file = tokio::fs::File::open(&path).await.map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                Error::not_found(format!("no checkpoint under key {key:?}"))
            } else {
                io_error("opening", &path, e)
            }
        })?;
        let stored = file
            .metadata()
            .await
            .map_err(|e| io_error("reading the metadata of", &path, e))?
            .len();
        Ok((file, stored, path))
    }

    /// Write `content` and its trailer to the temporary file `tmp`, synced;
    /// the content's metadata under `key`.
    async fn write_temp(
        &self,
        key: &str,
        tmp: &Path,
        mut content: ByteStream,
    ) -> Result<ObjectMeta> {
        let mut file = tokio::fs::File::create(tmp)
            .await
            .map_err(|e| io_error("creating", tmp, e))?;
        let mut hasher = Sha256::new();
        let mut size = 0u64;
        while let Some(chunk) = content.next().await {
            let chunk = chunk?;
            hasher.update(&chunk);
            size += chunk.len() as u64;
            file.write_all(&chunk)
                .await
                .map_err(|e| io_error("writing", tmp, e))?;
        }
        let digest: [u8; 32] = hasher.finalize().into();
        file.write_all(&sha256_trailer(&digest))
            .await
            .map_err(|e| io_error("writing", tmp, e))?;
        file.sync_all()
            .await
            .map_err(|e| io_error("syncing", tmp, e))?;
        Ok(ObjectMeta {
            key: key.to_string(),
            size,
            sha256: hex::encode(digest),
        })
    }

    /// Move the finished temporary file onto `path`. A concurrent delete
    /// can remove the (then empty) directory between its creation and the
    /// rename: then the directory is made again.
    async fn publish(&self, tmp: &Path, path: &Path) -> Result<()> {
        let dir = path.parent().expect("an object path has a parent");
        let mut attempts = 0;
        loop {
            tokio::fs::create_dir_all(dir)
                .await
                .map_err(|e| io_error("creating", dir, e))?;
            match tokio::fs::rename(tmp, path).await {
                Ok(()) => return Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound && attempts < 5 => {
                    attempts += 1;
                }
                Err(e) => return Err(io_error("renaming a finished put onto", path, e)),
            }
        }
    }

    /// Every key under the directory `dir` (which stands for key prefix
    /// `prefix`, `""` or ending in `/`), unsorted. Runs blocking.
    fn walk(dir: &Path, prefix: &str, at_root: bool, out: &mut Vec<String>) -> std::io::Result<()> {
        let entries = match std::fs::read_dir(dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(e),
        };
        for entry in entries {
            let entry = entry?;
            let Some(name) = entry.file_name().to_str().map(str::to_string) else {
                continue;
            };
            if name == OBJECTS {
                for object in std::fs::read_dir(entry.path())? {
                    let object = object?;
                    if let Some(n) = object.file_name().to_str() {
                        if object.file_type()?.is_file() {
                            out.push(format!("{prefix}{n}"));
                        }
                    }
                }
            } else if at_root && name == TEMPS {
                continue;
            } else if entry.file_type()?.is_dir() {
                Self::walk(&entry.path(), &format!("{prefix}{name}/"), false, out)?;
            }
        }
        Ok(())
    }

    /// Removes `dir` and its parents up to the root while they are empty.
    async fn prune(&self, mut dir: &Path) {
        while dir != self.root && dir.starts_with(&self.root) {
            if tokio::fs::remove_dir(dir).await.is_err() {
                return;
            }
            match dir.parent() {
                Some(parent) => dir = parent,
                None => return,
            }
        }
    }
}

/// Removes a put's temporary file unless the put published it, also when
/// the put's future is dropped midway.
struct TempFile(Option<PathBuf>);

impl Drop for TempFile {
    fn drop(&mut self) {
        if let Some(path) = self.0.take() {
            let _ = std::fs::remove_file(path);
        }
    }
}

fn io_error(doing: &str, path: &Path, e: std::io::Error) -> Error {
    Error::backend(format!("checkpoint store: {doing} {}: {e}", path.display()))
}

#[async_trait]
impl CheckpointStore for FsCheckpointStore {
    async fn put(&self, key: &str, content: ByteStream) -> Result<ObjectMeta> {
        let path = self.object_path(key)?;
        let mut tmp = TempFile(Some(self.temp_path()));
        let tmp_path = tmp.0.clone().expect("just set");
        let meta = self.write_temp(key, &tmp_path, content).await?;
        self.publish(&tmp_path, &path).await?;
        tmp.0 = None;
        Ok(meta)
    }

    async fn get(&self, key: &str) -> Result<ByteStream> {
        let (file, _, path) = self.open_object(key).await?;
        let bytes = tokio_util::io::ReaderStream::with_capacity(file, READ_CHUNK)
            .map(move |r| r.map_err(|e| io_error("reading", &path, e)));
        Ok(verify_trailer_stream(Box::pin(bytes), key.to_string()))
    }

    async fn head(&self, key: &str) -> Result<ObjectMeta> {
        let (mut file, stored, path) = self.open_object(key).await?;
        let from = stored.saturating_sub(SHA256_TRAILER_LEN as u64);
        let mut tail = Vec::with_capacity(SHA256_TRAILER_LEN);
        let read = async {
            file.seek(SeekFrom::Start(from)).await?;
            file.read_to_end(&mut tail).await
        };
        read.await
            .map_err(|e| io_error("reading the hash of", &path, e))?;
        RecordedHash::Trailer.object_meta(key, stored, &tail)
    }

    async fn list(&self, prefix: &str) -> Result<Vec<ObjectMeta>> {
        let mut out = Vec::new();
        for key in self.list_keys(prefix).await? {
            match self.head(&key).await {
                Ok(meta) => out.push(meta),
                // Deleted since the listing: not there any more.
                Err(e) if e.kind() == harness_core::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
        }
        Ok(out)
    }

    async fn list_keys(&self, prefix: &str) -> Result<Vec<String>> {
        // The prefix's directory part must be a path of valid segments: a
        // prefix that could climb (or that no key can start with) lists
        // nothing.
        let dir_part = prefix.rsplit_once('/').map_or("", |(dir, _)| dir);
        if !dir_part.is_empty() && validate_key(dir_part).is_err() {
            return Ok(Vec::new());
        }
        let mut dir = self.root.clone();
        dir.extend(dir_part.split('/').filter(|s| !s.is_empty()));
        let base = if dir_part.is_empty() {
            String::new()
        } else {
            format!("{dir_part}/")
        };
        let at_root = dir_part.is_empty();
        let prefix = prefix.to_string();
        let root = self.root.clone();
        tokio::task::spawn_blocking(move || {
            let mut keys = Vec::new();
            Self::walk(&dir, &base, at_root, &mut keys)
                .map_err(|e| io_error("listing", &root, e))?;
            keys.retain(|k| k.starts_with(&prefix));
            keys.sort();
            Ok(keys)
        })
        .await
        .map_err(|e| Error::backend(format!("checkpoint store: listing: {e}")))?
    }

    async fn delete(&self, key: &str) -> Result<()> {
        let path = self.object_path(key)?;
        match tokio::fs::remove_file(&path).await {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(io_error("removing", &path, e)),
        }
        if let Some(dir) = path.parent() {
            self.prune(dir).await;
        }
        Ok(())
    }

    async fn get_range(&self, key: &str, range: std::ops::Range<u64>) -> Result<Bytes> {
        check_range(key, &range)?;
        let (mut file, stored, path) = self.open_object(key).await?;
        let size = trailer_content_size(key, stored)?;
        if range.end > size {
            return Err(range_past_end(key, &range, size));
        }
        let mut buf = vec![0u8; (range.end - range.start) as usize];
        let read = async {
            file.seek(SeekFrom::Start(range.start)).await?;
            file.read_exact(&mut buf).await
        };
        read.await.map_err(|e| io_error("reading", &path, e))?;
        Ok(Bytes::from(buf))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_map_to_files_in_tilde_directories() {
        let store = FsCheckpointStore {
            root: PathBuf::from("/r"),
        };
        assert_eq!(store.object_path("a").unwrap(), Path::new("/r/~/a"));
        assert_eq!(
            store.object_path("sessions/s1/a").unwrap(),
            Path::new("/r/sessions/s1/~/a")
        );
        // A key and the keys under it never want one name.
        assert_eq!(
            store.object_path("sessions/s1").unwrap(),
            Path::new("/r/sessions/~/s1")
        );
        for bad in ["../x", "a/../b", "", "~tmp/x", "a/~/b"] {
            assert!(store.object_path(bad).is_err(), "{bad:?}");
        }
    }
}
