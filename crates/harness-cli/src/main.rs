//! `harness`: run Claude Code and Codex turns in sandboxes as durable
//! sessions, serve sessions over HTTP, and move working trees.
//!
//! The binary is a thin layer over the `harness` facade; see `docs/cli.md`.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};

mod agents;
mod broker;
mod client;
mod demo;
#[cfg(test)]
mod doc_commands;
mod features;
mod helpers;
mod home;
mod image;
mod local;
mod moves;
mod print;
mod reconnect;
mod relay_host;
mod serve;
mod serve_sandboxes;
mod sessions;
mod stop;
mod telemetry;
mod turn;
mod worker;

/// Run coding agents in sandboxes as durable sessions.
#[derive(Debug, Parser)]
#[command(name = "harness", version, about, long_about = None)]
struct Cli {
    /// Where sessions, the SQLite log and local sandboxes live
    /// (default: $HARNESS_HOME, else ~/.local/share/harness).
    #[arg(long, global = true, env = "HARNESS_HOME")]
    home: Option<PathBuf>,
    /// Log more (repeat for more detail). Logs go to stderr.
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    verbose: u8,
    /// Export spans (session commands, turns, slices, agent starts, sandbox
    /// execs, log appends, checkpoints) to this OTLP/HTTP endpoint, e.g.
    /// http://127.0.0.1:4318. Needs a build with the `otlp` feature.
    #[arg(
        long,
        global = true,
        env = "OTEL_EXPORTER_OTLP_ENDPOINT",
        value_name = "URL"
    )]
    otlp: Option<String>,
    /// Give agents the model key and URL themselves, as environment
    /// variables inside the sandbox (anything the agent runs can read the
    /// key). Default: agents reach the model through this home's broker
    /// with a session token and never see the key.
    /// `HARNESS_DIRECT_MODEL` takes 1/0, true/false, yes/no, on/off.
    #[arg(
        long,
        global = true,
        env = "HARNESS_DIRECT_MODEL",
        action = clap::ArgAction::SetTrue,
        value_parser = clap::builder::BoolishValueParser::new()
    )]
    direct_model: bool,
    #[command(subcommand)]
    command: Command,
}

/// Which agent runs the turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum AgentKind {
    /// Claude Code (`claude`).
    ClaudeCode,
    /// Codex (`codex`).
    Codex,
}

impl AgentKind {
    /// The adapter name recorded in turn states.
    pub fn name(self) -> &'static str {
        match self {
            AgentKind::ClaudeCode => "claude-code",
            AgentKind::Codex => "codex",
        }
    }

    /// Parse an adapter name.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "claude-code" => Some(AgentKind::ClaudeCode),
            "codex" => Some(AgentKind::Codex),
            _ => None,
        }
    }
}

/// Which sandbox backend to create a session in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SandboxKind {
    /// A directory on this host (not a security boundary).
    Local,
    /// A Docker container.
    Docker,
    /// A Cloudflare Sandbox bridge (HARNESS_CF_BRIDGE_URL, HARNESS_CF_TOKEN).
    Cloudflare,
    /// A QEMU microVM (the guest `cargo xtask microvm` builds; HARNESS_MICROVM_ASSETS).
    Microvm,
}

impl SandboxKind {
    /// The provider name recorded in session configs.
    pub fn name(self) -> &'static str {
        match self {
            SandboxKind::Local => "local",
            SandboxKind::Docker => "docker",
            SandboxKind::Cloudflare => "cloudflare",
            SandboxKind::Microvm => "microvm",
        }
    }
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run a real agent turn against the built-in scripted model: no API key,
    /// no network. Shows the whole path working.
    Demo {
        /// The agent to run.
        #[arg(long, value_enum, default_value = "claude-code")]
        agent: AgentKind,
        /// Keep the demo's sandbox instead of destroying it.
        #[arg(long)]
        keep: bool,
    },
    /// Run one turn with real credentials from the environment
    /// (ANTHROPIC_API_KEY for Claude Code, OPENAI_API_KEY for Codex). When
    /// a `harness serve` drives this home the turn goes through it (its
    /// clients see the run live); otherwise it runs in this process.
    Run {
        /// The agent (ignored with --session: the session's agent is used).
        #[arg(long, value_enum, default_value = "claude-code")]
        agent: AgentKind,
        /// Sandbox for a new session.
        #[arg(long, value_enum, default_value = "local")]
        sandbox: SandboxKind,
        /// Ask on the terminal before tools that need permission (a new
        /// session; Claude Code needs harness-approval-mcp next to harness).
        #[arg(long)]
        approvals: bool,
        /// Continue this session (its sandbox and conversation).
        #[arg(long)]
        session: Option<String>,
        /// Model name passed to the agent.
        #[arg(long)]
        model: Option<String>,
        /// Docker image for a new docker session.
        #[arg(long)]
        image: Option<String>,
        #[command(flatten)]
        checkpoints: turn::CheckpointFlags,
        #[command(flatten)]
        network: turn::NetworkArgs,
        #[command(flatten)]
        limits: local::TurnLimits,
        /// The prompt.
        prompt: String,
    },
    /// Finish turns that an earlier run left unfinished (crash, kill -9).
    Resume,
    /// Serve sessions over HTTP, WebSocket and SSE; a client's prompt runs
    /// a turn.
    Serve(serve::ServeArgs),
    /// Run the slices of a `harness serve --engine temporal` (a Temporal
    /// worker writing to the server as the session's runner).
    Worker(worker::WorkerArgs),
    /// Run the turns of a `harness serve --engine remote` where the
    /// sandboxes are (an in-process engine attached to the server as its
    /// runner).
    Runner(worker::RunnerArgs),
    /// List, show, export and fork sessions.
    Sessions {
        #[command(subcommand)]
        command: sessions::SessionsCommand,
    },
    /// Checkpoint a whole session (working tree and agent state) into an
    /// S3/R2 store; --tree-only for the working tree alone.
    Checkpoint(moves::CheckpointArgs),
    /// Restore a session checkpoint into a new session (--new-session, any
    /// sandbox) or an existing one (--session); the next `harness run
    /// --session` continues the conversation. --tree-only for a tree.
    Restore(moves::RestoreArgs),
    /// List checkpoints in the store.
    Ls(moves::LsArgs),
    /// Delete the content blobs that no tree checkpoint (`harness
    /// checkpoint --tree-only --incremental`) in the store references.
    /// Refused while a tree checkpoint runs on the store.
    Gc(moves::GcArgs),
    /// The home's model broker: `serve` (started by the other commands when
    /// none runs) and `usage SESSION`.
    Broker {
        #[command(subcommand)]
        command: broker::BrokerCommand,
    },
    /// Serve tools from this machine to one session's agent (MCP tools
    /// `mcp__host__<name>`), each call run at most once.
    RelayHost(relay_host::RelayHostArgs),
    /// The Docker image sessions start from when they name none: `build`
    /// makes it (Docker sessions make it on first use too).
    Image {
        #[command(subcommand)]
        command: image::ImageCommand,
    },
}

fn main() -> ExitCode {
    // Invoked under a helper's name (a sandbox's gate, approval server or
    // host-tool bridge): be that helper (`helpers.rs`).
    if let Some(code) = helpers::dispatch() {
        return code;
    }
    let cli = Cli::parse();
    // `HARNESS_FAILPOINT` stops this process at a named point for a kill
    // trial (docs/reliability.md); unset, nothing happens.
    harness::runtime::failpoints::install_from_env();
    // Dropped last, after the runtime: it flushes the spans still queued.
    let _telemetry = match telemetry::init(cli.verbose, cli.otlp.as_deref()) {
        Ok(guard) => guard,
        Err(e) => {
            eprintln!("error: {e:#}");
            return ExitCode::FAILURE;
        }
    };
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async move {
        let home = home::Home::open(cli.home)?.with_direct_model(cli.direct_model);
        match cli.command {
            Command::Demo { agent, keep } => demo::run(&home, agent, keep).await,
            Command::Run {
                agent,
                sandbox,
                approvals,
                session,
                model,
                image,
                checkpoints,
                network,
                limits,
                prompt,
            } => {
                turn::run_command(
                    &home,
                    turn::RunArgs {
                        agent,
                        sandbox,
                        session,
                        model,
                        image,
                        checkpoints,
                        network,
                        limits,
                        approvals,
                        prompt,
                    },
                )
                .await
            }
            Command::Resume => turn::resume_command(&home).await,
            Command::Serve(args) => serve::run(&home, args).await,
            Command::Worker(args) => worker::run(&home, args).await,
            Command::Runner(args) => worker::runner(&home, args).await,
            Command::Sessions { command } => sessions::run(&home, command).await,
            Command::Checkpoint(args) => moves::checkpoint(&home, args).await,
            Command::Restore(args) => moves::restore(&home, args).await,
            Command::Ls(args) => moves::ls(&home, args).await,
            Command::Gc(args) => moves::gc(&home, args).await,
            Command::RelayHost(args) => relay_host::run(args).await,
            Command::Broker { command } => broker::run(&home, command).await,
            Command::Image { command } => image::run(&home, command).await,
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    /// Clap's own consistency checks over every subcommand (a flag defined
    /// twice in one command, e.g. a flattened `--prefix`, fails here rather
    /// than as a panic when a user runs that command).
    #[test]
    fn the_command_line_is_consistent() {
        super::Cli::command().debug_assert();
    }

    /// The documented `HARNESS_DIRECT_MODEL=1` is accepted (clap's plain
    /// bool flag took only `true`/`false` from the environment).
    #[test]
    fn direct_model_takes_the_documented_env_values() {
        use clap::Parser;
        for (value, want) in [
            ("1", true),
            ("true", true),
            ("yes", true),
            ("0", false),
            ("false", false),
        ] {
            std::env::set_var("HARNESS_DIRECT_MODEL", value);
            let cli = super::Cli::try_parse_from(["harness", "sessions", "list"]);
            std::env::remove_var("HARNESS_DIRECT_MODEL");
            let cli = cli.unwrap_or_else(|e| panic!("HARNESS_DIRECT_MODEL={value}: {e}"));
            assert_eq!(cli.direct_model, want, "HARNESS_DIRECT_MODEL={value}");
        }
        let cli =
            super::Cli::try_parse_from(["harness", "--direct-model", "sessions", "list"]).unwrap();
        assert!(cli.direct_model);
    }
}
