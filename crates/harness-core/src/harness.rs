//! The agent adapter contract: how to install an agent, how to start a turn,
//! and how to read what it prints.

use std::collections::BTreeMap;

use crate::bootstrap::BootstrapRecipe;
use crate::part::StreamPart;
use crate::turn::TurnState;
use crate::Result;

/// Everything an adapter needs to build a turn's command.
#[derive(Debug, Clone)]
pub struct TurnContext<'a> {
    /// The turn (prompt, agent session id for resuming, approvals).
    pub state: &'a TurnState,
    /// The working directory inside the sandbox.
    pub workdir: &'a str,
    /// The session's own home directory inside the sandbox (agent state
    /// lives under it, so sessions never share state and it moves with the
    /// tree).
    pub home: &'a str,
    /// Environment from the caller: API keys, base URLs.
    pub env: &'a BTreeMap<String, String>,
    /// Model name, if the caller picked one.
    pub model: Option<&'a str>,
    /// Extra system prompt, if any.
    pub system_prompt: Option<&'a str>,
    /// The turn's relay directory when the session's tool host offers
    /// tools: the adapter gives the agent the host-tool MCP bridge
    /// (`harness-relay-mcp`, server name [`MCP_SERVER_NAME`]) with
    /// `HARNESS_RELAY_DIR` set to it.
    ///
    /// [`MCP_SERVER_NAME`]: crate::relay::files::MCP_SERVER_NAME
    pub relay_dir: Option<&'a str>,
}

/// A command to run in the sandbox for one turn.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentCommand {
    /// Program and arguments.
    pub argv: Vec<String>,
    /// Environment (merged over the sandbox's).
    pub env: BTreeMap<String, String>,
    /// Working directory.
    pub cwd: String,
}

/// Turns an agent's output lines into stream parts. Stateful (it tracks
/// open blocks and the agent's session id), fed line by line.
pub trait OutputParser: Send + std::fmt::Debug {
    /// Parse one complete line (without its newline). Unknown or malformed
    /// lines become [`StreamPart::Raw`]; a parser never fails.
    fn push_line(&mut self, line: &str) -> Vec<StreamPart>;

    /// The agent's own session/thread id, once seen.
    fn agent_session_id(&self) -> Option<String>;

    /// True while a text or reasoning block is open. A slice never commits a
    /// spool cursor past the start of an open block, so a retried slice
    /// re-sends the whole block.
    fn in_block(&self) -> bool;
}

/// An agent adapter (Claude Code, Codex).
pub trait Harness: Send + Sync + std::fmt::Debug {
    /// Adapter name recorded in turn states (`claude-code`, `codex`).
    fn name(&self) -> &'static str;

    /// What to install in a sandbox (run once per identity).
    fn bootstrap_recipe(&self) -> Result<BootstrapRecipe>;

    /// The command for one turn.
    fn turn_command(&self, turn: &TurnContext<'_>) -> Result<AgentCommand>;

    /// A fresh parser for one turn's output.
    fn parser(&self) -> Box<dyn OutputParser>;

    /// Directories (under `home`) holding the agent's own session state,
    /// which must travel with the working tree.
    fn state_dirs(&self, home: &str) -> Vec<String>;

    /// Paths inside [`state_dirs`](Self::state_dirs), relative to `home`,
    /// left out when the state travels: scratch the agent makes again, which
    /// may hold what a restore refuses (a symlink to the agent's binary
    /// outside the tree). `tar --exclude` patterns.
    fn state_excludes(&self) -> Vec<String> {
        Vec::new()
    }

    /// A shell script that adapts restored agent state to a new place, run
    /// in the target sandbox after the state directories were restored under
    /// its home (see `moves::restore_session`; only called when the home or
    /// the workdir changed). Agents that key state by the working directory
    /// (Claude Code names its transcript directory after the cwd) or record
    /// absolute paths under their home (Codex's thread index) fix that here.
    /// `None` (the default): the state does not depend on either.
    fn relocate_state_script(&self, moved: &StateMove<'_>) -> Option<String> {
        let _ = moved;
        None
    }
}

/// Where a session's agent state came from and where it was restored to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StateMove<'a> {
    /// `$HOME` in the source sandbox.
    pub old_home: &'a str,
    /// `$HOME` in the target sandbox (the state dirs are restored under it).
    pub home: &'a str,
    /// The source sandbox's working directory.
    pub old_workdir: &'a str,
    /// The target sandbox's working directory.
    pub workdir: &'a str,
}
