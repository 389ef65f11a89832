//! Exact GELU, the vision tower's MLP activation: `y = ½ · x · (1 + erf(x / √2))`
//! (PyTorch's `gelu(approximate="none")`), in f32. The host calls libm's
//! `erff`; the GPU's `math.erf` becomes libdevice's `__nv_erff`.

use crate::builder::Builder;
use crate::emit::{load_f32, store_f32};
use crate::gpu::{GpuFunc, GpuTarget};
use crate::host::rowwise;
use crate::unit::{gpu_func, param, KernelUnit, Param};
use crate::{indent, Storage};

/// GELU of each element of `x` (`[S, width]`, stored as `act`) into `y`.
#[derive(Debug, Clone, PartialEq, PartialOrd)]
pub struct Gelu {
    pub width: usize,
    pub act: Storage,
}

/// The libm function the host body calls.
const ERFF: &str = "  func.func private @erff(f32) -> f32\n";

impl Gelu {
    /// `y = ½ · x · (1 + erf(x · 1/√2))` of the loaded `%x`, stored from the
    /// returned value; `erf` is how the target spells erf of a value.
    pub(crate) fn element(
        b: &mut Builder,
        x: &str,
        erf: impl Fn(&mut Builder, &crate::builder::Value) -> crate::builder::Value,
    ) -> crate::builder::Value {
        let x = crate::builder::Value { name: x.to_string(), ty: "f32".into() };
        let (half, one, rsqrt2) = (b.f32(0.5), b.f32(1.0), b.f32(std::f64::consts::FRAC_1_SQRT_2));
        let scaled = b.binary("arith.mulf", &x, &rsqrt2);
        let e = erf(b, &scaled);
        let onep = b.binary("arith.addf", &one, &e);
        let hx = b.binary("arith.mulf", &half, &x);
        b.binary("arith.mulf", &hx, &onep)
    }
}

impl KernelUnit for Gelu {
    fn symbol(&self) -> String {
        format!("m3c_gelu_w{}{}", self.width, self.act.act_suffix())
    }
    fn params(&self) -> Vec<Param> {
        let t = self.act.rows_ty(self.width);
        vec![param("x", &t), param("y", &t)]
    }
    fn act(&self) -> Option<Storage> {
        Some(self.act)
    }
    fn host_body(&self) -> String {
        let t = self.act.rows_ty(self.width);
        let mut b = Builder::new("ge");
        let y = Gelu::element(&mut b, "%xv", |b, v| {
            let r = b.fresh("f32");
            b.line(&format!("{r} = func.call @erff({v}) : (f32) -> f32"));
            r
        });
        let element = format!(
            "{}{}{}",
            load_f32("%xv", "%x", &t, "%r", "%i", self.act),
            b.finish(),
            store_f32(&y.name, "%y", &t, "%r", "%i", self.act)
        );
        rowwise(self.width, self.act, "x", "", &element)
    }
    fn gpu_funcs(&self, target: &GpuTarget) -> Vec<GpuFunc> {
        let idx = target.idx();
        let t = self.act.rows_ty(self.width);
        let mut b = Builder::new("ge");
        let y = Gelu::element(&mut b, "%xv", |b, v| b.unary("math.erf", v));
        let body = format!(
            "{idx}%r = gpu.block_id x\n%t = gpu.thread_id x\n%cw = arith.constant {} : index\n\
             scf.for %i = %t to %cw step %c256 {{\n{}{}{}}}\n",
            self.width,
            indent(&load_f32("%xv", "%x", &t, "%r", "%i", self.act), 2),
            indent(&b.finish(), 2),
            indent(&store_f32(&y.name, "%y", &t, "%r", "%i", self.act), 2),
        );
        vec![gpu_func(target, &self.symbol(), &self.params(), &body)]
    }
    fn globals(&self) -> Vec<(String, String)> {
        vec![("erff".into(), ERFF.into())]
    }
}
