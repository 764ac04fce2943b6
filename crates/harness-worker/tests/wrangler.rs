//! The session-API suite against the Worker under `wrangler dev`: the same
//! cases `session-server` passes (crates/session-server/tests/session_api.rs).
//! Needs the built Worker and wrangler (`cargo xtask worker test` builds and
//! runs it; otherwise it skips, or fails under `HARNESS_REQUIRE_REAL=1`).

#![cfg(not(target_arch = "wasm32"))]

use harness_testkit::conformance::session_api::{self, Target, CLIENT, HOST};
use harness_testkit::wrangler::{test_build_with_suite_tokens, WranglerDev};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_worker_speaks_the_session_api() {
    let Some(dev) = test_build_with_suite_tokens().await else {
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
    let worker_dir = harness_testkit::wrangler::test_build();
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
    let worker_dir = harness_testkit::wrangler::test_build();
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
    let worker_dir = harness_testkit::wrangler::test_build();
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

    let worker_dir = harness_testkit::wrangler::test_build();
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

/// The audit chain on the Durable Object: the Worker keys it with its
/// secret `HARNESS_AUDIT_KEY`; `GET /v1/sessions/{id}/verify` walks it.
/// With `wrangler dev` stopped, the objects' SQLite files are edited the
/// way someone holding the storage would: a body changed in one session, a
/// frame deleted in another, every frame from seq 2 on rewritten with
/// recomputed (unkeyed) hashes in a third. After a restart, `verify` names
/// the frame in each; a fork made before keeps its parent's chain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_durable_objects_audit_chain_names_what_was_edited_in_its_storage() {
    use harness_core::log::chain::link;
    use harness_core::log::{ChainKey, FrameHash};
    let worker_dir = harness_testkit::wrangler::test_build();
    let state = std::env::temp_dir().join(format!("harness-worker-audit-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&state);
    let secret = "the worker's audit secret";
    let start = || {
        let state = state.clone();
        let vars = [
            ("HARNESS_TOKENS", session_api::token_table().to_string()),
            ("HARNESS_AUDIT_KEY", secret.to_string()),
        ];
        tokio::task::spawn_blocking(move || {
            WranglerDev::start_with_state(worker_dir, &vars, &state)
        })
    };
    let Some(first) = start().await.expect("start task") else {
        return;
    };
    let t = Target::new(first.base.clone(), "audit");
    let verify = |t: &Target, id: &str| {
        let path = format!("/v1/sessions/{id}/verify");
        let t = t.clone();
        async move { t.get(&path, Some(CLIENT)).await }
    };
    let sessions = ["audit-edit", "audit-delete", "audit-rewrite"];
    for id in sessions {
        t.create(id).await;
        let (status, _) = t
            .message(id, CLIENT, json!({"type": "prompt", "text": "go"}))
            .await;
        assert_eq!(status, 200);
        for i in 0..4 {
            let answer = json!({"type": "approval-response", "approvalId": format!("a{i}"), "approved": true});
            assert_eq!(t.message(id, CLIENT, answer).await.0, 200);
        }
        let (status, v) = verify(&t, id).await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(
            (v["intact"].clone(), v["frames"].clone()),
            (json!(true), json!(5)),
            "{v}"
        );
    }
    let (status, forked) = t
        .post(
            "/v1/sessions/audit-edit/fork?until=3&target=audit-fork",
            Some(HOST),
            json!({}),
        )
        .await;
    assert_eq!(status, 201, "{forked}");
    let (_, v) = verify(&t, "audit-fork").await;
    assert_eq!(
        v["intact"], true,
        "a fork continues its parent's chain: {v}"
    );
    let (status, _) = verify(&t, "audit-nobody").await;
    assert_eq!(status, 404);
    drop(first);

    // The objects' SQLite files, by the session each holds.
    let mut files = std::collections::HashMap::new();
    let mut dirs = vec![state.clone()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap().flatten() {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "sqlite") {
                let db = rusqlite::Connection::open(&path).unwrap();
                let held: Option<String> = db
                    .query_row("SELECT session FROM logs WHERE id = 1", [], |r| r.get(0))
                    .ok();
                if let Some(session) = held {
                    files.insert(session, path);
                }
            }
        }
    }
    let open = |id: &str| {
        let path = files
            .get(id)
            .unwrap_or_else(|| panic!("no SQLite file holds {id}: {files:?}"));
        rusqlite::Connection::open(path).unwrap()
    };
    let changed = open("audit-edit")
        .execute(
            "UPDATE frames SET body = replace(body, '\"a0\"', '\"forged\"') WHERE seq = 2",
            [],
        )
        .unwrap();
    assert_eq!(changed, 1, "frame 2 answers approval a0");
    open("audit-delete")
        .execute("DELETE FROM frames WHERE seq = 3", [])
        .unwrap();
    let db = open("audit-rewrite");
    let mut prev: FrameHash = db
        .query_row("SELECT hash FROM frames WHERE seq = 1", [], |r| {
            r.get::<_, String>(0)
        })
        .map(|h| FrameHash::parse_hex(&h).unwrap())
        .unwrap();
    for seq in 2..=5u64 {
        let (at_ms, body): (i64, String) = db
            .query_row(
                "SELECT at_ms, body FROM frames WHERE seq = ?1",
                [seq as i64],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .unwrap();
        let body = body.replace("\"approved\":true", "\"approved\":false");
        let hash = link(&ChainKey::unkeyed(), &prev, seq, at_ms as u64, None, &body);
        db.execute(
            "UPDATE frames SET body = ?2, hash = ?3 WHERE seq = ?1",
            rusqlite::params![seq as i64, body, hash.to_hex()],
        )
        .unwrap();
        prev = hash;
    }
    db.execute("UPDATE logs SET last_hash = ?1", [prev.to_hex()])
        .unwrap();
    drop(db);

    let Some(second) = start().await.expect("start task") else {
        return;
    };
    let t = Target::new(second.base.clone(), "audit");
    let (_, v) = verify(&t, "audit-edit").await;
    assert_eq!(
        (v["intact"].clone(), v["broken"].clone()),
        (json!(false), json!({"kind": "mismatch", "seq": 2})),
        "{v}"
    );
    let (_, v) = verify(&t, "audit-delete").await;
    assert_eq!(
        v["broken"],
        json!({"kind": "gap", "after": 2, "next": 4}),
        "{v}"
    );
    let (_, v) = verify(&t, "audit-rewrite").await;
    assert_eq!(
        v["broken"],
        json!({"kind": "mismatch", "seq": 2}),
        "a consistent rewrite without the Worker's secret is caught: {v}"
    );
    let (_, v) = verify(&t, "audit-fork").await;
    assert_eq!(v["intact"], true, "the fork kept its own copy: {v}");
    drop(second);
    let _ = std::fs::remove_dir_all(&state);
}

/// Search on the Worker (docs/search.md): each session's Durable Object
/// indexes its frames in its own SQLite (FTS5, with the append), and `GET
/// /v1/search` asks every listed session's object and merges. A prompt is
/// found as soon as its append is answered, naming session and seq; every
/// word must appear; the agent filter narrows; a fork finds its copy;
/// bad input is a 400 saying why; a session's client cannot search across
/// sessions (403).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_worker_searches_across_sessions() {
    let Some(dev) = test_build_with_suite_tokens().await else {
        return;
    };
    let t = Target::new(dev.base.clone(), "search");
    for (id, agent) in [
        ("find-a", "claude-code"),
        ("find-b", "codex"),
        ("find-c", "codex"),
    ] {
        let (status, info) = t
            .post(
                "/v1/sessions",
                Some(HOST),
                json!({"id": id, "agent": agent}),
            )
            .await;
        assert_eq!(status, 201, "{info}");
    }
    let prompt = |id: &'static str, text: &'static str| {
        let t = t.clone();
        async move {
            let (status, ack) = t
                .message(id, HOST, json!({"type": "prompt", "text": text}))
                .await;
            assert_eq!(status, 200, "{ack}");
            ack["seq"].as_u64().expect("the ack names the seq")
        }
    };
    let a = prompt("find-a", "rename the walrus module").await;
    let b = prompt("find-b", "walrus tests in the parser").await;
    prompt("find-c", "nothing to see here").await;
    let search = |query: &'static str, token: &'static str| {
        let t = t.clone();
        async move { t.get(&format!("/v1/search?{query}"), Some(token)).await }
    };
    let hits_of = |v: &serde_json::Value| -> Vec<(String, u64)> {
        let mut hits: Vec<(String, u64)> = v
            .as_array()
            .unwrap_or_else(|| panic!("hits are an array: {v}"))
            .iter()
            .map(|h| {
                (
                    h["session"].as_str().unwrap().to_string(),
                    h["seq"].as_u64().unwrap(),
                )
            })
            .collect();
        hits.sort();
        hits
    };
    let (status, v) = search("q=walrus", HOST).await;
    assert_eq!(status, 200, "{v}\n{}", dev.log_tail());
    assert_eq!(
        hits_of(&v),
        [("find-a".to_string(), a), ("find-b".to_string(), b)],
        "{v}"
    );
    assert!(
        v[0]["snippet"].as_str().unwrap().contains("[walrus]"),
        "{v}"
    );
    assert_eq!(v[0]["kind"], "prompt");
    let (_, v) = search("q=walrus+module", HOST).await;
    assert_eq!(hits_of(&v), [("find-a".to_string(), a)], "every word: {v}");
    let (_, v) = search("q=walrus&agent=codex", HOST).await;
    assert_eq!(
        hits_of(&v),
        [("find-b".to_string(), b)],
        "the agent filter: {v}"
    );
    let (_, v) = search("q=walrus&limit=1", HOST).await;
    assert_eq!(v.as_array().map(Vec::len), Some(1), "the limit: {v}");

    let (status, fork) = t
        .post(
            &format!("/v1/sessions/find-a/fork?until={a}&target=find-fork"),
            Some(HOST),
            json!({}),
        )
        .await;
    assert_eq!(status, 201, "{fork}");
    let (_, v) = search("q=walrus+module", HOST).await;
    let sessions: Vec<String> = hits_of(&v).into_iter().map(|(s, _)| s).collect();
    assert_eq!(
        sessions,
        ["find-a", "find-fork"],
        "a fork finds its copy: {v}"
    );

    for (query, why) in [
        ("q=", "nothing to search for"),
        ("q=walrus&color=red", "unknown search parameter"),
        ("q=walrus&limit=0", "limit"),
    ] {
        let (status, v) = search(query, HOST).await;
        assert_eq!(status, 400, "{query}: {v}");
        assert!(v.to_string().contains(why), "{query}: {v}");
    }
    assert_eq!(search("q=walrus", CLIENT).await.0, 403);

    // Delete (docs/retention.md): a host's, refused while a turn runs (a
    // prompt with no engine stays running); a deleted session is gone from
    // info, the list and search.
    let delete = |id, token| t.delete(id, token);
    assert_eq!(delete("find-c", CLIENT).await.0, 403);
    let (status, v) = delete("find-c", HOST).await;
    assert_eq!(status, 409, "a turn is running: {v}");
    assert!(v.to_string().contains("turn running"), "{v}");
    let (status, fork) = t
        .post(
            "/v1/sessions/find-c/fork?until=1&target=find-idle",
            Some(HOST),
            json!({}),
        )
        .await;
    assert_eq!(status, 201, "{fork}");
    let (_, v) = search("q=nothing+to+see", HOST).await;
    assert_eq!(v.as_array().map(Vec::len), Some(2), "{v}");
    let (status, v) = delete("find-idle", HOST).await;
    assert_eq!(status, 204, "{v}\n{}", dev.log_tail());
    assert_eq!(t.get("/v1/sessions/find-idle", Some(HOST)).await.0, 404);
    assert_eq!(delete("find-idle", HOST).await.0, 404);
    let (_, list) = t.get("/v1/sessions", Some(HOST)).await;
    assert!(!list.to_string().contains("find-idle"), "{list}");
    let (_, v) = search("q=nothing+to+see", HOST).await;
    let sessions: Vec<String> = hits_of(&v).into_iter().map(|(s, _)| s).collect();
    assert_eq!(sessions, ["find-c"], "the deleted fork is not found: {v}");
}

/// The deploy build (`cargo xtask worker build`, no `test-routes`) has no
/// test route, even with the test variables set: the engine API, the
/// stores' routes and the failpoint's switch exist only in the test build.
/// A session route answers, so the 404s are the routes' absence, not a
/// Worker that does not run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_deploy_build_has_no_test_routes() {
    let tokens = session_api::token_table().to_string();
    let vars = [
        ("HARNESS_TOKENS", tokens),
        (
            "HARNESS_TEST_EXECUTOR_URL",
            "http://127.0.0.1:9/executor".to_string(),
        ),
        ("HARNESS_TEST_FAIL_SLICE", "1:1".to_string()),
    ];
    let Some(dev) = tokio::task::spawn_blocking(move || {
        WranglerDev::start(harness_testkit::wrangler::deploy_build(), &vars)
    })
    .await
    .expect("start task") else {
        return;
    };
    let http = reqwest::Client::new();
    let listed = http
        .get(format!("{}/v1/sessions", dev.base))
        .bearer_auth(HOST)
        .send()
        .await
        .unwrap();
    assert_eq!(listed.status(), 200, "the deploy build does not serve");
    for (path, token) in [
        ("/v1/test/engine/wait", session_api::RUNNER),
        ("/v1/test/engine/start", session_api::RUNNER),
        ("/v1/test/log/create?session=deploy-s", HOST),
        ("/v1/test/log/append?session=deploy-s", HOST),
        ("/v1/test/checkpoints/list", HOST),
        ("/v1/test/checkpoints/tamper?key=a", HOST),
    ] {
        let answer = http
            .post(format!("{}{path}", dev.base))
            .bearer_auth(token)
            .json(&json!({}))
            .send()
            .await
            .unwrap();
        let status = answer.status();
        let body = answer.text().await.unwrap_or_default();
        assert_eq!(
            status, 404,
            "the deploy build answers {path} with {status}: {body}"
        );
        assert!(body.contains("no such endpoint"), "{path}: {body}");
    }
}

/// The Cron Trigger's retention pass (`src/retention.rs`), under `wrangler
/// dev --test-scheduled` (miniflare's `/cdn-cgi/handler/scheduled`), with `HARNESS_RETAIN_SESSIONS=2` and
/// `HARNESS_RETAIN_DAYS=1`: of four sessions, a pass now keeps the two most
/// recently active and the one whose turn is running, deleting the oldest;
/// a pass "two days later" deletes every idle one and keeps the running
/// one. Deleted sessions leave the listing and answer 404.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cron_trigger_runs_the_retention_policy() {
    use harness_core::frame::{FrameBody, MessageKind, SessionId};
    use harness_core::log::{AppendRequest, SessionLog};
    use harness_testkit::worker_stores::WorkerLog;

    let tokens = session_api::token_table().to_string();
    let started = tokio::task::spawn_blocking(move || {
        WranglerDev::start(
            harness_testkit::wrangler::test_build(),
            &[
                ("HARNESS_TOKENS", tokens),
                ("HARNESS_RETAIN_SESSIONS", "2".into()),
                ("HARNESS_RETAIN_DAYS", "1".into()),
            ],
        )
    })
    .await
    .unwrap();
    let Some(dev) = started else { return };
    let log = WorkerLog::new(&dev.base, HOST);
    let sid = |id: &str| SessionId::parse(id).unwrap();
    for id in ["r-old", "r-busy", "r-mid", "r-new"] {
        log.create(&sid(id)).await.unwrap();
        let said = AppendRequest::new(FrameBody::Message {
            turn_id: "t0".into(),
            id: "m".into(),
            kind: MessageKind::Text,
            text: format!("hello from {id}"),
            interrupted: false,
        });
        log.append(&sid(id), said).await.unwrap();
        if id == "r-busy" {
            let prompt = AppendRequest::new(FrameBody::UserMessage {
                text: "a long turn".into(),
                turn_id: None,
            });
            log.append(&sid(id), prompt).await.unwrap();
        }
        // Activity in this order.
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let names = |infos: Vec<harness_core::log::LogInfo>| -> Vec<String> {
        infos.into_iter().map(|i| i.session.to_string()).collect()
    };
    let http = reqwest::Client::new();
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let pass = |time_ms: u64| {
        http.get(format!("{}/cdn-cgi/handler/scheduled", dev.base))
            .query(&[("cron", "17 * * * *"), ("time", &time_ms.to_string())])
            .send()
    };
    let answer = pass(now_ms).await.unwrap();
    assert!(
        answer.status().is_success(),
        "{answer:?}\n{}",
        dev.log_tail()
    );
    assert_eq!(
        names(log.list().await.unwrap()),
        ["r-busy", "r-mid", "r-new"],
        "kept: the two newest and the running\n{}",
        dev.log_tail()
    );
    assert!(
        dev.wait_for_log(
            "retention: deleted 1 sessions",
            std::time::Duration::from_secs(10)
        )
        .await,
        "{}",
        dev.log_tail()
    );
    assert_eq!(
        log.info(&sid("r-old")).await.unwrap_err().kind(),
        harness_core::ErrorKind::NotFound
    );

    let answer = pass(now_ms + 2 * 86_400_000).await.unwrap();
    assert!(answer.status().is_success(), "{answer:?}");
    assert_eq!(
        names(log.list().await.unwrap()),
        ["r-busy"],
        "two days later: only the running one\n{}",
        dev.log_tail()
    );
}
