//! Dense host attention with head widths that are a multiple of 8, over
//! blocks of query rows: each key batch's rows of K, and each key block's
//! rows of V, are loaded into L1 once and used by every row of the block.
//!
//! Row by row, a head's keys (2,304 × 80 f32 on an image: 740 KB) stream
//! from L3 once per query row, which left the arithmetic waiting on memory
//! (under 10 GFLOP/s on a 2,304-patch image). A row's own operations are
//! those of the eight-key path in `scores.rs` in the same
//! order: the block only decides which rows advance together, so a row's
//! bits do not depend on the rows beside it.

use super::key_row;
use super::scores::{batch_keys, dots8, exp8, key_rows, transposed_tree};
use crate::emit::{f32_lit, hsum, load_f32xn, parallel_or_serial, store_f32};
use crate::host::{index_consts, BASICS};
use crate::{indent, Storage};

const V: &str = "vector<8xf32>";
/// Query rows per block: K and V tiles are reused this many times from L1.
const ROWS: usize = 8;
/// Keys per P·V block: V tiles of 64 × head width f32 (20 KB at width 80).
const KEYS: usize = 64;

/// The position of block row `%ii` (`%r0i`) and how many keys it sees (`%nk`).
const ROW: &str = "%r0i = arith.addi %r0, %ii : index\n\
                   %p64 = memref.load %pos[%r0i] : memref<?xi64>\n\
                   %p = arith.index_cast %p64 : i64 to index\n\
                   %nk = arith.addi %p, %c1 : index\n";
/// The block's scores: `[rows of the block, keys rounded up to 8]`.
const SCT: &str = "memref<?x?xf32>";

/// The memref types, and where each row's f32 sums accumulate: in `o`'s
/// own row for f32 outputs, in the block's `%oacc` for bf16 ones (rounded
/// once at the end).
struct Layout {
    qt: String,
    kt: String,
    acct: String,
    acc: &'static str,
    acc_row: &'static str,
    acc_ty: String,
}

impl Layout {
    fn of(k: &super::Attention) -> Layout {
        let super::Attention { heads, kv_heads, head_dim: d, act, cache, .. } = *k;
        let qt = act.rows_ty(heads * d);
        let kt = cache.rows_ty(kv_heads * d);
        let acct = format!("memref<?x{d}xf32>");
        let ((acc, acc_row), acc_ty) = match act {
            Storage::F32 => (("%o", "%r0i"), qt.clone()),
            Storage::Bf16 | Storage::Fp8 => (("%oacc", "%ii"), acct.clone()),
        };
        Layout { qt, kt, acct, acc, acc_row, acc_ty }
    }
}

/// The kernel body. `q`, `o`: `[S, heads·d]` stored as `act`; `k`, `v`:
/// `[T, kv_heads·d]` stored as `cache`; row `r` sees keys `0..=pos[r]`.
pub(super) fn host(k: &super::Attention) -> String {
    let super::Attention { heads, kv_heads, head_dim: d, scale, paged, .. } = *k;
    debug_assert!(d.is_multiple_of(8));
    let l = Layout::of(k);
    let ck: String = (0..8).map(|j| format!("%ck{j} = arith.constant {j} : index\n")).collect();
    let idx0 = index_consts(&[
        ("cg", heads / kv_heads),
        ("ckv", kv_heads),
        ("cd", d),
        ("c2", 2),
        ("c7", 7),
        ("c8", 8),
        ("cR", ROWS),
        ("cRm1", ROWS - 1),
        ("cKB", KEYS),
    ]);
    format!(
        "{BASICS}\
         {idx0}\
         {ck}\
         %scale = arith.constant {scale} : f32\n\
         %ninf = arith.constant 0xFF800000 : f32\n\
         %ninf8 = vector.broadcast %ninf : f32 to {V}\n\
         %z8 = arith.constant dense<0.0> : {V}\n\
         %scale8 = vector.broadcast %scale : f32 to {V}\n\
         {pconst}\
         {rows}\
         %rowsr = arith.addi %rows, %cRm1 : index\n\
         %nblk = arith.divui %rowsr, %cR : index\n\
         {iters}\
         return\n",
        scale = f32_lit(scale),
        pconst = super::page_const(paged),
        rows = super::rows_and_work(&l.qt, heads * d * 2),
        // KV group first: a thread's run of iterations then goes through
        // one group's keys and values at a time, which stay in cache from
        // block to block (all groups' K and V of a 32k context are the
        // L3 of this machine; cycling through them went to memory).
        iters = parallel_or_serial("%work", &["%g", "%bi"], &["%c0", "%c0"], &["%ckv", "%nblk"], &["%c1", "%c1"], &block(k, &l)),
    )
}

/// One block of rows × one KV group. Blocks go in zig-zag order (0, B-1,
/// 1, B-2, ...), as rows do in the row-by-row kernel.
fn block(k: &super::Attention, l: &Layout) -> String {
    let (acc_alloc, acc_free) = match k.act {
        Storage::F32 => (String::new(), String::new()),
        Storage::Bf16 | Storage::Fp8 => {
            (format!("%oacc = memref.alloc(%nr) : {}\n", l.acct), format!("memref.dealloc %oacc : {}\n", l.acct))
        }
    };
    format!(
        "%bi2 = arith.divui %bi, %c2 : index\n\
         %bpar = arith.remui %bi, %c2 : index\n\
         %bodd = arith.cmpi ne, %bpar, %c0 : index\n\
         %blast = arith.subi %nblk, %c1 : index\n\
         %brev = arith.subi %blast, %bi2 : index\n\
         %blk = arith.select %bodd, %brev, %bi2 : index\n\
         %r0 = arith.muli %blk, %cR : index\n\
         %r1a = arith.addi %r0, %cR : index\n\
         %r1 = arith.minui %r1a, %rows : index\n\
         %nr = arith.subi %r1, %r0 : index\n\
         %nkmax = scf.for %ii = %c0 to %nr step %c1 iter_args(%m = %c0) -> (index) {{\n\
         {row}\
         \x20 %m2 = arith.maxui %m, %nk : index\n\
         \x20 scf.yield %m2 : index\n\
         }}\n\
         %nkm7 = arith.addi %nkmax, %c7 : index\n\
         %nkmb = arith.divui %nkm7, %c8 : index\n\
         %nk8max = arith.muli %nkmb, %c8 : index\n\
         %sc = memref.alloc(%nr, %nk8max) : {SCT}\n\
         %inv = memref.alloc(%nr) : memref<?xf32>\n\
         {acc_alloc}\
         %kb = arith.muli %g, %cd : index\n\
         scf.for %hh = %c0 to %cg step %c1 {{\n\
         \x20 %gi = arith.muli %g, %cg : index\n\
         \x20 %hi = arith.addi %gi, %hh : index\n\
         \x20 %qb = arith.muli %hi, %cd : index\n\
         {phase1}\
         {phase2}\
         {phase3}\
         {out}\
         }}\n\
         memref.dealloc %sc : {SCT}\n\
         memref.dealloc %inv : memref<?xf32>\n\
         {acc_free}",
        row = indent(ROW, 2),
        phase1 = indent(&scores_phase(k, l), 2),
        phase2 = indent(&weights_phase(k, l), 2),
        phase3 = indent(&values_phase(k, l), 2),
        out = indent(&bf16_out(k, l), 2),
    )
}

/// Phase 1: scores. Per key batch, per row of the block that sees it.
fn scores_phase(k: &super::Attention, l: &Layout) -> String {
    let mut score = batch_keys(k.paged);
    score.push_str(&dots8("%qk", ("%q", &l.qt, k.act, "%r0i", "%qb"), ("%k", &l.kt, k.cache, "%kb"), key_rows(k.paged), "%cd"));
    score.push_str(&transposed_tree("%dv", &(0..8).map(|j| format!("%qk#{j}")).collect::<Vec<_>>()));
    let vals = (0..8).map(|j| format!("%in{j}")).collect::<Vec<_>>().join(", ");
    score.push_str(&format!(
        "%sv0 = arith.mulf %dv, %scale8 : {V}\n\
         %mask = vector.from_elements {vals} : vector<8xi1>\n\
         %sv = arith.select %mask, %sv0, %ninf8 : vector<8xi1>, {V}\n\
         vector.store %sv, %sc[%ii, %t0] : {SCT}, {V}\n"
    ));
    each_live_row(
        "scf.for %t0 = %c0 to %nk8max step %c8",
        "%live = arith.cmpi ult, %t0, %nk : index\n",
        &format!("%nkm1 = arith.subi %nk, %c1 : index\n{score}"),
    )
}

/// `outer { for each row of the block { its row; live; if %live { body } } }`:
/// the loop nest of phases 1 and 3, whose `live` statements decide whether
/// the row sees any key of the outer loop's batch.
fn each_live_row(outer: &str, live: &str, body: &str) -> String {
    format!(
        "{outer} {{\n\
         \x20 scf.for %ii = %c0 to %nr step %c1 {{\n\
         {row}\
         {live}\
         \x20   scf.if %live {{\n\
         {body}\
         \x20   }}\n\
         \x20 }}\n\
         }}\n",
        row = indent(ROW, 4),
        live = indent(live, 4),
        body = indent(body, 6),
    )
}

/// Phase 2: per row, the max, the weights and 1 / their sum; the row's
/// accumulator zeroed.
fn weights_phase(k: &super::Attention, l: &Layout) -> String {
    let Layout { acc, acc_row, acc_ty, .. } = l;
    let mut zero = String::new();
    for c in (0..k.head_dim).step_by(8) {
        zero.push_str(&format!(
            "%zc{c} = arith.constant {c} : index\n\
             %zq{c} = arith.addi %qb, %zc{c} : index\n\
             vector.store %z8, {acc}[{acc_row}, {}] : {acc_ty}, {V}\n",
            if k.act == Storage::F32 { format!("%zq{c}") } else { format!("%zc{c}") }
        ));
    }
    format!(
        "scf.for %ii = %c0 to %nr step %c1 {{\n\
         {row}\
         \x20 %nk7 = arith.addi %nk, %c7 : index\n\
         \x20 %nkb = arith.divui %nk7, %c8 : index\n\
         \x20 %nk8 = arith.muli %nkb, %c8 : index\n\
         \x20 %mxv = scf.for %t0 = %c0 to %nk8 step %c8 iter_args(%mv = %ninf8) -> ({V}) {{\n\
         \x20   %sl = vector.load %sc[%ii, %t0] : {SCT}, {V}\n\
         \x20   %mv2 = arith.maximumf %mv, %sl : {V}\n\
         \x20   scf.yield %mv2 : {V}\n\
         \x20 }}\n\
         \x20 %mx = vector.reduction <maximumf>, %mxv : {V} into f32\n\
         \x20 %mx8 = vector.broadcast %mx : f32 to {V}\n\
         \x20 %sumv = scf.for %t0 = %c0 to %nk8 step %c8 iter_args(%sa = %z8) -> ({V}) {{\n\
         \x20   %sl = vector.load %sc[%ii, %t0] : {SCT}, {V}\n\
         \x20   %sh = arith.subf %sl, %mx8 : {V}\n\
         {exp}\
         \x20   vector.store %e, %sc[%ii, %t0] : {SCT}, {V}\n\
         \x20   %sa2 = arith.addf %sa, %e : {V}\n\
         \x20   scf.yield %sa2 : {V}\n\
         \x20 }}\n\
         {sum}\
         \x20 %invr = arith.divf %one, %sum : f32\n\
         \x20 memref.store %invr, %inv[%ii] : memref<?xf32>\n\
         {zero}\
         }}\n",
        row = indent(ROW, 2),
        exp = indent(&exp8("%e", "%sh"), 4),
        sum = indent(&hsum("%sum", "%sumv"), 2),
        zero = indent(&zero, 2),
    )
}

/// Phase 3: P·V per key block, per chunk of up to 80 columns
/// ([`super::pv_chunks`]), the chunk's sums in registers across the block's
/// keys. Narrow heads' rows go in pairs: each key's V vectors load once for
/// both rows, and the two rows' sums are independent chains, so a head of
/// up to 32 columns (whose few chains alone wait on the FMA latency) keeps
/// twice as many FMAs in flight. Each row's sums are its own, in key order, as alone: over the
/// keys both rows see, then over the rest of the longer row's.
fn values_phase(k: &super::Attention, l: &Layout) -> String {
    let single = values_row(k, l);
    // Wider heads (the vision tower's 80 columns) have chains enough alone,
    // and two rows' sums would not fit the registers.
    if super::pv_chunks(k.head_dim).iter().any(|&(_, nv)| nv > PAIR_MAX_VECTORS) {
        return format!(
            "scf.for %tb = %c0 to %nkmax step %cKB {{\n\
             \x20 %tbe = arith.addi %tb, %cKB : index\n\
             \x20 scf.for %iia = %c0 to %nr step %c1 {{\n\
             {}\
             \x20 }}\n\
             }}\n",
            indent(&single, 4)
        );
    }
    let pair = values_pair(k, l);
    format!(
        "%npairs0 = arith.addi %nr, %c1 : index\n\
         %npairs = arith.divui %npairs0, %c2 : index\n\
         scf.for %tb = %c0 to %nkmax step %cKB {{\n\
         \x20 %tbe = arith.addi %tb, %cKB : index\n\
         \x20 scf.for %pi = %c0 to %npairs step %c1 {{\n\
         \x20   %iia = arith.muli %pi, %c2 : index\n\
         \x20   %iib = arith.addi %iia, %c1 : index\n\
         \x20   %hasb = arith.cmpi ult, %iib, %nr : index\n\
         \x20   scf.if %hasb {{\n\
         {pair}\
         \x20   }} else {{\n\
         {single}\
         \x20   }}\n\
         \x20 }}\n\
         }}\n",
        pair = indent(&pair, 6),
        single = indent(&single, 6),
    )
}

/// The widest chunk of P·V columns (in vectors of 8) that rows take in
/// pairs: two rows' sums, the V vectors and the weights then fit AVX2's 16
/// registers.
const PAIR_MAX_VECTORS: usize = 4;

/// A chunk of P·V columns: its first column and its vectors of 8.
struct PvChunk {
    c0: usize,
    nv: usize,
}

/// One row's P·V over keys `%tb..%te` of the tile (the pair's odd row
/// out, or the tail of the longer row of a pair): row `%ii`.
fn values_row(k: &super::Attention, l: &Layout) -> String {
    let Layout { acc, acc_row, acc_ty, .. } = l;
    let mut out = String::from("%ii = arith.addi %iia, %c0 : index\n");
    out.push_str(ROW);
    out.push_str(
        "%te = arith.minui %tbe, %nk : index\n\
         %invr = memref.load %inv[%ii] : memref<?xf32>\n",
    );
    for (ch, (c0, nv)) in super::pv_chunks(k.head_dim).into_iter().enumerate() {
        let pc = PvChunk { c0, nv };
        let (load, store) = acc_io(k, &pc, acc, acc_row, acc_ty, &format!("{ch}"), "%qb");
        let inits = (0..nv).map(|i| format!("%a{i} = %o{ch}_{i}")).collect::<Vec<_>>().join(", ");
        out.push_str(&load);
        out.push_str(&format!("%pacc{ch}:{nv} = {}", keys_loop(k, l, &pc, "%tb", "%te", &inits, &[("%ii", "%invr", "a")])));
        out.push_str(&store.replace("%RES", &format!("%pacc{ch}")));
    }
    out
}

/// Rows `%iia` and `%iib` of the block: their P·V over the keys of the
/// tile both see, V loaded once for both, then each one's own rest.
fn values_pair(k: &super::Attention, l: &Layout) -> String {
    let Layout { acc, acc_ty, .. } = l;
    let f32_out = k.act == Storage::F32;
    let mut out = String::new();
    for (x, ii) in [("a", "%iia"), ("b", "%iib")] {
        out.push_str(&format!(
            "%r0{x} = arith.addi %r0, {ii} : index\n\
             %p64{x} = memref.load %pos[%r0{x}] : memref<?xi64>\n\
             %p{x} = arith.index_cast %p64{x} : i64 to index\n\
             %nk{x} = arith.addi %p{x}, %c1 : index\n\
             %te{x} = arith.minui %tbe, %nk{x} : index\n\
             %invr{x} = memref.load %inv[{ii}] : memref<?xf32>\n"
        ));
    }
    out.push_str(
        "%tec = arith.minui %tea, %teb : index\n\
         %tsc = arith.maxui %tb, %tec : index\n",
    );
    for (ch, (c0, nv)) in super::pv_chunks(k.head_dim).into_iter().enumerate() {
        let pc = PvChunk { c0, nv };
        let row = |x: &str, ii: &str| if f32_out { format!("%r0{x}") } else { ii.to_string() };
        let (load_a, store_a) = acc_io(k, &pc, acc, &row("a", "%iia"), acc_ty, &format!("{ch}a"), "%qb");
        let (load_b, store_b) = acc_io(k, &pc, acc, &row("b", "%iib"), acc_ty, &format!("{ch}b"), "%qb");
        out.push_str(&load_a);
        out.push_str(&load_b);
        let both = (0..nv)
            .map(|i| format!("%a{i} = %o{ch}a_{i}"))
            .chain((0..nv).map(|i| format!("%b{i} = %o{ch}b_{i}")))
            .collect::<Vec<_>>()
            .join(", ");
        out.push_str(&format!(
            "%pj{ch}:{} = {}",
            2 * nv,
            keys_loop(k, l, &pc, "%tb", "%tec", &both, &[("%iia", "%invra", "a"), ("%iib", "%invrb", "b")])
        ));
        let from = |first: usize| (0..nv).map(|i| format!("%a{i} = %pj{ch}#{}", first + i)).collect::<Vec<_>>().join(", ");
        out.push_str(&format!("%pta{ch}:{nv} = {}", keys_loop(k, l, &pc, "%tsc", "%tea", &from(0), &[("%iia", "%invra", "a")])));
        out.push_str(&format!("%ptb{ch}:{nv} = {}", keys_loop(k, l, &pc, "%tsc", "%teb", &from(nv), &[("%iib", "%invrb", "a")])));
        out.push_str(&store_a.replace("%RES", &format!("%pta{ch}")));
        out.push_str(&store_b.replace("%RES", &format!("%ptb{ch}")));
    }
    out
}

/// A chunk's sums of one row at `acc[row, ...]`: their loads as
/// `%o{tag}_{i}`, and their stores from `%RES#i` (the caller names the
/// results).
fn acc_io(k: &super::Attention, pc: &PvChunk, acc: &str, row: &str, acc_ty: &str, tag: &str, qb: &str) -> (String, String) {
    let (mut load, mut store) = (String::new(), String::new());
    for i in 0..pc.nv {
        let col = pc.c0 + 8 * i;
        // The accumulator's column: in `o`'s row, past the head's start.
        let c = if k.act == Storage::F32 { format!("%aq{tag}_{i}") } else { format!("%ac{tag}_{i}") };
        load.push_str(&format!(
            "%ac{tag}_{i} = arith.constant {col} : index\n\
             %aq{tag}_{i} = arith.addi {qb}, %ac{tag}_{i} : index\n\
             %o{tag}_{i} = vector.load {acc}[{row}, {c}] : {acc_ty}, {V}\n"
        ));
        store.push_str(&format!("vector.store %RES#{i}, {acc}[{row}, {c}] : {acc_ty}, {V}\n"));
    }
    (load, store)
}

/// `scf.for %t = from to to` over a chunk's columns for the given rows
/// (each: its row in `%sc`, its `1 / sum`, and the prefix of its sums'
/// names), each key's V vectors loaded once, each row's sums a multiply
/// then an add (fused where the CPU has FMA), in key order.
fn keys_loop(k: &super::Attention, l: &Layout, pc: &PvChunk, from: &str, to: &str, inits: &str, rows: &[(&str, &str, &str)]) -> String {
    let (vrow, vt) = key_row(k.paged, "%t", "%tp");
    let tys = vec![V; pc.nv * rows.len()].join(", ");
    let mut body = vrow;
    for i in 0..pc.nv {
        let col = pc.c0 + 8 * i;
        body.push_str(&format!("%vk{i} = arith.constant {col} : index\n%vc{i} = arith.addi %kb, %vk{i} : index\n"));
        body.push_str(&load_f32xn(8, &format!("%vv{i}"), "%v", &l.kt, &vt, &format!("%vc{i}"), k.cache));
    }
    let mut next = Vec::new();
    for (ii, invr, x) in rows {
        body.push_str(&format!(
            "%e{x} = memref.load %sc[{ii}, %t] : {SCT}\n\
             %pw{x} = arith.mulf %e{x}, {invr} : f32\n\
             %pwv{x} = vector.broadcast %pw{x} : f32 to {V}\n"
        ));
        for i in 0..pc.nv {
            body.push_str(&format!(
                "%pv{x}{i} = arith.mulf %pwv{x}, %vv{i} fastmath<contract> : {V}\n\
                 %{x}{i}n = arith.addf %{x}{i}, %pv{x}{i} fastmath<contract> : {V}\n"
            ));
            next.push(format!("%{x}{i}n"));
        }
    }
    format!(
        "scf.for %t = {from} to {to} step %c1 iter_args({inits}) -> ({tys}) {{\n\
         {}\
         \x20 scf.yield {} : {tys}\n\
         }}\n",
        indent(&body, 2),
        next.join(", ")
    )
}

/// bf16 outputs: each row's f32 sums rounded once into `o`.
fn bf16_out(k: &super::Attention, l: &Layout) -> String {
    match k.act {
        Storage::F32 => String::new(),
        Storage::Bf16 | Storage::Fp8 => format!(
            "scf.for %ii = %c0 to %nr step %c1 {{\n\
             \x20 %r0i = arith.addi %r0, %ii : index\n\
             \x20 scf.for %c = %c0 to %cd step %c1 {{\n\
             \x20   %oc = arith.addi %qb, %c : index\n\
             \x20   %ov = memref.load %oacc[%ii, %c] : {}\n\
             {}\
             \x20 }}\n\
             }}\n",
            l.acct,
            indent(&store_f32("%ov", "%o", &l.qt, "%r0i", "%oc", k.act), 4)
        ),
    }
}
