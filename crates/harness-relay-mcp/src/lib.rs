//! # harness-relay-mcp
//!
//! An MCP server on stdio that runs inside the agent's sandbox and offers
//! the agent the host's tools: tools that run on the user's own machine.
//! It never talks to the network; everything goes through files in the
//! relay directory, `$HARNESS_RELAY_DIR`, which the slice runner watches:
//!
//! - `tools.json`: a JSON array of [`ToolSpec`], written by the slice when
//!   the agent starts. `tools/list` lists exactly these (a missing file means
//!   no tools); `tools/call` refuses any other name without writing anything.
//! - `requests.jsonl`: for each call the server appends one line, a
//!   [`RelayRequest::HostTool`] (`{"kind":"host-tool","callId":…,"tool":…,
//!   "input":…}`), with a fresh call id (a simple-form UUID v4). The limits
//!   `byteBudget` and `timeoutMs` come from `HARNESS_RELAY_BYTE_BUDGET` and
//!   `HARNESS_RELAY_TIMEOUT_MS` when set; otherwise the session's defaults
//!   apply.
//! - `answers/<callId>.json`: the call's [`HostOutcome`], written by the
//!   slice. The server polls for it every 50 ms and answers the agent with
//!   [`HostOutcome::agent_text`]. The session always answers (a `timeout`
//!   outcome when the deadline passes), so the server only gives up on its
//!   own after [`MAX_TIMEOUT_MS`] plus a minute.
//!
//! Calls run concurrently: each `tools/call` waits for its own answer file.
//! Stdout carries the protocol, so diagnostics go to stderr only.

use std::{
    ffi::OsString,
    io::Write,
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use harness_relay::{
    files::{self, RelayRequest},
    HostCallRequest, HostOutcome, ToolSpec, MAX_BYTE_BUDGET, MAX_TIMEOUT_MS,
};
use rmcp::{
    model::{
        CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, Implementation,
        ListToolsResult, PaginatedRequestParams, ServerCapabilities, ServerConfig, Tool,
    },
    service::RequestContext,
    ErrorData as McpError, RoleServer, ServerHandler, ServiceExt,
};
use serde_json::Value;

/// The relay directory (required).
pub const ENV_DIR: &str = "HARNESS_RELAY_DIR";
/// Byte budget put on every request (optional).
pub const ENV_BYTE_BUDGET: &str = "HARNESS_RELAY_BYTE_BUDGET";
/// Timeout in milliseconds put on every request (optional).
pub const ENV_TIMEOUT_MS: &str = "HARNESS_RELAY_TIMEOUT_MS";

/// How often an answer file is looked for: short next to a host round trip,
/// long enough that a handful of waiting calls cost nothing.
pub const POLL_INTERVAL: Duration = Duration::from_millis(50);
/// How long a call waits before giving up on the session. The session itself
/// answers with a `timeout` outcome by the longest allowed deadline; the
/// extra minute covers the call waiting in `requests.jsonl` before the slice
/// picks it up, so this only fires when the session is gone.
pub const GIVE_UP_AFTER: Duration = Duration::from_millis(MAX_TIMEOUT_MS + 60_000);

/// Where the relay directory is and what limits to ask for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// The relay directory.
    pub dir: PathBuf,
    /// `byteBudget` of every request; `None` leaves the session's default.
    pub byte_budget: Option<u64>,
    /// `timeoutMs` of every request; `None` leaves the session's default.
    pub timeout_ms: Option<u64>,
}

impl Config {
    /// Read the configuration from the process environment.
    pub fn from_env() -> Result<Self, String> {
        Self::from_vars(|name| std::env::var_os(name))
    }

    /// Read the configuration through `var` (the environment in
    /// [`Config::from_env`]).
    pub fn from_vars(var: impl Fn(&str) -> Option<OsString>) -> Result<Self, String> {
        let Some(dir) = var(ENV_DIR).filter(|d| !d.is_empty()) else {
            return Err(format!(
                "{ENV_DIR} is not set: it must name the relay directory shared with the harness"
            ));
        };
        // A bad limit is refused here rather than dropped: the session would
        // refuse every call carrying it, and a silent default hides the bug.
        let limit = |name: &str, max: u64| -> Result<Option<u64>, String> {
            let Some(raw) = var(name).filter(|v| !v.is_empty()) else {
                return Ok(None);
            };
            let text = raw.to_string_lossy();
            match text.trim().parse::<u64>() {
                Ok(n) if (1..=max).contains(&n) => Ok(Some(n)),
                _ => Err(format!(
                    "{name}={text:?}: expected a whole number in 1..={max}"
                )),
            }
        };
        Ok(Self {
            dir: PathBuf::from(dir),
            byte_budget: limit(ENV_BYTE_BUDGET, MAX_BYTE_BUDGET)?,
            timeout_ms: limit(ENV_TIMEOUT_MS, MAX_TIMEOUT_MS)?,
        })
    }
}

/// The MCP server: lists the host's tools and relays calls through the
/// relay directory.
#[derive(Debug)]
pub struct RelayServer {
    config: Arc<Config>,
    // Appends from this process are serialized so two lines can never
    // interleave, whatever the platform does with concurrent appends.
    append_lock: Arc<tokio::sync::Mutex<()>>,
}

impl RelayServer {
    /// A server over `config`.
    pub fn new(config: Config) -> Self {
        Self {
            config: Arc::new(config),
            append_lock: Arc::default(),
        }
    }

    /// Serve MCP on stdin/stdout until the client closes stdin.
    pub async fn serve_stdio(self) -> Result<(), String> {
        let running = self
            .serve(rmcp::transport::stdio())
            .await
            .map_err(|e| format!("MCP handshake failed: {e}"))?;
        running
            .waiting()
            .await
            .map_err(|e| format!("MCP service stopped: {e}"))?;
        Ok(())
    }

    /// The host's tools as the slice wrote them. Re-read on every request:
    /// the file is small, and the listing and the check in `tools/call`
    /// then never disagree.
    async fn load_tools(&self) -> Result<Vec<ToolSpec>, String> {
        let path = self.config.dir.join(files::TOOLS);
        let bytes = match tokio::fs::read(&path).await {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
        };
        let tools: Vec<ToolSpec> = serde_json::from_slice(&bytes)
            .map_err(|e| format!("{} is not a JSON array of tools: {e}", path.display()))?;
        // MCP clients may reject a whole server over one malformed tool, so
        // a bad declaration costs only that tool.
        let mut seen = std::collections::BTreeSet::new();
        Ok(tools
            .into_iter()
            .filter(|tool| match tool.validate() {
                Err(e) => {
                    eprintln!("harness-relay-mcp: skipping a host tool: {e}");
                    false
                }
                Ok(()) if !seen.insert(tool.name.clone()) => {
                    eprintln!(
                        "harness-relay-mcp: skipping a second declaration of host tool {:?}",
                        tool.name
                    );
                    false
                }
                Ok(()) => true,
            })
            .collect())
    }

    /// Append the request as one line with one write, so the slice never
    /// reads half a request from this process.
    async fn append_request(&self, request: HostCallRequest) -> Result<(), String> {
        let mut line = serde_json::to_vec(&RelayRequest::HostTool(request))
            .map_err(|e| format!("cannot encode the request: {e}"))?;
        line.push(b'\n');
        let path = self.config.dir.join(files::REQUESTS);
        let _guard = self.append_lock.lock().await;
        tokio::task::spawn_blocking(move || {
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&path)
                .and_then(|mut file| file.write_all(&line))
                .map_err(|e| format!("cannot append to {}: {e}", path.display()))
        })
        .await
        .map_err(|e| format!("the append task failed: {e}"))?
    }

    /// Wait for the call's answer file; `None` after [`GIVE_UP_AFTER`].
    async fn await_answer(&self, call_id: &str) -> Option<HostOutcome> {
        let path = self.config.dir.join(files::answer_path(call_id));
        let deadline = tokio::time::Instant::now() + GIVE_UP_AFTER;
        let mut last_error = None;
        loop {
            match read_answer(&path).await {
                Ok(Some(outcome)) => return Some(outcome),
                Ok(None) => {}
                Err(e) => {
                    // Said once per distinct error: the poll repeats 20 times
                    // a second.
                    if last_error.as_ref() != Some(&e) {
                        eprintln!("harness-relay-mcp: call {call_id}: {e}; still waiting");
                        last_error = Some(e);
                    }
                }
            }
            if tokio::time::Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(POLL_INTERVAL).await;
        }
    }

    async fn relay_call(&self, tool: String, input: Value, call_id: String) -> CallToolResult {
        let request = HostCallRequest {
            call_id: call_id.clone(),
            tool: tool.clone(),
            input,
            byte_budget: self.config.byte_budget,
            timeout_ms: self.config.timeout_ms,
        };
        if let Err(e) = self.append_request(request).await {
            eprintln!("harness-relay-mcp: call {call_id}: {e}");
            return tool_error(format!(
                "host tool {tool:?} could not be called: {e}. Nothing ran; you may call it again."
            ));
        }
        match self.await_answer(&call_id).await {
            Some(outcome) => {
                let (text, is_error) = outcome.agent_text();
                if is_error {
                    tool_error(text)
                } else {
                    CallToolResult::success(vec![ContentBlock::text(text)])
                }
            }
            None => {
                eprintln!("harness-relay-mcp: call {call_id}: no answer, giving up");
                tool_error(format!(
                    "host tool {tool:?}: the session never answered (waited {} s). \
                     It may or may not have run; do not assume either.",
                    GIVE_UP_AFTER.as_secs()
                ))
            }
        }
    }
}

/// The answer at `path`: `Ok(None)` while it is missing or not yet whole
/// (the slice may be mid-write), `Err` when it cannot be read at all.
async fn read_answer(path: &Path) -> Result<Option<HostOutcome>, String> {
    match tokio::fs::read(path).await {
        Ok(bytes) => Ok(serde_json::from_slice(&bytes).ok()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("cannot read {}: {e}", path.display())),
    }
}

fn tool_error(text: impl Into<String>) -> CallToolResult {
    CallToolResult::error(vec![ContentBlock::text(text)])
}

fn mcp_tool(spec: ToolSpec) -> Tool {
    let schema = match spec.input_schema {
        Value::Object(schema) => schema,
        // `load_tools` keeps only object schemas.
        _ => serde_json::Map::new(),
    };
    let description = (!spec.description.is_empty()).then(|| spec.description.into());
    Tool::new_with_raw(spec.name, description, schema)
}

impl ServerHandler for RelayServer {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build()).with_server_info(
            Implementation::new(env!("CARGO_PKG_NAME"), env!("CARGO_PKG_VERSION")),
        )
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, McpError> {
        let tools = self.load_tools().await.map_err(|e| {
            eprintln!("harness-relay-mcp: {e}");
            McpError::internal_error(e, None)
        })?;
        Ok(ListToolsResult::with_all_items(
            tools.into_iter().map(mcp_tool).collect(),
        ))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, McpError> {
        let tools = match self.load_tools().await {
            Ok(tools) => tools,
            Err(e) => {
                eprintln!("harness-relay-mcp: {e}");
                return Ok(tool_error(format!("host tools are unavailable: {e}")).into());
            }
        };
        let name = request.name.into_owned();
        if !tools.iter().any(|tool| tool.name == name) {
            return Ok(tool_error(format!(
                "the host does not offer a tool named {name:?}. Nothing ran."
            ))
            .into());
        }
        let input = Value::Object(request.arguments.unwrap_or_default());
        let call_id = uuid::Uuid::new_v4().simple().to_string();
        tokio::select! {
            result = self.relay_call(name, input, call_id.clone()) => Ok(result.into()),
            // The client sent notifications/cancelled, or closed stdin
            // (rmcp then cancels what is in flight). The request stays in
            // requests.jsonl and the session still records its outcome; only
            // this wait ends.
            () = context.ct.cancelled() => {
                eprintln!("harness-relay-mcp: call {call_id}: cancelled, no longer waiting");
                Ok(tool_error(
                    "host tool call cancelled by the client; it may or may not have run.",
                )
                .into())
            }
        }
    }
}

/// The binary's entry: serve the relay on stdin/stdout with the
/// configuration from the environment (what `harness-relay-mcp` runs, and
/// what the multi-call `harness` binary runs when invoked under that name).
pub fn main() -> std::process::ExitCode {
    use std::process::ExitCode;
    let config = match Config::from_env() {
        Ok(config) => config,
        Err(e) => {
            eprintln!("harness-relay-mcp: {e}");
            return ExitCode::from(2);
        }
    };
    // One thread is plenty: the work is waiting on stdin and on files, and
    // the sandbox may be small.
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("harness-relay-mcp: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let server = RelayServer::new(config);
    match runtime.block_on(server.serve_stdio()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("harness-relay-mcp: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<OsString> {
        let pairs: Vec<(String, OsString)> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), OsString::from(v)))
            .collect();
        move |name| {
            pairs
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
        }
    }

    #[test]
    fn config_needs_the_dir_and_sane_limits() {
        let err = Config::from_vars(vars(&[])).unwrap_err();
        assert!(err.contains(ENV_DIR), "{err}");
        let err = Config::from_vars(vars(&[(ENV_DIR, "")])).unwrap_err();
        assert!(err.contains(ENV_DIR), "{err}");

        let c = Config::from_vars(vars(&[(ENV_DIR, "/r")])).unwrap();
        assert_eq!((c.byte_budget, c.timeout_ms), (None, None));

        let c = Config::from_vars(vars(&[
            (ENV_DIR, "/r"),
            (ENV_BYTE_BUDGET, "100"),
            (ENV_TIMEOUT_MS, "5000"),
        ]))
        .unwrap();
        assert_eq!((c.byte_budget, c.timeout_ms), (Some(100), Some(5000)));

        for (name, value) in [
            (ENV_BYTE_BUDGET, "0"),
            (ENV_BYTE_BUDGET, "lots"),
            (ENV_TIMEOUT_MS, "-1"),
            (ENV_TIMEOUT_MS, &(MAX_TIMEOUT_MS + 1).to_string()),
        ] {
            let err = Config::from_vars(vars(&[(ENV_DIR, "/r"), (name, value)])).unwrap_err();
            assert!(err.contains(name), "{err}");
        }
    }

    #[tokio::test]
    async fn invalid_and_repeated_tools_are_dropped_not_fatal() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join(files::TOOLS),
            r#"[{"name":"ok","inputSchema":{"type":"object"}},
                {"name":"bad name","inputSchema":{"type":"object"}},
                {"name":"ok","description":"again"},
                {"name":"no_schema"}]"#,
        )
        .unwrap();
        let server = RelayServer::new(Config {
            dir: dir.path().to_path_buf(),
            byte_budget: None,
            timeout_ms: None,
        });
        let names: Vec<String> = server
            .load_tools()
            .await
            .unwrap()
            .into_iter()
            .map(|t| t.name)
            .collect();
        assert_eq!(names, ["ok", "no_schema"]);
    }

    #[tokio::test]
    async fn a_half_written_answer_is_not_an_answer() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.json");
        assert_eq!(read_answer(&path).await, Ok(None));
        std::fs::write(&path, r#"{"outcome":"#).unwrap();
        assert_eq!(read_answer(&path).await, Ok(None));
        std::fs::write(&path, r#"{"outcome":"unavailable","reason":"r"}"#).unwrap();
        assert_eq!(
            read_answer(&path).await,
            Ok(Some(HostOutcome::Unavailable { reason: "r".into() }))
        );
    }
}
