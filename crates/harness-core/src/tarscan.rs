//! A sans-IO tar scanner that refuses archives which could write outside
//! their target, or which different extractors could read differently.
//!
//! Feed it bytes as they arrive ([`TarScanner::push`]); it parses each header
//! (with the `tar` crate's header type, including GNU long names and PAX
//! `path`/`linkpath`/`size` records), skips the data, and fails at the first
//! unsafe entry. Restores run it over the whole archive *before* touching the
//! target, so a refused archive leaves the target exactly as it was.
//!
//! Refused, each with a clear message naming the entry:
//! - absolute paths and any `..` component in an entry path;
//! - entries placed under a symlink that the archive itself created (the
//!   symlink could point anywhere the lexical check cannot see);
//! - symlinks whose target is absolute, climbs above the root from the
//!   link's directory, or uses `..` after a normal component;
//! - hardlinks whose target path is unsafe by the entry-path rules;
//! - setuid and setgid bits on anything but a directory (a restore into a
//!   container extracts as root: the bit would make a root-owned setuid
//!   program); sticky bits and setgid directories are fine;
//! - a path named twice, unless every time as a directory (a later entry
//!   could change what an earlier one was checked as);
//! - character and block devices, FIFOs, sparse files (GNU `S` entries and
//!   PAX `GNU.sparse.*` records, whose `GNU.sparse.name` renames the entry
//!   behind the scanner's back) and unknown entry types;
//! - PAX global headers (they change every later entry);
//!
//! and, because the scanner only protects the target if it reads the archive
//! exactly as the extractor will (GNU tar in containers, the `tar` crate on
//! the host), anything those two read differently:
//! - a header with a wrong checksum (GNU tar skips it and resynchronises on
//!   the next valid header, which may sit inside what this scanner took for
//!   file data);
//! - a link, symlink or directory entry that claims data (GNU tar reads no
//!   data for them, the `tar` crate skips `size` bytes);
//! - two GNU long names, two PAX headers, or a PAX path together with a GNU
//!   long name for one entry (the extractors pick different ones);
//! - extension headers without a ustar/GNU magic.
//!
//! A PAX `size` record replaces the header's size, as in both extractors.
//!
//! And archives bigger than [`ScanLimits`] (by default 8 GiB of file
//! content or 500,000 entries; `HARNESS_MAX_RESTORE_BYTES` /
//! `HARNESS_MAX_RESTORE_ENTRIES` change them): a decompression bomb — a
//! few MB of zstd that expand to 10 GB of zeros, or a million empty files —
//! is refused at the header that crosses the limit, before its data is
//! read. A reader that extracts as it scans (a sandbox that stages
//! imports) has written the entries before that header to its staging
//! directory, which the refusal removes.

use std::borrow::Cow;
use std::collections::hash_map::RandomState;
use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasher, BuildHasherDefault, Hasher};

use futures::StreamExt;
use tar::{EntryType, Header};

use crate::stream::ByteStream;
use crate::{Error, Result};

const BLOCK: usize = 512;
/// Longest GNU long name or PAX header the scanner buffers.
const MAX_EXTENSION_BYTES: u64 = 1024 * 1024;
/// Mode bits that make a program run as its owner or group.
const SETID_BITS: u32 = 0o6000;

/// How big an archive may be. A header that would take the archive past a
/// limit is refused, so a bomb costs a few headers, not its expansion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScanLimits {
    /// Most entries (files, directories, links).
    pub max_entries: u64,
    /// Most bytes of file content, summed over the entries.
    pub max_content_bytes: u64,
}

impl ScanLimits {
    /// Built in: 500,000 entries, 8 GiB of content.
    pub const BUILT_IN: ScanLimits = ScanLimits {
        max_entries: 500_000,
        max_content_bytes: 8 << 30,
    };
}

impl Default for ScanLimits {
    /// [`ScanLimits::BUILT_IN`], each overridden by
    /// `HARNESS_MAX_RESTORE_ENTRIES` / `HARNESS_MAX_RESTORE_BYTES` when set
    /// to a number (so a deployment raises them without a rebuild).
    fn default() -> Self {
        let env = |name: &str| {
            std::env::var(name)
                .ok()
                .and_then(|v| v.trim().parse::<u64>().ok())
        };
        ScanLimits {
            max_entries: env("HARNESS_MAX_RESTORE_ENTRIES").unwrap_or(Self::BUILT_IN.max_entries),
            max_content_bytes: env("HARNESS_MAX_RESTORE_BYTES")
                .unwrap_or(Self::BUILT_IN.max_content_bytes),
        }
    }
}

/// What a complete scan saw.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ScanSummary {
    /// Entries (files, directories, links).
    pub entries: u64,
    /// Bytes of file content.
    pub content_bytes: u64,
    /// Bytes of archive consumed.
    pub archive_bytes: u64,
}

#[derive(Debug)]
enum State {
    Header,
    /// Skipping `remaining` bytes of entry data plus padding.
    Data {
        remaining: u64,
    },
    /// Collecting an extension (GNU long name/link, PAX) of `size` bytes,
    /// followed by `pad` padding bytes.
    Extension {
        kind: ExtKind,
        size: u64,
        pad: u64,
    },
    /// Past the end-of-archive marker: the rest is ignored, as extractors do.
    End,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ExtKind {
    LongName,
    LongLink,
    Pax,
}

/// The scanner. See the module docs.
#[derive(Debug)]
pub struct TarScanner {
    state: State,
    buf: Vec<u8>,
    long_name: Option<Vec<u8>>,
    long_link: Option<Vec<u8>>,
    /// A PAX header was read for the entry to come.
    pax_seen: bool,
    pax_path: Option<Vec<u8>>,
    pax_link: Option<Vec<u8>>,
    pax_size: Option<u64>,
    symlinks: HashSet<String>,
    /// Judge where symlinks point (off for [`TarScanner::outward_symlinks`]).
    check_symlink_targets: bool,
    /// Every entry path seen (by hash, so a huge tree costs a few bytes per
    /// entry; a collision can only refuse an archive, never pass one), and
    /// whether every entry of that path was a directory.
    seen: HashMap<u64, bool, BuildHasherDefault<KeyIsHash>>,
    /// The keys of the paths' hashes in `seen`: random per scanner, so no
    /// archive can be made whose paths collide in that table (it uses the
    /// hashes as they are).
    path_keys: RandomState,
    summary: ScanSummary,
    limits: ScanLimits,
    /// Content bytes of the current entry still to come (the rest of
    /// `State::Data` is block padding).
    content_left: u64,
}

/// What kind of entry a [`TarEntry`] is (the kinds the scanner admits).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TarKind {
    /// A regular file; its content follows as [`TarItem::Data`].
    File,
    /// A directory.
    Dir,
    /// A symbolic link to `target` (as written, not resolved).
    Symlink {
        /// The link text.
        target: String,
    },
    /// A hard link to an earlier entry of the same archive.
    Hardlink {
        /// The earlier entry's normalized path.
        target: String,
    },
}

/// One admitted entry, as [`TarScanner::push_entries`] reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TarEntry {
    /// Normalized path (no `.` segments, no trailing slash; `""` is the root).
    pub path: String,
    /// The kind, with a link's target.
    pub kind: TarKind,
    /// Permission bits (`0o7777`).
    pub mode: u32,
    /// Content bytes (0 but for files).
    pub size: u64,
    /// Modification time, seconds since the epoch.
    pub mtime: u64,
}

/// What [`TarScanner::push_entries`] hands its sink, in archive order: an
/// entry, then (for a file) its content in one or more pieces.
#[derive(Debug)]
pub enum TarItem<'a> {
    /// An entry that passed every rule.
    Entry(TarEntry),
    /// The next bytes of the current file's content (no padding).
    Data(&'a [u8]),
}

/// The sink of [`TarScanner::push_entries`].
type Sink<'s> = Option<&'s mut dyn FnMut(TarItem<'_>) -> Result<()>>;

impl Default for TarScanner {
    fn default() -> Self {
        Self::new()
    }
}

/// The hasher of `seen`, whose keys are keyed hashes already
/// (`path_keys`): hashing them again would cost as much as the first time.
#[derive(Default)]
struct KeyIsHash(u64);

impl Hasher for KeyIsHash {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only `u64` keys come here (`write_u64`); anything else is folded.
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

/// The header checksum as the format defines it (the checksum field counted
/// as spaces).
fn computed_checksum(block: &[u8]) -> u32 {
    let sum: u32 = block.iter().map(|&b| u32::from(b)).sum();
    sum - block[148..156].iter().map(|&b| u32::from(b)).sum::<u32>() + 8 * u32::from(b' ')
}

impl TarScanner {
    /// A scanner at the start of an archive.
    pub fn new() -> Self {
        Self {
            state: State::Header,
            buf: Vec::with_capacity(BLOCK),
            long_name: None,
            long_link: None,
            pax_seen: false,
            pax_path: None,
            pax_link: None,
            pax_size: None,
            symlinks: HashSet::new(),
            check_symlink_targets: true,
            seen: HashMap::default(),
            path_keys: RandomState::new(),
            summary: ScanSummary::default(),
            limits: ScanLimits::default(),
            content_left: 0,
        }
    }

    /// Refuse archives past `limits` (instead of [`ScanLimits::default`]).
    pub fn with_limits(mut self, limits: ScanLimits) -> Self {
        self.limits = limits;
        self
    }

    /// Accept symlinks whatever they point to (absolute, or above the
    /// tree, like `../shared`), with every other rule kept (nothing is
    /// accepted *under* such a symlink). For `Sandbox::import_tar`, which
    /// restores a tree as it was and whose extractors never write through
    /// a symlink; `moves::restore` uses the full rules.
    pub fn outward_symlinks(mut self) -> Self {
        self.check_symlink_targets = false;
        self
    }

    /// Consume the next bytes of the archive.
    pub fn push(&mut self, data: &[u8]) -> Result<()> {
        self.push_inner(data, None)
    }

    /// Consume the next bytes of the archive and hand `sink` every admitted
    /// entry and its content: a tar *reader* with the scanner's rules, for
    /// callers that take an archive apart instead of passing it on (the
    /// content-addressed checkpoints of [`crate::tree_checkpoint`]). An
    /// error from `sink` stops the scan and is returned.
    pub fn push_entries(
        &mut self,
        data: &[u8],
        sink: &mut dyn FnMut(TarItem<'_>) -> Result<()>,
    ) -> Result<()> {
        self.push_inner(data, Some(sink))
    }

    /// Admit one entry that does not come from an archive (a manifest's),
    /// given by its parts, by exactly the rules archive entries meet,
    /// limits and duplicate paths included. `path` is taken as written;
    /// nothing is copied for a file or a directory.
    pub fn admit(&mut self, path: &str, kind: &TarKind, mode: u32, size: u64) -> Result<()> {
        let (kind, link) = match kind {
            TarKind::File => (EntryType::Regular, None),
            TarKind::Dir => (EntryType::Directory, None),
            TarKind::Symlink { target } => (EntryType::Symlink, Some(target.as_bytes().to_vec())),
            TarKind::Hardlink { target } => (EntryType::Link, Some(target.as_bytes().to_vec())),
        };
        let size = if kind == EntryType::Regular { size } else { 0 };
        self.admit_raw(path, kind, mode, size, link).map(|_| ())
    }

    /// Room for `entries` more entries' paths, for a caller that knows how
    /// many come (a manifest): the table of paths seen is not grown and
    /// rehashed again and again. Never more than the entry limit.
    pub fn reserve(&mut self, entries: usize) {
        let room = self.limits.max_entries.saturating_sub(self.summary.entries);
        self.seen
            .reserve(entries.min(usize::try_from(room).unwrap_or(usize::MAX)));
    }

    fn push_inner(&mut self, mut data: &[u8], mut sink: Sink<'_>) -> Result<()> {
        self.summary.archive_bytes += data.len() as u64;
        while !data.is_empty() {
            match &mut self.state {
                State::End => return Ok(()),
                State::Data { remaining } => {
                    let n = (*remaining).min(data.len() as u64) as usize;
                    *remaining -= n as u64;
                    let content = (self.content_left as usize).min(n);
                    self.content_left -= content as u64;
                    if let (Some(sink), true) = (sink.as_mut(), content > 0) {
                        sink(TarItem::Data(&data[..content]))?;
                    }
                    data = &data[n..];
                    if *remaining == 0 {
                        self.state = State::Header;
                    }
                }
                State::Header => {
                    let n = (BLOCK - self.buf.len()).min(data.len());
                    self.buf.extend_from_slice(&data[..n]);
                    data = &data[n..];
                    if self.buf.len() == BLOCK {
                        let block = std::mem::take(&mut self.buf);
                        self.header(&block, &mut sink)?;
                        self.buf = block;
                        self.buf.clear();
                    }
                }
                State::Extension { kind, size, pad } => {
                    let (kind, size, pad) = (*kind, *size, *pad);
                    let want = (size + pad) as usize - self.buf.len();
                    let n = want.min(data.len());
                    self.buf.extend_from_slice(&data[..n]);
                    data = &data[n..];
                    if self.buf.len() as u64 == size + pad {
                        let mut value = std::mem::take(&mut self.buf);
                        value.truncate(size as usize);
                        self.extension(kind, value)?;
                        self.buf = Vec::with_capacity(BLOCK);
                        self.state = State::Header;
                    }
                }
            }
        }
        Ok(())
    }

    /// Finish: fails if the archive stopped in the middle of an entry.
    pub fn finish(self) -> Result<ScanSummary> {
        match self.state {
            State::End => Ok(self.summary),
            State::Header
                if self.buf.is_empty()
                    && !self.pax_seen
                    && self.long_name.is_none()
                    && self.long_link.is_none() =>
            {
                Ok(self.summary)
            }
            _ => Err(Error::corrupt(
                "archive is truncated: it ends in the middle of an entry",
            )),
        }
    }

    fn header(&mut self, block: &[u8], sink: &mut Sink<'_>) -> Result<()> {
        if block.iter().all(|&b| b == 0) {
            self.state = State::End;
            return Ok(());
        }
        let header = Header::from_byte_slice(block);
        // Every header's checksum, whatever its format: GNU tar skips a
        // header whose checksum is wrong and looks for the next valid one,
        // which may lie inside what we would skip as its data.
        let sum = header
            .cksum()
            .map_err(|_| Error::corrupt("tar header has an unreadable checksum"))?;
        if sum != computed_checksum(block) {
            return Err(Error::corrupt(
                "not a valid tar archive (bad header checksum)",
            ));
        }
        let has_magic = header.as_ustar().is_some() || header.as_gnu().is_some();
        let header_size = header
            .entry_size()
            .map_err(|_| Error::corrupt("tar header has an unreadable size"))?;
        let ext = match header.entry_type() {
            _ if !has_magic => None,
            EntryType::GNULongName => Some(ExtKind::LongName),
            EntryType::GNULongLink => Some(ExtKind::LongLink),
            EntryType::XHeader => Some(ExtKind::Pax),
            EntryType::XGlobalHeader => {
                return Err(Error::unsafe_entry(
                    "refusing a PAX global header: it would change every later entry (checkpoints never hold one)",
                ));
            }
            _ => None,
        };
        if let Some(kind) = ext {
            let twice = match kind {
                ExtKind::LongName => self.long_name.is_some(),
                ExtKind::LongLink => self.long_link.is_some(),
                ExtKind::Pax => self.pax_seen,
            };
            if twice {
                return Err(Error::unsafe_entry(
                    "refusing two GNU long-name or two PAX headers for one tar entry: extractors disagree on which applies",
                ));
            }
            if header_size > MAX_EXTENSION_BYTES {
                return Err(Error::invalid(format!("tar extension header of {header_size} bytes is larger than the {MAX_EXTENSION_BYTES}-byte limit")));
            }
            if kind == ExtKind::Pax {
                self.pax_seen = true;
            }
            let padded = header_size.div_ceil(BLOCK as u64) * BLOCK as u64;
            self.state = if padded == 0 {
                State::Header
            } else {
                State::Extension {
                    kind,
                    size: header_size,
                    pad: padded - header_size,
                }
            };
            if padded == 0 {
                self.extension(kind, Vec::new())?;
            }
            return Ok(());
        }

        if self.pax_path.is_some() && self.long_name.is_some()
            || self.pax_link.is_some() && self.long_link.is_some()
        {
            return Err(Error::unsafe_entry(
                "refusing a tar entry named by both a PAX header and a GNU long name: extractors disagree on which applies",
            ));
        }
        let path = self
            .pax_path
            .take()
            .or_else(|| self.long_name.take())
            .unwrap_or_else(|| header.path_bytes().into_owned());
        let link = self
            .pax_link
            .take()
            .or_else(|| self.long_link.take())
            .or_else(|| header.link_name_bytes().map(|l| l.into_owned()));
        // A PAX size replaces the header's, in GNU tar and the tar crate.
        let size = self.pax_size.take().unwrap_or(header_size);
        self.long_name = None;
        self.long_link = None;
        self.pax_seen = false;
        // A PAX size is any decimal the archive likes: one near u64::MAX
        // cannot be padded to a block, and no real entry is that large.
        let padded = size
            .checked_next_multiple_of(BLOCK as u64)
            .ok_or_else(|| Error::corrupt(format!("tar entry size {size} is impossible")))?;
        let path = String::from_utf8(path)
            .map_err(|_| Error::unsafe_entry("tar entry path is not UTF-8"))?;
        let kind = header.entry_type();
        let mode = header
            .mode()
            .map_err(|_| Error::corrupt(format!("tar entry {path:?} has an unreadable mode")))?;
        let (normalized, link) = self.admit_raw(&path, kind, mode, size, link)?;
        if let Some(sink) = sink.as_mut() {
            let kind = match kind {
                EntryType::Directory => TarKind::Dir,
                EntryType::Symlink => TarKind::Symlink {
                    target: link.unwrap_or_default(),
                },
                EntryType::Link => TarKind::Hardlink {
                    target: check_entry_path(&link.unwrap_or_default())?,
                },
                _ => TarKind::File,
            };
            sink(TarItem::Entry(TarEntry {
                path: normalized.into_owned(),
                kind,
                mode: mode & 0o7777,
                size,
                mtime: header.mtime().unwrap_or(0),
            }))?;
        }
        self.content_left = size;
        self.state = if padded == 0 {
            State::Header
        } else {
            State::Data { remaining: padded }
        };
        Ok(())
    }

    /// Every rule an entry meets, whether it comes from an archive header
    /// or from a manifest. Returns the normalized path and the link text.
    fn admit_raw<'p>(
        &mut self,
        path: &'p str,
        kind: EntryType,
        mode: u32,
        size: u64,
        link: Option<Vec<u8>>,
    ) -> Result<(Cow<'p, str>, Option<String>)> {
        let normalized = normalize_entry_path(path)?;
        if normalized.is_empty() && kind != EntryType::Directory {
            // Only the tree itself is at its root: a file or link there
            // would stand in for the directory being restored into.
            return Err(Error::unsafe_entry(format!(
                "refusing tar entry {path:?}: a {} at the tree's root (an empty name)",
                kind_name(kind)
            )));
        }
        for ancestor in ancestors(&normalized) {
            if self.symlinks.contains(ancestor) {
                return Err(Error::unsafe_entry(format!(
                    "refusing tar entry {path:?}: it is placed under {ancestor:?}, a symlink created by the same archive"
                )));
            }
        }
        if kind != EntryType::Directory && mode & SETID_BITS != 0 {
            return Err(Error::unsafe_entry(format!(
                "refusing tar entry {path:?}: setuid/setgid bits (mode {mode:o}) are not restored; clear them (chmod ug-s) before the checkpoint"
            )));
        }
        if matches!(
            kind,
            EntryType::Directory | EntryType::Symlink | EntryType::Link
        ) && size != 0
        {
            return Err(Error::unsafe_entry(format!(
                "refusing tar entry {path:?}: a {} entry carries {size} bytes of data, which extractors read differently",
                kind_name(kind)
            )));
        }
        if self.summary.entries >= self.limits.max_entries {
            return Err(Error::unsafe_entry(format!(
                "refusing the archive at {path:?}: it has more than {} entries (the limit; HARNESS_MAX_RESTORE_ENTRIES raises it)",
                self.limits.max_entries
            )));
        }
        let mut link_target = None;
        match kind {
            EntryType::Regular | EntryType::Continuous => {
                let total = self.summary.content_bytes.saturating_add(size);
                if total > self.limits.max_content_bytes {
                    return Err(Error::unsafe_entry(format!(
                        "refusing the archive at {path:?}: it expands to more than {} bytes of files (the limit; HARNESS_MAX_RESTORE_BYTES raises it)",
                        self.limits.max_content_bytes
                    )));
                }
                self.summary.content_bytes = total;
            }
            EntryType::Directory => {}
            EntryType::Symlink => {
                let target = link_text(path, link)?;
                if self.check_symlink_targets {
                    check_symlink(path, &normalized, &target)?;
                }
                link_target = Some(target);
            }
            EntryType::Link => {
                let target = link_text(path, link)?;
                let target_normalized = check_entry_path(&target).map_err(|e| {
                    Error::unsafe_entry(format!(
                        "refusing hardlink {path:?} -> {target:?}: {}",
                        e.message()
                    ))
                })?;
                // link(2) does not follow the target's last component: a
                // hardlink to a symlink is that symlink again, now judged
                // from another directory (and not known as a symlink here).
                if std::iter::once(target_normalized.as_str())
                    .chain(ancestors(&target_normalized))
                    .any(|p| self.symlinks.contains(p))
                {
                    return Err(Error::unsafe_entry(format!(
                        "refusing hardlink {path:?} -> {target:?}: the target is, or is under, a symlink created by the same archive"
                    )));
                }
                link_target = Some(target);
            }
            EntryType::Char | EntryType::Block => {
                return Err(Error::unsafe_entry(format!(
                    "refusing tar entry {path:?}: device nodes are not restored"
                )));
            }
            EntryType::Fifo => {
                return Err(Error::unsafe_entry(format!(
                    "refusing tar entry {path:?}: FIFOs are not restored"
                )));
            }
            EntryType::GNUSparse => {
                return Err(Error::unsafe_entry(format!(
                    "refusing tar entry {path:?}: sparse files are not supported"
                )));
            }
            other => {
                return Err(Error::unsafe_entry(format!(
                    "refusing tar entry {path:?}: unknown entry type {:?}",
                    other.as_byte() as char
                )));
            }
        }
        if !normalized.is_empty() {
            let is_dir = kind == EntryType::Directory;
            match self.seen.entry(self.path_keys.hash_one(&*normalized)) {
                std::collections::hash_map::Entry::Occupied(all_dirs)
                    if *all_dirs.get() && is_dir => {}
                std::collections::hash_map::Entry::Occupied(_) => {
                    return Err(Error::unsafe_entry(format!(
                        "refusing tar entry {path:?}: the archive names {normalized:?} twice (a later entry could change what an earlier one was checked as)"
                    )));
                }
                std::collections::hash_map::Entry::Vacant(slot) => {
                    slot.insert(is_dir);
                }
            }
        }
        if kind == EntryType::Symlink {
            self.symlinks.insert(normalized.clone().into_owned());
        }
        self.summary.entries += 1;
        Ok((normalized, link_target))
    }

    fn extension(&mut self, kind: ExtKind, mut value: Vec<u8>) -> Result<()> {
        match kind {
            ExtKind::LongName | ExtKind::LongLink => {
                // GNU long names are NUL-terminated.
                while value.last() == Some(&0) {
                    value.pop();
                }
                if kind == ExtKind::LongName {
                    self.long_name = Some(value);
                } else {
                    self.long_link = Some(value);
                }
            }
            ExtKind::Pax => {
                for ext in tar::PaxExtensions::new(&value) {
                    let ext = ext.map_err(|_| Error::corrupt("malformed PAX extended header"))?;
                    let key = ext
                        .key()
                        .map_err(|_| Error::corrupt("PAX record key is not UTF-8"))?;
                    match key {
                        "path" => self.pax_path = Some(ext.value_bytes().to_vec()),
                        "linkpath" => self.pax_link = Some(ext.value_bytes().to_vec()),
                        "size" => {
                            let size = ext
                                .value()
                                .ok()
                                .and_then(|v| v.parse::<u64>().ok())
                                .ok_or_else(|| Error::corrupt("PAX size record is not a number"))?;
                            self.pax_size = Some(size);
                        }
                        k if k.starts_with("GNU.sparse.") => {
                            return Err(Error::unsafe_entry(format!(
                                "refusing a PAX {k} record: sparse files are not supported"
                            )));
                        }
                        _ => {}
                    }
                }
            }
        }
        Ok(())
    }
}

/// `tar` passed through `scanner` chunk by chunk: the stream fails at the
/// first refused entry (before handing on the chunk that holds its header)
/// and at a truncated end. What an extractor reading it has written by then
/// stays: scan the whole archive first where nothing may change.
pub fn scan_stream(tar: ByteStream, scanner: TarScanner) -> ByteStream {
    Box::pin(futures::stream::unfold(
        Some((tar, scanner)),
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

fn kind_name(kind: EntryType) -> &'static str {
    match kind {
        EntryType::Directory => "directory",
        EntryType::Symlink => "symlink",
        _ => "hardlink",
    }
}

fn link_text(path: &str, link: Option<Vec<u8>>) -> Result<String> {
    let link =
        link.ok_or_else(|| Error::corrupt(format!("tar link entry {path:?} has no target")))?;
    String::from_utf8(link)
        .map_err(|_| Error::unsafe_entry(format!("tar link target of {path:?} is not UTF-8")))
}

/// Check an entry path and return it normalized (no `.` segments, no
/// trailing slash). `""` is the archive root.
pub fn check_entry_path(path: &str) -> Result<String> {
    normalize_entry_path(path).map(Cow::into_owned)
}

/// [`check_entry_path`], borrowing `path` when it is normal already (no
/// empty, `.` or `..` component): every path of a manifest we wrote is.
pub fn normalize_entry_path(path: &str) -> Result<Cow<'_, str>> {
    if path.contains('\0') {
        return Err(Error::unsafe_entry(format!(
            "refusing tar entry {path:?}: NUL in path"
        )));
    }
    if path.starts_with('/') {
        return Err(Error::unsafe_entry(format!(
            "refusing tar entry {path:?}: absolute path"
        )));
    }
    if path.split('/').all(|part| !matches!(part, "" | "." | "..")) {
        return Ok(Cow::Borrowed(path));
    }
    let mut parts = Vec::new();
    for part in path.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                return Err(Error::unsafe_entry(format!(
                    "refusing tar entry {path:?}: '..' component escapes the target"
                )));
            }
            p => parts.push(p),
        }
    }
    Ok(Cow::Owned(parts.join("/")))
}

fn ancestors(path: &str) -> impl Iterator<Item = &str> {
    path.match_indices('/').map(move |(i, _)| &path[..i])
}

/// Check a symlink at `normalized` (whose raw name is `path`) pointing to
/// `target`.
fn check_symlink(path: &str, normalized: &str, target: &str) -> Result<()> {
    let refuse = |why: &str| {
        Err(Error::unsafe_entry(format!(
            "refusing symlink {path:?} -> {target:?}: {why}"
        )))
    };
    if target.starts_with('/') {
        return refuse("absolute target points outside the tree");
    }
    if target.contains('\0') {
        return refuse("NUL in target");
    }
    // Depth of the directory holding the link.
    let mut depth = normalized.split('/').filter(|s| !s.is_empty()).count() as i64 - 1;
    let mut seen_normal = false;
    for part in target.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                if seen_normal {
                    // `a/..` resolves through `a`, which may itself be a
                    // symlink: only a leading run of `..` is judged safely.
                    return refuse("'..' after a normal component");
                }
                depth -= 1;
                if depth < 0 {
                    return refuse("target climbs above the root of the tree");
                }
            }
            // Past the leading `..`s the depth no longer matters: any
            // later `..` is refused above.
            _ => seen_normal = true,
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(path: &str, kind: EntryType, size: u64, link: Option<&str>) -> Vec<u8> {
        let mut h = Header::new_gnu();
        h.set_entry_type(kind);
        h.set_size(size);
        h.set_mode(0o644);
        // Bypass the builder's own path checks: hostile names are the point.
        let name = &mut h.as_old_mut().name;
        name[..path.len()].copy_from_slice(path.as_bytes());
        if let Some(link) = link {
            h.as_old_mut().linkname[..link.len()].copy_from_slice(link.as_bytes());
        }
        h.set_cksum();
        h.as_bytes().to_vec()
    }

    #[test]
    fn archives_past_the_limits_are_refused_at_the_header() {
        // A 10 GiB file is refused from its header alone: no data read.
        let mut s = TarScanner::new().with_limits(ScanLimits::BUILT_IN);
        let err = s
            .push(&header("zeros.bin", EntryType::Regular, 10 << 30, None))
            .unwrap_err();
        assert_eq!(err.kind(), crate::ErrorKind::Unsafe);
        assert!(err.message().contains("bytes of files"), "{err}");
        assert!(err.message().contains("HARNESS_MAX_RESTORE_BYTES"), "{err}");
        // Entries: the one past the limit is refused; sizes add up.
        let limits = ScanLimits {
            max_entries: 3,
            max_content_bytes: 1000,
        };
        let mut s = TarScanner::new().with_limits(limits);
        for name in ["a", "b", "c"] {
            s.push(&header(name, EntryType::Regular, 0, None)).unwrap();
        }
        let err = s
            .push(&header("d", EntryType::Regular, 0, None))
            .unwrap_err();
        assert!(err.message().contains("more than 3 entries"), "{err}");
        let mut s = TarScanner::new().with_limits(limits);
        let mut data = header("a", EntryType::Regular, 600, None);
        data.extend(vec![0u8; 1024]);
        s.push(&data).unwrap();
        let err = s
            .push(&header("b", EntryType::Regular, 401, None))
            .unwrap_err();
        assert!(err.message().contains("more than 1000 bytes"), "{err}");
        // At the limit exactly: fine.
        let mut s = TarScanner::new().with_limits(limits);
        let mut data = header("a", EntryType::Regular, 1000, None);
        data.extend(vec![0u8; 1024]);
        s.push(&data).unwrap();
    }

    fn archive(entries: &[(&str, EntryType, &[u8], Option<&str>)]) -> Vec<u8> {
        let mut out = Vec::new();
        for (path, kind, data, link) in entries {
            out.extend(header(path, *kind, data.len() as u64, *link));
            out.extend_from_slice(data);
            out.resize(out.len().div_ceil(BLOCK) * BLOCK, 0);
        }
        out.extend([0u8; 1024]);
        out
    }

    fn scan(bytes: &[u8], chunk: usize) -> Result<ScanSummary> {
        let mut s = TarScanner::new();
        for c in bytes.chunks(chunk) {
            s.push(c)?;
        }
        s.finish()
    }

    #[test]
    fn safe_archive_passes_in_any_chunking() {
        let a = archive(&[
            ("dir/", EntryType::Directory, b"", None),
            ("dir/a.txt", EntryType::Regular, b"hello world", None),
            ("dir/link", EntryType::Symlink, b"", Some("a.txt")),
            (
                "node_modules/.bin/x",
                EntryType::Symlink,
                b"",
                Some("../pkg/x"),
            ),
            ("hard", EntryType::Link, b"", Some("dir/a.txt")),
        ]);
        for chunk in [1, 7, 512, 1000, a.len()] {
            let s = scan(&a, chunk).unwrap();
            assert_eq!(s.entries, 5);
            assert_eq!(s.content_bytes, 11);
            assert_eq!(s.archive_bytes, a.len() as u64);
        }
    }

    /// A tar *reader*: the sink is handed every admitted entry, then its
    /// content (no padding), in archive order.
    #[test]
    fn push_entries_hands_the_sink_entries_and_their_content() {
        let a = archive(&[
            ("dir/", EntryType::Directory, b"", None),
            ("dir/a.txt", EntryType::Regular, b"hello world", None),
            ("dir/link", EntryType::Symlink, b"", Some("a.txt")),
            ("hard", EntryType::Link, b"", Some("dir/a.txt")),
        ]);
        let mut seen: Vec<String> = Vec::new();
        let mut s = TarScanner::new();
        for chunk in a.chunks(100) {
            s.push_entries(chunk, &mut |item| {
                seen.push(match item {
                    TarItem::Entry(e) => {
                        format!("entry {} {:?} {} {:o}", e.path, e.kind, e.size, e.mode)
                    }
                    TarItem::Data(d) => format!("data {}", String::from_utf8_lossy(d)),
                });
                Ok(())
            })
            .unwrap();
        }
        s.finish().unwrap();
        assert_eq!(
            seen,
            [
                "entry dir Dir 0 644",
                "entry dir/a.txt File 11 644",
                "data hello world",
                "entry dir/link Symlink { target: \"a.txt\" } 0 644",
                "entry hard Hardlink { target: \"dir/a.txt\" } 0 644",
            ]
        );
        // A sink's error stops the scan and is returned.
        let mut s = TarScanner::new();
        let err = s
            .push_entries(&a, &mut |_| Err(Error::invalid("the sink is full")))
            .unwrap_err();
        assert!(err.to_string().contains("the sink is full"), "{err}");
    }

    /// Entries given by their parts (a manifest's) meet the archive rules:
    /// the limits (a directory's size counts for nothing, a file's does),
    /// unsafe paths, a path named twice.
    #[test]
    fn admitted_entries_meet_the_archive_rules() {
        let limits = ScanLimits {
            max_entries: 10,
            max_content_bytes: 100,
        };
        let mut s = TarScanner::new().with_limits(limits);
        s.admit("dir", &TarKind::Dir, 0o755, 1 << 40).unwrap();
        s.admit("dir/a", &TarKind::File, 0o644, 50).unwrap();
        let twice = s.admit("dir/a", &TarKind::File, 0o644, 0).unwrap_err();
        assert_eq!(twice.kind(), crate::ErrorKind::Unsafe, "{twice}");
        let escape = s.admit("../escape", &TarKind::File, 0o644, 0).unwrap_err();
        assert_eq!(escape.kind(), crate::ErrorKind::Unsafe, "{escape}");
        let link = TarKind::Symlink {
            target: "/etc/passwd".into(),
        };
        assert!(s.admit("dir/l", &link, 0o777, 0).is_err());
        let big = s.admit("dir/b", &TarKind::File, 0o644, 51).unwrap_err();
        assert!(big.message().contains("more than 100 bytes"), "{big}");
        s.admit("dir/c", &TarKind::File, 0o644, 50).unwrap();
    }

    /// `reserve` makes room for the paths a manifest announces, never for
    /// more than the entry limit (a hostile count costs no memory).
    #[test]
    fn reserving_room_is_bounded_by_the_entry_limit() {
        let mut s = TarScanner::new();
        s.reserve(1000);
        assert!(s.seen.capacity() >= 1000, "{}", s.seen.capacity());
        let mut s = TarScanner::new().with_limits(ScanLimits {
            max_entries: 16,
            max_content_bytes: 0,
        });
        s.reserve(usize::MAX / 2);
        assert!(s.seen.capacity() < 1000, "{}", s.seen.capacity());
    }

    /// The paths-seen table's hasher takes a key (already a keyed hash) as
    /// its hash; bytes, should any come, are folded in a word at a time.
    #[test]
    fn the_seen_tables_hasher_passes_keys_through() {
        let mut h = KeyIsHash::default();
        h.write_u64(0xdead_beef_0042);
        assert_eq!(h.finish(), 0xdead_beef_0042);
        let mut h = KeyIsHash::default();
        h.write(&[1; 9]);
        // Eight bytes fill the word; the ninth is folded onto the first.
        assert_eq!(h.finish(), 0x0101_0101_0101_0100);
    }

    /// An extension header (GNU long name or link, PAX) of up to a MiB is
    /// read; one byte more is refused from its header.
    #[test]
    fn extension_headers_are_held_to_a_mebibyte() {
        let mut s = TarScanner::new();
        s.push(&header(
            "././@LongLink",
            EntryType::GNULongName,
            MAX_EXTENSION_BYTES,
            None,
        ))
        .unwrap();
        let mut s = TarScanner::new();
        let err = s
            .push(&header(
                "././@LongLink",
                EntryType::GNULongName,
                MAX_EXTENSION_BYTES + 1,
                None,
            ))
            .unwrap_err();
        assert!(err.message().contains("larger than the"), "{err}");
    }

    /// A GNU long name with no bytes still names the next entry — an empty
    /// name, the tree's root, which only a directory may be — rather than
    /// being skipped so that the entry's own short name would pass.
    #[test]
    fn an_empty_long_name_still_names_the_next_entry() {
        let mut out = header("././@LongLink", EntryType::GNULongName, 0, None);
        out.extend(header("short", EntryType::Regular, 0, None));
        out.extend([0u8; 1024]);
        let err = scan(&out, 512).unwrap_err();
        assert!(err.message().contains("at the tree's root"), "{err}");
        for kind in [EntryType::Regular, EntryType::Symlink] {
            let root = archive(&[("./", kind, b"", Some("x"))]);
            let err = scan(&root, 512).unwrap_err();
            assert_eq!(err.kind(), crate::ErrorKind::Unsafe, "{kind:?}: {err}");
        }
        let root_dir = archive(&[("./", EntryType::Directory, b"", None)]);
        scan(&root_dir, 512).unwrap();
        let up = archive(&[("..", EntryType::Directory, b"", None)]);
        assert_eq!(scan(&up, 512).unwrap_err().kind(), crate::ErrorKind::Unsafe);
    }

    /// PAX records: `linkpath` gives a link its target; keys the scanner
    /// does not know (`mtime`, `comment`) pass; `GNU.sparse.*` is refused.
    #[test]
    fn pax_records_other_than_paths_and_sizes() {
        let target = vec!["p".repeat(60); 3].join("/");
        let mut out = pax(&[("linkpath", &target), ("mtime", "1700000000.5")]);
        out.extend(header("l", EntryType::Symlink, 0, Some("short")));
        let out = end(out);
        let mut kinds = Vec::new();
        let mut s = TarScanner::new();
        s.push_entries(&out, &mut |item| {
            if let TarItem::Entry(e) = item {
                kinds.push(e.kind);
            }
            Ok(())
        })
        .unwrap();
        assert_eq!(kinds, [TarKind::Symlink { target }]);
        let mut commented = pax(&[("comment", "made by a test")]);
        commented.extend(header("f", EntryType::Regular, 0, None));
        assert_eq!(scan(&end(commented), 512).unwrap().entries, 1);
        let mut sparse = pax(&[("GNU.sparse.map", "0,0")]);
        sparse.extend(header("f", EntryType::Regular, 0, None));
        refused(&end(sparse), "sparse");
    }

    /// A symlink's `.` and empty components are no steps: `./../a` from
    /// `dir/` stays inside the tree.
    #[test]
    fn dot_components_of_a_symlink_target_are_no_steps() {
        let a = archive(&[
            ("a.txt", EntryType::Regular, b"x", None),
            ("dir/", EntryType::Directory, b"", None),
            ("dir/l", EntryType::Symlink, b"", Some(".//./../a.txt")),
        ]);
        assert_eq!(scan(&a, 512).unwrap().entries, 3);
    }

    /// A GNU long link names the next entry's link target: the entry is
    /// handed on with that target, and a hostile one is judged.
    #[test]
    fn gnu_long_links_give_the_target() {
        let long_link = |target: &str| {
            let mut out = gnu_extension(EntryType::GNULongLink, target);
            out.extend(header("dir/link", EntryType::Symlink, 0, Some("short")));
            out.extend([0u8; 1024]);
            out
        };
        let target = vec!["t".repeat(60); 3].join("/");
        let mut targets = Vec::new();
        let mut s = TarScanner::new();
        s.push_entries(&long_link(&target), &mut |item| {
            if let TarItem::Entry(e) = item {
                targets.push(e.kind);
            }
            Ok(())
        })
        .unwrap();
        assert_eq!(targets, [TarKind::Symlink { target }]);
        let hostile = format!("{}etc/passwd", "../".repeat(40));
        let err = scan(&long_link(&hostile), 512).unwrap_err();
        assert_eq!(err.kind(), crate::ErrorKind::Unsafe, "{err}");
    }

    /// An archive that ends after an entry without its end-of-archive
    /// blocks is whole (tar writers may leave them out); one that ends in
    /// a header is not.
    #[test]
    fn an_archive_may_end_without_its_end_blocks() {
        let mut a = archive(&[("a.txt", EntryType::Regular, b"hi", None)]);
        a.truncate(a.len() - 1024);
        assert_eq!(scan(&a, 512).unwrap().entries, 1);
        a.extend(&header("b", EntryType::Regular, 0, None)[..100]);
        assert_eq!(scan(&a, 512).unwrap_err().kind(), crate::ErrorKind::Corrupt);
    }

    /// Deep trees have long paths: a GNU long name of a few KiB passes (the
    /// buffer limit for one is a MiB).
    #[test]
    fn long_names_of_a_few_kib_pass() {
        let long = vec!["d".repeat(100); 30].join("/") + "/file.txt";
        let mut out = gnu_extension(EntryType::GNULongName, &long);
        out.extend(header("short", EntryType::Regular, 0, None));
        out.extend([0u8; 1024]);
        let s = scan(&out, 512).unwrap();
        assert_eq!(s.entries, 1);
    }

    #[test]
    fn each_unsafe_kind_is_refused() {
        let cases: &[(&str, EntryType, Option<&str>, &str)] = &[
            ("../evil", EntryType::Regular, None, "'..'"),
            ("a/../../evil", EntryType::Regular, None, "'..'"),
            ("/etc/passwd", EntryType::Regular, None, "absolute"),
            ("l", EntryType::Symlink, Some("/etc"), "absolute target"),
            ("d/l", EntryType::Symlink, Some("../../x"), "climbs above"),
            ("l", EntryType::Symlink, Some("a/../.."), "after a normal"),
            ("h", EntryType::Link, Some("../outside"), "hardlink"),
            ("h", EntryType::Link, Some("/etc/shadow"), "hardlink"),
            ("dev", EntryType::Char, None, "device"),
            ("blk", EntryType::Block, None, "device"),
            ("fifo", EntryType::Fifo, None, "FIFO"),
        ];
        for (path, kind, link, expect) in cases {
            let a = archive(&[
                ("ok.txt", EntryType::Regular, b"x", None),
                (path, *kind, b"", *link),
            ]);
            let err = scan(&a, 100).unwrap_err();
            assert_eq!(err.kind(), crate::ErrorKind::Unsafe, "{path}: {err}");
            assert!(err.to_string().contains(expect), "{path}: {err}");
        }
    }

    #[test]
    fn outward_symlinks_are_only_accepted_when_asked_and_never_written_under() {
        let a = archive(&[
            ("shared", EntryType::Symlink, b"", Some("../shared")),
            ("etc", EntryType::Symlink, b"", Some("/etc")),
        ]);
        assert!(scan(&a, 512).is_err());
        let mut s = TarScanner::new().outward_symlinks();
        s.push(&a).unwrap();
        assert_eq!(s.finish().unwrap().entries, 2);
        let under = archive(&[
            ("etc", EntryType::Symlink, b"", Some("/etc")),
            ("etc/passwd", EntryType::Regular, b"x", None),
        ]);
        let mut s = TarScanner::new().outward_symlinks();
        let err = s.push(&under).unwrap_err();
        assert!(
            err.to_string()
                .contains("symlink created by the same archive"),
            "{err}"
        );
    }

    #[test]
    fn writing_through_an_archive_symlink_is_refused() {
        let a = archive(&[
            ("d", EntryType::Symlink, b"", Some(".")),
            ("d/x", EntryType::Regular, b"x", None),
        ]);
        let err = scan(&a, 512).unwrap_err();
        assert!(
            err.to_string()
                .contains("symlink created by the same archive"),
            "{err}"
        );
    }

    /// A GNU long name or long link header (`kind`) holding `text`,
    /// NUL-terminated and padded, as GNU tar writes one.
    fn gnu_extension(kind: EntryType, text: &str) -> Vec<u8> {
        let mut out = header("././@LongLink", kind, text.len() as u64 + 1, None);
        out.extend(text.as_bytes());
        out.push(0);
        out.resize(out.len().div_ceil(BLOCK) * BLOCK, 0);
        out
    }

    #[test]
    fn gnu_long_names_are_checked() {
        let long = format!("{}/../../escape", "a".repeat(120));
        let mut out = gnu_extension(EntryType::GNULongName, &long);
        out.extend(header("short", EntryType::Regular, 0, None));
        out.extend([0u8; 1024]);
        let err = scan(&out, 64).unwrap_err();
        assert!(
            err.to_string().contains("escape"),
            "the long name, not the short one, is judged: {err}"
        );
    }

    #[test]
    fn pax_paths_are_checked() {
        let record = "29 path=../../pax-escape.txt\n";
        assert_eq!(record.len(), 29);
        let mut out = header("PaxHeader", EntryType::XHeader, record.len() as u64, None);
        out.extend(record.as_bytes());
        out.resize(out.len().div_ceil(BLOCK) * BLOCK, 0);
        out.extend(header("innocent.txt", EntryType::Regular, 0, None));
        out.extend([0u8; 1024]);
        let err = scan(&out, 512).unwrap_err();
        assert!(err.to_string().contains("pax-escape"), "{err}");
    }

    /// A header with `mode` (and otherwise like [`header`]).
    fn header_mode(path: &str, kind: EntryType, size: u64, mode: u32) -> Vec<u8> {
        let mut h = Header::from_byte_slice(&header(path, kind, size, None)).clone();
        h.set_mode(mode);
        h.set_cksum();
        h.as_bytes().to_vec()
    }

    /// A PAX extended header (type `x`) holding `records`.
    fn pax(records: &[(&str, &str)]) -> Vec<u8> {
        let mut body = Vec::new();
        for (k, v) in records {
            let rest = format!(" {k}={v}\n");
            let mut n = rest.len() + 1;
            while n.to_string().len() + rest.len() != n {
                n += 1;
            }
            body.extend(format!("{n}{rest}").as_bytes());
        }
        let mut out = header("PaxHeader", EntryType::XHeader, body.len() as u64, None);
        out.extend(&body);
        out.resize(out.len().div_ceil(BLOCK) * BLOCK, 0);
        out
    }

    fn with_data(mut header: Vec<u8>, data: &[u8]) -> Vec<u8> {
        header.extend_from_slice(data);
        header.resize(header.len().div_ceil(BLOCK) * BLOCK, 0);
        header
    }

    fn end(mut out: Vec<u8>) -> Vec<u8> {
        out.extend([0u8; 1024]);
        out
    }

    /// A character device entry, to hide where only a desynchronised
    /// scanner would miss it.
    fn hidden_device() -> Vec<u8> {
        header("hidden-dev", EntryType::Char, 0, None)
    }

    fn refused(bytes: &[u8], expect: &str) {
        for chunk in [1, 100, 512, bytes.len().max(1)] {
            let err = scan(bytes, chunk).expect_err(expect);
            assert!(
                matches!(
                    err.kind(),
                    crate::ErrorKind::Unsafe | crate::ErrorKind::Corrupt
                ),
                "{expect}: {err}"
            );
            assert!(err.to_string().contains(expect), "{expect}: {err}");
        }
    }

    #[test]
    fn setuid_and_setgid_are_refused_on_everything_but_directories() {
        for (mode, kind) in [
            (0o4755, EntryType::Regular),
            (0o2755, EntryType::Regular),
            (0o6711, EntryType::Continuous),
            (0o4644, EntryType::Link),
        ] {
            let mut out = header_mode("x", kind, 0, mode);
            if kind == EntryType::Link {
                out = header("target", EntryType::Regular, 0, None);
                let mut h = Header::from_byte_slice(&header("x", kind, 0, Some("target"))).clone();
                h.set_mode(mode);
                h.set_cksum();
                out.extend(h.as_bytes());
            }
            let err = scan(&end(out), 512).unwrap_err();
            assert_eq!(err.kind(), crate::ErrorKind::Unsafe, "{mode:o}: {err}");
            assert!(err.to_string().contains("setuid/setgid"), "{err}");
        }
        // A setgid or sticky directory is an ordinary shared directory.
        let ok = end([
            header_mode("shared/", EntryType::Directory, 0, 0o2775),
            header_mode("tmp/", EntryType::Directory, 0, 0o1777),
            header_mode("shared/run.sh", EntryType::Regular, 0, 0o755),
        ]
        .concat());
        assert_eq!(scan(&ok, 512).unwrap().entries, 3);
    }

    #[test]
    fn a_path_named_twice_is_refused_unless_always_a_directory() {
        let twice = |a: (&str, EntryType, Option<&str>), b: (&str, EntryType, Option<&str>)| {
            archive(&[(a.0, a.1, b"", a.2), (b.0, b.1, b"", b.2)])
        };
        for (a, b) in [
            (
                ("f", EntryType::Regular, None),
                ("f", EntryType::Regular, None),
            ),
            (
                ("d/", EntryType::Directory, None),
                ("d", EntryType::Symlink, Some(".")),
            ),
            (
                ("l", EntryType::Symlink, Some("sub")),
                ("l", EntryType::Regular, None),
            ),
            (
                ("f", EntryType::Regular, None),
                ("./f", EntryType::Link, Some("g")),
            ),
            (
                ("f", EntryType::Regular, None),
                ("f/", EntryType::Directory, None),
            ),
        ] {
            let err = scan(&twice(a, b), 512).unwrap_err();
            assert!(err.to_string().contains("twice"), "{a:?} {b:?}: {err}");
        }
        let dirs = twice(
            ("d/", EntryType::Directory, None),
            ("./d", EntryType::Directory, None),
        );
        scan(&dirs, 512).unwrap();
        // The archive root may come more than once too.
        scan(
            &twice(
                ("./", EntryType::Directory, None),
                (".", EntryType::Directory, None),
            ),
            512,
        )
        .unwrap();
    }

    #[test]
    fn pax_global_headers_are_refused() {
        for records in [
            &[("comment", "hello")][..],
            &[("path", "x")],
            &[("size", "0")],
        ] {
            let mut out = pax(records);
            out[156] = b'g';
            let mut h = Header::from_byte_slice(&out[..BLOCK]).clone();
            h.set_cksum();
            out[..BLOCK].copy_from_slice(h.as_bytes());
            out.extend(header("a.txt", EntryType::Regular, 0, None));
            refused(&end(out), "global header");
        }
    }

    #[test]
    fn sparse_entries_are_refused_in_every_form() {
        refused(
            &archive(&[("s", EntryType::GNUSparse, b"", None)]),
            "sparse",
        );
        // PAX sparse (format 1.0), whose GNU.sparse.name GNU tar takes as
        // the entry's real name.
        for records in [
            &[("GNU.sparse.major", "1"), ("GNU.sparse.minor", "0")][..],
            &[("GNU.sparse.name", "renamed.txt")],
            &[("GNU.sparse.map", "0,0")],
        ] {
            let mut out = pax(records);
            out.extend(with_data(
                header("innocent.txt", EntryType::Regular, 3, None),
                b"abc",
            ));
            refused(&end(out), "sparse");
        }
    }

    #[test]
    fn a_pax_size_decides_where_the_next_header_is() {
        // The header claims 512 bytes of data, which hold a device entry;
        // the PAX size (0), which extractors obey, puts that entry in plain
        // sight.
        let mut out = pax(&[("size", "0")]);
        out.extend(header("f", EntryType::Regular, BLOCK as u64, None));
        out.extend(hidden_device());
        refused(&end(out), "device");
        // And the other way round: a PAX size that covers the next header.
        let mut out = pax(&[("size", "512")]);
        out.extend(header("g", EntryType::Regular, 0, None));
        out.extend(header("covered", EntryType::Regular, 0, None));
        let s = scan(&end(out), 512).unwrap();
        assert_eq!((s.entries, s.content_bytes), (1, 512));
        refused(&end(with_data(pax(&[("size", "x")]), &[])), "not a number");
        // Found by the tarscan fuzz target: a size that cannot be padded to
        // a block overflowed (a panic in debug builds, a wrap in release).
        let mut out = pax(&[("size", &u64::MAX.to_string())]);
        out.extend(header("huge", EntryType::Regular, 0, None));
        refused(&end(out), "impossible");
    }

    #[test]
    fn a_header_with_a_wrong_checksum_is_refused() {
        // GNU tar skips such a header and reads the next valid one, here
        // inside what its size field would make data.
        let mut cover = header("cover", EntryType::Regular, BLOCK as u64, None);
        cover[148..156].copy_from_slice(b"0000000\0");
        cover.extend(hidden_device());
        let err = scan(&end(cover), 512).unwrap_err();
        assert_eq!(err.kind(), crate::ErrorKind::Corrupt, "{err}");
        assert!(err.to_string().contains("checksum"), "{err}");
    }

    #[test]
    fn links_and_directories_carrying_data_are_refused() {
        for (kind, link, name) in [
            (EntryType::Symlink, Some("x"), "a symlink entry"),
            (EntryType::Link, Some("x"), "a hardlink entry"),
            (EntryType::Directory, None, "a directory entry"),
        ] {
            let mut out = header("x", EntryType::Regular, 0, None);
            out.extend(header("e", kind, BLOCK as u64, link));
            out.extend(hidden_device());
            let out = end(out);
            refused(&out, "carries 512 bytes");
            let err = scan(&out, 512).unwrap_err();
            assert!(err.message().contains(name), "{name}: {err}");
        }
    }

    #[test]
    fn ambiguous_extension_headers_are_refused() {
        let long = |kind: EntryType, name: &str| {
            with_data(
                header("././@LongLink", kind, name.len() as u64 + 1, None),
                format!("{name}\0").as_bytes(),
            )
        };
        let entry = header("short", EntryType::Regular, 0, None);
        for (out, expect) in [
            (
                [
                    long(EntryType::GNULongName, "a"),
                    long(EntryType::GNULongName, "b"),
                    entry.clone(),
                ]
                .concat(),
                "two GNU long-name or two PAX",
            ),
            (
                [pax(&[("path", "a")]), pax(&[("mtime", "1")]), entry.clone()].concat(),
                "two GNU long-name or two PAX",
            ),
            (
                [
                    pax(&[("path", "a")]),
                    long(EntryType::GNULongName, "b"),
                    entry.clone(),
                ]
                .concat(),
                "both a PAX header and a GNU long name",
            ),
        ] {
            refused(&end(out), expect);
        }
        // A long-name header without a magic is no extension to the tar
        // crate: an entry of an unknown type here.
        let mut plain = long(EntryType::GNULongName, "a");
        plain[257..265].copy_from_slice(&[0; 8]);
        let mut h = Header::from_byte_slice(&plain[..BLOCK]).clone();
        h.set_cksum();
        plain[..BLOCK].copy_from_slice(h.as_bytes());
        plain.extend(entry);
        refused(&end(plain), "unknown entry type");
        // An extension at the very end, describing nothing, is a truncation.
        let err = scan(&pax(&[("path", "a")]), 512).unwrap_err();
        assert_eq!(err.kind(), crate::ErrorKind::Corrupt, "{err}");
    }

    #[test]
    fn truncated_archive_is_corrupt() {
        let a = archive(&[("a.txt", EntryType::Regular, &[7u8; 2000], None)]);
        let err = scan(&a[..1500], 512).unwrap_err();
        assert_eq!(err.kind(), crate::ErrorKind::Corrupt);
        let err = scan(
            b"this is not a tar archive at all, just some text padding it out",
            512,
        );
        // Shorter than a block: truncated.
        assert!(err.is_err());
    }
}
