use m3c_compiler::family::load_config;
use m3c_compiler::model::Part;
use m3c_compiler::weights::{bind, BindProblem, Checkpoint, WeightsError};
use m3c_tests::fixture;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use std::collections::BTreeSet;
use std::path::Path;

/// All tensors of a safetensors file as (name, dtype, shape, bytes).
fn read_all(path: &Path) -> Vec<(String, Dtype, Vec<usize>, Vec<u8>)> {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<_> = st.tensors().into_iter().map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec())).collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

fn write(path: &Path, tensors: &[(String, Dtype, Vec<usize>, Vec<u8>)]) {
    let views: Vec<(String, TensorView)> =
        tensors.iter().map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap())).collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

#[test]
fn fixtures_bind_every_tensor() {
    for name in ["tiny-m3", "tiny-m3-mxfp8"] {
        let dir = fixture(name);
        let cfg = load_config(&dir.join("config.json")).unwrap();
        let ck = Checkpoint::open(&dir).unwrap();
        let bound = bind(&cfg, &ck, None).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(bound.tensors.len(), ck.tensors.len(), "{name}");
        // The bound bytes are views of the mapped file with the declared size.
        let (spec, entry) = bound.get("language_model.model.embed_tokens.weight").unwrap();
        assert_eq!(ck.bytes(entry).len() as u64, spec.numel() * 2);
    }
}

#[test]
fn a_stage_binds_only_its_parts() {
    let dir = fixture("tiny-m3-mxfp8");
    let cfg = load_config(&dir.join("config.json")).unwrap();
    let ck = Checkpoint::open(&dir).unwrap();
    let parts: BTreeSet<Part> = [Part::Layer(3), Part::Layer(4)].into_iter().collect();
    let bound = bind(&cfg, &ck, Some(&parts)).unwrap();
    assert!(bound.tensors.iter().all(|(s, _)| parts.contains(&s.part)));
    // Layer 3 is MSA + MoE: 8 experts × 3 linears × (weight + scale) among them.
    let experts = bound.tensors.iter().filter(|(s, _)| s.name.contains("layers.3.block_sparse_moe.experts.")).count();
    assert_eq!(experts, 8 * 3 * 2);
}

#[test]
fn sharded_checkpoint_binds() {
    let src = fixture("tiny-m3");
    let dir = tempfile::tempdir().unwrap();
    let all = read_all(&src.join("model.safetensors"));
    let (a, b) = all.split_at(all.len() / 2);
    let names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"];
    write(&dir.path().join(names[0]), a);
    write(&dir.path().join(names[1]), b);
    let mut map = serde_json::Map::new();
    for (i, part) in [a, b].iter().enumerate() {
        for t in part.iter() {
            map.insert(t.0.clone(), names[i].into());
        }
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    std::fs::write(dir.path().join("model.safetensors.index.json"), index.to_string()).unwrap();
    std::fs::copy(src.join("config.json"), dir.path().join("config.json")).unwrap();
    let cfg = load_config(&dir.path().join("config.json")).unwrap();
    let ck = Checkpoint::open(dir.path()).unwrap();
    assert_eq!(ck.shards.len(), 2);
    bind(&cfg, &ck, None).unwrap();

    // A shard named in the index but absent is an error naming both.
    std::fs::remove_file(dir.path().join(names[1])).unwrap();
    let e = Checkpoint::open(dir.path()).err().expect("missing shard must fail");
    assert!(matches!(e, WeightsError::MissingShard { .. }), "{e}");
    let msg = e.to_string();
    assert!(msg.contains("model.safetensors.index.json") && msg.contains(names[1]), "{msg}");
}

#[test]
fn all_binding_problems_are_reported_at_once() {
    let src = fixture("tiny-m3");
    let dir = tempfile::tempdir().unwrap();
    let mut all = read_all(&src.join("model.safetensors"));
    let missing = "language_model.model.layers.5.self_attn.index_k_norm.weight";
    all.retain(|t| t.0 != missing);
    all.push(("language_model.mtp.0.weight".into(), Dtype::BF16, vec![2], vec![0; 4]));
    for t in all.iter_mut() {
        if t.0 == "language_model.model.layers.2.self_attn.q_norm.weight" {
            t.2 = vec![16];
            t.3.truncate(32);
        }
        if t.0 == "language_model.model.layers.4.block_sparse_moe.gate.weight" {
            t.1 = Dtype::I32; // same size as its f32, wrong kind
        }
    }
    write(&dir.path().join("model.safetensors"), &all);
    std::fs::copy(src.join("config.json"), dir.path().join("config.json")).unwrap();
    let cfg = load_config(&dir.path().join("config.json")).unwrap();
    let ck = Checkpoint::open(dir.path()).unwrap();
    let report = bind(&cfg, &ck, None).err().expect("binding must fail");
    let p = &report.problems;
    assert_eq!(p.len(), 4, "{report}");
    assert!(p.iter().any(|x| matches!(x, BindProblem::Missing { name, .. } if name == missing)));
    assert!(p.iter().any(|x| matches!(x, BindProblem::Unexpected { name, .. } if name == "language_model.mtp.0.weight")));
    assert!(p.iter().any(|x| matches!(x, BindProblem::Shape { expected, found, .. } if expected == &vec![32] && found == &vec![16])));
    assert!(p.iter().any(|x| matches!(x, BindProblem::Dtype { found, .. } if found == "i32")));
    let text = report.to_string();
    assert!(text.contains("1 missing, 1 unexpected, 2 mismatched"), "{text}");
    assert!(
        text.contains("model.safetensors: tensor `language_model.model.layers.2.self_attn.q_norm.weight` has shape [16], expected [32]"),
        "{text}"
    );
}

#[test]
fn unreadable_checkpoints_name_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let e = Checkpoint::open(dir.path()).err().unwrap().to_string();
    assert!(e.contains("no model.safetensors or model.safetensors.index.json"), "{e}");
    std::fs::write(dir.path().join("model.safetensors"), b"garbage").unwrap();
    let e = Checkpoint::open(dir.path()).err().unwrap().to_string();
    assert!(e.contains("model.safetensors: not a valid safetensors file"), "{e}");
}
