//! The in-process engine on the Docker sandbox: a turn killed with `kill -9`
//! at several points is finished by `harness resume` with a gap-free log and
//! no duplicated frame, and a turn longer than one slice completes across
//! slices. Real `claude` inside a real container (`HARNESS_TEST_IMAGE`),
//! real dockerd, scripted model on the host's bridge gateway address.

mod common;

use common::docker::*;
use common::harness;
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use harness_testkit::model::ScriptedModel;
use harness_testkit::require_env;

/// The claude binary and [`docker_parts`], or `None` after a skip.
fn claude_and_docker() -> Option<(String, IpAddr)> {
    require_env("HARNESS_CLAUDE_BIN")?;
    docker_parts()
}

fn run_args<'a>(image: &'a str, slice_ms: &'a str) -> [&'a str; 7] {
    [
        "run",
        "--sandbox",
        "docker",
        "--image",
        image,
        "--slice-ms",
        slice_ms,
    ]
}

/// Wait (polling) until `probe` holds, while the run is still alive.
async fn wait_for(
    what: &str,
    child: &mut std::process::Child,
    mut probe: impl FnMut() -> bool,
) -> Duration {
    let started = Instant::now();
    while !probe() {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "timed out waiting for: {what}"
        );
        assert!(
            child.try_wait().unwrap().is_none(),
            "the run ended before: {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    started.elapsed()
}

/// Where to kill the run, each after the agent process has started (its
/// claim file exists in the container).
#[derive(Debug, Clone, Copy)]
enum KillPoint {
    /// Shortly after the start: during the first model call or the tool's sleep.
    AfterStart(u64),
    /// As soon as the tool's output file appears: around the tool result.
    AtToolResult,
    /// This long after the tool's output file appeared: during the final text.
    AfterToolResult(u64),
}

#[tokio::test(flavor = "multi_thread")]
async fn docker_kill_nine_at_several_points_then_resume_finishes_the_turn_once() {
    let Some((image, gateway)) = claude_and_docker() else {
        return;
    };
    for point in [
        KillPoint::AfterStart(200),
        KillPoint::AtToolResult,
        KillPoint::AfterToolResult(1_000),
    ] {
        let round = Instant::now();
        let model = ScriptedModel::start_on(SocketAddr::new(gateway, 0), common::slow_script())
            .await
            .unwrap();
        let home = tempfile::tempdir().unwrap();
        let mut child = harness(home.path(), &model)
            .args(run_args(&image, "1000"))
            .arg("do the slow thing")
            .spawn()
            .unwrap();
        // The run creates the session first (the log's meta names its
        // config), then the turn makes its container.
        let mut session = None;
        wait_for("the session", &mut child, || {
            session = common::only_session(home.path(), &model);
            session.is_some()
        })
        .await;
        let row = session.unwrap();
        assert_eq!(
            (row.agent.as_str(), row.sandbox.as_str()),
            ("claude-code", "docker"),
            "{row:?}"
        );
        let _cleanup = SessionContainers(row.id.clone());
        let mut containers = Vec::new();
        wait_for("the session's container", &mut child, || {
            containers = session_containers(&row.id);
            !containers.is_empty()
        })
        .await;
        assert_eq!(containers.len(), 1, "one container: {containers:?}");
        let container = containers[0].clone();
        let workdir = container_workdir(&container);
        assert!(workdir.starts_with('/'), "{workdir:?}");
        // The agent's spool lives in the container's $HOME; its launch
        // writes the agent's pid there.
        wait_for("the agent's pid in its spool", &mut child, || {
            docker_sh(&container, "test -f \"$HOME/.harness/turns/t1/pid\"").0
        })
        .await;
        let tool_done = format!("test -f {workdir}/slow.txt");
        match point {
            KillPoint::AfterStart(ms) => tokio::time::sleep(Duration::from_millis(ms)).await,
            KillPoint::AtToolResult => {
                wait_for("the tool's file", &mut child, || {
                    docker_sh(&container, &tool_done).0
                })
                .await;
            }
            KillPoint::AfterToolResult(ms) => {
                wait_for("the tool's file", &mut child, || {
                    docker_sh(&container, &tool_done).0
                })
                .await;
                tokio::time::sleep(Duration::from_millis(ms)).await;
            }
        }
        assert!(
            child.try_wait().unwrap().is_none(),
            "the turn must still be running at {point:?}"
        );
        child.kill().unwrap(); // SIGKILL
        let killed = child.wait_with_output().unwrap();
        let killed_stderr = String::from_utf8_lossy(&killed.stderr).to_string();

        let out = harness(home.path(), &model).arg("resume").output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "resume after kill at {point:?} failed:\n{stderr}"
        );
        assert!(
            stderr.contains("resuming 1 unfinished turn"),
            "{stderr}\nthe killed run said:\n{killed_stderr}"
        );
        assert!(stderr.contains("turn t1 ended finished"), "{stderr}");

        let frames = common::export(home.path(), &model, &row.id);
        common::assert_stored_once(&frames, &format!("kill at {point:?}"));
        model.assert_no_failures();
        let row = common::only_session(home.path(), &model).unwrap();
        assert_eq!(
            (row.turns, row.last_turn.as_str()),
            (1, "t1 finished"),
            "{row:?}"
        );
        // The turn ended in the container its first slice made: resume
        // reattached to it and made no second one.
        let sandbox = common::recorded_sandbox(&frames);
        assert_eq!(
            (&sandbox["provider"], &sandbox["id"], &sandbox["workdir"]),
            (
                &serde_json::json!("docker"),
                &serde_json::json!(container),
                &serde_json::json!(workdir)
            ),
            "{sandbox:#}"
        );
        assert_eq!(session_containers(&row.id), vec![container.clone()]);
        // The agent ran its command in the container: the file is there.
        let (ok, content) = docker_sh(&container, &format!("cat {workdir}/slow.txt"));
        assert!(ok, "slow.txt is missing in the container");
        assert_eq!(content.trim(), "slow-done");
        eprintln!("kill at {point:?}: round took {:?}", round.elapsed());
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn docker_turn_longer_than_one_slice_completes_across_slices() {
    let Some((image, gateway)) = claude_and_docker() else {
        return;
    };
    let model = ScriptedModel::start_on(SocketAddr::new(gateway, 0), common::slow_script())
        .await
        .unwrap();
    let home = tempfile::tempdir().unwrap();
    let out = harness(home.path(), &model)
        .args(run_args(&image, "700"))
        .arg("do the slow thing")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let row = common::only_session(home.path(), &model);
    let _cleanup = row.as_ref().map(|r| SessionContainers(r.id.clone()));
    assert!(out.status.success(), "{stderr}");
    let row = row.expect("the run made a session");
    assert_eq!(
        (
            row.agent.as_str(),
            row.sandbox.as_str(),
            row.last_turn.as_str()
        ),
        ("claude-code", "docker", "t1 finished"),
        "{row:?}"
    );
    model.assert_no_failures();
    let slices: u32 = stderr
        .split("finished in ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .expect("the summary names the slice count");
    assert!(
        slices >= 5,
        "a ~7 s turn in 0.7 s slices took {slices} slice(s)"
    );
    // The tool ran inside the session's container, the one the turn
    // recorded.
    let frames = common::export(home.path(), &model, &row.id);
    let sandbox = common::recorded_sandbox(&frames);
    assert_eq!(sandbox["provider"], "docker", "{sandbox:#}");
    let container = sandbox["id"].as_str().unwrap();
    assert_eq!(session_containers(&row.id), vec![container.to_string()]);
    let workdir = sandbox["workdir"].as_str().unwrap();
    let (ok, content) = docker_sh(container, &format!("cat {workdir}/slow.txt"));
    assert!(ok, "slow.txt is missing in the container");
    assert_eq!(content.trim(), "slow-done");
}
