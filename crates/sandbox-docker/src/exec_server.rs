//! Commands through the exec server in the container (the gate's
//! `--exec-server`, started by the container's init): one Unix connection
//! per command instead of the engine's create, start and inspect calls and
//! runc's setup of a new process (`docs/sandbox-docker.md`, "Commands
//! through the exec server"). Where the server cannot be reached — not
//! started yet, a stopped and restarted container whose init has not
//! started it again, no gate in the image — the engine's exec runs the
//! command instead.
//!
//! The socket lives in a host directory the container may write (its
//! server binds there). So the host never follows what the container put
//! in it: the socket is opened with `O_PATH | O_NOFOLLOW` beneath the
//! directory's descriptor, must be a socket, and is connected to through
//! that descriptor (`/proc/self/fd/N`) — a link to a host socket leads
//! nowhere.

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use bytes::Bytes;
use harness_core::sandbox::{ExecEvent, ExecStream, ExitStatus};
use harness_core::{Error, Result};
use harness_sandbox_gate::exec_wire::{self, Request};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixStream;
use tokio::sync::mpsc;

use crate::exec::{drive, pump_stdin, ExecPlan, Running};

/// Where a container's exec directory is mounted.
pub const DIR_IN_CONTAINER: &str = "/run/harness/exec";
/// The server's socket in that directory.
pub(crate) const SOCKET_NAME: &str = "sock";

/// The server's socket as the container sees it.
pub(crate) fn socket_in_container() -> String {
    format!("{DIR_IN_CONTAINER}/{SOCKET_NAME}")
}

/// The names of exec directories under [`crate::DockerConfig::exec_dir`]
/// (what the sweep of leftovers looks at).
pub(crate) const NAME_PREFIX: &str = "exec-";

/// A new container's exec directory under `root`: `<root>/exec-<uuid>/`,
/// this process's only, holding the file naming the container
/// ([`record`]) and `dir/`, the directory mounted at [`DIR_IN_CONTAINER`]
/// — writable by whatever user the container runs as, since its server
/// binds there. Returns `dir/`, by which the rest of this module knows it.
pub(crate) fn make_dir(root: &Path) -> std::io::Result<PathBuf> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(root)?;
    let name = format!("{NAME_PREFIX}{}", uuid::Uuid::new_v4().simple());
    let outer = crate::forward_dirs::of(root, &name);
    std::fs::DirBuilder::new().mode(0o700).create(&outer)?;
    let dir = outer.join("dir");
    std::fs::create_dir(&dir)?;
    // The mode asked for is cut by the umask.
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777))?;
    Ok(dir)
}

/// The root and name (`exec-<uuid>`) of the exec directory whose mounted
/// part is `dir`.
fn root_and_name(dir: &Path) -> Option<(&Path, &str)> {
    let outer = dir.parent()?;
    Some((outer.parent()?, outer.file_name()?.to_str()?))
}

/// Record container `id` as the owner of exec directory `dir` (what the
/// sweep of leftovers checks, as for a pooled container's forward
/// directories).
pub(crate) fn record(dir: &Path, id: &str) -> std::io::Result<()> {
    let (root, name) = root_and_name(dir)
        .ok_or_else(|| std::io::Error::other(format!("{} is no exec directory", dir.display())))?;
    crate::forward_dirs::record_container(root, name, id)
}

/// Remove the exec directory whose mounted part is `dir`, whole.
pub(crate) fn remove_dir(dir: &Path) {
    if let Some((root, name)) = root_and_name(dir) {
        crate::forward_dirs::remove(root, name);
    }
}

/// Connect to the server whose socket is in host directory `dir`, without
/// following anything the container put there (see the module). `Err`
/// means no server is there to take the command.
pub(crate) async fn connect(dir: &Path) -> std::io::Result<UnixStream> {
    use rustix::fs::{FileType, Mode, OFlags};
    let dirfd = rustix::fs::open(
        dir,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    let socket = rustix::fs::openat(
        &dirfd,
        SOCKET_NAME,
        OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    let stat = rustix::fs::fstat(&socket)?;
    if FileType::from_raw_mode(stat.st_mode) != FileType::Socket {
        return Err(std::io::Error::other(format!(
            "{} is no socket",
            dir.join(SOCKET_NAME).display()
        )));
    }
    UnixStream::connect(format!("/proc/self/fd/{}", socket.as_raw_fd())).await
}

/// Run `plan` on a connection to the server; its events as
/// [`crate::exec::start`] gives them.
pub(crate) async fn start(dir: &Path, conn: UnixStream, plan: ExecPlan) -> Result<ExecStream> {
    let request = Request {
        argv: plan.argv.into_iter().map(String::into_bytes).collect(),
        env: plan.env.into_iter().map(String::into_bytes).collect(),
        cwd: plan.cwd.map(String::into_bytes),
        stdin: plan.stdin.is_some(),
    };
    let (read, mut write) = conn.into_split();
    let payload = request.encode();
    if payload.len() > exec_wire::MAX_PAYLOAD {
        return Err(Error::invalid(format!(
            "a command of {} bytes (arguments and environment) is over the exec server's limit",
            payload.len()
        )));
    }
    write_frame(&mut write, exec_wire::REQUEST, &payload)
        .await
        .map_err(|e| Error::backend(format!("sending a command to the exec server: {e}")))?;

    let (events_tx, events) = mpsc::channel(16);
    let (group_tx, group) = tokio::sync::watch::channel(None);
    tokio::spawn(read_events(read, events_tx, group_tx));

    let (stdin_err_tx, stdin_err_rx) = mpsc::channel::<Error>(1);
    match plan.stdin {
        Some(source) => {
            // The stdin pump of the engine's exec, into a pipe this side
            // frames: one batching rule for both.
            let (pump_end, frame_end) = tokio::io::duplex(256 * 1024);
            tokio::spawn(pump_stdin(source, pump_end, stdin_err_tx));
            tokio::spawn(write_stdin(write, frame_end));
        }
        None => drop(write),
    }
    let running = ServerExec {
        events,
        group,
        dir: dir.to_path_buf(),
    };
    Ok(drive(running, plan.timeout, plan.abort, stdin_err_rx))
}

async fn write_frame(write: &mut OwnedWriteHalf, tag: u8, payload: &[u8]) -> std::io::Result<()> {
    write
        .write_all(&exec_wire::header(tag, payload.len()))
        .await?;
    write.write_all(payload).await
}

/// Stdin as it comes, framed, then its end.
async fn write_stdin(mut write: OwnedWriteHalf, mut stdin: tokio::io::DuplexStream) {
    let mut buf = vec![0u8; 128 * 1024];
    loop {
        let sent = match stdin.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => write_frame(&mut write, exec_wire::STDIN, &buf[..n]).await,
        };
        if sent.is_err() {
            // The server is gone: its reader tells the driver.
            return;
        }
    }
    let _ = write_frame(&mut write, exec_wire::STDIN_END, &[]).await;
}

/// The server's frames as events, until the exit (or the connection's end).
async fn read_events(
    mut read: OwnedReadHalf,
    events: mpsc::Sender<Result<ExecEvent>>,
    group: tokio::sync::watch::Sender<Option<u32>>,
) {
    loop {
        let mut head = [0u8; 5];
        if let Err(e) = read.read_exact(&mut head).await {
            if e.kind() != std::io::ErrorKind::UnexpectedEof {
                let _ = events
                    .send(Err(Error::backend(format!(
                        "reading from the exec server: {e}"
                    ))))
                    .await;
            }
            return;
        }
        let (tag, len) = match exec_wire::parse_header(head) {
            Ok(h) => h,
            Err(e) => {
                let _ = events.send(Err(Error::backend(e))).await;
                return;
            }
        };
        let mut payload = vec![0u8; len];
        if let Err(e) = read.read_exact(&mut payload).await {
            let _ = events
                .send(Err(Error::backend(format!(
                    "reading from the exec server: {e}"
                ))))
                .await;
            return;
        }
        let event = match tag {
            exec_wire::STARTED => {
                if let Ok(id) = <[u8; 4]>::try_from(payload.as_slice()) {
                    let _ = group.send(Some(u32::from_be_bytes(id)));
                }
                continue;
            }
            exec_wire::STDOUT => ExecEvent::Stdout(Bytes::from(payload)),
            exec_wire::STDERR => ExecEvent::Stderr(Bytes::from(payload)),
            exec_wire::EXIT => {
                let Ok(code) = <[u8; 4]>::try_from(payload.as_slice()) else {
                    let _ = events
                        .send(Err(Error::backend("the exec server sent a malformed exit")))
                        .await;
                    return;
                };
                let _ = events
                    .send(Ok(ExecEvent::Exit(ExitStatus::exited(i32::from_be_bytes(
                        code,
                    )))))
                    .await;
                return;
            }
            other => {
                let _ = events
                    .send(Err(Error::backend(format!(
                        "the exec server sent an unknown frame {:?}",
                        other as char
                    ))))
                    .await;
                return;
            }
        };
        if events.send(Ok(event)).await.is_err() {
            return;
        }
    }
}

/// A command run by the exec server.
struct ServerExec {
    events: mpsc::Receiver<Result<ExecEvent>>,
    /// The command's process group, once the server has said it.
    group: tokio::sync::watch::Receiver<Option<u32>>,
    /// The exec directory, where a kill connects.
    dir: PathBuf,
}

/// How long a kill waits for the server to name the command's group (a
/// kill right after the start).
const GROUP_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

impl Running for ServerExec {
    async fn next(&mut self) -> Option<Result<ExecEvent>> {
        self.events.recv().await
    }

    async fn exit(&mut self) -> Result<ExitStatus> {
        Err(Error::backend(
            "the exec server closed the connection before the command's exit",
        ))
    }

    async fn kill(&mut self) -> Result<()> {
        let group =
            match tokio::time::timeout(GROUP_WAIT, self.group.wait_for(Option::is_some)).await {
                Ok(Ok(group)) => group.expect("waited for"),
                // The connection ended before the server named the group:
                // nothing was started, or the server is gone.
                Ok(Err(_)) => return Ok(()),
                Err(_) => {
                    return Err(Error::backend(format!(
                        "the exec server did not name the command's process group within {} s",
                        GROUP_WAIT.as_secs()
                    )))
                }
            };
        // A kill is a connection of its own: never behind stdin.
        let killed = async {
            let conn = connect(&self.dir).await?;
            let (mut read, mut write) = conn.into_split();
            write_frame(&mut write, exec_wire::KILL, &group.to_be_bytes()).await?;
            // The answer (killed, or no longer running): either is done.
            let mut answer = Vec::new();
            read.read_to_end(&mut answer).await?;
            std::io::Result::Ok(())
        };
        killed.await.map_err(|e| {
            Error::backend(format!(
                "killing the command's process group {group} through the exec server: {e}"
            ))
        })
    }
}
