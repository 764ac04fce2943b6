//! Running one turn end to end on the embedded default: a sandbox (local or
//! Docker), the in-process engine with its state in SQLite, the SQLite
//! session log, and the session actor's runner side (`LogSink`).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use harness::core::engine::{DurableEngine, InProcessEngine, Spawner};
use harness::core::frame::{FrameBody, SessionId};
use harness::core::harness::Harness;
use harness::core::log::{AppendRequest, SessionLog};
use harness::core::sandbox::{SandboxProvider, SandboxSpec};
use harness::core::sink::LogSink;
use harness::core::slice::SliceRunner;
use harness::core::turn::{TurnState, TurnStatus};

use crate::home::{Home, SessionRecord};
use crate::print::PrintingSink;
use crate::{AgentKind, EngineKind, SandboxKind};

/// `harness run` arguments.
#[derive(Debug)]
pub struct RunArgs {
    pub agent: AgentKind,
    pub sandbox: SandboxKind,
    pub engine: EngineKind,
    pub session: Option<String>,
    pub model: Option<String>,
    pub image: Option<String>,
    pub slice_ms: Option<u64>,
    pub prompt: String,
}

/// What a turn needs besides the home directory.
pub struct TurnPlan {
    /// The agent for a new session.
    pub agent: AgentKind,
    /// Its adapter.
    pub harness: Arc<dyn Harness>,
    /// Sandbox backend for a new session.
    pub sandbox: SandboxKind,
    /// Docker image for a new Docker session.
    pub image: Option<String>,
    /// Agent environment (credentials, base URLs).
    pub env: BTreeMap<String, String>,
    /// Model override.
    pub model: Option<String>,
    /// Continue this session.
    pub session: Option<String>,
    /// Slice length override.
    pub slice_ms: Option<u64>,
    /// The prompt.
    pub prompt: String,
}

impl std::fmt::Debug for TurnPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TurnPlan")
            .field("agent", &self.agent)
            .field("session", &self.session)
            .finish_non_exhaustive()
    }
}

/// A provider for `kind`.
pub async fn provider(
    home: &Home,
    kind: &str,
    image: Option<&str>,
) -> Result<Arc<dyn SandboxProvider>> {
    match kind {
        "local" => Ok(Arc::new(harness::local::LocalProvider::new(
            home.sandboxes(),
        ))),
        "docker" => {
            let mut config = harness::docker::DockerConfig::default();
            if let Some(image) = image {
                config.default_image = image.to_string();
            }
            let provider = harness::docker::DockerProvider::connect(config).await.context(
                "no Docker engine answered (start dockerd, e.g. `cargo xtask services start`, or use --sandbox local)",
            )?;
            Ok(Arc::new(provider))
        }
        other => bail!("unknown sandbox provider {other:?} (this build knows local and docker)"),
    }
}

fn now_ms() -> u64 {
    harness::core::log::now_ms()
}

fn spinner(message: String) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new_spinner();
    bar.set_style(
        indicatif::ProgressStyle::with_template("{spinner} {msg} [{elapsed}]")
            .expect("static template"),
    );
    bar.set_message(message);
    bar.enable_steady_tick(Duration::from_millis(120));
    bar
}

/// The in-process engine: slices run by a [`SliceRunner`] whose parts are
/// printed and then stored through the actor's runner side ([`LogSink`]),
/// turn states saved in SQLite.
fn engine(
    log: Arc<harness::sqlite::SqliteSessionLog>,
    store: Arc<harness::sqlite::SqliteTurnStore>,
    providers: BTreeMap<String, Arc<dyn SandboxProvider>>,
    harnesses: BTreeMap<String, Arc<dyn Harness>>,
    env: BTreeMap<String, String>,
    model: Option<String>,
) -> InProcessEngine {
    // The start time is the runner generation: a later process fences this one.
    let sink = Arc::new(PrintingSink::new(Arc::new(LogSink::new(log, now_ms()))));
    let runner = SliceRunner {
        providers,
        harnesses,
        sink,
        env,
        model,
        poll_interval: Duration::from_millis(150),
        sleep: Arc::new(|d| Box::pin(tokio::time::sleep(d))),
        now_ms: Arc::new(now_ms),
    };
    let spawn: Spawner = Arc::new(|f| {
        tokio::spawn(f);
    });
    InProcessEngine::new(Arc::new(runner), store, spawn)
}

/// Credentials and base URLs for agents, from this process's environment.
fn agent_env() -> BTreeMap<String, String> {
    [
        "ANTHROPIC_API_KEY",
        "ANTHROPIC_BASE_URL",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC",
        "OPENAI_API_KEY",
        "OPENAI_BASE_URL",
    ]
    .into_iter()
    .filter_map(|k| {
        std::env::var(k)
            .ok()
            .filter(|v| !v.is_empty())
            .map(|v| (k.to_string(), v))
    })
    .collect()
}

/// `harness resume`: finish every unfinished turn.
pub async fn resume_command(home: &Home) -> Result<()> {
    use harness::core::engine::TurnStore;
    let log = Arc::new(
        harness::sqlite::SqliteSessionLog::open(home.db()).context("opening the session log")?,
    );
    let store = Arc::new(log.turn_store());
    let unfinished = store.unfinished().await?;
    if unfinished.is_empty() {
        eprintln!("no unfinished turns");
        return Ok(());
    }
    let mut providers: BTreeMap<String, Arc<dyn SandboxProvider>> = BTreeMap::new();
    let mut harnesses: BTreeMap<String, Arc<dyn Harness>> = BTreeMap::new();
    for state in &unfinished {
        if let Some(handle) = &state.sandbox {
            if !providers.contains_key(&handle.provider) {
                providers.insert(
                    handle.provider.clone(),
                    provider(home, &handle.provider, None).await?,
                );
            }
        }
        if !harnesses.contains_key(&state.agent) {
            let kind = AgentKind::from_name(&state.agent)
                .with_context(|| format!("unknown agent {:?}", state.agent))?;
            let binary = crate::agents::ensure_binary(home, kind).await?;
            harnesses.insert(state.agent.clone(), crate::agents::adapter(kind, binary)?);
        }
    }
    let engine = engine(log, store, providers, harnesses, agent_env(), None);
    eprintln!(
        "resuming {} unfinished turn(s)",
        engine.resume_unfinished().await?
    );
    let mut failed = 0;
    for state in unfinished {
        let done = engine.wait_turn(&state.session_id, &state.turn_id).await?;
        if let Ok(mut record) = home.load_session(&done.session_id) {
            if done.agent_session_id.is_some() {
                record.agent_session_id = done.agent_session_id.clone();
                home.save_session(&record)?;
            }
        }
        eprintln!("session {}: {}", done.session_id, summary(&done));
        failed += usize::from(done.status != TurnStatus::Finished);
    }
    if failed > 0 {
        bail!("{failed} resumed turn(s) did not finish");
    }
    Ok(())
}

/// Run one turn; returns the session record (saved) and the final state.
pub async fn execute(home: &Home, plan: TurnPlan) -> Result<(SessionRecord, TurnState)> {
    let log = Arc::new(
        harness::sqlite::SqliteSessionLog::open(home.db()).context("opening the session log")?,
    );
    let store = Arc::new(log.turn_store());

    let mut record = match &plan.session {
        Some(id) => {
            let record = home.load_session(id)?;
            if record.agent != plan.agent.name() && plan.session.is_some() {
                tracing::info!(agent = %record.agent, "continuing with the session's own agent");
            }
            record
        }
        None => {
            let kind = match plan.sandbox {
                SandboxKind::Local => "local",
                SandboxKind::Docker => "docker",
            };
            let provider = provider(home, kind, plan.image.as_deref()).await?;
            let id = format!("s-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
            let mut spec = SandboxSpec::new("/workspace");
            spec.session_id = Some(id.clone());
            spec.bootstrap = Some(plan.harness.bootstrap_recipe()?);
            let bar = spinner(format!(
                "preparing a {kind} sandbox (the agent is installed once per recipe, then reused)"
            ));
            let sandbox = provider.create(&spec).await;
            bar.finish_and_clear();
            let sandbox = sandbox.context("creating the sandbox")?;
            let record = SessionRecord {
                id: id.clone(),
                agent: plan.agent.name().to_string(),
                sandbox: sandbox.detach().await?,
                turns: 0,
                agent_session_id: None,
            };
            home.save_session(&record)?;
            eprintln!("session {id} in {kind} sandbox {}", record.sandbox.id);
            record
        }
    };
    let agent = AgentKind::from_name(&record.agent)
        .with_context(|| format!("session uses unknown agent {:?}", record.agent))?;
    if agent != plan.agent {
        bail!(
            "session {} runs {}, not {} (drop --agent or pick another session)",
            record.id,
            record.agent,
            plan.agent.name()
        );
    }
    let session = SessionId::parse(&record.id)?;
    log.create(&session).await?;

    let turn_id = format!("t{}", record.turns + 1);
    log.append(
        &session,
        AppendRequest::idempotent(
            FrameBody::UserMessage {
                text: plan.prompt.clone(),
                turn_id: Some(turn_id.clone()),
            },
            format!("prompt:{turn_id}"),
        ),
    )
    .await?;

    let mut providers: BTreeMap<String, Arc<dyn SandboxProvider>> = BTreeMap::new();
    providers.insert(
        record.sandbox.provider.clone(),
        provider(home, &record.sandbox.provider, plan.image.as_deref()).await?,
    );
    let mut harnesses: BTreeMap<String, Arc<dyn Harness>> = BTreeMap::new();
    harnesses.insert(record.agent.clone(), plan.harness.clone());
    let sink = Arc::new(PrintingSink::new(Arc::new(LogSink::new(
        log.clone(),
        now_ms(),
    ))));
    let runner = SliceRunner {
        providers,
        harnesses,
        sink,
        env: plan.env.clone(),
        model: plan.model.clone(),
        poll_interval: Duration::from_millis(150),
        sleep: Arc::new(|d| Box::pin(tokio::time::sleep(d))),
        now_ms: Arc::new(now_ms),
    };
    let spawn: Spawner = Arc::new(|f| {
        tokio::spawn(f);
    });
    let engine = InProcessEngine::new(Arc::new(runner), store, spawn);
    let resumed = engine.resume_unfinished().await?;
    if resumed > 0 {
        eprintln!("resumed {resumed} interrupted turn(s) from an earlier run");
    }

    let mut state = TurnState::new(
        record.id.clone(),
        turn_id.clone(),
        record.agent.clone(),
        plan.prompt.clone(),
    );
    state.sandbox = Some(record.sandbox.clone());
    state.agent_session_id = record.agent_session_id.clone();
    if let Some(ms) = plan.slice_ms {
        state.config.slice_ms = ms;
    }
    engine.start_turn(state).await?;
    record.turns += 1;
    home.save_session(&record)?;

    let final_state = tokio::select! {
        done = engine.wait_turn(&record.id, &turn_id) => done?,
        _ = tokio::signal::ctrl_c() => {
            eprintln!("\naborting the turn (the session stays usable)…");
            engine.abort_turn(&record.id, &turn_id, "interrupted from the terminal").await?;
            engine.wait_turn(&record.id, &turn_id).await?
        }
    };
    if final_state.agent_session_id.is_some() {
        record.agent_session_id = final_state.agent_session_id.clone();
        home.save_session(&record)?;
    }
    Ok((record, final_state))
}

/// Describe how a turn ended.
pub fn summary(state: &TurnState) -> String {
    match state.status {
        TurnStatus::Finished => format!(
            "turn {} finished in {} slice(s)",
            state.turn_id, state.slices_run
        ),
        status => format!(
            "turn {} ended {}: {}",
            state.turn_id,
            status.as_str(),
            state.error.as_deref().unwrap_or("no error recorded")
        ),
    }
}

/// `harness run`.
pub async fn run_command(home: &Home, args: RunArgs) -> Result<()> {
    let EngineKind::Local = args.engine;
    let agent = match &args.session {
        Some(id) => AgentKind::from_name(&home.load_session(id)?.agent).unwrap_or(args.agent),
        None => args.agent,
    };
    let env = agent_env();
    let key_var = match agent {
        AgentKind::ClaudeCode => "ANTHROPIC_API_KEY",
        AgentKind::Codex => "OPENAI_API_KEY",
    };
    if !env.contains_key(key_var) {
        bail!("{key_var} is not set: export it to run {} for real, or try `harness demo` (no key needed)", agent.name());
    }
    let binary = crate::agents::ensure_binary(home, agent).await?;
    let plan = TurnPlan {
        agent,
        harness: crate::agents::adapter(agent, binary)?,
        sandbox: args.sandbox,
        image: args.image,
        env,
        model: args.model,
        session: args.session,
        slice_ms: args.slice_ms,
        prompt: args.prompt,
    };
    let (record, state) = execute(home, plan).await?;
    eprintln!(
        "{} — continue with `harness run --session {} PROMPT`",
        summary(&state),
        record.id
    );
    if state.status == TurnStatus::Finished {
        Ok(())
    } else {
        bail!("{}", summary(&state))
    }
}
