use m3c_compiler::config::{AttentionKind, MlpKind, Quantization};
use m3c_compiler::family::parse_config;
use m3c_compiler::inspect::model_stats;
use m3c_tests::{configs, fixture};
use serde_json::Value;
use std::path::Path;

fn load(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// Parses `v` and returns the error message (the test fails if it parses).
fn error_of(v: &Value) -> String {
    match parse_config(Path::new("cfg/config.json"), &v.to_string()) {
        Ok(_) => panic!("config unexpectedly valid"),
        Err(e) => e.to_string(),
    }
}

fn tiny() -> Value {
    load(&fixture("tiny-m3/config.json"))
}

#[test]
fn real_config_parses_with_exact_parameter_count() {
    let path = configs("minimax-m3.config.json");
    let cfg = m3c_compiler::family::load_config(&path).unwrap();
    let t = &cfg.text;
    assert_eq!((t.hidden_size, t.num_layers, t.num_heads, t.num_kv_heads, t.head_dim), (6144, 60, 64, 4, 128));
    assert_eq!((t.moe.num_experts, t.moe.experts_per_token, t.rotary_dim, t.vocab_size), (128, 4, 64, 200064));
    assert_eq!(t.swiglu_beta, 1.0);
    assert_eq!(cfg.text_prefix, "language_model.");
    for (l, k) in t.layers.iter().enumerate() {
        let dense = l < 3;
        assert_eq!(k.attention, if dense { AttentionKind::Full } else { AttentionKind::Sparse }, "layer {l}");
        assert_eq!(k.mlp, if dense { MlpKind::Dense } else { MlpKind::Moe }, "layer {l}");
    }
    let s = t.sparse.as_ref().unwrap();
    assert_eq!((s.block_size, s.topk_blocks, s.num_index_heads, s.local_blocks), (128, 16, 4, 1));
    let stats = model_stats(&cfg);
    assert_eq!(stats.total_params, 427_040_140_160);
    assert_eq!(stats.vision_params, 865_567_232);
    // The spec's ≈ 25.96 B active per token, embedding and lm_head included.
    assert_eq!(stats.active_params, 25_962_473_856);
    assert_eq!(cfg.quantization, Quantization::None);
    let v = cfg.vision.as_ref().unwrap();
    assert_eq!((v.hidden_size, v.num_layers, v.image_token_id, v.projector_hidden_size), (1280, 32, 200025, 6144));
}

#[test]
fn mxfp8_config_parses_with_same_parameters() {
    let cfg = m3c_compiler::family::load_config(&configs("minimax-m3-mxfp8.config.json")).unwrap();
    match &cfg.quantization {
        Quantization::Mxfp8 { block, ignored_layers } => {
            assert_eq!(*block, 32);
            assert!(ignored_layers.iter().any(|l| l == "lm_head"));
        }
        q => panic!("expected MXFP8, got {q:?}"),
    }
    let stats = model_stats(&cfg);
    assert_eq!(stats.total_params, 427_040_140_160);
    // fp8 linears + E8M0 scales: the published checkpoint's ≈ 413 GiB.
    let total: u64 = stats.bytes_by_dtype.values().sum();
    assert_eq!(total, 443_742_085_120);
}

#[test]
fn flat_text_only_config_parses() {
    let mut text = tiny()["text_config"].clone();
    text["architectures"] = serde_json::json!(["MiniMaxM3SparseForCausalLM"]);
    let cfg = parse_config(Path::new("flat/config.json"), &text.to_string()).unwrap();
    assert_eq!(cfg.text_prefix, "");
    assert!(cfg.vision.is_none());
    assert_eq!(cfg.text.num_layers, 8);
    assert_eq!(cfg.text.layers[1].attention, AttentionKind::Sparse);
}

#[test]
fn unknown_architecture_is_an_error() {
    let mut v = tiny();
    v["architectures"] = serde_json::json!(["LlamaForCausalLM"]);
    let e = error_of(&v);
    assert!(
        e.contains("cfg/config.json") && e.contains("LlamaForCausalLM") && e.contains("MiniMaxM3SparseForConditionalGeneration"),
        "{e}"
    );
}

#[test]
fn validation_errors_name_key_and_expectation() {
    type Edit = fn(&mut Value);
    let cases: Vec<(Edit, &str, &str)> = vec![
        (|v| v["text_config"]["num_key_value_heads"] = 3.into(), "text_config.num_key_value_heads", "a divisor of num_attention_heads = 8"),
        (|v| v["text_config"]["moe_layer_freq"] = serde_json::json!([0, 1]), "text_config.moe_layer_freq", "8 entries"),
        (
            |v| v["text_config"]["sparse_attention_config"]["sparse_attention_freq"] = serde_json::json!([0, 1, 0]),
            "sparse_attention_freq",
            "one per layer",
        ),
        (|v| v["text_config"]["moe_layer_freq"][3] = 2.into(), "text_config.moe_layer_freq[3]", "0 or 1"),
        (
            |v| v["text_config"]["sparse_attention_config"]["sparse_num_index_heads"] = 4.into(),
            "sparse_num_index_heads",
            "num_key_value_heads = 2",
        ),
        (|v| v["text_config"]["sparse_attention_config"]["sparse_index_dim"] = 64.into(), "sparse_index_dim", "head_dim = 32"),
        (|v| v["text_config"]["hidden_act"] = "gelu".into(), "text_config.hidden_act", "\"swigluoai\""),
        (|v| v["text_config"]["scoring_func"] = "softmax".into(), "text_config.scoring_func", "\"sigmoid\""),
        (|v| v["text_config"]["sparse_attention_config"]["sparse_score_type"] = "mean".into(), "sparse_score_type", "\"max\""),
        (
            |v| {
                v["text_config"].as_object_mut().unwrap().remove("hidden_size");
            },
            "text_config.hidden_size",
            "missing key",
        ),
        (|v| v["text_config"]["hidden_size"] = "big".into(), "text_config.hidden_size", "a positive integer"),
        (|v| v["text_config"]["rotary_dim"] = 12.into(), "text_config.rotary_dim", "partial_rotary_factor × head_dim = 16"),
        (|v| v["text_config"]["num_experts_per_tok"] = 9.into(), "num_experts_per_tok", "at most num_local_experts = 8"),
        (
            |v| v["text_config"]["sparse_attention_config"]["sparse_disable_index_value"][3] = 0.into(),
            "sparse_disable_index_value[3]",
            "selection-only",
        ),
        (|v| v["text_config"]["attention_output_gate"] = true.into(), "attention_output_gate", "false"),
        (|v| v["vision_config"]["hidden_act"] = "relu".into(), "vision_config.hidden_act", "\"gelu\""),
    ];
    for (edit, key, expected) in cases {
        let mut v = tiny();
        edit(&mut v);
        let e = error_of(&v);
        assert!(e.contains("cfg/config.json"), "no file in: {e}");
        assert!(e.contains(key), "key {key} not in: {e}");
        assert!(e.contains(expected), "'{expected}' not in: {e}");
    }
}

#[test]
fn mxfp8_in_features_must_split_into_blocks() {
    let mut v = load(&fixture("tiny-m3-mxfp8/config.json"));
    v["text_config"]["intermediate_size"] = 48.into();
    let e = error_of(&v);
    assert!(e.contains("quantization_config.weight_block_size") && e.contains("intermediate_size = 48 is not a multiple of 32"), "{e}");
    let mut v = load(&fixture("tiny-m3-mxfp8/config.json"));
    v["quantization_config"]["weight_block_size"] = serde_json::json!([128, 128]);
    let e = error_of(&v);
    assert!(e.contains("[1, 32]"), "{e}");
    let mut v = load(&fixture("tiny-m3-mxfp8/config.json"));
    v["quantization_config"]["quant_method"] = "fp8".into();
    assert!(error_of(&v).contains("quantization_config.quant_method"));
}

#[test]
fn malformed_json_names_the_file() {
    let e = parse_config(Path::new("x/config.json"), "{ not json").unwrap_err().to_string();
    assert!(e.starts_with("x/config.json: not valid JSON"), "{e}");
}
