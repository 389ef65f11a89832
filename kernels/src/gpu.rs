//! The kernels for NVIDIA GPUs: the same [`Kernel`] values as the host
//! generators, written as `gpu.func` kernels (activations stored as f32 or
//! bf16 bits as each kernel's `act` says, weights in their stored type, f32
//! arithmetic and accumulation) plus the host-side launches that
//! run them. The CUDA back end lowers them through NVVM to PTX.
//!
//! Work split: a warp per output row of a linear (lanes stride over the
//! inputs 8 bytes at a time where the row allows, so a warp reads a weight
//! row with coalesced 256-byte loads, each byte once per four activation
//! rows, then one shuffle reduction per row; fp8 is decoded by the
//! hardware converter); a block per row for
//! norms and elementwise ops; a warp per (query row, KV group) for attention,
//! with an online softmax per lane merged by shuffles and the MSA block
//! selection done by the same warp. Routed experts are grouped by expert:
//! a grouping launch, then gate/up + SwiGLU-OAI and down per (expert, output
//! rows) over that expert's tokens four at a time (one at a time, in an
//! `_r1` twin, for experts with a single token), then a weighted combine.

use crate::builder::{warp_reduce, Reduce};
use crate::emit::{e8m0_to_f32, indent, load_f32, load_f32xn_aligned, E8M0_CONSTANTS};
use crate::view::MemTy;
use crate::{Storage, WeightType};

/// Name of the `gpu.module` holding a stage's kernels.
pub const GPU_MODULE: &str = "m3c_kernels";

/// Outputs (warps) per block of a linear.
pub(crate) const WARPS: usize = 8;
/// Activation rows a linear's warp takes per pass over a weight row.
pub(crate) const ROWS_PER_PASS: usize = 4;
pub(crate) const BLOCK: usize = 256;

/// A `gpu.func` by name and text.
pub struct GpuFunc {
    pub name: String,
    pub text: String,
}

/// The host side of one kernel call on the GPU: statements that launch the
/// kernel(s) over the arguments the host kernel would take.
pub struct GpuCall {
    pub text: String,
    /// View helpers the device code needs (for expert weight tables).
    pub device_views: Vec<MemTy>,
    /// View helpers the host code needs (scratch buffers).
    pub host_views: Vec<MemTy>,
}

/// Device memory comes from the runtime (`m3c_buf_alloc(bytes) -> ptr`,
/// `m3c_buf_free(ptr)`), so it can pool and account for it; the launch
/// code views the pointers as memrefs. `%{name}` gets a `[n, width]` buffer.
pub fn device_buffer(name: &str, n: &str, width: usize, elem: &'static str) -> (String, MemTy) {
    let ty = if width == 0 { MemTy { dims: vec![None], elem } } else { MemTy::rows(width, elem) };
    let size = match elem {
        "i64" | "f64" => 8,
        "i8" => 1,
        "i16" | "bf16" | "f16" => 2,
        _ => 4,
    } * width.max(1);
    (
        format!(
            "{name}_sz = arith.constant {size} : index
             {name}_nb = arith.muli {n}, {name}_sz : index
             {name}_nb64 = arith.index_cast {name}_nb : index to i64
             {name}_p = func.call @m3c_buf_alloc({name}_nb64) : (i64) -> !llvm.ptr
             {name} = func.call @{}({name}_p, {n}) : (!llvm.ptr, index) -> {}
",
            ty.view_fn(),
            ty.mlir()
        ),
        ty,
    )
}

/// `%{d}` = the f32 value of the `float8_e4m3fn` byte `%{q}` (i8) with
/// Hopper's converter (`cvt.rn.f16x2.e4m3x2`, sm_89+; e4m3 → f16 is exact,
/// NaN stays NaN), then f16 → f32: a few instructions instead of the ~20
/// integer ops a software decode takes, which would make an MXFP8 GEMV compute-bound
/// far below HBM bandwidth.
fn fp8_cvt(d: &str, q: &str) -> String {
    format!(
        "%{d}_h = arith.extui %{q} : i8 to i16\n\
         %{d}_x2 = llvm.inline_asm \"cvt.rn.f16x2.e4m3x2 $0, $1;\", \"=r,h\" %{d}_h : (i16) -> i32\n\
         %{d}_lo = arith.trunci %{d}_x2 : i32 to i16\n\
         %{d}_f16 = arith.bitcast %{d}_lo : i16 to f16\n\
         %{d} = arith.extf %{d}_f16 : f16 to f32\n"
    )
}

/// A weight operand of a GPU kernel: its memref names and types.
pub(crate) struct WeightArgs {
    weight: WeightType,
    /// `%w` and, for MXFP8, `%s`.
    w: String,
    s: String,
    wty: String,
    sty: String,
}

impl WeightArgs {
    pub(crate) fn new(w: &str, s: &str, out: usize, inp: usize, weight: WeightType) -> WeightArgs {
        let sty = match weight {
            WeightType::Mxfp8 { block } => format!("memref<{out}x{}xi8>", inp / block),
            _ => String::new(),
        };
        WeightArgs { weight, w: w.into(), s: s.into(), wty: format!("memref<{out}x{inp}x{}>", weight.mlir_elem()), sty }
    }

    /// `%{d}` = W[o, i] as f32.
    pub(crate) fn load(&self, d: &str, o: &str, i: &str) -> String {
        match self.weight {
            WeightType::F32 => format!("%{d} = memref.load {}[{o}, {i}] : {}\n", self.w, self.wty),
            WeightType::BF16 | WeightType::F16 => format!(
                "%{d}_n = memref.load {}[{o}, {i}] : {}\n%{d} = arith.extf %{d}_n : {} to f32\n",
                self.w,
                self.wty,
                self.weight.mlir_elem()
            ),
            WeightType::Mxfp8 { block } => format!(
                "%{d}_q = memref.load {w}[{o}, {i}] : {wty}\n\
                 %{d}_cb = arith.constant {block} : index\n\
                 %{d}_bi = arith.divui {i}, %{d}_cb : index\n\
                 %{d}_sq = memref.load {s}[{o}, %{d}_bi] : {sty}\n\
                 {dec}\
                 {scale}\
                 %{d} = arith.mulf %{d}_v, %{d}_sc : f32\n",
                w = self.w,
                wty = self.wty,
                s = self.s,
                sty = self.sty,
                dec = fp8_cvt(&format!("{d}_v"), &format!("{d}_q")),
                scale = e8m0_to_f32(&format!("%{d}_sc"), &format!("%{d}_sq")),
            ),
        }
    }

    /// Elements of this weight in 8 bytes: what one lane loads at a time on the wide path.
    pub(crate) fn lanes(&self) -> usize {
        match self.weight {
            WeightType::F32 => 2,
            WeightType::BF16 | WeightType::F16 => 4,
            WeightType::Mxfp8 { .. } => 8,
        }
    }

    /// `%{d}` = W[o, i .. i + lanes] as `vector<lanes x f32>`, from one 8-byte
    /// load (`i` a multiple of `lanes`; MXFP8: all in one scale block).
    pub(crate) fn load_wide(&self, d: &str, o: &str, i: &str) -> String {
        let n = self.lanes();
        let elem = self.weight.mlir_elem();
        let raw = format!("%{d}_raw = vector.load {}[{o}, {i}] {{alignment = 8}} : {}, vector<{n}x{elem}>\n", self.w, self.wty);
        match self.weight {
            WeightType::F32 => raw.replace(&format!("%{d}_raw ="), &format!("%{d} =")),
            WeightType::BF16 | WeightType::F16 => format!("{raw}%{d} = arith.extf %{d}_raw : vector<{n}x{elem}> to vector<{n}xf32>\n"),
            WeightType::Mxfp8 { block } => {
                // Four `cvt.rn.f16x2.e4m3x2`, one per byte pair, then the block's scale.
                let mut s = format!("{raw}%{d}_p = vector.bitcast %{d}_raw : vector<8xi8> to vector<4xi16>\n");
                for k in 0..4 {
                    s.push_str(&format!(
                        "%{d}_h{k} = vector.extract %{d}_p[{k}] : i16 from vector<4xi16>\n\
                         %{d}_x{k} = llvm.inline_asm \"cvt.rn.f16x2.e4m3x2 $0, $1;\", \"=r,h\" %{d}_h{k} : (i16) -> i32\n\
                         %{d}_v{k} = llvm.bitcast %{d}_x{k} : i32 to vector<2xf16>\n\
                         %{d}_f{k} = arith.extf %{d}_v{k} : vector<2xf16> to vector<2xf32>\n"
                    ));
                }
                // The four pairs side by side, in element order.
                s.push_str(&format!(
                    "%{d}_lo = vector.shuffle %{d}_f0, %{d}_f1 [0, 1, 2, 3] : vector<2xf32>, vector<2xf32>\n\
                     %{d}_hi = vector.shuffle %{d}_f2, %{d}_f3 [0, 1, 2, 3] : vector<2xf32>, vector<2xf32>\n\
                     %{d}_all = vector.shuffle %{d}_lo, %{d}_hi [0, 1, 2, 3, 4, 5, 6, 7] : vector<4xf32>, vector<4xf32>\n"
                ));
                s.push_str(&format!(
                    "%{d}_cb = arith.constant {block} : index\n\
                     %{d}_bi = arith.divui {i}, %{d}_cb : index\n\
                     %{d}_sq = memref.load {s}[{o}, %{d}_bi] : {sty}\n\
                     {scale}\
                     %{d}_scv = vector.broadcast %{d}_sc : f32 to vector<8xf32>\n\
                     %{d} = arith.mulf %{d}_all, %{d}_scv : vector<8xf32>\n",
                    s = self.s,
                    sty = self.sty,
                    scale = e8m0_to_f32(&format!("%{d}_sc"), &format!("%{d}_sq")),
                ));
                s
            }
        }
    }

    pub(crate) fn consts(&self) -> String {
        match self.weight {
            WeightType::Mxfp8 { .. } => E8M0_CONSTANTS.to_string(),
            _ => String::new(),
        }
    }
}

pub(crate) fn func(name: &str, params: &str, body: &str) -> GpuFunc {
    GpuFunc {
        name: name.to_string(),
        text: format!("    gpu.func @{name}({params}) kernel {{\n{}      gpu.return\n    }}\n", indent(body, 6)),
    }
}

pub(crate) const IDX: &str = "%c0 = arith.constant 0 : index\n\
     %c1 = arith.constant 1 : index\n\
     %c32 = arith.constant 32 : index\n\
     %c256 = arith.constant 256 : index\n\
     %zero = arith.constant 0.0 : f32\n\
     %one = arith.constant 1.0 : f32\n\
     %ninf = arith.constant 0xFF800000 : f32\n\
     %pinf = arith.constant 0x7F800000 : f32\n";

/// Warp dot products of weight row `o` with activation rows `rows` (index
/// SSA names) of `x` (`n` columns): lanes stride over the columns, loading
/// each weight element once for all the rows (8 bytes of weights per lane
/// per load when `n` is a multiple of 32 such chunks: 8 fp8, 4 bf16/f16 or
/// 2 f32 elements, so a warp moves 256 B per load; else one element), then
/// one shuffle reduction per row into `%{tag}s{j}` (every lane gets it).
/// `x` holds values stored as `xs`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn warp_dots(tag: &str, wa: &WeightArgs, o: &str, x: &str, xt: &str, xs: Storage, rows: &[String], n: usize) -> String {
    let lanes = wa.lanes();
    let wide = n.is_multiple_of(32 * lanes);
    let vt = if wide { format!("vector<{lanes}xf32>") } else { "f32".to_string() };
    let zero = if wide { format!("%{tag}vz") } else { "%zero".to_string() };
    let inits: Vec<String> = (0..rows.len()).map(|j| format!("%{tag}a{j} = {zero}")).collect();
    let tys = vec![vt.as_str(); rows.len()].join(", ");
    let mut fma = String::new();
    for (j, r) in rows.iter().enumerate() {
        let xload = if wide {
            // Rows of a multiple of 32·lanes elements from 256-byte-aligned buffers: aligned.
            indent(&load_f32xn_aligned(lanes, (lanes * xs.bytes()).min(16), &format!("%{tag}v{j}"), x, xt, r, "%i", xs), 2)
        } else {
            indent(&load_f32(&format!("%{tag}v{j}"), x, xt, r, "%i", xs), 2)
        };
        fma.push_str(&format!(
            "{xload}  %{tag}m{j} = arith.mulf %{tag}v{j}, %{tag}w : {vt}\n  %{tag}n{j} = arith.addf %{tag}a{j}, %{tag}m{j} : {vt}\n"
        ));
    }
    let nexts: Vec<String> = (0..rows.len()).map(|j| format!("%{tag}n{j}")).collect();
    let (lb, step, load) = if wide {
        (format!("%{tag}i0"), format!("%{tag}st"), wa.load_wide(&format!("{tag}w"), o, "%i"))
    } else {
        ("%lane".to_string(), "%c32".to_string(), wa.load(&format!("{tag}w"), o, "%i"))
    };
    let mut s = format!("%{tag}cn = arith.constant {n} : index\n");
    if wide {
        s.push_str(&format!(
            "%{tag}vz = arith.constant dense<0.0> : {vt}\n%{tag}cl = arith.constant {lanes} : index\n%{tag}i0 = arith.muli %lane, %{tag}cl : index\n%{tag}st = arith.constant {} : index\n",
            32 * lanes
        ));
    }
    s.push_str(&format!(
        "%{tag}acc:{} = scf.for %i = {lb} to %{tag}cn step {step} iter_args({}) -> ({tys}) {{\n{}{fma}  scf.yield {} : {tys}\n}}\n",
        rows.len(),
        inits.join(", "),
        indent(&load, 2),
        nexts.join(", ")
    ));
    for j in 0..rows.len() {
        if wide {
            s.push_str(&format!("%{tag}l{j} = vector.reduction <add>, %{tag}acc#{j} : {vt} into f32\n"));
            s.push_str(&warp_reduce(&format!("%{tag}s{j}"), Reduce::Add, &format!("%{tag}l{j}"), "f32"));
        } else {
            s.push_str(&warp_reduce(&format!("%{tag}s{j}"), Reduce::Add, &format!("%{tag}acc#{j}"), "f32"));
        }
    }
    s
}

pub(crate) const WARP_IDS: &str = "%tid = gpu.thread_id x\n\
     %lane = arith.remui %tid, %c32 : index\n\
     %warp = arith.divui %tid, %c32 : index\n";
