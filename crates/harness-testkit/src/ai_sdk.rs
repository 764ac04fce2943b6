//! The AI SDK (`ai` on npm, what `useChat` runs) as a judge of UI message
//! streams: installed once from the npm registry into
//! `$HARNESS_CACHE/npm/ai-sdk-check`, run by `node`.

use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;

/// Pinned so a new SDK release cannot change the tests under us.
pub const PACKAGES: &[&str] = &["ai@7.0.173", "ws@8.18.3"];

/// Whether `node` and `npm` run here.
pub fn tools_ok() -> bool {
    ["node", "npm"].iter().all(|bin| {
        Command::new(bin)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    })
}

/// The directory the SDK is installed in (installing it the first time).
pub fn sdk_dir() -> Result<PathBuf, String> {
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

/// Read the UI message stream at `url` (with `token` as bearer) to its
/// end with the SDK, which refuses any chunk its schema rejects; the
/// message `readUIMessageStream` built. `Ok(None)` after a skip (no node
/// or npm, or the SDK could not be installed; a failure under
/// `HARNESS_REQUIRE_REAL=1`).
pub async fn read_ui_stream(url: &str, token: Option<&str>) -> Result<Option<Value>, String> {
    if !tools_ok() {
        crate::skip_or_fail("node and npm are needed to run the AI SDK check");
        return Ok(None);
    }
    let dir = match sdk_dir() {
        Ok(d) => d,
        Err(e) => {
            crate::skip_or_fail(&format!("could not install the AI SDK: {e}"));
            return Ok(None);
        }
    };
    // ESM resolves imports next to the script, so it runs from the
    // package directory.
    let script = dir.join("ui_stream_read.mjs");
    std::fs::write(&script, include_str!("../js/ui_stream_read.mjs"))
        .map_err(|e| format!("{}: {e}", script.display()))?;
    let mut cmd = tokio::process::Command::new("node");
    cmd.arg(&script)
        .arg(url)
        .current_dir(&dir)
        .kill_on_drop(true);
    if let Some(token) = token {
        cmd.arg(token);
    }
    let out = tokio::time::timeout(std::time::Duration::from_secs(60), cmd.output())
        .await
        .map_err(|_| format!("the AI SDK did not finish reading {url} in 60 s"))?
        .map_err(|e| format!("node: {e}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let message = stdout
        .lines()
        .find_map(|l| l.strip_prefix("AI SDK MESSAGE "))
        .filter(|_| out.status.success())
        .ok_or_else(|| format!("the AI SDK rejected the stream:\n{stdout}\n{stderr}"))?;
    serde_json::from_str(message)
        .map(Some)
        .map_err(|e| format!("the message the SDK printed: {e}: {message}"))
}
