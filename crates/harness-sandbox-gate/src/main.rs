//! `harness-sandbox-gate`: see the library docs (`src/lib.rs`).

fn main() {
    harness_sandbox_gate::cli::main()
}
