//! `harness serve` runs turns: over HTTP only, with the real `claude` and
//! `codex` against the scripted model, on the local sandbox and on Docker.
//! A client creates a session, posts a prompt, and an SSE reader and a
//! WebSocket client both see the live parts and the end; a prompt that
//! needs permission shows `tool-approval-request` and a client's
//! `approval-response` lets the command run; a client's abort ends the
//! turn `failed` with `aborted: …` and the next prompt works. Also: a
//! `harness serve` killed with SIGKILL mid-turn and started again finishes
//! the turn with every part once, and a `harness run` on the home of a
//! running server goes through it (one actor; the server's clients see the
//! run live). Generic Durable Streams survive a SIGKILL of the server.
//!
//! Every server is the built `harness` binary in its own home; clients use
//! only HTTP, SSE and WebSocket. Skips (prints "skipped: …") without the
//! agent binaries, dockerd or the test image; fails then under
//! `HARNESS_REQUIRE_REAL=1`.

mod common;

use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::{SinkExt, StreamExt};
use harness_testkit::model::{
    any, last_is_tool_result_for, last_user_text_contains, Gate, Reply, Rule, Script, ScriptedModel,
};
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::Message;

use common::follow::{Seen, SseClient};
use common::server::*;

/// A client following a session over WebSocket (`?after=0`).
struct WsClient {
    seen: Arc<Mutex<Seen>>,
    tx: mpsc::UnboundedSender<Value>,
}

impl WsClient {
    async fn open(serve: &Serve, id: &str) -> WsClient {
        let url = serve.ws_url(&format!(
            "/v1/sessions/{id}/ws?after=0&access_token={CLIENT}"
        ));
        let (socket, _) = tokio_tungstenite::connect_async(&url).await.unwrap();
        let (mut write, mut read) = socket.split();
        let (tx, mut rx) = mpsc::unbounded_channel::<Value>();
        tokio::spawn(async move {
            while let Some(m) = rx.recv().await {
                if write.send(Message::text(m.to_string())).await.is_err() {
                    return;
                }
            }
        });
        let seen = Arc::new(Mutex::new(Seen::default()));
        let sink = seen.clone();
        tokio::spawn(async move {
            while let Some(Ok(Message::Text(t))) = read.next().await {
                let Ok(m) = serde_json::from_str::<Value>(t.as_str()) else {
                    continue;
                };
                let mut seen = sink.lock().unwrap();
                match m["type"].as_str() {
                    Some("frame") => seen.push_frame(m["frame"].clone()),
                    Some("live") => seen.live.push(m),
                    _ => {}
                }
            }
        });
        WsClient { seen, tx }
    }

    fn seen(&self) -> Seen {
        self.seen.lock().unwrap().clone()
    }
}

/// Wait until `seen()` shows the end of `turn`; panics with the server's
/// log after the timeout.
async fn until_end(serve: &Serve, seen: impl Fn() -> Seen, turn: &str) -> Value {
    let started = Instant::now();
    loop {
        if let Some(end) = seen().end(turn) {
            return end;
        }
        assert!(
            started.elapsed() < TURN_TIMEOUT,
            "turn {turn} did not end in {TURN_TIMEOUT:?}; the client saw {:#?}\nserver log:\n{}",
            seen().frames,
            serve.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn until(serve: &Serve, what: &str, check: impl Fn() -> bool) {
    let started = Instant::now();
    while !check() {
        assert!(
            started.elapsed() < TURN_TIMEOUT,
            "{what} did not happen in {TURN_TIMEOUT:?}\nserver log:\n{}",
            serve.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A scripted model reachable from `backend`'s sandboxes.
async fn model(backend: Backend, script: Script) -> Option<(ScriptedModel, Option<String>)> {
    match backend {
        Backend::Local => Some((ScriptedModel::start(script).await.unwrap(), None)),
        Backend::Docker => {
            let (image, gateway) = docker_parts().await?;
            let model = ScriptedModel::start_on(SocketAddr::new(gateway, 0), script)
                .await
                .unwrap();
            Some((model, Some(image)))
        }
    }
}

fn session_body(agent: Agent, backend: Backend, image: &Option<String>, approvals: bool) -> Value {
    let mut body = json!({"agent": agent.name(), "sandbox": backend.name()});
    if let Some(image) = image {
        body["image"] = json!(image);
    }
    if approvals {
        body["approvals"] = json!(true);
    }
    body
}

const CALL_ID: &str = "toolu_serve_1";

/// Text and a tool call stream to an SSE reader and a WebSocket client
/// alike; both see every stored frame once, in order, as the log holds it.
async fn text_and_tools_reach_sse_and_websocket(agent: Agent, backend: Backend) {
    if !agent.available() {
        return;
    }
    let script = Script::new()
        .rule(
            Rule::new(
                last_is_tool_result_for(CALL_ID),
                Reply::text_chunks(["The file ", "says ", "served."]).with_delay(150),
            )
            .assert_tool_result_contains(CALL_ID, "served"),
        )
        .on(
            any(),
            Reply::shell(CALL_ID, "echo served > served.txt && cat served.txt"),
        );
    let Some((model, image)) = model(backend, script).await else {
        return;
    };
    let home = tempfile::tempdir().unwrap();
    let serve = Serve::start(home.path(), &model, &[]);
    let id = create(&serve, session_body(agent, backend, &image, false)).await;
    // The session's container (Docker) goes with the test.
    let _containers = common::docker::SessionContainers(id.clone());
    let sse = SseClient::open(&serve, &id).await;
    let ws = WsClient::open(&serve, &id).await;
    let turn = prompt(&serve, &id, "write the file").await;
    let end = until_end(&serve, || sse.seen(), &turn).await;
    assert_eq!(end["status"], "finished", "{end}");
    until_end(&serve, || ws.seen(), &turn).await;
    model.assert_no_failures();

    let stored = export(&serve, &id).await;
    let seqs: Vec<u64> = stored.iter().map(|f| f["seq"].as_u64().unwrap()).collect();
    assert_eq!(
        seqs,
        (1..=stored.len() as u64).collect::<Vec<_>>(),
        "gap-free"
    );
    for (who, seen) in [("sse", sse.seen()), ("websocket", ws.seen())] {
        assert_eq!(
            seen.frames,
            stored[..seen.frames.len()].to_vec(),
            "{who} saw the log's frames, once, in order"
        );
        assert!(
            seen.live_deltas(&turn) > 0,
            "{who} saw live text deltas: {:?}",
            seen.live
        );
        assert_eq!(seen.parts(&turn, "tool-call").len(), 1, "{who}");
        let results = seen.parts(&turn, "tool-result");
        assert_eq!(results.len(), 1, "{who}");
        assert!(
            results[0]["output"].to_string().contains("served"),
            "{results:?}"
        );
        assert_eq!(seen.parts(&turn, "finish").len(), 1, "{who}");
    }
    let texts: Vec<&str> = stored
        .iter()
        .filter(|f| f["body"]["type"] == "message" && f["body"]["kind"] == "text")
        .filter_map(|f| f["body"]["text"].as_str())
        .collect();
    assert_eq!(
        texts,
        ["The file says served."],
        "the answer stored once, whole"
    );
    let statuses: Vec<&str> = stored
        .iter()
        .filter(|f| f["body"]["type"] == "turn-status")
        .filter_map(|f| f["body"]["status"].as_str())
        .collect();
    assert_eq!(
        statuses,
        ["ready_for_next_step", "finished"],
        "running once its agent started, then one terminal status"
    );
    // The end records the sandbox the turn made, for the next turn.
    assert!(end["sandbox"]["provider"] == backend.name(), "{end}");
}

/// A prompt that needs permission: the client sees the request, answers
/// over HTTP, and the command runs.
async fn a_client_approves_and_the_command_runs(agent: Agent, backend: Backend) {
    if !agent.available() {
        return;
    }
    let script = Script::new()
        .rule(
            Rule::new(last_is_tool_result_for(CALL_ID), Reply::text("All done."))
                .assert_tool_result_contains(CALL_ID, "wrote-it"),
        )
        .on(
            last_user_text_contains("make the file"),
            Reply::shell(CALL_ID, "echo ran > approved.txt && echo wrote-it"),
        );
    let Some((model, image)) = model(backend, script).await else {
        return;
    };
    let home = tempfile::tempdir().unwrap();
    let serve = Serve::start(home.path(), &model, &[]);
    let id = create(&serve, session_body(agent, backend, &image, true)).await;
    // The session's container (Docker) goes with the test.
    let _containers = common::docker::SessionContainers(id.clone());
    let sse = SseClient::open(&serve, &id).await;
    let turn = prompt(&serve, &id, "please make the file").await;
    until(&serve, "a tool-approval-request", || {
        !sse.seen().parts(&turn, "tool-approval-request").is_empty()
    })
    .await;
    let request = sse.seen().parts(&turn, "tool-approval-request").remove(0);
    let approval_id = request["approvalId"].as_str().unwrap().to_string();
    // The turn waits: the session says so, and no tool result yet.
    let info: Value = http()
        .get(serve.url(&format!("/v1/sessions/{id}")))
        .bearer_auth(CLIENT)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        info["meta"]["turn"]["approval"],
        approval_id.as_str(),
        "{info}"
    );
    assert!(sse.seen().parts(&turn, "tool-result").is_empty());
    let (status, ack) = post(
        &serve.url(&format!("/v1/sessions/{id}/messages")),
        CLIENT,
        json!({"type": "approval-response", "approvalId": approval_id, "approved": true}),
    )
    .await;
    assert_eq!(status, 200, "{ack}");
    let end = until_end(&serve, || sse.seen(), &turn).await;
    assert_eq!(end["status"], "finished", "{end}\n{}", serve.log());
    model.assert_no_failures();
    let stored = export(&serve, &id).await;
    let ran = stored.iter().any(|f| {
        f["body"]["type"] == "part"
            && f["body"]["part"]["type"] == "tool-result"
            && f["body"]["part"]["output"].to_string().contains("wrote-it")
    });
    assert!(ran, "the approved command ran: {stored:#?}");
    assert!(stored
        .iter()
        .any(|f| f["body"]["type"] == "approval-response" && f["body"]["approved"] == true));
}

/// A client's abort ends the turn `failed` with `aborted: …` while the
/// agent runs a long command; the parts so far are kept; the next prompt
/// of the session works, in the same sandbox.
async fn abort_ends_the_turn_and_the_next_prompt_works(agent: Agent, backend: Backend) {
    if !agent.available() {
        return;
    }
    let script = Script::new()
        .on(
            last_user_text_contains("after the abort"),
            Reply::text("Still here."),
        )
        .on(
            any(),
            Reply::shell(
                CALL_ID,
                "timeout 120 tail -f /dev/null; echo should-never-print",
            ),
        );
    let Some((model, image)) = model(backend, script).await else {
        return;
    };
    let home = tempfile::tempdir().unwrap();
    let serve = Serve::start(home.path(), &model, &[]);
    let id = create(&serve, session_body(agent, backend, &image, false)).await;
    // The session's container (Docker) goes with the test.
    let _containers = common::docker::SessionContainers(id.clone());
    let sse = SseClient::open(&serve, &id).await;
    let turn = prompt(&serve, &id, "run the long command").await;
    until(&serve, "the long command's tool call", || {
        !sse.seen().parts(&turn, "tool-call").is_empty()
    })
    .await;
    // A second prompt while the turn runs is refused, storing nothing.
    let (status, refused) = post(
        &serve.url(&format!("/v1/sessions/{id}/messages")),
        CLIENT,
        json!({"type": "prompt", "text": "too early"}),
    )
    .await;
    assert_eq!(status, 409, "{refused}");
    assert_eq!(refused["error"]["code"], "turn_in_progress");
    // The abort comes from another client, over its WebSocket.
    let ws = WsClient::open(&serve, &id).await;
    let asked = Instant::now();
    ws.tx
        .send(json!({"type": "abort", "reason": "user pressed stop"}))
        .unwrap();
    let end = until_end(&serve, || sse.seen(), &turn).await;
    until_end(&serve, || ws.seen(), &turn).await;
    // That the abort did not wait for the command (120 s) is shown by the
    // command having no result below; the time is printed, not asserted.
    eprintln!("abort to end: {:?}", asked.elapsed());
    assert_eq!(end["status"], "failed", "{end}");
    assert!(
        end["error"]
            .as_str()
            .is_some_and(|e| e.starts_with("aborted: user pressed stop")),
        "{end}"
    );
    let seen = sse.seen();
    assert_eq!(
        seen.parts(&turn, "tool-call").len(),
        1,
        "the parts so far are kept"
    );
    assert!(
        seen.parts(&turn, "tool-result").is_empty(),
        "the command was cut short, it has no result: {:?}",
        seen.parts(&turn, "tool-result")
    );
    // The session takes its next prompt, in the same sandbox.
    let next = prompt(&serve, &id, "after the abort").await;
    let end2 = until_end(&serve, || sse.seen(), &next).await;
    assert_eq!(end2["status"], "finished", "{end2}\n{}", serve.log());
    assert_eq!(end2["sandbox"], end["sandbox"], "the same sandbox");
    let stored = export(&serve, &id).await;
    assert!(stored.iter().any(|f| f["body"]["type"] == "message"
        && f["body"]["turnId"] == next.as_str()
        && f["body"]["text"] == "Still here."));

    // DELETE takes the sandbox the session owns with it: the directory
    // (local) or the container (Docker) is gone, then the log.
    let info = get_json_as(&serve, &format!("/v1/sessions/{id}"), HOST).await;
    let sandbox = info["meta"]["sandbox"].clone();
    assert_eq!(sandbox["owned"], true, "{info}");
    let exists = || match backend {
        Backend::Local => {
            let dir = sandbox["data"]["dir"]
                .as_str()
                .expect("the sandbox's directory");
            std::path::Path::new(dir).exists()
        }
        Backend::Docker => !common::docker::session_containers(&id).is_empty(),
    };
    assert!(
        exists(),
        "the sandbox is there before the delete: {sandbox}"
    );
    assert_eq!(delete(&serve, &id).await, 204, "{}", serve.log());
    assert!(
        !exists(),
        "the deleted session's sandbox is left: {sandbox}"
    );
    let gone = http()
        .get(serve.url(&format!("/v1/sessions/{id}")))
        .bearer_auth(HOST)
        .send()
        .await
        .unwrap();
    assert_eq!(gone.status(), 404);
}

/// An agent that exits non-zero ends the turn `failed` with its own words:
/// the turn's error quotes the last lines of its stderr. Here the real
/// `claude` is asked to resume a conversation its sandbox no longer has
/// (its transcript deleted between two turns).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_agent_says_why_in_the_turns_error() {
    let agent = Agent::Claude;
    if !agent.available() {
        return;
    }
    let script = Script::new().on(any(), Reply::text("Hello."));
    let Some((model, image)) = model(Backend::Local, script).await else {
        return;
    };
    let home = tempfile::tempdir().unwrap();
    let serve = Serve::start(home.path(), &model, &[]);
    let id = create(&serve, session_body(agent, Backend::Local, &image, false)).await;
    let sse = SseClient::open(&serve, &id).await;
    let first = prompt(&serve, &id, "hello").await;
    let end = until_end(&serve, || sse.seen(), &first).await;
    assert_eq!(end["status"], "finished", "{end}");
    let conversation = end["agentSessionId"]
        .as_str()
        .expect("the agent's session id");
    let dir = end["sandbox"]["data"]["dir"]
        .as_str()
        .expect("the sandbox's directory");
    let projects = std::path::Path::new(dir).join("home/.claude/projects");
    let mut removed = 0;
    for project in std::fs::read_dir(&projects).unwrap() {
        let transcript = project
            .unwrap()
            .path()
            .join(format!("{conversation}.jsonl"));
        if transcript.exists() {
            std::fs::remove_file(transcript).unwrap();
            removed += 1;
        }
    }
    assert_eq!(
        removed,
        1,
        "claude's transcript under {}",
        projects.display()
    );

    let next = prompt(&serve, &id, "hello again").await;
    let end = until_end(&serve, || sse.seen(), &next).await;
    assert_eq!(end["status"], "failed", "{end}");
    let error = end["error"].as_str().unwrap_or_default();
    assert!(
        error.starts_with("agent exited with code 1: ")
            && error.contains(&format!(
                "No conversation found with session ID: {conversation}"
            )),
        "{end}"
    );
}

/// The slow turn of the durability cases: a Bash call that sleeps 5 s and
/// writes `slow.txt`, then the answer streamed in chunks 400 ms apart.
const SLOW_CHUNKS: [&str; 6] = ["The slow ", "task ", "is ", "done ", "and ", "verified."];

fn slow_script() -> Script {
    Script::new()
        .rule(
            Rule::new(
                last_is_tool_result_for(CALL_ID),
                Reply::text_chunks(SLOW_CHUNKS).with_delay(400),
            )
            .assert_tool_result_contains(CALL_ID, "slow-done"),
        )
        .on(
            any(),
            Reply::shell(CALL_ID, "sleep 5; echo slow-done > slow.txt; cat slow.txt"),
        )
}

/// The runner generations that wrote to a session, in log order.
fn runner_generations(stored: &[Value]) -> Vec<u64> {
    stored
        .iter()
        .filter(|f| f["body"]["type"] == "runner-attached")
        .filter_map(|f| f["body"]["generation"].as_u64())
        .collect()
}

/// A session with the slow turn started on `serve`, followed over SSE,
/// once its tool call shows (the agent runs its 5 s command): the session,
/// its reader and the turn.
async fn slow_turn_running(serve: &Serve) -> (String, SseClient, String) {
    let id = create(serve, json!({"agent": "claude-code", "sandbox": "local"})).await;
    let sse = SseClient::open(serve, &id).await;
    let turn = prompt(serve, &id, "do the slow thing").await;
    until(serve, "the tool call", || {
        !sse.seen().parts(&turn, "tool-call").is_empty()
    })
    .await;
    (id, sse, turn)
}

/// The slow turn's log: gap-free, one prompt, one tool call and result,
/// one finish, the whole answer once, one terminal `finished`.
fn assert_slow_turn_stored_once(stored: &[Value], what: &str) {
    let seqs: Vec<u64> = stored.iter().map(|f| f["seq"].as_u64().unwrap()).collect();
    assert_eq!(
        seqs,
        (1..=stored.len() as u64).collect::<Vec<_>>(),
        "gap-free {what}"
    );
    let count = |pred: &dyn Fn(&Value) -> bool| stored.iter().filter(|f| pred(&f["body"])).count();
    let part =
        |kind: &'static str| move |b: &Value| b["type"] == "part" && b["part"]["type"] == kind;
    let context = format!("{what}: {stored:#?}");
    assert_eq!(count(&|b| b["type"] == "user-message"), 1, "{context}");
    assert_eq!(count(&part("tool-call")), 1, "{context}");
    assert_eq!(count(&part("tool-result")), 1, "{context}");
    assert_eq!(count(&part("finish")), 1, "{context}");
    let texts: Vec<&str> = stored
        .iter()
        .filter(|f| f["body"]["type"] == "message")
        .filter_map(|f| f["body"]["text"].as_str())
        .collect();
    assert_eq!(texts, vec![SLOW_CHUNKS.concat().as_str()], "{context}");
    let terminal = |b: &Value| {
        b["type"] == "turn-status"
            && matches!(
                b["status"].as_str(),
                Some("finished" | "failed" | "timed_out")
            )
    };
    assert_eq!(count(&terminal), 1, "{context}");
    assert_eq!(
        count(&|b| b["type"] == "turn-status" && b["status"] == "finished"),
        1,
        "{context}"
    );
}

/// `harness serve` (in-process engine) killed with SIGKILL mid-turn — during
/// the tool's sleep, then again during the streamed answer — and started
/// again on the same home: the turn finishes, every part once, one end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_killed_mid_turn_finishes_the_turn_after_a_restart() {
    if !Agent::Claude.available() {
        return;
    }
    // The answer streams its first chunk, then waits for `answer` to open:
    // the second kill lands mid-answer however slow this machine is (the
    // agent keeps running while no server does).
    let answer = Gate::new();
    let script = Script::new()
        .rule(
            Rule::new(
                last_is_tool_result_for(CALL_ID),
                Reply::text_chunks(SLOW_CHUNKS).hold_before_delta(1, answer.clone()),
            )
            .assert_tool_result_contains(CALL_ID, "slow-done"),
        )
        .on(
            any(),
            Reply::shell(CALL_ID, "sleep 5; echo slow-done > slow.txt; cat slow.txt"),
        );
    let model = ScriptedModel::start(script).await.unwrap();
    let home = tempfile::tempdir().unwrap();
    let args = ["--slice-ms", "1000"];
    let mut serve = Serve::start(home.path(), &model, &args);
    let (id, sse, turn) = slow_turn_running(&serve).await;
    // First life: killed during the tool's sleep (its result is not back).
    until(&serve, "the tool call", || {
        !sse.seen().parts(&turn, "tool-call").is_empty()
    })
    .await;
    assert!(
        sse.seen().parts(&turn, "tool-result").is_empty(),
        "the tool's result came back before the first kill"
    );
    serve.kill();
    // Second life: killed while the answer streams (its first chunk out,
    // the rest held).
    let mut serve = Serve::start(home.path(), &model, &args);
    let sse = SseClient::open(&serve, &id).await;
    until(&serve, "the answer's first chunk after the restart", || {
        let seen = sse.seen();
        !seen.parts(&turn, "tool-result").is_empty() && seen.live_deltas(&turn) > 0
    })
    .await;
    assert!(
        sse.seen().end(&turn).is_none(),
        "still running at the second kill"
    );
    serve.kill();
    answer.open();
    // Third life: the turn finishes.
    let serve = Serve::start(home.path(), &model, &args);
    let sse = SseClient::open(&serve, &id).await;
    let end = until_end(&serve, || sse.seen(), &turn).await;
    assert_eq!(end["status"], "finished", "{end}\n{}", serve.log());
    model.assert_no_failures();
    let stored = export(&serve, &id).await;
    assert_slow_turn_stored_once(&stored, "two SIGKILLs of the server");
    assert!(
        serve.log().contains("resumed 1 turn"),
        "the restarted server resumed the turn:\n{}",
        serve.log()
    );
    // Three server lives wrote as three runner generations, in order.
    let generations = runner_generations(&stored);
    assert!(
        generations.len() >= 2 && generations.windows(2).all(|w| w[0] < w[1]),
        "{generations:?}"
    );
}

/// `harness run` on the home of a running server goes through it: one
/// actor, and a client of the server sees the run live.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn harness_run_goes_through_the_running_server() {
    if !Agent::Claude.available() {
        return;
    }
    let script = Script::bash_each_turn("echo via-the-server", "The server ran it.");
    let model = ScriptedModel::start(script).await.unwrap();
    let home = tempfile::tempdir().unwrap();
    let serve = Serve::start(home.path(), &model, &[]);
    let id = create(&serve, json!({"agent": "claude-code", "sandbox": "local"})).await;
    let sse = SseClient::open(&serve, &id).await;
    let out = tokio::task::spawn_blocking({
        let home = home.path().to_path_buf();
        let id = id.clone();
        move || {
            Command::new(env!("CARGO_BIN_EXE_harness"))
                .arg("--home")
                .arg(&home)
                .args(["run", "--session", &id, "run it through the server"])
                .env_remove("ANTHROPIC_API_KEY")
                .env_remove("HARNESS_HOME")
                .stdin(Stdio::null())
                .output()
                .unwrap()
        }
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}\n{}", serve.log());
    assert!(stderr.contains("drives this home"), "{stderr}");
    assert!(stdout.contains("The server ran it."), "{stdout}");
    // The server's client saw the run live. `harness run` returns once
    // *it* has seen the end; this client follows the same log over its own
    // stream and may be a few frames behind (seen in CI: the end not yet
    // read when the run exited), so wait for the end before looking.
    let prompt_turn = || {
        sse.seen()
            .frames
            .iter()
            .find(|f| f["body"]["type"] == "user-message")
            .map(|f| f["body"]["turnId"].as_str().unwrap().to_string())
    };
    until(&serve, "the client sees the prompt", || {
        prompt_turn().is_some()
    })
    .await;
    let turn = prompt_turn().unwrap();
    until(&serve, "the client sees the turn's end", || {
        sse.seen().end(&turn).is_some()
    })
    .await;
    let seen = sse.seen();
    assert!(
        seen.live_deltas(&turn) > 0,
        "live text reached the server's client"
    );
    assert_eq!(seen.end(&turn).unwrap()["status"], "finished");
    // One actor wrote: a single runner generation, the server's.
    let stored = export(&serve, &id).await;
    let attached = stored
        .iter()
        .filter(|f| f["body"]["type"] == "runner-attached")
        .count();
    assert_eq!(attached, 1, "{stored:#?}");
}

/// A `harness worker` child for a server on Temporal.
/// `harness serve --engine temporal`: the worker running the turn is
/// killed with SIGKILL mid-turn and a new one started; the turn finishes
/// with every part once and one end, the server never restarting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(feature = "temporal"),
    ignore = "needs the `temporal` feature (cargo test -p harness-cli --features temporal; CI builds --features full)"
)]
async fn a_killed_temporal_worker_is_replaced_and_the_turn_finishes() {
    if !Agent::Claude.available() {
        return;
    }
    let model = ScriptedModel::start(slow_script()).await.unwrap();
    let home = tempfile::tempdir().unwrap();
    let queue = format!("serve-test-{}", std::process::id());
    let Some(serve) = temporal_server(home.path(), &model, &queue).await else {
        return;
    };
    let worker = Worker::start(home.path(), &serve, &model, &queue);
    let (id, sse, turn) = slow_turn_running(&serve).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(sse.seen().end(&turn).is_none(), "still running at the kill");
    drop(worker); // SIGKILL
    let replacement = Worker::start(home.path(), &serve, &model, &queue);
    let end = until_end(&serve, || sse.seen(), &turn).await;
    assert_eq!(
        end["status"],
        "finished",
        "{end}\nserver:\n{}\nworker:\n{}",
        serve.log(),
        replacement.log()
    );
    model.assert_no_failures();
    let stored = export(&serve, &id).await;
    assert_slow_turn_stored_once(&stored, "a SIGKILL of the worker");
    let generations = runner_generations(&stored);
    assert!(
        generations.len() == 2 && generations[0] < generations[1],
        "the replacement wrote as a newer runner: {generations:?}"
    );
}

/// Turn-end checkpoints in a store every worker reaches (`docs/scale.md`):
/// two Temporal workers, each with a home of its own, share one checkpoint
/// directory (`--checkpoints`, here `HARNESS_TURN_CHECKPOINTS`). Turn 1 runs on the
/// first, which writes a file and stores the turn's end; that worker is
/// killed and the session's sandbox lost. Turn 2 lands on the second
/// worker, which makes a new sandbox from the shared checkpoint: the file
/// is there, and the turn's end is recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(feature = "temporal"),
    ignore = "needs the `temporal` feature (cargo test -p harness-cli --features temporal; CI builds --features full)"
)]
async fn a_second_worker_makes_a_lost_sandbox_anew_from_the_shared_store() {
    let shared = tempfile::tempdir().unwrap();
    a_lost_sandbox_is_made_anew_on_another_worker(shared.path().to_str().unwrap(), &[]).await;
}

/// The same through a bucket (`--checkpoints s3://BUCKET/PREFIX` on
/// SeaweedFS): encrypted on the workers, which share the deployment's
/// checkpoint key (`HARNESS_CHECKPOINT_KEY`), as every worker of one
/// deployment must.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(feature = "temporal"),
    ignore = "needs the `temporal` feature (cargo test -p harness-cli --features temporal; CI builds --features full)"
)]
async fn a_second_worker_makes_a_lost_sandbox_anew_from_a_shared_bucket() {
    if s3_endpoint("the workers' shared bucket").await.is_none() {
        return;
    }
    let store = format!("s3://harness-workers/run-{}", std::process::id());
    let key = "5f".repeat(32);
    a_lost_sandbox_is_made_anew_on_another_worker(&store, &[("HARNESS_CHECKPOINT_KEY", &key)])
        .await;
}

async fn a_lost_sandbox_is_made_anew_on_another_worker(store: &str, more_env: &[(&str, &str)]) {
    if !Agent::Claude.available() {
        return;
    }
    let script = Script::new()
        .on(
            last_is_tool_result_for("toolu_write"),
            Reply::text("Written."),
        )
        .on(
            last_user_text_contains("write the note"),
            Reply::shell("toolu_write", "echo shared-note > note.txt && echo wrote"),
        )
        .on(last_is_tool_result_for("toolu_read"), Reply::text("Read."))
        .on(
            last_user_text_contains("read the note"),
            Reply::shell("toolu_read", "cat note.txt"),
        );
    let model = ScriptedModel::start(script).await.unwrap();
    let (home, first_home, second_home) = (
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
    );
    let queue = format!("serve-shared-{}", std::process::id());
    let Some(serve) = temporal_server(home.path(), &model, &queue).await else {
        return;
    };
    let mut env = vec![("HARNESS_TURN_CHECKPOINTS", store)];
    env.extend_from_slice(more_env);
    let first = Worker::start_with_env(first_home.path(), &serve, &model, &queue, &env);
    let id = create(
        &serve,
        session_body(Agent::Claude, Backend::Local, &None, false),
    )
    .await;
    let sse = SseClient::open(&serve, &id).await;
    let t1 = prompt(&serve, &id, "please write the note").await;
    let end1 = tokio::time::timeout(TURN_TIMEOUT / 2, until_end(&serve, || sse.seen(), &t1))
        .await
        .unwrap_or_else(|_| panic!("turn 1 did not end; worker:\n{}", first.log()));
    assert_eq!(
        end1["status"],
        "finished",
        "{end1}\nworker:\n{}",
        first.log()
    );
    let checkpoint = end1["checkpoint"].as_str().unwrap_or_default().to_string();
    assert!(
        !checkpoint.is_empty(),
        "turn 1 recorded no checkpoint: {end1}"
    );
    let dir = end1["sandbox"]["data"]["dir"]
        .as_str()
        .expect("a local handle names its directory")
        .to_string();
    assert!(
        dir.starts_with(first_home.path().to_str().unwrap()),
        "turn 1 ran on the first worker: {dir}"
    );
    let first_log = first.log();
    let said = if store.starts_with("s3://") {
        "checkpoints are encrypted on this machine"
    } else {
        "checkpoint store: the directory"
    };
    assert!(first_log.contains(said), "{first_log}");
    drop(first); // SIGKILL
    std::fs::remove_dir_all(&dir).unwrap();

    let second = Worker::start_with_env(second_home.path(), &serve, &model, &queue, &env);
    let t2 = prompt(&serve, &id, "please read the note").await;
    let end2 = tokio::time::timeout(TURN_TIMEOUT / 2, until_end(&serve, || sse.seen(), &t2))
        .await
        .unwrap_or_else(|_| {
            panic!(
                "turn 2 did not end; frames: {:#?}\nfirst worker:\n{first_log}\nsecond worker:\n{}",
                sse.seen().frames,
                second.log()
            )
        });
    let logs = || {
        format!(
            "first worker:\n{first_log}\nsecond worker:\n{}\nserver:\n{}",
            second.log(),
            serve.log()
        )
    };
    assert_eq!(end2["status"], "finished", "{end2}\n{}", logs());
    let dir2 = end2["sandbox"]["data"]["dir"].as_str().unwrap_or_default();
    assert!(
        dir2.starts_with(second_home.path().to_str().unwrap()),
        "turn 2 made its sandbox on the second worker: {dir2}\n{}",
        logs()
    );
    let seen = sse.seen();
    let read = seen.parts(&t2, "tool-result");
    assert!(
        read.iter().any(|p| p.to_string().contains("shared-note")),
        "the file of turn 1 is in the new sandbox: {read:?}\n{}",
        logs()
    );
    // Each worker's broker numbered its calls from 1; both turns' records
    // are in the log, one per call the model saw (their keys carry the
    // broker's journal id: two workers' record 1 are two records).
    let calls = export(&serve, &id)
        .await
        .iter()
        .filter(|f| f["body"]["part"]["record"]["kind"] == "model-call")
        .count();
    assert_eq!(calls, model.requests().len(), "{}", logs());
    model.assert_no_failures();
}

/// Two workers: the one running the turn is paused (SIGSTOP) and a second
/// takes the turn over (a newer runner generation); resumed (SIGCONT), the
/// first may try to write before Temporal cancels its attempt, or not at
/// all — which of the two cannot be forced from outside, so this test is
/// named for what it can always check: the log holds every part once, from
/// the two generations in order. The fencing itself (a paused runner's
/// held write refused, its engine stopped) is checked deterministically by
/// `session-runtime/tests/fencing.rs`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(feature = "temporal"),
    ignore = "needs the `temporal` feature (cargo test -p harness-cli --features temporal; CI builds --features full)"
)]
async fn a_paused_temporal_worker_and_its_successor_store_the_turn_once() {
    if !Agent::Claude.available() {
        return;
    }
    let model = ScriptedModel::start(slow_script()).await.unwrap();
    let home = tempfile::tempdir().unwrap();
    let queue = format!("serve-fence-{}", std::process::id());
    let Some(serve) = temporal_server(home.path(), &model, &queue).await else {
        return;
    };
    let first = Worker::start(home.path(), &serve, &model, &queue);
    let (id, sse, turn) = slow_turn_running(&serve).await;
    first.signal("-STOP");
    let second = Worker::start(home.path(), &serve, &model, &queue);
    let end = until_end(&serve, || sse.seen(), &turn).await;
    assert_eq!(
        end["status"],
        "finished",
        "{end}\nsecond worker:\n{}",
        second.log()
    );
    first.signal("-CONT");
    // The first worker wakes up and either tries its pending write (and is
    // told it is fenced: the event ends the wait) or has its attempt
    // cancelled by Temporal, which leaves nothing to observe — so that
    // case is given a bounded 4 s. Either way nothing it does may land.
    let woke = Instant::now();
    while !first.log().contains("runner fenced") && woke.elapsed() < Duration::from_secs(4) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let stored = export(&serve, &id).await;
    assert_slow_turn_stored_once(&stored, "a paused worker and its successor");
    let generations = runner_generations(&stored);
    assert_eq!(generations.len(), 2, "{generations:?}");
    assert!(generations[0] < generations[1]);
    // Nothing after the second worker attached came from the first: the
    // frames after its runner-attached frame are the rest of this turn,
    // each once (checked above), and the first worker was told it is
    // fenced if it tried to write.
    // Which of the two it was, for the record.
    if first.log().contains("runner fenced") {
        eprintln!("the paused worker tried to write and was fenced");
    } else {
        eprintln!("the paused worker's attempt was cancelled before it wrote again");
    }
}

/// `harness serve --engine remote` runs no engine: its turns run in a
/// `harness runner` (its own home, next to the sandboxes). A prompt posted
/// before any runner attached starts when one does; the runner SIGKILLed
/// mid-turn and started again resumes the turn from its own turn store;
/// every part once, one end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remote_runner_runs_the_servers_turns_and_resumes_after_a_kill() {
    if !Agent::Claude.available() {
        return;
    }
    // The slow turn, then a plain answer to a second prompt.
    let script = Script::new()
        .on(last_user_text_contains("again"), Reply::text("Again."))
        .rule(
            Rule::new(
                last_is_tool_result_for(CALL_ID),
                Reply::text_chunks(SLOW_CHUNKS).with_delay(400),
            )
            .assert_tool_result_contains(CALL_ID, "slow-done"),
        )
        .on(
            any(),
            Reply::shell(CALL_ID, "sleep 5; echo slow-done > slow.txt; cat slow.txt"),
        );
    let model = ScriptedModel::start(script).await.unwrap();
    let server_home = tempfile::tempdir().unwrap();
    let runner_home = tempfile::tempdir().unwrap();
    let serve = Serve::start(server_home.path(), &model, &["--engine", "remote"]);
    let id = create(&serve, json!({"agent": "claude-code", "sandbox": "local"})).await;
    let sse = SseClient::open(&serve, &id).await;
    let turn = prompt(&serve, &id, "do the slow thing").await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        sse.seen().parts(&turn, "stream-start").is_empty(),
        "nothing runs the turn before a runner attaches"
    );
    let runner = Worker::runner(runner_home.path(), &serve, &model);
    until(&serve, "the tool call", || {
        !sse.seen().parts(&turn, "tool-call").is_empty()
    })
    .await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(sse.seen().end(&turn).is_none(), "still running at the kill");
    drop(runner); // SIGKILL
    let runner = Worker::runner(runner_home.path(), &serve, &model);
    let end = until_end(&serve, || sse.seen(), &turn).await;
    assert_eq!(
        end["status"],
        "finished",
        "{end}\nrunner:\n{}",
        runner.log()
    );
    assert!(runner.log().contains("resumed 1 turn"), "{}", runner.log());
    model.assert_no_failures();
    let stored = export(&serve, &id).await;
    assert_slow_turn_stored_once(&stored, "a SIGKILL of the remote runner");
    let stored_t1: Vec<Value> = stored.clone();
    let generations = runner_generations(&stored);
    assert!(
        generations.len() == 2 && generations[0] < generations[1],
        "{generations:?}"
    );
    // The session goes on with the runner: a second prompt.
    let next = prompt(&serve, &id, "again").await;
    let end2 = until_end(&serve, || sse.seen(), &next).await;
    assert_eq!(end2["status"], "finished", "{end2}");
    let stored = export(&serve, &id).await;
    assert!(stored.len() > stored_t1.len());
    assert!(stored.iter().any(|f| f["body"]["type"] == "message"
        && f["body"]["turnId"] == next.as_str()
        && f["body"]["text"] == "Again."));
}

/// Generic Durable Streams written through `harness serve` live in the
/// home (`streams.db`): after a SIGKILL of the server and a restart on the
/// same home, a read from offset 0 (`-1`) returns the same messages and
/// the same tail, and appends go on after it. No agent runs here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generic_durable_streams_survive_a_killed_server() {
    let script = Script::bash_each_turn("true", "unused");
    let model = ScriptedModel::start(script).await.unwrap();
    let home = tempfile::tempdir().unwrap();
    let mut serve = Serve::start(home.path(), &model, &[]);
    let path = "/v1/stream/kept/across-restarts";
    let r = http()
        .put(serve.url(path))
        .bearer_auth(HOST)
        .header("content-type", "application/json")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201, "{}", serve.log());
    for body in [r#"{"n":1}"#, r#"[{"n":2},{"n":3}]"#] {
        let r = http()
            .post(serve.url(path))
            .bearer_auth(HOST)
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 204, "append {body}");
    }
    let read = |serve: &Serve| {
        let url = serve.url(&format!("{path}?offset=-1"));
        async move {
            let r = http().get(url).bearer_auth(HOST).send().await.unwrap();
            assert_eq!(r.status(), 200);
            let tail = r.headers()["stream-next-offset"]
                .to_str()
                .unwrap()
                .to_string();
            (r.json::<Value>().await.unwrap(), tail)
        }
    };
    let (before, tail) = read(&serve).await;
    assert_eq!(before, json!([{"n": 1}, {"n": 2}, {"n": 3}]));

    serve.kill();
    let serve = Serve::start(home.path(), &model, &[]);
    let (after, tail_after) = read(&serve).await;
    assert_eq!(after, before, "the stream's messages after the restart");
    assert_eq!(tail_after, tail, "the stream's tail after the restart");
    let r = http()
        .post(serve.url(path))
        .bearer_auth(HOST)
        .header("content-type", "application/json")
        .body(r#"{"n":4}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
    let next = r.headers()["stream-next-offset"]
        .to_str()
        .unwrap()
        .to_string();
    assert!(
        next > tail,
        "appends go on after the restored tail: {next} > {tail}"
    );
    let (all, _) = read(&serve).await;
    assert_eq!(all, json!([{"n": 1}, {"n": 2}, {"n": 3}, {"n": 4}]));
}

/// One test per (case, agent, backend), named after all three so nextest
/// reports each on its own.
macro_rules! case {
    ($name:ident: $case:ident($agent:expr, $backend:expr)) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            $case($agent, $backend).await
        }
    };
}

case!(claude_local_text_and_tools: text_and_tools_reach_sse_and_websocket(Agent::Claude, Backend::Local));
case!(claude_docker_text_and_tools: text_and_tools_reach_sse_and_websocket(Agent::Claude, Backend::Docker));
case!(codex_local_text_and_tools: text_and_tools_reach_sse_and_websocket(Agent::Codex, Backend::Local));
case!(codex_docker_text_and_tools: text_and_tools_reach_sse_and_websocket(Agent::Codex, Backend::Docker));
case!(claude_local_approval: a_client_approves_and_the_command_runs(Agent::Claude, Backend::Local));
case!(claude_docker_approval: a_client_approves_and_the_command_runs(Agent::Claude, Backend::Docker));
case!(codex_local_approval: a_client_approves_and_the_command_runs(Agent::Codex, Backend::Local));
case!(claude_local_abort: abort_ends_the_turn_and_the_next_prompt_works(Agent::Claude, Backend::Local));
case!(claude_docker_abort: abort_ends_the_turn_and_the_next_prompt_works(Agent::Claude, Backend::Docker));
case!(codex_local_abort: abort_ends_the_turn_and_the_next_prompt_works(Agent::Codex, Backend::Local));
case!(codex_docker_abort: abort_ends_the_turn_and_the_next_prompt_works(Agent::Codex, Backend::Docker));

/// The containers recorded in a home's Docker exec directories
/// (`<home>/docker-exec/exec-*/container`): every container the server
/// made, pooled or a session's, while it exists.
fn recorded_containers(home: &std::path::Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(home.join("docker-exec")) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| std::fs::read_to_string(e.path().join("container")).ok())
        .map(|id| id.trim().to_string())
        .collect()
}

fn container_exists(id: &str) -> bool {
    Command::new("docker")
        .args(["inspect", "--format", "{{.Id}}", id])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// SIGTERM — what systemd, `docker stop` and Kubernetes send — stops
/// `harness serve` the way Ctrl-C does: its pooled Docker container and
/// that container's exec directory go with it, while the session's own
/// container stays for the next start to resume.
#[tokio::test(flavor = "multi_thread")]
async fn sigterm_stops_the_server_and_takes_its_pool_with_it() {
    if !Agent::Claude.available() {
        return;
    }
    let Some((model, image)) = model(Backend::Docker, Script::text("Ready.")).await else {
        return;
    };
    let home = tempfile::tempdir().unwrap();
    let mut serve = Serve::start(home.path(), &model, &["--docker-pool", "1"]);
    let id = create(
        &serve,
        session_body(Agent::Claude, Backend::Docker, &image, false),
    )
    .await;
    let _containers = common::docker::SessionContainers(id.clone());
    let sse = SseClient::open(&serve, &id).await;
    let turn = prompt(&serve, &id, "hello").await;
    let end = until_end(&serve, || sse.seen(), &turn).await;
    assert_eq!(end["status"], "finished", "{end}");
    let session: Vec<String> = common::docker::session_containers(&id);
    assert_eq!(session.len(), 1, "{session:?}");
    let is_session = |c: &str| session.iter().any(|s| c.starts_with(s.as_str()));
    // The pool refills after the session's create (a second later).
    let started = Instant::now();
    let pooled = loop {
        let pooled: Vec<String> = recorded_containers(home.path())
            .into_iter()
            .filter(|c| !is_session(c))
            .collect();
        if let Some(c) = pooled.first().filter(|c| container_exists(c)) {
            break c.clone();
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "no pooled container after 60 s\n{}",
            serve.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };

    serve.signal("-TERM");
    let status = serve.wait_exit(Duration::from_secs(60));
    assert!(
        status.is_some_and(|s| s.success()),
        "harness serve did not stop cleanly on SIGTERM ({status:?})\n{}",
        serve.log()
    );
    assert!(serve.log().contains("shutting down"), "{}", serve.log());
    assert!(
        !container_exists(&pooled),
        "the pooled container outlived the server\n{}",
        serve.log()
    );
    assert!(
        !recorded_containers(home.path()).contains(&pooled),
        "the pooled container's exec directory outlived the server"
    );
    assert!(
        session.iter().all(|c| container_exists(c)),
        "the session's container must stay for the next start"
    );
}
