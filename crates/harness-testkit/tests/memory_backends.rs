//! The in-memory backends from harness-core pass the conformance suites, and
//! each suite catches a plausible bug in a deliberately broken backend.

use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use harness_core::checkpoint::{CheckpointStore, MemoryCheckpointStore, ObjectMeta};
use harness_core::engine::{MemoryTurnStore, TurnStore};
use harness_core::frame::{Frame, SessionId};
use harness_core::log::{AppendRequest, Appended, LogInfo, MemorySessionLog, SessionLog};
use harness_core::session::SessionConfig;
use harness_core::stream::ByteStream;
use harness_testkit::conformance::{checkpoint, log, retention, turn_store};

#[tokio::test]
async fn memory_session_log_passes_the_suite() {
    log::run_all(|| async { Arc::new(MemorySessionLog::new()) as Arc<dyn SessionLog> })
        .await
        .unwrap();
}

#[tokio::test]
async fn memory_session_log_passes_the_retention_suite() {
    let key = harness_core::log::ChainKey::new(*b"memory retention");
    retention::run_all(
        || async {
            Arc::new(MemorySessionLog::new().with_chain_key(key.clone())) as Arc<dyn SessionLog>
        },
        &key,
    )
    .await
    .unwrap();
}

/// The memory store under test, tampered with through its test hook.
fn memory_store() -> checkpoint::StoreUnderTest {
    let store = MemoryCheckpointStore::new();
    let handle = store.clone();
    checkpoint::StoreUnderTest::new(
        Arc::new(store),
        Arc::new(move |key: String, bytes: bytes::Bytes| {
            handle.corrupt_for_test(&key, bytes);
            Box::pin(async { anyhow::Ok(()) })
        }),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_session_log_handles_share_one_log() {
    let shared = MemorySessionLog::new();
    let handles: Vec<Arc<dyn SessionLog>> = (0..3)
        .map(|_| Arc::new(shared.clone()) as Arc<dyn SessionLog>)
        .collect();
    log::handles_on_one_store(handles).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_turn_store_passes_the_suite() {
    turn_store::run_all(|| async { Arc::new(MemoryTurnStore::default()) as Arc<dyn TurnStore> })
        .await
        .unwrap();
}

#[tokio::test]
async fn memory_checkpoint_store_passes_the_suite() {
    checkpoint::run_all(|| async { memory_store() })
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_checkpoint_store_passes_the_race_on_threads() {
    checkpoint::concurrent_writers_and_readers_on_one_key(memory_store().store)
        .await
        .unwrap();
}

/// A log that forgets idempotency keys: every retry stores a new frame.
#[derive(Debug, Default)]
struct ForgetsKeys(MemorySessionLog);

#[async_trait]
impl SessionLog for ForgetsKeys {
    async fn create_with(
        &self,
        s: &SessionId,
        c: Option<SessionConfig>,
    ) -> harness_core::Result<LogInfo> {
        self.0.create_with(s, c).await
    }
    async fn info(&self, s: &SessionId) -> harness_core::Result<LogInfo> {
        self.0.info(s).await
    }
    async fn append(&self, s: &SessionId, mut r: AppendRequest) -> harness_core::Result<Appended> {
        r.idempotency_key = None;
        self.0.append(s, r).await
    }
    async fn read(
        &self,
        s: &SessionId,
        after: u64,
        limit: usize,
    ) -> harness_core::Result<Vec<Frame>> {
        self.0.read(s, after, limit).await
    }
    async fn seal(&self, s: &SessionId) -> harness_core::Result<LogInfo> {
        self.0.seal(s).await
    }
    async fn fork(&self, a: &SessionId, u: u64, b: &SessionId) -> harness_core::Result<LogInfo> {
        self.0.fork(a, u, b).await
    }
    async fn list(&self) -> harness_core::Result<Vec<LogInfo>> {
        self.0.list().await
    }
}

/// A log whose seqs skip a number after the third frame (a gap).
#[derive(Debug, Default)]
struct SkipsASeq(MemorySessionLog);

#[async_trait]
impl SessionLog for SkipsASeq {
    async fn create_with(
        &self,
        s: &SessionId,
        c: Option<SessionConfig>,
    ) -> harness_core::Result<LogInfo> {
        self.0.create_with(s, c).await
    }
    async fn info(&self, s: &SessionId) -> harness_core::Result<LogInfo> {
        self.0.info(s).await
    }
    async fn append(&self, s: &SessionId, r: AppendRequest) -> harness_core::Result<Appended> {
        let mut a = self.0.append(s, r).await?;
        if a.seq > 3 {
            a.seq += 1;
        }
        Ok(a)
    }
    async fn read(
        &self,
        s: &SessionId,
        after: u64,
        limit: usize,
    ) -> harness_core::Result<Vec<Frame>> {
        self.0.read(s, after, limit).await
    }
    async fn seal(&self, s: &SessionId) -> harness_core::Result<LogInfo> {
        self.0.seal(s).await
    }
    async fn fork(&self, a: &SessionId, u: u64, b: &SessionId) -> harness_core::Result<LogInfo> {
        self.0.fork(a, u, b).await
    }
    async fn list(&self) -> harness_core::Result<Vec<LogInfo>> {
        self.0.list().await
    }
}

#[tokio::test]
async fn log_suite_catches_a_non_idempotent_append() {
    let err = log::idempotent_append(Arc::new(ForgetsKeys::default()))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("retry returned"), "{err}");
}

/// A log that keeps its meta but only folds it on create (a backend that
/// forgot to fold appends into it).
#[derive(Debug, Default)]
struct StaleMeta(MemorySessionLog);

#[async_trait]
impl SessionLog for StaleMeta {
    async fn create_with(
        &self,
        s: &SessionId,
        c: Option<SessionConfig>,
    ) -> harness_core::Result<LogInfo> {
        self.0.create_with(s, c).await
    }
    async fn info(&self, s: &SessionId) -> harness_core::Result<LogInfo> {
        let mut info = self.0.info(s).await?;
        info.meta = harness_core::session::SessionMeta::new(info.meta.config.clone());
        Ok(info)
    }
    async fn append(&self, s: &SessionId, r: AppendRequest) -> harness_core::Result<Appended> {
        self.0.append(s, r).await
    }
    async fn read(
        &self,
        s: &SessionId,
        after: u64,
        limit: usize,
    ) -> harness_core::Result<Vec<Frame>> {
        self.0.read(s, after, limit).await
    }
    async fn seal(&self, s: &SessionId) -> harness_core::Result<LogInfo> {
        self.0.seal(s).await
    }
    async fn fork(&self, a: &SessionId, u: u64, b: &SessionId) -> harness_core::Result<LogInfo> {
        self.0.fork(a, u, b).await
    }
    async fn list(&self) -> harness_core::Result<Vec<LogInfo>> {
        self.0.list().await
    }
}

#[tokio::test]
async fn log_suite_catches_a_meta_that_is_not_folded() {
    let err = log::meta_is_folded_with_every_append(Arc::new(StaleMeta::default()))
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("is not the frames folded"),
        "{err}"
    );
}

/// A log that keeps numbers with less precision than it was given (as a
/// store parsing floats inexactly, or keeping them as 32-bit, would): the
/// frames it reads back have every float rounded to f32.
#[derive(Debug, Default)]
struct RoundsFloats(MemorySessionLog);

fn round_floats(value: &mut serde_json::Value) {
    match value {
        serde_json::Value::Number(n) if n.is_f64() => {
            *value = serde_json::json!(n.as_f64().unwrap() as f32 as f64);
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(round_floats),
        serde_json::Value::Object(map) => map.values_mut().for_each(round_floats),
        _ => {}
    }
}

#[async_trait]
impl SessionLog for RoundsFloats {
    async fn create_with(
        &self,
        s: &SessionId,
        c: Option<SessionConfig>,
    ) -> harness_core::Result<LogInfo> {
        self.0.create_with(s, c).await
    }
    async fn info(&self, s: &SessionId) -> harness_core::Result<LogInfo> {
        self.0.info(s).await
    }
    async fn append(&self, s: &SessionId, r: AppendRequest) -> harness_core::Result<Appended> {
        self.0.append(s, r).await
    }
    async fn read(
        &self,
        s: &SessionId,
        after: u64,
        limit: usize,
    ) -> harness_core::Result<Vec<Frame>> {
        let mut frames = self.0.read(s, after, limit).await?;
        for frame in &mut frames {
            let mut body = serde_json::to_value(&frame.body).unwrap();
            round_floats(&mut body);
            frame.body = serde_json::from_value(body).unwrap();
        }
        Ok(frames)
    }
    async fn seal(&self, s: &SessionId) -> harness_core::Result<LogInfo> {
        self.0.seal(s).await
    }
    async fn fork(&self, a: &SessionId, u: u64, b: &SessionId) -> harness_core::Result<LogInfo> {
        self.0.fork(a, u, b).await
    }
    async fn list(&self) -> harness_core::Result<Vec<LogInfo>> {
        self.0.list().await
    }
}

#[tokio::test]
async fn log_suite_catches_numbers_that_change() {
    let err = log::numbers_read_back_exactly(Arc::new(RoundsFloats::default()))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("read back"), "{err}");
}

#[tokio::test]
async fn log_suite_catches_a_seq_gap() {
    let err = log::seq_starts_at_one_without_gaps(Arc::new(SkipsASeq::default()))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("expected seq 4"), "{err}");
}

/// A store that publishes a partial object when the upload stream fails
/// (a plausible bug: writing straight to the final key).
#[derive(Debug, Default)]
struct PublishesPartialPuts {
    inner: MemoryCheckpointStore,
    chunks: Mutex<Vec<bytes::Bytes>>,
}

#[async_trait]
impl CheckpointStore for PublishesPartialPuts {
    async fn put(&self, key: &str, mut content: ByteStream) -> harness_core::Result<ObjectMeta> {
        use futures::StreamExt;
        let mut got = Vec::new();
        let mut failed = None;
        while let Some(c) = content.next().await {
            match c {
                Ok(c) => got.push(c),
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        *self.chunks.lock().unwrap() = got.clone();
        let meta = self
            .inner
            .put(
                key,
                Box::pin(futures::stream::iter(got.into_iter().map(Ok))),
            )
            .await?;
        match failed {
            Some(e) => Err(e),
            None => Ok(meta),
        }
    }
    async fn get(&self, key: &str) -> harness_core::Result<ByteStream> {
        self.inner.get(key).await
    }
    async fn head(&self, key: &str) -> harness_core::Result<ObjectMeta> {
        self.inner.head(key).await
    }
    async fn list(&self, prefix: &str) -> harness_core::Result<Vec<ObjectMeta>> {
        self.inner.list(prefix).await
    }
    async fn delete(&self, key: &str) -> harness_core::Result<()> {
        self.inner.delete(key).await
    }
}

#[tokio::test]
async fn checkpoint_suite_catches_a_partial_put() {
    let err = checkpoint::failed_put_leaves_previous(Arc::new(PublishesPartialPuts::default()))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("previous object changed"), "{err}");
}

/// A store whose ranged read includes the byte after the range (a
/// plausible bug: an inclusive `Range` header end taken as exclusive).
#[derive(Debug, Default)]
struct RangeOneTooLong {
    inner: MemoryCheckpointStore,
}

#[async_trait]
impl CheckpointStore for RangeOneTooLong {
    async fn put(&self, key: &str, content: ByteStream) -> harness_core::Result<ObjectMeta> {
        self.inner.put(key, content).await
    }
    async fn get(&self, key: &str) -> harness_core::Result<ByteStream> {
        self.inner.get(key).await
    }
    async fn head(&self, key: &str) -> harness_core::Result<ObjectMeta> {
        self.inner.head(key).await
    }
    async fn list(&self, prefix: &str) -> harness_core::Result<Vec<ObjectMeta>> {
        self.inner.list(prefix).await
    }
    async fn delete(&self, key: &str) -> harness_core::Result<()> {
        self.inner.delete(key).await
    }
    async fn get_range(
        &self,
        key: &str,
        range: std::ops::Range<u64>,
    ) -> harness_core::Result<bytes::Bytes> {
        let size = self.inner.head(key).await?.size;
        let end = (range.end + 1).min(size).max(range.end);
        self.inner.get_range(key, range.start..end).await
    }
}

#[tokio::test]
async fn checkpoint_suite_catches_a_range_one_byte_too_long() {
    let err = checkpoint::ranged_reads(Arc::new(RangeOneTooLong::default()))
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("that differ from the content"),
        "{err}"
    );
}
