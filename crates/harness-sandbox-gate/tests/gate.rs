//! The gate against the real kernel: a new network namespace hides the
//! host's loopback, forwards reach a Unix socket on the host, the forward
//! daemon lives exactly as long as something is left in the namespace, and
//! the command cannot get back out. Needs root (skipped with a printed
//! reason otherwise, a failure under `HARNESS_REQUIRE_REAL=1`).

use std::io::{Read, Write};
use std::net::TcpListener;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const GATE: &str = env!("CARGO_BIN_EXE_harness-sandbox-gate");

/// True when this process may make network namespaces; prints the skip
/// otherwise.
fn root() -> bool {
    if nix::unistd::geteuid().is_root() {
        return true;
    }
    harness_testkit::skip_or_fail(
        "the gate's namespace tests need root (unshare(CLONE_NEWNET) needs CAP_SYS_ADMIN)",
    );
    false
}

fn nonce() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    format!("gate-nonce-{}-{nanos}", std::process::id())
}

/// Run the gate with `args`, bounded.
fn gate(args: &[&str]) -> Output {
    let mut child = Command::new(GATE)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("the gate {args:?} did not finish within 30 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A Unix socket in its own directory answering every connection with one
/// HTTP response whose body is `body`; counts connections.
struct SocketServer {
    _dir: tempfile::TempDir,
    path: PathBuf,
    hits: Arc<AtomicUsize>,
}

impl SocketServer {
    fn start(body: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let hits = Arc::new(AtomicUsize::new(0));
        let counter = hits.clone();
        let body = body.to_string();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut conn) = conn else { return };
                counter.fetch_add(1, Ordering::SeqCst);
                let body = body.clone();
                std::thread::spawn(move || {
                    // Read the request head, then answer and close.
                    let mut head = Vec::new();
                    let mut byte = [0u8; 1];
                    while !head.ends_with(b"\r\n\r\n") && head.len() < 8192 {
                        match conn.read(&mut byte) {
                            Ok(1) => head.push(byte[0]),
                            _ => break,
                        }
                    }
                    let _ = write!(
                        conn,
                        "HTTP/1.0 200 OK\r\ncontent-length: {}\r\n\r\n{body}",
                        body.len()
                    );
                });
            }
        });
        Self {
            _dir: dir,
            path,
            hits,
        }
    }

    fn forward(&self, port: u16) -> String {
        format!("{port}={}", self.path.display())
    }
}

/// A bash line that sends one HTTP request to 127.0.0.1:`port` and prints
/// the answer (or `unreachable`).
fn http_get(port: u16) -> String {
    format!(
        "timeout 5 bash -c 'exec 3<>/dev/tcp/127.0.0.1/{port} && printf \"GET / HTTP/1.0\\r\\n\\r\\n\" >&3 && cat <&3' \
         || echo unreachable"
    )
}

/// Every pid whose network namespace is `ns` (a `net:[…]` link).
fn pids_in(ns: &str) -> Vec<u32> {
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse().ok()) else {
            continue;
        };
        if let Ok(link) = std::fs::read_link(format!("/proc/{pid}/ns/net")) {
            if link.to_string_lossy() == ns {
                pids.push(pid);
            }
        }
    }
    pids
}

/// Wait (bounded) until no process is left in namespace `ns`.
fn wait_namespace_empty(ns: &str, limit: Duration) -> Result<(), Vec<u32>> {
    let deadline = Instant::now() + limit;
    loop {
        let pids = pids_in(ns);
        if pids.is_empty() {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(pids);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn unshare_net_hides_the_hosts_loopback() {
    if !root() {
        return;
    }
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let accepted = Arc::new(AtomicUsize::new(0));
    let counter = accepted.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            if conn.is_ok() {
                counter.fetch_add(1, Ordering::SeqCst);
            }
        }
    });
    let probe = format!(
        "timeout 3 bash -c 'exec 3<>/dev/tcp/127.0.0.1/{port}' 2>/dev/null && echo connected || echo refused"
    );
    let out = gate(&["--unshare-net", "--", "bash", "-c", &probe]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(stdout(&out).trim(), "refused", "{out:?}");
    // Only loopback, and it is up.
    let links = gate(&["--unshare-net", "--", "ip", "-o", "link", "show"]);
    let links = stdout(&links);
    assert_eq!(links.lines().count(), 1, "{links}");
    assert!(links.contains("lo:") && links.contains("UP"), "{links}");
    assert_eq!(accepted.load(Ordering::SeqCst), 0);

    // The control: without the flag the same probe connects.
    let out = gate(&["--", "bash", "-c", &probe]);
    assert_eq!(stdout(&out).trim(), "connected", "{out:?}");
    assert_eq!(accepted.load(Ordering::SeqCst), 1);
}

#[test]
fn a_forward_reaches_the_unix_socket_and_the_daemon_exits_after_the_command() {
    if !root() {
        return;
    }
    let body = nonce();
    let server = SocketServer::start(&body);
    let script = format!("readlink /proc/self/ns/net; {}", http_get(47811));
    let started = Instant::now();
    let out = gate(&[
        "--unshare-net",
        "--forward",
        &server.forward(47811),
        "--",
        "bash",
        "-c",
        &script,
    ]);
    assert!(out.status.success(), "{out:?}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "the command must not wait for the forward daemon"
    );
    let text = stdout(&out);
    let (ns, reply) = text.split_once('\n').unwrap();
    assert!(
        reply.ends_with(&body),
        "no nonce through the forward: {text:?}"
    );
    assert_eq!(server.hits.load(Ordering::SeqCst), 1);
    // The daemon was the last process in the namespace; it leaves within
    // its 1 s watch interval.
    if let Err(pids) = wait_namespace_empty(ns, Duration::from_secs(5)) {
        panic!("processes {pids:?} still in the command's namespace {ns} 5 s after it ended");
    }
}

#[test]
fn a_detached_child_keeps_the_forward_alive() {
    if !root() {
        return;
    }
    let body = nonce();
    let server = SocketServer::start(&body);
    let dir = tempfile::tempdir().unwrap();
    let result = dir.path().join("reply");
    let child = dir.path().join("child.sh");
    std::fs::write(
        &child,
        format!(
            "sleep 2\n( {get} ) > {out}.tmp\nmv {out}.tmp {out}\n",
            get = http_get(47811),
            out = result.display()
        ),
    )
    .unwrap();
    let script = format!(
        "readlink /proc/self/ns/net; setsid bash {} </dev/null >/dev/null 2>&1 &",
        child.display()
    );
    let out = gate(&[
        "--unshare-net",
        "--forward",
        &server.forward(47811),
        "--",
        "bash",
        "-c",
        &script,
    ]);
    assert!(out.status.success(), "{out:?}");
    let ns = stdout(&out).trim().to_string();
    // The command is gone; its detached child connects later.
    let deadline = Instant::now() + Duration::from_secs(15);
    let reply = loop {
        if let Ok(text) = std::fs::read_to_string(&result) {
            break text;
        }
        assert!(
            Instant::now() < deadline,
            "the detached child wrote nothing within 15 s"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(
        reply.ends_with(&body),
        "the detached child did not get through: {reply:?}"
    );
    if let Err(pids) = wait_namespace_empty(&ns, Duration::from_secs(5)) {
        panic!("processes {pids:?} still in namespace {ns} after the detached child ended");
    }
}

#[test]
fn a_port_already_served_in_the_namespace_is_left_to_its_gate() {
    if !root() {
        return;
    }
    // The outer gate makes the namespace and serves 47811; the inner one
    // (as inside a container: no --unshare-net) finds it taken and leaves
    // it, and serves 47812 itself.
    let first = SocketServer::start("first");
    let second = SocketServer::start("second");
    let third = SocketServer::start("third");
    let script = format!(
        "readlink /proc/self/ns/net; {}; echo; {}",
        http_get(47811),
        http_get(47812)
    );
    let out = gate(&[
        "--unshare-net",
        "--forward",
        &first.forward(47811),
        "--",
        GATE,
        "--forward",
        &second.forward(47811),
        "--forward",
        &third.forward(47812),
        "--",
        "bash",
        "-c",
        &script,
    ]);
    assert!(out.status.success(), "{out:?}");
    let text = stdout(&out);
    assert!(text.contains("\r\n\r\nfirst\n"), "{text:?}");
    assert!(text.ends_with("\r\n\r\nthird"), "{text:?}");
    assert_eq!(second.hits.load(Ordering::SeqCst), 0);
    // Two daemons share the namespace: neither keeps the other alive.
    let ns = text.lines().next().unwrap();
    if let Err(pids) = wait_namespace_empty(ns, Duration::from_secs(5)) {
        panic!("forward daemons {pids:?} outlived the command in {ns}");
    }
}

#[test]
fn the_command_cannot_get_back_to_the_host_network() {
    if !root() {
        return;
    }
    // $PPID is this test process, in the host's namespace: the same
    // nsenter from a plain `unshare -n` shell gets back.
    let script = "nsenter --net=/proc/$PPID/ns/net true 2>&1 && echo ESCAPED-NSENTER; \
                  unshare --net true 2>&1 && echo ESCAPED-UNSHARE; \
                  ip link set lo down 2>&1 && echo ESCAPED-IP; \
                  ip link add harness-gate-test type dummy 2>&1 && echo ESCAPED-LINK; \
                  grep CapBnd /proc/self/status; grep CapEff /proc/self/status; echo done";
    // The control: from a namespace made by unshare(1), which keeps every
    // capability, the same nsenter does get back.
    let control = Command::new("unshare")
        .args([
            "--net",
            "sh",
            "-c",
            "nsenter --net=/proc/$PPID/ns/net true && echo back",
        ])
        .output()
        .unwrap();
    assert_eq!(stdout(&control).trim(), "back", "{control:?}");
    let out = gate(&["--unshare-net", "--", "sh", "-c", script]);
    let text = stdout(&out);
    assert!(out.status.success(), "{out:?}");
    assert!(!text.contains("ESCAPED"), "{text}");
    assert!(text.ends_with("done\n"), "{text}");
    for line in text.lines().filter(|l| l.starts_with("Cap")) {
        let mask = u64::from_str_radix(line.split_whitespace().nth(1).unwrap(), 16).unwrap();
        // CAP_NET_ADMIN 12, CAP_NET_RAW 13, CAP_SYS_MODULE 16,
        // CAP_SYS_PTRACE 19, CAP_SYS_ADMIN 21.
        for bit in [12, 13, 16, 19, 21] {
            assert_eq!(mask & (1 << bit), 0, "capability {bit} left in {line}");
        }
    }
}

#[test]
fn exit_status_and_pid_are_the_programs() {
    if !root() {
        return;
    }
    let out = gate(&["--unshare-net", "--", "sh", "-c", "exit 7"]);
    assert_eq!(out.status.code(), Some(7));
    // exec: the program has the gate's pid (its parent is this test).
    let out = gate(&["--", "sh", "-c", "echo $PPID"]);
    assert_eq!(stdout(&out).trim(), std::process::id().to_string());
    let out = gate(&["--unshare-net", "--", "/nonexistent/program"]);
    assert_eq!(out.status.code(), Some(127), "{out:?}");
    let out = gate(&["--bogus", "--", "true"]);
    assert_eq!(out.status.code(), Some(125), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("usage:"));
    let out = gate(&["--version"]);
    assert!(stdout(&out).starts_with("harness-sandbox-gate "));
}

#[test]
fn a_missing_socket_closes_the_connection_and_the_gate_still_runs() {
    if !root() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let missing: &Path = &dir.path().join("nobody.sock");
    let out = gate(&[
        "--unshare-net",
        "--forward",
        &format!("47811={}", missing.display()),
        "--",
        "bash",
        "-c",
        &format!("{}; echo end", http_get(47811)),
    ]);
    assert!(out.status.success(), "{out:?}");
    // Connected (the daemon accepts), then closed with no answer.
    let text = stdout(&out);
    assert!(!text.contains("HTTP"), "{text:?}");
    assert!(text.ends_with("end\n"), "{text:?}");
}
