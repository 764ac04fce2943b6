//! A session whose actor runs on another node: this node forwards its
//! connections there.
//!
//! With several nodes over one log ([`HubConfig::leases`](super::HubConfig)),
//! a session's actor runs on the node holding its lease. Another node that
//! is asked for the session (an SSE reader, a prompt, a runner's writes)
//! does not start a second actor: its task for the session becomes a
//! *forwarder*, and each connection made through it is one session
//! WebSocket to the owner (`/v1/sessions/{id}/ws`, as the peer). What the
//! owner sends is queued for the local reader as the actor's own messages
//! would be, so every route works the same on every node.
//!
//! When the owner goes away — its socket fails, or the lease shows another
//! owner or has expired — the forwarder hands its client connections back
//! to the task, each with the last frame it passed on, and the task decides
//! again: it takes the lease (the session's actor then runs here and the
//! readers rejoin it from where they were) or forwards to the new owner.
//! A reader following a session therefore sees every stored frame once,
//! across the death of the node it was really reading from. Runner and
//! tool-host connections are closed instead (their peers reconnect and
//! resend, which the actor's keys and generations make safe), as are
//! one-message requests whose answer was lost.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::{SinkExt, StreamExt};
use harness_core::actor::{ConnId, Input, Role, ServerMessage};
use harness_core::SessionId;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_tungstenite::tungstenite::{self, Message};

use super::{ActorTask, Command, OutTx, Outbound, Queued, SharedFrame};

/// How long opening a socket to the owner may take: a node that is paused
/// or gone must not hold a reader for long.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// A client connection that follows the session to its next home.
pub(super) struct Carried {
    pub conn: ConnId,
    pub out: OutTx,
    /// Resume after this seq (the last frame passed on).
    pub after: Option<u64>,
}

/// How [`forward`] ended.
pub(super) enum Forwarded {
    /// No connection left for the idle timeout: the task left the registry.
    Retired,
    /// The owner went away: decide again; these client connections follow.
    OwnerLost(Vec<Carried>),
}

/// Close connections that cannot follow the session anywhere.
pub(super) fn close_all(carried: Vec<Carried>, reason: &str) {
    for c in carried {
        c.out.push(Queued::one(Outbound::Close(reason.to_string())));
    }
}

/// One forwarded connection.
struct Link {
    role: Role,
    out: OutTx,
    /// Messages for the owner (JSON text), sent in order by the link's task.
    to_owner: mpsc::UnboundedSender<String>,
    /// The `after` it was opened with, then the seq of each frame passed on.
    seen: Arc<AtomicU64>,
    opened_after: Option<u64>,
    /// A one-message request ([`Hub::request`](super::Hub::request)): ends
    /// with its answer, and is not carried anywhere.
    transient: bool,
    task: JoinHandle<()>,
}

impl Link {
    /// Where a reader following the session resumes.
    fn resume_after(&self) -> Option<u64> {
        match self.seen.load(Ordering::Acquire) {
            0 => self.opened_after,
            seq => Some(seq),
        }
    }

    fn follows(&self) -> bool {
        matches!(self.role, Role::Client) && !self.transient
    }
}

/// Why a link's task ended.
enum LinkEnd {
    /// The request was answered, or the local reader is gone.
    Done,
    /// The owner refused the connection (a 4xx: no such session, no grant):
    /// nothing to retry.
    Refused(String),
    /// The owner's actor closed it, with its reason.
    Closed(String),
    /// The owner could not be reached or the socket failed.
    Lost(String),
}

/// Forward `task`'s connections to `owner` until the task retires or the
/// owner goes away. `carried` are client connections that follow the
/// session from its previous home.
pub(super) async fn forward(task: &mut ActorTask, owner: &str, carried: Vec<Carried>) -> Forwarded {
    tracing::debug!(session = %task.session, owner, "forwarding the session's connections to its owner");
    let leases = task
        .hub
        .config
        .leases
        .clone()
        .expect("only a hub with leases forwards");
    let (ended_tx, mut ended) = mpsc::unbounded_channel::<(ConnId, LinkEnd)>();
    let mut links = Links {
        owner,
        peer_token: task.hub.config.peer_token.clone(),
        ended_tx,
        by_conn: HashMap::new(),
    };
    for c in carried {
        links.open(task, c.conn, Role::Client, c.after, c.out, None);
    }
    let mut check = tokio::time::interval(leases.ttl() / 3);
    check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    check.tick().await;
    let idle = tokio::time::sleep(task.hub.config.idle_timeout);
    tokio::pin!(idle);
    loop {
        tokio::select! {
            cmd = task.rx.recv() => {
                let Some(cmd) = cmd else { return Forwarded::Retired };
                links.on_command(task, cmd);
                if links.by_conn.is_empty() {
                    idle.as_mut().reset(tokio::time::Instant::now() + task.hub.config.idle_timeout);
                }
            }
            Some((conn, end)) = ended.recv() => {
                if let Some(why) = links.on_end(&task.session, conn, end) {
                    return links.owner_lost(&why);
                }
                if links.by_conn.is_empty() {
                    idle.as_mut().reset(tokio::time::Instant::now() + task.hub.config.idle_timeout);
                }
            }
            _ = check.tick() => {
                if let Some(why) = owner_moved(leases.as_ref(), &task.session, owner).await {
                    tracing::info!(session = %task.session, owner, %why, "following the session");
                    return links.owner_lost(&why);
                }
            }
            _ = &mut idle, if links.by_conn.is_empty() => {
                if task.hub.try_retire(&task.session, task.epoch, &mut task.rx) {
                    return Forwarded::Retired;
                }
                idle.as_mut().reset(tokio::time::Instant::now() + task.hub.config.idle_timeout);
            }
        }
    }
}

/// The forwarded connections of one session, each a socket to its owner.
struct Links<'a> {
    owner: &'a str,
    peer_token: Option<String>,
    /// Where each link's task says why it ended.
    ended_tx: mpsc::UnboundedSender<(ConnId, LinkEnd)>,
    by_conn: HashMap<ConnId, Link>,
}

impl Links<'_> {
    /// Open `conn`'s socket to the owner; `first` is a one-message
    /// request's message (the link then ends with its answer).
    fn open(
        &mut self,
        task: &ActorTask,
        conn: ConnId,
        role: Role,
        after: Option<u64>,
        out: OutTx,
        first: Option<String>,
    ) {
        let transient = first.is_some();
        let (to_owner, from_local) = mpsc::unbounded_channel();
        if let Some(first) = first {
            let _ = to_owner.send(first);
        }
        let seen = Arc::new(AtomicU64::new(0));
        let url = socket_url(
            self.owner,
            &task.session,
            role,
            after,
            self.peer_token.as_deref(),
        );
        let pumping = task.hub.tasks.spawn(pump(
            url,
            conn,
            out.clone(),
            from_local,
            seen.clone(),
            transient,
            self.ended_tx.clone(),
        ));
        let link = Link {
            role,
            out,
            to_owner,
            seen,
            opened_after: after,
            transient,
            task: pumping,
        };
        self.by_conn.insert(conn, link);
    }

    /// A command for the session's task: connections open a link, inputs
    /// go to the owner on theirs.
    fn on_command(&mut self, task: &mut ActorTask, cmd: Command) {
        match cmd {
            Command::Connect {
                role,
                after,
                out,
                reply,
                request,
            } => {
                let Some(conn) = task.accept(reply) else {
                    return;
                };
                let first = request.map(|m| serde_json::to_string(&m).unwrap_or_default());
                self.open(task, conn, role, after, out, first);
            }
            Command::Input(input) => match input {
                Input::Client { conn, message } => send(&self.by_conn, conn, &message),
                Input::Runner { conn, message } => send(&self.by_conn, conn, &message),
                Input::ToolHost { conn, message } => send(&self.by_conn, conn, &message),
                Input::Disconnect { conn } => {
                    if let Some(link) = self.by_conn.remove(&conn) {
                        // Dropping its sender closes the owner's socket.
                        drop(link.to_owner);
                    }
                }
                other => tracing::warn!(
                    session = %task.session,
                    input = ?other,
                    "an input for a session whose actor runs on another node is dropped"
                ),
            },
            Command::CountConnections(reply) => {
                let _ = reply.send(self.by_conn.len());
            }
            // Only an owner keeps a lease.
            Command::LeaseLost(_) => {}
            // The session was deleted: every forwarded connection is told
            // (dropping a link closes the owner's socket).
            Command::Close(reason) => {
                for (_, link) in self.by_conn.drain() {
                    link.out.push(Queued::one(Outbound::Close(reason.clone())));
                }
            }
        }
    }

    /// A link ended: its local connection is told why, or, when the owner
    /// went away under a reader that follows the session, why to decide
    /// again (the link stays, to be carried).
    fn on_end(&mut self, session: &SessionId, conn: ConnId, end: LinkEnd) -> Option<String> {
        let link = self.by_conn.remove(&conn)?;
        match end {
            LinkEnd::Done => None,
            LinkEnd::Refused(reason) => {
                link.out.push(Queued::one(Outbound::Close(reason)));
                None
            }
            LinkEnd::Closed(reason) if !link.follows() => {
                link.out.push(Queued::one(Outbound::Close(reason)));
                None
            }
            LinkEnd::Closed(reason) | LinkEnd::Lost(reason) => {
                tracing::info!(%session, owner = self.owner, %reason, "lost the session's owner");
                self.by_conn.insert(conn, link);
                Some(reason)
            }
        }
    }

    /// The owner is gone: readers that follow the session are carried to
    /// its next home, every other connection is closed.
    fn owner_lost(&mut self, why: &str) -> Forwarded {
        let mut follow = Vec::new();
        for (conn, link) in self.by_conn.drain() {
            link.task.abort();
            if link.follows() {
                follow.push(Carried {
                    conn,
                    after: link.resume_after(),
                    out: link.out,
                });
            } else {
                link.out.push(Queued::one(Outbound::Close(format!(
                    "the node running this session went away ({why}); reconnect"
                ))));
            }
        }
        Forwarded::OwnerLost(follow)
    }
}

/// Why the session no longer runs on `owner`, if the lease says so (a read
/// that fails says nothing: the socket's own failure is the other signal).
async fn owner_moved(
    leases: &dyn harness_core::log::lease::SessionLeases,
    session: &SessionId,
    owner: &str,
) -> Option<String> {
    match leases.holder(session).await {
        Ok(Some((node, _, false))) if node == owner => None,
        Ok(Some((node, _, false))) => Some(format!("the session moved to {node}")),
        Ok(_) => Some(format!("the lease of {owner} expired")),
        Err(e) => {
            tracing::warn!(%session, "could not read the session's lease: {e}");
            None
        }
    }
}

/// Queue `message` for the owner on `conn`'s link.
fn send(links: &HashMap<ConnId, Link>, conn: ConnId, message: &impl serde::Serialize) {
    if let Some(link) = links.get(&conn) {
        match serde_json::to_string(message) {
            Ok(text) => {
                let _ = link.to_owner.send(text);
            }
            Err(e) => tracing::warn!("a message could not be encoded for the owner: {e}"),
        }
    }
}

/// The owner's session WebSocket for a connection of `role`.
fn socket_url(
    owner: &str,
    session: &SessionId,
    role: Role,
    after: Option<u64>,
    token: Option<&str>,
) -> String {
    let base = crate::remote::ws_base(owner);
    let mut url = format!("{base}/v1/sessions/{session}/ws?");
    match role {
        Role::Client => url.push_str("role=client"),
        Role::Runner { generation } => {
            url.push_str(&format!("role=runner&generation={generation}"))
        }
        Role::ToolHost { takeover } => url.push_str(&format!("role=tool-host&takeover={takeover}")),
    }
    if let Some(after) = after {
        url.push_str(&format!("&after={after}"));
    }
    if let Some(token) = token {
        url.push_str("&access_token=");
        url.push_str(token);
    }
    url
}

/// One link: open the owner's socket, pass what the owner sends to the
/// local reader and what the local side sends to the owner, and report
/// how it ended.
async fn pump(
    url: String,
    conn: ConnId,
    out: OutTx,
    mut from_local: mpsc::UnboundedReceiver<String>,
    seen: Arc<AtomicU64>,
    transient: bool,
    ended: mpsc::UnboundedSender<(ConnId, LinkEnd)>,
) {
    let end = run_link(&url, &out, &mut from_local, &seen, transient).await;
    let _ = ended.send((conn, end));
}

async fn run_link(
    url: &str,
    out: &OutTx,
    from_local: &mut mpsc::UnboundedReceiver<String>,
    seen: &AtomicU64,
    transient: bool,
) -> LinkEnd {
    let connect = tokio_tungstenite::connect_async_with_config(url, None, true);
    let socket = match tokio::time::timeout(CONNECT_TIMEOUT, connect).await {
        Err(_) => return LinkEnd::Lost("the owner did not answer in time".into()),
        Ok(Err(tungstenite::Error::Http(response))) if response.status().is_client_error() => {
            let body = response
                .body()
                .as_ref()
                .map(|b| String::from_utf8_lossy(b).into_owned())
                .unwrap_or_default();
            return LinkEnd::Refused(format!(
                "the session's owner refused the connection ({}): {body}",
                response.status()
            ));
        }
        Ok(Err(e)) => return LinkEnd::Lost(format!("cannot reach the owner: {e}")),
        Ok(Ok((socket, _))) => socket,
    };
    let (mut sink, mut stream) = socket.split();
    loop {
        tokio::select! {
            local = from_local.recv() => match local {
                Some(text) => {
                    if let Err(e) = sink.send(Message::text(text)).await {
                        return LinkEnd::Lost(format!("the owner's socket failed: {e}"));
                    }
                }
                None => {
                    let _ = sink.send(Message::Close(None)).await;
                    return LinkEnd::Done;
                }
            },
            inbound = stream.next() => match inbound {
                Some(Ok(Message::Text(text))) => {
                    let message = match serde_json::from_str::<ServerMessage>(text.as_str()) {
                        Ok(m) => m,
                        Err(e) => {
                            tracing::warn!("ignoring a message from the owner: {e}");
                            continue;
                        }
                    };
                    let answer = matches!(
                        message,
                        ServerMessage::Ack { .. } | ServerMessage::Received {} | ServerMessage::Error { .. }
                    );
                    let queued = match message {
                        ServerMessage::Frame { frame } => {
                            let seq = frame.seq;
                            let pushed = out.push(Queued::Frame(SharedFrame::new(frame)));
                            if pushed {
                                seen.store(seq, Ordering::Release);
                            }
                            pushed
                        }
                        other => out.push(Queued::one(Outbound::Msg(other))),
                    };
                    if !queued {
                        // The reader is gone or too far behind: it resumes
                        // from its last seq, as with a local actor.
                        return LinkEnd::Done;
                    }
                    if transient && answer {
                        let _ = sink.send(Message::Close(None)).await;
                        return LinkEnd::Done;
                    }
                }
                Some(Ok(Message::Close(Some(frame))))
                    if u16::from(frame.code) == session_api::ws::CLOSED_BY_SESSION =>
                {
                    return LinkEnd::Closed(frame.reason.to_string());
                }
                Some(Ok(Message::Close(_))) | None => {
                    return LinkEnd::Lost("the owner closed the socket".into())
                }
                Some(Ok(_)) => {}
                Some(Err(e)) => return LinkEnd::Lost(format!("the owner's socket failed: {e}")),
            },
        }
    }
}
