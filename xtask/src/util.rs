//! Small helpers shared by every subcommand: paths, running commands, timing.

use std::ffi::OsStr;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// Default for `HARNESS_CACHE`: everything slow to make is kept here, outside
/// the clone, so a later run on the same machine reuses it.
pub const DEFAULT_CACHE: &str = "/var/cache/harness";

/// `$HARNESS_CACHE`, or [`DEFAULT_CACHE`].
pub fn cache_dir() -> PathBuf {
    match std::env::var_os("HARNESS_CACHE") {
        Some(v) if !v.is_empty() => PathBuf::from(v),
        _ => PathBuf::from(DEFAULT_CACHE),
    }
}

/// `$HARNESS_CACHE/<sub>`, created if missing.
pub fn cache_subdir(sub: &str) -> Result<PathBuf> {
    let dir = cache_dir().join(sub);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir)
}

/// Every `.rs` file under `roots`, walked depth-first (the tidy checks
/// read sources without a build).
pub fn rust_files(roots: Vec<PathBuf>) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    let mut dirs = roots;
    while let Some(dir) = dirs.pop() {
        for entry in
            std::fs::read_dir(&dir).with_context(|| format!("listing {}", dir.display()))?
        {
            let path = entry?.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                files.push(path);
            }
        }
    }
    files.sort();
    Ok(files)
}

/// The workspace root (the parent of `xtask/`). Read at run time: `cargo
/// run` sets `CARGO_MANIFEST_DIR` for the checkout it runs in, while the
/// value baked in at build time names whichever checkout built this binary
/// (another clone sharing the cached target directory would otherwise run
/// its own sources).
/// [`forget_cargo_run_env`] hands it on to the xtask processes this one
/// starts as `HARNESS_XTASK_ROOT`.
pub fn repo_root() -> PathBuf {
    if let Some(root) = std::env::var_os(XTASK_ROOT) {
        return PathBuf::from(root);
    }
    let manifest_dir = std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")));
    Path::new(&manifest_dir)
        .parent()
        .expect("xtask lives one level below the workspace root")
        .to_path_buf()
}

/// The workspace root, as the first xtask process of a command found it.
const XTASK_ROOT: &str = "HARNESS_XTASK_ROOT";

/// Take out of this process's environment what `cargo run` (so `cargo
/// xtask`) set for the xtask binary itself — `CARGO_MANIFEST_DIR`,
/// `CARGO_PKG_*`, `CARGO_CRATE_NAME`… — keeping the workspace root as
/// `HARNESS_XTASK_ROOT` for [`repo_root`].
///
/// Every cargo the xtask runs inherited them, and a build script that reads
/// one is rerun when its value changes: ring's reads `CARGO_MANIFEST_DIR`
/// and `CARGO_PKG_NAME` through `rerun-if-env-changed`, so a CI run from
/// another clone's path (`/tmp/freshM/xtask` after `/tmp/freshL/xtask`), or
/// a `cargo clippy` typed by hand after `cargo xtask ci`, rebuilt ring and
/// everything above it — rustls, reqwest, tonic, the Temporal SDK and most
/// workspace crates, in clippy and again in the tests (warm run L's test
/// build: 4m20s).
pub fn forget_cargo_run_env() {
    if std::env::var_os(XTASK_ROOT).is_none() {
        std::env::set_var(XTASK_ROOT, repo_root());
    }
    let set_by_cargo_run = |key: &str| {
        key.starts_with("CARGO_PKG_")
            || key.starts_with("CARGO_MANIFEST_")
            || matches!(
                key,
                "CARGO_CRATE_NAME" | "CARGO_BIN_NAME" | "CARGO_PRIMARY_PACKAGE" | "OUT_DIR"
            )
    };
    let keys: Vec<_> = std::env::vars_os()
        .filter_map(|(key, _)| key.into_string().ok())
        .filter(|key| set_by_cargo_run(key))
        .collect();
    for key in keys {
        std::env::remove_var(key);
    }
}

/// True when running under CI (`CI=true`, as CI sets it).
pub fn is_ci() -> bool {
    matches!(
        std::env::var("CI").ok().as_deref(),
        Some("true") | Some("1") | Some("TRUE") | Some("True")
    )
}

/// The target dir every cargo invocation of ours uses: `$HARNESS_CACHE/target`
/// under CI or when `CARGO_TARGET_DIR` is unset; otherwise the caller's.
pub fn cargo_target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(v) if !v.is_empty() && !is_ci() => PathBuf::from(v),
        _ => cache_dir().join("target"),
    }
}

/// A `cargo` command run at the repo root with our target dir. Under CI
/// builds are not incremental: a CI build compiles each workspace crate
/// once, and the incremental state it would leave (7 GB for this
/// workspace's tests) only fills the cache's disk.
pub fn cargo() -> Command {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(repo_root())
        .env("CARGO_TARGET_DIR", cargo_target_dir());
    if is_ci() {
        cmd.env("CARGO_INCREMENTAL", "0");
    }
    cmd
}

/// Render a command for logs: `$ prog arg arg`.
pub fn display(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for a in cmd.get_args() {
        s.push(' ');
        let a = a.to_string_lossy();
        if a.is_empty() || a.contains(char::is_whitespace) {
            s.push_str(&format!("'{a}'"));
        } else {
            s.push_str(&a);
        }
    }
    s
}

/// The system's CA bundle (Debian's `ca-certificates`).
const SYSTEM_CA_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";

/// Make every Node program xtask starts — `npm` installs, and the tests
/// and benchmarks that install npm packages themselves — trust the
/// system's CA bundle as well as Node's own. Node ships its own list and
/// ignores the system store, so behind a registry proxy whose CA only the
/// system trusts every install fails with `SELF_SIGNED_CERT_IN_CHAIN`.
/// `NODE_EXTRA_CA_CERTS` adds the bundle (it never removes a CA); one the
/// caller set is kept. Called first thing in `main`, while xtask has one
/// thread.
pub fn trust_system_cas_in_node() {
    if std::env::var_os("NODE_EXTRA_CA_CERTS").is_none() && Path::new(SYSTEM_CA_BUNDLE).exists() {
        std::env::set_var("NODE_EXTRA_CA_CERTS", SYSTEM_CA_BUNDLE);
    }
}

/// `cmd` under the idle scheduling classes (`chrt --idle 0`, `ionice -c 3`,
/// inherited by everything it starts), where util-linux has the tools;
/// `cmd` as it is otherwise: still correct, only less polite to the work
/// beside it.
pub fn idle_priority(cmd: Command) -> Command {
    if which("chrt").is_none() || which("ionice").is_none() {
        return cmd;
    }
    let mut wrapped = Command::new("chrt");
    wrapped
        .args(["--idle", "0", "ionice", "-c", "3"])
        .arg(cmd.get_program())
        .args(cmd.get_args());
    for (key, value) in cmd.get_envs() {
        match value {
            Some(value) => wrapped.env(key, value),
            None => wrapped.env_remove(key),
        };
    }
    wrapped
}

/// SIGKILL the process group `leader` started (with `process_group(0)`):
/// the cargo and rustc processes under it go too. Best effort.
pub fn kill_group(leader: u32) {
    let _ = Command::new("kill")
        .args(["-KILL", "--", &format!("-{leader}")])
        .status();
}

/// Run a command with inherited stdio; error if it fails.
pub fn run(cmd: &mut Command) -> Result<()> {
    println!("$ {}", display(cmd));
    let status = cmd
        .status()
        .with_context(|| format!("could not start `{}`", display(cmd)))?;
    if !status.success() {
        bail!("`{}` failed ({status})", display(cmd));
    }
    Ok(())
}

/// Run a command quietly; true if it exited 0. Never errors.
pub fn succeeds(cmd: &mut Command) -> bool {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

/// Run a command and capture its stdout (stderr inherited); error if it fails.
pub fn output(cmd: &mut Command) -> Result<String> {
    let out = cmd
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("could not start `{}`", display(cmd)))?;
    if !out.status.success() {
        bail!("`{}` failed ({})", display(cmd), out.status);
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Find an executable on `PATH`.
pub fn which(name: impl AsRef<OsStr>) -> Option<PathBuf> {
    let name = name.as_ref();
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| is_executable(p))
}

pub fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p)
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

/// True if `p` starts with the ELF magic (a native executable, not a script).
pub fn is_elf(p: &Path) -> bool {
    let mut magic = [0u8; 4];
    std::fs::File::open(p)
        .and_then(|mut f| f.read_exact(&mut magic))
        .map(|_| magic == *b"\x7fELF")
        .unwrap_or(false)
}

/// True if something accepts a TCP connection on `addr` within 500 ms.
pub fn tcp_answers(addr: &str) -> bool {
    let Ok(addr) = addr.parse::<SocketAddr>() else {
        return false;
    };
    TcpStream::connect_timeout(&addr, Duration::from_millis(500)).is_ok()
}

/// True if an HTTP server on `addr` answers `GET /` with any status line.
pub fn http_answers(addr: &str) -> bool {
    let Ok(sock) = addr.parse::<SocketAddr>() else {
        return false;
    };
    let Ok(mut s) = TcpStream::connect_timeout(&sock, Duration::from_millis(500)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    let _ = s.set_write_timeout(Some(Duration::from_secs(2)));
    let req = format!("GET / HTTP/1.0\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    if s.write_all(req.as_bytes()).is_err() {
        return false;
    }
    let mut buf = [0u8; 5];
    s.read_exact(&mut buf).is_ok() && &buf == b"HTTP/"
}

/// Poll `ready` every 250 ms until it is true or `timeout` passes.
pub fn wait_until(timeout: Duration, mut ready: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    loop {
        if ready() {
            return true;
        }
        if start.elapsed() >= timeout {
            return false;
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// `12.3s` / `2m03s`.
pub fn fmt_duration(d: Duration) -> String {
    let secs = d.as_secs_f64();
    if secs < 60.0 {
        format!("{secs:.1}s")
    } else {
        let s = d.as_secs();
        format!("{}m{:02}s", s / 60, s % 60)
    }
}

/// Run `f` between a header line and a footer line with its duration.
pub fn timed<T>(title: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    println!("==> {title}");
    let start = Instant::now();
    let res = f();
    let took = fmt_duration(start.elapsed());
    match &res {
        Ok(_) => println!("<== {title}: ok ({took})"),
        Err(e) => println!("<== {title}: FAILED ({took}): {e:#}"),
    }
    res
}

/// FNV-1a 64-bit: a stable hash for cache keys (no dependency needed).
pub fn stable_hash(data: &str) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in data.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{h:016x}")
}

/// `npm install` of `specs` (space-separated `name@version`) into
/// `root/node_modules`, leaving no package.json behind.
pub fn npm_install(root: &Path, specs: &str) -> Result<()> {
    std::fs::create_dir_all(root).with_context(|| format!("creating {}", root.display()))?;
    run(Command::new("npm")
        .current_dir(root)
        .args([
            "install",
            "--no-audit",
            "--no-fund",
            "--no-save",
            "--prefix",
            ".",
        ])
        .args(specs.split_whitespace())
        // wrangler's install would otherwise ask to send metrics.
        .env("WRANGLER_SEND_METRICS", "false"))
    .with_context(|| format!("npm install {specs} (is npm installed and the registry reachable?)"))
}
