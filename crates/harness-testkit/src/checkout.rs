//! Where this checkout is, read when the test runs, not when it was built.
//!
//! `env!("CARGO_MANIFEST_DIR")` is the directory the crate was *compiled*
//! in. A cached target directory shared by several clones (CI's, and every
//! developer's worktrees) reuses a test binary built in another clone
//! without rebuilding it — cargo does not count the checkout's path as a
//! change — so a compiled-in path names that other clone: a README test
//! then reads another clone's README, or fails when that clone is gone.
//! `cargo test` and `cargo nextest` set `CARGO_MANIFEST_DIR` for every test
//! process to the package's directory in the checkout being tested; this
//! module reads that. (`cargo xtask layers` allows `env!("CARGO_MANIFEST_DIR")`
//! nowhere else in the workspace.)

use std::path::{Path, PathBuf};

/// The workspace root of the checkout under test: the nearest directory at
/// or above the running package's directory that holds `Cargo.lock`.
pub fn root() -> PathBuf {
    let package = package_dir();
    package
        .ancestors()
        .find(|dir| dir.join("Cargo.lock").is_file())
        .map(Path::to_path_buf)
        .unwrap_or_else(|| {
            panic!(
                "no Cargo.lock at or above {}: not inside the workspace",
                package.display()
            )
        })
}

/// `<root>/<relative>`: a file or directory of the checkout under test.
pub fn path(relative: &str) -> PathBuf {
    root().join(relative)
}

/// The running package's directory: `$CARGO_MANIFEST_DIR` as cargo set it
/// for this process, else (a binary started by hand) the one compiled in.
fn package_dir() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .filter(|dir| !dir.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_root_holds_the_workspace_and_its_crates() {
        let root = root();
        assert!(root.join("Cargo.lock").is_file());
        assert!(path("crates/harness-testkit/src/checkout.rs").is_file());
    }
}
