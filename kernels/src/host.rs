//! Host-body helpers shared by several kernels (the bodies only: each
//! kernel's parameters come from its `params()`).

use crate::emit::{indent, load_f32, store_f32};
use crate::Storage;

/// The constants host bodies share: `%c0`, `%c1`, `%zero` and `%one`.
pub const BASICS: &str = "%c0 = arith.constant 0 : index\n\
                          %c1 = arith.constant 1 : index\n\
                          %zero = arith.constant 0.0 : f32\n\
                          %one = arith.constant 1.0 : f32\n";

/// `%NAME = arith.constant VALUE : index` for each pair, one per line.
pub fn index_consts(pairs: &[(&str, usize)]) -> String {
    pairs.iter().map(|(n, v)| format!("%{n} = arith.constant {v} : index\n")).collect()
}

/// The body of a loop over the rows of `%{rows_of}` (a memref of type
/// `ty` whose first dimension is S) and the `width` columns of each:
/// `consts` before the loops, `row` at the start of row `%r`, `element` for
/// row `%r`, column `%i`.
pub fn row_loop(rows_of: &str, ty: &str, width: usize, consts: &str, row: &str, element: &str) -> String {
    format!(
        "%c0 = arith.constant 0 : index\n\
         %c1 = arith.constant 1 : index\n\
         %cw = arith.constant {width} : index\n\
         {consts}\
         %rows = memref.dim %{rows_of}, %c0 : {ty}\n\
         scf.for %r = %c0 to %rows step %c1 {{\n\
         {row}\
         \x20 scf.for %i = %c0 to %cw step %c1 {{\n\
         {element}\
         \x20 }}\n\
         }}\n\
         return\n",
        row = indent(row, 2),
        element = indent(element, 4),
    )
}

/// The body of a kernel over rows of `width` columns whose arguments are all
/// `[S, width]` of f32 values stored as `act` (`first` gives S): `consts`
/// statements before the loops, `element` the body for row `%r`, column `%i`.
pub fn rowwise(width: usize, act: Storage, first: &str, consts: &str, element: &str) -> String {
    row_loop(first, &act.rows_ty(width), width, consts, "", element)
}

/// The body storing each row of `%x` (stored as `from`) as `into`: at row
/// `pos[r]` of `%y` (`scatter`) or at row `r`.
pub fn store_rows(width: usize, from: Storage, into: Storage, scatter: bool) -> String {
    let t = from.rows_ty(width);
    let yt = into.rows_ty(width);
    let (row, pos_load) = if scatter {
        ("%p", "%p64 = memref.load %pos[%r] : memref<?xi64>\n%p = arith.index_cast %p64 : i64 to index\n")
    } else {
        ("%r", "")
    };
    let element = load_f32("%v", "%x", &t, "%r", "%i", from) + &store_f32("%v", "%y", &yt, row, "%i", into);
    row_loop("x", &t, width, "", pos_load, &element)
}
