//! Streaming single-file tar helpers for the archive endpoints.
//!
//! Docker's `GET /containers/{id}/archive` answers a tar holding the path's
//! own entry; for a regular file that is one header and the file's bytes.
//! [`open_single_entry`] parses the header (and any GNU long-name or PAX
//! extension before it) and passes the body through without buffering it.
//! [`header_blocks`] builds the header blocks for an upload whose body is
//! streamed after them.

use bytes::{Bytes, BytesMut};
use futures::StreamExt;
use harness_core::stream::ByteStream;
use harness_core::{Error, Result};
use tar::{EntryType, Header};

const BLOCK: usize = 512;
/// Largest extension record (long name, PAX) we buffer.
const MAX_EXTENSION: u64 = 1024 * 1024;

/// What the archive's first real entry is.
pub(crate) enum SingleEntry {
    /// A regular file: its content as a stream.
    File(ByteStream),
    /// A symbolic link and its target.
    Symlink(String),
    /// Anything else (directory, device, …), by its type.
    Other(EntryType),
}

impl std::fmt::Debug for SingleEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SingleEntry::File(_) => f.write_str("File(..)"),
            SingleEntry::Symlink(t) => write!(f, "Symlink({t:?})"),
            SingleEntry::Other(t) => write!(f, "Other({t:?})"),
        }
    }
}

struct Reader {
    inner: ByteStream,
    buf: BytesMut,
}

impl Reader {
    /// Ensure at least `n` bytes are buffered; false at a clean end of input.
    async fn fill(&mut self, n: usize) -> Result<bool> {
        while self.buf.len() < n {
            match self.inner.next().await {
                Some(chunk) => self.buf.extend_from_slice(&chunk?),
                None => return Ok(false),
            }
        }
        Ok(true)
    }

    async fn take_exact(&mut self, n: usize, what: &str) -> Result<Bytes> {
        if !self.fill(n).await? {
            return Err(Error::corrupt(format!("archive ended inside {what}")));
        }
        Ok(self.buf.split_to(n).freeze())
    }
}

fn padded(size: u64) -> u64 {
    size.div_ceil(BLOCK as u64) * BLOCK as u64
}

/// Parse the first entry of a tar stream. A regular file's body is streamed
/// lazily; nothing after it is read.
pub(crate) async fn open_single_entry(stream: ByteStream) -> Result<SingleEntry> {
    let mut r = Reader {
        inner: stream,
        buf: BytesMut::new(),
    };
    let mut pax_size: Option<u64> = None;
    let mut long_link: Option<String> = None;
    loop {
        let block = r.take_exact(BLOCK, "a header").await?;
        if block.iter().all(|b| *b == 0) {
            return Err(Error::corrupt("archive holds no entry"));
        }
        let header = Header::from_byte_slice(&block);
        let size = header
            .entry_size()
            .map_err(|e| Error::corrupt(format!("bad tar header size: {e}")))?;
        let kind = header.entry_type();
        match kind {
            EntryType::XHeader
            | EntryType::XGlobalHeader
            | EntryType::GNULongName
            | EntryType::GNULongLink => {
                if size > MAX_EXTENSION {
                    return Err(Error::corrupt(format!(
                        "tar extension of {size} bytes is over the {MAX_EXTENSION}-byte limit"
                    )));
                }
                let data = r.take_exact(padded(size) as usize, "an extension").await?;
                let data = &data[..size as usize];
                if kind == EntryType::XHeader {
                    for rec in tar::PaxExtensions::new(data).flatten() {
                        match rec.key() {
                            Ok("size") => {
                                pax_size = rec.value().ok().and_then(|v| v.parse().ok());
                            }
                            Ok("linkpath") => {
                                long_link = rec.value().ok().map(str::to_string);
                            }
                            _ => {}
                        }
                    }
                } else if kind == EntryType::GNULongLink {
                    let text = String::from_utf8_lossy(data);
                    long_link = Some(text.trim_end_matches('\0').to_string());
                }
            }
            EntryType::Regular | EntryType::Continuous => {
                let size = pax_size.unwrap_or(size);
                return Ok(SingleEntry::File(body_stream(r, size)));
            }
            EntryType::Symlink => {
                let target = match long_link {
                    Some(t) => t,
                    None => header
                        .link_name()
                        .ok()
                        .flatten()
                        .map(|p| p.to_string_lossy().into_owned())
                        .unwrap_or_default(),
                };
                return Ok(SingleEntry::Symlink(target));
            }
            other => return Ok(SingleEntry::Other(other)),
        }
    }
}

/// Pass exactly `size` bytes through, then stop reading.
fn body_stream(reader: Reader, size: u64) -> ByteStream {
    Box::pin(futures::stream::unfold(
        Some((reader, size)),
        |state| async move {
            let (mut r, remaining) = state?;
            if remaining == 0 {
                return None;
            }
            if r.buf.is_empty() {
                match r.inner.next().await {
                    Some(Ok(chunk)) => r.buf.extend_from_slice(&chunk),
                    Some(Err(e)) => return Some((Err(e), None)),
                    None => {
                        return Some((
                            Err(Error::corrupt(format!(
                                "archive ended with {remaining} bytes of the file missing"
                            ))),
                            None,
                        ))
                    }
                }
            }
            let n = (r.buf.len() as u64).min(remaining) as usize;
            let chunk = r.buf.split_to(n).freeze();
            // Keep the buffer from pinning a large allocation once drained.
            if r.buf.is_empty() {
                r.buf = BytesMut::new();
            }
            Some((Ok(chunk), Some((r, remaining - n as u64))))
        },
    ))
}

/// The header block(s) for one regular file of `size` bytes at `path`
/// (relative, long names allowed), with mode `mode`; the caller streams
/// `size` bytes of body, then [`trailer`].
pub(crate) fn header_blocks(path: &str, size: u64, mode: u32) -> Result<Bytes> {
    let mut header = Header::new_gnu();
    header.set_entry_type(EntryType::Regular);
    header.set_size(size);
    header.set_mode(mode);
    header.set_uid(0);
    header.set_gid(0);
    header.set_mtime(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
    );
    let mut builder = tar::Builder::new(Vec::new());
    // `append_data` writes the header (plus a GNU long-name entry when the
    // path needs one) and then copies the data: with an empty reader only
    // the header blocks are written, and no padding, since none was copied.
    builder
        .append_data(&mut header, path, std::io::empty())
        .map_err(|e| Error::invalid(format!("cannot put {path:?} in a tar header: {e}")))?;
    // Take the bytes out before the builder's drop appends its end marker.
    let bytes = std::mem::take(builder.get_mut());
    Ok(Bytes::from(bytes))
}

/// Padding after a body of `size` bytes plus the end-of-archive marker.
pub(crate) fn trailer(size: u64) -> Bytes {
    let pad = (padded(size) - size) as usize;
    Bytes::from(vec![0u8; pad + 2 * BLOCK])
}

/// A whole one-file archive for small content held in memory.
pub(crate) fn small_archive(path: &str, content: Bytes, mode: u32) -> Result<Bytes> {
    let head = header_blocks(path, content.len() as u64, mode)?;
    let tail = trailer(content.len() as u64);
    let mut out = BytesMut::with_capacity(head.len() + content.len() + tail.len());
    out.extend_from_slice(&head);
    out.extend_from_slice(&content);
    out.extend_from_slice(&tail);
    Ok(out.freeze())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunks(data: Bytes, size: usize) -> ByteStream {
        let parts: Vec<Result<Bytes>> = data
            .chunks(size)
            .map(|c| Ok(Bytes::copy_from_slice(c)))
            .collect();
        Box::pin(futures::stream::iter(parts))
    }

    async fn read_all(s: ByteStream) -> Vec<u8> {
        let mut out = Vec::new();
        let mut s = s;
        while let Some(c) = s.next().await {
            out.extend_from_slice(&c.unwrap());
        }
        out
    }

    #[tokio::test]
    async fn round_trips_a_file_with_a_long_name_in_odd_chunks() {
        let name = format!("{}/file.txt", "d".repeat(150));
        let body: Vec<u8> = (0..5000u32).map(|i| (i % 251) as u8).collect();
        let archive = small_archive(&name, Bytes::from(body.clone()), 0o644).unwrap();
        // The real tar crate reads what we wrote.
        let mut ar = tar::Archive::new(&archive[..]);
        let entry = ar.entries().unwrap().next().unwrap().unwrap();
        assert_eq!(entry.path().unwrap().to_string_lossy(), name);

        for chunk in [1, 7, 512, 4096] {
            match open_single_entry(chunks(archive.clone(), chunk))
                .await
                .unwrap()
            {
                SingleEntry::File(s) => assert_eq!(read_all(s).await, body),
                other => panic!("expected a file, got {other:?}"),
            }
        }
    }

    #[tokio::test]
    async fn truncated_body_is_an_error_not_a_short_file() {
        let archive = small_archive("f", Bytes::from(vec![1u8; 2000]), 0o644).unwrap();
        let cut = archive.slice(..512 + 1000);
        let SingleEntry::File(mut s) = open_single_entry(chunks(cut, 300)).await.unwrap() else {
            panic!("expected a file");
        };
        let mut got = 0;
        let mut failed = false;
        while let Some(c) = s.next().await {
            match c {
                Ok(c) => got += c.len(),
                Err(e) => {
                    failed = true;
                    assert_eq!(e.kind(), harness_core::ErrorKind::Corrupt);
                }
            }
        }
        assert!(failed, "a truncated archive must fail");
        assert_eq!(got, 1000);
    }

    #[tokio::test]
    async fn directories_and_symlinks_are_reported() {
        let mut b = tar::Builder::new(Vec::new());
        let mut h = Header::new_gnu();
        h.set_entry_type(EntryType::Symlink);
        h.set_size(0);
        b.append_link(&mut h, "l", "../target").unwrap();
        let data = Bytes::from(b.into_inner().unwrap());
        match open_single_entry(chunks(data, 100)).await.unwrap() {
            SingleEntry::Symlink(t) => assert_eq!(t, "../target"),
            other => panic!("expected a symlink, got {other:?}"),
        }
        let mut b = tar::Builder::new(Vec::new());
        let mut h = Header::new_gnu();
        h.set_entry_type(EntryType::Directory);
        h.set_size(0);
        b.append_data(&mut h, "d/", std::io::empty()).unwrap();
        let data = Bytes::from(b.into_inner().unwrap());
        assert!(matches!(
            open_single_entry(chunks(data, 100)).await.unwrap(),
            SingleEntry::Other(EntryType::Directory)
        ));
    }

    #[test]
    fn trailer_pads_to_a_block() {
        assert_eq!(trailer(1).len(), 511 + 1024);
        assert_eq!(trailer(512).len(), 1024);
    }
}
