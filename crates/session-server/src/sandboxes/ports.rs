//! A sandbox's ports, reachable from the host:
//! `/v1/sandbox-port/{name}/{port}/{secret}/…` proxies HTTP and WebSocket
//! to the port inside the sandbox that has that name *now* (a replaced
//! sandbox keeps its URLs). The secret is in the path because the AI
//! SDK's bridge client sends no headers and appends its own query string.
//!
//! WebSocket is relayed message by message: the client's upgrade is
//! completed first, then the sandbox's port is dialled and frames are
//! copied both ways. The sandbox's first frame therefore never shares a
//! read with the `101` answer (a client that attaches its message listener
//! after the open event, as the AI SDK's does, would lose it).

use std::sync::Arc;

use axum::body::Body;
use axum::extract::ws::{CloseFrame, Message, WebSocket, WebSocketUpgrade};
use axum::extract::{FromRequestParts, Path, Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use futures::{SinkExt, StreamExt};
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::Message as UpMessage;

use super::routes::Inner;
use crate::error::ApiError;

pub(crate) async fn proxy_root(
    State(inner): State<Arc<Inner>>,
    Path((name, port, secret)): Path<(String, String, String)>,
    request: Request,
) -> Response {
    forward(inner, name, port, secret, String::new(), request).await
}

pub(crate) async fn proxy(
    State(inner): State<Arc<Inner>>,
    Path((name, port, secret, rest)): Path<(String, String, String, String)>,
    request: Request,
) -> Response {
    forward(inner, name, port, secret, rest, request).await
}

fn same(a: &str, b: &str) -> bool {
    // Constant time in the secret's length: nothing learnt from timing.
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
}

async fn forward(
    inner: Arc<Inner>,
    name: String,
    port: String,
    secret: String,
    rest: String,
    request: Request,
) -> Response {
    let target = async {
        let slot = inner.slot(&name).await?;
        let (secret_ok, declared, port) = {
            let guard = slot.lock().await;
            let live = guard.as_ref().ok_or_else(|| {
                ApiError::new(
                    StatusCode::NOT_FOUND,
                    "not_found",
                    format!("no sandbox {name:?}"),
                )
            })?;
            let port: u16 = port.parse().map_err(|_| {
                ApiError::new(
                    StatusCode::NOT_FOUND,
                    "not_found",
                    format!("{port:?} is not a port"),
                )
            })?;
            (
                same(&secret, &live.record.port_secret),
                live.record.request.ports.contains(&port),
                port,
            )
        };
        if !secret_ok {
            return Err(ApiError::new(
                StatusCode::FORBIDDEN,
                "forbidden",
                format!("wrong secret for the ports of sandbox {name:?}"),
            ));
        }
        if !declared {
            return Err(ApiError::new(
                StatusCode::NOT_FOUND,
                "port_not_declared",
                format!("sandbox {name:?} did not declare port {port}"),
            ));
        }
        let (sandbox, _) = inner.sandbox(&name).await?;
        let endpoint = sandbox.port_endpoint(port).await?;
        Ok::<_, ApiError>(format!("{}:{}", endpoint.host, endpoint.port))
    }
    .await;
    let authority = match target {
        Ok(a) => a,
        Err(e) => return e.into_response(),
    };
    let query = request
        .uri()
        .query()
        .map(|q| format!("?{q}"))
        .unwrap_or_default();
    let is_upgrade = request
        .headers()
        .get("upgrade")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case("websocket"));
    if is_upgrade {
        let (mut parts, _body) = request.into_parts();
        let upgrade = match WebSocketUpgrade::from_request_parts(&mut parts, &()).await {
            Ok(u) => u,
            Err(rejection) => return rejection.into_response(),
        };
        let url = format!("ws://{authority}/{rest}{query}");
        return upgrade
            .max_message_size(64 << 20)
            .on_upgrade(move |client| relay(client, url));
    }
    let url = format!("http://{authority}/{rest}{query}");
    let (parts, body) = request.into_parts();
    let mut upstream = inner.http.request(parts.method.clone(), &url);
    for (name, value) in parts.headers.iter() {
        if is_hop_by_hop(name.as_str()) || name == "host" {
            continue;
        }
        upstream = upstream.header(name, value);
    }
    let upstream = upstream.body(reqwest::Body::wrap_stream(body.into_data_stream()));
    match upstream.send().await {
        Ok(answer) => {
            let mut response = Response::builder().status(answer.status().as_u16());
            for (name, value) in answer.headers() {
                if is_hop_by_hop(name.as_str()) {
                    continue;
                }
                response = response.header(name, value);
            }
            response
                .body(Body::from_stream(answer.bytes_stream()))
                .unwrap_or_else(|_| StatusCode::BAD_GATEWAY.into_response())
        }
        Err(e) => ApiError::new(
            StatusCode::BAD_GATEWAY,
            "port_unreachable",
            format!("nothing answered on the sandbox's port: {e}"),
        )
        .into_response(),
    }
}

fn is_hop_by_hop(name: &str) -> bool {
    matches!(
        name.to_ascii_lowercase().as_str(),
        "connection"
            | "keep-alive"
            | "proxy-authenticate"
            | "proxy-authorization"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
    )
}

/// Dial the sandbox's port and copy messages both ways until either side
/// closes.
async fn relay(mut client: WebSocket, url: String) {
    let upstream = match tokio_tungstenite::connect_async(&url).await {
        Ok((ws, _)) => ws,
        Err(e) => {
            tracing::debug!(target: "harness_sandboxes", "dialling {url}: {e}");
            let _ = client
                .send(Message::Close(Some(CloseFrame {
                    code: 1011,
                    reason: "the sandbox's port did not accept a WebSocket".into(),
                })))
                .await;
            return;
        }
    };
    let (mut up_tx, mut up_rx) = upstream.split();
    let (mut down_tx, mut down_rx) = client.split();
    let to_upstream = async {
        while let Some(Ok(message)) = down_rx.next().await {
            let message = match message {
                Message::Text(t) => UpMessage::Text(t.as_str().into()),
                Message::Binary(b) => UpMessage::Binary(b),
                Message::Ping(p) => UpMessage::Ping(p),
                Message::Pong(p) => UpMessage::Pong(p),
                Message::Close(frame) => {
                    let frame =
                        frame.map(|f| tokio_tungstenite::tungstenite::protocol::CloseFrame {
                            code: CloseCode::from(f.code),
                            reason: f.reason.as_str().into(),
                        });
                    let _ = up_tx.send(UpMessage::Close(frame)).await;
                    break;
                }
            };
            if up_tx.send(message).await.is_err() {
                break;
            }
        }
        let _ = up_tx.close().await;
    };
    let to_client = async {
        while let Some(Ok(message)) = up_rx.next().await {
            let message = match message {
                UpMessage::Text(t) => Message::Text(t.as_str().into()),
                UpMessage::Binary(b) => Message::Binary(b),
                UpMessage::Ping(p) => Message::Ping(p),
                UpMessage::Pong(p) => Message::Pong(p),
                UpMessage::Close(frame) => {
                    let frame = frame.map(|f| CloseFrame {
                        code: u16::from(f.code),
                        reason: f.reason.as_str().into(),
                    });
                    let _ = down_tx.send(Message::Close(frame)).await;
                    break;
                }
                UpMessage::Frame(_) => continue,
            };
            if down_tx.send(message).await.is_err() {
                break;
            }
        }
        let _ = down_tx.close().await;
    };
    // Either direction ending ends the relay (the other side is closed).
    tokio::select! {
        _ = to_upstream => {}
        _ = to_client => {}
    }
}
