//! The web page: a single-page app at `/` (session list, transcript,
//! prompt box, approvals, abort, fork and export), compiled into the
//! binary. Plain HTML, CSS and a JavaScript module — no bundler, nothing to
//! build — talking to the same public API as every other client (the
//! bearer token stays in the tab's `sessionStorage` and goes out as a
//! header, or as `access_token` on the SSE URL).

use axum::http::header;
use axum::response::{IntoResponse, Response};

const INDEX: &str = include_str!("../web/index.html");
const SCRIPT: &str = include_str!("../web/app.js");
const STYLE: &str = include_str!("../web/app.css");

/// Same-origin only: the page loads nothing from elsewhere and talks only
/// to this server.
const CSP: &str = "default-src 'self'; img-src 'self' blob: data:; object-src 'none'; base-uri 'none'; frame-ancestors 'none'";

fn asset(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            // Small files; always fresh after an upgrade of the server.
            (header::CACHE_CONTROL, "no-cache"),
            (header::CONTENT_SECURITY_POLICY, CSP),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        ],
        body,
    )
        .into_response()
}

pub(crate) async fn index() -> Response {
    asset("text/html; charset=utf-8", INDEX)
}

pub(crate) async fn script() -> Response {
    asset("text/javascript; charset=utf-8", SCRIPT)
}

pub(crate) async fn style() -> Response {
    asset("text/css; charset=utf-8", STYLE)
}

pub(crate) async fn favicon() -> axum::http::StatusCode {
    axum::http::StatusCode::NO_CONTENT
}
