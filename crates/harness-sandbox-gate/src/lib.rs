//! # harness-sandbox-gate
//!
//! The program every command of a network-restricted sandbox starts
//! through, and the small library sandbox providers use to find it and to
//! build its command line.
//!
//! ```text
//! harness-sandbox-gate [--unshare-net] [--forward PORT=SOCKET_PATH]... -- PROGRAM [ARGS...]
//! ```
//!
//! 1. `--unshare-net`: the gate moves into a new, empty network namespace
//!    (only `lo`, brought up), then drops `CAP_SYS_ADMIN`, `CAP_NET_ADMIN`,
//!    `CAP_NET_RAW`, `CAP_SYS_PTRACE` and `CAP_SYS_MODULE` from its
//!    capability bounding, inheritable and ambient sets, so even a root
//!    command cannot `setns` back into the host's network or change its own
//!    routes and firewall. The local sandbox provider runs every deny-all
//!    and custom-policy command this way (a container has its own network
//!    namespace already and needs no flag).
//! 2. `--forward PORT=SOCKET_PATH` (repeatable): inside the namespace,
//!    `127.0.0.1:PORT` connects to the Unix socket `SOCKET_PATH`. A daemon
//!    copy of the gate (its own session, holding none of the caller's
//!    pipes) serves the ports until no other process is left in its
//!    network namespace; a port some earlier gate already serves in the
//!    same namespace is left to it.
//! 3. Finally the gate `exec`s the program: its pid, process group, exit
//!    status and signals are the program's.
//!
//! The gate's own failures exit with [`EXIT_GATE_FAILED`] (125, like
//! `env(1)`), with the reason on stderr; a program that cannot be run
//! exits 127 (not found) or 126.
//!
//! See `docs/sandbox-local.md` and `docs/sandbox-docker.md` for what each
//! provider does with it.

use std::path::PathBuf;

pub mod cli;
mod exec_server;
pub mod exec_wire;

/// The gate's binary name.
pub const BINARY_NAME: &str = "harness-sandbox-gate";

/// The names a program invoked as the gate may have (its `argv[0]`'s file
/// name): its own, and the name the Docker provider mounts it under in a
/// container (`/run/harness/gate`). A multi-call binary (`harness`) runs
/// the gate when invoked under one of these.
pub const NAMES: &[&str] = &[BINARY_NAME, "gate"];

/// The environment variable naming the gate binary (see [`locate`]).
pub const BIN_ENV: &str = "HARNESS_SANDBOX_GATE_BIN";

/// The environment variable naming a file the forward daemon appends its
/// log lines to (connection failures); unset, it logs nowhere.
pub const LOG_ENV: &str = "HARNESS_SANDBOX_GATE_LOG";

/// Exit code of the gate's own failures (it could not make the namespace,
/// drop the capabilities, or start the forwards).
pub const EXIT_GATE_FAILED: i32 = 125;

/// The gate binary: `$HARNESS_SANDBOX_GATE_BIN` when set (even to a path
/// that does not exist: the caller then reports that path), else
/// `harness-sandbox-gate` beside the current executable when it is there.
pub fn locate() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os(BIN_ENV).filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(path));
    }
    let exe = std::env::current_exe().ok()?;
    let sibling = exe.parent()?.join(BINARY_NAME);
    sibling.is_file().then_some(sibling)
}

/// One `--forward`: `127.0.0.1:port` inside reaches the Unix socket
/// `socket` (a path as the gate sees it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Forward {
    /// The loopback port.
    pub port: u16,
    /// The Unix socket's path.
    pub socket: String,
}

impl Forward {
    /// A forward of `port` to `socket`.
    pub fn new(port: u16, socket: impl Into<String>) -> Self {
        Self {
            port,
            socket: socket.into(),
        }
    }

    /// The `PORT=SOCKET_PATH` argument.
    pub fn arg(&self) -> String {
        format!("{}={}", self.port, self.socket)
    }
}

/// The full command line that runs `command` through `gate`:
/// `gate [--unshare-net] [--forward P=S]... -- command...`.
pub fn command_line(
    gate: &str,
    unshare_net: bool,
    forwards: &[Forward],
    command: &[String],
) -> Vec<String> {
    let mut argv = vec![gate.to_string()];
    if unshare_net {
        argv.push("--unshare-net".into());
    }
    for forward in forwards {
        argv.push("--forward".into());
        argv.push(forward.arg());
    }
    argv.push("--".into());
    argv.extend(command.iter().cloned());
    argv
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn command_line_puts_options_before_the_program() {
        let command: Vec<String> = ["sh", "-c", "echo --forward"].map(String::from).to_vec();
        let argv = command_line(
            "/gate",
            true,
            &[Forward::new(47811, "/run/b.sock")],
            &command,
        );
        assert_eq!(
            argv,
            [
                "/gate",
                "--unshare-net",
                "--forward",
                "47811=/run/b.sock",
                "--",
                "sh",
                "-c",
                "echo --forward"
            ]
        );
        let plain = command_line("/gate", false, &[], &["true".to_string()]);
        assert_eq!(plain, ["/gate", "--", "true"]);
    }
}
