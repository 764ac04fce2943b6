//! # harness-approval-mcp
//!
//! A minimal MCP server on stdio with one tool, `approve`, for Claude Code's
//! `--permission-prompt-tool mcp__harness__approve`. Claude Code calls it
//! whenever a tool needs permission; the server hands the request to the
//! harness through files and blocks until the harness answers:
//!
//! 1. append `{"kind":"approval","approvalId","toolName","input","toolUseId"}`
//!    (`harness_relay::files::RelayRequest::Approval`) as one line to
//!    `$HARNESS_RELAY_DIR/requests.jsonl`, the turn's relay (the slice
//!    runner tails it and surfaces a `tool-approval-request` part);
//! 2. poll `$HARNESS_RELAY_DIR/answers/<approvalId>.json`
//!    (`{"approved": bool, "reason": string?}`, written by the next slice
//!    once a client answered);
//! 3. answer Claude Code with the text content
//!    `{"behavior":"allow","updatedInput":<input>}` or
//!    `{"behavior":"deny","message":<reason>}` — the contract the CLI
//!    (2.1.332) checks: "Expected {behavior: 'allow', updatedInput?: object}
//!    or {behavior: 'deny', message: string}".
//!
//! Why hand-written JSON-RPC rather than the `rmcp` SDK: the server needs
//! exactly `initialize`, `tools/list`, `tools/call` and `ping` over
//! newline-delimited JSON, and it blocks on a file anyway; a synchronous
//! std-only loop is ~150 lines, has no async runtime or macro dependencies
//! to build on the 2-core CI, and is one small static-ish binary to copy
//! into every bootstrap snapshot.

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use harness_relay::files::{self, RelayRequest};
use harness_relay::ApprovalRequest;
use serde_json::{json, Value};

/// The tool's name; Claude Code sees it as `mcp__<server>__approve`.
pub const TOOL_NAME: &str = "approve";

/// Protocol version answered when the client proposes none.
const DEFAULT_PROTOCOL: &str = "2025-06-18";

/// The server: where requests and answers live, and how often to poll.
#[derive(Debug)]
pub struct Server {
    dir: PathBuf,
    poll: Duration,
    counter: AtomicU64,
}

/// A client's answer as the harness writes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    /// Allow or deny.
    pub approved: bool,
    /// Why (shown to the model on deny).
    pub reason: Option<String>,
}

impl Server {
    /// A server exchanging files under `dir`.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            poll: Duration::from_millis(100),
            counter: AtomicU64::new(0),
        }
    }

    /// Serve JSON-RPC messages, one per line, until `input` ends.
    pub fn serve(&self, input: impl BufRead, mut output: impl Write) -> std::io::Result<()> {
        for line in input.lines() {
            let line = line?;
            if line.trim().is_empty() {
                continue;
            }
            if let Some(reply) = self.handle_line(&line) {
                let mut bytes = serde_json::to_vec(&reply)?;
                bytes.push(b'\n');
                output.write_all(&bytes)?;
                output.flush()?;
            }
        }
        Ok(())
    }

    /// Answer one JSON-RPC line (`None` for notifications).
    pub fn handle_line(&self, line: &str) -> Option<Value> {
        let msg: Value = match serde_json::from_str(line) {
            Ok(v) => v,
            Err(e) => {
                return Some(error(Value::Null, -32700, &format!("parse error: {e}")));
            }
        };
        let id = msg.get("id").cloned();
        let method = msg.get("method").and_then(Value::as_str).unwrap_or("");
        // Notifications (no id) and responses need no reply.
        let id = id?;
        let params = msg.get("params").cloned().unwrap_or(Value::Null);
        Some(match method {
            "initialize" => {
                let version = params
                    .get("protocolVersion")
                    .and_then(Value::as_str)
                    .unwrap_or(DEFAULT_PROTOCOL);
                result(
                    id,
                    json!({
                        "protocolVersion": version,
                        "capabilities": { "tools": {} },
                        "serverInfo": { "name": "harness-approval-mcp", "version": env!("CARGO_PKG_VERSION") }
                    }),
                )
            }
            "ping" => result(id, json!({})),
            "tools/list" => result(id, json!({ "tools": [tool_description()] })),
            "tools/call" => {
                let name = params.get("name").and_then(Value::as_str).unwrap_or("");
                if name != TOOL_NAME {
                    return Some(error(id, -32602, &format!("unknown tool {name:?}")));
                }
                let args = params.get("arguments").cloned().unwrap_or(json!({}));
                match self.approve(&args) {
                    Ok(decision) => result(
                        id,
                        json!({ "content": [{ "type": "text", "text": decision.to_string() }] }),
                    ),
                    Err(e) => result(
                        id,
                        json!({ "content": [{ "type": "text", "text": e }], "isError": true }),
                    ),
                }
            }
            other => error(id, -32601, &format!("method not found: {other}")),
        })
    }

    /// One permission request: record it, wait for the answer, and return
    /// the decision JSON Claude Code expects.
    pub fn approve(&self, args: &Value) -> Result<Value, String> {
        let tool_name = args
            .get("tool_name")
            .and_then(Value::as_str)
            .ok_or("missing tool_name")?;
        let input = args.get("input").cloned().unwrap_or(json!({}));
        let tool_use_id = args.get("tool_use_id").and_then(Value::as_str);
        let approval_id = self.next_id(tool_use_id);
        let request = RelayRequest::Approval(ApprovalRequest {
            approval_id: approval_id.clone(),
            tool_name: tool_name.to_string(),
            input: input.clone(),
            tool_use_id: tool_use_id.map(str::to_string),
        });
        let line = serde_json::to_string(&request).map_err(|e| e.to_string())?;
        append_line(&self.dir.join(files::REQUESTS), &line)
            .map_err(|e| format!("recording the request in {}: {e}", self.dir.display()))?;
        let answer = self.wait_answer(&approval_id);
        Ok(decision(&answer, input))
    }

    fn next_id(&self, tool_use_id: Option<&str>) -> String {
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        // Only file-name-safe characters: the id names the answer file.
        let base: String = tool_use_id
            .unwrap_or("call")
            .chars()
            .filter(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == '-')
            .take(80)
            .collect();
        format!("{base}-{}-{n}", std::process::id())
    }

    /// Poll for the answer file. A file that does not parse yet is read
    /// again (a writer may be half-way through it).
    fn wait_answer(&self, approval_id: &str) -> Answer {
        let path = self.dir.join(files::answer_path(approval_id));
        loop {
            if let Some(answer) = read_answer(&path) {
                return answer;
            }
            std::thread::sleep(self.poll);
        }
    }
}

/// The `approve` tool as listed by `tools/list`.
pub fn tool_description() -> Value {
    json!({
        "name": TOOL_NAME,
        "description": "Ask the harness's client whether a tool may run.",
        "inputSchema": {
            "type": "object",
            "properties": {
                "tool_name": { "type": "string" },
                "input": { "type": "object" },
                "tool_use_id": { "type": "string" }
            },
            "required": ["tool_name", "input"]
        }
    })
}

/// Claude Code's decision JSON for `answer`.
pub fn decision(answer: &Answer, input: Value) -> Value {
    if answer.approved {
        json!({ "behavior": "allow", "updatedInput": input })
    } else {
        let message = answer
            .reason
            .clone()
            .filter(|r| !r.is_empty())
            .unwrap_or_else(|| "The user denied this tool call.".into());
        json!({ "behavior": "deny", "message": message })
    }
}

/// The answer in `path`, if it exists and parses.
pub fn read_answer(path: &Path) -> Option<Answer> {
    let bytes = std::fs::read(path).ok()?;
    let v: Value = serde_json::from_slice(&bytes).ok()?;
    Some(Answer {
        approved: v.get("approved")?.as_bool()?,
        reason: v.get("reason").and_then(Value::as_str).map(str::to_string),
    })
}

fn append_line(path: &Path, line: &str) -> std::io::Result<()> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)?;
    // One write of the whole line, so a reader never sees half of it
    // followed by another request.
    f.write_all(format!("{line}\n").as_bytes())
}

fn result(id: Value, result: Value) -> Value {
    json!({ "jsonrpc": "2.0", "id": id, "result": result })
}

fn error(id: Value, code: i64, message: &str) -> Value {
    json!({ "jsonrpc": "2.0", "id": id, "error": { "code": code, "message": message } })
}

/// The binary's entry: serve permission requests on stdin/stdout through
/// the relay directory `$HARNESS_RELAY_DIR` (what `harness-approval-mcp`
/// runs, and what the multi-call `harness` binary runs when invoked under
/// that name).
pub fn main() -> std::process::ExitCode {
    use std::process::ExitCode;
    let Some(dir) = std::env::var_os("HARNESS_RELAY_DIR").filter(|d| !d.is_empty()) else {
        eprintln!("harness-approval-mcp: HARNESS_RELAY_DIR is not set");
        return ExitCode::from(2);
    };
    let server = Server::new(dir);
    let stdin = std::io::stdin().lock();
    let stdout = std::io::stdout().lock();
    match server.serve(stdin, stdout) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("harness-approval-mcp: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn initialize_list_and_unknown_method() {
        let s = Server::new("/nonexistent");
        let r = s
            .handle_line(r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-03-26"}}"#)
            .unwrap();
        assert_eq!(r["result"]["protocolVersion"], "2025-03-26");
        assert!(r["result"]["capabilities"]["tools"].is_object());
        assert_eq!(
            s.handle_line(r#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#),
            None
        );
        let r = s
            .handle_line(r#"{"jsonrpc":"2.0","id":"a","method":"tools/list"}"#)
            .unwrap();
        assert_eq!(r["id"], "a");
        assert_eq!(r["result"]["tools"][0]["name"], TOOL_NAME);
        let r = s
            .handle_line(r#"{"jsonrpc":"2.0","id":2,"method":"nope"}"#)
            .unwrap();
        assert_eq!(r["error"]["code"], -32601);
        let r = s.handle_line("not json").unwrap();
        assert_eq!(r["error"]["code"], -32700);
    }

    #[test]
    fn a_call_records_the_request_and_waits_for_the_answer() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().to_path_buf();
        let answerer = std::thread::spawn(move || {
            let requests = path.join("requests.jsonl");
            loop {
                if let Ok(text) = std::fs::read_to_string(&requests) {
                    if let Some(line) = text.lines().next() {
                        let req: Value = serde_json::from_str(line).unwrap();
                        assert_eq!(req["kind"], "approval", "{req}");
                        let id = req["approvalId"].as_str().unwrap().to_string();
                        std::fs::create_dir_all(path.join("answers")).unwrap();
                        std::fs::write(
                            path.join("answers").join(format!("{id}.json")),
                            r#"{"approved":false,"reason":"not today"}"#,
                        )
                        .unwrap();
                        return req;
                    }
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        let s = Server::new(dir.path());
        let r = s
            .handle_line(
                r#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"approve","arguments":{"tool_name":"Bash","input":{"command":"rm x"},"tool_use_id":"toolu_1"}}}"#,
            )
            .unwrap();
        let req = answerer.join().unwrap();
        assert_eq!(req["toolName"], "Bash");
        assert_eq!(req["input"]["command"], "rm x");
        assert_eq!(req["toolUseId"], "toolu_1");
        assert!(req["approvalId"].as_str().unwrap().starts_with("toolu_1-"));
        let text = r["result"]["content"][0]["text"].as_str().unwrap();
        let d: Value = serde_json::from_str(text).unwrap();
        assert_eq!(d, json!({"behavior":"deny","message":"not today"}));
    }

    #[test]
    fn allow_echoes_the_input() {
        let a = Answer {
            approved: true,
            reason: None,
        };
        assert_eq!(
            decision(&a, json!({"command":"ls"})),
            json!({"behavior":"allow","updatedInput":{"command":"ls"}})
        );
        let d = Answer {
            approved: false,
            reason: None,
        };
        assert_eq!(decision(&d, json!({}))["behavior"], "deny");
        assert!(decision(&d, json!({}))["message"].as_str().unwrap().len() > 5);
    }
}
