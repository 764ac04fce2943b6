//! `harness` with `--sandbox cloudflare`, through the built binary, against
//! the test kit's bridge-compatible server (backed by the real Docker
//! engine; every request and response checked against the bridge's pinned
//! OpenAPI document): the real `claude`, the scripted model on the Docker
//! bridge gateway (reachable from the host and from the containers).
//!
//! - a new session runs in a Cloudflare sandbox (`harness run --sandbox
//!   cloudflare`), and without `--direct-model` the command says why a
//!   Cloudflare sandbox cannot use this host's model broker;
//! - a whole session moves laptop → Cloudflare: turn 1 in a local
//!   sandbox, `harness checkpoint`, `harness restore --new-session
//!   --sandbox cloudflare`, and turn 2 there sees turn 1's conversation and
//!   files.

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use common::docker::docker_parts;
use common::{continued_session, Ran};
use harness::core::sandbox::SandboxSpec;
use harness_testkit::bridge::{BridgeServer, BridgeServerConfig, OpenApi};
use harness_testkit::model::{
    last_is_tool_result_for, last_user_text_contains, Reply, Rule, Script, ScriptedModel,
};
use harness_testkit::{require_env, skip_or_fail};
use serde_json::Value;

const TOKEN: &str = "cli-bridge-token";

fn script() -> Script {
    Script::new()
        .rule(
            Rule::new(
                last_is_tool_result_for("toolu_cat_t2"),
                Reply::text("Second answer: the note says alpha-note."),
            )
            .assert_tool_result_contains("toolu_cat_t2", "alpha-note"),
        )
        .on(
            last_is_tool_result_for("toolu_note_t1"),
            Reply::text("First answer alpha."),
        )
        .rule(
            Rule::new(
                last_user_text_contains("second question"),
                Reply::shell("toolu_cat_t2", "cat notes.txt"),
            )
            .assert_user_texts_contain("the codeword is pelican-42")
            .assert_assistant_texts_contain("First answer alpha."),
        )
        .on(
            last_user_text_contains("first question"),
            Reply::shell(
                "toolu_note_t1",
                "echo alpha-note > notes.txt && echo noted from $(pwd)",
            ),
        )
}

struct Parts {
    server: BridgeServer,
    model: ScriptedModel,
}

/// The bridge server (on Docker) and the model on the bridge gateway.
async fn parts() -> Option<Parts> {
    require_env("HARNESS_CLAUDE_BIN")?;
    let (image, gateway) = docker_parts()?;
    let openapi = match OpenApi::pinned() {
        Ok(o) => o,
        Err(e) => {
            skip_or_fail(&format!("the bridge's OpenAPI document: {e:#}"));
            return None;
        }
    };
    let docker = harness::docker::DockerProvider::connect(harness::docker::DockerConfig {
        default_image: image,
        ..Default::default()
    })
    .await
    .expect("docker engine");
    let server = BridgeServer::start(
        Arc::new(docker),
        BridgeServerConfig {
            token: TOKEN.into(),
            spec: SandboxSpec::new("/workspace"),
            openapi: Some(openapi),
        },
    )
    .await
    .unwrap();
    let model = ScriptedModel::start_on(SocketAddr::new(gateway, 0), script())
        .await
        .unwrap();
    Some(Parts { server, model })
}

/// `harness --home HOME ARGS…` with the bridge configured.
async fn harness(home: &Path, parts: &Parts, direct: bool, args: &[&str]) -> Ran {
    let mut cmd = common::harness(home, &parts.model);
    cmd.args(args)
        .env("HARNESS_CF_BRIDGE_URL", parts.server.url())
        .env("HARNESS_CF_TOKEN", TOKEN);
    if direct {
        cmd.env("HARNESS_DIRECT_MODEL", "1");
    }
    common::run_to_end(cmd).await
}

async fn show_json(home: &Path, parts: &Parts, session: &str) -> Value {
    let ran = harness(home, parts, false, &["sessions", "show", session, "--json"])
        .await
        .expect_ok("sessions show --json");
    serde_json::from_str(&ran.stdout).unwrap()
}

async fn finish(parts: Parts) {
    parts.model.assert_no_failures();
    let checked = parts.server.check();
    parts.server.shutdown().await.unwrap();
    checked.expect("every bridge request and response within the OpenAPI contract");
}

#[tokio::test(flavor = "multi_thread")]
#[cfg_attr(
    not(feature = "cloudflare"),
    ignore = "needs the `cloudflare` feature (cargo test -p harness-cli --features cloudflare; CI builds --features full)"
)]
async fn harness_run_sandbox_cloudflare_runs_a_claude_turn_on_the_bridge() {
    let Some(parts) = parts().await else {
        return;
    };
    let home = tempfile::tempdir().unwrap();
    let home = home.path();

    // The broker lives on this host; a Cloudflare sandbox cannot reach it.
    let ran = harness(
        home,
        &parts,
        false,
        &[
            "run",
            "--sandbox",
            "cloudflare",
            "first question: the codeword is pelican-42",
        ],
    )
    .await;
    assert!(!ran.ok, "{}\n{}", ran.stdout, ran.stderr);
    assert!(
        ran.stderr.contains("--direct-model"),
        "the refusal says what to do:\n{}",
        ran.stderr
    );

    let ran = harness(
        home,
        &parts,
        true,
        &[
            "run",
            "--sandbox",
            "cloudflare",
            "first question: the codeword is pelican-42",
        ],
    )
    .await
    .expect_ok("a turn in a cloudflare sandbox");
    assert!(ran.stdout.contains("First answer alpha."), "{}", ran.stdout);
    let session = continued_session(&ran.stderr);
    let shown = show_json(home, &parts, &session).await;
    assert_eq!(
        shown["sandbox"]["handle"]["provider"], "cloudflare",
        "{shown:#}"
    );
    assert_eq!(shown["turns"][0]["status"], "finished", "{shown:#}");
    let id = shown["sandbox"]["handle"]["id"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        parts.server.sandboxes().contains(&id),
        "the session's sandbox {id} is on the bridge: {:?}",
        parts.server.sandboxes()
    );
    // The command ran in the bridge sandbox's /workspace.
    let requests = parts.model.model_requests();
    let result = requests
        .last()
        .and_then(|r| r.tool_result("toolu_note_t1"))
        .expect("the tool result reached the model");
    assert!(
        result.content.contains("noted from /workspace"),
        "{result:?}"
    );
    finish(parts).await;
}

#[tokio::test(flavor = "multi_thread")]
#[cfg_attr(
    not(all(feature = "cloudflare", feature = "s3")),
    ignore = "needs the `cloudflare` and `s3` features (cargo test -p harness-cli --features full)"
)]
async fn a_claude_session_moves_from_local_to_cloudflare_and_continues() {
    let Some(endpoint) = require_env("HARNESS_S3_ENDPOINT") else {
        return;
    };
    let Some(parts) = parts().await else {
        return;
    };
    let home = tempfile::tempdir().unwrap();
    let home = home.path();
    let store = common::s3_store_flags(&endpoint, "cloudflare-moves");
    let with = |args: &[&'static str]| -> Vec<String> {
        args.iter()
            .map(|s| s.to_string())
            .chain(store.iter().cloned())
            .collect()
    };

    let ran = harness(
        home,
        &parts,
        false,
        &["run", "first question: the codeword is pelican-42"],
    )
    .await
    .expect_ok("turn 1 in a local sandbox");
    assert!(ran.stdout.contains("First answer alpha."), "{}", ran.stdout);
    let a = continued_session(&ran.stderr);

    let mut args = with(&["checkpoint"]);
    args.extend(["--session".to_string(), a.clone()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let ran = harness(home, &parts, false, &args)
        .await
        .expect_ok("checkpoint");
    let key = ran
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("checkpoint "))
        .and_then(|rest| rest.split([':', ' ']).next())
        .unwrap_or_else(|| panic!("no checkpoint key printed:\n{}", ran.stdout))
        .to_string();

    let mut args = with(&["restore", "--new-session", "--sandbox", "cloudflare"]);
    args.extend(["--key".to_string(), key.clone()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let ran = harness(home, &parts, true, &args)
        .await
        .expect_ok("restore into a new cloudflare session");
    let b = continued_session(&ran.stdout);
    let shown_b = show_json(home, &parts, &b).await;
    assert_eq!(
        shown_b["sandbox"]["handle"]["provider"], "cloudflare",
        "{shown_b:#}"
    );

    let ran = harness(
        home,
        &parts,
        true,
        &["run", "--session", &b, "second question"],
    )
    .await
    .expect_ok("turn 2 in the cloudflare session");
    assert!(
        ran.stdout
            .contains("Second answer: the note says alpha-note."),
        "{}",
        ran.stdout
    );
    let requests = parts.model.model_requests();
    assert_eq!(requests.len(), 4, "{requests:#?}");
    let first_of_t2 = &requests[2];
    assert!(
        first_of_t2.tool_result("toolu_note_t1").is_some(),
        "turn 2's request carries turn 1's tool result: {first_of_t2:#?}"
    );
    let shown_b = show_json(home, &parts, &b).await;
    assert_eq!(shown_b["turns"][0]["status"], "finished", "{shown_b:#}");
    finish(parts).await;
}
