//! A client of a running `harness serve` (what `harness run` uses when a
//! server drives the home): create a session, post messages, and read the
//! session's events (SSE) as the actor's `ServerMessage`s, so a turn is
//! followed exactly as in-process.

use anyhow::{bail, Context, Result};
use futures::StreamExt;
use harness::core::actor::{ClientMessage, ServerMessage};
use harness::core::frame::Frame;
use harness::core::log::LogInfo;
use harness::core::part::StreamPart;
use harness::core::session::SessionConfig;
use harness::core::sse::{read_events, ReadError, SseEvent, SseReader};
use serde_json::{json, Value};

/// A server and the token to use.
#[derive(Debug, Clone)]
pub struct RemoteClient {
    http: reqwest::Client,
    base: String,
    token: Option<String>,
}

async fn check(response: reqwest::Response, what: &str) -> Result<Value> {
    let status = response.status();
    let body: Value = response.json().await.unwrap_or(Value::Null);
    if !status.is_success() {
        let message = body["error"]["message"]
            .as_str()
            .map(str::to_string)
            .unwrap_or_else(|| body.to_string());
        bail!("{what}: the server answered {status}: {message}");
    }
    Ok(body)
}

impl RemoteClient {
    /// A client of the server at `base`.
    pub fn new(base: &str, token: Option<String>) -> Self {
        Self {
            http: reqwest::Client::new(),
            base: base.trim_end_matches('/').to_string(),
            token,
        }
    }

    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let r = self.http.request(method, format!("{}{path}", self.base));
        match &self.token {
            Some(t) => r.bearer_auth(t),
            None => r,
        }
    }

    /// Whether the server answers as the session server holding our token
    /// does. Any answer is not enough: a server killed without cleanup
    /// leaves its address behind, and another program may have its port.
    pub async fn reachable(&self) -> bool {
        let probe = self
            .request(reqwest::Method::GET, "/v1/sessions?limit=1")
            .timeout(std::time::Duration::from_secs(3))
            .send()
            .await;
        match probe {
            Ok(r) if r.status().is_success() => r.json::<Vec<LogInfo>>().await.is_ok(),
            _ => false,
        }
    }

    /// Create a session running `config`.
    pub async fn create(&self, config: &SessionConfig) -> Result<LogInfo> {
        let mut body = json!({
            "agent": config.agent,
            "sandbox": config.sandbox.provider,
        });
        if let Some(image) = &config.sandbox.image {
            body["image"] = json!(image);
        }
        if let Some(model) = &config.model {
            body["model"] = json!(model);
        }
        if config.approvals {
            body["approvals"] = json!(true);
        }
        let r = self
            .request(reqwest::Method::POST, "/v1/sessions")
            .json(&body)
            .send()
            .await
            .context("creating the session on the server")?;
        Ok(serde_json::from_value(
            check(r, "creating the session").await?,
        )?)
    }

    /// A session's info.
    pub async fn info(&self, session: &str) -> Result<LogInfo> {
        let r = self
            .request(reqwest::Method::GET, &format!("/v1/sessions/{session}"))
            .send()
            .await?;
        Ok(serde_json::from_value(
            check(r, &format!("reading session {session}")).await?,
        )?)
    }

    /// Post a client message; the ack (`{"seq", "duplicate", "turnId"?}`).
    pub async fn post(&self, session: &str, message: &ClientMessage) -> Result<Value> {
        let r = self
            .request(
                reqwest::Method::POST,
                &format!("/v1/sessions/{session}/messages"),
            )
            .json(message)
            .send()
            .await?;
        check(r, "sending to the session").await
    }

    /// The session's events after `after`, as the actor's messages.
    pub async fn events(&self, session: &str, after: u64) -> Result<Events> {
        let r = self
            .request(
                reqwest::Method::GET,
                &format!("/v1/sessions/{session}/events?after={after}"),
            )
            .send()
            .await?;
        if !r.status().is_success() {
            check(r, "opening the session's events").await?;
            bail!("unreachable");
        }
        Ok(Events {
            events: Box::pin(read_events(r.bytes_stream(), SseReader::new())),
        })
    }
}

type SessionEvents = std::pin::Pin<
    Box<dyn futures::Stream<Item = Result<SseEvent, ReadError<reqwest::Error>>> + Send>,
>;

/// A session's SSE stream (`event: frame|live|error`), read with core's
/// one SSE reader.
pub struct Events {
    events: SessionEvents,
}

impl std::fmt::Debug for Events {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Events").finish_non_exhaustive()
    }
}

impl Events {
    /// The next message; `None` when the stream ended.
    pub async fn next(&mut self) -> Option<Result<ServerMessage>> {
        loop {
            match self.events.next().await? {
                Ok(event) => {
                    if let Some(message) = server_message(&event) {
                        return Some(Ok(message));
                    }
                }
                Err(e) => return Some(Err(anyhow::Error::new(e))),
            }
        }
    }
}

/// A session event as the actor's message: stored frames and live parts;
/// `None` for the rest (an `error` event is followed by the stream's end).
fn server_message(event: &SseEvent) -> Option<ServerMessage> {
    match event.event.as_str() {
        "frame" => serde_json::from_str::<Frame>(&event.data)
            .ok()
            .map(|frame| ServerMessage::Frame { frame }),
        "live" => {
            let v: Value = serde_json::from_str(&event.data).ok()?;
            let part: StreamPart = serde_json::from_value(v["part"].clone()).ok()?;
            Some(ServerMessage::Live {
                turn_id: v["turnId"].as_str()?.to_string(),
                part,
            })
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::routing::get;
    use axum::Router;

    async fn server(app: Router) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await });
        url
    }

    async fn reachable(url: &str, token: &str) -> bool {
        RemoteClient::new(url, Some(token.into())).reachable().await
    }

    /// A port another program took after a killed server is not that
    /// server, whatever it answers.
    #[tokio::test]
    async fn only_a_session_server_that_takes_the_token_is_reachable() {
        let list = |token: &'static str| {
            move |headers: axum::http::HeaderMap| async move {
                let bearer = format!("Bearer {token}");
                if headers.get("authorization").is_some_and(|v| *v == *bearer) {
                    (axum::http::StatusCode::OK, "[]")
                } else {
                    (axum::http::StatusCode::UNAUTHORIZED, "{}")
                }
            }
        };
        let ours = server(Router::new().route("/v1/sessions", get(list("ours")))).await;
        let foreign_404 = server(Router::new()).await;
        let foreign_200 =
            server(Router::new().route("/v1/sessions", get(|| async { "<html></html>" }))).await;
        assert!(reachable(&ours, "ours").await);
        assert!(!reachable(&ours, "theirs").await);
        assert!(!reachable(&foreign_404, "ours").await);
        assert!(!reachable(&foreign_200, "ours").await);
        let closed = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            format!("http://{}", l.local_addr().unwrap())
        };
        assert!(!reachable(&closed, "ours").await);
    }

    /// Serve `/v1/sessions/s1/events` as `chunks`, one body chunk each.
    async fn events_server(chunks: Vec<bytes::Bytes>) -> String {
        let events = move || {
            let chunks = chunks.clone();
            async move {
                let chunks = chunks.into_iter().map(Ok::<_, std::io::Error>);
                axum::body::Body::from_stream(futures::stream::iter(chunks))
            }
        };
        server(Router::new().route("/v1/sessions/s1/events", get(events))).await
    }

    /// Frames and live parts come out as the actor's messages however the
    /// body is cut, past keep-alives, CRLF line ends and `error` events.
    #[tokio::test]
    async fn events_are_read_as_the_actors_messages() {
        use harness::core::frame::FrameBody;
        let frame = Frame {
            seq: 3,
            at_ms: 9,
            body: FrameBody::Sealed {},
        };
        let part = StreamPart::TextDelta {
            id: "b1".into(),
            delta: "two\nlines".into(),
        };
        let wire = format!(
            ":\n\nid: 3\r\nevent: frame\r\ndata: {}\r\n\r\n\
             event: error\ndata: {{\"code\":\"internal\"}}\n\n\
             event: live\ndata: {}\n\n",
            serde_json::to_string(&frame).unwrap(),
            json!({"turnId": "t1", "part": part}),
        );
        let chunks = wire
            .as_bytes()
            .chunks(7)
            .map(bytes::Bytes::copy_from_slice)
            .collect();
        let url = events_server(chunks).await;
        let mut events = RemoteClient::new(&url, None).events("s1", 0).await.unwrap();
        assert_eq!(
            events.next().await.unwrap().unwrap(),
            ServerMessage::Frame { frame }
        );
        assert_eq!(
            events.next().await.unwrap().unwrap(),
            ServerMessage::Live {
                turn_id: "t1".into(),
                part
            }
        );
        assert!(events.next().await.is_none());
    }

    /// A server that never ends its line costs the CLI a bounded buffer
    /// and an error, not its memory.
    #[tokio::test]
    async fn an_endless_event_is_an_error() {
        let mib = bytes::Bytes::from(vec![b'a'; 1024 * 1024]);
        let chunks = std::iter::once(bytes::Bytes::from_static(b"data: "))
            .chain(std::iter::repeat_n(mib, 17))
            .collect();
        let url = events_server(chunks).await;
        let mut events = RemoteClient::new(&url, None).events("s1", 0).await.unwrap();
        let error = events.next().await.unwrap().unwrap_err();
        assert!(error.to_string().contains("longer than"), "{error}");
        assert!(events.next().await.is_none());
    }
}
