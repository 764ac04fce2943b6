//! A real sandbox with one behaviour changed, for tests that need a
//! provider to misbehave, or to race, in one precise place: every method
//! forwards to the real sandbox but what the [`Decoration`] overrides.
//! The machinery is core's (`harness_core::decorate`), shared with the
//! audit layer.

pub use harness_core::decorate::{Decorated, Decoration};
