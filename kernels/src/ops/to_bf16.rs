//! `y = bf16(x)` row by row (nearest even), as bf16 bits: the input of a
//! tensor-core GEMM (cuBLAS) on the GPU.

use crate::gpu::{GpuFunc, GpuTarget};
use crate::host::store_rows;
use crate::unit::{gpu_func, param, KernelUnit, Param};
use crate::{indent, Storage};

/// `x`, `y`: `[S, width]`, f32 in, bf16 bits out.
#[derive(Debug, Clone, PartialEq, PartialOrd)]
pub struct ToBf16 {
    pub width: usize,
}

impl KernelUnit for ToBf16 {
    fn symbol(&self) -> String {
        format!("m3c_to_bf16_w{}", self.width)
    }
    fn params(&self) -> Vec<Param> {
        let w = self.width;
        vec![param("x", format!("memref<?x{w}xf32>")), param("y", format!("memref<?x{w}xi16>"))]
    }
    fn act(&self) -> Option<Storage> {
        None
    }
    fn host_body(&self) -> String {
        store_rows(self.width, Storage::F32, Storage::Bf16, false)
    }
    fn gpu_funcs(&self, target: &GpuTarget) -> Vec<GpuFunc> {
        let idx = target.idx();
        let ToBf16 { width } = self;

        let t = format!("memref<?x{width}xf32>");
        let yt = format!("memref<?x{width}xi16>");
        let body = format!(
            "{idx}%r = gpu.block_id x\n%t = gpu.thread_id x\n%cw = arith.constant {width} : index\n\
                     scf.for %i = %t to %cw step %c256 {{\n  %v = memref.load %x[%r, %i] : {t}\n{}}}\n",
            indent(&crate::emit::store_f32("%v", "%y", &yt, "%r", "%i", crate::Storage::Bf16), 2)
        );
        vec![gpu_func(target, &self.symbol(), &self.params(), &body)]
    }
}
