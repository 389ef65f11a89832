//! Host-body helpers shared by several kernels (the bodies only: each
//! kernel's parameters come from its `params()`).

use crate::emit::{indent, load_f32, store_f32};
use crate::Storage;

/// The body of a kernel over rows of `width` columns whose arguments are all
/// `[S, width]` of f32 values stored as `act` (`first` gives S): `consts`
/// statements before the loops, `element` the body for row `%r`, column `%i`.
pub fn rowwise(width: usize, act: Storage, first: &str, consts: &str, element: &str) -> String {
    let t = format!("memref<?x{width}x{}>", act.mlir_elem());
    format!(
        "%c0 = arith.constant 0 : index\n\
         %c1 = arith.constant 1 : index\n\
         %cw = arith.constant {width} : index\n\
         {consts}\
         %rows = memref.dim %{first}, %c0 : {t}\n\
         scf.for %r = %c0 to %rows step %c1 {{\n\
         \x20 scf.for %i = %c0 to %cw step %c1 {{\n\
         {element}\
         \x20 }}\n\
         }}\n\
         return\n",
        element = indent(element, 4),
    )
}

/// The body storing each row of `%x` (stored as `from`) as `into`: at row
/// `pos[r]` of `%y` (`scatter`) or at row `r`.
pub fn store_rows(width: usize, from: Storage, into: Storage, scatter: bool) -> String {
    let t = format!("memref<?x{width}x{}>", from.mlir_elem());
    let yt = format!("memref<?x{width}x{}>", into.mlir_elem());
    let (row, pos_load) = if scatter {
        ("%p", "\x20 %p64 = memref.load %pos[%r] : memref<?xi64>\n\x20 %p = arith.index_cast %p64 : i64 to index\n")
    } else {
        ("%r", "")
    };
    let load = load_f32("%v", "%x", &t, "%r", "%i", from);
    let store = store_f32("%v", "%y", &yt, row, "%i", into);
    format!(
        "%c0 = arith.constant 0 : index\n\
         %c1 = arith.constant 1 : index\n\
         %cw = arith.constant {width} : index\n\
         %rows = memref.dim %x, %c0 : {t}\n\
         scf.for %r = %c0 to %rows step %c1 {{\n\
         {pos_load}\
         \x20 scf.for %i = %c0 to %cw step %c1 {{\n\
         {load}\
         {store}\
         \x20 }}\n\
         }}\n\
         return\n",
        load = indent(&load, 4),
        store = indent(&store, 4),
    )
}
