//! The host linear when the widths allow vectors: register-tiled, with
//! bf16/F16/MXFP8 weights decoded into f32 panels of an output tile (its
//! whole reduction, or one K block at a time) at prefill.
//!
//! # The summation order, and why it never depends on the tile
//! Every output `y[r, o]` is the same sum whatever path computes it:
//! [`LANES`] lane sums, lane `l` accumulating `x[r, i] · w[o, i]` for
//! `i ≡ l (mod LANES)` in increasing `i`, each step one fused multiply-add
//! (`fastmath<contract>` on the product and its sum, and nothing else
//! reassociates), then the lanes summed by the fixed halving tree of
//! [`hsum`] (written out, so LLVM may not reorder it). The micro-tile only
//! chooses *which* sums advance together: 3 rows × 4 outputs at prefill
//! (12 accumulator registers, 7 loads per 12 FMAs), 1 × 4 at decode; the
//! lane sums wait in f32 scratch between K blocks, exactly. A decoded panel
//! holds exactly the values the direct path decodes (fp8 × its
//! power-of-two scale is exact in f32), so a row's result is the same bits
//! alone or in a batch, in any prefill chunk, on any thread count.
//!
//! # AVX-512: two sums a register
//! On CPUs with 16-lane vectors ([`HostWidth::Lanes16`]) the prefill
//! micro-tiles hold two outputs' 8 lane sums in one register: the row's 8
//! activations twice against 8 weights of each output, one FMA for both.
//! Each lane still takes the same products in the same order, so the bits
//! are the 8-lane form's. The micro-tile is 4 rows × 8 outputs (16 of the
//! 32 registers), and a tile's panel keeps each pair's weights side by
//! side, so that a pair is one load and no shuffle takes an FMA port.
//! At either width outputs are reduced eight at a time (`hsum8x8`): the
//! same tree as [`hsum`]'s, across registers.
//!
//! # Code size
//! The micro-tiles are functions of their own ([`Micro`]), shared by every
//! linear of a module with the same weight format and activation storage:
//! the shapes are their arguments, so each is compiled once, not once per
//! shape (and LLVM cannot fully unroll a small model's short reductions).

use crate::emit::{e8m0_to_f32, hsum, hsum8x8, indent, load_f32xn, parallel_or_serial, store_f32, E8M0_CONSTANTS};
use crate::host::{index_consts, BASICS};
use crate::{HostWidth, Storage, WeightType};

/// Lanes of a dot product's partial sums: one AVX2 register of f32.
pub const LANES: usize = 8;

/// Rows of the prefill micro-tile at 8 lanes.
const MR: usize = 3;
/// Rows of the prefill micro-tile at 16 lanes (outputs in pairs, a
/// register each): 4 × 4 pairs, 16 accumulators of the 32 registers.
/// 6 rows × 2 pairs ran at 44 % of the 16-lane peak, against 47-52 % for
/// 4 × 4 (`m3c bench-kernels`, 512 rows, before the paired panel): a row's
/// activations then serve 8 outputs, not 4, and their stream from L2 keeps
/// up with twice the FMA rate.
const MR_WIDE: usize = 4;
/// Outputs of the prefill micro-tile at 16 lanes.
const NR_WIDE: usize = 8;
/// Outputs of the micro-tiles at 8 lanes, and of every decode micro-tile.
const NR: usize = 4;

/// Activation rows from which a call decodes each tile's bf16/F16/MXFP8
/// weights into an f32 panel once and runs 3-row micro-tiles over it. Fewer
/// rows (a decode step of one or two sequences) read the weights in place,
/// one row at a time: the second row finds them in L1.
const PACK_MIN_ROWS: usize = 3;

/// Bytes of L2 given to each of the row tile's activations and the output
/// tile's panel: together about half of a 512 KB-per-core L2.
const TILE_BYTES: usize = 128 * 1024;

/// Inputs per K block of a pass over a reduction longer than [`KC_FROM`]:
/// a micro-tile's 4 panel rows (12 KB) then stay in L1 while every row
/// group of the tile passes them, and its 3 activation rows (9 KB) come
/// from L2. Measured on the real widths at 512 rows (`m3c bench-kernels`):
/// 6144 × 6144 in 580 ms against 790 unblocked.
const KC: usize = 768;

/// Reductions longer than this are K-blocked. With panels decoded per K
/// block into wide output tiles, the vision tower's 1280-input linears at
/// 2304 rows went from 41–56 % of the FMA peak unblocked to 63–70 %
/// (paired runs; the expert's 6144 × 1536 at 512 rows from 61–69 % to
/// 56–76 %). The tiny fixtures' widths stay unblocked.
const KC_FROM: usize = 1024;

/// Rows of a K-blocked row tile: their K block (288 KB) stays in L2 while
/// every output of the tile passes it.
const KC_ROWS: usize = 96;

/// Outputs of a K-blocked output tile, at most. The tile's activations are
/// read from L3 once per output tile, so wider tiles read them fewer times;
/// the panel is decoded per K block and streamed once per row tile, and
/// only its four rows in use need stay in L1. Measured on the real widths
/// at 512 rows against 44 (`m3c bench-kernels`, paired runs): 6144 × 6144,
/// 1280 × 5120 and 6144 × 24576 from 46–54 % of the FMA peak to 54–73 %.
const KC_OUTS: usize = 176;

/// Whether this path applies: every input width of MiniMax-M3 (and of the
/// tiny fixtures) is a multiple of 32, as MXFP8's blocks require.
pub fn vectorizes(inp: usize, weight: WeightType) -> bool {
    inp.is_multiple_of(LANES)
        && match weight {
            WeightType::Mxfp8 { block } => block.is_multiple_of(LANES),
            _ => true,
        }
}

const V: &str = "vector<8xf32>";
/// Two outputs' lane sums (16-lane micro-tiles).
const V2: &str = "vector<16xf32>";
/// `vector.shuffle` indices: `a`'s 8 lanes, then `b`'s.
const CAT: &str = "[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]";
/// `vector.shuffle` indices: `a`'s 8 lanes twice.
const TWICE: &str = "[0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7]";
/// The lane-sum scratch: `[row, output, lane]` within a tile.
const ACC: &str = "memref<?x?x8xf32>";

/// Where a micro-tile's weight vectors come from.
#[derive(Clone, Copy, PartialEq)]
enum Source {
    /// The weights themselves, decoded in registers.
    Direct,
    /// The tile's f32 panel.
    Panel,
}

/// A micro-tile function: rows `r0..r1` of `x`, `m` at a time, against
/// weight rows `wo0 + q·qs` (q < n) over inputs `k0..k1`, adding to the
/// lane sums at `acc[ar + (r - r0), ao + q·qs]`.
#[derive(Clone, Copy)]
struct Micro {
    m: usize,
    n: usize,
    /// The format of `w`: a panel is f32.
    weight: WeightType,
    act: Storage,
    /// Outputs in pairs, one 16-lane register each (`n` even, f32 weights).
    pair: bool,
    /// `w` is a panel of pairs ([`Tile::pack`]): row `o / 2`, the two
    /// outputs' 8 columns side by side at `2 · column + 8 · (o mod 2)`.
    paired_panel: bool,
}

impl Micro {
    fn symbol(&self) -> String {
        let p = if self.pair { "_p16" } else { "" };
        let pp = if self.paired_panel { "_pp" } else { "" };
        format!("m3c_linear_tile{}x{}{p}{pp}_{}{}", self.m, self.n, self.weight.tag(), self.act.act_suffix())
    }
    fn x_ty(&self) -> String {
        format!("memref<?x?x{}>", self.act.mlir_elem())
    }
    fn w_ty(&self) -> String {
        format!("memref<?x?x{}>", self.weight.mlir_elem())
    }
    fn mxfp8_block(&self) -> Option<usize> {
        match self.weight {
            WeightType::Mxfp8 { block } => Some(block),
            _ => None,
        }
    }

    /// The call: `x`, `w` (and `s`) as dynamic memrefs, then the indices.
    fn call(&self, x: &str, w: &str, s: &str, idx: &str) -> String {
        let (wt, xt) = (self.w_ty(), self.x_ty());
        let (sa, st) = if self.mxfp8_block().is_some() { (format!(", {s}"), ", memref<?x?xi8>") } else { (String::new(), "") };
        format!(
            "func.call @{}({x}, {w}{sa}, %acs, {idx}) : ({xt}, {wt}{st}, {ACC}, index, index, index, index, index, index, index, index, index) -> ()\n",
            self.symbol()
        )
    }

    /// Row `j` of the row group in `x`.
    fn row(j: usize) -> String {
        if j == 0 {
            "%rg".to_string()
        } else {
            format!("%kr{j}")
        }
    }

    /// A step's start at column `col` (names suffixed `t`): the rows'
    /// activations `%kx{j}`, and the weights' column `%kwc` (and in a
    /// paired panel `%kwc2`, its double).
    fn rows_and_column(&self, col: &str, t: &str) -> String {
        let xt = self.x_ty();
        let mut s = String::new();
        for j in 0..self.m {
            s.push_str(&load_f32xn(LANES, &format!("%kx{j}{t}"), "%x", &xt, &Self::row(j), col, self.act));
        }
        s.push_str(&format!("%kwc{t} = arith.addi {col}, %wc : index\n"));
        if self.paired_panel {
            s.push_str(&format!("%kwc2{t} = arith.addi %kwc{t}, %kwc{t} : index\n"));
        }
        s
    }

    /// `%wk{q}`: output `q`'s 8 weights (f32) at the step's column, from
    /// its row of `w` or its half of a paired panel's row.
    fn weights_of(&self, q: usize, t: &str) -> String {
        let (mut s, row, col) = if self.paired_panel {
            (format!("%kwi{q}{t} = arith.addi %kwc2{t}, %kwh{q} : index\n"), format!("%kwr{q}"), format!("%kwi{q}{t}"))
        } else {
            (String::new(), format!("%kw{q}"), format!("%kwc{t}"))
        };
        s.push_str(&weight_vector(self.weight, ("%w", &self.w_ty()), &format!("%wk{q}{t}"), (&row, &col), &format!("%ksv{q}")));
        s
    }

    /// One step at column `col` from accumulators `a` to `b` (names
    /// suffixed `t`): each weight vector right before its m FMAs, so m
    /// activation registers, one weight register and the m·n accumulators
    /// (16 at 3 × 4) are live and nothing spills.
    fn step(&self, a: &str, b: &str, col: &str, t: &str) -> String {
        if self.pair {
            return self.step_pairs(a, b, col, t);
        }
        let Micro { m, n, .. } = *self;
        let mut s = self.rows_and_column(col, t);
        for q in 0..n {
            s.push_str(&self.weights_of(q, t));
            for j in 0..m {
                let i = j * n + q;
                s.push_str(&format!(
                    "%kpr{j}_{q}{t} = arith.mulf %kx{j}{t}, %wk{q}{t} fastmath<contract> : {V}\n\
                     %{b}{i} = arith.addf %{a}{i}, %kpr{j}_{q}{t} fastmath<contract> : {V}\n"
                ));
            }
        }
        s
    }

    /// [`Micro::step`] with outputs in pairs: each row's 8 activations
    /// twice in one register, each pair's 8 weights of both outputs in
    /// another, one 16-lane FMA for the 2 × 8 lane sums.
    fn step_pairs(&self, a: &str, b: &str, col: &str, t: &str) -> String {
        let Micro { m, n, .. } = *self;
        let mut s = self.rows_and_column(col, t);
        for j in 0..m {
            s.push_str(&format!("%kxx{j}{t} = vector.shuffle %kx{j}{t}, %kx{j}{t} {TWICE} : {V}, {V}\n"));
        }
        for p in 0..n / 2 {
            if self.paired_panel {
                // The pair's 16 weights are side by side: one load.
                s.push_str(&format!("%wp{p}{t} = vector.load %w[%kwr{}, %kwc2{t}] : {}, {V2}\n", 2 * p, self.w_ty()));
            } else {
                s.push_str(&self.weights_of(2 * p, t));
                s.push_str(&self.weights_of(2 * p + 1, t));
                s.push_str(&format!("%wp{p}{t} = vector.shuffle %wk{}{t}, %wk{}{t} {CAT} : {V}, {V}\n", 2 * p, 2 * p + 1));
            }
            for j in 0..m {
                let i = j * (n / 2) + p;
                s.push_str(&format!(
                    "%kpr{j}_{p}{t} = arith.mulf %kxx{j}{t}, %wp{p}{t} fastmath<contract> : {V2}\n\
                     %{b}{i} = arith.addf %{a}{i}, %kpr{j}_{p}{t} fastmath<contract> : {V2}\n"
                ));
            }
        }
        s
    }

    /// Two MXFP8 steps, at `%ki` and `%ki + 8`, from 16 fp8 weights per
    /// output decoded at once: the integer operations that make their f16
    /// bits then run on 16 lanes of one register, not 8 of one each. Every
    /// sum still takes column `%ki`'s product, then `%ki + 8`'s.
    fn step16(&self, a: &str, b: &str) -> String {
        debug_assert!(!self.pair);
        let Micro { m, n, act, .. } = *self;
        let (xt, wt) = (self.x_ty(), self.w_ty());
        let mut s = String::from("%ki2 = arith.addi %ki, %cl : index\n");
        for j in 0..m {
            s.push_str(&load_f32xn(LANES, &format!("%kx{j}"), "%x", &xt, &Self::row(j), "%ki", act));
            s.push_str(&load_f32xn(LANES, &format!("%kx{j}_u"), "%x", &xt, &Self::row(j), "%ki2", act));
        }
        s.push_str("%kwc = arith.addi %ki, %wc : index\n");
        for q in 0..n {
            s.push_str(&fp8_decode(&format!("%wk{q}w"), ("%w", &wt), (&format!("%kw{q}"), "%kwc"), &format!("%ksw{q}"), 2 * LANES));
            for (half, t) in [(0, ""), (LANES, "_u")] {
                s.push_str(&format!(
                    "%wk{q}{t} = vector.extract_strided_slice %wk{q}w {{offsets = [{half}], sizes = [{LANES}], strides = [1]}} : vector<{}xf32> to {V}\n",
                    2 * LANES
                ));
            }
            for j in 0..m {
                let i = j * n + q;
                s.push_str(&format!(
                    "%kpr{j}_{q} = arith.mulf %kx{j}, %wk{q} fastmath<contract> : {V}\n\
                     %kmid{i} = arith.addf %{a}{i}, %kpr{j}_{q} fastmath<contract> : {V}\n\
                     %kpr{j}_{q}_u = arith.mulf %kx{j}_u, %wk{q}_u fastmath<contract> : {V}\n\
                     %{b}{i} = arith.addf %kmid{i}, %kpr{j}_{q}_u fastmath<contract> : {V}\n"
                ));
            }
        }
        s
    }

    /// A row group's accumulators `%kin*` loaded from the lane sums, and
    /// `%acc#*` stored back to them; `per`: accumulators a row.
    fn sums_in_out(&self, per: usize) -> (String, String) {
        let slot = |j: usize, q: usize| format!("%acs[%ka{j}, %kc{q}, %c0] : {ACC}, {V}");
        let (mut loads, mut stores) = (String::new(), String::new());
        for a in 0..self.m * per {
            let (j, q) = (a / per, a % per);
            if !self.pair {
                loads.push_str(&format!("%kin{a} = vector.load {}\n", slot(j, q)));
                stores.push_str(&format!("vector.store %acc#{a}, {}\n", slot(j, q)));
                continue;
            }
            loads.push_str(&format!(
                "%kin{a}_0 = vector.load {}\n%kin{a}_1 = vector.load {}\n%kin{a} = vector.shuffle %kin{a}_0, %kin{a}_1 {CAT} : {V}, {V}\n",
                slot(j, 2 * q),
                slot(j, 2 * q + 1)
            ));
            for h in 0..2 {
                stores.push_str(&format!(
                    "%kout{a}_{h} = vector.extract_strided_slice %acc#{a} {{offsets = [{}], sizes = [{LANES}], strides = [1]}} : {V2} to {V}\n\
                     vector.store %kout{a}_{h}, {}\n",
                    h * LANES,
                    slot(j, 2 * q + h)
                ));
            }
        }
        (loads, stores)
    }

    /// The function's text, a module-level global.
    fn text(&self) -> String {
        let Micro { m, n, .. } = *self;
        let (xt, wt) = (self.x_ty(), self.w_ty());
        let s_param = if self.mxfp8_block().is_some() { ", %s: memref<?x?xi8>" } else { "" };
        let mut head = format!("{BASICS}%cl = arith.constant {LANES} : index\n%cm = arith.constant {m} : index\n");
        // Per row group: its rows in `x` and in the lane sums, and the sums.
        let mut rowhead = String::new();
        for j in 1..m {
            head.push_str(&format!("%c{j}_k = arith.constant {j} : index\n"));
            rowhead.push_str(&format!("%kr{j} = arith.addi %rg, %c{j}_k : index\n"));
        }
        for j in 0..m {
            rowhead.push_str(&format!("%ka{j} = arith.addi %arg, {} : index\n", if j == 0 { "%c0".into() } else { format!("%c{j}_k") }));
        }
        for q in 0..n {
            head.push_str(&format!(
                "%c{q}_q = arith.constant {q} : index\n%kq{q} = arith.muli %qs, %c{q}_q : index\n\
                 %kw{q} = arith.addi %wo0, %kq{q} : index\n%kc{q} = arith.addi %ao, %kq{q} : index\n"
            ));
            if self.paired_panel {
                // Output kw's row of the paired panel, and its 8 columns' offset.
                head.push_str(&format!(
                    "%kwr{q} = arith.divui %kw{q}, %c2_pp : index\n%kwp{q} = arith.remui %kw{q}, %c2_pp : index\n%kwh{q} = arith.muli %kwp{q}, %cl : index\n"
                ));
            }
        }
        if self.paired_panel {
            head.insert_str(head.find("%cm = ").expect("the row constant"), "%c2_pp = arith.constant 2 : index\n");
        }
        if let Some(block) = self.mxfp8_block() {
            head.push_str(&format!("%cb = arith.constant {block} : index\n{E8M0_CONSTANTS}"));
            head.push_str(&fp8_consts(LANES));
            head.push_str(&fp8_consts(2 * LANES));
            head.push_str(&format!("%cl16 = arith.constant {} : index\n", 2 * LANES));
        }
        // Accumulator `a` holds row a / per's sums of output a % per, or
        // of the pair of outputs 2 (a % per) and the one after.
        let (per, vt) = if self.pair { (n / 2, V2) } else { (n, V) };
        let n_acc = m * per;
        let tys = vec![vt; n_acc].join(", ");
        let names = |p: &str| (0..n_acc).map(|a| format!("%{p}{a}")).collect::<Vec<_>>();
        let iter_args = |p: &str, init: &[String]| (0..n_acc).map(|a| format!("%{p}{a} = {}", init[a])).collect::<Vec<_>>().join(", ");
        let (loads, stores) = self.sums_in_out(per);
        rowhead.push_str(&loads);
        let body = match self.mxfp8_block() {
            // Block by block, each with its four scales.
            Some(block) => {
                let wide = block.is_multiple_of(2 * LANES);
                let mut scales = String::new();
                for q in 0..n {
                    scales.push_str(&format!(
                        "%ksb{q} = memref.load %s[%kw{q}, %kb] : memref<?x?xi8>\n{}%ksv{q} = vector.broadcast %kscale{q} : f32 to {V}\n",
                        e8m0_to_f32(&format!("%kscale{q}"), &format!("%ksb{q}"))
                    ));
                    if wide {
                        scales.push_str(&format!("%ksw{q} = vector.broadcast %kscale{q} : f32 to vector<{}xf32>\n", 2 * LANES));
                    }
                }
                let (kstep, inner) = if wide { ("%cl16", self.step16("b", "n")) } else { ("%cl", self.step("b", "n", "%ki", "")) };
                format!(
                    "%kb0 = arith.divui %k0, %cb : index\n\
                     %kb1 = arith.divui %k1, %cb : index\n\
                     %acc:{n_acc} = scf.for %kb = %kb0 to %kb1 step %c1 iter_args({}) -> ({tys}) {{\n\
                     {}\
                     \x20 %kbase = arith.muli %kb, %cb : index\n\
                     \x20 %ab:{n_acc} = scf.for %kj = %c0 to %cb step {kstep} iter_args({}) -> ({tys}) {{\n\
                     \x20   %ki = arith.addi %kbase, %kj : index\n\
                     {}\
                     \x20   scf.yield {} : {tys}\n\
                     \x20 }}\n\
                     \x20 scf.yield {} : {tys}\n\
                     }}\n",
                    iter_args("a", &names("kin")),
                    indent(&scales, 2),
                    iter_args("b", &names("a")),
                    indent(&inner, 4),
                    names("n").join(", "),
                    (0..n_acc).map(|a| format!("%ab#{a}")).collect::<Vec<_>>().join(", "),
                )
            }
            // Two steps per iteration (the bounds are arguments, so LLVM
            // would not unroll it), then the odd step if there is one.
            None => format!(
                "%c16 = arith.constant 16 : index\n\
                 %klen = arith.subi %k1, %k0 : index\n\
                 %krem = arith.remui %klen, %c16 : index\n\
                 %kmid = arith.subi %k1, %krem : index\n\
                 %accu:{n_acc} = scf.for %ki = %k0 to %kmid step %c16 iter_args({}) -> ({tys}) {{\n\
                 {}\
                 \x20 %ki2 = arith.addi %ki, %cl : index\n\
                 {}\
                 \x20 scf.yield {} : {tys}\n\
                 }}\n\
                 %acc:{n_acc} = scf.for %ki = %kmid to %k1 step %cl iter_args({}) -> ({tys}) {{\n\
                 {}\
                 \x20 scf.yield {} : {tys}\n\
                 }}\n",
                iter_args("a", &names("kin")),
                indent(&self.step("a", "m", "%ki", ""), 2),
                indent(&self.step("m", "n", "%ki2", "_u"), 2),
                names("n").join(", "),
                iter_args("a", &(0..n_acc).map(|i| format!("%accu#{i}")).collect::<Vec<_>>()),
                indent(&self.step("a", "n", "%ki", ""), 2),
                names("n").join(", "),
            ),
        };
        // The row groups loop here, not around the call: the call's entry
        // (about 60 instructions unpacking memref descriptors) is then paid
        // once per output quad and K block, not once per 1,152 FMAs.
        let groups = format!(
            "scf.for %rg = %r0 to %r1 step %cm {{\n\
             \x20 %rga = arith.subi %rg, %r0 : index\n\
             \x20 %arg = arith.addi %ar, %rga : index\n\
             {}\
             }}\n",
            indent(&format!("{rowhead}{body}{stores}"), 2)
        );
        // Not inlined: one copy serves every call site (see the module doc).
        format!(
            "  func.func private @{}(%x: {xt}, %w: {wt}{s_param}, %acs: {ACC}, %r0: index, %r1: index, %wo0: index, %ar: index, %ao: index, %qs: index, %k0: index, %k1: index, %wc: index) attributes {{passthrough = [\"noinline\"]}} {{\n{}  }}\n",
            self.symbol(),
            indent(&format!("{head}{groups}return\n"), 4)
        )
    }
}

/// The constants [`fp8_decode`] uses at `lanes` lanes.
fn fp8_consts(lanes: usize) -> String {
    let mut c: String = [("8", 8), ("1", 1), ("3f80", 0x3F80), ("80", 0x80), ("4000", 0x4000), ("bfff", 0xBFFF_u16 as i16 as i32)]
        .iter()
        .map(|(nm, val)| format!("%h{lanes}_{nm} = arith.constant dense<{val}> : vector<{lanes}xi16>\n"))
        .collect();
    c.push_str(&format!("%v{lanes}_256 = arith.constant dense<256.0> : vector<{lanes}xf32>\n"));
    c
}

/// `{dst}`: the 8 f32 weights of row `{o}` from column `{i}` of `{mem}`
/// (type `wt`, format `weight`), times `{scale}` (a broadcast vector) for MXFP8.
fn weight_vector(weight: WeightType, (mem, wt): (&str, &str), dst: &str, (o, i): (&str, &str), scale: &str) -> String {
    let w = dst;
    match weight {
        WeightType::F32 => format!("{w} = vector.load {mem}[{o}, {i}] : {wt}, {V}\n"),
        WeightType::BF16 | WeightType::F16 => format!(
            "{w}_n = vector.load {mem}[{o}, {i}] : {wt}, vector<8x{e}>\n{w} = arith.extf {w}_n : vector<8x{e}> to {V}\n",
            e = weight.mlir_elem()
        ),
        WeightType::Mxfp8 { .. } => fp8_decode(w, (mem, wt), (o, i), scale, LANES),
    }
}

/// `{w}`: `lanes` f32 weights (a vector of that many) of row `{o}` from
/// column `{i}` of the fp8 memref `{mem}` (type `wt`), times `{scale}` (a
/// broadcast vector of `lanes`). Needs [`fp8_consts`] at `lanes`.
///
/// fp8 E4M3FN as the f16 with the same exponent and mantissa bits (sign to
/// bit 15, the rest shifted up 7): that f16 is the fp8 value × 2^-8
/// exactly, subnormals included, and the F16C convert widens it. Then ×
/// 2^8 (exact) and × the block's scale: the one rounding of fp8 × scale,
/// as the table path makes. The byte goes to the top (sign at 15,
/// magnitude at 14..8) and one arithmetic shift puts the magnitude at
/// 13..7 with the sign in bits 15 and 14; clearing 14 leaves the f16.
/// 0x7F/0xFF (NaN in E4M3FN, ±1.875·2^8 in f16) become an f16 quiet NaN by
/// arithmetic, not a select: the magnitude's bits plus 0x80 carry into bit
/// 14 for 0x7F alone, and bit 14 set makes the exponent all ones with the
/// mantissa not zero. (LLVM turned a select into an 8-lane f32 blend after
/// the convert: three more micro-ops per 8 weights on Zen 1; this is two
/// integer operations fewer than masking sign and magnitude apart.)
fn fp8_decode(w: &str, (mem, wt): (&str, &str), (o, i): (&str, &str), scale: &str, lanes: usize) -> String {
    let (vh, vf, h) = (format!("vector<{lanes}xi16>"), format!("vector<{lanes}xf32>"), format!("%h{lanes}"));
    format!(
        "{w}_q = vector.load {mem}[{o}, {i}] : {wt}, vector<{lanes}xi8>\n\
         {w}_u = arith.extui {w}_q : vector<{lanes}xi8> to {vh}\n\
         {w}_t = arith.shli {w}_u, {h}_8 : {vh}\n\
         {w}_a = arith.shrsi {w}_t, {h}_1 : {vh}\n\
         {w}_m = arith.andi {w}_a, {h}_3f80 : {vh}\n\
         {w}_n1 = arith.addi {w}_m, {h}_80 : {vh}\n\
         {w}_n = arith.andi {w}_n1, {h}_4000 : {vh}\n\
         {w}_b0 = arith.andi {w}_a, {h}_bfff : {vh}\n\
         {w}_b = arith.ori {w}_b0, {w}_n : {vh}\n\
         {w}_h = arith.bitcast {w}_b : {vh} to vector<{lanes}xf16>\n\
         {w}_f = arith.extf {w}_h : vector<{lanes}xf16> to {vf}\n\
         {w}_v = arith.mulf {w}_f, %v{lanes}_256 : {vf}\n\
         {w} = arith.mulf {w}_v, {scale} : {vf}\n"
    )
}

/// Inputs per K block: the whole reduction up to [`KC_FROM`], else [`KC`]
/// (the last block shorter). Even blocks (640 + 640 at 1280 inputs) ran
/// 10–20 points of the FMA peak slower than 768 + 512 in paired runs.
fn k_block(inp: usize) -> usize {
    if inp > KC_FROM {
        KC
    } else {
        inp
    }
}

/// Bytes a thread's panel may take to hold its output tile's whole
/// reduction: such a panel is decoded once, on the first row tile, and the
/// later row tiles read it from L3 instead of decoding every K block again
/// (6144 × 6144: 4.3 MB). A longer one (the 2×2 merge's 24576 inputs)
/// holds one K block and is decoded per row tile.
const FULL_PANEL_BYTES: usize = 8 << 20;

/// The inputs a panel holds: all of them where they fit
/// [`FULL_PANEL_BYTES`], else one K block.
fn panel_inputs(inp: usize, tiles: Tiles) -> usize {
    let outs = if tiles.outs_balanced { KC_OUTS } else { tiles.outs_packed };
    if outs * inp * 4 <= FULL_PANEL_BYTES {
        inp
    } else {
        k_block(inp)
    }
}

/// The tile sizes of one linear's shape.
#[derive(Clone, Copy)]
struct Tiles {
    rows: usize,
    /// Outputs per tile when the weights are decoded into panels.
    outs_packed: usize,
    /// Whether the call picks the panel tiles' width at run time (the
    /// K-blocked shapes; see [`balanced_outs`]).
    outs_balanced: bool,
    /// Outputs per tile when they are read in place (decode): the tile's
    /// four weight strands then stay close enough for the prefetcher
    /// (176-output tiles halved MXFP8 decode over 24576 inputs).
    outs_direct: usize,
}

fn tiles_of(inp: usize, out: usize, (mr, nr): (usize, usize)) -> Tiles {
    // A multiple of the micro-tiles' outputs, with enough tiles for every
    // core to get some.
    let outs = |n: usize, nr: usize| n.min(out.div_ceil(16)).max(nr).next_multiple_of(nr);
    let fit = TILE_BYTES / (k_block(inp) * 4);
    let (rows, outs_packed) = if inp > KC_FROM { (KC_ROWS, KC_OUTS) } else { (fit.clamp(mr, 96) / mr * mr, fit) };
    Tiles { rows, outs_packed: outs(outs_packed, nr), outs_balanced: inp > KC_FROM, outs_direct: outs(fit, NR) }
}

/// The function that computes one output tile for every row: shared by all
/// linears of a module with the same formats, the shape its arguments.
#[derive(Clone, Copy)]
struct Tile {
    weight: WeightType,
    act: Storage,
    out_act: Storage,
    /// Pairs of outputs a 16-lane register in the row-group micro-tiles.
    wide: bool,
}

impl Tile {
    fn new(weight: WeightType, act: Storage, out_act: Storage, width: HostWidth) -> Tile {
        Tile { weight, act, out_act, wide: width == HostWidth::Lanes16 }
    }
    fn symbol(&self) -> String {
        let w = if self.wide { "_w16" } else { "" };
        format!("m3c_linear_otile_{}{}_y{}{w}", self.weight.tag(), self.act.act_suffix(), self.out_act.name())
    }
    /// Rows and outputs of the row-group micro-tiles.
    fn mr_nr(&self) -> (usize, usize) {
        if self.wide {
            (MR_WIDE, NR_WIDE)
        } else {
            (MR, NR)
        }
    }
    fn mr(&self) -> usize {
        self.mr_nr().0
    }
    /// Outputs of the micro-tiles a pass from `src` calls for full groups.
    fn nr(&self, src: Source) -> usize {
        if self.row_groups(src) {
            self.mr_nr().1
        } else {
            NR
        }
    }
    fn types(&self) -> [String; 3] {
        [
            format!("memref<?x?x{}>", self.act.mlir_elem()),
            format!("memref<?x?x{}>", self.weight.mlir_elem()),
            format!("memref<?x?x{}>", self.out_act.mlir_elem()),
        ]
    }
    fn has_scales(&self) -> bool {
        matches!(self.weight, WeightType::Mxfp8 { .. })
    }
    /// Rows go through in groups of [`Tile::mr`] from panels, and in place for
    /// f32 weights (which need no panel); one by one when weights are
    /// decoded in place.
    fn row_groups(&self, src: Source) -> bool {
        src == Source::Panel || self.weight == WeightType::F32
    }
    /// Whether a panel pass over an unblocked reduction reads the
    /// activations in place rather than from a copy: when they are f32
    /// already. Its rows (4 KB apart at 1024 inputs) then stay in L2 for
    /// every output tile, where a copy per output tile cost more than it
    /// saved. 512 rows (`m3c bench-kernels`, 3 paired rounds, % of the FMA
    /// peak): 1024 × 1024 from 63-73 to 80-82, 1536 × 1024 from 69-71 to
    /// 79-84. The copy stays for bf16 activations (widened once) and for
    /// K-blocked shapes (rows 24 KB apart that would evict each other).
    fn in_place_unblocked(&self) -> bool {
        self.act == Storage::F32
    }

    /// The micro-tiles a pass from `src` calls: 4 outputs, then 1 for
    /// widths that leave some over.
    fn micros(&self, src: Source) -> Vec<Micro> {
        let (weight, act) = if src == Source::Panel { (WeightType::F32, Storage::F32) } else { (self.weight, self.act) };
        let mut ms = Vec::new();
        let paired_panel = self.wide && src == Source::Panel;
        for n in [self.nr(src), 1] {
            if self.row_groups(src) {
                // Row groups always read f32 weights (a panel, or f32 ones).
                ms.push(Micro { m: self.mr(), n, weight, act, pair: self.wide && n > 1, paired_panel });
            }
            ms.push(Micro { m: 1, n, weight, act, pair: false, paired_panel });
        }
        ms
    }
    fn sources(&self) -> Vec<Source> {
        if self.weight == WeightType::F32 {
            vec![Source::Direct]
        } else {
            vec![Source::Panel, Source::Direct]
        }
    }

    /// The call for output tile `%ot..%ot_end`.
    fn call(&self, kstep: &str, pk: &str) -> String {
        let [xt, wt, yt] = self.types();
        let (s, st) = if self.has_scales() { (", %sd", ", memref<?x?xi8>") } else { ("", "") };
        format!(
            "func.call @{}(%xd, %wd{s}, %yd, %ot, %ot_end, %rows, %cin, %crt, %cot, {kstep}, {pk}) : ({xt}, {wt}{st}, {yt}, index, index, index, index, index, index, index, index) -> ()\n",
            self.symbol()
        )
    }

    /// The function's text, a module-level global.
    fn text(&self) -> String {
        let [xt, wt, yt] = self.types();
        let s_param = if self.has_scales() { ", %s: memref<?x?xi8>" } else { "" };
        let tile = match self.weight {
            WeightType::F32 => self.tile_loops(Source::Direct),
            _ => format!(
                "%pack_min = arith.constant {PACK_MIN_ROWS} : index\n\
                 %pack = arith.cmpi uge, %rows, %pack_min : index\n\
                 scf.if %pack {{\n\
                 {alloc}\
                 \x20 %xp = memref.alloc(%rtm, %kstep) {{alignment = 64 : i64}} : memref<?x?xf32>\n\
                 {panel}\
                 \x20 memref.dealloc %xp : memref<?x?xf32>\n\
                 \x20 memref.dealloc %pwd : memref<?x?xf32>\n\
                 }} else {{\n\
                 {direct}\
                 }}\n",
                panel = indent(&self.tile_loops(Source::Panel), 2),
                alloc = indent(&self.panel_alloc(), 2),
                direct = indent(&self.tile_loops(Source::Direct), 2),
            ),
        };
        let body = format!(
            "{BASICS}\
             %cmr = arith.constant {mr} : index\n\
             %c8 = arith.constant {LANES} : index\n\
             %vz = arith.constant dense<0.0> : {V}\n\
             %rtm = arith.minui %crt, %rows : index\n\
             %acs = memref.alloc(%rtm, %cot) {{alignment = 64 : i64}} : {ACC}\n\
             {tile}\
             memref.dealloc %acs : {ACC}\n\
             return\n",
            mr = self.mr()
        );
        // Not inlined: one copy serves every linear (see the module doc).
        format!(
            "  func.func private @{}(%xd: {xt}, %wd: {wt}{s_param}, %y: {yt}, %ot: index, %ot_end: index, %rows: index, %cin: index, %crt: index, %cot: index, %kstep: index, %pk: index) attributes {{passthrough = [\"noinline\"]}} {{\n{}  }}\n",
            self.symbol(),
            indent(&body, 4)
        )
    }

    /// The panel `%pwd` of `%cot` outputs × `%pk` inputs: at 16 lanes in
    /// pairs of outputs, each row two outputs' columns 8 by 8 side by side
    /// (see [`Micro::paired_panel`]), so that a pair's 16 weights are one
    /// load (`%cot` is even there: a multiple of [`NR_WIDE`]).
    fn panel_alloc(&self) -> String {
        if self.wide {
            "%c2_pa = arith.constant 2 : index\n%pwd_r = arith.divui %cot, %c2_pa : index\n%pwd_c = arith.muli %pk, %c2_pa : index\n\
             %pwd = memref.alloc(%pwd_r, %pwd_c) {alignment = 64 : i64} : memref<?x?xf32>\n"
                .to_string()
        } else {
            "%pwd = memref.alloc(%cot, %pk) {alignment = 64 : i64} : memref<?x?xf32>\n".to_string()
        }
    }

    /// Decodes outputs `%ot..%ot_end`, inputs `%kb0..%kb1` (one K block)
    /// of the weights into the panel `%pwd`, its column 0 at input `%kb0`
    /// (laid out as [`Tile::panel_alloc`] says).
    fn pack(&self) -> String {
        let wt = &self.types()[1];
        let pt = "memref<?x?xf32>";
        let place = if self.wide {
            "%pc1 = arith.subi %ki, %pc0 : index\n%pcd = arith.addi %pc1, %pc1 : index\n%prp = arith.remui %pr, %c2_pk : index\n\
             %prh = arith.muli %prp, %cl : index\n%pc = arith.addi %pcd, %prh : index\n%prr = arith.divui %pr, %c2_pk : index\n"
        } else {
            "%pc = arith.subi %ki, %pc0 : index\n%prr = arith.addi %pr, %c0 : index\n"
        };
        let per_vector = format!(
            "{}{place}vector.store %wp, %pwd[%prr, %pc] : {pt}, {V}\n",
            weight_vector(self.weight, ("%wd", wt), "%wp", ("%po", "%ki"), "%psv")
        );
        let mut consts = String::from("%cl = arith.constant 8 : index\n%c2_pk = arith.constant 2 : index\n");
        let inner = match self.weight {
            WeightType::Mxfp8 { block } => {
                consts.push_str(&format!(
                    "%cb = arith.constant {block} : index\n%pb0 = arith.divui %kb0, %cb : index\n%pb1 = arith.divui %kb1, %cb : index\n{E8M0_CONSTANTS}"
                ));
                consts.push_str(&fp8_consts(LANES));
                format!(
                    "scf.for %b = %pb0 to %pb1 step %c1 {{\n\
                     \x20 %sb = memref.load %s[%po, %b] : memref<?x?xi8>\n\
                     {dec}\
                     \x20 %psv = vector.broadcast %scale : f32 to {V}\n\
                     \x20 %base = arith.muli %b, %cb : index\n\
                     \x20 scf.for %j = %c0 to %cb step %cl {{\n\
                     \x20   %ki = arith.addi %base, %j : index\n\
                     {store}\
                     \x20 }}\n\
                     }}\n",
                    dec = indent(&e8m0_to_f32("%scale", "%sb"), 2),
                    store = indent(&per_vector, 4),
                )
            }
            _ => format!("scf.for %ki = %kb0 to %kb1 step %cl {{\n{}}}\n", indent(&per_vector, 2)),
        };
        format!("{consts}scf.for %po = %ot to %ot_end step %c1 {{\n\x20 %pr = arith.subi %po, %ot : index\n{}}}\n", indent(&inner, 2))
    }

    /// What a panel pass does at each K block before its micro-tiles: the
    /// panel's refill, then the row tile's activations copied or (unblocked
    /// f32) chosen in place.
    fn panel_fill(&self) -> String {
        // A panel holds the tile's outputs over `%pk` inputs: the whole
        // reduction (decoded K block by K block on the first row tile, read
        // by the later ones), or, where that is too large, one K block
        // (decoded again for each row tile, so it stays in L2).
        // The row tile's K block of activations is copied to `%xp` (f32,
        // rows `kstep` apart) beside the panel, so every output quad's pass
        // reads one contiguous block: bf16 activations are widened once,
        // not once per quad, and rows of 6144 inputs (24 KB apart, twelve
        // of 96 on the same L2 sets) no longer evict each other. The copy
        // reads the activations from L3 or DRAM, and the prefetcher starts
        // over at each row (its K block is 3 KB): a K-blocked copy
        // prefetches the row two ahead as it goes. 6144 × 6144 bf16 at 512
        // rows: 69.9 → 74.1 % of the FMA peak, mean of 6 paired rounds,
        // every round faster; the other real shapes +0.5 to +2 points.
        // Unblocked shapes (their activations stay in L2 across output
        // tiles) ran 15 points slower with it: 2048 × 1024 bf16.
        let copy = |prefetch: bool| {
            let (ahead, pf) = if prefetch {
                (
                    "%xpf0 = arith.addi %xr, %c2x : index\n%xpf = arith.minui %xpf0, %xlast : index\n".to_string(),
                    format!("memref.prefetch %xd[%xpf, %xk], read, locality<3>, data : {}\n", self.types()[0]),
                )
            } else {
                (String::new(), String::new())
            };
            format!(
                "scf.for %xr = %rt to %rt_end step %c1 {{\n\
                 \x20 %xri = arith.subi %xr, %rt : index\n\
                 {}\
                 \x20 scf.for %xk = %kb0 to %kb1 step %c8 {{\n\
                 {}\
                 {}\
                 \x20   %xkc = arith.subi %xk, %kb0 : index\n\
                 \x20   vector.store %xv, %xp[%xri, %xkc] : memref<?x?xf32>, {V}\n\
                 \x20 }}\n\
                 }}\n",
                indent(&ahead, 2),
                indent(&pf, 4),
                indent(&load_f32xn(LANES, "%xv", "%xd", &self.types()[0], "%xr", "%xk", self.act), 4),
            )
        };
        format!(
            "%first_rt = arith.cmpi eq, %rt, %c0 : index\n\
                 %pblocked = arith.cmpi ult, %pk, %cin : index\n\
                 %refill = arith.ori %first_rt, %pblocked : i1\n\
                 %pc0 = arith.select %pblocked, %kb0, %c0 : index\n\
                 scf.if %refill {{\n{}}}\n\
                 %klen = arith.subi %kb1, %kb0 : index\n\
                 %wcol = arith.subi %kb0, %pc0 : index\n\
                 %xlast = arith.subi %rows, %c1 : index\n\
                 %c2x = arith.constant 2 : index\n\
                 %kblocked = arith.cmpi ult, %kstep, %cin : index\n\
                 scf.if %kblocked {{\n{}}} else {{\n{}}}\n",
            indent(&self.pack(), 2),
            indent(&copy(true), 2),
            indent(&if self.in_place_unblocked() { String::new() } else { copy(false) }, 2),
        ) + &if self.in_place_unblocked() {
            format!(
                "%xsrc = arith.select %kblocked, %xp, %xd : {}\n\
                     %xrb = arith.select %kblocked, %c0, %rt : index\n\
                     %xk0 = arith.select %kblocked, %c0, %kb0 : index\n\
                     %xk1 = arith.select %kblocked, %klen, %kb1 : index\n\
                     %xwc = arith.select %kblocked, %wcol, %c0 : index\n",
                self.types()[0]
            )
        } else {
            String::new()
        }
    }

    /// Outputs `%zo..%zo + 8` of row `%zr` (lane sums at `%acs[%zri,
    /// %zoi..]`) reduced and stored: [`hsum`]'s sums, eight at a time.
    fn reduce8(&self) -> String {
        let yt = &self.types()[2];
        let mut s = String::new();
        let vs: [String; 8] = std::array::from_fn(|q| format!("%zv{q}"));
        for q in 0..8 {
            s.push_str(&format!(
                "%zq{q} = arith.constant {q} : index\n%zoi{q} = arith.addi %zoi, %zq{q} : index\n\
                 %zv{q} = vector.load %acs[%zri, %zoi{q}, %c0] : {ACC}, {V}\n"
            ));
        }
        s.push_str(&hsum8x8("%zs8", &vs));
        if self.out_act == Storage::F32 {
            s.push_str(&format!("vector.store %zs8, %y[%zr, %zo] : {yt}, {V}\n"));
        } else {
            for q in 0..8 {
                s.push_str(&format!("%zs{q} = vector.extract %zs8[{q}] : f32 from {V}\n%zo{q}y = arith.addi %zo, %zq{q} : index\n"));
                s.push_str(&store_f32(&format!("%zs{q}"), "%y", yt, "%zr", &format!("%zo{q}y"), self.out_act));
            }
        }
        s
    }

    /// The row tiles of output tile `%ot..%ot_end`, each: its lane sums
    /// zeroed, every K block (`%kstep` inputs; one block when weights are
    /// decoded in place) through the micro-tiles, then each output reduced
    /// and stored.
    fn tile_loops(&self, src: Source) -> String {
        let k_step = if self.row_groups(src) { "%kstep" } else { "%cin" };
        // Outputs `%o0 + q·%qs` advance together. From a panel, `%qs` is 1:
        // four neighbouring panel rows. Straight from the weights (decode),
        // the tile's full groups are cut in four strands, `%qs` = groups
        // apart, so each of the four weight streams runs through memory in
        // one long line that the hardware prefetcher follows (neighbouring
        // rows would make four streams of one row each, restarting every
        // row).
        let (o_end, o_step, qs, w) = match src {
            Source::Panel => ("%oq_end", "%cnr", "%c1", "%pwd"),
            Source::Direct => ("%oq_str", "%c1", "%nq0", "%wd"),
        };
        let fill = match src {
            Source::Panel => self.panel_fill(),
            Source::Direct => String::new(),
        };
        let fill = indent(&fill, 4);
        let micros = self.micros(src);
        // Rows `from..to` of the row tile (relative to `%rt`, and absolute
        // as `abs_from..abs_to`) in groups of `m`: the packed activations
        // `%xp` start at the tile's first row, the activations in place at 0.
        let call = |m: usize, n: usize, (from, to): (&str, &str), (abs_from, abs_to): (&str, &str)| -> String {
            let mc = micros.iter().find(|mc| mc.m == m && mc.n == n).expect("the micro-tile is listed");
            match src {
                // Unblocked f32 activations are read where they are: the
                // source, rows and columns chosen by `select` (two calls
                // under an `scf.if` would lower to one block taking the
                // memref as an argument, which LLVM's dialect refuses).
                Source::Panel if self.in_place_unblocked() => format!(
                    "%xa{m} = arith.addi {from}, %xrb : index\n%xb{m} = arith.addi {to}, %xrb : index\n{}",
                    mc.call("%xsrc", w, "%s", &format!("%xa{m}, %xb{m}, %aor, {from}, %aor, %qs, %xk0, %xk1, %xwc"))
                ),
                Source::Panel => mc.call("%xp", w, "%s", &format!("{from}, {to}, %aor, {from}, %aor, %qs, %c0, %klen, %wcol")),
                Source::Direct => mc.call("%xd", w, "%s", &format!("{abs_from}, {abs_to}, %o0, {from}, %aor, %qs, %kb0, %kb1, %c0")),
            }
        };
        let rows_of = |n: usize| {
            if self.row_groups(src) {
                call(self.mr(), n, ("%c0", "%nf"), ("%rt", "%rfull")) + &call(1, n, ("%nf", "%rn"), ("%rfull", "%rt_end"))
            } else {
                call(1, n, ("%c0", "%rn"), ("%rt", "%rt_end"))
            }
        };
        let red = hsum("%zs", "%zv") + &store_f32("%zs", "%y", &self.types()[2], "%zr", "%zo", self.out_act);
        let red8 = self.reduce8();
        format!(
            "%cnr = arith.constant {nr} : index\n\
             %on = arith.subi %ot_end, %ot : index\n\
             %nq0 = arith.divui %on, %cnr : index\n\
             %nq = arith.muli %nq0, %cnr : index\n\
             %oq_end = arith.addi %ot, %nq : index\n\
             %oq_str = arith.addi %ot, %nq0 : index\n\
             %qs = arith.addi {qs}, %c0 : index\n\
             scf.for %rt = %c0 to %rows step %crt {{\n\
             \x20 %rt_end0 = arith.addi %rt, %crt : index\n\
             \x20 %rt_end = arith.minui %rt_end0, %rows : index\n\
             \x20 %rn = arith.subi %rt_end, %rt : index\n\
             \x20 %nf0 = arith.divui %rn, %cmr : index\n\
             \x20 %nf = arith.muli %nf0, %cmr : index\n\
             \x20 %rfull = arith.addi %rt, %nf : index\n\
             \x20 scf.for %zr = %c0 to %rn step %c1 {{\n\
             \x20   scf.for %zo = %c0 to %on step %c1 {{\n\
             \x20     vector.store %vz, %acs[%zr, %zo, %c0] : {ACC}, {V}\n\
             \x20   }}\n\
             \x20 }}\n\
             \x20 scf.for %kb0 = %c0 to %cin step {k_step} {{\n\
             \x20   %kb1a = arith.addi %kb0, {k_step} : index\n\
             \x20   %kb1 = arith.minui %kb1a, %cin : index\n\
             {fill}\
             \x20   scf.for %o0 = %ot to {o_end} step {o_step} {{\n\
             \x20     %aor = arith.subi %o0, %ot : index\n\
             {quads}\
             \x20   }}\n\
             \x20   // The outputs past the last full group of four, if any.\n\
             \x20   scf.for %o0 = %oq_end to %ot_end step %c1 {{\n\
             \x20     %aor = arith.subi %o0, %ot : index\n\
             {singles}\
             \x20   }}\n\
             \x20 }}\n\
             \x20 %zon8 = arith.divui %on, %c8 : index\n\
             \x20 %zo8n = arith.muli %zon8, %c8 : index\n\
             \x20 %zo8 = arith.addi %ot, %zo8n : index\n\
             \x20 scf.for %zr = %rt to %rt_end step %c1 {{\n\
             \x20   %zri = arith.subi %zr, %rt : index\n\
             \x20   scf.for %zo = %ot to %zo8 step %c8 {{\n\
             \x20     %zoi = arith.subi %zo, %ot : index\n\
             {red8}\
             \x20   }}\n\
             \x20   scf.for %zo = %zo8 to %ot_end step %c1 {{\n\
             \x20     %zoi = arith.subi %zo, %ot : index\n\
             \x20     %zv = vector.load %acs[%zri, %zoi, %c0] : {ACC}, {V}\n\
             {red}\
             \x20   }}\n\
             \x20 }}\n\
             }}\n",
            quads = indent(&rows_of(self.nr(src)), 6),
            nr = self.nr(src),
            singles = indent(&rows_of(1), 6),
            red = indent(&red, 6),
            red8 = indent(&red8, 6),
        )
    }
}

/// The functions the linear calls, as (name, text) globals: its output-tile
/// function and the micro-tiles that calls.
pub fn globals(inp: usize, weight: WeightType, act: Storage, out_act: Storage, width: HostWidth) -> Vec<(String, String)> {
    let t = Tile::new(weight, act, out_act, width);
    let mut g = vec![(t.symbol(), t.text())];
    if tiles_of(inp, 1, t.mr_nr()).outs_balanced {
        g.push(("omp_get_max_threads".into(), "  func.func private @omp_get_max_threads() -> i32\n".into()));
    }
    g.extend(t.sources().into_iter().flat_map(|src| t.micros(src)).map(|m| (m.symbol(), m.text())));
    g
}

/// The body of the linear `y[S, out] = x[S, inp] · W[out, inp]ᵀ`: its
/// output tiles, in parallel, each through the shared tile function.
pub fn body(inp: usize, out: usize, weight: WeightType, act: Storage, out_act: Storage, width: HostWidth) -> String {
    debug_assert!(vectorizes(inp, weight) && LANES == 8);
    let t = Tile::new(weight, act, out_act, width);
    let tiles = tiles_of(inp, out, t.mr_nr());
    let [xt, wt, yt] = t.types();
    let x = act.rows_ty(inp);
    let mut casts = format!(
        "%xd = memref.cast %x : {x} to {xt}\n\
         %wd = memref.cast %w : memref<{out}x{inp}x{e}> to {wt}\n\
         %yd = memref.cast %y : memref<?x{out}x{ye}> to {yt}\n",
        e = weight.mlir_elem(),
        ye = out_act.mlir_elem()
    );
    if let WeightType::Mxfp8 { block } = weight {
        casts.push_str(&format!("%sd = memref.cast %s : memref<{out}x{}xi8> to memref<?x?xi8>\n", inp / block));
    }
    let kstep = k_block(inp);
    let tile =
        format!("%ot_end0 = arith.addi %ot, %cot : index\n%ot_end = arith.minui %ot_end0, %cout : index\n{}", t.call("%ckstep", "%cpk"));
    format!(
        "{BASICS}{consts}\
         %rows = memref.dim %x, %c0 : {x}\n\
         %packs = arith.cmpi uge, %rows, %cpack_min : index\n\
         {balance}\
         %cot = arith.select %packs, %cot_p, %cot_d : index\n\
         {casts}\
         %work0 = arith.constant {macs} : index\n\
         %work = arith.muli %rows, %work0 : index\n\
         {tiles}\
         return\n",
        consts = index_consts(&[
            ("cout", out),
            ("cin", inp),
            ("crt", tiles.rows),
            ("cot_d", tiles.outs_direct),
            ("ckstep", kstep),
            ("cpk", panel_inputs(inp, tiles)),
            ("cpack_min", PACK_MIN_ROWS),
        ]),
        macs = inp * out,
        balance = balanced_outs(out, tiles, t.mr_nr().1),
        tiles = parallel_or_serial("%work", &["%ot"], &["%c0"], &["%cout"], &["%cot"], &tile),
    )
}

/// `%cot_p`: the outputs of a panel tile. A K-blocked shape reads its
/// activations once per output tile (from L3 or DRAM: 12 MB at 512 rows of
/// 6144 inputs), so its tiles are as wide as [`KC_OUTS`] allows, in a count
/// that is a multiple of the thread count: 35 tiles of 176 on 2 threads
/// left one core a tile alone, and the 16 tiles of 80 that a 1280-output
/// shape got for a 16-core machine read the activations twice as often as
/// 2 cores need. Measured at 512 rows (`m3c bench-kernels`, 4 paired
/// rounds, Zen 4): 6144 × 6144 MXFP8 from 62 to 72 % of the FMA peak,
/// 1280 × 5120 bf16 from 64 to 77 %, the expert's 6144 × 1536 from 69–71
/// to 79–80 %. The width never changes a result (see the module doc).
/// Other shapes keep their compile-time width.
fn balanced_outs(out: usize, tiles: Tiles, nr: usize) -> String {
    if !tiles.outs_balanced {
        return index_consts(&[("cot_p", tiles.outs_packed)]);
    }
    // tiles = ⌈⌈out / KC_OUTS⌉ / threads⌉ · threads; width = ⌈out / tiles⌉
    // up to a multiple of `nr`.
    format!(
        "%nth_i = func.call @omp_get_max_threads() : () -> i32\n\
         %nth0 = arith.index_cast %nth_i : i32 to index\n\
         %nth = arith.maxui %nth0, %c1 : index\n\
         %bal_min = arith.constant {min} : index\n\
         %bal_nr = arith.constant {nr} : index\n\
         %nt_a = arith.addi %bal_min, %nth : index\n\
         %nt_b = arith.subi %nt_a, %c1 : index\n\
         %nt_c = arith.divui %nt_b, %nth : index\n\
         %nt = arith.muli %nt_c, %nth : index\n\
         %bo_a = arith.addi %cout, %nt : index\n\
         %bo_b = arith.subi %bo_a, %c1 : index\n\
         %bo_c = arith.divui %bo_b, %nt : index\n\
         %bo_d = arith.addi %bo_c, %bal_nr : index\n\
         %bo_e = arith.subi %bo_d, %c1 : index\n\
         %bo_f = arith.divui %bo_e, %bal_nr : index\n\
         %cot_p = arith.muli %bo_f, %bal_nr : index\n",
        min = out.div_ceil(KC_OUTS),
    )
}
