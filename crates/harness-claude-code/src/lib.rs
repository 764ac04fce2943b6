//! # harness-claude-code
//!
//! The [`Harness`] adapter for Anthropic's Claude Code CLI (`claude`).
//!
//! - **Provisioning**: the native binary from the npm package
//!   `@anthropic-ai/claude-code-linux-x64` (no Node needed) is a
//!   [`FileSource::HostPath`] file of the bootstrap recipe, so it lands in
//!   the identity snapshot once and is never copied per turn. In wrap-mode
//!   sandboxes with Claude Code already installed, set
//!   [`ClaudeCodeConfig::preinstalled`] and the recipe is empty.
//! - **Isolation**: every session runs with its own `HOME` and
//!   `CLAUDE_CONFIG_DIR=$HOME/.claude`, so all agent state (transcripts under
//!   `projects/`, and the `.claude.json` that would otherwise sit in `$HOME`)
//!   lives in one directory that travels with the tree.
//! - **Turns**: `claude -p --output-format stream-json --verbose
//!   --include-partial-messages --permission-mode bypassPermissions
//!   [--resume ID] -- PROMPT`, parsed by [`ClaudeCodeParser`].
//! - **Permission requests** (opt-in per session, `SessionConfig::approvals`,
//!   with the server given in [`ClaudeCodeConfig::approvals`]): the
//!   `harness-approval-mcp` server is installed next to the agent and named
//!   as `--permission-prompt-tool`; see `docs/agents.md`.
//!
//! See `docs/agents.md` for the flags and the parser mapping table.

mod parser;

use std::collections::BTreeMap;

use harness_core::bootstrap::{BootstrapRecipe, FileSource, RecipeFile};
use harness_core::harness::{AgentCommand, Harness, OutputParser, StateMove, TurnContext};
use harness_core::relay;
use harness_core::sandbox::shell_quote;
use harness_core::{Error, Result};

pub use harness_agent_binary::{parse_version, sha256_cached, AgentBinary, HelperBinary};
pub use parser::ClaudeCodeParser;

/// The Claude Code version these adapters were verified against.
pub const VERIFIED_VERSION: &str = "2.1.332";

/// Where the binary is installed inside a sandbox by default.
pub const DEFAULT_INSTALL_PATH: &str = "/opt/harness/bin/claude";

/// How to provision and run Claude Code.
#[derive(Debug, Clone)]
pub struct ClaudeCodeConfig {
    /// The native binary on the host (ignored when `preinstalled` is set).
    pub binary: Option<AgentBinary>,
    /// Path of an already-installed `claude` inside the sandbox (wrap-mode):
    /// the recipe is then empty and the command runs this path.
    pub preinstalled: Option<String>,
    /// Where the recipe installs the binary inside the sandbox.
    pub install_path: String,
    /// `--permission-mode` (default `bypassPermissions`: the harness sandbox
    /// is the security boundary).
    pub permission_mode: String,
    /// Extra arguments appended to every turn's command.
    pub extra_args: Vec<String>,
    /// The approval MCP server (`harness-approval-mcp`), installed by the
    /// recipe when set. A turn whose session asks for approvals
    /// (`TurnState::approvals`) then runs with `--permission-mode default
    /// --permission-prompt-tool mcp__harness__approve` instead of
    /// `permission_mode`, so permission requests go to the harness's
    /// client; such a turn without a server fails with a clear error.
    /// `None` (the default) keeps the sandbox as the only boundary.
    pub approvals: Option<ApprovalServer>,
    /// The host-tool bridge (`harness-relay-mcp`), installed by the recipe
    /// when set. A turn whose session's tool host offers tools
    /// (`TurnContext::relay_dir`) gets it as MCP server `host` (tools
    /// `mcp__host__<name>`); such a turn without it fails with a clear
    /// error.
    pub relay_bridge: Option<HelperBinary>,
}

/// The approval MCP server binary on the host (see `harness-approval-mcp`).
pub type ApprovalServer = HelperBinary;

/// Where the recipe installs the approval MCP server inside a sandbox.
pub const APPROVAL_SERVER_PATH: &str = "/opt/harness/bin/harness-approval-mcp";

/// The MCP server name in `--mcp-config`; Claude Code calls its tool
/// `mcp__<server>__<tool>`.
pub const APPROVAL_MCP_SERVER: &str = "harness";

/// The `--permission-prompt-tool` value.
pub const APPROVAL_TOOL: &str = "mcp__harness__approve";

impl Default for ClaudeCodeConfig {
    fn default() -> Self {
        Self {
            binary: None,
            preinstalled: None,
            install_path: DEFAULT_INSTALL_PATH.to_string(),
            permission_mode: "bypassPermissions".to_string(),
            extra_args: Vec::new(),
            approvals: None,
            relay_bridge: None,
        }
    }
}

impl ClaudeCodeConfig {
    /// Install `binary` at the default path.
    pub fn with_binary(binary: AgentBinary) -> Self {
        Self {
            binary: Some(binary),
            ..Self::default()
        }
    }

    /// Use a `claude` already installed at `path` inside the sandbox.
    pub fn preinstalled(path: impl Into<String>) -> Self {
        Self {
            preinstalled: Some(path.into()),
            ..Self::default()
        }
    }

    /// The binary named by `HARNESS_CLAUDE_BIN`, else the one `cargo xtask
    /// agents` installs under `$HARNESS_CACHE/agents` (default cache
    /// `/var/cache/harness`). `NotFound` when neither exists.
    pub fn from_env() -> Result<Self> {
        Ok(Self::with_binary(AgentBinary::load(locate_host_binary()?)?))
    }
}

/// Where the native `claude` is on this host: `$HARNESS_CLAUDE_BIN`, else
/// `$HARNESS_CACHE/agents/claude-code-<VERIFIED_VERSION>/node_modules/@anthropic-ai/claude-code-linux-x64/claude`.
pub fn locate_host_binary() -> Result<std::path::PathBuf> {
    harness_agent_binary::locate(
        "HARNESS_CLAUDE_BIN",
        &format!("claude-code-{VERIFIED_VERSION}/node_modules/@anthropic-ai/claude-code-linux-x64/claude"),
        "claude",
    )
}

/// The Claude Code adapter.
#[derive(Debug, Clone)]
pub struct ClaudeCodeHarness {
    config: ClaudeCodeConfig,
}

impl ClaudeCodeHarness {
    /// An adapter with `config`.
    pub fn new(config: ClaudeCodeConfig) -> Self {
        Self { config }
    }

    /// The configuration.
    pub fn config(&self) -> &ClaudeCodeConfig {
        &self.config
    }

    /// The `claude` path the turn command runs inside the sandbox.
    pub fn program(&self) -> &str {
        self.config
            .preinstalled
            .as_deref()
            .unwrap_or(&self.config.install_path)
    }
}

/// The launcher script run as `sh -c SCRIPT PROGRAM ARGS…`.
///
/// - It creates the session's state directory (`$CLAUDE_CONFIG_DIR` /
///   `$CODEX_HOME`) first, so a turn is one self-contained command.
/// - A backend whose sandbox filesystem is not rooted at `/` (sandbox-local:
///   recipe files land under `$HARNESS_SANDBOX_ROOT`) exports that root; the
///   installed binary is looked up there first, then at its plain path.
pub fn launcher_script(state_var: &str) -> String {
    format!(
        "mkdir -p \"${state_var}\" && p=\"${{HARNESS_SANDBOX_ROOT:-}}$0\" && {{ [ -x \"$p\" ] || p=\"$0\"; }} && exec \"$p\" \"$@\""
    )
}

fn launch_argv(program: &str, state_var: &str, args: Vec<String>) -> Vec<String> {
    let mut argv = vec![
        "sh".to_string(),
        "-c".to_string(),
        launcher_script(state_var),
        program.to_string(),
    ];
    argv.extend(args);
    argv
}

/// The bootstrap smoke test: the installed binary runs in this image (a
/// musl-only image cannot run Claude Code, and this says so at bootstrap
/// rather than at the first turn).
fn version_check(install: &str) -> String {
    format!(
        "\"${{HARNESS_SANDBOX_ROOT:-}}\"{} --version >/dev/null",
        shell_quote(install)
    )
}

impl Harness for ClaudeCodeHarness {
    fn name(&self) -> &'static str {
        "claude-code"
    }

    fn bootstrap_recipe(&self) -> Result<BootstrapRecipe> {
        if self.config.preinstalled.is_some() {
            return Ok(BootstrapRecipe::default());
        }
        let binary = self.config.binary.as_ref().ok_or_else(|| {
            Error::invalid(
                "ClaudeCodeConfig has neither `binary` nor `preinstalled`: \
                 set HARNESS_CLAUDE_BIN or use ClaudeCodeConfig::preinstalled",
            )
        })?;
        let install = &self.config.install_path;
        let mut files = vec![RecipeFile {
            path: install.clone(),
            mode: 0o755,
            source: FileSource::HostPath {
                path: binary.host_path.display().to_string(),
                sha256: binary.sha256.clone(),
            },
        }];
        let helpers: Vec<(&str, &HelperBinary)> = [
            (APPROVAL_SERVER_PATH, &self.config.approvals),
            (relay::files::BRIDGE_PATH, &self.config.relay_bridge),
        ]
        .into_iter()
        .filter_map(|(path, helper)| Some((path, helper.as_ref()?)))
        .collect();
        let (helper_files, mut commands) = harness_agent_binary::helper_files(&helpers);
        files.extend(helper_files);
        commands.push(version_check(install));
        Ok(BootstrapRecipe {
            files,
            // Backends create parent directories and set the mode when they
            // write recipe files, so no mkdir/chmod is needed here.
            bootstrap_pre_commands: Vec::new(),
            commands,
        })
    }

    fn turn_command(&self, turn: &TurnContext<'_>) -> Result<AgentCommand> {
        if turn.home.is_empty() || !turn.home.starts_with('/') {
            return Err(Error::invalid(format!(
                "session home must be an absolute path, got {:?}",
                turn.home
            )));
        }
        let mut args = vec![
            "-p".to_string(),
            "--output-format".into(),
            "stream-json".into(),
            // stream-json requires --verbose in -p mode.
            "--verbose".into(),
            // Live text deltas (stream_event lines), not only whole messages.
            "--include-partial-messages".into(),
        ];
        if turn.state.approvals && self.config.approvals.is_none() {
            return Err(Error::invalid(
                "this session asks for tool approvals, but the runner has no approval server \
                 (harness-approval-mcp): the `harness` binary is one (it runs as it under that \
                 name), or build it (`cargo build -p harness-approval-mcp`) and give its path \
                 in ClaudeCodeConfig::approvals (HARNESS_APPROVAL_MCP_BIN for the CLI)",
            ));
        }
        if turn.relay_dir.is_some() && self.config.relay_bridge.is_none() {
            return Err(Error::invalid(
                "this session's tool host offers tools, but the runner has no host-tool bridge \
                 (harness-relay-mcp): the `harness` binary is one (it runs as it under that \
                 name), or build it (`cargo build -p harness-relay-mcp`) and give its path in \
                 the adapter's config (HARNESS_RELAY_MCP_BIN for the CLI)",
            ));
        }
        // Permission requests and host-tool calls share the turn's relay.
        let relay = format!(
            "{}/{}",
            harness_core::slice::spool_dir(turn.home, &turn.state.turn_id),
            relay::files::DIR
        );
        if let Some(config) = mcp_config(&relay, turn.state.approvals, turn.relay_dir.is_some()) {
            args.extend(["--mcp-config".into(), config]);
        }
        if turn.state.approvals {
            args.extend([
                "--permission-mode".into(),
                "default".into(),
                "--permission-prompt-tool".into(),
                APPROVAL_TOOL.into(),
            ]);
        } else {
            args.extend([
                "--permission-mode".into(),
                self.config.permission_mode.clone(),
            ]);
        }
        if let Some(id) = &turn.state.agent_session_id {
            args.push("--resume".into());
            args.push(id.clone());
        }
        if let Some(model) = turn.model {
            args.push("--model".into());
            args.push(model.to_string());
        }
        if let Some(system) = turn.system_prompt {
            args.push("--append-system-prompt".into());
            args.push(system.to_string());
        }
        args.extend(self.config.extra_args.iter().cloned());
        // The prompt goes last, after `--`, so a prompt starting with `-` is
        // never taken for an option.
        args.push("--".into());
        args.push(turn.state.prompt.clone());

        let home = turn.home.trim_end_matches('/');
        let mut env: BTreeMap<String, String> = turn.env.clone();
        env.insert("HOME".into(), home.to_string());
        env.insert("CLAUDE_CONFIG_DIR".into(), format!("{home}/.claude"));
        // bypassPermissions is refused as root unless the CLI is told it is
        // inside a sandbox.
        env.insert("IS_SANDBOX".into(), "1".into());
        env.insert(
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC".into(),
            "1".into(),
        );
        env.entry("DISABLE_AUTOUPDATER".into())
            .or_insert_with(|| "1".into());
        Ok(AgentCommand {
            argv: launch_argv(self.program(), "CLAUDE_CONFIG_DIR", args),
            env,
            cwd: turn.workdir.to_string(),
        })
    }

    fn parser(&self) -> Box<dyn OutputParser> {
        Box::new(ClaudeCodeParser::new())
    }

    /// `<home>/.claude`: with `CLAUDE_CONFIG_DIR` pointing there, it holds the
    /// transcripts (`projects/<cwd with / → ->/<session>.jsonl`) and the
    /// `.claude.json` that would otherwise live directly in `<home>`.
    fn state_dirs(&self, home: &str) -> Vec<String> {
        vec![format!("{}/.claude", home.trim_end_matches('/'))]
    }

    /// Claude Code finds a session's transcript under
    /// `projects/<project_dir_name(cwd)>/`, so a session restored into a
    /// sandbox with another workdir must have that directory renamed (merged
    /// into an existing one), or `--resume` finds no conversation.
    fn relocate_state_script(&self, moved: &StateMove<'_>) -> Option<String> {
        let old = project_dir_name(moved.old_workdir);
        let new = project_dir_name(moved.workdir);
        if old == new {
            return None;
        }
        let projects = format!("{}/.claude/projects", moved.home.trim_end_matches('/'));
        Some(format!(
            "set -e\np={p}; old=\"$p\"/{old}; new=\"$p\"/{new}\n\
             if [ -d \"$old\" ]; then\n\
             \x20 if [ -e \"$new\" ]; then cp -a \"$old\"/. \"$new\"/ && rm -rf \"$old\"; else mv \"$old\" \"$new\"; fi\n\
             fi\n",
            p = shell_quote(&projects),
            old = shell_quote(&old),
            new = shell_quote(&new),
        ))
    }
}

/// The inline `--mcp-config` JSON: the approval server when the turn asks
/// for approvals, the host-tool bridge when its session's host offers
/// tools, both exchanging files in the turn's `relay_dir`; `None` for
/// neither. Each command goes through `sh` so that, like the agent itself,
/// the server is found under `$HARNESS_SANDBOX_ROOT` (sandbox-local) first,
/// then at its plain path (Docker etc.).
pub fn mcp_config(relay_dir: &str, approvals: bool, host_tools: bool) -> Option<String> {
    let server = |path: &str| {
        serde_json::json!({
            "type": "stdio",
            "command": "sh",
            "args": [
                "-c",
                "p=\"${HARNESS_SANDBOX_ROOT:-}$0\" && { [ -x \"$p\" ] || p=\"$0\"; } && exec \"$p\"",
                path,
            ],
            "env": { "HARNESS_RELAY_DIR": relay_dir },
        })
    };
    let mut servers = serde_json::Map::new();
    if approvals {
        servers.insert(APPROVAL_MCP_SERVER.into(), server(APPROVAL_SERVER_PATH));
    }
    if host_tools {
        servers.insert(
            relay::files::MCP_SERVER_NAME.into(),
            server(relay::files::BRIDGE_PATH),
        );
    }
    (!servers.is_empty()).then(|| serde_json::json!({ "mcpServers": servers }).to_string())
}

/// Longest project directory name before Claude Code shortens it.
const MAX_PROJECT_DIR: usize = 200;

/// The directory under `$CLAUDE_CONFIG_DIR/projects` where Claude Code keeps
/// the transcripts of sessions run in `cwd`: every UTF-16 code unit that is
/// not an ASCII letter or digit becomes `-`; names over 200 characters are
/// cut to 200 and suffixed with `-` and the base-36 absolute value of the
/// path's 32-bit Java-style string hash. Mirrors the CLI (2.1.332).
pub fn project_dir_name(cwd: &str) -> String {
    let units: Vec<u16> = cwd.encode_utf16().collect();
    let name: String = units
        .iter()
        .map(|&u| match u8::try_from(u) {
            Ok(b) if b.is_ascii_alphanumeric() => b as char,
            _ => '-',
        })
        .collect();
    if name.len() <= MAX_PROJECT_DIR {
        return name;
    }
    let hash = units.iter().fold(0i32, |h, &u| {
        h.wrapping_shl(5).wrapping_sub(h).wrapping_add(i32::from(u))
    });
    format!(
        "{}-{}",
        &name[..MAX_PROJECT_DIR],
        base36(i64::from(hash).unsigned_abs())
    )
}

fn base36(mut n: u64) -> String {
    const DIGITS: &[u8; 36] = b"0123456789abcdefghijklmnopqrstuvwxyz";
    let mut out = Vec::new();
    loop {
        out.push(DIGITS[(n % 36) as usize]);
        n /= 36;
        if n == 0 {
            break;
        }
    }
    out.reverse();
    String::from_utf8(out).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use harness_core::turn::TurnState;

    fn binary() -> AgentBinary {
        AgentBinary {
            host_path: "/cache/claude".into(),
            sha256: "ab".repeat(32),
            version: VERIFIED_VERSION.into(),
        }
    }

    fn ctx<'a>(state: &'a TurnState, env: &'a BTreeMap<String, String>) -> TurnContext<'a> {
        TurnContext {
            state,
            workdir: "/workspace",
            home: "/home/s1",
            env,
            model: None,
            system_prompt: None,
            relay_dir: None,
        }
    }

    #[test]
    fn project_dir_names_match_the_cli() {
        assert_eq!(project_dir_name("/workspace"), "-workspace");
        assert_eq!(
            project_dir_name("/var/cache/x_y.z/ab-12/work"),
            "-var-cache-x-y-z-ab-12-work"
        );
        // A non-BMP character is two UTF-16 units, so two dashes (as in JS).
        assert_eq!(project_dir_name("/a\u{1F600}b"), "-a--b");
        // Long paths: 200 chars, '-', base-36 |hash|. The CLI's own hash
        // function (copied from the binary) run in node gives -931632369,
        // i.e. "feo44x", for "/" + 250 'a's.
        let long = format!("/{}", "a".repeat(250));
        assert_eq!(
            project_dir_name(&long),
            format!("-{}-feo44x", "a".repeat(199))
        );
        assert_eq!(base36(0), "0");
        assert_eq!(base36(35), "z");
        assert_eq!(base36(36), "10");
    }

    #[test]
    fn relocation_renames_the_project_dir_only_when_the_cwd_changes() {
        let h = ClaudeCodeHarness::new(ClaudeCodeConfig::with_binary(binary()));
        let moved = |old_workdir, workdir| StateMove {
            old_home: "/old",
            home: "/h",
            old_workdir,
            workdir,
        };
        assert_eq!(
            h.relocate_state_script(&moved("/workspace", "/workspace")),
            None,
            "a new home alone needs nothing: the state is relative to it"
        );
        let script = h
            .relocate_state_script(&moved("/tmp/a/work", "/workspace"))
            .unwrap();
        assert!(script.contains("p=/h/.claude/projects"), "{script}");
        assert!(script.contains("old=\"$p\"/-tmp-a-work"), "{script}");
        assert!(script.contains("new=\"$p\"/-workspace"), "{script}");
    }

    #[test]
    fn recipe_installs_the_host_binary_once() {
        let h = ClaudeCodeHarness::new(ClaudeCodeConfig::with_binary(binary()));
        let r = h.bootstrap_recipe().unwrap();
        assert_eq!(r.files.len(), 1);
        assert_eq!(r.files[0].path, DEFAULT_INSTALL_PATH);
        assert_eq!(r.files[0].mode, 0o755);
        assert_eq!(
            r.files[0].source,
            FileSource::HostPath {
                path: "/cache/claude".into(),
                sha256: "ab".repeat(32)
            }
        );
        assert_eq!(
            r.commands,
            ["\"${HARNESS_SANDBOX_ROOT:-}\"/opt/harness/bin/claude --version >/dev/null"]
        );
        // A different build is a different snapshot identity.
        let mut other = binary();
        other.sha256 = "cd".repeat(32);
        let r2 = ClaudeCodeHarness::new(ClaudeCodeConfig::with_binary(other))
            .bootstrap_recipe()
            .unwrap();
        assert_ne!(r.identity("img"), r2.identity("img"));
    }

    #[test]
    fn preinstalled_means_empty_recipe_and_that_path() {
        let h = ClaudeCodeHarness::new(ClaudeCodeConfig::preinstalled("/usr/local/bin/claude"));
        assert!(h.bootstrap_recipe().unwrap().is_empty());
        let state = TurnState::new("s", "t", "claude-code", "hi");
        let env = BTreeMap::new();
        let cmd = h.turn_command(&ctx(&state, &env)).unwrap();
        assert_eq!(cmd.argv[3], "/usr/local/bin/claude");
    }

    #[test]
    fn no_binary_is_a_clear_error() {
        let err = ClaudeCodeHarness::new(ClaudeCodeConfig::default())
            .bootstrap_recipe()
            .unwrap_err();
        assert!(err.message().contains("HARNESS_CLAUDE_BIN"), "{err}");
    }

    #[test]
    fn first_and_resumed_turn_commands() {
        let h = ClaudeCodeHarness::new(ClaudeCodeConfig::with_binary(binary()));
        let mut env = BTreeMap::new();
        env.insert("ANTHROPIC_API_KEY".to_string(), "k".to_string());
        env.insert("ANTHROPIC_BASE_URL".to_string(), "http://m".to_string());
        let state = TurnState::new("s", "t1", "claude-code", "do it");
        let mut c = ctx(&state, &env);
        c.model = Some("claude-x");
        c.system_prompt = Some("be brief");
        let cmd = h.turn_command(&c).unwrap();
        assert_eq!(&cmd.argv[..2], ["sh", "-c"]);
        assert_eq!(cmd.argv[2], launcher_script("CLAUDE_CONFIG_DIR"));
        assert!(cmd.argv[2].starts_with("mkdir -p \"$CLAUDE_CONFIG_DIR\" && "));
        assert_eq!(cmd.argv[3], DEFAULT_INSTALL_PATH);
        let args = &cmd.argv[4..];
        assert_eq!(
            args,
            [
                "-p",
                "--output-format",
                "stream-json",
                "--verbose",
                "--include-partial-messages",
                "--permission-mode",
                "bypassPermissions",
                "--model",
                "claude-x",
                "--append-system-prompt",
                "be brief",
                "--",
                "do it"
            ]
        );
        assert_eq!(cmd.cwd, "/workspace");
        assert_eq!(cmd.env["HOME"], "/home/s1");
        assert_eq!(cmd.env["CLAUDE_CONFIG_DIR"], "/home/s1/.claude");
        assert_eq!(cmd.env["IS_SANDBOX"], "1");
        assert_eq!(cmd.env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"], "1");
        assert_eq!(cmd.env["ANTHROPIC_API_KEY"], "k");
        assert_eq!(cmd.env["ANTHROPIC_BASE_URL"], "http://m");

        let mut second = state.next_turn("t2", "again");
        second.agent_session_id = Some("sess-1".into());
        let cmd = h.turn_command(&ctx(&second, &env)).unwrap();
        let args = &cmd.argv[4..];
        let at = args.iter().position(|a| a == "--resume").unwrap();
        assert_eq!(args[at + 1], "sess-1");
        assert_eq!(args[args.len() - 2..], ["--", "again"]);
    }

    #[test]
    fn approvals_install_the_server_and_route_prompts_to_it() {
        let mut config = ClaudeCodeConfig::with_binary(binary());
        let plain = ClaudeCodeHarness::new(config.clone())
            .bootstrap_recipe()
            .unwrap();
        config.approvals = Some(ApprovalServer {
            host_path: "/cache/harness-approval-mcp".into(),
            sha256: "ef".repeat(32),
        });
        let h = ClaudeCodeHarness::new(config);
        let r = h.bootstrap_recipe().unwrap();
        assert_eq!(r.files.len(), 2);
        assert_eq!(r.files[1].path, APPROVAL_SERVER_PATH);
        assert_eq!(r.files[1].mode, 0o755);
        assert_eq!(
            r.files[1].source,
            FileSource::HostPath {
                path: "/cache/harness-approval-mcp".into(),
                sha256: "ef".repeat(32)
            }
        );
        assert_ne!(r.identity("img"), plain.identity("img"));

        let mut state = TurnState::new("s", "t9", "claude-code", "x");
        let env = BTreeMap::new();
        // Without the session asking, the turn bypasses permissions.
        let cmd = h.turn_command(&ctx(&state, &env)).unwrap();
        assert!(cmd.argv.iter().any(|a| a == "bypassPermissions"));
        state.approvals = true;
        // A runner without the server refuses such a turn, saying why.
        let err = ClaudeCodeHarness::new(ClaudeCodeConfig::with_binary(binary()))
            .turn_command(&ctx(&state, &env))
            .unwrap_err();
        assert!(err.to_string().contains("harness-approval-mcp"), "{err}");
        let cmd = h.turn_command(&ctx(&state, &env)).unwrap();
        let args = &cmd.argv[4..];
        let at = args.iter().position(|a| a == "--permission-mode").unwrap();
        assert_eq!(args[at + 1], "default");
        assert!(!args.iter().any(|a| a == "bypassPermissions"));
        let at = args
            .iter()
            .position(|a| a == "--permission-prompt-tool")
            .unwrap();
        assert_eq!(args[at + 1], "mcp__harness__approve");
        let at = args.iter().position(|a| a == "--mcp-config").unwrap();
        let mcp: serde_json::Value = serde_json::from_str(&args[at + 1]).unwrap();
        let server = &mcp["mcpServers"]["harness"];
        assert_eq!(server["command"], "sh");
        assert_eq!(server["args"][2], APPROVAL_SERVER_PATH);
        assert_eq!(
            server["env"]["HARNESS_RELAY_DIR"],
            "/home/s1/.harness/turns/t9/relay"
        );
        assert_eq!(args[args.len() - 2..], ["--", "x"]);
    }

    #[test]
    fn a_missing_approval_server_is_a_clear_error() {
        let err = ApprovalServer::load("/nonexistent/harness-approval-mcp").unwrap_err();
        assert!(err.message().contains("/nonexistent"), "{err}");
    }

    #[test]
    fn relative_home_is_refused() {
        let h = ClaudeCodeHarness::new(ClaudeCodeConfig::with_binary(binary()));
        let state = TurnState::new("s", "t", "claude-code", "x");
        let env = BTreeMap::new();
        let mut c = ctx(&state, &env);
        c.home = "home";
        assert!(h.turn_command(&c).is_err());
    }

    #[test]
    fn state_lives_under_home() {
        let h = ClaudeCodeHarness::new(ClaudeCodeConfig::default());
        assert_eq!(h.state_dirs("/home/s1/"), ["/home/s1/.claude"]);
    }
}
