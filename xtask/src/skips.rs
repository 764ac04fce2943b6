//! The only tests CI lets go unrun. `cargo xtask ci` names every skipped
//! test in its closing summary and fails on any that is not listed here, so
//! a test that quietly stops running is a red build, not a green one.

/// `#[ignore]`d tests, as `cargo nextest list` names them. Each is the
/// child half of a cross-process test: its parent test starts it as a
/// separate process (with the environment it needs) and checks its result.
pub const IGNORED: &[(&str, &str)] = &[
    (
        "harness-claude-code::e2e child::resume_and_run_next_turn",
        "started by cross_process_resume: resumes a detached turn from a second process",
    ),
    (
        "harness-codex::e2e child::resume_and_run_next_turn",
        "started by cross_process_resume: resumes a detached turn from a second process",
    ),
    (
        "sandbox-microvm::microvm child_creates_a_vm",
        "started by a_vm_outlives_the_process_that_made_it as the process that makes the VM and exits",
    ),
    (
        "harness-tario tests::unpack_child",
        "started by read_only_directories_take_their_entries_and_keep_their_modes as a process \
         of the user `nobody` (root writes into a read-only directory: the test would test nothing)",
    ),
    (
        "sandbox-local::local child_entry",
        "started by the cross-process tests of sandbox-local as their second process",
    ),
];

/// Tests allowed to skip for a missing real part while CI requires real
/// parts (test names, matched at the end: `module::test` is enough).
/// Every real part the tests use is installed by `cargo xtask deps`, except
/// hardware some machines lack (a provider that needs a KVM that can boot a
/// guest) and a case the local Workflows runtime cannot host are listed
/// here, with the reason.
pub const ALLOWED_SKIPS: &[(&str, &str)] = &[
    (
        "microsandbox_passes_the_sandbox_conformance_suite",
        "sandbox-microvm feature `microsandbox` (not built by ci; `cargo xtask extra` checks it \
         compiles): libkrun needs a KVM that boots a guest, and the CI machines' kvm_pvm stops \
         it with KVM_EXIT_INTERNAL_ERROR; the test's boot probe skips with that reason",
    ),
    (
        "the_workflows_engine_passes_the_engine_suite",
        "its one case a_killed_engine_is_resumed_by_the_next (the rest of the suite runs): \
         `wrangler dev`'s local Workflows do not resume an instance after a restart; \
         crates/durable-workflows/tests/replay.rs shows what a resumed instance does",
    ),
];
