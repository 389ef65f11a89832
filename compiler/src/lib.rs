//! m3c: an ahead-of-time compiler that turns MiniMax-M3 into pipeline-parallel
//! executables. See docs/ARCHITECTURE.md for the map of this crate.

// serde_json::json! of the tiny config nests deeply.
#![recursion_limit = "256"]

pub mod backend;
pub mod compile;
pub mod config;
pub mod dtype;
pub mod family;
pub mod fsutil;
pub mod graph;
pub mod inspect;
pub mod kernel_bench;
pub mod lower;
pub mod model;
pub mod plan;
pub mod source;
pub mod tiny;
pub mod units;
pub mod weights;
