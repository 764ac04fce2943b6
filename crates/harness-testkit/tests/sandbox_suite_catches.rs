//! The sandbox suite can fail: real local sandboxes wrapped in deliberately
//! broken decorators must be reported, each with a message naming the
//! broken rule.

use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;
use harness_core::sandbox::{
    DetachedProcess, DetachedRequest, DetachedStatus, ExecEvent, ExecRequest, ExecStream,
    PortEndpoint, Sandbox, SandboxHandle, SandboxProvider, SandboxSpec,
};
use harness_core::stream::ByteStream;
use harness_core::Result;
use harness_testkit::conformance::sandbox as suite;
use sandbox_local::LocalProvider;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Breakage {
    /// exec streams end without their Exit event.
    DropExit,
    /// exec ignores the request's timeout.
    IgnoreTimeout,
}

/// A real sandbox with one deliberate contract violation.
#[derive(Debug)]
struct Broken {
    inner: Box<dyn Sandbox>,
    breakage: Breakage,
}

#[async_trait]
impl Sandbox for Broken {
    fn handle(&self) -> SandboxHandle {
        self.inner.handle()
    }
    fn workdir(&self) -> &str {
        self.inner.workdir()
    }
    async fn exec(&self, mut request: ExecRequest) -> Result<ExecStream> {
        match self.breakage {
            Breakage::DropExit => {
                let stream = self.inner.exec(request).await?;
                Ok(Box::pin(stream.filter(|e| {
                    std::future::ready(!matches!(e, Ok(ExecEvent::Exit(_))))
                })))
            }
            Breakage::IgnoreTimeout => {
                request.timeout = None;
                self.inner.exec(request).await
            }
        }
    }
    async fn read_file(&self, path: &str) -> Result<ByteStream> {
        self.inner.read_file(path).await
    }
    async fn read_file_from(&self, path: &str, offset: u64) -> Result<ByteStream> {
        self.inner.read_file_from(path, offset).await
    }
    async fn write_file(&self, path: &str, content: ByteStream) -> Result<u64> {
        self.inner.write_file(path, content).await
    }
    async fn export_tar(&self, dir: &str) -> Result<ByteStream> {
        self.inner.export_tar(dir).await
    }
    async fn import_tar(&self, dir: &str, tar: ByteStream) -> Result<()> {
        self.inner.import_tar(dir, tar).await
    }
    async fn spawn_detached(&self, request: DetachedRequest) -> Result<DetachedProcess> {
        self.inner.spawn_detached(request).await
    }
    async fn detached_status(&self, process: &DetachedProcess) -> Result<DetachedStatus> {
        self.inner.detached_status(process).await
    }
    async fn kill_detached(&self, process: &DetachedProcess) -> Result<()> {
        self.inner.kill_detached(process).await
    }
    async fn port_endpoint(&self, port: u16) -> Result<PortEndpoint> {
        self.inner.port_endpoint(port).await
    }
    async fn destroy(&self) -> Result<()> {
        self.inner.destroy().await
    }
}

/// A provider handing out broken sandboxes.
#[derive(Debug)]
struct BrokenProvider {
    inner: LocalProvider,
    breakage: Breakage,
}

#[async_trait]
impl SandboxProvider for BrokenProvider {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    async fn create(&self, spec: &SandboxSpec) -> Result<Box<dyn Sandbox>> {
        Ok(Box::new(Broken {
            inner: self.inner.create(spec).await?,
            breakage: self.breakage,
        }))
    }
    async fn resume(&self, handle: &SandboxHandle) -> Result<Box<dyn Sandbox>> {
        Ok(Box::new(Broken {
            inner: self.inner.resume(handle).await?,
            breakage: self.breakage,
        }))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_suite_reports_a_sandbox_that_drops_the_exit_event() {
    let root = tempfile::tempdir().unwrap();
    let provider = BrokenProvider {
        inner: LocalProvider::new(root.path()),
        breakage: Breakage::DropExit,
    };
    let options = suite::SuiteOptions {
        large_file_bytes: 0,
        ..Default::default()
    };
    let err = suite::run_all_with(&provider, SandboxSpec::new("/workspace"), &options)
        .await
        .expect_err("the suite must fail a sandbox whose exec never reports Exit");
    let msg = format!("{err:#}");
    assert!(
        msg.contains("exec_streams_stdout_stderr_and_one_exit: the exec stream must end with exactly one Exit event, got 0"),
        "the failure must name the rule: {msg}"
    );

    // The same sandbox, unbroken, passes that item: the failure is the
    // decorator's, not the environment's.
    let healthy = LocalProvider::new(root.path());
    let sb = healthy
        .create(&SandboxSpec::new("/workspace"))
        .await
        .unwrap();
    suite::exec_streams_stdout_stderr_and_one_exit(sb.as_ref())
        .await
        .unwrap();
    sb.destroy().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_suite_reports_a_sandbox_that_ignores_timeouts() {
    let root = tempfile::tempdir().unwrap();
    let provider = BrokenProvider {
        inner: LocalProvider::new(root.path()),
        breakage: Breakage::IgnoreTimeout,
    };
    let sb = provider
        .create(&SandboxSpec::new("/workspace"))
        .await
        .unwrap();
    let started = std::time::Instant::now();
    let err = suite::exec_timeout_kills_tree(sb.as_ref())
        .await
        .expect_err("the suite must fail a sandbox that ignores timeouts");
    let msg = format!("{err:#}");
    assert!(
        msg.contains("should be killed (TimedOut) after 1 s") && msg.contains("did not finish"),
        "the failure must say the timeout was not enforced: {msg}"
    );
    // The suite bounds its own wait instead of hanging for the full 100 s.
    assert!(started.elapsed() < Duration::from_secs(60));
    sb.destroy().await.unwrap();
}
