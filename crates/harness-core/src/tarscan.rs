//! A sans-IO tar scanner that refuses archives which could write outside
//! their target.
//!
//! Feed it bytes as they arrive ([`TarScanner::push`]); it parses each header
//! (with the `tar` crate's header type, including GNU long names and PAX
//! `path`/`linkpath` records), skips the data, and fails at the first unsafe
//! entry. Restores run it over the whole archive *before* touching the
//! target, so a refused archive leaves the target exactly as it was.
//!
//! Refused, each with a clear message naming the entry:
//! - absolute paths and any `..` component in an entry path;
//! - entries placed under a symlink that the archive itself created (the
//!   symlink could point anywhere the lexical check cannot see);
//! - symlinks whose target is absolute, climbs above the root from the
//!   link's directory, or uses `..` after a normal component;
//! - hardlinks whose target path is unsafe by the entry-path rules;
//! - character and block devices, FIFOs, GNU sparse files and unknown entry
//!   types.

use std::collections::HashSet;

use tar::{EntryType, Header};

use crate::{Error, Result};

const BLOCK: usize = 512;
/// Longest GNU long name or PAX header the scanner buffers.
const MAX_EXTENSION_BYTES: u64 = 1024 * 1024;

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
    GlobalPax,
}

/// The scanner. See the module docs.
#[derive(Debug)]
pub struct TarScanner {
    state: State,
    buf: Vec<u8>,
    long_name: Option<Vec<u8>>,
    long_link: Option<Vec<u8>>,
    pax_path: Option<Vec<u8>>,
    pax_link: Option<Vec<u8>>,
    symlinks: HashSet<String>,
    summary: ScanSummary,
}

impl Default for TarScanner {
    fn default() -> Self {
        Self::new()
    }
}

impl TarScanner {
    /// A scanner at the start of an archive.
    pub fn new() -> Self {
        Self {
            state: State::Header,
            buf: Vec::with_capacity(BLOCK),
            long_name: None,
            long_link: None,
            pax_path: None,
            pax_link: None,
            symlinks: HashSet::new(),
            summary: ScanSummary::default(),
        }
    }

    /// Consume the next bytes of the archive.
    pub fn push(&mut self, mut data: &[u8]) -> Result<()> {
        self.summary.archive_bytes += data.len() as u64;
        while !data.is_empty() {
            match &mut self.state {
                State::End => return Ok(()),
                State::Data { remaining } => {
                    let n = (*remaining).min(data.len() as u64) as usize;
                    *remaining -= n as u64;
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
                        self.header(&block)?;
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
            State::Header if self.buf.is_empty() => Ok(self.summary),
            _ => Err(Error::corrupt(
                "archive is truncated: it ends in the middle of an entry",
            )),
        }
    }

    fn header(&mut self, block: &[u8]) -> Result<()> {
        if block.iter().all(|&b| b == 0) {
            self.state = State::End;
            return Ok(());
        }
        let header = Header::from_byte_slice(block);
        if header.as_ustar().is_none() && header.as_gnu().is_none() {
            // Old v7 headers carry no magic; accept them only if the checksum
            // is right, like extractors do.
            let sum = header
                .cksum()
                .map_err(|_| Error::corrupt("tar header has an unreadable checksum"))?;
            let mut computed: u32 = block.iter().map(|&b| u32::from(b)).sum();
            computed -= block[148..156].iter().map(|&b| u32::from(b)).sum::<u32>();
            computed += 8 * u32::from(b' ');
            if sum != computed {
                return Err(Error::corrupt("not a tar archive (bad header checksum)"));
            }
        }
        let size = header
            .entry_size()
            .map_err(|_| Error::corrupt("tar header has an unreadable size"))?;
        let padded = size.div_ceil(BLOCK as u64) * BLOCK as u64;
        let ext = match header.entry_type() {
            EntryType::GNULongName => Some(ExtKind::LongName),
            EntryType::GNULongLink => Some(ExtKind::LongLink),
            EntryType::XHeader => Some(ExtKind::Pax),
            EntryType::XGlobalHeader => Some(ExtKind::GlobalPax),
            _ => None,
        };
        if let Some(kind) = ext {
            if size > MAX_EXTENSION_BYTES {
                return Err(Error::invalid(format!("tar extension header of {size} bytes is larger than the {MAX_EXTENSION_BYTES}-byte limit")));
            }
            self.state = if padded == 0 {
                State::Header
            } else {
                State::Extension {
                    kind,
                    size,
                    pad: padded - size,
                }
            };
            if padded == 0 {
                self.extension(kind, Vec::new())?;
            }
            return Ok(());
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
        self.long_name = None;
        self.long_link = None;
        let path = String::from_utf8(path)
            .map_err(|_| Error::unsafe_entry("tar entry path is not UTF-8"))?;
        let normalized = check_entry_path(&path)?;
        for ancestor in ancestors(&normalized) {
            if self.symlinks.contains(ancestor) {
                return Err(Error::unsafe_entry(format!(
                    "refusing tar entry {path:?}: it is placed under {ancestor:?}, a symlink created by the same archive"
                )));
            }
        }
        let kind = header.entry_type();
        match kind {
            EntryType::Regular | EntryType::Continuous => {
                self.summary.content_bytes += size;
            }
            EntryType::Directory => {}
            EntryType::Symlink => {
                let target = link_text(&path, link)?;
                check_symlink(&path, &normalized, &target)?;
                self.symlinks.insert(normalized);
            }
            EntryType::Link => {
                let target = link_text(&path, link)?;
                check_entry_path(&target).map_err(|e| {
                    Error::unsafe_entry(format!(
                        "refusing hardlink {path:?} -> {target:?}: {}",
                        e.message()
                    ))
                })?;
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
        self.summary.entries += 1;
        self.state = if padded == 0 {
            State::Header
        } else {
            State::Data { remaining: padded }
        };
        Ok(())
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
                    match ext.key() {
                        Ok("path") => self.pax_path = Some(ext.value_bytes().to_vec()),
                        Ok("linkpath") => self.pax_link = Some(ext.value_bytes().to_vec()),
                        _ => {}
                    }
                }
            }
            ExtKind::GlobalPax => {
                for ext in tar::PaxExtensions::new(&value) {
                    let ext = ext.map_err(|_| Error::corrupt("malformed PAX global header"))?;
                    if matches!(ext.key(), Ok("path") | Ok("linkpath")) {
                        return Err(Error::unsafe_entry(
                            "refusing a PAX global header that sets path or linkpath",
                        ));
                    }
                }
            }
        }
        Ok(())
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
    Ok(parts.join("/"))
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
            _ => {
                seen_normal = true;
                depth += 1;
            }
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
        }
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

    #[test]
    fn gnu_long_names_are_checked() {
        let long = format!("{}/../../escape", "a".repeat(120));
        let mut out = header(
            "././@LongLink",
            EntryType::GNULongName,
            long.len() as u64 + 1,
            None,
        );
        out.extend(long.as_bytes());
        out.push(0);
        out.resize(out.len().div_ceil(BLOCK) * BLOCK, 0);
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
