//! The writer: one thread owning the database's write connection, which
//! commits many appends in one transaction (group commit).
//!
//! Jobs queue up while the thread works; it takes everything queued (up to
//! [`MAX_BATCH`]) at once:
//! - a plain append ([`Job::Append`] with `grouped: false`) is executed in
//!   the open transaction (begun if none) inside a savepoint, so a refused
//!   append (sealed, key reused) leaves the others alone; its caller is
//!   answered only after the transaction *committed*, which happens when the
//!   thread has handled everything it took. Concurrent appenders therefore
//!   share one commit, and an ack still means "committed".
//! - a grouped append (`grouped: true`, [`SessionLog::append_grouped`]) is
//!   executed the same way but answered at once with the open group's
//!   number; its appender (a session actor handling a batch of inputs)
//!   sends [`Job::Commit`] for that group when its batch is done, and only
//!   then acknowledges. A group left open with nothing queued is committed
//!   after [`IDLE_COMMIT`] anyway.
//! - anything else ([`Job::Exec`]: create, seal, fork, the turn store, reads
//!   of an in-memory database) first commits the open group, then runs on
//!   its own.
//!
//! A failed commit fails every append of its transaction: plain appenders
//! get the error, grouped ones get it from `Commit`, and the sessions that
//! had grouped appends in it are refused further grouped appends until
//! their appender asked for that group's result (or [`POISON_FOR`] passed),
//! so an actor never stores a frame computed from frames that were lost.
//!
//! [`SessionLog::append_grouped`]: harness_core::log::SessionLog::append_grouped

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use harness_core::log::{Appended, ChainKey, CheckedAppend};
use harness_core::{Error, ErrorKind, Result, SessionId};
use rusqlite::Connection;
use tokio::sync::oneshot;

use crate::index::{index_batch, Entry, IndexSink, Indexer};
use crate::{append_in, db_err, now_ms};

/// Most jobs taken into one transaction.
pub(crate) const MAX_BATCH: usize = 1024;

/// How long an open group waits for its appender's `Commit` (or more work)
/// before the writer commits it on its own.
const IDLE_COMMIT: Duration = Duration::from_millis(2);

/// How long a session whose group failed is refused grouped appends when
/// its appender never asks for the group's result.
const POISON_FOR: Duration = Duration::from_secs(5);

/// Failed groups remembered for `Commit` answers.
const FAILED_KEPT: usize = 1024;

type ExecFn = Box<dyn FnOnce(&mut Connection) + Send>;
type AppendReply = oneshot::Sender<Result<(Appended, u64)>>;

// Jobs live for a moment in the queue; boxing the big one buys nothing.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Job {
    Append {
        session: SessionId,
        append: CheckedAppend,
        grouped: bool,
        reply: AppendReply,
    },
    Commit {
        session: SessionId,
        group: u64,
        reply: oneshot::Sender<Result<()>>,
    },
    Exec(ExecFn),
}

#[derive(Default)]
struct Queue {
    jobs: VecDeque<Job>,
    closed: bool,
}

impl Shared {
    fn chain_key(&self) -> Arc<ChainKey> {
        self.chain_key
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

struct Shared {
    queue: Mutex<Queue>,
    wake: Condvar,
    /// Commits still to fail on purpose (tests: [`Writer::fail_next_commits`]).
    fail_commits: Arc<AtomicUsize>,
    /// Transactions of appends committed (or tried) so far.
    commits: AtomicU64,
    /// Most jobs taken into one transaction.
    max_batch: AtomicUsize,
    /// Whether a group (transaction) is open.
    open: AtomicBool,
    /// The key appends chain frames with (`harness_core::log::chain`).
    chain_key: RwLock<Arc<ChainKey>>,
}

/// The handle; dropping the last one stops the thread after the queued
/// jobs (committing what is open).
pub(crate) struct Writer {
    shared: Arc<Shared>,
    /// The connection and the open group; the thread holds it while it
    /// works, a grouped append takes it directly when it is free.
    state: Arc<Mutex<State>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// The search indexer the thread hands committed frames to; joined
    /// after the thread (whose end drops the sender).
    indexer: Mutex<Option<Indexer>>,
}

impl std::fmt::Debug for Writer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Writer").finish_non_exhaustive()
    }
}

impl Writer {
    /// Start the thread over `conn`, indexing committed frames for search:
    /// through an indexer thread on `index_conn` (a second connection to
    /// the same file), or right after each commit when there is none (an
    /// in-memory database).
    pub(crate) fn start(conn: Connection, index_conn: Option<Connection>) -> Result<Arc<Self>> {
        let (indexer, sink) = match index_conn {
            Some(c) => {
                let (indexer, sink) = Indexer::start(c)?;
                (Some(indexer), sink)
            }
            None => (None, IndexSink::Inline),
        };
        Self::start_with(conn, sink, indexer)
    }

    /// Start the thread over `conn` with no search index (the turn store's
    /// own database handle appends no frames).
    pub(crate) fn start_unindexed(conn: Connection) -> Result<Arc<Self>> {
        Self::start_with(conn, IndexSink::None, None)
    }

    fn start_with(
        conn: Connection,
        index: IndexSink,
        indexer: Option<Indexer>,
    ) -> Result<Arc<Self>> {
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue::default()),
            wake: Condvar::new(),
            fail_commits: Arc::new(AtomicUsize::new(0)),
            commits: AtomicU64::new(0),
            max_batch: AtomicUsize::new(MAX_BATCH),
            open: AtomicBool::new(false),
            chain_key: RwLock::new(Arc::new(ChainKey::unkeyed())),
        });
        let fail = shared.fail_commits.clone();
        // The hook turns a COMMIT into a ROLLBACK and makes it fail
        // (SQLITE_CONSTRAINT_COMMITHOOK): a real failed commit.
        conn.commit_hook(Some(move || {
            fail.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
                .is_ok()
        }));
        let state = State {
            shared: shared.clone(),
            conn,
            group: 0,
            open: false,
            in_group: HashSet::new(),
            waiting: Vec::new(),
            failed: BTreeMap::new(),
            poisoned: HashMap::new(),
            index,
            staged: Vec::new(),
        };
        let state = Arc::new(Mutex::new(state));
        let (thread_shared, thread_state) = (shared.clone(), state.clone());
        let thread = std::thread::Builder::new()
            .name("session-log-writer".into())
            .spawn(move || run(thread_shared, thread_state))
            .map_err(|e| Error::backend(format!("cannot start the log writer thread: {e}")))?;
        Ok(Arc::new(Self {
            shared,
            state,
            thread: Mutex::new(Some(thread)),
            indexer: Mutex::new(indexer),
        }))
    }

    fn push(&self, job: Job) {
        let mut q = self.shared.queue.lock().unwrap_or_else(|e| e.into_inner());
        if q.closed {
            // Dropping the job drops its reply sender: the caller hears
            // that the writer stopped.
            return;
        }
        q.jobs.push_back(job);
        drop(q);
        self.shared.wake.notify_one();
    }

    /// Append; answered once committed (`grouped: false`) or at once with
    /// the group to commit (`grouped: true`).
    pub(crate) async fn append(
        &self,
        session: SessionId,
        append: CheckedAppend,
        grouped: bool,
    ) -> Result<(Appended, u64)> {
        let (reply, rx) = oneshot::channel();
        let job = Job::Append {
            session,
            append,
            grouped,
            reply,
        };
        // A grouped append into a group that is already open needs no BEGIN
        // (no lock wait) and no I/O until the commit: when the connection is
        // free, do it here rather than pay two thread hand-offs. (Jobs still
        // queued are other callers', concurrent with this one.)
        let job = match grouped.then(|| self.state.try_lock().ok()).flatten() {
            Some(mut st) if st.open => {
                st.job(job);
                None
            }
            _ => Some(job),
        };
        if let Some(job) = job {
            self.push(job);
        }
        rx.await.unwrap_or_else(|_| Err(stopped()))
    }

    /// Commit `group` if still open; its outcome.
    pub(crate) async fn commit(&self, session: SessionId, group: u64) -> Result<()> {
        let (reply, rx) = oneshot::channel();
        self.push(Job::Commit {
            session,
            group,
            reply,
        });
        rx.await.unwrap_or_else(|_| Err(stopped()))
    }

    /// Run `f` on the writer's connection, outside any group.
    pub(crate) async fn exec<T, F>(&self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut Connection) -> Result<T> + Send + 'static,
    {
        let (reply, rx) = oneshot::channel();
        self.push(Job::Exec(Box::new(move |conn| {
            let _ = reply.send(f(conn));
        })));
        rx.await.unwrap_or_else(|_| Err(stopped()))
    }

    /// Queue `f` to run on the writer's connection, outside any group,
    /// without waiting for it.
    pub(crate) fn exec_detached(&self, f: impl FnOnce(&mut Connection) + Send + 'static) {
        self.push(Job::Exec(Box::new(f)));
    }

    /// Run `f` on the writer's connection from synchronous code (setup).
    pub(crate) fn exec_blocking<T, F>(&self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut Connection) -> Result<T> + Send + 'static,
    {
        let (tx, rx) = std::sync::mpsc::channel();
        self.push(Job::Exec(Box::new(move |conn| {
            let _ = tx.send(f(conn));
        })));
        rx.recv().unwrap_or_else(|_| Err(stopped()))
    }

    /// Take at most `n` jobs into one transaction (1: every plain append
    /// commits alone).
    pub(crate) fn set_chain_key(&self, key: ChainKey) {
        *self
            .shared
            .chain_key
            .write()
            .unwrap_or_else(|e| e.into_inner()) = Arc::new(key);
    }

    pub(crate) fn chain_key(&self) -> Arc<ChainKey> {
        self.shared.chain_key()
    }

    pub(crate) fn set_max_batch(&self, n: usize) {
        self.shared.max_batch.store(n.max(1), Ordering::Release);
    }

    /// Transactions of appends committed (or tried) so far.
    pub(crate) fn commits(&self) -> u64 {
        self.shared.commits.load(Ordering::Acquire)
    }

    /// Make the next `n` commits fail (the transaction is rolled back).
    pub(crate) fn fail_next_commits(&self, n: usize) {
        self.shared.fail_commits.store(n, Ordering::Release);
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        {
            let mut q = self.shared.queue.lock().unwrap_or_else(|e| e.into_inner());
            q.closed = true;
        }
        self.shared.wake.notify_one();
        let thread = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(thread) = thread {
            // The thread finishes what was queued and commits: a reopen in
            // this process right after finds the file free.
            let _ = thread.join();
        }
        // The state (and with it the indexer's sender) goes with the last
        // handle; the indexer then writes what it holds and stops.
        let indexer = self
            .indexer
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(mut indexer) = indexer {
            if let Ok(mut st) = self.state.lock() {
                st.index = IndexSink::None;
            }
            indexer.join();
        }
    }
}

fn stopped() -> Error {
    Error::backend("the session log's writer stopped")
}

fn copy(e: &Error) -> Error {
    Error::new(e.kind(), e.message())
}

struct State {
    shared: Arc<Shared>,
    conn: Connection,
    /// The open group's number, or the last one's.
    group: u64,
    open: bool,
    /// Sessions with grouped appends in the open group.
    in_group: HashSet<SessionId>,
    /// Plain appends of the open group, answered when it commits.
    waiting: Vec<(AppendReply, Result<Appended>)>,
    /// Groups whose commit failed (kind, message).
    failed: BTreeMap<u64, (ErrorKind, String)>,
    /// Sessions refused grouped appends: (failed group, since).
    poisoned: HashMap<SessionId, (u64, Instant)>,
    /// Where committed frames go for the search index.
    index: IndexSink,
    /// The open group's frames, handed to the index once it commits.
    staged: Vec<Entry>,
}

/// Marks the queue closed if the thread ends (also by a panic), so callers
/// get an error instead of waiting forever.
struct Exit(Arc<Shared>);

impl Drop for Exit {
    fn drop(&mut self) {
        let mut q = self.0.queue.lock().unwrap_or_else(|e| e.into_inner());
        q.closed = true;
        q.jobs.clear();
    }
}

fn run(shared: Arc<Shared>, state: Arc<Mutex<State>>) {
    let _exit = Exit(shared.clone());
    loop {
        let (jobs, closed) = {
            let mut q = shared.queue.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                if !q.jobs.is_empty() || q.closed {
                    break;
                }
                if shared.open.load(Ordering::Acquire) {
                    let (guard, wait) = shared
                        .wake
                        .wait_timeout(q, IDLE_COMMIT)
                        .unwrap_or_else(|e| e.into_inner());
                    q = guard;
                    if wait.timed_out() && q.jobs.is_empty() {
                        break;
                    }
                } else {
                    q = shared.wake.wait(q).unwrap_or_else(|e| e.into_inner());
                }
            }
            let n = q.jobs.len().min(shared.max_batch.load(Ordering::Acquire));
            (q.jobs.drain(..n).collect::<Vec<_>>(), q.closed)
        };
        let mut st = state.lock().unwrap_or_else(|e| e.into_inner());
        if jobs.is_empty() {
            st.commit();
            if closed {
                return;
            }
            continue;
        }
        for job in jobs {
            st.job(job);
        }
        if !st.waiting.is_empty() {
            st.commit();
        }
    }
}

impl State {
    fn job(&mut self, job: Job) {
        match job {
            Job::Append {
                session,
                append,
                grouped,
                reply,
            } => {
                if grouped {
                    if let Some(err) = self.poison(&session) {
                        let _ = reply.send(Err(err));
                        return;
                    }
                }
                let result = self.begin().and_then(|()| self.stage(&session, append));
                if grouped {
                    if result.is_ok() {
                        self.in_group.insert(session);
                    }
                    let group = self.group;
                    let _ = reply.send(result.map(|a| (a, group)));
                } else {
                    self.waiting.push((reply, result));
                }
            }
            Job::Commit {
                session,
                group,
                reply,
            } => {
                if self.open && group == self.group {
                    self.commit();
                }
                let result = match self.failed.get(&group) {
                    Some((kind, message)) => {
                        if self.poisoned.get(&session).is_some_and(|p| p.0 == group) {
                            self.poisoned.remove(&session);
                        }
                        Err(Error::new(*kind, message.clone()))
                    }
                    None => Ok(()),
                };
                let _ = reply.send(result);
            }
            Job::Exec(f) => {
                self.commit();
                // A panic in `f` drops its reply (the caller gets an error)
                // and rusqlite rolls back what `f` had open; the writer lives on.
                let conn = &mut self.conn;
                let _ = std::panic::catch_unwind(AssertUnwindSafe(move || f(conn)));
                if !self.conn.is_autocommit() {
                    let _ = self.conn.execute_batch("ROLLBACK");
                }
            }
        }
    }

    /// The error for a grouped append of a session whose last group failed.
    fn poison(&mut self, session: &SessionId) -> Option<Error> {
        let (group, since) = *self.poisoned.get(session)?;
        if since.elapsed() > POISON_FOR {
            self.poisoned.remove(session);
            return None;
        }
        let (kind, message) = self.failed.get(&group)?;
        Some(Error::new(
            *kind,
            format!("an earlier group of this session failed to commit: {message}"),
        ))
    }

    fn begin(&mut self) -> Result<()> {
        if !self.open {
            // IMMEDIATE takes the write lock up front, so the seqs read in
            // the group stay the last ones until it commits, even with
            // another process on the same file.
            self.run("BEGIN IMMEDIATE").map_err(db_err)?;
            self.open = true;
            self.shared.open.store(true, Ordering::Release);
            self.group += 1;
        }
        Ok(())
    }

    /// One append in the open transaction, in a savepoint: a refused append
    /// rolls back alone.
    fn stage(&mut self, session: &SessionId, append: CheckedAppend) -> Result<Appended> {
        self.run("SAVEPOINT append").map_err(db_err)?;
        let key = self.shared.chain_key();
        match append_in(&self.conn, session, append, now_ms(), &key) {
            Ok((appended, doc)) => {
                self.run("RELEASE append").map_err(db_err)?;
                if !matches!(self.index, IndexSink::None) {
                    self.staged.push(Entry {
                        session: session.as_str().to_string(),
                        seq: appended.seq as i64,
                        doc,
                    });
                }
                Ok(appended)
            }
            Err(e) => {
                let _ = self.run("ROLLBACK TO append");
                let _ = self.run("RELEASE append");
                Err(e)
            }
        }
    }

    /// The committed group's frames to the search index (index.rs).
    fn hand_to_index(&mut self) {
        if self.staged.is_empty() {
            return;
        }
        let staged = std::mem::take(&mut self.staged);
        match &self.index {
            IndexSink::Thread(tx) => {
                // A stopped indexer leaves the marks behind: the next open
                // catches up.
                let _ = tx.send(staged);
            }
            IndexSink::Inline => {
                if let Err(e) = index_batch(&self.conn, &staged) {
                    tracing::warn!(frames = staged.len(), error = %e, "search index: a batch failed");
                }
            }
            IndexSink::None => {}
        }
    }

    /// One statement without parameters, prepared once.
    fn run(&self, sql: &str) -> rusqlite::Result<()> {
        self.conn.prepare_cached(sql)?.execute([])?;
        Ok(())
    }

    /// Commit the open group (if any) and answer its plain appends.
    fn commit(&mut self) {
        if !self.open {
            return;
        }
        self.open = false;
        self.shared.open.store(false, Ordering::Release);
        let group = self.group;
        self.shared.commits.fetch_add(1, Ordering::AcqRel);
        let result = self
            .run("COMMIT")
            .map_err(|e| Error::backend(format!("sqlite: commit failed: {e}")).with_source(e));
        if result.is_err() && !self.conn.is_autocommit() {
            let _ = self.conn.execute_batch("ROLLBACK");
        }
        match result {
            Ok(()) => {
                for (reply, appended) in self.waiting.drain(..) {
                    let _ = reply.send(appended.map(|a| (a, group)));
                }
                self.in_group.clear();
                self.hand_to_index();
            }
            Err(e) => {
                self.staged.clear();
                tracing::warn!(
                    group,
                    plain = self.waiting.len(),
                    grouped_sessions = self.in_group.len(),
                    error = %e,
                    "a group of appends failed to commit: none of them is stored"
                );
                for (reply, appended) in self.waiting.drain(..) {
                    let _ = reply.send(Err(match appended {
                        Err(refused) => refused,
                        Ok(_) => copy(&e),
                    }));
                }
                let now = Instant::now();
                for session in self.in_group.drain() {
                    self.poisoned.insert(session, (group, now));
                }
                self.failed
                    .insert(group, (e.kind(), e.message().to_string()));
                while self.failed.len() > FAILED_KEPT {
                    self.failed.pop_first();
                }
            }
        }
    }
}
