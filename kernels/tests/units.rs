//! Every kernel type at small shapes: its host module and its GPU module
//! parse and verify in MLIR, and its host MLIR is pinned by a small
//! snapshot (`tests/snapshots/units__NAME.snap`, reviewed as diffs;
//! regenerate with `INSTA_UPDATE=always cargo test -p m3c-kernels`).
//! A new kernel needs a sample here: the last test fails until it has one.

use m3c_kernels::*;
use melior::dialect::DialectRegistry;
use melior::ir::operation::OperationLike;
use melior::ir::Module;
use melior::utility::register_all_dialects;
use melior::Context;

/// One or more small instances of every kernel type, with a snapshot name.
fn samples() -> Vec<(&'static str, Kernel)> {
    let (f, b) = (Storage::F32, Storage::Bf16);
    let bf16 = WeightType::BF16;
    let mx = WeightType::Mxfp8 { block: 32 };
    let sel = SparseSel { index_heads: 2, index_dim: 16, block: 4, topk: 3, local: 1, init: 1 };
    vec![
        ("rms_norm", RmsNorm { width: 64, eps: 1e-6, weight: bf16, act: f, gemma: true }.into()),
        ("rms_norm_abf16", RmsNorm { width: 64, eps: 1e-6, weight: bf16, act: b, gemma: true }.into()),
        ("linear_scalar", Linear { inp: 44, out: 8, weight: bf16, act: f, out_act: f }.into()),
        ("linear_vector_mxfp8", Linear { inp: 64, out: 8, weight: mx, act: f, out_act: f }.into()),
        ("linear_logits_abf16", Linear { inp: 64, out: 8, weight: bf16, act: b, out_act: f }.into()),
        (
            "head_norm_rope",
            HeadNormRope { heads: 2, head_dim: 32, rotary_dim: 16, theta: 1e4, eps: 1e-6, weight: bf16, act: f, norm: true }.into(),
        ),
        ("swiglu_oai", SwiGluOai { width: 32, alpha: 1.702, limit: 7.0, beta: 1.0, act: f }.into()),
        ("sample", Sample { width: 40 }.into()),
        ("embedding", Embedding { vocab: 10, width: 32, weight: bf16, act: f }.into()),
        ("add", Add { width: 32, act: f }.into()),
        ("copy_cols", CopyCols { width: 16, into: 48, offset: 16, act: b }.into()),
        ("rms_norm_plain", RmsNorm { width: 64, eps: 1e-6, weight: bf16, act: f, gemma: false }.into()),
        (
            "rope_without_norm",
            HeadNormRope { heads: 2, head_dim: 32, rotary_dim: 32, theta: 1e4, eps: 0.0, weight: bf16, act: f, norm: false }.into(),
        ),
        ("scatter_rows_kvbf16", ScatterRows { width: 32, paged: Some(4), cache: b, act: f }.into()),
        ("scatter_rows_kvfp8", ScatterRows { width: 32, paged: Some(4), cache: Storage::Fp8, act: f }.into()),
        (
            "attention_paged_kvfp8",
            Attention { heads: 4, kv_heads: 2, head_dim: 16, scale: 0.25, sparse: None, paged: Some(4), cache: Storage::Fp8, act: f }
                .into(),
        ),
        ("scatter_rows_image", ScatterRows { width: 32, paged: None, cache: f, act: f }.into()),
        ("to_bf16", ToBf16 { width: 32 }.into()),
        ("dequant_mxfp8", DequantMxfp8 { out: 4, inp: 64, block: 32 }.into()),
        ("attention", Attention { heads: 4, kv_heads: 2, head_dim: 16, scale: 0.25, sparse: None, paged: None, cache: f, act: f }.into()),
        (
            "attention_paged",
            Attention { heads: 4, kv_heads: 2, head_dim: 16, scale: 0.25, sparse: None, paged: Some(4), cache: f, act: f }.into(),
        ),
        (
            "attention_msa",
            Attention { heads: 4, kv_heads: 2, head_dim: 16, scale: 0.25, sparse: Some(sel), paged: Some(4), cache: f, act: f }.into(),
        ),
        (
            // Blocks of whole batches of eight keys (as the real 128): blocks of query rows.
            "attention_msa_b8",
            Attention {
                heads: 4,
                kv_heads: 2,
                head_dim: 16,
                scale: 0.25,
                sparse: Some(SparseSel { block: 8, ..sel }),
                paged: Some(8),
                cache: f,
                act: f,
            }
            .into(),
        ),
        (
            "attention_msa_w12",
            Attention {
                heads: 2,
                kv_heads: 1,
                head_dim: 12,
                scale: 0.25,
                sparse: Some(SparseSel { index_heads: 1, index_dim: 12, ..sel }),
                paged: Some(4),
                cache: f,
                act: f,
            }
            .into(),
        ),
        (
            "router",
            Router { width: 32, experts: 8, top_k: 2, scale: 2.5, weight: WeightType::F32, bias: Some(WeightType::F32), act: f }.into(),
        ),
        (
            "routed_experts",
            RoutedExperts { experts: 4, hidden: 32, inter: 32, top_k: 2, weight: bf16, alpha: 1.702, limit: 7.0, beta: 1.0, act: f }.into(),
        ),
        ("gelu", Gelu { width: 32, act: f }.into()),
        ("layer_norm", LayerNorm { width: 32, eps: 1e-5, weight: bf16, act: f }.into()),
        ("bias_gelu_abf16", BiasAct { width: 32, weight: bf16, gelu: true, act: b }.into()),
        ("axial_rope", AxialRope { heads: 2, head_dim: 16, axis_dim: 4, theta: 10000.0, act: f }.into()),
    ]
}

fn context() -> Context {
    let registry = DialectRegistry::new();
    register_all_dialects(&registry);
    let context = Context::new();
    context.append_dialect_registry(&registry);
    context.load_all_available_dialects();
    context
}

fn verify(context: &Context, what: &str, text: &str) {
    let module = Module::parse(context, text).unwrap_or_else(|| panic!("{what}: does not parse:\n{text}"));
    assert!(module.as_operation().verify(), "{what}: does not verify:\n{text}");
}

#[test]
fn every_kernel_parses_and_verifies_on_every_target() {
    let context = context();
    for (name, k) in samples() {
        verify(&context, &format!("{name} (host)"), &module(std::slice::from_ref(&k)));
        for target in [GpuTarget::CUDA, GpuTarget::ROCM] {
            verify(&context, &format!("{name} (gpu, {target:?})"), &gpu_text(&k, &target));
        }
        // ROCm's kernels call nothing from a device library (the rocm back
        // end refuses a stage that would).
        let rocm = gpu_text(&k, &GpuTarget::ROCM);
        for op in std::iter::once(&"gpu.all_reduce").chain(m3c_kernels::devmath::EXPANDED) {
            assert!(!rocm.contains(&format!("{op} ")), "{name}: `{op}` left for rocm");
        }
    }
}

/// `k`'s GPU functions in a module, with the view helpers they call.
fn gpu_text(k: &Kernel, target: &GpuTarget) -> String {
    let mut gpu = format!("module attributes {{gpu.container_module}} {{\n  gpu.module @{} {{\n", gpu::GPU_MODULE);
    if let Kernel::RoutedExperts(r) = &k {
        // One helper per distinct view type, as the stage entry emits them.
        let views: std::collections::BTreeSet<MemTy> = expert_tensor_types(r.hidden, r.inter, r.weight).into_iter().collect();
        for t in views {
            gpu.push_str(&indent(&t.view_fn_text(), 2));
        }
    }
    for f in k.gpu_funcs(target) {
        gpu.push_str(&f.text);
    }
    gpu.push_str("  }\n}\n");
    gpu
}

#[test]
fn each_kernel_is_pinned_by_a_small_snapshot() {
    for (name, k) in samples() {
        insta::assert_snapshot!(name, k.mlir());
    }
}

#[test]
fn the_signature_is_the_definition_s_parameter_list() {
    for (name, k) in samples() {
        let params = unit::params_text(&k.params());
        assert!(k.mlir().contains(&format!("func.func @{}({params})", k.symbol())), "{name}");
    }
}

#[test]
fn every_registered_kernel_type_has_a_sample() {
    let sampled: Vec<String> = samples().iter().map(|(_, k)| format!("{k:?}").split('(').next().unwrap_or_default().to_string()).collect();
    for t in KERNEL_TYPES {
        assert!(sampled.iter().any(|s| s == t), "kernel type {t} has no sample in kernels/tests/units.rs");
    }
}
