//! Retention policy: which sessions a server (or `harness sessions prune`)
//! deletes, decided once here on plain data (`docs/retention.md`).
//!
//! A session is deleted when it has been idle longer than
//! [`RetentionPolicy::max_idle_ms`], or when more than
//! [`RetentionPolicy::keep_sessions`] sessions are newer than it (by last
//! activity). A session with a turn running is never deleted, whatever
//! its age: it is active by definition, and deleting would take its
//! work away mid-turn.

use super::LogInfo;
use crate::frame::SessionId;
use crate::sandbox::{SandboxHandle, SandboxProvider};

/// What to keep. `None` everywhere keeps everything.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RetentionPolicy {
    /// Delete sessions idle (no frame stored) for longer than this.
    pub max_idle_ms: Option<u64>,
    /// Keep at most this many sessions, the most recently active.
    pub keep_sessions: Option<usize>,
}

/// A day in milliseconds.
const DAY_MS: u64 = 86_400_000;

impl RetentionPolicy {
    /// The policy of its two settings: delete sessions idle over
    /// `retain_days` days; keep at most `retain_sessions` (`harness serve
    /// --retain-days --retain-sessions`).
    pub fn of(retain_days: Option<u64>, retain_sessions: Option<usize>) -> Self {
        Self {
            max_idle_ms: retain_days.map(|d| d.saturating_mul(DAY_MS)),
            keep_sessions: retain_sessions,
        }
    }

    /// The policy of its two settings given as text (the Worker's
    /// `HARNESS_RETAIN_DAYS` and `HARNESS_RETAIN_SESSIONS` variables):
    /// absent or empty is "any"; anything else must be a whole number, at
    /// least 1 day — `InvalidInput` naming the setting otherwise.
    pub fn parse(retain_days: Option<&str>, retain_sessions: Option<&str>) -> crate::Result<Self> {
        fn number(name: &str, text: Option<&str>, min: u64) -> crate::Result<Option<u64>> {
            let Some(text) = text.map(str::trim).filter(|t| !t.is_empty()) else {
                return Ok(None);
            };
            match text.parse::<u64>() {
                Ok(n) if n >= min => Ok(Some(n)),
                _ => Err(crate::Error::invalid(format!(
                    "{name} is {text:?}: give a whole number of at least {min}, or leave it \
                     unset to keep sessions whatever their {}",
                    if min == 1 { "age" } else { "number" }
                ))),
            }
        }
        let days = number("the retention's days (HARNESS_RETAIN_DAYS)", retain_days, 1)?;
        let sessions = number(
            "the retention's session count (HARNESS_RETAIN_SESSIONS)",
            retain_sessions,
            0,
        )?;
        Ok(Self::of(
            days,
            sessions.map(|n| usize::try_from(n).unwrap_or(usize::MAX)),
        ))
    }

    /// Whether the policy deletes anything at all.
    pub fn is_active(&self) -> bool {
        self.max_idle_ms.is_some() || self.keep_sessions.is_some()
    }

    /// The sessions of `logs` to delete at `now_ms`, oldest first.
    pub fn expired(&self, logs: &[LogInfo], now_ms: u64) -> Vec<SessionId> {
        let mut by_activity: Vec<&LogInfo> = logs.iter().collect();
        // Most recent first; ties by id, so the choice is the same every run.
        by_activity.sort_by(|a, b| {
            b.last_at_ms
                .cmp(&a.last_at_ms)
                .then_with(|| a.session.as_str().cmp(b.session.as_str()))
        });
        let mut expired: Vec<&LogInfo> = by_activity
            .iter()
            .enumerate()
            .filter(|(rank, info)| {
                let too_many = self.keep_sessions.is_some_and(|keep| *rank >= keep);
                let too_old = self
                    .max_idle_ms
                    .is_some_and(|max| now_ms.saturating_sub(info.last_at_ms) > max);
                (too_many || too_old) && !running(info)
            })
            .map(|(_, info)| *info)
            .collect();
        expired.reverse();
        expired.into_iter().map(|i| i.session.clone()).collect()
    }
}

/// Whether `info`'s latest turn is still running.
fn running(info: &LogInfo) -> bool {
    info.meta
        .turn
        .as_ref()
        .is_some_and(|t| !t.status.is_terminal())
}

/// `Conflict` when `info`'s session may not be deleted now: a turn of it
/// is running (abort it or let it end first). Every delete — the server's,
/// the CLI's, the Worker's — asks this first.
pub fn check_deletable(info: &LogInfo) -> crate::Result<()> {
    match info.meta.turn.as_ref().filter(|_| running(info)) {
        Some(turn) => Err(crate::Error::conflict(format!(
            "session {} has a turn running ({} {}): abort it or let it end, then delete",
            info.session,
            turn.turn_id,
            turn.status.as_str()
        ))),
        None => Ok(()),
    }
}

/// What deleting a session did with its sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SandboxRemoval {
    /// The session owned no sandbox (none made yet, or one it attached to).
    NoneOwned,
    /// Removed.
    Removed,
    /// Gone already (a container removed by hand, a machine's temp dir).
    Gone,
    /// Left: the deleting process does not run its provider.
    NotHere,
}

/// The sandbox a deleted session takes with it: the one it made (`owned`),
/// not one it was attached to.
pub fn owned_sandbox(info: &LogInfo) -> Option<&SandboxHandle> {
    info.meta.sandbox.as_ref().filter(|h| h.owned)
}

/// Remove `handle`, `info`'s owned sandbox, through its `provider` — the
/// one rule every delete follows (the server's, the CLI's, the Worker's),
/// before the log goes: a sandbox its provider no longer finds is
/// [`SandboxRemoval::Gone`]; any other failure keeps the session (the
/// error says so) so that deleting again retries, and nothing is left
/// running with no session to name it.
pub async fn remove_sandbox(
    info: &LogInfo,
    handle: &SandboxHandle,
    provider: &dyn SandboxProvider,
) -> crate::Result<SandboxRemoval> {
    let kept = |doing: &str, e: crate::Error| {
        crate::Error::new(
            e.kind(),
            format!(
                "{doing} the {} sandbox {} of session {}: {e} (the session is kept; delete again \
                 to retry)",
                handle.provider, handle.id, info.session
            ),
        )
    };
    let sandbox = match provider.resume(handle).await {
        Ok(sandbox) => sandbox,
        Err(e) if e.kind() == crate::ErrorKind::NotFound => return Ok(SandboxRemoval::Gone),
        Err(e) => return Err(kept("reattaching to", e)),
    };
    sandbox.destroy().await.map_err(|e| kept("removing", e))?;
    Ok(SandboxRemoval::Removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_parse_or_say_which_is_wrong() {
        assert_eq!(
            RetentionPolicy::parse(Some("30"), Some(" 5000 ")).unwrap(),
            RetentionPolicy {
                max_idle_ms: Some(30 * DAY_MS),
                keep_sessions: Some(5000),
            }
        );
        let none = RetentionPolicy::parse(None, Some("")).unwrap();
        assert!(!none.is_active());
        for (days, sessions, named) in [
            (Some("0"), None, "HARNESS_RETAIN_DAYS"),
            (Some("thirty"), None, "HARNESS_RETAIN_DAYS"),
            (Some("1.5"), None, "HARNESS_RETAIN_DAYS"),
            (None, Some("-1"), "HARNESS_RETAIN_SESSIONS"),
        ] {
            let e = RetentionPolicy::parse(days, sessions).unwrap_err();
            assert_eq!(e.kind(), crate::ErrorKind::InvalidInput);
            assert!(e.to_string().contains(named), "{e}");
        }
    }
    use crate::frame::FrameBody;
    use crate::log::{AppendRequest, LogState};

    fn log(id: &str, at_ms: u64, prompts: &[&str]) -> LogInfo {
        let mut state = LogState::new(SessionId::parse(id).unwrap());
        for p in prompts {
            state
                .append(
                    AppendRequest::new(FrameBody::UserMessage {
                        text: p.to_string(),
                        turn_id: None,
                    }),
                    at_ms,
                    usize::MAX,
                )
                .unwrap();
        }
        let mut info = state.info();
        info.last_at_ms = at_ms;
        info
    }

    const DAY: u64 = 86_400_000;

    #[test]
    fn idle_sessions_and_those_past_the_count_go_oldest_first() {
        let now = 100 * DAY;
        let logs = [
            log("new", now - DAY, &[]),
            log("old", now - 40 * DAY, &[]),
            log("older", now - 50 * DAY, &[]),
            log("mid", now - 10 * DAY, &[]),
            // Idle exactly the limit: not more than it, kept.
            log("edge", now - 30 * DAY, &[]),
        ];
        let ids = |v: Vec<SessionId>| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let by_age = RetentionPolicy {
            max_idle_ms: Some(30 * DAY),
            keep_sessions: None,
        };
        assert_eq!(ids(by_age.expired(&logs, now)), ["older", "old"]);
        let by_count = RetentionPolicy {
            max_idle_ms: None,
            keep_sessions: Some(1),
        };
        assert_eq!(
            ids(by_count.expired(&logs, now)),
            ["older", "old", "edge", "mid"]
        );
        let both = RetentionPolicy {
            max_idle_ms: Some(5 * DAY),
            keep_sessions: Some(3),
        };
        assert_eq!(
            ids(both.expired(&logs, now)),
            ["older", "old", "edge", "mid"]
        );
        let by_rank = RetentionPolicy {
            max_idle_ms: None,
            keep_sessions: Some(3),
        };
        assert_eq!(ids(by_rank.expired(&logs, now)), ["older", "old"]);
        assert!(RetentionPolicy::default().expired(&logs, now).is_empty());
        assert!(!RetentionPolicy::default().is_active());
        assert!(by_age.is_active() && by_count.is_active() && both.is_active());
    }

    #[test]
    fn a_session_is_deletable_unless_a_turn_of_it_runs() {
        let busy = log("busy", 0, &["still going"]);
        let err = check_deletable(&busy).unwrap_err();
        assert_eq!(err.kind(), crate::ErrorKind::Conflict);
        assert!(
            err.to_string().contains("has a turn running") && err.to_string().contains("busy"),
            "{err}"
        );
        check_deletable(&log("idle", 0, &[])).unwrap();
    }

    #[test]
    fn a_session_with_a_turn_running_is_kept_whatever_its_age() {
        let now = 100 * DAY;
        let logs = [
            log("busy", now - 90 * DAY, &["still going"]),
            log("idle", now - 90 * DAY, &[]),
        ];
        let policy = RetentionPolicy {
            max_idle_ms: Some(DAY),
            keep_sessions: Some(0),
        };
        let expired = policy.expired(&logs, now);
        assert_eq!(expired, [SessionId::parse("idle").unwrap()]);
    }
}
