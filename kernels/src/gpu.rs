//! The kernels for GPUs: the same [`Kernel`] values as the host
//! generators, written as `gpu.func` kernels for the GPU a [`GpuTarget`]
//! describes (activations stored as f32 or
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
use crate::devmath::DeviceMath;
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

/// What the kernel generators need to know of a GPU, so that they hold no
/// vendor's constants: each GPU back end describes its target with one of
/// these, and every generator takes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuTarget {
    /// Threads that run in lock step and trade registers by shuffle: a warp
    /// of 32 on NVIDIA GPUs, a wave of 64 on AMD's CDNA. A linear's block is
    /// [`WARPS`] of them; attention and the router run one per block.
    pub warp: usize,
    /// How a `float8_e4m3fn` weight byte becomes an f32.
    pub fp8: Fp8Decode,
    /// Whether each `gpu.func` states the block size it is launched with
    /// (`known_block_size`). AMDGPU needs it to allow blocks over 256
    /// threads and to size registers; NVVM does not, and its output is kept
    /// as it is without it.
    pub declares_block_size: bool,
    /// Where `sin`, `cos`, `erf`, `rsqrt` and `ceil` come from.
    pub math: DeviceMath,
    /// Whether block-wide sums are written out as warp shuffles and
    /// workgroup memory instead of `gpu.all_reduce`, whose ROCDL lowering
    /// asks ROCm's device library for the block size.
    pub writes_block_sums: bool,
    /// Whether private arrays are allocated at the kernel's entry, in the
    /// private address space. AMDGPU cannot select a stack allocation after
    /// a loop (a dynamic one), nor one in the generic address space where
    /// its promotion to registers fails (a 128-float accumulator indexed by
    /// a loop); NVVM places them itself, and its output is kept as it is.
    pub explicit_private: bool,
}

/// How a GPU target decodes `float8_e4m3fn`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fp8Decode {
    /// Hopper's converter, `cvt.rn.f16x2.e4m3x2` (inline PTX, sm_89 and
    /// later), two bytes at a time: a few instructions instead of the ~15
    /// integer ops of [`Fp8Decode::Bits`], which would make an MXFP8 GEMV
    /// compute-bound far below HBM bandwidth.
    PtxCvt,
    /// gfx942's converter (`v_cvt_f32_fp8`, MLIR's `rocdl.cvt.f32.fp8`),
    /// which reads the byte as `float8_e4m3fnuz`: an exponent bias one
    /// higher (half the value), NaN at `0x80` and none at `0x7F`/`0xFF`.
    /// A fix-up makes it e4m3fn's exactly: the value doubled (exact in
    /// f32, subnormals included), then `0x80` as −0 and `0x7F`/`0xFF` as
    /// NaN. Four instructions a byte instead of the ~15 of [`Fp8Decode::Bits`].
    FnuzCvt,
    /// Integer and f32 arithmetic on the bits, exact for every byte: for a
    /// target whose converter has not been checked against this one (gfx950
    /// decodes OCP e4m3fn natively, unmeasured) or that has none.
    Bits,
}

impl GpuTarget {
    /// NVIDIA GPUs from sm_89 on (the CUDA back end's `sm_90a` included).
    pub const CUDA: GpuTarget = GpuTarget {
        warp: 32,
        fp8: Fp8Decode::PtxCvt,
        declares_block_size: false,
        math: DeviceMath::Library,
        writes_block_sums: false,
        explicit_private: false,
    };

    /// AMD's CDNA 3 (gfx942: MI300X, MI325X): waves of 64, fp8 through the
    /// FNUZ converter and its fix-up, every kernel's block size declared,
    /// math functions and block sums written out (no ROCm device library
    /// needed to compile).
    pub const ROCM: GpuTarget = GpuTarget {
        warp: 64,
        fp8: Fp8Decode::FnuzCvt,
        declares_block_size: true,
        math: DeviceMath::Inline,
        writes_block_sums: true,
        explicit_private: true,
    };

    /// The ROCm target for `chip`: [`GpuTarget::ROCM`] on gfx942; other
    /// chips (gfx950) decode fp8 by [`Fp8Decode::Bits`], whose converter
    /// reads another format.
    pub fn rocm(chip: &str) -> GpuTarget {
        match chip {
            "gfx942" => GpuTarget::ROCM,
            _ => GpuTarget { fp8: Fp8Decode::Bits, ..GpuTarget::ROCM },
        }
    }

    /// Threads of a block of [`WARPS`] warps: a linear's or an expert projection's.
    pub(crate) fn warps_block(&self) -> usize {
        WARPS * self.warp
    }

    /// ` attributes {known_block_size = ...}` when the target declares
    /// block sizes: what goes between `kernel` and the body of a `gpu.func`
    /// launched with `block` threads.
    pub(crate) fn block_attr(&self, block: usize) -> String {
        if self.declares_block_size {
            format!(" attributes {{known_block_size = array<i32: {block}, 1, 1>}}")
        } else {
            String::new()
        }
    }

    /// The constants every kernel body starts with; `%cwarp` is the warp width.
    pub(crate) fn idx(&self) -> String {
        format!(
            "%c0 = arith.constant 0 : index\n\
             %c1 = arith.constant 1 : index\n\
             %cwarp = arith.constant {} : index\n\
             %c256 = arith.constant 256 : index\n\
             %zero = arith.constant 0.0 : f32\n\
             %one = arith.constant 1.0 : f32\n\
             %ninf = arith.constant 0xFF800000 : f32\n\
             %pinf = arith.constant 0x7F800000 : f32\n",
            self.warp
        )
    }

    /// `%tid`, and the thread's `%lane` in its warp and `%warp` in its block
    /// (after [`GpuTarget::idx`]).
    pub(crate) fn warp_ids(&self) -> &'static str {
        "%tid = gpu.thread_id x\n\
         %lane = arith.remui %tid, %cwarp : index\n\
         %warp = arith.divui %tid, %cwarp : index\n"
    }

    /// `%{d}` = the f32 value of the `float8_e4m3fn` byte `%{q}` (i8).
    fn fp8_decode(&self, d: &str, q: &str) -> String {
        match self.fp8 {
            // e4m3 → f16 is exact and keeps NaN; then f16 → f32.
            Fp8Decode::PtxCvt => format!(
                "%{d}_h = arith.extui %{q} : i8 to i16\n\
                 %{d}_x2 = llvm.inline_asm \"cvt.rn.f16x2.e4m3x2 $0, $1;\", \"=r,h\" %{d}_h : (i16) -> i32\n\
                 %{d}_lo = arith.trunci %{d}_x2 : i32 to i16\n\
                 %{d}_f16 = arith.bitcast %{d}_lo : i16 to f16\n\
                 %{d} = arith.extf %{d}_f16 : f16 to f32\n"
            ),
            Fp8Decode::FnuzCvt => format!(
                "%{d}_b = arith.extui %{q} : i8 to i32\n\
                 %{d}_h = rocdl.cvt.f32.fp8 %{d}_b[0] : f32\n{}",
                fnuz_fixup(d, &format!("%{d}_h"), &format!("%{d}_b"), None)
            ),
            Fp8Decode::Bits => format!("%{d}_b = arith.extui %{q} : i8 to i32\n{}", fp8_bits(d, &format!("%{d}_b"), None)),
        }
    }
}

/// The i32, f32 and i1 types of an fp8 decode: scalars, or vectors of
/// `lanes` when `Some`.
fn lane_types(lanes: Option<usize>) -> [String; 3] {
    match lanes {
        Some(n) => [format!("vector<{n}xi32>"), format!("vector<{n}xf32>"), format!("vector<{n}xi1>")],
        None => ["i32".to_string(), "f32".to_string(), "i1".to_string()],
    }
}

/// The constant `%{d}_{name}` = `v` of type `ty` (splat over the lanes).
fn lane_const(d: &str, name: &str, v: &str, ty: &str, lanes: Option<usize>) -> String {
    match lanes {
        Some(_) => format!("%{d}_{name} = arith.constant dense<{v}> : {ty}\n"),
        None => format!("%{d}_{name} = arith.constant {v} : {ty}\n"),
    }
}

/// `%{d}` = the `float8_e4m3fn` value(s) of the byte(s) `b` (i32, or
/// `vector<N x i32>` when `lanes` is `Some(N)`), from `h`, what gfx942's
/// converter made of them as `float8_e4m3fnuz`: `2·h`, but −0 for `0x80`
/// (FNUZ's NaN) and NaN for `0x7F` and `0xFF` (FNUZ's ±240).
fn fnuz_fixup(d: &str, h: &str, b: &str, lanes: Option<usize>) -> String {
    let [it, ft, bt] = lane_types(lanes);
    let c = |name: &str, v: &str, ty: &str| lane_const(d, name, v, ty, lanes);
    format!(
        "{}{}{}{}\
         %{d}_x2 = arith.addf {h}, {h} : {ft}\n\
         %{d}_isnz = arith.cmpi eq, {b}, %{d}_k128 : {it}\n\
         %{d}_low = arith.andi {b}, %{d}_k127 : {it}\n\
         %{d}_isnan = arith.cmpi eq, %{d}_low, %{d}_k127 : {it}\n\
         %{d}_z = arith.select %{d}_isnz, %{d}_nz, %{d}_x2 : {bt}, {ft}\n\
         %{d} = arith.select %{d}_isnan, %{d}_nan, %{d}_z : {bt}, {ft}\n",
        c("k127", "127", &it),
        c("k128", "128", &it),
        c("nz", "-0.0", &ft),
        c("nan", "0x7FC00000", &ft),
    )
}

/// `%{d}` = the f32 value(s) of the `float8_e4m3fn` byte(s) in the low 8 bits
/// of `b` (i32, or `vector<N x i32>` when `lanes` is `Some(N)`), by
/// arithmetic alone and exactly: with `m` the 3 mantissa bits and `e` the 4
/// exponent bits, the value is `(e > 0 ? 8 + m : m) · 2^(max(e, 1) − 10)`,
/// both factors exact f32 normals; then the sign bit, and NaN for `0x7F`
/// and `0xFF`. No subnormal f32 is formed, so a target that flushes them
/// decodes the same.
fn fp8_bits(d: &str, b: &str, lanes: Option<usize>) -> String {
    let [it, ft, bt] = lane_types(lanes);
    let c = |name: &str, v: &str, ty: &str| lane_const(d, name, v, ty, lanes);
    let mut s = String::new();
    for (name, v) in [("k0", "0"), ("k1", "1"), ("k3", "3"), ("k7", "7"), ("k8", "8"), ("k15", "15"), ("k23", "23"), ("k24", "24")] {
        s.push_str(&c(name, v, &it));
    }
    for (name, v) in [("k117", "117"), ("k127", "127"), ("k128", "128")] {
        s.push_str(&c(name, v, &it));
    }
    s.push_str(&c("nan", "0x7FC00000", &ft));
    s.push_str(&format!(
        "%{d}_m = arith.andi {b}, %{d}_k7 : {it}\n\
         %{d}_es = arith.shrui {b}, %{d}_k3 : {it}\n\
         %{d}_e = arith.andi %{d}_es, %{d}_k15 : {it}\n\
         %{d}_norm = arith.cmpi ne, %{d}_e, %{d}_k0 : {it}\n\
         %{d}_lead = arith.select %{d}_norm, %{d}_k8, %{d}_k0 : {bt}, {it}\n\
         %{d}_mm = arith.ori %{d}_m, %{d}_lead : {it}\n\
         %{d}_ee = arith.select %{d}_norm, %{d}_e, %{d}_k1 : {bt}, {it}\n\
         %{d}_eb = arith.addi %{d}_ee, %{d}_k117 : {it}\n\
         %{d}_pb = arith.shli %{d}_eb, %{d}_k23 : {it}\n\
         %{d}_p2 = arith.bitcast %{d}_pb : {it} to {ft}\n\
         %{d}_mf = arith.uitofp %{d}_mm : {it} to {ft}\n\
         %{d}_mag = arith.mulf %{d}_mf, %{d}_p2 : {ft}\n\
         %{d}_magb = arith.bitcast %{d}_mag : {ft} to {it}\n\
         %{d}_sb = arith.andi {b}, %{d}_k128 : {it}\n\
         %{d}_sg = arith.shli %{d}_sb, %{d}_k24 : {it}\n\
         %{d}_vb = arith.ori %{d}_magb, %{d}_sg : {it}\n\
         %{d}_val = arith.bitcast %{d}_vb : {it} to {ft}\n\
         %{d}_low = arith.andi {b}, %{d}_k127 : {it}\n\
         %{d}_isnan = arith.cmpi eq, %{d}_low, %{d}_k127 : {it}\n\
         %{d} = arith.select %{d}_isnan, %{d}_nan, %{d}_val : {bt}, {ft}\n"
    ));
    s
}

/// A weight operand of a GPU kernel: its memref names and types.
pub(crate) struct WeightArgs {
    /// The GPU it is decoded on (and whose warps [`warp_dots`] use).
    pub(crate) t: GpuTarget,
    weight: WeightType,
    /// `%w` and, for MXFP8, `%s`.
    w: String,
    s: String,
    wty: String,
    sty: String,
}

impl WeightArgs {
    pub(crate) fn new(t: &GpuTarget, w: &str, s: &str, out: usize, inp: usize, weight: WeightType) -> WeightArgs {
        let sty = match weight {
            WeightType::Mxfp8 { block } => format!("memref<{out}x{}xi8>", inp / block),
            _ => String::new(),
        };
        WeightArgs { t: *t, weight, w: w.into(), s: s.into(), wty: weight.memref(&[out, inp]), sty }
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
                dec = self.t.fp8_decode(&format!("{d}_v"), &format!("{d}_q")),
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
                let mut s = raw;
                match self.t.fp8 {
                    Fp8Decode::PtxCvt => {
                        // Four `cvt.rn.f16x2.e4m3x2`, one per byte pair, then the block's scale.
                        s.push_str(&format!("%{d}_p = vector.bitcast %{d}_raw : vector<8xi8> to vector<4xi16>\n"));
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
                    }
                    Fp8Decode::FnuzCvt => {
                        // Each byte of the two words through the converter,
                        // then the fix-up on all eight at once.
                        s.push_str(&format!(
                            "%{d}_b = arith.extui %{d}_raw : vector<8xi8> to vector<8xi32>\n\
                             %{d}_wd = vector.bitcast %{d}_raw : vector<8xi8> to vector<2xi32>\n"
                        ));
                        for w in 0..2 {
                            s.push_str(&format!("%{d}_w{w} = vector.extract %{d}_wd[{w}] : i32 from vector<2xi32>\n"));
                            for k in 0..4 {
                                s.push_str(&format!("%{d}_c{} = rocdl.cvt.f32.fp8 %{d}_w{w}[{k}] : f32\n", 4 * w + k));
                            }
                        }
                        let cs = (0..8).map(|k| format!("%{d}_c{k}")).collect::<Vec<_>>().join(", ");
                        s.push_str(&format!("%{d}_h = vector.from_elements {cs} : vector<8xf32>\n"));
                        s.push_str(&fnuz_fixup(&format!("{d}_all"), &format!("%{d}_h"), &format!("%{d}_b"), Some(8)));
                    }
                    Fp8Decode::Bits => {
                        // All eight bytes at once, as a vector of i32.
                        s.push_str(&format!("%{d}_b = arith.extui %{d}_raw : vector<8xi8> to vector<8xi32>\n"));
                        s.push_str(&fp8_bits(&format!("{d}_all"), &format!("%{d}_b"), Some(8)));
                    }
                }
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

/// A `gpu.func` kernel launched with `block` threads per block.
pub(crate) fn func(t: &GpuTarget, name: &str, params: &str, body: &str, block: usize) -> GpuFunc {
    func_shared(t, name, params, &[], body, block)
}

/// [`func`] with workgroup (shared) memory: `shared` lists each buffer's
/// name (without `%`) and memref type (in the workgroup address space).
pub(crate) fn func_shared(t: &GpuTarget, name: &str, params: &str, shared: &[(&str, String)], body: &str, block: usize) -> GpuFunc {
    let mut shared = shared.to_vec();
    let summed;
    let body = if t.writes_block_sums {
        let (text, partials) = block_sums(t, body, block);
        shared.extend(partials.map(|n| (BLOCK_SUM_PARTIALS, format!("memref<{n}xf32, #gpu.address_space<workgroup>>"))));
        summed = text;
        &summed
    } else {
        body
    };
    let workgroup = if shared.is_empty() {
        String::new()
    } else {
        let list: Vec<String> = shared.iter().map(|(n, ty)| format!("%{n}: {ty}")).collect();
        format!(" workgroup({})", list.join(", "))
    };
    let body = match t.math {
        DeviceMath::Library => indent(body, 6),
        DeviceMath::Inline => indent(&crate::devmath::expand(body), 6),
    };
    GpuFunc {
        name: name.to_string(),
        text: format!("    gpu.func @{name}({params}){workgroup} kernel{} {{\n{body}      gpu.return\n    }}\n", t.block_attr(block)),
    }
}

/// The workgroup buffer of the warps' partial sums in [`block_sums`].
const BLOCK_SUM_PARTIALS: &str = "m3c_block_sum";

/// `body` with each `%s = gpu.all_reduce add %x uniform {} : (f32) -> (f32)`
/// over a block of `block` threads written out: a shuffle butterfly per warp,
/// then (for a block of several warps) each warp's sum through workgroup
/// memory, added in warp order by every thread. Returns the partials
/// buffer's length when one is needed. A block that is neither a power of
/// two up to a warp nor whole warps keeps `gpu.all_reduce`.
fn block_sums(t: &GpuTarget, body: &str, block: usize) -> (String, Option<usize>) {
    let mut out = String::with_capacity(body.len());
    let mut partials = None;
    for line in body.split_inclusive('\n') {
        let sum = line.trim().split_once(" = gpu.all_reduce add ").and_then(|(d, rest)| {
            let x = rest.strip_suffix(" uniform {} : (f32) -> (f32)")?;
            (d.starts_with('%') && x.starts_with('%') && !x.contains(' ')).then_some((d, x))
        });
        let Some((d, x)) = sum else {
            out.push_str(line);
            continue;
        };
        if block <= t.warp && block.is_power_of_two() && block > 1 {
            out.push_str(&warp_reduce(block, d, Reduce::Add, x, "f32"));
        } else if block > t.warp && block.is_multiple_of(t.warp) {
            let n = block / t.warp;
            partials = Some(n);
            let buf = format!("%{BLOCK_SUM_PARTIALS}");
            let ty = format!("memref<{n}xf32, #gpu.address_space<workgroup>>");
            let base = d.trim_start_matches('%');
            out.push_str(&warp_reduce(t.warp, &format!("%{base}_ws"), Reduce::Add, x, "f32"));
            out.push_str(&format!(
                "%{base}_tid = gpu.thread_id x\n%{base}_cw = arith.constant {w} : index\n\
                 %{base}_lane = arith.remui %{base}_tid, %{base}_cw : index\n%{base}_wid = arith.divui %{base}_tid, %{base}_cw : index\n\
                 %{base}_c0 = arith.constant 0 : index\n%{base}_first = arith.cmpi eq, %{base}_lane, %{base}_c0 : index\n\
                 scf.if %{base}_first {{\n  memref.store %{base}_ws, {buf}[%{base}_wid] : {ty}\n}}\ngpu.barrier\n",
                w = t.warp
            ));
            for i in 0..n {
                let name = if i + 1 == n { d.to_string() } else { format!("%{base}_a{i}") };
                out.push_str(&format!(
                    "%{base}_i{i} = arith.constant {i} : index\n%{base}_p{i} = memref.load {buf}[%{base}_i{i}] : {ty}\n"
                ));
                if i > 0 {
                    let prev = if i == 1 { format!("%{base}_p0") } else { format!("%{base}_a{}", i - 1) };
                    out.push_str(&format!("{name} = arith.addf {prev}, %{base}_p{i} : f32\n"));
                }
            }
            // The next sum writes the buffer again: every thread has read it first.
            out.push_str("gpu.barrier\n");
        } else {
            out.push_str(line);
        }
    }
    (out, partials)
}

/// Warp dot products of weight row `o` with activation rows `rows` (index
/// SSA names) of `x` (`n` columns): lanes stride over the columns, loading
/// each weight element once for all the rows (8 bytes of weights per lane
/// per load when `n` is a multiple of a warp of such chunks: 8 fp8, 4
/// bf16/f16 or 2 f32 elements, so a warp of 32 moves 256 B per load; else
/// one element), then
/// one shuffle reduction per row into `%{tag}s{j}` (every lane gets it).
/// `x` holds values stored as `xs`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn warp_dots(tag: &str, wa: &WeightArgs, o: &str, x: &str, xt: &str, xs: Storage, rows: &[String], n: usize) -> String {
    let (lanes, warp) = (wa.lanes(), wa.t.warp);
    let wide = n.is_multiple_of(warp * lanes);
    let vt = if wide { format!("vector<{lanes}xf32>") } else { "f32".to_string() };
    let zero = if wide { format!("%{tag}vz") } else { "%zero".to_string() };
    let inits: Vec<String> = (0..rows.len()).map(|j| format!("%{tag}a{j} = {zero}")).collect();
    let tys = vec![vt.as_str(); rows.len()].join(", ");
    let mut fma = String::new();
    for (j, r) in rows.iter().enumerate() {
        let xload = if wide {
            // Rows of a multiple of warp·lanes elements from 256-byte-aligned buffers: aligned.
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
        ("%lane".to_string(), "%cwarp".to_string(), wa.load(&format!("{tag}w"), o, "%i"))
    };
    let mut s = format!("%{tag}cn = arith.constant {n} : index\n");
    if wide {
        s.push_str(&format!(
            "%{tag}vz = arith.constant dense<0.0> : {vt}\n%{tag}cl = arith.constant {lanes} : index\n%{tag}i0 = arith.muli %lane, %{tag}cl : index\n%{tag}st = arith.constant {} : index\n",
            warp * lanes
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
            s.push_str(&warp_reduce(warp, &format!("%{tag}s{j}"), Reduce::Add, &format!("%{tag}l{j}"), "f32"));
        } else {
            s.push_str(&warp_reduce(warp, &format!("%{tag}s{j}"), Reduce::Add, &format!("%{tag}acc#{j}"), "f32"));
        }
    }
    s
}
