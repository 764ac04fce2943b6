//! A sandbox with some of its behaviour changed: [`Decorated`] forwards
//! every [`Sandbox`] method to the real sandbox, except the ones its
//! [`Decoration`] takes over. The audit layer (`audit::AuditedSandbox`) is
//! one; tests make providers misbehave, or race, in one precise place
//! with another (`harness_testkit::decorated`).
//!
//! Every method is forwarded here, once: a wrapper that forgot one would
//! silently run the trait's default instead of the provider's own
//! implementation (a native tree listing, a `docker commit` snapshot).

use async_trait::async_trait;

use crate::maybe::{MaybeSend, MaybeSync};
use crate::sandbox::{
    DetachedProcess, DetachedRequest, DetachedStatus, ExecRequest, ExecStream, NetworkPolicy,
    PortEndpoint, Sandbox, SandboxHandle, TreeListing,
};
use crate::stream::ByteStream;
use crate::Result;

/// What a [`Decorated`] sandbox does instead of the real one. Each method
/// forwards to `inner` unless overridden.
#[cfg_attr(not(target_arch = "wasm32"), async_trait)]
#[cfg_attr(target_arch = "wasm32", async_trait(?Send))]
pub trait Decoration: MaybeSend + MaybeSync + std::fmt::Debug {
    /// [`Sandbox::exec`].
    async fn exec(&self, inner: &dyn Sandbox, request: ExecRequest) -> Result<ExecStream> {
        inner.exec(request).await
    }

    /// [`Sandbox::spawn_detached`].
    async fn spawn_detached(
        &self,
        inner: &dyn Sandbox,
        request: DetachedRequest,
    ) -> Result<DetachedProcess> {
        inner.spawn_detached(request).await
    }

    /// [`Sandbox::export_paths_tar`].
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
    /// The real sandbox.
    pub inner: Box<dyn Sandbox>,
    /// What is changed.
    pub decoration: D,
}

impl<D> Decorated<D> {
    /// `inner`, changed by `decoration`.
    pub fn new(inner: Box<dyn Sandbox>, decoration: D) -> Self {
        Self { inner, decoration }
    }
}

#[cfg_attr(not(target_arch = "wasm32"), async_trait)]
#[cfg_attr(target_arch = "wasm32", async_trait(?Send))]
impl<D: Decoration> Sandbox for Decorated<D> {
    fn handle(&self) -> SandboxHandle {
        self.inner.handle()
    }

    fn workdir(&self) -> &str {
        self.inner.workdir()
    }

    fn home_hint(&self) -> Option<String> {
        self.inner.home_hint()
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

    fn parallel_imports(&self) -> usize {
        self.inner.parallel_imports()
    }

    fn stages_tar_imports(&self) -> bool {
        self.inner.stages_tar_imports()
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
        self.decoration
            .spawn_detached(self.inner.as_ref(), request)
            .await
    }

    async fn detached_status(&self, process: &DetachedProcess) -> Result<DetachedStatus> {
        self.inner.detached_status(process).await
    }

    async fn poll_detached(
        &self,
        process: &DetachedProcess,
        offset: u64,
    ) -> Result<(DetachedStatus, ByteStream)> {
        self.inner.poll_detached(process, offset).await
    }

    async fn kill_detached(&self, process: &DetachedProcess) -> Result<()> {
        self.inner.kill_detached(process).await
    }

    async fn port_endpoint(&self, port: u16) -> Result<PortEndpoint> {
        self.inner.port_endpoint(port).await
    }

    async fn snapshot_image(&self, name: &str) -> Result<String> {
        self.inner.snapshot_image(name).await
    }

    async fn set_network(&self, policy: &NetworkPolicy) -> Result<()> {
        self.inner.set_network(policy).await
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
