//! Retention on the Worker (`docs/retention.md`): a Cron Trigger
//! (`[triggers] crons` in `wrangler.toml`, hourly) runs the policy
//! `harness serve --retain-days --retain-sessions` runs natively, from the
//! variables `HARNESS_RETAIN_DAYS` and `HARNESS_RETAIN_SESSIONS` (unset:
//! nothing is deleted). Which sessions go is core's rule
//! (`RetentionPolicy::expired`: idle too long or past the newest N, never
//! one with a turn running); each goes through its object's delete, the
//! path of `DELETE /v1/sessions/{id}` (the object re-checks that no turn
//! runs), then the directory forgets it.
//!
//! A pass reads every listed session's info (one subrequest per session)
//! and deletes the expired ones (two each): the Worker's subrequest limit
//! per invocation bounds how many sessions one pass can cover — state it
//! in `limits.subrequests` for a large directory.

// `#[event(scheduled)]` expands to unsafe blocks: allowed here, denied
// elsewhere in the crate.
#![allow(unsafe_code)]

use harness_core::log::{LogInfo, RetentionPolicy};
use harness_core::SessionId;
use session_api::ApiError;
use worker::{console_error, console_log, event, Env, Method, ScheduleContext, ScheduledEvent};

use crate::front::{forget_session, internal, listed_ids, session_object};

/// Directory ids read per page.
const PAGE: usize = 200;

#[event(scheduled)]
async fn scheduled(event: ScheduledEvent, env: Env, _ctx: ScheduleContext) {
    let var = |name: &str| env.var(name).ok().map(|v| v.to_string());
    let policy = match RetentionPolicy::parse(
        var("HARNESS_RETAIN_DAYS").as_deref(),
        var("HARNESS_RETAIN_SESSIONS").as_deref(),
    ) {
        Ok(policy) if policy.is_active() => policy,
        Ok(_) => return,
        Err(e) => {
            console_error!("retention: not run: {e}");
            return;
        }
    };
    // The time the trigger was scheduled for (ms since the epoch).
    let now_ms = event.schedule() as u64;
    match run_pass(&env, &policy, now_ms).await {
        Ok(deleted) => console_log!("retention: deleted {deleted} sessions"),
        Err(e) => console_error!("retention: the pass stopped: {}", e.message),
    }
}

/// One pass: list every session's info, delete the expired ones. A
/// session that cannot be deleted now (a turn started since the listing;
/// deleted by another pass) is left for the next pass.
async fn run_pass(env: &Env, policy: &RetentionPolicy, now_ms: u64) -> Result<usize, ApiError> {
    let mut infos: Vec<LogInfo> = Vec::new();
    let mut cursor = String::new();
    loop {
        let ids = listed_ids(env, &cursor, PAGE).await?;
        let Some(last) = ids.last() else { break };
        cursor.clone_from(last);
        for id in ids {
            let Ok(id) = SessionId::parse(id) else {
                continue;
            };
            let mut info = session_object(env, &id, Method::Get, "info", "", None).await?;
            // 404: listed, but its creation failed; nothing to keep.
            if info.status_code() == 200 {
                infos.push(info.json().await.map_err(internal)?);
            }
        }
    }
    let mut deleted = 0;
    for session in policy.expired(&infos, now_ms) {
        let answer = session_object(env, &session, Method::Delete, "delete", "", None).await?;
        match answer.status_code() {
            204 => {
                forget_session(env, &session).await?;
                deleted += 1;
            }
            status => {
                console_log!("retention: left session {session} (its object answered {status})")
            }
        }
    }
    Ok(deleted)
}
