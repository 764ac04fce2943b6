//! The Cloudflare Sandbox bridge test server and its OpenAPI referee.
//!
//! The `OpenApi` tests check that the referee catches what it must (a
//! renamed field, a bad header, an out-of-range port, an undeclared status,
//! a missing required field, a malformed event stream). The live tests run
//! the server over real Docker sandboxes and drive it the way the
//! `sandbox-cloudflare` provider does, with every request and response
//! checked against the bridge's own document.

use std::sync::Arc;

use base64::Engine as _;
use harness_core::sandbox::{SandboxProvider, SandboxSpec};
use harness_testkit::bridge::{check_exec_sse, BridgeServer, BridgeServerConfig, OpenApi};
use http::{HeaderMap, HeaderValue};
use serde_json::{json, Value};

const TOKEN: &str = "test-token";

/// The pinned document, or a skip (a failure under `HARNESS_REQUIRE_REAL=1`)
/// when `cargo xtask deps` has not installed it.
fn api() -> Option<OpenApi> {
    match OpenApi::pinned() {
        Ok(api) => Some(api),
        Err(e) => {
            harness_testkit::skip_or_fail(&format!("{e:#}"));
            None
        }
    }
}

fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (k, v) in pairs {
        h.insert(*k, HeaderValue::from_str(v).unwrap());
    }
    h
}

fn json_request() -> HeaderMap {
    headers(&[
        ("authorization", "Bearer t"),
        ("content-type", "application/json"),
    ])
}

fn exec_ok(api: &OpenApi, body: &Value, extra: &[(&'static str, &str)]) -> Vec<String> {
    let mut h = json_request();
    for (k, v) in extra {
        h.insert(*k, HeaderValue::from_str(v).unwrap());
    }
    api.validate_request(
        "POST",
        "/v1/sandbox/abc/exec",
        &h,
        body.to_string().as_bytes(),
    )
}

#[test]
fn openapi_accepts_valid_requests() {
    let Some(api) = api() else { return };
    let v = exec_ok(
        &api,
        &json!({"argv": ["sh", "-c", "echo hi"], "timeout_ms": 1000, "cwd": "/workspace"}),
        &[("session-id", "s-1.a_b")],
    );
    assert!(v.is_empty(), "{v:?}");
    let v = api.validate_request("GET", "/health", &HeaderMap::new(), b"");
    assert!(v.is_empty(), "{v:?}");
    let h = headers(&[
        ("authorization", "Bearer t"),
        ("content-type", "application/octet-stream"),
    ]);
    let v = api.validate_request("PUT", "/v1/sandbox/abc/file/workspace/a/b.txt", &h, b"x");
    assert!(v.is_empty(), "{v:?}");
    let v = api.validate_request("POST", "/v1/sandbox/abc/persist?excludes=a,b", &h, b"");
    assert!(v.is_empty(), "{v:?}");
    let v = api.validate_request("POST", "/v1/sandbox/abc/tunnel/8080", &h, b"");
    assert!(v.is_empty(), "{v:?}");
}

#[test]
fn openapi_catches_a_renamed_field() {
    let Some(api) = api() else { return };
    let v = exec_ok(&api, &json!({"args": ["true"]}), &[]);
    assert!(
        v.iter()
            .any(|e| e.contains("argv") && e.contains("POST /v1/sandbox/abc/exec")),
        "{v:?}"
    );
    let v = exec_ok(&api, &json!({"argv": []}), &[]);
    assert!(!v.is_empty(), "an empty argv passed");
    let v = exec_ok(&api, &json!({"argv": ["true"], "timeout_ms": "1000"}), &[]);
    assert!(!v.is_empty(), "a string timeout passed");
    // A JSON body sent without its content type is a drift too.
    let h = headers(&[("authorization", "Bearer t")]);
    let v = api.validate_request("POST", "/v1/sandbox/abc/exec", &h, br#"{"argv":["true"]}"#);
    assert!(v.iter().any(|e| e.contains("Content-Type")), "{v:?}");
}

#[test]
fn openapi_catches_bad_parameters_and_auth() {
    let Some(api) = api() else { return };
    let v = exec_ok(
        &api,
        &json!({"argv": ["true"]}),
        &[("session-id", "../etc")],
    );
    assert!(v.iter().any(|e| e.contains("Session-Id")), "{v:?}");
    let h = json_request();
    for port in ["80", "70000", "http"] {
        let path = format!("/v1/sandbox/abc/tunnel/{port}");
        let v = api.validate_request("POST", &path, &h, b"");
        assert!(v.iter().any(|e| e.contains("port")), "port {port}: {v:?}");
    }
    let v = api.validate_request("POST", "/v1/sandbox/abc/exic", &h, b"{}");
    assert!(v.iter().any(|e| e.contains("no operation")), "{v:?}");
    let no_auth = headers(&[("content-type", "application/json")]);
    let v = api.validate_request(
        "POST",
        "/v1/sandbox/abc/exec",
        &no_auth,
        br#"{"argv":["true"]}"#,
    );
    assert!(v.iter().any(|e| e.contains("Bearer")), "{v:?}");
}

#[test]
fn openapi_catches_bad_responses() {
    let Some(api) = api() else { return };
    let json_ct = headers(&[("content-type", "application/json")]);
    let v = api.validate_response("POST", "/v1/sandbox", 200, &json_ct, br#"{"id":"abc"}"#);
    assert!(v.is_empty(), "{v:?}");
    let v = api.validate_response("POST", "/v1/sandbox", 200, &json_ct, br#"{"name":"abc"}"#);
    assert!(
        v.iter().any(|e| e.contains("id")),
        "a missing id passed: {v:?}"
    );
    let v = api.validate_response(
        "POST",
        "/v1/sandbox/abc/exec",
        418,
        &json_ct,
        br#"{"error":"x","code":"invalid_request"}"#,
    );
    assert!(v.iter().any(|e| e.contains("418")), "{v:?}");
    let v = api.validate_response(
        "POST",
        "/v1/sandbox/abc/exec",
        403,
        &json_ct,
        br#"{"error":"x","code":"no_such_code"}"#,
    );
    assert!(!v.is_empty(), "an undeclared error code passed");
    let v = api.validate_response(
        "POST",
        "/v1/sandbox/abc/exec",
        200,
        &json_ct,
        br#"{"exit_code":0}"#,
    );
    assert!(v.iter().any(|e| e.contains("Content-Type")), "{v:?}");
    let v = api.validate_response("DELETE", "/v1/sandbox/abc", 204, &HeaderMap::new(), b"");
    assert!(v.is_empty(), "{v:?}");
}

#[test]
fn openapi_catches_malformed_event_streams() {
    let Some(api) = api() else { return };
    let sse = headers(&[("content-type", "text/event-stream")]);
    let check = |body: &str| {
        api.validate_response("POST", "/v1/sandbox/abc/exec", 200, &sse, body.as_bytes())
    };
    let good = "event: stdout\ndata: aGk=\n\nevent: stderr\ndata: b2g=\n\nevent: exit\ndata: {\"exit_code\":3}\n\n";
    assert!(check(good).is_empty(), "{:?}", check(good));
    let err = "event: error\ndata: {\"error\":\"boom\",\"code\":\"exec_error\"}\n\n";
    assert!(check(err).is_empty(), "{:?}", check(err));
    for bad in [
        // no terminal event
        "event: stdout\ndata: aGk=\n\n",
        // stdout not base64
        "event: stdout\ndata: hi there\n\nevent: exit\ndata: {\"exit_code\":0}\n\n",
        // unknown event
        "event: output\ndata: aGk=\n\nevent: exit\ndata: {\"exit_code\":0}\n\n",
        // exit code not an integer
        "event: exit\ndata: {\"exit_code\":\"0\"}\n\n",
        // two terminal events
        "event: exit\ndata: {\"exit_code\":0}\n\nevent: exit\ndata: {\"exit_code\":0}\n\n",
        // output after the end
        "event: exit\ndata: {\"exit_code\":0}\n\nevent: stdout\ndata: aGk=\n\n",
        // error without code
        "event: error\ndata: {\"error\":\"boom\"}\n\n",
        // cut off before its blank line
        "event: exit\ndata: {\"exit_code\":0}\n",
    ] {
        assert!(!check(bad).is_empty(), "accepted {bad:?}");
        assert!(
            !check_exec_sse(bad.as_bytes()).is_empty(),
            "accepted {bad:?}"
        );
    }
}

// ------------------------------------------------------------------ live

fn docker_image() -> String {
    std::env::var("HARNESS_TEST_IMAGE")
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "harness-test:bookworm".into())
}

async fn docker() -> Option<Arc<dyn SandboxProvider>> {
    let config = sandbox_docker::DockerConfig {
        default_image: docker_image(),
        ..Default::default()
    };
    let provider = match sandbox_docker::DockerProvider::connect(config).await {
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
    Some(Arc::new(provider))
}

struct Client {
    http: reqwest::Client,
    base: String,
}

impl Client {
    fn new(server: &BridgeServer) -> Self {
        Self {
            http: reqwest::Client::new(),
            base: server.url(),
        }
    }

    fn req(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        self.http
            .request(method, format!("{}{path}", self.base))
            .bearer_auth(TOKEN)
    }

    async fn post_json(&self, path: &str, body: Value) -> (u16, Value) {
        let r = self
            .req(reqwest::Method::POST, path)
            .json(&body)
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(Value::Null))
    }

    /// Run an exec; the status, and for a 200 the decoded stdout, stderr and
    /// the terminal event.
    async fn exec(&self, id: &str, body: Value, session: Option<&str>) -> Exec {
        let mut req = self
            .req(reqwest::Method::POST, &format!("/v1/sandbox/{id}/exec"))
            .json(&body);
        if let Some(s) = session {
            req = req.header("Session-Id", s);
        }
        let r = req.send().await.unwrap();
        let status = r.status().as_u16();
        let text = r.text().await.unwrap();
        let mut exec = Exec {
            status,
            body: text.clone(),
            ..Default::default()
        };
        if status != 200 {
            return exec;
        }
        assert!(
            check_exec_sse(text.as_bytes()).is_empty(),
            "bad stream {text:?}"
        );
        for block in text.split("\n\n").filter(|b| !b.is_empty()) {
            let mut event = "";
            let mut data = String::new();
            for line in block.lines() {
                if let Some(e) = line.strip_prefix("event: ") {
                    event = e;
                } else if let Some(d) = line.strip_prefix("data: ") {
                    data.push_str(d);
                }
            }
            let b64 = base64::engine::general_purpose::STANDARD;
            match event {
                "stdout" => exec
                    .stdout
                    .push_str(&String::from_utf8(b64.decode(&data).unwrap()).unwrap()),
                "stderr" => exec
                    .stderr
                    .push_str(&String::from_utf8(b64.decode(&data).unwrap()).unwrap()),
                "exit" => {
                    exec.exit_code =
                        serde_json::from_str::<Value>(&data).unwrap()["exit_code"].as_i64()
                }
                "error" => exec.error = Some(serde_json::from_str(&data).unwrap()),
                other => panic!("unexpected event {other}"),
            }
        }
        exec
    }
}

#[derive(Debug, Default)]
struct Exec {
    status: u16,
    body: String,
    stdout: String,
    stderr: String,
    exit_code: Option<i64>,
    error: Option<Value>,
}

async fn start(provider: Arc<dyn SandboxProvider>, api: OpenApi) -> BridgeServer {
    BridgeServer::start(
        provider,
        BridgeServerConfig {
            token: TOKEN.to_string(),
            spec: SandboxSpec::new("/ignored"),
            openapi: Some(api),
        },
    )
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn bridge_server_serves_real_sandboxes() {
    let Some(api) = api() else { return };
    let Some(provider) = docker().await else {
        return;
    };
    let server = start(provider, api).await;
    let c = Client::new(&server);

    // Health needs no token; everything else does.
    let r = reqwest::get(format!("{}/health", server.url()))
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Value>().await.unwrap(), json!({"ok": true}));
    let r = reqwest::Client::new()
        .post(format!("{}/v1/sandbox", server.url()))
        .bearer_auth("wrong")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    assert_eq!(r.json::<Value>().await.unwrap()["code"], "unauthorized");

    let r = c
        .req(reqwest::Method::POST, "/v1/sandbox")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let id = r.json::<Value>().await.unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        id.bytes().all(|b| matches!(b, b'a'..=b'z' | b'2'..=b'7')),
        "{id}"
    );

    // Nothing is made until the id is used; `running` does not make it.
    let r = c
        .req(reqwest::Method::GET, &format!("/v1/sandbox/{id}/running"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.json::<Value>().await.unwrap(), json!({"running": false}));
    assert!(server.sandboxes().is_empty());

    // exec: stdout, stderr and the exit code, in /workspace.
    let e = c
        .exec(
            &id,
            json!({"argv": ["sh", "-c", "pwd; echo oops >&2; exit 3"]}),
            None,
        )
        .await;
    assert_eq!(e.status, 200, "{e:?}");
    assert_eq!(
        (e.stdout.as_str(), e.stderr.as_str(), e.exit_code),
        ("/workspace\n", "oops\n", Some(3)),
        "{e:?}"
    );
    assert_eq!(server.sandboxes(), vec![id.clone()]);
    let r = c
        .req(reqwest::Method::GET, &format!("/v1/sandbox/{id}/running"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.json::<Value>().await.unwrap(), json!({"running": true}));

    // Arguments are passed as they are, not re-split by a shell.
    let e = c
        .exec(
            &id,
            json!({"argv": ["printf", "%s|", "a b", "$HOME", "it's"]}),
            None,
        )
        .await;
    assert_eq!(e.stdout, "a b|$HOME|it's|", "{e:?}");

    // A command killed by a signal exits 128+N.
    let e = c
        .exec(&id, json!({"argv": ["sh", "-c", "kill -9 $$"]}), None)
        .await;
    assert_eq!(e.exit_code, Some(137), "{e:?}");

    // A timeout ends the stream with an error event.
    let e = c
        .exec(
            &id,
            json!({"argv": ["sleep", "30"], "timeout_ms": 500}),
            None,
        )
        .await;
    assert_eq!(
        e.error.as_ref().map(|v| v["code"].clone()),
        Some(json!("exec_error")),
        "{e:?}"
    );

    // cwd: inside /workspace is fine, outside is 403.
    c.exec(&id, json!({"argv": ["mkdir", "-p", "sub"]}), None)
        .await;
    let e = c
        .exec(&id, json!({"argv": ["pwd"], "cwd": "sub"}), None)
        .await;
    assert_eq!(e.stdout, "/workspace/sub\n", "{e:?}");
    for cwd in ["/tmp", "/workspace/../etc", "../x"] {
        let e = c
            .exec(&id, json!({"argv": ["pwd"], "cwd": cwd}), None)
            .await;
        assert_eq!(e.status, 403, "cwd {cwd}: {e:?}");
        assert!(e.body.contains("within /workspace"), "{e:?}");
    }

    // Files: PUT then GET; a missing file is 404; outside /workspace is 403.
    let r = c
        .req(
            reqwest::Method::PUT,
            &format!("/v1/sandbox/{id}/file/workspace/dir/hello.txt"),
        )
        .header("content-type", "application/octet-stream")
        .body("hello, bridge\n")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Value>().await.unwrap(), json!({"ok": true}));
    let r = c
        .req(
            reqwest::Method::GET,
            &format!("/v1/sandbox/{id}/file/workspace/dir/hello.txt"),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.text().await.unwrap(), "hello, bridge\n");
    let r = c
        .req(
            reqwest::Method::GET,
            &format!("/v1/sandbox/{id}/file/workspace/nope.txt"),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    assert_eq!(
        r.json::<Value>().await.unwrap()["code"],
        "workspace_read_not_found"
    );
    let r = c
        .req(
            reqwest::Method::GET,
            &format!("/v1/sandbox/{id}/file/etc/passwd"),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403);

    // persist → hydrate into a fresh sandbox: the files come back, the
    // excluded directory does not.
    c.exec(
        &id,
        json!({"argv": ["sh", "-c", "mkdir -p cache && echo x > cache/junk"]}),
        None,
    )
    .await;
    let r = c
        .req(
            reqwest::Method::POST,
            &format!("/v1/sandbox/{id}/persist?excludes=cache"),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let tar = r.bytes().await.unwrap();
    let mut names: Vec<String> = tar::Archive::new(&tar[..])
        .entries()
        .unwrap()
        .map(|e| e.unwrap().path().unwrap().display().to_string())
        .collect();
    names.sort();
    assert!(
        names.iter().any(|n| n.ends_with("dir/hello.txt")),
        "{names:?}"
    );
    assert!(!names.iter().any(|n| n.contains("cache")), "{names:?}");
    let r = c
        .req(
            reqwest::Method::POST,
            &format!("/v1/sandbox/{id}/persist?excludes=../x"),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);

    let other = {
        let r = c
            .req(reqwest::Method::POST, "/v1/sandbox")
            .send()
            .await
            .unwrap();
        r.json::<Value>().await.unwrap()["id"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let r = c
        .req(
            reqwest::Method::POST,
            &format!("/v1/sandbox/{other}/hydrate"),
        )
        .header("content-type", "application/octet-stream")
        .body(tar.to_vec())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Value>().await.unwrap(), json!({"ok": true}));
    let e = c
        .exec(&other, json!({"argv": ["cat", "dir/hello.txt"]}), None)
        .await;
    assert_eq!(e.stdout, "hello, bridge\n", "{e:?}");

    // Sessions carry env and cwd into the execs that name them.
    let (status, s) = c
        .post_json(
            &format!("/v1/sandbox/{id}/session"),
            json!({"id": "build", "env": {"GREETING": "hi from session"}, "cwd": "/workspace/sub"}),
        )
        .await;
    assert_eq!((status, s.clone()), (200, json!({"id": "build"})));
    let (_, again) = c
        .post_json(&format!("/v1/sandbox/{id}/session"), json!({"id": "build"}))
        .await;
    assert_eq!(again, json!({"id": "build"}));
    let e = c
        .exec(
            &id,
            json!({"argv": ["sh", "-c", "echo $GREETING; pwd"]}),
            Some("build"),
        )
        .await;
    assert_eq!(e.stdout, "hi from session\n/workspace/sub\n", "{e:?}");
    let e = c
        .exec(
            &id,
            json!({"argv": ["sh", "-c", "echo ${GREETING:-none}"]}),
            None,
        )
        .await;
    assert_eq!(e.stdout, "none\n", "{e:?}");
    let r = c
        .req(
            reqwest::Method::DELETE,
            &format!("/v1/sandbox/{id}/session/build"),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(
        r.json::<Value>().await.unwrap(),
        json!({"success": true, "sessionId": "build"})
    );

    // A tunnel is the sandbox's own address, reachable from here.
    let r = c
        .req(
            reqwest::Method::POST,
            &format!("/v1/sandbox/{id}/tunnel/8080"),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let tunnel = r.json::<Value>().await.unwrap();
    let url = tunnel["url"].as_str().unwrap().to_string();
    assert!(
        url.starts_with("http://") && url.ends_with(":8080"),
        "{tunnel}"
    );
    // Serve for as long as the exec's stream is held open (the test image's
    // Python has `socket` but not `http.server`).
    let serve = r#"import socket
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 8080))
s.listen()
while True:
    c, _ = s.accept()
    c.recv(65536)
    c.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: 14\r\n\r\nhello, tunnel\n")
    c.close()
"#;
    let serving = c
        .req(reqwest::Method::POST, &format!("/v1/sandbox/{id}/exec"))
        .json(&json!({"argv": ["python3", "-c", serve]}))
        .send()
        .await
        .unwrap();
    assert_eq!(serving.status(), 200);
    let mut served = None;
    for _ in 0..100 {
        if let Ok(r) = reqwest::get(format!("{url}/")).await {
            served = Some(r.text().await.unwrap());
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert_eq!(
        served.as_deref(),
        Some("hello, tunnel\n"),
        "nothing answered at {url}"
    );
    // A client that goes away ends its command.
    drop(serving);
    let mut stopped = false;
    for _ in 0..100 {
        if reqwest::get(format!("{url}/")).await.is_err() {
            stopped = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(stopped, "the server at {url} outlived its exec's client");
    // Asking again for the port answers the same tunnel.
    let r = c
        .req(
            reqwest::Method::POST,
            &format!("/v1/sandbox/{id}/tunnel/8080"),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.json::<Value>().await.unwrap(), tunnel);
    let r = c
        .req(
            reqwest::Method::DELETE,
            &format!("/v1/sandbox/{id}/tunnel/8080"),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);

    // delete: gone, idempotent, and a later use makes a fresh sandbox.
    for _ in 0..2 {
        let r = c
            .req(reqwest::Method::DELETE, &format!("/v1/sandbox/{id}"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 204);
    }
    assert_eq!(server.sandboxes(), vec![other.clone()]);
    let r = c
        .req(reqwest::Method::GET, &format!("/v1/sandbox/{id}/running"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.json::<Value>().await.unwrap(), json!({"running": false}));
    let e = c.exec(&id, json!({"argv": ["ls", "dir"]}), None).await;
    assert_ne!(
        e.exit_code,
        Some(0),
        "the fresh sandbox has the old files: {e:?}"
    );

    server.check().unwrap();
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_drifted_request_fails_the_check() {
    let Some(api) = api() else { return };
    // The request is refused before any sandbox is needed: a local provider
    // that is never asked for one will do.
    let root = tempfile::tempdir().unwrap();
    let provider: Arc<dyn SandboxProvider> =
        Arc::new(sandbox_local::LocalProvider::new(root.path()));
    let server = start(provider, api).await;
    let c = Client::new(&server);
    let e = c.exec("abc", json!({"args": ["true"]}), None).await;
    assert_eq!(e.status, 400, "{e:?}");
    let body: Value = serde_json::from_str(&e.body).unwrap();
    assert_eq!(body["code"], "invalid_request");
    assert!(body["error"].as_str().unwrap().contains("argv"), "{body}");
    let err = server.check().unwrap_err().to_string();
    assert!(
        err.contains("POST /v1/sandbox/abc/exec") && err.contains("argv"),
        "{err}"
    );
    assert!(server.sandboxes().is_empty());
    server.shutdown().await.unwrap();
}

/// The bridge's limits and refusals, on a server without the referee: some
/// of them (the 413 of a too-large write, a malformed sandbox id) are the
/// bridge's real answers but not in its document, so a validating server
/// would record them as drift.
#[tokio::test(flavor = "multi_thread")]
async fn bridge_limits_and_refusals() {
    let Some(provider) = docker().await else {
        return;
    };
    let server = BridgeServer::start(
        provider,
        BridgeServerConfig {
            token: TOKEN.to_string(),
            spec: SandboxSpec::new("/ignored"),
            openapi: None,
        },
    )
    .await
    .unwrap();
    let c = Client::new(&server);
    let id = "limits";
    let code = |v: Value| v["code"].as_str().unwrap_or_default().to_string();

    let too_big = vec![b'x'; 32 * 1024 * 1024 + 1];
    let r = c
        .req(
            reqwest::Method::PUT,
            &format!("/v1/sandbox/{id}/file/workspace/big"),
        )
        .header("content-type", "application/octet-stream")
        .body(too_big.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 413);
    assert_eq!(code(r.json().await.unwrap()), "payload_too_large");
    let r = c
        .req(reqwest::Method::POST, &format!("/v1/sandbox/{id}/hydrate"))
        .header("content-type", "application/octet-stream")
        .body(too_big)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let body: Value = r.json().await.unwrap();
    assert_eq!(code(body.clone()), "invalid_request");
    assert!(
        body["error"].as_str().unwrap().contains("too large"),
        "{body}"
    );
    let r = c
        .req(reqwest::Method::POST, &format!("/v1/sandbox/{id}/hydrate"))
        .header("content-type", "application/octet-stream")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let r = c
        .req(reqwest::Method::POST, &format!("/v1/sandbox/{id}/hydrate"))
        .header("content-type", "application/octet-stream")
        .body("not a tar archive, not at all, and long enough to be read")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 502);
    assert_eq!(
        code(r.json().await.unwrap()),
        "workspace_archive_write_error"
    );

    let e = c.exec(id, json!({"argv": []}), None).await;
    assert_eq!(e.status, 400, "{e:?}");
    let e = c.exec(id, json!({"argv": ["true"]}), Some("../x")).await;
    assert_eq!(e.status, 400, "{e:?}");
    let e = c.exec("Not-An-Id", json!({"argv": ["true"]}), None).await;
    assert_eq!(e.status, 400, "{e:?}");
    for port in ["80", "3000", "70000"] {
        let r = c
            .req(
                reqwest::Method::POST,
                &format!("/v1/sandbox/{id}/tunnel/{port}"),
            )
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400, "port {port}");
    }
    let r = c
        .req(reqwest::Method::GET, &format!("/v1/sandbox/{id}/pty"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let (status, body) = c
        .post_json(
            &format!("/v1/sandbox/{id}/mount"),
            json!({"mountPath": "/mnt", "options": {}}),
        )
        .await;
    assert_eq!((status, code(body)), (502, "mount_error".to_string()));
    let r = reqwest::get(format!("{}/v1/openapi.json?token={TOKEN}", server.url()))
        .await
        .unwrap();
    if r.status() == 200 {
        assert_eq!(r.json::<Value>().await.unwrap()["openapi"], "3.1.0");
    }
    assert_eq!(server.sandboxes(), vec![id.to_string()]);
    server.shutdown().await.unwrap();
}
