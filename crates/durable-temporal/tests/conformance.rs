//! The Temporal engine passes the engine conformance suite
//! (`harness_testkit::conformance::engine`) against the real dev server,
//! with a real local sandbox and the scripted agent.
//!
//! The fixture runs each engine's worker on a dedicated OS thread with its
//! own current-thread tokio runtime and a `LocalSet` (the worker future is
//! not `Send`), polling one task queue for the whole suite, and hands out a
//! `TemporalEngine` client to it. A crash makes the thread's `block_on`
//! return at once (a oneshot wins the `select!` against `worker.run()`)
//! and drops the thread's runtime with `shutdown_background`: nothing in
//! flight completes or reports, as after `kill -9`. The next worker on
//! the queue picks the turn up once the dead one's heartbeat times out
//! (2 s, see `common::test_config`).

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context, Result};
use async_trait::async_trait;
use durable_temporal::{TemporalConfig, TemporalEngine, TurnWorker};
use harness_core::engine::{DurableEngine, SliceExecutor};
use harness_testkit::conformance::engine::{self, EngineFixture};
use tokio::sync::oneshot;

type Shutdown = Box<dyn Fn() + Send + Sync>;

/// A worker running on its own thread.
struct WorkerThread {
    thread: std::thread::JoinHandle<()>,
    /// Asks for a graceful shutdown (in-flight tasks finish).
    shutdown: Shutdown,
    /// Makes the thread drop everything at once.
    kill: oneshot::Sender<()>,
}

/// Start a worker for `config` on a new thread; returns once it is
/// registered with the server.
async fn spawn_worker(
    config: TemporalConfig,
    executor: Arc<dyn SliceExecutor>,
) -> Result<WorkerThread> {
    let (ready_tx, ready_rx) = oneshot::channel::<harness_core::Result<Shutdown>>();
    let (kill_tx, kill_rx) = oneshot::channel::<()>();
    let thread = std::thread::Builder::new()
        .name("temporal-worker".into())
        .spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("the worker thread's runtime");
            let local = tokio::task::LocalSet::new();
            let killed = local.block_on(&runtime, async move {
                let mut worker = match TurnWorker::new(&config, executor).await {
                    Ok(worker) => worker,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return false;
                    }
                };
                let _ = ready_tx.send(Ok(Box::new(worker.shutdown_handle())));
                tokio::select! {
                    result = worker.run() => {
                        if let Err(e) = result {
                            eprintln!("the worker stopped with an error: {e}");
                        }
                        false
                    }
                    _ = kill_rx => true,
                }
            });
            // Drop the local tasks (workflow code) inside the runtime's
            // context; they are never polled again.
            {
                let _context = runtime.enter();
                drop(local);
            }
            if killed {
                // Like kill -9: spawned tasks (running activities) are
                // dropped without being polled again.
                runtime.shutdown_background();
            } else {
                runtime.shutdown_timeout(Duration::from_secs(10));
            }
        })
        .context("spawning the worker thread")?;
    let shutdown = match ready_rx.await {
        Ok(Ok(shutdown)) => shutdown,
        Ok(Err(e)) => {
            let _ = tokio::task::spawn_blocking(move || thread.join()).await;
            return Err(anyhow!("the worker did not start: {e}"));
        }
        Err(_) => {
            let _ = tokio::task::spawn_blocking(move || thread.join()).await;
            return Err(anyhow!("the worker thread died while starting"));
        }
    };
    Ok(WorkerThread {
        thread,
        shutdown,
        kill: kill_tx,
    })
}

struct TemporalFixture {
    /// One task queue for the whole suite: a restarted worker must poll
    /// the queue of the turns it resumes.
    config: TemporalConfig,
    worker: Mutex<Option<WorkerThread>>,
    began: Instant,
}

impl TemporalFixture {
    fn note(&self, what: &str) {
        eprintln!("[{:>7.2?}] {what}", self.began.elapsed());
    }

    fn take(&self) -> Option<WorkerThread> {
        self.worker.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    /// Kill `worker` at once and wait for its thread.
    async fn kill(worker: WorkerThread) {
        let _ = worker.kill.send(());
        let joined = tokio::task::spawn_blocking(move || worker.thread.join()).await;
        assert!(
            matches!(joined, Ok(Ok(()))),
            "the killed worker thread panicked"
        );
    }

    /// Stop `worker` gracefully; kill it if it does not stop in 30 s.
    async fn shut_down(&self, worker: WorkerThread) {
        let t = Instant::now();
        (worker.shutdown)();
        let WorkerThread { thread, kill, .. } = worker;
        let mut join = tokio::task::spawn_blocking(move || thread.join());
        match tokio::time::timeout(Duration::from_secs(30), &mut join).await {
            Ok(joined) => {
                assert!(matches!(joined, Ok(Ok(()))), "the worker thread panicked");
                self.note(&format!("worker stopped in {:?}", t.elapsed()));
            }
            Err(_) => {
                let _ = kill.send(());
                let _ = join.await;
                panic!("the worker did not shut down in 30 s");
            }
        }
    }
}

#[async_trait]
impl EngineFixture for TemporalFixture {
    async fn start(&self, executor: Arc<dyn SliceExecutor>) -> Result<Arc<dyn DurableEngine>> {
        if let Some(old) = self.take() {
            self.shut_down(old).await;
        }
        let worker = spawn_worker(self.config.clone(), executor).await?;
        *self.worker.lock().unwrap_or_else(|e| e.into_inner()) = Some(worker);
        let engine = TemporalEngine::connect(self.config.clone()).await?;
        self.note("worker started");
        Ok(Arc::new(engine))
    }

    async fn crash(&self, _engine: Arc<dyn DurableEngine>) {
        if let Some(worker) = self.take() {
            Self::kill(worker).await;
        }
        self.note("worker killed");
    }

    async fn stop(&self, _engine: Arc<dyn DurableEngine>) {
        if let Some(worker) = self.take() {
            self.shut_down(worker).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_temporal_engine_passes_the_engine_suite() {
    let mut config = common::test_config();
    if !common::server_or_skip(&config).await {
        return;
    }
    config.task_queue = format!("dt-conformance-{}", uuid::Uuid::new_v4());
    let root = tempfile::tempdir().unwrap();
    let provider = Arc::new(sandbox_local::LocalProvider::new(root.path()));
    let fixture = TemporalFixture {
        config,
        worker: Mutex::new(None),
        began: Instant::now(),
    };
    let result = engine::run_all(&fixture, provider).await;
    if let Some(worker) = fixture.take() {
        TemporalFixture::kill(worker).await;
    }
    fixture.note("suite done");
    if let Err(e) = result {
        panic!("{e:?}");
    }
}
