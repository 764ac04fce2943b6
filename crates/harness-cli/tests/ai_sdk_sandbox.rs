//! The AI SDK in our sandboxes: `harness serve`'s sandbox API
//! (`/v1/sandboxes`, `docs/ai-sdk.md`) driven by the real `HarnessAgent`
//! of `@ai-sdk/harness` with the real `@ai-sdk/harness-claude-code`
//! through this repository's npm package (`packages/ai-sdk`), the real
//! `claude` inside Docker and local sandboxes, against the scripted model
//! (which refuses any request without the real key: the key travels only
//! as a request transformation, added by the server's proxy).
//!
//! Needs Node 22 (`HARNESS_NODE22`, `cargo xtask deps`), npm and the
//! registry for the package's dependencies (installed once per lockfile
//! into `$HARNESS_CACHE/npm/ai-sdk-<hash>`), dockerd and the test image.

mod common;

use common::npm::{cache_dir, node22, run};

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::server::{docker_parts, Serve, CLIENT, HOST};
use harness_testkit::model::{
    last_is_tool_result_for, last_user_text_contains, matcher_fn, Reply, Rule, Script,
    ScriptedModel, BASH_CALL_ID,
};
use serde_json::{json, Value};

const REAL_KEY: &str = "sk-real-0f9e8d7c6b5a4f3e2d1c";
const PLACEHOLDER: &str = "placeholder-not-a-key";

fn script() -> Script {
    Script::new()
        .rule(
            Rule::new(
                last_is_tool_result_for(BASH_CALL_ID),
                Reply::text("The tool ran."),
            )
            .assert_tool_result_contains(BASH_CALL_ID, "tool-ran"),
        )
        .on(
            last_user_text_contains("run the tool"),
            Reply::shell(BASH_CALL_ID, "echo tool-ran > tool.txt && cat tool.txt"),
        )
        .on(
            last_user_text_contains("stream please"),
            Reply::text_chunks(["One, ", "two, ", "three."]).with_delay(150),
        )
        .on(
            last_user_text_contains("slow please"),
            Reply::text_chunks(["slowly ", "and ", "slower ", "still."]).with_delay(1500),
        )
        .rule(
            Rule::new(
                last_user_text_contains("what did I ask first"),
                Reply::text("You first asked me to say hello."),
            )
            // The history must hold the first turn, or the model would not know.
            .assert_user_texts_contain("say hello"),
        )
        .on(
            matcher_fn(|req| {
                req.last_user_text()
                    .is_some_and(|t| t.contains("say hello"))
            }),
            Reply::text("Hello from the scripted model."),
        )
}

fn package_dir() -> PathBuf {
    harness_testkit::checkout::path("packages/ai-sdk")
}

/// The package built from this checkout (`tsc`), its own tests run, in a
/// directory of its own (the sources copied, the cached dependencies
/// linked); the end-to-end script is copied beside its `dist/`.
struct Package {
    dir: tempfile::TempDir,
    node: PathBuf,
}

impl Package {
    fn build() -> Option<Package> {
        let node = node22()?;
        let modules = common::npm::node_modules(&package_dir(), "ai-sdk")?;
        let dir = tempfile::tempdir().unwrap();
        let src = package_dir();
        for file in [
            "package.json",
            "package-lock.json",
            "tsconfig.json",
            "README.md",
        ] {
            std::fs::copy(src.join(file), dir.path().join(file)).unwrap();
        }
        for sub in ["src", "test"] {
            std::fs::create_dir_all(dir.path().join(sub)).unwrap();
            for entry in std::fs::read_dir(src.join(sub)).unwrap() {
                let entry = entry.unwrap();
                std::fs::copy(entry.path(), dir.path().join(sub).join(entry.file_name())).unwrap();
            }
        }
        std::os::unix::fs::symlink(&modules, dir.path().join("node_modules")).unwrap();
        run(
            Command::new(&node)
                .arg("node_modules/typescript/bin/tsc")
                .args(["-p", "tsconfig.json"])
                .current_dir(dir.path()),
            "tsc",
        );
        std::fs::write(
            dir.path().join("ai_sdk_sandbox.mjs"),
            include_str!("js/ai_sdk_sandbox.mjs"),
        )
        .unwrap();
        Some(Package { dir, node })
    }

    /// Run a scenario of `js/ai_sdk_sandbox.mjs`; its RESULT.
    async fn scenario(&self, name: &str, args: Value, timeout: Duration) -> Value {
        let started = Instant::now();
        let child = tokio::process::Command::new(&self.node)
            .arg("ai_sdk_sandbox.mjs")
            .arg(name)
            .arg(args.to_string())
            .current_dir(self.dir.path())
            .kill_on_drop(true)
            .output();
        let out = tokio::time::timeout(timeout, child)
            .await
            .unwrap_or_else(|_| panic!("scenario {name} took over {timeout:?}"))
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        let result = stdout
            .lines()
            .find_map(|l| l.strip_prefix("RESULT "))
            .unwrap_or_else(|| {
                panic!(
                    "scenario {name} failed ({}):\n{stdout}\n{}",
                    out.status,
                    tail(&stderr, 6000)
                )
            });
        println!("scenario {name}: {:.1} s", started.elapsed().as_secs_f64());
        serde_json::from_str(result).unwrap()
    }
}

fn tail(s: &str, n: usize) -> &str {
    &s[s.len().saturating_sub(n)..]
}

/// What a test's server made, swept when the test ends (also when it
/// fails, before it could destroy them): the containers labelled with its
/// state directory, and the processes of its local sandboxes.
struct Sweep(PathBuf);

impl Drop for Sweep {
    fn drop(&mut self) {
        let state = self.0.join("sandbox-api");
        if let Ok(out) = Command::new("docker")
            .args(["ps", "-aq", "--filter"])
            .arg(format!("label=harness.api.state={}", state.display()))
            .output()
        {
            let ids: Vec<String> = String::from_utf8_lossy(&out.stdout)
                .lines()
                .map(str::to_string)
                .collect();
            if !ids.is_empty() {
                let _ = Command::new("docker")
                    .args(["rm", "-f"])
                    .args(&ids)
                    .output();
            }
        }
        // Local sandboxes' processes carry HARNESS_SANDBOX_ROOT under the home.
        for pid in common::server::sandbox_processes(&self.0) {
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).output();
        }
    }
}

/// `harness serve` with the sandbox API, sharing the machine's identity
/// snapshots; the scripted model (requiring the real key) on the Docker
/// bridge gateway, an address both containers and local sandboxes reach.
async fn serve_and_model(home: &Path) -> Option<(Serve, ScriptedModel, String, IpAddr)> {
    serve_with_snapshots(home, &cache_dir().join("sandbox-api-snapshots")).await
}

/// [`serve_and_model`] with the identity snapshots recorded in `snapshots`.
async fn serve_with_snapshots(
    home: &Path,
    snapshots: &Path,
) -> Option<(Serve, ScriptedModel, String, IpAddr)> {
    let (image, gateway) = docker_parts().await?;
    let node = node22()?;
    let tools = node.parent()?.parent()?.to_path_buf();
    let model = ScriptedModel::start_requiring_key(SocketAddr::new(gateway, 0), script(), REAL_KEY)
        .await
        .unwrap();
    let serve = Serve::start_with_env(
        home,
        &model,
        &["--image", &image],
        &[
            ("HARNESS_SANDBOX_TOOLS", tools.to_str().unwrap()),
            ("HARNESS_SANDBOX_SNAPSHOTS", snapshots.to_str().unwrap()),
        ],
    );
    Some((serve, model, image, gateway))
}

fn agent_args(
    serve: &Serve,
    model: &ScriptedModel,
    provider: &str,
    image: &str,
    port: u16,
    state: &Path,
) -> Value {
    json!({
        "url": serve.base,
        "token": HOST,
        "provider": provider,
        "image": image,
        "port": port,
        "modelUrl": model.base_url(),
        "modelHost": model.addr().to_string(),
        "placeholder": PLACEHOLDER,
        "realKey": REAL_KEY,
        "stateFile": state,
    })
}

/// What every agent run shows, whatever the provider.
fn assert_agent_scenarios(r: &Value) {
    assert_eq!(r["text"], "Hello from the scripted model.", "{r:#}");
    assert_eq!(r["streamText"], "One, two, three.", "{r:#}");
    assert!(
        r["streamDeltas"].as_array().unwrap().len() >= 2,
        "the text streamed in parts: {r:#}"
    );
    assert_eq!(r["toolText"], "The tool ran.", "{r:#}");
    assert_eq!(
        r["toolFile"], "tool-ran\n",
        "the bash tool ran in the sandbox: {r:#}"
    );
    assert_eq!(r["relativeRead"], "line2", "{r:#}");
    assert_eq!(r["streamedRead"], "streamed content", "{r:#}");
    assert_eq!(
        r["missing"],
        Value::Null,
        "a missing file reads as null: {r:#}"
    );
    assert_eq!(r["exit"]["exitCode"], 7, "{r:#}");
    assert_eq!(r["exit"]["stdout"], "out\n", "{r:#}");
    assert_eq!(r["exit"]["stderr"], "err\n", "{r:#}");
    assert_eq!(r["agentSeesHostWrite"], "262144", "{r:#}");
    assert_eq!(r["recall"], "You first asked me to say hello.", "{r:#}");
    assert_ne!(r["distinct"]["id1"], r["distinct"]["id2"], "{r:#}");
    assert_eq!(
        r["distinct"]["other"],
        Value::Null,
        "another session's file is not here: {r:#}"
    );
    assert_eq!(
        r["secondSessionText"], "Hello from the scripted model.",
        "{r:#}"
    );
    assert_eq!(r["abort"], "AbortError", "{r:#}");
    assert_eq!(r["afterAbort"], "Hello from the scripted model.", "{r:#}");
    if r["emptyTurnAfterAbort"] == json!(true) {
        println!("note: the first turn after the abort came back empty (harness 1.0.40), the next worked");
    }
    if let Some(error) = r["upstreamErrorAfterAbort"].as_str() {
        println!(
            "note: @ai-sdk/harness 1.0.40 threw after the abort ({error}); the session went on"
        );
    }
    assert_eq!(r["destroyed"], "not_found", "{r:#}");
}

fn assert_resumed(r: &Value, provider: &str) {
    assert_eq!(r["attached"], "You first asked me to say hello.", "{r:#}");
    assert_eq!(r["rerun"], "You first asked me to say hello.", "{r:#}");
    assert_eq!(
        r["toolFileAfterStop"], "tool-ran\n",
        "stop keeps the files: {r:#}"
    );
    let scan = &r["secretScan"];
    assert_eq!(
        scan["selfTest"], "1",
        "the scan finds the key where it is: {r:#}"
    );
    assert_eq!(
        scan["procHits"], "0",
        "no process of the sandbox holds the key ({provider}): {r:#}"
    );
    assert_ne!(
        scan["placeholderInEnv"], "0",
        "the agent ran with the placeholder: {r:#}"
    );
    assert_eq!(
        scan["files"], "",
        "no file in the sandbox holds the key ({provider}): {r:#}"
    );
}

/// The model saw the key on every request that reached the script, and
/// nothing reached it without (the scripted model refuses those).
fn assert_key_only_on_the_host(model: &ScriptedModel) {
    let requests: Vec<_> = model
        .requests()
        .into_iter()
        .filter(|r| r.path.ends_with("/messages"))
        .collect();
    assert!(!requests.is_empty());
    let answered = requests.iter().filter(|r| r.rule.is_some()).count();
    assert!(answered >= 8, "the turns reached the model: {answered}");
    for r in requests.iter().filter(|r| r.rule.is_some()) {
        assert_eq!(r.header("x-api-key"), Some(REAL_KEY));
    }
    model.assert_no_failures();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ai_sdk_runs_claude_in_docker_sandboxes() {
    let Some(package) = Package::build() else {
        return;
    };
    let home = tempfile::tempdir().unwrap();
    let _sweep = Sweep(home.path().to_path_buf());
    let Some((serve, model, image, gateway)) = serve_and_model(home.path()).await else {
        return;
    };
    let state = home.path().join("resume.json");
    let args = agent_args(&serve, &model, "docker", &image, 4000, &state);
    let args_for_custom = |serve: &Serve, model: &ScriptedModel, image: &str, state: &Path| {
        agent_args(serve, model, "docker", image, 4000, state)
    };
    let started = Instant::now();
    let r = package
        .scenario("agent", args.clone(), Duration::from_secs(400))
        .await;
    println!(
        "docker: createSession {} ms (bootstrap included if cold), first turn {} ms",
        r["createSessionMs"], r["firstTurnMs"]
    );
    assert_agent_scenarios(&r);
    // Another process resumes the detached session.
    let resumed = package
        .scenario("resume", args, Duration::from_secs(240))
        .await;
    assert_resumed(&resumed, "docker");
    assert_key_only_on_the_host(&model);

    // The agent under a custom policy: the model through the proxy only.
    let mut custom = args_for_custom(&serve, &model, &image, &state);
    custom["gateway"] = json!(gateway.to_string());
    let u = package
        .scenario("agent-custom", custom, Duration::from_secs(180))
        .await;
    assert_eq!(u["text"], "Hello from the scripted model.", "{u:#}");
    assert!(
        u["direct"].as_str().unwrap().ends_with("BLOCKED"),
        "no route but the proxy: {u:#}"
    );

    // The configuration matrix: workdir, env, cpus, memory, network policy
    // (deny-all and custom, at create and at run time).
    let allowed = http_server(SocketAddr::new(gateway, 0), "allowed-body").await;
    let refused = http_server(SocketAddr::from(([127, 0, 0, 1], 0)), "loopback-body").await;
    let c = package
        .scenario(
            "config",
            json!({
                "url": serve.base, "token": HOST, "image": image, "gateway": gateway.to_string(),
                "allowedPort": allowed.port(), "refusedPort": refused.port(),
                "suffix": uuid::Uuid::new_v4().simple().to_string()[..8].to_string(),
            }),
            Duration::from_secs(180),
        )
        .await;
    assert_eq!(c["workdir"]["reported"], "/srv/work", "{c:#}");
    assert_eq!(c["workdir"]["pwd"], "/srv/work", "{c:#}");
    assert_eq!(c["env"], "bar baz", "{c:#}");
    assert!(c["cpu"] == "50000" || c["cpu"] == "50000 100000", "{c:#}");
    assert_eq!(c["memory"], "268435456", "{c:#}");
    let fails = |v: &Value| v.as_str().unwrap().starts_with("FAIL");
    let refused_403 = |v: &Value| v.as_str().unwrap().starts_with("HTTP 403");
    assert!(
        fails(&c["denyAll"]["direct"]),
        "deny-all: no route out: {c:#}"
    );
    assert!(
        refused_403(&c["denyAll"]["proxied"]),
        "deny-all: the proxy refuses: {c:#}"
    );
    for at in ["customAtRunTime", "customAtCreate"] {
        assert_eq!(c[at]["allowed"], "OK allowed-body", "{at}: {c:#}");
        assert!(refused_403(&c[at]["refused"]), "{at}: {c:#}");
        assert!(
            fails(&c[at]["direct"]),
            "{at}: no route but the proxy: {c:#}"
        );
    }
    assert_eq!(
        c["allowAllAtRunTime"]["direct"], "OK allowed-body",
        "the route came back: {c:#}"
    );
    assert!(
        refused_403(&c["allowAllAtRunTime"]["proxiedLoopback"]),
        "allow-all never hands out the host's loopback: {c:#}"
    );
    println!(
        "docker AI SDK test: {:.1} s",
        started.elapsed().as_secs_f64()
    );
    assert_no_api_containers_left(&serve).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ai_sdk_runs_claude_in_local_sandboxes() {
    let Some(package) = Package::build() else {
        return;
    };
    let home = tempfile::tempdir().unwrap();
    let _sweep = Sweep(home.path().to_path_buf());
    let Some((serve, model, image, _)) = serve_and_model(home.path()).await else {
        return;
    };
    let state = home.path().join("resume.json");
    // Local sandboxes share the host's network: the bridge's port is a
    // host port.
    let port = free_port();
    let mut args = agent_args(&serve, &model, "local", &image, port, &state);
    args["port2"] = json!(free_port());
    let r = package
        .scenario("agent", args.clone(), Duration::from_secs(400))
        .await;
    println!(
        "local: createSession {} ms, first turn {} ms",
        r["createSessionMs"], r["firstTurnMs"]
    );
    assert_agent_scenarios(&r);
    let resumed = package
        .scenario("resume", args, Duration::from_secs(240))
        .await;
    assert_resumed(&resumed, "local");
    assert_key_only_on_the_host(&model);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bootstrap_runs_once_per_identity_across_two_processes() {
    let Some(package) = Package::build() else {
        return;
    };
    let home = tempfile::tempdir().unwrap();
    let _sweep = Sweep(home.path().to_path_buf());
    // A fresh identity each run: its snapshot is this test's, removed at the end.
    let snapshots = home.path().join("snapshots");
    let Some((serve, _model, image, _)) = serve_with_snapshots(home.path(), &snapshots).await
    else {
        return;
    };
    let identity = format!("count-{}", uuid::Uuid::new_v4().simple());
    let count = home.path().join("count.txt");
    std::fs::write(&count, "").unwrap();
    let args = |session: &str| {
        json!({"url": serve.base, "token": HOST, "provider": "docker", "image": image,
               "identity": identity, "sessionId": session, "countFile": count})
    };
    let (a, b) = tokio::join!(
        package.scenario("bootstrap-once", args("boot-a"), Duration::from_secs(120)),
        async {
            // The second arrives while the first runs its hook.
            tokio::time::sleep(Duration::from_millis(300)).await;
            package
                .scenario("bootstrap-once", args("boot-b"), Duration::from_secs(120))
                .await
        }
    );
    let ran = std::fs::read_to_string(&count).unwrap();
    assert_eq!(ran.lines().count(), 1, "the hook ran once: {ran:?}");
    let first = ran.trim();
    let outcomes = [&a["bootstrap"], &b["bootstrap"]];
    assert!(
        outcomes.contains(&&json!("required")) && outcomes.contains(&&json!("snapshot")),
        "{a} {b}"
    );
    // Both sandboxes have the hook's file: the second from the snapshot.
    assert_eq!(a["by"], first, "{a}");
    assert_eq!(b["by"], first, "{b}");
    // A third create, later, starts from the snapshot too.
    let c = package
        .scenario("bootstrap-once", args("boot-c"), Duration::from_secs(120))
        .await;
    assert_eq!(c["bootstrap"], "snapshot", "{c}");
    assert_eq!(std::fs::read_to_string(&count).unwrap().lines().count(), 1);
    assert_no_api_containers_left(&serve).await;
    let records: Vec<_> = std::fs::read_dir(&snapshots).unwrap().collect();
    assert_eq!(records.len(), 1, "one snapshot for the identity");
    for record in records {
        let record: Value =
            serde_json::from_slice(&std::fs::read(record.unwrap().path()).unwrap()).unwrap();
        let image = record["image"].as_str().unwrap();
        assert!(image.starts_with("harness-sandbox-image:"), "{record}");
        let _ = Command::new("docker").args(["rmi", image]).output();
    }
}

/// A free TCP port of this machine.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A tiny HTTP server answering `body` to every request.
async fn http_server(addr: SocketAddr, body: &'static str) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = axum::Router::new().fallback(move || async move { body });
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

async fn api(
    serve: &Serve,
    method: reqwest::Method,
    path: &str,
    token: Option<&str>,
    body: Option<Value>,
) -> (u16, Value) {
    let mut req = reqwest::Client::new().request(method, serve.url(path));
    if let Some(token) = token {
        req = req.bearer_auth(token);
    }
    if let Some(body) = body {
        req = req.json(&body);
    }
    let r = req.send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// Containers the sandbox API made for sandbox `name` that still exist.
async fn api_containers(name: &str) -> Vec<String> {
    let out = Command::new("docker")
        .args([
            "ps",
            "-aq",
            "--filter",
            "label=harness.api=sandboxes",
            "--filter",
        ])
        .arg(format!("label=dev.harness.session-id={name}"))
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect()
}

async fn assert_no_api_containers_left(serve: &Serve) {
    let (status, list) = api(
        serve,
        reqwest::Method::GET,
        "/v1/sandboxes",
        Some(HOST),
        None,
    )
    .await;
    assert_eq!(status, 200);
    for sandbox in list["sandboxes"].as_array().unwrap() {
        let name = sandbox["name"].as_str().unwrap();
        let (status, _) = api(
            serve,
            reqwest::Method::DELETE,
            &format!("/v1/sandboxes/{name}"),
            Some(HOST),
            None,
        )
        .await;
        assert_eq!(status, 204);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_a_clear_4xx_and_creates_nothing() {
    let home = tempfile::tempdir().unwrap();
    let _sweep = Sweep(home.path().to_path_buf());
    let Some((serve, _model, image, _)) = serve_and_model(home.path()).await else {
        return;
    };
    let name = format!("bad-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
    let post = |token: Option<&'static str>, body: Value| {
        let serve = &serve;
        async move {
            api(
                serve,
                reqwest::Method::POST,
                "/v1/sandboxes",
                token,
                Some(body),
            )
            .await
        }
    };
    let base = json!({"provider": "docker", "image": image, "sessionId": name, "ports": [4000]});
    let with = |patch: Value| {
        let mut b = base.clone();
        for (k, v) in patch.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    };
    let cases: Vec<(&str, Option<&str>, Value, u16, &str)> = vec![
        (
            "unknown provider",
            Some(HOST),
            with(json!({"provider": "vmware"})),
            400,
            "unknown_provider",
        ),
        ("no token", None, base.clone(), 401, "unauthorized"),
        (
            "wrong token",
            Some("wrong-token-0123456789"),
            base.clone(),
            401,
            "unauthorized",
        ),
        (
            "a client token creating an unnamed sandbox",
            Some(CLIENT),
            json!({"provider": "docker"}),
            403,
            "forbidden",
        ),
        (
            "malformed policy",
            Some(HOST),
            with(json!({"networkPolicy": {"mode": "custom", "allowedHosts": ["bad host:99/x"]}})),
            400,
            "invalid_policy",
        ),
        (
            "unknown policy mode",
            Some(HOST),
            with(json!({"networkPolicy": {"mode": "open"}})),
            400,
            "invalid",
        ),
        (
            "custom with nothing allowed",
            Some(HOST),
            with(json!({"networkPolicy": {"mode": "custom"}})),
            400,
            "invalid_policy",
        ),
        (
            "a reserved port",
            Some(HOST),
            with(json!({"ports": [47812]})),
            400,
            "invalid",
        ),
        (
            "a bad transformation",
            Some(HOST),
            with(
                json!({"requestTransformations": [{"match": {"host": "https://x"}, "transform": {"headers": {"a": "b"}}}]}),
            ),
            400,
            "invalid",
        ),
        (
            "an unknown field",
            Some(HOST),
            with(json!({"memroy": 5})),
            400,
            "invalid",
        ),
        (
            "a bad session id",
            Some(HOST),
            with(json!({"sessionId": "../etc"})),
            400,
            "invalid",
        ),
        (
            "a relative workdir",
            Some(HOST),
            with(json!({"workdir": "work"})),
            400,
            "invalid",
        ),
    ];
    for (what, token, body, status, code) in cases {
        let (got, answer) = post(token, body).await;
        assert_eq!(got, status, "{what}: {answer}");
        assert_eq!(answer["error"]["code"], code, "{what}: {answer}");
        assert!(
            !answer["error"]["message"].as_str().unwrap_or("").is_empty(),
            "{what}: a message says why"
        );
    }
    let raw = reqwest::Client::new()
        .post(serve.url("/v1/sandboxes"))
        .bearer_auth(HOST)
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(raw.status().as_u16(), 400);
    // Nothing was made: no record, no container.
    let (_, list) = api(
        &serve,
        reqwest::Method::GET,
        "/v1/sandboxes",
        Some(HOST),
        None,
    )
    .await;
    assert_eq!(list["sandboxes"], json!([]), "{list}");
    assert_eq!(
        api_containers(&name).await,
        Vec::<String>::new(),
        "no container was created"
    );

    // On a sandbox that exists: an undeclared port, a wrong secret, a bad policy change.
    let (status, made) = post(Some(HOST), base.clone()).await;
    assert_eq!(status, 201, "{made}");
    let (status, answer) = api(
        &serve,
        reqwest::Method::GET,
        &format!("/v1/sandboxes/{name}/ports/5000"),
        Some(HOST),
        None,
    )
    .await;
    assert_eq!(
        (status, answer["error"]["code"].as_str()),
        (400, Some("port_not_declared")),
        "{answer}"
    );
    let (status, port) = api(
        &serve,
        reqwest::Method::GET,
        &format!("/v1/sandboxes/{name}/ports/4000"),
        Some(HOST),
        None,
    )
    .await;
    assert_eq!(status, 200, "{port}");
    let path = port["path"].as_str().unwrap();
    assert!(!path.contains('?'));
    let wrong = path.replace("/4000/", "/4000/x");
    let r = reqwest::get(serve.url(&wrong)).await.unwrap();
    assert_eq!(r.status().as_u16(), 403, "a wrong secret is refused");
    let other = path.replace("/4000/", "/5000/");
    let r = reqwest::get(serve.url(&other)).await.unwrap();
    assert_eq!(
        r.status().as_u16(),
        404,
        "a port the sandbox did not declare is not proxied"
    );
    let (status, answer) = api(
        &serve,
        reqwest::Method::PUT,
        &format!("/v1/sandboxes/{name}/network-policy"),
        Some(HOST),
        Some(json!({"mode": "custom", "deniedCIDRs": ["10.0.0.0/8"]})),
    )
    .await;
    assert_eq!(
        (status, answer["error"]["code"].as_str()),
        (400, Some("invalid_policy")),
        "{answer}"
    );
    let (status, answer) = post(Some(HOST), base.clone()).await;
    assert_eq!(
        (status, answer["error"]["code"].as_str()),
        (409, Some("sandbox_exists")),
        "{answer}"
    );
    let (status, _) = api(
        &serve,
        reqwest::Method::DELETE,
        &format!("/v1/sandboxes/{name}"),
        Some(HOST),
        None,
    )
    .await;
    assert_eq!(status, 204);
    let (status, _) = api(
        &serve,
        reqwest::Method::GET,
        &format!("/v1/sandboxes/{name}"),
        Some(HOST),
        None,
    )
    .await;
    assert_eq!(status, 404);
    assert_eq!(
        api_containers(&name).await,
        Vec::<String>::new(),
        "destroy left no container"
    );
}

/// Run `command` in sandbox `name` through the API; its exit code and
/// stdout (stderr is printed).
async fn exec(serve: &Serve, name: &str, command: &str) -> (i64, String) {
    use base64::Engine as _;
    let body = reqwest::Client::new()
        .post(serve.url(&format!("/v1/sandboxes/{name}/exec")))
        .bearer_auth(HOST)
        .json(&json!({"command": command}))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let mut stdout = Vec::new();
    let mut code = -1;
    for block in body.split("\n\n") {
        let event = block
            .lines()
            .find_map(|l| l.strip_prefix("event: "))
            .unwrap_or("");
        let data = block
            .lines()
            .find_map(|l| l.strip_prefix("data: "))
            .unwrap_or("");
        match event {
            "stdout" => stdout.extend(
                base64::engine::general_purpose::STANDARD
                    .decode(data)
                    .unwrap(),
            ),
            "stderr" => eprintln!(
                "{name}: {}",
                String::from_utf8_lossy(
                    &base64::engine::general_purpose::STANDARD
                        .decode(data)
                        .unwrap()
                )
            ),
            "error" => eprintln!("{name}: error {data}"),
            "exit" => {
                code = serde_json::from_str::<Value>(data).unwrap()["exit_code"]
                    .as_i64()
                    .unwrap()
            }
            _ => {}
        }
    }
    (code, String::from_utf8_lossy(&stdout).into_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_port_url_survives_the_sandbox_being_replaced() {
    let home = tempfile::tempdir().unwrap();
    let _sweep = Sweep(home.path().to_path_buf());
    let Some((serve, _model, image, _)) = serve_and_model(home.path()).await else {
        return;
    };
    let port = free_port();
    let (status, made) = api(
        &serve,
        reqwest::Method::POST,
        "/v1/sandboxes",
        Some(HOST),
        Some(json!({
            "provider": "docker", "image": image, "sessionId": "ports-1", "ports": [port],
        })),
    )
    .await;
    assert_eq!(status, 201, "{made}");
    // The image has no HTTP server of its own: Node (the tools the server
    // mounts) serves the page.
    let serve_page = format!(
        "(nohup node -e 'require(\"http\").createServer((q, s) => s.end(require(\"fs\").readFileSync(\"index.html\"))).listen({port}, \"0.0.0.0\")' >/dev/null 2>&1 &) && \
         for i in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/{port}) 2>/dev/null && exit 0; sleep 0.1; done; exit 1"
    );
    let start_server = format!(
        "mkdir -p site && cd site && echo \"page from $HOSTNAME $RANDOM\" > index.html && {serve_page}"
    );
    assert_eq!(exec(&serve, "ports-1", &start_server).await.0, 0);
    let (_, url) = api(
        &serve,
        reqwest::Method::GET,
        &format!("/v1/sandboxes/ports-1/ports/{port}"),
        Some(HOST),
        None,
    )
    .await;
    let path = url["path"].as_str().unwrap().to_string();
    let page = |path: String| {
        let serve = &serve;
        async move {
            let r = reqwest::get(serve.url(&format!("{path}index.html")))
                .await
                .unwrap();
            (r.status().as_u16(), r.text().await.unwrap())
        }
    };
    let (status, first) = page(path.clone()).await;
    assert_eq!(status, 200, "{first}");
    assert!(first.starts_with("page from "), "{first}");

    // Replace the sandbox (a new container, the workdir moved into it).
    let (status, replaced) = api(
        &serve,
        reqwest::Method::POST,
        "/v1/sandboxes/ports-1/replace",
        Some(HOST),
        Some(json!({})),
    )
    .await;
    assert_eq!(status, 200, "{replaced}");
    assert_ne!(replaced["id"], made["id"], "a new sandbox");
    assert_eq!(replaced["generation"], 2);
    let (_, again) = api(
        &serve,
        reqwest::Method::GET,
        &format!("/v1/sandboxes/ports-1/ports/{port}"),
        Some(HOST),
        None,
    )
    .await;
    assert_eq!(again["path"], path.as_str(), "the same URL");
    // The tree moved (the old page is there), the server is started anew.
    let restart = format!("cd site && cat index.html && {serve_page}");
    let (code, moved) = exec(&serve, "ports-1", &restart).await;
    assert_eq!(code, 0);
    assert_eq!(moved, first, "the workdir moved with the replacement");
    let (status, second) = page(path.clone()).await;
    assert_eq!(
        (status, second.as_str()),
        (200, first.as_str()),
        "the same URL reaches the new sandbox"
    );

    // Across providers: the same name and URL, now a local sandbox (its
    // port is this machine's).
    let (status, local) = api(
        &serve,
        reqwest::Method::POST,
        "/v1/sandboxes/ports-1/replace",
        Some(HOST),
        Some(json!({"provider": "local"})),
    )
    .await;
    assert_eq!(status, 200, "{local}");
    assert_eq!(local["provider"], "local");
    let (code, moved) = exec(&serve, "ports-1", &restart).await;
    assert_eq!((code, moved.as_str()), (0, first.as_str()));
    let (status, third) = page(path.clone()).await;
    assert_eq!(
        (status, third.as_str()),
        (200, first.as_str()),
        "the URL survives a move to another provider"
    );

    // Refused without the secret.
    let r = reqwest::get(serve.url(&format!("/v1/sandbox-port/ports-1/{port}/")))
        .await
        .unwrap();
    assert!(r.status().is_client_error());
    let (status, _) = api(
        &serve,
        reqwest::Method::DELETE,
        "/v1/sandboxes/ports-1",
        Some(HOST),
        None,
    )
    .await;
    assert_eq!(status, 204);
}

#[test]
fn the_npm_package_builds_passes_its_tests_and_packs_clean() {
    let Some(package) = Package::build() else {
        return;
    };
    let tests: Vec<PathBuf> = std::fs::read_dir(package.dir.path().join("test"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().ends_with(".test.mjs"))
        .collect();
    assert!(!tests.is_empty());
    let out = run(
        Command::new(&package.node)
            .arg("--test")
            .args(&tests)
            .current_dir(package.dir.path()),
        "node --test",
    );
    assert!(out.contains("# fail 0"), "{out}");
    let passed: usize = out
        .lines()
        .find_map(|l| l.strip_prefix("# pass "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0);
    assert!(passed >= 5, "{out}");
    // What `npm publish` would upload: the build, the README, the manifest.
    let packed = run(
        Command::new("npm")
            .args(["pack", "--dry-run", "--json", "--ignore-scripts"])
            .current_dir(package.dir.path()),
        "npm pack",
    );
    let packed: Value = serde_json::from_str(&packed).unwrap();
    let mut files: Vec<String> = packed[0]["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["path"].as_str().unwrap().to_string())
        .collect();
    files.sort();
    assert_eq!(
        files,
        [
            "README.md",
            "dist/chat.d.ts",
            "dist/chat.js",
            "dist/index.d.ts",
            "dist/index.js",
            "dist/session.d.ts",
            "dist/session.js",
            "dist/wire.d.ts",
            "dist/wire.js",
            "package.json",
        ],
        "npm pack holds exactly the build, the README and the manifest"
    );
    // Types only from the AI SDK at run time: no import of it in the build.
    let index = std::fs::read_to_string(package.dir.path().join("dist/index.js")).unwrap();
    assert!(
        !index.contains("from '@ai-sdk/"),
        "the build imports no AI SDK code"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_outlives_a_restart_of_the_server() {
    let home = tempfile::tempdir().unwrap();
    let _sweep = Sweep(home.path().to_path_buf());
    let Some((mut serve, model, image, _)) = serve_and_model(home.path()).await else {
        return;
    };
    let name = format!(
        "restart-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    );
    let (status, made) = api(
        &serve,
        reqwest::Method::POST,
        "/v1/sandboxes",
        Some(HOST),
        Some(json!({
            "provider": "docker", "image": image, "sessionId": name, "ports": [4000],
            "networkPolicy": {"mode": "deny-all"},
        })),
    )
    .await;
    assert_eq!(status, 201, "{made}");
    assert_eq!(exec(&serve, &name, "echo kept > kept.txt").await.0, 0);
    let (_, before) = api(
        &serve,
        reqwest::Method::GET,
        &format!("/v1/sandboxes/{name}/ports/4000"),
        Some(HOST),
        None,
    )
    .await;
    serve.kill();
    let serve = Serve::start_with_env(
        home.path(),
        &model,
        &["--image", &image],
        &[(
            "HARNESS_SANDBOX_TOOLS",
            node22()
                .unwrap()
                .parent()
                .unwrap()
                .parent()
                .unwrap()
                .to_str()
                .unwrap(),
        )],
    );
    // Found by name from the record; its policy and port URL as they were.
    let (status, info) = api(
        &serve,
        reqwest::Method::POST,
        &format!("/v1/sandboxes/{name}/resume"),
        Some(HOST),
        None,
    )
    .await;
    assert_eq!(status, 200, "{info}");
    assert_eq!(info["id"], made["id"]);
    assert_eq!(info["networkPolicy"]["mode"], "deny-all");
    assert_eq!(
        exec(&serve, &name, "cat kept.txt").await,
        (0, "kept\n".to_string())
    );
    let (_, after) = api(
        &serve,
        reqwest::Method::GET,
        &format!("/v1/sandboxes/{name}/ports/4000"),
        Some(HOST),
        None,
    )
    .await;
    assert_eq!(after["path"], before["path"]);
    // The proxy is back too: deny-all still refuses through it.
    let (code, answer) = exec(
        &serve,
        &name,
        "exec 3<>/dev/tcp/127.0.0.1/47812 && printf 'GET http://example.org/ HTTP/1.1\\r\\nHost: example.org\\r\\n\\r\\n' >&3 && head -1 <&3",
    )
    .await;
    assert_eq!(code, 0);
    assert!(answer.starts_with("HTTP/1.1 403"), "{answer}");
    let (status, _) = api(
        &serve,
        reqwest::Method::DELETE,
        &format!("/v1/sandboxes/{name}"),
        Some(HOST),
        None,
    )
    .await;
    assert_eq!(status, 204);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrap_mode_uses_the_callers_sandbox_and_leaves_it() {
    let Some(package) = Package::build() else {
        return;
    };
    let home = tempfile::tempdir().unwrap();
    let _sweep = Sweep(home.path().to_path_buf());
    let Some((serve, _model, image, _)) = serve_and_model(home.path()).await else {
        return;
    };
    let name = format!("wrap-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
    let (status, made) = api(
        &serve,
        reqwest::Method::POST,
        "/v1/sandboxes",
        Some(HOST),
        Some(json!({"provider": "docker", "image": image, "sessionId": name, "ports": [4000]})),
    )
    .await;
    assert_eq!(status, 201, "{made}");
    assert_eq!(
        exec(&serve, &name, "echo caller-made > mine.txt").await.0,
        0
    );
    let w = package
        .scenario(
            "wrap",
            json!({"url": serve.base, "token": HOST, "name": name}),
            Duration::from_secs(120),
        )
        .await;
    assert_eq!(w["bridgePorts"], json!([4000]), "{w}");
    assert_eq!(w["id"], name.as_str(), "{w}");
    assert_eq!(w["run"], "caller-made\n", "{w}");
    assert_eq!(
        w["hookRan"], false,
        "no first-create hook in wrap mode: {w}"
    );
    assert_eq!(
        w["after"], "still-here\n",
        "stop and destroy left the caller's sandbox: {w}"
    );
    let (status, _) = api(
        &serve,
        reqwest::Method::DELETE,
        &format!("/v1/sandboxes/{name}"),
        Some(HOST),
        None,
    )
    .await;
    assert_eq!(status, 204);
}
