//! Forks that carry the tree: a fork of a session at seq `N` copies the log
//! (`SessionLog::fork`) and then puts the fork at the last turn end at or
//! before `N` — the checkpoint that turn left (tree and agent state) — with
//! a [`FrameBody::SandboxReset`]. The fork never shares the parent's live
//! sandbox: its first turn makes a sandbox of its own from that checkpoint,
//! on the provider the caller names. Rewinding in place is the session
//! actor's (`ClientMessage::Rewind`, [`SessionMeta::rewind_point`]).
//!
//! [`SessionMeta::rewind_point`]: crate::session::SessionMeta::rewind_point

use crate::frame::{Frame, FrameBody, SessionId};
use crate::log::{fork_range_error, AppendRequest, LogInfo, SessionLog};
use crate::session::SessionMeta;
use crate::{Error, Result};

/// Where a fork at some seq puts the new session.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ForkPoint {
    /// The turn whose end it is (none: no turn ended before the cut).
    pub turn_id: Option<String>,
    /// That turn end's checkpoint.
    pub checkpoint: Option<String>,
    /// The agent session the checkpoint holds.
    pub agent_session_id: Option<String>,
}

/// The fork point of a log prefix (its frames in order): the state after
/// the last turn end that left a checkpoint, or a reset (fork, rewind)
/// within the prefix. A turn that ran in a sandbox and ended *without* a
/// checkpoint after that is refused: the fork could not hold its tree.
/// A terminal status naming no sandbox (a turn that never started, or one a
/// fork cut) changed no tree and is passed over.
pub fn fork_point<'a>(
    source: &SessionId,
    frames: impl IntoIterator<Item = &'a Frame>,
) -> Result<ForkPoint> {
    let mut point = ForkPoint::default();
    let mut agent_session_id: Option<String> = None;
    let mut without: Option<String> = None;
    for frame in frames {
        match &frame.body {
            FrameBody::TurnStatus {
                turn_id,
                status,
                sandbox,
                agent_session_id: agent,
                checkpoint,
                ..
            } => {
                if agent.is_some() {
                    agent_session_id = agent.clone();
                }
                if !status.is_terminal() {
                    continue;
                }
                match checkpoint {
                    Some(key) => {
                        point = ForkPoint {
                            turn_id: Some(turn_id.clone()),
                            checkpoint: Some(key.clone()),
                            agent_session_id: agent_session_id.clone(),
                        };
                        without = None;
                    }
                    None if sandbox.is_some() => without = Some(turn_id.clone()),
                    None => {}
                }
            }
            FrameBody::SandboxReset {
                turn_id,
                checkpoint,
                agent_session_id: agent,
                ..
            } => {
                point = ForkPoint {
                    turn_id: turn_id.clone(),
                    checkpoint: checkpoint.clone(),
                    agent_session_id: agent.clone(),
                };
                agent_session_id = agent.clone();
                without = None;
            }
            _ => {}
        }
    }
    match without {
        Some(turn) => Err(Error::conflict(format!(
            "cannot fork {source} there with its tree: turn {turn} ended without a checkpoint (checkpoints were off for the session, or its runtime had no checkpoint store); fork at an earlier turn end"
        ))),
        None => Ok(point),
    }
}

/// Frames read per page while finding a fork point.
const PAGE: usize = 1000;

/// Fork `source` at seq `until` into `target` with its tree (see the module
/// docs); the new sandbox on `provider` when given, else the source's. The
/// fork point is checked before anything is written: a refused fork
/// changes nothing. The source keeps running meanwhile.
pub async fn fork_with_tree(
    log: &dyn SessionLog,
    source: &SessionId,
    until: u64,
    target: &SessionId,
    provider: Option<String>,
) -> Result<LogInfo> {
    let info = log.info(source).await?;
    if until == 0 || until > info.last_seq {
        return Err(fork_range_error(source, until, info.last_seq));
    }
    let mut frames = Vec::new();
    while (frames.len() as u64) < until {
        let after = frames.len() as u64;
        let want = PAGE.min((until - after) as usize);
        let page = log.read(source, after, want).await?;
        if page.is_empty() {
            break;
        }
        frames.extend(page);
    }
    frames.truncate(until as usize);
    let point = fork_point(source, &frames)?;
    log.fork(source, until, target).await?;
    let reason = match &point.turn_id {
        Some(turn) => format!("fork of {source} at seq {until}: the tree and conversation as turn {turn} ended"),
        None => format!("fork of {source} at seq {until}: no turn had ended, so an empty tree and a new conversation"),
    };
    let reset = FrameBody::SandboxReset {
        turn_id: point.turn_id,
        checkpoint: point.checkpoint,
        agent_session_id: point.agent_session_id,
        provider,
        reason,
    };
    let info = log.info(target).await?;
    if info.sealed {
        // A sealed prefix stays sealed; nothing runs in it.
        return Ok(info);
    }
    log.append(
        target,
        AppendRequest::idempotent(reset, "fork:sandbox-reset".to_string()),
    )
    .await?;
    log.info(target).await
}

/// The frame that rewinds a session in place to the end of `turn_id`
/// ([`SessionMeta::rewind_point`]: refused while a turn runs or for a turn
/// with no checkpoint). The session actor appends it on
/// `ClientMessage::Rewind`; `harness sessions rewind` on an idle home.
pub fn rewind_frame(meta: &SessionMeta, turn_id: &str) -> Result<FrameBody> {
    let point = meta.rewind_point(turn_id)?;
    Ok(FrameBody::SandboxReset {
        reason: format!("rewind to the end of turn {}", point.turn_id),
        turn_id: Some(point.turn_id.clone()),
        checkpoint: Some(point.key.clone()),
        agent_session_id: point.agent_session_id.clone(),
        provider: None,
    })
}

/// A fork as `harness serve` and the CLI make it: sealed, a read-only copy
/// of the log (no turn runs in it, so it needs no sandbox and no
/// checkpoint); else [`fork_with_tree`].
pub async fn fork_session(
    log: &dyn SessionLog,
    source: &SessionId,
    until: u64,
    target: &SessionId,
    provider: Option<String>,
    seal: bool,
) -> Result<LogInfo> {
    if !seal {
        return fork_with_tree(log, source, until, target, provider).await;
    }
    let info = log.fork(source, until, target).await?;
    if info.sealed {
        return Ok(info);
    }
    log.seal(target).await
}
