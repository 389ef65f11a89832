use super::names::{self, ExpertProj, MlpProj, TextNames};
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
                self.push(names::weight(stem), vec![out, inp], TypeRule::Fp8, DType::F8E4M3, part, role);
                self.push(names::scales(stem), vec![out, inp / block], TypeRule::E8M0, DType::U8, part, scale_role);
            }
            Quantization::None => self.float(names::weight(stem), vec![out, inp], part, role),
        }
    }
}

/// Every tensor the checkpoint of `cfg` must contain, in a stable order.
pub fn expected_tensors(cfg: &ModelConfig) -> Vec<TensorSpec> {
    let t = &cfg.text;
    let float = cfg.torch_dtype.as_deref().and_then(DType::from_torch).unwrap_or(DType::BF16);
    let mut b = Builder { cfg, float, out: Vec::new() };
    let names = TextNames::new(&cfg.text_prefix);
    let h = t.hidden_size;

    b.float(names.embedding(), vec![t.vocab_size, h], Part::Embedding, Role::Embedding);
    for (l, kind) in t.layers.iter().enumerate() {
        let part = Part::Layer(l);
        let n = names.layer(l);
        b.float(n.input_norm(), vec![h], part, Role::Norm);
        b.float(n.post_attention_norm(), vec![h], part, Role::Norm);
        b.linear(&n.q_proj(), t.q_dim(), h, part, Role::Linear);
        b.linear(&n.k_proj(), t.kv_dim(), h, part, Role::Linear);
        b.linear(&n.v_proj(), t.kv_dim(), h, part, Role::Linear);
        b.linear(&n.o_proj(), h, t.q_dim(), part, Role::Linear);
        b.float(n.q_norm(), vec![t.head_dim], part, Role::Norm);
        b.float(n.k_norm(), vec![t.head_dim], part, Role::Norm);
        if kind.attention == AttentionKind::Sparse {
            let s = t.sparse.as_ref().expect("sparse layers imply a sparse config");
            b.linear(&n.index_q_proj(), s.num_index_heads * s.index_dim, h, part, Role::Linear);
            b.linear(&n.index_k_proj(), s.index_dim, h, part, Role::Linear);
            b.float(n.index_q_norm(), vec![s.index_dim], part, Role::Norm);
            b.float(n.index_k_norm(), vec![s.index_dim], part, Role::Norm);
        }
        match kind.mlp {
            MlpKind::Dense => mlp(&mut b, &n.mlp(), t.dense_intermediate_size, h, part),
            MlpKind::Moe => {
                // The router is stored in fp32 and is never quantized.
                b.push(n.router(), vec![t.moe.num_experts, h], TypeRule::Float, DType::F32, part, Role::Router);
                if t.moe.use_routing_bias {
                    b.push(n.router_bias(), vec![t.moe.num_experts], TypeRule::Float, DType::F32, part, Role::Router);
                }
                let i = t.moe.expert_intermediate_size;
                let experts = n.experts();
                for e in 0..t.moe.num_experts {
                    b.linear(&names::expert(&experts, e, ExpertProj::W1), i, h, part, Role::Expert(e));
                    b.linear(&names::expert(&experts, e, ExpertProj::W2), h, i, part, Role::Expert(e));
                    b.linear(&names::expert(&experts, e, ExpertProj::W3), i, h, part, Role::Expert(e));
                }
                if t.moe.num_shared_experts > 0 {
                    mlp(&mut b, &n.shared_experts(), t.moe.shared_intermediate_size, h, part);
                }
            }
        }
    }
    b.float(names.final_norm(), vec![h], Part::FinalNorm, Role::Norm);
    b.float(names::weight(&names.lm_head()), vec![t.vocab_size, h], Part::LmHead, Role::Linear);

    if let Some(v) = &cfg.vision {
        vision_tensors(&mut b, v, h);
    }
    b.out
}

/// A SwiGLU MLP's three linears (dense layers and the shared expert).
fn mlp(b: &mut Builder, stem: &str, inter: usize, h: usize, part: Part) {
    b.linear(&names::mlp_proj(stem, MlpProj::Gate), inter, h, part, Role::Linear);
    b.linear(&names::mlp_proj(stem, MlpProj::Up), inter, h, part, Role::Linear);
    b.linear(&names::mlp_proj(stem, MlpProj::Down), h, inter, part, Role::Linear);
}

fn vision_tensors(b: &mut Builder, v: &crate::config::VisionConfig, text_hidden: usize) {
    use names::vision as vn;
    let (part, role) = (Part::Vision, Role::Vision);
    let vh = v.hidden_size;
    // The patch convolution is stored in fp32 in the published checkpoints.
    b.push(
        vn::patch_embedding(),
        vec![vh, v.num_channels, v.temporal_patch_size, v.patch_size, v.patch_size],
        TypeRule::Float,
        DType::F32,
        part,
        role,
    );
    b.float(vn::pre_norm("weight"), vec![vh], part, role);
    b.float(vn::pre_norm("bias"), vec![vh], part, role);
    for l in 0..v.num_layers {
        let lp = vn::layer(l);
        for which in [1, 2] {
            b.float(vn::layer_norm(&lp, which, "weight"), vec![vh], part, role);
            b.float(vn::layer_norm(&lp, which, "bias"), vec![vh], part, role);
        }
        for proj in vn::ATTN_PROJS {
            b.float(vn::attn(&lp, proj, "weight"), vec![vh, vh], part, role);
            b.float(vn::attn(&lp, proj, "bias"), vec![vh], part, role);
        }
        b.float(vn::fc(&lp, 1, "weight"), vec![v.intermediate_size, vh], part, role);
        b.float(vn::fc(&lp, 1, "bias"), vec![v.intermediate_size], part, role);
        b.float(vn::fc(&lp, 2, "weight"), vec![vh, v.intermediate_size], part, role);
        b.float(vn::fc(&lp, 2, "bias"), vec![vh], part, role);
    }
    let ph = v.projector_hidden_size;
    let merged = v.spatial_merge_size * v.spatial_merge_size * text_hidden;
    for (stem, ins) in [(vn::PROJECTOR, vh), (vn::PATCH_MERGE, merged)] {
        // The reference always has these biases, whatever
        // `multimodal_projector_bias` says (vision spec §1).
        b.float(vn::projector(stem, 1, "weight"), vec![ph, ins], part, role);
        b.float(vn::projector(stem, 1, "bias"), vec![ph], part, role);
        b.float(vn::projector(stem, 2, "weight"), vec![text_hidden, ph], part, role);
        b.float(vn::projector(stem, 2, "bias"), vec![text_hidden], part, role);
    }
}
