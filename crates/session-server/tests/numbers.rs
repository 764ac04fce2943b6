//! A tool input's numbers reach every reader as the agent sent them: the
//! runner's WebSocket in, and out through the WebSocket replay, `/export`,
//! a fork's export, the AI SDK UI message stream and the session's Durable
//! Stream (SQLite log underneath). The core test `numbers.rs` covers the
//! wire types themselves with arbitrary values; this one covers the paths.

mod common;

use common::*;
use harness_core::actor::ServerMessage;
use harness_core::StreamPart;
use harness_testkit::conformance::log::exact_numbers_input;
use serde_json::{json, Value};

/// Compared as re-encoded text: `Value`'s own equality takes `-0.0` for
/// `0.0`.
fn same(got: &Value, what: &str) {
    let want = serde_json::to_string(&exact_numbers_input()).unwrap();
    let got = serde_json::to_string(got).unwrap();
    assert_eq!(got, want, "{what} changed the tool input's numbers");
}

async fn get_json(srv: &TestServer, path: &str) -> Value {
    let r = srv
        .http
        .get(format!("{}{path}", srv.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "GET {path}");
    // Parsed from the body's text with the workspace's serde_json (exact
    // floats): reqwest's `json()` would parse the same way, this says so.
    serde_json::from_str(&r.text().await.unwrap()).unwrap()
}

#[tokio::test]
async fn every_read_path_carries_the_numbers_the_agent_sent() {
    let srv = start(|_| {}).await;
    srv.create("n").await;
    let mut runner = ws(&format!(
        "{}/v1/sessions/n/ws?role=runner&generation=1",
        srv.ws_base
    ))
    .await;
    // Sent as the text the agent wrote, not re-encoded by this test.
    let input_text = r#"{"fuzzFind":2.2222223222222223e+58,"max":1.7976931348623157e308,
            "minPositive":2.2250738585072014e-308,"subnormal":5e-324,"negativeZero":-0.0,
            "tenth":0.1,"third":0.3333333333333333,"i64Min":-9223372036854775808,
            "u64Max":18446744073709551615,"nested":[[{"x":1.0000000000000002}]]}"#;
    let message = format!(
        r#"{{"type":"part","turnId":"t","key":"k1","part":{{"type":"tool-call","toolCallId":"c","toolName":"Bash","input":{input_text}}}}}"#
    );
    use futures::SinkExt;
    runner
        .send(tokio_tungstenite::tungstenite::Message::Text(
            message.into(),
        ))
        .await
        .unwrap();
    let mut seen = Vec::new();
    let seq = match answer(&mut runner, &mut seen).await {
        ServerMessage::Ack { seq, .. } => seq,
        other => panic!("the runner's part was answered {other:?}"),
    };

    // The WebSocket replay of a client that joins later.
    let mut client = ws(&format!("{}/v1/sessions/n/ws?after=0", srv.ws_base)).await;
    loop {
        match recv(&mut client).await {
            Some(ServerMessage::Frame { frame }) if frame.seq == seq => match frame.body {
                harness_core::FrameBody::Part {
                    part: StreamPart::ToolCall { input, .. },
                    ..
                } => break same(&input, "the WebSocket replay"),
                other => panic!("replayed {other:?}"),
            },
            Some(ServerMessage::Frame { .. }) => {}
            other => panic!("replayed {other:?}"),
        }
    }
    // Frames as JSON arrays: the tool call is the frame at `seq`.
    let input_at = |frames: &Value| frames[(seq - 1) as usize]["body"]["part"]["input"].clone();

    let export = get_json(&srv, "/v1/sessions/n/export").await;
    same(&input_at(&export), "the export");

    let r = srv
        .http
        .post(format!(
            "{}/v1/sessions/n/fork?until={seq}&target=n2",
            srv.base
        ))
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "fork: {}", r.text().await.unwrap());
    let export = get_json(&srv, "/v1/sessions/n2/export").await;
    same(&input_at(&export), "a fork's export");

    let stream = get_json(&srv, "/v1/stream/sessions/n?offset=-1").await;
    same(&input_at(&stream), "the Durable Stream");

    let r = srv
        .http
        .get(format!("{}/v1/sessions/n/ui-stream?after=0", srv.base))
        .send()
        .await
        .unwrap();
    let mut reader = SseReader::new(r);
    loop {
        let ev = reader.next().await.expect("the UI stream ended early");
        let chunk: Value = serde_json::from_str(&ev.data).unwrap_or(json!(null));
        if chunk["type"] == "tool-input-available" {
            same(&chunk["input"], "the UI message stream");
            break;
        }
    }
}
