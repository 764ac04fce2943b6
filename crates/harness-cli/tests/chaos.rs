//! Chaos trials: real turns (real `claude`, scripted model, the local or the
//! Docker sandbox) on each engine — `harness run` (in-process), `harness
//! serve`, `harness serve --engine temporal` with a `harness worker`,
//! `harness serve --engine remote` with a remote `harness runner` — each
//! killed with SIGKILL at a point drawn from the turn's phases, then
//! restarted. Every trial asserts the turn ends `finished`, the log is
//! gap-free with every part once and one terminal status, the tree holds
//! what the tool wrote, and nothing is left behind (one sandbox for the
//! session).
//!
//! Reproducible from a seed: trial `k` of seed `S` draws its engine,
//! sandbox, phase and delay from `(S, k)` alone. A failed trial prints the
//! command that replays it. `cargo xtask chaos --trials 50 --seed S` runs
//! many (docs/reliability.md); the ordinary test run does a short smoke.
//!
//! Environment: `HARNESS_CHAOS_TRIALS` (default 5), `HARNESS_CHAOS_SEED`
//! (default: from the clock, printed), `HARNESS_CHAOS_TRIAL` (only that
//! one), `HARNESS_CHAOS_ENGINES` and `HARNESS_CHAOS_PHASES`
//! (comma-separated; default all),
//! `HARNESS_CHAOS_REPORT` (append one JSON line per trial to this file).

mod common;

use std::io::Write;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::docker::{container_workdir, docker_sh, session_containers, SessionContainers};
use common::server::{
    create, docker_parts, http, post, prompt, temporal_server, Agent, Serve, Worker, CLIENT,
};
use common::{assert_stored_once, harness, recorded_sandbox};
use harness::core::log::SessionLog;
use harness::core::SessionId;
use harness::sqlite::SqliteSessionLog;
use harness_testkit::model::ScriptedModel;
use harness_testkit::skip_or_fail;
use serde_json::{json, Value};

/// Seconds the scripted tool call sleeps (the window of the tool phase).
const TOOL_SLEEP_S: u32 = 3;
/// Longest a trial waits for a phase or for the end of the turn.
const DEADLINE: Duration = Duration::from_secs(180);
const PROMPT: &str = "do the slow thing";
/// The file under a trial's home the failpoint writes when it is reached.
const FAILPOINT_MARKER: &str = "failpoint-reached";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Engine {
    InProcess,
    Serve,
    Temporal,
    /// `harness serve --engine remote`: the turns run in a `harness
    /// runner` with its own home (where its sandboxes are).
    Runner,
}

impl Engine {
    const ALL: [Engine; 4] = [
        Engine::InProcess,
        Engine::Serve,
        Engine::Temporal,
        Engine::Runner,
    ];

    fn name(self) -> &'static str {
        match self {
            Engine::InProcess => "in-process",
            Engine::Serve => "serve",
            Engine::Temporal => "temporal",
            Engine::Runner => "runner",
        }
    }

    /// What is killed and what replaces it.
    fn victim(self) -> &'static str {
        match self {
            Engine::InProcess => "`harness run`, then `harness resume`",
            Engine::Serve => "`harness serve`, then a new server",
            Engine::Temporal => "`harness worker`, then a new worker",
            Engine::Runner => "the remote `harness runner`, then a new runner",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// The turn's sandbox is made, its handle not yet in the turn's state.
    CreateToRecord,
    /// The turn's sandbox exists, its agent's spool is not claimed yet.
    BeforeClaim,
    /// The spool is claimed, the agent not launched.
    ClaimToLaunch,
    /// The agent runs, its launch has returned, nothing more is done yet
    /// (`process.json` not written, where the slice writes one).
    LaunchToRecord,
    /// The agent's tool call runs (a delay into its sleep).
    ToolCall,
    /// The final answer streams (a delay after the tool result).
    TextStreaming,
    /// The turn waits for a client's approval (servers only: the answer
    /// comes over HTTP after the restart).
    ApprovalWait,
    /// `harness checkpoint` after the turn, between its objects and its
    /// manifest (the in-process CLI, with an S3 server).
    CheckpointUpload,
}

impl Phase {
    const ALL: [Phase; 8] = [
        Phase::CreateToRecord,
        Phase::BeforeClaim,
        Phase::ClaimToLaunch,
        Phase::LaunchToRecord,
        Phase::ToolCall,
        Phase::TextStreaming,
        Phase::ApprovalWait,
        Phase::CheckpointUpload,
    ];

    fn name(self) -> &'static str {
        match self {
            Phase::CreateToRecord => "create-to-record",
            Phase::BeforeClaim => "before-claim",
            Phase::ClaimToLaunch => "claim-to-launch",
            Phase::LaunchToRecord => "launch-to-record",
            Phase::ToolCall => "tool-call",
            Phase::TextStreaming => "text-streaming",
            Phase::ApprovalWait => "approval-wait",
            Phase::CheckpointUpload => "checkpoint-upload",
        }
    }

    /// The `HARNESS_FAILPOINT` that stops the process in this phase; the
    /// others are reached by watching the log and waiting a drawn delay.
    fn failpoint(self) -> Option<&'static str> {
        match self {
            Phase::CreateToRecord => Some("create-to-record"),
            Phase::BeforeClaim => Some("before-claim"),
            Phase::ClaimToLaunch => Some("claim-to-launch"),
            Phase::LaunchToRecord => Some("launch-to-record"),
            Phase::CheckpointUpload => Some("checkpoint-upload"),
            _ => None,
        }
    }

    fn fits(self, engine: Engine, parts: &Parts) -> bool {
        if !parts.phases.is_empty() && !parts.phases.contains(&self) {
            return false;
        }
        match self {
            Phase::ApprovalWait => engine != Engine::InProcess && parts.approvals,
            Phase::CheckpointUpload => engine == Engine::InProcess && parts.s3.is_some(),
            _ => true,
        }
    }
}

/// SplitMix64: tiny, and the same numbers on every machine.
struct Rng(u64);

impl Rng {
    /// The stream of trial `trial`: seed and trial go through the mixer
    /// before they meet, so neighbouring trials' streams are unrelated (a
    /// plain `seed ^ trial·γ` start made trial k+1's first draw trial k's
    /// second).
    fn for_trial(seed: u64, trial: u32) -> Rng {
        Rng(Rng(seed).next() ^ Rng(u64::from(trial).wrapping_add(0xD1B5_4A32_D192_ED03)).next())
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next() % n
        }
    }
}

/// The real parts this machine has.
#[derive(Debug, Clone)]
struct Parts {
    /// The Docker test image and the bridge gateway.
    docker: Option<(String, IpAddr)>,
    /// The approval MCP server is built (approval phases possible).
    approvals: bool,
    /// An S3 endpoint (checkpoint phases possible).
    s3: Option<String>,
    /// Only these phases (`HARNESS_CHAOS_PHASES`); empty: all.
    phases: Vec<Phase>,
}

#[derive(Debug, Clone)]
struct Trial {
    seed: u64,
    /// The `--engine`/`--phase` filters the draw was made under (a replay
    /// needs them too).
    filters: String,
    index: u32,
    engine: Engine,
    docker: bool,
    phase: Phase,
    delay_ms: u64,
}

impl Trial {
    /// Trial `index` of `seed`: every draw made in one fixed order.
    fn draw(seed: u64, index: u32, engines: &[Engine], parts: &Parts, filters: &str) -> Trial {
        let mut rng = Rng::for_trial(seed, index);
        let engine = engines[rng.below(engines.len() as u64) as usize];
        let phases: Vec<Phase> = Phase::ALL
            .into_iter()
            .filter(|p| p.fits(engine, parts))
            .collect();
        assert!(
            !phases.is_empty(),
            "no phase of HARNESS_CHAOS_PHASES fits the {} engine on this machine",
            engine.name()
        );
        let phase = phases[rng.below(phases.len() as u64) as usize];
        let docker = rng.below(2) == 1 && parts.docker.is_some();
        let delay_ms = match phase {
            Phase::ToolCall => rng.below(u64::from(TOOL_SLEEP_S) * 1000 - 700),
            Phase::TextStreaming => rng.below(1500),
            Phase::ApprovalWait => rng.below(1000),
            _ => 0,
        };
        Trial {
            seed,
            filters: filters.to_string(),
            index,
            engine,
            docker,
            phase,
            delay_ms,
        }
    }

    fn sandbox(&self) -> &'static str {
        if self.docker {
            "docker"
        } else {
            "local"
        }
    }

    fn label(&self) -> String {
        let victim = if self.phase == Phase::CheckpointUpload {
            "`harness checkpoint`, then another checkpoint"
        } else {
            self.engine.victim()
        };
        format!(
            "trial {} ({} on {}, kill {victim} at {} +{} ms)",
            self.index,
            self.engine.name(),
            self.sandbox(),
            self.phase.name(),
            self.delay_ms
        )
    }

    fn replay(&self) -> String {
        format!(
            "cargo xtask chaos --seed {} --trial {}{}",
            self.seed, self.index, self.filters
        )
    }
}

fn env_parse<T: std::str::FromStr>(name: &str) -> Option<T> {
    std::env::var(name).ok().and_then(|v| v.trim().parse().ok())
}

/// The members of `all` the comma-separated variable `var` names (by
/// `name`); empty when it is unset or empty.
fn env_list<T: Copy>(var: &str, all: &[T], name: fn(T) -> &'static str) -> Vec<T> {
    std::env::var(var)
        .unwrap_or_default()
        .split(',')
        .map(str::trim)
        .filter(|item| !item.is_empty())
        .map(|item| {
            all.iter()
                .copied()
                .find(|t| name(*t) == item)
                .unwrap_or_else(|| panic!("unknown name {item:?} in {var}"))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(all(feature = "temporal", feature = "s3")),
    ignore = "needs the `temporal` and `s3` features (cargo test -p harness-cli --features full)"
)]
async fn chaos_trials() {
    if !Agent::Claude.available() {
        return;
    }
    let trials: u32 = env_parse("HARNESS_CHAOS_TRIALS").unwrap_or(5);
    let seed: u64 = env_parse("HARNESS_CHAOS_SEED").unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64
            % 1_000_000_007
    });
    let only: Option<u32> = env_parse("HARNESS_CHAOS_TRIAL");
    let engine_filter = env_list("HARNESS_CHAOS_ENGINES", &Engine::ALL, Engine::name);
    let phase_filter = env_list("HARNESS_CHAOS_PHASES", &Phase::ALL, Phase::name);
    let mut engines = if engine_filter.is_empty() {
        Engine::ALL.to_vec()
    } else {
        engine_filter.clone()
    };
    if engines.contains(&Engine::Temporal) && !common::server::temporal_answers().await {
        skip_or_fail(
            "chaos: no Temporal server on 127.0.0.1:7233; the temporal engine is left out",
        );
        engines.retain(|e| *e != Engine::Temporal);
    }
    let parts = Parts {
        docker: docker_parts().await,
        approvals: common::server::approval_server().is_some(),
        s3: common::server::s3_endpoint("chaos: checkpoint trials are left out").await,
        phases: phase_filter.clone(),
    };
    println!(
        "chaos: seed {seed}, {} trial(s) on {}; docker: {}, approvals: {}, s3: {}",
        only.map_or(trials, |_| 1),
        engines
            .iter()
            .map(|e| e.name())
            .collect::<Vec<_>>()
            .join(", "),
        parts.docker.is_some(),
        parts.approvals,
        parts.s3.is_some()
    );
    // What a replay must pass again to draw the same trials.
    let mut filters = String::new();
    if !engine_filter.is_empty() {
        let names: Vec<&str> = engine_filter.iter().map(|e| e.name()).collect();
        filters.push_str(&format!(" --engine {}", names.join(",")));
    }
    if !phase_filter.is_empty() {
        let names: Vec<&str> = phase_filter.iter().map(|p| p.name()).collect();
        filters.push_str(&format!(" --phase {}", names.join(",")));
    }
    let mut failures = Vec::new();
    let mut passed = Vec::new();
    for index in 1..=trials.max(only.unwrap_or(0)) {
        if only.is_some_and(|k| k != index) {
            continue;
        }
        let trial = Trial::draw(seed, index, &engines, &parts, &filters);
        println!("{} …", trial.label());
        let started = Instant::now();
        let result = tokio::spawn(run_trial(trial.clone(), parts.clone())).await;
        let seconds = started.elapsed().as_secs_f64();
        let record = match result {
            Ok(killed_at) => {
                println!("  ok in {seconds:.1} s; the kill landed {}", killed_at);
                let record = json!({"killedAt": killed_at, "ok": true});
                passed.push(trial.clone());
                record
            }
            Err(err) => {
                let message = match err.try_into_panic() {
                    Ok(payload) => payload
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_else(|| "a panic without a message".into()),
                    Err(err) => format!("the trial task ended: {err}"),
                };
                println!(
                    "  FAILED after {seconds:.1} s; replay: {}\n{message}",
                    trial.replay()
                );
                failures.push((trial.clone(), message.clone()));
                json!({"ok": false, "error": message})
            }
        };
        if let Some(path) = std::env::var_os("HARNESS_CHAOS_REPORT") {
            let mut line = json!({
                "seed": seed,
                "trial": index,
                "engine": trial.engine.name(),
                "sandbox": trial.sandbox(),
                "phase": trial.phase.name(),
                "delayMs": trial.delay_ms,
                "seconds": seconds,
            });
            line.as_object_mut()
                .unwrap()
                .extend(record.as_object().unwrap().clone());
            let mut file = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .unwrap();
            writeln!(file, "{line}").unwrap();
        }
    }
    println!("\nchaos report (seed {seed}):");
    println!(
        "{:<11} {:<18} {:>6} {:>6}",
        "engine", "phase", "passed", "failed"
    );
    for engine in Engine::ALL {
        for phase in Phase::ALL {
            let ok = passed
                .iter()
                .filter(|t: &&Trial| t.engine == engine && t.phase == phase)
                .count();
            let bad = failures
                .iter()
                .filter(|(t, _)| t.engine == engine && t.phase == phase)
                .count();
            if ok + bad > 0 {
                println!(
                    "{:<11} {:<18} {ok:>6} {bad:>6}",
                    engine.name(),
                    phase.name()
                );
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} chaos trial(s) failed (seed {seed}); replay each with:\n{}",
        failures.len(),
        failures.len() + passed.len(),
        failures
            .iter()
            .map(|(t, _)| format!("  {}  # {}", t.replay(), t.label()))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// Run one trial; what the log showed when the kill landed.
async fn run_trial(trial: Trial, parts: Parts) -> String {
    let script = common::slow_script_sleeping(TOOL_SLEEP_S);
    let (model, image) = match (&parts.docker, trial.docker) {
        (Some((image, gateway)), true) => (
            ScriptedModel::start_on(SocketAddr::new(*gateway, 0), script)
                .await
                .unwrap(),
            Some(image.clone()),
        ),
        _ => (ScriptedModel::start(script).await.unwrap(), None),
    };
    let home = tempfile::tempdir().unwrap();
    // Dropped before `home`: removes the trial's containers however it ends.
    let _containers = HomeContainers(home.path().to_path_buf());
    let mut killed_at = match trial.engine {
        Engine::InProcess => in_process(&trial, home.path(), &model, &image).await,
        Engine::Serve | Engine::Temporal | Engine::Runner => {
            on_a_server(&trial, home.path(), &model, &image).await
        }
    };
    let (session, frames) = only_session(home.path()).await;
    let context = trial.label();
    assert_stored_once(&frames, &context);
    model.assert_no_failures();
    the_tree_is_intact(&trial, home.path(), &session, &frames);
    if trial.phase == Phase::CheckpointUpload {
        killed_at = checkpoint_killed(&trial, home.path(), &model, &session, &image, &parts).await;
    }
    killed_at
}

/// Removes the Docker containers of every session in a trial's home when
/// dropped — also when the trial fails before it learns its session's id.
struct HomeContainers(PathBuf);

impl Drop for HomeContainers {
    fn drop(&mut self) {
        // No assertion: this also runs while a failed trial unwinds.
        let Ok(out) = Command::new(env!("CARGO_BIN_EXE_harness"))
            .arg("--home")
            .arg(&self.0)
            .args(["sessions", "list"])
            .stdin(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .output()
        else {
            return;
        };
        let listed = String::from_utf8_lossy(&out.stdout);
        if !out.status.success() || !listed.starts_with("SESSION") {
            return;
        }
        // The first column of each row is the session id (no parsing that
        // could panic while a failed trial unwinds).
        for id in listed
            .lines()
            .skip(1)
            .filter_map(|l| l.split_whitespace().next())
        {
            drop(SessionContainers(id.to_string()));
        }
    }
}

/// The environment that stops the killed process at the trial's failpoint.
fn failpoint_env(trial: &Trial, marker: &Path) -> Vec<(&'static str, String)> {
    match trial.phase.failpoint() {
        Some(point) if trial.phase != Phase::CheckpointUpload => vec![
            ("HARNESS_FAILPOINT", point.to_string()),
            ("HARNESS_FAILPOINT_REACHED", marker.display().to_string()),
        ],
        _ => Vec::new(),
    }
}

/// The home's log, once its database exists.
async fn open_log(home: &Path) -> SqliteSessionLog {
    let db = home.join("harness.db");
    let started = Instant::now();
    while !db.exists() {
        assert!(started.elapsed() < DEADLINE, "no log at {}", db.display());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    SqliteSessionLog::open(&db).unwrap()
}

/// Every frame of `session`, as the JSON `harness sessions export` prints.
async fn frames(log: &SqliteSessionLog, session: &SessionId) -> Vec<Value> {
    log.read(session, 0, usize::MAX)
        .await
        .unwrap()
        .iter()
        .map(|f| serde_json::to_value(f).unwrap())
        .collect()
}

/// The home's one session and its frames.
async fn only_session(home: &Path) -> (SessionId, Vec<Value>) {
    let log = open_log(home).await;
    let sessions = log.list().await.unwrap();
    assert_eq!(sessions.len(), 1, "one trial, one session: {sessions:?}");
    let id = sessions[0].session.clone();
    let frames = frames(&log, &id).await;
    (id, frames)
}

fn has_part(frames: &[Value], kind: &str) -> bool {
    frames
        .iter()
        .any(|f| f["body"]["type"] == "part" && f["body"]["part"]["type"] == kind)
}

fn ended(frames: &[Value]) -> Option<Value> {
    frames
        .iter()
        .map(|f| &f["body"])
        .find(|b| {
            b["type"] == "turn-status"
                && matches!(
                    b["status"].as_str(),
                    Some("finished" | "failed" | "timed_out")
                )
        })
        .cloned()
}

/// What the log shows, in a few words (the report's "the kill landed …"):
/// the latest of the parts that mark a phase, in log order.
fn progress(frames: &[Value]) -> String {
    let latest = frames
        .iter()
        .filter(|f| f["body"]["type"] == "part")
        .filter_map(|f| match f["body"]["part"]["type"].as_str()? {
            "tool-approval-request" => Some("the approval request"),
            "tool-call" => Some("the tool call"),
            "tool-result" => Some("the tool result"),
            _ => None,
        })
        .next_back();
    match latest {
        Some(last) => format!("after {last} ({} frames)", frames.len()),
        None => format!(
            "with no agent output in the log yet ({} frames)",
            frames.len()
        ),
    }
}

/// Wait for the trial's phase while `alive` holds, then its delay; what the
/// log showed at that moment. The turn must not have ended: a kill after
/// the end would test nothing.
async fn reach_phase(
    trial: &Trial,
    home: &Path,
    marker: &Path,
    session: Option<&SessionId>,
    mut alive: impl FnMut() -> bool,
) -> String {
    let log = open_log(home).await;
    let started = Instant::now();
    let mut session = session.cloned();
    loop {
        assert!(
            started.elapsed() < DEADLINE,
            "{}: the phase never came",
            trial.label()
        );
        assert!(
            alive(),
            "{}: the process ended before the phase",
            trial.label()
        );
        if session.is_none() {
            session = log.list().await.unwrap().first().map(|i| i.session.clone());
        }
        let seen = match &session {
            Some(id) => frames(&log, id).await,
            None => Vec::new(),
        };
        let reached = match trial.phase {
            Phase::CreateToRecord
            | Phase::BeforeClaim
            | Phase::ClaimToLaunch
            | Phase::LaunchToRecord => marker.exists(),
            Phase::ToolCall => has_part(&seen, "tool-call"),
            Phase::TextStreaming => has_part(&seen, "tool-result"),
            Phase::ApprovalWait => has_part(&seen, "tool-approval-request"),
            Phase::CheckpointUpload => unreachable!("checkpoint trials kill the checkpoint"),
        };
        if reached {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(trial.delay_ms)).await;
    let seen = frames(&log, session.as_ref().unwrap()).await;
    assert!(
        ended(&seen).is_none(),
        "{}: the turn ended before the kill; the phase was missed",
        trial.label()
    );
    if let Some(point) = trial.phase.failpoint() {
        format!("at failpoint {point}, {}", progress(&seen))
    } else {
        progress(&seen)
    }
}

/// `harness run`, killed; `harness resume` finishes the turn.
async fn in_process(
    trial: &Trial,
    home: &Path,
    model: &ScriptedModel,
    image: &Option<String>,
) -> String {
    let marker = home.join(FAILPOINT_MARKER);
    let mut run = harness(home, model);
    run.args(["run", "--slice-ms", "1000"]);
    if let Some(image) = image {
        run.args(["--sandbox", "docker", "--image", image]);
    }
    run.arg(PROMPT).envs(failpoint_env(trial, &marker));
    let mut child = run.spawn().unwrap();
    if trial.phase == Phase::CheckpointUpload {
        // The turn itself runs undisturbed; the kill comes in the checkpoint.
        let out = tokio::task::spawn_blocking(move || child.wait_with_output())
            .await
            .unwrap()
            .unwrap();
        assert!(
            out.status.success(),
            "{}: the run failed:\n{}",
            trial.label(),
            String::from_utf8_lossy(&out.stderr)
        );
        return String::new();
    }
    let killed_at = reach_phase(trial, home, &marker, None, || {
        child.try_wait().unwrap().is_none()
    })
    .await;
    child.kill().unwrap(); // SIGKILL
    let killed = child.wait_with_output().unwrap();
    let mut resume = harness(home, model);
    resume.arg("resume");
    let (ok, stderr) = run_blocking(resume).await;
    assert!(
        ok && stderr.contains("resuming 1 unfinished turn"),
        "{}: resume failed:\n{stderr}\nthe killed run said:\n{}",
        trial.label(),
        String::from_utf8_lossy(&killed.stderr)
    );
    killed_at
}

/// `harness serve` (or its Temporal worker, or its remote runner), killed
/// and replaced.
async fn on_a_server(
    trial: &Trial,
    home: &Path,
    model: &ScriptedModel,
    image: &Option<String>,
) -> String {
    let marker = home.join(FAILPOINT_MARKER);
    let env = failpoint_env(trial, &marker);
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let args = ["--slice-ms", "1000"];
    let queue = format!(
        "chaos-{}-{}-{}",
        std::process::id(),
        trial.seed,
        trial.index
    );
    let (mut serve, mut worker) = match trial.engine {
        Engine::Serve => (Serve::start_with_env(home, model, &args, &env), None),
        Engine::Temporal => {
            let serve = temporal_server(home, model, &queue)
                .await
                .expect("Temporal was reachable when the trials started");
            let worker = Worker::start_with_env(home, &serve, model, &queue, &env);
            (serve, Some(worker))
        }
        Engine::Runner => {
            let serve = Serve::start(home, model, &["--engine", "remote"]);
            let runner = Worker::runner_with_env(&runner_home(home), &serve, model, &env);
            (serve, Some(runner))
        }
        Engine::InProcess => unreachable!(),
    };
    let mut body = json!({"agent": "claude-code", "sandbox": trial.sandbox()});
    if let Some(image) = image {
        body["image"] = json!(image);
    }
    if trial.phase == Phase::ApprovalWait {
        body["approvals"] = json!(true);
    }
    let id = create(&serve, body).await;
    let session = SessionId::parse(id.clone()).unwrap();
    let turn = prompt(&serve, &id, PROMPT).await;
    let killed_at = reach_phase(trial, home, &marker, Some(&session), || true).await;
    let log_before;
    match worker.as_mut() {
        Some(w) => {
            log_before = w.log();
            w.kill();
            worker = Some(match trial.engine {
                Engine::Runner => Worker::runner(&runner_home(home), &serve, model),
                _ => Worker::start(home, &serve, model, &queue),
            });
        }
        None => {
            log_before = serve.log();
            serve.kill();
            serve = Serve::start(home, model, &args);
        }
    }
    let log = open_log(home).await;
    if trial.phase == Phase::ApprovalWait {
        let seen = frames(&log, &session).await;
        let request = seen
            .iter()
            .find(|f| f["body"]["part"]["type"] == "tool-approval-request")
            .expect("the approval request is in the log");
        let approval = request["body"]["part"]["approvalId"].as_str().unwrap();
        let (status, ack) = post(
            &serve.url(&format!("/v1/sessions/{id}/messages")),
            CLIENT,
            json!({"type": "approval-response", "approvalId": approval, "approved": true}),
        )
        .await;
        assert_eq!(status, 200, "{}: the approval: {ack}", trial.label());
    }
    let started = Instant::now();
    let end = loop {
        if let Some(end) = ended(&frames(&log, &session).await) {
            break end;
        }
        assert!(
            started.elapsed() < DEADLINE,
            "{}: turn {turn} did not end\nserver:\n{}\nworker:\n{}\nbefore the kill:\n{log_before}",
            trial.label(),
            serve.log(),
            worker.as_ref().map(Worker::log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(
        end["status"],
        "finished",
        "{}: {end}\nserver:\n{}\nworker:\n{}\nbefore the kill:\n{log_before}",
        trial.label(),
        serve.log(),
        worker.as_ref().map(Worker::log).unwrap_or_default()
    );
    // The turn's end frame is written before the server answers for it:
    // make sure the server holds nothing more (an HTTP read goes through
    // its actor).
    let _ = http()
        .get(serve.url(&format!("/v1/sessions/{id}")))
        .bearer_auth(CLIENT)
        .send()
        .await;
    killed_at
}

/// A remote runner's home: beside the server's, its own (its sandboxes and
/// its in-process turn state live there, not in the server's log).
fn runner_home(home: &Path) -> PathBuf {
    home.join("runner")
}

/// The sandbox the turn recorded holds what the tool wrote, and it is the
/// session's only sandbox (a killed create left none behind).
fn the_tree_is_intact(trial: &Trial, home: &Path, session: &SessionId, frames: &[Value]) {
    let sandbox = recorded_sandbox(frames);
    let label = trial.label();
    if trial.docker {
        let containers = session_containers(session.as_str());
        assert_eq!(
            containers.len(),
            1,
            "{label}: one container: {containers:?}"
        );
        let container = &containers[0];
        assert_eq!(
            sandbox["id"].as_str(),
            Some(container.as_str()),
            "{label}: the turn recorded the session's container: {sandbox}"
        );
        let workdir = container_workdir(container);
        let (ok, out) = docker_sh(container, &format!("cat '{workdir}/slow.txt'"));
        assert!(
            ok && out.trim() == "slow-done",
            "{label}: the tree: {out:?}"
        );
    } else {
        let id = sandbox["id"].as_str().unwrap();
        // The home whose provider made it: a remote runner's own.
        let home = match trial.engine {
            Engine::Runner => runner_home(home),
            _ => home.to_path_buf(),
        };
        let dirs = common::local_sandboxes(&home);
        assert_eq!(
            dirs,
            vec![id.to_string()],
            "{label}: one sandbox for the session"
        );
        let written =
            std::fs::read_to_string(home.join("sandboxes").join(id).join("work/slow.txt"))
                .unwrap_or_default();
        assert_eq!(written.trim(), "slow-done", "{label}: the tree");
    }
}

/// `harness checkpoint` killed between its objects and its manifest: that
/// key restores nothing (a clear error), a second checkpoint restores the
/// tree into a new session.
async fn checkpoint_killed(
    trial: &Trial,
    home: &Path,
    model: &ScriptedModel,
    session: &SessionId,
    image: &Option<String>,
    parts: &Parts,
) -> String {
    let label = trial.label();
    let endpoint = parts.s3.clone().unwrap();
    let base = format!(
        "chaos/{}-{}-{}",
        trial.seed,
        trial.index,
        std::process::id()
    );
    let marker = home.join(FAILPOINT_MARKER);
    let checkpoint = |key: &str| {
        let mut cmd = harness(home, model);
        cmd.args(["checkpoint", "--session", session.as_str(), "--key", key])
            .env("HARNESS_S3_ENDPOINT", &endpoint);
        cmd
    };
    let mut killed = checkpoint(&format!("{base}/killed"))
        .env("HARNESS_FAILPOINT", "checkpoint-upload")
        .env("HARNESS_FAILPOINT_REACHED", &marker)
        .spawn()
        .unwrap();
    let started = Instant::now();
    while !marker.exists() {
        assert!(
            started.elapsed() < DEADLINE,
            "{label}: the checkpoint never uploaded"
        );
        assert!(
            killed.try_wait().unwrap().is_none(),
            "{label}: the checkpoint ended before its failpoint"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    killed.kill().unwrap();
    let _ = killed.wait();
    let out = run_blocking(checkpoint(&format!("{base}/whole"))).await;
    assert!(out.0, "{label}: the second checkpoint: {}", out.1);
    let restore = |key: String| {
        let mut cmd = harness(home, model);
        cmd.args(["restore", "--key", &key, "--new-session"])
            .env("HARNESS_S3_ENDPOINT", &endpoint);
        if let Some(image) = image {
            cmd.args(["--sandbox", "docker", "--image", image]);
        }
        cmd
    };
    let (ok, stderr) = run_blocking(restore(format!("{base}/killed"))).await;
    assert!(
        !ok && stderr.contains("manifest"),
        "{label}: a checkpoint killed before its manifest must not restore: {stderr}"
    );
    let (ok, stderr) = run_blocking(restore(format!("{base}/whole"))).await;
    assert!(ok, "{label}: restoring the whole checkpoint: {stderr}");
    let log = open_log(home).await;
    let restored: Vec<SessionId> = log
        .list()
        .await
        .unwrap()
        .into_iter()
        .map(|i| i.session)
        .filter(|s| s != session)
        .collect();
    assert_eq!(restored.len(), 1, "{label}: one restored session");
    let frames = frames(&log, &restored[0]).await;
    let sandbox = recorded_sandbox(&frames);
    let text = if trial.docker {
        let id = sandbox["id"].as_str().unwrap();
        let workdir = container_workdir(id);
        docker_sh(id, &format!("cat '{workdir}/slow.txt'")).1
    } else {
        std::fs::read_to_string(
            PathBuf::from(sandbox["workdir"].as_str().unwrap()).join("slow.txt"),
        )
        .unwrap_or_default()
    };
    assert_eq!(text.trim(), "slow-done", "{label}: the restored tree");
    "at failpoint checkpoint-upload, after the turn finished".into()
}

/// Run a command to its end off the async threads: (success, stderr).
async fn run_blocking(mut cmd: Command) -> (bool, String) {
    let out = tokio::task::spawn_blocking(move || cmd.output())
        .await
        .unwrap()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}
