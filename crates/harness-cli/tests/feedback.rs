//! What `harness run` tells its user while a turn runs: a model that does
//! not answer is reported at once (not minutes of silence) and the turn
//! ends `timed_out` after the quiet limit; a healthy turn shows nothing of
//! the sort. Real `claude` and `codex`; the model is either nothing at all
//! (a loopback port nobody listens on) or the scripted one.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use harness_testkit::model::{Script, ScriptedModel};
use harness_testkit::require_env;

/// The quiet limit the dead-endpoint runs use.
const QUIET_SECS: u64 = 10;

#[derive(Clone, Copy, Debug)]
enum Agent {
    Claude,
    Codex,
}

impl Agent {
    fn flag(self) -> &'static str {
        match self {
            Agent::Claude => "claude-code",
            Agent::Codex => "codex",
        }
    }

    fn available(self) -> bool {
        let var = match self {
            Agent::Claude => "HARNESS_CLAUDE_BIN",
            Agent::Codex => "HARNESS_CODEX_BIN",
        };
        require_env(var).is_some()
    }

    /// `harness --home HOME run --agent A` with the agent's model at `url`.
    fn run(self, home: &Path, url: &str) -> Command {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_harness"));
        cmd.arg("--home")
            .arg(home)
            .args(["run", "--agent", self.flag()])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .env_remove("HARNESS_HOME")
            .env_remove("HARNESS_QUIET_TIMEOUT")
            .env("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1");
        match self {
            Agent::Claude => cmd
                .env("ANTHROPIC_API_KEY", "test-key")
                .env("ANTHROPIC_BASE_URL", url),
            Agent::Codex => cmd
                .env("OPENAI_API_KEY", "test-key")
                .env("OPENAI_BASE_URL", format!("{url}/v1")),
        };
        cmd
    }
}

/// A loopback port nothing listens on (bound, then closed).
fn dead_url() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    drop(listener);
    format!("http://127.0.0.1:{port}")
}

/// One line of output and when it arrived.
struct Line {
    at: Duration,
    text: String,
}

/// Run `cmd` to its end (killed after `limit`), collecting both streams
/// line by line with arrival times.
fn watch(mut cmd: Command, limit: Duration) -> (bool, Vec<Line>, Vec<Line>) {
    let start = Instant::now();
    let mut child = cmd.spawn().expect("the harness binary runs");
    let (tx, rx) = mpsc::channel::<(bool, Line)>();
    let readers: Vec<_> = [
        (
            false,
            Box::new(child.stdout.take().unwrap()) as Box<dyn std::io::Read + Send>,
        ),
        (true, Box::new(child.stderr.take().unwrap())),
    ]
    .into_iter()
    .map(|(is_err, stream)| {
        let tx = tx.clone();
        std::thread::spawn(move || {
            for text in BufReader::new(stream).lines().map_while(Result::ok) {
                let _ = tx.send((
                    is_err,
                    Line {
                        at: start.elapsed(),
                        text,
                    },
                ));
            }
        })
    })
    .collect();
    drop(tx);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("harness run still ran after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    for reader in readers {
        reader.join().unwrap();
    }
    let (mut out, mut err) = (Vec::new(), Vec::new());
    for (is_err, line) in rx {
        if is_err {
            err.push(line)
        } else {
            out.push(line)
        }
    }
    (status.success(), out, err)
}

fn text(lines: &[Line]) -> String {
    lines
        .iter()
        .map(|l| format!("[{:>6.2}s] {}\n", l.at.as_secs_f64(), l.text))
        .collect()
}

/// `harness sessions export` of the home's only session, as frames.
fn frames(home: &Path) -> Vec<serde_json::Value> {
    let list = Command::new(env!("CARGO_BIN_EXE_harness"))
        .arg("--home")
        .arg(home)
        .args(["sessions", "list"])
        .env_remove("HARNESS_HOME")
        .output()
        .unwrap();
    let list = String::from_utf8_lossy(&list.stdout).into_owned();
    let id = list
        .split_whitespace()
        .find(|w| w.starts_with("s-"))
        .unwrap_or_else(|| panic!("a session is listed: {list}"))
        .to_string();
    let out = Command::new(env!("CARGO_BIN_EXE_harness"))
        .arg("--home")
        .arg(home)
        .args(["sessions", "export", &id])
        .env_remove("HARNESS_HOME")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn parts_of_type<'a>(frames: &'a [serde_json::Value], kind: &str) -> Vec<&'a serde_json::Value> {
    frames
        .iter()
        .filter(|f| f["body"]["part"]["type"] == kind)
        .map(|f| &f["body"]["part"])
        .collect()
}

/// Processes whose working directory is under `home` (the agent's).
fn processes_under(home: &Path) -> Vec<String> {
    let home = std::fs::canonicalize(home).unwrap();
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().parse::<u32>().is_ok())
        .filter(|e| {
            std::fs::read_link(e.path().join("cwd")).is_ok_and(|cwd| cwd.starts_with(&home))
        })
        .map(|e| {
            let cmdline = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
            String::from_utf8_lossy(&cmdline).replace('\0', " ")
        })
        .collect()
}

fn dead_model_is_reported_then_the_turn_times_out(agent: Agent) {
    if !agent.available() {
        return;
    }
    let home = tempfile::tempdir().unwrap();
    let url = dead_url();
    let mut cmd = agent.run(home.path(), &url);
    cmd.args(["--quiet-timeout", &QUIET_SECS.to_string(), "say hi"]);
    let (ok, out, err) = watch(cmd, Duration::from_secs(QUIET_SECS + 90));
    let shown = format!("stdout:\n{}stderr:\n{}", text(&out), text(&err));
    assert!(
        !ok,
        "a turn against a dead model must not succeed:\n{shown}"
    );
    let session_at = err
        .iter()
        .find(|l| l.text.starts_with("session s-"))
        .unwrap_or_else(|| panic!("the session is announced:\n{shown}"))
        .at;
    let warning = err
        .iter()
        .find(|l| {
            l.text.contains(&format!("the model at {url}"))
                && l.text.contains("is not answering: retrying")
        })
        .unwrap_or_else(|| panic!("the dead model is reported, naming its URL:\n{shown}"));
    let ended = err
        .iter()
        .find(|l| {
            l.text
                .contains("ended timed_out: no output from the agent for")
        })
        .unwrap_or_else(|| panic!("the turn ends timed_out with its reason:\n{shown}"));
    println!(
        "{agent:?}: session at {:.1}s, first warning at {:.1}s, timed_out at {:.1}s",
        session_at.as_secs_f64(),
        warning.at.as_secs_f64(),
        ended.at.as_secs_f64()
    );
    // "Within seconds": the agent starts in a second or two and retries a
    // refused connection at once (Claude Code) or within ~5 s (Codex).
    assert!(
        warning.at - session_at < Duration::from_secs(QUIET_SECS),
        "the warning came before the quiet limit, not after it:\n{shown}"
    );
    assert!(
        ended.text.contains("its last warning"),
        "the reason quotes what the agent last said:\n{shown}"
    );
    // The quiet limit, not something else, ended it: no sooner than the
    // limit after the first warning's turn started.
    assert!(
        ended.at - session_at >= Duration::from_secs(QUIET_SECS),
        "ended before the quiet limit:\n{shown}"
    );
    let frames = frames(home.path());
    let warnings = parts_of_type(&frames, "warning");
    assert!(
        warnings.iter().all(|w| w["code"] == "model-retry"),
        "{warnings:?}"
    );
    assert!(
        !warnings.is_empty(),
        "the warnings are in the log for every client"
    );
    let statuses: Vec<_> = frames
        .iter()
        .filter(|f| f["body"]["type"] == "turn-status")
        .map(|f| f["body"]["status"].as_str().unwrap_or("").to_string())
        .collect();
    assert_eq!(
        statuses.last().map(String::as_str),
        Some("timed_out"),
        "{statuses:?}"
    );
    let left = processes_under(home.path());
    assert!(left.is_empty(), "the timed-out agent was killed: {left:?}");
}

fn healthy_turn_shows_no_warning(agent: Agent) {
    if !agent.available() {
        return;
    }
    let rt = tokio::runtime::Runtime::new().unwrap();
    let model = rt
        .block_on(ScriptedModel::start(Script::bash_each_turn(
            "echo fine > ok.txt && cat ok.txt",
            "All fine.",
        )))
        .unwrap();
    let home = tempfile::tempdir().unwrap();
    let mut cmd = agent.run(home.path(), &model.base_url());
    cmd.args(["--quiet-timeout", "60", "check"]);
    let (ok, out, err) = watch(cmd, Duration::from_secs(120));
    let shown = format!("stdout:\n{}stderr:\n{}", text(&out), text(&err));
    assert!(ok, "{shown}");
    assert!(shown.contains("All fine."), "{shown}");
    for bad in ["⚠", "not answering", "timed_out", "✖"] {
        assert!(!shown.contains(bad), "{bad:?} in a healthy run:\n{shown}");
    }
    let frames = frames(home.path());
    assert!(parts_of_type(&frames, "warning").is_empty(), "{frames:?}");
    assert!(parts_of_type(&frames, "error").is_empty(), "{frames:?}");
    drop(model);
}

#[test]
fn claude_against_a_dead_model_warns_at_once_and_times_out() {
    dead_model_is_reported_then_the_turn_times_out(Agent::Claude);
}

#[test]
fn codex_against_a_dead_model_warns_at_once_and_times_out() {
    dead_model_is_reported_then_the_turn_times_out(Agent::Codex);
}

#[test]
fn claude_against_the_scripted_model_shows_no_warning() {
    healthy_turn_shows_no_warning(Agent::Claude);
}

#[test]
fn codex_against_the_scripted_model_shows_no_warning() {
    healthy_turn_shows_no_warning(Agent::Codex);
}

/// On a terminal (a pseudo-terminal from util-linux `script`), the status
/// line under a running turn says what it does and how long since the
/// agent's last output: "running Bash" while the command sleeps, then
/// "waiting for the model".
#[test]
fn the_status_line_says_what_the_turn_does_on_a_terminal() {
    if !Agent::Claude.available() {
        return;
    }
    if Command::new("script").arg("--version").output().is_err() {
        harness_testkit::skip_or_fail("util-linux `script` is not installed (apt bsdutils)");
        return;
    }
    let rt = tokio::runtime::Runtime::new().unwrap();
    let model = rt
        .block_on(ScriptedModel::start(Script::bash_each_turn(
            "sleep 3 && echo slept",
            "Slept well.",
        )))
        .unwrap();
    let home = tempfile::tempdir().unwrap();
    let typescript = home.path().join("typescript");
    let command = format!(
        "{} --home {} run --agent claude-code 'take a nap'",
        env!("CARGO_BIN_EXE_harness"),
        home.path().display()
    );
    let mut cmd = Command::new("script");
    cmd.args(["-qec", &command])
        .arg(&typescript)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .env_remove("HARNESS_HOME")
        .env("ANTHROPIC_API_KEY", "test-key")
        .env("ANTHROPIC_BASE_URL", model.base_url())
        .env("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1");
    let (ok, _, _) = watch(cmd, Duration::from_secs(120));
    let screen = std::fs::read_to_string(&typescript).unwrap_or_default();
    assert!(ok, "{screen}");
    assert!(screen.contains("Slept well."), "{screen}");
    assert!(screen.contains("running Bash"), "{screen}");
    assert!(screen.contains("waiting for the model"), "{screen}");
    // The clock since the last output ran while the command slept.
    assert!(
        ["1s", "2s", "3s"]
            .iter()
            .any(|t| screen.contains(&format!("running Bash · {t} since the last output"))),
        "{screen}"
    );
    drop(model);
}
