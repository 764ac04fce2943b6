//! `harness run --sandbox microvm`: a real codex turn in a QEMU microVM,
//! the model reached only through the session's model broker, whose socket
//! the microVM gets as a host forward on `127.0.0.1:47811`.

use std::process::{Command, Stdio};

use harness_testkit::model::{write_a_file_script, ScriptedModel};
use harness_testkit::{require_env, skip_or_fail};

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
    let model = ScriptedModel::start(write_a_file_script()).await.unwrap();
    let home = tempfile::tempdir().unwrap();
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
        .env("OPENAI_API_KEY", "test-key")
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
    // The request reached the model through the broker, with the broker's
    // key, never the sandbox's.
    assert_eq!(model.model_requests().len(), 2);
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
