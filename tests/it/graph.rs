use m3c_compiler::family::load_config;
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

/// The family seam's contract, for every family: its tiny config reads back
/// as that family, and a stage holding every part binds exactly the
/// family's layout (every tensor the graph names exists, and every tensor of
/// the layout is read by some kernel).
/// The front, the server and the stages find a model's chat format by its
/// `config.json`'s architecture, as the compiler finds its family: each
/// family has one, for exactly its architectures.
#[test]
fn every_family_has_a_chat_format_for_its_architectures() {
    use m3c_compiler::family::Family;
    use m3c_contract::chat_format::ChatFormat;
    for family in Family::all() {
        let format = ChatFormat::of_family(family.id()).unwrap_or_else(|| panic!("{}: no chat format", family.id()));
        assert_eq!(format.architectures, family.model().architectures(), "{}", family.id());
        for a in format.architectures {
            assert_eq!(ChatFormat::of_architecture(a).map(|f| f.family), Some(family.id()));
        }
    }
}

#[test]
fn every_family_reads_its_tiny_config_and_its_graph_reads_exactly_its_layout() {
    use m3c_compiler::family::Family;
    use m3c_compiler::lower::{fuse_stage, Storages};
    use m3c_compiler::model::expected_tensors;
    use m3c_compiler::tiny::TinySpec;
    use m3c_kernels::Storage;
    use std::collections::BTreeSet;
    for family in Family::all() {
        for mxfp8 in [false, true] {
            let spec = TinySpec { family, mxfp8, ..TinySpec::default() };
            let text = serde_json::to_string(&spec.config_json()).unwrap();
            let cfg = m3c_compiler::family::parse_config(std::path::Path::new("config.json"), &text).unwrap();
            assert_eq!(cfg.family, family);
            assert!(Family::all_architectures().contains(&cfg.architecture.as_str()));
            let layout: BTreeSet<String> = expected_tensors(&cfg).into_iter().map(|t| t.name).collect();
            let graph = build_graph(&cfg);
            let parts: BTreeSet<Part> = graph.graph.node_weights().map(|n| n.part).collect();
            let storages = Storages { kv_cache: Storage::F32, activations: Storage::F32 };
            let stage = fuse_stage(&cfg, &graph, &parts, storages, Default::default(), false).unwrap();
            let read: BTreeSet<String> = stage.tensors.iter().map(|t| t.name.clone()).collect();
            assert_eq!(read.len(), stage.tensors.len(), "{family:?}: a tensor bound twice");
            assert_eq!(read, layout, "{family:?} mxfp8 {mxfp8}: the graph's tensors and the layout differ");
        }
    }
}
