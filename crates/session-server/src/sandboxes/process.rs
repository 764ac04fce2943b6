//! Commands run through the API: each runs in a task of the server, not of
//! the request, so a client that goes away (a process that detached, a
//! dropped connection) does not kill it; `kill` (or `stop`, `destroy`)
//! does. Its output goes to the request that started it while that request
//! reads, and is dropped after: nothing the command writes can block it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use futures::StreamExt;
use harness_core::sandbox::{ExecEvent, ExecStream, ExitStatus};
use harness_core::stream::AbortSignal;
use tokio::sync::mpsc;

/// What a running command sends to the request that started it.
#[derive(Debug)]
pub(crate) enum Event {
    Stdout(bytes::Bytes),
    Stderr(bytes::Bytes),
    Exit(ExitStatus),
    Error(harness_core::Error),
}

#[derive(Debug, Clone)]
struct Entry {
    sandbox: String,
    abort: AbortSignal,
}

/// The running commands of every API sandbox.
#[derive(Debug, Default)]
pub(crate) struct Processes {
    running: Mutex<HashMap<String, Entry>>,
}

impl Processes {
    /// Drive `stream` (a command of `sandbox` whose abort signal is
    /// `abort`) in its own task; the events come out of the receiver.
    pub(crate) fn start(
        self: &Arc<Self>,
        sandbox: &str,
        abort: AbortSignal,
        mut stream: ExecStream,
    ) -> (String, mpsc::UnboundedReceiver<Event>) {
        let id = format!("p-{}", &uuid::Uuid::new_v4().simple().to_string()[..16]);
        self.lock().insert(
            id.clone(),
            Entry {
                sandbox: sandbox.to_string(),
                abort,
            },
        );
        let (tx, rx) = mpsc::unbounded_channel();
        let table = self.clone();
        let key = id.clone();
        tokio::spawn(async move {
            // A send to a request that went away fails: the output is
            // dropped, the command keeps running.
            while let Some(event) = stream.next().await {
                let (event, last) = match event {
                    Ok(ExecEvent::Stdout(b)) => (Event::Stdout(b), false),
                    Ok(ExecEvent::Stderr(b)) => (Event::Stderr(b), false),
                    Ok(ExecEvent::Exit(status)) => (Event::Exit(status), true),
                    Err(e) => (Event::Error(e), true),
                };
                let _ = tx.send(event);
                if last {
                    break;
                }
            }
            table.lock().remove(&key);
        });
        (id, rx)
    }

    /// Kill process `id` of `sandbox`; false if there is no such running
    /// process.
    pub(crate) fn kill(&self, sandbox: &str, id: &str) -> bool {
        match self.lock().get(id) {
            Some(entry) if entry.sandbox == sandbox => {
                entry.abort.abort();
                true
            }
            _ => false,
        }
    }

    /// Kill every running process of `sandbox`; how many there were.
    pub(crate) fn kill_all(&self, sandbox: &str) -> usize {
        let running = self.lock();
        let mut n = 0;
        for entry in running.values().filter(|e| e.sandbox == sandbox) {
            entry.abort.abort();
            n += 1;
        }
        n
    }

    /// How many processes of `sandbox` run.
    pub(crate) fn count(&self, sandbox: &str) -> usize {
        self.lock()
            .values()
            .filter(|e| e.sandbox == sandbox)
            .count()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        self.running.lock().unwrap_or_else(|e| e.into_inner())
    }
}
