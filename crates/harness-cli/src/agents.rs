//! Finding (or downloading) the native agent binaries and building the
//! adapters around them.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use harness::core::harness::Harness;
use harness::core::ErrorKind;

use crate::helpers::Helper;
use crate::home::Home;
use crate::AgentKind;

struct Package {
    npm: &'static str,
    version: &'static str,
    /// The native executable inside the npm prefix.
    binary: &'static str,
}

fn package(kind: AgentKind) -> Package {
    match kind {
        AgentKind::ClaudeCode => Package {
            npm: "@anthropic-ai/claude-code",
            version: harness::claude_code::VERIFIED_VERSION,
            binary: "node_modules/@anthropic-ai/claude-code-linux-x64/claude",
        },
        AgentKind::Codex => Package {
            npm: "@openai/codex",
            version: harness::codex::VERIFIED_VERSION,
            binary:
                "node_modules/@openai/codex-linux-x64/vendor/x86_64-unknown-linux-musl/bin/codex",
        },
    }
}

/// The agent's native binary on this host: `$HARNESS_CLAUDE_BIN` /
/// `$HARNESS_CODEX_BIN`, the `cargo xtask agents` cache, an earlier download
/// in the CLI's home, or a fresh `npm install` (with a spinner).
pub async fn ensure_binary(home: &Home, kind: AgentKind) -> Result<PathBuf> {
    let located = match kind {
        AgentKind::ClaudeCode => harness::claude_code::locate_host_binary(),
        AgentKind::Codex => harness::codex::locate_host_binary(),
    };
    match located {
        Ok(path) => return Ok(path),
        Err(e) if e.kind() == ErrorKind::NotFound => {}
        Err(e) => return Err(e.into()),
    }
    let pkg = package(kind);
    let prefix = home
        .agents()
        .join(format!("{}-{}", kind.name(), pkg.version));
    let binary = prefix.join(pkg.binary);
    if binary.is_file() {
        return Ok(binary);
    }
    let spec = format!("{}@{}", pkg.npm, pkg.version);
    let bar = indicatif::ProgressBar::new_spinner();
    bar.set_style(
        indicatif::ProgressStyle::with_template("{spinner} {msg} [{elapsed}]")
            .expect("static template"),
    );
    bar.set_message(format!(
        "downloading {spec} from the npm registry (once; ~100 MB)"
    ));
    bar.enable_steady_tick(Duration::from_millis(120));
    std::fs::create_dir_all(&prefix)?;
    let mut npm = tokio::process::Command::new("npm");
    npm.args([
        "install",
        "--no-audit",
        "--no-fund",
        "--loglevel=error",
        "--prefix",
    ])
    .arg(&prefix)
    .arg(&spec);
    // `--prefix` also moves npm's global config to `<prefix>/etc/npmrc`, so
    // a `cafile` set there (Debian's `/usr/etc/npmrc`, as behind a registry
    // proxy) is not read; Node then trusts only its own CA list and the
    // install fails with SELF_SIGNED_CERT_IN_CHAIN. Adding the system's
    // bundle (never removing a CA; a caller's own setting is kept) makes
    // the install trust what the host trusts.
    if std::env::var_os("NODE_EXTRA_CA_CERTS").is_none()
        && std::path::Path::new(crate::serve_sandboxes::HOST_CA).is_file()
    {
        npm.env("NODE_EXTRA_CA_CERTS", crate::serve_sandboxes::HOST_CA);
    }
    let out = npm
        .output()
        .await
        .context("running npm (is Node.js installed? `apt-get install nodejs npm`)")?;
    bar.finish_and_clear();
    if !out.status.success() {
        bail!(
            "npm install {spec} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    if !binary.is_file() {
        bail!(
            "npm installed {spec} but {} is missing (not a linux-x64 host?)",
            binary.display()
        );
    }
    eprintln!("installed {spec} into {}", prefix.display());
    Ok(binary)
}

/// The helper `helper` as a recipe file (`crate::helpers`: an explicit
/// binary, else this multi-call binary under the helper's name).
fn load_helper(home: &Home, helper: Helper) -> Result<harness::claude_code::HelperBinary> {
    let path = crate::helpers::path(home, helper)?;
    harness::claude_code::HelperBinary::load(&path)
        .with_context(|| format!("loading {} from {}", helper.name(), path.display()))
}

/// The adapter for `kind` around the binary at `path`, with the approval
/// server and the host-tool bridge.
pub fn adapter(home: &Home, kind: AgentKind, path: PathBuf) -> Result<Arc<dyn Harness>> {
    let bridge = Some(load_helper(home, Helper::Relay)?);
    Ok(match kind {
        AgentKind::ClaudeCode => {
            let binary = harness::claude_code::AgentBinary::load(&path)?;
            let mut config = harness::claude_code::ClaudeCodeConfig::with_binary(binary);
            config.approvals = Some(load_helper(home, Helper::Approval)?);
            config.relay_bridge = bridge;
            Arc::new(harness::claude_code::ClaudeCodeHarness::new(config))
        }
        AgentKind::Codex => {
            let binary = harness::codex::AgentBinary::load(&path)?;
            let mut config = harness::codex::CodexConfig::with_binary(binary);
            config.relay_bridge = bridge;
            Arc::new(harness::codex::CodexHarness::new(config))
        }
    })
}
