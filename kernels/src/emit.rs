//! Small pieces of MLIR text shared by the generators.

use crate::WeightType;

/// An f32 literal MLIR parses back to the same bits.
pub fn f32_lit(x: f64) -> String {
    let v = x as f32;
    if v.is_finite() {
        // MLIR float literals need a decimal point; 9 significant digits round-trip an f32.
        format!("{:.8e}", v)
    } else {
        format!("0x{:08X}", v.to_bits())
    }
}

/// Loads element `[idx]` of a weight memref `w` of type `ty` and widens it to
/// f32 (`%dst`); not for MXFP8, whose elements go through the lookup table.
pub fn load_weight_f32(dst: &str, w: &str, idx: &str, ty: &str, weight: WeightType) -> String {
    match weight {
        WeightType::F32 => format!("{dst} = memref.load {w}[{idx}] : {ty}\n"),
        WeightType::BF16 | WeightType::F16 => {
            format!("{dst}_n = memref.load {w}[{idx}] : {ty}\n{dst} = arith.extf {dst}_n : {} to f32\n", weight.mlir_elem())
        }
        WeightType::Mxfp8 { .. } => unreachable!("MXFP8 weights are decoded per block"),
    }
}

/// Value of every `float8_e4m3fn` byte (0x7F and 0xFF are NaN).
pub fn fp8_e4m3_value(byte: u8) -> f32 {
    let sign = if byte & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = ((byte >> 3) & 0x0F) as i32;
    let man = (byte & 0x07) as f32;
    if exp == 0x0F && byte & 0x07 == 0x07 {
        return f32::NAN;
    }
    let mag = if exp == 0 { man / 8.0 * 2f32.powi(-6) } else { (1.0 + man / 8.0) * 2f32.powi(exp - 7) };
    sign * mag
}

/// The fp8 → f32 table as a private constant global.
pub fn fp8_lut_global() -> String {
    let vals: Vec<String> = (0..=255u8)
        .map(|b| {
            let v = fp8_e4m3_value(b);
            if v.is_nan() {
                "0x7FC00000".to_string()
            } else {
                f32_lit(v as f64)
            }
        })
        .collect();
    format!("  memref.global \"private\" constant @m3c_fp8_e4m3_lut : memref<256xf32> = dense<[{}]>\n", vals.join(", "))
}

/// `%dst` = 2^(s − 127) for the E8M0 byte `%src` (i8): the exponent bits of
/// an f32, with 0 → 2^-127 (a subnormal) and 255 → NaN as in the format.
pub fn e8m0_to_f32(dst: &str, src: &str) -> String {
    format!(
        "{dst}_u = arith.extui {src} : i8 to i32\n\
         {dst}_sh = arith.shli {dst}_u, %c23_i32 : i32\n\
         {dst}_is0 = arith.cmpi eq, {dst}_u, %c0_i32 : i32\n\
         {dst}_is255 = arith.cmpi eq, {dst}_u, %c255_i32 : i32\n\
         {dst}_a = arith.select {dst}_is0, %c_sub_i32, {dst}_sh : i32\n\
         {dst}_b = arith.select {dst}_is255, %c_nan_i32, {dst}_a : i32\n\
         {dst} = arith.bitcast {dst}_b : i32 to f32\n"
    )
}

/// The integer constants `e8m0_to_f32` uses.
pub const E8M0_CONSTANTS: &str = "%c23_i32 = arith.constant 23 : i32\n\
     %c0_i32 = arith.constant 0 : i32\n\
     %c255_i32 = arith.constant 255 : i32\n\
     %c_sub_i32 = arith.constant 4194304 : i32\n\
     %c_nan_i32 = arith.constant 2143289344 : i32\n";

/// RoPE's rotation of the pair `(%a, %b)` by the angle whose cosine and
/// sine are `%cs`, `%sn`: `%y1 = a·cos − b·sin`, `%y2 = b·cos + a·sin`, each
/// product rounded before the sum, as the reference's `rotate_half` does.
pub const ROTATE: &str = "%ac = arith.mulf %a, %cs : f32\n\
                          %bs = arith.mulf %b, %sn : f32\n\
                          %y1 = arith.subf %ac, %bs : f32\n\
                          %bc = arith.mulf %b, %cs : f32\n\
                          %as = arith.mulf %a, %sn : f32\n\
                          %y2 = arith.addf %bc, %as : f32\n";

/// The end of a reduction loop's body that carries `acc` (of type `ty`):
/// `prod = x·y`, then `acc2 = acc + prod`, yielded (the per-element step of
/// the linear and attention dot products).
pub fn mul_add_yield(acc: &str, prod: &str, x: &str, y: &str, ty: &str) -> String {
    format!("{prod} = arith.mulf {x}, {y} : {ty}\n{acc}2 = arith.addf {acc}, {prod} : {ty}\nscf.yield {acc}2 : {ty}\n")
}

/// Indents every line of `body` by `n` spaces.
pub fn indent(body: &str, n: usize) -> String {
    let pad = " ".repeat(n);
    body.lines().map(|l| if l.is_empty() { "\n".to_string() } else { format!("{pad}{l}\n") }).collect()
}

/// Gemma RMSNorm of one span of a row, as MLIR statements: the `width`
/// columns of row `%r` of `%x` (type `xty`) starting at index `%base`,
/// normalised in f32 and scaled by `(1 + w[i])`. `store` is the statement
/// that writes each result `%o` (it may use `%i`, the position in the span,
/// and `%c`, the column). Needs `%c0`, `%c1`, `%zero`, `%one`, `%n` (the width
/// as f32) and `%eps` in scope. `%x` holds values stored as `act`.
/// `offset` is `%one` for Gemma's `(1 + w)` and `%zero` for a plain RMSNorm's
/// `w` (`0 + w` is `w` exactly, so the two share one body).
#[allow(clippy::too_many_arguments)]
pub fn gemma_norm_span(
    xty: &str,
    act: crate::Storage,
    base: &str,
    width: &str,
    wty: &str,
    weight: WeightType,
    offset: &str,
    store: &str,
) -> String {
    let load = indent(&load_f32("%v", "%x", xty, "%r", "%c", act), 2);
    format!(
        "%ss = scf.for %i = %c0 to {width} step %c1 iter_args(%acc = %zero) -> (f32) {{\n\
         \x20 %c = arith.addi {base}, %i : index\n\
         {load}\
         \x20 %sq = arith.mulf %v, %v : f32\n\
         \x20 %a = arith.addf %acc, %sq : f32\n\
         \x20 scf.yield %a : f32\n\
         }}\n\
         %mean = arith.divf %ss, %n : f32\n\
         %me = arith.addf %mean, %eps : f32\n\
         %rs = math.rsqrt %me : f32\n\
         scf.for %i = %c0 to {width} step %c1 {{\n\
         \x20 %c = arith.addi {base}, %i : index\n\
         {load}\
         {wload}\
         \x20 %s = arith.addf {offset}, %wf : f32\n\
         \x20 %t = arith.mulf %v, %rs : f32\n\
         \x20 %o = arith.mulf %t, %s : f32\n\
         {store}\
         }}\n",
        wload = indent(&load_weight_f32("%wf", "%w", "%i", wty, weight), 2),
        store = indent(store, 2),
    )
}

/// Multiply-adds below which a kernel runs on the calling thread: forking
/// threads costs a few microseconds, about this much work on one core.
pub const PARALLEL_MIN_WORK: usize = 1 << 17;

/// `body` over the loop nest `ivs` (with bounds `lbs`, `ubs`, `steps`, SSA
/// names): as one `scf.parallel` (an OpenMP loop on the host) when `work`
/// (an index SSA value: multiply-adds of the call) reaches
/// [`PARALLEL_MIN_WORK`], else as plain `scf.for` loops. Both run the same
/// body text, so results do not depend on which ran.
pub fn parallel_or_serial(work: &str, ivs: &[&str], lbs: &[&str], ubs: &[&str], steps: &[&str], body: &str) -> String {
    let mut serial_open = String::new();
    let mut serial_close = String::new();
    for (i, iv) in ivs.iter().enumerate() {
        serial_open.push_str(&format!("{}scf.for {iv} = {} to {} step {} {{\n", "  ".repeat(i), lbs[i], ubs[i], steps[i]));
    }
    for i in (0..ivs.len()).rev() {
        serial_close.push_str(&format!("{}}}\n", "  ".repeat(i)));
    }
    format!(
        "%par_min = arith.constant {PARALLEL_MIN_WORK} : index\n\
         %par_big = arith.cmpi uge, {work}, %par_min : index\n\
         scf.if %par_big {{\n\
         \x20 scf.parallel ({}) = ({}) to ({}) step ({}) {{\n\
         {}\
         \x20   scf.reduce\n\
         \x20 }}\n\
         }} else {{\n\
         {}\
         }}\n",
        ivs.join(", "),
        lbs.join(", "),
        ubs.join(", "),
        steps.join(", "),
        indent(body, 4),
        indent(&format!("{serial_open}{}{serial_close}", indent(body, 2 * ivs.len())), 2),
    )
}

/// `{dst}` (f32) = element `[r, c]` of `mem` (type `ty`), stored as
/// `store`: a load, and for bf16 bits the widening `f32::from_bits((b as u32) << 16)`.
pub fn load_f32(dst: &str, mem: &str, ty: &str, r: &str, c: &str, store: crate::Storage) -> String {
    match store {
        crate::Storage::F32 => format!("{dst} = memref.load {mem}[{r}, {c}] : {ty}\n"),
        crate::Storage::Bf16 => format!(
            "{dst}_lh = memref.load {mem}[{r}, {c}] : {ty}\n\
             {dst}_lw = arith.extui {dst}_lh : i16 to i32\n\
             {dst}_lk = arith.constant 16 : i32\n\
             {dst}_ls = arith.shli {dst}_lw, {dst}_lk : i32\n\
             {dst} = arith.bitcast {dst}_ls : i32 to f32\n"
        ),
        crate::Storage::Fp8 => format!(
            "{dst}_lq = memref.load {mem}[{r}, {c}] : {ty}\n\
             {dst}_lw = arith.extui {dst}_lq : i8 to i32\n{}",
            fp8_decode(dst, &format!("{dst}_lw"), "i32", "f32", &|v, t| format!("arith.constant {v} : {t}"))
        ),
    }
}

/// `{dst}` (f32, or a vector of them) = the `float8_e4m3fn` value of the
/// byte in the low bits of `{w}` (i32s of type `it`): sign, exponent (bias
/// 7) and 3 mantissa bits placed into an f32 for normals, `m · 2^-9` for
/// subnormals, NaN for 0x7F and 0xFF. `k(value, type)` writes a constant.
fn fp8_decode(dst: &str, w: &str, it: &str, ft: &str, k: &dyn Fn(&str, &str) -> String) -> String {
    format!(
        "{dst}_f7 = {k7}\n{dst}_f3 = {k3}\n{dst}_f15 = {k15}\n{dst}_f127 = {k127}\n{dst}_f128 = {k128}\n\
         {dst}_f24 = {k24}\n{dst}_f23 = {k23}\n{dst}_f20 = {k20}\n{dst}_f120 = {k120}\n{dst}_f0 = {k0}\n\
         {dst}_fsub = {ksub}\n{dst}_fnan = {knan}\n\
         {dst}_fs = arith.andi {w}, {dst}_f128 : {it}\n\
         {dst}_fs32 = arith.shli {dst}_fs, {dst}_f24 : {it}\n\
         {dst}_fe0 = arith.shrui {w}, {dst}_f3 : {it}\n\
         {dst}_fe = arith.andi {dst}_fe0, {dst}_f15 : {it}\n\
         {dst}_fm = arith.andi {w}, {dst}_f7 : {it}\n\
         {dst}_fe1 = arith.addi {dst}_fe, {dst}_f120 : {it}\n\
         {dst}_fe2 = arith.shli {dst}_fe1, {dst}_f23 : {it}\n\
         {dst}_fm2 = arith.shli {dst}_fm, {dst}_f20 : {it}\n\
         {dst}_fn0 = arith.ori {dst}_fe2, {dst}_fm2 : {it}\n\
         {dst}_fn1 = arith.ori {dst}_fn0, {dst}_fs32 : {it}\n\
         {dst}_fnorm = arith.bitcast {dst}_fn1 : {it} to {ft}\n\
         {dst}_fmf = arith.uitofp {dst}_fm : {it} to {ft}\n\
         {dst}_fsu0 = arith.mulf {dst}_fmf, {dst}_fsub : {ft}\n\
         {dst}_fsu1 = arith.bitcast {dst}_fsu0 : {ft} to {it}\n\
         {dst}_fsu2 = arith.ori {dst}_fsu1, {dst}_fs32 : {it}\n\
         {dst}_fsubn = arith.bitcast {dst}_fsu2 : {it} to {ft}\n\
         {dst}_fiss = arith.cmpi eq, {dst}_fe, {dst}_f0 : {it}\n\
         {dst}_fv = arith.select {dst}_fiss, {dst}_fsubn, {dst}_fnorm : {sel}{ft}\n\
         {dst}_flow = arith.andi {w}, {dst}_f127 : {it}\n\
         {dst}_fisn = arith.cmpi eq, {dst}_flow, {dst}_f127 : {it}\n\
         {dst} = arith.select {dst}_fisn, {dst}_fnan, {dst}_fv : {sel}{ft}\n",
        k7 = k("7", it),
        k3 = k("3", it),
        k15 = k("15", it),
        k127 = k("127", it),
        k128 = k("128", it),
        k24 = k("24", it),
        k23 = k("23", it),
        k20 = k("20", it),
        k120 = k("120", it),
        k0 = k("0", it),
        ksub = k("0.001953125", ft),
        knan = k("0x7FC00000", ft),
        sel = if it.starts_with("vector") { format!("{}, ", it.replace("i32", "i1")) } else { String::new() },
    )
}

/// `{v}`'s `float8_e4m3fn` byte as an i8 `{q}`: rounded to nearest even,
/// saturated at ±448 (vLLM's fp8 KV caches saturate), NaN as 0x7F.
/// Normals round the f32 bits (`a + 0x7FFFF + lsb`, the exponent rebiased
/// from 127 to 7); below 2^-6 the value is a multiple of 2^-9, rounded as
/// f32 adds round (`(|v| · 512 + 2^23) − 2^23`).
fn fp8_encode(v: &str) -> String {
    format!(
        "{v}_eb = arith.bitcast {v} : f32 to i32\n\
         {v}_ek24 = arith.constant 24 : i32\n\
         {v}_ek128 = arith.constant 128 : i32\n\
         {v}_ekabs = arith.constant 2147483647 : i32\n\
         {v}_ek20 = arith.constant 20 : i32\n\
         {v}_ek1 = arith.constant 1 : i32\n\
         {v}_ekr = arith.constant 524287 : i32\n\
         {v}_ekbias = arith.constant 960 : i32\n\
         {v}_ek126 = arith.constant 126 : i32\n\
         {v}_ek127 = arith.constant 127 : i32\n\
         {v}_ek512 = arith.constant 512.0 : f32\n\
         {v}_ekmagic = arith.constant 8388608.0 : f32\n\
         {v}_ekmin = arith.constant 0.015625 : f32\n\
         {v}_es0 = arith.shrui {v}_eb, {v}_ek24 : i32\n\
         {v}_es = arith.andi {v}_es0, {v}_ek128 : i32\n\
         {v}_ea = arith.andi {v}_eb, {v}_ekabs : i32\n\
         {v}_eaf = arith.bitcast {v}_ea : i32 to f32\n\
         {v}_el0 = arith.shrui {v}_ea, {v}_ek20 : i32\n\
         {v}_elsb = arith.andi {v}_el0, {v}_ek1 : i32\n\
         {v}_er0 = arith.addi {v}_ea, {v}_ekr : i32\n\
         {v}_er1 = arith.addi {v}_er0, {v}_elsb : i32\n\
         {v}_er2 = arith.shrui {v}_er1, {v}_ek20 : i32\n\
         {v}_en = arith.subi {v}_er2, {v}_ekbias : i32\n\
         {v}_ey0 = arith.mulf {v}_eaf, {v}_ek512 : f32\n\
         {v}_ey1 = arith.addf {v}_ey0, {v}_ekmagic : f32\n\
         {v}_ey2 = arith.subf {v}_ey1, {v}_ekmagic : f32\n\
         {v}_eq = arith.fptoui {v}_ey2 : f32 to i32\n\
         {v}_eiss = arith.cmpf olt, {v}_eaf, {v}_ekmin : f32\n\
         {v}_ec0 = arith.select {v}_eiss, {v}_eq, {v}_en : i32\n\
         {v}_ebig = arith.cmpi sgt, {v}_ec0, {v}_ek126 : i32\n\
         {v}_ec1 = arith.select {v}_ebig, {v}_ek126, {v}_ec0 : i32\n\
         {v}_enan = arith.cmpf uno, {v}, {v} : f32\n\
         {v}_ec2 = arith.select {v}_enan, {v}_ek127, {v}_ec1 : i32\n\
         {v}_ec3 = arith.ori {v}_ec2, {v}_es : i32\n\
         {v}_eq8 = arith.trunci {v}_ec3 : i32 to i8\n"
    )
}

/// [`load_f32`] of `n` consecutive elements into a `vector<n x f32>`, with
/// the load's `alignment` in bytes (0: the element's).
pub fn load_f32xn(n: usize, dst: &str, mem: &str, ty: &str, r: &str, c: &str, store: crate::Storage) -> String {
    load_f32xn_aligned(n, 0, dst, mem, ty, r, c, store)
}

/// [`load_f32xn`] with an alignment (bytes) promised for the load; 0 for none.
#[allow(clippy::too_many_arguments)]
pub fn load_f32xn_aligned(n: usize, align: usize, dst: &str, mem: &str, ty: &str, r: &str, c: &str, store: crate::Storage) -> String {
    let al = if align == 0 { String::new() } else { format!(" {{alignment = {align}}}") };
    match store {
        crate::Storage::F32 => format!("{dst} = vector.load {mem}[{r}, {c}]{al} : {ty}, vector<{n}xf32>\n"),
        crate::Storage::Bf16 => format!(
            "{dst}_lh = vector.load {mem}[{r}, {c}]{al} : {ty}, vector<{n}xi16>\n\
             {dst}_lw = arith.extui {dst}_lh : vector<{n}xi16> to vector<{n}xi32>\n\
             {dst}_lk = arith.constant dense<16> : vector<{n}xi32>\n\
             {dst}_ls = arith.shli {dst}_lw, {dst}_lk : vector<{n}xi32>\n\
             {dst} = arith.bitcast {dst}_ls : vector<{n}xi32> to vector<{n}xf32>\n"
        ),
        crate::Storage::Fp8 => format!(
            "{dst}_lq = vector.load {mem}[{r}, {c}]{al} : {ty}, vector<{n}xi8>\n\
             {dst}_lw = arith.extui {dst}_lq : vector<{n}xi8> to vector<{n}xi32>\n{}",
            fp8_decode(dst, &format!("{dst}_lw"), &format!("vector<{n}xi32>"), &format!("vector<{n}xf32>"), &|v, t| {
                format!("arith.constant dense<{v}> : {t}")
            })
        ),
    }
}

/// Stores f32 `{v}` at `[r, c]` of `mem`, kept as `store`; for bf16, rounded
/// to nearest even (`(b + 0x7FFF + ((b >> 16) & 1)) >> 16`), NaN kept a quiet NaN.
pub fn store_f32(v: &str, mem: &str, ty: &str, r: &str, c: &str, store: crate::Storage) -> String {
    match store {
        crate::Storage::F32 => format!("memref.store {v}, {mem}[{r}, {c}] : {ty}\n"),
        crate::Storage::Bf16 => format!(
            "{v}_qb = arith.bitcast {v} : f32 to i32\n\
             {v}_qk16 = arith.constant 16 : i32\n\
             {v}_qk1 = arith.constant 1 : i32\n\
             {v}_qkr = arith.constant 32767 : i32\n\
             {v}_qkn = arith.constant 32704 : i32\n\
             {v}_qhi = arith.shrui {v}_qb, {v}_qk16 : i32\n\
             {v}_qlsb = arith.andi {v}_qhi, {v}_qk1 : i32\n\
             {v}_qr0 = arith.addi {v}_qb, {v}_qkr : i32\n\
             {v}_qr1 = arith.addi {v}_qr0, {v}_qlsb : i32\n\
             {v}_qr = arith.shrui {v}_qr1, {v}_qk16 : i32\n\
             {v}_qnan = arith.cmpf uno, {v}, {v} : f32\n\
             {v}_qsel = arith.select {v}_qnan, {v}_qkn, {v}_qr : i32\n\
             {v}_qbits = arith.trunci {v}_qsel : i32 to i16\n\
             memref.store {v}_qbits, {mem}[{r}, {c}] : {ty}\n"
        ),
        crate::Storage::Fp8 => format!("{}memref.store {v}_eq8, {mem}[{r}, {c}] : {ty}\n", fp8_encode(v)),
    }
}

/// `{dst}` (a vector of 8 f32) = [`hsum`] of each of the eight vectors
/// `vs`, lane `k` `vs[k]`'s: the same additions in the same order, eight
/// outputs at a time. Each halving step adds the lower halves of two
/// vectors (or partial sums) to their upper halves in one addition, the
/// halves gathered by shuffles: 14 shuffles and 7 additions for what takes
/// eight sums of 8 extractions and 3 additions each.
pub fn hsum8x8(dst: &str, vs: &[String; 8]) -> String {
    let v8 = "vector<8xf32>";
    let step = |out: &str, a: &str, b: &str, lo: &str, hi: &str| {
        format!(
            "{out}_l = vector.shuffle {a}, {b} {lo} : {v8}, {v8}\n\
             {out}_h = vector.shuffle {a}, {b} {hi} : {v8}, {v8}\n\
             {out} = arith.addf {out}_l, {out}_h : {v8}\n"
        )
    };
    let mut s = String::new();
    // lanes 0-3 + lanes 4-7 of two vectors: [v: 4 partials | w: 4 partials]
    for i in 0..4 {
        s.push_str(&step(&format!("{dst}_4{i}"), &vs[2 * i], &vs[2 * i + 1], "[0, 1, 2, 3, 8, 9, 10, 11]", "[4, 5, 6, 7, 12, 13, 14, 15]"));
    }
    // partials 0-1 + partials 2-3: four outputs' two partials each
    for i in 0..2 {
        let (a, b) = (format!("{dst}_4{}", 2 * i), format!("{dst}_4{}", 2 * i + 1));
        s.push_str(&step(&format!("{dst}_2{i}"), &a, &b, "[0, 1, 4, 5, 8, 9, 12, 13]", "[2, 3, 6, 7, 10, 11, 14, 15]"));
    }
    // partial 0 + partial 1: the eight sums
    s.push_str(&step(dst, &format!("{dst}_20"), &format!("{dst}_21"), "[0, 2, 4, 6, 8, 10, 12, 14]", "[1, 3, 5, 7, 9, 11, 13, 15]"));
    s
}

/// `{dst}` (f32) = the sum of the 8 lanes of `{v}` by a fixed halving
/// tree: `((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))`: the host linear's
/// and attention's one order for a lane sum.
pub fn hsum(dst: &str, v: &str) -> String {
    format!(
        "{dst}_lo4 = vector.extract_strided_slice {v} {{offsets = [0], sizes = [4], strides = [1]}} : vector<8xf32> to vector<4xf32>\n\
         {dst}_hi4 = vector.extract_strided_slice {v} {{offsets = [4], sizes = [4], strides = [1]}} : vector<8xf32> to vector<4xf32>\n\
         {dst}_4 = arith.addf {dst}_lo4, {dst}_hi4 : vector<4xf32>\n\
         {dst}_lo2 = vector.extract_strided_slice {dst}_4 {{offsets = [0], sizes = [2], strides = [1]}} : vector<4xf32> to vector<2xf32>\n\
         {dst}_hi2 = vector.extract_strided_slice {dst}_4 {{offsets = [2], sizes = [2], strides = [1]}} : vector<4xf32> to vector<2xf32>\n\
         {dst}_2 = arith.addf {dst}_lo2, {dst}_hi2 : vector<2xf32>\n\
         {dst}_a = vector.extract {dst}_2[0] : f32 from vector<2xf32>\n\
         {dst}_b = vector.extract {dst}_2[1] : f32 from vector<2xf32>\n\
         {dst} = arith.addf {dst}_a, {dst}_b : f32\n"
    )
}
