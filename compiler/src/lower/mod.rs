//! Stage lowering: a stage's slice of the model graph → fused kernel calls →
//! one MLIR module (the kernels it needs, each once per shape, and the stage
//! entry `m3c_stage_step` that runs them in graph order; with the vision
//! tower, `m3c_stage_vision`; with an EAGLE3 head, `m3c_draft_first` and
//! `m3c_draft_next`).
//!
//! The fused program ([`FusedStage`]) is the same for every target; the
//! target's back end (`backend::Backend::module`) writes it as the host's
//! module (the entry calls the kernels) or a GPU module (the entry launches
//! `gpu.func`s), and compiles it. Weights are not read here: the entry
//! receives a table of pointers, in the order of [`StageProgram::tensors`],
//! which the runtime fills at start-up.

mod entry;
pub mod fuse;

pub use entry::{gpu_module, host_units, module as host_module, ENTRY_SYMBOL, VISION_SYMBOL};
pub use fuse::{fuse_stage, DraftPart, DraftProgram, FusedStage, Step, TextProgram, VisionProgram};
/// The slots and boundaries are the contract's: the stage metadata and the
/// manifest carry them as they are.
pub use m3c_contract::stage::{Boundary, CacheSlot, TensorSlot};

use crate::graph::CacheKind;
use crate::model::Part;
pub use m3c_kernels::Storage;
use std::collections::BTreeSet;

/// How a stage keeps f32 values in memory: its KV and index-key caches
/// (`--kv-cache`) and the activations between its kernels and between
/// stages (`--activations`). Arithmetic is f32 either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Storages {
    pub kv_cache: Storage,
    pub activations: Storage,
}

/// Everything m3c generates for one stage.
#[derive(Debug, Clone)]
pub struct StageProgram {
    pub index: usize,
    pub parts: BTreeSet<Part>,
    /// Its fused steps, kernels, tensor and cache slots and boundaries
    /// (`StageProgram` reads as one, through `Deref`).
    pub fused: FusedStage,
    /// The MLIR module for the plan's target: kernels, view helpers and the
    /// stage entry (for CUDA, the kernels as `gpu.func`s and a launching entry).
    pub mlir: String,
}

#[derive(Debug, thiserror::Error)]
pub enum LowerError {
    #[error("stage {stage}: {message}")]
    Stage { stage: usize, message: String },
}

pub(crate) fn cache_kind_name(k: CacheKind) -> &'static str {
    match k {
        CacheKind::Key => "key",
        CacheKind::Value => "value",
        CacheKind::IndexKey => "index_key",
    }
}

impl std::ops::Deref for StageProgram {
    type Target = FusedStage;
    fn deref(&self) -> &FusedStage {
        &self.fused
    }
}

impl StageProgram {
    /// The fused program as text, one step per line (for `--emit` and snapshots).
    pub fn listing(&self) -> String {
        let mut s = format!("stage {} input {:?} output {:?}\n", self.index, self.text.input, self.text.output);
        for step in &self.text.steps {
            s.push_str(&step.to_string());
            s.push('\n');
        }
        if let Some(v) = &self.vision {
            s.push_str(&format!("vision entry: patch rows of {} values, {} per image token\n", v.patch_row, v.merge));
            if let Some(l) = &v.layers {
                s.push_str(&format!(
                    "  (steps {}..{}: layer 0's {} steps run as a loop over {} layers, weights w{}.. + {}·layer)\n",
                    l.start,
                    l.start + l.len * l.count,
                    l.len,
                    l.count,
                    l.first_slot,
                    l.stride
                ));
            }
            for step in &v.steps {
                s.push_str(&step.to_string());
                s.push('\n');
            }
        }
        if let Some(d) = &self.draft {
            for (name, steps) in [("first", &d.first), ("next", &d.next)] {
                s.push_str(&format!("EAGLE3 draft entry ({name}): draft vocabulary {}\n", d.vocab));
                for step in steps {
                    s.push_str(&step.to_string());
                    s.push('\n');
                }
            }
        }
        s
    }
}
