//! The approval hook script on its own: run with `sh` (and `bash` when the
//! host has it; Codex runs hooks with `$SHELL -c`) on the hook input Codex
//! 0.171.0 was observed to send, against answers written the way the slice
//! runner writes them. No Codex binary needed.
//!
//! What matters most is that the script fails closed: Codex lets a call run
//! when its hook exits 1, prints what it cannot parse, exits 2 with an empty
//! stderr or times out, so every way of not approving must be exit 2 with a
//! non-empty stderr.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use harness_codex::{approval_hook_script, SHELL_TOOL_NAME};
use serde_json::{json, Value};

/// What Codex wrote to the hook's stdin for an `exec_command` call (observed,
/// paths shortened).
const INPUT: &str = r#"{"session_id":"01a22d21-292e-7221-9c63-26550f90745c","turn_id":"01a22d21-2946-7563-8d84-4ef224cc3563","transcript_path":"/h/.codex/sessions/2026/11/30/rollout-x.jsonl","cwd":"/workspace","hook_event_name":"PreToolUse","model":"gpt-test","permission_mode":"bypassPermissions","tool_name":"Bash","tool_input":{"command":"echo \"tool_input\": > x && echo done"},"tool_use_id":"call_plain"}"#;

fn shells() -> Vec<&'static str> {
    ["sh", "bash"]
        .into_iter()
        .filter(|s| {
            Command::new(s)
                .args(["-c", "true"])
                .status()
                .is_ok_and(|st| st.success())
        })
        .collect()
}

fn scratch(name: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("harness-codex-hook-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn start(shell: &str, approvals: &Path, wait_secs: u64, input: &str) -> Child {
    let script = approval_hook_script(approvals.to_str().unwrap(), wait_secs);
    let mut child = Command::new(shell)
        .args(["-c", &script])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    child
}

/// The request lines written so far, parsed.
fn requests(approvals: &Path) -> Vec<Value> {
    std::fs::read_to_string(approvals.join("requests.jsonl"))
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad line {l:?}: {e}")))
        .collect()
}

fn wait_request(approvals: &Path) -> Value {
    let started = Instant::now();
    loop {
        if let Some(r) = requests(approvals).pop() {
            return r;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "no request written"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Write the answer exactly as `SliceRunner::deliver_answers` does.
fn answer(approvals: &Path, id: &str, approved: bool, reason: Option<&str>) {
    let body = serde_json::to_vec(&json!({ "approved": approved, "reason": reason })).unwrap();
    std::fs::write(approvals.join("answers").join(format!("{id}.json")), body).unwrap();
}

fn finish(child: Child) -> (i32, String) {
    let Output { status, stderr, .. } = child.wait_with_output().unwrap();
    (
        status.code().expect("exited"),
        String::from_utf8(stderr).unwrap(),
    )
}

#[test]
fn request_line_is_what_the_slice_runner_reads_and_approval_lets_the_call_run() {
    for shell in shells() {
        let dir = scratch(&format!("approve-{shell}"));
        let approvals = dir.join("turn/relay");
        let child = start(shell, &approvals, 60, INPUT);
        let req = wait_request(&approvals);
        let id = req["approvalId"].as_str().unwrap().to_string();
        assert!(id.starts_with("codex-"), "{req}");
        assert!(
            id.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_'),
            "file-name safe: {id}"
        );
        assert_eq!(req["toolName"], SHELL_TOOL_NAME, "{req}");
        assert_eq!(req["toolUseId"], "call_plain");
        // The nested "tool_input": inside the command is data, not the key.
        assert_eq!(
            req["input"],
            json!({"command": "echo \"tool_input\": > x && echo done"})
        );
        assert_eq!(req["hook_event_name"], "PreToolUse");
        // The line the slice reads: a typed relay request.
        let typed: harness_core::relay::files::RelayRequest =
            serde_json::from_value(req.clone()).unwrap();
        assert!(
            matches!(&typed, harness_core::relay::files::RelayRequest::Approval(a) if a.approval_id == id && a.tool_name == SHELL_TOOL_NAME),
            "{typed:?}"
        );
        answer(&approvals, &id, true, None);
        let (code, stderr) = finish(child);
        assert_eq!((code, stderr.as_str()), (0, ""), "{shell}");
        assert!(!approvals.join("requests.lock").exists(), "lock released");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn denial_blocks_with_the_reason_on_stderr() {
    for shell in shells() {
        let dir = scratch(&format!("deny-{shell}"));
        let child = start(shell, &dir, 60, INPUT);
        let id = wait_request(&dir)["approvalId"]
            .as_str()
            .unwrap()
            .to_string();
        let reason = r#"not "that" file \ please"#;
        answer(&dir, &id, false, Some(reason));
        let (code, stderr) = finish(child);
        assert_eq!(code, 2, "{shell}: {stderr}");
        assert_eq!(stderr, format!("{reason}\n"), "{shell}");

        // No reason (or only blanks): a default text, never an empty stderr
        // (exit 2 with an empty stderr lets the call run).
        for (n, none) in [None, Some(""), Some("  ")].into_iter().enumerate() {
            let dir = dir.join(n.to_string());
            let child = start(shell, &dir, 60, INPUT);
            let id = wait_request(&dir)["approvalId"]
                .as_str()
                .unwrap()
                .to_string();
            answer(&dir, &id, false, none);
            let (code, stderr) = finish(child);
            assert_eq!(code, 2, "{shell} {none:?}");
            assert_eq!(
                stderr, "The user denied this tool call.\n",
                "{shell} {none:?}"
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn no_answer_in_time_denies() {
    for shell in shells() {
        let dir = scratch(&format!("late-{shell}"));
        let started = Instant::now();
        let (code, stderr) = finish(start(shell, &dir, 1, INPUT));
        assert_eq!(code, 2, "{shell}");
        assert!(stderr.contains("no answer within 1 s"), "{shell}: {stderr}");
        assert!(started.elapsed() < Duration::from_secs(10));
        assert_eq!(requests(&dir).len(), 1, "the request was still recorded");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn unexpected_input_or_an_unwritable_directory_denies() {
    for shell in shells() {
        let dir = scratch(&format!("bad-{shell}"));
        for input in ["", "not json", "{}", "[1]"] {
            let (code, stderr) = finish(start(shell, &dir, 60, input));
            assert_eq!(code, 2, "{shell} {input:?}");
            assert!(!stderr.trim().is_empty(), "{shell} {input:?}");
        }
        assert!(requests(&dir).is_empty(), "nothing recorded");

        // The approvals directory cannot be created (a file is in the way).
        let blocked = dir.join("file");
        std::fs::write(&blocked, "x").unwrap();
        let (code, stderr) = finish(start(shell, &blocked.join("approvals"), 60, INPUT));
        assert_eq!(code, 2, "{shell}");
        assert!(stderr.contains("harness approval:"), "{shell}: {stderr}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn concurrent_calls_each_get_a_whole_line_and_their_own_answer() {
    for shell in shells() {
        let dir = scratch(&format!("parallel-{shell}"));
        let big = "y".repeat(20_000);
        let inputs: Vec<String> = (0..4)
            .map(|i| INPUT.replace("echo done", &format!("echo {i} {big}")))
            .collect();
        let children: Vec<Child> = inputs.iter().map(|i| start(shell, &dir, 60, i)).collect();
        let reqs = loop {
            let r = requests(&dir);
            if r.len() == 4 {
                break r;
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let mut ids: Vec<String> = reqs
            .iter()
            .map(|r| r["approvalId"].as_str().unwrap().to_string())
            .collect();
        ids.sort();
        ids.dedup();
        assert_eq!(ids.len(), 4, "distinct ids: {ids:?}");
        for r in &reqs {
            let id = r["approvalId"].as_str().unwrap();
            let command = r["input"]["command"].as_str().unwrap();
            let n: usize = command.split("&& echo ").nth(1).unwrap()[..1]
                .parse()
                .unwrap();
            answer(&dir, id, n.is_multiple_of(2), Some("odd"));
        }
        for (i, child) in children.into_iter().enumerate() {
            let (code, _) = finish(child);
            assert_eq!(
                code,
                if i.is_multiple_of(2) { 0 } else { 2 },
                "{shell} call {i}"
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
