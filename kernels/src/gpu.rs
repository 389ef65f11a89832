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

use crate::emit::{e8m0_to_f32, f32_lit, indent, load_f32, load_f32xn_aligned, store_f32, E8M0_CONSTANTS};
use crate::view::MemTy;
use crate::{moe, Kernel, SparseSel, Storage, WeightType};

/// Name of the `gpu.module` holding a stage's kernels.
pub const GPU_MODULE: &str = "m3c_kernels";

/// Outputs (warps) per block of a linear.
const WARPS: usize = 8;
/// Activation rows a linear's warp takes per pass over a weight row.
const ROWS_PER_PASS: usize = 4;
const BLOCK: usize = 256;

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
struct WeightArgs {
    weight: WeightType,
    /// `%w` and, for MXFP8, `%s`.
    w: String,
    s: String,
    wty: String,
    sty: String,
}

impl WeightArgs {
    fn new(w: &str, s: &str, out: usize, inp: usize, weight: WeightType) -> WeightArgs {
        let sty = match weight {
            WeightType::Mxfp8 { block } => format!("memref<{out}x{}xi8>", inp / block),
            _ => String::new(),
        };
        WeightArgs { weight, w: w.into(), s: s.into(), wty: format!("memref<{out}x{inp}x{}>", weight.mlir_elem()), sty }
    }

    fn params(&self) -> String {
        match self.weight {
            WeightType::Mxfp8 { .. } => format!("{}: {}, {}: {}", self.w, self.wty, self.s, self.sty),
            _ => format!("{}: {}", self.w, self.wty),
        }
    }

    /// `%{d}` = W[o, i] as f32.
    fn load(&self, d: &str, o: &str, i: &str) -> String {
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
    fn lanes(&self) -> usize {
        match self.weight {
            WeightType::F32 => 2,
            WeightType::BF16 | WeightType::F16 => 4,
            WeightType::Mxfp8 { .. } => 8,
        }
    }

    /// `%{d}` = W[o, i .. i + lanes] as `vector<lanes x f32>`, from one 8-byte
    /// load (`i` a multiple of `lanes`; MXFP8: all in one scale block).
    fn load_wide(&self, d: &str, o: &str, i: &str) -> String {
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

    fn consts(&self) -> String {
        match self.weight {
            WeightType::Mxfp8 { .. } => E8M0_CONSTANTS.to_string(),
            _ => String::new(),
        }
    }
}

fn func(name: &str, params: &str, body: &str) -> GpuFunc {
    GpuFunc {
        name: name.to_string(),
        text: expand_warp_reductions(&format!("    gpu.func @{name}({params}) kernel {{\n{}      gpu.return\n    }}\n", indent(body, 6))),
    }
}

/// Warp reductions, written `%d = gpu.subgroup_reduce OP %s : (T) -> T` in
/// the generators, expanded into a butterfly of `gpu.shuffle xor` (offsets
/// 16, 8, 4, 2, 1) so every lane ends with the result: the NVVM lowering has
/// no f32 subgroup reduction.
fn expand_warp_reductions(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for line in text.lines() {
        let t = line.trim_start();
        let pad = &line[..line.len() - t.len()];
        let parsed = (|| {
            let (dst, rest) = t.split_once(" = gpu.subgroup_reduce ")?;
            let (op, rest) = rest.split_once(' ')?;
            let (src, ty) = rest.split_once(" : (")?;
            let ty = ty.split_once(')')?.0;
            Some((dst.to_string(), op.to_string(), src.to_string(), ty.to_string()))
        })();
        let Some((dst, op, src, ty)) = parsed else {
            out.push_str(line);
            out.push('\n');
            continue;
        };
        let combine = match op.as_str() {
            "add" => "arith.addf",
            "maximumf" => "arith.maximumf",
            "minsi" => "arith.minsi",
            other => panic!("no warp reduction for `{other}`"),
        };
        let base = dst.trim_start_matches('%');
        out.push_str(&format!("{pad}%{base}_w32 = arith.constant 32 : i32\n"));
        let mut cur = src.clone();
        for (k, off) in [16, 8, 4, 2, 1].iter().enumerate() {
            out.push_str(&format!(
                "{pad}%{base}_o{k} = arith.constant {off} : i32\n\
                 {pad}%{base}_s{k}, %{base}_v{k} = gpu.shuffle xor {cur}, %{base}_o{k}, %{base}_w32 : {ty}\n"
            ));
            let next = if k == 4 { dst.clone() } else { format!("%{base}_r{k}") };
            out.push_str(&format!("{pad}{next} = {combine} {cur}, %{base}_s{k} : {ty}\n"));
            cur = next;
        }
    }
    out
}

const IDX: &str = "%c0 = arith.constant 0 : index\n\
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
fn warp_dots(tag: &str, wa: &WeightArgs, o: &str, x: &str, xt: &str, xs: Storage, rows: &[String], n: usize) -> String {
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
            s.push_str(&format!("%{tag}l{j} = vector.reduction <add>, %{tag}acc#{j} : {vt} into f32\n%{tag}s{j} = gpu.subgroup_reduce add %{tag}l{j} : (f32) -> f32\n"));
        } else {
            s.push_str(&format!("%{tag}s{j} = gpu.subgroup_reduce add %{tag}acc#{j} : (f32) -> f32\n"));
        }
    }
    s
}

const WARP_IDS: &str = "%tid = gpu.thread_id x\n\
     %lane = arith.remui %tid, %c32 : index\n\
     %warp = arith.divui %tid, %c32 : index\n";

impl Kernel {
    /// The `gpu.func` kernels this kernel runs as.
    pub fn gpu_funcs(&self) -> Vec<GpuFunc> {
        let sym = self.symbol();
        match self {
            Kernel::Embedding { vocab, width, weight, act } => {
                let wa = WeightArgs::new("%w", "", *vocab, *width, *weight);
                let yt = format!("memref<?x{width}x{}>", act.mlir_elem());
                let body = format!(
                    "{IDX}%r = gpu.block_id x\n%t = gpu.thread_id x\n%cw = arith.constant {width} : index\n\
                     %id64 = memref.load %ids[%r] : memref<?xi64>\n%id = arith.index_cast %id64 : i64 to index\n\
                     scf.for %c = %t to %cw step %c256 {{\n{}{}}}\n",
                    indent(&wa.load("v", "%id", "%c"), 2),
                    indent(&store_f32("%v", "%y", &yt, "%r", "%c", *act), 2)
                );
                vec![func(&sym, &format!("%ids: memref<?xi64>, {}, %y: {yt}", wa.params()), &body)]
            }
            Kernel::RmsNorm { width, eps, weight, act } => {
                let t = format!("memref<?x{width}x{}>", act.mlir_elem());
                let xl = indent(&load_f32("%v", "%x", &t, "%r", "%c", *act), 2);
                let wt = format!("memref<{width}x{}>", weight.mlir_elem());
                let wl = crate::emit::load_weight_f32("%wv", "%w", "%c", &wt, *weight);
                let body = format!(
                    "{IDX}%r = gpu.block_id x\n%t = gpu.thread_id x\n%cw = arith.constant {width} : index\n\
                     %n = arith.constant {n} : f32\n%eps = arith.constant {eps} : f32\n\
                     %part = scf.for %c = %t to %cw step %c256 iter_args(%a = %zero) -> (f32) {{\n\
                     {xl}  %q = arith.mulf %v, %v : f32\n  %a2 = arith.addf %a, %q : f32\n  scf.yield %a2 : f32\n}}\n\
                     %ss = gpu.all_reduce add %part uniform {{}} : (f32) -> (f32)\n\
                     %mean = arith.divf %ss, %n : f32\n%me = arith.addf %mean, %eps : f32\n%rs = math.rsqrt %me : f32\n\
                     scf.for %c = %t to %cw step %c256 {{\n\
                     {xl}{}\
                     \x20 %s = arith.addf %one, %wv : f32\n  %u = arith.mulf %v, %rs : f32\n  %o = arith.mulf %u, %s : f32\n\
                     {}}}\n",
                    indent(&wl, 2),
                    indent(&store_f32("%o", "%y", &t, "%r", "%c", *act), 2),
                    n = f32_lit(*width as f64),
                    eps = f32_lit(*eps),
                );
                vec![func(&sym, &format!("%x: {t}, %w: {wt}, %y: {t}"), &body)]
            }
            Kernel::Linear { inp, out, weight, act, out_act } => {
                // A warp per output row, looping over the activation rows
                // four at a time: each weight element is loaded (and, for
                // MXFP8, decoded) once per four rows, so a decode
                // micro-batch of up to four sequences reads each weight byte
                // once. Rows past the end are clamped for the loads and not stored.
                // `{sym}_r1` takes one row per pass: a batch-1 decode step
                // then does no clamped duplicate work.
                let wa = WeightArgs::new("%w", "%s", *out, *inp, *weight);
                let xt = format!("memref<?x{inp}x{}>", act.mlir_elem());
                let yt = format!("memref<?x{out}x{}>", out_act.mlir_elem());
                let mut funcs = Vec::new();
                for (rows, name) in [(ROWS_PER_PASS, sym.clone()), (1, format!("{sym}_r1"))] {
                    let mut clamp = String::new();
                    for j in 0..rows {
                        clamp.push_str(&format!(
                            "%cj{j} = arith.constant {j} : index\n%ru{j} = arith.addi %rb, %cj{j} : index\n\
                             %ok{j} = arith.cmpi ult, %ru{j}, %rows : index\n%r{j} = arith.select %ok{j}, %ru{j}, %rb : index\n"
                        ));
                    }
                    let names: Vec<String> = (0..rows).map(|j| format!("%r{j}")).collect();
                    let mut stores = String::new();
                    for j in 0..rows {
                        stores.push_str(&format!(
                            "%st{j} = arith.andi %first, %ok{j} : i1\n\
                             scf.if %st{j} {{\n{}}}\n",
                            indent(&store_f32(&format!("%ys{j}"), "%y", &yt, &format!("%r{j}"), "%o", *out_act), 2)
                        ));
                    }
                    let body = format!(
                        "{IDX}{WARP_IDS}{consts}%bx = gpu.block_id x\n%cwarps = arith.constant {WARPS} : index\n\
                         %ob = arith.muli %bx, %cwarps : index\n%o = arith.addi %ob, %warp : index\n\
                         %cout = arith.constant {out} : index\n%ok = arith.cmpi ult, %o, %cout : index\n\
                         %rows = memref.dim %x, %c0 : {xt}\n%cr = arith.constant {rows} : index\n\
                         %first = arith.cmpi eq, %lane, %c0 : index\n\
                         scf.if %ok {{\n\
                         \x20 scf.for %rb = %c0 to %rows step %cr {{\n\
                         {clamp}\
                         {dots}\
                         {stores}\
                         \x20 }}\n\
                         }}\n",
                        consts = wa.consts(),
                        clamp = indent(&clamp, 4),
                        dots = indent(&warp_dots("y", &wa, "%o", "%x", &xt, *act, &names, *inp), 4),
                        stores = indent(&stores, 4),
                    );
                    funcs.push(func(&name, &format!("%x: {xt}, {}, %y: {yt}", wa.params()), &body));
                }
                funcs
            }
            Kernel::HeadNormRope { heads, head_dim, rotary_dim, theta, eps, weight, act } => {
                let (d, half) = (*head_dim, rotary_dim / 2);
                let t = format!("memref<?x{}x{}>", heads * d, act.mlir_elem());
                let st = |v: &str, c: &str| store_f32(v, "%y", &t, "%r", c, *act);
                let wt = format!("memref<{d}x{}>", weight.mlir_elem());
                let inv: Vec<String> =
                    (0..half.max(1)).map(|j| f32_lit((1.0 / (*theta as f32).powf((2 * j) as f32 / *rotary_dim as f32)) as f64)).collect();
                let wl = crate::emit::load_weight_f32("%wv", "%w", "%t", &wt, *weight);
                let body = format!(
                    "{IDX}%r = gpu.block_id x\n%h = gpu.block_id y\n%t = gpu.thread_id x\n\
                     %cd = arith.constant {d} : index\n%chalf = arith.constant {half} : index\n%crot = arith.constant {rotary_dim} : index\n\
                     %n = arith.constant {nf} : f32\n%eps = arith.constant {epsf} : f32\n\
                     %inv = arith.constant dense<[{inv}]> : vector<{hv}xf32>\n\
                     %base = arith.muli %h, %cd : index\n%col = arith.addi %base, %t : index\n\
                     {xl}%q = arith.mulf %v, %v : f32\n\
                     %ss = gpu.all_reduce add %q uniform {{}} : (f32) -> (f32)\n\
                     %mean = arith.divf %ss, %n : f32\n%me = arith.addf %mean, %eps : f32\n%rs = math.rsqrt %me : f32\n\
                     {wl}%s = arith.addf %one, %wv : f32\n%u = arith.mulf %v, %rs : f32\n%nv = arith.mulf %u, %s : f32\n\
                     memref.store %nv, %sh[%t] : memref<{d}xf32, #gpu.address_space<workgroup>>\n\
                     gpu.barrier\n\
                     %p64 = memref.load %pos[%r] : memref<?xi64>\n%pf = arith.sitofp %p64 : i64 to f32\n\
                     %lo = arith.cmpi ult, %t, %chalf : index\n\
                     scf.if %lo {{\n\
                     \x20 %f = vector.extract %inv[%t] : f32 from vector<{hv}xf32>\n\
                     \x20 %ang = arith.mulf %pf, %f : f32\n  %cs = math.cos %ang : f32\n  %sn = math.sin %ang : f32\n\
                     \x20 %j2 = arith.addi %t, %chalf : index\n\
                     \x20 %a = memref.load %sh[%t] : memref<{d}xf32, #gpu.address_space<workgroup>>\n\
                     \x20 %b = memref.load %sh[%j2] : memref<{d}xf32, #gpu.address_space<workgroup>>\n\
                     \x20 %ac = arith.mulf %a, %cs : f32\n  %bs = arith.mulf %b, %sn : f32\n  %y1 = arith.subf %ac, %bs : f32\n\
                     \x20 %bc = arith.mulf %b, %cs : f32\n  %as = arith.mulf %a, %sn : f32\n  %y2 = arith.addf %bc, %as : f32\n\
                     \x20 %o2 = arith.addi %base, %j2 : index\n\
                     {st12}\
                     }}\n\
                     %pass = arith.cmpi uge, %t, %crot : index\n\
                     scf.if %pass {{\n{stp}}}\n",
                    xl = load_f32("%v", "%x", &t, "%r", "%col", *act),
                    st12 = indent(&format!("{}{}", st("%y1", "%col"), st("%y2", "%o2")), 2),
                    stp = indent(&st("%nv", "%col"), 2),
                    nf = f32_lit(d as f64),
                    epsf = f32_lit(*eps),
                    inv = inv.join(", "),
                    hv = half.max(1),
                );
                vec![GpuFunc {
                    name: sym.clone(),
                    text: format!(
                        "    gpu.func @{sym}(%x: {t}, %w: {wt}, %pos: memref<?xi64>, %y: {t}) workgroup(%sh: memref<{d}xf32, #gpu.address_space<workgroup>>) kernel {{\n{}      gpu.return\n    }}\n",
                        indent(&body, 6)
                    ),
                }]
            }
            Kernel::SwiGluOai { width, alpha, limit, beta, act } => {
                let t = format!("memref<?x{width}x{}>", act.mlir_elem());
                let body = format!(
                    "{IDX}%r = gpu.block_id x\n%t = gpu.thread_id x\n%cw = arith.constant {width} : index\n\
                     %alpha = arith.constant {a} : f32\n%lim = arith.constant {l} : f32\n%nlim = arith.constant {nl} : f32\n%beta = arith.constant {b} : f32\n\
                     scf.for %i = %t to %cw step %c256 {{\n\
                     {gl}{ul}\
                     \x20 %gc = arith.minimumf %gv, %lim : f32\n  %u1 = arith.minimumf %uv, %lim : f32\n  %uc = arith.maximumf %u1, %nlim : f32\n\
                     \x20 %ag = arith.mulf %alpha, %gc : f32\n  %nag = arith.negf %ag : f32\n  %e = math.exp %nag : f32\n\
                     \x20 %den = arith.addf %one, %e : f32\n  %sig = arith.divf %one, %den : f32\n  %glu = arith.mulf %gc, %sig : f32\n\
                     \x20 %up = arith.addf %uc, %beta : f32\n  %o = arith.mulf %glu, %up : f32\n{yst}}}\n",
                    gl = indent(&load_f32("%gv", "%g", &t, "%r", "%i", *act), 2),
                    ul = indent(&load_f32("%uv", "%u", &t, "%r", "%i", *act), 2),
                    yst = indent(&store_f32("%o", "%y", &t, "%r", "%i", *act), 2),
                    a = f32_lit(*alpha),
                    l = f32_lit(*limit),
                    nl = f32_lit(-limit),
                    b = f32_lit(*beta),
                );
                vec![func(&sym, &format!("%g: {t}, %u: {t}, %y: {t}"), &body)]
            }
            Kernel::Add { width, act } => {
                let t = format!("memref<?x{width}x{}>", act.mlir_elem());
                let body = format!(
                    "{IDX}%r = gpu.block_id x\n%t = gpu.thread_id x\n%cw = arith.constant {width} : index\n\
                     scf.for %i = %t to %cw step %c256 {{\n{}{}  %s = arith.addf %x, %z : f32\n{}}}\n",
                    indent(&load_f32("%x", "%a", &t, "%r", "%i", *act), 2),
                    indent(&load_f32("%z", "%b", &t, "%r", "%i", *act), 2),
                    indent(&store_f32("%s", "%y", &t, "%r", "%i", *act), 2),
                );
                vec![func(&sym, &format!("%a: {t}, %b: {t}, %y: {t}"), &body)]
            }
            Kernel::ScatterRows { width, cache, act } => {
                let t = format!("memref<?x{width}x{}>", act.mlir_elem());
                let yt = format!("memref<?x{width}x{}>", cache.mlir_elem());
                let body = format!(
                    "{IDX}%r = gpu.block_id x\n%t = gpu.thread_id x\n%cw = arith.constant {width} : index\n\
                     %p64 = memref.load %pos[%r] : memref<?xi64>\n%p = arith.index_cast %p64 : i64 to index\n\
                     scf.for %i = %t to %cw step %c256 {{\n{}{}}}\n",
                    indent(&load_f32("%v", "%x", &t, "%r", "%i", *act), 2),
                    indent(&store_f32("%v", "%y", &yt, "%p", "%i", *cache), 2)
                );
                vec![func(&sym, &format!("%x: {t}, %pos: memref<?xi64>, %y: {yt}"), &body)]
            }
            Kernel::ToBf16 { width } => {
                let t = format!("memref<?x{width}xf32>");
                let yt = format!("memref<?x{width}xi16>");
                let body = format!(
                    "{IDX}%r = gpu.block_id x\n%t = gpu.thread_id x\n%cw = arith.constant {width} : index\n\
                     scf.for %i = %t to %cw step %c256 {{\n  %v = memref.load %x[%r, %i] : {t}\n{}}}\n",
                    indent(&crate::emit::store_f32("%v", "%y", &yt, "%r", "%i", crate::Storage::Bf16), 2)
                );
                vec![func(&sym, &format!("%x: {t}, %y: {yt}"), &body)]
            }
            Kernel::DequantMxfp8 { out, inp, block } => {
                // A block per weight row; threads stride its columns.
                let wa = WeightArgs::new("%w", "%s", *out, *inp, WeightType::Mxfp8 { block: *block });
                let yt = format!("memref<?x{inp}xi16>");
                let body = format!(
                    "{IDX}{consts}%o = gpu.block_id x\n%t = gpu.thread_id x\n%cw = arith.constant {inp} : index\n\
                     scf.for %i = %t to %cw step %c256 {{\n{}{}}}\n",
                    indent(&wa.load("v", "%o", "%i"), 2),
                    indent(&store_f32("%v", "%y", &yt, "%o", "%i", Storage::Bf16), 2),
                    consts = wa.consts(),
                );
                vec![func(&sym, &format!("{}, %y: {yt}", wa.params()), &body)]
            }
            Kernel::Argmax { width } => {
                let t = format!("memref<?x{width}xf32>");
                let body = format!(
                    "{IDX}%r = gpu.block_id x\n%lane = gpu.thread_id x\n%cw = arith.constant {width} : index\n\
                     %big = arith.constant 2147483647 : i32\n\
                     %best:2 = scf.for %i = %lane to %cw step %c32 iter_args(%bv = %ninf, %bi = %cw) -> (f32, index) {{\n\
                     \x20 %v0 = memref.load %x[%r, %i] : {t}\n  %isnan = arith.cmpf uno, %v0, %v0 : f32\n  %v = arith.select %isnan, %ninf, %v0 : f32\n\
                     \x20 %gt0 = arith.cmpf ogt, %v, %bv : f32\n  %none = arith.cmpi eq, %bi, %cw : index\n  %gt = arith.ori %gt0, %none : i1\n\
                     \x20 %nv = arith.select %gt, %v, %bv : f32\n  %ni = arith.select %gt, %i, %bi : index\n  scf.yield %nv, %ni : f32, index\n}}\n\
                     %m = gpu.subgroup_reduce maximumf %best#0 : (f32) -> f32\n\
                     %is = arith.cmpf oeq, %best#0, %m : f32\n\
                     %bi32 = arith.index_cast %best#1 : index to i32\n\
                     %cand = arith.select %is, %bi32, %big : i32\n\
                     %win = gpu.subgroup_reduce minsi %cand : (i32) -> i32\n\
                     %first = arith.cmpi eq, %lane, %c0 : index\n\
                     scf.if %first {{\n  %id = arith.extsi %win : i32 to i64\n  memref.store %id, %ids[%r] : memref<?xi64>\n}}\n"
                );
                vec![func(&sym, &format!("%x: {t}, %ids: memref<?xi64>"), &body)]
            }
            Kernel::Router { width, experts, top_k, scale, weight, bias, act } => {
                let ht = format!("memref<?x{width}x{}>", act.mlir_elem());
                let wa = WeightArgs::new("%w", "", *experts, *width, *weight);
                let e = *experts;
                let wts = format!("memref<?x{top_k}xf32>");
                let ids = format!("memref<?x{top_k}xi64>");
                let sh = format!("memref<{e}xf32, #gpu.address_space<workgroup>>");
                let (bias_param, bias_add) = match bias {
                    Some(bt) => {
                        let bty = format!("memref<{e}x{}>", bt.mlir_elem());
                        (
                            format!(", %bias: {bty}"),
                            format!(
                                "{}    %ch = arith.addf %sg, %bv : f32\n",
                                indent(&crate::emit::load_weight_f32("%bv", "%bias", "%e", &bty, *bt), 4)
                            ),
                        )
                    }
                    None => (String::new(), "    %ch = arith.addf %sg, %zero : f32\n".into()),
                };
                let body = format!(
                    "{IDX}%r = gpu.block_id x\n%lane = gpu.thread_id x\n%ce = arith.constant {e} : index\n%ck = arith.constant {top_k} : index\n\
                     %scale = arith.constant {sc} : f32\n%first = arith.cmpi eq, %lane, %c0 : index\n\
                     scf.for %e = %c0 to %ce step %c1 {{\n\
                     {dot}\
                     \x20 scf.if %first {{\n\
                     \x20   %nl = arith.negf %ls0 : f32\n    %ex = math.exp %nl : f32\n    %den = arith.addf %one, %ex : f32\n    %sg = arith.divf %one, %den : f32\n\
                     \x20   memref.store %sg, %ss[%e] : {sh}\n\
                     {bias_add}\
                     \x20   %chnan = arith.cmpf uno, %ch, %ch : f32\n    %chs = arith.select %chnan, %ninf, %ch : f32\n\
                     \x20   memref.store %chs, %sc_[%e] : {sh}\n\
                     \x20 }}\n\
                     }}\n\
                     scf.if %first {{\n\
                     \x20 %sum = scf.for %j = %c0 to %ck step %c1 iter_args(%acc = %zero) -> (f32) {{\n\
                     \x20   %best:2 = scf.for %e = %c0 to %ce step %c1 iter_args(%bv = %ninf, %bi = %ce) -> (f32, index) {{\n\
                     \x20     %v = memref.load %sc_[%e] : {sh}\n      %free = arith.cmpf ord, %v, %v : f32\n      %gt0 = arith.cmpf ogt, %v, %bv : f32\n\
                     \x20     %none = arith.cmpi eq, %bi, %ce : index\n      %better = arith.ori %gt0, %none : i1\n      %gt = arith.andi %free, %better : i1\n\
                     \x20     %nv = arith.select %gt, %v, %bv : f32\n      %ni = arith.select %gt, %e, %bi : index\n      scf.yield %nv, %ni : f32, index\n    }}\n\
                     \x20   %taken = arith.constant 0x7FC00000 : f32\n    memref.store %taken, %sc_[%best#1] : {sh}\n\
                     \x20   %id = arith.index_cast %best#1 : index to i64\n    memref.store %id, %ids[%r, %j] : {ids}\n\
                     \x20   %sv = memref.load %ss[%best#1] : {sh}\n    memref.store %sv, %wts[%r, %j] : {wts}\n\
                     \x20   %acc2 = arith.addf %acc, %sv : f32\n    scf.yield %acc2 : f32\n  }}\n\
                     \x20 scf.for %j = %c0 to %ck step %c1 {{\n\
                     \x20   %sv = memref.load %wts[%r, %j] : {wts}\n    %nw = arith.divf %sv, %sum : f32\n    %sw = arith.mulf %nw, %scale : f32\n\
                     \x20   memref.store %sw, %wts[%r, %j] : {wts}\n  }}\n\
                     }}\n",
                    sc = f32_lit(*scale),
                    dot = indent(&warp_dots("l", &wa, "%e", "%h", &ht, *act, &["%r".to_string()], *width), 2),
                );
                vec![GpuFunc {
                    name: sym.clone(),
                    text: expand_warp_reductions(&format!(
                        "    gpu.func @{sym}(%h: {ht}, {}{bias_param}, %wts: {wts}, %ids: {ids}) workgroup(%ss: {sh}, %sc_: {sh}) kernel {{\n{}      gpu.return\n    }}\n",
                        wa.params(),
                        indent(&body, 6)
                    )),
                }]
            }
            Kernel::Attention { heads, kv_heads, head_dim, scale, sparse, cache, act } => {
                vec![attention(&sym, *heads, *kv_heads, *head_dim, *scale, *sparse, *cache, *act)]
            }
            Kernel::RoutedExperts { experts, hidden, inter, top_k, weight, alpha, limit, beta, act } => {
                routed_experts(&sym, *experts, *hidden, *inter, *top_k, *weight, *alpha, *limit, *beta, *act)
            }
        }
    }

    /// Host statements launching this kernel on the GPU. `args` are the SSA
    /// names and types of the host kernel's arguments, in order; `rows` is
    /// the step's row count (an index SSA name); `tag` makes local names unique.
    pub fn gpu_call(&self, args: &[(String, String)], rows: &str, tag: &str) -> GpuCall {
        let sym = self.symbol();
        let launch = |name: &str, grid: [&str; 3], block: usize, a: &[(String, String)]| -> String {
            let list: Vec<String> = a.iter().map(|(n, t)| format!("{n} : {t}")).collect();
            format!(
                "gpu.launch_func @{GPU_MODULE}::@{name} blocks in ({}, {}, {}) threads in (%g{tag}_b{block}, %g{tag}_one, %g{tag}_one) args({})\n",
                grid[0],
                grid[1],
                grid[2],
                list.join(", ")
            )
        };
        let mut text = format!("%g{tag}_one = arith.constant 1 : index\n");
        for b in [32usize, 256] {
            text.push_str(&format!("%g{tag}_b{b} = arith.constant {b} : index\n"));
        }
        let one = format!("%g{tag}_one");
        let mut host_views = Vec::new();
        match self {
            Kernel::Linear { out, .. } => {
                text.push_str(&format!("%g{tag}_ob = arith.constant {} : index\n", out.div_ceil(WARPS)));
                // One block per 8 output rows; each warp covers every activation
                // row (one at a time for a single row, else four at a time).
                let ob = format!("%g{tag}_ob");
                text.push_str(&format!(
                    "%g{tag}_single = arith.cmpi eq, {rows}, %g{tag}_one : index\nscf.if %g{tag}_single {{\n{}}} else {{\n{}}}\n",
                    indent(&launch(&format!("{sym}_r1"), [&ob, &one, &one], BLOCK, args), 2),
                    indent(&launch(&sym, [&ob, &one, &one], BLOCK, args), 2)
                ));
            }
            Kernel::HeadNormRope { heads, head_dim, .. } => {
                text.push_str(&format!("%g{tag}_h = arith.constant {heads} : index\n%g{tag}_d = arith.constant {head_dim} : index\n"));
                let list: Vec<String> = args.iter().map(|(n, t)| format!("{n} : {t}")).collect();
                text.push_str(&format!(
                    "gpu.launch_func @{GPU_MODULE}::@{sym} blocks in ({rows}, %g{tag}_h, {one}) threads in (%g{tag}_d, {one}, {one}) args({})\n",
                    list.join(", ")
                ));
            }
            Kernel::Argmax { .. } | Kernel::Router { .. } => text.push_str(&launch(&sym, [rows, &one, &one], 32, args)),
            Kernel::DequantMxfp8 { out, .. } => {
                text.push_str(&format!("%g{tag}_o = arith.constant {out} : index\n"));
                text.push_str(&launch(&sym, [&format!("%g{tag}_o"), &one, &one], BLOCK, args));
            }
            Kernel::Attention { kv_heads, sparse, .. } => {
                text.push_str(&format!("%g{tag}_kv = arith.constant {kv_heads} : index\n"));
                let mut a = args.to_vec();
                if let Some(s) = sparse {
                    // Per (row, group) block scores and selection flags, in global scratch.
                    let (k_name, k_ty) = &args[1];
                    text.push_str(&format!(
                        "%g{tag}_c0 = arith.constant 0 : index\n\
                         %g{tag}_ctx = memref.dim {k_name}, %g{tag}_c0 : {k_ty}\n\
                         %g{tag}_bm1 = arith.constant {} : index\n\
                         %g{tag}_bsz = arith.constant {} : index\n\
                         %g{tag}_cp = arith.addi %g{tag}_ctx, %g{tag}_bm1 : index\n\
                         %g{tag}_nbmax = arith.divui %g{tag}_cp, %g{tag}_bsz : index\n\
                         %g{tag}_rk = arith.muli {rows}, %g{tag}_kv : index\n\
                         %g{tag}_n = arith.muli %g{tag}_rk, %g{tag}_nbmax : index\n",
                        s.block - 1,
                        s.block
                    ));
                    let (a1, t1) = device_buffer(&format!("%g{tag}_bs"), &format!("%g{tag}_n"), 0, "f32");
                    let (a2, t2) = device_buffer(&format!("%g{tag}_sel"), &format!("%g{tag}_n"), 0, "i32");
                    text.push_str(&a1);
                    text.push_str(&a2);
                    host_views.push(t1);
                    host_views.push(t2);
                    let o = a.pop().expect("attention has an output");
                    a.push((format!("%g{tag}_bs"), "memref<?xf32>".into()));
                    a.push((format!("%g{tag}_sel"), "memref<?xi32>".into()));
                    a.push((format!("%g{tag}_nbmax"), "index".into()));
                    a.push(o);
                }
                text.push_str(&launch(&sym, [rows, &format!("%g{tag}_kv"), &one], 32, &a));
                if sparse.is_some() {
                    text.push_str(&format!(
                        "func.call @m3c_buf_free(%g{tag}_bs_p) : (!llvm.ptr) -> ()\nfunc.call @m3c_buf_free(%g{tag}_sel_p) : (!llvm.ptr) -> ()\n"
                    ));
                }
            }
            Kernel::RoutedExperts { experts, hidden, inter, top_k, weight, .. } => {
                // args: h, wts, ids, table, y
                let (h, wts, ids, table, y) = (&args[0], &args[1], &args[2], &args[3], &args[4]);
                text.push_str(&format!(
                    "%g{tag}_k = arith.constant {top_k} : index\n\
                     %g{tag}_pairs = arith.muli {rows}, %g{tag}_k : index\n\
                     %g{tag}_ne = arith.constant {experts} : index\n\
                     %g{tag}_ne1 = arith.constant {} : index\n\
                     %g{tag}_slots = arith.minui %g{tag}_ne, %g{tag}_pairs : index\n\
                     %g{tag}_ib = arith.constant {} : index\n\
                     %g{tag}_hb = arith.constant {} : index\n",
                    experts + 1,
                    inter.div_ceil(WARPS),
                    hidden.div_ceil(WARPS)
                ));
                let mut bufs = Vec::new();
                for (n, count, width, elem) in [
                    ("act", format!("%g{tag}_pairs"), *inter, "f32"),
                    ("dn", format!("%g{tag}_pairs"), *hidden, "f32"),
                    ("start", format!("%g{tag}_ne1"), 0, "i32"),
                    ("order", format!("%g{tag}_pairs"), 0, "i32"),
                    ("active", format!("%g{tag}_slots"), 0, "i32"),
                ] {
                    let (a, t) = device_buffer(&format!("%g{tag}_{n}"), &count, width, elem);
                    text.push_str(&a);
                    bufs.push((format!("%g{tag}_{n}"), t.mlir()));
                    host_views.push(t);
                }
                let (act, dn, start, order, active) = (&bufs[0], &bufs[1], &bufs[2], &bufs[3], &bufs[4]);
                let grouping = [start.clone(), order.clone(), active.clone()];
                let mut group_args = vec![ids.clone()];
                group_args.extend(grouping.iter().cloned());
                text.push_str(&launch(&format!("{sym}_group"), [&one, &one, &one], BLOCK, &group_args));
                let mut up_args = vec![h.clone()];
                up_args.extend(grouping.iter().cloned());
                up_args.extend([table.clone(), act.clone()]);
                for kernel in ["up_r1", "up"] {
                    text.push_str(&launch(
                        &format!("{sym}_{kernel}"),
                        [&format!("%g{tag}_slots"), &format!("%g{tag}_ib"), &one],
                        BLOCK,
                        &up_args,
                    ));
                }
                let mut down_args = vec![act.clone()];
                down_args.extend(grouping.iter().cloned());
                down_args.extend([table.clone(), dn.clone()]);
                for kernel in ["down_r1", "down"] {
                    text.push_str(&launch(
                        &format!("{sym}_{kernel}"),
                        [&format!("%g{tag}_slots"), &format!("%g{tag}_hb"), &one],
                        BLOCK,
                        &down_args,
                    ));
                }
                text.push_str(&launch(&format!("{sym}_combine"), [rows, &one, &one], BLOCK, &[dn.clone(), wts.clone(), y.clone()]));
                for n in ["act", "dn", "start", "order", "active"] {
                    text.push_str(&format!("func.call @m3c_buf_free(%g{tag}_{n}_p) : (!llvm.ptr) -> ()\n"));
                }
                return GpuCall { text, device_views: moe::expert_tensor_types(*hidden, *inter, *weight), host_views };
            }
            _ => text.push_str(&launch(&sym, [rows, &one, &one], BLOCK, args)),
        }
        GpuCall { text, device_views: Vec::new(), host_views }
    }
}

/// Attention on the GPU: one warp per (query row, KV group). `q`, `iq` and
/// `o` hold values stored as `act`.
#[allow(clippy::too_many_arguments)]
fn attention(
    name: &str,
    heads: usize,
    kv_heads: usize,
    d: usize,
    scale: f64,
    sparse: Option<SparseSel>,
    cache: Storage,
    act: Storage,
) -> GpuFunc {
    let group = heads / kv_heads;
    let qt = format!("memref<?x{}x{}>", heads * d, act.mlir_elem());
    let kt = format!("memref<?x{}x{}>", kv_heads * d, cache.mlir_elem());
    let load = |dst: &str, mem: &str, ty: &str, r: &str, c: &str| crate::emit::load_f32(dst, mem, ty, r, c, cache);
    let mut params = format!("%q: {qt}, %k: {kt}, %v: {kt}, %pos: memref<?xi64>");
    let mut select = String::new();
    let mut allowed = "%allowed = arith.constant true\n".to_string();
    if let Some(s) = sparse {
        let iqt = format!("memref<?x{}x{}>", s.index_heads * s.index_dim, act.mlir_elem());
        let ikt = format!("memref<?x{}x{}>", s.index_dim, cache.mlir_elem());
        params.push_str(&format!(", %iq: {iqt}, %ik: {ikt}, %bs: memref<?xf32>, %sel: memref<?xi32>, %nbmax: index"));
        select = format!(
            "%cB = arith.constant {block} : index\n%cK = arith.constant {topk} : index\n%cid = arith.constant {id} : index\n\
             %clocal = arith.constant {local} : index\n%cinit = arith.constant {init} : index\n\
             %i0 = arith.constant 0 : i32\n%i1 = arith.constant 1 : i32\n%big = arith.constant 2147483647 : i32\n\
             %row0 = arith.muli %r, %ckv : index\n%row = arith.addi %row0, %g : index\n%rbase = arith.muli %row, %nbmax : index\n\
             %bq = arith.divui %p, %cB : index\n%nb = arith.addi %bq, %c1 : index\n%iqb = arith.muli %g, %cid : index\n\
             // Block scores: lane-strided blocks, max over the block's causal keys.\n\
             scf.for %b = %lane to %nb step %c32 {{\n\
             \x20 %t0 = arith.muli %b, %cB : index\n  %t1a = arith.addi %t0, %cB : index\n  %t1 = arith.minui %t1a, %nk : index\n\
             \x20 %mx = scf.for %t = %t0 to %t1 step %c1 iter_args(%m = %ninf) -> (f32) {{\n\
             \x20   %dot = scf.for %c = %c0 to %cid step %c1 iter_args(%a = %zero) -> (f32) {{\n\
             \x20     %qc = arith.addi %iqb, %c : index\n{iq_load}{ik_load}\
             \x20     %mm = arith.mulf %x1, %x2 : f32\n      %a2 = arith.addf %a, %mm : f32\n      scf.yield %a2 : f32\n    }}\n\
             \x20   %m2 = arith.maximumf %m, %dot : f32\n    scf.yield %m2 : f32\n  }}\n\
             \x20 %bl = arith.addi %b, %clocal : index\n  %isloc = arith.cmpi ugt, %bl, %bq : index\n  %isinit = arith.cmpi ult, %b, %cinit : index\n\
             \x20 %forced = arith.ori %isloc, %isinit : i1\n  %val = arith.select %forced, %pinf, %mx : f32\n\
             \x20 %at = arith.addi %rbase, %b : index\n  memref.store %val, %bs[%at] : memref<?xf32>\n  memref.store %i0, %sel[%at] : memref<?xi32>\n\
             }}\n\
             gpu.barrier\n\
             // Top-k by repeated warp argmax; ties go to the lower block.\n\
             scf.for %s = %c0 to %cK step %c1 {{\n\
             \x20 %best:2 = scf.for %b = %lane to %nb step %c32 iter_args(%bv = %ninf, %bi = %nb) -> (f32, index) {{\n\
             \x20   %at = arith.addi %rbase, %b : index\n    %tk = memref.load %sel[%at] : memref<?xi32>\n    %free = arith.cmpi eq, %tk, %i0 : i32\n\
             \x20   %x = memref.load %bs[%at] : memref<?xf32>\n    %gt = arith.cmpf ogt, %x, %bv : f32\n    %ok = arith.andi %free, %gt : i1\n\
             \x20   %nv = arith.select %ok, %x, %bv : f32\n    %ni = arith.select %ok, %b, %bi : index\n    scf.yield %nv, %ni : f32, index\n  }}\n\
             \x20 %wm = gpu.subgroup_reduce maximumf %best#0 : (f32) -> f32\n\
             \x20 %mine = arith.cmpf oeq, %best#0, %wm : f32\n  %bi32 = arith.index_cast %best#1 : index to i32\n\
             \x20 %cand = arith.select %mine, %bi32, %big : i32\n  %win = gpu.subgroup_reduce minsi %cand : (i32) -> i32\n\
             \x20 %found = arith.cmpf ogt, %wm, %ninf : f32\n  %lead = arith.cmpi eq, %lane, %c0 : index\n  %mark = arith.andi %found, %lead : i1\n\
             \x20 scf.if %mark {{\n    %wi = arith.index_cast %win : i32 to index\n    %at = arith.addi %rbase, %wi : index\n    memref.store %i1, %sel[%at] : memref<?xi32>\n  }}\n\
             \x20 gpu.barrier\n\
             }}\n",
            block = s.block,
            topk = s.topk,
            id = s.index_dim,
            local = s.local,
            init = s.init,
            iq_load = indent(&load_f32("%x1", "%iq", &iqt, "%r", "%qc", act), 6),
            ik_load = indent(&load("%x2", "%ik", &ikt, "%t", "%c"), 6),
        );
        allowed = "%tb = arith.divui %t, %cB : index\n%at = arith.addi %rbase, %tb : index\n%sv = memref.load %sel[%at] : memref<?xi32>\n%allowed = arith.cmpi ne, %sv, %i0 : i32\n".into();
    }
    params.push_str(&format!(", %o: {qt}"));
    let body = format!(
        "{IDX}%r = gpu.block_id x\n%g = gpu.block_id y\n%lane = gpu.thread_id x\n\
         %cg = arith.constant {group} : index\n%ckv = arith.constant {kv_heads} : index\n%cd = arith.constant {d} : index\n\
         %scale = arith.constant {sc} : f32\n\
         %p64 = memref.load %pos[%r] : memref<?xi64>\n%p = arith.index_cast %p64 : i64 to index\n%nk = arith.addi %p, %c1 : index\n\
         {select}\
         %kb = arith.muli %g, %cd : index\n\
         %acc = memref.alloca() : memref<{d}xf32>\n\
         scf.for %hh = %c0 to %cg step %c1 {{\n\
         \x20 %gi = arith.muli %g, %cg : index\n  %i = arith.addi %gi, %hh : index\n  %qb = arith.muli %i, %cd : index\n\
         \x20 scf.for %c = %c0 to %cd step %c1 {{\n    memref.store %zero, %acc[%c] : memref<{d}xf32>\n  }}\n\
         \x20 // Online softmax over this lane's keys.\n\
         \x20 %ml:2 = scf.for %t = %lane to %nk step %c32 iter_args(%m = %ninf, %l = %zero) -> (f32, f32) {{\n\
         {allowed}\
         \x20   %res:2 = scf.if %allowed -> (f32, f32) {{\n\
         \x20     %dot = scf.for %c = %c0 to %cd step %c1 iter_args(%a = %zero) -> (f32) {{\n\
         \x20       %qc = arith.addi %qb, %c : index\n        %kc = arith.addi %kb, %c : index\n\
         {q_load}{k_load}\
         \x20       %mm = arith.mulf %x1, %x2 : f32\n        %a2 = arith.addf %a, %mm : f32\n        scf.yield %a2 : f32\n      }}\n\
         \x20     %s = arith.mulf %dot, %scale : f32\n      %m2 = arith.maximumf %m, %s : f32\n\
         \x20     %dm = arith.subf %m, %m2 : f32\n      %cold = math.exp %dm : f32\n      %ds = arith.subf %s, %m2 : f32\n      %pw = math.exp %ds : f32\n\
         \x20     %lc = arith.mulf %l, %cold : f32\n      %l2 = arith.addf %lc, %pw : f32\n\
         \x20     scf.for %c = %c0 to %cd step %c1 {{\n\
         \x20       %vc = arith.addi %kb, %c : index\n{v_load}        %av = memref.load %acc[%c] : memref<{d}xf32>\n\
         \x20       %a1 = arith.mulf %av, %cold : f32\n        %pv = arith.mulf %pw, %vv : f32\n        %a2 = arith.addf %a1, %pv : f32\n\
         \x20       memref.store %a2, %acc[%c] : memref<{d}xf32>\n      }}\n\
         \x20     scf.yield %m2, %l2 : f32, f32\n    }} else {{\n      scf.yield %m, %l : f32, f32\n    }}\n\
         \x20   scf.yield %res#0, %res#1 : f32, f32\n  }}\n\
         \x20 // Merge the lanes: one max, rescaled sums.\n\
         \x20 %gm = gpu.subgroup_reduce maximumf %ml#0 : (f32) -> f32\n\
         \x20 %dl = arith.subf %ml#0, %gm : f32\n  %f = math.exp %dl : f32\n  %lf = arith.mulf %ml#1, %f : f32\n\
         \x20 %gl = gpu.subgroup_reduce add %lf : (f32) -> f32\n  %inv = arith.divf %one, %gl : f32\n\
         \x20 %lead = arith.cmpi eq, %lane, %c0 : index\n\
         \x20 scf.for %c = %c0 to %cd step %c1 {{\n\
         \x20   %av = memref.load %acc[%c] : memref<{d}xf32>\n    %af = arith.mulf %av, %f : f32\n\
         \x20   %sum = gpu.subgroup_reduce add %af : (f32) -> f32\n    %ov = arith.mulf %sum, %inv : f32\n\
         \x20   scf.if %lead {{\n      %oc = arith.addi %qb, %c : index\n{o_store}    }}\n  }}\n\
         }}\n",
        sc = f32_lit(scale),
        allowed = indent(&allowed, 4),
        q_load = indent(&load_f32("%x1", "%q", &qt, "%r", "%qc", act), 8),
        o_store = indent(&store_f32("%ov", "%o", &qt, "%r", "%oc", act), 6),
        k_load = indent(&load("%x2", "%k", &kt, "%t", "%kc"), 8),
        v_load = indent(&load("%vv", "%v", &kt, "%t", "%vc"), 8),
    );
    func(name, &params, &body)
}

/// Routed experts on the GPU, grouped by expert so that each expert's
/// weights are read once per step for all the tokens that chose it (decode
/// batches share experts; a prefill's tokens share them heavily):
/// - `{name}_group` (one block): per expert, its (token, choice) pairs in
///   pair order (`order`, from `start[e]` to `start[e + 1]`), and the list
///   of experts with any pair (`active`, padded with −1); deterministic.
/// - `{name}_up`: a block per (active expert, 8 intermediate rows); a warp
///   per row walks the expert's pairs four at a time, loading each gate/up
///   weight element once per four pairs; SwiGLU-OAI into `act[pair]`.
/// - `{name}_down`: the same over the hidden rows, `act[pair]` → `dn[pair]`.
/// - `{name}_combine`: `y[r] = Σ_j wts[r, j] · dn[r·k + j]`.
///
/// `h` and `y` hold values stored as `act`; `act` and `dn` are f32 scratch.
#[allow(clippy::too_many_arguments)]
fn routed_experts(
    name: &str,
    experts: usize,
    hidden: usize,
    inter: usize,
    k: usize,
    weight: WeightType,
    alpha: f64,
    limit: f64,
    beta: f64,
    act: Storage,
) -> Vec<GpuFunc> {
    let ht = format!("memref<?x{hidden}xf32>");
    let hat = format!("memref<?x{hidden}x{}>", act.mlir_elem());
    let it = format!("memref<?x{inter}xf32>");
    let ids = format!("memref<?x{k}xi64>");
    let wts = format!("memref<?x{k}xf32>");
    let i32v = "memref<?xi32>";
    let stride = moe::expert_table_stride(weight);
    let types = moe::expert_tensor_types(hidden, inter, weight);
    let e_n = experts;
    let group_body = format!(
        "{IDX}%t = gpu.thread_id x\n%ck = arith.constant {k} : index\n%ce = arith.constant {e_n} : index\n\
         %rows = memref.dim %ids, %c0 : {ids}\n%pairs = arith.muli %rows, %ck : index\n%slots = memref.dim %active, %c0 : {i32v}\n\
         %i0 = arith.constant 0 : i32\n%i1 = arith.constant 1 : i32\n%neg = arith.constant -1 : i32\n\
         // Pairs per expert.\n\
         scf.for %e = %t to %ce step %c256 {{\n\
         \x20 %e64 = arith.index_cast %e : index to i64\n\
         \x20 %n = scf.for %p = %c0 to %pairs step %c1 iter_args(%a = %i0) -> (i32) {{\n\
         \x20   %r = arith.divui %p, %ck : index\n    %j = arith.remui %p, %ck : index\n\
         \x20   %x = memref.load %ids[%r, %j] : {ids}\n    %is = arith.cmpi eq, %x, %e64 : i64\n\
         \x20   %a1 = arith.addi %a, %i1 : i32\n    %a2 = arith.select %is, %a1, %a : i32\n    scf.yield %a2 : i32\n  }}\n\
         \x20 memref.store %n, %cnt[%e] : memref<{e_n}xi32, #gpu.address_space<workgroup>>\n\
         }}\n\
         gpu.barrier\n\
         // Offsets and the active list (one thread: E is small).\n\
         %lead = arith.cmpi eq, %t, %c0 : index\n\
         scf.if %lead {{\n\
         \x20 %tot:2 = scf.for %e = %c0 to %ce step %c1 iter_args(%off = %i0, %s = %c0) -> (i32, index) {{\n\
         \x20   memref.store %off, %start[%e] : {i32v}\n\
         \x20   %n = memref.load %cnt[%e] : memref<{e_n}xi32, #gpu.address_space<workgroup>>\n\
         \x20   %off2 = arith.addi %off, %n : i32\n    %any = arith.cmpi sgt, %n, %i0 : i32\n\
         \x20   %s1 = arith.addi %s, %c1 : index\n\
         \x20   %s2 = scf.if %any -> (index) {{\n\
         \x20     %fits = arith.cmpi ult, %s, %slots : index\n\
         \x20     scf.if %fits {{\n        %e32 = arith.index_cast %e : index to i32\n        memref.store %e32, %active[%s] : {i32v}\n      }}\n\
         \x20     scf.yield %s1 : index\n    }} else {{\n      scf.yield %s : index\n    }}\n\
         \x20   scf.yield %off2, %s2 : i32, index\n  }}\n\
         \x20 memref.store %tot#0, %start[%ce] : {i32v}\n\
         \x20 scf.for %s = %tot#1 to %slots step %c1 {{\n    memref.store %neg, %active[%s] : {i32v}\n  }}\n\
         }}\n\
         gpu.barrier\n\
         // Each expert's pairs, in pair order.\n\
         scf.for %e = %t to %ce step %c256 {{\n\
         \x20 %e64 = arith.index_cast %e : index to i64\n\
         \x20 %s0 = memref.load %start[%e] : {i32v}\n\
         \x20 %fin = scf.for %p = %c0 to %pairs step %c1 iter_args(%at = %s0) -> (i32) {{\n\
         \x20   %r = arith.divui %p, %ck : index\n    %j = arith.remui %p, %ck : index\n\
         \x20   %x = memref.load %ids[%r, %j] : {ids}\n    %is = arith.cmpi eq, %x, %e64 : i64\n\
         \x20   %nx = scf.if %is -> (i32) {{\n\
         \x20     %ati = arith.index_cast %at : i32 to index\n      %p32 = arith.index_cast %p : index to i32\n\
         \x20     memref.store %p32, %order[%ati] : {i32v}\n      %at1 = arith.addi %at, %i1 : i32\n      scf.yield %at1 : i32\n\
         \x20   }} else {{\n      scf.yield %at : i32\n    }}\n\
         \x20   scf.yield %nx : i32\n  }}\n\
         }}\n"
    );
    // Views of expert `%e`'s tensors `first..first+n` from the device pointer table.
    let views = |first: usize, n: usize| -> String {
        let mut s = format!("%cstride = arith.constant {stride} : i64\n%e64 = arith.index_cast %e : index to i64\n%ebase = arith.muli %e64, %cstride : i64\n");
        for (j, ty) in types.iter().enumerate().skip(first).take(n) {
            s.push_str(&format!(
                "%off{j}c = arith.constant {j} : i64\n%off{j} = arith.addi %ebase, %off{j}c : i64\n\
                 %gp{j} = llvm.getelementptr %table[%off{j}] : (!llvm.ptr, i64) -> !llvm.ptr, !llvm.ptr\n\
                 %p{j} = llvm.load %gp{j} : !llvm.ptr -> !llvm.ptr\n\
                 %t{j} = func.call @{}(%p{j}, %c0) : (!llvm.ptr, index) -> {}\n",
                ty.view_fn(),
                ty.mlir()
            ));
        }
        s
    };
    let mx = matches!(weight, WeightType::Mxfp8 { .. });
    let (g_w, g_s, u_w, u_s, d_w, d_s) = if mx { ("%t0", "%t1", "%t2", "%t3", "%t4", "%t5") } else { ("%t0", "", "%t1", "", "%t2", "") };
    let gate = WeightArgs::new(g_w, g_s, inter, hidden, weight);
    let up = WeightArgs::new(u_w, u_s, inter, hidden, weight);
    let down = WeightArgs::new(d_w, d_s, hidden, inter, weight);
    let consts = gate.consts();
    // The block's expert and output row.
    let head = |out: usize| {
        format!(
            "{IDX}{WARP_IDS}{consts}%slot = gpu.block_id x\n%e32 = memref.load %active[%slot] : {i32v}\n%i0 = arith.constant 0 : i32\n\
             %has = arith.cmpi sge, %e32, %i0 : i32\n%e = arith.index_cast %e32 : i32 to index\n\
             %bx = gpu.block_id y\n%cwarps = arith.constant {WARPS} : index\n%ob = arith.muli %bx, %cwarps : index\n%o = arith.addi %ob, %warp : index\n\
             %cout = arith.constant {out} : index\n%in = arith.cmpi ult, %o, %cout : index\n%ok = arith.andi %has, %in : i1\n\
             %ck = arith.constant {k} : index\n%first = arith.cmpi eq, %lane, %c0 : index\n"
        )
    };
    // The expert's pair range, and whether it has a single pair (a batch-1
    // decode: then the one-pair walk, with no clamped duplicates).
    let range =
        "%e1 = arith.addi %e, %c1 : index\n%s0i = memref.load %start[%e] : memref<?xi32>\n%s1i = memref.load %start[%e1] : memref<?xi32>\n\
                 %s0 = arith.index_cast %s0i : i32 to index\n%s1 = arith.index_cast %s1i : i32 to index\n\
                 %npairs = arith.subi %s1, %s0 : index\n%single = arith.cmpi eq, %npairs, %c1 : index\n";
    // The walk over the expert's pairs `rows` at a time (`%q{j}`: pair,
    // `%x{j}`: the activation row it reads, `%ok{j}`: not past the end).
    let walk_open = |rows: usize, xrow_of_pair: bool| {
        let mut s = format!("%cr = arith.constant {rows} : index\nscf.for %pb = %s0 to %s1 step %cr {{\n");
        for j in 0..rows {
            s.push_str(&format!(
                "  %cj{j} = arith.constant {j} : index\n  %pu{j} = arith.addi %pb, %cj{j} : index\n  %ok{j} = arith.cmpi ult, %pu{j}, %s1 : index\n\
                 \x20 %pi{j} = arith.select %ok{j}, %pu{j}, %pb : index\n  %q{j}i = memref.load %order[%pi{j}] : memref<?xi32>\n\
                 \x20 %q{j} = arith.index_cast %q{j}i : i32 to index\n"
            ));
            if xrow_of_pair {
                s.push_str(&format!("  %x{j} = arith.addi %q{j}, %c0 : index\n"));
            } else {
                s.push_str(&format!("  %x{j} = arith.divui %q{j}, %ck : index\n"));
            }
        }
        s
    };
    // `rows` dot products of weight row `%o` with the pairs' activation rows `%x{j}`.
    let dots = |rows: usize, tag: &str, wa: &WeightArgs, x: &str, xt: &str, xs: Storage, n: usize| {
        let names: Vec<String> = (0..rows).map(|j| format!("%x{j}")).collect();
        warp_dots(tag, wa, "%o", x, xt, xs, &names, n)
    };
    let swiglu = |rows: usize| {
        let mut out = String::new();
        for j in 0..rows {
            out.push_str(&format!(
                "%gc{j} = arith.minimumf %gs{j}, %lim : f32\n%u1{j} = arith.minimumf %us{j}, %lim : f32\n%uc{j} = arith.maximumf %u1{j}, %nlim : f32\n\
                 %ag{j} = arith.mulf %alpha, %gc{j} : f32\n%nag{j} = arith.negf %ag{j} : f32\n%ex{j} = math.exp %nag{j} : f32\n\
                 %den{j} = arith.addf %one, %ex{j} : f32\n%sig{j} = arith.divf %one, %den{j} : f32\n%glu{j} = arith.mulf %gc{j}, %sig{j} : f32\n\
                 %upb{j} = arith.addf %uc{j}, %beta : f32\n%act{j} = arith.mulf %glu{j}, %upb{j} : f32\n\
                 %st{j} = arith.andi %first, %ok{j} : i1\nscf.if %st{j} {{\n  memref.store %act{j}, %out[%q{j}, %o] : {it}\n}}\n"
            ));
        }
        out
    };
    let down_store = |rows: usize| {
        let mut out = String::new();
        for j in 0..rows {
            out.push_str(&format!(
                "%st{j} = arith.andi %first, %ok{j} : i1\nscf.if %st{j} {{\n  memref.store %ds{j}, %out[%q{j}, %o] : {ht}\n}}\n"
            ));
        }
        out
    };
    // One walk (gate/up or down) for `rows` pairs per pass.
    let up_walk = |rows: usize| {
        format!(
            "{}{}{}{}}}\n",
            walk_open(rows, false),
            indent(&dots(rows, "g", &gate, "%h", &hat, act, hidden), 2),
            indent(&dots(rows, "u", &up, "%h", &hat, act, hidden), 2),
            indent(&swiglu(rows), 2)
        )
    };
    let down_walk = |rows: usize| {
        format!(
            "{}{}{}}}\n",
            walk_open(rows, true),
            indent(&dots(rows, "d", &down, "%act", &it, Storage::F32, inter), 2),
            indent(&down_store(rows), 2)
        )
    };
    // Two kernels per projection: `_r1` serves the experts with exactly one
    // pair (all of them in a batch-1 decode) with a one-pair walk and few
    // registers; the other serves the experts with more pairs, four per
    // pass. Both are launched over the same grid; a block whose expert is
    // the other kind's returns at once.
    let only = |rows: usize, walk: &dyn Fn(usize) -> String| {
        let cond = if rows == 1 { "%single".to_string() } else { "%multi".to_string() };
        let pre =
            if rows == 1 { String::new() } else { "%yes = arith.constant true\n%multi = arith.xori %single, %yes : i1\n".to_string() };
        format!("{pre}scf.if {cond} {{\n{}}}\n", indent(&walk(rows), 2))
    };
    let up_body = |rows: usize| {
        format!(
            "{head}%alpha = arith.constant {a} : f32\n%lim = arith.constant {l} : f32\n%nlim = arith.constant {nl} : f32\n%beta = arith.constant {b} : f32\n\
             scf.if %ok {{\n{views}{range}{walks}}}\n",
            head = head(inter),
            a = f32_lit(alpha),
            l = f32_lit(limit),
            nl = f32_lit(-limit),
            b = f32_lit(beta),
            views = indent(&views(0, if mx { 4 } else { 2 }), 2),
            range = indent(range, 2),
            walks = indent(&only(rows, &up_walk), 2),
        )
    };
    let down_first = if mx { 4 } else { 2 };
    let down_body = |rows: usize| {
        format!(
            "{head}scf.if %ok {{\n{views}{range}{walks}}}\n",
            head = head(hidden),
            views = indent(&views(down_first, if mx { 2 } else { 1 }), 2),
            range = indent(range, 2),
            walks = indent(&only(rows, &down_walk), 2),
        )
    };
    let combine_body = format!(
        "{IDX}%r = gpu.block_id x\n%t = gpu.thread_id x\n%ch = arith.constant {hidden} : index\n%ck = arith.constant {k} : index\n\
         %rk = arith.muli %r, %ck : index\n\
         scf.for %c = %t to %ch step %c256 {{\n\
         \x20 %s = scf.for %j = %c0 to %ck step %c1 iter_args(%a = %zero) -> (f32) {{\n\
         \x20   %pk = arith.addi %rk, %j : index\n    %w = memref.load %wts[%r, %j] : {wts}\n    %x = memref.load %dn[%pk, %c] : {ht}\n\
         \x20   %m = arith.mulf %w, %x : f32\n    %a2 = arith.addf %a, %m : f32\n    scf.yield %a2 : f32\n  }}\n\
         {}}}\n",
        indent(&store_f32("%s", "%y", &hat, "%r", "%c", act), 2)
    );
    let grouping = format!("%start: {i32v}, %order: {i32v}, %active: {i32v}");
    vec![
        GpuFunc {
            name: format!("{name}_group"),
            text: format!(
                "    gpu.func @{name}_group(%ids: {ids}, {grouping}) workgroup(%cnt: memref<{e_n}xi32, #gpu.address_space<workgroup>>) kernel {{\n{}      gpu.return\n    }}\n",
                indent(&group_body, 6)
            ),
        },
        func(&format!("{name}_up_r1"), &format!("%h: {hat}, {grouping}, %table: !llvm.ptr, %out: {it}"), &up_body(1)),
        func(&format!("{name}_up"), &format!("%h: {hat}, {grouping}, %table: !llvm.ptr, %out: {it}"), &up_body(ROWS_PER_PASS)),
        func(&format!("{name}_down_r1"), &format!("%act: {it}, {grouping}, %table: !llvm.ptr, %out: {ht}"), &down_body(1)),
        func(&format!("{name}_down"), &format!("%act: {it}, {grouping}, %table: !llvm.ptr, %out: {ht}"), &down_body(ROWS_PER_PASS)),
        func(&format!("{name}_combine"), &format!("%dn: {ht}, %wts: {wts}, %y: {hat}"), &combine_body),
    ]
}
