//! # sandbox-cloudflare
//!
//! A [`SandboxProvider`] over the Cloudflare Sandbox **bridge** HTTP API: the
//! Worker that `@cloudflare/sandbox` ships as `dist/bridge` (its contract,
//! `/v1/openapi.json`, is pinned in `cargo xtask deps`). One bridge sandbox
//! (a container behind a Durable Object, named by its id) is one harness
//! sandbox; the handle is its id, so another process resumes it by name.
//!
//! The bridge offers less than our contract, and this crate makes up the
//! difference on top of what it has (see `docs/sandbox-cloudflare.md`):
//!
//! | contract            | bridge                 | here                                                        |
//! |---------------------|------------------------|-------------------------------------------------------------|
//! | exec env            | per session only       | spec env in a bridge session (`Session-Id`), request env through `env` |
//! | exec stdin          | none                   | staged as a file under `/workspace/.harness-io`, redirected |
//! | exec abort/timeout  | closes the stream only | every command runs under `setsid`; a second exec kills its process group |
//! | files anywhere      | `/workspace` only, ≤32 MiB per PUT | uploads in parts into the staging dir, one exec joins and moves them |
//! | tar export          | `persist` (`/workspace`) | `persist` for the root, `tar` through exec elsewhere         |
//! | tar import          | `hydrate` (≤32 MiB, keeps owners) | scanned, staged in parts, extracted by GNU tar like Docker |
//! | ports               | tunnels                | `port_endpoint` creates the tunnel                            |
//! | network policy      | none                   | `allow-all` only; others are refused                          |
//!
//! All HTTP goes through [`transport::BridgeTransport`], so the same logic
//! runs natively ([`transport::ReqwestTransport`]) and inside a Worker.

pub mod transport;

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use base64::Engine as _;
use bytes::{Bytes, BytesMut};
use futures::StreamExt;
use harness_core::bootstrap::BootstrapRecipe;
use harness_core::sandbox::{
    collect_exec, exec_stdout_stream, export_tar_by_exec, extract_tar_failure, extract_tar_script,
    poll_detached_by_exec, resolve_path, shell_quote, DetachedProcess, DetachedStatus, ExecEvent,
    ExecOutput, ExecRequest, ExecStream, ExitReason, ExitStatus, NetworkPolicy, PortEndpoint,
    Sandbox, SandboxHandle, SandboxProvider, SandboxSpec,
};
use harness_core::sse::{SseEvent, SseReader};
use harness_core::stream::ByteStream;
use harness_core::{tarscan, Error, ErrorKind, Result};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::transport::{BridgeRequest, BridgeResponse, BridgeTransport, Method};

/// The provider name recorded in handles.
pub const PROVIDER: &str = "cloudflare";
/// The bridge's root: files, `cwd`, `persist` and `hydrate` are confined to it.
pub const ROOT: &str = "/workspace";
/// Staging directory under [`ROOT`] for stdin, file parts and archives on
/// their way in; left out of every export.
pub const STAGING_DIR: &str = ".harness-io";
/// The bridge refuses request bodies above this (PUT file, hydrate).
pub const MAX_BODY_BYTES: usize = 32 * 1024 * 1024;
/// Default size of one upload part: half the bridge's limit, so a part and
/// its base64 copy in the Worker stay well inside a Worker's memory.
pub const DEFAULT_PART_BYTES: usize = 16 * 1024 * 1024;
/// The bridge session (`Session-Id`) that carries the spec's environment.
const BRIDGE_SESSION: &str = "harness";
/// Removes the staging directory once it is empty, so the working tree
/// shows nothing of ours between uploads (a concurrent upload whose PUT then
/// finds no directory makes it again: see `put_staged`).
const DROP_EMPTY_STAGING: &str = "rmdir /workspace/.harness-io 2>/dev/null";
/// Where each running command records its process group, for the kill.
const EXEC_PID_DIR: &str = "/tmp/harness-exec";
/// Holds the sandbox's id from `create` on: `resume` finds it or reports
/// the sandbox gone (see `resume`).
const SANDBOX_MARK: &str = "/var/lib/harness/sandbox-id";
/// Where a sandbox records the bootstrap identities it has run.
const BOOTSTRAP_MARKERS: &str = "/var/lib/harness/bootstrap";
/// The base a recipe identity is computed against: the bridge's image is
/// whatever its deployment built, which the client cannot name.
const IDENTITY_BASE: &str = "cloudflare-bridge";
/// How long a killed command's stream may take to end before we stop
/// waiting for its exit event.
const KILL_GRACE: Duration = Duration::from_secs(10);

/// Where the bridge is and how to authenticate.
#[derive(Debug, Clone)]
pub struct CloudflareConfig {
    /// The bridge Worker's base URL (`https://sandbox.example.workers.dev`).
    pub url: String,
    /// The bridge's `SANDBOX_API_KEY` (sent as `Authorization: Bearer`).
    pub token: String,
    /// Bytes per upload part (at most [`MAX_BODY_BYTES`]).
    pub part_bytes: usize,
}

impl CloudflareConfig {
    /// A config for the bridge at `url` with `token`.
    pub fn new(url: impl Into<String>, token: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            token: token.into(),
            part_bytes: DEFAULT_PART_BYTES,
        }
    }

    /// From `HARNESS_CF_BRIDGE_URL` and `HARNESS_CF_TOKEN`.
    pub fn from_env() -> Result<Self> {
        let get = |name: &str| {
            std::env::var(name)
                .ok()
                .filter(|v| !v.is_empty())
                .ok_or_else(|| {
                    Error::invalid(format!(
                        "{name} is not set: the Cloudflare sandbox needs the bridge's URL \
                         (HARNESS_CF_BRIDGE_URL) and its SANDBOX_API_KEY (HARNESS_CF_TOKEN)"
                    ))
                })
        };
        Ok(Self::new(
            get("HARNESS_CF_BRIDGE_URL")?,
            get("HARNESS_CF_TOKEN")?,
        ))
    }
}

/// Sandboxes on a Cloudflare Sandbox bridge.
#[derive(Debug, Clone)]
pub struct CloudflareProvider {
    bridge: Bridge,
}

impl CloudflareProvider {
    /// A provider talking to the bridge with reqwest.
    #[cfg(feature = "native")]
    pub fn new(config: CloudflareConfig) -> Result<Self> {
        let transport = transport::ReqwestTransport::new(&config.url, &config.token)?;
        Ok(Self::with_transport(Arc::new(transport), config.part_bytes))
    }

    /// A provider over any transport (a Worker's fetch, a test double).
    pub fn with_transport(transport: Arc<dyn BridgeTransport>, part_bytes: usize) -> Self {
        Self {
            bridge: Bridge {
                transport,
                part_bytes: part_bytes.clamp(1, MAX_BODY_BYTES),
            },
        }
    }

    /// Whether the bridge answers `/health` (no token needed).
    pub async fn health(&self) -> Result<()> {
        self.bridge
            .json(BridgeRequest::new(Method::Get, "/health"))
            .await
            .map(|_| ())
    }
}

/// What a handle's `data` carries.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
struct HandleData {
    /// The spec's environment, restored into the bridge session on resume
    /// (a container that slept lost its sessions).
    #[serde(default)]
    env: BTreeMap<String, String>,
    /// Ports the spec asked for (`port_endpoint` answers only these).
    #[serde(default)]
    ports: Vec<u16>,
}

#[cfg_attr(not(target_arch = "wasm32"), async_trait)]
#[cfg_attr(target_arch = "wasm32", async_trait(?Send))]
impl SandboxProvider for CloudflareProvider {
    fn name(&self) -> &'static str {
        PROVIDER
    }

    async fn create(&self, spec: &SandboxSpec) -> Result<Box<dyn Sandbox>> {
        refuse_what_the_bridge_cannot_do(spec)?;
        let (id, owned) = match (&spec.wrap, &spec.slot) {
            (Some(id), _) => (validate_id(id)?, false),
            (None, Some(slot)) => {
                // A stable name per (session, slot): creating again replaces
                // a sandbox whose creator died before recording its handle.
                let id = slot_id(spec.session_id.as_deref().unwrap_or(""), slot);
                self.bridge.destroy(&id).await?;
                (id, true)
            }
            (None, None) => {
                let created = self
                    .bridge
                    .json(BridgeRequest::new(Method::Post, "/v1/sandbox"))
                    .await?;
                let id = created["id"].as_str().ok_or_else(|| {
                    Error::backend(format!(
                        "cloudflare bridge: POST /v1/sandbox gave no id: {created}"
                    ))
                })?;
                (validate_id(id)?, true)
            }
        };
        let sandbox = CloudflareSandbox {
            bridge: self.bridge.clone(),
            id,
            workdir: spec.workdir.clone(),
            owned,
            data: HandleData {
                env: spec.env.clone(),
                ports: spec.ports.clone(),
            },
        };
        let prepared = async {
            sandbox.open_session().await?;
            sandbox.prepare_dirs().await?;
            sandbox
                .bridge
                .sh(
                    &sandbox.id,
                    format!(
                        "mkdir -p \"$(dirname {SANDBOX_MARK})\" && printf %s {} > {SANDBOX_MARK}",
                        shell_quote(&sandbox.id)
                    ),
                )
                .await?
                .check("marking the sandbox")?;
            if let Some(recipe) = spec.bootstrap.as_ref().filter(|r| !r.is_empty()) {
                sandbox.bootstrap(recipe).await?;
            }
            Ok::<_, Error>(())
        }
        .await;
        if let Err(e) = prepared {
            if owned {
                let _ = sandbox.bridge.destroy(&sandbox.id).await;
            }
            return Err(e);
        }
        Ok(Box::new(sandbox))
    }

    async fn resume(&self, handle: &SandboxHandle) -> Result<Box<dyn Sandbox>> {
        if handle.provider != PROVIDER {
            return Err(Error::invalid(format!(
                "a {:?} handle cannot be resumed by the cloudflare provider",
                handle.provider
            )));
        }
        let data: HandleData = if handle.data.is_null() {
            HandleData::default()
        } else {
            serde_json::from_value(handle.data.clone())?
        };
        let sandbox = CloudflareSandbox {
            bridge: self.bridge.clone(),
            id: validate_id(&handle.id)?,
            workdir: handle.workdir.clone(),
            owned: handle.owned,
            data,
        };
        // The bridge starts a sleeping container on first use; its sessions
        // do not survive that, so the session is opened again.
        // The bridge makes a fresh container for any id it is asked about,
        // destroyed or not: the mark `create` left tells a live sandbox from
        // an empty stand-in (whose files, if it ever had any, are gone).
        let marked = sandbox
            .bridge
            .sh(
                &sandbox.id,
                format!(
                    "[ \"$(cat {SANDBOX_MARK} 2>/dev/null)\" = {} ]",
                    shell_quote(&sandbox.id)
                ),
            )
            .await?;
        if !marked.status.success() {
            if sandbox.owned {
                let _ = sandbox.bridge.destroy(&sandbox.id).await;
            }
            return Err(Error::not_found(format!(
                "cloudflare sandbox {} is gone: it was destroyed, or its container was \
                 recycled and its files with it",
                sandbox.id
            )));
        }
        sandbox.open_session().await?;
        sandbox.prepare_dirs().await?;
        Ok(Box::new(sandbox))
    }
}

fn refuse_what_the_bridge_cannot_do(spec: &SandboxSpec) -> Result<()> {
    if spec.network != NetworkPolicy::AllowAll {
        return Err(Error::unsupported(
            "the Cloudflare bridge has no network policy: its containers always reach the \
             network, so `deny-all` and `custom` cannot be enforced there (use `allow-all`, or \
             the local or docker sandbox)",
        ));
    }
    if !spec.forwards.is_empty() {
        return Err(Error::unsupported(
            "a Cloudflare sandbox cannot reach sockets on this host, so it takes no host \
             forwards (the model broker's among them): run with `--direct-model` \
             (HARNESS_DIRECT_MODEL=1) to give the agent its model endpoint and key directly",
        ));
    }
    if let Some(image) = &spec.image {
        return Err(Error::unsupported(format!(
            "the Cloudflare bridge's container image is fixed by its deployment (the bridge \
             Worker's Dockerfile); it cannot start image {image:?}"
        )));
    }
    if spec.cpus.is_some() || spec.memory_mb.is_some() {
        tracing::warn!(
            "cpus/memory limits are set by the bridge deployment's instance type; ignoring them"
        );
    }
    Ok(())
}

/// Bridge ids name Durable Objects; the bridge takes `[a-z2-7]{1,128}`
/// (lowercase RFC 4648 base32, as its own ids are) and answers anything
/// else with 400 `Invalid sandbox ID format`.
fn validate_id(id: &str) -> Result<String> {
    if id.is_empty()
        || id.len() > 128
        || !id.bytes().all(|b| matches!(b, b'a'..=b'z' | b'2'..=b'7'))
    {
        return Err(Error::invalid(format!(
            "{id:?} is not a Cloudflare bridge sandbox id (1-128 of [a-z2-7])"
        )));
    }
    Ok(id.to_string())
}

/// The sandbox id of a (session, slot): `h` and lowercase base32 of a
/// SHA-256, within the bridge's id alphabet.
fn slot_id(session: &str, slot: &str) -> String {
    const ALPHABET: &[u8; 32] = b"abcdefghijklmnopqrstuvwxyz234567";
    let digest = Sha256::digest(format!("{session}\0{slot}").as_bytes());
    // 120 bits are plenty: 24 base32 digits of the first 15 bytes.
    let mut out = String::from("h");
    let mut bits = 0u32;
    let mut acc = 0u32;
    for &byte in &digest[..15] {
        acc = (acc << 8) | u32::from(byte);
        bits += 8;
        while bits >= 5 {
            bits -= 5;
            out.push(ALPHABET[((acc >> bits) & 31) as usize] as char);
        }
    }
    out
}

/// The bridge API with errors mapped and bodies collected where small.
#[derive(Debug, Clone)]
struct Bridge {
    transport: Arc<dyn BridgeTransport>,
    part_bytes: usize,
}

/// Largest JSON answer read into memory.
const MAX_JSON: usize = 1024 * 1024;

impl Bridge {
    /// Send; a status of 400 or above becomes an error naming the bridge's
    /// code and message.
    async fn call(&self, request: BridgeRequest) -> Result<BridgeResponse> {
        let what = format!("{} {}", request.method.as_str(), request.path);
        let response = self.transport.send(request).await?;
        if response.status < 400 {
            return Ok(response);
        }
        let status = response.status;
        let body = harness_core::stream::collect(response.body, MAX_JSON)
            .await
            .unwrap_or_default();
        Err(bridge_error(&what, status, &body))
    }

    async fn json(&self, request: BridgeRequest) -> Result<Value> {
        let what = format!("{} {}", request.method.as_str(), request.path);
        let response = self.call(request).await?;
        let body = harness_core::stream::collect(response.body, MAX_JSON).await?;
        if body.is_empty() {
            return Ok(Value::Null);
        }
        serde_json::from_slice(&body).map_err(|e| {
            Error::backend(format!(
                "cloudflare bridge: {what} answered malformed JSON: {e}"
            ))
        })
    }

    async fn destroy(&self, id: &str) -> Result<()> {
        self.call(BridgeRequest::new(
            Method::Delete,
            format!("/v1/sandbox/{id}"),
        ))
        .await
        .map(|_| ())
    }

    /// Start `argv` as given (no wrapper) and return the raw SSE response.
    async fn exec_raw(&self, id: &str, argv: Vec<String>, session: bool) -> Result<BridgeResponse> {
        let mut request = BridgeRequest::new(Method::Post, format!("/v1/sandbox/{id}/exec"))
            .json(json!({ "argv": argv }));
        if session {
            request = request.header("Session-Id", BRIDGE_SESSION);
        }
        self.call(request).await
    }

    /// Start a helper shell script (no wrapper: no abort, no stdin).
    async fn sh_events(&self, id: &str, script: String) -> Result<ExecStream> {
        let response = self
            .exec_raw(id, vec!["sh".into(), "-c".into(), script], false)
            .await?;
        Ok(exec_events(
            response,
            None,
            self.clone(),
            id.to_string(),
            String::new(),
        ))
    }

    /// Run a helper shell script to its end.
    async fn sh(&self, id: &str, script: String) -> Result<ExecOutput> {
        collect_exec(self.sh_events(id, script).await?).await
    }

    /// PUT `bytes` to a path under the root (`workspace/...`).
    async fn put(&self, id: &str, path: &str, bytes: Bytes) -> Result<()> {
        let request = BridgeRequest::new(
            Method::Put,
            format!("/v1/sandbox/{id}/file/{}", encode_path(path)),
        )
        .bytes(bytes);
        self.call(request).await.map(|_| ())
    }
}

/// Map a bridge error answer (`{"error","code"}`) to our kinds, keeping the
/// bridge's message.
fn bridge_error(what: &str, status: u16, body: &[u8]) -> Error {
    let parsed: Option<Value> = serde_json::from_slice(body).ok();
    let code = parsed
        .as_ref()
        .and_then(|v| v["code"].as_str())
        .unwrap_or("")
        .to_string();
    let message = parsed
        .as_ref()
        .and_then(|v| v["error"].as_str().map(str::to_string))
        .unwrap_or_else(|| String::from_utf8_lossy(&body[..body.len().min(500)]).into_owned());
    let kind = match (code.as_str(), status) {
        ("unauthorized", _) | (_, 401) => ErrorKind::Unauthorized,
        ("workspace_read_not_found", _) | (_, 404) => ErrorKind::NotFound,
        ("invalid_request", _) | ("payload_too_large", _) | (_, 400) | (_, 413) => {
            ErrorKind::InvalidInput
        }
        (_, 403) => ErrorKind::InvalidInput,
        // exec_error, exec_transport_error, workspace_archive_*,
        // capacity_exceeded (503), pool_error, mount_error, session_error,
        // tunnel_error: the bridge or its container failed.
        _ => ErrorKind::Backend,
    };
    let code = if code.is_empty() {
        "no code".to_string()
    } else {
        code
    };
    Error::new(
        kind,
        format!("cloudflare bridge: {what}: {status} {code}: {message}"),
    )
}

/// Percent-encode a relative path segment by segment (`/` stays).
fn encode_path(path: &str) -> String {
    const SEGMENT: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
        .remove(b'-')
        .remove(b'_')
        .remove(b'.')
        .remove(b'~');
    path.split('/')
        .map(|s| percent_encoding::utf8_percent_encode(s, SEGMENT).to_string())
        .collect::<Vec<_>>()
        .join("/")
}

/// `/workspace/a/b` → `workspace/a/b` when the path is inside the root with
/// no `..`/`.` components (the bridge's file routes take that form).
fn under_root(path: &str) -> Option<String> {
    let rest = path.strip_prefix(ROOT)?;
    if !(rest.is_empty() || rest.starts_with('/')) {
        return None;
    }
    if rest.split('/').any(|c| c == ".." || c == ".") {
        return None;
    }
    Some(path.trim_start_matches('/').to_string())
}

/// One live bridge sandbox.
#[derive(Debug)]
pub struct CloudflareSandbox {
    bridge: Bridge,
    id: String,
    workdir: String,
    owned: bool,
    data: HandleData,
}

impl CloudflareSandbox {
    /// The bridge's name for this sandbox.
    pub fn id(&self) -> &str {
        &self.id
    }

    async fn open_session(&self) -> Result<()> {
        let request = BridgeRequest::new(Method::Post, format!("/v1/sandbox/{}/session", self.id))
            .json(json!({ "id": BRIDGE_SESSION, "env": self.data.env }));
        match self.bridge.json(request).await {
            Ok(_) => Ok(()),
            // The session is still there (resume of a running sandbox).
            Err(e) if e.message().contains("session_error") && e.message().contains("exist") => {
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    async fn prepare_dirs(&self) -> Result<()> {
        let script = format!(
            "mkdir -p {pids} {workdir}",
            pids = EXEC_PID_DIR,
            workdir = shell_quote(&self.workdir)
        );
        self.bridge
            .sh(&self.id, script)
            .await?
            .check("preparing the sandbox's directories")
            .map(|_| ())
    }

    /// A fresh staging path, absolute and relative to `/`.
    fn staging_path(&self, name: &str) -> (String, String) {
        let abs = format!(
            "{ROOT}/{STAGING_DIR}/{}-{name}",
            self.bridge.transport.unique()
        );
        let rel = abs.trim_start_matches('/').to_string();
        (abs, rel)
    }

    /// Upload `content` into staging parts of at most `part_bytes`. On
    /// failure, the parts already uploaded are returned with the error so
    /// the caller can remove them.
    async fn upload_parts(
        &self,
        mut content: ByteStream,
    ) -> std::result::Result<(Vec<String>, u64), (Vec<String>, Error)> {
        let (base, _) = self.staging_path("part");
        let mut parts = Vec::new();
        let mut total = 0u64;
        let mut buffer = BytesMut::new();
        loop {
            let chunk = match content.next().await {
                Some(Ok(chunk)) => Some(chunk),
                Some(Err(e)) => return Err((parts, e)),
                None => None,
            };
            let done = chunk.is_none();
            if let Some(chunk) = chunk {
                total += chunk.len() as u64;
                buffer.extend_from_slice(&chunk);
            }
            while buffer.len() >= self.bridge.part_bytes || (done && !buffer.is_empty()) {
                let take = buffer.len().min(self.bridge.part_bytes);
                let part = buffer.split_to(take).freeze();
                let path = format!("{base}.{:05}", parts.len());
                if let Err(e) = self.put_staged(&path, part).await {
                    return Err((parts, e));
                }
                parts.push(path);
            }
            if done {
                return Ok((parts, total));
            }
        }
    }

    /// PUT into the staging dir, making it again if an agent removed it.
    async fn put_staged(&self, abs: &str, bytes: Bytes) -> Result<()> {
        let rel = abs.trim_start_matches('/');
        match self.bridge.put(&self.id, rel, bytes.clone()).await {
            Ok(()) => Ok(()),
            // The bridge's write may not make parent directories, and the
            // staging directory comes and goes (`DROP_EMPTY_STAGING`).
            Err(first) if first.kind() == ErrorKind::Backend => {
                self.bridge
                    .sh(&self.id, format!("mkdir -p {ROOT}/{STAGING_DIR}"))
                    .await?
                    .check("making the staging directory")?;
                self.bridge
                    .put(&self.id, rel, bytes)
                    .await
                    .map_err(|e| Error::new(e.kind(), format!("{e} (after {first})")))
            }
            Err(e) => Err(e),
        }
    }

    async fn remove_staged(&self, parts: &[String]) {
        if parts.is_empty() {
            return;
        }
        let list: Vec<String> = parts.iter().map(|p| shell_quote(p)).collect();
        let _ = self
            .bridge
            .sh(
                &self.id,
                format!("rm -f {}; {DROP_EMPTY_STAGING}; true", list.join(" ")),
            )
            .await;
    }

    /// Run the recipe unless this sandbox already did (or its image was
    /// built with it: the marker file is what counts).
    async fn bootstrap(&self, recipe: &BootstrapRecipe) -> Result<()> {
        let identity = recipe.identity(IDENTITY_BASE);
        let marker = format!("{BOOTSTRAP_MARKERS}/{identity}");
        let probe = self
            .bridge
            .sh(&self.id, format!("test -e {}", shell_quote(&marker)))
            .await?;
        if probe.status.success() {
            tracing::debug!(%identity, "bootstrap already in the sandbox");
            return Ok(());
        }
        tracing::info!(%identity, sandbox = %self.id, "running the bootstrap recipe in the Cloudflare sandbox");
        harness_core::bootstrap::run_recipe(self, recipe, &HostFs).await?;
        self.bridge
            .sh(
                &self.id,
                format!(
                    "mkdir -p {BOOTSTRAP_MARKERS} && touch {}",
                    shell_quote(&marker)
                ),
            )
            .await?
            .check("recording the bootstrap")?;
        Ok(())
    }
}

/// Host files of a recipe, read from this machine's disk (a Worker has
/// none: there, a recipe with host files is refused).
#[derive(Debug)]
struct HostFs;

#[cfg_attr(not(target_arch = "wasm32"), async_trait)]
#[cfg_attr(target_arch = "wasm32", async_trait(?Send))]
impl harness_core::bootstrap::HostFiles for HostFs {
    async fn open(&self, path: &str) -> Result<ByteStream> {
        host_file(path).await
    }
}

#[cfg(feature = "native")]
async fn host_file(path: &str) -> Result<ByteStream> {
    let file = tokio::fs::File::open(path).await.map_err(|e| {
        let kind = Error::from(std::io::Error::new(e.kind(), "")).kind();
        Error::new(kind, format!("opening bootstrap file {path}: {e}"))
    })?;
    Ok(Box::pin(
        tokio_util::io::ReaderStream::with_capacity(file, 1024 * 1024)
            .map(|r| r.map_err(Error::from)),
    ))
}

#[cfg(not(feature = "native"))]
async fn host_file(path: &str) -> Result<ByteStream> {
    Err(Error::unsupported(format!(
        "bootstrap file {path} is a host path, which this build (without `native`) cannot read"
    )))
}

/// A boxed future (`Send` where the runtime is multi-threaded; nothing is
/// `Send` on wasm32).
#[cfg(not(target_arch = "wasm32"))]
type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;
#[cfg(target_arch = "wasm32")]
type BoxFuture<T> = Pin<Box<dyn Future<Output = T>>>;

/// What the exec stream waits on to stop its command (abort or timeout).
type StopFuture = BoxFuture<ExitReason>;

/// The exec stream's state between polls.
struct ExecState {
    body: ByteStream,
    reader: SseReader,
    pending: std::collections::VecDeque<Result<ExecEvent>>,
    stop: Option<StopFuture>,
    killed: Option<ExitReason>,
    grace: Option<BoxFuture<()>>,
    bridge: Bridge,
    id: String,
    xid: String,
    finished: bool,
}

/// Turn the bridge's SSE answer into our exec events; `stop` (abort or
/// timeout) kills the command's process group through a second exec.
fn exec_events(
    response: BridgeResponse,
    stop: Option<StopFuture>,
    bridge: Bridge,
    id: String,
    xid: String,
) -> ExecStream {
    let state = ExecState {
        body: response.body,
        reader: SseReader::new(),
        pending: Default::default(),
        stop,
        killed: None,
        grace: None,
        bridge,
        id,
        xid,
        finished: false,
    };
    Box::pin(futures::stream::unfold(state, |mut st| async move {
        loop {
            if let Some(item) = st.pending.pop_front() {
                return Some((item, st));
            }
            if st.finished {
                return None;
            }
            // Wait for the next body chunk, the stop signal, or (once
            // killed) the grace period.
            enum Next {
                Chunk(Option<Result<Bytes>>),
                Stop(ExitReason),
                GraceOver,
            }
            let next = {
                let chunk = st.body.next();
                futures::pin_mut!(chunk);
                if let Some(stop) = st.stop.as_mut() {
                    match futures::future::select(chunk, stop).await {
                        futures::future::Either::Left((c, _)) => Next::Chunk(c),
                        futures::future::Either::Right((r, _)) => Next::Stop(r),
                    }
                } else if let Some(grace) = st.grace.as_mut() {
                    match futures::future::select(chunk, grace).await {
                        futures::future::Either::Left((c, _)) => Next::Chunk(c),
                        futures::future::Either::Right(((), _)) => Next::GraceOver,
                    }
                } else {
                    Next::Chunk(chunk.await)
                }
            };
            match next {
                Next::Stop(reason) => {
                    st.stop = None;
                    st.killed = Some(reason);
                    if let Err(e) = kill_group(&st.bridge, &st.id, &st.xid).await {
                        tracing::warn!(error = %e, "killing an exec's process group on the bridge");
                    }
                    let transport = st.bridge.transport.clone();
                    st.grace = Some(Box::pin(async move { transport.sleep(KILL_GRACE).await }));
                }
                Next::GraceOver => {
                    st.finished = true;
                    st.pending.push_back(Ok(ExecEvent::Exit(ExitStatus {
                        code: None,
                        signal: Some(9),
                        reason: st.killed.unwrap_or(ExitReason::Aborted),
                    })));
                }
                Next::Chunk(Some(Ok(bytes))) => match st.reader.push(&bytes) {
                    Ok(events) => {
                        for event in events {
                            if let Some(item) = translate(&event, st.killed) {
                                let terminal = !matches!(
                                    item,
                                    Ok(ExecEvent::Stdout(_)) | Ok(ExecEvent::Stderr(_))
                                );
                                st.pending.push_back(item);
                                if terminal {
                                    st.finished = true;
                                    break;
                                }
                            }
                        }
                    }
                    Err(e) => {
                        st.finished = true;
                        st.pending
                            .push_back(Err(Error::backend(format!("cloudflare bridge: {e}"))));
                    }
                },
                Next::Chunk(Some(Err(e))) => {
                    st.finished = true;
                    st.pending.push_back(Err(e));
                }
                Next::Chunk(None) => {
                    st.finished = true;
                    st.pending.push_back(match st.killed {
                        Some(reason) => Ok(ExecEvent::Exit(ExitStatus {
                            code: None,
                            signal: Some(9),
                            reason,
                        })),
                        None => Err(Error::backend(
                            "cloudflare bridge: the exec stream ended without an exit event",
                        )),
                    });
                }
            }
        }
    }))
}

/// One SSE event as an exec event (`None` for events we ignore).
fn translate(event: &SseEvent, killed: Option<ExitReason>) -> Option<Result<ExecEvent>> {
    let b64 = |data: &str| {
        base64::engine::general_purpose::STANDARD
            .decode(data.trim())
            .map(Bytes::from)
            .map_err(|e| {
                Error::backend(format!(
                    "cloudflare bridge: output chunk is not base64: {e}"
                ))
            })
    };
    match event.event.as_str() {
        "stdout" => Some(b64(&event.data).map(ExecEvent::Stdout)),
        "stderr" => Some(b64(&event.data).map(ExecEvent::Stderr)),
        "exit" => {
            let parsed: Value = match serde_json::from_str(&event.data) {
                Ok(v) => v,
                Err(e) => {
                    return Some(Err(Error::backend(format!(
                        "cloudflare bridge: malformed exit event {:?}: {e}",
                        event.data
                    ))))
                }
            };
            let Some(code) = parsed["exit_code"].as_i64() else {
                return Some(Err(Error::backend(format!(
                    "cloudflare bridge: exit event without exit_code: {}",
                    event.data
                ))));
            };
            let code = code as i32;
            Some(Ok(ExecEvent::Exit(match killed {
                // Killed by us: the shell reports 128+SIGKILL.
                Some(reason) => ExitStatus {
                    code: (code <= 128).then_some(code),
                    signal: (code > 128).then_some(code - 128),
                    reason,
                },
                None => ExitStatus::exited(code),
            })))
        }
        "error" => {
            let parsed: Value = serde_json::from_str(&event.data).unwrap_or(Value::Null);
            let code = parsed["code"].as_str().unwrap_or("exec_error");
            let message = parsed["error"].as_str().unwrap_or(&event.data);
            Some(Err(Error::backend(format!(
                "cloudflare bridge: exec failed: {code}: {message}"
            ))))
        }
        _ => None,
    }
}

/// Kill the process group an exec recorded under `xid` (waiting briefly for
/// the record when the command has only just started).
async fn kill_group(bridge: &Bridge, id: &str, xid: &str) -> Result<()> {
    let script = format!(
        "f={dir}/{xid}; i=0; while [ ! -s $f ] && [ $i -lt 50 ]; do sleep 0.1; i=$((i+1)); done; \
         [ -s $f ] || exit 0; p=$(cat $f); kill -KILL -$p 2>/dev/null; rm -f $f; exit 0",
        dir = EXEC_PID_DIR,
    );
    bridge.sh(id, script).await?.check("killing a command")?;
    Ok(())
}

/// The wrapper every command runs in: records its process group, enters
/// the cwd, adds the request's env, feeds stdin from a staged file, and
/// cleans up after itself. The user's argv follows as `"$@"`.
fn exec_script(
    xid: &str,
    cwd: &str,
    env: &BTreeMap<String, String>,
    stdin: Option<&str>,
) -> String {
    let mut command = String::from("env");
    for (k, v) in env {
        command.push(' ');
        command.push_str(&shell_quote(&format!("{k}={v}")));
    }
    command.push_str(" \"$@\"");
    let input = stdin.map(shell_quote).unwrap_or_else(|| "/dev/null".into());
    let cleanup = match stdin {
        Some(path) => format!(
            "rm -f {}/{xid} {}; {DROP_EMPTY_STAGING}",
            EXEC_PID_DIR,
            shell_quote(path)
        ),
        None => format!("rm -f {}/{xid}", EXEC_PID_DIR),
    };
    format!(
        "echo $$ > {pids}/{xid} 2>/dev/null || {{ mkdir -p {pids} && echo $$ > {pids}/{xid}; }}; \
         if cd {cwd}; then {command} < {input}; c=$?; else c=126; fi; {cleanup}; exit $c",
        pids = EXEC_PID_DIR,
        cwd = shell_quote(cwd),
    )
}

#[cfg_attr(not(target_arch = "wasm32"), async_trait)]
#[cfg_attr(target_arch = "wasm32", async_trait(?Send))]
impl Sandbox for CloudflareSandbox {
    fn handle(&self) -> SandboxHandle {
        SandboxHandle {
            provider: PROVIDER.into(),
            id: self.id.clone(),
            workdir: self.workdir.clone(),
            owned: self.owned,
            data: serde_json::to_value(&self.data).unwrap_or(Value::Null),
        }
    }

    fn workdir(&self) -> &str {
        &self.workdir
    }

    async fn exec(&self, request: ExecRequest) -> Result<ExecStream> {
        if request.argv.is_empty() {
            return Err(Error::invalid("exec needs a program (argv is empty)"));
        }
        let xid = self.bridge.transport.unique();
        let cwd = request
            .cwd
            .as_deref()
            .map(|c| resolve_path(&self.workdir, c))
            .unwrap_or_else(|| self.workdir.clone());
        let stdin = match request.stdin.filter(|b| !b.is_empty()) {
            Some(bytes) => {
                let (abs, _) = self.staging_path("stdin");
                match self.upload_parts(harness_core::stream::once(bytes)).await {
                    Ok((parts, _)) => {
                        let list: Vec<String> = parts.iter().map(|p| shell_quote(p)).collect();
                        let script = format!(
                            "cat {l} > {a} && rm -f {l}",
                            l = list.join(" "),
                            a = shell_quote(&abs)
                        );
                        self.bridge
                            .sh(&self.id, script)
                            .await?
                            .check("staging stdin")?;
                        Some(abs)
                    }
                    Err((parts, e)) => {
                        self.remove_staged(&parts).await;
                        return Err(e);
                    }
                }
            }
            None => None,
        };
        let script = exec_script(&xid, &cwd, &request.env, stdin.as_deref());
        let mut argv: Vec<String> = vec![
            "setsid".into(),
            "-w".into(),
            "sh".into(),
            "-c".into(),
            script,
            "harness-exec".into(),
        ];
        argv.extend(request.argv);
        let response = self.bridge.exec_raw(&self.id, argv, true).await?;
        let mut stops: Vec<StopFuture> = Vec::new();
        if let Some(abort) = request.abort {
            stops.push(Box::pin(async move {
                abort.aborted().await;
                ExitReason::Aborted
            }));
        }
        if let Some(timeout) = request.timeout {
            let transport = self.bridge.transport.clone();
            stops.push(Box::pin(async move {
                transport.sleep(timeout).await;
                ExitReason::TimedOut
            }));
        }
        let stop: Option<StopFuture> = if stops.is_empty() {
            None
        } else {
            Some(Box::pin(async move {
                futures::future::select_all(stops).await.0
            }))
        };
        Ok(exec_events(
            response,
            stop,
            self.bridge.clone(),
            self.id.clone(),
            xid,
        ))
    }

    async fn read_file(&self, path: &str) -> Result<ByteStream> {
        let path = resolve_path(&self.workdir, path);
        if let Some(rel) = under_root(&path).filter(|r| r != "workspace") {
            let response = self
                .bridge
                .call(BridgeRequest::new(
                    Method::Get,
                    format!("/v1/sandbox/{}/file/{}", self.id, encode_path(&rel)),
                ))
                .await?;
            return Ok(response.body);
        }
        // Outside the bridge's root: through `cat`.
        let script = format!(
            "test -f {p} || {{ printf 'no such file: %s\\n' {p} >&2; exit 44; }}; exec cat {p}",
            p = shell_quote(&path)
        );
        Ok(exec_stdout_stream(
            self.bridge.sh_events(&self.id, script).await?,
            path,
        ))
    }

    async fn poll_detached(
        &self,
        process: &DetachedProcess,
        offset: u64,
    ) -> Result<(DetachedStatus, ByteStream)> {
        // The status probe and the read in one exec, not two, on every poll.
        poll_detached_by_exec(self, process, offset).await
    }

    async fn write_file(&self, path: &str, content: ByteStream) -> Result<u64> {
        let path = resolve_path(&self.workdir, path);
        let (parts, total) = match self.upload_parts(content).await {
            Ok(done) => done,
            Err((parts, e)) => {
                self.remove_staged(&parts).await;
                return Err(e);
            }
        };
        // Joined and renamed into place in one exec: a reader never sees a
        // half-written file, and the parent directories are made.
        let list: Vec<String> = parts.iter().map(|p| shell_quote(p)).collect();
        let tmp = format!("{path}.harness-{}", self.bridge.transport.unique());
        let source = if list.is_empty() {
            ": >".to_string()
        } else {
            format!("cat {} >", list.join(" "))
        };
        let script = format!(
            "mkdir -p \"$(dirname {p})\" && {source} {t} && mv -f {t} {p}; c=$?; rm -f {t} {l}; {DROP_EMPTY_STAGING}; exit $c",
            p = shell_quote(&path),
            t = shell_quote(&tmp),
            l = list.join(" "),
        );
        self.bridge
            .sh(&self.id, script)
            .await?
            .check(&format!("writing {path}"))?;
        Ok(total)
    }

    async fn export_tar(&self, dir: &str) -> Result<ByteStream> {
        let dir = resolve_path(&self.workdir, dir);
        if dir.trim_end_matches('/') == ROOT {
            // The bridge's own archive of the root, without our staging.
            let response = self
                .bridge
                .call(BridgeRequest::new(
                    Method::Post,
                    format!("/v1/sandbox/{}/persist?excludes={STAGING_DIR}", self.id),
                ))
                .await?;
            return Ok(response.body);
        }
        export_tar_by_exec(self, &dir).await
    }

    async fn import_tar(&self, dir: &str, tar: ByteStream) -> Result<()> {
        let dir = resolve_path(&self.workdir, dir);
        // Scanned on the way up: a refused entry stops the upload before
        // anything is extracted, and the parts are removed. Not `hydrate`:
        // its `tar xf` runs as root with the archive's owners and modes and
        // takes one body of at most 32 MiB; core's `extract_tar_script`
        // restores the way the Docker and microVM providers do.
        let tar = tarscan::scan_stream(tar, tarscan::TarScanner::new().outward_symlinks());
        let parts = match self.upload_parts(tar).await {
            Ok((parts, _)) => parts,
            Err((parts, e)) => {
                self.remove_staged(&parts).await;
                return Err(e);
            }
        };
        let list: Vec<String> = parts.iter().map(|p| shell_quote(p)).collect();
        let input = if list.is_empty() {
            "cat /dev/null".to_string()
        } else {
            format!("cat {}", list.join(" "))
        };
        let script = format!(
            "{input} | sh -c {extract}; c=$?; rm -f {l}; {DROP_EMPTY_STAGING}; exit $c",
            extract = shell_quote(&extract_tar_script(&dir)),
            l = list.join(" "),
        );
        let out = self.bridge.sh(&self.id, script).await?;
        if out.status.success() {
            return Ok(());
        }
        Err(extract_tar_failure(&dir, &out.status, &out.stderr_str()))
    }

    async fn port_endpoint(&self, port: u16) -> Result<PortEndpoint> {
        if !self.data.ports.contains(&port) {
            return Err(Error::not_found(format!(
                "port {port} was not in the sandbox's spec (ports {:?})",
                self.data.ports
            )));
        }
        let tunnel = self
            .bridge
            .json(
                BridgeRequest::new(
                    Method::Post,
                    format!("/v1/sandbox/{}/tunnel/{port}", self.id),
                )
                .json(json!({})),
            )
            .await?;
        let url = tunnel["url"].as_str().ok_or_else(|| {
            Error::backend(format!(
                "cloudflare bridge: tunnel for port {port} has no url: {tunnel}"
            ))
        })?;
        let (host, host_port) = host_and_port(url)?;
        Ok(PortEndpoint {
            sandbox_port: port,
            host,
            port: host_port,
        })
    }

    async fn destroy(&self) -> Result<()> {
        if !self.owned {
            return Ok(());
        }
        self.bridge.destroy(&self.id).await
    }
}

/// `https://h.example.com/x` → (`h.example.com`, 443).
fn host_and_port(url: &str) -> Result<(String, u16)> {
    let (scheme, rest) = url
        .split_once("://")
        .ok_or_else(|| Error::backend(format!("tunnel url {url:?} has no scheme")))?;
    let authority = rest.split('/').next().unwrap_or(rest);
    let default = if scheme == "https" { 443 } else { 80 };
    match authority.rsplit_once(':') {
        Some((host, port)) if !host.ends_with(']') || authority.starts_with('[') => {
            let port = port
                .parse()
                .map_err(|_| Error::backend(format!("tunnel url {url:?} has a bad port")))?;
            Ok((
                host.trim_matches(|c| c == '[' || c == ']').to_string(),
                port,
            ))
        }
        _ => Ok((authority.to_string(), default)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_under_the_root_only() {
        assert_eq!(under_root("/workspace/a/b"), Some("workspace/a/b".into()));
        assert_eq!(under_root("/workspace"), Some("workspace".into()));
        assert_eq!(under_root("/workspacex/a"), None);
        assert_eq!(under_root("/workspace/../etc/passwd"), None);
        assert_eq!(under_root("/tmp/x"), None);
    }

    #[test]
    fn paths_are_percent_encoded_per_segment() {
        assert_eq!(
            encode_path("workspace/a b/é#?.txt"),
            "workspace/a%20b/%C3%A9%23%3F.txt"
        );
    }

    #[test]
    fn bridge_errors_keep_code_and_message() {
        let e = bridge_error(
            "GET /v1/sandbox/x/file/workspace/a",
            404,
            br#"{"error":"File not found: /workspace/a","code":"workspace_read_not_found"}"#,
        );
        assert_eq!(e.kind(), ErrorKind::NotFound);
        assert!(e.message().contains("workspace_read_not_found"));
        assert!(e.message().contains("File not found: /workspace/a"));
        let e = bridge_error(
            "POST /v1/sandbox",
            401,
            br#"{"error":"Unauthorized","code":"unauthorized"}"#,
        );
        assert_eq!(e.kind(), ErrorKind::Unauthorized);
        let e = bridge_error(
            "POST /x",
            503,
            br#"{"error":"full","code":"capacity_exceeded"}"#,
        );
        assert_eq!(e.kind(), ErrorKind::Backend);
        assert!(e.message().contains("capacity_exceeded"));
        let e = bridge_error("POST /x", 502, b"<html>bad gateway</html>");
        assert!(e.message().contains("bad gateway"));
    }

    #[test]
    fn tunnel_urls_give_host_and_port() {
        assert_eq!(
            host_and_port("https://a.example.com").unwrap(),
            ("a.example.com".into(), 443)
        );
        assert_eq!(
            host_and_port("http://172.17.0.2:8080/").unwrap(),
            ("172.17.0.2".into(), 8080)
        );
        assert!(host_and_port("nonsense").is_err());
    }

    #[test]
    fn slot_ids_are_stable_and_valid() {
        let a = slot_id("s1", "t1");
        assert_eq!(a, slot_id("s1", "t1"));
        assert_ne!(a, slot_id("s1", "t2"));
        assert_eq!(a.len(), 25);
        assert!(validate_id(&a).is_ok(), "{a}");
        assert!(validate_id("../x").is_err());
        assert!(validate_id("has-dash").is_err());
        assert!(validate_id("mfrggzdfmy2tqnrzgezdgnbv").is_ok());
    }

    #[test]
    fn policies_the_bridge_cannot_enforce_are_refused() {
        let mut spec = SandboxSpec::new("/workspace");
        spec.network = NetworkPolicy::DenyAll;
        let e = refuse_what_the_bridge_cannot_do(&spec).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unsupported);
        let mut spec = SandboxSpec::new("/workspace");
        spec.forwards.push(harness_core::sandbox::HostForward {
            port: 1,
            socket: "/x".into(),
        });
        let e = refuse_what_the_bridge_cannot_do(&spec).unwrap_err();
        assert!(e.message().contains("--direct-model"), "{e}");
    }
}
