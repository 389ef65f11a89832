//! The hub names of MiniMax-M3's tensors: the only place that spells them.
//! The family's layout (`tensors.rs`), graph (`graph.rs`) and tiny
//! generator ask here; shared code learns a name only from the layout or
//! the graph (a tidy test keeps it so).

pub use crate::model::names::{weight, without_weight};

/// Names of the text model, under a prefix (`language_model.` in the VL
/// checkpoints, empty in a flat text config).
#[derive(Debug, Clone, Copy)]
pub struct TextNames<'a> {
    pub prefix: &'a str,
}

/// The prefix of the text model in the published VL checkpoints.
pub const VL_TEXT_PREFIX: &str = "language_model.";

impl<'a> TextNames<'a> {
    pub fn new(prefix: &'a str) -> TextNames<'a> {
        TextNames { prefix }
    }
    pub fn embedding(&self) -> String {
        format!("{}model.embed_tokens.weight", self.prefix)
    }
    pub fn final_norm(&self) -> String {
        format!("{}model.norm.weight", self.prefix)
    }
    pub fn lm_head(&self) -> String {
        format!("{}lm_head", self.prefix)
    }
    pub fn layer(&self, l: usize) -> LayerNames {
        LayerNames { lp: format!("{}model.layers.{l}", self.prefix) }
    }
}

/// Which projection of an MLP (dense, shared expert).
#[derive(Debug, Clone, Copy)]
pub enum MlpProj {
    Gate,
    Up,
    Down,
}

/// Which matrix of a routed expert: w1 (gate), w3 (up), w2 (down).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertProj {
    W1,
    W3,
    W2,
}

impl ExpertProj {
    /// In the order of a routed-experts pointer table.
    pub const TABLE_ORDER: [ExpertProj; 3] = [ExpertProj::W1, ExpertProj::W3, ExpertProj::W2];
    fn name(self) -> &'static str {
        match self {
            ExpertProj::W1 => "w1",
            ExpertProj::W3 => "w3",
            ExpertProj::W2 => "w2",
        }
    }
}

/// A projection of the MLP at `stem`.
pub fn mlp_proj(stem: &str, p: MlpProj) -> String {
    let n = match p {
        MlpProj::Gate => "gate_proj",
        MlpProj::Up => "up_proj",
        MlpProj::Down => "down_proj",
    };
    format!("{stem}.{n}")
}

/// Expert `e`'s matrix `p`, under the experts stem.
pub fn expert(experts: &str, e: usize, p: ExpertProj) -> String {
    format!("{experts}.{e}.{}", p.name())
}

/// Names of one decoder layer.
#[derive(Debug, Clone)]
pub struct LayerNames {
    lp: String,
}

impl LayerNames {
    fn attn(&self, n: &str) -> String {
        format!("{}.self_attn.{n}", self.lp)
    }
    pub fn input_norm(&self) -> String {
        format!("{}.input_layernorm.weight", self.lp)
    }
    pub fn post_attention_norm(&self) -> String {
        format!("{}.post_attention_layernorm.weight", self.lp)
    }
    pub fn q_proj(&self) -> String {
        self.attn("q_proj")
    }
    pub fn k_proj(&self) -> String {
        self.attn("k_proj")
    }
    pub fn v_proj(&self) -> String {
        self.attn("v_proj")
    }
    pub fn o_proj(&self) -> String {
        self.attn("o_proj")
    }
    pub fn q_norm(&self) -> String {
        self.attn("q_norm.weight")
    }
    pub fn k_norm(&self) -> String {
        self.attn("k_norm.weight")
    }
    pub fn index_q_proj(&self) -> String {
        self.attn("index_q_proj")
    }
    pub fn index_k_proj(&self) -> String {
        self.attn("index_k_proj")
    }
    pub fn index_q_norm(&self) -> String {
        self.attn("index_q_norm.weight")
    }
    pub fn index_k_norm(&self) -> String {
        self.attn("index_k_norm.weight")
    }
    /// The dense MLP's stem.
    pub fn mlp(&self) -> String {
        format!("{}.mlp", self.lp)
    }
    fn moe(&self, n: &str) -> String {
        format!("{}.block_sparse_moe.{n}", self.lp)
    }
    /// The router's weight (stored f32, never quantized).
    pub fn router(&self) -> String {
        self.moe("gate.weight")
    }
    /// The router's stem, as MXFP8 `ignored_layers` name it.
    pub fn router_stem(&self) -> String {
        self.moe("gate")
    }
    pub fn router_bias(&self) -> String {
        self.moe("e_score_correction_bias")
    }
    /// The routed experts' stem (see [`expert`]).
    pub fn experts(&self) -> String {
        self.moe("experts")
    }
    /// The shared expert's MLP stem.
    pub fn shared_experts(&self) -> String {
        self.moe("shared_experts")
    }
}

/// Names of the vision tower and projectors.
pub mod vision {
    pub const TOWER: &str = "vision_tower";
    pub const PROJECTOR: &str = "multi_modal_projector";
    pub const PATCH_MERGE: &str = "patch_merge_mlp";
    const MODEL: &str = "vision_tower.vision_model";

    pub fn patch_embedding() -> String {
        format!("{MODEL}.embeddings.patch_embedding.weight")
    }
    /// `weight` and `bias` of the pre-LayerNorm (the checkpoint's spelling).
    pub fn pre_norm(param: &str) -> String {
        format!("{MODEL}.pre_layrnorm.{param}")
    }
    pub fn layer(l: usize) -> String {
        format!("{MODEL}.encoder.layers.{l}")
    }
    /// The encoder layer a vision tensor belongs to, if any.
    pub fn layer_of(name: &str) -> Option<usize> {
        let rest = name.strip_prefix(MODEL)?.strip_prefix(".encoder.layers.")?;
        rest.split('.').next()?.parse().ok()
    }
    pub fn layer_norm(layer: &str, which: usize, param: &str) -> String {
        format!("{layer}.layer_norm{which}.{param}")
    }
    pub fn attn(layer: &str, proj: &str, param: &str) -> String {
        format!("{layer}.self_attn.{proj}.{param}")
    }
    pub const ATTN_PROJS: [&str; 4] = ["q_proj", "k_proj", "v_proj", "out_proj"];
    pub fn fc(layer: &str, which: usize, param: &str) -> String {
        format!("{layer}.mlp.fc{which}.{param}")
    }
    pub fn projector(stem: &str, which: usize, param: &str) -> String {
        format!("{stem}.linear_{which}.{param}")
    }
}

/// Whether `name` is a norm's scale (RMSNorm or LayerNorm weight).
pub fn is_norm_weight(name: &str) -> bool {
    name.contains("norm") && name.ends_with(".weight")
}

/// Whether `name` belongs to a gate or up projection (dense, shared or
/// expert), which feed SwiGLU.
pub fn is_gate_or_up(name: &str) -> bool {
    [".gate_proj.", ".up_proj.", ".w1.", ".w3."].iter().any(|p| name.contains(p))
}
