//! The `SessionLog` conformance suite. Every backend's tests call
//! [`run_all`] with a factory that makes a fresh, empty log.

use std::future::Future;
use std::sync::Arc;

use anyhow::{bail, ensure, Context, Result};
use harness_core::frame::{FrameBody, MessageKind, SessionId};
use harness_core::log::{fold_meta, verify_log, AppendRequest, ChainKey, SessionLog};
use harness_core::part::StreamPart;
use harness_core::sandbox::SandboxHandle;
use harness_core::session::SessionConfig;
use harness_core::turn::TurnStatus;
use harness_core::ErrorKind;

fn sid(s: &str) -> SessionId {
    SessionId::parse(s).expect("valid test id")
}

/// A stored message that opens no turn.
fn said(text: &str) -> FrameBody {
    FrameBody::Message {
        turn_id: "t0".into(),
        id: text.into(),
        kind: MessageKind::Text,
        text: text.into(),
        interrupted: false,
    }
}

fn prompt(text: &str) -> FrameBody {
    FrameBody::UserMessage {
        text: text.to_string(),
        turn_id: None,
    }
}

/// Run every check against fresh logs from `factory`.
pub async fn run_all<F, Fut>(factory: F) -> Result<()>
where
    F: Fn() -> Fut,
    Fut: Future<Output = Arc<dyn SessionLog>>,
{
    seq_starts_at_one_without_gaps(factory().await)
        .await
        .context("seq_starts_at_one_without_gaps")?;
    idempotent_append(factory().await)
        .await
        .context("idempotent_append")?;
    read_from_cursor(factory().await)
        .await
        .context("read_from_cursor")?;
    seal_refuses_appends(factory().await)
        .await
        .context("seal_refuses_appends")?;
    fork_copies_a_prefix(factory().await)
        .await
        .context("fork_copies_a_prefix")?;
    unknown_session_is_not_found(factory().await)
        .await
        .context("unknown_session_is_not_found")?;
    oversized_frame_is_refused(factory().await)
        .await
        .context("oversized_frame_is_refused")?;
    concurrent_appends_stay_gap_free(factory().await)
        .await
        .context("concurrent_appends_stay_gap_free")?;
    appends_answer_with_the_stored_frame(factory().await)
        .await
        .context("appends_answer_with_the_stored_frame")?;
    meta_is_folded_with_every_append(factory().await)
        .await
        .context("meta_is_folded_with_every_append")?;
    concurrent_retries_store_once(factory().await)
        .await
        .context("concurrent_retries_store_once")?;
    same_key_in_two_sessions(factory().await)
        .await
        .context("same_key_in_two_sessions")?;
    frame_of_exactly_the_limit(factory().await)
        .await
        .context("frame_of_exactly_the_limit")?;
    list_pages_in_id_order(factory().await)
        .await
        .context("list_pages_in_id_order")?;
    numbers_read_back_exactly(factory().await)
        .await
        .context("numbers_read_back_exactly")?;
    every_frame_is_chained(factory().await, &ChainKey::unkeyed())
        .await
        .context("every_frame_is_chained")?;
    Ok(())
}

/// The audit chain (`harness_core::log::chain`): every stored frame has a
/// hash that links it to the one before under the store's key (`key`,
/// which a store given none keeps unkeyed); `read_chain` hands back the
/// frames as stored, pages from a cursor, and a fork keeps its parent's
/// links up to the cut and chains on from there. A walk with another key
/// fails at the first frame.
pub async fn every_frame_is_chained(log: Arc<dyn SessionLog>, key: &ChainKey) -> Result<()> {
    let s = sid("chain");
    log.create(&s).await?;
    log.append(&s, AppendRequest::idempotent(prompt("go"), "k1"))
        .await?;
    log.append(&s, AppendRequest::new(said("one"))).await?;
    let retry = log
        .append(&s, AppendRequest::idempotent(prompt("go"), "k1"))
        .await?;
    ensure!(retry.duplicate, "the retry must be a duplicate");
    log.append(&s, AppendRequest::new(said("two"))).await?;
    let frames = log.read(&s, 0, 100).await?;
    let chained = log.read_chain(&s, 0, 100).await?;
    ensure!(
        chained.len() == 3 && frames.len() == 3,
        "3 frames stored (a duplicate adds no link), read_chain gave {}",
        chained.len()
    );
    for (c, f) in chained.iter().zip(&frames) {
        ensure!(
            c.seq == f.seq && c.at_ms == f.at_ms,
            "read_chain frame {} (at {}) is not read's frame {} (at {})",
            c.seq,
            c.at_ms,
            f.seq,
            f.at_ms
        );
        let body: FrameBody = serde_json::from_str(&c.body)
            .with_context(|| format!("frame {}'s stored body is not a frame body", c.seq))?;
        ensure!(
            body == f.body,
            "frame {}'s stored body is not its body",
            c.seq
        );
        ensure!(c.hash.is_some(), "frame {} has no hash", c.seq);
    }
    ensure!(
        chained[0].key.as_deref() == Some("k1") && chained[1].key.is_none(),
        "read_chain must carry each frame's idempotency key: {:?}, {:?}",
        chained[0].key,
        chained[1].key
    );
    let report = verify_log(log.clone(), &s, key).await?;
    ensure!(report.intact(), "a fresh log's chain must hold: {report:?}");
    ensure!(
        report.frames == 3 && report.head == chained[2].hash,
        "the walk read {} frames and ended at {:?}, not at frame 3's hash",
        report.frames,
        report.head
    );
    let wrong = verify_log(log.clone(), &s, &ChainKey::new(*b"not the store's key")).await?;
    ensure!(
        !wrong.intact(),
        "a walk with another key must fail: the chain is not keyed with the store's key"
    );
    let page = log.read_chain(&s, 1, 1).await?;
    ensure!(
        page.len() == 1 && page[0].seq == 2 && page[0].hash == chained[1].hash,
        "read_chain(after 1, limit 1) must give frame 2 alone"
    );

    // A fork in the middle of a turn: its prefix keeps the parent's links,
    // its closing frame chains from the parent's hash at the cut.
    let f = sid("chain-fork");
    let info = log.fork(&s, 2, &f).await?;
    let forked = log.read_chain(&f, 0, 100).await?;
    ensure!(
        forked.len() as u64 == info.last_seq && forked.len() >= 2,
        "the fork holds {} frames, read_chain gave {}",
        info.last_seq,
        forked.len()
    );
    ensure!(
        forked[..2]
            .iter()
            .map(|c| c.hash)
            .eq(chained[..2].iter().map(|c| c.hash)),
        "a fork's copied frames must keep their parent's hashes"
    );
    let report = verify_log(log.clone(), &f, key).await?;
    ensure!(report.intact(), "a fork's chain must hold: {report:?}");
    log.append(&f, AppendRequest::new(said("own"))).await?;
    let report = verify_log(log.clone(), &f, key).await?;
    ensure!(
        report.intact() && report.frames == info.last_seq + 1,
        "a fork's own frames chain on: {report:?}"
    );
    // The parent is untouched by its fork.
    let report = verify_log(log.clone(), &s, key).await?;
    ensure!(report.intact() && report.frames == 3, "{report:?}");

    match log.read_chain(&sid("chain-nobody"), 0, 10).await {
        Err(e) if e.kind() == ErrorKind::NotFound => {}
        other => bail!("read_chain of an unknown session must be NotFound, got {other:?}"),
    }
    Ok(())
}

/// A tool input's numbers as the agent sent them: the float the fuzzer
/// found changing on a fresh machine (`2.2222223222222223e58`), the f64
/// extremes, a subnormal, `-0.0`, and both 64-bit integer ends.
pub fn exact_numbers_input() -> serde_json::Value {
    serde_json::from_str(
        r#"{"fuzzFind":2.2222223222222223e+58,"max":1.7976931348623157e308,
            "minPositive":2.2250738585072014e-308,"subnormal":5e-324,"negativeZero":-0.0,
            "tenth":0.1,"third":0.3333333333333333,"i64Min":-9223372036854775808,
            "u64Max":18446744073709551615,"nested":[[{"x":1.0000000000000002}]]}"#,
    )
    .expect("valid JSON")
}

/// A frame holding [`exact_numbers_input`] reads back byte-identical
/// (encoded the same) from `read`, from the append's answer, from a
/// duplicate's answer, and from a fork.
pub async fn numbers_read_back_exactly(log: Arc<dyn SessionLog>) -> Result<()> {
    let s = sid("numbers");
    log.create(&s).await?;
    let body = FrameBody::Part {
        turn_id: "t0".into(),
        part: StreamPart::ToolCall {
            tool_call_id: "c1".into(),
            tool_name: "Bash".into(),
            input: exact_numbers_input(),
        },
    };
    let want = serde_json::to_string(&body)?;
    let appended = log
        .append(&s, AppendRequest::idempotent(body.clone(), "numbers"))
        .await?;
    ensure!(
        serde_json::to_string(&appended.frame.body)? == want,
        "the append answered with other numbers: {}",
        serde_json::to_string(&appended.frame.body)?
    );
    let read = log.read(&s, 0, 10).await?;
    ensure!(read.len() == 1, "read {} frames, want 1", read.len());
    let got = serde_json::to_string(&read[0].body)?;
    ensure!(got == want, "read back\n  {got}\nwant\n  {want}");
    // The retry compares what it decodes with what it sent: a store that
    // changed a number would answer a conflict here.
    let retry = log
        .append(&s, AppendRequest::idempotent(body, "numbers"))
        .await
        .context("a retry of the same frame")?;
    ensure!(retry.duplicate, "the retry stored a second frame");
    ensure!(serde_json::to_string(&retry.frame.body)? == want);
    let fork = sid("numbers-fork");
    log.fork(&s, 1, &fork).await?;
    let forked = log.read(&fork, 0, 10).await?;
    let got = serde_json::to_string(&forked[0].body)?;
    ensure!(got == want, "the fork read back\n  {got}\nwant\n  {want}");
    Ok(())
}

/// `list_page` walks `list` in id order: pages of at most `limit`,
/// each after the last id of the one before, concatenating to `list`;
/// `after` need not be an existing id.
pub async fn list_pages_in_id_order(log: Arc<dyn SessionLog>) -> Result<()> {
    for id in ["page-c", "page-a", "page-e", "page-b", "page-d"] {
        log.create(&SessionId::parse(id)?).await?;
    }
    let all: Vec<String> = log
        .list()
        .await?
        .into_iter()
        .map(|i| i.session.as_str().to_string())
        .collect();
    let mut walked = Vec::new();
    let mut after: Option<SessionId> = None;
    for _ in 0..=all.len() {
        let page = log.list_page(after.as_ref(), 2).await?;
        ensure!(page.len() <= 2, "a page of limit 2 held {}", page.len());
        let Some(last) = page.last() else { break };
        after = Some(last.session.clone());
        walked.extend(page.into_iter().map(|i| i.session.as_str().to_string()));
    }
    ensure!(
        walked == all,
        "the pages walked {walked:?}, list has {all:?}"
    );
    let between = log
        .list_page(Some(&SessionId::parse("page-bb")?), 2)
        .await?;
    let ids: Vec<&str> = between.iter().map(|i| i.session.as_str()).collect();
    ensure!(ids == ["page-c", "page-d"], "after page-bb came {ids:?}");
    let first = log.list_page(None, 1).await?;
    ensure!(
        first.len() == 1 && first[0].session.as_str() == all[0],
        "the first page of one is {first:?}"
    );
    Ok(())
}

/// An append answers with the frame exactly as a read returns it (seq,
/// `at_ms`, body), and a duplicate with the original frame: a session
/// actor fans it out without reading it back.
pub async fn appends_answer_with_the_stored_frame(log: Arc<dyn SessionLog>) -> Result<()> {
    let s = sid("stored-frame");
    log.create(&s).await?;
    let first = log
        .append(&s, AppendRequest::idempotent(prompt("one"), "k1"))
        .await?;
    let second = log.append(&s, AppendRequest::new(prompt("two"))).await?;
    let stored = log.read(&s, 0, 10).await?;
    ensure!(
        stored.len() == 2 && first.frame == stored[0] && second.frame == stored[1],
        "append answers {:?} / {:?} differ from what is read back {stored:?}",
        first.frame,
        second.frame
    );
    ensure!(
        first.seq == first.frame.seq,
        "seq {} vs frame {:?}",
        first.seq,
        first.frame
    );
    let retry = log
        .append(&s, AppendRequest::idempotent(prompt("one"), "k1"))
        .await?;
    ensure!(
        retry.duplicate && retry.frame == stored[0],
        "a duplicate must answer with the original frame, got {retry:?}"
    );
    Ok(())
}

/// `info().meta` is every frame folded with `SessionMeta::apply` (config
/// from `create_with`, runner generation, the latest turn with its key,
/// answers and abort, the sandbox and agent session of its end); a fork's
/// meta is its own prefix folded under the source's config.
pub async fn meta_is_folded_with_every_append(log: Arc<dyn SessionLog>) -> Result<()> {
    let s = sid("meta");
    let config = SessionConfig::new("codex", "docker");
    let info = log.create_with(&s, Some(config.clone())).await?;
    ensure!(
        info.meta.config.as_ref() == Some(&config) && info.meta.turn.is_none(),
        "a new log's meta: {:?}",
        info.meta
    );
    let handle = SandboxHandle {
        provider: "docker".into(),
        id: "c1".into(),
        workdir: "/workspace".into(),
        owned: true,
        data: serde_json::Value::Null,
    };
    let frames = turn_touching_every_field(&handle);
    let mut after_two = None;
    for (i, (body, key)) in frames.iter().enumerate() {
        let request = AppendRequest {
            body: body.clone(),
            idempotency_key: key.map(str::to_string),
        };
        log.append(&s, request).await?;
        if i == 1 {
            after_two = Some(log.info(&s).await?.meta);
        }
    }
    let expected = fold_meta(
        Some(config.clone()),
        frames.iter().zip(1..).map(|((b, k), seq)| (seq, b, *k)),
    );
    let meta = log.info(&s).await?.meta;
    ensure!(
        meta == expected,
        "stored meta {meta:?} is not the frames folded: {expected:?}"
    );
    ensure!(
        meta.generation == 7
            && meta.sandbox.as_ref() == Some(&handle)
            && meta.agent_session_id.as_deref() == Some("agent-1")
            && meta.active_turn().is_none(),
        "meta {meta:?}"
    );
    let after_two = after_two.expect("recorded");
    let turn = after_two
        .active_turn()
        .context("a turn runs after the prompt")?;
    ensure!(
        turn.key.as_deref() == Some("p1"),
        "the prompt's key is kept: {turn:?}"
    );
    forks_fold_their_prefix(log.as_ref(), &s, &config, &frames).await?;
    ensure!(
        after_two.active_turn().is_some(),
        "the source's turn was running at the cut"
    );
    Ok(())
}

/// The frames of one turn that touch every field of the meta, with their
/// idempotency keys: the runner attached, a prompt (key `p1`) opening
/// turn t1, its start (the agent session), an approval asked and
/// answered, an abort, and its end as failed (with the sandbox).
fn turn_touching_every_field(handle: &SandboxHandle) -> Vec<(FrameBody, Option<&'static str>)> {
    vec![
        (FrameBody::RunnerAttached { generation: 7 }, None),
        (
            FrameBody::UserMessage {
                text: "hi".into(),
                turn_id: Some("t1".into()),
            },
            Some("p1"),
        ),
        (
            FrameBody::Part {
                turn_id: "t1".into(),
                part: StreamPart::StreamStart {
                    agent_session_id: Some("agent-1".into()),
                },
            },
            Some("t1:0:0"),
        ),
        (
            FrameBody::Part {
                turn_id: "t1".into(),
                part: StreamPart::ToolApprovalRequest {
                    approval_id: "ap".into(),
                    tool_call_id: "c".into(),
                    tool_name: "Bash".into(),
                    input: serde_json::json!({}),
                },
            },
            None,
        ),
        (
            FrameBody::ApprovalResponse {
                approval_id: "ap".into(),
                approved: true,
                reason: None,
                turn_id: Some("t1".into()),
            },
            None,
        ),
        (
            FrameBody::AbortRequested {
                turn_id: "t1".into(),
                reason: "stop".into(),
            },
            None,
        ),
        (
            FrameBody::TurnStatus {
                turn_id: "t1".into(),
                status: TurnStatus::Failed,
                error: Some("aborted: stop".into()),
                code: None,
                sandbox: Some(handle.clone()),
                agent_session_id: None,
                checkpoint: None,
            },
            Some("t1:status:failed"),
        ),
    ]
}

/// Forks of `s` (the `frames` appended to a log created with `config`):
/// one between turns is its prefix folded under the source's config; one
/// inside turn t1 closes that turn with one frame of its own.
async fn forks_fold_their_prefix(
    log: &dyn SessionLog,
    s: &SessionId,
    config: &SessionConfig,
    frames: &[(FrameBody, Option<&str>)],
) -> Result<()> {
    // A fork between turns: its prefix folded under the source's config.
    let between = log.fork(s, 1, &sid("meta-fork-between")).await?;
    let expected = fold_meta(
        Some(config.clone()),
        frames[..1]
            .iter()
            .zip(1..)
            .map(|((b, k), seq)| (seq, b, *k)),
    );
    ensure!(
        between.last_seq == 1 && between.meta == expected,
        "a fork between turns is its prefix folded: {between:?}"
    );
    // A fork of the first two frames ends inside turn t1 (its prompt is
    // copied, its end is not): the fork closes it with one frame of its
    // own, so the fork takes a new prompt and never runs t1.
    let f = sid("meta-fork");
    let forked = log.fork(s, 2, &f).await?;
    let copied = log.read(&f, 0, 10).await?;
    ensure!(
        forked.last_seq == 3 && copied[..2] == log.read(s, 0, 2).await?[..],
        "the fork holds the prefix and one closing frame: {copied:?}"
    );
    ensure!(
        forked.forked_from.as_ref().map(|o| o.until) == Some(2),
        "the fork's origin is the cut, not its own frame: {forked:?}"
    );
    match &copied[2].body {
        FrameBody::TurnStatus {
            turn_id,
            status: TurnStatus::Failed,
            error: Some(error),
            ..
        } if turn_id == "t1" && error.contains("forked") => {}
        other => bail!("a fork inside a turn must end it as failed, got {other:?}"),
    }
    ensure!(
        forked.meta.active_turn().is_none()
            && forked.meta.turn.as_ref().map(|t| t.turn_id.as_str()) == Some("t1")
            && forked.meta.turn.as_ref().and_then(|t| t.key.as_deref()) == Some("p1")
            && forked.meta.generation == 7
            && forked.meta.config.as_ref() == Some(config),
        "fork meta {:?}",
        forked.meta
    );
    ensure!(
        log.info(&f).await?.meta == forked.meta,
        "fork meta changed on read"
    );
    Ok(())
}

/// Seqs are assigned by the log: 1, 2, 3, … with no gaps, across sessions
/// independently.
pub async fn seq_starts_at_one_without_gaps(log: Arc<dyn SessionLog>) -> Result<()> {
    let a = sid("seq-a");
    let b = sid("seq-b");
    log.create(&a).await?;
    log.create(&b).await?;
    for i in 1..=5u64 {
        let got = log
            .append(&a, AppendRequest::new(prompt(&format!("a{i}"))))
            .await?;
        ensure!(
            got.seq == i && !got.duplicate,
            "append #{i} to a got {got:?}, expected seq {i}"
        );
    }
    let got = log.append(&b, AppendRequest::new(prompt("b1"))).await?;
    ensure!(
        got.seq == 1,
        "a second session must start at seq 1, got {}",
        got.seq
    );
    let frames = log.read(&a, 0, 100).await?;
    let seqs: Vec<u64> = frames.iter().map(|f| f.seq).collect();
    ensure!(seqs == vec![1, 2, 3, 4, 5], "read back seqs {seqs:?}");
    ensure!(
        frames[2].body == prompt("a3"),
        "frame 3 holds {:?}",
        frames[2].body
    );
    let info = log.info(&a).await?;
    ensure!(info.last_seq == 5 && !info.sealed, "info {info:?}");
    // Creating an existing log is a no-op that keeps its frames.
    let again = log.create(&a).await?;
    ensure!(
        again.last_seq == 5,
        "create on an existing log reset it: {again:?}"
    );
    Ok(())
}

/// A repeated idempotency key stores nothing and returns the original seq;
/// the same key with other content is a conflict.
pub async fn idempotent_append(log: Arc<dyn SessionLog>) -> Result<()> {
    let s = sid("idem");
    log.create(&s).await?;
    let first = log
        .append(&s, AppendRequest::idempotent(prompt("x"), "turn1:0"))
        .await?;
    log.append(&s, AppendRequest::new(prompt("between")))
        .await?;
    let retry = log
        .append(&s, AppendRequest::idempotent(prompt("x"), "turn1:0"))
        .await?;
    ensure!(
        retry.seq == first.seq && retry.duplicate,
        "retry returned {retry:?}, first was {first:?}"
    );
    ensure!(
        log.info(&s).await?.last_seq == 2,
        "a duplicate append stored a frame"
    );
    match log
        .append(
            &s,
            AppendRequest::idempotent(prompt("different"), "turn1:0"),
        )
        .await
    {
        Err(e) if e.kind() == ErrorKind::Conflict => {}
        other => bail!("reusing a key for other content must be a Conflict, got {other:?}"),
    }
    let next = log
        .append(&s, AppendRequest::idempotent(prompt("y"), "turn1:1"))
        .await?;
    ensure!(next.seq == 3 && !next.duplicate, "new key got {next:?}");
    Ok(())
}

/// `read(after, limit)` returns frames with seq > after, at most limit.
pub async fn read_from_cursor(log: Arc<dyn SessionLog>) -> Result<()> {
    let s = sid("cursor");
    log.create(&s).await?;
    for i in 1..=10 {
        log.append(&s, AppendRequest::new(prompt(&i.to_string())))
            .await?;
    }
    let page = log.read(&s, 4, 3).await?;
    let seqs: Vec<u64> = page.iter().map(|f| f.seq).collect();
    ensure!(
        seqs == vec![5, 6, 7],
        "read(after=4, limit=3) gave {seqs:?}"
    );
    ensure!(
        log.read(&s, 10, 5).await?.is_empty(),
        "read past the end must be empty"
    );
    ensure!(
        log.read(&s, 99, 5).await?.is_empty(),
        "read far past the end must be empty"
    );
    ensure!(log.read(&s, 0, 1000).await?.len() == 10, "full read");
    Ok(())
}

/// Sealing appends a final `sealed` frame, refuses later appends, and is
/// idempotent.
pub async fn seal_refuses_appends(log: Arc<dyn SessionLog>) -> Result<()> {
    let s = sid("seal");
    log.create(&s).await?;
    log.append(&s, AppendRequest::new(prompt("before"))).await?;
    let info = log.seal(&s).await?;
    ensure!(info.sealed && info.last_seq == 2, "after seal: {info:?}");
    let frames = log.read(&s, 0, 10).await?;
    ensure!(
        matches!(frames.last().map(|f| &f.body), Some(FrameBody::Sealed {})),
        "last frame must be sealed"
    );
    match log.append(&s, AppendRequest::new(prompt("after"))).await {
        Err(e) if e.kind() == ErrorKind::Conflict => {}
        other => bail!("append after seal must be a Conflict, got {other:?}"),
    }
    let again = log.seal(&s).await?;
    ensure!(
        again.last_seq == 2,
        "sealing twice added a frame: {again:?}"
    );
    ensure!(
        log.info(&s).await?.last_seq == 2,
        "a refused append stored something"
    );
    Ok(())
}

/// `fork(until=N)` copies frames 1..=N and keys; the fork grows on its own.
/// (Frames outside any turn here: a cut inside one is
/// `meta_is_folded_with_every_append`'s.)
pub async fn fork_copies_a_prefix(log: Arc<dyn SessionLog>) -> Result<()> {
    let src = sid("fork-src");
    let dst = sid("fork-dst");
    log.create(&src).await?;
    for i in 1..=5 {
        log.append(
            &src,
            AppendRequest::idempotent(said(&format!("m{i}")), format!("k{i}")),
        )
        .await?;
    }
    let info = log.fork(&src, 3, &dst).await?;
    ensure!(info.last_seq == 3 && !info.sealed, "fork info {info:?}");
    let origin = info
        .forked_from
        .as_ref()
        .context("fork must record its origin")?;
    ensure!(
        origin.session == src && origin.until == 3,
        "origin {origin:?}"
    );
    let copied = log.read(&dst, 0, 10).await?;
    ensure!(
        copied == log.read(&src, 0, 3).await?,
        "fork must hold exactly the prefix"
    );
    // Keys up to N came along; later keys did not.
    let dup = log
        .append(&dst, AppendRequest::idempotent(said("m2"), "k2"))
        .await?;
    ensure!(
        dup.duplicate && dup.seq == 2,
        "key k2 should be known in the fork: {dup:?}"
    );
    let fresh = log
        .append(&dst, AppendRequest::idempotent(said("m5-in-fork"), "k5"))
        .await?;
    ensure!(
        !fresh.duplicate && fresh.seq == 4,
        "key k5 is past the fork point: {fresh:?}"
    );
    ensure!(
        log.info(&src).await?.last_seq == 5,
        "forking changed the source"
    );
    match log.fork(&src, 6, &sid("fork-bad")).await {
        Err(e) if e.kind() == ErrorKind::InvalidInput => {}
        other => bail!("fork past the end must be InvalidInput, got {other:?}"),
    }
    match log.fork(&src, 1, &dst).await {
        Err(e) if e.kind() == ErrorKind::Conflict => {}
        other => bail!("fork onto an existing session must be a Conflict, got {other:?}"),
    }
    let empty = log.fork(&src, 0, &sid("fork-empty")).await?;
    ensure!(empty.last_seq == 0, "fork until=0 is an empty log");
    let listed: Vec<String> = log
        .list()
        .await?
        .into_iter()
        .map(|i| i.session.to_string())
        .collect();
    ensure!(
        listed == vec!["fork-dst", "fork-empty", "fork-src"],
        "list gave {listed:?}"
    );
    Ok(())
}

/// Operations on an unknown session are `NotFound` and create nothing.
pub async fn unknown_session_is_not_found(log: Arc<dyn SessionLog>) -> Result<()> {
    let s = sid("ghost");
    match log.append(&s, AppendRequest::new(prompt("boo"))).await {
        Err(e) if e.kind() == ErrorKind::NotFound => {}
        other => bail!("append to an unknown session must be NotFound, got {other:?}"),
    }
    ensure!(
        matches!(log.info(&s).await, Err(e) if e.kind() == ErrorKind::NotFound),
        "info"
    );
    ensure!(
        matches!(log.read(&s, 0, 1).await, Err(e) if e.kind() == ErrorKind::NotFound),
        "read"
    );
    match log.seal(&s).await {
        Err(e) if e.kind() == ErrorKind::NotFound => {}
        other => bail!("seal of an unknown session must be NotFound, got {other:?}"),
    }
    match log.fork(&s, 0, &sid("ghost-fork")).await {
        Err(e) if e.kind() == ErrorKind::NotFound => {}
        other => bail!("fork of an unknown session must be NotFound, got {other:?}"),
    }
    ensure!(
        matches!(log.info(&sid("ghost-fork")).await, Err(e) if e.kind() == ErrorKind::NotFound),
        "a refused fork created its target"
    );
    ensure!(
        log.list().await?.is_empty(),
        "a refused append, seal or fork created a log: {:?}",
        log.list().await?
    );
    Ok(())
}

/// A frame over the log's limit (default 1 MiB) is refused and stores nothing.
pub async fn oversized_frame_is_refused(log: Arc<dyn SessionLog>) -> Result<()> {
    let s = sid("big");
    log.create(&s).await?;
    let huge = prompt(&"x".repeat(harness_core::log::DEFAULT_MAX_FRAME_BYTES + 1));
    match log.append(&s, AppendRequest::new(huge)).await {
        Err(e) if e.kind() == ErrorKind::InvalidInput => {}
        other => bail!("an oversized frame must be InvalidInput, got {other:?}"),
    }
    ensure!(
        log.info(&s).await?.last_seq == 0,
        "the oversized frame was stored"
    );
    Ok(())
}

/// Many writers at once still get distinct, gap-free seqs.
pub async fn concurrent_appends_stay_gap_free(log: Arc<dyn SessionLog>) -> Result<()> {
    let s = sid("concurrent");
    log.create(&s).await?;
    let writers = (0..8).map(|w| {
        let log = log.clone();
        let s = s.clone();
        async move {
            let mut seqs = Vec::new();
            for i in 0..25 {
                let a = log
                    .append(
                        &s,
                        AppendRequest::idempotent(prompt(&format!("{w}-{i}")), format!("{w}-{i}")),
                    )
                    .await?;
                seqs.push(a.seq);
            }
            anyhow::Ok(seqs)
        }
    });
    let mut all: Vec<u64> = futures::future::try_join_all(writers)
        .await?
        .into_iter()
        .flatten()
        .collect();
    all.sort_unstable();
    ensure!(
        all == (1..=200).collect::<Vec<u64>>(),
        "seqs were not exactly 1..=200"
    );
    Ok(())
}

/// Many retries of one append (same key, same body) racing each other store
/// exactly one frame: one answer is the original, every other a duplicate
/// of it with the same seq and frame. A racing retry with other content is
/// a `Conflict` (or, if it won, the others are), never a second frame.
pub async fn concurrent_retries_store_once(log: Arc<dyn SessionLog>) -> Result<()> {
    let s = sid("retries");
    log.create(&s).await?;
    log.append(&s, AppendRequest::new(said("before"))).await?;
    let retries = (0..16).map(|_| {
        let (log, s) = (log.clone(), s.clone());
        async move {
            log.append(&s, AppendRequest::idempotent(said("once"), "retry-key"))
                .await
        }
    });
    let answers = futures::future::join_all(retries).await;
    let mut originals = 0;
    let mut frames = Vec::new();
    for a in answers {
        let a = a.context("a concurrent retry failed")?;
        if !a.duplicate {
            originals += 1;
        }
        frames.push(a.frame);
    }
    ensure!(
        originals == 1,
        "{originals} of 16 concurrent retries were stored as new frames"
    );
    ensure!(
        frames.iter().all(|f| f == &frames[0]) && frames[0].seq == 2,
        "concurrent retries answered different frames: {frames:?}"
    );
    ensure!(
        log.info(&s).await?.last_seq == 2 && log.read(&s, 0, 10).await?.len() == 2,
        "concurrent retries stored more than one frame"
    );
    // The same key with different bodies at once: one frame at most.
    let racing = (0..8).map(|i| {
        let (log, s) = (log.clone(), s.clone());
        async move {
            log.append(
                &s,
                AppendRequest::idempotent(said(&format!("variant-{i}")), "contested"),
            )
            .await
        }
    });
    let mut stored = 0;
    for a in futures::future::join_all(racing).await {
        match a {
            Ok(a) if !a.duplicate => stored += 1,
            Ok(a) => bail!("a retry with other content answered as a duplicate: {a:?}"),
            Err(e) if e.kind() == ErrorKind::Conflict => {}
            Err(e) => bail!("a contested key must be stored once or Conflict, got {e}"),
        }
    }
    ensure!(stored == 1, "a contested key was stored {stored} times");
    ensure!(
        log.info(&s).await?.last_seq == 3,
        "a contested key left {} frames",
        log.info(&s).await?.last_seq
    );
    Ok(())
}

/// Idempotency keys belong to one session: the same key in another session
/// is a new frame there (even with other content), and a retry in each
/// session answers that session's own frame.
pub async fn same_key_in_two_sessions(log: Arc<dyn SessionLog>) -> Result<()> {
    let (a, b) = (sid("keys-a"), sid("keys-b"));
    log.create(&a).await?;
    log.create(&b).await?;
    log.append(&b, AppendRequest::new(said("b-first"))).await?;
    let in_a = log
        .append(&a, AppendRequest::idempotent(said("in a"), "shared-key"))
        .await?;
    let in_b = log
        .append(&b, AppendRequest::idempotent(said("in b"), "shared-key"))
        .await
        .context("a key used in another session must be free here")?;
    ensure!(
        !in_a.duplicate && !in_b.duplicate && in_a.seq == 1 && in_b.seq == 2,
        "the same key in two sessions: {in_a:?} / {in_b:?}"
    );
    let again_a = log
        .append(&a, AppendRequest::idempotent(said("in a"), "shared-key"))
        .await?;
    let again_b = log
        .append(&b, AppendRequest::idempotent(said("in b"), "shared-key"))
        .await?;
    ensure!(
        again_a.duplicate && again_a.frame == in_a.frame,
        "retry in a answered {again_a:?}"
    );
    ensure!(
        again_b.duplicate && again_b.frame == in_b.frame,
        "retry in b answered {again_b:?}"
    );
    match log
        .append(&a, AppendRequest::idempotent(said("in b"), "shared-key"))
        .await
    {
        Err(e) if e.kind() == ErrorKind::Conflict => {}
        other => bail!("b's content under the key in a must be a Conflict in a, got {other:?}"),
    }
    ensure!(
        log.info(&a).await?.last_seq == 1 && log.info(&b).await?.last_seq == 2,
        "retries stored frames"
    );
    Ok(())
}

/// A frame whose encoding is exactly the default limit is stored and read
/// back whole; one byte more is refused and stores nothing.
pub async fn frame_of_exactly_the_limit(log: Arc<dyn SessionLog>) -> Result<()> {
    use harness_core::frame::Frame;
    use harness_core::log::DEFAULT_MAX_FRAME_BYTES;
    let s = sid("limit");
    log.create(&s).await?;
    let overhead = Frame::encoded_len(&prompt(""));
    let exact = prompt(&"x".repeat(DEFAULT_MAX_FRAME_BYTES - overhead));
    ensure!(
        Frame::encoded_len(&exact) == DEFAULT_MAX_FRAME_BYTES,
        "test frame is {} bytes",
        Frame::encoded_len(&exact)
    );
    let stored = log
        .append(&s, AppendRequest::idempotent(exact.clone(), "at-limit"))
        .await
        .context("a frame of exactly the limit must be accepted")?;
    ensure!(stored.seq == 1, "stored {stored:?}");
    let back = log.read(&s, 0, 10).await?;
    ensure!(
        back.len() == 1 && back[0].body == exact,
        "the frame at the limit did not come back whole"
    );
    let retry = log
        .append(&s, AppendRequest::idempotent(exact, "at-limit"))
        .await?;
    ensure!(retry.duplicate, "retry at the limit: {retry:?}");
    let over = prompt(&"x".repeat(DEFAULT_MAX_FRAME_BYTES - overhead + 1));
    match log.append(&s, AppendRequest::new(over)).await {
        Err(e) if e.kind() == ErrorKind::InvalidInput => {}
        other => bail!("a frame one byte over the limit must be InvalidInput, got {other:?}"),
    }
    ensure!(
        log.info(&s).await?.last_seq == 1,
        "the frame over the limit was stored"
    );
    Ok(())
}

/// What one writer of [`shared_writer`] was answered: `(key, seq)`.
pub type WriterRecord = (String, u64);

/// The session [`shared_writer`] writes to.
pub const SHARED_SESSION: &str = "shared-writers";

/// One of several writers on one store (handles in one process, or in
/// several processes on one file): `n` rounds of its own frame (key
/// `<writer>-<i>`), a retry of it, and a frame every writer appends with
/// the same key and content (`shared-<i>`). Returns every answer, for
/// [`check_shared_writers`].
pub async fn shared_writer(
    log: Arc<dyn SessionLog>,
    writer: &str,
    n: usize,
) -> Result<Vec<WriterRecord>> {
    let s = sid(SHARED_SESSION);
    log.create(&s).await?;
    let mut records = Vec::new();
    for i in 0..n {
        let own = format!("{writer}-{i}");
        let first = log
            .append(&s, AppendRequest::idempotent(said(&own), own.clone()))
            .await
            .with_context(|| format!("{writer}: append {own}"))?;
        ensure!(
            !first.duplicate,
            "{writer}: its own key {own} was a duplicate"
        );
        let retry = log
            .append(&s, AppendRequest::idempotent(said(&own), own.clone()))
            .await
            .with_context(|| format!("{writer}: retry {own}"))?;
        ensure!(
            retry.duplicate && retry.frame == first.frame,
            "{writer}: the retry of {own} answered {retry:?}, the append {first:?}"
        );
        records.push((own, first.seq));
        let shared = format!("shared-{i}");
        let a = log
            .append(&s, AppendRequest::idempotent(said(&shared), shared.clone()))
            .await
            .with_context(|| format!("{writer}: append {shared}"))?;
        records.push((shared, a.seq));
        if i % 8 == 0 {
            tokio::task::yield_now().await;
        }
    }
    Ok(records)
}

/// Check the log after [`shared_writer`] ran for `writers` writers of `n`
/// rounds: seqs 1..=N without gaps, every key stored exactly once, and every
/// answer a writer got names the frame that holds its content.
pub async fn check_shared_writers(
    log: Arc<dyn SessionLog>,
    writers: &[&str],
    n: usize,
    records: &[WriterRecord],
) -> Result<()> {
    let s = sid(SHARED_SESSION);
    let frames = log.read(&s, 0, usize::MAX).await?;
    let want = writers.len() * n + n;
    ensure!(
        frames.len() == want,
        "{} frames stored, expected {want} (each writer's own plus one per shared key)",
        frames.len()
    );
    let mut by_text = std::collections::BTreeMap::new();
    for (i, f) in frames.iter().enumerate() {
        ensure!(
            f.seq == i as u64 + 1,
            "frame #{i} has seq {}: a gap or a repeat",
            f.seq
        );
        let FrameBody::Message { text, .. } = &f.body else {
            bail!("unexpected frame {f:?}");
        };
        ensure!(
            by_text.insert(text.clone(), f.seq).is_none(),
            "{text} was stored twice"
        );
    }
    for (key, seq) in records {
        ensure!(
            by_text.get(key) == Some(seq),
            "a writer was answered seq {seq} for {key}, which is stored at {:?}",
            by_text.get(key)
        );
    }
    ensure!(
        log.info(&s).await?.last_seq == want as u64,
        "info disagrees with the frames"
    );
    Ok(())
}

/// Several handles on one store (clones of a memory log, two connections to
/// one SQLite file, …) written through at once stay one gap-free log with
/// every key stored once.
pub async fn handles_on_one_store(handles: Vec<Arc<dyn SessionLog>>) -> Result<()> {
    const N: usize = 60;
    let names: Vec<String> = (0..handles.len()).map(|i| format!("h{i}")).collect();
    let writers = handles.iter().zip(&names).map(|(log, name)| {
        let (log, name) = (log.clone(), name.clone());
        tokio::spawn(async move { shared_writer(log, &name, N).await })
    });
    let mut records = Vec::new();
    for w in futures::future::join_all(writers).await {
        records.extend(w.context("writer task")??);
    }
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    for log in &handles {
        check_shared_writers(log.clone(), &names, N, &records).await?;
    }
    Ok(())
}
