//! Next-token sampling on the last stage: per row of logits, the sampler of
//! `m3c_contract::sampling` (an additive bias row, repetition penalty,
//! temperature, allowed tokens, top-k, top-p,
//! min-p, one Philox draw keyed by (seed, request, step)), so that on a GPU
//! only the ids leave the device. Each row also gets the count of its
//! non-finite logits, which the runtime turns into an error.
//!
//! The host body calls the runtime's `m3c_sample_rows`, which is the
//! contract's Rust sampler: one implementation per target, and the GPU one
//! is checked to pick exactly the host's ids (tests/it/gpu_kernels.rs). That
//! works because every decision is made on integer weights, whose sums are
//! exact in any order, computed with the contract's own constants and no
//! fused multiply-adds.
//!
//! On the GPU a block of 1024 threads takes one row: a pass for the maximum
//! (and the non-finite count), then for greedy rows a pass for the first
//! maximum; for sampled rows a pass for the total and the min-p weight, then
//! up to three weighted radix selects (top-k's k-th token, top-p's boundary,
//! the draw), each four passes of an 8-bit digit histogram in shared memory
//! (integer atomics, so the order of the adds does not matter), and a last
//! pass that finds the n-th token of the boundary weight in id order.
//! Weights are recomputed from the logits in every pass rather than stored:
//! a row is 800 kB at MiniMax-M3's vocabulary and stays in L2.

use crate::gpu::{func_shared, GpuCall, GpuFunc, GpuTarget};
use crate::unit::{params_text, KernelUnit, Launch, Param};
use crate::{indent, Storage};
use m3c_contract::sampling::{exp_consts, row, ROW_WORDS, WEIGHT_ONE};

/// Threads per row on the GPU.
const THREADS: usize = 1024;

/// Samples one id per row of `x` (`[S, width]` f32 logits) under the row's
/// entry of `table` (`[S, ROW_WORDS]` i64, see `m3c_contract::sampling::row`;
/// the kernel writes each row's non-finite count into it), with `seen` the
/// repetition-penalty bitmaps (`[sequences, ⌈width/32⌉]` i32, a row picks
/// its own) and `bias` the bias rows (`[rows, width]` f32, added to the
/// logits of the rows that name one). `ids`: `[S]`.
#[derive(Debug, Clone, PartialEq, PartialOrd)]
pub struct Sample {
    pub width: usize,
}

/// The runtime's host sampler: (logits, table, seen, bias, ids, rows,
/// width, seen rows, seen words, bias rows).
const HOST_SAMPLER: &str = m3c_contract::stage::abi::SAMPLE_ROWS;

impl Sample {
    fn seen_words(&self) -> usize {
        m3c_contract::sampling::seen_words(self.width)
    }
}

impl KernelUnit for Sample {
    fn symbol(&self) -> String {
        format!("m3c_sample_w{}", self.width)
    }
    fn params(&self) -> Vec<Param> {
        vec![
            crate::unit::param("x", format!("memref<?x{}xf32>", self.width)),
            crate::unit::param("table", format!("memref<?x{ROW_WORDS}xi64>")),
            crate::unit::param("seen", format!("memref<?x{}xi32>", self.seen_words())),
            crate::unit::param("bias", format!("memref<?x{}xf32>", self.width)),
            crate::unit::param("ids", "memref<?xi64>"),
        ]
    }
    fn act(&self) -> Option<Storage> {
        None
    }
    fn host_body(&self) -> String {
        let (w, nw) = (self.width, self.seen_words());
        let ptr = |name: &str, ty: &str| {
            format!(
                "%{name}_ix = memref.extract_aligned_pointer_as_index %{name} : {ty} -> index\n\
                 %{name}_i = arith.index_cast %{name}_ix : index to i64\n\
                 %{name}_p = llvm.inttoptr %{name}_i : i64 to !llvm.ptr\n"
            )
        };
        format!(
            "%c0 = arith.constant 0 : index\n\
             {}{}{}{}{}\
             %rows_ix = memref.dim %x, %c0 : memref<?x{w}xf32>\n\
             %rows = arith.index_cast %rows_ix : index to i64\n\
             %seqs_ix = memref.dim %seen, %c0 : memref<?x{nw}xi32>\n\
             %seqs = arith.index_cast %seqs_ix : index to i64\n\
             %brows_ix = memref.dim %bias, %c0 : memref<?x{w}xf32>\n\
             %brows = arith.index_cast %brows_ix : index to i64\n\
             %width = arith.constant {w} : i64\n\
             %words = arith.constant {nw} : i64\n\
             func.call @{HOST_SAMPLER}(%x_p, %table_p, %seen_p, %bias_p, %ids_p, %rows, %width, %seqs, %words, %brows) : \
             (!llvm.ptr, !llvm.ptr, !llvm.ptr, !llvm.ptr, !llvm.ptr, i64, i64, i64, i64, i64) -> ()\n\
             return\n",
            ptr("x", &format!("memref<?x{w}xf32>")),
            ptr("table", &format!("memref<?x{ROW_WORDS}xi64>")),
            ptr("seen", &format!("memref<?x{nw}xi32>")),
            ptr("bias", &format!("memref<?x{w}xf32>")),
            ptr("ids", "memref<?xi64>"),
        )
    }
    fn globals(&self) -> Vec<(String, String)> {
        vec![(
            HOST_SAMPLER.into(),
            format!(
                "  func.func private @{HOST_SAMPLER}(!llvm.ptr, !llvm.ptr, !llvm.ptr, !llvm.ptr, !llvm.ptr, i64, i64, i64, i64, i64)\n"
            ),
        )]
    }
    fn gpu_funcs(&self, target: &GpuTarget) -> Vec<GpuFunc> {
        let sym = self.symbol();
        let body = gpu_body(self.width, self.seen_words());
        let wg = |ty: &str| format!("memref<{ty}, #gpu.address_space<workgroup>>");
        let shared = [
            ("hc", wg("256xi32")),
            ("hm", wg("256xi64")),
            ("tie", wg(&format!("{THREADS}xi32"))),
            ("si", wg("4xi32")),
            ("sl", wg("4xi64")),
        ];
        vec![func_shared(target, &sym, &params_text(&self.params()), &shared, &body, THREADS)]
    }
    fn launch(&self, l: &Launch) -> GpuCall {
        let threads = l.local(&format!("b{THREADS}"));
        let mut call = l.call(l.grid(&self.symbol(), [l.rows, &l.one(), &l.one()], THREADS, l.args));
        call.text = format!("{threads} = arith.constant {THREADS} : index\n{}", call.text);
        call
    }
}

/// An f32 constant with the exact bits of `v`.
fn f32c(name: &str, v: f32) -> String {
    format!("{name} = arith.constant 0x{:08X} : f32\n", v.to_bits())
}

/// An i32 constant from its bit pattern.
fn i32c(name: &str, v: u32) -> String {
    format!("{name} = arith.constant {} : i32\n", v as i32)
}

/// The scaled value `%{p}x` of logit `l0` at index `i` of the row: plus
/// the row's bias when it has one, NaN as -∞, the penalty if the row's
/// bitmap has the token, divided by `%tt`; -∞ for a token the row's
/// allowed-token bitmap leaves out.
fn scaled(p: &str, l0: &str, i: &str, width: usize, nw: usize) -> String {
    let l = format!("%{p}bias_x");
    format!(
        "{l} = scf.if %biason -> (f32) {{\n\
         \x20 %{p}bias_v = memref.load %bias[%brow, {i}] : memref<?x{width}xf32>\n\
         \x20 %{p}bias_s = arith.addf {l0}, %{p}bias_v : f32\n\
         \x20 scf.yield %{p}bias_s : f32\n\
         }} else {{\n\
         \x20 scf.yield {l0} : f32\n\
         }}\n\
         %{p}nan = arith.cmpf uno, {l}, {l} : f32\n\
         %{p}fl = arith.select %{p}nan, %ninf, {l} : f32\n\
         {hit}\
         %{p}pos = arith.cmpf ogt, {l}, %zero : f32\n\
         %{p}dv = arith.divf {l}, %pen : f32\n\
         %{p}mv = arith.mulf {l}, %pen : f32\n\
         %{p}pl = arith.select %{p}pos, %{p}dv, %{p}mv : f32\n\
         %{p}pnan = arith.cmpf uno, %{p}pl, %{p}pl : f32\n\
         %{p}pf = arith.select %{p}pnan, %ninf, %{p}pl : f32\n\
         %{p}v = arith.select %{p}hit, %{p}pf, %{p}fl : f32\n\
         %{p}x0 = arith.divf %{p}v, %tt : f32\n\
         {ok}\
         %{p}x = arith.select %{p}ok, %{p}x0, %ninf : f32\n",
        hit = bitmap_bit(&format!("{p}hit"), "%penon", "%srow", i, nw, "%false"),
        ok = bitmap_bit(&format!("{p}ok"), "%maskon", "%mrow", i, nw, "%true"),
    )
}

/// `%{d}` (i1) = bit `i` of bitmap row `row` of `%seen` when `on`, else `otherwise`.
fn bitmap_bit(d: &str, on: &str, row: &str, i: &str, nw: usize, otherwise: &str) -> String {
    format!(
        "%{d} = scf.if {on} -> (i1) {{\n\
         \x20 %{d}_wi = arith.divui {i}, %c32 : index\n\
         \x20 %{d}_w = memref.load %seen[{row}, %{d}_wi] : memref<?x{nw}xi32>\n\
         \x20 %{d}_bi = arith.remui {i}, %c32 : index\n\
         \x20 %{d}_b32 = arith.index_cast %{d}_bi : index to i32\n\
         \x20 %{d}_s = arith.shrui %{d}_w, %{d}_b32 : i32\n\
         \x20 %{d}_1 = arith.trunci %{d}_s : i32 to i1\n\
         \x20 scf.yield %{d}_1 : i1\n\
         }} else {{\n\
         \x20 scf.yield {otherwise} : i1\n\
         }}\n"
    )
}

/// The weight `%{p}w` (i64) of scaled value `x` below the maximum `%m`:
/// `m3c_sampler::weight`, operation for operation.
fn weight(p: &str, x: &str) -> String {
    let mut s = format!(
        "%{p}d = arith.subf %m, {x} : f32\n\
         %{p}gt0 = arith.cmpf ogt, %{p}d, %zero : f32\n\
         %{p}c = arith.select %{p}gt0, %{p}d, %zero : f32\n\
         %{p}lt = arith.cmpf olt, %{p}c, %cut : f32\n\
         %{p}cc = arith.select %{p}lt, %{p}c, %cut : f32\n\
         %{p}xx = arith.negf %{p}cc : f32\n\
         %{p}n0 = arith.mulf %{p}xx, %log2e : f32\n\
         %{p}n1 = arith.addf %{p}n0, %round : f32\n\
         %{p}n = arith.subf %{p}n1, %round : f32\n\
         %{p}h = arith.mulf %{p}n, %ln2hi : f32\n\
         %{p}r0 = arith.subf %{p}xx, %{p}h : f32\n\
         %{p}lo = arith.mulf %{p}n, %ln2lo : f32\n\
         %{p}r = arith.subf %{p}r0, %{p}lo : f32\n"
    );
    let mut cur = "%poly0".to_string();
    for k in 1..exp_consts::POLY.len() {
        s.push_str(&format!("%{p}pm{k} = arith.mulf {cur}, %{p}r : f32\n%{p}pa{k} = arith.addf %{p}pm{k}, %poly{k} : f32\n"));
        cur = format!("%{p}pa{k}");
    }
    s.push_str(&format!(
        "%{p}ni = arith.fptosi %{p}n : f32 to i32\n\
         %{p}nb = arith.addi %{p}ni, %c127i : i32\n\
         %{p}sb = arith.shli %{p}nb, %c23i : i32\n\
         %{p}scale = arith.bitcast %{p}sb : i32 to f32\n\
         %{p}e0 = arith.mulf {cur}, %{p}scale : f32\n\
         %{p}in = arith.cmpf olt, %{p}d, %cut : f32\n\
         %{p}e = arith.select %{p}in, %{p}e0, %zero : f32\n\
         %{p}es = arith.mulf %{p}e, %wone : f32\n\
         %{p}lt1 = arith.cmpf olt, %{p}es, %wone : f32\n\
         %{p}ec = arith.select %{p}lt1, %{p}es, %wone : f32\n\
         %{p}wint = arith.fptosi %{p}ec : f32 to i32\n\
         %{p}w = arith.extui %{p}wint : i32 to i64\n"
    ));
    s
}

/// Loads logit `i` of the row and weighs it: defines `%{p}w`.
fn weigh_at(p: &str, i: &str, width: usize, nw: usize) -> String {
    format!(
        "%{p}l = memref.load %x[%r, {i}] : memref<?x{width}xf32>\n{}{}",
        scaled(p, &format!("%{p}l"), i, width, nw),
        weight(p, &format!("%{p}x"))
    )
}

/// A weighted radix select over the row's weights: the boundary where the
/// running count (`by_count`) or weight first reaches `goal` (i64), in the
/// order of descending weight. Four passes, each an 8-bit digit histogram
/// (count and weight) of the weights that share the digits found so far,
/// then a scan of the digits from the top. Defines `%{t}tau`, `%{t}ac`,
/// `%{t}am` (the count and weight strictly above the boundary's weight).
fn select(t: &str, by_count: bool, goal: &str, width: usize, nw: usize) -> String {
    let reach = if by_count { format!("%{t}na") } else { format!("%{t}nm") };
    format!(
        "%{t}res:3 = scf.for %{t}lv = %c0 to %c4 step %c1 iter_args(%{t}P = %z64, %{t}Ac = %z64, %{t}Am = %z64) -> (i64, i64, i64) {{\n\
         \x20 %{t}lv64 = arith.index_cast %{t}lv : index to i64\n\
         \x20 %{t}l8 = arith.muli %{t}lv64, %c8l : i64\n\
         \x20 %{t}sh = arith.subi %c24l, %{t}l8 : i64\n\
         \x20 %{t}sh8 = arith.addi %{t}sh, %c8l : i64\n\
         \x20 %{t}first = arith.cmpi eq, %{t}lv, %c0 : index\n\
         \x20 scf.if %zeroer {{\n\
         \x20   memref.store %z32, %hc[%t] : memref<256xi32, #gpu.address_space<workgroup>>\n\
         \x20   memref.store %z64, %hm[%t] : memref<256xi64, #gpu.address_space<workgroup>>\n\
         \x20 }}\n\
         \x20 gpu.barrier\n\
         \x20 scf.for %{t}i = %t to %cw step %cth {{\n\
         {}\
         \x20   %{t}hi = arith.shrui %{t}aw, %{t}sh8 : i64\n\
         \x20   %{t}same = arith.cmpi eq, %{t}hi, %{t}P : i64\n\
         \x20   %{t}in = arith.ori %{t}same, %{t}first : i1\n\
         \x20   scf.if %{t}in {{\n\
         \x20     %{t}dg0 = arith.shrui %{t}aw, %{t}sh : i64\n\
         \x20     %{t}dg = arith.andi %{t}dg0, %c255l : i64\n\
         \x20     %{t}di = arith.index_cast %{t}dg : i64 to index\n\
         \x20     %{t}o1 = memref.atomic_rmw addi %c1i, %hc[%{t}di] : (i32, memref<256xi32, #gpu.address_space<workgroup>>) -> i32\n\
         \x20     %{t}o2 = memref.atomic_rmw addi %{t}aw, %hm[%{t}di] : (i64, memref<256xi64, #gpu.address_space<workgroup>>) -> i64\n\
         \x20   }}\n\
         \x20 }}\n\
         \x20 gpu.barrier\n\
         \x20 %{t}s:4 = scf.for %{t}k = %c0 to %c256 step %c1 iter_args(%{t}sa = %{t}Ac, %{t}sm = %{t}Am, %{t}sd = %z64, %{t}done = %false) -> (i64, i64, i64, i1) {{\n\
         \x20   %{t}d = arith.subi %c255, %{t}k : index\n\
         \x20   %{t}hcv = memref.load %hc[%{t}d] : memref<256xi32, #gpu.address_space<workgroup>>\n\
         \x20   %{t}hcl = arith.extui %{t}hcv : i32 to i64\n\
         \x20   %{t}hmv = memref.load %hm[%{t}d] : memref<256xi64, #gpu.address_space<workgroup>>\n\
         \x20   %{t}na = arith.addi %{t}sa, %{t}hcl : i64\n\
         \x20   %{t}nm = arith.addi %{t}sm, %{t}hmv : i64\n\
         \x20   %{t}hit = arith.cmpi uge, {reach}, {goal} : i64\n\
         \x20   %{t}open = arith.xori %{t}done, %true : i1\n\
         \x20   %{t}take = arith.andi %{t}hit, %{t}open : i1\n\
         \x20   %{t}miss = arith.xori %{t}hit, %true : i1\n\
         \x20   %{t}pass = arith.andi %{t}miss, %{t}open : i1\n\
         \x20   %{t}ra = arith.select %{t}pass, %{t}na, %{t}sa : i64\n\
         \x20   %{t}rm = arith.select %{t}pass, %{t}nm, %{t}sm : i64\n\
         \x20   %{t}dl = arith.index_cast %{t}d : index to i64\n\
         \x20   %{t}rd = arith.select %{t}take, %{t}dl, %{t}sd : i64\n\
         \x20   %{t}rdone = arith.ori %{t}done, %{t}hit : i1\n\
         \x20   scf.yield %{t}ra, %{t}rm, %{t}rd, %{t}rdone : i64, i64, i64, i1\n\
         \x20 }}\n\
         \x20 %{t}Ps = arith.shli %{t}P, %c8l : i64\n\
         \x20 %{t}P2 = arith.ori %{t}Ps, %{t}s#2 : i64\n\
         \x20 gpu.barrier\n\
         \x20 scf.yield %{t}P2, %{t}s#0, %{t}s#1 : i64, i64, i64\n\
         }}\n\
         %{t}tau = arith.addi %{t}res#0, %z64 : i64\n\
         %{t}ac = arith.addi %{t}res#1, %z64 : i64\n\
         %{t}am = arith.addi %{t}res#2, %z64 : i64\n",
        indent(&weigh_at(&format!("{t}a"), &format!("%{t}i"), width, nw), 4),
    )
}

/// Philox-4x32-10 of (counter, key) as i32 SSA names; defines `%{p}bits`
/// (i64): the first two output words, low first
/// (`m3c_sampler::draw_bits`).
fn philox(p: &str, counter: [&str; 4], key: [&str; 2]) -> String {
    let mut s = String::new();
    let (mut c, mut k) = (counter.map(str::to_string), key.map(str::to_string));
    for round in 0..10 {
        let q = format!("%{p}{round}");
        s.push_str(&format!(
            "{q}a = arith.extui {c0} : i32 to i64\n{q}p0 = arith.muli {q}a, %pm0 : i64\n\
             {q}b = arith.extui {c2} : i32 to i64\n{q}p1 = arith.muli {q}b, %pm1 : i64\n\
             {q}h0l = arith.shrui {q}p0, %c32l : i64\n{q}h0 = arith.trunci {q}h0l : i64 to i32\n{q}l0 = arith.trunci {q}p0 : i64 to i32\n\
             {q}h1l = arith.shrui {q}p1, %c32l : i64\n{q}h1 = arith.trunci {q}h1l : i64 to i32\n{q}l1 = arith.trunci {q}p1 : i64 to i32\n\
             {q}x0 = arith.xori {q}h1, {c1} : i32\n{q}n0 = arith.xori {q}x0, {k0} : i32\n\
             {q}x2 = arith.xori {q}h0, {c3} : i32\n{q}n2 = arith.xori {q}x2, {k1} : i32\n\
             {q}k0 = arith.addi {k0}, %pw0 : i32\n{q}k1 = arith.addi {k1}, %pw1 : i32\n",
            c0 = c[0],
            c1 = c[1],
            c2 = c[2],
            c3 = c[3],
            k0 = k[0],
            k1 = k[1],
        ));
        c = [format!("{q}n0"), format!("{q}l1"), format!("{q}n2"), format!("{q}l0")];
        k = [format!("{q}k0"), format!("{q}k1")];
    }
    s.push_str(&format!(
        "%{p}w0 = arith.extui {} : i32 to i64\n%{p}w1 = arith.extui {} : i32 to i64\n\
         %{p}w1s = arith.shli %{p}w1, %c32l : i64\n%{p}bits = arith.ori %{p}w0, %{p}w1s : i64\n",
        c[0], c[1]
    ));
    s
}

/// The high 64 bits of the 128-bit product of two u64 (`a`, `b`), from
/// 32-bit halves: defines `%{p}hi`.
fn mul_hi(p: &str, a: &str, b: &str) -> String {
    format!(
        "%{p}al = arith.andi {a}, %lo32 : i64\n%{p}ah = arith.shrui {a}, %c32l : i64\n\
         %{p}bl = arith.andi {b}, %lo32 : i64\n%{p}bh = arith.shrui {b}, %c32l : i64\n\
         %{p}ll = arith.muli %{p}al, %{p}bl : i64\n%{p}m1 = arith.muli %{p}ah, %{p}bl : i64\n\
         %{p}m2 = arith.muli %{p}al, %{p}bh : i64\n%{p}hh = arith.muli %{p}ah, %{p}bh : i64\n\
         %{p}t0 = arith.shrui %{p}ll, %c32l : i64\n%{p}m1l = arith.andi %{p}m1, %lo32 : i64\n%{p}m2l = arith.andi %{p}m2, %lo32 : i64\n\
         %{p}t1 = arith.addi %{p}t0, %{p}m1l : i64\n%{p}t = arith.addi %{p}t1, %{p}m2l : i64\n\
         %{p}m1h = arith.shrui %{p}m1, %c32l : i64\n%{p}m2h = arith.shrui %{p}m2, %c32l : i64\n%{p}tc = arith.shrui %{p}t, %c32l : i64\n\
         %{p}s1 = arith.addi %{p}hh, %{p}m1h : i64\n%{p}s2 = arith.addi %{p}s1, %{p}m2h : i64\n%{p}hi = arith.addi %{p}s2, %{p}tc : i64\n"
    )
}

/// ⌈a / b⌉ for u64 `a` ≥ 0, `b` > 0: defines `%{p}q`.
fn div_ceil(p: &str, a: &str, b: &str) -> String {
    format!("%{p}s = arith.addi {a}, {b} : i64\n%{p}s1 = arith.subi %{p}s, %c1l : i64\n%{p}q = arith.divui %{p}s1, {b} : i64\n")
}

/// The GPU body: block `%r` samples row `%r`.
fn gpu_body(width: usize, nw: usize) -> String {
    let mut s = gpu_constants(width);
    s.push_str(&gpu_row_params());
    s.push_str(&gpu_scan(width, nw));
    s.push_str(&gpu_greedy(width, nw));
    s.push_str("%notgreedy = arith.xori %greedy, %true : i1\n%dosample = arith.andi %give, %notgreedy : i1\n");
    s.push_str(&format!("scf.if %dosample {{\n{}}}\n", indent(&gpu_draw(width, nw), 2)));
    s
}

/// The sampling table's type.
fn table_type() -> String {
    format!("memref<?x{ROW_WORDS}xi64>")
}

/// The block's shared scalars (see [`gpu_scan`]).
const SHARED_I32: &str = "memref<4xi32, #gpu.address_space<workgroup>>";
const SHARED_I64: &str = "memref<4xi64, #gpu.address_space<workgroup>>";

/// Every constant the body uses.
fn gpu_constants(width: usize) -> String {
    let chunk = width.div_ceil(THREADS);
    let mut s = String::new();
    // Constants.
    s.push_str(
        "%c0 = arith.constant 0 : index\n%c1 = arith.constant 1 : index\n%c2 = arith.constant 2 : index\n\
         %c3 = arith.constant 3 : index\n%c4 = arith.constant 4 : index\n%c32 = arith.constant 32 : index\n\
         %c255 = arith.constant 255 : index\n%c256 = arith.constant 256 : index\n\
         %zero = arith.constant 0.0 : f32\n%fone = arith.constant 1.0 : f32\n%ninf = arith.constant 0xFF800000 : f32\n\
         %true = arith.constant true\n%false = arith.constant false\n\
         %z32 = arith.constant 0 : i32\n%c1i = arith.constant 1 : i32\n%c23i = arith.constant 23 : i32\n%c127i = arith.constant 127 : i32\n\
         %z64 = arith.constant 0 : i64\n%c1l = arith.constant 1 : i64\n%c8l = arith.constant 8 : i64\n%c24l = arith.constant 24 : i64\n\
         %c32l = arith.constant 32 : i64\n%c255l = arith.constant 255 : i64\n%lo32 = arith.constant 4294967295 : i64\n\
         %expmask = arith.constant 2139095040 : i32\n",
    );
    s.push_str(&format!(
        "%cw = arith.constant {width} : index\n%cwl = arith.constant {width} : i64\n%cwi = arith.constant {width} : i32\n\
         %cth = arith.constant {THREADS} : index\n%cchunk = arith.constant {chunk} : index\n\
         %pm0 = arith.constant 3528531795 : i64\n%pm1 = arith.constant 3449720151 : i64\n{}{}\
         %two30 = arith.constant 1073741824.0 : f64\n",
        i32c("%pw0", 0x9E37_79B9),
        i32c("%pw1", 0xBB67_AE85),
    ));
    // The words this kernel reads or writes (the penalties' own words and
    // the bookkeeping ones are the host's).
    for idx in (0..=row::NON_FINITE).chain([row::BIAS_ROW, row::TOKEN_MASK]) {
        s.push_str(&format!("%cw{idx} = arith.constant {idx} : index\n"));
    }
    s.push_str(&f32c("%log2e", exp_consts::LOG2_E));
    s.push_str(&f32c("%round", exp_consts::ROUND));
    s.push_str(&f32c("%ln2hi", exp_consts::LN2_HI));
    s.push_str(&f32c("%ln2lo", exp_consts::LN2_LO));
    s.push_str(&f32c("%cut", exp_consts::CUTOFF));
    s.push_str(&f32c("%wone", WEIGHT_ONE));
    for (k, c) in exp_consts::POLY.iter().enumerate() {
        s.push_str(&f32c(&format!("%poly{k}"), *c));
    }
    s
}

/// The row's parameters, unpacked from its table words.
fn gpu_row_params() -> String {
    let tab = table_type();
    let word = |name: &str, k: usize| format!("%{name} = memref.load %table[%r, %cw{k}] : {tab}\n");
    let mut s = String::new();
    // The row's parameters.
    s.push_str(
        "%r = gpu.block_id x\n%t = gpu.thread_id x\n%lead = arith.cmpi eq, %t, %c0 : index\n%zeroer = arith.cmpi ult, %t, %c256 : index\n",
    );
    s.push_str(&word("w0", row::TEMPERATURE_TOP_P));
    s.push_str(&word("w1", row::MIN_P_PENALTY));
    s.push_str(&word("topk", row::TOP_K));
    s.push_str(&word("seed", row::SEED));
    s.push_str(&word("step", row::STEP));
    s.push_str(&word("req", row::REQUEST));
    s.push_str(&word("flags", row::FLAGS));
    s.push_str(&word("mword", row::TOKEN_MASK));
    s.push_str(&word("bword", row::BIAS_ROW));
    s.push_str(
        "%temp_i = arith.trunci %w0 : i64 to i32\n%temp = arith.bitcast %temp_i : i32 to f32\n\
         %topp_h = arith.shrui %w0, %c32l : i64\n%topp_i = arith.trunci %topp_h : i64 to i32\n%topp = arith.bitcast %topp_i : i32 to f32\n\
         %minp_i = arith.trunci %w1 : i64 to i32\n%minp = arith.bitcast %minp_i : i32 to f32\n\
         %pen_h = arith.shrui %w1, %c32l : i64\n%pen_i = arith.trunci %pen_h : i64 to i32\n%pen = arith.bitcast %pen_i : i32 to f32\n\
         %give0 = arith.andi %flags, %c1l : i64\n%give = arith.cmpi ne, %give0, %z64 : i64\n\
         %srow_l = arith.shrui %flags, %c32l : i64\n%srow = arith.index_cast %srow_l : i64 to index\n\
         %penne = arith.cmpf one, %pen, %fone : f32\n%penon = arith.andi %give, %penne : i1\n\
         %maskne = arith.cmpi ne, %mword, %z64 : i64\n%maskon = arith.andi %give, %maskne : i1\n\
         %mrow_l = arith.subi %mword, %c1l : i64\n%mrow = arith.index_cast %mrow_l : i64 to index\n\
         %biasne = arith.cmpi ne, %bword, %z64 : i64\n%biason = arith.andi %give, %biasne : i1\n\
         %brow_l = arith.subi %bword, %c1l : i64\n%brow = arith.index_cast %brow_l : i64 to index\n\
         %tpos = arith.cmpf ogt, %temp, %zero : f32\n%tt = arith.select %tpos, %temp, %fone : f32\n",
    );
    s
}

/// Pass 1 over the row: the non-finite count (written to the table) and
/// the maximum scaled value, shared through the block.
fn gpu_scan(width: usize, nw: usize) -> String {
    let (tab, si, sl) = (table_type(), SHARED_I32, SHARED_I64);
    let mut s = String::new();
    // Shared scalars: si[0] the maximum's order key, si[1] the non-finite
    // count, si[2] the first maximum's index; sl[0] the total weight, sl[1]
    // the weight at or above the min-p floor.
    s.push_str(&format!(
        "scf.if %lead {{\n\
         \x20 memref.store %z32, %si[%c0] : {si}\n  memref.store %z32, %si[%c1] : {si}\n  memref.store %cwi, %si[%c2] : {si}\n\
         \x20 memref.store %z64, %sl[%c0] : {sl}\n  memref.store %z64, %sl[%c1] : {sl}\n\
         }}\n\
         gpu.barrier\n"
    ));
    // Pass 1: the non-finite count and the maximum scaled value.
    s.push_str(&format!(
        "%p1:2 = scf.for %i = %t to %cw step %cth iter_args(%bad = %z32, %mx = %ninf) -> (i32, f32) {{\n\
         \x20 %l = memref.load %x[%r, %i] : memref<?x{width}xf32>\n\
         \x20 %lb = arith.bitcast %l : f32 to i32\n  %le = arith.andi %lb, %expmask : i32\n  %lnf = arith.cmpi eq, %le, %expmask : i32\n\
         \x20 %lnfi = arith.extui %lnf : i1 to i32\n  %bad2 = arith.addi %bad, %lnfi : i32\n\
         {}\
         \x20 %gtm = arith.cmpf ogt, %ax, %mx : f32\n  %mx2 = arith.select %gtm, %ax, %mx : f32\n\
         \x20 scf.yield %bad2, %mx2 : i32, f32\n\
         }}\n\
         %mxb = arith.bitcast %p1#1 : f32 to i32\n%mxneg = arith.cmpi slt, %mxb, %z32 : i32\n\
         %flipall = arith.constant -1 : i32\n%flipsign = arith.constant -2147483648 : i32\n\
         %flip = arith.select %mxneg, %flipall, %flipsign : i32\n%mkey = arith.xori %mxb, %flip : i32\n\
         %o_max = memref.atomic_rmw maxu %mkey, %si[%c0] : (i32, {si}) -> i32\n\
         %o_bad = memref.atomic_rmw addi %p1#0, %si[%c1] : (i32, {si}) -> i32\n\
         gpu.barrier\n\
         scf.if %lead {{\n\
         \x20 %nb = memref.load %si[%c1] : {si}\n  %nbl = arith.extui %nb : i32 to i64\n\
         \x20 memref.store %nbl, %table[%r, %cw{nf}] : {tab}\n\
         }}\n",
        indent(&scaled("a", "%l", "%i", width, nw), 2),
        nf = row::NON_FINITE,
    ));
    // The maximum, decoded from its order key.
    s.push_str(&format!(
        "%key = memref.load %si[%c0] : {si}\n\
         %kpos = arith.cmpi slt, %key, %z32 : i32\n\
         %unflip = arith.select %kpos, %flipsign, %flipall : i32\n\
         %mb = arith.xori %key, %unflip : i32\n%m = arith.bitcast %mb : i32 to f32\n\
         %mbe = arith.andi %mb, %expmask : i32\n%mnf = arith.cmpi eq, %mbe, %expmask : i32\n\
         %t0 = arith.cmpf oeq, %temp, %zero : f32\n%greedy = arith.ori %t0, %mnf : i1\n\
         %nogive = arith.xori %give, %true : i1\n"
    ));
    s
}

/// Rows that give no token get id 0; greedy rows the first maximum.
fn gpu_greedy(width: usize, nw: usize) -> String {
    let si = SHARED_I32;
    let mut s = String::new();
    // Rows that give no token: id 0.
    s.push_str("scf.if %nogive {\n  scf.if %lead {\n    memref.store %z64, %ids[%r] : memref<?xi64>\n  }\n}\n");
    // Greedy: the first index of the maximum.
    s.push_str(&format!(
        "%dogreedy = arith.andi %give, %greedy : i1\n\
         scf.if %dogreedy {{\n\
         \x20 %gi = scf.for %i = %t to %cw step %cth iter_args(%best = %cwi) -> (i32) {{\n\
         \x20   %gl = memref.load %x[%r, %i] : memref<?x{width}xf32>\n\
         {}\
         \x20   %eq = arith.cmpf oeq, %ggx, %m : f32\n\
         \x20   %ii = arith.index_cast %i : index to i32\n\
         \x20   %lt = arith.cmpi ult, %ii, %best : i32\n\
         \x20   %tk = arith.andi %eq, %lt : i1\n\
         \x20   %nb = arith.select %tk, %ii, %best : i32\n\
         \x20   scf.yield %nb : i32\n\
         \x20 }}\n\
         \x20 %o_first = memref.atomic_rmw minu %gi, %si[%c2] : (i32, {si}) -> i32\n\
         \x20 gpu.barrier\n\
         \x20 scf.if %lead {{\n\
         \x20   %fi = memref.load %si[%c2] : {si}\n\
         \x20   %found = arith.cmpi ult, %fi, %cwi : i32\n\
         \x20   %fi2 = arith.select %found, %fi, %z32 : i32\n\
         \x20   %fl = arith.extui %fi2 : i32 to i64\n\
         \x20   memref.store %fl, %ids[%r] : memref<?xi64>\n\
         \x20 }}\n\
         }}\n",
        indent(&scaled("gg", "%gl", "%i", width, nw), 4),
    ));
    s
}

/// A draw: min-p, top-k and top-p on integer weights, the Philox draw and
/// the token it lands on.
fn gpu_draw(width: usize, nw: usize) -> String {
    let sl = SHARED_I64;
    let mut d = String::new();
    // The min-p floor: ⌈min_p · 2^30⌉, 0 when min_p = 0.
    d.push_str(
        "%mpd = arith.extf %minp : f32 to f64\n%mps = arith.mulf %mpd, %two30 : f64\n%mpc = math.ceil %mps : f64\n\
         %mpu = arith.fptoui %mpc : f64 to i64\n%mpon = arith.cmpf ogt, %minp, %zero : f32\n%floor = arith.select %mpon, %mpu, %z64 : i64\n",
    );
    // Pass 2: the total and the weight at or above the floor.
    d.push_str(&format!(
        "%p2:2 = scf.for %i = %t to %cw step %cth iter_args(%tot = %z64, %abv = %z64) -> (i64, i64) {{\n\
         {}\
         \x20 %tot2 = arith.addi %tot, %qw : i64\n\
         \x20 %ge = arith.cmpi uge, %qw, %floor : i64\n\
         \x20 %qa = arith.select %ge, %qw, %z64 : i64\n\
         \x20 %abv2 = arith.addi %abv, %qa : i64\n\
         \x20 scf.yield %tot2, %abv2 : i64, i64\n\
         }}\n\
         %o_tot = memref.atomic_rmw addi %p2#0, %sl[%c0] : (i64, {sl}) -> i64\n\
         %o_abv = memref.atomic_rmw addi %p2#1, %sl[%c1] : (i64, {sl}) -> i64\n\
         gpu.barrier\n\
         %total = memref.load %sl[%c0] : {sl}\n%fmass = memref.load %sl[%c1] : {sl}\n",
        indent(&weigh_at("q", "%i", width, nw), 2),
    ));
    // Top-k: the weight of the first k tokens (all when k is 0 or ≥ width).
    d.push_str(&format!(
        "%kon0 = arith.cmpi ne, %topk, %z64 : i64\n%kon1 = arith.cmpi ult, %topk, %cwl : i64\n%kon = arith.andi %kon0, %kon1 : i1\n\
         %mk = scf.if %kon -> (i64) {{\n\
         {}\
         \x20 %kr = arith.subi %topk, %kac : i64\n  %krw = arith.muli %kr, %ktau : i64\n  %kmass = arith.addi %kam, %krw : i64\n\
         \x20 scf.yield %kmass : i64\n\
         }} else {{\n  scf.yield %total : i64\n}}\n",
        indent(&select("k", true, "%topk", width, nw), 2),
    ));
    // Top-p: the shortest prefix reaching ⌈mk · p⌉.
    d.push_str(&format!(
        "%pon = arith.cmpf olt, %topp, %fone : f32\n\
         %mp = scf.if %pon -> (i64) {{\n\
         \x20 %mkf = arith.uitofp %mk : i64 to f64\n  %ppf = arith.extf %topp : f32 to f64\n  %gp = arith.mulf %mkf, %ppf : f64\n\
         \x20 %gc = math.ceil %gp : f64\n  %goalp = arith.fptoui %gc : f64 to i64\n\
         {}\
         \x20 %pr = arith.subi %goalp, %pam : i64\n\
         {}\
         \x20 %prw = arith.muli %pdq, %ptau : i64\n  %pmass = arith.addi %pam, %prw : i64\n\
         \x20 scf.yield %pmass : i64\n\
         }} else {{\n  scf.yield %mk : i64\n}}\n",
        indent(&select("p", false, "%goalp", width, nw), 2),
        indent(&div_ceil("pd", "%pr", "%ptau"), 2),
    ));
    // The kept weight, the draw, and the token it lands on.
    d.push_str(
        "%mmin = arith.select %mpon, %fmass, %total : i64\n\
         %kk1 = arith.minui %mk, %mp : i64\n%kept = arith.minui %kk1, %mmin : i64\n\
         %rq0 = arith.trunci %req : i64 to i32\n%rqh = arith.shrui %req, %c32l : i64\n%rq1 = arith.trunci %rqh : i64 to i32\n\
         %st0 = arith.trunci %step : i64 to i32\n%sth = arith.shrui %step, %c32l : i64\n%st1 = arith.trunci %sth : i64 to i32\n\
         %sd0 = arith.trunci %seed : i64 to i32\n%sdh = arith.shrui %seed, %c32l : i64\n%sd1 = arith.trunci %sdh : i64 to i32\n",
    );
    d.push_str(&philox("ph", ["%rq0", "%rq1", "%st0", "%st1"], ["%sd0", "%sd1"]));
    d.push_str(&mul_hi("mh", "%kept", "%phbits"));
    d.push_str("%goald = arith.addi %mhhi, %c1l : i64\n");
    d.push_str(&select("dr", false, "%goald", width, nw));
    d.push_str("%gr = arith.subi %goald, %dram : i64\n");
    d.push_str(&div_ceil("gn", "%gr", "%drtau"));
    // The n-th (from 1) token of weight tau in id order: each thread counts
    // its own contiguous slice, the counts before it give its offset.
    d.push_str(&format!(
        "%lo0 = arith.muli %t, %cchunk : index\n%lo = arith.minui %lo0, %cw : index\n\
         %hi0 = arith.addi %lo, %cchunk : index\n%hi = arith.minui %hi0, %cw : index\n\
         %cnt = scf.for %i = %lo to %hi step %c1 iter_args(%n = %z32) -> (i32) {{\n\
         {}\
         \x20 %is = arith.cmpi eq, %cw_w, %drtau : i64\n  %isi = arith.extui %is : i1 to i32\n  %n2 = arith.addi %n, %isi : i32\n\
         \x20 scf.yield %n2 : i32\n\
         }}\n\
         memref.store %cnt, %tie[%t] : memref<{THREADS}xi32, #gpu.address_space<workgroup>>\n\
         gpu.barrier\n\
         %before = scf.for %u = %c0 to %t step %c1 iter_args(%b = %z64) -> (i64) {{\n\
         \x20 %tu = memref.load %tie[%u] : memref<{THREADS}xi32, #gpu.address_space<workgroup>>\n\
         \x20 %tul = arith.extui %tu : i32 to i64\n  %b2 = arith.addi %b, %tul : i64\n  scf.yield %b2 : i64\n\
         }}\n\
         %cntl = arith.extui %cnt : i32 to i64\n%upto = arith.addi %before, %cntl : i64\n\
         %afterb = arith.cmpi ugt, %gnq, %before : i64\n%within = arith.cmpi ule, %gnq, %upto : i64\n%mine = arith.andi %afterb, %within : i1\n\
         scf.if %mine {{\n\
         \x20 %want = arith.subi %gnq, %before : i64\n\
         \x20 %walk:2 = scf.for %i = %lo to %hi step %c1 iter_args(%seen_n = %z64, %pick = %z64) -> (i64, i64) {{\n\
         {}\
         \x20   %is2 = arith.cmpi eq, %cv_w, %drtau : i64\n\
         \x20   %isl = arith.extui %is2 : i1 to i64\n    %sn = arith.addi %seen_n, %isl : i64\n\
         \x20   %hitn = arith.cmpi eq, %sn, %want : i64\n    %now = arith.andi %is2, %hitn : i1\n\
         \x20   %il = arith.index_cast %i : index to i64\n    %np = arith.select %now, %il, %pick : i64\n\
         \x20   scf.yield %sn, %np : i64, i64\n\
         \x20 }}\n\
         \x20 memref.store %walk#1, %ids[%r] : memref<?xi64>\n\
         }}\n",
        indent(&weigh_at("cw_", "%i", width, nw), 2),
        indent(&weigh_at("cv_", "%i", width, nw), 4),
    ));
    d
}
