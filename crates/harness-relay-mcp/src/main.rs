//! `harness-relay-mcp`: see the library docs.

use std::process::ExitCode;

fn main() -> ExitCode {
    let config = match harness_relay_mcp::Config::from_env() {
        Ok(config) => config,
        Err(e) => {
            eprintln!("harness-relay-mcp: {e}");
            return ExitCode::from(2);
        }
    };
    // One thread is plenty: the work is waiting on stdin and on files, and
    // the sandbox may be small.
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("harness-relay-mcp: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let server = harness_relay_mcp::RelayServer::new(config);
    match runtime.block_on(server.serve_stdio()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("harness-relay-mcp: {e}");
            ExitCode::FAILURE
        }
    }
}
