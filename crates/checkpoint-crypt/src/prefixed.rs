//! [`PrefixedStore`]: one part of a store's key space as a store.

use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use harness_core::checkpoint::{validate_key, CheckpointStore, ObjectMeta};
use harness_core::stream::ByteStream;
use harness_core::{Error, Result};

/// The keys of `inner` under a prefix (`lineages/s1/`), seen without it.
/// Keys are limited by `inner`'s limit on the whole key: 512 bytes less
/// the prefix.
#[derive(Debug, Clone)]
pub struct PrefixedStore {
    inner: Arc<dyn CheckpointStore>,
    prefix: String,
}

impl PrefixedStore {
    /// The part of `inner` under `prefix`, which ends with `/`.
    pub fn new(inner: Arc<dyn CheckpointStore>, prefix: String) -> Self {
        debug_assert!(prefix.ends_with('/'), "a prefix ends with '/': {prefix:?}");
        Self { inner, prefix }
    }

    fn full(&self, key: &str) -> Result<String> {
        // The key alone is checked first, so `..` cannot climb out.
        validate_key(key)?;
        Ok(format!("{}{key}", self.prefix))
    }

    fn strip(&self, mut meta: ObjectMeta) -> Result<ObjectMeta> {
        meta.key = self.strip_key(meta.key)?;
        Ok(meta)
    }

    fn strip_key(&self, key: String) -> Result<String> {
        key.strip_prefix(&self.prefix)
            .map(str::to_string)
            .ok_or_else(|| {
                Error::backend(format!(
                    "the store listed {key:?} outside {:?}",
                    self.prefix
                ))
            })
    }

    fn full_prefix(&self, prefix: &str) -> Result<String> {
        if prefix.is_empty() {
            return Ok(self.prefix.clone());
        }
        // A listing prefix may end with '/' or be part of a segment.
        validate_key(prefix.trim_end_matches('/'))?;
        Ok(format!("{}{prefix}", self.prefix))
    }
}

#[cfg_attr(not(target_arch = "wasm32"), async_trait)]
#[cfg_attr(target_arch = "wasm32", async_trait(?Send))]
impl CheckpointStore for PrefixedStore {
    async fn put(&self, key: &str, content: ByteStream) -> Result<ObjectMeta> {
        self.strip(self.inner.put(&self.full(key)?, content).await?)
    }

    async fn get(&self, key: &str) -> Result<ByteStream> {
        self.inner.get(&self.full(key)?).await
    }

    async fn head(&self, key: &str) -> Result<ObjectMeta> {
        self.strip(self.inner.head(&self.full(key)?).await?)
    }

    async fn list(&self, prefix: &str) -> Result<Vec<ObjectMeta>> {
        let listed = self.inner.list(&self.full_prefix(prefix)?).await?;
        listed.into_iter().map(|m| self.strip(m)).collect()
    }

    async fn list_keys(&self, prefix: &str) -> Result<Vec<String>> {
        let listed = self.inner.list_keys(&self.full_prefix(prefix)?).await?;
        listed.into_iter().map(|k| self.strip_key(k)).collect()
    }

    async fn delete(&self, key: &str) -> Result<()> {
        self.inner.delete(&self.full(key)?).await
    }

    async fn get_range(&self, key: &str, range: std::ops::Range<u64>) -> Result<Bytes> {
        self.inner.get_range(&self.full(key)?, range).await
    }
}
