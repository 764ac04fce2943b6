//! Turn-end checkpoints, forks with the tree, rewinds and sandboxes that
//! are gone — through the built binary, with the real `claude` and the real
//! `codex` against the scripted model, real dockerd and the test image.
//!
//! Turn 1 writes `a.txt`, turn 2 writes `b.txt`. A fork at turn 1's end on
//! Docker must see `a.txt` and not `b.txt`, and its agent's next request
//! must carry turn 1's conversation and not turn 2's (the scripted model
//! asserts it); the parent's turn 3 still has both. A rewind of the parent
//! to turn 1's end: the same checks, in place. Then the fork's container is
//! removed (`docker rm -f`) or the parent's local sandbox directory deleted,
//! and the next prompt finishes in a sandbox made anew from the last
//! turn-end checkpoint, conversation intact. Bad input changes nothing.

mod common;

use common::docker::{docker_parts, session_containers, SessionContainers};
use common::{continued_session as session_of, Ran};

use std::net::SocketAddr;
use std::path::Path;

use harness_testkit::model::{
    last_is_tool_result_for, last_user_text_contains, ModelRequest, Reply, Rule, Script,
    ScriptedModel,
};
use harness_testkit::require_env;
use serde_json::Value;

/// A check that no user message of the request contains `s`: the turns a
/// fork or rewind left behind must not reach the model.
fn lacks_user_text(s: &'static str) -> impl Fn(&ModelRequest) -> Result<(), String> {
    move |req| match req.user_texts().iter().find(|t| t.contains(s)) {
        Some(t) => Err(format!("a user message still carries {s:?}: {t:?}")),
        None => Ok(()),
    }
}

/// The listing `ls` returned for `call` holds `has` and not `lacks`.
fn listing(
    call: &'static str,
    has: &'static str,
    lacks: Option<&'static str>,
) -> impl Fn(&ModelRequest) -> Result<(), String> {
    move |req| {
        let r = req
            .tool_result(call)
            .ok_or_else(|| format!("no tool result for {call}"))?;
        if !r.content.contains(has) {
            return Err(format!("{call}: {has} missing from {:?}", r.content));
        }
        match lacks {
            Some(l) if r.content.contains(l) => {
                Err(format!("{call}: {l} present in {:?}", r.content))
            }
            _ => Ok(()),
        }
    }
}

/// One `ls` turn: asked by `prompt`, answered with `answer` once the
/// listing holds `has` and not `lacks`; the request carries `remembers`
/// and none of `forgets`.
#[allow(clippy::too_many_arguments)]
fn ls_turn(
    script: Script,
    prompt: &'static str,
    call: &'static str,
    answer: &'static str,
    remembers: &'static str,
    forgets: &[&'static str],
    has: &'static str,
    lacks: Option<&'static str>,
) -> Script {
    let mut ask = Rule::new(last_user_text_contains(prompt), Reply::shell(call, "ls"))
        .assert_user_texts_contain(remembers);
    for f in forgets {
        ask = ask.assert_fn(lacks_user_text(f));
    }
    script
        .rule(
            Rule::new(last_is_tool_result_for(call), Reply::text(answer))
                .assert_fn(listing(call, has, lacks)),
        )
        .rule(ask)
}

fn script() -> Script {
    let s = Script::new()
        .on(
            last_is_tool_result_for("call_a_t1"),
            Reply::text("First answer alpha."),
        )
        .on(
            last_user_text_contains("first question"),
            Reply::shell("call_a_t1", "echo alpha > a.txt && echo wrote-a"),
        )
        .on(
            last_is_tool_result_for("call_b_t2"),
            Reply::text("Second answer beta."),
        )
        .rule(
            Rule::new(
                last_user_text_contains("second question"),
                Reply::shell("call_b_t2", "echo beta > b.txt && echo wrote-b"),
            )
            .assert_user_texts_contain("first question"),
        );
    // The fork at turn 1's end: turn 1 remembered, turn 2 not; a.txt only.
    let s = ls_turn(
        s,
        "fork question",
        "call_ls_fork",
        "Fork answer.",
        "first question",
        &["second question"],
        "a.txt",
        Some("b.txt"),
    );
    // The parent goes on untouched: turn 2 remembered, both files.
    let s = ls_turn(
        s,
        "third question",
        "call_ls_t3",
        "Third answer.",
        "second question",
        &[],
        "b.txt",
        None,
    );
    // Rewound in place to turn 1's end.
    let s = ls_turn(
        s,
        "rewound question",
        "call_ls_rw",
        "Rewound answer.",
        "first question",
        &["second question", "third question"],
        "a.txt",
        Some("b.txt"),
    );
    // After retention ran: the fork's last checkpoint still makes a sandbox.
    let s = ls_turn(
        s,
        "after gc question",
        "call_ls_gc",
        "After-gc answer.",
        "fork question",
        &["second question"],
        "a.txt",
        Some("b.txt"),
    );
    // After the sandbox was lost: the conversation up to the last turn end.
    ls_turn(
        s,
        "after loss question",
        "call_ls_lost",
        "After-loss answer.",
        "question",
        &[],
        "a.txt",
        Some("b.txt"),
    )
}

/// Run `harness --home HOME ARGS…` with the agent aimed at `model`, the
/// home's directory store for checkpoints (not the S3 store the
/// environment names for other tests).
async fn harness(home: &Path, model: &ScriptedModel, args: &[&str]) -> Ran {
    let mut cmd = common::harness(home, model);
    cmd.env_remove("HARNESS_S3_ENDPOINT")
        .env_remove("HARNESS_R2_ACCOUNT_ID")
        .env("OPENAI_API_KEY", "test-key")
        .env("OPENAI_BASE_URL", model.v1_url())
        .args(args);
    common::run_to_end(cmd).await
}

/// The terminal `turn-status` frames of `session`: (turn, seq, checkpoint).
fn turn_ends(
    home: &Path,
    model: &ScriptedModel,
    session: &str,
) -> Vec<(String, u64, Option<String>)> {
    common::export(home, model, session)
        .into_iter()
        .filter(|f| f["body"]["type"] == "turn-status")
        .filter(|f| {
            matches!(
                f["body"]["status"].as_str(),
                Some("finished" | "failed" | "timed_out" | "canceled")
            )
        })
        .map(|f| {
            (
                f["body"]["turnId"].as_str().unwrap_or_default().to_string(),
                f["seq"].as_u64().unwrap_or_default(),
                f["body"]["checkpoint"].as_str().map(str::to_string),
            )
        })
        .collect()
}

async fn show(home: &Path, model: &ScriptedModel, session: &str) -> Value {
    let out = harness(home, model, &["sessions", "show", session, "--json"])
        .await
        .expect_ok("sessions show --json")
        .all();
    let json = out
        .lines()
        .find(|l| l.starts_with('{'))
        .map_or(out.as_str(), |_| {
            &out[out.find('{').unwrap_or(0)..out.rfind('}').map_or(out.len(), |i| i + 1)]
        });
    serde_json::from_str(json).unwrap_or_else(|e| panic!("sessions show --json ({e}):\n{out}"))
}

/// The whole path for one agent. See the module docs.
async fn forks_and_rewinds(agent: &str) {
    let Some((image, gateway)) = docker_parts() else {
        return;
    };
    // On the bridge gateway: reachable from local sandboxes and containers.
    let model = ScriptedModel::start_on(SocketAddr::new(gateway, 0), script())
        .await
        .unwrap();
    let home = tempfile::tempdir().unwrap();
    let home = home.path();
    let run = |prompt: &'static str, session: Option<String>| {
        let mut args: Vec<String> = vec!["run".into(), "--agent".into(), agent.into()];
        args.extend(["--image".into(), image.clone()]);
        if let Some(s) = session {
            args.extend(["--session".into(), s]);
        }
        args.push(prompt.into());
        args
    };
    let m = &model;
    let go = |args: Vec<String>| async move {
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        harness(home, m, &refs).await
    };

    // Turns 1 and 2 in a local sandbox, each checkpointed as it ends.
    let out = go(run("first question", None))
        .await
        .expect_ok("turn 1")
        .all();
    assert!(out.contains("First answer alpha."), "{out}");
    let a = session_of(&out);
    let out = go(run("second question", Some(a.clone())))
        .await
        .expect_ok("turn 2")
        .all();
    assert!(out.contains("Second answer beta."), "{out}");
    let ends = turn_ends(home, &model, &a);
    assert_eq!(ends.len(), 2, "{ends:?}");
    let (t1, t1_seq, t1_checkpoint) = ends[0].clone();
    let t1_checkpoint =
        t1_checkpoint.unwrap_or_else(|| panic!("turn 1 left no checkpoint: {ends:?}"));
    assert!(ends[1].2.is_some(), "turn 2 left no checkpoint: {ends:?}");
    // In the home's directory store (what `harness ls` reads by default).
    let listed = go(vec!["ls".into(), "--prefix".into(), t1_checkpoint.clone()])
        .await
        .expect_ok("ls")
        .all();
    assert!(
        listed.contains(&format!("{t1_checkpoint}/turn.json")),
        "{listed}"
    );

    // Bad input first: nothing changes.
    let frames = common::export(home, &model, &a).len();
    let err = go(vec![
        "sessions".into(),
        "fork".into(),
        a.clone(),
        "--until".into(),
        "99999".into(),
    ])
    .await
    .expect_err("fork past the end");
    assert!(err.contains("cannot fork"), "{err}");
    let err = go(vec![
        "sessions".into(),
        "rewind".into(),
        a.clone(),
        "--turn".into(),
        "t9".into(),
    ])
    .await
    .expect_err("rewind to a turn with no checkpoint");
    assert!(err.contains("has no checkpoint"), "{err}");
    assert_eq!(
        common::export(home, &model, &a).len(),
        frames,
        "bad input changed the log"
    );

    // A fork at turn 1's end, on Docker.
    let f = format!("{a}-f1");
    let _cleanup = SessionContainers(f.clone());
    go(vec![
        "sessions".into(),
        "fork".into(),
        a.clone(),
        "--until".into(),
        t1_seq.to_string(),
        "--provider".into(),
        "docker".into(),
        "--target".into(),
        f.clone(),
    ])
    .await
    .expect_ok("fork")
    .all();
    let out = go(run("fork question", Some(f.clone())))
        .await
        .expect_ok("the fork's turn")
        .all();
    assert!(out.contains("Fork answer."), "{out}");
    assert!(
        out.contains(&format!("made from checkpoint {t1_checkpoint}")),
        "{out}"
    );
    let shown = show(home, &model, &f).await;
    assert_eq!(
        shown["sandbox"]["handle"]["provider"], "docker",
        "{shown:#}"
    );

    // The parent meanwhile: untouched, its own sandbox and conversation.
    let out = go(run("third question", Some(a.clone())))
        .await
        .expect_ok("parent turn 3")
        .all();
    assert!(out.contains("Third answer."), "{out}");
    assert_eq!(
        show(home, &model, &a).await["sandbox"]["handle"]["provider"],
        "local"
    );

    // Rewind the parent in place to turn 1's end.
    go(vec![
        "sessions".into(),
        "rewind".into(),
        a.clone(),
        "--turn".into(),
        t1.clone(),
    ])
    .await
    .expect_ok("rewind")
    .all();
    let out = go(run("rewound question", Some(a.clone())))
        .await
        .expect_ok("after the rewind")
        .all();
    assert!(out.contains("Rewound answer."), "{out}");

    // The fork's container is removed: the next prompt makes a new one from
    // the fork's last turn-end checkpoint.
    for c in session_containers(&f) {
        let rm = std::process::Command::new("docker")
            .args(["rm", "-f", &c])
            .output()
            .unwrap();
        assert!(
            rm.status.success(),
            "docker rm: {}",
            String::from_utf8_lossy(&rm.stderr)
        );
    }
    let out = go(run("after loss question", Some(f.clone())))
        .await
        .expect_ok("after docker rm")
        .all();
    assert!(out.contains("After-loss answer."), "{out}");
    assert!(out.contains("is gone"), "the client was not told: {out}");

    // The parent's local sandbox directory deleted: the same.
    let dir = show(home, &model, &a).await["sandbox"]["handle"]["data"]["dir"]
        .as_str()
        .map(str::to_string)
        .expect("a local sandbox handle names its directory");
    std::fs::remove_dir_all(&dir).unwrap();
    let out = go(run("after loss question", Some(a.clone())))
        .await
        .expect_ok("after rm -r")
        .all();
    assert!(out.contains("After-loss answer."), "{out}");
    assert!(out.contains("is gone"), "{out}");

    // Retention: every checkpoint is referenced; then only each session's
    // last is kept — the parent's turn 2 goes, and the fork's last one (whose
    // content it shares with the parent's turn 1) still makes a sandbox.
    let gc = |more: &[&str]| {
        let mut args: Vec<String> = vec!["gc".into(), "--grace-secs".into(), "0".into()];
        args.extend(more.iter().map(|s| s.to_string()));
        args
    };
    let out = go(gc(&[])).await.expect_ok("gc").all();
    assert!(out.contains(" 0 deleted"), "{out}");
    let t2_checkpoint = ends[1].2.clone().unwrap();
    let listed = go(vec!["ls".into(), "--prefix".into(), t2_checkpoint.clone()])
        .await
        .expect_ok("ls")
        .all();
    assert!(
        listed.contains(&format!("{t2_checkpoint}/turn.json")),
        "{listed}"
    );
    let out = go(gc(&["--keep-last", "1"]))
        .await
        .expect_ok("gc --keep-last 1")
        .all();
    assert!(!out.contains(" 0 deleted"), "{out}");
    let listed = go(vec!["ls".into(), "--prefix".into(), t2_checkpoint.clone()])
        .await
        .expect_ok("ls")
        .all();
    assert!(
        !listed.contains(&t2_checkpoint),
        "turn 2's checkpoint survived: {listed}"
    );
    for c in session_containers(&f) {
        let rm = std::process::Command::new("docker")
            .args(["rm", "-f", &c])
            .output()
            .unwrap();
        assert!(rm.status.success());
    }
    let out = go(run("after gc question", Some(f.clone())))
        .await
        .expect_ok("after gc")
        .all();
    assert!(out.contains("After-gc answer."), "{out}");

    // Delete the parent (docs/retention.md): its sandbox goes with it, and
    // the next collection deletes the checkpoints only it referenced (its
    // last turn's) while the fork's stay.
    let last_checkpoint = |session: &str| {
        turn_ends(home, &model, session)
            .into_iter()
            .filter_map(|(_, _, checkpoint)| checkpoint)
            .next_back()
            .expect("a turn end with a checkpoint")
    };
    let (parent_last, fork_last) = (last_checkpoint(&a), last_checkpoint(&f));
    let stored = |key: String| {
        let go = &go;
        async move {
            go(vec!["ls".into(), "--prefix".into(), key.clone()])
                .await
                .expect_ok("ls")
                .all()
                .contains(&format!("{key}/turn.json"))
        }
    };
    assert!(
        stored(parent_last.clone()).await,
        "{parent_last} before the delete"
    );
    let sandbox_dir = show(home, &model, &a).await["sandbox"]["handle"]["data"]["dir"]
        .as_str()
        .map(str::to_string)
        .expect("the parent's new local sandbox");
    assert!(std::path::Path::new(&sandbox_dir).exists());
    let out = go(vec!["sessions".into(), "delete".into(), a.clone()])
        .await
        .expect_ok("sessions delete")
        .all();
    assert!(out.contains("removed its local sandbox"), "{out}");
    assert!(
        !std::path::Path::new(&sandbox_dir).exists(),
        "the deleted session's sandbox {sandbox_dir} is still there"
    );
    let out = go(gc(&[])).await.expect_ok("gc after the delete").all();
    assert!(!out.contains(" 0 deleted"), "{out}");
    assert!(
        !stored(parent_last.clone()).await,
        "the deleted session's last checkpoint {parent_last} survived"
    );
    assert!(
        stored(fork_last.clone()).await,
        "the fork's checkpoint {fork_last} was collected"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn claude_forks_rewinds_and_outlives_its_sandbox() {
    if require_env("HARNESS_CLAUDE_BIN").is_none() {
        return;
    }
    forks_and_rewinds("claude-code").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn codex_forks_rewinds_and_outlives_its_sandbox() {
    if require_env("HARNESS_CODEX_BIN").is_none() {
        return;
    }
    forks_and_rewinds("codex").await;
}
