//! The broker against the scripted model server (the one scripted part):
//! the key is swapped on the host side, tokens open their own session
//! only, a revoked session is refused, streams pass through as they come,
//! usage is counted, and a second process over the same directory takes
//! over the serving when the first lets go.

use std::time::{Duration, Instant};

use harness_broker::{Broker, BrokerConfig, Upstream};
use harness_core::broker::{ModelBroker, Reach};
use harness_core::sandbox::{NetworkPolicy, MODEL_BROKER_PORT};
use harness_testkit::model::{Reply, Script, ScriptedModel};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const ANTHROPIC_KEY: &str = "sk-ant-real-key-for-the-broker-test";
const OPENAI_KEY: &str = "sk-openai-real-key-for-the-broker-test";

async fn broker(dir: &std::path::Path, model: &ScriptedModel) -> Broker {
    Broker::start(BrokerConfig {
        dir: dir.to_path_buf(),
        anthropic: Some(Upstream {
            base_url: model.base_url(),
            api_key: ANTHROPIC_KEY.into(),
        }),
        openai: Some(Upstream {
            base_url: model.v1_url(),
            api_key: OPENAI_KEY.into(),
        }),
    })
    .await
    .unwrap()
}

fn anthropic_body() -> serde_json::Value {
    serde_json::json!({
        "model": "claude-test", "max_tokens": 100, "stream": true,
        "messages": [{"role": "user", "content": "say hi"}],
    })
}

fn openai_body() -> serde_json::Value {
    serde_json::json!({"model": "gpt-test", "stream": true, "input": "say hi"})
}

/// One HTTP/1.1 exchange over the broker's Unix socket (what a sandbox's
/// forward carries): status and body.
async fn over_socket(
    socket: &std::path::Path,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, String) {
    let mut stream = tokio::net::UnixStream::connect(socket).await.unwrap();
    let mut req = format!(
        "POST {path} HTTP/1.1\r\nhost: 127.0.0.1:{MODEL_BROKER_PORT}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n",
        body.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(body);
    stream.write_all(req.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), stream.read_to_end(&mut out))
        .await
        .expect("the broker answers within 20 s")
        .unwrap();
    let text = String::from_utf8_lossy(&out).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, text)
}

#[tokio::test]
async fn the_key_is_added_on_the_host_and_tokens_open_their_own_session_only() {
    let model = ScriptedModel::start(Script::text("hello through the broker"))
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let broker = broker(dir.path(), &model).await;
    assert!(broker.is_serving().await);
    let token_a = broker.token("session-a");
    let token_b = broker.token("session-b");
    assert_ne!(token_a, token_b);

    // Before its turn starts, a session's own token opens nothing.
    broker
        .forwards("session-a", &NetworkPolicy::DenyAll)
        .await
        .unwrap();
    let (status, text) = over_socket(
        &broker.socket_path("session-a"),
        "/s/session-a/anthropic/v1/messages",
        &[("x-api-key", &token_a)],
        &anthropic_body().to_string(),
    )
    .await;
    assert_eq!(status, 403, "{text}");

    // The agent's view: what the slice runner puts in its environment.
    let env = broker
        .agent_env("session-a", &NetworkPolicy::DenyAll, Reach::Forwarded)
        .await
        .unwrap();
    assert_eq!(env["ANTHROPIC_API_KEY"], token_a);
    assert_eq!(env["OPENAI_API_KEY"], token_a);
    assert_eq!(
        env["ANTHROPIC_BASE_URL"],
        format!("http://127.0.0.1:{MODEL_BROKER_PORT}/s/session-a/anthropic")
    );
    assert!(env
        .values()
        .all(|v| !v.contains(ANTHROPIC_KEY) && !v.contains(OPENAI_KEY)));
    let forwards = broker
        .forwards("session-a", &NetworkPolicy::DenyAll)
        .await
        .unwrap();
    assert_eq!(forwards.len(), 1);
    assert_eq!(forwards[0].port, MODEL_BROKER_PORT);
    let socket = std::path::PathBuf::from(&forwards[0].socket);
    // The socket's directory holds sockets only (a provider mounts it):
    // never the secret.
    for entry in std::fs::read_dir(socket.parent().unwrap()).unwrap() {
        let entry = entry.unwrap();
        use std::os::unix::fs::FileTypeExt;
        assert!(
            entry.file_type().unwrap().is_socket(),
            "{:?} next to the socket",
            entry.path()
        );
    }

    // Anthropic over the socket, with session A's token.
    let (status, text) = over_socket(
        &socket,
        "/s/session-a/anthropic/v1/messages?beta=true",
        &[("x-api-key", &token_a), ("anthropic-version", "2023-06-01")],
        &anthropic_body().to_string(),
    )
    .await;
    assert_eq!(status, 200, "{text}");
    assert!(
        text.contains("hello") && text.contains("message_stop"),
        "{text}"
    );
    // OpenAI over TCP (what a sandbox on the host network uses).
    let env_host = broker
        .agent_env("session-a", &NetworkPolicy::AllowAll, Reach::HostNetwork)
        .await
        .unwrap();
    let url = format!("{}/responses", env_host["OPENAI_BASE_URL"]);
    assert!(url.starts_with(&format!(
        "http://{}/s/session-a/openai",
        broker.tcp_addr().unwrap()
    )));
    let answer = reqwest::Client::new()
        .post(&url)
        .bearer_auth(&token_a)
        .json(&openai_body())
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 200);
    let body = answer.text().await.unwrap();
    assert!(body.contains("response.completed"), "{body}");

    // What the provider saw: the real keys, never the token.
    let seen = model.requests();
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert_eq!(seen[0].path, "/v1/messages");
    assert_eq!(seen[0].header("x-api-key"), Some(ANTHROPIC_KEY));
    assert_eq!(seen[1].path, "/v1/responses");
    assert_eq!(
        seen[1].header("authorization"),
        Some(format!("Bearer {OPENAI_KEY}").as_str())
    );
    for r in &seen {
        assert!(
            r.headers.iter().all(|(_, v)| !v.contains("hsb1_")),
            "a token reached the provider: {:?}",
            r.headers
        );
    }

    // Session B's token on session A's endpoint, a made-up token, and no
    // token: refused, and nothing reaches the provider.
    for headers in [
        vec![("x-api-key", token_b.as_str())],
        vec![("authorization", "Bearer hsb1_00")],
        vec![("x-api-key", ANTHROPIC_KEY)],
        vec![],
    ] {
        let (status, text) = over_socket(
            &socket,
            "/s/session-a/anthropic/v1/messages",
            &headers,
            &anthropic_body().to_string(),
        )
        .await;
        assert_eq!(status, 401, "{headers:?}: {text}");
        assert!(text.contains("does not open this session"), "{text}");
    }
    // Session B's own path and token, through session A's socket (what a
    // sandbox of A reaches): refused too, even while B runs a turn.
    broker
        .forwards("session-b", &NetworkPolicy::DenyAll)
        .await
        .unwrap();
    broker.activate("session-b").unwrap();
    let (status, text) = over_socket(
        &socket,
        "/s/session-b/anthropic/v1/messages",
        &[("x-api-key", &token_b)],
        &anthropic_body().to_string(),
    )
    .await;
    assert_eq!(status, 401, "{text}");
    assert!(text.contains("serves another session"), "{text}");
    // ... while B's own socket serves B.
    let (status, text) = over_socket(
        &broker.socket_path("session-b"),
        "/s/session-b/anthropic/v1/messages",
        &[("x-api-key", &token_b)],
        &anthropic_body().to_string(),
    )
    .await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(model.requests().len(), 3);

    // Usage: two forwarded exchanges with the tokens the provider reported.
    let usage = broker.usage("session-a").unwrap();
    assert_eq!(usage.requests, 2, "{usage:?}");
    assert_eq!(usage.refused, 5, "{usage:?}");
    assert!(
        usage.input_tokens > 0 && usage.output_tokens > 0,
        "{usage:?}"
    );
    assert!(usage.response_bytes as usize >= body.len(), "{usage:?}");
    assert_eq!(broker.usage("session-b").unwrap().requests, 1);
    assert_eq!(broker.usage("session-b").unwrap().refused, 0);

    // The turn ends: the token opens nothing until the next turn starts.
    broker.turn_ended("session-a").await.unwrap();
    let (status, text) = over_socket(
        &socket,
        "/s/session-a/anthropic/v1/messages",
        &[("x-api-key", &token_a)],
        &anthropic_body().to_string(),
    )
    .await;
    assert_eq!(status, 403, "{text}");
    assert!(text.contains("no turn running"), "{text}");
    assert_eq!(model.requests().len(), 3);
}

#[tokio::test]
async fn a_stream_passes_through_as_it_comes() {
    // Eight deltas, 250 ms apart: about 2 s from the first to the last.
    let reply = Reply::text_chunks([
        "one ", "two ", "three ", "four ", "five ", "six ", "seven ", "eight",
    ])
    .with_delay(250);
    let model = ScriptedModel::start(Script::new().on(harness_testkit::model::any(), reply))
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let broker = broker(dir.path(), &model).await;
    let token = broker.token("s1");
    broker.activate("s1").unwrap();
    let url = format!(
        "http://{}/s/s1/anthropic/v1/messages",
        broker.tcp_addr().unwrap()
    );
    let started = Instant::now();
    let mut answer = reqwest::Client::new()
        .post(&url)
        .header("x-api-key", &token)
        .json(&anthropic_body())
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 200);
    let mut first_text_at = None;
    let mut body = Vec::new();
    while let Some(chunk) = answer.chunk().await.unwrap() {
        body.extend_from_slice(&chunk);
        if first_text_at.is_none() && String::from_utf8_lossy(&body).contains("one ") {
            first_text_at = Some(started.elapsed());
        }
    }
    let total = started.elapsed();
    let first = first_text_at.expect("the first delta arrived");
    // A buffering broker would hand over the first delta only with the
    // last, about 2 s later.
    assert!(
        total - first >= Duration::from_millis(1000),
        "first delta at {first:?}, end at {total:?}: the broker held the stream back"
    );
    assert!(String::from_utf8_lossy(&body).contains("eight"));
}

#[tokio::test]
async fn a_second_process_takes_over_when_the_first_lets_go() {
    let model = ScriptedModel::start(Script::text("hi")).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let first = broker(dir.path(), &model).await;
    let second = broker(dir.path(), &model).await;
    assert!(first.is_serving().await);
    assert!(
        !second.is_serving().await,
        "two processes serve one directory"
    );
    // Same secret, same tokens: an agent started under one works with the other.
    assert_eq!(first.token("s"), second.token("s"));
    first.forwards("s", &NetworkPolicy::DenyAll).await.unwrap();
    first.activate("s").unwrap();
    first.shutdown().await;
    second.ensure_served().await.unwrap();
    assert!(second.is_serving().await);
    let (status, text) = over_socket(
        &second.socket_path("s"),
        "/s/s/anthropic/v1/messages",
        &[("x-api-key", &first.token("s"))],
        &anthropic_body().to_string(),
    )
    .await;
    assert_eq!(status, 200, "{text}");
}

#[tokio::test]
async fn a_provider_without_a_key_is_refused_with_the_variable_to_set() {
    let model = ScriptedModel::start(Script::text("hi")).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::start(BrokerConfig {
        dir: dir.path().to_path_buf(),
        anthropic: Some(Upstream {
            base_url: model.base_url(),
            api_key: ANTHROPIC_KEY.into(),
        }),
        openai: None,
    })
    .await
    .unwrap();
    broker.forwards("s", &NetworkPolicy::DenyAll).await.unwrap();
    broker.activate("s").unwrap();
    let (status, text) = over_socket(
        &broker.socket_path("s"),
        "/s/s/openai/responses",
        &[("authorization", &format!("Bearer {}", broker.token("s")))],
        &openai_body().to_string(),
    )
    .await;
    assert_eq!(status, 503, "{text}");
    assert!(text.contains("OPENAI_API_KEY"), "{text}");
}

#[tokio::test]
async fn a_custom_policy_gets_its_egress_proxy_and_a_bad_one_is_refused() {
    use harness_core::sandbox::EGRESS_PROXY_PORT;
    let model = ScriptedModel::start(Script::text("hi")).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let broker = broker(dir.path(), &model).await;
    // Two servers on this machine: one the policy allows, one it does not.
    let allowed = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let denied = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let allowed_port = allowed.local_addr().unwrap().port();
    let denied_port = denied.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = allowed.accept().await {
            let _ = s.write_all(b"allowed-server-says-hi").await;
        }
    });
    let policy = NetworkPolicy::Custom {
        allowed_hosts: vec![],
        allowed_cidrs: vec!["127.0.0.1/32".into()],
        denied_cidrs: vec![],
        allowed_ports: vec![allowed_port],
    };
    let forwards = broker.forwards("custom-1", &policy).await.unwrap();
    assert_eq!(forwards.len(), 2, "{forwards:?}");
    assert_eq!(forwards[1].port, EGRESS_PROXY_PORT);
    let env = broker
        .agent_env("custom-1", &policy, Reach::Forwarded)
        .await
        .unwrap();
    assert_eq!(
        env["HTTPS_PROXY"],
        format!("http://127.0.0.1:{EGRESS_PROXY_PORT}")
    );
    assert!(env["NO_PROXY"].contains("127.0.0.1"));

    let connect = |port: u16| {
        let socket = forwards[1].socket.clone();
        async move {
            let mut s = tokio::net::UnixStream::connect(&socket).await.unwrap();
            s.write_all(
                format!("CONNECT 127.0.0.1:{port} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n\r\n")
                    .as_bytes(),
            )
            .await
            .unwrap();
            let mut out = Vec::new();
            let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out)).await;
            String::from_utf8_lossy(&out).into_owned()
        }
    };
    let yes = connect(allowed_port).await;
    assert!(yes.starts_with("HTTP/1.1 200"), "{yes}");
    assert!(yes.contains("allowed-server-says-hi"), "{yes}");
    let no = connect(denied_port).await;
    assert!(no.starts_with("HTTP/1.1 403"), "{no}");
    let accepted = tokio::time::timeout(Duration::from_millis(300), denied.accept()).await;
    assert!(accepted.is_err(), "the refused destination was dialled");

    // A policy the proxy cannot enforce is refused before any sandbox exists.
    let bad = NetworkPolicy::Custom {
        allowed_hosts: vec!["exa mple.com".into()],
        allowed_cidrs: vec!["10.0.0.0/33".into()],
        denied_cidrs: vec![],
        allowed_ports: vec![],
    };
    let err = broker.forwards("custom-2", &bad).await.unwrap_err();
    assert_eq!(err.kind(), harness_core::ErrorKind::InvalidInput, "{err}");
    assert!(err.to_string().contains("10.0.0.0/33"), "{err}");
}

/// The age of `session`'s turn mark in `dir`.
fn mark_age(dir: &std::path::Path, session: &str) -> Duration {
    std::fs::metadata(dir.join("active").join(session))
        .unwrap()
        .modified()
        .unwrap()
        .elapsed()
        .unwrap_or_default()
}

/// Make `session`'s turn mark in `dir` two hours old.
fn age_mark(dir: &std::path::Path, session: &str) {
    let two_hours_ago = std::time::SystemTime::now() - Duration::from_secs(7200);
    std::fs::File::options()
        .write(true)
        .open(dir.join("active").join(session))
        .unwrap()
        .set_modified(two_hours_ago)
        .unwrap();
}

/// A detached broker (`serve_until_idle`) stays up while a turn's mark is
/// fresh and stops once the only marks left are ones nothing refreshed for
/// `stale_after` (a runner killed and never restarted); a model call and a
/// slice (`turn_running`) refresh a session's mark, and `turn_running`
/// makes none for a session with no turn.
#[tokio::test]
async fn a_turn_mark_nothing_refreshes_no_longer_keeps_the_broker_up() {
    let model = ScriptedModel::start(Script::text("hi")).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = BrokerConfig {
        dir: dir.path().to_path_buf(),
        anthropic: Some(Upstream {
            base_url: model.base_url(),
            api_key: ANTHROPIC_KEY.into(),
        }),
        openai: None,
    };
    let setup = broker(dir.path(), &model).await;
    setup
        .forwards("gone", &NetworkPolicy::DenyAll)
        .await
        .unwrap();
    setup
        .forwards("live", &NetworkPolicy::DenyAll)
        .await
        .unwrap();
    setup.activate("gone").unwrap();
    age_mark(dir.path(), "gone");
    setup.shutdown().await;

    // Only a stale mark: the broker stops after `idle_exit`.
    let (idle, stale) = (Duration::from_secs(1), Duration::from_secs(3600));
    let started = Instant::now();
    tokio::time::timeout(
        Duration::from_secs(20),
        Broker::serve_until_idle(config.clone(), idle, stale),
    )
    .await
    .expect("a broker with only a stale mark stops")
    .unwrap();
    assert!(started.elapsed() < Duration::from_secs(10));

    // A fresh mark keeps it up.
    setup.activate("live").unwrap();
    let serving = tokio::spawn(Broker::serve_until_idle(config.clone(), idle, stale));
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        !serving.is_finished(),
        "the broker stopped with a turn running"
    );

    // The session's model call refreshes its mark.
    age_mark(dir.path(), "live");
    let (status, text) = over_socket(
        &setup.socket_path("live"),
        "/s/live/anthropic/v1/messages",
        &[("x-api-key", &setup.token("live"))],
        &anthropic_body().to_string(),
    )
    .await;
    assert_eq!(status, 200, "{text}");
    assert!(mark_age(dir.path(), "live") < Duration::from_secs(60));

    // So does a slice; a session with no turn gets no mark.
    age_mark(dir.path(), "live");
    setup.turn_running("live").await.unwrap();
    assert!(mark_age(dir.path(), "live") < Duration::from_secs(60));
    setup.turn_running("idle").await.unwrap();
    assert!(!dir.path().join("active/idle").exists());
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        !serving.is_finished(),
        "the broker stopped with a turn running"
    );

    // The turn ends: the broker stops (the stale mark is still there).
    setup.turn_ended("live").await.unwrap();
    tokio::time::timeout(Duration::from_secs(20), serving)
        .await
        .expect("the broker stops once no fresh mark is left")
        .unwrap()
        .unwrap();
    assert!(dir.path().join("active/gone").exists());
}
