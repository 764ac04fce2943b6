//! Small helpers the protocol needs: base64 (SSE over binary streams),
//! RFC 3339 timestamps (`Stream-Expires-At`) (the `base64` and `chrono`
//! crates underneath), query strings (core's one decoder, re-exported)
//! and cursors.

pub use harness_core::query::{percent_decode, query_pairs};

/// Standard base64 with padding.
pub fn base64(data: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(data)
}

/// Parse an RFC 3339 / ISO 8601 timestamp (`2026-01-02T03:04:05.678Z`,
/// `…+01:00`) into milliseconds since the Unix epoch, also taking the
/// shorter forms ECMAScript's `Date.parse` takes (no seconds, no zone — read
/// as UTC, since a server has no meaningful local zone — or a date alone).
/// `None` for anything else.
pub fn parse_rfc3339_ms(raw: &str) -> Option<i64> {
    use chrono::{DateTime, NaiveDate, NaiveDateTime};
    let s = raw.trim();
    if let Ok(t) = DateTime::parse_from_rfc3339(s) {
        return Some(t.timestamp_millis());
    }
    // chrono's formats take the same separators RFC 3339 allows.
    let s = s.replacen(['t', ' '], "T", 1);
    let s = s
        .strip_suffix(['Z', 'z'])
        .map_or(s.clone(), |u| format!("{u}+00:00"));
    for format in ["%Y-%m-%dT%H:%M%:z", "%Y-%m-%dT%H:%M:%S%.f%:z"] {
        if let Ok(t) = DateTime::parse_from_str(&s, format) {
            return Some(t.timestamp_millis());
        }
    }
    for format in ["%Y-%m-%dT%H:%M:%S%.f", "%Y-%m-%dT%H:%M"] {
        if let Ok(t) = NaiveDateTime::parse_from_str(&s, format) {
            return Some(t.and_utc().timestamp_millis());
        }
    }
    let date = NaiveDate::parse_from_str(&s, "%Y-%m-%d").ok()?;
    Some(date.and_hms_opt(0, 0, 0)?.and_utc().timestamp_millis())
}

/// Start of cursor intervals (the reference server's epoch, 2024-10-09).
const CURSOR_EPOCH_MS: i64 = 1_728_432_000_000;
/// Length of one cursor interval.
const CURSOR_INTERVAL_S: i64 = 20;

/// The `Stream-Cursor` to answer with (protocol §8.1) at `now_ms`: the
/// current 20-second interval number, or, when the client already sent a
/// cursor at or past it, that cursor plus a jitter drawn from `random` so
/// caches never collapse a client onto its own previous response.
pub fn response_cursor(client: Option<&str>, now_ms: i64, random: u64) -> String {
    let current = (now_ms - CURSOR_EPOCH_MS) / (CURSOR_INTERVAL_S * 1000);
    match client.and_then(|c| c.parse::<i64>().ok()) {
        Some(c) if c >= current => {
            // 1..=3600 seconds of jitter, in whole intervals (at least one).
            let jitter_s = 1 + (random % 3600) as i64;
            let intervals = (jitter_s + CURSOR_INTERVAL_S - 1) / CURSOR_INTERVAL_S;
            // A client may send any i64: saturate rather than overflow.
            c.saturating_add(intervals.max(1)).to_string()
        }
        _ => current.to_string(),
    }
}

/// The next number of a splitmix64 generator at `state`: a few bits of
/// spread for cursor jitter, not secrecy (and no system call per draw).
pub fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Append `n` in decimal, at least `width` digits (zero-padded): what
/// `write!(out, "{n:0width$}")` writes, without the formatting machinery
/// (SSE ids and offsets are written for every frame and reader).
pub fn push_decimal(out: &mut Vec<u8>, mut n: u64, width: usize) {
    let mut digits = [b'0'; 20];
    let mut at = digits.len();
    loop {
        at -= 1;
        digits[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    let len = digits.len() - at;
    out.extend(std::iter::repeat_n(b'0', width.saturating_sub(len)));
    out.extend_from_slice(&digits[at..]);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decimals_are_written_as_format_writes_them() {
        for n in [0, 7, 10, 99, 1234, u64::MAX / 3, u64::MAX] {
            for width in [0, 1, 16, 25] {
                let mut out = Vec::new();
                push_decimal(&mut out, n, width);
                assert_eq!(String::from_utf8(out).unwrap(), format!("{n:0width$}"));
            }
        }
    }

    #[test]
    fn base64_matches_known_vectors() {
        assert_eq!(base64(b""), "");
        assert_eq!(base64(b"f"), "Zg==");
        assert_eq!(base64(b"fo"), "Zm8=");
        assert_eq!(base64(b"foo"), "Zm9v");
        assert_eq!(base64(&[0xff, 0x00, 0x10, 0x80]), "/wAQgA==");
    }

    #[test]
    fn rfc3339_parses_zones_and_rejects_garbage() {
        assert_eq!(parse_rfc3339_ms("1970-01-01T00:00:00Z"), Some(0));
        assert_eq!(parse_rfc3339_ms("1970-01-01T01:00:00+01:00"), Some(0));
        assert_eq!(
            parse_rfc3339_ms("2024-10-09T00:00:00.000Z"),
            Some(CURSOR_EPOCH_MS)
        );
        assert_eq!(
            parse_rfc3339_ms("2000-03-01T00:00:00.5Z"),
            Some(951_868_800_500)
        );
        assert_eq!(parse_rfc3339_ms("1970-01-01t00:01:00z"), Some(60_000));
        assert_eq!(parse_rfc3339_ms("1970-01-01 00:01:00.25Z"), Some(60_250));
        assert_eq!(parse_rfc3339_ms("1970-01-01T00:01Z"), Some(60_000));
        assert_eq!(parse_rfc3339_ms("1970-01-01T01:01+01:00"), Some(60_000));
        assert_eq!(parse_rfc3339_ms("1970-01-01T00:01:00"), Some(60_000));
        assert_eq!(parse_rfc3339_ms("1970-01-01T00:01"), Some(60_000));
        assert_eq!(parse_rfc3339_ms("1970-01-02"), Some(86_400_000));
        assert_eq!(parse_rfc3339_ms("not-a-timestamp"), None);
        assert_eq!(parse_rfc3339_ms("2024-13-01T00:00:00Z"), None);
        assert_eq!(parse_rfc3339_ms("2024-01-01T00:00:00Zjunk"), None);
    }

    #[test]
    fn response_cursor_survives_the_largest_client_cursor() {
        // Found by fuzzing: adding the jitter overflowed.
        assert_eq!(
            response_cursor(Some(&i64::MAX.to_string()), CURSOR_EPOCH_MS, 7),
            i64::MAX.to_string()
        );
    }

    #[test]
    fn response_cursor_counts_intervals_and_jumps_a_current_client() {
        let now = CURSOR_EPOCH_MS + 41_000;
        assert_eq!(response_cursor(None, now, 0), "2");
        assert_eq!(response_cursor(Some("1"), now, 0), "2");
        // A client at the current interval moves on by 1..=180 intervals.
        for random in [0, 19, 20, 3599, u64::MAX] {
            let next: i64 = response_cursor(Some("2"), now, random).parse().unwrap();
            assert!((3..=182).contains(&next), "{random}: {next}");
        }
    }

    #[test]
    fn splitmix64_spreads_a_current_clients_jitter() {
        let (mut a, mut b) = (7, 7);
        let draws: Vec<u64> = (0..1000).map(|_| splitmix64(&mut a)).collect();
        assert_eq!(draws[..3], [0, 1, 2].map(|_| splitmix64(&mut b)));
        // Successive draws from one seed land on most of the 180 intervals.
        let now = CURSOR_EPOCH_MS + 41_000;
        let intervals: std::collections::HashSet<String> = draws
            .iter()
            .map(|r| response_cursor(Some("2"), now, *r))
            .collect();
        assert!(intervals.len() > 150, "{} intervals", intervals.len());
    }
}
