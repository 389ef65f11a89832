//! MiniMax-M3's forward pass as a graph: embedding (with the vision tower's
//! rows scattered in), decoder layers of full or MSA attention and dense or
//! MoE MLPs, the final Gemma norm, the lm_head and the sampler.

use super::names::{self, ExpertProj, MlpProj, TextNames};
use crate::config::{AttentionKind, MlpKind, ModelConfig};
use crate::graph::build::{ty, GraphBuilder};
use crate::graph::{CacheKind, Dim, Elem, ModelGraph, Op};
use crate::model::Part;
use petgraph::graph::NodeIndex;

/// MiniMax-M3's blocks, built from the shared helpers.
trait MiniMaxBlocks {
    fn mlp(&mut self, h: NodeIndex, stem: &str, width: usize) -> NodeIndex;
    fn layer(&mut self, l: usize, x: NodeIndex, pos: NodeIndex) -> NodeIndex;
    fn vision(&mut self) -> NodeIndex;
}

impl MiniMaxBlocks for GraphBuilder<'_> {
    /// SwiGLU-OAI MLP (dense layers and the shared expert).
    fn mlp(&mut self, h: NodeIndex, stem: &str, width: usize) -> NodeIndex {
        let t = &self.cfg.text;
        let hidden = t.hidden_size;
        let (alpha, limit, beta) = (t.swiglu_alpha, t.swiglu_limit, t.swiglu_beta);
        let gate = self.linear(h, &names::mlp_proj(stem, MlpProj::Gate), width, hidden);
        let up = self.linear(h, &names::mlp_proj(stem, MlpProj::Up), width, hidden);
        let act = self.node(Op::SwiGluOai { alpha, limit, beta }, ty(&[Dim::Tokens, Dim::Fixed(width)], Elem::Act), &[gate, up]);
        self.linear(act, &names::mlp_proj(stem, MlpProj::Down), hidden, width)
    }

    fn layer(&mut self, l: usize, x: NodeIndex, pos: NodeIndex) -> NodeIndex {
        let cfg = self.cfg;
        let t = &cfg.text;
        let kind = t.layers[l];
        let (h, d) = (t.hidden_size, t.head_dim);
        let n = TextNames::new(&cfg.text_prefix).layer(l);
        let hidden = [Dim::Tokens, Dim::Fixed(h)];

        let hn = self.norm(x, n.input_norm(), h);
        let q = self.linear(hn, &n.q_proj(), t.q_dim(), h);
        let k = self.linear(hn, &n.k_proj(), t.kv_dim(), h);
        let v = self.linear(hn, &n.v_proj(), t.kv_dim(), h);
        let q = self.norm_rope(q, pos, n.q_norm(), t.num_heads);
        let k = self.norm_rope(k, pos, n.k_norm(), t.num_kv_heads);
        let kc = self.cache(k, CacheKind::Key, l, t.num_kv_heads, d);
        let vc = self.cache(v, CacheKind::Value, l, t.num_kv_heads, d);
        let scale = 1.0 / (d as f64).sqrt();
        let attn_out = [Dim::Tokens, Dim::Fixed(t.q_dim())];
        let o = match kind.attention {
            AttentionKind::Full => {
                let op = Op::Attention { heads: t.num_heads, kv_heads: t.num_kv_heads, head_dim: d, scale, sparse_block: None };
                self.node(op, ty(&attn_out, Elem::Act), &[q, kc, vc, pos])
            }
            AttentionKind::Sparse => {
                let s = t.sparse.as_ref().expect("sparse layer without sparse config");
                let iq = self.linear(hn, &n.index_q_proj(), s.num_index_heads * s.index_dim, h);
                let ik = self.linear(hn, &n.index_k_proj(), s.index_dim, h);
                let iq = self.norm_rope(iq, pos, n.index_q_norm(), s.num_index_heads);
                let ik = self.norm_rope(ik, pos, n.index_k_norm(), 1);
                let ikc = self.cache(ik, CacheKind::IndexKey, l, 1, s.index_dim);
                let g = Dim::Fixed(s.num_index_heads);
                let scores = self.node(
                    Op::IndexScores { heads: s.num_index_heads, dim: s.index_dim },
                    ty(&[g, Dim::Tokens, Dim::Context], Elem::F32),
                    &[iq, ikc, pos],
                );
                let blocks = self.node(Op::BlockMaxScore { block: s.block_size }, ty(&[g, Dim::Tokens, Dim::Blocks], Elem::F32), &[scores]);
                let sel = self.node(
                    Op::TopKBlocks { k: s.topk_blocks, block: s.block_size, local: s.local_blocks, init: s.init_blocks },
                    ty(&[g, Dim::Tokens, Dim::Fixed(s.topk_blocks)], Elem::I32),
                    &[blocks, pos],
                );
                let op =
                    Op::Attention { heads: t.num_heads, kv_heads: t.num_kv_heads, head_dim: d, scale, sparse_block: Some(s.block_size) };
                self.node(op, ty(&attn_out, Elem::Act), &[q, kc, vc, pos, sel])
            }
        };
        let o = self.linear(o, &n.o_proj(), h, t.q_dim());
        let x = self.node(Op::Add, ty(&hidden, Elem::Act), &[x, o]);

        let h2 = self.norm(x, n.post_attention_norm(), h);
        let ffn = match kind.mlp {
            MlpKind::Dense => self.mlp(h2, &n.mlp(), t.dense_intermediate_size),
            MlpKind::Moe => {
                let k = t.moe.experts_per_token;
                let router = Op::Router {
                    weight: n.router(),
                    bias: t.moe.use_routing_bias.then(|| n.router_bias()),
                    experts: t.moe.num_experts,
                    top_k: k,
                    scale: t.moe.routed_scaling_factor,
                };
                let routing = self.node(router, ty(&[Dim::Tokens, Dim::Fixed(k)], Elem::F32), &[h2]);
                let stem = n.experts();
                let proj = |e, p| names::expert(&stem, e, p);
                let weights = (0..t.moe.num_experts).map(|e| ExpertProj::TABLE_ORDER.map(|p| proj(e, p))).collect();
                let experts = Op::RoutedExperts {
                    weights,
                    stem,
                    experts: t.moe.num_experts,
                    hidden: h,
                    intermediate: t.moe.expert_intermediate_size,
                    mxfp8_block: self.mxfp8_block(),
                    alpha: t.swiglu_alpha,
                    limit: t.swiglu_limit,
                    beta: t.swiglu_beta,
                };
                let routed = self.node(experts, ty(&hidden, Elem::Act), &[h2, routing]);
                if t.moe.num_shared_experts > 0 {
                    let shared = self.mlp(h2, &n.shared_experts(), t.moe.shared_intermediate_size);
                    self.node(Op::Add, ty(&hidden, Elem::Act), &[routed, shared])
                } else {
                    routed
                }
            }
        };
        self.node(Op::Add, ty(&hidden, Elem::Act), &[x, ffn])
    }

    /// The vision tower, projector and 2×2 merge (vision spec §4-5): patch
    /// rows in, one row of text width per merged 2×2 group out. Linears of
    /// the tower are unquantised in every published checkpoint.
    fn vision(&mut self) -> NodeIndex {
        use names::vision as vn;
        let cfg = self.cfg;
        let Some(v) = cfg.vision.as_ref() else { unreachable!("vision() without a vision config") };
        self.part = Part::Vision;
        let (vh, heads) = (v.hidden_size, v.num_heads);
        let d = vh / heads;
        let row = v.num_channels * v.temporal_patch_size * v.patch_size * v.patch_size;
        let p = Dim::Patches;
        let pix = self.node(Op::PixelRows, ty(&[p, Dim::Fixed(row)], Elem::F32), &[]);
        let ppos = self.node(Op::PatchPositions, ty(&[p, Dim::Fixed(3)], Elem::I64), &[]);
        let segs = self.node(Op::ImageSegments, ty(&[p], Elem::I64), &[]);
        // The patch Conv3d's kernel is the whole row: a linear over it.
        let patch = Op::Linear { weight: vn::patch_embedding(), out: vh, inp: row, mxfp8_block: None };
        let x = self.node(patch, ty(&[p, Dim::Fixed(vh)], Elem::Act), &[pix]);
        let pre = names::without_weight(&vn::pre_norm("weight")).to_string();
        let mut x = self.layer_norm(x, &pre, vh, v.layer_norm_eps);
        let axis_dim = 2 * ((d / 3) / 2);
        let hidden = ty(&[p, Dim::Fixed(vh)], Elem::Act);
        for l in 0..v.num_layers {
            let lp = vn::layer(l);
            let stem = |which: &str| names::without_weight(which).to_string();
            let h = self.layer_norm(x, &stem(&vn::layer_norm(&lp, 1, "weight")), vh, v.layer_norm_eps);
            let qkv: Vec<NodeIndex> =
                vn::ATTN_PROJS[..3].iter().map(|proj| self.biased(h, &stem(&vn::attn(&lp, proj, "weight")), vh, vh, false, p)).collect();
            let rope = |b: &mut Self, x: NodeIndex| {
                let op = Op::AxialRope { heads, head_dim: d, axis_dim, theta: v.rope_theta };
                b.node(op, ty(&[p, Dim::Fixed(heads), Dim::Fixed(d)], Elem::Act), &[x, ppos])
            };
            let (q, k) = (rope(self, qkv[0]), rope(self, qkv[1]));
            let att = Op::ImageAttention { heads, head_dim: d, scale: 1.0 / (d as f64).sqrt() };
            let o = self.node(att, hidden.clone(), &[q, k, qkv[2], segs]);
            let o = self.biased(o, &stem(&vn::attn(&lp, vn::ATTN_PROJS[3], "weight")), vh, vh, false, p);
            x = self.node(Op::Add, hidden.clone(), &[x, o]);
            let h = self.layer_norm(x, &stem(&vn::layer_norm(&lp, 2, "weight")), vh, v.layer_norm_eps);
            let f = self.biased(h, &stem(&vn::fc(&lp, 1, "weight")), v.intermediate_size, vh, true, p);
            let f = self.biased(f, &stem(&vn::fc(&lp, 2, "weight")), vh, v.intermediate_size, false, p);
            x = self.node(Op::Add, hidden.clone(), &[x, f]);
        }
        let (ph, th) = (v.projector_hidden_size, cfg.text.hidden_size);
        let proj = |which| names::without_weight(&vn::projector(vn::PROJECTOR, which, "weight")).to_string();
        let merge = |which| names::without_weight(&vn::projector(vn::PATCH_MERGE, which, "weight")).to_string();
        let y = self.biased(x, &proj(1), ph, vh, true, p);
        let y = self.biased(y, &proj(2), th, ph, false, p);
        let factor = v.spatial_merge_size * v.spatial_merge_size;
        let m = self.node(Op::MergePatches { factor }, ty(&[Dim::Merged, Dim::Fixed(factor * th)], Elem::Act), &[y]);
        let z = self.biased(m, &merge(1), ph, factor * th, true, Dim::Merged);
        self.biased(z, &merge(2), th, ph, false, Dim::Merged)
    }
}

/// Builds the text backbone of `cfg`: embedding, every decoder layer, final
/// norm, lm_head and the sampler.
pub(super) fn graph(cfg: &ModelConfig) -> ModelGraph {
    let t = &cfg.text;
    let names = TextNames::new(&cfg.text_prefix);
    let mut b = GraphBuilder::new(cfg);
    let ids = b.node(Op::TokenIds, ty(&[Dim::Tokens], Elem::I64), &[]);
    let pos = b.node(Op::Positions, ty(&[Dim::Tokens], Elem::I64), &[]);
    let mut x = b.node(Op::Embedding { weight: names.embedding() }, ty(&[Dim::Tokens, Dim::Fixed(t.hidden_size)], Elem::Act), &[ids]);
    // The vision tower (vision spec §4-6) joins here: its patch-merged rows
    // replace the embedding rows of image placeholder tokens before layer 0.
    if cfg.vision.is_some() {
        let feats = b.vision();
        b.part = Part::Embedding;
        let token = cfg.vision.as_ref().map_or(0, |v| v.image_token_id);
        x = b.node(Op::ImageScatter { token }, ty(&[Dim::Tokens, Dim::Fixed(t.hidden_size)], Elem::Act), &[x, feats]);
    }
    for l in 0..t.num_layers {
        b.part = Part::Layer(l);
        x = b.layer(l, x, pos);
    }
    b.part = Part::FinalNorm;
    let xn = b.norm(x, names.final_norm(), t.hidden_size);
    b.part = Part::LmHead;
    let lm = Op::Linear { weight: names::weight(&names.lm_head()), out: t.vocab_size, inp: t.hidden_size, mxfp8_block: None };
    let logits = b.node(lm, ty(&[Dim::Tokens, Dim::Fixed(t.vocab_size)], Elem::F32), &[xn]);
    b.node(Op::Sample, ty(&[Dim::Tokens], Elem::I64), &[logits]);
    b.finish(logits)
}
