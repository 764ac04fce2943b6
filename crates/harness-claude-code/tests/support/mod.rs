//! The shared end-to-end plumbing lives in the `harness-agent-e2e` crate;
//! this module re-exports it for test files that `mod support;`.

#![allow(unused_imports)]

pub use harness_agent_e2e::*;
