//! The ROCm back end: a stage's GPU module (`gpu.func` kernels + the
//! launching entry) through MLIR's ROCDL conversion. Device code becomes one
//! AMDGPU code object (HSACO, code object v5) for the chosen chip, embedded
//! in the host module; host code becomes the LLVM dialect, whose launches
//! call the same `mgpu*` runtime ABI as CUDA's.
//!
//! Nothing from AMD is needed to compile: LLVM's AMDGPU back end is part of
//! the LLVM m3c links, the kernels call no device library (the generators
//! write their few math functions out for this target, see
//! `m3c_kernels::DeviceMath`), and the code object is linked by LLVM's
//! `ld.lld`.

use super::BackendError;
use std::path::{Path, PathBuf};

/// What the ROCm back end makes of one stage.
pub struct RocmArtifacts {
    /// The stage's code object: an AMDGPU ELF shared object.
    pub hsaco: Vec<u8>,
    /// The whole module after lowering (host code in the LLVM dialect, the
    /// code object embedded in a `gpu.binary`).
    pub lowered: String,
}

/// The pass pipeline for `chip`, linking with the `ld.lld` under `toolkit`:
/// the shape of MLIR's NVVM pipeline (see `cuda.rs`) with ROCDL in NVVM's
/// place. There is no built-in ROCDL pipeline.
///
/// The target's math flags keep IEEE semantics (no fast or finite-only math,
/// correctly rounded sqrt, denormals kept), as on the host and CUDA.
/// `abi=500` asks for code object v5 (LLVM 22 defaults to v6, which the
/// ROCm 6 runtimes users have cannot load). `gpu-module-to-binary` runs
/// `TOOLKIT/llvm/bin/ld.lld`; `toolkit` names a folder laid out so.
pub fn pipeline(chip: &str, toolkit: &Path) -> Result<String, BackendError> {
    let root = super::gpu_stage::option_path(toolkit).ok_or_else(|| {
        BackendError::Toolkit(format!(
            "{}: a scratch folder m3c can pass to MLIR must be UTF-8 without spaces, commas, quotes, braces or `=`; set TMPDIR to such a folder",
            toolkit.display()
        ))
    })?;
    Ok(super::gpu_stage::pipeline(&super::gpu_stage::PipelineParts {
        before: "",
        after_cf: "",
        attach: &format!(
            "rocdl-attach-target{{O=3 abi=500 chip={chip} correct-sqrt=true daz=false fast=false features= finite-only=false module= \
             triple=amdgcn-amd-amdhsa wave64=true}}"
        ),
        to_device: &format!("convert-gpu-to-rocdl{{chipset={chip} index-bitwidth=64 runtime=HIP use-bare-ptr-memref-call-conv=false}}"),
        format: "bin",
        toolkit: root,
    }))
}

/// LLVM's `ld.lld`, which links the code object: `$M3C_LLD`, else
/// `ld.lld-22` or `ld.lld` on PATH, else Debian's `/usr/lib/llvm-22/bin`.
pub fn lld() -> Result<PathBuf, BackendError> {
    if let Some(p) = std::env::var_os("M3C_LLD") {
        let p = PathBuf::from(p);
        return if p.is_file() {
            Ok(p)
        } else {
            Err(BackendError::Toolkit(format!("M3C_LLD={}: no such file (it should name LLVM's ld.lld)", p.display())))
        };
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    let on_path = ["ld.lld-22", "ld.lld"].into_iter().find_map(|n| std::env::split_paths(&path).map(|d| d.join(n)).find(|p| p.is_file()));
    on_path.or_else(|| Some(PathBuf::from("/usr/lib/llvm-22/bin/ld.lld")).filter(|p| p.is_file())).ok_or_else(|| {
        BackendError::Toolkit(
            "LLVM's ld.lld (which links AMDGPU code objects) not found: install lld-22 (scripts/setup.sh does), or set M3C_LLD to it"
                .into(),
        )
    })
}

/// A folder under `work` laid out as MLIR's ROCDL serializer expects a ROCm
/// install to be (`llvm/bin/ld.lld`), holding only a link to `lld`: MLIR
/// finds the linker there and no device library, which the kernels do not
/// call.
fn toolkit_folder(work: &Path, lld: &Path) -> Result<PathBuf, BackendError> {
    let root = work.join("rocm-toolkit");
    let bin = root.join("llvm/bin");
    let err = |e: std::io::Error| BackendError::Toolkit(format!("{}: {e}", bin.display()));
    std::fs::create_dir_all(&bin).map_err(err)?;
    // Stages compile on parallel threads with one scratch folder: the
    // first makes the link, the others find it.
    match std::os::unix::fs::symlink(lld, bin.join("ld.lld")) {
        Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => Err(err(e)),
        _ => Ok(root),
    }
}

/// Lowers one stage's GPU module for `chip` (e.g. `gfx942`); `work` is a
/// scratch folder.
pub fn compile(mlir: &str, chip: &str, work: &Path) -> Result<RocmArtifacts, BackendError> {
    let toolkit = toolkit_folder(work, &lld()?)?;
    let pipeline = pipeline(chip, &toolkit)?;
    let lowered = super::gpu_stage::lower(mlir, &pipeline, "rocm")?;
    let hsaco = super::gpu_stage::embedded_object(&lowered, "bin = \"")
        .ok_or_else(|| BackendError::Codegen("no code object in the lowered module".into()))?;
    Ok(RocmArtifacts { hsaco, lowered })
}
