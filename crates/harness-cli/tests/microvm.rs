//! `harness run --sandbox microvm`: a real codex turn in a QEMU microVM,
//! the model reached only through the session's model broker, whose socket
//! the microVM gets as a host forward on `127.0.0.1:47811`.
//!
//! The agent's tool call probes the VM from inside (issue 39's boundary, as
//! `broker.rs` does for local and Docker sandboxes): the harness home and
//! its broker secret are out of reach, the real key (the user's
//! environment's `OPENAI_API_KEY`) is in no process's environment or
//! command line and no file the VM holds, and the broker refuses another
//! session's token and another session's endpoint.

mod common;

use std::process::{Command, Stdio};

use common::probe::ProbeApi;
use harness_testkit::model::{last_is_tool_result_for, last_user_text_contains};
use harness_testkit::model::{Reply, Rule, Script, ScriptedModel, ToolCall};
use harness_testkit::{require_env, skip_or_fail};
use serde_json::json;

const REAL_OPENAI_KEY: &str = "sk-proj-microvm-REAL-KEY-3d9e01b7aa";
const PROBE: &str = "call_probe_microvm";

/// What the agent runs inside the VM (the key reaches it through
/// `common::probe::keys_into_file`).
fn probe(home: &std::path::Path, other_session: &str, other_token: &str) -> String {
    let key = common::probe::keys_into_file(&[REAL_OPENAI_KEY]);
    let refusals = common::probe::broker_refusals(ProbeApi::OpenAi, other_session, other_token);
    format!(
        r#"{key}
cat {home}/broker/secret >/dev/null 2>&1 && echo SECRET-READ || echo SECRET-UNREADABLE
ls -A {home} >/dev/null 2>&1 && echo HOME-LISTED || echo HOME-UNSEEN
n=0
for p in /proc/[0-9]*; do
  n=$((n+1))
  for f in environ cmdline; do
    grep -qaFf $k $p/$f 2>/dev/null && echo "KEY-IN-PROC $p/$f"
  done
done
echo "PROCESSES-SEARCHED $n"
grep -rlaFf $k "$HOME" "$PWD" /tmp /etc /run 2>/dev/null | grep -vxF $k | sed 's/^/KEY-IN-FILE /'
: > $k
{refusals}
echo "PROBE-DONE in $SECONDS s""#,
        home = home.display(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(feature = "microvm"),
    ignore = "needs the `microvm` feature (cargo test -p harness-cli --features microvm; CI builds --features full)"
)]
async fn run_in_a_microvm_sandbox_goes_through_the_broker() {
    if require_env("HARNESS_CODEX_BIN").is_none() {
        return;
    }
    let cache = std::env::var("HARNESS_CACHE").unwrap_or_else(|_| "/var/cache/harness".into());
    let assets =
        std::env::var("HARNESS_MICROVM_ASSETS").unwrap_or_else(|_| format!("{cache}/microvm"));
    if !std::path::Path::new(&assets).join("assets.json").exists() {
        skip_or_fail(&format!(
            "no microVM guest in {assets} (cargo xtask microvm)"
        ));
        return;
    }
    let home = tempfile::tempdir().unwrap();
    // Another session, mid-turn, with a valid token.
    let other_session = "other-session-vm";
    let other_token = common::probe::other_session_token(home.path(), other_session);
    let script = Script::new()
        .rule(Rule::new(
            last_is_tool_result_for(PROBE),
            Reply::text("Wrote it."),
        ))
        .on(
            last_user_text_contains("write a file"),
            // Codex hands back a command still running after 10 s unless
            // told to wait longer; the probe reads every process of the VM.
            Reply::tool(ToolCall::per_api(
                PROBE,
                ("Bash", json!({"command": "true"})),
                (
                    "exec_command",
                    json!({
                        "cmd": probe(home.path(), other_session, &other_token),
                        "yield_time_ms": 120_000,
                    }),
                ),
            )),
        );
    let model = ScriptedModel::start(script).await.unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_harness"));
    cmd.arg("--home")
        .arg(home.path())
        .args([
            "run",
            "--sandbox",
            "microvm",
            "--agent",
            "codex",
            "write a file",
        ])
        .stdin(Stdio::null())
        .env_remove("ANTHROPIC_API_KEY")
        .env_remove("HARNESS_HOME")
        .env("OPENAI_API_KEY", REAL_OPENAI_KEY)
        .env("OPENAI_BASE_URL", model.v1_url())
        .env("HARNESS_MICROVM_ASSETS", &assets)
        // The codex snapshot (a 315 MB copy into the guest) is shared with
        // sandbox-microvm's own tests.
        .env(
            "HARNESS_MICROVM_STATE",
            format!("{cache}/microvm-sandboxes"),
        );
    let out = tokio::task::spawn_blocking(move || cmd.output().unwrap())
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("Wrote it."), "{stdout}\n{stderr}");
    assert!(model.failures().is_empty(), "{:?}", model.failures());
    // The request reached the model through the broker, with the real
    // key, never a session token.
    let requests: Vec<_> = model
        .requests()
        .into_iter()
        .filter(|r| r.api.is_some())
        .collect();
    assert_eq!(requests.len(), 2);
    for r in &requests {
        assert_eq!(
            r.header("authorization"),
            Some(format!("Bearer {REAL_OPENAI_KEY}").as_str())
        );
    }
    let report = requests
        .iter()
        .filter_map(|r| r.model_request())
        .find_map(|r| r.tool_result(PROBE))
        .expect("the probe's result reached the model")
        .content;
    println!("the probe's report:\n{report}");
    common::probe::assert_keeps_the_key_out(&report, 3);
    assert!(report.contains("SECRET-UNREADABLE"), "{report}");
    assert!(report.contains("HOME-UNSEEN"), "{report}");
    let session = stderr
        .split_whitespace()
        .skip_while(|w| *w != "--session")
        .nth(1)
        .expect("run prints how to continue")
        .to_string();
    // The sandbox is the microVM, recorded with its directory; the VM
    // outlives the command (it waits for the next turn): stop it here.
    let out = Command::new(env!("CARGO_BIN_EXE_harness"))
        .arg("--home")
        .arg(home.path())
        .args(["sessions", "show", &session, "--json"])
        .output()
        .unwrap();
    let shown: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let handle = &shown["sandbox"]["handle"];
    assert_eq!(handle["provider"], "microvm", "{shown:#}");
    let dir = std::path::PathBuf::from(handle["data"]["dir"].as_str().expect("the VM's directory"));
    if let Ok(pid) = std::fs::read_to_string(dir.join("qemu.pid")) {
        let _ = Command::new("kill").arg(pid.trim()).status();
    }
    std::thread::sleep(std::time::Duration::from_millis(500));
    let _ = std::fs::remove_dir_all(&dir);
}
