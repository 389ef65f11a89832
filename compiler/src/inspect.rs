//! `m3c inspect`: what a config (and its checkpoint, when present) holds.

use crate::config::ModelConfig;
use crate::dtype::DType;
use crate::model::{expected_tensors, Part, Role, TensorSpec};
use crate::units::{bytes, grouped};
use crate::weights::{bind, Checkpoint};
use std::collections::BTreeMap;
use std::fmt::Write;

/// Parameter and byte counts of a model, from its config.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelStats {
    pub total_params: u64,
    pub text_params: u64,
    pub vision_params: u64,
    /// Parameters one text token touches: everything of the text model except
    /// the routed experts it is not routed to (embedding and lm_head included).
    pub active_params: u64,
    /// Bytes by element type, in the published checkpoint's types.
    pub bytes_by_dtype: BTreeMap<DType, u64>,
    /// Weight bytes of each part.
    pub part_bytes: BTreeMap<Part, u64>,
    pub part_params: BTreeMap<Part, u64>,
}

pub fn model_stats(cfg: &ModelConfig) -> ModelStats {
    stats_of(cfg, &expected_tensors(cfg))
}

fn stats_of(cfg: &ModelConfig, specs: &[TensorSpec]) -> ModelStats {
    let t = &cfg.text;
    let mut s = ModelStats {
        total_params: 0,
        text_params: 0,
        vision_params: 0,
        active_params: 0,
        bytes_by_dtype: BTreeMap::new(),
        part_bytes: BTreeMap::new(),
        part_params: BTreeMap::new(),
    };
    let mut expert_params = 0u64;
    for spec in specs {
        *s.bytes_by_dtype.entry(spec.nominal).or_insert(0) += spec.nominal_bytes();
        *s.part_bytes.entry(spec.part).or_insert(0) += spec.nominal_bytes();
        if !spec.is_parameter() {
            continue;
        }
        let n = spec.numel();
        s.total_params += n;
        *s.part_params.entry(spec.part).or_insert(0) += n;
        if spec.part == Part::Vision {
            s.vision_params += n;
        } else {
            s.text_params += n;
            if matches!(spec.role, Role::Expert(_)) {
                expert_params += n;
            }
        }
    }
    // Each token runs top-k of the routed experts; they all have the same size.
    let routed_active = (expert_params as u128 * t.moe.experts_per_token as u128 / t.moe.num_experts as u128) as u64;
    s.active_params = s.text_params - expert_params + routed_active;
    s
}

/// The `m3c inspect` report. With a checkpoint, its tensors are bound and
/// bytes by dtype are read from the files instead of predicted.
pub fn report(cfg: &ModelConfig, checkpoint: Option<&Checkpoint>) -> Result<String, crate::weights::BindReport> {
    let t = &cfg.text;
    let stats = model_stats(cfg);
    let mut o = String::new();
    let quant = if cfg.is_mxfp8() { "MXFP8 linears" } else { "unquantized" };
    let _ = writeln!(o, "model       {} ({}, {quant})", cfg.source.display(), cfg.architecture);
    let _ = writeln!(
        o,
        "text        hidden {}, {} heads / {} KV heads × {}, vocab {}, {} experts top-{} + {} shared",
        t.hidden_size,
        t.num_heads,
        t.num_kv_heads,
        t.head_dim,
        t.vocab_size,
        t.moe.num_experts,
        t.moe.experts_per_token,
        t.moe.num_shared_experts
    );
    if let Some(v) = &cfg.vision {
        let _ = writeln!(
            o,
            "vision      {} layers, hidden {}, patch {} (tower present in checkpoint layout)",
            v.num_layers, v.hidden_size, v.patch_size
        );
    }

    let _ = writeln!(o, "\nlayers by kind ({} layers)", t.num_layers);
    let mut l = 0;
    while l < t.layers.len() {
        let mut end = l;
        while end + 1 < t.layers.len() && t.layers[end + 1] == t.layers[l] {
            end += 1;
        }
        let range = if end == l { format!("{l}") } else { format!("{l}-{end}") };
        let n = end - l + 1;
        let _ = writeln!(o, "  {range:<8} {:<28} ({n} layer{})", t.layers[l].label(), if n == 1 { "" } else { "s" });
        l = end + 1;
    }

    let _ = writeln!(o, "\nparameters");
    let _ = writeln!(o, "  total              {:>20}", grouped(stats.total_params));
    let _ = writeln!(o, "  text               {:>20}", grouped(stats.text_params));
    let _ = writeln!(o, "  vision + projector {:>20}", grouped(stats.vision_params));
    let _ = writeln!(
        o,
        "  active per token   {:>20}  (top-{} of {} experts; embedding and lm_head included)",
        grouped(stats.active_params),
        t.moe.experts_per_token,
        t.moe.num_experts
    );

    let (by_dtype, what) = match checkpoint {
        Some(ck) => {
            bind(cfg, ck, None)?;
            (ck.bytes_by_dtype(), format!("read from {} shard(s), all {} tensors bound", ck.shards.len(), ck.tensors.len()))
        }
        None => (stats.bytes_by_dtype.clone(), "predicted from the config".to_string()),
    };
    let _ = writeln!(o, "\nbytes by dtype ({what})");
    let mut total = 0;
    for (d, b) in &by_dtype {
        total += b;
        let _ = writeln!(o, "  {:<8} {:>22} B  {:>12}", d.to_string(), grouped(*b), bytes(*b));
    }
    let _ = writeln!(o, "  {:<8} {:>22} B  {:>12}", "total", grouped(total), bytes(total));

    let _ = writeln!(o, "\nweight bytes per part (runs of identical layers on one row, figures per layer)");
    let _ = writeln!(o, "  {:<14} {:<28} {:>16} {:>12}", "part", "kind", "params", "bytes");
    let rows: Vec<(String, String, u64, u64)> = stats
        .part_bytes
        .iter()
        .map(|(part, b)| {
            let (name, kind) = match part {
                Part::Embedding => ("embedding".to_string(), String::new()),
                Part::Layer(l) => (l.to_string(), t.layers[*l].label().to_string()),
                Part::FinalNorm => ("norm".to_string(), String::new()),
                Part::LmHead => ("lm_head".to_string(), String::new()),
                Part::Vision => ("vision".to_string(), "tower + projector + merger".to_string()),
                Part::Draft => ("draft".to_string(), "EAGLE3 draft head".to_string()),
            };
            (name, kind, stats.part_params[part], *b)
        })
        .collect();
    let mut i = 0;
    while i < rows.len() {
        let mut j = i;
        let is_layer = rows[i].0.parse::<usize>().is_ok();
        while is_layer
            && j + 1 < rows.len()
            && rows[j + 1].0.parse::<usize>().is_ok()
            && rows[j + 1].1 == rows[i].1
            && rows[j + 1].3 == rows[i].3
        {
            j += 1;
        }
        let name = match (is_layer, i == j) {
            (false, _) => rows[i].0.clone(),
            (true, true) => format!("layer {}", rows[i].0),
            (true, false) => format!("layers {}-{}", rows[i].0, rows[j].0),
        };
        let _ = writeln!(o, "  {name:<14} {:<28} {:>16} {:>12}", rows[i].1, grouped(rows[i].2), bytes(rows[i].3));
        i = j + 1;
    }
    Ok(o)
}

/// Non-finite values found in one tensor by `m3c inspect --check-values`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadValues {
    pub tensor: String,
    pub file: std::path::PathBuf,
    pub nan: u64,
    pub inf: u64,
    /// Element index of the first one.
    pub first: u64,
}

/// Counts NaN and ±Inf in every floating tensor of the checkpoint (fp8
/// E4M3 has NaN only; an E8M0 scale of 0xFF is NaN). Tensors in name order.
pub fn check_values(ck: &Checkpoint) -> Vec<BadValues> {
    let mut out = Vec::new();
    for e in ck.tensors.values() {
        let bytes = ck.bytes(e);
        let (mut nan, mut inf, mut first) = (0u64, 0u64, None);
        let mut see = |i: usize, is_nan: bool, is_inf: bool| {
            if is_nan || is_inf {
                nan += is_nan as u64;
                inf += is_inf as u64;
                first.get_or_insert(i as u64);
            }
        };
        match e.dtype {
            DType::F32 => bytes.chunks_exact(4).enumerate().for_each(|(i, c)| {
                let v = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                see(i, v.is_nan(), v.is_infinite())
            }),
            DType::BF16 | DType::F16 => {
                // Exponent all ones: Inf (zero mantissa) or NaN.
                let (exp, man) = if e.dtype == DType::BF16 { (0x7F80u16, 0x007Fu16) } else { (0x7C00, 0x03FF) };
                bytes.chunks_exact(2).enumerate().for_each(|(i, c)| {
                    let b = u16::from_le_bytes([c[0], c[1]]);
                    let all = b & exp == exp;
                    see(i, all && b & man != 0, all && b & man == 0)
                })
            }
            DType::F8E4M3 => bytes.iter().enumerate().for_each(|(i, &b)| see(i, b & 0x7F == 0x7F, false)),
            DType::U8 if crate::model::names::is_scales(&e.name) => bytes.iter().enumerate().for_each(|(i, &b)| see(i, b == 0xFF, false)),
            DType::F64 => bytes.chunks_exact(8).enumerate().for_each(|(i, c)| {
                let v = f64::from_le_bytes(c.try_into().unwrap_or([0; 8]));
                see(i, v.is_nan(), v.is_infinite())
            }),
            _ => {}
        }
        if let Some(first) = first {
            out.push(BadValues { tensor: e.name.clone(), file: ck.file_of(e).to_path_buf(), nan, inf, first });
        }
    }
    out
}
