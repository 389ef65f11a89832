use crate::emit::{f32_lit, gemma_norm_span, indent};
use crate::{Storage, WeightType};

/// Gemma RMSNorm over rows of `width`, in f32: `x · rsqrt(mean(x²) + eps) · (1 + w)`.
/// `x` and `y` hold values stored as `act`.
pub fn rms_norm(name: &str, width: usize, eps: f64, weight: WeightType, act: Storage) -> String {
    let x = format!("memref<?x{width}x{}>", act.mlir_elem());
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
         {span}\
         }}\n\
         return\n",
        n = f32_lit(width as f64),
        eps = f32_lit(eps),
        span = indent(
            &gemma_norm_span(&x, act, "%c0", "%cw", &wt, weight, crate::emit::store_f32("%o", "%y", &x, "%r", "%c", act).trim_end()),
            2
        ),
    );
    format!("  func.func @{name}(%x: {x}, %w: {wt}, %y: {x}) attributes {{llvm.emit_c_interface}} {{\n{}  }}\n", indent(&body, 4))
}
