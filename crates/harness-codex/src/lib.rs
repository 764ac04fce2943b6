//! # harness-codex
//!
//! The [`Harness`] adapter for OpenAI's Codex CLI (`codex`).
//!
//! - **Provisioning**: the native (static musl) binary from the npm package
//!   `@openai/codex-linux-x64` is a [`FileSource::HostPath`] file of the
//!   bootstrap recipe, so it lands in the identity snapshot once. In
//!   wrap-mode sandboxes with Codex installed, set
//!   [`CodexConfig::preinstalled`] and the recipe is empty.
//! - **Isolation**: every session runs with its own `HOME` and
//!   `CODEX_HOME=$HOME/.codex` (created before the run: Codex refuses a
//!   missing `CODEX_HOME`); rollouts live in `$CODEX_HOME/sessions/…`.
//! - **Turns**: `codex exec --json --skip-git-repo-check
//!   --dangerously-bypass-approvals-and-sandbox [-c …] [resume THREAD] --
//!   PROMPT`, parsed by [`CodexParser`].
//!
//! See `docs/agents.md` for the flags and the parser mapping table.

mod parser;

use std::collections::BTreeMap;

use harness_core::bootstrap::{BootstrapRecipe, FileSource, RecipeFile};
use harness_core::harness::{AgentCommand, Harness, OutputParser, StateMove, TurnContext};
use harness_core::sandbox::shell_quote;
use harness_core::{Error, Result};

pub use harness_agent_binary::{parse_version, sha256_cached, AgentBinary};
pub use parser::{CodexParser, SHELL_TOOL_NAME};

/// The Codex version this adapter was verified against.
pub const VERIFIED_VERSION: &str = "0.171.0";

/// Where the binary is installed inside a sandbox by default.
pub const DEFAULT_INSTALL_PATH: &str = "/opt/harness/bin/codex";

/// The provider name used when a base URL is configured.
pub const PROVIDER_NAME: &str = "harness";

/// How to provision and run Codex.
#[derive(Debug, Clone)]
pub struct CodexConfig {
    /// The native binary on the host (ignored when `preinstalled` is set).
    pub binary: Option<AgentBinary>,
    /// Path of an already-installed `codex` inside the sandbox (wrap-mode):
    /// the recipe is then empty and the command runs this path.
    pub preinstalled: Option<String>,
    /// Where the recipe installs the binary inside the sandbox.
    pub install_path: String,
    /// An OpenAI-compatible Responses endpoint (`http://host:port/v1`). When
    /// unset, `OPENAI_BASE_URL` from the turn's environment is used; when
    /// neither is set Codex uses its built-in OpenAI provider.
    pub base_url: Option<String>,
    /// Extra arguments placed after the fixed `exec` options.
    pub extra_args: Vec<String>,
}

impl Default for CodexConfig {
    fn default() -> Self {
        Self {
            binary: None,
            preinstalled: None,
            install_path: DEFAULT_INSTALL_PATH.to_string(),
            base_url: None,
            extra_args: Vec::new(),
        }
    }
}

impl CodexConfig {
    /// Install `binary` at the default path.
    pub fn with_binary(binary: AgentBinary) -> Self {
        Self {
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
        Ok(BootstrapRecipe {
            files: vec![RecipeFile {
                path: install.clone(),
                mode: 0o755,
                source: FileSource::HostPath {
                    path: binary.host_path.display().to_string(),
                    sha256: binary.sha256.clone(),
                },
            }],
            // Backends create parent directories and set the mode when they
            // write recipe files, so no mkdir/chmod is needed here.
            bootstrap_pre_commands: Vec::new(),
            // Smoke test: the binary runs in this image.
            commands: vec![format!(
                "\"${{HARNESS_SANDBOX_ROOT:-}}\"{} --version >/dev/null",
                shell_quote(install)
            )],
        })
    }

    fn turn_command(&self, turn: &TurnContext<'_>) -> Result<AgentCommand> {
        if turn.home.is_empty() || !turn.home.starts_with('/') {
            return Err(Error::invalid(format!(
                "session home must be an absolute path, got {:?}",
                turn.home
            )));
        }
        let mut args: Vec<String> = vec![
            "exec".into(),
            // One JSON event per line on stdout.
            "--json".into(),
            // Session workdirs are not git repositories.
            "--skip-git-repo-check".into(),
            // The harness sandbox is the boundary; Codex's own sandbox
            // (landlock/seccomp) is not available in every backend.
            "--dangerously-bypass-approvals-and-sandbox".into(),
        ];
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
