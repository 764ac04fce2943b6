//! The reference Durable Streams server (npm `@durable-streams/server`) as
//! a Node child process, and our routers on their own runtime: shared by
//! the benchmarks (`ds_bench`, `bench`).
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

/// The reference server version the numbers in the docs were measured with.
pub const REFERENCE_VERSION: &str = "0.3.7";

/// Starts the reference server on an ephemeral port and prints its URL.
/// The package is imported by absolute file URL so the launcher can live
/// anywhere.
pub const LAUNCHER: &str = r#"const { DurableStreamTestServer } = await import(process.env.DS_REFERENCE_ENTRY)
const dataDir = process.env.DS_DATA_DIR || undefined
const server = new DurableStreamTestServer({ port: 0, host: "127.0.0.1", dataDir })
const url = await server.start()
console.log("LISTENING " + url)
"#;

/// A running server; dropping it stops it.
#[derive(Debug)]
pub enum Server {
    Ours(Option<tokio::runtime::Runtime>),
    Reference(Child),
}

impl Drop for Server {
    fn drop(&mut self) {
        match self {
            // `shutdown_background` does not block, so this may run inside
            // the client's runtime (a plain drop of a runtime there panics).
            Server::Ours(rt) => {
                if let Some(rt) = rt.take() {
                    rt.shutdown_background();
                }
            }
            Server::Reference(child) => {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
}

/// A listener on a free loopback port, its base URL, and a 2-thread
/// runtime of its own to serve it on (like a separate process would).
pub fn listener_and_runtime(
    thread_name: &str,
) -> anyhow::Result<(std::net::TcpListener, String, tokio::runtime::Runtime)> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    listener.set_nonblocking(true)?;
    let base = format!("http://{}", listener.local_addr()?);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name(thread_name)
        .enable_all()
        .build()?;
    Ok((listener, base, rt))
}

/// Serve `app` on its own 2-thread runtime (like a separate process would).
pub fn serve_ours(app: axum::Router) -> anyhow::Result<(String, Server)> {
    let (listener, base, rt) = listener_and_runtime("ours-server")?;
    rt.spawn(async move {
        let listener = tokio::net::TcpListener::from_std(listener).expect("listener");
        // As `SessionServer::serve` does: TCP_NODELAY on every connection.
        axum::serve(session_server::no_delay(listener), app)
            .await
            .expect("serve");
    });
    Ok((base, Server::Ours(Some(rt))))
}

/// Install (once) the reference server into the npm cache directory.
pub fn install_reference() -> anyhow::Result<PathBuf> {
    let cache = std::env::var("HARNESS_CACHE").unwrap_or_else(|_| "/var/cache/harness".into());
    let dir = Path::new(&cache).join("npm").join("ds-reference");
    let pkg = dir.join("node_modules/@durable-streams/server");
    let pinned = std::fs::read_to_string(pkg.join("package.json"))
        .is_ok_and(|s| s.contains(&format!("\"version\": \"{REFERENCE_VERSION}\"")));
    if !pinned {
        std::fs::create_dir_all(&dir)?;
        let status = Command::new("npm")
            .args(["install", "--no-audit", "--no-fund", "--prefix"])
            .arg(&dir)
            .arg(format!("@durable-streams/server@{REFERENCE_VERSION}"))
            .status()
            .map_err(|e| anyhow::anyhow!("run npm: {e}"))?;
        anyhow::ensure!(
            status.success(),
            "npm install into {} failed: {status}",
            dir.display()
        );
    }
    Ok(pkg.join("dist/index.js"))
}

/// Start the reference server as a Node child and wait for its URL.
pub fn serve_reference(
    entry: &Path,
    launcher: &Path,
    data_dir: Option<&Path>,
) -> anyhow::Result<(String, Server)> {
    use std::io::BufRead;
    let mut cmd = Command::new("node");
    cmd.arg(launcher)
        .env("DS_REFERENCE_ENTRY", format!("file://{}", entry.display()))
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    if let Some(d) = data_dir {
        cmd.env("DS_DATA_DIR", d);
    }
    let mut child = cmd.spawn().map_err(|e| anyhow::anyhow!("run node: {e}"))?;
    let stdout = child.stdout.take().expect("piped stdout");
    let server = Server::Reference(child);
    // Bounded: the launcher prints one line, or exits (EOF) on failure.
    let mut lines = std::io::BufReader::new(stdout).lines();
    for line in lines.by_ref().take(50) {
        let line = line?;
        if let Some(url) = line.strip_prefix("LISTENING ") {
            // Keep draining stdout so the child never blocks on a full pipe.
            std::thread::spawn(move || for _ in lines {});
            return Ok((url.trim().to_string(), server));
        }
    }
    anyhow::bail!("the reference server exited without printing its URL")
}
