//! What the search index costs and gives, on the SQLite log:
//!
//! - appends/s of frames the index holds (answers of 20 words) next to
//!   appends/s of frames of the same size it does not hold (text deltas,
//!   stream bookkeeping) — the same store, the same bytes, in interleaved
//!   rounds, 16 writers on 1,000 sessions;
//! - how long the index takes to catch up once a round's appends are
//!   acknowledged (it is written after each commit, by its own thread);
//!   the next round starts only then, so no round pays for another's;
//! - query latency (p50/p99) over everything indexed, for one- and
//!   two-word queries;
//! - first, the floor: what FTS5 itself costs next to a plain insert of the
//!   same frame, on one thread with this build's SQLite (no log, no
//!   threads, transactions of 16 frames), for our table and for FTS5's
//!   cheapest settings. With no spare core, an index costing a fraction
//!   `f` of an append's own work leaves `1 / (1 + f)` of the appends/s:
//!   the 10 % goal needs `f` ≤ 0.11.
//!
//! ```text
//! cargo xtask bench search
//! BENCH_FRAMES=1000000 cargo run --release -p session-log --example search_bench
//! BENCH_FLOOR=0 …   # without the floor; BENCH_FLOOR_FRAMES (100000)
//! ```

use std::sync::Arc;
use std::time::{Duration, Instant};

use harness_core::frame::{FrameBody, MessageKind, SessionId};
use harness_core::log::{AppendRequest, SessionLog};
use harness_core::part::StreamPart;
use harness_core::search::SearchQuery;
use session_log::SqliteSessionLog;

const SESSIONS: usize = 1000;
const WRITERS: usize = 16;
const ROUNDS: usize = 5;
const VOCABULARY: u64 = 5000;

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A deterministic stream of words (xorshift).
struct Words(u64);

impl Words {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn sentence(&mut self, n: usize) -> String {
        (0..n)
            .map(|_| format!("w{}", self.next() % VOCABULARY))
            .collect::<Vec<_>>()
            .join(" ")
    }
}

fn body(indexed: bool, text: String) -> FrameBody {
    if indexed {
        FrameBody::Message {
            turn_id: "t1".into(),
            id: "m".into(),
            kind: MessageKind::Text,
            text,
            interrupted: false,
        }
    } else {
        FrameBody::Part {
            turn_id: "t1".into(),
            part: StreamPart::TextDelta {
                id: "m".into(),
                delta: text,
            },
        }
    }
}

/// Append `frames` frames (indexed or not) with [`WRITERS`] tasks; the
/// rate.
async fn append_round(log: &Arc<SqliteSessionLog>, frames: usize, indexed: bool, seed: u64) -> f64 {
    let started = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..WRITERS {
        let log = log.clone();
        tasks.push(tokio::spawn(async move {
            let mut words = Words(seed * 7919 + w as u64 + 1);
            for i in (w..frames).step_by(WRITERS) {
                let id = SessionId::parse(format!("s{:04}", i % SESSIONS)).unwrap();
                log.append(&id, AppendRequest::new(body(indexed, words.sentence(20))))
                    .await
                    .unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    frames as f64 / started.elapsed().as_secs_f64()
}

async fn open(dir: &std::path::Path, name: &str) -> Arc<SqliteSessionLog> {
    let log = Arc::new(SqliteSessionLog::open(dir.join(name)).unwrap());
    for i in 0..SESSIONS {
        log.create(&SessionId::parse(format!("s{i:04}")).unwrap())
            .await
            .unwrap();
    }
    log
}

/// Append a marker and wait until it is searchable: the indexer is done
/// with everything before it.
async fn drain(log: &Arc<SqliteSessionLog>, round: usize) -> Duration {
    let started = Instant::now();
    let marker = format!("drainmarker{round}");
    let id = SessionId::parse("s0000").unwrap();
    log.append(&id, AppendRequest::new(body(true, marker.clone())))
        .await
        .unwrap();
    while log
        .search(&SearchQuery::new(&marker))
        .await
        .unwrap()
        .is_empty()
    {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "the index never caught up"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    started.elapsed()
}

fn pct(sorted: &[Duration], p: f64) -> f64 {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize].as_secs_f64() * 1e3
}

/// FTS5 tables for the floor: ours (`lib.rs`: external content in
/// `search_docs`, `unicode61`), then FTS5's cheapest settings.
const FLOOR_VARIANTS: &[(&str, &str)] = &[
    (
        "ours (content table + FTS5, unicode61)",
        "CREATE TABLE docs (id INTEGER PRIMARY KEY, session TEXT, seq INTEGER, kind TEXT, text TEXT);
         CREATE UNIQUE INDEX docs_frame ON docs (session, seq);
         CREATE VIRTUAL TABLE fts USING fts5(text, content = 'docs', content_rowid = 'id', tokenize = 'unicode61');",
    ),
    (
        "FTS5 alone, detail=none",
        "CREATE VIRTUAL TABLE fts USING fts5(text, detail = none);",
    ),
    (
        "FTS5 contentless, detail=none, columnsize=0",
        "CREATE VIRTUAL TABLE fts USING fts5(text, content = '', detail = none, columnsize = 0);",
    ),
    (
        "the same, ascii tokenizer",
        "CREATE VIRTUAL TABLE fts USING fts5(text, content = '', detail = none, columnsize = 0, tokenize = 'ascii');",
    ),
];

/// Seconds to store `texts` as frames (16 per transaction), each also
/// indexed when `index` is a [`FLOOR_VARIANTS`] schema.
fn floor_run(dir: &std::path::Path, texts: &[String], index: Option<&str>) -> f64 {
    let path = dir.join("floor.db");
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
    let mut db = rusqlite::Connection::open(&path).unwrap();
    db.execute_batch(
        "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;
         CREATE TABLE frames (session TEXT NOT NULL, seq INTEGER NOT NULL, at_ms INTEGER NOT NULL,
                              body TEXT NOT NULL, PRIMARY KEY (session, seq)) WITHOUT ROWID;",
    )
    .unwrap();
    if let Some(schema) = index {
        db.execute_batch(schema).unwrap();
    }
    let ours = index.is_some_and(|s| s.contains("docs"));
    let started = Instant::now();
    for (batch, chunk) in texts.chunks(16).enumerate() {
        let tx = db.transaction().unwrap();
        for (i, text) in chunk.iter().enumerate() {
            let seq = (batch * 16 + i) as i64;
            let session = format!("s{:04}", seq % SESSIONS as i64);
            let body = serde_json::to_string(&body(true, text.clone())).unwrap();
            tx.prepare_cached("INSERT INTO frames VALUES (?1, ?2, ?3, ?4)")
                .unwrap()
                .execute(rusqlite::params![session, seq, seq, body])
                .unwrap();
            if ours {
                tx.prepare_cached(
                    "INSERT INTO docs (session, seq, kind, text) VALUES (?1, ?2, 'answer', ?3)",
                )
                .unwrap()
                .execute(rusqlite::params![session, seq, text])
                .unwrap();
                tx.prepare_cached("INSERT INTO fts (rowid, text) VALUES (last_insert_rowid(), ?1)")
                    .unwrap()
                    .execute([text])
                    .unwrap();
            } else if index.is_some() {
                tx.prepare_cached("INSERT INTO fts (rowid, text) VALUES (?1, ?2)")
                    .unwrap()
                    .execute(rusqlite::params![seq + 1, text])
                    .unwrap();
            }
        }
        tx.commit().unwrap();
    }
    started.elapsed().as_secs_f64()
}

/// The floor (see the module's docs): three interleaved rounds, every one
/// printed.
fn floor(dir: &std::path::Path) {
    let n = env_or("BENCH_FLOOR_FRAMES", 100_000);
    let mut words = Words(99);
    let texts: Vec<String> = (0..n).map(|_| words.sentence(20)).collect();
    println!(
        "floor: {n} frames of 20 words on one thread, 16 per transaction; \
         index work as a fraction f of the plain insert's (goal needs f <= 0.11)"
    );
    for round in 1..=3 {
        let plain = floor_run(dir, &texts, None);
        let mut line = format!("  round {round}: plain {plain:.2} s");
        for (name, schema) in FLOOR_VARIANTS {
            let with = floor_run(dir, &texts, Some(schema));
            line.push_str(&format!("; {name}: f = {:.2}", with / plain - 1.0));
        }
        println!("{line}");
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let frames = env_or("BENCH_FRAMES", 200_000);
    let per_round = frames / ROUNDS;
    let dir = tempfile::tempdir().unwrap();
    if env_or("BENCH_FLOOR", 1) == 1 {
        floor(dir.path());
    }
    let plain = open(dir.path(), "plain.db").await;
    let indexed = open(dir.path(), "indexed.db").await;
    println!(
        "search_bench: {frames} frames of 20 words in {ROUNDS} rounds, {WRITERS} writers, \
         {SESSIONS} sessions; not indexed (text deltas) vs indexed (answers), interleaved"
    );
    println!(
        "{:>5}  {:>16}  {:>16}  {:>7}  {:>16}",
        "round", "not indexed /s", "indexed /s", "ratio", "caught up after"
    );
    for round in 0..ROUNDS {
        let a = append_round(&plain, per_round, false, round as u64).await;
        let b = append_round(&indexed, per_round, true, round as u64).await;
        let caught_up = drain(&indexed, round).await;
        println!(
            "{:>5}  {a:>16.0}  {b:>16.0}  {:>7.3}  {:>13.0} ms",
            round + 1,
            b / a,
            caught_up.as_secs_f64() * 1e3
        );
    }
    let mut words = Words(42);
    for n in [1, 2] {
        let mut times = Vec::new();
        let mut hits = 0;
        for _ in 0..1000 {
            let query = SearchQuery::new(words.sentence(n));
            let started = Instant::now();
            hits += indexed.search(&query).await.unwrap().len();
            times.push(started.elapsed());
        }
        times.sort();
        println!(
            "query of {n} word(s) over {frames} indexed frames: p50 {:.2} ms, p99 {:.2} ms \
             (1000 queries, {:.1} hits each on average, 20 at most)",
            pct(&times, 0.5),
            pct(&times, 0.99),
            hits as f64 / 1000.0
        );
    }
}
