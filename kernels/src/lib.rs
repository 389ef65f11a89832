//! m3c's kernel generators. Each [`Kernel`] is one fused operation at one
//! shape; [`Kernel::mlir`] writes it as an MLIR `func.func` over memrefs in
//! target-neutral dialects (`scf`, `arith`, `math`, `memref`), which the
//! compiler's back ends lower for the host (LLVM) or for GPUs.
//!
//! This crate knows shapes and arithmetic, never files or weights: weights
//! arrive as memref arguments at run time.

pub mod builder;
pub mod devmath;
mod emit;
pub mod gpu;
mod host;
pub mod unit;
mod view;

use std::fmt;

pub use devmath::DeviceMath;
/// The value of a `float8_e4m3fn` byte: the table MXFP8 kernels decode with.
pub use emit::fp8_e4m3_value;
pub use gpu::{Fp8Decode, GpuCall, GpuFunc, GpuTarget};
pub use ops::attention::SparseSel;
pub use ops::routed_experts::{expert_table_stride, expert_tensor_types};
pub use ops::*;
pub use unit::{KernelUnit, Launch, Param};
pub use view::MemTy;

/// Indents every line of `body` by `n` spaces.
pub fn indent(body: &str, n: usize) -> String {
    emit::indent(body, n)
}

/// The widest f32 vectors of the CPU host code is compiled for. A kernel
/// with a wider form ([`KernelUnit::host_body_at`]) gives the same bits in
/// either: the wider one runs two of the narrower one's 8-lane sums in one
/// register, each lane with the same operations in the same order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum HostWidth {
    /// 8 f32 lanes, 16 registers (AVX2, and the portable levels).
    #[default]
    Lanes8,
    /// 16 f32 lanes, 32 registers (AVX-512).
    Lanes16,
}

impl HostWidth {
    /// The width of a CPU whose widest f32 vector has `lanes` lanes.
    pub fn of_lanes(lanes: usize) -> HostWidth {
        if lanes >= 16 {
            HostWidth::Lanes16
        } else {
            HostWidth::Lanes8
        }
    }
}

/// How f32 values are kept in memory: KV and MSA index-key caches
/// (`--kv-cache`) and the activations that pass between kernels and stages
/// (`--activations`). Kernels compute in f32 either way; `Bf16` halves the
/// memory and the bytes moved, rounding each written value to nearest-even
/// bf16 (as `torch.Tensor.to(torch.bfloat16)` does). Stored as `i16` bit
/// patterns and converted with integer ops, so no back end needs bf16
/// arithmetic and host and GPU round identically.
///
/// `Fp8` is for caches only (`--kv-cache fp8`): `float8_e4m3fn` bytes with a
/// per-tensor scale of 1 (vLLM's when a checkpoint carries no KV scales),
/// rounded to nearest even and saturated at ±448, NaN kept NaN, converted
/// with integer ops as bf16 is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub enum Storage {
    #[default]
    F32,
    Bf16,
    Fp8,
}

impl Storage {
    /// The memref element type of a cache of this type.
    pub fn mlir_elem(self) -> &'static str {
        match self {
            Storage::F32 => "f32",
            Storage::Bf16 => "i16",
            Storage::Fp8 => "i8",
        }
    }

    /// The memref type of rows of `width` values stored this way, the row
    /// count dynamic: how activations and caches cross a kernel's boundary.
    pub fn rows_ty(self, width: usize) -> String {
        format!("memref<?x{width}x{}>", self.mlir_elem())
    }

    pub fn bytes(self) -> usize {
        match self {
            Storage::F32 => 4,
            Storage::Bf16 => 2,
            Storage::Fp8 => 1,
        }
    }

    /// The name users write (`--kv-cache`) and manifests record.
    pub fn name(self) -> &'static str {
        match self {
            Storage::F32 => "f32",
            Storage::Bf16 => "bf16",
            Storage::Fp8 => "fp8",
        }
    }

    /// Suffix of kernel symbols that touch a cache of this type (none for f32).
    pub(crate) fn suffix(self) -> &'static str {
        match self {
            Storage::F32 => "",
            Storage::Bf16 => "_kvbf16",
            Storage::Fp8 => "_kvfp8",
        }
    }

    /// Suffix of kernel symbols whose activations are of this type (none for f32).
    pub(crate) fn act_suffix(self) -> &'static str {
        match self {
            Storage::F32 => "",
            Storage::Bf16 => "_abf16",
            Storage::Fp8 => "_afp8",
        }
    }
}

/// How a weight operand is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum WeightType {
    F32,
    BF16,
    F16,
    /// `float8_e4m3fn` elements with one E8M0 (`uint8`) scale per 1×`block` input block.
    Mxfp8 {
        block: usize,
    },
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
    /// The static memref type of a weight of shape `dims` stored this way.
    pub fn memref(self, dims: &[usize]) -> String {
        let dims: String = dims.iter().map(|d| format!("{d}x")).collect();
        format!("memref<{dims}{}>", self.mlir_elem())
    }
    pub(crate) fn tag(self) -> String {
        match self {
            WeightType::F32 => "f32".into(),
            WeightType::BF16 => "bf16".into(),
            WeightType::F16 => "f16".into(),
            WeightType::Mxfp8 { block } => format!("mxfp8b{block}"),
        }
    }
}

/// The kernel types, one module (file) each, declared in `ops/mod.rs` (where
/// rustfmt sees them).
pub mod ops;

/// The kernels: one file each under `ops/`, one line each here. The list
/// makes the [`Kernel`] enum (a variant per kernel type), `From` for each
/// type, and the dispatch to its [`KernelUnit`].
macro_rules! kernels {
    ($($module:ident :: $name:ident),* $(,)?) => {
        /// One kernel at one shape. Activations are rows `[S, width]` (S
        /// dynamic: prompt length at prefill, 1 at decode) of f32 values
        /// stored as the kernel's `act`.
        #[derive(Debug, Clone, PartialEq, PartialOrd)]
        pub enum Kernel {
            $($name(ops::$module::$name),)*
        }

        impl Kernel {
            /// The kernel as its unit: everything it knows about itself.
            pub fn unit(&self) -> &dyn KernelUnit {
                match self {
                    $(Kernel::$name(k) => k,)*
                }
            }
        }

        /// The name of every kernel type, in registration order.
        pub const KERNEL_TYPES: &[&str] = &[$(stringify!($name)),*];

        $(impl From<ops::$name> for Kernel {
            fn from(k: ops::$name) -> Kernel {
                Kernel::$name(k)
            }
        })*
    };
}

kernels! {
    rms_norm::RmsNorm,
    linear::Linear,
    head_norm_rope::HeadNormRope,
    swiglu_oai::SwiGluOai,
    sample::Sample,
    embedding::Embedding,
    add::Add,
    scatter_rows::ScatterRows,
    to_bf16::ToBf16,
    dequant_mxfp8::DequantMxfp8,
    attention::Attention,
    router::Router,
    routed_experts::RoutedExperts,
    gelu::Gelu,
    layer_norm::LayerNorm,
    bias_act::BiasAct,
    axial_rope::AxialRope,
    copy_cols::CopyCols,
}

impl Kernel {
    /// The kernel's function name (see [`KernelUnit::symbol`]).
    pub fn symbol(&self) -> String {
        self.unit().symbol()
    }

    /// Its arguments, written once (see [`KernelUnit::params`]).
    pub fn params(&self) -> Vec<Param> {
        self.unit().params()
    }

    /// How the kernel's activations are stored (`None`: it has none, or
    /// only f32 logits).
    pub fn act(&self) -> Option<Storage> {
        self.unit().act()
    }

    /// Kernels this one calls (emitted with it).
    pub fn deps(&self) -> Vec<Kernel> {
        self.unit().deps()
    }

    /// The MLIR text of this kernel's host `func.func` (8-lane vectors).
    pub fn mlir(&self) -> String {
        self.mlir_at(HostWidth::Lanes8)
    }

    /// [`Kernel::mlir`] for CPUs with vectors of `width`.
    pub fn mlir_at(&self, width: HostWidth) -> String {
        unit::host_func(self.unit(), width)
    }

    /// Globals (lookup tables) the kernel refers to, by name and MLIR text.
    pub fn globals(&self) -> Vec<(String, String)> {
        self.unit().globals()
    }

    /// [`Kernel::globals`] of [`Kernel::mlir_at`]'s form.
    pub fn globals_at(&self, width: HostWidth) -> Vec<(String, String)> {
        self.unit().globals_at(width)
    }

    /// The `gpu.func` kernels this kernel runs as on the GPU `t`.
    pub fn gpu_funcs(&self, t: &GpuTarget) -> Vec<GpuFunc> {
        self.unit().gpu_funcs(t)
    }

    /// Host statements launching this kernel on the GPU `target`. `args`
    /// are the SSA names and types of the call's arguments, in
    /// [`Kernel::params`] order; `rows` is the step's row count (an index
    /// SSA name); `tag` makes local names unique.
    pub fn gpu_call(&self, target: &GpuTarget, args: &[(String, String)], rows: &str, tag: &str) -> GpuCall {
        self.unit().launch(&Launch { target, args, rows, tag })
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

/// A module holding `kernels` and what they call (each once, in the order
/// first needed) and the globals they need.
pub fn module(kernels: &[Kernel]) -> String {
    module_with(kernels, &[], "", HostWidth::Lanes8)
}

/// [`module`] for CPUs with vectors of `width`.
pub fn module_at(kernels: &[Kernel], width: HostWidth) -> String {
    module_with(kernels, &[], "", width)
}

/// Each kernel of `kernels`, and each kernel they call, as a module of its
/// own: the kernel's `func.func`, the globals it needs and declarations of
/// the kernels it calls. The modules are compiled one by one (a back end
/// caches each by its text, so a kernel shared by stages, splits and
/// compiles is compiled once), and the objects linked together equal
/// [`module_at`]'s. In the order [`module`] emits them.
pub fn host_units(kernels: &[Kernel], width: HostWidth) -> Vec<(String, String)> {
    let mut seen = std::collections::BTreeSet::new();
    let mut units = Vec::new();
    fn visit(k: &Kernel, w: HostWidth, seen: &mut std::collections::BTreeSet<String>, units: &mut Vec<(String, String)>) {
        if !seen.insert(k.symbol()) {
            return;
        }
        let deps = k.deps();
        for d in &deps {
            visit(d, w, seen, units);
        }
        // Globals are private (constants, helpers) or declarations, so a
        // copy in every unit that needs one links without a clash.
        let globals: std::collections::BTreeMap<String, String> = k.globals_at(w).into_iter().collect();
        let mut text = String::from("module {\n");
        for g in globals.values() {
            text.push_str(g);
        }
        let decls: std::collections::BTreeSet<String> = deps.iter().map(host_decl).collect();
        for d in decls {
            text.push_str(&d);
        }
        text.push_str(&k.mlir_at(w));
        text.push_str("}\n");
        units.push((k.symbol(), text));
    }
    for k in kernels {
        visit(k, width, &mut seen, &mut units);
    }
    units
}

/// A declaration of `k`'s host function, for a module that calls it but
/// does not define it (see [`host_units`]).
pub fn host_decl(k: &Kernel) -> String {
    let types: Vec<String> = k.params().into_iter().map(|p| p.ty).collect();
    format!("  func.func private @{}({})\n", k.symbol(), types.join(", "))
}

/// [`module`] plus view helpers for `views` and extra functions (`tail`, a
/// stage entry) that call them.
pub fn module_with(kernels: &[Kernel], views: &[MemTy], tail: &str, width: HostWidth) -> String {
    let mut seen = std::collections::BTreeSet::new();
    let mut globals = std::collections::BTreeMap::new();
    let mut body = String::new();
    fn visit(
        k: &Kernel,
        w: HostWidth,
        seen: &mut std::collections::BTreeSet<String>,
        globals: &mut std::collections::BTreeMap<String, String>,
        body: &mut String,
    ) {
        if !seen.insert(k.symbol()) {
            return;
        }
        for d in k.deps() {
            visit(&d, w, seen, globals, body);
        }
        for (name, text) in k.globals_at(w) {
            globals.insert(name, text);
        }
        body.push_str(&k.mlir_at(w));
    }
    for k in kernels {
        visit(k, width, &mut seen, &mut globals, &mut body);
    }
    for v in views {
        globals.insert(v.view_fn(), v.view_fn_text());
    }
    let mut out = String::from("module {\n");
    for text in globals.values() {
        out.push_str(text);
    }
    out.push_str(&body);
    out.push_str(tail);
    out.push_str("}\n");
    out
}
