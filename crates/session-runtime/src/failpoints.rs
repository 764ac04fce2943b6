//! The failpoint hook of a process that can be killed on purpose
//! (`cargo xtask chaos`, `docs/reliability.md`): core names the points
//! (`harness_core::failpoint`); this is what happens at one.

/// `HARNESS_FAILPOINT=<name>` arms one point: the first time the process
/// reaches it, it writes `<name>` to the file `HARNESS_FAILPOINT_REACHED`
/// (when set) and to stderr, then blocks the thread that reached it for
/// good — the chaos driver sees the marker and sends SIGKILL. Unset (every
/// ordinary run), a point costs one cached environment lookup.
pub fn from_env(name: &str) {
    static ARMED: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    let armed = ARMED.get_or_init(|| {
        std::env::var("HARNESS_FAILPOINT")
            .ok()
            .filter(|s| !s.is_empty())
    });
    if armed.as_deref() != Some(name) {
        return;
    }
    eprintln!("failpoint {name} reached; stopping here until killed");
    if let Some(path) = std::env::var_os("HARNESS_FAILPOINT_REACHED") {
        let _ = std::fs::write(path, name);
    }
    loop {
        std::thread::park();
    }
}

/// Install [`from_env`] as this process's failpoint hook.
pub fn install_from_env() {
    harness_core::failpoint::install(from_env);
}
