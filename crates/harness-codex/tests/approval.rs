//! Permission requests end to end: the real `codex` with
//! `CodexConfig::approvals` (a `PreToolUse` hook that hands every tool call
//! to the harness through `<spool>/relay/`), run by the in-process
//! engine (`InProcessEngine`, `SliceRunner`) against the scripted model.
//! The model asks for an `exec_command`; the turn must stop at
//! `awaiting_tool_approval` with one `tool-approval-request` part; the
//! answer decides whether the command runs. Every case runs on the local
//! sandbox (`local::…`) and on Docker (`docker::…`). Skips (prints
//! "skipped: …") without the codex binary, dockerd or the test image; fails
//! then under `HARNESS_REQUIRE_REAL=1`.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use harness_agent_e2e::*;
use harness_codex::{CodexApprovals, CodexConfig, CodexHarness, SHELL_TOOL_NAME};
use harness_core::clock::FnClock;
use harness_core::engine::{DurableEngine, InProcessEngine, MemoryTurnStore, Spawner};
use harness_core::harness::Harness;
use harness_core::part::StreamPart;
use harness_core::sandbox::{collect_exec, ExecRequest, Sandbox, SandboxProvider};
use harness_core::slice::{PartSink, SliceRunner};
use harness_core::turn::{ApprovalAnswer, TurnState, TurnStatus};
use harness_testkit::model::*;

const CALL_ID: &str = "call_needs_permission";
const DENY_REASON: &str = "the test says no";

fn harness() -> Option<CodexHarness> {
    let mut config = match CodexConfig::from_env() {
        Ok(c) => c,
        Err(e) => {
            harness_testkit::skip_or_fail(&format!("codex binary: {e}"));
            return None;
        }
    };
    config.approvals = Some(CodexApprovals::default());
    Some(CodexHarness::new(config))
}

/// The parts the slice runner emits, in order, with their keys.
#[derive(Debug, Default)]
struct Collect(Mutex<Vec<(StreamPart, String)>>);

impl Collect {
    fn parts(&self) -> Vec<StreamPart> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .map(|(p, _)| p.clone())
            .collect()
    }
}

// `PartSink` is an `async_trait`; written out by hand so this crate needs
// no extra dependency for one test sink.
impl PartSink for Collect {
    fn emit<'a, 'b, 'c, 'f>(
        &'a self,
        _session_id: &'b str,
        _turn_id: &'c str,
        part: StreamPart,
        key: String,
    ) -> BoxFuture<'f, harness_core::Result<()>>
    where
        'a: 'f,
        'b: 'f,
        'c: 'f,
        Self: 'f,
    {
        Box::pin(async move {
            let mut parts = self.0.lock().unwrap();
            // Idempotency keys: a re-emitted part is stored once.
            if !parts.iter().any(|(_, k)| *k == key) {
                parts.push((part, key));
            }
            Ok(())
        })
    }

    fn turn_status<'a, 'b, 'f>(
        &'a self,
        _state: &'b TurnState,
    ) -> BoxFuture<'f, harness_core::Result<()>>
    where
        'a: 'f,
        'b: 'f,
        Self: 'f,
    {
        Box::pin(async { Ok(()) })
    }
}

/// Everything one approval case needs.
struct Rig {
    engine: InProcessEngine,
    sink: Arc<Collect>,
    session: Session,
    state: TurnState,
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

async fn rig(b: Backend, h: CodexHarness, server: &ScriptedModel, name: &str) -> Rig {
    let session = new_session(&b, &h, name).await;
    // The engine resumes the sandbox by handle through the same provider.
    let provider: Arc<dyn SandboxProvider> = Arc::from(b.provider);
    let handle = session.sandbox.handle();
    let mut providers = BTreeMap::new();
    providers.insert(handle.provider.clone(), provider);
    let mut harnesses: BTreeMap<String, Arc<dyn Harness>> = BTreeMap::new();
    harnesses.insert(h.name().to_string(), Arc::new(h));
    let sink = Arc::new(Collect::default());
    let mut env: BTreeMap<String, String> = server.codex_env().into_iter().collect();
    env.insert("OPENAI_BASE_URL".into(), server.v1_url());
    let runner = SliceRunner {
        providers,
        harnesses,
        sink: sink.clone(),
        env,
        broker: None,
        model: None,
        poll_interval: Duration::from_millis(100),
        sleep: Arc::new(|d| Box::pin(tokio::time::sleep(d))),
        clock: Arc::new(FnClock(now_ms)),
        checkpoints: None,
    };
    let spawn: Spawner = Arc::new(|f| {
        tokio::spawn(f);
    });
    let engine = InProcessEngine::new(
        Arc::new(runner),
        Arc::new(MemoryTurnStore::default()),
        Arc::new(FnClock(now_ms)),
        spawn,
    );
    let mut state = TurnState::new(&session.id, "t1", "codex", "please make the file");
    state.sandbox = Some(handle);
    state.approvals = true;
    Rig {
        engine,
        sink,
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
/// and the parts, and that the command has not run yet.
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
        "turn ended instead: {state:?}\nparts: {:#?}",
        rig.sink.parts()
    );
    let pending = state.pending_approval.clone().expect("pending approval");
    assert_eq!(pending.tool_name, SHELL_TOOL_NAME);
    assert_eq!(
        pending.input["command"], "echo ran > approved.txt && echo wrote-it",
        "{pending:?}"
    );
    assert!(
        !exists(rig.session.sandbox.as_ref(), "approved.txt").await,
        "the command ran before it was approved"
    );
    let requests: Vec<_> = rig
        .sink
        .parts()
        .into_iter()
        .filter_map(|p| match p {
            StreamPart::ToolApprovalRequest {
                approval_id,
                tool_call_id,
                tool_name,
                ..
            } => Some((approval_id, tool_call_id, tool_name)),
            _ => None,
        })
        .collect();
    assert_eq!(
        requests,
        [(
            pending.approval_id.clone(),
            CALL_ID.to_string(),
            SHELL_TOOL_NAME.to_string()
        )],
        "one tool-approval-request part"
    );
    // The hook's trust notice is not reported as an error of the turn.
    assert!(
        !rig.sink
            .parts()
            .iter()
            .any(|p| matches!(p, StreamPart::Error { message } if message.contains("hook-trust"))),
        "{:#?}",
        rig.sink.parts()
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

async fn answer_and_wait(rig: &Rig, approval_id: String, approved: bool) -> TurnState {
    let (sid, tid) = (rig.state.session_id.clone(), rig.state.turn_id.clone());
    rig.engine
        .answer_approval(
            &sid,
            &tid,
            ApprovalAnswer {
                approval_id,
                approved,
                reason: (!approved).then(|| DENY_REASON.to_string()),
            },
        )
        .await
        .unwrap();
    tokio::time::timeout(TURN_TIMEOUT, rig.engine.wait_turn(&sid, &tid))
        .await
        .expect("turn ends after the answer")
        .unwrap()
}

async fn approved_command_runs(kind: BackendKind) {
    let Some(h) = harness() else { return };
    let Some(b) = Backend::get(kind).await else {
        return;
    };
    let server = b.model(script("wrote-it")).await;
    let rig = rig(b, h, &server, "cx-approve-yes").await;
    let approval_id = until_approval_requested(&rig).await;
    let done = answer_and_wait(&rig, approval_id, true).await;
    server.assert_no_failures();
    assert_eq!(done.status, TurnStatus::Finished, "{done:?}");
    assert!(exists(rig.session.sandbox.as_ref(), "approved.txt").await);
    assert_eq!(done.approval_answers.len(), 1);
    let parts = rig.sink.parts();
    assert!(
        parts.iter().any(|p| matches!(p, StreamPart::ToolResult { output, is_error: false, .. } if output["aggregated_output"].as_str().is_some_and(|o| o.contains("wrote-it")))),
        "{parts:#?}"
    );
    rig.session.destroy().await;
}

async fn denied_command_does_not_run(kind: BackendKind) {
    let Some(h) = harness() else { return };
    let Some(b) = Backend::get(kind).await else {
        return;
    };
    // The model must be told why: Codex gives it the hook's stderr as the
    // call's output ("Command blocked by PreToolUse hook: <reason>. …").
    let server = b.model(script(DENY_REASON)).await;
    let rig = rig(b, h, &server, "cx-approve-no").await;
    let approval_id = until_approval_requested(&rig).await;
    let done = answer_and_wait(&rig, approval_id, false).await;
    server.assert_no_failures();
    assert_eq!(done.status, TurnStatus::Finished, "{done:?}");
    assert!(!exists(rig.session.sandbox.as_ref(), "approved.txt").await);
    let reqs = server.model_requests();
    assert_eq!(reqs.len(), 2, "the model was asked again after the denial");
    assert!(
        reqs[1].tool_results().iter().any(|r| r.call_id == CALL_ID
            && r.content.contains("blocked by PreToolUse hook")
            && r.content.contains(DENY_REASON)),
        "{:?}",
        reqs[1].tool_results()
    );
    // A blocked call leaves no command_execution item: no tool-call or
    // tool-result part for it (observed with 0.171.0).
    let parts = rig.sink.parts();
    assert!(
        !parts
            .iter()
            .any(|p| matches!(p, StreamPart::ToolResult { .. })),
        "{parts:#?}"
    );
    rig.session.destroy().await;
}

on_both_backends!(approved_command_runs, denied_command_does_not_run);
