//! The tool host loop ([`ToolHost`]) against the real hub and session actor,
//! with runners calling through [`RunnerSink`] (the path a slice takes):
//! 1,000 call ids each asked several times run once; a deadline cancels
//! the call (a command is killed) and records `timeout`; a second host is
//! refused; results are cut to the budget; a host that goes away mid-call
//! leaves `ambiguous`.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use harness_core::actor::{ClientMessage, Role};
use harness_core::clock::ManualClock;
use harness_core::frame::SessionId;
use harness_core::log::{MemorySessionLog, SessionLog};
use harness_core::relay::{HostCallRequest, HostOutcome, ToolSpec};
use harness_core::slice::PartSink;
use harness_core::ErrorKind;
use serde_json::json;
use session_runtime::{
    CommandTool, Hub, HubConfig, HubConnector, RunnerSink, ToolHost, ToolOutput,
};

/// A hub with one session whose turn t1 is running (its prompt stored; no
/// engine needed: the runner below speaks for the turn).
async fn session() -> (Arc<Hub>, SessionId) {
    let log = Arc::new(MemorySessionLog::new());
    session_on(log, HubConfig::default()).await
}

/// [`session`] on `log`, with a hub configured as `config`.
async fn session_on(log: Arc<MemorySessionLog>, config: HubConfig) -> (Arc<Hub>, SessionId) {
    let hub = Hub::new(log.clone(), config);
    let session = SessionId::parse("s-host").unwrap();
    log.create(&session).await.unwrap();
    let mut client = hub.connect(&session, Role::Client, None).await.unwrap();
    client.client(ClientMessage::Prompt {
        text: "go".into(),
        turn_id: Some("t1".into()),
        key: None,
    });
    client.answer(Duration::from_secs(5)).await.unwrap();
    (hub, session)
}

fn sink(hub: &Arc<Hub>, generation: u64) -> RunnerSink {
    RunnerSink::new(Arc::new(HubConnector::new(hub.clone())), generation)
}

fn call(id: &str, tool: &str) -> HostCallRequest {
    HostCallRequest {
        call_id: id.into(),
        tool: tool.into(),
        input: json!({"id": id}),
        byte_budget: None,
        timeout_ms: None,
    }
}

fn spec(name: &str) -> ToolSpec {
    ToolSpec::new(name, "test tool", json!({"type": "object"}))
}

/// Serve `host` on `session` in the background; returns once the host is
/// attached (`runner` sees its tools).
async fn attach(
    hub: &Arc<Hub>,
    session: &SessionId,
    host: ToolHost,
    runner: &RunnerSink,
) -> tokio::task::JoinHandle<()> {
    let (hub2, session2) = (hub.clone(), session.clone());
    let task = tokio::spawn(async move {
        let _ = host.serve_hub(&hub2, &session2, false).await;
    });
    let probe = runner;
    let started = Instant::now();
    while probe.host_tools(session.as_str()).await.unwrap().is_empty() {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the host never attached"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    task
}

#[tokio::test(flavor = "multi_thread")]
async fn a_thousand_call_ids_asked_three_times_each_run_once() {
    let (hub, session) = session().await;
    let runs: Arc<Mutex<BTreeMap<String, usize>>> = Arc::default();
    let seen = runs.clone();
    let host = ToolHost::new().function(spec("count"), move |input, _ctx| {
        let seen = seen.clone();
        async move {
            let id = input["id"].as_str().unwrap_or_default().to_string();
            *seen.lock().unwrap().entry(id.clone()).or_default() += 1;
            ToolOutput::ok(format!("ran {id}"))
        }
    });
    let first = sink(&hub, 1);
    let _host = attach(&hub, &session, host, &first).await;
    let expected = |id: &str| HostOutcome::Completed {
        output: format!("ran {id}"),
        is_error: false,
        truncated: false,
    };
    // Every id asked twice at once by one runner...
    for i in 0..1000 {
        let id = format!("c{i}");
        let (a, b) = tokio::join!(
            first.host_call(session.as_str(), "t1", call(&id, "count")),
            first.host_call(session.as_str(), "t1", call(&id, "count")),
        );
        assert_eq!(a.unwrap(), expected(&id));
        assert_eq!(b.unwrap(), expected(&id));
    }
    // ...then again by the runner of the next slice (a newer generation,
    // which fences the first), as after a restart.
    let next = sink(&hub, 2);
    for i in 0..1000 {
        let id = format!("c{i}");
        let again = next
            .host_call(session.as_str(), "t1", call(&id, "count"))
            .await
            .unwrap();
        assert_eq!(again, expected(&id));
    }
    {
        let runs = runs.lock().unwrap();
        assert_eq!(runs.len(), 1000);
        assert!(
            runs.values().all(|&n| n == 1),
            "ran more than once: {:?}",
            runs.iter().filter(|(_, &n)| n != 1).collect::<Vec<_>>()
        );
    }
    let frames = hub.log().read(&session, 0, 100_000).await.unwrap();
    let outcomes = frames
        .iter()
        .filter(|f| matches!(f.body, harness_core::FrameBody::HostOutcome { .. }))
        .count();
    assert_eq!(outcomes, 1000, "one outcome frame per call");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_deadline_cancels_the_call_and_kills_its_command() {
    let (hub, session) = session().await;
    let dir = tempfile::tempdir().unwrap();
    let pid_file = dir.path().join("pid");
    let host = ToolHost::new().tool(
        spec("slow"),
        CommandTool {
            argv: vec![
                "sh".into(),
                "-c".into(),
                format!("echo $$ > {}; exec sleep 30", pid_file.display()),
            ],
            cwd: None,
            env: BTreeMap::new(),
        },
    );
    let runner = sink(&hub, 1);
    let _host = attach(&hub, &session, host, &runner).await;
    let mut slow = call("slow-1", "slow");
    slow.timeout_ms = Some(1_000);
    let started = Instant::now();
    let outcome = runner
        .host_call(session.as_str(), "t1", slow)
        .await
        .unwrap();
    assert!(
        matches!(outcome, HostOutcome::Timeout { .. }),
        "{outcome:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    // The host was told to cancel: the command is killed, not left running.
    let pid = std::fs::read_to_string(&pid_file)
        .unwrap()
        .trim()
        .to_string();
    let gone = Instant::now();
    while std::path::Path::new(&format!("/proc/{pid}")).exists() {
        // A killed child is reaped by tokio; a zombie counts as gone.
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        if stat.contains(") Z ") {
            break;
        }
        assert!(
            gone.elapsed() < Duration::from_secs(10),
            "the tool's command {pid} still runs"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The hub feeds its actors the time of its own clock: stopped, a host
/// call stays out well past its timeout in real time; moved past the
/// deadline, the call ends `timeout` at that deadline.
#[tokio::test(flavor = "multi_thread")]
async fn a_deadline_runs_on_the_hubs_clock() {
    let clock = ManualClock::at(1_000_000);
    let log = Arc::new(MemorySessionLog::new().with_clock(Arc::new(clock.clone())));
    let config = HubConfig {
        clock: Arc::new(clock.clone()),
        ..HubConfig::default()
    };
    let (hub, session) = session_on(log, config).await;
    let host = ToolHost::new().function(spec("wait"), |_input, _ctx| async move {
        std::future::pending::<ToolOutput>().await
    });
    let runner = sink(&hub, 1);
    let _host = attach(&hub, &session, host, &runner).await;
    let mut late = call("late-1", "wait");
    late.timeout_ms = Some(100);
    let out = tokio::spawn(async move { runner.host_call(session.as_str(), "t1", late).await });
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(
        !out.is_finished(),
        "the call ended while the hub's clock stood still"
    );
    clock.advance(100);
    let outcome = tokio::time::timeout(Duration::from_secs(10), out)
        .await
        .expect("the call ends once the clock passes its deadline")
        .unwrap()
        .unwrap();
    assert_eq!(
        outcome,
        HostOutcome::Timeout {
            deadline_at_ms: 1_000_100
        }
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn results_over_the_budget_are_cut_and_a_second_host_is_refused() {
    let (hub, session) = session().await;
    let host = ToolHost::new().function(spec("big"), |_input, ctx| async move {
        ctx.chunk("x".repeat(3000));
        ToolOutput::ok("y".repeat(3000))
    });
    let runner = sink(&hub, 1);
    let _host = attach(&hub, &session, host, &runner).await;
    let mut big = call("big-1", "big");
    big.byte_budget = Some(1000);
    match runner.host_call(session.as_str(), "t1", big).await.unwrap() {
        HostOutcome::Completed {
            output, truncated, ..
        } => {
            assert!(truncated);
            assert!(output.starts_with(&"x".repeat(1000)), "{}", &output[..50]);
            assert!(
                output.contains("1000 of 6000 bytes shown"),
                "{}",
                &output[1000..]
            );
        }
        other => panic!("{other:?}"),
    }
    // A second host is refused while the first holds the lease.
    let second = ToolHost::new().function(spec("other"), |_i, _c| async { ToolOutput::ok("") });
    let err = second.serve_hub(&hub, &session, false).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Conflict, "{err}");
    assert!(err.to_string().contains("takeover"), "{err}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_host_that_goes_away_mid_call_leaves_ambiguous_and_no_rerun() {
    let (hub, session) = session().await;
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    let host = ToolHost::new().function(spec("hang"), move |_input, _ctx| {
        counted.fetch_add(1, Ordering::SeqCst);
        async {
            tokio::time::sleep(Duration::from_secs(60)).await;
            ToolOutput::ok("never")
        }
    });
    let runner = sink(&hub, 1);
    let task = attach(&hub, &session, host, &runner).await;
    let pending = {
        let (runner, session) = (runner.clone(), session.clone());
        tokio::spawn(async move {
            runner
                .host_call(session.as_str(), "t1", call("h1", "hang"))
                .await
        })
    };
    let started = Instant::now();
    while runs.load(Ordering::SeqCst) == 0 {
        assert!(started.elapsed() < Duration::from_secs(10));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The host's task ends (its connection drops), as a killed process's would.
    task.abort();
    let outcome = pending.await.unwrap().unwrap();
    assert!(
        matches!(outcome, HostOutcome::Ambiguous { .. }),
        "{outcome:?}"
    );
    // A new host; the same call id is answered from the log, never rerun.
    let again = Arc::new(AtomicUsize::new(0));
    let counted = again.clone();
    let host = ToolHost::new().function(spec("hang"), move |_i, _c| {
        counted.fetch_add(1, Ordering::SeqCst);
        async { ToolOutput::ok("ran") }
    });
    let _host = attach(&hub, &session, host, &runner).await;
    let outcome = runner
        .host_call(session.as_str(), "t1", call("h1", "hang"))
        .await
        .unwrap();
    assert!(
        matches!(outcome, HostOutcome::Ambiguous { .. }),
        "{outcome:?}"
    );
    assert_eq!(again.load(Ordering::SeqCst), 0);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_command_streams_its_output_and_a_long_one_is_cut_naming_its_size() {
    let (hub, session) = session().await;
    let host = ToolHost::new().tool(
        spec("yes"),
        CommandTool {
            // 200,000 bytes: "y\n" 100,000 times.
            argv: vec!["sh".into(), "-c".into(), "yes | head -n 100000".into()],
            cwd: None,
            env: BTreeMap::new(),
        },
    );
    let runner = sink(&hub, 1);
    let _host = attach(&hub, &session, host, &runner).await;
    let mut long = call("yes-1", "yes");
    long.byte_budget = Some(1000);
    match runner
        .host_call(session.as_str(), "t1", long)
        .await
        .unwrap()
    {
        HostOutcome::Completed {
            output,
            truncated,
            is_error,
        } => {
            assert!(truncated && !is_error);
            assert!(output.starts_with(&"y\n".repeat(500)), "{}", &output[..40]);
            assert!(
                output.contains("1000 of 200000 bytes shown"),
                "the marker names what the tool printed: {}",
                &output[1000..]
            );
        }
        other => panic!("{other:?}"),
    }
    // (A command's result message carries no text of its own: all of the
    // output above reached the session as chunks while it ran.)
}
