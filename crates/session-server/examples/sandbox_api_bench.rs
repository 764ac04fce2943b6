//! `cargo xtask bench sandbox-api`: the sandbox API (`/v1/sandboxes`,
//! `docs/ai-sdk.md`) from Node through the npm package, next to the same
//! calls on the provider in Rust, in the same run, for Docker and local:
//!
//! - time to a first command: `createSession` + `run('true')` against
//!   `create` + `exec(bash -c true)`;
//! - an exec round trip (`bash -c true`), median of `BENCH_N` (30);
//! - a 64 MiB file (`BENCH_MIB`) written and read back, in MiB/s.
//!
//! The direct sandbox is made with the spec the API gives its own (the
//! proxy's forward, so every exec goes through the same gate; the same
//! environment), so the ratio is the API's cost: HTTP, the SSE framing,
//! Node. Targets: ≤ 1.2× + 2 ms per call, ≥ 80 % of the direct
//! throughput for files.
//!
//! ```text
//! cargo run --release -p session-server --example sandbox_api_bench
//! ```
//! Needs dockerd and `HARNESS_TEST_IMAGE`, Node 22 (`HARNESS_NODE22`) and
//! the package's dependencies (npm, once per lockfile into
//! `$HARNESS_CACHE/npm/ai-sdk-<hash>`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use futures::StreamExt;
use harness_core::sandbox::{
    collect_exec, ExecRequest, HostForward, SandboxProvider, SandboxSpec, EGRESS_PROXY_PORT,
};
use session_server::sandboxes::SandboxRegistry;
use sha2::Digest;

const TOOLS_IN_CONTAINER: &str = "/opt/harness/tools";

fn cache_dir() -> PathBuf {
    std::env::var_os("HARNESS_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| "/var/cache/harness".into())
}

fn package_dir() -> PathBuf {
    harness_testkit::checkout::path("packages/ai-sdk")
}

/// The npm package built from this checkout into a temp dir; the bench
/// script beside its `dist/`.
fn build_package(node: &Path, dir: &Path) -> Result<()> {
    let lock = std::fs::read(package_dir().join("package-lock.json"))?;
    let hash = hex::encode(sha2::Sha256::digest(&lock));
    let cached = cache_dir()
        .join("npm")
        .join(format!("ai-sdk-{}", &hash[..12]));
    if !cached.join(".harness-complete").is_file() {
        std::fs::create_dir_all(&cached)?;
        for file in ["package.json", "package-lock.json"] {
            std::fs::copy(package_dir().join(file), cached.join(file))?;
        }
        let ok = Command::new("npm")
            .args(["ci", "--no-audit", "--no-fund", "--ignore-scripts"])
            .current_dir(&cached)
            .status()?
            .success();
        if !ok {
            bail!("npm ci of packages/ai-sdk failed");
        }
        std::fs::write(cached.join(".harness-complete"), "")?;
    }
    for file in ["package.json", "tsconfig.json"] {
        std::fs::copy(package_dir().join(file), dir.join(file))?;
    }
    std::fs::create_dir_all(dir.join("src"))?;
    for entry in std::fs::read_dir(package_dir().join("src"))? {
        let entry = entry?;
        std::fs::copy(entry.path(), dir.join("src").join(entry.file_name()))?;
    }
    std::os::unix::fs::symlink(cached.join("node_modules"), dir.join("node_modules"))?;
    let ok = Command::new(node)
        .args(["node_modules/typescript/bin/tsc", "-p", "tsconfig.json"])
        .current_dir(dir)
        .status()?
        .success();
    if !ok {
        bail!("tsc failed");
    }
    std::fs::write(dir.join("bench.mjs"), include_str!("sandbox_api_bench.mjs"))?;
    Ok(())
}

#[derive(Debug, Default)]
struct Figures {
    first_command_ms: f64,
    exec_median_ms: f64,
    write_mib_s: f64,
    read_mib_s: f64,
}

fn median_figures(all: &[Figures]) -> Figures {
    let pick = |f: fn(&Figures) -> f64| median(all.iter().map(f).collect());
    Figures {
        first_command_ms: pick(|f| f.first_command_ms),
        exec_median_ms: pick(|f| f.exec_median_ms),
        write_mib_s: pick(|f| f.write_mib_s),
        read_mib_s: pick(|f| f.read_mib_s),
    }
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1000.0
}

async fn direct(
    provider: &dyn SandboxProvider,
    spec: &SandboxSpec,
    n: usize,
    mib: usize,
) -> Result<Figures> {
    let started = Instant::now();
    let sandbox = provider.create(spec).await?;
    let out = collect_exec(
        sandbox
            .exec(ExecRequest::new(["bash", "-c", "true"]))
            .await?,
    )
    .await?;
    let first_command_ms = ms(started);
    if !out.status.success() {
        bail!("true failed: {:?}", out.status);
    }
    let mut exec = Vec::new();
    for _ in 0..n {
        let t = Instant::now();
        let out = collect_exec(
            sandbox
                .exec(ExecRequest::new(["bash", "-c", "true"]))
                .await?,
        )
        .await?;
        exec.push(ms(t));
        if !out.status.success() {
            bail!("true failed");
        }
    }
    let size = mib << 20;
    let path = format!("{}/bench.bin", sandbox.workdir());
    let chunk = bytes::Bytes::from(vec![7u8; 1 << 20]);
    let body: harness_core::stream::ByteStream = Box::pin(futures::stream::iter(
        (0..mib).map(move |_| Ok(chunk.clone())),
    ));
    let t = Instant::now();
    sandbox.write_file(&path, body).await?;
    let write_mib_s = mib as f64 / (ms(t) / 1000.0);
    let t = Instant::now();
    let mut stream = sandbox.read_file(&path).await?;
    let mut read = 0;
    while let Some(chunk) = stream.next().await {
        read += chunk?.len();
    }
    let read_mib_s = mib as f64 / (ms(t) / 1000.0);
    if read != size {
        bail!("read {read} of {size}");
    }
    sandbox.destroy().await?;
    Ok(Figures {
        first_command_ms,
        exec_median_ms: median(exec),
        write_mib_s,
        read_mib_s,
    })
}

async fn through_api(
    node: &Path,
    dir: &Path,
    url: &str,
    provider: &str,
    image: &str,
    n: usize,
    mib: usize,
) -> Result<Figures> {
    let args =
        serde_json::json!({"url": url, "provider": provider, "image": image, "n": n, "mib": mib});
    let out = tokio::process::Command::new(node)
        .arg("bench.mjs")
        .arg(args.to_string())
        .current_dir(dir)
        .output()
        .await?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let Some(result) = stdout.lines().find_map(|l| l.strip_prefix("RESULT ")) else {
        bail!(
            "the Node half failed ({}): {stdout}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let v: serde_json::Value = serde_json::from_str(result)?;
    let f = |k: &str| v[k].as_f64().unwrap_or(f64::NAN);
    Ok(Figures {
        first_command_ms: f("firstCommandMs"),
        exec_median_ms: f("execMedianMs"),
        write_mib_s: f("writeMibS"),
        read_mib_s: f("readMibS"),
    })
}

fn report(provider: &str, direct: &Figures, api: &Figures) {
    println!(
        "\n{provider}: through the API from Node vs the provider in Rust (medians of the rounds)"
    );
    println!("| call | Rust, direct | Node, API | ratio | target |");
    println!("|---|---:|---:|---:|---|");
    let call = |what: &str, d: f64, a: f64| {
        let ok = a <= 1.2 * d + 2.0;
        println!(
            "| {what} | {d:.1} ms | {a:.1} ms | {:.2}× | ≤ 1.2× + 2 ms: {} |",
            a / d,
            if ok { "met" } else { "missed" }
        );
    };
    call(
        "first command after create",
        direct.first_command_ms,
        api.first_command_ms,
    );
    call(
        "exec round trip (median)",
        direct.exec_median_ms,
        api.exec_median_ms,
    );
    let rate = |what: &str, d: f64, a: f64| {
        println!(
            "| {what} | {d:.0} MiB/s | {a:.0} MiB/s | {:.0} % | ≥ 80 %: {} |",
            100.0 * a / d,
            if a >= 0.8 * d { "met" } else { "missed" }
        );
    };
    rate("write 64 MiB", direct.write_mib_s, api.write_mib_s);
    rate("read 64 MiB", direct.read_mib_s, api.read_mib_s);
}

#[tokio::main]
async fn main() -> Result<()> {
    let n: usize = std::env::var("BENCH_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(30);
    let mib: usize = std::env::var("BENCH_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64);
    let image =
        std::env::var("HARNESS_TEST_IMAGE").unwrap_or_else(|_| "harness-test:bookworm".into());
    let node = std::env::var_os("HARNESS_NODE22")
        .map(PathBuf::from)
        .unwrap_or_else(|| cache_dir().join("tools/node22/bin/node"));
    if !node.is_file() {
        bail!("no Node 22 at {} (cargo xtask deps)", node.display());
    }
    let tools = node
        .parent()
        .and_then(Path::parent)
        .context("the tools directory")?
        .to_path_buf();
    let gate = harness_testkit::gate_binary().context("the sandbox gate")?;
    let work = tempfile::tempdir()?;
    let pkg = work.path().join("pkg");
    std::fs::create_dir_all(&pkg)?;
    build_package(&node, &pkg)?;

    let mut config = sandbox_docker::DockerConfig {
        default_image: image.clone(),
        gate: Some(gate),
        ..Default::default()
    };
    config.bind_mounts.push(sandbox_docker::BindMount {
        host: tools.display().to_string(),
        container: TOOLS_IN_CONTAINER.into(),
        read_only: true,
    });
    let docker: Arc<dyn SandboxProvider> =
        Arc::new(sandbox_docker::DockerProvider::connect(config).await?);
    let local: Arc<dyn SandboxProvider> =
        Arc::new(sandbox_local::LocalProvider::new(work.path().join("local")));
    let docker_env = BTreeMap::from([(
        "PATH".to_string(),
        format!(
            "{TOOLS_IN_CONTAINER}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        ),
    )]);
    let local_env = BTreeMap::from([(
        "PATH".to_string(),
        format!(
            "{}:{}",
            tools.join("bin").display(),
            std::env::var("PATH").unwrap_or_default()
        ),
    )]);
    let api = SandboxRegistry::new(work.path().join("api"))
        .provider("docker", docker.clone())
        .provider_env("docker", docker_env.clone())
        .provider("local", local.clone())
        .provider_env("local", local_env.clone())
        .auth(Vec::new(), true)
        .start()
        .await?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    let router = api.router();
    tokio::spawn(async move { axum::serve(session_server::no_delay(listener), router).await });

    // The forward every API container has (the sandbox's proxy), here to
    // a socket nothing uses: the same gate in front of every exec.
    let sock_dir = work.path().join("sock");
    std::fs::create_dir_all(&sock_dir)?;
    let _sock = tokio::net::UnixListener::bind(sock_dir.join("egress.sock"))?;
    let mut docker_spec = SandboxSpec::new("/workspace");
    docker_spec.image = Some(image.clone());
    docker_spec.env = docker_env;
    docker_spec.ports = vec![4000];
    docker_spec.forwards.push(HostForward {
        port: EGRESS_PROXY_PORT,
        socket: sock_dir.join("egress.sock").display().to_string(),
    });
    let mut local_spec = SandboxSpec::new("/workspace");
    local_spec.env = local_env;
    local_spec.ports = vec![4000];

    println!(
        "sandbox API bench: exec round trips n={n}, files {mib} MiB, Node {}",
        node.display()
    );
    for (name, provider, spec) in [
        ("docker", &docker, &docker_spec),
        ("local", &local, &local_spec),
    ] {
        // One warm-up, then rounds that alternate the two sides, so a busy
        // moment of the machine (dockerd's exec time moves with it) falls
        // on both; the figure is the median of the rounds.
        let _ = direct(provider.as_ref(), spec, 1, 1).await?;
        let rounds: usize = std::env::var("BENCH_ROUNDS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(3);
        let (mut ds, mut as_) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            ds.push(direct(provider.as_ref(), spec, n, mib).await?);
            as_.push(through_api(&node, &pkg, &url, name, &image, n, mib).await?);
        }
        report(name, &median_figures(&ds), &median_figures(&as_));
    }
    Ok(())
}
