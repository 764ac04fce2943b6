//! Shared e2e helper: create a sandbox with the adapter's bootstrap recipe,
//! run a turn detached (spool outside the workdir), tail the stdout spool
//! until the process exits, and feed every line to the adapter's parser.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use futures::StreamExt;
use harness_core::harness::{Harness, TurnContext};
use harness_core::part::StreamPart;
use harness_core::sandbox::{
    collect_exec, DetachedProcess, DetachedRequest, DetachedStatus, ExecRequest, Sandbox,
    SandboxProvider, SandboxSpec,
};
use harness_core::turn::TurnState;

/// Longest a scripted turn may take before the test fails.
pub const TURN_TIMEOUT: Duration = Duration::from_secs(120);

/// One session: a sandbox, its home, and the agent's session id.
pub struct Session {
    pub sandbox: Box<dyn Sandbox>,
    pub home: String,
    pub id: String,
    pub agent_session_id: Option<String>,
    turns: u32,
}

/// What one turn produced.
#[derive(Debug)]
pub struct TurnRun {
    pub parts: Vec<StreamPart>,
    /// How many parts had been parsed while the process was still running.
    /// Exit code -1 means the test killed the process.
    pub parts_while_running: usize,
    pub exit_code: i32,
    pub stderr: String,
    pub process: DetachedProcess,
}

impl TurnRun {
    pub fn text(&self) -> String {
        self.parts
            .iter()
            .filter_map(|p| match p {
                StreamPart::TextDelta { delta, .. } => Some(delta.as_str()),
                _ => None,
            })
            .collect()
    }
    pub fn finish_reason(&self) -> Option<&str> {
        self.parts.iter().rev().find_map(|p| match p {
            StreamPart::Finish { finish_reason, .. } => Some(finish_reason.as_str()),
            _ => None,
        })
    }
}

/// Create a session sandbox from the adapter's recipe; its home is the
/// sandbox's own `$HOME`.
pub async fn new_session(
    provider: &dyn SandboxProvider,
    harness: &dyn Harness,
    id: &str,
    image: Option<String>,
) -> Session {
    let mut spec = SandboxSpec::new("/workspace");
    spec.image = image;
    spec.session_id = Some(id.to_string());
    spec.bootstrap = Some(harness.bootstrap_recipe().expect("recipe"));
    let sandbox = provider.create(&spec).await.expect("create sandbox");
    let out = collect_exec(
        sandbox
            .exec(ExecRequest::shell("echo \"$HOME\""))
            .await
            .unwrap(),
    )
    .await
    .unwrap();
    let mut home = out.stdout_str().trim().to_string();
    if home.is_empty() || home == "/" {
        home = "/root".into();
    }
    Session {
        sandbox,
        home,
        id: id.to_string(),
        agent_session_id: None,
        turns: 0,
    }
}

/// Start a turn detached; returns the process and the parser.
pub async fn start_turn(
    session: &mut Session,
    harness: &dyn Harness,
    prompt: &str,
    env: &BTreeMap<String, String>,
) -> DetachedProcess {
    session.turns += 1;
    let turn_id = format!("t{}", session.turns);
    let mut state = TurnState::new(&session.id, &turn_id, harness.name(), prompt);
    state.agent_session_id = session.agent_session_id.clone();
    let ctx = TurnContext {
        state: &state,
        workdir: session.sandbox.workdir(),
        home: &session.home,
        env,
        model: None,
        system_prompt: None,
    };
    let cmd = harness.turn_command(&ctx).expect("turn command");
    session
        .sandbox
        .spawn_detached(DetachedRequest {
            argv: cmd.argv,
            cwd: Some(cmd.cwd),
            env: cmd.env,
            // Outside the working tree, so it never travels with checkpoints.
            spool_dir: format!("{}/.harness/turns/{turn_id}", session.home),
        })
        .await
        .expect("spawn agent")
}

/// Tail the spool until the process exits (or `stop` says to abort), parsing
/// complete lines as they arrive. `stop` sees the parts so far and returns
/// true to kill the process.
pub async fn follow(
    session: &mut Session,
    harness: &dyn Harness,
    process: DetachedProcess,
    mut stop: impl FnMut(&[StreamPart]) -> bool,
) -> TurnRun {
    let mut parser = harness.parser();
    let mut parts = Vec::new();
    let mut cursor = 0u64;
    let mut pending: Vec<u8> = Vec::new();
    let mut parts_while_running = 0usize;
    let started = Instant::now();
    let mut killed = false;
    loop {
        let status = session
            .sandbox
            .detached_status(&process)
            .await
            .expect("status");
        // Read after probing, so an exited process's output is complete.
        let mut stream = session
            .sandbox
            .read_file_from(&process.stdout_path, cursor)
            .await
            .expect("read spool");
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.expect("spool chunk");
            cursor += chunk.len() as u64;
            pending.extend_from_slice(&chunk);
        }
        while let Some(nl) = pending.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = pending.drain(..=nl).collect();
            let line = String::from_utf8_lossy(&line[..line.len() - 1]).into_owned();
            parts.extend(parser.push_line(&line));
        }
        if status == DetachedStatus::Running {
            parts_while_running = parts.len();
        }
        if let Some(id) = parser.agent_session_id() {
            session.agent_session_id = Some(id);
        }
        // A killed process group takes its exit-code writer with it, so a
        // killed turn shows as `Lost`; report it as exit code -1.
        let ended = match status {
            DetachedStatus::Exited { code } => Some(code),
            DetachedStatus::Lost if killed => Some(-1),
            DetachedStatus::Lost => panic!("agent process lost"),
            DetachedStatus::Running => None,
        };
        if let Some(code) = ended {
            if !pending.is_empty() {
                let line = String::from_utf8_lossy(&pending).into_owned();
                parts.extend(parser.push_line(&line));
            }
            let stderr = read_all(session.sandbox.as_ref(), &process.stderr_path).await;
            let parts_while_running = if killed {
                parts.len()
            } else {
                parts_while_running
            };
            return TurnRun {
                parts,
                parts_while_running,
                exit_code: code,
                stderr,
                process,
            };
        }
        if !killed && stop(&parts) {
            session.sandbox.kill_detached(&process).await.expect("kill");
            killed = true;
        }
        assert!(
            started.elapsed() < TURN_TIMEOUT,
            "turn did not finish in {TURN_TIMEOUT:?}; parts so far: {parts:#?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Run a whole turn.
pub async fn run_turn(
    session: &mut Session,
    harness: &dyn Harness,
    prompt: &str,
    env: &BTreeMap<String, String>,
) -> TurnRun {
    let p = start_turn(session, harness, prompt, env).await;
    follow(session, harness, p, |_| false).await
}

pub async fn read_all(sandbox: &dyn Sandbox, path: &str) -> String {
    let mut s = sandbox.read_file(path).await.expect("read file");
    let mut buf = Vec::new();
    while let Some(c) = s.next().await {
        buf.extend_from_slice(&c.expect("chunk"));
    }
    String::from_utf8_lossy(&buf).into_owned()
}

pub async fn write_text(sandbox: &dyn Sandbox, path: &str, text: &str) {
    let body = bytes::Bytes::from(text.to_string());
    let stream: harness_core::stream::ByteStream =
        Box::pin(futures::stream::once(async move { Ok(body) }));
    sandbox.write_file(path, stream).await.expect("write file");
}
