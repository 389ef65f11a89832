//! Safetensors checkpoints, single-file or sharded, memory-mapped; and the
//! binding of every tensor the model needs to the bytes that hold it.
//!
//! Nothing here copies or converts a weight: a bound tensor is a view into a
//! mapped file.

mod bind;
pub mod checkpoint;

pub use bind::{bind, BindProblem, BindReport, BoundWeights};
pub use checkpoint::{Checkpoint, TensorEntry, WeightsError};
