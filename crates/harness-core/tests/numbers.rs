//! Every number a tool input carries comes back bit-exact through every
//! wire type and the log rules: a `ToolCall` the agent sent with `2.2e58`
//! is the `ToolCall` every client, export and fork sees.
//!
//! serde_json parses floats exactly only with its `float_roundtrip` feature
//! (set for the whole workspace, the fuzz workspace and the wasm32 build:
//! `docs/ARCHITECTURE.md`, "Numbers"). Without it, `messages` — the fuzz
//! target — found `2.2222223222222223e58` coming back as
//! `2.2222223222222226e58` on a fresh machine; `the_fuzz_find_reads_back`
//! keeps that input. Integers beyond 64 bits are out of scope: JSON text
//! like `1e400` or a 30-digit integer is parsed as (or refused as) an f64.

use harness_core::actor::{ClientMessage, RunnerMessage, ServerMessage};
use harness_core::log::{AppendRequest, LogState};
use harness_core::relay::HostCallRequest;
use harness_core::{Frame, FrameBody, SessionId, StreamPart};
use proptest::prelude::*;
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::{json, Value};

/// The value the fuzzer found changing on a fresh machine, as the agent
/// would have written it.
const FUZZ_FIND: &str = "2.2222223222222223e+58";

/// encode → decode → equal, and encode again → the same bytes.
fn through<T: Serialize + DeserializeOwned + PartialEq + std::fmt::Debug>(value: &T) -> T {
    let text = serde_json::to_string(value).expect("encodes");
    let back: T =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text} does not decode: {e}"));
    assert_eq!(&back, value, "decode(encode(v)) != v for {text}");
    assert_eq!(
        serde_json::to_string(&back).unwrap(),
        text,
        "the encoding is not stable"
    );
    back
}

/// Every wire type a tool input travels in, and the log rules (append,
/// read, fork) applied to it. Returns the input as the fork read it back.
fn every_wire(input: &Value) -> Value {
    let part = StreamPart::ToolCall {
        tool_call_id: "c1".into(),
        tool_name: "Bash".into(),
        input: input.clone(),
    };
    through(&part);
    through(&RunnerMessage::Part {
        turn_id: "t1".into(),
        part: part.clone(),
        key: Some("k".into()),
    });
    through(&RunnerMessage::HostCall {
        turn_id: "t1".into(),
        call: HostCallRequest {
            call_id: "h1".into(),
            tool: "lookup".into(),
            input: input.clone(),
            byte_budget: None,
            timeout_ms: None,
        },
    });
    let body = FrameBody::Part {
        turn_id: "t1".into(),
        part: part.clone(),
    };
    through(&body);
    let host_call = FrameBody::HostCall {
        turn_id: "t1".into(),
        call_id: "h1".into(),
        tool: "lookup".into(),
        input: input.clone(),
        byte_budget: 1024,
        timeout_ms: 5000,
    };
    through(&host_call);
    let frame = Frame {
        seq: 7,
        at_ms: 1,
        body: body.clone(),
    };
    through(&frame);
    through(&ServerMessage::Frame {
        frame: frame.clone(),
    });
    through(&ServerMessage::Live {
        turn_id: "t1".into(),
        part: part.clone(),
    });
    // A client's message carries no tool input; decoding one still must
    // not disturb a number it holds in a string field.
    through(&ClientMessage::Prompt {
        text: input.to_string(),
        turn_id: None,
        key: None,
    });

    let mut log = LogState::new(SessionId::parse("numbers").unwrap());
    let appended = log
        .append(AppendRequest::idempotent(body.clone(), "k"), 1, usize::MAX)
        .unwrap();
    assert_eq!(appended.frame.body, body);
    log.append(AppendRequest::new(host_call.clone()), 2, usize::MAX)
        .unwrap();
    // A retry compares the decoded body with the stored one: it must be a
    // duplicate, not a conflict.
    let decoded: FrameBody = serde_json::from_str(&serde_json::to_string(&body).unwrap()).unwrap();
    let retry = log
        .append(AppendRequest::idempotent(decoded, "k"), 3, usize::MAX)
        .unwrap();
    assert!(
        retry.duplicate,
        "a retried append of the same input conflicted"
    );
    let fork = log
        .fork(2, SessionId::parse("numbers-fork").unwrap(), 4)
        .unwrap();
    let frames = fork.read(0, 10).unwrap();
    assert_eq!(frames[0].body, body);
    assert_eq!(frames[1].body, host_call);
    match through(&frames[0].body) {
        FrameBody::Part {
            part: StreamPart::ToolCall { input, .. },
            ..
        } => input,
        other => panic!("read back {other:?}"),
    }
}

/// The bits of every number in `value`, in order.
fn number_bits(value: &Value, out: &mut Vec<String>) {
    match value {
        Value::Number(n) => out.push(match (n.as_u64(), n.as_i64(), n.as_f64()) {
            (Some(u), _, _) => format!("u{u}"),
            (_, Some(i), _) => format!("i{i}"),
            (_, _, Some(f)) => format!("f{:016x}", f.to_bits()),
            _ => unreachable!("a JSON number is u64, i64 or f64"),
        }),
        Value::Array(items) => items.iter().for_each(|v| number_bits(v, out)),
        Value::Object(map) => map.values().for_each(|v| number_bits(v, out)),
        _ => {}
    }
}

fn assert_exact(sent: &Value) {
    let back = every_wire(sent);
    let (mut want, mut got) = (Vec::new(), Vec::new());
    number_bits(sent, &mut want);
    number_bits(&back, &mut got);
    assert_eq!(got, want, "numbers changed on the way through: {sent}");
}

#[test]
fn the_fuzz_find_reads_back() {
    // As the agent wrote it (text), and as the value it parses to.
    let sent: Value = serde_json::from_str(&format!(r#"{{"command":"ls","n":{FUZZ_FIND}}}"#))
        .expect("valid JSON");
    assert_eq!(sent["n"].as_f64(), Some(2.2222223222222223e58));
    assert_exact(&sent);
}

#[test]
fn extremes_read_back() {
    assert_exact(&json!({
        "max": f64::MAX, "min_positive": f64::MIN_POSITIVE,
        "subnormal": f64::from_bits(1), "negative_zero": -0.0_f64,
        "third": 1.0_f64 / 3.0, "tenth": 0.1_f64, "big": 1e300_f64,
        "i64_min": i64::MIN, "u64_max": u64::MAX, "nested": [[{"x": 5e-324_f64}]],
    }));
}

/// Any finite f64 (every bit pattern but NaN and the infinities, which
/// JSON cannot carry).
fn finite_f64() -> impl Strategy<Value = f64> {
    any::<u64>()
        .prop_map(f64::from_bits)
        .prop_filter("JSON has no NaN or infinity", |f| f.is_finite())
}

fn number() -> impl Strategy<Value = Value> {
    prop_oneof![
        finite_f64().prop_map(|f| json!(f)),
        any::<i64>().prop_map(|i| json!(i)),
        any::<u64>().prop_map(|u| json!(u)),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn any_number_in_a_tool_input_reads_back(
        a in number(),
        b in number(),
        list in proptest::collection::vec(number(), 0..4),
    ) {
        assert_exact(&json!({"a": a, "deep": {"b": b, "list": list}}));
    }

    /// The same numbers written as text the way another JSON encoder might
    /// (exponent forms, trailing zeros) parse to the nearest f64, and that
    /// value then travels unchanged.
    #[test]
    fn numbers_in_other_spellings_read_back(f in finite_f64(), zeros in 0usize..3) {
        let shortest = format!("{f:e}");
        let (mantissa, exponent) = shortest.split_once('e').expect("{:e} has an exponent");
        let padding = "0".repeat(zeros);
        let mantissa = match (mantissa.contains('.'), zeros) {
            (_, 0) => mantissa.to_string(),
            (true, _) => format!("{mantissa}{padding}"),
            (false, _) => format!("{mantissa}.{padding}"),
        };
        let text = format!("{mantissa}E{exponent}");
        let sent: Value = serde_json::from_str(&format!(r#"{{"n":{text}}}"#)).unwrap();
        prop_assert_eq!(sent["n"].as_f64().map(f64::to_bits), Some(f.to_bits()), "{} parsed inexactly", text);
        assert_exact(&sent);
    }
}
