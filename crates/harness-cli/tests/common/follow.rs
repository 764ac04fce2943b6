//! A client following a session over SSE, and what it saw.

use std::sync::{Arc, Mutex};

use futures::StreamExt;
use serde_json::Value;

use super::server::{http, Serve, CLIENT};

/// What a client saw: stored frames (in order) and live parts.
#[derive(Debug, Default, Clone)]
pub struct Seen {
    pub frames: Vec<Value>,
    pub live: Vec<Value>,
}

impl Seen {
    pub fn push_frame(&mut self, frame: Value) {
        self.frames.push(frame);
    }

    /// The terminal status of `turn`, once seen.
    pub fn end(&self, turn: &str) -> Option<Value> {
        self.frames
            .iter()
            .find(|f| {
                let b = &f["body"];
                b["type"] == "turn-status"
                    && b["turnId"] == turn
                    && matches!(
                        b["status"].as_str(),
                        Some("finished" | "failed" | "timed_out")
                    )
            })
            .map(|f| f["body"].clone())
    }

    pub fn parts(&self, turn: &str, kind: &str) -> Vec<Value> {
        self.frames
            .iter()
            .filter(|f| {
                f["body"]["type"] == "part"
                    && f["body"]["turnId"] == turn
                    && f["body"]["part"]["type"] == kind
            })
            .map(|f| f["body"]["part"].clone())
            .collect()
    }

    pub fn live_deltas(&self, turn: &str) -> usize {
        self.live
            .iter()
            .filter(|l| l["turnId"] == turn && l["part"]["type"] == "text-delta")
            .count()
    }
}

/// A client following a session over SSE (`/events?after=0`) in the
/// background.
pub struct SseClient {
    seen: Arc<Mutex<Seen>>,
}

impl SseClient {
    pub async fn open(serve: &Serve, id: &str) -> SseClient {
        Self::open_from(serve, id, None).await
    }

    /// Follow from the start, or, with `last_event_id`, resume after that
    /// seq as a reconnecting `EventSource` does (`Last-Event-ID`).
    pub async fn open_from(serve: &Serve, id: &str, last_event_id: Option<u64>) -> SseClient {
        let request = match last_event_id {
            None => http()
                .get(serve.url(&format!("/v1/sessions/{id}/events?after=0")))
                .bearer_auth(CLIENT),
            Some(seq) => http()
                .get(serve.url(&format!("/v1/sessions/{id}/events")))
                .bearer_auth(CLIENT)
                .header("last-event-id", seq.to_string()),
        };
        let response = request.send().await.unwrap();
        assert_eq!(response.status(), 200);
        let seen = Arc::new(Mutex::new(Seen::default()));
        let sink = seen.clone();
        tokio::spawn(async move {
            let mut body = response.bytes_stream();
            let mut buffer = String::new();
            while let Some(Ok(chunk)) = body.next().await {
                buffer.push_str(&String::from_utf8_lossy(&chunk));
                while let Some(end) = buffer.find("\n\n") {
                    let block: String = buffer.drain(..end + 2).collect();
                    let mut event = "";
                    let mut data = String::new();
                    for line in block.lines() {
                        if let Some(v) = line.strip_prefix("event:") {
                            event = v.trim();
                        } else if let Some(v) = line.strip_prefix("data:") {
                            data.push_str(v.trim_start());
                        }
                    }
                    let Ok(value) = serde_json::from_str::<Value>(&data) else {
                        continue;
                    };
                    let mut seen = sink.lock().unwrap();
                    match event {
                        "frame" => seen.push_frame(value),
                        "live" => seen.live.push(value),
                        _ => {}
                    }
                }
            }
        });
        SseClient { seen }
    }

    pub fn seen(&self) -> Seen {
        self.seen.lock().unwrap().clone()
    }
}
