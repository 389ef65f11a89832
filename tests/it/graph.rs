use m3c_compiler::config::load_config;
use m3c_compiler::graph::{build_graph, Op};
use m3c_compiler::model::Part;
use m3c_tests::fixture;

#[test]
fn tiny_graph_dump_is_pinned() {
    let cfg = load_config(&fixture("tiny-m3/config.json")).unwrap();
    insta::assert_snapshot!("tiny_m3_graph", build_graph(&cfg).text());
}

#[test]
fn every_layer_has_its_structure() {
    let cfg = load_config(&fixture("tiny-m3-mxfp8/config.json")).unwrap();
    let g = build_graph(&cfg);
    for (l, kind) in cfg.text.layers.iter().enumerate() {
        let ops: Vec<&Op> = g.nodes_of(Part::Layer(l)).into_iter().map(|n| &g.graph[n].op).collect();
        let sparse = ops.iter().any(|o| matches!(o, Op::TopKBlocks { .. }));
        let moe = ops.iter().any(|o| matches!(o, Op::Router { .. }));
        assert_eq!(sparse, kind.attention == m3c_compiler::config::AttentionKind::Sparse, "layer {l}");
        assert_eq!(moe, kind.mlp == m3c_compiler::config::MlpKind::Moe, "layer {l}");
        // MXFP8 linears carry their block size.
        assert!(ops
            .iter()
            .filter_map(|o| if let Op::Linear { mxfp8_block, .. } = o { Some(*mxfp8_block) } else { None })
            .all(|b| b == Some(32)));
    }
    assert!(matches!(g.graph[g.logits].op, Op::Linear { mxfp8_block: None, .. }), "lm_head is never quantized");
}
