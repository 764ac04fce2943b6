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
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get};
use axum::Router;
use bytes::Bytes;
use futures::{Stream, StreamExt};
use harness_core::SessionId;

use crate::usage::{PriceTable, Usage, UsageScanner};
use crate::{token, Api, Inner};

/// Largest request body forwarded (a long conversation with images is a
/// few MB; this leaves room and still bounds memory).
const MAX_REQUEST_BYTES: usize = 64 * 1024 * 1024;

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

/// A refusal in the shape both SDKs print: `{"type":"error","error":{...}}`.
fn refuse(status: StatusCode, kind: &str, message: &str) -> Response {
    let body = serde_json::json!({
        "type": "error",
        "error": { "type": kind, "message": format!("harness model broker: {message}") },
    });
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

/// The token a request carries: `x-api-key` (Anthropic) or a bearer
/// `authorization` (OpenAI), whichever is present.
fn presented_token(headers: &HeaderMap) -> Option<&str> {
    if let Some(v) = headers.get("x-api-key").and_then(|v| v.to_str().ok()) {
        return Some(v.trim());
    }
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            v.strip_prefix("Bearer ")
                .or_else(|| v.strip_prefix("bearer "))
        })
        .map(str::trim)
}

/// Headers that describe one hop, or carry the sandbox's credentials: never
/// forwarded.
fn hop_header(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "host"
            | "connection"
            | "keep-alive"
            | "proxy-authorization"
            | "proxy-connection"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
            | "content-length"
            | "authorization"
            | "x-api-key"
            // Ask for an identity body: the usage scanner reads it as it passes.
            | "accept-encoding"
    )
}

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
    let model = request_model(&body);
    let prices = match PriceTable::load(&inner.dir) {
        Ok(p) => p,
        Err(e) => {
            return refused(
                StatusCode::INTERNAL_SERVER_ERROR,
                "api_error",
                &format!("the broker's price table: {e}"),
            )
        }
    };
    let budget = crate::read_budget(&inner.dir, &session);
    if !budget.is_unlimited() {
        let used = crate::read_usage(&inner.dir, &session)
            .unwrap_or_default()
            .model_usage();
        if let Some(why) = budget.exceeded_by(&used) {
            return refused(StatusCode::FORBIDDEN, "permission_error", &why);
        }
        if budget.max_spend_micros.is_some()
            && prices.price(model.as_deref().unwrap_or("")).is_none()
        {
            return refused(
                StatusCode::FORBIDDEN,
                "permission_error",
                &format!(
                    "the session has a spend budget, and model {:?} has no price in {}",
                    model.as_deref().unwrap_or("(none named)"),
                    inner.dir.join("prices.json").display()
                ),
            );
        }
    }
    let mut url = format!("{}/{}", upstream.base_url.trim_end_matches('/'), rest);
    if let Some(q) = parts.uri.query() {
        url.push('?');
        url.push_str(q);
    }
    let mut headers = HeaderMap::new();
    for (name, value) in &parts.headers {
        if !hop_header(name) {
            headers.append(name.clone(), value.clone());
        }
    }
    let Ok(key) = HeaderValue::from_str(&upstream.api_key) else {
        return refused(
            StatusCode::INTERNAL_SERVER_ERROR,
            "api_error",
            "the configured key is not a valid header value",
        );
    };
    match api {
        Api::Anthropic => {
            headers.insert("x-api-key", key);
        }
        Api::OpenAi => {
            let Ok(bearer) = HeaderValue::from_str(&format!("Bearer {}", upstream.api_key)) else {
                return refused(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "api_error",
                    "the configured key is not a valid header value",
                );
            };
            headers.insert(header::AUTHORIZATION, bearer);
        }
    }
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
        if !hop_header(name) {
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

/// The `model` a request body names (Anthropic's and OpenAI's both).
fn request_model(body: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Named {
        model: Option<String>,
    }
    serde_json::from_slice::<Named>(body).ok()?.model
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
