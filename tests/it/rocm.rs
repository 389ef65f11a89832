//! The ROCm back end without an AMD GPU (none is lent to this project):
//! every stage lowers to one gfx942 code object that is checked as the
//! runtime will load it, the real config compiles, and a rocm stage fails
//! cleanly where it cannot run. The kernels themselves run at wave 64 in
//! the SIMT interpreter (`gpu_kernels.rs`), whole stages included.

use m3c_compiler::backend::hsaco;
use m3c_tests::{compile, compile_to, configs, fixture, ids_arg, m3c, read_tensor_i64, stderr};
use std::collections::BTreeMap;

/// Each `gpu.func`'s declared block size in a stage's `--emit mlir` text.
fn declared_blocks(mlir: &str) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for line in mlir.lines() {
        let Some(rest) = line.trim().strip_prefix("gpu.func @") else { continue };
        let name = rest.split('(').next().unwrap().to_string();
        let known = rest.split("known_block_size = array<i32: ").nth(1).unwrap_or_else(|| panic!("{name} declares no block size"));
        out.insert(name, known.split(',').next().unwrap().trim().parse().unwrap());
    }
    out
}

/// The tiny fixtures at pp 2: each stage's code object is for gfx942, code
/// object v5, with one kernel descriptor per kernel, waves of 64, the
/// maximum workgroup each kernel declares (which the interpreter holds
/// every launch to), no spills, scratch, dynamic stack or undefined
/// symbols; the executable embeds it and the report lists every kernel.
#[test]
fn tiny_rocm_stages_are_gfx942_code_objects_the_runtime_can_load() {
    for model in ["tiny-m3", "tiny-m3-mxfp8"] {
        let dir = tempfile::tempdir().unwrap();
        let out = compile(&fixture(model), 2, dir.path(), &["--target", "rocm", "--emit", "ptx", "--emit", "mlir"]);
        let manifest: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("manifest.json")).unwrap()).unwrap();
        assert_eq!(manifest["target"], "rocm gfx942");
        assert_eq!(manifest["activations"], "bf16", "the GPU default");
        let report = std::fs::read_to_string(out.join("compile-report.txt")).unwrap();
        assert!(report.contains("no GEMM library"), "{report}");
        for k in 0..2 {
            let bytes = std::fs::read(out.join(format!("stage-{k}.hsaco"))).unwrap();
            let co = hsaco::read(&bytes).unwrap();
            assert_eq!((co.chip.as_str(), co.version), ("gfx942", 5), "{model} stage {k}");
            assert!(co.undefined.is_empty(), "{model} stage {k}: {:?}", co.undefined);
            let declared = declared_blocks(&std::fs::read_to_string(out.join(format!("stage-{k}.mlir"))).unwrap());
            assert_eq!(co.kernels.len(), declared.len(), "{model} stage {k}: one kernel per gpu.func");
            assert_eq!(co.descriptors.len(), declared.len(), "{model} stage {k}: one descriptor per kernel");
            for kern in &co.kernels {
                let what = format!("{model} stage {k} {}", kern.name);
                assert!(co.descriptors.contains(&format!("{}.kd", kern.name)), "{what}: no descriptor");
                assert_eq!(kern.wavefront, 64, "{what}");
                assert_eq!(Some(&kern.max_workgroup), declared.get(&kern.name), "{what}: max workgroup vs declared block");
                assert_eq!((kern.sgpr_spills, kern.vgpr_spills, kern.scratch, kern.dynamic_stack), (0, 0, 0, false), "{what}");
                assert!(report.lines().any(|l| l.starts_with(&format!("{k:<6} {} ", kern.name))), "{what}: not in the report");
            }
            // The sampler's block of 1024 (over the 256 AMDGPU assumes
            // without a declaration).
            if k == 1 {
                assert!(co.kernels.iter().any(|c| c.name.starts_with("m3c_sample_w") && c.max_workgroup == 1024), "{model}");
            }
            let exe = std::fs::read(out.join(format!("stage-{k}"))).unwrap();
            assert!(exe.windows(bytes.len()).any(|w| w == &bytes[..]), "{model} stage {k}: the executable embeds the code object");
            assert_eq!(manifest["stages"][k]["device_code"], "hsaco gfx942 (code object v5)");
        }
    }
}

/// `--arch gfx950` (MI350X/MI355X) gives gfx950 code objects; an unknown
/// chip is refused before any work.
#[test]
fn rocm_compiles_for_gfx950_and_refuses_an_unknown_chip() {
    let dir = tempfile::tempdir().unwrap();
    let out = compile(&fixture("tiny-m3"), 1, dir.path(), &["--target", "rocm", "--arch", "gfx950", "--emit", "ptx"]);
    let co = hsaco::read(&std::fs::read(out.join("stage-0.hsaco")).unwrap()).unwrap();
    assert_eq!((co.chip.as_str(), co.version), ("gfx950", 5));
    let bad = dir.path().join("bad");
    let o = compile_to(&fixture("tiny-m3"), 1, &bad, &["--target", "rocm", "--arch", "gfx90a"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("\"gfx90a\" is not an AMD GPU m3c compiles for: expected one of gfx942, gfx950"), "{}", stderr(&o));
    assert!(!bad.exists(), "nothing written");
}

#[test]
fn real_config_compiles_for_rocm_at_pp4_without_weights() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let plan = dir.path().join("plan.yaml");
    let cuda_plan = std::fs::read_to_string(configs("minimax-m3-mxfp8.pp4.yaml")).unwrap();
    std::fs::write(&plan, rocm_plan(&cuda_plan)).unwrap();
    let o = compile_to(&configs("minimax-m3-mxfp8.config.json"), 4, &out, &[plan.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let report = std::fs::read_to_string(out.join("compile-report.txt")).unwrap();
    assert!(report.contains("m3c_linear_i6144_o8192_mxfp8b32"), "{report}");
    // (The compile itself checked each code object: no spills, no dynamic
    // stack; attention's 128-float accumulator is in scratch, as in CUDA's
    // local memory.)
    assert_eq!(report.lines().filter(|l| l.starts_with("3      m3c_sample_w")).count(), 1, "{report}");
}

/// A CUDA plan as its ROCm twin: the same stages, `target: rocm`, no arch
/// (and no model: the test names it).
fn rocm_plan(cuda: &str) -> String {
    cuda.lines()
        .filter(|l| !l.starts_with("arch:") && !l.starts_with("model:"))
        .map(|l| if l.starts_with("target:") { "target: rocm" } else { l })
        .collect::<Vec<_>>()
        .join("\n")
}

/// A rocm stage on a machine without HIP says so, naming every file it
/// tried, and exits non-zero; so does one pointed at a library that is not
/// HIP (`M3C_HIP_LIB`). Neither panics.
#[test]
fn a_rocm_stage_without_hip_fails_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let model = fixture("tiny-m3");
    let out = compile(&model, 2, dir.path(), &["--target", "rocm"]);
    let prompt = ids_arg(&read_tensor_i64(&model.join("golden.safetensors"), "prompt_ids"));
    let run = ["run", out.to_str().unwrap(), "--model", model.to_str().unwrap(), "--prompt-ids", &prompt, "--max-new-tokens", "4"];
    let o = m3c(&run);
    let e = m3c_tests::fails_with(&o, &["this stage was compiled for rocm gfx942, but the HIP runtime is not on this machine"]);
    for tried in ["libamdhip64.so (", "libamdhip64.so.7 (", "libamdhip64.so.6 (", "/opt/rocm/lib/libamdhip64.so.6 ("] {
        assert!(e.contains(tried), "{tried}: {e}");
    }
    assert!(!e.contains("panicked"), "{e}");
    let o = m3c_tests::m3c_env(&run, &[("M3C_HIP_LIB", "libm.so.6")]);
    let e = m3c_tests::fails_with(&o, &["libm.so.6 is not the HIP runtime of ROCm 6 or later: it has no hipInit"]);
    assert!(!e.contains("panicked"), "{e}");
}

/// `m3c plan --target rocm` sizes stages for an MI300X (192 GB): the real
/// MXFP8 model fits in 3 stages there, where an H200 needs 4, and the plan
/// it writes names the target and chip.
#[test]
fn plans_for_rocm_size_stages_for_an_mi300x() {
    let model = configs("minimax-m3-mxfp8.config.json");
    let plan = |target: &str| m3c(&["plan", "--model", model.to_str().unwrap(), "--pp", "3", "--target", target]);
    let o = plan("rocm");
    assert!(o.status.success(), "{}", stderr(&o));
    let text = m3c_tests::stdout(&o);
    assert!(text.contains("--gpu MI300X") && text.contains("\ntarget: rocm\narch: gfx942\n"), "{text}");
    let o = plan("cuda");
    assert!(!o.status.success() && stderr(&o).contains("no split into 3 stages fits H200"), "{}", stderr(&o));
}
