//! The helpers every family's graph builder uses: nodes with typed operands,
//! tagged with the part of the model they belong to.

use super::ops::*;
use super::{ModelGraph, Operand};
use crate::config::{ModelConfig, Quantization};
use crate::model::names;
use crate::model::Part;
use petgraph::graph::{DiGraph, NodeIndex};

pub(crate) struct GraphBuilder<'a> {
    pub cfg: &'a ModelConfig,
    pub g: DiGraph<Node, Operand>,
    /// The part that new nodes belong to.
    pub part: Part,
}

pub(crate) fn ty(shape: &[Dim], elem: Elem) -> TensorType {
    TensorType { shape: shape.to_vec(), elem }
}

/// The graph of `cfg`, built by its family.
pub fn build_graph(cfg: &ModelConfig) -> ModelGraph {
    cfg.family.model().graph(cfg)
}

impl<'a> GraphBuilder<'a> {
    pub fn new(cfg: &'a ModelConfig) -> Self {
        GraphBuilder { cfg, g: DiGraph::new(), part: Part::Embedding }
    }

    pub fn finish(self, logits: NodeIndex) -> ModelGraph {
        ModelGraph { graph: self.g, logits }
    }

    pub fn node(&mut self, op: Op, ty: TensorType, operands: &[NodeIndex]) -> NodeIndex {
        let n = self.g.add_node(Node { op, ty, part: self.part });
        for (i, &src) in operands.iter().enumerate() {
            self.g.add_edge(src, n, i);
        }
        n
    }

    pub fn mxfp8_block(&self) -> Option<usize> {
        match &self.cfg.quantization {
            Quantization::Mxfp8 { block, .. } => Some(*block),
            Quantization::None => None,
        }
    }

    pub fn linear(&mut self, x: NodeIndex, stem: &str, out: usize, inp: usize) -> NodeIndex {
        let op = Op::Linear { weight: names::weight(stem), out, inp, mxfp8_block: self.mxfp8_block() };
        self.node(op, ty(&[Dim::Tokens, Dim::Fixed(out)], Elem::Act), &[x])
    }

    pub fn norm(&mut self, x: NodeIndex, weight: String, width: usize) -> NodeIndex {
        let eps = self.cfg.text.rms_norm_eps;
        self.node(Op::RmsNorm { weight, eps, gemma: true }, ty(&[Dim::Tokens, Dim::Fixed(width)], Elem::Act), &[x])
    }

    /// Per-head QK-norm then partial RoPE, as `[S, heads, head_dim]`.
    pub fn norm_rope(&mut self, x: NodeIndex, pos: NodeIndex, weight: String, heads: usize) -> NodeIndex {
        let t = &self.cfg.text;
        let (d, eps) = (t.head_dim, t.rms_norm_eps);
        let shape = [Dim::Tokens, Dim::Fixed(heads), Dim::Fixed(d)];
        let n = self.node(Op::HeadRmsNorm { weight, heads, head_dim: d, eps }, ty(&shape, Elem::Act), &[x]);
        let rope = Op::Rope { heads, head_dim: d, rotary_dim: t.rotary_dim, theta: t.rope_theta };
        self.node(rope, ty(&shape, Elem::Act), &[n, pos])
    }

    pub fn cache(&mut self, x: NodeIndex, kind: CacheKind, layer: usize, heads: usize, dim: usize) -> NodeIndex {
        let shape = [Dim::Context, Dim::Fixed(heads), Dim::Fixed(dim)];
        self.node(Op::CacheAppend { kind, layer, heads, dim }, ty(&shape, Elem::Act), &[x])
    }

    /// A linear with a bias (and GELU after it when `gelu`) over rows of `rows`.
    pub fn biased(&mut self, x: NodeIndex, stem: &str, out: usize, inp: usize, gelu: bool, rows: Dim) -> NodeIndex {
        let shape = [rows, Dim::Fixed(out)];
        let op = Op::Linear { weight: names::weight(stem), out, inp, mxfp8_block: None };
        let y = self.node(op, ty(&shape, Elem::Act), &[x]);
        self.node(Op::BiasAct { bias: names::bias(stem), gelu }, ty(&shape, Elem::Act), &[y])
    }

    pub fn layer_norm(&mut self, x: NodeIndex, stem: &str, width: usize, eps: f64) -> NodeIndex {
        let op = Op::LayerNorm { weight: names::weight(stem), bias: names::bias(stem), eps };
        self.node(op, ty(&[Dim::Patches, Dim::Fixed(width)], Elem::Act), &[x])
    }
}
