//! The in-process engine survives `kill -9`: a turn killed at several points
//! is finished by `harness resume` with a gap-free log and no duplicated
//! frame. Real `claude`, real local sandbox, scripted model.

mod common;

use common::harness;
use std::path::Path;
use std::time::Duration;

use harness_testkit::model::ScriptedModel;
use harness_testkit::require_env;

/// The agent's pid in its spool, once the slice has launched it.
fn agent_started(home: &Path) -> Option<std::path::PathBuf> {
    for sandbox in std::fs::read_dir(home.join("sandboxes")).ok()? {
        let path = sandbox.ok()?.path().join("home/.harness/turns/t1/pid");
        if path.exists() {
            return Some(path);
        }
    }
    None
}

#[tokio::test(flavor = "multi_thread")]
async fn kill_nine_at_several_points_then_resume_finishes_the_turn_once() {
    if require_env("HARNESS_CLAUDE_BIN").is_none() {
        return;
    }
    // Offsets after the agent process has started (the claim file exists):
    // during the tool's sleep, around its result, during the final text.
    for kill_after_ms in [200u64, 4_500, 6_000] {
        let model = ScriptedModel::start(common::slow_script()).await.unwrap();
        let home = tempfile::tempdir().unwrap();
        let mut child = harness(home.path(), &model)
            .args(["run", "--slice-ms", "1000", "do the slow thing"])
            .spawn()
            .unwrap();
        let started = std::time::Instant::now();
        while agent_started(home.path()).is_none() {
            assert!(
                started.elapsed() < Duration::from_secs(120),
                "the agent never started"
            );
            assert!(
                child.try_wait().unwrap().is_none(),
                "the run ended before its agent started"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        tokio::time::sleep(Duration::from_millis(kill_after_ms)).await;
        assert!(
            child.try_wait().unwrap().is_none(),
            "the turn must still be running at {kill_after_ms} ms"
        );
        child.kill().unwrap(); // SIGKILL
        let killed = child.wait_with_output().unwrap();
        let killed_stderr = String::from_utf8_lossy(&killed.stderr).to_string();

        let out = harness(home.path(), &model).arg("resume").output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "resume after kill at {kill_after_ms} ms failed:\n{stderr}"
        );
        assert!(
            stderr.contains("resuming 1 unfinished turn"),
            "{stderr}\nthe killed run said:\n{killed_stderr}"
        );
        assert!(stderr.contains("turn t1 ended finished"), "{stderr}");

        // The session, as the log's meta tells it.
        let row = common::only_session(home.path(), &model).expect("the run made a session");
        assert_eq!(
            (row.agent.as_str(), row.sandbox.as_str(), row.turns),
            ("claude-code", "local", 1),
            "{row:?}"
        );
        assert_eq!(row.last_turn, "t1 finished", "{row:?}");
        let frames = common::export(home.path(), &model, &row.id);
        assert_eq!(row.frames, frames.len() as u64, "{row:?}");
        common::assert_stored_once(&frames, &format!("kill at {kill_after_ms} ms"));
        assert!(model.failures().is_empty(), "{:?}", model.failures());
        // The turn kept the sandbox its first slice made (resume made no
        // second one), under the home's sandboxes with the tree at work/.
        let sandbox = common::recorded_sandbox(&frames);
        assert_eq!(sandbox["provider"], "local", "{sandbox:#}");
        let id = sandbox["id"].as_str().unwrap();
        let dir = home.path().join("sandboxes").join(id);
        assert_eq!(
            sandbox["workdir"].as_str().map(Path::new),
            Some(dir.join("work").as_path()),
            "{sandbox:#}"
        );
        assert_eq!(
            common::local_sandboxes(home.path()),
            vec![id.to_string()],
            "one sandbox for the session"
        );
        // The agent ran its command once: the tool result is in the log once
        // and the file exists.
        assert_eq!(
            std::fs::read_to_string(dir.join("work/slow.txt"))
                .unwrap()
                .trim(),
            "slow-done"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_turn_longer_than_one_slice_completes_across_slices() {
    if require_env("HARNESS_CLAUDE_BIN").is_none() {
        return;
    }
    let model = ScriptedModel::start(common::slow_script()).await.unwrap();
    let home = tempfile::tempdir().unwrap();
    let out = harness(home.path(), &model)
        .args(["run", "--slice-ms", "700", "do the slow thing"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
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
}

/// Every slice tells the model broker its turn still runs (`turn_running`):
/// the session's mark in `<home>/broker/active/`, made two hours old while
/// the agent waits on its 6-second tool call (no model call meanwhile), is
/// fresh again within a few 0.7 s slices. A broker counts a mark nothing
/// refreshed for an hour as a runner killed for good (docs/broker.md).
#[tokio::test(flavor = "multi_thread")]
async fn every_slice_refreshes_the_turns_broker_mark() {
    if require_env("HARNESS_CLAUDE_BIN").is_none() {
        return;
    }
    let model = ScriptedModel::start(common::slow_script_sleeping(6))
        .await
        .unwrap();
    let home = tempfile::tempdir().unwrap();
    let mut run = harness(home.path(), &model)
        .args(["run", "--slice-ms", "700", "do the slow thing"])
        .spawn()
        .unwrap();
    let active = home.path().join("broker/active");
    let mark_age = |mark: &Path| {
        std::fs::metadata(mark)
            .and_then(|m| m.modified())
            .map(|t| t.elapsed().unwrap_or_default())
    };
    // The agent asked the model once (it got the tool call) and has a mark.
    let started = std::time::Instant::now();
    let mark = loop {
        let mark = std::fs::read_dir(&active)
            .ok()
            .and_then(|mut d| d.next())
            .and_then(|e| e.ok())
            .map(|e| e.path());
        if let (Some(mark), 1) = (mark, model.requests().len()) {
            break mark;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the agent did not start"
        );
        assert!(run.try_wait().unwrap().is_none(), "the run ended early");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let two_hours_ago = std::time::SystemTime::now() - Duration::from_secs(7200);
    std::fs::File::options()
        .write(true)
        .open(&mark)
        .unwrap()
        .set_modified(two_hours_ago)
        .unwrap();
    let aged = std::time::Instant::now();
    while mark_age(&mark).unwrap() > Duration::from_secs(60) {
        assert!(
            aged.elapsed() < Duration::from_secs(4),
            "no slice refreshed the turn's mark in 4 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        model.requests().len(),
        1,
        "a model call, not a slice, refreshed the mark"
    );
    let status = tokio::task::spawn_blocking(move || run.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    assert!(
        status.status.success(),
        "{}",
        String::from_utf8_lossy(&status.stderr)
    );
    assert!(!mark.exists(), "the turn's end removes its mark");
}
