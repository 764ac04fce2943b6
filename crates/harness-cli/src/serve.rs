//! `harness serve`: the home's session runtime behind the session server.
//! A client's prompt runs a turn on the configured engine, in the session's
//! sandbox; approvals and aborts from any client reach it.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use harness::server::{GrantRole, Scope, ServerConfig, SessionServer, TokenGrant};
use harness_scripted_model::ScriptedModel;

use crate::home::{Home, ServeInfo};

/// A line for the operator on stderr. Unlike `eprintln!`, a closed stderr
/// (`harness serve 2>&1 | head`, a parent that stopped reading) does not
/// take the server down: the line is dropped.
macro_rules! note {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}
use crate::local::{self, EngineSpec};
use crate::AgentKind;

/// Which engine runs the server's turns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ServeEngine {
    /// In this process, turn states in the home's SQLite database.
    InProcess,
    /// On Temporal (`HARNESS_TEMPORAL_ADDRESS`, default 127.0.0.1:7233):
    /// run `harness worker --server URL --token T` for the slices.
    Temporal,
    /// In a remote runner: run `harness runner --server URL --token T`
    /// where the sandboxes are; turns wait for it.
    Remote,
}

/// `harness serve` arguments.
#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8787")]
    addr: String,
    /// A bearer token grant, `TOKEN=ROLE[@SESSION]` with ROLE one of
    /// client, runner, tool-host (`harness relay-host`), host (everything)
    /// and SESSION a session id or `*` (the default).
    /// Repeatable. Also read from $HARNESS_TOKENS (comma-separated).
    #[arg(long = "token", value_name = "TOKEN=ROLE[@SESSION]")]
    tokens: Vec<String>,
    /// Accept every request without a token (local development only).
    #[arg(long)]
    insecure_no_auth: bool,
    /// Stop an idle session's actor after this many seconds.
    #[arg(long, default_value_t = 30)]
    idle_secs: u64,
    /// The engine that runs turns.
    #[arg(long, value_enum, default_value = "in-process")]
    engine: ServeEngine,
    /// Run the agents against the built-in scripted model (no key, no
    /// network): every prompt gets a Bash call writing hello.txt, then an
    /// answer. Implies --insecure-no-auth when no token is given.
    #[arg(long)]
    demo: bool,
    /// Docker image for docker sessions that name none.
    #[arg(long)]
    image: Option<String>,
    /// Ready Docker containers kept for new sessions, per shape (image,
    /// network policy, …; at most 4 shapes): a session's first turn takes
    /// one instead of creating and starting a container (~0.2 s,
    /// docs/performance.md). 0 turns the pool off.
    #[arg(long, default_value_t = 1, value_name = "N")]
    docker_pool: usize,
    /// Where the session logs live: the home's SQLite file (the default),
    /// or `postgres://…`, shared by several `harness serve` nodes, each
    /// session's actor on one node at a time (docs/scale.md; needs
    /// `--engine temporal`).
    #[arg(long, value_name = "URL")]
    log: Option<String>,
    /// With `--log postgres://…`: the URL the other nodes reach this one
    /// at, which is also its name among them (default: the address it
    /// listens on).
    #[arg(long, value_name = "URL")]
    node_url: Option<String>,
    /// With `--log postgres://…`: how long a session's lease lasts unless
    /// renewed, in seconds — how long a dead node's sessions wait for
    /// another node to take them over.
    #[arg(long, default_value_t = 10, value_name = "SECS")]
    lease_secs: u64,
    /// The audit key that chains every session's frames (default: the
    /// home's). Nodes sharing one log must share it.
    #[arg(long, value_name = "FILE")]
    audit_key: Option<std::path::PathBuf>,
    /// Retention: delete sessions idle (no frame stored) for more than
    /// this many days, checked hourly. A session with a turn running is
    /// kept; `harness gc` then collects checkpoints no session references.
    #[arg(long, value_name = "DAYS", value_parser = clap::value_parser!(u64).range(1..))]
    retain_days: Option<u64>,
    /// Retention: keep at most this many sessions, the most recently
    /// active; older ones are deleted (checked hourly).
    #[arg(long, value_name = "N")]
    retain_sessions: Option<usize>,
    #[command(flatten)]
    limits: local::TurnLimits,
}

/// Parse `TOKEN=ROLE[@SESSION]`.
pub fn parse_grant(text: &str) -> Result<TokenGrant> {
    let (token, rest) = text
        .split_once('=')
        .context("a token grant looks like TOKEN=ROLE[@SESSION]")?;
    if token.len() < 16 {
        bail!(
            "token {:?}… is too short: use at least 16 characters",
            &token[..token.len().min(4)]
        );
    }
    let (role, scope) = rest.split_once('@').unwrap_or((rest, "*"));
    let role = match role {
        "client" => GrantRole::Client,
        "runner" => GrantRole::Runner,
        "host" => GrantRole::Host,
        "tool-host" => GrantRole::ToolHost,
        other => bail!("unknown role {other:?}: use client, runner, tool-host or host"),
    };
    Ok(TokenGrant::new(token, Scope::parse(scope)?, role))
}

/// Where the demo's scripted model listens: on the Docker bridge gateway
/// when Docker is there (an address of this machine that both local
/// sandboxes and containers reach), else on loopback.
async fn demo_model() -> Result<ScriptedModel> {
    #[cfg(feature = "docker")]
    let gateway = match harness::docker::DockerProvider::connect(Default::default()).await {
        Ok(docker) => docker.bridge_gateway().await,
        Err(_) => None,
    };
    #[cfg(not(feature = "docker"))]
    let gateway = None;
    let ip = gateway.unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST));
    ScriptedModel::start_on(SocketAddr::new(ip, 0), crate::demo::script())
        .await
        .context("starting the built-in scripted model")
}

/// The grants from `--token` and `$HARNESS_TOKENS`, and whether the
/// server runs without authentication (asked for, or a demo with no
/// grants).
fn grants(args: &ServeArgs) -> Result<(Vec<TokenGrant>, bool)> {
    let env_tokens = std::env::var("HARNESS_TOKENS").unwrap_or_default();
    let grants = args
        .tokens
        .iter()
        .map(String::as_str)
        .chain(env_tokens.split(',').filter(|s| !s.is_empty()))
        .map(parse_grant)
        .collect::<Result<Vec<_>>>()?;
    let insecure = args.insecure_no_auth || (args.demo && grants.is_empty());
    if grants.is_empty() && !insecure {
        bail!("no tokens: pass --token TOKEN=host (and client/runner grants), or --insecure-no-auth for local development");
    }
    Ok((grants, insecure))
}

/// The runtime that runs turns in this process, started (interrupted turns
/// resumed); `None` with a remote runner, where this process runs no
/// engine.
async fn start_runtime(
    home: &Home,
    args: &ServeArgs,
    env: BTreeMap<String, String>,
    cluster: Option<local::Cluster>,
) -> Result<Option<harness::runtime::Runtime>> {
    let engine = match args.engine {
        ServeEngine::Remote => return Ok(None),
        ServeEngine::InProcess => EngineSpec::InProcess,
        #[cfg(feature = "temporal")]
        ServeEngine::Temporal => {
            EngineSpec::Temporal(harness::temporal::TemporalConfig::from_env())
        }
        #[cfg(not(feature = "temporal"))]
        ServeEngine::Temporal => {
            return Err(crate::features::missing("temporal", "`--engine temporal`"))
        }
    };
    let options = local::Options {
        agents: vec![AgentKind::ClaudeCode, AgentKind::Codex],
        env,
        image: args.image.clone(),
        limits: args.limits.clone(),
        engine,
        lenient: true,
        require_docker: false,
        require_cloudflare: false,
        cluster,
        docker_pool: args.docker_pool,
    };
    let runtime = local::runtime(home, options).await?;
    let started = runtime.start().await?;
    if started.resumed + started.redispatched > 0 {
        note!(
            "resumed {} turn(s), re-sent the commands of {} session(s)",
            started.resumed,
            started.redispatched
        );
    }
    Ok(Some(runtime))
}

/// Which log this server keeps its sessions in, from `--log`.
enum LogSetting {
    /// The home's SQLite file.
    Home,
    /// A PostgreSQL database shared with other nodes.
    Postgres(String),
}

impl LogSetting {
    fn parse(args: &ServeArgs) -> Result<Self> {
        let Some(url) = &args.log else {
            return Ok(LogSetting::Home);
        };
        if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
            bail!(
                "--log {url:?}: give a PostgreSQL URL (postgres://user@host:port/db), or leave \
                 --log out for the home's SQLite file"
            );
        }
        if args.engine != ServeEngine::Temporal {
            bail!(
                "--log postgres://… runs the turns of several nodes on Temporal: add `--engine temporal` \
                 (an in-process turn would die with its node; docs/scale.md)"
            );
        }
        if args.lease_secs < 2 {
            bail!("--lease-secs must be at least 2 (a lease is renewed every third of it)");
        }
        Ok(LogSetting::Postgres(url.clone()))
    }
}

/// This node among the others over one PostgreSQL: the shared log (fenced
/// by this node's leases), the leases, and the host token to forward with.
#[cfg(feature = "postgres")]
async fn join_cluster(
    url: &str,
    node: &str,
    args: &ServeArgs,
    key: harness::core::log::ChainKey,
    grants: &[TokenGrant],
    insecure: bool,
) -> Result<local::Cluster> {
    let peer_token = grants
        .iter()
        .find(|g| g.role == GrantRole::Host && g.scope == Scope::All)
        .map(|g| g.token.clone());
    if peer_token.is_none() && !insecure {
        bail!(
            "nodes forward sessions to each other with a host token: pass the same \
             --token TOKEN=host to every node"
        );
    }
    let log = harness::postgres::PostgresSessionLog::connect(url)
        .await?
        .with_chain_key(key);
    let leases = log.leases(node, Duration::from_secs(args.lease_secs))?;
    Ok(local::Cluster {
        log: Arc::new(log.fenced(leases.clone())),
        leases: Arc::new(leases),
        peer_token,
        describe: format!("{} as node {node}", harness::postgres::redacted(url)),
    })
}

#[cfg(not(feature = "postgres"))]
async fn join_cluster(
    _url: &str,
    _node: &str,
    _args: &ServeArgs,
    _key: harness::core::log::ChainKey,
    _grants: &[TokenGrant],
    _insecure: bool,
) -> Result<local::Cluster> {
    Err(crate::features::missing("postgres", "`--log postgres://…`"))
}

/// What the server says once it serves: where, and how to go on.
fn greet(
    home: &Home,
    log: &str,
    url: &str,
    engine: ServeEngine,
    engine_name: &str,
    model: Option<&ScriptedModel>,
) {
    note!("serving sessions on {url} (log: {log}, engine: {engine_name})");
    note!(
        "  Durable Streams: {url}/v1/stream/ (generic streams in {})",
        home.streams_db().display()
    );
    note!("  the web page: {url}/ (docs/web.md)");
    if let Some(model) = model {
        note!(
            "demo: the agents talk to the scripted model at {}",
            model.base_url()
        );
        note!("  curl -s -XPOST {url}/v1/sessions -d '{{\"id\":\"demo\"}}'");
        note!(
            "  curl -s -XPOST {url}/v1/sessions/demo/messages -d '{{\"type\":\"prompt\",\"text\":\"hello\"}}'"
        );
        note!("  curl -sN {url}/v1/sessions/demo/events");
    }
    match engine {
        ServeEngine::Temporal => note!(
            "turns run on Temporal: start a worker with `harness worker --server {url} --token <runner token>`"
        ),
        ServeEngine::Remote => note!(
            "turns run in a remote runner: start one with `harness runner --server {url} --token <runner token>`"
        ),
        ServeEngine::InProcess => {}
    }
}

/// Run the server until interrupted.
pub async fn run(home: &Home, args: ServeArgs) -> Result<()> {
    let (config_tokens, insecure) = grants(&args)?;
    // Bind first: a taken port is the most common mistake, say it before
    // anything slow.
    let listener = tokio::net::TcpListener::bind(&args.addr)
        .await
        .with_context(|| format!("binding {}", args.addr))?;
    let url = format!("http://{}", listener.local_addr()?);
    let log_setting = LogSetting::parse(&args)?;
    let lock = home.lock_runtime("harness serve").await?;
    let chain_key = match &args.audit_key {
        Some(path) => harness::core::log::ChainKey::new(
            harness::broker::load_or_make_secret(path)
                .with_context(|| format!("the audit key {}", path.display()))?,
        ),
        None => home.chain_key()?,
    };
    let cluster = match &log_setting {
        LogSetting::Home => None,
        LogSetting::Postgres(db) => {
            let node = args.node_url.clone().unwrap_or_else(|| url.clone());
            Some(
                join_cluster(
                    db,
                    &node,
                    &args,
                    chain_key.clone(),
                    &config_tokens,
                    insecure,
                )
                .await?,
            )
        }
    };
    let log_name = match &cluster {
        None => home.db().display().to_string(),
        Some(cluster) => cluster.describe.clone(),
    };

    let model = if args.demo {
        Some(demo_model().await?)
    } else {
        None
    };
    let env = match &model {
        Some(model) => crate::demo::model_env(model),
        None => local::agent_env(),
    };
    let runtime = start_runtime(home, &args, env, cluster).await?;

    let log: Arc<dyn harness::core::log::SessionLog> = match &runtime {
        Some(runtime) => runtime.hub().log().clone(),
        None => Arc::new(home.open_log()?),
    };
    let mut config = ServerConfig::new(log);
    config.chain_key = chain_key;
    config.tokens = config_tokens;
    config.insecure_no_auth = insecure;
    config.idle_timeout = Duration::from_secs(args.idle_secs);
    config.agents = vec!["claude-code".into(), "codex".into()];
    // What the runtime was built with (local, and docker, microvm or
    // cloudflare where they answered); a server whose turns run elsewhere
    // (remote runners) offers the two every runner has.
    config.providers = match &runtime {
        Some(runtime) => runtime.hub().sandbox_provider_names(),
        None => vec!["local".into(), "docker".into()],
    };
    // Generic Durable Streams outlive the process: every write is committed
    // to this file before it is answered.
    let streams = harness::server::durable_streams::StreamStore::open(home.streams_db())
        .with_context(|| format!("opening {}", home.streams_db().display()))?;
    config.stream_store = Some(Arc::new(streams));
    // A host token for clients on this machine (`harness run`), published
    // in the home only (mode 0600).
    let local_token = uuid::Uuid::new_v4().simple().to_string();
    config
        .tokens
        .push(TokenGrant::new(&local_token, Scope::All, GrantRole::Host));
    let sandboxes = crate::serve_sandboxes::sandbox_api(
        home,
        config.tokens.clone(),
        insecure,
        args.image.as_deref(),
    )
    .await?;
    let server = match &runtime {
        Some(runtime) => SessionServer::with_hub(config, runtime.hub().clone()),
        None => SessionServer::with_remote_runners(config),
    };
    let retention = harness::core::log::RetentionPolicy::of(args.retain_days, args.retain_sessions);
    if retention.is_active() {
        server.spawn_retention(retention, Duration::from_secs(3600));
        note!(
            "retention: deleting sessions idle over {} days, keeping at most {} (hourly)",
            args.retain_days.map_or("any".into(), |d| d.to_string()),
            args.retain_sessions.map_or("any".into(), |n| n.to_string())
        );
    }
    home.write_serve_info(&ServeInfo {
        url: url.clone(),
        token: local_token,
        pid: std::process::id(),
    })?;
    let engine_name = match &runtime {
        Some(runtime) => runtime.engine().name(),
        None => "remote runner",
    };
    greet(
        home,
        &log_name,
        &url,
        args.engine,
        engine_name,
        model.as_ref(),
    );
    // The sessions' routes and the sandbox API's (docs/ai-sdk.md).
    let router = server.router().merge(sandboxes.router());
    let served = tokio::select! {
        served = axum::serve(harness::server::no_delay(listener), router) => served.context("the server stopped"),
        () = crate::stop::requested() => {
            note!("shutting down");
            Ok(())
        }
    };
    if let Some(runtime) = &runtime {
        runtime.hub().shutdown_sandbox_providers().await;
    }
    home.remove_serve_info();
    drop(lock);
    drop(model);
    served
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grants_parse_and_bad_ones_are_explained() {
        let g = parse_grant("0123456789abcdef=client@s-1").unwrap();
        assert_eq!(g.role, GrantRole::Client);
        assert_eq!(g.scope, Scope::parse("s-1").unwrap());
        assert_eq!(
            parse_grant("0123456789abcdef=host").unwrap().scope,
            Scope::All
        );
        assert!(parse_grant("short=host")
            .unwrap_err()
            .to_string()
            .contains("too short"));
        assert!(parse_grant("0123456789abcdef=admin")
            .unwrap_err()
            .to_string()
            .contains("unknown role"));
        assert!(parse_grant("no-equals").is_err());
    }
}
