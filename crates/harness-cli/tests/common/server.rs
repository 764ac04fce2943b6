//! `harness serve` as a child process, and the HTTP calls every serve
//! test makes: what `tests/serve.rs` (over HTTP) and `tests/web.rs` (in a
//! browser) share.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use harness_testkit::model::ScriptedModel;
use harness_testkit::{require_env, skip_or_fail};
use serde_json::{json, Value};

pub const HOST: &str = "host-token-0123456789";
pub const CLIENT: &str = "client-token-0123456789";
pub const RUNNER: &str = "runner-token-0123456789";
pub const TOOL_HOST: &str = "tool-host-token-0123456789";
pub const TURN_TIMEOUT: Duration = Duration::from_secs(180);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Agent {
    Claude,
    Codex,
}

impl Agent {
    pub fn name(self) -> &'static str {
        match self {
            Agent::Claude => "claude-code",
            Agent::Codex => "codex",
        }
    }
    pub fn available(self) -> bool {
        match self {
            Agent::Claude => require_env("HARNESS_CLAUDE_BIN").is_some(),
            Agent::Codex => require_env("HARNESS_CODEX_BIN").is_some(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Local,
    Docker,
}

impl Backend {
    pub fn name(self) -> &'static str {
        match self {
            Backend::Local => "local",
            Backend::Docker => "docker",
        }
    }
}

/// The Docker test image and the bridge gateway (where the model listens
/// so containers reach it), or a skip.
pub async fn docker_parts() -> Option<(String, IpAddr)> {
    let image = std::env::var("HARNESS_TEST_IMAGE")
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "harness-test:bookworm".into());
    let inspect = Command::new("docker")
        .args(["image", "inspect", &image, "--format", "ok"])
        .output();
    if !matches!(&inspect, Ok(o) if o.status.success()) {
        skip_or_fail(&format!("no Docker engine or no image {image}"));
        return None;
    }
    let docker = match harness::docker::DockerProvider::connect(Default::default()).await {
        Ok(docker) => docker,
        Err(e) => {
            skip_or_fail(&format!("cannot reach the Docker engine: {e}"));
            return None;
        }
    };
    match docker.bridge_gateway().await {
        Some(gw) => Some((image, gw)),
        None => {
            skip_or_fail("cannot find the Docker bridge gateway");
            None
        }
    }
}

/// The approval MCP server, built into this test's target directory.
pub fn approval_server() -> Option<PathBuf> {
    harness_testkit::gate::helper_binary("harness-approval-mcp")
}

/// The host-tool bridge, built into this test's target directory.
pub fn relay_bridge() -> Option<PathBuf> {
    harness_testkit::gate::helper_binary("harness-relay-mcp")
}

/// The sandbox gate (forwards to the model broker; deny-all on local),
/// built into this test's target directory.
pub fn sandbox_gate() -> Option<PathBuf> {
    harness_testkit::gate::gate_binary()
}

/// Give a harness child the helper binaries.
pub fn with_helpers(cmd: &mut Command) {
    if let Some(gate) = sandbox_gate() {
        cmd.env("HARNESS_SANDBOX_GATE_BIN", gate);
    }
    if let Some(server) = approval_server() {
        cmd.env("HARNESS_APPROVAL_MCP_BIN", server);
    }
    if let Some(bridge) = relay_bridge() {
        cmd.env("HARNESS_RELAY_MCP_BIN", bridge);
    }
}

/// One `harness serve` child.
pub struct Serve {
    process: ChildProcess,
    pub base: String,
}

/// A `harness` child whose stderr is collected line by line (each line also
/// shown to `on_line`); SIGKILLed when dropped.
pub struct ChildProcess {
    child: Child,
    stderr: Arc<Mutex<String>>,
}

impl ChildProcess {
    pub fn spawn(
        cmd: &mut Command,
        what: &str,
        mut on_line: impl FnMut(&str) + Send + 'static,
    ) -> Self {
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("{what} does not start: {e}"));
        let stderr = child.stderr.take().unwrap();
        let log = Arc::new(Mutex::new(String::new()));
        let sink = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                on_line(&line);
                let mut log = sink.lock().unwrap();
                log.push_str(&line);
                log.push('\n');
            }
        });
        ChildProcess { child, stderr: log }
    }

    /// Send `signal` (`-STOP`, `-CONT`, …) with kill(1). A `-STOP` returns
    /// once every thread of the process is stopped: kill(2) only queues a
    /// stop, and on a loaded machine the process's other threads go on
    /// for a while (long enough to take a request sent right after — seen
    /// in CI: a prompt sent after the signal was stored before the stop).
    pub fn signal(&self, signal: &str) {
        let pid = self.child.id();
        let status = Command::new("kill")
            .args([signal, &pid.to_string()])
            .status()
            .unwrap();
        assert!(status.success());
        if signal == "-STOP" {
            let started = std::time::Instant::now();
            while !all_threads_stopped(pid) {
                assert!(
                    started.elapsed() < Duration::from_secs(30),
                    "process {pid} did not stop in 30 s after SIGSTOP"
                );
                std::thread::sleep(Duration::from_millis(5));
            }
        }
    }

    /// SIGKILL, and wait for the process to be gone.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Its stderr so far.
    pub fn log(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    /// Wait (bounded) for the process to exit by itself: its status, or
    /// `None` if it still runs after `limit`.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let started = std::time::Instant::now();
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            if started.elapsed() > limit {
                return None;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for ChildProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

impl Serve {
    /// Start `harness serve` on a free loopback port in `home`, its agents
    /// pointed at `model`.
    pub fn start(home: &Path, model: &ScriptedModel, extra: &[&str]) -> Serve {
        Self::start_with_env(home, model, extra, &[])
    }

    /// [`Serve::start`] with more environment for the server.
    pub fn start_with_env(
        home: &Path,
        model: &ScriptedModel,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Serve {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_harness"));
        cmd.arg("--home")
            .arg(home)
            .args(["serve", "--addr", "127.0.0.1:0"])
            .args(["--token", &format!("{HOST}=host")])
            .args(["--token", &format!("{CLIENT}=client")])
            .args(["--token", &format!("{RUNNER}=runner")])
            .args(["--token", &format!("{TOOL_HOST}=tool-host")])
            .args(extra)
            .env("ANTHROPIC_API_KEY", "test")
            .env("ANTHROPIC_BASE_URL", model.base_url())
            .env("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1")
            .env("OPENAI_API_KEY", "test")
            .env("OPENAI_BASE_URL", model.v1_url())
            .env_remove("HARNESS_TOKENS")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        with_helpers(&mut cmd);
        let (tx, rx) = std::sync::mpsc::channel();
        let process = ChildProcess::spawn(&mut cmd, "harness serve", move |line| {
            if let Some(url) = line.strip_prefix("serving sessions on ") {
                let _ = tx.send(url.split_whitespace().next().unwrap_or("").to_string());
            }
        });
        let base = rx
            .recv_timeout(Duration::from_secs(120))
            .unwrap_or_else(|_| panic!("harness serve did not start:\n{}", process.log()));
        Serve { process, base }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    pub fn ws_url(&self, path: &str) -> String {
        format!("{}{path}", self.base.replacen("http://", "ws://", 1))
    }

    /// SIGKILL, and wait for the server to be gone.
    pub fn kill(&mut self) {
        self.process.kill();
    }

    /// Send `signal` (`-STOP`, `-CONT`, `-KILL`, …).
    pub fn signal(&self, signal: &str) {
        self.process.signal(signal);
    }

    pub fn log(&self) -> String {
        self.process.log()
    }

    /// Wait (bounded) for the server to exit by itself.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        self.process.wait_exit(limit)
    }
}

/// Whether every thread of `pid` is stopped (`T` in its `/proc` stat).
fn all_threads_stopped(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks.flatten().all(|task| {
        std::fs::read_to_string(task.path().join("stat")).is_ok_and(|stat| {
            // `pid (comm) state …`: the state follows the last `)`.
            stat.rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().next())
                .is_some_and(|state| state == "T" || state == "t")
        })
    })
}

pub fn http() -> reqwest::Client {
    reqwest::Client::new()
}

pub async fn post(url: &str, token: &str, body: Value) -> (u16, Value) {
    let r = http()
        .post(url)
        .bearer_auth(token)
        .json(&body)
        .send()
        .await
        .expect("the server answers");
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

pub async fn create(serve: &Serve, body: Value) -> String {
    let (status, info) = post(&serve.url("/v1/sessions"), HOST, body).await;
    assert_eq!(status, 201, "create: {info}");
    info["session"].as_str().unwrap().to_string()
}

pub async fn prompt(serve: &Serve, id: &str, text: &str) -> String {
    let (status, ack) = post(
        &serve.url(&format!("/v1/sessions/{id}/messages")),
        CLIENT,
        json!({"type": "prompt", "text": text}),
    )
    .await;
    assert_eq!(status, 200, "prompt: {ack}");
    ack["turnId"]
        .as_str()
        .expect("the ack names the turn")
        .to_string()
}

/// `DELETE /v1/sessions/{id}` with the host token; its status.
pub async fn delete(serve: &Serve, id: &str) -> u16 {
    http()
        .delete(serve.url(&format!("/v1/sessions/{id}")))
        .bearer_auth(HOST)
        .send()
        .await
        .expect("the server answers")
        .status()
        .as_u16()
}

pub async fn export(serve: &Serve, id: &str) -> Vec<Value> {
    serde_json::from_value(get_json(serve, &format!("/v1/sessions/{id}/export")).await).unwrap()
}

/// `GET path` with the client token, its JSON body.
pub async fn get_json(serve: &Serve, path: &str) -> Value {
    get_json_as(serve, path, CLIENT).await
}

/// `GET path` with `token`, its JSON body.
pub async fn get_json_as(serve: &Serve, path: &str, token: &str) -> Value {
    http()
        .get(serve.url(path))
        .bearer_auth(token)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// A `harness worker` (Temporal) or `harness runner` (remote engine) child
/// serving a server's turns.
pub type Worker = ChildProcess;

impl Worker {
    pub fn start(home: &Path, serve: &Serve, model: &ScriptedModel, queue: &str) -> Worker {
        Self::connect(home, &serve.base, model, "worker", &[], queue, &[])
    }

    /// A `harness worker` writing to whichever of `nodes` answers.
    pub fn start_on_nodes(
        home: &Path,
        nodes: &[Serve],
        model: &ScriptedModel,
        queue: &str,
    ) -> Worker {
        let servers: Vec<&str> = nodes.iter().map(|n| n.base.as_str()).collect();
        Self::connect(home, &servers.join(","), model, "worker", &[], queue, &[])
    }

    /// [`Worker::start`] with more environment for the worker.
    pub fn start_with_env(
        home: &Path,
        serve: &Serve,
        model: &ScriptedModel,
        queue: &str,
        env: &[(&str, &str)],
    ) -> Worker {
        Self::connect(home, &serve.base, model, "worker", &[], queue, env)
    }

    /// `harness runner` for a server on `--engine remote`.
    pub fn runner(home: &Path, serve: &Serve, model: &ScriptedModel) -> Worker {
        Self::runner_with_env(home, serve, model, &[])
    }

    /// [`Worker::runner`] with more environment for the runner.
    pub fn runner_with_env(
        home: &Path,
        serve: &Serve,
        model: &ScriptedModel,
        env: &[(&str, &str)],
    ) -> Worker {
        Self::connect(
            home,
            &serve.base,
            model,
            "runner",
            &["--slice-ms", "1000"],
            "",
            env,
        )
    }

    /// `harness COMMAND --server …` as a runner of `serve`.
    fn connect(
        home: &Path,
        server: &str,
        model: &ScriptedModel,
        command: &str,
        extra: &[&str],
        queue: &str,
        env: &[(&str, &str)],
    ) -> Worker {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_harness"));
        with_helpers(&mut cmd);
        cmd.arg("--home")
            .arg(home)
            .args([command, "--server", server, "--token", RUNNER])
            .args(extra)
            .env("HARNESS_TEMPORAL_TASK_QUEUE", queue)
            .env("ANTHROPIC_API_KEY", "test")
            .env("ANTHROPIC_BASE_URL", model.base_url())
            .env("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        ChildProcess::spawn(&mut cmd, command, |_| {})
    }
}

/// Whether the Temporal dev server answers on 127.0.0.1:7233.
pub async fn temporal_answers() -> bool {
    matches!(
        tokio::time::timeout(
            Duration::from_secs(5),
            tokio::net::TcpStream::connect("127.0.0.1:7233"),
        )
        .await,
        Ok(Ok(_))
    )
}

/// [`temporal_answers`], after skip_or_fail when not.
pub async fn temporal_reachable() -> bool {
    if !temporal_answers().await {
        skip_or_fail("no Temporal server on 127.0.0.1:7233 (cargo xtask services start)");
        return false;
    }
    true
}

/// `HARNESS_S3_ENDPOINT`, when something answers there (after a skip that
/// names `what` is left out, when not).
pub async fn s3_endpoint(what: &str) -> Option<String> {
    let Some(endpoint) = std::env::var("HARNESS_S3_ENDPOINT")
        .ok()
        .filter(|s| !s.is_empty())
    else {
        skip_or_fail(&format!("HARNESS_S3_ENDPOINT is not set; {what}"));
        return None;
    };
    let addr = endpoint
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_string();
    let reachable = matches!(
        tokio::time::timeout(
            Duration::from_secs(5),
            tokio::net::TcpStream::connect(&addr)
        )
        .await,
        Ok(Ok(_))
    );
    if !reachable {
        skip_or_fail(&format!("no S3 server at {endpoint}; {what}"));
    }
    reachable.then_some(endpoint)
}

/// Settings under which Temporal moves a dead worker's slice on in seconds.
pub const FAST_TEMPORAL: [(&str, &str); 2] = [
    ("HARNESS_TEMPORAL_HEARTBEAT_TIMEOUT_MS", "2000"),
    ("HARNESS_TEMPORAL_RETRY_INITIAL_MS", "300"),
];

/// The server on Temporal, its Temporal tuned so a dead worker's slice
/// moves on in seconds; `None` (after skip_or_fail) without Temporal.
pub async fn temporal_server(home: &Path, model: &ScriptedModel, queue: &str) -> Option<Serve> {
    if !temporal_reachable().await {
        return None;
    }
    Some(Serve::start_with_env(
        home,
        model,
        &["--engine", "temporal", "--slice-ms", "1000"],
        &[
            ("HARNESS_TEMPORAL_TASK_QUEUE", queue),
            FAST_TEMPORAL[0],
            FAST_TEMPORAL[1],
        ],
    ))
}

/// A `harness relay-host` child serving `session` of `serve` with the
/// tools of `tools_file`; started once it says it is attached.
pub struct RelayHost {
    pub process: ChildProcess,
}

impl RelayHost {
    pub fn start(serve: &Serve, session: &str, tools_file: &Path, extra: &[&str]) -> RelayHost {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_harness"));
        cmd.args(["relay-host", "--server", &serve.base, "--token", TOOL_HOST])
            .args(["--session", session])
            .arg("--tools")
            .arg(tools_file)
            .args(extra)
            .env_remove("HARNESS_TOKEN")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let (tx, rx) = std::sync::mpsc::channel();
        let process = ChildProcess::spawn(&mut cmd, "harness relay-host", move |line| {
            if line.contains("attached as the tool host") {
                let _ = tx.send(());
            }
        });
        if rx.recv_timeout(Duration::from_secs(60)).is_err() {
            panic!("harness relay-host did not attach:\n{}", process.log());
        }
        RelayHost { process }
    }
}

/// Processes of local sandboxes under `home` (their environment names the
/// sandbox root, `HARNESS_SANDBOX_ROOT`): the agents a server started there.
pub fn sandbox_processes(home: &Path) -> Vec<i32> {
    let root = format!("HARNESS_SANDBOX_ROOT={}", home.join("sandboxes").display());
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(env) = std::fs::read(entry.path().join("environ")) else {
            continue;
        };
        if env
            .split(|b| *b == 0)
            .any(|v| v.starts_with(root.as_bytes()))
        {
            pids.push(pid);
        }
    }
    pids
}

/// A temporary `harness` home that, when dropped after the servers using
/// it, first kills the agents they left running in its local sandboxes
/// ([`sandbox_processes`]): a SIGKILLed server does not end its turns
/// (they are durable), so its agents go on after the test, writing into
/// the directory as it is removed, so that the removal fails and the
/// detached model broker, which stops when its directory goes, stays.
pub struct ServeHome(tempfile::TempDir);

impl ServeHome {
    pub fn new() -> Self {
        ServeHome(tempfile::tempdir().unwrap())
    }

    pub fn path(&self) -> &Path {
        self.0.path()
    }
}

impl Drop for ServeHome {
    fn drop(&mut self) {
        for pid in sandbox_processes(self.0.path()) {
            let _ = Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status();
        }
    }
}
