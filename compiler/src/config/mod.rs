//! The model configuration: the hub `config.json`, read by its model family
//! (`crate::family`) into types the rest of the compiler relies on.
//!
//! Everything that later stages assume (head counts divide, one entry per
//! layer in the per-layer lists, index heads = KV heads, ...) is checked here,
//! once, and reported with the key and the expected value.

pub(crate) mod json;
pub(crate) mod parse;

use std::path::PathBuf;

pub use json::Obj;
pub use parse::bounds;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file is missing, not a regular file, too large or not UTF-8.
    #[error(transparent)]
    Input(#[from] m3c_contract::InputError),
    #[error("{file}: not valid JSON: {err}")]
    Json { file: PathBuf, err: serde_json::Error },
    #[error("{file}: missing key `{key}` (expected {expected})")]
    Missing { file: PathBuf, key: String, expected: String },
    #[error("{file}: `{key}`: expected {expected}, found {found}")]
    Invalid { file: PathBuf, key: String, expected: String, found: String },
    #[error("{file}: unsupported architecture {found} (m3c compiles the architectures {expected})")]
    Architecture { file: PathBuf, found: String, expected: String },
}

/// Which attention a decoder layer runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum AttentionKind {
    /// Full causal attention.
    Full,
    /// MiniMax Sparse Attention: causal attention restricted to the key blocks
    /// chosen by the indexer.
    Sparse,
}

/// Which feed-forward block a decoder layer runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MlpKind {
    Dense,
    Moe,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub struct LayerKind {
    pub attention: AttentionKind,
    pub mlp: MlpKind,
}

impl LayerKind {
    pub fn label(&self) -> &'static str {
        match (self.attention, self.mlp) {
            (AttentionKind::Full, MlpKind::Dense) => "full attention + dense MLP",
            (AttentionKind::Full, MlpKind::Moe) => "full attention + MoE",
            (AttentionKind::Sparse, MlpKind::Dense) => "MSA + dense MLP",
            (AttentionKind::Sparse, MlpKind::Moe) => "MSA + MoE",
        }
    }
}

/// MiniMax Sparse Attention settings (`text_config.sparse_attention_config`).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct SparseConfig {
    pub num_index_heads: usize,
    pub index_dim: usize,
    pub block_size: usize,
    pub topk_blocks: usize,
    pub local_blocks: usize,
    pub init_blocks: usize,
}

/// The experts of the MoE layers: `experts_per_token` of `num_experts`
/// routed experts chosen per token, and the shared expert every token
/// goes through.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct MoeConfig {
    /// Width of each routed expert.
    pub expert_intermediate_size: usize,
    /// Width of the shared expert (all shared experts together).
    pub shared_intermediate_size: usize,
    pub num_experts: usize,
    pub experts_per_token: usize,
    pub num_shared_experts: usize,
    /// The router's bias selects experts (it does not weight them).
    pub use_routing_bias: bool,
    pub routed_scaling_factor: f64,
}

/// The text backbone: everything the forward pass needs.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct TextConfig {
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    /// Channels of each head that RoPE rotates (the rest pass through).
    pub rotary_dim: usize,
    pub swiglu_alpha: f64,
    pub swiglu_limit: f64,
    pub swiglu_beta: f64,
    /// Width of the dense MLP layers.
    pub dense_intermediate_size: usize,
    /// The MoE layers' experts (the config's keys of the same names).
    #[serde(flatten)]
    pub moe: MoeConfig,
    pub tie_word_embeddings: bool,
    pub layers: Vec<LayerKind>,
    pub sparse: Option<SparseConfig>,
    pub bos_token_id: Option<usize>,
    pub eos_token_id: Option<usize>,
}

impl TextConfig {
    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
    /// Query heads that share one KV head.
    pub fn gqa_group(&self) -> usize {
        self.num_heads / self.num_kv_heads
    }
    pub fn has_sparse_layers(&self) -> bool {
        self.layers.iter().any(|l| l.attention == AttentionKind::Sparse)
    }
    /// Positions per KV cache block: the MSA block, so a block is exactly
    /// the unit MSA selects (128 on MiniMax-M3), or 128 without MSA.
    pub fn kv_block(&self) -> usize {
        self.sparse.as_ref().map_or(128, |s| s.block_size)
    }
}

/// The CLIP-style vision tower (`vision_config`) and the projector around it.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct VisionConfig {
    pub hidden_size: usize,
    pub num_heads: usize,
    pub num_layers: usize,
    pub intermediate_size: usize,
    pub patch_size: usize,
    pub num_channels: usize,
    pub temporal_patch_size: usize,
    pub spatial_merge_size: usize,
    pub layer_norm_eps: f64,
    pub rope_theta: f64,
    /// `projector_hidden_size`: width inside the projector and the patch merger.
    pub projector_hidden_size: usize,
    pub projector_bias: bool,
    pub image_token_id: usize,
    pub video_token_id: usize,
}

/// A model family m3c compiles, by its id (`minimax_m3`). Only
/// `crate::family`'s registry makes one, so every value names a family
/// it implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(transparent)]
pub struct Family(pub(crate) &'static str);

/// How the checkpoint's linears are stored.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub enum Quantization {
    /// Plain floating point (bf16, f16 or f32) everywhere.
    None,
    /// MXFP8: `float8_e4m3fn` weights with one E8M0 scale (`uint8`) per 1×`block` input block.
    Mxfp8 { block: usize, ignored_layers: Vec<String> },
}

/// A parsed and validated config.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ModelConfig {
    /// The model family that read it, and that builds its layout and graph.
    pub family: Family,
    /// The file it came from (for messages).
    pub source: PathBuf,
    /// `architectures[0]` of the file.
    pub architecture: String,
    /// Prefix of the text tensors in the checkpoint: `language_model.` for the
    /// VL layout, empty for a flat text-only checkpoint.
    pub text_prefix: String,
    pub text: TextConfig,
    pub vision: Option<VisionConfig>,
    pub quantization: Quantization,
    /// `torch_dtype` of the file, if stated.
    pub torch_dtype: Option<String>,
}

impl ModelConfig {
    pub fn is_mxfp8(&self) -> bool {
        matches!(self.quantization, Quantization::Mxfp8 { .. })
    }
}
