//! Three `harness serve` nodes over one PostgreSQL, turns on Temporal
//! (docs/scale.md): a session's actor runs on one node at a time, held by
//! a lease; the other nodes forward its connections there.
//!
//! A reader on node B follows a real Claude Code turn (scripted model)
//! whose actor runs on node A, and a second reader follows it on A itself.
//! A is SIGKILLed mid-turn: another node takes the session over once A's
//! lease expires, the turn finishes, the reader on B sees every frame once
//! without reconnecting, and the reader from A, reconnecting to node C with
//! `Last-Event-ID`, sees the rest once. Then the new owner is paused
//! (SIGSTOP) with a prompt in its socket, the last node takes the session
//! over, and the paused node, resumed, cannot store the prompt: it is
//! refused (fenced) and the session goes on on the node that holds it.
//!
//! Needs `claude`, the Temporal dev server and PostgreSQL (`cargo xtask
//! services start`; `HARNESS_TEST_POSTGRES_URL`); skips through the skip
//! registry without them (a failure under `HARNESS_REQUIRE_REAL=1`).

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use futures::{SinkExt, StreamExt};
use harness_testkit::model::ScriptedModel;
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::Message;

use common::follow::{Seen, SseClient};
use common::server::*;

/// Short leases, so a dead node's sessions move on in seconds (by hand:
/// `HARNESS_NODES_LEASE_SECS=10` measures the default).
fn lease_secs() -> String {
    std::env::var("HARNESS_NODES_LEASE_SECS").unwrap_or_else(|_| "3".into())
}

/// A database of this test's own on the test PostgreSQL (after a skip, `None`).
async fn postgres_url() -> Option<String> {
    let admin = harness_testkit::postgres::admin_url()?;
    Some(harness_testkit::postgres::fresh_database(&admin).await)
}

/// One node: `harness serve` on Temporal over the shared database, with
/// the audit key every node shares.
fn node(home: &Path, model: &ScriptedModel, db: &str, key: &Path, queue: &str) -> Serve {
    let lease = lease_secs();
    Serve::start_with_env(
        home,
        model,
        &[
            "--engine",
            "temporal",
            "--slice-ms",
            "1000",
            "--log",
            db,
            "--lease-secs",
            &lease,
            "--audit-key",
            key.to_str().unwrap(),
        ],
        &[
            ("HARNESS_TEMPORAL_TASK_QUEUE", queue),
            FAST_TEMPORAL[0],
            FAST_TEMPORAL[1],
            ("RUST_LOG", "warn,session_runtime=info"),
        ],
    )
}

/// Three nodes, each with a home under `dir`, sharing `db` and an audit key.
fn three_nodes(dir: &Path, model: &ScriptedModel, db: &str, queue: &str) -> [Serve; 3] {
    let key = dir.join("audit.key");
    ["a", "b", "c"].map(|name| {
        let home = dir.join(name);
        std::fs::create_dir_all(&home).unwrap();
        node(&home, model, db, &key, queue)
    })
}

/// Wait for `check`, at most `TURN_TIMEOUT`; panic with `context()` after.
async fn until(what: &str, check: impl Fn() -> bool, context: impl Fn() -> String) {
    let started = Instant::now();
    while !check() {
        assert!(
            started.elapsed() < TURN_TIMEOUT,
            "{what} did not happen in {TURN_TIMEOUT:?}\n{}",
            context()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn seqs(frames: &[Value]) -> Vec<u64> {
    frames.iter().map(|f| f["seq"].as_u64().unwrap()).collect()
}

/// The line a node logs when it starts running `session`'s actor.
fn runs(serve: &Serve, session: &str) -> usize {
    serve
        .log()
        .lines()
        .filter(|l| l.contains("this node runs the session's actor") && l.contains(session))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(all(feature = "temporal", feature = "postgres")),
    ignore = "needs the `temporal` and `postgres` features (CI builds --features full)"
)]
async fn a_session_outlives_its_node_and_a_paused_node_is_fenced() {
    if !Agent::Claude.available() {
        return;
    }
    let Some(db) = postgres_url().await else {
        return;
    };
    if !temporal_reachable().await {
        return;
    }
    let model = ScriptedModel::start(common::slow_script_answering_again())
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let home = |name: &str| {
        let path = dir.path().join(name);
        std::fs::create_dir_all(&path).unwrap();
        path
    };
    let queue = format!("nodes-{}", std::process::id());
    let [a, b, c] = three_nodes(dir.path(), &model, &db, &queue);
    // The slices run in a worker whose runner writes through node C.
    let worker = Worker::start(&home("worker"), &c, &model, &queue);
    // On a failure, who is who and the end of each process's log (CI
    // shows a failure's first lines: keep them short).
    let logs = || {
        format!(
            "A {}:\n{}\nB {}:\n{}\nC {}:\n{}\nworker (through C):\n{}",
            a.base,
            tail(&a.log()),
            b.base,
            tail(&b.log()),
            c.base,
            tail(&c.log()),
            tail(&worker.log())
        )
    };

    let id = create(&a, json!({"agent": "claude-code", "sandbox": "local"})).await;
    // The first node asked for the session runs its actor: A, here.
    let on_a = SseClient::open(&a, &id).await;
    let on_b = SseClient::open(&b, &id).await;
    // A prompt through B reaches the actor on A.
    let turn = prompt(&b, &id, "do the slow thing").await;
    until(
        "the tool call, seen on B",
        || !on_b.seen().parts(&turn, "tool-call").is_empty(),
        &logs,
    )
    .await;
    assert_eq!(runs(&a, &id), 1, "A runs the session's actor\n{}", logs());
    assert_eq!(runs(&b, &id) + runs(&c, &id), 0, "{}", logs());

    a.signal("-KILL"); // mid-turn (the agent's command sleeps 5 s)
    let killed_at = Instant::now();
    let before_kill = on_a.seen().frames;
    let last = *seqs(&before_kill).last().expect("A's reader saw frames");
    let on_c = SseClient::open_from(&c, &id, Some(last)).await;

    until(
        "another node taking the session over",
        || runs(&b, &id) + runs(&c, &id) == 1,
        &logs,
    )
    .await;
    let took_over = killed_at.elapsed();
    let end = until_end(&on_b, &turn, &logs).await;
    let ended = killed_at.elapsed();
    assert_eq!(end["status"], "finished", "{end}\n{}", logs());
    let stored = export(&b, &id).await;
    common::assert_stored_once(&stored, "the SIGKILL of the session's node");
    model.assert_no_failures();

    // The reader on B never reconnected: every frame once, in order.
    let all = seqs(&stored);
    assert_eq!(seqs(&on_b.seen().frames), all, "the reader on B");
    // The reader that was on A resumed on C: the rest, once.
    until_end(&on_c, &turn, &logs).await;
    let mut joined = before_kill.clone();
    joined.extend(on_c.seen().frames);
    assert_eq!(seqs(&joined), all, "the reader from A, resumed on C");
    assert_eq!(
        joined.iter().map(|f| &f["body"]).collect::<Vec<_>>(),
        stored.iter().map(|f| &f["body"]).collect::<Vec<_>>(),
        "what the readers saw is what is stored"
    );
    let (owner, other) = match (runs(&b, &id), runs(&c, &id)) {
        (1, 0) => (&b, &c),
        (0, 1) => (&c, &b),
        found => panic!(
            "one node took the session over, found {found:?}\n{}",
            logs()
        ),
    };
    eprintln!(
        "{} took the session over {:.2} s after the kill (lease {} s); the turn ended {:.1} s after it",
        owner.base,
        took_over.as_secs_f64(),
        lease_secs(),
        ended.as_secs_f64()
    );

    // The owner, paused with a prompt waiting in its socket.
    let url = owner.ws_url(&format!("/v1/sessions/{id}/ws?access_token={CLIENT}"));
    let (mut socket, _) = tokio_tungstenite::connect_async(&url).await.unwrap();
    owner.signal("-STOP");
    let late = json!({"type": "prompt", "text": "a late prompt to the paused node"});
    socket.send(Message::text(late.to_string())).await.unwrap();
    // Its lease runs out; a reader on the third node takes the session.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let on_other = SseClient::open(other, &id).await;
    until(
        "the third node taking the session over",
        || runs(other, &id) == 1,
        &logs,
    )
    .await;
    owner.signal("-CONT");
    // The resumed node cannot store the prompt: the store refuses its
    // append as fenced, or its lease keeper learns first that the lease is
    // gone; either way the socket is told and closed.
    let refused = tokio::time::timeout(Duration::from_secs(30), async {
        let mut said = Vec::new();
        while let Some(message) = socket.next().await {
            match message {
                Ok(Message::Text(text)) => said.push(text.to_string()),
                Ok(Message::Close(frame)) => {
                    said.push(frame.map(|f| f.reason.to_string()).unwrap_or_default());
                    break;
                }
                Ok(_) => {}
                Err(e) => {
                    said.push(e.to_string());
                    break;
                }
            }
        }
        said
    })
    .await
    .unwrap_or_else(|_| panic!("the resumed node never answered\n{}", logs()));
    let refusal = refused.join("\n");
    assert!(
        refusal.contains("fenced") || refusal.contains("moved to another node"),
        "the late prompt was refused: {refusal}\n{}",
        logs()
    );
    assert!(
        !refusal.contains("\"type\":\"ack\""),
        "the paused node acknowledged a write: {refusal}\n{}",
        logs()
    );
    // Its stderr is read line by line beside the test: the line may land
    // a moment after the socket closed.
    until(
        "the paused node saying it lost the session",
        || {
            let log = owner.log();
            log.contains("refused as fenced") || log.contains("moves to another node")
        },
        &logs,
    )
    .await;
    let stored = export(other, &id).await;
    assert!(
        !stored
            .iter()
            .any(|f| f["body"]["text"] == "a late prompt to the paused node"),
        "the late prompt is not in the log: {stored:#?}"
    );

    // The session goes on where it lives now, reached through any node.
    let second = prompt(owner, &id, "do the slow thing again").await;
    let end = until_end(&on_other, &second, &logs).await;
    assert_eq!(end["status"], "finished", "{end}\n{}", logs());
    let stored = export(&b, &id).await;
    assert_eq!(
        seqs(&stored),
        (1..=stored.len() as u64).collect::<Vec<_>>(),
        "gap-free after both moves"
    );
    assert_eq!(seqs(&on_other.seen().frames), seqs(&stored));
}

/// Wait until `reader` has seen the end of `turn`.
async fn until_end(reader: &SseClient, turn: &str, logs: impl Fn() -> String) -> Value {
    let started = Instant::now();
    loop {
        let seen: Seen = reader.seen();
        if let Some(end) = seen.end(turn) {
            return end;
        }
        assert!(
            started.elapsed() < TURN_TIMEOUT,
            "turn {turn} did not end in {TURN_TIMEOUT:?}; the reader saw {}\n{}",
            outline(&seen.frames),
            logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Frames as `seq:type[/part type] turn`, one line: what a failure shows
/// first.
fn outline(frames: &[Value]) -> String {
    frames
        .iter()
        .map(|f| {
            let body = &f["body"];
            let part = body["part"]["type"].as_str().map(|t| format!("/{t}"));
            format!(
                "{}:{}{} {}",
                f["seq"],
                body["type"].as_str().unwrap_or("?"),
                part.unwrap_or_default(),
                body["turnId"].as_str().unwrap_or("")
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// The last 40 lines of a process's log.
fn tail(log: &str) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(40)..].join("\n")
}

/// A node given a database URL that is not PostgreSQL's, or one nothing
/// answers at, or without Temporal, refuses to start and says why.
#[test]
#[cfg_attr(
    not(feature = "postgres"),
    ignore = "needs the `postgres` feature (CI builds --features full)"
)]
fn a_node_with_a_bad_log_url_says_why() {
    let dir = tempfile::tempdir().unwrap();
    let run = |extra: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_harness"))
            .arg("--home")
            .arg(dir.path())
            .args([
                "serve",
                "--addr",
                "127.0.0.1:0",
                "--token",
                &format!("{HOST}=host"),
            ])
            .args(extra)
            .env_remove("HARNESS_TOKENS")
            .output()
            .unwrap();
        assert!(!out.status.success(), "{extra:?} started");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let said = run(&["--engine", "temporal", "--log", "mysql://x@127.0.0.1/db"]);
    assert!(said.contains("give a PostgreSQL URL"), "{said}");
    let said = run(&["--log", "postgres://x@127.0.0.1:1/db"]);
    assert!(said.contains("--engine temporal"), "{said}");
    // Port 1 on loopback: nothing listens; the node says so and stops.
    let said = run(&[
        "--engine",
        "temporal",
        "--log",
        "postgres://someone:secret@127.0.0.1:1/db",
    ]);
    assert!(said.contains("127.0.0.1:1"), "names the server: {said}");
    assert!(!said.contains("secret"), "the password is blanked: {said}");
}

/// Random kill trials: three nodes, readers on each, a turn running; one
/// node, drawn at random (the session's owner or not), is SIGKILLed after
/// a random delay. The turn finishes, its log holds every part once, and
/// every surviving reader saw exactly the stored frames. One trial with a
/// fixed seed in the ordinary run; `cargo xtask chaos --nodes --trials N`
/// runs many (`HARNESS_NODES_TRIALS`, `HARNESS_CHAOS_SEED`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(all(feature = "temporal", feature = "postgres")),
    ignore = "needs the `temporal` and `postgres` features (CI builds --features full)"
)]
async fn node_kill_trials() {
    if !Agent::Claude.available() {
        return;
    }
    let Some(admin) = harness_testkit::postgres::admin_url() else {
        return;
    };
    if !temporal_reachable().await {
        return;
    }
    let trials: u64 = std::env::var("HARNESS_NODES_TRIALS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let seed: u64 = std::env::var("HARNESS_CHAOS_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(7);
    let model = ScriptedModel::start(common::slow_script()).await.unwrap();
    let mut failed = Vec::new();
    for trial in 0..trials {
        // splitmix64 of (seed, trial): the victim, the delay, who reads first.
        let mut x = seed ^ trial.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let mut draw = |n: u64| {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            (z ^ (z >> 31)) % n
        };
        let victim = draw(3) as usize;
        let first = draw(3) as usize;
        let delay = Duration::from_millis(draw(7000));
        let label = format!("trial {trial} (seed {seed}): first reader on node {first}, node {victim} killed {delay:?} after the prompt");
        eprintln!("{label}");
        let started = Instant::now();
        // Each trial in a database of its own: the sessions the last one's
        // nodes left (killed at its end) are not this one's to sweep.
        let db = harness_testkit::postgres::fresh_database(&admin).await;
        match kill_trial(&model, &db, trial, victim, first, delay).await {
            Ok(()) => eprintln!("  ok in {:.1} s", started.elapsed().as_secs_f64()),
            Err(e) => {
                eprintln!("  FAILED: {e}");
                failed.push(format!("{label}: {e}"));
            }
        }
    }
    model.assert_no_failures();
    assert!(
        failed.is_empty(),
        "{} of {trials} trials failed:\n{}",
        failed.len(),
        failed.join("\n\n")
    );
}

async fn kill_trial(
    model: &ScriptedModel,
    db: &str,
    trial: u64,
    victim: usize,
    first: usize,
    delay: Duration,
) -> Result<(), String> {
    let dir = tempfile::tempdir().unwrap();
    let queue = format!("nodes-trial-{}-{trial}", std::process::id());
    let nodes = three_nodes(dir.path(), model, db, &queue);
    let worker_home = dir.path().join("worker");
    std::fs::create_dir_all(&worker_home).unwrap();
    // The worker writes to whichever node answers (the victim among them).
    let worker = Worker::start_on_nodes(&worker_home, &nodes, model, &queue);
    let logs = || {
        let mut all = String::new();
        for (i, n) in nodes.iter().enumerate() {
            all.push_str(&format!("node {i}:\n{}\n", n.log()));
        }
        all + "worker:\n" + &worker.log()
    };
    let id = create(
        &nodes[0],
        json!({"agent": "claude-code", "sandbox": "local"}),
    )
    .await;
    // The first node asked runs the actor: readers open from `first` on.
    let mut readers = Vec::new();
    for k in 0..3 {
        let at = (first + k) % 3;
        readers.push((at, SseClient::open(&nodes[at], &id).await));
    }
    let through = (victim + 2) % 3;
    let turn = prompt(&nodes[through], &id, "do the slow thing").await;
    tokio::time::sleep(delay).await;
    nodes[victim].signal("-KILL");
    let (_, survivor) = readers
        .iter()
        .find(|(at, _)| *at != victim)
        .expect("two readers survive");
    let started = Instant::now();
    let end = loop {
        if let Some(end) = survivor.seen().end(&turn) {
            break end;
        }
        if started.elapsed() > TURN_TIMEOUT {
            return Err(format!("the turn did not end\n{}", logs()));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    if end["status"] != "finished" {
        return Err(format!("the turn ended {end}\n{}", logs()));
    }
    let stored = export(&nodes[through], &id).await;
    let checked = std::panic::catch_unwind(|| common::assert_stored_once(&stored, "a node's kill"));
    if checked.is_err() {
        return Err(format!("the log is not the turn once\n{}", logs()));
    }
    for (at, reader) in readers.iter().filter(|(at, _)| *at != victim) {
        // The last frames may still be on their way to this reader.
        let waited = Instant::now();
        while reader.seen().frames.len() < stored.len()
            && waited.elapsed() < Duration::from_secs(10)
        {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let seen = seqs(&reader.seen().frames);
        if seen != seqs(&stored) {
            return Err(format!(
                "the reader on node {at} saw {seen:?}, the log holds 1..={}\n{}",
                stored.len(),
                logs()
            ));
        }
    }
    Ok(())
}
