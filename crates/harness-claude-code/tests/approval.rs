//! Permission requests end to end, through the session runtime as an
//! embedding program uses it: the real `claude` with
//! `--permission-prompt-tool mcp__harness__approve` and the harness's
//! approval MCP server (`harness-approval-mcp`, installed by the bootstrap
//! recipe), a session created with `approvals: true`, its prompt sent by a
//! client (`SessionClient::prompt`), the turn run by the in-process engine
//! in a sandbox the engine creates, against the scripted model. The model
//! asks for a Bash call; the client sees a `tool-approval-request` part
//! while the turn waits (`awaiting_tool_approval`, the command not run);
//! the client's answer (`SessionClient::answer`) decides whether the
//! command runs. Every case runs on the local sandbox (`local::…`) and on
//! Docker (`docker::…`). Skips (prints "skipped: …") without the claude
//! binary, dockerd or the test image; fails then under
//! `HARNESS_REQUIRE_REAL=1`.

use std::sync::Arc;

use harness_agent_e2e::*;
use harness_claude_code::{ApprovalServer, ClaudeCodeConfig, ClaudeCodeHarness};
use harness_core::frame::{FrameBody, SessionId};
use harness_core::log::{MemorySessionLog, SessionLog};
use harness_core::part::StreamPart;
use harness_core::sandbox::{collect_exec, ExecRequest, Sandbox, SandboxProvider};
use harness_core::session::{SandboxConfig, SessionConfig};
use harness_core::turn::TurnStatus;
use harness_testkit::model::*;
use session_runtime::{Runtime, SessionClient, TurnHandle, TurnUpdate};

const CALL_ID: &str = "toolu_needs_permission";
const DENY_REASON: &str = "the test says no";

fn harness() -> Option<ClaudeCodeHarness> {
    let mut config = match ClaudeCodeConfig::from_env() {
        Ok(c) => c,
        Err(e) => {
            harness_testkit::skip_or_fail(&format!("claude binary: {e}"));
            return None;
        }
    };
    config.approvals = Some(ApprovalServer::load(approval_server_binary()?).expect("hash server"));
    Some(ClaudeCodeHarness::new(config))
}

/// Everything one approval case needs.
struct Rig {
    runtime: Runtime,
    provider: Arc<dyn SandboxProvider>,
    log: Arc<MemorySessionLog>,
    session: SessionClient,
}

async fn rig(b: Backend, h: ClaudeCodeHarness, server: &ScriptedModel) -> Rig {
    let provider: Arc<dyn SandboxProvider> = Arc::from(b.provider);
    let log = Arc::new(MemorySessionLog::new());
    let runtime = Runtime::builder(log.clone())
        .provider(provider.clone())
        .agent(Arc::new(h))
        .env(server.claude_env().into_iter().collect())
        .poll_interval(std::time::Duration::from_millis(100))
        .build();
    runtime.start().await.unwrap();
    let config = SessionConfig {
        sandbox: SandboxConfig {
            provider: provider.name().to_string(),
            ..SandboxConfig::default()
        },
        approvals: true,
        ..SessionConfig::default()
    };
    let session = runtime.create_session(None, config).await.unwrap();
    Rig {
        runtime,
        provider,
        log,
        session,
    }
}

fn script(expect_in_result: &str) -> Script {
    Script::new()
        .rule(
            Rule::new(last_is_tool_result_for(CALL_ID), Reply::text("All done."))
                .assert_tool_result_contains(CALL_ID, expect_in_result),
        )
        .on(
            last_user_text_contains("make the file"),
            Reply::shell(CALL_ID, "echo ran > approved.txt && echo wrote-it"),
        )
}

/// Send the prompt and follow the turn until the client sees the
/// permission request; checks the engine's state, the log, and that the
/// command has not run yet.
async fn until_approval_requested(rig: &Rig) -> (TurnHandle, String, Box<dyn Sandbox>) {
    let mut turn = rig.session.prompt("please make the file").await.unwrap();
    let approval_id = tokio::time::timeout(TURN_TIMEOUT, async {
        while let Some(update) = turn.next().await {
            match update {
                TurnUpdate::Part(StreamPart::ToolApprovalRequest {
                    approval_id,
                    tool_name,
                    input,
                    ..
                }) => {
                    assert_eq!(tool_name, "Bash");
                    assert!(
                        input["command"]
                            .as_str()
                            .is_some_and(|c| c.contains("approved.txt")),
                        "{input}"
                    );
                    return approval_id;
                }
                TurnUpdate::Ended { status, error } => {
                    panic!("the turn ended ({status:?}, {error:?}) without asking")
                }
                TurnUpdate::Part(_) => {}
            }
        }
        panic!("the session stream ended")
    })
    .await
    .expect("no permission request in time");
    let sid = rig.session.id().clone();
    let state = rig
        .runtime
        .engine()
        .turn_state(sid.as_str(), turn.turn_id())
        .await
        .unwrap();
    // The slice reports the request right after it emitted it; give the
    // engine a moment to save that.
    let mut state = state;
    for _ in 0..50 {
        if state.status == TurnStatus::AwaitingToolApproval {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        state = rig
            .runtime
            .engine()
            .turn_state(sid.as_str(), turn.turn_id())
            .await
            .unwrap();
    }
    assert_eq!(state.status, TurnStatus::AwaitingToolApproval, "{state:?}");
    assert_eq!(
        state
            .pending_approval
            .as_ref()
            .map(|p| p.approval_id.clone()),
        Some(approval_id.clone())
    );
    let sandbox = rig
        .provider
        .resume(state.sandbox.as_ref().expect("the engine made the sandbox"))
        .await
        .unwrap();
    assert!(
        !exists(sandbox.as_ref(), "approved.txt").await,
        "the command ran before it was approved"
    );
    let frames = rig
        .log
        .read(&SessionId::parse(sid.as_str()).unwrap(), 0, 1000)
        .await
        .unwrap();
    let requests: Vec<_> = frames
        .iter()
        .filter_map(|f| match &f.body {
            FrameBody::Part {
                part:
                    StreamPart::ToolApprovalRequest {
                        approval_id,
                        tool_call_id,
                        ..
                    },
                ..
            } => Some((approval_id.clone(), tool_call_id.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(
        requests,
        [(approval_id.clone(), CALL_ID.to_string())],
        "one tool-approval-request part in the log"
    );
    (turn, approval_id, sandbox)
}

async fn exists(sandbox: &dyn Sandbox, path: &str) -> bool {
    let out = collect_exec(
        sandbox
            .exec(ExecRequest::shell(format!(
                "test -e {path} && echo yes || echo no"
            )))
            .await
            .unwrap(),
    )
    .await
    .unwrap();
    out.stdout_str().trim() == "yes"
}

async fn approved_command_runs(kind: BackendKind) {
    let Some(h) = harness() else { return };
    let Some(b) = Backend::get(kind).await else {
        return;
    };
    let server = b.model(script("wrote-it")).await;
    let rig = rig(b, h, &server).await;
    let (turn, approval_id, sandbox) = until_approval_requested(&rig).await;
    rig.session.answer(approval_id, true, None).await.unwrap();
    let done = tokio::time::timeout(TURN_TIMEOUT, turn.finish())
        .await
        .expect("turn ends after the answer")
        .unwrap();
    server.assert_no_failures();
    assert_eq!(done.status, TurnStatus::Finished, "{done:?}");
    assert!(exists(sandbox.as_ref(), "approved.txt").await);
    assert!(done.text.contains("All done."), "{done:?}");
    sandbox.destroy().await.unwrap();
}

async fn denied_command_does_not_run(kind: BackendKind) {
    let Some(h) = harness() else { return };
    let Some(b) = Backend::get(kind).await else {
        return;
    };
    // The model must be told why: the deny message reaches it as the
    // tool result of the call.
    let server = b.model(script(DENY_REASON)).await;
    let rig = rig(b, h, &server).await;
    let (turn, approval_id, sandbox) = until_approval_requested(&rig).await;
    rig.session
        .answer(approval_id, false, Some(DENY_REASON.into()))
        .await
        .unwrap();
    let done = tokio::time::timeout(TURN_TIMEOUT, turn.finish())
        .await
        .expect("turn ends after the answer")
        .unwrap();
    server.assert_no_failures();
    assert_eq!(done.status, TurnStatus::Finished, "{done:?}");
    assert!(!exists(sandbox.as_ref(), "approved.txt").await);
    // The scripted model's rule asserted the tool result carried the
    // reason; the final text came from that rule.
    assert!(
        server.model_requests().len() >= 2,
        "the model was asked again after the denial"
    );
    sandbox.destroy().await.unwrap();
}

on_both_backends!(approved_command_runs, denied_command_does_not_run);
