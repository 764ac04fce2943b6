//! `harness:slice` — one bounded piece of a turn, the unit every engine
//! schedules.
//!
//! A slice reattaches to the session's sandbox by handle, starts the agent
//! if the turn has not started (detached, output spooled to
//! `<home>/.harness/turns/<turn>/` — inside the sandbox, outside the working
//! tree), reads the spool from the state's cursor, turns lines into stream
//! parts with the adapter's parser, emits them with idempotency keys derived
//! from (turn, byte offset, index), and returns a [`SliceReport`].
//!
//! Exactly-once rules:
//! - the agent is started at most once per turn: `mkdir` of the spool
//!   directory is the claim, so a retried slice finds it and reattaches
//!   (through `process.json`, or, when the claiming slice died before
//!   writing it, by launching again: the launch is idempotent per spool);
//! - the cursor only advances to a line boundary where no text/reasoning
//!   block is open, so a retried slice re-sends whole blocks (the actor
//!   starts a re-sent block over) and every other part carries a key the log
//!   has already seen.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures::{FutureExt, StreamExt};
use tracing::{field, Instrument};

use crate::audit::{AuditLog, AuditRecord, AuditedSandbox};
use crate::broker::{ModelBroker, Reach, CREDENTIAL_ENV_VARS};
use crate::clock::Clock;
use crate::engine::SliceExecutor;
use crate::harness::{Harness, TurnContext};
use crate::maybe::{BoxFuture, MaybeSend, MaybeSync};
use crate::part::StreamPart;
use crate::relay;
use crate::sandbox::{
    collect_exec, shell_quote, DetachedProcess, DetachedRequest, DetachedStatus, ExecRequest,
    Sandbox, SandboxHandle, SandboxProvider, SandboxSpec,
};
use crate::stream::AbortSignal;
use crate::turn::{PendingApproval, SliceOutcome, SliceReport, TurnState};
use crate::turn_checkpoint::{TurnCheckpoints, WARNING_SANDBOX_RESTORED};
use crate::{Error, ErrorKind, Result};

/// Where a slice's parts go: the session actor, as the session's runner
/// (in-process through the runtime's hub, or over the runner WebSocket).
/// Both calls return once the actor stored the part (or refused it: a
/// fenced runner gets `ErrorKind::Fenced` and must stop).
#[cfg_attr(not(target_arch = "wasm32"), async_trait)]
#[cfg_attr(target_arch = "wasm32", async_trait(?Send))]
pub trait PartSink: MaybeSend + MaybeSync {
    /// Emit one part of `turn_id`. `key` is stable across retries.
    async fn emit(
        &self,
        session_id: &str,
        turn_id: &str,
        part: StreamPart,
        key: String,
    ) -> Result<()>;
    /// Record a turn's status — `ready_for_next_step` once its agent
    /// started, the terminal one at its end — with its sandbox and agent
    /// session (which the session's next turn continues), keyed by
    /// [`TurnState::status_key`].
    async fn turn_status(&self, state: &TurnState) -> Result<()>;
    /// Call a host tool for `turn_id` and wait for its one outcome (the
    /// session answers a repeated call id with the recorded one). A sink
    /// with no session behind it has no host: `unavailable`.
    async fn host_call(
        &self,
        session_id: &str,
        turn_id: &str,
        call: crate::relay::HostCallRequest,
    ) -> Result<crate::relay::HostOutcome> {
        let _ = (session_id, turn_id, call);
        Ok(crate::relay::HostOutcome::Unavailable {
            reason: "this runner has no session to reach a tool host through".into(),
        })
    }
    /// The tools of the session's attached host (none without one).
    async fn host_tools(&self, session_id: &str) -> Result<Vec<crate::relay::ToolSpec>> {
        let _ = session_id;
        Ok(Vec::new())
    }
}

/// Sleeps for a duration on the caller's runtime.
#[cfg(not(target_arch = "wasm32"))]
pub type Sleeper = Arc<dyn Fn(Duration) -> BoxFuture<'static, ()> + Send + Sync>;
/// Sleeps for a duration on the caller's runtime.
#[cfg(target_arch = "wasm32")]
pub type Sleeper = Arc<dyn Fn(Duration) -> BoxFuture<'static, ()>>;

/// Everything a slice needs besides the turn state.
#[derive(Clone)]
pub struct SliceRunner {
    /// Sandbox providers by name (the handle names its provider).
    pub providers: BTreeMap<String, Arc<dyn SandboxProvider>>,
    /// Agent adapters by name (the state names its agent).
    pub harnesses: BTreeMap<String, Arc<dyn Harness>>,
    /// Where parts go.
    pub sink: Arc<dyn PartSink>,
    /// Caller environment for the agent (API keys, base URLs). With a
    /// `broker`, its credential variables
    /// ([`CREDENTIAL_ENV_VARS`](crate::broker::CREDENTIAL_ENV_VARS)) never
    /// reach the agent.
    pub env: BTreeMap<String, String>,
    /// The model broker: when set, sandboxes are made with forwards to it
    /// and agents get a session token instead of the real key.
    pub broker: Option<Arc<dyn ModelBroker>>,
    /// Model override.
    pub model: Option<String>,
    /// How often to poll the spool while the agent runs.
    pub poll_interval: Duration,
    /// Timer.
    pub sleep: Sleeper,
    /// Clock.
    pub clock: Arc<dyn Clock>,
    /// Where turn-end checkpoints go (none: no checkpoints; a session at a
    /// checkpoint then cannot get a new sandbox from it).
    pub checkpoints: Option<Arc<dyn TurnCheckpoints>>,
}

impl std::fmt::Debug for SliceRunner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SliceRunner")
            .field("providers", &self.providers.keys().collect::<Vec<_>>())
            .field("harnesses", &self.harnesses.keys().collect::<Vec<_>>())
            .field("poll_interval", &self.poll_interval)
            .finish_non_exhaustive()
    }
}

/// Largest spool read per poll, so one slice never holds a huge chunk.
const READ_LIMIT_HINT: usize = 4 * 1024 * 1024;

/// Least time between two looks at an idle agent's permission requests.
const APPROVAL_CHECK_MS: u64 = 1000;

/// The spool directory of a turn under `home`.
pub fn spool_dir(home: &str, turn_id: &str) -> String {
    format!("{}/.harness/turns/{turn_id}", home.trim_end_matches('/'))
}

impl SliceRunner {
    fn provider(&self, name: &str) -> Result<&Arc<dyn SandboxProvider>> {
        self.providers.get(name).ok_or_else(|| {
            Error::invalid(format!("no sandbox provider named {name:?} is configured"))
        })
    }

    fn harness(&self, name: &str) -> Result<&Arc<dyn Harness>> {
        self.harnesses
            .get(name)
            .ok_or_else(|| Error::invalid(format!("no agent adapter named {name:?} is configured")))
    }

    async fn sandbox(&self, state: &TurnState) -> Result<Box<dyn Sandbox>> {
        let handle = state
            .sandbox
            .as_ref()
            .ok_or_else(|| Error::invalid("turn state has no sandbox handle"))?;
        self.provider(&handle.provider)?.resume(handle).await
    }

    /// The agent's environment: the caller's, or, with a broker, the
    /// caller's without its credentials plus the broker's endpoint and the
    /// session's token (and the session's budget handed to the broker).
    async fn agent_env(&self, state: &TurnState) -> Result<BTreeMap<String, String>> {
        let Some(broker) = &self.broker else {
            if !state.config.budget.is_unlimited() {
                return Err(Error::invalid(
                    "a model budget needs the model broker (it counts what passes): run with \
                     the broker, or drop the budget",
                ));
            }
            return Ok(self.env.clone());
        };
        broker
            .set_budget(&state.session_id, &state.config.budget)
            .await?;
        let handle = state
            .sandbox
            .as_ref()
            .ok_or_else(|| Error::invalid("turn state has no sandbox handle"))?;
        let network = state
            .sandbox_config
            .as_ref()
            .map(|c| c.network.clone())
            .unwrap_or_default();
        let reach = if self
            .provider(&handle.provider)?
            .shares_host_network(&network)
        {
            Reach::HostNetwork
        } else {
            Reach::Forwarded
        };
        let mut env: BTreeMap<String, String> = self
            .env
            .iter()
            .filter(|(k, _)| !CREDENTIAL_ENV_VARS.contains(&k.as_str()))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        env.extend(broker.agent_env(&state.session_id, &network, reach).await?);
        Ok(env)
    }

    /// Start the agent for this turn, or find the one a previous attempt
    /// started; true when this call started it.
    async fn start_or_find(
        &self,
        sandbox: &dyn Sandbox,
        state: &TurnState,
    ) -> Result<(DetachedProcess, bool)> {
        crate::failpoint::hit("before-claim");
        if let Some(home) = sandbox.home_hint() {
            // The tools' file is written before the launch, and must not
            // change under an agent an earlier slice started: with tools,
            // the claim below says first whether one did.
            let tools = self.sink.host_tools(&state.session_id).await?;
            if tools.is_empty() {
                return self.launch_or_find(sandbox, state, &home).await;
            }
        }
        // One exec reads `$HOME` and claims the spool under it: on Docker
        // each exec is a round trip through dockerd (~50 ms), and this is
        // on the path to every turn's first request.
        let (home, claimed) = claim_spool(sandbox, &state.turn_id).await?;
        let dir = spool_dir(&home, &state.turn_id);
        let process_file = format!("{dir}/process.json");
        if !claimed {
            match sandbox.read_file(&process_file).await {
                Ok(stream) => {
                    let bytes = crate::stream::collect(stream, 64 * 1024).await?;
                    return Ok((serde_json::from_slice(&bytes)?, false));
                }
                // An earlier slice claimed the spool and died before it
                // recorded the process: before the launch, during it, or
                // after it. The launch is idempotent per spool, so launching
                // again returns the agent it started, or starts the agent
                // when it never got that far.
                Err(e) if e.kind() == crate::ErrorKind::NotFound => {
                    tracing::info!(
                        turn.id = %state.turn_id,
                        "the turn's spool was claimed by a slice that died before recording its process; launching again"
                    );
                }
                Err(e) => return Err(e),
            }
        }
        crate::failpoint::hit("claim-to-launch");
        // The session's tool host, if one is attached now, lends this turn
        // its tools: the agent gets the bridge, which lists them from
        // tools.json. A host attaching later serves the next turn.
        let tools = self.sink.host_tools(&state.session_id).await?;
        let relay = if tools.is_empty() {
            None
        } else {
            let relay = format!("{dir}/{}", relay::files::DIR);
            sandbox
                .write_file(
                    &format!("{relay}/{}", relay::files::TOOLS),
                    crate::stream::once(serde_json::to_vec(&tools)?),
                )
                .await?;
            Some(relay)
        };
        let process = self.launch(sandbox, state, &home, dir, relay).await?;
        crate::failpoint::hit("launch-to-record");
        let json = serde_json::to_vec(&process)?;
        sandbox
            .write_file(&process_file, crate::stream::once(json))
            .instrument(tracing::info_span!("agent.record"))
            .await?;
        Ok((process, true))
    }

    /// Launch the turn's agent in spool `dir` (idempotent per spool: an
    /// agent an earlier call started is returned instead).
    async fn launch(
        &self,
        sandbox: &dyn Sandbox,
        state: &TurnState,
        home: &str,
        dir: String,
        relay: Option<String>,
    ) -> Result<DetachedProcess> {
        let harness = self.harness(&state.agent)?;
        let env = self
            .agent_env(state)
            .instrument(tracing::info_span!(
                "agent.env",
                broker = self.broker.is_some()
            ))
            .await?;
        let command = harness.turn_command(&TurnContext {
            state,
            workdir: sandbox.workdir(),
            home,
            env: &env,
            model: state.model.as_deref().or(self.model.as_deref()),
            system_prompt: None,
            relay_dir: relay.as_deref(),
        })?;
        sandbox
            .spawn_detached(DetachedRequest {
                argv: command.argv,
                cwd: Some(command.cwd),
                env: command.env,
                spool_dir: dir,
            })
            .instrument(tracing::info_span!("agent.launch"))
            .await
    }

    /// [`start_or_find`](Self::start_or_find) when the sandbox's `$HOME`
    /// is known and the turn lends no host tools: no claim first, and no
    /// `process.json` after. The launch is idempotent per spool, so it
    /// starts the agent or returns the one an earlier slice started (its
    /// pid is in the spool's `pid`, which the launch writes before it
    /// returns), and the agent is reported started either way — the
    /// status is keyed ([`TurnState::status_key`]), so a report an earlier
    /// slice made is not stored twice, and one it died before making is
    /// made now. A slice that takes the claiming path later (the session's
    /// tool host attached meanwhile) finds the spool claimed and no record,
    /// and launches again, which returns the same agent. Every exec left
    /// out here is one less competing with the agent's start for the CPU
    /// (on Docker each is a round trip through dockerd and runc).
    async fn launch_or_find(
        &self,
        sandbox: &dyn Sandbox,
        state: &TurnState,
        home: &str,
    ) -> Result<(DetachedProcess, bool)> {
        let dir = spool_dir(home, &state.turn_id);
        crate::failpoint::hit("claim-to-launch");
        let process = self.launch(sandbox, state, home, dir, None).await?;
        crate::failpoint::hit("launch-to-record");
        Ok((process, true))
    }

    /// Run one slice. See the module docs.
    pub async fn run(
        &self,
        state: &TurnState,
        budget: Duration,
        abort: AbortSignal,
    ) -> Result<SliceReport> {
        if let Some(broker) = &self.broker {
            // Not fatal: the agent reaches the model without it as long as
            // the broker serves; a slice that needs one fails at its start.
            if let Err(error) = broker.turn_running(&state.session_id).await {
                tracing::warn!(session = %state.session_id, %error, "the model broker missed a turn's liveness mark");
            }
        }
        let (sandbox, replaced) = match self.sandbox(state).await {
            Err(e) if self.can_rehydrate(state, &e) => {
                let handle = self.rehydrate(state, &e).await?;
                let sandbox = self.provider(&handle.provider)?.resume(&handle).await?;
                (sandbox, Some(handle))
            }
            other => (other?, None),
        };
        let Some(handle) = replaced else {
            let report = self.run_audited(sandbox, state, budget, abort).await?;
            return self.with_usage(state, report).await;
        };
        let state = TurnState {
            sandbox: Some(handle.clone()),
            ..state.clone()
        };
        let mut report = self.run_audited(sandbox, &state, budget, abort).await?;
        report.sandbox = Some(handle);
        self.with_usage(&state, report).await
    }

    /// [`run_in`](Self::run_in) with every command it runs in the sandbox
    /// recorded, and the records written to the turn — also when the slice
    /// fails (what ran, ran).
    async fn run_audited(
        &self,
        sandbox: Box<dyn Sandbox>,
        state: &TurnState,
        budget: Duration,
        abort: AbortSignal,
    ) -> Result<SliceReport> {
        let log = AuditLog::default();
        let sandbox = Box::new(AuditedSandbox::audited(sandbox, log.clone()));
        let report = self.run_in(sandbox, state, budget, abort).await;
        let scope = format!("{}:s{}", state.turn_id, state.slices_run);
        let written = self.write_audit(state, &scope, log.take()).await;
        let report = report?;
        written?;
        Ok(report)
    }

    /// Write `records` as audit parts of the turn, keyed within `scope`.
    async fn write_audit(
        &self,
        state: &TurnState,
        scope: &str,
        records: Vec<AuditRecord>,
    ) -> Result<()> {
        for (n, record) in records.into_iter().enumerate() {
            let key = record.key(scope, n);
            self.append(state, StreamPart::Audit { record }, key)
                .await?;
        }
        Ok(())
    }

    /// The session's model usage on the report, when the turn has a budget
    /// to hold it to (the machine decides whether it is spent).
    async fn with_usage(&self, state: &TurnState, mut report: SliceReport) -> Result<SliceReport> {
        if let (Some(broker), false) = (&self.broker, state.config.budget.is_unlimited()) {
            report.usage = broker.usage(&state.session_id).await?;
        }
        Ok(report)
    }

    /// Whether the session's sandbox is gone — its provider said so
    /// (`NotFound`: no such container, no such directory), not merely slow
    /// or unreachable — before this turn's agent started, and the session
    /// has a checkpoint to make a new one from.
    fn can_rehydrate(&self, state: &TurnState, error: &Error) -> bool {
        error.kind() == ErrorKind::NotFound
            && state.process.is_none()
            && state.checkpoint.is_some()
            && self.checkpoints.is_some()
    }

    /// Make the session a new sandbox from its checkpoint, in place of the
    /// one that is gone, and tell the session's clients.
    async fn rehydrate(&self, state: &TurnState, gone: &Error) -> Result<SandboxHandle> {
        let old = state.sandbox.as_ref().map_or("", |h| h.id.as_str());
        tracing::warn!(sandbox.id = old, error = %gone, "the session's sandbox is gone; making a new one from its checkpoint");
        let handle = self
            .make_sandbox(state, format!("{}-rehydrated", state.turn_id))
            .await?;
        let message = format!(
            "the session's sandbox {old} is gone ({gone}); this turn runs in a new {} sandbox {} made from checkpoint {}",
            handle.provider,
            handle.id,
            state.checkpoint.as_deref().unwrap_or_default()
        );
        self.tell_restored(state, message).await?;
        Ok(handle)
    }

    async fn tell_restored(&self, state: &TurnState, message: String) -> Result<()> {
        let part = StreamPart::Warning {
            code: WARNING_SANDBOX_RESTORED.into(),
            message,
            attempt: None,
            max_attempts: None,
        };
        let key = format!("{}:{WARNING_SANDBOX_RESTORED}", state.turn_id);
        self.sink
            .emit(&state.session_id, &state.turn_id, part, key)
            .await
    }

    /// A new sandbox for the session from its spec, holding the session's
    /// checkpoint when it has one. `slot` names it, so a retry after a
    /// crash replaces what the crashed attempt made.
    async fn make_sandbox(&self, state: &TurnState, slot: String) -> Result<SandboxHandle> {
        let config = state.sandbox_config.as_ref().ok_or_else(|| {
            Error::invalid(format!(
                "turn {} has no sandbox config to create its sandbox from",
                state.turn_id
            ))
        })?;
        let provider = self.provider(&config.provider)?;
        let harness = self.harness(&state.agent)?;
        let spec = session_sandbox_spec(
            provider.as_ref(),
            config,
            &state.session_id,
            Some(slot),
            harness.as_ref(),
            self.broker.as_deref(),
        )
        .await?;
        let span = tracing::info_span!(
            "sandbox.create",
            session.id = %state.session_id,
            turn.id = %state.turn_id,
            sandbox.provider = %config.provider,
            sandbox.id = field::Empty,
            checkpoint = state.checkpoint.as_deref().unwrap_or(""),
        );
        async {
            let sandbox = provider.create(&spec).await?;
            if let Some(key) = &state.checkpoint {
                let checkpoints = self.checkpoints.as_ref().ok_or_else(|| {
                    Error::invalid(format!(
                        "session {} is at checkpoint {key}, but this runner has no checkpoint store to make its sandbox from",
                        state.session_id
                    ))
                })?;
                checkpoints
                    .restore(key, sandbox.as_ref(), harness.as_ref())
                    .instrument(tracing::info_span!("checkpoint.restore", key = %key))
                    .await?;
            }
            let handle = sandbox.detach().await?;
            // Made, not yet recorded in the turn's state: a kill here leaves
            // a sandbox only its slot finds again.
            crate::failpoint::hit("create-to-record");
            tracing::Span::current().record("sandbox.id", handle.id.as_str());
            Ok(handle)
        }
        .instrument(span)
        .await
    }

    async fn run_in(
        &self,
        sandbox: Box<dyn Sandbox>,
        state: &TurnState,
        budget: Duration,
        abort: AbortSignal,
    ) -> Result<SliceReport> {
        let started = self.clock.now_ms();
        let deadline = started + budget.as_millis() as u64;
        let process = self.agent_process(sandbox.as_ref(), state).await?;
        let relay = relay_dir(&process);
        self.deliver_answers(sandbox.as_ref(), state, &relay)
            .await?;
        // Host tools: only a turn launched with them has a tools.json (one
        // look per slice, not per poll). Requests are read from the start
        // each slice; the answered ones are skipped.
        let relay_on = match sandbox
            .read_file(&format!("{relay}/{}", relay::files::TOOLS))
            .await
        {
            Ok(_) => true,
            Err(e) if e.kind() == crate::ErrorKind::NotFound => false,
            Err(e) => return Err(e),
        };
        let mut relay_read = 0u64;
        let mut requests_read = 0u64; // bytes of requests.jsonl seen by this slice
        let mut last_approval_check: Option<u64> = None;
        let mut spool = Spool {
            parser: self.harness(&state.agent)?.parser(),
            cursor: state.cursor,
            read_to: state.cursor,
            pending: Vec::new(),
            agent_session_id: state.agent_session_id.clone(),
            last_progress: state.last_progress_at_ms.unwrap_or(started),
            last_warning: None,
        };
        let quiet_ms = state.config.quiet_ms;
        loop {
            // Probe the status *before* reading, so "exited" plus "nothing
            // new to read" really means the whole output was consumed.
            let (status, stdout) = sandbox.poll_detached(&process, spool.read_to).await?;
            let got_any = read_spool(stdout, &mut spool).await?;
            if let Some((request, cursor)) = self.emit_lines(state, &mut spool).await? {
                let outcome = SliceOutcome::ApprovalRequested(request);
                return Ok(spool.report(&process, cursor, outcome));
            }
            match status {
                DetachedStatus::Exited { code } if !got_any => {
                    // Whole output consumed; a trailing line without a
                    // newline is parsed now.
                    self.emit_last_line(state, &mut spool).await?;
                    let outcome = SliceOutcome::Exited { code };
                    let mut report = spool.report(&process, spool.read_to, outcome);
                    if code != 0 {
                        report.stderr_tail = stderr_tail(sandbox.as_ref(), &process).await;
                    }
                    return Ok(report);
                }
                DetachedStatus::Lost if !got_any => {
                    return Ok(spool.report(&process, spool.cursor, SliceOutcome::Lost));
                }
                _ => {}
            }
            if relay_on {
                let served = self
                    .serve_relay(
                        sandbox.as_ref(),
                        state,
                        &relay,
                        &mut relay_read,
                        deadline,
                        &abort,
                    )
                    .await?;
                if !served {
                    // Aborted or out of budget while a host call was out:
                    // the next slice asks again (the session answers the
                    // same call id with its outcome).
                    return Ok(spool.report(&process, spool.cursor, SliceOutcome::Running));
                }
            }
            // An idle agent may be blocked on a permission request (the
            // approval MCP server waits for an answer file): everything it
            // printed before asking has been consumed, so surface the first
            // unanswered request now.
            // Checked at most once per APPROVAL_CHECK_MS of idleness: on
            // backends without a native offset read each check is an exec,
            // and turns without approvals never have a requests file.
            let now = self.clock.now_ms();
            if !got_any
                && !spool.parser.in_block()
                && last_approval_check.is_none_or(|t| now >= t + APPROVAL_CHECK_MS)
            {
                last_approval_check = Some(now);
                let waiting = self
                    .surface_approval(sandbox.as_ref(), state, &relay, &mut requests_read)
                    .await?;
                if let Some(request) = waiting {
                    let outcome = SliceOutcome::ApprovalRequested(request);
                    return Ok(spool.report(&process, spool.cursor, outcome));
                }
            }
            let now = self.clock.now_ms();
            let quiet_for_too_long =
                quiet_ms > 0 && now >= spool.last_progress.saturating_add(quiet_ms);
            if abort.is_aborted() || now >= deadline || quiet_for_too_long {
                return Ok(spool.report(&process, spool.cursor, SliceOutcome::Running));
            }
            if !got_any {
                let sleep = (self.sleep)(self.poll_interval);
                futures::select! {
                    _ = sleep.fuse() => {},
                    _ = abort.aborted().fuse() => {},
                }
            }
        }
    }

    /// The turn's agent process: the one on record, else started now (or
    /// found, when an earlier slice started it and died before recording
    /// it); a new start is told to the session at once, with the sandbox,
    /// so clients see where the turn runs.
    async fn agent_process(
        &self,
        sandbox: &dyn Sandbox,
        state: &TurnState,
    ) -> Result<DetachedProcess> {
        if let Some(process) = &state.process {
            return Ok(process.clone());
        }
        let span = tracing::info_span!("agent.start", agent = %state.agent, started = field::Empty);
        let (process, started) = self
            .start_or_find(sandbox, state)
            .instrument(span.clone())
            .await?;
        span.record("started", started);
        if started {
            let mut running = state.clone();
            running.process = Some(process.clone());
            self.sink
                .turn_status(&running)
                .instrument(tracing::info_span!(
                    "log.append",
                    part = "turn-status",
                    status = running.status.as_str()
                ))
                .await?;
        }
        Ok(process)
    }

    /// Parse the complete lines fetched and send their parts to the
    /// session, each keyed by its spool offset; the committed cursor moves
    /// to each line end outside an open text block. A permission request
    /// stops it: the request, and the cursor past its line.
    async fn emit_lines(
        &self,
        state: &TurnState,
        spool: &mut Spool,
    ) -> Result<Option<(PendingApproval, u64)>> {
        let mut line_start = spool.read_to - spool.pending.len() as u64;
        while let Some(nl) = spool.pending.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = spool.pending.drain(..=nl).collect();
            let offset = line_start;
            line_start += line.len() as u64;
            let text = String::from_utf8_lossy(&line[..line.len() - 1]);
            let text = text.trim_end_matches('\r');
            if text.is_empty() {
                continue;
            }
            let parts = spool.parser.push_line(text);
            if let Some(id) = spool.parser.agent_session_id() {
                spool.agent_session_id = Some(id);
            }
            for (i, part) in parts.into_iter().enumerate() {
                let key = format!("{}:{offset}:{i}", state.turn_id);
                if let StreamPart::ToolApprovalRequest {
                    approval_id,
                    tool_name,
                    input,
                    ..
                } = &part
                {
                    let request = PendingApproval {
                        approval_id: approval_id.clone(),
                        tool_name: tool_name.clone(),
                        input: input.clone(),
                    };
                    self.append(state, part, key).await?;
                    return Ok(Some((request, line_start)));
                }
                spool.note_progress(&part, &*self.clock);
                self.append(state, part, key).await?;
            }
            if !spool.parser.in_block() {
                spool.cursor = line_start;
            }
        }
        Ok(None)
    }

    /// The agent exited: a last line it wrote without a newline is parsed
    /// and sent now.
    async fn emit_last_line(&self, state: &TurnState, spool: &mut Spool) -> Result<()> {
        if spool.pending.is_empty() {
            return Ok(());
        }
        let text = String::from_utf8_lossy(&spool.pending).to_string();
        let offset = spool.read_to - spool.pending.len() as u64;
        for (i, part) in spool
            .parser
            .push_line(text.trim_end())
            .into_iter()
            .enumerate()
        {
            spool.note_progress(&part, &*self.clock);
            self.append(state, part, format!("{}:{offset}:{i}", state.turn_id))
                .await?;
        }
        if let Some(id) = spool.parser.agent_session_id() {
            spool.agent_session_id = Some(id);
        }
        Ok(())
    }

    /// The first permission request the agent waits on without an answer
    /// (from the relay's request file), sent to the session as a
    /// `tool-approval-request` part.
    async fn surface_approval(
        &self,
        sandbox: &dyn Sandbox,
        state: &TurnState,
        relay: &str,
        requests_read: &mut u64,
    ) -> Result<Option<PendingApproval>> {
        let Some(request) = self
            .unanswered_request(sandbox, state, relay, requests_read)
            .await?
        else {
            return Ok(None);
        };
        let part = StreamPart::ToolApprovalRequest {
            approval_id: request.approval.approval_id.clone(),
            tool_call_id: request.tool_call_id,
            tool_name: request.approval.tool_name.clone(),
            input: request.approval.input.clone(),
        };
        let key = format!(
            "{}:approval:{}",
            state.turn_id, request.approval.approval_id
        );
        self.append(state, part, key).await?;
        Ok(Some(request.approval))
    }
}

/// What a slice has read of the agent's spool (its stdout) so far.
struct Spool {
    parser: Box<dyn crate::harness::OutputParser>,
    /// Committed: a line boundary outside any open text block, where the
    /// next slice starts reading again.
    cursor: u64,
    /// Bytes fetched.
    read_to: u64,
    /// Fetched, not yet a whole line.
    pending: Vec<u8>,
    agent_session_id: Option<String>,
    /// The quiet timer (see `TurnConfig::quiet_ms`): progress restarts it,
    /// warnings do not.
    last_progress: u64,
    last_warning: Option<String>,
}

impl Spool {
    /// The slice's report, ending at `cursor` with `outcome`.
    fn report(&self, process: &DetachedProcess, cursor: u64, outcome: SliceOutcome) -> SliceReport {
        SliceReport {
            process: Some(process.clone()),
            agent_session_id: self.agent_session_id.clone(),
            cursor,
            outcome,
            last_progress_at_ms: Some(self.last_progress),
            last_warning: self.last_warning.clone(),
            sandbox: None,
            usage: None,
            stderr_tail: None,
        }
    }

    fn note_progress(&mut self, part: &StreamPart, clock: &dyn Clock) {
        note_progress(part, clock, &mut self.last_progress, &mut self.last_warning);
    }
}

/// Restart the quiet timer on progress; remember the last warning.
fn note_progress(
    part: &StreamPart,
    clock: &dyn Clock,
    last_progress: &mut u64,
    last_warning: &mut Option<String>,
) {
    match part {
        StreamPart::Warning {
            message, attempt, ..
        } => {
            *last_warning = Some(match attempt {
                Some(n) => format!("{message} (retry {n})"),
                None => message.clone(),
            });
        }
        part if part.is_progress() => *last_progress = clock.now_ms(),
        _ => {}
    }
}

/// How much of the end of an agent's stderr a failed turn's error quotes.
const STDERR_TAIL_BYTES: usize = 4096;
/// At most this many of its last non-empty lines.
const STDERR_TAIL_LINES: usize = 3;

/// The last lines an agent that exited non-zero wrote to stderr, joined
/// with ` | `, or `None` when it wrote none or the file cannot be read (the
/// turn still ends `failed`, with the exit code only: this is a diagnosis,
/// never a reason to fail the slice).
async fn stderr_tail(sandbox: &dyn Sandbox, process: &DetachedProcess) -> Option<String> {
    let mut stream = match sandbox.read_file(&process.stderr_path).await {
        Ok(stream) => stream,
        Err(e) => {
            tracing::debug!(error = %e, "the agent's stderr could not be read");
            return None;
        }
    };
    // Streamed, keeping only the end: an agent may write a lot to stderr.
    let mut tail: Vec<u8> = Vec::new();
    while let Some(chunk) = stream.next().await {
        match chunk {
            Ok(bytes) => {
                tail.extend_from_slice(&bytes);
                if tail.len() > 2 * STDERR_TAIL_BYTES {
                    tail.drain(..tail.len() - STDERR_TAIL_BYTES);
                }
            }
            Err(e) => {
                tracing::debug!(error = %e, "reading the agent's stderr failed");
                return None;
            }
        }
    }
    summarize_stderr(&tail)
}

/// The last [`STDERR_TAIL_LINES`] non-empty lines of the last
/// [`STDERR_TAIL_BYTES`] of `stderr`.
fn summarize_stderr(stderr: &[u8]) -> Option<String> {
    let end = &stderr[stderr.len().saturating_sub(STDERR_TAIL_BYTES)..];
    let text = String::from_utf8_lossy(end);
    let lines: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    let kept = &lines[lines.len().saturating_sub(STDERR_TAIL_LINES)..];
    (!kept.is_empty()).then(|| kept.join(" | "))
}

/// The turn's relay directory, `<spool>/relay` (the spool being the
/// directory of the stdout file): where the agent's side appends its
/// requests (`requests.jsonl`, one [`relay::files::RelayRequest`] per
/// line: permission requests from Claude Code's approval server or Codex's
/// hook, host-tool calls from the bridge) and waits for
/// `answers/<id>.json`.
pub fn relay_dir(process: &DetachedProcess) -> String {
    let stdout = process.stdout_path.as_str();
    let spool = stdout.rsplit_once('/').map_or(".", |(dir, _)| dir);
    format!("{spool}/{}", relay::files::DIR)
}

/// A request read from `requests.jsonl`.
struct ApprovalLine {
    approval: PendingApproval,
    tool_call_id: String,
}

impl SliceRunner {
    /// Emit one part to the session's log. A `log.append` span per part
    /// that is stored (INFO); deltas, which are fanned out live but never
    /// stored, get DEBUG spans so a default trace is not one span per token.
    async fn append(&self, state: &TurnState, part: StreamPart, key: String) -> Result<()> {
        let kind = part.type_name();
        let span = if matches!(
            part,
            StreamPart::TextDelta { .. } | StreamPart::ReasoningDelta { .. }
        ) {
            tracing::debug_span!("log.append", part = kind)
        } else {
            tracing::info_span!("log.append", part = kind)
        };
        self.sink
            .emit(&state.session_id, &state.turn_id, part, key)
            .instrument(span)
            .await
    }

    /// Hand every answer in the state to the agent: (re)write
    /// `answers/<id>.json`. Rewriting an existing answer is harmless (same
    /// content; the server stops reading once it has answered), and saves a
    /// round trip per answer to check.
    async fn deliver_answers(
        &self,
        sandbox: &dyn Sandbox,
        state: &TurnState,
        relay_dir: &str,
    ) -> Result<()> {
        for answer in &state.approval_answers {
            // The id names a file: one that could leave the answers
            // directory is never written (the request it answers could
            // not have been read either).
            if relay::validate_call_id(&answer.approval_id).is_err() {
                continue;
            }
            let body = serde_json::to_vec(&relay::ApprovalAnswer {
                approved: answer.approved,
                reason: answer.reason.clone(),
            })?;
            let path = format!(
                "{relay_dir}/{}",
                relay::files::answer_path(&answer.approval_id)
            );
            sandbox.write_file(&path, crate::stream::once(body)).await?;
        }
        Ok(())
    }

    /// Serve the bridge's host-tool requests past `read`: each one without
    /// an answer file goes to the session (which runs it at most once and
    /// answers a repeat with the recorded outcome), and its outcome is
    /// written to `answers/<callId>.json`. False when the slice must end
    /// first (aborted, or out of budget with a call still out).
    async fn serve_relay(
        &self,
        sandbox: &dyn Sandbox,
        state: &TurnState,
        relay_dir: &str,
        read: &mut u64,
        deadline: u64,
        abort: &AbortSignal,
    ) -> Result<bool> {
        let path = format!("{relay_dir}/{}", relay::files::REQUESTS);
        let bytes = match sandbox.read_file_from(&path, *read).await {
            Ok(stream) => match crate::stream::collect(stream, READ_LIMIT_HINT).await {
                Ok(b) => b,
                Err(e) if e.kind() == crate::ErrorKind::NotFound => return Ok(true),
                Err(e) => return Err(e),
            },
            Err(e) if e.kind() == crate::ErrorKind::NotFound => return Ok(true),
            Err(e) => return Err(e),
        };
        // Whole lines only: the bridge writes each request in one write,
        // but a read may land between two.
        let Some(end) = bytes.iter().rposition(|&b| b == b'\n') else {
            return Ok(true);
        };
        for line in bytes[..end].split(|&b| b == b'\n') {
            if line.iter().all(u8::is_ascii_whitespace) {
                *read += line.len() as u64 + 1;
                continue;
            }
            let parsed = match serde_json::from_slice::<relay::files::RelayRequest>(line) {
                Ok(relay::files::RelayRequest::HostTool(r)) => {
                    relay::validate_call_id(&r.call_id).map(|()| r)
                }
                // Approvals are read by `unanswered_request`.
                Ok(relay::files::RelayRequest::Approval(_)) => {
                    *read += line.len() as u64 + 1;
                    continue;
                }
                Err(e) => Err(e.to_string()),
            };
            let request = match parsed {
                Ok(r) => r,
                Err(e) => {
                    // No call id we can answer safely (it names a file):
                    // say so and go on.
                    tracing::warn!(turn.id = %state.turn_id, "ignoring a bad relay request line: {e}");
                    *read += line.len() as u64 + 1;
                    continue;
                }
            };
            let answer = format!(
                "{relay_dir}/{}",
                relay::files::answer_path(&request.call_id)
            );
            let answered = match sandbox.read_file(&answer).await {
                Ok(_) => true,
                Err(e) if e.kind() == crate::ErrorKind::NotFound => false,
                Err(e) => return Err(e),
            };
            if !answered {
                let call = self
                    .sink
                    .host_call(&state.session_id, &state.turn_id, request.clone())
                    .instrument(tracing::info_span!(
                        "host.call",
                        call = %request.call_id,
                        tool = %request.tool
                    ));
                let left = deadline.saturating_sub(self.clock.now_ms());
                let out_of_time = (self.sleep)(Duration::from_millis(left));
                let outcome = futures::select! {
                    outcome = call.fuse() => outcome,
                    _ = out_of_time.fuse() => return Ok(false),
                    _ = abort.aborted().fuse() => return Ok(false),
                };
                let outcome = match outcome {
                    Ok(o) => o,
                    // The session refused the request itself (a budget over
                    // the limit, a reused id): nothing ran; the agent is
                    // told why instead of the turn failing.
                    Err(e) if matches!(e.kind(), ErrorKind::InvalidInput | ErrorKind::Conflict) => {
                        relay::HostOutcome::Unavailable {
                            reason: format!("the session refused the call: {}", e.message()),
                        }
                    }
                    Err(e) => return Err(e),
                };
                sandbox
                    .write_file(&answer, crate::stream::once(serde_json::to_vec(&outcome)?))
                    .await?;
            }
            *read += line.len() as u64 + 1;
        }
        Ok(true)
    }

    /// The first request in `requests.jsonl` past `read` that the state has
    /// no answer for. No requests file (approvals not enabled, or nothing
    /// asked yet) means none.
    async fn unanswered_request(
        &self,
        sandbox: &dyn Sandbox,
        state: &TurnState,
        relay_dir: &str,
        read: &mut u64,
    ) -> Result<Option<ApprovalLine>> {
        let path = format!("{relay_dir}/{}", relay::files::REQUESTS);
        let stream = match sandbox.read_file_from(&path, *read).await {
            Ok(s) => s,
            Err(e) if e.kind() == crate::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        let bytes = match crate::stream::collect(stream, READ_LIMIT_HINT).await {
            Ok(b) => b,
            Err(e) if e.kind() == crate::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        // Only whole lines: the server writes each request in one write,
        // but a read may still land between two.
        let Some(end) = bytes.iter().rposition(|&b| b == b'\n') else {
            return Ok(None);
        };
        let mut found = None;
        for line in bytes[..end].split(|&b| b == b'\n') {
            if line.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            let request = match serde_json::from_slice::<relay::files::RelayRequest>(line) {
                Ok(relay::files::RelayRequest::Approval(r)) => r,
                // Host-tool calls are served by `serve_relay`.
                Ok(relay::files::RelayRequest::HostTool(_)) => continue,
                Err(e) => return Err(Error::backend(format!("bad request line in {path}: {e}"))),
            };
            if relay::validate_call_id(&request.approval_id).is_err()
                || state
                    .approval_answers
                    .iter()
                    .any(|a| a.approval_id == request.approval_id)
            {
                continue;
            }
            found = Some(ApprovalLine {
                tool_call_id: request.tool_use_id.unwrap_or_default(),
                approval: PendingApproval {
                    approval_id: request.approval_id,
                    tool_name: request.tool_name,
                    input: request.input,
                },
            });
            break;
        }
        if found.is_none() {
            // Everything up to the last newline was answered already.
            *read += end as u64 + 1;
        }
        Ok(found)
    }
}

/// The spec of a session's sandbox: what a session's first turn makes, and
/// what a restore into a new session makes — one recipe, so both get the
/// agent installed and, with a broker, the broker's forwards.
pub async fn session_sandbox_spec(
    provider: &dyn SandboxProvider,
    config: &crate::session::SandboxConfig,
    session_id: &str,
    slot: Option<String>,
    harness: &dyn Harness,
    broker: Option<&dyn ModelBroker>,
) -> Result<SandboxSpec> {
    let mut spec = SandboxSpec::new("/workspace");
    spec.image = config.image.clone();
    spec.network = config.network.clone();
    spec.session_id = Some(session_id.to_string());
    spec.slot = slot;
    spec.bootstrap = Some(harness.bootstrap_recipe()?);
    if let Some(broker) = broker {
        if !provider.shares_host_network(&spec.network) {
            spec.forwards = broker
                .forwards(session_id, &spec.network)
                .instrument(tracing::info_span!("broker.forwards"))
                .await?;
        }
    }
    Ok(spec)
}

/// The sandbox's `$HOME` (each session has its own): its handle's
/// [`Sandbox::home_hint`], else asked by an exec.
pub async fn home_of(sandbox: &dyn Sandbox) -> Result<String> {
    if let Some(home) = sandbox.home_hint() {
        return Ok(home);
    }
    let out = async {
        collect_exec(
            sandbox
                .exec(ExecRequest::shell("printf %s \"$HOME\""))
                .await?,
        )
        .await
    }
    .instrument(tracing::info_span!("sandbox.exec", what = "read $HOME"))
    .await?
    .check("reading $HOME")?;
    let home = out.stdout_str();
    if home.is_empty() || !home.starts_with('/') {
        return Err(Error::backend(format!(
            "the sandbox has no usable $HOME ({home:?})"
        )));
    }
    Ok(home)
}

/// Read what `stdout` holds into the spool's pending bytes (up to about
/// [`READ_LIMIT_HINT`]); true when there was anything.
async fn read_spool(mut stdout: crate::stream::ByteStream, spool: &mut Spool) -> Result<bool> {
    let mut got_any = false;
    while let Some(chunk) = stdout.next().await {
        let chunk = chunk?;
        got_any |= !chunk.is_empty();
        spool.read_to += chunk.len() as u64;
        spool.pending.extend_from_slice(&chunk);
        if spool.pending.len() > READ_LIMIT_HINT {
            break;
        }
    }
    Ok(got_any)
}

/// Read the sandbox's `$HOME` and claim `turn_id`'s spool under it
/// (`mkdir`, which one caller wins), in one exec: the home, and whether
/// this call made the spool directory.
async fn claim_spool(sandbox: &dyn Sandbox, turn_id: &str) -> Result<(String, bool)> {
    let script = format!(
        "home=$HOME; case \"$home\" in /*) ;; *) printf 'the sandbox has no usable $HOME (%s)\\n' \"$home\" >&2; exit 1;; esac; \
         mkdir -p \"$home/.harness/turns\" || exit 1; \
         if mkdir \"$home/.harness/turns/\"{turn} 2>/dev/null; then s=claimed; else s=exists; fi; \
         printf '%s\\n%s' \"$s\" \"$home\"",
        turn = shell_quote(turn_id)
    );
    let out = async { collect_exec(sandbox.exec(ExecRequest::shell(script)).await?).await }
        .instrument(tracing::info_span!(
            "sandbox.exec",
            what = "read $HOME and claim the turn spool"
        ))
        .await?;
    let out = out.check("claiming the turn spool")?;
    let (status, home) = out
        .stdout_str()
        .split_once('\n')
        .map(|(s, h)| (s.to_string(), h.to_string()))
        .ok_or_else(|| {
            Error::backend(format!(
                "the spool claim printed {:?}, not its status and $HOME",
                out.stdout_str()
            ))
        })?;
    Ok((home, status == "claimed"))
}

impl SliceRunner {
    /// The turn-end checkpoint of an ended turn, when checkpoints are on
    /// and the turn has a sandbox. A checkpoint that fails is logged and
    /// left out: the turn's end is recorded all the same (its frame names
    /// no checkpoint, so the session stays at its previous one).
    async fn checkpoint_turn(&self, state: &TurnState) -> Option<String> {
        let checkpoints = self.checkpoints.as_ref()?;
        if state.sandbox.is_none()
            || state
                .sandbox_config
                .as_ref()
                .is_some_and(|c| !c.checkpoints.enabled)
        {
            return None;
        }
        let span = tracing::info_span!(
            "checkpoint.turn",
            session.id = %state.session_id,
            turn.id = %state.turn_id,
            parent = state.checkpoint.as_deref().unwrap_or(""),
        );
        let result = async {
            let sandbox = self.sandbox(state).await?;
            let harness = self.harness(&state.agent)?;
            checkpoints
                .checkpoint(sandbox.as_ref(), harness.as_ref(), state)
                .await
        }
        .instrument(span)
        .await;
        match result {
            Ok(key) => Some(key),
            Err(e) => {
                tracing::warn!(session.id = %state.session_id, turn.id = %state.turn_id, error = %e, "the turn-end checkpoint failed; the session stays at its previous one");
                None
            }
        }
    }
}

#[cfg_attr(not(target_arch = "wasm32"), async_trait)]
#[cfg_attr(target_arch = "wasm32", async_trait(?Send))]
impl SliceExecutor for SliceRunner {
    async fn create_sandbox(&self, state: &TurnState) -> Result<SandboxHandle> {
        // Named after the turn: a retry of this step after a kill replaces
        // the sandbox the killed attempt made instead of orphaning it.
        let handle = self.make_sandbox(state, state.turn_id.clone()).await?;
        if let Some(key) = &state.checkpoint {
            // A fork's or rewind's first turn: say what the sandbox holds.
            let message = format!(
                "this turn runs in a new {} sandbox {} made from checkpoint {key}",
                handle.provider, handle.id
            );
            self.tell_restored(state, message).await?;
        }
        Ok(handle)
    }

    async fn run_slice(
        &self,
        state: &TurnState,
        budget: Duration,
        abort: AbortSignal,
    ) -> Result<SliceReport> {
        let span = tracing::info_span!(
            "slice",
            session.id = %state.session_id,
            turn.id = %state.turn_id,
            slice = state.slices_run + 1,
            agent = %state.agent,
            sandbox.id = state.sandbox.as_ref().map_or("", |s| s.id.as_str()),
            budget_ms = budget.as_millis() as u64,
            outcome = field::Empty,
            cursor = field::Empty,
        );
        let report = self
            .run(state, budget, abort)
            .instrument(span.clone())
            .await;
        match &report {
            Ok(report) => {
                let outcome = match &report.outcome {
                    crate::turn::SliceOutcome::Running => "running",
                    crate::turn::SliceOutcome::Exited { .. } => "exited",
                    crate::turn::SliceOutcome::ApprovalRequested(_) => "approval_requested",
                    crate::turn::SliceOutcome::Lost => "lost",
                };
                span.record("outcome", outcome);
                span.record("cursor", report.cursor);
            }
            Err(e) => {
                span.record("outcome", "error");
                span.in_scope(|| tracing::warn!(error = %e, "slice failed"));
            }
        }
        report
    }

    async fn kill_agent(&self, state: &TurnState, process: &DetachedProcess) -> Result<()> {
        let span = tracing::info_span!(
            "agent.kill",
            session.id = %state.session_id,
            turn.id = %state.turn_id,
        );
        async {
            let sandbox = self.sandbox(state).await?;
            sandbox.kill_detached(process).await
        }
        .instrument(span)
        .await
    }

    async fn turn_ended(&self, state: &TurnState) -> Result<()> {
        if let Some(broker) = &self.broker {
            // The agent is gone: its token opens nothing until the next turn.
            broker.turn_ended(&state.session_id).await?;
            // Its model calls, from the broker's journal, before the turn's
            // end: a retry writes the same keys again (one frame each).
            let calls = broker.model_calls(&state.session_id).await?;
            let upto = calls.iter().filter_map(AuditRecord::journal_index).max();
            // Keyed by the session, the journal (a worker's broker numbers
            // its own: `journal_id`) and the journal's number: a retried
            // end, or a later turn's after a lost acknowledgement, writes
            // each once; a fork's own records never meet its parent's, nor
            // one worker's another's.
            let scope = match broker.journal_id() {
                Some(journal) => format!("{}:{journal}", state.session_id),
                None => state.session_id.to_string(),
            };
            self.write_audit(state, &scope, calls).await?;
            if let Some(upto) = upto {
                broker.model_calls_recorded(&state.session_id, upto).await?;
            }
        }
        let checkpointed;
        let state = match self.checkpoint_turn(state).await {
            Some(key) => {
                checkpointed = TurnState {
                    checkpoint: Some(key),
                    ..state.clone()
                };
                &checkpointed
            }
            None => state,
        };
        self.sink
            .turn_status(state)
            .instrument(tracing::info_span!(
                "log.append",
                part = "turn-status",
                status = state.status.as_str()
            ))
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_agents_stderr_is_summarized_by_its_last_lines() {
        assert_eq!(summarize_stderr(b""), None);
        assert_eq!(summarize_stderr(b"\n  \n"), None);
        assert_eq!(
            summarize_stderr(b"one\n\ntwo\nthree\n  four  \n\n").as_deref(),
            Some("two | three | four")
        );
        // Only the end is read: a long stderr keeps its last lines.
        let mut long = "x".repeat(10 * STDERR_TAIL_BYTES).into_bytes();
        long.extend_from_slice(b"\nError: the last word\n");
        let summary = summarize_stderr(&long).unwrap();
        assert!(summary.ends_with(" | Error: the last word"), "{summary}");
        assert!(summary.len() <= STDERR_TAIL_BYTES + 32, "{}", summary.len());
    }

    #[test]
    fn the_relay_lives_next_to_the_stdout_spool() {
        let p = DetachedProcess {
            id: "1".into(),
            stdout_path: "/h/.harness/turns/t1/stdout".into(),
            stderr_path: "/h/.harness/turns/t1/stderr".into(),
            exit_path: "/h/.harness/turns/t1/exit".into(),
        };
        assert_eq!(relay_dir(&p), "/h/.harness/turns/t1/relay");
        assert_eq!(relay_dir(&p), format!("{}/relay", spool_dir("/h/", "t1")));
    }
}
