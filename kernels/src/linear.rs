use crate::emit::{e8m0_to_f32, indent, load_weight_f32, E8M0_CONSTANTS};
use crate::WeightType;

/// `y[S, out] = x[S, inp] · W[out, inp]ᵀ`, f32 accumulation. MXFP8 weights are
/// decoded in the inner loop (fp8 through a 256-entry table, one E8M0 scale
/// per block applied to the block's partial sum), so each weight byte is read
/// once and never expanded in memory.
pub fn linear(name: &str, inp: usize, out: usize, weight: WeightType) -> String {
    let x = format!("memref<?x{inp}xf32>");
    let y = format!("memref<?x{out}xf32>");
    let wt = format!("memref<{out}x{inp}x{}>", weight.mlir_elem());
    let head = "%c0 = arith.constant 0 : index\n\
                %c1 = arith.constant 1 : index\n\
                %zero = arith.constant 0.0 : f32\n";
    let (args, body) = match weight {
        WeightType::Mxfp8 { block } => {
            let nb = inp / block;
            let st = format!("memref<{out}x{nb}xi8>");
            let body = format!(
                "{head}{E8M0_CONSTANTS}\
                 %cout = arith.constant {out} : index\n\
                 %cnb = arith.constant {nb} : index\n\
                 %cb = arith.constant {block} : index\n\
                 %lut = memref.get_global @m3c_fp8_e4m3_lut : memref<256xf32>\n\
                 %rows = memref.dim %x, %c0 : {x}\n\
                 scf.for %r = %c0 to %rows step %c1 {{\n\
                 \x20 scf.for %o = %c0 to %cout step %c1 {{\n\
                 \x20   %acc = scf.for %b = %c0 to %cnb step %c1 iter_args(%a = %zero) -> (f32) {{\n\
                 \x20     %base = arith.muli %b, %cb : index\n\
                 \x20     %part = scf.for %j = %c0 to %cb step %c1 iter_args(%p = %zero) -> (f32) {{\n\
                 \x20       %i = arith.addi %base, %j : index\n\
                 \x20       %xv = memref.load %x[%r, %i] : {x}\n\
                 \x20       %q = memref.load %w[%o, %i] : {wt}\n\
                 \x20       %qi = arith.extui %q : i8 to i32\n\
                 \x20       %qx = arith.index_cast %qi : i32 to index\n\
                 \x20       %wv = memref.load %lut[%qx] : memref<256xf32>\n\
                 \x20       %m = arith.mulf %xv, %wv : f32\n\
                 \x20       %p2 = arith.addf %p, %m : f32\n\
                 \x20       scf.yield %p2 : f32\n\
                 \x20     }}\n\
                 \x20     %sb = memref.load %s[%o, %b] : {st}\n\
                 {dec}\
                 \x20     %ps = arith.mulf %part, %scale : f32\n\
                 \x20     %a2 = arith.addf %a, %ps : f32\n\
                 \x20     scf.yield %a2 : f32\n\
                 \x20   }}\n\
                 \x20   memref.store %acc, %y[%r, %o] : {y}\n\
                 \x20 }}\n\
                 }}\n\
                 return\n",
                dec = indent(&e8m0_to_f32("%scale", "%sb"), 6),
            );
            (format!("%x: {x}, %w: {wt}, %s: {st}, %y: {y}"), body)
        }
        _ => {
            let body = format!(
                "{head}\
                 %cout = arith.constant {out} : index\n\
                 %cin = arith.constant {inp} : index\n\
                 %rows = memref.dim %x, %c0 : {x}\n\
                 scf.for %r = %c0 to %rows step %c1 {{\n\
                 \x20 scf.for %o = %c0 to %cout step %c1 {{\n\
                 \x20   %acc = scf.for %i = %c0 to %cin step %c1 iter_args(%a = %zero) -> (f32) {{\n\
                 \x20     %xv = memref.load %x[%r, %i] : {x}\n\
                 {load}\
                 \x20     %m = arith.mulf %xv, %wv : f32\n\
                 \x20     %a2 = arith.addf %a, %m : f32\n\
                 \x20     scf.yield %a2 : f32\n\
                 \x20   }}\n\
                 \x20   memref.store %acc, %y[%r, %o] : {y}\n\
                 \x20 }}\n\
                 }}\n\
                 return\n",
                load = indent(&load_weight_f32("%wv", "%w", "%o, %i", &wt, weight), 6),
            );
            (format!("%x: {x}, %w: {wt}, %y: {y}"), body)
        }
    };
    format!("  func.func @{name}({args}) attributes {{llvm.emit_c_interface}} {{\n{}  }}\n", indent(&body, 4))
}
