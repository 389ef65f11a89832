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
use crate::model::names::{TextNames, EAGLE3_OWN_EMBEDDING};
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
        ("fc.weight".into(), vec![h, n * d.target_hidden], Role::Linear),
        ("midlayer.input_layernorm.weight".into(), vec![h], Role::Norm),
        ("midlayer.hidden_norm.weight".into(), vec![h], Role::Norm),
        ("midlayer.self_attn.q_proj.weight".into(), vec![q, 2 * h], Role::Linear),
        ("midlayer.self_attn.k_proj.weight".into(), vec![kv, 2 * h], Role::Linear),
        ("midlayer.self_attn.v_proj.weight".into(), vec![kv, 2 * h], Role::Linear),
        ("midlayer.self_attn.o_proj.weight".into(), vec![h, q], Role::Linear),
        ("midlayer.post_attention_layernorm.weight".into(), vec![h], Role::Norm),
        ("midlayer.mlp.gate_proj.weight".into(), vec![i, h], Role::Linear),
        ("midlayer.mlp.up_proj.weight".into(), vec![i, h], Role::Linear),
        ("midlayer.mlp.down_proj.weight".into(), vec![h, i], Role::Linear),
        ("norm.weight".into(), vec![h], Role::Norm),
        ("lm_head.weight".into(), vec![d.draft_vocab, h], Role::Linear),
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
        b.linear(aux, "fc.weight", h, width)
    } else {
        b.rows(Op::DraftHidden, h, &[])
    };
    let embedding = if d.own_embedding { name(EAGLE3_OWN_EMBEDDING) } else { TextNames::new(&cfg.text_prefix).embedding() };
    let e = b.rows(Op::Embedding { weight: embedding }, h, &[ids]);
    let en = b.norm(e, "midlayer.input_layernorm.weight", h, eps);
    let hn = b.norm(hidden, "midlayer.hidden_norm.weight", h, eps);
    let x = b.rows(Op::Concat, 2 * h, &[en, hn]);
    let (q_dim, kv_dim) = (d.heads * hd, d.kv_heads * hd);
    let q = b.linear(x, "midlayer.self_attn.q_proj.weight", q_dim, 2 * h);
    let k = b.linear(x, "midlayer.self_attn.k_proj.weight", kv_dim, 2 * h);
    let v = b.linear(x, "midlayer.self_attn.v_proj.weight", kv_dim, 2 * h);
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
    let o = b.linear(o, "midlayer.self_attn.o_proj.weight", h, q_dim);
    let h1 = b.rows(Op::Add, h, &[hidden, o]);
    let m = b.norm(h1, "midlayer.post_attention_layernorm.weight", h, eps);
    let gate = b.linear(m, "midlayer.mlp.gate_proj.weight", d.intermediate, h);
    let up = b.linear(m, "midlayer.mlp.up_proj.weight", d.intermediate, h);
    // SiLU(g)·u is SwiGLU-OAI with alpha 1, beta 0 and no clamp that binds
    // (the largest finite f32): min(g, L)·σ(g)·(clamp(u, ±L) + 0).
    let silu = Op::SwiGluOai { alpha: 1.0, limit: f32::MAX as f64, beta: 0.0 };
    let act = b.rows(silu, d.intermediate, &[gate, up]);
    let down = b.linear(act, "midlayer.mlp.down_proj.weight", h, d.intermediate);
    let h2 = b.rows(Op::Add, h, &[h1, down]);
    let n = b.norm(h2, "norm.weight", h, eps);
    let lm = Op::Linear { weight: name("lm_head.weight"), out: d.draft_vocab, inp: h, mxfp8_block: None };
    let logits = b.node(lm, &[Dim::Tokens, Dim::Fixed(d.draft_vocab)], Elem::F32, &[n]);
    b.node(Op::Sample, &[Dim::Tokens], Elem::I64, &[logits]);
    ModelGraph { graph: b.g, logits }
}

/// Taps the target's graph for an EAGLE3 draft: aux slot k copies the
/// residual stream entering layer `layers[k]` (vLLM's id: the embedding for
/// 0, else layer id − 1's output), at the end of the part that makes it,
/// so the stage holding that part writes the slot.
pub fn tap_aux_states(graph: &mut ModelGraph, layers: &[usize]) -> Result<(), String> {
    for (slot, &l) in layers.iter().enumerate() {
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
