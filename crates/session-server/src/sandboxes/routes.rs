//! The sandbox API's handlers. Every request is checked whole before
//! anything is made: a bad one is a 4xx and leaves nothing behind.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use base64::Engine as _;
use futures::StreamExt;
use harness_core::sandbox::{
    collect_exec, resolve_path, ExecRequest, ExitReason, HostForward, NetworkPolicy, Sandbox,
    SandboxSpec, EGRESS_PROXY_PORT, MODEL_BROKER_PORT,
};
use harness_core::stream::AbortSignal;
use harness_core::{ErrorKind, SessionId};
use serde::Deserialize;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use super::egress::{ApiNetworkPolicy, Egress, Listen, RequestTransformation, Rules};
use super::process::{Event, Processes};
use super::{
    record_path, CreateRequest, EgressRecord, Live, ProviderEntry, Record, SandboxRegistry, Slots,
};
use crate::auth::{authorize, bearer, GrantRole, TokenGrant};
use crate::error::ApiError;

/// How long an identity's first create may wait for its hook before the
/// next create of that identity takes over.
const BOOTSTRAP_LEASE: Duration = Duration::from_secs(20 * 60);
/// The default working directory of a container sandbox.
const DEFAULT_WORKDIR: &str = "/workspace";
const MAX_PORTS: usize = 16;

pub(crate) struct Inner {
    providers: BTreeMap<String, ProviderEntry>,
    state_dir: std::path::PathBuf,
    snapshots_dir: std::path::PathBuf,
    tokens: Vec<TokenGrant>,
    insecure_no_auth: bool,
    slots: tokio::sync::Mutex<Slots>,
    pub(crate) processes: Arc<Processes>,
    identities: std::sync::Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    pub(crate) http: reqwest::Client,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SandboxApi")
            .field("providers", &self.providers.keys().collect::<Vec<_>>())
            .field("state_dir", &self.state_dir)
            .finish()
    }
}

type Shared = State<Arc<Inner>>;
type Params = Query<HashMap<String, String>>;

pub(crate) fn router(inner: Arc<Inner>) -> Router {
    Router::new()
        .route("/v1/sandboxes", post(create).get(list))
        .route("/v1/sandboxes/{name}", get(info).delete(destroy))
        .route("/v1/sandboxes/{name}/resume", post(resume))
        .route("/v1/sandboxes/{name}/bootstrap", post(bootstrap))
        .route("/v1/sandboxes/{name}/exec", post(exec))
        .route("/v1/sandboxes/{name}/processes/{process}/kill", post(kill))
        .route("/v1/sandboxes/{name}/file", get(read_file).put(write_file))
        .route(
            "/v1/sandboxes/{name}/network-policy",
            axum::routing::put(set_policy),
        )
        .route(
            "/v1/sandboxes/{name}/request-transformations",
            axum::routing::put(set_transformations).post(add_transformations),
        )
        .route("/v1/sandboxes/{name}/ports/{port}", get(port_url))
        .route("/v1/sandboxes/{name}/replace", post(replace))
        .route("/v1/sandboxes/{name}/stop", post(stop))
        .route(
            "/v1/sandbox-port/{name}/{port}/{secret}",
            axum::routing::any(super::ports::proxy_root),
        )
        .route(
            "/v1/sandbox-port/{name}/{port}/{secret}/",
            axum::routing::any(super::ports::proxy_root),
        )
        .route(
            "/v1/sandbox-port/{name}/{port}/{secret}/{*rest}",
            axum::routing::any(super::ports::proxy),
        )
        .with_state(inner)
}

impl Inner {
    pub(crate) fn new(registry: SandboxRegistry) -> Self {
        Self {
            providers: registry.providers,
            snapshots_dir: registry
                .snapshots_dir
                .unwrap_or_else(|| registry.state_dir.join("snapshots")),
            state_dir: registry.state_dir,
            tokens: registry.tokens,
            insecure_no_auth: registry.insecure_no_auth,
            slots: tokio::sync::Mutex::new(HashMap::new()),
            processes: Arc::new(Processes::default()),
            identities: std::sync::Mutex::new(HashMap::new()),
            http: reqwest::Client::builder()
                .no_proxy()
                .redirect(reqwest::redirect::Policy::none())
                .build()
                .unwrap_or_default(),
        }
    }

    /// Load the records of earlier runs; their proxies start again.
    pub(crate) async fn load(self: &Arc<Self>) {
        let Ok(entries) = std::fs::read_dir(self.state_dir.join("records")) else {
            return;
        };
        let mut slots = self.slots.lock().await;
        for entry in entries.flatten() {
            let Ok(raw) = std::fs::read(entry.path()) else {
                continue;
            };
            let Ok(record) = serde_json::from_slice::<Record>(&raw) else {
                tracing::warn!("unreadable sandbox record {}", entry.path().display());
                continue;
            };
            let listen = match &record.egress {
                EgressRecord::Unix { path } => Listen::Unix(path.into()),
                EgressRecord::Tcp { port } => Listen::Tcp(*port),
            };
            let rules = match rules_for(&record.policy, &record.transformations) {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!("sandbox {}: {e}", record.name);
                    continue;
                }
            };
            let egress = match Egress::start(listen, rules).await {
                Ok(e) => e,
                Err(e) => {
                    tracing::warn!("sandbox {}: its proxy cannot start again: {e}", record.name);
                    continue;
                }
            };
            let name = record.name.clone();
            slots.insert(
                name,
                Arc::new(tokio::sync::Mutex::new(Some(Live {
                    record,
                    sandbox: None,
                    egress,
                    bootstrap: None,
                }))),
            );
        }
    }

    fn auth(
        &self,
        headers: &HeaderMap,
        params: &HashMap<String, String>,
        name: Option<&str>,
    ) -> Result<(), ApiError> {
        let token = bearer(headers, params.get("access_token").map(String::as_str));
        let session = name.and_then(|n| SessionId::parse(n).ok());
        let allowed: &[GrantRole] = if session.is_some() {
            &[GrantRole::Host, GrantRole::Client]
        } else {
            &[GrantRole::Host]
        };
        authorize(
            &self.tokens,
            self.insecure_no_auth,
            token.as_deref(),
            session.as_ref(),
            allowed,
        )
        .map(|_| ())
    }

    fn save(&self, record: &Record) -> Result<(), ApiError> {
        let path = record_path(&self.state_dir, &record.name);
        let tmp = path.with_extension("json.tmp");
        std::fs::write(&tmp, serde_json::to_vec_pretty(record).map_err(internal)?)
            .map_err(internal)?;
        std::fs::rename(&tmp, &path).map_err(internal)?;
        Ok(())
    }

    fn identity_lock(&self, key: &str) -> Arc<tokio::sync::Mutex<()>> {
        self.identities
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(key.to_string())
            .or_default()
            .clone()
    }

    fn snapshot_path(&self, key: &str) -> std::path::PathBuf {
        self.snapshots_dir.join(format!("{key}.json"))
    }

    /// The slot of `name` (404 when there is none).
    pub(crate) async fn slot(
        &self,
        name: &str,
    ) -> Result<Arc<tokio::sync::Mutex<Option<Live>>>, ApiError> {
        self.slots
            .lock()
            .await
            .get(name)
            .cloned()
            .ok_or_else(|| not_found(name))
    }

    /// The live sandbox of `name`, resumed if need be (a stopped one
    /// starts again), and its record.
    pub(crate) async fn sandbox(&self, name: &str) -> Result<(Arc<dyn Sandbox>, Record), ApiError> {
        let slot = self.slot(name).await?;
        let mut guard = slot.lock().await;
        let live = guard.as_mut().ok_or_else(|| not_found(name))?;
        self.ensure_live(live).await?;
        let sandbox = live.sandbox.clone().expect("ensured");
        Ok((sandbox, live.record.clone()))
    }

    async fn ensure_live(&self, live: &mut Live) -> Result<(), ApiError> {
        if live.sandbox.is_some() {
            return Ok(());
        }
        let entry = self.providers.get(&live.record.provider).ok_or_else(|| {
            ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable",
                format!(
                    "sandbox {} is on provider {:?}, which this server does not offer now",
                    live.record.name, live.record.provider
                ),
            )
        })?;
        let sandbox: Arc<dyn Sandbox> =
            Arc::from(entry.provider.resume(&live.record.handle).await?);
        // A route taken away at run time may be back after a stop and a
        // start (Docker's firewall lives in the container's namespace).
        if !live.record.routed && entry.provider.changes_network_at_run_time() {
            sandbox.set_network(&NetworkPolicy::DenyAll).await?;
        }
        live.sandbox = Some(sandbox);
        if live.record.stopped {
            live.record.stopped = false;
            self.save(&live.record)?;
        }
        Ok(())
    }
}

fn internal(e: impl std::fmt::Display) -> ApiError {
    ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string())
}

fn not_found(name: &str) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "not_found",
        format!("no sandbox named {name:?} (never created, or destroyed)"),
    )
}

fn bad(code: &str, message: impl Into<String>) -> ApiError {
    ApiError::new(StatusCode::BAD_REQUEST, code, message)
}

fn rules_for(
    policy: &ApiNetworkPolicy,
    transformations: &[RequestTransformation],
) -> harness_core::Result<Rules> {
    Ok(Rules {
        rule: policy.compile()?,
        transformations: transformations.to_vec(),
    })
}

/// Parse a JSON body, answering 400 with serde's words on a bad one.
fn parse<T: serde::de::DeserializeOwned>(body: &Bytes) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| bad("invalid", format!("bad request body: {e}")))
}

/// Every check a create makes before anything exists.
fn validate(inner: &Inner, req: &CreateRequest) -> Result<(), ApiError> {
    if !inner.providers.contains_key(&req.provider) {
        return Err(bad(
            "unknown_provider",
            format!(
                "unknown provider {:?}: this server offers {}",
                req.provider,
                inner
                    .providers
                    .keys()
                    .map(|k| format!("{k:?}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        ));
    }
    if let Some(id) = &req.session_id {
        SessionId::parse(id.clone())
            .map_err(|e| bad("invalid", e.message().replace("session id", "sessionId")))?;
    }
    if let Some(identity) = &req.identity {
        if identity.is_empty() || identity.len() > 256 || identity.chars().any(char::is_control) {
            return Err(bad(
                "invalid",
                "identity must be 1-256 printable characters",
            ));
        }
    }
    if let Some(image) = &req.image {
        if image.is_empty()
            || image.len() > 256
            || image.chars().any(|c| c.is_whitespace() || c.is_control())
        {
            return Err(bad(
                "invalid",
                format!("image {image:?} is not an image reference"),
            ));
        }
    }
    if let Some(workdir) = &req.workdir {
        if !workdir.starts_with('/')
            || workdir.contains('\0')
            || workdir.split('/').any(|c| c == "..")
        {
            return Err(bad(
                "invalid",
                format!("workdir {workdir:?} must be an absolute path without '..'"),
            ));
        }
    }
    for key in req.env.keys() {
        let ok = !key.is_empty()
            && !key.starts_with(|c: char| c.is_ascii_digit())
            && key.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
        if !ok {
            return Err(bad(
                "invalid",
                format!("env name {key:?}: use letters, digits and '_'"),
            ));
        }
    }
    if req.env.values().any(|v| v.contains('\0')) {
        return Err(bad("invalid", "env values cannot contain NUL"));
    }
    if let Some(cpus) = req.cpus {
        if !(cpus.is_finite() && cpus > 0.0 && cpus <= 256.0) {
            return Err(bad(
                "invalid",
                format!("cpus {cpus} must be more than 0 and at most 256"),
            ));
        }
    }
    if let Some(memory) = req.memory {
        if !(6..=1 << 22).contains(&memory) {
            return Err(bad(
                "invalid",
                format!("memory {memory} MiB must be between 6 MiB and 4 TiB"),
            ));
        }
    }
    if req.ports.len() > MAX_PORTS {
        return Err(bad("invalid", format!("at most {MAX_PORTS} ports")));
    }
    let mut seen = std::collections::BTreeSet::new();
    for &port in &req.ports {
        if port == 0 || port == MODEL_BROKER_PORT || port == EGRESS_PROXY_PORT {
            return Err(bad(
                "invalid",
                format!("port {port} cannot be exposed (0 and {MODEL_BROKER_PORT}/{EGRESS_PROXY_PORT}, the server's own, are reserved)"),
            ));
        }
        if !seen.insert(port) {
            return Err(bad("invalid", format!("port {port} is listed twice")));
        }
    }
    req.network_policy
        .compile()
        .map_err(|e| bad("invalid_policy", e.message().to_string()))?;
    for (i, t) in req.request_transformations.iter().enumerate() {
        t.check(i)
            .map_err(|e| bad("invalid", e.message().to_string()))?;
    }
    if req.bootstrap_pre_commands.iter().any(|c| c.contains('\0')) {
        return Err(bad("invalid", "bootstrapPreCommands cannot contain NUL"));
    }
    Ok(())
}

/// The key of an identity's snapshot: everything that makes its files.
fn snapshot_key(req: &CreateRequest, identity: &str) -> String {
    let mut h = Sha256::new();
    for part in [
        "harness-sandbox-api-v1",
        &req.provider,
        req.image.as_deref().unwrap_or(""),
        identity,
    ] {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part.as_bytes());
    }
    for cmd in &req.bootstrap_pre_commands {
        h.update((cmd.len() as u64).to_le_bytes());
        h.update(cmd.as_bytes());
    }
    format!("aisdk-{}", &hex::encode(h.finalize())[..20])
}

#[derive(Debug, Deserialize, serde::Serialize)]
struct SnapshotRecord {
    image: String,
}

/// Make the provider sandbox for `req` (the name's proxy already serving
/// at `listen`); on any failure nothing of it is left.
async fn make_sandbox(
    inner: &Inner,
    name: &str,
    req: &CreateRequest,
    image: Option<String>,
    listen: &Listen,
) -> Result<(Arc<dyn Sandbox>, bool), ApiError> {
    let entry = &inner.providers[&req.provider];
    let provider = &entry.provider;
    let routed = if provider.changes_network_at_run_time() {
        true
    } else {
        req.network_policy.needs_route()
    };
    let network = if routed {
        NetworkPolicy::AllowAll
    } else {
        NetworkPolicy::DenyAll
    };
    let proxy = match listen {
        Listen::Tcp(port) => format!("http://127.0.0.1:{port}"),
        Listen::Unix(_) => format!("http://127.0.0.1:{EGRESS_PROXY_PORT}"),
    };
    let mut env = BTreeMap::new();
    // Claude Code refuses --dangerously-skip-permissions as root unless it
    // is told it runs in a sandbox; commands in containers run as root.
    env.insert("IS_SANDBOX".to_string(), "1".to_string());
    for key in ["HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"] {
        env.insert(key.to_string(), proxy.clone());
    }
    for key in ["NO_PROXY", "no_proxy"] {
        env.insert(key.to_string(), "localhost,127.0.0.1,::1".to_string());
    }
    env.extend(entry.env.clone());
    env.extend(req.env.clone());
    let mut spec = SandboxSpec::new(
        req.workdir
            .clone()
            .unwrap_or_else(|| DEFAULT_WORKDIR.into()),
    );
    spec.image = image.or_else(|| req.image.clone());
    spec.env = env;
    spec.cpus = req.cpus;
    spec.memory_mb = req.memory;
    spec.ports = req.ports.clone();
    spec.network = network;
    spec.session_id = Some(name.to_string());
    spec.labels.insert("harness.api".into(), "sandboxes".into());
    // Which server's records name it (a leftover can be traced, or swept).
    spec.labels.insert(
        "harness.api.state".into(),
        inner.state_dir.display().to_string(),
    );
    if let Listen::Unix(path) = listen {
        spec.forwards.push(HostForward {
            port: EGRESS_PROXY_PORT,
            socket: path.display().to_string(),
        });
    }
    let sandbox: Arc<dyn Sandbox> = Arc::from(provider.create(&spec).await?);
    if provider.changes_network_at_run_time() && !req.network_policy.needs_route() {
        if let Err(e) = sandbox.set_network(&NetworkPolicy::DenyAll).await {
            let _ = sandbox.destroy().await;
            return Err(e.into());
        }
        return Ok((sandbox, false));
    }
    Ok((sandbox, routed))
}

/// Run `bootstrapPreCommands` in order; the first failure is the error.
async fn run_pre_commands(sandbox: &dyn Sandbox, commands: &[String]) -> Result<(), ApiError> {
    for cmd in commands {
        let request = ExecRequest::new(["bash", "-c", cmd.as_str()]).cwd("/");
        let out = collect_exec(sandbox.exec(request).await?).await?;
        if !out.status.success() {
            return Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "bootstrap_failed",
                format!(
                    "bootstrapPreCommands {cmd:?} failed ({:?}): {}",
                    out.status,
                    out.stderr_str().trim()
                ),
            ));
        }
    }
    Ok(())
}

fn listen_for(inner: &Inner, req: &CreateRequest) -> Listen {
    let provider = &inner.providers[&req.provider].provider;
    let routed = provider.changes_network_at_run_time() || req.network_policy.needs_route();
    let network = if routed {
        NetworkPolicy::AllowAll
    } else {
        NetworkPolicy::DenyAll
    };
    if provider.shares_host_network(&network) {
        Listen::Tcp(0)
    } else {
        // Short: a Unix socket path has ~108 bytes.
        let id = &uuid::Uuid::new_v4().simple().to_string()[..12];
        Listen::Unix(inner.state_dir.join("sock").join(id).join("egress.sock"))
    }
}

fn egress_record(listen: &Listen) -> EgressRecord {
    match listen {
        Listen::Unix(path) => EgressRecord::Unix {
            path: path.display().to_string(),
        },
        Listen::Tcp(port) => EgressRecord::Tcp { port: *port },
    }
}

fn info_json(record: &Record, bootstrap: Option<&str>, processes: usize) -> Value {
    let mut v = json!({
        "name": record.name,
        "provider": record.provider,
        "id": record.handle.id,
        "workdir": record.handle.workdir,
        "ports": record.request.ports,
        "networkPolicy": record.policy,
        "requestTransformations": record.transformations.len(),
        "stopped": record.stopped,
        "generation": record.generation,
        "processes": processes,
    });
    if let Some(b) = bootstrap {
        v["bootstrap"] = json!(b);
    }
    v
}

async fn create(
    State(inner): Shared,
    Query(params): Params,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    match create_inner(&inner, &params, &headers, &body).await {
        Ok(v) => (StatusCode::CREATED, Json(v)).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn create_inner(
    inner: &Arc<Inner>,
    params: &HashMap<String, String>,
    headers: &HeaderMap,
    body: &Bytes,
) -> Result<Value, ApiError> {
    // Who may call comes first: a stranger learns nothing of the rules.
    let peek: Option<String> = serde_json::from_slice::<Value>(body).ok().and_then(|v| {
        v.get("sessionId")
            .and_then(Value::as_str)
            .map(str::to_string)
    });
    inner.auth(headers, params, peek.as_deref())?;
    let req: CreateRequest = parse(body)?;
    validate(inner, &req)?;
    let name = req
        .session_id
        .clone()
        .unwrap_or_else(|| format!("sbx-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]));
    // Claim the name: a second create of it is a conflict, not a second sandbox.
    let slot = {
        let mut slots = inner.slots.lock().await;
        if slots.contains_key(&name) {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                "sandbox_exists",
                format!("a sandbox named {name:?} exists: resume it, or destroy it first"),
            ));
        }
        let slot = Arc::new(tokio::sync::Mutex::new(None));
        slots.insert(name.clone(), slot.clone());
        slot
    };
    let mut guard = slot.lock().await;
    let made = create_named(inner, &name, req).await;
    match made {
        Ok((live, bootstrap)) => {
            let v = info_json(&live.record, Some(bootstrap), 0);
            *guard = Some(live);
            Ok(v)
        }
        Err(e) => {
            drop(guard);
            inner.slots.lock().await.remove(&name);
            Err(e)
        }
    }
}

async fn create_named(
    inner: &Arc<Inner>,
    name: &str,
    req: CreateRequest,
) -> Result<(Live, &'static str), ApiError> {
    // One first create per identity at a time: a second waits here until
    // the first has its snapshot (or gave up), then starts from it.
    let mut lease = None;
    let mut snapshot_image = None;
    let key = req.identity.as_ref().map(|i| snapshot_key(&req, i));
    if let Some(key) = &key {
        let lock = inner.identity_lock(key).lock_owned().await;
        if let Ok(raw) = std::fs::read(inner.snapshot_path(key)) {
            if let Ok(s) = serde_json::from_slice::<SnapshotRecord>(&raw) {
                snapshot_image = Some(s.image);
            }
        }
        lease = Some(lock);
    }
    let listen = listen_for(inner, &req);
    let rules = rules_for(&req.network_policy, &req.request_transformations)?;
    let egress = Egress::start(listen, rules).await.map_err(internal)?;
    let listen = egress.listen.clone();
    let mut from_snapshot = snapshot_image.is_some();
    let made = match make_sandbox(inner, name, &req, snapshot_image.clone(), &listen).await {
        Err(e) if from_snapshot && e.status == StatusCode::NOT_FOUND => {
            // The snapshot's image is gone (pruned): bootstrap again.
            if let Some(key) = &key {
                let _ = std::fs::remove_file(inner.snapshot_path(key));
            }
            from_snapshot = false;
            make_sandbox(inner, name, &req, None, &listen).await
        }
        other => other,
    };
    let (sandbox, routed) = made?;
    if !from_snapshot {
        if let Err(e) = run_pre_commands(sandbox.as_ref(), &req.bootstrap_pre_commands).await {
            let _ = sandbox.destroy().await;
            return Err(e);
        }
    }
    let bootstrap = match (&key, from_snapshot) {
        (None, _) => "none",
        (Some(_), true) => "snapshot",
        (Some(_), false) => "required",
    };
    if bootstrap != "required" {
        lease = None;
    }
    let record = Record {
        name: name.to_string(),
        provider: req.provider.clone(),
        handle: sandbox.handle(),
        port_secret: uuid::Uuid::new_v4().simple().to_string(),
        policy: req.network_policy.clone(),
        transformations: req.request_transformations.clone(),
        routed,
        snapshot_key: key.clone(),
        egress: egress_record(&listen),
        stopped: false,
        generation: 1,
        request: req,
    };
    if let Err(e) = inner.save(&record) {
        let _ = sandbox.destroy().await;
        return Err(e);
    }
    if lease.is_some() {
        // A client that never reports back must not hold the identity
        // for ever: the next create of it takes over after the lease.
        let inner = inner.clone();
        let name = name.to_string();
        tokio::spawn(async move {
            tokio::time::sleep(BOOTSTRAP_LEASE).await;
            if let Ok(slot) = inner.slot(&name).await {
                if let Some(live) = slot.lock().await.as_mut() {
                    if live.bootstrap.take().is_some() {
                        tracing::warn!(sandbox = %name, "the first-create hook never reported: its identity is free again");
                    }
                }
            }
        });
    }
    Ok((
        Live {
            record,
            sandbox: Some(sandbox),
            egress,
            bootstrap: lease,
        },
        bootstrap,
    ))
}

async fn list(State(inner): Shared, Query(params): Params, headers: HeaderMap) -> Response {
    if let Err(e) = inner.auth(&headers, &params, None) {
        return e.into_response();
    }
    let slots: Vec<_> = inner.slots.lock().await.values().cloned().collect();
    let mut out = Vec::new();
    for slot in slots {
        if let Some(live) = slot.lock().await.as_ref() {
            out.push(info_json(
                &live.record,
                None,
                inner.processes.count(&live.record.name),
            ));
        }
    }
    Json(json!({ "sandboxes": out })).into_response()
}

/// Authorize a request on `name`, then give its slot.
async fn named(
    inner: &Inner,
    name: &str,
    params: &HashMap<String, String>,
    headers: &HeaderMap,
) -> Result<Arc<tokio::sync::Mutex<Option<Live>>>, ApiError> {
    inner.auth(headers, params, Some(name))?;
    inner.slot(name).await
}

async fn info(
    State(inner): Shared,
    Path(name): Path<String>,
    Query(params): Params,
    headers: HeaderMap,
) -> Result<Json<Value>, ApiError> {
    let slot = named(&inner, &name, &params, &headers).await?;
    let guard = slot.lock().await;
    let live = guard.as_ref().ok_or_else(|| not_found(&name))?;
    Ok(Json(info_json(
        &live.record,
        None,
        inner.processes.count(&name),
    )))
}

async fn resume(
    State(inner): Shared,
    Path(name): Path<String>,
    Query(params): Params,
    headers: HeaderMap,
) -> Result<Json<Value>, ApiError> {
    let slot = named(&inner, &name, &params, &headers).await?;
    let mut guard = slot.lock().await;
    let live = guard.as_mut().ok_or_else(|| not_found(&name))?;
    // A fresh reattach: the provider checks the sandbox still exists
    // (and starts a stopped one).
    live.sandbox = None;
    inner.ensure_live(live).await?;
    Ok(Json(info_json(
        &live.record,
        None,
        inner.processes.count(&name),
    )))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct BootstrapReport {
    ok: bool,
}

async fn bootstrap(
    State(inner): Shared,
    Path(name): Path<String>,
    Query(params): Params,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let slot = named(&inner, &name, &params, &headers).await?;
    let report: BootstrapReport = parse(&body)?;
    let mut guard = slot.lock().await;
    let live = guard.as_mut().ok_or_else(|| not_found(&name))?;
    let Some(lease) = live.bootstrap.take() else {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "no_bootstrap",
            format!("sandbox {name:?} is not waiting for a first-create hook"),
        ));
    };
    let key = live.record.snapshot_key.clone().expect("a lease has a key");
    let mut image = None;
    if report.ok {
        inner.ensure_live(live).await?;
        let sandbox = live.sandbox.clone().expect("ensured");
        match sandbox.snapshot_image(&key).await {
            Ok(reference) => {
                let raw = serde_json::to_vec(&SnapshotRecord {
                    image: reference.clone(),
                })
                .map_err(internal)?;
                std::fs::write(inner.snapshot_path(&key), raw).map_err(internal)?;
                image = Some(reference);
            }
            // No snapshot on this provider: the next create of the
            // identity runs the hook again (the AI SDK's rule for
            // providers without snapshots).
            Err(e) if e.kind() == ErrorKind::Unsupported => {}
            Err(e) => return Err(e.into()),
        }
    }
    drop(lease);
    Ok(Json(json!({ "snapshot": image })))
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ExecBody {
    #[serde(default)]
    command: Option<String>,
    #[serde(default)]
    argv: Option<Vec<String>>,
    #[serde(default)]
    cwd: Option<String>,
    #[serde(default)]
    env: BTreeMap<String, String>,
    #[serde(default)]
    timeout_ms: Option<u64>,
}

fn sse(event: &str, data: &str) -> Bytes {
    Bytes::from(format!("event: {event}\ndata: {data}\n\n"))
}

async fn exec(
    State(inner): Shared,
    Path(name): Path<String>,
    Query(params): Params,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let result = async {
        inner.auth(&headers, &params, Some(&name))?;
        let body: ExecBody = parse(&body)?;
        let argv = match (body.command, body.argv) {
            (Some(cmd), None) => vec!["bash".to_string(), "-c".to_string(), cmd],
            (None, Some(argv)) if !argv.is_empty() => argv,
            _ => {
                return Err(bad(
                    "invalid",
                    "give exactly one of command (a bash script) and argv",
                ))
            }
        };
        let (sandbox, _) = inner.sandbox(&name).await?;
        let abort = AbortSignal::new();
        let mut request = ExecRequest::new(argv).abort(abort.clone());
        request.env = body.env;
        if let Some(cwd) = body.cwd {
            request.cwd = Some(resolve_path(sandbox.workdir(), &cwd));
        }
        if let Some(ms) = body.timeout_ms {
            request.timeout = Some(Duration::from_millis(ms));
        }
        let stream = sandbox.exec(request).await?;
        let (id, rx) = inner.processes.start(&name, abort, stream);
        Ok::<_, ApiError>((id, rx))
    }
    .await;
    let (id, rx) = match result {
        Ok(x) => x,
        Err(e) => return e.into_response(),
    };
    let b64 = base64::engine::general_purpose::STANDARD;
    let events = tokio_stream_from(rx).map(move |event| {
        let bytes = match event {
            Event::Stdout(b) => sse("stdout", &b64.encode(&b)),
            Event::Stderr(b) => sse("stderr", &b64.encode(&b)),
            Event::Exit(status) => {
                let code = status
                    .code
                    .unwrap_or_else(|| 128 + status.signal.unwrap_or(9));
                let reason = match status.reason {
                    ExitReason::Exited => "exited",
                    ExitReason::Aborted => "killed",
                    ExitReason::TimedOut => "timed_out",
                };
                sse(
                    "exit",
                    &json!({"exit_code": code, "signal": status.signal, "reason": reason})
                        .to_string(),
                )
            }
            Event::Error(e) => sse(
                "error",
                &json!({"error": e.message(), "code": e.kind().as_str()}).to_string(),
            ),
        };
        Ok::<_, std::convert::Infallible>(bytes)
    });
    let mut response = Response::new(Body::from_stream(events));
    let h = response.headers_mut();
    h.insert(
        "content-type",
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert("cache-control", HeaderValue::from_static("no-cache"));
    if let Ok(v) = HeaderValue::from_str(&id) {
        h.insert("x-harness-process", v);
    }
    response
}

fn tokio_stream_from<T: Send + 'static>(
    mut rx: tokio::sync::mpsc::UnboundedReceiver<T>,
) -> impl futures::Stream<Item = T> + Send + 'static {
    futures::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

async fn kill(
    State(inner): Shared,
    Path((name, process)): Path<(String, String)>,
    Query(params): Params,
    headers: HeaderMap,
) -> Response {
    if let Err(e) = inner.auth(&headers, &params, Some(&name)) {
        return e.into_response();
    }
    if inner.processes.kill(&name, &process) {
        StatusCode::NO_CONTENT.into_response()
    } else {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("sandbox {name:?} runs no process {process:?} (it may have exited)"),
        )
        .into_response()
    }
}

fn file_path(params: &HashMap<String, String>, workdir: &str) -> Result<String, ApiError> {
    let path = params
        .get("path")
        .filter(|p| !p.is_empty() && !p.contains('\0'))
        .ok_or_else(|| bad("invalid", "give the file as ?path=…"))?;
    Ok(resolve_path(workdir, path))
}

async fn read_file(
    State(inner): Shared,
    Path(name): Path<String>,
    Query(params): Params,
    headers: HeaderMap,
) -> Response {
    let result = async {
        inner.auth(&headers, &params, Some(&name))?;
        let (sandbox, _) = inner.sandbox(&name).await?;
        let path = file_path(&params, sandbox.workdir())?;
        let stream = match sandbox.read_file(&path).await {
            Ok(s) => s,
            Err(e) if e.kind() == ErrorKind::NotFound => {
                return Err(ApiError::new(
                    StatusCode::NOT_FOUND,
                    "no_such_file",
                    format!("no file {path}"),
                ))
            }
            Err(e) => return Err(e.into()),
        };
        // A missing file some providers only report at the first read.
        let stream = match harness_core::sandbox::first_error_now(stream).await {
            Ok(s) => s,
            Err(e) if e.kind() == ErrorKind::NotFound => {
                return Err(ApiError::new(
                    StatusCode::NOT_FOUND,
                    "no_such_file",
                    format!("no file {path}"),
                ))
            }
            Err(e) => return Err(e.into()),
        };
        Ok::<_, ApiError>(stream)
    }
    .await;
    match result {
        Ok(stream) => {
            // Gathered and read ahead like a written body: a provider's
            // pieces (a container archive's are small) would each be an
            // HTTP chunk, and a client pays per chunk.
            let body =
                Body::from_stream(coalesce(stream).map(|r| r.map_err(std::io::Error::other)));
            ([("content-type", "application/octet-stream")], body).into_response()
        }
        Err(e) => e.into_response(),
    }
}

async fn write_file(
    State(inner): Shared,
    Path(name): Path<String>,
    Query(params): Params,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<Value>, ApiError> {
    inner.auth(&headers, &params, Some(&name))?;
    let (sandbox, _) = inner.sandbox(&name).await?;
    let path = file_path(&params, sandbox.workdir())?;
    let stream = coalesce(
        body.into_data_stream()
            .map(|r| r.map_err(|e| harness_core::Error::backend(format!("request body: {e}")))),
    );
    let written = sandbox.write_file(&path, stream).await?;
    Ok(Json(json!({ "path": path, "bytes": written })))
}

/// The size [`coalesce`] gathers a request body into.
const WRITE_CHUNK: usize = 1 << 20;
/// How many gathered chunks are read ahead of the provider's writes.
const WRITE_AHEAD: usize = 4;

/// `body` in chunks of about [`WRITE_CHUNK`], read ahead of its consumer:
/// an HTTP body arrives in the socket's pieces (a few KiB to 64 KiB) and a
/// provider pays per chunk (a write into a container's stdin, a syscall),
/// so a file is written in 1 MiB steps whatever the client's framing, and
/// the next steps arrive while one is written. A file read goes out the
/// same way.
fn coalesce(
    body: impl futures::Stream<Item = harness_core::Result<Bytes>> + Send + 'static,
) -> harness_core::stream::ByteStream {
    let (tx, mut rx) = tokio::sync::mpsc::channel::<harness_core::Result<Bytes>>(WRITE_AHEAD);
    tokio::spawn(async move {
        let mut body = Box::pin(body);
        let mut buf = bytes::BytesMut::new();
        loop {
            let item = match body.next().await {
                Some(Ok(chunk)) if buf.is_empty() && chunk.len() >= WRITE_CHUNK => Ok(chunk),
                Some(Ok(chunk)) => {
                    buf.extend_from_slice(&chunk);
                    if buf.len() < WRITE_CHUNK {
                        continue;
                    }
                    Ok(buf.split().freeze())
                }
                Some(Err(e)) => Err(e),
                None => {
                    if !buf.is_empty() {
                        let _ = tx.send(Ok(buf.split().freeze())).await;
                    }
                    return;
                }
            };
            let last = item.is_err();
            // The consumer went away (the write failed): stop reading.
            if tx.send(item).await.is_err() || last {
                return;
            }
        }
    });
    Box::pin(futures::stream::poll_fn(move |cx| rx.poll_recv(cx)))
}

async fn set_policy(
    State(inner): Shared,
    Path(name): Path<String>,
    Query(params): Params,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let slot = named(&inner, &name, &params, &headers).await?;
    let policy: ApiNetworkPolicy = parse(&body)?;
    let rule = policy
        .compile()
        .map_err(|e| bad("invalid_policy", e.message().to_string()))?;
    let mut guard = slot.lock().await;
    let live = guard.as_mut().ok_or_else(|| not_found(&name))?;
    let provider = inner
        .providers
        .get(&live.record.provider)
        .map(|p| p.provider.clone());
    let want_route = policy.needs_route();
    if want_route != live.record.routed {
        let changes = provider
            .as_ref()
            .is_some_and(|p| p.changes_network_at_run_time());
        if !changes {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                "unsupported",
                format!(
                    "provider {:?} fixes whether a sandbox has a route out when it is made: \
                     between deny-all and custom this sandbox can change, to or from allow-all \
                     it cannot (create it with the policy it needs)",
                    live.record.provider
                ),
            ));
        }
        inner.ensure_live(live).await?;
        let sandbox = live.sandbox.clone().expect("ensured");
        let network = if want_route {
            NetworkPolicy::AllowAll
        } else {
            NetworkPolicy::DenyAll
        };
        sandbox.set_network(&network).await?;
        live.record.routed = want_route;
    }
    live.egress.set(|r| r.rule = rule);
    live.record.policy = policy;
    inner.save(&live.record)?;
    Ok(Json(info_json(
        &live.record,
        None,
        inner.processes.count(&name),
    )))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Transformations {
    transformations: Vec<RequestTransformation>,
}

async fn set_transformations(
    State(inner): Shared,
    Path(name): Path<String>,
    Query(params): Params,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    change_transformations(inner, name, params, headers, body, false).await
}

async fn add_transformations(
    State(inner): Shared,
    Path(name): Path<String>,
    Query(params): Params,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    change_transformations(inner, name, params, headers, body, true).await
}

async fn change_transformations(
    inner: Arc<Inner>,
    name: String,
    params: HashMap<String, String>,
    headers: HeaderMap,
    body: Bytes,
    add: bool,
) -> Result<Json<Value>, ApiError> {
    let slot = named(&inner, &name, &params, &headers).await?;
    let body: Transformations = parse(&body)?;
    for (i, t) in body.transformations.iter().enumerate() {
        t.check(i)
            .map_err(|e| bad("invalid", e.message().to_string()))?;
    }
    let mut guard = slot.lock().await;
    let live = guard.as_mut().ok_or_else(|| not_found(&name))?;
    let mut list = if add {
        live.record.transformations.clone()
    } else {
        Vec::new()
    };
    list.extend(body.transformations);
    live.egress.set(|r| r.transformations = list.clone());
    live.record.transformations = list;
    inner.save(&live.record)?;
    Ok(Json(info_json(
        &live.record,
        None,
        inner.processes.count(&name),
    )))
}

async fn port_url(
    State(inner): Shared,
    Path((name, port)): Path<(String, String)>,
    Query(params): Params,
    headers: HeaderMap,
) -> Result<Json<Value>, ApiError> {
    let slot = named(&inner, &name, &params, &headers).await?;
    let port: u16 = port
        .parse()
        .map_err(|_| bad("invalid", format!("port {port:?} is not a port number")))?;
    let guard = slot.lock().await;
    let live = guard.as_ref().ok_or_else(|| not_found(&name))?;
    if !live.record.request.ports.contains(&port) {
        return Err(bad(
            "port_not_declared",
            format!(
                "sandbox {name:?} did not declare port {port} (its ports: {:?})",
                live.record.request.ports
            ),
        ));
    }
    Ok(Json(json!({
        "path": format!("/v1/sandbox-port/{name}/{port}/{}/", live.record.port_secret),
    })))
}

async fn stop(
    State(inner): Shared,
    Path(name): Path<String>,
    Query(params): Params,
    headers: HeaderMap,
) -> Result<Json<Value>, ApiError> {
    let slot = named(&inner, &name, &params, &headers).await?;
    let mut guard = slot.lock().await;
    let live = guard.as_mut().ok_or_else(|| not_found(&name))?;
    let killed = inner.processes.kill_all(&name);
    if live.record.stopped && live.sandbox.is_none() {
        // Stopped already: nothing runs, nothing to start just to stop.
        return Ok(Json(json!({ "stopped": true, "killed": killed })));
    }
    inner.ensure_live(live).await?;
    let sandbox = live.sandbox.take().expect("ensured");
    match sandbox.stop().await {
        Ok(_) => {}
        // Nothing to stop but the processes (a local sandbox).
        Err(e) if e.kind() == ErrorKind::Unsupported => {}
        Err(e) => return Err(e.into()),
    }
    wait_for_exit(&inner.processes, &name).await;
    live.record.stopped = true;
    inner.save(&live.record)?;
    Ok(Json(json!({ "stopped": true, "killed": killed })))
}

/// Wait (a few seconds at most) for the killed processes of `name` to end.
async fn wait_for_exit(processes: &Processes, name: &str) {
    for _ in 0..100 {
        if processes.count(name) == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn destroy(
    State(inner): Shared,
    Path(name): Path<String>,
    Query(params): Params,
    headers: HeaderMap,
) -> Response {
    let result = async {
        let slot = named(&inner, &name, &params, &headers).await?;
        let mut guard = slot.lock().await;
        let Some(mut live) = guard.take() else {
            return Err(not_found(&name));
        };
        inner.processes.kill_all(&name);
        let sandbox = match live.sandbox.take() {
            Some(s) => Some(s),
            None => match inner.providers.get(&live.record.provider) {
                Some(p) => match p.provider.resume(&live.record.handle).await {
                    Ok(s) => Some(Arc::from(s)),
                    Err(e) if e.kind() == ErrorKind::NotFound => None,
                    Err(e) => {
                        *guard = Some(live);
                        return Err(e.into());
                    }
                },
                None => None,
            },
        };
        if let Some(sandbox) = sandbox {
            if let Err(e) = sandbox.destroy().await {
                *guard = Some(live);
                return Err(e.into());
            }
        }
        wait_for_exit(&inner.processes, &name).await;
        let _ = std::fs::remove_file(record_path(&inner.state_dir, &name));
        if let EgressRecord::Unix { path } = &live.record.egress {
            if let Some(dir) = std::path::Path::new(path).parent() {
                let _ = std::fs::remove_dir_all(dir);
            }
        }
        drop(live);
        drop(guard);
        inner.slots.lock().await.remove(&name);
        Ok::<_, ApiError>(())
    }
    .await;
    match result {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => e.into_response(),
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ReplaceBody {
    #[serde(default)]
    provider: Option<String>,
}

/// A new sandbox under the same name: made like the first (on another
/// provider if asked), the working directory moved into it as a tar
/// stream, the old one destroyed. The name's port URLs and proxy stay.
async fn replace(
    State(inner): Shared,
    Path(name): Path<String>,
    Query(params): Params,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let slot = named(&inner, &name, &params, &headers).await?;
    let body: ReplaceBody = if body.is_empty() {
        ReplaceBody::default()
    } else {
        parse(&body)?
    };
    let mut guard = slot.lock().await;
    let live = guard.as_mut().ok_or_else(|| not_found(&name))?;
    let mut req = live.record.request.clone();
    if let Some(provider) = body.provider {
        req.provider = provider;
    }
    req.network_policy = live.record.policy.clone();
    req.request_transformations = live.record.transformations.clone();
    validate(&inner, &req)?;
    // The proxy stays when the new sandbox reaches it the same way;
    // else a new one with the same rules (a Unix socket for a
    // container, a loopback port for a local sandbox on the host's
    // network).
    let wanted = listen_for(&inner, &req);
    let new_egress =
        if std::mem::discriminant(&live.egress.listen) == std::mem::discriminant(&wanted) {
            None
        } else {
            let rules = live
                .egress
                .rules
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .clone();
            Some(Egress::start(wanted, rules).await.map_err(internal)?)
        };
    let listen = new_egress
        .as_ref()
        .map_or_else(|| live.egress.listen.clone(), |e| e.listen.clone());
    let snapshot = match &live.record.snapshot_key {
        Some(key) => std::fs::read(inner.snapshot_path(key))
            .ok()
            .and_then(|raw| serde_json::from_slice::<SnapshotRecord>(&raw).ok())
            .filter(|_| req.provider == live.record.provider)
            .map(|s| s.image),
        None => None,
    };
    inner.ensure_live(live).await?;
    let old = live.sandbox.clone().expect("ensured");
    let (new, routed) = make_sandbox(&inner, &name, &req, snapshot.clone(), &listen).await?;
    if snapshot.is_none() {
        if let Err(e) = run_pre_commands(new.as_ref(), &req.bootstrap_pre_commands).await {
            let _ = new.destroy().await;
            return Err(e);
        }
    }
    let moved = async {
        let tar = old.export_tar(old.workdir()).await?;
        new.import_tar(new.workdir(), tar).await
    }
    .await;
    if let Err(e) = moved {
        let _ = new.destroy().await;
        return Err(e.into());
    }
    inner.processes.kill_all(&name);
    wait_for_exit(&inner.processes, &name).await;
    if let Err(e) = old.destroy().await {
        tracing::warn!(sandbox = %name, "the replaced sandbox was not destroyed: {e}");
    }
    if let Some(egress) = new_egress {
        live.record.egress = egress_record(&egress.listen);
        live.egress = egress;
    }
    live.record.handle = new.handle();
    live.record.provider = req.provider.clone();
    live.record.request.provider = req.provider;
    live.record.routed = routed;
    live.record.stopped = false;
    live.record.generation += 1;
    live.sandbox = Some(new);
    inner.save(&live.record)?;
    Ok(Json(info_json(&live.record, None, 0)))
}
