//! The host linear when the widths allow vectors: register-tiled, with
//! bf16/F16/MXFP8 weights decoded into f32 panels once per tile at prefill.
//!
//! # The summation order, and why it never depends on the tile
//! Every output `y[r, o]` is the same sum whatever path computes it:
//! [`LANES`] lane sums, lane `l` accumulating `x[r, i] · w[o, i]` for
//! `i ≡ l (mod LANES)` in increasing `i`, each step one fused multiply-add
//! (`fastmath<contract>` on the product and its sum, and nothing else
//! reassociates), then the lanes summed by the fixed halving tree of
//! [`hsum`] (written out, so LLVM may not reorder it). The micro-tile only
//! chooses *which* sums advance together: 3 rows × 4 outputs at prefill
//! (12 accumulator registers, 7 loads per 12 FMAs), 1 × 4 at decode. A
//! decoded panel holds exactly the values the direct path decodes (fp8 ×
//! its power-of-two scale is exact in f32), so a row's result is the same
//! bits alone or in a batch, in any prefill chunk, on any thread count.

use crate::emit::{e8m0_to_f32, indent, load_f32xn, parallel_or_serial, store_f32, E8M0_CONSTANTS};
use crate::host::{index_consts, BASICS};
use crate::{Storage, WeightType};

/// Lanes of a dot product's partial sums: one AVX2 register of f32.
pub const LANES: usize = 8;

/// Rows of the prefill micro-tile.
const MR: usize = 3;
/// Outputs of every micro-tile.
const NR: usize = 4;

/// Activation rows from which a call decodes each tile's bf16/F16/MXFP8
/// weights into an f32 panel once, instead of in every micro-tile (a decode
/// step's few rows read each weight once anyway, straight from memory).
const PACK_MIN_ROWS: usize = 6;

/// Bytes of L2 given to each of the row tile's activations and the output
/// tile's panel: together about half of a 512 KB-per-core L2.
const TILE_BYTES: usize = 128 * 1024;

/// Inputs per K block of a panel pass over a reduction longer than
/// [`KC_FROM`]: a micro-tile's 4 panel rows (12 KB) then stay in L1 while
/// every row group of the tile passes them, and its 3 activation rows
/// (9 KB) come from L2. The lane sums wait between K blocks in f32 scratch
/// (exactly, so the order of every sum is unchanged). Measured on the real
/// widths at 512 rows (`m3c bench-kernels`): 6144 × 6144 in 580 ms against
/// 790 unblocked, while widths up to 1536 run faster unblocked.
const KC: usize = 768;

/// Reductions longer than this are K-blocked.
const KC_FROM: usize = 2048;

/// Whether this path applies: every input width of MiniMax-M3 (and of the
/// tiny fixtures) is a multiple of 32, as MXFP8's blocks require.
pub fn vectorizes(inp: usize, weight: WeightType) -> bool {
    inp.is_multiple_of(LANES)
        && match weight {
            WeightType::Mxfp8 { block } => block.is_multiple_of(LANES),
            _ => true,
        }
}

/// Where a micro-tile's weight vectors come from.
#[derive(Clone, Copy, PartialEq)]
enum Source {
    /// `%w` itself, decoded in registers (f32 weights need no decoding).
    Direct,
    /// The tile's f32 panel `%pw`, whose row 0 is output `%ot`.
    Panel,
}

/// Types and the weight format every piece of the body needs.
struct Ctx {
    weight: WeightType,
    act: Storage,
    out_act: Storage,
    x: String,
    y: String,
    wt: String,
    st: String,
    pt: String,
    /// The K-blocked panel pass's scratch of lane sums, `[row, output, lane]`
    /// within the tile; empty when the reduction fits one block.
    at: String,
}

const V: &str = "vector<8xf32>";
const VH: &str = "vector<8xi16>";

/// The body of the linear `y[S, out] = x[S, inp] · W[out, inp]ᵀ`.
pub fn body(inp: usize, out: usize, weight: WeightType, act: Storage, out_act: Storage) -> String {
    debug_assert!(vectorizes(inp, weight) && LANES == 8);
    // The inputs a tile's pass holds at once: all, or one K block.
    let blocked = inp > KC_FROM && weight != WeightType::F32;
    let span = if blocked { KC } else { inp };
    let row_tile = (TILE_BYTES / (span * 4)).clamp(MR, 96) / MR * MR;
    // A multiple of NR, small enough for L2 and for every core to get tiles.
    let out_tile = (TILE_BYTES / (span * 4)).min(out.div_ceil(16)).max(NR).next_multiple_of(NR);
    let c = Ctx {
        weight,
        act,
        out_act,
        x: format!("memref<?x{inp}x{}>", act.mlir_elem()),
        y: format!("memref<?x{out}x{}>", out_act.mlir_elem()),
        wt: format!("memref<{out}x{inp}x{}>", weight.mlir_elem()),
        st: match weight {
            WeightType::Mxfp8 { block } => format!("memref<{out}x{}xi8>", inp / block),
            _ => String::new(),
        },
        pt: format!("memref<{out_tile}x{inp}xf32>"),
        at: if blocked { format!("memref<{row_tile}x{out_tile}x{LANES}xf32>") } else { String::new() },
    };
    let mut consts = format!(
        "{BASICS}{}%vz = arith.constant dense<0.0> : {V}\n",
        index_consts(&[
            ("cl", LANES),
            ("cmr", MR),
            ("cnr", NR),
            ("cout", out),
            ("cin", inp),
            ("crt", row_tile),
            ("cot", out_tile),
            ("ckc", KC)
        ])
    );
    if let WeightType::Mxfp8 { block } = weight {
        consts.push_str(&index_consts(&[("cnb", inp / block), ("cb", block)]));
        consts.push_str(E8M0_CONSTANTS);
        for (n, val) in [("80", 0x80), ("8", 8), ("7f", 0x7F), ("7", 7), ("qnan", 0x7E00)] {
            consts.push_str(&format!("%h_{n} = arith.constant dense<{val}> : {VH}\n"));
        }
        consts.push_str(&format!("%v_256 = arith.constant dense<256.0> : {V}\n"));
    }
    let tiles = |src| tile_loops(&c, src);
    let tile = if weight == WeightType::F32 {
        tiles(Source::Direct)
    } else {
        format!(
            "%pack_min = arith.constant {PACK_MIN_ROWS} : index\n\
             %pack = arith.cmpi uge, %rows, %pack_min : index\n\
             scf.if %pack {{\n\
             \x20 %pw = memref.alloc() {{alignment = 64 : i64}} : {pt}\n\
             {fill}\
             {panel}\
             \x20 memref.dealloc %pw : {pt}\n\
             }} else {{\n\
             {direct}\
             }}\n",
            pt = c.pt,
            fill = indent(&pack(&c), 2),
            panel = indent(&tiles(Source::Panel), 2),
            direct = indent(&tiles(Source::Direct), 2),
        )
    };
    let tile = format!("%ot_end0 = arith.addi %ot, %cot : index\n%ot_end = arith.minui %ot_end0, %cout : index\n{tile}");
    format!(
        "{consts}\
         %rows = memref.dim %x, %c0 : {x}\n\
         %work0 = arith.constant {macs} : index\n\
         %work = arith.muli %rows, %work0 : index\n\
         {tiles}\
         return\n",
        x = c.x,
        macs = inp * out,
        tiles = parallel_or_serial("%work", &["%ot"], &["%c0"], &["%cout"], &["%cot"], &tile),
    )
}

/// Decodes outputs `%ot..%ot_end` of `%w` into the panel `%pw`.
fn pack(c: &Ctx) -> String {
    let per_vector = |w: &str| format!("{}vector.store {w}, %pw[%pr, %i] : {}, {V}\n", decode(c, "%po", "%i", "p", "%psv"), c.pt);
    let inner = match c.weight {
        WeightType::Mxfp8 { .. } => format!(
            "scf.for %b = %c0 to %cnb step %c1 {{\n\
             \x20 %sb = memref.load %s[%po, %b] : {st}\n\
             {dec}\
             \x20 %psv = vector.broadcast %scale : f32 to {V}\n\
             \x20 %base = arith.muli %b, %cb : index\n\
             \x20 scf.for %j = %c0 to %cb step %cl {{\n\
             \x20   %i = arith.addi %base, %j : index\n\
             {store}\
             \x20 }}\n\
             }}\n",
            st = c.st,
            dec = indent(&e8m0_to_f32("%scale", "%sb"), 2),
            store = indent(&per_vector("%wp"), 4),
        ),
        _ => format!("scf.for %i = %c0 to %cin step %cl {{\n{}}}\n", indent(&per_vector("%wp"), 2)),
    };
    format!("scf.for %po = %ot to %ot_end step %c1 {{\n\x20 %pr = arith.subi %po, %ot : index\n{}}}\n", indent(&inner, 2))
}

/// `%w{tag}`: the 8 weights of output `o` from column `i` of `%w` as f32
/// (times the block's scale `%{scale}` for MXFP8).
fn decode(c: &Ctx, o: &str, i: &str, tag: &str, scale: &str) -> String {
    let w = format!("%w{tag}");
    match c.weight {
        WeightType::F32 => format!("{w} = vector.load %w[{o}, {i}] : {}, {V}\n", c.wt),
        WeightType::BF16 | WeightType::F16 => format!(
            "{w}_n = vector.load %w[{o}, {i}] : {wt}, vector<8x{e}>\n{w} = arith.extf {w}_n : vector<8x{e}> to {V}\n",
            wt = c.wt,
            e = c.weight.mlir_elem()
        ),
        // fp8 E4M3FN as the f16 with the same exponent and mantissa bits
        // (sign to bit 15, the rest shifted up 7): that f16 is the fp8
        // value × 2^-8 exactly, subnormals included, and the F16C convert
        // widens it. Then × 2^8 (exact) and × the block's scale: the one
        // rounding of fp8 × scale, as the table path makes. 0x7F/0xFF
        // (NaN in E4M3FN, ±1.875·2^8 in f16) become the f16 quiet NaN.
        WeightType::Mxfp8 { .. } => format!(
            "{w}_q = vector.load %w[{o}, {i}] : {wt}, vector<8xi8>\n\
             {w}_u = arith.extui {w}_q : vector<8xi8> to {VH}\n\
             {w}_s0 = arith.andi {w}_u, %h_80 : {VH}\n\
             {w}_s = arith.shli {w}_s0, %h_8 : {VH}\n\
             {w}_m0 = arith.andi {w}_u, %h_7f : {VH}\n\
             {w}_m = arith.shli {w}_m0, %h_7 : {VH}\n\
             {w}_b0 = arith.ori {w}_s, {w}_m : {VH}\n\
             {w}_nan = arith.cmpi eq, {w}_m0, %h_7f : {VH}\n\
             {w}_b = arith.select {w}_nan, %h_qnan, {w}_b0 : vector<8xi1>, {VH}\n\
             {w}_h = arith.bitcast {w}_b : {VH} to vector<8xf16>\n\
             {w}_f = arith.extf {w}_h : vector<8xf16> to {V}\n\
             {w}_v = arith.mulf {w}_f, %v_256 : {V}\n\
             {w} = arith.mulf {w}_v, {scale} : {V}\n",
            wt = c.wt
        ),
    }
}

/// The row tiles of one output tile `%ot..%ot_end`: full groups of [`NR`]
/// outputs, then the last outputs one by one; in each, groups of [`MR`]
/// rows, then the last rows one by one.
fn tile_loops(c: &Ctx, src: Source) -> String {
    let blocked = src == Source::Panel && !c.at.is_empty();
    let rows_of = |n: usize| {
        format!(
            "scf.for %r0 = %rt to %rfull step %cmr {{\n{}}}\n\
             scf.for %r0 = %rfull to %rt_end step %c1 {{\n{}}}\n",
            indent(&micro(c, src, MR, n, blocked), 2),
            indent(&micro(c, src, 1, n, blocked), 2)
        )
    };
    // Outputs `%o0 + q·%qs` advance together. From a panel, `%qs` is 1:
    // four neighbouring panel rows. Straight from the weights (decode), the
    // tile's full groups are cut in four strands, `%qs` = groups apart, so
    // each of the four weight streams runs through memory in one long
    // line that the hardware prefetcher follows (neighbouring rows
    // would make four streams of one row each, restarting every row).
    let (o_end, o_step, qs) = match src {
        Source::Panel => ("%oq_end", "%cnr", "%c1"),
        Source::Direct => ("%oq_str", "%c1", "%nq0"),
    };
    let outputs = format!(
        "%qs = arith.addi {qs}, %c0 : index\n\
         scf.for %o0 = %ot to {o_end} step {o_step} {{\n\
         {quads}\
         }}\n\
         scf.for %o0 = %oq_end to %ot_end step %c1 {{\n\
         {singles}\
         }}\n",
        quads = indent(&rows_of(NR), 2),
        singles = indent(&rows_of(1), 2),
    );
    // K-blocked: lane sums start at zero in scratch, every K block adds
    // to them, and a last pass reduces each and stores it.
    let outputs = if blocked {
        let at = &c.at;
        format!(
            "scf.for %zr = %rt to %rt_end step %c1 {{\n\
             \x20 %zri = arith.subi %zr, %rt : index\n\
             \x20 scf.for %zo = %ot to %ot_end step %c1 {{\n\
             \x20   %zoi = arith.subi %zo, %ot : index\n\
             \x20   vector.store %vz, %acs[%zri, %zoi, %c0] : {at}, {V}\n\
             \x20 }}\n\
             }}\n\
             scf.for %kb0 = %c0 to %cin step %ckc {{\n\
             \x20 %kb1a = arith.addi %kb0, %ckc : index\n\
             \x20 %kb1 = arith.minui %kb1a, %cin : index\n\
             {outputs}\
             }}\n\
             scf.for %zr = %rt to %rt_end step %c1 {{\n\
             \x20 %zri = arith.subi %zr, %rt : index\n\
             \x20 scf.for %zo = %ot to %ot_end step %c1 {{\n\
             \x20   %zoi = arith.subi %zo, %ot : index\n\
             \x20   %zv = vector.load %acs[%zri, %zoi, %c0] : {at}, {V}\n\
             {red}\
             \x20 }}\n\
             }}\n",
            outputs = indent(&outputs, 2),
            red = indent(&(hsum("%zs", "%zv") + &store_f32("%zs", "%y", &c.y, "%zr", "%zo", c.out_act)), 4),
        )
    } else {
        outputs
    };
    let (alloc, dealloc) = if blocked {
        (format!("%acs = memref.alloc() {{alignment = 64 : i64}} : {}\n", c.at), format!("memref.dealloc %acs : {}\n", c.at))
    } else {
        (String::new(), String::new())
    };
    format!(
        "%on = arith.subi %ot_end, %ot : index\n\
         %nq0 = arith.divui %on, %cnr : index\n\
         %nq = arith.muli %nq0, %cnr : index\n\
         %oq_end = arith.addi %ot, %nq : index\n\
         %oq_str = arith.addi %ot, %nq0 : index\n\
         {alloc}\
         scf.for %rt = %c0 to %rows step %crt {{\n\
         \x20 %rt_end0 = arith.addi %rt, %crt : index\n\
         \x20 %rt_end = arith.minui %rt_end0, %rows : index\n\
         \x20 %rn = arith.subi %rt_end, %rt : index\n\
         \x20 %nf0 = arith.divui %rn, %cmr : index\n\
         \x20 %nf = arith.muli %nf0, %cmr : index\n\
         \x20 %rfull = arith.addi %rt, %nf : index\n\
         {outputs}\
         }}\n\
         {dealloc}",
        outputs = indent(&outputs, 2),
    )
}

/// One micro-tile: rows `%r0..+m` × outputs `%o0..+n`, the reduction in
/// `m·n` vector accumulators, then each reduced and stored; `blocked`: only
/// inputs `%kb0..%kb1`, the accumulators loaded from and stored back to
/// the scratch `%acs`.
fn micro(c: &Ctx, src: Source, m: usize, n: usize, blocked: bool) -> String {
    let head: String = (1..m)
        .map(|j| format!("%c{j}_k = arith.constant {j} : index\n%kr{j} = arith.addi %r0, %c{j}_k : index\n"))
        .chain((1..n).map(|q| {
            format!(
                "%c{q}_q = arith.constant {q} : index\n%kq{q} = arith.muli %qs, %c{q}_q : index\n%ko{q} = arith.addi %o0, %kq{q} : index\n"
            )
        }))
        .collect();
    let row = |j: usize| if j == 0 { "%r0".to_string() } else { format!("%kr{j}") };
    let outp = |q: usize| if q == 0 { "%o0".to_string() } else { format!("%ko{q}") };
    let n_acc = m * n;
    let tys = vec![V; n_acc].join(", ");
    let acc = |p: &str| (0..n_acc).map(|a| format!("%{p}{a}")).collect::<Vec<_>>();
    let iter_args = |p: &str, init: &[String]| (0..n_acc).map(|a| format!("%{p}{a} = {}", init[a])).collect::<Vec<_>>().join(", ");
    let mut zeros = vec!["%vz".to_string(); n_acc];
    // Where each accumulator waits between K blocks.
    let mut at_rows = String::new();
    let slot = |j: usize, q: usize| format!("%acs[%krel{j}, %kp{q}, %c0] : {}, {V}", c.at);
    if blocked {
        for j in 0..m {
            at_rows.push_str(&format!("%krel{j} = arith.subi {}, %rt : index\n", row(j)));
        }
        for (a_, z) in zeros.iter_mut().enumerate() {
            *z = format!("%kin{a_}");
        }
    }
    // The panel row of each output.
    let mut prow = String::new();
    if src == Source::Panel {
        for q in 0..n {
            prow.push_str(&format!("%kp{q} = arith.subi {}, %ot : index\n", outp(q)));
        }
    }
    // One step of the reduction at column `%ki` from accumulators `a` to `b`.
    let step = |a: &str, b: &str, scale: &dyn Fn(usize) -> String| -> String {
        let mut s = String::new();
        for j in 0..m {
            s.push_str(&load_f32xn(LANES, &format!("%kx{j}"), "%x", &c.x, &row(j), "%ki", c.act));
        }
        // Each weight vector right before its m FMAs: m activation
        // registers, one weight register and the m·n accumulators (16 at
        // 3 × 4) are live, so nothing spills.
        for q in 0..n {
            s.push_str(&match src {
                Source::Panel => format!("%wk{q} = vector.load %pw[%kp{q}, %ki] : {}, {V}\n", c.pt),
                Source::Direct => decode(c, &outp(q), "%ki", &format!("k{q}"), &scale(q)),
            });
            for j in 0..m {
                let a_ = j * n + q;
                s.push_str(&format!(
                    "%kpr{j}_{q} = arith.mulf %kx{j}, %wk{q} fastmath<contract> : {V}\n\
                     %{b}{a_} = arith.addf %{a}{a_}, %kpr{j}_{q} fastmath<contract> : {V}\n"
                ));
            }
        }
        s
    };
    let loop_text = match (src, c.weight) {
        (Source::Direct, WeightType::Mxfp8 { .. }) => {
            let mut scales = String::new();
            for q in 0..n {
                scales.push_str(&format!(
                    "%ksb{q} = memref.load %s[{}, %kb] : {}\n{}%ksv{q} = vector.broadcast %kscale{q} : f32 to {V}\n",
                    outp(q),
                    c.st,
                    e8m0_to_f32(&format!("%kscale{q}"), &format!("%ksb{q}"))
                ));
            }
            format!(
                "%acc:{n_acc} = scf.for %kb = %c0 to %cnb step %c1 iter_args({}) -> ({tys}) {{\n\
                 {}\
                 \x20 %kbase = arith.muli %kb, %cb : index\n\
                 \x20 %ab:{n_acc} = scf.for %kj = %c0 to %cb step %cl iter_args({}) -> ({tys}) {{\n\
                 \x20   %ki = arith.addi %kbase, %kj : index\n\
                 {}\
                 \x20   scf.yield {} : {tys}\n\
                 \x20 }}\n\
                 \x20 scf.yield {} : {tys}\n\
                 }}\n",
                iter_args("a", &zeros),
                indent(&scales, 2),
                iter_args("b", &acc("a")),
                indent(&step("b", "n", &|q| format!("%ksv{q}")), 4),
                acc("n").join(", "),
                (0..n_acc).map(|a| format!("%ab#{a}")).collect::<Vec<_>>().join(", "),
            )
        }
        _ => format!(
            "%acc:{n_acc} = scf.for %ki = %c0 to %cin step %cl iter_args({}) -> ({tys}) {{\n\
             {}\
             \x20 scf.yield {} : {tys}\n\
             }}\n",
            iter_args("a", &zeros),
            indent(&step("a", "n", &|_| String::new()), 2),
            acc("n").join(", "),
        ),
    };
    let mut text = format!("{head}{prow}{at_rows}");
    if blocked {
        for j in 0..m {
            for q in 0..n {
                text.push_str(&format!("%kin{} = vector.load {}\n", j * n + q, slot(j, q)));
            }
        }
        text.push_str(&loop_text.replacen("%ki = %c0 to %cin", "%ki = %kb0 to %kb1", 1));
        for j in 0..m {
            for q in 0..n {
                text.push_str(&format!("vector.store %acc#{}, {}\n", j * n + q, slot(j, q)));
            }
        }
        return text;
    }
    text.push_str(&loop_text);
    for j in 0..m {
        for q in 0..n {
            let a_ = j * n + q;
            text.push_str(&hsum(&format!("%ks{a_}"), &format!("%acc#{a_}")));
            text.push_str(&store_f32(&format!("%ks{a_}"), "%y", &c.y, &row(j), &outp(q), c.out_act));
        }
    }
    text
}

/// `{dst}` (f32) = the sum of the 8 lanes of `{v}` by a fixed halving
/// tree: `((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))`.
fn hsum(dst: &str, v: &str) -> String {
    format!(
        "{dst}_lo4 = vector.extract_strided_slice {v} {{offsets = [0], sizes = [4], strides = [1]}} : {V} to vector<4xf32>\n\
         {dst}_hi4 = vector.extract_strided_slice {v} {{offsets = [4], sizes = [4], strides = [1]}} : {V} to vector<4xf32>\n\
         {dst}_4 = arith.addf {dst}_lo4, {dst}_hi4 : vector<4xf32>\n\
         {dst}_lo2 = vector.extract_strided_slice {dst}_4 {{offsets = [0], sizes = [2], strides = [1]}} : vector<4xf32> to vector<2xf32>\n\
         {dst}_hi2 = vector.extract_strided_slice {dst}_4 {{offsets = [2], sizes = [2], strides = [1]}} : vector<4xf32> to vector<2xf32>\n\
         {dst}_2 = arith.addf {dst}_lo2, {dst}_hi2 : vector<2xf32>\n\
         {dst}_a = vector.extract {dst}_2[0] : f32 from vector<2xf32>\n\
         {dst}_b = vector.extract {dst}_2[1] : f32 from vector<2xf32>\n\
         {dst} = arith.addf {dst}_a, {dst}_b : f32\n"
    )
}
