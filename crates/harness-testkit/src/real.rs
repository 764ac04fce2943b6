//! The one rule for tests that need a real part (dockerd, S3, an agent
//! binary): skip with a printed reason on a developer machine that lacks it,
//! fail under CI, where `HARNESS_REQUIRE_REAL=1` promises every part is there.

/// True when missing real parts must fail tests instead of skipping them.
pub fn real_parts_required() -> bool {
    std::env::var("HARNESS_REQUIRE_REAL").is_ok_and(|v| v == "1")
}

/// Report a missing real part: panics under `HARNESS_REQUIRE_REAL=1`,
/// otherwise prints `skipped: <reason>` so the skip is visible in test
/// output. Callers return right after.
pub fn skip_or_fail(reason: &str) {
    if real_parts_required() {
        panic!("HARNESS_REQUIRE_REAL=1 but a real part is missing: {reason}");
    }
    eprintln!("skipped: {reason}");
    println!("skipped: {reason}");
}

/// The value of an environment variable naming a real part, or a
/// skip/failure if it is unset. `None` means: return from the test now.
pub fn require_env(var: &str) -> Option<String> {
    match std::env::var(var) {
        Ok(v) if !v.is_empty() => Some(v),
        _ => {
            skip_or_fail(&format!(
                "{var} is not set (run `cargo xtask ci`, or `cargo xtask env` for the variables)"
            ));
            None
        }
    }
}
