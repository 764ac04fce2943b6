//! Claude Code end to end: the real `claude` binary, installed by the
//! adapter's bootstrap recipe into a real sandbox — every case runs on the
//! local sandbox (`local::…`) and on Docker (`docker::…`, a snapshot image
//! per recipe identity, the binary copied once) — against the scripted
//! model server. Skips (prints "skipped: …") without the binary, dockerd or
//! the test image; fails under `HARNESS_REQUIRE_REAL=1`.

use std::collections::BTreeMap;

use harness_agent_e2e::cases::AgentUnderTest;
use harness_agent_e2e::*;
use harness_claude_code::{ClaudeCodeConfig, ClaudeCodeHarness};
use harness_core::harness::Harness;
use harness_core::part::StreamPart;
use harness_core::sandbox::{NetworkPolicy, SandboxSpec};
use harness_core::ErrorKind;
use harness_testkit::model::*;

fn harness() -> Option<ClaudeCodeHarness> {
    match ClaudeCodeConfig::from_env() {
        Ok(c) => Some(ClaudeCodeHarness::new(c)),
        Err(e) => {
            harness_testkit::skip_or_fail(&format!("claude binary: {e}"));
            None
        }
    }
}

fn env_for(server: &ScriptedModel) -> BTreeMap<String, String> {
    server.claude_env().into_iter().collect()
}

fn has_delta_before(run: &TurnRun, n: usize) -> bool {
    run.parts[..n]
        .iter()
        .any(|p| matches!(p, StreamPart::TextDelta { .. }))
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
    let mut s = new_session(&b, &h, "cc-stream").await;
    let run = run_turn(&mut s, &h, "stream please", &env_for(&server)).await;
    server.assert_no_failures();
    assert_eq!(run.exit_code, 0, "{}", run.stderr);
    assert_eq!(run.text(), "Streaming one chunk at a time.");
    assert_eq!(run.finish_reason(), Some("stop"));
    assert!(
        matches!(&run.parts[0], StreamPart::StreamStart { agent_session_id: Some(id) } if !id.is_empty())
    );
    // Parts were parsed from the spool before the process exited.
    assert!(
        has_delta_before(&run, run.parts_while_running),
        "no text delta before exit: {} of {} parts while running",
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
    let mut s = new_session(&b, &h, "cc-files").await;
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
    assert!(run.parts.iter().any(|p| matches!(p, StreamPart::ToolCall { tool_name, tool_call_id, .. } if tool_name == "Bash" && tool_call_id == BASH_CALL_ID)));
    assert!(run.parts.iter().any(|p| matches!(p, StreamPart::ToolResult { output, is_error: false, .. } if output.as_str().is_some_and(|o| o.contains("agent-was-here")))));
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
    let mut s = new_session(&b, &h, "cc-abort").await;
    let env = env_for(&server);
    let proc = start_turn(&mut s, &h, "talk slowly", &env).await;
    let run = follow(&mut s, &h, proc, |parts| {
        parts
            .iter()
            .filter(|p| matches!(p, StreamPart::TextDelta { .. }))
            .count()
            >= 2
    })
    .await;
    assert_ne!(run.exit_code, 0, "killed, not finished");
    assert!(run
        .parts
        .iter()
        .any(|p| matches!(p, StreamPart::TextStart { .. })));
    assert!(run.text().starts_with("slow0 slow1 "), "{}", run.text());
    assert!(!run.text().contains("slow39"), "the turn was cut short");
    assert_eq!(run.finish_reason(), None);
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
/// the host, so the turn fails with a connection error and the model sees
/// no request; the same turn under allow-all succeeds.
async fn network_policy(kind: BackendKind) {
    let Some(h) = harness() else { return };
    let Some(b) = Backend::get(kind).await else {
        return;
    };
    let server = b
        .model(Script::new().on(any(), Reply::text("reached")))
        .await;
    let mut env = env_for(&server);
    // No retries: a refused connection fails the turn at once.
    env.insert("CLAUDE_CODE_MAX_RETRIES".into(), "0".into());
    let mut deny = SandboxSpec::new("/workspace");
    deny.network = NetworkPolicy::DenyAll;
    match kind {
        BackendKind::Local => {
            let err = match new_session_with(&b, &h, "cc-deny", deny).await {
                Ok(s) => {
                    s.destroy().await;
                    panic!("the local sandbox accepted deny-all");
                }
                Err(e) => e,
            };
            assert_eq!(err.kind(), ErrorKind::Unsupported, "{err}");
        }
        BackendKind::Docker => {
            let mut s = new_session_with(&b, &h, "cc-deny", deny)
                .await
                .expect("deny-all sandbox");
            let run = run_turn(&mut s, &h, "are you there", &env).await;
            assert!(
                server.model_requests().is_empty(),
                "a deny-all container reached the model server"
            );
            assert_ne!(run.exit_code, 0, "{:?}", run.parts);
            assert_eq!(run.finish_reason(), Some("error"), "{:?}", run.parts);
            let errors = run.errors().join("\n").to_lowercase();
            println!("deny-all turn: exit {}, errors: {errors}", run.exit_code);
            assert!(
                errors.contains("connect"),
                "not a connection error: {errors}"
            );
            s.destroy().await;
        }
    }
    let mut s = new_session(&b, &h, "cc-allow").await;
    let run = run_turn(&mut s, &h, "are you there", &env).await;
    server.assert_no_failures();
    assert_eq!(run.exit_code, 0, "{}", run.stderr);
    assert_eq!(run.text(), "reached");
    assert_eq!(server.model_requests().len(), 1);
    s.destroy().await;
}

/// The shared cases (`harness_agent_e2e::cases`) for this agent.
struct Claude;

impl AgentUnderTest for Claude {
    fn tag(&self) -> &'static str {
        "cc"
    }
    fn harness(&self) -> Option<Box<dyn Harness>> {
        harness().map(|h| Box::new(h) as Box<dyn Harness>)
    }
    fn env_for(&self, server: &ScriptedModel) -> BTreeMap<String, String> {
        env_for(server)
    }
    fn transcripts_command(&self, state_dir: &str) -> String {
        format!("ls {state_dir}/projects/*/")
    }
    fn shell_output(&self, part: &StreamPart) -> Option<String> {
        match part {
            StreamPart::ToolResult { output, .. } => output.as_str().map(str::to_string),
            _ => None,
        }
    }
}

agent_cases!(Claude;
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
