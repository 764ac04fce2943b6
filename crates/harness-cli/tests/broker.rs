//! Issue 18 end to end: the real `harness serve`, the real `claude` and
//! `codex`, local and Docker sandboxes under `deny-all`, the model reached
//! through the broker. The agent's own tool call probes the sandbox from
//! inside and reports back through the model (the scripted server records
//! it):
//!
//! - the real key is in no process of the sandbox (environment, command
//!   line) and in no file under its home or working tree;
//! - a server this test opens on the host, on the address the sandbox
//!   would use to reach the host, cannot be reached;
//! - the broker refuses another session's token, and another session's
//!   endpoint, from this sandbox;
//! - the broker's secret under the harness home cannot be read (Docker,
//!   sealed local; host-mode local is the user's own process);
//!
//! and, from the outside: the provider saw the real key on every request
//! and never a token, and the turn finished.
//!
//! "A process of the sandbox": in Docker, every process in the container;
//! for the local provider (not an isolation boundary, see
//! docs/sandbox-local.md) every process in the sandbox's network
//! namespace — the host's own processes, the harness among them, are
//! visible to a local sandbox and hold the key by design. The sealed local
//! sandbox (`claude_sealed_local_through_the_broker`) is a boundary: there
//! a second probe checks that the harness home and its broker secret are
//! out of reach, that no visible process's environment holds the key, and
//! that the agent runs as a uid other than 0.

mod common;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::probe::ProbeApi;
use common::server::{create, docker_parts, export, prompt, Agent, Backend, Serve, TURN_TIMEOUT};
use harness_testkit::model::{any, last_is_tool_result_for, Reply, Rule, Script, ScriptedModel};
use serde_json::{json, Value};

const REAL_ANTHROPIC_KEY: &str = "sk-ant-api03-e2e-REAL-KEY-9f2c71d04b";
const REAL_OPENAI_KEY: &str = "sk-proj-e2e-REAL-KEY-5a13e8c77d";
const PROBE: &str = "toolu_probe_1";

/// What the probes send to the test's own servers. The servers count only
/// connections that carry it: other tests on this machine may dial a
/// loopback port that the kernel has just given to one of these servers
/// (a "dead model" test retries against a port it freed).
const PROBE_MARK: &str = "harness-probe-7c1e";

/// Whether the connection's first bytes (within 3 s) carry [`PROBE_MARK`].
async fn carries_the_mark(s: &mut tokio::net::TcpStream) -> bool {
    use tokio::io::AsyncReadExt;
    let mut buf = [0u8; 4096];
    match tokio::time::timeout(Duration::from_secs(3), s.read(&mut buf)).await {
        Ok(Ok(n)) => String::from_utf8_lossy(&buf[..n]).contains(PROBE_MARK),
        _ => false,
    }
}

/// A TCP server on `ip` that counts the probe's connections.
async fn host_server(ip: IpAddr) -> (SocketAddr, Arc<AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind(SocketAddr::new(ip, 0))
        .await
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = accepted.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let count = count.clone();
            tokio::spawn(async move {
                if carries_the_mark(&mut s).await {
                    count.fetch_add(1, Ordering::SeqCst);
                }
            });
        }
    });
    (addr, accepted)
}

/// The probe the agent runs (the keys it searches for reach it through
/// `common::probe::keys_into_file`).
fn probe(
    host: SocketAddr,
    home: &std::path::Path,
    other_session: &str,
    other_token: &str,
) -> String {
    let keys = common::probe::keys_into_file(&[REAL_ANTHROPIC_KEY, REAL_OPENAI_KEY]);
    let refusals = common::probe::broker_refusals(ProbeApi::Anthropic, other_session, other_token);
    format!(
        r#"{keys}
me=$(readlink /proc/self/ns/net); n=0
for p in /proc/[0-9]*; do
  [ "$(readlink $p/ns/net 2>/dev/null)" = "$me" ] || continue
  n=$((n+1))
  for f in environ cmdline; do
    if grep -qaFf $k $p/$f 2>/dev/null; then echo "KEY-IN-PROC $p/$f: $(tr '\0' ' ' < $p/cmdline | head -c 100)"; fi
  done
done
echo "PROCESSES-SEARCHED $n"
grep -rlaFf $k "$HOME" "$PWD" 2>/dev/null | sed 's/^/KEY-IN-FILE /'
cat {home}/broker/secret >/dev/null 2>&1 && echo SECRET-READ || echo SECRET-UNREADABLE
: > $k
if timeout 3 bash -c 'exec 3<>/dev/tcp/{ip}/{port} && echo {mark} >&3' 2>/dev/null; then echo HOST-REACHED; else echo HOST-BLOCKED; fi
{refusals}
echo PROBE-DONE"#,
        ip = host.ip(),
        port = host.port(),
        mark = PROBE_MARK,
        home = home.display(),
    )
}

/// `harness broker usage ID`: what the broker counted for the session.
fn broker_usage(home: &std::path::Path, id: &str) -> Value {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_harness"))
        .arg("--home")
        .arg(home)
        .args(["broker", "usage", id])
        .output()
        .unwrap();
    serde_json::from_slice(&out.stdout).unwrap()
}

async fn until_end(serve: &Serve, id: &str, turn: &str) -> Value {
    let started = Instant::now();
    loop {
        let frames = export(serve, id).await;
        if let Some(end) = frames.iter().find(|f| {
            f["body"]["type"] == "turn-status"
                && f["body"]["turnId"] == turn
                && matches!(
                    f["body"]["status"].as_str(),
                    Some("finished" | "failed" | "timed_out")
                )
        }) {
            return end["body"].clone();
        }
        assert!(
            started.elapsed() < TURN_TIMEOUT,
            "turn {turn} did not end in {TURN_TIMEOUT:?}\nserver log:\n{}",
            serve.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// What the agent's `call_id` tool call sent back to the model.
fn tool_report(model: &ScriptedModel, call_id: &str) -> String {
    let requests = model.requests();
    requests
        .iter()
        .filter_map(|r| r.model_request())
        .find_map(|r| r.tool_result(call_id))
        .unwrap_or_else(|| panic!("{call_id}'s result never reached the model: {requests:#?}"))
        .content
}

/// One probed turn: the session, its turn's terminal status, what the
/// agent's probe sent back to the model, and the guard that removes the
/// session's container (Docker) when the test ends.
struct Probed {
    id: String,
    end: Value,
    report: String,
    _containers: common::docker::SessionContainers,
}

/// Create a session from `body` (plus `image`), run one prompt, require it
/// to finish, and read what the agent's `call_id` tool call sent back to
/// the model.
async fn run_probe(
    serve: &Serve,
    model: &ScriptedModel,
    mut body: Value,
    image: &Option<String>,
    text: &str,
    call_id: &str,
) -> Probed {
    if let Some(image) = image {
        body["image"] = json!(image);
    }
    let id = create(serve, body).await;
    let containers = common::docker::SessionContainers(id.clone());
    let turn = prompt(serve, &id, text).await;
    let end = until_end(serve, &id, &turn).await;
    assert_eq!(
        end["status"],
        "finished",
        "{end}\nserver log:\n{}",
        serve.log()
    );
    let report = tool_report(model, call_id);
    Probed {
        id,
        end,
        report,
        _containers: containers,
    }
}

async fn deny_all_through_the_broker(agent: Agent, backend: Backend) {
    through_the_broker(agent, backend, false).await
}

/// The sealed local sandbox (`HARNESS_LOCAL_ISOLATION=sealed` for the
/// server): the same probes, plus what only a boundary keeps — the harness
/// home, its broker secret and the host's processes out of sight, and an
/// unprivileged uid.
const SEALED_PROBE: &str = "toolu_sealed_1";

fn sealed_probe(home: &std::path::Path) -> String {
    format!(
        "cat {home}/broker/secret >/dev/null 2>&1 && echo SECRET-READ || echo SECRET-UNREADABLE; \
         ls {home}/broker >/dev/null 2>&1 && echo HOME-LISTED || echo HOME-UNSEEN; \
         echo \"HOME-HAS $(ls -A {home} | tr '\\n' ' ')\"; \
         echo UID-$(id -u); echo PROCS-$(ls /proc | grep -c '^[0-9]'); \
         cat /proc/[0-9]*/environ 2>/dev/null | tr '\\0' '\\n' | grep -c REAL-KEY | sed 's/^/ENV-KEYS-/'; \
         echo SEALED-DONE",
        home = home.display()
    )
}

async fn through_the_broker(agent: Agent, backend: Backend, sealed: bool) {
    if !agent.available() {
        return;
    }
    let root = std::fs::read_to_string("/proc/self/status")
        .map(|s| {
            s.lines()
                .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(2) == Some("0"))
        })
        .unwrap_or(false);
    if sealed && !root {
        harness_testkit::skip_or_fail("the sealed local sandbox's e2e test runs as root here");
        return;
    }
    // Where the sandbox would find the host: loopback for the local
    // provider, the bridge gateway for a container.
    let (image, host_ip) = match backend {
        Backend::Local => (None, IpAddr::V4(Ipv4Addr::LOCALHOST)),
        Backend::Docker => match docker_parts().await {
            Some((image, gateway)) => (Some(image), gateway),
            None => return,
        },
    };
    let (host_addr, accepted) = host_server(host_ip).await;
    let home = tempfile::tempdir().unwrap();
    if sealed {
        // The sandbox uid must be able to pass through the home to reach
        // its sandbox directory (docs/sandbox-local.md, *Sealed*).
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(home.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
    }

    // Another session, mid-turn, with a valid token.
    let other_session = "other-session-1";
    let other_token = common::probe::other_session_token(home.path(), other_session);

    let script = if sealed {
        Script::new()
            .rule(Rule::new(
                last_is_tool_result_for(SEALED_PROBE),
                Reply::text("probed"),
            ))
            .rule(Rule::new(
                last_is_tool_result_for(PROBE),
                Reply::shell(SEALED_PROBE, sealed_probe(home.path())),
            ))
    } else {
        Script::new().rule(Rule::new(
            last_is_tool_result_for(PROBE),
            Reply::text("probed"),
        ))
    }
    .on(
        any(),
        Reply::shell(
            PROBE,
            probe(host_addr, home.path(), other_session, &other_token),
        ),
    );
    // The model listens on loopback: only the broker, on the host, calls it.
    let model = ScriptedModel::start(script).await.unwrap();
    let isolation = if sealed { "sealed" } else { "host" };
    let serve = Serve::start_with_env(
        home.path(),
        &model,
        &[],
        &[
            ("ANTHROPIC_API_KEY", REAL_ANTHROPIC_KEY),
            ("OPENAI_API_KEY", REAL_OPENAI_KEY),
            ("HARNESS_LOCAL_ISOLATION", isolation),
        ],
    );
    let body = json!({
        "agent": agent.name(),
        "sandbox": backend.name(),
        "network": {"mode": "deny-all"},
    });
    let Probed {
        id,
        end,
        report,
        _containers,
    } = run_probe(&serve, &model, body, &image, "probe the sandbox", PROBE).await;
    let requests = model.requests();
    common::probe::assert_keeps_the_key_out(&report, 2);
    assert!(report.contains("HOST-BLOCKED"), "{report}");
    assert_eq!(
        accepted.load(Ordering::SeqCst),
        0,
        "the host server was reached"
    );
    // The broker's secret: the host-mode local sandbox is the user's own
    // process and reads it (not a boundary, docs/security.md); a container
    // does not have the home, a sealed sandbox does not see it.
    if backend == Backend::Docker || sealed {
        assert!(report.contains("SECRET-UNREADABLE"), "{report}");
    }
    if sealed {
        let sealed_report = tool_report(&model, SEALED_PROBE);
        assert!(sealed_report.contains("SEALED-DONE"), "{sealed_report}");
        assert!(
            sealed_report.contains("SECRET-UNREADABLE"),
            "{sealed_report}"
        );
        assert!(sealed_report.contains("HOME-UNSEEN"), "{sealed_report}");
        // All a sealed sandbox sees of the home is the path down to its own
        // directory (the mount points of its binds), never `broker/`.
        let has = sealed_report
            .lines()
            .find_map(|l| l.strip_prefix("HOME-HAS"))
            .unwrap_or_default();
        assert!(!has.contains("broker"), "{sealed_report}");
        assert!(sealed_report.contains("ENV-KEYS-0"), "{sealed_report}");
        assert!(!sealed_report.contains("UID-0\n"), "{sealed_report}");
        let procs: usize = sealed_report
            .lines()
            .find_map(|l| l.strip_prefix("PROCS-"))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or(usize::MAX);
        // The agent, its shells and the holder — not the host's.
        assert!(procs < 40, "{sealed_report}");
    }

    // The provider saw the real key on every request, never a token.
    let model_requests: Vec<_> = requests.iter().filter(|r| r.api.is_some()).collect();
    assert!(model_requests.len() >= 2, "{requests:#?}");
    for r in &model_requests {
        match agent {
            Agent::Claude => assert_eq!(r.header("x-api-key"), Some(REAL_ANTHROPIC_KEY)),
            Agent::Codex => assert_eq!(
                r.header("authorization"),
                Some(format!("Bearer {REAL_OPENAI_KEY}").as_str())
            ),
        }
        assert!(
            r.headers.iter().all(|(_, v)| !v.contains("hsb1_")),
            "a session token reached the provider: {:?}",
            r.headers
        );
    }

    // From the outside too: no file of the sandbox holds a key after the
    // turn (the transcript and spool included).
    let handle = &end["sandbox"];
    match backend {
        Backend::Local => {
            let dir = handle["data"]["dir"]
                .as_str()
                .expect("the local handle names its dir");
            let hits = std::process::Command::new("grep")
                .args([
                    "-rlaF",
                    "-e",
                    REAL_ANTHROPIC_KEY,
                    "-e",
                    REAL_OPENAI_KEY,
                    dir,
                ])
                .output()
                .unwrap();
            assert!(
                hits.stdout.is_empty(),
                "files holding a key: {}",
                String::from_utf8_lossy(&hits.stdout)
            );
        }
        Backend::Docker => {
            let container = handle["id"]
                .as_str()
                .expect("the handle names the container");
            let hits = std::process::Command::new("docker")
                .args(["exec", container, "sh", "-c"])
                .arg(format!(
                    "grep -rlaF -e {REAL_ANTHROPIC_KEY} -e {REAL_OPENAI_KEY} \"$HOME\" /workspace /tmp 2>/dev/null; true"
                ))
                .output()
                .unwrap();
            assert!(
                hits.stdout.is_empty(),
                "files holding a key: {}",
                String::from_utf8_lossy(&hits.stdout)
            );
        }
    }

    // Through the broker, counted for this session.
    let usage = broker_usage(home.path(), &id);
    assert_eq!(
        usage["requests"].as_u64(),
        Some(model_requests.len() as u64),
        "{usage}"
    );
    assert!(usage["outputTokens"].as_u64().unwrap_or(0) > 0, "{usage}");

    // The audit trail in the session's log: the agent's launch and the
    // commands the harness ran, and one record per brokered call that adds
    // up to the broker's count (docs/audit.md).
    let frames = export(&serve, &id).await;
    let records: Vec<&Value> = frames
        .iter()
        .filter(|f| f["body"]["part"]["type"] == "audit")
        .map(|f| &f["body"]["part"]["record"])
        .collect();
    let launched = records.iter().any(|r| {
        r["kind"] == "exec"
            && r["detached"] == true
            && r["argv"].as_array().is_some_and(|a| {
                a.iter().any(|x| {
                    x.as_str()
                        .is_some_and(|x| x.contains(agent.name().split('-').next().unwrap_or("")))
                })
            })
    });
    assert!(
        launched,
        "no audit record of the agent's launch: {records:#?}"
    );
    // The commands the harness ran besides the launch, each with how it
    // ended. (A turn in a sandbox whose handle knows `$HOME` runs none
    // before its agent: no claim; `crates/sandbox-local/tests/audit.rs`
    // checks the exit codes of commands that do run.)
    for r in records
        .iter()
        .filter(|r| r["kind"] == "exec" && r["detached"] != true)
    {
        assert!(
            r["ended"].is_string(),
            "an audited exec without how it ended: {r:#}"
        );
    }
    let calls: Vec<&&Value> = records
        .iter()
        .filter(|r| r["kind"] == "model-call")
        .collect();
    let forwarded: Vec<&&&Value> = calls.iter().filter(|c| c["status"] == 200).collect();
    assert_eq!(forwarded.len(), model_requests.len(), "{records:#?}");
    let input: u64 = forwarded
        .iter()
        .map(|c| c["inputTokens"].as_u64().unwrap_or(0))
        .sum();
    assert_eq!(
        Some(input),
        usage["inputTokens"].as_u64(),
        "{records:#?}\n{usage}"
    );
    // The probe's try with another session's token is on record, refused.
    let refused: Vec<&&Value> = calls
        .iter()
        .copied()
        .filter(|c| c["status"] == 401)
        .collect();
    assert_eq!(refused.len(), 1, "{records:#?}");
    assert_eq!(refused[0]["inputTokens"], 0, "{records:#?}");
    // Numbered once each, in order.
    let indexes: Vec<u64> = calls.iter().filter_map(|c| c["index"].as_u64()).collect();
    assert_eq!(
        indexes,
        (1..=calls.len() as u64).collect::<Vec<_>>(),
        "{records:#?}"
    );
    // No record carries a secret: env values are never recorded.
    let text = serde_json::to_string(&records).unwrap();
    assert!(
        !text.contains("hsb1_") && !text.contains(REAL_ANTHROPIC_KEY),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_local_deny_all_through_the_broker() {
    deny_all_through_the_broker(Agent::Claude, Backend::Local).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_sealed_local_through_the_broker() {
    through_the_broker(Agent::Claude, Backend::Local, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codex_local_deny_all_through_the_broker() {
    deny_all_through_the_broker(Agent::Codex, Backend::Local).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_docker_deny_all_through_the_broker() {
    deny_all_through_the_broker(Agent::Claude, Backend::Docker).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codex_docker_deny_all_through_the_broker() {
    deny_all_through_the_broker(Agent::Codex, Backend::Docker).await;
}

/// An HTTP server on loopback answering every request with `body`,
/// counting the probe's requests.
async fn http_server(body: &'static str) -> (SocketAddr, Arc<AtomicUsize>) {
    use tokio::io::AsyncWriteExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = accepted.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let count = count.clone();
            tokio::spawn(async move {
                if carries_the_mark(&mut s).await {
                    count.fetch_add(1, Ordering::SeqCst);
                }
                let reply = format!(
                    "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = s.write_all(reply.as_bytes()).await;
            });
        }
    });
    (addr, accepted)
}

const CUSTOM_PROBE: &str = "toolu_custom_1";

/// The agent's probe under `custom`: a GET through the proxy the
/// environment names, to the allowed and to the refused server, and a
/// direct connection that bypasses the proxy.
fn custom_probe(allowed: SocketAddr, refused: SocketAddr) -> String {
    format!(
        r#"get() {{ p=${{HTTP_PROXY#http://}}; timeout 8 bash -c 'exec 3<>/dev/tcp/${{0%:*}}/${{0#*:}} || exit 9
  printf "GET http://%s/{mark} HTTP/1.1\r\nhost: %s\r\nconnection: close\r\n\r\n" "$1" "$1" >&3; cat <&3' "$p" "$1" | tr -d '\r' | sed -n '1p;$p' | tr '\n' ' '; }}
echo "ALLOWED: $(get {allowed})"
echo "REFUSED: $(get {refused})"
if timeout 3 bash -c 'exec 3<>/dev/tcp/{aip}/{aport}' 2>/dev/null; then echo DIRECT-REACHED; else echo DIRECT-BLOCKED; fi
echo PROBE-DONE"#,
        aip = allowed.ip(),
        aport = allowed.port(),
        mark = PROBE_MARK,
    )
}

/// `custom`: an allowed server answers through the egress proxy, a
/// refused one does not, and nothing goes around the proxy.
async fn custom_policy_through_the_egress_proxy(backend: Backend) {
    let agent = Agent::Claude;
    if !agent.available() {
        return;
    }
    let image = match backend {
        Backend::Local => None,
        Backend::Docker => match docker_parts().await {
            Some((image, _)) => Some(image),
            None => return,
        },
    };
    // Both servers on this machine's loopback: the proxy runs on the host.
    let (allowed, allowed_hits) = http_server("allowed-server-body").await;
    let (refused, refused_hits) = http_server("refused-server-body").await;
    let script = Script::new()
        .rule(Rule::new(
            last_is_tool_result_for(CUSTOM_PROBE),
            Reply::text("probed"),
        ))
        .on(
            any(),
            Reply::shell(CUSTOM_PROBE, custom_probe(allowed, refused)),
        );
    let model = ScriptedModel::start(script).await.unwrap();
    let home = tempfile::tempdir().unwrap();
    let serve = Serve::start(home.path(), &model, &[]);
    let body = json!({
        "agent": agent.name(),
        "sandbox": backend.name(),
        "network": {
            "mode": "custom",
            "allowed_cidrs": ["127.0.0.1/32"],
            "allowed_ports": [allowed.port()],
        },
    });
    let Probed { report, id, .. } = run_probe(
        &serve,
        &model,
        body,
        &image,
        "probe the network",
        CUSTOM_PROBE,
    )
    .await;
    assert!(report.contains("PROBE-DONE"), "{report}");
    let line = |tag: &str| {
        report
            .lines()
            .find(|l| l.starts_with(tag))
            .unwrap_or_default()
            .to_string()
    };
    let yes = line("ALLOWED:");
    assert!(
        yes.contains("200 OK") && yes.contains("allowed-server-body"),
        "{report}"
    );
    let no = line("REFUSED:");
    assert!(
        no.contains("403") && !no.contains("refused-server-body"),
        "{report}"
    );
    assert!(report.contains("DIRECT-BLOCKED"), "{report}");
    assert!(allowed_hits.load(Ordering::SeqCst) >= 1);
    assert_eq!(
        refused_hits.load(Ordering::SeqCst),
        0,
        "the refused server was dialled"
    );
    // Both decisions are in the session's audit trail, with their rule.
    let frames = export(&serve, &id).await;
    let egress: Vec<&Value> = frames
        .iter()
        .map(|f| &f["body"]["part"]["record"])
        .filter(|r| r["kind"] == "egress")
        .collect();
    let decided = |target: String, decision: &str| {
        egress.iter().any(|r| {
            r["target"] == target.as_str()
                && r["decision"] == decision
                && r["reason"].as_str().is_some_and(|w| !w.is_empty())
        })
    };
    assert!(
        decided(format!("127.0.0.1:{}", allowed.port()), "allowed"),
        "{egress:#?}"
    );
    assert!(
        decided(format!("127.0.0.1:{}", refused.port()), "refused"),
        "{egress:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_custom_policy_through_the_egress_proxy() {
    custom_policy_through_the_egress_proxy(Backend::Local).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn docker_custom_policy_through_the_egress_proxy() {
    custom_policy_through_the_egress_proxy(Backend::Docker).await;
}

/// Issue 40's budget: a model that asks for one tool after another, a
/// server that holds each session to a token budget. The first answer
/// spends it; the broker refuses the next call, the turn ends `failed`
/// with the code `budget_exceeded` and says by how much, and nothing runs
/// after the refusal: one model request passed, one tool ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spent_token_budget_ends_the_turn_and_nothing_runs_after_it() {
    // The server's budget for every session (`--budget-tokens`).
    spent_budget(&["--budget-tokens", "10"], json!({})).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sessions_own_budget_from_its_create_body_holds_it() {
    // No server-wide budget: the session's own, from `POST /v1/sessions`.
    spent_budget(&[], json!({"budget": {"max_tokens": 10}})).await;
}

async fn spent_budget(flags: &[&str], extra: Value) {
    if !Agent::Claude.available() {
        return;
    }
    let home = tempfile::tempdir().unwrap();
    let script = Script::new().on(
        any(),
        Reply::shell("toolu_again", "echo ran >> \"$HOME/steps\"; echo again"),
    );
    let model = ScriptedModel::start(script).await.unwrap();
    let serve = Serve::start_with_env(
        home.path(),
        &model,
        flags,
        &[("ANTHROPIC_API_KEY", REAL_ANTHROPIC_KEY)],
    );
    let mut body = json!({"agent": "claude-code", "sandbox": "local"});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    let id = create(&serve, body).await;
    let turn = prompt(&serve, &id, "keep going").await;
    let end = until_end(&serve, &id, &turn).await;
    assert_eq!(end["status"], "failed", "{end}\n{}", serve.log());
    assert_eq!(end["code"], "budget_exceeded", "{end}");
    let error = end["error"].as_str().unwrap_or_default();
    assert!(
        error.contains("token budget") && error.contains("over"),
        "{error}"
    );
    // Exactly the one request that spent the budget reached the model.
    let passed = model.requests().iter().filter(|r| r.api.is_some()).count();
    assert_eq!(passed, 1, "{:#?}", model.requests());
    // Its tool ran; nothing after the refusal did.
    let handle = &end["sandbox"];
    let dir = handle["data"]["dir"]
        .as_str()
        .expect("the local handle names its dir");
    let steps = std::fs::read_to_string(format!("{dir}/home/steps")).unwrap_or_default();
    assert_eq!(steps.lines().count(), 1, "{steps:?}");
    // The broker counted the refusal against the session.
    let usage = broker_usage(home.path(), &id);
    assert_eq!(usage["requests"].as_u64(), Some(1), "{usage}");
    assert!(usage["refused"].as_u64().unwrap_or(0) >= 1, "{usage}");
    // And the log has both calls: the one that passed, the one refused.
    let statuses: Vec<u64> = export(&serve, &id)
        .await
        .iter()
        .map(|f| &f["body"]["part"]["record"])
        .filter(|r| r["kind"] == "model-call")
        .filter_map(|r| r["status"].as_u64())
        .collect();
    assert_eq!(statuses.first(), Some(&200), "{statuses:?}");
    assert!(
        statuses[1..].iter().all(|s| *s == 403) && statuses.len() >= 2,
        "{statuses:?}"
    );
}
