//! Small helpers the protocol needs: base64 (SSE over binary streams),
//! RFC 3339 timestamps (`Stream-Expires-At`), query strings and cursors.

/// Standard base64 with padding.
pub fn base64(data: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for chunk in data.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        out.push(ALPHABET[(n >> 18) as usize & 63] as char);
        out.push(ALPHABET[(n >> 12) as usize & 63] as char);
        out.push(if chunk.len() > 1 {
            ALPHABET[(n >> 6) as usize & 63] as char
        } else {
            '='
        });
        out.push(if chunk.len() > 2 {
            ALPHABET[n as usize & 63] as char
        } else {
            '='
        });
    }
    out
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's
/// `days_from_civil`).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = if y >= 0 { y } else { y - 399 } / 400;
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Parse an RFC 3339 / ISO 8601 timestamp (`2026-01-02T03:04:05.678Z`,
/// `…+01:00`, seconds and fraction optional) into milliseconds since the
/// Unix epoch. `None` for anything else.
pub fn parse_rfc3339_ms(raw: &str) -> Option<i64> {
    let s = raw.trim().as_bytes();
    let num = |range: std::ops::Range<usize>| -> Option<i64> {
        let part = s.get(range)?;
        if part.is_empty() || !part.iter().all(u8::is_ascii_digit) {
            return None;
        }
        std::str::from_utf8(part).ok()?.parse().ok()
    };
    let year = num(0..4)?;
    if s.get(4) != Some(&b'-') || s.get(7) != Some(&b'-') {
        return None;
    }
    let month = num(5..7)?;
    let day = num(8..10)?;
    if !(1..=12).contains(&month) || !(1..=31).contains(&day) {
        return None;
    }
    let date_ms = days_from_civil(year, month, day) * 86_400_000;
    if s.len() == 10 {
        return Some(date_ms);
    }
    if !matches!(s.get(10), Some(b'T' | b't' | b' ')) || s.get(13) != Some(&b':') {
        return None;
    }
    let hour = num(11..13)?;
    let minute = num(14..16)?;
    let mut i = 16;
    let mut second = 0;
    let mut millis = 0;
    if s.get(i) == Some(&b':') {
        second = num(i + 1..i + 3)?;
        i += 3;
        if s.get(i) == Some(&b'.') {
            let start = i + 1;
            let mut end = start;
            while s.get(end).is_some_and(u8::is_ascii_digit) {
                end += 1;
            }
            if end == start {
                return None;
            }
            let frac = std::str::from_utf8(&s[start..end]).ok()?;
            let padded = format!("{frac:0<3}");
            millis = padded[..3].parse::<i64>().ok()?;
            i = end;
        }
    }
    if hour > 23 || minute > 59 || second > 60 {
        return None;
    }
    let offset_min = match s.get(i) {
        Some(b'Z' | b'z') if s.len() == i + 1 => 0,
        Some(sign @ (b'+' | b'-')) => {
            if s.len() != i + 6 || s[i + 3] != b':' {
                return None;
            }
            let h = num(i + 1..i + 3)?;
            let m = num(i + 4..i + 6)?;
            let total = h * 60 + m;
            if *sign == b'+' {
                total
            } else {
                -total
            }
        }
        // No zone: ECMAScript reads a date-time without offset as local
        // time; servers have no meaningful local zone, so take UTC.
        None => 0,
        _ => return None,
    };
    Some(date_ms + ((hour * 60 + minute - offset_min) * 60 + second) * 1000 + millis)
}

/// Decode `%XX` and `+` in a query component.
pub fn percent_decode(raw: &str) -> String {
    let bytes = raw.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            // Two hex digits, as URL decoders require (`from_str_radix`
            // alone would also take a sign: `%+1`).
            b'%' if i + 2 < bytes.len()
                && bytes[i + 1].is_ascii_hexdigit()
                && bytes[i + 2].is_ascii_hexdigit() =>
            {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or("");
                match u8::from_str_radix(hex, 16) {
                    Ok(b) => {
                        out.push(b);
                        i += 2;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// All `(name, value)` pairs of a query string, in order, decoded.
pub fn query_pairs(query: Option<&str>) -> Vec<(String, String)> {
    query
        .unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
}

/// Start of cursor intervals (the reference server's epoch, 2024-10-09).
const CURSOR_EPOCH_MS: i64 = 1_728_432_000_000;
/// Length of one cursor interval.
const CURSOR_INTERVAL_S: i64 = 20;

/// The `Stream-Cursor` to answer with (protocol §8.1): the current 20-second
/// interval number, or, when the client already sent a cursor at or past
/// it, that cursor plus a random jitter so caches never collapse a client
/// onto its own previous response.
pub fn response_cursor(client: Option<&str>) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0);
    let current = (now - CURSOR_EPOCH_MS) / (CURSOR_INTERVAL_S * 1000);
    match client.and_then(|c| c.parse::<i64>().ok()) {
        Some(c) if c >= current => {
            // 1..=3600 seconds of jitter, in whole intervals (at least one).
            let random = u64::from_le_bytes(
                uuid::Uuid::new_v4().as_bytes()[..8]
                    .try_into()
                    .unwrap_or([0; 8]),
            );
            let jitter_s = 1 + (random % 3600) as i64;
            let intervals = (jitter_s + CURSOR_INTERVAL_S - 1) / CURSOR_INTERVAL_S;
            // A client may send any i64: saturate rather than overflow.
            c.saturating_add(intervals.max(1)).to_string()
        }
        _ => current.to_string(),
    }
}

/// Append `n` in decimal, at least `width` digits (zero-padded): what
/// `write!(out, "{n:0width$}")` writes, without the formatting machinery
/// (SSE ids and offsets are written for every frame and reader).
pub(crate) fn push_decimal(out: &mut Vec<u8>, mut n: u64, width: usize) {
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
        assert_eq!(parse_rfc3339_ms("not-a-timestamp"), None);
        assert_eq!(parse_rfc3339_ms("2024-13-01T00:00:00Z"), None);
        assert_eq!(parse_rfc3339_ms("2024-01-01T00:00:00Zjunk"), None);
    }

    #[test]
    fn percent_decode_needs_two_hex_digits() {
        // Found by fuzzing: `from_str_radix` took `+1` as a number.
        assert_eq!(percent_decode("%+1x"), "% 1x");
        assert_eq!(percent_decode("%4"), "%4");
        assert_eq!(percent_decode("%4g%41"), "%4gA");
    }

    #[test]
    fn response_cursor_survives_the_largest_client_cursor() {
        // Found by fuzzing: adding the jitter overflowed.
        assert_eq!(
            response_cursor(Some(&i64::MAX.to_string())),
            i64::MAX.to_string()
        );
    }

    #[test]
    fn query_pairs_decode_and_keep_duplicates() {
        let pairs = query_pairs(Some("offset=1&offset=2&cursor=%31%32&x"));
        assert_eq!(pairs.len(), 4);
        assert_eq!(pairs[2], ("cursor".into(), "12".into()));
        assert_eq!(pairs[3], ("x".into(), String::new()));
    }
}
