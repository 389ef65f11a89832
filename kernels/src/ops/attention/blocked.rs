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
use super::scores::{batch_rows, dots8, exp8, key_rows, transposed_tree};
use crate::emit::{f32_lit, hsum, load_f32xn, parallel_or_serial, store_f32};
use crate::host::{index_consts, BASICS};
use crate::{indent, Storage};

const V: &str = "vector<8xf32>";
/// Query rows per block: K and V tiles are reused this many times from L1.
pub(super) const ROWS: usize = 8;
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
    /// Each P·V tile's keys sit in one block of the paged cache
    /// ([`tile_page`]).
    one_page: bool,
}

impl Layout {
    fn of(k: &super::Attention, keys: Keys) -> Layout {
        let super::Attention { heads, kv_heads, head_dim: d, act, cache, .. } = *k;
        let qt = act.rows_ty(heads * d);
        let kt = cache.rows_ty(kv_heads * d);
        let acct = format!("memref<?x{d}xf32>");
        let ((acc, acc_row), acc_ty) = match act {
            Storage::F32 => (("%o", "%r0i"), qt.clone()),
            Storage::Bf16 | Storage::Fp8 => (("%oacc", "%ii"), acct.clone()),
        };
        Layout { qt, kt, acct, acc, acc_row, acc_ty, one_page: tile_in_one_page(k, keys) }
    }
}

/// The kernel body. `q`, `o`: `[S, heads·d]` stored as `act`; `k`, `v`:
/// `[T, kv_heads·d]` stored as `cache`; row `r` sees keys `0..=pos[r]`.
pub(super) fn host(k: &super::Attention) -> String {
    let super::Attention { heads, kv_heads, head_dim: d, scale, paged, .. } = *k;
    debug_assert!(d.is_multiple_of(8));
    let l = Layout::of(k, Keys::Dense);
    let idx0 = index_consts(&[("cg", heads / kv_heads), ("ckv", kv_heads), ("cd", d), ("c2", 2)]);
    format!(
        "{BASICS}\
         {idx0}\
         {consts}\
         %scale = arith.constant {scale} : f32\n\
         %ninf = arith.constant 0xFF800000 : f32\n\
         {vconsts}\
         {pconst}\
         {rows}\
         %rowsr = arith.addi %rows, %cRm1 : index\n\
         %nblk = arith.divui %rowsr, %cR : index\n\
         {iters}\
         return\n",
        consts = block_consts(KEYS),
        vconsts = VECTOR_CONSTS,
        scale = f32_lit(scale),
        pconst = super::page_const(paged),
        rows = super::rows_and_work(&l.qt, heads * d * 2),
        // KV group first: a thread's run of iterations then goes through
        // one group's keys and values at a time, which stay in cache from
        // block to block (all groups' K and V of a 32k context are the
        // L3 of this machine; cycling through them went to memory).
        iters =
            parallel_or_serial("%work", &["%g", "%bi"], &["%c0", "%c0"], &["%ckv", "%nblk"], &["%c1", "%c1"], &block(k, &l, Keys::Dense)),
    )
}

/// MSA's sparse phase over blocks of query rows: the body of one (KV
/// group `%g`, block `%bki` of a pass's `%nblk`) iteration of
/// `super::msa_phases`, for blocks of keys that hold whole batches of
/// eight. Each row selects its blocks as the row-by-row kernel does
/// (`select`: `super::msa_host`'s, from the pass's `%bsall`; `teardown`
/// frees its scratch), then the block's rows attend as dense ones do but
/// only over their own selected blocks: each key batch and V tile loads
/// once for every row of the block that selected it, not once per row.
///
/// A row's scores, weights and sums are those of the row-by-row kernel:
/// its batches in key order, the same operations per batch. The
/// row-by-row P·V passed over keys whose weight is exactly 0; here they
/// add 0·v, which leaves a sum as it was for any finite v.
pub(super) fn msa_block(k: &super::Attention, msa_block: usize, select: &str, teardown: &str) -> String {
    debug_assert!(k.head_dim.is_multiple_of(8) && msa_block.is_multiple_of(8));
    let l = Layout::of(k, Keys::Msa { select, teardown });
    format!(
        "{consts}\
         {VECTOR_CONSTS}\
         {body}",
        consts = block_consts(msa_tile(msa_block)),
        body = block(k, &l, Keys::Msa { select, teardown }),
    )
}

/// The P·V tile of MSA blocks of `block` keys: one that never straddles
/// two blocks, so a tile is selected or not as a whole.
fn msa_tile(block: usize) -> usize {
    let (mut a, mut b) = (block, KEYS);
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// The index constants of a block's loops; `keys`: the P·V tile.
fn block_consts(keys: usize) -> String {
    let ck: String = (0..8).map(|j| format!("%ck{j} = arith.constant {j} : index\n")).collect();
    format!("{}{ck}", index_consts(&[("c7", 7), ("c8", 8), ("cR", ROWS), ("cRm1", ROWS - 1), ("cKB", keys)]))
}

/// Eight-lane -inf, zeros and `%scale` (needs `%ninf` and `%scale`).
const VECTOR_CONSTS: &str = "%ninf8 = vector.broadcast %ninf : f32 to vector<8xf32>\n\
                             %z8 = arith.constant dense<0.0> : vector<8xf32>\n\
                             %scale8 = vector.broadcast %scale : f32 to vector<8xf32>\n";

/// Which keys a block's rows attend.
#[derive(Clone, Copy)]
enum Keys<'a> {
    /// Every key a row sees.
    Dense,
    /// MSA's selected blocks: each row's choice, made by `select` (which
    /// defines `%sel[0..%nb]` from the row's `%p`), is kept in
    /// `%selb[row of the block, block]`, and `%uni[block]` says whether
    /// any row of the block chose it.
    Msa { select: &'a str, teardown: &'a str },
}

impl Keys<'_> {
    fn msa(self) -> bool {
        matches!(self, Keys::Msa { .. })
    }
}

/// One block of rows × one KV group. Blocks go in zig-zag order (0, B-1,
/// 1, B-2, ...), as rows do in the row-by-row kernel. Dense: blocks of the
/// call's rows; MSA: of the pass's (`%rc0..%rc1`, see `super::msa_phases`).
fn block(k: &super::Attention, l: &Layout, keys: Keys) -> String {
    let (acc_alloc, acc_free) = match k.act {
        Storage::F32 => (String::new(), String::new()),
        Storage::Bf16 | Storage::Fp8 => {
            (format!("%oacc = memref.alloc(%nr) : {}\n", l.acct), format!("memref.dealloc %oacc : {}\n", l.acct))
        }
    };
    let rows = match keys {
        Keys::Dense => "%r0 = arith.muli %blk, %cR : index\n\
                        %r1a = arith.addi %r0, %cR : index\n\
                        %r1 = arith.minui %r1a, %rows : index\n"
            .to_string(),
        Keys::Msa { .. } => "%r0l = arith.muli %blk, %cR : index\n\
                             %r0 = arith.addi %rc0, %r0l : index\n\
                             %r1a = arith.addi %r0, %cR : index\n\
                             %r1 = arith.minui %r1a, %rc1 : index\n"
            .to_string(),
    };
    let (select, select_free) = match keys {
        Keys::Dense => (String::new(), String::new()),
        Keys::Msa { select, teardown } => (
            selection(select, teardown),
            "memref.dealloc %selb : memref<?x?xi32>\nmemref.dealloc %uni : memref<?xi32>\nmemref.dealloc %rl : memref<?xindex>\n"
                .to_string(),
        ),
    };
    // The block's index (MSA's selection names its own `%bi`).
    let iv = if keys.msa() { "%bki" } else { "%bi" };
    format!(
        "%bi2 = arith.divui {iv}, %c2 : index\n\
         %bpar = arith.remui {iv}, %c2 : index\n\
         %bodd = arith.cmpi ne, %bpar, %c0 : index\n\
         %blast = arith.subi %nblk, %c1 : index\n\
         %brev = arith.subi %blast, %bi2 : index\n\
         %blk = arith.select %bodd, %brev, %bi2 : index\n\
         {rows}\
         %nr = arith.subi %r1, %r0 : index\n\
         %nkmax = scf.for %ii = %c0 to %nr step %c1 iter_args(%m = %c0) -> (index) {{\n\
         {row}\
         \x20 %m2 = arith.maxui %m, %nk : index\n\
         \x20 scf.yield %m2 : index\n\
         }}\n\
         %nkm7 = arith.addi %nkmax, %c7 : index\n\
         %nkmb = arith.divui %nkm7, %c8 : index\n\
         %nk8max = arith.muli %nkmb, %c8 : index\n\
         {select}\
         %sc = memref.alloc(%nr, %nk8max) : {SCT}\n\
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
         {acc_free}\
         {select_free}",
        row = indent(ROW, 2),
        phase1 = indent(&scores_phase(k, l, keys), 2),
        phase2 = indent(&weights_phase(k, l, keys), 2),
        phase3 = indent(&values_phase(k, l, keys), 2),
        out = indent(&bf16_out(k, l), 2),
    )
}

/// MSA: each row of the block chooses its blocks (`select`, then
/// `teardown`), kept in `%selb[row, block]` for the `%nbk` blocks any row
/// of the block reaches, with `%uni[block]` their union.
fn selection(select: &str, teardown: &str) -> String {
    format!(
        "%nbk0 = arith.addi %nkmax, %cBm1 : index\n\
         %nbk = arith.divui %nbk0, %cB : index\n\
         %selb = memref.alloc(%nr, %nbk) : memref<?x?xi32>\n\
         %uni = memref.alloc(%nbk) : memref<?xi32>\n\
         %rl = memref.alloc(%nr) : memref<?xindex>\n\
         scf.for %b = %c0 to %nbk step %c1 {{\n\
         \x20 memref.store %i32_0, %uni[%b] : memref<?xi32>\n\
         }}\n\
         scf.for %ii = %c0 to %nr step %c1 {{\n\
         {row}\
         \x20 %lr = arith.addi %r0l, %ii : index\n\
         \x20 scf.for %b = %c0 to %nbk step %c1 {{\n\
         \x20   memref.store %i32_0, %selb[%ii, %b] : memref<?x?xi32>\n\
         \x20 }}\n\
         \x20 scf.execute_region {{\n\
         {select}\
         \x20   scf.for %b = %c0 to %nb step %c1 {{\n\
         \x20     %sb = memref.load %sel[%b] : memref<?xi32>\n\
         \x20     memref.store %sb, %selb[%ii, %b] : memref<?x?xi32>\n\
         \x20     %ub = memref.load %uni[%b] : memref<?xi32>\n\
         \x20     %uo = arith.ori %ub, %sb : i32\n\
         \x20     memref.store %uo, %uni[%b] : memref<?xi32>\n\
         \x20   }}\n\
         {teardown}\
         \x20   scf.yield\n\
         \x20 }}\n\
         }}\n",
        row = indent(ROW, 2),
        select = indent(select, 4),
        teardown = indent(teardown, 4),
    )
}

/// Phase 1: scores. Per key batch, per row of the block that sees it
/// (MSA: that chose its block; a batch no row chose is passed over).
fn scores_phase(k: &super::Attention, l: &Layout, keys: Keys) -> String {
    let mut score = dots8("%qk", ("%q", &l.qt, k.act, "%r0i", "%qb"), ("%k", &l.kt, k.cache, "%kb"), key_rows(k.paged), "%cd");
    score.push_str(&transposed_tree("%dv", &(0..8).map(|j| format!("%qk#{j}")).collect::<Vec<_>>()));
    // A batch wholly below the row's count keeps every score; the row's
    // last batch masks the keys past it to -inf.
    let ins: String = (0..8).map(|j| format!("%in{j} = arith.cmpi ult, %tu{j}, %nk : index\n")).collect();
    let vals = (0..8).map(|j| format!("%in{j}")).collect::<Vec<_>>().join(", ");
    score.push_str(&format!(
        "%sv0 = arith.mulf %dv, %scale8 : {V}\n\
         %t8 = arith.addi %t0, %c8 : index\n\
         %whole = arith.cmpi ule, %t8, %nk : index\n\
         %sv = scf.if %whole -> ({V}) {{\n\
         \x20 scf.yield %sv0 : {V}\n\
         }} else {{\n\
         {}\
         \x20 %mask = vector.from_elements {vals} : vector<8xi1>\n\
         \x20 %svm = arith.select %mask, %sv0, %ninf8 : vector<8xi1>, {V}\n\
         \x20 scf.yield %svm : {V}\n\
         }}\n\
         vector.store %sv, %sc[%ii, %t0] : {SCT}, {V}\n",
        indent(&ins, 2)
    ));
    // The batch's key rows once for all the block's rows, clamped to the
    // last key any of them sees (a loadable row: the padding is masked).
    let batch = batch_rows(k.paged, "%nkmaxm1");
    if !keys.msa() {
        return format!(
            "%nkmaxm1 = arith.subi %nkmax, %c1 : index\n\
             scf.for %t0 = %c0 to %nk8max step %c8 {{\n\
             {}\
             }}\n",
            indent(&format!("{batch}{}", live_rows("scf.for %ii = %c0 to %nr step %c1 {\n", &score)), 2)
        );
    }
    // MSA: block by block that any row chose, the rows that chose it
    // listed once (`%rl[0..%nrs]`), then its batches for those rows only.
    let rows =
        format!("{batch}{}", live_rows("scf.for %li = %c0 to %nrs step %c1 {\n  %ii = memref.load %rl[%li] : memref<?xindex>\n", &score));
    format!(
        "%nkmaxm1 = arith.subi %nkmax, %c1 : index\n\
         {}",
        chosen_blocks(&format!(
            "%bt0 = arith.muli %sb, %cB : index\n\
             %bt1a = arith.addi %bt0, %cB : index\n\
             %bt1 = arith.minui %bt1a, %nk8max : index\n\
             scf.for %t0 = %bt0 to %bt1 step %c8 {{\n\
             {}\
             }}\n",
            indent(&rows, 2)
        ))
    )
}

/// MSA: `body` for each block `%sb` any row of the block chose, with the
/// rows that chose it listed in key order: `%rl[0..%nrs]`.
fn chosen_blocks(body: &str) -> String {
    format!(
        "scf.for %sb = %c0 to %nbk step %c1 {{\n\
         \x20 %uav = memref.load %uni[%sb] : memref<?xi32>\n\
         \x20 %uaany = arith.cmpi ne, %uav, %i32_0 : i32\n\
         \x20 scf.if %uaany {{\n\
         \x20   %nrs = scf.for %ii = %c0 to %nr step %c1 iter_args(%cnt = %c0) -> (index) {{\n\
         \x20     %rsv = memref.load %selb[%ii, %sb] : memref<?x?xi32>\n\
         \x20     %rsel = arith.cmpi ne, %rsv, %i32_0 : i32\n\
         \x20     %cnt2 = scf.if %rsel -> (index) {{\n\
         \x20       memref.store %ii, %rl[%cnt] : memref<?xindex>\n\
         \x20       %cnt1 = arith.addi %cnt, %c1 : index\n\
         \x20       scf.yield %cnt1 : index\n\
         \x20     }} else {{\n\
         \x20       scf.yield %cnt : index\n\
         \x20     }}\n\
         \x20     scf.yield %cnt2 : index\n\
         \x20   }}\n\
         {}\
         \x20 }}\n\
         }}\n",
        indent(body, 4)
    )
}

/// Phase 1's loop over rows: `head` opens it and defines the row `%ii`
/// (every row of the block, or MSA's listed ones); `body` runs for a row
/// that sees a key of the batch at `%t0`.
fn live_rows(head: &str, body: &str) -> String {
    format!(
        "{head}\
         {row}\
         \x20 %live = arith.cmpi ult, %t0, %nk : index\n\
         \x20 scf.if %live {{\n\
         {body}\
         \x20 }}\n\
         }}\n",
        row = indent(ROW, 2),
        body = indent(body, 4),
    )
}

/// Phase 2: per row, the max, the weights and 1 / their sum; the row's
/// accumulator zeroed. MSA: over the batches of the row's own blocks
/// only (the others hold no scores of its), in key order, as the
/// row-by-row `scores::softmax8` goes through them.
fn weights_phase(k: &super::Attention, l: &Layout, keys: Keys) -> String {
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
    let max =
        "%sl = vector.load %sc[%ii, %t0] : {SCT}, {V}\n%mv2 = arith.maximumf %mv, %sl : {V}\n".replace("{SCT}", SCT).replace("{V}", V);
    let sum = format!(
        "%sl = vector.load %sc[%ii, %t0] : {SCT}, {V}\n\
         %sh = arith.subf %sl, %mx8 : {V}\n\
         {exp}\
         vector.store %e, %sc[%ii, %t0] : {SCT}, {V}\n\
         %sa2 = arith.addf %sa, %e : {V}\n",
        exp = exp8("%e", "%sh"),
    );
    // The weights times 1 / their sum, each the product P·V's multiply-add
    // takes (the row-by-row kernel's scalar `e · inv`, the same bits).
    let norm = format!(
        "%wl = vector.load %sc[%ii, %t0] : {SCT}, {V}\n\
         %wn = arith.mulf %wl, %inv8 : {V}\n\
         vector.store %wn, %sc[%ii, %t0] : {SCT}, {V}\n"
    );
    // MSA: the batches of the blocks the row chose, in key order: block by
    // block, each chosen block's batches below the row's count.
    let over = |x: &str, init: &str, body: &str, acc: &str, next: &str| -> String {
        if !keys.msa() {
            return match init {
                "" => format!("scf.for %t0 = %c0 to %nk8 step %c8 {{\n{}}}\n", indent(body, 2)),
                _ => format!(
                    "scf.for %t0 = %c0 to %nk8 step %c8 iter_args({acc} = {init}) -> ({V}) {{\n{}  scf.yield {next} : {V}\n}}\n",
                    indent(body, 2)
                ),
            };
        }
        let head = format!(
            "%{x}sv = memref.load %selb[%ii, %{x}bb] : memref<?x?xi32>\n\
             %{x}sel = arith.cmpi ne, %{x}sv, %i32_0 : i32\n\
             %{x}t0 = arith.muli %{x}bb, %cB : index\n\
             %{x}t1a = arith.addi %{x}t0, %cB : index\n\
             %{x}t1 = arith.minui %{x}t1a, %nk8 : index\n"
        );
        match init {
            "" => format!(
                "scf.for %{x}bb = %c0 to %nbr step %c1 {{\n\
                 {}\
                 \x20 scf.if %{x}sel {{\n\
                 \x20   scf.for %t0 = %{x}t0 to %{x}t1 step %c8 {{\n\
                 {}\
                 \x20   }}\n\
                 \x20 }}\n\
                 }}\n",
                indent(&head, 2),
                indent(body, 6)
            ),
            _ => format!(
                "scf.for %{x}bb = %c0 to %nbr step %c1 iter_args(%{x}o = {init}) -> ({V}) {{\n\
                 {}\
                 \x20 %{x}k = scf.if %{x}sel -> ({V}) {{\n\
                 \x20   %{x}i = scf.for %t0 = %{x}t0 to %{x}t1 step %c8 iter_args({acc} = %{x}o) -> ({V}) {{\n\
                 {}\
                 \x20     scf.yield {next} : {V}\n\
                 \x20   }}\n\
                 \x20   scf.yield %{x}i : {V}\n\
                 \x20 }} else {{\n\
                 \x20   scf.yield %{x}o : {V}\n\
                 \x20 }}\n\
                 \x20 scf.yield %{x}k : {V}\n\
                 }}\n",
                indent(&head, 2),
                indent(body, 6)
            ),
        }
    };
    format!(
        "scf.for %ii = %c0 to %nr step %c1 {{\n\
         {row}\
         \x20 %nk7 = arith.addi %nk, %c7 : index\n\
         \x20 %nkb = arith.divui %nk7, %c8 : index\n\
         \x20 %nk8 = arith.muli %nkb, %c8 : index\n\
         {blocks}\
         \x20 %mxv = {max}\
         \x20 %mx = vector.reduction <maximumf>, %mxv : {V} into f32\n\
         \x20 %mx8 = vector.broadcast %mx : f32 to {V}\n\
         \x20 %sumv = {sum}\
         {hsum}\
         \x20 %invr = arith.divf %one, %sum : f32\n\
         \x20 %inv8 = vector.broadcast %invr : f32 to {V}\n\
         {norm}\
         {zero}\
         }}\n",
        row = indent(ROW, 2),
        // MSA: the row's blocks, chosen or not.
        blocks = if keys.msa() { "\x20 %nbr0 = arith.addi %nk, %cBm1 : index\n\x20 %nbr = arith.divui %nbr0, %cB : index\n" } else { "" },
        max = indent(&over("wm", "%ninf8", &max, "%mv", "%mv2"), 2).trim_start(),
        sum = indent(&over("ws", "%z8", &sum, "%sa", "%sa2"), 2).trim_start(),
        norm = indent(&over("wn", "", &norm, "", ""), 2),
        hsum = indent(&hsum("%sum", "%sumv"), 2),
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
///
/// MSA: a tile (never wider than a block) no row of the block chose is
/// passed over; a row that did not choose it sees none of its keys.
fn values_phase(k: &super::Attention, l: &Layout, keys: Keys) -> String {
    // Wider heads (the vision tower's 80 columns) have chains enough alone,
    // and two rows' sums would not fit the registers.
    let wide = super::pv_chunks(k.head_dim).iter().any(|&(_, nv)| nv > super::PAIR_MAX_VECTORS);
    if keys.msa() {
        return msa_values_phase(k, l, wide);
    }
    let single = values_row(k, l);
    if wide {
        return format!(
            "scf.for %tb = %c0 to %nkmax step %cKB {{\n\
             \x20 %tbe = arith.addi %tb, %cKB : index\n\
             {}\
             \x20 scf.for %iia = %c0 to %nr step %c1 {{\n\
             {}\
             \x20 }}\n\
             }}\n",
            indent(&tile_page(k, l), 2),
            indent(&single, 4)
        );
    }
    let pair = values_pair(k, l);
    format!(
        "%npairs0 = arith.addi %nr, %c1 : index\n\
         %npairs = arith.divui %npairs0, %c2 : index\n\
         scf.for %tb = %c0 to %nkmax step %cKB {{\n\
         \x20 %tbe = arith.addi %tb, %cKB : index\n\
         {page}\
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
        page = indent(&tile_page(k, l), 2),
        pair = indent(&pair, 6),
        single = indent(&single, 6),
    )
}

/// MSA's phase 3: block by block that any row chose, its tiles for the
/// rows that chose it ([`chosen_blocks`]), paired in their list's order:
/// a pair's two rows both see the tile, so both sums advance on every key
/// (pairing by position left one row of most pairs alone where rows share
/// few blocks, its few sums waiting on the FMA latency).
fn msa_values_phase(k: &super::Attention, l: &Layout, wide: bool) -> String {
    // Every listed row chose the tile: it sees the keys below its count.
    let single = values_row(k, l);
    let rows = if wide {
        format!(
            "scf.for %li = %c0 to %nrs step %c1 {{\n\
             \x20 %iia = memref.load %rl[%li] : memref<?xindex>\n\
             {}\
             }}\n",
            indent(&single, 2)
        )
    } else {
        format!(
            "%npl0 = arith.addi %nrs, %c1 : index\n\
             %npl = arith.divui %npl0, %c2 : index\n\
             scf.for %pi = %c0 to %npl step %c1 {{\n\
             \x20 %lia = arith.muli %pi, %c2 : index\n\
             \x20 %lib = arith.addi %lia, %c1 : index\n\
             \x20 %iia = memref.load %rl[%lia] : memref<?xindex>\n\
             \x20 %hasb = arith.cmpi ult, %lib, %nrs : index\n\
             \x20 scf.if %hasb {{\n\
             \x20   %iib = memref.load %rl[%lib] : memref<?xindex>\n\
             {}\
             \x20 }} else {{\n\
             {}\
             \x20 }}\n\
             }}\n",
            indent(&values_pair(k, l), 4),
            indent(&single, 4)
        )
    };
    chosen_blocks(&format!(
        "%vb0 = arith.muli %sb, %cB : index\n\
         %vb1a = arith.addi %vb0, %cB : index\n\
         %vb1 = arith.minui %vb1a, %nkmax : index\n\
         scf.for %tb = %vb0 to %vb1 step %cKB {{\n\
         \x20 %tbe = arith.addi %tb, %cKB : index\n\
         {}\
         {}\
         }}\n",
        indent(&tile_page(k, l), 2),
        indent(&rows, 2)
    ))
}

/// Keys per P·V tile: [`KEYS`], or for MSA the tile that never straddles
/// two of its blocks.
fn tile_keys(k: &super::Attention, keys: Keys) -> usize {
    match (keys, k.sparse) {
        (Keys::Msa { .. }, Some(s)) => msa_tile(s.block),
        _ => KEYS,
    }
}

/// Whether a P·V tile's keys sit in one block of a paged cache: tiles
/// start at multiples of their width, so they do where a cache block
/// holds whole tiles. Its keys' rows then follow the tile's first.
fn tile_in_one_page(k: &super::Attention, keys: Keys) -> bool {
    k.paged.is_some_and(|b| b.is_multiple_of(tile_keys(k, keys)))
}

/// The pool row of tile `%tb`'s first key, `%tpt`, looked up in the block
/// table once per tile rather than once per key and row ([`keys_loop`]).
fn tile_page(k: &super::Attention, l: &Layout) -> String {
    if l.one_page {
        key_row(k.paged, "%tb", "%tpt").0
    } else {
        String::new()
    }
}

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
    out.push_str("%te = arith.minui %tbe, %nk : index\n");
    for (ch, (c0, nv)) in super::pv_chunks(k.head_dim).into_iter().enumerate() {
        let pc = PvChunk { c0, nv };
        let (load, store) = acc_io(k, &pc, acc, acc_row, acc_ty, &format!("{ch}"), "%qb");
        let inits = (0..nv).map(|i| format!("%a{i} = %o{ch}_{i}")).collect::<Vec<_>>().join(", ");
        out.push_str(&load);
        out.push_str(&format!("%pacc{ch}:{nv} = {}", keys_loop(k, l, &pc, "%tb", "%te", &inits, &[("%ii", "a")])));
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
             %te{x} = arith.minui %tbe, %nk{x} : index\n"
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
        out.push_str(&format!("%pj{ch}:{} = {}", 2 * nv, keys_loop(k, l, &pc, "%tb", "%tec", &both, &[("%iia", "a"), ("%iib", "b")])));
        let from = |first: usize| (0..nv).map(|i| format!("%a{i} = %pj{ch}#{}", first + i)).collect::<Vec<_>>().join(", ");
        out.push_str(&format!("%pta{ch}:{nv} = {}", keys_loop(k, l, &pc, "%tsc", "%tea", &from(0), &[("%iia", "a")])));
        out.push_str(&format!("%ptb{ch}:{nv} = {}", keys_loop(k, l, &pc, "%tsc", "%teb", &from(nv), &[("%iib", "a")])));
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
/// (each: its row in `%sc`, which holds its weights already divided by
/// their sum, and the prefix of its sums' names), each key's V vectors
/// loaded once, each row's sums a multiply then an add (fused where the
/// CPU has FMA), in key order.
fn keys_loop(k: &super::Attention, l: &Layout, pc: &PvChunk, from: &str, to: &str, inits: &str, rows: &[(&str, &str)]) -> String {
    let (vrow, vt) = if l.one_page {
        ("%tpo = arith.subi %t, %tb : index\n%tp = arith.addi %tpt, %tpo : index\n".to_string(), "%tp".to_string())
    } else {
        key_row(k.paged, "%t", "%tp")
    };
    let tys = vec![V; pc.nv * rows.len()].join(", ");
    let mut body = vrow;
    for i in 0..pc.nv {
        let col = pc.c0 + 8 * i;
        body.push_str(&format!("%vk{i} = arith.constant {col} : index\n%vc{i} = arith.addi %kb, %vk{i} : index\n"));
        body.push_str(&load_f32xn(8, &format!("%vv{i}"), "%v", &l.kt, &vt, &format!("%vc{i}"), k.cache));
    }
    let mut next = Vec::new();
    for (ii, x) in rows {
        body.push_str(&format!(
            "%pw{x} = memref.load %sc[{ii}, %t] : {SCT}\n\
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
