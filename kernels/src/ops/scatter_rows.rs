//! Row `r` of `x` into row `pos[r]` of `y`: a sequence's new keys and values
//! into its cache, at positions read from memory (not baked into the
//! call), so a decode step's launches are the same at every position.

use crate::emit::{load_f32, store_f32};
use crate::gpu::{GpuFunc, GpuTarget};
use crate::host::store_rows;
use crate::unit::{gpu_func, param, KernelUnit, Param};
use crate::{indent, Storage};

/// `x`: `[S, width]` stored as `act`, `pos`: `[S]`, `y`: `[T, width]` (a
/// cache stored as `cache`; every `pos[r] < T`).
#[derive(Debug, Clone, PartialEq, PartialOrd)]
pub struct ScatterRows {
    pub width: usize,
    pub cache: Storage,
    pub act: Storage,
}

impl KernelUnit for ScatterRows {
    fn symbol(&self) -> String {
        format!("m3c_scatter_rows_w{}{}{}", self.width, self.cache.suffix(), self.act.act_suffix())
    }
    fn params(&self) -> Vec<Param> {
        let ScatterRows { width, cache, act } = self;
        vec![
            param("x", format!("memref<?x{width}x{}>", act.mlir_elem())),
            param("pos", "memref<?xi64>"),
            param("y", format!("memref<?x{width}x{}>", cache.mlir_elem())),
        ]
    }
    fn act(&self) -> Option<Storage> {
        Some(self.act)
    }
    fn host_body(&self) -> String {
        store_rows(self.width, self.act, self.cache, true)
    }
    fn gpu_funcs(&self, target: &GpuTarget) -> Vec<GpuFunc> {
        let idx = target.idx();
        let ScatterRows { width, cache, act } = self;

        let t = format!("memref<?x{width}x{}>", act.mlir_elem());
        let yt = format!("memref<?x{width}x{}>", cache.mlir_elem());
        let body = format!(
            "{idx}%r = gpu.block_id x\n%t = gpu.thread_id x\n%cw = arith.constant {width} : index\n\
                     %p64 = memref.load %pos[%r] : memref<?xi64>\n%p = arith.index_cast %p64 : i64 to index\n\
                     scf.for %i = %t to %cw step %c256 {{\n{}{}}}\n",
            indent(&load_f32("%v", "%x", &t, "%r", "%i", *act), 2),
            indent(&store_f32("%v", "%y", &yt, "%p", "%i", *cache), 2)
        );
        vec![gpu_func(target, &self.symbol(), &self.params(), &body)]
    }
}
