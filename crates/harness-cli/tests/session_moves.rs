//! `harness checkpoint|restore` moving whole sessions, and `harness sessions
//! show`, through the built binary: the real `claude` against the scripted
//! model, the real S3 server (SeaweedFS, `HARNESS_S3_ENDPOINT`), real
//! dockerd with the test image (`HARNESS_TEST_IMAGE`).
//!
//! The move: turn 1 runs in a local sandbox (the prompt tells the model a
//! codeword; the model writes a file), `harness checkpoint` stores the tree
//! and Claude's state, `harness restore --new-session --sandbox docker`
//! makes a Docker session of them, and turn 2 there (`harness run
//! --session`) sends the model a request that must carry turn 1's
//! conversation — the scripted model asserts it — and reads the file back
//! from the container's tree.

mod common;

use common::docker::{docker_parts, docker_sh, SessionContainers};
use common::{continued_session, Ran};

use std::net::SocketAddr;
use std::path::Path;

use harness_testkit::model::{
    last_is_tool_result_for, last_user_text_contains, Reply, Rule, Script, ScriptedModel,
};
use harness_testkit::require_env;
use serde_json::Value;

/// Turn 1 is told a codeword and writes a note; turn 2's first request must
/// carry turn 1 (its prompt with the codeword, its tool call and result, its
/// answer), then it reads the note. Tool-call ids differ per turn.
fn script() -> Script {
    Script::new()
        .rule(
            Rule::new(
                last_is_tool_result_for("toolu_cat_t2"),
                Reply::text("Second answer: the note says alpha-note."),
            )
            .assert_tool_result_contains("toolu_cat_t2", "alpha-note"),
        )
        .on(
            last_is_tool_result_for("toolu_note_t1"),
            Reply::text("First answer alpha."),
        )
        .rule(
            Rule::new(
                last_user_text_contains("second question"),
                Reply::shell("toolu_cat_t2", "cat notes.txt"),
            )
            .assert_user_texts_contain("the codeword is pelican-42")
            .assert_assistant_texts_contain("First answer alpha.")
            .assert_tool_result_contains("toolu_note_t1", "noted"),
        )
        .on(
            last_user_text_contains("first question"),
            Reply::shell("toolu_note_t1", "echo alpha-note > notes.txt && echo noted"),
        )
}

/// Run `harness --home HOME ARGS…` (Claude Code aimed at `model`).
async fn harness(home: &Path, model: &ScriptedModel, args: &[&str]) -> Ran {
    let mut cmd = common::harness(home, model);
    cmd.args(args);
    common::run_to_end(cmd).await
}

/// The key `harness checkpoint` printed (`checkpoint KEY: …` or `checkpoint
/// KEY (tree only): …`).
fn checkpoint_key(stdout: &str) -> String {
    stdout
        .lines()
        .find_map(|l| l.strip_prefix("checkpoint "))
        .and_then(|rest| rest.split([':', ' ']).next())
        .unwrap_or_else(|| panic!("no checkpoint key printed:\n{stdout}"))
        .to_string()
}

async fn show_json(home: &Path, model: &ScriptedModel, session: &str) -> Value {
    let ran = harness(home, model, &["sessions", "show", session, "--json"])
        .await
        .expect_ok("sessions show --json");
    serde_json::from_str(&ran.stdout)
        .unwrap_or_else(|e| panic!("sessions show --json is not JSON ({e}):\n{}", ran.stdout))
}

fn with<'a>(args: &[&'a str], more: &'a [String]) -> Vec<&'a str> {
    args.iter()
        .copied()
        .chain(more.iter().map(String::as_str))
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
#[cfg_attr(
    not(feature = "s3"),
    ignore = "needs the `s3` feature (cargo test -p harness-cli --features s3; CI builds --features full)"
)]
async fn a_claude_session_moves_from_local_to_a_new_docker_session_and_continues() {
    if require_env("HARNESS_CLAUDE_BIN").is_none() {
        return;
    }
    let Some(endpoint) = require_env("HARNESS_S3_ENDPOINT") else {
        return;
    };
    let Some((image, gateway)) = docker_parts() else {
        return;
    };
    // On the bridge gateway: reachable from the host (turn 1, local
    // sandbox) and from the container (turn 2).
    let model = ScriptedModel::start_on(SocketAddr::new(gateway, 0), script())
        .await
        .unwrap();
    let home = tempfile::tempdir().unwrap();
    let home = home.path();
    let store = common::s3_store_flags(&endpoint, "moves");

    // Turn 1 in a local sandbox.
    let ran = harness(
        home,
        &model,
        &["run", "first question: the codeword is pelican-42"],
    )
    .await
    .expect_ok("turn 1");
    assert!(ran.stdout.contains("First answer alpha."), "{}", ran.stdout);
    let a = continued_session(&ran.stderr);
    let shown_a = show_json(home, &model, &a).await;
    assert_eq!(
        shown_a["sandbox"]["handle"]["provider"], "local",
        "{shown_a:#}"
    );
    let agent_session = shown_a["agent_session_id"]
        .as_str()
        .unwrap_or_else(|| panic!("turn 1 recorded no agent session: {shown_a:#}"))
        .to_string();

    // The whole session into the store; the home records the checkpoint.
    let ran = harness(
        home,
        &model,
        &with(&["checkpoint", "--session", &a], &store),
    )
    .await
    .expect_ok("checkpoint");
    let key = checkpoint_key(&ran.stdout);
    // On S3 checkpoints are encrypted by default: the key names the
    // session's lineage (docs/checkpoint-encryption.md).
    assert_eq!(
        key,
        format!("lineages/{a}/sessions/{a}/turn-1"),
        "{}",
        ran.stdout
    );
    let listed = harness(home, &model, &with(&["ls", "--prefix", &key], &store))
        .await
        .expect_ok("ls");
    for object in ["manifest.json", "work.tar.zst", "state.tar.zst"] {
        assert!(
            listed.stdout.contains(&format!("{key}/{object}")),
            "{object} is stored:\n{}",
            listed.stdout
        );
    }
    let shown_a = show_json(home, &model, &a).await;
    let checkpoints = shown_a["checkpoints"].as_array().unwrap();
    assert_eq!(checkpoints.len(), 1, "{shown_a:#}");
    assert_eq!(
        (
            &checkpoints[0]["key"],
            &checkpoints[0]["kind"],
            &checkpoints[0]["turn"],
            &checkpoints[0]["agent_session_id"]
        ),
        (
            &Value::from(key.as_str()),
            &Value::from("session"),
            &Value::from("t1"),
            &Value::from(agent_session.as_str())
        ),
        "{shown_a:#}"
    );

    // Into a new session in a new Docker sandbox.
    let ran = harness(
        home,
        &model,
        &with(
            &[
                "restore",
                "--key",
                &key,
                "--new-session",
                "--sandbox",
                "docker",
                "--image",
                &image,
            ],
            &store,
        ),
    )
    .await;
    let b = ran.ok.then(|| continued_session(&ran.stdout));
    let _cleanup = b.clone().map(SessionContainers);
    let ran = ran.expect_ok("restore into a new docker session");
    let b = b.unwrap();
    assert_ne!(a, b);
    assert!(
        ran.stdout
            .contains(&format!("session {b} (claude-code in a docker sandbox")),
        "{}",
        ran.stdout
    );
    let shown_b = show_json(home, &model, &b).await;
    let handle = &shown_b["sandbox"]["handle"];
    assert_eq!(
        (
            &shown_b["agent"],
            &shown_b["sandbox"]["provider"],
            &handle["provider"],
            &shown_b["agent_session_id"],
            &shown_b["status"],
        ),
        (
            &Value::from("claude-code"),
            &Value::from("docker"),
            &Value::from("docker"),
            &Value::from(agent_session.as_str()),
            &Value::from("idle"),
        ),
        "{shown_b:#}"
    );
    assert_eq!(shown_b["turns"], serde_json::json!([]), "{shown_b:#}");
    assert_eq!(shown_b["restores"][0]["key"], key.as_str(), "{shown_b:#}");
    let container = handle["id"].as_str().unwrap().to_string();
    let workdir = handle["workdir"].as_str().unwrap().to_string();
    let (ok, note) = docker_sh(&container, &format!("cat {workdir}/notes.txt"));
    assert!(ok, "notes.txt is in the container's tree");
    assert_eq!(note.trim(), "alpha-note");

    // Turn 2 in the Docker session continues turn 1's conversation.
    let ran = harness(home, &model, &["run", "--session", &b, "second question"])
        .await
        .expect_ok("turn 2 in the restored session");
    assert!(
        ran.stdout
            .contains("Second answer: the note says alpha-note."),
        "{}",
        ran.stdout
    );
    model.assert_no_failures();
    let requests = model.model_requests();
    // Turn 1: prompt, tool result; turn 2: prompt, tool result.
    assert_eq!(requests.len(), 4, "{requests:#?}");
    let first_of_t2 = &requests[2];
    assert!(
        first_of_t2
            .user_texts()
            .iter()
            .any(|t| t.contains("the codeword is pelican-42")),
        "turn 2's request carries turn 1's prompt: {first_of_t2:#?}"
    );
    assert!(
        first_of_t2
            .assistant_texts()
            .iter()
            .any(|t| t.contains("First answer alpha.")),
        "turn 2's request carries turn 1's answer: {first_of_t2:#?}"
    );
    assert!(
        first_of_t2.tool_result("toolu_note_t1").is_some(),
        "turn 2's request carries turn 1's tool result: {first_of_t2:#?}"
    );

    // Turn 2 ran in the restored container, and continued the same agent
    // session.
    let shown_b = show_json(home, &model, &b).await;
    assert_eq!(
        shown_b["sandbox"]["handle"]["id"],
        container.as_str(),
        "{shown_b:#}"
    );
    assert_eq!(shown_b["turns"][0]["id"], "t1", "{shown_b:#}");
    assert_eq!(shown_b["turns"][0]["status"], "finished", "{shown_b:#}");
    assert_eq!(
        shown_b["agent_session_id"],
        agent_session.as_str(),
        "{shown_b:#}"
    );
    let (_, transcripts) = docker_sh(
        &container,
        "cd \"$HOME/.claude/projects\" && find . -name '*.jsonl'",
    );
    assert_eq!(
        transcripts.trim(),
        format!(
            "./{}/{agent_session}.jsonl",
            harness::claude_code::project_dir_name(&workdir)
        ),
        "the transcript was relocated to the container's workdir"
    );
}

/// `sessions show` (human and JSON) after a turn, `--tree-only` checkpoints
/// and restores, a session restored into a new local session and again
/// into that session, and the errors that say what to do.
#[tokio::test(flavor = "multi_thread")]
#[cfg_attr(
    not(feature = "s3"),
    ignore = "needs the `s3` feature (cargo test -p harness-cli --features s3; CI builds --features full)"
)]
async fn sessions_show_tree_only_moves_and_clear_errors() {
    if require_env("HARNESS_CLAUDE_BIN").is_none() {
        return;
    }
    let Some(endpoint) = require_env("HARNESS_S3_ENDPOINT") else {
        return;
    };
    let model = ScriptedModel::start(script()).await.unwrap();
    let home = tempfile::tempdir().unwrap();
    let home = home.path();
    let store = common::s3_store_flags(&endpoint, "show");

    let ran = harness(
        home,
        &model,
        &["run", "first question: the codeword is pelican-42"],
    )
    .await
    .expect_ok("turn 1");
    let a = continued_session(&ran.stderr);

    // Human output before any move.
    let ran = harness(home, &model, &["sessions", "show", &a])
        .await
        .expect_ok("sessions show");
    let text = ran.stdout;
    for expected in [
        format!("session        {a}\n"),
        "agent          claude-code (agent session ".to_string(),
        "sandbox        local ".to_string(),
        "status         idle\n".to_string(),
        "turns (1)\n".to_string(),
        "checkpoints (0)\n".to_string(),
        "restored from (0)\n".to_string(),
        " UTC (frame ".to_string(),
    ] {
        assert!(text.contains(&expected), "{expected:?} in:\n{text}");
    }
    let row = text
        .lines()
        .find(|l| l.trim_start().starts_with("t1 "))
        .unwrap_or_else(|| panic!("no row for turn t1:\n{text}"));
    let cells: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(cells[1], "finished", "{row}");
    assert!(row.matches(" UTC").count() == 2, "started and ended: {row}");
    assert!(
        row.trim_end().ends_with(" s") || row.trim_end().ends_with(" ms"),
        "a duration: {row}"
    );

    let shown = show_json(home, &model, &a).await;
    let handle = &shown["sandbox"]["handle"];
    assert_eq!(
        (
            &shown["agent"],
            &shown["sandbox"]["provider"],
            &handle["provider"],
            &shown["status"]
        ),
        (
            &Value::from("claude-code"),
            &Value::from("local"),
            &Value::from("local"),
            &Value::from("idle")
        ),
        "{shown:#}"
    );
    let turn = &shown["turns"][0];
    assert_eq!(
        (&turn["id"], &turn["status"]),
        (&Value::from("t1"), &Value::from("finished"))
    );
    let (started, ended) = (
        turn["started_ms"].as_u64().unwrap(),
        turn["ended_ms"].as_u64().unwrap(),
    );
    assert!(started > 0 && ended >= started, "{turn:#}");
    assert_eq!(
        turn["duration_ms"].as_u64(),
        Some(ended - started),
        "{turn:#}"
    );
    assert!(
        shown["last_activity_ms"].as_u64().unwrap() >= ended,
        "{shown:#}"
    );
    assert!(shown["last_activity"].as_str().unwrap().ends_with(" UTC"));
    let workdir = Path::new(handle["workdir"].as_str().unwrap()).to_path_buf();
    assert_eq!(
        std::fs::read_to_string(workdir.join("notes.txt")).unwrap(),
        "alpha-note\n"
    );

    // --tree-only: the tree alone, as one object.
    let ran = harness(
        home,
        &model,
        &with(&["checkpoint", "--session", &a, "--tree-only"], &store),
    )
    .await
    .expect_ok("checkpoint --tree-only");
    let tree_key = checkpoint_key(&ran.stdout);
    assert_eq!(
        tree_key,
        format!("lineages/{a}/sessions/{a}/turn-1.tar.zst"),
        "{}",
        ran.stdout
    );
    assert!(ran.stdout.contains("(tree only)"), "{}", ran.stdout);
    // A tree-only checkpoint has no agent state: a session restore says so.
    let err = harness(
        home,
        &model,
        &with(&["restore", "--key", &tree_key, "--new-session"], &store),
    )
    .await
    .expect_err("restoring a tree-only checkpoint as a session");
    assert!(err.contains("is a tree-only checkpoint"), "{err}");
    assert!(err.contains("--tree-only"), "suggests --tree-only: {err}");
    // ... and restores as a tree, overlaying.
    std::fs::write(workdir.join("notes.txt"), "changed").unwrap();
    std::fs::write(workdir.join("extra.txt"), "stays").unwrap();
    harness(
        home,
        &model,
        &with(
            &[
                "restore",
                "--tree-only",
                "--session",
                &a,
                "--key",
                &tree_key,
            ],
            &store,
        ),
    )
    .await
    .expect_ok("restore --tree-only");
    assert_eq!(
        std::fs::read_to_string(workdir.join("notes.txt")).unwrap(),
        "alpha-note\n"
    );
    assert_eq!(
        std::fs::read_to_string(workdir.join("extra.txt")).unwrap(),
        "stays"
    );

    // --incremental: a tree checkpoint (manifest + blobs); against it as
    // the parent, a one-file change uploads one chunk, and restoring the
    // parent onto the changed tree writes the old content back.
    let ran = harness(
        home,
        &model,
        &with(
            &[
                "checkpoint",
                "--session",
                &a,
                "--tree-only",
                "--incremental",
            ],
            &store,
        ),
    )
    .await
    .expect_ok("checkpoint --tree-only --incremental");
    let first_tree = checkpoint_key(&ran.stdout);
    assert_eq!(
        first_tree,
        format!("lineages/{a}/sessions/{a}/turn-1.tree"),
        "{}",
        ran.stdout
    );
    assert!(
        ran.stdout.contains("(tree only, incremental)"),
        "{}",
        ran.stdout
    );
    std::fs::write(workdir.join("notes.txt"), "beta-note\n").unwrap();
    let second_tree = format!("sessions/{a}/second.tree");
    let ran = harness(
        home,
        &model,
        &with(
            &[
                "checkpoint",
                "--session",
                &a,
                "--tree-only",
                "--incremental",
                "--key",
                &second_tree,
                "--parent",
                &first_tree,
            ],
            &store,
        ),
    )
    .await
    .expect_ok("checkpoint --incremental --parent");
    assert!(
        ran.stdout.contains("uploaded 1 new chunks"),
        "only notes.txt's new content is uploaded: {}",
        ran.stdout
    );
    harness(
        home,
        &model,
        &with(
            &[
                "restore",
                "--tree-only",
                "--session",
                &a,
                "--key",
                &first_tree,
            ],
            &store,
        ),
    )
    .await
    .expect_ok("restore --tree-only of a tree checkpoint");
    assert_eq!(
        std::fs::read_to_string(workdir.join("notes.txt")).unwrap(),
        "alpha-note\n"
    );
    // Both trees reference what they hold: nothing to collect.
    let ran = harness(home, &model, &with(&["gc"], &store))
        .await
        .expect_ok("gc");
    assert!(
        ran.stdout.contains("2 tree checkpoints") && ran.stdout.contains("deleted 0 unreferenced"),
        "{}",
        ran.stdout
    );

    // A session checkpoint is not a tree.
    let ran = harness(
        home,
        &model,
        &with(&["checkpoint", "--session", &a], &store),
    )
    .await
    .expect_ok("checkpoint");
    let key = checkpoint_key(&ran.stdout);
    let err = harness(
        home,
        &model,
        &with(
            &["restore", "--tree-only", "--session", &a, "--key", &key],
            &store,
        ),
    )
    .await
    .expect_err("restoring a session checkpoint with --tree-only");
    assert!(err.contains("is a session checkpoint"), "{err}");
    assert!(err.contains("without --tree-only"), "{err}");
    // Unknown keys and sessions.
    let err = harness(
        home,
        &model,
        &with(
            &["restore", "--key", "sessions/none/turn-9", "--new-session"],
            &store,
        ),
    )
    .await
    .expect_err("restoring a missing checkpoint");
    assert!(
        err.contains("no checkpoint \"sessions/none/turn-9\""),
        "{err}"
    );
    let err = harness(
        home,
        &model,
        &with(&["restore", "--key", &key, "--session", "s-nope"], &store),
    )
    .await
    .expect_err("restoring into an unknown session");
    assert!(err.contains("unknown session \"s-nope\""), "{err}");
    let err = harness(home, &model, &with(&["restore", "--key", &key], &store))
        .await
        .expect_err("restore without a target");
    assert!(
        err.contains("--session") && err.contains("--new-session"),
        "{err}"
    );
    let err = harness(
        home,
        &model,
        &with(
            &[
                "restore",
                "--key",
                &key,
                "--session",
                &a,
                "--sandbox",
                "docker",
            ],
            &store,
        ),
    )
    .await
    .expect_err("--sandbox with --session");
    assert!(err.contains("cannot be used with"), "{err}");
    let err = harness(home, &model, &["sessions", "show", "s-nope"])
        .await
        .expect_err("show of an unknown session");
    assert!(err.contains("unknown session \"s-nope\""), "{err}");
    assert!(err.contains("harness sessions list"), "{err}");

    // The session checkpoint into a new local session (no turn yet), then
    // again into that session as an existing one.
    let ran = harness(
        home,
        &model,
        &with(&["restore", "--key", &key, "--new-session"], &store),
    )
    .await
    .expect_ok("restore into a new local session");
    let b = continued_session(&ran.stdout);
    harness(
        home,
        &model,
        &with(&["restore", "--key", &key, "--session", &b], &store),
    )
    .await
    .expect_ok("restore into an existing session");
    let shown_b = show_json(home, &model, &b).await;
    assert_eq!(
        (
            &shown_b["sandbox"]["handle"]["provider"],
            &shown_b["agent_session_id"]
        ),
        (&Value::from("local"), &shown["agent_session_id"]),
        "{shown_b:#}"
    );
    let restores: Vec<&str> = shown_b["restores"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["key"].as_str().unwrap())
        .collect();
    assert_eq!(restores, [key.as_str(), key.as_str()], "{shown_b:#}");
    assert_eq!(shown_b["turns"], serde_json::json!([]), "{shown_b:#}");
    let b_workdir = shown_b["sandbox"]["handle"]["workdir"].as_str().unwrap();
    assert_ne!(Path::new(b_workdir), workdir.as_path());
    assert_eq!(
        std::fs::read_to_string(Path::new(b_workdir).join("notes.txt")).unwrap(),
        "alpha-note\n"
    );

    // What `show` says of A now: its four checkpoints (archive, two tree
    // checkpoints, session) and its two tree restores.
    let shown = show_json(home, &model, &a).await;
    let moves = |field: &str| -> Vec<(String, String)> {
        shown[field]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| {
                (
                    m["key"].as_str().unwrap().to_string(),
                    m["kind"].as_str().unwrap().to_string(),
                )
            })
            .collect()
    };
    assert_eq!(
        moves("checkpoints"),
        [
            (tree_key.clone(), "tree".to_string()),
            (first_tree.clone(), "tree".to_string()),
            (format!("lineages/{a}/{second_tree}"), "tree".to_string()),
            (key.clone(), "session".to_string())
        ],
        "{shown:#}"
    );
    assert_eq!(
        moves("restores"),
        [
            (tree_key.clone(), "tree".to_string()),
            (first_tree.clone(), "tree".to_string())
        ],
        "{shown:#}"
    );
    let text = harness(home, &model, &["sessions", "show", &a])
        .await
        .expect_ok("sessions show")
        .stdout;
    assert!(text.contains("checkpoints (4)\n"), "{text}");
    let row = |key: &str| {
        text.lines()
            .find(|l| l.trim_end().ends_with(&format!(" {key}")))
            .unwrap_or_else(|| panic!("no row for {key}:\n{text}"))
            .split_whitespace()
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    // TURN, AT (date, time, UTC), KIND, BYTES, KEY.
    assert_eq!(
        (row(&key)[0].as_str(), row(&key)[4].as_str()),
        ("t1", "session"),
        "{text}"
    );
    assert_eq!(row(&tree_key)[4], "tree", "{text}");
    assert!(text.contains("restored from (2)\n"), "{text}");
}
