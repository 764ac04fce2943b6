//! The actor runtime: one tokio task per live session, each driving one
//! [`SessionActor`] over the [`SessionLog`].
//!
//! ## Who sequences, and why there are no locks on the hot path
//!
//! The log assigns seqs; the actor task is the only writer of its session,
//! and it handles one command at a time: it feeds the machine an input,
//! performs the machine's outputs *in order* (an `Append` is awaited and its
//! result fed back at once, before the next output or command), and only
//! then takes the next command. Fan-out is a push onto each connection's
//! unbounded channel, so a slow reader never stalls the actor (it only grows
//! its own queue). The only lock is the registry's, held for a map lookup
//! and a channel send.
//!
//! ## Never two actors for one session
//!
//! The registry maps a session to the command sender of its one task.
//! Commands that open a connection (`Connect`) are sent *while holding the
//! registry lock*. A task with no connections left waits `idle_timeout`,
//! then takes the registry lock, and retires only if its queue is empty:
//! it removes its own entry (matched by epoch) and closes its queue before
//! releasing the lock. So a `Connect` is either already in the queue (and
//! the task stays) or arrives after the removal (and starts a fresh task,
//! which recovers from the log). Messages from a connection can only follow
//! its `Connect`, and a task never retires while it has connections.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use harness_core::actor::{
    ActorConfig, ClientMessage, ConnId, Input, Output, Role, RunnerMessage, ServerMessage,
    SessionActor,
};
use harness_core::log::{now_ms, SessionLog};
use harness_core::{Error, Frame, SessionId};
use tokio::sync::{mpsc, oneshot};

use crate::error::ApiError;

/// Frames read from the log per page (replay, recovery).
pub(crate) const PAGE: usize = 1000;

/// Messages queued for one connection before the actor gives up on it. A
/// reader this far behind is dropped (its stream ends after the queued
/// messages) and resumes from its last seq, instead of growing the
/// server's memory without bound.
pub(crate) const MAX_QUEUED: usize = 10_000;

/// The actor's end of a connection's queue, with its depth.
#[derive(Debug, Clone)]
struct OutTx {
    tx: mpsc::UnboundedSender<Outbound>,
    depth: Arc<AtomicUsize>,
}

impl OutTx {
    /// Queue a message; false when the reader is gone or too far behind.
    fn push(&self, out: Outbound) -> bool {
        if self.depth.fetch_add(1, Ordering::AcqRel) >= MAX_QUEUED {
            return false;
        }
        self.tx.send(out).is_ok()
    }
}

/// What a connection receives.
#[derive(Debug, Clone)]
pub(crate) enum Outbound {
    /// A message for the peer.
    Msg(ServerMessage),
    /// The actor closed the connection (e.g. a fenced runner).
    Close(String),
}

enum Command {
    Connect {
        role: Role,
        after: Option<u64>,
        out: OutTx,
        reply: oneshot::Sender<Result<ConnId, ApiError>>,
    },
    Input(Input),
}

struct Entry {
    epoch: u64,
    tx: mpsc::UnboundedSender<Command>,
}

/// The registry of live session actors.
pub(crate) struct Hub {
    pub(crate) log: Arc<dyn SessionLog>,
    actor_config: ActorConfig,
    idle_timeout: Duration,
    registry: Mutex<HashMap<SessionId, Entry>>,
    epochs: AtomicU64,
}

impl std::fmt::Debug for Hub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hub")
            .field("log", &self.log)
            .field("live", &self.live_sessions())
            .finish()
    }
}

/// One open connection to a session actor. Dropping it disconnects.
#[derive(Debug)]
pub(crate) struct Connection {
    pub(crate) id: ConnId,
    rx: mpsc::UnboundedReceiver<Outbound>,
    depth: Arc<AtomicUsize>,
    tx: mpsc::UnboundedSender<Command>,
}

impl std::fmt::Debug for Command {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Command::Connect { role, after, .. } => f
                .debug_struct("Connect")
                .field("role", role)
                .field("after", after)
                .finish(),
            Command::Input(i) => f.debug_tuple("Input").field(i).finish(),
        }
    }
}

impl Connection {
    /// The next message for this connection; `None` when the actor dropped
    /// it (stopped, or the reader fell `MAX_QUEUED` behind).
    pub(crate) async fn recv(&mut self) -> Option<Outbound> {
        let out = self.rx.recv().await;
        if out.is_some() {
            self.depth.fetch_sub(1, Ordering::AcqRel);
        }
        out
    }

    /// Send a client message (the answer arrives on `rx`).
    pub(crate) fn client(&self, message: ClientMessage) {
        let _ = self.tx.send(Command::Input(Input::Client {
            conn: self.id,
            message,
        }));
    }

    /// Send a runner message.
    pub(crate) fn runner(&self, message: RunnerMessage) {
        let _ = self.tx.send(Command::Input(Input::Runner {
            conn: self.id,
            message,
        }));
    }

    /// Wait for the answer (`Ack` or `Error`) to the one message this
    /// connection sent, skipping the frames fanned out meanwhile.
    pub(crate) async fn answer(&mut self, timeout: Duration) -> Result<(u64, bool), ApiError> {
        let wait = async {
            while let Some(out) = self.recv().await {
                match out {
                    Outbound::Msg(ServerMessage::Ack { seq, duplicate }) => {
                        return Ok((seq, duplicate))
                    }
                    Outbound::Msg(ServerMessage::Error { code, message }) => {
                        return Err(ApiError::from_actor(&code, &message))
                    }
                    Outbound::Msg(_) => {}
                    Outbound::Close(reason) => {
                        return Err(ApiError::from_actor("closed", &reason));
                    }
                }
            }
            Err(ApiError::from_actor("closed", "the session actor stopped"))
        };
        tokio::time::timeout(timeout, wait)
            .await
            .unwrap_or_else(|_| {
                Err(ApiError::new(
                    axum::http::StatusCode::GATEWAY_TIMEOUT,
                    "timed_out",
                    "the session did not answer in time",
                ))
            })
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        let _ = self
            .tx
            .send(Command::Input(Input::Disconnect { conn: self.id }));
    }
}

impl Hub {
    pub(crate) fn new(
        log: Arc<dyn SessionLog>,
        actor_config: ActorConfig,
        idle_timeout: Duration,
    ) -> Self {
        Self {
            log,
            actor_config,
            idle_timeout,
            registry: Mutex::new(HashMap::new()),
            epochs: AtomicU64::new(1),
        }
    }

    /// Sessions with a running actor.
    pub(crate) fn live_sessions(&self) -> Vec<SessionId> {
        let mut v: Vec<SessionId> = self
            .registry
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .keys()
            .cloned()
            .collect();
        v.sort();
        v
    }

    /// Open a connection to `session`'s actor, starting it if needed.
    pub(crate) async fn connect(
        self: &Arc<Self>,
        session: &SessionId,
        role: Role,
        after: Option<u64>,
    ) -> Result<Connection, ApiError> {
        // A retry covers the window where a task died between our lookup
        // and its reply (it never happens in normal operation).
        for _ in 0..3 {
            let (out_tx, out_rx) = mpsc::unbounded_channel();
            let depth = Arc::new(AtomicUsize::new(0));
            let (reply_tx, reply_rx) = oneshot::channel();
            let tx = {
                let mut registry = self.registry.lock().unwrap_or_else(|e| e.into_inner());
                let entry = registry
                    .entry(session.clone())
                    .or_insert_with(|| self.spawn_actor(session.clone()));
                let cmd = Command::Connect {
                    role,
                    after,
                    out: OutTx {
                        tx: out_tx,
                        depth: depth.clone(),
                    },
                    reply: reply_tx,
                };
                if entry.tx.send(cmd).is_err() {
                    registry.remove(session);
                    continue;
                }
                entry.tx.clone()
            };
            match reply_rx.await {
                Ok(Ok(id)) => {
                    return Ok(Connection {
                        id,
                        rx: out_rx,
                        depth,
                        tx,
                    })
                }
                Ok(Err(e)) => return Err(e),
                Err(_) => continue,
            }
        }
        Err(ApiError::from(Error::backend(format!(
            "the actor of session {session} keeps failing"
        ))))
    }

    /// Seal through the actor, so live clients see the seal frame and the
    /// actor refuses later writes itself.
    pub(crate) async fn seal(self: &Arc<Self>, session: &SessionId) -> Result<(), ApiError> {
        let mut conn = self.connect(session, Role::Client, None).await?;
        conn.client(ClientMessage::Seal {});
        conn.answer(Duration::from_secs(30)).await.map(|_| ())
    }

    fn spawn_actor(self: &Arc<Self>, session: SessionId) -> Entry {
        let (tx, rx) = mpsc::unbounded_channel();
        let epoch = self.epochs.fetch_add(1, Ordering::Relaxed);
        tokio::spawn(run_actor(self.clone(), session, epoch, rx));
        Entry { epoch, tx }
    }

    /// Remove the task's entry if its queue is empty; true when retired.
    /// Called with no connections open.
    fn try_retire(
        &self,
        session: &SessionId,
        epoch: u64,
        rx: &mut mpsc::UnboundedReceiver<Command>,
    ) -> bool {
        let mut registry = self.registry.lock().unwrap_or_else(|e| e.into_inner());
        if !rx.is_empty() {
            return false;
        }
        if registry.get(session).is_some_and(|e| e.epoch == epoch) {
            registry.remove(session);
        }
        rx.close();
        true
    }

    /// A task that could not start: leave the registry and refuse what was
    /// queued (every queued command is a `Connect`: nothing else can come
    /// before a connection exists).
    fn fail_start(
        &self,
        session: &SessionId,
        epoch: u64,
        mut rx: mpsc::UnboundedReceiver<Command>,
        error: ApiError,
    ) {
        {
            let mut registry = self.registry.lock().unwrap_or_else(|e| e.into_inner());
            if registry.get(session).is_some_and(|e| e.epoch == epoch) {
                registry.remove(session);
            }
            rx.close();
        }
        while let Ok(cmd) = rx.try_recv() {
            if let Command::Connect { reply, .. } = cmd {
                let _ = reply.send(Err(error.clone()));
            }
        }
    }
}

/// Rebuild the machine's state by folding every stored frame.
async fn recover(
    log: &dyn SessionLog,
    session: &SessionId,
    config: ActorConfig,
) -> harness_core::Result<SessionActor> {
    let mut actor = SessionActor::new(config);
    log.info(session).await?;
    let mut after = 0;
    loop {
        let page = log.read(session, after, PAGE).await?;
        let Some(last) = page.last() else { break };
        after = last.seq;
        for frame in &page {
            actor.recover(frame);
        }
    }
    Ok(actor)
}

struct ActorTask {
    log: Arc<dyn SessionLog>,
    session: SessionId,
    actor: SessionActor,
    conns: HashMap<ConnId, OutTx>,
    next_conn: ConnId,
}

async fn run_actor(
    hub: Arc<Hub>,
    session: SessionId,
    epoch: u64,
    mut rx: mpsc::UnboundedReceiver<Command>,
) {
    let actor = match recover(hub.log.as_ref(), &session, hub.actor_config.clone()).await {
        Ok(actor) => actor,
        Err(e) => {
            hub.fail_start(&session, epoch, rx, ApiError::from(e));
            return;
        }
    };
    tracing::debug!(%session, last_seq = actor.last_seq(), "session actor started");
    let mut task = ActorTask {
        log: hub.log.clone(),
        session: session.clone(),
        actor,
        conns: HashMap::new(),
        next_conn: 1,
    };
    loop {
        let cmd = if task.conns.is_empty() {
            match tokio::time::timeout(hub.idle_timeout, rx.recv()).await {
                Ok(cmd) => cmd,
                Err(_) => {
                    if hub.try_retire(&session, epoch, &mut rx) {
                        tracing::debug!(%session, "session actor stopped (idle)");
                        return;
                    }
                    continue;
                }
            }
        } else {
            rx.recv().await
        };
        // `None` only once the queue is closed, i.e. after retiring.
        let Some(cmd) = cmd else { return };
        task.handle(cmd).await;
    }
}

impl ActorTask {
    async fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Connect {
                role,
                after,
                out,
                reply,
            } => {
                let conn = self.next_conn;
                self.next_conn += 1;
                if reply.send(Ok(conn)).is_err() {
                    // The caller gave up before we answered: nothing to do.
                    return;
                }
                self.conns.insert(conn, out);
                let outputs = self.actor.handle(Input::Connect { conn, role, after });
                self.perform(outputs).await;
            }
            Command::Input(input) => {
                if let Input::Disconnect { conn } = &input {
                    self.conns.remove(conn);
                }
                let outputs = self.actor.handle(input);
                self.perform(outputs).await;
            }
        }
    }

    /// Perform outputs in order; an append's result is fed back at once and
    /// its outputs run before the rest.
    async fn perform(&mut self, outputs: Vec<Output>) {
        let mut queue: VecDeque<Output> = outputs.into();
        while let Some(output) = queue.pop_front() {
            match output {
                Output::Append(request) => {
                    let input = self.append(request).await;
                    let more = self.actor.handle(input);
                    for o in more.into_iter().rev() {
                        queue.push_front(o);
                    }
                }
                Output::Replay { conn, after, until } => self.replay(conn, after, until).await,
                Output::Send { conn, message } => {
                    self.deliver(conn, Outbound::Msg(message));
                }
                Output::Close { conn, reason } => {
                    self.deliver(conn, Outbound::Close(reason));
                }
            }
        }
    }

    /// Queue a message for a connection; a connection that is gone or too
    /// far behind is dropped here (its handler sees the end of its queue).
    fn deliver(&mut self, conn: ConnId, out: Outbound) -> bool {
        let Some(tx) = self.conns.get(&conn) else {
            return false;
        };
        if tx.push(out) {
            return true;
        }
        tracing::warn!(session = %self.session, conn, "dropping a connection that fell behind");
        self.conns.remove(&conn);
        false
    }

    async fn append(&mut self, request: harness_core::log::AppendRequest) -> Input {
        match self.log.append(&self.session, request.clone()).await {
            Ok(a) if a.duplicate => Input::Appended {
                // Nothing is fanned out for a duplicate; only the seq is used.
                frame: Frame {
                    seq: a.seq,
                    at_ms: 0,
                    body: request.body,
                },
                duplicate: true,
            },
            Ok(a) => {
                // Read the frame back so live clients get exactly what a
                // replay would give them (the log stamps `at_ms`).
                let frame = match self.log.read(&self.session, a.seq - 1, 1).await {
                    Ok(mut v) if v.len() == 1 && v[0].seq == a.seq => v.remove(0),
                    _ => Frame {
                        seq: a.seq,
                        at_ms: now_ms(),
                        body: request.body,
                    },
                };
                Input::Appended {
                    frame,
                    duplicate: false,
                }
            }
            Err(e) => Input::AppendFailed {
                error: e.to_string(),
            },
        }
    }

    async fn replay(&mut self, conn: ConnId, after: u64, until: u64) {
        let mut cursor = after;
        while cursor < until {
            let want = usize::try_from(until - cursor).unwrap_or(PAGE).min(PAGE);
            match self.log.read(&self.session, cursor, want).await {
                Ok(page) if page.is_empty() => break,
                Ok(page) => {
                    for frame in page {
                        if frame.seq > until {
                            return;
                        }
                        cursor = frame.seq;
                        if !self.deliver(conn, Outbound::Msg(ServerMessage::Frame { frame })) {
                            return;
                        }
                    }
                }
                Err(e) => {
                    // A reader with a hole in its history must not go on as
                    // if it had everything: tell it and close.
                    let error = ServerMessage::Error {
                        code: "replay_failed".into(),
                        message: format!("could not read frames after {cursor}: {e}"),
                    };
                    self.deliver(conn, Outbound::Msg(error));
                    self.deliver(conn, Outbound::Close("replay failed".into()));
                    return;
                }
            }
        }
    }
}
