//! The checkpoint layout that a config implies: every tensor the model needs,
//! by its hub name, with shape, element type and the part of the model it
//! belongs to. Weight binding, `m3c inspect`, the planner's cost model and
//! `m3c init-tiny` all read this one list, so they cannot disagree.

pub mod names;
pub(crate) mod tensors;

pub use tensors::{expected_tensors, Part, Role, TensorSpec, TypeRule};
