//! How a long-running command (`serve`, `worker`, `runner`) is asked to
//! stop: Ctrl-C from a terminal, or SIGTERM from whatever supervises it
//! (systemd, `docker stop`, Kubernetes). Both shut it down the same way
//! (`serve` then shuts its sandbox providers down, so a Docker pool's ready
//! containers go with it instead of waiting for the next start's sweep).

/// Resolves when the process is asked to stop (SIGINT or SIGTERM).
pub async fn requested() {
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            // No handler could be installed: Ctrl-C alone.
            Err(_) => futures::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        () = terminate => {}
    }
}
