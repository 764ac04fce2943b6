//! The README's paths from the `harness` binary alone: copied into an
//! empty directory (no helper binary beside it, no helper variable set —
//! what `cargo run -p harness-cli`, `cargo install` or a release archive
//! leaves a user with), `harness serve --demo` on a new home runs a Claude
//! Code turn in Docker, a Codex turn in a local sandbox, and a Codex turn
//! in Docker, each to `finished`.
//!
//! What it proves: the sandboxes' helpers (gate, approval server, host-tool
//! bridge) come from the multi-call binary itself, and a Docker session
//! with no image named gets the default image made on this machine
//! (`harness/debian:bookworm`: its rootfs from `$HARNESS_CACHE/images`,
//! where `cargo xtask image` left the same recipe, else debootstrapped).

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::docker::SessionContainers;
use common::server::ChildProcess;
use harness_testkit::skip_or_fail;
use serde_json::{json, Value};

/// Every variable that would hand the binary a helper from elsewhere.
const HELPER_VARS: [&str; 3] = [
    "HARNESS_SANDBOX_GATE_BIN",
    "HARNESS_APPROVAL_MCP_BIN",
    "HARNESS_RELAY_MCP_BIN",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_alone_serves_docker_and_codex_sessions() {
    if std::env::var_os("HARNESS_CLAUDE_BIN").is_none()
        || std::env::var_os("HARNESS_CODEX_BIN").is_none()
    {
        skip_or_fail("the claude and codex binaries (HARNESS_CLAUDE_BIN, HARNESS_CODEX_BIN)");
        return;
    }
    if !Command::new("docker")
        .args(["version", "--format", "{{.Server.Version}}"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
    {
        skip_or_fail("a Docker engine");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let bin = dir.path().join("bin");
    std::fs::create_dir(&bin).unwrap();
    let harness = bin.join("harness");
    std::fs::copy(env!("CARGO_BIN_EXE_harness"), &harness).unwrap();
    let home = dir.path().join("home");

    let mut cmd = Command::new(&harness);
    cmd.arg("--home")
        .arg(&home)
        .args(["serve", "--demo", "--addr", "127.0.0.1:0"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    for var in HELPER_VARS {
        cmd.env_remove(var);
    }
    let (tx, rx) = std::sync::mpsc::channel();
    let serve = ChildProcess::spawn(&mut cmd, "harness serve --demo", move |line| {
        if let Some(url) = line.strip_prefix("serving sessions on ") {
            let _ = tx.send(url.split_whitespace().next().unwrap_or("").to_string());
        }
    });
    let base = rx
        .recv_timeout(Duration::from_secs(120))
        .unwrap_or_else(|_| panic!("harness serve did not start:\n{}", serve.log()));

    // The sessions' Docker sandboxes outlive the server by design (they
    // are durable); they are this test's to remove, even when it fails.
    let _sandboxes = ["claude-docker", "codex-docker"].map(|s| SessionContainers(s.into()));
    let http = reqwest::Client::new();
    let sessions = [
        (
            "claude-docker",
            json!({"id": "claude-docker", "sandbox": "docker"}),
        ),
        (
            "codex-local",
            json!({"id": "codex-local", "agent": "codex"}),
        ),
        (
            "codex-docker",
            json!({"id": "codex-docker", "agent": "codex", "sandbox": "docker"}),
        ),
    ];
    for (id, body) in &sessions {
        let r = http
            .post(format!("{base}/v1/sessions"))
            .json(body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 201, "create {id}: {}", r.text().await.unwrap());
        let r = http
            .post(format!("{base}/v1/sessions/{id}/messages"))
            .json(&json!({"type": "prompt", "text": "hello"}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "prompt {id}: {}", r.text().await.unwrap());
    }
    // The three turns run side by side; the first Docker one makes the
    // default image and both agents' bootstraps.
    let deadline = Instant::now() + Duration::from_secs(600);
    for (id, _) in &sessions {
        let turn = loop {
            let info: Value = http
                .get(format!("{base}/v1/sessions/{id}"))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            let turn = info["meta"]["turn"].clone();
            if matches!(
                turn["status"].as_str(),
                Some("finished" | "failed" | "timed_out")
            ) {
                break turn;
            }
            assert!(
                Instant::now() < deadline,
                "{id}'s turn did not end: {turn}\n{}",
                serve.log()
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        };
        assert_eq!(turn["status"], "finished", "{id}: {turn}\n{}", serve.log());
        // The demo's Bash call wrote hello.txt and its result came back.
        let frames: Vec<Value> = http
            .get(format!("{base}/v1/sessions/{id}/export"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert!(
            frames
                .iter()
                .any(|f| f["body"]["part"]["type"] == "tool-result"),
            "{id} ran no tool: {frames:#?}"
        );
    }
    // The helpers were this binary under their names, not found elsewhere.
    for name in [
        "harness-sandbox-gate",
        "harness-approval-mcp",
        "harness-relay-mcp",
    ] {
        let link = home.join("helpers").join(name);
        assert_eq!(
            std::fs::read_link(&link).unwrap_or_else(|e| panic!("{}: {e}", link.display())),
            harness,
            "{name}"
        );
    }
    // The default image carries the recipe it was made from.
    let out = Command::new("docker")
        .args([
            "image",
            "inspect",
            "--format",
            "{{ index .Config.Labels \"harness.recipe\" }}",
            "harness/debian:bookworm",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success() && !String::from_utf8_lossy(&out.stdout).trim().is_empty(),
        "the default image is missing or unlabelled: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    drop(serve);
    // The home's detached broker (`harness broker serve`) outlives the
    // server by design; it is this test's to stop.
    let _ = Command::new("pkill")
        .arg("-f")
        .arg(format!("{} broker serve", harness.display()))
        .status();
}
