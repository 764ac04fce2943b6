//! The sandbox suite can fail: real local sandboxes wrapped in deliberately
//! broken decorators must be reported, each with a message naming the
//! broken rule.

use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;
use harness_core::sandbox::{
    ExecEvent, ExecRequest, ExecStream, Sandbox, SandboxHandle, SandboxProvider, SandboxSpec,
};
use harness_core::Result;
use harness_testkit::conformance::sandbox as suite;
use harness_testkit::decorated::{Decorated, Decoration};
use sandbox_local::LocalProvider;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Breakage {
    /// exec streams end without their Exit event.
    DropExit,
    /// exec ignores the request's timeout.
    IgnoreTimeout,
}

/// A real sandbox with one deliberate contract violation.
type Broken = Decorated<Breakage>;

#[async_trait]
impl Decoration for Breakage {
    async fn exec(&self, inner: &dyn Sandbox, mut request: ExecRequest) -> Result<ExecStream> {
        match self {
            Breakage::DropExit => {
                let stream = inner.exec(request).await?;
                Ok(Box::pin(stream.filter(|e| {
                    std::future::ready(!matches!(e, Ok(ExecEvent::Exit(_))))
                })))
            }
            Breakage::IgnoreTimeout => {
                request.timeout = None;
                inner.exec(request).await
            }
        }
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
            decoration: self.breakage,
        }))
    }
    async fn resume(&self, handle: &SandboxHandle) -> Result<Box<dyn Sandbox>> {
        Ok(Box::new(Broken {
            inner: self.inner.resume(handle).await?,
            decoration: self.breakage,
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
