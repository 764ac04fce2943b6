//! `LogSink`: the runner side of the actor, in-process over a log.

use std::sync::Arc;

use harness_core::frame::{FrameBody, MessageKind, SessionId};
use harness_core::log::{MemorySessionLog, SessionLog};
use harness_core::part::StreamPart;
use harness_core::sink::LogSink;
use harness_core::slice::PartSink;
use harness_core::ErrorKind;

async fn emit(sink: &LogSink, part: StreamPart, key: &str) -> harness_core::Result<()> {
    sink.emit("s", "t1", part, key.to_string()).await
}

#[tokio::test]
async fn parts_are_folded_keyed_and_fenced() {
    let log = Arc::new(MemorySessionLog::new());
    let s = SessionId::parse("s").unwrap();
    log.create(&s).await.unwrap();
    let sink = LogSink::new(log.clone(), 100);
    emit(&sink, StreamPart::TextStart { id: "b".into() }, "t1:0:0")
        .await
        .unwrap();
    emit(
        &sink,
        StreamPart::TextDelta {
            id: "b".into(),
            delta: "Hi ".into(),
        },
        "t1:10:0",
    )
    .await
    .unwrap();
    emit(
        &sink,
        StreamPart::TextDelta {
            id: "b".into(),
            delta: "there".into(),
        },
        "t1:20:0",
    )
    .await
    .unwrap();
    emit(&sink, StreamPart::TextEnd { id: "b".into() }, "t1:30:0")
        .await
        .unwrap();
    let call = StreamPart::ToolCall {
        tool_call_id: "c".into(),
        tool_name: "Bash".into(),
        input: serde_json::json!({"command": "ls"}),
    };
    emit(&sink, call.clone(), "t1:40:0").await.unwrap();
    // A retried slice re-emits the call with the same key: stored once.
    emit(&sink, call.clone(), "t1:40:0").await.unwrap();
    let frames = log.read(&s, 0, 100).await.unwrap();
    let bodies: Vec<_> = frames.iter().map(|f| &f.body).collect();
    assert_eq!(
        bodies.len(),
        3,
        "runner-attached, one message, one tool call: {bodies:?}"
    );
    assert!(matches!(
        bodies[0],
        FrameBody::RunnerAttached { generation: 100 }
    ));
    assert!(
        matches!(bodies[1], FrameBody::Message { kind: MessageKind::Text, text, .. } if text == "Hi there")
    );

    // A restarted worker (higher generation) fences this one.
    let newer = LogSink::new(log.clone(), 200);
    emit(
        &newer,
        StreamPart::Error {
            message: "new worker".into(),
        },
        "t1:50:0",
    )
    .await
    .unwrap();
    // The old sink's actor still believes it is current; the log-level
    // fence is the generation recorded in the log, which a fresh attach of
    // the old generation is refused by.
    let stale = LogSink::new(log.clone(), 100);
    let err = emit(
        &stale,
        StreamPart::Error {
            message: "zombie".into(),
        },
        "t1:60:0",
    )
    .await
    .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Conflict);
    let last = log.read(&s, 0, 100).await.unwrap();
    assert!(!last.iter().any(|f| matches!(&f.body, FrameBody::Part { part: StreamPart::Error { message }, .. } if message == "zombie")));
}
