//! `harness demo`: the whole path — a prompt through the home's session
//! runtime, a real agent turn in a local sandbox on the in-process engine,
//! the SQLite log — with the model scripted (no key, no network).

use std::collections::BTreeMap;

use anyhow::{bail, Context, Result};
use harness::core::frame::{FrameBody, SessionId};
use harness::core::session::{SandboxConfig, SessionConfig};
use harness::core::turn::TurnStatus;
use harness_scripted_model::{Script, ScriptedModel};

use crate::home::Home;
use crate::local::{self, EngineSpec};
use crate::turn::{run_local, summary, Driver};
use crate::AgentKind;

pub(crate) const FILE: &str = "hello.txt";
pub(crate) const GREETING: &str = "hello from the sandbox";

/// The demo's script: every prompt (any number of turns) gets a Bash
/// call writing the greeting, then a text answer quoting it.
pub(crate) fn script() -> Script {
    Script::bash_each_turn(
        format!("echo '{GREETING}' > {FILE} && cat {FILE}"),
        format!("I wrote {FILE}; it says \"{GREETING}\"."),
    )
}

/// The agents' environment pointing at a scripted model.
pub(crate) fn model_env(model: &ScriptedModel) -> BTreeMap<String, String> {
    let mut env: BTreeMap<String, String> = model.claude_env().into_iter().collect();
    env.extend(model.codex_env());
    env.insert("OPENAI_BASE_URL".into(), model.v1_url());
    env
}

/// Run the demo.
pub async fn run(home: &Home, agent: AgentKind, keep: bool) -> Result<()> {
    let lock = match crate::turn::driver(home, "the demo").await? {
        Driver::Local(lock) => lock,
        Driver::Remote(_, info) => bail!(
            "harness serve (pid {}) drives this home; try the demo against it with `harness serve --demo`, or use another --home",
            info.pid
        ),
    };
    let model = ScriptedModel::start(script())
        .await
        .context("starting the built-in scripted model")?;
    eprintln!(
        "harness demo: a real {} turn in a local sandbox, against the scripted model at {}",
        agent.name(),
        model.base_url()
    );
    let options = local::Options {
        agents: vec![agent],
        env: model_env(&model),
        image: None,
        limits: Default::default(),
        engine: EngineSpec::InProcess,
        lenient: false,
        require_docker: false,
        require_cloudflare: false,
        cluster: None,
        docker_pool: 0,
    };
    let config = SessionConfig {
        agent: agent.name().to_string(),
        sandbox: SandboxConfig::default(),
        model: None,
        approvals: false,
        budget: Default::default(),
    };
    let prompt = format!("Create {FILE} with a greeting, then tell me what it says.");
    let (runtime, ended) = run_local(home, &lock, options, None, config, prompt).await?;

    let session = SessionId::parse(&ended.session)?;
    let log = runtime.hub().log().clone();
    let info = log.info(&session).await?;
    let handle = info
        .meta
        .sandbox
        .clone()
        // A turn that could not make its sandbox (a full disk, a refused
        // directory) says why in its own error: show that, not the symptom.
        .with_context(|| format!("the turn recorded no sandbox: {}", summary(&ended)))?;
    let sandbox = local::provider(home, &handle.provider, None)
        .await?
        .resume(&handle)
        .await?;
    let content = harness::core::stream::collect(sandbox.read_file(FILE).await?, 1 << 20).await;
    let frames = log.read(&session, 0, 10_000).await?;
    let stored_messages = frames
        .iter()
        .filter(|f| matches!(f.body, FrameBody::Message { .. }))
        .count();
    println!();
    println!("{}", summary(&ended));
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
            ended.session, handle.id, ended.session
        );
    } else {
        sandbox.destroy().await?;
    }
    if !failures.is_empty() {
        bail!("the scripted model saw unexpected requests: {failures:?}");
    }
    if ended.status != TurnStatus::Finished {
        bail!("{}", summary(&ended));
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
