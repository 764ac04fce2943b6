//! Running one command as a host process in its own process group.
//!
//! The command is spawned with `process_group(0)`, so it and every child it
//! forks (unless they call `setsid` themselves) share one group id equal to
//! its pid. Abort, timeout and a dropped output stream all `killpg` that group
//! with SIGKILL, which takes the whole tree down at once.

use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use bytes::Bytes;
use harness_core::sandbox::{ExecEvent, ExecStream, ExitReason, ExitStatus};
use harness_core::stream::AbortSignal;
use harness_core::{Error, Result};
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// Size of one stdout/stderr read.
const READ_CHUNK: usize = 64 * 1024;
/// How long to wait for the pipes to close after the group was killed (a
/// process that escaped the group with `setsid` may hold them open).
const DRAIN_AFTER_KILL: Duration = Duration::from_secs(2);

/// What to run, fully resolved against the sandbox.
pub(crate) struct Launch<'a> {
    pub argv: &'a [String],
    pub cwd: &'a Path,
    pub env: Vec<(String, String)>,
    pub stdin: Option<Bytes>,
    pub timeout: Option<Duration>,
    pub abort: Option<AbortSignal>,
}

/// Spawn the command and return its event stream.
pub(crate) fn spawn(launch: Launch<'_>) -> Result<ExecStream> {
    let Some((program, args)) = launch.argv.split_first() else {
        return Err(Error::invalid("exec needs a program: argv is empty"));
    };
    if !launch.cwd.is_dir() {
        return Err(Error::not_found(format!(
            "working directory {} does not exist",
            launch.cwd.display()
        )));
    }
    let mut cmd = tokio::process::Command::new(program);
    cmd.args(args)
        .current_dir(launch.cwd)
        // Exactly the sandbox's environment (see `INHERITED_ENV`).
        .env_clear()
        .envs(launch.env)
        .stdin(if launch.stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    let mut child = cmd.spawn().map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            Error::not_found(format!("cannot run {program:?}: {e}"))
        } else {
            Error::from(e).with_context(format!("spawning {program:?}"))
        }
    })?;
    let pgid = child
        .id()
        .and_then(|pid| i32::try_from(pid).ok())
        .map(Pid::from_raw)
        .ok_or_else(|| Error::backend("spawned process has no pid"))?;

    if let (Some(data), Some(mut stdin)) = (launch.stdin, child.stdin.take()) {
        // A command that never reads stdin must not block us: the write runs
        // on its own and a broken pipe is not an error.
        tokio::spawn(async move {
            let _ = stdin.write_all(&data).await;
            let _ = stdin.shutdown().await;
        });
    }

    let (tx, mut rx) = mpsc::channel::<Result<ExecEvent>>(16);
    let stdout = child.stdout.take().expect("stdout is piped");
    let stderr = child.stderr.take().expect("stderr is piped");
    let out_task = tokio::spawn(pump(stdout, tx.clone(), ExecEvent::Stdout));
    let err_task = tokio::spawn(pump(stderr, tx.clone(), ExecEvent::Stderr));
    tokio::spawn(supervise(
        child,
        pgid,
        out_task,
        err_task,
        tx,
        launch.timeout,
        launch.abort,
    ));

    Ok(Box::pin(futures::stream::poll_fn(move |cx| {
        rx.poll_recv(cx)
    })))
}

/// `NotFound` when `argv[0]` names no program: a path (joined onto `cwd`)
/// that does not exist, or a name in no directory of the command's `PATH`
/// (the last `PATH` in `env`, else this process's).
pub(crate) fn check_program(argv: &[String], cwd: &Path, env: &[(String, String)]) -> Result<()> {
    let Some(program) = argv.first() else {
        return Err(Error::invalid("exec needs a program: argv is empty"));
    };
    let found = if program.contains('/') {
        cwd.join(program).exists()
    } else {
        let path = env
            .iter()
            .rev()
            .find(|(k, _)| k == "PATH")
            .map(|(_, v)| v.clone())
            .or_else(|| std::env::var("PATH").ok())
            .unwrap_or_default();
        !program.is_empty()
            && path.split(':').any(|dir| {
                let dir = if dir.is_empty() { cwd } else { Path::new(dir) };
                cwd.join(dir).join(program).is_file()
            })
    };
    if found {
        Ok(())
    } else {
        Err(Error::not_found(format!(
            "cannot run {program:?}: No such file or directory"
        )))
    }
}

/// Forward one pipe as events until it closes or nobody listens.
async fn pump<R: AsyncRead + Unpin>(
    mut pipe: R,
    tx: mpsc::Sender<Result<ExecEvent>>,
    wrap: fn(Bytes) -> ExecEvent,
) {
    let mut buf = vec![0u8; READ_CHUNK];
    loop {
        match pipe.read(&mut buf).await {
            Ok(0) => return,
            Ok(n) => {
                if tx
                    .send(Ok(wrap(Bytes::copy_from_slice(&buf[..n]))))
                    .await
                    .is_err()
                {
                    return;
                }
            }
            Err(e) => {
                let _ = tx.send(Err(Error::from(e))).await;
                return;
            }
        }
    }
}

enum Outcome {
    Natural(std::io::Result<std::process::ExitStatus>),
    Kill(ExitReason),
    Dropped,
}

async fn supervise(
    mut child: tokio::process::Child,
    pgid: Pid,
    mut out_task: JoinHandle<()>,
    mut err_task: JoinHandle<()>,
    tx: mpsc::Sender<Result<ExecEvent>>,
    timeout: Option<Duration>,
    abort: Option<AbortSignal>,
) {
    let outcome = {
        // "Done" means the process exited AND both pipes closed, so every
        // byte is forwarded before the Exit event.
        let natural = async {
            let status = child.wait().await;
            let _ = (&mut out_task).await;
            let _ = (&mut err_task).await;
            status
        };
        let timer = async {
            match timeout {
                Some(t) => tokio::time::sleep(t).await,
                None => std::future::pending().await,
            }
        };
        let aborted = async {
            match &abort {
                Some(a) => a.aborted().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            status = natural => Outcome::Natural(status),
            _ = timer => Outcome::Kill(ExitReason::TimedOut),
            _ = aborted => Outcome::Kill(ExitReason::Aborted),
            _ = tx.closed() => Outcome::Dropped,
        }
    };

    let event = match outcome {
        Outcome::Natural(Ok(status)) => Ok(ExecEvent::Exit(ExitStatus {
            code: status.code(),
            signal: status.signal(),
            reason: ExitReason::Exited,
        })),
        Outcome::Natural(Err(e)) => Err(Error::from(e)),
        Outcome::Kill(reason) => {
            kill_group(pgid);
            let status = child.wait().await;
            drain(&mut out_task, &mut err_task).await;
            match status {
                Ok(status) => Ok(ExecEvent::Exit(ExitStatus {
                    code: status.code(),
                    signal: status.signal(),
                    reason,
                })),
                Err(e) => Err(Error::from(e)),
            }
        }
        Outcome::Dropped => {
            // Nobody reads the output any more: take the tree down rather
            // than leave it running unobserved.
            kill_group(pgid);
            let _ = child.wait().await;
            out_task.abort();
            err_task.abort();
            return;
        }
    };
    let _ = tx.send(event).await;
}

/// Wait briefly for the readers after a kill, then stop them.
async fn drain(out_task: &mut JoinHandle<()>, err_task: &mut JoinHandle<()>) {
    let both = async {
        let _ = (&mut *out_task).await;
        let _ = (&mut *err_task).await;
    };
    if tokio::time::timeout(DRAIN_AFTER_KILL, both).await.is_err() {
        out_task.abort();
        err_task.abort();
    }
}

/// SIGKILL the whole group; a group that is already gone is fine.
pub(crate) fn kill_group(pgid: Pid) {
    if let Err(e) = killpg(pgid, Signal::SIGKILL) {
        if e != nix::errno::Errno::ESRCH {
            tracing::warn!(pgid = pgid.as_raw(), error = %e, "killpg failed");
        }
    }
}

/// Extension to add context to an error message.
pub(crate) trait WithContext {
    fn with_context(self, what: String) -> Self;
}

impl WithContext for Error {
    fn with_context(self, what: String) -> Self {
        Error::new(self.kind(), format!("{what}: {}", self.message()))
    }
}
