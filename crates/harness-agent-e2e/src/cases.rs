//! The cases both agents run the same way: each is an async fn of an
//! [`AgentUnderTest`] and a [`BackendKind`], called from an agent's e2e
//! file (`agent_cases!` there makes the `local::…` and `docker::…` tests).
//! What differs between the agents — their binary, their environment for
//! the scripted model, where they keep a session's transcript, the shape
//! of a shell tool's result — is asked of the agent. Cases whose course
//! differs (streaming, abort, network policy) stay in each agent's file.

use std::collections::BTreeMap;

use harness_core::harness::Harness;
use harness_core::part::StreamPart;
use harness_core::sandbox::{collect_exec, ExecRequest, SandboxSpec};
use harness_testkit::model::*;

use crate::*;

/// What the shared cases need to know of one agent.
pub trait AgentUnderTest: Sync {
    /// The prefix of the session ids the cases make (`cc`, `cx`).
    fn tag(&self) -> &'static str;
    /// The agent's harness, or `None` after a skip (no binary).
    fn harness(&self) -> Option<Box<dyn Harness>>;
    /// The agent's environment for reaching `server`.
    fn env_for(&self, server: &ScriptedModel) -> BTreeMap<String, String>;
    /// A shell command that lists the transcript files under the agent's
    /// state directory `state_dir`, each named `<agent session id>.jsonl`
    /// or ending so.
    fn transcripts_command(&self, state_dir: &str) -> String;
    /// The text a shell tool's result carries, if `part` is one.
    fn shell_output(&self, part: &StreamPart) -> Option<String>;
}

/// The agent and the backend of a case, or `None` after a skip.
async fn parts(
    agent: &dyn AgentUnderTest,
    kind: BackendKind,
) -> Option<(Box<dyn Harness>, Backend)> {
    let harness = agent.harness()?;
    let backend = Backend::get(kind).await?;
    Some((harness, backend))
}

/// Turn 2 of a session resumes the agent's session of turn 1: the same id,
/// and the model sees turn 1's exchange. The transcript lives where
/// `state_dirs` says, under the session's home.
pub async fn second_turn_resumes_with_the_first_turns_context(
    agent: &dyn AgentUnderTest,
    kind: BackendKind,
) {
    let Some((h, b)) = parts(agent, kind).await else {
        return;
    };
    let h = h.as_ref();
    let server = b
        .model(
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
        .await;
    let mut s = new_session(&b, h, &format!("{}-resume", agent.tag())).await;
    let env = agent.env_for(&server);
    let r1 = run_turn(&mut s, h, "first question", &env).await;
    assert_eq!(r1.exit_code, 0, "{}", r1.stderr);
    let id1 = s.agent_session_id.clone().expect("session id");
    let r2 = run_turn(&mut s, h, "second question", &env).await;
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
    let dir = &h.state_dirs(&s.home)[0];
    let out = collect_exec(
        s.sandbox
            .exec(ExecRequest::shell(agent.transcripts_command(dir)))
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
    s.destroy().await;
}

/// Two sessions: two sandboxes, two agent sessions; what one writes the
/// other neither sees nor has in its state.
pub async fn sessions_have_distinct_sandboxes_and_state(
    agent: &dyn AgentUnderTest,
    kind: BackendKind,
) {
    let Some((h, be)) = parts(agent, kind).await else {
        return;
    };
    let h = h.as_ref();
    let server = be
        .model(
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
        .await;
    let env = agent.env_for(&server);
    let mut a = new_session(&be, h, &format!("{}-iso-a", agent.tag())).await;
    let mut b = new_session(&be, h, &format!("{}-iso-b", agent.tag())).await;
    assert_ne!(a.sandbox.handle().id, b.sandbox.handle().id);
    if kind == BackendKind::Local {
        // Host directories: each session has its own workdir and home.
        // (In Docker both are /workspace and /root, in separate containers.)
        assert_ne!(a.sandbox.workdir(), b.sandbox.workdir());
        assert_ne!(a.home, b.home);
    }
    let ra = run_turn(&mut a, h, "make mine", &env).await;
    let rb = run_turn(&mut b, h, "list yours", &env).await;
    server.assert_no_failures();
    assert_eq!((ra.exit_code, rb.exit_code), (0, 0));
    let b_listing = rb
        .parts
        .iter()
        .find_map(|p| agent.shell_output(p))
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
    a.destroy().await;
    b.destroy().await;
}

/// Turn 1 here; the sandbox is detached and turn 2 runs in another process
/// (the agent's test binary re-run as `child::resume_and_run_next_turn`),
/// which resumes the sandbox from the handle JSON and the agent from its
/// session id. The scripted model asserts turn 2's request carries turn 1.
pub async fn cross_process_resume(agent: &dyn AgentUnderTest, kind: BackendKind) {
    let Some((h, b)) = parts(agent, kind).await else {
        return;
    };
    let h = h.as_ref();
    let server = b
        .model(
            Script::new()
                .rule(
                    Rule::new(
                        last_user_text_contains("question from process two"),
                        Reply::text("Answer from process two."),
                    )
                    .assert_user_texts_contain("question from process one")
                    .assert_assistant_texts_contain("Answer one: zebra-17."),
                )
                .on(
                    last_user_text_contains("question from process one"),
                    Reply::text("Answer one: zebra-17."),
                ),
        )
        .await;
    let env = agent.env_for(&server);
    let mut s = new_session(&b, h, &format!("{}-xproc", agent.tag())).await;
    let r1 = run_turn(&mut s, h, "question from process one", &env).await;
    assert_eq!(r1.exit_code, 0, "{}", r1.stderr);
    let id1 = s.agent_session_id.clone().expect("session id");
    let (session_id, home, turns_done) = (s.id.clone(), s.home.clone(), s.turns);
    // Only the handle's JSON crosses the process boundary.
    let handle = s.detach().await;
    let _guard = DockerGuard::new(kind, &handle);
    let handle = serde_json::to_value(handle).unwrap();
    let child = run_child(
        "child::resume_and_run_next_turn",
        &ChildTurn {
            backend: kind,
            handle: serde_json::from_value(handle.clone()).unwrap(),
            session_id,
            home,
            agent_session_id: Some(id1.clone()),
            turns_done,
            prompt: "question from process two".into(),
            env,
        },
    )
    .await;
    server.assert_no_failures();
    assert_eq!(child.exit_code, 0, "{}", child.stderr);
    assert_eq!(child.text, "Answer from process two.");
    assert_eq!(child.finish_reason.as_deref(), Some("stop"));
    assert_eq!(child.agent_session_id.as_deref(), Some(id1.as_str()));
    let reqs = server.model_requests();
    assert_eq!(reqs.len(), 2, "one model request per turn");
    assert!(reqs[1]
        .assistant_texts()
        .iter()
        .any(|t| t.contains("Answer one: zebra-17.")));
    // The child left the sandbox running; resume it here once more to clean up.
    let sandbox = b
        .provider
        .resume(&serde_json::from_value(handle).unwrap())
        .await
        .expect("resume after the child");
    sandbox.destroy().await.unwrap();
}

/// Two configurations: a different workdir and a different value of an env
/// var set in the `SandboxSpec`. The agent's shell tool runs `pwd` and
/// prints the variable; the scripted model asserts the tool result shows
/// both.
pub async fn config_workdir_and_env(agent: &dyn AgentUnderTest, kind: BackendKind) {
    let Some((h, b)) = parts(agent, kind).await else {
        return;
    };
    let h = h.as_ref();
    let mut seen_workdirs = Vec::new();
    for (i, (workdir, mark)) in [
        ("/workspace", "mark-alpha-501"),
        ("/srv/app-two", "mark-beta-502"),
    ]
    .into_iter()
    .enumerate()
    {
        let mut spec = SandboxSpec::new(workdir);
        spec.env.insert("HARNESS_E2E_MARK".into(), mark.to_string());
        let mut s = new_session_with(&b, h, &format!("{}-config-{i}", agent.tag()), spec)
            .await
            .expect("create sandbox");
        if kind == BackendKind::Docker {
            // In a container the spec's workdir is the real path. (The local
            // sandbox records it and works in its own host directory.)
            assert_eq!(s.sandbox.workdir(), workdir);
        }
        let real_workdir = s.sandbox.workdir().to_string();
        let server = b
            .model(
                Script::new()
                    .rule(
                        Rule::new(last_is_tool_result_for("toolu_env"), Reply::text("seen"))
                            .assert_tool_result_contains(
                                "toolu_env",
                                format!("pwd={real_workdir}\n"),
                            )
                            .assert_tool_result_contains("toolu_env", format!("mark={mark}")),
                    )
                    .on(
                        any(),
                        Reply::shell(
                            "toolu_env",
                            "echo \"pwd=$(pwd)\"; echo \"mark=$HARNESS_E2E_MARK\"",
                        ),
                    ),
            )
            .await;
        let run = run_turn(&mut s, h, "show config", &agent.env_for(&server)).await;
        server.assert_no_failures();
        assert_eq!(run.exit_code, 0, "{}", run.stderr);
        assert_eq!(run.text(), "seen");
        seen_workdirs.push(real_workdir);
        s.destroy().await;
    }
    assert_ne!(seen_workdirs[0], seen_workdirs[1]);
}

/// For each named shared case, an `async fn(BackendKind)` in the calling
/// test file that runs it for `$agent` — so `on_both_backends!` makes its
/// `local::…` and `docker::…` tests like those of the agent's own cases.
#[macro_export]
macro_rules! agent_cases {
    ($agent:expr; $($case:ident),* $(,)?) => {
        $(
            async fn $case(kind: $crate::BackendKind) {
                $crate::cases::$case(&$agent, kind).await
            }
        )*
    };
}
