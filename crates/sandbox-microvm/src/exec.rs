//! One exec over the agent connection: start, stdin under credit, output
//! events (granting credit as the consumer takes them), kill on timeout,
//! abort, a failing stdin source, or a dropped stream.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use futures::StreamExt;
use harness_core::sandbox::{ExecEvent, ExecStream, ExitReason, ExitStatus};
use harness_core::stream::{AbortSignal, ByteStream};
use harness_core::{Error, ErrorKind, Result};
use harness_microvm_agent::{Host, CHUNK, WINDOW};
use tokio::sync::{mpsc, oneshot};

use crate::conn::{self, Event, Lease};
use crate::guest_files::{aborted, sleep_until, stdin_failure};

/// How long a killed command's output may still drain before its exit is
/// reported without the agent's word.
const DRAIN_AFTER_KILL: Duration = Duration::from_secs(5);

/// What to run.
pub(crate) struct Plan {
    pub argv: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub cwd: String,
    pub stdin: Option<ByteStream>,
    pub timeout: Option<Duration>,
    pub abort: Option<AbortSignal>,
}

struct Running {
    lease: Lease,
    id: u64,
    events: mpsc::UnboundedReceiver<Event>,
    stdin_failed: Option<oneshot::Receiver<Error>>,
    deadline: Option<tokio::time::Instant>,
    abort: Option<AbortSignal>,
    reason: ExitReason,
    killed_at: Option<tokio::time::Instant>,
    done: bool,
}

impl Drop for Running {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.lease.send(&Host::Kill { id: self.id }, b"");
            self.lease.unregister(self.id);
        }
    }
}

impl Running {
    fn kill(&mut self, reason: ExitReason) {
        if self.killed_at.is_none() {
            self.reason = reason;
            self.killed_at = Some(tokio::time::Instant::now());
            let _ = self.lease.send(&Host::Kill { id: self.id }, b"");
        }
    }

    async fn next_event(&mut self) -> Option<Result<ExecEvent>> {
        if self.done {
            return None;
        }
        loop {
            let deadline = self.deadline.filter(|_| self.killed_at.is_none());
            let drain_end = self.killed_at.map(|t| t + DRAIN_AFTER_KILL);
            let abort = self.abort.clone().filter(|_| self.killed_at.is_none());
            tokio::select! {
                biased;
                err = stdin_failure(&mut self.stdin_failed) => {
                    if let Some(e) = err {
                        self.kill(ExitReason::Exited);
                        self.done = true;
                        let _ = self.lease.send(&Host::Kill { id: self.id }, b"");
                        self.lease.unregister(self.id);
                        return Some(Err(e));
                    }
                    // The feeder finished cleanly: never poll it again.
                    self.stdin_failed = None;
                }
                ev = self.events.recv() => {
                    match ev {
                        Some(Event::Stdout(b)) => {
                            let _ = self.lease.send(&Host::Credit { id: self.id, bytes: b.len() as u64 }, b"");
                            return Some(Ok(ExecEvent::Stdout(b)));
                        }
                        Some(Event::Stderr(b)) => {
                            let _ = self.lease.send(&Host::Credit { id: self.id, bytes: b.len() as u64 }, b"");
                            return Some(Ok(ExecEvent::Stderr(b)));
                        }
                        Some(Event::Exit { code, signal }) => {
                            self.done = true;
                            return Some(Ok(ExecEvent::Exit(ExitStatus { code, signal, reason: self.reason })));
                        }
                        Some(Event::Started) | Some(Event::Failed(_)) => continue,
                        None => {
                            self.done = true;
                            return Some(Err(Error::backend(
                                "the microVM agent connection closed while a command ran (the VM stopped?)",
                            )));
                        }
                    }
                }
                () = sleep_until(deadline) => self.kill(ExitReason::TimedOut),
                () = aborted(abort) => self.kill(ExitReason::Aborted),
                () = sleep_until(drain_end) => {
                    self.done = true;
                    self.lease.unregister(self.id);
                    return Some(Ok(ExecEvent::Exit(ExitStatus { code: None, signal: Some(9), reason: self.reason })));
                }
            }
        }
    }
}

/// Start `plan` on the agent behind `socket`. Returns once the process
/// started (a missing program or cwd is an error here).
pub(crate) async fn start(
    socket: &Path,
    connect_timeout: Duration,
    plan: Plan,
) -> Result<ExecStream> {
    let lease = conn::lease(socket, connect_timeout).await?;
    let mut reg = lease.register();
    let id = reg.id;
    reg.stdin_credit.add_permits(WINDOW as usize);
    lease.send(
        &Host::Exec {
            id,
            argv: plan.argv.clone(),
            env: plan.env.into_iter().collect(),
            cwd: plan.cwd,
            stdin: plan.stdin.is_some(),
        },
        b"",
    )?;
    // The agent answers every exec with Started or Failed at once (it spawns
    // on a thread of its own): no answer within the connect timeout is a
    // guest that stopped answering, not a slow command.
    let first = match tokio::time::timeout(connect_timeout, reg.events.recv()).await {
        Ok(first) => first,
        Err(_) => {
            lease.unregister(id);
            let _ = lease.send(&Host::Kill { id }, b"");
            return Err(Error::backend(format!(
                "the microVM agent did not start the command within {connect_timeout:?} \
                 (the guest stopped answering)"
            )));
        }
    };
    match first {
        Some(Event::Started) => {}
        Some(Event::Failed(message)) => {
            lease.unregister(id);
            let kind = if message.contains("No such file") || message.contains("not found") {
                ErrorKind::NotFound
            } else {
                ErrorKind::InvalidInput
            };
            return Err(Error::new(kind, message));
        }
        Some(other) => {
            lease.unregister(id);
            return Err(Error::backend(format!(
                "the microVM agent answered an exec with {other:?}"
            )));
        }
        None => {
            return Err(Error::backend(
                "the microVM agent connection closed before the command started",
            ))
        }
    }
    let (fail_tx, fail_rx) = oneshot::channel();
    let fail_rx = plan.stdin.is_some().then_some(fail_rx);
    if let Some(mut source) = plan.stdin {
        let conn = lease.conn();
        let credit = reg.stdin_credit.clone();
        tokio::spawn(async move {
            while let Some(chunk) = source.next().await {
                match chunk {
                    Ok(chunk) => {
                        for piece in chunk.chunks(CHUNK) {
                            let Ok(permit) = credit.acquire_many(piece.len() as u32).await else {
                                return;
                            };
                            permit.forget();
                            if conn.send(&Host::Stdin { id, eof: false }, piece).is_err() {
                                return;
                            }
                        }
                    }
                    Err(e) => {
                        let _ = fail_tx.send(e);
                        return;
                    }
                }
            }
            let _ = conn.send(&Host::Stdin { id, eof: true }, b"");
        });
    }
    let running = Running {
        lease,
        id,
        events: reg.events,
        stdin_failed: fail_rx,
        deadline: plan.timeout.map(|t| tokio::time::Instant::now() + t),
        abort: plan.abort,
        reason: ExitReason::Exited,
        killed_at: None,
        done: false,
    };
    Ok(Box::pin(futures::stream::unfold(
        running,
        |mut r| async move {
            let ev = r.next_event().await?;
            Some((ev, r))
        },
    )))
}
