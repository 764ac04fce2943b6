//! The exec server run for real (`--exec-server`): commands over its
//! socket, with stdout, stderr, stdin, exit codes, kills (a connection of
//! their own), a host going away, and the daemon's
//! end when its socket goes.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use harness_sandbox_gate::exec_wire::{self, Request};

const GATE: &str = env!("CARGO_BIN_EXE_harness-sandbox-gate");

/// A running server on a fresh socket; removing the directory ends it.
struct Server {
    dir: tempfile::TempDir,
}

impl Server {
    fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let out = Command::new(GATE)
            .arg("--exec-server")
            .arg(dir.path().join("sock"))
            .output()
            .unwrap();
        assert!(out.status.success(), "launch failed: {out:?}");
        Self { dir }
    }

    fn socket(&self) -> std::path::PathBuf {
        self.dir.path().join("sock")
    }
}

#[derive(Debug, Default)]
struct Outcome {
    started: Option<u32>,
    stdout: Vec<u8>,
    stderr: Vec<u8>,
    exit: Option<i32>,
}

fn frame(conn: &mut UnixStream, tag: u8, payload: &[u8]) {
    conn.write_all(&exec_wire::header(tag, payload.len()))
        .unwrap();
    conn.write_all(payload).unwrap();
}

fn read_all(conn: &mut UnixStream) -> Outcome {
    conn.set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let mut outcome = Outcome::default();
    loop {
        let mut head = [0u8; 5];
        if conn.read_exact(&mut head).is_err() {
            return outcome;
        }
        let (tag, len) = exec_wire::parse_header(head).unwrap();
        let mut payload = vec![0u8; len];
        conn.read_exact(&mut payload).unwrap();
        match tag {
            exec_wire::STARTED => {
                assert!(outcome.started.is_none() && outcome.stdout.is_empty());
                outcome.started = Some(u32::from_be_bytes(payload.try_into().unwrap()));
            }
            exec_wire::STDOUT => outcome.stdout.extend(payload),
            exec_wire::STDERR => outcome.stderr.extend(payload),
            exec_wire::EXIT => {
                outcome.exit = Some(i32::from_be_bytes(payload.try_into().unwrap()));
                return outcome;
            }
            other => panic!("unexpected frame {other}"),
        }
    }
}

fn request(argv: &[&str]) -> Request {
    Request {
        argv: argv.iter().map(|a| a.as_bytes().to_vec()).collect(),
        ..Request::default()
    }
}

fn start(socket: &Path, request: &Request) -> UnixStream {
    let mut conn = UnixStream::connect(socket).unwrap();
    frame(&mut conn, exec_wire::REQUEST, &request.encode());
    conn
}

fn run(socket: &Path, request: &Request) -> Outcome {
    let mut conn = start(socket, request);
    read_all(&mut conn)
}

#[test]
fn commands_run_with_their_output_environment_directory_and_exit_code() {
    let server = Server::start();
    let dir = tempfile::tempdir().unwrap();
    let mut req = request(&["sh", "-c", "echo out $GREETING; pwd; echo err >&2; exit 7"]);
    req.env.push(b"GREETING=hello=there".to_vec());
    req.cwd = Some(dir.path().as_os_str().as_encoded_bytes().to_vec());
    let out = run(&server.socket(), &req);
    assert_eq!(out.exit, Some(7));
    assert!(out.started.is_some());
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        format!("out hello=there\n{}\n", dir.path().display())
    );
    assert_eq!(out.stderr, b"err\n");
    // Many at once: one connection each.
    let handles: Vec<_> = (0..8)
        .map(|i| {
            let socket = server.socket();
            std::thread::spawn(move || run(&socket, &request(&["sh", "-c", &format!("exit {i}")])))
        })
        .collect();
    for (i, h) in handles.into_iter().enumerate() {
        assert_eq!(h.join().unwrap().exit, Some(i as i32));
    }
}

#[test]
fn stdin_reaches_the_command_and_ends_when_told() {
    let server = Server::start();
    let mut req = request(&["sh", "-c", "wc -c; echo done"]);
    req.stdin = true;
    let mut conn = start(&server.socket(), &req);
    let data = vec![0u8; 300_000];
    for chunk in data.chunks(70_000) {
        frame(&mut conn, exec_wire::STDIN, chunk);
    }
    frame(&mut conn, exec_wire::STDIN_END, &[]);
    let out = read_all(&mut conn);
    assert_eq!(out.exit, Some(0));
    assert_eq!(
        String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .collect::<Vec<_>>(),
        ["300000", "done"]
    );
    // No stdin: empty and closed at once.
    let out = run(&server.socket(), &request(&["wc", "-c"]));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "0");
}

#[test]
fn what_cannot_run_says_why_with_a_shells_code() {
    let server = Server::start();
    let out = run(&server.socket(), &request(&["/no/such/program"]));
    assert_eq!(out.exit, Some(127));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/no/such/program"));
    let mut req = request(&["true"]);
    req.cwd = Some(b"/no/such/dir".to_vec());
    let out = run(&server.socket(), &req);
    assert_eq!(out.exit, Some(126));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/no/such/dir"));
    // A malformed request: refused with the gate's own code, and the
    // server still serves.
    let mut conn = UnixStream::connect(server.socket()).unwrap();
    frame(&mut conn, exec_wire::REQUEST, &[2, 0, 0]);
    assert_eq!(
        read_all(&mut conn).exit,
        Some(harness_sandbox_gate::EXIT_GATE_FAILED)
    );
    assert_eq!(run(&server.socket(), &request(&["true"])).exit, Some(0));
}

/// Whether process `pid` is gone (or a zombie).
fn gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit(')')
            .next()
            .unwrap_or("")
            .trim_start()
            .starts_with('Z'),
    }
}

fn wait_gone(pid: u32) -> bool {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if gone(pid) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

/// Read frames until `want` arrives: its payload.
fn read_until(conn: &mut UnixStream, want: u8) -> Vec<u8> {
    conn.set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    loop {
        let mut head = [0u8; 5];
        conn.read_exact(&mut head).unwrap();
        let (tag, len) = exec_wire::parse_header(head).unwrap();
        let mut payload = vec![0u8; len];
        conn.read_exact(&mut payload).unwrap();
        if tag == want {
            return payload;
        }
    }
}

/// Start `sleep 300` in the background of a group whose leader prints the
/// sleeper's pid and waits: the connection, the group, the sleeper.
fn start_group(socket: &Path) -> (UnixStream, u32, u32) {
    let mut conn = start(socket, &request(&["sh", "-c", "sleep 300 & echo $!; wait"]));
    let group = u32::from_be_bytes(
        read_until(&mut conn, exec_wire::STARTED)
            .try_into()
            .unwrap(),
    );
    let sleeper = String::from_utf8_lossy(&read_until(&mut conn, exec_wire::STDOUT))
        .trim()
        .parse()
        .unwrap();
    (conn, group, sleeper)
}

/// Kill group `group` on a connection of its own: the server's answer.
fn kill(socket: &Path, group: u32) -> Option<i32> {
    let mut conn = UnixStream::connect(socket).unwrap();
    frame(&mut conn, exec_wire::KILL, &group.to_be_bytes());
    read_all(&mut conn).exit
}

#[test]
fn a_kill_kills_the_whole_group_and_a_host_going_away_does_not() {
    let server = Server::start();
    let (mut conn, group, sleeper) = start_group(&server.socket());
    assert!(!gone(sleeper));
    assert_eq!(kill(&server.socket(), group), Some(0));
    let out = read_all(&mut conn);
    assert_eq!(out.exit, Some(128 + 9), "{out:?}");
    assert!(wait_gone(sleeper), "the group's sleeper outlived the kill");
    // No such command any more: told, and nothing is signalled.
    assert_eq!(kill(&server.socket(), group), Some(1));

    // The host goes away: the command runs on (as under the engine's
    // exec, a launch whose caller died finishes), until killed.
    let (conn, group, sleeper) = start_group(&server.socket());
    drop(conn);
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        !gone(sleeper),
        "the command died with its host's connection"
    );
    assert_eq!(kill(&server.socket(), group), Some(0));
    assert!(wait_gone(sleeper));

    // A command that reads no stdin while the host sends more than the
    // pipe holds: the server is stuck feeding it, and the kill, on a
    // connection of its own, still gets through.
    let mut req = request(&["sleep", "300"]);
    req.stdin = true;
    let mut conn = start(&server.socket(), &req);
    let group = u32::from_be_bytes(
        read_until(&mut conn, exec_wire::STARTED)
            .try_into()
            .unwrap(),
    );
    let writer = {
        let mut conn = conn.try_clone().unwrap();
        std::thread::spawn(move || {
            let chunk = vec![0u8; 64 * 1024];
            // Ends when the connection does (up to 64 MiB).
            for _ in 0..1024 {
                if conn
                    .write_all(&exec_wire::header(exec_wire::STDIN, chunk.len()))
                    .is_err()
                    || conn.write_all(&chunk).is_err()
                {
                    return;
                }
            }
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(kill(&server.socket(), group), Some(0));
    let out = read_all(&mut conn);
    assert_eq!(out.exit, Some(128 + 9), "{out:?}");
    conn.shutdown(std::net::Shutdown::Both).unwrap();
    writer.join().unwrap();
}

#[test]
fn the_server_ends_when_its_socket_goes() {
    let server = Server::start();
    let pid = run(&server.socket(), &request(&["sh", "-c", "echo $PPID"]));
    let pid: u32 = String::from_utf8_lossy(&pid.stdout).trim().parse().unwrap();
    assert!(!gone(pid));
    drop(server);
    assert!(wait_gone(pid), "the exec server outlived its socket");
}
