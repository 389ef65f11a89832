//! MiniMax-M3's config.json → [`ModelConfig`], with every assumption
//! checked: the VL wrapper with a `text_config` (optionally with an MXFP8
//! `quantization_config`), or a flat text-only config.

use crate::config::bounds;
use crate::config::json::short;
use crate::config::parse::{check, opt_size, size};
use crate::config::*;
use crate::family::Family;
use serde_json::Value;

/// The architecture of the VL wrapper (the published checkpoints).
const VL_ARCHITECTURE: &str = "MiniMaxM3SparseForConditionalGeneration";
/// Every architecture the family reads: the VL wrapper first (messages list
/// them in this order), then those of a flat, text-only config.
pub(super) const ARCHITECTURES: &[&str] = &[VL_ARCHITECTURE, "MiniMaxM3SparseForCausalLM", "MiniMaxM3VLForCausalLM"];

pub(super) fn parse(root: &Obj, architecture: &str) -> Result<ModelConfig, ConfigError> {
    let is_vl = architecture == VL_ARCHITECTURE;
    let (text_obj, text_prefix) = if is_vl { (root.obj("text_config")?, super::names::VL_TEXT_PREFIX) } else { (root.clone(), "") };
    // Flat configs are sometimes used with the hub shards, whose names carry
    // `language_model.`; the weight binder accepts either (see weights::bind).
    let text = parse_text(&text_obj)?;
    let vision = if is_vl { Some(parse_vision(root, &text)?) } else { None };
    let quantization = match root.opt_obj("quantization_config")? {
        Some(q) => parse_quantization(&q, &text)?,
        None => Quantization::None,
    };
    Ok(ModelConfig {
        family: Family(super::ID),
        source: root.file.to_path_buf(),
        architecture: architecture.to_string(),
        text_prefix: text_prefix.to_string(),
        text,
        vision,
        quantization,
        torch_dtype: root.opt_string("torch_dtype")?.map(str::to_string),
    })
}

fn parse_text(t: &Obj) -> Result<TextConfig, ConfigError> {
    let hidden_size = size(t, "hidden_size", bounds::WIDTH)?;
    let num_layers = size(t, "num_hidden_layers", bounds::LAYERS)?;
    let num_heads = size(t, "num_attention_heads", bounds::HEADS)?;
    let num_kv_heads = size(t, "num_key_value_heads", bounds::HEADS)?;
    check(num_heads % num_kv_heads == 0, t, "num_key_value_heads", &format!("a divisor of num_attention_heads = {num_heads}"))?;
    let head_dim = match opt_size(t, "head_dim", bounds::HEAD_DIM)? {
        Some(d) => d,
        None => {
            check(hidden_size % num_heads == 0, t, "num_attention_heads", "a divisor of hidden_size")?;
            hidden_size / num_heads
        }
    };
    check(head_dim > 0 && head_dim % 2 == 0, t, "head_dim", "a positive even number")?;
    let vocab_size = size(t, "vocab_size", bounds::VOCAB)?;

    t.one_of("hidden_act", &["swigluoai"])?;
    if t.has("scoring_func") {
        t.one_of("scoring_func", &["sigmoid"])?;
    } else {
        return Err(t.missing("scoring_func", "\"sigmoid\""));
    }
    if let Some(g) = t.opt_bool("use_gemma_norm")? {
        check(g, t, "use_gemma_norm", "true (m3c implements the Gemma (1 + w) RMSNorm)")?;
    }
    if let Some(q) = t.opt_bool("use_qk_norm")? {
        check(q, t, "use_qk_norm", "true")?;
    }
    if t.has("qk_norm_type") {
        t.one_of("qk_norm_type", &["per_head"])?;
    }
    if let Some(g) = t.opt_bool("attention_output_gate")? {
        check(!g, t, "attention_output_gate", "false (MiniMax-M3 has no output gate)")?;
    }
    if let Some(tie) = t.opt_bool("tie_word_embeddings")? {
        check(!tie, t, "tie_word_embeddings", "false (MiniMax-M3 ships a separate lm_head)")?;
    }

    let rotary_dim = rotary_dim(t, head_dim)?;

    let num_experts = size(t, "num_local_experts", bounds::EXPERTS)?;
    let experts_per_token = size(t, "num_experts_per_tok", bounds::EXPERTS_PER_TOKEN)?;
    check(experts_per_token <= num_experts, t, "num_experts_per_tok", &format!("at most num_local_experts = {num_experts}"))?;
    // Every expert of every layer is a tensor of its own: bound their count.
    check(
        num_experts * num_layers <= bounds::EXPERT_TENSORS,
        t,
        "num_local_experts",
        &format!("at most {} experts in all layers together (num_local_experts × num_hidden_layers)", bounds::EXPERT_TENSORS),
    )?;
    let expert_intermediate_size = size(t, "intermediate_size", bounds::INTERMEDIATE)?;
    let num_shared_experts = opt_size(t, "n_shared_experts", bounds::SHARED_EXPERTS)?.unwrap_or(0);
    let shared_intermediate_size = match opt_size(t, "shared_intermediate_size", bounds::INTERMEDIATE)? {
        Some(s) => s,
        None => {
            let s = expert_intermediate_size * num_shared_experts;
            check(
                s <= bounds::INTERMEDIATE,
                t,
                "n_shared_experts",
                &format!("few enough that n_shared_experts × intermediate_size ≤ {}", bounds::INTERMEDIATE),
            )?;
            s
        }
    };
    check(
        (num_shared_experts == 0) == (shared_intermediate_size == 0),
        t,
        "shared_intermediate_size",
        "a positive width when n_shared_experts > 0, else 0",
    )?;

    let moe = t.flags("moe_layer_freq", num_layers)?;
    let dense_intermediate_size = if moe.iter().any(|m| !m) {
        size(t, "dense_intermediate_size", bounds::INTERMEDIATE)?
    } else {
        opt_size(t, "dense_intermediate_size", bounds::INTERMEDIATE)?.unwrap_or(0)
    };

    let (sparse, sparse_flags) = match t.opt_obj("sparse_attention_config")? {
        Some(s) if s.opt_bool("use_sparse_attention")?.unwrap_or(true) => {
            let flags = s.flags("sparse_attention_freq", num_layers)?;
            let cfg = parse_sparse(&s, num_kv_heads, head_dim, num_layers, &flags)?;
            (Some(cfg), flags)
        }
        _ => (None, vec![false; num_layers]),
    };
    let layers = (0..num_layers)
        .map(|l| LayerKind {
            attention: if sparse_flags[l] { AttentionKind::Sparse } else { AttentionKind::Full },
            mlp: if moe[l] { MlpKind::Moe } else { MlpKind::Dense },
        })
        .collect();

    let rms_norm_eps = t.float("rms_norm_eps")?;
    check(rms_norm_eps > 0.0, t, "rms_norm_eps", "a positive number")?;
    let rope_theta = t.float("rope_theta")?;
    check(rope_theta > 1.0, t, "rope_theta", "a number > 1")?;
    let routed_scaling_factor = t.opt_float("routed_scaling_factor")?.unwrap_or(1.0);
    let use_routing_bias = t.opt_bool("use_routing_bias")?.unwrap_or(false);

    Ok(TextConfig {
        hidden_size,
        num_layers,
        num_heads,
        num_kv_heads,
        head_dim,
        vocab_size,
        max_position_embeddings: match t.opt_uint("max_position_embeddings")? {
            Some(n) => {
                check(
                    (2..=bounds::POSITIONS).contains(&n),
                    t,
                    "max_position_embeddings",
                    &format!("an integer from 2 (a prompt token and one generated) to {}", bounds::POSITIONS),
                )?;
                n
            }
            None => 4096,
        },
        rms_norm_eps,
        rope_theta,
        rotary_dim,
        swiglu_alpha: t.opt_float("swiglu_alpha")?.unwrap_or(1.702),
        swiglu_limit: t.opt_float("swiglu_limit")?.unwrap_or(7.0),
        // Absent from the published config.json; the reference hard-codes 1.0.
        swiglu_beta: t.opt_float("swiglu_beta")?.unwrap_or(1.0),
        dense_intermediate_size,
        moe: MoeConfig {
            expert_intermediate_size,
            shared_intermediate_size,
            num_experts,
            experts_per_token,
            num_shared_experts,
            use_routing_bias,
            routed_scaling_factor,
        },
        tie_word_embeddings: false,
        layers,
        sparse,
        bos_token_id: token_id(t, "bos_token_id", vocab_size)?,
        eos_token_id: token_id(t, "eos_token_id", vocab_size)?,
    })
}

/// An optional token id, which must lie in the vocabulary.
fn token_id(t: &Obj, key: &str, vocab: usize) -> Result<Option<usize>, ConfigError> {
    let id = t.opt_uint(key)?;
    if let Some(id) = id {
        check(id < vocab, t, key, &format!("a token id < vocab_size = {vocab}"))?;
    }
    Ok(id)
}

fn parse_sparse(
    s: &Obj,
    num_kv_heads: usize,
    head_dim: usize,
    num_layers: usize,
    sparse_flags: &[bool],
) -> Result<SparseConfig, ConfigError> {
    let num_index_heads = size(s, "sparse_num_index_heads", bounds::HEADS)?;
    check(
        num_index_heads == num_kv_heads,
        s,
        "sparse_num_index_heads",
        &format!("num_key_value_heads = {num_kv_heads} (one index head per KV group)"),
    )?;
    let index_dim = size(s, "sparse_index_dim", bounds::HEAD_DIM)?;
    check(index_dim == head_dim, s, "sparse_index_dim", &format!("head_dim = {head_dim} (the indexer reuses the main RoPE table)"))?;
    s.one_of("sparse_score_type", &["max"])?;
    let block_size = size(s, "sparse_block_size", bounds::BLOCK)?;
    let topk_blocks = size(s, "sparse_topk_blocks", bounds::BLOCKS)?;
    let local_blocks = opt_size(s, "sparse_local_block", bounds::BLOCKS)?.unwrap_or(1);
    let init_blocks = opt_size(s, "sparse_init_block", bounds::BLOCKS)?.unwrap_or(0);
    check(
        local_blocks.checked_add(init_blocks).is_some_and(|n| n <= topk_blocks),
        s,
        "sparse_local_block",
        &format!("sparse_local_block + sparse_init_block ≤ sparse_topk_blocks = {topk_blocks}"),
    )?;
    // m3c implements the selection-only indexer, which is what every sparse
    // layer of MiniMax-M3 uses (index value/output path disabled).
    if s.has("sparse_disable_index_value") {
        let disabled = s.flags("sparse_disable_index_value", num_layers)?;
        if let Some(l) = (0..num_layers).find(|&l| sparse_flags[l] && !disabled[l]) {
            return Err(ConfigError::Invalid {
                file: s.file.to_path_buf(),
                key: format!("{}[{l}]", s.key("sparse_disable_index_value")),
                expected: "1 on every sparse layer (m3c implements the selection-only indexer)".into(),
                found: "0".into(),
            });
        }
    }
    Ok(SparseConfig { num_index_heads, index_dim, block_size, topk_blocks, local_blocks, init_blocks })
}

fn parse_vision(root: &Obj, text: &TextConfig) -> Result<VisionConfig, ConfigError> {
    let v = root.obj("vision_config")?;
    let hidden_size = size(&v, "hidden_size", bounds::WIDTH)?;
    let num_heads = size(&v, "num_attention_heads", bounds::HEADS)?;
    check(hidden_size % num_heads == 0, &v, "num_attention_heads", &format!("a divisor of vision hidden_size = {hidden_size}"))?;
    v.one_of("hidden_act", &["gelu"])?;
    if root.has("projector_hidden_act") {
        root.one_of("projector_hidden_act", &["gelu"])?;
    }
    let (temporal_patch_size, spatial_merge_size) = match v.opt_obj("img_token_compression_config")? {
        Some(c) => {
            if c.has("image_token_compression_method") {
                c.one_of("image_token_compression_method", &["patch_merge"])?;
            }
            (size(&c, "temporal_patch_size", bounds::PATCH)?, size(&c, "spatial_merge_size", bounds::PATCH)?)
        }
        None => (2, 2),
    };
    let image_token_id = root.uint("image_token_index")?;
    let video_token_id = root.uint("video_token_index")?;
    for (key, id) in [("image_token_index", image_token_id), ("video_token_index", video_token_id)] {
        check(id < text.vocab_size, root, key, &format!("a token id < vocab_size = {}", text.vocab_size))?;
    }
    Ok(VisionConfig {
        hidden_size,
        num_heads,
        num_layers: size(&v, "num_hidden_layers", bounds::LAYERS)?,
        intermediate_size: size(&v, "intermediate_size", bounds::INTERMEDIATE)?,
        patch_size: size(&v, "patch_size", bounds::PATCH)?,
        num_channels: opt_size(&v, "num_channels", bounds::CHANNELS)?.unwrap_or(3),
        temporal_patch_size,
        spatial_merge_size,
        layer_norm_eps: v.opt_float("layer_norm_eps")?.unwrap_or(1e-5),
        rope_theta: v.opt_float("rope_theta")?.unwrap_or(10000.0),
        projector_hidden_size: size(root, "projector_hidden_size", bounds::INTERMEDIATE)?,
        projector_bias: root.opt_bool("multimodal_projector_bias")?.unwrap_or(true),
        image_token_id,
        video_token_id,
    })
}

fn parse_quantization(q: &Obj, text: &TextConfig) -> Result<Quantization, ConfigError> {
    q.one_of("quant_method", &["mxfp8"])?;
    let expected_block = "[1, 32] (MXFP8: one E8M0 scale per 1×32 block)";
    let block = match q.map.get("weight_block_size") {
        None => 32,
        Some(v) => match v.as_array().map(|a| a.iter().map(Value::as_u64).collect::<Vec<_>>()) {
            Some(a) if a == [Some(1), Some(32)] => 32,
            _ => return Err(q.invalid("weight_block_size", expected_block, v)),
        },
    };
    if q.has("activation_scheme") {
        q.one_of("activation_scheme", &["dynamic"])?;
    }
    // Every quantized linear's in-features must split into whole blocks.
    let ins = [
        ("hidden_size", text.hidden_size),
        ("num_attention_heads × head_dim (the attention output projection's input)", text.q_dim()),
        ("intermediate_size", text.moe.expert_intermediate_size),
        ("shared_intermediate_size", text.moe.shared_intermediate_size),
        ("dense_intermediate_size", text.dense_intermediate_size),
    ];
    for (what, n) in ins {
        if n % block != 0 {
            return Err(ConfigError::Invalid {
                file: q.file.to_path_buf(),
                key: q.key("weight_block_size"),
                expected: format!("a block that divides every quantized in-features; {what} = {n} is not a multiple of {block}"),
                found: short(q.map.get("weight_block_size").unwrap_or(&Value::Null)),
            });
        }
    }
    let ignored_layers = if q.has("ignored_layers") { q.string_list("ignored_layers")? } else { Vec::new() };
    Ok(Quantization::Mxfp8 { block, ignored_layers })
}

/// Partial RoPE: `partial_rotary_factor` is what the reference reads;
/// `rotary_dim`, when present, must agree with it.
fn rotary_dim(t: &Obj, head_dim: usize) -> Result<usize, ConfigError> {
    let from_factor = t.opt_float("partial_rotary_factor")?.map(|f| f * head_dim as f64);
    let rotary_dim = match (opt_size(t, "rotary_dim", bounds::HEAD_DIM)?, from_factor) {
        (Some(r), Some(f)) => {
            check((r as f64 - f).abs() < 1e-9, t, "rotary_dim", &format!("partial_rotary_factor × head_dim = {f}"))?;
            r
        }
        (Some(r), None) => r,
        (None, Some(f)) => {
            check(
                f.fract() == 0.0 && f > 0.0 && f <= head_dim as f64,
                t,
                "partial_rotary_factor",
                "a factor giving a whole number of channels",
            )?;
            f as usize
        }
        (None, None) => head_dim,
    };
    check(
        rotary_dim > 0 && rotary_dim % 2 == 0 && rotary_dim <= head_dim,
        t,
        if t.has("rotary_dim") { "rotary_dim" } else { "partial_rotary_factor" },
        &format!("an even number of channels ≤ head_dim = {head_dim}"),
    )?;

    Ok(rotary_dim)
}
