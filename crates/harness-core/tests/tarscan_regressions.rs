//! Archives the fuzz target `fuzz/fuzz_targets/tarscan.rs` found the scanner
//! passing although their extraction leaves the target (docs/fuzzing.md).

use harness_core::tarscan::TarScanner;
use harness_core::ErrorKind;
use tar::{EntryType, Header};

fn entry(out: &mut Vec<u8>, path: &str, kind: EntryType, link: Option<&str>) {
    let mut h = Header::new_gnu();
    h.set_path(path).unwrap();
    h.set_entry_type(kind);
    h.set_size(0);
    h.set_mode(if kind == EntryType::Directory {
        0o755
    } else {
        0o644
    });
    if let Some(link) = link {
        h.set_link_name(link).unwrap();
    }
    h.set_cksum();
    out.extend_from_slice(h.as_bytes());
}

fn scan(entries: &[(&str, EntryType, Option<&str>)]) -> harness_core::Result<()> {
    let mut tar = Vec::new();
    for (path, kind, link) in entries {
        entry(&mut tar, path, *kind, *link);
    }
    tar.extend_from_slice(&[0u8; 1024]);
    let mut scanner = TarScanner::new();
    scanner.push(&tar)?;
    scanner.finish().map(|_| ())
}

#[test]
fn a_hardlink_to_a_symlink_of_the_archive_is_refused() {
    // `d/s -> ..` is the root, but the hardlink `h` is that symlink again at
    // the root, where `..` is above it: `h/x` would be written outside.
    let err = scan(&[
        ("d/", EntryType::Directory, None),
        ("d/s", EntryType::Symlink, Some("..")),
        ("h", EntryType::Link, Some("d/s")),
        ("h/x", EntryType::Regular, None),
    ])
    .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unsafe, "{err}");
    assert!(err.to_string().contains("refusing hardlink"), "{err}");
}

#[test]
fn a_hardlink_through_a_symlink_of_the_archive_is_refused() {
    let err = scan(&[
        ("d/", EntryType::Directory, None),
        ("s", EntryType::Symlink, Some("d")),
        ("h", EntryType::Link, Some("s/f")),
    ])
    .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unsafe, "{err}");
}

#[test]
fn a_hardlink_to_a_file_still_passes() {
    scan(&[
        ("d/", EntryType::Directory, None),
        ("d/f", EntryType::Regular, None),
        ("h", EntryType::Link, Some("d/f")),
    ])
    .unwrap();
}
