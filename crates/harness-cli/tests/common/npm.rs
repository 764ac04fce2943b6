//! npm packages of this repository in tests: Node 22, a package's
//! dependencies installed once per lockfile into the cache, commands run
//! with their output in the panic.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use harness_testkit::skip_or_fail;

/// Node 22, or a skip.
pub fn node22() -> Option<PathBuf> {
    let bin = std::env::var_os("HARNESS_NODE22")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| cache_dir().join("tools/node22/bin/node"));
    if bin.is_file() {
        Some(bin)
    } else {
        skip_or_fail(&format!(
            "no Node 22 at {} (cargo xtask deps installs it)",
            bin.display()
        ));
        None
    }
}

pub fn cache_dir() -> PathBuf {
    std::env::var_os("HARNESS_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir)
}

pub fn run(cmd: &mut Command, what: &str) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("{what} does not start: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// The dependencies of the npm package in `package` (its `package.json`
/// and `package-lock.json`), installed once per lockfile into
/// `$HARNESS_CACHE/npm/<name>-<hash>` (one install at a time in this
/// process; processes racing each install into a directory of their own,
/// and the first rename wins).
pub fn node_modules(package: &Path, name: &str) -> Option<PathBuf> {
    use sha2::Digest;
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let lock = std::fs::read(package.join("package-lock.json")).unwrap();
    let hash = hex::encode(sha2::Sha256::digest(&lock));
    let dir = cache_dir()
        .join("npm")
        .join(format!("{name}-{}", &hash[..12]));
    // Written last, before the directory takes its name: a directory
    // without it is no install.
    let done = ".harness-complete";
    // One install at a time across processes too (nextest runs each test
    // in its own): the others wait for it rather than download again. A
    // lock left by a killed install is taken over after 10 minutes.
    let claim = cache_dir()
        .join("npm")
        .join(format!(".{name}-{}.installing", &hash[..12]));
    let started = Instant::now();
    loop {
        if dir.join(done).is_file() {
            return Some(dir.join("node_modules"));
        }
        std::fs::create_dir_all(cache_dir().join("npm")).unwrap();
        if std::fs::create_dir(&claim).is_ok() {
            break;
        }
        let stale = std::fs::metadata(&claim)
            .and_then(|m| m.modified())
            .map(|t| t.elapsed().unwrap_or_default() > Duration::from_secs(600))
            .unwrap_or(false);
        if stale {
            let _ = std::fs::remove_dir(&claim);
        } else if started.elapsed() > Duration::from_secs(600) {
            skip_or_fail(&format!(
                "another process has been installing {}'s dependencies for 10 minutes",
                package.display()
            ));
            return None;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    let installed = install_node_modules(package, name, &dir, &hash, done);
    let _ = std::fs::remove_dir(&claim);
    installed
}

/// `npm ci` into a directory of its own, then renamed to `dir`.
fn install_node_modules(
    package: &Path,
    name: &str,
    dir: &Path,
    hash: &str,
    done: &str,
) -> Option<PathBuf> {
    let tmp = cache_dir().join("npm").join(format!(
        ".{name}-{}-{}",
        &hash[..12],
        uuid::Uuid::new_v4().simple()
    ));
    std::fs::create_dir_all(&tmp).unwrap();
    for file in ["package.json", "package-lock.json"] {
        std::fs::copy(package.join(file), tmp.join(file)).unwrap();
    }
    let out = Command::new("npm")
        .args(["ci", "--no-audit", "--no-fund", "--ignore-scripts"])
        .current_dir(&tmp)
        .env("NODE_EXTRA_CA_CERTS", "/etc/ssl/certs/ca-certificates.crt")
        .output();
    match out {
        Ok(o) if o.status.success() => {}
        other => {
            let _ = std::fs::remove_dir_all(&tmp);
            skip_or_fail(&format!(
                "npm ci of {} failed: {other:?}",
                package.display()
            ));
            return None;
        }
    }
    std::fs::write(tmp.join(done), "").unwrap();
    if dir.exists() && !dir.join(done).is_file() {
        // A directory left by an install that did not finish.
        let _ = std::fs::remove_dir_all(dir);
    }
    // Another process may have finished first: either copy is whole.
    if std::fs::rename(&tmp, dir).is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    Some(dir.join("node_modules"))
}
