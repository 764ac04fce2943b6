//! The floor for live delivery: a fan-out server that does the least a
//! server can do per delivery — one pre-encoded chunk per event, one
//! `write` per reader of whatever is queued for it — with no log, no
//! actor, no HTTP library. It speaks just enough
//! HTTP/1.1 for the bench's readers (an endless chunked SSE body for any
//! `GET`) and its writer (a `POST` whose body becomes the event's data,
//! answered `200` on a kept-alive connection). Each event carries a `seq`
//! (from 1) and the posted body, so the readers check order and find the
//! writer's stamp as they do on our streams, and its size is close to
//! ours.
//!
//! Served on a 2-thread runtime of its own, as our servers are: the
//! difference between its p99 and ours is what our server adds; its own
//! p99 is what these 2 cores, loopback TCP and the readers cost.
//!
//! [`start_durable`] is the same server with the one thing our streams
//! promise on top: an event goes out only once it is stored. Each `POST`
//! is appended to a SQLite session log (the writer thread's group commit,
//! as ours) and fanned out after its commit, with the log's seq. The gap
//! between the two floors is what durability costs on this machine; the
//! gap between the durable floor and ours is what the rest of our server
//! (HTTP routing, the session actor, per-stream encoding) costs.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use harness_core::frame::FrameBody;
use harness_core::log::{AppendRequest, SessionLog};
use harness_core::SessionId;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::broadcast;

/// Events a slow reader may be behind before it is dropped.
const BEHIND: usize = 65_536;

struct Fanout {
    /// The next seq and the channel, together: events go out in seq order.
    next: Mutex<Order>,
    /// Where each event is stored before it goes out ([`start_durable`]).
    log: Option<(Arc<dyn SessionLog>, SessionId)>,
}

struct Order {
    /// The seq of the next event to go out.
    next: u64,
    /// Stored events waiting for an earlier one's append to return
    /// (appends run concurrently, so the log's group commit batches them
    /// as it does ours).
    waiting: BTreeMap<u64, Bytes>,
    tx: broadcast::Sender<Bytes>,
}

/// One event's chunk of the endless body.
fn chunk(seq: u64, body: &[u8]) -> Bytes {
    let mut data = format!("id: {seq}\ndata: {{\"seq\":{seq},\"body\":").into_bytes();
    data.extend_from_slice(body);
    data.extend_from_slice(b"}\n\n");
    let mut chunk = format!("{:x}\r\n", data.len()).into_bytes();
    chunk.extend_from_slice(&data);
    chunk.extend_from_slice(b"\r\n");
    Bytes::from(chunk)
}

/// Start it; returns its base URL and the runtime that serves it.
pub fn start() -> anyhow::Result<(String, super::servers::Server)> {
    serve(None)
}

/// Start it with every event appended to `log` (session `session`, which
/// must exist) before it goes out.
pub fn start_durable(
    log: Arc<dyn SessionLog>,
    session: SessionId,
) -> anyhow::Result<(String, super::servers::Server)> {
    serve(Some((log, session)))
}

fn serve(
    log: Option<(Arc<dyn SessionLog>, SessionId)>,
) -> anyhow::Result<(String, super::servers::Server)> {
    let (listener, base, rt) = super::servers::listener_and_runtime("floor-server")?;
    let fanout = Arc::new(Fanout {
        next: Mutex::new(Order {
            next: 1,
            waiting: BTreeMap::new(),
            tx: broadcast::channel(BEHIND).0,
        }),
        log,
    });
    rt.spawn(async move {
        let listener = tokio::net::TcpListener::from_std(listener).expect("listener");
        while let Ok((tcp, _)) = listener.accept().await {
            let _ = tcp.set_nodelay(true);
            tokio::spawn(connection(tcp, fanout.clone()));
        }
    });
    Ok((base, super::servers::Server::Ours(Some(rt))))
}

async fn connection(mut tcp: TcpStream, fanout: Arc<Fanout>) -> anyhow::Result<()> {
    let mut buf = Vec::with_capacity(4096);
    loop {
        // One request head.
        let head_end = loop {
            if let Some(at) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break at + 4;
            }
            if tcp.read_buf(&mut buf).await? == 0 {
                return Ok(());
            }
        };
        let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
        if head.starts_with("get ") {
            let mut events = fanout.next.lock().unwrap().tx.subscribe();
            tcp.write_all(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
                  cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n",
            )
            .await?;
            let mut out = Vec::with_capacity(64 * 1024);
            loop {
                // Fell more than `BEHIND` events back (as our hub does,
                // the reader is dropped), or the server is going.
                let Ok(first) = events.recv().await else {
                    return Ok(());
                };
                out.extend_from_slice(&first);
                // What is queued goes out in one write, as our streams
                // write a run of frames per chunk: without it this server
                // falls seconds behind at 1,000 frames/s.
                loop {
                    match events.try_recv() {
                        Ok(chunk) => out.extend_from_slice(&chunk),
                        Err(broadcast::error::TryRecvError::Empty) => break,
                        Err(_) => return Ok(()),
                    }
                }
                tcp.write_all(&out).await?;
                out.clear();
            }
        }
        let length: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0);
        while buf.len() < head_end + length {
            if tcp.read_buf(&mut buf).await? == 0 {
                return Ok(());
            }
        }
        let body = &buf[head_end..head_end + length];
        match &fanout.log {
            None => {
                let mut order = fanout.next.lock().unwrap();
                let seq = order.next;
                order.next += 1;
                // No reader yet is not an error.
                let _ = order.tx.send(chunk(seq, body));
            }
            // Stored (committed) first, with the log's seq; out in seq order.
            Some((log, session)) => {
                let value: serde_json::Value = serde_json::from_slice(body)?;
                let frame = FrameBody::Part {
                    turn_id: "t1".into(),
                    part: harness_core::part::StreamPart::Raw { value },
                };
                let seq = log
                    .append(session, AppendRequest::new(frame))
                    .await?
                    .frame
                    .seq;
                let mut order = fanout.next.lock().unwrap();
                order.waiting.insert(seq, chunk(seq, body));
                loop {
                    let next = order.next;
                    let Some(ready) = order.waiting.remove(&next) else {
                        break;
                    };
                    order.next += 1;
                    let _ = order.tx.send(ready);
                }
            }
        }
        buf.drain(..head_end + length);
        tcp.write_all(
            b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-type: application/json\r\n\r\n{}",
        )
        .await?;
    }
}
