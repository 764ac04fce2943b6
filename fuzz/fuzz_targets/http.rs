//! The session server's HTTP surface in memory: the session API (where
//! `Last-Event-ID` and `after=` are read) and the Durable Streams routes
//! (offsets, `Stream-*` and `Producer-*` headers, bodies, forks), driven
//! through the real axum router with a `MemorySessionLog` on a paused tokio
//! clock (long-polls and idle timeouts pass at once).
//!
//! Input: requests separated by a `~~~` line; each is `METHOD TARGET`, then
//! `Name: value` header lines, an empty line, and the body. Session `s1`
//! exists before the first request.
//!
//! Asserts: no request gets a 5xx; every `Stream-Next-Offset` answered is a
//! well-formed offset that prints back the same; `GET
//! /v1/sessions/<id>/events` answers 400 exactly when its `Last-Event-ID` is
//! not a frame seq (a u64 after trimming), and a non-SSE body always ends.

#![no_main]

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderName, HeaderValue, Method, Request, StatusCode};
use harness_core::log::MemorySessionLog;
use harness_core::SessionId;
use libfuzzer_sys::fuzz_target;
use session_server::durable_streams::Offset;
use session_server::{ServerConfig, SessionServer};
use tower::ServiceExt;

const MAX_REQUESTS: usize = 8;

struct Parsed {
    request: Request<Body>,
    /// For `GET /v1/sessions/<valid id>/events`: whether a `Last-Event-ID`
    /// was sent and, if so, whether it is a valid seq.
    last_event_id: Option<Option<bool>>,
}

fn parse(raw: &[u8]) -> Option<Parsed> {
    let head_end = raw
        .windows(2)
        .position(|w| w == b"\n\n")
        .unwrap_or(raw.len());
    let body = raw.get(head_end + 2..).unwrap_or(&[]).to_vec();
    let head = std::str::from_utf8(&raw[..head_end]).ok()?;
    let mut lines = head.split('\n');
    let (method, target) = lines.next()?.split_once(' ')?;
    let method = Method::from_bytes(method.as_bytes()).ok()?;
    let mut builder = Request::builder().method(method.clone()).uri(target);
    let mut last_event_id = None;
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        let value = value.strip_prefix(' ').unwrap_or(value);
        let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_bytes(value.as_bytes()),
        ) else {
            continue;
        };
        if name.as_str() == "last-event-id" && last_event_id.is_none() {
            let valid = value
                .to_str()
                .ok()
                .and_then(|s| s.trim().parse::<u64>().ok())
                .is_some();
            last_event_id = Some(valid);
        }
        builder = builder.header(name, value);
    }
    let request = builder.body(Body::from(body)).ok()?;
    let path = request.uri().path().to_string();
    let events_of_valid_session = method == Method::GET
        && path
            .strip_prefix("/v1/sessions/")
            .and_then(|r| r.strip_suffix("/events"))
            .is_some_and(|id| SessionId::parse(id).is_ok());
    Some(Parsed {
        request,
        last_event_id: events_of_valid_session.then_some(last_event_id),
    })
}

async fn run(data: &[u8]) {
    let log = Arc::new(MemorySessionLog::new());
    let mut config = ServerConfig::new(log);
    config.insecure_no_auth = true;
    let server = SessionServer::new(config);
    let router = server.router();

    let create = Request::post("/v1/sessions")
        .header("content-type", "application/json")
        .body(Body::from(r#"{"id":"s1"}"#))
        .expect("request");
    let res = router.clone().oneshot(create).await.expect("infallible");
    assert!(res.status().is_success(), "creating s1: {}", res.status());

    let text = data;
    let mut rest: &[u8] = text;
    for _ in 0..MAX_REQUESTS {
        if rest.is_empty() {
            break;
        }
        let (raw, next) = match rest.windows(5).position(|w| w == b"\n~~~\n") {
            Some(i) => (&rest[..i], &rest[i + 5..]),
            None => (rest, &rest[rest.len()..]),
        };
        rest = next;
        let Some(parsed) = parse(raw) else {
            continue;
        };
        let described = format!(
            "{} {} {:?}",
            parsed.request.method(),
            parsed.request.uri(),
            parsed.request.headers()
        );
        let response = router
            .clone()
            .oneshot(parsed.request)
            .await
            .expect("infallible");
        let status = response.status();
        assert!(!status.is_server_error(), "{described} answered {status}");
        if let Some(raw) = response.headers().get("stream-next-offset") {
            let raw = raw.to_str().expect("ASCII offset");
            let offset = Offset::parse(raw)
                .unwrap_or_else(|| panic!("{described}: Stream-Next-Offset {raw:?} is malformed"));
            assert_eq!(offset.to_string(), raw);
        }
        if let Some(Some(valid)) = parsed.last_event_id {
            assert_eq!(
                status == StatusCode::BAD_REQUEST,
                !valid,
                "{described}: Last-Event-ID valid={valid} answered {status}"
            );
        }
        let sse = response
            .headers()
            .get("content-type")
            .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
        if !sse && status != StatusCode::SWITCHING_PROTOCOLS {
            let body = tokio::time::timeout(
                Duration::from_secs(3600),
                axum::body::to_bytes(response.into_body(), 64 << 20),
            )
            .await;
            assert!(body.is_ok(), "{described}: the body never ended");
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .expect("runtime");
    runtime.block_on(run(data));
});
