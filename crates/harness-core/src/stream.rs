//! Byte streams and cancellation, the two shapes every I/O trait shares.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use bytes::{Bytes, BytesMut};
use futures::channel::oneshot;
use futures::future::{FutureExt, Shared};
use futures::{Stream, StreamExt};

use crate::{Error, Result};

/// A stream of byte chunks. Every large payload in the crate (files, tar
/// archives, checkpoints) travels as one of these so that nothing has to be
/// held in memory whole.
#[cfg(not(target_arch = "wasm32"))]
pub type ByteStream = Pin<Box<dyn Stream<Item = Result<Bytes>> + Send + 'static>>;
/// A stream of byte chunks (not `Send` on wasm32, where nothing is).
#[cfg(target_arch = "wasm32")]
pub type ByteStream = Pin<Box<dyn Stream<Item = Result<Bytes>> + 'static>>;

/// A stream that yields `bytes` as a single chunk.
pub fn once(bytes: impl Into<Bytes>) -> ByteStream {
    let bytes = bytes.into();
    Box::pin(futures::stream::once(async move { Ok(bytes) }))
}

/// An empty stream.
pub fn empty() -> ByteStream {
    Box::pin(futures::stream::empty())
}

/// Collect a stream into memory, refusing to grow past `limit` bytes.
///
/// Meant for small payloads (state files, test assertions), never for trees.
pub async fn collect(mut stream: ByteStream, limit: usize) -> Result<Bytes> {
    let mut buf = BytesMut::new();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk?;
        if buf.len() + chunk.len() > limit {
            return Err(Error::invalid(format!(
                "stream is larger than the {limit}-byte limit for an in-memory read"
            )));
        }
        buf.extend_from_slice(&chunk);
    }
    Ok(buf.freeze())
}

/// A cloneable cancellation signal: one side calls [`AbortSignal::abort`],
/// every clone observes it through [`AbortSignal::aborted`].
///
/// Built on `futures` alone so it works in any executor, including inside a
/// Durable Object.
#[derive(Clone)]
pub struct AbortSignal {
    inner: Arc<AbortInner>,
    wait: Shared<oneshot::Receiver<()>>,
}

struct AbortInner {
    flag: AtomicBool,
    trigger: Mutex<Option<oneshot::Sender<()>>>,
}

impl std::fmt::Debug for AbortSignal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AbortSignal")
            .field("aborted", &self.is_aborted())
            .finish()
    }
}

impl Default for AbortSignal {
    fn default() -> Self {
        Self::new()
    }
}

impl AbortSignal {
    /// A signal that has not fired.
    pub fn new() -> Self {
        let (tx, rx) = oneshot::channel();
        Self {
            inner: Arc::new(AbortInner {
                flag: AtomicBool::new(false),
                trigger: Mutex::new(Some(tx)),
            }),
            wait: rx.shared(),
        }
    }

    /// Fire the signal. Idempotent.
    pub fn abort(&self) {
        self.inner.flag.store(true, Ordering::SeqCst);
        if let Some(tx) = self
            .inner
            .trigger
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            let _ = tx.send(());
        }
    }

    /// Whether the signal has fired.
    pub fn is_aborted(&self) -> bool {
        self.inner.flag.load(Ordering::SeqCst)
    }

    /// Resolves once the signal fires (immediately if it already has).
    pub async fn aborted(&self) {
        // The sender lives in `inner`, which this signal keeps alive, so the
        // receiver only resolves on a real abort.
        let _ = self.wait.clone().await;
    }
}
