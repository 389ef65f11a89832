//! A small typed emitter for kernel bodies: values that carry their MLIR
//! type, fresh names, a constant pool, and warp reductions as a helper (no
//! text rewriting afterwards). Kernels emit MLIR text, as naga's back ends
//! do; what this removes is implicit name contracts between snippets: a
//! value is a [`Value`] handed from one helper to the next.

use std::collections::BTreeMap;
use std::fmt;

/// An SSA value with its MLIR type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Value {
    pub name: String,
    pub ty: String,
}

impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name)
    }
}

/// A warp reduction's combining operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reduce {
    Add,
    Max,
    MinSi,
}

impl Reduce {
    fn op(self) -> &'static str {
        match self {
            Reduce::Add => "arith.addf",
            Reduce::Max => "arith.maximumf",
            Reduce::MinSi => "arith.minsi",
        }
    }
}

/// `dst` = the reduction of `src` (of type `ty`) over the `warp` lanes of a
/// warp: a butterfly of `gpu.shuffle xor` (offsets `warp/2`, …, 2, 1), so
/// every lane ends with the result (the NVVM lowering has no f32 subgroup
/// reduction). Local names derive from `dst`.
pub fn warp_reduce(warp: usize, dst: &str, op: Reduce, src: &str, ty: &str) -> String {
    assert!(warp.is_power_of_two() && warp > 1, "a warp of {warp} lanes");
    let base = dst.trim_start_matches('%');
    let mut out = format!("%{base}_w{warp} = arith.constant {warp} : i32\n");
    let mut cur = src.to_string();
    let steps = warp.trailing_zeros() as usize;
    for k in 0..steps {
        let off = warp >> (k + 1);
        out.push_str(&format!(
            "%{base}_o{k} = arith.constant {off} : i32\n\
             %{base}_s{k}, %{base}_v{k} = gpu.shuffle xor {cur}, %{base}_o{k}, %{base}_w{warp} : {ty}\n"
        ));
        let next = if k + 1 == steps { dst.to_string() } else { format!("%{base}_r{k}") };
        out.push_str(&format!("{next} = {} {cur}, %{base}_s{k} : {ty}\n", op.op()));
        cur = next;
    }
    out
}

/// Statements under construction, with fresh names and pooled constants.
pub struct Builder {
    prefix: String,
    next: usize,
    consts: BTreeMap<(String, String), Value>,
    body: String,
}

impl Builder {
    /// Names are `%{prefix}{n}`; `prefix` keeps two builders' names apart.
    pub fn new(prefix: &str) -> Builder {
        Builder { prefix: prefix.to_string(), next: 0, consts: BTreeMap::new(), body: String::new() }
    }

    /// A new value of type `ty`.
    pub fn fresh(&mut self, ty: &str) -> Value {
        self.next += 1;
        Value { name: format!("%{}{}", self.prefix, self.next), ty: ty.to_string() }
    }

    /// A constant (`arith.constant LIT : TY`), emitted once per builder.
    pub fn constant(&mut self, lit: &str, ty: &str) -> Value {
        let key = (lit.to_string(), ty.to_string());
        if let Some(v) = self.consts.get(&key) {
            return v.clone();
        }
        let v = self.fresh(ty);
        self.consts.insert(key, v.clone());
        v
    }

    /// An index constant.
    pub fn index(&mut self, n: usize) -> Value {
        self.constant(&n.to_string(), "index")
    }

    /// An f32 constant (exactly as `crate::emit::f32_lit` writes it).
    pub fn f32(&mut self, x: f64) -> Value {
        self.constant(&crate::emit::f32_lit(x), "f32")
    }

    /// `%v = OP ARGS : TY` with a fresh `%v` of type `ty`; `op_args` is the
    /// text between `=` and ` : TY`.
    pub fn op(&mut self, ty: &str, op_args: &str) -> Value {
        let v = self.fresh(ty);
        self.body.push_str(&format!("{v} = {op_args} : {ty}\n"));
        v
    }

    /// A binary f32 (or vector) arithmetic op on two values of one type.
    pub fn binary(&mut self, op: &str, a: &Value, b: &Value) -> Value {
        let ty = a.ty.clone();
        self.op(&ty, &format!("{op} {a}, {b}"))
    }

    /// A unary op (`math.erf`, `arith.negf`, ...).
    pub fn unary(&mut self, op: &str, a: &Value) -> Value {
        let ty = a.ty.clone();
        self.op(&ty, &format!("{op} {a}"))
    }

    /// A statement with no result, or text from another emitter.
    pub fn line(&mut self, text: &str) {
        self.body.push_str(text);
        if !text.ends_with('\n') {
            self.body.push('\n');
        }
    }

    /// The constants, then the statements.
    pub fn finish(self) -> String {
        let mut out = String::new();
        for ((lit, ty), v) in &self.consts {
            out.push_str(&format!("{v} = arith.constant {lit} : {ty}\n"));
        }
        out + &self.body
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constants_are_pooled_and_names_fresh() {
        let mut b = Builder::new("t");
        let one = b.f32(1.0);
        assert_eq!(b.f32(1.0), one);
        let x = b.fresh("f32");
        let y = b.binary("arith.addf", &x, &one);
        assert_ne!(x, y);
        let text = b.finish();
        assert_eq!(text.matches("arith.constant").count(), 1, "{text}");
        assert!(text.contains(&format!("{y} = arith.addf {x}, {one} : f32")), "{text}");
    }

    #[test]
    fn a_warp_reduction_is_a_butterfly_of_log2_warp_steps() {
        let t = warp_reduce(32, "%s", Reduce::Add, "%a", "f32");
        assert_eq!(t.matches("gpu.shuffle xor").count(), 5);
        assert!(t.contains("%s_o0 = arith.constant 16 : i32"), "{t}");
        assert!(t.trim_end().ends_with("%s = arith.addf %s_r3, %s_s4 : f32"), "{t}");
        let w = warp_reduce(64, "%s", Reduce::Max, "%a", "f32");
        assert_eq!(w.matches("gpu.shuffle xor").count(), 6);
        assert!(w.contains("%s_o0 = arith.constant 32 : i32") && w.contains(", %s_w64 : f32"), "{w}");
        assert!(w.trim_end().ends_with("%s = arith.maximumf %s_r4, %s_s5 : f32"), "{w}");
    }
}
