//! `wrangler dev` for tests: the built Cloudflare Worker — its test build
//! ([`test_build`], `cargo xtask worker build --test-routes`), or the deploy
//! build ([`deploy_build`], `cargo xtask worker build`) — served by workerd
//! on a loopback port, offline (`WRANGLER_SEND_METRICS=false
//! CLOUDFLARE_CF_FETCH_ENABLED=false CI=1`), its Durable Objects' state in
//! a fresh directory. Started with `setsid`, so wrangler, its esbuild and
//! workerd form one process group, which is stopped as a whole on drop.
//!
//! The wrangler executable is `$HARNESS_WRANGLER`, else the one `cargo
//! xtask worker deps` installs under `$HARNESS_CACHE/tools`.
//!
//! ## The nudge
//!
//! `wrangler dev` puts a proxy in front of the Worker: a Durable Object
//! (`ProxyWorker`) in a second workerd that forwards each request with
//! `fetch` and answers the client when that promise settles. Sometimes,
//! after a request the Worker took many seconds over (a checkpoint of an
//! 18 MB tree, while the inspector streams thousands of network events),
//! the settled answer is not written to the client until the proxy gets
//! another request: the Worker has logged `200 OK`, and the client waits
//! with nothing to read, for as long as no other request comes (seen: 16
//! minutes; one `curl` to the same port released it at once). That is
//! wrangler's local proxy, not the Worker, which production does not put
//! behind it. So while a `WranglerDev` lives, a thread sends
//! `GET /__ready` (404 from the Worker) every [`NUDGE_EVERY`]; the lines
//! those requests log are left out of [`WranglerDev::log`].

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::real::skip_or_fail;

/// The wrangler release `cargo xtask worker deps` installs.
pub const WRANGLER_VERSION: &str = "4.86.0";

/// How often the nudge (module docs) asks the proxy for `/__ready`: a
/// stalled answer waits at most this long. Not near 5 s, the keep-alive
/// timeout of workerd's HTTP client and server, so that a pooled connection
/// between the proxy and the Worker is never reused just as it is closed.
pub const NUDGE_EVERY: Duration = Duration::from_secs(1);

/// The request the startup probe and the nudge send.
const READY_PROBE: &[u8] = b"GET /__ready HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";

/// A running `wrangler dev`.
#[derive(Debug)]
pub struct WranglerDev {
    child: Child,
    /// `http://127.0.0.1:PORT`.
    pub base: String,
    state: PathBuf,
    /// The state directory was made here (and is removed on drop).
    owned: bool,
    /// The nudge thread (module docs) and its stop flag.
    nudge: Option<(Arc<AtomicBool>, JoinHandle<()>)>,
}

/// `crates/harness-worker`.
fn worker_crate() -> &'static Path {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| crate::checkout::path("crates/harness-worker"))
}

/// The Worker's test build (`cargo xtask worker build --test-routes`,
/// `crates/harness-worker/test-build/`): the deploy build plus the routes
/// and switches only tests use. What every test under `wrangler dev` runs.
pub fn test_build() -> &'static Path {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| worker_crate().join("test-build"))
}

/// The test build under `wrangler dev` with the session-API suite's token
/// table (`conformance::session_api::token_table`), started off the async
/// runtime; `None` after a skip (see [`WranglerDev::start`]).
pub async fn test_build_with_suite_tokens() -> Option<WranglerDev> {
    let tokens = crate::conformance::session_api::token_table().to_string();
    tokio::task::spawn_blocking(move || {
        WranglerDev::start(test_build(), &[("HARNESS_TOKENS", tokens)])
    })
    .await
    .expect("the task starting wrangler dev")
}

/// The Worker's deploy build (`cargo xtask worker build`,
/// `crates/harness-worker/build/`): what a deployment runs.
pub fn deploy_build() -> &'static Path {
    worker_crate()
}

/// Where wrangler is: `$HARNESS_WRANGLER`, else the xtask-installed one.
pub fn wrangler_bin() -> PathBuf {
    if let Some(bin) = std::env::var_os("HARNESS_WRANGLER").filter(|v| !v.is_empty()) {
        return PathBuf::from(bin);
    }
    let cache = std::env::var_os("HARNESS_CACHE")
        .filter(|v| !v.is_empty())
        .map_or_else(|| PathBuf::from("/var/cache/harness"), PathBuf::from);
    cache
        .join("tools")
        .join(format!("wrangler-{WRANGLER_VERSION}"))
        .join("node_modules/.bin/wrangler")
}

/// A port free on `ip` now (for [`WranglerDev::start_at`]).
pub fn free_port_on(ip: std::net::IpAddr) -> u16 {
    TcpListener::bind((ip, 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

/// True once `addr` answers an HTTP request with a status line.
fn http_answers(addr: SocketAddr) -> bool {
    let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_millis(500)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    if s.write_all(READY_PROBE).is_err() {
        return false;
    }
    let mut head = [0u8; 12];
    s.read_exact(&mut head).is_ok() && head.starts_with(b"HTTP/1.1 ")
}

impl WranglerDev {
    /// Serve the Worker in `worker_dir` with `vars` (`--var NAME:VALUE`),
    /// its state in a fresh directory removed on drop. `None` (after
    /// [`skip_or_fail`]) when wrangler or the built Worker is missing;
    /// panics when wrangler does not come up.
    pub fn start(worker_dir: &Path, vars: &[(&str, String)]) -> Option<Self> {
        Self::start_at(
            worker_dir,
            vars,
            SocketAddr::from(([127, 0, 0, 1], free_port())),
        )
    }

    /// As [`start`](Self::start), listening on `addr` instead of a loopback
    /// port: an address the tests made (a Docker bridge's gateway), so that
    /// sandboxes reach the Worker as they reach a deployed one (its model
    /// broker). [`free_port_on`] picks a port for it.
    pub fn start_at(worker_dir: &Path, vars: &[(&str, String)], addr: SocketAddr) -> Option<Self> {
        // Named by the port, which no other wrangler of this process holds.
        let state = std::env::temp_dir().join(format!(
            "harness-wrangler-{}-{}",
            std::process::id(),
            addr.port()
        ));
        Self::start_in(worker_dir, vars, &state, true, addr)
    }

    /// As [`start`](Self::start), with the Durable Objects' state (and
    /// wrangler's output) in `state`, which is kept: a later `wrangler dev`
    /// on the same directory finds the same sessions.
    pub fn start_with_state(
        worker_dir: &Path,
        vars: &[(&str, String)],
        state: &Path,
    ) -> Option<Self> {
        let addr = SocketAddr::from(([127, 0, 0, 1], free_port()));
        Self::start_in(worker_dir, vars, state, false, addr)
    }

    fn start_in(
        worker_dir: &Path,
        vars: &[(&str, String)],
        state: &Path,
        owned: bool,
        addr: SocketAddr,
    ) -> Option<Self> {
        let wrangler = wrangler_bin();
        if !wrangler.exists() {
            skip_or_fail(&format!(
                "wrangler is not installed at {} (cargo xtask worker deps)",
                wrangler.display()
            ));
            return None;
        }
        let index = worker_dir.join("build/index.js");
        if !index.exists() {
            skip_or_fail(&format!(
                "the Worker is not built: {} is missing (cargo xtask worker build)",
                index.display()
            ));
            return None;
        }
        let state = state.to_path_buf();
        std::fs::create_dir_all(&state).expect("a state directory");
        let log = std::fs::File::create(state.join("wrangler.log")).expect("a log file");
        let inspector = free_port();
        let mut cmd = Command::new("setsid");
        cmd.arg(&wrangler)
            .current_dir(worker_dir)
            .args(["dev", "--ip", &addr.ip().to_string()])
            .args(["--port", &addr.port().to_string()])
            .args(["--inspector-port", &inspector.to_string()])
            .arg("--persist-to")
            .arg(state.join("state"))
            .arg("--show-interactive-dev-session=false")
            // `GET /cdn-cgi/handler/scheduled?cron=…&time=<ms>` runs the
            // Cron Trigger's handler (retention) as Cloudflare would on its
            // schedule, at the time given.
            .arg("--test-scheduled")
            .env("WRANGLER_SEND_METRICS", "false")
            .env("CLOUDFLARE_CF_FETCH_ENABLED", "false")
            .env("CI", "1")
            .env("WRANGLER_LOG_PATH", state.join("logs"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log);
        for (name, value) in vars {
            cmd.arg("--var").arg(format!("{name}:{value}"));
        }
        let child = cmd
            .spawn()
            .expect("starting wrangler dev (is setsid there?)");
        let mut dev = Self {
            child,
            base: format!("http://{addr}"),
            state,
            owned,
            nudge: None,
        };
        let started = Instant::now();
        while !http_answers(addr) {
            if started.elapsed() > Duration::from_secs(120) {
                panic!(
                    "wrangler dev did not answer on {addr} in 120 s:\n{}",
                    dev.log_tail()
                );
            }
            std::thread::sleep(Duration::from_millis(250));
        }
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::Builder::new()
            .name("wrangler-nudge".into())
            .spawn(move || {
                while !stopped.load(Ordering::Relaxed) {
                    std::thread::sleep(NUDGE_EVERY);
                    // Whether it answers does not matter: arriving is enough.
                    let _ = http_answers(addr);
                }
            })
            .expect("the nudge thread");
        dev.nudge = Some((stop, thread));
        Some(dev)
    }

    /// Everything wrangler (and the Worker's `console`) printed so far,
    /// without the lines of the nudge's requests (module docs).
    pub fn log(&self) -> String {
        let text = std::fs::read_to_string(self.state.join("wrangler.log")).unwrap_or_default();
        text.lines()
            .filter(|line| !line.contains("GET /__ready "))
            .map(|line| format!("{line}\n"))
            .collect()
    }

    /// Waits (bounded) until wrangler's output holds `needle`. The Worker's
    /// `console` lines reach the log file through workerd and wrangler's
    /// stdout after the request that printed them has been answered, so a
    /// test that reads the log right after a response can miss a line that
    /// is on its way (seen in CI: the retention pass had deleted, its line
    /// was not yet written).
    pub async fn wait_for_log(&self, needle: &str, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        loop {
            if self.log().contains(needle) {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The end of wrangler's output.
    pub fn log_tail(&self) -> String {
        let text = self.log();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }
}

impl Drop for WranglerDev {
    fn drop(&mut self) {
        if let Some((stop, thread)) = self.nudge.take() {
            stop.store(true, Ordering::Relaxed);
            let _ = thread.join();
        }
        // setsid made wrangler the leader of its own group: stop all of it.
        // The leader is reaped only at the end, so until then the group id
        // cannot name anyone else's processes.
        let pid = self.child.id();
        let group = format!("-{pid}");
        let _ = Command::new("kill").args(["-TERM", "--", &group]).status();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline && !exited(pid) {
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = Command::new("kill").args(["-KILL", "--", &group]).status();
        let _ = self.child.wait();
        if self.owned {
            let _ = std::fs::remove_dir_all(&self.state);
        }
    }
}

/// True when `pid` is gone or a zombie (exited, not yet reaped).
fn exited(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_none_or(|state| state == "Z" || state == "X"),
        Err(_) => true,
    }
}
