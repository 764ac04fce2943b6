//! The Durable Streams routes over real HTTP: generic streams (create,
//! append, read, ETag, JSON, producers, close, long-poll, fork, delete) and
//! session logs (SQLite) exposed as read-only JSON streams.

use std::sync::Arc;
use std::time::Duration;

use harness_core::frame::FrameBody;
use harness_core::log::{AppendRequest, SessionLog};
use harness_core::SessionId;
use reqwest::StatusCode;
use session_log::SqliteSessionLog;
use session_runtime::{Hub, HubConfig};
use session_server::durable_streams::{router, DurableStreamsState};

/// A long-poll timeout no test waits out.
const LONG_POLL: Duration = Duration::from_secs(60);

struct Server {
    base: String,
    http: reqwest::Client,
    log: Arc<SqliteSessionLog>,
    hub: Arc<Hub>,
    _dir: tempfile::TempDir,
}

async fn start() -> Server {
    start_with(Duration::from_millis(500)).await
}

/// A server whose long-polls give up after `long_poll`.
async fn start_with(long_poll: Duration) -> Server {
    let dir = tempfile::tempdir().unwrap();
    let log = Arc::new(SqliteSessionLog::open(dir.path().join("log.db")).unwrap());
    let mut state = DurableStreamsState::new();
    state.long_poll_timeout = long_poll;
    let hub = Hub::new(log.clone(), HubConfig::default());
    state.sessions = Some(hub.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router(state)).await.unwrap() });
    Server {
        base: format!("http://{addr}/v1/stream"),
        http: reqwest::Client::new(),
        log,
        hub,
        _dir: dir,
    }
}

fn header(r: &reqwest::Response, name: &str) -> Option<String> {
    r.headers()
        .get(name)
        .map(|v| v.to_str().unwrap().to_string())
}

#[tokio::test]
async fn create_append_read_with_etag_and_idempotent_create() {
    let s = start().await;
    let url = format!("{}/basic", s.base);
    let r = s
        .http
        .put(&url)
        .header("content-type", "text/plain")
        .body("hello")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::CREATED);
    assert!(header(&r, "location")
        .unwrap()
        .ends_with("/v1/stream/basic"));
    let after_create = header(&r, "stream-next-offset").unwrap();

    let r = s
        .http
        .post(&url)
        .header("content-type", "text/plain")
        .body(" world")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::NO_CONTENT);
    let tail = header(&r, "stream-next-offset").unwrap();
    assert!(
        tail > after_create,
        "offsets grow: {after_create} -> {tail}"
    );

    let r = s.http.get(format!("{url}?offset=-1")).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(
        header(&r, "stream-next-offset").as_deref(),
        Some(tail.as_str())
    );
    assert_eq!(header(&r, "stream-up-to-date").as_deref(), Some("true"));
    assert_eq!(
        header(&r, "x-content-type-options").as_deref(),
        Some("nosniff")
    );
    let etag = header(&r, "etag").unwrap();
    assert_eq!(r.text().await.unwrap(), "hello world");

    // Reading from the first append's offset returns only the second.
    let r = s
        .http
        .get(format!("{url}?offset={after_create}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.text().await.unwrap(), " world");

    let r = s
        .http
        .get(format!("{url}?offset=-1"))
        .header("if-none-match", &etag)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::NOT_MODIFIED);

    // Same config: 200; different content type: 409; both TTL forms: 400.
    let r = s
        .http
        .put(&url)
        .header("content-type", "text/plain")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let r = s
        .http
        .put(&url)
        .header("content-type", "application/json")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::CONFLICT);
    let r = s
        .http
        .put(format!("{}/both-ttl", s.base))
        .header("stream-ttl", "60")
        .header("stream-expires-at", "2099-01-01T00:00:00Z")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);

    // Empty append without close is refused and stores nothing.
    let r = s
        .http
        .post(&url)
        .header("content-type", "text/plain")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    let r = s.http.head(&url).send().await.unwrap();
    assert_eq!(
        header(&r, "stream-next-offset").as_deref(),
        Some(tail.as_str())
    );
}

#[tokio::test]
async fn json_streams_flatten_one_level_and_refuse_bad_bodies() {
    let s = start().await;
    let url = format!("{}/json", s.base);
    let json = "application/json";
    let r = s
        .http
        .put(&url)
        .header("content-type", json)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::CREATED);
    let r = s
        .http
        .post(&url)
        .header("content-type", json)
        .body(r#"[1,[2,3]]"#)
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success());
    let r = s
        .http
        .post(&url)
        .header("content-type", json)
        .body(r#"{"a":4}"#)
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success());
    for bad in ["[]", "{not json"] {
        let r = s
            .http
            .post(&url)
            .header("content-type", json)
            .body(bad)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::BAD_REQUEST, "body {bad}");
    }
    let r = s.http.get(format!("{url}?offset=-1")).send().await.unwrap();
    let items: serde_json::Value = r.json().await.unwrap();
    assert_eq!(items, serde_json::json!([1, [2, 3], {"a": 4}]));
}

#[tokio::test]
async fn idempotent_producers_dedupe_fence_and_report_gaps() {
    let s = start().await;
    let url = format!("{}/producer", s.base);
    s.http
        .put(&url)
        .header("content-type", "text/plain")
        .send()
        .await
        .unwrap();
    let post = |epoch: u64, seq: u64, body: &'static str| {
        s.http
            .post(&url)
            .header("content-type", "text/plain")
            .header("producer-id", "p1")
            .header("producer-epoch", epoch.to_string())
            .header("producer-seq", seq.to_string())
            .body(body)
            .send()
    };
    assert_eq!(post(0, 0, "a").await.unwrap().status(), StatusCode::OK);
    let dup = post(0, 0, "a").await.unwrap();
    assert_eq!(dup.status(), StatusCode::NO_CONTENT);
    assert_eq!(header(&dup, "producer-seq").as_deref(), Some("0"));
    let gap = post(0, 2, "c").await.unwrap();
    assert_eq!(gap.status(), StatusCode::CONFLICT);
    assert_eq!(header(&gap, "producer-expected-seq").as_deref(), Some("1"));
    assert_eq!(header(&gap, "producer-received-seq").as_deref(), Some("2"));
    assert_eq!(post(1, 0, "b").await.unwrap().status(), StatusCode::OK);
    let stale = post(0, 1, "x").await.unwrap();
    assert_eq!(stale.status(), StatusCode::FORBIDDEN);
    assert_eq!(header(&stale, "producer-epoch").as_deref(), Some("1"));

    let body = s
        .http
        .get(format!("{url}?offset=-1"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert_eq!(
        body, "ab",
        "duplicates, gaps and stale epochs store nothing"
    );
}

#[tokio::test]
async fn close_long_poll_and_fork_lifecycle() {
    // Long-polls here would wait a minute: a poll that answers at once
    // shows it did not wait, with no clock in the assertion.
    let s = start_with(LONG_POLL).await;
    let url = format!("{}/live", s.base);
    let r = s
        .http
        .put(&url)
        .header("content-type", "text/plain")
        .body("one")
        .send()
        .await
        .unwrap();
    let tail = header(&r, "stream-next-offset").unwrap();

    // A long-poll at the tail is woken by an append.
    let poll = {
        let http = s.http.clone();
        let u = format!("{url}?offset={tail}&live=long-poll");
        tokio::spawn(async move { http.get(u).send().await.unwrap() })
    };
    // Either order is right (a poll arriving after the append reads it at
    // once); the pause only makes the wake-up path the likely one.
    tokio::time::sleep(Duration::from_millis(100)).await;
    s.http
        .post(&url)
        .header("content-type", "text/plain")
        .body("two")
        .send()
        .await
        .unwrap();
    let r = poll.await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    assert!(header(&r, "stream-cursor").is_some());
    assert_eq!(r.text().await.unwrap(), "two");

    // A fork at the first offset sees only "one", then its own appends.
    let fork = format!("{}/live-fork", s.base);
    let r = s
        .http
        .put(&fork)
        .header("stream-forked-from", "/v1/stream/live")
        .header("stream-fork-offset", &tail)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::CREATED);
    assert_eq!(
        header(&r, "content-type").as_deref(),
        Some("text/plain"),
        "inherited"
    );
    s.http
        .post(&fork)
        .header("content-type", "text/plain")
        .body("-fork")
        .send()
        .await
        .unwrap();
    let body = s
        .http
        .get(format!("{fork}?offset=-1"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert_eq!(body, "one-fork");

    // Append and close atomically; then appends are 409 and a long-poll at
    // the tail answers at once.
    let r = s
        .http
        .post(&url)
        .header("content-type", "text/plain")
        .header("stream-closed", "true")
        .body("three")
        .send()
        .await
        .unwrap();
    assert_eq!(header(&r, "stream-closed").as_deref(), Some("true"));
    let end = header(&r, "stream-next-offset").unwrap();
    let r = s
        .http
        .post(&url)
        .header("content-type", "text/plain")
        .body("four")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::CONFLICT);
    let r = tokio::time::timeout(
        LONG_POLL / 2,
        s.http
            .get(format!("{url}?offset={end}&live=long-poll"))
            .send(),
    )
    .await
    .expect("a long-poll on a closed tail answers at once, it does not wait")
    .unwrap();
    assert_eq!(r.status(), StatusCode::NO_CONTENT);
    assert_eq!(header(&r, "stream-closed").as_deref(), Some("true"));

    // Deleting the source keeps it for its fork: 410 for the source, the
    // fork still reads its inherited data.
    assert_eq!(
        s.http.delete(&url).send().await.unwrap().status(),
        StatusCode::NO_CONTENT
    );
    assert_eq!(
        s.http.get(&url).send().await.unwrap().status(),
        StatusCode::GONE
    );
    let body = s
        .http
        .get(format!("{fork}?offset=-1"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert_eq!(body, "one-fork");
    assert_eq!(
        s.http.delete(&fork).send().await.unwrap().status(),
        StatusCode::NO_CONTENT
    );
    assert_eq!(
        s.http.head(&url).send().await.unwrap().status(),
        StatusCode::NOT_FOUND,
        "cascaded"
    );
}

#[tokio::test]
async fn session_logs_read_as_json_streams() {
    let s = start().await;
    let id = SessionId::parse("ds-session").unwrap();
    s.log.create(&id).await.unwrap();
    for text in ["first", "second"] {
        let body = FrameBody::UserMessage {
            text: text.into(),
            turn_id: None,
        };
        s.log.append(&id, AppendRequest::new(body)).await.unwrap();
    }
    let url = format!("{}/sessions/ds-session", s.base);
    let r = s.http.get(format!("{url}?offset=-1")).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(
        header(&r, "content-type").as_deref(),
        Some("application/json")
    );
    let next = header(&r, "stream-next-offset").unwrap();
    assert_eq!(
        next, "0000000000000000_0000000000000002",
        "offset carries the seq"
    );
    let frames: Vec<serde_json::Value> = r.json().await.unwrap();
    assert_eq!(frames.len(), 2);
    assert_eq!(frames[0]["seq"], 1);
    assert_eq!(frames[1]["body"]["text"], "second");

    // Caught up: an empty array; a long-poll there times out with 204.
    let r = s
        .http
        .get(format!("{url}?offset={next}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.text().await.unwrap(), "[]");
    let r = s
        .http
        .get(format!("{url}?offset={next}&live=long-poll"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::NO_CONTENT);

    // Read-only, and sealed logs read as closed streams.
    let r = s
        .http
        .post(&url)
        .header("content-type", "application/json")
        .body("[1]")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::METHOD_NOT_ALLOWED);
    s.log.seal(&id).await.unwrap();
    let r = s
        .http
        .get(format!("{url}?offset={next}"))
        .send()
        .await
        .unwrap();
    assert_eq!(header(&r, "stream-closed").as_deref(), Some("true"));
    let r = s
        .http
        .get(format!("{}/sessions/no-such-session?offset=-1", s.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::NOT_FOUND);

    // Retention (docs/retention.md): a third frame, then frames 1..=2
    // trimmed. An offset inside the cut is 410 Gone; from the start
    // (`-1`) the stream begins at the first frame kept.
    let kept = SessionId::parse("ds-kept").unwrap();
    s.log.create(&kept).await.unwrap();
    for text in ["one", "two", "three"] {
        let body = FrameBody::UserMessage {
            text: text.into(),
            turn_id: None,
        };
        s.log.append(&kept, AppendRequest::new(body)).await.unwrap();
    }
    s.log.trim(&kept, 2).await.unwrap();
    let url = format!("{}/sessions/ds-kept", s.base);
    let inside = "0000000000000000_0000000000000001";
    let r = s
        .http
        .get(format!("{url}?offset={inside}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::GONE);
    let r = s.http.get(format!("{url}?offset=-1")).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let frames: Vec<serde_json::Value> = r.json().await.unwrap();
    assert_eq!(frames.len(), 1, "{frames:?}");
    assert_eq!(frames[0]["seq"], 3);
}

#[tokio::test]
async fn mounted_on_the_session_server_with_its_tokens() {
    use session_server::{GrantRole, Scope, ServerConfig, SessionServer, TokenGrant};
    let dir = tempfile::tempdir().unwrap();
    let log = Arc::new(SqliteSessionLog::open(dir.path().join("log.db")).unwrap());
    let id = SessionId::parse("mounted").unwrap();
    log.create(&id).await.unwrap();
    let mut config = ServerConfig::new(log.clone());
    config
        .tokens
        .push(TokenGrant::new("host", Scope::All, GrantRole::Host));
    config.tokens.push(TokenGrant::new(
        "reader",
        Scope::Session(id.clone()),
        GrantRole::Client,
    ));
    let server = SessionServer::new(config);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = server.router();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let http = reqwest::Client::new();
    let url = format!("http://{addr}/v1/stream/mounted-generic");

    let r = http.put(&url).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED, "no token");
    let r = http.put(&url).bearer_auth("reader").send().await.unwrap();
    assert_eq!(
        r.status(),
        StatusCode::FORBIDDEN,
        "generic streams need host"
    );
    let r = http.put(&url).bearer_auth("host").send().await.unwrap();
    assert_eq!(r.status(), StatusCode::CREATED);

    let session_url = format!("http://{addr}/v1/stream/sessions/mounted?offset=-1");
    let r = http
        .get(&session_url)
        .bearer_auth("reader")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(r.text().await.unwrap(), "[]");
    // The session API itself still answers next to the streams.
    let r = http
        .get(format!("http://{addr}/v1/sessions/mounted"))
        .bearer_auth("host")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
}

#[tokio::test]
async fn sqlite_store_survives_reopening() {
    use session_server::durable_streams::StreamStore;
    use session_server::durable_streams::{AppendOptions, AppendOutcome, CreateOptions, Producer};
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("streams.db");
    let text = || Some("text/plain".to_string());
    let (tail, fork_tail) = {
        let store = StreamStore::open(&file).unwrap();
        let opts = CreateOptions {
            content_type: text(),
            initial_data: Some("a".into()),
            ..CreateOptions::default()
        };
        assert!(store.create("/v1/stream/p", opts).unwrap().0);
        let append = AppendOptions {
            content_type: text(),
            producer: Some(Producer {
                id: "w".into(),
                epoch: 3,
                seq: 0,
            }),
            close: true,
            ..AppendOptions::default()
        };
        store.append("/v1/stream/p", "b".into(), append).unwrap();
        let fork = CreateOptions {
            forked_from: Some("/v1/stream/p".into()),
            initial_data: Some("c".into()),
            ..CreateOptions::default()
        };
        let (_, fork_meta) = store.create("/v1/stream/f", fork).unwrap();
        let q = CreateOptions {
            content_type: text(),
            ..CreateOptions::default()
        };
        store.create("/v1/stream/q", q).unwrap();
        let first = AppendOptions {
            content_type: text(),
            producer: Some(Producer {
                id: "w".into(),
                epoch: 3,
                seq: 0,
            }),
            ..AppendOptions::default()
        };
        let outcome = store.append("/v1/stream/q", "x".into(), first).unwrap();
        assert!(matches!(outcome, AppendOutcome::Accepted { .. }));
        // Deleting the source while the fork lives only soft-deletes it.
        assert!(store.delete("/v1/stream/p").unwrap());
        let (_, meta) = store.read("/v1/stream/p", None).unwrap();
        (meta.tail, fork_meta.tail)
    };

    let store = StreamStore::open(&file).unwrap();
    let (messages, meta) = store.read("/v1/stream/p", None).unwrap();
    assert_eq!(meta.tail, tail);
    assert!(meta.closed && meta.soft_deleted);
    let bytes: Vec<u8> = messages.iter().flat_map(|m| m.data.to_vec()).collect();
    assert_eq!(bytes, b"ab");
    let (messages, meta) = store.read("/v1/stream/f", None).unwrap();
    assert_eq!(meta.tail, fork_tail);
    let bytes: Vec<u8> = messages.iter().flat_map(|m| m.data.to_vec()).collect();
    assert_eq!(bytes, b"abc", "the fork still reads through its source");
    // Producer state came back too: a retry is a duplicate, a skip a gap.
    let producer = |seq: u64| AppendOptions {
        content_type: text(),
        producer: Some(Producer {
            id: "w".into(),
            epoch: 3,
            seq,
        }),
        ..AppendOptions::default()
    };
    let outcome = store
        .append("/v1/stream/q", "x".into(), producer(0))
        .unwrap();
    assert!(
        matches!(outcome, AppendOutcome::Duplicate { last_seq: 0, .. }),
        "{outcome:?}"
    );
    let outcome = store
        .append("/v1/stream/q", "z".into(), producer(2))
        .unwrap();
    assert!(
        matches!(
            outcome,
            AppendOutcome::SequenceGap {
                expected: 1,
                received: 2
            }
        ),
        "{outcome:?}"
    );

    // Removing the fork cascades to the soft-deleted source, on disk too.
    assert!(store.delete("/v1/stream/f").unwrap());
    drop(store);
    let store = StreamStore::open(&file).unwrap();
    assert!(store.meta("/v1/stream/p").is_none());
    assert!(store.meta("/v1/stream/f").is_none());
}

#[tokio::test]
async fn session_stream_sse_pairs_frames_with_controls_and_follows_appends() {
    use futures::StreamExt;
    let s = start().await;
    let id = SessionId::parse("ds-sse").unwrap();
    s.log.create(&id).await.unwrap();
    prompt(&s.hub, &id, "before").await;
    let r = s
        .http
        .get(format!("{}/sessions/ds-sse?offset=-1&live=sse", s.base))
        .send()
        .await
        .unwrap();
    assert_eq!(
        header(&r, "content-type").as_deref(),
        Some("text/event-stream")
    );
    let mut body = r.bytes_stream();
    let mut text = String::new();
    let mut appended = false;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    // Read until the frame appended after connecting has arrived.
    while !text.contains("\"after\"") {
        let chunk = tokio::time::timeout_at(deadline, body.next())
            .await
            .expect("SSE data in time")
            .expect("stream open")
            .unwrap();
        text.push_str(&String::from_utf8_lossy(&chunk));
        if !appended && text.contains("upToDate") {
            // Live reads follow the actor: write through it, as the
            // session API does.
            prompt(&s.hub, &id, "after").await;
            appended = true;
        }
    }
    let events: Vec<&str> = text
        .split("\n\n")
        .filter_map(|block| block.lines().next()?.strip_prefix("event: "))
        .collect();
    // catch-up data+control, then live data+control; every data event is
    // followed by a control event.
    assert_eq!(events[..2], ["data", "control"]);
    for (i, e) in events.iter().enumerate() {
        if *e == "data" && i + 1 < events.len() {
            assert_eq!(events[i + 1], "control", "events: {events:?}");
        }
    }
    assert!(text.contains("\"streamNextOffset\":\"0000000000000000_0000000000000001\""));
}

/// Store a prompt through the session's actor (as `POST /messages` does);
/// its seq.
async fn prompt(hub: &Hub, id: &SessionId, text: &str) -> u64 {
    use harness_core::actor::{ClientMessage, Role};
    let mut conn = hub.connect(id, Role::Client, None).await.unwrap();
    conn.client(ClientMessage::Prompt {
        text: text.into(),
        turn_id: None,
        key: None,
    });
    let seq = conn.answer(Duration::from_secs(10)).await.unwrap().seq;
    // No runtime runs the turn: end it as the runtime would when it cannot
    // start one, so the next prompt is accepted.
    let frame = hub.log().read(id, seq - 1, 1).await.unwrap().remove(0);
    let FrameBody::UserMessage {
        turn_id: Some(turn_id),
        ..
    } = frame.body
    else {
        panic!("not a prompt: {frame:?}")
    };
    hub.input(
        id,
        harness_core::actor::Input::DispatchFailed {
            turn_id,
            error: "no runtime in this test".into(),
        },
    )
    .unwrap();
    seq
}

/// Wait until a live reader follows `id`'s actor: the one connection the
/// actor holds once the test's own (dropped) ones are gone. A reader that
/// has not connected yet still reads the log, and would see a frame
/// written behind the actor's back whether or not it polls.
async fn reader_follows(hub: &Hub, id: &SessionId) {
    for _ in 0..1000 {
        if hub.connection_count(id).await >= 1 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("no reader connected to the actor of {id} within 10 s");
}

/// Read `body` into `text` until it holds `needle`; false after `within`.
async fn read_until<S>(body: &mut S, text: &mut String, needle: String, within: Duration) -> bool
where
    S: futures::Stream<Item = reqwest::Result<bytes::Bytes>> + Unpin,
{
    use futures::StreamExt;
    let deadline = tokio::time::Instant::now() + within;
    while !text.contains(&needle) {
        match tokio::time::timeout_at(deadline, body.next()).await {
            Ok(chunk) => text.push_str(&String::from_utf8_lossy(
                &chunk.expect("stream open").unwrap(),
            )),
            Err(_) => return false,
        }
    }
    true
}

/// Live reads are woken by the actor's fan-out, not by a timer looking at
/// the log: a frame written to the log behind the actor's back stays
/// unseen by a waiting reader for many times the old 100 ms poll interval
/// (a polling reader would answer with it within one interval), and shows
/// up as soon as the actor stores the next frame. Then a live reader gets
/// each of a run of frames as it is stored; the delivery times are printed,
/// not asserted (a shared CI machine makes any bound flaky), since the
/// first half is what tells following from polling.
#[tokio::test]
async fn session_stream_live_reads_follow_the_actor_not_a_timer() {
    let s = start_with(LONG_POLL).await;
    let id = SessionId::parse("ds-follow").unwrap();
    s.log.create(&id).await.unwrap();
    let url = format!("{}/sessions/ds-follow", s.base);
    let behind_the_actor = |text: &str| {
        let body = FrameBody::Message {
            turn_id: "elsewhere".into(),
            id: "m".into(),
            kind: harness_core::frame::MessageKind::Text,
            text: text.into(),
            interrupted: false,
        };
        s.log.append(&id, AppendRequest::new(body))
    };

    // Long-poll.
    let http = s.http.clone();
    let poll_url = format!("{url}?offset=0000000000000000_0000000000000000&live=long-poll");
    let mut long_poll = tokio::spawn(async move { http.get(poll_url).send().await.unwrap() });
    reader_follows(&s.hub, &id).await;
    behind_the_actor("unseen").await.unwrap();
    assert!(
        tokio::time::timeout(Duration::from_millis(500), &mut long_poll)
            .await
            .is_err(),
        "the long-poll answered without the actor storing anything: it polls the log"
    );
    let seq = prompt(&s.hub, &id, "wakes").await;
    let r = tokio::time::timeout(Duration::from_secs(10), long_poll)
        .await
        .expect("the actor's frame wakes the long-poll")
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let frames: Vec<serde_json::Value> = r.json().await.unwrap();
    assert_eq!(frames[0]["body"]["text"], "unseen");
    assert_eq!(frames[1]["seq"], seq);
    assert_eq!(frames[1]["body"]["text"], "wakes");

    // SSE, from the tail.
    let r = s
        .http
        .get(format!("{url}?offset=now&live=sse"))
        .send()
        .await
        .unwrap();
    let mut body = r.bytes_stream();
    let mut text = String::new();
    assert!(
        read_until(
            &mut body,
            &mut text,
            "upToDate".into(),
            Duration::from_secs(10)
        )
        .await
    );
    reader_follows(&s.hub, &id).await;
    behind_the_actor("unseen-sse").await.unwrap();
    assert!(
        !read_until(
            &mut body,
            &mut text,
            "unseen-sse".into(),
            Duration::from_millis(500)
        )
        .await,
        "the SSE reader saw a frame the actor never stored: it polls the log"
    );
    prompt(&s.hub, &id, "wakes-sse").await;
    assert!(
        read_until(
            &mut body,
            &mut text,
            "wakes-sse".into(),
            Duration::from_secs(10)
        )
        .await
    );
    assert!(text.find("unseen-sse").unwrap() < text.find("wakes-sse").unwrap());

    let mut delays = Vec::new();
    for i in 0..20 {
        let sent = std::time::Instant::now();
        let needle = format!("live-{i}\"");
        prompt(&s.hub, &id, &needle[..needle.len() - 1]).await;
        assert!(read_until(&mut body, &mut text, needle, Duration::from_secs(10)).await);
        delays.push(sent.elapsed());
    }
    delays.sort();
    eprintln!(
        "SSE delivery through the actor (append + ack + fan-out): p50 {:?}, max {:?}",
        delays[delays.len() / 2],
        delays[delays.len() - 1]
    );
}
