//! The CUDA back end without a GPU: every stage's kernels lower to PTX for
//! sm_90a and ptxas assembles them.

use m3c::backend::cuda;
use m3c::plan::load_plan;
use m3c::source::ModelSource;
use m3c_tests::{configs, fixture, root};

/// The nvidia-cuda-nvcc wheel's toolkit folder that scripts/setup.sh installs.
pub fn cuda_root() -> std::path::PathBuf {
    let p = root().join(".venv-cuda/lib/python3.11/site-packages/nvidia/cuda_nvcc");
    assert!(p.join("bin/ptxas").is_file(), "{}: no ptxas; run scripts/setup.sh (it installs nvidia-cuda-nvcc-cu12 there)", p.display());
    p
}

#[test]
fn tiny_stages_lower_to_ptx_that_ptxas_assembles() {
    for model in ["tiny-m3", "tiny-m3-mxfp8"] {
        check_ptx(model);
    }
}

fn check_ptx(model: &str) {
    std::env::set_var("CUDA_ROOT", cuda_root());
    let src = ModelSource::open(&fixture(model)).unwrap();
    let plan = load_plan(&configs("tiny-m3.pp2.yaml"), Some(&src.config)).unwrap();
    let programs = m3c::compile::lower_all(&src.config, &plan).unwrap();
    let dir = tempfile::tempdir().unwrap();
    for p in &programs {
        let art = cuda::compile(&p.cuda_mlir, "sm_90a").unwrap_or_else(|e| panic!("stage {}: {e}", p.index));
        assert!(art.ptx.contains(".target sm_90a"));
        let f = dir.path().join(format!("s{}.ptx", p.index));
        std::fs::write(&f, &art.ptx).unwrap();
        let o = std::process::Command::new(cuda_root().join("bin/ptxas")).args(["-arch=sm_90a", "-o", "/dev/null"]).arg(&f).output().unwrap();
        assert!(o.status.success(), "ptxas: {}", String::from_utf8_lossy(&o.stderr));
    }
}
