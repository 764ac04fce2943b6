//! `harness checkpoint|restore|ls`: moving a session's working tree through
//! an S3/R2 store, with progress bars.

use std::sync::Arc;

use anyhow::{Context, Result};
use harness::core::checkpoint::CheckpointStore;
use harness::core::moves::{MovePhase, MoveProgress};
use harness::r2::{S3CheckpointStore, S3Config};

use crate::home::Home;

/// Where the store is.
#[derive(Debug, clap::Args)]
pub struct StoreArgs {
    /// S3 endpoint (e.g. http://127.0.0.1:8333); for R2 use --r2-account.
    #[arg(long, env = "HARNESS_S3_ENDPOINT")]
    endpoint: Option<String>,
    /// Cloudflare account id: selects the R2 endpoint, region `auto`.
    #[arg(long, env = "HARNESS_R2_ACCOUNT_ID")]
    r2_account: Option<String>,
    /// Bucket.
    #[arg(long, env = "HARNESS_S3_BUCKET", default_value = "harness-checkpoints")]
    bucket: String,
    /// Region (ignored for R2).
    #[arg(long, env = "AWS_REGION", default_value = "us-east-1")]
    region: String,
}

impl StoreArgs {
    async fn open(&self) -> Result<S3CheckpointStore> {
        let key = std::env::var("AWS_ACCESS_KEY_ID").unwrap_or_else(|_| "harness".into());
        let secret = std::env::var("AWS_SECRET_ACCESS_KEY").unwrap_or_else(|_| "harness".into());
        let config = match (&self.r2_account, &self.endpoint) {
            (Some(account), _) => S3Config::r2(account, key, secret, &self.bucket),
            (None, Some(endpoint)) => S3Config::custom(endpoint, &self.region, key, secret, &self.bucket),
            (None, None) => anyhow::bail!(
                "no checkpoint store: pass --endpoint URL (or $HARNESS_S3_ENDPOINT) for S3, or --r2-account ID for R2"
            ),
        };
        let store = S3CheckpointStore::new(config)?;
        store
            .ensure_bucket()
            .await
            .context("reaching the checkpoint store")?;
        Ok(store)
    }
}

/// `harness checkpoint`.
#[derive(Debug, clap::Args)]
pub struct CheckpointArgs {
    /// The session whose working tree to checkpoint.
    #[arg(long)]
    session: String,
    /// Checkpoint key (default: sessions/<session>/<turns>.tar.zst).
    #[arg(long)]
    key: Option<String>,
    #[command(flatten)]
    store: StoreArgs,
}

/// `harness restore`.
#[derive(Debug, clap::Args)]
pub struct RestoreArgs {
    /// The session whose sandbox receives the tree.
    #[arg(long)]
    session: String,
    /// Checkpoint key.
    #[arg(long)]
    key: String,
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

/// Progress bars for the phases of a move.
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

/// A session of the home, as its log tells it (config, sandbox, turns).
async fn session_info(home: &Home, id: &str) -> Result<harness::core::log::LogInfo> {
    use harness::core::log::SessionLog;
    let log = harness::sqlite::SqliteSessionLog::open(home.db())?;
    let session = harness::core::SessionId::parse(id)?;
    log.info(&session).await.map_err(|e| {
        if e.kind() == harness::core::ErrorKind::NotFound {
            anyhow::anyhow!("unknown session {id:?}: `harness sessions list` shows the known ones")
        } else {
            e.into()
        }
    })
}

async fn session_sandbox(
    home: &Home,
    id: &str,
) -> Result<Box<dyn harness::core::sandbox::Sandbox>> {
    let info = session_info(home, id).await?;
    let handle = info.meta.sandbox.clone().with_context(|| {
        format!("session {id} has no sandbox yet: its first turn makes it (`harness run --session {id} PROMPT`)")
    })?;
    let provider = crate::local::provider(home, &handle.provider, None).await?;
    provider
        .resume(&handle)
        .await
        .with_context(|| format!("reattaching to the sandbox of {id}"))
}

/// Run `harness checkpoint`.
pub async fn checkpoint(home: &Home, args: CheckpointArgs) -> Result<()> {
    let info = session_info(home, &args.session).await?;
    let key = args
        .key
        .unwrap_or_else(|| format!("sessions/{}/turn-{}.tar.zst", info.session, info.meta.turns));
    let store = args.store.open().await?;
    let sandbox = session_sandbox(home, &args.session).await?;
    let info = harness::core::moves::checkpoint(
        sandbox.as_ref(),
        sandbox.workdir(),
        &store,
        &key,
        Some(Arc::new(Bars::new())),
    )
    .await
    .context("checkpointing")?;
    println!(
        "checkpoint {}: {} bytes of tar as {} bytes of zstd, sha256 {}",
        info.object.key, info.tar_bytes, info.object.size, info.object.sha256
    );
    Ok(())
}

/// Run `harness restore`.
pub async fn restore(home: &Home, args: RestoreArgs) -> Result<()> {
    let store = args.store.open().await?;
    let sandbox = session_sandbox(home, &args.session).await?;
    let info = harness::core::moves::restore(
        &store,
        &args.key,
        sandbox.as_ref(),
        sandbox.workdir(),
        Some(Arc::new(Bars::new())),
    )
    .await
    .context("restoring (nothing was changed if the checkpoint was refused)")?;
    println!(
        "restored {} entries ({} bytes of files) into session {}",
        info.summary.entries, info.summary.content_bytes, args.session
    );
    Ok(())
}

/// Run `harness ls`.
pub async fn ls(args: LsArgs) -> Result<()> {
    let store = args.store.open().await?;
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
