//! `cargo xtask services start|stop|status`: dockerd, the Temporal dev
//! server, SeaweedFS (S3) and PostgreSQL, run as detached daemons.
//!
//! There is no systemd on these machines. Each daemon is started through
//! `setsid` (a new session, so it outlives xtask and its terminal), with
//! stdin from /dev/null and output to `$HARNESS_CACHE/services/<name>.log`;
//! its pid goes to `$HARNESS_CACHE/services/<name>.pid`, and `stop` kills
//! exactly that pid. A service that already answers is left alone.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::deps::venv_bin;
use crate::env;
use crate::util::{self, which};

pub const TEMPORAL_ADDR: &str = "127.0.0.1:7233";
pub const S3_ADDR: &str = "127.0.0.1:8333";
/// The test PostgreSQL: a cluster of its own (not the distribution's
/// default one on 5432), trust authentication on loopback only.
pub const POSTGRES_ADDR: &str = "127.0.0.1:55432";
/// The URL the tests use (`HARNESS_TEST_POSTGRES_URL`).
pub const POSTGRES_URL: &str = "postgres://postgres@127.0.0.1:55432/postgres";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Service {
    Dockerd,
    Temporal,
    Seaweedfs,
    Postgres,
}

pub const ALL: &[Service] = &[
    Service::Dockerd,
    Service::Temporal,
    Service::Seaweedfs,
    Service::Postgres,
];

impl Service {
    pub fn name(self) -> &'static str {
        match self {
            Service::Dockerd => "dockerd",
            Service::Temporal => "temporal",
            Service::Seaweedfs => "weed",
            Service::Postgres => "postgres",
        }
    }

    fn describe(self) -> &'static str {
        match self {
            Service::Dockerd => "Docker engine (unix:///var/run/docker.sock)",
            Service::Temporal => "Temporal dev server (grpc 127.0.0.1:7233)",
            Service::Seaweedfs => "SeaweedFS S3 (http://127.0.0.1:8333)",
            Service::Postgres => "PostgreSQL (postgres://postgres@127.0.0.1:55432/postgres)",
        }
    }

    /// Is the service answering right now?
    pub fn is_up(self) -> bool {
        match self {
            Service::Dockerd => util::succeeds(Command::new("docker").arg("info")),
            // The port opens before the frontend serves: ask for its health.
            Service::Temporal => {
                util::tcp_answers(TEMPORAL_ADDR)
                    && util::succeeds(
                        Command::new(venv_bin("temporal"))
                            .args(["operator", "cluster", "health", "--address"])
                            .arg(TEMPORAL_ADDR),
                    )
            }
            Service::Seaweedfs => util::http_answers(S3_ADDR),
            Service::Postgres => {
                util::tcp_answers(POSTGRES_ADDR)
                    && postgres_bin("pg_isready").is_ok_and(|bin| {
                        util::succeeds(Command::new(bin).args([
                            "-q",
                            "-h",
                            "127.0.0.1",
                            "-p",
                            "55432",
                        ]))
                    })
            }
        }
    }

    fn timeout(self) -> Duration {
        match self {
            Service::Dockerd => Duration::from_secs(60),
            Service::Temporal => Duration::from_secs(90),
            Service::Seaweedfs => Duration::from_secs(90),
            Service::Postgres => Duration::from_secs(60),
        }
    }

    fn pid_file(self) -> Result<PathBuf> {
        Ok(util::cache_subdir("services")?.join(format!("{}.pid", self.name())))
    }

    fn log_file(self) -> Result<PathBuf> {
        Ok(util::cache_subdir("services")?.join(format!("{}.log", self.name())))
    }

    fn command(self) -> Result<Command> {
        let services = util::cache_subdir("services")?;
        Ok(match self {
            Service::Dockerd => {
                let dockerd =
                    which("dockerd").context("dockerd not found: run `cargo xtask deps`")?;
                // Defaults work on these machines: the default bridge (with
                // its iptables NAT rules) and `--network none` both run.
                Command::new(dockerd)
            }
            Service::Temporal => {
                let bin = venv_bin("temporal");
                if !bin.exists() {
                    bail!("{} missing: run `cargo xtask deps`", bin.display());
                }
                let mut c = Command::new(bin);
                c.args([
                    "server",
                    "start-dev",
                    "--headless",
                    "--ip",
                    "127.0.0.1",
                    "--port",
                    "7233",
                ])
                .arg("--db-filename")
                .arg(services.join("temporal.db"))
                .args(["--log-level", "warn"]);
                c
            }
            Service::Seaweedfs => {
                let bin = venv_bin("weed");
                if !bin.exists() {
                    bail!("{} missing: run `cargo xtask deps`", bin.display());
                }
                // A test server: it starts empty every time xtask starts
                // it. Kept across runs, its data grew by a collection of
                // volumes per test bucket until no volume slot was left
                // and every write failed with HTTP 500.
                let dir = services.join("weed");
                if dir.exists() {
                    std::fs::remove_dir_all(&dir)
                        .with_context(|| format!("clearing {}", dir.display()))?;
                }
                std::fs::create_dir_all(&dir)?;
                warn_if_disk_low(&dir);
                let mut c = Command::new(bin);
                c.arg("server")
                    .arg("-s3")
                    .arg(format!("-dir={}", dir.display()))
                    .args(["-ip=127.0.0.1", "-ip.bind=127.0.0.1"])
                    // Small volumes: tests write little, and the default
                    // (30 GB per volume) reserves far more than needed.
                    .arg("-master.volumeSizeLimitMB=256")
                    // Every bucket is a collection that grows its own
                    // volumes; the default cap (8) runs out after a couple
                    // of test buckets ("No writable volumes"), so allow many
                    // small ones.
                    .arg("-volume.max=500");
                c
            }
            Service::Postgres => {
                // A test server, empty every time xtask starts it (as
                // SeaweedFS): a cluster made by initdb under the cache, run
                // as the `postgres` account when xtask is root (PostgreSQL
                // refuses to run as root).
                let dir = services.join("postgres");
                if dir.exists() {
                    std::fs::remove_dir_all(&dir)
                        .with_context(|| format!("clearing {}", dir.display()))?;
                }
                std::fs::create_dir_all(&dir)?;
                let as_postgres = |program: PathBuf| -> Result<Command> {
                    if !is_root() {
                        return Ok(Command::new(program));
                    }
                    util::run(
                        Command::new("chown")
                            .args(["-R", "postgres:postgres"])
                            .arg(&dir),
                    )
                    .context("the postgres account owns the test cluster (apt: postgresql)")?;
                    let mut c = Command::new("setpriv");
                    c.args(["--reuid=postgres", "--regid=postgres", "--init-groups"])
                        .arg(program);
                    Ok(c)
                };
                let mut initdb = as_postgres(postgres_bin("initdb")?)?;
                initdb
                    .arg("-D")
                    .arg(&dir)
                    .args(["-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync"])
                    .stdout(Stdio::null());
                util::run(&mut initdb).context("initdb for the test PostgreSQL")?;
                let mut c = as_postgres(postgres_bin("postgres")?)?;
                c.arg("-D")
                    .arg(&dir)
                    .args(["-h", "127.0.0.1", "-p", "55432", "-k"])
                    .arg(&dir)
                    // Several nodes and their pools at once in the scale tests.
                    .args(["-c", "max_connections=300"]);
                c
            }
        })
    }

    /// The pid from our pid file, if that process is still alive and is
    /// this service. A pid file outlives its process, and the kernel hands
    /// its pid to another process or thread (`/proc/<tid>` of another
    /// process's thread reads as alive): waiting on such a pid as "still
    /// starting" failed a chaos run after 90 s.
    pub fn running_pid(self) -> Option<u32> {
        let pid: u32 = std::fs::read_to_string(self.pid_file().ok()?)
            .ok()?
            .trim()
            .parse()
            .ok()?;
        // Each service's daemon is named as the service (postgres runs
        // through `setpriv`, which execs it in place).
        (pid_alive(pid) && is_process_of(pid, self.name())).then_some(pid)
    }

    pub fn start(self) -> Result<()> {
        if self.is_up() {
            match self.running_pid() {
                Some(pid) => println!("{}: already running (pid {pid})", self.name()),
                None => println!("{}: already answering (not started by xtask)", self.name()),
            }
            return Ok(());
        }
        if let Some(pid) = self.running_pid() {
            // Started by us but not (yet) answering: give it its full time.
            println!("{}: pid {pid} is starting; waiting", self.name());
            if util::wait_until(self.timeout(), || self.is_up()) {
                return Ok(());
            }
            bail!(
                "{} (pid {pid}) not answering; see {}",
                self.name(),
                self.log_file()?.display()
            );
        }
        let log_path = self.log_file()?;
        let log = File::options()
            .create(true)
            .append(true)
            .open(&log_path)
            .with_context(|| format!("opening {}", log_path.display()))?;
        let inner = self.command()?;
        // `setsid` runs the daemon in a new session so it survives xtask (and
        // a terminal closing). Spawned from a process that is not a group
        // leader, setsid execs in place: the pid we get is the daemon's.
        let mut cmd = Command::new("setsid");
        cmd.arg(inner.get_program())
            .args(inner.get_args())
            .current_dir(util::cache_subdir("services")?)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        println!(
            "{}: starting: {} (log {})",
            self.name(),
            util::display(&cmd),
            log_path.display()
        );
        let mut child = cmd
            .spawn()
            .with_context(|| format!("starting {}", self.name()))?;
        let pid = child.id();
        std::fs::write(self.pid_file()?, format!("{pid}\n"))?;
        let up = util::wait_until(self.timeout(), || {
            if let Ok(Some(status)) = child.try_wait() {
                println!("{}: exited early ({status})", self.name());
                return true;
            }
            self.is_up()
        });
        if up && self.is_up() {
            println!("{}: up (pid {pid})", self.name());
            // Dropping `child` neither waits for nor kills it.
            return Ok(());
        }
        print_log_tail(&log_path, 30);
        bail!(
            "{} did not answer within {}s; log: {}",
            self.name(),
            self.timeout().as_secs(),
            log_path.display()
        )
    }

    pub fn stop(self) -> Result<()> {
        let pid_file = self.pid_file()?;
        let Some(pid) = self.running_pid() else {
            println!(
                "{}: not running (no live pid in {})",
                self.name(),
                pid_file.display()
            );
            let _ = std::fs::remove_file(&pid_file);
            return Ok(());
        };
        // Guard against a recycled pid: the process must be the one we started.
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let prog = String::from_utf8_lossy(cmdline.split(|b| *b == 0).next().unwrap_or_default())
            .into_owned();
        if !prog.ends_with(self.name()) {
            println!(
                "{}: pid {pid} is now `{prog}`, not ours; leaving it",
                self.name()
            );
            let _ = std::fs::remove_file(&pid_file);
            return Ok(());
        }
        println!("{}: stopping pid {pid}", self.name());
        let _ = Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status();
        if !util::wait_until(Duration::from_secs(30), || !pid_alive(pid)) {
            println!("{}: still alive after 30s; SIGKILL", self.name());
            let _ = Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status();
            util::wait_until(Duration::from_secs(5), || !pid_alive(pid));
        }
        let _ = std::fs::remove_file(&pid_file);
        Ok(())
    }
}

/// A program of the newest PostgreSQL Debian installs
/// (`/usr/lib/postgresql/<version>/bin`).
fn postgres_bin(name: &str) -> Result<PathBuf> {
    let root = Path::new("/usr/lib/postgresql");
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir(root)
        .with_context(|| {
            format!(
                "{} is missing: run `cargo xtask deps` (apt: postgresql)",
                root.display()
            )
        })?
        .filter_map(|e| e.ok())
        .filter_map(|e| Some((e.file_name().to_str()?.parse().ok()?, e.path())))
        .collect();
    versions.sort();
    let (_, dir) = versions.pop().with_context(|| {
        format!(
            "no PostgreSQL under {}: run `cargo xtask deps`",
            root.display()
        )
    })?;
    let bin = dir.join("bin").join(name);
    if !bin.exists() {
        bail!(
            "{} is missing: run `cargo xtask deps` (apt: postgresql)",
            bin.display()
        );
    }
    Ok(bin)
}

fn is_root() -> bool {
    util::output(Command::new("id").arg("-u")).is_ok_and(|id| id.trim() == "0")
}

/// Alive and not a zombie.
fn pid_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // Field 3 (after the parenthesised comm) is the state.
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X"),
        Err(_) => false,
    }
}

/// Whether `pid` is a process (not another process's thread) running
/// `program` (its name as the kernel keeps it: at most 15 bytes).
fn is_process_of(pid: u32, program: &str) -> bool {
    let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
        return false;
    };
    let tgid = status
        .lines()
        .find_map(|l| l.strip_prefix("Tgid:"))
        .and_then(|v| v.trim().parse::<u32>().ok());
    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
    tgid == Some(pid) && comm_matches(comm.trim_end(), program)
}

/// The kernel keeps a process's name cut to 15 bytes.
fn comm_matches(comm: &str, program: &str) -> bool {
    let cut = program.len().min(15);
    !comm.is_empty() && program.as_bytes()[..cut] == *comm.as_bytes()
}

fn print_log_tail(path: &Path, lines: usize) {
    if let Ok(text) = std::fs::read_to_string(path) {
        let all: Vec<&str> = text.lines().collect();
        println!("--- last {lines} lines of {} ---", path.display());
        for l in &all[all.len().saturating_sub(lines)..] {
            println!("{l}");
        }
        println!("---");
    }
}

pub fn start(which: &[Service]) -> Result<()> {
    for s in which {
        util::timed(&format!("services: start {}", s.name()), || s.start())?;
    }
    Ok(())
}

pub fn stop(which: &[Service]) -> Result<()> {
    // Reverse order: dockerd last.
    for s in which.iter().rev() {
        s.stop()?;
    }
    Ok(())
}

pub fn status() -> Result<()> {
    let mut all_up = true;
    for s in ALL {
        let up = s.is_up();
        all_up &= up;
        let pid = s
            .running_pid()
            .map(|p| format!("pid {p}"))
            .unwrap_or_else(|| "no pid file".into());
        println!(
            "{:<9} {:<5} {:<14} {}",
            s.name(),
            if up { "up" } else { "DOWN" },
            pid,
            s.describe()
        );
    }
    println!();
    println!("# environment for the tests (eval \"$(cargo xtask env)\"):");
    env::print_exports(&env::test_env(true));
    if !all_up {
        println!("# some services are down: `cargo xtask services start`");
    }
    Ok(())
}

/// SeaweedFS turns its volumes read-only when its disk has less than 1 %
/// free, and every PUT then fails with a bare HTTP 500 (seen when a
/// development machine's build directories had filled the disk): say so up
/// front when the disk is near that.
fn warn_if_disk_low(dir: &Path) {
    let Ok(out) = util::output(Command::new("df").arg("-Pk").arg(dir)) else {
        return;
    };
    if let Some((total_kib, free_kib)) = df_total_and_free(&out) {
        if free_kib.saturating_mul(100) < total_kib.saturating_mul(3) {
            eprintln!(
                "warning: {} has {:.1} GiB free of {:.0} GiB: SeaweedFS refuses every write below 1 % \
                 free (its log then says `disk free … < required 1.00%`), and a cold build \
                 directory takes tens of GiB",
                dir.display(),
                free_kib as f64 / 1_048_576.0,
                total_kib as f64 / 1_048_576.0
            );
        }
    }
}

/// `df -Pk`'s total and available KiB on its second line.
fn df_total_and_free(out: &str) -> Option<(u64, u64)> {
    let fields: Vec<&str> = out.lines().nth(1)?.split_whitespace().collect();
    Some((fields.get(1)?.parse().ok()?, fields.get(3)?.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_is_compared_as_the_kernel_cuts_it() {
        assert!(comm_matches("dockerd", "dockerd"));
        assert!(comm_matches("a-very-long-pro", "a-very-long-program-name"));
        assert!(!comm_matches("dockerd", "temporal"));
        assert!(!comm_matches("", "weed"));
        assert_eq!(
            df_total_and_free(
                "Filesystem 1024-blocks Used Available Capacity Mounted on\n\
                 /dev/vda 264060000 74000000 22000000 78% /\n"
            ),
            Some((264_060_000, 22_000_000))
        );
        assert_eq!(df_total_and_free("Filesystem\n"), None);
        assert!(!comm_matches("weed", "weedy"));
    }

    #[test]
    fn a_thread_of_a_process_is_not_the_process() {
        let own = std::fs::read_to_string("/proc/self/comm").unwrap();
        let own = own.trim_end();
        let pid = std::process::id();
        assert!(is_process_of(pid, own));
        assert!(!is_process_of(pid, "temporal"));
        // A thread's id reads as alive in /proc but is not a process: the
        // pid file of a dead service may name one.
        let (tx, rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let thread = std::thread::spawn(move || {
            let tid = std::fs::read_link("/proc/thread-self").unwrap();
            let tid: u32 = tid.file_name().unwrap().to_str().unwrap().parse().unwrap();
            tx.send(tid).unwrap();
            let _ = done_rx.recv();
        });
        let tid = rx.recv().unwrap();
        assert_ne!(tid, pid);
        assert!(pid_alive(tid), "a thread id reads as alive");
        assert!(!is_process_of(tid, own));
        done_tx.send(()).unwrap();
        thread.join().unwrap();
    }
}
