//! The seam between the provider logic and the runtime it runs on.
//!
//! Everything the provider does goes through [`BridgeTransport`]: one HTTP
//! exchange with the bridge, a timer and a source of unique names. The
//! native implementation ([`ReqwestTransport`], feature `native`) uses
//! reqwest and tokio; inside a Worker (wasm32) the same logic runs over the
//! Worker's `fetch` by implementing this trait there, so the provider is
//! written once.

use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use harness_core::maybe::{MaybeSend, MaybeSync};
use harness_core::stream::ByteStream;
use harness_core::Result;

/// HTTP methods the bridge API uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    /// GET
    Get,
    /// POST
    Post,
    /// PUT
    Put,
    /// DELETE
    Delete,
}

impl Method {
    /// The method's name on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Method::Get => "GET",
            Method::Post => "POST",
            Method::Put => "PUT",
            Method::Delete => "DELETE",
        }
    }
}

/// A request body. Bodies are bounded (the bridge takes at most 32 MiB),
/// so they travel whole.
#[derive(Debug, Clone)]
pub enum RequestBody {
    /// No body.
    Empty,
    /// `application/json`.
    Json(serde_json::Value),
    /// `application/octet-stream`.
    Bytes(Bytes),
}

/// One request to the bridge; the transport adds the base URL and the
/// `Authorization` header.
#[derive(Debug, Clone)]
pub struct BridgeRequest {
    /// The method.
    pub method: Method,
    /// Path and query, starting with `/` (`/v1/sandbox/abc/exec`).
    pub path: String,
    /// Extra headers (`Session-Id`).
    pub headers: Vec<(String, String)>,
    /// The body.
    pub body: RequestBody,
}

impl BridgeRequest {
    /// A request without body or extra headers.
    pub fn new(method: Method, path: impl Into<String>) -> Self {
        Self {
            method,
            path: path.into(),
            headers: Vec::new(),
            body: RequestBody::Empty,
        }
    }

    /// Set a JSON body.
    pub fn json(mut self, value: serde_json::Value) -> Self {
        self.body = RequestBody::Json(value);
        self
    }

    /// Set a raw body.
    pub fn bytes(mut self, bytes: Bytes) -> Self {
        self.body = RequestBody::Bytes(bytes);
        self
    }

    /// Add a header.
    pub fn header(mut self, name: &str, value: impl Into<String>) -> Self {
        self.headers.push((name.to_string(), value.into()));
        self
    }
}

/// A response whose body is still a stream (exec output, files, archives).
pub struct BridgeResponse {
    /// HTTP status.
    pub status: u16,
    /// The `Content-Type` header, if any.
    pub content_type: Option<String>,
    /// The body, as it arrives.
    pub body: ByteStream,
}

impl std::fmt::Debug for BridgeResponse {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BridgeResponse")
            .field("status", &self.status)
            .field("content_type", &self.content_type)
            .finish_non_exhaustive()
    }
}

/// What the provider needs from its runtime.
#[cfg_attr(not(target_arch = "wasm32"), async_trait)]
#[cfg_attr(target_arch = "wasm32", async_trait(?Send))]
pub trait BridgeTransport: MaybeSend + MaybeSync + std::fmt::Debug {
    /// Send one request. Transport failures (connection refused, TLS) are
    /// `Backend` errors; HTTP error statuses are returned, not raised.
    async fn send(&self, request: BridgeRequest) -> Result<BridgeResponse>;

    /// Wait `duration`.
    async fn sleep(&self, duration: Duration);

    /// A name no other call returns (for staging files and exec ids).
    fn unique(&self) -> String;
}

#[cfg(feature = "native")]
pub use native::ReqwestTransport;

#[cfg(feature = "native")]
mod native {
    use super::*;
    use futures::StreamExt;
    use harness_core::Error;

    /// The native transport: reqwest for HTTP, tokio for the timer.
    #[derive(Debug, Clone)]
    pub struct ReqwestTransport {
        client: reqwest::Client,
        base_url: String,
        token: String,
    }

    impl ReqwestTransport {
        /// A transport to the bridge at `base_url` (no trailing slash
        /// needed) authenticating with `token`.
        pub fn new(base_url: &str, token: &str) -> Result<Self> {
            let client = reqwest::Client::builder()
                // Long execs stream for as long as they run: only the
                // connection is bounded, not the response.
                .connect_timeout(Duration::from_secs(30))
                .build()
                .map_err(|e| Error::backend(format!("building the HTTP client: {e}")))?;
            Ok(Self {
                client,
                base_url: base_url.trim_end_matches('/').to_string(),
                token: token.to_string(),
            })
        }
    }

    #[async_trait]
    impl BridgeTransport for ReqwestTransport {
        async fn send(&self, request: BridgeRequest) -> Result<BridgeResponse> {
            let method = match request.method {
                Method::Get => reqwest::Method::GET,
                Method::Post => reqwest::Method::POST,
                Method::Put => reqwest::Method::PUT,
                Method::Delete => reqwest::Method::DELETE,
            };
            let url = format!("{}{}", self.base_url, request.path);
            let mut builder = self.client.request(method, &url).bearer_auth(&self.token);
            for (name, value) in &request.headers {
                builder = builder.header(name.as_str(), value.as_str());
            }
            builder = match request.body {
                RequestBody::Empty => builder,
                RequestBody::Json(value) => builder
                    .header("content-type", "application/json")
                    .body(serde_json::to_vec(&value)?),
                RequestBody::Bytes(bytes) => builder
                    .header("content-type", "application/octet-stream")
                    .body(bytes),
            };
            let response = builder.send().await.map_err(|e| {
                Error::backend(format!(
                    "cloudflare bridge: {} {} did not answer: {e}",
                    request.method.as_str(),
                    request.path
                ))
            })?;
            let status = response.status().as_u16();
            let content_type = response
                .headers()
                .get(reqwest::header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string);
            let what = format!("{} {}", request.method.as_str(), request.path);
            let body = response.bytes_stream().map(move |chunk| {
                chunk.map_err(|e| Error::backend(format!("cloudflare bridge: reading {what}: {e}")))
            });
            Ok(BridgeResponse {
                status,
                content_type,
                body: Box::pin(body),
            })
        }

        async fn sleep(&self, duration: Duration) {
            tokio::time::sleep(duration).await
        }

        fn unique(&self) -> String {
            uuid::Uuid::new_v4().simple().to_string()
        }
    }
}
