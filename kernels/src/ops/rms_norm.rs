//! RMSNorm over rows of `width`, in f32: Gemma's `x · rsqrt(mean(x²) + eps) · (1 + w)`,
//! or the plain `· w` of Llama (an EAGLE3 draft head's norms).

use crate::emit::{f32_lit, gemma_norm_span, load_f32, store_f32};
use crate::gpu::{GpuFunc, GpuTarget};
use crate::host::BASICS;
use crate::unit::{gpu_func, param, KernelUnit, Param};
use crate::{indent, num_tag, Storage, WeightType};

/// RMSNorm of each row; `x` and `y` hold values stored as `act`.
#[derive(Debug, Clone, PartialEq, PartialOrd)]
pub struct RmsNorm {
    pub width: usize,
    pub eps: f64,
    pub weight: WeightType,
    pub act: Storage,
    /// Gemma's `(1 + w)`; else the plain `w`.
    pub gemma: bool,
}

impl RmsNorm {
    /// The constant the weight is added to: 1 (Gemma) or 0 (plain).
    fn offset(&self) -> &'static str {
        if self.gemma {
            "%one"
        } else {
            "%zero"
        }
    }
}

impl KernelUnit for RmsNorm {
    fn symbol(&self) -> String {
        let RmsNorm { width, eps, weight, act, gemma } = self;
        let kind = if *gemma { "" } else { "plain_" };
        format!("m3c_rms_norm_{kind}w{width}_eps{}_{}{}", num_tag(*eps), weight.tag(), act.act_suffix())
    }
    fn params(&self) -> Vec<Param> {
        let RmsNorm { width, weight, act, .. } = self;
        let x = act.rows_ty(*width);
        vec![param("x", &x), param("w", weight.memref(&[*width])), param("y", &x)]
    }
    fn act(&self) -> Option<Storage> {
        Some(self.act)
    }
    /// Gemma RMSNorm over rows of `width`, in f32: `x · rsqrt(mean(x²) + eps) · (1 + w)`.
    /// `x` and `y` hold values stored as `act`.
    fn host_body(&self) -> String {
        let RmsNorm { width, eps, weight, act, .. } = *self;
        let offset = self.offset();
        let x = act.rows_ty(width);
        let wt = weight.memref(&[width]);
        let body = format!(
            "{BASICS}\
             %cw = arith.constant {width} : index\n\
             %n = arith.constant {n} : f32\n\
             %eps = arith.constant {eps} : f32\n\
             %rows = memref.dim %x, %c0 : {x}\n\
             scf.for %r = %c0 to %rows step %c1 {{\n\
             {span}\
             }}\n\
             return\n",
            n = f32_lit(width as f64),
            eps = f32_lit(eps),
            span = indent(
                &gemma_norm_span(
                    &x,
                    act,
                    "%c0",
                    "%cw",
                    &wt,
                    weight,
                    offset,
                    crate::emit::store_f32("%o", "%y", &x, "%r", "%c", act).trim_end()
                ),
                2
            ),
        );
        body
    }
    fn gpu_funcs(&self, target: &GpuTarget) -> Vec<GpuFunc> {
        let idx = target.idx();
        let RmsNorm { width, eps, weight, act, .. } = self;
        let offset = self.offset();

        let t = act.rows_ty(*width);
        let xl = indent(&load_f32("%v", "%x", &t, "%r", "%c", *act), 2);
        let wt = weight.memref(&[*width]);
        let wl = crate::emit::load_weight_f32("%wv", "%w", "%c", &wt, *weight);
        let body = format!(
            "{idx}%r = gpu.block_id x\n%t = gpu.thread_id x\n%cw = arith.constant {width} : index\n\
                     %n = arith.constant {n} : f32\n%eps = arith.constant {eps} : f32\n\
                     %part = scf.for %c = %t to %cw step %c256 iter_args(%a = %zero) -> (f32) {{\n\
                     {xl}  %q = arith.mulf %v, %v : f32\n  %a2 = arith.addf %a, %q : f32\n  scf.yield %a2 : f32\n}}\n\
                     %ss = gpu.all_reduce add %part uniform {{}} : (f32) -> (f32)\n\
                     %mean = arith.divf %ss, %n : f32\n%me = arith.addf %mean, %eps : f32\n%rs = math.rsqrt %me : f32\n\
                     scf.for %c = %t to %cw step %c256 {{\n\
                     {xl}{}\
                     \x20 %s = arith.addf {offset}, %wv : f32\n  %u = arith.mulf %v, %rs : f32\n  %o = arith.mulf %u, %s : f32\n\
                     {}}}\n",
            indent(&wl, 2),
            indent(&store_f32("%o", "%y", &t, "%r", "%c", *act), 2),
            n = f32_lit(*width as f64),
            eps = f32_lit(*eps),
        );
        vec![gpu_func(target, &self.symbol(), &self.params(), &body)]
    }
}
