//! m3c's kernel generators. Each [`Kernel`] is one fused operation at one
//! shape; [`Kernel::mlir`] writes it as an MLIR `func.func` over memrefs in
//! target-neutral dialects (`scf`, `arith`, `math`, `memref`), which the
//! compiler's back ends lower for the host (LLVM) or for GPUs.
//!
//! This crate knows shapes and arithmetic, never files or weights: weights
//! arrive as memref arguments at run time.

mod elementwise;
mod emit;
mod linear;
mod norm;
mod rope;

use std::fmt;

/// The value of a `float8_e4m3fn` byte: the table MXFP8 kernels decode with.
pub use emit::fp8_e4m3_value;

/// How a weight operand is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum WeightType {
    F32,
    BF16,
    F16,
    /// `float8_e4m3fn` elements with one E8M0 (`uint8`) scale per 1×`block` input block.
    Mxfp8 { block: usize },
}

impl WeightType {
    /// The MLIR element type of the weight memref.
    pub fn mlir_elem(self) -> &'static str {
        match self {
            WeightType::F32 => "f32",
            WeightType::BF16 => "bf16",
            WeightType::F16 => "f16",
            WeightType::Mxfp8 { .. } => "i8",
        }
    }
    fn tag(self) -> String {
        match self {
            WeightType::F32 => "f32".into(),
            WeightType::BF16 => "bf16".into(),
            WeightType::F16 => "f16".into(),
            WeightType::Mxfp8 { block } => format!("mxfp8b{block}"),
        }
    }
}

/// One kernel at one shape. Activations are f32 rows `[S, width]` with S
/// dynamic (prompt length at prefill, 1 at decode).
#[derive(Debug, Clone, PartialEq, PartialOrd)]
pub enum Kernel {
    /// Gemma RMSNorm of each row: `x · rsqrt(mean(x²) + eps) · (1 + w)`.
    RmsNorm { width: usize, eps: f64, weight: WeightType },
    /// `y = x Wᵀ` with `W: [out, inp]`.
    Linear { inp: usize, out: usize, weight: WeightType },
    /// Per-head Gemma RMSNorm fused with partial NeoX RoPE (QK-norm + RoPE,
    /// also the MSA indexer's).
    HeadNormRope { heads: usize, head_dim: usize, rotary_dim: usize, theta: f64, eps: f64, weight: WeightType },
    /// SwiGLU-OAI of a gate and an up projection.
    SwiGluOai { width: usize, alpha: f64, limit: f64, beta: f64 },
    /// Greedy sampling: the first index of each row's maximum.
    Argmax { width: usize },
}

impl Kernel {
    /// The kernel's function name: a pure function of its parameters, so the
    /// same kernel generated twice has one name (and is emitted once).
    pub fn symbol(&self) -> String {
        match self {
            Kernel::RmsNorm { width, eps, weight } => format!("m3c_rms_norm_w{width}_eps{}_{}", num_tag(*eps), weight.tag()),
            Kernel::Linear { inp, out, weight } => format!("m3c_linear_i{inp}_o{out}_{}", weight.tag()),
            Kernel::HeadNormRope { heads, head_dim, rotary_dim, theta, eps, weight } => format!(
                "m3c_head_norm_rope_h{heads}_d{head_dim}_r{rotary_dim}_t{}_eps{}_{}",
                num_tag(*theta),
                num_tag(*eps),
                weight.tag()
            ),
            Kernel::SwiGluOai { width, alpha, limit, beta } => {
                format!("m3c_swiglu_oai_w{width}_a{}_l{}_b{}", num_tag(*alpha), num_tag(*limit), num_tag(*beta))
            }
            Kernel::Argmax { width } => format!("m3c_argmax_w{width}"),
        }
    }

    /// The MLIR text of this kernel (a `func.func` plus any private globals it uses).
    pub fn mlir(&self) -> String {
        match self {
            Kernel::RmsNorm { width, eps, weight } => norm::rms_norm(&self.symbol(), *width, *eps, *weight),
            Kernel::Linear { inp, out, weight } => linear::linear(&self.symbol(), *inp, *out, *weight),
            Kernel::HeadNormRope { heads, head_dim, rotary_dim, theta, eps, weight } => {
                rope::head_norm_rope(&self.symbol(), *heads, *head_dim, *rotary_dim, *theta, *eps, *weight)
            }
            Kernel::SwiGluOai { width, alpha, limit, beta } => elementwise::swiglu_oai(&self.symbol(), *width, *alpha, *limit, *beta),
            Kernel::Argmax { width } => elementwise::argmax(&self.symbol(), *width),
        }
    }

    /// Globals (lookup tables) the kernel refers to, by name and MLIR text.
    pub fn globals(&self) -> Vec<(String, String)> {
        match self {
            Kernel::Linear { weight: WeightType::Mxfp8 { .. }, .. } => vec![("m3c_fp8_e4m3_lut".into(), emit::fp8_lut_global())],
            Kernel::HeadNormRope { rotary_dim, theta, .. } => {
                vec![(rope::rope_table_name(*rotary_dim, *theta), rope::rope_table(*rotary_dim, *theta))]
            }
            _ => Vec::new(),
        }
    }
}

/// A number as part of a symbol name: `1e-6` → `1em6`, `1.702` → `1p702e0`.
pub(crate) fn num_tag(x: f64) -> String {
    format!("{x:e}").replace('-', "m").replace('.', "p")
}

impl fmt::Display for Kernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.symbol())
    }
}

/// A module holding `kernels` (each once, in the order given) and the globals they need.
pub fn module(kernels: &[Kernel]) -> String {
    let mut seen = std::collections::BTreeSet::new();
    let mut globals = std::collections::BTreeMap::new();
    let mut body = String::new();
    for k in kernels {
        if seen.insert(k.symbol()) {
            for (name, text) in k.globals() {
                globals.insert(name, text);
            }
            body.push_str(&k.mlir());
        }
    }
    let mut out = String::from("module {\n");
    for text in globals.values() {
        out.push_str(text);
    }
    out.push_str(&body);
    out.push_str("}\n");
    out
}
