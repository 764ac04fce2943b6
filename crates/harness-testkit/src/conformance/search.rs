//! The search conformance suite (`SessionLog::search`, `docs/search.md`):
//! every store that keeps an index runs it against fresh, empty logs —
//! 1,000 sessions of generated frames with ranked hits naming session and
//! seq, the filters, a new frame found within a second of its append (a
//! store may index after the commit), a fork's index, and bad queries
//! refused.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use harness_core::frame::{FrameBody, MessageKind, SessionId};
use harness_core::log::{AppendRequest, SessionLog};
use harness_core::part::StreamPart;
use harness_core::search::{DocKind, SearchHit, SearchQuery};
use harness_core::session::SessionConfig;
use harness_core::ErrorKind;
use serde_json::json;

/// Run every check, each on a fresh log from `factory`.
pub async fn run_all<F, Fut>(factory: F) -> Result<()>
where
    F: Fn() -> Fut,
    Fut: Future<Output = Arc<dyn SessionLog>>,
{
    a_thousand_sessions_are_searched_by_words_with_ranked_hits(factory().await)
        .await
        .context("a_thousand_sessions_are_searched_by_words_with_ranked_hits")?;
    a_new_frame_is_found_as_soon_as_it_is_stored(factory().await)
        .await
        .context("a_new_frame_is_found_as_soon_as_it_is_stored")?;
    a_fork_finds_its_prefix_and_its_own_frames(factory().await)
        .await
        .context("a_fork_finds_its_prefix_and_its_own_frames")?;
    bad_queries_are_refused_with_the_reason(factory().await)
        .await
        .context("bad_queries_are_refused_with_the_reason")?;
    Ok(())
}

fn sid(s: &str) -> SessionId {
    SessionId::parse(s).expect("valid test id")
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

/// How long a store may take to make an appended frame searchable.
pub const SEARCHABLE_WITHIN: Duration = Duration::from_secs(1);

/// The hits of `query` once `done` holds for them, polling (a store may
/// index after the commit) for at most twice [`SEARCHABLE_WITHIN`]; the
/// last hits either way.
async fn settled(
    log: &dyn SessionLog,
    query: &SearchQuery,
    done: impl Fn(&[SearchHit]) -> bool,
) -> Result<Vec<SearchHit>> {
    let started = Instant::now();
    loop {
        let hits = log.search(query).await?;
        if done(&hits) || started.elapsed() > 2 * SEARCHABLE_WITHIN {
            return Ok(hits);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn places(hits: &[SearchHit]) -> Vec<(String, u64)> {
    let mut p: Vec<(String, u64)> = hits
        .iter()
        .map(|h| (h.session.as_str().to_string(), h.seq))
        .collect();
    p.sort();
    p
}

/// Session `i` of `n` generated ones: its own word (`zeta<i>`) in the
/// prompt (seq 1), a command naming a crate shared by every 37th session
/// (seq 2), a result, an answer; agents and providers alternate.
pub async fn generate(log: &dyn SessionLog, n: usize) -> Result<()> {
    for i in 0..n {
        let id = sid(&format!("s{i:04}"));
        let agent = if i % 2 == 0 { "claude-code" } else { "codex" };
        let provider = if i % 3 == 0 { "docker" } else { "local" };
        log.create_with(&id, Some(SessionConfig::new(agent, provider)))
            .await?;
        log.append(&id, prompt(&format!("please fix the parser of zeta{i}")))
            .await?;
        log.append(&id, bash(&format!("cargo test -p crate{}", i % 37)))
            .await?;
        log.append(&id, ran("test result: ok. 12 passed")).await?;
        log.append(&id, answer("Fixed: the tokenizer skipped a byte."))
            .await?;
    }
    // The last frame searchable: everything before it is too (a store
    // indexes in commit order).
    let end = sid("zz-generated");
    log.create(&end).await?;
    let marker = format!("generatedmarker{n}");
    log.append(&end, prompt(&marker)).await?;
    let hits = settled(log, &q(&marker), |h| !h.is_empty()).await?;
    ensure!(
        hits.len() == 1,
        "the last generated frame is not searchable: {hits:?}"
    );
    Ok(())
}

/// 1,000 sessions: a session's own word finds it at the prompt's seq; a
/// word shared by every 37th session finds exactly those, at the tool
/// call's seq, up to the limit; every word must appear; a frame dense with
/// the word ranks before one mentioning it in passing; the filters narrow
/// by agent, provider, time and the latest turn's status.
pub async fn a_thousand_sessions_are_searched_by_words_with_ranked_hits(
    log: Arc<dyn SessionLog>,
) -> Result<()> {
    generate(log.as_ref(), 1000).await?;

    let hits = log.search(&q("zeta417")).await?;
    ensure!(places(&hits) == [("s0417".to_string(), 1)], "{hits:?}");
    ensure!(hits[0].kind == DocKind::Prompt, "{hits:?}");
    ensure!(hits[0].snippet.contains("[zeta417]"), "{}", hits[0].snippet);

    let mut wide = q("crate5");
    wide.limit = Some(200);
    let hits = log.search(&wide).await?;
    let want: Vec<(String, u64)> = (0..1000)
        .filter(|i| i % 37 == 5)
        .map(|i| (format!("s{i:04}"), 2))
        .collect();
    ensure!(places(&hits) == want, "{:?}", places(&hits));
    ensure!(hits.iter().all(|h| h.kind == DocKind::ToolCall), "{hits:?}");
    let mut few = q("crate5");
    few.limit = Some(3);
    ensure!(log.search(&few).await?.len() == 3);

    ensure!(log.search(&q("ZETA9 Parser")).await?.len() == 1);
    ensure!(log.search(&q("zeta9 tokenizer")).await?.is_empty());
    ensure!(log.search(&q("nowhere")).await?.is_empty());

    let r = sid("ranked");
    log.create(&r).await?;
    log.append(
        &r,
        answer(&format!("the needle, among {}", "hay ".repeat(200))),
    )
    .await?;
    log.append(&r, answer("needle needle needle")).await?;
    let hits = settled(log.as_ref(), &q("needle"), |h| h.len() == 2).await?;
    ensure!(hits.len() == 2, "{hits:?}");
    ensure!(hits[0].seq == 2 && hits[0].rank <= hits[1].rank, "{hits:?}");

    let mut by_agent = q("crate5");
    by_agent.limit = Some(200);
    by_agent.agent = Some("codex".into());
    let hits = log.search(&by_agent).await?;
    ensure!(!hits.is_empty());
    for h in &hits {
        let i: usize = h.session.as_str()[1..].parse()?;
        ensure!(i % 2 == 1, "{h:?}");
    }
    by_agent.provider = Some("docker".into());
    let hits = log.search(&by_agent).await?;
    ensure!(!hits.is_empty());
    for h in &hits {
        let i: usize = h.session.as_str()[1..].parse()?;
        ensure!((i % 2, i % 3) == (1, 0), "{h:?}");
    }
    let mut by_time = q("zeta3");
    by_time.after_ms = Some(u64::MAX / 4);
    ensure!(log.search(&by_time).await?.is_empty());
    by_time.after_ms = None;
    by_time.before_ms = Some(u64::MAX / 4);
    ensure!(log.search(&by_time).await?.len() == 1);
    let mut by_status = q("zeta3");
    by_status.status = Some("finished".into());
    ensure!(log.search(&by_status).await?.is_empty());
    by_status.status = Some("not_started".into());
    ensure!(log.search(&by_status).await?.len() == 1);
    Ok(())
}

/// A frame is found within [`SEARCHABLE_WITHIN`] of its append.
pub async fn a_new_frame_is_found_as_soon_as_it_is_stored(log: Arc<dyn SessionLog>) -> Result<()> {
    generate(log.as_ref(), 50).await?;
    let id = sid("s0007");
    let started = Instant::now();
    let appended = log.append(&id, bash("grep -rn kappa_marker src/")).await?;
    let hits = settled(log.as_ref(), &q("kappa_marker"), |h| !h.is_empty()).await?;
    let took = started.elapsed();
    ensure!(
        places(&hits) == [("s0007".to_string(), appended.seq)],
        "{hits:?}"
    );
    ensure!(took < SEARCHABLE_WITHIN, "{took:?}");
    Ok(())
}

/// A fork's index is its prefix's: the source's later frames are not found
/// in the fork, and the fork's own frames are found there only.
pub async fn a_fork_finds_its_prefix_and_its_own_frames(log: Arc<dyn SessionLog>) -> Result<()> {
    let src = sid("src");
    log.create(&src).await?;
    log.append(&src, prompt("alpha one")).await?;
    log.append(&src, answer("beta two")).await?;
    log.fork(&src, 1, &sid("copy")).await?;
    log.append(&sid("copy"), answer("gamma three")).await?;
    settled(log.as_ref(), &q("gamma"), |h| !h.is_empty()).await?;
    let alpha = places(&settled(log.as_ref(), &q("alpha"), |h| h.len() == 2).await?);
    ensure!(
        alpha == [("copy".to_string(), 1), ("src".to_string(), 1)],
        "{alpha:?}"
    );
    let beta = places(&log.search(&q("beta")).await?);
    ensure!(beta == [("src".to_string(), 2)], "{beta:?}");
    let gamma = places(&log.search(&q("gamma")).await?);
    ensure!(gamma.len() == 1 && gamma[0].0 == "copy", "{gamma:?}");
    Ok(())
}

/// Queries with nothing to search for, too long, or with a bad limit are
/// refused as bad input; the index's own query syntax in a query is read
/// as words.
pub async fn bad_queries_are_refused_with_the_reason(log: Arc<dyn SessionLog>) -> Result<()> {
    let long = "word ".repeat(300);
    for text in ["", "  ", "*** ()", long.as_str()] {
        let err = log
            .search(&q(text))
            .await
            .err()
            .with_context(|| format!("{text:?} was taken"))?;
        ensure!(err.kind() == ErrorKind::InvalidInput, "{text:?}: {err}");
    }
    let mut zero = q("x");
    zero.limit = Some(0);
    let err = log.search(&zero).await.err().context("limit 0 was taken")?;
    ensure!(err.kind() == ErrorKind::InvalidInput, "{err}");
    ensure!(log.search(&q("NEAR(a b) OR \"x")).await?.is_empty());
    Ok(())
}
