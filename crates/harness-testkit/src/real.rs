//! The one rule for tests that need a real part (dockerd, S3, an agent
//! binary): skip with a printed reason on a developer machine that lacks it,
//! fail under CI, where `HARNESS_REQUIRE_REAL=1` promises every part is there.

/// True when missing real parts must fail tests instead of skipping them.
pub fn real_parts_required() -> bool {
    std::env::var("HARNESS_REQUIRE_REAL").is_ok_and(|v| v == "1")
}

/// Report a missing real part: prints `skipped: <reason>` so the skip is
/// visible in test output, and records it for `cargo xtask ci`'s summary
/// (one `<test>\t<reason>` line appended to `$HARNESS_SKIP_LOG`). Under
/// `HARNESS_REQUIRE_REAL=1` it panics instead, unless the test is one of
/// `$HARNESS_ALLOWED_SKIPS` (comma-separated test names: xtask passes its
/// explicit, commented list in `xtask/src/skips.rs`). Callers return right
/// after.
pub fn skip_or_fail(reason: &str) {
    let test = current_test();
    let allowed = std::env::var("HARNESS_ALLOWED_SKIPS").ok();
    if !may_skip(real_parts_required(), allowed.as_deref(), &test) {
        panic!("HARNESS_REQUIRE_REAL=1 but a real part is missing: {reason}");
    }
    eprintln!("skipped: {reason}");
    println!("skipped: {reason}");
    if let Some(path) = std::env::var_os("HARNESS_SKIP_LOG") {
        use std::io::Write;
        // One short line per write: appends from parallel test processes
        // do not interleave.
        let line = format!("{test}\t{}\n", reason.replace(['\n', '\t'], " "));
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path);
        if let Ok(mut file) = file {
            let _ = file.write_all(line.as_bytes());
        }
    }
}

/// The running test's name: libtest (and nextest, which runs one test per
/// process through it) names the test's thread after the test.
fn current_test() -> String {
    std::thread::current()
        .name()
        .unwrap_or("unknown test")
        .to_string()
}

/// Whether `test` may skip: always unless real parts are `required`; then
/// only when `allowed` (`$HARNESS_ALLOWED_SKIPS`) names it, matched at the
/// end of its name.
fn may_skip(required: bool, allowed: Option<&str>, test: &str) -> bool {
    !required
        || allowed.is_some_and(|list| {
            list.split(',')
                .map(str::trim)
                .any(|allowed| !allowed.is_empty() && test.ends_with(allowed))
        })
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

#[cfg(test)]
mod tests {
    use super::may_skip;

    /// Under `HARNESS_REQUIRE_REAL=1` a planted skip no allowed name
    /// matches fails (an empty entry allows nothing); without it, any
    /// test may skip.
    #[test]
    fn a_skip_the_list_does_not_allow_fails_when_real_parts_are_required() {
        let planted = "planted::needs_a_part_ci_lacks";
        let list = "microsandbox_passes_the_sandbox_conformance_suite, ,";
        assert!(!may_skip(true, Some(list), planted));
        assert!(!may_skip(true, None, planted));
        assert!(!may_skip(true, Some(""), planted));
        assert!(may_skip(
            true,
            Some(&format!("{list},needs_a_part_ci_lacks")),
            planted
        ));
        assert!(
            !may_skip(true, Some("needs_a_part"), planted),
            "matched at the end only"
        );
        assert!(may_skip(false, None, planted));
    }
}
