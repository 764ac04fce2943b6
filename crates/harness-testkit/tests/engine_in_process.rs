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

impl Drop for InProcess {
    // A case that fails before stopping its engine leaves the runtime here;
    // dropping a runtime inside the test's async context would panic.
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.lock().unwrap().take() {
            runtime.shutdown_background();
        }
    }
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

/// An engine that acknowledges aborts and does nothing with them.
#[derive(Debug)]
struct IgnoresAborts(Arc<dyn DurableEngine>);

#[async_trait]
impl DurableEngine for IgnoresAborts {
    fn name(&self) -> &'static str {
        "ignores-aborts"
    }
    async fn start_turn(&self, state: harness_core::turn::TurnState) -> harness_core::Result<()> {
        self.0.start_turn(state).await
    }
    async fn turn_state(
        &self,
        s: &str,
        t: &str,
    ) -> harness_core::Result<harness_core::turn::TurnState> {
        self.0.turn_state(s, t).await
    }
    async fn answer_approval(
        &self,
        s: &str,
        t: &str,
        answer: harness_core::turn::ApprovalAnswer,
    ) -> harness_core::Result<()> {
        self.0.answer_approval(s, t, answer).await
    }
    async fn abort_turn(&self, _s: &str, _t: &str, _reason: &str) -> harness_core::Result<()> {
        Ok(())
    }
    async fn wait_turn(
        &self,
        s: &str,
        t: &str,
    ) -> harness_core::Result<harness_core::turn::TurnState> {
        self.0.wait_turn(s, t).await
    }
}

struct Broken(InProcess);

#[async_trait]
impl EngineFixture for Broken {
    async fn start(&self, executor: Arc<dyn SliceExecutor>) -> Result<Arc<dyn DurableEngine>> {
        Ok(Arc::new(IgnoresAborts(self.0.start(executor).await?)))
    }
    async fn crash(&self, engine: Arc<dyn DurableEngine>) {
        self.0.crash(engine).await
    }
    async fn stop(&self, engine: Arc<dyn DurableEngine>) {
        self.0.stop(engine).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engine_suite_catches_an_engine_that_ignores_aborts() {
    let root = tempfile::tempdir().unwrap();
    let provider = Arc::new(sandbox_local::LocalProvider::new(root.path()));
    let fixture = Broken(InProcess {
        store: Arc::new(MemoryTurnStore::default()),
        runtime: Mutex::new(None),
        generation: std::sync::atomic::AtomicU64::new(1),
    });
    let rig = engine::Rig::new(provider);
    let err = engine::abort_cuts_a_running_slice_short(&fixture, &rig)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("Finished"), "{err:#}");
}
