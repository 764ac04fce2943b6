//! Listing the tree in the sandbox: natively where the provider can, else
//! with GNU `find`; and the sandbox's clock.

use harness_core::sandbox::{collect_exec, shell_quote, ExecRequest, ListedEntry, Sandbox};
use harness_core::{Error, ErrorKind, Result};

/// The sandbox has no GNU `find`/`tar` (listing falls back to reading all).
const EXIT_NO_GNU_TOOLS: i32 = 45;
/// The listed directory does not exist.
const EXIT_NO_DIR: i32 = 44;

/// A directory as [`list_tree`] found it.
pub(super) enum Listing {
    /// Its entries, and the sandbox's clock (seconds) as it was listed.
    Listed { now: u64, entries: Vec<ListedEntry> },
    /// No such directory.
    Missing,
    /// Not listable (no GNU `find` and `tar`): the tree is read whole.
    Unsupported,
}

/// List `dir`: natively where the provider can
/// ([`Sandbox::list_tree`]), else with GNU `find` inside the sandbox.
pub(super) async fn list_tree(sandbox: &dyn Sandbox, dir: &str) -> Result<Listing> {
    let mut listing = match sandbox.list_tree(dir).await {
        Ok(listing) => Listing::Listed {
            now: listing.now_secs,
            entries: listing.entries,
        },
        Err(e) if e.kind() == ErrorKind::NotFound => Listing::Missing,
        Err(e) if e.kind() == ErrorKind::Unsupported => find_tree(sandbox, dir).await?,
        Err(e) => return Err(e),
    };
    // In path order, as manifests are: checkpoint and restore pair the
    // two in one pass. One pass here too when the sandbox answered in
    // that order (the local one does).
    if let Listing::Listed { entries, .. } = &mut listing {
        entries.sort_unstable_by(|a, b| a.path.cmp(&b.path));
    }
    Ok(listing)
}

/// List `dir` inside the sandbox with GNU `find`.
async fn find_tree(sandbox: &dyn Sandbox, dir: &str) -> Result<Listing> {
    let script = format!(
        "cd {d} 2>/dev/null || exit {EXIT_NO_DIR}; \
         {{ find . -maxdepth 0 -printf '' && tar --version | grep -q 'GNU tar'; }} >/dev/null 2>&1 || exit {EXIT_NO_GNU_TOOLS}; \
         date +%s; exec find . -mindepth 1 -printf '%y %m %s %T@ %i %C@ %P\\0%l\\0'",
        d = shell_quote(dir)
    );
    let out = collect_exec(sandbox.exec(ExecRequest::shell(script)).await?).await?;
    match out.status.code {
        Some(0) => {}
        Some(EXIT_NO_DIR) => return Ok(Listing::Missing),
        Some(EXIT_NO_GNU_TOOLS) => return Ok(Listing::Unsupported),
        _ => {
            let status = out.status;
            return Err(out
                .check(&format!("listing {dir}"))
                .err()
                .unwrap_or_else(|| {
                    Error::backend(format!("listing {dir}: unexpected exit {status:?}"))
                }));
        }
    }
    let text = &out.stdout[..];
    let newline = text
        .iter()
        .position(|&b| b == b'\n')
        .ok_or_else(|| Error::backend(format!("listing {dir}: no clock reading")))?;
    let now = std::str::from_utf8(&text[..newline])
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .ok_or_else(|| Error::backend(format!("listing {dir}: unreadable clock")))?;
    let mut fields = text[newline + 1..].split(|&b| b == 0);
    let mut entries = Vec::new();
    let bad = || Error::backend(format!("listing {dir}: unreadable find output"));
    while let Some(record) = fields.next() {
        if record.is_empty() {
            break;
        }
        let link = fields.next().ok_or_else(bad)?;
        let record = std::str::from_utf8(record)
            .map_err(|_| Error::unsafe_entry(format!("a path under {dir} is not UTF-8")))?;
        let mut parts = record.splitn(7, ' ');
        let mut next = || parts.next().ok_or_else(bad);
        let kind = next()?.chars().next().ok_or_else(bad)?;
        let mode = u32::from_str_radix(next()?, 8).map_err(|_| bad())?;
        let size = next()?.parse::<u64>().map_err(|_| bad())?;
        let mtime = next()?
            .split('.')
            .next()
            .and_then(|s| s.parse::<u64>().ok())
            .ok_or_else(bad)?;
        let ino = next()?.parse::<u64>().map_err(|_| bad())?;
        let ctime_ns = nanos(next()?).ok_or_else(bad)?;
        let path = next()?.to_string();
        entries.push(ListedEntry {
            kind,
            mode,
            size,
            mtime,
            ino,
            ctime_ns,
            path,
            link: String::from_utf8_lossy(link).into_owned(),
        });
    }
    Ok(Listing::Listed { now, entries })
}

/// `find`'s `%C@` (seconds, a dot, a fraction) as nanoseconds.
fn nanos(text: &str) -> Option<u64> {
    let (secs, frac) = text.split_once('.').unwrap_or((text, ""));
    if !frac.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let secs = secs.parse::<u64>().ok()?;
    let frac = frac.as_bytes();
    let ns = (0..9).fold(0u64, |ns, i| {
        ns * 10 + u64::from(frac.get(i).copied().unwrap_or(b'0') - b'0')
    });
    secs.checked_mul(1_000_000_000)?.checked_add(ns)
}

/// The sandbox's clock, in seconds.
pub(super) async fn sandbox_now(sandbox: &dyn Sandbox) -> Result<u64> {
    let out = collect_exec(sandbox.exec(ExecRequest::shell("date +%s")).await?)
        .await?
        .check("reading the sandbox's clock")?;
    out.stdout_str()
        .trim()
        .parse()
        .map_err(|_| Error::backend("the sandbox's `date +%s` is not a number"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn find_times_read_as_nanoseconds() {
        assert_eq!(
            nanos("1796144891.1234567890"),
            Some(1_796_144_891_123_456_789)
        );
        assert_eq!(nanos("12.5"), Some(12_500_000_000));
        assert_eq!(nanos("12"), Some(12_000_000_000));
        assert_eq!(nanos("12.x"), None);
        assert_eq!(nanos("-1.0"), None);
    }
}
