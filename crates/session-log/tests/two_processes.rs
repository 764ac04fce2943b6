//! Two processes on one SQLite file: this test and a child (this same test
//! binary, re-run with an environment variable that turns `child_writer`
//! into the second writer) append to one session at once, each with its own
//! keys, retries of them, and keys both append. The shared check of the log
//! suite then requires one gap-free log with every key stored once, and
//! every answer either process got naming the frame that holds it.

use std::process::{Command, Stdio};
use std::sync::Arc;

use harness_core::log::SessionLog;
use harness_testkit::conformance::log::{check_shared_writers, shared_writer};
use session_log::SqliteSessionLog;

const CHILD_ENV: &str = "SESSION_LOG_TWO_PROCESSES_DB";
const ROUNDS: usize = 150;

/// The child's work; a no-op when run as an ordinary test.
#[tokio::test]
async fn child_writer() {
    let Ok(db) = std::env::var(CHILD_ENV) else {
        return;
    };
    let log = Arc::new(SqliteSessionLog::open(db).unwrap()) as Arc<dyn SessionLog>;
    let records = shared_writer(log, "child", ROUNDS).await.unwrap();
    // One line per answer, for the parent's check.
    for (key, seq) in records {
        println!("REC {key} {seq}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_append_to_one_file() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("two.db");
    // Create the schema first so neither process races the other's CREATE.
    drop(SqliteSessionLog::open(&db).unwrap());
    let child = Command::new(std::env::current_exe().unwrap())
        .args(["child_writer", "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, &db)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let log = Arc::new(SqliteSessionLog::open(&db).unwrap()) as Arc<dyn SessionLog>;
    let mut records = shared_writer(log.clone(), "parent", ROUNDS).await.unwrap();
    let out = tokio::task::spawn_blocking(move || child.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    assert!(
        out.status.success(),
        "the child writer failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    let child: Vec<(String, u64)> = stdout
        .lines()
        .filter_map(|l| {
            let rest = &l[l.find("REC ")? + 4..];
            let (key, seq) = rest.trim().split_once(' ')?;
            Some((key.to_string(), seq.parse().ok()?))
        })
        .collect();
    assert_eq!(child.len(), 2 * ROUNDS, "child answers: {stdout}");
    // The writers really overlapped: each holds seqs on both sides of the
    // other's.
    let (child_min, child_max) = (
        child.iter().map(|r| r.1).min().unwrap(),
        child.iter().map(|r| r.1).max().unwrap(),
    );
    let interleaved = records.iter().any(|r| r.1 > child_min && r.1 < child_max);
    records.extend(child);
    check_shared_writers(log, &["parent", "child"], ROUNDS, &records)
        .await
        .unwrap();
    println!("processes interleaved: {interleaved}");
}
