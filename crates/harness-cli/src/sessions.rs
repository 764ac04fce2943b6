//! `harness sessions list|show|search|export|fork`, on the CLI's SQLite log.

use anyhow::Result;
use harness::core::frame::{Frame, FrameBody, SessionId};
use harness::core::log::retention::{self, SandboxRemoval};
use harness::core::log::{LogInfo, SessionLog};
use harness::core::session::SessionMeta;
use harness::core::turn::TurnStatus;
use serde::Serialize;

use crate::home::Home;
use crate::moves::MoveRecord;

/// `harness sessions …`.
#[derive(Debug, clap::Subcommand)]
pub enum SessionsCommand {
    /// List sessions: id, frames, sealed, origin.
    List,
    /// Show one session: agent, sandbox, status, turns, checkpoints and
    /// restores, last activity.
    Show {
        /// The session.
        id: String,
        /// Print it as one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Find frames across every session: prompts, answers, tool calls
    /// (commands, file paths), tool results, changed files, errors. Every
    /// word must appear; best hits first, each naming its session and seq.
    Search {
        /// The words to find.
        #[arg(required = true)]
        words: Vec<String>,
        /// Only sessions of this agent (claude-code, codex).
        #[arg(long)]
        agent: Option<String>,
        /// Only sessions on this sandbox provider.
        #[arg(long)]
        provider: Option<String>,
        /// Only sessions whose latest turn has this status (running,
        /// finished, failed, …).
        #[arg(long)]
        status: Option<String>,
        /// The most hits (1 to 200).
        #[arg(long, default_value_t = harness::core::search::DEFAULT_LIMIT)]
        limit: usize,
        /// Print the hits as JSON lines.
        #[arg(long)]
        json: bool,
    },
    /// Print a session's frames as JSON lines.
    Export {
        /// The session.
        id: String,
        /// Only frames 1..=UNTIL.
        #[arg(long)]
        until: Option<u64>,
        /// Print each frame as the audit chain holds it: `seq`, `at_ms`,
        /// `key`, the body as stored (`body`, JSON text) and its `hash`.
        #[arg(long, conflicts_with = "format")]
        chain: bool,
        /// `jsonl` (the frames, one JSON object per line) or `markdown`
        /// (the conversation as a document, tool calls folded).
        #[arg(long, value_enum, default_value_t = ExportFormat::Jsonl)]
        format: ExportFormat,
    },
    /// Check a session's audit chain: every frame against its hash and its
    /// predecessor's, keyed with the home's `audit.key`. Prints the chain's
    /// head; fails naming the first frame that does not match.
    Verify {
        /// The session.
        id: String,
        /// A head printed by an earlier `verify` (kept somewhere the
        /// database's writer cannot change): the chain must still hold
        /// it, which catches frames cut off the end.
        #[arg(long)]
        head: Option<String>,
        /// Print the report as one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Copy frames 1..=UNTIL of a session into a new session.
    Fork {
        /// The source session.
        id: String,
        /// Last frame to copy.
        #[arg(long)]
        until: u64,
        /// Id of the new session (default: generated).
        #[arg(long)]
        target: Option<String>,
        /// Seal the new session (read-only).
        #[arg(long)]
        seal: bool,
        /// The provider of the fork's sandbox (default: the source's).
        #[arg(long)]
        provider: Option<String>,
    },
    /// Delete a session: its log and index entries, and the sandbox it
    /// owns. Refused while a turn runs. Its checkpoints go at the next
    /// `harness gc` (which keeps what a fork still references).
    Delete {
        /// The session.
        id: String,
    },
    /// Remove a session's frames 1..=THROUGH (retention). The log keeps
    /// its meta and the chain hash at the cut: `verify` holds from there;
    /// reading from inside the cut is refused as gone.
    Trim {
        /// The session.
        id: String,
        /// The last seq to remove (the newest frame always stays).
        #[arg(long)]
        through: u64,
    },
    /// Put a session back to the end of an earlier turn, in place: its next
    /// turn runs in a new sandbox holding that turn's checkpoint, the agent
    /// continuing that conversation. The log keeps its history.
    Rewind {
        /// The session.
        id: String,
        /// The turn whose end to go back to (`harness sessions show` lists
        /// the turns with a checkpoint).
        #[arg(long)]
        turn: String,
    },
}

/// What `sessions export` prints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ExportFormat {
    /// One frame per line, as JSON.
    Jsonl,
    /// The conversation as a Markdown document.
    #[value(alias = "md")]
    Markdown,
}

/// Run a sessions subcommand.
pub async fn run(home: &Home, command: SessionsCommand) -> Result<()> {
    let log = home.open_log()?;
    match command {
        SessionsCommand::Search {
            words,
            agent,
            provider,
            status,
            limit,
            json,
        } => {
            let query = harness::core::search::SearchQuery {
                text: words.join(" "),
                agent,
                provider,
                status,
                limit: Some(limit),
                ..Default::default()
            };
            search(&log, &query, json).await
        }
        SessionsCommand::List => list(&log).await,
        SessionsCommand::Show { id, json } => show(home, &log, &id, json).await,
        SessionsCommand::Verify { id, head, json } => {
            verify(home, &log, &id, head.as_deref(), json).await
        }
        SessionsCommand::Export {
            id,
            until,
            chain,
            format,
        } => export(&log, id, until, chain, format).await,
        SessionsCommand::Fork {
            id,
            until,
            target,
            seal,
            provider,
        } => {
            let source = SessionId::parse(id)?;
            let target =
                SessionId::parse(target.unwrap_or_else(|| format!("{source}-fork-{until}")))?;
            let info =
                harness::core::fork::fork_session(&log, &source, until, &target, provider, seal)
                    .await?;
            println!("{}", serde_json::to_string_pretty(&info)?);
            Ok(())
        }
        SessionsCommand::Delete { id } => delete(home, &log, id).await,
        SessionsCommand::Trim { id, through } => {
            let session = SessionId::parse(id)?;
            let info = log.trim(&session, through).await?;
            println!(
                "session {session} holds frames {}..={} (frames up to {} removed)",
                info.kept_after() + 1,
                info.last_seq,
                info.kept_after()
            );
            Ok(())
        }
        SessionsCommand::Rewind { id, turn } => rewind(home, &log, id, &turn).await,
    }
}

/// `sessions search`: the hits, as JSON lines or a table.
async fn search(
    log: &harness::sqlite::SqliteSessionLog,
    query: &harness::core::search::SearchQuery,
    json: bool,
) -> Result<()> {
    let hits = log.search(query).await?;
    if json {
        for hit in &hits {
            println!("{}", serde_json::to_string(hit)?);
        }
    } else if hits.is_empty() {
        eprintln!("no frame holds all of: {}", query.text);
    } else {
        for hit in &hits {
            println!(
                "{:<32} {:>6}  {:<11}  {}",
                hit.session.to_string(),
                hit.seq,
                hit.kind.as_str(),
                hit.snippet.replace('\n', " ")
            );
        }
    }
    Ok(())
}

/// `sessions list`: one line per session.
async fn list(log: &harness::sqlite::SqliteSessionLog) -> Result<()> {
    let logs = log.list().await?;
    println!(
        "{:<32} {:<12} {:<7} {:>6} {:>7} {:>7}  {:<24} origin",
        "SESSION", "AGENT", "SANDBOX", "TURNS", "FRAMES", "SEALED", "LAST TURN"
    );
    for info in logs {
        let origin = info
            .forked_from
            .as_ref()
            .map(|o| format!("fork of {} until {}", o.session, o.until))
            .unwrap_or_default();
        let config = info.meta.config_or_default();
        let last = info
            .meta
            .turn
            .as_ref()
            .map(|t| format!("{} {}", t.turn_id, t.status.as_str()))
            .unwrap_or_else(|| "-".into());
        println!(
            "{:<32} {:<12} {:<7} {:>6} {:>7} {:>7}  {:<24} {origin}",
            info.session.to_string(),
            config.agent,
            config.sandbox.provider,
            info.meta.turns,
            info.last_seq,
            if info.sealed { "yes" } else { "no" },
            last
        );
    }
    Ok(())
}

/// `sessions show`: a session's turns, checkpoints and usage.
async fn show(
    home: &Home,
    log: &harness::sqlite::SqliteSessionLog,
    id: &str,
    json: bool,
) -> Result<()> {
    let session = SessionId::parse(id)?;
    let info = log.info(&session).await.map_err(|e| {
        if e.kind() == harness::core::ErrorKind::NotFound {
            anyhow::anyhow!("unknown session {id:?}: `harness sessions list` shows the known ones")
        } else {
            e.into()
        }
    })?;
    let frames = read_all(log, &session, info.last_seq).await?;
    let mut shown = Shown::of(&info, &frames);
    shown.model_usage = harness::broker::read_usage(&home.broker_dir(), id)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&shown)?);
    } else {
        print!("{}", shown.human());
    }
    Ok(())
}

/// `sessions export`: the frames up to `until`, as JSON lines (with their
/// chain hashes if asked) or as Markdown.
async fn export(
    log: &harness::sqlite::SqliteSessionLog,
    id: String,
    until: Option<u64>,
    chain: bool,
    format: ExportFormat,
) -> Result<()> {
    let session = SessionId::parse(id)?;
    let info = log.info(&session).await?;
    let until = until.unwrap_or(info.last_seq);
    if until > info.last_seq {
        anyhow::bail!(
            "session {session} ends at frame {}, cannot export until {until}",
            info.last_seq
        );
    }
    if format == ExportFormat::Markdown {
        let frames = read_all(log, &session, until).await?;
        print!(
            "{}",
            harness::server::markdown::session_markdown(&info, &frames)
        );
        return Ok(());
    }
    let mut after = info.kept_after();
    while after < until {
        let want = (until - after).min(1000) as usize;
        // Each page as (last seq, its lines).
        let (last, lines) = if chain {
            json_lines(log.read_chain(&session, after, want).await?, |f| f.seq)?
        } else {
            json_lines(log.read(&session, after, want).await?, |f| f.seq)?
        };
        let Some(last) = last else { break };
        after = last;
        for line in lines {
            println!("{line}");
        }
    }
    Ok(())
}

/// `sessions delete`: the sandbox the session owns, then its log.
async fn delete(home: &Home, log: &harness::sqlite::SqliteSessionLog, id: String) -> Result<()> {
    // No actor may hold the session while it goes.
    let _lock = crate::moves::lock_idle_home(home, "deleting a session").await?;
    let session = SessionId::parse(id)?;
    let info = log.info(&session).await?;
    retention::check_deletable(&info)?;
    if let Some(handle) = retention::owned_sandbox(&info) {
        let provider = crate::local::provider(home, &handle.provider, None).await?;
        match retention::remove_sandbox(&info, handle, provider.as_ref()).await? {
            SandboxRemoval::Gone => {
                println!(
                    "its {} sandbox {} is gone already",
                    handle.provider, handle.id
                )
            }
            _ => println!("removed its {} sandbox {}", handle.provider, handle.id),
        }
    }
    log.delete(&session).await?;
    println!(
        "deleted session {session} ({} frames); `harness gc` collects checkpoints no session references",
        info.last_seq
    );
    Ok(())
}

/// `sessions rewind`: the rewind frame, appended while no actor holds the
/// session.
async fn rewind(
    home: &Home,
    log: &harness::sqlite::SqliteSessionLog,
    id: String,
    turn: &str,
) -> Result<()> {
    // The frame goes into the log directly: no actor may hold it.
    let _lock = crate::moves::lock_idle_home(home, "rewinding").await?;
    let session = SessionId::parse(id)?;
    let info = log.info(&session).await?;
    let body = harness::core::fork::rewind_frame(&info.meta, turn)?;
    let appended = log
        .append(&session, harness::core::log::AppendRequest::new(body))
        .await?;
    println!(
        "session {session} rewound to the end of turn {turn} (frame {}); its next turn runs in a new sandbox made from that turn's checkpoint",
        appended.seq
    );
    Ok(())
}

/// A page of frames as JSON lines, with the page's last seq.
fn json_lines<T: Serialize>(
    page: Vec<T>,
    seq: impl Fn(&T) -> u64,
) -> Result<(Option<u64>, Vec<String>)> {
    let last = page.last().map(&seq);
    let lines = page
        .iter()
        .map(serde_json::to_string)
        .collect::<serde_json::Result<_>>()?;
    Ok((last, lines))
}

/// `harness sessions verify`.
async fn verify(
    home: &Home,
    log: &harness::sqlite::SqliteSessionLog,
    id: &str,
    head: Option<&str>,
    json: bool,
) -> Result<()> {
    use harness::core::log::FrameHash;
    let session = SessionId::parse(id)?;
    let kept = head.map(FrameHash::parse_hex).transpose()?;
    let log: std::sync::Arc<dyn SessionLog> = std::sync::Arc::new(log.clone());
    log.info(&session).await.map_err(|e| {
        if e.kind() == harness::core::ErrorKind::NotFound {
            anyhow::anyhow!("unknown session {id:?}: `harness sessions list` shows the known ones")
        } else {
            e.into()
        }
    })?;
    let mut walk = harness::core::log::chain::ChainVerifier::new(home.chain_key()?);
    if let Some(kept) = kept {
        walk = walk.watching(kept);
    }
    let store = harness::core::log::LogSession::new(log, session.clone());
    let report = harness::core::log::walk_store(&store, walk).await?;
    let kept_at = report.kept_head_at;
    if json {
        let mut out = serde_json::to_value(&report)?;
        out["session"] = serde_json::json!(session);
        out["intact"] = serde_json::json!(report.intact() && (kept.is_none() || kept_at.is_some()));
        println!("{}", serde_json::to_string_pretty(&out)?);
    }
    if let Some(broken) = &report.broken {
        anyhow::bail!("session {session}: the audit chain is broken: {broken}");
    }
    if let (Some(kept), None) = (kept, kept_at) {
        anyhow::bail!(
            "session {session}: the chain holds, but not the head {kept}: frames were cut off \
             its end, or the chain was rebuilt"
        );
    }
    if !json {
        let older = if report.unchained > 0 {
            format!(
                " ({} written before the log kept a chain are not covered)",
                report.unchained
            )
        } else {
            String::new()
        };
        println!(
            "session {session}: audit chain intact over {} frames{older}",
            report.frames
        );
        if let Some(head) = report.head {
            println!(
                "head {head} (keep it elsewhere; `verify --head` checks the log still holds it)"
            );
        }
        if let Some(at) = kept_at {
            println!("the kept head is frame {at}'s");
        }
    }
    Ok(())
}

/// Frames `1..=until` of `session`.
async fn read_all(
    log: &harness::sqlite::SqliteSessionLog,
    session: &SessionId,
    until: u64,
) -> Result<Vec<Frame>> {
    let mut out = Vec::new();
    // What retention kept: from the cut, if the log was trimmed.
    let mut after = log.info(session).await?.kept_after();
    while after < until {
        let frames = log
            .read(session, after, (until - after).min(1000) as usize)
            .await?;
        let Some(last) = frames.last() else { break };
        after = last.seq;
        out.extend(frames);
    }
    Ok(out)
}

/// `harness sessions show`: what the log says about one session.
#[derive(Debug, Serialize)]
struct Shown {
    session: String,
    agent: String,
    /// The agent's own session id (what the next turn resumes).
    agent_session_id: Option<String>,
    model: Option<String>,
    sandbox: ShownSandbox,
    /// `idle`, `running` (a turn has not ended) or `sealed`.
    status: &'static str,
    turns: Vec<ShownTurn>,
    /// Checkpoints `harness checkpoint` made of this session.
    checkpoints: Vec<ShownMove>,
    /// Checkpoints `harness restore` put into this session.
    restores: Vec<ShownMove>,
    forked_from: Option<harness::core::log::ForkOrigin>,
    frames: u64,
    /// When the last frame was stored (ms since the epoch; 0: never).
    last_activity_ms: u64,
    last_activity: Option<String>,
    /// What the session's agents used through the home's model broker.
    model_usage: harness::broker::Usage,
}

#[derive(Debug, Serialize)]
struct ShownSandbox {
    /// The provider the session's config names (`local`, `docker`).
    provider: String,
    image: Option<String>,
    /// The sandbox a turn (or a restore) recorded; `None` before the first
    /// turn makes it.
    handle: Option<harness::core::sandbox::SandboxHandle>,
}

#[derive(Debug, Serialize)]
struct ShownTurn {
    id: String,
    status: TurnStatus,
    prompt: String,
    started_ms: u64,
    ended_ms: Option<u64>,
    duration_ms: Option<u64>,
    error: Option<String>,
}

#[derive(Debug, Serialize)]
struct ShownMove {
    key: String,
    /// `session` (tree and agent state) or `tree`.
    kind: String,
    at_ms: u64,
    /// The frame recording it.
    seq: u64,
    /// The turn the session had run last when it was made.
    turn: String,
    agent_session_id: Option<String>,
    bytes: Option<u64>,
}

impl Shown {
    fn of(info: &LogInfo, frames: &[Frame]) -> Self {
        let config = info.meta.config_or_default();
        // The turns, as the log's own fold names them.
        let mut meta = SessionMeta::new(info.meta.config.clone());
        let mut turns: Vec<ShownTurn> = Vec::new();
        let mut checkpoints = Vec::new();
        let mut restores = Vec::new();
        for frame in frames {
            meta.apply(frame.seq, &frame.body, None);
            match &frame.body {
                FrameBody::UserMessage { text, .. } => {
                    if let Some(turn) = &meta.turn {
                        turns.push(ShownTurn {
                            id: turn.turn_id.clone(),
                            status: turn.status,
                            prompt: text.clone(),
                            started_ms: frame.at_ms,
                            ended_ms: None,
                            duration_ms: None,
                            error: None,
                        });
                    }
                }
                FrameBody::TurnStatus {
                    turn_id,
                    status,
                    error,
                    ..
                } => {
                    if let Some(turn) = turns.iter_mut().rev().find(|t| t.id == *turn_id) {
                        if turn.ended_ms.is_none() {
                            turn.status = *status;
                            turn.error = error.clone();
                            if status.is_terminal() {
                                turn.ended_ms = Some(frame.at_ms);
                                turn.duration_ms =
                                    Some(frame.at_ms.saturating_sub(turn.started_ms));
                            }
                        }
                    }
                }
                body => {
                    if let Some(record) = MoveRecord::from_frame(body) {
                        let turn = match body {
                            FrameBody::Part { turn_id, .. } => turn_id.clone(),
                            _ => String::new(),
                        };
                        let shown = ShownMove {
                            key: record.key,
                            kind: record.kind,
                            at_ms: frame.at_ms,
                            seq: frame.seq,
                            turn,
                            agent_session_id: record.agent_session_id,
                            bytes: record.bytes,
                        };
                        if record.harness == "checkpoint" {
                            checkpoints.push(shown);
                        } else {
                            restores.push(shown);
                        }
                    }
                }
            }
        }
        let status = if info.sealed {
            "sealed"
        } else if info.meta.active_turn().is_some() {
            "running"
        } else {
            "idle"
        };
        Shown {
            session: info.session.to_string(),
            agent: config.agent,
            agent_session_id: info.meta.agent_session_id.clone(),
            model: config.model,
            sandbox: ShownSandbox {
                provider: config.sandbox.provider,
                image: config.sandbox.image,
                handle: info.meta.sandbox.clone(),
            },
            status,
            turns,
            checkpoints,
            restores,
            forked_from: info.forked_from.clone(),
            frames: info.last_seq,
            last_activity_ms: info.last_at_ms,
            last_activity: (info.last_at_ms > 0).then(|| utc(info.last_at_ms)),
            model_usage: Default::default(),
        }
    }

    fn human(&self) -> String {
        use std::fmt::Write;
        let mut out = String::new();
        let w = &mut out;
        let _ = writeln!(w, "session        {}", self.session);
        let _ = writeln!(
            w,
            "agent          {}{}",
            self.agent,
            self.agent_session_id
                .as_deref()
                .map(|id| format!(" (agent session {id})"))
                .unwrap_or_default()
        );
        if let Some(model) = &self.model {
            let _ = writeln!(w, "model          {model}");
        }
        let sandbox = match &self.sandbox.handle {
            Some(h) => format!("{} {} (workdir {})", h.provider, h.id, h.workdir),
            None => format!(
                "{} (none yet: the first turn makes it)",
                self.sandbox.provider
            ),
        };
        let _ = writeln!(w, "sandbox        {sandbox}");
        if let Some(image) = &self.sandbox.image {
            let _ = writeln!(w, "image          {image}");
        }
        let running = self
            .turns
            .last()
            .filter(|_| self.status == "running")
            .map(|t| format!(" (turn {} {})", t.id, t.status.as_str()))
            .unwrap_or_default();
        let _ = writeln!(w, "status         {}{running}", self.status);
        let u = &self.model_usage;
        if u.requests + u.refused > 0 {
            let _ = writeln!(
                w,
                "model use      {} requests, {} input / {} output tokens, {} refused (through the broker)",
                u.requests, u.input_tokens, u.output_tokens, u.refused
            );
        }
        if let Some(origin) = &self.forked_from {
            let _ = writeln!(
                w,
                "forked from    {} until frame {}",
                origin.session, origin.until
            );
        }
        let _ = writeln!(
            w,
            "last activity  {} (frame {})",
            self.last_activity.as_deref().unwrap_or("-"),
            self.frames
        );
        let _ = writeln!(w, "\nturns ({})", self.turns.len());
        if !self.turns.is_empty() {
            let _ = writeln!(
                w,
                "  {:<8} {:<24} {:<24} {:<24} {:>10}",
                "TURN", "STATUS", "STARTED", "ENDED", "DURATION"
            );
        }
        for t in &self.turns {
            let _ = writeln!(
                w,
                "  {:<8} {:<24} {:<24} {:<24} {:>10}",
                t.id,
                t.status.as_str(),
                utc(t.started_ms),
                t.ended_ms.map(utc).unwrap_or_else(|| "-".into()),
                t.duration_ms.map(duration).unwrap_or_else(|| "-".into())
            );
            if let Some(error) = &t.error {
                let _ = writeln!(w, "           error: {error}");
            }
        }
        for (title, moves) in [
            ("checkpoints", &self.checkpoints),
            ("restored from", &self.restores),
        ] {
            let _ = writeln!(w, "\n{title} ({})", moves.len());
            if !moves.is_empty() {
                let _ = writeln!(
                    w,
                    "  {:<8} {:<24} {:<8} {:>12}  KEY",
                    "TURN", "AT", "KIND", "BYTES"
                );
            }
            for m in moves {
                let _ = writeln!(
                    w,
                    "  {:<8} {:<24} {:<8} {:>12}  {}",
                    m.turn,
                    utc(m.at_ms),
                    m.kind,
                    m.bytes.map(|b| b.to_string()).unwrap_or_else(|| "-".into()),
                    m.key
                );
            }
        }
        out
    }
}

/// `2025-01-02 03:04:05 UTC` for milliseconds since the epoch.
fn utc(ms: u64) -> String {
    let secs = ms / 1000;
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02} UTC",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// `850 ms`, `4.2 s`, `3 m 07 s`, `2 h 05 m`.
fn duration(ms: u64) -> String {
    match ms {
        0..=999 => format!("{ms} ms"),
        1_000..=59_999 => format!("{:.1} s", ms as f64 / 1000.0),
        60_000..=3_599_999 => format!("{} m {:02} s", ms / 60_000, ms % 60_000 / 1000),
        _ => format!("{} h {:02} m", ms / 3_600_000, ms % 3_600_000 / 60_000),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_read_as_utc_dates_and_short_durations() {
        assert_eq!(utc(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(utc(951_782_400_000), "2000-02-29 00:00:00 UTC");
        assert_eq!(utc(1_735_787_045_123), "2025-01-02 03:04:05 UTC");
        assert_eq!(duration(850), "850 ms");
        assert_eq!(duration(4_240), "4.2 s");
        assert_eq!(duration(187_000), "3 m 07 s");
        assert_eq!(duration(7_500_000), "2 h 05 m");
    }
}
