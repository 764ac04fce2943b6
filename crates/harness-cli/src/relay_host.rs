//! `harness relay-host`: this machine as one session's tool host. The
//! tools are commands listed in a TOML file; the agent in the session's
//! sandbox calls them as MCP tools `mcp__host__<name>`, and they run here,
//! each call at most once (see `docs/host-tools.md`).
//!
//! ```toml
//! [[tool]]
//! name = "lookup"
//! description = "Look up a customer in the local database"
//! command = ["python3", "lookup.py"]     # the arguments arrive as JSON on stdin
//! input_schema = { type = "object", properties = { q = { type = "string" } }, required = ["q"] }
//! # cwd = "."                           # relative to this file (the default)
//! # env = { DB = "customers.sqlite" }
//! ```

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use harness::core::relay::{validate_tools, ToolSpec};
use harness::core::{ErrorKind, SessionId};
use harness::runtime::{CommandTool, HostEvent, ToolHost};
use serde::Deserialize;

use crate::reconnect::{keep_linked, LinkEnd};

/// `harness relay-host` arguments.
#[derive(Debug, clap::Args)]
pub struct RelayHostArgs {
    /// The server of the session (`http://host:port`).
    #[arg(long)]
    server: String,
    /// A token with the tool-host role for the session (`--token T=tool-host@SESSION`
    /// on `harness serve`).
    #[arg(long, env = "HARNESS_TOKEN")]
    token: Option<String>,
    /// The session to serve.
    #[arg(long)]
    session: String,
    /// The tools: a TOML file of `[[tool]]` tables (name, description,
    /// command, input_schema, optional cwd and env).
    #[arg(long, value_name = "FILE")]
    tools: PathBuf,
    /// Replace a tool host already attached to the session (its calls still
    /// running end `ambiguous`). Without it a second host is refused.
    #[arg(long)]
    takeover: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ToolsFile {
    #[serde(default)]
    tool: Vec<ToolEntry>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ToolEntry {
    name: String,
    #[serde(default)]
    description: String,
    command: Vec<String>,
    #[serde(default)]
    input_schema: Option<toml::Value>,
    #[serde(default)]
    cwd: Option<PathBuf>,
    #[serde(default)]
    env: BTreeMap<String, String>,
}

/// The tool host described by the TOML file at `path`.
pub fn load_tools(path: &Path) -> Result<ToolHost> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading the tools file {}", path.display()))?;
    let file: ToolsFile =
        toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    if file.tool.is_empty() {
        bail!(
            "{} declares no tools: add a [[tool]] table with name and command",
            path.display()
        );
    }
    let base = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let mut host = ToolHost::new();
    let mut specs = Vec::new();
    for entry in file.tool {
        if entry.command.is_empty() {
            bail!("tool {:?}: command is empty", entry.name);
        }
        let schema = match entry.input_schema {
            Some(v) => serde_json::to_value(v)?,
            None => serde_json::json!({ "type": "object" }),
        };
        let spec = ToolSpec::new(&entry.name, &entry.description, schema);
        specs.push(spec.clone());
        let cwd = base.join(entry.cwd.unwrap_or_default());
        host = host.tool(
            spec,
            CommandTool {
                argv: entry.command,
                cwd: Some(cwd),
                env: entry.env,
            },
        );
    }
    validate_tools(&specs).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    Ok(host)
}

/// Serve until interrupted; reconnect when the link drops (the server
/// restarted); stop when another host holds the lease or the token is
/// refused.
pub async fn run(args: RelayHostArgs) -> Result<()> {
    let session = SessionId::parse(&args.session)?;
    let (events_tx, mut events) = tokio::sync::mpsc::unbounded_channel();
    let host = load_tools(&args.tools)?.with_events(events_tx);
    tokio::spawn(async move {
        while let Some(event) = events.recv().await {
            match event {
                HostEvent::Attached { tools } => eprintln!(
                    "relay-host: attached as the tool host of {}, offering {}",
                    args.session,
                    tools.join(", ")
                ),
                HostEvent::Ran {
                    call_id,
                    tool,
                    is_error,
                    elapsed,
                } => {
                    let how = match is_error {
                        Some(false) => "ok",
                        Some(true) => "failed",
                        None => "cancelled",
                    };
                    eprintln!(
                        "relay-host: {tool} ({call_id}) {how} in {} ms",
                        elapsed.as_millis()
                    );
                }
                HostEvent::Refused { message } => {
                    eprintln!("relay-host: the session refused a message: {message}")
                }
            }
        }
    });
    // Refusals after a drop: the server may not have seen our old link go
    // yet, so a few are waited out; on the first attempt one is final.
    let mut refusals_left = 0u32;
    let ended = move |served: harness::core::Result<()>| match served {
        Ok(()) => {
            refusals_left = 10;
            LinkEnd::Closed("the session closed the link".into())
        }
        Err(e) if e.kind() == ErrorKind::Conflict && refusals_left > 0 => {
            refusals_left -= 1;
            LinkEnd::Failed(e.to_string())
        }
        Err(e) if matches!(e.kind(), ErrorKind::Conflict | ErrorKind::Unauthorized) => {
            LinkEnd::Stop(Err(anyhow::Error::new(e).context(REFUSED)))
        }
        Err(e) => LinkEnd::Failed(e.to_string()),
    };
    let serve = || host.serve_ws(&args.server, &session, args.token.as_deref(), args.takeover);
    keep_linked("relay-host", Duration::from_secs(5), serve, ended).await
}

/// Why `relay-host` gives up on a session that will not take it.
const REFUSED: &str =
    "the session refused this tool host (pass --takeover to replace the attached one)";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tools_file_loads_and_bad_ones_are_explained() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tools.toml");
        std::fs::write(
            &path,
            r#"
[[tool]]
name = "lookup"
description = "find"
command = ["cat"]
input_schema = { type = "object", properties = { q = { type = "string" } } }
"#,
        )
        .unwrap();
        let host = load_tools(&path).unwrap();
        let specs = host.specs();
        assert_eq!(specs.len(), 1);
        assert_eq!(
            specs[0].input_schema["properties"]["q"]["type"],
            serde_json::json!("string")
        );
        std::fs::write(&path, "[[tool]]\nname = \"a b\"\ncommand = [\"x\"]\n").unwrap();
        let err = load_tools(&path).unwrap_err().to_string();
        assert!(err.contains("a b"), "{err}");
        std::fs::write(&path, "[[tool]]\nname = \"a\"\ncommand = []\n").unwrap();
        assert!(load_tools(&path).unwrap_err().to_string().contains("empty"));
        std::fs::write(&path, "").unwrap();
        assert!(load_tools(&path)
            .unwrap_err()
            .to_string()
            .contains("no tools"));
        std::fs::write(
            &path,
            "[[tool]]\nname = \"a\"\ncommand = [\"x\"]\ncolour = 1\n",
        )
        .unwrap();
        assert!(format!("{:#}", load_tools(&path).unwrap_err()).contains("colour"));
    }
}
