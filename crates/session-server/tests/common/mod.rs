//! Shared test helpers: a real server on 127.0.0.1 with a SQLite log in a
//! tempdir, a WebSocket client and an SSE reader.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use futures::{SinkExt, StreamExt};
use harness_core::actor::ServerMessage;
use harness_core::log::SessionLog;
use harness_core::SessionId;
use serde_json::Value;
use session_log::SqliteSessionLog;
use session_server::{ServerConfig, SessionServer};
use tokio_tungstenite::tungstenite::Message;

pub const WAIT: Duration = Duration::from_secs(20);

pub struct TestServer {
    pub base: String,
    pub ws_base: String,
    pub log: Arc<SqliteSessionLog>,
    pub server: SessionServer,
    pub http: reqwest::Client,
    _dir: tempfile::TempDir,
}

pub async fn start(configure: impl FnOnce(&mut ServerConfig)) -> TestServer {
    let dir = tempfile::tempdir().unwrap();
    let log = Arc::new(SqliteSessionLog::open(dir.path().join("log.db")).unwrap());
    let mut config = ServerConfig::new(log.clone());
    config.insecure_no_auth = true;
    configure(&mut config);
    let server = SessionServer::new(config);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let router = server.router();
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    TestServer {
        base: format!("http://{addr}"),
        ws_base: format!("ws://{addr}"),
        log,
        server,
        http: reqwest::Client::new(),
        _dir: dir,
    }
}

pub fn sid(s: &str) -> SessionId {
    SessionId::parse(s).unwrap()
}

impl TestServer {
    pub async fn create(&self, id: &str) {
        let r = self
            .http
            .post(format!("{}/v1/sessions", self.base))
            .json(&serde_json::json!({"id": id}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 201, "{}", r.text().await.unwrap());
    }

    pub async fn last_seq(&self, id: &str) -> u64 {
        self.log.info(&sid(id)).await.unwrap().last_seq
    }
}

pub type Ws =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

pub async fn ws(url: &str) -> Ws {
    let (ws, _) = tokio_tungstenite::connect_async(url).await.unwrap();
    ws
}

pub async fn send(ws: &mut Ws, v: Value) {
    ws.send(Message::Text(v.to_string().into())).await.unwrap();
}

/// The next server message, or None when the socket closed.
pub async fn recv(ws: &mut Ws) -> Option<ServerMessage> {
    loop {
        let msg = tokio::time::timeout(WAIT, ws.next())
            .await
            .expect("timed out waiting for a server message")?;
        match msg {
            Ok(Message::Text(t)) => return Some(serde_json::from_str(t.as_str()).unwrap()),
            Ok(Message::Close(_)) | Err(_) => return None,
            Ok(_) => {}
        }
    }
}

/// Wait for the Ack (or Error) to the last write, collecting other messages.
pub async fn answer(ws: &mut Ws, seen: &mut Vec<ServerMessage>) -> ServerMessage {
    loop {
        let m = recv(ws).await.expect("socket closed before the answer");
        match m {
            ServerMessage::Ack { .. } | ServerMessage::Error { .. } => return m,
            // A runner's live part is answered with `received`.
            ServerMessage::Received {} => {}
            other => seen.push(other),
        }
    }
}

/// One SSE event.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SseEvent {
    pub id: Option<String>,
    pub event: Option<String>,
    pub data: String,
}

/// Reads SSE events from a streaming response.
pub struct SseReader {
    stream: futures::stream::BoxStream<'static, reqwest::Result<bytes::Bytes>>,
    buf: String,
}

impl SseReader {
    pub fn new(response: reqwest::Response) -> Self {
        Self {
            stream: response.bytes_stream().boxed(),
            buf: String::new(),
        }
    }

    /// The next event (comments and keep-alives skipped); None at the end.
    pub async fn next(&mut self) -> Option<SseEvent> {
        loop {
            if let Some(end) = self.buf.find("\n\n") {
                let block: String = self.buf.drain(..end + 2).collect();
                let mut ev = SseEvent::default();
                let mut data = Vec::new();
                for line in block.lines() {
                    if let Some(v) = line.strip_prefix("id:") {
                        ev.id = Some(v.trim_start().to_string());
                    } else if let Some(v) = line.strip_prefix("event:") {
                        ev.event = Some(v.trim_start().to_string());
                    } else if let Some(v) = line.strip_prefix("data:") {
                        data.push(v.strip_prefix(' ').unwrap_or(v).to_string());
                    }
                }
                if data.is_empty() && ev.id.is_none() && ev.event.is_none() {
                    continue;
                }
                ev.data = data.join("\n");
                return Some(ev);
            }
            let chunk = tokio::time::timeout(WAIT, self.stream.next())
                .await
                .expect("timed out waiting for SSE data")?;
            self.buf
                .push_str(&String::from_utf8_lossy(&chunk.ok()?).replace("\r\n", "\n"));
        }
    }
}
