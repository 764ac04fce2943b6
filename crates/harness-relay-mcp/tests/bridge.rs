//! The built binary, driven like an MCP client drives it: newline-delimited
//! JSON-RPC on stdin/stdout, with the test playing the slice on the other
//! side of the relay directory.

use std::{
    collections::HashMap,
    io::{BufRead, BufReader, Write},
    path::Path,
    process::{Child, ChildStdin, Command, Stdio},
    sync::mpsc::{self, Receiver, RecvTimeoutError},
    time::{Duration, Instant},
};

use harness_relay::{
    files::{self, RelayRequest},
    HostCallRequest,
};
use serde_json::{json, Value};

const WAIT: Duration = Duration::from_secs(10);
const BIN: &str = env!("CARGO_BIN_EXE_harness-relay-mcp");

/// A running server with the MCP handshake done.
struct Mcp {
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<String>,
    /// Responses read while waiting for another id.
    early: HashMap<u64, Value>,
}

impl Mcp {
    fn start(dir: &Path, env: &[(&str, &str)]) -> Self {
        let mut cmd = Command::new(BIN);
        cmd.env("HARNESS_RELAY_DIR", dir)
            .env_remove("HARNESS_RELAY_BYTE_BUDGET")
            .env_remove("HARNESS_RELAY_TIMEOUT_MS")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn harness-relay-mcp");
        let stdin = child.stdin.take().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        // A thread, so every read from stdout can be bounded by recv_timeout.
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut mcp = Self {
            child,
            stdin,
            lines,
            early: HashMap::new(),
        };
        mcp.send(json!({
            "jsonrpc": "2.0", "id": 0, "method": "initialize",
            "params": {
                "protocolVersion": "2025-06-18",
                "capabilities": {},
                "clientInfo": {"name": "bridge-test", "version": "0"}
            }
        }));
        let init = mcp.response(0);
        assert_eq!(init["result"]["protocolVersion"], "2025-06-18", "{init}");
        assert_eq!(
            init["result"]["serverInfo"]["name"], "harness-relay-mcp",
            "{init}"
        );
        assert!(
            init["result"]["capabilities"]["tools"].is_object(),
            "{init}"
        );
        mcp.send(json!({"jsonrpc": "2.0", "method": "notifications/initialized"}));
        mcp
    }

    fn send(&mut self, message: Value) {
        let mut line = serde_json::to_vec(&message).unwrap();
        line.push(b'\n');
        self.stdin.write_all(&line).unwrap();
        self.stdin.flush().unwrap();
    }

    fn call(&mut self, id: u64, tool: &str, arguments: Value) {
        self.send(json!({
            "jsonrpc": "2.0", "id": id, "method": "tools/call",
            "params": {"name": tool, "arguments": arguments}
        }));
    }

    /// The response to `id`, waiting up to `wait`.
    fn try_response(&mut self, id: u64, wait: Duration) -> Option<Value> {
        let deadline = Instant::now() + wait;
        loop {
            if let Some(response) = self.early.remove(&id) {
                return Some(response);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            let line = match self.lines.recv_timeout(left) {
                Ok(line) => line,
                Err(RecvTimeoutError::Timeout) => return None,
                Err(RecvTimeoutError::Disconnected) => panic!("the server closed stdout"),
            };
            let message: Value = serde_json::from_str(&line)
                .unwrap_or_else(|e| panic!("stdout carried a non-JSON line {line:?}: {e}"));
            // Notifications and server requests have no numeric id of ours.
            if let Some(got) = message.get("id").and_then(Value::as_u64) {
                if message.get("method").is_none() {
                    self.early.insert(got, message);
                }
            }
        }
    }

    fn response(&mut self, id: u64) -> Value {
        self.try_response(id, WAIT)
            .unwrap_or_else(|| panic!("no response to request {id} within {WAIT:?}"))
    }

    /// The `result` of a `tools/call`: its single text and `isError`.
    fn tool_result(&mut self, id: u64) -> (String, bool) {
        let response = self.response(id);
        let result = &response["result"];
        let content = result["content"]
            .as_array()
            .unwrap_or_else(|| panic!("tools/call {id} answered without content: {response}"));
        assert_eq!(content.len(), 1, "{response}");
        assert_eq!(content[0]["type"], "text", "{response}");
        let text = content[0]["text"].as_str().unwrap().to_string();
        let is_error = result["isError"]
            .as_bool()
            .unwrap_or_else(|| panic!("no isError in {response}"));
        (text, is_error)
    }
}

impl Drop for Mcp {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn write_tools(dir: &Path, tools: &Value) {
    std::fs::write(dir.join(files::TOOLS), tools.to_string()).unwrap();
}

fn echo_tool(dir: &Path) {
    write_tools(
        dir,
        &json!([{"name": "echo", "description": "Echo", "inputSchema": {"type": "object"}}]),
    );
}

/// The raw lines of `requests.jsonl` once it holds `n` (fails after 10 s).
fn request_lines(dir: &Path, n: usize) -> Vec<Value> {
    let path = dir.join(files::REQUESTS);
    let deadline = Instant::now() + WAIT;
    loop {
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        // Only whole lines count: a line is written in one piece with its
        // newline, so a line without one would be a torn write.
        let lines: Vec<&str> = text.split_inclusive('\n').collect();
        if lines.len() >= n && lines.iter().all(|l| l.ends_with('\n')) {
            assert_eq!(lines.len(), n, "more requests than expected: {text}");
            return lines
                .iter()
                .map(|l| serde_json::from_str(l).unwrap())
                .collect();
        }
        assert!(
            Instant::now() < deadline,
            "requests.jsonl did not reach {n} lines within {WAIT:?}: {text:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A request line as the slice reads it, checked for a usable call id.
fn host_call(line: &Value) -> HostCallRequest {
    let Ok(RelayRequest::HostTool(call)) = serde_json::from_value(line.clone()) else {
        panic!("not a host-tool RelayRequest: {line}");
    };
    assert_eq!(line["kind"], "host-tool", "{line}");
    harness_relay::validate_call_id(&call.call_id).unwrap();
    assert!(
        call.call_id.len() == 32 && call.call_id.bytes().all(|b| b.is_ascii_hexdigit()),
        "call id is not a simple-form UUID: {}",
        call.call_id
    );
    call
}

/// Write an answer the way the slice does: whole, by rename.
fn answer(dir: &Path, call_id: &str, outcome: &Value) {
    let answers = dir.join(files::ANSWERS);
    std::fs::create_dir_all(&answers).unwrap();
    let tmp = answers.join(format!(".{call_id}.tmp"));
    std::fs::write(&tmp, outcome.to_string()).unwrap();
    std::fs::rename(&tmp, dir.join(files::answer_path(call_id))).unwrap();
}

#[test]
fn lists_exactly_the_declared_tools() {
    let dir = tempfile::tempdir().unwrap();
    let tools = json!([
        {
            "name": "query_db",
            "description": "Run SQL on the local database",
            "inputSchema": {
                "type": "object",
                "properties": {"sql": {"type": "string"}},
                "required": ["sql"]
            }
        },
        {
            "name": "open-url",
            "description": "Open a page in the user's browser",
            "inputSchema": {"type": "object", "properties": {"url": {"type": "string"}}}
        }
    ]);
    write_tools(dir.path(), &tools);
    let mut mcp = Mcp::start(dir.path(), &[]);
    mcp.send(json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}));
    let response = mcp.response(1);
    assert_eq!(response["result"]["tools"], tools, "{response}");
}

#[test]
fn lists_no_tools_without_tools_json() {
    let dir = tempfile::tempdir().unwrap();
    let mut mcp = Mcp::start(dir.path(), &[]);
    mcp.send(json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}));
    let response = mcp.response(1);
    assert_eq!(response["result"]["tools"], json!([]), "{response}");
}

#[test]
fn a_call_is_relayed_and_answered_with_each_outcome() {
    let dir = tempfile::tempdir().unwrap();
    echo_tool(dir.path());
    let mut mcp = Mcp::start(dir.path(), &[]);

    let cases = [
        (
            json!({"outcome": "completed", "output": "hello from the host", "isError": false}),
            false,
            vec!["hello from the host"],
        ),
        (
            json!({"outcome": "unavailable", "reason": "no host attached"}),
            true,
            vec!["unavailable", "no host attached", "call it again"],
        ),
        (
            json!({"outcome": "timeout", "deadlineAtMs": 1_700_000_000_000u64}),
            true,
            vec!["timed out"],
        ),
        (
            json!({"outcome": "ambiguous", "reason": "the host left mid-call"}),
            true,
            vec!["outcome unknown", "the host left mid-call"],
        ),
    ];
    let mut seen_ids = Vec::new();
    for (n, (outcome, want_error, want_text)) in cases.iter().enumerate() {
        let id = 10 + n as u64;
        let args = json!({"text": "hi", "n": n});
        mcp.call(id, "echo", args.clone());
        let lines = request_lines(dir.path(), n + 1);
        let line = &lines[n];
        assert!(
            line.get("byteBudget").is_none() && line.get("timeoutMs").is_none(),
            "limits are left to the session when not configured: {line}"
        );
        let call = host_call(line);
        assert_eq!(call.tool, "echo");
        assert_eq!(call.input, args);
        assert!(!seen_ids.contains(&call.call_id), "call id reused");
        seen_ids.push(call.call_id.clone());

        assert!(
            mcp.try_response(id, Duration::from_millis(300)).is_none(),
            "answered before the session did"
        );
        answer(dir.path(), &call.call_id, outcome);
        let (text, is_error) = mcp.tool_result(id);
        assert_eq!(is_error, *want_error, "{outcome}: {text}");
        for want in want_text {
            assert!(text.contains(want), "{outcome}: {text:?} lacks {want:?}");
        }
    }
}

#[test]
fn a_call_without_arguments_sends_an_empty_object() {
    let dir = tempfile::tempdir().unwrap();
    echo_tool(dir.path());
    let mut mcp = Mcp::start(dir.path(), &[]);
    mcp.send(json!({
        "jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "echo"}
    }));
    let call = host_call(&request_lines(dir.path(), 1)[0]);
    assert_eq!(call.input, json!({}));
    answer(
        dir.path(),
        &call.call_id,
        &json!({"outcome": "completed", "output": "ok", "isError": true}),
    );
    // The tool's own failure reaches the agent as an error.
    assert_eq!(mcp.tool_result(1), ("ok".to_string(), true));
}

#[test]
fn a_partly_written_answer_is_waited_out() {
    let dir = tempfile::tempdir().unwrap();
    echo_tool(dir.path());
    let mut mcp = Mcp::start(dir.path(), &[]);
    mcp.call(1, "echo", json!({}));
    let call = host_call(&request_lines(dir.path(), 1)[0]);
    let path = dir.path().join(files::answer_path(&call.call_id));
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(&path, r#"{"outcome":"#).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        mcp.try_response(1, Duration::ZERO).is_none(),
        "answered from a half-written file"
    );
    std::fs::write(
        &path,
        json!({"outcome": "completed", "output": "whole now"}).to_string(),
    )
    .unwrap();
    assert_eq!(mcp.tool_result(1), ("whole now".to_string(), false));
}

#[test]
fn two_calls_in_flight_each_get_their_own_answer() {
    let dir = tempfile::tempdir().unwrap();
    echo_tool(dir.path());
    let mut mcp = Mcp::start(dir.path(), &[]);
    mcp.call(1, "echo", json!({"which": "first"}));
    mcp.call(2, "echo", json!({"which": "second"}));
    let calls: Vec<HostCallRequest> = request_lines(dir.path(), 2).iter().map(host_call).collect();
    let id_of = |which: &str| {
        calls
            .iter()
            .find(|c| c.input["which"] == which)
            .unwrap_or_else(|| panic!("no request for the {which} call: {calls:?}"))
            .call_id
            .clone()
    };
    let (first, second) = (id_of("first"), id_of("second"));
    assert_ne!(first, second);

    answer(
        dir.path(),
        &second,
        &json!({"outcome": "completed", "output": "answer two"}),
    );
    assert_eq!(mcp.tool_result(2), ("answer two".to_string(), false));
    assert!(
        mcp.try_response(1, Duration::from_millis(200)).is_none(),
        "the first call was answered before its answer existed"
    );
    answer(
        dir.path(),
        &first,
        &json!({"outcome": "completed", "output": "answer one"}),
    );
    assert_eq!(mcp.tool_result(1), ("answer one".to_string(), false));
}

#[test]
fn an_unknown_tool_is_refused_without_a_request() {
    let dir = tempfile::tempdir().unwrap();
    echo_tool(dir.path());
    let mut mcp = Mcp::start(dir.path(), &[]);
    mcp.call(1, "rm_rf", json!({"path": "/"}));
    let (text, is_error) = mcp.tool_result(1);
    assert!(is_error, "{text}");
    assert!(
        text.contains("rm_rf") && text.contains("does not offer"),
        "{text}"
    );
    let requests = std::fs::read_to_string(dir.path().join(files::REQUESTS)).unwrap_or_default();
    assert_eq!(requests, "", "a request was written for an unknown tool");

    // The refusal does not wedge the server: a known tool still goes through.
    mcp.call(2, "echo", json!({}));
    let call = host_call(&request_lines(dir.path(), 1)[0]);
    assert_eq!(call.tool, "echo");
}

#[test]
fn limits_from_the_environment_go_on_the_request() {
    let dir = tempfile::tempdir().unwrap();
    echo_tool(dir.path());
    let mut mcp = Mcp::start(
        dir.path(),
        &[
            ("HARNESS_RELAY_BYTE_BUDGET", "100"),
            ("HARNESS_RELAY_TIMEOUT_MS", "5000"),
        ],
    );
    mcp.call(1, "echo", json!({}));
    let line = &request_lines(dir.path(), 1)[0];
    assert_eq!(line["byteBudget"], 100, "{line}");
    assert_eq!(line["timeoutMs"], 5000, "{line}");
    let call = host_call(line);
    assert_eq!((call.byte_budget, call.timeout_ms), (Some(100), Some(5000)));
}

#[test]
fn without_the_relay_dir_it_exits_2_naming_the_variable() {
    let mut child = Command::new(BIN)
        .env_remove("HARNESS_RELAY_DIR")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + WAIT;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            panic!("still running after {WAIT:?} without HARNESS_RELAY_DIR");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let output = child.wait_with_output().unwrap();
    assert_eq!(status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("HARNESS_RELAY_DIR"), "{stderr}");
    assert!(output.stdout.is_empty(), "stdout is the protocol");
}
