//! `harness demo`: the whole path, with the model scripted.

use std::collections::BTreeMap;

use anyhow::{bail, Context, Result};
use harness::core::frame::{FrameBody, SessionId};
use harness::core::log::SessionLog;
use harness::core::turn::TurnStatus;
use harness_testkit::model::{Script, ScriptedModel};

use crate::home::Home;
use crate::turn::{execute, provider, summary, TurnPlan};
use crate::{AgentKind, SandboxKind};

const FILE: &str = "hello.txt";
const GREETING: &str = "hello from the sandbox";

/// Run the demo.
pub async fn run(home: &Home, agent: AgentKind, keep: bool) -> Result<()> {
    let binary = crate::agents::ensure_binary(home, agent).await?;
    let script = Script::bash_then_text_expecting(
        format!("echo '{GREETING}' > {FILE} && cat {FILE}"),
        GREETING,
        format!("I wrote {FILE}; it says \"{GREETING}\"."),
    );
    let model = ScriptedModel::start(script)
        .await
        .context("starting the built-in scripted model")?;
    let mut env: BTreeMap<String, String> = match agent {
        AgentKind::ClaudeCode => model.claude_env().into_iter().collect(),
        AgentKind::Codex => model.codex_env().into_iter().collect(),
    };
    if agent == AgentKind::Codex {
        env.insert("OPENAI_BASE_URL".into(), model.v1_url());
    }
    eprintln!(
        "harness demo: a real {} turn in a local sandbox, against the scripted model at {}",
        agent.name(),
        model.base_url()
    );
    let plan = TurnPlan {
        agent,
        harness: crate::agents::adapter(agent, binary)?,
        sandbox: SandboxKind::Local,
        image: None,
        env,
        model: None,
        session: None,
        slice_ms: None,
        prompt: format!("Create {FILE} with a greeting, then tell me what it says."),
    };
    let (record, state) = execute(home, plan).await?;

    let sandbox = provider(home, &record.sandbox.provider, None)
        .await?
        .resume(&record.sandbox)
        .await?;
    let content = harness::core::stream::collect(sandbox.read_file(FILE).await?, 1 << 20).await;
    let log = harness::sqlite::SqliteSessionLog::open(home.db())?;
    let frames = log.read(&SessionId::parse(&record.id)?, 0, 10_000).await?;
    let stored_messages = frames
        .iter()
        .filter(|f| matches!(f.body, FrameBody::Message { .. }))
        .count();
    println!();
    println!("{}", summary(&state));
    println!(
        "session log: {} frames ({} text message(s) stored once)",
        frames.len(),
        stored_messages
    );
    match &content {
        Ok(bytes) => println!(
            "{FILE} in the sandbox, read through the sandbox API: {:?}",
            String::from_utf8_lossy(bytes).trim()
        ),
        Err(e) => println!("{FILE} could not be read: {e}"),
    }
    let failures = model.failures();
    if keep {
        println!(
            "kept session {} (sandbox {}); continue with `harness run --session {} PROMPT`",
            record.id, record.sandbox.id, record.id
        );
    } else {
        sandbox.destroy().await?;
        home.forget_session(&record.id)?;
    }
    if !failures.is_empty() {
        bail!("the scripted model saw unexpected requests: {failures:?}");
    }
    if state.status != TurnStatus::Finished {
        bail!("{}", summary(&state));
    }
    match content {
        Ok(bytes) if String::from_utf8_lossy(&bytes).trim() == GREETING => Ok(()),
        Ok(bytes) => bail!(
            "{FILE} holds {:?}, not the greeting",
            String::from_utf8_lossy(&bytes)
        ),
        Err(e) => bail!("the agent did not leave {FILE} in the sandbox: {e}"),
    }
}
