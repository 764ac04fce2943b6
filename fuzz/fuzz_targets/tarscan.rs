//! The tar safety scanner (`harness_core::tarscan`) on arbitrary archives.
//!
//! Asserts:
//! - the verdict and summary do not depend on how the bytes are chunked;
//! - an archive the scanner passes is safe when extracted: the archive is
//!   read again with the `tar` crate (what the local sandbox extracts with)
//!   and replayed on a model file system that follows symlinks the way an
//!   extractor does (hardlinks to a symlink copy the symlink). No entry path,
//!   link target or path through a link may leave the root, no entry may be
//!   a device or FIFO, and the scanner must have counted every entry the
//!   `tar` crate yields.

#![no_main]

use std::collections::HashMap;
use std::io::Read;

use harness_core::tarscan::{ScanSummary, TarScanner};
use libfuzzer_sys::fuzz_target;
use tar::EntryType;

fn scan_chunked(data: &[u8], chunk: usize) -> Result<ScanSummary, String> {
    let mut scanner = TarScanner::new();
    for piece in data.chunks(chunk.max(1)) {
        scanner.push(piece).map_err(|e| e.to_string())?;
    }
    scanner.finish().map_err(|e| e.to_string())
}

#[derive(Debug, Clone)]
enum Node {
    Dir,
    File,
    Symlink(String),
}

/// A file system rooted at the extraction target; paths are component lists
/// relative to it.
#[derive(Default)]
struct Model {
    nodes: HashMap<Vec<String>, Node>,
}

#[derive(Debug)]
struct Escape(String);

/// Not an escape: the extractor stops with ELOOP.
const LOOP: &str = "symlink loop";

impl Model {
    /// Resolve `path` starting in directory `base`, following symlinks in
    /// every component but (unless `follow_last`) the last one.
    fn resolve(
        &self,
        base: &[String],
        path: &str,
        follow_last: bool,
        depth: u32,
    ) -> Result<Vec<String>, Escape> {
        if depth > 40 {
            // ELOOP: the extractor fails here and writes nothing.
            return Err(Escape(LOOP.into()));
        }
        if path.starts_with('/') {
            return Err(Escape(format!("absolute path {path:?}")));
        }
        let mut at: Vec<String> = base.to_vec();
        let parts: Vec<&str> = path
            .split('/')
            .filter(|p| !p.is_empty() && *p != ".")
            .collect();
        for (i, part) in parts.iter().enumerate() {
            let last = i + 1 == parts.len();
            if *part == ".." {
                if at.pop().is_none() {
                    return Err(Escape(format!("{path:?} climbs above the root")));
                }
                continue;
            }
            let mut candidate = at.clone();
            candidate.push(part.to_string());
            match self.nodes.get(&candidate) {
                Some(Node::Symlink(target)) if !last || follow_last => {
                    at = self.resolve(&at, target, true, depth + 1)?;
                }
                _ => at = candidate,
            }
        }
        Ok(at)
    }

    fn entry(&mut self, kind: EntryType, path: &str, link: Option<&str>) -> Result<(), Escape> {
        let at = self.resolve(&[], path, false, 0)?;
        if at.is_empty() {
            // The root itself: an extractor cannot replace it.
            return Ok(());
        }
        let dir = &at[..at.len() - 1];
        let node = match kind {
            EntryType::Regular | EntryType::Continuous => Node::File,
            EntryType::Directory => Node::Dir,
            EntryType::Symlink => {
                let target = link.ok_or_else(|| Escape("symlink without target".into()))?;
                // Where the link would lead must stay inside.
                self.resolve(dir, target, true, 1)
                    .map_err(|e| Escape(format!("symlink {path:?} -> {target:?}: {}", e.0)))?;
                Node::Symlink(target.to_string())
            }
            EntryType::Link => {
                let target = link.ok_or_else(|| Escape("hardlink without target".into()))?;
                // link(2) resolves the target from the root without following
                // its last component: a hardlink to a symlink is that symlink.
                let source = self
                    .resolve(&[], target, false, 0)
                    .map_err(|e| Escape(format!("hardlink {path:?} -> {target:?}: {}", e.0)))?;
                match self.nodes.get(&source).cloned() {
                    Some(Node::Symlink(t)) => {
                        self.resolve(dir, &t, true, 1).map_err(|e| {
                            Escape(format!(
                                "hardlink {path:?} -> symlink {target:?} -> {t:?}: {}",
                                e.0
                            ))
                        })?;
                        Node::Symlink(t)
                    }
                    _ => Node::File,
                }
            }
            other => return Err(Escape(format!("entry type {other:?} passed"))),
        };
        match (self.nodes.get(&at), &node) {
            // mkdir over an existing directory or a symlink to one keeps it.
            (Some(Node::Dir | Node::Symlink(_)), Node::Dir) => {}
            _ => {
                self.nodes.insert(at, node);
            }
        }
        Ok(())
    }
}

fn with_checksums(data: &[u8]) -> Vec<u8> {
    let mut out = data.to_vec();
    for block in out.chunks_exact_mut(512) {
        if block.iter().all(|&b| b == 0) {
            continue;
        }
        block[148..156].fill(b' ');
        let sum: u32 = block.iter().map(|&b| u32::from(b)).sum();
        block[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
    }
    out
}

fn is_entry(kind: EntryType) -> bool {
    matches!(
        kind,
        EntryType::Regular
            | EntryType::Continuous
            | EntryType::Directory
            | EntryType::Symlink
            | EntryType::Link
            | EntryType::Char
            | EntryType::Block
            | EntryType::Fifo
            | EntryType::GNUSparse
    )
}

fuzz_target!(|input: &[u8]| {
    // First byte: a chunk size for the streamed scan, and (bit 7) whether to
    // fix the checksum of every non-zero 512-byte block first, so mutations
    // of header fields get past the checksum check.
    let Some((&chunk, data)) = input.split_first() else {
        return;
    };
    let fixed;
    let data = if chunk & 0x80 != 0 {
        fixed = with_checksums(data);
        &fixed[..]
    } else {
        data
    };
    let whole = scan_chunked(data, data.len());
    let chunked = scan_chunked(data, usize::from(chunk % 64) + 1);
    assert_eq!(
        whole.as_ref().ok(),
        chunked.as_ref().ok(),
        "verdict depends on chunking: {whole:?} vs {chunked:?}"
    );
    let Ok(summary) = whole else {
        return;
    };
    assert!(summary.archive_bytes == data.len() as u64);

    // Passed: extract it on the model, as the tar crate sees it.
    let mut archive = tar::Archive::new(data);
    let Ok(entries) = archive.entries() else {
        return;
    };
    let mut model = Model::default();
    let mut count = 0u64;
    let mut complete = true;
    for entry in entries {
        let Ok(mut entry) = entry else {
            complete = false;
            break;
        };
        let kind = entry.header().entry_type();
        if !is_entry(kind) {
            continue;
        }
        count += 1;
        // The tar crate keeps all but one trailing NUL of a GNU long name
        // (and then fails to create the file); GNU tar stops at the first
        // NUL, as the scanner does: judge what precedes it.
        let text = |b: &[u8]| {
            let b = b.split(|&c| c == 0).next().unwrap_or_default();
            String::from_utf8_lossy(b).into_owned()
        };
        let path = text(&entry.path_bytes());
        let link = entry.link_name_bytes().map(|l| text(&l));
        if let Err(Escape(why)) = model.entry(kind, &path, link.as_deref()) {
            if why.ends_with(LOOP) {
                complete = false;
                break;
            }
            panic!("the scanner passed an unsafe archive: entry {path:?}: {why}");
        }
        // Drain the data the way an extractor does.
        let mut sink = Vec::new();
        if entry.read_to_end(&mut sink).is_err() {
            complete = false;
            break;
        }
    }
    if complete {
        assert!(
            count <= summary.entries,
            "the tar crate saw {count} entries, the scanner checked {}",
            summary.entries
        );
    }
});
