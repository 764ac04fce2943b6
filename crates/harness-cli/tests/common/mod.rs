//! What the durability tests share: the slow scripted turn, the `harness`
//! command aimed at the scripted model, and the check that a turn's log is
//! gap-free with every part stored exactly once.

#![allow(dead_code)]

use std::path::Path;
use std::process::{Command, Stdio};

use harness_testkit::model::{
    any, last_is_tool_result_for, Reply, Rule, Script, ScriptedModel, BASH_CALL_ID,
};

/// The final answer, streamed in chunks 400 ms apart.
pub const FINAL_CHUNKS: [&str; 6] = ["The slow ", "task ", "is ", "done ", "and ", "verified."];

/// A turn of ~7 s: a Bash call that sleeps 5 s and writes `slow.txt`, then
/// the chunked answer (which asserts the tool result).
pub fn slow_script() -> Script {
    Script::new()
        .rule(
            Rule::new(
                last_is_tool_result_for(BASH_CALL_ID),
                Reply::text_chunks(FINAL_CHUNKS).with_delay(400),
            )
            .assert_tool_result_contains(BASH_CALL_ID, "slow-done"),
        )
        .rule(Rule::new(
            any(),
            Reply::shell(
                BASH_CALL_ID,
                "sleep 5; echo slow-done > slow.txt; cat slow.txt",
            ),
        ))
}

/// `harness --home HOME` with Claude Code pointed at `model`.
pub fn harness(home: &Path, model: &ScriptedModel) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_harness"));
    cmd.arg("--home")
        .arg(home)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .env("ANTHROPIC_API_KEY", "test-key")
        .env("ANTHROPIC_BASE_URL", model.base_url())
        .env("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1");
    cmd
}

/// `harness sessions export SESSION`, parsed.
pub fn export(home: &Path, model: &ScriptedModel, session: &str) -> Vec<serde_json::Value> {
    let out = harness(home, model)
        .args(["sessions", "export", session])
        .stdout(Stdio::piped())
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// The slow turn's log is gap-free and holds one prompt, one tool call, one
/// tool result, one finish, the whole answer once and one `finished` status.
pub fn assert_stored_once(frames: &[serde_json::Value], what: &str) {
    let seqs: Vec<u64> = frames.iter().map(|f| f["seq"].as_u64().unwrap()).collect();
    assert_eq!(
        seqs,
        (1..=frames.len() as u64).collect::<Vec<_>>(),
        "gap-free after {what}"
    );
    let count = |pred: &dyn Fn(&serde_json::Value) -> bool| {
        frames.iter().filter(|f| pred(&f["body"])).count()
    };
    let context = format!("{what}: {frames:#?}");
    let part = |kind: &'static str| {
        move |b: &serde_json::Value| b["type"] == "part" && b["part"]["type"] == kind
    };
    assert_eq!(count(&|b| b["type"] == "user-message"), 1, "{context}");
    assert_eq!(count(&part("tool-call")), 1, "one tool call: {context}");
    assert_eq!(count(&part("tool-result")), 1, "one tool result: {context}");
    assert_eq!(count(&part("finish")), 1, "one finish: {context}");
    let texts: Vec<&str> = frames
        .iter()
        .filter(|f| f["body"]["type"] == "message")
        .filter_map(|f| f["body"]["text"].as_str())
        .collect();
    assert_eq!(
        texts,
        vec![FINAL_CHUNKS.concat().as_str()],
        "the answer stored once and whole: {context}"
    );
    assert_eq!(
        count(&|b| b["type"] == "turn-status" && b["status"] == "finished"),
        1,
        "{context}"
    );
}
