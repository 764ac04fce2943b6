//! Fan-out to many readers: every reader gets every stored frame once, in
//! the log's order, as one copy shared by all of them (its JSON encoded
//! once); a reader that falls too far behind is dropped after what was
//! queued for it, with no gap, and resumes from its last seq. Real hub over
//! the SQLite log.

use std::sync::Arc;
use std::time::Duration;

use harness_core::actor::{ClientMessage, Role};
use harness_core::frame::SessionId;
use harness_core::log::SessionLog;
use session_log::SqliteSessionLog;
use session_runtime::hub::{MAX_BATCH, MAX_QUEUED};
use session_runtime::{Connection, Hub, HubConfig, Outbound, SharedFrame};

const WAIT: Duration = Duration::from_secs(30);

fn answer(id: String) -> ClientMessage {
    ClientMessage::ApprovalResponse {
        approval_id: id,
        approved: true,
        reason: None,
    }
}

async fn setup(name: &str) -> (tempfile::TempDir, Arc<Hub>, SessionId) {
    let dir = tempfile::tempdir().unwrap();
    let log = Arc::new(SqliteSessionLog::open(dir.path().join("log.db")).unwrap());
    let hub = Hub::new(log.clone(), HubConfig::default());
    let s = SessionId::parse(name).unwrap();
    log.create(&s).await.unwrap();
    // One open turn, so client answers are stored.
    let mut c = hub
        .request(
            &s,
            ClientMessage::Prompt {
                text: "open".into(),
                turn_id: None,
                key: None,
            },
        )
        .await
        .unwrap();
    c.answer(WAIT).await.unwrap();
    (dir, hub, s)
}

/// `writers` concurrent writers, `each` answers each, as POST /messages
/// sends them (one request per message).
async fn write(hub: &Arc<Hub>, s: &SessionId, writers: u64, each: u64) {
    let tasks: Vec<_> = (0..writers)
        .map(|w| {
            let (hub, s) = (hub.clone(), s.clone());
            tokio::spawn(async move {
                for i in 0..each {
                    let mut c = hub.request(&s, answer(format!("w{w}-{i}"))).await.unwrap();
                    c.answer(WAIT).await.unwrap();
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
}

/// Frames until `until` (or the connection ends); anything else skipped.
async fn frames(conn: &mut Connection, until: u64) -> Vec<SharedFrame> {
    let mut got: Vec<SharedFrame> = Vec::new();
    while got.last().map_or(0, |f| f.frame().seq) < until {
        match tokio::time::timeout(WAIT, conn.recv()).await.unwrap() {
            Some(Outbound::Frame(f)) => got.push(f),
            Some(Outbound::Msg(_)) => {}
            Some(Outbound::Close(_)) | None => break,
        }
    }
    got
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_reader_gets_one_shared_copy_of_each_frame_in_order() {
    let (_dir, hub, s) = setup("fan").await;
    let mut readers = Vec::new();
    for _ in 0..3 {
        readers.push(hub.connect(&s, Role::Client, Some(0)).await.unwrap());
    }
    let (writers, each) = (16u64, 25u64);
    write(&hub, &s, writers, each).await;
    let last = 1 + writers * each;
    let mut seen = Vec::new();
    for reader in &mut readers {
        let got = frames(reader, last).await;
        let seqs: Vec<u64> = got.iter().map(|f| f.frame().seq).collect();
        assert_eq!(seqs, (1..=last).collect::<Vec<_>>(), "gap-free, in order");
        seen.push(got);
    }
    // Seq 1 was replayed to each reader; every later frame was fanned out
    // as one copy, encoded once whoever asked first.
    for i in 1..seen[0].len() {
        let first = &seen[0][i];
        for other in &seen[1..] {
            assert_eq!(first.frame(), other[i].frame());
            assert_eq!(
                first.json().as_ptr(),
                other[i].json().as_ptr(),
                "seq {} encoded twice",
                first.frame().seq
            );
        }
        assert_eq!(
            first.json(),
            serde_json::to_vec(first.frame()).unwrap().as_slice()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_reader_too_far_behind_is_dropped_after_what_was_queued_without_a_gap() {
    let (_dir, hub, s) = setup("slow").await;
    let mut slow = hub.connect(&s, Role::Client, Some(0)).await.unwrap();
    let mut live = hub.connect(&s, Role::Client, Some(0)).await.unwrap();
    let (writers, each) = (16u64, (MAX_QUEUED as u64 + 400) / 16);
    let last = 1 + writers * each;
    // A reader that keeps up gets everything.
    let reading = tokio::spawn(async move { frames(&mut live, last).await.len() as u64 });
    write(&hub, &s, writers, each).await;
    assert_eq!(reading.await.unwrap(), last);
    // The one that never read was dropped once MAX_QUEUED messages waited:
    // it gets what was queued (frames 1..=k, no gap), then the end.
    let got = frames(&mut slow, last).await;
    let seqs: Vec<u64> = got.iter().map(|f| f.frame().seq).collect();
    let k = seqs.len() as u64;
    assert_eq!(seqs, (1..=k).collect::<Vec<_>>());
    // A run of frames (one batch's, at most MAX_BATCH) may cross the limit.
    let limit = MAX_QUEUED as u64;
    assert!(
        (limit..limit + MAX_BATCH as u64).contains(&k) && k < last,
        "dropped after {k} of {last}"
    );
    assert!(slow.recv().await.is_none(), "the connection ended");
    // It resumes from its last seq.
    let mut again = hub.connect(&s, Role::Client, Some(k)).await.unwrap();
    let rest = frames(&mut again, last).await;
    let seqs: Vec<u64> = rest.iter().map(|f| f.frame().seq).collect();
    assert_eq!(seqs, (k + 1..=last).collect::<Vec<_>>());
}

/// The count a live reader's test waits on: every connection from the
/// moment `connect` returns until it is dropped, nothing once no actor
/// runs.
#[tokio::test]
async fn connection_count_follows_connects_and_drops() {
    let (_dir, hub, s) = setup("count").await;
    let other = SessionId::parse("count-none").unwrap();
    assert_eq!(hub.connection_count(&other).await, 0, "no actor runs");
    assert_eq!(
        hub.connection_count(&s).await,
        0,
        "the request's one closed"
    );
    let a = hub.connect(&s, Role::Client, None).await.unwrap();
    let b = hub.connect(&s, Role::Client, Some(0)).await.unwrap();
    assert_eq!(hub.connection_count(&s).await, 2);
    drop(a);
    assert_eq!(hub.connection_count(&s).await, 1);
    drop(b);
    assert_eq!(hub.connection_count(&s).await, 0);
}
