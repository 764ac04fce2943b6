//! A session actor under concurrent writers commits their frames in groups:
//! every acknowledged frame is stored, readers see the log's order, and a
//! failed group commit acknowledges nothing of its batch (and shows nothing
//! of it to readers), after which the actor goes on from what is stored.
//! Real hub over the SQLite log.

use std::sync::Arc;
use std::time::Duration;

use harness_core::actor::{ClientMessage, Role};
use harness_core::frame::{FrameBody, SessionId};
use harness_core::log::SessionLog;
use session_log::SqliteSessionLog;
use session_runtime::{Hub, HubConfig, Outbound};

const WAIT: Duration = Duration::from_secs(20);

fn answer(id: String) -> ClientMessage {
    ClientMessage::ApprovalResponse {
        approval_id: id,
        approved: true,
        reason: None,
    }
}

fn approval_id(body: &FrameBody) -> Option<&str> {
    match body {
        FrameBody::ApprovalResponse { approval_id, .. } => Some(approval_id),
        _ => None,
    }
}

/// Open a turn (one prompt), so client answers are stored.
async fn open_turn(hub: &Hub, s: &SessionId) {
    let mut c = hub.connect(s, Role::Client, None).await.unwrap();
    c.client(ClientMessage::Prompt {
        text: "open".into(),
        turn_id: None,
        key: None,
    });
    c.answer(WAIT).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_writers_share_commits_and_every_ack_is_stored_in_reader_order() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("log.db");
    let log = Arc::new(SqliteSessionLog::open(&db).unwrap());
    let hub = Hub::new(log.clone(), HubConfig::default());
    let s = SessionId::parse("busy").unwrap();
    log.create(&s).await.unwrap();
    open_turn(&hub, &s).await;

    let mut reader = hub.connect(&s, Role::Client, Some(0)).await.unwrap();
    let (writers, each) = (16u64, 40u64);
    let before = log.group_commits();
    let tasks: Vec<_> = (0..writers)
        .map(|w| {
            let (hub, s) = (hub.clone(), s.clone());
            tokio::spawn(async move {
                let mut acked = Vec::new();
                for i in 0..each {
                    // A connection per message, as POST /messages does.
                    let mut c = hub.connect(&s, Role::Client, None).await.unwrap();
                    c.client(answer(format!("w{w}-{i}")));
                    let seq = c.answer(WAIT).await.unwrap().seq;
                    acked.push((seq, format!("w{w}-{i}")));
                }
                acked
            })
        })
        .collect();
    let mut acked = Vec::new();
    for t in tasks {
        acked.extend(t.await.unwrap());
    }
    let total = writers * each;
    let commits = log.group_commits() - before;
    println!("{total} acknowledged answers in {commits} commits");
    assert!(
        commits <= total / 2,
        "{total} answers from {writers} concurrent writers took {commits} commits"
    );

    // The reader saw 1..=total+1 in order, each frame once.
    let mut seen = Vec::new();
    while seen.len() < total as usize + 1 {
        match tokio::time::timeout(WAIT, reader.recv()).await.unwrap() {
            Some(Outbound::Frame(frame)) => seen.push(frame.into_frame()),
            Some(Outbound::Msg(_)) => {}
            other => panic!("reader ended: {other:?}"),
        }
    }
    let seqs: Vec<u64> = seen.iter().map(|f| f.seq).collect();
    assert_eq!(seqs, (1..=total + 1).collect::<Vec<_>>());
    drop(reader);
    drop(hub);
    drop(log);

    // After a reopen, every acknowledged seq holds what was acknowledged,
    // and each writer's answers are in the order it sent them.
    let log = SqliteSessionLog::open(&db).unwrap();
    let frames = log.read(&s, 0, usize::MAX).await.unwrap();
    assert_eq!(frames.len() as u64, total + 1);
    for (seq, id) in &acked {
        let frame = &frames[*seq as usize - 1];
        assert_eq!(frame.seq, *seq);
        assert_eq!(approval_id(&frame.body), Some(id.as_str()));
    }
    for w in 0..writers {
        let mine: Vec<u64> = frames
            .iter()
            .filter_map(|f| approval_id(&f.body))
            .filter_map(|id| id.strip_prefix(&format!("w{w}-")))
            .map(|i| i.parse().unwrap())
            .collect();
        assert_eq!(
            mine,
            (0..each).collect::<Vec<_>>(),
            "writer {w} out of order"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failed_group_commit_acknowledges_and_shows_nothing_of_its_batch() {
    let dir = tempfile::tempdir().unwrap();
    let log = Arc::new(SqliteSessionLog::open(dir.path().join("log.db")).unwrap());
    let hub = Hub::new(log.clone(), HubConfig::default());
    let s = SessionId::parse("failing").unwrap();
    log.create(&s).await.unwrap();
    open_turn(&hub, &s).await;
    let mut reader = hub.connect(&s, Role::Client, None).await.unwrap();

    // Ten writers, connected first.
    let mut conns = Vec::new();
    for _ in 0..10 {
        conns.push(hub.connect(&s, Role::Client, None).await.unwrap());
    }
    // Hold the writer: the actor's first append waits on it and the other
    // messages queue up behind it, to be taken as one batch.
    let hold = log.hold_writer();
    hold.wait();
    let writers: Vec<_> = conns
        .into_iter()
        .enumerate()
        .map(|(w, mut c)| {
            c.client(answer(format!("lost-{w}")));
            tokio::spawn(async move { c.answer(WAIT).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    // At most two commits: the first message's (alone, or with others if
    // they were already queued) and the batch of the rest. Both fail.
    log.fail_next_commits(2);
    drop(hold);
    for w in writers {
        let result = w.await.unwrap();
        assert!(
            result.is_err(),
            "a write of a failed commit was acknowledged: {result:?}"
        );
    }
    log.fail_next_commits(0);
    // The reader was shown none of it (its connection is closed when the
    // batch fails, or it saw nothing at all).
    while let Ok(Some(out)) = tokio::time::timeout(Duration::from_millis(300), reader.recv()).await
    {
        if let Outbound::Frame(frame) = out {
            panic!("a reader was shown a frame that is not stored: {frame:?}");
        }
    }
    let stored = log.read(&s, 0, 100).await.unwrap();
    assert_eq!(stored.len(), 1, "only the prompt is stored: {stored:?}");

    // The actor goes on from the log: the next answer is seq 2.
    let mut c = hub.connect(&s, Role::Client, None).await.unwrap();
    c.client(answer("after".into()));
    let seq = c.answer(WAIT).await.unwrap().seq;
    assert_eq!(seq, 2);
    let stored = log.read(&s, 0, 100).await.unwrap();
    assert_eq!(approval_id(&stored[1].body), Some("after"));
}
