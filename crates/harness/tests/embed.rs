//! The embedding API as the README shows it: `harness::open` on a
//! directory, a session, a prompt whose parts stream, the end — and, after
//! the program's runtime is gone, the same session resumed by id in a new
//! one, its conversation continuing. Real `claude`, local sandbox, the
//! scripted model.

use harness::core::part::StreamPart;
use harness::core::session::SessionConfig;
use harness::core::turn::TurnStatus;
use harness::runtime::TurnUpdate;
use harness_testkit::model::{Script, ScriptedModel};
use harness_testkit::require_env;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_a_session_prompt_stream_and_resume_by_id() {
    if require_env("HARNESS_CLAUDE_BIN").is_none() {
        return;
    }
    let script = Script::bash_each_turn("echo embedded > e.txt && cat e.txt", "Embedded.");
    let model = ScriptedModel::start(script).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let options = || harness::OpenOptions {
        env: Some(model.claude_env().into_iter().collect()),
        ..Default::default()
    };

    let harness = harness::open_with(dir.path(), options()).await.unwrap();
    let session = harness
        .create_session(None, SessionConfig::default())
        .await
        .unwrap();
    let mut turn = session.prompt("write the file").await.unwrap();
    let mut updates = Vec::new();
    while let Some(update) = turn.next().await {
        updates.push(update);
    }
    assert!(
        matches!(
            updates.last(),
            Some(TurnUpdate::Ended {
                status: TurnStatus::Finished,
                ..
            })
        ),
        "{updates:?}"
    );
    let parts: Vec<&StreamPart> = updates
        .iter()
        .filter_map(|u| match u {
            TurnUpdate::Part(p) => Some(p),
            _ => None,
        })
        .collect();
    assert!(parts
        .iter()
        .any(|p| matches!(p, StreamPart::ToolCall { .. })));
    let text: String = parts
        .iter()
        .filter_map(|p| match p {
            StreamPart::TextDelta { delta, .. } => Some(delta.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(text, "Embedded.", "{parts:#?}");
    let id = session.id().clone();
    drop(turn);
    drop(session);
    drop(harness);

    // Another runtime on the same directory resumes the session by id.
    let harness = harness::open_with(dir.path(), options()).await.unwrap();
    let session = harness.session(&id).await.unwrap();
    let outcome = session
        .prompt("again")
        .await
        .unwrap()
        .finish()
        .await
        .unwrap();
    assert_eq!(outcome.status, TurnStatus::Finished, "{outcome:?}");
    assert_eq!(outcome.turn_id, "t2");
    assert_eq!(outcome.text, "Embedded.");
    let info = session.info().await.unwrap();
    assert_eq!(info.meta.turns, 2);
    // The second turn resumed the agent's conversation in the same sandbox.
    assert!(info.meta.agent_session_id.is_some());
    assert!(info.meta.sandbox.is_some());
    model.assert_no_failures();
}
