//! The actor driver's replay of a trimmed log (`docs/retention.md`): a
//! client connecting from 0 gets the kept frames from the cut, one resuming
//! inside the cut is told `gone` and closed — the rule of every server's
//! event streams (`LogInfo::reader_start`), held here too for the race of a
//! trim between a server's check and the replay. Over the in-memory log,
//! CPU only.

use std::sync::Arc;

use harness_core::actor::{ActorConfig, ConnId, ErrorCode, Input, Role, ServerMessage};
use harness_core::actor_driver::{ActorDriver, Transport};
use harness_core::frame::{FrameBody, MessageKind, SessionId};
use harness_core::log::{AppendRequest, LogSession, MemorySessionLog, SessionLog};
use harness_core::session::TurnCommand;

#[derive(Debug, Default)]
struct Recorder {
    sent: Vec<(ConnId, ServerMessage)>,
    closed: Vec<(ConnId, String)>,
}

impl Transport for Recorder {
    fn send(&mut self, conn: ConnId, message: ServerMessage) -> bool {
        self.sent.push((conn, message));
        true
    }
    fn close(&mut self, conn: ConnId, reason: &str) {
        self.closed.push((conn, reason.to_string()));
    }
    fn dispatch(&mut self, _command: TurnCommand) {}
}

async fn trimmed_driver() -> ActorDriver<Recorder> {
    let log = Arc::new(MemorySessionLog::new());
    let session = SessionId::parse("rt").unwrap();
    log.create(&session).await.unwrap();
    for i in 1..=6 {
        log.append(
            &session,
            AppendRequest::new(FrameBody::Message {
                turn_id: "t0".into(),
                id: format!("m{i}"),
                kind: MessageKind::Text,
                text: format!("pangolin {i}"),
                interrupted: false,
            }),
        )
        .await
        .unwrap();
    }
    log.trim(&session, 3).await.unwrap();
    let store = Arc::new(LogSession::new(log, session));
    ActorDriver::recover(store, ActorConfig::default(), Recorder::default())
        .await
        .unwrap()
}

#[tokio::test]
async fn a_replay_from_zero_starts_at_the_cut() {
    let mut driver = trimmed_driver().await;
    driver
        .handle(Input::Connect {
            conn: 1,
            role: Role::Client,
            after: Some(0),
        })
        .await;
    let seqs: Vec<u64> = driver
        .transport()
        .sent
        .iter()
        .filter_map(|(_, m)| match m {
            ServerMessage::Frame { frame } => Some(frame.seq),
            _ => None,
        })
        .collect();
    assert_eq!(seqs, [4, 5, 6]);
    assert!(driver.transport().closed.is_empty());
}

#[tokio::test]
async fn a_replay_from_inside_the_cut_is_told_gone_and_closed() {
    let mut driver = trimmed_driver().await;
    driver
        .handle(Input::Connect {
            conn: 1,
            role: Role::Client,
            after: Some(2),
        })
        .await;
    let t = driver.transport();
    assert!(
        !t.sent
            .iter()
            .any(|(_, m)| matches!(m, ServerMessage::Frame { .. })),
        "no frame after a hole: {:?}",
        t.sent
    );
    match t.sent.as_slice() {
        [(1, ServerMessage::Error { code, message })] => {
            assert_eq!(*code, ErrorCode::Gone, "{message}");
            assert!(message.contains("removed by retention"), "{message}");
        }
        other => panic!("expected one `gone` error, got {other:?}"),
    }
    assert_eq!(t.closed, [(1, "gone".to_string())]);
}
