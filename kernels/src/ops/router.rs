//! The MoE router, in f32: `s = σ(h Wᵀ)`, top-k of `s + bias` (the bias
//! only selects; first index on ties), weights `scale · s[idx] / Σ s[idx]`.

use crate::emit::{f32_lit, load_f32, load_weight_f32, parallel_or_serial};
use crate::gpu::{func_shared, warp_dots, GpuCall, GpuFunc, GpuTarget, WeightArgs};
use crate::host::{index_consts, BASICS};
use crate::unit::{param, params_text, KernelUnit, Launch, Param};
use crate::{indent, num_tag, Storage, WeightType};

/// `h`: `[S, width]`, `w`: `[experts, width]`, `bias`: `[experts]`; out:
/// `wts` `[S, k]` f32 and `ids` `[S, k]` i64, in selection order.
#[derive(Debug, Clone, PartialEq, PartialOrd)]
pub struct Router {
    pub width: usize,
    pub experts: usize,
    pub top_k: usize,
    pub scale: f64,
    pub weight: WeightType,
    pub bias: Option<WeightType>,
    pub act: Storage,
}

impl KernelUnit for Router {
    fn symbol(&self) -> String {
        let Router { width, experts, top_k, scale, weight, bias, act } = self;
        format!(
            "m3c_router_w{width}_e{experts}_k{top_k}_s{}_{}{}{}",
            num_tag(*scale),
            weight.tag(),
            bias.map_or(String::new(), |b| format!("_bias{}", b.tag())),
            act.act_suffix()
        )
    }
    fn params(&self) -> Vec<Param> {
        let Router { width, experts, top_k, weight, bias, act, .. } = self;
        let mut p = vec![param("h", act.rows_ty(*width)), param("w", weight.memref(&[*experts, *width]))];
        if let Some(bt) = bias {
            p.push(param("bias", format!("memref<{experts}x{}>", bt.mlir_elem())));
        }
        p.push(param("wts", format!("memref<?x{top_k}xf32>")));
        p.push(param("ids", format!("memref<?x{top_k}xi64>")));
        p
    }
    fn act(&self) -> Option<Storage> {
        Some(self.act)
    }
    /// The MoE router, in f32: `s = σ(h Wᵀ)`, top-k of `s + bias` (the bias only
    /// selects; first index on ties), weights `scale · s[idx] / Σ s[idx]`.
    /// Whatever the scores, the k ids are distinct and in range: a NaN score
    /// ranks as -inf, and each round takes the first free expert unless a
    /// later one scores strictly higher (the routed experts index by these ids).
    /// `h`: `[S, width]`, `w`: `[experts, width]`, `bias`: `[experts]`;
    /// out: `wts` `[S, k]` f32 and `ids` `[S, k]` i64, in selection order.
    /// `h` holds values stored as `act`.
    fn host_body(&self) -> String {
        let Router { width, experts, top_k: k, scale, weight, bias, act } = *self;
        let ht = act.rows_ty(width);
        let wt = weight.memref(&[experts, width]);
        let wts = format!("memref<?x{k}xf32>");
        let ids = format!("memref<?x{k}xi64>");
        let add_bias = match bias {
            Some(bt) => {
                let bty = format!("memref<{experts}x{}>", bt.mlir_elem());
                format!("{}%ch = arith.addf %sg, %bv : f32\n", load_weight_f32("%bv", "%bias", "%e", &bty, bt))
            }
            None => "%ch = arith.addf %sg, %zero : f32\n".into(),
        };
        // One token: logits, sigmoid, top-k, renormalised weights.
        let row = format!(
            "%s = memref.alloc() : memref<{experts}xf32>\n\
             %choice = memref.alloc() : memref<{experts}xf32>\n\
             %taken = memref.alloc() : memref<{experts}xi32>\n\
             \x20 scf.for %e = %c0 to %ce step %c1 {{\n\
             \x20   %l = scf.for %i = %c0 to %cw step %c1 iter_args(%a = %zero) -> (f32) {{\n\
             {xload}\
             {wload}\
             \x20     %m = arith.mulf %xv, %wv : f32\n\
             \x20     %a2 = arith.addf %a, %m : f32\n\
             \x20     scf.yield %a2 : f32\n\
             \x20   }}\n\
             \x20   %nl = arith.negf %l : f32\n\
             \x20   %ex = math.exp %nl : f32\n\
             \x20   %den = arith.addf %one, %ex : f32\n\
             \x20   %sg = arith.divf %one, %den : f32\n\
             \x20   memref.store %sg, %s[%e] : memref<{experts}xf32>\n\
             {add_bias}\
             \x20   memref.store %ch, %choice[%e] : memref<{experts}xf32>\n\
             \x20   memref.store %i32_0, %taken[%e] : memref<{experts}xi32>\n\
             \x20 }}\n\
             \x20 %sum = scf.for %j = %c0 to %ck step %c1 iter_args(%acc = %zero) -> (f32) {{\n\
             \x20   %best:2 = scf.for %e = %c0 to %ce step %c1 iter_args(%bv = %ninf, %bi = %ce) -> (f32, index) {{\n\
             \x20     %t = memref.load %taken[%e] : memref<{experts}xi32>\n\
             \x20     %free = arith.cmpi eq, %t, %i32_0 : i32\n\
             \x20     %v0 = memref.load %choice[%e] : memref<{experts}xf32>\n\
             \x20     %isnan = arith.cmpf uno, %v0, %v0 : f32\n\
             \x20     %v = arith.select %isnan, %ninf, %v0 : f32\n\
             \x20     %gt = arith.cmpf ogt, %v, %bv : f32\n\
             \x20     %none = arith.cmpi eq, %bi, %ce : index\n\
             \x20     %better = arith.ori %gt, %none : i1\n\
             \x20     %ok = arith.andi %free, %better : i1\n\
             \x20     %nv = arith.select %ok, %v, %bv : f32\n\
             \x20     %ni = arith.select %ok, %e, %bi : index\n\
             \x20     scf.yield %nv, %ni : f32, index\n\
             \x20   }}\n\
             \x20   memref.store %i32_1, %taken[%best#1] : memref<{experts}xi32>\n\
             \x20   %id = arith.index_cast %best#1 : index to i64\n\
             \x20   memref.store %id, %ids[%r, %j] : {ids}\n\
             \x20   %sv = memref.load %s[%best#1] : memref<{experts}xf32>\n\
             \x20   memref.store %sv, %wts[%r, %j] : {wts}\n\
             \x20   %acc2 = arith.addf %acc, %sv : f32\n\
             \x20   scf.yield %acc2 : f32\n\
             \x20 }}\n\
             \x20 scf.for %j = %c0 to %ck step %c1 {{\n\
             \x20   %sv = memref.load %wts[%r, %j] : {wts}\n\
             \x20   %nw = arith.divf %sv, %sum : f32\n\
             \x20   %sw = arith.mulf %nw, %scale : f32\n\
             \x20   memref.store %sw, %wts[%r, %j] : {wts}\n\
             \x20 }}\n\
             memref.dealloc %s : memref<{experts}xf32>\n\
             memref.dealloc %choice : memref<{experts}xf32>\n\
             memref.dealloc %taken : memref<{experts}xi32>\n",
            xload = indent(&load_f32("%xv", "%h", &ht, "%r", "%i", act), 6),
            wload = indent(&load_weight_f32("%wv", "%w", "%e, %i", &wt, weight), 6),
            add_bias = indent(&add_bias, 4),
        );
        let idx0 = index_consts(&[("cw", width), ("ce", experts), ("ck", k)]);
        let body = format!(
            "{BASICS}\
             {idx0}\
             %scale = arith.constant {scale} : f32\n\
             %ninf = arith.constant 0xFF800000 : f32\n\
             %i32_0 = arith.constant 0 : i32\n\
             %i32_1 = arith.constant 1 : i32\n\
             %rows = memref.dim %h, %c0 : {ht}\n\
             %work0 = arith.constant {macs} : index\n\
             %work = arith.muli %rows, %work0 : index\n\
             {rows_loop}\
             return\n",
            scale = f32_lit(scale),
            macs = experts * width,
            rows_loop = parallel_or_serial("%work", &["%r"], &["%c0"], &["%rows"], &["%c1"], &row),
        );
        body
    }
    fn gpu_funcs(&self, target: &GpuTarget) -> Vec<GpuFunc> {
        let idx = target.idx();
        let sym = self.symbol();
        let Router { width, experts, top_k, scale, weight, bias, act } = self;

        let ht = act.rows_ty(*width);
        let wa = WeightArgs::new(target, "%w", "", *experts, *width, *weight);
        let e = *experts;
        let wts = format!("memref<?x{top_k}xf32>");
        let ids = format!("memref<?x{top_k}xi64>");
        let sh = format!("memref<{e}xf32, #gpu.address_space<workgroup>>");
        let bias_add = match bias {
            Some(bt) => {
                let bty = format!("memref<{e}x{}>", bt.mlir_elem());
                format!(
                    "{}    %ch = arith.addf %sg, %bv : f32\n",
                    indent(&crate::emit::load_weight_f32("%bv", "%bias", "%e", &bty, *bt), 4)
                )
            }
            None => "    %ch = arith.addf %sg, %zero : f32\n".into(),
        };
        let body = format!(
                    "{idx}%r = gpu.block_id x\n%lane = gpu.thread_id x\n%ce = arith.constant {e} : index\n%ck = arith.constant {top_k} : index\n\
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
        let shared = [("ss", sh.clone()), ("sc_", sh)];
        vec![func_shared(target, &sym, &params_text(&self.params()), &shared, &body, target.warp)]
    }
    /// One warp per row.
    fn launch(&self, l: &Launch) -> GpuCall {
        l.call(l.grid(&self.symbol(), [l.rows, &l.one(), &l.one()], l.target.warp, l.args))
    }
}
