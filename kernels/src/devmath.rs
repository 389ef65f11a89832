//! Math functions written out in MLIR for a GPU target without a device
//! library ([`DeviceMath::Inline`]): `sin`, `cos`, `erf` and `rsqrt` on f32
//! and `ceil` on f64 become arithmetic the target lowers to native
//! instructions. ROCm's `convert-gpu-to-rocdl` turns these five into calls
//! to ROCm's device library (`__ocml_*`), which would need a ROCm install
//! on the machine that compiles; written out, they need nothing.
//!
//! Accuracy: each f32 function is computed in f64 and rounded once, so it
//! is the correctly rounded f32 result but in rare ties, as the host's
//! libm (glibc) is for these inputs.
//! - `sin`/`cos`: Cody–Waite reduction by π/2 in three parts (the first two
//!   of 33 bits, so `k·P1` and `k·P2` are exact for |k| < 2^20, angles up to
//!   1.6 million radians: RoPE's positions times frequencies up to 1), then
//!   Taylor polynomials on |r| ≤ π/4 whose truncation error is below 1e-17.
//! - `erf`: its Maclaurin series in 60 terms on x clamped to [−4, 4]
//!   (erf(4) rounds to 1 in f32); cancellation leaves errors below 5e-11.
//! - `rsqrt`: `1/sqrt(x)`, as the host lowers it (both correctly rounded).
//! - `ceil` (the sampler's f64): through a truncating integer conversion.
//!
//! `tests/it/gpu_kernels.rs` runs every kernel that uses them in the SIMT
//! interpreter against the host kernels.

use std::fmt::Write;

/// How a GPU target gets `sin`, `cos`, `erf`, `rsqrt` and `ceil`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceMath {
    /// As `math` ops, which the target's lowering maps to its vendor's
    /// library (CUDA's libdevice, found through the toolkit).
    Library,
    /// Written out by [`expand`].
    Inline,
}

/// The `math` ops [`expand`] writes out.
pub const EXPANDED: &[&str] = &["math.sin", "math.cos", "math.erf", "math.rsqrt", "math.ceil"];

/// `body` with every scalar `%d = math.OP %x : T` of [`EXPANDED`] written
/// out; other lines unchanged.
pub fn expand(body: &str) -> String {
    let mut out = String::with_capacity(body.len());
    for line in body.split_inclusive('\n') {
        match parse(line) {
            Some((d, op, x, ty)) => {
                let lead = &line[..line.len() - line.trim_start().len()];
                let text = match (op, ty) {
                    ("sin", "f32") => sin_cos(d, x, false),
                    ("cos", "f32") => sin_cos(d, x, true),
                    ("erf", "f32") => erf(d, x),
                    ("rsqrt", "f32") => rsqrt(d, x),
                    ("ceil", "f64") => ceil(d, x),
                    _ => {
                        out.push_str(line);
                        continue;
                    }
                };
                for l in text.lines() {
                    let _ = writeln!(out, "{lead}{l}");
                }
            }
            None => out.push_str(line),
        }
    }
    out
}

/// (`%d`, op, `%x`, type) of a line `%d = math.OP %x : T`.
fn parse(line: &str) -> Option<(&str, &str, &str, &str)> {
    let (d, rest) = line.trim().split_once(" = math.")?;
    let (op, rest) = rest.split_once(' ')?;
    let (x, ty) = rest.split_once(" : ")?;
    let ssa = |s: &str| s.starts_with('%') && s[1..].chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    (ssa(d) && ssa(x) && EXPANDED.contains(&&format!("math.{op}")[..])).then_some((d, op, x, ty))
}

/// An f64 constant, exactly: MLIR's hexadecimal form of its bits.
fn lit(v: f64) -> String {
    format!("0x{:016X}", v.to_bits())
}

/// A polynomial `Σ c[i]·y^i` (two or more terms) by Horner in f64, its
/// value named `p`.
fn horner(p: &str, y: &str, coeffs: &[f64]) -> String {
    let n = coeffs.len();
    let h = |i: usize| if i == 0 { p.to_string() } else { format!("{p}_h{i}") };
    let mut s = format!("{} = arith.constant {} : f64\n", h(n - 1), lit(coeffs[n - 1]));
    for i in (0..n - 1).rev() {
        let _ = writeln!(
            s,
            "{p}_m{i} = arith.mulf {}, {y} : f64\n{p}_c{i} = arith.constant {} : f64\n{} = arith.addf {p}_m{i}, {p}_c{i} : f64",
            h(i + 1),
            lit(coeffs[i]),
            h(i)
        );
    }
    s
}

fn factorial(n: u32) -> f64 {
    (1..=n).map(f64::from).product()
}

/// π/2 = P1 + P2 + P3, P1 and P2 of 33 significant bits.
const PIO2: [f64; 3] = [1.5707963267341256, 6.077100506303966e-11, 2.0222662487959506e-21];

fn sin_cos(d: &str, x: &str, cos: bool) -> String {
    let sin_c: Vec<f64> = (0..9).map(|n| (-1f64).powi(n) / factorial(2 * n as u32 + 1)).collect();
    let cos_c: Vec<f64> = (0..10).map(|n| (-1f64).powi(n) / factorial(2 * n as u32)).collect();
    // sin(x) by quadrant k mod 4: s, c, −s, −c; cos(x): c, −s, −c, s.
    // An odd k swaps the two; bit 1 of k (of k + 1 for cos) negates.
    let (flip, pick, other) = if cos { ("1", "s", "c") } else { ("0", "c", "s") };
    format!(
        "{d}_x = arith.extf {x} : f32 to f64\n\
         {d}_2opi = arith.constant {} : f64\n{d}_y = arith.mulf {d}_x, {d}_2opi : f64\n\
         {d}_half = arith.constant 0.5 : f64\n{d}_nhalf = arith.constant -0.5 : f64\n{d}_f0 = arith.constant 0.0 : f64\n\
         {d}_neg = arith.cmpf olt, {d}_y, {d}_f0 : f64\n{d}_bias = arith.select {d}_neg, {d}_nhalf, {d}_half : f64\n\
         {d}_yb = arith.addf {d}_y, {d}_bias : f64\n{d}_k = arith.fptosi {d}_yb : f64 to i64\n{d}_kf = arith.sitofp {d}_k : i64 to f64\n\
         {d}_p1 = arith.constant {} : f64\n{d}_p2 = arith.constant {} : f64\n{d}_p3 = arith.constant {} : f64\n\
         {d}_k1 = arith.mulf {d}_kf, {d}_p1 : f64\n{d}_r1 = arith.subf {d}_x, {d}_k1 : f64\n\
         {d}_k2 = arith.mulf {d}_kf, {d}_p2 : f64\n{d}_r2 = arith.subf {d}_r1, {d}_k2 : f64\n\
         {d}_k3 = arith.mulf {d}_kf, {d}_p3 : f64\n{d}_r = arith.subf {d}_r2, {d}_k3 : f64\n\
         {d}_rr = arith.mulf {d}_r, {d}_r : f64\n\
         {ps}{d}_s = arith.mulf {d}_r, {d}_ps : f64\n{pc}\
         {d}_i1 = arith.constant 1 : i64\n{d}_i2 = arith.constant 2 : i64\n{d}_i0 = arith.constant 0 : i64\n\
         {d}_flip = arith.constant {flip} : i64\n{d}_q = arith.addi {d}_k, {d}_flip : i64\n\
         {d}_odd = arith.andi {d}_k, {d}_i1 : i64\n{d}_swap = arith.cmpi ne, {d}_odd, {d}_i0 : i64\n\
         {d}_v = arith.select {d}_swap, {d}_{pick}, {d}_{other} : f64\n\
         {d}_hi = arith.andi {d}_q, {d}_i2 : i64\n{d}_isneg = arith.cmpi ne, {d}_hi, {d}_i0 : i64\n\
         {d}_nv = arith.negf {d}_v : f64\n{d}_w = arith.select {d}_isneg, {d}_nv, {d}_v : f64\n\
         {d} = arith.truncf {d}_w : f64 to f32\n",
        lit(2.0 / std::f64::consts::PI),
        lit(PIO2[0]),
        lit(PIO2[1]),
        lit(PIO2[2]),
        ps = horner(&format!("{d}_ps"), &format!("{d}_rr"), &sin_c),
        pc = horner(&format!("{d}_c"), &format!("{d}_rr"), &cos_c),
    )
}

fn erf(d: &str, x: &str) -> String {
    let two_over_sqrt_pi = 2.0 / std::f64::consts::PI.sqrt();
    let c: Vec<f64> = (0..60).map(|n| (-1f64).powi(n) * two_over_sqrt_pi / (factorial(n as u32) * (2 * n + 1) as f64)).collect();
    format!(
        "{d}_x = arith.extf {x} : f32 to f64\n\
         {d}_lim = arith.constant 4.0 : f64\n{d}_nlim = arith.constant -4.0 : f64\n\
         {d}_t1 = arith.minimumf {d}_x, {d}_lim : f64\n{d}_t = arith.maximumf {d}_t1, {d}_nlim : f64\n\
         {d}_y = arith.mulf {d}_t, {d}_t : f64\n{p}{d}_w = arith.mulf {d}_t, {d}_p : f64\n\
         {d} = arith.truncf {d}_w : f64 to f32\n",
        p = horner(&format!("{d}_p"), &format!("{d}_y"), &c),
    )
}

fn rsqrt(d: &str, x: &str) -> String {
    format!("{d}_s = math.sqrt {x} : f32\n{d}_one = arith.constant 1.0 : f32\n{d} = arith.divf {d}_one, {d}_s : f32\n")
}

fn ceil(d: &str, x: &str) -> String {
    format!(
        "{d}_i = arith.fptosi {x} : f64 to i64\n{d}_t = arith.sitofp {d}_i : i64 to f64\n\
         {d}_up = arith.cmpf olt, {d}_t, {x} : f64\n{d}_one = arith.constant 1.0 : f64\n\
         {d}_t1 = arith.addf {d}_t, {d}_one : f64\n{d} = arith.select {d}_up, {d}_t1, {d}_t : f64\n"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_scalar_library_functions_are_written_out() {
        let body = "%a = math.exp %x : f32\n  %b = math.sin %x : f32\n%c = math.rsqrt %v : vector<4xf32>\n%d = math.ceil %g : f64\n";
        let out = expand(body);
        assert!(out.starts_with("%a = math.exp %x : f32\n  %b_x = arith.extf %x : f32 to f64\n"), "{out}");
        assert!(out.contains("  %b = arith.truncf %b_w : f64 to f32\n"));
        assert!(out.contains("%c = math.rsqrt %v : vector<4xf32>\n"), "a vector op is left for the back end's check");
        assert!(out.contains("%d = arith.select %d_up, %d_t1, %d_t : f64\n") && !out.contains("math.ceil") && !out.contains("math.sin"));
    }

    #[test]
    fn the_split_of_pi_over_2_is_exact_where_it_must_be() {
        // P1 and P2 have at most 33 significant bits: k·P1, k·P2 exact for |k| < 2^20.
        for p in &PIO2[..2] {
            assert_eq!(p.to_bits() & ((1 << 20) - 1), 0, "{p}");
        }
        let sum = PIO2[0] + PIO2[1];
        assert!((sum - std::f64::consts::FRAC_PI_2).abs() <= f64::EPSILON);
    }
}
