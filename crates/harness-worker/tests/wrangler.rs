//! The session-API suite against the Worker under `wrangler dev`: the same
//! cases `session-server` passes (crates/session-server/tests/session_api.rs).
//! Needs the built Worker and wrangler (`cargo xtask worker test` builds and
//! runs it; otherwise it skips, or fails under `HARNESS_REQUIRE_REAL=1`).

#![cfg(not(target_arch = "wasm32"))]

use std::path::Path;

use harness_testkit::conformance::session_api::{self, Target, CLIENT, HOST};
use harness_testkit::wrangler::WranglerDev;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_worker_speaks_the_session_api() {
    let worker_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let tokens = session_api::token_table().to_string();
    let Some(dev) = tokio::task::spawn_blocking(move || {
        WranglerDev::start(worker_dir, &[("HARNESS_TOKENS", tokens)])
    })
    .await
    .expect("start task") else {
        return;
    };
    let target = Target::new(dev.base.clone(), "w");
    let outcome = tokio::spawn(async move { session_api::run_all(&target).await }).await;
    if let Err(e) = outcome {
        eprintln!("--- wrangler dev ---\n{}", dev.log_tail());
        std::panic::resume_unwind(e.into_panic());
    }
    // The engine API (tests/engine.rs) exists only with its variable set.
    let absent = reqwest::Client::new()
        .post(format!("{}/v1/test/engine/wait", dev.base))
        .bearer_auth(session_api::RUNNER)
        .json(&json!({"session_id": "w-none", "turn_id": "t1"}))
        .send()
        .await
        .unwrap();
    assert_eq!(
        absent.status(),
        404,
        "the engine API answers without HARNESS_TEST_EXECUTOR_URL"
    );
}

/// A session's Durable Object keeps its log in its SQLite, and a new
/// actor recovers from it: after `wrangler dev` is stopped and started
/// again on the same state, the frames, the idempotency keys, the running
/// turn (so a second prompt is still refused) and the seal are all there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_worker_recovers_its_sessions_from_sqlite() {
    let worker_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let state = std::env::temp_dir().join(format!("harness-worker-restart-{}", std::process::id()));
    let start = || {
        let state = state.clone();
        let tokens = session_api::token_table().to_string();
        tokio::task::spawn_blocking(move || {
            WranglerDev::start_with_state(worker_dir, &[("HARNESS_TOKENS", tokens)], &state)
        })
    };
    let Some(first) = start().await.expect("start task") else {
        return;
    };
    let t = Target::new(first.base.clone(), "restart");
    let id = "restart-s";
    t.create(id).await;
    let prompt = json!({"type": "prompt", "text": "before", "key": "k1"});
    let (status, ack) = t.message(id, CLIENT, prompt.clone()).await;
    assert_eq!((status, ack["seq"].clone()), (200, json!(1)), "{ack}");
    let answer = json!({"type": "approval-response", "approvalId": "a", "approved": true});
    assert_eq!(t.message(id, CLIENT, answer.clone()).await.0, 200);
    drop(first);

    let Some(second) = start().await.expect("start task") else {
        return;
    };
    let t = Target::new(second.base.clone(), "restart");
    let info = t.info(id).await;
    assert_eq!(info["last_seq"], 2, "{info}");
    assert_eq!(info["meta"]["turn"]["turn_id"], "t1", "{info}");
    // The key is remembered, the turn still runs.
    let (status, ack) = t.message(id, CLIENT, prompt).await;
    assert_eq!(
        (status, ack["duplicate"].clone(), ack["seq"].clone()),
        (200, json!(true), json!(1))
    );
    let (status, refused) = t
        .message(id, CLIENT, json!({"type": "prompt", "text": "another"}))
        .await;
    assert_eq!(
        (status, refused["error"]["code"].clone()),
        (409, json!("turn_in_progress")),
        "{refused}"
    );
    let (status, ack) = t.message(id, CLIENT, answer).await;
    assert_eq!((status, ack["seq"].clone()), (200, json!(3)));
    let (status, sealed) = t
        .post(&format!("/v1/sessions/{id}/seal"), Some(HOST), json!({}))
        .await;
    assert_eq!((status, sealed["sealed"].clone()), (200, json!(true)));
    drop(second);

    let Some(third) = start().await.expect("start task") else {
        return;
    };
    let t = Target::new(third.base.clone(), "restart");
    assert_eq!(t.info(id).await["sealed"], true);
    let events = t.events_to_end(id, "", None).await;
    let seqs: Vec<&str> = events.iter().filter_map(|e| e.id.as_deref()).collect();
    assert_eq!(seqs, ["1", "2", "3", "4"]);
    let (status, refused) = t
        .message(
            id,
            CLIENT,
            json!({"type": "approval-response", "approvalId": "b", "approved": true}),
        )
        .await;
    assert_eq!(
        (status, refused["error"]["code"].clone()),
        (409, json!("sealed")),
        "{refused}"
    );
    drop(third);
    let _ = std::fs::remove_dir_all(&state);
}

/// The official Durable Streams conformance suite against the Worker's
/// `/v1/stream/*` (the streams object over its SQLite), with the floor
/// `session-server` meets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_worker_passes_the_durable_streams_conformance_suite() {
    use harness_testkit::conformance::durable_streams as suite;
    let Some(dir) = tokio::task::spawn_blocking(suite::available_or_skip)
        .await
        .expect("install task")
    else {
        return;
    };
    let worker_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let Some(dev) = tokio::task::spawn_blocking(move || {
        // The suite sends no token; it waits up to 5 s for a long-poll.
        WranglerDev::start(
            worker_dir,
            &[
                ("HARNESS_INSECURE_NO_AUTH", "1".to_string()),
                ("HARNESS_DS_LONG_POLL_MS", "2000".to_string()),
            ],
        )
    })
    .await
    .expect("start task") else {
        return;
    };
    let base = dev.base.clone();
    let counts = tokio::task::spawn_blocking(move || suite::run(&dir, &base))
        .await
        .expect("suite task");
    if counts.passed < suite::MIN_PASSED || counts.failed > 0 {
        eprintln!("--- wrangler dev ---\n{}", dev.log_tail());
    }
    suite::check("worker (Durable Object SQLite)", &counts);
}

/// Generic streams live in the streams object's SQLite: after `wrangler
/// dev` restarts on the same state, a stream's messages and its producer
/// state (a retried append is still a duplicate, the next seq appends) are
/// there. A body over the Worker's limit gets 413 and writes nothing; a
/// client grant gets 403.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generic_streams_survive_a_restart_and_refuse_oversized_bodies() {
    let worker_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let state = std::env::temp_dir().join(format!("harness-worker-ds-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&state);
    let start = || {
        let state = state.clone();
        tokio::task::spawn_blocking(move || {
            WranglerDev::start_with_state(
                worker_dir,
                &[
                    ("HARNESS_TOKENS", session_api::token_table().to_string()),
                    ("HARNESS_DS_MAX_BODY_BYTES", "4096".to_string()),
                ],
                &state,
            )
        })
    };
    let Some(first) = start().await.expect("start task") else {
        return;
    };
    let http = reqwest::Client::new();
    let url = format!("{}/v1/stream/restart/log", first.base);
    let host = format!("Bearer {HOST}");
    let client = format!("Bearer {CLIENT}");

    // A client grant may not touch generic streams; nothing is created.
    let refused = http
        .put(&url)
        .header("authorization", &client)
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 403);
    let created = http
        .put(&url)
        .header("authorization", &host)
        .header("content-type", "text/plain")
        .send()
        .await
        .unwrap();
    assert_eq!(created.status(), 201);
    let append = |seq: u64, body: &'static str| {
        http.post(&url)
            .header("authorization", &host)
            .header("content-type", "text/plain")
            .header("producer-id", "p")
            .header("producer-epoch", "0")
            .header("producer-seq", seq.to_string())
            .body(body)
            .send()
    };
    assert_eq!(append(0, "one ").await.unwrap().status(), 200);
    assert_eq!(append(1, "two").await.unwrap().status(), 200);
    let oversized = http
        .post(&url)
        .header("authorization", &host)
        .header("content-type", "text/plain")
        .body(vec![b'x'; 5000])
        .send()
        .await
        .unwrap();
    assert_eq!(oversized.status(), 413);
    drop(first);

    let Some(second) = start().await.expect("start task") else {
        return;
    };
    let url = format!("{}/v1/stream/restart/log", second.base);
    let post = |seq: &str, body: &'static str| {
        http.post(&url)
            .header("authorization", &host)
            .header("content-type", "text/plain")
            .header("producer-id", "p")
            .header("producer-epoch", "0")
            .header("producer-seq", seq)
            .body(body)
            .send()
    };
    // Seq 1 is remembered: its retry is a duplicate, seq 2 appends.
    assert_eq!(post("1", "two").await.unwrap().status(), 204);
    assert_eq!(post("2", " three").await.unwrap().status(), 200);
    let read = http
        .get(format!("{url}?offset=-1"))
        .header("authorization", &host)
        .send()
        .await
        .unwrap();
    assert_eq!(read.status(), 200);
    assert_eq!(read.text().await.unwrap(), "one two three");
    drop(second);
    let _ = std::fs::remove_dir_all(&state);
}

/// A live SSE reader that stops reading falls behind; more than
/// `HARNESS_MAX_QUEUED` messages behind (8 here, 10,000 by default), the
/// object drops it instead of queueing without bound: its stream ends
/// before the last frame. It resumes from its `Last-Event-ID` and gets
/// the rest, so nothing is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_too_far_behind_is_dropped_and_resumes() {
    use futures::{SinkExt, StreamExt};
    use std::time::Duration;
    use tokio_tungstenite::tungstenite::Message;

    let worker_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let tokens = session_api::token_table().to_string();
    let Some(dev) = tokio::task::spawn_blocking(move || {
        WranglerDev::start(
            worker_dir,
            &[
                ("HARNESS_TOKENS", tokens),
                ("HARNESS_MAX_QUEUED", "8".into()),
            ],
        )
    })
    .await
    .expect("start task") else {
        return;
    };
    let t = Target::new(dev.base.clone(), "lag");
    let id = "lag-behind";
    t.create(id).await;
    let (status, ack) = t
        .message(id, CLIENT, json!({"type": "prompt", "text": "go"}))
        .await;
    assert_eq!(status, 200, "{ack}");
    let events = |extra: Option<u64>| {
        let request = reqwest::Client::new()
            .get(format!("{}/v1/sessions/{id}/events?after=0", dev.base))
            .bearer_auth(CLIENT);
        match extra {
            Some(last) => request.header("last-event-id", last.to_string()),
            None => request,
        }
        .send()
    };
    // Connected, then not read while the runner writes ~20 MB: more than
    // the sockets between hold, so the object's queue for it grows.
    let slow = events(None).await.unwrap();
    assert_eq!(slow.status(), 200);
    let mut runner = t
        .socket(id, "role=runner&generation=1", session_api::RUNNER)
        .await
        .expect("the runner connects");
    let blob = "x".repeat(200_000);
    const PARTS: u64 = 100;
    for n in 0..PARTS {
        let part = json!({"type": "part", "turnId": "t1", "key": format!("p{n}"),
            "part": {"type": "tool-call", "toolCallId": format!("c{n}"), "toolName": "Bash",
                     "input": {"blob": blob}}});
        runner
            .send(Message::Text(part.to_string().into()))
            .await
            .unwrap();
        loop {
            let reply = tokio::time::timeout(Duration::from_secs(30), runner.next())
                .await
                .expect("an ack in time")
                .expect("the socket is open")
                .unwrap();
            if let Message::Text(text) = reply {
                let reply: serde_json::Value = serde_json::from_str(text.as_str()).unwrap();
                assert_eq!(reply["type"], "ack", "{reply}");
                break;
            }
        }
    }
    let last_seq = t.info(id).await["last_seq"].as_u64().unwrap();
    assert!(last_seq > PARTS, "{last_seq}");

    // Read what the slow reader was sent: its stream ends early.
    let ids_in = |text: &str| -> Vec<u64> {
        text.lines()
            .filter_map(|l| l.strip_prefix("id:"))
            .filter_map(|v| v.trim().parse().ok())
            .collect()
    };
    let mut body = slow.bytes_stream();
    let mut text = String::new();
    let ended = loop {
        match tokio::time::timeout(Duration::from_secs(10), body.next()).await {
            Ok(Some(chunk)) => text.push_str(&String::from_utf8_lossy(&chunk.unwrap())),
            Ok(None) => break true,
            Err(_) => break false,
        }
    };
    let got = ids_in(&text);
    assert!(
        ended,
        "the slow reader was not dropped: its stream stayed open after {} of {last_seq} frames",
        got.len()
    );
    let last_got = got.last().copied().unwrap_or(0);
    assert!(
        last_got < last_seq,
        "the dropped reader still got every frame ({last_got} of {last_seq})"
    );
    assert!(
        got.windows(2).all(|w| w[1] == w[0] + 1),
        "the reader's frames have a gap: {got:?}"
    );

    // It resumes where it was: the rest arrives, once each.
    let resumed = events(Some(last_got)).await.unwrap();
    let mut body = resumed.bytes_stream();
    let mut text = String::new();
    let mut rest = Vec::new();
    while rest.last().copied().unwrap_or(last_got) < last_seq {
        let chunk = tokio::time::timeout(Duration::from_secs(30), body.next())
            .await
            .expect("the rest in time")
            .expect("the resumed stream stays open")
            .unwrap();
        text.push_str(&String::from_utf8_lossy(&chunk));
        rest = ids_in(&text);
    }
    let want: Vec<u64> = (last_got + 1..=last_seq).collect();
    assert_eq!(rest, want, "the resumed reader's frames");
    drop(dev);
}
