//! `harness checkpoint|restore|ls`: moving a session through an S3/R2
//! store, with progress bars.
//!
//! By default a checkpoint is the whole session — the working tree, the
//! agent's own state (its conversation, under the sandbox's `$HOME`) and a
//! manifest (`harness_moves::checkpoint_session`) under a base key —
//! and a restore puts both into a sandbox and relocates the agent's state
//! to that sandbox's workdir and home (`restore_session`), so the next
//! `harness run --session` continues the conversation. `--tree-only` moves
//! the working tree alone (one `.tar.zst` object), as earlier versions did.
//!
//! What was moved is recorded in the session's log (what `harness sessions
//! show` reads): a `raw` part whose value is a [`MoveRecord`]. A restore
//! also records the sandbox and the agent session it put in place with a
//! terminal `turn-status` frame of the pseudo turn [`RESTORE_TURN`], the
//! frame that carries them into the session's meta (the next turn resumes
//! from it).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use harness::core::checkpoint::CheckpointStore;
use harness::core::frame::{FrameBody, SessionId};
use harness::core::harness::Harness;
use harness::core::log::{AppendRequest, LogInfo, SessionLog};
use harness::core::part::StreamPart;
use harness::core::sandbox::Sandbox;
use harness::core::session::{SandboxConfig, SessionConfig};
use harness::core::turn::TurnStatus;
use harness::core::ErrorKind;
use harness::fs_store::FsCheckpointStore;
use harness::moves::crypt::{DeploymentKey, Lineages};
use harness::moves::{MovePhase, MoveProgress, SessionKeys, SessionManifest};
#[cfg(feature = "s3")]
use harness::r2::{S3CheckpointStore, S3Config};
use harness::runtime::SystemClock;
use harness::sqlite::SqliteSessionLog;
use serde::{Deserialize, Serialize};

use crate::home::Home;
use crate::{AgentKind, SandboxKind};

/// The turn id of the frames a restore writes into its target session.
pub const RESTORE_TURN: &str = "restore";

/// Where the store is: a directory on this machine (by default the harness
/// home's `checkpoints/`), or an S3/R2 bucket when one is named.
#[derive(Debug, clap::Args)]
pub struct StoreArgs {
    /// A checkpoint store in this directory (made if absent). Without it,
    /// and without an S3/R2 store below, the store is `checkpoints/` in the
    /// harness home.
    #[arg(long, env = "HARNESS_CHECKPOINT_DIR")]
    dir: Option<PathBuf>,
    /// S3 endpoint (e.g. http://127.0.0.1:8333); for R2 use --r2-account.
    #[arg(long, env = "HARNESS_S3_ENDPOINT")]
    endpoint: Option<String>,
    /// Cloudflare account id: selects the R2 endpoint, region `auto`.
    #[arg(long, env = "HARNESS_R2_ACCOUNT_ID")]
    r2_account: Option<String>,
    /// Bucket.
    #[arg(long, env = "HARNESS_S3_BUCKET", default_value = "harness-checkpoints")]
    bucket: String,
    /// A key prefix inside the bucket that this store keeps to (e.g.
    /// `staging`): several deployments or test runs share one bucket, each
    /// seeing only its own keys.
    #[arg(long, env = "HARNESS_S3_NAMESPACE", default_value = "")]
    namespace: String,
    /// Region (ignored for R2).
    #[arg(long, env = "AWS_REGION", default_value = "us-east-1")]
    region: String,
    /// Encrypt new checkpoints on this machine before they reach the store
    /// (XChaCha20-Poly1305, a key per session lineage derived from
    /// $HARNESS_CHECKPOINT_KEY, else the home's `checkpoint.key`): `auto`
    /// encrypts for S3/R2 stores and not for a directory on this machine.
    /// Encrypted checkpoints are read whatever this says, given the key.
    #[arg(
        long,
        env = "HARNESS_CHECKPOINT_ENCRYPTION",
        value_enum,
        default_value = "auto"
    )]
    encryption: Encryption,
}

/// Whether new checkpoints are encrypted (`--encryption`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Encryption {
    /// On for S3/R2 stores, off for a directory store.
    Auto,
    /// Always.
    On,
    /// Never (encrypted checkpoints are still read, given the key).
    Off,
}

impl StoreArgs {
    /// The store these flags name, with the deployment's checkpoint key:
    /// new checkpoints are encrypted when `--encryption` says so (the key
    /// made in the home if there is none yet), and encrypted ones are
    /// read when a key is there.
    async fn open_lineages(&self, home: &Home) -> Result<Lineages> {
        let store = self.open(home).await?;
        let object_store = self.endpoint.is_some() || self.r2_account.is_some();
        let encrypt = match self.encryption {
            Encryption::On => true,
            Encryption::Off => false,
            Encryption::Auto => object_store && self.dir.is_none(),
        };
        let key = checkpoint_key(home, encrypt)?;
        if encrypt {
            eprintln!("checkpoints are encrypted on this machine (a key per session lineage)");
        }
        // Reading needs the key whatever new checkpoints do; writing
        // encrypts only when asked.
        Ok(match (encrypt, key) {
            (true, key) => Lineages::new(store, key),
            (false, Some(key)) => Lineages::reading(store, key),
            (false, None) => Lineages::new(store, None),
        })
    }

    /// The store `spec` names: a directory, or `s3://BUCKET/PREFIX` with the
    /// endpoint (`$HARNESS_S3_ENDPOINT`, or R2's `$HARNESS_R2_ACCOUNT_ID`)
    /// and region from the environment; encryption `auto` (on for a
    /// bucket). `harness worker --checkpoints`.
    pub(crate) fn named(spec: &str) -> Result<Self> {
        let env = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        let mut args = Self {
            dir: None,
            endpoint: None,
            r2_account: None,
            bucket: String::new(),
            namespace: String::new(),
            region: env("AWS_REGION").unwrap_or_else(|| "us-east-1".into()),
            encryption: Encryption::Auto,
        };
        match spec.strip_prefix("s3://") {
            Some(rest) => {
                let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
                if bucket.is_empty() {
                    bail!("{spec:?} names no bucket: give s3://BUCKET or s3://BUCKET/PREFIX");
                }
                args.bucket = bucket.to_string();
                args.namespace = prefix.trim_end_matches('/').to_string();
                args.r2_account = env("HARNESS_R2_ACCOUNT_ID");
                args.endpoint = env("HARNESS_S3_ENDPOINT");
                if args.r2_account.is_none() && args.endpoint.is_none() {
                    bail!(
                        "{spec:?} is a bucket, but no endpoint is set: export HARNESS_S3_ENDPOINT \
                         (e.g. http://127.0.0.1:8333) or HARNESS_R2_ACCOUNT_ID"
                    );
                }
            }
            None if spec.is_empty() => {
                bail!("an empty checkpoint store: give a directory or s3://BUCKET/PREFIX")
            }
            None => args.dir = Some(PathBuf::from(spec)),
        }
        Ok(args)
    }

    /// Turn-end checkpoints (`docs/turn-checkpoints.md`) in the store these
    /// flags name: what a `harness worker` or `runner` takes at each turn's
    /// end and makes forks and lost sandboxes anew from. Several workers
    /// share one store (a directory they all reach, or a bucket), so a
    /// session's next turn may land on any of them.
    pub(crate) async fn turn_checkpoints(
        &self,
        home: &Home,
    ) -> Result<Arc<dyn harness::core::turn_checkpoint::TurnCheckpoints>> {
        let lineages = self.open_lineages(home).await?;
        Ok(Arc::new(harness::moves::turns::StoreTurnCheckpoints::over(
            lineages,
            Arc::new(harness::runtime::SystemClock),
        )))
    }

    /// The store these flags name; the home's directory store when they
    /// name none.
    async fn open(&self, home: &Home) -> Result<Arc<dyn CheckpointStore>> {
        let object_store = self.endpoint.is_some() || self.r2_account.is_some();
        match (&self.dir, object_store) {
            (Some(dir), true) => bail!(
                "both a directory store (--dir {}) and an S3/R2 store (--endpoint/--r2-account, \
                 or $HARNESS_S3_ENDPOINT/$HARNESS_R2_ACCOUNT_ID) are named: pick one",
                dir.display()
            ),
            (Some(dir), false) => Self::open_dir(dir),
            (None, false) => Self::open_dir(&home.checkpoints()),
            (None, true) => self.open_object_store().await,
        }
    }

    fn open_dir(dir: &Path) -> Result<Arc<dyn CheckpointStore>> {
        let store = FsCheckpointStore::open(dir)
            .with_context(|| format!("opening the checkpoint store in {}", dir.display()))?;
        eprintln!("checkpoint store: the directory {}", dir.display());
        Ok(Arc::new(store))
    }

    #[cfg(not(feature = "s3"))]
    async fn open_object_store(&self) -> Result<Arc<dyn CheckpointStore>> {
        Err(crate::features::missing("s3", "an S3/R2 checkpoint store"))
    }

    #[cfg(feature = "s3")]
    async fn open_object_store(&self) -> Result<Arc<dyn CheckpointStore>> {
        let key = std::env::var("AWS_ACCESS_KEY_ID").unwrap_or_else(|_| "harness".into());
        let secret = std::env::var("AWS_SECRET_ACCESS_KEY").unwrap_or_else(|_| "harness".into());
        let config = match (&self.r2_account, &self.endpoint) {
            (Some(account), _) => S3Config::r2(account, key, secret, &self.bucket),
            (None, Some(endpoint)) => {
                S3Config::custom(endpoint, &self.region, key, secret, &self.bucket)
            }
            (None, None) => unreachable!("open() asks for an object store only when one is named"),
        };
        let config = config.with_prefix(&self.namespace);
        let store = S3CheckpointStore::new(config)?;
        store
            .ensure_bucket()
            .await
            .context("reaching the checkpoint store")?;
        Ok(Arc::new(store))
    }
}

/// The deployment's checkpoint key: `$HARNESS_CHECKPOINT_KEY` (64 hex
/// digits), else the home's `checkpoint.key` — made there when `create`
/// (a checkpoint to encrypt) and there is none.
fn checkpoint_key(home: &Home, create: bool) -> Result<Option<DeploymentKey>> {
    if let Ok(text) = std::env::var(harness::moves::crypt::KEY_ENV) {
        return Ok(Some(DeploymentKey::from_hex(&text).with_context(|| {
            format!("${}", harness::moves::crypt::KEY_ENV)
        })?));
    }
    let path = home.checkpoint_key();
    if create || path.exists() {
        let secret = harness::broker::load_or_make_secret(&path)
            .with_context(|| format!("the checkpoint key {}", path.display()))?;
        return Ok(Some(DeploymentKey::from_secret(&secret)?));
    }
    Ok(None)
}

/// The store and key a restore of `key` reads. A key given as the user
/// chose it at `harness checkpoint --key` (without the `lineages/<L>/` the
/// checkpoint printed) that is not in the plain store is looked for in the
/// lineages: found in exactly one, that one is read (and said so).
async fn resolve_for_restore(
    lineages: &Lineages,
    key: &str,
) -> Result<(Arc<dyn CheckpointStore>, String)> {
    let (store, inner) = lineages.resolve(key)?;
    if harness::moves::crypt::split_lineage(key).is_some()
        || !store.list_keys(&inner).await?.is_empty()
    {
        return Ok((store, inner));
    }
    match lineages.holding(key).await?.as_slice() {
        [lineage] => {
            let full = format!("{}{key}", harness::moves::crypt::lineage_prefix(lineage)?);
            eprintln!("note: {key} is encrypted in lineage {lineage}: reading {full}");
            Ok(lineages.resolve(&full)?)
        }
        [] => Ok((store, inner)),
        several => bail!(
            "{key} is in several lineages ({}): name one, as `lineages/<lineage>/{key}`",
            several.join(", ")
        ),
    }
}

/// The lineage a session's checkpoints are encrypted in: the session its
/// forks were made from, first of all (a fork reads its parent's chunks).
async fn lineage_of(log: &SqliteSessionLog, info: &LogInfo) -> String {
    let mut origin = info.forked_from.clone();
    let mut root = info.session.to_string();
    // Bounded: a fork chain longer than this is cut, not walked forever.
    for _ in 0..64 {
        let Some(from) = origin else { break };
        root = from.session.to_string();
        origin = match log.info(&from.session).await {
            Ok(parent) => parent.forked_from,
            Err(_) => None,
        };
    }
    harness::core::turn_checkpoint::key_segment(&root)
}

/// `harness checkpoint`.
#[derive(Debug, clap::Args)]
pub struct CheckpointArgs {
    /// The session to checkpoint.
    #[arg(long)]
    session: String,
    /// Checkpoint key: the base key of a session checkpoint (default
    /// sessions/<session>/turn-<turns>), the object key with --tree-only
    /// (default sessions/<session>/turn-<turns>.tar.zst).
    #[arg(long)]
    key: Option<String>,
    /// Only the working tree, as one .tar.zst object (no agent state: a
    /// restore cannot continue the conversation).
    #[arg(long)]
    tree_only: bool,
    /// With --tree-only: a tree checkpoint (a manifest plus content blobs
    /// stored once per store, default key …/turn-<turns>.tree) instead of
    /// one archive; `harness restore --tree-only` reads both.
    #[arg(long, requires = "tree_only")]
    incremental: bool,
    /// With --incremental: an earlier tree checkpoint of this tree. Only the
    /// files changed since are read and only content the store lacks is
    /// uploaded; restoring onto that earlier state writes only the change.
    #[arg(long, requires = "incremental")]
    parent: Option<String>,
    #[command(flatten)]
    store: StoreArgs,
}

/// `harness gc`.
#[derive(Debug, clap::Args)]
pub struct GcArgs {
    #[command(flatten)]
    store: StoreArgs,
    /// Keep only each session's last N turn-end checkpoints (what it may
    /// rewind to); the default keeps every one a session references. A
    /// fork's references count as its own, so a live fork keeps the
    /// checkpoint it was made from.
    #[arg(long, value_name = "N")]
    keep_last: Option<usize>,
    /// Leave turn-end checkpoints younger than this alone (their frame may
    /// not be in the log yet).
    #[arg(long, default_value_t = 600, value_name = "SECONDS")]
    grace_secs: u64,
}

/// `harness restore`.
#[derive(Debug, clap::Args)]
#[command(group(
    clap::ArgGroup::new("target")
        .required(true)
        .args(["session", "new_session"])
))]
pub struct RestoreArgs {
    /// Restore into this session's sandbox (overlaying its tree); a session
    /// checkpoint also makes the session continue the checkpoint's
    /// conversation (the agents must match).
    #[arg(long)]
    session: Option<String>,
    /// Restore into a new session, in a new sandbox (--sandbox, --image),
    /// running the checkpoint's agent; prints the new session's id.
    #[arg(long, conflicts_with = "tree_only")]
    new_session: bool,
    /// Sandbox of the new session (default local).
    #[arg(long, value_enum, conflicts_with = "session")]
    sandbox: Option<SandboxKind>,
    /// Docker image of the new session's sandbox.
    #[arg(long, conflicts_with = "session")]
    image: Option<String>,
    /// Model name the new session passes to the agent.
    #[arg(long, conflicts_with = "session")]
    model: Option<String>,
    /// Checkpoint key (as `harness checkpoint` printed it).
    #[arg(long)]
    key: String,
    /// The key is a tree-only checkpoint (`harness checkpoint --tree-only`):
    /// restore the working tree alone into --session.
    #[arg(long)]
    tree_only: bool,
    #[command(flatten)]
    store: StoreArgs,
}

/// `harness ls`.
#[derive(Debug, clap::Args)]
pub struct LsArgs {
    /// Only keys under this prefix.
    #[arg(long, default_value = "")]
    prefix: String,
    #[command(flatten)]
    store: StoreArgs,
}

/// What a checkpoint or a restore left in a session's log: the value of a
/// `raw` part (`{"harness": "checkpoint", "key": …}`), read back by
/// `harness sessions show`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MoveRecord {
    /// `checkpoint` or `restore`.
    pub harness: String,
    /// The checkpoint's key (the base key of a session checkpoint).
    pub key: String,
    /// `session` (tree and agent state) or `tree`.
    pub kind: String,
    /// The agent whose state moved.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<String>,
    /// The agent's own session id that moved.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_session_id: Option<String>,
    /// Bytes stored (zstd, checkpoint) or restored (files, restore).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes: Option<u64>,
    /// Restore: the workdir the checkpoint was taken in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_workdir: Option<String>,
}

impl MoveRecord {
    /// The record a frame holds, if it holds one.
    pub fn from_frame(body: &FrameBody) -> Option<Self> {
        match body {
            FrameBody::Part {
                part: StreamPart::Raw { value },
                ..
            } if matches!(
                value.get("harness").and_then(|v| v.as_str()),
                Some("checkpoint" | "restore")
            ) =>
            {
                serde_json::from_value(value.clone()).ok()
            }
            _ => None,
        }
    }

    fn frame(&self, turn_id: &str) -> Result<AppendRequest> {
        Ok(AppendRequest::new(FrameBody::Part {
            turn_id: turn_id.to_string(),
            part: StreamPart::Raw {
                value: serde_json::to_value(self)?,
            },
        }))
    }
}

/// Progress bars for the phases of a move, under a spinner saying what
/// runs.
struct Bars {
    multi: indicatif::MultiProgress,
    bars: std::sync::Mutex<Vec<(MovePhase, indicatif::ProgressBar)>>,
}

impl Bars {
    fn new() -> Self {
        Self {
            multi: indicatif::MultiProgress::new(),
            bars: std::sync::Mutex::new(Vec::new()),
        }
    }

    /// A spinner line saying what runs (finish it with `finish_and_clear`).
    fn step(&self, message: String) -> indicatif::ProgressBar {
        let bar = self.multi.add(indicatif::ProgressBar::new_spinner());
        bar.set_style(
            indicatif::ProgressStyle::with_template("{spinner} {msg} [{elapsed}]")
                .expect("static template"),
        );
        bar.set_message(message);
        bar.enable_steady_tick(Duration::from_millis(120));
        bar
    }

    /// Show `message` as a spinner while `work` runs, then clear it,
    /// whatever `work` answers.
    async fn during<T>(&self, message: String, work: impl std::future::Future<Output = T>) -> T {
        let step = self.step(message);
        let out = work.await;
        step.finish_and_clear();
        out
    }

    fn bar(&self, phase: MovePhase) -> indicatif::ProgressBar {
        let mut bars = self.bars.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, bar)) = bars.iter().find(|(p, _)| *p == phase) {
            return bar.clone();
        }
        let bar = self.multi.add(indicatif::ProgressBar::new_spinner());
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{spinner} {prefix:>8} {bytes} ({bytes_per_sec}) [{elapsed}]",
            )
            .expect("static template"),
        );
        bar.set_prefix(match phase {
            MovePhase::Export => "export",
            MovePhase::Verify => "verify",
            MovePhase::Import => "import",
        });
        bars.push((phase, bar.clone()));
        bar
    }
}

impl MoveProgress for Bars {
    fn advance(&self, phase: MovePhase, bytes: u64) {
        self.bar(phase).inc(bytes);
    }
    fn finish(&self, phase: MovePhase) {
        self.bar(phase).finish();
    }
}

fn open_log(home: &Home) -> Result<SqliteSessionLog> {
    home.open_log()
}

/// A session of the home, as its log tells it (config, sandbox, turns).
async fn session_info(log: &SqliteSessionLog, id: &str) -> Result<LogInfo> {
    let session = SessionId::parse(id)?;
    log.info(&session).await.map_err(|e| {
        if e.kind() == ErrorKind::NotFound {
            anyhow::anyhow!("unknown session {id:?}: `harness sessions list` shows the known ones")
        } else {
            e.into()
        }
    })
}

/// Refuse a session whose turn is still running (its tree and state are
/// changing).
fn idle(info: &LogInfo) -> Result<()> {
    if let Some(turn) = info.meta.active_turn() {
        bail!(
            "turn {} of session {} is still running ({}): wait for it to end (or finish it with `harness resume`)",
            turn.turn_id,
            info.session,
            turn.status.as_str()
        );
    }
    Ok(())
}

pub(crate) async fn session_sandbox(home: &Home, info: &LogInfo) -> Result<Box<dyn Sandbox>> {
    let id = &info.session;
    let handle = info.meta.sandbox.clone().with_context(|| {
        format!("session {id} has no sandbox yet: its first turn makes it (`harness run --session {id} PROMPT`)")
    })?;
    let provider = crate::local::provider(home, &handle.provider, None).await?;
    provider
        .resume(&handle)
        .await
        .with_context(|| format!("reattaching to the {} sandbox of {id}", handle.provider))
}

/// The adapter of the agent named `name` (the native binary is found, or
/// downloaded once, as for `harness run`).
async fn adapter(home: &Home, name: &str) -> Result<Arc<dyn Harness>> {
    let kind = AgentKind::from_name(name).with_context(|| {
        format!("agent {name:?} is not one this build runs (claude-code, codex)")
    })?;
    let binary = crate::agents::ensure_binary(home, kind).await?;
    crate::agents::adapter(home, kind, binary)
}

/// The manifest of the session checkpoint `key`, with an error saying what
/// `key` is when it is not one.
async fn manifest(store: &dyn CheckpointStore, key: &str) -> Result<SessionManifest> {
    let keys = SessionKeys::new(key)?;
    match harness::moves::read_session_manifest(store, key).await {
        Ok(m) => Ok(m),
        Err(e) if e.kind() == ErrorKind::NotFound => match store.head(key).await {
            Ok(_) => bail!(
                "{key} is a tree-only checkpoint (no {} beside it, so no agent state to continue): \
                 restore its tree with `harness restore --tree-only --session ID --key {key}`",
                keys.manifest
            ),
            Err(e) if e.kind() == ErrorKind::NotFound => bail!(
                "no checkpoint {key:?} in the store (neither {} nor {key}): `harness ls` lists its keys",
                keys.manifest
            ),
            Err(e) => Err(e).context("reading the checkpoint store"),
        },
        Err(e) => Err(e).with_context(|| format!("reading {}", keys.manifest)),
    }
}

/// Append `request` to `session`'s log, saying so (and going on) when it
/// cannot be recorded: the move itself is done.
async fn record(log: &SqliteSessionLog, session: &SessionId, request: Result<AppendRequest>) {
    let stored = match request {
        Ok(request) => log.append(session, request).await.map_err(Into::into),
        Err(e) => Err(e),
    };
    if let Err(e) = stored {
        eprintln!("note: the move is not recorded in the log of session {session}: {e:#}");
    }
}

/// Run `harness checkpoint`.
pub async fn checkpoint(home: &Home, args: CheckpointArgs) -> Result<()> {
    let log = open_log(home)?;
    let info = session_info(&log, &args.session).await?;
    idle(&info)?;
    let session = info.session.clone();
    let base = format!("sessions/{session}/turn-{}", info.meta.turns);
    let after_turn = info
        .meta
        .turn
        .as_ref()
        .map(|t| t.turn_id.clone())
        .unwrap_or_else(|| "checkpoint".into());
    let lineages = args.store.open_lineages(home).await?;
    let (store, prefix) = lineages.for_new(&lineage_of(&log, &info).await)?;
    let sandbox = session_sandbox(home, &info).await?;
    let bars = Arc::new(Bars::new());
    // A tree-only checkpoint holds no agent state: it names no agent.
    let record_of = |kind: &str, key: &str, bytes: u64| MoveRecord {
        harness: "checkpoint".into(),
        key: key.to_string(),
        kind: kind.into(),
        agent: (kind == "session").then(|| info.meta.config_or_default().agent),
        agent_session_id: info
            .meta
            .agent_session_id
            .clone()
            .filter(|_| kind == "session"),
        bytes: Some(bytes),
        from_workdir: None,
    };
    if args.tree_only {
        let (key, bytes, said) = checkpoint_tree_only(
            &args,
            &session,
            sandbox.as_ref(),
            store.as_ref(),
            &prefix,
            &base,
            &bars,
        )
        .await?;
        record(
            &log,
            &session,
            record_of("tree", &key, bytes).frame(&after_turn),
        )
        .await;
        println!("{said}");
        return Ok(());
    }
    let key = args.key.unwrap_or(base);
    SessionKeys::new(&key)?;
    let config = info.meta.config_or_default();
    let harness = adapter(home, &config.agent).await?;
    let message = format!(
        "checkpointing session {session}: {}'s state, then the working tree",
        config.agent
    );
    let manifest = bars
        .during(
            message,
            harness::moves::checkpoint_session(
                sandbox.as_ref(),
                harness.as_ref(),
                info.meta.agent_session_id.as_deref(),
                store.as_ref(),
                &key,
                Some(bars.clone()),
            ),
        )
        .await
        .context("checkpointing the session")?;
    let state_bytes = manifest.state.as_ref().map_or(0, |s| s.size);
    let key = format!("{prefix}{key}");
    record(
        &log,
        &session,
        record_of("session", &key, manifest.work.size + state_bytes).frame(&after_turn),
    )
    .await;
    println!(
        "checkpoint {key}: session {session} ({}{}): tree {} bytes of zstd, agent state {}",
        manifest.agent,
        manifest
            .agent_session_id
            .as_deref()
            .map(|id| format!(", agent session {id}"))
            .unwrap_or_default(),
        manifest.work.size,
        match &manifest.state {
            Some(state) => format!(
                "{} bytes of zstd ({})",
                state.size,
                manifest.state_dirs.join(", ")
            ),
            None => "none yet".into(),
        }
    );
    println!(
        "restore it with `harness restore --key {key} --new-session [--sandbox docker]` (or --session ID)"
    );
    Ok(())
}

/// `harness checkpoint --tree-only`: one archive, or with `--incremental`
/// a tree checkpoint (manifest + chunks) over `--parent`. Answers the key as
/// printed (within the lineage), the bytes stored, and what to say.
async fn checkpoint_tree_only(
    args: &CheckpointArgs,
    session: &SessionId,
    sandbox: &dyn Sandbox,
    store: &dyn CheckpointStore,
    prefix: &str,
    base: &str,
    bars: &Arc<Bars>,
) -> Result<(String, u64, String)> {
    if !args.incremental {
        let key = args
            .key
            .clone()
            .unwrap_or_else(|| format!("{base}.tar.zst"));
        let stored = bars
            .during(
                format!("checkpointing the working tree of {session}"),
                harness::moves::checkpoint(
                    sandbox,
                    sandbox.workdir(),
                    store,
                    &key,
                    Some(bars.clone()),
                ),
            )
            .await
            .context("checkpointing the working tree")?;
        let key = format!("{prefix}{key}");
        let said = format!(
            "checkpoint {key} (tree only): {} bytes of tar as {} bytes of zstd, sha256 {}\n\
             restore it with `harness restore --tree-only --session ID --key {key}`",
            stored.tar_bytes, stored.object.size, stored.object.sha256
        );
        return Ok((key, stored.object.size, said));
    }
    let key = args.key.clone().unwrap_or_else(|| format!("{base}.tree"));
    // The parent as printed names the lineage; the tree checkpoint reads it
    // within the lineage's view.
    let parent = match args.parent.as_deref() {
        Some(p) if !prefix.is_empty() => Some(p.strip_prefix(prefix).with_context(|| {
            format!("--parent {p} is not in this session's lineage ({prefix}…)")
        })?),
        other => other,
    };
    let stored = bars
        .during(
            format!("checkpointing the working tree of {session} (changed content only)"),
            harness::moves::tree::checkpoint_tree(
                sandbox,
                sandbox.workdir(),
                store,
                &key,
                parent,
                &SystemClock,
                Some(bars.clone()),
            ),
        )
        .await
        .context("checkpointing the working tree")?;
    let key = format!("{prefix}{key}");
    let said = format!(
        "checkpoint {key} (tree only, incremental): {} entries, {} bytes; read {} files \
         ({} bytes), uploaded {} new chunks ({} bytes with the manifest){}\n\
         restore it with `harness restore --tree-only --session ID --key {key}`; \
         the next one with `--incremental --parent {key}`",
        stored.entries,
        stored.tree_bytes,
        stored.files_read,
        stored.bytes_read,
        stored.chunks_uploaded,
        stored.bytes_uploaded,
        match &args.parent {
            Some(p) => format!(", {} paths deleted since {p}", stored.deleted),
            None => String::new(),
        }
    );
    Ok((key, stored.bytes_uploaded, said))
}

/// Take the home's runtime for `what` (a restore, a rewind): it writes into
/// a session's log, which no running actor may hold. With `harness serve`
/// running, use its HTTP API instead.
pub async fn lock_idle_home(home: &Home, what: &str) -> Result<crate::home::RuntimeLock> {
    if let Some(lock) = home.try_lock_runtime()? {
        return Ok(lock);
    }
    if let Some(serve) = home.serve_info() {
        bail!(
            "harness serve (pid {}) drives this home: stop it before {what}, or ask it \
             (its HTTP API writes through the session's actor)",
            serve.pid
        );
    }
    home.lock_runtime(what).await
}

/// Run `harness restore`.
pub async fn restore(home: &Home, args: RestoreArgs) -> Result<()> {
    if args.tree_only {
        return restore_tree(home, args).await;
    }
    let _lock = lock_idle_home(home, "restoring").await?;
    let log = open_log(home)?;
    // Check the target before reading the store.
    let target = match &args.session {
        Some(id) => {
            let info = session_info(&log, id).await?;
            if info.sealed {
                bail!("session {id} is sealed: restore into a new session (--new-session) instead");
            }
            idle(&info)?;
            Some(info)
        }
        None => None,
    };
    let lineages = args.store.open_lineages(home).await?;
    let (store, key) = resolve_for_restore(&lineages, &args.key).await?;
    let manifest = manifest(store.as_ref(), &key).await?;
    if let Some(info) = &target {
        let agent = info.meta.config_or_default().agent;
        if agent != manifest.agent {
            bail!(
                "checkpoint {} holds a {} session, and session {} runs {agent}: \
                 restore it into a new session (--new-session) instead",
                args.key,
                manifest.agent,
                info.session
            );
        }
    }
    let harness = adapter(home, &manifest.agent).await?;
    let bars = Arc::new(Bars::new());
    match target {
        Some(info) => {
            let sandbox = session_sandbox(home, &info).await?;
            let restored =
                restore_into(store.as_ref(), &key, sandbox.as_ref(), &harness, &bars).await?;
            let session = info.session;
            record_restore(&log, &session, &args.key, &restored, None).await;
            println!(
                "restored {} into session {session} ({} entries, {} bytes of files{}){}",
                args.key,
                restored.work.summary.entries,
                restored.work.summary.content_bytes,
                state_note(&restored),
                resume_note(&restored)
            );
            println!("continue with `harness run --session {session} PROMPT`");
        }
        None => {
            let kind = args.sandbox.unwrap_or(SandboxKind::Local);
            let session = SessionId::parse(format!(
                "s-{}",
                &uuid::Uuid::new_v4().simple().to_string()[..12]
            ))?;
            let config = SessionConfig {
                agent: manifest.agent.clone(),
                sandbox: SandboxConfig {
                    provider: kind.name().to_string(),
                    image: args.image.clone(),
                    ..SandboxConfig::default()
                },
                model: args.model.clone(),
                approvals: false,
                budget: Default::default(),
            };
            let provider = crate::local::provider(home, kind.name(), args.image.as_deref()).await?;
            // The sandbox a session's first turn would make, with the agent
            // installed and the forwards to the home's model broker.
            let broker = crate::local::model_broker(home, &crate::local::agent_env()).await?;
            let spec = harness::core::slice::session_sandbox_spec(
                provider.as_ref(),
                &config.sandbox,
                session.as_str(),
                None,
                harness.as_ref(),
                broker.as_deref(),
            )
            .await?;
            let message = format!(
                "creating a {} sandbox for session {session} (the agent is installed once per image)",
                kind.name()
            );
            let sandbox = bars
                .during(message, provider.create(&spec))
                .await
                .with_context(|| format!("creating a {} sandbox", kind.name()))?;
            let restored =
                match restore_into(store.as_ref(), &key, sandbox.as_ref(), &harness, &bars).await {
                    Ok(restored) => restored,
                    Err(e) => {
                        let _ = sandbox.destroy().await;
                        return Err(e.context("the new sandbox was removed; no session was made"));
                    }
                };
            let handle = sandbox.detach().await?;
            log.create_with(&session, Some(config))
                .await
                .context("recording the new session")?;
            record_restore(&log, &session, &args.key, &restored, Some(handle.clone())).await;
            println!(
                "session {session} ({} in a {} sandbox, {}) restored from {}: {} entries, {} bytes of files{}{}",
                manifest.agent,
                handle.provider,
                handle.workdir,
                args.key,
                restored.work.summary.entries,
                restored.work.summary.content_bytes,
                state_note(&restored),
                resume_note(&restored)
            );
            println!("continue with `harness run --session {session} PROMPT`");
        }
    }
    Ok(())
}

async fn restore_into(
    store: &dyn CheckpointStore,
    key: &str,
    sandbox: &dyn Sandbox,
    harness: &Arc<dyn Harness>,
    bars: &Arc<Bars>,
) -> Result<harness::moves::SessionRestoreInfo> {
    bars.during(
        format!("restoring {key} (verified before anything is written)"),
        harness::moves::restore_session(store, key, sandbox, harness.as_ref(), Some(bars.clone())),
    )
    .await
    .context("restoring (nothing was changed if the checkpoint was refused)")
}

fn state_note(restored: &harness::moves::SessionRestoreInfo) -> String {
    match &restored.state {
        Some(state) => format!(
            "; agent state {} bytes under {}{}",
            state.summary.content_bytes,
            restored.home,
            if restored.relocated {
                ", relocated to this sandbox's workdir"
            } else {
                ""
            }
        ),
        None => "; no agent state".into(),
    }
}

fn resume_note(restored: &harness::moves::SessionRestoreInfo) -> String {
    restored
        .manifest
        .agent_session_id
        .as_deref()
        .map(|id| format!("; the next turn resumes agent session {id}"))
        .unwrap_or_default()
}

/// Record a session restore in the target's log: what was restored, then
/// the sandbox (a new session's) and the agent session the next turn
/// continues, in a terminal `turn-status` of the pseudo turn
/// [`RESTORE_TURN`] (the frame that carries both into the session's meta).
async fn record_restore(
    log: &SqliteSessionLog,
    session: &SessionId,
    key: &str,
    restored: &harness::moves::SessionRestoreInfo,
    sandbox: Option<harness::core::sandbox::SandboxHandle>,
) {
    let manifest = &restored.manifest;
    let what = MoveRecord {
        harness: "restore".into(),
        key: key.to_string(),
        kind: "session".into(),
        agent: Some(manifest.agent.clone()),
        agent_session_id: manifest.agent_session_id.clone(),
        bytes: Some(
            restored.work.summary.content_bytes
                + restored
                    .state
                    .as_ref()
                    .map_or(0, |s| s.summary.content_bytes),
        ),
        from_workdir: Some(manifest.workdir.clone()),
    };
    record(log, session, what.frame(RESTORE_TURN)).await;
    let status = AppendRequest::new(FrameBody::TurnStatus {
        turn_id: RESTORE_TURN.into(),
        status: TurnStatus::Finished,
        error: None,
        code: None,
        sandbox,
        agent_session_id: manifest.agent_session_id.clone(),
        checkpoint: None,
    });
    record(log, session, Ok(status)).await;
}

/// `harness restore --tree-only`: the working tree alone, into an existing
/// session's sandbox.
async fn restore_tree(home: &Home, args: RestoreArgs) -> Result<()> {
    let Some(id) = &args.session else {
        bail!("--tree-only restores into an existing session: pass --session ID");
    };
    let log = open_log(home)?;
    let info = session_info(&log, id).await?;
    idle(&info)?;
    let lineages = args.store.open_lineages(home).await?;
    let (store, key) = resolve_for_restore(&lineages, &args.key).await?;
    let sandbox = session_sandbox(home, &info).await?;
    let bars = Arc::new(Bars::new());
    let restored = bars
        .during(
            format!(
                "restoring the tree {} (verified before anything is written)",
                args.key
            ),
            harness::moves::restore(
                store.as_ref(),
                &key,
                sandbox.as_ref(),
                sandbox.workdir(),
                Some(bars.clone()),
            ),
        )
        .await;
    let restored = match restored {
        Ok(restored) => restored,
        Err(e) if e.kind() == ErrorKind::NotFound => {
            let manifest = SessionKeys::new(&key).map(|k| k.manifest);
            let is_session = match &manifest {
                Ok(m) => store.head(m).await.is_ok(),
                Err(_) => false,
            };
            if is_session {
                bail!(
                    "{} is a session checkpoint (tree and agent state), not a tree-only one: \
                     restore it without --tree-only",
                    args.key
                );
            }
            bail!(
                "no checkpoint {:?} in the store: `harness ls` lists its keys",
                args.key
            );
        }
        Err(e) => {
            return Err(anyhow::Error::from(e)
                .context("restoring (nothing was changed if the checkpoint was refused)"))
        }
    };
    let what = MoveRecord {
        harness: "restore".into(),
        key: args.key.clone(),
        kind: "tree".into(),
        agent: None,
        agent_session_id: None,
        bytes: Some(restored.summary.content_bytes),
        from_workdir: None,
    };
    record(&log, &info.session, what.frame(RESTORE_TURN)).await;
    println!(
        "restored {} entries ({} bytes of files) into session {} (tree only)",
        restored.summary.entries, restored.summary.content_bytes, info.session
    );
    Ok(())
}

/// `harness gc`: delete the content blobs and packs no tree checkpoint in
/// the store references.
pub async fn gc(home: &Home, args: GcArgs) -> Result<()> {
    let lineages = args.store.open_lineages(home).await?;
    // Turn-end checkpoints no session of this home references, first: their
    // trees' content is then collected with the rest.
    let log = open_log(home)?;
    let mut referenced = std::collections::HashSet::new();
    for info in log.list().await? {
        let meta = &info.meta;
        referenced.extend(meta.checkpoint.clone());
        let skip = args
            .keep_last
            .map_or(0, |n| meta.checkpoints.len().saturating_sub(n));
        referenced.extend(meta.checkpoints.iter().skip(skip).map(|c| c.key.clone()));
    }
    // The plain store, then each encrypted lineage through its own view,
    // with the references that name it.
    let mut spaces = vec![(String::new(), lineages.raw().clone())];
    for lineage in lineages.list().await? {
        match lineages.lineage(&lineage) {
            Ok(view) => spaces.push((harness::moves::crypt::lineage_prefix(&lineage)?, view)),
            Err(e) => eprintln!("note: lineage {lineage} is left as it is: {e}"),
        }
    }
    for (prefix, store) in spaces {
        if !prefix.is_empty() {
            println!("lineage {prefix}:");
        }
        let referenced: std::collections::HashSet<String> = referenced
            .iter()
            .filter_map(|k| match prefix.as_str() {
                "" => harness::moves::crypt::split_lineage(k)
                    .is_none()
                    .then(|| k.clone()),
                p => k.strip_prefix(p).map(str::to_string),
            })
            .collect();
        gc_space(store.as_ref(), &referenced, &args).await?;
    }
    Ok(())
}

/// One space's collection: the plain store's, or one lineage's.
async fn gc_space(
    store: &dyn CheckpointStore,
    referenced: &std::collections::HashSet<String>,
    args: &GcArgs,
) -> Result<()> {
    let turns = harness::moves::turns::collect_turn_checkpoints(
        store,
        referenced,
        harness::core::clock::Clock::now_ms(&SystemClock),
        args.grace_secs.saturating_mul(1000),
    )
    .await
    .context("collecting unreferenced turn-end checkpoints")?;
    println!(
        "{} turn-end checkpoints: {} referenced by a session, {} younger than {} s, {} deleted",
        turns.found, turns.referenced, turns.young, args.grace_secs, turns.deleted
    );
    let info = harness::moves::tree::collect_garbage(store, &SystemClock)
        .await
        .context("collecting unreferenced blobs")?;
    println!(
        "{} tree checkpoints reference {} blobs and {} packs; deleted {} unreferenced blobs and {} packs ({} bytes)",
        info.manifests,
        info.blobs_kept,
        info.packs_kept,
        info.blobs_deleted,
        info.packs_deleted,
        info.bytes_freed
    );
    Ok(())
}

/// `harness ls`: the objects in the store, under `--prefix`.
pub async fn ls(home: &Home, args: LsArgs) -> Result<()> {
    let store = args.store.open(home).await?;
    for meta in store.list(&args.prefix).await? {
        println!(
            "{:>12}  {}  {}",
            meta.size,
            &meta.sha256[..12.min(meta.sha256.len())],
            meta.key
        );
    }
    Ok(())
}
