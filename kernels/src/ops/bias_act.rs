//! `y = x + b`, then exact GELU when asked: the bias of a linear that has
//! one (the vision tower's and the projectors'), fused with the activation
//! that follows it. `y` may be `x` (in place, as the fuser calls it).

use crate::builder::{Builder, Value};
use crate::emit::{load_f32, load_weight_f32, store_f32};
use crate::gpu::{GpuFunc, GpuTarget};
use crate::host::rowwise;
use crate::unit::{gpu_func, param, KernelUnit, Param};
use crate::{indent, Storage, WeightType};

/// Bias add (and GELU) over `[S, width]` stored as `act`.
#[derive(Debug, Clone, PartialEq, PartialOrd)]
pub struct BiasAct {
    pub width: usize,
    pub weight: WeightType,
    pub gelu: bool,
    pub act: Storage,
}

impl BiasAct {
    /// Loads `[%r, %i]`, adds the bias, applies GELU (`erf` spells erf for
    /// the target) and stores.
    fn element(&self, erf: impl Fn(&mut Builder, &Value) -> Value) -> String {
        let x = self.act.rows_ty(self.width);
        let wt = self.weight.memref(&[self.width]);
        let mut b = Builder::new("ba");
        let xv = Value { name: "%xv".into(), ty: "f32".into() };
        let bv = Value { name: "%bv".into(), ty: "f32".into() };
        let s = b.binary("arith.addf", &xv, &bv);
        // The GELU kernel's own element (PyTorch's gelu(approximate="none")).
        let y = if self.gelu { super::gelu::Gelu::element(&mut b, &s.name, erf) } else { s };
        format!(
            "{}{}{}{}",
            load_f32("%xv", "%x", &x, "%r", "%i", self.act),
            load_weight_f32("%bv", "%b", "%i", &wt, self.weight),
            b.finish(),
            store_f32(&y.name, "%y", &x, "%r", "%i", self.act)
        )
    }
}

impl KernelUnit for BiasAct {
    fn symbol(&self) -> String {
        let BiasAct { width, weight, gelu, act } = self;
        format!("m3c_bias{}_w{width}_{}{}", if *gelu { "_gelu" } else { "" }, weight.tag(), act.act_suffix())
    }
    fn params(&self) -> Vec<Param> {
        let x = self.act.rows_ty(self.width);
        vec![param("x", &x), param("b", self.weight.memref(&[self.width])), param("y", &x)]
    }
    fn act(&self) -> Option<Storage> {
        Some(self.act)
    }
    fn host_body(&self) -> String {
        let element = self.element(|b, v| {
            let r = b.fresh("f32");
            b.line(&format!("{r} = func.call @erff({v}) : (f32) -> f32"));
            r
        });
        rowwise(self.width, self.act, "x", "", &element)
    }
    fn gpu_funcs(&self, target: &GpuTarget) -> Vec<GpuFunc> {
        let idx = target.idx();
        let element = self.element(|b, v| b.unary("math.erf", v));
        let body = format!(
            "{idx}%r = gpu.block_id x\n%t = gpu.thread_id x\n%cw = arith.constant {} : index\n\
             scf.for %i = %t to %cw step %c256 {{\n{}}}\n",
            self.width,
            indent(&element, 2),
        );
        vec![gpu_func(target, &self.symbol(), &self.params(), &body)]
    }
    fn globals(&self) -> Vec<(String, String)> {
        if self.gelu {
            vec![("erff".into(), "  func.func private @erff(f32) -> f32\n".into())]
        } else {
            Vec::new()
        }
    }
}
