//! An EAGLE3 draft head as graphs, after vLLM's `llama_eagle3.py` at
//! inference, and the taps in the target's graph that feed it.
//!
//! The head runs in two entries on the stage that holds it:
//! - first (`first`): the target's aux states of each row (`[S, n·H]`,
//!   concatenated in slot order) go through `fc` into the hidden state;
//! - next: its own pre-norm hidden state of the row before (`[S, H]`).
//!
//! Then one Llama decoder layer: attention over
//! `[input_layernorm(embed(token)) | hidden_norm(h)]` (2·H inputs; the
//! residual is `h` before its norm), NeoX RoPE over the whole head, its own
//! K and V caches (a "layer" one past the target's last, in the same block
//! pool and block tables), a SiLU-gated MLP, the final norm, and `lm_head`
//! over the draft vocabulary with the greedy sampler. Both entries leave the
//! pre-norm hidden state in `x` for the next step.

use super::build::ty;
use super::ops::{CacheKind, Dim, Elem, Node, Op};
use super::ModelGraph;
use crate::config::ModelConfig;
use crate::model::names::{eagle3 as E, EAGLE3_OWN_EMBEDDING};
use crate::model::{Part, Role, TensorSpec, TypeRule};
use crate::plan::draft::DraftHead;
use petgraph::graph::{DiGraph, NodeIndex};
use petgraph::Direction;

/// Slot names of the draft's tensors start with this: the runtime binds
/// them from the draft's checkpoint (the rest from the target's).
pub const PREFIX: &str = "draft/";

/// The layer index of the draft's caches: one past the target's last.
pub fn cache_layer(cfg: &ModelConfig) -> usize {
    cfg.text.num_layers
}

fn name(n: &str) -> String {
    format!("{PREFIX}{n}")
}

/// The draft's tensors as the fuser looks weights up: hub names under
/// [`PREFIX`], the checkpoint's type.
pub fn tensors(d: &DraftHead) -> Vec<TensorSpec> {
    let (h, q, kv, i) = (d.hidden, d.heads * d.head_dim, d.kv_heads * d.head_dim, d.intermediate);
    let n = d.aux_layers.len();
    let mut list: Vec<(String, Vec<usize>, Role)> = vec![
        (E::FC.to_string(), vec![h, n * d.target_hidden], Role::Linear),
        (E::INPUT_NORM.into(), vec![h], Role::Norm),
        (E::HIDDEN_NORM.into(), vec![h], Role::Norm),
        (E::Q.into(), vec![q, 2 * h], Role::Linear),
        (E::K.into(), vec![kv, 2 * h], Role::Linear),
        (E::V.into(), vec![kv, 2 * h], Role::Linear),
        (E::O.into(), vec![h, q], Role::Linear),
        (E::POST_ATTENTION_NORM.into(), vec![h], Role::Norm),
        (E::GATE.into(), vec![i, h], Role::Linear),
        (E::UP.into(), vec![i, h], Role::Linear),
        (E::DOWN.into(), vec![h, i], Role::Linear),
        (E::NORM.into(), vec![h], Role::Norm),
        (E::LM_HEAD.into(), vec![d.draft_vocab, h], Role::Linear),
    ];
    if d.own_embedding {
        list.push((EAGLE3_OWN_EMBEDDING.into(), vec![d.vocab, h], Role::Embedding));
    }
    list.into_iter()
        .map(|(n, shape, role)| TensorSpec { name: name(&n), shape, rule: TypeRule::Float, nominal: d.dtype, part: Part::Draft, role })
        .collect()
}

struct Builder {
    g: DiGraph<Node, usize>,
}

impl Builder {
    fn node(&mut self, op: Op, shape: &[Dim], elem: Elem, operands: &[NodeIndex]) -> NodeIndex {
        let n = self.g.add_node(Node { op, ty: ty(shape, elem), part: Part::Draft });
        for (i, &src) in operands.iter().enumerate() {
            self.g.add_edge(src, n, i);
        }
        n
    }

    fn rows(&mut self, op: Op, width: usize, operands: &[NodeIndex]) -> NodeIndex {
        self.node(op, &[Dim::Tokens, Dim::Fixed(width)], Elem::Act, operands)
    }

    fn linear(&mut self, x: NodeIndex, w: &str, out: usize, inp: usize) -> NodeIndex {
        self.rows(Op::Linear { weight: name(w), out, inp, mxfp8_block: None }, out, &[x])
    }

    fn norm(&mut self, x: NodeIndex, w: &str, width: usize, eps: f64) -> NodeIndex {
        self.rows(Op::RmsNorm { weight: name(w), eps, gemma: false }, width, &[x])
    }
}

/// The draft head's first (`first`, from the aux states) or later entry.
pub fn draft_graph(cfg: &ModelConfig, d: &DraftHead, first: bool) -> ModelGraph {
    let mut b = Builder { g: DiGraph::new() };
    let (h, hd, eps) = (d.hidden, d.head_dim, d.rms_norm_eps);
    let ids = b.node(Op::TokenIds, &[Dim::Tokens], Elem::I64, &[]);
    let pos = b.node(Op::Positions, &[Dim::Tokens], Elem::I64, &[]);
    let hidden = if first {
        let width = d.aux_layers.len() * d.target_hidden;
        let aux = b.rows(Op::AuxRows, width, &[]);
        b.linear(aux, E::FC, h, width)
    } else {
        b.rows(Op::DraftHidden, h, &[])
    };
    let embedding = if d.own_embedding { name(EAGLE3_OWN_EMBEDDING) } else { cfg.family.model().embedding(cfg) };
    let e = b.rows(Op::Embedding { weight: embedding }, h, &[ids]);
    let en = b.norm(e, E::INPUT_NORM, h, eps);
    let hn = b.norm(hidden, E::HIDDEN_NORM, h, eps);
    let x = b.rows(Op::Concat, 2 * h, &[en, hn]);
    let (q_dim, kv_dim) = (d.heads * hd, d.kv_heads * hd);
    let q = b.linear(x, E::Q, q_dim, 2 * h);
    let k = b.linear(x, E::K, kv_dim, 2 * h);
    let v = b.linear(x, E::V, kv_dim, 2 * h);
    let rope = |b: &mut Builder, x: NodeIndex, heads: usize| {
        let op = Op::Rope { heads, head_dim: hd, rotary_dim: hd, theta: d.rope_theta };
        b.node(op, &[Dim::Tokens, Dim::Fixed(heads), Dim::Fixed(hd)], Elem::Act, &[x, pos])
    };
    let q = rope(&mut b, q, d.heads);
    let k = rope(&mut b, k, d.kv_heads);
    let layer = cache_layer(cfg);
    let cache = |b: &mut Builder, x: NodeIndex, kind: CacheKind| {
        let op = Op::CacheAppend { kind, layer, heads: d.kv_heads, dim: hd };
        b.node(op, &[Dim::Context, Dim::Fixed(d.kv_heads), Dim::Fixed(hd)], Elem::Act, &[x])
    };
    let kc = cache(&mut b, k, CacheKind::Key);
    let vc = cache(&mut b, v, CacheKind::Value);
    let att = Op::Attention { heads: d.heads, kv_heads: d.kv_heads, head_dim: hd, scale: 1.0 / (hd as f64).sqrt(), sparse_block: None };
    let o = b.rows(att, q_dim, &[q, kc, vc, pos]);
    let o = b.linear(o, E::O, h, q_dim);
    let h1 = b.rows(Op::Add, h, &[hidden, o]);
    let m = b.norm(h1, E::POST_ATTENTION_NORM, h, eps);
    let gate = b.linear(m, E::GATE, d.intermediate, h);
    let up = b.linear(m, E::UP, d.intermediate, h);
    // SiLU(g)·u is SwiGLU-OAI with alpha 1, beta 0 and no clamp that binds
    // (the largest finite f32): min(g, L)·σ(g)·(clamp(u, ±L) + 0).
    let silu = Op::SwiGluOai { alpha: 1.0, limit: f32::MAX as f64, beta: 0.0 };
    let act = b.rows(silu, d.intermediate, &[gate, up]);
    let down = b.linear(act, E::DOWN, h, d.intermediate);
    let h2 = b.rows(Op::Add, h, &[h1, down]);
    let n = b.norm(h2, E::NORM, h, eps);
    let lm = Op::Linear { weight: name(E::LM_HEAD), out: d.draft_vocab, inp: h, mxfp8_block: None };
    let logits = b.node(lm, &[Dim::Tokens, Dim::Fixed(d.draft_vocab)], Elem::F32, &[n]);
    b.node(Op::Sample, &[Dim::Tokens], Elem::I64, &[logits]);
    ModelGraph { graph: b.g, logits }
}

/// The carry slot of each aux state the draft names, in its config's
/// order: slots go in layer order, so the states made by stages 0..=k are
/// the first slots whatever order the config lists them in, and boundary k
/// carries only those.
pub fn carry_order(layers: &[usize]) -> Vec<usize> {
    let mut by_layer: Vec<usize> = (0..layers.len()).collect();
    by_layer.sort_by_key(|&j| (layers[j], j));
    let mut order = vec![0; layers.len()];
    for (slot, j) in by_layer.into_iter().enumerate() {
        order[j] = slot;
    }
    order
}

/// The part whose end makes aux state `layer` (the residual stream entering
/// that layer): the embedding's for 0, else the layer before's.
pub fn aux_producer(layer: usize) -> Part {
    match layer {
        0 => Part::Embedding,
        l => Part::Layer(l - 1),
    }
}

/// Taps the target's graph for an EAGLE3 draft: the aux state of
/// `layers[j]` (vLLM's id: the residual stream entering that layer, the
/// embedding for 0, else layer id − 1's output) is copied into carry slot
/// [`carry_order`]`[j]` at the end of the part that makes it, so the stage
/// holding that part writes the slot.
pub fn tap_aux_states(graph: &mut ModelGraph, layers: &[usize]) -> Result<(), String> {
    let order = carry_order(layers);
    for (&l, &slot) in layers.iter().zip(&order) {
        let inside = |n: NodeIndex| graph.graph[n].part == Part::Layer(l);
        let mut inputs: Vec<NodeIndex> = graph
            .graph
            .node_indices()
            .filter(|&n| inside(n))
            .flat_map(|n| graph.graph.neighbors_directed(n, Direction::Incoming).collect::<Vec<_>>())
            .filter(|&s| !inside(s) && graph.graph[s].ty.elem == Elem::Act)
            .collect();
        inputs.sort();
        inputs.dedup();
        let [stream] = inputs.as_slice() else {
            return Err(format!("layer {l} of the target does not read exactly one residual stream (found {})", inputs.len()));
        };
        let (part, shape) = (graph.graph[*stream].part, graph.graph[*stream].ty.clone());
        let n = graph.graph.add_node(Node { op: Op::AuxState { slot }, ty: shape, part });
        graph.graph.add_edge(*stream, n, 0);
    }
    Ok(())
}

/// Whether `n` is an aux tap (a reader that runs at the end of its
/// producer's part, before any later reader).
pub fn is_tap(graph: &ModelGraph, n: NodeIndex) -> bool {
    matches!(graph.graph[n].op, Op::AuxState { .. })
}
