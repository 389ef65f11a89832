//! The host back end end to end: kernels generated as MLIR, lowered through
//! melior and LLVM to an x86-64 object, linked into a shared library, and run
//! on the fixtures' real weights against a plain Rust reference.

use m3c_compiler::backend::host;
use m3c_compiler::tiny::encode::{bf16_to_f32, e4m3_to_f32, e8m0_to_f32};
use m3c_compiler::weights::Checkpoint;
use m3c_kernels::{module, module_at, HostWidth, Kernel, Storage, WeightType};
use m3c_tests::fixture;

/// Dense, unpaged attention of `heads` query heads over `kv` KV heads of
/// width `d`, scale 0.25, all f32: tests override what they vary.
pub(crate) fn attention(heads: usize, kv: usize, d: usize) -> m3c_kernels::Attention {
    m3c_kernels::Attention {
        heads,
        kv_heads: kv,
        head_dim: d,
        scale: 0.25,
        sparse: None,
        paged: None,
        cache: Storage::F32,
        act: Storage::F32,
    }
}

/// A memref descriptor of rank `N`, as MLIR's C interface passes it.
#[repr(C)]
pub(crate) struct Memref<T, const N: usize> {
    allocated: *const T,
    aligned: *const T,
    offset: i64,
    sizes: [i64; N],
    strides: [i64; N],
}

pub(crate) type Memref2<T> = Memref<T, 2>;
pub(crate) type Memref1<T> = Memref<T, 1>;

pub(crate) fn m2<T>(data: &[T], rows: usize, cols: usize) -> Memref2<T> {
    assert_eq!(data.len(), rows * cols);
    Memref { allocated: data.as_ptr(), aligned: data.as_ptr(), offset: 0, sizes: [rows as i64, cols as i64], strides: [cols as i64, 1] }
}

pub(crate) fn m1<T>(data: &[T]) -> Memref1<T> {
    Memref { allocated: data.as_ptr(), aligned: data.as_ptr(), offset: 0, sizes: [data.len() as i64], strides: [1] }
}

/// A linear with f32 activations in and out.
fn lin_f32(inp: usize, out: usize, weight: WeightType) -> Kernel {
    Kernel::Linear(m3c_kernels::Linear { inp, out, weight, act: Storage::F32, out_act: Storage::F32 })
}

/// Compiles `kernels` and loads them as a shared library.
pub(crate) fn build(kernels: &[Kernel], dir: &std::path::Path) -> libloading::Library {
    build_at(kernels, HostWidth::Lanes8, "x86-64-v2", dir).0
}

/// [`build`] of the kernels' `width` form, compiled for `cpu`; and its
/// LLVM IR. (Loading code for a CPU this one is not runs nothing of it.)
fn build_at(kernels: &[Kernel], width: HostWidth, cpu: &str, dir: &std::path::Path) -> (libloading::Library, String) {
    let art = host::compile(&module_at(kernels, width), cpu).expect("host back end");
    assert!(art.llvm_ir.contains("define"), "LLVM IR has functions");
    let obj = dir.join("k.o");
    let so = dir.join("k.so");
    std::fs::write(&obj, &art.object).unwrap();
    let st = std::process::Command::new("cc")
        .args(["-shared", "-o"])
        .arg(&so)
        .arg(&obj)
        .args(["-L/usr/lib/llvm-22/lib", "-Wl,-rpath,/usr/lib/llvm-22/lib", "-lomp", "-lm"])
        .status()
        .unwrap();
    assert!(st.success(), "cc -shared failed");
    // SAFETY: loading the shared library this test just linked from m3c's kernels runs no foreign initialisers.
    (unsafe { libloading::Library::new(&so).unwrap() }, art.llvm_ir)
}

fn input(rows: usize, cols: usize) -> Vec<f32> {
    (0..rows * cols).map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * 1.5).collect()
}

fn bf16s(bytes: &[u8]) -> Vec<u16> {
    bytes.chunks(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect()
}

fn close(a: &[f32], b: &[f32], tol: f32) {
    assert_eq!(a.len(), b.len());
    let worst = a.iter().zip(b).map(|(x, y)| (x - y).abs() / (1.0 + y.abs())).fold(0f32, f32::max);
    assert!(worst <= tol, "max relative difference {worst} > {tol}");
}

#[test]
fn rms_norm_and_bf16_linear_match_reference() {
    let dir = tempfile::tempdir().unwrap();
    let ck = Checkpoint::open(&fixture("tiny-m3")).unwrap();
    let get = |n: &str| ck.bytes(&ck.tensors[n]);
    let norm_w = bf16s(get("language_model.model.layers.0.input_layernorm.weight"));
    let q_w = bf16s(get("language_model.model.layers.0.self_attn.q_proj.weight"));
    let norm = Kernel::RmsNorm(m3c_kernels::RmsNorm { width: 128, eps: 1e-6, weight: WeightType::BF16, act: Storage::F32, gemma: true });
    let lin = lin_f32(128, 256, WeightType::BF16);
    let lib = build(&[norm.clone(), lin.clone(), norm.clone()], dir.path());
    let rows = 5;
    let x = input(rows, 128);

    let mut y = vec![0f32; rows * 128];
    let f: libloading::Symbol<unsafe extern "C" fn(*const Memref2<f32>, *const Memref1<u16>, *const Memref2<f32>)> =
        // SAFETY: the kernel's C interface symbol (`_mlir_ciface_`) takes one memref descriptor pointer per argument, as declared.
        unsafe { lib.get(format!("_mlir_ciface_{}", norm.symbol()).as_bytes()).unwrap() };
    unsafe { f(&m2(&x, rows, 128), &m1(&norm_w), &m2(&y, rows, 128)) };
    let mut want = vec![0f32; rows * 128];
    for r in 0..rows {
        let row = &x[r * 128..(r + 1) * 128];
        let ms = row.iter().map(|v| v * v).sum::<f32>() / 128.0;
        let inv = 1.0 / (ms + 1e-6).sqrt();
        for i in 0..128 {
            want[r * 128 + i] = row[i] * inv * (1.0 + bf16_to_f32(norm_w[i]));
        }
    }
    close(&y, &want, 1e-5);

    let h = y.clone();
    let q = vec![0f32; rows * 256];
    let f: libloading::Symbol<unsafe extern "C" fn(*const Memref2<f32>, *const Memref2<u16>, *const Memref2<f32>)> =
        // SAFETY: the kernel's C interface symbol (`_mlir_ciface_`) takes one memref descriptor pointer per argument, as declared.
        unsafe { lib.get(format!("_mlir_ciface_{}", lin.symbol()).as_bytes()).unwrap() };
    unsafe { f(&m2(&h, rows, 128), &m2(&q_w, 256, 128), &m2(&q, rows, 256)) };
    y = vec![0f32; rows * 256];
    for r in 0..rows {
        for o in 0..256 {
            y[r * 256 + o] = (0..128).map(|i| h[r * 128 + i] * bf16_to_f32(q_w[o * 128 + i])).sum();
        }
    }
    close(&q, &y, 1e-5);
}

/// Layer 0's MLP down projection of the MXFP8 fixture, `[128, 192]`: its
/// fp8 bytes and its E8M0 scales `[128, 6]`.
fn mxfp8_down_proj() -> (Vec<u8>, Vec<u8>) {
    let ck = Checkpoint::open(&fixture("tiny-m3-mxfp8")).unwrap();
    let stem = "language_model.model.layers.0.mlp.down_proj";
    let get = |n: String| ck.bytes(&ck.tensors[&n]).to_vec();
    (get(format!("{stem}.weight")), get(format!("{stem}.weight_scale_inv")))
}

/// Both MXFP8 code paths: 32-, 16- and 8-wide blocks take the tiled vector
/// path (fp8 decoded by integer ops, 16 weights at a time where the block
/// allows); 4-wide blocks (same weights, each scale repeated) take the
/// scalar path through the fp8 table. Seven rows go through decoded panels,
/// one row decodes in registers.
#[test]
fn mxfp8_linear_matches_dequantized_reference() {
    let dir = tempfile::tempdir().unwrap();
    let (w, s32) = mxfp8_down_proj();
    let (out, inp) = (128, 192);
    let s16: Vec<u8> = s32.iter().flat_map(|&b| [b, b]).collect();
    let s8: Vec<u8> = s32.iter().flat_map(|&b| [b; 4]).collect();
    let s4: Vec<u8> = s32.iter().flat_map(|&b| [b; 8]).collect();
    // Seven rows: three blocks of two rows, then one single row.
    let rows = 7;
    let x = input(rows, inp);
    // W[o, i] = fp8[o, i] · 2^(s[o, i/32] − 127), spec §4.2.
    let mut want = vec![0f32; rows * out];
    for r in 0..rows {
        for o in 0..out {
            want[r * out + o] =
                (0..inp).map(|i| x[r * inp + i] * e4m3_to_f32(w[o * inp + i]) * e8m0_to_f32(s32[o * (inp / 32) + i / 32])).sum();
        }
    }
    assert!(want.iter().any(|v| v.abs() > 1.0), "the test must see real values");
    for (block, s) in [(32, &s32), (16, &s16), (8, &s8), (4, &s4)] {
        let lin = lin_f32(inp, out, WeightType::Mxfp8 { block });
        let sub = dir.path().join(format!("b{block}"));
        std::fs::create_dir(&sub).unwrap();
        let lib = build(std::slice::from_ref(&lin), &sub);
        let y = vec![0f32; rows * out];
        let f: libloading::Symbol<unsafe extern "C" fn(*const Memref2<f32>, *const Memref2<u8>, *const Memref2<u8>, *const Memref2<f32>)> =
            // SAFETY: the kernel's C interface symbol (`_mlir_ciface_`) takes one memref descriptor pointer per argument, as declared.
            unsafe { lib.get(format!("_mlir_ciface_{}", lin.symbol()).as_bytes()).unwrap() };
        unsafe { f(&m2(&x, rows, inp), &m2(&w, out, inp), &m2(s, out, inp / block), &m2(&y, rows, out)) };
        close(&y, &want, 1e-5);
        let y1 = vec![0f32; out];
        // SAFETY: as above, with the first row alone.
        unsafe { f(&m2(&x[..inp], 1, inp), &m2(&w, out, inp), &m2(s, out, inp / block), &m2(&y1, 1, out)) };
        close(&y1, &want[..out], 1e-5);
    }
}

#[test]
fn kernels_are_emitted_once_per_shape() {
    let a = lin_f32(128, 64, WeightType::BF16);
    let b = lin_f32(128, 64, WeightType::Mxfp8 { block: 32 });
    let text = module(&[a.clone(), b.clone(), a.clone(), b]);
    assert_eq!(text.matches("func.func @m3c_linear_i128_o64_bf16(").count(), 1);
    assert_eq!(text.matches("func.func @m3c_linear_i128_o64_mxfp8b32(").count(), 1);
    assert_eq!(text.matches("memref.global").count(), 0, "the vector path decodes fp8 without a table");
    // The scalar path (blocks not a multiple of 8) shares one table.
    let c = lin_f32(128, 64, WeightType::Mxfp8 { block: 4 });
    let d = lin_f32(96, 64, WeightType::Mxfp8 { block: 4 });
    let text = module(&[c, d]);
    assert_eq!(text.matches("memref.global").count(), 1, "one fp8 table for all scalar MXFP8 kernels");
}

#[test]
fn head_norm_rope_matches_reference() {
    let dir = tempfile::tempdir().unwrap();
    let ck = Checkpoint::open(&fixture("tiny-m3")).unwrap();
    let w = bf16s(ck.bytes(&ck.tensors["language_model.model.layers.0.self_attn.q_norm.weight"]));
    let (heads, d, rot, theta) = (8, 32, 16, 5.0e6);
    let k = Kernel::HeadNormRope(m3c_kernels::HeadNormRope {
        heads,
        head_dim: d,
        rotary_dim: rot,
        theta,
        eps: 1e-6,
        weight: WeightType::BF16,
        act: Storage::F32,
        norm: true,
    });
    let lib = build(std::slice::from_ref(&k), dir.path());
    let rows = 4;
    let x = input(rows, heads * d);
    // Positions far apart, so a wrong frequency table shows.
    let pos: Vec<i64> = vec![0, 1, 39, 1000];
    let y = vec![0f32; rows * heads * d];
    let f: libloading::Symbol<unsafe extern "C" fn(*const Memref2<f32>, *const Memref1<u16>, *const Memref1<i64>, *const Memref2<f32>)> =
        // SAFETY: the kernel's C interface symbol (`_mlir_ciface_`) takes one memref descriptor pointer per argument, as declared.
        unsafe { lib.get(format!("_mlir_ciface_{}", k.symbol()).as_bytes()).unwrap() };
    unsafe { f(&m2(&x, rows, heads * d), &m1(&w), &m1(&pos), &m2(&y, rows, heads * d)) };
    let mut want = vec![0f32; rows * heads * d];
    for (r, &p) in pos.iter().enumerate().take(rows) {
        for h in 0..heads {
            let o = r * heads * d + h * d;
            let v = &x[o..o + d];
            let inv = 1.0 / ((v.iter().map(|a| a * a).sum::<f32>() / d as f32) + 1e-6).sqrt();
            let n: Vec<f32> = (0..d).map(|i| v[i] * inv * (1.0 + bf16_to_f32(w[i]))).collect();
            for j in 0..rot / 2 {
                let f = 1.0 / (theta as f32).powf((2 * j) as f32 / rot as f32);
                let a = p as f32 * f;
                want[o + j] = n[j] * a.cos() - n[j + rot / 2] * a.sin();
                want[o + j + rot / 2] = n[j + rot / 2] * a.cos() + n[j] * a.sin();
            }
            want[o + rot..o + d].copy_from_slice(&n[rot..]);
        }
    }
    close(&y, &want, 2e-5);
}

#[test]
fn swiglu_oai_clamps_and_gates() {
    let dir = tempfile::tempdir().unwrap();
    let k = Kernel::SwiGluOai(m3c_kernels::SwiGluOai { width: 16, alpha: 1.702, limit: 7.0, beta: 1.0, act: Storage::F32 });
    let lib = build(std::slice::from_ref(&k), dir.path());
    let rows = 2;
    // Values well past ±7 on both inputs, so both clamps fire.
    let g: Vec<f32> = (0..rows * 16).map(|i| (i as f32 - 16.0) * 0.9).collect();
    let u: Vec<f32> = (0..rows * 16).map(|i| (16.0 - i as f32) * 0.8).collect();
    let y = vec![0f32; rows * 16];
    let f: libloading::Symbol<unsafe extern "C" fn(*const Memref2<f32>, *const Memref2<f32>, *const Memref2<f32>)> =
        // SAFETY: the kernel's C interface symbol (`_mlir_ciface_`) takes one memref descriptor pointer per argument, as declared.
        unsafe { lib.get(format!("_mlir_ciface_{}", k.symbol()).as_bytes()).unwrap() };
    unsafe { f(&m2(&g, rows, 16), &m2(&u, rows, 16), &m2(&y, rows, 16)) };
    let want: Vec<f32> = g
        .iter()
        .zip(&u)
        .map(|(&g, &u)| {
            let gc = g.min(7.0);
            let uc = u.clamp(-7.0, 7.0);
            gc * (1.0 / (1.0 + (-1.702 * gc).exp())) * (uc + 1.0)
        })
        .collect();
    close(&y, &want, 1e-5);
    assert!(g.iter().any(|&v| v > 7.0) && u.iter().any(|&v| v < -7.0));
}

/// A shape that crosses every tile edge of the vector path: 19 rows (row
/// tiles of 8, pairs and a single row), 300 outputs (output tiles of 128).
#[test]
fn linear_tiles_cover_every_row_and_output() {
    let dir = tempfile::tempdir().unwrap();
    let (rows, inp, out) = (19, 1024, 300);
    let x = input(rows, inp);
    // bf16 weights: the top halves of f32 values in [-1, 1).
    let wf: Vec<f32> = (0..out * inp).map(|i| ((i * 7919 % 2003) as f32 / 1001.5) - 1.0).collect();
    let w: Vec<u16> = wf.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
    let lin = lin_f32(inp, out, WeightType::BF16);
    let lib = build(std::slice::from_ref(&lin), dir.path());
    let y = vec![f32::NAN; rows * out];
    let f: libloading::Symbol<unsafe extern "C" fn(*const Memref2<f32>, *const Memref2<u16>, *const Memref2<f32>)> =
        // SAFETY: the kernel's C interface symbol (`_mlir_ciface_`) takes one memref descriptor pointer per argument, as declared.
        unsafe { lib.get(format!("_mlir_ciface_{}", lin.symbol()).as_bytes()).unwrap() };
    unsafe { f(&m2(&x, rows, inp), &m2(&w, out, inp), &m2(&y, rows, out)) };
    let mut want = vec![0f32; rows * out];
    for r in 0..rows {
        for o in 0..out {
            want[r * out + o] = (0..inp).map(|i| x[r * inp + i] as f64 * bf16_to_f32(w[o * inp + i]) as f64).sum::<f64>() as f32;
        }
    }
    assert!(y.iter().all(|v| v.is_finite()), "every output is written");
    close(&y, &want, 1e-5);
}

/// bf16 by exact comparison: the nearer of the two bf16 values around `x`
/// (ties to the even one), found without the bit trick the kernel uses.
pub(crate) fn bf16_nearest_even(x: f32) -> u16 {
    if x.is_nan() {
        return 0x7FC0;
    }
    if x.is_infinite() {
        return (x.to_bits() >> 16) as u16;
    }
    let lo = (x.to_bits() >> 16) as u16;
    let hi = lo.wrapping_add(1);
    // Past the largest finite value, rounding sees infinity as 2^128 (IEEE overflow).
    let val = |h: u16| {
        let v = f32::from_bits((h as u32) << 16);
        if v.is_infinite() {
            v.signum() as f64 * 2f64.powi(128)
        } else {
            v as f64
        }
    };
    let (dl, dh) = ((x as f64 - val(lo)).abs(), (val(hi) - x as f64).abs());
    if dl < dh || (dl == dh && lo.is_multiple_of(2)) {
        lo
    } else {
        hi
    }
}

/// The `float8_e4m3fn` byte nearest `x` (ties to the even code), saturated
/// at ±448, NaN as 0x7F: by search over every finite code's value.
pub(crate) fn fp8_nearest_even(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7F;
    }
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs().min(448.0) as f64;
    let mut best = 0u8;
    for code in 0u8..=0x7E {
        let (v, b) = (m3c_kernels::fp8_e4m3_value(code) as f64, m3c_kernels::fp8_e4m3_value(best) as f64);
        let (dv, db) = ((a - v).abs(), (a - b).abs());
        if dv < db || (dv == db && code % 2 == 0 && best % 2 == 1) {
            best = code;
        }
    }
    best | sign
}

#[test]
fn fp8_cache_writes_round_to_nearest_even_and_reads_give_every_code_s_value() {
    use m3c_kernels::Storage;
    let dir = tempfile::tempdir().unwrap();
    // Writes: f32 rows into an fp8 cache.
    let w = Kernel::ScatterRows(m3c_kernels::ScatterRows { width: 8, paged: None, cache: Storage::Fp8, act: Storage::F32 });
    // Reads: fp8 rows (every byte) out as f32.
    let r = Kernel::ScatterRows(m3c_kernels::ScatterRows { width: 8, paged: None, cache: Storage::F32, act: Storage::Fp8 });
    let lib = build(&[w.clone(), r.clone()], dir.path());
    let mut x: Vec<f32> = vec![
        1.0 + 1.0 / 16.0, // halfway between 1 and 1.125: even (1.0) wins
        1.0 + 3.0 / 16.0, // halfway: even (1.25) wins
        448.0,
        460.0, // nearer 448 than 480: saturates anyway
        1.0e6,
        f32::INFINITY,
        f32::NAN,
        -0.0,
        0.001953125,  // the smallest subnormal
        0.0009765625, // half of it: ties to even (0)
        0.0029296875, // 1.5 × the smallest: ties to even (2 × it)
        0.015625,     // the smallest normal
        0.0146484375, // just below it: the top subnormal rounds up to it
        -3.3,
        -0.1,
        f32::NEG_INFINITY,
    ];
    // And a sweep over many magnitudes, both signs.
    let mut v = 1.0e-4f32;
    while x.len() < 256 {
        x.push(if x.len().is_multiple_of(2) { v } else { -v });
        v *= 1.0717;
    }
    let rows = x.len() / 8;
    let pos: Vec<i64> = (0..rows as i64).collect();
    let y = vec![0u8; x.len()];
    type F<'a, T, U> = libloading::Symbol<'a, unsafe extern "C" fn(*const Memref2<T>, *const Memref1<i64>, *const Memref2<U>)>;
    // SAFETY: the kernels' C interface symbols (`_mlir_ciface_`) take one memref descriptor pointer per argument, as declared.
    let fw: F<f32, u8> = unsafe { lib.get(format!("_mlir_ciface_{}", w.symbol()).as_bytes()).unwrap() };
    // SAFETY: as above.
    let fr: F<u8, f32> = unsafe { lib.get(format!("_mlir_ciface_{}", r.symbol()).as_bytes()).unwrap() };
    // SAFETY: every buffer holds the rows the descriptors say.
    unsafe { fw(&m2(&x, rows, 8), &m1(&pos), &m2(&y, rows, 8)) };
    for (i, (&v, &b)) in x.iter().zip(&y).enumerate() {
        assert_eq!(b, fp8_nearest_even(v), "value {i} ({v:e}) stored as {b:#04x}");
    }
    // Every code read back.
    let codes: Vec<u8> = (0..=255u8).collect();
    let out = vec![0f32; 256];
    let pos: Vec<i64> = (0..32).collect();
    // SAFETY: every buffer holds the rows the descriptors say.
    unsafe { fr(&m2(&codes, 32, 8), &m1(&pos), &m2(&out, 32, 8)) };
    for (code, got) in codes.iter().zip(&out) {
        let want = m3c_kernels::fp8_e4m3_value(*code);
        assert!(got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()), "code {code:#04x}: {got} != {want}");
    }
}

#[test]
#[allow(clippy::approx_constant)] // -2.718… is just a value with a long mantissa
fn bf16_cache_writes_round_to_nearest_even_at_their_positions() {
    use m3c_kernels::Storage;
    let dir = tempfile::tempdir().unwrap();
    let k = Kernel::ScatterRows(m3c_kernels::ScatterRows { width: 8, paged: None, cache: Storage::Bf16, act: Storage::F32 });
    let lib = build(std::slice::from_ref(&k), dir.path());
    let step = f32::from_bits(1 << 16); // the smallest bf16 subnormal
    let x: Vec<f32> = vec![
        1.0 + 1.0 / 256.0, // halfway: even (1.0) wins
        1.0 + 3.0 / 256.0, // halfway: even (1.0 + 4/256) wins
        1.0 + 1.5 / 256.0, // nearer the upper
        -2.718_281_8,      // any value with many mantissa bits
        f32::NAN,
        f32::INFINITY,
        f32::MAX, // rounds to infinity
        step,
        // row 1
        0.1,
        -0.1,
        3.0e-40,
        65504.0,
        1.0e10,
        -0.0,
        0.333_333_34,
        7.999_999_5,
    ];
    let pos = [3i64, 0];
    let y = vec![0x5555u16; 4 * 8];
    let f: libloading::Symbol<unsafe extern "C" fn(*const Memref2<f32>, *const Memref1<i64>, *const Memref2<u16>)> =
        // SAFETY: the kernel's C interface symbol (`_mlir_ciface_`) takes one memref descriptor pointer per argument, as declared.
        unsafe { lib.get(format!("_mlir_ciface_{}", k.symbol()).as_bytes()).unwrap() };
    unsafe { f(&m2(&x, 2, 8), &m1(&pos), &m2(&y, 4, 8)) };
    let want = |r: usize| -> Vec<u16> { x[r * 8..r * 8 + 8].iter().map(|&v| bf16_nearest_even(v)).collect() };
    assert_eq!(&y[24..32], &want(0)[..], "row 0 lands at position 3");
    assert_eq!(&y[0..8], &want(1)[..], "row 1 lands at position 0");
    assert!(y[8..24].iter().all(|&b| b == 0x5555), "other positions untouched");
    assert_eq!(y[24], 0x3F80, "1 + 2^-8 ties to 1.0");
    assert_eq!(y[30], 0x7F80, "f32::MAX rounds to +inf");
}

/// Attention over bf16 caches equals f32 attention over the same (rounded)
/// values bit for bit: the cache type changes storage, never arithmetic.
/// Dense and MSA (its index keys come from a cache too); the caches are
/// longer than the context (their capacity), positions come from `pos`.
#[test]
fn attention_over_bf16_caches_equals_f32_attention_over_the_rounded_values() {
    use m3c_kernels::{SparseSel, Storage};
    let dir = tempfile::tempdir().unwrap();
    let (heads, kv, d, cap) = (4usize, 2usize, 16usize, 12usize);
    let sel = SparseSel { index_heads: 2, index_dim: 16, block: 2, topk: 2, local: 1, init: 0 };
    let mk = |sparse: Option<SparseSel>, cache| Kernel::Attention(m3c_kernels::Attention { sparse, cache, ..attention(heads, kv, d) });
    let kernels = [mk(None, Storage::F32), mk(None, Storage::Bf16), mk(Some(sel), Storage::F32), mk(Some(sel), Storage::Bf16)];
    let lib = build(&kernels, dir.path());
    let rows = 3;
    let q = input(rows, heads * d);
    let iq: Vec<f32> = input(rows, 2 * 16).iter().map(|v| v * 0.7 + 0.1).collect();
    let pos = [6i64, 7, 8];
    let bits = |n: usize, salt: usize| -> Vec<u16> {
        (0..n).map(|i| bf16_nearest_even(((i * 7919 + salt) % 1000) as f32 / 400.0 - 1.2)).collect()
    };
    let widen = |b: &[u16]| -> Vec<f32> { b.iter().map(|&h| f32::from_bits((h as u32) << 16)).collect() };
    let (kb, vb, ib) = (bits(cap * kv * d, 1), bits(cap * kv * d, 2), bits(cap * 16, 3));
    let (kf, vf, ifl) = (widen(&kb), widen(&vb), widen(&ib));
    for sparse in [false, true] {
        let mut outs = Vec::new();
        for (i, bf) in [(0usize, false), (1, true)] {
            let k = &kernels[i + if sparse { 2 } else { 0 }];
            let o = vec![0f32; rows * heads * d];
            // One descriptor per argument: q, k, v, pos, [iq, ik,] o; the
            // caches in the kernel's storage.
            let p2f = |m: &Memref2<f32>| m as *const Memref2<f32> as *const std::ffi::c_void;
            let p2h = |m: &Memref2<u16>| m as *const Memref2<u16> as *const std::ffi::c_void;
            let (qm, om, posm, iqm) = (m2(&q, rows, heads * d), m2(&o, rows, heads * d), m1(&pos), m2(&iq, rows, 32));
            let (kfm, vfm, ifm) = (m2(&kf, cap, kv * d), m2(&vf, cap, kv * d), m2(&ifl, cap, 16));
            let (kbm, vbm, ibm) = (m2(&kb, cap, kv * d), m2(&vb, cap, kv * d), m2(&ib, cap, 16));
            let (kp, vp, ip) = if bf { (p2h(&kbm), p2h(&vbm), p2h(&ibm)) } else { (p2f(&kfm), p2f(&vfm), p2f(&ifm)) };
            let posp = &posm as *const Memref1<i64> as *const std::ffi::c_void;
            let mut args = vec![p2f(&qm), kp, vp, posp];
            if sparse {
                args.extend([p2f(&iqm), ip]);
            }
            args.push(p2f(&om));
            // SAFETY: every descriptor views a live buffer of the compiled shape for the whole call.
            unsafe { call(&lib, k, &args) };
            outs.push(o);
        }
        assert!(outs[0].iter().any(|v| *v != 0.0), "attention wrote its output (sparse: {sparse})");
        let (a, b): (Vec<u32>, Vec<u32>) = (outs[0].iter().map(|v| v.to_bits()).collect(), outs[1].iter().map(|v| v.to_bits()).collect());
        assert_eq!(a, b, "bf16-cache attention differs from f32 attention on the same values (sparse: {sparse})");
    }
}

/// The pool row of position `t` under block table `table` (blocks of `b`).
fn pool_row(table: &[i64], b: usize, t: usize) -> usize {
    table[t / b] as usize * b + t % b
}

/// A paged cache changes where rows live, never what is computed: cache
/// writes through a block table land at the table's pool rows (and
/// nowhere else), and attention and the MSA indexer over a pool whose
/// blocks are scattered and out of order give the contiguous kernel's bits
/// exactly, for the eight-key and one-key paths, dense and MSA, f32 and
/// bf16 caches, at every context length from 1 to 26. Pool rows no
/// sequence owns hold NaN, so a read through a wrong row shows. Pages (and
/// MSA blocks) of 4 keys, and of 8: pages that hold whole batches of eight
/// keys, as the real model's 128 do, whose batches look their pool rows up
/// once (MSA's narrow heads then go two at a time, `head_pairs`); and of
/// 64 over 150 positions: pages that hold whole P·V tiles, whose keys'
/// rows follow from the tile's first (the blocked kernel's lookup once per
/// tile).
#[test]
fn paged_attention_and_cache_writes_equal_contiguous_ones_bit_for_bit() {
    for (b, cap) in [(4, 26), (8, 26), (64, 150)] {
        paged_equals_contiguous(b, cap);
    }
}

/// [`paged_attention_and_cache_writes_equal_contiguous_ones_bit_for_bit`]
/// for pages of `b` keys and a context of `cap` positions.
fn paged_equals_contiguous(b: usize, cap: usize) {
    use m3c_kernels::SparseSel;
    let dir = tempfile::tempdir().unwrap();
    let (heads, kv) = (4usize, 2usize);
    // Up to seven blocks for the positions, scattered over a pool of 20.
    assert!(cap <= 7 * b);
    let table: Vec<i64> = vec![13, 2, 19, 7, 0, 11, 5];
    let pool_rows = 20 * b;
    let sel = SparseSel { index_heads: 2, index_dim: 8, block: b, topk: 2, local: 1, init: 1 };
    let mk = |d: usize, sparse: Option<SparseSel>, cache: Storage, paged: Option<usize>| {
        Kernel::Attention(m3c_kernels::Attention { heads, kv_heads: kv, head_dim: d, scale: 0.3, sparse, paged, cache, act: Storage::F32 })
    };
    let cases = [
        (16usize, None, Storage::F32),
        (12, None, Storage::F32),
        (16, Some(sel), Storage::F32),
        (12, Some(sel), Storage::Bf16),
        (16, None, Storage::Bf16),
    ];
    let scatter = Kernel::ScatterRows(m3c_kernels::ScatterRows { width: 8, paged: Some(b), cache: Storage::F32, act: Storage::F32 });
    let mut kernels: Vec<Kernel> = cases.iter().flat_map(|&(d, sp, c)| [mk(d, sp, c, None), mk(d, sp, c, Some(b))]).collect();
    kernels.push(scatter.clone());
    let lib = build(&kernels, dir.path());

    // Cache writes: rows at positions 25, 0, 9 and 4 land in their blocks.
    let x = input(4, 8);
    let pos = [25i64, 0, 9, 4];
    let y = vec![f32::NAN; pool_rows * 8];
    let (xm, pm, tm, ym) = (m2(&x, 4, 8), m1(&pos), m1(&table), m2(&y, pool_rows, 8));
    // SAFETY: every descriptor views a live buffer of the compiled shape for the whole call.
    unsafe { call(&lib, &scatter, &[p(&xm), p(&pm), p(&tm), p(&ym)]) };
    let written: Vec<usize> = pos.iter().map(|&t| pool_row(&table, b, t as usize)).collect();
    for (r, &row) in written.iter().enumerate() {
        assert_eq!(&y[row * 8..row * 8 + 8], &x[r * 8..r * 8 + 8], "position {} at pool row {row}", pos[r]);
    }
    assert!(
        (0..pool_rows).filter(|r| !written.contains(r)).all(|r| y[r * 8..r * 8 + 8].iter().all(|v| v.is_nan())),
        "nothing else written"
    );

    // Attention: the same keys contiguous and paged.
    let bits16 = |v: &[f32]| -> Vec<u16> { v.iter().map(|&x| bf16_nearest_even(x)).collect() };
    let page = |cont: &[f32], width: usize| -> Vec<f32> {
        let mut pool = vec![f32::NAN; pool_rows * width];
        for t in 0..cap {
            let r = pool_row(&table, b, t);
            pool[r * width..(r + 1) * width].copy_from_slice(&cont[t * width..(t + 1) * width]);
        }
        pool
    };
    for (i, &(d, sparse, cache)) in cases.iter().enumerate() {
        let (plain, paged) = (&kernels[2 * i], &kernels[2 * i + 1]);
        let q = input(cap, heads * d);
        let iq: Vec<f32> = input(cap, 16).iter().map(|v| v * 0.7 + 0.1).collect();
        let k: Vec<f32> = input(cap, kv * d).iter().rev().map(|v| v * 0.9).collect();
        let v: Vec<f32> = input(cap, kv * d).iter().map(|v| v * 0.5 - 0.2).collect();
        let ik: Vec<f32> = input(cap, 8).iter().rev().copied().collect();
        let (kp, vp, ikp) = (page(&k, kv * d), page(&v, kv * d), page(&ik, 8));
        let (kh, vh, ikh, kph, vph, ikph) = (bits16(&k), bits16(&v), bits16(&ik), bits16(&kp), bits16(&vp), bits16(&ikp));
        let pos: Vec<i64> = (0..cap as i64).collect();
        let run = |kernel: &Kernel, rows: usize, keys: (&[f32], &[f32], &[f32]), halves: (&[u16], &[u16], &[u16]), with_table: bool| {
            let o = vec![0f32; cap * heads * d];
            let krows = if with_table { pool_rows } else { rows };
            let (qm, posm, tm, om, iqm) = (m2(&q, cap, heads * d), m1(&pos), m1(&table), m2(&o, cap, heads * d), m2(&iq, cap, 16));
            let (kf, vf, ikf) = (m2(keys.0, krows, kv * d), m2(keys.1, krows, kv * d), m2(keys.2, krows, 8));
            let (kb, vb, ikb) = (m2(halves.0, krows, kv * d), m2(halves.1, krows, kv * d), m2(halves.2, krows, 8));
            let (km, vm, ikm) = if cache == Storage::Bf16 { (p(&kb), p(&vb), p(&ikb)) } else { (p(&kf), p(&vf), p(&ikf)) };
            let mut args = vec![p(&qm), km, vm, p(&posm)];
            if with_table {
                args.push(p(&tm));
            }
            if sparse.is_some() {
                args.extend([p(&iqm), ikm]);
            }
            args.push(p(&om));
            // SAFETY: every descriptor views a live buffer of the compiled shape for the whole call.
            unsafe { call(&lib, kernel, &args) };
            o
        };
        let want = run(plain, cap, (&k, &v, &ik), (&kh, &vh, &ikh), false);
        let got = run(paged, cap, (&kp, &vp, &ikp), (&kph, &vph, &ikph), true);
        assert!(want.iter().all(|x| x.is_finite()) && want.iter().any(|x| *x != 0.0), "{plain}: real outputs");
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got), bits(&want), "pages of {b}: {paged} differs from {plain}");
    }
}

/// Host attention against an f64 reference, for head widths that take the
/// eight-keys-at-a-time path (16, 80 and 96, with the vector exp) and the
/// one-by-one path (12), over every context length from 1 to 26 (so every remainder
/// of the last batch of 8); and each query row computed alone gives the
/// same bits as in the batch, dense and MSA, with scores large enough that
/// some weights underflow to exactly 0. The MSA reference selects its own
/// blocks (see [`msa_reference_keys`]): top-k picks two blocks by score past
/// the forced ones, over blocks of 4 (a batch of eight keys spans two),
/// 2 (four), 8 (one; it picks one by score) and 3.
#[test]
fn attention_matches_an_f64_reference_and_each_row_alone() {
    use m3c_kernels::SparseSel;
    let dir = tempfile::tempdir().unwrap();
    let (heads, kv, cap) = (4usize, 2usize, 26usize);
    let sel = SparseSel { index_heads: 2, index_dim: 8, block: 4, topk: 4, local: 1, init: 1 };
    let sel2 = SparseSel { block: 2, ..sel };
    // Blocks of 8 (a batch of eight keys in one block, as the real 128)
    // and of 3 (blocks that straddle batches, pooled key by key).
    let sel8 = SparseSel { block: 8, topk: 3, ..sel };
    let sel3 = SparseSel { block: 3, ..sel };
    let mk = |d: usize, scale: f64, sparse: Option<SparseSel>| {
        Kernel::Attention(m3c_kernels::Attention { scale, sparse, ..attention(heads, kv, d) })
    };
    // 80 (the vision tower's) and 96 wide: P·V in one chunk of 80 columns,
    // and in two of 48.
    let cases = [
        (16usize, 0.25, None),
        (12, 0.3, None),
        (16, 0.25, Some(sel)),
        (16, 40.0, None),
        (12, 40.0, Some(sel)),
        (80, 0.11, None),
        (96, 0.1, Some(sel)),
        (16, 0.25, Some(sel2)),
        (16, 0.25, Some(sel8)),
        (16, 0.25, Some(sel3)),
    ];
    let kernels: Vec<Kernel> = cases.iter().map(|&(d, sc, sp)| mk(d, sc, sp)).collect();
    let lib = build(&kernels, dir.path());
    for (kernel, &(d, scale, sparse)) in kernels.iter().zip(&cases) {
        let rows = cap;
        let q = input(rows, heads * d);
        let k: Vec<f32> = input(cap, kv * d).iter().rev().map(|v| v * 0.9).collect();
        let v: Vec<f32> = input(cap, kv * d).iter().map(|v| v * 0.5 - 0.2).collect();
        let iq: Vec<f32> = input(rows, 16).iter().map(|v| v * 0.7 + 0.1).collect();
        let ik: Vec<f32> = input(cap, 8).iter().rev().copied().collect();
        let run = |rs: std::ops::Range<usize>| -> Vec<f32> {
            let n = rs.len();
            let pos: Vec<i64> = rs.clone().map(|r| r as i64).collect();
            let (qs, iqs) = (&q[rs.start * heads * d..rs.end * heads * d], &iq[rs.start * 16..rs.end * 16]);
            let o = vec![0f32; n * heads * d];
            let (qm, km, vm, posm, om) = (m2(qs, n, heads * d), m2(&k, cap, kv * d), m2(&v, cap, kv * d), m1(&pos), m2(&o, n, heads * d));
            let (iqm, ikm) = (m2(iqs, n, 16), m2(&ik, cap, 8));
            let mut args = vec![p(&qm), p(&km), p(&vm), p(&posm)];
            if sparse.is_some() {
                args.extend([p(&iqm), p(&ikm)]);
            }
            args.push(p(&om));
            // SAFETY: every descriptor views a live buffer of the compiled shape for the whole call.
            unsafe { call(&lib, kernel, &args) };
            o
        };
        let all = run(0..rows);
        for r in 0..rows {
            let alone = run(r..r + 1);
            let row = &all[r * heads * d..(r + 1) * heads * d];
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(row), bits(&alone), "d {d}, scale {scale}, sparse {}: row {r} alone differs from the batch", sparse.is_some());
            // At scale 40 the f32 rounding of scores in the hundreds moves
            // the weights by more than any tolerance worth checking; those
            // cases are for the underflowing weights and the invariance.
            if scale > 1.0 {
                continue;
            }
            // f64 reference: row r at position r sees keys 0..=r, or the
            // MSA selection's among them.
            for h in 0..heads {
                let g = h / (heads / kv);
                let keys: Vec<usize> = match sparse {
                    None => (0..=r).collect(),
                    Some(s) => msa_reference_keys(s, &iq[r * 16 + g * 8..][..8], &ik, r),
                };
                let sc: Vec<f64> = keys
                    .iter()
                    .map(|&t| scale * (0..d).map(|c| q[r * heads * d + h * d + c] as f64 * k[t * kv * d + g * d + c] as f64).sum::<f64>())
                    .collect();
                let mx = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let w: Vec<f64> = sc.iter().map(|s| (s - mx).exp()).collect();
                let sum: f64 = w.iter().sum();
                for c in 0..d {
                    let want = keys.iter().zip(&w).map(|(&t, w)| w / sum * v[t * kv * d + g * d + c] as f64).sum::<f64>();
                    let got = row[h * d + c] as f64;
                    assert!(
                        (got - want).abs() <= 2e-6 * (1.0 + want.abs()),
                        "d {d}, scale {scale}: row {r} head {h} col {c}: {got} vs {want}"
                    );
                }
            }
        }
    }
}

/// The keys MSA lets a query at position `p` see, by the spec's rule
/// (minimax-m3.md, 2.3), in f64: each block scored by its best causal key's
/// index score (`iq`, the group's index query, against `ik`'s rows), the
/// query's own `local` blocks and the first `init` forced, then the top
/// `topk`, the lower block first on ties and never one with no causal key.
fn msa_reference_keys(s: m3c_kernels::SparseSel, iq: &[f32], ik: &[f32], p: usize) -> Vec<usize> {
    let (b, dim) = (s.block, s.index_dim);
    let nb = p / b + 1;
    let mut score = vec![f64::NEG_INFINITY; nb];
    for t in 0..=p {
        let dot: f64 = (0..dim).map(|c| iq[c] as f64 * ik[t * dim + c] as f64).sum();
        score[t / b] = score[t / b].max(dot);
    }
    for j in 0..s.local.min(nb) {
        score[p / b - j] = f64::INFINITY;
    }
    for sc in score.iter_mut().take(s.init) {
        *sc = f64::INFINITY;
    }
    let mut order: Vec<usize> = (0..nb).filter(|&i| score[i] > f64::NEG_INFINITY).collect();
    order.sort_by(|&i, &j| score[j].total_cmp(&score[i]).then(i.cmp(&j)));
    // A near tie at the cut would make the test depend on rounding.
    if let (Some(&last), Some(&next)) = (order.get(s.topk - 1), order.get(s.topk)) {
        assert!(score[last] - score[next] > 1e-4, "position {p}: blocks {last} and {next} nearly tie; change the inputs");
    }
    order.truncate(s.topk);
    (0..=p).filter(|t| order.contains(&(t / b))).collect()
}

/// MSA whose selection takes every block is dense attention, to the bit:
/// the same scores, weights and sums in the same order, whichever keys the
/// sparse path passes over (batches of eight unselected keys, keys of
/// weight 0). Heads of 16 and 80 (P·V in one chunk of 80), over 40
/// positions: five full batches of eight keys. Blocks of 4 go row by row;
/// blocks of 8 (whole batches, as the real 128) in blocks of query rows.
#[test]
fn msa_selecting_every_block_is_dense_attention_bit_for_bit() {
    use m3c_kernels::SparseSel;
    let dir = tempfile::tempdir().unwrap();
    let (heads, kv, cap) = (4usize, 2usize, 40usize);
    for (block, d) in [(4, 16usize), (4, 80), (8, 16), (8, 80)] {
        let every = SparseSel { index_heads: 2, index_dim: 8, block, topk: 10, local: 1, init: 1 };
        let dense = Kernel::Attention(m3c_kernels::Attention { scale: 0.3, ..attention(heads, kv, d) });
        let msa = Kernel::Attention(m3c_kernels::Attention { scale: 0.3, sparse: Some(every), ..attention(heads, kv, d) });
        let lib = build(&[dense.clone(), msa.clone()], dir.path());
        let data = MsaInputs::new(heads, kv, d, cap, |v| v);
        let (want, got) = (data.run(&lib, &dense, false, 0..cap), data.run(&lib, &msa, true, 0..cap));
        assert!(want.iter().all(|b| f32::from_bits(*b).is_finite()), "d {d}: dense attention wrote every output");
        for r in 0..cap {
            let row = r * heads * d..(r + 1) * heads * d;
            assert!(got[row.clone()] == want[row], "block {block}, d {d}: row {r}: MSA over every block differs from dense attention");
        }
    }
}

/// MSA blocks of 16 keys (a multiple of two batches, as the real 128): a
/// call of many rows pools each block's index scores in registers over
/// keys transposed once for the call, a call of one row batch by batch
/// from key rows. Over 80 positions (five blocks, two chosen per row, so
/// the index scores decide), every row alone gives the bits of all rows
/// together, and the choice matters: the output is not dense attention's.
#[test]
fn msa_block_pooling_of_a_whole_call_equals_each_row_alone() {
    use m3c_kernels::SparseSel;
    let dir = tempfile::tempdir().unwrap();
    let (heads, kv, d, cap) = (4usize, 2usize, 16usize, 80usize);
    let sel = SparseSel { index_heads: 2, index_dim: 8, block: 16, topk: 2, local: 1, init: 0 };
    let msa = Kernel::Attention(m3c_kernels::Attention { scale: 0.3, sparse: Some(sel), ..attention(heads, kv, d) });
    let dense = Kernel::Attention(m3c_kernels::Attention { scale: 0.3, ..attention(heads, kv, d) });
    let lib = build(&[msa.clone(), dense.clone()], dir.path());
    // Index keys spread wider than the inputs' own, so blocks' scores differ.
    let data = MsaInputs::new(heads, kv, d, cap, |v| v * 1.3 - 0.4);
    let all = data.run(&lib, &msa, true, 0..cap);
    let full = data.run(&lib, &dense, false, 0..cap);
    let width = heads * d;
    for r in 0..cap {
        assert!(data.run(&lib, &msa, true, r..r + 1) == all[r * width..(r + 1) * width], "row {r} alone differs from the whole call");
    }
    let differ = (0..cap).filter(|r| all[r * width..(r + 1) * width] != full[r * width..(r + 1) * width]).count();
    assert!(differ > 0, "no row's output depends on the blocks it chose");
}

/// Attention inputs over `cap` positions for the MSA bit tests: queries,
/// keys and values, index queries (two heads of 8) and index keys (`ik`
/// maps each of the reversed inputs).
struct MsaInputs {
    heads: usize,
    kv: usize,
    d: usize,
    cap: usize,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    iq: Vec<f32>,
    ik: Vec<f32>,
}

impl MsaInputs {
    fn new(heads: usize, kv: usize, d: usize, cap: usize, ik: impl Fn(f32) -> f32) -> MsaInputs {
        MsaInputs {
            heads,
            kv,
            d,
            cap,
            q: input(cap, heads * d),
            k: input(cap, kv * d).iter().rev().map(|v| v * 0.9).collect(),
            v: input(cap, kv * d).iter().map(|v| v * 0.5 - 0.2).collect(),
            iq: input(cap, 16).iter().map(|v| v * 0.7 + 0.1).collect(),
            ik: input(cap, 8).iter().rev().map(|v| ik(*v)).collect(),
        }
    }

    /// The output bits of query rows `rs` (at their own positions) over
    /// every key; `sparse`: the kernel takes the index queries and keys.
    fn run(&self, lib: &libloading::Library, kernel: &Kernel, sparse: bool, rs: std::ops::Range<usize>) -> Vec<u32> {
        let MsaInputs { heads, kv, d, cap, .. } = *self;
        let n = rs.len();
        let pos: Vec<i64> = rs.clone().map(|r| r as i64).collect();
        let (qs, iqs) = (&self.q[rs.start * heads * d..rs.end * heads * d], &self.iq[rs.start * 16..rs.end * 16]);
        let o = vec![f32::NAN; n * heads * d];
        let (qm, km, vm, posm, om) =
            (m2(qs, n, heads * d), m2(&self.k, cap, kv * d), m2(&self.v, cap, kv * d), m1(&pos), m2(&o, n, heads * d));
        let (iqm, ikm) = (m2(iqs, n, 16), m2(&self.ik, cap, 8));
        let mut args = vec![p(&qm), p(&km), p(&vm), p(&posm)];
        if sparse {
            args.extend([p(&iqm), p(&ikm)]);
        }
        args.push(p(&om));
        // SAFETY: every descriptor views a live buffer of the compiled shape for the whole call.
        unsafe { call(lib, kernel, &args) };
        o.iter().map(|x| x.to_bits()).collect()
    }
}

/// Calls the C interface of kernel `k` with memref descriptors (as pointers).
// SAFETY: callers pass one live descriptor per kernel argument (see the # Safety note).
pub(crate) unsafe fn call(lib: &libloading::Library, k: &Kernel, a: &[*const std::ffi::c_void]) {
    // SAFETY: passed on from the caller.
    unsafe { call_symbol(lib, &k.symbol(), a) }
}

/// Calls the C interface of the kernel named `symbol` with memref
/// descriptors (as pointers).
// SAFETY: callers pass one live descriptor per kernel argument.
pub(crate) unsafe fn call_symbol(lib: &libloading::Library, symbol: &str, a: &[*const std::ffi::c_void]) {
    type P = *const std::ffi::c_void;
    let name = format!("_mlir_ciface_{symbol}");
    unsafe {
        match a.len() {
            2 => lib.get::<unsafe extern "C" fn(P, P)>(name.as_bytes()).unwrap()(a[0], a[1]),
            3 => lib.get::<unsafe extern "C" fn(P, P, P)>(name.as_bytes()).unwrap()(a[0], a[1], a[2]),
            4 => lib.get::<unsafe extern "C" fn(P, P, P, P)>(name.as_bytes()).unwrap()(a[0], a[1], a[2], a[3]),
            5 => lib.get::<unsafe extern "C" fn(P, P, P, P, P)>(name.as_bytes()).unwrap()(a[0], a[1], a[2], a[3], a[4]),
            6 => lib.get::<unsafe extern "C" fn(P, P, P, P, P, P)>(name.as_bytes()).unwrap()(a[0], a[1], a[2], a[3], a[4], a[5]),
            7 => lib.get::<unsafe extern "C" fn(P, P, P, P, P, P, P)>(name.as_bytes()).unwrap()(a[0], a[1], a[2], a[3], a[4], a[5], a[6]),
            8 => lib.get::<unsafe extern "C" fn(P, P, P, P, P, P, P, P)>(name.as_bytes()).unwrap()(
                a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7],
            ),
            n => panic!("{symbol}: no call shape for {n} arguments"),
        }
    }
}

pub(crate) fn p<T>(m: &T) -> *const std::ffi::c_void {
    m as *const T as *const std::ffi::c_void
}

/// The kernels checked in both activation storages: each pair is the f32
/// kernel and its bf16-activation twin.
fn bf16_twins() -> Vec<[Kernel; 2]> {
    let (f, b) = (Storage::F32, Storage::Bf16);
    let sel = m3c_kernels::SparseSel { index_heads: 2, index_dim: 16, block: 2, topk: 2, local: 1, init: 0 };
    let twins = |mk: &dyn Fn(Storage) -> Kernel| [mk(f), mk(b)];
    let lin = |weight, out_act: Option<Storage>| {
        move |a: Storage| Kernel::Linear(m3c_kernels::Linear { inp: 192, out: 128, weight, act: a, out_act: out_act.unwrap_or(a) })
    };
    vec![
        twins(&lin(WeightType::BF16, None)),
        twins(&lin(WeightType::Mxfp8 { block: 32 }, None)),
        twins(&lin(WeightType::Mxfp8 { block: 4 }, None)),
        twins(&lin(WeightType::BF16, Some(f))),
        twins(&|a| Kernel::RmsNorm(m3c_kernels::RmsNorm { width: 128, eps: 1e-6, weight: WeightType::BF16, act: a, gemma: true })),
        twins(&|a| {
            Kernel::HeadNormRope(m3c_kernels::HeadNormRope {
                heads: 4,
                head_dim: 32,
                rotary_dim: 16,
                theta: 5e6,
                eps: 1e-6,
                weight: WeightType::BF16,
                act: a,
                norm: true,
            })
        }),
        twins(&|a| Kernel::SwiGluOai(m3c_kernels::SwiGluOai { width: 128, alpha: 1.702, limit: 7.0, beta: 1.0, act: a })),
        twins(&|a| Kernel::Add(m3c_kernels::Add { width: 128, act: a })),
        twins(&|a| {
            Kernel::Router(m3c_kernels::Router {
                width: 128,
                experts: 8,
                top_k: 2,
                scale: 2.5,
                weight: WeightType::BF16,
                bias: None,
                act: a,
            })
        }),
        twins(&|a| Kernel::Attention(m3c_kernels::Attention { sparse: Some(sel), cache: f, act: a, ..attention(4, 2, 16) })),
    ]
}

/// `--activations bf16` changes storage, never arithmetic: every kernel with
/// bf16 activations gives, bit for bit, its f32 twin's result on the same
/// (bf16-rounded) inputs, rounded to nearest even once. Covered: linear on
/// all three code paths (bf16 vector, MXFP8 vector, MXFP8 table) and with
/// f32 output (the logits), RMSNorm, QK-norm + RoPE, SwiGLU-OAI, add, the
/// router (f32 outputs) and MSA attention.
#[test]
fn bf16_activation_kernels_round_their_f32_twins_once() {
    let dir = tempfile::tempdir().unwrap();
    let (w8, s32) = mxfp8_down_proj();
    let s4: Vec<u8> = s32.iter().flat_map(|&b| [b; 8]).collect();
    let wb: Vec<u16> = (0..128 * 192).map(|i| bf16_nearest_even(((i * 7919 % 997) as f32 / 997.0 - 0.5) * 0.2)).collect();
    let norm_w = vec![0x3E80u16; 128]; // 0.25
    let f = Storage::F32;
    let kernels = bf16_twins();
    let all: Vec<Kernel> = kernels.iter().flat_map(|t| t.iter().cloned()).collect();
    let lib = build(&all, dir.path());
    let rows = 5;
    let round = |x: &[f32]| -> (Vec<u16>, Vec<f32>) {
        let bits: Vec<u16> = x.iter().map(|&v| bf16_nearest_even(v)).collect();
        let wide = bits.iter().map(|&h| f32::from_bits((h as u32) << 16)).collect();
        (bits, wide)
    };
    let (x192b, x192) = round(&input(rows, 192));
    let (x128b, x128) = round(&input(rows, 128));
    let (y128b, y128) = round(&input(rows, 128).iter().map(|v| v * 0.37 - 0.2).collect::<Vec<_>>());
    let pos = [6i64, 7, 8, 9, 10];
    let cap = 12;
    let kc = input(cap, 32);
    let vc: Vec<f32> = input(cap, 32).iter().map(|v| 0.5 - v).collect();
    let ic = input(cap, 16);
    let (q64b, q64) = round(&input(rows, 64));
    let (iq32b, iq32) = round(&input(rows, 32).iter().map(|v| v * 0.7 + 0.1).collect::<Vec<_>>());
    let mut checked = 0;
    for [kf, kb] in &kernels {
        // (f32 output, bf16-act output) per kernel, from the same values.
        // SAFETY: the symbol and descriptors follow the kernel's C interface; every buffer outlives the call.
        let (want, got): (Vec<f32>, Vec<u32>) = unsafe {
            match kf {
                Kernel::Linear(m3c_kernels::Linear { weight, out_act, .. }) => {
                    let yf = vec![0f32; rows * 128];
                    let ybf = vec![0u16; rows * 128];
                    let y32 = vec![0f32; rows * 128];
                    let w = match weight {
                        WeightType::BF16 => m2(&wb, 128, 192),
                        _ => m2(&[0u16; 0][..], 0, 0),
                    };
                    let (args_f, args_b): (Vec<*const std::ffi::c_void>, Vec<*const std::ffi::c_void>);
                    let (xf, xb) = (m2(&x192, rows, 192), m2(&x192b, rows, 192));
                    let (w8m, s) = (
                        m2(&w8, 128, 192),
                        match weight {
                            WeightType::Mxfp8 { block: 4 } => m2(&s4, 128, 48),
                            _ => m2(&s32, 128, 6),
                        },
                    );
                    let (yfm, ybm, y32m) = (m2(&yf, rows, 128), m2(&ybf, rows, 128), m2(&y32, rows, 128));
                    let yb_out = if *out_act == f && kb.symbol().contains("_yf32") { p(&y32m) } else { p(&ybm) };
                    if let WeightType::BF16 = weight {
                        args_f = vec![p(&xf), p(&w), p(&yfm)];
                        args_b = vec![p(&xb), p(&w), yb_out];
                    } else {
                        args_f = vec![p(&xf), p(&w8m), p(&s), p(&yfm)];
                        args_b = vec![p(&xb), p(&w8m), p(&s), yb_out];
                    }
                    call(&lib, kf, &args_f);
                    call(&lib, kb, &args_b);
                    if kb.symbol().contains("_yf32") {
                        // f32 output (logits): exactly the f32 twin's, no rounding.
                        (yf.clone(), y32.iter().map(|v| v.to_bits()).collect())
                    } else {
                        (yf.clone(), ybf.iter().map(|&h| h as u32).collect())
                    }
                }
                Kernel::RmsNorm(m3c_kernels::RmsNorm { .. })
                | Kernel::SwiGluOai(m3c_kernels::SwiGluOai { .. })
                | Kernel::Add(m3c_kernels::Add { .. }) => {
                    let (yf, yb) = (vec![0f32; rows * 128], vec![0u16; rows * 128]);
                    let (af, ab, bf, bb) = (m2(&x128, rows, 128), m2(&x128b, rows, 128), m2(&y128, rows, 128), m2(&y128b, rows, 128));
                    let (yfm, ybm, wm) = (m2(&yf, rows, 128), m2(&yb, rows, 128), m1(&norm_w));
                    let second_f = if matches!(kf, Kernel::RmsNorm(m3c_kernels::RmsNorm { .. })) { p(&wm) } else { p(&bf) };
                    let second_b = if matches!(kf, Kernel::RmsNorm(m3c_kernels::RmsNorm { .. })) { p(&wm) } else { p(&bb) };
                    call(&lib, kf, &[p(&af), second_f, p(&yfm)]);
                    call(&lib, kb, &[p(&ab), second_b, p(&ybm)]);
                    (yf.clone(), yb.iter().map(|&h| h as u32).collect())
                }
                Kernel::HeadNormRope(m3c_kernels::HeadNormRope { .. }) => {
                    let nw = vec![0x3E80u16; 32];
                    let (yf, yb) = (vec![0f32; rows * 128], vec![0u16; rows * 128]);
                    let (xf, xb, wm, pm) = (m2(&x128, rows, 128), m2(&x128b, rows, 128), m1(&nw), m1(&pos));
                    let (yfm, ybm) = (m2(&yf, rows, 128), m2(&yb, rows, 128));
                    call(&lib, kf, &[p(&xf), p(&wm), p(&pm), p(&yfm)]);
                    call(&lib, kb, &[p(&xb), p(&wm), p(&pm), p(&ybm)]);
                    (yf.clone(), yb.iter().map(|&h| h as u32).collect())
                }
                Kernel::Router(m3c_kernels::Router { .. }) => {
                    let rw: Vec<u16> = wb[..8 * 128].to_vec();
                    let (wf, wbt, idf, idb) = (vec![0f32; rows * 2], vec![0f32; rows * 2], vec![0i64; rows * 2], vec![0i64; rows * 2]);
                    let (xf, xb, wm) = (m2(&x128, rows, 128), m2(&x128b, rows, 128), m2(&rw, 8, 128));
                    let (wfm, wbm, ifm, ibm) = (m2(&wf, rows, 2), m2(&wbt, rows, 2), m2(&idf, rows, 2), m2(&idb, rows, 2));
                    call(&lib, kf, &[p(&xf), p(&wm), p(&wfm), p(&ifm)]);
                    call(&lib, kb, &[p(&xb), p(&wm), p(&wbm), p(&ibm)]);
                    assert_eq!(idf, idb, "router picks the same experts from the same values");
                    // Router outputs stay f32: equal bits, no rounding.
                    (wf.clone(), wbt.iter().map(|v| v.to_bits()).collect())
                }
                Kernel::Attention(m3c_kernels::Attention { .. }) => {
                    let (of, ob) = (vec![0f32; rows * 64], vec![0u16; rows * 64]);
                    let (qf, qb, km, vm, pm) = (m2(&q64, rows, 64), m2(&q64b, rows, 64), m2(&kc, cap, 32), m2(&vc, cap, 32), m1(&pos));
                    let (iqf, iqb, ikm) = (m2(&iq32, rows, 32), m2(&iq32b, rows, 32), m2(&ic, cap, 16));
                    let (ofm, obm) = (m2(&of, rows, 64), m2(&ob, rows, 64));
                    call(&lib, kf, &[p(&qf), p(&km), p(&vm), p(&pm), p(&iqf), p(&ikm), p(&ofm)]);
                    call(&lib, kb, &[p(&qb), p(&km), p(&vm), p(&pm), p(&iqb), p(&ikm), p(&obm)]);
                    (of.clone(), ob.iter().map(|&h| h as u32).collect())
                }
                other => panic!("no twin check for {other}"),
            }
        };
        assert!(want.iter().any(|v| v.abs() > 0.05), "{kf}: the test must see real values");
        let f32_out = matches!(kf, Kernel::Router(m3c_kernels::Router { .. })) || kb.symbol().contains("_yf32");
        let expect: Vec<u32> =
            if f32_out { want.iter().map(|v| v.to_bits()).collect() } else { want.iter().map(|&v| bf16_nearest_even(v) as u32).collect() };
        assert_eq!(got, expect, "{kb} is not its f32 twin rounded once");
        checked += 1;
    }
    assert_eq!(checked, kernels.len());
}

/// The MXFP8 → bf16 decode that feeds prefill GEMMs on tensor cores: every
/// weight of a real fixture tensor decodes to the bf16 of fp8 · 2^(s − 127),
/// and that bf16 is the exact product (so the GEMM sees the weights the
/// GEMV kernel does).
#[test]
fn mxfp8_weights_decode_to_bf16_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let (w, s) = mxfp8_down_proj();
    let (out, inp) = (128, 192);
    let k = Kernel::DequantMxfp8(m3c_kernels::DequantMxfp8 { out, inp, block: 32 });
    let lib = build(std::slice::from_ref(&k), dir.path());
    let y = vec![0u16; out * inp];
    // SAFETY: each pointer is a live descriptor of the compiled shape, for the whole call.
    unsafe { call(&lib, &k, &[p(&m2(&w, out, inp)), p(&m2(&s, out, inp / 32)), p(&m2(&y, out, inp))]) };
    let mut nonzero = 0;
    for o in 0..out {
        for i in 0..inp {
            let exact = e4m3_to_f32(w[o * inp + i]) * e8m0_to_f32(s[o * (inp / 32) + i / 32]);
            let got = y[o * inp + i];
            assert_eq!(got, bf16_nearest_even(exact), "w[{o}, {i}]");
            assert_eq!(f32::from_bits((got as u32) << 16), exact, "w[{o}, {i}] is exact in bf16");
            nonzero += (exact != 0.0) as usize;
        }
    }
    assert!(nonzero > out * inp / 2, "the test must see real weights");
}

/// Exact GELU against an f64 reference (`½ x (1 + erf(x/√2))` with libm's
/// double erf), over the range where it bends and past it, both storages.
#[test]
fn gelu_is_the_exact_erf_gelu() {
    let dir = tempfile::tempdir().unwrap();
    let (rows, width) = (3usize, 96usize);
    let x: Vec<f32> = (0..rows * width).map(|i| (i as f32 - 144.0) / 16.0).collect(); // -9 .. 9
    let want: Vec<f64> = x.iter().map(|&v| 0.5 * v as f64 * (1.0 + libm::erf(v as f64 / std::f64::consts::SQRT_2))).collect();
    let k = Kernel::Gelu(m3c_kernels::Gelu { width, act: Storage::F32 });
    let lib = build(std::slice::from_ref(&k), dir.path());
    let y = vec![0f32; rows * width];
    let p = |m: &Memref2<f32>| m as *const Memref2<f32> as *const std::ffi::c_void;
    // SAFETY: two live descriptors of the compiled shape, for the whole call.
    unsafe { call(&lib, &k, &[p(&m2(&x, rows, width)), p(&m2(&y, rows, width))]) };
    for (i, (&g, &w)) in y.iter().zip(&want).enumerate() {
        assert!((g as f64 - w).abs() <= 2e-7 * w.abs().max(1.0), "x = {}: {g} vs {w}", x[i]);
    }
    assert_eq!(y[144], 0.0, "gelu(0)");
    assert_eq!(y[rows * width - 1], x[rows * width - 1], "gelu(x) = x once erf(x/√2) rounds to 1");
    assert!(y[0] <= 0.0 && y[0] > -1e-6, "gelu(-9) is a tiny negative: {}", y[0]);
}

/// The tiled linear's one summation order: every row of a batch is the same
/// bits as that row computed alone, whatever the batch's size (decode
/// micro-tiles of one row, prefill tiles of three rows, f32 panels decoded
/// from 3 rows on, row tiles of 30 at width 1024, the panel decoded once
/// for all of them; at 2560, K blocks of 768 with a short last one, row
/// tiles of 96 and a panel of the whole reduction decoded on the first;
/// at 2816 × 12288, a panel too large for that, decoded per row tile and
/// K block) and for every weight type and activation storage; K-blocked
/// batches are the same bits on 1, 2 and 3 threads (which size their output
/// tiles differently); and the batch matches an f64 reference.
#[test]
fn linear_rows_are_bit_identical_alone_and_in_any_batch() {
    linear_rows_alone_and_batched(150, 1024, &[2, 3, 5, 6, 7, 16, 20, 40], None);
    linear_rows_alone_and_batched(150, 2560, &[1, 6, 20, 45, 100], None);
    // Only the panel's weight types, and a few rows alone: the weights are
    // 35 M values.
    linear_rows_alone_and_batched(2816, 12288, &[100], Some(&[0, 2, 95, 96, 99]));
}

/// The 16-lane form of the tiled linear (AVX-512: two outputs' lane sums a
/// register, micro-tiles of 4 rows × 8 outputs) gives the 8-lane form's
/// bits, for every weight type and activation storage, whole rows and
/// leftovers of the micro-tiles (rows 1-3, outputs past a group of 8),
/// unblocked and K-blocked reductions, on 2 threads. Where the CPU lacks
/// AVX-512 the 16-lane form is compiled and linked (its 16-lane FMAs
/// checked in the IR) but cannot run.
#[test]
fn linear_16_lane_form_gives_the_8_lane_bits() {
    // x86-64-v4's features.
    let avx512 = std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx512cd")
        && std::arch::is_x86_feature_detected!("avx512dq")
        && std::arch::is_x86_feature_detected!("avx512vl");
    let kinds = [
        (WeightType::F32, Storage::F32),
        (WeightType::F32, Storage::Bf16),
        (WeightType::BF16, Storage::F32),
        (WeightType::Mxfp8 { block: 32 }, Storage::F32),
        (WeightType::BF16, Storage::Bf16),
    ];
    let mut compared = 0;
    for (out, inp, rows) in [(150, 1024, 45), (37, 64, 11), (20, 2560, 13)] {
        let dir = tempfile::tempdir().unwrap();
        let kernels: Vec<Kernel> =
            kinds.iter().map(|&(weight, act)| Kernel::Linear(m3c_kernels::Linear { inp, out, weight, act, out_act: act })).collect();
        // x86-64-v3, m3c's default: FMA, as AVX-512 has (x86-64-v2 has none,
        // so its products round on their own).
        let (narrow, _) = build_at(&kernels, HostWidth::Lanes8, "x86-64-v3", dir.path());
        let wide_dir = tempfile::tempdir().unwrap();
        let (wide, ir) = build_at(&kernels, HostWidth::Lanes16, "x86-64-v4", wide_dir.path());
        let fma16 = ir.lines().any(|l| l.contains("fadd contract <16 x float>") || l.contains("@llvm.fma.v16f32"));
        assert!(fma16, "{out}x{inp}: no 16-lane multiply-adds in the 16-lane form");
        if !avx512 {
            continue;
        }
        let wf: Vec<f32> = (0..out * inp).map(|i| ((i * 7919 % 2003) as f32 / 1001.5) - 1.0).collect();
        let w16: Vec<u16> = wf.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
        let w8: Vec<u8> = (0..out * inp).map(|i| (i * 7919 % 251) as u8).map(|b| if b & 0x7F == 0x7F { 0x11 } else { b }).collect();
        let s8: Vec<u8> = (0..out * inp / 32).map(|i| 124 + (i * 31 % 6) as u8).collect();
        let xf = input(rows, inp);
        let xb: Vec<u16> = xf.iter().map(|&v| bf16_nearest_even(v)).collect();
        for (k, &(weight, act)) in kernels.iter().zip(&kinds) {
            let run = |lib: &libloading::Library, n: usize| -> Vec<u32> {
                let (xm32, xm16) = (m2(&xf[..n * inp], n, inp), m2(&xb[..n * inp], n, inp));
                let xp = if act == Storage::F32 { p(&xm32) } else { p(&xm16) };
                let (y32, y16) = (vec![f32::NAN; n * out], vec![0xFFFFu16; n * out]);
                let (ym32, ym16) = (m2(&y32, n, out), m2(&y16, n, out));
                let yp = if act == Storage::F32 { p(&ym32) } else { p(&ym16) };
                let (wm32, wm16, wm8, sm) = (m2(&wf, out, inp), m2(&w16, out, inp), m2(&w8, out, inp), m2(&s8, out, inp / 32));
                // SAFETY: one live descriptor per argument of this kernel, shaped as its params() say.
                with_threads(lib, 2, || unsafe {
                    match weight {
                        WeightType::F32 => call(lib, k, &[xp, p(&wm32), yp]),
                        WeightType::Mxfp8 { .. } => call(lib, k, &[xp, p(&wm8), p(&sm), yp]),
                        _ => call(lib, k, &[xp, p(&wm16), yp]),
                    }
                });
                if act == Storage::F32 {
                    y32.iter().map(|v| v.to_bits()).collect()
                } else {
                    y16.iter().map(|&v| v as u32).collect()
                }
            };
            for n in [1, 2, 3, 5, rows] {
                let (a, b) = (run(&narrow, n), run(&wide, n));
                let first = a.iter().zip(&b).position(|(x, y)| x != y);
                assert!(first.is_none(), "{out}x{inp} {weight:?} {act:?}, {n} rows: output {first:?} differs between 8 and 16 lanes");
                compared += 1;
            }
        }
    }
    assert!(!avx512 || compared == 3 * kinds.len() * 5, "{compared} comparisons");
}

/// The output reduction eight outputs at a time (`hsum8x8`) gives each
/// output the bits of the one-output `hsum`: every output of a 150-output
/// linear (most reduced eight at a time) equals the same weight row run
/// as a linear of its own (one output: reduced alone), f32 and bf16 out.
#[test]
fn outputs_reduced_eight_at_a_time_equal_outputs_reduced_alone() {
    let (out, inp, rows) = (150, 1024, 5);
    let dir = tempfile::tempdir().unwrap();
    let acts = [Storage::F32, Storage::Bf16];
    let lin = |out: usize, act: Storage| Kernel::Linear(m3c_kernels::Linear { inp, out, weight: WeightType::BF16, act, out_act: act });
    let kernels: Vec<Kernel> = acts.iter().flat_map(|&a| [lin(out, a), lin(1, a)]).collect();
    let lib = build(&kernels, dir.path());
    let w: Vec<u16> = (0..out * inp).map(|i| bf16_nearest_even(((i * 7919 % 2003) as f32 / 1001.5) - 1.0)).collect();
    let xf = input(rows, inp);
    let xb: Vec<u16> = xf.iter().map(|&v| bf16_nearest_even(v)).collect();
    for (pair, act) in kernels.chunks(2).zip(acts) {
        // y of `k` over weight rows `o0..o0 + n`, as raw words.
        let run = |k: &Kernel, o0: usize, n: usize| -> Vec<u32> {
            let (xm32, xm16) = (m2(&xf, rows, inp), m2(&xb, rows, inp));
            let (y32, y16) = (vec![f32::NAN; rows * n], vec![0xFFFFu16; rows * n]);
            let (ym32, ym16) = (m2(&y32, rows, n), m2(&y16, rows, n));
            let wm = m2(&w[o0 * inp..(o0 + n) * inp], n, inp);
            let (xp, yp) = if act == Storage::F32 { (p(&xm32), p(&ym32)) } else { (p(&xm16), p(&ym16)) };
            // SAFETY: one live descriptor per argument of this kernel, shaped as its params() say.
            unsafe { call(&lib, k, &[xp, p(&wm), yp]) };
            if act == Storage::F32 {
                y32.iter().map(|v| v.to_bits()).collect()
            } else {
                y16.iter().map(|&v| v as u32).collect()
            }
        };
        let all = run(&pair[0], 0, out);
        for o in 0..out {
            let alone = run(&pair[1], o, 1);
            for r in 0..rows {
                assert_eq!(all[r * out + o], alone[r], "{act:?}: y[{r}, {o}] differs from the output reduced alone");
            }
        }
    }
}

/// Runs `f` with the kernels' OpenMP thread count set to `threads` for
/// this test thread (the setting is per thread, so parallel tests keep
/// theirs), then restores it.
fn with_threads<T>(lib: &libloading::Library, threads: i32, f: impl FnOnce() -> T) -> T {
    // SAFETY: libomp's own entry points, with the C signatures its omp.h declares.
    unsafe {
        let get: libloading::Symbol<unsafe extern "C" fn() -> i32> = lib.get(b"omp_get_max_threads").unwrap();
        let set: libloading::Symbol<unsafe extern "C" fn(i32)> = lib.get(b"omp_set_num_threads").unwrap();
        let before = get();
        set(threads);
        assert_eq!(get(), threads, "omp_set_num_threads took effect");
        let out = f();
        set(before);
        out
    }
}

/// `alone_rows`: the rows computed alone and checked (all when `None`);
/// with `Some`, f32 weights (which have no panel) are left out.
fn linear_rows_alone_and_batched(out: usize, inp: usize, batches: &[usize], alone_rows: Option<&[usize]>) {
    let dir = tempfile::tempdir().unwrap();
    let wf: Vec<f32> = (0..out * inp).map(|i| ((i * 7919 % 2003) as f32 / 1001.5) - 1.0).collect();
    let w32: Vec<f32> = if alone_rows.is_none() { wf.clone() } else { Vec::new() };
    let w16: Vec<u16> = wf.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
    // fp8 bytes other than the NaNs, and scales 2^-3 .. 2^2.
    let w8: Vec<u8> = (0..out * inp).map(|i| (i * 7919 % 251) as u8).map(|b| if b & 0x7F == 0x7F { 0x11 } else { b }).collect();
    let s8: Vec<u8> = (0..out * inp / 32).map(|i| 124 + (i * 31 % 6) as u8).collect();
    let mut kinds: Vec<(WeightType, Storage)> = vec![
        (WeightType::F32, Storage::F32),
        (WeightType::BF16, Storage::F32),
        (WeightType::Mxfp8 { block: 32 }, Storage::F32),
        (WeightType::BF16, Storage::Bf16),
    ];
    if alone_rows.is_some() {
        kinds.retain(|&(weight, _)| weight != WeightType::F32);
    }
    let kernels: Vec<Kernel> =
        kinds.iter().map(|&(weight, act)| Kernel::Linear(m3c_kernels::Linear { inp, out, weight, act, out_act: act })).collect();
    let lib = build(&kernels, dir.path());
    let max_rows = *batches.iter().max().unwrap();
    let all_rows: Vec<usize> = (0..max_rows).collect();
    let alone_rows = alone_rows.unwrap_or(&all_rows);
    let xf = input(max_rows, inp);
    let xb: Vec<u16> = xf.iter().map(|&v| bf16_nearest_even(v)).collect();
    for (k, &(weight, act)) in kernels.iter().zip(&kinds) {
        // y for rows `r0..r0 + n` of the input, as raw 32-bit or 16-bit words.
        let run = |r0: usize, n: usize| -> Vec<u32> {
            let (xm32, xm16) = (m2(&xf[r0 * inp..(r0 + n) * inp], n, inp), m2(&xb[r0 * inp..(r0 + n) * inp], n, inp));
            let xp = if act == Storage::F32 { p(&xm32) } else { p(&xm16) };
            let (y32, y16) = (vec![f32::NAN; n * out], vec![0xFFFFu16; n * out]);
            let (ym32, ym16) = (m2(&y32, n, out), m2(&y16, n, out));
            let yp = if act == Storage::F32 { p(&ym32) } else { p(&ym16) };
            let (wm16, wm8, sm) = (m2(&w16, out, inp), m2(&w8, out, inp), m2(&s8, out, inp / 32));
            // SAFETY: one live descriptor per argument of this kernel, shaped as its params() say.
            unsafe {
                match weight {
                    WeightType::F32 => call(&lib, k, &[xp, p(&m2(&w32, out, inp)), yp]),
                    WeightType::Mxfp8 { .. } => call(&lib, k, &[xp, p(&wm8), p(&sm), yp]),
                    _ => call(&lib, k, &[xp, p(&wm16), yp]),
                }
            }
            if act == Storage::F32 {
                y32.iter().map(|v| v.to_bits()).collect()
            } else {
                y16.iter().map(|&v| v as u32).collect()
            }
        };
        let alone: Vec<(usize, Vec<u32>)> = alone_rows.iter().map(|&r| (r, run(r, 1))).collect();
        for &n in batches {
            // Two threads named, not the default: the test command runs
            // with one (`OMP_NUM_THREADS=1`), and 1, 2 and 3 are all checked.
            let batch = with_threads(&lib, 2, || run(0, n));
            for (r, y) in alone.iter().filter(|(r, _)| *r < n) {
                assert_eq!(&batch[r * out..(r + 1) * out], &y[..], "{weight:?} {act:?}: row {r} of {n} differs from the row alone");
            }
            // K-blocked shapes size their output tiles by the thread count.
            if inp > 1024 {
                for threads in [1, 3] {
                    let other = with_threads(&lib, threads, || run(0, n));
                    assert!(other == batch, "{weight:?} {act:?}: {n} rows on {threads} thread(s) differ from 2 threads");
                }
            }
        }
        // The values: against f64 sums of the decoded weights.
        let wv = |o: usize, i: usize| -> f64 {
            match weight {
                WeightType::F32 => w32[o * inp + i] as f64,
                WeightType::Mxfp8 { .. } => e4m3_to_f32(w8[o * inp + i]) as f64 * e8m0_to_f32(s8[o * (inp / 32) + i / 32]) as f64,
                _ => bf16_to_f32(w16[o * inp + i]) as f64,
            }
        };
        let x = |r: usize, i: usize| if act == Storage::F32 { xf[r * inp + i] } else { bf16_to_f32(xb[r * inp + i]) } as f64;
        let value = |b: u32| if act == Storage::F32 { f32::from_bits(b) } else { bf16_to_f32(b as u16) };
        // Within f32 rounding of the terms' magnitude (long lane sums),
        // plus the output's own rounding when it is stored as bf16. Of the
        // large shape, every 16th output (each output tile has some): the
        // f64 sums are slow in a test build.
        let y_ulp = if act == Storage::F32 { 0.0 } else { 1.0 / 256.0 };
        let o_step = if out * inp > 1 << 24 { 16 } else { 1 };
        for (r, o, g) in alone.iter().flat_map(|(r, y)| (0..out).step_by(o_step).map(move |o| (*r, o, value(y[o])))) {
            let want: f64 = (0..inp).map(|i| x(r, i) * wv(o, i)).sum();
            let mag: f64 = (0..inp).map(|i| (x(r, i) * wv(o, i)).abs()).sum();
            let err = (g as f64 - want).abs();
            assert!(err <= 4e-6 * mag + y_ulp * want.abs(), "{weight:?} {act:?}: y[{r}, {o}] = {g}, want {want} (terms' magnitude {mag})");
        }
    }
}

/// The tiled linear decodes every fp8 byte exactly: output `o` of one row
/// `x = [1, 0, …]` is byte `o` times its block's scale (scales from the
/// smallest, 2^-127, to 2^127), the NaN bytes NaN; at one row (decoded in
/// registers) and at eight (decoded into an f32 panel first).
#[test]
fn tiled_mxfp8_linear_decodes_every_byte_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let (inp, out) = (32, 256);
    let w: Vec<u8> = (0..out * inp).map(|e| if e % inp == 0 { (e / inp) as u8 } else { 0 }).collect();
    let scales = [0u8, 1, 100, 127, 134, 200, 254];
    let s: Vec<u8> = (0..out).map(|o| scales[o % scales.len()]).collect();
    let lin = lin_f32(inp, out, WeightType::Mxfp8 { block: 32 });
    let lib = build(std::slice::from_ref(&lin), dir.path());
    for rows in [1, 8] {
        let x: Vec<f32> = (0..rows * inp).map(|e| if e % inp == 0 { 1.0 } else { 0.0 }).collect();
        let y = vec![0f32; rows * out];
        // SAFETY: one live descriptor per argument (x, w, s, y), shaped as the kernel's params() say.
        unsafe { call(&lib, &lin, &[p(&m2(&x, rows, inp)), p(&m2(&w, out, inp)), p(&m2(&s, out, 1)), p(&m2(&y, rows, out))]) };
        for r in 0..rows {
            for o in 0..out {
                let want = (e4m3_to_f32(o as u8) as f64 * e8m0_to_f32(s[o]) as f64) as f32;
                let got = y[r * out + o];
                if o & 0x7F == 0x7F {
                    assert!(got.is_nan(), "byte {o:#04x} is NaN, got {got}");
                } else {
                    assert_eq!(got, want, "byte {o:#04x} × 2^({} − 127) at {rows} row(s)", s[o]);
                }
            }
        }
    }
}

/// One MSA block choice that hangs on how block scores compare exactly: a
/// query at position 31 over 32 keys in blocks of 8 (blocks 0-2 compete,
/// block 3 is its own), top 2, so exactly one of blocks 0-2 is chosen:
/// `want`. The index query is one constant (0.1, whose products round), so
/// keys whose entries are the same numbers in another order have equal
/// exact scores; every key scores low except one in each of two blocks.
pub(crate) struct TieCase {
    pub name: &'static str,
    pub iq: Vec<f32>,
    pub ik: Vec<f32>,
    pub want: usize,
}

/// A score as the reference computes it: one fused multiply-add chain over
/// the index width in column order, from 0 (what `torch.matmul`'s GEMM
/// gives, checked bit for bit against torch 2.15 for index widths 32 and
/// 128).
pub(crate) fn chain_score(iq: &[f32], ik: &[f32]) -> f32 {
    iq.iter().zip(ik).fold(0f32, |a, (x, y)| x.mul_add(*y, a))
}

/// The chain with each product rounded before it is added (no fused
/// multiply-add).
fn unfused_score(iq: &[f32], ik: &[f32]) -> f32 {
    iq.iter().zip(ik).fold(0f32, |a, (x, y)| a + x * y)
}

/// The same sum in m3c's former order: eight lane chains (column c in lane
/// c mod 8), then the tree ((l0+l4)+(l2+l6))+((l1+l5)+(l3+l7)).
fn lane_tree_score(iq: &[f32], ik: &[f32]) -> f32 {
    let mut l = [0f32; 8];
    for (c, (x, y)) in iq.iter().zip(ik).enumerate() {
        l[c % 8] = x.mul_add(*y, l[c % 8]);
    }
    ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]))
}

/// The tie cases for an index width `dim`: two exact ties (the lower block
/// wins, whichever pair), and, for widths of 8 or more, a rounding tie: two
/// keys whose entries are the same numbers in another order, so their exact
/// sums are equal and only the arithmetic separates them; the reference's
/// fused chain ranks them one way, the lane tree and an unfused chain the
/// other.
pub(crate) fn msa_tie_cases(dim: usize) -> Vec<TieCase> {
    let iq = vec![0.1f32; dim];
    let low = vec![-1f32; dim];
    let hi: Vec<f32> = (0..dim).map(|c| 0.5 + c as f32 * 0.125).collect();
    let with = |keys: &[(usize, &[f32])]| {
        let mut ik: Vec<f32> = (0..32).flat_map(|_| low.clone()).collect();
        for &(t, v) in keys {
            ik[t * dim..(t + 1) * dim].copy_from_slice(v);
        }
        ik
    };
    let mut cases = vec![
        TieCase { name: "exact tie of blocks 1 and 2", iq: iq.clone(), ik: with(&[(9, &hi), (17, &hi)]), want: 1 },
        TieCase { name: "exact tie of blocks 0 and 2", iq: iq.clone(), ik: with(&[(20, &hi), (3, &hi)]), want: 0 },
    ];
    if dim >= 8 {
        // A deterministic search: entries of mixed magnitudes, and
        // permutations of them, until the two orders disagree.
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let found = (0..20_000).find_map(|_| {
            let a: Vec<f32> = (0..dim).map(|_| ((next() % 2001) as f32 - 1000.0) * (2f32).powi((next() % 24) as i32 - 12)).collect();
            let mut b = a.clone();
            for i in (1..dim).rev() {
                b.swap(i, (next() % (i as u64 + 1)) as usize);
            }
            let (ca, cb) = (chain_score(&iq, &a), chain_score(&iq, &b));
            let (ta, tb) = (lane_tree_score(&iq, &a), lane_tree_score(&iq, &b));
            let (ua, ub) = (unfused_score(&iq, &a), unfused_score(&iq, &b));
            // The reference prefers block 2 (b); the lane tree and the
            // unfused chain would keep block 1 (a).
            (cb > ca && ta >= tb && ua >= ub && cb > 0.0).then_some((a, b))
        });
        let (a, b) = found.expect("a pair of keys whose summation orders disagree");
        cases.push(TieCase { name: "rounding tie decided by the reference's order", iq, ik: with(&[(12, &a), (22, &b)]), want: 2 });
    }
    cases
}

/// The blocks an MSA attention output shows as chosen, for the tie cases'
/// values: value column c is 1 on the keys of block c, so with all scores
/// equal (q = 0) output column c is positive exactly when block c was
/// attended.
pub(crate) fn chosen_blocks(o: &[f32]) -> Vec<usize> {
    (0..4).filter(|&c| o[c] > 0.0).collect()
}

/// The tie cases' inputs besides iq and ik: q (zeros; 2 heads of 16), k
/// (zeros; one KV head) and v (block indicators) over 32 keys.
pub(crate) fn tie_qkv() -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let v = (0..32).flat_map(|t| (0..16).map(move |c| if c == t / 8 { 1f32 } else { 0.0 })).collect();
    (vec![0f32; 32], vec![0f32; 32 * 16], v)
}

/// MSA's block choice where block scores tie: exactly (the lower block
/// wins, `../shared/spec/minimax-m3.md` 2.3), or only after rounding (the
/// scores are the reference's fused multiply-add chain, so the block the
/// reference chooses; m3c's former lane-tree scores chose the other). Index
/// widths 8 and 16 (eight keys at a time) and 12 (key by key).
#[test]
fn msa_ties_fall_as_the_reference_breaks_them() {
    use m3c_kernels::SparseSel;
    let dir = tempfile::tempdir().unwrap();
    for dim in [8usize, 16, 12] {
        let sel = SparseSel { index_heads: 1, index_dim: dim, block: 8, topk: 2, local: 1, init: 0 };
        let kernel = Kernel::Attention(m3c_kernels::Attention { sparse: Some(sel), ..attention(2, 1, 16) });
        let lib = build(std::slice::from_ref(&kernel), dir.path());
        let (q, k, v) = tie_qkv();
        let cases = msa_tie_cases(dim);
        assert_eq!(cases.len(), if dim >= 8 { 3 } else { 2 });
        for case in cases {
            let pos = [31i64];
            let o = vec![f32::NAN; 32];
            let (qm, km, vm, posm, om) = (m2(&q, 1, 32), m2(&k, 32, 16), m2(&v, 32, 16), m1(&pos), m2(&o, 1, 32));
            let (iqm, ikm) = (m2(&case.iq, 1, dim), m2(&case.ik, 32, dim));
            // SAFETY: every descriptor views a live buffer of the compiled shape for the whole call.
            unsafe { call(&lib, &kernel, &[p(&qm), p(&km), p(&vm), p(&posm), p(&iqm), p(&ikm), p(&om)]) };
            assert_eq!(chosen_blocks(&o), vec![case.want, 3], "index width {dim}: {}", case.name);
        }
    }
}
