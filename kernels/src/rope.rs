use crate::emit::{f32_lit, gemma_norm_span, indent};
use crate::{Storage, WeightType};

/// Per-head Gemma RMSNorm over `head_dim` channels (one weight for all heads)
/// fused with NeoX rotate-half RoPE on channels `0..rotary_dim`:
/// for `j < rotary_dim/2`, `y[j] = x[j]·cos − x[j+h]·sin`, `y[j+h] = x[j+h]·cos + x[j]·sin`
/// with `h = rotary_dim/2`, angle `pos · θ^(−2j/rotary_dim)` in f32.
/// `x`, `y`: `[S, heads·head_dim]` stored as `act`; `pos`: `[S]` i64.
#[allow(clippy::too_many_arguments)]
pub fn head_norm_rope(
    name: &str,
    heads: usize,
    head_dim: usize,
    rotary_dim: usize,
    theta: f64,
    eps: f64,
    weight: WeightType,
    act: Storage,
) -> String {
    let width = heads * head_dim;
    let half = rotary_dim / 2;
    let x = format!("memref<?x{width}x{}>", act.mlir_elem());
    let wt = format!("memref<{head_dim}x{}>", weight.mlir_elem());
    let body = format!(
        "%c0 = arith.constant 0 : index\n\
         %c1 = arith.constant 1 : index\n\
         %ch = arith.constant {heads} : index\n\
         %cd = arith.constant {head_dim} : index\n\
         %chalf = arith.constant {half} : index\n\
         %crot = arith.constant {rotary_dim} : index\n\
         %zero = arith.constant 0.0 : f32\n\
         %one = arith.constant 1.0 : f32\n\
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
         \x20     %ac = arith.mulf %a, %cs : f32\n\
         \x20     %bs = arith.mulf %b, %sn : f32\n\
         \x20     %y1 = arith.subf %ac, %bs : f32\n\
         \x20     %bc = arith.mulf %b, %cs : f32\n\
         \x20     %as = arith.mulf %a, %sn : f32\n\
         \x20     %y2 = arith.addf %bc, %as : f32\n\
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
        span = indent(
            &gemma_norm_span(&x, act, "%base", "%cd", &wt, weight, &format!("memref.store %o, %tmp[%i] : memref<{head_dim}xf32>")),
            4
        ),
    );
    format!(
        "  func.func @{name}(%x: {x}, %w: {wt}, %pos: memref<?xi64>, %y: {x}) attributes {{llvm.emit_c_interface}} {{\n{}  }}\n",
        indent(&body, 4)
    )
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
