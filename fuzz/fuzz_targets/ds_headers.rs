//! The Durable Streams parsers behind the request headers and query:
//! offsets (`offset=`, `Stream-Fork-Offset`), `Stream-TTL` and
//! `Stream-Fork-Sub-Offset` (`strict_uint`), `Stream-Expires-At`
//! (`parse_rfc3339_ms`), `content-type`, the query string
//! (`percent_decode`, `query_pairs`), `cursor=` (`response_cursor`) and the
//! SSE framing of payloads (`sse_event`).
//!
//! Asserts, against small independent oracles: offsets round-trip through
//! their text form and order as strings the way they order as numbers (for
//! offsets the server writes, < 10^16); `strict_uint` is exactly
//! `^(0|[1-9]\d*)$` within u64; a parsed timestamp re-printed canonically
//! parses to the same instant; `percent_decode` decodes `%XX` only for two
//! hex digits; the content-type check is `^[\w-]+/[\w-]+`; a returned
//! cursor is a number; and `sse_event` yields, to a WHATWG SSE parser,
//! exactly one event with exactly the payload (no injected fields or events).

#![no_main]

use libfuzzer_sys::fuzz_target;
use session_server::durable_streams::util::{
    parse_rfc3339_ms, percent_decode, query_pairs, response_cursor,
};
use session_server::durable_streams::{sse_event, strict_uint, valid_content_type, Offset};

fn check_offset(raw: &str) -> Option<Offset> {
    let parsed = Offset::parse(raw);
    let shape = raw.split_once('_').is_some_and(|(a, b)| {
        !a.is_empty()
            && !b.is_empty()
            && a.bytes().all(|c| c.is_ascii_digit())
            && b.bytes().all(|c| c.is_ascii_digit())
            && a.parse::<u64>().is_ok()
            && b.parse::<u64>().is_ok()
    });
    assert_eq!(
        parsed.is_some(),
        shape,
        "Offset::parse({raw:?}) = {parsed:?}"
    );
    let o = parsed?;
    let text = o.to_string();
    assert_eq!(
        Offset::parse(&text),
        Some(o),
        "{o:?} -> {text:?} does not parse back"
    );
    Some(o)
}

fn check_strict_uint(raw: &str) {
    let want = (raw == "0"
        || (!raw.is_empty() && !raw.starts_with('0') && raw.bytes().all(|b| b.is_ascii_digit())))
    .then(|| raw.parse::<u64>().ok())
    .flatten();
    assert_eq!(strict_uint(raw), want, "strict_uint({raw:?})");
    if let Some(v) = want {
        assert_eq!(v.to_string(), raw);
    }
}

fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = if z >= 0 { z } else { z - 146_096 } / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (if m <= 2 { y + 1 } else { y }, m, d)
}

fn check_timestamp(raw: &str) {
    let Some(ms) = parse_rfc3339_ms(raw) else {
        return;
    };
    let days = ms.div_euclid(86_400_000);
    let rest = ms.rem_euclid(86_400_000);
    let (y, m, d) = civil_from_days(days);
    if !(0..=9999).contains(&y) {
        return;
    }
    let canonical = format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:03}Z",
        rest / 3_600_000,
        rest / 60_000 % 60,
        rest / 1000 % 60,
        rest % 1000
    );
    assert_eq!(
        parse_rfc3339_ms(&canonical),
        Some(ms),
        "{raw:?} -> {ms} -> {canonical:?}"
    );
}

fn reference_percent_decode(raw: &str) -> String {
    let b = raw.as_bytes();
    let hex = |c: u8| (c as char).to_digit(16).map(|v| v as u8);
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < b.len() => match (hex(b[i + 1]), hex(b[i + 2])) {
                (Some(h), Some(l)) => {
                    out.push(h * 16 + l);
                    i += 2;
                }
                _ => out.push(b'%'),
            },
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn check_content_type(raw: &str) {
    let word = |c: u8| c.is_ascii_alphanumeric() || c == b'_' || c == b'-';
    let b = raw.as_bytes();
    let a_len = b.iter().take_while(|c| word(**c)).count();
    let want =
        a_len > 0 && b.get(a_len) == Some(&b'/') && b.get(a_len + 1).is_some_and(|c| word(*c));
    assert_eq!(valid_content_type(raw), want, "valid_content_type({raw:?})");
}

/// Events a WHATWG EventSource would dispatch: (type, data), plus whether
/// any field other than `event`/`data` (or a comment) appeared.
fn parse_sse(stream: &str) -> (Vec<(String, String)>, bool) {
    let mut events = Vec::new();
    let mut other = false;
    let (mut event, mut data) = (String::new(), String::new());
    let normalized = stream.replace("\r\n", "\n").replace('\r', "\n");
    let mut lines: Vec<&str> = normalized.split('\n').collect();
    // The part after the last line break is an incomplete line.
    lines.pop();
    for line in lines {
        if line.is_empty() {
            if !data.is_empty() {
                data.pop();
                events.push((std::mem::take(&mut event), std::mem::take(&mut data)));
            }
            event.clear();
            continue;
        }
        let (field, value) = line.split_once(':').unwrap_or((line, ""));
        let value = value.strip_prefix(' ').unwrap_or(value);
        match field {
            "event" => event = value.to_string(),
            "data" => {
                data.push_str(value);
                data.push('\n');
            }
            _ => other = true,
        }
    }
    (events, other)
}

fn check_sse(payload: &str) {
    let out = sse_event("data", payload);
    let text = std::str::from_utf8(&out).expect("SSE output is UTF-8");
    assert!(text.ends_with("\n\n"));
    let (events, other) = parse_sse(text);
    assert!(!other, "payload {payload:?} injected a field: {text:?}");
    let want = payload.replace("\r\n", "\n").replace('\r', "\n");
    assert_eq!(
        events,
        vec![("data".to_string(), want)],
        "payload {payload:?} framed as {text:?}"
    );
}

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let text = text.as_ref();

    let (first, second) = text.split_once('\n').unwrap_or((text, ""));
    if let (Some(a), Some(b)) = (check_offset(first), check_offset(second)) {
        let small = |o: &Offset| o.read_seq < 10u64.pow(16) && o.byte < 10u64.pow(16);
        if small(&a) && small(&b) {
            assert_eq!(
                a.to_string().cmp(&b.to_string()),
                a.cmp(&b),
                "{a:?} vs {b:?}"
            );
        }
    }
    check_offset(text);
    check_strict_uint(text);
    check_strict_uint(first);
    check_timestamp(text);
    check_timestamp(first);
    check_content_type(text);
    check_content_type(text.trim());

    assert_eq!(
        percent_decode(text),
        reference_percent_decode(text),
        "percent_decode({text:?})"
    );
    let pairs = query_pairs(text);
    assert_eq!(
        pairs.len(),
        text.split('&').filter(|p| !p.is_empty()).count()
    );

    // The clock and the jitter are inputs: take both from the input too.
    let now = 1_728_432_000_000 + (data.len() as i64) * 997_000;
    let cursor = response_cursor(Some(first), now, text.len() as u64);
    assert!(
        cursor.parse::<i64>().is_ok(),
        "cursor {cursor:?} for {first:?}"
    );

    check_sse(text);
});
