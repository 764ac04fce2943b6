//! Named points where a fault-injection run stops this process, so it can be
//! killed exactly there (`cargo xtask chaos`; see `docs/reliability.md`).
//!
//! `HARNESS_FAILPOINT=<name>` arms one point. The first time the process
//! reaches it, it writes `<name>` to the file `HARNESS_FAILPOINT_REACHED`
//! (when set) and to stderr, then blocks the thread that reached it for
//! good: the chaos driver sees the marker and sends SIGKILL. Points in the
//! windows a wall-clock delay cannot hit reliably (between claiming a turn's
//! spool and recording its agent's process, between the objects of a
//! checkpoint) are what this is for.
//!
//! Unset (every ordinary run), [`hit`] is one cached environment lookup. On
//! wasm32 there is no environment and no thread to block: it does nothing.

/// The points in the code, in the order a turn reaches them.
pub const POINTS: &[&str] = &[
    "create-to-record",
    "before-claim",
    "claim-to-launch",
    "launch-to-record",
    "checkpoint-upload",
];

/// Stop here for good when `name` is the armed point.
pub fn hit(name: &str) {
    #[cfg(not(target_arch = "wasm32"))]
    {
        static ARMED: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
        let armed = ARMED.get_or_init(|| {
            std::env::var("HARNESS_FAILPOINT")
                .ok()
                .filter(|s| !s.is_empty())
        });
        if armed.as_deref() != Some(name) {
            return;
        }
        debug_assert!(POINTS.contains(&name), "unlisted failpoint {name}");
        eprintln!("failpoint {name} reached; stopping here until killed");
        if let Some(path) = std::env::var_os("HARNESS_FAILPOINT_REACHED") {
            let _ = std::fs::write(path, name);
        }
        loop {
            std::thread::park();
        }
    }
    #[cfg(target_arch = "wasm32")]
    let _ = name;
}
