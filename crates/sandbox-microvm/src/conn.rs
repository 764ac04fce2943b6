//! The host side of the agent protocol: one connection per VM and process,
//! multiplexing every exec of every `Sandbox` object this process holds for
//! that VM.
//!
//! QEMU's socket chardev serves one client at a time; another client's
//! `connect` waits in the listen backlog until the first disconnects. So a
//! connection is dropped once nothing uses it for [`LINGER`]: another
//! process resuming the same VM gets its turn then.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use bytes::Bytes;
use harness_core::{Error, Result};
use harness_microvm_agent::{encode, Decoder, Guest, Host};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::sync::{mpsc, Semaphore};

/// How long an unused connection stays open.
pub(crate) const LINGER: Duration = Duration::from_millis(1500);

/// What the reader hands an exec.
#[derive(Debug)]
pub(crate) enum Event {
    Started,
    Failed(String),
    Stdout(Bytes),
    Stderr(Bytes),
    Exit {
        code: Option<i32>,
        signal: Option<i32>,
    },
}

#[derive(Debug)]
struct Route {
    events: mpsc::UnboundedSender<Event>,
    stdin_credit: Arc<Semaphore>,
}

type Routes = Arc<Mutex<HashMap<u64, Route>>>;

/// One open connection to a VM's agent.
#[derive(Debug)]
pub(crate) struct Conn {
    frames: mpsc::UnboundedSender<Vec<u8>>,
    routes: Routes,
    next_id: AtomicU64,
    closed: Arc<std::sync::atomic::AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Conn {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// Where an exec's frames arrive.
#[derive(Debug)]
pub(crate) struct Registration {
    pub id: u64,
    pub events: mpsc::UnboundedReceiver<Event>,
    pub stdin_credit: Arc<Semaphore>,
}

impl Conn {
    pub(crate) fn send(&self, header: &Host, payload: &[u8]) -> Result<()> {
        self.frames
            .send(encode(header, payload))
            .map_err(|_| Error::backend("the connection to the microVM agent is closed"))
    }

    pub(crate) fn register(&self) -> Registration {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::unbounded_channel();
        let credit = Arc::new(Semaphore::new(0));
        self.routes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(
                id,
                Route {
                    events: tx,
                    stdin_credit: credit.clone(),
                },
            );
        Registration {
            id,
            events: rx,
            stdin_credit: credit,
        }
    }

    pub(crate) fn unregister(&self, id: u64) {
        self.routes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&id);
    }
}

/// A use of a connection; dropping it keeps the connection open for
/// [`LINGER`] more.
#[derive(Debug)]
pub(crate) struct Lease(Option<Arc<Conn>>);

impl std::ops::Deref for Lease {
    type Target = Conn;
    fn deref(&self) -> &Conn {
        self.0
            .as_ref()
            .expect("lease holds a connection until dropped")
    }
}

impl Lease {
    /// The connection itself, for a task that outlives the lease's user.
    pub(crate) fn conn(&self) -> Arc<Conn> {
        self.0
            .clone()
            .expect("lease holds a connection until dropped")
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(conn) = self.0.take() {
            if let Ok(handle) = tokio::runtime::Handle::try_current() {
                handle.spawn(async move {
                    tokio::time::sleep(LINGER).await;
                    drop(conn);
                });
            }
        }
    }
}

type Slot = Arc<tokio::sync::Mutex<Weak<Conn>>>;

fn registry() -> &'static Mutex<HashMap<PathBuf, Slot>> {
    static REG: std::sync::OnceLock<Mutex<HashMap<PathBuf, Slot>>> = std::sync::OnceLock::new();
    REG.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Forget the connection to `socket` (its VM was stopped or destroyed).
pub(crate) fn forget(socket: &Path) {
    registry()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(socket);
}

/// A lease on this process's connection to the agent behind `socket`,
/// connecting (and waiting up to `timeout` for the agent's hello) if there
/// is none.
pub(crate) async fn lease(socket: &Path, timeout: Duration) -> Result<Lease> {
    let slot = registry()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .entry(socket.to_path_buf())
        .or_default()
        .clone();
    let mut weak = slot.lock().await;
    if let Some(conn) = weak.upgrade() {
        if !conn.closed.load(Ordering::SeqCst) {
            return Ok(Lease(Some(conn)));
        }
    }
    let conn = Arc::new(connect(socket, timeout).await?);
    *weak = Arc::downgrade(&conn);
    Ok(Lease(Some(conn)))
}

async fn connect(socket: &Path, timeout: Duration) -> Result<Conn> {
    let deadline = tokio::time::Instant::now() + timeout;
    let stream = loop {
        match UnixStream::connect(socket).await {
            Ok(s) => break s,
            Err(e) if tokio::time::Instant::now() < deadline => {
                tracing::trace!("connecting to {}: {e}", socket.display());
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => {
                return Err(Error::backend(format!(
                    "cannot connect to the microVM agent at {}: {e}",
                    socket.display()
                )))
            }
        }
    };
    let (mut rd, mut wr) = stream.into_split();
    let nonce: u64 = uuid::Uuid::new_v4().as_u64_pair().0;
    wr.write_all(&encode(&Host::Hello { nonce }, b""))
        .await
        .map_err(|e| Error::backend(format!("writing to the microVM agent: {e}")))?;
    // Wait for our hello: anything before it is left from an earlier
    // connection.
    let mut decoder = Decoder::new();
    let mut buf = vec![0u8; 256 * 1024];
    let greeted = async {
        loop {
            while let Some((frame, _)) = decoder.next_frame::<Guest>() {
                if let Guest::Hello { nonce: n, .. } = frame {
                    if n == nonce {
                        return Ok(());
                    }
                }
            }
            let n = rd
                .read(&mut buf)
                .await
                .map_err(|e| Error::backend(format!("reading from the microVM agent: {e}")))?;
            if n == 0 {
                return Err(Error::backend(
                    "the microVM closed the agent connection (did the VM stop?)",
                ));
            }
            decoder.push(&buf[..n]);
        }
    };
    match tokio::time::timeout_at(deadline, greeted).await {
        Ok(r) => r?,
        Err(_) => {
            return Err(Error::backend(format!(
                "the microVM agent at {} did not answer within {timeout:?} \
                 (still booting, hung, or another process holds its connection)",
                socket.display()
            )))
        }
    }
    let routes: Routes = Arc::new(Mutex::new(HashMap::new()));
    let (tx, mut frames) = mpsc::unbounded_channel::<Vec<u8>>();
    let writer = tokio::spawn(async move {
        while let Some(frame) = frames.recv().await {
            if wr.write_all(&frame).await.is_err() {
                break;
            }
        }
    });
    let r = routes.clone();
    let closed = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let c = closed.clone();
    let reader = tokio::spawn(async move {
        loop {
            while let Some((frame, payload)) = decoder.next_frame::<Guest>() {
                dispatch(&r, frame, payload);
            }
            match rd.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => decoder.push(&buf[..n]),
            }
        }
        // The connection is gone: every exec still waiting learns it by its
        // channel closing.
        c.store(true, Ordering::SeqCst);
        r.lock().unwrap_or_else(|e| e.into_inner()).clear();
    });
    Ok(Conn {
        frames: tx,
        routes,
        next_id: AtomicU64::new(1),
        closed,
        tasks: vec![writer, reader],
    })
}

fn dispatch(routes: &Routes, frame: Guest, payload: Vec<u8>) {
    let mut map = routes.lock().unwrap_or_else(|e| e.into_inner());
    let (id, event) = match frame {
        Guest::Hello { .. } => return,
        Guest::Started { id, .. } => (id, Event::Started),
        Guest::Failed { id, message } => (id, Event::Failed(message)),
        Guest::Stdout { id } => (id, Event::Stdout(Bytes::from(payload))),
        Guest::Stderr { id } => (id, Event::Stderr(Bytes::from(payload))),
        Guest::StdinCredit { id, bytes } => {
            if let Some(route) = map.get(&id) {
                route.stdin_credit.add_permits(bytes as usize);
            }
            return;
        }
        Guest::Exit { id, code, signal } => (id, Event::Exit { code, signal }),
    };
    let last = matches!(event, Event::Exit { .. } | Event::Failed(_));
    if let Some(route) = map.get(&id) {
        let _ = route.events.send(event);
    }
    if last {
        map.remove(&id);
    }
}
