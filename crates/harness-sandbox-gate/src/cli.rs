//! The gate's command line: what the `harness-sandbox-gate` binary runs,
//! and what the multi-call `harness` binary runs when invoked under the
//! gate's name (see the crate docs for what it does and why).
//!
//! Hidden modes, used only by the gate itself:
//! - `--serve-launch --forward ...`: start the forward daemon and exit at
//!   once, so the daemon is nobody's child (not the program's the gate
//!   becomes) and is reaped by init;
//! - `--serve --forward ...`: the daemon.
//! - `--exec-server SOCKET`: start the exec server (`exec_server`) and
//!   exit once it listens on `SOCKET`;
//! - `--exec-serve SOCKET`: the exec server.

use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::net::{Ipv4Addr, Shutdown, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use crate::{BINARY_NAME, EXIT_GATE_FAILED, LOG_ENV};

/// One `--forward` as given (the socket path need not be UTF-8).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Forward {
    port: u16,
    socket: OsString,
}

impl Forward {
    fn new(port: u16, socket: impl Into<OsString>) -> Self {
        Self {
            port,
            socket: socket.into(),
        }
    }

    fn arg(&self) -> OsString {
        let mut arg = OsString::from(format!("{}=", self.port));
        arg.push(&self.socket);
        arg
    }
}

/// How long the gate waits for the forward daemon to bind its ports.
const READY_TIMEOUT: Duration = Duration::from_secs(5);
/// How often the daemon checks whether anyone is left in its namespace.
pub(crate) const WATCH_INTERVAL: Duration = Duration::from_secs(1);
/// Stack of each connection-copying thread (a copy needs an 8 KiB buffer).
const COPY_STACK: usize = 128 * 1024;

/// Capabilities a command behind `--unshare-net` must not have: with them
/// a root command could `setns` back into the host's network
/// (`CAP_SYS_ADMIN`), rewrite its own routes and firewall
/// (`CAP_NET_ADMIN`, `CAP_NET_RAW`), borrow a host process's namespace
/// through ptrace (`CAP_SYS_PTRACE`), or load kernel code
/// (`CAP_SYS_MODULE`).
const DROPPED_CAPS: [caps::Capability; 5] = [
    caps::Capability::CAP_SYS_ADMIN,
    caps::Capability::CAP_NET_ADMIN,
    caps::Capability::CAP_NET_RAW,
    caps::Capability::CAP_SYS_PTRACE,
    caps::Capability::CAP_SYS_MODULE,
];

const USAGE: &str = "usage: harness-sandbox-gate [--unshare-net] [--forward PORT=SOCKET_PATH]... -- PROGRAM [ARGS...]

Runs PROGRAM (exec: same pid, exit status and signals).
  --unshare-net            run it in a new network namespace with only loopback up,
                           without CAP_SYS_ADMIN, CAP_NET_ADMIN, CAP_NET_RAW,
                           CAP_SYS_PTRACE and CAP_SYS_MODULE (needs root or CAP_SYS_ADMIN)
  --forward PORT=SOCKET    inside, 127.0.0.1:PORT connects to the Unix socket SOCKET
                           (served by a daemon while any process is left in the namespace)
  --exec-server SOCKET     start a daemon that runs commands sent to the Unix socket
                           SOCKET (the Docker provider's exec server), and exit
  --version                print the version
Exit status: PROGRAM's; 125 when the gate itself fails, 126/127 when PROGRAM cannot run.";

#[derive(Debug, PartialEq, Eq)]
enum Mode {
    Run {
        unshare_net: bool,
        forwards: Vec<Forward>,
        program: Vec<OsString>,
    },
    ServeLaunch(Vec<Forward>),
    Serve(Vec<Forward>),
    ExecServerLaunch(PathBuf),
    ExecServe(PathBuf),
    Version,
    Help,
}

/// Run the gate with this process's arguments (after argv\[0\]); never
/// returns when it runs a program (it becomes that program).
pub fn main() {
    let args: Vec<OsString> = std::env::args_os().skip(1).collect();
    let mode = match parse(args) {
        Ok(mode) => mode,
        Err(msg) => fail(&format!("{msg}\n{USAGE}")),
    };
    match mode {
        Mode::Version => println!("harness-sandbox-gate {}", env!("CARGO_PKG_VERSION")),
        Mode::Help => println!("{USAGE}"),
        Mode::Serve(forwards) => serve(&forwards),
        Mode::ServeLaunch(forwards) => serve_launch(&forwards),
        Mode::ExecServerLaunch(socket) => crate::exec_server::launch(&socket),
        Mode::ExecServe(socket) => crate::exec_server::serve(&socket),
        Mode::Run {
            unshare_net,
            forwards,
            program,
        } => {
            if unshare_net {
                if let Err(msg) = enter_new_network() {
                    fail(&msg);
                }
            }
            if !forwards.is_empty() {
                if let Err(msg) = start_forwards(&forwards) {
                    fail(&msg);
                }
            }
            let err = Command::new(&program[0]).args(&program[1..]).exec();
            eprintln!(
                "harness-sandbox-gate: cannot run {}: {err}",
                Path::new(&program[0]).display()
            );
            std::process::exit(if err.kind() == std::io::ErrorKind::NotFound {
                127
            } else {
                126
            });
        }
    }
}

/// Print the gate's own failure and exit 125.
fn fail(msg: &str) -> ! {
    eprintln!("harness-sandbox-gate: {msg}");
    std::process::exit(EXIT_GATE_FAILED);
}

fn parse(args: Vec<OsString>) -> Result<Mode, String> {
    let mut unshare_net = false;
    let mut forwards = Vec::new();
    let mut serve = None;
    let mut args = args.into_iter();
    let mut program = Vec::new();
    while let Some(arg) = args.next() {
        let bytes = arg.as_bytes();
        if bytes == b"--" {
            program.extend(args.by_ref());
            break;
        }
        if !bytes.starts_with(b"-") {
            program.push(arg);
            program.extend(args.by_ref());
            break;
        }
        match bytes {
            b"--unshare-net" => unshare_net = true,
            b"--forward" => {
                let value = args
                    .next()
                    .ok_or_else(|| "--forward needs PORT=SOCKET_PATH".to_string())?;
                forwards.push(parse_forward(&value)?);
            }
            b"--serve" | b"--serve-launch" => serve = Some(arg),
            b"--exec-server" | b"--exec-serve" => {
                let socket = args
                    .next()
                    .ok_or_else(|| format!("{} needs SOCKET_PATH", arg.to_string_lossy()))?;
                if socket.is_empty() {
                    return Err(format!("{} needs SOCKET_PATH", arg.to_string_lossy()));
                }
                let socket = PathBuf::from(socket);
                return Ok(if bytes == b"--exec-server" {
                    Mode::ExecServerLaunch(socket)
                } else {
                    Mode::ExecServe(socket)
                });
            }
            b"--version" | b"-V" => return Ok(Mode::Version),
            b"--help" | b"-h" => return Ok(Mode::Help),
            _ if bytes.starts_with(b"--forward=") => {
                forwards.push(parse_forward(OsStr::from_bytes(&bytes[10..]))?);
            }
            _ => return Err(format!("unknown option {}", arg.to_string_lossy())),
        }
    }
    let mut ports: Vec<u16> = forwards.iter().map(|f| f.port).collect();
    ports.sort_unstable();
    if let Some(dup) = ports.windows(2).find(|w| w[0] == w[1]) {
        return Err(format!("port {} is forwarded twice", dup[0]));
    }
    match serve {
        Some(mode) => {
            if forwards.is_empty() {
                return Err("the forward daemon needs at least one --forward".into());
            }
            Ok(if mode == "--serve" {
                Mode::Serve(forwards)
            } else {
                Mode::ServeLaunch(forwards)
            })
        }
        None if program.is_empty() => Err("no program to run".into()),
        None => Ok(Mode::Run {
            unshare_net,
            forwards,
            program,
        }),
    }
}

fn parse_forward(value: &OsStr) -> Result<Forward, String> {
    let bytes = value.as_bytes();
    let eq = bytes.iter().position(|&b| b == b'=').ok_or_else(|| {
        format!(
            "--forward {}: expected PORT=SOCKET_PATH",
            value.to_string_lossy()
        )
    })?;
    let port = std::str::from_utf8(&bytes[..eq])
        .ok()
        .and_then(|p| p.parse::<u16>().ok())
        .filter(|&p| p != 0)
        .ok_or_else(|| {
            format!(
                "--forward {}: the port must be a number from 1 to 65535",
                value.to_string_lossy()
            )
        })?;
    let socket = &bytes[eq + 1..];
    if socket.is_empty() {
        return Err(format!(
            "--forward {}: the socket path is empty",
            value.to_string_lossy()
        ));
    }
    Ok(Forward::new(port, OsStr::from_bytes(socket)))
}

// ---------------------------------------------------------------------------
// the network namespace

/// Move into a new network namespace, bring its loopback up, and drop the
/// capabilities that would let the command leave it or reshape it.
fn enter_new_network() -> Result<(), String> {
    use nix::sched::{unshare, CloneFlags};
    match unshare(CloneFlags::CLONE_NEWNET) {
        Ok(()) => {}
        Err(nix::errno::Errno::EPERM) => {
            return Err(
                "cannot create a network namespace (unshare: EPERM): the local sandbox enforces \
                 deny-all/custom with a network namespace, which needs root or CAP_SYS_ADMIN"
                    .into(),
            )
        }
        Err(e) => return Err(format!("cannot create a network namespace: unshare: {e}")),
    }
    loopback_up()?;
    drop_capabilities()
}

/// `ip link set lo up`: a new network namespace starts with `lo` down.
fn loopback_up() -> Result<(), String> {
    let ip = ["/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
        .ok_or_else(|| {
            "cannot bring up loopback in the new network namespace: no `ip` program \
             (iproute2) in /usr/sbin, /sbin, /usr/bin or /bin"
                .to_string()
        })?;
    let out = Command::new(&ip)
        .args(["link", "set", "lo", "up"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .env_clear()
        .output()
        .map_err(|e| format!("cannot run {}: {e}", ip.display()))?;
    if !out.status.success() {
        return Err(format!(
            "`{} link set lo up` failed ({}): {}",
            ip.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(())
}

/// Drop [`DROPPED_CAPS`] from the bounding set (no program this process
/// runs can gain them again), the inheritable and ambient sets (which a
/// root exec would add back), and this process's own sets.
fn drop_capabilities() -> Result<(), String> {
    use caps::CapSet;
    for cap in DROPPED_CAPS {
        let in_bounding = caps::has_cap(None, CapSet::Bounding, cap)
            .map_err(|e| format!("reading the capability bounding set: {e}"))?;
        if in_bounding {
            caps::drop(None, CapSet::Bounding, cap)
                .map_err(|e| format!("dropping {cap} from the bounding set: {e}"))?;
        }
        caps::drop(None, CapSet::Inheritable, cap)
            .map_err(|e| format!("dropping {cap} from the inheritable set: {e}"))?;
        // Kernels without ambient capabilities (< 4.3) have none to drop.
        let _ = caps::drop(None, CapSet::Ambient, cap);
    }
    for cap in DROPPED_CAPS {
        caps::drop(None, CapSet::Effective, cap)
            .map_err(|e| format!("dropping {cap} from the effective set: {e}"))?;
        caps::drop(None, CapSet::Permitted, cap)
            .map_err(|e| format!("dropping {cap} from the permitted set: {e}"))?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// forwards

/// This very binary, even if its file was replaced since it started.
pub(crate) fn self_exe() -> PathBuf {
    let proc_self = PathBuf::from("/proc/self/exe");
    if proc_self.exists() {
        return proc_self;
    }
    std::env::current_exe().unwrap_or(proc_self)
}

fn forward_args(forwards: &[Forward]) -> Vec<OsString> {
    forwards
        .iter()
        .flat_map(|f| [OsString::from("--forward"), f.arg()])
        .collect()
}

/// Where the daemon's stderr goes: `$HARNESS_SANDBOX_GATE_LOG`, else nowhere.
pub(crate) fn log_stdio() -> Stdio {
    std::env::var_os(LOG_ENV)
        .filter(|p| !p.is_empty())
        .and_then(|p| {
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .ok()
        })
        .map(Stdio::from)
        .unwrap_or_else(Stdio::null)
}

/// A command for one of the gate's own hidden modes: no stdin, no
/// environment but the log setting, `/` as its directory.
fn own_mode(mode: &str, forwards: &[Forward]) -> Command {
    let mut cmd = Command::new(self_exe());
    // Under its own name, whatever file it is: a multi-call `harness`
    // binary runs the gate only when invoked as the gate.
    cmd.arg0(BINARY_NAME)
        .arg(mode)
        .args(forward_args(forwards))
        .stdin(Stdio::null())
        .current_dir("/")
        .env_clear();
    if let Some(log) = std::env::var_os(LOG_ENV) {
        cmd.env(LOG_ENV, log);
    }
    cmd
}

/// Start the forward daemon and wait until it serves (or found every port
/// served already).
fn start_forwards(forwards: &[Forward]) -> Result<(), String> {
    let mut launcher = own_mode("--serve-launch", forwards)
        .stdout(Stdio::piped())
        .stderr(log_stdio())
        .spawn()
        .map_err(|e| format!("cannot start the forward daemon: {e}"))?;
    // The launcher exits as soon as the daemon runs; the daemon holds the
    // pipe until it has bound its ports.
    let ready = await_ready(&mut launcher, "the forward daemon");
    // Reaped here: the program this gate becomes must not inherit it.
    let _ = launcher.wait();
    ready
}

/// Wait (up to [`READY_TIMEOUT`]) for the first line a daemon's launch
/// writes on `child`'s piped stdout: `ready`, or `error: <why>`. `what`
/// names the daemon in the error.
pub(crate) fn await_ready(child: &mut std::process::Child, what: &str) -> Result<(), String> {
    let stdout = child.stdout.take().expect("stdout is piped");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let read = BufReader::new(stdout).read_line(&mut line).map(|_| line);
        let _ = tx.send(read);
    });
    match rx.recv_timeout(READY_TIMEOUT) {
        Ok(Ok(line)) if line == "ready\n" => Ok(()),
        Ok(Ok(line)) if line.starts_with("error: ") => {
            Err(format!("{what} failed: {}", line["error: ".len()..].trim()))
        }
        Ok(Ok(line)) if line.is_empty() => Err(format!(
            "{what} exited before it was ready ({:?})",
            child.wait()
        )),
        Ok(Ok(line)) => Err(format!("{what} said {:?} instead of ready", line.trim())),
        Ok(Err(e)) => Err(format!("reading from {what}: {e}")),
        Err(_) => Err(format!(
            "{what} was not ready within {} s",
            READY_TIMEOUT.as_secs()
        )),
    }
}

/// `--serve-launch`: start the daemon (which inherits our stdout, the
/// gate's pipe) and exit, leaving it to init.
fn serve_launch(forwards: &[Forward]) {
    match own_mode("--serve", forwards)
        .stdout(Stdio::inherit())
        .stderr(Stdio::inherit())
        .spawn()
    {
        Ok(_) => std::process::exit(0),
        Err(e) => {
            println!("error: cannot start the forward daemon: {e}");
            std::process::exit(EXIT_GATE_FAILED);
        }
    }
}

/// Tell the launcher `ready` on stdout, then let go of it: a reader
/// waiting for EOF on the caller's pipes must not wait for a daemon.
pub(crate) fn say_ready_and_let_go() {
    let mut stdout = std::io::stdout();
    let _ = stdout.write_all(b"ready\n");
    let _ = stdout.flush();
    match File::options().read(true).write(true).open("/dev/null") {
        Ok(null) => {
            let _ = nix::unistd::dup2(null.as_raw_fd(), 1);
        }
        Err(_) => {
            let _ = nix::unistd::close(1);
        }
    }
}

pub(crate) fn log(msg: &str) {
    eprintln!("harness-sandbox-gate[{}]: {msg}", std::process::id());
}

/// `--serve`: bind every port, say `ready`, let go of the caller's pipe,
/// then forward connections until nobody else is in this network
/// namespace.
fn serve(forwards: &[Forward]) -> ! {
    // Its own session and process group: killing the command's group
    // leaves the forwards to the detached processes that still use them.
    let _ = nix::unistd::setsid();
    let mut listeners = Vec::new();
    for forward in forwards {
        match TcpListener::bind((Ipv4Addr::LOCALHOST, forward.port)) {
            Ok(listener) => listeners.push((listener, PathBuf::from(&forward.socket))),
            // An earlier gate in this namespace serves it.
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {}
            Err(e) => {
                println!("error: binding 127.0.0.1:{}: {e}", forward.port);
                std::process::exit(EXIT_GATE_FAILED);
            }
        }
    }
    say_ready_and_let_go();
    if listeners.is_empty() {
        std::process::exit(0);
    }
    for (listener, socket) in listeners {
        std::thread::spawn(move || accept_loop(listener, socket));
    }
    loop {
        std::thread::sleep(WATCH_INTERVAL);
        if !others_share_network() {
            std::process::exit(0);
        }
    }
}

fn accept_loop(listener: TcpListener, socket: PathBuf) {
    loop {
        match listener.accept() {
            Ok((tcp, _)) => {
                let socket = socket.clone();
                let spawned = std::thread::Builder::new()
                    .stack_size(COPY_STACK)
                    .spawn(move || proxy(tcp, &socket));
                if let Err(e) = spawned {
                    log(&format!("cannot start a connection thread: {e}"));
                }
            }
            Err(e) => {
                // EMFILE and the like: back off instead of spinning.
                log(&format!("accept: {e}"));
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

/// Copy bytes both ways between one TCP connection and a new connection to
/// the Unix socket.
fn proxy(tcp: TcpStream, socket: &Path) {
    let unix = match UnixStream::connect(socket) {
        Ok(u) => u,
        Err(e) => {
            log(&format!("connecting to {}: {e}", socket.display()));
            return;
        }
    };
    let (mut tcp_in, mut unix_out) = match (tcp.try_clone(), unix.try_clone()) {
        (Ok(t), Ok(u)) => (t, u),
        _ => return,
    };
    let up = std::thread::Builder::new()
        .stack_size(COPY_STACK)
        .spawn(move || match std::io::copy(&mut tcp_in, &mut unix_out) {
            Ok(_) => {
                let _ = unix_out.shutdown(Shutdown::Write);
            }
            Err(_) => {
                let _ = unix_out.shutdown(Shutdown::Both);
                let _ = tcp_in.shutdown(Shutdown::Both);
            }
        });
    let (mut unix_in, mut tcp_out) = (unix, tcp);
    match std::io::copy(&mut unix_in, &mut tcp_out) {
        Ok(_) => {
            let _ = tcp_out.shutdown(Shutdown::Write);
        }
        Err(_) => {
            let _ = tcp_out.shutdown(Shutdown::Both);
            let _ = unix_in.shutdown(Shutdown::Both);
        }
    }
    if let Ok(up) = up {
        let _ = up.join();
    }
}

/// Whether any process but this one and other forward daemons is in this
/// network namespace.
/// Processes whose namespace link cannot be read do not count: for root
/// those are the non-dumpable ones (a firecracker or gVisor init, setuid
/// programs), which are never in a namespace the gate made; a non-root
/// daemon in a container runs as the user of the container's own init,
/// which it can read.
fn others_share_network() -> bool {
    let Ok(mine) = std::fs::read_link("/proc/self/ns/net") else {
        return true;
    };
    let me = std::process::id();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return true;
    };
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        if pid == me {
            continue;
        }
        match std::fs::read_link(format!("/proc/{pid}/ns/net")) {
            // Another forward daemon (a nested gate's) is no user: two of
            // them must not keep each other alive.
            Ok(link) if link == mine && !is_forward_daemon(pid) => return true,
            // Another namespace; gone; a zombie (whose namespaces are
            // released); not ours to read.
            Ok(_) | Err(_) => {}
        }
    }
    false
}

/// Whether `pid` runs the gate's `--serve` mode.
fn is_forward_daemon(pid: u32) -> bool {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|cmdline| cmdline.split(|&b| b == 0).nth(1) == Some(b"--serve"))
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Vec<OsString> {
        list.iter().map(OsString::from).collect()
    }

    #[test]
    fn parses_the_documented_command_line() {
        assert_eq!(
            parse(args(&[
                "--unshare-net",
                "--forward",
                "47811=/run/a.sock",
                "--forward=47812=/run/b.sock",
                "--",
                "sh",
                "-c",
                "echo --unshare-net"
            ]))
            .unwrap(),
            Mode::Run {
                unshare_net: true,
                forwards: vec![
                    Forward::new(47811, "/run/a.sock"),
                    Forward::new(47812, "/run/b.sock")
                ],
                program: args(&["sh", "-c", "echo --unshare-net"]),
            }
        );
        // Without `--`, the first argument that is no option starts the program.
        assert_eq!(
            parse(args(&["true", "--unshare-net"])).unwrap(),
            Mode::Run {
                unshare_net: false,
                forwards: vec![],
                program: args(&["true", "--unshare-net"]),
            }
        );
        assert_eq!(
            parse(args(&["--serve", "--forward", "1=/s"])).unwrap(),
            Mode::Serve(vec![Forward::new(1, "/s")])
        );
        assert_eq!(parse(args(&["--version"])).unwrap(), Mode::Version);
        assert_eq!(
            parse(args(&["--exec-server", "/run/harness/exec/sock"])).unwrap(),
            Mode::ExecServerLaunch("/run/harness/exec/sock".into())
        );
    }

    #[test]
    fn refuses_malformed_command_lines() {
        for bad in [
            &[][..],
            &["--"][..],
            &["--forward"][..],
            &["--forward", "x=/s", "--", "true"][..],
            &["--forward", "0=/s", "--", "true"][..],
            &["--forward", "70000=/s", "--", "true"][..],
            &["--forward", "80=", "--", "true"][..],
            &["--forward", "/s", "--", "true"][..],
            &["--forward", "80=/a", "--forward", "80=/b", "--", "true"][..],
            &["--frobnicate", "--", "true"][..],
            &["--serve"][..],
            &["--exec-server"][..],
            &["--exec-server", ""][..],
        ] {
            assert!(parse(args(bad)).is_err(), "{bad:?} was accepted");
        }
    }
}
