//! Row `r` of `x` into row `pos[r]` of `y`: a sequence's new keys and values
//! into its cache, at positions read from memory (not baked into the
//! call), so a decode step's launches are the same at every position. In
//! a paged cache, position `p` is row `bt[p / B]·B + p mod B` of the pool.

use crate::emit::{load_f32, store_f32};
use crate::gpu::{GpuFunc, GpuTarget};
use crate::host::{row_loop, store_rows};
use crate::unit::{gpu_func, param, KernelUnit, Param};
use crate::{indent, Storage};

/// `x`: `[S, width]` stored as `act`, `pos`: `[S]`, `y`: `[T, width]` (a
/// cache stored as `cache`; every `pos[r] < T`). Paged (`paged`: the block
/// size), `bt` is the sequence's block table and `y` the whole pool.
#[derive(Debug, Clone, PartialEq, PartialOrd)]
pub struct ScatterRows {
    pub width: usize,
    pub paged: Option<usize>,
    pub cache: Storage,
    pub act: Storage,
}

/// The MLIR that turns position `%p` into the row `%pr` it is stored in.
fn pool_row(paged: Option<usize>) -> String {
    match paged {
        None => "%pr = arith.addi %p, %c0 : index\n".into(),
        Some(b) => format!(
            "%cPB = arith.constant {b} : index\n\
             %pb = arith.divui %p, %cPB : index\n\
             %po = arith.remui %p, %cPB : index\n\
             %pe64 = memref.load %bt[%pb] : memref<?xi64>\n\
             %pe = arith.index_cast %pe64 : i64 to index\n\
             %ps = arith.muli %pe, %cPB : index\n\
             %pr = arith.addi %ps, %po : index\n"
        ),
    }
}

impl KernelUnit for ScatterRows {
    fn symbol(&self) -> String {
        let paged = self.paged.map_or(String::new(), |b| format!("_pg{b}"));
        format!("m3c_scatter_rows_w{}{paged}{}{}", self.width, self.cache.suffix(), self.act.act_suffix())
    }
    fn params(&self) -> Vec<Param> {
        let ScatterRows { width, paged, cache, act } = self;
        let mut p = vec![param("x", act.rows_ty(*width)), param("pos", "memref<?xi64>")];
        if paged.is_some() {
            p.push(param("bt", "memref<?xi64>"));
        }
        p.push(param("y", cache.rows_ty(*width)));
        p
    }
    fn act(&self) -> Option<Storage> {
        Some(self.act)
    }
    fn host_body(&self) -> String {
        let ScatterRows { width, paged, cache, act } = *self;
        if paged.is_none() {
            return store_rows(width, act, cache, true);
        }
        let t = act.rows_ty(width);
        let yt = cache.rows_ty(width);
        let row = format!("%p64 = memref.load %pos[%r] : memref<?xi64>\n%p = arith.index_cast %p64 : i64 to index\n{}", pool_row(paged));
        let element = load_f32("%v", "%x", &t, "%r", "%i", act) + &store_f32("%v", "%y", &yt, "%pr", "%i", cache);
        row_loop("x", &t, width, "", &row, &element)
    }
    fn gpu_funcs(&self, target: &GpuTarget) -> Vec<GpuFunc> {
        let idx = target.idx();
        let ScatterRows { width, paged, cache, act } = *self;

        let t = act.rows_ty(width);
        let yt = cache.rows_ty(width);
        let body = format!(
            "{idx}%r = gpu.block_id x\n%t = gpu.thread_id x\n%cw = arith.constant {width} : index\n\
                     %p64 = memref.load %pos[%r] : memref<?xi64>\n%p = arith.index_cast %p64 : i64 to index\n{}\
                     scf.for %i = %t to %cw step %c256 {{\n{}{}}}\n",
            pool_row(paged),
            indent(&load_f32("%v", "%x", &t, "%r", "%i", act), 2),
            indent(&store_f32("%v", "%y", &yt, "%pr", "%i", cache), 2)
        );
        vec![gpu_func(target, &self.symbol(), &self.params(), &body)]
    }
}
