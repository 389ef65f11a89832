//! MiniMax-M3's tiny random model: the fixtures' layer pattern (full+dense,
//! MSA+dense, full+MoE, then MSA+MoE), every structural feature of the real
//! model at test widths.

use super::names::{self, TextNames};
use crate::family::{Rng, TinySpec, HEAD_DIM};
use crate::model::{Role, TensorSpec};
use serde_json::json;

/// The hub-style config.json of the tiny model.
pub(super) fn config(spec: &TinySpec) -> serde_json::Value {
    let l = spec.layers;
    let h = spec.hidden;
    let heads = h / 16;
    // Layer pattern of the fixtures: 0 full+dense, 1 MSA+dense, 2 full+MoE, 3.. MSA+MoE.
    let moe: Vec<u8> = (0..l).map(|i| u8::from(i >= 2)).collect();
    let sparse: Vec<u8> = (0..l).map(|i| u8::from(i == 1 || i >= 3)).collect();
    let mut cfg = json!({
        "architectures": ["MiniMaxM3SparseForConditionalGeneration"],
        "model_type": "minimax_m3_vl",
        "text_config": {
            "architectures": ["MiniMaxM3SparseForCausalLM"],
            "hidden_size": h, "intermediate_size": h / 2, "num_hidden_layers": l,
            "num_attention_heads": heads, "num_key_value_heads": heads / 4, "head_dim": HEAD_DIM,
            "vocab_size": 512, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
            "use_gemma_norm": true, "attention_output_gate": false, "rope_theta": 5000000,
            "rotary_dim": HEAD_DIM / 2, "partial_rotary_factor": 0.5, "hidden_act": "swigluoai",
            "use_qk_norm": true, "qk_norm_type": "per_head", "tie_word_embeddings": false,
            "dense_intermediate_size": h * 3 / 2, "shared_intermediate_size": h / 2,
            "num_local_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
            "scoring_func": "sigmoid", "use_routing_bias": true, "routed_scaling_factor": 2.0,
            "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "num_mtp_modules": 0,
            "bos_token_id": 1, "eos_token_id": 2,
            "moe_layer_freq": moe,
            "sparse_attention_config": {
                "use_sparse_attention": true, "sparse_index_dim": HEAD_DIM,
                "sparse_num_index_heads": heads / 4, "sparse_topk_blocks": 2, "sparse_block_size": 4,
                "sparse_score_type": "max", "sparse_init_block": 0, "sparse_local_block": 1,
                "sparse_attention_freq": sparse, "sparse_disable_index_value": sparse
            }
        },
        "vision_config": {
            "model_type": "clip_vision_model", "hidden_size": spec.vision.hidden, "num_attention_heads": spec.vision.heads,
            "num_hidden_layers": spec.vision.layers, "intermediate_size": spec.vision.intermediate, "patch_size": 14, "image_size": 56,
            "num_channels": 3, "hidden_act": "gelu", "layer_norm_eps": 1e-5, "rope_theta": 10000.0,
            "rope_mode": "3d",
            "img_token_compression_config": {
                "image_token_compression_method": "patch_merge", "spatial_merge_size": 2, "temporal_patch_size": 2
            },
            "vision_segment_max_frames": 4
        },
        "image_token_index": 500, "video_token_index": 501, "projector_hidden_size": spec.vision.projector,
        "projector_hidden_act": "gelu", "multimodal_projector_bias": true,
        "vision_feature_layer": -1, "vision_feature_select_strategy": "full",
        "tie_word_embeddings": false, "torch_dtype": "bfloat16",
        "m3c_init_tiny": { "seed": spec.seed }
    });
    if spec.mxfp8 {
        // The published checkpoint's spelling: module names without the text prefix.
        let bare = TextNames::new("");
        let mut ignored = vec![
            bare.lm_head(),
            names::without_weight(&bare.embedding()).to_string(),
            names::vision::TOWER.into(),
            names::vision::PROJECTOR.into(),
            names::vision::PATCH_MERGE.into(),
        ];
        let vl = TextNames::new(names::VL_TEXT_PREFIX);
        ignored.extend((2..l).map(|i| vl.layer(i).router_stem()));
        cfg["quantization_config"] = json!({
            "quant_method": "mxfp8", "activation_scheme": "dynamic",
            "weight_block_size": [1, 32], "ignored_layers": ignored
        });
    }
    cfg
}

/// The standard deviation (or uniform half-width for norms) of a tensor's
/// random values: large enough that the clamps, the routing bias and the
/// block selection all matter.
pub(super) fn values(rng: &mut Rng, spec: &TensorSpec) -> Vec<f32> {
    let n = spec.numel() as usize;
    let name = spec.name.as_str();
    let fan_in = *spec.shape.last().unwrap_or(&1) as f64;
    let fan_in = if spec.shape.len() == 5 { spec.shape[1..].iter().product::<usize>() as f64 } else { fan_in };
    let normal = |rng: &mut Rng, std: f64| (0..n).map(|_| (rng.normal() * std) as f32).collect::<Vec<_>>();
    let is_norm_weight = spec.role == Role::Norm || names::is_norm_weight(name);
    if is_norm_weight {
        return (0..n).map(|_| (rng.uniform() - 0.5) as f32).collect();
    }
    if spec.role == Role::Router && spec.shape.len() == 1 {
        // The routing bias.
        return normal(rng, 0.5);
    }
    if name.ends_with(".bias") {
        return normal(rng, 0.1);
    }
    if spec.role == Role::Embedding {
        return normal(rng, 1.0);
    }
    let gated = names::is_gate_or_up(name);
    normal(rng, if gated { 3.0 } else { 1.0 } / fan_in.sqrt())
}

/// A small byte-level BPE (512 ids) with MiniMax-M3's special-token names
/// and a chat template of the real one's structure: the tokenizer of the
/// test fixture (`tests/fixtures/tiny-m3`, from the reference), so a tiny
/// checkpoint takes `--prompt` and `--chat` like a real one.
pub(super) const TOKENIZER_FILES: &[(&str, &[u8])] = &[
    ("tokenizer.json", include_bytes!("../../../data/tiny-tokenizer/tokenizer.json")),
    ("tokenizer_config.json", include_bytes!("../../../data/tiny-tokenizer/tokenizer_config.json")),
];
