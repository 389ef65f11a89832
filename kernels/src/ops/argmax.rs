//! Greedy sampling: the index of each row's largest value.

use crate::builder::{warp_reduce, Reduce};
use crate::host::BASICS;
use crate::gpu::{GpuCall, GpuFunc, IDX};
use crate::unit::{gpu_func, param, KernelUnit, Launch, Param};
use crate::Storage;

/// The first index of each row's maximum (`x`: `[S, width]` f32 logits,
/// `ids`: `[S]`). NaN ranks as -inf, so the id is always in range.
#[derive(Debug, Clone, PartialEq, PartialOrd)]
pub struct Argmax {
    pub width: usize,
}

impl KernelUnit for Argmax {
    fn symbol(&self) -> String {
        format!("m3c_argmax_w{}", self.width)
    }
    fn params(&self) -> Vec<Param> {
        vec![param("x", format!("memref<?x{}xf32>", self.width)), param("ids", "memref<?xi64>")]
    }
    fn act(&self) -> Option<Storage> {
        None
    }
    fn host_body(&self) -> String {
        host(self.width)
    }
    fn gpu_funcs(&self) -> Vec<GpuFunc> {
        let Argmax { width } = self;

                let t = format!("memref<?x{width}xf32>");
                let wr0 = warp_reduce("%m", Reduce::Max, "%best#0", "f32");
                let wr1 = warp_reduce("%win", Reduce::MinSi, "%cand", "i32");
                let body = format!(
                    "{IDX}%r = gpu.block_id x\n%lane = gpu.thread_id x\n%cw = arith.constant {width} : index\n\
                     %big = arith.constant 2147483647 : i32\n\
                     %best:2 = scf.for %i = %lane to %cw step %c32 iter_args(%bv = %ninf, %bi = %cw) -> (f32, index) {{\n\
                     \x20 %v0 = memref.load %x[%r, %i] : {t}\n  %isnan = arith.cmpf uno, %v0, %v0 : f32\n  %v = arith.select %isnan, %ninf, %v0 : f32\n\
                     \x20 %gt0 = arith.cmpf ogt, %v, %bv : f32\n  %none = arith.cmpi eq, %bi, %cw : index\n  %gt = arith.ori %gt0, %none : i1\n\
                     \x20 %nv = arith.select %gt, %v, %bv : f32\n  %ni = arith.select %gt, %i, %bi : index\n  scf.yield %nv, %ni : f32, index\n}}\n\
                     {wr0}\
                     %is = arith.cmpf oeq, %best#0, %m : f32\n\
                     %bi32 = arith.index_cast %best#1 : index to i32\n\
                     %cand = arith.select %is, %bi32, %big : i32\n\
                     {wr1}\
                     %first = arith.cmpi eq, %lane, %c0 : index\n\
                     scf.if %first {{\n  %id = arith.extsi %win : i32 to i64\n  memref.store %id, %ids[%r] : memref<?xi64>\n}}\n"
                );
                vec![gpu_func(&self.symbol(), &self.params(), &body)]
                }
    /// One warp per row.
    fn launch(&self, l: &Launch) -> GpuCall {
        l.call(l.grid(&self.symbol(), [l.rows, &l.one(), &l.one()], 32, l.args))
    }
}

/// Greedy sampling: the index of each row's largest value (the first on
/// ties; NaN ranks as -inf, so the id is always in range).
/// `x`: `[S, width]`, `ids`: `[S]` i64.
fn host(width: usize) -> String {
    let t = format!("memref<?x{width}xf32>");
    let body = format!(
        "{BASICS}\
         %cw = arith.constant {width} : index\n\
         %ninf = arith.constant 0xFF800000 : f32\n\
         %rows = memref.dim %x, %c0 : {t}\n\
         scf.for %r = %c0 to %rows step %c1 {{\n\
         \x20 %f0 = memref.load %x[%r, %c0] : {t}\n\
         \x20 %f0nan = arith.cmpf uno, %f0, %f0 : f32\n\
         \x20 %first = arith.select %f0nan, %ninf, %f0 : f32\n\
         \x20 %best:2 = scf.for %i = %c1 to %cw step %c1 iter_args(%bv = %first, %bi = %c0) -> (f32, index) {{\n\
         \x20   %v0 = memref.load %x[%r, %i] : {t}\n\
         \x20   %vnan = arith.cmpf uno, %v0, %v0 : f32\n\
         \x20   %v = arith.select %vnan, %ninf, %v0 : f32\n\
         \x20   %gt = arith.cmpf ogt, %v, %bv : f32\n\
         \x20   %nv = arith.select %gt, %v, %bv : f32\n\
         \x20   %ni = arith.select %gt, %i, %bi : index\n\
         \x20   scf.yield %nv, %ni : f32, index\n\
         \x20 }}\n\
         \x20 %id = arith.index_cast %best#1 : index to i64\n\
         \x20 memref.store %id, %ids[%r] : memref<?xi64>\n\
         }}\n\
         return\n"
    );
    body
}
