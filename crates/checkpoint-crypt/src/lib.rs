//! Checkpoints the store cannot read.
//!
//! A [`DeploymentKey`] (32 random bytes a deployment keeps outside its
//! store: `HARNESS_CHECKPOINT_KEY`, or the harness home's
//! `checkpoint.key`) derives one key per **fork lineage** — a session and
//! every fork made from it share one, so a fork reads the chunks its
//! parent stored — with HKDF-SHA256. A lineage's objects live under
//! `lineages/<lineage>/` in the store, each sealed with XChaCha20-Poly1305
//! in 64 KiB segments ([`format`]): the store holds ciphertext only;
//! content addressing still deduplicates within a lineage (the same chunk
//! in one lineage is one object); a wrong key is an `Unauthorized` error
//! that names both keys, never garbage.
//!
//! Keys name their lineage: a checkpoint key `lineages/<L>/<rest>` is the
//! object `<rest>` of lineage `L`'s encrypted view; any other key is a
//! plain object. [`Lineages::resolve`] is that rule, the one place that
//! reads it. See `docs/checkpoint-encryption.md`.

#![warn(missing_docs)]

use std::sync::Arc;

use harness_core::checkpoint::CheckpointStore;
use harness_core::{Error, ErrorKind, Result};
use hmac::{Hmac, Mac};
use sha2::Sha256;

pub mod format;
mod prefixed;
mod store;

pub use prefixed::PrefixedStore;
pub use store::EncryptedStore;

/// What every lineage's objects live under.
pub const LINEAGES: &str = "lineages/";

/// The environment variable holding a deployment's key (64 hex digits).
pub const KEY_ENV: &str = "HARNESS_CHECKPOINT_KEY";

/// The secret every lineage key is derived from; it never reaches a store.
#[derive(Clone)]
pub struct DeploymentKey(Vec<u8>);

impl std::fmt::Debug for DeploymentKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DeploymentKey(..)")
    }
}

impl DeploymentKey {
    /// A key from a secret of at least 32 bytes (the harness home's
    /// `checkpoint.key`, made like the broker's secret).
    pub fn from_secret(secret: &[u8]) -> Result<Self> {
        if secret.len() < 32 {
            return Err(Error::invalid(format!(
                "a checkpoint key is at least 32 bytes, not {}",
                secret.len()
            )));
        }
        Ok(Self(secret.to_vec()))
    }

    /// A key from hex digits (what [`KEY_ENV`] holds: 64 or more);
    /// `InvalidInput` saying what is wrong otherwise.
    pub fn from_hex(text: &str) -> Result<Self> {
        let bytes = hex::decode(text.trim()).map_err(|e| {
            Error::invalid(format!("a checkpoint key is hex digits (at least 64): {e}"))
        })?;
        Self::from_secret(&bytes)
    }

    /// The key as [`KEY_ENV`] takes it: to give another machine that
    /// restores this one's checkpoints.
    pub fn to_hex(&self) -> String {
        hex::encode(&self.0)
    }

    /// The key of `lineage`: HKDF-SHA256 of this key, with the lineage as
    /// the info.
    pub fn lineage(&self, lineage: &str) -> format::SegmentKey {
        let hk = hkdf::Hkdf::<Sha256>::new(Some(b"harness-checkpoint-lineage-v1"), &self.0);
        let mut key = [0u8; 32];
        hk.expand(lineage.as_bytes(), &mut key)
            .expect("32 bytes is a valid HKDF-SHA256 length");
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(&key).expect("any key length");
        mac.update(b"key-id");
        let mut id = [0u8; 8];
        id.copy_from_slice(&mac.finalize().into_bytes()[..8]);
        format::SegmentKey::new(&key, id)
    }
}

/// A store and the lineages it may hold: resolves checkpoint keys to the
/// view that reads them.
#[derive(Debug, Clone)]
pub struct Lineages {
    store: Arc<dyn CheckpointStore>,
    key: Option<DeploymentKey>,
    /// New checkpoints are plain although a key is there to read.
    write_plain: bool,
}

impl Lineages {
    /// Lineages of `store`, sealed under `key`'s lineage keys; with no key
    /// new checkpoints are plain and encrypted ones cannot be read.
    pub fn new(store: Arc<dyn CheckpointStore>, key: Option<DeploymentKey>) -> Self {
        Self {
            store,
            key,
            write_plain: false,
        }
    }

    /// Lineages of `store` that new checkpoints do not use (they are
    /// plain) but that read encrypted ones under `key`'s lineage keys.
    pub fn reading(store: Arc<dyn CheckpointStore>, key: DeploymentKey) -> Self {
        Self {
            store,
            key: Some(key),
            write_plain: true,
        }
    }

    /// The store, as it holds objects (ciphertext under `lineages/`).
    pub fn raw(&self) -> &Arc<dyn CheckpointStore> {
        &self.store
    }

    /// Whether new checkpoints are encrypted.
    pub fn encrypts(&self) -> bool {
        self.key.is_some() && !self.write_plain
    }

    /// Where a new checkpoint of `lineage` is written: that lineage's
    /// encrypted view and the prefix that turns its keys into the keys
    /// recorded (`lineages/<L>/`); the plain store and no prefix when this
    /// deployment does not encrypt.
    pub fn for_new(&self, lineage: &str) -> Result<(Arc<dyn CheckpointStore>, String)> {
        match self.key.as_ref().filter(|_| !self.write_plain) {
            None => Ok((self.store.clone(), String::new())),
            Some(key) => {
                let prefix = lineage_prefix(lineage)?;
                Ok((self.view(key, lineage, &prefix), prefix))
            }
        }
    }

    /// The store a recorded checkpoint `key` is read through and its key
    /// there: lineage `L`'s encrypted view for `lineages/<L>/<rest>`, the
    /// plain store for any other key. `Unauthorized` for an encrypted key
    /// when this deployment has no key.
    pub fn resolve(&self, key: &str) -> Result<(Arc<dyn CheckpointStore>, String)> {
        match split_lineage(key) {
            None => Ok((self.store.clone(), key.to_string())),
            Some((lineage, rest)) => {
                let Some(deployment) = &self.key else {
                    return Err(Error::new(
                        ErrorKind::Unauthorized,
                        format!(
                            "checkpoint {key:?} is encrypted (lineage {lineage:?}) and no \
                             checkpoint key is configured: set {KEY_ENV} to the deployment's key"
                        ),
                    ));
                };
                let prefix = lineage_prefix(lineage)?;
                Ok((self.view(deployment, lineage, &prefix), rest.to_string()))
            }
        }
    }

    /// The lineages the store holds objects of, sorted.
    pub async fn list(&self) -> Result<Vec<String>> {
        self.lineages_where(|_| true).await
    }

    /// The lineages holding a checkpoint named `key` within them (an object
    /// at `lineages/<L>/<key>` or under it), sorted: where a key given
    /// without its lineage (as the user chose it at `harness checkpoint
    /// --key`) may be. One listing of everything under `lineages/`: for the
    /// case a plain key was not found, not for every read.
    pub async fn holding(&self, key: &str) -> Result<Vec<String>> {
        self.lineages_where(|rest| {
            rest == key || rest.strip_prefix(key).is_some_and(|t| t.starts_with('/'))
        })
        .await
    }

    /// The lineages with an object whose key within them passes `keep`, in
    /// the listing's (sorted) order, each once.
    async fn lineages_where(&self, keep: impl Fn(&str) -> bool) -> Result<Vec<String>> {
        let mut out: Vec<String> = Vec::new();
        for stored in self.store.list_keys(LINEAGES).await? {
            match split_lineage(&stored) {
                Some((lineage, rest))
                    if keep(rest) && out.last().map(String::as_str) != Some(lineage) =>
                {
                    out.push(lineage.to_string())
                }
                _ => {}
            }
        }
        Ok(out)
    }

    /// Lineage `lineage`'s encrypted view (`Unauthorized` without a key).
    pub fn lineage(&self, lineage: &str) -> Result<Arc<dyn CheckpointStore>> {
        let prefix = lineage_prefix(lineage)?;
        match &self.key {
            Some(key) => Ok(self.view(key, lineage, &prefix)),
            None => Err(Error::new(
                ErrorKind::Unauthorized,
                format!("lineage {lineage:?} is encrypted and no checkpoint key is configured: set {KEY_ENV}"),
            )),
        }
    }

    fn view(&self, key: &DeploymentKey, lineage: &str, prefix: &str) -> Arc<dyn CheckpointStore> {
        Arc::new(EncryptedStore::new(
            Arc::new(PrefixedStore::new(self.store.clone(), prefix.to_string())),
            key.lineage(lineage),
        ))
    }
}

/// `lineages/<lineage>/`, for a lineage that is one valid key segment.
pub fn lineage_prefix(lineage: &str) -> Result<String> {
    let prefix = format!("{LINEAGES}{lineage}/");
    harness_core::checkpoint::validate_key(prefix.trim_end_matches('/')).map_err(|_| {
        Error::invalid(format!(
            "{lineage:?} cannot name a lineage: use one key segment (A-Z a-z 0-9 . _ -)"
        ))
    })?;
    if lineage.contains('/') {
        return Err(Error::invalid(format!(
            "{lineage:?} cannot name a lineage: it holds a '/'"
        )));
    }
    Ok(prefix)
}

/// The lineage a recorded key names and the key within it.
pub fn split_lineage(key: &str) -> Option<(&str, &str)> {
    key.strip_prefix(LINEAGES)?
        .split_once('/')
        .filter(|(l, rest)| !l.is_empty() && !rest.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lineage_keys_differ_by_lineage_and_deployment() {
        let a = DeploymentKey::from_secret(&[1; 32]).unwrap();
        let b = DeploymentKey::from_secret(&[2; 32]).unwrap();
        assert_eq!(a.lineage("s1").id, a.lineage("s1").id);
        assert_ne!(a.lineage("s1").id, a.lineage("s2").id);
        assert_ne!(a.lineage("s1").id, b.lineage("s1").id);
    }

    #[test]
    fn keys_are_parsed_with_reasons() {
        assert!(DeploymentKey::from_hex(&"ab".repeat(32)).is_ok());
        let short = DeploymentKey::from_hex("abcd").unwrap_err().to_string();
        assert!(short.contains("not 2"), "{short}");
        let key = DeploymentKey::from_secret(&[3; 40]).unwrap();
        assert_eq!(
            DeploymentKey::from_hex(&key.to_hex())
                .unwrap()
                .lineage("x")
                .id,
            key.lineage("x").id
        );
        let bad = DeploymentKey::from_hex(&"zz".repeat(32))
            .unwrap_err()
            .to_string();
        assert!(bad.contains("hex"), "{bad}");
    }

    #[test]
    fn recorded_keys_name_their_lineage() {
        assert_eq!(
            split_lineage("lineages/s1/turns/s2/t1"),
            Some(("s1", "turns/s2/t1"))
        );
        assert_eq!(split_lineage("turns/s2/t1"), None);
        assert_eq!(split_lineage("lineages/s1"), None);
        assert!(lineage_prefix("a/b").is_err());
        assert!(lineage_prefix("..").is_err());
        assert_eq!(lineage_prefix("s_2e1").unwrap(), "lineages/s_2e1/");
    }
}
