//! test kit
pub mod model;
