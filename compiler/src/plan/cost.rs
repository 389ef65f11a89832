//! Per-part cost model for one decode step: weight bytes, cache bytes per
//! token, FLOPs and bytes read at batch B and context T, turned into time with
//! a roofline of the chosen GPU.

use crate::config::{AttentionKind, ModelConfig};
use crate::model::{expected_tensors, Part, Role};
use std::collections::BTreeMap;

/// A GPU as the planner sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuProfile {
    pub name: String,
    /// Memory in bytes.
    pub memory: f64,
    /// HBM bandwidth in bytes/s.
    pub bandwidth: f64,
    /// Dense bf16 tensor throughput in FLOP/s.
    pub flops: f64,
}

/// Known GPUs: (name, memory GB, bandwidth TB/s, dense bf16 TFLOP/s).
const PROFILES: &[(&str, f64, f64, f64)] = &[
    ("H200", 141.0, 4.8, 990.0),
    ("H100", 80.0, 3.35, 990.0),
    ("H20", 96.0, 4.0, 148.0),
    ("B200", 180.0, 8.0, 2250.0),
    ("A100", 80.0, 2.039, 312.0),
    ("L40S", 48.0, 0.864, 362.0),
    ("MI300X", 192.0, 5.3, 1307.0),
    ("MI325X", 256.0, 6.0, 1307.0),
    ("MI355X", 288.0, 8.0, 2300.0),
];

/// Share of GPU memory the planner fills with weights and caches; the rest is
/// kept for activations, workspace and the CUDA context.
pub const USABLE_MEMORY: f64 = 0.92;

impl GpuProfile {
    pub fn named(name: &str) -> Option<GpuProfile> {
        PROFILES.iter().find(|p| p.0.eq_ignore_ascii_case(name)).map(|&(n, m, bw, f)| GpuProfile {
            name: n.to_string(),
            memory: m * 1e9,
            bandwidth: bw * 1e12,
            flops: f * 1e12,
        })
    }
    /// The profile a plan for `target` (`host`, `cuda`, `rocm`) is sized
    /// for unless told otherwise: the target's flagship GPU.
    pub fn default_name(target: &str) -> &'static str {
        if target == "rocm" {
            "MI300X"
        } else {
            "H200"
        }
    }
    pub fn known_names() -> Vec<&'static str> {
        PROFILES.iter().map(|p| p.0).collect()
    }
    pub fn usable_memory(&self) -> f64 {
        self.memory * USABLE_MEMORY
    }
}

/// What the step is sized for.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Workload {
    /// Sequences decoded together.
    pub batch: usize,
    /// Context length each of them has reached.
    pub context: usize,
    /// How the stages store K, V and MSA index keys (`m3c compile --kv-cache`).
    pub kv_cache: m3c_kernels::Storage,
}

/// The cost of one part of the model for one decode step.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PartCost {
    /// Resident weight bytes (MXFP8 scales included).
    pub weight_bytes: f64,
    /// KV (and MSA index-key) cache bytes per token of context.
    pub cache_bytes_per_token: f64,
    /// Bytes read from memory in one decode step.
    pub step_bytes: f64,
    pub step_flops: f64,
}

impl PartCost {
    /// Roofline time of one step on `gpu`.
    pub fn time(&self, gpu: &GpuProfile) -> f64 {
        (self.step_bytes / gpu.bandwidth).max(self.step_flops / gpu.flops)
    }
    /// Memory this part needs at the workload: weights plus its caches.
    pub fn memory(&self, w: Workload) -> f64 {
        self.weight_bytes + self.cache_bytes_per_token * (w.batch * w.context) as f64
    }
    pub fn add(&mut self, o: &PartCost) {
        self.weight_bytes += o.weight_bytes;
        self.cache_bytes_per_token += o.cache_bytes_per_token;
        self.step_bytes += o.step_bytes;
        self.step_flops += o.step_flops;
    }
}

/// Expected number of distinct experts that `batch` tokens touch when each
/// picks `k` of `e` experts (uniform routing).
pub fn expected_experts(e: usize, k: usize, batch: usize) -> f64 {
    let miss = 1.0 - k as f64 / e as f64;
    e as f64 * (1.0 - miss.powi(batch as i32))
}

/// Costs of every part of the text model, in pipeline order (embedding, layers, final norm, lm_head).
pub fn part_costs(cfg: &ModelConfig, w: Workload) -> BTreeMap<Part, PartCost> {
    let t = &cfg.text;
    let b = w.batch as f64;
    let ctx = w.context as f64;
    let mut costs: BTreeMap<Part, PartCost> = BTreeMap::new();
    let mut expert_bytes: BTreeMap<Part, f64> = BTreeMap::new();
    let mut expert_params: BTreeMap<Part, f64> = BTreeMap::new();
    for spec in expected_tensors(cfg) {
        let c = costs.entry(spec.part).or_default();
        let bytes = spec.nominal_bytes() as f64;
        if spec.part == Part::Vision {
            // Held with the embedding; it runs once per image at prefill, not per decode step.
            c.weight_bytes += bytes;
            continue;
        }
        c.weight_bytes += bytes;
        let params = if spec.is_parameter() { spec.numel() as f64 } else { 0.0 };
        match (spec.part, spec.role) {
            (_, Role::Expert(_)) => {
                *expert_bytes.entry(spec.part).or_default() += bytes;
                *expert_params.entry(spec.part).or_default() += params;
            }
            (Part::Embedding, _) => {
                // A step gathers B rows of the table.
                c.step_bytes += b * (t.hidden_size * spec.nominal.size_bytes()) as f64;
            }
            _ => {
                c.step_bytes += bytes;
                c.step_flops += 2.0 * b * params;
            }
        }
    }
    let touched = expected_experts(t.moe.num_experts, t.moe.experts_per_token, w.batch);
    for (part, bytes) in &expert_bytes {
        let c = costs.get_mut(part).expect("expert part has a cost");
        let per_expert = bytes / t.moe.num_experts as f64;
        c.step_bytes += touched * per_expert;
        let per_expert_params = expert_params[part] / t.moe.num_experts as f64;
        c.step_flops += 2.0 * b * t.moe.experts_per_token as f64 * per_expert_params;
    }
    for (l, kind) in t.layers.iter().enumerate() {
        let c = costs.get_mut(&Part::Layer(l)).expect("every layer has weights");
        let kv = (2 * t.num_kv_heads * t.head_dim * w.kv_cache.bytes()) as f64;
        c.cache_bytes_per_token += kv;
        // Keys each query attends to, and the indexer scan on sparse layers.
        let attended = match (kind.attention, &t.sparse) {
            (AttentionKind::Sparse, Some(s)) => {
                let ik = (s.index_dim * w.kv_cache.bytes()) as f64;
                c.cache_bytes_per_token += ik;
                c.step_bytes += b * ctx * ik;
                c.step_flops += 2.0 * b * ctx * (s.num_index_heads * s.index_dim) as f64;
                ctx.min((s.topk_blocks * s.block_size) as f64)
            }
            _ => ctx,
        };
        c.step_bytes += b * attended * kv;
        c.step_flops += 4.0 * b * attended * (t.num_heads * t.head_dim) as f64;
    }
    costs
}

/// Patch rows of a 672×672 image, the reference processor's largest
/// (48 × 48 patches of 14 pixels; 576 image tokens after the 2×2 merge).
pub const IMAGE_672_PATCHES: usize = 48 * 48;

/// FLOPs of encoding `patches` patch rows of one image through the vision
/// tower, projector and patch merge (the stage that holds the tower runs
/// them once per image, beside its steps): the patch embedding, per layer
/// the attention's four projections, its scores and weighted sums over the
/// image's own rows, and the MLP; then the projector on every row and the
/// merge on every fourth.
pub fn vision_encode_flops(cfg: &ModelConfig, patches: usize) -> Option<f64> {
    let v = cfg.vision.as_ref()?;
    let (p, h, m, big) = (patches as f64, v.hidden_size as f64, v.intermediate_size as f64, v.projector_hidden_size as f64);
    let row = (v.num_channels * v.temporal_patch_size * v.patch_size * v.patch_size) as f64;
    let merge = (v.spatial_merge_size * v.spatial_merge_size) as f64;
    let embed = 2.0 * p * row * h;
    let layer = 2.0 * p * (4.0 * h * h + 2.0 * h * m) + 4.0 * p * p * h;
    let projector = 2.0 * p * (h * big + big * big) + 2.0 * (p / merge) * (merge * big * big + big * big);
    Some(embed + v.num_layers as f64 * layer + projector)
}
