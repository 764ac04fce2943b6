//! The session-API suite (harness-testkit) against session-server: the
//! same cases the Cloudflare Worker passes under `wrangler dev`
//! (crates/harness-worker/tests/wrangler.rs), so one client talks to
//! either. The server runs no engine, as the Worker does not yet: a prompt
//! is stored and its turn stays open.

use std::sync::Arc;

use harness_testkit::conformance::session_api::{self, Target};
use session_server::{ServerConfig, SessionServer, TokenGrant};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_server_speaks_the_session_api() {
    let dir = tempfile::tempdir().unwrap();
    let log = Arc::new(session_log::SqliteSessionLog::open(dir.path().join("s.db")).unwrap());
    let mut config = ServerConfig::new(log);
    config.tokens = serde_json::from_value::<Vec<TokenGrant>>(session_api::token_table()).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(SessionServer::new(config).serve(listener));
    session_api::run_all(&Target::new(base, "s")).await;
}
