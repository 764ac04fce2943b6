//! `harness-microvm-agent`: PID 1 of a `sandbox-microvm` guest.
//!
//! It opens the virtio-serial port named [`PORT_NAME`], answers the host's
//! frames (see the library docs for the protocol), starts processes in
//! their own process groups, streams their output under flow control,
//! reaps every child (it is init), and powers the VM off on request.
//! Built as a static executable and placed in the initramfs by
//! `cargo xtask microvm`.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use harness_microvm_agent::{
    encode, forward_ports, Decoder, Guest, Host, CHUNK, FORWARD_ADDR, PORT_NAME, VERSION, WINDOW,
};
use nix::sys::signal::{killpg, Signal};
use nix::sys::wait::{waitpid, WaitStatus};
use nix::unistd::Pid;

/// Stdin bytes for an exec's writer thread, and whether they end it.
type StdinTx = mpsc::Sender<(Vec<u8>, bool)>;

/// One running exec.
struct Exec {
    epoch: u64,
    pgid: i32,
    /// Output credit left; negative never.
    credit: Mutex<u64>,
    credit_cv: Condvar,
    /// Set when the connection that started it is gone: output is dropped.
    cancelled: std::sync::atomic::AtomicBool,
    stdin: Mutex<Option<StdinTx>>,
}

#[derive(Default)]
struct Procs {
    /// pid -> where its exit status goes.
    waiting: HashMap<i32, mpsc::Sender<std::process::ExitStatus>>,
    /// Statuses of pids reaped before anyone waited for them.
    early: HashMap<i32, i32>,
}

struct Agent {
    port: Mutex<File>,
    execs: Mutex<HashMap<u64, Arc<Exec>>>,
    epoch: AtomicU64,
    procs: Mutex<Procs>,
}

fn log(msg: &str) {
    // The console is the serial port; the host keeps it in console.log.
    eprintln!("harness-agent: {msg}");
}

fn find_port() -> std::io::Result<String> {
    for _ in 0..200 {
        if let Ok(rd) = std::fs::read_dir("/sys/class/virtio-ports") {
            for entry in rd.flatten() {
                let name = std::fs::read_to_string(entry.path().join("name")).unwrap_or_default();
                if name.trim() == PORT_NAME {
                    return Ok(format!("/dev/{}", entry.file_name().to_string_lossy()));
                }
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Err(std::io::Error::other(format!(
        "no virtio-serial port named {PORT_NAME}"
    )))
}

impl Agent {
    fn send(&self, header: &Guest, payload: &[u8]) {
        let frame = encode(header, payload);
        let mut port = self.port.lock().unwrap_or_else(|e| e.into_inner());
        // A write fails while no host is connected; the frame is lost, which
        // is what a host that went away asked for.
        let _ = port.write_all(&frame);
    }

    fn exec(
        self: &Arc<Self>,
        id: u64,
        argv: Vec<String>,
        env: Vec<(String, String)>,
        cwd: String,
        with_stdin: bool,
    ) {
        let Some((program, args)) = argv.split_first() else {
            self.send(
                &Guest::Failed {
                    id,
                    message: "empty argv".into(),
                },
                b"",
            );
            return;
        };
        let mut cmd = Command::new(program);
        cmd.args(args)
            .env_clear()
            .envs(env)
            .current_dir(&cwd)
            .process_group(0)
            .stdin(if with_stdin {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let (status_tx, status_rx) = mpsc::channel();
        let mut procs = self.procs.lock().unwrap_or_else(|e| e.into_inner());
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                drop(procs);
                let message = if std::path::Path::new(&cwd).is_dir() {
                    format!("cannot run {program:?}: {e}")
                } else {
                    format!("cannot run {program:?}: working directory {cwd:?}: {e}")
                };
                self.send(&Guest::Failed { id, message }, b"");
                return;
            }
        };
        let pid = child.id() as i32;
        match procs.early.remove(&pid) {
            Some(raw) => {
                let _ = status_tx.send(std::process::ExitStatus::from_raw(raw));
            }
            None => {
                procs.waiting.insert(pid, status_tx);
            }
        }
        drop(procs);
        let exec = Arc::new(Exec {
            epoch: self.epoch.load(Ordering::SeqCst),
            pgid: pid,
            credit: Mutex::new(WINDOW),
            credit_cv: Condvar::new(),
            cancelled: std::sync::atomic::AtomicBool::new(false),
            stdin: Mutex::new(None),
        });
        if let Some(mut stdin) = child.stdin.take() {
            let (tx, rx) = mpsc::channel::<(Vec<u8>, bool)>();
            *exec.stdin.lock().unwrap_or_else(|e| e.into_inner()) = Some(tx);
            let agent = self.clone();
            std::thread::spawn(move || {
                let mut open = true;
                while let Ok((bytes, eof)) = rx.recv() {
                    if open && !bytes.is_empty() && stdin.write_all(&bytes).is_err() {
                        // The process closed its stdin: the rest is dropped,
                        // but still acknowledged so the host is not stalled.
                        open = false;
                    }
                    if !bytes.is_empty() {
                        agent.send(
                            &Guest::StdinCredit {
                                id,
                                bytes: bytes.len() as u64,
                            },
                            b"",
                        );
                    }
                    if eof {
                        break;
                    }
                }
                drop(stdin);
            });
        }
        self.execs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, exec.clone());
        self.send(&Guest::Started { id, pid }, b"");
        let out = child.stdout.take().expect("piped");
        let err = child.stderr.take().expect("piped");
        let t_out = self.pump(id, exec.clone(), out, false);
        let t_err = self.pump(id, exec.clone(), err, true);
        let agent = self.clone();
        std::thread::spawn(move || {
            // `child` is never waited on: the reaper owns every exit status.
            drop(child);
            let _ = t_out.join();
            let _ = t_err.join();
            let status = status_rx.recv().ok();
            agent
                .execs
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&id);
            if exec.cancelled.load(Ordering::SeqCst) {
                return;
            }
            let (code, signal) = match status {
                Some(s) => (s.code(), s.signal()),
                None => (None, None),
            };
            agent.send(&Guest::Exit { id, code, signal }, b"");
        });
    }

    fn pump(
        self: &Arc<Self>,
        id: u64,
        exec: Arc<Exec>,
        mut from: impl Read + Send + 'static,
        stderr: bool,
    ) -> std::thread::JoinHandle<()> {
        let agent = self.clone();
        std::thread::spawn(move || {
            let mut buf = vec![0u8; CHUNK];
            loop {
                let n = match from.read(&mut buf) {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                };
                {
                    let mut credit = exec.credit.lock().unwrap_or_else(|e| e.into_inner());
                    while *credit == 0 && !exec.cancelled.load(Ordering::SeqCst) {
                        credit = exec
                            .credit_cv
                            .wait(credit)
                            .unwrap_or_else(|e| e.into_inner());
                    }
                    if exec.cancelled.load(Ordering::SeqCst) {
                        // Keep draining so the process is not blocked on a
                        // full pipe, but send nothing.
                        continue;
                    }
                    *credit = credit.saturating_sub(n as u64);
                }
                let header = if stderr {
                    Guest::Stderr { id }
                } else {
                    Guest::Stdout { id }
                };
                agent.send(&header, &buf[..n]);
            }
        })
    }

    /// The running exec `id`, if it is still running.
    fn exec_of(&self, id: u64) -> Option<Arc<Exec>> {
        self.execs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&id)
            .cloned()
    }

    fn handle(self: &Arc<Self>, frame: Host, payload: Vec<u8>) {
        match frame {
            Host::Hello { nonce } => {
                let epoch = self.epoch.fetch_add(1, Ordering::SeqCst) + 1;
                let old: Vec<Arc<Exec>> = self
                    .execs
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .values()
                    .filter(|e| e.epoch < epoch)
                    .cloned()
                    .collect();
                for exec in old {
                    cancel(&exec);
                }
                self.send(
                    &Guest::Hello {
                        nonce,
                        version: VERSION,
                    },
                    b"",
                );
            }
            Host::Exec {
                id,
                argv,
                env,
                cwd,
                stdin,
            } => {
                let agent = self.clone();
                // Spawning waits for the child's exec; keep the reader free.
                std::thread::spawn(move || agent.exec(id, argv, env, cwd, stdin));
            }
            Host::Stdin { id, eof } => {
                if let Some(exec) = self.exec_of(id) {
                    let tx = exec.stdin.lock().unwrap_or_else(|e| e.into_inner()).clone();
                    if let Some(tx) = tx {
                        let _ = tx.send((payload, eof));
                    }
                }
            }
            Host::Credit { id, bytes } => {
                if let Some(exec) = self.exec_of(id) {
                    let mut credit = exec.credit.lock().unwrap_or_else(|e| e.into_inner());
                    *credit = credit.saturating_add(bytes);
                    exec.credit_cv.notify_all();
                }
            }
            Host::Kill { id } => {
                if let Some(exec) = self.exec_of(id) {
                    let _ = killpg(Pid::from_raw(exec.pgid), Signal::SIGKILL);
                }
            }
            Host::Poweroff => {
                log("power off");
                nix::unistd::sync();
                if std::process::id() == 1 {
                    let _ = nix::sys::reboot::reboot(nix::sys::reboot::RebootMode::RB_POWER_OFF);
                }
                std::process::exit(0);
            }
        }
    }

    /// Reap every child (init's duty) and hand exit statuses to the execs
    /// waiting for them.
    fn reap(self: &Arc<Self>) {
        loop {
            match waitpid(Pid::from_raw(-1), None) {
                Ok(status) => {
                    let (pid, raw) = match status {
                        WaitStatus::Exited(pid, code) => (pid.as_raw(), (code & 0xff) << 8),
                        WaitStatus::Signaled(pid, sig, core) => {
                            (pid.as_raw(), sig as i32 | if core { 0x80 } else { 0 })
                        }
                        _ => continue,
                    };
                    let mut procs = self.procs.lock().unwrap_or_else(|e| e.into_inner());
                    match procs.waiting.remove(&pid) {
                        Some(tx) => {
                            let _ = tx.send(std::process::ExitStatus::from_raw(raw));
                        }
                        None => {
                            // An orphan, or an exec not registered yet.
                            if procs.early.len() > 4096 {
                                procs.early.clear();
                            }
                            procs.early.insert(pid, raw);
                        }
                    }
                }
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    }
}

fn cancel(exec: &Exec) {
    exec.cancelled.store(true, Ordering::SeqCst);
    exec.credit_cv.notify_all();
    let _ = killpg(Pid::from_raw(exec.pgid), Signal::SIGKILL);
    exec.stdin.lock().unwrap_or_else(|e| e.into_inner()).take();
}

/// Copy both ways between two byte streams until either side ends; then
/// shut the other's write half so its reader sees the end too.
fn splice<A, B>(a: A, b: B)
where
    A: Read + Write + Send + 'static + TryCloneShutdown,
    B: Read + Write + Send + 'static + TryCloneShutdown,
{
    let (Ok(mut a2), Ok(mut b2)) = (a.try_clone_box(), b.try_clone_box()) else {
        return;
    };
    let (mut a, mut b) = (a, b);
    let t = std::thread::spawn(move || {
        let _ = std::io::copy(&mut a2, &mut b2);
        b2.shutdown_write();
    });
    let _ = std::io::copy(&mut b, &mut a);
    a.shutdown_write();
    let _ = t.join();
}

/// What [`splice`] needs of a socket.
trait TryCloneShutdown: Sized {
    fn try_clone_box(&self) -> std::io::Result<Self>;
    fn shutdown_write(&self);
}

impl TryCloneShutdown for std::net::TcpStream {
    fn try_clone_box(&self) -> std::io::Result<Self> {
        self.try_clone()
    }
    fn shutdown_write(&self) {
        let _ = self.shutdown(std::net::Shutdown::Write);
    }
}

impl TryCloneShutdown for std::os::unix::net::UnixStream {
    fn try_clone_box(&self) -> std::io::Result<Self> {
        self.try_clone()
    }
    fn shutdown_write(&self) {
        let _ = self.shutdown(std::net::Shutdown::Write);
    }
}

/// In the guest: relay `127.0.0.1:<port>` to the `guestfwd` address.
fn serve_forwards() {
    let cmdline = std::fs::read_to_string("/proc/cmdline").unwrap_or_default();
    for port in forward_ports(&cmdline) {
        match std::net::TcpListener::bind(("127.0.0.1", port)) {
            Ok(listener) => {
                std::thread::spawn(move || {
                    for conn in listener.incoming().flatten() {
                        std::thread::spawn(move || {
                            match std::net::TcpStream::connect((FORWARD_ADDR, port)) {
                                Ok(out) => splice(conn, out),
                                Err(e) => log(&format!("forward {port}: {e}")),
                            }
                        });
                    }
                });
            }
            Err(e) => log(&format!("forward {port}: cannot listen: {e}")),
        }
    }
}

/// On the host: `harness-microvm-agent relay SOCKET`, the command QEMU runs
/// for each connection to a `guestfwd` (stdin/stdout are the connection):
/// relays it to the Unix socket.
fn relay(socket: &str) -> std::process::ExitCode {
    let sock = match std::os::unix::net::UnixStream::connect(socket) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("harness-microvm-agent relay: {socket}: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let Ok(mut sock_in) = sock.try_clone() else {
        return std::process::ExitCode::FAILURE;
    };
    let mut sock_out = sock;
    let t = std::thread::spawn(move || {
        let _ = std::io::copy(&mut std::io::stdin().lock(), &mut sock_in);
        let _ = sock_in.shutdown(std::net::Shutdown::Write);
    });
    let mut stdout = std::io::stdout().lock();
    let _ = std::io::copy(&mut sock_out, &mut stdout);
    let _ = stdout.flush();
    drop(stdout);
    // The guest side ended or the socket did: either way the connection is
    // over (stdin may stay open; do not wait for it).
    let _ = t.is_finished();
    std::process::ExitCode::SUCCESS
}

fn main() -> std::process::ExitCode {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("relay") {
        return match args.get(2) {
            Some(socket) => relay(socket),
            None => {
                eprintln!("usage: harness-microvm-agent relay SOCKET");
                std::process::ExitCode::FAILURE
            }
        };
    }
    serve();
    std::process::ExitCode::SUCCESS
}

fn serve() {
    serve_forwards();
    let path = match find_port() {
        Ok(p) => p,
        Err(e) => {
            log(&e.to_string());
            std::thread::sleep(Duration::from_secs(1));
            std::process::exit(1);
        }
    };
    // A virtio-serial port opens once (a second open is EBUSY): the writer
    // is a duplicate of the reader's descriptor.
    let (reader, writer) = match File::options()
        .read(true)
        .write(true)
        .open(&path)
        .and_then(|f| Ok((f.try_clone()?, f)))
    {
        Ok(pair) => pair,
        Err(e) => {
            log(&format!("opening {path}: {e}"));
            std::process::exit(1);
        }
    };
    log(&format!("serving on {path}"));
    let agent = Arc::new(Agent {
        port: Mutex::new(writer),
        execs: Mutex::new(HashMap::new()),
        epoch: AtomicU64::new(0),
        procs: Mutex::new(Procs::default()),
    });
    {
        let agent = agent.clone();
        std::thread::spawn(move || agent.reap());
    }
    let mut reader = reader;
    let mut decoder = Decoder::new();
    let mut buf = vec![0u8; 256 * 1024];
    loop {
        match reader.read(&mut buf) {
            Ok(0) | Err(_) => {
                // No host connected: whatever was half-read belonged to a
                // connection that is gone.
                decoder.reset();
                std::thread::sleep(Duration::from_millis(20));
            }
            Ok(n) => {
                decoder.push(&buf[..n]);
                while let Some((frame, payload)) = decoder.next_frame::<Host>() {
                    agent.handle(frame, payload);
                }
            }
        }
    }
}
