//! A real sandbox with one behaviour changed, for tests that need a
//! provider to misbehave, or to race, in one precise place: every method
//! forwards to the real sandbox but what the [`Decoration`] overrides.

use async_trait::async_trait;
use harness_core::sandbox::{
    DetachedProcess, DetachedRequest, DetachedStatus, ExecRequest, ExecStream, PortEndpoint,
    Sandbox, SandboxHandle, TreeListing,
};
use harness_core::stream::ByteStream;
use harness_core::Result;

/// What a [`Decorated`] sandbox does instead of the real one. Each method
/// forwards unless overridden.
#[async_trait]
pub trait Decoration: Send + Sync + std::fmt::Debug {
    async fn exec(&self, inner: &dyn Sandbox, request: ExecRequest) -> Result<ExecStream> {
        inner.exec(request).await
    }

    async fn export_paths_tar(
        &self,
        inner: &dyn Sandbox,
        dir: &str,
        paths: &[String],
    ) -> Result<ByteStream> {
        inner.export_paths_tar(dir, paths).await
    }
}

/// The real sandbox `inner`, changed by `decoration`.
#[derive(Debug)]
pub struct Decorated<D> {
    pub inner: Box<dyn Sandbox>,
    pub decoration: D,
}

#[async_trait]
impl<D: Decoration> Sandbox for Decorated<D> {
    fn handle(&self) -> SandboxHandle {
        self.inner.handle()
    }
    fn workdir(&self) -> &str {
        self.inner.workdir()
    }
    async fn exec(&self, request: ExecRequest) -> Result<ExecStream> {
        self.decoration.exec(self.inner.as_ref(), request).await
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
    fn stages_tar_imports(&self) -> bool {
        self.inner.stages_tar_imports()
    }
    fn parallel_imports(&self) -> usize {
        self.inner.parallel_imports()
    }
    async fn import_tar_staged(&self, dir: &str, tar: ByteStream) -> Result<()> {
        self.inner.import_tar_staged(dir, tar).await
    }
    async fn list_tree(&self, dir: &str) -> Result<TreeListing> {
        self.inner.list_tree(dir).await
    }
    async fn export_paths_tar(&self, dir: &str, paths: &[String]) -> Result<ByteStream> {
        self.decoration
            .export_paths_tar(self.inner.as_ref(), dir, paths)
            .await
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
    async fn detach(&self) -> Result<SandboxHandle> {
        self.inner.detach().await
    }
    async fn stop(&self) -> Result<SandboxHandle> {
        self.inner.stop().await
    }
    async fn destroy(&self) -> Result<()> {
        self.inner.destroy().await
    }
}
