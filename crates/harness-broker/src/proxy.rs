//! The broker's HTTP face: `/s/{session}/{anthropic|openai}/{path}`.
//!
//! One request: check the session id and its token, refuse a revoked
//! session, replace the token with the real key, forward, and stream the
//! answer back as it arrives, counting bytes and tokens on the way.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get};
use axum::Router;
use bytes::Bytes;
use futures::{Stream, StreamExt};
use harness_core::SessionId;

use crate::usage::{PriceTable, Usage, UsageScanner};
use crate::{token, Inner};

use harness_broker_proto::wire::{self, Api, MAX_REQUEST_BYTES};

/// The broker's routes. `only` set: a session's own socket, which answers
/// that session's path alone.
pub(crate) fn router(inner: Arc<Inner>, only: Option<String>) -> Router {
    let state = Served { inner, only };
    Router::new()
        .route("/health", get(|| async { "ok" }))
        .route("/s/{session}/{api}/{*rest}", any(forward))
        .fallback(|| async {
            refuse(
                StatusCode::NOT_FOUND,
                "not_found",
                "the model broker serves /s/<session>/anthropic/... and /s/<session>/openai/...",
            )
        })
        .with_state(state)
}

#[derive(Clone)]
struct Served {
    inner: Arc<Inner>,
    only: Option<String>,
}

/// A refusal in the shape both SDKs print (`wire::refusal_body`).
fn refuse(status: StatusCode, kind: &str, message: &str) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        wire::refusal_body(kind, message),
    )
        .into_response()
}

/// The token a request carries (`wire::presented_token`).
fn presented_token(headers: &HeaderMap) -> Option<&str> {
    let header = |name| {
        headers
            .get(name)
            .and_then(|v: &HeaderValue| v.to_str().ok())
    };
    wire::presented_token(header("x-api-key"), header(header::AUTHORIZATION.as_str()))
}

/// The price table in the broker's directory (`prices.json`; none is an
/// empty table).
fn load_prices(dir: &std::path::Path) -> harness_core::Result<PriceTable> {
    let path = dir.join("prices.json");
    match std::fs::read(&path) {
        Ok(bytes) => PriceTable::parse(&bytes, &path.display().to_string()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(PriceTable::default()),
        Err(e) => Err(harness_core::Error::from(e)),
    }
}

/// The session's budget against what it used: a call past it is refused
/// with the reason (an unlimited budget admits everything).
fn admit(
    dir: &std::path::Path,
    session: &str,
    prices: &PriceTable,
    model: Option<&str>,
) -> Result<(), String> {
    let budget = crate::read_budget(dir, session);
    if budget.is_unlimited() {
        return Ok(());
    }
    let used = crate::read_usage(dir, session)
        .unwrap_or_default()
        .model_usage();
    let origin = dir.join("prices.json").display().to_string();
    crate::usage::admit(&budget, &used, prices, model, &origin)
}

/// The agent's headers as the provider gets them: hop-by-hop ones left
/// out, the real key in place of the token (`None`: the key is not a valid
/// header value).
fn upstream_headers(agents: &HeaderMap, api: Api, api_key: &str) -> Option<HeaderMap> {
    let mut headers = HeaderMap::new();
    for (name, value) in agents {
        if !wire::is_hop_header(name.as_str()) {
            headers.append(name.clone(), value.clone());
        }
    }
    let (key_header, key) = api.key_header(api_key);
    headers.insert(key_header, HeaderValue::from_str(&key).ok()?);
    Some(headers)
}

/// `/s/<session>/<api>/<rest>`: check the token and the session's turn and
/// budget, swap in the real key, forward, and stream the answer back while
/// its usage is counted.
async fn forward(
    State(Served { inner, only }): State<Served>,
    Path((session, api, rest)): Path<(String, String, String)>,
    request: Request,
) -> Response {
    let Ok(session) = SessionId::parse(session) else {
        return refuse(StatusCode::NOT_FOUND, "not_found", "no such session");
    };
    let session = session.as_str().to_string();
    if only.as_ref().is_some_and(|own| *own != session) {
        // A sandbox's forward reaches its own session's socket: another
        // session's path (with that session's token or not) opens nothing.
        return refuse(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "this endpoint serves another session: this token does not open this session",
        );
    }
    let Some(api) = Api::parse(&api) else {
        return refuse(
            StatusCode::NOT_FOUND,
            "not_found",
            "unknown provider in the path: use /anthropic/ or /openai/",
        );
    };
    let refused = |status: StatusCode, kind, message: &str| {
        inner.record(
            &session,
            &Usage {
                refused: 1,
                ..Usage::default()
            },
            Some((None, status.as_u16())),
        );
        tracing::warn!(session.id = %session, status = %status, "{message}");
        refuse(status, kind, message)
    };
    let valid = presented_token(request.headers())
        .is_some_and(|t| token::verify(&inner.secret, &session, t));
    if !valid {
        return refused(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "this token does not open this session",
        );
    }
    if !inner.is_active(&session) {
        return refused(
            StatusCode::FORBIDDEN,
            "permission_error",
            "this session has no turn running: its token opens nothing between turns or after the session ends",
        );
    }
    let upstream = match api {
        Api::Anthropic => inner.anthropic.as_ref(),
        Api::OpenAi => inner.openai.as_ref(),
    };
    let Some(upstream) = upstream else {
        return refused(
            StatusCode::SERVICE_UNAVAILABLE,
            "api_error",
            &format!(
                "no key for this provider: set {} where the harness runs",
                api.key_var()
            ),
        );
    };

    let (parts, body) = request.into_parts();
    let body = match axum::body::to_bytes(body, MAX_REQUEST_BYTES).await {
        Ok(b) => b,
        Err(e) => {
            return refused(
                StatusCode::PAYLOAD_TOO_LARGE,
                "request_too_large",
                &format!("request body over {MAX_REQUEST_BYTES} bytes or unreadable: {e}"),
            )
        }
    };
    // The session's budget: spent, nothing more passes; a spend budget
    // with a model the price table cannot price is refused, not ignored.
    let model = wire::request_model(&body);
    let prices = match load_prices(&inner.dir) {
        Ok(p) => p,
        Err(e) => {
            return refused(
                StatusCode::INTERNAL_SERVER_ERROR,
                "api_error",
                &format!("the broker's price table: {e}"),
            )
        }
    };
    if let Err(why) = admit(&inner.dir, &session, &prices, model.as_deref()) {
        return refused(StatusCode::FORBIDDEN, "permission_error", &why);
    }
    let url = wire::upstream_url(&upstream.base_url, &rest, parts.uri.query());
    let Some(headers) = upstream_headers(&parts.headers, api, &upstream.api_key) else {
        return refused(
            StatusCode::INTERNAL_SERVER_ERROR,
            "api_error",
            "the configured key is not a valid header value",
        );
    };
    let request_bytes = body.len() as u64;
    let answer = inner
        .client
        .request(parts.method.clone(), &url)
        .headers(headers)
        .body(body)
        .send()
        .await;
    let answer = match answer {
        Ok(a) => a,
        Err(e) => {
            return refused(
                StatusCode::BAD_GATEWAY,
                "api_error",
                &format!("the upstream {} did not answer: {e}", upstream.base_url),
            )
        }
    };
    tracing::debug!(session.id = %session, %url, status = %answer.status(), "model request forwarded");
    let mut response = Response::builder().status(answer.status());
    for (name, value) in answer.headers() {
        if !wire::is_hop_header(name.as_str()) {
            response = response.header(name, value);
        }
    }
    let tap = UsageTap {
        inner: inner.clone(),
        session,
        status: answer.status().as_u16(),
        model,
        prices,
        stream: answer.bytes_stream().boxed(),
        scanner: Some(UsageScanner::default()),
        usage: Usage {
            requests: 1,
            request_bytes,
            ..Usage::default()
        },
    };
    response.body(Body::from_stream(tap)).unwrap_or_else(|e| {
        refuse(
            StatusCode::BAD_GATEWAY,
            "api_error",
            &format!("building the response: {e}"),
        )
    })
}

/// The upstream body, passed on chunk by chunk; on its end (or when the
/// agent hangs up) the exchange is added to the session's usage.
struct UsageTap {
    inner: Arc<Inner>,
    session: String,
    /// The model the request named, and the prices to cost it with.
    model: Option<String>,
    /// The upstream's answer status.
    status: u16,
    prices: PriceTable,
    stream: futures::stream::BoxStream<'static, reqwest::Result<Bytes>>,
    scanner: Option<UsageScanner>,
    usage: Usage,
}

impl Stream for UsageTap {
    type Item = reqwest::Result<Bytes>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let next = self.stream.poll_next_unpin(cx);
        if let Poll::Ready(Some(Ok(chunk))) = &next {
            let len = chunk.len() as u64;
            self.usage.response_bytes += len;
            if let Some(s) = self.scanner.as_mut() {
                s.feed(chunk);
            }
        }
        next
    }
}

impl Drop for UsageTap {
    fn drop(&mut self) {
        if let Some(scanner) = self.scanner.take() {
            let (input, output) = scanner.finish();
            self.usage.input_tokens = input;
            self.usage.output_tokens = output;
            match self
                .prices
                .spend_micros(self.model.as_deref().unwrap_or(""), input, output)
            {
                Some(spend) => self.usage.spend_micros = spend,
                None => self.usage.unpriced_requests = 1,
            }
        }
        self.inner.record(
            &self.session,
            &self.usage,
            Some((self.model.clone(), self.status)),
        );
    }
}
