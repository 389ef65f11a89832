//! `y[r, offset + c] = x[r, c]`: rows of `width` into columns
//! `offset..offset + width` of rows of `into` (two such calls make the
//! concatenation an EAGLE3 draft's attention reads).

use crate::emit::{load_f32, store_f32};
use crate::gpu::{GpuFunc, GpuTarget};
use crate::host::rowwise;
use crate::unit::{gpu_func, param, KernelUnit, Param};
use crate::{indent, Storage};

/// A column block of wider rows, written from narrower ones.
#[derive(Debug, Clone, PartialEq, PartialOrd)]
pub struct CopyCols {
    pub width: usize,
    pub into: usize,
    pub offset: usize,
    pub act: Storage,
}

impl KernelUnit for CopyCols {
    fn symbol(&self) -> String {
        let CopyCols { width, into, offset, act } = *self;
        format!("m3c_copy_cols_w{width}_to{into}_at{offset}{}", act.act_suffix())
    }
    fn params(&self) -> Vec<Param> {
        vec![param("x", self.act.rows_ty(self.width)), param("y", self.act.rows_ty(self.into))]
    }
    fn act(&self) -> Option<Storage> {
        Some(self.act)
    }
    fn host_body(&self) -> String {
        let CopyCols { width, into, offset, act } = *self;
        let (t, yt) = (act.rows_ty(width), act.rows_ty(into));
        rowwise(
            width,
            act,
            "x",
            &format!("%coff = arith.constant {offset} : index\n"),
            &format!(
                "{}%j = arith.addi %i, %coff : index\n{}",
                load_f32("%v", "%x", &t, "%r", "%i", act),
                store_f32("%v", "%y", &yt, "%r", "%j", act)
            ),
        )
    }
    fn gpu_funcs(&self, target: &GpuTarget) -> Vec<GpuFunc> {
        let idx = target.idx();
        let CopyCols { width, into, offset, act } = *self;
        let (t, yt) = (act.rows_ty(width), act.rows_ty(into));
        let body = format!(
            "{idx}%r = gpu.block_id x\n%t = gpu.thread_id x\n%cw = arith.constant {width} : index\n\
             %coff = arith.constant {offset} : index\n\
             scf.for %i = %t to %cw step %c256 {{\n{}  %j = arith.addi %i, %coff : index\n{}}}\n",
            indent(&load_f32("%v", "%x", &t, "%r", "%i", act), 2),
            indent(&store_f32("%v", "%y", &yt, "%r", "%j", act), 2),
        );
        vec![gpu_func(target, &self.symbol(), &self.params(), &body)]
    }
}
