//! The AI SDK chat endpoint (`/v1/chat`, `docs/ai-sdk.md` "useChat") over
//! a real server and SQLite log, with this test as the session's runner
//! (WebSocket): a prompt's stream, a retried POST, a second prompt, the
//! resume stream and its 204, approvals (the stream pausing at a request
//! and a second request continuing it), the history as `UIMessage[]`, and
//! bad input refused with nothing stored. The real agents and the real
//! `ai` package drive the same endpoint in `harness-cli`'s `tests/chat.rs`.

mod common;

use common::*;
use harness_core::actor::ServerMessage;
use serde_json::{json, Value};

fn user(id: &str, text: &str) -> Value {
    json!({"id": id, "role": "user", "parts": [{"type": "text", "text": text}]})
}

fn chat_body(session: &str, messages: Vec<Value>) -> Value {
    json!({"id": session, "messages": messages, "trigger": "submit-message"})
}

async fn post_chat(srv: &TestServer, body: &Value) -> reqwest::Response {
    srv.http
        .post(format!("{}/v1/chat", srv.base))
        .json(body)
        .send()
        .await
        .unwrap()
}

/// Every chunk of a UI message stream, up to `[DONE]`.
async fn chunks(response: reqwest::Response) -> Vec<Value> {
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["x-vercel-ai-ui-message-stream"], "v1");
    let mut reader = SseReader::new(response);
    let mut out = Vec::new();
    loop {
        let ev = reader
            .next()
            .await
            .expect("the stream ended without [DONE]");
        if ev.data == "[DONE]" {
            break;
        }
        out.push(serde_json::from_str::<Value>(&ev.data).unwrap());
    }
    assert!(reader.next().await.is_none(), "nothing after [DONE]");
    out
}

fn types(chunks: &[Value]) -> Vec<&str> {
    chunks.iter().map(|c| c["type"].as_str().unwrap()).collect()
}

async fn error_of(response: reqwest::Response) -> (u16, String, String) {
    let status = response.status().as_u16();
    let body: Value = response.json().await.unwrap();
    (
        status,
        body["error"]["code"].as_str().unwrap_or("").to_string(),
        body["error"]["message"].as_str().unwrap_or("").to_string(),
    )
}

async fn runner(srv: &TestServer, session: &str) -> Ws {
    ws(&format!(
        "{}/v1/sessions/{session}/ws?role=runner&generation=1",
        srv.ws_base
    ))
    .await
}

/// Send parts one after the other as the runner.
async fn parts<const N: usize>(ws: &mut Ws, turn: &str, parts: [Value; N]) {
    for p in parts {
        part(ws, turn, p).await;
    }
}

/// Send a part as the runner and wait for its one answer (`received` for
/// a live text part, else the ack).
async fn part(ws: &mut Ws, turn: &str, part: Value) {
    send(ws, json!({"type": "part", "turnId": turn, "part": part})).await;
    loop {
        match recv(ws).await.expect("the runner's socket closed") {
            ServerMessage::Ack { .. } | ServerMessage::Received {} => return,
            ServerMessage::Error { code, message } => panic!("{code:?}: {message}"),
            _ => {}
        }
    }
}

async fn status(ws: &mut Ws, turn: &str, status: &str) {
    let key = format!("{turn}:status:{status}");
    send(
        ws,
        json!({"type": "turn-status", "turnId": turn, "status": status, "key": key}),
    )
    .await;
    let mut seen = Vec::new();
    let _ = answer(ws, &mut seen).await;
}

/// `GET path`, its JSON body.
async fn get_json(srv: &TestServer, path: &str) -> Value {
    srv.http
        .get(format!("{}{path}", srv.base))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

async fn count_frames(srv: &TestServer, session: &str, kind: &str) -> usize {
    let frames = get_json(srv, &format!("/v1/sessions/{session}/export")).await;
    let frames = frames.as_array().unwrap();
    frames.iter().filter(|f| f["body"]["type"] == kind).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_streams_its_turn_and_a_retried_post_starts_nothing_new() {
    let srv = start(|_| {}).await;
    srv.create("c").await;
    let first = chat_body("c", vec![user("m1", "hello")]);
    let response = post_chat(&srv, &first).await;
    let mut run = runner(&srv, "c").await;
    parts(
        &mut run,
        "t1",
        [
            json!({"type": "stream-start"}),
            json!({"type": "text-start", "id": "b"}),
            json!({"type": "text-delta", "id": "b", "delta": "Hel"}),
            json!({"type": "text-delta", "id": "b", "delta": "lo"}),
            json!({"type": "text-end", "id": "b"}),
            json!({"type": "tool-call", "toolCallId": "c1", "toolName": "Bash", "input": {"command": "ls"}}),
            json!({"type": "tool-result", "toolCallId": "c1", "toolName": "Bash", "output": "a.txt"}),
            json!({"type": "finish", "finishReason": "end_turn"}),
        ],
    )
    .await;
    status(&mut run, "t1", "finished").await;
    let live = chunks(response).await;
    assert_eq!(
        types(&live),
        [
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
    assert_eq!(live[0]["messageId"], "t1-assistant");
    assert_eq!(
        live[9],
        json!({"type": "finish", "finishReason": "stop",
               "messageMetadata": {"turnId": "t1", "status": "finished"}})
    );
    // The same POST again: no second prompt, the same turn replayed.
    let prompts = count_frames(&srv, "c", "user-message").await;
    let last = srv.last_seq("c").await;
    let again = chunks(post_chat(&srv, &first).await).await;
    assert_eq!(count_frames(&srv, "c", "user-message").await, prompts);
    assert_eq!(srv.last_seq("c").await, last, "a retry stores nothing");
    assert_eq!(again[0]["messageId"], "t1-assistant");
    let text: String = again
        .iter()
        .filter(|c| c["type"] == "text-delta")
        .map(|c| c["delta"].as_str().unwrap())
        .collect();
    assert_eq!(text, "Hello");
    // No turn runs: the resume stream has nothing.
    let r = srv
        .http
        .get(format!("{}/v1/chat/c/stream", srv.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);

    // A second prompt (the client sends its whole history; only the new
    // message counts) opens t2; a third while t2 runs is refused.
    let second = chat_body(
        "c",
        vec![
            user("m1", "hello"),
            // useChat sends the whole conversation, over the frame limit
            // here: only the last message is read.
            json!({"id": "t1-assistant", "role": "assistant",
                   "parts": [{"type": "text", "text": "x".repeat(3 << 20)}]}),
            user("m2", "more"),
        ],
    );
    let response = post_chat(&srv, &second).await;
    parts(
        &mut run,
        "t2",
        [
            json!({"type": "text-start", "id": "x"}),
            json!({"type": "text-delta", "id": "x", "delta": "partial "}),
        ],
    )
    .await;
    let last = srv.last_seq("c").await;
    let (code, err, message) =
        error_of(post_chat(&srv, &chat_body("c", vec![user("m3", "busy?")])).await).await;
    assert_eq!((code, err.as_str()), (409, "turn_in_progress"), "{message}");
    assert!(message.contains("t2 is still running"), "{message}");
    assert_eq!(
        srv.last_seq("c").await,
        last,
        "the refused prompt is not stored"
    );
    // A reader arriving mid-turn (a reload) gets the turn so far, then the
    // rest, each part once.
    let resumed = srv
        .http
        .get(format!("{}/v1/chat/c/stream", srv.base))
        .send()
        .await
        .unwrap();
    assert_eq!(resumed.status(), 200);
    let history = get_json(&srv, "/v1/chat/c/messages").await;
    parts(
        &mut run,
        "t2",
        [
            json!({"type": "text-delta", "id": "x", "delta": "done"}),
            json!({"type": "text-end", "id": "x"}),
        ],
    )
    .await;
    status(&mut run, "t2", "finished").await;
    for stream in [chunks(response).await, chunks(resumed).await] {
        assert_eq!(stream[0]["messageId"], "t2-assistant");
        let text: String = stream
            .iter()
            .filter(|c| c["type"] == "text-delta")
            .map(|c| c["delta"].as_str().unwrap())
            .collect();
        assert_eq!(text, "partial done", "{stream:?}");
        assert_eq!(
            types(&stream)
                .iter()
                .filter(|t| **t == "text-start")
                .count(),
            1
        );
    }
    // History: the running turn's text was not stored yet, so its
    // assistant message is not there (the resume stream brings it);
    // afterwards every turn is there.
    assert_eq!(history.as_array().unwrap().len(), 3, "{history:#?}");
    assert_eq!(history[2]["id"], "t2-user");
    let history = get_json(&srv, "/v1/chat/c/messages").await;
    let ids: Vec<&str> = history
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["t1-user", "t1-assistant", "t2-user", "t2-assistant"]);
    assert_eq!(history[0]["parts"][0]["text"], "hello");
    assert_eq!(history[1]["parts"][1]["text"], "Hello");
    assert_eq!(history[1]["parts"][2]["state"], "output-available");
    assert_eq!(history[3]["parts"][1]["text"], "partial done");
    assert_eq!(history[3]["metadata"]["status"], "finished");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approval_response_continues_the_paused_stream() {
    let srv = start(|_| {}).await;
    srv.create("a").await;
    let response = post_chat(&srv, &chat_body("a", vec![user("p1", "run ls")])).await;
    let mut run = runner(&srv, "a").await;
    parts(
        &mut run,
        "t1",
        [
            json!({"type": "tool-call", "toolCallId": "c1", "toolName": "Bash", "input": {"command": "ls"}}),
            json!({"type": "tool-approval-request", "approvalId": "ap1", "toolCallId": "c1", "toolName": "Bash", "input": {"command": "ls"}}),
        ],
    )
    .await;
    let first = chunks(response).await;
    assert_eq!(
        types(&first),
        [
            "start",
            "start-step",
            "tool-input-available",
            "tool-approval-request",
            "finish-step",
            "finish"
        ]
    );
    assert_eq!(first[5]["finishReason"], "tool-calls");
    assert_eq!(
        first[5]["messageMetadata"]["status"],
        "awaiting_tool_approval"
    );
    // The resume stream pauses there too.
    let resumed = srv
        .http
        .get(format!("{}/v1/chat/a/stream", srv.base))
        .send()
        .await
        .unwrap();
    assert_eq!(
        types(&chunks(resumed).await).last(),
        Some(&"finish"),
        "a reload sees the request"
    );
    let assistant = |id: &str, approved: bool| {
        json!({"id": "t1-assistant", "role": "assistant", "parts": [
            {"type": "step-start"},
            {"type": "dynamic-tool", "toolName": "Bash", "toolCallId": "c1", "input": {"command": "ls"},
             "state": "approval-responded", "approval": {"id": id, "approved": approved}}]})
    };
    // An answer to no pending request: refused, nothing stored.
    let last = srv.last_seq("a").await;
    let (code, err, message) = error_of(
        post_chat(
            &srv,
            &chat_body("a", vec![user("p1", "run ls"), assistant("nope", true)]),
        )
        .await,
    )
    .await;
    assert_eq!(
        (code, err.as_str()),
        (409, "no_pending_approval"),
        "{message}"
    );
    assert!(message.contains("waits on \"ap1\""), "{message}");
    assert_eq!(srv.last_seq("a").await, last);
    // The answer: stored once even when the POST is retried.
    let approve = chat_body("a", vec![user("p1", "run ls"), assistant("ap1", true)]);
    let continued = post_chat(&srv, &approve).await;
    assert_eq!(continued.status(), 200);
    let retried = post_chat(&srv, &approve).await;
    assert_eq!(retried.status(), 200);
    assert_eq!(count_frames(&srv, "a", "approval-response").await, 1);
    let (code, err, _) = error_of(
        post_chat(
            &srv,
            &chat_body("a", vec![user("p1", "run ls"), assistant("ap1", false)]),
        )
        .await,
    )
    .await;
    assert_eq!((code, err.as_str()), (409, "conflict"));
    part(
        &mut run,
        "t1",
        json!({"type": "tool-result", "toolCallId": "c1", "toolName": "Bash", "output": "a.txt"}),
    )
    .await;
    status(&mut run, "t1", "finished").await;
    for stream in [chunks(continued).await, chunks(retried).await] {
        // Only what follows the request: the client has the rest.
        assert_eq!(
            types(&stream),
            ["start", "tool-output-available", "finish-step", "finish"],
            "{stream:?}"
        );
        assert_eq!(stream[0]["messageId"], "t1-assistant");
    }
    let history = get_json(&srv, "/v1/chat/a/messages").await;
    let tool = &history[1]["parts"][1];
    assert_eq!(tool["state"], "output-available", "{history:#?}");
    assert_eq!(tool["approval"], json!({"id": "ap1", "approved": true}));
    // Once the turn ended, an answer is an error the UI can show.
    let (code, err, _) = error_of(post_chat(&srv, &approve).await).await;
    assert_eq!((code, err.as_str()), (409, "no_active_turn"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_chat_requests_get_clear_errors_and_store_nothing() {
    let srv = start(|c| {
        c.insecure_no_auth = false;
        c.tokens.push(session_server::TokenGrant::new(
            "host",
            session_server::Scope::All,
            session_server::GrantRole::Host,
        ));
        c.tokens.push(session_server::TokenGrant::new(
            "client-b",
            session_server::Scope::Session(sid("b")),
            session_server::GrantRole::Client,
        ));
    })
    .await;
    let created = srv
        .http
        .post(format!("{}/v1/sessions", srv.base))
        .bearer_auth("host")
        .json(&json!({"id": "b"}))
        .send()
        .await
        .unwrap();
    assert_eq!(created.status(), 201);
    let last = srv.last_seq("b").await;
    let post = |body: Value, token: Option<&'static str>| {
        let mut r = srv.http.post(format!("{}/v1/chat", srv.base)).json(&body);
        if let Some(token) = token {
            r = r.bearer_auth(token);
        }
        r.send()
    };
    let cases = [
        (
            json!({"id": "b", "messages": "hi"}),
            Some("client-b"),
            400,
            "invalid",
        ),
        (
            json!({"id": "b", "messages": [{"role": "user", "parts": [{"type": "text", "text": "x"}]}]}),
            Some("client-b"),
            400,
            "invalid",
        ),
        (
            json!({"id": "b", "trigger": "regenerate-message", "messages": [user("m", "x")]}),
            Some("client-b"),
            400,
            "unsupported",
        ),
        (
            chat_body("b", vec![user("m", "x")]),
            None,
            401,
            "unauthorized",
        ),
        (
            chat_body("b", vec![user("m", "x")]),
            Some("wrong"),
            401,
            "unauthorized",
        ),
        (
            chat_body("other", vec![user("m", "x")]),
            Some("client-b"),
            403,
            "forbidden",
        ),
        (
            chat_body("missing", vec![user("m", "x")]),
            Some("host"),
            404,
            "not_found",
        ),
        (
            chat_body(
                "b",
                vec![json!({"id": "t1-assistant", "role": "assistant", "parts": [
            {"type": "dynamic-tool", "toolCallId": "c", "toolName": "Bash", "state": "approval-responded",
             "approval": {"id": "a", "approved": true}}]})],
            ),
            Some("client-b"),
            409,
            "no_active_turn",
        ),
    ];
    for (body, token, status, code) in cases {
        let r = post(body.clone(), token).await.unwrap();
        let (got, got_code, message) = error_of(r).await;
        assert_eq!(
            (got, got_code.as_str()),
            (status, code),
            "{body}: {message}"
        );
        assert!(!message.is_empty());
    }
    // A wrong token is refused before the body is read.
    let r = srv
        .http
        .post(format!("{}/v1/chat", srv.base))
        .bearer_auth("wrong")
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(error_of(r).await.0, 401);
    let r = srv
        .http
        .post(format!("{}/v1/chat", srv.base))
        .bearer_auth("client-b")
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .unwrap();
    let (status, code, message) = error_of(r).await;
    assert_eq!((status, code.as_str()), (400, "invalid"));
    assert!(message.contains("not JSON"), "{message}");
    // Abort and the reads, with the same grants.
    let abort = srv
        .http
        .post(format!("{}/v1/chat/b/abort", srv.base))
        .bearer_auth("client-b")
        .send()
        .await
        .unwrap();
    assert_eq!(error_of(abort).await.1, "no_active_turn");
    let r = srv
        .http
        .get(format!("{}/v1/chat/b/messages", srv.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let r = srv
        .http
        .get(format!("{}/v1/chat/b/messages", srv.base))
        .bearer_auth("client-b")
        .send()
        .await
        .unwrap();
    assert_eq!(r.json::<Value>().await.unwrap(), json!([]));
    assert_eq!(srv.last_seq("b").await, last, "nothing was stored");
}
