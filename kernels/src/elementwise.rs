use crate::emit::{f32_lit, indent, load_f32, store_f32};
use crate::Storage;

/// A kernel over rows of `width` columns: `args` are its memref arguments
/// (all `[S, width]` of f32 values stored as `act`, the first gives S),
/// `consts` statements before the loops, `element` the body for row `%r`,
/// column `%i`.
fn rowwise(name: &str, width: usize, act: Storage, args: &[&str], consts: &str, element: &str) -> String {
    let t = format!("memref<?x{width}x{}>", act.mlir_elem());
    let params: Vec<String> = args.iter().map(|a| format!("%{a}: {t}")).collect();
    let body = format!(
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
        first = args[0],
        element = indent(element, 4),
    );
    format!("  func.func @{name}({}) attributes {{llvm.emit_c_interface}} {{\n{}  }}\n", params.join(", "), indent(&body, 4))
}

/// SwiGLU-OAI: `g' = min(g, limit)`, `u' = clamp(u, −limit, limit)`,
/// `y = g' · σ(alpha · g') · (u' + beta)`. `g`, `u`, `y`: `[S, width]`.
pub fn swiglu_oai(name: &str, width: usize, alpha: f64, limit: f64, beta: f64, act: Storage) -> String {
    let t = format!("memref<?x{width}x{}>", act.mlir_elem());
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
        name,
        width,
        act,
        &["g", "u", "y"],
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

/// Greedy sampling: the index of each row's largest value (the first on
/// ties; NaN ranks as -inf, so the id is always in range).
/// `x`: `[S, width]`, `ids`: `[S]` i64.
pub fn argmax(name: &str, width: usize) -> String {
    let t = format!("memref<?x{width}xf32>");
    let body = format!(
        "%c0 = arith.constant 0 : index\n\
         %c1 = arith.constant 1 : index\n\
         %cw = arith.constant {width} : index\n\
         %ninf = arith.constant 0xFF800000 : f32\n\
         %rows = memref.dim %x, %c0 : {t}\n\
         scf.for %r = %c0 to %rows step %c1 {{\n\
         \x20 %f0 = memref.load %x[%r, %c0] : {t}\n\
         \x20 %f0nan = arith.cmpf uno, %f0, %f0 : f32\n\
         \x20 %first = arith.select %f0nan, %ninf, %f0 : f32\n\
         \x20 %best:2 = scf.for %i = %c1 to %cw step %c1 iter_args(%bv = %first, %bi = %c0) -> (f32, index) {{\n\
         \x20   %v0 = memref.load %x[%r, %i] : {t}\n\
         \x20   %vnan = arith.cmpf uno, %v0, %v0 : f32\n\
         \x20   %v = arith.select %vnan, %ninf, %v0 : f32\n\
         \x20   %gt = arith.cmpf ogt, %v, %bv : f32\n\
         \x20   %nv = arith.select %gt, %v, %bv : f32\n\
         \x20   %ni = arith.select %gt, %i, %bi : index\n\
         \x20   scf.yield %nv, %ni : f32, index\n\
         \x20 }}\n\
         \x20 %id = arith.index_cast %best#1 : index to i64\n\
         \x20 memref.store %id, %ids[%r] : memref<?xi64>\n\
         }}\n\
         return\n"
    );
    format!("  func.func @{name}(%x: {t}, %ids: memref<?xi64>) attributes {{llvm.emit_c_interface}} {{\n{}  }}\n", indent(&body, 4))
}

/// `y = a + b` over rows of `width` (`y` may be `a`: the residual add in place).
pub fn add(name: &str, width: usize, act: Storage) -> String {
    let t = format!("memref<?x{width}x{}>", act.mlir_elem());
    rowwise(
        name,
        width,
        act,
        &["a", "b", "y"],
        "",
        &format!(
            "{}{}%s = arith.addf %x, %z : f32\n{}",
            load_f32("%x", "%a", &t, "%r", "%i", act),
            load_f32("%z", "%b", &t, "%r", "%i", act),
            store_f32("%s", "%y", &t, "%r", "%i", act)
        ),
    )
}

/// Row gather: `y[r] = f32(W[ids[r]])`. Ids are checked against the vocabulary
/// by the runtime before a step starts.
pub fn embedding(name: &str, vocab: usize, width: usize, weight: crate::WeightType, act: Storage) -> String {
    let t = format!("memref<?x{width}x{}>", act.mlir_elem());
    let wt = format!("memref<{vocab}x{width}x{}>", weight.mlir_elem());
    let body = format!(
        "%c0 = arith.constant 0 : index\n\
         %c1 = arith.constant 1 : index\n\
         %cw = arith.constant {width} : index\n\
         %rows = memref.dim %ids, %c0 : memref<?xi64>\n\
         scf.for %r = %c0 to %rows step %c1 {{\n\
         \x20 %id64 = memref.load %ids[%r] : memref<?xi64>\n\
         \x20 %id = arith.index_cast %id64 : i64 to index\n\
         \x20 scf.for %i = %c0 to %cw step %c1 {{\n\
         {load}\
         {store}\
         \x20 }}\n\
         }}\n\
         return\n",
        load = indent(&crate::emit::load_weight_f32("%wv", "%w", "%id, %i", &wt, weight), 4),
        store = indent(&store_f32("%wv", "%y", &t, "%r", "%i", act), 4),
    );
    format!(
        "  func.func @{name}(%ids: memref<?xi64>, %w: {wt}, %y: {t}) attributes {{llvm.emit_c_interface}} {{\n{}  }}\n",
        indent(&body, 4)
    )
}

/// Row `r` of `x` into row `pos[r]` of `y`. `x`: `[S, width]` stored as
/// `act`, `pos`: `[S]`, `y`: `[T, width]` (a cache of `cache`'s type; every
/// `pos[r] < T`).
pub fn scatter_rows(name: &str, width: usize, cache: Storage, act: Storage) -> String {
    store_rows(name, width, act, cache, true)
}

/// `y = bf16(x)` (nearest even, as `i16` bits). `x`, `y`: `[S, width]`.
pub fn to_bf16(name: &str, width: usize) -> String {
    store_rows(name, width, Storage::F32, Storage::Bf16, false)
}

/// Each row of `x` (stored as `from`) stored as `into`: at row `pos[r]` of
/// `y` (`scatter`) or at row `r`.
fn store_rows(name: &str, width: usize, from: Storage, into: Storage, scatter: bool) -> String {
    let t = format!("memref<?x{width}x{}>", from.mlir_elem());
    let yt = format!("memref<?x{width}x{}>", into.mlir_elem());
    let (row, pos_param, pos_load) = if scatter {
        (
            "%p",
            ", %pos: memref<?xi64>",
            "\x20 %p64 = memref.load %pos[%r] : memref<?xi64>\n\x20 %p = arith.index_cast %p64 : i64 to index\n",
        )
    } else {
        ("%r", "", "")
    };
    let load = load_f32("%v", "%x", &t, "%r", "%i", from);
    let store = store_f32("%v", "%y", &yt, row, "%i", into);
    let body = format!(
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
    );
    format!("  func.func @{name}(%x: {t}{pos_param}, %y: {yt}) attributes {{llvm.emit_c_interface}} {{\n{}  }}\n", indent(&body, 4))
}
