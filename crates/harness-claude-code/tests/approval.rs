//! Permission requests end to end: the real `claude` with
//! `--permission-prompt-tool mcp__harness__approve` and the harness's
//! approval MCP server (`harness-approval-mcp`, installed by the bootstrap
//! recipe), run by the in-process engine (`InProcessEngine`, `SliceRunner`,
//! `LogSink` over a `MemorySessionLog`) against the scripted model. The
//! model asks for a Bash call; the turn must stop at
//! `awaiting_tool_approval` with a `tool-approval-request` part in the log;
//! the answer decides whether the command runs. Every case runs on the
//! local sandbox (`local::…`) and on Docker (`docker::…`). Skips (prints
//! "skipped: …") without the claude binary, dockerd or the test image;
//! fails then under `HARNESS_REQUIRE_REAL=1`.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use harness_agent_e2e::*;
use harness_claude_code::{ApprovalServer, ClaudeCodeConfig, ClaudeCodeHarness};
use harness_core::engine::{DurableEngine, InProcessEngine, MemoryTurnStore, Spawner};
use harness_core::frame::{FrameBody, SessionId};
use harness_core::harness::Harness;
use harness_core::log::{AppendRequest, MemorySessionLog, SessionLog};
use harness_core::part::StreamPart;
use harness_core::sandbox::{collect_exec, ExecRequest, Sandbox, SandboxProvider};
use harness_core::sink::LogSink;
use harness_core::slice::SliceRunner;
use harness_core::turn::{ApprovalAnswer, TurnState, TurnStatus};
use harness_testkit::model::*;

const CALL_ID: &str = "toolu_needs_permission";
const DENY_REASON: &str = "the test says no";

/// The approval server binary: `$HARNESS_APPROVAL_MCP_BIN`, else built with
/// cargo into this test's target directory (a test of another crate cannot
/// name a binary of this workspace as an artifact).
fn approval_server_binary() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("HARNESS_APPROVAL_MCP_BIN").filter(|p| !p.is_empty()) {
        return Some(p.into());
    }
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let status = std::process::Command::new(cargo)
        .args(["build", "-q", "-p", "harness-approval-mcp"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .status();
    if !matches!(status, Ok(s) if s.success()) {
        harness_testkit::skip_or_fail(&format!(
            "could not build harness-approval-mcp ({status:?})"
        ));
        return None;
    }
    // target/<profile>/deps/<test exe> → target/<profile>/harness-approval-mcp
    let exe = std::env::current_exe().ok()?;
    let bin = exe.parent()?.parent()?.join("harness-approval-mcp");
    if bin.is_file() {
        Some(bin)
    } else {
        harness_testkit::skip_or_fail(&format!("no approval server at {}", bin.display()));
        None
    }
}

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
    engine: InProcessEngine,
    log: Arc<MemorySessionLog>,
    session: Session,
    state: TurnState,
}

async fn rig(b: Backend, h: ClaudeCodeHarness, server: &ScriptedModel, name: &str) -> Rig {
    let session = new_session(&b, &h, name).await;
    let session_id = session.id.clone();
    // The engine resumes the sandbox by handle through the same provider.
    let provider: Arc<dyn SandboxProvider> = Arc::from(b.provider);
    let handle = session.sandbox.handle();
    let mut providers = BTreeMap::new();
    providers.insert(handle.provider.clone(), provider);
    let mut harnesses: BTreeMap<String, Arc<dyn Harness>> = BTreeMap::new();
    harnesses.insert(h.name().to_string(), Arc::new(h));

    let log = Arc::new(MemorySessionLog::new());
    let sid = SessionId::parse(&session_id).unwrap();
    log.create(&sid).await.unwrap();
    let turn_id = "t1";
    let prompt = "please make the file";
    log.append(
        &sid,
        AppendRequest::new(FrameBody::UserMessage {
            text: prompt.into(),
            turn_id: Some(turn_id.into()),
        }),
    )
    .await
    .unwrap();
    let runner = SliceRunner {
        providers,
        harnesses,
        sink: Arc::new(LogSink::new(log.clone(), 1)),
        env: server.claude_env().into_iter().collect(),
        model: None,
        poll_interval: Duration::from_millis(100),
        sleep: Arc::new(|d| Box::pin(tokio::time::sleep(d))),
        now_ms: Arc::new(harness_core::log::now_ms),
    };
    let spawn: Spawner = Arc::new(|f| {
        tokio::spawn(f);
    });
    let engine = InProcessEngine::new(
        Arc::new(runner),
        Arc::new(MemoryTurnStore::default()),
        spawn,
    );
    let mut state = TurnState::new(&session_id, turn_id, "claude-code", prompt);
    state.sandbox = Some(handle);
    Rig {
        engine,
        log,
        session,
        state,
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

/// Start the turn and wait until it asks for permission; checks the state
/// and the log, and that the command has not run yet.
async fn until_approval_requested(rig: &Rig) -> String {
    let (sid, tid) = (rig.state.session_id.clone(), rig.state.turn_id.clone());
    rig.engine.start_turn(rig.state.clone()).await.unwrap();
    let started = Instant::now();
    let state = loop {
        let s = rig.engine.turn_state(&sid, &tid).await.unwrap();
        if s.status == TurnStatus::AwaitingToolApproval || s.status.is_terminal() {
            break s;
        }
        assert!(
            started.elapsed() < TURN_TIMEOUT,
            "no permission request within {TURN_TIMEOUT:?}: {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(
        state.status,
        TurnStatus::AwaitingToolApproval,
        "turn ended instead: {state:?}"
    );
    let pending = state.pending_approval.clone().expect("pending approval");
    assert_eq!(pending.tool_name, "Bash");
    assert!(
        pending.input["command"]
            .as_str()
            .is_some_and(|c| c.contains("approved.txt")),
        "{pending:?}"
    );
    assert!(
        !exists(rig.session.sandbox.as_ref(), "approved.txt").await,
        "the command ran before it was approved"
    );
    let frames = rig
        .log
        .read(&SessionId::parse(&sid).unwrap(), 0, 1000)
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
                        tool_name,
                        ..
                    },
                ..
            } => Some((approval_id.clone(), tool_call_id.clone(), tool_name.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(
        requests,
        [(
            pending.approval_id.clone(),
            CALL_ID.to_string(),
            "Bash".to_string()
        )],
        "one tool-approval-request part in the log"
    );
    pending.approval_id
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
    let rig = rig(b, h, &server, "cc-approve-yes").await;
    let approval_id = until_approval_requested(&rig).await;
    let (sid, tid) = (rig.state.session_id.clone(), rig.state.turn_id.clone());
    rig.engine
        .answer_approval(
            &sid,
            &tid,
            ApprovalAnswer {
                approval_id,
                approved: true,
                reason: None,
            },
        )
        .await
        .unwrap();
    let done = tokio::time::timeout(TURN_TIMEOUT, rig.engine.wait_turn(&sid, &tid))
        .await
        .expect("turn ends after the answer")
        .unwrap();
    server.assert_no_failures();
    assert_eq!(done.status, TurnStatus::Finished, "{done:?}");
    assert!(exists(rig.session.sandbox.as_ref(), "approved.txt").await);
    assert_eq!(done.approval_answers.len(), 1);
    rig.session.destroy().await;
}

async fn denied_command_does_not_run(kind: BackendKind) {
    let Some(h) = harness() else { return };
    let Some(b) = Backend::get(kind).await else {
        return;
    };
    // The model must be told why: the deny message reaches it as the
    // tool result of the call.
    let server = b.model(script(DENY_REASON)).await;
    let rig = rig(b, h, &server, "cc-approve-no").await;
    let approval_id = until_approval_requested(&rig).await;
    let (sid, tid) = (rig.state.session_id.clone(), rig.state.turn_id.clone());
    rig.engine
        .answer_approval(
            &sid,
            &tid,
            ApprovalAnswer {
                approval_id,
                approved: false,
                reason: Some(DENY_REASON.into()),
            },
        )
        .await
        .unwrap();
    let done = tokio::time::timeout(TURN_TIMEOUT, rig.engine.wait_turn(&sid, &tid))
        .await
        .expect("turn ends after the answer")
        .unwrap();
    server.assert_no_failures();
    assert_eq!(done.status, TurnStatus::Finished, "{done:?}");
    assert!(!exists(rig.session.sandbox.as_ref(), "approved.txt").await);
    // The scripted model's rule asserted the tool result carried the
    // reason; the final text came from that rule.
    assert!(
        server.model_requests().len() >= 2,
        "the model was asked again after the denial"
    );
    rig.session.destroy().await;
}

on_both_backends!(approved_command_runs, denied_command_does_not_run);
