//! Commands through Docker's exec API, with streamed output, streamed stdin,
//! and process-group kills for abort and timeout.

use std::future::Future;
use std::time::Duration;

use bollard::container::LogOutput;
use bollard::exec::{CreateExecOptions, StartExecResults};
use bollard::Docker;
use futures::StreamExt;
use harness_core::sandbox::{ExecEvent, ExecStream, ExitReason, ExitStatus};
use harness_core::stream::{AbortSignal, ByteStream};
use harness_core::{Error, Result};
use tokio::io::AsyncWriteExt;
use tokio::sync::mpsc;

use crate::docker_err;

/// How long output may keep flowing after we killed a command's group
/// (a process that left the group may hold the pipe open).
const DRAIN_AFTER_KILL: Duration = Duration::from_secs(2);

/// One command to run.
pub(crate) struct ExecPlan {
    pub argv: Vec<String>,
    pub env: Vec<String>,
    pub cwd: Option<String>,
    pub stdin: Option<ByteStream>,
    pub timeout: Option<Duration>,
    pub abort: Option<AbortSignal>,
}

/// Wrap `argv` so it runs as the leader of its own process group, with the
/// group id in a pid file the kill path reads (`kill -KILL -PGID`: dash's
/// kill builtin rejects `--`); the wrapper removes the file
/// when the command ends and passes the exit code through.
fn wrapped_argv(argv: &[String], pidfile: &str) -> Vec<String> {
    let script = format!("echo $$ >{pidfile}; \"$@\"; rc=$?; rm -f {pidfile}; exit $rc");
    let mut out = vec![
        "setsid".to_string(),
        // `-w` waits when setsid had to fork (the exec process was already
        // a group leader) so the exit code still comes through.
        "-w".to_string(),
        "sh".to_string(),
        "-c".to_string(),
        script,
        "sh".to_string(),
    ];
    out.extend(argv.iter().cloned());
    out
}

/// Kill the process group recorded in `pidfile` (waiting briefly for the
/// wrapper to write it, in case the abort came first).
pub(crate) async fn kill_group(docker: &Docker, container: &str, pidfile: &str) -> Result<()> {
    let script = format!(
        "i=0; while [ ! -s {pidfile} ] && [ $i -lt 40 ]; do sleep 0.05; i=$((i+1)); done; \
         [ -s {pidfile} ] || exit 0; pg=$(cat {pidfile}); kill -KILL -$pg 2>/dev/null; rm -f {pidfile}; exit 0"
    );
    let out = run_simple(docker, container, vec!["sh".into(), "-c".into(), script]).await?;
    if out.0 != 0 {
        return Err(Error::backend(format!(
            "killing the command's process group failed: {}",
            String::from_utf8_lossy(&out.2)
        )));
    }
    Ok(())
}

/// Create an exec in `container` and start it: its id and its start.
async fn create_and_start(
    docker: &Docker,
    container: &str,
    options: CreateExecOptions<String>,
) -> Result<(String, StartExecResults)> {
    let created = docker
        .create_exec(container, options)
        .await
        .map_err(|e| docker_err("creating an exec", e))?;
    let started = docker
        .start_exec(&created.id, None)
        .await
        .map_err(|e| docker_err("starting an exec", e))?;
    Ok((created.id, started))
}

/// Run a short helper command unwrapped and collect (exit code, stdout, stderr).
pub(crate) async fn run_simple(
    docker: &Docker,
    container: &str,
    argv: Vec<String>,
) -> Result<(i64, Vec<u8>, Vec<u8>)> {
    let options = CreateExecOptions::<String> {
        attach_stdout: Some(true),
        attach_stderr: Some(true),
        cmd: Some(argv),
        ..Default::default()
    };
    let (exec_id, started) = create_and_start(docker, container, options).await?;
    let mut stdout = Vec::new();
    let mut stderr = Vec::new();
    if let StartExecResults::Attached { mut output, .. } = started {
        while let Some(item) = output.next().await {
            match item.map_err(|e| docker_err("reading exec output", e))? {
                LogOutput::StdOut { message } | LogOutput::Console { message } => {
                    stdout.extend_from_slice(&message)
                }
                LogOutput::StdErr { message } => stderr.extend_from_slice(&message),
                LogOutput::StdIn { .. } => {}
            }
        }
    }
    let code = exit_code(docker, &exec_id).await?;
    Ok((code, stdout, stderr))
}

/// The exit code of a finished exec (polling briefly: docker may report the
/// end of output a moment before it records the exit).
async fn exit_code(docker: &Docker, exec_id: &str) -> Result<i64> {
    for _ in 0..200 {
        let info = docker
            .inspect_exec(exec_id)
            .await
            .map_err(|e| docker_err("inspecting an exec", e))?;
        if info.running != Some(true) {
            return info
                .exit_code
                .ok_or_else(|| Error::backend("docker reported no exit code for a finished exec"));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Err(Error::backend(
        "the command's output ended but docker still reports it running",
    ))
}

enum Stop {
    Aborted,
    TimedOut,
    /// The stdin source failed: the command must not see a clean EOF.
    StdinFailed(Error),
    /// The consumer dropped the stream.
    Dropped,
}

/// Items of an exec's stdin read at once, when ready ([`start`]).
const STDIN_ITEMS_PER_WRITE: usize = 64;
/// Items smaller than this are gathered into one write; larger ones are
/// written as they are.
const STDIN_SMALL_ITEM: usize = 64 * 1024;

/// Write and empty `buffer`; false when the command stopped reading (a
/// write error: it exited, and its exit code tells the rest).
async fn flush_into(
    input: &mut (impl tokio::io::AsyncWrite + Unpin),
    buffer: &mut Vec<u8>,
) -> bool {
    if buffer.is_empty() {
        return true;
    }
    let written = input.write_all(buffer).await.is_ok();
    buffer.clear();
    written
}

/// Feed `source` to the command's stdin: the small items it has ready go
/// in one write (a tar stream comes as a header, a file and its padding,
/// each an item of its own; a write per item costs the engine a frame
/// each), nothing waits for more than is ready. A failing source is sent
/// on `stdin_err_tx` and `input` kept open (no EOF) until the group is killed.
pub(crate) async fn pump_stdin(
    source: ByteStream,
    mut input: impl tokio::io::AsyncWrite + Unpin,
    stdin_err_tx: mpsc::Sender<Error>,
) {
    let mut source = source.ready_chunks(STDIN_ITEMS_PER_WRITE);
    let mut buffer = Vec::new();
    while let Some(items) = source.next().await {
        let mut failed = None;
        for item in items {
            match item {
                Ok(chunk) if chunk.len() < STDIN_SMALL_ITEM => buffer.extend_from_slice(&chunk),
                Ok(chunk) => {
                    if !flush_into(&mut input, &mut buffer).await
                        || input.write_all(&chunk).await.is_err()
                    {
                        return;
                    }
                }
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        if !flush_into(&mut input, &mut buffer).await {
            return;
        }
        if let Some(e) = failed {
            // Keep `input` open (no EOF) until the group is killed.
            let _ = stdin_err_tx.send(e).await;
            tokio::time::sleep(Duration::from_secs(30)).await;
            return;
        }
    }
    let _ = input.shutdown().await;
}

/// One way of running a command, driven by [`drive`]: the engine's exec
/// ([`start`]) or the exec server in the container (`exec_server`).
pub(crate) trait Running: Send + 'static {
    /// The command's next output, or its exit; `None` when its output
    /// ended without one. Cancel-safe: [`drive`] races it against the
    /// deadline and the abort.
    fn next(&mut self) -> impl Future<Output = Option<Result<ExecEvent>>> + Send;
    /// The exit, asked once the output ended without one.
    fn exit(&mut self) -> impl Future<Output = Result<ExitStatus>> + Send;
    /// Kill the command's process group.
    fn kill(&mut self) -> impl Future<Output = Result<()>> + Send;
}

/// The command's events, from a task that drives `running`: its output as
/// it comes, then its exit. Abort, timeout, a failing stdin source (told on
/// `stdin_err`), or dropping the returned stream kill the whole group.
pub(crate) fn drive<R: Running>(
    mut running: R,
    timeout: Option<Duration>,
    abort: Option<AbortSignal>,
    mut stdin_err: mpsc::Receiver<Error>,
) -> ExecStream {
    let (tx, rx) = mpsc::channel::<Result<ExecEvent>>(16);
    tokio::spawn(async move {
        let deadline = async {
            match timeout {
                Some(t) => tokio::time::sleep(t).await,
                None => futures::future::pending().await,
            }
        };
        let aborted = async {
            match &abort {
                Some(a) => a.aborted().await,
                None => futures::future::pending().await,
            }
        };
        tokio::pin!(deadline, aborted);
        let mut stdin_open = true;
        let stop = loop {
            tokio::select! {
                item = running.next() => match item {
                    Some(Ok(ExecEvent::Exit(status))) => {
                        let _ = tx.send(Ok(ExecEvent::Exit(status))).await;
                        return;
                    }
                    Some(Ok(event)) => {
                        if tx.send(Ok(event)).await.is_err() {
                            break Some(Stop::Dropped);
                        }
                    }
                    Some(Err(e)) => {
                        let _ = tx.send(Err(e)).await;
                        break Some(Stop::Dropped);
                    }
                    None => break None,
                },
                () = &mut deadline => break Some(Stop::TimedOut),
                () = &mut aborted => break Some(Stop::Aborted),
                err = stdin_err.recv(), if stdin_open => match err {
                    Some(e) => break Some(Stop::StdinFailed(e)),
                    None => stdin_open = false,
                },
                () = tx.closed() => break Some(Stop::Dropped),
            }
        };
        let Some(stop) = stop else {
            let _ = tx.send(running.exit().await.map(ExecEvent::Exit)).await;
            return;
        };
        let killed = running.kill().await;
        let reason = match stop {
            Stop::Aborted => ExitReason::Aborted,
            Stop::TimedOut => ExitReason::TimedOut,
            Stop::StdinFailed(e) => {
                let _ = tx.send(Err(e)).await;
                return;
            }
            Stop::Dropped => return,
        };
        if let Err(e) = killed {
            let _ = tx.send(Err(e)).await;
            return;
        }
        // Forward what the group printed before it died, but do not wait
        // on a straggler that escaped the group and holds the pipe.
        let drain = async {
            while let Some(Ok(event)) = running.next().await {
                if matches!(event, ExecEvent::Exit(_)) || tx.send(Ok(event)).await.is_err() {
                    return;
                }
            }
        };
        let _ = tokio::time::timeout(DRAIN_AFTER_KILL, drain).await;
        let _ = tx
            .send(Ok(ExecEvent::Exit(ExitStatus {
                code: None,
                signal: Some(9),
                reason,
            })))
            .await;
    });
    Box::pin(futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    }))
}

/// A command run by the engine's exec API.
struct EngineExec {
    docker: Docker,
    container: String,
    exec_id: String,
    pidfile: String,
    output: std::pin::Pin<
        Box<
            dyn futures::Stream<Item = std::result::Result<LogOutput, bollard::errors::Error>>
                + Send,
        >,
    >,
}

impl Running for EngineExec {
    async fn next(&mut self) -> Option<Result<ExecEvent>> {
        loop {
            return match self.output.next().await? {
                Ok(LogOutput::StdOut { message } | LogOutput::Console { message }) => {
                    Some(Ok(ExecEvent::Stdout(message)))
                }
                Ok(LogOutput::StdErr { message }) => Some(Ok(ExecEvent::Stderr(message))),
                Ok(LogOutput::StdIn { .. }) => continue,
                Err(e) => Some(Err(docker_err("reading exec output", e))),
            };
        }
    }

    async fn exit(&mut self) -> Result<ExitStatus> {
        let code = exit_code(&self.docker, &self.exec_id).await?;
        Ok(ExitStatus::exited(i32::try_from(code).unwrap_or(i32::MAX)))
    }

    async fn kill(&mut self) -> Result<()> {
        kill_group(&self.docker, &self.container, &self.pidfile).await
    }
}

/// Start a command through the engine's exec API and return its events
/// ([`drive`]). The command runs in its own process group.
pub(crate) async fn start(docker: &Docker, container: &str, plan: ExecPlan) -> Result<ExecStream> {
    let pidfile = format!("/tmp/.harness-exec-{}.pid", uuid::Uuid::new_v4().simple());
    let options = CreateExecOptions::<String> {
        attach_stdin: Some(plan.stdin.is_some()),
        attach_stdout: Some(true),
        attach_stderr: Some(true),
        cmd: Some(wrapped_argv(&plan.argv, &pidfile)),
        env: (!plan.env.is_empty()).then_some(plan.env),
        working_dir: plan.cwd,
        ..Default::default()
    };
    let (exec_id, started) = create_and_start(docker, container, options).await?;
    let StartExecResults::Attached { output, input } = started else {
        return Err(Error::backend("docker started the exec detached"));
    };
    let (stdin_err_tx, stdin_err_rx) = mpsc::channel::<Error>(1);
    if let Some(source) = plan.stdin {
        tokio::spawn(pump_stdin(source, input, stdin_err_tx));
    } else {
        drop(stdin_err_tx);
        drop(input);
    }
    let running = EngineExec {
        docker: docker.clone(),
        container: container.to_string(),
        exec_id,
        pidfile,
        output,
    };
    Ok(drive(running, plan.timeout, plan.abort, stdin_err_rx))
}
