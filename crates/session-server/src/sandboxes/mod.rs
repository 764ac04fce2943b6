//! The sandbox API: `harness serve`'s sandboxes for outside agents (the AI
//! SDK's `HarnessAgent` through `packages/ai-sdk`), one API for every
//! provider the server was given. See `docs/ai-sdk.md`.
//!
//! A sandbox made here is a *bare* sandbox with a name (the AI SDK session
//! id), not a session's: no log, no turns. The server keeps a record per
//! name (provider, handle, policy, transformations, the secret of its port
//! URLs) in its state directory, so any process resumes it by name, and a
//! replaced sandbox keeps its name and its port URLs.
//!
//! ```text
//! POST   /v1/sandboxes                           create (201), or 4xx and nothing made
//! GET    /v1/sandboxes                           list
//! GET    /v1/sandboxes/{name}                    info
//! POST   /v1/sandboxes/{name}/resume             reattach (a stopped sandbox starts again)
//! POST   /v1/sandboxes/{name}/bootstrap          {"ok":bool}: the first-create hook ran; snapshot it for the identity
//! POST   /v1/sandboxes/{name}/exec               SSE: stdout/stderr (base64), then exit | error
//! POST   /v1/sandboxes/{name}/processes/{p}/kill kill a running command
//! GET    /v1/sandboxes/{name}/file?path=P        the file's bytes (404 when missing)
//! PUT    /v1/sandboxes/{name}/file?path=P        write the body (parents created)
//! PUT    /v1/sandboxes/{name}/network-policy     change the policy at run time
//! PUT|POST /v1/sandboxes/{name}/request-transformations   set | add
//! GET    /v1/sandboxes/{name}/ports/{port}       {"path": …} of the port's URL
//! POST   /v1/sandboxes/{name}/replace            a new sandbox under the name, the workdir moved
//! POST   /v1/sandboxes/{name}/stop               kill every process, keep the files
//! DELETE /v1/sandboxes/{name}                    destroy
//! ANY    /v1/sandbox-port/{name}/{port}/{secret}/…  HTTP and WebSocket to the port
//! ```

mod egress;
mod ports;
mod process;
mod routes;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use axum::Router;
use harness_core::sandbox::{Sandbox, SandboxHandle, SandboxProvider};
use serde::{Deserialize, Serialize};

pub use egress::{ApiNetworkPolicy, RequestTransformation};

use crate::auth::TokenGrant;

/// One provider the API offers.
#[derive(Debug, Clone)]
struct ProviderEntry {
    provider: Arc<dyn SandboxProvider>,
    /// Variables every sandbox of this provider gets (before the request's).
    env: BTreeMap<String, String>,
}

/// What `harness serve` fills: the providers by name, where the records
/// live, and who may call.
#[derive(Debug, Clone)]
pub struct SandboxRegistry {
    providers: BTreeMap<String, ProviderEntry>,
    state_dir: PathBuf,
    snapshots_dir: Option<PathBuf>,
    tokens: Vec<TokenGrant>,
    insecure_no_auth: bool,
}

impl SandboxRegistry {
    /// An empty registry keeping its records under `state_dir`.
    pub fn new(state_dir: impl Into<PathBuf>) -> Self {
        Self {
            providers: BTreeMap::new(),
            state_dir: state_dir.into(),
            snapshots_dir: None,
            tokens: Vec::new(),
            insecure_no_auth: false,
        }
    }

    /// Offer `provider` as `name` (`local`, `docker`, …).
    pub fn provider(mut self, name: &str, provider: Arc<dyn SandboxProvider>) -> Self {
        self.providers.insert(
            name.to_string(),
            ProviderEntry {
                provider,
                env: BTreeMap::new(),
            },
        );
        self
    }

    /// Variables every sandbox of provider `name` gets, under the
    /// request's own (a `PATH` that finds the tools the server mounts, the
    /// CA bundle a registry proxy needs).
    pub fn provider_env(mut self, name: &str, env: BTreeMap<String, String>) -> Self {
        if let Some(entry) = self.providers.get_mut(name) {
            entry.env.extend(env);
        }
        self
    }

    /// Where the identities' snapshot records live (default: the state
    /// directory's `snapshots/`). Records name provider images (a Docker
    /// image), which outlive a server's state: servers of one machine may
    /// share them; a record whose image is gone is bootstrapped again.
    pub fn snapshots_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.snapshots_dir = Some(dir.into());
        self
    }

    /// The same bearer grants as the sessions' (`ServerConfig::tokens`).
    pub fn auth(mut self, tokens: Vec<TokenGrant>, insecure_no_auth: bool) -> Self {
        self.tokens = tokens;
        self.insecure_no_auth = insecure_no_auth;
        self
    }

    /// The provider names offered.
    pub fn names(&self) -> Vec<String> {
        self.providers.keys().cloned().collect()
    }

    /// Load the records of earlier runs (their proxies start again) and
    /// serve.
    pub async fn start(self) -> std::io::Result<SandboxApi> {
        std::fs::create_dir_all(self.state_dir.join("records"))?;
        let snapshots = self
            .snapshots_dir
            .clone()
            .unwrap_or_else(|| self.state_dir.join("snapshots"));
        std::fs::create_dir_all(&snapshots)?;
        let inner = Arc::new(routes::Inner::new(self));
        inner.load().await;
        Ok(SandboxApi { inner })
    }
}

/// The running API: its router.
#[derive(Debug, Clone)]
pub struct SandboxApi {
    inner: Arc<routes::Inner>,
}

impl SandboxApi {
    /// The routes (merge into the session server's router).
    pub fn router(&self) -> Router {
        routes::router(self.inner.clone())
    }
}

/// What a create asks for (`createHarnessSandbox`'s options, JSON).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CreateRequest {
    /// A provider the server offers.
    pub provider: String,
    /// Names the sandbox (the AI SDK session id); a fresh name when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<String>,
    /// The one-time setup's identity: the first create of an identity
    /// answers `bootstrap: "required"`, later ones start from its snapshot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub identity: Option<String>,
    /// Image (Docker) or the provider's equivalent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// The default working directory (containers; a local sandbox has its
    /// own host directory).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workdir: Option<String>,
    /// Variables for every command.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// CPU limit (cores).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpus: Option<f64>,
    /// Memory limit in MiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<u64>,
    /// Ports reachable through `/v1/sandbox-port/…`.
    #[serde(default)]
    pub ports: Vec<u16>,
    /// The network policy.
    #[serde(default)]
    pub network_policy: ApiNetworkPolicy,
    /// Headers added on the host to matching requests.
    #[serde(default)]
    pub request_transformations: Vec<RequestTransformation>,
    /// Shell commands run once after a fresh create (part of the identity's
    /// snapshot).
    #[serde(default)]
    pub bootstrap_pre_commands: Vec<String>,
}

/// A named sandbox as the server keeps it on disk.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Record {
    name: String,
    provider: String,
    handle: SandboxHandle,
    /// The secret in the sandbox's port URLs.
    port_secret: String,
    request: CreateRequest,
    policy: ApiNetworkPolicy,
    transformations: Vec<RequestTransformation>,
    /// Whether the sandbox itself has a route out now.
    routed: bool,
    /// The key of the identity's snapshot, when an identity was given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    snapshot_key: Option<String>,
    /// How the sandbox reaches its proxy.
    egress: EgressRecord,
    /// Stopped through the API (and not resumed since).
    #[serde(default)]
    stopped: bool,
    /// How many sandboxes this name has had (1 + replacements).
    #[serde(default = "one")]
    generation: u64,
}

fn one() -> u64 {
    1
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
enum EgressRecord {
    Unix { path: String },
    Tcp { port: u16 },
}

fn record_path(state_dir: &Path, name: &str) -> PathBuf {
    state_dir.join("records").join(format!("{name}.json"))
}

/// The live part of a named sandbox.
struct Live {
    record: Record,
    sandbox: Option<Arc<dyn Sandbox>>,
    egress: egress::Egress,
    /// Held while this sandbox's identity waits for its first-create hook.
    bootstrap: Option<tokio::sync::OwnedMutexGuard<()>>,
}

impl std::fmt::Debug for Live {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Live")
            .field("name", &self.record.name)
            .field("provider", &self.record.provider)
            .field("bootstrap", &self.bootstrap.is_some())
            .finish()
    }
}

type Slots = HashMap<String, Arc<tokio::sync::Mutex<Option<Live>>>>;
