//! Time to a ready agent: from `POST /v1/sessions` and a prompt to the
//! agent's first request reaching the model, per provider, next to the
//! agent CLI's own start on the host (`claude -p`, or `codex exec`, with
//! the same prompt, against the same scripted model) measured in the same
//! run, runs of the two interleaved. And where the time goes, from the server's own spans
//! (`harness serve --otlp` to a receiver in this process): what the API
//! and the engine take before the sandbox is made, the sandbox, the
//! slice's steps in the sandbox, the broker's grant, the agent's launch,
//! and the agent's own boot up to its first request (through the broker).
//!
//! ```text
//! cargo xtask bench ready
//! # or: cargo bench -p harness-cli --features full --bench ready
//! # knobs: READY_RUNS (20), READY_TRACE (1: print the last run's spans),
//! #        READY_CASES (local:claude-code,docker:claude-code,
//! #                     docker-warm:claude-code,microvm:codex)
//! ```
//!
//! `docker` is cold (`harness serve --docker-pool 0`: each session's
//! container is created and started on its path); `docker-warm` is the
//! server's default pool of one ready container, refilled in the
//! background after each take: before each of its runs (the bare CLI's
//! too) the bench waits, bounded, until the refill is ready, so a run is
//! a warm start and no fill competes with it. A run that found no ready
//! container is marked `pool miss`. (Sessions arriving faster than a
//! refill — about 1.3 s: the fill's 1 s delay and the container's start
//! — find a pool of one empty every other time: `--docker-pool N`.)
//!
//! A case the server does not offer (no microVM guest, a build without the
//! feature) is reported as not measured. Each provider gets its own
//! `harness serve` (release build) and home.
//! A first, untimed session builds what every later session starts from
//! (the bootstrap template or snapshot, the broker's process), so the
//! timed runs are a server's steady state; each run's session is deleted
//! (sandbox and all) before the next. The model is scripted: it answers
//! every request with a short text, so the turn ends at once.
//! Results: `docs/performance.md`.

#[path = "../tests/common/mod.rs"]
mod common;
#[path = "../tests/common/otlp.rs"]
mod otlp;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::server::{create, delete, prompt, Serve, HOST};
use harness_testkit::model::{Script, ScriptedModel};
use otlp::{Received, Span};
use serde_json::json;

const PROMPT: &str = "Say ready.";

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_string())
}

fn unix_ns(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).unwrap().as_nanos() as u64
}

fn ms(ns: u64) -> f64 {
    ns as f64 / 1e6
}

/// The first model request that arrived after `after` (a count of the
/// requests before), waited for up to `limit`.
async fn first_request_after(model: &ScriptedModel, after: usize, limit: Duration) -> SystemTime {
    let started = Instant::now();
    loop {
        if let Some(request) = model
            .requests()
            .iter()
            .skip(after)
            .find(|r| r.api.is_some())
        {
            return request.received_at;
        }
        assert!(
            started.elapsed() < limit,
            "no model request within {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// The agent a case runs.
#[derive(Clone, Copy, PartialEq)]
enum Agent {
    Claude,
    Codex,
}

impl Agent {
    fn parse(name: &str) -> Result<Agent, String> {
        match name {
            "claude-code" | "claude" => Ok(Agent::Claude),
            "codex" => Ok(Agent::Codex),
            other => Err(format!("unknown agent {other} (claude-code, codex)")),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Agent::Claude => "claude-code",
            Agent::Codex => "codex",
        }
    }

    /// The host binary (`cargo xtask agents` puts it in the environment).
    fn binary(self) -> Result<PathBuf, String> {
        let var = match self {
            Agent::Claude => "HARNESS_CLAUDE_BIN",
            Agent::Codex => "HARNESS_CODEX_BIN",
        };
        std::env::var_os(var)
            .map(PathBuf::from)
            .ok_or_else(|| format!("{var} is not set (`eval \"$(cargo xtask env)\"`)"))
    }

    /// The CLI's own non-interactive start with `PROMPT`: `claude -p`, or
    /// `codex exec`.
    fn bare_command(self, binary: &Path, model: &ScriptedModel) -> tokio::process::Command {
        let mut cmd = tokio::process::Command::new(binary);
        match self {
            Agent::Claude => {
                cmd.args(["-p", PROMPT]).envs(model.claude_env());
            }
            Agent::Codex => {
                cmd.args(["exec", "--skip-git-repo-check"])
                    .args(model.codex_config_args("gpt-5-codex"))
                    .arg(PROMPT)
                    .envs(model.codex_env());
            }
        }
        cmd
    }
}

/// The anchor: the agent CLI on the host, from its spawn to its first
/// request at the model; in a fresh `$HOME` and working directory, as a
/// session's agent starts in a fresh sandbox.
async fn bare_cli(agent: Agent, binary: &Path, model: &ScriptedModel) -> f64 {
    let home = tempfile::tempdir().unwrap();
    let before = model.requests().len();
    let t0 = SystemTime::now();
    let mut child = agent
        .bare_command(binary, model)
        .current_dir(home.path())
        .env("HOME", home.path())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("the agent CLI starts");
    let first = first_request_after(model, before, Duration::from_secs(60)).await;
    let _ = tokio::time::timeout(Duration::from_secs(60), child.wait()).await;
    ms(unix_ns(first) - unix_ns(t0))
}

/// One timed session: its total and, once the spans are in, its stages.
struct Run {
    session: String,
    t0_ns: u64,
    first_ns: u64,
}

impl Run {
    fn total_ms(&self) -> f64 {
        ms(self.first_ns - self.t0_ns)
    }
}

async fn session_run(serve: &Serve, model: &ScriptedModel, body: &serde_json::Value) -> Run {
    let before = model.requests().len();
    let t0 = SystemTime::now();
    let id = create(serve, body.clone()).await;
    run_created(serve, model, id, before, t0).await
}

/// A created session's prompt to its agent's first request (`before`: the
/// model's request count then), its turn's end and its delete.
async fn run_created(
    serve: &Serve,
    model: &ScriptedModel,
    id: String,
    before: usize,
    t0: SystemTime,
) -> Run {
    prompt(serve, &id, PROMPT).await;
    let first = first_request_after(model, before, Duration::from_secs(180)).await;
    wait_idle(serve, &id).await;
    assert_eq!(delete(serve, &id).await, 204, "delete {id}");
    Run {
        session: id,
        t0_ns: unix_ns(t0),
        first_ns: unix_ns(first),
    }
}

/// Until the session's turn has ended; it must have finished.
async fn wait_idle(serve: &Serve, id: &str) {
    let started = Instant::now();
    loop {
        let info = common::server::get_json_as(serve, &format!("/v1/sessions/{id}"), HOST).await;
        match info["meta"]["turn"]["status"].as_str() {
            Some("finished") => return,
            Some("failed" | "timed_out") => {
                panic!("session {id}'s turn failed: {info}\n{}", serve.log())
            }
            _ => {}
        }
        assert!(
            started.elapsed() < Duration::from_secs(180),
            "session {id} did not finish its turn: {info}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Where one session's first seconds went, in ms, from its spans.
#[derive(Default, Clone)]
struct Stages {
    /// POST → the sandbox's creation starts, less the broker's forwards:
    /// create and prompt over HTTP, the actor, the engine's start of the
    /// turn.
    api: f64,
    /// `sandbox.create`: the sandbox made (and, for a new identity, its
    /// bootstrap).
    sandbox: f64,
    /// From the sandbox made to the agent's launch, less the two below:
    /// the slice's resume and its execs in the sandbox ($HOME, the spool
    /// claim).
    harness: f64,
    /// `broker.forwards` (the session's socket served, before the sandbox
    /// is made) and `agent.env` (the session's token and endpoint).
    broker: f64,
    /// The launch exec of the agent (the rest of `agent.start`).
    launch: f64,
    /// The agent's own boot to its first request at the model (through
    /// the broker's hop).
    agent: f64,
}

const STAGE_NAMES: [&str; 6] = ["api", "sandbox", "harness", "broker", "launch", "agent"];

impl Stages {
    fn values(&self) -> [f64; 6] {
        [
            self.api,
            self.sandbox,
            self.harness,
            self.broker,
            self.launch,
            self.agent,
        ]
    }
}

fn stages_of(run: &Run, spans: &[Span]) -> Option<Stages> {
    let create = spans
        .iter()
        .find(|s| s.name == "sandbox.create" && s.attr("session.id") == run.session)?;
    let in_trace = |name: &str| {
        spans
            .iter()
            .filter(|s| s.name == name && s.trace == create.trace)
            .min_by_key(|s| s.start_ns)
    };
    let start = in_trace("agent.start")?;
    let env = in_trace("agent.env")?;
    // Absent without a broker, or where the provider shares the host's
    // network (no forwards to make).
    let forwards = in_trace("broker.forwards").map_or(0.0, Span::ms);
    let api = ms(create.start_ns.saturating_sub(run.t0_ns)) - forwards;
    let sandbox = create.ms();
    let before_start = ms(start.start_ns.saturating_sub(create.end_ns));
    let execs: f64 = spans
        .iter()
        .filter(|s| s.name == "sandbox.exec" && s.parent == start.id)
        .map(Span::ms)
        .sum();
    let broker = forwards + env.ms();
    let launch = (start.ms() - env.ms() - execs).max(0.0);
    let agent = ms(run.first_ns.saturating_sub(start.end_ns));
    Some(Stages {
        api,
        sandbox,
        harness: before_start + execs,
        broker,
        launch,
        agent,
    })
}

/// `READY_TRACE=1`: the last run's spans on its own clock (ms after its
/// POST), to see what the stages sum up.
fn print_timeline(run: &Run, spans: &[Span]) {
    let Some(create) = spans
        .iter()
        .find(|s| s.name == "sandbox.create" && s.attr("session.id") == run.session)
    else {
        return;
    };
    let mut mine: Vec<&Span> = spans
        .iter()
        .filter(|s| s.trace == create.trace || s.attr("session.id") == run.session)
        .filter(|s| s.start_ns <= run.first_ns)
        .collect();
    mine.sort_by_key(|s| s.start_ns);
    println!("  timeline of session {} (ms after the POST):", run.session);
    for s in mine {
        let what = ["what", "part", "http.route", "command"]
            .iter()
            .map(|k| s.attr(k))
            .find(|v| !v.is_empty())
            .unwrap_or("");
        println!(
            "    {:>7.1} .. {:>7.1}  {} {what}",
            ms(s.start_ns.saturating_sub(run.t0_ns)),
            ms(s.end_ns.saturating_sub(run.t0_ns)),
            s.name
        );
    }
    println!("    {:>7.1}  the agent's first request", run.total_ms());
}

/// Wait (bounded by `limit`) until a pooled container is running (only one
/// server with a pool runs at a time here); whether one is.
async fn pool_ready(limit: Duration) -> bool {
    let started = Instant::now();
    loop {
        let listed = Command::new("docker")
            .args(["ps", "-q", "--filter", "label=dev.harness.pool"])
            .output()
            .ok()
            .filter(|o| o.status.success())
            .is_some_and(|o| !o.stdout.is_empty());
        if listed {
            // Running is a moment before it is in the pool's ready list
            // (the provider records it once started).
            tokio::time::sleep(Duration::from_millis(300)).await;
            return true;
        }
        if started.elapsed() > limit {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Wait (bounded) until every run's spans have been exported.
async fn spans_for(runs: &[Run], received: &Received) -> Vec<Span> {
    let started = Instant::now();
    loop {
        let spans = received.lock().unwrap().clone();
        let missing = runs
            .iter()
            .filter(|r| stages_of(r, &spans).is_none())
            .count();
        if missing == 0 || started.elapsed() > Duration::from_secs(30) {
            if missing > 0 {
                println!("({missing} runs' spans never arrived; their stages are left out)");
            }
            return spans;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn p50_p99(values: &[f64]) -> (f64, f64) {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    (percentile(&v, 50.0), percentile(&v, 99.0))
}

/// One case: a provider and the agent it runs.
struct Case {
    /// The case's name in the tables (`docker-warm` for Docker with the
    /// pool).
    name: String,
    /// Arguments of its `harness serve`.
    serve_args: Vec<&'static str>,
    agent: Agent,
    binary: PathBuf,
    body: serde_json::Value,
    /// Its server keeps a pool: each run waits for a ready container.
    pooled: bool,
}

/// `provider:agent`, or why it cannot run here.
fn case(spec: &str) -> Result<Case, String> {
    let (name, agent) = spec.split_once(':').unwrap_or((spec, "claude-code"));
    let agent = Agent::parse(agent.trim())?;
    let name = name.trim().to_string();
    let (provider, serve_args) = match name.as_str() {
        "docker" => ("docker".to_string(), vec!["--docker-pool", "0"]),
        "docker-warm" => ("docker".to_string(), vec!["--docker-pool", "1"]),
        other => (other.to_string(), vec![]),
    };
    let binary = agent.binary()?;
    let mut body = json!({"agent": agent.name(), "sandbox": provider});
    match provider.as_str() {
        "local" => {}
        "docker" => {
            let image = std::env::var("HARNESS_TEST_IMAGE")
                .map_err(|_| "HARNESS_TEST_IMAGE is not set (cargo xtask image)".to_string())?;
            let usable = Command::new("docker")
                .args(["image", "inspect", "--format", "{{.Id}}", &image])
                .output()
                .is_ok_and(|o| o.status.success());
            if !usable {
                return Err(format!("docker image {image} is not usable"));
            }
            body["image"] = json!(image);
        }
        "microvm" => {
            let cache = env_or("HARNESS_CACHE", "/var/cache/harness");
            let assets =
                std::env::var("HARNESS_MICROVM_ASSETS").unwrap_or(format!("{cache}/microvm"));
            if !Path::new(&assets).join("assets.json").exists() {
                return Err(format!(
                    "no microVM guest in {assets} (cargo xtask microvm)"
                ));
            }
        }
        other => return Err(format!("unknown provider {other}")),
    }
    Ok(Case {
        pooled: name == "docker-warm",
        name,
        serve_args,
        agent,
        binary,
        body,
    })
}

struct Row {
    provider: String,
    ours: Vec<f64>,
    bare: Vec<f64>,
    stages: Vec<Stages>,
}

async fn bench_case(case: &Case, runs: usize) -> Option<Row> {
    let model = ScriptedModel::start(Script::text("Ready.")).await.unwrap();
    let (endpoint, received) = otlp::receiver().await;
    let home = tempfile::tempdir().unwrap();
    let mut args = vec!["--otlp", endpoint.as_str()];
    args.extend(case.serve_args.iter().copied());
    let serve = Serve::start_with_env(
        home.path(),
        &model,
        &args,
        &[("OTEL_BSP_SCHEDULE_DELAY", "200")],
    );
    // Untimed: the bootstrap template (or snapshot) and the broker process.
    // Its create also tells whether this server offers the case at all (a
    // microVM needs a build with the feature and the guest's assets).
    let (before, t0) = (model.requests().len(), SystemTime::now());
    let (status, answer) =
        common::server::post(&serve.url("/v1/sessions"), HOST, case.body.clone()).await;
    let Some(id) = answer["session"].as_str().filter(|_| status == 201) else {
        println!("  not measured: the server refused the session ({status}): {answer}");
        return None;
    };
    run_created(&serve, &model, id.to_string(), before, t0).await;
    let mut row = Row {
        provider: format!("{} ({})", case.name, case.agent.name()),
        ours: Vec::new(),
        bare: Vec::new(),
        stages: Vec::new(),
    };
    let mut timed = Vec::new();
    for i in 0..runs {
        let hit = !case.pooled || pool_ready(Duration::from_secs(15)).await;
        let bare = bare_cli(case.agent, &case.binary, &model).await;
        let run = session_run(&serve, &model, &case.body).await;
        println!(
            "  {} run {}: ours {:.0} ms, bare CLI {:.0} ms{}",
            row.provider,
            i + 1,
            run.total_ms(),
            bare,
            if hit { "" } else { " (pool miss)" }
        );
        row.ours.push(run.total_ms());
        row.bare.push(bare);
        timed.push(run);
    }
    let spans = spans_for(&timed, &received).await;
    row.stages = timed.iter().filter_map(|r| stages_of(r, &spans)).collect();
    if std::env::var_os("READY_TRACE").is_some() {
        if let Some(run) = timed.last() {
            print_timeline(run, &spans);
        }
    }
    drop(serve);
    Some(row)
}

fn print_rows(rows: &[Row]) {
    println!();
    println!("| provider (agent) | runs | ours p50 / p99 ms | bare CLI p50 / p99 ms | p50 ratio | p99 ratio |");
    println!("|---|---|---|---|---|---|");
    for row in rows {
        let (o50, o99) = p50_p99(&row.ours);
        let (b50, b99) = p50_p99(&row.bare);
        println!(
            "| {} | {} | {o50:.0} / {o99:.0} | {b50:.0} / {b99:.0} | {:.2} | {:.2} |",
            row.provider,
            row.ours.len(),
            o50 / b50,
            o99 / b99
        );
    }
    println!();
    let header: Vec<String> = STAGE_NAMES
        .iter()
        .map(|s| format!("{s} p50 ms (share)"))
        .collect();
    println!("| provider (agent) | {} |", header.join(" | "));
    println!("|---|{}", "---|".repeat(STAGE_NAMES.len()));
    for row in rows {
        if row.stages.is_empty() {
            continue;
        }
        let mut medians = BTreeMap::new();
        let mut sum = 0.0;
        for (i, name) in STAGE_NAMES.iter().enumerate() {
            let values: Vec<f64> = row.stages.iter().map(|s| s.values()[i]).collect();
            let (p50, _) = p50_p99(&values);
            sum += p50;
            medians.insert(i, (name, p50));
        }
        let cells: Vec<String> = medians
            .values()
            .map(|(_, p50)| format!("{p50:.0} ({:.0} %)", 100.0 * p50 / sum))
            .collect();
        println!("| {} | {} |", row.provider, cells.join(" | "));
    }
}

#[tokio::main]
async fn main() {
    let runs: usize = env_or("READY_RUNS", "20").parse().expect("READY_RUNS");
    let mut rows = Vec::new();
    for spec in env_or(
        "READY_CASES",
        "local:claude-code,docker:claude-code,docker-warm:claude-code,microvm:codex",
    )
    .split(',')
    {
        match case(spec.trim()) {
            Ok(case) => {
                println!("==== {} ({}): {runs} runs", case.name, case.agent.name());
                if let Some(row) = bench_case(&case, runs).await {
                    // Each case's table as soon as it is done, and all of
                    // them at the end.
                    print_rows(std::slice::from_ref(&row));
                    rows.push(row);
                }
            }
            Err(why) => println!("==== {spec}: not measured: {why}"),
        }
    }
    print_rows(&rows);
}
