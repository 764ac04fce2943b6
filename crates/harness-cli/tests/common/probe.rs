//! What the boundary probes (`broker.rs` for local and Docker sandboxes,
//! `microvm.rs` for the microVM) share: how the real key travels into the
//! probe without appearing in its command line, and what every probe's
//! report must say.

use base64::Engine as _;

/// Shell lines that put `keys` (one per line) into the file `$k`. They
/// travel base64-encoded, so neither the probe's command line nor the
/// agent's transcript holds them; the probe empties `$k` when done.
pub fn keys_into_file(keys: &[&str]) -> String {
    let lines: String = keys.iter().map(|k| format!("{k}\n")).collect();
    let encoded = base64::engine::general_purpose::STANDARD.encode(lines);
    format!("k=/tmp/harness-probe-keys.$$; printf %s '{encoded}' | base64 -d > $k")
}

/// The model API a probe's broker checks speak.
#[derive(Debug, Clone, Copy)]
pub enum ProbeApi {
    Anthropic,
    OpenAi,
}

/// Shell lines that ask the broker (at the sandbox's `127.0.0.1:47811`)
/// with `other_token`, another session's valid token, on this session's
/// endpoint (`OTHER-TOKEN-<status>`) and on that session's
/// (`OTHER-SESSION-<status>`, with the reason when nothing answers), and
/// say `TOKEN-NOT-KEY` when the agent's own key is a broker token.
pub fn broker_refusals(api: ProbeApi, other_session: &str, other_token: &str) -> String {
    let (auth, base, key, own_path, name, other_path) = match api {
        ProbeApi::Anthropic => (
            "x-api-key: %s",
            "ANTHROPIC_BASE_URL",
            "ANTHROPIC_API_KEY",
            "v1/messages",
            "anthropic",
            "v1/messages",
        ),
        ProbeApi::OpenAi => (
            "authorization: Bearer %s",
            "OPENAI_BASE_URL",
            "OPENAI_API_KEY",
            "responses",
            "openai",
            "v1/responses",
        ),
    };
    format!(
        r#"status() {{ timeout 5 bash -c 'exec 3<>/dev/tcp/127.0.0.1/47811 || exit 1
  printf "POST %s HTTP/1.1\r\nhost: 127.0.0.1\r\n{auth}\r\ncontent-type: application/json\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{{}}" "$0" "$1" >&3
  head -1 <&3' "$1" "$2" | cut -d" " -f2; }}
own=${{{base}#http://127.0.0.1:47811}}
echo "OTHER-TOKEN-$(status $own/{own_path} '{other_token}')"
other=$(status /s/{other_session}/{name}/{other_path} '{other_token}')
echo "OTHER-SESSION-$other"
# No status line: say why (a connection refused, reset or closed), so a
# failure of the assertion on it explains itself.
[ -n "$other" ] || echo "OTHER-SESSION-NO-ANSWER: $(timeout 5 bash -c 'exec 3<>/dev/tcp/127.0.0.1/47811 && echo connects-now' 2>&1)"
case "${key}" in hsb1_*) echo TOKEN-NOT-KEY;; esac"#
    )
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

/// A valid token of `session`, another session mid-turn in the harness
/// home `home`: the test is the host, so it lays down the broker's secret
/// itself (before the broker starts), marks the session active and signs
/// the token.
pub fn other_session_token(home: &std::path::Path, session: &str) -> String {
    let broker_dir = home.join("broker");
    std::fs::create_dir_all(broker_dir.join("active")).unwrap();
    let secret: Vec<u8> = (0..32u8)
        .map(|i| i.wrapping_mul(37).wrapping_add(11))
        .collect();
    std::fs::write(broker_dir.join("secret"), &secret).unwrap();
    std::fs::write(broker_dir.join("active").join(session), b"").unwrap();
    harness::broker::token::token_for(&secret, session)
}
