//! The HTTP endpoints: fork/seal/export, auth, limits, the UI message
//! stream, and no acknowledged frame lost across a kill -9 of the server.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use common::*;
use harness_core::actor::ServerMessage;
use harness_core::frame::{Frame, FrameBody};
use harness_core::log::{LogInfo, SessionLog};
use serde_json::{json, Value};
use session_server::{GrantRole, Scope, TokenGrant};

async fn prompt(srv: &TestServer, id: &str, text: &str) -> reqwest::Response {
    srv.http
        .post(format!("{}/v1/sessions/{id}/messages", srv.base))
        .json(&json!({"type": "prompt", "text": text}))
        .send()
        .await
        .unwrap()
}

/// A client frame of the running turn: an answer named `text` (a session
/// holds one turn at a time, so frames after the first prompt are answers).
async fn say(srv: &TestServer, id: &str, text: &str) -> reqwest::Response {
    srv.http
        .post(format!("{}/v1/sessions/{id}/messages", srv.base))
        .json(&json!({"type": "approval-response", "approvalId": text, "approved": true}))
        .send()
        .await
        .unwrap()
}

async fn error_code(r: reqwest::Response) -> String {
    let v: Value = r.json().await.unwrap();
    v["error"]["code"]
        .as_str()
        .unwrap_or_else(|| panic!("no error code in {v}"))
        .to_string()
}

#[tokio::test]
async fn fork_until_n_export_and_seal_behave_as_specified() {
    let srv = start(|_| {}).await;
    srv.create("src").await;
    assert_eq!(prompt(&srv, "src", "m1").await.status(), 200);
    for i in 2..=5 {
        assert_eq!(say(&srv, "src", &format!("m{i}")).await.status(), 200);
    }
    // Fork the first 3 frames, sealed.
    let r = srv
        .http
        .post(format!(
            "{}/v1/sessions/src/fork?until=3&seal=1&target=dst",
            srv.base
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let info: LogInfo = r.json().await.unwrap();
    assert!(info.sealed);
    assert_eq!(
        info.last_seq, 5,
        "3 copied frames, the frame closing the turn they cut, the seal frame"
    );
    assert_eq!(info.forked_from.as_ref().unwrap().until, 3);
    let exported: Vec<Frame> = srv
        .http
        .get(format!("{}/v1/sessions/dst/export", srv.base))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let source: Vec<Frame> = srv
        .http
        .get(format!("{}/v1/sessions/src/export?until=3", srv.base))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(source.len(), 3);
    assert_eq!(exported[..3], source[..]);
    assert!(
        matches!(&exported[3].body, FrameBody::TurnStatus { turn_id, error: Some(e), .. }
            if turn_id == "t1" && e.contains("forked from src at seq 3")),
        "{:?}",
        exported[3]
    );
    assert!(matches!(exported[4].body, FrameBody::Sealed {}));
    // The sealed fork refuses writes; the source goes on.
    let r = say(&srv, "dst", "late").await;
    assert_eq!(r.status(), 409);
    assert_eq!(error_code(r).await, "sealed");
    assert_eq!(say(&srv, "src", "m6").await.status(), 200);
    // An unsealed fork with a generated id grows on its own.
    let r = srv
        .http
        .post(format!("{}/v1/sessions/src/fork?until=2", srv.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let open: LogInfo = r.json().await.unwrap();
    assert!(
        !open.sealed && open.last_seq == 4,
        "2 copied frames, the frame closing the cut turn, the sandbox reset: {open:?}"
    );
    // No turn had ended before the cut: the fork starts from an empty tree
    // and a new conversation, in a sandbox of its own.
    let last = srv.log.read(&open.session, 3, 1).await.unwrap();
    assert!(
        matches!(
            &last[0].body,
            FrameBody::SandboxReset {
                turn_id: None,
                checkpoint: None,
                ..
            }
        ),
        "{:?}",
        last[0]
    );
    assert!(open.meta.sandbox.is_none());
    // The cut turn is closed in the fork: no answers for it, a new prompt
    // starts a turn of the fork's own.
    let r = say(&srv, open.session.as_str(), "late answer").await;
    assert_eq!(r.status(), 409);
    assert_eq!(error_code(r).await, "no_active_turn");
    let ack: Value = prompt(&srv, open.session.as_str(), "fresh")
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(ack["seq"], 5);
    // Bad ranges and targets.
    let r = srv
        .http
        .post(format!(
            "{}/v1/sessions/src/fork?until=99&target=x",
            srv.base
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let r = srv
        .http
        .post(format!(
            "{}/v1/sessions/src/fork?until=1&target=dst",
            srv.base
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 409);
    let r = srv
        .http
        .get(format!("{}/v1/sessions/src/export?until=99", srv.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    // Seal: a live client sees the seal frame, later writes are refused,
    // sealing again is a no-op.
    let mut client = ws(&format!("{}/v1/sessions/src/ws", srv.ws_base)).await;
    send(
        &mut client,
        json!({"type": "approval-response", "approvalId": "registered", "approved": true}),
    )
    .await;
    let mut seen = Vec::new();
    answer(&mut client, &mut seen).await;
    let r = srv
        .http
        .post(format!("{}/v1/sessions/src/seal", srv.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let sealed: LogInfo = r.json().await.unwrap();
    assert!(sealed.sealed);
    assert_eq!(sealed.last_seq, 8);
    loop {
        match recv(&mut client).await.unwrap() {
            ServerMessage::Frame { frame } if matches!(frame.body, FrameBody::Sealed {}) => break,
            _ => {}
        }
    }
    assert_eq!(say(&srv, "src", "after seal").await.status(), 409);
    let again: LogInfo = srv
        .http
        .post(format!("{}/v1/sessions/src/seal", srv.base))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(again.last_seq, 8);
    // Paged replay.
    let page: Vec<Frame> = srv
        .http
        .get(format!(
            "{}/v1/sessions/src/frames?after=2&limit=3",
            srv.base
        ))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        page.iter().map(|f| f.seq).collect::<Vec<_>>(),
        vec![3, 4, 5]
    );
    let list: Vec<LogInfo> = srv
        .http
        .get(format!("{}/v1/sessions", srv.base))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(list.len(), 3);
}

#[tokio::test]
async fn wrong_tokens_get_401_and_wrong_grants_403_with_nothing_written() {
    let srv = start(|c| {
        c.insecure_no_auth = false;
        c.tokens = vec![
            TokenGrant::new("host", Scope::All, GrantRole::Host),
            TokenGrant::new("client-a", Scope::parse("a").unwrap(), GrantRole::Client),
            TokenGrant::new("runner-a", Scope::parse("a").unwrap(), GrantRole::Runner),
        ];
    })
    .await;
    let h = &srv.http;
    let base = &srv.base;
    // Create: host only.
    let r = h
        .post(format!("{base}/v1/sessions"))
        .json(&json!({"id": "a"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    assert_eq!(error_code(r).await, "unauthorized");
    let r = h
        .post(format!("{base}/v1/sessions"))
        .bearer_auth("client-a")
        .json(&json!({"id": "a"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403);
    for id in ["a", "b"] {
        let r = h
            .post(format!("{base}/v1/sessions"))
            .bearer_auth("host")
            .json(&json!({"id": id}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 201);
    }
    let msg = json!({"type": "prompt", "text": "x"});
    let post = |token: Option<&'static str>, id: &'static str| {
        let mut req = h
            .post(format!("{base}/v1/sessions/{id}/messages"))
            .json(&msg);
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        req.send()
    };
    assert_eq!(post(None, "a").await.unwrap().status(), 401);
    assert_eq!(post(Some("nope"), "a").await.unwrap().status(), 401);
    assert_eq!(post(Some("client-a"), "b").await.unwrap().status(), 403);
    assert_eq!(post(Some("runner-a"), "a").await.unwrap().status(), 403);
    // Sealing is for hosts, even through the client message endpoint.
    let r = h
        .post(format!("{base}/v1/sessions/a/messages"))
        .bearer_auth("client-a")
        .json(&json!({"type": "seal"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403);
    let r = h
        .get(format!("{base}/v1/sessions"))
        .bearer_auth("client-a")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403);
    for path in ["seal", "fork?until=0&target=c"] {
        let r = h
            .post(format!("{base}/v1/sessions/a/{path}"))
            .bearer_auth("client-a")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 403, "{path}");
    }
    // WebSocket: the handshake itself is refused.
    let err = tokio_tungstenite::connect_async(format!(
        "{}/v1/sessions/a/ws?role=runner&generation=1&access_token=client-a",
        srv.ws_base
    ))
    .await
    .unwrap_err();
    assert!(err.to_string().contains("403"), "{err}");
    let err = tokio_tungstenite::connect_async(format!("{}/v1/sessions/a/ws", srv.ws_base))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("401"), "{err}");
    assert_eq!(
        srv.last_seq("a").await,
        0,
        "a refused request wrote something"
    );
    assert_eq!(srv.last_seq("b").await, 0);
    // The right grants work, by header or by query token.
    assert_eq!(post(Some("client-a"), "a").await.unwrap().status(), 200);
    let r = h
        .get(format!("{base}/v1/sessions/a/frames?access_token=client-a"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let mut runner = ws(&format!(
        "{}/v1/sessions/a/ws?role=runner&generation=1&access_token=runner-a",
        srv.ws_base
    ))
    .await;
    send(
        &mut runner,
        json!({"type": "part", "turnId": "t", "part": {"type": "finish-step"}}),
    )
    .await;
    assert!(matches!(
        recv(&mut runner).await,
        Some(ServerMessage::Ack { .. })
    ));
    assert_eq!(srv.last_seq("a").await, 3);
}

#[tokio::test]
async fn oversized_malformed_and_unknown_are_refused_with_nothing_written() {
    let srv = start(|c| c.max_frame_bytes = 1024).await;
    srv.create("l").await;
    let url = format!("{}/v1/sessions/l/messages", srv.base);
    // Just over the frame limit: the actor refuses it.
    let r = srv
        .http
        .post(&url)
        .json(&json!({"type": "prompt", "text": "x".repeat(2000)}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 413);
    assert_eq!(error_code(r).await, "frame_too_large");
    // Far over: refused while reading the body.
    let r = srv
        .http
        .post(&url)
        .json(&json!({"type": "prompt", "text": "x".repeat(200_000)}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 413);
    assert_eq!(error_code(r).await, "frame_too_large");
    let r = srv.http.post(&url).body("{not json").send().await.unwrap();
    assert_eq!(r.status(), 400);
    assert_eq!(error_code(r).await, "invalid");
    let r = srv
        .http
        .post(&url)
        .json(&json!({"type": "no-such-type"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let r = prompt(&srv, "ghost", "hi").await;
    assert_eq!(r.status(), 404);
    assert_eq!(error_code(r).await, "not_found");
    let r = srv
        .http
        .get(format!("{}/v1/sessions/ghost/events", srv.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let r = srv
        .http
        .get(format!("{}/v1/sessions/bad..id%2F/frames", srv.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    // Over WebSocket: clear errors, the connection stays usable.
    let mut c = ws(&format!("{}/v1/sessions/l/ws", srv.ws_base)).await;
    send(&mut c, json!({"type": "prompt", "text": "y".repeat(2000)})).await;
    assert!(
        matches!(recv(&mut c).await, Some(ServerMessage::Error { code, .. }) if code.as_str() == "frame_too_large")
    );
    use futures::SinkExt;
    c.send(tokio_tungstenite::tungstenite::Message::Text("[1,2".into()))
        .await
        .unwrap();
    assert!(
        matches!(recv(&mut c).await, Some(ServerMessage::Error { code, .. }) if code.as_str() == "invalid")
    );
    let mut runner = ws(&format!(
        "{}/v1/sessions/l/ws?role=runner&generation=1",
        srv.ws_base
    ))
    .await;
    send(&mut runner, json!({"type": "part", "turnId": "t", "part": {"type": "error", "message": "z".repeat(2000)}})).await;
    assert!(
        matches!(recv(&mut runner).await, Some(ServerMessage::Error { code, .. }) if code.as_str() == "frame_too_large")
    );
    // Only the runner-attached frame was stored.
    let frames = srv.log.read(&sid("l"), 0, 10).await.unwrap();
    assert_eq!(frames.len(), 1);
    assert!(matches!(
        frames[0].body,
        FrameBody::RunnerAttached { generation: 1 }
    ));
    send(&mut c, json!({"type": "prompt", "text": "fine"})).await;
    let mut seen = Vec::new();
    assert!(matches!(
        answer(&mut c, &mut seen).await,
        ServerMessage::Ack { seq: 2, .. }
    ));
}

#[tokio::test]
async fn ui_stream_speaks_the_ai_sdk_ui_message_stream() {
    let srv = start(|_| {}).await;
    srv.create("u").await;
    let r = srv
        .http
        .get(format!("{}/v1/sessions/u/ui-stream", srv.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-vercel-ai-ui-message-stream"], "v1");
    let mut reader = SseReader::new(r);
    let mut runner = ws(&format!(
        "{}/v1/sessions/u/ws?role=runner&generation=1",
        srv.ws_base
    ))
    .await;
    // The reader is registered once its response head arrived, so it sees
    // every live delta.
    let p = |part: Value| json!({"type": "part", "turnId": "t", "part": part});
    send(&mut runner, p(json!({"type": "stream-start"}))).await;
    send(&mut runner, p(json!({"type": "text-start", "id": "b"}))).await;
    send(
        &mut runner,
        p(json!({"type": "text-delta", "id": "b", "delta": "Hel"})),
    )
    .await;
    send(
        &mut runner,
        p(json!({"type": "text-delta", "id": "b", "delta": "lo"})),
    )
    .await;
    send(&mut runner, p(json!({"type": "text-end", "id": "b"}))).await;
    send(&mut runner, p(json!({"type": "tool-call", "toolCallId": "c", "toolName": "Bash", "input": {"command": "ls"}}))).await;
    send(
        &mut runner,
        p(json!({"type": "tool-result", "toolCallId": "c", "toolName": "Bash", "output": "ok"})),
    )
    .await;
    send(
        &mut runner,
        p(json!({"type": "finish", "finishReason": "stop"})),
    )
    .await;
    let mut chunks = Vec::new();
    loop {
        let ev = reader.next().await.expect("ui stream ended without [DONE]");
        if ev.data == "[DONE]" {
            break;
        }
        chunks.push(serde_json::from_str::<Value>(&ev.data).unwrap());
    }
    assert!(
        reader.next().await.is_none(),
        "the stream ends after [DONE]"
    );
    let types: Vec<&str> = chunks.iter().map(|c| c["type"].as_str().unwrap()).collect();
    assert_eq!(
        types,
        vec![
            "start",
            "start-step",
            "text-start",
            "text-delta",
            "text-delta",
            "text-end",
            "tool-input-available",
            "tool-output-available",
            "finish-step",
            "finish"
        ]
    );
    assert_eq!(chunks[6]["dynamic"], true);
    assert_eq!(chunks[7]["output"], "ok");
    // Replaying the same turn later gives the same text whole.
    let r = srv
        .http
        .get(format!("{}/v1/sessions/u/ui-stream?after=0", srv.base))
        .send()
        .await
        .unwrap();
    let mut replay = SseReader::new(r);
    let mut text = String::new();
    loop {
        let ev = replay.next().await.unwrap();
        if ev.data == "[DONE]" {
            break;
        }
        let c: Value = serde_json::from_str(&ev.data).unwrap();
        if c["type"] == "text-delta" {
            text.push_str(c["delta"].as_str().unwrap());
        }
    }
    assert_eq!(text, "Hello");
}

const CHILD_ENV: &str = "SESSION_SERVER_KILL9_DB";

/// The server child of `acknowledged_frames_survive_a_server_kill`: a no-op
/// when run as an ordinary test.
#[tokio::test]
async fn child_server() {
    let Ok(db) = std::env::var(CHILD_ENV) else {
        return;
    };
    let log = session_log::SqliteSessionLog::open(db).unwrap();
    let mut config = session_server::ServerConfig::new(std::sync::Arc::new(log));
    config.insecure_no_auth = true;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    println!("LISTENING {}", listener.local_addr().unwrap());
    session_server::serve(listener, config).await.unwrap();
}

fn spawn_server(db: &std::path::Path) -> (std::process::Child, String) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["child_server", "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, db)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let addr = loop {
        let line = lines
            .next()
            .expect("child exited before listening")
            .unwrap();
        if let Some(at) = line.find("LISTENING ") {
            break line[at + 10..].trim().to_string();
        }
    };
    (child, format!("http://{addr}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_frames_survive_a_server_kill() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("server.db");
    let (mut child, base) = spawn_server(&db);
    let http = reqwest::Client::new();
    let r = http
        .post(format!("{base}/v1/sessions"))
        .json(&json!({"id": "k"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    // One turn opens; four concurrent writers answer in it; the server is
    // killed while they write.
    let r = http
        .post(format!("{base}/v1/sessions/k/messages"))
        .json(&json!({"type": "prompt", "text": "open"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let acked = std::sync::Arc::new(std::sync::Mutex::new(Vec::<(u64, String)>::new()));
    let mut writers = Vec::new();
    for w in 0..4 {
        let (http, base, acked) = (http.clone(), base.clone(), acked.clone());
        writers.push(tokio::spawn(async move {
            for i in 0.. {
                let text = format!("w{w}-{i}");
                let r = http
                    .post(format!("{base}/v1/sessions/k/messages"))
                    .json(
                        &json!({"type": "approval-response", "approvalId": text, "approved": true}),
                    )
                    .send()
                    .await;
                let Ok(r) = r else { return };
                let Ok(v) = r.json::<Value>().await else {
                    return;
                };
                acked
                    .lock()
                    .unwrap()
                    .push((v["seq"].as_u64().unwrap(), text));
            }
        }));
    }
    while acked.lock().unwrap().len() < 200 {
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    for w in writers {
        w.await.unwrap();
    }
    let acked = acked.lock().unwrap().clone();
    let (mut child, base) = spawn_server(&db);
    let frames: Vec<Frame> = http
        .get(format!("{base}/v1/sessions/k/export"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    child.kill().unwrap();
    child.wait().unwrap();
    for (i, f) in frames.iter().enumerate() {
        assert_eq!(f.seq, i as u64 + 1, "gap after restart");
    }
    for (seq, text) in &acked {
        let f = frames
            .get(*seq as usize - 1)
            .unwrap_or_else(|| panic!("acknowledged seq {seq} lost"));
        assert!(
            matches!(&f.body, FrameBody::ApprovalResponse { approval_id: t, .. } if t == text),
            "seq {seq} holds {:?}",
            f.body
        );
    }
    println!("acked {}, recovered {}", acked.len(), frames.len());
}

#[tokio::test]
async fn a_retried_message_with_a_key_is_stored_once() {
    let srv = start(|_| {}).await;
    srv.create("i").await;
    let url = format!("{}/v1/sessions/i/messages", srv.base);
    let send = |text: &str| {
        srv.http
            .post(&url)
            .json(&json!({"type": "prompt", "text": text, "key": "turn-1"}))
            .send()
    };
    let first: Value = send("hello").await.unwrap().json().await.unwrap();
    assert_eq!(
        first,
        json!({"type": "ack", "seq": 1, "duplicate": false, "turnId": "t1"})
    );
    let retry: Value = send("hello").await.unwrap().json().await.unwrap();
    assert_eq!(
        retry,
        json!({"type": "ack", "seq": 1, "duplicate": true, "turnId": "t1"})
    );
    // The same key for other content is a conflict, and stores nothing.
    let r = send("something else").await.unwrap();
    assert_eq!(r.status(), 409);
    assert_eq!(srv.last_seq("i").await, 1);
}

/// The read paths written a page at a time (export, frames, SSE, WebSocket
/// replay) give every frame once, in order, across page boundaries, and
/// stop where asked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_histories_read_whole_and_in_order_on_every_path() {
    let srv = start(|_| {}).await;
    srv.create("long").await;
    let s = sid("long");
    let n = 2_500u64;
    for i in 1..=n {
        let body = FrameBody::UserMessage {
            text: format!("m{i}"),
            turn_id: None,
        };
        srv.log
            .append(&s, harness_core::log::AppendRequest::new(body))
            .await
            .unwrap();
    }
    srv.log.seal(&s).await.unwrap();
    let total = n + 1;
    let seqs = |frames: &[Frame]| frames.iter().map(|f| f.seq).collect::<Vec<_>>();
    let get = |path: String| {
        let http = srv.http.clone();
        let url = format!("{}{path}", srv.base);
        async move { http.get(url).send().await.unwrap() }
    };

    let all: Vec<Frame> = get("/v1/sessions/long/export".into())
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(seqs(&all), (1..=total).collect::<Vec<_>>());
    assert_eq!(
        all[41].body,
        FrameBody::UserMessage {
            text: "m42".into(),
            turn_id: None
        }
    );
    let part: Vec<Frame> = get("/v1/sessions/long/export?until=1234".into())
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(seqs(&part), (1..=1234).collect::<Vec<_>>());
    let none: Vec<Frame> = get("/v1/sessions/long/export?until=0".into())
        .await
        .json()
        .await
        .unwrap();
    assert!(none.is_empty());
    let page: Vec<Frame> = get("/v1/sessions/long/frames?after=100&limit=2000".into())
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(seqs(&page), (101..=2100).collect::<Vec<_>>());
    let tail: Vec<Frame> = get("/v1/sessions/long/frames?after=2400&limit=10000".into())
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(seqs(&tail), (2401..=total).collect::<Vec<_>>());
    assert_eq!(get("/v1/sessions/nope/frames".into()).await.status(), 404);

    // SSE from seq 7: every later frame once, then the stream ends (sealed).
    let mut sse = SseReader::new(get("/v1/sessions/long/events?after=7".into()).await);
    let mut got = Vec::new();
    while let Some(event) = tokio::time::timeout(WAIT, sse.next()).await.unwrap() {
        assert_eq!(event.event.as_deref(), Some("frame"));
        let frame: Frame = serde_json::from_str(&event.data).unwrap();
        assert_eq!(event.id, Some(frame.seq.to_string()));
        got.push(frame.seq);
    }
    assert_eq!(got, (8..=total).collect::<Vec<_>>());

    // WebSocket replay from 0.
    let mut socket = ws(&format!(
        "{}/v1/sessions/long/ws?role=client&after=0",
        srv.ws_base
    ))
    .await;
    let mut got = Vec::new();
    while (got.len() as u64) < total {
        match tokio::time::timeout(WAIT, recv(&mut socket)).await.unwrap() {
            Some(ServerMessage::Frame { frame }) => got.push(frame.seq),
            Some(_) => {}
            None => break,
        }
    }
    assert_eq!(got, (1..=total).collect::<Vec<_>>());
}

/// A turn end with a checkpoint, appended as the runner would record it.
async fn turn_end(srv: &TestServer, id: &str, turn: &str, checkpoint: Option<&str>) {
    use harness_core::log::AppendRequest;
    use harness_core::sandbox::SandboxHandle;
    let session = sid(id);
    srv.log
        .append(
            &session,
            AppendRequest::new(FrameBody::UserMessage {
                text: format!("prompt of {turn}"),
                turn_id: Some(turn.into()),
            }),
        )
        .await
        .unwrap();
    srv.log
        .append(
            &session,
            AppendRequest::new(FrameBody::TurnStatus {
                turn_id: turn.into(),
                status: harness_core::turn::TurnStatus::Finished,
                error: None,
                code: None,
                sandbox: Some(SandboxHandle {
                    provider: "local".into(),
                    id: format!("sb-{turn}"),
                    workdir: "/w".into(),
                    owned: true,
                    data: json!({}),
                }),
                agent_session_id: Some(format!("agent-{turn}")),
                checkpoint: checkpoint.map(str::to_string),
            }),
        )
        .await
        .unwrap();
}

#[tokio::test]
async fn forks_carry_the_tree_and_rewinds_go_back_in_place() {
    let srv = start(|_| {}).await;
    srv.create("cp").await;
    turn_end(&srv, "cp", "t1", Some("turns/cp/t1")).await; // seq 1, 2
    turn_end(&srv, "cp", "t2", Some("turns/cp/t2")).await; // seq 3, 4
    turn_end(&srv, "cp", "t3", None).await; // seq 5, 6: no checkpoint
    let post = |path: String| srv.http.post(format!("{}{path}", srv.base)).send();

    // A fork at turn 1's end, on Docker: its next turn makes a Docker
    // sandbox from turn 1's checkpoint and resumes turn 1's agent session.
    let r = post("/v1/sessions/cp/fork?until=2&provider=docker&target=f1".into())
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let info: LogInfo = r.json().await.unwrap();
    assert_eq!(
        info.meta.sandbox, None,
        "the fork never shares the parent's sandbox"
    );
    assert_eq!(info.meta.checkpoint.as_deref(), Some("turns/cp/t1"));
    assert_eq!(info.meta.agent_session_id.as_deref(), Some("agent-t1"));
    assert_eq!(info.meta.config_or_default().sandbox.provider, "docker");
    // Two forks of one point side by side.
    let r = post("/v1/sessions/cp/fork?until=3&target=f2".into())
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let f2: LogInfo = r.json().await.unwrap();
    assert_eq!(f2.meta.checkpoint.as_deref(), Some("turns/cp/t1"));
    // Past turn 3, which ended without a checkpoint: refused, nothing made.
    let r = post("/v1/sessions/cp/fork?until=6&target=f3".into())
        .await
        .unwrap();
    assert_eq!(r.status(), 409);
    let body: Value = r.json().await.unwrap();
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("turn t3 ended without a checkpoint"),
        "{body}"
    );
    assert!(
        srv.log.info(&sid("f3")).await.is_err(),
        "a refused fork left a session"
    );

    // Rewind in place: needs a turn, a checkpoint, a host token.
    let r = post("/v1/sessions/cp/rewind".into()).await.unwrap();
    assert_eq!(r.status(), 400);
    let r = post("/v1/sessions/cp/rewind?turn=t3".into()).await.unwrap();
    assert_eq!(r.status(), 400);
    let body: Value = r.json().await.unwrap();
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("turns with one: t1, t2"),
        "{body}"
    );
    let before = srv.log.info(&sid("cp")).await.unwrap().last_seq;
    let r = post("/v1/sessions/cp/rewind?turn=t1".into()).await.unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    let info = srv.log.info(&sid("cp")).await.unwrap();
    assert_eq!(info.last_seq, before + 1, "one frame records the rewind");
    assert_eq!(info.meta.sandbox, None);
    assert_eq!(info.meta.checkpoint.as_deref(), Some("turns/cp/t1"));
    assert_eq!(info.meta.agent_session_id.as_deref(), Some("agent-t1"));
    // The log keeps its history: turn 2 may still be gone back to.
    let r = post("/v1/sessions/cp/rewind?turn=t2".into()).await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(
        srv.log
            .info(&sid("cp"))
            .await
            .unwrap()
            .meta
            .checkpoint
            .as_deref(),
        Some("turns/cp/t2")
    );
    // While a turn runs: refused with turn_in_progress, nothing stored.
    assert_eq!(prompt(&srv, "cp", "a running turn").await.status(), 200);
    let before = srv.log.info(&sid("cp")).await.unwrap().last_seq;
    let r = post("/v1/sessions/cp/rewind?turn=t1".into()).await.unwrap();
    assert_eq!(r.status(), 409);
    assert_eq!(error_code(r).await, "turn_in_progress");
    assert_eq!(srv.log.info(&sid("cp")).await.unwrap().last_seq, before);
}

#[tokio::test]
async fn a_client_token_may_not_rewind() {
    let srv = start(|c| {
        c.insecure_no_auth = false;
        c.tokens = vec![TokenGrant::new(
            "client-token",
            Scope::parse("cp").unwrap(),
            GrantRole::Client,
        )];
    })
    .await;
    srv.log.create(&sid("cp")).await.unwrap();
    turn_end(&srv, "cp", "t1", Some("turns/cp/t1")).await;
    for (path, body) in [
        ("/v1/sessions/cp/rewind?turn=t1", None),
        (
            "/v1/sessions/cp/messages",
            Some(json!({"type": "rewind", "turnId": "t1"})),
        ),
    ] {
        let mut req = srv
            .http
            .post(format!("{}{path}", srv.base))
            .bearer_auth("client-token");
        if let Some(body) = body {
            req = req.json(&body);
        }
        let r = req.send().await.unwrap();
        assert_eq!(r.status(), 403, "{path}");
    }
    assert_eq!(srv.log.info(&sid("cp")).await.unwrap().last_seq, 2);
}

/// `GET /v1/sessions/{id}/verify`: the walk of the session's audit chain
/// with the server's key. Intact after a turn's frames and a fork; a
/// server holding another key than the one the log was written with finds
/// the chain broken at frame 1 (200, `intact: false`, said in words).
#[tokio::test]
async fn verify_walks_the_audit_chain_with_the_servers_key() {
    let key = harness_core::log::ChainKey::new(*b"the server's audit key");
    let dir = tempfile::tempdir().unwrap();
    let log = std::sync::Arc::new(
        session_log::SqliteSessionLog::open(dir.path().join("log.db"))
            .unwrap()
            .with_chain_key(key.clone()),
    );
    let srv = start(|config| {
        config.log = log.clone();
        config.chain_key = key.clone();
    })
    .await;
    srv.create("audited").await;
    assert_eq!(prompt(&srv, "audited", "m1").await.status(), 200);
    for i in 2..=4 {
        assert_eq!(say(&srv, "audited", &format!("m{i}")).await.status(), 200);
    }
    let last = log.info(&sid("audited")).await.unwrap().last_seq;
    let get = |id: &str| {
        srv.http
            .get(format!("{}/v1/sessions/{id}/verify", srv.base))
            .send()
    };
    let r = get("audited").await.unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["intact"], true, "{v}");
    assert_eq!(v["frames"].as_u64(), Some(last), "{v}");
    assert_eq!(v["head"].as_str().map(str::len), Some(64), "{v}");
    let r = srv
        .http
        .post(format!(
            "{}/v1/sessions/audited/fork?until=2&target=audited-fork",
            srv.base
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let v: Value = get("audited-fork").await.unwrap().json().await.unwrap();
    assert_eq!(
        v["intact"], true,
        "a fork continues its parent's chain: {v}"
    );
    assert_eq!(get("nobody").await.unwrap().status(), 404);

    // The same log, read by a server holding another key.
    let other = start(|config| {
        config.log = log.clone();
        config.chain_key = harness_core::log::ChainKey::new(*b"some other key");
    })
    .await;
    let v: Value = other
        .http
        .get(format!("{}/v1/sessions/audited/verify", other.base))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["intact"], false, "{v}");
    assert_eq!(v["broken"]["kind"], "mismatch", "{v}");
    assert_eq!(v["broken"]["seq"], 1, "{v}");
    assert!(
        v["problem"]
            .as_str()
            .unwrap()
            .contains("frame 1 does not match"),
        "{v}"
    );
}

/// `GET /export?format=markdown` on a cut: only the frames up to `until`
/// are in the document; an unknown format is a 400.
#[tokio::test]
async fn export_as_markdown_honours_until() {
    let srv = start(|_| {}).await;
    srv.create("md").await;
    assert_eq!(prompt(&srv, "md", "the first prompt").await.status(), 200);
    let r = srv
        .http
        .get(format!(
            "{}/v1/sessions/md/export?format=md&until=1",
            srv.base
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.headers()["content-type"],
        session_server::markdown::MARKDOWN_CONTENT_TYPE
    );
    let document = r.text().await.unwrap();
    assert!(document.contains("frames 1..=1"), "{document}");
    assert!(
        document.contains("## User (t1)\n\nthe first prompt"),
        "{document}"
    );
    let r = srv
        .http
        .get(format!("{}/v1/sessions/md/export?format=csv", srv.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    assert_eq!(error_code(r).await, "invalid");
}

/// `GET /v1/search`: prompts stored through the API are found at once,
/// naming session and seq, with a filter; bad input (no words, an unknown
/// filter, a bad limit) is a 400 saying why; a session's client cannot
/// search across sessions (403), a host can.
#[tokio::test]
async fn search_finds_frames_across_sessions_and_refuses_bad_queries() {
    let srv = start(|c| {
        c.insecure_no_auth = false;
        c.tokens = vec![
            TokenGrant::new("host", Scope::All, GrantRole::Host),
            TokenGrant::new("client-a", Scope::parse("sa").unwrap(), GrantRole::Client),
        ];
    })
    .await;
    let h = &srv.http;
    let base = &srv.base;
    for (id, agent) in [("sa", "claude-code"), ("sb", "codex")] {
        let r = h
            .post(format!("{base}/v1/sessions"))
            .bearer_auth("host")
            .json(&json!({"id": id, "agent": agent}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 201);
        let r = h
            .post(format!("{base}/v1/sessions/{id}/messages"))
            .bearer_auth("host")
            .json(&json!({"type": "prompt", "text": format!("rename the walrus module in {id}")}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    }
    let search = |query: &str, token: &str| {
        h.get(format!("{base}/v1/search?{query}"))
            .bearer_auth(token)
            .send()
    };
    // The index is written after the commit (docs/search.md): within a
    // second.
    let started = std::time::Instant::now();
    let hits = loop {
        let r = search("q=walrus+module", "host").await.unwrap();
        assert_eq!(r.status(), 200);
        let hits: Vec<Value> = r.json().await.unwrap();
        if hits.len() == 2 || started.elapsed() > std::time::Duration::from_secs(2) {
            break hits;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    let mut found: Vec<(String, u64)> = hits
        .iter()
        .map(|h| {
            (
                h["session"].as_str().unwrap().to_string(),
                h["seq"].as_u64().unwrap(),
            )
        })
        .collect();
    found.sort();
    let seq = |id: &str| {
        let log = srv.log.clone();
        let id = sid(id);
        async move {
            log.read(&id, 0, 100)
                .await
                .unwrap()
                .iter()
                .find(|f| matches!(f.body, harness_core::frame::FrameBody::UserMessage { .. }))
                .unwrap()
                .seq
        }
    };
    assert_eq!(
        found,
        [
            ("sa".to_string(), seq("sa").await),
            ("sb".to_string(), seq("sb").await)
        ]
    );
    assert_eq!(hits[0]["kind"], "prompt");
    let r = search("q=walrus&agent=codex", "host").await.unwrap();
    let hits: Vec<Value> = r.json().await.unwrap();
    assert_eq!(hits.len(), 1);
    assert_eq!(hits[0]["session"], "sb");

    for (query, why) in [
        ("", "q="),
        ("q=%21%21", "nothing to search for"),
        ("q=walrus&color=red", "unknown search parameter"),
        ("q=walrus&limit=0", "limit"),
        ("q=walrus&after=x", "not a number"),
    ] {
        let r = search(query, "host").await.unwrap();
        assert_eq!(r.status(), 400, "{query}");
        let v: Value = r.json().await.unwrap();
        assert!(v.to_string().contains(why), "{query}: {v}");
    }
    assert_eq!(search("q=walrus", "client-a").await.unwrap().status(), 403);
    assert_eq!(search("q=walrus", "nobody").await.unwrap().status(), 401);
}

/// Retention over HTTP (`docs/retention.md`): `POST /trim` cuts a log's
/// start — the info names the cut, frames and events from inside it are
/// 410 Gone, a reader from the start gets what is kept, export starts at
/// the cut, verify holds from it; a bad cut is a 400 and changes nothing.
/// `DELETE` removes a session (204, then 404 and gone from the list and
/// search), is refused while a turn runs (409), and needs a host (403).
#[tokio::test]
async fn trim_answers_gone_and_delete_removes_a_session() {
    let srv = start(|c| {
        c.insecure_no_auth = false;
        c.tokens = vec![
            TokenGrant::new("host", Scope::All, GrantRole::Host),
            TokenGrant::new("client", Scope::parse("rt").unwrap(), GrantRole::Client),
        ];
    })
    .await;
    let (h, base) = (&srv.http, &srv.base);
    let r = h
        .post(format!("{base}/v1/sessions"))
        .bearer_auth("host")
        .json(&json!({"id": "rt"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let id = sid("rt");
    for i in 1..=6 {
        srv.log
            .append(
                &id,
                harness_core::log::AppendRequest::new(FrameBody::Message {
                    turn_id: "t0".into(),
                    id: format!("m{i}"),
                    kind: harness_core::frame::MessageKind::Text,
                    text: format!("pangolin {i}"),
                    interrupted: false,
                }),
            )
            .await
            .unwrap();
    }
    let trim = |body: Value, token: &'static str| {
        h.post(format!("{base}/v1/sessions/rt/trim"))
            .bearer_auth(token)
            .json(&body)
            .send()
    };
    for (body, why) in [
        (json!({"through": 6}), "keeps at least the newest"),
        (json!({"through": 0}), "keeps at least the newest"),
        (json!({"thru": 2}), "through"),
        (json!({"through": "2"}), "through"),
    ] {
        let r = trim(body.clone(), "host").await.unwrap();
        assert_eq!(r.status(), 400, "{body}");
        let v: Value = r.json().await.unwrap();
        assert!(v.to_string().contains(why), "{body}: {v}");
    }
    assert_eq!(srv.log.read(&id, 0, 100).await.unwrap().len(), 6);
    assert_eq!(
        trim(json!({"through": 3}), "client")
            .await
            .unwrap()
            .status(),
        403
    );
    let r = trim(json!({"through": 3}), "host").await.unwrap();
    assert_eq!(r.status(), 200);
    let info: LogInfo = r.json().await.unwrap();
    assert_eq!(info.trimmed.map(|c| c.through), Some(3));
    assert_eq!(info.last_seq, 6);

    let get = |path: String| h.get(format!("{base}{path}")).bearer_auth("host").send();
    let r = get("/v1/sessions/rt/frames?after=1".into()).await.unwrap();
    assert_eq!(r.status(), 410);
    assert!(r.text().await.unwrap().contains("removed by retention"));
    let r = get("/v1/sessions/rt/frames?after=3".into()).await.unwrap();
    let frames: Vec<Frame> = r.json().await.unwrap();
    assert_eq!(frames.iter().map(|f| f.seq).collect::<Vec<_>>(), [4, 5, 6]);
    let r = get("/v1/sessions/rt/export".into()).await.unwrap();
    let frames: Vec<Frame> = r.json().await.unwrap();
    assert_eq!(
        frames.first().map(|f| f.seq),
        Some(4),
        "export starts at the cut"
    );
    let r = get("/v1/sessions/rt/verify".into()).await.unwrap();
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["intact"], true, "{v}");
    let r = h
        .get(format!("{base}/v1/sessions/rt/events"))
        .bearer_auth("host")
        .header("last-event-id", "2")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 410, "resuming inside the cut");
    // From the start: the kept frames, the first being 4.
    let mut r = h
        .get(format!("{base}/v1/sessions/rt/events"))
        .bearer_auth("host")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let mut text = String::new();
    while !text.contains("pangolin 6") {
        let chunk = tokio::time::timeout(std::time::Duration::from_secs(10), r.chunk())
            .await
            .expect("events within 10 s")
            .unwrap()
            .expect("the stream stays open");
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
    assert!(
        text.contains("id: 4\n") && !text.contains("pangolin 3"),
        "{text}"
    );
    drop(r);

    // Delete: a host only; refused while a turn runs.
    let delete = |id: &'static str, token: &'static str| {
        h.delete(format!("{base}/v1/sessions/{id}"))
            .bearer_auth(token)
            .send()
    };
    assert_eq!(delete("rt", "client").await.unwrap().status(), 403);
    let r = h
        .post(format!("{base}/v1/sessions/rt/messages"))
        .bearer_auth("host")
        .json(&json!({"type": "prompt", "text": "keep going"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = delete("rt", "host").await.unwrap();
    assert_eq!(r.status(), 409);
    assert!(r.text().await.unwrap().contains("turn running"));
    let r = h
        .post(format!("{base}/v1/sessions"))
        .bearer_auth("host")
        .json(&json!({"id": "gone"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    // A client connected to it is told it was deleted (not that the
    // session moved to another node: there is nothing to reconnect to).
    let mut watcher = ws(&format!(
        "{}/v1/sessions/gone/ws?access_token=host",
        srv.ws_base
    ))
    .await;
    assert_eq!(delete("gone", "host").await.unwrap().status(), 204);
    let close = loop {
        let msg = tokio::time::timeout(
            std::time::Duration::from_secs(10),
            futures::StreamExt::next(&mut watcher),
        )
        .await
        .expect("the deleted session's socket closes within 10 s");
        match msg {
            Some(Ok(tokio_tungstenite::tungstenite::Message::Close(frame))) => break frame,
            Some(Ok(_)) => {}
            other => panic!("the socket ended without a close frame: {other:?}"),
        }
    };
    let reason = close.map(|f| f.reason.to_string()).unwrap_or_default();
    assert!(
        reason.contains("was deleted") && !reason.contains("another node"),
        "{reason:?}"
    );
    assert_eq!(get("/v1/sessions/gone".into()).await.unwrap().status(), 404);
    assert_eq!(delete("gone", "host").await.unwrap().status(), 404);
    let list: Value = get("/v1/sessions".into())
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(!list.to_string().contains("\"gone\""), "{list}");
}

/// The server's retention pass (`--retain-sessions 1`): of four sessions,
/// the most recently active is kept, and so is an older one whose turn is
/// running; the two other idle ones are deleted, in one pass.
#[tokio::test]
async fn retention_keeps_the_newest_and_the_running_and_deletes_the_rest() {
    let srv = start(|_| {}).await;
    for id in ["r-old", "r-busy", "r-mid", "r-new"] {
        srv.create(id).await;
        // Activity in this order, each at least a millisecond apart.
        srv.log
            .append(
                &sid(id),
                harness_core::log::AppendRequest::new(FrameBody::Message {
                    turn_id: "t0".into(),
                    id: "m".into(),
                    kind: harness_core::frame::MessageKind::Text,
                    text: format!("hello from {id}"),
                    interrupted: false,
                }),
            )
            .await
            .unwrap();
        if id == "r-busy" {
            srv.log
                .append(
                    &sid(id),
                    harness_core::log::AppendRequest::new(FrameBody::UserMessage {
                        text: "a long turn".into(),
                        turn_id: None,
                    }),
                )
                .await
                .unwrap();
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    // Keep one: r-new by activity; r-busy only because its turn runs.
    let policy = harness_core::log::RetentionPolicy {
        max_idle_ms: None,
        keep_sessions: Some(1),
    };
    let pass = srv
        .server
        .spawn_retention(policy, std::time::Duration::from_secs(3600));
    let started = std::time::Instant::now();
    let remaining = loop {
        let ids: Vec<String> = srv
            .log
            .list()
            .await
            .unwrap()
            .into_iter()
            .map(|i| i.session.to_string())
            .collect();
        if ids.len() <= 2 || started.elapsed() > std::time::Duration::from_secs(10) {
            break ids;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    pass.abort();
    assert_eq!(
        remaining,
        ["r-busy", "r-new"],
        "kept: the newest and the running"
    );
}
