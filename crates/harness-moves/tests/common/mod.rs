//! What the tree checkpoint tests share: real local sandboxes (no part to
//! start: they run everywhere) and the wall clock the locks read.
#![allow(dead_code)]

use harness_core::sandbox::{Sandbox, SandboxProvider, SandboxSpec};
use sandbox_local::LocalProvider;

/// A new sandbox of `provider` with an empty `/workspace`.
pub async fn fresh_local(provider: &LocalProvider) -> Box<dyn Sandbox> {
    provider
        .create(&SandboxSpec::new("/workspace"))
        .await
        .unwrap()
}

/// The wall clock, as tree checkpoints' locks read it.
pub fn wall_clock() -> harness_core::clock::FnClock<impl Fn() -> u64 + Send + Sync> {
    harness_core::clock::FnClock(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64
    })
}

/// `n` bytes no compressor shrinks (xorshift from `seed`): a large file of
/// them is several chunks, and a pack of them is as large as its files.
pub fn noise(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}
