//! The CUDA back end: a stage's GPU module (`gpu.func` kernels + the
//! launching entry) through MLIR's NVVM pipeline. Device code becomes PTX
//! for the chosen architecture (sm_90a first), embedded in the host module;
//! host code becomes the LLVM dialect, whose launches call the `mgpu*`
//! runtime ABI.

use super::BackendError;
use std::path::{Path, PathBuf};

/// What the CUDA back end makes of one stage.
pub struct CudaArtifacts {
    /// The PTX of the stage's `gpu.module`.
    pub ptx: String,
    /// The whole module after lowering (host code in the LLVM dialect, the
    /// device code as an embedded `gpu.binary`).
    pub lowered: String,
}

/// MLIR's `gpu-lower-to-nvvm-pipeline` as it expands for `arch`
/// (NVVM for device code, PTX via LLVM's NVPTX back end; the LLVM dialect
/// for host code), spelled out so that `gpu-module-to-binary` can be told
/// where the toolkit is: the built-in pipeline only finds libdevice through
/// the process environment, which worker threads must not change. A unit
/// test checks this is exactly the built-in expansion but for `toolkit`.
pub fn pipeline(arch: &str, toolkit: &Path) -> Result<String, BackendError> {
    let root = super::gpu_stage::option_path(toolkit).ok_or_else(|| {
        BackendError::Toolkit(format!(
            "{}: a CUDA toolkit path m3c can pass to MLIR must be UTF-8 without spaces, commas, quotes, braces or `=`; \
             link or copy the toolkit to such a path and set CUDA_ROOT to it",
            toolkit.display()
        ))
    })?;
    Ok(super::gpu_stage::pipeline(&super::gpu_stage::PipelineParts {
        before: "convert-nvgpu-to-nvvm,",
        after_cf: "convert-nvvm-to-llvm,",
        attach: &format!(
            "nvvm-attach-target{{O=3 chip={arch} fast=false features=+ptx80 ftz=false  module= ptxas-cmd-options= triple=nvptx64-nvidia-cuda}}"
        ),
        to_device: "convert-gpu-to-nvvm{allow-pattern-rollback=true  has-redux=false index-bitwidth=64 use-bare-ptr-memref-call-conv=false}",
        format: "isa",
        toolkit: root,
    }))
}

/// Where libdevice (and ptxas) come from: `$CUDA_ROOT`, else `/usr/local/cuda`.
pub fn cuda_root() -> Result<PathBuf, BackendError> {
    let candidates: Vec<PathBuf> =
        std::env::var_os("CUDA_ROOT").map(PathBuf::from).into_iter().chain([PathBuf::from("/usr/local/cuda")]).collect();
    for c in &candidates {
        if c.join("nvvm/libdevice/libdevice.10.bc").is_file() {
            return Ok(c.clone());
        }
    }
    Err(BackendError::Toolkit(format!(
        "libdevice not found (looked in {}); set CUDA_ROOT to a CUDA toolkit, or to the `nvidia/cuda_nvcc` folder of the \
         nvidia-cuda-nvcc-cu12 wheel (scripts/setup.sh installs it in .venv-cuda)",
        candidates.iter().map(|c| c.display().to_string()).collect::<Vec<_>>().join(", ")
    )))
}

/// `ptxas` of the toolkit at `root`, if present.
pub fn ptxas(root: &Path) -> Option<PathBuf> {
    let p = root.join("bin/ptxas");
    p.is_file().then_some(p)
}

/// Lowers one stage's GPU module for `arch` (e.g. `sm_90a`).
pub fn compile(mlir: &str, arch: &str) -> Result<CudaArtifacts, BackendError> {
    // libdevice (math functions) comes from the toolkit the pipeline names.
    let pipeline = pipeline(arch, &cuda_root()?)?;
    let lowered = super::gpu_stage::lower(mlir, &pipeline, "cuda")?;
    let ptx = extract_ptx(&lowered).ok_or_else(|| BackendError::Codegen("no PTX in the lowered module".into()))?;
    Ok(CudaArtifacts { ptx, lowered })
}

/// The lowered module with its `gpu.binary` object replaced by `cubin` (an
/// ELF for the same architecture, from ptxas): the stage then loads machine
/// code instead of PTX that the driver would JIT-compile at start-up, and
/// runs exactly the code the compile report describes. MLIR's translation
/// embeds a `bin` object and registers it with `mgpuModuleLoad`.
pub fn embed_cubin(lowered: &str, cubin: &[u8]) -> Option<String> {
    let key = "assembly = \"";
    let start = lowered.find(key)?;
    let end = start + key.len() + string_end(&lowered.as_bytes()[start + key.len()..])?;
    let mut out = String::with_capacity(lowered.len() + 3 * cubin.len());
    out.push_str(&lowered[..start]);
    out.push_str("bin = \"");
    for &b in cubin {
        if b.is_ascii_alphanumeric() {
            out.push(b as char);
        } else {
            out.push_str(&format!("\\{b:02X}"));
        }
    }
    out.push('"');
    out.push_str(&lowered[end + 1..]);
    Some(out)
}

/// Index of the closing quote of an MLIR string body (escapes skipped).
fn string_end(body: &[u8]) -> Option<usize> {
    let mut i = 0;
    while i < body.len() {
        match body[i] {
            b'"' => return Some(i),
            b'\\' => i += if body.get(i + 1).is_some_and(|c| c.is_ascii_hexdigit()) { 3 } else { 2 },
            _ => i += 1,
        }
    }
    None
}

/// The `assembly = "..."` string of the module's `gpu.binary`, unescaped.
fn extract_ptx(lowered: &str) -> Option<String> {
    String::from_utf8(super::gpu_stage::embedded_object(lowered, "assembly = \"")?).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use melior::pass::PassManager;
    use melior::utility::{parse_pass_pipeline, register_all_passes};

    /// The spelled-out pipeline is MLIR's own `gpu-lower-to-nvvm-pipeline`
    /// (with our options) pass for pass and option for option, but for
    /// the toolkit path: the same device code, without touching the
    /// process environment.
    #[test]
    fn the_pipeline_is_mlirs_nvvm_pipeline_with_the_toolkit_named() {
        static INIT: std::sync::Once = std::sync::Once::new();
        INIT.call_once(register_all_passes);
        let context = super::super::host::context();
        let printed = |text: &str| {
            let pm = PassManager::new(&context);
            parse_pass_pipeline(pm.as_operation_pass_manager(), text).unwrap_or_else(|e| panic!("{text}: {e}"));
            pm.as_operation_pass_manager().to_string()
        };
        let builtin =
            printed("builtin.module(gpu-lower-to-nvvm-pipeline{cubin-chip=sm_90a cubin-features=+ptx80 cubin-format=isa opt-level=3})");
        let ours = printed(&pipeline("sm_90a", Path::new("/opt/cuda-12.9")).unwrap());
        assert!(ours.contains("toolkit=/opt/cuda-12.9") && builtin.contains("toolkit=}"), "{ours}\n{builtin}");
        assert_eq!(ours.replace("toolkit=/opt/cuda-12.9", "toolkit="), builtin);
        for bad in ["/opt/my cuda", "/a,b", "/x}y", ""] {
            assert!(matches!(pipeline("sm_90a", Path::new(bad)), Err(BackendError::Toolkit(_))), "{bad:?}");
        }
    }
}
