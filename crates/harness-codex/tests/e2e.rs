//! Codex end to end: the real `codex` binary, installed by the adapter's
//! bootstrap recipe into a real sandbox — every case runs on the local
//! sandbox (`local::…`) and on Docker (`docker::…`, a snapshot image per
//! recipe identity, the binary copied once) — against the scripted model
//! server. Skips (prints "skipped: …") without the binary, dockerd or the
//! test image; fails under `HARNESS_REQUIRE_REAL=1`.

use std::collections::BTreeMap;

use harness_agent_e2e::cases::AgentUnderTest;
use harness_agent_e2e::*;
use harness_codex::{CodexConfig, CodexHarness, SHELL_TOOL_NAME};
use harness_core::harness::Harness;
use harness_core::part::StreamPart;
use harness_core::sandbox::{collect_exec, ExecRequest, NetworkPolicy, SandboxSpec};
use harness_core::ErrorKind;
use harness_testkit::model::*;

fn harness() -> Option<CodexHarness> {
    match CodexConfig::from_env() {
        Ok(c) => Some(CodexHarness::new(c)),
        Err(e) => {
            harness_testkit::skip_or_fail(&format!("codex binary: {e}"));
            None
        }
    }
}

fn env_for(server: &ScriptedModel) -> BTreeMap<String, String> {
    let mut env: BTreeMap<String, String> = server.codex_env().into_iter().collect();
    env.insert("OPENAI_BASE_URL".into(), server.v1_url());
    env
}

async fn text_streams_while_the_agent_runs(kind: BackendKind) {
    let Some(h) = harness() else { return };
    let Some(b) = Backend::get(kind).await else {
        return;
    };
    let server = b
        .model(Script::new().on(
            any(),
            Reply::text_chunks(["Streaming ", "one ", "chunk ", "at a time."]).with_delay(400),
        ))
        .await;
    let mut s = new_session(&b, &h, "cx-stream").await;
    let run = run_turn(&mut s, &h, "stream please", &env_for(&server)).await;
    server.assert_no_failures();
    assert_eq!(run.exit_code, 0, "{}", run.stderr);
    assert_eq!(run.text(), "Streaming one chunk at a time.");
    assert_eq!(run.finish_reason(), Some("stop"));
    assert!(
        matches!(&run.parts[0], StreamPart::StreamStart { agent_session_id: Some(id) } if !id.is_empty())
    );
    // Parts were parsed from the spool before the process exited. `codex
    // exec --json` prints the answer as one completed item just before it
    // exits, so whether its delta is seen before the exit is a race with
    // the poll interval (lost more often on Docker, where each poll is two
    // execs); the thread start, printed while the model is still streaming
    // slowly (4 chunks, 400 ms apart), is not.
    assert!(
        run.parts[..run.parts_while_running]
            .iter()
            .any(|p| matches!(p, StreamPart::StreamStart { .. })),
        "nothing parsed before exit: {} of {} parts while running",
        run.parts_while_running,
        run.parts.len()
    );
    s.destroy().await;
}

async fn agent_writes_a_file_the_test_reads_and_reads_a_file_the_test_wrote(kind: BackendKind) {
    let Some(h) = harness() else { return };
    let Some(b) = Backend::get(kind).await else {
        return;
    };
    let mut s = new_session(&b, &h, "cx-files").await;
    write_text(s.sandbox.as_ref(), "input.txt", "secret-from-test-42\n").await;
    let server = b
        .model(
            Script::new()
                .rule(
                    Rule::new(
                        last_is_tool_result_for("toolu_cat"),
                        Reply::text("Read it."),
                    )
                    .assert_tool_result_contains("toolu_cat", "secret-from-test-42"),
                )
                .rule(
                    Rule::new(
                        last_is_tool_result_for(BASH_CALL_ID),
                        Reply::text("Wrote it."),
                    )
                    .assert_tool_result_contains(BASH_CALL_ID, "agent-was-here"),
                )
                .on(
                    last_user_text_contains("read the input"),
                    Reply::tool(ToolCall::shell("toolu_cat", "cat input.txt")),
                )
                .on(
                    last_user_text_contains("write a file"),
                    Reply::shell(
                        BASH_CALL_ID,
                        "echo agent-was-here > made.txt && cat made.txt",
                    ),
                ),
        )
        .await;
    let env = env_for(&server);
    let run = run_turn(&mut s, &h, "write a file", &env).await;
    server.assert_no_failures();
    assert_eq!(run.exit_code, 0, "{}", run.stderr);
    assert_eq!(
        read_all(s.sandbox.as_ref(), "made.txt").await,
        "agent-was-here\n"
    );
    assert!(run.parts.iter().any(|p| matches!(p, StreamPart::ToolCall { tool_name, input, .. } if tool_name == SHELL_TOOL_NAME && input["command"].as_str().is_some_and(|c| c.contains("made.txt")))));
    assert!(run.parts.iter().any(|p| matches!(p, StreamPart::ToolResult { output, is_error: false, .. } if output["aggregated_output"].as_str().is_some_and(|o| o.contains("agent-was-here")) && output["exit_code"] == 0)));
    assert_eq!(run.text(), "Wrote it.");

    s.agent_session_id = None;
    let run = run_turn(&mut s, &h, "read the input", &env).await;
    server.assert_no_failures();
    assert_eq!(run.exit_code, 0, "{}", run.stderr);
    assert_eq!(run.text(), "Read it.");
    s.destroy().await;
}

async fn abort_keeps_parts_and_the_session_goes_on(kind: BackendKind) {
    let Some(h) = harness() else { return };
    let Some(b) = Backend::get(kind).await else {
        return;
    };
    let chunks: Vec<String> = (0..40).map(|i| format!("slow{i} ")).collect();
    let server = b
        .model(
            Script::new()
                .on(
                    last_user_text_contains("after the abort"),
                    Reply::text("Still here."),
                )
                .on(any(), Reply::text_chunks(chunks).with_delay(500)),
        )
        .await;
    let mut s = new_session(&b, &h, "cx-abort").await;
    let env = env_for(&server);
    let proc = start_turn(&mut s, &h, "talk slowly", &env).await;
    // `codex exec --json` prints no text deltas (only whole items), so the
    // test kills the turn once the thread has started and the model is still
    // slowly streaming its answer.
    let run = follow(&mut s, &h, proc, |parts| {
        parts.iter().any(|p| {
            matches!(
                p,
                StreamPart::StreamStart {
                    agent_session_id: Some(_)
                }
            )
        })
    })
    .await;
    assert_ne!(run.exit_code, 0, "killed, not finished");
    assert!(
        run.parts.iter().any(|p| matches!(
            p,
            StreamPart::StreamStart {
                agent_session_id: Some(_)
            }
        )),
        "{:?}",
        run.parts
    );
    assert!(!run.text().contains("slow39"), "the turn was cut short");
    assert_eq!(run.finish_reason(), None);
    // Codex persists its rollout lazily: a turn killed this early leaves a
    // thread id that `exec resume` refuses — "no rollout found" when the
    // file is missing, "rollout … is empty" when it was created but not
    // written yet. The next turn then starts a new thread in the same
    // sandbox (documented in docs/agents.md); when the rollout has content,
    // it resumes.
    let thread = s.agent_session_id.clone().expect("thread id");
    let found = collect_exec(
        s.sandbox
            .exec(ExecRequest::shell(format!(
                "find {}/sessions -name '*{thread}*.jsonl' -size +0c 2>/dev/null",
                h.state_dirs(&s.home)[0]
            )))
            .await
            .unwrap(),
    )
    .await
    .unwrap()
    .stdout_str();
    if found.trim().is_empty() {
        println!("aborted thread {thread} has no written rollout: next turn starts a new thread");
        s.agent_session_id = None;
    }
    // The next turn in the same session works.
    let next = run_turn(&mut s, &h, "after the abort", &env).await;
    assert_eq!(next.exit_code, 0, "{}", next.stderr);
    assert_eq!(next.text(), "Still here.");
    assert_eq!(next.finish_reason(), Some("stop"));
    s.destroy().await;
}

/// Network policy, with the key handed to the agent directly (no broker:
/// `harness-cli/tests/broker.rs` covers the broker). Local: this backend is
/// made without the sandbox gate, so deny-all is refused at create
/// (`Unsupported`) rather than run on the host network.
/// Docker: under deny-all the container cannot reach the model server on
/// the host, so Codex reports a connection error and the model sees no
/// request; the same turn under allow-all succeeds.
async fn network_policy(kind: BackendKind) {
    let Some(h) = harness() else { return };
    let Some(b) = Backend::get(kind).await else {
        return;
    };
    let server = b
        .model(Script::new().on(any(), Reply::text("reached")))
        .await;
    let env = env_for(&server);
    let mut deny = SandboxSpec::new("/workspace");
    deny.network = NetworkPolicy::DenyAll;
    match kind {
        BackendKind::Local => {
            let err = match new_session_with(&b, &h, "cx-deny", deny).await {
                Ok(s) => {
                    s.destroy().await;
                    panic!("the local sandbox accepted deny-all");
                }
                Err(e) => e,
            };
            assert_eq!(err.kind(), ErrorKind::Unsupported, "{err}");
        }
        BackendKind::Docker => {
            let mut s = new_session_with(&b, &h, "cx-deny", deny)
                .await
                .expect("deny-all sandbox");
            // Codex does not give up without a network: it reports
            // "Reconnecting... waiting for network (Connection failed: …)"
            // as an error event about every 10 s and keeps waiting (request
            // and stream retry limits do not end that wait); the parser makes
            // it a `model-retry` warning. So the test waits for that warning
            // and then aborts the turn.
            let reported = |parts: &[StreamPart]| {
                parts.iter().any(|p| {
                    matches!(p, StreamPart::Warning { code, message, .. }
                        if code == "model-retry" && message.to_lowercase().contains("connection failed"))
                })
            };
            let proc = start_turn(&mut s, &h, "are you there", &env).await;
            let run = follow(&mut s, &h, proc, reported).await;
            println!(
                "deny-all turn: exit {}, errors: {:?}",
                run.exit_code,
                run.errors()
            );
            assert!(reported(&run.parts), "{:?}", run.parts);
            assert!(
                server.model_requests().is_empty(),
                "a deny-all container reached the model server"
            );
            assert_ne!(run.finish_reason(), Some("stop"), "{:?}", run.parts);
            assert!(run.text().is_empty(), "{:?}", run.parts);
            s.destroy().await;
        }
    }
    let mut s = new_session(&b, &h, "cx-allow").await;
    let run = run_turn(&mut s, &h, "are you there", &env).await;
    server.assert_no_failures();
    assert_eq!(run.exit_code, 0, "{}", run.stderr);
    assert_eq!(run.text(), "reached");
    assert_eq!(server.model_requests().len(), 1);
    s.destroy().await;
}

/// The shared cases (`harness_agent_e2e::cases`) for this agent.
struct Codex;

impl AgentUnderTest for Codex {
    fn tag(&self) -> &'static str {
        "cx"
    }
    fn harness(&self) -> Option<Box<dyn Harness>> {
        harness().map(|h| Box::new(h) as Box<dyn Harness>)
    }
    fn env_for(&self, server: &ScriptedModel) -> BTreeMap<String, String> {
        env_for(server)
    }
    fn transcripts_command(&self, state_dir: &str) -> String {
        format!("find {state_dir}/sessions -name '*.jsonl'")
    }
    fn shell_output(&self, part: &StreamPart) -> Option<String> {
        match part {
            StreamPart::ToolResult { output, .. } => {
                output["aggregated_output"].as_str().map(str::to_string)
            }
            _ => None,
        }
    }
}

agent_cases!(Codex;
    second_turn_resumes_with_the_first_turns_context,
    sessions_have_distinct_sandboxes_and_state,
    cross_process_resume,
    config_workdir_and_env,
);

on_both_backends!(
    text_streams_while_the_agent_runs,
    agent_writes_a_file_the_test_reads_and_reads_a_file_the_test_wrote,
    second_turn_resumes_with_the_first_turns_context,
    sessions_have_distinct_sandboxes_and_state,
    abort_keeps_parts_and_the_session_goes_on,
    cross_process_resume,
    config_workdir_and_env,
    network_policy,
);

mod child {
    /// The second process of `cross_process_resume`; does nothing unless
    /// that test starts it (with the turn in `HARNESS_E2E_CHILD_TURN`).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "run by cross_process_resume as its child process"]
    async fn resume_and_run_next_turn() {
        let Some(h) = super::harness() else { return };
        super::child_main(&h).await;
    }
}
