//! Memref views over raw pointers. Weights, caches and activations reach a
//! stage as plain pointers (the runtime maps tensors where the checkpoint
//! keeps them); these helpers give them memref types with the compiled
//! shapes, so every kernel works on memrefs and never sees a pointer.

use crate::emit::indent;

/// A memref type: each dim is fixed, or `None` for one given at run time.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MemTy {
    pub dims: Vec<Option<usize>>,
    pub elem: &'static str,
}

impl MemTy {
    /// `[?, width]` rows of `elem`.
    pub fn rows(width: usize, elem: &'static str) -> MemTy {
        MemTy { dims: vec![None, Some(width)], elem }
    }
    pub fn fixed(dims: &[usize], elem: &'static str) -> MemTy {
        MemTy { dims: dims.iter().map(|&d| Some(d)).collect(), elem }
    }

    pub fn mlir(&self) -> String {
        let dims: Vec<String> = self.dims.iter().map(|d| d.map_or("?".to_string(), |n| n.to_string())).collect();
        format!("memref<{}x{}>", dims.join("x"), self.elem)
    }

    fn tag(&self) -> String {
        let dims: Vec<String> = self.dims.iter().map(|d| d.map_or("d".to_string(), |n| n.to_string())).collect();
        format!("{}x{}", dims.join("x"), self.elem)
    }

    /// Name of the helper that views a pointer as this type.
    pub fn view_fn(&self) -> String {
        format!("m3c_view_{}", self.tag())
    }

    /// The helper: `(%p: !llvm.ptr, %n: index) -> memref`, where `%n` is the
    /// run-time extent of the first dim (ignored when that dim is fixed).
    /// Row-major strides, offset 0. The descriptor is built in the LLVM
    /// dialect and cast to the memref type; the host lowering folds the cast
    /// away (reconcile-unrealized-casts).
    pub fn view_fn_text(&self) -> String {
        let rank = self.dims.len();
        let st = format!("!llvm.struct<(ptr, ptr, i64, array<{rank} x i64>, array<{rank} x i64>)>");
        let mut body = String::from(
            "%n64 = arith.index_cast %n : index to i64\n\
             %z = llvm.mlir.constant(0 : i64) : i64\n",
        );
        body.push_str(&format!("%d0 = llvm.mlir.undef : {st}\n"));
        body.push_str(&format!("%d1 = llvm.insertvalue %p, %d0[0] : {st}\n"));
        body.push_str(&format!("%d2 = llvm.insertvalue %p, %d1[1] : {st}\n"));
        body.push_str(&format!("%d3 = llvm.insertvalue %z, %d2[2] : {st}\n"));
        let mut cur = 3;
        let mut stride = 1usize;
        let mut strides = vec![String::new(); rank];
        // Strides from the innermost dim out; a dynamic dim can only be the first.
        for i in (0..rank).rev() {
            strides[i] = format!("%s{i}");
            body.push_str(&format!("%s{i} = llvm.mlir.constant({stride} : i64) : i64\n"));
            if let Some(d) = self.dims[i] {
                stride *= d;
            }
        }
        for (i, d) in self.dims.iter().enumerate() {
            let size = match d {
                Some(n) => {
                    body.push_str(&format!("%e{i} = llvm.mlir.constant({n} : i64) : i64\n"));
                    format!("%e{i}")
                }
                None => "%n64".to_string(),
            };
            body.push_str(&format!("%d{} = llvm.insertvalue {size}, %d{cur}[3, {i}] : {st}\n", cur + 1));
            cur += 1;
            body.push_str(&format!("%d{} = llvm.insertvalue {}, %d{cur}[4, {i}] : {st}\n", cur + 1, strides[i]));
            cur += 1;
        }
        let ty = self.mlir();
        body.push_str(&format!("%m = builtin.unrealized_conversion_cast %d{cur} : {st} to {ty}\nreturn %m : {ty}\n"));
        format!("  func.func private @{}(%p: !llvm.ptr, %n: index) -> {ty} {{\n{}  }}\n", self.view_fn(), indent(&body, 4))
    }
}
