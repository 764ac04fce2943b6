//! The exec server (`--exec-server SOCKET`): a daemon in a container that
//! runs the host's commands for it, one per connection to `SOCKET`
//! (framing in [`crate::exec_wire`]). Started by the container's init, it
//! runs as the container's user with the container's environment — what
//! the engine's exec starts a command with — so a command it starts is the
//! one the engine would have started, minus the engine's round trips
//! (`docs/sandbox-docker.md`, "Commands through the exec server").
//!
//! It serves while its socket is there: removed or replaced, it exits.
//! Each command leads its own process group, which a kill (a connection
//! of its own) kills; a command whose host went away runs to its end, as
//! under the engine's exec.

use std::collections::HashSet;
use std::ffi::{OsStr, OsString};
use std::io::{BufReader, Read, Write};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use nix::sys::signal::{killpg, Signal};
use nix::sys::wait::{waitid, Id, WaitPidFlag};
use nix::unistd::Pid;

use crate::exec_wire::{self, Request};
use crate::{BINARY_NAME, EXIT_GATE_FAILED};

/// Stack of each connection's threads (they copy through 64 KiB buffers
/// on the heap).
const THREAD_STACK: usize = 128 * 1024;

/// `--exec-server SOCKET`: start the daemon, wait until it listens, exit 0
/// (the daemon is left to init). Exits 125 when it could not.
pub(crate) fn launch(socket: &Path) -> ! {
    let mut cmd = Command::new(crate::cli::self_exe());
    // The environment stays: the commands it runs inherit it.
    cmd.arg0(BINARY_NAME)
        .arg("--exec-serve")
        .arg(socket)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(crate::cli::log_stdio())
        .current_dir("/");
    let mut daemon = match cmd.spawn() {
        Ok(child) => child,
        Err(e) => fail(&format!("cannot start the exec server: {e}")),
    };
    match crate::cli::await_ready(&mut daemon, "the exec server") {
        Ok(()) => std::process::exit(0),
        Err(e) => fail(&e),
    }
}

fn fail(msg: &str) -> ! {
    eprintln!("harness-sandbox-gate: {msg}");
    std::process::exit(EXIT_GATE_FAILED);
}

/// `--exec-serve SOCKET`: listen, say `ready`, serve until killed.
pub(crate) fn serve(socket: &Path) -> ! {
    let _ = nix::unistd::setsid();
    // A socket left by an earlier run of this container (a restart).
    let _ = std::fs::remove_file(socket);
    let listener = match UnixListener::bind(socket) {
        Ok(l) => l,
        Err(e) => {
            println!("error: binding {}: {e}", socket.display());
            std::process::exit(EXIT_GATE_FAILED);
        }
    };
    // Only this user (and the host's root) may run commands through it.
    let _ = std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o600));
    crate::cli::say_ready_and_let_go();
    // Serve while the socket is ours: removed or replaced, nobody can
    // reach this server any more.
    if let Ok(bound) = std::fs::metadata(socket) {
        let socket = socket.to_path_buf();
        let _ = std::thread::Builder::new()
            .stack_size(THREAD_STACK)
            .spawn(move || loop {
                std::thread::sleep(crate::cli::WATCH_INTERVAL);
                match std::fs::metadata(&socket) {
                    Ok(now) if now.ino() == bound.ino() && now.dev() == bound.dev() => {}
                    _ => std::process::exit(0),
                }
            });
    }
    loop {
        match listener.accept() {
            Ok((conn, _)) => {
                let spawned = std::thread::Builder::new()
                    .stack_size(THREAD_STACK)
                    .spawn(move || serve_one(conn));
                if let Err(e) = spawned {
                    crate::cli::log(&format!("cannot start a command thread: {e}"));
                }
            }
            Err(e) => {
                crate::cli::log(&format!("accept: {e}"));
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

/// Read one frame: its tag and payload; `None` at a clean end of stream.
fn read_frame(input: &mut impl Read) -> std::io::Result<Option<(u8, Vec<u8>)>> {
    let mut head = [0u8; 5];
    match input.read_exact(&mut head) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let (tag, len) = exec_wire::parse_header(head)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
    let mut payload = vec![0u8; len];
    input.read_exact(&mut payload)?;
    Ok(Some((tag, payload)))
}

/// The connection's writing side, shared by the output threads.
type Writer = Arc<Mutex<UnixStream>>;

fn send(writer: &Writer, tag: u8, payload: &[u8]) -> bool {
    let mut w = writer.lock().unwrap_or_else(|p| p.into_inner());
    w.write_all(&exec_wire::header(tag, payload.len())).is_ok() && w.write_all(payload).is_ok()
}

/// The commands running, by process group id: a kill reaches only these.
/// A command leaves before it is reaped, under this lock, so a kill can
/// never reach a recycled pid.
fn running() -> &'static Mutex<HashSet<i32>> {
    static RUNNING: OnceLock<Mutex<HashSet<i32>>> = OnceLock::new();
    RUNNING.get_or_init(Mutex::default)
}

fn serve_one(conn: UnixStream) {
    let Ok(write_half) = conn.try_clone() else {
        return;
    };
    let writer: Writer = Arc::new(Mutex::new(write_half));
    let mut reader = BufReader::new(conn);
    let request = match read_frame(&mut reader) {
        Ok(Some((exec_wire::REQUEST, payload))) => Request::decode(&payload),
        Ok(Some((exec_wire::KILL, payload))) => return serve_kill(&writer, &payload),
        Ok(Some((tag, _))) => Err(format!("expected a request, got a frame {:?}", tag as char)),
        Ok(None) => return,
        Err(e) => Err(format!("reading the request: {e}")),
    };
    let request = match request {
        Ok(r) => r,
        Err(e) => return refuse(&writer, EXIT_GATE_FAILED, &format!("a bad request: {e}")),
    };
    let mut child = match spawn(&request) {
        Ok(child) => child,
        Err((code, msg)) => return refuse(&writer, code, &msg),
    };
    let pgid = child.id() as i32;
    running()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(pgid);
    let _ = send(&writer, exec_wire::STARTED, &(pgid as u32).to_be_bytes());

    // Output goes to the host while it listens; once it is gone the
    // command's output is read and dropped, so the command never blocks
    // on a full pipe (the engine's exec lets a command whose caller died
    // run to its end too).
    let outputs: Vec<_> = [
        (
            exec_wire::STDOUT,
            child
                .stdout
                .take()
                .map(|s| Box::new(s) as Box<dyn Read + Send>),
        ),
        (
            exec_wire::STDERR,
            child
                .stderr
                .take()
                .map(|s| Box::new(s) as Box<dyn Read + Send>),
        ),
    ]
    .into_iter()
    .filter_map(|(tag, pipe)| {
        let mut pipe = pipe?;
        let writer = writer.clone();
        std::thread::Builder::new()
            .stack_size(THREAD_STACK)
            .spawn(move || {
                let mut buf = vec![0u8; 64 * 1024];
                let mut listening = true;
                loop {
                    match pipe.read(&mut buf) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => {
                            if listening && !send(&writer, tag, &buf[..n]) {
                                listening = false;
                            }
                        }
                    }
                }
            })
            .ok()
    })
    .collect();

    // The host's side: stdin and its end. The host's going away ends
    // stdin and nothing else; a kill comes on a connection of its own
    // (so it is never stuck behind stdin the command does not read).
    let mut stdin = child.stdin.take();
    let _ = std::thread::Builder::new()
        .stack_size(THREAD_STACK)
        .spawn(move || loop {
            match read_frame(&mut reader) {
                Ok(Some((exec_wire::STDIN, bytes))) => {
                    if let Some(input) = &mut stdin {
                        // The command stopped reading: its exit tells.
                        if input.write_all(&bytes).is_err() {
                            stdin = None;
                        }
                    }
                }
                Ok(Some(_)) => stdin = None,
                Ok(None) | Err(_) => return,
            }
        });

    // Wait without reaping; leave the running set; then reap.
    let _ = waitid(
        Id::Pid(Pid::from_raw(pgid)),
        WaitPidFlag::WEXITED | WaitPidFlag::WNOWAIT,
    );
    let killed = !running()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .remove(&pgid);
    let status = child.wait();
    // Output ends when every holder of the pipes closed them (as with the
    // engine's exec); after a kill, a straggler that left the group must
    // not hold the exit back.
    if !killed {
        for output in outputs {
            let _ = output.join();
        }
    }
    let code = match status {
        Ok(s) => s.code().unwrap_or_else(|| 128 + s.signal().unwrap_or(0)),
        Err(_) => EXIT_GATE_FAILED,
    };
    let _ = send(&writer, exec_wire::EXIT, &code.to_be_bytes());
}

/// A [`exec_wire::KILL`]: kill the named group if it is one of ours and
/// still running (exit 0), else exit 1.
fn serve_kill(writer: &Writer, payload: &[u8]) {
    let Ok(pgid) = <[u8; 4]>::try_from(payload).map(|b| u32::from_be_bytes(b) as i32) else {
        return refuse(writer, EXIT_GATE_FAILED, "a bad kill");
    };
    let mut live = running().lock().unwrap_or_else(|p| p.into_inner());
    // Taken out of the set: the command's thread knows it was killed.
    let code = if pgid > 0 && live.remove(&pgid) {
        let _ = killpg(Pid::from_raw(pgid), Signal::SIGKILL);
        0
    } else {
        1
    };
    drop(live);
    let _ = send(writer, exec_wire::EXIT, &(code as i32).to_be_bytes());
}

/// Answer a request that runs nothing: the reason on stderr, then `code`.
fn refuse(writer: &Writer, code: i32, msg: &str) {
    let line = format!("harness-sandbox-gate: {msg}\n");
    let _ = send(writer, exec_wire::STDERR, line.as_bytes());
    let _ = send(writer, exec_wire::EXIT, &code.to_be_bytes());
}

/// Start the request's command as the leader of a new process group, or
/// the exit code and message of why it could not start (126, or 127 for a
/// program that is not there — a shell's codes).
fn spawn(request: &Request) -> Result<Child, (i32, String)> {
    let program = PathBuf::from(OsString::from_vec(request.argv[0].clone()));
    let mut cmd = Command::new(&program);
    cmd.args(
        request.argv[1..]
            .iter()
            .map(|a| OsString::from_vec(a.clone())),
    );
    for entry in &request.env {
        match entry.iter().position(|&b| b == b'=') {
            Some(eq) if eq > 0 => {
                cmd.env(
                    OsStr::from_bytes(&entry[..eq]),
                    OsStr::from_bytes(&entry[eq + 1..]),
                );
            }
            _ => {
                let entry = String::from_utf8_lossy(entry);
                return Err((
                    EXIT_GATE_FAILED,
                    format!("a bad environment entry {entry:?}"),
                ));
            }
        }
    }
    if let Some(cwd) = &request.cwd {
        let cwd = PathBuf::from(OsString::from_vec(cwd.clone()));
        // Checked first: a failed chdir and a missing program are both
        // ENOENT from the spawn.
        if !cwd.is_dir() {
            return Err((
                126,
                format!(
                    "cannot change to directory {}: not a directory",
                    cwd.display()
                ),
            ));
        }
        cmd.current_dir(cwd);
    }
    cmd.stdin(if request.stdin {
        Stdio::piped()
    } else {
        Stdio::null()
    })
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .process_group(0);
    cmd.spawn().map_err(|e| {
        let code = if e.kind() == std::io::ErrorKind::NotFound {
            127
        } else {
            126
        };
        (code, format!("cannot run {}: {e}", program.display()))
    })
}
