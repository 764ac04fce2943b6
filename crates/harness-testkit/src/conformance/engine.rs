//! The `DurableEngine` conformance suite. Every engine's tests call
//! [`run_all`] with an [`EngineFixture`] (how to start it, and how to kill
//! it as `kill -9` would) and a real sandbox provider.
//!
//! The work is real: the engine creates the session's sandbox, runs the
//! scripted agent ([`crate::agent::ScriptHarness`], a shell script in that
//! sandbox) through core's `SliceRunner`, and its parts go to a session
//! log through a [`Hub`] of session actors as the session's runner — what
//! `harness serve` does. Only the agent's words are scripted.
//!
//! Checks: a turn finishes and its end is recorded once (with the sandbox
//! the engine created); a turn spans several slices; an abort cuts a
//! running slice short, kills the agent and lets the session take its next
//! turn; an approval is waited for, a wrong answer is ignored, approve and
//! deny reach the agent; a slice whose report is lost after it appended is
//! retried and appends nothing twice; recording the end again stores one
//! terminal status; a killed engine's successor finishes the turn with
//! every line once.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use async_trait::async_trait;
use harness_core::engine::{DurableEngine, SliceExecutor};
use harness_core::frame::{Frame, FrameBody, SessionId};
use harness_core::harness::Harness;
use harness_core::log::{MemorySessionLog, SessionLog};
use harness_core::part::StreamPart;
use harness_core::sandbox::{DetachedProcess, DetachedStatus, SandboxHandle, SandboxProvider};
use harness_core::session::SandboxConfig;
use harness_core::slice::SliceRunner;
use harness_core::stream::AbortSignal;
use harness_core::turn::{ApprovalAnswer, SliceReport, TurnState, TurnStatus};
use harness_core::Error;
use session_runtime::{Hub, HubConfig, HubConnector, RunnerSink, SystemClock};

use crate::agent::{ScriptHarness, SCRIPT_AGENT};

/// Longest any one turn of the suite may take.
pub const TURN_TIMEOUT: Duration = Duration::from_secs(90);

/// How to run the engine under test.
#[async_trait]
pub trait EngineFixture: Send + Sync {
    /// Start the engine with slices run by `executor`. After a
    /// [`crash`](Self::crash) this is the restarted engine: it shares the
    /// durable state of the one before and resumes its unfinished turns.
    async fn start(&self, executor: Arc<dyn SliceExecutor>) -> Result<Arc<dyn DurableEngine>>;
    /// Kill the engine as `kill -9` of its process would: nothing it has
    /// in flight completes or reports.
    async fn crash(&self, engine: Arc<dyn DurableEngine>);
    /// Stop the engine cleanly at the end of a case.
    async fn stop(&self, engine: Arc<dyn DurableEngine>);
    /// Why [`crash`](Self::crash) cannot be done here, if it cannot (the
    /// case that needs it is then skipped through `skip_or_fail`, with this
    /// reason).
    fn crash_unsupported(&self) -> Option<String> {
        None
    }
}

/// Run every check, each on its own session.
pub async fn run_all(
    fixture: &dyn EngineFixture,
    provider: Arc<dyn SandboxProvider>,
) -> Result<()> {
    let rig = Rig::new(provider);
    finishes_a_turn_and_records_its_end_once(fixture, &rig)
        .await
        .context("finishes_a_turn_and_records_its_end_once")?;
    runs_a_turn_across_slices(fixture, &rig)
        .await
        .context("runs_a_turn_across_slices")?;
    abort_cuts_a_running_slice_short(fixture, &rig)
        .await
        .context("abort_cuts_a_running_slice_short")?;
    approvals_are_waited_for_and_reach_the_agent(fixture, &rig)
        .await
        .context("approvals_are_waited_for_and_reach_the_agent")?;
    a_retried_slice_appends_nothing_twice(fixture, &rig)
        .await
        .context("a_retried_slice_appends_nothing_twice")?;
    a_retried_end_is_stored_once(fixture, &rig)
        .await
        .context("a_retried_end_is_stored_once")?;
    match fixture.crash_unsupported() {
        // Through the skip registry, so CI's summary names it (and fails
        // unless xtask/src/skips.rs allows it).
        Some(reason) => {
            crate::skip_or_fail(&format!("a_killed_engine_is_resumed_by_the_next: {reason}"))
        }
        None => a_killed_engine_is_resumed_by_the_next(fixture, &rig)
            .await
            .context("a_killed_engine_is_resumed_by_the_next")?,
    }
    Ok(())
}

/// The parts every case shares: a sandbox provider, a session log and a
/// hub of session actors, and runners of growing generations.
#[derive(Debug)]
pub struct Rig {
    provider: Arc<dyn SandboxProvider>,
    log: Arc<MemorySessionLog>,
    hub: Arc<Hub>,
    generation: AtomicU64,
}

impl Rig {
    /// A rig over `provider` (call inside a tokio runtime).
    pub fn new(provider: Arc<dyn SandboxProvider>) -> Self {
        let log = Arc::new(MemorySessionLog::new().with_clock(Arc::new(SystemClock)));
        let hub = Hub::new(log.clone(), HubConfig::default());
        Self {
            provider,
            log,
            hub,
            generation: AtomicU64::new(1),
        }
    }

    /// A slice runner writing as a runner of a newer generation than every
    /// runner before (a restarted worker fences the dead one).
    pub fn runner(&self) -> SliceRunner {
        let generation = self.generation.fetch_add(1, Ordering::SeqCst);
        let mut providers = BTreeMap::new();
        providers.insert(self.provider.name().to_string(), self.provider.clone());
        let mut harnesses: BTreeMap<String, Arc<dyn Harness>> = BTreeMap::new();
        harnesses.insert(SCRIPT_AGENT.into(), Arc::new(ScriptHarness));
        SliceRunner {
            providers,
            harnesses,
            sink: Arc::new(RunnerSink::new(
                Arc::new(HubConnector::new(self.hub.clone())),
                generation,
            )),
            env: BTreeMap::new(),
            broker: None,
            model: None,
            poll_interval: Duration::from_millis(50),
            sleep: session_runtime::tokio_sleeper(),
            clock: Arc::new(SystemClock),
            checkpoints: None,
        }
    }

    /// A fresh session in the log and its first turn, whose sandbox the
    /// engine creates.
    pub async fn turn(&self, prompt: &str, slice_ms: u64) -> Result<TurnState> {
        let session = format!("eng-{}", uuid_like());
        self.log.create(&SessionId::parse(&session)?).await?;
        let mut state = TurnState::new(session, "t1", SCRIPT_AGENT, prompt);
        state.sandbox_config = Some(SandboxConfig {
            provider: self.provider.name().to_string(),
            ..SandboxConfig::default()
        });
        state.config.slice_ms = slice_ms;
        Ok(state)
    }

    /// Every frame of a session.
    pub async fn frames(&self, session: &str) -> Result<Vec<Frame>> {
        Ok(self
            .log
            .read(&SessionId::parse(session)?, 0, 100_000)
            .await?)
    }
}

fn uuid_like() -> String {
    use std::time::{SystemTime, UNIX_EPOCH};
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!("{nanos:x}-{}", N.fetch_add(1, Ordering::SeqCst))
}

/// The stored text lines of a turn, in log order.
pub fn lines(frames: &[Frame], turn: &str) -> Vec<String> {
    frames
        .iter()
        .filter_map(|f| match &f.body {
            FrameBody::Message { turn_id, text, .. } if turn_id == turn => Some(text.clone()),
            _ => None,
        })
        .collect()
}

/// The terminal statuses recorded for a turn.
pub fn ends(frames: &[Frame], turn: &str) -> Vec<(TurnStatus, Option<SandboxHandle>)> {
    frames
        .iter()
        .filter_map(|f| match &f.body {
            FrameBody::TurnStatus {
                turn_id,
                status,
                sandbox,
                ..
            } if turn_id == turn && status.is_terminal() => Some((*status, sandbox.clone())),
            _ => None,
        })
        .collect()
}

fn expected_lines(n: u32) -> Vec<String> {
    (0..n).map(|i| format!("line {i}")).collect()
}

fn gap_free(frames: &[Frame]) -> Result<()> {
    for (i, f) in frames.iter().enumerate() {
        ensure!(
            f.seq == i as u64 + 1,
            "the log has a gap at {}: {:?}",
            i + 1,
            frames.iter().map(|f| f.seq).collect::<Vec<_>>()
        );
    }
    Ok(())
}

async fn wait_turn(engine: &dyn DurableEngine, state: &TurnState) -> Result<TurnState> {
    let waited = tokio::time::timeout(
        TURN_TIMEOUT,
        engine.wait_turn(&state.session_id, &state.turn_id),
    )
    .await;
    match waited {
        Ok(result) => result.map_err(Into::into),
        Err(_) => {
            let now = engine.turn_state(&state.session_id, &state.turn_id).await;
            bail!(
                "turn {} did not end in {TURN_TIMEOUT:?}; it is now {now:?}",
                state.session_id
            )
        }
    }
}

/// Poll the log until `lines(...)` has at least `n` entries.
async fn wait_lines(rig: &Rig, state: &TurnState, n: usize) -> Result<()> {
    let started = Instant::now();
    loop {
        let got = lines(&rig.frames(&state.session_id).await?, &state.turn_id).len();
        if got >= n {
            return Ok(());
        }
        if started.elapsed() > TURN_TIMEOUT {
            bail!("only {got} of {n} lines were stored in {TURN_TIMEOUT:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Poll the engine until the turn waits for an approval.
async fn wait_approval(engine: &dyn DurableEngine, state: &TurnState) -> Result<TurnState> {
    let started = Instant::now();
    loop {
        let s = engine.turn_state(&state.session_id, &state.turn_id).await?;
        if s.status == TurnStatus::AwaitingToolApproval {
            return Ok(s);
        }
        ensure!(!s.status.is_terminal(), "the turn ended instead: {s:?}");
        if started.elapsed() > TURN_TIMEOUT {
            bail!("no approval was asked for in {TURN_TIMEOUT:?}: {s:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A turn runs to its end: every line once, the sandbox made by the
/// engine, one terminal status carrying that sandbox.
pub async fn finishes_a_turn_and_records_its_end_once(
    fixture: &dyn EngineFixture,
    rig: &Rig,
) -> Result<()> {
    let engine = fixture.start(Arc::new(rig.runner())).await?;
    let state = rig.turn("lines=3 delay=0.05", 60_000).await?;
    engine.start_turn(state.clone()).await?;
    let done = wait_turn(engine.as_ref(), &state).await?;
    fixture.stop(engine).await;
    ensure!(
        done.status == TurnStatus::Finished && done.end_recorded,
        "{done:?}"
    );
    let sandbox = done.sandbox.clone().context("the engine made no sandbox")?;
    let frames = rig.frames(&state.session_id).await?;
    gap_free(&frames)?;
    ensure!(
        lines(&frames, "t1") == expected_lines(3),
        "lines {:?}",
        lines(&frames, "t1")
    );
    let ends = ends(&frames, "t1");
    ensure!(
        ends == vec![(TurnStatus::Finished, Some(sandbox))],
        "one terminal status with the sandbox, got {ends:?}"
    );
    Ok(())
}

/// A turn longer than its slice budget runs in several slices.
pub async fn runs_a_turn_across_slices(fixture: &dyn EngineFixture, rig: &Rig) -> Result<()> {
    let engine = fixture.start(Arc::new(rig.runner())).await?;
    let state = rig.turn("lines=12 delay=0.1", 300).await?;
    engine.start_turn(state.clone()).await?;
    let done = wait_turn(engine.as_ref(), &state).await?;
    fixture.stop(engine).await;
    ensure!(done.status == TurnStatus::Finished, "{done:?}");
    ensure!(
        done.slices_run >= 3,
        "a 1.2 s agent in 300 ms slices ran in {} slice(s)",
        done.slices_run
    );
    let frames = rig.frames(&state.session_id).await?;
    gap_free(&frames)?;
    ensure!(lines(&frames, "t1") == expected_lines(12), "{frames:?}");
    ensure!(ends(&frames, "t1").len() == 1);
    Ok(())
}

/// An abort during a long slice ends the turn `failed` with
/// `aborted: <reason>` promptly, kills the agent, records one end, and
/// the session's next turn runs in the same sandbox.
pub async fn abort_cuts_a_running_slice_short(
    fixture: &dyn EngineFixture,
    rig: &Rig,
) -> Result<()> {
    let engine = fixture.start(Arc::new(rig.runner())).await?;
    let state = rig.turn("lines=400 delay=0.05", 120_000).await?;
    engine.start_turn(state.clone()).await?;
    wait_lines(rig, &state, 3).await?;
    let asked = Instant::now();
    engine
        .abort_turn(&state.session_id, &state.turn_id, "stop pressed")
        .await?;
    let done = wait_turn(engine.as_ref(), &state).await?;
    let took = asked.elapsed();
    ensure!(done.status == TurnStatus::Failed, "{done:?}");
    ensure!(
        done.error
            .as_deref()
            .is_some_and(|e| e.starts_with("aborted: stop pressed")),
        "error {:?}",
        done.error
    );
    ensure!(
        took < Duration::from_secs(30),
        "the abort took {took:?} to end a 120 s slice"
    );
    let process: DetachedProcess = done.process.clone().context("no agent process recorded")?;
    let sandbox = rig
        .provider
        .resume(done.sandbox.as_ref().context("no sandbox")?)
        .await?;
    let status = sandbox.detached_status(&process).await?;
    ensure!(
        status != DetachedStatus::Running,
        "the agent still runs after the abort"
    );
    let frames = rig.frames(&state.session_id).await?;
    let stored = lines(&frames, "t1").len();
    ensure!(stored < 400, "the agent ran to its end: {stored} lines");
    ensure!(
        ends(&frames, "t1").iter().map(|e| e.0).collect::<Vec<_>>() == vec![TurnStatus::Failed],
        "{:?}",
        ends(&frames, "t1")
    );
    // The session goes on.
    let mut next = done.next_turn("t2", "lines=1 delay=0");
    next.config.slice_ms = 60_000;
    engine.start_turn(next.clone()).await?;
    let second = wait_turn(engine.as_ref(), &next).await?;
    fixture.stop(engine).await;
    ensure!(second.status == TurnStatus::Finished, "{second:?}");
    ensure!(
        second.sandbox == done.sandbox,
        "the next turn moved to another sandbox"
    );
    let frames = rig.frames(&state.session_id).await?;
    gap_free(&frames)?;
    ensure!(lines(&frames, "t2") == expected_lines(1));
    Ok(())
}

/// A permission request stops the turn at `awaiting_tool_approval` with a
/// `tool-approval-request` in the log; an answer to another request is
/// ignored; approving and denying each reach the agent.
pub async fn approvals_are_waited_for_and_reach_the_agent(
    fixture: &dyn EngineFixture,
    rig: &Rig,
) -> Result<()> {
    let engine = fixture.start(Arc::new(rig.runner())).await?;
    for approved in [true, false] {
        let state = rig.turn("lines=3 delay=0.05 approval=1", 60_000).await?;
        engine.start_turn(state.clone()).await?;
        let waiting = wait_approval(engine.as_ref(), &state).await?;
        let pending = waiting
            .pending_approval
            .clone()
            .context("no pending approval")?;
        ensure!(pending.approval_id == "approve-1", "{pending:?}");
        let frames = rig.frames(&state.session_id).await?;
        let requests = frames
            .iter()
            .filter(|f| {
                matches!(&f.body, FrameBody::Part { part: StreamPart::ToolApprovalRequest { approval_id, .. }, .. } if approval_id == "approve-1")
            })
            .count();
        ensure!(requests == 1, "{requests} approval requests stored");
        // An answer to another request changes nothing.
        engine
            .answer_approval(
                &state.session_id,
                &state.turn_id,
                ApprovalAnswer {
                    approval_id: "approve-9".into(),
                    approved: true,
                    reason: None,
                },
            )
            .await?;
        tokio::time::sleep(Duration::from_millis(500)).await;
        let still = engine.turn_state(&state.session_id, &state.turn_id).await?;
        ensure!(
            still.status == TurnStatus::AwaitingToolApproval,
            "a wrong answer moved the turn: {still:?}"
        );
        engine
            .answer_approval(
                &state.session_id,
                &state.turn_id,
                ApprovalAnswer {
                    approval_id: "approve-1".into(),
                    approved,
                    reason: (!approved).then(|| "not now".to_string()),
                },
            )
            .await?;
        let done = wait_turn(engine.as_ref(), &state).await?;
        ensure!(done.status == TurnStatus::Finished, "{done:?}");
        ensure!(done.approval_answers.len() == 1, "{done:?}");
        let frames = rig.frames(&state.session_id).await?;
        gap_free(&frames)?;
        let verdict = if approved { "approved 1" } else { "denied 1" };
        let want = vec!["line 0", "line 1", verdict, "line 2"];
        ensure!(
            lines(&frames, "t1") == want,
            "the agent saw the answer as {:?}",
            lines(&frames, "t1")
        );
        ensure!(ends(&frames, "t1").len() == 1);
    }
    fixture.stop(engine).await;
    Ok(())
}

/// Runs the real slice, then reports a failure instead of its result (a
/// worker that died after appending), `fail_slices` times; then records
/// the end and reports a failure once more.
struct LosesReports {
    inner: SliceRunner,
    fail_slices: AtomicU32,
    fail_ends: AtomicU32,
    ends: AtomicU32,
}

#[async_trait]
impl SliceExecutor for LosesReports {
    async fn create_sandbox(&self, state: &TurnState) -> harness_core::Result<SandboxHandle> {
        self.inner.create_sandbox(state).await
    }
    async fn run_slice(
        &self,
        state: &TurnState,
        budget: Duration,
        abort: AbortSignal,
    ) -> harness_core::Result<SliceReport> {
        let report = self.inner.run_slice(state, budget, abort).await?;
        if self
            .fail_slices
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            return Err(Error::backend("the worker died before reporting the slice"));
        }
        Ok(report)
    }
    async fn kill_agent(
        &self,
        state: &TurnState,
        process: &DetachedProcess,
    ) -> harness_core::Result<()> {
        self.inner.kill_agent(state, process).await
    }
    async fn turn_ended(&self, state: &TurnState) -> harness_core::Result<()> {
        self.inner.turn_ended(state).await?;
        self.ends.fetch_add(1, Ordering::SeqCst);
        if self
            .fail_ends
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            return Err(Error::backend("the worker died before reporting the end"));
        }
        Ok(())
    }
}

/// Slices whose reports are lost after they appended are run again from
/// the last reported cursor; nothing is stored twice.
pub async fn a_retried_slice_appends_nothing_twice(
    fixture: &dyn EngineFixture,
    rig: &Rig,
) -> Result<()> {
    let executor = Arc::new(LosesReports {
        inner: rig.runner(),
        fail_slices: AtomicU32::new(2),
        fail_ends: AtomicU32::new(0),
        ends: AtomicU32::new(0),
    });
    let engine = fixture.start(executor.clone()).await?;
    let state = rig.turn("lines=8 delay=0.05", 200).await?;
    engine.start_turn(state.clone()).await?;
    let done = wait_turn(engine.as_ref(), &state).await?;
    fixture.stop(engine).await;
    ensure!(done.status == TurnStatus::Finished, "{done:?}");
    ensure!(
        executor.fail_slices.load(Ordering::SeqCst) == 0,
        "the lost reports were never retried"
    );
    let frames = rig.frames(&state.session_id).await?;
    gap_free(&frames)?;
    ensure!(
        lines(&frames, "t1") == expected_lines(8),
        "after retried slices the log holds {:?}",
        lines(&frames, "t1")
    );
    ensure!(ends(&frames, "t1").len() == 1);
    Ok(())
}

/// Recording the end again (its report was lost) stores one terminal status.
pub async fn a_retried_end_is_stored_once(fixture: &dyn EngineFixture, rig: &Rig) -> Result<()> {
    let executor = Arc::new(LosesReports {
        inner: rig.runner(),
        fail_slices: AtomicU32::new(0),
        fail_ends: AtomicU32::new(1),
        ends: AtomicU32::new(0),
    });
    let engine = fixture.start(executor.clone()).await?;
    let state = rig.turn("lines=2 delay=0", 60_000).await?;
    engine.start_turn(state.clone()).await?;
    let done = wait_turn(engine.as_ref(), &state).await?;
    fixture.stop(engine).await;
    ensure!(
        done.status == TurnStatus::Finished && done.end_recorded,
        "{done:?}"
    );
    let recorded = executor.ends.load(Ordering::SeqCst);
    ensure!(
        recorded >= 2,
        "the end was recorded {recorded} time(s), not retried"
    );
    let frames = rig.frames(&state.session_id).await?;
    ensure!(
        ends(&frames, "t1").len() == 1,
        "{} terminal statuses stored",
        ends(&frames, "t1").len()
    );
    Ok(())
}

/// An engine killed mid-turn: the next one (a newer runner generation)
/// resumes the turn; the log is gap-free with every line once and one end.
pub async fn a_killed_engine_is_resumed_by_the_next(
    fixture: &dyn EngineFixture,
    rig: &Rig,
) -> Result<()> {
    let engine = fixture.start(Arc::new(rig.runner())).await?;
    let state = rig.turn("lines=30 delay=0.1", 500).await?;
    engine.start_turn(state.clone()).await?;
    wait_lines(rig, &state, 6).await?;
    fixture.crash(engine).await;
    let engine = fixture.start(Arc::new(rig.runner())).await?;
    let done = wait_turn(engine.as_ref(), &state).await?;
    fixture.stop(engine).await;
    ensure!(done.status == TurnStatus::Finished, "{done:?}");
    let frames = rig.frames(&state.session_id).await?;
    gap_free(&frames)?;
    ensure!(
        lines(&frames, "t1") == expected_lines(30),
        "after the kill the log holds {:?}",
        lines(&frames, "t1")
    );
    ensure!(ends(&frames, "t1").len() == 1, "{:?}", ends(&frames, "t1"));
    let generations: Vec<u64> = frames
        .iter()
        .filter_map(|f| match f.body {
            FrameBody::RunnerAttached { generation } => Some(generation),
            _ => None,
        })
        .collect();
    ensure!(
        generations.len() >= 2 && generations.windows(2).all(|w| w[0] < w[1]),
        "the restarted engine wrote as a newer runner: {generations:?}"
    );
    Ok(())
}
