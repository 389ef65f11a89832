//! The CUDA back end: a stage's GPU module (`gpu.func` kernels + the
//! launching entry) through MLIR's NVVM pipeline. Device code becomes PTX
//! for the chosen architecture (sm_90a first), embedded in the host module;
//! host code becomes the LLVM dialect, whose launches call the `mgpu*`
//! runtime ABI.

use super::BackendError;
use melior::ir::operation::OperationLike;
use melior::ir::Module;
use melior::pass::PassManager;
use melior::utility::{parse_pass_pipeline, register_all_passes};
use std::path::{Path, PathBuf};

/// What the CUDA back end makes of one stage.
pub struct CudaArtifacts {
    /// The PTX of the stage's `gpu.module`.
    pub ptx: String,
    /// The whole module after lowering (host code in the LLVM dialect, the
    /// device code as an embedded `gpu.binary`).
    pub lowered: String,
}

/// The pipeline: NVVM for device code (PTX via LLVM's NVPTX back end), LLVM
/// dialect for host code.
pub fn pipeline(arch: &str) -> String {
    format!("builtin.module(gpu-lower-to-nvvm-pipeline{{cubin-chip={arch} cubin-features=+ptx80 cubin-format=isa opt-level=3}})")
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
    let root = cuda_root()?;
    // MLIR's NVVM target reads CUDA_ROOT to find libdevice (math functions).
    std::env::set_var("CUDA_ROOT", &root);
    static INIT: std::sync::Once = std::sync::Once::new();
    INIT.call_once(register_all_passes);
    if let Some(d) = std::env::var_os("M3C_DUMP_DIR") {
        // Debugging aid: the module as generated (also when it does not parse).
        let _ = std::fs::write(Path::new(&d).join("cuda-in.mlir"), mlir);
    }
    let context = super::host::context();
    let mut module =
        Module::parse(&context, mlir).ok_or_else(|| BackendError::Parse { head: mlir.lines().take(12).collect::<Vec<_>>().join("\n") })?;
    let pipeline = pipeline(arch);
    let pm = PassManager::new(&context);
    pm.enable_verifier(true);
    let err = |e: melior::Error| BackendError::Passes { pipeline: pipeline.clone(), message: e.to_string() };
    parse_pass_pipeline(pm.as_operation_pass_manager(), &pipeline).map_err(err)?;
    pm.run(&mut module).map_err(err)?;
    if !module.as_operation().verify() {
        return Err(BackendError::Passes { pipeline, message: "the lowered module does not verify".into() });
    }
    let lowered = module.as_operation().to_string();
    if let Some(d) = std::env::var_os("M3C_DUMP_DIR") {
        // Debugging aid: the module after the NVVM pipeline.
        let _ = std::fs::write(Path::new(&d).join("cuda-lowered.mlir"), &lowered);
    }
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
    let start = lowered.find("assembly = \"")? + "assembly = \"".len();
    let bytes = lowered.as_bytes();
    let mut out = Vec::new();
    let mut i = start;
    while i < bytes.len() {
        match bytes[i] {
            b'"' => return String::from_utf8(out).ok(),
            b'\\' if i + 2 < bytes.len() + 1 => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).ok()?;
                match u8::from_str_radix(hex, 16) {
                    Ok(b) => {
                        out.push(b);
                        i += 3;
                    }
                    Err(_) => {
                        // `\\` or `\"`
                        out.push(bytes[i + 1]);
                        i += 2;
                    }
                }
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    None
}
