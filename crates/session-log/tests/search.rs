//! Search across sessions on the SQLite log (FTS5, fed by the append
//! decision's document in the append's own transaction): 1,000 sessions of
//! generated frames, ranked hits naming session and seq, a new frame found
//! at once, the filters, forks, a database indexed at open, and bad input.

use std::sync::Arc;
use std::time::{Duration, Instant};

use harness_core::frame::{FrameBody, MessageKind, SessionId};
use harness_core::log::{AppendRequest, SessionLog};
use harness_core::part::StreamPart;
use harness_core::search::{DocKind, SearchQuery};
use harness_core::session::SessionConfig;
use harness_core::ErrorKind;
use serde_json::json;
use session_log::SqliteSessionLog;

fn sid(s: &str) -> SessionId {
    SessionId::parse(s).unwrap()
}

fn prompt(text: &str) -> AppendRequest {
    AppendRequest::new(FrameBody::UserMessage {
        text: text.into(),
        turn_id: None,
    })
}

fn answer(text: &str) -> AppendRequest {
    AppendRequest::new(FrameBody::Message {
        turn_id: "t1".into(),
        id: "m1".into(),
        kind: MessageKind::Text,
        text: text.into(),
        interrupted: false,
    })
}

fn bash(command: &str) -> AppendRequest {
    AppendRequest::new(FrameBody::Part {
        turn_id: "t1".into(),
        part: StreamPart::ToolCall {
            tool_call_id: "c1".into(),
            tool_name: "Bash".into(),
            input: json!({ "command": command }),
        },
    })
}

fn ran(output: &str) -> AppendRequest {
    AppendRequest::new(FrameBody::Part {
        turn_id: "t1".into(),
        part: StreamPart::ToolResult {
            tool_call_id: "c1".into(),
            tool_name: "Bash".into(),
            output: json!(output),
            is_error: false,
        },
    })
}

fn q(text: &str) -> SearchQuery {
    SearchQuery::new(text)
}

/// Session `i` of the generated thousand: its own word (`zeta<i>`) in the
/// prompt, a command naming a crate shared by every 37th session, an
/// answer, a result; agents and providers alternate.
async fn generate(log: &SqliteSessionLog, n: usize) {
    for i in 0..n {
        let id = sid(&format!("s{i:04}"));
        let agent = if i % 2 == 0 { "claude-code" } else { "codex" };
        let provider = if i % 3 == 0 { "docker" } else { "local" };
        log.create_with(&id, Some(SessionConfig::new(agent, provider)))
            .await
            .unwrap();
        log.append(&id, prompt(&format!("please fix the parser of zeta{i}")))
            .await
            .unwrap();
        log.append(&id, bash(&format!("cargo test -p crate{}", i % 37)))
            .await
            .unwrap();
        log.append(&id, ran("test result: ok. 12 passed"))
            .await
            .unwrap();
        log.append(&id, answer("Fixed: the tokenizer skipped a byte."))
            .await
            .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_sessions_are_searched_by_words_with_ranked_hits() {
    let dir = tempfile::tempdir().unwrap();
    let log = SqliteSessionLog::open(dir.path().join("search.db")).unwrap();
    generate(&log, 1000).await;

    // One session's own word: that session, the prompt's seq.
    let hits = log.search(&q("zeta417")).await.unwrap();
    assert_eq!(hits.len(), 1, "{hits:?}");
    assert_eq!((hits[0].session.as_str(), hits[0].seq), ("s0417", 1));
    assert_eq!(hits[0].kind, DocKind::Prompt);
    assert!(hits[0].snippet.contains("[zeta417]"), "{}", hits[0].snippet);

    // A crate name shared by every 37th session: all of them, at the tool
    // call's seq, as many as asked for.
    let mut wide = q("crate5");
    wide.limit = Some(200);
    let hits = log.search(&wide).await.unwrap();
    let want: Vec<String> = (0..1000)
        .filter(|i| i % 37 == 5)
        .map(|i| format!("s{i:04}"))
        .collect();
    let mut got: Vec<String> = hits.iter().map(|h| h.session.as_str().to_string()).collect();
    got.sort();
    assert_eq!(got, want);
    assert!(hits.iter().all(|h| h.seq == 2 && h.kind == DocKind::ToolCall));
    let mut few = q("crate5");
    few.limit = Some(3);
    assert_eq!(log.search(&few).await.unwrap().len(), 3);

    // Every word must be there; order and case do not matter.
    assert_eq!(log.search(&q("ZETA9 Parser")).await.unwrap().len(), 1);
    assert!(log.search(&q("zeta9 tokenizer")).await.unwrap().is_empty());
    assert!(log.search(&q("nowhere")).await.unwrap().is_empty());

    // Ranked: a frame dense with the words comes before one that mentions
    // them in passing.
    let r = sid("ranked");
    log.create(&r).await.unwrap();
    log.append(&r, answer(&format!("the needle, among {}", "hay ".repeat(200))))
        .await
        .unwrap();
    log.append(&r, answer("needle needle needle"))
        .await
        .unwrap();
    let hits = log.search(&q("needle")).await.unwrap();
    assert_eq!(hits.len(), 2);
    assert_eq!(hits[0].seq, 2, "{hits:?}");
    assert!(hits[0].rank <= hits[1].rank, "{hits:?}");

    // The filters: agent, provider, time, the latest turn's status.
    let mut by_agent = q("crate5");
    by_agent.limit = Some(200);
    by_agent.agent = Some("codex".into());
    let hits = log.search(&by_agent).await.unwrap();
    assert!(!hits.is_empty());
    for h in &hits {
        let i: usize = h.session.as_str()[1..].parse().unwrap();
        assert_eq!(i % 2, 1, "{h:?}");
    }
    by_agent.provider = Some("docker".into());
    for h in log.search(&by_agent).await.unwrap() {
        let i: usize = h.session.as_str()[1..].parse().unwrap();
        assert_eq!((i % 2, i % 3), (1, 0), "{h:?}");
    }
    let mut by_time = q("zeta3");
    by_time.after_ms = Some(u64::MAX / 2);
    assert!(log.search(&by_time).await.unwrap().is_empty());
    by_time.after_ms = None;
    by_time.before_ms = Some(u64::MAX / 2);
    assert_eq!(log.search(&by_time).await.unwrap().len(), 1);
    let mut by_status = q("zeta3");
    by_status.status = Some("finished".into());
    assert!(log.search(&by_status).await.unwrap().is_empty());
    by_status.status = Some("not_started".into());
    assert_eq!(log.search(&by_status).await.unwrap().len(), 1);
}

/// A frame is found as soon as its append returns (the index row is
/// written in the append's transaction), well within a second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_frame_is_found_as_soon_as_it_is_stored() {
    let dir = tempfile::tempdir().unwrap();
    let log = Arc::new(SqliteSessionLog::open(dir.path().join("fresh.db")).unwrap());
    generate(&log, 50).await;
    let id = sid("s0007");
    let started = Instant::now();
    let appended = log
        .append(&id, bash("grep -rn kappa_marker src/"))
        .await
        .unwrap();
    let hits = log.search(&q("kappa_marker")).await.unwrap();
    let took = started.elapsed();
    assert_eq!(hits.len(), 1, "{hits:?}");
    assert_eq!((hits[0].session.clone(), hits[0].seq), (id, appended.seq));
    assert!(took < Duration::from_secs(1), "{took:?}");
}

/// A fork's index is its prefix's: the source's later frames are not
/// found in the fork; a frame appended to the fork is found there only.
#[tokio::test]
async fn a_fork_finds_its_prefix_and_its_own_frames() {
    let dir = tempfile::tempdir().unwrap();
    let log = SqliteSessionLog::open(dir.path().join("fork.db")).unwrap();
    let src = sid("src");
    log.create(&src).await.unwrap();
    log.append(&src, prompt("alpha one")).await.unwrap();
    log.append(&src, answer("beta two")).await.unwrap();
    log.fork(&src, 1, &sid("copy")).await.unwrap();
    log.append(&sid("copy"), answer("gamma three")).await.unwrap();
    let sessions = |hits: Vec<harness_core::search::SearchHit>| {
        let mut s: Vec<(String, u64)> = hits
            .into_iter()
            .map(|h| (h.session.as_str().to_string(), h.seq))
            .collect();
        s.sort();
        s
    };
    assert_eq!(
        sessions(log.search(&q("alpha")).await.unwrap()),
        [("copy".to_string(), 1), ("src".to_string(), 1)]
    );
    assert_eq!(
        sessions(log.search(&q("beta")).await.unwrap()),
        [("src".to_string(), 2)]
    );
    let gamma = sessions(log.search(&q("gamma")).await.unwrap());
    assert_eq!(gamma.len(), 1);
    assert_eq!(gamma[0].0, "copy");
}

/// A database written before the index existed is indexed when opened.
#[tokio::test]
async fn a_database_without_an_index_is_indexed_at_open() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("old.db");
    {
        let log = SqliteSessionLog::open(&path).unwrap();
        generate(&log, 20).await;
    }
    {
        // What a database of an earlier build looks like: no index rows,
        // user_version 0.
        let conn = rusqlite::Connection::open(&path).unwrap();
        conn.execute_batch(
            "DELETE FROM search_docs; INSERT INTO search_fts(search_fts) VALUES ('delete-all'); \
             PRAGMA user_version = 0;",
        )
        .unwrap();
    }
    let log = SqliteSessionLog::open(&path).unwrap();
    let hits = log.search(&q("zeta12")).await.unwrap();
    assert_eq!(hits.len(), 1, "{hits:?}");
    assert_eq!((hits[0].session.as_str(), hits[0].seq), ("s0012", 1));
}

#[tokio::test]
async fn bad_queries_are_refused_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let log = SqliteSessionLog::open(dir.path().join("bad.db")).unwrap();
    for text in ["", "  ", "*** ()", &"word ".repeat(300)] {
        let err = log.search(&q(text)).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidInput, "{text:?}: {err}");
    }
    let mut q0 = q("x");
    q0.limit = Some(0);
    assert_eq!(
        log.search(&q0).await.unwrap_err().kind(),
        ErrorKind::InvalidInput
    );
    // FTS5 syntax in a query is read as words, never as syntax.
    assert!(log.search(&q("NEAR(a b) OR \"x")).await.unwrap().is_empty());
}
