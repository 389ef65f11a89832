//! `m3c init-tiny`: a random checkpoint of a model family in the hub layout
//! (config.json + model.safetensors), small enough for tests and the demo.
//! The family gives the config (for MiniMax-M3 every structural feature of
//! the real model: full and MSA attention, dense and MoE layers, shared
//! expert, routing bias, partial RoPE, the vision tower) and the scale of
//! each tensor's values; this module draws, encodes and writes them. The
//! same options give byte-identical files.

pub mod encode;
pub use crate::family::{Rng, TinySpec, TinyVision, HEAD_DIM};

use crate::dtype::DType;
use crate::family::parse_config;
use crate::fsutil::write_dir_atomically;
use crate::model::names;
use crate::model::{expected_tensors, TensorSpec, TypeRule};
use anyhow::{bail, Context, Result};
use std::borrow::Cow;
use std::path::Path;

/// The largest checkpoint init-tiny builds (in memory, then written).
const MAX_BYTES: u64 = 4_000_000_000;

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

fn encode(spec: &TensorSpec, v: &[f32]) -> (DType, Vec<u8>) {
    match spec.nominal {
        DType::F32 => (DType::F32, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
        _ => (DType::BF16, v.iter().flat_map(|x| encode::bf16_bits(*x).to_le_bytes()).collect()),
    }
}

/// Generates the checkpoint's tensors.
fn tensors(spec: &TinySpec, cfg: &crate::config::ModelConfig) -> Vec<Owned> {
    let family = cfg.family.model();
    let mut rng = Rng::new(spec.seed);
    let mut out = Vec::new();
    for t in expected_tensors(cfg) {
        match t.rule {
            // Scales are written together with their weight.
            TypeRule::E8M0 => continue,
            TypeRule::Fp8 => {
                let v = family.tiny_values(&mut rng, &t);
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
                let v = family.tiny_values(&mut rng, &t);
                let (dtype, data) = encode(&t, &v);
                out.push(Owned { name: t.name.clone(), dtype, shape: t.shape.clone(), data });
            }
        }
    }
    out
}

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
            for (name, data) in cfg.family.model().tiny_tokenizer() {
                std::fs::write(tmp.join(name), data)?;
            }
            Ok(())
        },
    )
}
