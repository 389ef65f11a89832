//! An EAGLE3 draft head in the cost model (`m3c plan --speculative-config`):
//! its weights and cache on the stage that runs it (the last), and the
//! target's aux hidden states each boundary must carry to it.
//!
//! The draft reads the residual stream entering target layers
//! `eagle_aux_hidden_state_layer_ids` (vLLM's meaning: id i is the input of
//! layer i, the output of layer i − 1, or the embedding for 0). A state is
//! made on the stage that holds layer i − 1 and must reach the draft's
//! stage: forwarded with the activations, it crosses every boundary in
//! between; sent straight there, it crosses once.

use super::format::Plan;
use crate::config::parse::{bounds, size};
use crate::config::{ConfigError, ModelConfig, Obj};
use std::path::{Path, PathBuf};

/// What the cost model needs of an EAGLE3 draft (`LlamaForCausalLMEagle3`).
#[derive(Debug, Clone, PartialEq)]
pub struct DraftHead {
    pub source: PathBuf,
    pub hidden: usize,
    pub intermediate: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub draft_vocab: usize,
    pub target_hidden: usize,
    pub aux_layers: Vec<usize>,
    /// Its own embedding (else the target's is shared).
    pub own_embedding: bool,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    /// The type its checkpoint stores (`torch_dtype`; bf16 when absent).
    pub dtype: m3c_contract::dtype::DType,
}

/// The architectures vLLM loads as an EAGLE3 Llama draft.
const ARCHITECTURES: &[&str] = &["LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM"];

impl DraftHead {
    /// Reads `DIR/config.json` of an EAGLE3 draft; every error names the key.
    pub fn load(dir: &Path) -> Result<DraftHead, ConfigError> {
        let file = dir.join("config.json");
        let text = m3c_contract::read_user_file(&file, "draft config", m3c_contract::input::limits::CONFIG)?;
        let value: serde_json::Value = serde_json::from_str(&text).map_err(|err| ConfigError::Json { file: file.clone(), err })?;
        let o = Obj::root(&file, &value)?;
        let arch = o.string_list("architectures")?;
        if !arch.iter().any(|a| ARCHITECTURES.contains(&a.as_str())) {
            return Err(ConfigError::Architecture {
                file,
                found: format!("{arch:?}"),
                expected: format!("{ARCHITECTURES:?} (an EAGLE3 draft head)"),
            });
        }
        let layers = size(&o, "num_hidden_layers", bounds::LAYERS)?;
        crate::config::parse::check(layers == 1, &o, "num_hidden_layers", "1 (an EAGLE3 draft head is one decoder layer)")?;
        let hidden = size(&o, "hidden_size", bounds::WIDTH)?;
        let heads = size(&o, "num_attention_heads", bounds::HEADS)?;
        let kv_heads = match o.has("num_key_value_heads") {
            true => size(&o, "num_key_value_heads", bounds::HEADS)?,
            false => heads,
        };
        let head_dim = match o.has("head_dim") {
            true => size(&o, "head_dim", bounds::HEAD_DIM)?,
            false => hidden / heads,
        };
        let vocab = size(&o, "vocab_size", bounds::VOCAB)?;
        let draft_vocab = match o.has("draft_vocab_size") {
            true => size(&o, "draft_vocab_size", bounds::VOCAB)?,
            false => vocab,
        };
        crate::config::parse::check(draft_vocab <= vocab, &o, "draft_vocab_size", "at most vocab_size")?;
        let target_hidden = match o.has("target_hidden_size") {
            true => size(&o, "target_hidden_size", bounds::WIDTH)?,
            false => hidden,
        };
        // vLLM reads the ids at the top level, or in `eagle_config`.
        let ids_in = if o.has("eagle_aux_hidden_state_layer_ids") { Some(o.clone()) } else { o.opt_obj("eagle_config")? };
        let aux_layers = match ids_in {
            Some(e) if e.has("eagle_aux_hidden_state_layer_ids") => aux_ids(&e)?,
            _ => Vec::new(),
        };
        // What the compiled head computes: SiLU, plain RoPE over the whole
        // head, no biases. Anything else would be drafted wrongly.
        if let Some(act) = o.opt_string("hidden_act")? {
            crate::config::parse::check(act == "silu", &o, "hidden_act", "\"silu\" (the EAGLE3 Llama head's MLP)")?;
        }
        for key in ["attention_bias", "mlp_bias"] {
            if o.has(key) {
                crate::config::parse::check(!o.boolean(key)?, &o, key, "false (the compiled head has no biases)")?;
            }
        }
        if o.map.get("rope_scaling").is_some_and(|v| !v.is_null()) {
            return Err(o.invalid("rope_scaling", "null (the compiled head applies plain RoPE)", &o.map["rope_scaling"]));
        }
        let dtype = match o.opt_string("torch_dtype")?.or(o.opt_string("dtype")?) {
            None | Some("bfloat16") => m3c_contract::dtype::DType::BF16,
            Some("float16") => m3c_contract::dtype::DType::F16,
            Some("float32") => m3c_contract::dtype::DType::F32,
            Some(_) => {
                let key = if o.has("torch_dtype") { "torch_dtype" } else { "dtype" };
                return Err(o.invalid(key, "bfloat16, float16 or float32", &o.map[key]));
            }
        };
        Ok(DraftHead {
            rms_norm_eps: o.opt_float("rms_norm_eps")?.unwrap_or(1e-6),
            rope_theta: o.opt_float("rope_theta")?.unwrap_or(10000.0),
            dtype,
            source: dir.to_path_buf(),
            hidden,
            intermediate: size(&o, "intermediate_size", bounds::INTERMEDIATE)?,
            heads,
            kv_heads,
            head_dim,
            vocab,
            draft_vocab,
            target_hidden,
            aux_layers,
            own_embedding: has_embedding(&dir.join("model.safetensors")),
        })
    }

    /// Checks the draft against its target; fills in vLLM's default aux
    /// layers `(2, L / 2, L − 3)` when the draft names none.
    pub fn for_target(mut self, cfg: &ModelConfig) -> Result<DraftHead, String> {
        let t = &cfg.text;
        let file = self.source.join("config.json");
        if self.aux_layers.is_empty() {
            self.aux_layers = vec![2.min(t.num_layers - 1), t.num_layers / 2, t.num_layers.saturating_sub(3)];
        }
        if self.target_hidden != t.hidden_size {
            return Err(format!(
                "{}: `target_hidden_size` (or `hidden_size`) is {}, but the target's hidden size is {}",
                file.display(),
                self.target_hidden,
                t.hidden_size
            ));
        }
        if self.hidden != t.hidden_size {
            return Err(format!(
                "{}: `hidden_size` is {}, but the target's is {}; m3c compiles EAGLE3 heads of the target's width (they read its embedding)",
                file.display(),
                self.hidden,
                t.hidden_size
            ));
        }
        if self.vocab != t.vocab_size {
            return Err(format!("{}: `vocab_size` is {}, but the target's is {}", file.display(), self.vocab, t.vocab_size));
        }
        if let Some(&bad) = self.aux_layers.iter().find(|&&i| i >= t.num_layers) {
            return Err(format!(
                "{}: `eagle_aux_hidden_state_layer_ids` holds {bad}, but the target has {} layers (an id is the input of that layer)",
                file.display(),
                t.num_layers
            ));
        }
        Ok(self)
    }

    /// Parameters of the draft (bf16 in its checkpoint), the shared
    /// embedding excluded unless it has its own.
    pub fn params(&self) -> usize {
        let (h, q, kv) = (self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim);
        let fc = h * self.aux_layers.len() * self.target_hidden;
        let attn = 2 * h * (q + 2 * kv) + q * h;
        let mlp = 3 * h * self.intermediate;
        let norms = 4 * h;
        let head = self.draft_vocab * h;
        let embed = if self.own_embedding { self.vocab * h } else { 0 };
        fc + attn + mlp + norms + head + embed
    }

    /// Cache bytes per position (K and V, `elem` bytes each).
    pub fn kv_bytes_per_position(&self, elem: usize) -> usize {
        2 * self.kv_heads * self.head_dim * elem
    }

    /// The stage that makes aux state `id` (the input of layer `id`).
    fn producer(plan: &Plan, id: usize) -> usize {
        let holds = |layer: usize| plan.stages.iter().position(|s| s.layers.is_some_and(|r| r.first <= layer && layer <= r.last));
        match id {
            0 => plan.stages.iter().position(|s| s.embedding).unwrap_or(0),
            i => holds(i - 1).unwrap_or(0),
        }
    }

    /// Per boundary k (stage k → k + 1): the aux states forwarded across it
    /// to the draft on the last stage, and those a direct send from their
    /// producer would put on it (the sender's own link), as counts of rows
    /// of the target's hidden width.
    pub fn boundary_states(&self, plan: &Plan) -> Vec<(usize, usize)> {
        let last = plan.stages.len() - 1;
        (0..last)
            .map(|k| {
                let made: Vec<usize> = self.aux_layers.iter().map(|&i| Self::producer(plan, i)).collect();
                (made.iter().filter(|&&s| s <= k).count(), made.iter().filter(|&&s| s == k).count())
            })
            .collect()
    }
}

/// `eagle_aux_hidden_state_layer_ids`: a list of layer indices.
fn aux_ids(o: &Obj) -> Result<Vec<usize>, ConfigError> {
    let key = "eagle_aux_hidden_state_layer_ids";
    let v = o.map.get(key).ok_or_else(|| o.missing(key, "a list of target layer indices"))?;
    let arr = v.as_array().ok_or_else(|| o.invalid(key, "a list of target layer indices", v))?;
    arr.iter()
        .map(|x| {
            x.as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .filter(|&n| n < bounds::LAYERS)
                .ok_or_else(|| o.invalid(key, "layer indices", v))
        })
        .collect()
}

/// Whether a draft checkpoint carries its own `embed_tokens.weight`.
fn has_embedding(file: &Path) -> bool {
    m3c_contract::checkpoint::read_header(file)
        .is_ok_and(|(_, t)| t.iter().any(|t| t.name.ends_with(crate::model::names::EAGLE3_OWN_EMBEDDING)))
}

/// The draft's lines under `m3c plan`'s table: its weights and cache on the
/// last stage (and whether they still fit there), and the aux states each
/// boundary carries for it, forwarded or sent straight, in bytes per row
/// of a step at `act_bytes` per activation (a verify step of K drafts has
/// K + 1 rows per sequence).
pub fn draft_section(
    cfg: &ModelConfig,
    plan: &Plan,
    draft: &DraftHead,
    tokens: usize,
    gpu: &super::GpuProfile,
    w: super::Workload,
    act_bytes: usize,
) -> String {
    use std::fmt::Write;
    let costs = super::stage_costs(cfg, plan, gpu, w);
    let last = plan.stages.len() - 1;
    let weights = draft.params() as f64 * 2.0;
    // A head that shares the target's embedding reads it on its own stage:
    // a copy there unless that stage holds the embedding already.
    let shared = if draft.own_embedding || plan.stages[last].embedding {
        0.0
    } else {
        let name = cfg.family.model().embedding(cfg);
        crate::model::expected_tensors(cfg).iter().find(|t| t.name == name).map_or(0.0, |t| t.nominal_bytes() as f64)
    };
    let kv = draft.kv_bytes_per_position(w.kv_cache.bytes());
    let memory = costs[last].memory + weights + shared + (kv * w.batch * w.context) as f64;
    let mut o = String::new();
    let _ = writeln!(
        o,
        "EAGLE3 draft {}: {} parameters ({} bf16{}), {} of cache per 1k positions, on stage {last} (the last): {} with it ({:.0}% of {}'s usable memory{})",
        draft.source.display(),
        scaled(draft.params() as f64, ""),
        scaled(weights, "B"),
        match (draft.own_embedding, shared > 0.0) {
            (true, _) => ", its own embedding".to_string(),
            (false, true) => format!("; the target's embedding, {} more there", scaled(shared, "B")),
            (false, false) => "; the embedding is the target's, on that stage already".to_string(),
        },
        scaled(kv as f64 * 1e3, "B"),
        scaled(memory, "B"),
        100.0 * memory / gpu.usable_memory(),
        gpu.name,
        if memory > gpu.usable_memory() { ": it does not fit" } else { "" }
    );
    let row = cfg.text.hidden_size * act_bytes;
    let _ = writeln!(
        o,
        "aux hidden states (the inputs of target layers {:?}), {row} B each per row; a verify step of K = {tokens} sends {} rows per sequence:",
        draft.aux_layers,
        tokens + 1
    );
    let _ = writeln!(o, "{:<9} {:>10} {:>12} {:>8} {:>12}", "boundary", "forwarded", "B/row", "direct", "B/row");
    let (mut fwd, mut direct) = (0, 0);
    for (k, (f, d)) in draft.boundary_states(plan).into_iter().enumerate() {
        let _ = writeln!(o, "{:<9} {:>10} {:>12} {:>8} {:>12}", format!("{k}->{}", k + 1), f, f * row, d, d * row);
        (fwd, direct) = (fwd + f * row, direct + d * row);
    }
    let _ = writeln!(
        o,
        "in all: {fwd} B per row forwarded with the activations, {direct} B per row sent straight to the draft's stage (each state once)"
    );
    o
}

/// `v` with a decimal prefix (k, M, G) and `unit`, three significant places.
fn scaled(v: f64, unit: &str) -> String {
    let (x, p) = match v {
        v if v >= 1e9 => (v / 1e9, "G"),
        v if v >= 1e6 => (v / 1e6, "M"),
        v if v >= 1e3 => (v / 1e3, "k"),
        v => (v, ""),
    };
    format!("{x:.3} {p}{unit}").trim_end().to_string()
}
