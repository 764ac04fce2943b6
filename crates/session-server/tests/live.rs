//! The actor over WebSocket and SSE: ordering, fan-out, text folding,
//! fencing, resume.

mod common;

use common::*;
use harness_core::actor::ServerMessage;
use harness_core::frame::{Frame, FrameBody, MessageKind};
use harness_core::log::SessionLog;
use harness_core::StreamPart;
use serde_json::json;

fn part(turn: &str, part: serde_json::Value) -> serde_json::Value {
    json!({"type": "part", "turnId": turn, "part": part})
}

fn frames_of(msgs: &[ServerMessage]) -> Vec<Frame> {
    msgs.iter()
        .filter_map(|m| match m {
            ServerMessage::Frame { frame } => Some(frame.clone()),
            _ => None,
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundred_clients_see_the_same_gap_free_sequence_while_a_runner_streams() {
    let srv = start(|_| {}).await;
    srv.create("s").await;
    // One turn runs; each client registers by storing an answer in it and
    // waiting for its ack; they all ask for the whole history, so frames
    // stored before they joined come as replay.
    post_prompt(&srv, "s", "go").await;
    let mut clients = Vec::new();
    for i in 0..100 {
        let url = format!("{}/v1/sessions/s/ws?after=0", srv.ws_base);
        clients.push(tokio::spawn(async move {
            let mut c = ws(&url).await;
            send(
                &mut c,
                json!({"type": "approval-response", "approvalId": format!("hi {i}"), "approved": true}),
            )
            .await;
            let mut seen = Vec::new();
            let ack = answer(&mut c, &mut seen).await;
            assert!(
                matches!(
                    ack,
                    ServerMessage::Ack {
                        duplicate: false,
                        ..
                    }
                ),
                "{ack:?}"
            );
            (c, seen)
        }));
    }
    let mut joined = Vec::new();
    for c in clients {
        joined.push(c.await.unwrap());
    }
    let mut runner = ws(&format!(
        "{}/v1/sessions/s/ws?role=runner&generation=1",
        srv.ws_base
    ))
    .await;
    send(&mut runner, part("t1", json!({"type": "stream-start"}))).await;
    send(
        &mut runner,
        part("t1", json!({"type": "text-start", "id": "b1"})),
    )
    .await;
    let mut expected_text = String::new();
    for i in 0..30 {
        let d = format!("w{i} ");
        expected_text.push_str(&d);
        send(
            &mut runner,
            part("t1", json!({"type": "text-delta", "id": "b1", "delta": d})),
        )
        .await;
    }
    send(
        &mut runner,
        part("t1", json!({"type": "text-end", "id": "b1"})),
    )
    .await;
    send(&mut runner, part("t1", json!({"type": "tool-call", "toolCallId": "c1", "toolName": "Bash", "input": {"command": "ls"}}))).await;
    send(
        &mut runner,
        json!({"type": "turn-status", "turnId": "t1", "status": "finished"}),
    )
    .await;
    // stream-start, message, tool-call, turn-status: four acks.
    let mut acks = Vec::new();
    while acks.len() < 4 {
        match recv(&mut runner).await.expect("runner socket closed") {
            ServerMessage::Ack { seq, .. } => acks.push(seq),
            // Every live delta is answered too.
            ServerMessage::Received {} => {}
            other => panic!("runner got {other:?}"),
        }
    }
    let last = srv.last_seq("s").await;
    // The prompt, 100 answers, runner-attached and 4 runner frames.
    assert_eq!(last, 106);
    assert_eq!(*acks.last().unwrap(), last);
    let stored = srv.log.read(&sid("s"), 0, 1000).await.unwrap();
    let handles: Vec<_> = joined
        .into_iter()
        .map(|(mut c, mut seen)| {
            tokio::spawn(async move {
                while frames_of(&seen).last().map(|f| f.seq) != Some(last) {
                    seen.push(recv(&mut c).await.expect("client socket closed"));
                }
                seen
            })
        })
        .collect();
    for h in handles {
        let seen = h.await.unwrap();
        let frames = frames_of(&seen);
        // Exactly the stored log, in order, no gap, no duplicate.
        assert_eq!(frames, stored);
        let live: String = seen
            .iter()
            .filter_map(|m| match m {
                ServerMessage::Live {
                    part: StreamPart::TextDelta { delta, .. },
                    ..
                } => Some(delta.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(live, expected_text, "live deltas");
    }
    let messages: Vec<_> = stored
        .iter()
        .filter(|f| matches!(f.body, FrameBody::Message { .. }))
        .collect();
    assert_eq!(messages.len(), 1, "deltas are stored once, as one message");
    assert!(
        matches!(&messages[0].body, FrameBody::Message { text, kind: MessageKind::Text, .. } if *text == expected_text)
    );
}

#[tokio::test]
async fn deltas_are_stored_once_and_a_late_joiner_gets_the_partial_text() {
    let srv = start(|_| {}).await;
    srv.create("d").await;
    let mut a = ws(&format!("{}/v1/sessions/d/ws?after=0", srv.ws_base)).await;
    send(&mut a, json!({"type": "prompt", "text": "go"})).await;
    let mut a_seen = Vec::new();
    answer(&mut a, &mut a_seen).await;
    let mut runner = ws(&format!(
        "{}/v1/sessions/d/ws?role=runner&generation=1",
        srv.ws_base
    ))
    .await;
    send(
        &mut runner,
        part("t", json!({"type": "text-start", "id": "x"})),
    )
    .await;
    for d in ["ab", "cd", "ef"] {
        send(
            &mut runner,
            part("t", json!({"type": "text-delta", "id": "x", "delta": d})),
        )
        .await;
    }
    // Wait until A saw all three deltas: the actor has folded them.
    let count = |seen: &[ServerMessage]| {
        seen.iter()
            .filter(|m| {
                matches!(
                    m,
                    ServerMessage::Live {
                        part: StreamPart::TextDelta { .. },
                        ..
                    }
                )
            })
            .count()
    };
    while count(&a_seen) < 3 {
        a_seen.push(recv(&mut a).await.unwrap());
    }
    let stored_before = srv.last_seq("d").await;
    let mut b = ws(&format!("{}/v1/sessions/d/ws?after=0", srv.ws_base)).await;
    let mut b_seen = Vec::new();
    // B gets the history, then the block so far as one start + one delta.
    while !b_seen.iter().any(|m| {
        matches!(
            m,
            ServerMessage::Live {
                part: StreamPart::TextDelta { .. },
                ..
            }
        )
    }) {
        b_seen.push(recv(&mut b).await.unwrap());
    }
    assert_eq!(frames_of(&b_seen).len() as u64, stored_before);
    assert!(b_seen.iter().any(
        |m| matches!(m, ServerMessage::Live { part: StreamPart::TextStart { id }, .. } if id == "x")
    ));
    assert!(
        matches!(b_seen.last().unwrap(), ServerMessage::Live { part: StreamPart::TextDelta { delta, .. }, .. } if delta == "abcdef")
    );
    for d in ["gh", "ij"] {
        send(
            &mut runner,
            part("t", json!({"type": "text-delta", "id": "x", "delta": d})),
        )
        .await;
    }
    send(
        &mut runner,
        part("t", json!({"type": "text-end", "id": "x"})),
    )
    .await;
    // Every start and delta was answered `received` (fanned out, not
    // stored); the end is acknowledged with the stored message's seq.
    let mut received = 0;
    let ack = loop {
        match recv(&mut runner).await.unwrap() {
            ServerMessage::Received {} => received += 1,
            other => break other,
        }
    };
    assert_eq!(received, 6, "text-start and five deltas");
    let ServerMessage::Ack { seq, .. } = ack else {
        panic!("{ack:?}")
    };
    // Nothing was stored for the deltas: the message is the next frame.
    assert_eq!(seq, stored_before + 1);
    for (c, seen) in [(&mut a, &mut a_seen), (&mut b, &mut b_seen)] {
        while frames_of(seen).last().map(|f| f.seq) != Some(seq) {
            seen.push(recv(c).await.unwrap());
        }
    }
    assert_eq!(count(&a_seen), 5, "A saw every delta live");
    let b_live: String = b_seen
        .iter()
        .filter_map(|m| match m {
            ServerMessage::Live {
                part: StreamPart::TextDelta { delta, .. },
                ..
            } => Some(delta.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(b_live, "abcdefghij");
    let stored = srv.log.read(&sid("d"), 0, 100).await.unwrap();
    let msg = stored.last().unwrap();
    assert!(matches!(&msg.body, FrameBody::Message { text, .. } if text == "abcdefghij"));
    assert!(!stored.iter().any(|f| matches!(
        &f.body,
        FrameBody::Part {
            part: StreamPart::TextDelta { .. },
            ..
        }
    )));
}

#[tokio::test]
async fn a_fenced_runner_cannot_write() {
    let srv = start(|_| {}).await;
    srv.create("f").await;
    let url = |g: u64| {
        format!(
            "{}/v1/sessions/f/ws?role=runner&generation={g}",
            srv.ws_base
        )
    };
    let mut gen1 = ws(&url(1)).await;
    send(
        &mut gen1,
        part("t", json!({"type": "error", "message": "from gen1 before"})),
    )
    .await;
    assert!(matches!(
        recv(&mut gen1).await,
        Some(ServerMessage::Ack { .. })
    ));
    let mut gen2 = ws(&url(2)).await;
    // gen1 hears it was fenced, and its connection is closed.
    match recv(&mut gen1).await {
        Some(ServerMessage::Error { code, .. }) => assert_eq!(code.as_str(), "stale_runner"),
        other => panic!("gen1 expected stale_runner, got {other:?}"),
    }
    // A write after the fence: refused at the socket (closed) or by the actor.
    let late = part("t", json!({"type": "error", "message": "from gen1 after"}));
    use futures::SinkExt;
    if gen1
        .send(tokio_tungstenite::tungstenite::Message::Text(
            late.to_string().into(),
        ))
        .await
        .is_ok()
    {
        match recv(&mut gen1).await {
            None => {}
            Some(ServerMessage::Error { code, .. }) => assert_eq!(code.as_str(), "stale_runner"),
            Some(other) => panic!("a fenced write got {other:?}"),
        }
    }
    // A lower generation is refused outright.
    let mut old = ws(&url(1)).await;
    match recv(&mut old).await {
        Some(ServerMessage::Error { code, .. }) => assert_eq!(code.as_str(), "stale_runner"),
        other => panic!("generation 1 after 2 expected stale_runner, got {other:?}"),
    }
    send(
        &mut gen2,
        part("t", json!({"type": "error", "message": "from gen2"})),
    )
    .await;
    assert!(matches!(
        recv(&mut gen2).await,
        Some(ServerMessage::Ack { .. })
    ));
    let frames = srv.log.read(&sid("f"), 0, 100).await.unwrap();
    let texts: Vec<String> = frames
        .iter()
        .filter_map(|f| match &f.body {
            FrameBody::Part {
                part: StreamPart::Error { message },
                ..
            } => Some(message.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(texts, vec!["from gen1 before", "from gen2"]);
    let gens: Vec<u64> = frames
        .iter()
        .filter_map(|f| match f.body {
            FrameBody::RunnerAttached { generation } => Some(generation),
            _ => None,
        })
        .collect();
    assert_eq!(gens, vec![1, 2]);
}

async fn post_answer(srv: &TestServer, id: &str, approval: &str) -> serde_json::Value {
    let r = srv
        .http
        .post(format!("{}/v1/sessions/{id}/messages", srv.base))
        .json(&json!({"type": "approval-response", "approvalId": approval, "approved": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}

async fn post_prompt(srv: &TestServer, id: &str, text: &str) -> serde_json::Value {
    let r = srv
        .http
        .post(format!("{}/v1/sessions/{id}/messages", srv.base))
        .json(&json!({"type": "prompt", "text": text}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sse_resumes_exactly_from_last_event_id() {
    let srv = start(|_| {}).await;
    srv.create("e").await;
    for i in 1..=10 {
        let ack = if i == 1 {
            post_prompt(&srv, "e", "m1").await
        } else {
            post_answer(&srv, "e", &format!("m{i}")).await
        };
        assert_eq!(ack["seq"], i);
    }
    let url = format!("{}/v1/sessions/e/events", srv.base);
    let mut first = SseReader::new(srv.http.get(&url).send().await.unwrap());
    let mut ids = Vec::new();
    while ids.len() < 6 {
        let ev = first.next().await.unwrap();
        assert_eq!(ev.event.as_deref(), Some("frame"));
        let frame: Frame = serde_json::from_str(&ev.data).unwrap();
        assert_eq!(ev.id.as_deref(), Some(frame.seq.to_string().as_str()));
        ids.push(frame.seq);
    }
    drop(first);
    // More frames arrive while the reader is away, and while it resumes.
    let writer = {
        let srv_base = srv.base.clone();
        let http = srv.http.clone();
        tokio::spawn(async move {
            for i in 11..=30 {
                let r = http
                    .post(format!("{srv_base}/v1/sessions/e/messages"))
                    .json(&json!({"type": "approval-response", "approvalId": format!("m{i}"), "approved": true}))
                    .send()
                    .await
                    .unwrap();
                assert_eq!(r.status(), 200);
            }
        })
    };
    let resumed = srv
        .http
        .get(&url)
        .header("Last-Event-ID", "6")
        .send()
        .await
        .unwrap();
    assert_eq!(resumed.headers()["content-type"], "text/event-stream");
    let mut second = SseReader::new(resumed);
    while ids.len() < 30 {
        let ev = second.next().await.unwrap();
        if ev.event.as_deref() != Some("frame") {
            continue;
        }
        ids.push(ev.id.unwrap().parse().unwrap());
    }
    writer.await.unwrap();
    assert_eq!(ids, (1..=30).collect::<Vec<u64>>());
    // `?after=` works the same way.
    let mut third = SseReader::new(
        srv.http
            .get(format!("{url}?after=28"))
            .send()
            .await
            .unwrap(),
    );
    assert_eq!(third.next().await.unwrap().id.as_deref(), Some("29"));
    assert_eq!(third.next().await.unwrap().id.as_deref(), Some("30"));
}

#[tokio::test]
async fn an_idle_actor_stops_and_a_new_one_recovers_from_the_log() {
    let srv = start(|c| c.idle_timeout = std::time::Duration::from_millis(200)).await;
    srv.create("idle").await;
    let mut runner = ws(&format!(
        "{}/v1/sessions/idle/ws?role=runner&generation=3",
        srv.ws_base
    ))
    .await;
    send(&mut runner, part("t", json!({"type": "finish-step"}))).await;
    assert!(matches!(
        recv(&mut runner).await,
        Some(ServerMessage::Ack { seq: 2, .. })
    ));
    assert_eq!(srv.server.live_sessions(), vec![sid("idle")]);
    drop(runner);
    let deadline = std::time::Instant::now() + WAIT;
    while !srv.server.live_sessions().is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "the idle actor never stopped"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    // The new actor recovered generation 3: generation 2 is fenced.
    let mut stale = ws(&format!(
        "{}/v1/sessions/idle/ws?role=runner&generation=2",
        srv.ws_base
    ))
    .await;
    assert!(
        matches!(recv(&mut stale).await, Some(ServerMessage::Error { code, .. }) if code.as_str() == "stale_runner")
    );
    let ack = post_prompt(&srv, "idle", "after restart").await;
    assert_eq!(ack["seq"], 3);
}
