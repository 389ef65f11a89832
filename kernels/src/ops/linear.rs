//! `y[S, out] = x[S, inp] · W[out, inp]ᵀ` with f32 accumulation, for every
//! weight type; on the host a vectorised path when the widths allow.

use crate::emit::{e8m0_to_f32, fp8_lut_global, load_f32, load_f32xn, load_weight_f32, parallel_or_serial, store_f32, E8M0_CONSTANTS};
use crate::gpu::{warp_dots, GpuCall, GpuFunc, GpuTarget, WeightArgs, ROWS_PER_PASS, WARPS};
use crate::host::{index_consts, BASICS};
use crate::unit::{gpu_func_block, param, KernelUnit, Launch, Param};
use crate::{indent, Storage, WeightType};

/// `y = x Wᵀ` with `W: [out, inp]`; `x` stored as `act`, `y` as `out_act`
/// (f32 for the logits whatever the activations are).
#[derive(Debug, Clone, PartialEq, PartialOrd)]
pub struct Linear {
    pub inp: usize,
    pub out: usize,
    pub weight: WeightType,
    pub act: Storage,
    pub out_act: Storage,
}

impl KernelUnit for Linear {
    fn symbol(&self) -> String {
        let Linear { inp, out, weight, act, out_act } = self;
        // The output type is named only when it differs (the logits).
        let y = if out_act != act { format!("_y{}", out_act.name()) } else { String::new() };
        format!("m3c_linear_i{inp}_o{out}_{}{y}{}", weight.tag(), act.act_suffix())
    }
    fn params(&self) -> Vec<Param> {
        let Linear { inp, out, weight, act, out_act } = self;
        let mut p = vec![
            param("x", format!("memref<?x{inp}x{}>", act.mlir_elem())),
            param("w", format!("memref<{out}x{inp}x{}>", weight.mlir_elem())),
        ];
        if let WeightType::Mxfp8 { block } = weight {
            p.push(param("s", format!("memref<{out}x{}xi8>", inp / block)));
        }
        p.push(param("y", format!("memref<?x{out}x{}>", out_act.mlir_elem())));
        p
    }
    fn act(&self) -> Option<Storage> {
        Some(self.act)
    }
    fn host_body(&self) -> String {
        host(self.inp, self.out, self.weight, self.act, self.out_act)
    }
    fn gpu_funcs(&self, target: &GpuTarget) -> Vec<GpuFunc> {
        let idx = target.idx();
        let sym = self.symbol();
        let Linear { inp, out, weight, act, out_act } = self;

        // A warp per output row, looping over the activation rows
        // four at a time: each weight element is loaded (and, for
        // MXFP8, decoded) once per four rows, so a decode
        // micro-batch of up to four sequences reads each weight byte
        // once. Rows past the end are clamped for the loads and not stored.
        // `{sym}_r1` takes one row per pass: a batch-1 decode step
        // then does no clamped duplicate work.
        let wa = WeightArgs::new(target, "%w", "%s", *out, *inp, *weight);
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
                "{idx}{warp_ids}{consts}%bx = gpu.block_id x\n%cwarps = arith.constant {WARPS} : index\n\
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
                warp_ids = target.warp_ids(),
                consts = wa.consts(),
                clamp = indent(&clamp, 4),
                dots = indent(&warp_dots("y", &wa, "%o", "%x", &xt, *act, &names, *inp), 4),
                stores = indent(&stores, 4),
            );
            funcs.push(gpu_func_block(target, &name, &self.params(), &body, target.warps_block()));
        }
        funcs
    }
    /// One block of 8 warps per 8 output rows; each warp covers every
    /// activation row (one at a time for a single row, else four at a time).
    fn launch(&self, l: &Launch) -> GpuCall {
        let sym = self.symbol();
        let (ob, single, one, rows) = (l.local("ob"), l.local("single"), l.one(), l.rows);
        l.call(format!(
            "{ob} = arith.constant {} : index\n\
             {single} = arith.cmpi eq, {rows}, {one} : index\nscf.if {single} {{\n{}}} else {{\n{}}}\n",
            self.out.div_ceil(WARPS),
            indent(&l.grid(&format!("{sym}_r1"), [&ob, &one, &one], l.target.warps_block(), l.args), 2),
            indent(&l.grid(&sym, [&ob, &one, &one], l.target.warps_block(), l.args), 2)
        ))
    }
    fn globals(&self) -> Vec<(String, String)> {
        match self.weight {
            WeightType::Mxfp8 { .. } if !vectorizes(self.inp, self.weight) => vec![("m3c_fp8_e4m3_lut".into(), fp8_lut_global())],
            _ => Vec::new(),
        }
    }
}

/// `y[S, out] = x[S, inp] · W[out, inp]ᵀ`, f32 accumulation. MXFP8 weights are
/// decoded in the inner loop (fp8 through a 256-entry table, one E8M0 scale
/// per block applied to the block's partial sum), so each weight byte is read
/// once and never expanded in memory. `x` is stored as `act`, `y` as `out_act`.
fn host(inp: usize, out: usize, weight: WeightType, act: Storage, out_act: Storage) -> String {
    if vectorizes(inp, weight) {
        return host_vec(inp, out, weight, act, out_act);
    }
    let x = format!("memref<?x{inp}x{}>", act.mlir_elem());
    let y = format!("memref<?x{out}x{}>", out_act.mlir_elem());
    let xload = load_f32("%xv", "%x", &x, "%r", "%i", act);
    let ystore = indent(&store_f32("%acc", "%y", &y, "%r", "%o", out_act), 4);
    let wt = format!("memref<{out}x{inp}x{}>", weight.mlir_elem());
    let head = "%c0 = arith.constant 0 : index\n\
                %c1 = arith.constant 1 : index\n\
                %zero = arith.constant 0.0 : f32\n";
    // The reduction over the inputs of output `%o` for row `%r` into `%acc`
    // (written 4 columns in), and the constants it needs.
    let (consts, acc) = match weight {
        WeightType::Mxfp8 { block } => {
            let nb = inp / block;
            let st = format!("memref<{out}x{nb}xi8>");
            let consts = format!(
                "{E8M0_CONSTANTS}{}%lut = memref.get_global @m3c_fp8_e4m3_lut : memref<256xf32>\n",
                index_consts(&[("cout", out), ("cnb", nb), ("cb", block)])
            );
            let acc = format!(
                "%acc = scf.for %b = %c0 to %cnb step %c1 iter_args(%a = %zero) -> (f32) {{\n\
                 \x20 %base = arith.muli %b, %cb : index\n\
                 \x20 %part = scf.for %j = %c0 to %cb step %c1 iter_args(%p = %zero) -> (f32) {{\n\
                 \x20   %i = arith.addi %base, %j : index\n\
                 {xload}\
                 \x20   %q = memref.load %w[%o, %i] : {wt}\n\
                 \x20   %qi = arith.extui %q : i8 to i32\n\
                 \x20   %qx = arith.index_cast %qi : i32 to index\n\
                 \x20   %wv = memref.load %lut[%qx] : memref<256xf32>\n\
                 \x20   %m = arith.mulf %xv, %wv : f32\n\
                 \x20   %p2 = arith.addf %p, %m : f32\n\
                 \x20   scf.yield %p2 : f32\n\
                 \x20 }}\n\
                 \x20 %sb = memref.load %s[%o, %b] : {st}\n\
                 {dec}\
                 \x20 %ps = arith.mulf %part, %scale : f32\n\
                 \x20 %a2 = arith.addf %a, %ps : f32\n\
                 \x20 scf.yield %a2 : f32\n\
                 }}\n",
                xload = indent(&xload, 4),
                dec = indent(&e8m0_to_f32("%scale", "%sb"), 2),
            );
            (consts, acc)
        }
        _ => {
            let acc = format!(
                "%acc = scf.for %i = %c0 to %cin step %c1 iter_args(%a = %zero) -> (f32) {{\n\
                 {xload}\
                 {load}\
                 \x20 %m = arith.mulf %xv, %wv : f32\n\
                 \x20 %a2 = arith.addf %a, %m : f32\n\
                 \x20 scf.yield %a2 : f32\n\
                 }}\n",
                xload = indent(&xload, 2),
                load = indent(&load_weight_f32("%wv", "%w", "%o, %i", &wt, weight), 2),
            );
            (index_consts(&[("cout", out), ("cin", inp)]), acc)
        }
    };
    format!(
        "{head}{consts}\
         %rows = memref.dim %x, %c0 : {x}\n\
         scf.for %r = %c0 to %rows step %c1 {{\n\
         \x20 scf.for %o = %c0 to %cout step %c1 {{\n\
         {acc}\
         {ystore}\
         \x20 }}\n\
         }}\n\
         return\n",
        acc = indent(&acc, 4),
    )
}

/// Lanes of the vector path: 32 f32 = four AVX2 registers, so the four
/// accumulator chains run in parallel.
pub const LANES: usize = 32;

/// Whether the vector path applies: every input width of MiniMax-M3 (and of
/// the tiny fixtures) is a multiple of 32, as MXFP8's 32-wide blocks require.
pub fn vectorizes(inp: usize, weight: WeightType) -> bool {
    inp.is_multiple_of(LANES)
        && match weight {
            WeightType::Mxfp8 { block } => block.is_multiple_of(LANES),
            _ => true,
        }
}

/// Rows computed together at prefill: each weight vector is loaded and
/// decoded once for two activation rows. Two, measured: 1.3x faster than one
/// on a hidden-1024 model's prefill; four spills (4 rows × 4 accumulator
/// registers = all 16 AVX2 registers) and is slower than two.
const ROW_BLOCK: usize = 2;

/// The vector path. Loop order: output row `o` outside, activation rows
/// inside (two at a time, then the rest one by one), so one weight row
/// (≤ 24 KB) stays in L1 while every activation row passes it and each
/// weight vector is decoded once per two rows. The reduction over inputs
/// runs on 32 lanes (`fastmath<contract>`: fused multiply-add) and is summed
/// once per output (`fastmath<reassoc>` on that final sum only). MXFP8
/// weights are decoded in registers: fp8 bits → f32 bits by integer ops,
/// times the block's E8M0 scale, so no table lookups and no expanded copy.
/// The code is the same whichever stage runs it, so results do not depend
/// on the pipeline split.
fn host_vec(inp: usize, out: usize, weight: WeightType, act: Storage, out_act: Storage) -> String {
    let x = format!("memref<?x{inp}x{}>", act.mlir_elem());
    let y = format!("memref<?x{out}x{}>", out_act.mlir_elem());
    let wt = format!("memref<{out}x{inp}x{}>", weight.mlir_elem());
    let v = format!("vector<{LANES}xf32>");
    let vi = format!("vector<{LANES}xi32>");
    let idx1 = index_consts(&[("crb", ROW_BLOCK), ("cl", LANES), ("cout", out), ("cin", inp)]);
    let mut consts = format!(
        "{BASICS}\
         {idx1}\
         %vz = arith.constant dense<0.0> : {v}\n"
    );
    let mut st = String::new();
    if let WeightType::Mxfp8 { block } = weight {
        let nb = inp / block;
        st = format!("memref<{out}x{nb}xi8>");
        consts.push_str(&format!("%cnb = arith.constant {nb} : index\n%cb = arith.constant {block} : index\n"));
        consts.push_str(E8M0_CONSTANTS);
        for (n, val) in [
            ("v_sign", 0x80),
            ("v_7f", 0x7F),
            ("v_e", 0xF),
            ("v_m", 7),
            ("v_3", 3),
            ("v_24", 24),
            ("v_120", 120),
            ("v_23", 23),
            ("v_20", 20),
            ("v_0", 0),
            ("v_nan", 0x7FC0_0000),
        ] {
            consts.push_str(&format!("%{n} = arith.constant dense<{val}> : {vi}\n"));
        }
        // 2^-9: the value of the fp8 subnormal with mantissa 1.
        consts.push_str(&format!("%v_sub = arith.constant dense<1.953125e-03> : {v}\n"));
    }
    // One output `o` for the activation rows `rows` (SSA index names):
    // accumulate, reduce, store.
    let ctx = VecCtx { x: x.clone(), y: y.clone(), wt: wt.clone(), st: st.clone(), v: v.clone(), vi: vi.clone(), weight, act, out_act };
    let reduce_rows = |rows: &[String]| reduce_rows(rows, &ctx);
    let block_rows: Vec<String> = (0..ROW_BLOCK).map(|j| format!("%r{j}")).collect();
    let row_idx: String = (1..ROW_BLOCK).map(|j| format!("%r{j} = arith.addi %r0, %c{j}_rb : index\n")).collect();
    let rb_consts: String = (1..ROW_BLOCK).map(|j| format!("%c{j}_rb = arith.constant {j} : index\n")).collect();
    // Tiles: a tile of activation rows small enough for L1 (about 32 KB)
    // meets every output row of the tile of outputs before moving on, so
    // activations are read from L1, not L2, at long prefills.
    // And a tile of outputs whose weights fit L2 (about 256 KB) is reused by
    // every row tile, so weights stream from memory once per output tile.
    let row_tile = ((32 * 1024) / (inp * 4)).clamp(ROW_BLOCK, 64) / ROW_BLOCK * ROW_BLOCK;
    let wbytes = match weight {
        WeightType::F32 => 4,
        WeightType::BF16 | WeightType::F16 => 2,
        WeightType::Mxfp8 { .. } => 1,
    };
    // At most ~1/64 of the outputs per tile, so the tiles (run in parallel,
    // one thread per tile at a time) keep every core busy at decode.
    let out_tile = ((256 * 1024) / (inp * wbytes)).clamp(1, out).min(out.div_ceil(64).max(8));
    // One tile of outputs: every row tile of the activations against it.
    let tile = format!(
        "%ot_end0 = arith.addi %ot, %cot : index\n\
         %ot_end = arith.minui %ot_end0, %cout : index\n\
         scf.for %rt = %c0 to %rows step %crt {{\n\
         \x20 %rt_end0 = arith.addi %rt, %crt : index\n\
         \x20 %rt_end = arith.minui %rt_end0, %rows : index\n\
         \x20 %rt_n = arith.subi %rt_end, %rt : index\n\
         \x20 %nfull = arith.divui %rt_n, %crb : index\n\
         \x20 %nfr = arith.muli %nfull, %crb : index\n\
         \x20 %rfull = arith.addi %rt, %nfr : index\n\
         \x20 scf.for %o = %ot to %ot_end step %c1 {{\n\
         \x20   scf.for %r0 = %rt to %rfull step %crb {{\n\
         {row_idx}\
         {block}\
         \x20   }}\n\
         \x20   scf.for %r = %rfull to %rt_end step %c1 {{\n\
         {single}\
         \x20   }}\n\
         \x20 }}\n\
         }}\n",
        row_idx = indent(&row_idx, 6),
        block = indent(&reduce_rows(&block_rows), 6),
        single = indent(&reduce_rows(&["%r".to_string()]), 6),
    );
    let body = format!(
        "{consts}\
         {rb_consts}\
         %crt = arith.constant {row_tile} : index\n\
         %cot = arith.constant {out_tile} : index\n\
         %rows = memref.dim %x, %c0 : {x}\n\
         %work0 = arith.constant {macs} : index\n\
         %work = arith.muli %rows, %work0 : index\n\
         {tiles}\
         return\n",
        macs = inp * out,
        tiles = parallel_or_serial("%work", &["%ot"], &["%c0"], &["%cout"], &["%cot"], &tile),
    );
    body
}

/// What the vector path's inner loops need to know of the linear.
struct VecCtx {
    x: String,
    y: String,
    wt: String,
    st: String,
    v: String,
    vi: String,
    weight: WeightType,
    act: Storage,
    out_act: Storage,
}

/// One output `o` for the activation rows `rows` (SSA index names):
/// accumulate, reduce, store.
fn reduce_rows(rows: &[String], c: &VecCtx) -> String {
    let (x, y, wt, st, v, vi) = (&c.x, &c.y, &c.wt, &c.st, &c.v, &c.vi);
    let (weight, act, out_act) = (c.weight, c.act, c.out_act);

    let n = rows.len();
    let accs = |p: &str| (0..n).map(|j| format!("%{p}{j}")).collect::<Vec<_>>();
    let iter = |p: &str, init: &[String]| (0..n).map(|j| format!("%{p}{j} = {}", init[j])).collect::<Vec<_>>().join(", ");
    let tys = vec![v.clone(); n].join(", ");
    let zeros = vec!["%vz".to_string(); n];
    // Loads of the activation chunks at column %i and the FMA into `acc` → `new`.
    let fma = |acc: &str, new: &str, w: &str| -> String {
        (0..n)
            .map(|j| {
                format!(
                    "{}%p{j} = arith.mulf %xv{j}, {w} fastmath<contract> : {v}\n\
                         %{new}{j} = arith.addf %{acc}{j}, %p{j} fastmath<contract> : {v}\n",
                    load_f32xn(LANES, &format!("%xv{j}"), "%x", x, &rows[j], "%i", act)
                )
            })
            .collect()
    };
    let result = match weight {
        WeightType::Mxfp8 { .. } => format!(
            "%acc:{n} = scf.for %b = %c0 to %cnb step %c1 iter_args({}) -> ({tys}) {{\n\
                 \x20 %sb = memref.load %s[%o, %b] : {st}\n\
                 {dec}\
                 \x20 %sv = vector.broadcast %scale : f32 to {v}\n\
                 \x20 %base = arith.muli %b, %cb : index\n\
                 \x20 %ab:{n} = scf.for %j = %c0 to %cb step %cl iter_args({}) -> ({tys}) {{\n\
                 \x20   %i = arith.addi %base, %j : index\n\
                 \x20   %q = vector.load %w[%o, %i] : {wt}, vector<{LANES}xi8>\n\
                 \x20   %u = arith.extui %q : vector<{LANES}xi8> to {vi}\n\
                 \x20   %sg0 = arith.andi %u, %v_sign : {vi}\n\
                 \x20   %sg = arith.shli %sg0, %v_24 : {vi}\n\
                 \x20   %e0 = arith.shrui %u, %v_3 : {vi}\n\
                 \x20   %e = arith.andi %e0, %v_e : {vi}\n\
                 \x20   %m = arith.andi %u, %v_m : {vi}\n\
                 \x20   %eb = arith.addi %e, %v_120 : {vi}\n\
                 \x20   %es = arith.shli %eb, %v_23 : {vi}\n\
                 \x20   %ms = arith.shli %m, %v_20 : {vi}\n\
                 \x20   %nb0 = arith.ori %sg, %es : {vi}\n\
                 \x20   %nbits = arith.ori %nb0, %ms : {vi}\n\
                 \x20   %mf = arith.uitofp %m : {vi} to {v}\n\
                 \x20   %subm = arith.mulf %mf, %v_sub : {v}\n\
                 \x20   %subi = arith.bitcast %subm : {v} to {vi}\n\
                 \x20   %sbits = arith.ori %subi, %sg : {vi}\n\
                 \x20   %is_sub = arith.cmpi eq, %e, %v_0 : {vi}\n\
                 \x20   %low = arith.andi %u, %v_7f : {vi}\n\
                 \x20   %is_nan = arith.cmpi eq, %low, %v_7f : {vi}\n\
                 \x20   %bits0 = arith.select %is_sub, %sbits, %nbits : vector<{LANES}xi1>, {vi}\n\
                 \x20   %bits = arith.select %is_nan, %v_nan, %bits0 : vector<{LANES}xi1>, {vi}\n\
                 \x20   %wv = arith.bitcast %bits : {vi} to {v}\n\
                 \x20   %ws = arith.mulf %wv, %sv : {v}\n\
                 {fma}\
                 \x20   scf.yield {} : {tys}\n\
                 \x20 }}\n\
                 \x20 scf.yield {} : {tys}\n\
                 }}\n",
            iter("a", &zeros),
            iter("b", &accs("a")),
            accs("n").join(", "),
            (0..n).map(|j| format!("%ab#{j}")).collect::<Vec<_>>().join(", "),
            dec = indent(&e8m0_to_f32("%scale", "%sb"), 2),
            fma = indent(&fma("b", "n", "%ws"), 4),
        ),
        _ => {
            let load = match weight {
                WeightType::F32 => format!("%wv = vector.load %w[%o, %i] : {wt}, {v}\n"),
                _ => format!(
                    "%wn = vector.load %w[%o, %i] : {wt}, vector<{LANES}x{e}>\n\
                         %wv = arith.extf %wn : vector<{LANES}x{e}> to {v}\n",
                    e = weight.mlir_elem()
                ),
            };
            format!(
                "%acc:{n} = scf.for %i = %c0 to %cin step %cl iter_args({}) -> ({tys}) {{\n\
                     {}\
                     {}\
                     \x20 scf.yield {} : {tys}\n\
                     }}\n",
                iter("a", &zeros),
                indent(&load, 2),
                indent(&fma("a", "n", "%wv"), 2),
                accs("n").join(", "),
            )
        }
    };
    let mut text = result;
    for (j, r) in rows.iter().enumerate() {
        text.push_str(&format!("%sum{j} = vector.reduction <add>, %acc#{j} fastmath<reassoc> : {v} into f32\n"));
        text.push_str(&store_f32(&format!("%sum{j}"), "%y", y, r, "%o", out_act));
    }
    text
}
