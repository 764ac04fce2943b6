//! [`SessionObject`]: the Durable Object of one session — core's
//! [`ActorDriver`] over the object's SQLite ([`DoStore`]) and a transport of
//! per-connection channels. The front (`front.rs`) has already checked the
//! token and parsed the request; it calls the object on internal paths
//! (`/create`, `/info`, `/messages`, `/events`, `/frames`, `/export`,
//! `/seal`) with the session id in `x-harness-session`.
//!
//! Writes go through the actor (one at a time, behind an async lock);
//! reads of stored history (`/frames`, `/export`) go to the store directly.
//! An SSE reader is a connection whose channel feeds the response body;
//! when the reader goes away its id is queued and the actor hears the
//! disconnect before its next input.

// `#[durable_object]` expands to an unsafe block (a `&'static self` for the
// object's promises): allowed here, denied elsewhere in the crate.
#![allow(unsafe_code)]

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;

use durable_workflows::engine::WorkflowsEngine;
use futures::channel::mpsc::{unbounded, TryRecvError, UnboundedReceiver, UnboundedSender};
use futures::lock::{Mutex, MutexGuard};
use futures::StreamExt;
use harness_core::actor::{
    ActorConfig, ClientMessage, ConnId, ErrorCode, Input, Role, ServerMessage,
};
use harness_core::actor_driver::{ActorDriver, Transport};
use harness_core::log::retention;
use harness_core::log::{unknown_session, verify_store, ChainKey, SessionStore};
use harness_core::session::{SessionConfig, SessionRuntime, TurnCommand};
use harness_core::turn::Budget;
use harness_core::SessionId;
use serde::{Deserialize, Serialize};
use session_api::request::{self, Verified, PAGE};
use session_api::sse::{EventsReader, EventsStep, KEEP_ALIVE, KEEP_ALIVE_INTERVAL};
use session_api::ui_stream::{UiStreamMapper, UI_STREAM_HEADER};
use session_api::ws::{self, Inbound};
use session_api::{ApiError, GrantRole};
use wasm_bindgen::JsCast;
use worker::{
    durable_object, wasm_bindgen, DurableObject, Env, Headers, Method, Request, Response, State,
    WebSocket, WebSocketIncomingMessage, WebSocketPair,
};

use crate::front::{
    error_response, json_response, max_frame_bytes, GRANT_HOST_HEADER, SESSION_HEADER,
};
use crate::journal::{BrokerState, CallFigures, Journal};
use crate::store::{DoStore, ForkPrefix};
use crate::turns::RunnerRequest;

/// What the actor sends a connection.
#[derive(Debug)]
pub(crate) enum Outbound {
    Msg(ServerMessage),
    Close(String),
}

/// Most messages queued for one HTTP reader of this object by default
/// (`HARNESS_MAX_QUEUED`): a reader further behind is dropped — its stream
/// ends, and it resumes from its last event id — instead of holding an
/// ever longer queue in the object's memory. `harness serve` drops at the
/// same depth (`session_runtime::MAX_QUEUED`).
pub(crate) const MAX_QUEUED: usize = 10_000;

/// The reading end of a connection's channel, counting what it takes off
/// the queue the actor's end counts onto.
#[derive(Debug)]
pub(crate) struct Inbox {
    rx: UnboundedReceiver<Outbound>,
    depth: Rc<Cell<usize>>,
}

impl Inbox {
    /// A message already queued, if any.
    pub(crate) fn try_recv(&mut self) -> Result<Outbound, TryRecvError> {
        let message = self.rx.try_recv()?;
        self.depth.set(self.depth.get().saturating_sub(1));
        Ok(message)
    }
}

impl futures::Stream for Inbox {
    type Item = Outbound;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Outbound>> {
        let polled = self.rx.poll_next_unpin(cx);
        if let std::task::Poll::Ready(Some(_)) = &polled {
            self.depth.set(self.depth.get().saturating_sub(1));
        }
        polled
    }
}

/// Where the actor's messages to one connection go.
#[derive(Debug)]
enum Peer {
    /// An HTTP request of this object (an SSE reader, a `POST /messages`,
    /// a runner message of the turn's Workflow), through its channel, and
    /// how many messages wait in it.
    Channel(UnboundedSender<Outbound>, Rc<Cell<usize>>),
    /// A WebSocket the object accepted with the hibernation API.
    Socket(WebSocket),
}

/// Connections; turn commands wait in `commands` until the request that
/// caused them performs them (`SessionObject::perform`).
#[derive(Debug)]
struct DoTransport {
    conns: HashMap<ConnId, Peer>,
    commands: Vec<TurnCommand>,
    /// A channel reader this many messages behind is dropped.
    max_queued: usize,
}

impl DoTransport {
    fn new(max_queued: usize) -> Self {
        Self {
            conns: HashMap::new(),
            commands: Vec::new(),
            max_queued,
        }
    }
}

impl Transport for DoTransport {
    fn send(&mut self, conn: ConnId, message: ServerMessage) -> bool {
        match self.conns.get(&conn) {
            Some(Peer::Channel(_, depth)) if depth.get() >= self.max_queued => {
                // Too far behind: its channel closes once drained, its
                // stream ends, and it resumes from its last event id.
                worker::console_log!(
                    "dropping connection {conn}: {} messages behind",
                    depth.get()
                );
                self.conns.remove(&conn);
                false
            }
            Some(Peer::Channel(tx, depth)) => {
                depth.set(depth.get() + 1);
                tx.unbounded_send(Outbound::Msg(message)).is_ok()
            }
            Some(Peer::Socket(ws)) => {
                serde_json::to_string(&message).is_ok_and(|text| ws.send_with_str(text).is_ok())
            }
            None => false,
        }
    }

    fn close(&mut self, conn: ConnId, reason: &str) {
        match self.conns.remove(&conn) {
            Some(Peer::Channel(tx, _)) => {
                let _ = tx.unbounded_send(Outbound::Close(reason.to_string()));
            }
            Some(Peer::Socket(ws)) => {
                let reason = ws::close_reason(reason).to_string();
                let _ = ws.close(Some(ws::CLOSED_BY_SESSION), Some(reason));
            }
            None => {}
        }
    }

    fn dispatch(&mut self, command: TurnCommand) {
        // Performed after the actor's lock is released: starting a
        // Workflow instance is a network call, and the actor must not wait
        // on it.
        self.commands.push(command);
    }
}

/// What a hibernating socket remembers about itself (its attachment): the
/// actor's connection id, its role, and whether its token is the host's.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
struct SocketTag {
    conn: ConnId,
    role: Role,
    host: bool,
}

#[derive(Debug)]
struct Live {
    driver: ActorDriver<DoTransport>,
    next_conn: ConnId,
}

impl Live {
    /// The commands the actor dispatched, with the runner generation a
    /// Workflow instance started now runs as (one above the current, so it
    /// fences any older instance of the session).
    fn take_commands(&mut self) -> (Vec<TurnCommand>, u64) {
        let generation = self.driver.actor().generation() + 1;
        (
            std::mem::take(&mut self.driver.transport_mut().commands),
            generation,
        )
    }

    fn open(&mut self) -> (ConnId, Inbox) {
        let conn = self.next_conn;
        self.next_conn += 1;
        let (tx, rx) = unbounded();
        let depth = Rc::new(Cell::new(0));
        self.driver
            .transport_mut()
            .conns
            .insert(conn, Peer::Channel(tx, depth.clone()));
        (conn, Inbox { rx, depth })
    }
}

/// The Durable Object of one session.
#[durable_object]
pub struct SessionObject {
    state: State,
    pub(crate) env: Env,
    /// The actor, once a request needed it.
    live: Mutex<Option<Live>>,
    /// Connections whose reader went away, for the actor to hear.
    pub(crate) gone: Rc<RefCell<Vec<ConnId>>>,
    /// Set once the session was found in storage.
    exists: Cell<bool>,
    /// Set once the storage's schema was brought up to date.
    migrated: Cell<bool>,
}

impl std::fmt::Debug for SessionObject {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionObject").finish_non_exhaustive()
    }
}

impl DurableObject for SessionObject {
    fn new(state: State, env: Env) -> Self {
        Self {
            state,
            env,
            live: Mutex::new(None),
            gone: Rc::default(),
            exists: Cell::new(false),
            migrated: Cell::new(false),
        }
    }

    async fn fetch(&self, req: Request) -> worker::Result<Response> {
        match self.route(req).await {
            Ok(response) => Ok(response),
            Err(e) => error_response(&e),
        }
    }

    async fn websocket_message(
        &self,
        ws: WebSocket,
        message: WebSocketIncomingMessage,
    ) -> worker::Result<()> {
        self.socket_message(&ws, message).await;
        Ok(())
    }

    async fn websocket_close(
        &self,
        ws: WebSocket,
        _code: usize,
        _reason: String,
        _was_clean: bool,
    ) -> worker::Result<()> {
        self.socket_gone(&ws).await;
        Ok(())
    }

    async fn websocket_error(&self, ws: WebSocket, _error: worker::Error) -> worker::Result<()> {
        self.socket_gone(&ws).await;
        Ok(())
    }
}

/// Send one server message on a socket (best effort: a socket that is
/// gone is noticed by its close event).
fn send_on(ws: &WebSocket, message: &ServerMessage) {
    if let Ok(text) = serde_json::to_string(message) {
        let _ = ws.send_with_str(text);
    }
}

impl SessionObject {
    /// Accept a WebSocket (the front checked its token and role): the
    /// hibernation API holds it, its attachment remembers who it is, and
    /// the actor hears it connect (a client with `after` gets the frames
    /// since then first, as on `session-server`).
    async fn accept_socket(
        &self,
        session: &SessionId,
        req: &Request,
        params: &HashMap<String, String>,
    ) -> Result<Response, ApiError> {
        let upgrade = req
            .headers()
            .get("upgrade")
            .ok()
            .flatten()
            .unwrap_or_default();
        if !upgrade.eq_ignore_ascii_case("websocket") {
            return Err(ApiError::new(
                426,
                "upgrade_required",
                "GET /ws takes a WebSocket upgrade",
            ));
        }
        let role = ws::role(params)?;
        let after = match role {
            Role::Client => request::param_u64(params, "after")?,
            _ => None,
        };
        let host = req
            .headers()
            .get(GRANT_HOST_HEADER)
            .ok()
            .flatten()
            .as_deref()
            == Some("1");
        // The actor first: made now, it would take an accepted socket
        // without its attachment for a stale one.
        let mut guard = self.actor(session).await?;
        let live = guard.as_mut().expect("the actor is live");
        // 410 for a client resuming inside a trimmed log's cut, before the
        // upgrade (as on `session-server`); one from 0 starts at the cut.
        let after = match after {
            Some(after) => Some(live.driver.store().info().await?.reader_start(after)?),
            None => None,
        };
        let pair = WebSocketPair::new().map_err(internal)?;
        self.state.accept_web_socket(&pair.server);
        let conn = live.next_conn;
        live.next_conn += 1;
        pair.server
            .serialize_attachment(SocketTag { conn, role, host })
            .map_err(internal)?;
        live.driver
            .transport_mut()
            .conns
            .insert(conn, Peer::Socket(pair.server.clone()));
        live.driver
            .handle(Input::Connect { conn, role, after })
            .await;
        let commands = live.take_commands();
        drop(guard);
        self.perform(session, commands).await;
        Response::from_websocket(pair.client).map_err(internal)
    }

    /// One message on a socket: typed by its role and handed to the actor,
    /// or refused on the socket with nothing stored.
    async fn socket_message(&self, socket: &WebSocket, message: WebSocketIncomingMessage) {
        let session = match DoStore::stored_session(&self.state.storage().sql()) {
            Ok(Some(session)) => session,
            _ => {
                let _ = socket.close(Some(1011), Some("this object holds no session"));
                return;
            }
        };
        let mut guard = match self.actor(&session).await {
            Ok(guard) => guard,
            Err(e) => return send_on(socket, &e.to_message()),
        };
        let live = guard.as_mut().expect("the actor is live");
        let Ok(Some(tag)) = socket.deserialize_attachment::<SocketTag>() else {
            let _ = socket.close(Some(1011), Some("lost its session state"));
            return;
        };
        let text = match message {
            WebSocketIncomingMessage::String(text) => text,
            WebSocketIncomingMessage::Binary(_) => return send_on(socket, &ws::binary_refused()),
        };
        let grant = if tag.host {
            GrantRole::Host
        } else {
            GrantRole::Client
        };
        let limit = request::body_limit(max_frame_bytes(&self.env));
        let conn = tag.conn;
        let input = match ws::parse_inbound(tag.role, grant, &text, limit) {
            Ok(Inbound::Client(message)) => Input::Client { conn, message },
            Ok(Inbound::Runner(message)) => Input::Runner { conn, message },
            Ok(Inbound::ToolHost(message)) => Input::ToolHost { conn, message },
            Err(refusal) => return send_on(socket, &refusal),
        };
        live.driver.handle(input).await;
        let commands = live.take_commands();
        drop(guard);
        self.perform(&session, commands).await;
    }

    /// A socket closed or failed: the actor hears the disconnect.
    async fn socket_gone(&self, socket: &WebSocket) {
        let _ = socket.close(Some(1000), Some("closed"));
        let Ok(Some(session)) = DoStore::stored_session(&self.state.storage().sql()) else {
            return;
        };
        let Ok(mut guard) = self.actor(&session).await else {
            return;
        };
        let live = guard.as_mut().expect("the actor is live");
        if let Ok(Some(tag)) = socket.deserialize_attachment::<SocketTag>() {
            live.driver.transport_mut().conns.remove(&tag.conn);
            live.driver
                .handle(Input::Disconnect { conn: tag.conn })
                .await;
        }
    }
}

impl SessionObject {
    fn store(&self, session: &SessionId) -> DoStore {
        DoStore::new(
            self.state.storage().sql(),
            session.clone(),
            max_frame_bytes(&self.env),
            chain_key(&self.env),
        )
    }

    /// Bring an object created by an older Worker up to the current
    /// schema, once per instance.
    fn migrate_once(&self) -> Result<(), ApiError> {
        if !self.migrated.get() {
            DoStore::migrate(&self.state.storage().sql())?;
            self.migrated.set(true);
        }
        Ok(())
    }

    /// Delete the session (docs/retention.md): refused while a turn runs
    /// (core's rule); the Cloudflare sandbox it owns is removed through the
    /// bridge (core's rule again: one its bridge no longer has is gone
    /// already, any other failure keeps the session for a retry); every
    /// connection is closed, then the object's storage — the log, its
    /// index, the turn mailbox — is emptied.
    async fn delete(&self, session: &SessionId, store: &DoStore) -> Result<Response, ApiError> {
        let info = store.info().await?;
        retention::check_deletable(&info)?;
        if let Some(handle) = retention::owned_sandbox(&info) {
            match crate::turns::bridge_provider(&self.env) {
                Ok(provider) if provider.name() == handle.provider => {
                    retention::remove_sandbox(&info, handle, provider.as_ref()).await?;
                }
                // A sandbox of another provider (a session moved here) or
                // no bridge configured: not this Worker's to remove.
                _ => worker::console_log!(
                    "session {session}: its {} sandbox {} is left (not this Worker's bridge)",
                    handle.provider,
                    handle.id
                ),
            }
        }
        self.remove(session).await?;
        Ok(Response::empty().map_err(internal)?.with_status(204))
    }

    /// Close every connection and empty the object's storage (a delete,
    /// once its rules allowed it).
    async fn remove(&self, session: &SessionId) -> Result<(), ApiError> {
        let reason = format!("session {session} was deleted");
        if let Some(mut live) = self.live.lock().await.take() {
            let transport = live.driver.transport_mut();
            let conns: Vec<ConnId> = transport.conns.keys().copied().collect();
            for conn in conns {
                transport.close(conn, &reason);
            }
        }
        // Sockets of a hibernated actor are not in a live transport.
        for ws in self.state.get_websockets() {
            let _ = ws.close(
                Some(ws::CLOSED_BY_SESSION),
                Some(ws::close_reason(&reason).to_string()),
            );
        }
        let storage = self.state.storage();
        storage.delete_alarm().await.map_err(internal)?;
        storage.delete_all().await.map_err(internal)?;
        self.exists.set(false);
        self.migrated.set(false);
        Ok(())
    }

    /// 404 unless the session was created (nothing is written to find out).
    fn check_exists(&self, session: &SessionId) -> Result<(), ApiError> {
        if self.exists.get() {
            return Ok(());
        }
        match DoStore::stored_session(&self.state.storage().sql())? {
            Some(stored) if &stored == session => {
                self.exists.set(true);
                Ok(())
            }
            _ => Err(unknown_session(session).into()),
        }
    }

    /// The actor, recovered from the store on first use, after it heard
    /// about every reader that left.
    async fn actor(&self, session: &SessionId) -> Result<MutexGuard<'_, Option<Live>>, ApiError> {
        let mut guard = self.live.lock().await;
        if guard.is_none() {
            let store: Arc<dyn SessionStore> = Arc::new(self.store(session));
            let config = ActorConfig {
                max_frame_bytes: max_frame_bytes(&self.env),
            };
            let max_queued = self
                .env
                .var("HARNESS_MAX_QUEUED")
                .ok()
                .and_then(|v| v.to_string().parse::<usize>().ok())
                .filter(|n| *n > 0)
                .unwrap_or(MAX_QUEUED);
            let driver = ActorDriver::recover(store, config, DoTransport::new(max_queued)).await?;
            let mut live = Live {
                driver,
                next_conn: 1,
            };
            // Sockets outlive an evicted object (hibernation): the new
            // actor hears them connect again. Nothing was appended while
            // the object was away, so they need no replay.
            for ws in self.state.get_websockets() {
                let Ok(Some(tag)) = ws.deserialize_attachment::<SocketTag>() else {
                    let _ = ws.close(Some(1011), Some("lost its session state"));
                    continue;
                };
                let conn = live.next_conn;
                live.next_conn += 1;
                let tag = SocketTag { conn, ..tag };
                if ws.serialize_attachment(tag).is_err() {
                    let _ = ws.close(Some(1011), Some("lost its session state"));
                    continue;
                }
                live.driver
                    .transport_mut()
                    .conns
                    .insert(conn, Peer::Socket(ws));
                live.driver
                    .handle(Input::Connect {
                        conn,
                        role: tag.role,
                        after: None,
                    })
                    .await;
            }
            *guard = Some(live);
        }
        let live = guard.as_mut().expect("set above");
        let gone: Vec<ConnId> = self.gone.borrow_mut().drain(..).collect();
        for conn in gone {
            live.driver.transport_mut().conns.remove(&conn);
            live.driver.handle(Input::Disconnect { conn }).await;
        }
        Ok(guard)
    }

    async fn route(&self, mut req: Request) -> Result<Response, ApiError> {
        let session = request::session_id(
            &req.headers()
                .get(SESSION_HEADER)
                .ok()
                .flatten()
                .unwrap_or_default(),
        )?;
        let url = req.url().map_err(internal)?;
        let params = request::parse_query(url.query().unwrap_or(""));
        let op = url.path().trim_start_matches('/').to_string();
        self.migrate_once()?;
        #[cfg(feature = "test-routes")]
        if let Some(test_op) = op.strip_prefix(crate::test_routes::LOG_OP) {
            return self.test_log_op(&session, test_op, &mut req, &params).await;
        }
        if op == "fork-into" {
            // This object becomes the fork of the prefix its source sent.
            let prefix: ForkPrefix = json_body(&mut req, "fork prefix").await?;
            let info = self.store(&session).create_fork(prefix)?;
            self.exists.set(true);
            return json_response(201, &info);
        }
        if op == "create" {
            let config: SessionConfig = json_body(&mut req, "session config").await?;
            let info = self.store(&session).create(Some(config.clone()))?;
            request::check_created(&info, &config)?;
            self.exists.set(true);
            return json_response(201, &info);
        }
        if op == "turn-abort" || op == "turn-progress" {
            return self.turn_mailbox(&session, &op, &mut req, &params).await;
        }
        self.check_exists(&session)?;
        let store = self.store(&session);
        match op.as_str() {
            "info" => json_response(200, &store.info().await?),
            "trim" => {
                let bytes = req.bytes().await.map_err(internal)?;
                let through = request::trim_through(&bytes)?;
                // On the store, as harness serve trims its log: the actor
                // keeps no frames, and the next reader starts at the cut.
                json_response(200, &store.trim(through)?)
            }
            "delete" => self.delete(&session, &store).await,
            // The Worker broker's journal (journal.rs): internal, reached
            // only by the broker route and the turn's slices.
            broker if broker.starts_with("broker-") => {
                self.broker_op(broker, &store, &mut req, &params).await
            }
            "search" => json_response(200, &store.search(&request::search_query(&params)?)?),
            "frames" => {
                let (after, limit) = request::frames_page(&params)?;
                json_response(200, &store.read(after, limit).await?)
            }
            "export" => export(&store, &params).await,
            "verify" => {
                let report = verify_store(&store, &chain_key(&self.env)).await?;
                json_response(200, &Verified::new(session.clone(), report))
            }
            "messages" => {
                let message: ClientMessage = json_body(&mut req, "client message").await?;
                let (seq, duplicate, turn_id) = self.request(&session, message).await?;
                json_response(200, &request::ack(seq, duplicate, turn_id))
            }
            "seal" => {
                self.request(&session, ClientMessage::Seal {}).await?;
                json_response(200, &store.info().await?)
            }
            "runner" => {
                let request: RunnerRequest = json_body(&mut req, "runner message").await?;
                let reply = self.runner(&session, request).await?;
                json_response(200, &reply)
            }
            "fork-prefix" => {
                let until = match request::param_u64(&params, "until")? {
                    Some(n) => n,
                    None => store.info().await?.last_seq,
                };
                json_response(200, &store.fork_prefix(until)?)
            }
            "ws" => self.accept_socket(&session, &req, &params).await,
            "events" => self.events(&session, &store, &params).await,
            "stream" => self.session_stream(&session, &store, &req).await,
            "ui-stream" => self.ui_stream(&session, &store, &params).await,
            _ => Err(ApiError::no_route()),
        }
    }

    /// A log-suite operation on this object's store directly
    /// (`test-routes` builds only: the Worker's run of the log suite).
    #[cfg(feature = "test-routes")]
    async fn test_log_op(
        &self,
        session: &SessionId,
        test_op: &str,
        req: &mut Request,
        params: &HashMap<String, String>,
    ) -> Result<Response, ApiError> {
        let stored = DoStore::stored_session(&self.state.storage().sql())?;
        if test_op == "delete" {
            // As a store deletes: the server's rule (no delete while a
            // turn runs) is not the store's.
            if stored.as_ref() != Some(session) {
                return crate::test_routes::answer::<()>(Err(unknown_session(session)))
                    .map_err(internal);
            }
            self.remove(session).await?;
            return crate::test_routes::answer(Ok(())).map_err(internal);
        }
        let store = self.store(session);
        let response = crate::test_routes::object_log_op(&store, stored, test_op, req, params)
            .await
            .map_err(internal)?;
        if test_op == "create" && response.status_code() == 200 {
            self.exists.set(true);
        }
        Ok(response)
    }

    /// The Worker broker's journal (journal.rs): the session's running
    /// turn, budget and usage; a call's figures recorded, listed and
    /// marked as counted; the budget set.
    async fn broker_op(
        &self,
        op: &str,
        store: &DoStore,
        req: &mut Request,
        params: &HashMap<String, String>,
    ) -> Result<Response, ApiError> {
        let sql = self.state.storage().sql();
        let journal = Journal::open(&sql)?;
        match op {
            "broker-state" => {
                let info = store.info().await?;
                json_response(
                    200,
                    &BrokerState {
                        running_turn: info.meta.active_turn().map(|t| t.turn_id.clone()),
                        budget: journal.budget()?,
                        usage: journal.usage()?,
                    },
                )
            }
            "broker-call" => {
                let call: CallFigures = json_body(req, "call record").await?;
                let index = journal.record(&call)?;
                json_response(200, &serde_json::json!({ "index": index }))
            }
            "broker-calls" => json_response(200, &journal.unrecorded()?),
            "broker-recorded" => {
                let upto = request::param_u64(params, "upto")?
                    .ok_or_else(|| ApiError::invalid("broker-recorded needs ?upto=<index>"))?;
                journal.recorded(upto)?;
                Ok(Response::empty().map_err(internal)?.with_status(204))
            }
            "broker-budget" => {
                let budget: Budget = json_body(req, "budget").await?;
                journal.set_budget(&budget)?;
                Ok(Response::empty().map_err(internal)?.with_status(204))
            }
            _ => Err(ApiError::no_route()),
        }
    }

    /// The turn's mailbox and progress board, kept by the session's object
    /// for the Workflow instance that runs the turn (turns.rs):
    ///
    /// - `GET turn-abort?turn=`: the abort a client asked for — from the
    ///   stored meta when this object holds the session, else from the
    ///   mailbox `POST turn-abort?turn=` `{"reason"}` wrote (the engine API
    ///   aborts turns of sessions that live elsewhere, engine_api.rs);
    /// - `POST turn-progress?turn=` (a `TurnState`): the state the instance
    ///   published (it shows no output before its end); `GET` reads it.
    ///   With `&initial=1` it is stored only if the turn has none yet, so
    ///   the engine API's initial state never hides what the instance
    ///   published.
    ///
    /// One key each in the object's key-value storage, holding the latest
    /// turn's (a session runs one turn at a time): a session's turns leave
    /// no trail of old states behind.
    async fn turn_mailbox(
        &self,
        session: &SessionId,
        op: &str,
        req: &mut Request,
        params: &HashMap<String, String>,
    ) -> Result<Response, ApiError> {
        let turn = params.get("turn").cloned().unwrap_or_default();
        if turn.is_empty() {
            return Err(ApiError::invalid(format!("{op} needs ?turn=<turn id>")));
        }
        let storage = self.state.storage();
        // The stored value, if it is this turn's.
        let stored = |json: Option<String>| -> Option<serde_json::Value> {
            let value: serde_json::Value = serde_json::from_str(&json?).ok()?;
            let of = value.get("turn_id").or_else(|| value.get("turn"))?;
            (of.as_str() == Some(turn.as_str())).then_some(value)
        };
        match (req.method(), op) {
            (Method::Get, "turn-abort") => {
                let mut abort = None;
                if self.check_exists(session).is_ok() {
                    let info = self.store(session).info().await?;
                    abort = info
                        .meta
                        .active_turn()
                        .filter(|t| t.turn_id == turn)
                        .and_then(|t| t.abort.clone());
                }
                if abort.is_none() {
                    let mailbox = storage.get::<String>(op).await.map_err(internal)?;
                    abort = stored(mailbox).and_then(|v| v["reason"].as_str().map(str::to_string));
                }
                json_response(200, &serde_json::json!({ "abort": abort }))
            }
            (Method::Post, "turn-abort") => {
                let body: serde_json::Value = json_body(req, "abort").await?;
                let reason = body["reason"].as_str().unwrap_or("aborted");
                let note = serde_json::json!({ "turn": turn, "reason": reason }).to_string();
                storage.put(op, note).await.map_err(internal)?;
                json_response(200, &serde_json::json!({ "abort": true }))
            }
            (Method::Get, _) => match stored(storage.get::<String>(op).await.map_err(internal)?) {
                Some(state) => json_response(200, &state),
                None => Err(ApiError::new(
                    404,
                    "not_found",
                    format!("turn {turn} of {session} published no progress"),
                )),
            },
            (Method::Post, _) => {
                let state: serde_json::Value = json_body(req, "progress").await?;
                if state["turn_id"].as_str() != Some(turn.as_str()) {
                    return Err(ApiError::invalid(format!(
                        "progress of turn {} posted for turn {turn}",
                        state["turn_id"]
                    )));
                }
                if request::param_flag(params, "initial")
                    && stored(storage.get::<String>(op).await.map_err(internal)?).is_some()
                {
                    return json_response(200, &serde_json::json!({ "stored": false }));
                }
                storage.put(op, state.to_string()).await.map_err(internal)?;
                json_response(200, &serde_json::json!({ "stored": true }))
            }
            _ => Err(ApiError::no_route()),
        }
    }

    /// One input on a connection that lasts while it is handled: connect
    /// as `role`, hand the actor `input(conn)`, disconnect, then perform the
    /// turn commands it dispatched. The store answers at once, so the
    /// actor's answers are queued on the returned receiver by then.
    async fn one_shot(
        &self,
        session: &SessionId,
        role: Role,
        input: impl FnOnce(ConnId) -> Input,
    ) -> Result<Inbox, ApiError> {
        let mut guard = self.actor(session).await?;
        let live = guard.as_mut().expect("the actor is live");
        let (conn, rx) = live.open();
        let driver = &mut live.driver;
        driver
            .handle(Input::Connect {
                conn,
                role,
                after: None,
            })
            .await;
        driver.handle(input(conn)).await;
        driver.handle(Input::Disconnect { conn }).await;
        driver.transport_mut().conns.remove(&conn);
        let commands = live.take_commands();
        drop(guard);
        self.perform(session, commands).await;
        Ok(rx)
    }

    /// One client message on a connection that lasts while it is handled;
    /// the actor's answer (`(seq, duplicate)` of an ack) or its refusal.
    async fn request(
        &self,
        session: &SessionId,
        message: ClientMessage,
    ) -> Result<(u64, bool, Option<String>), ApiError> {
        let mut rx = self
            .one_shot(session, Role::Client, |conn| Input::Client {
                conn,
                message,
            })
            .await?;
        while let Ok(out) = rx.try_recv() {
            match out {
                Outbound::Msg(ServerMessage::Ack {
                    seq,
                    duplicate,
                    turn_id,
                }) => return Ok((seq, duplicate, turn_id)),
                Outbound::Msg(ServerMessage::Received {}) => return Ok((0, false, None)),
                Outbound::Msg(ServerMessage::Error { code, message }) => {
                    return Err(ApiError::from_code(code, &message))
                }
                Outbound::Msg(_) => {}
                Outbound::Close(reason) => {
                    return Err(ApiError::new(
                        503,
                        "closed",
                        format!("the session closed the connection: {reason}"),
                    ))
                }
            }
        }
        Err(ApiError::new(
            500,
            "internal",
            "the session actor did not answer",
        ))
    }

    /// One message of the turn's Workflow instance, as runner
    /// `generation` on a connection that lasts while it is handled (open
    /// blocks outlive it: the actor keeps them for the runner's next
    /// message); the actor's reply, refusals included (`stale_runner` for
    /// a fenced instance).
    async fn runner(
        &self,
        session: &SessionId,
        request: RunnerRequest,
    ) -> Result<ServerMessage, ApiError> {
        let role = Role::Runner {
            generation: request.generation,
        };
        let message = request.message;
        let mut rx = self
            .one_shot(session, role, |conn| Input::Runner { conn, message })
            .await?;
        while let Ok(out) = rx.try_recv() {
            match out {
                Outbound::Msg(
                    reply @ (ServerMessage::Ack { .. }
                    | ServerMessage::Received {}
                    | ServerMessage::Error { .. }
                    | ServerMessage::HostTools { .. }),
                ) => return Ok(reply),
                Outbound::Msg(_) => {}
                Outbound::Close(reason) => {
                    return Ok(ServerMessage::error(
                        ErrorCode::StaleRunner,
                        format!("the session closed the runner's connection: {reason}"),
                    ))
                }
            }
        }
        Err(ApiError::new(
            500,
            "internal",
            "the session actor did not answer the runner",
        ))
    }

    /// Perform the actor's turn commands on Workflows. A start or abort
    /// that cannot be performed goes back to the actor, which records the
    /// turn as failed. Without a sandbox bridge configured
    /// (`HARNESS_CF_BRIDGE_URL`) nothing runs turns: the prompt is stored
    /// and waits, as `harness serve` without a runtime does.
    async fn perform(&self, session: &SessionId, (commands, generation): (Vec<TurnCommand>, u64)) {
        if commands.is_empty() {
            return;
        }
        let Some(runtime) = self.turn_runtime(generation) else {
            for command in commands {
                worker::console_log!("no turn engine configured; not performing {command:?}");
            }
            return;
        };
        for command in commands {
            let reports_failure = matches!(
                command,
                TurnCommand::Start { .. } | TurnCommand::Abort { .. }
            );
            let turn_id = command.turn_id().to_string();
            let kind = match &command {
                TurnCommand::Start { .. } => "start",
                TurnCommand::Answer { .. } => "answer",
                TurnCommand::Abort { .. } => "abort",
            };
            worker::console_log!("turn {turn_id} of {session}: {kind}");
            if let Err(e) = runtime.perform(session, command).await {
                worker::console_error!("turn {turn_id} of {session}: {e}");
                if !reports_failure {
                    continue;
                }
                let error = e.to_string();
                if let Ok(mut guard) = self.actor(session).await {
                    let live = guard.as_mut().expect("the actor is live");
                    live.driver
                        .handle(Input::DispatchFailed { turn_id, error })
                        .await;
                }
            }
        }
    }

    /// Turns run on the `TURNS` Workflow once a sandbox bridge is set.
    fn turn_runtime(&self, generation: u64) -> Option<SessionRuntime> {
        let bridge = self.env.var("HARNESS_CF_BRIDGE_URL").ok()?.to_string();
        if bridge.is_empty() {
            return None;
        }
        let binding = worker::js_sys::Reflect::get(&self.env, &"TURNS".into())
            .ok()
            .filter(|b| !b.is_undefined())?;
        let engine = WorkflowsEngine::new(binding.unchecked_into(), generation);
        Some(SessionRuntime::new(Arc::new(engine)))
    }

    /// SSE of stored frames after `after`, then live traffic, until the
    /// session is sealed or the reader leaves.
    async fn events(
        &self,
        session: &SessionId,
        store: &DoStore,
        params: &HashMap<String, String>,
    ) -> Result<Response, ApiError> {
        let after = request::param_u64(params, "after")?.unwrap_or(0);
        let info = store.info().await?;
        // From the cut of a trimmed log; 410 from inside it.
        let after = info.reader_start(after)?;
        let headers = sse_headers()?;
        if info.sealed && after >= info.last_seq {
            // Nothing will come: the stream is over.
            let empty = futures::stream::empty::<worker::Result<Vec<u8>>>();
            return Ok(Response::from_stream(empty)
                .map_err(internal)?
                .with_headers(headers));
        }
        // Connected first, at the log's end (the body cannot reach the
        // object once the response is out): the actor holds what comes
        // meanwhile, and the stored frames are read page by page from the
        // store, so a reader from 0 never has the whole history in memory.
        let mut events = EventsReader::new(after, info.sealed);
        let follow = if info.sealed {
            None
        } else {
            let (conn, rx) = self.connect_reader(session, info.last_seq).await?;
            events.connected(info.last_seq);
            Some((
                rx,
                Leave {
                    conn,
                    gone: self.gone.clone(),
                },
            ))
        };
        let reader = Reader {
            events,
            store: store.clone(),
            follow,
        };
        let body = futures::stream::unfold(reader, |mut reader| async move {
            let chunk = reader.next_chunk().await?;
            Some((Ok::<Vec<u8>, worker::Error>(chunk), reader))
        });
        Ok(Response::from_stream(body)
            .map_err(internal)?
            .with_headers(headers))
    }
}

impl SessionObject {
    /// Connect a reading client at `after`: the actor replays (after,
    /// last] into the channel, then every live frame.
    pub(crate) async fn connect_reader(
        &self,
        session: &SessionId,
        after: u64,
    ) -> Result<(ConnId, Inbox), ApiError> {
        let mut guard = self.actor(session).await?;
        let live = guard.as_mut().expect("the actor is live");
        let (conn, rx) = live.open();
        live.driver
            .handle(Input::Connect {
                conn,
                role: Role::Client,
                after: Some(after),
            })
            .await;
        Ok((conn, rx))
    }

    /// The AI SDK UI message stream from `after` (default: the log's end
    /// now) until the turn finishes or the session is sealed, as
    /// `session-server` answers it (`session_api::ui_stream`).
    async fn ui_stream(
        &self,
        session: &SessionId,
        store: &DoStore,
        params: &HashMap<String, String>,
    ) -> Result<Response, ApiError> {
        let info = store.info().await?;
        let after = match request::param_u64(params, "after")? {
            Some(after) => info.reader_start(after)?,
            None => info.last_seq,
        };
        let headers = sse_headers()?;
        headers.set(UI_STREAM_HEADER, "v1").map_err(internal)?;
        let (conn, rx) = self.connect_reader(session, after).await?;
        let reader = UiReader {
            rx,
            cursor: after,
            mapper: UiStreamMapper::new(format!("{session}-{after}")),
            finished: false,
            _leave: Leave {
                conn,
                gone: self.gone.clone(),
            },
        };
        let body = futures::stream::unfold(reader, |mut reader| async move {
            let chunk = reader.next_chunk().await?;
            Some((Ok::<Vec<u8>, worker::Error>(chunk.into_bytes()), reader))
        });
        Ok(Response::from_stream(body)
            .map_err(internal)?
            .with_headers(headers))
    }
}

/// A request's JSON body as `T`; one that does not parse is refused as
/// `malformed <what>`.
async fn json_body<T: serde::de::DeserializeOwned>(
    req: &mut Request,
    what: &str,
) -> Result<T, ApiError> {
    let bytes = req.bytes().await.map_err(internal)?;
    serde_json::from_slice(&bytes).map_err(|e| ApiError::invalid(format!("malformed {what}: {e}")))
}

/// `export`: the frames up to `?until=`, as JSON or a Markdown document.
async fn export(store: &DoStore, params: &HashMap<String, String>) -> Result<Response, ApiError> {
    let info = store.info().await?;
    let until = request::export_until(params, &info)?;
    let format = request::export_format(params)?;
    let mut out = Vec::new();
    let mut cursor = info.kept_after();
    while cursor < until {
        let want = usize::try_from(until - cursor).unwrap_or(PAGE).min(PAGE);
        let page = store.read(cursor, want).await?;
        let Some(last) = page.last() else { break };
        cursor = last.seq;
        out.extend(page.into_iter().filter(|f| f.seq <= until));
    }
    match format {
        request::ExportFormat::Json => json_response(200, &out),
        request::ExportFormat::Markdown => {
            let document = session_api::markdown::session_markdown(&info, &out);
            let mut response = Response::ok(document).map_err(internal)?;
            response
                .headers_mut()
                .set("content-type", session_api::markdown::MARKDOWN_CONTENT_TYPE)
                .map_err(internal)?;
            Ok(response)
        }
    }
}

/// One UI-stream reader: session messages mapped to UI chunks, then
/// `[DONE]`.
/// The headers of an SSE response.
fn sse_headers() -> Result<Headers, ApiError> {
    let headers = Headers::new();
    headers
        .set("content-type", "text/event-stream")
        .map_err(internal)?;
    headers.set("cache-control", "no-cache").map_err(internal)?;
    Ok(headers)
}

#[derive(Debug)]
struct UiReader {
    rx: Inbox,
    cursor: u64,
    mapper: UiStreamMapper,
    finished: bool,
    _leave: Leave,
}

impl UiReader {
    /// The next chunks' text; `None` after `[DONE]`.
    async fn next_chunk(&mut self) -> Option<String> {
        if self.finished {
            return None;
        }
        loop {
            if self.mapper.is_done() {
                self.finished = true;
                return Some("data: [DONE]\n\n".to_string());
            }
            let message = match self.rx.next().await {
                Some(Outbound::Msg(message)) => message,
                Some(Outbound::Close(_)) | None => {
                    self.finished = true;
                    return Some("data: [DONE]\n\n".to_string());
                }
            };
            if let ServerMessage::Frame { frame } = &message {
                if frame.seq <= self.cursor {
                    continue;
                }
                self.cursor = frame.seq;
            }
            let chunks = self.mapper.map(&message);
            if !chunks.is_empty() {
                return Some(
                    chunks
                        .iter()
                        .map(|c| format!("data: {c}\n\n"))
                        .collect::<String>(),
                );
            }
        }
    }
}

/// Queues the connection's disconnect when its reader is dropped.
#[derive(Debug)]
pub(crate) struct Leave {
    pub(crate) conn: ConnId,
    pub(crate) gone: Rc<RefCell<Vec<ConnId>>>,
}

impl Drop for Leave {
    fn drop(&mut self) {
        self.gone.borrow_mut().push(self.conn);
    }
}

/// One SSE reader: the steps of a `session_api::sse::EventsReader` over
/// the store's pages and its connection's channel, with a keep-alive
/// comment after [`KEEP_ALIVE_INTERVAL`] of quiet.
#[derive(Debug)]
struct Reader {
    events: EventsReader,
    store: DoStore,
    /// The connection (none for a session sealed when the request came).
    follow: Option<(Inbox, Leave)>,
}

impl Reader {
    /// The next chunk; `None` when the stream ends.
    async fn next_chunk(&mut self) -> Option<Vec<u8>> {
        let mut out = Vec::new();
        loop {
            match self.events.next() {
                EventsStep::ReadPage { after } => {
                    let page = self.store.read(after, PAGE).await.ok()?;
                    self.events.page(&page, &mut out);
                    if !out.is_empty() {
                        return Some(out);
                    }
                }
                // Connected before the first step, or sealed (no step
                // connects then).
                EventsStep::Connect { .. } | EventsStep::End => {
                    return (!out.is_empty()).then_some(out)
                }
                EventsStep::Follow => {
                    let (rx, _) = self.follow.as_mut()?;
                    let quiet = worker::Delay::from(KEEP_ALIVE_INTERVAL);
                    let first = match futures::future::select(rx.next(), quiet).await {
                        futures::future::Either::Left((message, _)) => message,
                        futures::future::Either::Right(_) => {
                            return Some(KEEP_ALIVE.as_bytes().to_vec())
                        }
                    };
                    // Everything already queued goes in one chunk.
                    let mut next = first;
                    loop {
                        match next {
                            Some(Outbound::Msg(message)) => self.events.message(&message, &mut out),
                            Some(Outbound::Close(_)) | None => self.events.dropped(),
                        }
                        if self.events.is_done() {
                            break;
                        }
                        // Empty or closed: a closed channel answers `None`
                        // on the next wait.
                        match rx.try_recv() {
                            Ok(message) => next = Some(message),
                            Err(_) => break,
                        }
                    }
                    if !out.is_empty() {
                        return Some(out);
                    }
                }
            }
        }
    }
}

fn internal(e: worker::Error) -> ApiError {
    ApiError::new(500, "internal", e.to_string())
}

/// The audit chain's key: the Worker secret `HARNESS_AUDIT_KEY` (kept by
/// Cloudflare, never in the object's storage; `wrangler secret put`, or
/// `.dev.vars` under `wrangler dev`). Without it the chain is unkeyed:
/// edits and deletions are still found, a consistent rewrite is not
/// (docs/audit.md).
pub(crate) fn chain_key(env: &Env) -> ChainKey {
    secret_or_var(env, "HARNESS_AUDIT_KEY")
        .map_or_else(ChainKey::unkeyed, |k| ChainKey::new(k.into_bytes()))
}

/// A Worker secret (`wrangler secret put`), else a plain variable of that
/// name (`.dev.vars`, `--var` under `wrangler dev`); `None` when neither is
/// set or it is empty.
pub(crate) fn secret_or_var(env: &Env, name: &str) -> Option<String> {
    env.secret(name)
        .map(|s| s.to_string())
        .or_else(|_| env.var(name).map(|v| v.to_string()))
        .ok()
        .filter(|v| !v.is_empty())
}
