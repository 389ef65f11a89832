//! `m3c init-tiny`: a random MiniMax-M3 checkpoint in the hub layout
//! (config.json + model.safetensors) with every structural feature of the real
//! model — full and MSA attention, dense and MoE layers, shared expert,
//! routing bias, partial RoPE, the vision tower — small enough for tests and
//! the demo. The same options give byte-identical files.

pub mod encode;
mod rng;

use crate::config::parse_config;
use crate::dtype::DType;
use crate::fsutil::write_dir_atomically;
use crate::model::names::{self, TextNames};
use crate::model::{expected_tensors, Role, TensorSpec, TypeRule};
use anyhow::{bail, Context, Result};
use rng::Rng;
use serde_json::json;
use std::borrow::Cow;
use std::path::Path;

/// The shape of a tiny model. Defaults mirror the golden fixtures.
#[derive(Debug, Clone, PartialEq)]
pub struct TinySpec {
    pub seed: u64,
    pub layers: usize,
    pub hidden: usize,
    pub mxfp8: bool,
    pub vision: TinyVision,
}

/// The vision tower's widths (MiniMax-M3's: hidden 1280, 16 heads, MLP
/// 5120, 32 layers, projector 6144).
#[derive(Debug, Clone, PartialEq)]
pub struct TinyVision {
    pub hidden: usize,
    pub heads: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub projector: usize,
}

impl Default for TinyVision {
    fn default() -> Self {
        TinyVision { hidden: 64, heads: 4, intermediate: 128, layers: 2, projector: 96 }
    }
}

impl Default for TinySpec {
    fn default() -> Self {
        TinySpec { seed: 0, layers: 8, hidden: 128, mxfp8: false, vision: TinyVision::default() }
    }
}

const HEAD_DIM: usize = 32;
/// The largest checkpoint init-tiny builds (in memory, then written).
const MAX_BYTES: u64 = 4_000_000_000;

impl TinySpec {
    fn check(&self) -> Result<()> {
        if self.layers == 0 || self.layers > 256 {
            bail!("--layers must be from 1 to 256 (found {})", self.layers);
        }
        if self.hidden > 16384 {
            bail!("--hidden must be at most 16384 (found {}): init-tiny makes small test models", self.hidden);
        }
        if self.hidden < 128 || !self.hidden.is_multiple_of(128) {
            bail!("--hidden must be a positive multiple of 128 (found {}): heads are {HEAD_DIM} wide and come in groups of 4", self.hidden);
        }
        let v = &self.vision;
        for (flag, n) in [("--vision-hidden", v.hidden), ("--vision-mlp", v.intermediate), ("--projector-hidden", v.projector)] {
            if n == 0 || n > 16384 {
                bail!("{flag} must be from 1 to 16384 (found {n})");
            }
        }
        if v.layers == 0 || v.layers > 64 {
            bail!("--vision-layers must be from 1 to 64 (found {})", v.layers);
        }
        if v.heads == 0 || !v.hidden.is_multiple_of(v.heads) || v.hidden / v.heads < 6 || !(v.hidden / v.heads).is_multiple_of(8) {
            bail!(
                "--vision-heads {} must divide --vision-hidden {} into heads of at least 6 channels, a multiple of 8 (3-D RoPE takes a third of each)",
                v.heads,
                v.hidden
            );
        }
        Ok(())
    }

    /// The hub-style config.json of this model.
    pub fn config_json(&self) -> serde_json::Value {
        let l = self.layers;
        let h = self.hidden;
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
                "model_type": "clip_vision_model", "hidden_size": self.vision.hidden, "num_attention_heads": self.vision.heads,
                "num_hidden_layers": self.vision.layers, "intermediate_size": self.vision.intermediate, "patch_size": 14, "image_size": 56,
                "num_channels": 3, "hidden_act": "gelu", "layer_norm_eps": 1e-5, "rope_theta": 10000.0,
                "rope_mode": "3d",
                "img_token_compression_config": {
                    "image_token_compression_method": "patch_merge", "spatial_merge_size": 2, "temporal_patch_size": 2
                },
                "vision_segment_max_frames": 4
            },
            "image_token_index": 500, "video_token_index": 501, "projector_hidden_size": self.vision.projector,
            "projector_hidden_act": "gelu", "multimodal_projector_bias": true,
            "vision_feature_layer": -1, "vision_feature_select_strategy": "full",
            "tie_word_embeddings": false, "torch_dtype": "bfloat16",
            "m3c_init_tiny": { "seed": self.seed }
        });
        if self.mxfp8 {
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
}

/// A tensor ready to be written.
struct Owned {
    name: String,
    dtype: DType,
    shape: Vec<usize>,
    data: Vec<u8>,
}

impl safetensors::View for &Owned {
    fn dtype(&self) -> safetensors::Dtype {
        crate::dtype::to_safetensors(self.dtype)
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

/// The standard deviation (or uniform half-width for norms) of a tensor's
/// random values: large enough that the clamps, the routing bias and the
/// block selection all matter.
fn values(rng: &mut Rng, spec: &TensorSpec) -> Vec<f32> {
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

fn encode(spec: &TensorSpec, v: &[f32]) -> (DType, Vec<u8>) {
    match spec.nominal {
        DType::F32 => (DType::F32, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
        _ => (DType::BF16, v.iter().flat_map(|x| encode::bf16_bits(*x).to_le_bytes()).collect()),
    }
}

/// Generates the checkpoint's tensors.
fn tensors(spec: &TinySpec, cfg: &crate::config::ModelConfig) -> Vec<Owned> {
    let mut rng = Rng::new(spec.seed);
    let mut out = Vec::new();
    for t in expected_tensors(cfg) {
        match t.rule {
            // Scales are written together with their weight.
            TypeRule::E8M0 => continue,
            TypeRule::Fp8 => {
                let v = values(&mut rng, &t);
                let inp = t.shape[1];
                let (q, s) = encode::mxfp8_quantize(&v, inp, 32);
                out.push(Owned { name: t.name.clone(), dtype: DType::F8E4M3, shape: t.shape.clone(), data: q });
                out.push(Owned {
                    name: names::scales(names::without_weight(&t.name)),
                    dtype: DType::U8,
                    shape: vec![t.shape[0], inp / 32],
                    data: s,
                });
            }
            TypeRule::Float => {
                let v = values(&mut rng, &t);
                let (dtype, data) = encode(&t, &v);
                out.push(Owned { name: t.name.clone(), dtype, shape: t.shape.clone(), data });
            }
        }
    }
    out
}

/// A small byte-level BPE (512 ids) with MiniMax-M3's special-token names
/// and a chat template of the real one's structure: the tokenizer of the
/// test fixture (`tests/fixtures/tiny-m3`, from the reference), so a tiny
/// checkpoint takes `--prompt` and `--chat` like a real one.
pub const TOKENIZER_FILES: [(&str, &[u8]); 2] = [
    ("tokenizer.json", include_bytes!("../../data/tiny-tokenizer/tokenizer.json")),
    ("tokenizer_config.json", include_bytes!("../../data/tiny-tokenizer/tokenizer_config.json")),
];

/// Writes the tiny checkpoint into the new folder `out`.
pub fn init_tiny(out: &Path, spec: &TinySpec) -> Result<()> {
    spec.check()?;
    let json = spec.config_json();
    let text = serde_json::to_string_pretty(&json)? + "\n";
    let cfg = parse_config(&out.join("config.json"), &text).context("internal: the generated config does not validate")?;
    // Checked before allocating: the tensors are built in memory, then encoded.
    let bytes: u64 = crate::model::expected_tensors(&cfg).iter().map(|t| t.nominal_bytes()).sum();
    if bytes > MAX_BYTES {
        bail!(
            "--hidden {} --layers {} would make a {:.1} GB checkpoint; init-tiny writes at most {:.0} GB (fewer layers or a smaller hidden size)",
            spec.hidden,
            spec.layers,
            bytes as f64 / 1e9,
            MAX_BYTES as f64 / 1e9
        );
    }
    let tensors = tensors(spec, &cfg);
    write_dir_atomically(
        out,
        |o| anyhow::bail!("{}: already exists and is not empty (choose a new folder, or remove it first)", o.display()),
        |tmp| {
            std::fs::write(tmp.join("config.json"), &text)?;
            let views: Vec<(&str, &Owned)> = tensors.iter().map(|t| (t.name.as_str(), t)).collect();
            let mut meta = std::collections::HashMap::new();
            meta.insert("format".to_string(), "pt".to_string());
            let bytes = safetensors::serialize(views, Some(meta)).context("cannot encode model.safetensors")?;
            std::fs::write(tmp.join("model.safetensors"), bytes)?;
            for (name, data) in TOKENIZER_FILES {
                std::fs::write(tmp.join(name), data)?;
            }
            Ok(())
        },
    )
}
