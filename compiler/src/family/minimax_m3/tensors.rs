//! MiniMax-M3's checkpoint layout: the text backbone (full and MSA layers,
//! dense and MoE MLPs, the shared expert) and the vision tower, by hub name.

use super::names::{self, ExpertProj, MlpProj, TextNames};
use crate::config::{AttentionKind, MlpKind, ModelConfig};
use crate::dtype::DType;
use crate::model::tensors::LayoutBuilder;
use crate::model::{Part, Role, TensorSpec, TypeRule};

/// Every tensor the checkpoint of `cfg` must contain, in a stable order.
pub(super) fn tensors(cfg: &ModelConfig) -> Vec<TensorSpec> {
    let t = &cfg.text;
    let mut b = LayoutBuilder::new(cfg);
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
fn mlp(b: &mut LayoutBuilder, stem: &str, inter: usize, h: usize, part: Part) {
    b.linear(&names::mlp_proj(stem, MlpProj::Gate), inter, h, part, Role::Linear);
    b.linear(&names::mlp_proj(stem, MlpProj::Up), inter, h, part, Role::Linear);
    b.linear(&names::mlp_proj(stem, MlpProj::Down), h, inter, part, Role::Linear);
}

fn vision_tensors(b: &mut LayoutBuilder, v: &crate::config::VisionConfig, text_hidden: usize) {
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
