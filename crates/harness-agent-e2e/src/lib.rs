//! Shared e2e helper: pick a sandbox backend (the local sandbox or Docker),
//! create a sandbox with the adapter's bootstrap recipe, run a turn detached
//! (spool outside the workdir), tail the stdout spool until the process
//! exits, and feed every line to the adapter's parser. Also the plumbing of
//! the cross-process test: re-running this test binary as a child that
//! resumes a detached sandbox.
//!
//! Used by the end-to-end tests of `harness-claude-code` and `harness-codex`
//! (as `use harness_agent_e2e::*;`), so both adapters run the same cases on
//! the same plumbing.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use futures::StreamExt;
use harness_core::harness::{Harness, TurnContext};
use harness_core::part::StreamPart;
use harness_core::sandbox::{
    collect_exec, DetachedProcess, DetachedRequest, DetachedStatus, ExecRequest, Sandbox,
    SandboxHandle, SandboxProvider, SandboxSpec,
};
use harness_core::turn::TurnState;
use harness_testkit::model::{Script, ScriptedModel};
use sandbox_docker::{DockerConfig, DockerProvider};
use sandbox_local::LocalProvider;
use serde::{Deserialize, Serialize};

pub mod cases;

/// Longest a scripted turn may take before the test fails.
pub const TURN_TIMEOUT: Duration = Duration::from_secs(120);

/// Generates one `#[tokio::test]` per backend for each named case: the case
/// is an `async fn(BackendKind)` in the test file; the tests are
/// `local::<case>` and `docker::<case>`, so nextest runs (and reports) each
/// backend on its own.
#[macro_export]
macro_rules! on_both_backends {
    ($($case:ident),* $(,)?) => {
        mod local {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    super::$case(super::BackendKind::Local).await
                }
            )*
        }
        mod docker {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    super::$case(super::BackendKind::Docker).await
                }
            )*
        }
    };
}

/// Which sandbox backend a case runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    /// `sandbox_local::LocalProvider`: host directories and processes.
    Local,
    /// `sandbox_docker::DockerProvider`: containers on the real dockerd.
    Docker,
}

impl BackendKind {
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Local => "local",
            BackendKind::Docker => "docker",
        }
    }
}

/// A sandbox provider plus the host address its sandboxes reach the
/// scripted model on.
#[derive(Debug)]
pub struct Backend {
    pub kind: BackendKind,
    pub provider: Box<dyn SandboxProvider>,
    /// Where the scripted model listens: loopback for the local sandbox
    /// (its commands are host processes), the Docker bridge gateway for
    /// containers (an address of this machine that bridge containers reach).
    model_host: IpAddr,
}

/// The Docker test image: `HARNESS_TEST_IMAGE`, else `harness-test:bookworm`.
pub fn docker_image() -> String {
    std::env::var("HARNESS_TEST_IMAGE")
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "harness-test:bookworm".into())
}

/// A Docker provider on the test image ([`docker_image`]); `None` after
/// `skip_or_fail` when dockerd or the image is missing.
pub async fn docker_image_provider() -> Option<DockerProvider> {
    let config = DockerConfig {
        default_image: docker_image(),
        ..DockerConfig::default()
    };
    let provider = match DockerProvider::connect(config).await {
        Ok(p) => p,
        Err(e) => {
            harness_testkit::skip_or_fail(&format!("no docker engine answers: {e}"));
            return None;
        }
    };
    if provider
        .client()
        .inspect_image(&docker_image())
        .await
        .is_err()
    {
        harness_testkit::skip_or_fail(&format!(
            "docker image {} is missing (build it with `cargo xtask image`)",
            docker_image()
        ));
        return None;
    }
    Some(provider)
}

/// [`docker_image_provider`] and the bridge gateway its containers reach
/// this machine at; `None` after `skip_or_fail` when any is missing.
pub async fn docker_test_provider() -> Option<(DockerProvider, IpAddr)> {
    let provider = docker_image_provider().await?;
    let Some(gateway) = provider.bridge_gateway().await else {
        harness_testkit::skip_or_fail("cannot find the docker bridge gateway address");
        return None;
    };
    Some((provider, gateway))
}

impl Backend {
    /// The backend, or `None` after `skip_or_fail` when its real part
    /// (dockerd, the test image) is missing.
    pub async fn get(kind: BackendKind) -> Option<Backend> {
        match kind {
            BackendKind::Local => {
                // A stable root so the bootstrap template (the agent binary)
                // is built once and reused across runs.
                let cache =
                    std::env::var("HARNESS_CACHE").unwrap_or_else(|_| "/var/cache/harness".into());
                Some(Backend {
                    kind,
                    provider: Box::new(LocalProvider::new(format!("{cache}/e2e-local-sandboxes"))),
                    model_host: IpAddr::V4(Ipv4Addr::LOCALHOST),
                })
            }
            BackendKind::Docker => {
                let (provider, gateway) = docker_test_provider().await?;
                Some(Backend {
                    kind,
                    provider: Box::new(provider),
                    model_host: gateway,
                })
            }
        }
    }

    /// Start the scripted model where this backend's sandboxes reach it.
    pub async fn model(&self, script: Script) -> ScriptedModel {
        ScriptedModel::start_on(SocketAddr::new(self.model_host, 0), script)
            .await
            .unwrap_or_else(|e| panic!("scripted model on {}: {e}", self.model_host))
    }
}

/// One session: a sandbox, its home, and the agent's session id.
#[derive(Debug)]
pub struct Session {
    pub sandbox: Box<dyn Sandbox>,
    pub home: String,
    pub id: String,
    pub agent_session_id: Option<String>,
    pub turns: u32,
    /// A Docker container to remove if the test fails before `destroy`.
    cleanup: Option<String>,
}

impl Session {
    /// A session on a sandbox resumed from a handle (e.g. in another
    /// process), continuing after `turns` turns.
    pub fn resumed(
        sandbox: Box<dyn Sandbox>,
        home: String,
        id: String,
        agent_session_id: Option<String>,
        turns: u32,
    ) -> Session {
        Session {
            sandbox,
            home,
            id,
            agent_session_id,
            turns,
            cleanup: None,
        }
    }

    /// Destroy the sandbox.
    pub async fn destroy(mut self) {
        self.sandbox.destroy().await.expect("destroy sandbox");
        self.cleanup = None;
    }

    /// Detach: the sandbox keeps running; its handle resumes it.
    pub async fn detach(mut self) -> SandboxHandle {
        let handle = self.sandbox.detach().await.expect("detach sandbox");
        self.cleanup = None;
        handle
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        // Best effort, so a failed Docker case leaves no container running.
        if let Some(id) = self.cleanup.take() {
            let _ = std::process::Command::new("docker")
                .args(["rm", "-f", &id])
                .output();
        }
    }
}

/// Removes a Docker container when dropped (best effort), for a sandbox the
/// test holds only as a handle; a no-op for other backends.
#[derive(Debug)]
pub struct DockerGuard(Option<String>);

impl DockerGuard {
    pub fn new(kind: BackendKind, handle: &SandboxHandle) -> DockerGuard {
        DockerGuard((kind == BackendKind::Docker).then(|| handle.id.clone()))
    }
}

impl Drop for DockerGuard {
    fn drop(&mut self) {
        if let Some(id) = self.0.take() {
            let _ = std::process::Command::new("docker")
                .args(["rm", "-f", &id])
                .output();
        }
    }
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
    pub fn errors(&self) -> Vec<String> {
        self.parts
            .iter()
            .filter_map(|p| match p {
                StreamPart::Error { message } => Some(message.clone()),
                _ => None,
            })
            .collect()
    }
}

/// Create a session sandbox (workdir `/workspace`) from the adapter's recipe.
pub async fn new_session(backend: &Backend, harness: &dyn Harness, id: &str) -> Session {
    new_session_with(backend, harness, id, SandboxSpec::new("/workspace"))
        .await
        .expect("create sandbox")
}

/// Create a session sandbox from `spec` plus the session id and the
/// adapter's recipe; its home is the sandbox's own `$HOME`.
pub async fn new_session_with(
    backend: &Backend,
    harness: &dyn Harness,
    id: &str,
    mut spec: SandboxSpec,
) -> harness_core::Result<Session> {
    let id = format!("{id}-{}", backend.kind.name());
    spec.session_id = Some(id.clone());
    spec.bootstrap = Some(harness.bootstrap_recipe().expect("recipe"));
    let sandbox = backend.provider.create(&spec).await?;
    let cleanup = (backend.kind == BackendKind::Docker).then(|| sandbox.handle().id);
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
    Ok(Session {
        sandbox,
        home,
        id,
        agent_session_id: None,
        turns: 0,
        cleanup,
    })
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
        relay_dir: None,
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

// ---- cross-process resume -------------------------------------------------

/// The variable carrying a [`ChildTurn`] (JSON) to the child process.
pub const CHILD_ENV: &str = "HARNESS_E2E_CHILD_TURN";
/// Prefix of the child's result line on its stdout.
const RESULT_PREFIX: &str = "HARNESS_E2E_CHILD_RESULT=";

/// What the parent hands the child: everything needed to resume the
/// session and run its next turn, as a separate process would get it from
/// durable state.
#[derive(Debug, Serialize, Deserialize)]
pub struct ChildTurn {
    pub backend: BackendKind,
    pub handle: SandboxHandle,
    pub session_id: String,
    pub home: String,
    pub agent_session_id: Option<String>,
    pub turns_done: u32,
    pub prompt: String,
    pub env: BTreeMap<String, String>,
}

/// What the child reports back.
#[derive(Debug, Serialize, Deserialize)]
pub struct ChildResult {
    pub exit_code: i32,
    pub text: String,
    pub finish_reason: Option<String>,
    pub agent_session_id: Option<String>,
    pub stderr: String,
}

/// Run the ignored test `child_test` (full path, e.g.
/// `child::resume_and_run_next_turn`) of this very test binary in a new
/// process with `turn` in its environment, and return what it reported.
pub async fn run_child(child_test: &str, turn: &ChildTurn) -> ChildResult {
    let exe = std::env::current_exe().expect("test binary path");
    let json = serde_json::to_string(turn).unwrap();
    let name = child_test.to_string();
    // Blocking wait on a blocking thread: the scripted model keeps serving
    // on the runtime meanwhile.
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(exe)
            .args([
                &name,
                "--exact",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_ENV, json)
            .output()
    })
    .await
    .unwrap()
    .expect("spawn child test process");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "child process failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    let line = stdout
        .lines()
        // libtest prints `test <name> ... ` before the test's own output,
        // on the same line.
        .find_map(|l| l.find(RESULT_PREFIX).map(|i| &l[i + RESULT_PREFIX.len()..]))
        .unwrap_or_else(|| panic!("child printed no result (did it run?):\n{stdout}\n{stderr}"));
    serde_json::from_str(line).expect("child result JSON")
}

/// The child side: resume the sandbox from the handle, run the turn, leave
/// the sandbox running, print the result. Returns false (after printing
/// why) when this process is not a child.
pub async fn child_main(harness: &dyn Harness) -> bool {
    let Ok(json) = std::env::var(CHILD_ENV) else {
        println!("skipped: only runs as the child process of a cross_process test");
        return false;
    };
    let turn: ChildTurn = serde_json::from_str(&json).expect("child turn JSON");
    let backend = Backend::get(turn.backend).await.expect("backend in child");
    let sandbox = backend
        .provider
        .resume(&turn.handle)
        .await
        .expect("resume sandbox from handle");
    let mut session = Session::resumed(
        sandbox,
        turn.home,
        turn.session_id,
        turn.agent_session_id,
        turn.turns_done,
    );
    let run = run_turn(&mut session, harness, &turn.prompt, &turn.env).await;
    let result = ChildResult {
        exit_code: run.exit_code,
        text: run.text(),
        finish_reason: run.finish_reason().map(str::to_string),
        agent_session_id: session.agent_session_id.clone(),
        stderr: run.stderr.clone(),
    };
    session.sandbox.detach().await.expect("detach in child");
    println!("{RESULT_PREFIX}{}", serde_json::to_string(&result).unwrap());
    true
}

/// The approval server binary (`harness_testkit::gate::helper_binary`:
/// `$HARNESS_TEST_APPROVAL_MCP_BIN`, else built with cargo into
/// `<target>/helpers`), or `None` after a skip.
pub fn approval_server_binary() -> Option<std::path::PathBuf> {
    harness_testkit::gate::helper_binary("harness-approval-mcp")
}
