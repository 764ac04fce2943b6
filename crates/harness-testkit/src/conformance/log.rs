//! The `SessionLog` conformance suite. Every backend's tests call
//! [`run_all`] with a factory that makes a fresh, empty log.

use std::future::Future;
use std::sync::Arc;

use anyhow::{bail, ensure, Context, Result};
use harness_core::frame::{FrameBody, MessageKind, SessionId};
use harness_core::log::{fold_meta, AppendRequest, SessionLog};
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
    let frames: Vec<(FrameBody, Option<&str>)> = vec![
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
                sandbox: Some(handle.clone()),
                agent_session_id: None,
            },
            Some("t1:status:failed"),
        ),
    ];
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
    let expected = fold_meta(Some(config.clone()), frames.iter().map(|(b, k)| (b, *k)));
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
    // A fork between turns: its prefix folded under the source's config.
    let between = log.fork(&s, 1, &sid("meta-fork-between")).await?;
    let expected = fold_meta(
        Some(config.clone()),
        frames[..1].iter().map(|(b, k)| (b, *k)),
    );
    ensure!(
        between.last_seq == 1 && between.meta == expected,
        "a fork between turns is its prefix folded: {between:?}"
    );
    // A fork of the first two frames ends inside turn t1 (its prompt is
    // copied, its end is not): the fork closes it with one frame of its
    // own, so the fork takes a new prompt and never runs t1.
    let f = sid("meta-fork");
    let forked = log.fork(&s, 2, &f).await?;
    let copied = log.read(&f, 0, 10).await?;
    ensure!(
        forked.last_seq == 3 && copied[..2] == log.read(&s, 0, 2).await?[..],
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
            && forked.meta.config.as_ref() == Some(&config),
        "fork meta {:?}",
        forked.meta
    );
    ensure!(
        log.info(&f).await?.meta == forked.meta,
        "fork meta changed on read"
    );
    ensure!(
        after_two.active_turn().is_some(),
        "the source's turn was running at the cut"
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
    ensure!(
        log.list().await?.is_empty(),
        "a refused append created a log"
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
