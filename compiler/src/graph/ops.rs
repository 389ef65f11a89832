use crate::model::Part;
use std::fmt;

/// A tensor dimension: fixed by the config, or known only per step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dim {
    /// Tokens processed in this step (prompt length at prefill, 1 at decode).
    Tokens,
    /// Positions held in the cache after this step (past + current tokens).
    Context,
    /// Key blocks of the context: ceil(Context / block size).
    Blocks,
    /// Patch rows of the images being encoded (vision tower).
    Patches,
    /// Image tokens after the 2×2 patch merge: `Patches / 4`.
    Merged,
    Fixed(usize),
}

impl fmt::Display for Dim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Dim::Tokens => f.write_str("S"),
            Dim::Context => f.write_str("T"),
            Dim::Blocks => f.write_str("NB"),
            Dim::Patches => f.write_str("P"),
            Dim::Merged => f.write_str("M"),
            Dim::Fixed(n) => write!(f, "{n}"),
        }
    }
}

/// Element type of a value. `Act` is the activation type, chosen per back end
/// (f32 on the host for exact comparison, bf16 on GPUs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Elem {
    Act,
    F32,
    I32,
    I64,
}

impl fmt::Display for Elem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Elem::Act => "act",
            Elem::F32 => "f32",
            Elem::I32 => "i32",
            Elem::I64 => "i64",
        })
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct TensorType {
    pub shape: Vec<Dim>,
    pub elem: Elem,
}

impl fmt::Display for TensorType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let dims: Vec<String> = self.shape.iter().map(|d| d.to_string()).collect();
        write!(f, "[{}] {}", dims.join(","), self.elem)
    }
}

/// Which per-layer cache an append writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CacheKind {
    Key,
    Value,
    /// MSA index keys (post-norm, post-RoPE), one vector per token.
    IndexKey,
}

/// One operation of the model. Weight operands are named by their hub tensor
/// name; they are bound at run time, never at compile time.
#[derive(Debug, Clone, PartialEq)]
pub enum Op {
    /// Token ids of this step: `[S] i64`.
    TokenIds,
    /// Absolute positions of this step's tokens: `[S] i64`.
    Positions,
    /// Row gather from the embedding table.
    Embedding { weight: String },
    /// RMSNorm over the last dim, in f32: Gemma's `x · rsqrt(mean(x²) + eps) · (1 + w)`,
    /// or (`gemma` false) the plain `· w` of Llama (an EAGLE3 draft's norms).
    RmsNorm { weight: String, eps: f64, gemma: bool },
    /// `y = x Wᵀ` (no bias). `mxfp8_block` is set when W is fp8 with E8M0 block scales.
    Linear { weight: String, out: usize, inp: usize, mxfp8_block: Option<usize> },
    /// Gemma RMSNorm of each head's `head_dim` channels, one weight for all heads.
    HeadRmsNorm { weight: String, heads: usize, head_dim: usize, eps: f64 },
    /// NeoX rotate-half RoPE on channels `0..rotary_dim` of each head (after a
    /// per-head norm, fused with it, or on the projection itself).
    Rope { heads: usize, head_dim: usize, rotary_dim: usize, theta: f64 },
    /// Appends this step's rows to a layer cache and yields the whole cache `[T, heads, dim]`.
    CacheAppend { kind: CacheKind, layer: usize, heads: usize, dim: usize },
    /// MSA indexer: `score[g, q, t] = <iq[q, g], ik[t]>` with the causal mask, f32.
    IndexScores { heads: usize, dim: usize },
    /// Max of the token scores inside each key block.
    BlockMaxScore { block: usize },
    /// Per index head and query: the top-k blocks, the query's own `local` blocks
    /// and the first `init` blocks forced, future blocks dropped.
    TopKBlocks { k: usize, block: usize, local: usize, init: usize },
    /// Causal GQA attention; with a block selection operand, restricted to the selected blocks.
    Attention { heads: usize, kv_heads: usize, head_dim: usize, scale: f64, sparse_block: Option<usize> },
    /// Elementwise residual add.
    Add,
    /// SwiGLU-OAI: `min(g, limit) · σ(alpha · min(g, limit)) · (clamp(u, ±limit) + beta)`.
    SwiGluOai { alpha: f64, limit: f64, beta: f64 },
    /// fp32 sigmoid router: bias used for selection only, top-k, renormalised
    /// weights times `scale`. Yields `[S, k]` weights and `[S, k]` expert ids.
    Router { weight: String, bias: Option<String>, experts: usize, top_k: usize, scale: f64 },
    /// `Σ_k w_k · Expert_{id_k}(h)` with SwiGLU-OAI experts `w1` (gate), `w3` (up), `w2` (down).
    RoutedExperts {
        /// The experts' common stem, for listings.
        stem: String,
        /// Each expert's gate, up and down linear stems, in the order of
        /// the kernel's pointer table.
        weights: Vec<[String; 3]>,
        experts: usize,
        hidden: usize,
        intermediate: usize,
        mxfp8_block: Option<usize>,
        alpha: f64,
        limit: f64,
        beta: f64,
    },
    /// The next token of each row of logits, under the row's sampling
    /// parameters (greedy or drawn), which the runtime passes at each step.
    Sample,
    /// Normalised patch rows of the images `[P, patch_row] f32` (vision input).
    PixelRows,
    /// Each patch row's `(t, h, w)` position `[P, 3] i64` (vision input).
    PatchPositions,
    /// Each patch row's last row within its image `[P] i64`: attention
    /// sees exactly its own image (one segment per image).
    ImageSegments,
    /// LayerNorm with weight and bias over the last dim, in f32.
    LayerNorm { weight: String, bias: String, eps: f64 },
    /// `y = x + b`, then exact GELU when `gelu`: a linear's bias and the activation after it.
    BiasAct { bias: String, gelu: bool },
    /// 3-D axial RoPE on channels `0..3·axis_dim` of each head (vision spec §4.3).
    AxialRope { heads: usize, head_dim: usize, axis_dim: usize, theta: f64 },
    /// Bidirectional attention within each image.
    ImageAttention { heads: usize, head_dim: usize, scale: f64 },
    /// `[P, w]` viewed as `[P/4, 4w]`: the 2×2 merge groups are consecutive rows.
    MergePatches { factor: usize },
    /// The embedding rows of image placeholder tokens replaced by the
    /// merged image features, in order (operands: embeddings, features).
    ImageScatter { token: usize },
    /// The residual stream entering a target layer an EAGLE3 draft reads,
    /// copied into aux slot `slot` of the step (no value of its own).
    AuxState { slot: usize },
    /// An EAGLE3 draft's first-step input: the target's aux states of each
    /// row, concatenated in slot order `[S, slots·hidden]`.
    AuxRows,
    /// An EAGLE3 draft's later-step input: its own pre-norm hidden state of
    /// the row before `[S, hidden]`.
    DraftHidden,
    /// `[a | b]`, row by row.
    Concat,
}

impl Op {
    pub fn name(&self) -> &'static str {
        match self {
            Op::TokenIds => "token_ids",
            Op::Positions => "positions",
            Op::Embedding { .. } => "embedding",
            Op::RmsNorm { .. } => "rms_norm",
            Op::Linear { .. } => "linear",
            Op::HeadRmsNorm { .. } => "head_rms_norm",
            Op::Rope { .. } => "rope",
            Op::CacheAppend { .. } => "cache_append",
            Op::IndexScores { .. } => "index_scores",
            Op::BlockMaxScore { .. } => "block_max_score",
            Op::TopKBlocks { .. } => "topk_blocks",
            Op::Attention { .. } => "attention",
            Op::Add => "add",
            Op::SwiGluOai { .. } => "swiglu_oai",
            Op::Router { .. } => "router",
            Op::RoutedExperts { .. } => "routed_experts",
            Op::Sample => "sample",
            Op::PixelRows => "pixel_rows",
            Op::PatchPositions => "patch_positions",
            Op::ImageSegments => "image_segments",
            Op::LayerNorm { .. } => "layer_norm",
            Op::BiasAct { gelu: false, .. } => "bias",
            Op::BiasAct { gelu: true, .. } => "bias_gelu",
            Op::AxialRope { .. } => "axial_rope",
            Op::ImageAttention { .. } => "image_attention",
            Op::MergePatches { .. } => "merge_patches",
            Op::ImageScatter { .. } => "image_scatter",
            Op::AuxState { .. } => "aux_state",
            Op::AuxRows => "aux_rows",
            Op::DraftHidden => "draft_hidden",
            Op::Concat => "concat",
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Node {
    pub op: Op,
    pub ty: TensorType,
    pub part: Part,
}
