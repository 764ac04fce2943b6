//! # harness-codex
//!
//! The [`Harness`] adapter for OpenAI's Codex CLI (`codex`).
//!
//! - **Provisioning**: the native (static musl) binary from the npm package
//!   `@openai/codex-linux-x64` is a [`FileSource::HostPath`] file of the
//!   bootstrap recipe, so it lands in the identity snapshot once, together
//!   with the package files it runs beside ([`PACKAGE_FILES`]: the
//!   `codex-code-mode-host` its Code Mode spawns, `rg` and the
//!   `codex-package.json` that makes Codex put `codex-path/` on its
//!   commands' `PATH`). In wrap-mode sandboxes with Codex installed, set
//!   [`CodexConfig::preinstalled`] and the recipe is empty.
//! - **Isolation**: every session runs with its own `HOME` and
//!   `CODEX_HOME=$HOME/.codex` (created before the run: Codex refuses a
//!   missing `CODEX_HOME`); rollouts live in `$CODEX_HOME/sessions/…`.
//! - **Turns**: `codex exec --json --skip-git-repo-check
//!   --dangerously-bypass-approvals-and-sandbox [-c …] [resume THREAD] --
//!   PROMPT`, parsed by [`CodexParser`].
//! - **Approvals** (opt-in, [`CodexConfig::approvals`]): `codex exec` has no
//!   approval prompt of its own — it forces the approval policy to `never`
//!   whatever `-a`/`approval_policy` say (observed with 0.171.0), so asking
//!   for one is refused ([`check_extra_args`]). Instead a `PreToolUse` hook
//!   (given with `-c hooks.PreToolUse=…`) hands each tool call Codex runs
//!   hooks for (shell commands, observed; `apply_patch` and MCP tools per
//!   Codex's documentation) to the harness through the same files as Claude
//!   Code's approval server and blocks until the harness answers (see
//!   [`approval_hook_script`]).
//!
//! See `docs/agents.md` for the flags, the approval findings and the parser
//! mapping table.

mod parser;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use harness_core::bootstrap::{BootstrapRecipe, FileSource, RecipeFile};
use harness_core::harness::{AgentCommand, Harness, OutputParser, StateMove, TurnContext};
use harness_core::relay;
use harness_core::sandbox::shell_quote;
use harness_core::{Error, Result};

pub use harness_agent_binary::{parse_version, sha256_cached, AgentBinary, HelperBinary};
pub use parser::{CodexParser, SHELL_TOOL_NAME};

/// The Codex version this adapter was verified against.
pub const VERIFIED_VERSION: &str = "0.171.0";

/// Where the binary is installed inside a sandbox by default.
pub const DEFAULT_INSTALL_PATH: &str = "/opt/harness/bin/codex";

/// The files of Codex's npm platform package (`@openai/codex-linux-x64`,
/// `vendor/x86_64-unknown-linux-musl/`) that the recipe installs beside
/// `bin/codex`, as `(path relative to the package root, mode)`. The recipe
/// puts them at the same place relative to the install root (the parent of
/// [`CodexConfig::install_path`]'s directory: `/opt/harness` by default).
///
/// - `bin/codex-code-mode-host`: the process Code Mode runs in. Codex
///   spawns it from the directory of its own executable; without it every
///   turn whose model uses Code Mode (the default model of 0.171.0 does)
///   starts with the error item "Code Mode is unavailable because failed to
///   spawn code-mode host …: host executable was not found", and the
///   model's `exec` tool fails (observed). No config turns Code Mode off
///   cleanly: `features.code_mode_host=false` gives "Code Mode is
///   unavailable because code-mode host is disabled", `features.code_mode=false`
///   changes nothing (the model's metadata asks for it).
/// - `codex-package.json`: with it beside `bin/`, Codex recognizes its
///   package layout and prepends `codex-path/` to the `PATH` of the commands
///   it runs (observed: `command -v rg` finds `/opt/harness/codex-path/rg`)
///   and uses that `rg` for its own file search.
/// - `codex-path/rg`: ripgrep.
///
/// Not installed: `codex-resources/` — `bwrap` is Codex's own Linux
/// sandbox, which turns bypass (`--dangerously-bypass-approvals-and-sandbox`:
/// the harness sandbox is the boundary), and `voice/` (50 MB of GStreamer)
/// serves the interactive app's voice conversations, which `codex exec` has
/// no way to start. Codex runs without the directory and says nothing.
pub const PACKAGE_FILES: &[(&str, u32)] = &[
    ("bin/codex-code-mode-host", 0o755),
    ("codex-path/rg", 0o755),
    ("codex-package.json", 0o644),
];

/// A file of Codex's package on the host that the recipe installs beside
/// the binary (see [`PACKAGE_FILES`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackageFile {
    /// Path relative to the package root, e.g. `bin/codex-code-mode-host`.
    pub relative: String,
    /// Where it is on the host.
    pub host_path: PathBuf,
    /// Its mode in the sandbox.
    pub mode: u32,
}

/// The [`PACKAGE_FILES`] that exist beside the `codex` binary at `codex`
/// (`<root>/bin/codex` → `<root>/bin/codex-code-mode-host`,
/// `<root>/codex-path/rg`, `<root>/codex-package.json`). A binary copied
/// out of its package has none: the recipe then installs it alone and
/// Codex reports Code Mode unavailable in every turn.
pub fn package_files_beside(codex: &Path) -> Vec<PackageFile> {
    let Some(bin_dir) = codex.parent() else {
        return Vec::new();
    };
    let root = bin_dir.parent();
    PACKAGE_FILES
        .iter()
        .filter_map(|&(relative, mode)| {
            let host_path = match relative.strip_prefix("bin/") {
                Some(name) => bin_dir.join(name),
                None => root?.join(relative),
            };
            host_path.is_file().then(|| PackageFile {
                relative: relative.to_string(),
                host_path,
                mode,
            })
        })
        .collect()
}

/// Where `relative` (a path in Codex's package) goes in the sandbox when the
/// binary is installed at `install`: `bin/…` beside it, the rest under the
/// parent of its directory.
fn install_path_of(install: &str, relative: &str) -> String {
    let bin_dir = install.rsplit_once('/').map_or("", |(dir, _)| dir);
    match relative.strip_prefix("bin/") {
        Some(name) => format!("{bin_dir}/{name}"),
        None => {
            let root = bin_dir.rsplit_once('/').map_or("", |(dir, _)| dir);
            format!("{root}/{relative}")
        }
    }
}

/// The provider name used when a base URL is configured.
pub const PROVIDER_NAME: &str = "harness";

/// How long one approval request waits by default before the hook denies
/// the call itself (24 h).
pub const DEFAULT_APPROVAL_WAIT_SECS: u64 = 24 * 60 * 60;

/// What Codex's hook timeout adds to [`CodexApprovals::wait_secs`]. A hook
/// that Codex times out lets the call RUN (observed: a 3 s timeout on a
/// hook sleeping 10 s, the command ran), so the hook must always answer
/// first: it denies at `wait_secs`, Codex would only kill it this much later.
pub const APPROVAL_HOOK_MARGIN_SECS: u64 = 120;

/// The longest wait [`CodexApprovals::wait_secs`] is taken to mean (one
/// year; a hook timeout of a year was observed to be accepted, and a value
/// past TOML's integer range would fail Codex's config).
pub const MAX_APPROVAL_WAIT_SECS: u64 = 365 * 24 * 60 * 60;

/// Per-tool-call permission requests for Codex, answered by the harness's
/// client like Claude Code's (`tool-approval-request` part, the turn waits
/// in `awaiting_tool_approval`).
///
/// `codex exec` cannot prompt: it runs with the approval policy forced to
/// `never` (`-a on-request`, `-c approval_policy="on-request"` or
/// `"on-failure"` are all overridden to `never`; `"untrusted"` is refused
/// as "no longer supported"), and its only other route,
/// `--approve-for-me`, sends approvals to a model reviewer. What exec mode
/// does run is hooks, so with this set each turn gets a `PreToolUse` hook
/// ([`approval_hook_script`]) that appends the call to
/// `<spool>/relay/requests.jsonl`, waits for
/// `<spool>/relay/answers/<id>.json` and then lets the call run (exit
/// 0) or blocks it with the client's reason (exit 2), which the model sees
/// as the call's output ("Command blocked by PreToolUse hook: <reason>.
/// Command: …").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CodexApprovals {
    /// How long one request waits for an answer before the hook denies the
    /// call itself ("no answer within … s"); at most
    /// [`MAX_APPROVAL_WAIT_SECS`].
    pub wait_secs: u64,
}

impl Default for CodexApprovals {
    fn default() -> Self {
        Self {
            wait_secs: DEFAULT_APPROVAL_WAIT_SECS,
        }
    }
}

/// How to provision and run Codex.
#[derive(Debug, Clone)]
pub struct CodexConfig {
    /// The native binary on the host (ignored when `preinstalled` is set).
    pub binary: Option<AgentBinary>,
    /// The package files installed beside the binary (ignored when
    /// `preinstalled` is set). [`CodexConfig::with_binary`] fills it with
    /// [`package_files_beside`] the binary; their digests are read (cached
    /// as `<file>.sha256`, like the binary's) when the recipe is built.
    pub package_files: Vec<PackageFile>,
    /// Path of an already-installed `codex` inside the sandbox (wrap-mode):
    /// the recipe is then empty and the command runs this path.
    pub preinstalled: Option<String>,
    /// Where the recipe installs the binary inside the sandbox. Codex
    /// recognizes its package (and puts `codex-path/` on `PATH`) only when
    /// this is `<root>/bin/codex`; the Code Mode host works from any
    /// directory (it sits beside the binary).
    pub install_path: String,
    /// An OpenAI-compatible Responses endpoint (`http://host:port/v1`). When
    /// unset, `OPENAI_BASE_URL` from the turn's environment is used; when
    /// neither is set Codex uses its built-in OpenAI provider.
    pub base_url: Option<String>,
    /// Extra arguments placed after the fixed `exec` options. Arguments
    /// that ask Codex itself for approvals (`-a`, `--ask-for-approval`,
    /// `--approve-for-me`, `-c approval_policy=…`) are refused with
    /// `Unsupported` (see [`check_extra_args`]); use `approvals`.
    pub extra_args: Vec<String>,
    /// How approvals work when a turn asks for them (its session's
    /// `approvals`; off by default: the harness sandbox is the boundary
    /// and Codex runs with approvals and its own sandbox bypassed). `None`
    /// uses [`CodexApprovals::default`]. See [`CodexApprovals`].
    pub approvals: Option<CodexApprovals>,
    /// The host-tool bridge (`harness-relay-mcp`), installed by the recipe
    /// when set. A turn whose session's tool host offers tools
    /// (`TurnContext::relay_dir`) gets it as MCP server `host`
    /// (`-c mcp_servers.host=…`; tools `mcp__host__<name>`); such a turn
    /// without it fails with a clear error.
    pub relay_bridge: Option<HelperBinary>,
}

impl Default for CodexConfig {
    fn default() -> Self {
        Self {
            binary: None,
            package_files: Vec::new(),
            preinstalled: None,
            install_path: DEFAULT_INSTALL_PATH.to_string(),
            base_url: None,
            extra_args: Vec::new(),
            approvals: None,
            relay_bridge: None,
        }
    }
}

impl CodexConfig {
    /// Install `binary` at the default path, with the files of its npm
    /// package that Codex runs beside ([`package_files_beside`] it).
    pub fn with_binary(binary: AgentBinary) -> Self {
        Self {
            package_files: package_files_beside(&binary.host_path),
            binary: Some(binary),
            ..Self::default()
        }
    }

    /// Use a `codex` already installed at `path` inside the sandbox.
    pub fn preinstalled(path: impl Into<String>) -> Self {
        Self {
            preinstalled: Some(path.into()),
            ..Self::default()
        }
    }

    /// The binary named by `HARNESS_CODEX_BIN`, else the one `cargo xtask
    /// agents` installs under `$HARNESS_CACHE/agents`.
    pub fn from_env() -> Result<Self> {
        Ok(Self::with_binary(AgentBinary::load(locate_host_binary()?)?))
    }
}

/// Where the native `codex` is on this host: `$HARNESS_CODEX_BIN`, else
/// `$HARNESS_CACHE/agents/codex-<VERIFIED_VERSION>/node_modules/@openai/codex-linux-x64/vendor/x86_64-unknown-linux-musl/bin/codex`.
pub fn locate_host_binary() -> Result<std::path::PathBuf> {
    harness_agent_binary::locate(
        "HARNESS_CODEX_BIN",
        &format!("codex-{VERIFIED_VERSION}/node_modules/@openai/codex-linux-x64/vendor/x86_64-unknown-linux-musl/bin/codex"),
        "codex",
    )
}

/// Refuse extra arguments that ask Codex itself for approvals: `codex exec`
/// forces its approval policy to `never` (observed with 0.171.0: the
/// model's permissions text says "Approval policy is currently never" and an
/// escalation request fails with "approval policy is Never; reject
/// command"), `-a`/`--ask-for-approval` are not `exec` options at all,
/// `approval_policy="untrusted"` fails the run, and `--approve-for-me`
/// hands the decision to a model reviewer and conflicts with
/// `--dangerously-bypass-approvals-and-sandbox`. None of these reach the
/// harness's client; [`CodexConfig::approvals`] does.
pub fn check_extra_args(args: &[String]) -> Result<()> {
    let mut prev: Option<&str> = None;
    for arg in args {
        let a = arg.as_str();
        let asks = matches!(a, "-a" | "--ask-for-approval" | "--approve-for-me")
            || a.starts_with("--ask-for-approval=")
            || (a.starts_with("-a") && a.len() > 2 && !a.starts_with("--"))
            || (matches!(prev, Some("-c" | "--config"))
                && a.trim_start().starts_with("approval_policy"))
            || a.starts_with("--config=approval_policy")
            || (a.starts_with("-capproval_policy"));
        if asks {
            return Err(Error::unsupported(format!(
                "Codex approvals cannot be configured with {a:?}: `codex exec` forces its \
                 approval policy to `never` and has no prompt the harness could answer; \
                 set CodexConfig::approvals to route every tool call to the harness's \
                 client through a PreToolUse hook (see docs/agents.md, \"Codex approvals\")"
            )));
        }
        prev = Some(a);
    }
    Ok(())
}

/// The shell script of the approval `PreToolUse` hook (Codex runs a hook's
/// `command` with a shell, `$SHELL -c` — `/bin/bash -c` observed; the
/// script is POSIX sh and needs only `date`, `tr`, `sed`, `mkdir`, `sleep`).
///
/// Codex writes the call to the hook's stdin as one JSON object, e.g.
/// `{"session_id":…,"turn_id":…,"transcript_path":…,"cwd":…,
/// "hook_event_name":"PreToolUse","model":…,"permission_mode":"bypassPermissions",
/// "tool_name":"Bash","tool_input":{"command":"echo hi > x"},"tool_use_id":"call_1"}`
/// (observed). The script
///
/// 1. appends that object to `<relay_dir>/requests.jsonl` as one line,
///    with `"kind":"approval","approvalId":"codex-<pid>-<time>"` first,
///    `tool_input` renamed `input`, `tool_name`/`tool_use_id` renamed
///    `toolName`/`toolUseId` and `Bash` named [`SHELL_TOOL_NAME`] — a
///    `harness_relay::files::RelayRequest::Approval`, the line the slice
///    runner reads (Codex's other fields ride along, ignored). Appends are
///    serialized with a `mkdir` lock (Codex runs hooks of parallel calls
///    concurrently);
/// 2. polls `<relay_dir>/answers/<approvalId>.json` once a second for
///    `{"approved":true,…}` or `{"approved":false,"reason":…}` (the slice
///    runner's format);
/// 3. exits 0 (the call runs) or prints the reason (`\"` and `\\` decoded,
///    other JSON escapes kept; "The user denied this tool call." when there
///    is none) to stderr and exits 2 (the call is blocked and the model gets
///    "Command blocked by PreToolUse hook: <reason>. Command: <command>").
///
/// Codex lets the call run when a hook exits 1, prints output it cannot
/// parse, exits 2 with an empty stderr, or times out (all observed), so
/// every failure path of the script is an explicit exit 2 with a message,
/// and the script gives up (deny) after `wait_secs`, before Codex's
/// timeout (`wait_secs` + [`APPROVAL_HOOK_MARGIN_SECS`]).
pub fn approval_hook_script(relay_dir: &str, wait_secs: u64) -> String {
    APPROVAL_HOOK_TEMPLATE
        .replace("@DIR@", &shell_quote(relay_dir))
        .replace("@WAIT@", &wait_secs.to_string())
        .replace("@SHELL_TOOL@", SHELL_TOOL_NAME)
}

/// See [`approval_hook_script`].
const APPROVAL_HOOK_TEMPLATE: &str = r#"# harness: ask the harness's client before this tool call runs
d=@DIR@
deny() { printf '%s\n' "$1" >&2; exit 2; }
end=$(( $(date +%s) + @WAIT@ ))
in=$(tr -d '\n\r') || deny 'harness approval: could not read the tool call'
case "$in" in '{"'*'}') ;; *) deny 'harness approval: unexpected hook input' ;; esac
id="codex-$$-$(date +%s)"
line=$(printf '%s' "$in" | sed -e 's/^{/{"kind":"approval","approvalId":"'"$id"'",/' -e 's/"tool_input":/"input":/' -e 's/"tool_name":"Bash"/"tool_name":"@SHELL_TOOL@"/' -e 's/"tool_name":/"toolName":/' -e 's/"tool_use_id":/"toolUseId":/')
case "$line" in '{"kind":"approval","approvalId":"'"$id"'","'*'}') ;; *) deny 'harness approval: could not build the request' ;; esac
mkdir -p "$d/answers" || deny 'harness approval: cannot create the relay directory'
until mkdir "$d/requests.lock" 2>/dev/null; do
  [ "$(date +%s)" -lt "$end" ] || deny 'harness approval: the request could not be recorded in time'
  sleep 1
done
printf '%s\n' "$line" >> "$d/requests.jsonl"; ok=$?
rmdir "$d/requests.lock"
[ "$ok" -eq 0 ] || deny 'harness approval: cannot record the request'
f="$d/answers/$id.json"
while :; do
  if [ -f "$f" ]; then
    a=$(tr -d '\n\r' < "$f")
    case "$a" in
      '{"approved":true,'*'}') exit 0 ;;
      '{"approved":false,'*'}') break ;;
    esac
  fi
  [ "$(date +%s)" -lt "$end" ] || deny 'harness approval: no answer within @WAIT@ s, so the call was denied'
  sleep 1
done
r=$(printf '%s' "$a" | sed -n -e 's/^{"approved":false,"reason":"\(.*\)"}$/\1/p' | sed -e 's/\\"/"/g' -e 's/\\\\/\\/g')
case "$r" in *[![:space:]]*) ;; *) r='The user denied this tool call.' ;; esac
deny "$r"
"#;

/// The `-c` override that installs the approval hook for every tool.
fn approval_hook_override(relay_dir: &str, approvals: &CodexApprovals) -> String {
    let wait = approvals.wait_secs.min(MAX_APPROVAL_WAIT_SECS);
    format!(
        "hooks.PreToolUse=[{{matcher=\"\",hooks=[{{type=\"command\",command={},timeout={}}}]}}]",
        toml_string(&approval_hook_script(relay_dir, wait)),
        wait + APPROVAL_HOOK_MARGIN_SECS
    )
}

/// A TOML basic string (for `-c key=value` overrides).
fn toml_string(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                out.push_str(&format!("\\u{:04X}", c as u32))
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// The Codex adapter.
#[derive(Debug, Clone)]
pub struct CodexHarness {
    config: CodexConfig,
}

impl CodexHarness {
    /// An adapter with `config`.
    pub fn new(config: CodexConfig) -> Self {
        Self { config }
    }

    /// The configuration.
    pub fn config(&self) -> &CodexConfig {
        &self.config
    }

    /// The `codex` path the turn command runs inside the sandbox.
    pub fn program(&self) -> &str {
        self.config
            .preinstalled
            .as_deref()
            .unwrap_or(&self.config.install_path)
    }
}

impl Harness for CodexHarness {
    fn name(&self) -> &'static str {
        "codex"
    }

    fn bootstrap_recipe(&self) -> Result<BootstrapRecipe> {
        if self.config.preinstalled.is_some() {
            return Ok(BootstrapRecipe::default());
        }
        let binary = self.config.binary.as_ref().ok_or_else(|| {
            Error::invalid(
                "CodexConfig has neither `binary` nor `preinstalled`: \
                 set HARNESS_CODEX_BIN or use CodexConfig::preinstalled",
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
        for file in &self.config.package_files {
            files.push(RecipeFile {
                path: install_path_of(install, &file.relative),
                mode: file.mode,
                source: FileSource::HostPath {
                    path: file.host_path.display().to_string(),
                    sha256: sha256_cached(&file.host_path).map_err(|e| {
                        Error::new(
                            e.kind(),
                            format!(
                                "Codex package file {}: {}",
                                file.host_path.display(),
                                e.message()
                            ),
                        )
                    })?,
                },
            });
        }
        let helpers: Vec<(&str, &HelperBinary)> = self
            .config
            .relay_bridge
            .iter()
            .map(|bridge| (relay::files::BRIDGE_PATH, bridge))
            .collect();
        let (helper_files, links) = harness_agent_binary::helper_files(&helpers);
        files.extend(helper_files);
        Ok(BootstrapRecipe {
            files,
            // Backends create parent directories and set the mode when they
            // write recipe files, so no mkdir/chmod is needed here.
            bootstrap_pre_commands: Vec::new(),
            // Smoke test: the binary runs in this image.
            commands: links
                .into_iter()
                .chain([format!(
                    "\"${{HARNESS_SANDBOX_ROOT:-}}\"{} --version >/dev/null",
                    shell_quote(install)
                )])
                .collect(),
        })
    }

    fn turn_command(&self, turn: &TurnContext<'_>) -> Result<AgentCommand> {
        if turn.home.is_empty() || !turn.home.starts_with('/') {
            return Err(Error::invalid(format!(
                "session home must be an absolute path, got {:?}",
                turn.home
            )));
        }
        check_extra_args(&self.config.extra_args)?;
        let mut args: Vec<String> = vec![
            "exec".into(),
            // One JSON event per line on stdout.
            "--json".into(),
            // Session workdirs are not git repositories.
            "--skip-git-repo-check".into(),
            // The harness sandbox is the boundary; Codex's own sandbox
            // (landlock/seccomp) is not available in every backend, and
            // exec mode never prompts anyway (its policy is forced to
            // `never`): approvals, when on, come from the hook below.
            "--dangerously-bypass-approvals-and-sandbox".into(),
        ];
        // A turn asks when its session asked for approvals; the config only
        // tunes how (how long the hook waits).
        let approvals = turn
            .state
            .approvals
            .then(|| self.config.approvals.clone().unwrap_or_default());
        if let Some(approvals) = &approvals {
            let dir = format!(
                "{}/{}",
                harness_core::slice::spool_dir(turn.home, &turn.state.turn_id),
                relay::files::DIR
            );
            // A hook given only with -c is "untrusted" and silently skipped
            // without this (observed); project-local hooks stay off (an
            // untrusted project's .codex/ is not loaded, observed).
            args.push("--dangerously-bypass-hook-trust".into());
            args.push("-c".into());
            args.push(approval_hook_override(&dir, approvals));
        }
        if let Some(dir) = turn.relay_dir {
            if self.config.relay_bridge.is_none() {
                return Err(Error::invalid(
                    "this session's tool host offers tools, but the runner has no host-tool bridge \
                     (harness-relay-mcp): the `harness` binary is one (it runs as it under that \
                     name), or build it (`cargo build -p harness-relay-mcp`) and give its path in \
                     CodexConfig::relay_bridge (HARNESS_RELAY_MCP_BIN for the CLI)",
                ));
            }
            args.push("-c".into());
            args.push(relay_mcp_override(dir));
        }
        let base_url = self
            .config
            .base_url
            .clone()
            .or_else(|| turn.env.get("OPENAI_BASE_URL").cloned());
        if let Some(url) = base_url {
            args.push("-c".into());
            args.push(format!("model_provider={PROVIDER_NAME}"));
            args.push("-c".into());
            args.push(format!(
                "model_providers.{PROVIDER_NAME}={{name={},base_url={},env_key=\"OPENAI_API_KEY\",wire_api=\"responses\"}}",
                toml_string(PROVIDER_NAME),
                toml_string(&url)
            ));
        }
        if let Some(model) = turn.model {
            args.push("-c".into());
            args.push(format!("model={}", toml_string(model)));
        }
        if let Some(system) = turn.system_prompt {
            args.push("-c".into());
            args.push(format!("developer_instructions={}", toml_string(system)));
        }
        args.extend(self.config.extra_args.iter().cloned());
        if let Some(thread) = &turn.state.agent_session_id {
            // Options stay before `resume` (verified with 0.171.0).
            args.push("resume".into());
            args.push(thread.clone());
        }
        // `--` so a prompt starting with `-` is never taken for an option.
        args.push("--".into());
        args.push(turn.state.prompt.clone());

        let home = turn.home.trim_end_matches('/');
        let mut env: BTreeMap<String, String> = turn.env.clone();
        env.insert("HOME".into(), home.to_string());
        env.insert("CODEX_HOME".into(), format!("{home}/.codex"));
        Ok(AgentCommand {
            argv: with_home_created(self.program(), args),
            env,
            cwd: turn.workdir.to_string(),
        })
    }

    fn parser(&self) -> Box<dyn OutputParser> {
        Box::new(CodexParser::new())
    }

    /// `<home>/.codex` (`CODEX_HOME`): rollouts under
    /// `sessions/YYYY/MM/DD/rollout-…-<thread>.jsonl` and Codex's SQLite files.
    fn state_dirs(&self, home: &str) -> Vec<String> {
        vec![format!("{}/.codex", home.trim_end_matches('/'))]
    }

    /// `.codex/tmp`: Codex's per-run scratch (`arg0-linux/…/applypatch`, a
    /// symlink to the codex binary's absolute path), made again each run.
    fn state_excludes(&self) -> Vec<String> {
        vec![".codex/tmp".into()]
    }

    /// Codex's thread index (`state_*.sqlite`) records each rollout's
    /// absolute path under the old `CODEX_HOME`; after a move to another
    /// home `exec resume` finds the thread there, misses the file and fails
    /// ("no rollout found for thread id"). Dropping the index makes Codex
    /// rebuild it from the rollout files (which are keyed by date and
    /// thread, not by path). Rewriting the paths would need `sqlite3` in
    /// the sandbox, which images do not have.
    fn relocate_state_script(&self, moved: &StateMove<'_>) -> Option<String> {
        if moved.old_home.trim_end_matches('/') == moved.home.trim_end_matches('/') {
            return None;
        }
        Some(format!(
            "rm -f -- {dir}/state_*.sqlite {dir}/state_*.sqlite-wal {dir}/state_*.sqlite-shm\n",
            dir = shell_quote(&format!("{}/.codex", moved.home.trim_end_matches('/')))
        ))
    }
}

/// `sh -c LAUNCHER PROGRAM ARGS…`: creates `$CODEX_HOME` (Codex needs it
/// to exist) and finds the binary under `$HARNESS_SANDBOX_ROOT` first (see
/// [`launcher_script`]).
fn with_home_created(program: &str, args: Vec<String>) -> Vec<String> {
    let mut argv = vec![
        "sh".to_string(),
        "-c".to_string(),
        launcher_script("CODEX_HOME"),
        program.to_string(),
    ];
    argv.extend(args);
    argv
}

/// The launcher script run as `sh -c SCRIPT PROGRAM ARGS…`: creates the
/// state directory named by `state_var`, then runs the program, looked up
/// under `$HARNESS_SANDBOX_ROOT` first (backends whose sandbox filesystem is
/// not rooted at `/`, like sandbox-local, export it) and at its plain path
/// otherwise.
pub fn launcher_script(state_var: &str) -> String {
    format!(
        "mkdir -p \"${state_var}\" && p=\"${{HARNESS_SANDBOX_ROOT:-}}$0\" && {{ [ -x \"$p\" ] || p=\"$0\"; }} && exec \"$p\" \"$@\""
    )
}

/// The `-c` override that gives Codex the host-tool bridge as MCP server
/// `host`. Like the agent, the bridge is found under
/// `$HARNESS_SANDBOX_ROOT` (sandbox-local) first, then at its plain path;
/// Codex starts MCP servers with a cleared environment, so that variable
/// is passed on by name (`env_vars`).
pub fn relay_mcp_override(relay_dir: &str) -> String {
    format!(
        "mcp_servers.{name}={{command=\"sh\",args=[\"-c\",{script},{path}],env={{HARNESS_RELAY_DIR={dir}}},env_vars=[\"HARNESS_SANDBOX_ROOT\"]}}",
        name = relay::files::MCP_SERVER_NAME,
        script = toml_string(
            "p=\"${HARNESS_SANDBOX_ROOT:-}$0\" && { [ -x \"$p\" ] || p=\"$0\"; } && exec \"$p\""
        ),
        path = toml_string(relay::files::BRIDGE_PATH),
        dir = toml_string(relay_dir),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use harness_core::turn::TurnState;

    fn binary() -> AgentBinary {
        AgentBinary {
            host_path: "/cache/codex".into(),
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
    fn recipe_installs_the_host_binary_once() {
        let h = CodexHarness::new(CodexConfig::with_binary(binary()));
        let r = h.bootstrap_recipe().unwrap();
        assert_eq!(r.files.len(), 1);
        assert_eq!(r.files[0].path, DEFAULT_INSTALL_PATH);
        assert_eq!(r.files[0].mode, 0o755);
        assert!(
            matches!(&r.files[0].source, FileSource::HostPath { path, sha256 } if path == "/cache/codex" && *sha256 == "ab".repeat(32))
        );
        assert_eq!(
            r.commands,
            ["\"${HARNESS_SANDBOX_ROOT:-}\"/opt/harness/bin/codex --version >/dev/null"]
        );
        assert!(
            CodexHarness::new(CodexConfig::preinstalled("/usr/bin/codex"))
                .bootstrap_recipe()
                .unwrap()
                .is_empty()
        );
        assert!(CodexHarness::new(CodexConfig::default())
            .bootstrap_recipe()
            .unwrap_err()
            .message()
            .contains("HARNESS_CODEX_BIN"));
    }

    #[test]
    fn recipe_installs_the_package_files_beside_the_binary() {
        // A package laid out like `@openai/codex-linux-x64`'s vendor dir.
        let root = std::env::temp_dir().join(format!("codex-package-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        for (rel, body) in [
            ("bin/codex", "codex"),
            ("bin/codex-code-mode-host", "host"),
            ("codex-path/rg", "rg"),
            ("codex-package.json", "{}"),
            ("codex-resources/bwrap", "bwrap"),
            ("codex-resources/voice/bin/codex-voice-host", "voice"),
        ] {
            let path = root.join(rel);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, body).unwrap();
        }
        let mut bin = binary();
        bin.host_path = root.join("bin/codex");
        let config = CodexConfig::with_binary(bin);
        assert_eq!(
            config
                .package_files
                .iter()
                .map(|f| (f.relative.as_str(), f.mode))
                .collect::<Vec<_>>(),
            PACKAGE_FILES,
            "every package file found, nothing from codex-resources"
        );
        let recipe = CodexHarness::new(config.clone())
            .bootstrap_recipe()
            .unwrap();
        let placed: Vec<(&str, u32, String, String)> = recipe
            .files
            .iter()
            .map(|f| match &f.source {
                FileSource::HostPath { path, sha256 } => {
                    (f.path.as_str(), f.mode, path.clone(), sha256.clone())
                }
                other => panic!("{other:?}"),
            })
            .collect();
        let digest = |rel: &str| sha256_cached(&root.join(rel)).unwrap();
        let host = |rel: &str| root.join(rel).display().to_string();
        assert_eq!(
            placed,
            [
                (
                    DEFAULT_INSTALL_PATH,
                    0o755,
                    host("bin/codex"),
                    "ab".repeat(32)
                ),
                (
                    "/opt/harness/bin/codex-code-mode-host",
                    0o755,
                    host("bin/codex-code-mode-host"),
                    digest("bin/codex-code-mode-host")
                ),
                (
                    "/opt/harness/codex-path/rg",
                    0o755,
                    host("codex-path/rg"),
                    digest("codex-path/rg")
                ),
                (
                    "/opt/harness/codex-package.json",
                    0o644,
                    host("codex-package.json"),
                    digest("codex-package.json")
                ),
            ]
        );
        // The helpers are part of the identity: a new host is a new snapshot.
        let alone = CodexHarness::new(CodexConfig {
            package_files: Vec::new(),
            ..config.clone()
        })
        .bootstrap_recipe()
        .unwrap();
        assert_eq!(alone.files.len(), 1);
        assert_ne!(alone.identity("base"), recipe.identity("base"));
        // Another install path keeps the package's shape around it.
        let mut moved = config;
        moved.install_path = "/usr/local/lib/codex/bin/codex".into();
        let paths: Vec<String> = CodexHarness::new(moved)
            .bootstrap_recipe()
            .unwrap()
            .files
            .into_iter()
            .map(|f| f.path)
            .collect();
        assert_eq!(
            paths,
            [
                "/usr/local/lib/codex/bin/codex",
                "/usr/local/lib/codex/bin/codex-code-mode-host",
                "/usr/local/lib/codex/codex-path/rg",
                "/usr/local/lib/codex/codex-package.json"
            ]
        );
        // A binary copied out of its package is installed alone.
        std::fs::copy(root.join("bin/codex"), root.join("loose-codex")).unwrap();
        assert!(package_files_beside(&root.join("loose-codex")).is_empty());
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn first_turn_with_provider_model_and_instructions() {
        let h = CodexHarness::new(CodexConfig::with_binary(binary()));
        let mut env = BTreeMap::new();
        env.insert("OPENAI_API_KEY".to_string(), "k".to_string());
        env.insert(
            "OPENAI_BASE_URL".to_string(),
            "http://127.0.0.1:9/v1".to_string(),
        );
        let state = TurnState::new("s", "t1", "codex", "-starts with a dash");
        let mut c = ctx(&state, &env);
        c.model = Some("gpt-test");
        c.system_prompt = Some("say \"hi\"");
        let cmd = h.turn_command(&c).unwrap();
        assert_eq!(cmd.argv[..2], ["sh", "-c"]);
        assert_eq!(cmd.argv[2], launcher_script("CODEX_HOME"));
        assert_eq!(cmd.argv[3], DEFAULT_INSTALL_PATH);
        assert_eq!(
            cmd.argv[4..],
            [
                "exec",
                "--json",
                "--skip-git-repo-check",
                "--dangerously-bypass-approvals-and-sandbox",
                "-c",
                "model_provider=harness",
                "-c",
                "model_providers.harness={name=\"harness\",base_url=\"http://127.0.0.1:9/v1\",env_key=\"OPENAI_API_KEY\",wire_api=\"responses\"}",
                "-c",
                "model=\"gpt-test\"",
                "-c",
                "developer_instructions=\"say \\\"hi\\\"\"",
                "--",
                "-starts with a dash"
            ]
        );
        assert_eq!(cmd.env["HOME"], "/home/s1");
        assert_eq!(cmd.env["CODEX_HOME"], "/home/s1/.codex");
        assert_eq!(cmd.env["OPENAI_API_KEY"], "k");
        assert_eq!(cmd.cwd, "/workspace");
    }

    #[test]
    fn later_turns_resume_the_thread() {
        let h = CodexHarness::new(CodexConfig::preinstalled("/usr/bin/codex"));
        let env = BTreeMap::new();
        let mut state = TurnState::new("s", "t2", "codex", "again");
        state.agent_session_id = Some("th-1".into());
        let cmd = h.turn_command(&ctx(&state, &env)).unwrap();
        assert_eq!(cmd.argv[3], "/usr/bin/codex");
        assert_eq!(
            cmd.argv[4..],
            [
                "exec",
                "--json",
                "--skip-git-repo-check",
                "--dangerously-bypass-approvals-and-sandbox",
                "resume",
                "th-1",
                "--",
                "again"
            ]
        );
        // No base URL anywhere: no provider override.
        assert!(!cmd.argv.iter().any(|a| a.starts_with("model_provider")));
    }

    #[test]
    fn approvals_add_the_hook_and_keep_codex_bypassed() {
        let mut config = CodexConfig::with_binary(binary());
        config.approvals = Some(CodexApprovals { wait_secs: 300 });
        let h = CodexHarness::new(config);
        let env = BTreeMap::new();
        let mut state = TurnState::new("s", "t9", "codex", "go");
        // Without the session asking, the hook stays off.
        let plain = h.turn_command(&ctx(&state, &env)).unwrap();
        assert!(!plain
            .argv
            .iter()
            .any(|a| a == "--dangerously-bypass-hook-trust"));
        state.approvals = true;
        state.agent_session_id = Some("th-1".into());
        let cmd = h.turn_command(&ctx(&state, &env)).unwrap();
        let args = &cmd.argv[4..];
        assert_eq!(
            args[..6],
            [
                "exec",
                "--json",
                "--skip-git-repo-check",
                "--dangerously-bypass-approvals-and-sandbox",
                "--dangerously-bypass-hook-trust",
                "-c"
            ]
        );
        let hook = &args[6];
        let script = approval_hook_script("/home/s1/.harness/turns/t9/relay", 300);
        assert_eq!(
            *hook,
            format!(
                "hooks.PreToolUse=[{{matcher=\"\",hooks=[{{type=\"command\",command={},timeout=420}}]}}]",
                toml_string(&script)
            )
        );
        assert!(
            script.contains("d=/home/s1/.harness/turns/t9/relay\n"),
            "{script}"
        );
        assert!(script.contains("no answer within 300 s"));
        assert_eq!(args[7..], ["resume", "th-1", "--", "go"]);
        // An endless wait is capped (Codex reads the timeout as a TOML integer).
        let capped = approval_hook_override(
            "/a",
            &CodexApprovals {
                wait_secs: u64::MAX,
            },
        );
        assert!(
            capped.ends_with(&format!(
                ",timeout={}}}]}}]",
                MAX_APPROVAL_WAIT_SECS + APPROVAL_HOOK_MARGIN_SECS
            )),
            "{capped}"
        );
        // A turn that does not ask gets none of this, whatever the config.
        state.approvals = false;
        let plain = CodexHarness::new(CodexConfig::with_binary(binary()))
            .turn_command(&ctx(&state, &env))
            .unwrap();
        assert!(!plain.argv.iter().any(|a| a.contains("hook")));
        // A turn that asks gets the hook with the default wait even when
        // the config names none.
        state.approvals = true;
        let default = CodexHarness::new(CodexConfig::with_binary(binary()))
            .turn_command(&ctx(&state, &env))
            .unwrap();
        assert!(default
            .argv
            .iter()
            .any(|a| a == "--dangerously-bypass-hook-trust"));
    }

    #[test]
    fn asking_codex_itself_for_approvals_is_unsupported() {
        let state = TurnState::new("s", "t", "codex", "x");
        let env = BTreeMap::new();
        for extra in [
            &["-a", "on-request"][..],
            &["--ask-for-approval", "untrusted"],
            &["--ask-for-approval=on-failure"],
            &["-aon-request"],
            &["--approve-for-me"],
            &["-c", "approval_policy=\"on-request\""],
            &["--config", "approval_policy=\"on-failure\""],
            &["--config=approval_policy=\"never\""],
            &["-capproval_policy=\"on-request\""],
        ] {
            let mut config = CodexConfig::preinstalled("/usr/bin/codex");
            config.extra_args = extra.iter().map(|s| s.to_string()).collect();
            let err = CodexHarness::new(config)
                .turn_command(&ctx(&state, &env))
                .unwrap_err();
            assert_eq!(
                err.kind(),
                harness_core::ErrorKind::Unsupported,
                "{extra:?}"
            );
            assert!(err.message().contains("CodexConfig::approvals"), "{err}");
            assert!(err.message().contains("`never`"), "{err}");
        }
        // Other overrides pass.
        let mut config = CodexConfig::preinstalled("/usr/bin/codex");
        config.extra_args = vec!["-c".into(), "model_reasoning_effort=\"low\"".into()];
        assert!(CodexHarness::new(config)
            .turn_command(&ctx(&state, &env))
            .is_ok());
    }

    #[test]
    fn toml_strings_escape() {
        assert_eq!(toml_string("a\"b\\c\nd\u{1}"), "\"a\\\"b\\\\c\\nd\\u0001\"");
    }

    #[test]
    fn relocation_drops_the_thread_index_only_when_the_home_changes() {
        let h = CodexHarness::new(CodexConfig::default());
        let moved = |old_home, home| StateMove {
            old_home,
            home,
            old_workdir: "/a/work",
            workdir: "/workspace",
        };
        assert_eq!(
            h.relocate_state_script(&moved("/root", "/root/")),
            None,
            "rollouts are not keyed by cwd"
        );
        let script = h.relocate_state_script(&moved("/x/home", "/root")).unwrap();
        assert!(
            script.starts_with("rm -f -- /root/.codex/state_*.sqlite "),
            "{script}"
        );
        assert!(
            script.contains("/root/.codex/state_*.sqlite-wal"),
            "{script}"
        );
    }

    #[test]
    fn state_dirs_and_bad_home() {
        let h = CodexHarness::new(CodexConfig::default());
        assert_eq!(h.state_dirs("/home/x"), ["/home/x/.codex"]);
        let state = TurnState::new("s", "t", "codex", "x");
        let env = BTreeMap::new();
        let mut c = ctx(&state, &env);
        c.home = "";
        assert!(h.turn_command(&c).is_err());
    }
}
