//! One back end per target behind one trait: the stage module's flavour
//! (how its entry runs the kernels), device code, the host object and the
//! compile report. `lower` and `compile` ask the trait; neither tests which
//! target it is.

use super::{cuda, host, hsaco, ptx_report, rocm};
use crate::lower::FusedStage;
use anyhow::{Context, Result};
use m3c_contract::target::Target;
use m3c_kernels::{GpuTarget, HostWidth};
use std::path::Path;

/// A piece of a stage compiled on its own: a kernel, the entry, or a
/// GPU target's whole stage. Its code depends only on its name, its text,
/// the CPU and the back end's [`Backend::toolchain`], so the compile
/// compiles a unit that several stages share once and may take it from
/// the object cache.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Unit {
    /// A kernel's symbol, `entry`, or `stage-K` (GPU targets, whose report
    /// lines name the stage).
    pub name: String,
    /// The stage it belongs to, for a unit that only one stage has.
    pub stage: Option<usize>,
    pub mlir: String,
}

/// What a back end made of one unit.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct UnitCode {
    /// An object file (host code, any device code embedded).
    pub object: Vec<u8>,
    /// (file suffix, text) of the intermediate forms `--emit llvm` writes.
    pub emitted: Vec<(String, String)>,
    /// (file suffix, bytes) of the device code `--emit ptx` writes.
    pub device_files: Vec<(String, Vec<u8>)>,
    /// What the manifest says the executable embeds (GPU targets).
    pub device_code: Option<String>,
    /// Its lines of the compile report (GPU targets).
    pub report: String,
}

/// A target's back end.
pub trait Backend: Sync {
    /// A stage's MLIR module: its kernels and the step and vision entries
    /// as this target runs them (what `--emit mlir` writes).
    fn module(&self, fused: &FusedStage) -> Result<String, String>;
    /// The same stage as the units its code is compiled in; their objects,
    /// linked together, are the stage's code.
    fn units(&self, stage: usize, fused: &FusedStage) -> Result<Vec<Unit>, String>;
    /// Device code and the host object (for the x86-64 `cpu`) of one unit;
    /// `work` is a scratch folder.
    fn compile_unit(&self, unit: &Unit, cpu: &str, work: &Path) -> Result<UnitCode>;
    /// What a unit's code depends on besides its text, the CPU and m3c
    /// itself: the tools the back end runs, by content (part of the object
    /// cache's key).
    fn toolchain(&self) -> Result<String> {
        Ok(String::new())
    }
    /// The compile report's header, when the target reports per kernel.
    fn report_header(&self) -> Option<String> {
        None
    }
    /// Whether the target has device code for `--emit ptx` to write.
    fn has_device_code(&self) -> bool {
        false
    }
}

/// The back end of `target`, its host code for the x86-64 `cpu`.
pub fn backend(target: &Target, cpu: &str) -> Box<dyn Backend> {
    match target {
        Target::Host => Box::new(Host { width: HostWidth::of_lanes(super::widest_f32_lanes(cpu)) }),
        Target::Cuda { arch } => Box::new(Cuda { arch: arch.clone() }),
        Target::Rocm { arch } => Box::new(Rocm { chip: arch.clone() }),
    }
}

/// x86-64: the kernels are called from the entry on the CPU, generated
/// for its vector width (the same bits at either).
struct Host {
    width: HostWidth,
}

impl Backend for Host {
    fn module(&self, fused: &FusedStage) -> Result<String, String> {
        crate::lower::host_module(fused, self.width)
    }

    /// One unit per kernel and one for the entry: a kernel is compiled once
    /// however many stages, splits and compiles use it.
    fn units(&self, stage: usize, fused: &FusedStage) -> Result<Vec<Unit>, String> {
        let units = crate::lower::host_units(fused, self.width)?;
        Ok(units
            .into_iter()
            .map(|(name, mlir)| {
                let stage = (name == "entry").then_some(stage);
                Unit { name, stage, mlir }
            })
            .collect())
    }

    fn compile_unit(&self, unit: &Unit, cpu: &str, _work: &Path) -> Result<UnitCode> {
        // A kernel unit exports the kernel (and its C wrapper); the entry
        // unit the entries the runtime calls.
        let exports = match unit.stage {
            Some(_) => {
                use m3c_contract::stage::abi::{DRAFT_FIRST, DRAFT_NEXT};
                [crate::lower::ENTRY_SYMBOL, crate::lower::VISION_SYMBOL, DRAFT_FIRST, DRAFT_NEXT].map(String::from).to_vec()
            }
            None => vec![unit.name.clone(), format!("_mlir_ciface_{}", unit.name)],
        };
        let art = host::compile_unit(&unit.mlir, cpu, &exports).with_context(|| format!("{}: back end", unit_label(unit)))?;
        Ok(UnitCode {
            object: art.object,
            emitted: vec![(".llvm.mlir".into(), art.llvm_dialect), (".ll".into(), art.llvm_ir)],
            ..UnitCode::default()
        })
    }
}

/// How errors name a unit: `stage 1` for a stage's own, else the kernel.
fn unit_label(unit: &Unit) -> String {
    match unit.stage {
        Some(k) => format!("stage {k}"),
        None => format!("kernel {}", unit.name),
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

    /// The whole stage is one unit: its kernels are one `gpu.module`, one
    /// PTX file and one cubin.
    fn units(&self, stage: usize, fused: &FusedStage) -> Result<Vec<Unit>, String> {
        Ok(vec![Unit { name: format!("stage-{stage}"), stage: Some(stage), mlir: self.module(fused)? }])
    }

    fn compile_unit(&self, unit: &Unit, cpu: &str, work: &Path) -> Result<UnitCode> {
        let stage = unit.stage.context("a CUDA unit is a stage")?;
        let ctx = || format!("stage {stage}: back end");
        let gpu = cuda::compile(&unit.mlir, &self.arch).with_context(ctx)?;
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
        Ok(UnitCode {
            object: art.object,
            emitted: vec![(".llvm.mlir".into(), art.llvm_dialect), (".ll".into(), art.llvm_ir)],
            device_files,
            device_code: Some(device_code),
            report: asm.report,
        })
    }

    /// libdevice (linked into the PTX) and ptxas (which makes the cubin
    /// and the report), by content.
    fn toolchain(&self) -> Result<String> {
        let root = cuda::cuda_root()?;
        let libdevice = root.join("nvvm/libdevice/libdevice.10.bc");
        let mut parts = vec![format!("libdevice {}", file_sha(&libdevice)?)];
        match cuda::ptxas(&root) {
            Some(p) => parts.push(format!("ptxas {}", file_sha(&p)?)),
            None => parts.push("no ptxas".into()),
        }
        Ok(parts.join("; "))
    }

    fn report_header(&self) -> Option<String> {
        Some(ptx_report::header())
    }

    fn has_device_code(&self) -> bool {
        true
    }
}

/// AMD GPUs: `gpu.func` kernels through ROCDL to one code object per stage
/// (checked as it is made: see [`hsaco::check`]), launched by the entry
/// through the same `mgpu*` ABI as CUDA's.
struct Rocm {
    chip: String,
}

impl Backend for Rocm {
    /// The stage's module, refused if it still holds an op that ROCDL
    /// lowers to a call into ROCm's device library (which the compile does
    /// not link): a shape the generators do not write out, named here
    /// instead of as a missing-library error from MLIR's serializer.
    fn module(&self, fused: &FusedStage) -> Result<String, String> {
        let text = crate::lower::gpu_module(fused, &GpuTarget::rocm(&self.chip))?;
        let mut library = std::iter::once(&"gpu.all_reduce").chain(m3c_kernels::devmath::EXPANDED);
        match library.find(|op| text.contains(&format!("{op} "))) {
            Some(op) => Err(format!(
                "the rocm stage module still has `{op}`, which ROCm lowers to a device-library call m3c does not link \
                 (a compiler bug: a shape the kernel generators do not write out for rocm)"
            )),
            None => Ok(text),
        }
    }

    /// The whole stage is one unit: its kernels are one `gpu.module` and
    /// one code object.
    fn units(&self, stage: usize, fused: &FusedStage) -> Result<Vec<Unit>, String> {
        Ok(vec![Unit { name: format!("stage-{stage}"), stage: Some(stage), mlir: self.module(fused)? }])
    }

    fn compile_unit(&self, unit: &Unit, cpu: &str, work: &Path) -> Result<UnitCode> {
        let stage = unit.stage.context("a ROCm unit is a stage")?;
        let ctx = || format!("stage {stage}: back end");
        let gpu = rocm::compile(&unit.mlir, &self.chip, work).with_context(ctx)?;
        let kernels = hsaco::check(&gpu.hsaco, &self.chip).with_context(|| format!("stage {stage}: the code object m3c made"))?;
        let art = host::object_from_lowered(&gpu.lowered, cpu).with_context(ctx)?;
        Ok(UnitCode {
            object: art.object,
            emitted: vec![(".llvm.mlir".into(), art.llvm_dialect), (".ll".into(), art.llvm_ir)],
            device_files: vec![(".hsaco".to_string(), gpu.hsaco)],
            device_code: Some(format!("hsaco {} (code object v5)", self.chip)),
            report: hsaco::report(stage, &kernels),
        })
    }

    /// `ld.lld`, which links the code object, by content.
    fn toolchain(&self) -> Result<String> {
        Ok(format!("ld.lld {}", file_sha(&rocm::lld()?)?))
    }

    /// The kernels' figures from the code object, under a line saying what
    /// a user of another vendor's GEMM would look for.
    fn report_header(&self) -> Option<String> {
        Some(format!(
            "# rocm {}: no GEMM library yet (hipBLASLt is planned): every linear runs m3c's own kernels at every row count\n{}",
            self.chip,
            hsaco::header()
        ))
    }

    fn has_device_code(&self) -> bool {
        true
    }
}

fn file_sha(p: &Path) -> Result<String> {
    let bytes = std::fs::read(p).with_context(|| format!("cannot read {}", p.display()))?;
    Ok(m3c_contract::manifest::sha256_hex(&bytes))
}
