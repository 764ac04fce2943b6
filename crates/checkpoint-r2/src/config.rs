//! Where the store lives: endpoint, region, credentials, bucket, namespace
//! and the sizes that bound memory.

use harness_core::checkpoint::{validate_key, SHA256_TRAILER_LEN};
use harness_core::{Error, Result};

/// Default multipart part size: 8 MiB. S3 (and R2) need every part but the
/// last to be at least 5 MiB; 8 MiB keeps a put's memory at ~16 MiB (one part
/// filling while the previous one uploads) and allows objects up to
/// 10,000 × 8 MiB ≈ 78 GiB.
pub const DEFAULT_PART_SIZE: usize = 8 * 1024 * 1024;

/// The smallest part size S3 accepts for all parts but the last.
pub const MIN_PART_SIZE: usize = 5 * 1024 * 1024;

/// The largest part size S3 accepts.
pub const MAX_PART_SIZE: usize = 5 * 1024 * 1024 * 1024;

/// How to reach an S3-compatible store and where in it checkpoints live.
///
/// Build one with [`S3Config::r2`] for Cloudflare R2 or [`S3Config::custom`]
/// for any other S3 (AWS, SeaweedFS, MinIO, …), then adjust with the
/// `with_*` methods. The secret key never appears in `Debug` output.
#[derive(Clone, PartialEq, Eq)]
pub struct S3Config {
    /// Base URL of the S3 API, e.g. `https://<account>.r2.cloudflarestorage.com`.
    pub endpoint: String,
    /// Signing region. R2 uses `auto`.
    pub region: String,
    /// Access key id.
    pub access_key_id: String,
    /// Secret access key.
    pub secret_access_key: String,
    /// Bucket holding the checkpoints.
    pub bucket: String,
    /// Address buckets as `<endpoint>/<bucket>/<key>` instead of
    /// `<bucket>.<endpoint>/<key>`. Needed by most self-hosted S3 servers.
    pub force_path_style: bool,
    /// Namespace inside the bucket: a checkpoint key `k` is stored as
    /// `<prefix>/k`. Empty means the bucket root.
    pub prefix: String,
    /// Multipart part size in bytes (see [`DEFAULT_PART_SIZE`]).
    pub part_size: usize,
}

impl std::fmt::Debug for S3Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("S3Config")
            .field("endpoint", &self.endpoint)
            .field("region", &self.region)
            .field("access_key_id", &self.access_key_id)
            .field("secret_access_key", &"<redacted>")
            .field("bucket", &self.bucket)
            .field("force_path_style", &self.force_path_style)
            .field("prefix", &self.prefix)
            .field("part_size", &self.part_size)
            .finish()
    }
}

impl S3Config {
    /// Cloudflare R2: endpoint `https://<account_id>.r2.cloudflarestorage.com`,
    /// region `auto`, path-style addressing. `access_key`/`secret_key` are an
    /// R2 API token's S3 credentials (dashboard → R2 → Manage API tokens).
    pub fn r2(
        account_id: impl Into<String>,
        access_key: impl Into<String>,
        secret_key: impl Into<String>,
        bucket: impl Into<String>,
    ) -> Self {
        let account_id = account_id.into();
        Self::custom(
            format!("https://{account_id}.r2.cloudflarestorage.com"),
            "auto",
            access_key,
            secret_key,
            bucket,
        )
    }

    /// Any S3-compatible endpoint (path-style addressing; switch it off with
    /// [`S3Config::with_path_style`] for virtual-hosted AWS buckets).
    pub fn custom(
        endpoint: impl Into<String>,
        region: impl Into<String>,
        access_key: impl Into<String>,
        secret_key: impl Into<String>,
        bucket: impl Into<String>,
    ) -> Self {
        Self {
            endpoint: endpoint.into().trim_end_matches('/').to_string(),
            region: region.into(),
            access_key_id: access_key.into(),
            secret_access_key: secret_key.into(),
            bucket: bucket.into(),
            force_path_style: true,
            prefix: String::new(),
            part_size: DEFAULT_PART_SIZE,
        }
    }

    /// Store keys under `<prefix>/` (a namespace shared by one deployment).
    pub fn with_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into().trim_matches('/').to_string();
        self
    }

    /// Set the multipart part size (5 MiB ..= 5 GiB less 40 bytes).
    pub fn with_part_size(mut self, bytes: usize) -> Self {
        self.part_size = bytes;
        self
    }

    /// Path-style (`true`) or virtual-hosted-style (`false`) addressing.
    pub fn with_path_style(mut self, path_style: bool) -> Self {
        self.force_path_style = path_style;
        self
    }

    /// Check the configuration; every error says which field is wrong.
    pub fn validate(&self) -> Result<()> {
        let endpoint_ok = (self.endpoint.starts_with("https://")
            || self.endpoint.starts_with("http://"))
            && self
                .endpoint
                .split("://")
                .nth(1)
                .is_some_and(|h| !h.is_empty());
        if !endpoint_ok {
            return Err(Error::invalid(format!(
                "S3 endpoint {:?} must be an http:// or https:// URL",
                self.endpoint
            )));
        }
        if self.region.is_empty() {
            return Err(Error::invalid("S3 region is empty (R2 uses \"auto\")"));
        }
        if self.access_key_id.is_empty() || self.secret_access_key.is_empty() {
            return Err(Error::invalid(
                "S3 access key id and secret access key must both be set",
            ));
        }
        validate_bucket(&self.bucket)?;
        if !self.prefix.is_empty() {
            validate_key(&self.prefix).map_err(|e| {
                Error::invalid(format!("S3 key prefix {:?}: {}", self.prefix, e.message()))
            })?;
        }
        // The last part carries the hash trailer on top of its content.
        let largest = MAX_PART_SIZE - SHA256_TRAILER_LEN;
        if !(MIN_PART_SIZE..=largest).contains(&self.part_size) {
            return Err(Error::invalid(format!(
                "S3 part size {} is outside {MIN_PART_SIZE}..={largest} bytes (S3's 5 GiB limit, less the {SHA256_TRAILER_LEN}-byte hash trailer the last part carries)",
                self.part_size
            )));
        }
        Ok(())
    }
}

/// Bucket names: 3–63 of lowercase letters, digits, `-` and `.`, starting
/// and ending with a letter or digit (the rule S3 and R2 share).
fn validate_bucket(bucket: &str) -> Result<()> {
    let ok = (3..=63).contains(&bucket.len())
        && bucket
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        && bucket
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_alphanumeric())
        && bucket
            .bytes()
            .last()
            .is_some_and(|b| b.is_ascii_alphanumeric());
    if ok {
        Ok(())
    } else {
        Err(Error::invalid(format!(
            "S3 bucket name {bucket:?} is invalid: use 3-63 lowercase letters, digits, '-' or '.'"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn r2_config_has_account_endpoint_auto_region_and_path_style() {
        let c = S3Config::r2("0123abcd", "AK", "SK", "checkpoints");
        assert_eq!(c.endpoint, "https://0123abcd.r2.cloudflarestorage.com");
        assert_eq!(c.region, "auto");
        assert!(c.force_path_style);
        assert_eq!(c.bucket, "checkpoints");
        assert_eq!(c.part_size, DEFAULT_PART_SIZE);
        c.validate().unwrap();
        let dbg = format!("{c:?}");
        assert!(!dbg.contains("SK\""), "secret leaked into Debug: {dbg}");
        assert!(dbg.contains("<redacted>"));
    }

    #[test]
    fn custom_config_trims_and_validates() {
        let c = S3Config::custom("http://127.0.0.1:8333/", "us-east-1", "a", "b", "bkt")
            .with_prefix("/team/ns/");
        assert_eq!(c.endpoint, "http://127.0.0.1:8333");
        assert_eq!(c.prefix, "team/ns");
        c.validate().unwrap();
    }

    #[test]
    fn bad_configs_are_refused_with_the_field_named() {
        let base = S3Config::custom("http://h:1", "r", "a", "b", "bkt");
        let cases = [
            (
                S3Config {
                    endpoint: "ftp://x".into(),
                    ..base.clone()
                },
                "endpoint",
            ),
            (
                S3Config {
                    bucket: "Bad_Bucket".into(),
                    ..base.clone()
                },
                "bucket",
            ),
            (base.clone().with_prefix("a/../b"), "prefix"),
            (base.clone().with_part_size(1024), "part size"),
            (
                S3Config {
                    secret_access_key: String::new(),
                    ..base.clone()
                },
                "secret",
            ),
        ];
        for (cfg, word) in cases {
            let err = cfg.validate().unwrap_err();
            assert_eq!(err.kind(), harness_core::ErrorKind::InvalidInput);
            assert!(err.message().contains(word), "{word}: {err}");
        }
    }
}
