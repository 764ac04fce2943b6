//! Run the session server on a SQLite log.
//!
//! ```text
//! cargo run -p session-server --example serve -- \
//!     --db /tmp/sessions.db --addr 127.0.0.1:8787 --token secret
//! cargo run -p session-server --example serve -- --db /tmp/s.db --insecure-no-auth
//! ```
//!
//! `--token T` grants T the host role on every session; repeat `--grant
//! TOKEN:SCOPE:ROLE` (scope `*` or a session id, role client|runner|host)
//! for narrower tokens. Prints `listening on http://ADDR` once bound (port 0
//! picks a free port).

use std::sync::Arc;
use std::time::Duration;

use session_log::SqliteSessionLog;
use session_server::{serve, GrantRole, Scope, ServerConfig, TokenGrant};

fn usage() -> ! {
    eprintln!(
        "usage: serve --db PATH [--addr HOST:PORT] [--token T]... [--grant TOKEN:SCOPE:ROLE]... \
         [--insecure-no-auth] [--idle-secs N] [--max-frame-bytes N]"
    );
    std::process::exit(2)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut db = None;
    let mut addr = "127.0.0.1:8787".to_string();
    let mut tokens = Vec::new();
    let mut insecure = false;
    let mut idle = 30;
    let mut max_frame = harness_core::log::DEFAULT_MAX_FRAME_BYTES;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || args.next().unwrap_or_else(|| usage());
        match arg.as_str() {
            "--db" => db = Some(value()),
            "--addr" => addr = value(),
            "--token" => tokens.push(TokenGrant::new(value(), Scope::All, GrantRole::Host)),
            "--grant" => {
                let v = value();
                let parts: Vec<&str> = v.splitn(3, ':').collect();
                let [token, scope, role] = parts[..] else {
                    usage()
                };
                let role: GrantRole = serde_json::from_value(serde_json::json!(role))?;
                tokens.push(TokenGrant::new(token, Scope::parse(scope)?, role));
            }
            "--insecure-no-auth" => insecure = true,
            "--idle-secs" => idle = value().parse()?,
            "--max-frame-bytes" => max_frame = value().parse()?,
            _ => usage(),
        }
    }
    let Some(db) = db else { usage() };
    let log = SqliteSessionLog::open(&db)?.with_max_frame_bytes(max_frame);
    let mut config = ServerConfig::new(Arc::new(log));
    config.tokens = tokens;
    config.insecure_no_auth = insecure;
    config.idle_timeout = Duration::from_secs(idle);
    config.max_frame_bytes = max_frame;
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    println!("listening on http://{}", listener.local_addr()?);
    serve(listener, config).await?;
    Ok(())
}
