//! Named points where a fault-injection run stops this process, so it can be
//! killed exactly there (`cargo xtask chaos`; see `docs/reliability.md`).
//!
//! Core only names the points and calls [`hit`] at each; what happens there
//! is the process's [`Hook`], installed once at start ([`install`]). The
//! `harness` binary installs `session_runtime::failpoints::from_env`:
//! `HARNESS_FAILPOINT=<name>` arms one point, which, when reached, writes
//! `<name>` to the file `HARNESS_FAILPOINT_REACHED` and blocks that thread
//! for good, for the chaos driver to send SIGKILL. Points in the windows a
//! wall-clock delay cannot hit reliably (between claiming a turn's spool and
//! recording its agent's process, between the objects of a checkpoint) are
//! what this is for. With no hook (a library user, wasm32), [`hit`] is one
//! atomic load.

use std::sync::OnceLock;

/// The points in the code, in the order a turn reaches them.
pub const POINTS: &[&str] = &[
    "create-to-record",
    "before-claim",
    "claim-to-launch",
    "launch-to-record",
    "checkpoint-upload",
];

/// What a process does at a failpoint.
pub type Hook = fn(&str);

static HOOK: OnceLock<Hook> = OnceLock::new();

/// Install this process's hook; the first one installed stays (false when
/// one was there already).
pub fn install(hook: Hook) -> bool {
    HOOK.set(hook).is_ok()
}

/// The code reached point `name`.
pub fn hit(name: &str) {
    debug_assert!(POINTS.contains(&name), "unlisted failpoint {name}");
    if let Some(hook) = HOOK.get() {
        hook(name);
    }
}
