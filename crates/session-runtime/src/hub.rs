//! [`Hub`]: one tokio task per live session, each running core's
//! [`ActorDriver`] over the [`SessionLog`] with a channel per connection.
//!
//! ## Who sequences, and why there are no locks on the hot path
//!
//! The log assigns seqs; the actor task is the only writer of its session,
//! and it handles one command at a time through the driver, which performs
//! the machine's outputs in order (an append's stored frame is fed back at
//! once). Fan-out is a push onto each connection's unbounded channel, so a
//! slow reader never stalls the actor (it only grows its own queue, up to
//! [`MAX_QUEUED`]). The only lock is the registry's, held for a map lookup
//! and a channel send.
//!
//! ## Never two actors for one session
//!
//! The registry maps a session to the command sender of its one task.
//! Commands that reach a task (`Connect`, and inputs from the runtime) are
//! sent *while holding the registry lock*. A task with no connections left
//! waits `idle_timeout`, then takes the registry lock, and retires only if
//! its queue is empty: it removes its own entry (matched by epoch) and
//! closes its queue before releasing the lock. So a command is either
//! already queued (and the task stays) or arrives after the removal (and
//! starts a fresh task, which recovers from the log's stored meta).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock, Weak};
use std::time::Duration;

use harness_core::actor::{
    ActorConfig, ClientMessage, ConnId, ErrorCode, Input, Role, RunnerMessage, ServerMessage,
};
use harness_core::actor_driver::{ActorDriver, Transport};
use harness_core::clock::Clock;
use harness_core::frame::{Frame, FrameBody};
use harness_core::log::retention;
pub use harness_core::log::retention::SandboxRemoval;
use harness_core::log::{Claim, LogInfo, LogSession, SessionLeases, SessionLog, SessionStore};
use harness_core::relay::HostMessage;
use harness_core::sandbox::SandboxProvider;
use harness_core::session::TurnCommand;
use harness_core::{Error, SessionId};
use tokio::sync::{mpsc, oneshot};

use crate::dispatch::Dispatcher;
use crate::SystemClock;

mod forward;
mod lease;

/// Messages queued for one connection before the actor gives up on it. A
/// reader this far behind is dropped (its stream ends after the queued
/// messages) and resumes from its last seq, instead of growing the
/// server's memory without bound.
pub const MAX_QUEUED: usize = 10_000;

/// Most commands an actor takes from its queue into one batch (one group
/// commit of their appends).
pub const MAX_BATCH: usize = 256;

/// Orphaned sessions one sweep takes over at most ([`Hub::sweep_orphans`]).
const SWEEP_BATCH: usize = 100;

/// How the hub runs its actors.
#[derive(Debug, Clone)]
pub struct HubConfig {
    /// The actor's limits (frame size).
    pub actor: ActorConfig,
    /// A session actor with no connections stops after this long.
    pub idle_timeout: Duration,
    /// Most queued commands an actor handles as one batch, whose appends
    /// are committed together ([`MAX_BATCH`]; 1 handles every command on
    /// its own, each append its own commit).
    pub max_batch: usize,
    /// The time the actors are fed ([`Input::Tick`]: host calls' deadlines);
    /// the system clock by default, the runtime's own under a
    /// [`Runtime`](crate::Runtime).
    pub clock: Arc<dyn Clock>,
    /// Several nodes over one shared log: the session leases that decide
    /// which node runs each session's actor (`None`: this hub is the only
    /// one, every session's actor runs here). A node without a session's
    /// lease forwards its connections to the owner (`hub/forward.rs`).
    pub leases: Option<Arc<dyn SessionLeases>>,
    /// The token this node presents to its peers when it forwards a
    /// connection to a session's owner (a host grant every node accepts);
    /// `None` when the nodes run without authentication.
    pub peer_token: Option<String>,
}

impl Default for HubConfig {
    fn default() -> Self {
        Self {
            actor: ActorConfig::default(),
            idle_timeout: Duration::from_secs(30),
            max_batch: MAX_BATCH,
            clock: Arc::new(SystemClock),
            leases: None,
            peer_token: None,
        }
    }
}

/// The actor's end of a connection's queue, with its depth (in
/// messages: a run of frames counts each).
#[derive(Debug, Clone)]
struct OutTx {
    tx: mpsc::UnboundedSender<Queued>,
    depth: Arc<AtomicUsize>,
}

impl OutTx {
    /// Queue a message; false when the reader is gone or too far behind.
    fn push(&self, out: Queued) -> bool {
        if self.depth.fetch_add(out.len(), Ordering::AcqRel) >= MAX_QUEUED {
            return false;
        }
        self.tx.send(out).is_ok()
    }
}

/// What goes through a connection's queue: a pointer each, so a push
/// copies little into the queue's blocks.
#[derive(Debug)]
enum Queued {
    /// A message for this connection only.
    One(Box<Outbound>),
    /// A stored frame.
    Frame(SharedFrame),
    /// Frames fanned out one after the other to the same connections (the
    /// appends of one batch): one push per reader for all of them. Never
    /// empty.
    Frames(Arc<[SharedFrame]>),
    /// A message fanned out to many (a live part): copied out by each
    /// reader, on its own task.
    Shared(Arc<ServerMessage>),
}

impl Queued {
    fn one(out: Outbound) -> Self {
        match out {
            Outbound::Frame(frame) => Queued::Frame(frame),
            out => Queued::One(Box::new(out)),
        }
    }

    fn len(&self) -> usize {
        match self {
            Queued::Frames(frames) => frames.len(),
            _ => 1,
        }
    }
}

/// What a connection receives.
// `Msg` is the large variant (a server message can carry a turn status with
// its sandbox handle); stored frames, nearly all traffic, travel as the
// shared pointer, so boxing the rare message would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone)]
pub enum Outbound {
    /// A message for the peer (never a stored frame: those come as
    /// [`Outbound::Frame`]).
    Msg(ServerMessage),
    /// A stored frame ([`ServerMessage::Frame`]), replayed or fanned out;
    /// one copy shared by every connection it went to.
    Frame(SharedFrame),
    /// The actor closed the connection (e.g. a fenced runner).
    Close(String),
}

impl Outbound {
    /// The message, a stored frame as [`ServerMessage::Frame`]; `Err` with
    /// the reason for a close.
    pub fn into_message(self) -> Result<ServerMessage, String> {
        match self {
            Outbound::Msg(message) => Ok(message),
            Outbound::Frame(frame) => Ok(ServerMessage::Frame {
                frame: frame.into_frame(),
            }),
            Outbound::Close(reason) => Err(reason),
        }
    }
}

/// A stored frame as the actor fans it out: made once and shared by all
/// its readers, with its JSON encoded once, by the first reader that asks
/// ([`json`](Self::json)), so a thousand SSE readers cost one encoding.
#[derive(Clone)]
pub struct SharedFrame(Arc<SharedInner>);

struct SharedInner {
    frame: Frame,
    json: OnceLock<Vec<u8>>,
}

impl std::fmt::Debug for SharedFrame {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.frame.fmt(f)
    }
}

impl SharedFrame {
    /// Share `frame`.
    pub fn new(frame: Frame) -> Self {
        Self(Arc::new(SharedInner {
            frame,
            json: OnceLock::new(),
        }))
    }

    /// The frame.
    pub fn frame(&self) -> &Frame {
        &self.0.frame
    }

    /// The frame's compact JSON (`serde_json::to_vec(frame)`), encoded on
    /// the first call and shared from then on.
    pub fn json(&self) -> &[u8] {
        self.0.json.get_or_init(|| {
            // Frames are plain data: encoding cannot fail.
            serde_json::to_vec(&self.0.frame).unwrap_or_default()
        })
    }

    /// The frame, moved out when this is the last reference (a copy
    /// otherwise).
    pub fn into_frame(self) -> Frame {
        match Arc::try_unwrap(self.0) {
            Ok(inner) => inner.frame,
            Err(shared) => shared.frame.clone(),
        }
    }
}

enum Command {
    Connect {
        role: Role,
        after: Option<u64>,
        out: OutTx,
        reply: oneshot::Sender<Result<ConnId, Error>>,
        /// A client's one message: the connection exists for its answer
        /// only and is closed once the message is handled
        /// ([`Hub::request`]).
        request: Option<ClientMessage>,
    },
    Input(Input),
    /// How many connections the actor holds once the commands queued
    /// before this one are handled.
    CountConnections(oneshot::Sender<usize>),
    /// This node no longer holds the session's lease (another node took
    /// it, or it could not be renewed in time): the actor stops here.
    LeaseLost(String),
    /// The session is being deleted: the actor closes its connections
    /// with this reason and stops.
    Close(String),
}

struct Entry {
    epoch: u64,
    tx: mpsc::UnboundedSender<Command>,
}

/// A client's write, acknowledged ([`Connection::answer`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Acked {
    /// Seq of the stored frame (0 for a live part, not stored by itself).
    pub seq: u64,
    /// An idempotency key matched an earlier write.
    pub duplicate: bool,
    /// The turn a stored prompt opened.
    pub turn_id: Option<String>,
}

/// Why a write got no acknowledgement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AnswerError {
    /// The actor refused it; nothing was stored.
    Refused {
        /// Why.
        code: ErrorCode,
        /// What happened and what to do.
        message: String,
    },
    /// The connection closed first (the actor stopped or fenced it).
    Closed(String),
    /// No answer within the timeout.
    TimedOut,
}

impl std::fmt::Display for AnswerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AnswerError::Refused { code, message } => write!(f, "{code}: {message}"),
            AnswerError::Closed(reason) => write!(f, "connection closed: {reason}"),
            AnswerError::TimedOut => f.write_str("the session did not answer in time"),
        }
    }
}

impl std::error::Error for AnswerError {}

impl From<AnswerError> for Error {
    fn from(e: AnswerError) -> Self {
        match e {
            AnswerError::Refused { code, message } => code.into_error(message),
            AnswerError::Closed(reason) => {
                if reason.contains("fenced") || reason.contains("stale runner") {
                    Error::fenced(reason)
                } else {
                    Error::backend(format!("the session connection closed: {reason}"))
                }
            }
            AnswerError::TimedOut => Error::new(
                harness_core::ErrorKind::TimedOut,
                "the session did not answer in time",
            ),
        }
    }
}

/// The registry of live session actors. See the module docs.
pub struct Hub {
    log: Arc<dyn SessionLog>,
    config: HubConfig,
    registry: Mutex<HashMap<SessionId, Entry>>,
    epochs: AtomicU64,
    dispatcher: RwLock<Option<Arc<dyn Dispatcher>>>,
    /// The sandbox providers of this process, by name: what a deleted
    /// session's owned sandbox is removed with (empty until
    /// [`set_sandbox_providers`](Hub::set_sandbox_providers)).
    providers: RwLock<BTreeMap<String, Arc<dyn SandboxProvider>>>,
    /// With leases: renews every lease this node holds, together (made
    /// when the first actor takes one).
    renewer: OnceLock<Arc<lease::Renewer>>,
    /// Where actor tasks run: the runtime the hub was made on, whichever
    /// thread later opens a connection (a Temporal worker's own runtime
    /// must not host actors that outlive it).
    tasks: tokio::runtime::Handle,
    me: Weak<Hub>,
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
pub struct Connection {
    id: ConnId,
    rx: mpsc::UnboundedReceiver<Queued>,
    /// The rest of a run of frames taken from the queue: the run and the
    /// index of the next.
    run: Option<(Arc<[SharedFrame]>, usize)>,
    depth: Arc<AtomicUsize>,
    tx: mpsc::UnboundedSender<Command>,
    /// Made by [`Hub::request`]: the actor closes it itself.
    transient: bool,
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
            Command::CountConnections(_) => f.write_str("CountConnections"),
            Command::LeaseLost(reason) => f.debug_tuple("LeaseLost").field(reason).finish(),
            Command::Close(reason) => f.debug_tuple("Close").field(reason).finish(),
        }
    }
}

impl Connection {
    /// The connection's id inside its actor.
    pub fn id(&self) -> ConnId {
        self.id
    }

    /// The next message for this connection; `None` when the actor dropped
    /// it (stopped, or the reader fell [`MAX_QUEUED`] behind).
    pub async fn recv(&mut self) -> Option<Outbound> {
        if let Some(out) = self.next_of_run() {
            return Some(out);
        }
        let queued = self.rx.recv().await?;
        Some(self.unpack(queued))
    }

    /// The next message if one is queued already (`None` when the queue
    /// is empty or closed).
    pub fn try_recv(&mut self) -> Option<Outbound> {
        if let Some(out) = self.next_of_run() {
            return Some(out);
        }
        let queued = self.rx.try_recv().ok()?;
        Some(self.unpack(queued))
    }

    fn next_of_run(&mut self) -> Option<Outbound> {
        let (frames, next) = self.run.as_mut()?;
        let frame = frames[*next].clone();
        *next += 1;
        if *next == frames.len() {
            self.run = None;
        }
        Some(Outbound::Frame(frame))
    }

    fn unpack(&mut self, queued: Queued) -> Outbound {
        self.depth.fetch_sub(queued.len(), Ordering::AcqRel);
        match queued {
            Queued::One(out) => *out,
            Queued::Frame(frame) => Outbound::Frame(frame),
            Queued::Shared(message) => {
                Outbound::Msg(Arc::try_unwrap(message).unwrap_or_else(|m| (*m).clone()))
            }
            Queued::Frames(frames) => {
                let first = frames[0].clone();
                if frames.len() > 1 {
                    self.run = Some((frames, 1));
                }
                Outbound::Frame(first)
            }
        }
    }

    /// Send a client message (the answer arrives on [`recv`](Self::recv)).
    pub fn client(&self, message: ClientMessage) {
        let _ = self.tx.send(Command::Input(Input::Client {
            conn: self.id,
            message,
        }));
    }

    /// Send a runner message.
    pub fn runner(&self, message: RunnerMessage) {
        let _ = self.tx.send(Command::Input(Input::Runner {
            conn: self.id,
            message,
        }));
    }

    /// Send a tool host's message (a connection opened as
    /// [`Role::ToolHost`]).
    pub fn tool_host(&self, message: HostMessage) {
        let _ = self.tx.send(Command::Input(Input::ToolHost {
            conn: self.id,
            message,
        }));
    }

    /// Wait for the reply to the one message this runner or tool-host
    /// connection sent ([`ServerMessage::is_reply`]). Clients use
    /// [`answer`](Self::answer): frames fanned out to them are not replies.
    pub async fn reply(&mut self, timeout: Duration) -> Result<ServerMessage, AnswerError> {
        self.wait_for(timeout, ServerMessage::is_reply).await
    }

    /// Wait for the answer (`Ack`, `Received` or `Error`) to the one
    /// message this connection sent, skipping the frames fanned out
    /// meanwhile: the ack (seq 0 for a live part: `Received`, fanned out,
    /// stored later as part of its block).
    pub async fn answer(&mut self, timeout: Duration) -> Result<Acked, AnswerError> {
        let acked =
            |m: &ServerMessage| matches!(m, ServerMessage::Ack { .. } | ServerMessage::Received {});
        match self.wait_for(timeout, acked).await? {
            ServerMessage::Ack {
                seq,
                duplicate,
                turn_id,
            } => Ok(Acked {
                seq,
                duplicate,
                turn_id,
            }),
            _ => Ok(Acked::default()),
        }
    }

    /// The first message `accept` takes (an `Error` is a refusal), skipping
    /// the rest.
    async fn wait_for(
        &mut self,
        timeout: Duration,
        accept: impl Fn(&ServerMessage) -> bool,
    ) -> Result<ServerMessage, AnswerError> {
        let wait = async {
            while let Some(out) = self.recv().await {
                match out {
                    Outbound::Msg(ServerMessage::Error { code, message }) => {
                        return Err(AnswerError::Refused { code, message })
                    }
                    Outbound::Msg(m) if accept(&m) => return Ok(m),
                    Outbound::Msg(_) => {}
                    // Only a host call's outcome frame answers (a runner);
                    // the frames fanned out to a client are skipped uncopied.
                    Outbound::Frame(f)
                        if matches!(f.frame().body, FrameBody::HostOutcome { .. }) =>
                    {
                        let m = ServerMessage::Frame {
                            frame: f.into_frame(),
                        };
                        if accept(&m) {
                            return Ok(m);
                        }
                    }
                    Outbound::Frame(_) => {}
                    Outbound::Close(reason) => return Err(AnswerError::Closed(reason)),
                }
            }
            Err(AnswerError::Closed("the session actor stopped".into()))
        };
        tokio::time::timeout(timeout, wait)
            .await
            .unwrap_or(Err(AnswerError::TimedOut))
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        if self.transient {
            return;
        }
        let _ = self
            .tx
            .send(Command::Input(Input::Disconnect { conn: self.id }));
    }
}

impl Hub {
    /// A hub over `log`; turns are dispatched to what
    /// [`set_dispatcher`](Self::set_dispatcher) installs (nothing until then:
    /// prompts are stored and wait for a runtime). Must be called inside a
    /// tokio runtime: actor tasks run on it.
    pub fn new(log: Arc<dyn SessionLog>, config: HubConfig) -> Arc<Self> {
        let tasks = tokio::runtime::Handle::current();
        Arc::new_cyclic(|me| Self {
            log,
            config,
            registry: Mutex::new(HashMap::new()),
            epochs: AtomicU64::new(1),
            dispatcher: RwLock::new(None),
            providers: RwLock::default(),
            renewer: OnceLock::new(),
            tasks,
            me: me.clone(),
        })
    }

    /// The runtime the hub's tasks run on.
    pub fn tasks(&self) -> &tokio::runtime::Handle {
        &self.tasks
    }

    /// Where the actors' [`TurnCommand`]s go from now on.
    pub fn set_dispatcher(&self, dispatcher: Arc<dyn Dispatcher>) {
        *self.dispatcher.write().unwrap_or_else(|e| e.into_inner()) = Some(dispatcher);
    }

    /// The node's lease renewer (started on first use).
    fn renewer(&self, leases: &Arc<dyn SessionLeases>) -> Arc<lease::Renewer> {
        self.renewer
            .get_or_init(|| lease::Renewer::start(leases.clone(), &self.tasks))
            .clone()
    }

    /// The sandbox providers a deleted session's sandbox is removed with
    /// (a runtime that runs turns here installs its own).
    pub fn set_sandbox_providers(&self, providers: BTreeMap<String, Arc<dyn SandboxProvider>>) {
        *self.providers.write().unwrap_or_else(|e| e.into_inner()) = providers;
    }

    /// Shut down the installed sandbox providers
    /// ([`SandboxProvider::shutdown`]: a pool's ready containers go) as the
    /// process stops. The hub itself may outlive this (its actors hold
    /// it), so the providers' own drops cannot be relied on. A provider
    /// that fails is logged; the others still go.
    pub async fn shutdown_sandbox_providers(&self) {
        let providers: Vec<_> = self
            .providers
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .cloned()
            .collect();
        for provider in providers {
            if let Err(e) = provider.shutdown().await {
                tracing::warn!(
                    "shutting down the {} sandboxes failed: {e}",
                    provider.name()
                );
            }
        }
    }

    /// The names of the sandbox providers installed with
    /// [`set_sandbox_providers`](Hub::set_sandbox_providers): what a server
    /// running turns here can offer its clients.
    pub fn sandbox_provider_names(&self) -> Vec<String> {
        self.providers
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .keys()
            .cloned()
            .collect()
    }

    /// The log.
    pub fn log(&self) -> &Arc<dyn SessionLog> {
        &self.log
    }

    /// The configuration.
    pub fn config(&self) -> &HubConfig {
        &self.config
    }

    pub(crate) fn dispatch(&self, session: &SessionId, command: TurnCommand) {
        let dispatcher = self
            .dispatcher
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        match dispatcher {
            Some(d) => d.dispatch(session, command),
            None => tracing::debug!(
                %session,
                turn = command.turn_id(),
                "no runtime attached: the command waits in the log for one"
            ),
        }
    }

    /// Sessions with a running actor.
    pub fn live_sessions(&self) -> Vec<SessionId> {
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

    /// How many connections (clients, runner, tool host) `session`'s actor
    /// holds once it has handled everything queued before this call; 0
    /// when no actor runs. A connection counts from the moment
    /// [`connect`](Self::connect) returns it until it is dropped, so this
    /// tells whether a live reader is following the actor yet.
    pub async fn connection_count(&self, session: &SessionId) -> usize {
        let running = self
            .registry
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains_key(session);
        if !running {
            return 0;
        }
        let (reply, answer) = oneshot::channel();
        if self
            .send(session, Command::CountConnections(reply))
            .is_err()
        {
            return 0;
        }
        // The task died before answering: it holds nothing.
        answer.await.unwrap_or(0)
    }

    /// Queue `cmd` for `session`'s actor, starting it if needed; returns
    /// the queue it went to.
    fn send(
        &self,
        session: &SessionId,
        mut cmd: Command,
    ) -> Result<mpsc::UnboundedSender<Command>, Error> {
        // A retry covers the window where a task retired between our lookup
        // and the send (its queue is closed then).
        for _ in 0..3 {
            let mut registry = self.registry.lock().unwrap_or_else(|e| e.into_inner());
            let entry = registry
                .entry(session.clone())
                .or_insert_with(|| self.spawn_actor(session.clone()));
            match entry.tx.send(cmd) {
                Ok(()) => return Ok(entry.tx.clone()),
                Err(mpsc::error::SendError(back)) => {
                    registry.remove(session);
                    cmd = back;
                }
            }
        }
        Err(Error::backend(format!(
            "the actor of session {session} keeps failing"
        )))
    }

    /// Open a connection to `session`'s actor, starting it if needed.
    pub async fn connect(
        &self,
        session: &SessionId,
        role: Role,
        after: Option<u64>,
    ) -> Result<Connection, Error> {
        self.open(session, role, after, None).await
    }

    /// Send one client message on a connection that lasts until it is
    /// handled (one command to the actor instead of connect, message and
    /// disconnect): what `POST /messages` does. Wait for the answer with
    /// [`Connection::answer`]; frames stored meanwhile may come first.
    pub async fn request(
        &self,
        session: &SessionId,
        message: ClientMessage,
    ) -> Result<Connection, Error> {
        self.open(session, Role::Client, None, Some(message)).await
    }

    async fn open(
        &self,
        session: &SessionId,
        role: Role,
        after: Option<u64>,
        request: Option<ClientMessage>,
    ) -> Result<Connection, Error> {
        for _ in 0..3 {
            let (out_tx, out_rx) = mpsc::unbounded_channel();
            let depth = Arc::new(AtomicUsize::new(0));
            let (reply_tx, reply_rx) = oneshot::channel();
            let transient = request.is_some();
            let cmd = Command::Connect {
                role,
                after,
                out: OutTx {
                    tx: out_tx,
                    depth: depth.clone(),
                },
                reply: reply_tx,
                request: request.clone(),
            };
            let tx = self.send(session, cmd)?;
            match reply_rx.await {
                Ok(Ok(id)) => {
                    return Ok(Connection {
                        id,
                        rx: out_rx,
                        run: None,
                        depth,
                        tx,
                        transient,
                    })
                }
                Ok(Err(e)) => return Err(e),
                // The task died before answering.
                Err(_) => continue,
            }
        }
        Err(Error::backend(format!(
            "the actor of session {session} keeps failing"
        )))
    }

    /// With leases (several nodes), start sweeping for orphans: every half
    /// lease, take over the sessions whose node died or stalled without
    /// releasing them, so a session with work left — a stored prompt its
    /// dead node never handed to the engine — moves on even when no client
    /// or runner asks for it. Nothing without leases.
    pub fn sweep_orphans(&self) {
        let Some(leases) = self.config.leases.clone() else {
            return;
        };
        let hub = self.me.clone();
        self.tasks.spawn(async move {
            let every = leases.ttl() / 2;
            loop {
                tokio::time::sleep(every).await;
                let Some(hub) = hub.upgrade() else { return };
                let orphans = match leases.orphans(SWEEP_BATCH).await {
                    Ok(orphans) => orphans,
                    Err(e) => {
                        tracing::warn!("could not look for sessions left by a dead node: {e}");
                        continue;
                    }
                };
                for session in orphans {
                    // A connection starts the session's task: it takes the
                    // lease (and, taking it over, re-sends what was left
                    // running) or forwards to a node that was quicker. The
                    // connection itself is not needed.
                    match hub.connect(&session, Role::Client, None).await {
                        Ok(conn) => drop(conn),
                        Err(e) => {
                            tracing::debug!(%session, "an orphaned session did not start: {e}")
                        }
                    }
                }
            }
        });
    }

    /// Feed an input that no connection sends (the runtime reporting a
    /// command it could not perform).
    pub fn input(&self, session: &SessionId, input: Input) -> Result<(), Error> {
        self.send(session, Command::Input(input)).map(|_| ())
    }

    /// Seal through the actor, so live clients see the seal frame and the
    /// actor refuses later writes itself.
    pub async fn seal(&self, session: &SessionId) -> Result<(), Error> {
        let mut conn = self.connect(session, Role::Client, None).await?;
        conn.client(ClientMessage::Seal {});
        conn.answer(Duration::from_secs(30))
            .await
            .map(|_| ())
            .map_err(Error::from)
    }

    /// Delete `session` (retention, `docs/retention.md`): refused while a
    /// turn runs (abort it first); the actor running it here closes its
    /// connections, the sandbox the session owns is removed, then the log
    /// goes. Its checkpoints are left to the collector (`harness gc`),
    /// which keeps what a fork references.
    ///
    /// The sandbox goes first: if removing it fails, the error is returned
    /// and the log stays (delete again to retry). A sandbox already gone
    /// is skipped; one whose provider this process does not run (turns on
    /// a remote runner or another node) is left, with a warning.
    pub async fn delete(&self, session: &SessionId) -> Result<SandboxRemoval, Error> {
        let info = self.log.info(session).await?;
        retention::check_deletable(&info)?;
        let entry = self
            .registry
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(session)
            .map(|e| e.tx.clone());
        if let Some(tx) = entry {
            let _ = tx.send(Command::Close(format!("session {session} was deleted")));
        }
        let removal = self.remove_sandbox(&info).await?;
        self.log.delete(session).await?;
        Ok(removal)
    }

    async fn remove_sandbox(&self, info: &LogInfo) -> Result<SandboxRemoval, Error> {
        let Some(handle) = retention::owned_sandbox(info) else {
            return Ok(SandboxRemoval::NoneOwned);
        };
        let provider = self
            .providers
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&handle.provider)
            .cloned();
        let Some(provider) = provider else {
            tracing::warn!(
                session = %info.session,
                provider = %handle.provider,
                sandbox = %handle.id,
                "the deleted session's sandbox is left: this process does not run its provider"
            );
            return Ok(SandboxRemoval::NotHere);
        };
        retention::remove_sandbox(info, handle, provider.as_ref()).await
    }

    fn spawn_actor(&self, session: SessionId) -> Entry {
        let (tx, rx) = mpsc::unbounded_channel();
        let epoch = self.epochs.fetch_add(1, Ordering::Relaxed);
        let hub = self.me.upgrade().expect("the hub is alive while it spawns");
        self.tasks
            .spawn(run_actor(hub, session, epoch, tx.clone(), rx));
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
    /// queued.
    fn fail_start(
        &self,
        session: &SessionId,
        epoch: u64,
        mut rx: mpsc::UnboundedReceiver<Command>,
        error: &Error,
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
                let _ = reply.send(Err(Error::new(error.kind(), error.message())));
            }
        }
    }
}

/// The actor task's connections, as the driver's [`Transport`].
///
/// Frames fanned out one after the other to the same connections (the
/// appends of a batch, and of the batches after it while commands keep
/// queuing up) are held and queued as one run per connection
/// ([`flush`](Self::flush)) — before anything else goes to a connection,
/// and once the actor has nothing queued (or holds a batch's worth) — so
/// every connection gets what it got before, in the same order, with one
/// queue push (and one wake-up) per run instead of per frame.
struct ChannelTransport {
    session: SessionId,
    conns: HashMap<ConnId, OutTx>,
    hub: Weak<Hub>,
    /// Frames fanned out and not queued yet, and to whom.
    fanout: Vec<SharedFrame>,
    fanout_to: Vec<ConnId>,
}

impl ChannelTransport {
    fn push(&mut self, conn: ConnId, out: Queued) -> bool {
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

    /// Queue the frames held for fan-out.
    fn flush(&mut self) {
        if self.fanout.is_empty() {
            return;
        }
        let to = std::mem::take(&mut self.fanout_to);
        if self.fanout.len() == 1 {
            let frame = self.fanout.pop().expect("one frame");
            for conn in to {
                self.push(conn, Queued::Frame(frame.clone()));
            }
        } else {
            let frames: Arc<[SharedFrame]> = std::mem::take(&mut self.fanout).into();
            for conn in to {
                self.push(conn, Queued::Frames(frames.clone()));
            }
        }
    }
}

impl Transport for ChannelTransport {
    fn send(&mut self, conn: ConnId, message: ServerMessage) -> bool {
        self.flush();
        let out = match message {
            ServerMessage::Frame { frame } => Outbound::Frame(SharedFrame::new(frame)),
            message => Outbound::Msg(message),
        };
        self.push(conn, Queued::one(out))
    }

    /// A stored frame is shared by every connection (one copy, one
    /// encoding) and held to be queued with the frames fanned out after it
    /// to the same connections; anything else is copied per connection.
    fn send_all(&mut self, conns: &[ConnId], message: ServerMessage) {
        match message {
            ServerMessage::Frame { frame } => {
                if !self.fanout.is_empty() && self.fanout_to != conns {
                    self.flush();
                }
                if self.fanout.is_empty() {
                    self.fanout_to.clear();
                    self.fanout_to.extend_from_slice(conns);
                }
                self.fanout.push(SharedFrame::new(frame));
            }
            message => {
                self.flush();
                let message = Arc::new(message);
                for &conn in conns {
                    self.push(conn, Queued::Shared(message.clone()));
                }
            }
        }
    }

    fn close(&mut self, conn: ConnId, reason: &str) {
        self.flush();
        if let Some(tx) = self.conns.get(&conn) {
            tx.push(Queued::one(Outbound::Close(reason.to_string())));
        }
    }

    fn dispatch(&mut self, command: TurnCommand) {
        if let Some(hub) = self.hub.upgrade() {
            hub.dispatch(&self.session, command);
        }
    }
}

/// The driver of one session's actor over its connections.
type Driver = ActorDriver<ChannelTransport>;

/// One session's actor task: the command queue it takes from, what it
/// recovers from, and the connection ids it hands out.
struct ActorTask {
    hub: Arc<Hub>,
    session: SessionId,
    epoch: u64,
    /// The task's own queue, for its lease keeper to report a lost lease.
    tx: mpsc::UnboundedSender<Command>,
    rx: mpsc::UnboundedReceiver<Command>,
    store: Arc<dyn SessionStore>,
    /// With leases: tells when the store refused an append as fenced.
    fence: Option<lease::FenceWatch>,
    next_conn: ConnId,
}

/// A batch's commands as the actor's inputs, and what is answered after.
struct BatchInputs {
    inputs: Vec<Input>,
    /// Connections of one request, closed once the batch is handled.
    transient: Vec<ConnId>,
    /// Who asked for the connection count.
    counts: Vec<oneshot::Sender<usize>>,
    /// Why the actor must end: its lease was lost, or the session closed.
    ended: Option<Ended>,
}

/// Why a session's actor ends before its queue does.
#[derive(Debug)]
enum Ended {
    /// Its lease went to another node: clients reconnect there.
    LeaseLost(String),
    /// The session was closed here (deleted): nothing to reconnect to.
    Closed(String),
}

async fn run_actor(
    hub: Arc<Hub>,
    session: SessionId,
    epoch: u64,
    tx: mpsc::UnboundedSender<Command>,
    rx: mpsc::UnboundedReceiver<Command>,
) {
    let log_store: Arc<dyn SessionStore> =
        Arc::new(LogSession::new(hub.log.clone(), session.clone()));
    let fence = hub
        .config
        .leases
        .as_ref()
        .map(|_| lease::FenceWatch::new(log_store.clone()));
    let store = match &fence {
        Some(fence) => fence.store(),
        None => log_store,
    };
    let mut task = ActorTask {
        hub,
        session,
        epoch,
        tx,
        rx,
        store,
        fence,
        next_conn: 1,
    };
    let Some(leases) = task.hub.config.leases.clone() else {
        match task.own(None, Vec::new()).await {
            Ok(_) => {}
            Err(e) => task.fail_start(&e),
        }
        return;
    };
    // Several nodes: run the actor while this node holds the lease, else
    // forward to the node that does; when either ends without the task
    // retiring, decide again.
    let mut carried: Vec<forward::Carried> = Vec::new();
    let mut unreachable: Option<String> = None;
    loop {
        match leases.acquire(&task.session).await {
            Ok(Claim::Owned {
                generation,
                taken_over,
            }) => {
                unreachable = None;
                let held = lease::Held {
                    leases: leases.clone(),
                    generation,
                    taken_over,
                };
                match task.own(Some(held), std::mem::take(&mut carried)).await {
                    Ok(Owned::Retired) => return,
                    Ok(Owned::Lost) => continue,
                    Err(e) => return task.fail_start(&e),
                }
            }
            Ok(Claim::Held { node }) => {
                if unreachable.as_deref() == Some(node.as_str()) {
                    // The owner just failed us and its lease still stands:
                    // wait a little before trying it (or its successor).
                    tokio::time::sleep(lease::retry_pause(leases.ttl())).await;
                }
                match forward::forward(&mut task, &node, std::mem::take(&mut carried)).await {
                    forward::Forwarded::Retired => return,
                    forward::Forwarded::OwnerLost(rest) => {
                        carried = rest;
                        unreachable = Some(node);
                    }
                }
            }
            Err(e) => {
                forward::close_all(
                    carried,
                    &format!("session {} has no owner: {e}", task.session),
                );
                return task.fail_start(&e);
            }
        }
    }
}

/// How [`ActorTask::own`] ended.
enum Owned {
    /// Idle: the task left the registry.
    Retired,
    /// The lease went to another node: every connection was closed.
    Lost,
}

impl ActorTask {
    /// A new connection's id, answered to its caller; `None` when the
    /// caller gave up before the answer.
    fn accept(&mut self, reply: oneshot::Sender<Result<ConnId, Error>>) -> Option<ConnId> {
        let conn = self.next_conn;
        self.next_conn += 1;
        reply.send(Ok(conn)).ok().map(|()| conn)
    }

    fn now_ms(&self) -> u64 {
        self.hub.config.clock.now_ms()
    }

    /// The actor as the log has it, over `transport`.
    async fn recover(&self, transport: ChannelTransport) -> Result<Driver, Error> {
        ActorDriver::recover(self.store.clone(), self.hub.config.actor.clone(), transport).await
    }

    /// Run the session's actor here until it retires, or until the lease
    /// (when there is one) is lost. `carried` are client connections that
    /// followed the session from a node that went away: they rejoin from
    /// the last frame each had.
    async fn own(
        &mut self,
        held: Option<lease::Held>,
        carried: Vec<forward::Carried>,
    ) -> Result<Owned, Error> {
        let transport = ChannelTransport {
            session: self.session.clone(),
            conns: HashMap::new(),
            hub: Arc::downgrade(&self.hub),
            fanout: Vec::new(),
            fanout_to: Vec::new(),
        };
        let mut driver = match self.recover(transport).await {
            Ok(driver) => driver,
            Err(e) => {
                forward::close_all(
                    carried,
                    &format!("session {} cannot start: {e}", self.session),
                );
                // Let the lease go: a session that cannot start here (an
                // unknown one, say) must not stay an orphan for the sweep.
                if let Some(held) = held {
                    let _ = held.leases.release(&self.session, held.generation).await;
                }
                return Err(e);
            }
        };
        let last_seq = driver.actor().last_seq();
        tracing::debug!(session = %self.session, last_seq, "session actor started");
        for c in carried {
            driver.transport_mut().conns.insert(c.conn, c.out);
            driver
                .handle(Input::Connect {
                    conn: c.conn,
                    role: Role::Client,
                    after: c.after,
                })
                .await;
        }
        driver.transport_mut().flush();
        let keeper = match held {
            Some(held) => Some(held.start(self).await),
            None => None,
        };
        let ended = loop {
            let Some(cmds) = self.next_batch(&mut driver).await else {
                break Owned::Retired;
            };
            match self.handle_batch(&mut driver, cmds).await {
                Ok(None) => {}
                Ok(Some(ended)) => {
                    let close = match ended {
                        Ended::LeaseLost(reason) => {
                            tracing::warn!(session = %self.session, %reason, "the session moves to another node");
                            format!(
                                "session {} moved to another node ({reason}); reconnect",
                                self.session
                            )
                        }
                        Ended::Closed(reason) => {
                            tracing::info!(session = %self.session, %reason, "the session is closed");
                            reason
                        }
                    };
                    let mut transport = driver.into_transport();
                    transport.flush();
                    for (_, out) in transport.conns.drain() {
                        out.push(Queued::one(Outbound::Close(close.clone())));
                    }
                    break Owned::Lost;
                }
                Err(error) => {
                    driver = match self.restart(driver, error).await {
                        Ok(driver) => driver,
                        Err(e) => {
                            if let Some(keeper) = keeper {
                                keeper.stop(false).await;
                            }
                            return Err(e);
                        }
                    };
                }
            }
        };
        if let Some(keeper) = keeper {
            keeper.stop(matches!(ended, Owned::Retired)).await;
        }
        Ok(ended)
    }

    /// The task could not (re)start: leave the registry and refuse what
    /// was queued.
    fn fail_start(self, error: &Error) {
        self.hub
            .fail_start(&self.session, self.epoch, self.rx, error);
    }

    /// The next command; `None` once the task retired. With no connection
    /// the task retires after the idle timeout; with a host call out it
    /// wakes for the call's deadline (the actor records the timeout on the
    /// tick).
    async fn next_command(&mut self, driver: &mut Driver) -> Option<Command> {
        loop {
            if driver.transport().conns.is_empty() {
                match tokio::time::timeout(self.hub.config.idle_timeout, self.rx.recv()).await {
                    Ok(cmd) => return cmd,
                    Err(_) if self.hub.try_retire(&self.session, self.epoch, &mut self.rx) => {
                        tracing::debug!(session = %self.session, "session actor stopped (idle)");
                        return None;
                    }
                    Err(_) => continue,
                }
            }
            let Some(deadline) = driver.actor().next_deadline() else {
                // `None` only once the queue is closed, i.e. after retiring.
                return self.rx.recv().await;
            };
            let wait = Duration::from_millis(deadline.saturating_sub(self.now_ms()));
            match tokio::time::timeout(wait, self.rx.recv()).await {
                Ok(cmd) => return cmd,
                Err(_) => {
                    driver
                        .handle(Input::Tick {
                            now_ms: self.now_ms(),
                        })
                        .await;
                    driver.transport_mut().flush();
                }
            }
        }
    }

    /// The next command and what queued up behind it, handled as one
    /// batch: its appends go into one group commit, and acks and fan-out
    /// wait for it.
    async fn next_batch(&mut self, driver: &mut Driver) -> Option<Vec<Command>> {
        let mut cmds = vec![self.next_command(driver).await?];
        while cmds.len() < self.hub.config.max_batch {
            match self.rx.try_recv() {
                Ok(cmd) => cmds.push(cmd),
                Err(_) => break,
            }
        }
        Some(cmds)
    }

    /// Handle one batch; `Err` when its group commit failed.
    async fn handle_batch(
        &mut self,
        driver: &mut Driver,
        cmds: Vec<Command>,
    ) -> Result<Option<Ended>, Error> {
        let BatchInputs {
            inputs,
            transient,
            counts,
            ended,
        } = self.inputs(driver, cmds);
        if let Some(reason) = ended {
            return Ok(Some(reason));
        }
        let result = handle_inputs(driver, inputs).await;
        for conn in transient {
            driver.transport_mut().conns.remove(&conn);
            driver.handle(Input::Disconnect { conn }).await;
        }
        for reply in counts {
            let _ = reply.send(driver.actor().connection_count());
        }
        // Frames fanned out wait while more commands are queued (their
        // frames join the same runs: one queue push per reader for many
        // frames when the actor is busy), up to a batch's worth.
        if self.rx.is_empty() || driver.transport().fanout.len() >= self.hub.config.max_batch {
            driver.transport_mut().flush();
        }
        if let Some(reason) = self.fence.as_ref().and_then(lease::FenceWatch::take) {
            return Ok(Some(Ended::LeaseLost(reason)));
        }
        result.map(|()| None)
    }

    /// A batch's commands as inputs, the time first: connections get their
    /// ids (and queues) here, so the inputs after them can reach them.
    fn inputs(&mut self, driver: &mut Driver, cmds: Vec<Command>) -> BatchInputs {
        let mut batch = BatchInputs {
            inputs: vec![Input::Tick {
                now_ms: self.now_ms(),
            }],
            transient: Vec::new(),
            counts: Vec::new(),
            ended: None,
        };
        for cmd in cmds {
            match cmd {
                Command::Connect {
                    role,
                    after,
                    out,
                    reply,
                    request,
                } => {
                    let Some(conn) = self.accept(reply) else {
                        // The caller gave up before we answered: nothing to do.
                        continue;
                    };
                    driver.transport_mut().conns.insert(conn, out);
                    batch.inputs.push(Input::Connect { conn, role, after });
                    if let Some(message) = request {
                        batch.inputs.push(Input::Client { conn, message });
                        batch.transient.push(conn);
                    }
                }
                Command::Input(input) => {
                    if let Input::Disconnect { conn } = &input {
                        driver.transport_mut().conns.remove(conn);
                    }
                    batch.inputs.push(input);
                }
                Command::CountConnections(reply) => batch.counts.push(reply),
                Command::LeaseLost(reason) => batch.ended = Some(Ended::LeaseLost(reason)),
                Command::Close(reason) => batch.ended = Some(Ended::Closed(reason)),
            }
        }
        batch
    }

    /// After a failed group commit: nothing of the batch was acknowledged
    /// or fanned out, and the machine saw frames the log does not hold.
    /// Start over from the log, as after a crash; every connection is
    /// closed so its peer resumes from what is stored.
    async fn restart(&self, driver: Driver, error: Error) -> Result<Driver, Error> {
        tracing::error!(
            session = %self.session,
            %error,
            "a group commit failed: the session actor restarts from the log"
        );
        let mut transport = driver.into_transport();
        let reason = format!("the session log failed to commit ({error}); reconnect");
        // What is held was stored by earlier batches (a failed batch
        // performed no output): it goes out before the close.
        transport.flush();
        for (_, out) in transport.conns.drain() {
            out.push(Queued::one(Outbound::Close(reason.clone())));
        }
        self.recover(transport).await
    }
}

/// Feed a batch's inputs to the actor: inputs that may append are
/// committed as one group; with one there is nothing to group, it commits
/// at once (possibly with other sessions' appends).
async fn handle_inputs(driver: &mut Driver, inputs: Vec<Input>) -> Result<(), Error> {
    let writes = inputs
        .iter()
        .filter(|i| {
            matches!(
                i,
                Input::Client { .. }
                    | Input::Runner { .. }
                    | Input::ToolHost { .. }
                    | Input::DispatchFailed { .. }
            )
        })
        .count();
    if writes > 1 {
        return driver.handle_batch(inputs).await;
    }
    for input in inputs {
        driver.handle(input).await;
    }
    Ok(())
}
