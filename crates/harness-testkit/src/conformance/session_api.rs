//! The session HTTP API, as a client sees it: one suite run against every
//! server of it — `session-server` (what `harness serve` runs) and the
//! Cloudflare Worker under `wrangler dev` (`crates/harness-worker`) — by
//! base URL and tokens, so both answer the same paths with the same JSON,
//! status codes and bearer roles.
//!
//! The server under test is configured with [`token_table`] (a JSON array
//! of `session_api::TokenGrant`s) and the default 1 MiB frame limit, and
//! runs no engine (a prompt is stored and its turn stays open), so every
//! frame in these cases is one the suite wrote. Each case makes its own
//! sessions, named with [`Target::tag`] so reruns against kept state do not
//! meet.

use std::time::Duration;

use futures::StreamExt;
use harness_core::sse::{read_events, ReadError, SseReader};
use serde_json::{json, Value};

/// A token with a `host` grant on every session.
pub const HOST: &str = "suite-host";
/// A token with a `client` grant on every session.
pub const CLIENT: &str = "suite-client";
/// A token with a `runner` grant on every session.
pub const RUNNER: &str = "suite-runner";
/// A token with a `client` grant on session [`OTHER_SESSION`] only.
pub const OTHER_CLIENT: &str = "suite-other-client";
/// The one session [`OTHER_CLIENT`] may use.
pub const OTHER_SESSION: &str = "suite-other-session";
/// A token in no grant.
pub const UNKNOWN: &str = "suite-unknown";

/// The token table the server under test must hold (`HARNESS_TOKENS` of
/// the Worker; `ServerConfig::tokens` of session-server, deserialized).
pub fn token_table() -> Value {
    json!([
        {"token": HOST, "scope": "all", "role": "host"},
        {"token": CLIENT, "scope": "all", "role": "client"},
        {"token": RUNNER, "scope": "all", "role": "runner"},
        {"token": OTHER_CLIENT, "scope": {"session": OTHER_SESSION}, "role": "client"},
    ])
}

/// The server under test.
#[derive(Debug, Clone)]
pub struct Target {
    /// `http://127.0.0.1:PORT`, no trailing slash.
    pub base: String,
    /// Prefix of the session ids the suite makes.
    pub tag: String,
    /// The server's frame limit (encoded frame body bytes).
    pub max_frame_bytes: usize,
    client: reqwest::Client,
}

/// One server-sent event, as core's one SSE reader reads it.
pub use harness_core::sse::SseEvent as Event;

/// How long any one read of the suite may take.
const WAIT: Duration = Duration::from_secs(30);

impl Target {
    /// A target at `base` with the default 1 MiB frame limit; sessions are
    /// named `<tag>-<case>`.
    pub fn new(base: impl Into<String>, tag: impl Into<String>) -> Self {
        Self {
            base: base.into().trim_end_matches('/').to_string(),
            tag: tag.into(),
            max_frame_bytes: harness_core::log::DEFAULT_MAX_FRAME_BYTES,
            client: reqwest::Client::new(),
        }
    }

    fn id(&self, case: &str) -> String {
        format!("{}-{case}", self.tag)
    }

    /// A request with `token` (if any) as bearer.
    pub fn request(
        &self,
        method: reqwest::Method,
        path: &str,
        token: Option<&str>,
    ) -> reqwest::RequestBuilder {
        let r = self.client.request(method, format!("{}{path}", self.base));
        match token {
            Some(t) => r.bearer_auth(t),
            None => r,
        }
    }

    /// Send and read `(status, JSON body or Null)`.
    pub async fn call(&self, r: reqwest::RequestBuilder) -> (u16, Value) {
        let response = tokio::time::timeout(WAIT, r.send())
            .await
            .expect("the server answers in time")
            .expect("the server is reachable");
        let status = response.status().as_u16();
        let bytes = response.bytes().await.expect("a whole body");
        (
            status,
            serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        )
    }

    /// `POST path` with a JSON body: `(status, JSON body or Null)`.
    pub async fn post(&self, path: &str, token: Option<&str>, body: Value) -> (u16, Value) {
        self.call(
            self.request(reqwest::Method::POST, path, token)
                .header("content-type", "application/json")
                .body(body.to_string()),
        )
        .await
    }

    async fn post_raw(&self, path: &str, token: Option<&str>, body: Vec<u8>) -> (u16, Value) {
        self.call(
            self.request(reqwest::Method::POST, path, token)
                .header("content-type", "application/json")
                .body(body),
        )
        .await
    }

    /// `GET path`: `(status, JSON body or Null)`.
    pub async fn get(&self, path: &str, token: Option<&str>) -> (u16, Value) {
        self.call(self.request(reqwest::Method::GET, path, token))
            .await
    }

    /// `DELETE /v1/sessions/{id}`: `(status, JSON body or Null)`.
    pub async fn delete(&self, id: &str, token: &str) -> (u16, Value) {
        self.call(self.request(
            reqwest::Method::DELETE,
            &format!("/v1/sessions/{id}"),
            Some(token),
        ))
        .await
    }

    /// Create session `id` as host (asserting 201); its info.
    pub async fn create(&self, id: &str) -> Value {
        let (status, info) = self
            .post("/v1/sessions", Some(HOST), json!({"id": id}))
            .await;
        assert_eq!(status, 201, "create {id}: {info}");
        info
    }

    /// Post one client message with `token`.
    pub async fn message(&self, id: &str, token: &str, message: Value) -> (u16, Value) {
        self.post(&format!("/v1/sessions/{id}/messages"), Some(token), message)
            .await
    }

    async fn answer(&self, id: &str, n: usize) -> Value {
        let (status, ack) = self
            .message(
                id,
                CLIENT,
                json!({"type": "approval-response", "approvalId": format!("a{n}"), "approved": true}),
            )
            .await;
        assert_eq!(status, 200, "answer {n}: {ack}");
        ack
    }

    /// A new session (`name` under this target's prefix) whose turn t1 a
    /// client prompted, with `answers` approval responses after it: frames
    /// `1..=1 + answers`.
    pub async fn session_with_answers(&self, name: &str, answers: usize) -> String {
        let id = self.id(name);
        self.create(&id).await;
        let (status, ack) = self
            .message(&id, CLIENT, json!({"type": "prompt", "text": "p"}))
            .await;
        assert_eq!(status, 200, "the prompt of {id}: {ack}");
        for n in 0..answers {
            self.answer(&id, n).await;
        }
        id
    }

    /// A session's info, read as host (asserting 200).
    pub async fn info(&self, id: &str) -> Value {
        let (status, info) = self.get(&format!("/v1/sessions/{id}"), Some(HOST)).await;
        assert_eq!(status, 200, "info {id}: {info}");
        info
    }

    async fn last_seq(&self, id: &str) -> u64 {
        self.info(id).await["last_seq"].as_u64().expect("last_seq")
    }

    /// Open `/events` (with `query` and `Last-Event-ID`) and read it to its
    /// end (the server ends it after the `sealed` frame).
    pub async fn events_to_end(
        &self,
        id: &str,
        query: &str,
        last_event_id: Option<&str>,
    ) -> Vec<Event> {
        let response = self.open_events(id, query, last_event_id).await;
        EventReader::new(response).into_events().await
    }

    async fn open_events(
        &self,
        id: &str,
        query: &str,
        last_event_id: Option<&str>,
    ) -> reqwest::Response {
        let mut r = self.request(
            reqwest::Method::GET,
            &format!("/v1/sessions/{id}/events{query}"),
            Some(CLIENT),
        );
        if let Some(last) = last_event_id {
            r = r.header("last-event-id", last);
        }
        let response = tokio::time::timeout(WAIT, r.send())
            .await
            .expect("the stream opens in time")
            .expect("the server is reachable");
        assert_eq!(response.status().as_u16(), 200, "GET /events{query}");
        let ct = response
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string();
        assert!(ct.starts_with("text/event-stream"), "content-type {ct:?}");
        response
    }
}

type Body = std::pin::Pin<Box<dyn futures::Stream<Item = reqwest::Result<bytes::Bytes>> + Send>>;

/// A reader of one event stream: core's SSE reader over the body.
struct EventReader {
    events: std::pin::Pin<
        Box<dyn futures::Stream<Item = Result<Event, ReadError<reqwest::Error>>> + Send>,
    >,
}

impl EventReader {
    fn new(response: reqwest::Response) -> Self {
        Self::of_body(Box::pin(response.bytes_stream()))
    }

    /// The rest of a body already partly read.
    fn of_body(body: Body) -> Self {
        Self {
            events: Box::pin(read_events(body, SseReader::new())),
        }
    }

    /// The next event, `None` when the stream ended (within [`WAIT`]).
    async fn next(&mut self) -> Option<Event> {
        tokio::time::timeout(WAIT, self.events.next())
            .await
            .expect("the next event (or the end) in time")
            .map(|event| event.expect("a readable event stream"))
    }

    /// Every event to the stream's end.
    async fn into_events(mut self) -> Vec<Event> {
        let mut events = Vec::new();
        while let Some(event) = self.next().await {
            events.push(event);
        }
        events
    }
}

fn frame_seqs(events: &[Event]) -> Vec<u64> {
    events
        .iter()
        .filter(|e| e.event == "frame")
        .map(|e| {
            let frame: Value = serde_json::from_str(&e.data).expect("frame JSON");
            let seq = frame["seq"].as_u64().expect("seq");
            assert_eq!(
                e.id.as_deref(),
                Some(seq.to_string().as_str()),
                "id is the seq"
            );
            seq
        })
        .collect()
}

fn assert_error(got: &(u16, Value), status: u16, code: &str) {
    assert_eq!(got.0, status, "status of {}", got.1);
    assert_eq!(got.1["error"]["code"], code, "code of {}", got.1);
    assert!(
        got.1["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "a message in {}",
        got.1
    );
}

/// Every case, in order.
pub async fn run_all(t: &Target) {
    create_append_read_back(t).await;
    replay_from_a_cursor_and_last_event_id(t).await;
    fanout_to_many_sse_clients(t).await;
    ui_stream_of_a_session_to_its_seal(t).await;
    refused_tokens_write_nothing(t).await;
    oversized_and_malformed_input_is_refused_with_nothing_written(t).await;
    fork_copies_a_prefix_and_seals(t).await;
    runners_are_fenced_by_generation_over_websocket(t).await;
    durable_streams_follow_a_session(t).await;
    sessions_are_listed_for_a_host(t).await;
    an_idle_event_stream_is_kept_alive(t).await;
    the_audit_chain_is_walked_on_request(t).await;
    a_session_exports_as_markdown(t).await;
    a_trimmed_log_is_read_from_its_cut(t).await;
}

/// Retention's cut (`POST /trim`, `docs/retention.md`) is one rule on
/// every reading path: from the start, each — frames, SSE, the WebSocket
/// replay — begins at the first kept frame; resuming from inside the cut
/// is 410 Gone (before the upgrade, for the WebSocket; for the UI stream
/// too).
pub async fn a_trimmed_log_is_read_from_its_cut(t: &Target) {
    let id = t.session_with_answers("trim", 4).await;
    assert_eq!(t.last_seq(&id).await, 5);
    let trim = format!("/v1/sessions/{id}/trim");
    let (status, info) = t.post(&trim, Some(HOST), json!({"through": 3})).await;
    assert_eq!(status, 200, "{info}");
    assert_eq!(info["trimmed"]["through"], 3, "{info}");

    let (status, frames) = t
        .get(&format!("/v1/sessions/{id}/frames?after=0"), Some(HOST))
        .await;
    assert_eq!(status, 410, "frames from 0 of a trimmed log: {frames}");
    let (status, frames) = t
        .get(&format!("/v1/sessions/{id}/frames?after=3"), Some(HOST))
        .await;
    assert_eq!(status, 200, "{frames}");
    let seqs: Vec<u64> = frames
        .as_array()
        .expect("frames")
        .iter()
        .filter_map(|f| f["seq"].as_u64())
        .collect();
    assert_eq!(seqs, [4, 5]);

    let mut events = EventReader::new(t.open_events(&id, "", None).await);
    let mut seqs = Vec::new();
    while seqs.last() != Some(&5) {
        let event = events.next().await.expect("the stream stays open");
        seqs.extend(frame_seqs(std::slice::from_ref(&event)));
    }
    assert_eq!(seqs, [4, 5], "SSE from the start begins at the cut");
    drop(events);
    let inside = t
        .request(
            reqwest::Method::GET,
            &format!("/v1/sessions/{id}/events"),
            Some(CLIENT),
        )
        .header("last-event-id", "2");
    assert_eq!(t.call(inside).await.0, 410, "SSE resuming inside the cut");

    let mut socket = t
        .socket(&id, "role=client&after=0", CLIENT)
        .await
        .expect("a client socket from 0");
    let mut seqs = Vec::new();
    while seqs.last() != Some(&5) {
        let message = next_json(&mut socket)
            .await
            .unwrap_or_else(|| panic!("the socket closed after {seqs:?}"));
        if message["type"] == "frame" {
            seqs.push(message["frame"]["seq"].as_u64().expect("seq"));
        }
    }
    assert_eq!(
        seqs,
        [4, 5],
        "the WebSocket replay from 0 begins at the cut"
    );
    drop(socket);
    assert_eq!(
        t.socket(&id, "role=client&after=2", CLIENT).await.err(),
        Some(410),
        "a WebSocket resuming inside the cut"
    );
    let (status, body) = t
        .get(
            &format!("/v1/sessions/{id}/ui-stream?after=2"),
            Some(CLIENT),
        )
        .await;
    assert_eq!(status, 410, "the UI stream from inside the cut: {body}");
}

/// `GET /export?format=markdown`: the conversation as a document
/// (`text/markdown`) with the prompt under the user's heading (the
/// answers' rendering is `session_api::markdown`'s unit test and the CLI's
/// test on real turns); an unknown format is a 400 that says
/// which ones there are.
pub async fn a_session_exports_as_markdown(t: &Target) {
    let id = t.id("md");
    t.create(&id).await;
    let (status, _) = t
        .message(
            &id,
            CLIENT,
            json!({"type": "prompt", "text": "write the report"}),
        )
        .await;
    assert_eq!(status, 200);
    t.answer(&id, 1).await;
    let response = t
        .request(
            reqwest::Method::GET,
            &format!("/v1/sessions/{id}/export?format=markdown"),
            Some(CLIENT),
        )
        .send()
        .await
        .expect("export");
    assert_eq!(response.status(), 200);
    let content_type = response
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    assert!(content_type.starts_with("text/markdown"), "{content_type}");
    let document = response.text().await.expect("a body");
    assert!(
        document.starts_with(&format!("# Session {id}\n")),
        "{document}"
    );
    assert!(
        document.contains("## User (t1)\n\nwrite the report"),
        "{document}"
    );
    let got = t
        .get(
            &format!("/v1/sessions/{id}/export?format=pdf"),
            Some(CLIENT),
        )
        .await;
    assert_error(&got, 400, "invalid");
    assert!(
        got.1["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("markdown")),
        "{}",
        got.1
    );
}

/// `GET /v1/sessions/{id}/verify`: the session's audit chain walked with
/// the server's key — intact over every frame, with its head; readers may
/// ask; an unknown session is 404, a request without a token 401.
pub async fn the_audit_chain_is_walked_on_request(t: &Target) {
    let id = t.id("audit");
    t.create(&id).await;
    let (status, _) = t
        .message(&id, CLIENT, json!({"type": "prompt", "text": "go"}))
        .await;
    assert_eq!(status, 200);
    t.answer(&id, 1).await;
    t.answer(&id, 2).await;
    let last = t.info(&id).await["last_seq"].clone();
    let (status, v) = t
        .get(&format!("/v1/sessions/{id}/verify"), Some(CLIENT))
        .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        (
            v["session"].as_str(),
            v["intact"].clone(),
            v["frames"].clone()
        ),
        (Some(id.as_str()), json!(true), last),
        "{v}"
    );
    assert_eq!(
        v["head"].as_str().map(str::len),
        Some(64),
        "an intact chain names its head: {v}"
    );
    assert!(v.get("broken").is_none(), "{v}");
    let nobody = t.id("audit-nobody");
    assert_error(
        &t.get(&format!("/v1/sessions/{nobody}/verify"), Some(CLIENT))
            .await,
        404,
        "not_found",
    );
    assert_eq!(
        t.get(&format!("/v1/sessions/{id}/verify"), None).await.0,
        401
    );
}

/// Create, prompt, answer; read back by `/frames`, `/export` and info.
pub async fn create_append_read_back(t: &Target) {
    let id = t.id("rw");
    let info = t.create(&id).await;
    assert_eq!(info["session"], id.as_str());
    assert_eq!(info["last_seq"], 0);
    assert_eq!(info["sealed"], false);
    // The same configuration again is fine; another one is a conflict.
    assert_eq!(
        t.post("/v1/sessions", Some(HOST), json!({"id": id}))
            .await
            .0,
        201
    );
    assert_error(
        &t.post(
            "/v1/sessions",
            Some(HOST),
            json!({"id": id, "agent": "codex"}),
        )
        .await,
        409,
        "conflict",
    );

    let prompt = json!({"type": "prompt", "text": "hello", "key": "k1"});
    let (status, ack) = t.message(&id, CLIENT, prompt.clone()).await;
    assert_eq!(status, 200, "{ack}");
    assert_eq!(
        ack,
        json!({"type": "ack", "seq": 1, "duplicate": false, "turnId": "t1"})
    );
    // A retry with the same key stores nothing.
    let (status, ack) = t.message(&id, CLIENT, prompt).await;
    assert_eq!(
        (status, ack["seq"].clone(), ack["duplicate"].clone()),
        (200, json!(1), json!(true))
    );
    // One turn at a time.
    assert_error(
        &t.message(&id, CLIENT, json!({"type": "prompt", "text": "again"}))
            .await,
        409,
        "turn_in_progress",
    );
    let ack = t.answer(&id, 1).await;
    assert_eq!(ack, json!({"type": "ack", "seq": 2, "duplicate": false}));

    let (status, frames) = t
        .get(&format!("/v1/sessions/{id}/frames?after=0"), Some(CLIENT))
        .await;
    assert_eq!(status, 200);
    let frames = frames.as_array().expect("an array").clone();
    assert_eq!(frames.len(), 2);
    assert_eq!(frames[0]["seq"], 1);
    assert_eq!(frames[0]["body"]["type"], "user-message");
    assert_eq!(frames[0]["body"]["text"], "hello");
    assert_eq!(frames[0]["body"]["turnId"], "t1");
    assert!(
        frames[0]["at_ms"].as_u64().is_some_and(|ms| ms > 0),
        "stamped: {}",
        frames[0]
    );
    assert_eq!(frames[1]["seq"], 2);
    assert_eq!(frames[1]["body"]["type"], "approval-response");
    assert_eq!(frames[1]["body"]["approvalId"], "a1");

    let (_, page) = t
        .get(
            &format!("/v1/sessions/{id}/frames?after=1&limit=1"),
            Some(RUNNER),
        )
        .await;
    assert_eq!(page.as_array().map(Vec::len), Some(1));
    assert_eq!(page[0]["seq"], 2);
    let (status, all) = t
        .get(&format!("/v1/sessions/{id}/export"), Some(CLIENT))
        .await;
    assert_eq!((status, all.as_array().map(Vec::len)), (200, Some(2)));
    assert_eq!(all, Value::Array(frames));
    let (_, one) = t
        .get(&format!("/v1/sessions/{id}/export?until=1"), Some(CLIENT))
        .await;
    assert_eq!(one.as_array().map(Vec::len), Some(1));
    assert_error(
        &t.get(&format!("/v1/sessions/{id}/export?until=9"), Some(CLIENT))
            .await,
        400,
        "invalid",
    );

    let info = t.info(&id).await;
    assert_eq!(info["last_seq"], 2);
    assert_eq!(info["meta"]["config"]["agent"], "claude-code");
}

/// `/events` from the start, from `?after`, and from `Last-Event-ID`
/// (which wins over `?after`); a sealed stream ends.
pub async fn replay_from_a_cursor_and_last_event_id(t: &Target) {
    let id = t.session_with_answers("replay", 4).await;
    let (status, info) = t
        .post(&format!("/v1/sessions/{id}/seal"), Some(HOST), json!({}))
        .await;
    assert_eq!(status, 200, "{info}");
    assert_eq!(
        (info["sealed"].clone(), info["last_seq"].clone()),
        (json!(true), json!(6))
    );

    let all = t.events_to_end(&id, "", None).await;
    assert_eq!(frame_seqs(&all), vec![1, 2, 3, 4, 5, 6]);
    let last: Value = serde_json::from_str(&all[5].data).unwrap();
    assert_eq!(last["body"]["type"], "sealed");
    assert_eq!(
        frame_seqs(&t.events_to_end(&id, "?after=3", None).await),
        vec![4, 5, 6]
    );
    assert_eq!(
        frame_seqs(&t.events_to_end(&id, "?after=1", Some("4")).await),
        vec![5, 6]
    );
    assert!(t.events_to_end(&id, "", Some("6")).await.is_empty());
    let (status, body) = t
        .call(
            t.request(
                reqwest::Method::GET,
                &format!("/v1/sessions/{id}/events"),
                Some(CLIENT),
            )
            .header("last-event-id", "x"),
        )
        .await;
    assert_error(&(status, body), 400, "invalid");
    // Sealed: nothing more is stored.
    assert_error(
        &t.message(
            &id,
            CLIENT,
            json!({"type": "approval-response", "approvalId": "z", "approved": true}),
        )
        .await,
        409,
        "sealed",
    );
}

/// Several SSE readers, attached before and while frames are written, each
/// see the same gap-free sequence.
pub async fn fanout_to_many_sse_clients(t: &Target) {
    const READERS: usize = 6;
    const ANSWERS: usize = 20;
    let id = t.session_with_answers("fanout", 0).await;
    let mut readers = Vec::new();
    for _ in 0..READERS / 2 {
        // Each has seen frame 1 before the writes start: attached.
        let mut reader = EventReader::new(t.open_events(&id, "", None).await);
        let first = reader.next().await.expect("frame 1");
        assert_eq!(first.id.as_deref(), Some("1"));
        readers.push(tokio::spawn(async move {
            let mut events = vec![first];
            events.extend(reader.into_events().await);
            events
        }));
    }
    for n in 0..ANSWERS {
        t.answer(&id, n).await;
        if n == ANSWERS / 2 {
            // Late joiners, from a cursor in the middle.
            for _ in 0..READERS / 2 {
                let reader = EventReader::new(t.open_events(&id, "?after=1", None).await);
                readers.push(tokio::spawn(reader.into_events()));
            }
        }
    }
    let (status, _) = t
        .post(&format!("/v1/sessions/{id}/seal"), Some(HOST), json!({}))
        .await;
    assert_eq!(status, 200);
    let last = 1 + ANSWERS as u64 + 1;
    for (i, reader) in readers.into_iter().enumerate() {
        let events = reader.await.expect("reader task");
        let from = if i < READERS / 2 { 1 } else { 2 };
        let want: Vec<u64> = (from..=last).collect();
        assert_eq!(frame_seqs(&events), want, "reader {i}");
    }
}

/// `/ui-stream` (the AI SDK UI message stream) from a cursor: its header,
/// `start` first, `finish` when the session is sealed, then `[DONE]` and
/// the end of the stream.
pub async fn ui_stream_of_a_session_to_its_seal(t: &Target) {
    let id = t.session_with_answers("ui", 0).await;
    let (status, _) = t
        .post(&format!("/v1/sessions/{id}/seal"), Some(HOST), json!({}))
        .await;
    assert_eq!(status, 200);
    let response = tokio::time::timeout(
        WAIT,
        t.request(
            reqwest::Method::GET,
            &format!("/v1/sessions/{id}/ui-stream?after=0"),
            Some(CLIENT),
        )
        .send(),
    )
    .await
    .expect("the stream opens in time")
    .expect("the server is reachable");
    assert_eq!(response.status().as_u16(), 200);
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string()
    };
    assert_eq!(header("x-vercel-ai-ui-message-stream"), "v1");
    assert!(header("content-type").starts_with("text/event-stream"));
    let data: Vec<String> = EventReader::new(response)
        .into_events()
        .await
        .into_iter()
        .map(|e| e.data)
        .collect();
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{data:?}");
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).expect("a JSON chunk"))
        .collect();
    assert_eq!(
        chunks.first().map(|c| c["type"].clone()),
        Some(json!("start")),
        "{data:?}"
    );
    assert_eq!(
        chunks.last().map(|c| c["type"].clone()),
        Some(json!("finish")),
        "{data:?}"
    );
    assert_error(
        &t.get(&format!("/v1/sessions/{id}/ui-stream"), Some(OTHER_CLIENT))
            .await,
        403,
        "forbidden",
    );
}

/// 401 without a token or with an unknown one, 403 for a grant of another
/// role or session; nothing is created or written by any of them.
pub async fn refused_tokens_write_nothing(t: &Target) {
    let id = t.id("auth");
    let never = t.id("auth-never");
    // Create: no token, unknown token, a client's token.
    assert_error(
        &t.post("/v1/sessions", None, json!({"id": never})).await,
        401,
        "unauthorized",
    );
    assert_error(
        &t.post("/v1/sessions", Some(UNKNOWN), json!({"id": never}))
            .await,
        401,
        "unauthorized",
    );
    assert_error(
        &t.post("/v1/sessions", Some(CLIENT), json!({"id": never}))
            .await,
        403,
        "forbidden",
    );
    assert_error(
        &t.post("/v1/sessions", Some(OTHER_CLIENT), json!({"id": never}))
            .await,
        403,
        "forbidden",
    );
    assert_error(
        &t.get(&format!("/v1/sessions/{never}"), Some(HOST)).await,
        404,
        "not_found",
    );

    t.create(&id).await;
    let prompt = json!({"type": "prompt", "text": "p"});
    let messages = format!("/v1/sessions/{id}/messages");
    assert_error(
        &t.post(&messages, None, prompt.clone()).await,
        401,
        "unauthorized",
    );
    assert_error(
        &t.post(&messages, Some(UNKNOWN), prompt.clone()).await,
        401,
        "unauthorized",
    );
    assert_error(
        &t.post(&messages, Some(RUNNER), prompt.clone()).await,
        403,
        "forbidden",
    );
    assert_error(
        &t.post(&messages, Some(OTHER_CLIENT), prompt.clone()).await,
        403,
        "forbidden",
    );
    // Sealing is the host's, by either endpoint.
    assert_error(
        &t.post(&messages, Some(CLIENT), json!({"type": "seal"}))
            .await,
        403,
        "forbidden",
    );
    assert_error(
        &t.post(&format!("/v1/sessions/{id}/seal"), Some(CLIENT), json!({}))
            .await,
        403,
        "forbidden",
    );
    // Reads.
    for path in ["", "/frames", "/export", "/events"] {
        let path = format!("/v1/sessions/{id}{path}");
        assert_error(&t.get(&path, None).await, 401, "unauthorized");
        assert_error(&t.get(&path, Some(OTHER_CLIENT)).await, 403, "forbidden");
    }
    // The access_token parameter names a token too (EventSource cannot set headers).
    let (status, _) = t
        .get(
            &format!("/v1/sessions/{id}/frames?access_token={CLIENT}"),
            None,
        )
        .await;
    assert_eq!(status, 200);
    let info = t.info(&id).await;
    assert_eq!(
        (info["last_seq"].clone(), info["sealed"].clone()),
        (json!(0), json!(false))
    );
}

/// Bodies over the limit (413), frames over it (413), malformed JSON and
/// unknown messages (400), bad ids and cursors (400), unknown sessions
/// (404): each refused with its error, and nothing stored.
pub async fn oversized_and_malformed_input_is_refused_with_nothing_written(t: &Target) {
    let id = t.id("bad");
    t.create(&id).await;
    let messages = format!("/v1/sessions/{id}/messages");
    // A body past the frame limit plus the envelope's room.
    let huge = vec![b' '; t.max_frame_bytes + 64 * 1024 + 1];
    assert_error(
        &t.post_raw(&messages, Some(CLIENT), huge).await,
        413,
        "frame_too_large",
    );
    // A body within the room whose frame is over the limit.
    let text = "x".repeat(t.max_frame_bytes);
    assert_error(
        &t.message(&id, CLIENT, json!({"type": "prompt", "text": text}))
            .await,
        413,
        "frame_too_large",
    );
    assert_error(
        &t.post_raw(&messages, Some(CLIENT), b"{not json".to_vec())
            .await,
        400,
        "invalid",
    );
    assert_error(
        &t.message(&id, CLIENT, json!({"type": "dance"})).await,
        400,
        "invalid",
    );
    assert_error(
        &t.message(&id, CLIENT, json!({"type": "prompt"})).await,
        400,
        "invalid",
    );
    assert_error(
        &t.post(
            "/v1/sessions",
            Some(HOST),
            json!({"id": "ok", "colour": "red"}),
        )
        .await,
        400,
        "invalid",
    );
    assert_error(
        &t.post_raw("/v1/sessions", Some(HOST), b"[1,".to_vec())
            .await,
        400,
        "invalid",
    );
    assert_error(
        &t.post("/v1/sessions", Some(HOST), json!({"id": ".hidden"}))
            .await,
        400,
        "invalid",
    );
    assert_error(
        &t.get(&format!("/v1/sessions/{id}/frames?after=x"), Some(CLIENT))
            .await,
        400,
        "invalid",
    );
    assert_error(
        &t.get(&format!("/v1/sessions/{id}/frames?limit=-1"), Some(CLIENT))
            .await,
        400,
        "invalid",
    );
    let unknown = t.id("bad-unknown");
    assert_error(
        &t.message(&unknown, CLIENT, json!({"type": "prompt", "text": "p"}))
            .await,
        404,
        "not_found",
    );
    assert_error(
        &t.get(&format!("/v1/sessions/{unknown}/frames"), Some(CLIENT))
            .await,
        404,
        "not_found",
    );
    // An answer with no turn running is refused too.
    assert_error(
        &t.message(
            &id,
            CLIENT,
            json!({"type": "approval-response", "approvalId": "a", "approved": true}),
        )
        .await,
        409,
        "no_active_turn",
    );
    assert_eq!(t.last_seq(&id).await, 0, "nothing was stored");
    // And the session still takes a good message.
    let (status, ack) = t
        .message(&id, CLIENT, json!({"type": "prompt", "text": "ok"}))
        .await;
    assert_eq!((status, ack["seq"].clone()), (200, json!(1)));
}

/// `POST /fork`: the target gets the source's frames up to `until` as they
/// were (bodies, times, idempotency keys), its origin, and — when the
/// prefix ends inside a running turn — the frame that fails that turn in
/// the fork; `seal=1` seals the fork. Refusals (another role, an existing
/// target, `until` past the end, an unknown source) create nothing.
pub async fn fork_copies_a_prefix_and_seals(t: &Target) {
    let id = t.id("forksrc");
    t.create(&id).await;
    let prompt = json!({"type": "prompt", "text": "fork me", "key": "fk1"});
    assert_eq!(t.message(&id, CLIENT, prompt.clone()).await.0, 200);
    t.answer(&id, 1).await;
    let (_, source_frames) = t
        .get(&format!("/v1/sessions/{id}/frames?after=0"), Some(HOST))
        .await;

    // A prefix inside the running turn t1.
    let target = t.id("forkdst");
    let (status, info) = t
        .post(
            &format!("/v1/sessions/{id}/fork?target={target}&until=1"),
            Some(HOST),
            json!({}),
        )
        .await;
    assert_eq!(status, 201, "{info}");
    assert_eq!(info["session"], target.as_str(), "{info}");
    assert_eq!(info["forked_from"]["session"], id.as_str(), "{info}");
    assert_eq!(info["forked_from"]["until"], 1, "{info}");
    // The prefix and the closing frame; a server that takes turn-end
    // checkpoints then puts the fork at its fork point with a
    // `sandbox-reset` (here: no turn had ended, so none to restore). The
    // Worker's forks are log copies: its sessions take no turn-end
    // checkpoints yet (docs/turn-checkpoints.md, "Not yet").
    let last_seq = info["last_seq"].as_u64().unwrap_or_default();
    assert!(last_seq == 2 || last_seq == 3, "{info}");
    let (_, frames) = t
        .get(&format!("/v1/sessions/{target}/frames?after=0"), Some(HOST))
        .await;
    if last_seq == 3 {
        assert_eq!(frames[2]["body"]["type"], "sandbox-reset", "{frames}");
        assert!(frames[2]["body"].get("checkpoint").is_none(), "{frames}");
    }
    assert_eq!(frames[0], source_frames[0], "copied as it was");
    assert_eq!(frames[1]["body"]["type"], "turn-status", "{frames}");
    assert_eq!(frames[1]["body"]["turnId"], "t1", "{frames}");
    assert_eq!(frames[1]["body"]["status"], "failed", "{frames}");
    assert!(
        frames[1]["body"]["error"]
            .as_str()
            .is_some_and(|e| e.contains("forked from")),
        "{frames}"
    );
    // The key came along: the same prompt is a duplicate in the fork.
    let (status, ack) = t.message(&target, CLIENT, prompt).await;
    assert_eq!(
        (status, ack["seq"].clone(), ack["duplicate"].clone()),
        (200, json!(1), json!(true)),
        "{ack}"
    );
    // The turn is over in the fork: a new prompt starts t2 there.
    let (status, ack) = t
        .message(&target, CLIENT, json!({"type": "prompt", "text": "go on"}))
        .await;
    assert_eq!((status, ack["turnId"].clone()), (200, json!("t2")), "{ack}");
    // The source is untouched.
    assert_eq!(t.info(&id).await["last_seq"], 2);

    // The whole log, sealed.
    let sealed = t.id("forksealed");
    let (status, info) = t
        .post(
            &format!("/v1/sessions/{id}/fork?target={sealed}&seal=1"),
            Some(HOST),
            json!({}),
        )
        .await;
    assert_eq!(status, 201, "{info}");
    assert_eq!(info["sealed"], true, "{info}");
    assert_eq!(info["forked_from"]["until"], 2, "{info}");
    assert_error(
        &t.message(&sealed, CLIENT, json!({"type": "prompt", "text": "no"}))
            .await,
        409,
        "sealed",
    );

    // Refusals create nothing.
    let never = t.id("forknever");
    let fork = |query: String| format!("/v1/sessions/{id}/fork?{query}");
    assert_error(
        &t.post(&fork(format!("target={never}")), Some(CLIENT), json!({}))
            .await,
        403,
        "forbidden",
    );
    assert_error(
        &t.post(
            &fork(format!("target={never}&until=9")),
            Some(HOST),
            json!({}),
        )
        .await,
        400,
        "invalid",
    );
    let unknown = t.id("forknosuch");
    assert_error(
        &t.post(
            &format!("/v1/sessions/{unknown}/fork?target={never}"),
            Some(HOST),
            json!({}),
        )
        .await,
        404,
        "not_found",
    );
    let (status, _) = t.get(&format!("/v1/sessions/{never}"), Some(HOST)).await;
    assert_eq!(status, 404, "a refused fork created its target");
    assert_error(
        &t.post(&fork(format!("target={target}")), Some(HOST), json!({}))
            .await,
        409,
        "conflict",
    );
    // Its frames: the fork's own (`last_seq`) and the one new prompt.
    assert_eq!(
        t.info(&target).await["last_seq"],
        last_seq + 1,
        "an existing target is left as it was"
    );
}

type Socket =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

impl Target {
    /// Open `/ws` with `query` (token as `access_token`); the HTTP status
    /// when the upgrade is refused.
    pub async fn socket(&self, id: &str, query: &str, token: &str) -> Result<Socket, u16> {
        let url = format!(
            "{}/v1/sessions/{id}/ws?{query}&access_token={token}",
            self.base.replacen("http", "ws", 1)
        );
        match tokio::time::timeout(WAIT, tokio_tungstenite::connect_async(url)).await {
            Ok(Ok((socket, _))) => Ok(socket),
            Ok(Err(tokio_tungstenite::tungstenite::Error::Http(response))) => {
                Err(response.status().as_u16())
            }
            Ok(Err(e)) => panic!("the WebSocket failed: {e}"),
            Err(_) => panic!("the WebSocket did not open in time"),
        }
    }
}

/// The next JSON message on `socket`, or `None` once it closed (bounded).
async fn next_json(socket: &mut Socket) -> Option<Value> {
    use futures::StreamExt;
    use tokio_tungstenite::tungstenite::Message;
    loop {
        let message = tokio::time::timeout(WAIT, socket.next())
            .await
            .expect("a message or the close in time");
        match message {
            Some(Ok(Message::Text(text))) => {
                return Some(serde_json::from_str(text.as_str()).expect("JSON"))
            }
            Some(Ok(Message::Close(_))) | None | Some(Err(_)) => return None,
            Some(Ok(_)) => {}
        }
    }
}

async fn send_json(socket: &mut Socket, value: Value) {
    use futures::SinkExt;
    socket
        .send(tokio_tungstenite::tungstenite::Message::Text(
            value.to_string().into(),
        ))
        .await
        .expect("send on the socket");
}

/// The session WebSocket: one runner at a time, fenced by generation (a
/// newer runner closes the older one, an older one is refused), parts
/// acknowledged as stored; a client socket replays from `after` and sees
/// live frames; the wrong role's token is refused before the upgrade.
pub async fn runners_are_fenced_by_generation_over_websocket(t: &Target) {
    let id = t.id("fence");
    t.create(&id).await;
    let (status, ack) = t
        .message(&id, CLIENT, json!({"type": "prompt", "text": "go"}))
        .await;
    assert_eq!((status, ack["turnId"].clone()), (200, json!("t1")), "{ack}");
    let part = |n: u64| {
        json!({"type": "part", "turnId": "t1", "key": format!("p{n}"),
               "part": {"type": "tool-call", "toolCallId": format!("c{n}"), "toolName": "Bash", "input": {}}})
    };

    // The wrong role's token is refused before the upgrade; so is a bad role.
    assert_eq!(
        t.socket(&id, "role=runner&generation=1", CLIENT)
            .await
            .err(),
        Some(403)
    );
    assert_eq!(t.socket(&id, "role=admin", CLIENT).await.err(), Some(400));

    let mut first = t
        .socket(&id, "role=runner&generation=1", RUNNER)
        .await
        .expect("runner 1 connects");
    send_json(&mut first, part(1)).await;
    let ack = next_json(&mut first).await.expect("an ack");
    assert_eq!(
        (ack["type"].clone(), ack["duplicate"].clone()),
        (json!("ack"), json!(false)),
        "{ack}"
    );
    // The same key again is a duplicate, not a second frame.
    send_json(&mut first, part(1)).await;
    let again = next_json(&mut first).await.expect("an ack");
    assert_eq!(
        (again["seq"].clone(), again["duplicate"].clone()),
        (ack["seq"].clone(), json!(true)),
        "{again}"
    );

    // A client following from the start sees the history, then live frames.
    let mut reader = t
        .socket(&id, "role=client&after=0", CLIENT)
        .await
        .expect("a client connects");
    let mut seen = Vec::new();
    while seen.len() < 3 {
        let m = next_json(&mut reader).await.expect("replayed frames");
        if m["type"] == "frame" {
            seen.push(m["frame"]["seq"].as_u64().unwrap());
        }
    }
    assert_eq!(seen, vec![1, 2, 3], "prompt, runner-attached, part");

    // Generation 2 takes over: runner 1 is told and closed.
    let mut second = t
        .socket(&id, "role=runner&generation=2", RUNNER)
        .await
        .expect("runner 2 connects");
    let fenced = next_json(&mut first).await.expect("runner 1 hears why");
    assert_eq!(fenced["code"], "stale_runner", "{fenced}");
    assert!(next_json(&mut first).await.is_none(), "runner 1 is closed");
    send_json(&mut second, part(2)).await;
    let ack2 = next_json(&mut second).await.expect("an ack");
    assert_eq!(ack2["type"], "ack", "{ack2}");
    // An older generation is refused and closed.
    let mut stale = t
        .socket(&id, "role=runner&generation=1", RUNNER)
        .await
        .expect("the upgrade itself is accepted");
    let refused = next_json(&mut stale).await.expect("a refusal");
    assert_eq!(refused["code"], "stale_runner", "{refused}");
    assert!(
        next_json(&mut stale).await.is_none(),
        "the stale runner is closed"
    );

    // The reader saw generation 2 attach and its part, live.
    let mut live = Vec::new();
    while live.len() < 2 {
        let m = next_json(&mut reader).await.expect("live frames");
        if m["type"] == "frame" {
            live.push(m["frame"]["body"]["type"].as_str().unwrap().to_string());
        }
    }
    assert_eq!(live, vec!["runner-attached", "part"]);
    // A client's own messages go through the socket too.
    send_json(&mut reader, json!({"type": "prompt", "text": "another"})).await;
    loop {
        let m = next_json(&mut reader).await.expect("an answer");
        if m["type"] == "error" {
            assert_eq!(m["code"], "turn_in_progress", "{m}");
            break;
        }
    }
    let (_, frames) = t
        .get(&format!("/v1/sessions/{id}/frames?after=0"), Some(HOST))
        .await;
    let kinds: Vec<&str> = frames
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["body"]["type"].as_str().unwrap())
        .collect();
    assert_eq!(
        kinds,
        vec![
            "user-message",
            "runner-attached",
            "part",
            "runner-attached",
            "part"
        ]
    );
}

/// The Durable Streams offset after frame `seq` of a session stream.
fn stream_offset(seq: u64) -> String {
    format!("{:016}_{seq:016}", 0)
}

/// `/v1/stream/sessions/<id>`: the session read as a Durable Stream —
/// `HEAD`, a catch-up read with its etag (304 when unchanged), a long-poll
/// woken by a write, an SSE reader from an offset to the seal (every data
/// event followed by its control event, the close last), writes refused
/// with 405 and wrong tokens with 401/403, nothing written by a refusal.
pub async fn durable_streams_follow_a_session(t: &Target) {
    let id = t.session_with_answers("ds", 1).await;
    let path = format!("/v1/stream/sessions/{id}");
    session_stream_catches_up(t, &path).await;
    session_stream_refusals_write_nothing(t, &id, &path).await;
    session_stream_long_polls(t, &id, &path).await;
    session_stream_over_sse_to_the_seal(t, &id, &path).await;
}

/// `HEAD` and a catch-up read of the session's two frames: the next
/// offset, up to date, an etag that answers 304 while nothing changed.
async fn session_stream_catches_up(t: &Target, path: &str) {
    let head = send(t.request(reqwest::Method::HEAD, path, Some(CLIENT))).await;
    assert_eq!(head.status().as_u16(), 200);
    assert_eq!(header(&head, "stream-next-offset"), Some(stream_offset(2)));
    assert_eq!(header(&head, "stream-closed"), None);

    let read = send(t.request(
        reqwest::Method::GET,
        &format!("{path}?offset=-1"),
        Some(CLIENT),
    ))
    .await;
    assert_eq!(read.status().as_u16(), 200);
    assert_eq!(header(&read, "stream-next-offset"), Some(stream_offset(2)));
    assert_eq!(header(&read, "stream-up-to-date").as_deref(), Some("true"));
    let tag = header(&read, "etag").expect("an etag");
    let frames: Value = read.json().await.expect("a JSON array");
    let seqs: Vec<u64> = frames
        .as_array()
        .expect("an array")
        .iter()
        .map(|f| f["seq"].as_u64().expect("a seq"))
        .collect();
    assert_eq!(seqs, vec![1, 2]);
    let again = send(
        t.request(
            reqwest::Method::GET,
            &format!("{path}?offset=-1"),
            Some(CLIENT),
        )
        .header("if-none-match", &tag),
    )
    .await;
    assert_eq!(again.status().as_u16(), 304);
}

/// A write (405), another client's token (403) and none (401), and the
/// session still holds its two frames.
async fn session_stream_refusals_write_nothing(t: &Target, id: &str, path: &str) {
    let write = send(
        t.request(reqwest::Method::POST, path, Some(HOST))
            .header("content-type", "application/json")
            .body("[1]"),
    )
    .await;
    assert_eq!(write.status().as_u16(), 405);
    let other = send(t.request(
        reqwest::Method::GET,
        &format!("{path}?offset=-1"),
        Some(OTHER_CLIENT),
    ))
    .await;
    assert_eq!(other.status().as_u16(), 403);
    let anonymous = send(t.request(reqwest::Method::GET, &format!("{path}?offset=-1"), None)).await;
    assert_eq!(anonymous.status().as_u16(), 401);
    assert_eq!(t.info(id).await["last_seq"], 2);
}

/// A long-poll at the tail answers with the next frame.
async fn session_stream_long_polls(t: &Target, id: &str, path: &str) {
    let poll = t
        .request(
            reqwest::Method::GET,
            &format!("{path}?offset={}&live=long-poll", stream_offset(2)),
            Some(CLIENT),
        )
        .send();
    let poll = tokio::spawn(poll);
    tokio::time::sleep(Duration::from_millis(300)).await;
    t.answer(id, 1).await;
    let polled = tokio::time::timeout(WAIT, poll)
        .await
        .expect("the long-poll answers in time")
        .expect("poll task")
        .expect("the server is reachable");
    assert_eq!(polled.status().as_u16(), 200);
    assert_eq!(
        header(&polled, "stream-next-offset"),
        Some(stream_offset(3))
    );
    assert!(header(&polled, "stream-cursor").is_some());
    let frames: Value = polled.json().await.expect("a JSON array");
    assert_eq!(frames[0]["seq"], 3, "{frames}");
}

/// SSE from frame 1 to the seal: every data event followed by its control
/// event, the close last; the stream is closed after.
async fn session_stream_over_sse_to_the_seal(t: &Target, id: &str, path: &str) {
    let sse = send(t.request(
        reqwest::Method::GET,
        &format!("{path}?offset={}&live=sse", stream_offset(1)),
        Some(CLIENT),
    ))
    .await;
    assert_eq!(sse.status().as_u16(), 200);
    assert_eq!(
        header(&sse, "content-type").as_deref(),
        Some("text/event-stream")
    );
    let reader = tokio::spawn(EventReader::new(sse).into_events());
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (status, _) = t
        .post(&format!("/v1/sessions/{id}/seal"), Some(HOST), json!({}))
        .await;
    assert_eq!(status, 200);
    let events = reader.await.expect("reader task");
    let mut seqs = Vec::new();
    let mut pending_data = false;
    let mut closed = false;
    for event in &events {
        match event.event.as_str() {
            "data" => {
                assert!(
                    !pending_data,
                    "two data events without a control: {events:?}"
                );
                let items: Value = serde_json::from_str(&event.data).expect("data is JSON");
                seqs.extend(
                    items
                        .as_array()
                        .expect("an array")
                        .iter()
                        .map(|f| f["seq"].as_u64().unwrap()),
                );
                pending_data = true;
            }
            "control" => {
                let control: Value = serde_json::from_str(&event.data).expect("control is JSON");
                if pending_data {
                    let last = *seqs.last().expect("a seq");
                    assert_eq!(
                        control["streamNextOffset"],
                        stream_offset(last),
                        "{events:?}"
                    );
                }
                pending_data = false;
                closed = control["streamClosed"] == true;
            }
            other => panic!("unexpected event {other:?}"),
        }
    }
    assert_eq!(seqs, vec![2, 3, 4], "{events:?}");
    assert!(closed, "the stream ends with its close: {events:?}");
    let head = send(t.request(reqwest::Method::HEAD, path, Some(CLIENT))).await;
    assert_eq!(header(&head, "stream-closed").as_deref(), Some("true"));
}

/// A header of a response, as text.
fn header(r: &reqwest::Response, name: &str) -> Option<String> {
    r.headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}

/// Send a request, within [`WAIT`].
async fn send(r: reqwest::RequestBuilder) -> reqwest::Response {
    tokio::time::timeout(WAIT, r.send())
        .await
        .expect("the server answers in time")
        .expect("the server is reachable")
}

/// `GET /v1/sessions`: a host sees every session with its info, in id
/// order, in pages (`limit`, `after` the last id seen, until an empty
/// page); a bad `limit` or `after` is 400; a client grant gets 403, no
/// token 401.
pub async fn sessions_are_listed_for_a_host(t: &Target) {
    let (a, b) = (t.id("list-a"), t.id("list-b"));
    t.create(&b).await;
    t.create(&a).await;
    let (status, _) = t
        .message(&a, CLIENT, json!({"type": "prompt", "text": "p"}))
        .await;
    assert_eq!(status, 200);
    let (status, list) = t.get("/v1/sessions?limit=1000", Some(HOST)).await;
    assert_eq!(status, 200, "{list}");
    let list = list.as_array().cloned().expect("an array");
    let ids: Vec<&str> = list
        .iter()
        .map(|i| i["session"].as_str().expect("a session id"))
        .collect();
    let mut sorted = ids.clone();
    sorted.sort();
    assert_eq!(ids, sorted, "listed in id order");
    let find = |id: &str| {
        list.iter()
            .find(|i| i["session"] == id)
            .cloned()
            .unwrap_or_else(|| panic!("{id} is not listed: {ids:?}"))
    };
    assert_eq!(find(&a)["last_seq"], 1);
    assert_eq!(find(&b)["last_seq"], 0);

    // Pages: `limit` sessions after `after`, by id, until an empty page.
    let page = |query: String| async move {
        let (status, page) = t.get(&format!("/v1/sessions?{query}"), Some(HOST)).await;
        assert_eq!(status, 200, "{query}: {page}");
        page.as_array()
            .expect("an array")
            .iter()
            .map(|i| i["session"].as_str().expect("a session id").to_string())
            .collect::<Vec<String>>()
    };
    assert_eq!(page(format!("after={a}&limit=1")).await, vec![b.clone()]);
    assert_eq!(page("limit=1".into()).await, vec![ids[0].to_string()]);
    if ids.len() < 1000 {
        let mut walked: Vec<String> = Vec::new();
        for _ in 0..1000 {
            let query = match walked.last() {
                Some(last) => format!("after={last}&limit=3"),
                None => "limit=3".into(),
            };
            let next = page(query).await;
            assert!(next.len() <= 3, "a page of 3 has {}", next.len());
            if next.is_empty() {
                break;
            }
            walked.extend(next);
        }
        // Sessions other tests create meanwhile may join the walk.
        for id in &ids {
            assert!(walked.contains(&id.to_string()), "{id} was not paged");
        }
        let mut sorted = walked.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(walked, sorted, "pages in id order, none twice");
    }
    assert_error(
        &t.get("/v1/sessions?limit=x", Some(HOST)).await,
        400,
        "invalid",
    );
    assert_error(
        &t.get("/v1/sessions?after=..%2Fx", Some(HOST)).await,
        400,
        "invalid",
    );
    assert_error(&t.get("/v1/sessions", Some(CLIENT)).await, 403, "forbidden");
    assert_error(&t.get("/v1/sessions", None).await, 401, "unauthorized");
}

/// An `/events` stream with nothing to send gets a comment after
/// `session_api::sse::KEEP_ALIVE_INTERVAL` (so proxies keep it open), and
/// still carries the next frame after it.
pub async fn an_idle_event_stream_is_kept_alive(t: &Target) {
    let id = t.id("idle");
    t.create(&id).await;
    let response = t.open_events(&id, "?after=0", None).await;
    let mut stream: Body = Box::pin(response.bytes_stream());
    let mut text = String::new();
    let started = std::time::Instant::now();
    let limit = session_api::sse::KEEP_ALIVE_INTERVAL + Duration::from_secs(10);
    while !text.contains(":\n\n") {
        let chunk = tokio::time::timeout(limit.saturating_sub(started.elapsed()), stream.next())
            .await
            .unwrap_or_else(|_| panic!("no keep-alive within {limit:?}: {text:?}"))
            .expect("the stream stays open")
            .expect("stream bytes");
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
    assert!(
        started.elapsed() >= session_api::sse::KEEP_ALIVE_INTERVAL - Duration::from_secs(2),
        "a keep-alive only after a quiet spell, not at once ({:?})",
        started.elapsed()
    );
    assert!(!text.contains("event: frame"), "{text:?}");
    let (status, _) = t
        .message(
            &id,
            CLIENT,
            json!({"type": "prompt", "text": "after the quiet"}),
        )
        .await;
    assert_eq!(status, 200);
    let mut reader = EventReader::of_body(stream);
    let event = reader.next().await.expect("the prompt's frame");
    assert_eq!(event.event, "frame");
    assert!(event.data.contains("after the quiet"), "{}", event.data);
}
