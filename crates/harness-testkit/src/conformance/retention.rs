//! The retention conformance suite (`SessionLog::delete` and
//! `SessionLog::trim`, `docs/retention.md`): every store that offers them
//! runs it against fresh, empty logs. A deleted session is gone from info,
//! reads, the list and search, and its fork keeps its own copy; a trimmed
//! log answers `Gone` inside its cut, keeps its meta, verifies from the cut
//! under the store's chain key, forks past it with the right meta, and
//! refuses a cut that would leave no frame.
//!
//! Search is checked where the store keeps an index (a store whose
//! `search` is `Unsupported` skips those checks).

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use harness_core::frame::{FrameBody, MessageKind, SessionId};
use harness_core::log::{verify_log, AppendRequest, ChainKey, LogCut, SessionLog};
use harness_core::search::SearchQuery;
use harness_core::ErrorKind;

/// Run every check, each on a fresh log from `factory`; `key` is the
/// chain key the store was given (unkeyed when none).
pub async fn run_all<F, Fut>(factory: F, key: &ChainKey) -> Result<()>
where
    F: Fn() -> Fut,
    Fut: Future<Output = Arc<dyn SessionLog>>,
{
    a_deleted_session_is_gone_and_its_fork_stays(factory().await)
        .await
        .context("a_deleted_session_is_gone_and_its_fork_stays")?;
    a_trimmed_log_answers_gone_and_verifies_from_its_cut(factory().await, key)
        .await
        .context("a_trimmed_log_answers_gone_and_verifies_from_its_cut")?;
    a_fork_past_the_cut_has_the_meta_of_an_untrimmed_fork(factory().await, key)
        .await
        .context("a_fork_past_the_cut_has_the_meta_of_an_untrimmed_fork")?;
    bad_cuts_are_refused_and_change_nothing(factory().await)
        .await
        .context("bad_cuts_are_refused_and_change_nothing")?;
    Ok(())
}

fn sid(s: &str) -> SessionId {
    SessionId::parse(s).expect("valid test id")
}

fn prompt(text: &str) -> FrameBody {
    FrameBody::UserMessage {
        text: text.into(),
        turn_id: None,
    }
}

fn answer(turn: &str, text: &str) -> FrameBody {
    FrameBody::Message {
        turn_id: turn.into(),
        id: format!("m-{text}"),
        kind: MessageKind::Text,
        text: text.into(),
        interrupted: false,
    }
}

/// `true` when the store keeps a search index.
async fn searchable(log: &Arc<dyn SessionLog>) -> Result<bool> {
    match log.search(&SearchQuery::new("anything")).await {
        Ok(_) => Ok(true),
        Err(e) if e.kind() == ErrorKind::Unsupported => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// The sessions and seqs `word` finds, once the index holds `expect`
/// hits (a store may index after the commit: at most 5 s).
async fn hits_settled(
    log: &Arc<dyn SessionLog>,
    word: &str,
    expect: usize,
) -> Result<Vec<(String, u64)>> {
    let started = Instant::now();
    loop {
        let hits: Vec<(String, u64)> = log
            .search(&SearchQuery::new(word))
            .await?
            .into_iter()
            .map(|h| (h.session.to_string(), h.seq))
            .collect();
        if hits.len() == expect || started.elapsed() > Duration::from_secs(5) {
            return Ok(hits);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn expect_kind<T: std::fmt::Debug>(
    got: harness_core::Result<T>,
    kind: ErrorKind,
    what: &str,
) -> Result<()> {
    match got {
        Err(e) if e.kind() == kind => Ok(()),
        other => bail!("{what}: expected {kind}, got {other:?}"),
    }
}

/// Delete: the session is gone from info, reads, the list and search; its
/// fork and the other sessions are untouched; deleting it again is
/// `NotFound`; its id can be used again for a new, empty log.
pub async fn a_deleted_session_is_gone_and_its_fork_stays(log: Arc<dyn SessionLog>) -> Result<()> {
    let (gone, kept, fork) = (sid("ret-gone"), sid("ret-kept"), sid("ret-fork"));
    for s in [&gone, &kept] {
        log.create(s).await?;
    }
    log.append(
        &gone,
        AppendRequest::idempotent(prompt("quokka parser"), "p1"),
    )
    .await?;
    log.append(&gone, AppendRequest::new(answer("t1", "quokka done")))
        .await?;
    log.append(&kept, AppendRequest::new(prompt("wombat parser")))
        .await?;
    log.fork(&gone, 2, &fork).await?;
    let search = searchable(&log).await?;
    if search {
        let hits = hits_settled(&log, "quokka", 4).await?;
        ensure!(hits.len() == 4, "before the delete: {hits:?}");
    }

    log.delete(&gone).await?;
    expect_kind(log.info(&gone).await, ErrorKind::NotFound, "info")?;
    expect_kind(log.read(&gone, 0, 10).await, ErrorKind::NotFound, "read")?;
    expect_kind(
        log.append(&gone, AppendRequest::new(prompt("late"))).await,
        ErrorKind::NotFound,
        "an append to a deleted session",
    )?;
    expect_kind(
        log.delete(&gone).await,
        ErrorKind::NotFound,
        "a second delete",
    )?;
    expect_kind(
        log.delete(&sid("ret-nobody")).await,
        ErrorKind::NotFound,
        "deleting an unknown session",
    )?;
    let listed: Vec<String> = log
        .list()
        .await?
        .into_iter()
        .map(|i| i.session.to_string())
        .collect();
    ensure!(
        listed == ["ret-fork", "ret-kept"],
        "the list after the delete: {listed:?}"
    );
    let forked = log.read(&fork, 0, 10).await?;
    ensure!(
        forked.len() >= 2 && forked[0].body == prompt("quokka parser"),
        "the fork keeps its copy: {forked:?}"
    );
    ensure!(
        log.read(&kept, 0, 10).await?.len() == 1,
        "the other session"
    );
    if search {
        let hits = hits_settled(&log, "quokka", 2).await?;
        ensure!(
            hits.iter().all(|(s, _)| s == "ret-fork") && hits.len() == 2,
            "a deleted session's frames are not found, its fork's are: {hits:?}"
        );
        let hits = hits_settled(&log, "parser", 2).await?;
        ensure!(hits.len() == 2, "the other sessions still found: {hits:?}");
    }

    // The id is free again: a new log, starting at seq 1, with its own key
    // space (the deleted log's keys went with it).
    log.create(&gone).await?;
    let again = log
        .append(&gone, AppendRequest::idempotent(prompt("fresh"), "p1"))
        .await?;
    ensure!(
        again.seq == 1 && !again.duplicate,
        "a session made again under a deleted id starts empty: {again:?}"
    );
    ensure!(
        log.info(&gone).await?.meta.turns == 1,
        "its meta starts over too"
    );
    Ok(())
}

/// Ten frames; trim through 4: reads inside the cut are `Gone`, from the
/// cut on they give frames 5.., the meta is what it was, the chain
/// verifies from the cut to the same head, appends go on at 11, search no
/// longer finds the trimmed frames. A second trim moves the cut on; one
/// at or before it changes nothing.
pub async fn a_trimmed_log_answers_gone_and_verifies_from_its_cut(
    log: Arc<dyn SessionLog>,
    key: &ChainKey,
) -> Result<()> {
    let s = sid("ret-trim");
    log.create(&s).await?;
    for i in 1..=10u64 {
        let body = if i % 5 == 1 {
            prompt(&format!("numbat{i} go"))
        } else {
            answer("t", &format!("numbat{i} said"))
        };
        log.append(&s, AppendRequest::idempotent(body, format!("k{i}")))
            .await?;
    }
    let before = log.info(&s).await?;
    let chain = log.read_chain(&s, 0, 100).await?;
    let head = verify_log(log.clone(), &s, key).await?;
    ensure!(head.intact() && head.frames == 10, "{head:?}");
    let search = searchable(&log).await?;
    if search {
        ensure!(hits_settled(&log, "numbat2", 1).await?.len() == 1);
    }

    let info = log.trim(&s, 4).await?;
    ensure!(
        info.trimmed
            == Some(LogCut {
                through: 4,
                hash: chain[3].hash
            }),
        "the cut names frame 4 and keeps its hash: {:?}",
        info.trimmed
    );
    ensure!(
        info.last_seq == 10 && info.meta == before.meta && info.sealed == before.sealed,
        "a trim keeps the head and the meta: {info:?} vs {before:?}"
    );
    ensure!(
        log.info(&s).await?.trimmed == info.trimmed,
        "info reports the cut"
    );
    for after in [0, 3] {
        expect_kind(
            log.read(&s, after, 10).await,
            ErrorKind::Gone,
            &format!("read after {after}"),
        )?;
        expect_kind(
            log.read_chain(&s, after, 10).await,
            ErrorKind::Gone,
            &format!("read_chain after {after}"),
        )?;
    }
    let kept = log.read(&s, 4, 100).await?;
    ensure!(
        kept.iter().map(|f| f.seq).eq(5..=10),
        "frames 5..=10 kept: {:?}",
        kept.iter().map(|f| f.seq).collect::<Vec<_>>()
    );
    let kept_chain = log.read_chain(&s, 4, 100).await?;
    ensure!(
        kept_chain == chain[4..],
        "the kept frames are stored as they were"
    );
    let report = verify_log(log.clone(), &s, key).await?;
    ensure!(
        report.intact() && report.frames == 6 && report.head == head.head,
        "the kept frames verify from the cut to the same head: {report:?}"
    );
    let wrong = verify_log(log.clone(), &s, &ChainKey::new(*b"another key")).await?;
    ensure!(
        !wrong.intact(),
        "a walk from the cut with another key fails: {wrong:?}"
    );
    if search {
        ensure!(
            hits_settled(&log, "numbat2", 0).await?.is_empty(),
            "a trimmed frame is not found"
        );
        let hits = hits_settled(&log, "numbat6", 1).await?;
        ensure!(hits == [("ret-trim".into(), 6)], "a kept one is: {hits:?}");
    }

    let next = log
        .append(&s, AppendRequest::new(answer("t", "numbat11")))
        .await?;
    ensure!(next.seq == 11, "appends go on after a trim: {}", next.seq);
    let same = log.trim(&s, 2).await?;
    ensure!(
        same.trimmed.map(|c| c.through) == Some(4),
        "a cut before the current one changes nothing: {:?}",
        same.trimmed
    );
    let moved = log.trim(&s, 7).await?;
    ensure!(
        moved.trimmed
            == Some(LogCut {
                through: 7,
                hash: chain[6].hash
            }),
        "{:?}",
        moved.trimmed
    );
    expect_kind(log.read(&s, 5, 10).await, ErrorKind::Gone, "read after 5")?;
    let report = verify_log(log.clone(), &s, key).await?;
    ensure!(report.intact() && report.frames == 4, "{report:?}");
    // A sealed log can be trimmed too (archived sessions age out).
    log.seal(&s).await?;
    let sealed = log.trim(&s, 9).await?;
    ensure!(sealed.sealed && sealed.trimmed.map(|c| c.through) == Some(9));
    Ok(())
}

/// A fork past a trimmed log's cut holds the frames from the cut to its
/// end, keeps the cut, verifies, and has the meta a fork of the same
/// frames untrimmed has; a fork at or before the cut is `Gone`.
pub async fn a_fork_past_the_cut_has_the_meta_of_an_untrimmed_fork(
    log: Arc<dyn SessionLog>,
    key: &ChainKey,
) -> Result<()> {
    let (trimmed, twin) = (sid("ret-src"), sid("ret-twin"));
    for s in [&trimmed, &twin] {
        log.create(s).await?;
        for turn in 1..=3 {
            log.append(s, AppendRequest::new(prompt(&format!("turn {turn}"))))
                .await?;
            log.append(
                s,
                AppendRequest::new(answer(&format!("t{turn}"), &format!("done {turn}"))),
            )
            .await?;
        }
    }
    log.trim(&trimmed, 3).await?;
    expect_kind(
        log.fork(&trimmed, 3, &sid("ret-f0")).await,
        ErrorKind::Gone,
        "a fork at the cut",
    )?;
    expect_kind(
        log.info(&sid("ret-f0")).await,
        ErrorKind::NotFound,
        "no fork made",
    )?;
    let fork = log.fork(&trimmed, 5, &sid("ret-f1")).await?;
    let untrimmed = log.fork(&twin, 5, &sid("ret-f2")).await?;
    // The closing frame names each fork's source; the rest is the same.
    let unnamed = |meta: &harness_core::session::SessionMeta| {
        let mut meta = meta.clone();
        if let Some(turn) = meta.turn.as_mut() {
            turn.error = turn
                .error
                .as_ref()
                .map(|e| e.replace("ret-twin", "ret-src"));
        }
        meta
    };
    ensure!(
        unnamed(&fork.meta) == unnamed(&untrimmed.meta) && fork.last_seq == untrimmed.last_seq,
        "a fork past the cut folds the same meta:\n{:?}\n{:?}",
        fork.meta,
        untrimmed.meta
    );
    ensure!(
        fork.trimmed.map(|c| c.through) == Some(3),
        "the fork keeps the cut: {:?}",
        fork.trimmed
    );
    expect_kind(
        log.read(&fork.session, 0, 10).await,
        ErrorKind::Gone,
        "fork read",
    )?;
    let frames = log.read(&fork.session, 3, 10).await?;
    ensure!(frames.first().map(|f| f.seq) == Some(4), "{frames:?}");
    let report = verify_log(log.clone(), &fork.session, key).await?;
    ensure!(
        report.intact(),
        "the fork verifies from the cut: {report:?}"
    );
    Ok(())
}

/// Cuts that would leave no frame, or none at all, are `InvalidInput`
/// and change nothing; an unknown session is `NotFound`.
pub async fn bad_cuts_are_refused_and_change_nothing(log: Arc<dyn SessionLog>) -> Result<()> {
    let s = sid("ret-bad");
    log.create(&s).await?;
    expect_kind(
        log.trim(&s, 1).await,
        ErrorKind::InvalidInput,
        "an empty log",
    )?;
    for i in 0..3 {
        log.append(&s, AppendRequest::new(prompt(&format!("p{i}"))))
            .await?;
    }
    for through in [0, 3, 4, u64::MAX] {
        match log.trim(&s, through).await {
            Err(e) if e.kind() == ErrorKind::InvalidInput => ensure!(
                e.to_string().contains("keeps at least the newest"),
                "the refusal says why: {e}"
            ),
            other => bail!("trim through {through}: expected InvalidInput, got {other:?}"),
        }
    }
    let info = log.info(&s).await?;
    ensure!(
        info.trimmed.is_none() && log.read(&s, 0, 10).await?.len() == 3,
        "nothing changed: {info:?}"
    );
    expect_kind(
        log.trim(&sid("ret-nobody"), 1).await,
        ErrorKind::NotFound,
        "an unknown session",
    )?;
    Ok(())
}
