//! One back end per target behind one trait: the stage module's flavour
//! (how its entry runs the kernels), device code, the host object and the
//! compile report. `lower` and `compile` ask the trait; neither tests which
//! target it is.

use super::{cuda, host, ptx_report};
use crate::lower::FusedStage;
use anyhow::{Context, Result};
use m3c_contract::target::Target;
use m3c_kernels::GpuTarget;
use std::path::Path;

/// What a back end made of one stage.
pub struct StageCode {
    /// The stage's object file (host code, any device code embedded).
    pub object: Vec<u8>,
    /// (file suffix, text) of the intermediate forms `--emit llvm` writes.
    pub emitted: Vec<(String, String)>,
    /// (file suffix, bytes) of the device code `--emit ptx` writes.
    pub device_files: Vec<(String, Vec<u8>)>,
    /// What the manifest says the executable embeds (GPU targets).
    pub device_code: Option<String>,
    /// The stage's lines of the compile report (GPU targets).
    pub report: String,
}

/// A target's back end.
pub trait Backend: Sync {
    /// A stage's MLIR module: its kernels and the step and vision entries
    /// as this target runs them.
    fn module(&self, fused: &FusedStage) -> Result<String, String>;
    /// Device code and the host object (for the x86-64 `cpu`) of stage
    /// `stage` from its module (metadata globals included); `work` is a
    /// scratch folder.
    fn compile_stage(&self, stage: usize, module: &str, cpu: &str, work: &Path) -> Result<StageCode>;
    /// The compile report's header, when the target reports per kernel.
    fn report_header(&self) -> Option<String> {
        None
    }
    /// Whether the target has device code for `--emit ptx` to write.
    fn has_device_code(&self) -> bool {
        false
    }
}

/// The back end of `target`.
pub fn backend(target: &Target) -> Box<dyn Backend> {
    match target {
        Target::Host => Box::new(Host),
        Target::Cuda { arch } => Box::new(Cuda { arch: arch.clone() }),
    }
}

/// x86-64: the kernels are called from the entry on the CPU.
struct Host;

impl Backend for Host {
    fn module(&self, fused: &FusedStage) -> Result<String, String> {
        crate::lower::host_module(fused)
    }

    fn compile_stage(&self, stage: usize, module: &str, cpu: &str, _work: &Path) -> Result<StageCode> {
        let art = host::compile(module, cpu).with_context(|| format!("stage {stage}: back end"))?;
        Ok(StageCode {
            object: art.object,
            emitted: vec![(".llvm.mlir".into(), art.llvm_dialect), (".ll".into(), art.llvm_ir)],
            device_files: Vec::new(),
            device_code: None,
            report: String::new(),
        })
    }
}

/// NVIDIA GPUs: `gpu.func` kernels through NVVM to PTX, assembled by ptxas
/// when it is there (the cubin is embedded instead of the PTX), launched by
/// the entry through MLIR's `mgpu*` ABI.
struct Cuda {
    arch: String,
}

impl Backend for Cuda {
    fn module(&self, fused: &FusedStage) -> Result<String, String> {
        crate::lower::gpu_module(fused, &GpuTarget::CUDA)
    }

    fn compile_stage(&self, stage: usize, module: &str, cpu: &str, work: &Path) -> Result<StageCode> {
        let ctx = || format!("stage {stage}: back end");
        let gpu = cuda::compile(module, &self.arch).with_context(ctx)?;
        let asm = ptx_report::assemble(stage, &gpu.ptx, work)?;
        let lowered = match &asm.cubin {
            Some(cubin) => cuda::embed_cubin(&gpu.lowered, cubin)
                .with_context(|| format!("stage {stage}: no device object in the lowered module to replace with the cubin"))?,
            None => gpu.lowered,
        };
        let art = host::object_from_lowered(&lowered, cpu).with_context(ctx)?;
        let arch = &self.arch;
        let device_code =
            if asm.cubin.is_some() { format!("cubin {arch}") } else { format!("ptx {arch} (JIT-compiled by the driver at start-up)") };
        let mut device_files = vec![(".ptx".to_string(), gpu.ptx.into_bytes())];
        device_files.extend(asm.cubin.map(|c| (".cubin".to_string(), c)));
        Ok(StageCode {
            object: art.object,
            emitted: vec![(".llvm.mlir".into(), art.llvm_dialect), (".ll".into(), art.llvm_ir)],
            device_files,
            device_code: Some(device_code),
            report: asm.report,
        })
    }

    fn report_header(&self) -> Option<String> {
        Some(ptx_report::header())
    }

    fn has_device_code(&self) -> bool {
        true
    }
}
