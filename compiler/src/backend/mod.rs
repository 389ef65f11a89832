//! Back ends: MLIR modules of kernels in, target code out. Everything
//! target-specific lives here, at the end of the pipeline.
//!
//! One trait, [`Backend`] (`target.rs`): `host` (LLVM → x86-64 object),
//! `cuda` (NVVM → PTX, assembled by ptxas when present; `ptx_report`),
//! `rocm` (ROCDL → an AMDGPU code object, checked by `hsaco`), and what the
//! GPU back ends share (`gpu_stage`). `--cpu native` is resolved to LLVM's
//! name for this machine's CPU ([`resolve_cpu`]) before anything keys on it,
//! so caches and manifests name a CPU, never a machine.

pub mod cuda;
mod gpu_stage;
pub mod host;
pub mod hsaco;
mod llvm_fatal;
pub mod ptx_report;
pub mod rocm;
mod target;

pub use llvm_fatal::install_llvm_fatal_handler;
pub use target::{backend, Backend, Unit, UnitCode};

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("generated MLIR does not parse (a compiler bug); first lines:\n{head}")]
    Parse { head: String },
    #[error("MLIR pass pipeline `{pipeline}` failed: {message}")]
    Passes { pipeline: String, message: String },
    #[error("translating to LLVM IR failed")]
    Translate,
    #[error("LLVM code generation failed: {0}")]
    Codegen(String),
    #[error("toolchain: {0}")]
    Toolkit(String),
    #[error(
        "--cpu {0}: not an x86-64 CPU LLVM knows; use x86-64 (any x86-64), x86-64-v2/v3/v4, or a name such as znver4 or sapphirerapids"
    )]
    Cpu(String),
    #[error("--cpu native: LLVM names this machine's CPU `{0}`, which is not an x86-64 CPU it compiles for; give a level (x86-64-v3, x86-64-v4) or the CPU's name")]
    NativeCpu(String),
}

/// The x86-64 CPUs LLVM 22 emits 64-bit code for (`llc -mcpu=help`, less
/// the 32-bit-only ones such as i686, for which LLVM aborts the process).
pub const X86_64_CPUS: &[&str] = &[
    "alderlake",
    "amdfam10",
    "arrowlake",
    "arrowlake-s",
    "arrowlake_s",
    "athlon-fx",
    "athlon64",
    "athlon64-sse3",
    "atom",
    "atom_sse4_2",
    "atom_sse4_2_movbe",
    "barcelona",
    "bdver1",
    "bdver2",
    "bdver3",
    "bdver4",
    "bonnell",
    "broadwell",
    "btver1",
    "btver2",
    "cannonlake",
    "cascadelake",
    "clearwaterforest",
    "cooperlake",
    "core-avx-i",
    "core-avx2",
    "core2",
    "core_2_duo_sse4_1",
    "core_2_duo_ssse3",
    "core_2nd_gen_avx",
    "core_3rd_gen_avx",
    "core_4th_gen_avx",
    "core_4th_gen_avx_tsx",
    "core_5th_gen_avx",
    "core_5th_gen_avx_tsx",
    "core_aes_pclmulqdq",
    "core_i7_sse4_2",
    "corei7",
    "corei7-avx",
    "diamondrapids",
    "emeraldrapids",
    "generic",
    "goldmont",
    "goldmont-plus",
    "goldmont_plus",
    "gracemont",
    "grandridge",
    "graniterapids",
    "graniterapids-d",
    "graniterapids_d",
    "haswell",
    "icelake-client",
    "icelake-server",
    "icelake_client",
    "icelake_server",
    "ivybridge",
    "k8",
    "k8-sse3",
    "knl",
    "knm",
    "lunarlake",
    "meteorlake",
    "mic_avx512",
    "nehalem",
    "nocona",
    "novalake",
    "opteron",
    "opteron-sse3",
    "pantherlake",
    "penryn",
    "raptorlake",
    "rocketlake",
    "sandybridge",
    "sapphirerapids",
    "sierraforest",
    "silvermont",
    "skx",
    "skylake",
    "skylake-avx512",
    "skylake_avx512",
    "slm",
    "tigerlake",
    "tremont",
    "westmere",
    "wildcatlake",
    "x86-64",
    "x86-64-v2",
    "x86-64-v3",
    "x86-64-v4",
    "znver1",
    "znver2",
    "znver3",
    "znver4",
    "znver5",
];

/// The CPUs of [`X86_64_CPUS`] with AVX-512 (LLVM's `FeatureAVX512` in
/// their processor definitions): 16 f32 lanes a vector, 32 registers.
const AVX512_CPUS: &[&str] = &[
    "cannonlake",
    "cascadelake",
    "cooperlake",
    "diamondrapids",
    "emeraldrapids",
    "graniterapids",
    "graniterapids-d",
    "icelake-client",
    "icelake-server",
    "knl",
    "knm",
    "rocketlake",
    "sapphirerapids",
    "skx",
    "skylake-avx512",
    "skylake_avx512",
    "tigerlake",
    "x86-64-v4",
    "znver4",
    "znver5",
];

/// The widest f32 vector code compiled for `cpu` may use, in lanes: 16
/// with AVX-512, else 8 (AVX2 and the portable levels alike, which the
/// kernels' 8-lane vectors fit or split).
pub fn widest_f32_lanes(cpu: &str) -> usize {
    if AVX512_CPUS.contains(&cpu) {
        16
    } else {
        8
    }
}

/// `--cpu native`: the CPU this command runs on, by LLVM's name for it
/// (`znver4`, `sapphirerapids`, ...), so that the object cache, the
/// manifest and every later build name the CPU, not the machine, and the
/// same inputs give the same bytes on any machine of that CPU. Any other
/// name is returned as given (checked by [`check_cpu`]).
pub fn resolve_cpu(cpu: &str) -> Result<String, BackendError> {
    if cpu != "native" {
        return Ok(cpu.to_string());
    }
    let host = inkwell::targets::TargetMachine::get_host_cpu_name().to_string();
    if X86_64_CPUS.contains(&host.as_str()) {
        Ok(host)
    } else {
        Err(BackendError::NativeCpu(host.chars().take(40).collect()))
    }
}

/// The x86-64 features host code compiled for `cpu` may use, as far as
/// m3c can tell (`m3c_contract::cpu`): a psABI level's list, or for this
/// machine's own CPU (what `--cpu native` names) what it reports; another
/// named CPU gives none, and its stages are not checked.
pub fn cpu_features(cpu: &str) -> Vec<String> {
    if let Some(f) = m3c_contract::cpu::level_features(cpu) {
        return f;
    }
    if inkwell::targets::TargetMachine::get_host_cpu_name().to_str() != Ok(cpu) {
        return Vec::new();
    }
    m3c_contract::cpu::checked(&inkwell::targets::TargetMachine::get_host_cpu_features().to_string())
}

/// Checks `--cpu` before LLVM sees it: an unknown or 32-bit CPU makes LLVM
/// abort the whole process instead of returning an error.
pub fn check_cpu(cpu: &str) -> Result<(), BackendError> {
    if X86_64_CPUS.contains(&cpu) {
        Ok(())
    } else {
        Err(BackendError::Cpu(cpu.chars().take(40).collect()))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_avx512_cpu_is_one_llvm_knows() {
        for c in super::AVX512_CPUS {
            assert!(super::X86_64_CPUS.contains(c), "{c}");
        }
        assert_eq!(super::widest_f32_lanes("znver4"), 16);
        assert_eq!(super::widest_f32_lanes("x86-64-v3"), 8);
    }

    #[test]
    fn native_is_this_machines_cpu_by_name_and_other_names_pass_as_given() {
        let native = super::resolve_cpu("native").expect("an x86-64 CPU LLVM knows");
        assert!(super::X86_64_CPUS.contains(&native.as_str()) && native != "native", "{native}");
        assert_eq!(super::resolve_cpu("x86-64-v3").unwrap(), "x86-64-v3");
        // This machine's CPU: what it reports (at least SSE3, as every
        // x86-64 LLVM names a CPU for has).
        assert!(super::cpu_features(&native).iter().any(|f| f == "sse3"), "{:?}", super::cpu_features(&native));
        assert_eq!(super::cpu_features("x86-64-v3").len(), 13);
    }
}
