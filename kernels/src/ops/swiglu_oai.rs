//! SwiGLU-OAI: `g' = min(g, limit)`, `u' = clamp(u, −limit, limit)`,
//! `y = g' · σ(alpha · g') · (u' + beta)`. `g`, `u`, `y`: `[S, width]`.

use crate::emit::{f32_lit, load_f32, store_f32};
use crate::gpu::{GpuFunc, GpuTarget};
use crate::host::rowwise;
use crate::unit::{gpu_func, param, KernelUnit, Param};
use crate::{indent, num_tag, Storage};

/// SwiGLU-OAI of a gate and an up projection.
#[derive(Debug, Clone, PartialEq, PartialOrd)]
pub struct SwiGluOai {
    pub width: usize,
    pub alpha: f64,
    pub limit: f64,
    pub beta: f64,
    pub act: Storage,
}

impl KernelUnit for SwiGluOai {
    fn symbol(&self) -> String {
        let SwiGluOai { width, alpha, limit, beta, act } = self;
        format!("m3c_swiglu_oai_w{width}_a{}_l{}_b{}{}", num_tag(*alpha), num_tag(*limit), num_tag(*beta), act.act_suffix())
    }
    fn params(&self) -> Vec<Param> {
        let t = self.act.rows_ty(self.width);
        vec![param("g", &t), param("u", &t), param("y", &t)]
    }
    fn act(&self) -> Option<Storage> {
        Some(self.act)
    }
    fn host_body(&self) -> String {
        let SwiGluOai { width, alpha, limit, beta, act } = *self;
        let t = act.rows_ty(width);
        let consts = format!(
            "%one = arith.constant 1.0 : f32\n\
         %alpha = arith.constant {} : f32\n\
         %lim = arith.constant {} : f32\n\
         %nlim = arith.constant {} : f32\n\
         %beta = arith.constant {} : f32\n",
            f32_lit(alpha),
            f32_lit(limit),
            f32_lit(-limit),
            f32_lit(beta)
        );
        rowwise(
            width,
            act,
            "g",
            &consts,
            &format!(
                "{}{}%gc = arith.minimumf %gv, %lim : f32\n\
         %u1 = arith.minimumf %uv, %lim : f32\n\
         %uc = arith.maximumf %u1, %nlim : f32\n\
         %ag = arith.mulf %alpha, %gc : f32\n\
         %nag = arith.negf %ag : f32\n\
         %e = math.exp %nag : f32\n\
         %den = arith.addf %one, %e : f32\n\
         %sig = arith.divf %one, %den : f32\n\
         %glu = arith.mulf %gc, %sig : f32\n\
         %up = arith.addf %uc, %beta : f32\n\
         %o = arith.mulf %glu, %up : f32\n{}",
                load_f32("%gv", "%g", &t, "%r", "%i", act),
                load_f32("%uv", "%u", &t, "%r", "%i", act),
                store_f32("%o", "%y", &t, "%r", "%i", act)
            ),
        )
    }
    fn gpu_funcs(&self, target: &GpuTarget) -> Vec<GpuFunc> {
        let idx = target.idx();
        let SwiGluOai { width, alpha, limit, beta, act } = self;

        let t = act.rows_ty(*width);
        let body = format!(
                    "{idx}%r = gpu.block_id x\n%t = gpu.thread_id x\n%cw = arith.constant {width} : index\n\
                     %alpha = arith.constant {a} : f32\n%lim = arith.constant {l} : f32\n%nlim = arith.constant {nl} : f32\n%beta = arith.constant {b} : f32\n\
                     scf.for %i = %t to %cw step %c256 {{\n\
                     {gl}{ul}\
                     \x20 %gc = arith.minimumf %gv, %lim : f32\n  %u1 = arith.minimumf %uv, %lim : f32\n  %uc = arith.maximumf %u1, %nlim : f32\n\
                     \x20 %ag = arith.mulf %alpha, %gc : f32\n  %nag = arith.negf %ag : f32\n  %e = math.exp %nag : f32\n\
                     \x20 %den = arith.addf %one, %e : f32\n  %sig = arith.divf %one, %den : f32\n  %glu = arith.mulf %gc, %sig : f32\n\
                     \x20 %up = arith.addf %uc, %beta : f32\n  %o = arith.mulf %glu, %up : f32\n{yst}}}\n",
                    gl = indent(&load_f32("%gv", "%g", &t, "%r", "%i", *act), 2),
                    ul = indent(&load_f32("%uv", "%u", &t, "%r", "%i", *act), 2),
                    yst = indent(&store_f32("%o", "%y", &t, "%r", "%i", *act), 2),
                    a = f32_lit(*alpha),
                    l = f32_lit(*limit),
                    nl = f32_lit(-limit),
                    b = f32_lit(*beta),
                );
        vec![gpu_func(target, &self.symbol(), &self.params(), &body)]
    }
}
