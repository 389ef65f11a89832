//! Causal GQA attention over the cache, with the MSA block selection
//! (MiniMax Sparse Attention's indexer) fused in when it is set.

use crate::builder::{warp_reduce, Reduce};
use crate::emit::{f32_lit, load_f32, load_f32xn, mul_add_yield, parallel_or_serial, store_f32};
use crate::gpu::{device_buffer, func, GpuCall, GpuFunc, GpuTarget};
use crate::host::{index_consts, BASICS};
use crate::unit::{param, KernelUnit, Launch, Param};
use crate::{indent, num_tag, Storage};

mod blocked;
mod head_pairs;
mod scores;

/// MiniMax Sparse Attention's block selection, as fixed by the config.
#[derive(Debug, Clone, Copy, PartialEq, PartialOrd)]
pub struct SparseSel {
    pub index_heads: usize,
    pub index_dim: usize,
    pub block: usize,
    pub topk: usize,
    /// The query's own block and the `local − 1` before it are always selected.
    pub local: usize,
    /// The first `init` blocks are always selected.
    pub init: usize,
}

/// Causal GQA attention over the cache; MSA block selection fused in when
/// `sparse` is set.
#[derive(Debug, Clone, Copy, PartialEq, PartialOrd)]
pub struct Attention {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub scale: f64,
    pub sparse: Option<SparseSel>,
    /// The keys live in a paged cache of blocks of this many positions:
    /// `k`, `v` (and `ik`) are the whole pools, and key `t` is row
    /// `bt[t / B]·B + t mod B` of them. None: `k`, `v` are plain rows
    /// (the vision tower's per-image keys).
    pub paged: Option<usize>,
    pub cache: Storage,
    pub act: Storage,
}

impl KernelUnit for Attention {
    fn symbol(&self) -> String {
        let Attention { heads, kv_heads, head_dim, scale, sparse, paged, cache, act } = self;
        let mut s = format!("m3c_attention_h{heads}_kv{kv_heads}_d{head_dim}_s{}", num_tag(*scale));
        if let Some(m) = sparse {
            s.push_str(&format!("_msa_ih{}_id{}_b{}_k{}_l{}_i{}", m.index_heads, m.index_dim, m.block, m.topk, m.local, m.init));
        }
        if let Some(b) = paged {
            s.push_str(&format!("_pg{b}"));
        }
        s.push_str(cache.suffix());
        s.push_str(act.act_suffix());
        s
    }
    fn params(&self) -> Vec<Param> {
        let Attention { heads, kv_heads, head_dim: d, sparse, paged, cache, act, .. } = self;
        let qt = act.rows_ty(heads * d);
        let kt = cache.rows_ty(kv_heads * d);
        let mut p = vec![param("q", &qt), param("k", &kt), param("v", &kt), param("pos", "memref<?xi64>")];
        if paged.is_some() {
            p.push(param("bt", "memref<?xi64>"));
        }
        if let Some(s) = sparse {
            p.push(param("iq", act.rows_ty(s.index_heads * s.index_dim)));
            p.push(param("ik", cache.rows_ty(s.index_dim)));
        }
        p.push(param("o", &qt));
        p
    }
    fn act(&self) -> Option<Storage> {
        Some(self.act)
    }
    fn host_body(&self) -> String {
        match self.sparse {
            None if self.head_dim.is_multiple_of(8) => blocked::host(self),
            _ => host(self),
        }
    }
    fn gpu_funcs(&self, target: &GpuTarget) -> Vec<GpuFunc> {
        vec![gpu_attention(target, &self.symbol(), self)]
    }
    /// A warp per (query row, KV group); sparse attention gets per-(row,
    /// group) block scores and selection flags in global scratch.
    fn launch(&self, l: &Launch) -> GpuCall {
        let (kv_heads, sparse) = (&self.kv_heads, &self.sparse);
        let (tag, rows, args, sym, one) = (l.tag, l.rows, l.args, self.symbol(), l.one());
        let (mut text, mut host_views) = (String::new(), Vec::new());

        text.push_str(&format!("%g{tag}_kv = arith.constant {kv_heads} : index\n"));
        let mut a = args.to_vec();
        if let Some(s) = sparse {
            // Per (row, group) block scores and selection flags, in global scratch.
            // The keys a row may see: the cache's rows, or, paged, its
            // block table's length in positions.
            let ctx = match self.paged {
                None => format!("%g{tag}_ctx = memref.dim {}, %g{tag}_c0 : {}\n", args[1].0, args[1].1),
                Some(b) => format!(
                    "%g{tag}_nbt = memref.dim {}, %g{tag}_c0 : memref<?xi64>\n\
                     %g{tag}_pb = arith.constant {b} : index\n\
                     %g{tag}_ctx = arith.muli %g{tag}_nbt, %g{tag}_pb : index\n",
                    args[4].0
                ),
            };
            text.push_str(&format!(
                "%g{tag}_c0 = arith.constant 0 : index\n\
                 {ctx}\
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
        text.push_str(&l.grid(&sym, [rows, &format!("%g{tag}_kv"), &one], l.target.warp, &a));
        if sparse.is_some() {
            text.push_str(&format!(
                "func.call @m3c_buf_free(%g{tag}_bs_p) : (!llvm.ptr) -> ()\nfunc.call @m3c_buf_free(%g{tag}_sel_p) : (!llvm.ptr) -> ()\n"
            ));
        }
        let mut call = l.call(text);
        call.host_views = host_views;
        call
    }
}

const NEG_INF: &str = "0xFF800000";
const POS_INF: &str = "0x7F800000";

/// Causal GQA attention of this step's queries over the whole cache, with the
/// MSA indexer fused in when `sparse` is set: per KV group, token scores
/// `<iq, ik>` max-pooled per key block, local/initial blocks forced, the
/// top-k blocks kept (score descending, lower block first on ties), and the
/// attention restricted to keys in selected blocks.
///
/// `q`, `o`: `[S, heads·d]`; `k`, `v`: `[T, kv_heads·d]` (the cache, this
/// step's rows already written; it may be longer, up to its capacity); query
/// row `r` sits at position `pos[r]` and sees keys `0..=pos[r]`.
/// Sparse: `iq`: `[S, index_heads·index_dim]`, `ik`: `[T, index_dim]`.
/// `q`, `o` and `iq` hold values stored as `act`; the output is accumulated
/// in f32 (in `o` itself when that is f32, else in scratch) and stored once.
fn host(k: &Attention) -> String {
    let Attention { heads, kv_heads, head_dim: d, scale, sparse, paged, cache, act } = *k;
    let group = heads / kv_heads;
    let qt = act.rows_ty(heads * d);
    let kt = cache.rows_ty(kv_heads * d);
    let mut setup = page_const(paged);
    let mut select = String::new();
    let mut allowed = String::from("%allowed = arith.constant true\n");
    let mut teardown = String::new();
    // MSA heads that go eight keys at a time visit only the batches that
    // hold a selected key (`%bl`, made once per KV group).
    let batches = d.is_multiple_of(8);
    // MSA's index scores in a phase of their own, every KV group of a row
    // at once ([`msa_scores`]), when the index width goes eight at a time.
    let phased = sparse.filter(|s| batches && s.index_dim.is_multiple_of(8));
    if let Some(s) = sparse {
        let msa;
        (msa, select, allowed, teardown) = msa_host(s, paged, cache, act, batches, phased.is_some());
        setup.push_str(&msa);
    }
    // Where P·V accumulates: `o` itself when it holds f32, else an f32 row
    // stored into `o` (rounded once) when the head is done.
    let acc_ty = format!("memref<{d}xf32>");
    let (acc, acc_mem, acc_idx, acc_alloc, acc_free, acc_out) = match act {
        Storage::F32 => ("%o", qt.as_str(), "%r, %oc", String::new(), String::new(), String::new()),
        Storage::Bf16 | Storage::Fp8 => (
            "%oacc",
            acc_ty.as_str(),
            "%c",
            format!("\x20 %oacc = memref.alloc() : {acc_ty}\n"),
            format!("\x20 memref.dealloc %oacc : {acc_ty}\n"),
            format!(
                "scf.for %c = %c0 to %cd step %c1 {{\n\
                 \x20 %oc = arith.addi %qb, %c : index\n\
                 \x20 %ov = memref.load %oacc[%c] : {acc_ty}\n\
                 {}\
                 }}\n",
                indent(&store_f32("%ov", "%o", &qt, "%r", "%oc", act), 2)
            ),
        ),
    };
    // The scores and softmax weights of one head into `%sc`, and their
    // `%sum`: eight keys at a time when the head width allows. (Dense
    // attention with such widths runs in `blocked`, never here.)
    let whole = sparse.is_some_and(|s| s.block.is_multiple_of(8));
    let softmax_in = |sc: &str| scores::softmax8((&qt, act), (&kt, cache), d, paged, &allowed, whole, sc);
    let pairs = head_pairs::pairs(k);
    let (sc_alloc, softmax) = if sparse.is_some() && d.is_multiple_of(8) {
        let second = if pairs { "%scb = memref.alloc(%nk8) : memref<?xf32>\n" } else { "" };
        (format!("{}%sc = memref.alloc(%nk8) : memref<?xf32>\n{second}", scores::batch_consts()), softmax_in("%sc"))
    } else {
        (format!("{}%sc = memref.alloc(%nk) : memref<?xf32>\n", scores::batch_consts()), softmax1(&qt, &kt, act, cache, d, paged, &allowed))
    };
    // The work of one (query row, KV group): what the parallel loop runs.
    // Rows in zig-zag order (0, S-1, 1, S-2, ...): a causal row's work grows
    // with its position, and the threads take contiguous runs of the
    // iterations, so each run then holds as much work as the next. Each
    // row's own sums are untouched.
    let row = match phased {
        None => zigzag("%ri", "%rows", "%r"),
        Some(_) => format!("{}%r = arith.addi %rc0, %lr : index\n", zigzag("%ri", "%crows", "%lr")),
    };
    let iteration = format!(
        "{row}\
         \x20 %p64 = memref.load %pos[%r] : memref<?xi64>\n\
         \x20 %p = arith.index_cast %p64 : i64 to index\n\
         \x20 %nk = arith.addi %p, %c1 : index\n\
         {sc_alloc}\
         {acc_alloc}\
         \x20 scf.execute_region {{\n\
         {select}\
         \x20   %kb = arith.muli %g, %cd : index\n\
         {heads}\
         \x20   memref.dealloc %sc : memref<?xf32>\n\
         {scb_free}\
         {acc_free}\
         {teardown}\
         \x20   scf.yield\n\
         \x20 }}\n\
",
        select = indent(&select, 4),
        heads = indent(
            &if pairs {
                head_pairs::heads(k, &softmax, &softmax_in("%scb"))
            } else {
                format!(
                    "scf.for %hh = %c0 to %cg step %c1 {{\n\
                     \x20 %gi = arith.muli %g, %cg : index\n\
                     \x20 %i = arith.addi %gi, %hh : index\n\
                     \x20 %qb = arith.muli %i, %cd : index\n\
                     {}\
                     \x20 %inv = arith.divf %one, %sum : f32\n\
                     {}\
                     {}\
                     }}\n",
                    indent(&softmax, 2),
                    indent(&pv(acc, acc_mem, acc_idx, &kt, d, cache, paged, sparse.is_some()), 2),
                    indent(&acc_out, 2),
                )
            },
            4
        ),
        scb_free = if pairs { "\x20   memref.dealloc %scb : memref<?xf32>\n" } else { "" },
        sc_alloc = indent(&sc_alloc, 2),
        acc_free = indent(&acc_free, 2),
        teardown = indent(&teardown, 4),
    );
    let idx0 = index_consts(&[("cg", group), ("ckv", kv_heads), ("cd", d), ("c2", 2)]);
    let body = format!(
        "{BASICS}\
         {idx0}\
         %scale = arith.constant {scale} : f32\n\
         %ninf = arith.constant {NEG_INF} : f32\n\
         {rows}\
         {setup}\
         {iters}\
         return\n",
        scale = f32_lit(scale),
        rows = rows_and_work(&qt, heads * d * 2),
        iters = match phased {
            None => parallel_or_serial("%work", &["%ri", "%g"], &["%c0", "%c0"], &["%rows", "%ckv"], &["%c1", "%c1"], &iteration),
            // Blocks of whole batches: the pass's rows attend in blocks.
            Some(s) if s.block.is_multiple_of(8) => {
                let (_, select, _, teardown) = msa_host(s, paged, cache, act, false, true);
                msa_phases(k, s, Attend::Blocks(&blocked::msa_block(k, s.block, &select, &teardown)))
            }
            Some(s) => msa_phases(k, s, Attend::Rows(&iteration)),
        },
    );
    body
}

/// Row `iv` of `n` in zig-zag order (0, n-1, 1, n-2, ...), named `out`: a
/// causal row's work grows with its position, and the threads take
/// contiguous runs of the iterations, so each run then holds as much work
/// as the next.
fn zigzag(iv: &str, n: &str, out: &str) -> String {
    format!(
        "%ri2 = arith.divui {iv}, %c2 : index\n\
         %rpar = arith.remui {iv}, %c2 : index\n\
         %rodd = arith.cmpi ne, %rpar, %c0 : index\n\
         %rlast = arith.subi {n}, %c1 : index\n\
         %rrev = arith.subi %rlast, %ri2 : index\n\
         {out} = arith.select %rodd, %rrev, %ri2 : index\n"
    )
}

/// Query rows a pass of the two MSA phases takes: its block scores
/// (`[rows, KV groups, blocks]` f32) stay small whatever the prompt
/// (2 MB at 64k positions in blocks of 128, four groups).
const MSA_ROWS: usize = 256;

/// How the second phase of [`msa_phases`] attends: MLIR for one (query
/// row `%ri`, KV group `%g`), or for one (KV group `%g`, block `%bki` of
/// `blocked::ROWS` rows) ([`blocked::msa_block`]).
enum Attend<'a> {
    Rows(&'a str),
    Blocks(&'a str),
}

/// MSA on the host in two phases per pass of [`MSA_ROWS`] query rows:
/// every row's block scores for all its KV groups ([`msa_scores`], in
/// `%bsall`), then iterations that select blocks from those scores and
/// attend (`attend`). Each row's scores are the chains the one-phase
/// kernel computes, so the same blocks are chosen.
fn msa_phases(k: &Attention, s: SparseSel, attend: Attend) -> String {
    let Attention { heads, kv_heads, head_dim: d, paged, cache, .. } = *k;
    let score = msa_scores(k, s);
    // The index keys every row scores against, transposed once for the
    // call (`%ikt`, see `scores::transpose_keys`) up to the last key any
    // row sees, when the call has 8 rows or more (`%transposed`): fewer
    // (a decode step's) would spend more on the transposition than it saves.
    let ck: String = (0..8).map(|j| format!("%ck{j} = arith.constant {j} : index\n")).collect();
    let transpose = format!(
        "%kall = scf.for %ka = %c0 to %rows step %c1 iter_args(%km = %c0) -> (index) {{\n\
         \x20 %kp64 = memref.load %pos[%ka] : memref<?xi64>\n\
         \x20 %kp = arith.index_cast %kp64 : i64 to index\n\
         \x20 %kn = arith.addi %kp, %c1 : index\n\
         \x20 %km2 = arith.maxui %km, %kn : index\n\
         \x20 scf.yield %km2 : index\n\
         }}\n\
         %c8t = arith.constant 8 : index\n\
         %c7t = arith.constant 7 : index\n\
         %transposed = arith.cmpi uge, %rows, %c8t : index\n\
         %kall7 = arith.addi %kall, %c7t : index\n\
         %nball0 = arith.divui %kall7, %c8t : index\n\
         %nball = arith.select %transposed, %nball0, %c0 : index\n\
         %iktb = arith.muli %nball, %cid : index\n\
         %iktn = arith.muli %iktb, %c8t : index\n\
         %ikt = memref.alloc(%iktn) : memref<?xf32>\n\
         %kallm1 = arith.subi %kall, %c1 : index\n\
         scf.execute_region {{\n\
         \x20 %c8 = arith.constant 8 : index\n\
         {}\
         {}\
         \x20 scf.yield\n\
         }}\n",
        indent(&ck, 2),
        indent(&scores::transpose_keys(("%ik", &cache.rows_ty(s.index_dim), cache), "%cid", "%ikt", "%nball", "%kallm1", paged), 2),
    );
    // KV group first, as in `blocked`: a thread's iterations go through
    // one group's keys and values at a time.
    let second = match attend {
        Attend::Rows(iteration) => phase("%awork", heads * d * 2, &["%g", "%ri"], &["%ckv", "%crows"], iteration),
        Attend::Blocks(block) => format!(
            "%cRB = arith.constant {} : index\n\
             %crowsr = arith.addi %crows, %cRB : index\n\
             %crowsr1 = arith.subi %crowsr, %c1 : index\n\
             %nblk = arith.divui %crowsr1, %cRB : index\n\
             {}",
            blocked::ROWS,
            phase("%awork", heads * d * 2, &["%g", "%bki"], &["%ckv", "%nblk"], block)
        ),
    };
    format!(
        "{transpose}\
         %cRC = arith.constant {MSA_ROWS} : index\n\
         scf.for %rc0 = %c0 to %rows step %cRC {{\n\
         \x20 %rc1a = arith.addi %rc0, %cRC : index\n\
         \x20 %rc1 = arith.minui %rc1a, %rows : index\n\
         \x20 %crows = arith.subi %rc1, %rc0 : index\n\
         \x20 // The most keys a row of the pass sees (rows of several sequences need not ascend).\n\
         \x20 %cmax = scf.for %li = %c0 to %crows step %c1 iter_args(%m = %c0) -> (index) {{\n\
         \x20   %mr = arith.addi %rc0, %li : index\n\
         \x20   %mp64 = memref.load %pos[%mr] : memref<?xi64>\n\
         \x20   %mp = arith.index_cast %mp64 : i64 to index\n\
         \x20   %mk = arith.addi %mp, %c1 : index\n\
         \x20   %m2 = arith.maxui %m, %mk : index\n\
         \x20   scf.yield %m2 : index\n\
         \x20 }}\n\
         \x20 %nbx = arith.addi %cmax, %cBm1 : index\n\
         \x20 %nbmax = arith.divui %nbx, %cB : index\n\
         \x20 %bsall = memref.alloc(%crows, %ckv, %nbmax) : memref<?x?x?xf32>\n\
         \x20 %keys = arith.muli %crows, %cmax : index\n\
         {}\
         {}\
         \x20 memref.dealloc %bsall : memref<?x?x?xf32>\n\
         }}\n\
         memref.dealloc %ikt : memref<?xf32>\n",
        indent(&phase("%swork", kv_heads * s.index_dim, &["%ri"], &["%crows"], &score), 2),
        indent(&second, 2),
    )
}

/// One phase of [`msa_phases`]: `body` over `ivs` from 0 to `ubs`, in
/// parallel when its work (`%keys` × `per_key` multiply-adds, named
/// `work`) pays, in a region of its own (each phase's loop names its
/// constants alike).
fn phase(work: &str, per_key: usize, ivs: &[&str], ubs: &[&str], body: &str) -> String {
    let zeros = vec!["%c0"; ivs.len()];
    let ones = vec!["%c1"; ivs.len()];
    format!(
        "{work}1 = arith.constant {per_key} : index\n\
         {work} = arith.muli %keys, {work}1 : index\n\
         scf.execute_region {{\n\
         {}\
         \x20 scf.yield\n\
         }}\n",
        indent(&parallel_or_serial(work, ivs, &zeros, ubs, &ones, body), 2)
    )
}

/// Phase 1 of [`msa_phases`] for pass row `%ri` (zig-zag, as `%lr`): the
/// token scores `<iq, ik>` of every KV group's index head over the row's
/// keys, max-pooled per block into `%bsall[%lr, group, block]` (-inf for a
/// block with no key of the row). The eight keys of a batch load and
/// transpose once for all the groups ([`scores::chains8_multi`]); each
/// score is the one fused multiply-add chain over the index width in
/// column order that the one-phase kernel ([`token_scores`]) and the GPU
/// compute, the order of the reference's `torch.matmul`.
fn msa_scores(k: &Attention, s: SparseSel) -> String {
    let Attention { kv_heads, paged, cache, act, .. } = *k;
    let (iqt, ikt) = (act.rows_ty(s.index_heads * s.index_dim), cache.rows_ty(s.index_dim));
    let heads: Vec<(String, String)> = (0..kv_heads).map(|g| ("%r".to_string(), format!("%iqb{g}"))).collect();
    let mut consts = String::new();
    let mut init = String::new();
    for g in 0..kv_heads {
        consts.push_str(&format!("%cgi{g} = arith.constant {g} : index\n%iqb{g} = arith.constant {} : index\n", g * s.index_dim));
        init.push_str(&format!("\x20 memref.store %ninf, %bsall[%lr, %cgi{g}, %b] : memref<?x?x?xf32>\n"));
    }
    // Keys transposed for the call (`%ikt`) where it has rows enough to
    // pay for the transposition, two batches at a time; else transposed
    // batch by batch in registers. The same chains either way, and each
    // batch's pooling is its own (a max, whatever the order).
    let n = heads.len();
    // The batch's keys (`scores::batch_keys`), then its scores pooled.
    let pooled = |src: &dyn Fn(usize) -> String, keys: bool| {
        let mut out = if keys { scores::batch_keys(paged) } else { String::new() };
        for g in 0..kv_heads {
            out.push_str(&pool_blocks(s.block, &src(g), &format!("g{g}"), ("%bsall", &format!("%lr, %cgi{g}, "), "memref<?x?x?xf32>")));
        }
        out
    };
    // Two batches a step; a row's odd last batch is scored twice (its
    // second copy unused) rather than given code of its own.
    let picked: String =
        (0..kv_heads).map(|g| format!("%pick{g} = arith.select %second, %ida#{}, %ida#{g} : vector<8xf32>\n", n + g)).collect();
    // Blocks of whole pairs of batches (the real 128): each block's max
    // is kept in registers across its batches and stored once, instead of
    // pooled batch by batch into `%bsall`; the same max of the same scores.
    let transposed = if s.block.is_multiple_of(16) {
        block_max_scores(kv_heads, &iqt, act, &heads)
    } else {
        format!(
            "%c16 = arith.constant 16 : index\n\
         scf.for %t0p = %c0 to %nk8 step %c16 {{\n\
         {pair}\
         {both}\
         \x20 %nbb = arith.select %two, %c2, %c1 : index\n\
         \x20 scf.for %bb = %c0 to %nbb step %c1 {{\n\
         \x20   %second = arith.cmpi ne, %bb, %c0 : index\n\
         \x20   %bofs = arith.muli %bb, %c8 : index\n\
         \x20   %t0 = arith.addi %t0p, %bofs : index\n\
         {picked}\
         {pool}\
         \x20 }}\n\
         }}\n",
            pair = indent(&pair_bases("%nk8"), 2),
            both = indent(&scores::chains8_multi_t("%ida", ("%iq", &iqt, act), &heads, "%ikt", &["%tbva", "%tbvb"], "%cid"), 2),
            picked = indent(&picked, 4),
            pool = indent(&pooled(&|g| format!("%pick{g}"), true), 4),
        )
    };
    let rowwise = format!(
        "scf.for %t0 = %c0 to %nk8 step %c8 {{\n\
         {}\
         {}\
         {}\
         }}\n",
        indent(&scores::batch_keys(paged), 2),
        indent(&scores::chains8_multi("%idr", ("%iq", &iqt, act), &heads, ("%ik", &ikt, cache, "%c0"), scores::key_rows(paged), "%cid"), 2),
        indent(&pooled(&|g| format!("%idr#{g}"), false), 2),
    );
    format!(
        "{}%r = arith.addi %rc0, %lr : index\n\
         %p64 = memref.load %pos[%r] : memref<?xi64>\n\
         %p = arith.index_cast %p64 : i64 to index\n\
         %nk = arith.addi %p, %c1 : index\n\
         {}\
         {consts}\
         %bq = arith.divui %p, %cB : index\n\
         %nb = arith.addi %bq, %c1 : index\n\
         scf.for %b = %c0 to %nb step %c1 {{\n\
         {init}\
         }}\n\
         scf.if %transposed {{\n\
         {}\
         }} else {{\n\
         {}\
         }}\n",
        zigzag("%ri", "%crows", "%lr"),
        scores::batch_consts(),
        indent(&transposed, 2),
        indent(&rowwise, 2),
    )
}

/// The two batches at `%t0p` and `%t0q` (`%two`: whether the second is
/// below `end`) and their first columns in `%ikt`, in vectors of eight:
/// `%tbva` and `%tbvb` (the first again when there is no second, a column
/// that can be loaded; its scores go unused).
fn pair_bases(end: &str) -> String {
    format!(
        "%t0q = arith.addi %t0p, %c8 : index\n\
         %two = arith.cmpi ult, %t0q, {end} : index\n\
         %tb8 = arith.divui %t0p, %c8 : index\n\
         %tbva = arith.muli %tb8, %cid : index\n\
         %tbvb1 = arith.addi %tbva, %cid : index\n\
         %tbvb = arith.select %two, %tbvb1, %tbva : index\n"
    )
}

/// MSA's index scores of row `%r` over keys transposed for the call
/// (`%ikt`), two batches of eight at a time ([`scores::chains8_multi_t`]),
/// for blocks of a multiple of 16 keys: per block, each KV group's scores
/// (keys past the row's last masked to -inf) fold into a vector max in
/// registers, reduced and stored into `%bsall[%lr, group, block]` once.
/// Max is exact and ignores order, so these are the bits of pooling batch
/// by batch.
fn block_max_scores(kv_heads: usize, iqt: &str, act: Storage, heads: &[(String, String)]) -> String {
    let v = "vector<8xf32>";
    let tys = vec![v; kv_heads].join(", ");
    let inits = (0..kv_heads).map(|g| format!("%bm{g} = %ninf8")).collect::<Vec<_>>().join(", ");
    let mut fold = String::new();
    for g in 0..kv_heads {
        fold.push_str(&format!(
            "%sa{g} = arith.select %lva, %ida#{g}, %ninf8 : vector<8xi1>, {v}\n\
             %sb{g} = arith.select %lvb, %ida#{}, %ninf8 : vector<8xi1>, {v}\n\
             %ma{g} = arith.maximumf %bm{g}, %sa{g} : {v}\n\
             %mb{g} = arith.maximumf %ma{g}, %sb{g} : {v}\n",
            kv_heads + g
        ));
    }
    let next = (0..kv_heads).map(|g| format!("%mb{g}")).collect::<Vec<_>>().join(", ");
    let store: String = (0..kv_heads)
        .map(|g| {
            format!(
                "%bred{g} = vector.reduction <maximumf>, %bmx#{g} : {v} into f32\n\
                 memref.store %bred{g}, %bsall[%lr, %cgi{g}, %b] : memref<?x?x?xf32>\n"
            )
        })
        .collect();
    format!(
        "%c16 = arith.constant 16 : index\n\
         %iota = arith.constant dense<[0, 1, 2, 3, 4, 5, 6, 7]> : vector<8xi32>\n\
         %nk32 = arith.index_cast %nk : index to i32\n\
         %nkv = vector.broadcast %nk32 : i32 to vector<8xi32>\n\
         scf.for %b = %c0 to %nb step %c1 {{\n\
         \x20 %bk0 = arith.muli %b, %cB : index\n\
         \x20 %bk1a = arith.addi %bk0, %cB : index\n\
         \x20 %bk1 = arith.minui %bk1a, %nk8 : index\n\
         \x20 %bmx:{kv_heads} = scf.for %t0p = %bk0 to %bk1 step %c16 iter_args({inits}) -> ({tys}) {{\n\
         {pair}\
         {chains}\
         \x20   // Lanes of keys the row sees; the second batch only if there is one.\n\
         \x20   %ta32 = arith.index_cast %t0p : index to i32\n\
         \x20   %tav = vector.broadcast %ta32 : i32 to vector<8xi32>\n\
         \x20   %kva = arith.addi %tav, %iota : vector<8xi32>\n\
         \x20   %lva = arith.cmpi slt, %kva, %nkv : vector<8xi32>\n\
         \x20   %tq32 = arith.index_cast %t0q : index to i32\n\
         \x20   %tqv = vector.broadcast %tq32 : i32 to vector<8xi32>\n\
         \x20   %kvb = arith.addi %tqv, %iota : vector<8xi32>\n\
         \x20   %lvb0 = arith.cmpi slt, %kvb, %nkv : vector<8xi32>\n\
         \x20   %twov = vector.broadcast %two : i1 to vector<8xi1>\n\
         \x20   %lvb = arith.andi %lvb0, %twov : vector<8xi1>\n\
         {fold}\
         \x20   scf.yield {next} : {tys}\n\
         \x20 }}\n\
         {store}\
         }}\n",
        pair = indent(&pair_bases("%bk1"), 4),
        chains = indent(&scores::chains8_multi_t("%ida", ("%iq", iqt, act), heads, "%ikt", &["%tbva", "%tbvb"], "%cid"), 4),
        fold = indent(&fold, 4),
        store = indent(&store, 2),
    )
}

/// `%rows` (query rows), `%ctx` (the keys the last row sees; the cache view
/// may be longer: its capacity) and `%work`, the multiply-adds that decide
/// whether the parallel loop pays (`per_key` per row and key).
fn rows_and_work(qt: &str, per_key: usize) -> String {
    format!(
        "%rows = memref.dim %q, %c0 : {qt}\n\
         %has_rows = arith.cmpi ugt, %rows, %c0 : index\n\
         %ctx = scf.if %has_rows -> (index) {{\n\
         \x20 %last = arith.subi %rows, %c1 : index\n\
         \x20 %lp64 = memref.load %pos[%last] : memref<?xi64>\n\
         \x20 %lp = arith.index_cast %lp64 : i64 to index\n\
         \x20 %lk = arith.addi %lp, %c1 : index\n\
         \x20 scf.yield %lk : index\n\
         }} else {{\n\
         \x20 scf.yield %c0 : index\n\
         }}\n\
         %work0 = arith.muli %rows, %ctx : index\n\
         %work1 = arith.constant {per_key} : index\n\
         %work = arith.muli %work0, %work1 : index\n"
    )
}

/// [`scores::softmax8`] one key at a time, for head widths that are not a
/// multiple of 8: fills `%sc` (`%nk` entries) and defines `%sum`.
fn softmax1(qt: &str, kt: &str, act: Storage, cache: Storage, d: usize, paged: Option<usize>, allowed: &str) -> String {
    let (row, tp) = key_row(paged, "%t", "%tp");
    format!(
        "%mx = scf.for %t = %c0 to %nk step %c1 iter_args(%m = %ninf) -> (f32) {{\n\
         {allowed}\
         \x20 %s = scf.if %allowed -> (f32) {{\n\
         {dot_qk}\
         \x20   %sd = arith.mulf %dot, %scale : f32\n\
         \x20   scf.yield %sd : f32\n\
         \x20 }} else {{\n\
         \x20   scf.yield %ninf : f32\n\
         \x20 }}\n\
         \x20 memref.store %s, %sc[%t] : memref<?xf32>\n\
         \x20 %m2 = arith.maximumf %m, %s : f32\n\
         \x20 scf.yield %m2 : f32\n\
         }}\n\
         %sum = scf.for %t = %c0 to %nk step %c1 iter_args(%a = %zero) -> (f32) {{\n\
         \x20 %s = memref.load %sc[%t] : memref<?xf32>\n\
         \x20 %sh = arith.subf %s, %mx : f32\n\
         \x20 %e = math.exp %sh : f32\n\
         \x20 memref.store %e, %sc[%t] : memref<?xf32>\n\
         \x20 %a2 = arith.addf %a, %e : f32\n\
         \x20 scf.yield %a2 : f32\n\
         }}\n",
        allowed = indent(allowed, 2),
        dot_qk = indent(&format!("{row}{}", dot("%dot", ("%q", qt, act), "%r", "%qb", ("%k", kt, cache), &tp, "%kb", "%cd", d)), 4),
    )
}

/// `dst` = Σ_c x[xr, xb + c] · y[yr, yb + c] over `len` (its index constant
/// `n`): eight lanes at a time when `len` allows (the lane sums are added at
/// the end), else one by one. `x` and `y` are (memref, type, storage).
#[allow(clippy::too_many_arguments)]
fn dot(
    dst: &str,
    x: (&str, &str, Storage),
    xr: &str,
    xb: &str,
    y: (&str, &str, Storage),
    yr: &str,
    yb: &str,
    n: &str,
    len: usize,
) -> String {
    let d = dst.trim_start_matches('%');
    let ((x, xt, xs), (y, yt, ycache)) = (x, y);
    if len.is_multiple_of(8) {
        format!(
            "%{d}_c8 = arith.constant 8 : index\n\
             %{d}_z = arith.constant dense<0.0> : vector<8xf32>\n\
             %{d}_v = scf.for %c = %c0 to {n} step %{d}_c8 iter_args(%a = %{d}_z) -> (vector<8xf32>) {{\n\
             \x20 %xc = arith.addi {xb}, %c : index\n\
             \x20 %yc = arith.addi {yb}, %c : index\n\
             {x8}\
             {y8}\
             {mac}\
             }}\n\
             {dst} = vector.reduction <add>, %{d}_v fastmath<reassoc> : vector<8xf32> into f32\n",
            x8 = indent(&load_f32xn(8, "%x1", x, xt, xr, "%xc", xs), 2),
            y8 = indent(&load_f32xn(8, "%x2", y, yt, yr, "%yc", ycache), 2),
            mac = indent(&mul_add_yield("%a", "%mm", "%x1", "%x2", "vector<8xf32>"), 2),
        )
    } else {
        format!(
            "{dst} = scf.for %c = %c0 to {n} step %c1 iter_args(%a = %zero) -> (f32) {{\n\
             \x20 %xc = arith.addi {xb}, %c : index\n\
             \x20 %yc = arith.addi {yb}, %c : index\n\
             {x1}\
             {y1}\
             {mac}\
             }}\n",
            x1 = indent(&load_f32("%x1", x, xt, xr, "%xc", xs), 2),
            y1 = indent(&load_f32("%x2", y, yt, yr, "%yc", ycache), 2),
            mac = indent(&mul_add_yield("%a", "%mm", "%x1", "%x2", "f32"), 2),
        )
    }
}

/// Vectors of 8 columns whose P·V sums one pass over the keys keeps in
/// registers, at most: with the key's weight and a V vector, 12 of AVX2's
/// 16.
const PV_VECTORS: usize = 10;

/// The widest chunk of P·V columns (in vectors of 8) that two rows
/// (`blocked`) or two heads (`head_pairs`) take together: both sets of
/// sums, the V vectors and the weights then fit AVX2's 16 registers.
pub(super) const PAIR_MAX_VECTORS: usize = 4;

/// P·V's column chunks of a head `d` wide (a multiple of 8), as (first
/// column, vectors): as few as [`PV_VECTORS`] allows, of even sizes. Each
/// of a chunk's sums gains one FMA per key, so a short chunk waits on the
/// FMA latency: the vision tower's 80 columns as 64 + 16 spent as long on
/// the 16 as on the 64; as one chunk of 80 they take one pass. A column's
/// sum is the same, in the same key order, in any chunk.
pub(super) fn pv_chunks(d: usize) -> Vec<(usize, usize)> {
    let vectors = d / 8;
    let n = vectors.div_ceil(PV_VECTORS).max(1);
    (0..n).map(|i| (8 * (vectors * i / n), vectors * (i + 1) / n - vectors * i / n)).collect()
}

/// `acc = Σ_t pw_t · v[t, kb + c]` over the head's columns, `pw_t` =
/// `sc[t] · inv`, in key order per column (a multiply, then an add; fused
/// where the CPU has FMA and the columns go eight at a time). `acc`
/// is the f32 memref the columns land in, indexed by `acc_idx` (written
/// with `%c`/`%oc`). When the head allows, eight columns at a time and up
/// to 80 at once ([`pv_chunks`]), the sums in registers across the keys and stored once:
/// the same operations in the same order as summing in memory. With
/// `skip_zero` (MSA), keys of weight exactly 0 (outside the selected
/// blocks) are skipped there.
#[allow(clippy::too_many_arguments)]
fn pv(acc: &str, acc_ty: &str, acc_idx: &str, kt: &str, d: usize, cache: Storage, paged: Option<usize>, skip_zero: bool) -> String {
    let (row, tp) = key_row(paged, "%t", "%tp");
    if !d.is_multiple_of(8) {
        let at = format!("{acc}[{acc_idx}]");
        return format!(
            "scf.for %c = %c0 to %cd step %c1 {{\n\
             \x20 %oc = arith.addi %qb, %c : index\n\
             \x20 memref.store %zero, {at} : {acc_ty}\n\
             }}\n\
             scf.for %t = %c0 to %nk step %c1 {{\n\
             \x20 %e = memref.load %sc[%t] : memref<?xf32>\n\
             \x20 %pw = arith.mulf %e, %inv : f32\n\
             {row}\
             \x20 scf.for %c = %c0 to %cd step %c1 {{\n\
             \x20   %oc = arith.addi %qb, %c : index\n\
             \x20   %vc = arith.addi %kb, %c : index\n\
             {v1}\
             \x20   %ov = memref.load {at} : {acc_ty}\n\
             \x20   %pvv = arith.mulf %pw, %vv : f32\n\
             \x20   %o2 = arith.addf %ov, %pvv : f32\n\
             \x20   memref.store %o2, {at} : {acc_ty}\n\
             \x20 }}\n\
             }}\n",
            v1 = indent(&load_f32("%vv", "%v", kt, &tp, "%vc", cache), 4),
            row = indent(&row, 2),
        );
    }
    let v8 = "vector<8xf32>";
    let (row, batch_row) = if skip_zero { msa_key_rows(paged) } else { (row, String::new()) };
    let mut out = format!("%pvz = arith.constant dense<0.0> : {v8}\n");
    for (chunk, (c0, nv)) in pv_chunks(d).into_iter().enumerate() {
        let tys = vec![v8; nv].join(", ");
        let mut body = String::new();
        for i in 0..nv {
            body.push_str(&format!("%pvc{i} = arith.constant {} : index\n%vc{i} = arith.addi %kb, %pvc{i} : index\n", c0 + 8 * i));
            body.push_str(&load_f32xn(8, &format!("%vv{i}"), "%v", kt, &tp, &format!("%vc{i}"), cache));
            body.push_str(&format!(
                "%pvv{i} = arith.mulf %pwv, %vv{i} fastmath<contract> : {v8}\n%o{i}n = arith.addf %o{i}, %pvv{i} fastmath<contract> : {v8}\n"
            ));
        }
        let inits = (0..nv).map(|i| format!("%o{i} = %pvz")).collect::<Vec<_>>().join(", ");
        let next = (0..nv).map(|i| format!("%o{i}n")).collect::<Vec<_>>().join(", ");
        let key = format!(
            "%pw = arith.mulf %e, %inv : f32\n\
             %pwv = vector.broadcast %pw : f32 to {v8}\n\
             {row}\
             {body}"
        );
        // MSA: keys outside the selected blocks (weight exactly 0) are
        // skipped rather than added as zeros.
        let key = if skip_zero {
            let old = (0..nv).map(|i| format!("%o{i}")).collect::<Vec<_>>().join(", ");
            let res = (0..nv).map(|i| format!("%pkr#{i}")).collect::<Vec<_>>().join(", ");
            format!(
                "%enz = arith.cmpf une, %e, %zero : f32\n\
                 %pkr:{nv} = scf.if %enz -> ({tys}) {{\n\
                 {}\
                 \x20 scf.yield {next} : {tys}\n\
                 }} else {{\n\
                 \x20 scf.yield {old} : {tys}\n\
                 }}\n\
                 scf.yield {res} : {tys}\n",
                indent(&key, 2)
            )
        } else {
            format!("{key}scf.yield {next} : {tys}\n")
        };
        let keys = |from: &str, to: &str, inits: &str| {
            format!(
                "scf.for %t = {from} to {to} step %c1 iter_args({inits}) -> ({tys}) {{\n\
                 \x20 %e = memref.load %sc[%t] : memref<?xf32>\n\
                 {}\
                 }}\n",
                indent(&key, 2)
            )
        };
        if skip_zero {
            // MSA: only the batches of eight keys that touch a selected
            // block (`%bl[0..%nbl]`, see `msa_host`); one of them whose
            // weights are all exactly 0 is passed over with one test, not
            // eight. `%sc` holds those batches' weights, padded with zeros
            // to a multiple of eight (`scores::softmax8`).
            let outer = (0..nv).map(|i| format!("%ob{i} = %pvz")).collect::<Vec<_>>().join(", ");
            let carried = (0..nv).map(|i| format!("%o{i} = %ob{i}")).collect::<Vec<_>>().join(", ");
            let pass = (0..nv).map(|i| format!("%ob{i}")).collect::<Vec<_>>().join(", ");
            let inner = (0..nv).map(|i| format!("%pin#{i}")).collect::<Vec<_>>().join(", ");
            let batch = (0..nv).map(|i| format!("%pbr#{i}")).collect::<Vec<_>>().join(", ");
            out.push_str(&format!(
                "%pacc{chunk}:{nv} = scf.for %tbi = %c0 to %nbl step %c1 iter_args({outer}) -> ({tys}) {{\n\
                 \x20 %tb0 = memref.load %bl[%tbi] : memref<?xindex>\n\
                 \x20 %ebv = vector.load %sc[%tb0] : memref<?xf32>, {v8}\n\
                 \x20 %ebnz = arith.cmpf une, %ebv, %z8 : {v8}\n\
                 \x20 %eany = vector.reduction <or>, %ebnz : vector<8xi1> into i1\n\
                 \x20 %pbr:{nv} = scf.if %eany -> ({tys}) {{\n\
                 {}\
                 \x20   %tb1a = arith.addi %tb0, %c8 : index\n\
                 \x20   %tb1 = arith.minui %tb1a, %nk : index\n\
                 \x20   %pin:{nv} = {}\
                 \x20   scf.yield {inner} : {tys}\n\
                 \x20 }} else {{\n\
                 \x20   scf.yield {pass} : {tys}\n\
                 \x20 }}\n\
                 \x20 scf.yield {batch} : {tys}\n\
                 }}\n",
                indent(&batch_row, 4),
                indent(&keys("%tb0", "%tb1", &carried), 4).trim_start()
            ));
        } else {
            out.push_str(&format!("%pacc{chunk}:{nv} = {}", keys("%c0", "%nk", &inits)));
        }
        // Each column's store in a region of its own, so `%c`/`%oc` (which
        // `acc_idx` names) can be defined once per store.
        for i in 0..nv {
            let col = c0 + 8 * i;
            out.push_str(&format!(
                "scf.execute_region {{\n\
                 \x20 %c = arith.constant {col} : index\n\
                 \x20 %oc = arith.addi %qb, %c : index\n\
                 \x20 vector.store %pacc{chunk}#{i}, {acc}[{acc_idx}] : {acc_ty}, {v8}\n\
                 \x20 scf.yield\n\
                 }}\n"
            ));
        }
    }
    out
}

/// MSA's P·V over batches of eight keys (`%tb0`): what each key `%t` runs
/// to define its pool row `%tp`, and what the batch runs once before its
/// keys. In a page that holds whole batches the batch's first pool row is
/// looked up once and the others follow it; otherwise each key looks its
/// own up ([`key_row`]).
fn msa_key_rows(paged: Option<usize>) -> (String, String) {
    if paged.is_some_and(|b| b.is_multiple_of(8)) {
        ("%tdo = arith.subi %t, %tb0 : index\n%tp = arith.addi %tpb0, %tdo : index\n".to_string(), key_row(paged, "%tb0", "%tpb0").0)
    } else {
        (key_row(paged, "%t", "%tp").0, String::new())
    }
}

/// Attention on the GPU: one warp per (query row, KV group). `q`, `iq` and
/// `o` hold values stored as `act`.
fn gpu_attention(target: &GpuTarget, name: &str, k: &Attention) -> GpuFunc {
    let Attention { heads, kv_heads, head_dim: d, scale, sparse, paged, cache, act } = *k;
    let (idx, warp) = (target.idx(), target.warp);
    let (row, tp) = key_row(paged, "%t", "%tp");
    let group = heads / kv_heads;
    let qt = act.rows_ty(heads * d);
    let kt = cache.rows_ty(kv_heads * d);
    let load = |dst: &str, mem: &str, ty: &str, r: &str, c: &str| crate::emit::load_f32(dst, mem, ty, r, c, cache);
    let mut params = format!("%q: {qt}, %k: {kt}, %v: {kt}, %pos: memref<?xi64>");
    if paged.is_some() {
        params.push_str(", %bt: memref<?xi64>");
    }
    let mut select = String::new();
    let mut allowed = "%allowed = arith.constant true\n".to_string();
    if let Some(s) = sparse {
        let iqt = act.rows_ty(s.index_heads * s.index_dim);
        let ikt = cache.rows_ty(s.index_dim);
        params.push_str(&format!(", %iq: {iqt}, %ik: {ikt}, %bs: memref<?xf32>, %sel: memref<?xi32>, %nbmax: index"));
        let wr0 = warp_reduce(warp, "%wm", Reduce::Max, "%best#0", "f32");
        let wr1 = warp_reduce(warp, "%win", Reduce::MinSi, "%cand", "i32");
        select = format!(
            "%cB = arith.constant {block} : index\n%cK = arith.constant {topk} : index\n%cid = arith.constant {id} : index\n\
             %clocal = arith.constant {local} : index\n%cinit = arith.constant {init} : index\n\
             %i0 = arith.constant 0 : i32\n%i1 = arith.constant 1 : i32\n%big = arith.constant 2147483647 : i32\n\
             %row0 = arith.muli %r, %ckv : index\n%row = arith.addi %row0, %g : index\n%rbase = arith.muli %row, %nbmax : index\n\
             %bq = arith.divui %p, %cB : index\n%nb = arith.addi %bq, %c1 : index\n%iqb = arith.muli %g, %cid : index\n\
             // Block scores: lane-strided blocks, max over the block's causal keys; each\n\
             // index score one fused multiply-add chain in column order, as the host's.\n\
             scf.for %b = %lane to %nb step %cwarp {{\n\
             \x20 %t0 = arith.muli %b, %cB : index\n  %t1a = arith.addi %t0, %cB : index\n  %t1 = arith.minui %t1a, %nk : index\n\
             \x20 %mx = scf.for %t = %t0 to %t1 step %c1 iter_args(%m = %ninf) -> (f32) {{\n\
             {ik_row}\
             \x20   %dot = scf.for %c = %c0 to %cid step %c1 iter_args(%a = %zero) -> (f32) {{\n\
             \x20     %qc = arith.addi %iqb, %c : index\n{iq_load}{ik_load}\
             \x20     %a2 = math.fma %x1, %x2, %a : f32\n      scf.yield %a2 : f32\n    }}\n\
             \x20   %m2 = arith.maximumf %m, %dot : f32\n    scf.yield %m2 : f32\n  }}\n\
             \x20 %bl = arith.addi %b, %clocal : index\n  %isloc = arith.cmpi ugt, %bl, %bq : index\n  %isinit = arith.cmpi ult, %b, %cinit : index\n\
             \x20 %forced = arith.ori %isloc, %isinit : i1\n  %val = arith.select %forced, %pinf, %mx : f32\n\
             \x20 %at = arith.addi %rbase, %b : index\n  memref.store %val, %bs[%at] : memref<?xf32>\n  memref.store %i0, %sel[%at] : memref<?xi32>\n\
             }}\n\
             gpu.barrier\n\
             // Top-k by repeated warp argmax; ties go to the lower block.\n\
             scf.for %s = %c0 to %cK step %c1 {{\n\
             \x20 %best:2 = scf.for %b = %lane to %nb step %cwarp iter_args(%bv = %ninf, %bi = %nb) -> (f32, index) {{\n\
             \x20   %at = arith.addi %rbase, %b : index\n    %tk = memref.load %sel[%at] : memref<?xi32>\n    %free = arith.cmpi eq, %tk, %i0 : i32\n\
             \x20   %x = memref.load %bs[%at] : memref<?xf32>\n    %gt = arith.cmpf ogt, %x, %bv : f32\n    %ok = arith.andi %free, %gt : i1\n\
             \x20   %nv = arith.select %ok, %x, %bv : f32\n    %ni = arith.select %ok, %b, %bi : index\n    scf.yield %nv, %ni : f32, index\n  }}\n\
             \x20 {wr0}\
             \x20 %mine = arith.cmpf oeq, %best#0, %wm : f32\n  %bi32 = arith.index_cast %best#1 : index to i32\n\
             \x20 %cand = arith.select %mine, %bi32, %big : i32\n  {wr1}\
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
            ik_load = indent(&load("%x2", "%ik", &ikt, &tp, "%c"), 6),
            ik_row = indent(&row, 4),
        );
        allowed = "%tb = arith.divui %t, %cB : index\n%at = arith.addi %rbase, %tb : index\n%sv = memref.load %sel[%at] : memref<?xi32>\n%allowed = arith.cmpi ne, %sv, %i0 : i32\n".into();
    }
    params.push_str(&format!(", %o: {qt}"));
    // The lane's output accumulator, in private memory.
    let acc_ty = if target.explicit_private { format!("memref<{d}xf32, #gpu.address_space<private>>") } else { format!("memref<{d}xf32>") };
    let acc = format!("%acc = memref.alloca() : {acc_ty}\n");
    let wr2 = warp_reduce(warp, "%gm", Reduce::Max, "%ml#0", "f32");
    let wr3 = warp_reduce(warp, "%gl", Reduce::Add, "%lf", "f32");
    let wr4 = warp_reduce(warp, "%sum", Reduce::Add, "%af", "f32");
    let body = format!(
        "{idx}%r = gpu.block_id x\n%g = gpu.block_id y\n%lane = gpu.thread_id x\n\
         %cg = arith.constant {group} : index\n%ckv = arith.constant {kv_heads} : index\n%cd = arith.constant {d} : index\n\
         %scale = arith.constant {sc} : f32\n\
         {pconst}\
         {acc_entry}\
         %p64 = memref.load %pos[%r] : memref<?xi64>\n%p = arith.index_cast %p64 : i64 to index\n%nk = arith.addi %p, %c1 : index\n\
         {select}\
         %kb = arith.muli %g, %cd : index\n\
         {acc_after}\
         scf.for %hh = %c0 to %cg step %c1 {{\n\
         \x20 %gi = arith.muli %g, %cg : index\n  %i = arith.addi %gi, %hh : index\n  %qb = arith.muli %i, %cd : index\n\
         \x20 scf.for %c = %c0 to %cd step %c1 {{\n    memref.store %zero, %acc[%c] : {acc_ty}\n  }}\n\
         \x20 // Online softmax over this lane's keys.\n\
         \x20 %ml:2 = scf.for %t = %lane to %nk step %cwarp iter_args(%m = %ninf, %l = %zero) -> (f32, f32) {{\n\
         {allowed}\
         \x20   %res:2 = scf.if %allowed -> (f32, f32) {{\n\
         {kv_row}\
         \x20     %dot = scf.for %c = %c0 to %cd step %c1 iter_args(%a = %zero) -> (f32) {{\n\
         \x20       %qc = arith.addi %qb, %c : index\n        %kc = arith.addi %kb, %c : index\n\
         {q_load}{k_load}\
         \x20       %mm = arith.mulf %x1, %x2 : f32\n        %a2 = arith.addf %a, %mm : f32\n        scf.yield %a2 : f32\n      }}\n\
         \x20     %s = arith.mulf %dot, %scale : f32\n      %m2 = arith.maximumf %m, %s : f32\n\
         \x20     %dm = arith.subf %m, %m2 : f32\n      %cold = math.exp %dm : f32\n      %ds = arith.subf %s, %m2 : f32\n      %pw = math.exp %ds : f32\n\
         \x20     %lc = arith.mulf %l, %cold : f32\n      %l2 = arith.addf %lc, %pw : f32\n\
         \x20     scf.for %c = %c0 to %cd step %c1 {{\n\
         \x20       %vc = arith.addi %kb, %c : index\n{v_load}        %av = memref.load %acc[%c] : {acc_ty}\n\
         \x20       %a1 = arith.mulf %av, %cold : f32\n        %pv = arith.mulf %pw, %vv : f32\n        %a2 = arith.addf %a1, %pv : f32\n\
         \x20       memref.store %a2, %acc[%c] : {acc_ty}\n      }}\n\
         \x20     scf.yield %m2, %l2 : f32, f32\n    }} else {{\n      scf.yield %m, %l : f32, f32\n    }}\n\
         \x20   scf.yield %res#0, %res#1 : f32, f32\n  }}\n\
         \x20 // Merge the lanes: one max, rescaled sums.\n\
         \x20 {wr2}\
         \x20 %dl = arith.subf %ml#0, %gm : f32\n  %f = math.exp %dl : f32\n  %lf = arith.mulf %ml#1, %f : f32\n\
         \x20 {wr3}  %inv = arith.divf %one, %gl : f32\n\
         \x20 %lead = arith.cmpi eq, %lane, %c0 : index\n\
         \x20 scf.for %c = %c0 to %cd step %c1 {{\n\
         \x20   %av = memref.load %acc[%c] : {acc_ty}\n    %af = arith.mulf %av, %f : f32\n\
         \x20   {wr4}    %ov = arith.mulf %sum, %inv : f32\n\
         \x20   scf.if %lead {{\n      %oc = arith.addi %qb, %c : index\n{o_store}    }}\n  }}\n\
         }}\n",
        sc = f32_lit(scale),
        allowed = indent(&allowed, 4),
        q_load = indent(&load_f32("%x1", "%q", &qt, "%r", "%qc", act), 8),
        o_store = indent(&store_f32("%ov", "%o", &qt, "%r", "%oc", act), 6),
        k_load = indent(&load("%x2", "%k", &kt, &tp, "%kc"), 8),
        v_load = indent(&load("%vv", "%v", &kt, &tp, "%vc"), 8),
        kv_row = indent(&row, 6),
        pconst = page_const(paged),
        acc_entry = if target.explicit_private { &acc } else { "" },
        acc_after = if target.explicit_private { "" } else { &acc },
    );
    func(target, name, &params, &body, warp)
}

/// MSA's token scores `<iq, ik>` of keys `0..%nk`, max-pooled into `%bs`
/// per key block: eight keys at a time ([`scores::chains8`]) when the
/// index width allows, else key by key. Either way each score is one fused
/// multiply-add chain over the index width in column order, the order of
/// the reference's `torch.matmul` (a GEMM's inner loop), so a block choice
/// that hangs on the last bit of a score falls as the reference's does;
/// the GPU kernel computes the same chain.
fn token_scores(s: SparseSel, paged: Option<usize>, iq: (&str, Storage), ik: (&str, Storage)) -> String {
    let ((iqt, act), (ikt, cache)) = (iq, ik);
    if !s.index_dim.is_multiple_of(8) {
        let (row, tp) = key_row(paged, "%t", "%tp");
        return format!(
            "scf.for %t = %c0 to %nk step %c1 {{\n\
             {}\
             \x20 %b = arith.divui %t, %cB : index\n\
             \x20 %old = memref.load %bs[%b] : memref<?xf32>\n\
             \x20 %mx = arith.maximumf %old, %dot : f32\n\
             \x20 memref.store %mx, %bs[%b] : memref<?xf32>\n\
             }}\n",
            indent(
                &format!(
                    "{row}%dot = scf.for %c = %c0 to %cid step %c1 iter_args(%a = %zero) -> (f32) {{\n\
                     \x20 %qc = arith.addi %iqb, %c : index\n\
                     {}{}\
                     \x20 %a2 = math.fma %x1, %x2, %a : f32\n\
                     \x20 scf.yield %a2 : f32\n\
                     }}\n",
                    indent(&crate::emit::load_f32("%x1", "%iq", iqt, "%r", "%qc", act), 2),
                    indent(&crate::emit::load_f32("%x2", "%ik", ikt, &tp, "%c", cache), 2),
                ),
                2
            )
        );
    }
    let pool = pool_blocks(s.block, "%idv", "", ("%bs", "", "memref<?xf32>"));
    let body = format!(
        "{}{}{}{pool}",
        scores::batch_keys(paged),
        scores::chains8("%idv", ("%iq", iqt, act, "%r", "%iqb"), ("%ik", ikt, cache, "%c0"), scores::key_rows(paged), "%cid"),
        "",
    );
    format!("scf.for %t0 = %c0 to %nk8 step %c8 {{\n{}}}\n", indent(&body, 2))
}

/// Max-pools the batch at `%t0`'s eight index scores (`src`, keys past
/// the row's last excluded) into their blocks' scores, block `b`'s at
/// `{bs}[{at}b] : {ty}` (names suffixed `tag`). Where blocks and batches
/// nest (a block of 8·n keys holds whole batches; a batch holds whole
/// blocks of 1, 2 or 4), each block's lanes reduce in-register and update
/// its score once, not once per key. Max is exact and ignores order, so
/// the scores are the same bits either way.
fn pool_blocks(block: usize, src: &str, tag: &str, (bs, at, ty): (&str, &str, &str)) -> String {
    // Group `g` of `width` lanes: its block, if its first key is the row's.
    let update = |g: usize, width: usize, value: &str| {
        let first = g * width;
        format!(
            "scf.if %in{first} {{\n\
             \x20 %ib{tag}_{g} = arith.divui %tu{first}, %cB : index\n\
             \x20 %iold{tag}_{g} = memref.load {bs}[{at}%ib{tag}_{g}] : {ty}\n\
             \x20 %imx{tag}_{g} = arith.maximumf %iold{tag}_{g}, {value} : f32\n\
             \x20 memref.store %imx{tag}_{g}, {bs}[{at}%ib{tag}_{g}] : {ty}\n\
             }}\n"
        )
    };
    if !(block.is_multiple_of(8) || 8 % block == 0) {
        // Blocks that straddle batches: key by key.
        return (0..8)
            .map(|j| {
                format!("%id{tag}_{j} = vector.extract {src}[{j}] : f32 from vector<8xf32>\n{}", update(j, 1, &format!("%id{tag}_{j}")))
            })
            .collect();
    }
    let width = block.min(8);
    let mask = (0..8).map(|j| format!("%in{j}")).collect::<Vec<_>>().join(", ");
    let mut out = format!(
        "%ipm{tag} = vector.from_elements {mask} : vector<8xi1>\n\
         %ipv{tag} = arith.select %ipm{tag}, {src}, %ninf8 : vector<8xi1>, vector<8xf32>\n"
    );
    for g in 0..8 / width {
        let lanes = if width == 8 {
            format!("%ipv{tag}")
        } else {
            out.push_str(&format!(
                "%ipg{tag}_{g} = vector.extract_strided_slice %ipv{tag} {{offsets = [{}], sizes = [{width}], strides = [1]}} : vector<8xf32> to vector<{width}xf32>\n",
                g * width
            ));
            format!("%ipg{tag}_{g}")
        };
        out.push_str(&format!("%ipr{tag}_{g} = vector.reduction <maximumf>, {lanes} : vector<{width}xf32> into f32\n"));
        out.push_str(&update(g, width, &format!("%ipr{tag}_{g}")));
    }
    out
}

/// The host attention's MSA block selection for one (query row, KV group):
/// constants (`setup`), the block scores and top-k (`select`), the per-key
/// test (`allowed`) and the scratch release (`teardown`). With `batches`,
/// `select` also lists the eight-key batches that touch a selected block,
/// in key order: their first keys in `%bl[0..%nbl]` (it needs
/// [`scores::batch_consts`]). The rest of a long context is -inf and weight
/// 0, so passing it over changes no sum: each batch's keys would have added
/// exact zeros.
fn msa_host(
    s: SparseSel,
    paged: Option<usize>,
    cache: Storage,
    act: Storage,
    batches: bool,
    scored: bool,
) -> (String, String, String, String) {
    let (setup, mut select, allowed, mut teardown): (String, String, String, String);

    let iqt = act.rows_ty(s.index_heads * s.index_dim);
    let ikt = cache.rows_ty(s.index_dim);
    let idx1 = index_consts(&[
        ("cB", s.block),
        ("cBm1", s.block - 1),
        ("cK", s.topk),
        ("cid", s.index_dim),
        ("clocal", s.local),
        ("cinit", s.init),
    ]);
    setup = format!(
        "{idx1}\
             %pinf = arith.constant {POS_INF} : f32\n\
             %i32_0 = arith.constant 0 : i32\n\
             %i32_1 = arith.constant 1 : i32\n"
    );
    teardown = "memref.dealloc %bs : memref<?xf32>\nmemref.dealloc %sel : memref<?xi32>\n".into();
    select = format!(
        "%bq = arith.divui %p, %cB : index\n\
             %nb = arith.addi %bq, %c1 : index\n\
             %bs = memref.alloc(%nb) : memref<?xf32>\n\
             %sel = memref.alloc(%nb) : memref<?xi32>\n\
             scf.for %b = %c0 to %nb step %c1 {{\n\
             \x20 memref.store %ninf, %bs[%b] : memref<?xf32>\n\
             \x20 memref.store %i32_0, %sel[%b] : memref<?xi32>\n\
             }}\n\
             {token_scores}\
             // Forced blocks: the query's own (and `local - 1` before it), and the first `init`.\n\
             %nloc = arith.minui %clocal, %nb : index\n\
             scf.for %j = %c0 to %nloc step %c1 {{\n\
             \x20 %b = arith.subi %bq, %j : index\n\
             \x20 memref.store %pinf, %bs[%b] : memref<?xf32>\n\
             }}\n\
             %ninit = arith.minui %cinit, %nb : index\n\
             scf.for %b = %c0 to %ninit step %c1 {{\n\
             \x20 memref.store %pinf, %bs[%b] : memref<?xf32>\n\
             }}\n\
             // Top-k by repeated argmax: strict `>` keeps the lower block on ties,\n\
             // and a block still at -inf (no causal key) is never taken.\n\
             scf.for %s = %c0 to %cK step %c1 {{\n\
             \x20 %best:2 = scf.for %b = %c0 to %nb step %c1 iter_args(%bv = %ninf, %bi = %nb) -> (f32, index) {{\n\
             \x20   %taken = memref.load %sel[%b] : memref<?xi32>\n\
             \x20   %free = arith.cmpi eq, %taken, %i32_0 : i32\n\
             \x20   %bsv = memref.load %bs[%b] : memref<?xf32>\n\
             \x20   %gt = arith.cmpf ogt, %bsv, %bv : f32\n\
             \x20   %ok = arith.andi %free, %gt : i1\n\
             \x20   %nv = arith.select %ok, %bsv, %bv : f32\n\
             \x20   %ni = arith.select %ok, %b, %bi : index\n\
             \x20   scf.yield %nv, %ni : f32, index\n\
             \x20 }}\n\
             \x20 %found = arith.cmpi ult, %best#1, %nb : index\n\
             \x20 scf.if %found {{\n\
             \x20   memref.store %i32_1, %sel[%best#1] : memref<?xi32>\n\
             \x20 }}\n\
             }}\n",
        token_scores = if scored {
            // Phase 1 scored every KV group of the row ([`msa_scores`]).
            "scf.for %b = %c0 to %nb step %c1 {\n\
             \x20 %bsv = memref.load %bsall[%lr, %g, %b] : memref<?x?x?xf32>\n\
             \x20 memref.store %bsv, %bs[%b] : memref<?xf32>\n\
             }\n"
            .to_string()
        } else {
            format!("%iqb = arith.muli %g, %cid : index\n{}", token_scores(s, paged, (&iqt, act), (&ikt, cache)))
        },
    );
    allowed = "%tb = arith.divui %t, %cB : index\n\
                   %sv = memref.load %sel[%tb] : memref<?xi32>\n\
                   %allowed = arith.cmpi ne, %sv, %i32_0 : i32\n"
        .into();
    if batches {
        // Batch `%t0`'s keys `%t0..=min(%t0 + 7, %nkm1)` lie in blocks
        // `%t0 / B ..= that / B`, all below `%nb`.
        select.push_str(
            "%bl = memref.alloc(%nkb) : memref<?xindex>\n\
             %nbl = scf.for %t0 = %c0 to %nk8 step %c8 iter_args(%bn = %c0) -> (index) {\n\
             \x20 %bt_hi0 = arith.addi %t0, %c7 : index\n\
             \x20 %bt_hi = arith.minui %bt_hi0, %nkm1 : index\n\
             \x20 %bb_lo = arith.divui %t0, %cB : index\n\
             \x20 %bb_hi0 = arith.divui %bt_hi, %cB : index\n\
             \x20 %bb_hi = arith.addi %bb_hi0, %c1 : index\n\
             \x20 %bfalse = arith.constant false\n\
             \x20 %bany = scf.for %bb = %bb_lo to %bb_hi step %c1 iter_args(%ba = %bfalse) -> (i1) {\n\
             \x20   %bsv = memref.load %sel[%bb] : memref<?xi32>\n\
             \x20   %bsel = arith.cmpi ne, %bsv, %i32_0 : i32\n\
             \x20   %ba2 = arith.ori %ba, %bsel : i1\n\
             \x20   scf.yield %ba2 : i1\n\
             \x20 }\n\
             \x20 %bn2 = scf.if %bany -> (index) {\n\
             \x20   memref.store %t0, %bl[%bn] : memref<?xindex>\n\
             \x20   %bn1 = arith.addi %bn, %c1 : index\n\
             \x20   scf.yield %bn1 : index\n\
             \x20 } else {\n\
             \x20   scf.yield %bn : index\n\
             \x20 }\n\
             \x20 scf.yield %bn2 : index\n\
             }\n",
        );
        teardown.push_str("memref.dealloc %bl : memref<?xindex>\n");
    }

    (setup, select, allowed, teardown)
}

/// `%cPB`, the block size of a paged cache (nothing when unpaged).
fn page_const(paged: Option<usize>) -> String {
    paged.map_or(String::new(), |b| format!("%cPB = arith.constant {b} : index\n"))
}

/// The cache row that holds key `t`, named `out`: `t` itself in plain
/// rows, else row `bt[t / B]·B + t mod B` of the pool (the MLIR that
/// computes it comes first; it needs `%bt` and [`page_const`]'s `%cPB`).
/// Returns (that MLIR, the row's name).
pub(super) fn key_row(paged: Option<usize>, t: &str, out: &str) -> (String, String) {
    if paged.is_none() {
        return (String::new(), t.to_string());
    }
    let o = out.trim_start_matches('%');
    (
        format!(
            "%{o}_b = arith.divui {t}, %cPB : index\n\
             %{o}_o = arith.remui {t}, %cPB : index\n\
             %{o}_e64 = memref.load %bt[%{o}_b] : memref<?xi64>\n\
             %{o}_e = arith.index_cast %{o}_e64 : i64 to index\n\
             %{o}_s = arith.muli %{o}_e, %cPB : index\n\
             {out} = arith.addi %{o}_s, %{o}_o : index\n"
        ),
        out.to_string(),
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn pv_chunks_are_few_and_even() {
        assert_eq!(super::pv_chunks(32), [(0, 4)]);
        assert_eq!(super::pv_chunks(80), [(0, 10)]);
        assert_eq!(super::pv_chunks(96), [(0, 6), (48, 6)]);
        assert_eq!(super::pv_chunks(128), [(0, 8), (64, 8)]);
        assert_eq!(super::pv_chunks(168), [(0, 7), (56, 7), (112, 7)]);
    }
}
