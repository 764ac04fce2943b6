//! An OTLP/HTTP trace receiver on loopback: what `harness --otlp URL`
//! exports, flattened to [`Span`]s. Shared by `tests/otlp.rs` (the spans
//! nest as documented) and `benches/ready.rs` (where a session's first
//! seconds go). Not in `common/mod.rs`: only those two include it.

#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::State;
use axum::routing::post;
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use prost::Message;

/// A received span, flattened.
#[derive(Debug, Clone)]
pub struct Span {
    pub name: String,
    pub trace: Vec<u8>,
    pub id: Vec<u8>,
    pub parent: Vec<u8>,
    pub service: String,
    /// Start and end, nanoseconds since the Unix epoch (the exporting
    /// process's wall clock: on one machine, the same clock as ours).
    pub start_ns: u64,
    pub end_ns: u64,
    pub attributes: HashMap<String, String>,
}

impl Span {
    pub fn attr(&self, key: &str) -> &str {
        self.attributes.get(key).map_or("", String::as_str)
    }

    /// Its duration in milliseconds.
    pub fn ms(&self) -> f64 {
        self.end_ns.saturating_sub(self.start_ns) as f64 / 1e6
    }
}

pub type Received = Arc<Mutex<Vec<Span>>>;

/// Serve `POST /v1/traces` on a free loopback port; the endpoint to give
/// `--otlp`, and what arrives there.
pub async fn receiver() -> (String, Received) {
    let received: Received = Arc::default();
    let app = axum::Router::new()
        .route("/v1/traces", post(receive))
        .with_state(received.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, received)
}

async fn receive(State(received): State<Received>, body: Bytes) -> Vec<u8> {
    let request = ExportTraceServiceRequest::decode(body).expect("an OTLP protobuf export");
    let mut spans = received.lock().unwrap();
    for resource in request.resource_spans {
        let service = resource
            .resource
            .iter()
            .flat_map(|r| &r.attributes)
            .find(|kv| kv.key == "service.name")
            .and_then(|kv| kv.value.as_ref())
            .map(|v| value_text(v.value.as_ref()))
            .unwrap_or_default();
        for scope in resource.scope_spans {
            for span in scope.spans {
                let attributes = span
                    .attributes
                    .iter()
                    .map(|kv| {
                        let value = kv.value.as_ref().and_then(|v| v.value.as_ref());
                        (kv.key.clone(), value_text(value))
                    })
                    .collect();
                spans.push(Span {
                    name: span.name,
                    trace: span.trace_id,
                    id: span.span_id,
                    parent: span.parent_span_id,
                    service: service.clone(),
                    start_ns: span.start_time_unix_nano,
                    end_ns: span.end_time_unix_nano,
                    attributes,
                });
            }
        }
    }
    ExportTraceServiceResponse::default().encode_to_vec()
}

fn value_text(value: Option<&AnyValue>) -> String {
    match value {
        Some(AnyValue::StringValue(s)) => s.clone(),
        Some(AnyValue::IntValue(i)) => i.to_string(),
        Some(AnyValue::BoolValue(b)) => b.to_string(),
        Some(AnyValue::DoubleValue(d)) => d.to_string(),
        other => format!("{other:?}"),
    }
}
