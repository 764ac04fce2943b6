//! The in-process engine (harness-core) passes the engine conformance
//! suite, with a real local sandbox and the scripted agent. A "kill" drops
//! the engine's own tokio runtime without letting anything finish, as
//! `kill -9` of its process would; the next engine shares its turn store.

use std::sync::{Arc, Mutex};

use anyhow::Result;
use async_trait::async_trait;
use harness_core::engine::{DurableEngine, InProcessEngine, MemoryTurnStore, SliceExecutor};
use harness_testkit::conformance::engine::{self, EngineFixture};
use session_runtime::SystemClock;

struct InProcess {
    store: Arc<MemoryTurnStore>,
    /// The runtime of the engine started last: its tasks are the engine.
    runtime: Mutex<Option<tokio::runtime::Runtime>>,
    generation: std::sync::atomic::AtomicU64,
}

#[async_trait]
impl EngineFixture for InProcess {
    async fn start(&self, executor: Arc<dyn SliceExecutor>) -> Result<Arc<dyn DurableEngine>> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()?;
        let handle = runtime.handle().clone();
        let generation = self
            .generation
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let engine = InProcessEngine::new(
            executor,
            self.store.clone(),
            Arc::new(SystemClock),
            Arc::new(move |f| {
                handle.spawn(f);
            }),
        )
        .with_generation(generation);
        engine.resume_unfinished().await?;
        if let Some(old) = self.runtime.lock().unwrap().replace(runtime) {
            old.shutdown_background();
        }
        Ok(Arc::new(engine))
    }

    async fn crash(&self, _engine: Arc<dyn DurableEngine>) {
        if let Some(runtime) = self.runtime.lock().unwrap().take() {
            runtime.shutdown_background();
        }
    }

    async fn stop(&self, engine: Arc<dyn DurableEngine>) {
        self.crash(engine).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_in_process_engine_passes_the_engine_suite() {
    let root = tempfile::tempdir().unwrap();
    let provider = Arc::new(sandbox_local::LocalProvider::new(root.path()));
    let fixture = InProcess {
        store: Arc::new(MemoryTurnStore::default()),
        runtime: Mutex::new(None),
        generation: std::sync::atomic::AtomicU64::new(1),
    };
    engine::run_all(&fixture, provider).await.unwrap();
}
