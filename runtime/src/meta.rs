//! What `m3c compile` tells a stage about itself: embedded in the executable
//! as JSON (the `m3c_stage_meta` symbol), so a stage binary is self-describing.

use serde::Deserialize;

#[derive(Debug, Clone, Deserialize)]
pub struct TensorSlot {
    pub name: String,
    pub shape: Vec<usize>,
    /// safetensors dtype name (`BF16`, `F32`, `F8_E4M3`, `U8`, ...).
    pub dtype: String,
}

/// One per-layer cache (key, value or MSA index key) of each sequence.
#[derive(Debug, Clone, Deserialize)]
pub struct CacheSlot {
    pub width: usize,
    /// Bytes per element: 4 (f32) or 2 (bf16).
    #[serde(default = "f32_bytes")]
    pub bytes: usize,
}

fn f32_bytes() -> usize {
    4
}

#[derive(Debug, Clone, Deserialize)]
pub struct StageMeta {
    /// Hash of every compile input; all ranks of a job must agree on it.
    pub compile_id: String,
    /// sha256 of the config.json the stages were compiled from.
    pub config_sha256: String,
    pub stage: usize,
    pub stages: usize,
    pub hidden: usize,
    /// Bytes per stored activation: 4 (f32) or 2 (bf16 bits, `--activations bf16`).
    #[serde(default = "f32_bytes")]
    pub act_bytes: usize,
    pub vocab: usize,
    /// `max_position_embeddings` of the config: the longest sequence.
    #[serde(default = "unbounded")]
    pub max_positions: usize,
    /// What the stage holds, e.g. `embed + layers 0-3`.
    pub holds: String,
    pub first_stage: bool,
    pub last_stage: bool,
    pub tensors: Vec<TensorSlot>,
    pub caches: Vec<CacheSlot>,
    /// `host`, or `cuda ARCH`.
    #[serde(default = "host")]
    pub target: String,
    /// The plan's CUDA device ordinal for this stage, if it names one.
    #[serde(default)]
    pub device: Option<i32>,
}

fn unbounded() -> usize {
    usize::MAX
}

fn host() -> String {
    "host".into()
}

impl StageMeta {
    /// f32 words per row of `x` (the activations a stage takes and passes
    /// on): the runtime moves `x` as f32 words whatever it holds, so bf16
    /// rows (an even hidden size, checked at compile time) take half as many.
    pub fn x_words(&self) -> usize {
        self.hidden * self.act_bytes / 4
    }

    pub fn parse(bytes: &[u8]) -> Result<StageMeta, String> {
        serde_json::from_slice(bytes).map_err(|e| format!("embedded stage metadata is unreadable ({e}): the executable is damaged"))
    }
}
