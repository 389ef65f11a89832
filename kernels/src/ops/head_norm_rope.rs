//! Per-head Gemma RMSNorm fused with partial NeoX RoPE (QK-norm + RoPE,
//! also the MSA indexer's).

use crate::emit::{f32_lit, gemma_norm_span, load_f32, store_f32, ROTATE};
use crate::gpu::{func_shared, GpuCall, GpuFunc, GpuTarget};
use crate::host::{index_consts, BASICS};
use crate::unit::{param, params_text, KernelUnit, Launch, Param};
use crate::{indent, num_tag, Storage, WeightType};

/// `heads` heads of `head_dim` channels per row; RoPE on channels `0..rotary_dim`.
#[derive(Debug, Clone, PartialEq, PartialOrd)]
pub struct HeadNormRope {
    pub heads: usize,
    pub head_dim: usize,
    pub rotary_dim: usize,
    pub theta: f64,
    pub eps: f64,
    pub weight: WeightType,
    pub act: Storage,
    /// The per-head norm before the RoPE; without it (an EAGLE3 draft's
    /// q and k) the kernel takes no weight and `eps` is unused.
    pub norm: bool,
}

impl KernelUnit for HeadNormRope {
    fn symbol(&self) -> String {
        let HeadNormRope { heads, head_dim, rotary_dim, theta, eps, weight, act, norm } = self;
        if !norm {
            return format!("m3c_rope_h{heads}_d{head_dim}_r{rotary_dim}_t{}{}", num_tag(*theta), act.act_suffix());
        }
        format!(
            "m3c_head_norm_rope_h{heads}_d{head_dim}_r{rotary_dim}_t{}_eps{}_{}{}",
            num_tag(*theta),
            num_tag(*eps),
            weight.tag(),
            act.act_suffix()
        )
    }
    fn params(&self) -> Vec<Param> {
        let HeadNormRope { heads, head_dim, weight, act, norm, .. } = self;
        let x = act.rows_ty(heads * head_dim);
        if !norm {
            return vec![param("x", &x), param("pos", "memref<?xi64>"), param("y", &x)];
        }
        vec![param("x", &x), param("w", weight.memref(&[*head_dim])), param("pos", "memref<?xi64>"), param("y", &x)]
    }
    fn act(&self) -> Option<Storage> {
        Some(self.act)
    }
    /// Per-head Gemma RMSNorm over `head_dim` channels (one weight for all heads)
    /// fused with NeoX rotate-half RoPE on channels `0..rotary_dim`:
    /// for `j < rotary_dim/2`, `y[j] = x[j]·cos − x[j+h]·sin`, `y[j+h] = x[j+h]·cos + x[j]·sin`
    /// with `h = rotary_dim/2`, angle `pos · θ^(−2j/rotary_dim)` in f32.
    /// `x`, `y`: `[S, heads·head_dim]` stored as `act`; `pos`: `[S]` i64.
    fn host_body(&self) -> String {
        let HeadNormRope { heads, head_dim, rotary_dim, theta, eps, weight, act, norm } = *self;
        let width = heads * head_dim;
        let half = rotary_dim / 2;
        let x = act.rows_ty(width);
        let wt = weight.memref(&[head_dim]);
        let idx0 = index_consts(&[("ch", heads), ("cd", head_dim), ("chalf", half), ("crot", rotary_dim)]);
        let body = format!(
            "{BASICS}\
             {idx0}\
             %n = arith.constant {n} : f32\n\
             %eps = arith.constant {eps} : f32\n\
             %inv = memref.get_global @{table} : memref<{half}xf32>\n\
             %rows = memref.dim %x, %c0 : {x}\n\
             %tmp = memref.alloca() : memref<{head_dim}xf32>\n\
             scf.for %r = %c0 to %rows step %c1 {{\n\
             \x20 %p64 = memref.load %pos[%r] : memref<?xi64>\n\
             \x20 %pf = arith.sitofp %p64 : i64 to f32\n\
             \x20 scf.for %hd = %c0 to %ch step %c1 {{\n\
             \x20   %base = arith.muli %hd, %cd : index\n\
             {span}\
             \x20   scf.for %j = %c0 to %chalf step %c1 {{\n\
             \x20     %f = memref.load %inv[%j] : memref<{half}xf32>\n\
             \x20     %ang = arith.mulf %pf, %f : f32\n\
             \x20     %cs = math.cos %ang : f32\n\
             \x20     %sn = math.sin %ang : f32\n\
             \x20     %j2 = arith.addi %j, %chalf : index\n\
             \x20     %a = memref.load %tmp[%j] : memref<{head_dim}xf32>\n\
             \x20     %b = memref.load %tmp[%j2] : memref<{head_dim}xf32>\n\
             {rotate}\
             \x20     %o1 = arith.addi %base, %j : index\n\
             \x20     %o2 = arith.addi %base, %j2 : index\n\
             {st12}\
             \x20   }}\n\
             \x20   scf.for %i = %crot to %cd step %c1 {{\n\
             \x20     %v = memref.load %tmp[%i] : memref<{head_dim}xf32>\n\
             \x20     %c = arith.addi %base, %i : index\n\
             {stv}\
             \x20   }}\n\
             \x20 }}\n\
             }}\n\
             return\n",
            n = f32_lit(head_dim as f64),
            eps = f32_lit(eps),
            table = rope_table_name(rotary_dim, theta),
            st12 = indent(
                &format!(
                    "{}{}",
                    crate::emit::store_f32("%y1", "%y", &x, "%r", "%o1", act),
                    crate::emit::store_f32("%y2", "%y", &x, "%r", "%o2", act)
                ),
                6
            ),
            stv = indent(&crate::emit::store_f32("%v", "%y", &x, "%r", "%c", act), 6),
            rotate = indent(ROTATE, 6),
            span = indent(
                &if norm {
                    gemma_norm_span(
                        &x,
                        act,
                        "%base",
                        "%cd",
                        &wt,
                        weight,
                        "%one",
                        &format!("memref.store %o, %tmp[%i] : memref<{head_dim}xf32>"),
                    )
                } else {
                    format!(
                        "scf.for %i = %c0 to %cd step %c1 {{\n\
                         \x20 %c = arith.addi %base, %i : index\n\
                         {}\
                         \x20 memref.store %v, %tmp[%i] : memref<{head_dim}xf32>\n\
                         }}\n",
                        indent(&load_f32("%v", "%x", &x, "%r", "%c", act), 2)
                    )
                },
                4
            ),
        );
        body
    }
    fn gpu_funcs(&self, target: &GpuTarget) -> Vec<GpuFunc> {
        let idx = target.idx();
        let sym = self.symbol();
        let HeadNormRope { heads, head_dim, rotary_dim, theta, eps, weight, act, norm } = self;

        let (d, half) = (*head_dim, rotary_dim / 2);
        let t = act.rows_ty(heads * d);
        let st = |v: &str, c: &str| store_f32(v, "%y", &t, "%r", c, *act);
        let wt = weight.memref(&[d]);
        let inv: Vec<String> =
            (0..half.max(1)).map(|j| f32_lit((1.0 / (*theta as f32).powf((2 * j) as f32 / *rotary_dim as f32)) as f64)).collect();
        let wl = crate::emit::load_weight_f32("%wv", "%w", "%t", &wt, *weight);
        let body = format!(
                    "{idx}%r = gpu.block_id x\n%h = gpu.block_id y\n%t = gpu.thread_id x\n\
                     %cd = arith.constant {d} : index\n%chalf = arith.constant {half} : index\n%crot = arith.constant {rotary_dim} : index\n\
                     %n = arith.constant {nf} : f32\n%eps = arith.constant {epsf} : f32\n\
                     %inv = arith.constant dense<[{inv}]> : vector<{hv}xf32>\n\
                     %base = arith.muli %h, %cd : index\n%col = arith.addi %base, %t : index\n\
                     {xl}{normed}\
                     memref.store %nv, %sh[%t] : memref<{d}xf32, #gpu.address_space<workgroup>>\n\
                     gpu.barrier\n\
                     %p64 = memref.load %pos[%r] : memref<?xi64>\n%pf = arith.sitofp %p64 : i64 to f32\n\
                     %lo = arith.cmpi ult, %t, %chalf : index\n\
                     scf.if %lo {{\n\
                     \x20 %f = vector.extract %inv[%t] : f32 from vector<{hv}xf32>\n\
                     \x20 %ang = arith.mulf %pf, %f : f32\n  %cs = math.cos %ang : f32\n  %sn = math.sin %ang : f32\n\
                     \x20 %j2 = arith.addi %t, %chalf : index\n\
                     \x20 %a = memref.load %sh[%t] : memref<{d}xf32, #gpu.address_space<workgroup>>\n\
                     \x20 %b = memref.load %sh[%j2] : memref<{d}xf32, #gpu.address_space<workgroup>>\n\
                     {rotate}\
                     \x20 %o2 = arith.addi %base, %j2 : index\n\
                     {st12}\
                     }}\n\
                     %pass = arith.cmpi uge, %t, %crot : index\n\
                     scf.if %pass {{\n{stp}}}\n",
                    xl = load_f32("%v", "%x", &t, "%r", "%col", *act),
                    normed = if *norm {
                        format!(
                            "%q = arith.mulf %v, %v : f32\n\
                             %ss = gpu.all_reduce add %q uniform {{}} : (f32) -> (f32)\n\
                             %mean = arith.divf %ss, %n : f32\n%me = arith.addf %mean, %eps : f32\n%rs = math.rsqrt %me : f32\n\
                             {wl}%s = arith.addf %one, %wv : f32\n%u = arith.mulf %v, %rs : f32\n%nv = arith.mulf %u, %s : f32\n"
                        )
                    } else {
                        "%nv = arith.mulf %v, %one : f32\n".to_string()
                    },
                    st12 = indent(&format!("{}{}", st("%y1", "%col"), st("%y2", "%o2")), 2),
                    rotate = indent(ROTATE, 2),
                    stp = indent(&st("%nv", "%col"), 2),
                    nf = f32_lit(d as f64),
                    epsf = f32_lit(*eps),
                    inv = inv.join(", "),
                    hv = half.max(1),
                );
        let shared = [("sh", format!("memref<{d}xf32, #gpu.address_space<workgroup>>"))];
        vec![func_shared(target, &sym, &params_text(&self.params()), &shared, &body, d)]
    }
    /// A block per (row, head), a thread per channel.
    fn launch(&self, l: &Launch) -> GpuCall {
        l.per_head(&self.symbol(), self.heads, self.head_dim)
    }
    fn globals(&self) -> Vec<(String, String)> {
        vec![(rope_table_name(self.rotary_dim, self.theta), rope_table(self.rotary_dim, self.theta))]
    }
}

pub fn rope_table_name(rotary_dim: usize, theta: f64) -> String {
    format!("m3c_rope_inv_freq_r{rotary_dim}_t{}", crate::num_tag(theta))
}

/// `inv_freq[j] = 1 / θ^(2j/rotary_dim)` as the reference computes it, in f32,
/// as a private constant global.
pub fn rope_table(rotary_dim: usize, theta: f64) -> String {
    let half = rotary_dim / 2;
    let inv: Vec<String> = (0..half).map(|j| f32_lit((1.0 / (theta as f32).powf((2 * j) as f32 / rotary_dim as f32)) as f64)).collect();
    format!(
        "  memref.global \"private\" constant @{} : memref<{half}xf32> = dense<[{}]>\n",
        rope_table_name(rotary_dim, theta),
        inv.join(", ")
    )
}
