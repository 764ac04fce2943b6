//! What the boundary probes (`broker.rs` for local and Docker sandboxes,
//! `microvm.rs` for the microVM) share: how the real key travels into the
//! probe without appearing in its command line, and what every probe's
//! report must say.

use base64::Engine as _;

/// `bytes` base64-encoded: the probe decodes the keys it searches for into
/// a file, so neither its command line nor the agent's transcript holds
/// them.
pub fn base64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// What every probe reports from inside a sandbox that keeps the key out:
/// it ran to its end, the agent holds a broker token (not the key), the key
/// is in no process or file it searched (at least `min_processes`
/// processes), and the broker refused another session's token and another
/// session's endpoint.
pub fn assert_keeps_the_key_out(report: &str, min_processes: usize) {
    assert!(report.contains("PROBE-DONE"), "{report}");
    assert!(report.contains("TOKEN-NOT-KEY"), "{report}");
    assert!(
        !report.contains("KEY-IN-"),
        "the real key is inside the sandbox:\n{report}"
    );
    let searched: usize = report
        .lines()
        .find_map(|l| l.strip_prefix("PROCESSES-SEARCHED "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0);
    assert!(
        searched >= min_processes,
        "the probe saw {searched} processes: {report}"
    );
    assert!(report.contains("OTHER-TOKEN-401"), "{report}");
    assert!(report.contains("OTHER-SESSION-401"), "{report}");
}
