//! kill -9 safety: a child process appends frames and prints each seq the
//! log acknowledged; the test SIGKILLs it mid-stream, reopens the database
//! and checks that every acknowledged seq is there, gap-free, with the body
//! the child wrote.
//!
//! The child is this same test binary re-run with an environment variable
//! that turns `child_appender` into the writer: no separate binary to build
//! or locate.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use harness_core::log::{AppendRequest, SessionLog};
use harness_core::{FrameBody, SessionId};
use session_log::SqliteSessionLog;

const CHILD_ENV: &str = "SESSION_LOG_KILL9_CHILD_DB";

fn body(i: u64) -> FrameBody {
    FrameBody::UserMessage {
        text: format!("frame-{i}"),
        turn_id: None,
    }
}

/// The seq in an `ACK <seq>` line. libtest may print `test name ... ` on the
/// same line before the first one, so search rather than strip a prefix. A
/// line cut short by the kill has no trailing digits to misread: the child
/// prints the whole line in one write.
fn ack(line: &str) -> Option<u64> {
    let at = line.find("ACK ")?;
    line[at + 4..].trim().parse().ok()
}

/// The child's work; a no-op when run as an ordinary test.
#[tokio::test]
async fn child_appender() {
    let Ok(db) = std::env::var(CHILD_ENV) else {
        return;
    };
    let log = SqliteSessionLog::open(db).unwrap();
    let s = SessionId::parse("kill9").unwrap();
    log.create(&s).await.unwrap();
    for i in 1..=1_000_000u64 {
        let a = log.append(&s, AppendRequest::new(body(i))).await.unwrap();
        assert_eq!(a.seq, i);
        // One line per ack, flushed, so the parent knows exactly what was
        // acknowledged before the kill.
        println!("ACK {}", a.seq);
    }
}

#[tokio::test]
async fn acknowledged_frames_survive_sigkill() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("kill9.db");
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "child_appender",
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
        let line = line.unwrap();
        if let Some(seq) = ack(&line) {
            acked.push(seq);
            if acked.len() == 500 {
                break;
            }
        }
    }
    assert_eq!(acked.len(), 500, "the child stopped before 500 acks");
    // std's Child::kill is SIGKILL on Unix: no destructor, no clean close.
    child.kill().unwrap();
    // Acks printed between our last read and the kill count too.
    for line in lines {
        let Ok(line) = line else { break };
        if let Some(seq) = ack(&line) {
            acked.push(seq);
        }
    }
    let status = child.wait().unwrap();
    assert!(!status.success(), "the child was killed, not finished");
    let max_acked = *acked.iter().max().unwrap();
    assert_eq!(acked, (1..=max_acked).collect::<Vec<_>>());

    let log = SqliteSessionLog::open(&db).unwrap();
    let s = SessionId::parse("kill9").unwrap();
    let frames = log.read(&s, 0, usize::MAX).await.unwrap();
    let last = frames.len() as u64;
    assert!(
        last >= max_acked,
        "acknowledged up to seq {max_acked} but only {last} frames survived"
    );
    for (i, frame) in frames.iter().enumerate() {
        let seq = i as u64 + 1;
        assert_eq!(frame.seq, seq, "gap in the recovered log");
        assert_eq!(frame.body, body(seq));
    }
    // The reopened log continues without a gap.
    let next = log
        .append(&s, AppendRequest::new(body(last + 1)))
        .await
        .unwrap();
    assert_eq!(next.seq, last + 1);
    println!("acked {max_acked}, recovered {last}");
}
