//! The CUDA back end on a machine without a GPU: every stage lowers to PTX
//! that ptxas assembles for sm_90a, the kernels and their signatures are
//! pinned, the real config compiles, and a CUDA stage started without a
//! driver fails cleanly. (With a driver present, the last test runs the
//! fixture on the GPU against the goldens instead.)

use m3c_tests::{configs, fixture, ids_arg, read_tensor_i64, root, stderr, stdout};
use std::path::{Path, PathBuf};

/// The nvidia-cuda-nvcc wheel's toolkit folder (ptxas + libdevice) that
/// scripts/setup.sh installs into .venv-cuda.
pub fn cuda_root() -> PathBuf {
    let venv = root().join(".venv-cuda/lib");
    let wheel = std::fs::read_dir(&venv)
        .ok()
        .and_then(|d| d.filter_map(|e| e.ok()).map(|e| e.path().join("site-packages/nvidia/cuda_nvcc")).find(|p| p.is_dir()))
        .unwrap_or_else(|| venv.join("python3/site-packages/nvidia/cuda_nvcc"));
    let p = std::env::var_os("CUDA_ROOT").map(PathBuf::from).unwrap_or(wheel);
    assert!(
        p.join("bin/ptxas").is_file(),
        "{}: no ptxas; run scripts/setup.sh (it installs nvidia-cuda-nvcc-cu12 in .venv-cuda)",
        p.display()
    );
    p
}

/// `m3c compile ... --target cuda` with this project's toolkit as the
/// compile's `CUDA_ROOT` (given to that process only: the test process's
/// environment is shared by every test thread).
fn compile_cuda(model: &Path, pp: usize, dir: &Path, extra: &[&str]) -> PathBuf {
    let out = dir.join("out");
    let o = compile_cuda_to(model, pp, &out, &[&["--target", "cuda"], extra].concat());
    assert!(o.status.success(), "m3c compile {} --target cuda {extra:?} failed:\n{}", model.display(), stderr(&o));
    out
}

/// `m3c compile --model MODEL --pp PP -o OUT EXTRA...` with `CUDA_ROOT` set
/// for it.
fn compile_cuda_to(model: &Path, pp: usize, out: &Path, extra: &[&str]) -> std::process::Output {
    let (pp, root) = (pp.to_string(), cuda_root());
    let mut args = vec!["compile", "--model", model.to_str().unwrap(), "--pp", &pp, "-o", out.to_str().unwrap()];
    args.extend_from_slice(extra);
    m3c_tests::m3c_env(&args, &[("CUDA_ROOT", root.to_str().unwrap())])
}

/// `.entry` lines of a PTX file: each kernel with its parameter count.
fn entries(ptx: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut lines = ptx.lines().peekable();
    while let Some(l) = lines.next() {
        if let Some(rest) = l.trim().strip_prefix(".visible .entry ") {
            let name = rest.trim_end_matches('(').to_string();
            let mut params = 0;
            for p in lines.by_ref() {
                if p.trim().starts_with(".param") {
                    params += 1;
                }
                if p.trim().starts_with(')') {
                    break;
                }
            }
            out.push(format!("{name} ({params} params)"));
        }
    }
    out.sort();
    out
}

#[test]
fn tiny_cuda_stages_assemble_for_sm90a_and_their_kernels_are_pinned() {
    for model in ["tiny-m3", "tiny-m3-mxfp8"] {
        let dir = tempfile::tempdir().unwrap();
        let out = compile_cuda(&fixture(model), 2, dir.path(), &["--emit", "ptx"]);
        let manifest: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("manifest.json")).unwrap()).unwrap();
        assert_eq!(manifest["target"], "cuda sm_90a");
        assert_eq!(manifest["activations"], "bf16", "the GPU default");
        let report = std::fs::read_to_string(out.join("compile-report.txt")).unwrap();
        for k in 0..2 {
            let ptx_file = out.join(format!("stage-{k}.ptx"));
            let ptx = std::fs::read_to_string(&ptx_file).unwrap();
            assert!(ptx.contains(".target sm_90a"));
            // (ptxas assembled it: the compile embeds the cubin it made, below.)
            let list = entries(&ptx);
            assert!(!list.is_empty());
            // Every kernel is in the compile report with its registers.
            for e in &list {
                let name = e.split(' ').next().unwrap();
                assert!(report.lines().any(|l| l.starts_with(&format!("{k:<6} {name} "))), "{name} missing from the report:\n{report}");
            }
            insta::assert_snapshot!(format!("{model}_pp2_stage{k}_cuda_kernels"), list.join("\n"));
            if k == 1 {
                // The device sampler matches the host's bit for bit only if
                // every product is rounded on its own (no fused multiply-add)
                // and every division is IEEE's.
                let at = ptx.find(".entry m3c_sample_w").expect("the last stage samples on the device");
                let body = &ptx[at + 6..];
                let body = &body[..body.find(".entry").unwrap_or(body.len())];
                assert!(!body.contains("fma.") && !body.contains("mad.rn.f"), "{model}: the sampler's PTX fuses a multiply-add");
                assert!(
                    body.contains("div.rn.f32") && !body.contains("div.approx") && !body.contains("div.full"),
                    "{model}: the sampler's divisions"
                );
            }
            // The executable embeds the cubin ptxas made (machine code, no JIT
            // at start-up), not the PTX.
            let cubin = std::fs::read(out.join(format!("stage-{k}.cubin"))).unwrap();
            assert_eq!(&cubin[..4], b"\x7fELF", "{model} stage {k}: the cubin is an ELF");
            let exe = std::fs::read(out.join(format!("stage-{k}"))).unwrap();
            assert!(exe.windows(cubin.len()).any(|w| w == &cubin[..]), "{model} stage {k}: the executable embeds the cubin");
            assert!(!exe.windows(23).any(|w| w == b"Generated by LLVM NVPTX"), "{model} stage {k}: no PTX left in the executable");
            assert_eq!(manifest["stages"][k]["device_code"], "cubin sm_90a");
        }
        // The same inputs give the same bytes, ptxas included (checked on
        // one fixture: a second compile of the other only costs test time).
        if model != "tiny-m3" {
            continue;
        }
        std::fs::create_dir(dir.path().join("again")).unwrap();
        let again = compile_cuda(&fixture(model), 2, &dir.path().join("again"), &["--emit", "ptx", "--no-cache"]);
        for f in ["stage-0", "stage-1", "stage-0.cubin", "manifest.json", "compile-report.txt"] {
            assert!(
                std::fs::read(out.join(f)).unwrap() == std::fs::read(again.join(f)).unwrap(),
                "{model}: {f} differs between two compiles"
            );
        }
    }
}

#[test]
fn real_config_compiles_for_cuda_at_pp4_without_weights() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let o = compile_cuda_to(&configs("minimax-m3-mxfp8.config.json"), 4, &out, &[configs("minimax-m3-mxfp8.pp4.yaml").to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let report = std::fs::read_to_string(out.join("compile-report.txt")).unwrap();
    // The MXFP8 linears of the real shapes are there, with no spills.
    assert!(report.contains("m3c_linear_i6144_o8192_mxfp8b32"), "{report}");
    for line in report.lines().skip(1) {
        let cols: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(cols[cols.len() - 2..], ["0", "0"], "spills: {line}");
    }
}

fn driver_present() -> bool {
    ["/usr/lib/x86_64-linux-gnu/libcuda.so.1", "/usr/lib64/libcuda.so.1", "/usr/lib/wsl/lib/libcuda.so.1"]
        .iter()
        .any(|p| Path::new(p).exists())
}

#[test]
fn a_cuda_stage_without_a_gpu_fails_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let model = fixture("tiny-m3");
    // f32 activations: the mode that reproduces the golden's tokens exactly.
    let out = compile_cuda(&model, 2, dir.path(), &["--activations", "f32"]);
    let golden = model.join("golden.safetensors");
    let prompt = ids_arg(&read_tensor_i64(&golden, "prompt_ids"));
    let o = m3c_tests::m3c_run(&out, &model, &["--prompt-ids", &prompt, "--max-new-tokens", "16"]);
    if driver_present() {
        // On a GPU machine: the fixture's tokens on the GPU (f32 activations).
        assert!(o.status.success(), "{}", stderr(&o));
        let want = ids_arg(&read_tensor_i64(&golden, "generated_ids"));
        assert!(stdout(&o).contains(&format!("prompt 0: {want}")), "{}", stdout(&o));
    } else {
        let e = m3c_tests::fails_with(&o, &["compiled for CUDA, but the NVIDIA driver (libcuda.so) is not on this machine"]);
        assert!(!e.contains("panicked"), "{e}");
    }
}

/// The other storage modes on the GPU (the pinned default is bf16
/// activations with f32 caches): `--kv-cache bf16 --activations f32` gives
/// the bf16 cache kernels over f32 activations, and every stage still
/// assembles for sm_90a; the manifest records both choices.
#[test]
fn f32_activations_and_bf16_kv_cache_stages_assemble_for_sm90a() {
    let dir = tempfile::tempdir().unwrap();
    let out = compile_cuda(&fixture("tiny-m3"), 2, dir.path(), &["--emit", "ptx", "--kv-cache", "bf16", "--activations", "f32"]);
    let manifest: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("manifest.json")).unwrap()).unwrap();
    assert_eq!((manifest["kv_cache"].as_str(), manifest["activations"].as_str()), (Some("bf16"), Some("f32")));
    for k in 0..2 {
        let ptx_file = out.join(format!("stage-{k}.ptx"));
        let ptx = std::fs::read_to_string(&ptx_file).unwrap();
        let list = entries(&ptx);
        assert!(list.iter().any(|e| e.starts_with("m3c_scatter_rows_w64_pg4_kvbf16 ")), "stage {k}: {list:?}");
        // (The vision tower's per-image attention, h4_kv4_d16 on stage 0, reads no cache.)
        let cached = |e: &&String| e.starts_with("m3c_attention_") && !e.starts_with("m3c_attention_h4_kv4_d16");
        assert!(list.iter().filter(cached).all(|e| e.contains("_kvbf16 ")), "stage {k}: {list:?}");
        assert!(!list.iter().any(|e| e.contains("_abf16")), "stage {k}: f32 activations: {list:?}");
        // With f32 activations the prefill GEMM path rounds x to bf16 first.
        assert!(list.iter().any(|e| e.starts_with("m3c_to_bf16_w128 ")), "stage {k}: {list:?}");
        // ptxas assembled it: the compile made the cubin it embeds.
        let cubin = std::fs::read(out.join(format!("stage-{k}.cubin"))).unwrap();
        assert_eq!(&cubin[..4], b"\x7fELF", "stage {k}: the cubin is an ELF");
    }
}
