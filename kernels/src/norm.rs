use crate::emit::{f32_lit, indent, load_weight_f32};
use crate::WeightType;

/// Gemma RMSNorm over rows of `width`, in f32: `x · rsqrt(mean(x²) + eps) · (1 + w)`.
pub fn rms_norm(name: &str, width: usize, eps: f64, weight: WeightType) -> String {
    let x = format!("memref<?x{width}xf32>");
    let wt = format!("memref<{width}x{}>", weight.mlir_elem());
    let body = format!(
        "%c0 = arith.constant 0 : index\n\
         %c1 = arith.constant 1 : index\n\
         %cw = arith.constant {width} : index\n\
         %zero = arith.constant 0.0 : f32\n\
         %one = arith.constant 1.0 : f32\n\
         %n = arith.constant {n} : f32\n\
         %eps = arith.constant {eps} : f32\n\
         %rows = memref.dim %x, %c0 : {x}\n\
         scf.for %r = %c0 to %rows step %c1 {{\n\
         \x20 %ss = scf.for %i = %c0 to %cw step %c1 iter_args(%acc = %zero) -> (f32) {{\n\
         \x20   %v = memref.load %x[%r, %i] : {x}\n\
         \x20   %sq = arith.mulf %v, %v : f32\n\
         \x20   %a = arith.addf %acc, %sq : f32\n\
         \x20   scf.yield %a : f32\n\
         \x20 }}\n\
         \x20 %mean = arith.divf %ss, %n : f32\n\
         \x20 %me = arith.addf %mean, %eps : f32\n\
         \x20 %inv = math.rsqrt %me : f32\n\
         \x20 scf.for %i = %c0 to %cw step %c1 {{\n\
         \x20   %v = memref.load %x[%r, %i] : {x}\n\
         {load}\
         \x20   %s = arith.addf %one, %wf : f32\n\
         \x20   %t = arith.mulf %v, %inv : f32\n\
         \x20   %o = arith.mulf %t, %s : f32\n\
         \x20   memref.store %o, %y[%r, %i] : {x}\n\
         \x20 }}\n\
         }}\n\
         return\n",
        n = f32_lit(width as f64),
        eps = f32_lit(eps),
        load = indent(&load_weight_f32("%wf", "%w", "%i", &wt, weight), 4),
    );
    format!(
        "  func.func @{name}(%x: {x}, %w: {wt}, %y: {x}) attributes {{llvm.emit_c_interface}} {{\n{}  }}\n",
        indent(&body, 4)
    )
}
