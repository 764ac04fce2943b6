//! The UI message stream checked by the AI SDK package itself (`ai` on npm,
//! what `useChat` runs): `tests/js/ui_stream_check.mjs` parses `/ui-stream`
//! with `parseJsonEventStream` + `uiMessageChunkSchema`, folds it with
//! `readUIMessageStream`, and asserts the message, live and replayed.
//!
//! Needs `node` and `npm`; the packages are installed once into
//! `$HARNESS_CACHE/npm/ai-sdk-check` (or a temp dir) from the npm registry
//! (`harness_testkit::ai_sdk`).

mod common;

use harness_testkit::ai_sdk::{sdk_dir, tools_ok};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ai_sdk_accepts_the_ui_message_stream() {
    if !tools_ok() {
        harness_testkit::skip_or_fail("node and npm are needed to run the AI SDK check");
        return;
    }
    let dir = match sdk_dir() {
        Ok(d) => d,
        Err(e) => {
            harness_testkit::skip_or_fail(&format!("could not install the AI SDK: {e}"));
            return;
        }
    };
    // ESM resolves imports next to the script, so the script runs from the
    // package directory.
    let script = dir.join("ui_stream_check.mjs");
    std::fs::write(&script, include_str!("js/ui_stream_check.mjs")).unwrap();
    let srv = common::start(|_| {}).await;
    let out = tokio::process::Command::new("node")
        .arg(&script)
        .arg(&srv.base)
        .current_dir(&dir)
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}");
    assert!(
        out.status.success() && stdout.contains("AI SDK CHECK OK"),
        "the AI SDK rejected the stream:\n{stdout}\n{stderr}"
    );
}
