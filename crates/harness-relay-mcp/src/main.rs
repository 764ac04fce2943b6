//! `harness-relay-mcp`: see the library docs.

fn main() -> std::process::ExitCode {
    harness_relay_mcp::main()
}
