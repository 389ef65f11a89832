//! `y = a + b` over rows of `width` (`y` may be `a`: the residual add in place).

use crate::emit::{load_f32, store_f32};
use crate::gpu::{GpuFunc, GpuTarget};
use crate::host::rowwise;
use crate::unit::{gpu_func, param, KernelUnit, Param};
use crate::{indent, Storage};

/// Elementwise `a + b` (the residual adds, routed + shared expert).
#[derive(Debug, Clone, PartialEq, PartialOrd)]
pub struct Add {
    pub width: usize,
    pub act: Storage,
}

impl KernelUnit for Add {
    fn symbol(&self) -> String {
        format!("m3c_add_w{}{}", self.width, self.act.act_suffix())
    }
    fn params(&self) -> Vec<Param> {
        let t = self.act.rows_ty(self.width);
        vec![param("a", &t), param("b", &t), param("y", &t)]
    }
    fn act(&self) -> Option<Storage> {
        Some(self.act)
    }
    fn host_body(&self) -> String {
        let Add { width, act } = *self;
        let t = act.rows_ty(width);
        rowwise(
            width,
            act,
            "a",
            "",
            &format!(
                "{}{}%s = arith.addf %x, %z : f32\n{}",
                load_f32("%x", "%a", &t, "%r", "%i", act),
                load_f32("%z", "%b", &t, "%r", "%i", act),
                store_f32("%s", "%y", &t, "%r", "%i", act)
            ),
        )
    }
    fn gpu_funcs(&self, target: &GpuTarget) -> Vec<GpuFunc> {
        let idx = target.idx();
        let Add { width, act } = self;
        let t = act.rows_ty(*width);
        let body = format!(
            "{idx}%r = gpu.block_id x\n%t = gpu.thread_id x\n%cw = arith.constant {width} : index\n\
                     scf.for %i = %t to %cw step %c256 {{\n{}{}  %s = arith.addf %x, %z : f32\n{}}}\n",
            indent(&load_f32("%x", "%a", &t, "%r", "%i", *act), 2),
            indent(&load_f32("%z", "%b", &t, "%r", "%i", *act), 2),
            indent(&store_f32("%s", "%y", &t, "%r", "%i", *act), 2),
        );
        vec![gpu_func(target, &self.symbol(), &self.params(), &body)]
    }
}
