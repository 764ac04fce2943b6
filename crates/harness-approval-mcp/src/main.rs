//! `harness-approval-mcp`: see the library docs.

fn main() -> std::process::ExitCode {
    harness_approval_mcp::main()
}
