//! `m3c bench-kernels`: the host linear kernels timed alone, beside this
//! machine's measured FMA peak. The kernels are the ones stages run, built
//! by the same back end (MLIR → LLVM at O3 for `--cpu`), linked into a
//! shared library and called through their C interface.

use crate::backend::host;
use crate::compile::link::OMP_DIR;
pub use m3c_kernels::WeightType;
use m3c_kernels::{Kernel, Linear, Storage};
use std::ffi::c_void;
use std::path::Path;
use std::time::{Duration, Instant};

/// Errors of a kernel benchmark.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error(transparent)]
    Backend(#[from] crate::backend::BackendError),
    #[error("{what}: {source}")]
    Io { what: String, source: std::io::Error },
    #[error("`cc -shared` failed to link the benchmark's kernels (exit {0})")]
    Link(String),
    #[error("loading the benchmark's kernels: {0}")]
    Load(String),
}

/// One linear to time: `rows` activation rows through an `out × inp` weight.
#[derive(Debug, Clone, Copy)]
pub struct LinearCase {
    pub out: usize,
    pub inp: usize,
    pub weight: WeightType,
    pub rows: usize,
}

/// What one case measured (the best of several timed runs).
#[derive(Debug, Clone, Copy)]
pub struct LinearTiming {
    pub case: LinearCase,
    pub seconds: f64,
}

impl LinearTiming {
    /// Multiply-adds count two FLOPs.
    pub fn gflops(&self) -> f64 {
        2.0 * (self.case.rows * self.case.inp * self.case.out) as f64 / self.seconds / 1e9
    }
    /// Weight bytes read per second (what bounds a decode step).
    pub fn weight_gbytes(&self) -> f64 {
        let per = match self.case.weight {
            WeightType::F32 => 4.0,
            WeightType::BF16 | WeightType::F16 => 2.0,
            WeightType::Mxfp8 { block } => 1.0 + 1.0 / block as f64,
        };
        per * (self.case.inp * self.case.out) as f64 / self.seconds / 1e9
    }
}

/// A memref descriptor of rank 2 or 1, as MLIR's C interface passes it.
#[repr(C)]
struct Memref<const N: usize> {
    allocated: *const c_void,
    aligned: *const c_void,
    offset: i64,
    sizes: [i64; N],
    strides: [i64; N],
}

fn m2<T>(data: &[T], rows: usize, cols: usize) -> Memref<2> {
    let p = data.as_ptr() as *const c_void;
    Memref { allocated: p, aligned: p, offset: 0, sizes: [rows as i64, cols as i64], strides: [cols as i64, 1] }
}

/// Compiles `mlir` for `cpu` into `dir/NAME.so` and loads it.
fn load(mlir: &str, cpu: &str, dir: &Path, name: &str) -> Result<libloading::Library, BenchError> {
    let art = host::compile(mlir, cpu)?;
    let (obj, so) = (dir.join(format!("{name}.o")), dir.join(format!("{name}.so")));
    std::fs::write(&obj, &art.object).map_err(|source| BenchError::Io { what: obj.display().to_string(), source })?;
    let st = std::process::Command::new("cc")
        .arg("-shared")
        .arg("-o")
        .arg(&so)
        .arg(&obj)
        .arg(format!("-L{OMP_DIR}"))
        .arg(format!("-Wl,-rpath,{OMP_DIR}"))
        .args(["-lomp", "-lm"])
        .status()
        .map_err(|source| BenchError::Io { what: "running cc".into(), source })?;
    if !st.success() {
        return Err(BenchError::Link(st.code().map_or("by a signal".into(), |c| c.to_string())));
    }
    // SAFETY: the library was just linked from m3c's own kernels; loading it runs no foreign initialisers.
    unsafe { libloading::Library::new(&so) }.map_err(|e| BenchError::Load(e.to_string()))
}

/// Calls `f` until `min` has passed (at least 10 times, after one warm-up
/// call) and returns the fastest call's seconds. A shared VM's neighbours
/// take memory bandwidth in bursts of seconds: at 3 calls, the 250 ms
/// 6144 × 6144 case read anywhere from 57 to 76 % of the FMA peak.
fn best_of(min: Duration, mut f: impl FnMut()) -> f64 {
    f();
    let (start, mut best, mut n) = (Instant::now(), f64::INFINITY, 0);
    while n < 10 || start.elapsed() < min {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed().as_secs_f64());
        n += 1;
    }
    best
}

/// Deterministic inputs in [-1, 1).
fn values(n: usize, seed: usize) -> Vec<f32> {
    (0..n).map(|i| ((i.wrapping_mul(7919).wrapping_add(seed) % 2003) as f32 / 1001.5) - 1.0).collect()
}

/// Times each case's linear (f32 activations in and out).
pub fn linears(cases: &[LinearCase], cpu: &str, min: Duration, dir: &Path) -> Result<Vec<LinearTiming>, BenchError> {
    let kernels: Vec<Kernel> = cases
        .iter()
        .map(|c| Kernel::Linear(Linear { inp: c.inp, out: c.out, weight: c.weight, act: Storage::F32, out_act: Storage::F32 }))
        .collect();
    let width = m3c_kernels::HostWidth::of_lanes(crate::backend::widest_f32_lanes(cpu));
    let lib = load(&m3c_kernels::module_at(&kernels, width), cpu, dir, "linears")?;
    let mut out = Vec::new();
    for (case, k) in cases.iter().zip(&kernels) {
        let (rows, inp, o) = (case.rows, case.inp, case.out);
        let x = values(rows * inp, 1);
        let y = vec![0f32; rows * o];
        let wf = values(o * inp, 2);
        let w32: Vec<f32>;
        let w16: Vec<u16>;
        let w8: Vec<u8>;
        let s8: Vec<u8>;
        let (wm, sm) = match case.weight {
            WeightType::F32 => {
                w32 = wf;
                (m2(&w32, o, inp), None)
            }
            WeightType::BF16 | WeightType::F16 => {
                w16 = wf.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
                (m2(&w16, o, inp), None)
            }
            WeightType::Mxfp8 { block } => {
                // fp8 bytes other than the two NaNs; scales near 1.
                w8 = (0..o * inp).map(|i| (i * 7919 % 251) as u8).map(|b| if b & 0x7F == 0x7F { 0x11 } else { b }).collect();
                s8 = (0..o * inp / block).map(|i| 124 + (i % 6) as u8).collect();
                (m2(&w8, o, inp), Some(m2(&s8, o, inp / block)))
            }
        };
        let (xm, ym) = (m2(&x, rows, inp), m2(&y, rows, o));
        type P = *const Memref<2>;
        let name = format!("_mlir_ciface_{}", k.symbol());
        let seconds = match &sm {
            None => {
                // SAFETY: the kernel's C interface takes one descriptor pointer per parameter (x, w, y), as built above.
                let f =
                    unsafe { lib.get::<unsafe extern "C" fn(P, P, P)>(name.as_bytes()) }.map_err(|e| BenchError::Load(e.to_string()))?;
                // SAFETY: the descriptors point at live buffers of the kernel's shapes for the whole call.
                best_of(min, || unsafe { f(&xm, &wm, &ym) })
            }
            Some(s) => {
                // SAFETY: as above, with the scales (x, w, s, y).
                let f =
                    unsafe { lib.get::<unsafe extern "C" fn(P, P, P, P)>(name.as_bytes()) }.map_err(|e| BenchError::Load(e.to_string()))?;
                // SAFETY: the descriptors point at live buffers of the kernel's shapes for the whole call.
                best_of(min, || unsafe { f(&xm, &wm, s, &ym) })
            }
        };
        out.push(LinearTiming { case: *case, seconds });
    }
    Ok(out)
}

/// Independent FMA chains per thread in the peak loop: more than the FMA
/// latency × units of any x86-64 core, so it runs at throughput.
const PEAK_CHAINS: usize = 12;

/// This machine's f32 FMA peak in GFLOP/s on `threads` threads: a loop of
/// [`PEAK_CHAINS`] independent FMA chains of `lanes`-wide vectors in
/// registers, one loop per thread, compiled by the same back end as the
/// kernels for `cpu`.
pub fn fma_peak(cpu: &str, threads: usize, dir: &Path, lanes: usize) -> Result<f64, BenchError> {
    let v = format!("vector<{lanes}xf32>");
    let v = v.as_str();
    let chains = PEAK_CHAINS;
    let inits: Vec<String> = (0..chains).map(|j| format!("%a{j} = %z")).collect();
    let fmas: String = (0..chains).map(|j| format!("        %n{j} = vector.fma %m, %a{j}, %b : {v}\n")).collect();
    let next: Vec<String> = (0..chains).map(|j| format!("%n{j}")).collect();
    let sums: String = (1..chains).map(|j| format!("      %s{j} = arith.addf %s{}, %r#{j} : {v}\n", j - 1)).collect();
    let tys = vec![v; chains].join(", ");
    let mlir = format!(
        "module {{\n\
         \x20 func.func @m3c_fma_peak(%out: memref<?xf32>, %n: index) attributes {{llvm.emit_c_interface}} {{\n\
         \x20   %c0 = arith.constant 0 : index\n\
         \x20   %c1 = arith.constant 1 : index\n\
         \x20   %ct = arith.constant {threads} : index\n\
         \x20   %z = arith.constant dense<0.0> : {v}\n\
         \x20   %m = arith.constant dense<0.5> : {v}\n\
         \x20   %b = arith.constant dense<1.0> : {v}\n\
         \x20   scf.parallel (%t) = (%c0) to (%ct) step (%c1) {{\n\
         \x20     %r:{chains} = scf.for %i = %c0 to %n step %c1 iter_args({}) -> ({tys}) {{\n\
         {fmas}\
         \x20       scf.yield {} : {tys}\n\
         \x20     }}\n\
         \x20     %s0 = arith.addf %r#0, %z : {v}\n\
         {sums}\
         \x20     %e = vector.extract %s{}[0] : f32 from {v}\n\
         \x20     memref.store %e, %out[%t] : memref<?xf32>\n\
         \x20     scf.reduce\n\
         \x20   }}\n\
         \x20   return\n\
         \x20 }}\n\
         }}\n",
        inits.join(", "),
        next.join(", "),
        chains - 1,
    );
    let lib = load(&mlir, cpu, dir, "peak")?;
    let sink = vec![0f32; threads];
    let desc = Memref::<1> { allocated: sink.as_ptr() as _, aligned: sink.as_ptr() as _, offset: 0, sizes: [threads as i64], strides: [1] };
    // SAFETY: the function's C interface takes the descriptor pointer and the trip count.
    let f = unsafe { lib.get::<unsafe extern "C" fn(*const Memref<1>, i64)>(b"_mlir_ciface_m3c_fma_peak") }
        .map_err(|e| BenchError::Load(e.to_string()))?;
    let n: i64 = 20_000_000;
    // SAFETY: `sink` has one element per thread and outlives the call.
    let seconds = best_of(Duration::from_millis(300), || unsafe { f(&desc, n) });
    Ok((threads * chains * lanes * 2) as f64 * n as f64 / seconds / 1e9)
}
