//! Group commit: concurrent appends share transactions, every acknowledged
//! frame is stored (also across a SIGKILL), in order, and a failed commit
//! fails every append of its transaction.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use harness_core::log::{AppendRequest, SessionLog};
use harness_core::{FrameBody, SessionId};
use session_log::SqliteSessionLog;

const CHILD_ENV: &str = "SESSION_LOG_GROUP_KILL9_CHILD_DB";
const WRITERS: u64 = 16;

fn sid(s: &str) -> SessionId {
    SessionId::parse(s).unwrap()
}

fn body(writer: u64, i: u64) -> FrameBody {
    FrameBody::UserMessage {
        text: format!("w{writer}-{i}"),
        turn_id: None,
    }
}

/// (writer, i) back from a body written by [`body`].
fn parse(body: &FrameBody) -> (u64, u64) {
    let FrameBody::UserMessage { text, .. } = body else {
        panic!("unexpected body {body:?}");
    };
    let (w, i) = text[1..].split_once('-').unwrap();
    (w.parse().unwrap(), i.parse().unwrap())
}

/// Every frame of `session` is 1..=n without a gap, each writer's frames are
/// in the order it wrote them, and every acknowledged (seq, writer, i) is
/// there as acknowledged.
async fn check_log(log: &SqliteSessionLog, session: &SessionId, acked: &[(u64, u64, u64)]) -> u64 {
    let frames = log.read(session, 0, usize::MAX).await.unwrap();
    let mut next_i: HashMap<u64, u64> = HashMap::new();
    let mut by_seq = HashMap::new();
    for (k, frame) in frames.iter().enumerate() {
        assert_eq!(frame.seq, k as u64 + 1, "gap in the log");
        let (w, i) = parse(&frame.body);
        let expected = next_i.entry(w).or_insert(0);
        assert_eq!(i, *expected, "writer {w}'s frames out of order");
        *expected += 1;
        by_seq.insert(frame.seq, (w, i));
    }
    for &(seq, w, i) in acked {
        assert_eq!(
            by_seq.get(&seq),
            Some(&(w, i)),
            "acknowledged seq {seq} (w{w}-{i}) is not stored as acknowledged"
        );
    }
    frames.len() as u64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_appends_share_commits_and_are_all_stored_in_order_after_a_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("group.db");
    let log = Arc::new(SqliteSessionLog::open(&db).unwrap());
    let shared = sid("shared");
    log.create(&shared).await.unwrap();
    let per_writer = 200;
    let commits_before = log.group_commits();
    let mut tasks = Vec::new();
    for w in 0..WRITERS {
        let (log, shared) = (log.clone(), shared.clone());
        tasks.push(tokio::spawn(async move {
            let own = sid(&format!("own-{w}"));
            log.create(&own).await.unwrap();
            let mut acked = Vec::new();
            for i in 0..per_writer {
                let a = log
                    .append(&shared, AppendRequest::new(body(w, i)))
                    .await
                    .unwrap();
                acked.push((a.seq, w, i));
                let b = log
                    .append(&own, AppendRequest::new(body(w, i)))
                    .await
                    .unwrap();
                assert_eq!(b.seq, i + 1);
            }
            acked
        }));
    }
    let mut acked = Vec::new();
    for t in tasks {
        acked.extend(t.await.unwrap());
    }
    let appends = 2 * WRITERS * per_writer;
    let commits = log.group_commits() - commits_before;
    println!("{appends} appends in {commits} commits");
    assert!(
        commits < appends,
        "{appends} concurrent appends took {commits} commits: none was shared"
    );
    drop(log);

    let log = SqliteSessionLog::open(&db).unwrap();
    assert_eq!(check_log(&log, &shared, &acked).await, WRITERS * per_writer);
    for w in 0..WRITERS {
        let own = log
            .read(&sid(&format!("own-{w}")), 0, usize::MAX)
            .await
            .unwrap();
        let expected: Vec<_> = (0..per_writer).map(|i| body(w, i)).collect();
        assert_eq!(
            own.into_iter().map(|f| f.body).collect::<Vec<_>>(),
            expected
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn appends_queued_together_commit_together() {
    let log = Arc::new(SqliteSessionLog::open_in_memory().unwrap());
    let s = sid("held");
    log.create(&s).await.unwrap();
    let hold = log.hold_writer();
    hold.wait();
    let before = log.group_commits();
    let tasks: Vec<_> = (0..50)
        .map(|i| {
            let (log, s) = (log.clone(), s.clone());
            tokio::spawn(async move { log.append(&s, AppendRequest::new(body(0, i))).await })
        })
        .collect();
    // Let every append reach the writer's queue.
    tokio::time::sleep(Duration::from_millis(300)).await;
    drop(hold);
    let mut seqs: Vec<u64> = Vec::new();
    for t in tasks {
        seqs.push(t.await.unwrap().unwrap().seq);
    }
    seqs.sort_unstable();
    assert_eq!(seqs, (1..=50).collect::<Vec<_>>());
    assert_eq!(
        log.group_commits() - before,
        1,
        "50 queued appends, one commit"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failed_commit_fails_every_append_in_its_transaction() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("fail.db");
    let log = Arc::new(SqliteSessionLog::open(&db).unwrap());
    let (a, b) = (sid("a"), sid("b"));
    log.create(&a).await.unwrap();
    log.create(&b).await.unwrap();
    log.append(&a, AppendRequest::new(body(9, 0)))
        .await
        .unwrap();

    let hold = log.hold_writer();
    hold.wait();
    let plain: Vec<_> = (0..20u64)
        .map(|i| {
            let log = log.clone();
            let s = if i % 2 == 0 { a.clone() } else { b.clone() };
            tokio::spawn(async move { log.append(&s, AppendRequest::new(body(1, i))).await })
        })
        .collect();
    // An actor's grouped append in the same transaction: its append is
    // answered at once, its commit fails.
    let grouped = {
        let (log, a) = (log.clone(), a.clone());
        tokio::spawn(async move {
            let (appended, group): (harness_core::log::Appended, u64) = log
                .append_grouped(&a, AppendRequest::new(body(2, 0)))
                .await?;
            // The group failed: a further grouped append of this session is
            // refused (it would be computed from frames that are gone) ...
            let refused = log.append_grouped(&a, AppendRequest::new(body(2, 1))).await;
            let committed = log.commit_group(&a, group).await;
            Ok::<_, harness_core::Error>((appended, refused.is_err(), committed))
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    log.fail_next_commits(1);
    drop(hold);
    for t in plain {
        let result = t.await.unwrap();
        assert!(
            result.is_err(),
            "an append of the failed transaction was acknowledged: {result:?}"
        );
    }
    let (appended, refused, committed) = grouped.await.unwrap().unwrap();
    assert!(appended.seq >= 2, "staged after frame 1: {appended:?}");
    assert!(
        refused,
        "a grouped append after a failed group of its session was taken"
    );
    assert!(committed.is_err(), "the failed group reported committed");

    // ... and, once its appender knows, the session takes appends again.
    let (again, group) = log
        .append_grouped(&a, AppendRequest::new(body(3, 0)))
        .await
        .unwrap();
    log.commit_group(&a, group).await.unwrap();
    assert_eq!(again.seq, 2, "the failed frames left no gap");
    let next = log
        .append(&b, AppendRequest::new(body(3, 1)))
        .await
        .unwrap();
    assert_eq!(next.seq, 1);
    drop(log);

    let log = SqliteSessionLog::open(&db).unwrap();
    let stored: Vec<_> = log
        .read(&a, 0, 100)
        .await
        .unwrap()
        .into_iter()
        .map(|f| f.body)
        .collect();
    assert_eq!(stored, vec![body(9, 0), body(3, 0)]);
    let stored: Vec<_> = log
        .read(&b, 0, 100)
        .await
        .unwrap()
        .into_iter()
        .map(|f| f.body)
        .collect();
    assert_eq!(stored, vec![body(3, 1)]);
}

/// The child of the SIGKILL test: 16 concurrent appenders, each printing
/// `ACK <seq> <writer> <i>` once its append is acknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn child_concurrent_appenders() {
    let Ok(db) = std::env::var(CHILD_ENV) else {
        return;
    };
    let log = Arc::new(SqliteSessionLog::open(db).unwrap());
    let s = sid("kill9");
    log.create(&s).await.unwrap();
    let tasks: Vec<_> = (0..WRITERS)
        .map(|w| {
            let (log, s) = (log.clone(), s.clone());
            tokio::spawn(async move {
                for i in 0.. {
                    let a = log
                        .append(&s, AppendRequest::new(body(w, i)))
                        .await
                        .unwrap();
                    // One write per line: a line cut by the kill has no
                    // complete triple to misread.
                    println!("ACK {} {w} {i} END", a.seq);
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
}

fn ack(line: &str) -> Option<(u64, u64, u64)> {
    let at = line.find("ACK ")?;
    let rest = line[at + 4..].strip_suffix(" END")?;
    let mut it = rest.split(' ').map(|n| n.parse::<u64>());
    Some((it.next()?.ok()?, it.next()?.ok()?, it.next()?.ok()?))
}

#[tokio::test]
async fn concurrently_acknowledged_frames_survive_sigkill() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("kill9.db");
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "child_concurrent_appenders",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, &db)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut acked = Vec::new();
    for line in lines.by_ref() {
        if let Some(a) = ack(&line.unwrap()) {
            acked.push(a);
            if acked.len() == 3000 {
                break;
            }
        }
    }
    assert_eq!(acked.len(), 3000, "the child stopped before 3000 acks");
    child.kill().unwrap();
    for line in lines {
        let Ok(line) = line else { break };
        if let Some(a) = ack(&line) {
            acked.push(a);
        }
    }
    assert!(!child.wait().unwrap().success());

    let log = SqliteSessionLog::open(&db).unwrap();
    let s = sid("kill9");
    let last = check_log(&log, &s, &acked).await;
    let next = log
        .append(&s, AppendRequest::new(body(99, 0)))
        .await
        .unwrap();
    assert_eq!(next.seq, last + 1);
    println!("acked {}, recovered {last}", acked.len());
}
