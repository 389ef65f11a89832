//! The host back end: kernels in MLIR → LLVM dialect → LLVM IR → x86-64
//! object, through melior (MLIR) and inkwell (LLVM) linked into one binary.

use super::BackendError;
use inkwell::targets::{CodeModel, FileType, InitializationConfig, RelocMode, Target, TargetTriple};
use inkwell::OptimizationLevel;
use melior::dialect::DialectRegistry;
use melior::ir::operation::OperationLike;
use melior::ir::Module;
use melior::pass::PassManager;
use melior::utility::{parse_pass_pipeline, register_all_dialects, register_all_llvm_translations, register_all_passes};
use melior::Context;

/// From target-neutral kernels to the LLVM dialect.
/// `scf.parallel` loops become OpenMP work-sharing loops (static schedule:
/// each iteration runs the same code on exactly one thread, so results do not
/// depend on the thread count). The pass wraps loop bodies in
/// `memref.alloca_scope`, which is only valid again once the memref lowering
/// has run, so the pipeline verifies at the end, not after every pass.
pub const HOST_PIPELINE: &str = "builtin.module(convert-scf-to-openmp, convert-scf-to-cf, convert-cf-to-llvm, expand-strided-metadata, \
lower-affine, convert-vector-to-llvm, finalize-memref-to-llvm, convert-math-to-llvm, convert-arith-to-llvm, convert-index-to-llvm, \
convert-openmp-to-llvm, convert-func-to-llvm, reconcile-unrealized-casts)";

pub const HOST_TRIPLE: &str = "x86_64-unknown-linux-gnu";

/// What the host back end makes of one module.
pub struct HostArtifacts {
    /// The module after lowering to the LLVM dialect.
    pub llvm_dialect: String,
    /// The LLVM IR it translates to.
    pub llvm_ir: String,
    /// An x86-64 ELF object.
    pub object: Vec<u8>,
}

/// An MLIR context with every dialect and LLVM translation registered.
pub(crate) fn context() -> Context {
    let registry = DialectRegistry::new();
    register_all_dialects(&registry);
    let context = Context::new();
    context.append_dialect_registry(&registry);
    context.load_all_available_dialects();
    register_all_llvm_translations(&context);
    context
}

/// Parses `mlir` and runs `pipeline` on it; returns the resulting module text.
pub fn run_pipeline(mlir: &str, pipeline: &str) -> Result<String, BackendError> {
    let context = context();
    let mut module = parse(&context, mlir)?;
    run(&context, &mut module, pipeline)?;
    Ok(module.as_operation().to_string())
}

pub(crate) fn parse<'c>(context: &'c Context, mlir: &str) -> Result<Module<'c>, BackendError> {
    Module::parse(context, mlir).ok_or_else(|| BackendError::Parse { head: mlir.lines().take(12).collect::<Vec<_>>().join("\n") })
}

/// Process-wide LLVM/MLIR registrations, done once (stages compile on several threads).
pub(crate) fn init_once() {
    static INIT: std::sync::Once = std::sync::Once::new();
    INIT.call_once(|| {
        register_all_passes();
        Target::initialize_x86(&InitializationConfig::default());
    });
}

fn run(context: &Context, module: &mut Module, pipeline: &str) -> Result<(), BackendError> {
    init_once();
    let pm = PassManager::new(context);
    pm.enable_verifier(false);
    let err = |e: melior::Error| BackendError::Passes { pipeline: pipeline.to_string(), message: e.to_string() };
    parse_pass_pipeline(pm.as_operation_pass_manager(), pipeline).map_err(err)?;
    pm.run(module).map_err(err)?;
    if !module.as_operation().verify() {
        return Err(BackendError::Passes { pipeline: pipeline.to_string(), message: "the lowered module does not verify".into() });
    }
    Ok(())
}

/// Lowers a module of kernels to an x86-64 object. `cpu` is the LLVM CPU
/// name (`x86-64-v3` by default for AVX2 machines; `x86-64` is portable).
pub fn compile(mlir: &str, cpu: &str) -> Result<HostArtifacts, BackendError> {
    let context = context();
    let mut module = parse(&context, mlir)?;
    run(&context, &mut module, HOST_PIPELINE)?;
    object(&module, cpu, None)
}

/// [`compile`] for one unit of a stage: only the functions in `exports`
/// keep external linkage. MLIR lowers private `func.func`s (view helpers,
/// linear tiles) to external LLVM functions, which would clash when the
/// units that each carry a copy are linked together.
pub fn compile_unit(mlir: &str, cpu: &str, exports: &[String]) -> Result<HostArtifacts, BackendError> {
    let context = context();
    let mut module = parse(&context, mlir)?;
    run(&context, &mut module, HOST_PIPELINE)?;
    object(&module, cpu, Some(exports))
}

/// Translates `lowered` (a module already in the LLVM dialect, possibly with
/// embedded GPU binaries) to LLVM IR and an x86-64 object for `cpu`.
pub fn object_from_lowered(lowered: &str, cpu: &str) -> Result<HostArtifacts, BackendError> {
    let context = context();
    let module = parse(&context, lowered)?;
    object(&module, cpu, None)
}

/// The object of a module in the LLVM dialect; with `exports`, every other
/// defined function becomes internal.
fn object(module: &Module, cpu: &str, exports: Option<&[String]>) -> Result<HostArtifacts, BackendError> {
    let llvm_dialect = module.as_operation().to_string();
    init_once();
    let llvm = inkwell::context::Context::create();
    // SAFETY: the LLVM context outlives the module made in it (both live to
    // the end of this function), and mlir-sys and inkwell link the same LLVM.
    let raw = unsafe { mlir_sys::mlirTranslateModuleToLLVMIR(module.as_operation().to_raw(), llvm.raw() as mlir_sys::LLVMContextRef) };
    if raw.is_null() {
        return Err(BackendError::Translate);
    }
    // SAFETY: `raw` is the non-null module just translated into `llvm`'s context, which outlives it; inkwell takes ownership.
    let llvm_module = unsafe { inkwell::module::Module::new(raw as inkwell::llvm_sys::prelude::LLVMModuleRef) };
    if let Some(exports) = exports {
        for f in llvm_module.get_functions() {
            let exported = f.get_name().to_str().is_ok_and(|n| exports.iter().any(|e| e == n));
            if f.count_basic_blocks() > 0 && !exported {
                f.set_linkage(inkwell::module::Linkage::Internal);
            }
        }
    }
    let triple = TargetTriple::create(HOST_TRIPLE);
    llvm_module.set_triple(&triple);
    let target = Target::from_triple(&triple).map_err(|e| BackendError::Codegen(e.to_string()))?;
    let machine = target
        .create_target_machine(&triple, cpu, "", OptimizationLevel::Aggressive, RelocMode::PIC, CodeModel::Default)
        .ok_or_else(|| BackendError::Codegen(format!("no target machine for {HOST_TRIPLE} / {cpu}")))?;
    llvm_module.set_data_layout(&machine.get_target_data().get_data_layout());
    let passes = inkwell::passes::PassBuilderOptions::create();
    llvm_module.run_passes("default<O3>", &machine, passes).map_err(|e| BackendError::Codegen(e.to_string()))?;
    let llvm_ir = llvm_module.print_to_string().to_string();
    let object = machine
        .write_to_memory_buffer(&llvm_module, FileType::Object)
        .map_err(|e| BackendError::Codegen(e.to_string()))?
        .as_slice()
        .to_vec();
    Ok(HostArtifacts { llvm_dialect, llvm_ir, object })
}
