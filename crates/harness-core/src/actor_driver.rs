//! [`ActorDriver`]: the one loop around the session actor, generic over
//! where frames are stored ([`SessionStore`]) and how connections are
//! reached ([`Transport`]).
//!
//! Every runtime drives a session's actor with this: the tokio hub of
//! `harness serve` (one task per live session, transport = per-connection
//! channels), and a Durable Object (store = the DO's SQLite, transport =
//! its hibernatable WebSockets). The driver:
//! - starts from [`SessionStore::info`] (last seq, seal, the folded
//!   [`SessionMeta`](crate::session::SessionMeta)) — no log scan, only the
//!   running turn's frames for its host calls;
//! - performs the machine's outputs in order; an append is awaited and its
//!   stored frame fed back at once (`Input::Appended`), and the outputs that
//!   produces run before the rest, so fan-out order is seq order and the
//!   machine never sees two things at once;
//! - reads replays from the store page by page;
//! - hands [`TurnCommand`]s to the transport's host.

use std::collections::VecDeque;
use std::sync::Arc;

use crate::actor::{ActorConfig, ConnId, ErrorCode, Input, Output, ServerMessage, SessionActor};
use crate::log::SessionStore;
use crate::maybe::MaybeSend;
use crate::session::TurnCommand;
use crate::{ErrorKind, Result};

/// Frames read from the store per page when replaying.
pub const REPLAY_PAGE: usize = 1000;

/// How an actor reaches its connections and its host. Every call is
/// synchronous: a transport queues (a channel push, a `WebSocket::send`),
/// it never waits on a reader.
pub trait Transport: MaybeSend {
    /// Queue `message` for `conn`. `false` when the connection is gone or
    /// was dropped for falling too far behind (a replay then stops).
    fn send(&mut self, conn: ConnId, message: ServerMessage) -> bool;
    /// Queue `message` for each of `conns`, in order (a stored frame or a
    /// live part fanned out to every client). By default a
    /// [`send`](Self::send) of a copy per connection; a transport with many
    /// readers shares one message (and its encoding) between them instead.
    fn send_all(&mut self, conns: &[ConnId], message: ServerMessage) {
        if let Some((&last, rest)) = conns.split_last() {
            for &conn in rest {
                self.send(conn, message.clone());
            }
            self.send(last, message);
        }
    }
    /// Close `conn` after what was queued.
    fn close(&mut self, conn: ConnId, reason: &str);
    /// A stored client message asks for an engine call: perform it (it must
    /// not block: spawn it), or forward it to the runtime that runs turns.
    fn dispatch(&mut self, command: TurnCommand);
}

/// Drives one [`SessionActor`]. See the module docs.
#[derive(Debug)]
pub struct ActorDriver<T> {
    store: Arc<dyn SessionStore>,
    transport: T,
    actor: SessionActor,
}

impl<T: Transport> ActorDriver<T> {
    /// Start the actor of `store`'s session from its stored info.
    pub async fn recover(
        store: Arc<dyn SessionStore>,
        config: ActorConfig,
        transport: T,
    ) -> Result<Self> {
        let info = store.info().await?;
        let mut actor = SessionActor::from_info(config, &info);
        // A running turn's host calls are in its frames, not the meta: read
        // them (one turn's worth) so a repeated call id is answered with its
        // recorded outcome and a call that was out is never sent again.
        if let Some(turn) = info.meta.active_turn() {
            let mut cursor = turn.start_seq.saturating_sub(1);
            while cursor < info.last_seq {
                let page = store.read(cursor, REPLAY_PAGE).await?;
                let Some(last) = page.last() else { break };
                cursor = last.seq;
                for frame in &page {
                    actor.recover_turn_frame(frame);
                }
            }
        }
        Ok(Self {
            actor,
            store,
            transport,
        })
    }

    /// The machine (read-only: feed it through [`handle`](Self::handle)).
    pub fn actor(&self) -> &SessionActor {
        &self.actor
    }

    /// The transport.
    pub fn transport(&self) -> &T {
        &self.transport
    }

    /// The transport, to register connections before their `Connect`.
    pub fn transport_mut(&mut self) -> &mut T {
        &mut self.transport
    }

    /// The store.
    pub fn store(&self) -> &Arc<dyn SessionStore> {
        &self.store
    }

    /// Feed one input and perform everything it leads to.
    pub async fn handle(&mut self, input: Input) {
        let outputs = self.actor.handle(input);
        self.perform(outputs).await;
    }

    /// Feed several inputs (those that queued up while the last ones were
    /// handled) with their appends committed as groups
    /// ([`SessionStore::append_grouped`]): the machine gets every append's
    /// result at once, as with [`handle`](Self::handle), but every other
    /// output — acks, fan-out, replays, dispatches — waits, in order, until
    /// the groups the appends joined are committed. So one commit serves
    /// many appends, and nothing is acknowledged, shown or dispatched
    /// before it is durable.
    ///
    /// `Err` when a group's commit failed: none of the batch's outputs was
    /// performed (no ack for a frame that is not stored), and the machine
    /// has seen appends that are not stored. Drop the driver, close its
    /// connections and [`recover`](Self::recover) from the store, as after
    /// a crash.
    pub async fn handle_batch(&mut self, inputs: Vec<Input>) -> Result<()> {
        let mut deferred = Vec::new();
        let mut groups: Vec<u64> = Vec::new();
        for input in inputs {
            let mut queue: VecDeque<Output> = self.actor.handle(input).into();
            while let Some(output) = queue.pop_front() {
                let Output::Append(request) = output else {
                    deferred.push(output);
                    continue;
                };
                let input = match self.store.append_grouped(request).await {
                    Ok((appended, group)) => {
                        if groups.last() != Some(&group) {
                            groups.push(group);
                        }
                        Input::Appended {
                            frame: appended.frame,
                            duplicate: appended.duplicate,
                        }
                    }
                    Err(e) => Input::AppendFailed {
                        kind: e.kind(),
                        error: e.to_string(),
                    },
                };
                let more = self.actor.handle(input);
                for output in more.into_iter().rev() {
                    queue.push_front(output);
                }
            }
        }
        for group in groups {
            self.store.commit_group(group).await?;
        }
        self.perform(deferred).await;
        Ok(())
    }

    /// The transport back, to close its connections after a failed
    /// [`handle_batch`](Self::handle_batch) and recover with it.
    pub fn into_transport(self) -> T {
        self.transport
    }

    async fn perform(&mut self, outputs: Vec<Output>) {
        let mut queue: VecDeque<Output> = outputs.into();
        while let Some(output) = queue.pop_front() {
            match output {
                Output::Append(request) => {
                    let input = match self.store.append(request).await {
                        Ok(appended) => Input::Appended {
                            frame: appended.frame,
                            duplicate: appended.duplicate,
                        },
                        Err(e) => Input::AppendFailed {
                            kind: e.kind(),
                            error: e.to_string(),
                        },
                    };
                    let more = self.actor.handle(input);
                    for output in more.into_iter().rev() {
                        queue.push_front(output);
                    }
                }
                Output::Replay { conn, after, until } => self.replay(conn, after, until).await,
                Output::Send { conn, message } => {
                    self.transport.send(conn, message);
                }
                Output::SendAll { conns, message } => self.transport.send_all(&conns, message),
                Output::Close { conn, reason } => self.transport.close(conn, &reason),
                Output::Dispatch(command) => self.transport.dispatch(command),
            }
        }
    }

    /// Send stored frames `after < seq <= until` to `conn`. A replay from
    /// the start (0) of a trimmed log starts at its cut; one resuming
    /// inside the cut is told those frames are gone and closed
    /// ([`LogInfo::reader_start`](crate::log::LogInfo::reader_start), the
    /// rule every server's event streams follow). The cut is looked up
    /// only when a read says it exists, so an untrimmed log pays nothing.
    async fn replay(&mut self, conn: ConnId, after: u64, until: u64) {
        let mut cursor = after;
        let mut cut_checked = false;
        while cursor < until {
            let want = usize::try_from(until - cursor)
                .unwrap_or(REPLAY_PAGE)
                .min(REPLAY_PAGE);
            match self.store.read(cursor, want).await {
                Ok(page) if page.is_empty() => break,
                Ok(page) => {
                    for frame in page {
                        if frame.seq > until {
                            return;
                        }
                        cursor = frame.seq;
                        if !self.transport.send(conn, ServerMessage::Frame { frame }) {
                            return;
                        }
                    }
                }
                Err(e) if e.kind() == ErrorKind::Gone && !cut_checked => {
                    cut_checked = true;
                    match self.store.info().await.and_then(|i| i.reader_start(cursor)) {
                        Ok(start) => cursor = start,
                        Err(e) if e.kind() == ErrorKind::Gone => {
                            self.transport
                                .send(conn, ServerMessage::error(ErrorCode::Gone, e.to_string()));
                            self.transport.close(conn, "gone");
                            return;
                        }
                        Err(e) => return self.replay_failed(conn, cursor, &e),
                    }
                }
                Err(e) => return self.replay_failed(conn, cursor, &e),
            }
        }
    }

    /// A reader with a hole in its history must not go on as if it had
    /// everything: tell it and close.
    fn replay_failed(&mut self, conn: ConnId, cursor: u64, e: &crate::Error) {
        let message = ServerMessage::error(
            ErrorCode::ReplayFailed,
            format!("could not read frames after {cursor}: {e}"),
        );
        self.transport.send(conn, message);
        self.transport.close(conn, "replay failed");
    }
}
