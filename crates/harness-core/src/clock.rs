//! The clock, as an input.
//!
//! Nothing in `harness-core` reads the system time: turns stamp their start,
//! slices measure their budget and logs stamp frames with a [`Clock`] they
//! are given. Natively that is the system clock (`session_runtime::SystemClock`
//! or any `Fn() -> u64` wrapped in [`FnClock`]); in a Durable Object it is
//! `Date.now()`; in a Temporal workflow it is the workflow's deterministic
//! time; in tests it is a [`ManualClock`] they move by hand.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::maybe::{MaybeSend, MaybeSync};

/// Milliseconds since the Unix epoch, from wherever the caller keeps time.
pub trait Clock: MaybeSend + MaybeSync + std::fmt::Debug {
    /// The current time in milliseconds since the Unix epoch.
    fn now_ms(&self) -> u64;
}

/// A clock that only moves when told to (tests, replays).
#[derive(Debug, Clone, Default)]
pub struct ManualClock(Arc<AtomicU64>);

impl ManualClock {
    /// A clock reading `ms`.
    pub fn at(ms: u64) -> Self {
        Self(Arc::new(AtomicU64::new(ms)))
    }

    /// Set the time.
    pub fn set(&self, ms: u64) {
        self.0.store(ms, Ordering::SeqCst);
    }

    /// Move the time forward by `ms`.
    pub fn advance(&self, ms: u64) {
        self.0.fetch_add(ms, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
}

/// A clock backed by a function (e.g. the platform's `Date.now()`).
pub struct FnClock<F>(pub F);

impl<F> std::fmt::Debug for FnClock<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FnClock")
    }
}

impl<F: Fn() -> u64 + MaybeSend + MaybeSync> Clock for FnClock<F> {
    fn now_ms(&self) -> u64 {
        (self.0)()
    }
}
