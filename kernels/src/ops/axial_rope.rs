//! The vision tower's 3-D axial rotary embedding (spec §4.3): each patch row
//! has a position `(t, h, w)`; with `d` the per-axis width
//! (`2·⌊⌊head_dim/3⌋/2⌋`) and `inv[j] = θ^(−2j/d)` (f32, as the reference's
//! table), the angles are `a = [t·inv, h·inv, w·inv]` (`3d/2` of them) and
//! channels `0..3d` of each head are rotated half against half:
//! `y[i] = x[i]·cos a_i − x[i+3d/2]·sin a_i`,
//! `y[i+3d/2] = x[i+3d/2]·cos a_i + x[i]·sin a_i`; the rest pass through.
//! `y` may be `x`: each pair is read before it is written.

use crate::emit::{f32_lit, load_f32, store_f32, ROTATE};
use crate::gpu::{GpuCall, GpuFunc, GpuTarget};
use crate::host::{index_consts, BASICS};
use crate::ops::head_norm_rope::{rope_table, rope_table_name};
use crate::unit::{gpu_func_block, param, KernelUnit, Launch, Param};
use crate::{indent, num_tag, Storage};

/// Axial RoPE over `heads` heads of `head_dim` channels, `axis_dim` (`d`) per axis.
#[derive(Debug, Clone, PartialEq, PartialOrd)]
pub struct AxialRope {
    pub heads: usize,
    pub head_dim: usize,
    pub axis_dim: usize,
    pub theta: f64,
    pub act: Storage,
}

impl AxialRope {
    fn x_ty(&self) -> String {
        self.act.rows_ty(self.heads * self.head_dim)
    }
    /// The pair `(j, j + half)` of head `%hd` (base `%base`) of row `%r`
    /// rotated by the angle of `%pf` (the axis position) times `%f`.
    fn pair(&self) -> String {
        let x = self.x_ty();
        let st = |v: &str, c: &str| store_f32(v, "%y", &x, "%r", c, self.act);
        format!(
            "%ang = arith.mulf %pf, %f : f32\n%cs = math.cos %ang : f32\n%sn = math.sin %ang : f32\n\
             %o1 = arith.addi %base, %j : index\n%j2 = arith.addi %j, %chalf : index\n%o2 = arith.addi %base, %j2 : index\n\
             {}{}{ROTATE}{}{}",
            load_f32("%a", "%x", &x, "%r", "%o1", self.act),
            load_f32("%b", "%x", &x, "%r", "%o2", self.act),
            st("%y1", "%o1"),
            st("%y2", "%o2"),
        )
    }
    /// `%pf`: the position on the axis of angle `%j` (row `%r`), and `%fj` its frequency index.
    fn axis_position(&self) -> String {
        "%axis = arith.divui %j, %cq : index\n%fj = arith.remui %j, %cq : index\n\
         %p64 = memref.load %ppos[%r, %axis] : memref<?x3xi64>\n%pf = arith.sitofp %p64 : i64 to f32\n"
            .to_string()
    }
}

impl KernelUnit for AxialRope {
    fn symbol(&self) -> String {
        let AxialRope { heads, head_dim, axis_dim, theta, act } = self;
        format!("m3c_axial_rope_h{heads}_d{head_dim}_a{axis_dim}_t{}{}", num_tag(*theta), act.act_suffix())
    }
    fn params(&self) -> Vec<Param> {
        let x = self.x_ty();
        vec![param("x", &x), param("ppos", "memref<?x3xi64>"), param("y", &x)]
    }
    fn act(&self) -> Option<Storage> {
        Some(self.act)
    }
    fn host_body(&self) -> String {
        let (q, half) = (self.axis_dim / 2, 3 * self.axis_dim / 2);
        let x = self.x_ty();
        let consts = index_consts(&[("ch", self.heads), ("cd", self.head_dim), ("cq", q), ("chalf", half), ("crot", 2 * half)]);
        let pass = format!("{}{}", load_f32("%v", "%x", &x, "%r", "%c", self.act), store_f32("%v", "%y", &x, "%r", "%c", self.act));
        format!(
            "{BASICS}{consts}%inv = memref.get_global @{table} : memref<{q}xf32>\n%rows = memref.dim %x, %c0 : {x}\n\
             scf.for %r = %c0 to %rows step %c1 {{\n\
             \x20 scf.for %hd = %c0 to %ch step %c1 {{\n\
             \x20   %base = arith.muli %hd, %cd : index\n\
             \x20   scf.for %j = %c0 to %chalf step %c1 {{\n\
             {ax}\
             \x20     %f = memref.load %inv[%fj] : memref<{q}xf32>\n\
             {pair}\
             \x20   }}\n\
             \x20   scf.for %i = %crot to %cd step %c1 {{\n\
             \x20     %c = arith.addi %base, %i : index\n\
             {pass}\
             \x20   }}\n\
             \x20 }}\n\
             }}\nreturn\n",
            table = rope_table_name(self.axis_dim, self.theta),
            ax = indent(&self.axis_position(), 6),
            pair = indent(&self.pair(), 6),
            pass = indent(&pass, 6),
        )
    }
    /// A block per (row, head), a thread per channel: thread `j < 3d/2`
    /// rotates the pair `(j, j + 3d/2)`, threads from `3d` copy their channel.
    fn gpu_funcs(&self, target: &GpuTarget) -> Vec<GpuFunc> {
        let idx = target.idx();
        let (q, half) = (self.axis_dim / 2, 3 * self.axis_dim / 2);
        let x = self.x_ty();
        let inv: Vec<String> =
            (0..q.max(1)).map(|j| f32_lit((1.0 / (self.theta as f32).powf((2 * j) as f32 / self.axis_dim as f32)) as f64)).collect();
        let body = format!(
            "{idx}%r = gpu.block_id x\n%hd = gpu.block_id y\n%j = gpu.thread_id x\n\
             {consts}%inv = arith.constant dense<[{inv}]> : vector<{qv}xf32>\n%base = arith.muli %hd, %cd : index\n\
             %lo = arith.cmpi ult, %j, %chalf : index\n\
             scf.if %lo {{\n{ax}  %f = vector.extract %inv[%fj] : f32 from vector<{qv}xf32>\n{pair}}}\n\
             %pass = arith.cmpi uge, %j, %crot : index\n\
             scf.if %pass {{\n  %c = arith.addi %base, %j : index\n{pass}}}\n",
            consts = index_consts(&[("cd", self.head_dim), ("cq", q), ("chalf", half), ("crot", 2 * half)]),
            inv = inv.join(", "),
            qv = q.max(1),
            ax = indent(&self.axis_position(), 2),
            pair = indent(&self.pair(), 2),
            pass = indent(
                &format!("{}{}", load_f32("%v", "%x", &x, "%r", "%c", self.act), store_f32("%v", "%y", &x, "%r", "%c", self.act)),
                2
            ),
        );
        vec![gpu_func_block(target, &self.symbol(), &self.params(), &body, self.head_dim)]
    }
    fn launch(&self, l: &Launch) -> GpuCall {
        l.per_head(&self.symbol(), self.heads, self.head_dim)
    }
    fn globals(&self) -> Vec<(String, String)> {
        vec![(rope_table_name(self.axis_dim, self.theta), rope_table(self.axis_dim, self.theta))]
    }
}
