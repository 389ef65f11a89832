//! The hub's naming conventions that every family shares: the only place
//! besides a family's own `names.rs` that spells tensor names (a tidy test
//! keeps it so). A family's layer, expert and vision names live in its
//! folder (`family/minimax_m3/names.rs`); what is here is the safetensors
//! and vLLM convention: linear stems, MXFP8 scales, EAGLE3 draft heads.
//!
//! Linear layers are named by their *stem*: the stored tensors are
//! `STEM.weight`, plus `STEM.weight_scale_inv` under MXFP8.

/// The stored weight of a linear stem.
pub fn weight(stem: &str) -> String {
    format!("{stem}.weight")
}

/// The bias of a stem (the vision tower's linears and LayerNorms).
pub fn bias(stem: &str) -> String {
    format!("{stem}.bias")
}

/// The E8M0 block scales of an MXFP8 linear stem.
pub fn scales(stem: &str) -> String {
    format!("{stem}.weight_scale_inv")
}

/// A tensor name without its `.weight` suffix (for listings).
pub fn without_weight(name: &str) -> &str {
    name.strip_suffix(".weight").unwrap_or(name)
}

/// An EAGLE3 draft checkpoint's own embedding (absent when the draft
/// shares its target's), as vLLM's `llama_eagle3.py` loads it.
pub const EAGLE3_OWN_EMBEDDING: &str = "embed_tokens.weight";

/// An EAGLE3 draft head's tensors, as vLLM's `llama_eagle3.py` loads them.
pub mod eagle3 {
    /// The linear over the concatenated aux states.
    pub const FC: &str = "fc.weight";
    pub const INPUT_NORM: &str = "midlayer.input_layernorm.weight";
    pub const HIDDEN_NORM: &str = "midlayer.hidden_norm.weight";
    pub const POST_ATTENTION_NORM: &str = "midlayer.post_attention_layernorm.weight";
    pub const Q: &str = "midlayer.self_attn.q_proj.weight";
    pub const K: &str = "midlayer.self_attn.k_proj.weight";
    pub const V: &str = "midlayer.self_attn.v_proj.weight";
    pub const O: &str = "midlayer.self_attn.o_proj.weight";
    pub const GATE: &str = "midlayer.mlp.gate_proj.weight";
    pub const UP: &str = "midlayer.mlp.up_proj.weight";
    pub const DOWN: &str = "midlayer.mlp.down_proj.weight";
    pub const NORM: &str = "norm.weight";
    pub const LM_HEAD: &str = "lm_head.weight";
}

/// Whether `name` is the E8M0 scales tensor of an MXFP8 linear.
pub fn is_scales(name: &str) -> bool {
    name.ends_with(".weight_scale_inv")
}
