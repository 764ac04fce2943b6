//! The UI message stream checked by the AI SDK package itself (`ai` on npm,
//! what `useChat` runs): `tests/js/ui_stream_check.mjs` parses `/ui-stream`
//! with `parseJsonEventStream` + `uiMessageChunkSchema`, folds it with
//! `readUIMessageStream`, and asserts the message, live and replayed.
//!
//! Needs `node` and `npm`; the packages are installed once into
//! `$HARNESS_CACHE/npm/ai-sdk-check` (or a temp dir) from the npm registry.

mod common;

use std::path::PathBuf;
use std::process::Command;

/// Pinned so a new SDK release cannot change the test under us.
const PACKAGES: &[&str] = &["ai@7.0.173", "ws@8.18.3"];

fn tool_ok(bin: &str) -> bool {
    Command::new(bin)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

fn sdk_dir() -> Result<PathBuf, String> {
    let root = std::env::var("HARNESS_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|_| std::env::temp_dir());
    let dir = root.join("npm").join("ai-sdk-check");
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    if !dir.join("node_modules/ai/package.json").exists() {
        std::fs::write(
            dir.join("package.json"),
            r#"{"name":"ai-sdk-check","private":true}"#,
        )
        .map_err(|e| e.to_string())?;
        let out = Command::new("npm")
            .args(["install", "--no-audit", "--no-fund", "--silent"])
            .args(PACKAGES)
            .current_dir(&dir)
            .output()
            .map_err(|e| format!("npm: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "npm install {PACKAGES:?} failed: {}",
                String::from_utf8_lossy(&out.stderr)
            ));
        }
    }
    Ok(dir)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ai_sdk_accepts_the_ui_message_stream() {
    if !tool_ok("node") || !tool_ok("npm") {
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
