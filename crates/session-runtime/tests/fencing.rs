//! Two runners for one session, the older one paused while it runs: the
//! newer one takes the turn over and fences it, and when the old one wakes
//! up it writes nothing more — its pending write is refused and its engine
//! stops the turn without saving or killing anything. Real local sandbox,
//! the scripted agent, the real in-process engine and hub.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use harness_core::engine::{DurableEngine, InProcessEngine, MemoryTurnStore, TurnStore};
use harness_core::frame::{FrameBody, SessionId};
use harness_core::harness::Harness;
use harness_core::log::{MemorySessionLog, SessionLog};
use harness_core::part::StreamPart;
use harness_core::session::SandboxConfig;
use harness_core::slice::{PartSink, SliceRunner};
use harness_core::turn::{TurnState, TurnStatus};
use harness_core::ErrorKind;
use harness_testkit::agent::{ScriptHarness, SCRIPT_AGENT};
use session_runtime::{tokio_sleeper, Hub, HubConfig, HubConnector, RunnerSink, SystemClock};
use tokio::sync::Semaphore;

/// A sink that lets `open` parts through, then holds the next one until
/// released — a runner paused in the middle of a slice — and records what
/// became of that held write.
struct PausingSink {
    inner: RunnerSink,
    open: Mutex<u32>,
    paused: Semaphore,
    release: Semaphore,
    held_result: Mutex<Option<harness_core::Result<()>>>,
}

#[async_trait]
impl PartSink for PausingSink {
    async fn emit(
        &self,
        session_id: &str,
        turn_id: &str,
        part: StreamPart,
        key: String,
    ) -> harness_core::Result<()> {
        let hold = {
            let mut open = self.open.lock().unwrap();
            if *open == 0 {
                true
            } else {
                *open -= 1;
                false
            }
        };
        if !hold {
            return self.inner.emit(session_id, turn_id, part, key).await;
        }
        self.paused.add_permits(1);
        let _go = self.release.acquire().await.unwrap();
        let result = self.inner.emit(session_id, turn_id, part, key).await;
        *self.held_result.lock().unwrap() = Some(match &result {
            Ok(()) => Ok(()),
            Err(e) => Err(harness_core::Error::new(e.kind(), e.message())),
        });
        result
    }

    async fn turn_status(&self, state: &TurnState) -> harness_core::Result<()> {
        self.inner.turn_status(state).await
    }
}

fn runner(provider: Arc<sandbox_local::LocalProvider>, sink: Arc<dyn PartSink>) -> SliceRunner {
    let mut providers: BTreeMap<String, Arc<dyn harness_core::sandbox::SandboxProvider>> =
        BTreeMap::new();
    providers.insert("local".into(), provider);
    let mut harnesses: BTreeMap<String, Arc<dyn Harness>> = BTreeMap::new();
    harnesses.insert(SCRIPT_AGENT.into(), Arc::new(ScriptHarness));
    SliceRunner {
        providers,
        harnesses,
        sink,
        env: BTreeMap::new(),
        broker: None,
        model: None,
        poll_interval: Duration::from_millis(50),
        sleep: tokio_sleeper(),
        clock: Arc::new(SystemClock),
        checkpoints: None,
    }
}

fn engine(
    runner: SliceRunner,
    store: Arc<MemoryTurnStore>,
    runtime: &tokio::runtime::Runtime,
    generation: u64,
) -> InProcessEngine {
    let handle = runtime.handle().clone();
    InProcessEngine::new(
        Arc::new(runner),
        store,
        Arc::new(SystemClock),
        Arc::new(move |f| {
            handle.spawn(f);
        }),
    )
    .with_generation(generation)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_runner_is_fenced_and_writes_nothing_more() {
    let root = tempfile::tempdir().unwrap();
    let provider = Arc::new(sandbox_local::LocalProvider::new(root.path()));
    let log = Arc::new(MemorySessionLog::new());
    let hub = Hub::new(log.clone(), HubConfig::default());
    let session = SessionId::parse("fenced").unwrap();
    log.create(&session).await.unwrap();
    let store = Arc::new(MemoryTurnStore::default());

    // Runner A (generation 1): lets 6 parts through (two lines), then
    // pauses on the 7th.
    let a_sink = Arc::new(PausingSink {
        inner: RunnerSink::new(Arc::new(HubConnector::new(hub.clone())), 1),
        open: Mutex::new(6),
        paused: Semaphore::new(0),
        release: Semaphore::new(0),
        held_result: Mutex::new(None),
    });
    let a_runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let a = engine(
        runner(provider.clone(), a_sink.clone()),
        store.clone(),
        &a_runtime,
        1,
    );
    let mut state = TurnState::new("fenced", "t1", SCRIPT_AGENT, "lines=12 delay=0.05");
    state.sandbox_config = Some(SandboxConfig::default());
    a.start_turn(state).await.unwrap();
    tokio::time::timeout(Duration::from_secs(60), a_sink.paused.acquire())
        .await
        .expect("runner A reached its pause")
        .unwrap()
        .forget();

    // Runner B (generation 2) on the same turn store takes the turn over.
    let b_runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let b_sink = Arc::new(RunnerSink::new(Arc::new(HubConnector::new(hub.clone())), 2));
    let b = engine(
        runner(provider.clone(), b_sink),
        store.clone(),
        &b_runtime,
        2,
    );
    assert_eq!(b.resume_unfinished().await.unwrap(), 1);
    let done = tokio::time::timeout(Duration::from_secs(60), b.wait_turn("fenced", "t1"))
        .await
        .expect("runner B finishes the turn")
        .unwrap();
    assert_eq!(done.status, TurnStatus::Finished, "{done:?}");

    // Runner A wakes up: its held write is refused as fenced, and its
    // engine stops the turn (its waiter hears `Fenced`).
    let a_waits = tokio::spawn({
        let a = a.clone();
        async move { a.wait_turn("fenced", "t1").await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    a_sink.release.add_permits(1);
    let a_end = tokio::time::timeout(Duration::from_secs(30), a_waits)
        .await
        .expect("runner A stops at once")
        .unwrap();
    assert_eq!(
        a_end.as_ref().map_err(|e| e.kind()).unwrap_err(),
        ErrorKind::Fenced,
        "{a_end:?}"
    );
    let held = a_sink
        .held_result
        .lock()
        .unwrap()
        .take()
        .expect("A tried its write");
    assert_eq!(held.unwrap_err().kind(), ErrorKind::Fenced);

    // The log: every line once, in order, gap-free, one end, and the two
    // generations in order. A's state did not overwrite B's.
    let frames = log.read(&session, 0, 10_000).await.unwrap();
    for (i, f) in frames.iter().enumerate() {
        assert_eq!(f.seq, i as u64 + 1, "gap-free");
    }
    let lines: Vec<String> = frames
        .iter()
        .filter_map(|f| match &f.body {
            FrameBody::Message { text, .. } => Some(text.clone()),
            _ => None,
        })
        .collect();
    let want: Vec<String> = (0..12).map(|i| format!("line {i}")).collect();
    assert_eq!(lines, want, "every line once, in order");
    let ends = frames
        .iter()
        .filter(|f| matches!(&f.body, FrameBody::TurnStatus { status, .. } if status.is_terminal()))
        .count();
    assert_eq!(ends, 1);
    let generations: Vec<u64> = frames
        .iter()
        .filter_map(|f| match f.body {
            FrameBody::RunnerAttached { generation } => Some(generation),
            _ => None,
        })
        .collect();
    assert_eq!(generations, vec![1, 2]);
    let stored = store.load("fenced", "t1").await.unwrap().unwrap();
    assert_eq!(stored.status, TurnStatus::Finished);
    assert!(stored.end_recorded);
    a_runtime.shutdown_background();
    b_runtime.shutdown_background();
}
