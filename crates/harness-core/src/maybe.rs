//! `Send`/`Sync` where the platform has threads, nothing where it has not.
//!
//! Natively every trait object in the crate crosses tokio tasks, so the
//! traits require `Send + Sync` and their futures are `Send`. Inside a
//! Cloudflare Worker (`wasm32-unknown-unknown`) there is one thread, and the
//! platform's handles (`JsValue`, Durable Object storage) are not `Send`:
//! there the bounds vanish and trait futures are `?Send`, so a Durable
//! Object can implement `SessionStore` over its own SQLite without
//! wrappers. Traits spell this as `MaybeSend + MaybeSync` and
//! `#[cfg_attr(target_arch = "wasm32", async_trait(?Send))]`.

/// `Send` natively; no bound on wasm32.
#[cfg(not(target_arch = "wasm32"))]
pub trait MaybeSend: Send {}
#[cfg(not(target_arch = "wasm32"))]
impl<T: Send + ?Sized> MaybeSend for T {}

/// `Send` natively; no bound on wasm32.
#[cfg(target_arch = "wasm32")]
pub trait MaybeSend {}
#[cfg(target_arch = "wasm32")]
impl<T: ?Sized> MaybeSend for T {}

/// `Sync` natively; no bound on wasm32.
#[cfg(not(target_arch = "wasm32"))]
pub trait MaybeSync: Sync {}
#[cfg(not(target_arch = "wasm32"))]
impl<T: Sync + ?Sized> MaybeSync for T {}

/// `Sync` natively; no bound on wasm32.
#[cfg(target_arch = "wasm32")]
pub trait MaybeSync {}
#[cfg(target_arch = "wasm32")]
impl<T: ?Sized> MaybeSync for T {}

/// A boxed future that is `Send` natively.
#[cfg(not(target_arch = "wasm32"))]
pub type BoxFuture<'a, T> = futures::future::BoxFuture<'a, T>;
/// A boxed future that is `Send` natively.
#[cfg(target_arch = "wasm32")]
pub type BoxFuture<'a, T> = futures::future::LocalBoxFuture<'a, T>;
