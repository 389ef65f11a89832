//! MiniMax-M3 (MiniMaxAI's sparse-attention MoE vision-language model): the
//! family the compiler was built for, and the reference for the seam.

mod config;
mod graph;
mod names;
mod tensors;
mod tiny;

use super::ModelFamily;
use crate::config::{ConfigError, ModelConfig, Obj};
use crate::family::{Rng, TinySpec};
use crate::graph::ModelGraph;
use crate::model::TensorSpec;

pub(super) struct MiniMaxM3;

/// The family's id.
const ID: &str = "minimax_m3";

impl ModelFamily for MiniMaxM3 {
    fn id(&self) -> &'static str {
        ID
    }

    fn name(&self) -> &'static str {
        "MiniMax-M3"
    }

    fn architectures(&self) -> &'static [&'static str] {
        config::ARCHITECTURES
    }

    fn parse_config(&self, root: &Obj, architecture: &str) -> Result<ModelConfig, ConfigError> {
        config::parse(root, architecture)
    }

    fn tensors(&self, cfg: &ModelConfig) -> Vec<TensorSpec> {
        tensors::tensors(cfg)
    }

    fn graph(&self, cfg: &ModelConfig) -> ModelGraph {
        graph::graph(cfg)
    }

    fn embedding(&self, cfg: &ModelConfig) -> String {
        names::TextNames::new(&cfg.text_prefix).embedding()
    }

    fn stored_prefix(&self, cfg: &ModelConfig, has: &dyn Fn(&str) -> bool) -> &'static str {
        let vl = names::VL_TEXT_PREFIX;
        if cfg.text_prefix.is_empty() && has(&names::TextNames::new(vl).embedding()) {
            vl
        } else {
            ""
        }
    }

    fn vision_layer_of(&self, name: &str) -> Option<usize> {
        names::vision::layer_of(name)
    }

    fn tiny_config(&self, spec: &TinySpec) -> serde_json::Value {
        tiny::config(spec)
    }

    fn tiny_values(&self, rng: &mut Rng, spec: &TensorSpec) -> Vec<f32> {
        tiny::values(rng, spec)
    }

    fn tiny_tokenizer(&self) -> &'static [(&'static str, &'static [u8])] {
        tiny::TOKENIZER_FILES
    }
}
