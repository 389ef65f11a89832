//! A stable, diff-friendly text form of the graph (`m3c inspect --graph`).

use super::ops::Op;
use super::ModelGraph;
use crate::model::Part;
use std::fmt::Write;

fn attrs(op: &Op) -> String {
    let q = |b: &Option<usize>| b.map(|b| format!(" mxfp8(block={b})")).unwrap_or_default();
    match op {
        Op::TokenIds
        | Op::Positions
        | Op::Add
        | Op::Sample
        | Op::PixelRows
        | Op::PatchPositions
        | Op::ImageSegments
        | Op::AuxRows
        | Op::DraftHidden
        | Op::Concat => String::new(),
        Op::AuxState { slot } => format!(" slot={slot}"),
        Op::LayerNorm { weight, bias, eps } => format!(" w={weight} b={bias} eps={eps:e}"),
        Op::BiasAct { bias, gelu } => format!(" b={bias}{}", if *gelu { " gelu(exact)" } else { "" }),
        Op::AxialRope { heads, head_dim, axis_dim, theta } => format!(" heads={heads} dim={head_dim} axis={axis_dim}x3 theta={theta}"),
        Op::ImageAttention { heads, head_dim, scale } => format!(" heads={heads} dim={head_dim} scale={scale:.6} bidirectional per-image"),
        Op::MergePatches { factor } => format!(" factor={factor}"),
        Op::ImageScatter { token } => format!(" token={token}"),
        Op::Embedding { weight } => format!(" w={weight}"),
        Op::RmsNorm { weight, eps, gemma } => format!(" w={weight} eps={eps:e} {}", if *gemma { "gemma" } else { "plain" }),
        Op::Linear { weight, out, inp, mxfp8_block } => format!(" w={weight} {inp}->{out}{}", q(mxfp8_block)),
        Op::HeadRmsNorm { weight, heads, head_dim, eps } => format!(" w={weight} heads={heads} dim={head_dim} eps={eps:e} gemma"),
        Op::Rope { heads, head_dim, rotary_dim, theta } => format!(" heads={heads} dim={head_dim} rotary={rotary_dim} theta={theta} neox"),
        Op::CacheAppend { kind, layer, heads, dim } => format!(" {kind:?} layer={layer} heads={heads} dim={dim}"),
        Op::IndexScores { heads, dim } => format!(" heads={heads} dim={dim} causal"),
        Op::BlockMaxScore { block } => format!(" block={block}"),
        Op::TopKBlocks { k, block, local, init } => format!(" k={k} block={block} local={local} init={init}"),
        Op::Attention { heads, kv_heads, head_dim, scale, sparse_block } => format!(
            " heads={heads} kv_heads={kv_heads} dim={head_dim} scale={scale:.6} causal{}",
            sparse_block.map(|b| format!(" msa(block={b})")).unwrap_or_default()
        ),
        Op::SwiGluOai { alpha, limit, beta } => format!(" alpha={alpha} limit={limit} beta={beta}"),
        Op::Router { weight, bias, experts, top_k, scale } => format!(
            " w={weight}{} experts={experts} top_k={top_k} scale={scale} sigmoid renorm",
            bias.as_ref().map(|b| format!(" select_bias={b}")).unwrap_or_default()
        ),
        Op::RoutedExperts { stem, weights, experts, hidden, intermediate, mxfp8_block, alpha, limit, beta } => format!(
            " w={stem}.{{0..{experts}}}.{{{}}} {hidden}->{intermediate}->{hidden}{} swiglu_oai(alpha={alpha} limit={limit} beta={beta})",
            expert_projections(stem, weights),
            q(mxfp8_block)
        ),
    }
}

fn part_title(part: Part, layer_titles: &[String]) -> String {
    match part {
        Part::Embedding => "embedding".into(),
        Part::Layer(l) => format!("layer {l}: {}", layer_titles.get(l).cloned().unwrap_or_default()),
        Part::FinalNorm => "final norm".into(),
        Part::LmHead => "lm_head".into(),
        Part::Vision => "vision".into(),
        Part::Draft => "EAGLE3 draft head".into(),
    }
}

pub fn dump(g: &ModelGraph) -> String {
    dump_where(g, |_| true)
}

/// The nodes of some parts only (a stage's slice, before fusion).
pub fn dump_where(g: &ModelGraph, keep: impl Fn(Part) -> bool) -> String {
    // Layer titles come from the ops themselves: attention kind and MLP kind.
    let mut titles = Vec::new();
    for n in g.graph.node_indices() {
        if let Part::Layer(l) = g.graph[n].part {
            if titles.len() <= l {
                titles.resize(l + 1, (false, false));
            }
            match &g.graph[n].op {
                Op::Attention { sparse_block: Some(_), .. } => titles[l].0 = true,
                Op::Router { .. } => titles[l].1 = true,
                _ => {}
            }
        }
    }
    let titles: Vec<String> = titles
        .iter()
        .map(|&(s, m)| format!("{} + {}", if s { "MSA" } else { "full attention" }, if m { "MoE" } else { "dense MLP" }))
        .collect();
    let mut out = String::new();
    let mut part = None;
    for n in g.graph.node_indices() {
        let node = &g.graph[n];
        if !keep(node.part) {
            continue;
        }
        if part != Some(node.part) {
            part = Some(node.part);
            let _ = writeln!(out, "// {}", part_title(node.part, &titles));
        }
        let args: Vec<String> = g.operands(n).iter().map(|a| format!("%{}", a.index())).collect();
        let _ = writeln!(out, "%{} = {}({}){} : {}", n.index(), node.op.name(), args.join(", "), attrs(&node.op), node.ty);
    }
    let _ = writeln!(out, "// logits: %{}", g.logits.index());
    out
}

/// `w1,w3,w2`: expert 0's linear stems past `STEM.0.`, the projections
/// every expert has.
fn expert_projections(stem: &str, weights: &[[String; 3]]) -> String {
    let first = format!("{stem}.0.");
    let names = weights.first().map(|w| w.iter().map(|n| n.strip_prefix(&first).unwrap_or(n)).collect::<Vec<_>>());
    names.unwrap_or_default().join(",")
}
