//! One conformance suite per core trait. Each is a set of plain async
//! functions taking the implementation under test (or a factory for fresh
//! instances); every backend crate calls them from its own tests, the way
//! `object_store` tests every store with the same functions.

pub mod checkpoint;
pub mod durable_streams;
pub mod engine;
pub mod leases;
pub mod log;
pub mod retention;
pub mod sandbox;
pub mod search;
pub mod session_api;
pub mod turn_store;
