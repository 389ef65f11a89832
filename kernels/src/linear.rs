use crate::emit::{e8m0_to_f32, indent, load_f32, load_f32xn, load_weight_f32, parallel_or_serial, store_f32, E8M0_CONSTANTS};
use crate::{Storage, WeightType};

/// `y[S, out] = x[S, inp] · W[out, inp]ᵀ`, f32 accumulation. MXFP8 weights are
/// decoded in the inner loop (fp8 through a 256-entry table, one E8M0 scale
/// per block applied to the block's partial sum), so each weight byte is read
/// once and never expanded in memory. `x` is stored as `act`, `y` as `out_act`.
pub fn linear(name: &str, inp: usize, out: usize, weight: WeightType, act: Storage, out_act: Storage) -> String {
    if vectorizes(inp, weight) {
        return linear_vec(name, inp, out, weight, act, out_act);
    }
    let x = format!("memref<?x{inp}x{}>", act.mlir_elem());
    let y = format!("memref<?x{out}x{}>", out_act.mlir_elem());
    let xload = indent(&load_f32("%xv", "%x", &x, "%r", "%i", act), 6);
    let ystore = indent(&store_f32("%acc", "%y", &y, "%r", "%o", out_act), 4);
    let wt = format!("memref<{out}x{inp}x{}>", weight.mlir_elem());
    let head = "%c0 = arith.constant 0 : index\n\
                %c1 = arith.constant 1 : index\n\
                %zero = arith.constant 0.0 : f32\n";
    let (args, body) = match weight {
        WeightType::Mxfp8 { block } => {
            let nb = inp / block;
            let st = format!("memref<{out}x{nb}xi8>");
            let body = format!(
                "{head}{E8M0_CONSTANTS}\
                 %cout = arith.constant {out} : index\n\
                 %cnb = arith.constant {nb} : index\n\
                 %cb = arith.constant {block} : index\n\
                 %lut = memref.get_global @m3c_fp8_e4m3_lut : memref<256xf32>\n\
                 %rows = memref.dim %x, %c0 : {x}\n\
                 scf.for %r = %c0 to %rows step %c1 {{\n\
                 \x20 scf.for %o = %c0 to %cout step %c1 {{\n\
                 \x20   %acc = scf.for %b = %c0 to %cnb step %c1 iter_args(%a = %zero) -> (f32) {{\n\
                 \x20     %base = arith.muli %b, %cb : index\n\
                 \x20     %part = scf.for %j = %c0 to %cb step %c1 iter_args(%p = %zero) -> (f32) {{\n\
                 \x20       %i = arith.addi %base, %j : index\n\
                 {xload8}\
                 \x20       %q = memref.load %w[%o, %i] : {wt}\n\
                 \x20       %qi = arith.extui %q : i8 to i32\n\
                 \x20       %qx = arith.index_cast %qi : i32 to index\n\
                 \x20       %wv = memref.load %lut[%qx] : memref<256xf32>\n\
                 \x20       %m = arith.mulf %xv, %wv : f32\n\
                 \x20       %p2 = arith.addf %p, %m : f32\n\
                 \x20       scf.yield %p2 : f32\n\
                 \x20     }}\n\
                 \x20     %sb = memref.load %s[%o, %b] : {st}\n\
                 {dec}\
                 \x20     %ps = arith.mulf %part, %scale : f32\n\
                 \x20     %a2 = arith.addf %a, %ps : f32\n\
                 \x20     scf.yield %a2 : f32\n\
                 \x20   }}\n\
                 {ystore}\
                 \x20 }}\n\
                 }}\n\
                 return\n",
                xload8 = indent(&xload, 2),
                dec = indent(&e8m0_to_f32("%scale", "%sb"), 6),
            );
            (format!("%x: {x}, %w: {wt}, %s: {st}, %y: {y}"), body)
        }
        _ => {
            let body = format!(
                "{head}\
                 %cout = arith.constant {out} : index\n\
                 %cin = arith.constant {inp} : index\n\
                 %rows = memref.dim %x, %c0 : {x}\n\
                 scf.for %r = %c0 to %rows step %c1 {{\n\
                 \x20 scf.for %o = %c0 to %cout step %c1 {{\n\
                 \x20   %acc = scf.for %i = %c0 to %cin step %c1 iter_args(%a = %zero) -> (f32) {{\n\
                 {xload}\
                 {load}\
                 \x20     %m = arith.mulf %xv, %wv : f32\n\
                 \x20     %a2 = arith.addf %a, %m : f32\n\
                 \x20     scf.yield %a2 : f32\n\
                 \x20   }}\n\
                 {ystore}\
                 \x20 }}\n\
                 }}\n\
                 return\n",
                load = indent(&load_weight_f32("%wv", "%w", "%o, %i", &wt, weight), 6),
            );
            (format!("%x: {x}, %w: {wt}, %y: {y}"), body)
        }
    };
    format!("  func.func @{name}({args}) attributes {{llvm.emit_c_interface}} {{\n{}  }}\n", indent(&body, 4))
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
fn linear_vec(name: &str, inp: usize, out: usize, weight: WeightType, act: Storage, out_act: Storage) -> String {
    let x = format!("memref<?x{inp}x{}>", act.mlir_elem());
    let y = format!("memref<?x{out}x{}>", out_act.mlir_elem());
    let wt = format!("memref<{out}x{inp}x{}>", weight.mlir_elem());
    let v = format!("vector<{LANES}xf32>");
    let vi = format!("vector<{LANES}xi32>");
    let mut consts = format!(
        "%c0 = arith.constant 0 : index\n\
         %c1 = arith.constant 1 : index\n\
         %crb = arith.constant {ROW_BLOCK} : index\n\
         %cl = arith.constant {LANES} : index\n\
         %cout = arith.constant {out} : index\n\
         %cin = arith.constant {inp} : index\n\
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
    let reduce_rows = |rows: &[String]| -> String {
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
                        load_f32xn(LANES, &format!("%xv{j}"), "%x", &x, &rows[j], "%i", act)
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
            text.push_str(&store_f32(&format!("%sum{j}"), "%y", &y, r, "%o", out_act));
        }
        text
    };
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
    let args = match weight {
        WeightType::Mxfp8 { .. } => format!("%x: {x}, %w: {wt}, %s: {st}, %y: {y}"),
        _ => format!("%x: {x}, %w: {wt}, %y: {y}"),
    };
    format!("  func.func @{name}({args}) attributes {{llvm.emit_c_interface}} {{\n{}  }}\n", indent(&body, 4))
}

/// `y[o, i] = bf16(fp8(w[o, i]) · 2^(s[o, i / block] − 127))` as bf16 bits:
/// an MXFP8 weight decoded for a tensor-core GEMM (see `Kernel::DequantMxfp8`).
pub fn dequant_mxfp8(name: &str, out: usize, inp: usize, block: usize) -> String {
    let wt = format!("memref<{out}x{inp}xi8>");
    let st = format!("memref<{out}x{}xi8>", inp / block);
    // Rows of bf16 bits, as the scratch the entry allocates for it is viewed.
    let yt = format!("memref<?x{inp}xi16>");
    let body = format!(
        "%c0 = arith.constant 0 : index\n\
         %c1 = arith.constant 1 : index\n\
         %cout = arith.constant {out} : index\n\
         %cin = arith.constant {inp} : index\n\
         %cb = arith.constant {block} : index\n\
         {E8M0_CONSTANTS}\
         %lut = memref.get_global @m3c_fp8_e4m3_lut : memref<256xf32>\n\
         scf.for %o = %c0 to %cout step %c1 {{\n\
         \x20 scf.for %i = %c0 to %cin step %c1 {{\n\
         \x20   %q = memref.load %w[%o, %i] : {wt}\n\
         \x20   %qi = arith.extui %q : i8 to i32\n\
         \x20   %qx = arith.index_cast %qi : i32 to index\n\
         \x20   %wv = memref.load %lut[%qx] : memref<256xf32>\n\
         \x20   %b = arith.divui %i, %cb : index\n\
         \x20   %sb = memref.load %s[%o, %b] : {st}\n\
         {dec}\
         \x20   %v = arith.mulf %wv, %scale : f32\n\
         {store}\
         \x20 }}\n\
         }}\n\
         return\n",
        dec = indent(&e8m0_to_f32("%scale", "%sb"), 4),
        store = indent(&store_f32("%v", "%y", &yt, "%o", "%i", Storage::Bf16), 4),
    );
    format!("  func.func @{name}(%w: {wt}, %s: {st}, %y: {yt}) attributes {{llvm.emit_c_interface}} {{\n{}  }}\n", indent(&body, 4))
}
