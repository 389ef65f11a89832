use crate::config::{AttentionKind, MlpKind, ModelConfig, Quantization};
use crate::dtype::DType;

/// Where a tensor lives in the model; stages are made of parts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub enum Part {
    Embedding,
    Layer(usize),
    FinalNorm,
    LmHead,
    /// The vision tower, projector and patch merger.
    Vision,
}

/// What a tensor does; the cost model reads this.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub enum Role {
    Embedding,
    Norm,
    /// A linear weight `[out, in]`.
    Linear,
    /// The MXFP8 E8M0 scales `[out, in/32]` of the linear before it.
    Scale,
    /// A routed expert's tensor (linear or scale) of expert `e`.
    Expert(usize),
    /// MoE router weight or its selection bias.
    Router,
    Vision,
}

/// Which element types the checkpoint may store a tensor in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum TypeRule {
    /// Any floating type (bf16, f16, f32).
    Float,
    /// `float8_e4m3fn` (MXFP8 weight).
    Fp8,
    /// `uint8` E8M0 scales.
    E8M0,
}

impl TypeRule {
    pub fn accepts(self, d: DType) -> bool {
        match self {
            TypeRule::Float => d.is_float(),
            TypeRule::Fp8 => d == DType::F8E4M3,
            TypeRule::E8M0 => d == DType::U8,
        }
    }
    pub fn describe(self) -> &'static str {
        match self {
            TypeRule::Float => "bf16, f16 or f32",
            TypeRule::Fp8 => "f8_e4m3 (MXFP8 weight)",
            TypeRule::E8M0 => "u8 (MXFP8 E8M0 scales)",
        }
    }
}

#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub rule: TypeRule,
    /// The type the published checkpoint uses (for sizes without weights).
    pub nominal: DType,
    pub part: Part,
    pub role: Role,
}

impl TensorSpec {
    pub fn numel(&self) -> u64 {
        self.shape.iter().map(|&d| d as u64).product()
    }
    pub fn nominal_bytes(&self) -> u64 {
        self.numel() * self.nominal.size_bytes() as u64
    }
    /// Scales are storage, not parameters.
    pub fn is_parameter(&self) -> bool {
        self.rule != TypeRule::E8M0
    }
}

struct Builder<'a> {
    cfg: &'a ModelConfig,
    float: DType,
    out: Vec<TensorSpec>,
}

impl Builder<'_> {
    fn push(&mut self, name: String, shape: Vec<usize>, rule: TypeRule, nominal: DType, part: Part, role: Role) {
        self.out.push(TensorSpec { name, shape, rule, nominal, part, role });
    }

    fn float(&mut self, name: String, shape: Vec<usize>, part: Part, role: Role) {
        let nominal = self.float;
        self.push(name, shape, TypeRule::Float, nominal, part, role);
    }

    /// A text-layer linear: fp8 + scales under MXFP8, else float.
    fn linear(&mut self, stem: &str, out: usize, inp: usize, part: Part, role: Role) {
        match &self.cfg.quantization {
            Quantization::Mxfp8 { block, .. } => {
                let scale_role = if let Role::Expert(e) = role { Role::Expert(e) } else { Role::Scale };
                self.push(format!("{stem}.weight"), vec![out, inp], TypeRule::Fp8, DType::F8E4M3, part, role);
                self.push(format!("{stem}.weight_scale_inv"), vec![out, inp / block], TypeRule::E8M0, DType::U8, part, scale_role);
            }
            Quantization::None => self.float(format!("{stem}.weight"), vec![out, inp], part, role),
        }
    }
}

/// Every tensor the checkpoint of `cfg` must contain, in a stable order.
pub fn expected_tensors(cfg: &ModelConfig) -> Vec<TensorSpec> {
    let t = &cfg.text;
    let float = cfg.torch_dtype.as_deref().and_then(DType::from_torch).unwrap_or(DType::BF16);
    let mut b = Builder { cfg, float, out: Vec::new() };
    let p = &cfg.text_prefix;
    let h = t.hidden_size;

    b.float(format!("{p}model.embed_tokens.weight"), vec![t.vocab_size, h], Part::Embedding, Role::Embedding);
    for (l, kind) in t.layers.iter().enumerate() {
        let part = Part::Layer(l);
        let lp = format!("{p}model.layers.{l}");
        b.float(format!("{lp}.input_layernorm.weight"), vec![h], part, Role::Norm);
        b.float(format!("{lp}.post_attention_layernorm.weight"), vec![h], part, Role::Norm);
        let a = format!("{lp}.self_attn");
        b.linear(&format!("{a}.q_proj"), t.q_dim(), h, part, Role::Linear);
        b.linear(&format!("{a}.k_proj"), t.kv_dim(), h, part, Role::Linear);
        b.linear(&format!("{a}.v_proj"), t.kv_dim(), h, part, Role::Linear);
        b.linear(&format!("{a}.o_proj"), h, t.q_dim(), part, Role::Linear);
        b.float(format!("{a}.q_norm.weight"), vec![t.head_dim], part, Role::Norm);
        b.float(format!("{a}.k_norm.weight"), vec![t.head_dim], part, Role::Norm);
        if kind.attention == AttentionKind::Sparse {
            let s = t.sparse.as_ref().expect("sparse layers imply a sparse config");
            b.linear(&format!("{a}.index_q_proj"), s.num_index_heads * s.index_dim, h, part, Role::Linear);
            b.linear(&format!("{a}.index_k_proj"), s.index_dim, h, part, Role::Linear);
            b.float(format!("{a}.index_q_norm.weight"), vec![s.index_dim], part, Role::Norm);
            b.float(format!("{a}.index_k_norm.weight"), vec![s.index_dim], part, Role::Norm);
        }
        match kind.mlp {
            MlpKind::Dense => {
                let m = format!("{lp}.mlp");
                let i = t.dense_intermediate_size;
                b.linear(&format!("{m}.gate_proj"), i, h, part, Role::Linear);
                b.linear(&format!("{m}.up_proj"), i, h, part, Role::Linear);
                b.linear(&format!("{m}.down_proj"), h, i, part, Role::Linear);
            }
            MlpKind::Moe => {
                let m = format!("{lp}.block_sparse_moe");
                // The router is stored in fp32 and is never quantized.
                b.push(format!("{m}.gate.weight"), vec![t.num_experts, h], TypeRule::Float, DType::F32, part, Role::Router);
                if t.use_routing_bias {
                    b.push(format!("{m}.e_score_correction_bias"), vec![t.num_experts], TypeRule::Float, DType::F32, part, Role::Router);
                }
                let i = t.expert_intermediate_size;
                for e in 0..t.num_experts {
                    let ep = format!("{m}.experts.{e}");
                    b.linear(&format!("{ep}.w1"), i, h, part, Role::Expert(e));
                    b.linear(&format!("{ep}.w2"), h, i, part, Role::Expert(e));
                    b.linear(&format!("{ep}.w3"), i, h, part, Role::Expert(e));
                }
                if t.num_shared_experts > 0 {
                    let s = t.shared_intermediate_size;
                    b.linear(&format!("{m}.shared_experts.gate_proj"), s, h, part, Role::Linear);
                    b.linear(&format!("{m}.shared_experts.up_proj"), s, h, part, Role::Linear);
                    b.linear(&format!("{m}.shared_experts.down_proj"), h, s, part, Role::Linear);
                }
            }
        }
    }
    b.float(format!("{p}model.norm.weight"), vec![h], Part::FinalNorm, Role::Norm);
    b.float(format!("{p}lm_head.weight"), vec![t.vocab_size, h], Part::LmHead, Role::Linear);

    if let Some(v) = &cfg.vision {
        vision_tensors(&mut b, v, h);
    }
    b.out
}

fn vision_tensors(b: &mut Builder, v: &crate::config::VisionConfig, text_hidden: usize) {
    let (part, role) = (Part::Vision, Role::Vision);
    let vh = v.hidden_size;
    let vm = "vision_tower.vision_model";
    // The patch convolution is stored in fp32 in the published checkpoints.
    b.push(
        format!("{vm}.embeddings.patch_embedding.weight"),
        vec![vh, v.num_channels, v.temporal_patch_size, v.patch_size, v.patch_size],
        TypeRule::Float,
        DType::F32,
        part,
        role,
    );
    b.float(format!("{vm}.pre_layrnorm.weight"), vec![vh], part, role);
    b.float(format!("{vm}.pre_layrnorm.bias"), vec![vh], part, role);
    for l in 0..v.num_layers {
        let lp = format!("{vm}.encoder.layers.{l}");
        for n in ["layer_norm1", "layer_norm2"] {
            b.float(format!("{lp}.{n}.weight"), vec![vh], part, role);
            b.float(format!("{lp}.{n}.bias"), vec![vh], part, role);
        }
        for n in ["q_proj", "k_proj", "v_proj", "out_proj"] {
            b.float(format!("{lp}.self_attn.{n}.weight"), vec![vh, vh], part, role);
            b.float(format!("{lp}.self_attn.{n}.bias"), vec![vh], part, role);
        }
        b.float(format!("{lp}.mlp.fc1.weight"), vec![v.intermediate_size, vh], part, role);
        b.float(format!("{lp}.mlp.fc1.bias"), vec![v.intermediate_size], part, role);
        b.float(format!("{lp}.mlp.fc2.weight"), vec![vh, v.intermediate_size], part, role);
        b.float(format!("{lp}.mlp.fc2.bias"), vec![vh], part, role);
    }
    let ph = v.projector_hidden_size;
    let merged = v.spatial_merge_size * v.spatial_merge_size * text_hidden;
    for (stem, ins) in [("multi_modal_projector", vh), ("patch_merge_mlp", merged)] {
        b.float(format!("{stem}.linear_1.weight"), vec![ph, ins], part, role);
        if v.projector_bias {
            b.float(format!("{stem}.linear_1.bias"), vec![ph], part, role);
        }
        b.float(format!("{stem}.linear_2.weight"), vec![text_hidden, ph], part, role);
        if v.projector_bias {
            b.float(format!("{stem}.linear_2.bias"), vec![text_hidden], part, role);
        }
    }
}
