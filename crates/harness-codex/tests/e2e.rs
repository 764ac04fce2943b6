//! Codex end to end: the real `codex` binary, installed by the
//! adapter's bootstrap recipe into a real local sandbox, against the scripted
//! model server. Skips (prints "skipped: …") without the binary; fails
//! under `HARNESS_REQUIRE_REAL=1`.

mod support;

use std::collections::BTreeMap;

use harness_codex::{CodexConfig, CodexHarness, SHELL_TOOL_NAME};
use harness_core::harness::Harness;
use harness_core::part::StreamPart;
use harness_core::sandbox::{collect_exec, ExecRequest, SandboxProvider};
use harness_testkit::model::*;
use sandbox_local::LocalProvider;
use support::*;

fn harness() -> Option<CodexHarness> {
    match CodexConfig::from_env() {
        Ok(c) => Some(CodexHarness::new(c)),
        Err(e) => {
            harness_testkit::skip_or_fail(&format!("codex binary: {e}"));
            None
        }
    }
}

fn provider() -> LocalProvider {
    // A stable root so the bootstrap template (the 400 MB binary) is built
    // once and reused across runs.
    let cache = std::env::var("HARNESS_CACHE").unwrap_or_else(|_| "/var/cache/harness".into());
    LocalProvider::new(format!("{cache}/e2e-local-sandboxes"))
}

fn env_for(server: &ScriptedModel) -> BTreeMap<String, String> {
    let mut env: BTreeMap<String, String> = server.codex_env().into_iter().collect();
    env.insert("OPENAI_BASE_URL".into(), server.v1_url());
    env
}

fn has_delta_before(run: &TurnRun, n: usize) -> bool {
    run.parts[..n]
        .iter()
        .any(|p| matches!(p, StreamPart::TextDelta { .. }))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_streams_while_the_agent_runs() {
    let Some(h) = harness() else { return };
    let server = ScriptedModel::start(Script::new().on(
        any(),
        Reply::text_chunks(["Streaming ", "one ", "chunk ", "at a time."]).with_delay(400),
    ))
    .await
    .unwrap();
    let p = provider();
    let mut s = new_session(&p, &h, "cx-stream", None).await;
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
    s.sandbox.destroy().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_writes_a_file_the_test_reads_and_reads_a_file_the_test_wrote() {
    let Some(h) = harness() else { return };
    let p = provider();
    let mut s = new_session(&p, &h, "cx-files", None).await;
    write_text(s.sandbox.as_ref(), "input.txt", "secret-from-test-42\n").await;
    let server = ScriptedModel::start(
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
    .await
    .unwrap();
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
    s.sandbox.destroy().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn second_turn_resumes_with_the_first_turns_context() {
    let Some(h) = harness() else { return };
    let server = ScriptedModel::start(
        Script::new()
            .rule(
                Rule::new(
                    last_user_text_contains("second question"),
                    Reply::text("Second answer."),
                )
                .assert_user_texts_contain("first question")
                .assert_assistant_texts_contain("First answer alpha."),
            )
            .on(
                last_user_text_contains("first question"),
                Reply::text("First answer alpha."),
            ),
    )
    .await
    .unwrap();
    let p = provider();
    let mut s = new_session(&p, &h, "cx-resume", None).await;
    let env = env_for(&server);
    let r1 = run_turn(&mut s, &h, "first question", &env).await;
    assert_eq!(r1.exit_code, 0, "{}", r1.stderr);
    let id1 = s.agent_session_id.clone().expect("session id");
    let r2 = run_turn(&mut s, &h, "second question", &env).await;
    server.assert_no_failures();
    assert_eq!(r2.exit_code, 0, "{}", r2.stderr);
    assert_eq!(r2.text(), "Second answer.");
    assert_eq!(s.agent_session_id.as_deref(), Some(id1.as_str()));
    let reqs = server.model_requests();
    assert_eq!(reqs.len(), 2);
    assert!(reqs[1]
        .assistant_texts()
        .iter()
        .any(|t| t.contains("First answer alpha.")));
    // The state lives where state_dirs says, under the session's home.
    let dir = &h.state_dirs(&s.home)[0];
    let out = collect_exec(
        s.sandbox
            .exec(ExecRequest::shell(format!(
                "find {dir}/sessions -name '*.jsonl'"
            )))
            .await
            .unwrap(),
    )
    .await
    .unwrap();
    assert!(
        out.stdout_str().contains(&format!("{id1}.jsonl")),
        "{}",
        out.stdout_str()
    );
    s.sandbox.destroy().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_have_distinct_sandboxes_and_state() {
    let Some(h) = harness() else { return };
    let server = ScriptedModel::start(
        Script::new()
            .on(last_is_tool_result(), Reply::text("listed"))
            .on(
                last_user_text_contains("make mine"),
                Reply::shell("toolu_a", "echo a > only-a.txt && ls"),
            )
            .on(
                last_user_text_contains("list yours"),
                Reply::shell("toolu_b", "ls -a; echo end-of-list"),
            ),
    )
    .await
    .unwrap();
    let p = provider();
    let env = env_for(&server);
    let mut a = new_session(&p, &h, "cx-iso-a", None).await;
    let mut b = new_session(&p, &h, "cx-iso-b", None).await;
    assert_ne!(a.sandbox.workdir(), b.sandbox.workdir());
    assert_ne!(a.home, b.home);
    let ra = run_turn(&mut a, &h, "make mine", &env).await;
    let rb = run_turn(&mut b, &h, "list yours", &env).await;
    server.assert_no_failures();
    assert_eq!((ra.exit_code, rb.exit_code), (0, 0));
    let b_listing = rb
        .parts
        .iter()
        .find_map(|p| match p {
            StreamPart::ToolResult { output, .. } => {
                output["aggregated_output"].as_str().map(str::to_string)
            }
            _ => None,
        })
        .expect("b's ls result");
    assert!(b_listing.contains("end-of-list"), "{b_listing}");
    assert!(!b_listing.contains("only-a.txt"), "{b_listing}");
    assert!(b.sandbox.read_file("only-a.txt").await.is_err());
    assert_ne!(a.agent_session_id, b.agent_session_id);
    // B's state directory knows nothing of A's agent session.
    let out = collect_exec(
        b.sandbox
            .exec(ExecRequest::shell(format!(
                "ls -R {}",
                h.state_dirs(&b.home)[0]
            )))
            .await
            .unwrap(),
    )
    .await
    .unwrap();
    let a_id = a.agent_session_id.clone().unwrap();
    assert!(!out.stdout_str().contains(&a_id));
    a.sandbox.destroy().await.unwrap();
    b.sandbox.destroy().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_keeps_parts_and_the_session_goes_on() {
    let Some(h) = harness() else { return };
    let chunks: Vec<String> = (0..40).map(|i| format!("slow{i} ")).collect();
    let server = ScriptedModel::start(
        Script::new()
            .on(
                last_user_text_contains("after the abort"),
                Reply::text("Still here."),
            )
            .on(any(), Reply::text_chunks(chunks).with_delay(500)),
    )
    .await
    .unwrap();
    let p = provider();
    let mut s = new_session(&p, &h, "cx-abort", None).await;
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
    // thread id that `exec resume` refuses ("no rollout found"). The next
    // turn then starts a new thread in the same sandbox (documented in
    // docs/agents.md); when the rollout exists, it resumes.
    let thread = s.agent_session_id.clone().expect("thread id");
    let found = collect_exec(
        s.sandbox
            .exec(ExecRequest::shell(format!(
                "find {}/sessions -name '*{thread}*.jsonl' 2>/dev/null",
                h.state_dirs(&s.home)[0]
            )))
            .await
            .unwrap(),
    )
    .await
    .unwrap()
    .stdout_str();
    if found.trim().is_empty() {
        println!("aborted thread {thread} has no rollout: next turn starts a new thread");
        s.agent_session_id = None;
    }
    // The next turn in the same session works.
    let next = run_turn(&mut s, &h, "after the abort", &env).await;
    assert_eq!(next.exit_code, 0, "{}", next.stderr);
    assert_eq!(next.text(), "Still here.");
    assert_eq!(next.finish_reason(), Some("stop"));
    s.sandbox.destroy().await.unwrap();
}

#[test]
fn provider_is_local() {
    assert_eq!(provider().name(), "local");
}
