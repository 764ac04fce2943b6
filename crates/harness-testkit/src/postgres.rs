//! Tests against a real PostgreSQL (`cargo xtask services start` runs one;
//! `HARNESS_TEST_POSTGRES_URL` names it): each test in a database of its
//! own, so tests running side by side — and the sessions a killed node
//! leaves behind — never meet.

use std::sync::atomic::{AtomicUsize, Ordering};

/// The test server's URL, or `None` after a skip through the registry.
pub fn admin_url() -> Option<String> {
    match std::env::var("HARNESS_TEST_POSTGRES_URL") {
        Ok(url) if !url.is_empty() => Some(url),
        _ => {
            crate::skip_or_fail(
                "HARNESS_TEST_POSTGRES_URL is not set (cargo xtask services start; eval \"$(cargo xtask env)\")",
            );
            None
        }
    }
}

static DATABASES: AtomicUsize = AtomicUsize::new(0);

/// A new, empty database on the server of `admin` (a URL naming some
/// database); its URL.
pub async fn fresh_database(admin: &str) -> String {
    let name = format!(
        "harness_t{}_{}",
        std::process::id(),
        DATABASES.fetch_add(1, Ordering::SeqCst)
    );
    let (client, connection) = tokio_postgres::connect(admin, tokio_postgres::NoTls)
        .await
        .expect("the test PostgreSQL answers");
    let task = tokio::spawn(connection);
    // Two statements: a multi-statement string is one implicit
    // transaction, which neither may run in.
    for sql in [
        format!("DROP DATABASE IF EXISTS {name}"),
        format!("CREATE DATABASE {name}"),
    ] {
        client.batch_execute(&sql).await.expect("a test database");
    }
    drop(client);
    let _ = task.await;
    let (base, _) = admin.rsplit_once('/').expect("a URL with a database");
    format!("{base}/{name}")
}
