//! LayerNorm over rows of `width` with weight and bias, in f32 (the vision
//! tower's): `(x − mean) · rsqrt(var + eps) · w + b`, the biased variance
//! of the row, as PyTorch's `nn.LayerNorm` computes it.

use crate::emit::{f32_lit, load_f32, load_weight_f32, parallel_or_serial, store_f32};
use crate::gpu::{GpuFunc, GpuTarget};
use crate::host::BASICS;
use crate::unit::{gpu_func, param, KernelUnit, Param};
use crate::{indent, num_tag, Storage, WeightType};

/// LayerNorm of each row; `x` and `y` hold values stored as `act`.
#[derive(Debug, Clone, PartialEq, PartialOrd)]
pub struct LayerNorm {
    pub width: usize,
    pub eps: f64,
    pub weight: WeightType,
    pub act: Storage,
}

impl LayerNorm {
    fn w_ty(&self) -> String {
        self.weight.memref(&[self.width])
    }
    /// `%o`: the normalised, scaled and shifted `%v` (column `%c`), given `%mean` and `%rs`.
    fn affine(&self) -> String {
        format!(
            "{}{}%dv = arith.subf %v, %mean : f32\n%nv = arith.mulf %dv, %rs : f32\n%sv = arith.mulf %nv, %wv : f32\n%o = arith.addf %sv, %bv : f32\n",
            load_weight_f32("%wv", "%w", "%c", &self.w_ty(), self.weight),
            load_weight_f32("%bv", "%b", "%c", &self.w_ty(), self.weight),
        )
    }
}

impl KernelUnit for LayerNorm {
    fn symbol(&self) -> String {
        let LayerNorm { width, eps, weight, act } = self;
        format!("m3c_layer_norm_w{width}_eps{}_{}{}", num_tag(*eps), weight.tag(), act.act_suffix())
    }
    fn params(&self) -> Vec<Param> {
        let (x, w) = (self.act.rows_ty(self.width), self.w_ty());
        vec![param("x", &x), param("w", &w), param("b", &w), param("y", &x)]
    }
    fn act(&self) -> Option<Storage> {
        Some(self.act)
    }
    /// Two passes over the row (mean, then the centred squares), each row on one thread.
    fn host_body(&self) -> String {
        let x = self.act.rows_ty(self.width);
        let load = indent(&load_f32("%v", "%x", &x, "%r", "%c", self.act), 2);
        let row = format!(
            "%sum = scf.for %c = %c0 to %cw step %c1 iter_args(%a = %zero) -> (f32) {{\n{load}  %a2 = arith.addf %a, %v : f32\n  scf.yield %a2 : f32\n}}\n\
             %mean = arith.divf %sum, %n : f32\n\
             %sq = scf.for %c = %c0 to %cw step %c1 iter_args(%a = %zero) -> (f32) {{\n{load}  %d = arith.subf %v, %mean : f32\n  %d2 = arith.mulf %d, %d : f32\n  %a2 = arith.addf %a, %d2 : f32\n  scf.yield %a2 : f32\n}}\n\
             %var = arith.divf %sq, %n : f32\n%ve = arith.addf %var, %eps : f32\n%rs = math.rsqrt %ve : f32\n\
             scf.for %c = %c0 to %cw step %c1 {{\n{load}{}{}}}\n",
            indent(&self.affine(), 2),
            indent(&store_f32("%o", "%y", &x, "%r", "%c", self.act), 2),
        );
        format!(
            "{BASICS}%cw = arith.constant {w} : index\n%n = arith.constant {n} : f32\n%eps = arith.constant {eps} : f32\n\
             %rows = memref.dim %x, %c0 : {x}\n%work = arith.muli %rows, %cw : index\n{}return\n",
            parallel_or_serial("%work", &["%r"], &["%c0"], &["%rows"], &["%c1"], &row),
            w = self.width,
            n = f32_lit(self.width as f64),
            eps = f32_lit(self.eps),
        )
    }
    /// A block of 256 threads per row; the sums by `gpu.all_reduce`.
    fn gpu_funcs(&self, target: &GpuTarget) -> Vec<GpuFunc> {
        let idx = target.idx();
        let x = self.act.rows_ty(self.width);
        let load = indent(&load_f32("%v", "%x", &x, "%r", "%c", self.act), 2);
        let body = format!(
            "{idx}%r = gpu.block_id x\n%t = gpu.thread_id x\n%cw = arith.constant {w} : index\n\
             %n = arith.constant {n} : f32\n%eps = arith.constant {eps} : f32\n\
             %p1 = scf.for %c = %t to %cw step %c256 iter_args(%a = %zero) -> (f32) {{\n{load}  %a2 = arith.addf %a, %v : f32\n  scf.yield %a2 : f32\n}}\n\
             %sum = gpu.all_reduce add %p1 uniform {{}} : (f32) -> (f32)\n%mean = arith.divf %sum, %n : f32\n\
             %p2 = scf.for %c = %t to %cw step %c256 iter_args(%a = %zero) -> (f32) {{\n{load}  %d = arith.subf %v, %mean : f32\n  %d2 = arith.mulf %d, %d : f32\n  %a2 = arith.addf %a, %d2 : f32\n  scf.yield %a2 : f32\n}}\n\
             %sq = gpu.all_reduce add %p2 uniform {{}} : (f32) -> (f32)\n\
             %var = arith.divf %sq, %n : f32\n%ve = arith.addf %var, %eps : f32\n%rs = math.rsqrt %ve : f32\n\
             scf.for %c = %t to %cw step %c256 {{\n{load}{}{}}}\n",
            indent(&self.affine(), 2),
            indent(&store_f32("%o", "%y", &x, "%r", "%c", self.act), 2),
            w = self.width,
            n = f32_lit(self.width as f64),
            eps = f32_lit(self.eps),
        );
        vec![gpu_func(target, &self.symbol(), &self.params(), &body)]
    }
}
