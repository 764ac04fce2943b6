//! `harness-approval-mcp`: see the library docs.

fn main() {
    let Some(dir) = std::env::var_os("HARNESS_RELAY_DIR").filter(|d| !d.is_empty()) else {
        eprintln!("harness-approval-mcp: HARNESS_RELAY_DIR is not set");
        std::process::exit(2);
    };
    let server = harness_approval_mcp::Server::new(dir);
    let stdin = std::io::stdin().lock();
    let stdout = std::io::stdout().lock();
    if let Err(e) = server.serve(stdin, stdout) {
        eprintln!("harness-approval-mcp: {e}");
        std::process::exit(1);
    }
}
