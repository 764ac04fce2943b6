//! `harness run` and `harness resume`: a turn through the home's session
//! runtime — in this process when nothing else drives the home, or through
//! the `harness serve` that does (so one session always has one actor, and
//! the server's clients see the run live).

use std::io::{BufRead, IsTerminal, Write};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use harness::core::actor::ClientMessage;
use harness::core::frame::SessionId;
use harness::core::part::StreamPart;
use harness::core::sandbox::NetworkPolicy;
use harness::core::session::{SandboxConfig, SessionConfig};
use harness::core::turn::TurnStatus;
use harness::runtime::{Runtime, SessionClient, TurnFollower, TurnHandle, TurnUpdate};

use crate::client::{Events, RemoteClient};
use crate::home::{Home, RuntimeLock, ServeInfo};
use crate::local::{self, EngineSpec};
use crate::print::Activity;
use crate::{AgentKind, SandboxKind};

/// `harness run` arguments.
#[derive(Debug)]
pub struct RunArgs {
    pub agent: AgentKind,
    pub sandbox: SandboxKind,
    pub session: Option<String>,
    pub model: Option<String>,
    pub image: Option<String>,
    pub checkpoints: CheckpointFlags,
    pub network: NetworkArgs,
    pub limits: local::TurnLimits,
    pub approvals: bool,
    pub prompt: String,
}

/// Who drives the home's sessions for this command.
pub enum Driver {
    /// This process (it holds the home's lock).
    Local(RuntimeLock),
    /// The `harness serve` that holds it.
    Remote(RemoteClient, ServeInfo),
}

/// Take the home, or find the server that has it.
pub async fn driver(home: &Home, what: &str) -> Result<Driver> {
    loop {
        if let Some(lock) = home.try_lock_runtime()? {
            // A server killed without cleanup leaves its file behind.
            home.remove_serve_info();
            return Ok(Driver::Local(lock));
        }
        if let Some(info) = home.serve_info() {
            let client = RemoteClient::new(&info.url, Some(info.token.clone()));
            if client.reachable().await {
                eprintln!(
                    "harness serve (pid {}) drives this home: {what} goes through {}",
                    info.pid, info.url
                );
                return Ok(Driver::Remote(client, info));
            }
        }
        // Another `harness run` (or a server still starting): wait for it.
        let lock = home.lock_runtime(what).await?;
        drop(lock);
    }
}

/// The network of a new session's sandbox.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct NetworkArgs {
    /// Network policy of a new session's sandbox: `allow-all`, `deny-all`
    /// (nothing but the model, through the broker), or `custom` (only what
    /// --allow-host / --allow-cidr name, through the egress proxy).
    #[arg(long, value_enum, default_value = "allow-all")]
    pub network: NetworkMode,
    /// With --network custom: a host the sandbox may reach (`example.com`,
    /// `*.example.com`); repeatable.
    #[arg(long = "allow-host", value_name = "HOST")]
    pub allow_hosts: Vec<String>,
    /// With --network custom: an address range the sandbox may reach
    /// (`10.1.0.0/16`); repeatable.
    #[arg(long = "allow-cidr", value_name = "CIDR")]
    pub allow_cidrs: Vec<String>,
    /// With --network custom: a range never reached, even when allowed above.
    #[arg(long = "deny-cidr", value_name = "CIDR")]
    pub deny_cidrs: Vec<String>,
    /// With --network custom: the only ports reached (default: any).
    #[arg(long = "allow-port", value_name = "PORT")]
    pub allow_ports: Vec<u16>,
}

/// `--network`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum NetworkMode {
    /// Unrestricted.
    #[default]
    AllowAll,
    /// Nothing but the model broker.
    DenyAll,
    /// The --allow-* lists, through the egress proxy.
    Custom,
}

impl NetworkArgs {
    /// The policy these flags name; lists without `--network custom` are an
    /// error rather than ignored.
    pub fn policy(&self) -> Result<NetworkPolicy> {
        let lists = !(self.allow_hosts.is_empty()
            && self.allow_cidrs.is_empty()
            && self.deny_cidrs.is_empty()
            && self.allow_ports.is_empty());
        match self.network {
            NetworkMode::AllowAll | NetworkMode::DenyAll if lists => anyhow::bail!(
                "--allow-host, --allow-cidr, --deny-cidr and --allow-port need --network custom"
            ),
            NetworkMode::AllowAll => Ok(NetworkPolicy::AllowAll),
            NetworkMode::DenyAll => Ok(NetworkPolicy::DenyAll),
            NetworkMode::Custom => Ok(NetworkPolicy::Custom {
                allowed_hosts: self.allow_hosts.clone(),
                allowed_cidrs: self.allow_cidrs.clone(),
                denied_cidrs: self.deny_cidrs.clone(),
                allowed_ports: self.allow_ports.clone(),
            }),
        }
    }
}

/// A new session's turn-end checkpoints (docs/turn-checkpoints.md).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct CheckpointFlags {
    /// Take no turn-end checkpoints (a new session; it then cannot be
    /// forked with its tree, rewound or rehydrated).
    #[arg(long)]
    pub no_checkpoints: bool,
    /// Leave paths out of the turn-end checkpoints: `.gitignore`-style
    /// patterns, e.g. `node_modules/.cache` (repeatable).
    #[arg(long = "checkpoint-exclude", value_name = "PATTERN")]
    pub exclude: Vec<String>,
    /// Also leave out what the tree's top-level `.gitignore` names.
    #[arg(long = "checkpoint-gitignore")]
    pub gitignore: bool,
}

impl CheckpointFlags {
    fn rules(&self) -> harness::core::session::CheckpointRules {
        harness::core::session::CheckpointRules {
            enabled: !self.no_checkpoints,
            exclude: self.exclude.clone(),
            gitignore: self.gitignore,
        }
    }
}

/// The session config of a new session from the flags.
fn new_config(args: &RunArgs) -> Result<SessionConfig> {
    Ok(SessionConfig {
        agent: args.agent.name().to_string(),
        sandbox: SandboxConfig {
            provider: args.sandbox.name().to_string(),
            image: args.image.clone(),
            network: args.network.policy()?,
            checkpoints: args.checkpoints.rules(),
        },
        model: args.model.clone(),
        approvals: args.approvals,
        budget: Default::default(),
    })
}

/// Where `agent` sends its model requests with `env`: the base URL the
/// user set, else the provider's public API.
fn model_url(env: &std::collections::BTreeMap<String, String>, agent: &str) -> Option<String> {
    let (var, default) = match AgentKind::from_name(agent)? {
        AgentKind::ClaudeCode => ("ANTHROPIC_BASE_URL", "https://api.anthropic.com"),
        AgentKind::Codex => ("OPENAI_BASE_URL", "https://api.openai.com/v1"),
    };
    Some(env.get(var).cloned().unwrap_or_else(|| default.to_string()))
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

/// How a followed turn ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ended {
    pub session: String,
    pub turn_id: String,
    pub status: TurnStatus,
    pub error: Option<String>,
    pub text: String,
    /// Slices the turn took (known when the engine runs in this process).
    pub slices: Option<u32>,
}

/// Describe how a turn ended.
pub fn summary(ended: &Ended) -> String {
    match (ended.status, ended.slices) {
        (TurnStatus::Finished, Some(n)) => {
            format!("turn {} finished in {n} slice(s)", ended.turn_id)
        }
        (TurnStatus::Finished, None) => format!("turn {} finished", ended.turn_id),
        (status, _) => format!(
            "turn {} ended {}: {}",
            ended.turn_id,
            status.as_str(),
            ended.error.as_deref().unwrap_or("no error recorded")
        ),
    }
}

/// A turn's updates, from a local handle or a server's event stream.
enum Updates {
    Local(TurnHandle),
    Remote(Events, TurnFollower, std::collections::VecDeque<TurnUpdate>),
}

impl Updates {
    async fn next(&mut self) -> Result<Option<TurnUpdate>> {
        match self {
            Updates::Local(handle) => Ok(handle.next().await),
            Updates::Remote(events, follower, queued) => loop {
                if let Some(update) = queued.pop_front() {
                    return Ok(Some(update));
                }
                if follower.is_ended() {
                    return Ok(None);
                }
                match events.next().await {
                    Some(message) => queued.extend(follower.push(&message?)),
                    None => return Ok(None),
                }
            },
        }
    }

    fn text(&self) -> String {
        match self {
            Updates::Local(_) => String::new(),
            Updates::Remote(_, follower, _) => follower.text().to_string(),
        }
    }
}

/// Where answers and aborts go.
enum Controls {
    Local(SessionClient),
    Remote(RemoteClient, String),
}

impl Controls {
    async fn send(&self, message: ClientMessage) -> Result<()> {
        match self {
            Controls::Local(session) => match message {
                ClientMessage::ApprovalResponse {
                    approval_id,
                    approved,
                    reason,
                } => Ok(session.answer(approval_id, approved, reason).await?),
                ClientMessage::Abort { reason, .. } => Ok(session
                    .abort(reason.unwrap_or_else(|| "aborted".into()))
                    .await?),
                other => bail!("not a turn control: {other:?}"),
            },
            Controls::Remote(client, session) => client.post(session, &message).await.map(|_| ()),
        }
    }
}

/// Ask on the terminal whether to allow a tool.
fn ask(tool: &str, input: &serde_json::Value) -> bool {
    eprint!("? allow {tool} {input}? [y/N] ");
    let _ = std::io::stderr().flush();
    let mut line = String::new();
    let _ = std::io::stdin().lock().read_line(&mut line);
    matches!(line.trim(), "y" | "Y" | "yes")
}

/// Print a turn as it happens until it ends; Ctrl-C aborts it (the session
/// stays usable); permission requests are asked on the terminal.
async fn follow(
    session: &str,
    turn_id: &str,
    mut updates: Updates,
    controls: &Controls,
    model_url: Option<String>,
) -> Result<Ended> {
    let mut activity = Activity::new(
        "starting the turn (a session's first turn makes its sandbox and installs the agent once)",
        model_url,
    );
    let mut text = String::new();
    let mut aborting = false;
    loop {
        let update = tokio::select! {
            update = updates.next() => update?,
            _ = tokio::signal::ctrl_c(), if !aborting => {
                aborting = true;
                eprintln!("\naborting the turn (the session stays usable)…");
                let abort = ClientMessage::Abort {
                    turn_id: Some(turn_id.to_string()),
                    reason: Some("interrupted from the terminal".into()),
                };
                if let Err(e) = controls.send(abort).await {
                    eprintln!("could not abort: {e:#}");
                }
                continue;
            }
        };
        let Some(update) = update else {
            activity.done();
            bail!("the session's stream ended before turn {turn_id} did");
        };
        match update {
            TurnUpdate::Part(part) => {
                if let StreamPart::TextDelta { delta, .. } = &part {
                    text.push_str(delta);
                }
                activity.part(&part);
                if let StreamPart::ToolApprovalRequest {
                    approval_id,
                    tool_name,
                    input,
                    ..
                } = &part
                {
                    if std::io::stdin().is_terminal() {
                        let approved = ask(tool_name, input);
                        let answer = ClientMessage::ApprovalResponse {
                            approval_id: approval_id.clone(),
                            approved,
                            reason: (!approved).then(|| "denied on the terminal".to_string()),
                        };
                        controls.send(answer).await?;
                    } else {
                        eprintln!(
                            "  waiting for a client to answer {approval_id} (POST /v1/sessions/{session}/messages)"
                        );
                    }
                }
            }
            TurnUpdate::Ended { status, error } => {
                activity.done();
                let remote_text = updates.text();
                return Ok(Ended {
                    session: session.to_string(),
                    turn_id: turn_id.to_string(),
                    status,
                    error,
                    text: if remote_text.is_empty() {
                        text
                    } else {
                        remote_text
                    },
                    slices: None,
                });
            }
        }
    }
}

/// Run one prompt in this process on the home's runtime.
pub async fn run_local(
    home: &Home,
    _lock: &RuntimeLock,
    options: local::Options,
    session: Option<String>,
    config: SessionConfig,
    prompt: String,
) -> Result<(Runtime, Ended)> {
    let options_env = options.env.clone();
    let runtime = local::runtime(home, options).await?;
    let started = runtime.start().await?;
    if started.resumed + started.redispatched > 0 {
        eprintln!(
            "picked up {} interrupted turn(s) from an earlier run",
            started.resumed.max(started.redispatched)
        );
    }
    let session = match session {
        Some(id) => runtime
            .session(&SessionId::parse(&id)?)
            .await
            .map_err(|e| {
                anyhow::anyhow!(
                    "unknown session {id:?} ({e}): `harness sessions list` shows the known ones"
                )
            })?,
        None => {
            let session = runtime.create_session(None, config.clone()).await?;
            eprintln!(
                "session {} ({} in a {} sandbox)",
                session.id(),
                config.agent,
                config.sandbox.provider
            );
            session
        }
    };
    // A turn of this session still running (an interrupted run picked up
    // above): finish it first, then send the prompt.
    let info = session.info().await?;
    let model_url = model_url(&options_env, &info.meta.config_or_default().agent);
    if let Some(running) = info.meta.active_turn() {
        eprintln!(
            "turn {} of session {} is still running; finishing it first…",
            running.turn_id,
            session.id()
        );
        let handle = session
            .follow(running.turn_id.clone(), info.last_seq)
            .await?;
        let earlier = follow(
            session.id().as_str(),
            &running.turn_id,
            Updates::Local(handle),
            &Controls::Local(session.clone()),
            model_url.clone(),
        )
        .await?;
        eprintln!("{}", summary(&earlier));
    }
    let turn = session.prompt(prompt).await?;
    let turn_id = turn.turn_id().to_string();
    let id = session.id().to_string();
    let mut ended = follow(
        &id,
        &turn_id,
        Updates::Local(turn),
        &Controls::Local(session),
        model_url,
    )
    .await?;
    // The turn's end is in the log once the client sees it, but the engine
    // still saves its last state: wait for that, so exiting never cuts the
    // engine short (its next start would finish the turn all over again).
    let done = tokio::time::timeout(
        Duration::from_secs(30),
        runtime.engine().wait_turn(&id, &turn_id),
    )
    .await;
    ended.slices = match done {
        Ok(Ok(state)) => Some(state.slices_run),
        _ => None,
    };
    Ok((runtime, ended))
}

/// Run one prompt through a running server.
pub async fn run_remote(
    client: &RemoteClient,
    session: Option<String>,
    config: &SessionConfig,
    prompt: String,
) -> Result<Ended> {
    let session = match session {
        Some(id) => {
            client.info(&id).await?;
            id
        }
        None => {
            let info = client.create(config).await?;
            eprintln!(
                "session {} ({} in a {} sandbox)",
                info.session, config.agent, config.sandbox.provider
            );
            info.session.to_string()
        }
    };
    let info = client.info(&session).await?;
    if let Some(running) = info.meta.active_turn() {
        eprintln!(
            "turn {} of session {session} is still running; finishing it first…",
            running.turn_id
        );
        let events = client.events(&session, info.last_seq).await?;
        let updates = Updates::Remote(
            events,
            TurnFollower::new(running.turn_id.clone()),
            Default::default(),
        );
        let controls = Controls::Remote(client.clone(), session.clone());
        // The server's agents reach the model from its environment, which
        // this process does not know.
        let earlier = follow(&session, &running.turn_id, updates, &controls, None).await?;
        eprintln!("{}", summary(&earlier));
    }
    let after = client.info(&session).await?.last_seq;
    let events = client.events(&session, after).await?;
    let ack = client
        .post(
            &session,
            &ClientMessage::Prompt {
                text: prompt,
                turn_id: None,
                key: None,
            },
        )
        .await?;
    let turn_id = ack["turnId"]
        .as_str()
        .context("the server's ack names no turn")?
        .to_string();
    let updates = Updates::Remote(
        events,
        TurnFollower::new(turn_id.clone()),
        Default::default(),
    );
    follow(
        &session,
        &turn_id,
        updates,
        &Controls::Remote(client.clone(), session.clone()),
        None,
    )
    .await
}

/// `harness run`.
pub async fn run_command(home: &Home, args: RunArgs) -> Result<()> {
    let env = local::agent_env();
    let driver = driver(home, "this run").await?;
    // The agent of a continued session is the session's own.
    let agent = match (&args.session, &driver) {
        (Some(id), Driver::Local(_)) => session_agent(home, id).await?.unwrap_or(args.agent),
        (Some(id), Driver::Remote(client, _)) => {
            let info = client.info(id).await?;
            AgentKind::from_name(&info.meta.config_or_default().agent).unwrap_or(args.agent)
        }
        (None, _) => args.agent,
    };
    let ended = match driver {
        Driver::Remote(client, _) => {
            run_remote(
                &client,
                args.session.clone(),
                &new_config(&args)?,
                args.prompt.clone(),
            )
            .await?
        }
        Driver::Local(lock) => {
            let key_var = match agent {
                AgentKind::ClaudeCode => "ANTHROPIC_API_KEY",
                AgentKind::Codex => "OPENAI_API_KEY",
            };
            if !env.contains_key(key_var) {
                bail!("{key_var} is not set: export it to run {} for real, or try `harness demo` (no key needed)", agent.name());
            }
            let options = local::Options {
                agents: vec![agent],
                env,
                image: args.image.clone(),
                limits: args.limits.clone(),
                engine: EngineSpec::InProcess,
                lenient: false,
                require_docker: args.sandbox == SandboxKind::Docker && args.session.is_none(),
                require_cloudflare: args.sandbox == SandboxKind::Cloudflare
                    && args.session.is_none(),
                cluster: None,
                docker_pool: 0,
            };
            let config = new_config(&args)?;
            run_local(
                home,
                &lock,
                options,
                args.session.clone(),
                config,
                args.prompt.clone(),
            )
            .await?
            .1
        }
    };
    eprintln!(
        "{} — continue with `harness run --session {} PROMPT`",
        summary(&ended),
        ended.session
    );
    if ended.status == TurnStatus::Finished {
        Ok(())
    } else {
        bail!("{}", summary(&ended))
    }
}

/// The agent a session of the home runs, if the session exists.
async fn session_agent(home: &Home, id: &str) -> Result<Option<AgentKind>> {
    use harness::core::log::SessionLog;
    let log = home.open_log()?;
    let session = SessionId::parse(id)?;
    match log.info(&session).await {
        Ok(info) => Ok(AgentKind::from_name(&info.meta.config_or_default().agent)),
        Err(e) if e.kind() == harness::core::ErrorKind::NotFound => {
            bail!("unknown session {id:?}: `harness sessions list` shows the known ones")
        }
        Err(e) => Err(e.into()),
    }
}

/// `harness resume`: finish every turn an earlier process left unfinished.
pub async fn resume_command(home: &Home) -> Result<()> {
    use harness::core::engine::TurnStore;
    use harness::core::log::SessionLog;
    let lock = match driver(home, "resume").await? {
        Driver::Local(lock) => lock,
        Driver::Remote(..) => {
            eprintln!("the running server resumes unfinished turns itself");
            return Ok(());
        }
    };
    // What an earlier process left: turns the engine's store holds
    // unfinished, and sessions whose log shows a turn still running (its
    // prompt stored, the engine never told).
    let log = home.open_log()?;
    let mut pending: Vec<(SessionId, String)> = Vec::new();
    for state in log.turn_store().unfinished().await? {
        pending.push((SessionId::parse(&state.session_id)?, state.turn_id));
    }
    for info in log.list().await? {
        if let Some(turn) = info.meta.active_turn().filter(|_| !info.sealed) {
            let key = (info.session.clone(), turn.turn_id.clone());
            if !pending.contains(&key) {
                pending.push(key);
            }
        }
    }
    if pending.is_empty() {
        eprintln!("no unfinished turns");
        return Ok(());
    }
    let options = local::Options {
        agents: vec![AgentKind::ClaudeCode, AgentKind::Codex],
        env: local::agent_env(),
        image: None,
        limits: Default::default(),
        engine: EngineSpec::InProcess,
        lenient: true,
        require_docker: false,
        require_cloudflare: false,
        cluster: None,
        docker_pool: 0,
    };
    let runtime = local::runtime(home, options).await?;
    runtime.start().await?;
    eprintln!("resuming {} unfinished turn(s)", pending.len());
    let bar = spinner("waiting for the resumed turns to end".into());
    let mut failed = 0;
    for (session, turn_id) in &pending {
        let (status, error) = loop {
            let info = log.info(session).await?;
            match info.meta.turn.as_ref() {
                Some(t) if t.turn_id == *turn_id && !t.is_active() => {
                    break (t.status, t.error.clone())
                }
                Some(t) if t.turn_id == *turn_id => {}
                // The log does not follow this turn (a log from before the
                // session kept its turns): ask the engine.
                _ => {
                    let done = runtime
                        .engine()
                        .wait_turn(session.as_str(), turn_id)
                        .await?;
                    break (done.status, done.error);
                }
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        };
        bar.suspend(|| match &error {
            Some(e) => eprintln!(
                "session {session}: turn {turn_id} ended {}: {e}",
                status.as_str()
            ),
            None => eprintln!(
                "session {session}: turn {turn_id} ended {}",
                status.as_str()
            ),
        });
        failed += usize::from(status != TurnStatus::Finished);
    }
    bar.finish_and_clear();
    drop(lock);
    if failed > 0 {
        bail!("{failed} resumed turn(s) did not finish");
    }
    Ok(())
}
