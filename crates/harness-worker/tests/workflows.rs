//! A turn on Cloudflare Workflows, end to end: a client's prompt to the
//! Worker under `wrangler dev` → the session's Durable Object starts a
//! `TurnWorkflow` instance → its steps (core's `TurnDriver`, one
//! `harness:slice` per step) run the real `claude` in a sandbox of the
//! test kit's bridge-compatible server (backed by the real Docker engine,
//! every request checked against the bridge's pinned OpenAPI document),
//! against the scripted model → the parts reach the object as the
//! session's runner → `finished` in the log.
//!
//! The first attempt of the first slice fails after it has emitted its
//! parts (`HARNESS_TEST_FAIL_SLICE=1:1`); Workflows retries the step, the
//! retried slice re-emits from the same cursor, and the log holds every
//! frame once.

#![cfg(not(target_arch = "wasm32"))]

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use harness_claude_code::{ApprovalServer, ClaudeCodeConfig, ClaudeCodeHarness};
use harness_core::harness::Harness;
use harness_core::sandbox::SandboxSpec;
use harness_testkit::bridge::{BridgeServer, BridgeServerConfig, OpenApi};
use harness_testkit::conformance::session_api::{self, Target, CLIENT, HOST};
use harness_testkit::model::ScriptedModel;
use harness_testkit::model::{
    any, last_is_tool_result_for, last_user_text_contains, Reply, Script,
};
use harness_testkit::wrangler::{free_port_on, WranglerDev};
use harness_testkit::{require_env, skip_or_fail};
use serde_json::{json, Value};

const BRIDGE_TOKEN: &str = "workflows-bridge-token";
/// The real model key: a secret of the Worker, never in a sandbox. Its
/// middle part is what the probe looks for (assembled at run time there,
/// so the probe's own command line does not hold it).
const MODEL_KEY: &str = "sk-ant-canary-KEYMARK-wf-7f3a9c";
/// The Worker's secret for turn tokens.
const BROKER_SECRET: &str = "workflows-broker-secret-0123456789abcdef";

fn script() -> Script {
    Script::new()
        .on(
            last_is_tool_result_for("toolu_wf_1"),
            Reply::text("Done: the note is written."),
        )
        .on(
            last_user_text_contains("write the note"),
            Reply::shell(
                "toolu_wf_1",
                "echo workflow-note > note.txt && echo wrote in $(pwd)",
            ),
        )
}

/// The frames of `id` from the start.
async fn frames(t: &Target, id: &str) -> Vec<Value> {
    let (status, frames) = t
        .get(
            &format!("/v1/sessions/{id}/frames?after=0&limit=1000"),
            Some(HOST),
        )
        .await;
    assert_eq!(status, 200, "{frames}");
    frames.as_array().cloned().unwrap_or_default()
}

fn terminal_status(frames: &[Value]) -> Option<String> {
    frames.iter().find_map(|f| {
        let body = &f["body"];
        let status = body["status"].as_str()?;
        (body["type"] == "turn-status" && matches!(status, "finished" | "failed" | "timed_out"))
            .then(|| status.to_string())
    })
}

/// The real parts one Workflows turn needs.
struct Rig {
    bridge: BridgeServer,
    model: ScriptedModel,
    dev: WranglerDev,
}

impl Rig {
    /// The bridge server (Docker, the test image plus the Claude Code
    /// recipe), the scripted model on the Docker bridge gateway and the
    /// Worker under `wrangler dev` configured for both; `None` after a skip.
    async fn start(script: Script, extra: &[(&'static str, String)]) -> Option<Rig> {
        Self::start_with(script, extra, false).await
    }

    /// As [`Rig::start`]; with `approvals`, the bridge's image also holds
    /// the approval MCP server and the Worker is told so
    /// (`HARNESS_APPROVALS=1`).
    async fn start_with(
        script: Script,
        extra: &[(&'static str, String)],
        approvals: bool,
    ) -> Option<Rig> {
        let claude = require_env("HARNESS_CLAUDE_BIN")?;
        let (docker, gateway) = harness_agent_e2e::docker_test_provider().await?;
        let openapi = match OpenApi::pinned() {
            Ok(o) => o,
            Err(e) => {
                skip_or_fail(&format!("the bridge's OpenAPI document: {e:#}"));
                return None;
            }
        };
        // The bridge's image has `claude` installed, as a production bridge
        // image bakes it in (docs/sandbox-cloudflare.md): here the Docker
        // provider runs the Claude Code recipe into an identity snapshot once.
        let mut config = ClaudeCodeConfig::with_binary(
            harness_agent_binary::AgentBinary::load(&claude).expect("the claude binary"),
        );
        if approvals {
            let server = harness_agent_e2e::approval_server_binary()?;
            config.approvals = Some(ApprovalServer::load(server).expect("the approval server"));
        }
        let recipe = ClaudeCodeHarness::new(config)
            .bootstrap_recipe()
            .expect("the claude recipe");
        let mut spec = SandboxSpec::new("/workspace");
        spec.bootstrap = Some(recipe);
        let bridge = BridgeServer::start(
            Arc::new(docker),
            BridgeServerConfig {
                token: BRIDGE_TOKEN.into(),
                spec,
                openapi: Some(openapi),
            },
        )
        .await
        .expect("the bridge server");
        // The model takes the real key only: a turn that finishes had the
        // Worker's broker add it (the agent holds a turn token).
        let model =
            ScriptedModel::start_requiring_key(SocketAddr::new(gateway, 0), script, MODEL_KEY)
                .await
                .expect("the scripted model");
        let worker_dir = harness_testkit::wrangler::test_build();
        // The Worker listens on the Docker gateway, where the bridge's
        // sandboxes reach it as they reach a deployed Worker: its broker.
        let addr = SocketAddr::new(gateway, free_port_on(gateway));
        let agent_env = json!({ "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1" });
        let mut vars = vec![
            ("HARNESS_TOKENS", session_api::token_table().to_string()),
            ("HARNESS_CF_BRIDGE_URL", bridge.url()),
            ("HARNESS_CF_TOKEN", BRIDGE_TOKEN.to_string()),
            ("HARNESS_AGENT_ENV", agent_env.to_string()),
            ("HARNESS_BROKER_URL", format!("http://{addr}")),
            ("HARNESS_BROKER_SECRET", BROKER_SECRET.to_string()),
            ("ANTHROPIC_BASE_URL", model.base_url()),
            ("ANTHROPIC_API_KEY", MODEL_KEY.to_string()),
        ];
        if approvals {
            vars.push(("HARNESS_APPROVALS", "1".to_string()));
        }
        vars.extend(extra.iter().cloned());
        let dev =
            tokio::task::spawn_blocking(move || WranglerDev::start_at(worker_dir, &vars, addr))
                .await
                .expect("start task")?;
        Some(Rig { bridge, model, dev })
    }

    /// A session on the Cloudflare provider running Claude Code, and its
    /// first prompt (asserting turn `t1`).
    async fn prompt(&self, t: &Target, id: &str, text: &str) {
        self.prompt_with(t, id, text, false).await;
    }

    /// As [`Rig::prompt`], for a session created with `approvals`.
    async fn prompt_with(&self, t: &Target, id: &str, text: &str, approvals: bool) {
        let (status, info) = t
            .post(
                "/v1/sessions",
                Some(HOST),
                json!({"id": id, "agent": "claude-code", "sandbox": "cloudflare", "approvals": approvals}),
            )
            .await;
        assert_eq!(status, 201, "{info}");
        let (status, ack) = t
            .message(
                id,
                CLIENT,
                json!({"type": "prompt", "text": text, "key": "p1"}),
            )
            .await;
        assert_eq!(status, 200, "{ack}");
        assert_eq!(ack["turnId"], "t1", "{ack}");
    }

    /// Poll the frames until one says the turn ended (bounded).
    async fn until_end(&self, t: &Target, id: &str, limit: Duration) -> Vec<Value> {
        let started = Instant::now();
        loop {
            let frames = frames(t, id).await;
            if terminal_status(&frames).is_some() {
                return frames;
            }
            if started.elapsed() > limit {
                panic!(
                    "no end of the turn in {limit:?}; frames: {}\n--- wrangler dev ---\n{}",
                    serde_json::to_string_pretty(&frames).unwrap(),
                    self.dev.log_tail()
                );
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    async fn finish(self) {
        self.model.assert_no_failures();
        // Every model request came through the Worker's broker with the
        // real key; none reached the model with anything else.
        assert_eq!(
            self.model.refused(),
            0,
            "requests reached the model without its key"
        );
        for r in self.model.requests() {
            assert_eq!(r.header("x-api-key"), Some(MODEL_KEY), "{:?}", r.path);
        }
        drop(self.dev);
        let checked = self.bridge.check();
        self.bridge
            .shutdown()
            .await
            .expect("the bridge server stops");
        checked.expect("every bridge request and response within the OpenAPI contract");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_runs_a_claude_turn_on_workflows_with_a_retried_step() {
    let fail = [("HARNESS_TEST_FAIL_SLICE", "1:1".to_string())];
    let Some(rig) = Rig::start(script(), &fail).await else {
        return;
    };
    let t = Target::new(rig.dev.base.clone(), "wf");
    let id = "wf-turn";
    rig.prompt(&t, id, "please write the note").await;
    let frames = rig.until_end(&t, id, Duration::from_secs(300)).await;
    let dev = &rig.dev;
    let model = &rig.model;
    let log = dev.log();
    let dump = || {
        format!(
            "{}\n--- wrangler dev ---\n{log}",
            serde_json::to_string_pretty(&frames).unwrap()
        )
    };
    assert_eq!(
        terminal_status(&frames).as_deref(),
        Some("finished"),
        "{}",
        dump()
    );

    // The agent ran in the bridge's sandbox: its tool result is the
    // command's output there, and its last words are the model's.
    let text = serde_json::to_string(&frames).unwrap();
    assert!(text.contains("wrote in /workspace"), "{}", dump());
    assert!(text.contains("Done: the note is written."), "{}", dump());

    // The failing attempt ran: its error is in the Worker's log …
    assert!(
        log.contains("failpoint HARNESS_TEST_FAIL_SLICE"),
        "the first attempt of slice 1 did not fail:\n{log}"
    );
    // … and nothing it emitted was stored twice: one assistant message per
    // text, one frame per tool call and result, seqs gap-free.
    let seqs: Vec<u64> = frames.iter().filter_map(|f| f["seq"].as_u64()).collect();
    assert_eq!(
        seqs,
        (1..=seqs.len() as u64).collect::<Vec<_>>(),
        "{}",
        dump()
    );
    let mut seen = HashSet::new();
    for frame in &frames {
        let mut body = frame["body"].clone();
        if body["type"] == "runner-attached" {
            continue;
        }
        // Identical bodies would be a duplicate (the times differ).
        body.as_object_mut().map(|b| b.remove("at_ms"));
        assert!(
            seen.insert(body.to_string()),
            "a frame is stored twice: {body}\n{}",
            dump()
        );
    }
    let done_texts = text.matches("Done: the note is written.").count();
    assert_eq!(done_texts, 1, "the final text is stored once\n{}", dump());

    // The turn's end carries the sandbox, for the session's next turn.
    let info = t.info(id).await;
    assert_eq!(info["meta"]["turn"]["status"], "finished", "{info}");
    assert!(
        info["meta"]["sandbox"]["provider"] == "cloudflare",
        "{info}"
    );

    // The AI SDK reads the turn back from the Worker's UI message stream
    // and builds the message a chat UI shows: the tool call with its
    // output, the final text.
    let url = format!("{}/v1/sessions/{id}/ui-stream?after=0", rig.dev.base);
    if let Some(message) = harness_testkit::ai_sdk::read_ui_stream(&url, Some(CLIENT))
        .await
        .unwrap_or_else(|e| panic!("{e}"))
    {
        let parts = message["parts"].as_array().cloned().unwrap_or_default();
        let tool = parts
            .iter()
            .find(|p| p["toolCallId"] == "toolu_wf_1")
            .unwrap_or_else(|| panic!("no tool part: {message}"));
        assert_eq!(tool["state"], "output-available", "{message}");
        assert!(
            parts
                .iter()
                .any(|p| p["type"] == "text" && p["text"] == "Done: the note is written."),
            "{message}"
        );
    }

    // Deleting the session removes the Cloudflare sandbox it owns through
    // the bridge (docs/retention.md), then the session.
    let sandbox = info["meta"]["sandbox"]["id"]
        .as_str()
        .expect("the sandbox's id")
        .to_string();
    assert!(
        rig.bridge.sandboxes().contains(&sandbox),
        "{sandbox} is not live on the bridge: {:?}",
        rig.bridge.sandboxes()
    );
    let (status, body) = t.delete(id, HOST).await;
    assert_eq!(status, 204, "{body}\n{}", rig.dev.log_tail());
    assert!(
        !rig.bridge.sandboxes().contains(&sandbox),
        "the deleted session's sandbox {sandbox} is still on the bridge"
    );
    assert_eq!(
        t.get(&format!("/v1/sessions/{id}"), Some(HOST)).await.0,
        404
    );

    // The agent was started once: the retried slice found it running and
    // read its spool again instead of asking the model a second time.
    let prompts = model
        .requests()
        .iter()
        .filter(|r| r.rule == Some(1))
        .count();
    assert_eq!(prompts, 1, "the model saw the prompt {prompts} times");
    rig.finish().await;
}

/// A client's abort reaches a running slice through the session's object
/// (the turn's mailbox): the agent, busy in a two-minute command, is
/// killed and the turn ends within seconds, not at the slice's budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abort_stops_a_running_slice_on_workflows() {
    let script = Script::new()
        .on(
            last_is_tool_result_for("toolu_wf_sleep"),
            Reply::text("The wait is over."),
        )
        .on(
            last_user_text_contains("wait a while"),
            Reply::shell(
                "toolu_wf_sleep",
                "timeout 120 tail -f /dev/null; echo waited",
            ),
        );
    let Some(rig) = Rig::start(script, &[]).await else {
        return;
    };
    let t = Target::new(rig.dev.base.clone(), "wf-abort");
    let id = "wf-abort";
    rig.prompt(&t, id, "please wait a while").await;
    // Abort once the agent is in its command.
    let started = Instant::now();
    loop {
        let text = serde_json::to_string(&frames(&t, id).await).unwrap();
        if text.contains("tail -f /dev/null") {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "the agent never ran its command: {text}\n{}",
            rig.dev.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let (status, ack) = t
        .message(
            id,
            CLIENT,
            json!({"type": "abort", "reason": "the user left"}),
        )
        .await;
    assert_eq!(status, 200, "{ack}");
    let aborted_at = Instant::now();
    let frames = rig.until_end(&t, id, Duration::from_secs(90)).await;
    let took = aborted_at.elapsed();
    let text = serde_json::to_string_pretty(&frames).unwrap();
    let status = terminal_status(&frames);
    assert_ne!(status.as_deref(), Some("finished"), "{text}");
    assert!(
        took < Duration::from_secs(30),
        "the turn ended {took:?} after the abort\n{text}"
    );
    assert!(!text.contains("The wait is over."), "{text}");
    assert!(
        rig.dev
            .wait_for_log("abort requested", Duration::from_secs(10))
            .await,
        "{}",
        rig.dev.log_tail()
    );
    rig.finish().await;
}

/// A tool approval reaches a Workflows turn: the agent's Bash call waits
/// for the client (the turn parks at `awaiting_tool_approval`, the command
/// not run, the instance waiting for its event); the client's answer
/// goes to the session's object, which sends it to the instance; the next
/// slice hands it to the agent, the command runs and the turn finishes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approval_reaches_a_claude_turn_on_workflows() {
    let script = Script::new()
        .on(
            last_is_tool_result_for("toolu_wf_approve"),
            Reply::text("Approved and done."),
        )
        .on(
            last_user_text_contains("make the file"),
            Reply::shell(
                "toolu_wf_approve",
                "echo ran > approved.txt && echo wrote-it",
            ),
        );
    let Some(rig) = Rig::start_with(script, &[], true).await else {
        return;
    };
    let t = Target::new(rig.dev.base.clone(), "wf-approve");
    let id = "wf-approve";
    rig.prompt_with(&t, id, "please make the file", true).await;
    // The request reaches the log; the command has not run.
    let started = Instant::now();
    let approval_id = loop {
        let frames = frames(&t, id).await;
        let request = frames.iter().find_map(|f| {
            let body = &f["body"];
            let part = if body["type"] == "tool-approval-request" {
                body
            } else {
                &body["part"]
            };
            (part["type"] == "tool-approval-request")
                .then(|| part["approvalId"].as_str().map(str::to_string))
                .flatten()
        });
        if let Some(id) = request {
            // The call's input names the command; no result of it exists.
            let ran = frames.iter().any(|f| {
                let body = &f["body"];
                let part = if body["type"] == "tool-result" {
                    body
                } else {
                    &body["part"]
                };
                part["type"] == "tool-result"
            });
            assert!(!ran, "the command ran unapproved: {frames:?}");
            break id;
        }
        assert!(
            terminal_status(&frames).is_none() && started.elapsed() < Duration::from_secs(120),
            "no approval request: {}\n{}",
            serde_json::to_string_pretty(&frames).unwrap(),
            rig.dev.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    let (status, ack) = t
        .message(
            id,
            CLIENT,
            json!({"type": "approval-response", "approvalId": approval_id, "approved": true}),
        )
        .await;
    assert_eq!(status, 200, "{ack}");
    let frames = rig.until_end(&t, id, Duration::from_secs(180)).await;
    let text = serde_json::to_string_pretty(&frames).unwrap();
    assert_eq!(
        terminal_status(&frames).as_deref(),
        Some("finished"),
        "{text}\n{}",
        rig.dev.log_tail()
    );
    assert!(text.contains("wrote-it"), "{text}");
    assert!(text.contains("Approved and done."), "{text}");
    rig.finish().await;
}

/// The key stays in the Worker: the agent in the bridge's sandbox reaches
/// the model through the Worker's broker with a turn token. A probe the
/// agent runs finds neither the key nor the broker's secret in any
/// process's environment or command line or in the sandbox's files; the
/// model saw the real key on every request; after the turn its token
/// opens nothing, a forged one and another session's path never did.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cloudflare_turn_holds_no_key_and_its_token_expires_with_it() {
    // The marks are assembled inside the sandbox, so the probe's own
    // command line does not hold them.
    let probe = "p=/tmp/harness-probe.$$; printf '%s%s\\n%s%s\\n' KEY MARK broker- secret-0123 > $p; \
         e=$( (env; cat /proc/[0-9]*/environ 2>/dev/null | tr '\\0' '\\n'; \
               cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' ') | grep -c -f $p); \
         f=$(grep -rIl -f $p /workspace /root /home /etc /var /tmp 2>/dev/null | grep -vc \"^$p\"); \
         rm -f $p; echo \"ENV-HITS=$e FILE-HITS=$f\"; echo \"TOKEN=$ANTHROPIC_API_KEY\"";
    let script = Script::new()
        .on(
            last_is_tool_result_for("toolu_wf_probe"),
            Reply::text("Probed."),
        )
        .on(
            last_user_text_contains("probe the sandbox"),
            Reply::shell("toolu_wf_probe", probe),
        );
    let Some(rig) = Rig::start(script, &[]).await else {
        return;
    };
    let t = Target::new(rig.dev.base.clone(), "wf-key");
    let id = "wf-key";
    rig.prompt(&t, id, "please probe the sandbox").await;
    let frames = rig.until_end(&t, id, Duration::from_secs(300)).await;
    let text = serde_json::to_string(&frames).unwrap();
    let dump = || {
        format!(
            "{}\n--- wrangler dev ---\n{}",
            serde_json::to_string_pretty(&frames).unwrap(),
            rig.dev.log_tail()
        )
    };
    assert_eq!(
        terminal_status(&frames).as_deref(),
        Some("finished"),
        "{}",
        dump()
    );
    assert!(text.contains("Probed."), "{}", dump());
    // Nothing inside holds the key or the secret …
    assert!(text.contains("ENV-HITS=0 FILE-HITS=0"), "{}", dump());
    assert!(
        !text.contains("KEYMARK"),
        "the key reached the log: {}",
        dump()
    );
    // … and the agent held a turn token of this turn.
    // (The command's own text holds `TOKEN=$…`: the printed one follows.)
    let token: String = text
        .split("TOKEN=hst1_")
        .nth(1)
        .unwrap_or_else(|| panic!("no turn token printed: {}", dump()))
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
        .collect();
    let token = format!("hst1_{token}");
    assert!(token.ends_with("_t1"), "{token}");

    // After the turn, the same token opens nothing; a forged one, another
    // session's path and no token never did. None reaches the model.
    let seen = rig.model.requests().len();
    let http = reqwest::Client::new();
    let call = |session: &str, token: Option<&str>| {
        let url = format!(
            "{}/v1/broker/s/{session}/anthropic/v1/messages",
            rig.dev.base
        );
        let mut request = http
            .post(url)
            .header("content-type", "application/json")
            .body(r#"{"model":"claude-probe","max_tokens":1,"messages":[]}"#);
        if let Some(token) = token {
            request = request.header("x-api-key", token);
        }
        async move {
            let answer = request.send().await.expect("the Worker answers");
            let status = answer.status().as_u16();
            let body: Value = answer.json().await.unwrap_or(Value::Null);
            (status, body)
        }
    };
    let (status, body) = call(id, Some(&token)).await;
    assert_eq!(status, 403, "an ended turn's token: {body}");
    assert_eq!(body["error"]["type"], "permission_error", "{body}");
    let mut forged = token.clone().into_bytes();
    forged[6] = if forged[6] == b'a' { b'b' } else { b'a' };
    let forged = String::from_utf8(forged).unwrap();
    for (session, token) in [
        (id, Some(forged.as_str())),
        ("wf-other", Some(token.as_str())),
        (id, Some(MODEL_KEY)),
        (id, None),
    ] {
        let (status, body) = call(session, token).await;
        assert_eq!(status, 401, "{session} {token:?}: {body}");
        assert_eq!(body["error"]["type"], "authentication_error", "{body}");
    }
    assert_eq!(
        rig.model.requests().len(),
        seen,
        "a refused call reached the model"
    );
    // The Worker's broker journaled each call the turn made, and the
    // turn's end wrote them into the log: the meta counts them.
    let info = t.info(id).await;
    let usage = &info["meta"]["usage"];
    assert_eq!(
        usage["modelCalls"].as_u64(),
        Some(seen as u64),
        "one record per call: {info}"
    );
    assert!(usage["inputTokens"].as_u64() > Some(0), "{info}");
    rig.finish().await;
}

/// A session's own budget holds on the Worker as on `harness serve`: the
/// agent asks for one tool after another; the first answer spends the
/// 10-token budget, the broker refuses the next call (403, journaled), and
/// the turn ends `failed` with the code `budget_exceeded`. Exactly one
/// request reached the model; the log has both calls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cloudflare_session_is_held_to_its_budget() {
    let script = Script::new().on(any(), Reply::shell("toolu_again", "echo again"));
    let Some(rig) = Rig::start(script, &[]).await else {
        return;
    };
    let t = Target::new(rig.dev.base.clone(), "wf-budget");
    let id = "wf-budget";
    let (status, info) = t
        .post(
            "/v1/sessions",
            Some(HOST),
            json!({"id": id, "agent": "claude-code", "sandbox": "cloudflare",
                   "budget": {"max_tokens": 10}}),
        )
        .await;
    assert_eq!(status, 201, "{info}");
    let (status, ack) = t
        .message(id, CLIENT, json!({"type": "prompt", "text": "keep going"}))
        .await;
    assert_eq!(status, 200, "{ack}");
    let frames = rig.until_end(&t, id, Duration::from_secs(300)).await;
    let dump = || {
        format!(
            "{}\n--- wrangler dev ---\n{}",
            serde_json::to_string_pretty(&frames).unwrap(),
            rig.dev.log_tail()
        )
    };
    let end = frames
        .iter()
        .map(|f| &f["body"])
        .find(|b| b["type"] == "turn-status" && b["status"] == "failed")
        .unwrap_or_else(|| panic!("the turn did not fail: {}", dump()));
    assert_eq!(end["code"], "budget_exceeded", "{}", dump());
    let error = end["error"].as_str().unwrap_or_default();
    assert!(
        error.contains("token budget") && error.contains("over"),
        "{error}"
    );
    let passed = rig
        .model
        .requests()
        .iter()
        .filter(|r| r.api.is_some())
        .count();
    assert_eq!(passed, 1, "{:#?}", rig.model.requests());
    let statuses: Vec<u64> = frames
        .iter()
        .map(|f| &f["body"]["part"]["record"])
        .filter(|r| r["kind"] == "model-call")
        .filter_map(|r| r["status"].as_u64())
        .collect();
    assert_eq!(statuses.first(), Some(&200), "{statuses:?}\n{}", dump());
    assert!(
        statuses.len() >= 2 && statuses[1..].iter().all(|s| *s == 403),
        "{statuses:?}\n{}",
        dump()
    );
    rig.finish().await;
}
